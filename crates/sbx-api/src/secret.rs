//! Secrets: `PUT /v1/secrets/{name}`'s body ([`parse_secret_put`], [`SecretPut`]) and the
//! secret object ([`SecretObject`]), which never holds the value.
//!
//! A secret is a value the node keeps sealed for the uses it is named in (an image registry's
//! login, `egress.inject`); `allowed_hosts` lists the hosts it may be sent to (`None`: any).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::{ApiError, ErrorCode};

/// The fields `PUT /v1/secrets/{name}` takes.
pub const SECRET_FIELDS: [&str; 2] = ["value", "allowed_hosts"];

/// The longest value a secret may hold, in bytes.
pub const MAX_SECRET_VALUE_BYTES: usize = 64 << 10;

/// The most hosts a secret's `allowed_hosts` may list.
pub const MAX_ALLOWED_HOSTS: usize = 64;

/// `PUT /v1/secrets/{name}`, validated. Its `Debug` does not show the value.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretPut {
    /// 1 byte to 64 KiB of text.
    pub value: String,
    /// Lower-case DNS names or `*.domain` wildcards; `None`: the secret may go anywhere.
    pub allowed_hosts: Option<Vec<String>>,
}

impl std::fmt::Debug for SecretPut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretPut")
            .field("value", &"<redacted>")
            .field("allowed_hosts", &self.allowed_hosts)
            .finish()
    }
}

/// The secret object: its name and where it may go, never its value. Keys in name order (as
/// the API has always written them).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretObject {
    /// `None` (null): any host.
    pub allowed_hosts: Option<Vec<String>>,
    /// RFC 3339, with milliseconds.
    pub created_at: String,
    pub name: String,
    /// Always `"secret"`.
    pub object: String,
    pub updated_at: String,
}

/// `DELETE /v1/secrets/{name}`: the secret that was.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretDeleted {
    /// Always true.
    pub deleted: bool,
    pub name: String,
    /// Always `"secret"`.
    pub object: String,
}

impl SecretDeleted {
    pub fn new(name: &str) -> SecretDeleted {
        SecretDeleted {
            deleted: true,
            name: name.to_string(),
            object: "secret".into(),
        }
    }
}

/// A host of `allowed_hosts`: a DNS name (`registry.example.com`, `docker.io`) or a wildcard of
/// its subdomains (`*.example.com`); no scheme, port or path.
pub fn valid_host_pattern(s: &str) -> bool {
    let host = s.strip_prefix("*.").unwrap_or(s);
    !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|label| {
            let b = label.as_bytes();
            !b.is_empty()
                && b.len() <= 63
                && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'-')
                && b[0] != b'-'
                && b[b.len() - 1] != b'-'
        })
}

/// `allowed_hosts` as given (absent or null: `None`), lower-cased, a host repeated in a row
/// listed once; 400 invalid_field naming the entry at fault.
pub fn parse_allowed_hosts(v: Option<&Value>) -> Result<Option<Vec<String>>, ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let Some(list) = v.as_array() else {
        return Err(ApiError::invalid_field(
            "allowed_hosts",
            "allowed_hosts must be an array of hosts or null",
        ));
    };
    if list.len() > MAX_ALLOWED_HOSTS {
        return Err(ApiError::invalid_field(
            "allowed_hosts",
            format!("allowed_hosts may list at most {MAX_ALLOWED_HOSTS} hosts"),
        ));
    }
    let mut hosts = Vec::with_capacity(list.len());
    for (i, h) in list.iter().enumerate() {
        match h.as_str() {
            Some(s) if valid_host_pattern(s) => hosts.push(s.to_ascii_lowercase()),
            _ => {
                return Err(ApiError::invalid_field(
                    format!("allowed_hosts[{i}]"),
                    "a host is a DNS name (registry.example.com) or a wildcard of its subdomains \
                     (*.example.com), without scheme, port or path",
                ))
            }
        }
    }
    hosts.dedup();
    Ok(Some(hosts))
}

