//! The helpers of the parsers: a JSON object's fields read as a type (absent and null being
//! not given), and the errors `invalid_field` and `unknown_field`.

use serde_json::{Map, Value};

use crate::error::{ApiError, ErrorCode};

pub(crate) fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
    ApiError::invalid_field(param, message)
}

pub(crate) fn unknown_field(param: &str, of: &str) -> ApiError {
    ApiError::new(
        ErrorCode::UnknownField,
        format!("{param} is not a field {of} takes"),
    )
    .with_param(param)
}

/// The field's value, unless it is absent or null.
pub(crate) fn given<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

pub(super) fn object<'a>(v: &'a Value, param: &str) -> Result<&'a Map<String, Value>, ApiError> {
    v.as_object()
        .ok_or_else(|| invalid(param, format!("{param} must be an object")))
}

pub(super) fn reject_unknown(
    obj: &Map<String, Value>,
    at: &str,
    known: &[&str],
) -> Result<(), ApiError> {
    match obj.keys().find(|k| !known.contains(&k.as_str())) {
        Some(key) => Err(unknown_field(&format!("{at}.{key}"), at)),
        None => Ok(()),
    }
}

pub(crate) fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, ApiError> {
    opt_bool_at(obj, key, key)
}

pub(super) fn opt_bool_at(
    obj: &Map<String, Value>,
    key: &str,
    param: &str,
) -> Result<Option<bool>, ApiError> {
    match given(obj, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(invalid(param, format!("{param} must be true or false"))),
    }
}

pub(crate) fn opt_str<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
) -> Result<Option<&'a str>, ApiError> {
    opt_str_at(obj, key, key)
}

pub(super) fn opt_str_at<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
    param: &str,
) -> Result<Option<&'a str>, ApiError> {
    match given(obj, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(invalid(param, format!("{param} must be a string"))),
    }
}

pub(super) fn opt_nonempty_str(
    obj: &Map<String, Value>,
    key: &str,
) -> Result<Option<String>, ApiError> {
    match opt_str(obj, key)? {
        Some("") => Err(invalid(key, format!("{key} must not be empty"))),
        s => Ok(s.map(str::to_owned)),
    }
}

pub(crate) fn uint_in(v: &Value, param: &str, min: u64, max: u64) -> Result<u64, ApiError> {
    match v.as_u64() {
        Some(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(invalid(
            param,
            format!("{param} must be an integer from {min} to {max}"),
        )),
    }
}

pub(super) fn port(v: &Value, param: &str) -> Result<u16, ApiError> {
    let n = uint_in(v, param, 1, 65_535)?;
    u16::try_from(n).map_err(|_| invalid(param, format!("{param} must be from 1 to 65535")))
}

pub(super) fn opt_u32(
    obj: &Map<String, Value>,
    key: &str,
    min: u32,
    max: u32,
) -> Result<Option<u32>, ApiError> {
    match given(obj, key) {
        None => Ok(None),
        Some(v) => {
            let n = uint_in(v, key, u64::from(min), u64::from(max))?;
            Ok(Some(
                u32::try_from(n).map_err(|_| invalid(key, "out of range"))?,
            ))
        }
    }
}

pub(crate) fn number_in(
    v: &Value,
    param: &str,
    ok: impl Fn(f64) -> bool,
    what: &str,
) -> Result<f64, ApiError> {
    match v.as_f64() {
        Some(n) if v.is_number() && ok(n) => Ok(n),
        _ => Err(invalid(param, format!("{param} must be {what}"))),
    }
}
