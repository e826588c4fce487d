//! The parsers and checks of the other fields of a `POST /v1/run` body: egress, runtime,
//! image, name, limits, env, metadata, volumes, ports, hostname, wake_daily_at.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::error::{ApiError, ErrorCode};
use crate::ids::{valid_name, RESERVED_NAME_PREFIXES};

use super::json::{
    given, invalid, object, opt_bool_at, port, reject_unknown, uint_in, unknown_field,
};
use super::limits::{
    MAX_HOSTNAME_LEN, MAX_IMAGE_LEN, MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS,
    MAX_METADATA_VALUE_CHARS, MAX_VCPUS, MEMORY_STEP_BYTES, MIN_MEMORY_BYTES,
};
use super::types::{Limits, VolumeMount};

pub(super) fn check_egress(v: &Value) -> Result<Value, ApiError> {
    crate::egress::Egress::parse(v)?;
    Ok(v.clone())
}

/// `runtime`, checked ([`super::runtime::Runtime::parse`]) and kept in its canonical form.
pub(super) fn check_runtime(v: &Value) -> Result<Value, ApiError> {
    Ok(super::runtime::Runtime::parse(v)?.to_value())
}

pub(super) fn check_image(s: &str) -> Result<String, ApiError> {
    if s.is_empty()
        || s.len() > MAX_IMAGE_LEN
        || s.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(ApiError::new(
            ErrorCode::InvalidImage,
            "image must be an image reference of 1 to 512 characters, without spaces",
        )
        .with_param("image"));
    }
    Ok(s.to_owned())
}

pub(crate) fn check_name(s: &str) -> Result<String, ApiError> {
    if valid_name(s) {
        return Ok(s.to_owned());
    }
    let msg = if RESERVED_NAME_PREFIXES.iter().any(|p| s.starts_with(p)) {
        "name may not start with an id prefix (sbx-, exe-, snap-, vol-, evt-, req-)"
    } else {
        "name must be 1 to 63 lower-case letters, digits and hyphens, not starting or ending with a hyphen"
    };
    Err(ApiError::new(ErrorCode::InvalidName, msg).with_param("name"))
}

pub(super) fn parse_limits(v: &Value) -> Result<Limits, ApiError> {
    let obj = object(v, "limits")?;
    if let Some(key) = obj
        .keys()
        .find(|k| !["vcpus", "memory_bytes", "disk_bytes"].contains(&k.as_str()))
    {
        return Err(unknown_field(&format!("limits.{key}"), "limits"));
    }
    if obj.contains_key("disk_bytes") {
        return Err(invalid(
            "limits.disk_bytes",
            "the disk's size is the node's: limits.disk_bytes cannot be set",
        ));
    }
    let vcpus = match given(obj, "vcpus") {
        None => None,
        Some(v) => {
            let n = uint_in(v, "limits.vcpus", 1, u64::from(MAX_VCPUS))?;
            Some(u32::try_from(n).map_err(|_| invalid("limits.vcpus", "out of range"))?)
        }
    };
    let memory_bytes = match given(obj, "memory_bytes") {
        None => None,
        Some(v) => Some(v.as_u64().ok_or_else(memory_error)?),
    };
    let limits = Limits {
        vcpus,
        memory_bytes,
    };
    check_limits(&limits)?;
    Ok(limits)
}

fn memory_error() -> ApiError {
    invalid(
        "limits.memory_bytes",
        "limits.memory_bytes must be at least 134217728 (128 MiB) and an even number of MiB",
    )
}

/// The ranges of a shape: 1 to [`MAX_VCPUS`] vCPUs, memory of at least 128 MiB in whole 2 MiB.
pub(crate) fn check_limits(l: &Limits) -> Result<(), ApiError> {
    if l.vcpus.is_some_and(|v| !(1..=MAX_VCPUS).contains(&v)) {
        return Err(invalid(
            "limits.vcpus",
            format!("limits.vcpus must be an integer from 1 to {MAX_VCPUS}"),
        ));
    }
    if l.memory_bytes
        .is_some_and(|n| n < MIN_MEMORY_BYTES || n % MEMORY_STEP_BYTES != 0)
    {
        return Err(memory_error());
    }
    Ok(())
}

pub(crate) fn parse_env(v: &Value, field: &str) -> Result<BTreeMap<String, String>, ApiError> {
    let obj = object(v, field)?;
    let mut out = BTreeMap::new();
    for (key, val) in obj {
        let Value::String(s) = val else {
            return Err(env_error(field, key, "must be a string"));
        };
        check_env_entry(field, key, s)?;
        out.insert(key.clone(), s.clone());
    }
    Ok(out)
}

fn env_error(field: &str, key: &str, msg: &str) -> ApiError {
    let param = format!("{field}.{key}");
    ApiError::new(ErrorCode::InvalidEnv, format!("{param} {msg}")).with_param(&param)
}

/// The rules of one variable of `field` (env, secret_env): a name without `=` or NUL, a value
/// without NUL.
fn check_env_entry(field: &str, key: &str, val: &str) -> Result<(), ApiError> {
    if key.is_empty() {
        return Err(env_error(field, key, "has an empty name"));
    }
    if key.contains('=') || key.contains('\0') {
        return Err(env_error(field, key, "has a name with = or a NUL byte"));
    }
    if val.contains('\0') {
        return Err(env_error(field, key, "has a NUL byte"));
    }
    Ok(())
}

