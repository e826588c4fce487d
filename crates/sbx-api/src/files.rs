//! A sandbox's files on the wire: the parameters of `/v1/sandboxes/{id}/files…` and of the
//! functions interface's `sandbox::fs::*` ([`FsParams`], the same for both), the operations
//! they ask for ([`FsCall`] -> [`FsRequest`], [`WriteRequest`], [`UnpackRequest`]), and the
//! objects both answer with ([`FileObject`], [`FsObject`]).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::{ApiError, ErrorCode};

/// 400 fs_invalid naming `param`.
pub fn fs_invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::FsInvalid, message).with_param(param)
}

/// Permission bits, octal: "0644", "644", "0o644" (at most 0o7777).
pub fn parse_mode(s: &str) -> Option<u32> {
    let t = s.trim();
    let t = t.strip_prefix("0o").unwrap_or(t);
    if t.is_empty() || t.len() > 5 || !t.bytes().all(|b| (b'0'..=b'7').contains(&b)) {
        return None;
    }
    u32::from_str_radix(t, 8).ok().filter(|m| *m <= 0o7777)
}

/// A file operation's parameters by name: an HTTP call's query and JSON body, or a function's
/// payload. Query values are strings; the getters read a number or a boolean from either form.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FsParams {
    map: HashMap<String, Value>,
}

impl FsParams {
    /// The parameters of a query's `pairs` and a JSON object body; `known`: the names the
    /// call takes (any other is refused, 400 fs_invalid).
    pub fn new(
        pairs: Vec<(String, String)>,
        body: Option<Map<String, Value>>,
        known: &[&str],
    ) -> Result<FsParams, ApiError> {
        let mut map: HashMap<String, Value> = HashMap::new();
        for (k, v) in pairs {
            let list = k == "include" || k == "exclude";
            match map.get_mut(&k) {
                Some(Value::Array(a)) if list => a.push(Value::String(v)),
                Some(_) => return Err(fs_invalid(&k, format!("{k} is given twice"))),
                None if list => {
                    map.insert(k, Value::Array(vec![Value::String(v)]));
                }
                None => {
                    map.insert(k, Value::String(v));
                }
            }
        }
        for (k, v) in body.unwrap_or_default() {
            if map.contains_key(&k) {
                return Err(fs_invalid(
                    &k,
                    format!("{k} is given in both the query and the body"),
                ));
            }
            map.insert(k, v);
        }
        if let Some(k) = map.keys().find(|k| !known.contains(&k.as_str())) {
            return Err(fs_invalid(k, format!("this call takes no parameter {k}")));
        }
        Ok(FsParams { map })
    }

    /// The parameters of a function's payload (whose names the function has checked).
    pub fn from_payload(map: Map<String, Value>) -> FsParams {
        FsParams {
            map: map.into_iter().collect(),
        }
    }

