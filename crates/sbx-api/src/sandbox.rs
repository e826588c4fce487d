//! Long-lived sandboxes and their commands: `POST /v1/sandboxes` (SandboxCreate),
//! `POST /v1/sandboxes/{id}/exec` and `…/run` (ExecRequest), and the sandbox object.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::run::{
    given, invalid, number_in, opt_bool, opt_str, parse_command, parse_env, parse_run_value,
    uint_in, unknown_field, Command, Encoding, RunRequest, RUN_FIELDS,
};
use crate::{ApiError, ErrorCode};

/// RunRequest fields that describe a command, not a sandbox: not taken by a create.
pub const COMMAND_ONLY_FIELDS: [&str; 6] = [
    "command",
    "stdin",
    "encoding",
    "stream",
    "wait_for_reader",
    "timeout_seconds",
];

/// A validated `POST /v1/sandboxes` body: the RunRequest fields that describe a sandbox,
/// checked by the same rules as a run's. `spec.command` is empty and means nothing.
#[derive(Clone, Debug, PartialEq)]
pub struct SandboxCreate {
    pub spec: RunRequest,
    /// Whether the sandbox is on the node's network; `None` (every HTTP create): the node's
    /// default (`--egress-default`). The functions interface's `network` sets it.
    pub network: Option<bool>,
}

fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::new(
            ErrorCode::InvalidJson,
            "the body is not a JSON object",
        )),
        Err(e) => Err(ApiError::new(
            ErrorCode::InvalidJson,
            format!("the body is not a JSON object: {e}"),
        )),
    }
}

/// Parses and validates a `POST /v1/sandboxes` body (an empty body is `{}`).
pub fn parse_sandbox_create(body: &[u8]) -> Result<SandboxCreate, ApiError> {
    let mut obj = if body.iter().all(|b| b.is_ascii_whitespace()) {
        Map::new()
    } else {
        object(body)?
    };
    if let Some(k) = obj
        .keys()
        .find(|k| !RUN_FIELDS.contains(&k.as_str()) || COMMAND_ONLY_FIELDS.contains(&k.as_str()))
    {
        return Err(unknown_field(k, "a create"));
    }
    obj.insert("command".into(), Value::String("true".into()));
    let mut spec = parse_run_value(&Value::Object(obj))?;
    spec.command = Command::Argv(Vec::new());
    Ok(SandboxCreate {
        spec,
        network: None,
    })
}

/// The fields of `POST /v1/sandboxes/{id}/exec` and `…/run`.
pub const EXEC_FIELDS: [&str; 14] = [
    "command",
    "env",
    "cwd",
    "user",
    "timeout_seconds",
    "stdin",
    "stdin_open",
    "encoding",
    "tty",
    "rows",
    "cols",
    "wait_seconds",
    "wait_for_reader",
    "stream",
];

/// The longest `wait_seconds`.
pub const MAX_WAIT_SECONDS: f64 = 300.0;

/// A validated command request.
#[derive(Clone, Debug, PartialEq)]
pub struct ExecRequest {
    pub command: Command,
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub user: Option<String>,
    /// `timeout_seconds` in whole milliseconds, rounded up (as a run's); `None`: no deadline.
    pub timeout: Option<std::time::Duration>,
    pub stdin: Option<Vec<u8>>,
    /// Keep stdin open after `stdin` for `…/stdin` calls.
    pub stdin_open: bool,
    pub encoding: Encoding,
    pub tty: bool,
    pub rows: u16,
    pub cols: u16,
    /// How long the answer waits for the command to end (0: at once).
    pub wait_seconds: f64,
    pub wait_for_reader: bool,
    pub stream: Option<bool>,
}

