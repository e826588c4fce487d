//! `process.Process`'s messages in proto3 JSON (E2B's `packages/envd/spec/process/process.proto`):
//! the requests as read (camelCase or the proto's own names, `null` as unset, `uint32` as a
//! number or a string, `bytes` as base64, enums by name or number) and the events as sent.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{json, Value};

use crate::connect::{b64, RpcError};

/// `ProcessConfig`: what a process runs (as given: List answers it back).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct ProcessConfig {
    #[serde(deserialize_with = "null_default")]
    pub cmd: String,
    #[serde(deserialize_with = "null_default")]
    pub args: Vec<String>,
    #[serde(deserialize_with = "null_default")]
    pub envs: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

/// `PTY.Size`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct PtySize {
    #[serde(deserialize_with = "uint32")]
    pub cols: u32,
    #[serde(deserialize_with = "uint32")]
    pub rows: u32,
}

/// `PTY`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct Pty {
    pub size: Option<PtySize>,
}

impl Pty {
    /// `(rows, cols)` as a terminal takes them (1 to 1000; 0, unset: 24 x 80).
    pub fn rows_cols(&self) -> (u16, u16) {
        let s = self.size.unwrap_or_default();
        let dim = |v: u32, default: u16| {
            if v == 0 {
                default
            } else {
                v.min(1000) as u16
            }
        };
        (dim(s.rows, 24), dim(s.cols, 80))
    }
}

/// `StartRequest`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct StartRequest {
    pub process: Option<ProcessConfig>,
    pub pty: Option<Pty>,
    pub tag: Option<String>,
    /// Unset: open (envd's default, for older SDKs).
    pub stdin: Option<bool>,
}

/// `ProcessSelector`: a oneof of `pid` and `tag`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct SelectorMsg {
    #[serde(deserialize_with = "opt_uint32")]
    pub pid: Option<u32>,
    pub tag: Option<String>,
}

/// A process named by a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selector {
    Pid(u32),
    Tag(String),
}

impl Selector {
    /// The selector of a request's `process` field.
    pub fn of(msg: Option<&SelectorMsg>) -> Result<Selector, RpcError> {
        let none = || RpcError::invalid("process: name the process by its pid or its tag");
        let msg = msg.ok_or_else(none)?;
        match (msg.pid, &msg.tag) {
            (Some(_), Some(_)) => Err(RpcError::invalid(
                "process: give its pid or its tag, not both (a oneof)",
            )),
            (Some(pid), None) => Ok(Selector::Pid(pid)),
            (None, Some(tag)) => Ok(Selector::Tag(tag.clone())),
            (None, None) => Err(none()),
        }
    }

    /// envd's not_found for it.
    pub fn not_found(&self) -> RpcError {
        match self {
            Selector::Pid(pid) => RpcError::not_found(format!("process with pid {pid} not found")),
            Selector::Tag(tag) => RpcError::not_found(format!("process with tag {tag} not found")),
        }
    }
}

/// `ConnectRequest`, `CloseStdinRequest`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct ProcessRequest {
    pub process: Option<SelectorMsg>,
}

/// `ProcessInput`: a oneof of `stdin` and `pty` bytes.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct InputMsg {
    #[serde(deserialize_with = "opt_bytes")]
    pub stdin: Option<Vec<u8>>,
    #[serde(deserialize_with = "opt_bytes")]
    pub pty: Option<Vec<u8>>,
}

/// Input for a process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    Stdin(Vec<u8>),
    Pty(Vec<u8>),
}

impl Input {
    pub fn of(msg: Option<&InputMsg>) -> Result<Input, RpcError> {
        let none = || RpcError::invalid("input: give stdin or pty bytes");
        let msg = msg.ok_or_else(none)?;
        match (&msg.stdin, &msg.pty) {
            (Some(_), Some(_)) => Err(RpcError::invalid(
                "input: give stdin or pty bytes, not both (a oneof)",
            )),
            (Some(b), None) => Ok(Input::Stdin(b.clone())),
            (None, Some(b)) => Ok(Input::Pty(b.clone())),
            (None, None) => Err(none()),
        }
    }
}