    pub fn str(&self, k: &str) -> Result<Option<String>, ApiError> {
        match self.map.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(Value::Number(n)) => Ok(Some(n.to_string())),
            Some(_) => Err(fs_invalid(k, format!("{k} must be a string"))),
        }
    }

    /// `owner`: a name, a uid or uid:gid; numbers a sandbox has no id for are refused here
    /// (the agent looks names up).
    pub fn owner(&self) -> Result<Option<String>, ApiError> {
        let owner = self.str("owner")?;
        match owner {
            Some(o) if !crate::run::user_ids_in_range(&o) => Err(fs_invalid(
                "owner",
                format!(
                    "{o} is not a user of the sandbox (its ids go from 0 to {})",
                    crate::run::MAX_SANDBOX_ID
                ),
            )),
            o => Ok(o),
        }
    }

    pub fn required(&self, k: &str) -> Result<String, ApiError> {
        match self.str(k)? {
            Some(s) if !s.is_empty() => Ok(s),
            _ => Err(fs_invalid(k, format!("{k} is required"))),
        }
    }

    pub fn path(&self) -> Result<String, ApiError> {
        self.required("path")
    }

    pub fn bool(&self, k: &str, default: bool) -> Result<bool, ApiError> {
        match self.map.get(k) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(Value::String(s)) => match s.as_str() {
                "" | "true" | "1" | "yes" => Ok(true),
                "false" | "0" | "no" => Ok(false),
                _ => Err(fs_invalid(k, format!("{k} must be true or false"))),
            },
            Some(_) => Err(fs_invalid(k, format!("{k} must be true or false"))),
        }
    }

    pub fn u64(&self, k: &str, max: u64) -> Result<Option<u64>, ApiError> {
        let bad = || fs_invalid(k, format!("{k} must be a whole number from 0 to {max}"));
        let n = match self.map.get(k) {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::Number(n)) => n.as_u64().ok_or_else(bad)?,
            Some(Value::String(s)) => s.trim().parse::<u64>().map_err(|_| bad())?,
            Some(_) => return Err(bad()),
        };
        if n > max {
            return Err(bad());
        }
        Ok(Some(n))
    }

    /// Permission bits, octal: "0644", "644", "0o644" (a JSON number's digits are read as
    /// octal too: 644).
    pub fn mode(&self, k: &str) -> Result<Option<u32>, ApiError> {
        let Some(s) = self.str(k)? else {
            return Ok(None);
        };
        parse_mode(&s)
            .map(Some)
            .ok_or_else(|| fs_invalid(k, format!("{k} must be octal permission bits such as 0644")))
    }

    pub fn list(&self, k: &str) -> Result<Vec<String>, ApiError> {
        let bad = || fs_invalid(k, format!("{k} must be a glob or a list of globs"));
        match self.map.get(k) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::String(s)) => Ok(vec![s.clone()]),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_str().map(String::from).ok_or_else(bad))
                .collect(),
            Some(_) => Err(bad()),
        }
    }
}

/// A file operation without a body (the body-less calls of `…/files/*` and `sandbox::fs::*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsCall {
    List,
    Stat,
    Mkdir,
    Remove,
    Move,
    Chmod,
    Grep,
    Sed,
}

/// What to search for, and where (`…/files/grep`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrepRequest {
    pub path: String,
    pub pattern: String,
    /// The pattern is text, not a regular expression.
    pub literal: bool,
    /// Into subdirectories (else only the files of `path` itself).
    pub recursive: bool,
    pub ignore_case: bool,
    /// Globs a file must match.
    pub include: Vec<String>,
    /// Globs of files to leave out.
    pub exclude: Vec<String>,
    /// Stop after this many matching lines.
    pub max_matches: u64,
    /// Cut each line answered to this many bytes.
    pub max_line_bytes: u32,
}

/// What to replace, with what, and where (`…/files/sed`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SedRequest {
    pub path: String,
    pub pattern: String,
    pub replacement: String,
    pub literal: bool,
    /// Only the first match of each file.
    pub first_only: bool,
    pub ignore_case: bool,
    pub recursive: bool,
    pub include: Vec<String>,
    pub exclude: Vec<String>,
}

/// A body-less file operation, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FsRequest {
    /// A directory's entries (at most `limit`).
    List {
        path: String,
        limit: Option<u32>,
    },
    Stat {
        path: String,
    },
    Mkdir {
        path: String,
        parents: bool,
        mode: Option<u32>,
        owner: Option<String>,
    },
    Remove {
        path: String,
        recursive: bool,
    },
    Move {
        src: String,
        dst: String,
        overwrite: bool,
    },
    Chmod {
        path: String,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        recursive: bool,
    },
    Grep(GrepRequest),
    Sed(SedRequest),
}