/// Parses and validates a command request.
pub fn parse_exec_request(body: &[u8]) -> Result<ExecRequest, ApiError> {
    let obj = object(body)?;
    if let Some(k) = obj.keys().find(|k| !EXEC_FIELDS.contains(&k.as_str())) {
        return Err(unknown_field(k, "this call"));
    }
    let command = match given(&obj, "command") {
        Some(v) => parse_command(v, "command", None)?,
        None => {
            return Err(
                ApiError::new(ErrorCode::MissingCommand, "command is required")
                    .with_param("command"),
            )
        }
    };
    let env = match given(&obj, "env") {
        Some(v) => parse_env(v, "env")?,
        None => BTreeMap::new(),
    };
    let cwd = opt_str(&obj, "cwd")?.map(String::from);
    let user = opt_str(&obj, "user")?.map(String::from);
    let timeout = given(&obj, "timeout_seconds")
        .map(|v| match v.as_f64() {
            Some(t) => exec_timeout(t),
            None => Err(invalid(TIMEOUT, TIMEOUT_RANGE)),
        })
        .transpose()?;
    let encoding = match opt_str(&obj, "encoding")? {
        None | Some("utf8") => Encoding::Utf8,
        Some("base64") => Encoding::Base64,
        Some(_) => return Err(invalid("encoding", "encoding must be utf8 or base64")),
    };
    let stdin = match opt_str(&obj, "stdin")? {
        Some(s) => Some(
            encoding
                .decode(s)
                .ok_or_else(|| invalid("stdin", "stdin is not base64"))?,
        ),
        None => None,
    };
    let dim = |key: &str, default: u16| -> Result<u16, ApiError> {
        match given(&obj, key) {
            Some(v) => Ok(uint_in(v, key, 1, 1000)? as u16),
            None => Ok(default),
        }
    };
    let wait_seconds = match given(&obj, "wait_seconds") {
        Some(v) => number_in(
            v,
            "wait_seconds",
            |n| (0.0..=MAX_WAIT_SECONDS).contains(&n),
            "a number of seconds from 0 to 300",
        )?,
        None => 0.0,
    };
    let req = ExecRequest {
        command,
        env,
        cwd,
        user,
        timeout,
        stdin,
        stdin_open: opt_bool(&obj, "stdin_open")?.unwrap_or(false),
        encoding,
        tty: opt_bool(&obj, "tty")?.unwrap_or(false),
        rows: dim("rows", 24)?,
        cols: dim("cols", 80)?,
        wait_seconds,
        wait_for_reader: opt_bool(&obj, "wait_for_reader")?.unwrap_or(false),
        stream: opt_bool(&obj, "stream")?,
    };
    req.check()?;
    Ok(req)
}

const TIMEOUT: &str = "timeout_seconds";
const TIMEOUT_RANGE: &str = "timeout_seconds must be a number of seconds from 0.001 (1 ms) to 1e9";

/// A command's `timeout_seconds` as its deadline: 0.001 to 1e9 seconds, else 400 invalid_field
/// (param `timeout_seconds`), the answer the node gives to the same number in a body.
pub fn exec_timeout(seconds: f64) -> Result<std::time::Duration, ApiError> {
    if (crate::run::MIN_TIMEOUT_SECONDS..=1e9).contains(&seconds) {
        Ok(std::time::Duration::from_millis(crate::run::seconds_to_ms(
            seconds,
        )))
    } else {
        Err(invalid(TIMEOUT, TIMEOUT_RANGE))
    }
}

impl ExecRequest {
    /// A request to run `command` with every other field at its default (as a body of only
    /// `{"command": …}` gives): for callers that build a request by type (the functions
    /// interface), then [`ExecRequest::check`] it.
    pub fn new(command: Command) -> ExecRequest {
        ExecRequest {
            command,
            env: BTreeMap::new(),
            cwd: None,
            user: None,
            timeout: None,
            stdin: None,
            stdin_open: false,
            encoding: Encoding::Utf8,
            tty: false,
            rows: 24,
            cols: 80,
            wait_seconds: 0.0,
            wait_for_reader: false,
            stream: None,
        }
    }

