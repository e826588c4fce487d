//! Volumes: directories of the node's disk with a size of their own that outlive sandboxes,
//! mounted at a create's or a run's `volumes` (`[{path, volume, read_only, copy}]`).
//! `POST /v1/volumes`' body ([`parse_volume_create`]) and the volume object.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{ApiError, ErrorCode};

/// The fields `POST /v1/volumes` takes.
pub const VOLUME_FIELDS: &[&str] = &["name", "size_bytes", "shared"];

/// The smallest volume (a filesystem's metadata takes some of it).
pub const MIN_VOLUME_BYTES: u64 = 1 << 20;

/// `POST /v1/volumes`, validated: the size against the node's most is the node's check.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VolumeCreate {
    pub name: Option<String>,
    pub size_bytes: Option<u64>,
    /// Several sandboxes may mount it at once (others: one at a time).
    pub shared: bool,
}

/// The volume object.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeObject {
    pub id: String,
    pub object: String,
    pub name: Option<String>,
    /// Its hard size: a write past it fails in the sandbox.
    pub size_bytes: u64,
    /// What its files take now (as of the disk's last commit, a few seconds at most).
    pub used_bytes: u64,
    pub shared: bool,
    pub created_at: String,
    /// The sandboxes it is mounted in (runs' included).
    pub sandboxes: Vec<String>,
}

/// A volume as the sandbox object shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxVolume {
    /// The volume's id.
    pub volume: String,
    pub path: String,
    pub read_only: bool,
}

/// Parses `POST /v1/volumes`' body (empty: `{}`): 400 invalid_json, unknown_field,
/// invalid_name, invalid_field.
pub fn parse_volume_create(body: &[u8]) -> Result<VolumeCreate, ApiError> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Ok(VolumeCreate::default());
    }
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::new(ErrorCode::InvalidJson, format!("the body is not JSON: {e}")))?;
    let Value::Object(o) = v else {
        return Err(ApiError::new(
            ErrorCode::InvalidJson,
            "the body is not a JSON object",
        ));
    };
    if let Some(k) = o.keys().find(|k| !VOLUME_FIELDS.contains(&k.as_str())) {
        return Err(ApiError::new(
            ErrorCode::UnknownField,
            format!("POST /v1/volumes takes no field {k}"),
        )
        .with_param(k.as_str()));
    }
    let name = match o.get("name") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if crate::valid_name(s) => Some(s.clone()),
        Some(Value::String(s)) => {
            return Err(
                ApiError::new(ErrorCode::InvalidName, format!("{s:?} is not a valid name"))
                    .with_param("name"),
            )
        }
        Some(_) => return Err(ApiError::invalid_field("name", "name must be a string")),
    };
    let size_bytes = match o.get("size_bytes") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(n) if n >= MIN_VOLUME_BYTES => Some(n),
            _ => {
                return Err(ApiError::invalid_field(
                    "size_bytes",
                    format!(
                        "size_bytes must be a whole number of bytes, {MIN_VOLUME_BYTES} or more"
                    ),
                ))
            }
        },
    };
    let shared = match o.get("shared") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid_field(
                "shared",
                "shared must be a boolean",
            ))
        }
    };
    Ok(VolumeCreate {
        name,
        size_bytes,
        shared,
    })
}

impl VolumeCreate {
    /// This create as the JSON body of `POST /v1/volumes` that parses back to it.
    pub fn to_json(&self) -> Value {
        let mut o = serde_json::Map::new();
        if let Some(n) = &self.name {
            o.insert("name".into(), Value::String(n.clone()));
        }
        if let Some(b) = self.size_bytes {
            o.insert("size_bytes".into(), Value::from(b));
        }
        if self.shared {
            o.insert("shared".into(), Value::Bool(true));
        }
        Value::Object(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: &str) -> (ErrorCode, Option<String>) {
        let e = parse_volume_create(body.as_bytes()).expect_err(body);
        (e.code, e.param)
    }

    #[test]
    fn a_volume_create_is_checked() {
        assert_eq!(parse_volume_create(b"").unwrap(), VolumeCreate::default());
        let c = parse_volume_create(br#"{"name": "db", "size_bytes": 1048576, "shared": true}"#)
            .unwrap();
        assert_eq!(c.name.as_deref(), Some("db"));
        assert_eq!(c.size_bytes, Some(1 << 20));
        assert!(c.shared);
        assert_eq!(err("[1]").0, ErrorCode::InvalidJson);
        assert_eq!(err("{").0, ErrorCode::InvalidJson);
        assert_eq!(
            err(r#"{"size": 1}"#),
            (ErrorCode::UnknownField, Some("size".into()))
        );
        assert_eq!(
            err(r#"{"name": "vol-abc"}"#),
            (ErrorCode::InvalidName, Some("name".into()))
        );
        assert_eq!(
            err(r#"{"name": "Bad"}"#),
            (ErrorCode::InvalidName, Some("name".into()))
        );
        assert_eq!(
            err(r#"{"size_bytes": 1024}"#),
            (ErrorCode::InvalidField, Some("size_bytes".into()))
        );
        assert_eq!(
            err(r#"{"size_bytes": -1}"#),
            (ErrorCode::InvalidField, Some("size_bytes".into()))
        );
        assert_eq!(
            err(r#"{"shared": "yes"}"#),
            (ErrorCode::InvalidField, Some("shared".into()))
        );
    }
}