impl FsCall {
    /// The parameters the call takes.
    pub fn fields(self) -> &'static [&'static str] {
        match self {
            FsCall::List => &["path", "limit"],
            FsCall::Stat => &["path"],
            FsCall::Mkdir => &["path", "parents", "mode", "owner"],
            FsCall::Remove => &["path", "recursive"],
            FsCall::Move => &["path", "dst", "overwrite"],
            FsCall::Chmod => &["path", "mode", "uid", "gid", "recursive"],
            FsCall::Grep => &[
                "path",
                "pattern",
                "literal",
                "recursive",
                "ignore_case",
                "include",
                "exclude",
                "max_matches",
                "max_line_bytes",
            ],
            FsCall::Sed => &[
                "path",
                "pattern",
                "replacement",
                "literal",
                "first_only",
                "ignore_case",
                "recursive",
                "include",
                "exclude",
            ],
        }
    }

    /// The operation of these parameters (400 fs_invalid naming the one at fault).
    pub fn request(self, p: &FsParams) -> Result<FsRequest, ApiError> {
        Ok(match self {
            FsCall::List => FsRequest::List {
                path: p.path()?,
                limit: p.u64("limit", 10_000)?.map(|l| l.max(1) as u32),
            },
            FsCall::Stat => FsRequest::Stat { path: p.path()? },
            FsCall::Mkdir => FsRequest::Mkdir {
                path: p.path()?,
                parents: p.bool("parents", false)?,
                mode: p.mode("mode")?,
                owner: p.owner()?,
            },
            FsCall::Remove => FsRequest::Remove {
                path: p.path()?,
                recursive: p.bool("recursive", false)?,
            },
            FsCall::Move => FsRequest::Move {
                src: p.path()?,
                dst: p.required("dst")?,
                overwrite: p.bool("overwrite", false)?,
            },
            FsCall::Chmod => {
                let id_max = u64::from(u32::MAX - 1);
                FsRequest::Chmod {
                    path: p.path()?,
                    mode: p.mode("mode")?,
                    uid: p.u64("uid", id_max)?.map(|v| v as u32),
                    gid: p.u64("gid", id_max)?.map(|v| v as u32),
                    recursive: p.bool("recursive", false)?,
                }
            }
            FsCall::Grep => FsRequest::Grep(GrepRequest {
                path: p.path()?,
                pattern: p.required("pattern")?,
                literal: p.bool("literal", false)?,
                recursive: p.bool("recursive", true)?,
                ignore_case: p.bool("ignore_case", false)?,
                include: p.list("include")?,
                exclude: p.list("exclude")?,
                max_matches: p.u64("max_matches", 100_000)?.unwrap_or(1000).max(1),
                max_line_bytes: p.u64("max_line_bytes", 1 << 20)?.unwrap_or(4096).max(1) as u32,
            }),
            FsCall::Sed => FsRequest::Sed(SedRequest {
                path: p.path()?,
                pattern: p.required("pattern")?,
                replacement: p
                    .str("replacement")?
                    .ok_or_else(|| fs_invalid("replacement", "replacement is required"))?,
                literal: p.bool("literal", false)?,
                first_only: p.bool("first_only", false)?,
                ignore_case: p.bool("ignore_case", false)?,
                recursive: p.bool("recursive", true)?,
                include: p.list("include")?,
                exclude: p.list("exclude")?,
            }),
        })
    }
}

/// The parameters of an upload (`PUT …/files`, `sandbox::fs::write`).
pub const WRITE_FIELDS: &[&str] = &["path", "mode", "parents", "owner"];

/// An upload: where the bytes go, and how the file is made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteRequest {
    pub path: String,
    /// Permission bits; default: the replaced file's, or 0644.
    pub mode: Option<u32>,
    /// Makes missing parent directories.
    pub parents: bool,
    /// Owner; default: the replaced file's, or the sandbox's user.
    pub owner: Option<String>,
}

impl WriteRequest {
    /// The upload of these parameters ([`WRITE_FIELDS`]).
    pub fn parse(p: &FsParams) -> Result<WriteRequest, ApiError> {
        Ok(WriteRequest {
            path: p.path()?,
            mode: p.mode("mode")?,
            parents: p.bool("parents", false)?,
            owner: p.owner()?,
        })
    }
}

/// The parameters of a tar stream unpacked (`POST …/files/tar`).
pub const UNPACK_FIELDS: &[&str] = &["path", "parents", "owner", "preserve_owners"];

/// A tar stream unpacked into the directory `path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnpackRequest {
    pub path: String,
    /// Makes `path` and its missing parents (default true).
    pub parents: bool,
    /// Owner of everything unpacked; default: the sandbox's user.
    pub owner: Option<String>,
    /// Keeps the owners written in the archive instead.
    pub preserve_owners: bool,
}

