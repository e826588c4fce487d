//! The node's answers that sbx-api has no type of (objects the node writes field by field),
//! typed. Each keeps the keys it does not name in `other`, and each key as it came (absent,
//! null or a value): written back with serde (`--json` of the CLI), an answer is the JSON the
//! node sent, whatever a newer node adds.

use std::collections::BTreeMap;

use sbx_api::{Encoding, SandboxObject, SnapshotObject};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// A key an answer may leave out, give as null or give a value (sbx-api's, which its objects
/// use too).
pub use sbx_api::Field;

/// A list: `{object: "list", data, has_more, next_cursor}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct List<T> {
    pub object: String,
    pub data: Vec<T>,
    /// Whether more follow (`next_cursor` names where); absent in a list that is whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub has_more: Option<bool>,
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub next_cursor: Field<String>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// A sandbox object as the node answers it: [`SandboxObject`], and its `token` where the call
/// gives it (`POST /v1/sandboxes`, `GET /v1/sandboxes/{id}`; the preview URL's key).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Sandbox {
    #[serde(flatten)]
    pub object: SandboxObject,
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub token: Field<String>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

impl std::ops::Deref for Sandbox {
    type Target = SandboxObject;

    fn deref(&self) -> &SandboxObject {
        &self.object
    }
}

/// `POST /v1/sandboxes/{id}/fork`: the snapshot the copies go on from, and the copies.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Fork {
    pub object: String,
    pub snapshot: SnapshotObject,
    pub sandboxes: Vec<Sandbox>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// A piece of a command's output as `GET …/output` (JSON) answers it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputChunk {
    /// `stdout` or `stderr`.
    pub stream: String,
    /// Where its first byte is, counting both streams together.
    pub position: u64,
    /// Text, or base64 (`encoding`).
    pub data: String,
}

/// A range of output no longer kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gap {
    pub from: u64,
    pub to: u64,
}

/// `GET …/exec/{exec_id}/output` without a stream: a page of the output from `from`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OutputPage {
    pub object: String,
    pub exec_id: String,
    pub from: u64,
    /// Where the next page begins.
    pub next: u64,
    /// The oldest position still kept.
    pub start: u64,
    /// The position after the newest byte.
    pub end: u64,
    /// Output from `from` on that is no longer kept.
    pub gap: Option<Gap>,
    /// Whether the command has ended.
    pub exited: bool,
    pub encoding: Encoding,
    pub chunks: Vec<OutputChunk>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// `POST …/exec/{exec_id}/stdin`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StdinWritten {
    pub object: String,
    pub exec_id: String,
    /// Bytes written.
    pub written: u64,
    /// Whether stdin is closed now.
    pub closed: bool,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// `POST …/exec/{exec_id}/signal`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignalSent {
    pub object: String,
    pub exec_id: String,
    /// Its name (`SIGTERM`).
    pub signal: String,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// An entry of a sandbox's files (`…/files/stat`, `…/files/list`): also the answer of mkdir
/// (`created`), rm (`removed`), mv (`src`) in `other`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub object: String,
    pub name: String,
    pub path: String,
    /// `file`, `dir`, `symlink`, `fifo`, `socket`, `char_device`, `block_device`.
    #[serde(rename = "type")]
    pub kind: String,
    pub size: u64,
    /// Octal permission bits, `0644`.
    pub mode: String,
    pub uid: u32,
    pub gid: u32,
    /// RFC 3339.
    pub modified_at: String,
    /// What a symlink points to.
    pub target: Option<String>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

impl FileEntry {
    pub fn is_dir(&self) -> bool {
        self.kind == "dir"
    }

    /// The permission bits, read from `mode`.
    pub fn mode_bits(&self) -> Option<u32> {
        u32::from_str_radix(&self.mode, 8).ok()
    }
}

/// `PUT …/files`: the file written.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileWritten {
    pub bytes_written: u64,
    /// Whether it is new.
    pub created: bool,
    #[serde(flatten)]
    pub entry: FileEntry,
}

/// `GET …/files/list`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileList {
    pub object: String,
    pub path: Option<String>,
    pub entries: Vec<FileEntry>,
    /// Cut at the call's limit.
    pub truncated: bool,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// `POST …/files/chmod`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chmodded {
    pub object: String,
    pub path: Option<String>,
    /// Entries changed.
    pub changed: u64,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// A matching line of `…/files/grep`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrepMatch {
    pub path: String,
    /// 1-based.
    pub line: u64,
    /// 1-based byte column of the first match.
    pub column: u64,
    pub text: String,
    #[serde(default)]
    pub line_truncated: bool,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// `POST …/files/grep`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grepped {
    pub object: String,
    pub matches: Vec<GrepMatch>,
    /// Stopped at `max_matches`.
    pub truncated: bool,
    pub files_scanned: u64,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// A file `…/files/sed` changed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SedFile {
    pub path: String,
    pub replacements: u64,
}