    /// The rules of a command request that are about its values, not its JSON: every request
    /// passes them, parsed or built, with the same codes.
    pub fn check(&self) -> Result<(), ApiError> {
        crate::run::check_command(&self.command, "command")?;
        crate::run::check_env(&self.env, "env")?;
        if self.cwd.as_deref().is_some_and(|c| !c.starts_with('/')) {
            return Err(invalid("cwd", "cwd must be an absolute path"));
        }
        crate::run::check_user(self.user.as_deref())?;
        if self
            .timeout
            .is_some_and(|t| !(1..=crate::run::seconds_to_ms(1e9)).contains(&crate::run::ms_of(t)))
        {
            return Err(invalid(TIMEOUT, TIMEOUT_RANGE));
        }
        if !(0.0..=MAX_WAIT_SECONDS).contains(&self.wait_seconds) {
            return Err(invalid(
                "wait_seconds",
                "wait_seconds must be a number of seconds from 0 to 300",
            ));
        }
        crate::run::check_exec_size(&self.command, self.env.iter(), "env", self.cwd.as_deref())
    }
}

impl SandboxCreate {
    /// This create as the JSON body of `POST /v1/sandboxes` that parses back to it: the
    /// fields of [`RunRequest::to_json`] that describe a sandbox (`network` is not on the wire:
    /// it is the functions interface's, and reads back as `None`).
    pub fn to_json(&self) -> Value {
        let mut v = self.spec.to_json();
        if let Some(o) = v.as_object_mut() {
            for k in COMMAND_ONLY_FIELDS {
                o.remove(k);
            }
        }
        v
    }
}

impl ExecRequest {
    /// This request as the JSON body of `POST /v1/sandboxes/{id}/exec` (or `…/run`) that
    /// parses back to it; fields at their defaults are left out.
    pub fn to_json(&self) -> Value {
        use crate::run::{command_value, seconds_value, stdin_value};
        let mut o = Map::new();
        o.insert("command".into(), command_value(&self.command));
        if !self.env.is_empty() {
            o.insert("env".into(), serde_json::json!(self.env));
        }
        if let Some(c) = &self.cwd {
            o.insert("cwd".into(), Value::String(c.clone()));
        }
        if let Some(u) = &self.user {
            o.insert("user".into(), Value::String(u.clone()));
        }
        if let Some(t) = self.timeout {
            o.insert("timeout_seconds".into(), seconds_value(t));
        }
        if let Some(s) = &self.stdin {
            o.insert("stdin".into(), stdin_value(s, self.encoding));
        }
        if self.stdin_open {
            o.insert("stdin_open".into(), Value::Bool(true));
        }
        if self.encoding != Encoding::Utf8 {
            o.insert(
                "encoding".into(),
                Value::String(self.encoding.as_str().into()),
            );
        }
        if self.tty {
            o.insert("tty".into(), Value::Bool(true));
        }
        if self.rows != 24 {
            o.insert("rows".into(), serde_json::json!(self.rows));
        }
        if self.cols != 80 {
            o.insert("cols".into(), serde_json::json!(self.cols));
        }
        if self.wait_seconds != 0.0 {
            o.insert("wait_seconds".into(), serde_json::json!(self.wait_seconds));
        }
        if self.wait_for_reader {
            o.insert("wait_for_reader".into(), Value::Bool(true));
        }
        if let Some(b) = self.stream {
            o.insert("stream".into(), Value::Bool(b));
        }
        Value::Object(o)
    }
}

/// The fields `PATCH /v1/sandboxes/{id}` takes.
pub const PATCH_FIELDS: [&str; 3] = ["egress", "expires_at", "held_asleep"];

/// A `PATCH /v1/sandboxes/{id}` body: what changes of a kept sandbox. `None`: the field is not
/// given, and that part is left as it is.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SandboxPatch {
    /// Its egress rules: `Some(None)` (null) removes every rule; `Some(Some(keys))` replaces
    /// each key given (`allow`, `deny`, ...) and removes each key given as null, the others
    /// kept ([`crate::egress::merge`]).
    pub egress: Option<Option<Map<String, Value>>>,
    /// When it expires: `Some(None)` (null): never; an RFC 3339 time.
    pub expires_at: Option<Option<String>>,
    /// Held asleep (null reads as false).
    pub held_asleep: Option<bool>,
}