impl UnpackRequest {
    /// The unpack of these parameters ([`UNPACK_FIELDS`]).
    pub fn parse(p: &FsParams) -> Result<UnpackRequest, ApiError> {
        Ok(UnpackRequest {
            path: p.path()?,
            parents: p.bool("parents", true)?,
            owner: p.owner()?,
            preserve_owners: p.bool("preserve_owners", false)?,
        })
    }
}

/// The kind of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Fifo,
    Socket,
    CharDevice,
    BlockDevice,
}

impl FileKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FileKind::File => "file",
            FileKind::Dir => "dir",
            FileKind::Symlink => "symlink",
            FileKind::Fifo => "fifo",
            FileKind::Socket => "socket",
            FileKind::CharDevice => "char_device",
            FileKind::BlockDevice => "block_device",
        }
    }
}

/// A file (`…/files/stat`, an entry of `…/files/list`), with what the call that answers it
/// adds: mkdir `created`, rm `removed`, mv `src`, an upload `bytes_written` and `created`.
/// Keys in name order (as the API has always written them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileObject {
    /// An upload: the bytes written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_written: Option<u64>,
    /// mkdir, an upload: whether it was made now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created: Option<bool>,
    pub gid: u32,
    /// Octal permission bits with setuid, setgid and sticky: `0644`.
    pub mode: String,
    /// RFC 3339, with milliseconds.
    pub modified_at: String,
    pub name: String,
    /// Always `"file"`.
    pub object: String,
    pub path: String,
    /// rm: always true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub removed: Option<bool>,
    pub size: u64,
    /// mv: the path it had.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub src: Option<String>,
    /// What a symlink points to.
    pub target: Option<String>,
    #[serde(rename = "type")]
    pub kind: FileKind,
    pub uid: u32,
}

/// `…/files/list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileListObject {
    pub entries: Vec<FileObject>,
    /// Always `"list"`.
    pub object: String,
    pub path: String,
    /// Cut at the call's limit (or the agent's).
    pub truncated: bool,
}

/// `…/files/chmod`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChmodObject {
    /// Entries changed.
    pub changed: u64,
    /// Always `"chmod"`.
    pub object: String,
    pub path: String,
}

/// One matching line of `…/files/grep`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrepMatch {
    /// 1-based byte column of the first match in the line.
    pub column: u64,
    /// 1-based.
    pub line: u64,
    /// The line was cut to `max_line_bytes`.
    pub line_truncated: bool,
    pub path: String,
    /// The line (UTF-8, invalid bytes replaced), without its end of line.
    pub text: String,
}

/// `…/files/grep`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrepObject {
    pub files_scanned: u64,
    pub matches: Vec<GrepMatch>,
    /// Always `"grep"`.
    pub object: String,
    /// `max_matches` (or the answer's size cap) stopped the search.
    pub truncated: bool,
}

/// A file `…/files/sed` changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SedFile {
    pub path: String,
    pub replacements: u64,
}

/// `…/files/sed`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SedObject {
    pub files: Vec<SedFile>,
    /// How many `files` lists.
    pub files_changed: u64,
    pub files_scanned: u64,
    /// Always `"sed"`.
    pub object: String,
    pub replacements: u64,
    /// More files changed than the answer lists.
    pub truncated: bool,
}

/// `POST …/files/tar`: a tar stream unpacked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TarObject {
    pub bytes: u64,
    pub entries: u64,
    /// Always `"tar"`.
    pub object: String,
    pub path: String,
    /// Entries left out (kinds a sandbox does not make, or outside the directory).
    pub skipped: u64,
}

