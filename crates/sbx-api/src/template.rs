//! Templates on the wire: the template object (`GET /internal/templates`, `POST
//! /internal/templates`, `GET /internal/node`'s `templates`).

use serde::{Deserialize, Serialize};

use crate::Field;

/// A template's ready check as its object shows it: `{"command": "…"}` (the command as text),
/// `{"tcp": {"port"}}` or `{"http": {"path", "port"}}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TemplateReady {
    Command(String),
    Tcp { port: u16 },
    Http { path: String, port: u16 },
}

/// A template: `base` (key, status, image, vcpus and memory_bytes only), or one built of an
/// image and its settings (every key, null where it has nothing). Keys in name order (as the
/// API has always written them).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateObject {
    /// The sandbox that built it.
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub built_by: Field<String>,
    /// How long its build took.
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub built_ms: Field<u64>,
    /// RFC 3339, with milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<String>,
    /// The image's manifest digest (a pulled image), once built.
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub digest: Field<String>,
    /// The names of the variables its start command sees.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub failure: Field<String>,
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub failure_code: Field<String>,
    pub image: String,
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub image_pull_secret: Field<String>,
    /// `base`, or `img-` and 16 characters.
    pub key: String,
    pub memory_bytes: u64,
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub ready: Field<TemplateReady>,
    /// Whether the image's own start command is started (null: as its labels say).
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub start: Field<bool>,
    /// As text.
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub start_command: Field<String>,
    /// `building`, `ready` or `failed`.
    pub status: String,
    pub vcpus: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    #[test]
    fn the_base_template_has_five_keys_and_a_built_one_all() {
        let base = TemplateObject {
            built_by: Field::Absent,
            built_ms: Field::Absent,
            created_at: None,
            digest: Field::Absent,
            env: None,
            failure: Field::Absent,
            failure_code: Field::Absent,
            image: "base".into(),
            image_pull_secret: Field::Absent,
            key: "base".into(),
            memory_bytes: 1 << 30,
            ready: Field::Absent,
            start: Field::Absent,
            start_command: Field::Absent,
            status: "ready".into(),
            vcpus: 1,
        };
        assert_eq!(
            serde_json::to_value(&base).unwrap(),
            json!({"key": "base", "status": "ready", "image": "base", "vcpus": 1,
                   "memory_bytes": 1 << 30})
        );
        let built = TemplateObject {
            built_by: Field::Value("sbx-1".into()),
            built_ms: Field::Value(12),
            created_at: Some("2023-11-14T22:13:20.123Z".into()),
            digest: Field::Null,
            env: Some(vec!["A".into()]),
            failure: Field::Null,
            failure_code: Field::Null,
            image_pull_secret: Field::Null,
            key: "img-x".into(),
            ready: Field::Value(TemplateReady::Http {
                path: "/".into(),
                port: 80,
            }),
            start: Field::Null,
            start_command: Field::Value("sleep 1".into()),
            status: "building".into(),
            ..base
        };
        let text = serde_json::to_string(&built).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap();
        // Written as a JSON object of sorted keys writes it.
        assert_eq!(serde_json::to_string(&v).unwrap(), text);
        assert_eq!(v["ready"], json!({"http": {"path": "/", "port": 80}}));
        assert_eq!(v["digest"], Value::Null);
        let c = serde_json::to_value(TemplateReady::Command("true".into())).unwrap();
        assert_eq!(c, json!({"command": "true"}));
        assert_eq!(serde_json::from_value::<TemplateObject>(v).unwrap(), built);
    }
}