/// Parses a `PATCH /v1/sandboxes/{id}` body: 400 invalid_json, unknown_field, invalid_field
/// (expires_at, held_asleep), invalid_egress (the egress keys given, each as the rules take
/// it; the rules as merged are the node's to check).
pub fn parse_sandbox_patch(body: &[u8]) -> Result<SandboxPatch, ApiError> {
    let obj = object(body)?;
    if let Some(k) = obj.keys().find(|k| !PATCH_FIELDS.contains(&k.as_str())) {
        return Err(ApiError::new(
            ErrorCode::UnknownField,
            format!("{k} is not a field this call takes (egress, expires_at and held_asleep are)"),
        )
        .with_param(k.clone()));
    }
    let held_asleep = match obj.get("held_asleep") {
        None => None,
        Some(Value::Null) => Some(false),
        Some(Value::Bool(b)) => Some(*b),
        Some(_) => {
            return Err(invalid(
                "held_asleep",
                "held_asleep must be true, false or null",
            ))
        }
    };
    let expires_at = match obj.get("expires_at") {
        None => None,
        Some(Value::Null) => Some(None),
        Some(Value::String(s)) => Some(Some(s.clone())),
        Some(_) => {
            return Err(invalid(
                "expires_at",
                "expires_at must be an RFC 3339 time or null",
            ))
        }
    };
    let egress = match obj.get("egress") {
        None => None,
        Some(Value::Null) => Some(None),
        Some(Value::Object(keys)) => {
            let given: Map<String, Value> = keys
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            crate::egress::Egress::parse(&Value::Object(given))?;
            Some(Some(keys.clone()))
        }
        Some(_) => {
            return Err(
                ApiError::new(ErrorCode::InvalidEgress, "egress must be an object or null")
                    .with_param("egress"),
            )
        }
    };
    Ok(SandboxPatch {
        egress,
        expires_at,
        held_asleep,
    })
}

impl SandboxPatch {
    /// This patch as the JSON body that parses back to it.
    pub fn to_json(&self) -> Value {
        let mut o = Map::new();
        match &self.egress {
            None => {}
            Some(None) => {
                o.insert("egress".into(), Value::Null);
            }
            Some(Some(keys)) => {
                o.insert("egress".into(), Value::Object(keys.clone()));
            }
        }
        match &self.expires_at {
            None => {}
            Some(at) => {
                o.insert("expires_at".into(), serde_json::json!(at));
            }
        }
        if let Some(h) = self.held_asleep {
            o.insert("held_asleep".into(), Value::Bool(h));
        }
        Value::Object(o)
    }
}

/// Where a sandbox is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxStatus {
    Starting,
    Running,
    /// Its processes are saved to disk (memory included) and its memory is freed; the next
    /// use wakes it where it was.
    Sleeping,
    Stopping,
    Failed,
    Deleted,
}

impl SandboxStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxStatus::Starting => "starting",
            SandboxStatus::Running => "running",
            SandboxStatus::Sleeping => "sleeping",
            SandboxStatus::Stopping => "stopping",
            SandboxStatus::Failed => "failed",
            SandboxStatus::Deleted => "deleted",
        }
    }

    pub fn parse(s: &str) -> Option<SandboxStatus> {
        [
            SandboxStatus::Starting,
            SandboxStatus::Running,
            SandboxStatus::Sleeping,
            SandboxStatus::Stopping,
            SandboxStatus::Failed,
            SandboxStatus::Deleted,
        ]
        .into_iter()
        .find(|x| x.as_str() == s)
    }

    /// Whether commands can be started in it.
    pub fn can_exec(self) -> bool {
        self == SandboxStatus::Running
    }

    /// Whether it can be restarted.
    pub fn can_restart(self) -> bool {
        matches!(
            self,
            SandboxStatus::Running | SandboxStatus::Sleeping | SandboxStatus::Failed
        )
    }

    /// Whether it can be deleted.
    pub fn can_delete(self) -> bool {
        !matches!(self, SandboxStatus::Deleted)
    }
}

/// The shape of a sandbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxLimits {
    pub vcpus: u32,
    pub memory_bytes: u64,
}