/// `POST …/files/sed`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sedded {
    pub object: String,
    pub files_changed: u64,
    pub files: Vec<SedFile>,
    pub replacements: u64,
    pub files_scanned: u64,
    pub truncated: bool,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// `POST …/files/tar`: a tar stream unpacked.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unpacked {
    pub object: String,
    pub path: String,
    pub entries: u64,
    pub bytes: u64,
    /// Entries left out (kinds a sandbox does not make).
    pub skipped: u64,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// An image of the node (`GET /v1/images`): the base image, or a pulled one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Image {
    pub object: String,
    pub references: Vec<String>,
    /// `sha256:…`; null for the base image.
    pub digest: Option<String>,
    /// Bytes of its layers; null for the base image.
    pub size: Option<u64>,
    pub layers: u64,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// A template of the node (`GET /internal/templates`, `GET /internal/node`'s `templates`,
/// `POST /internal/templates`): `base`, or one built of an image and settings. The base
/// template's object has only key, status, image, vcpus and memory_bytes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Template {
    /// `base`, `img-…`.
    pub key: String,
    /// `ready`, `building`, `failed`.
    pub status: String,
    pub image: String,
    pub vcpus: u32,
    pub memory_bytes: u64,
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub digest: Field<String>,
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub image_pull_secret: Field<String>,
    /// Whether the image's own start command is started.
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub start: Field<bool>,
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub start_command: Field<String>,
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub ready: Field<Value>,
    /// Names of its variables.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<Vec<String>>,
    /// How long its build took.
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub built_ms: Field<u64>,
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub built_by: Field<String>,
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub failure_code: Field<String>,
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub failure: Field<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<String>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// `GET /internal/node`: what the node is and holds. Its shape limits and templates are
/// typed; the rest (capacity, health, network, disk, ...) is in `other` as the node wrote it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub object: String,
    /// The isolation driver.
    pub driver: String,
    pub max_vcpus: u32,
    pub max_memory_bytes: u64,
    pub default_vcpus: u32,
    pub default_memory_bytes: u64,
    pub templates: Vec<Template>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// `DELETE /v1/secrets/{name}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretDeleted {
    pub object: String,
    pub name: String,
    pub deleted: bool,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// A pull's last event: the image the node has now.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pulled {
    /// The reference as the node reads it (`docker.io/library/python:3.12`).
    pub reference: String,
    pub digest: Option<String>,
    pub layers: u64,
    /// Templates of an older image of the reference, forgotten.
    #[serde(default)]
    pub templates_forgotten: u64,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// The text message that ends a terminal: `{"type": "exit", status, exit_code, signal}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TerminalExit {
    /// `exited`, `timed_out`, `killed`.
    pub status: String,
    pub exit_code: Option<i32>,
    pub signal: Option<String>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// The query of `GET /v1/sandboxes`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SandboxQuery {
    /// Only sandboxes in this status (`running`, ...).
    pub status: Option<String>,
    /// At most this many a page (1 to 1000; the node's default: 100).
    pub limit: Option<u32>,
    /// The `next_cursor` of the page before.
    pub cursor: Option<String>,
    /// Only sandboxes with these metadata.
    pub metadata: BTreeMap<String, String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// An answer read and written back is the JSON the node sent.
    fn same<T: serde::de::DeserializeOwned + Serialize>(v: Value) {
        let t: T = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(serde_json::to_value(&t).unwrap(), v);
    }

    #[test]
    fn answers_are_written_back_as_they_came() {
        same::<Template>(
            json!({"key": "base", "status": "ready", "image": "base", "vcpus": 1,
            "memory_bytes": 536870912u64}),
        );
        same::<Template>(
            json!({"key": "img-1", "status": "building", "image": "python",
            "digest": null, "image_pull_secret": null, "start": true, "start_command": null,
            "ready": {"tcp": {"port": 80}}, "env": ["A"], "vcpus": 2, "memory_bytes": 1,
            "built_ms": null, "built_by": "x", "failure_code": null, "failure": null,
            "created_at": "t", "new_key": [1]}),
        );
        same::<List<Image>>(json!({"object": "list", "data": [{"object": "image",
            "references": ["base"], "digest": null, "size": null, "layers": 1}]}));
        same::<FileWritten>(
            json!({"object": "file", "name": "a", "path": "/a", "type": "file",
            "size": 1, "mode": "0644", "uid": 0, "gid": 0, "modified_at": "t", "target": null,
            "bytes_written": 1, "created": true}),
        );
        same::<OutputPage>(
            json!({"object": "output", "exec_id": "exe-1", "from": 0, "next": 3,
            "start": 0, "end": 3, "gap": null, "exited": true, "encoding": "utf8",
            "chunks": [{"stream": "stdout", "position": 0, "data": "hi\n"}]}),
        );
    }
}