/// `SendInputRequest`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct SendInputRequest {
    pub process: Option<SelectorMsg>,
    pub input: Option<InputMsg>,
}

/// `StreamInputRequest.StartEvent`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct StreamStart {
    pub process: Option<SelectorMsg>,
}

/// `StreamInputRequest.DataEvent`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct StreamData {
    pub input: Option<InputMsg>,
}

/// `StreamInputRequest`: a oneof of `start`, `data`, `keepalive`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct StreamInputRequest {
    pub start: Option<StreamStart>,
    pub data: Option<StreamData>,
    pub keepalive: Option<Value>,
}

/// One message of StreamInput.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEvent {
    Start(Selector),
    Data(Input),
    Keepalive,
}

impl StreamInputRequest {
    pub fn event(&self) -> Result<StreamEvent, RpcError> {
        let given = [
            self.start.is_some(),
            self.data.is_some(),
            self.keepalive.as_ref().is_some_and(|v| !v.is_null()),
        ];
        if given.iter().filter(|g| **g).count() != 1 {
            return Err(RpcError::invalid(
                "a StreamInput message holds one of start, data, keepalive",
            ));
        }
        if let Some(s) = &self.start {
            return Ok(StreamEvent::Start(Selector::of(s.process.as_ref())?));
        }
        if let Some(d) = &self.data {
            return Ok(StreamEvent::Data(Input::of(d.input.as_ref())?));
        }
        Ok(StreamEvent::Keepalive)
    }
}

/// `Signal`: by name or number.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum SignalMsg {
    Name(String),
    Number(i64),
}

impl SignalMsg {
    /// The signal's number: SIGTERM or SIGKILL (the only ones the proto has).
    pub fn number(msg: Option<&SignalMsg>) -> Result<i32, RpcError> {
        match msg {
            Some(SignalMsg::Name(n)) if n == "SIGNAL_SIGKILL" || n == "9" => Ok(libc::SIGKILL),
            Some(SignalMsg::Name(n)) if n == "SIGNAL_SIGTERM" || n == "15" => Ok(libc::SIGTERM),
            Some(SignalMsg::Number(9)) => Ok(libc::SIGKILL),
            Some(SignalMsg::Number(15)) => Ok(libc::SIGTERM),
            Some(SignalMsg::Name(n)) => Err(RpcError::unimplemented(format!(
                "invalid signal: {n} (SIGNAL_SIGTERM and SIGNAL_SIGKILL are served)"
            ))),
            Some(SignalMsg::Number(n)) => Err(RpcError::unimplemented(format!(
                "invalid signal: {n} (SIGNAL_SIGTERM and SIGNAL_SIGKILL are served)"
            ))),
            None => Err(RpcError::unimplemented(
                "invalid signal: SIGNAL_UNSPECIFIED (SIGNAL_SIGTERM and SIGNAL_SIGKILL are served)",
            )),
        }
    }
}

/// `SendSignalRequest`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct SendSignalRequest {
    pub process: Option<SelectorMsg>,
    pub signal: Option<SignalMsg>,
}

/// `UpdateRequest`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct UpdateRequest {
    pub process: Option<SelectorMsg>,
    pub pty: Option<Pty>,
}

/// `ProcessEvent.EndEvent`, as envd builds it from Go's `os.ProcessState`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndEvent {
    pub exit_code: i32,
    pub exited: bool,
    pub status: String,
    pub error: Option<String>,
}