/// The sandbox object.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SandboxObject {
    pub id: String,
    pub object: String,
    pub name: Option<String>,
    pub status: SandboxStatus,
    pub image: String,
    pub limits: SandboxLimits,
    pub hostname: String,
    pub metadata: BTreeMap<String, String>,
    /// Names of its variables; `secret_env`'s values are never shown, only their names.
    pub env: BTreeMap<String, String>,
    pub secret_env: Vec<String>,
    pub created_at: String,
    pub started_at: Option<String>,
    pub expires_at: Option<String>,
    pub failure_code: Option<String>,
    pub failure: Option<String>,
    /// How many times it was restarted.
    pub restarts: u32,
    /// The key of the template it is made from (`base`, `img-…`; GET /internal/node lists
    /// them).
    #[serde(default)]
    pub template: Option<String>,
    /// Its egress rules as the calls gave them (PATCH merges key by key); null: none.
    #[serde(default)]
    pub egress: Option<serde_json::Value>,
    /// Ports anybody may open at its preview URL, as the create gave them.
    #[serde(default)]
    pub public_ports: Vec<u16>,
    /// Every port but these is public too (`[]`: every port); `None`: only `public_ports`.
    #[serde(default)]
    pub public_ports_except: Option<Vec<u16>>,
    /// Its preview URL with the literal text `{port}` where a port goes
    /// (`http://{port}-sbx-….localhost:7780`); `None` when the node's preview listener is off.
    #[serde(default)]
    pub preview_url: Option<String>,
    /// Paused now: idle for its `sleep_after_seconds`, its processes are frozen (its memory
    /// kept); the next use of it resumes it in about a millisecond.
    #[serde(default)]
    pub paused: bool,
    /// How long it may be idle before it pauses, in seconds (null: never by itself).
    #[serde(default)]
    pub sleep_after_seconds: Option<f64>,
    /// How long before it pauses for being idle the programs connected to its
    /// `/run/sbx/awake` are sent `sleep N` (null: not told).
    #[serde(default)]
    pub sleep_notice_ms: Option<u32>,
    /// How long the holds raised on `/run/sbx/awake` keep it up after its idle time has run
    /// out (0: holds are not heeded).
    #[serde(default)]
    pub sleep_hold_max_ms: u32,
    /// Its runtime settings as the spec's `Runtime` shows them ([`crate::run::Runtime::shown`]);
    /// null: none.
    #[serde(default)]
    pub runtime: Option<serde_json::Value>,
    /// The volumes mounted in it (shown only when it has some).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<crate::volume::SandboxVolume>,
}