/// Parses the body of `PUT /v1/secrets/{name}`: `{value, allowed_hosts?}`. Messages never
/// quote the body (it holds the value).
pub fn parse_secret_put(body: &[u8]) -> Result<SecretPut, ApiError> {
    // serde_json's messages may quote the input: only where it failed is said.
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            ErrorCode::InvalidJson,
            format!(
                "the body is not a JSON object (line {}, column {})",
                e.line(),
                e.column()
            ),
        )
    })?;
    let Some(obj) = v.as_object() else {
        return Err(ApiError::new(
            ErrorCode::InvalidJson,
            "the body is not a JSON object",
        ));
    };
    if let Some(k) = obj.keys().find(|k| !SECRET_FIELDS.contains(&k.as_str())) {
        return Err(ApiError::new(
            ErrorCode::UnknownField,
            format!("{k} is not a field this call takes"),
        )
        .with_param(k.clone()));
    }
    let value = match obj.get("value") {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid_field("value", "value is required"))
        }
        Some(Value::String(s)) => s,
        Some(_) => return Err(ApiError::invalid_field("value", "value must be a string")),
    };
    if value.is_empty() || value.len() > MAX_SECRET_VALUE_BYTES {
        return Err(ApiError::invalid_field(
            "value",
            "value must be 1 byte to 64 KiB of text",
        ));
    }
    Ok(SecretPut {
        value: value.clone(),
        allowed_hosts: parse_allowed_hosts(obj.get("allowed_hosts"))?,
    })
}

impl SecretPut {
    /// This secret as the JSON body of `PUT /v1/secrets/{name}` that parses back to it.
    pub fn to_json(&self) -> Value {
        let mut o = Map::new();
        o.insert("value".into(), Value::String(self.value.clone()));
        if let Some(h) = &self.allowed_hosts {
            o.insert("allowed_hosts".into(), h.clone().into());
        }
        Value::Object(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: &str) -> (ErrorCode, Option<String>) {
        let e = parse_secret_put(body.as_bytes()).expect_err(body);
        (e.code, e.param)
    }

    #[test]
    fn a_secret_put_is_checked() {
        let p = parse_secret_put(
            br#"{"value": "u:p", "allowed_hosts": ["Docker.io", "docker.io", "*.example.com"]}"#,
        )
        .unwrap();
        assert_eq!(p.value, "u:p");
        assert_eq!(
            p.allowed_hosts.as_deref(),
            Some(&["docker.io".to_string(), "*.example.com".to_string()][..])
        );
        assert_eq!(
            parse_secret_put(&serde_json::to_vec(&p.to_json()).unwrap()),
            Ok(p.clone())
        );
        assert!(!format!("{p:?}").contains("u:p"));
        assert_eq!(err("[1]").0, ErrorCode::InvalidJson);
        assert_eq!(
            err(r#"{"value": "x", "v": 1}"#),
            (ErrorCode::UnknownField, Some("v".into()))
        );
        assert_eq!(err("{}"), (ErrorCode::InvalidField, Some("value".into())));
        assert_eq!(
            err(r#"{"value": ""}"#),
            (ErrorCode::InvalidField, Some("value".into()))
        );
        assert_eq!(
            err(r#"{"value": "x", "allowed_hosts": ["https://a.com"]}"#),
            (ErrorCode::InvalidField, Some("allowed_hosts[0]".into()))
        );
        // The message of a body that is not JSON never quotes it.
        let e = parse_secret_put(br#"{"value": "hunter2"#).unwrap_err();
        assert!(!e.message.contains("hunter2"), "{}", e.message);
    }

    #[test]
    fn host_patterns_are_names_or_wildcards_of_subdomains() {
        assert!(valid_host_pattern("*.example.com"));
        assert!(valid_host_pattern("localhost"));
        for bad in [
            "",
            "*.",
            "a..b",
            "-a.com",
            "a.com:5000",
            "https://a.com",
            "*",
            "a*.com",
        ] {
            assert!(!valid_host_pattern(bad), "{bad}");
        }
    }
}