impl EndEvent {
    /// The end of a command as the agent tells it. A signal ends it as Go says it
    /// (`signal: killed`, exit code -1); a timeout is the agent's SIGKILL.
    pub fn of(exit: &crate::node::output::ExitInfo) -> EndEvent {
        let signal = match exit.status {
            crate::node::output::ExitStatus::TimedOut => Some(exit.signal.unwrap_or(libc::SIGKILL)),
            _ => exit.signal,
        };
        match signal {
            Some(sig) => {
                let status = format!("signal: {}", go_signal_name(sig));
                EndEvent {
                    exit_code: -1,
                    exited: false,
                    error: Some(status.clone()),
                    status,
                }
            }
            None => {
                let status = format!("exit status {}", exit.exit_code);
                EndEvent {
                    exit_code: exit.exit_code,
                    exited: true,
                    error: (exit.exit_code != 0).then(|| status.clone()),
                    status,
                }
            }
        }
    }
}

/// A signal's name as Go's `syscall.Signal.String` gives it on Linux.
pub fn go_signal_name(sig: i32) -> String {
    let name = match sig {
        1 => "hangup",
        2 => "interrupt",
        3 => "quit",
        4 => "illegal instruction",
        5 => "trace/breakpoint trap",
        6 => "aborted",
        7 => "bus error",
        8 => "floating point exception",
        9 => "killed",
        10 => "user defined signal 1",
        11 => "segmentation fault",
        12 => "user defined signal 2",
        13 => "broken pipe",
        14 => "alarm clock",
        15 => "terminated",
        16 => "stack fault",
        17 => "child exited",
        18 => "continued",
        19 => "stopped (signal)",
        20 => "stopped",
        21 => "stopped (tty input)",
        22 => "stopped (tty output)",
        23 => "urgent I/O condition",
        24 => "CPU time limit exceeded",
        25 => "file size limit exceeded",
        26 => "virtual timer expired",
        27 => "profiling timer expired",
        28 => "window changed",
        29 => "I/O possible",
        30 => "power failure",
        31 => "bad system call",
        n => return format!("signal {n}"),
    };
    name.to_string()
}

/// Which field a data event's bytes go in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    Stdout,
    Stderr,
    Pty,
}

impl Output {
    fn field(self) -> &'static str {
        match self {
            Output::Stdout => "stdout",
            Output::Stderr => "stderr",
            Output::Pty => "pty",
        }
    }
}

/// The most bytes of one data event (envd reads pipes 32 KiB at a time).
pub const DATA_CHUNK: usize = 32 << 10;

/// `{"event": {"start": {"pid": N}}}` (a StartResponse or a ConnectResponse).
pub fn start_event(pid: u32) -> Value {
    json!({ "event": { "start": { "pid": pid } } })
}

/// `{"event": {"data": {"stdout"|"stderr"|"pty": base64}}}`.
pub fn data_event(out: Output, bytes: &[u8]) -> Value {
    let mut data = serde_json::Map::new();
    data.insert(out.field().into(), Value::String(b64::encode(bytes)));
    json!({ "event": { "data": data } })
}

/// `{"event": {"end": {...}}}`.
pub fn end_event(end: &EndEvent) -> Value {
    let mut e = serde_json::Map::new();
    e.insert("exitCode".into(), json!(end.exit_code));
    e.insert("exited".into(), json!(end.exited));
    e.insert("status".into(), json!(end.status));
    if let Some(err) = &end.error {
        e.insert("error".into(), json!(err));
    }
    json!({ "event": { "end": e } })
}

/// `{"event": {"keepalive": {}}}`.
pub fn keepalive_event() -> Value {
    json!({ "event": { "keepalive": {} } })
}

/// `ProcessInfo` of List.
pub fn process_info(pid: u32, tag: Option<&str>, config: &ProcessConfig) -> Value {
    let mut v = json!({ "config": config, "pid": pid });
    if let Some(tag) = tag {
        v["tag"] = json!(tag);
    }
    v
}

/// A field that may be `null` (proto3 JSON: the default).
fn null_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// A `uint32`: a number or a string of one (proto3 JSON takes both).
#[derive(Deserialize)]
#[serde(untagged)]
enum NumOrStr {
    Num(u64),
    Str(String),
}

fn to_u32<E: serde::de::Error>(v: NumOrStr) -> Result<u32, E> {
    let n = match v {
        NumOrStr::Num(n) => n,
        NumOrStr::Str(s) => s
            .trim()
            .parse::<u64>()
            .map_err(|_| E::custom(format!("{s:?} is not a uint32")))?,
    };
    u32::try_from(n).map_err(|_| E::custom(format!("{n} is over a uint32")))
}