/// The object a file operation answers with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum FsObject {
    File(FileObject),
    List(FileListObject),
    Chmod(ChmodObject),
    Grep(GrepObject),
    Sed(SedObject),
    Tar(TarObject),
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn modes() {
        assert_eq!(parse_mode("0644"), Some(0o644));
        assert_eq!(parse_mode("755"), Some(0o755));
        assert_eq!(parse_mode("0o4755"), Some(0o4755));
        assert_eq!(parse_mode("0888"), None);
        assert_eq!(parse_mode("17777"), None);
        assert_eq!(parse_mode(""), None);
        assert_eq!(parse_mode("rwx"), None);
    }

    #[test]
    fn params_from_query_and_body() {
        let q: Vec<(String, String)> = vec![
            ("path".into(), "/w".into()),
            ("include".into(), "*.rs".into()),
            ("include".into(), "*.py".into()),
            ("recursive".into(), "false".into()),
        ];
        let body = json!({"mode": "0644", "max_matches": 3})
            .as_object()
            .cloned();
        let p = FsParams::new(
            q,
            body,
            &["path", "include", "recursive", "mode", "max_matches"],
        )
        .unwrap();
        assert_eq!(p.path().unwrap(), "/w");
        assert_eq!(p.list("include").unwrap(), ["*.rs", "*.py"]);
        assert!(!p.bool("recursive", true).unwrap());
        assert_eq!(p.mode("mode").unwrap(), Some(0o644));
        assert_eq!(p.u64("max_matches", 10).unwrap(), Some(3));
        let q: Vec<(String, String)> = vec![("nope".into(), "1".into())];
        let e = FsParams::new(q, None, &["path"]).err().unwrap();
        assert_eq!(e.code, ErrorCode::FsInvalid);
        assert_eq!(e.param.as_deref(), Some("nope"));
        let q: Vec<(String, String)> = vec![("path".into(), "/a".into())];
        let e = FsParams::new(q, json!({"path": "/b"}).as_object().cloned(), &["path"])
            .err()
            .unwrap();
        assert_eq!(e.param.as_deref(), Some("path"));
    }

    fn payload(v: Value) -> FsParams {
        FsParams::from_payload(v.as_object().cloned().unwrap_or_default())
    }

    #[test]
    fn calls_become_requests_with_their_defaults() {
        let g = FsCall::Grep
            .request(&payload(
                json!({"path": "/w", "pattern": "x", "include": "*.rs"}),
            ))
            .unwrap();
        assert_eq!(
            g,
            FsRequest::Grep(GrepRequest {
                path: "/w".into(),
                pattern: "x".into(),
                literal: false,
                recursive: true,
                ignore_case: false,
                include: vec!["*.rs".into()],
                exclude: vec![],
                max_matches: 1000,
                max_line_bytes: 4096,
            })
        );
        let l = FsCall::List
            .request(&payload(json!({"path": "/", "limit": 0})))
            .unwrap();
        assert_eq!(
            l,
            FsRequest::List {
                path: "/".into(),
                limit: Some(1)
            }
        );
        let e = FsCall::Mkdir
            .request(&payload(json!({"path": "/d", "owner": "70000"})))
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("owner"));
        let e = FsCall::Sed
            .request(&payload(json!({"path": "/d", "pattern": "a"})))
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("replacement"));
        let e = FsCall::Move
            .request(&payload(json!({"path": "/d"})))
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("dst"));
        let w = WriteRequest::parse(&payload(json!({"path": "/f", "mode": 600}))).unwrap();
        assert_eq!(w.mode, Some(0o600));
        assert!(!w.parents);
        let u = UnpackRequest::parse(&payload(json!({"path": "/d"}))).unwrap();
        assert!(u.parents && !u.preserve_owners);
    }

    #[test]
    fn a_file_object_is_written_in_name_order() {
        let f = FileObject {
            bytes_written: None,
            created: Some(true),
            gid: 0,
            mode: "0755".into(),
            modified_at: "2023-11-14T22:13:20.123Z".into(),
            name: "d".into(),
            object: "file".into(),
            path: "/d".into(),
            removed: None,
            size: 4096,
            src: None,
            target: None,
            kind: FileKind::Dir,
            uid: 0,
        };
        let text = serde_json::to_string(&FsObject::File(f.clone())).unwrap();
        // As a JSON object of sorted keys writes it.
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(serde_json::to_string(&v).unwrap(), text);
        assert_eq!(v["type"], "dir");
        assert!(v.get("removed").is_none());
        assert_eq!(v["target"], Value::Null);
        assert_eq!(serde_json::from_value::<FileObject>(v).unwrap(), f);
    }
}
