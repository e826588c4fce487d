//! A sandbox's files, as the node acts on them: an operation's parameters (the same for the
//! HTTP API and the functions interface) made into the agent's [`FsOp`], run by the sandbox's
//! agent (which does the work inside the sandbox, so that paths, owners and permissions are
//! the sandbox's own; see sbx-agent's `fs`), and its result as the object both answer with.

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use sbx_api::{ApiError, ErrorCode};
use sbx_proto::{FsEntry, FsOp, FsResult, GrepSpec, SedSpec};
use serde_json::{json, Map, Value};

use crate::agent::files::{self as agent_files, unexpected, Download};
use crate::agent::AgentConn;
use crate::node::Node;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

pub fn fs_invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::FsInvalid, message).with_param(param)
}

/// A file operation's parameters by name: an HTTP call's query and JSON body, or a function's
/// payload. Query values are strings; the getters read a number or a boolean from either form.
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
    pub fn from_map(map: Map<String, Value>) -> FsParams {
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
            Some(o) if !sbx_api::run::user_ids_in_range(&o) => Err(fs_invalid(
                "owner",
                format!(
                    "{o} is not a user of the sandbox (its ids go from 0 to {})",
                    sbx_api::run::MAX_SANDBOX_ID
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

pub fn parse_mode(s: &str) -> Option<u32> {
    let t = s.trim();
    let t = t.strip_prefix("0o").unwrap_or(t);
    if t.is_empty() || t.len() > 5 || !t.bytes().all(|b| (b'0'..=b'7').contains(&b)) {
        return None;
    }
    u32::from_str_radix(t, 8).ok().filter(|m| *m <= 0o7777)
}

pub fn entry_json(e: &FsEntry) -> Map<String, Value> {
    let v = json!({
        "object": "file",
        "name": e.name,
        "path": e.path,
        "type": e.kind.as_str(),
        "size": e.size,
        "mode": format!("{:04o}", e.mode),
        "uid": e.uid,
        "gid": e.gid,
        "modified_at": sbx_api::format_rfc3339_millis(i128::from(e.mtime_ns)),
        "target": e.target,
    });
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
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

/// An operation's answer: its object, and whether it made something (201 over HTTP).
pub struct FsReply {
    pub object: Value,
    pub created: bool,
}

impl FsReply {
    fn of(object: Map<String, Value>) -> FsReply {
        FsReply {
            object: Value::Object(object),
            created: false,
        }
    }
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

    /// The agent's operation of these parameters.
    pub fn op(self, p: &FsParams) -> Result<FsOp, ApiError> {
        Ok(match self {
            FsCall::List => FsOp::List {
                path: p.path()?,
                limit: p.u64("limit", 10_000)?.map(|l| l.max(1) as u32),
                depth: None,
            },
            FsCall::Stat => FsOp::Stat { path: p.path()? },
            FsCall::Mkdir => FsOp::Mkdir {
                path: p.path()?,
                parents: p.bool("parents", false)?,
                mode: p.mode("mode")?,
                owner: p.owner()?,
            },
            FsCall::Remove => FsOp::Remove {
                path: p.path()?,
                recursive: p.bool("recursive", false)?,
            },
            FsCall::Move => FsOp::Move {
                src: p.path()?,
                dst: p.required("dst")?,
                overwrite: p.bool("overwrite", false)?,
            },
            FsCall::Chmod => {
                let id_max = u64::from(u32::MAX - 1);
                FsOp::Chmod {
                    path: p.path()?,
                    mode: p.mode("mode")?,
                    uid: p.u64("uid", id_max)?.map(|v| v as u32),
                    gid: p.u64("gid", id_max)?.map(|v| v as u32),
                    recursive: p.bool("recursive", false)?,
                }
            }
            FsCall::Grep => FsOp::Grep(GrepSpec {
                path: p.path()?,
                pattern: p.required("pattern")?,
                literal: p.bool("literal", false)?,
                recursive: p.bool("recursive", true)?,
                ignore_case: p.bool("ignore_case", false)?,
                include: p.list("include")?,
                exclude: p.list("exclude")?,
                max_matches: Some(p.u64("max_matches", 100_000)?.unwrap_or(1000).max(1)),
                max_line_bytes: Some(
                    p.u64("max_line_bytes", 1 << 20)?.unwrap_or(4096).max(1) as u32
                ),
            }),
            FsCall::Sed => FsOp::Sed(SedSpec {
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

    /// The answer of the agent's result (a result of another kind is a fault: 500).
    pub fn reply(self, r: FsResult, p: &FsParams) -> Result<FsReply, ApiError> {
        match (self, r) {
            (FsCall::List, FsResult::List { entries, truncated }) => {
                let entries: Vec<Value> = entries
                    .iter()
                    .map(|e| Value::Object(entry_json(e)))
                    .collect();
                Ok(FsReply {
                    object: json!({
                        "object": "list",
                        "path": p.path().ok(),
                        "entries": entries,
                        "truncated": truncated,
                    }),
                    created: false,
                })
            }
            (FsCall::Stat, FsResult::Entry { entry, .. }) => Ok(FsReply::of(entry_json(&entry))),
            (FsCall::Mkdir, FsResult::Entry { entry, created }) => {
                let mut v = entry_json(&entry);
                v.insert("created".into(), json!(created));
                Ok(FsReply {
                    created,
                    ..FsReply::of(v)
                })
            }
            (FsCall::Remove, FsResult::Removed { entry }) => {
                let mut v = entry_json(&entry);
                v.insert("removed".into(), json!(true));
                Ok(FsReply::of(v))
            }
            (FsCall::Move, FsResult::Entry { entry, .. }) => {
                let mut v = entry_json(&entry);
                v.insert("src".into(), json!(p.path().ok()));
                Ok(FsReply::of(v))
            }
            (FsCall::Chmod, FsResult::Changed { count }) => Ok(FsReply {
                object: json!({
                    "object": "chmod",
                    "path": p.path().ok(),
                    "changed": count,
                }),
                created: false,
            }),
            (
                FsCall::Grep,
                FsResult::Grep {
                    matches,
                    truncated,
                    files_scanned,
                },
            ) => Ok(FsReply {
                object: json!({
                    "object": "grep",
                    "matches": matches,
                    "truncated": truncated,
                    "files_scanned": files_scanned,
                }),
                created: false,
            }),
            (
                FsCall::Sed,
                FsResult::Sed {
                    files,
                    replacements,
                    files_scanned,
                    truncated,
                },
            ) => Ok(FsReply {
                object: json!({
                    "object": "sed",
                    "files_changed": files.len(),
                    "files": files,
                    "replacements": replacements,
                    "files_scanned": files_scanned,
                    "truncated": truncated,
                }),
                created: false,
            }),
            (_, other) => Err(unexpected(&other)),
        }
    }
}

/// The parameters of an upload (`PUT …/files`, `sandbox::fs::write`).
pub const WRITE_FIELDS: &[&str] = &["path", "mode", "parents", "owner"];

/// The operation of an upload's parameters.
pub fn write_op(p: &FsParams) -> Result<FsOp, ApiError> {
    Ok(FsOp::Write {
        path: p.path()?,
        mode: p.mode("mode")?,
        parents: p.bool("parents", false)?,
        owner: p.owner()?,
        in_place: false,
    })
}

/// The answer of an upload.
pub fn written_reply(r: FsResult) -> Result<FsReply, ApiError> {
    match r {
        FsResult::Written {
            entry,
            bytes,
            created,
        } => {
            let mut v = entry_json(&entry);
            v.insert("bytes_written".into(), json!(bytes));
            v.insert("created".into(), json!(created));
            Ok(FsReply {
                created,
                ..FsReply::of(v)
            })
        }
        other => Err(unexpected(&other)),
    }
}

/// The answer of a tar stream unpacked into `path`.
pub fn unpacked_reply(r: FsResult, path: &str) -> Result<FsReply, ApiError> {
    match r {
        FsResult::Tar {
            entries,
            bytes,
            skipped,
        } => Ok(FsReply::of(
            json!({
                "object": "tar",
                "path": path,
                "entries": entries,
                "bytes": bytes,
                "skipped": skipped,
            })
            .as_object()
            .cloned()
            .unwrap_or_default(),
        )),
        other => Err(unexpected(&other)),
    }
}

impl Node {
    /// A connection to the agent of a running sandbox that serves file operations.
    async fn fs_conn(&self, id: &str) -> Result<AgentConn, ApiError> {
        let m = self.managed(id)?;
        let status = self.sandbox_object(&m).status;
        if !status.can_exec() {
            return Err(ApiError::new(
                ErrorCode::SandboxNotRunning,
                format!(
                    "the sandbox is {}: its files cannot be reached",
                    status.as_str()
                ),
            ));
        }
        let socket = self.sandboxes_dir().join(&m.id).join("agent.sock");
        let conn = AgentConn::connect(&socket, CONNECT_TIMEOUT)
            .await
            .map_err(|e| {
                tracing::warn!(socket = %socket.display(), error = %e, "agent");
                ApiError::new(
                    ErrorCode::Unavailable,
                    format!("the sandbox's agent cannot be reached: {e}"),
                )
            })?;
        if !conn.serves_fs() {
            return Err(ApiError::new(
                ErrorCode::Unsupported,
                "the sandbox's agent serves no file operations: restart the sandbox to update it",
            ));
        }
        Ok(conn)
    }

    /// Runs a body-less file operation in sandbox `id` (an id or a name).
    pub async fn fs_call(&self, id: &str, call: FsCall, p: &FsParams) -> Result<FsReply, ApiError> {
        let op = call.op(p)?;
        let r = agent_files::call(self.fs_conn(id).await?, op).await?;
        call.reply(r, p)
    }

    /// Runs operation `op` (one without bytes, built by the caller) in sandbox `id`: the
    /// agent's result. `List`'s depth and `Write`'s in_place need an agent with the `watch`
    /// feature (an older one lists one level); `Users` is `unsupported` without it.
    pub async fn fs_op(&self, id: &str, op: FsOp) -> Result<FsResult, ApiError> {
        let conn = self.fs_conn(id).await?;
        if matches!(op, FsOp::Users) && !conn.serves_watch() {
            return Err(ApiError::new(
                ErrorCode::Unsupported,
                "the sandbox's agent does not list its users: restart the sandbox to update it",
            ));
        }
        agent_files::call(conn, op).await
    }

    /// Watches directory `path` of sandbox `id` (`recursive`: every directory under it too):
    /// its changes as they come, until the [`Watch`](crate::agent::watch::Watch) is dropped.
    pub async fn fs_watch(
        &self,
        id: &str,
        path: String,
        recursive: bool,
    ) -> Result<crate::agent::watch::Watch, ApiError> {
        let conn = self.fs_conn(id).await?;
        if !conn.serves_watch() {
            return Err(ApiError::new(
                ErrorCode::Unsupported,
                "the sandbox's agent does not watch directories: restart the sandbox to update it",
            ));
        }
        // A kept sandbox's watch ends when it goes to sleep (and is counted until then).
        let ends = self.managed(id).ok().map(|m| crate::agent::watch::Ends {
            asleep: m.asleep.subscribe(),
            hold: Box::new(crate::node::sandbox::Attached::new(&m)),
        });
        crate::agent::watch::watch(conn, path, recursive, ends).await
    }

    /// An upload (a write or a tar unpack): `op` with `bytes` as they come.
    pub async fn fs_upload<S, E>(&self, id: &str, op: FsOp, bytes: S) -> Result<FsResult, ApiError>
    where
        S: futures_util::Stream<Item = Result<Bytes, E>> + Unpin,
        E: std::fmt::Display,
    {
        let conn = self.fs_conn(id).await?;
        agent_files::upload(conn, op, bytes).await
    }

    /// A download (a read or a tar stream of a directory): what the agent opened, its bytes to
    /// come.
    pub async fn fs_download(&self, id: &str, op: FsOp) -> Result<Download, ApiError> {
        let conn = self.fs_conn(id).await?;
        agent_files::download(conn, op).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