fn uint32<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    Ok(opt_uint32(d)?.unwrap_or(0))
}

fn opt_uint32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    Option::<NumOrStr>::deserialize(d)?.map(to_u32).transpose()
}

/// `bytes` in base64; `null` is unset, `""` is set and empty.
fn opt_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
    Option::<String>::deserialize(d)?
        .map(|s| b64::decode(&s).map_err(serde::de::Error::custom))
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::output::{ExitInfo, ExitStatus};

    fn exit(status: ExitStatus, code: i32, signal: Option<i32>) -> ExitInfo {
        ExitInfo {
            status,
            exit_code: code,
            signal,
            duration_ns: 0,
            cpu_ns: 0,
            max_rss_bytes: 0,
        }
    }

    #[test]
    fn a_start_request_as_the_sdk_sends_it() {
        let r: StartRequest = serde_json::from_str(
            r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"A":"1"},"cwd":"/tmp"},"stdin":false}"#,
        )
        .unwrap();
        let p = r.process.unwrap();
        assert_eq!(p.cmd, "/bin/bash");
        assert_eq!(p.args, ["-l", "-c", "echo hi"]);
        assert_eq!(p.envs["A"], "1");
        assert_eq!(p.cwd.as_deref(), Some("/tmp"));
        assert_eq!(r.stdin, Some(false));
        assert!(r.pty.is_none());
        let r: StartRequest = serde_json::from_str(
            r#"{"process":{"cmd":"/bin/bash","args":["-i","-l"],"envs":null},"pty":{"size":{"cols":"80","rows":24}},"tag":"t"}"#,
        )
        .unwrap();
        assert_eq!(r.pty.unwrap().rows_cols(), (24, 80));
        assert_eq!(r.tag.as_deref(), Some("t"));
        assert_eq!(r.stdin, None);
        assert_eq!(Pty::default().rows_cols(), (24, 80));
        assert!(serde_json::from_str::<StartRequest>(r#"{"pty":{"size":{"cols":-1}}}"#).is_err());
    }

    #[test]
    fn selectors_are_a_oneof() {
        let sel = |s: &str| {
            let r: ProcessRequest = serde_json::from_str(s).unwrap();
            Selector::of(r.process.as_ref())
        };
        assert_eq!(sel(r#"{"process":{"pid":42}}"#).unwrap(), Selector::Pid(42));
        assert_eq!(
            sel(r#"{"process":{"pid":"42"}}"#).unwrap(),
            Selector::Pid(42)
        );
        assert_eq!(
            sel(r#"{"process":{"tag":"web"}}"#).unwrap(),
            Selector::Tag("web".into())
        );
        for bad in [
            r#"{}"#,
            r#"{"process":{}}"#,
            r#"{"process":{"pid":1,"tag":"x"}}"#,
        ] {
            assert_eq!(
                sel(bad).unwrap_err().code,
                crate::connect::Code::InvalidArgument
            );
        }
        assert_eq!(
            Selector::Pid(7).not_found().message,
            "process with pid 7 not found"
        );
    }

    #[test]
    fn input_and_stream_input() {
        let r: SendInputRequest =
            serde_json::from_str(r#"{"process":{"pid":3},"input":{"stdin":"aGkK"}}"#).unwrap();
        assert_eq!(
            Input::of(r.input.as_ref()).unwrap(),
            Input::Stdin(b"hi\n".to_vec())
        );
        let r: SendInputRequest =
            serde_json::from_str(r#"{"process":{"pid":3},"input":{"pty":""}}"#).unwrap();
        assert_eq!(Input::of(r.input.as_ref()).unwrap(), Input::Pty(vec![]));
        assert!(serde_json::from_str::<SendInputRequest>(r#"{"input":{"stdin":"%%"}}"#).is_err());
        let r: SendInputRequest = serde_json::from_str(r#"{"input":{}}"#).unwrap();
        assert!(Input::of(r.input.as_ref()).is_err());

        let ev = |s: &str| {
            serde_json::from_str::<StreamInputRequest>(s)
                .unwrap()
                .event()
        };
        assert_eq!(
            ev(r#"{"start":{"process":{"pid":5}}}"#).unwrap(),
            StreamEvent::Start(Selector::Pid(5))
        );
        assert_eq!(
            ev(r#"{"data":{"input":{"pty":"YQ=="}}}"#).unwrap(),
            StreamEvent::Data(Input::Pty(b"a".to_vec()))
        );
        assert_eq!(ev(r#"{"keepalive":{}}"#).unwrap(), StreamEvent::Keepalive);
        assert!(ev(r#"{}"#).is_err());
        assert!(ev(r#"{"keepalive":{},"data":{"input":{"stdin":""}}}"#).is_err());
    }

    #[test]
    fn signals_by_name_or_number() {
        let sig = |s: &str| {
            let r: SendSignalRequest = serde_json::from_str(s).unwrap();
            SignalMsg::number(r.signal.as_ref())
        };
        assert_eq!(
            sig(r#"{"signal":"SIGNAL_SIGKILL"}"#).unwrap(),
            libc::SIGKILL
        );
        assert_eq!(
            sig(r#"{"signal":"SIGNAL_SIGTERM"}"#).unwrap(),
            libc::SIGTERM
        );
        assert_eq!(sig(r#"{"signal":9}"#).unwrap(), libc::SIGKILL);
        assert_eq!(
            sig(r#"{"signal":"SIGNAL_UNSPECIFIED"}"#).unwrap_err().code,
            crate::connect::Code::Unimplemented
        );
        assert!(sig(r#"{}"#).is_err());
        assert!(sig(r#"{"signal":2}"#).is_err());
    }

    #[test]
    fn ends_read_as_go_says_them() {
        let ok = EndEvent::of(&exit(ExitStatus::Exited, 0, None));
        assert_eq!(
            end_event(&ok),
            json!({"event":{"end":{"exitCode":0,"exited":true,"status":"exit status 0"}}})
        );
        let failed = EndEvent::of(&exit(ExitStatus::Exited, 1, None));
        assert_eq!(failed.error.as_deref(), Some("exit status 1"));
        assert_eq!(failed.exit_code, 1);
        let killed = EndEvent::of(&exit(ExitStatus::Killed, 137, Some(9)));
        assert_eq!(
            end_event(&killed),
            json!({"event":{"end":{"exitCode":-1,"exited":false,"status":"signal: killed","error":"signal: killed"}}})
        );
        let timed_out = EndEvent::of(&exit(ExitStatus::TimedOut, 137, None));
        assert_eq!(timed_out.status, "signal: killed");
        let term = EndEvent::of(&exit(ExitStatus::Killed, 143, Some(15)));
        assert_eq!(term.status, "signal: terminated");
        assert_eq!(go_signal_name(40), "signal 40");
    }

    #[test]
    fn events_as_sent() {
        assert_eq!(start_event(12), json!({"event":{"start":{"pid":12}}}));
        assert_eq!(
            data_event(Output::Stderr, b"hi\n"),
            json!({"event":{"data":{"stderr":"aGkK"}}})
        );
        assert_eq!(
            data_event(Output::Pty, b"a"),
            json!({"event":{"data":{"pty":"YQ=="}}})
        );
        assert_eq!(keepalive_event(), json!({"event":{"keepalive":{}}}));
        let cfg = ProcessConfig {
            cmd: "/bin/bash".into(),
            args: vec!["-l".into()],
            envs: BTreeMap::new(),
            cwd: None,
        };
        assert_eq!(
            process_info(3, Some("t"), &cfg),
            json!({"config":{"cmd":"/bin/bash","args":["-l"],"envs":{}},"pid":3,"tag":"t"})
        );
        assert_eq!(process_info(3, None, &cfg).get("tag"), None);
    }
}