/// A snapshot: a sandbox's processes (memory included) and files at one instant. It outlives
/// its sandbox; `POST /v1/sandboxes {"snapshot": ID}` makes a sandbox that goes on from it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SnapshotObject {
    pub id: String,
    pub object: String,
    pub name: Option<String>,
    /// `ready`, or `lost` (its files are gone: 409 snapshot_lost for a sandbox made from it).
    pub status: String,
    /// What it takes on the node's disk.
    pub size_bytes: u64,
    pub created_at: String,
    /// The sandbox it was taken of (which may be gone since).
    pub sandbox_id: String,
    /// The image of that sandbox.
    pub image: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_built_exec_request_is_the_parse_of_its_fields() {
        let argv = Command::Argv(vec!["ls".into(), "-l".into()]);
        let parsed = parse_exec_request(br#"{"command":["ls","-l"]}"#).unwrap();
        assert_eq!(ExecRequest::new(argv.clone()), parsed);
        let mut built = ExecRequest::new(argv);
        built.env.insert("A".into(), "1".into());
        built.cwd = Some("/w".into());
        built.timeout = Some(std::time::Duration::from_millis(1500));
        built.wait_seconds = 2.0;
        built.check().unwrap();
        let parsed = parse_exec_request(
            br#"{"command":["ls","-l"],"env":{"A":"1"},"cwd":"/w","timeout_seconds":1.5,"wait_seconds":2}"#,
        )
        .unwrap();
        assert_eq!(built, parsed);
        // The same refusals, built or parsed.
        for (change, body) in [
            (
                (|r: &mut ExecRequest| r.cwd = Some("w".into())) as fn(&mut ExecRequest),
                &br#"{"command":"x","cwd":"w"}"#[..],
            ),
            (
                |r| r.timeout = Some(std::time::Duration::ZERO),
                br#"{"command":"x","timeout_seconds":0}"#,
            ),
            (
                |r| {
                    r.env.insert("A=B".into(), String::new());
                },
                br#"{"command":"x","env":{"A=B":""}}"#,
            ),
            (
                |r| r.wait_seconds = 301.0,
                br#"{"command":"x","wait_seconds":301}"#,
            ),
        ] {
            let mut built = ExecRequest::new(Command::Shell("x".into()));
            change(&mut built);
            let (b, p) = (
                built.check().unwrap_err(),
                parse_exec_request(body).unwrap_err(),
            );
            assert_eq!((b.code, b.param), (p.code, p.param));
        }
    }

    #[test]
    fn create_takes_sandbox_fields_only() {
        let c = parse_sandbox_create(br#"{"name":"box-1","env":{"A":"b"},"limits":{"vcpus":1}}"#)
            .unwrap();
        assert_eq!(c.spec.name.as_deref(), Some("box-1"));
        assert_eq!(c.spec.command, Command::Argv(vec![]));
        assert!(parse_sandbox_create(b"").is_ok());
        let e = parse_sandbox_create(br#"{"command":"ls"}"#).unwrap_err();
        assert_eq!(
            (e.code, e.param.as_deref()),
            (ErrorCode::UnknownField, Some("command"))
        );
        let e = parse_sandbox_create(br#"{"name":"Bad"}"#).unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidName);
        let e = parse_sandbox_create(b"[1]").unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidJson);
    }

    #[test]
    fn exec_requests_are_checked_like_runs() {
        let e = |body: serde_json::Value| {
            let e = parse_exec_request(body.to_string().as_bytes()).unwrap_err();
            (e.code, e.param)
        };
        let huge = "y".repeat(10 << 20);
        let is = |c: ErrorCode, p: &str| (c, Some(p.to_string()));
        use serde_json::json;
        assert_eq!(
            e(json!({ "command": huge })),
            is(ErrorCode::InvalidField, "command")
        );
        assert_eq!(
            e(json!({ "command": "true", "env": { "A": huge } })),
            is(ErrorCode::InvalidEnv, "env.A")
        );
        assert_eq!(
            e(json!({ "command": "true", "cwd": format!("/{huge}") })),
            is(ErrorCode::InvalidField, "cwd")
        );
        assert_eq!(
            e(json!({ "command": "true", "user": "0:999999999" })),
            is(ErrorCode::NoSuchUser, "user")
        );
        assert_eq!(
            e(json!({ "command": "true", "timeout_seconds": 1e-320 })),
            is(ErrorCode::InvalidField, "timeout_seconds")
        );
    }

    #[test]
    fn exec_requests() {
        let r =
            parse_exec_request(br#"{"command":["ls","-l"],"stdin_open":true,"wait_seconds":2.5}"#)
                .unwrap();
        assert!(r.stdin_open);
        assert_eq!(r.wait_seconds, 2.5);
        assert_eq!((r.rows, r.cols), (24, 80));
        let e = parse_exec_request(br#"{}"#).unwrap_err();
        assert_eq!(e.code, ErrorCode::MissingCommand);
        let e = parse_exec_request(br#"{"command":"x","wait_seconds":301}"#).unwrap_err();
        assert_eq!(
            (e.code, e.param.as_deref()),
            (ErrorCode::InvalidField, Some("wait_seconds"))
        );
        let e = parse_exec_request(br#"{"command":"x","bogus":1}"#).unwrap_err();
        assert_eq!(
            (e.code, e.param.as_deref()),
            (ErrorCode::UnknownField, Some("bogus"))
        );
        let e = parse_exec_request(br#"{"command":"x","cwd":"rel"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("cwd"));
        let r =
            parse_exec_request(br#"{"command":"x","encoding":"base64","stdin":"AP8="}"#).unwrap();
        assert_eq!(r.stdin, Some(vec![0, 255]));
    }
}