/// [`parse_env`]'s rules for a map built by type.
pub(crate) fn check_env(env: &BTreeMap<String, String>, field: &str) -> Result<(), ApiError> {
    env.iter()
        .try_for_each(|(k, v)| check_env_entry(field, k, v))
}

pub(super) fn parse_metadata(v: &Value) -> Result<BTreeMap<String, String>, ApiError> {
    let obj = object(v, "metadata")?;
    let bad =
        |param: &str, msg: String| ApiError::new(ErrorCode::InvalidMetadata, msg).with_param(param);
    if obj.len() > MAX_METADATA_KEYS {
        return Err(bad("metadata", "metadata has more than 64 keys".to_owned()));
    }
    let mut out = BTreeMap::new();
    for (key, val) in obj {
        let param = format!("metadata.{key}");
        if !(1..=MAX_METADATA_KEY_CHARS).contains(&key.chars().count()) {
            return Err(bad(
                &param,
                "metadata keys must be 1 to 64 characters".to_owned(),
            ));
        }
        match val {
            Value::String(s) if s.chars().count() <= MAX_METADATA_VALUE_CHARS => {
                out.insert(key.clone(), s.clone());
            }
            Value::String(_) => {
                return Err(bad(&param, format!("{param} is over 1024 characters")))
            }
            _ => return Err(bad(&param, format!("{param} must be a string"))),
        }
    }
    Ok(out)
}

pub(super) fn parse_volumes(v: &Value) -> Result<Vec<VolumeMount>, ApiError> {
    let Value::Array(items) = v else {
        return Err(invalid("volumes", "volumes must be an array"));
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = format!("volumes[{i}]");
        let obj = object(item, &at)?;
        reject_unknown(
            obj,
            &at,
            &["path", "volume", "read_only", "copy", "version"],
        )?;
        let path_param = format!("{at}.path");
        let path = match given(obj, "path") {
            Some(Value::String(p)) => p,
            Some(_) => {
                return Err(invalid(
                    &path_param,
                    format!("{path_param} must be a string"),
                ))
            }
            None => return Err(invalid(&path_param, format!("{path_param} is required"))),
        };
        if !valid_mount_path(path) {
            return Err(ApiError::new(
                ErrorCode::InvalidPath,
                format!("{path_param} must be an absolute path other than /"),
            )
            .with_param(path_param));
        }
        let volume_param = format!("{at}.volume");
        let volume = match given(obj, "volume") {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            Some(_) => {
                return Err(invalid(
                    &volume_param,
                    format!("{volume_param} must be a volume's id or name"),
                ))
            }
            None => {
                return Err(invalid(
                    &volume_param,
                    format!("{volume_param} is required"),
                ))
            }
        };
        let read_only = opt_bool_at(obj, "read_only", &format!("{at}.read_only"))?.unwrap_or(false);
        let copy = opt_bool_at(obj, "copy", &format!("{at}.copy"))?.unwrap_or(false);
        let version = match given(obj, "version") {
            Some(v) if !v.is_object() => {
                let p = format!("{at}.version");
                return Err(invalid(&p, format!("{p} must be an object or null")));
            }
            v => v.cloned(),
        };
        out.push(VolumeMount {
            path: path.clone(),
            volume,
            read_only,
            copy,
            version,
        });
    }
    Ok(out)
}

/// Absolute, not `/` (however written), no `.` or `..` part, no NUL.
fn valid_mount_path(p: &str) -> bool {
    p.starts_with('/')
        && !p.contains('\0')
        && p.split('/').any(|part| !part.is_empty())
        && p.split('/').all(|part| part != "." && part != "..")
}

pub(super) fn parse_ports(v: &Value, field: &str) -> Result<Vec<u16>, ApiError> {
    let Value::Array(items) = v else {
        return Err(invalid(field, format!("{field} must be an array of ports")));
    };
    let mut out: Vec<u16> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let p = port(item, &format!("{field}[{i}]"))?;
        if !out.contains(&p) {
            out.push(p);
        }
    }
    Ok(out)
}

pub(super) fn valid_hostname(s: &str) -> bool {
    let label_ok = |l: &str| {
        let b = l.as_bytes();
        let edge = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
        b.first().is_some_and(edge)
            && b.last().is_some_and(edge)
            && b.iter().all(|c| edge(c) || *c == b'-')
    };
    !s.is_empty() && s.len() <= MAX_HOSTNAME_LEN && s.split('.').all(label_ok)
}

/// `^([01][0-9]|2[0-3]):[0-5][0-9]$`
pub(super) fn valid_time_of_day(s: &str) -> bool {
    match s.as_bytes() {
        [h1, h2, b':', m1, m2] => {
            let hour_ok = matches!((h1, h2), (b'0'..=b'1', b'0'..=b'9') | (b'2', b'0'..=b'3'));
            hour_ok && matches!(m1, b'0'..=b'5') && m2.is_ascii_digit()
        }
        _ => false,
    }
}
