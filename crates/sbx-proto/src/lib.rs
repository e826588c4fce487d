//! The protocol between `sandboxd` (the host) and `sbx-agent` (PID 1 of a sandbox).
//!
//! A connection carries frames both ways. A frame is a little-endian `u32` length of what
//! follows, one kind byte, and the payload:
//! - kind 1 (`Msg`): a JSON document, [`HostMsg`] from the host or [`AgentMsg`] from the agent;
//! - kind 2 (`Data`): bytes of a command's stream, binary so that output needs no escaping:
//!   `u8` stream, `u64` position, `u8` exec id length, exec id, then the bytes. Stream
//!   [`Stream::File`] carries a file operation's bytes (its id in place of the exec id, the
//!   position an offset in the file): see [`fs`].
//!
//! Versioning: the agent's first frame is [`AgentMsg::Hello`] with [`PROTO_VERSION`]. Fields are
//! only ever added, as `Option`s or with `#[serde(default)]`, so an older peer ignores them
//! (`deny_unknown_fields` is never used here). A change that an old peer would misread bumps the
//! version. `tests::schema_snapshot` pins the JSON shape of every message.

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

pub mod fs;
pub use fs::{
    FsEntry, FsErrorCode, FsFailure, FsKind, FsOp, FsResult, GrepMatch, GrepSpec, GroupInfo,
    SedFile, SedSpec, UserInfo, WatchEvent, WatchKind, XattrSet, FEATURE_FS, FEATURE_WATCH,
    FEATURE_XATTRS,
};

/// The feature (in the agent's hello) of [`ExecSpec::stdin_null`].
pub const FEATURE_STDIN_NULL: &str = "stdin_null";
/// The feature of [`HostMsg::Awake`]: the agent serves `/run/sbx/awake` in the sandbox.
pub const FEATURE_AWAKE: &str = "awake";
/// Where programs of a sandbox hold it awake: a unix socket; `+` raises a hold, `-` lowers one,
/// the connection's end lowers all of its own; the agent sends `sleep N\n` (milliseconds)
/// before the sandbox stops for being idle.
pub const AWAKE_SOCKET: &str = "/run/sbx/awake";
/// The feature of [`HostMsg::Lease`]: the agent is the watchdog of the node's lease (a node
/// of a fleet); an agent without it is sent none.
pub const FEATURE_LEASE: &str = "lease";

/// The generation of this protocol.
pub const PROTO_VERSION: u32 = 1;
/// The largest frame either side accepts (a data frame carries at most [`MAX_DATA`] bytes).
pub const MAX_FRAME: usize = 4 << 20;
/// The most bytes one data frame carries.
pub const MAX_DATA: usize = 1 << 20;

const KIND_MSG: u8 = 1;
const KIND_DATA: u8 = 2;

#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("frame of {0} bytes is over the limit")]
    TooLarge(usize),
    #[error("malformed frame: {0}")]
    Malformed(String),
    #[error("bad message: {0}")]
    Json(#[from] serde_json::Error),
}

/// Which stream bytes belong to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    Stdin = 0,
    Stdout = 1,
    Stderr = 2,
    /// Bytes of a file operation (an upload or a download).
    File = 3,
}

impl Stream {
    fn from_u8(b: u8) -> Option<Stream> {
        match b {
            0 => Some(Stream::Stdin),
            1 => Some(Stream::Stdout),
            2 => Some(Stream::Stderr),
            3 => Some(Stream::File),
            _ => None,
        }
    }
}

/// What a command runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Program {
    /// One line for `/bin/sh -c`.
    Shell(String),
    /// Arguments run as they are; the first found along the command's own PATH.
    Argv(Vec<String>),
}

/// A command to start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecSpec {
    pub exec_id: String,
    pub program: Program,
    /// Added to the sandbox's environment; the same name wins here. In order.
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// Absolute directory to run in; `None`: the image's working directory.
    #[serde(default)]
    pub cwd: Option<String>,
    /// A user name, a uid, or uid:gid; `None`: the image's user.
    #[serde(default)]
    pub user: Option<String>,
    /// Kill the command's process group after this many milliseconds.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Keep stdin open for later [`HostMsg::Stdin`] data; false closes it after `stdin`.
    #[serde(default)]
    pub stdin_open: bool,
    /// No stdin at all: the command reads /dev/null, and no `CloseStdin` follows. Only to an
    /// agent that announces [`FEATURE_STDIN_NULL`] (an older one ignores the field).
    #[serde(default)]
    pub stdin_null: bool,
    /// Send output to this connection as it comes.
    #[serde(default)]
    pub attach: bool,
    /// Run on a terminal (a PTY) of `rows` x `cols`: its output is one stream (stdout).
    #[serde(default)]
    pub tty: bool,
    /// Read the command's output only as fast as a reader takes it (the command blocks on a
    /// full pipe), instead of keeping the last bytes in the ring and dropping older ones.
    #[serde(default)]
    pub wait_for_reader: bool,
    #[serde(default = "default_rows")]
    pub rows: u16,
    #[serde(default = "default_cols")]
    pub cols: u16,
}

fn default_rows() -> u16 {
    24
}

fn default_cols() -> u16 {
    80
}

/// The host's messages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum HostMsg {
    /// Start a command. Answered by `Started` or `ExecFailed`.
    Exec(ExecSpec),
    /// Close the command's stdin (after the data frames sent before it).
    CloseStdin { exec_id: String },
    /// Send a signal to the command's process group.
    Signal { exec_id: String, signal: i32 },
    /// Send this connection the command's output from `from`, then live, then its exit.
    Attach { exec_id: String, from: u64 },
    /// Ask for the state of a command.
    Status { exec_id: String },
    /// Answered by `State` once the command has ended.
    Wait { exec_id: String },
    /// Answered by `Execs`: every command the agent knows, oldest first.
    List,
    /// Answered by `Synced` after every frame sent before it was handled (stdin queued).
    Sync { token: u64 },
    /// A terminal's new size.
    Resize {
        exec_id: String,
        rows: u16,
        cols: u16,
    },
    /// Starts file operation `id` (see [`fs`]).
    Fs { id: String, op: FsOp },
    /// The end of an upload's data frames.
    FsEnd { id: String },
    /// Watches directory `path` (and, when `recursive`, every directory under it, those made
    /// later too) for changes: answered `WatchStarted` or `WatchEnded` with the error, then
    /// `WatchEvents` as they come until `Unwatch`, the connection's end, or `WatchEnded` (the
    /// directory went). Only to an agent that announces [`FEATURE_WATCH`].
    Watch {
        id: String,
        path: String,
        #[serde(default)]
        recursive: bool,
    },
    /// Ends watch `id` (answered `WatchEnded` without an error).
    Unwatch { id: String },
    /// Makes the agent dumpable (just before a checkpoint) or not (after a wake, and while
    /// awake). Answered by `Dumpable` with the state now.
    SetDumpable { dumpable: bool },
    /// The holds raised on [`AWAKE_SOCKET`], answered by `Awake`; with `notice_ms`, the
    /// programs connected are first sent `sleep N` (the sandbox stops that long after). Only
    /// to an agent that announces [`FEATURE_AWAKE`].
    Awake {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        notice_ms: Option<u32>,
    },
    /// The node's lease with its control plane runs until `until_ms` (CLOCK_BOOTTIME, in
    /// milliseconds): past it without a newer lease, the agent stops every other process of
    /// the sandbox (SIGSTOP) and keeps them stopped until a lease in the future comes (SIGCONT).
    /// `None`: no lease (the watchdog is off; what it stopped goes on). A node without a
    /// control plane never sends one, and an agent that never got one never stops anything.
    /// Answered by `Leased`. Only to an agent that announces [`FEATURE_LEASE`].
    Lease { until_ms: Option<u64> },
}

/// How a command ended, as [`ExitInfo::status`]. On the wire: `"exited"`, `"timed_out"`,
/// `"killed"`. A status this peer does not know (a newer agent's) is read as
/// [`ExitStatus::Exited`]: the exit code and signal that come with it still say what happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExitStatus {
    /// Its deadline was up and the agent killed it.
    TimedOut,
    /// A signal ended it.
    Killed,
    /// It ended by itself, with any exit code; also any status this peer does not know
    /// (serde's `other` must be the last variant).
    #[serde(other)]
    Exited,
}

/// How a command ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExitInfo {
    pub status: ExitStatus,
    pub exit_code: i32,
    /// The signal number that ended it, if one did.
    pub signal: Option<i32>,
    pub duration_ns: u64,
    pub cpu_ns: u64,
    pub max_rss_bytes: u64,
}

/// Output counters of a command.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputCounts {
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    /// Position of the oldest byte kept.
    pub start: u64,
    /// Position after the newest byte.
    pub end: u64,
}

/// Why the agent refused a request about a command ([`AgentMsg::ExecFailed`]). A kind this
/// peer does not know (a newer agent's) reads as [`ExecFailKind::Internal`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecFailKind {
    NoSuchUser,
    DuplicateId,
    NoSuchExec,
    /// Also any kind this peer does not know (serde's `other` must be the last variant).
    #[serde(other)]
    Internal,
}

/// Why a command could not be executed ([`StartFailure`]), from the errno of the step that
/// failed: the working directory's stat, the search along PATH, execve. On the wire its
/// snake_case name; one this peer does not know (a newer agent's) reads as
/// [`StartFailKind::Other`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StartFailKind {
    /// The working directory does not exist (ENOENT).
    CwdMissing,
    /// The working directory is not a directory (a file; ENOTDIR).
    CwdNotDirectory,
    /// The program is not found along PATH, execve said ENOENT (a missing file or
    /// interpreter), or the command is empty.
    NotFound,
    /// execve said EACCES or EPERM: no execute permission, a directory, a noexec mount.
    Permission,
    /// execve said ENOEXEC: a file the kernel does not run (no `#!` line, another
    /// architecture).
    NotExecutable,
    /// Anything else (E2BIG, ENOMEM, a terminal that could not be made, ...); also a kind
    /// this peer does not know, and an older agent's failure, which has no kind (serde's
    /// `other` must be the last variant).
    #[default]
    #[serde(other)]
    Other,
}

impl StartFailKind {
    /// The exit code the command ends with, as a shell's: 127 when it is not found, else 126.
    pub fn exit_code(self) -> i32 {
        match self {
            StartFailKind::NotFound => 127,
            _ => 126,
        }
    }
}

/// A command that could not be executed. It still "ran": the agent answers `Started` with pid
/// 0, and it ends at once with [`StartFailKind::exit_code`], `sbx: ` and the message on its
/// stderr. Its kind says why without the text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartFailure {
    #[serde(default)]
    pub kind: StartFailKind,
    /// For people: what its stderr says, without `sbx: ` and the newline.
    #[serde(default)]
    pub message: String,
}

impl StartFailure {
    pub fn new(kind: StartFailKind, message: impl Into<String>) -> StartFailure {
        StartFailure {
            kind,
            message: message.into(),
        }
    }

    /// The failure of a start as told (`Started` or [`ExecState`]): the one sent, else, for
    /// pid 0 (which only a command that could not be executed has), one of kind
    /// [`StartFailKind::Other`] without a message: an older agent sends no `failed`.
    pub fn of_start(pid: u32, failed: Option<StartFailure>) -> Option<StartFailure> {
        failed.or_else(|| (pid == 0).then(|| StartFailure::new(StartFailKind::Other, "")))
    }
}

/// The agent's messages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum AgentMsg {
    Hello {
        version: u32,
        agent: String,
        /// What this agent serves beyond commands ([`FEATURE_FS`]); absent from older agents.
        #[serde(default)]
        features: Vec<String>,
    },
    Started {
        exec_id: String,
        /// 0 for a command that could not be executed (see [`StartFailure`]).
        pid: u32,
        /// Wall clock of the sandbox, nanoseconds since the epoch.
        started_at_ns: i64,
        /// Why the command could not be executed (its end follows at once); absent when it
        /// runs, and from older agents (see [`StartFailure::of_start`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        failed: Option<StartFailure>,
    },
    ExecFailed {
        exec_id: String,
        kind: ExecFailKind,
        message: String,
    },
    /// Bytes from `from` to `to` are no longer kept.
    Gap { exec_id: String, from: u64, to: u64 },
    Exited {
        exec_id: String,
        exit: ExitInfo,
        output: OutputCounts,
    },
    /// Answer to `Status` and `Wait`.
    State(ExecState),
    /// Answer to `List`.
    Execs { execs: Vec<ExecState> },
    /// Answer to `Sync`.
    Synced { token: u64 },
    /// Whether the agent is dumpable now (the answer to `SetDumpable`).
    Dumpable { dumpable: bool },
    /// The answer to `Awake`: holds raised now, programs connected, and how long ago the last
    /// hold was lowered (`None`: none was ever, or one is raised now).
    Awake {
        holds: u32,
        connected: u32,
        #[serde(default)]
        lowered_ms_ago: Option<u64>,
    },
    /// The answer to `Lease`: whether the sandbox's processes are stopped now (its lease ran
    /// out).
    Leased { stopped: bool },
    /// A download of file operation `id` starts: data frames of stream `file` follow, from
    /// position `offset`, `length` bytes (`None`: as many as there are), then `FsDone`.
    FsOpened {
        id: String,
        /// The size of the file (0 for a tar stream).
        size: u64,
        offset: u64,
        length: Option<u64>,
    },
    /// File operation `id` succeeded.
    FsDone { id: String, result: FsResult },
    /// File operation `id` failed.
    FsError { id: String, error: FsFailure },
    /// Watch `id` is in place: changes from now on are reported.
    WatchStarted { id: String },
    /// Changes seen by watch `id`, in order. `overflow`: the kernel's queue overflowed
    /// before these (some changes were lost).
    WatchEvents {
        id: String,
        events: Vec<WatchEvent>,
        #[serde(default)]
        overflow: bool,
    },
    /// Watch `id` has ended (`error`: why, when it did not end by `Unwatch`).
    WatchEnded {
        id: String,
        #[serde(default)]
        error: Option<FsFailure>,
    },
}

/// What the agent knows of a command.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecState {
    pub exec_id: String,
    pub pid: u32,
    pub started_at_ns: i64,
    pub exit: Option<ExitInfo>,
    pub output: OutputCounts,
    /// Why the command could not be executed, as its `Started` said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<StartFailure>,
}

/// A frame as read.
#[derive(Debug, Clone, PartialEq)]
pub enum Frame<M> {
    Msg(M),
    Data {
        exec_id: String,
        stream: Stream,
        pos: u64,
        bytes: Vec<u8>,
    },
}

/// Encodes a message frame; one over [`MAX_FRAME`], which the peer would refuse (and close the
/// connection on), is [`ProtoError::TooLarge`] and never sent.
pub fn encode_msg<M: Serialize>(msg: &M) -> Result<Vec<u8>, ProtoError> {
    let json = serde_json::to_vec(msg)?;
    if json.len() + 1 > MAX_FRAME {
        return Err(ProtoError::TooLarge(json.len() + 1));
    }
    let mut out = Vec::with_capacity(json.len() + 5);
    out.extend_from_slice(&((json.len() + 1) as u32).to_le_bytes());
    out.push(KIND_MSG);
    out.extend_from_slice(&json);
    Ok(out)
}

/// Encodes a data frame header; the caller writes `len` bytes after it.
pub fn encode_data_header(exec_id: &str, stream: Stream, pos: u64, len: usize) -> Vec<u8> {
    let id = exec_id.as_bytes();
    let id_len = id.len().min(255);
    let body = 1 + 1 + 8 + 1 + id_len + len;
    let mut out = Vec::with_capacity(4 + body - len);
    out.extend_from_slice(&(body as u32).to_le_bytes());
    out.push(KIND_DATA);
    out.push(stream as u8);
    out.extend_from_slice(&pos.to_le_bytes());
    out.push(id_len as u8);
    out.extend_from_slice(&id[..id_len]);
    out
}

/// Encodes a whole data frame.
pub fn encode_data(exec_id: &str, stream: Stream, pos: u64, bytes: &[u8]) -> Vec<u8> {
    let mut out = encode_data_header(exec_id, stream, pos, bytes.len());
    out.extend_from_slice(bytes);
    out
}

/// Reads one frame; `Ok(None)` at a clean end of the connection.
pub async fn read_frame<M, R>(r: &mut R) -> Result<Option<Frame<M>>, ProtoError>
where
    M: for<'de> Deserialize<'de>,
    R: AsyncRead + Unpin,
{
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(ProtoError::TooLarge(len));
    }
    if len == 0 {
        return Err(ProtoError::Malformed("empty frame".into()));
    }
    let mut kind = [0u8; 1];
    r.read_exact(&mut kind).await?;
    match kind[0] {
        KIND_MSG => {
            let mut buf = vec![0u8; len - 1];
            r.read_exact(&mut buf).await?;
            Ok(Some(Frame::Msg(serde_json::from_slice(&buf)?)))
        }
        KIND_DATA => {
            // The bytes are read straight into their own buffer: no copy out of the frame.
            if len < 11 {
                return Err(ProtoError::Malformed("short data frame".into()));
            }
            let mut head = [0u8; 10];
            r.read_exact(&mut head).await?;
            let stream = Stream::from_u8(head[0])
                .ok_or_else(|| ProtoError::Malformed(format!("stream {}", head[0])))?;
            let mut pos = [0u8; 8];
            pos.copy_from_slice(&head[1..9]);
            let id_len = head[9] as usize;
            if len < 11 + id_len {
                return Err(ProtoError::Malformed("short exec id".into()));
            }
            let mut id = vec![0u8; id_len];
            r.read_exact(&mut id).await?;
            let exec_id = String::from_utf8(id)
                .map_err(|_| ProtoError::Malformed("exec id is not UTF-8".into()))?;
            let bytes = read_exactly(r, len - 11 - id_len).await?;
            Ok(Some(Frame::Data {
                exec_id,
                stream,
                pos: u64::from_le_bytes(pos),
                bytes,
            }))
        }
        other => Err(ProtoError::Malformed(format!("frame kind {other}"))),
    }
}

/// `n` bytes of `r` into a buffer of their own, read into it as they come (it is not zeroed
/// first: that would touch every byte once more).
async fn read_exactly<R: AsyncRead + Unpin>(r: &mut R, n: usize) -> std::io::Result<Vec<u8>> {
    let mut bytes = Vec::with_capacity(n);
    let mut limited = r.take(n as u64);
    while bytes.len() < n {
        if limited.read_buf(&mut bytes).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(bytes)
}

/// Writes a message frame.
pub async fn write_msg<M: Serialize, W: AsyncWrite + Unpin>(
    w: &mut W,
    msg: &M,
) -> Result<(), ProtoError> {
    w.write_all(&encode_msg(msg)?).await?;
    Ok(())
}

/// Writes a data frame (split into frames of at most [`MAX_DATA`] bytes).
pub async fn write_data<W: AsyncWrite + Unpin>(
    w: &mut W,
    exec_id: &str,
    stream: Stream,
    mut pos: u64,
    bytes: &[u8],
) -> Result<(), ProtoError> {
    for chunk in bytes.chunks(MAX_DATA) {
        w.write_all(&encode_data_header(exec_id, stream, pos, chunk.len()))
            .await?;
        w.write_all(chunk).await?;
        pos += chunk.len() as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_round_trip() {
        let spec = ExecSpec {
            exec_id: "exe-0123456789abcdef".into(),
            program: Program::Argv(vec!["echo".into(), "hi".into()]),
            env: vec![("A".into(), "b".into())],
            cwd: Some("/tmp".into()),
            user: None,
            timeout_ms: Some(5),
            stdin_open: false,
            stdin_null: false,
            attach: true,
            tty: false,
            wait_for_reader: false,
            rows: 24,
            cols: 80,
        };
        let mut buf = encode_msg(&HostMsg::Exec(spec.clone())).unwrap();
        buf.extend(encode_data(
            "exe-0123456789abcdef",
            Stream::Stdout,
            7,
            b"\x00\xffhi",
        ));
        let mut r = &buf[..];
        let f1: Frame<HostMsg> = read_frame(&mut r).await.unwrap().unwrap();
        assert_eq!(f1, Frame::Msg(HostMsg::Exec(spec)));
        let f2: Frame<HostMsg> = read_frame(&mut r).await.unwrap().unwrap();
        assert_eq!(
            f2,
            Frame::Data {
                exec_id: "exe-0123456789abcdef".into(),
                stream: Stream::Stdout,
                pos: 7,
                bytes: b"\x00\xffhi".to_vec()
            }
        );
        assert!(read_frame::<HostMsg, _>(&mut r).await.unwrap().is_none());
    }

    #[test]
    fn a_message_over_the_frame_limit_is_never_encoded() {
        let msg = HostMsg::Sync { token: 0 };
        assert!(encode_msg(&msg).is_ok());
        let big = serde_json::json!({ "pad": "\u{1}".repeat(MAX_FRAME / 6 + 1) });
        assert!(matches!(encode_msg(&big), Err(ProtoError::TooLarge(n)) if n > MAX_FRAME));
        let fits = serde_json::json!({ "pad": "x".repeat(MAX_FRAME - 64) });
        assert!(encode_msg(&fits).is_ok());
    }

    #[tokio::test]
    async fn oversized_and_malformed_frames_are_refused() {
        let mut big = ((MAX_FRAME + 1) as u32).to_le_bytes().to_vec();
        big.push(KIND_MSG);
        let mut r = &big[..];
        assert!(matches!(
            read_frame::<HostMsg, _>(&mut r).await,
            Err(ProtoError::TooLarge(_))
        ));
        let bad = [2u8, 0, 0, 0, 9, 0];
        let mut r = &bad[..];
        assert!(matches!(
            read_frame::<HostMsg, _>(&mut r).await,
            Err(ProtoError::Malformed(_))
        ));
    }

    /// The enum is the old strings on the wire, both ways; an unknown status reads as exited.
    #[test]
    fn exit_status_strings() {
        for (s, text) in [
            (ExitStatus::Exited, "exited"),
            (ExitStatus::TimedOut, "timed_out"),
            (ExitStatus::Killed, "killed"),
        ] {
            assert_eq!(serde_json::to_string(&s).unwrap(), format!("\"{text}\""));
            assert_eq!(
                serde_json::from_str::<ExitStatus>(&format!("\"{text}\"")).unwrap(),
                s
            );
        }
        assert_eq!(
            serde_json::from_str::<ExitStatus>(r#""stopped_by_something_new""#).unwrap(),
            ExitStatus::Exited
        );
        let x: ExitInfo = serde_json::from_str(
            r#"{"status":"nope","exit_code":3,"signal":null,"duration_ns":1,"cpu_ns":2,"max_rss_bytes":3}"#,
        )
        .unwrap();
        assert_eq!((x.status, x.exit_code), (ExitStatus::Exited, 3));
    }

    /// The awake messages' wire shape; an older answer without `lowered_ms_ago` reads.
    #[test]
    fn awake_schema_snapshot() {
        let ask = serde_json::to_string(&HostMsg::Awake { notice_ms: None }).unwrap();
        assert_eq!(ask, r#"{"type":"awake"}"#);
        let notice = serde_json::to_string(&HostMsg::Awake {
            notice_ms: Some(500),
        })
        .unwrap();
        assert_eq!(notice, r#"{"type":"awake","notice_ms":500}"#);
        let state = serde_json::to_string(&AgentMsg::Awake {
            holds: 2,
            connected: 3,
            lowered_ms_ago: Some(7),
        })
        .unwrap();
        assert_eq!(
            state,
            r#"{"type":"awake","holds":2,"connected":3,"lowered_ms_ago":7}"#
        );
        let old: AgentMsg =
            serde_json::from_str(r#"{"type":"awake","holds":0,"connected":1}"#).unwrap();
        assert_eq!(
            old,
            AgentMsg::Awake {
                holds: 0,
                connected: 1,
                lowered_ms_ago: None
            }
        );
    }

    #[test]
    fn lease_schema_snapshot() {
        let lease = serde_json::to_string(&HostMsg::Lease {
            until_ms: Some(12_345),
        })
        .unwrap();
        assert_eq!(lease, r#"{"type":"lease","until_ms":12345}"#);
        let none = serde_json::to_string(&HostMsg::Lease { until_ms: None }).unwrap();
        assert_eq!(none, r#"{"type":"lease","until_ms":null}"#);
        let back: HostMsg = serde_json::from_str(r#"{"type":"lease","until_ms":7}"#).unwrap();
        assert_eq!(back, HostMsg::Lease { until_ms: Some(7) });
        let leased = serde_json::to_string(&AgentMsg::Leased { stopped: true }).unwrap();
        assert_eq!(leased, r#"{"type":"leased","stopped":true}"#);
    }

    /// Pins the wire shape: a change here is a protocol change (see the module doc).
    #[test]
    fn schema_snapshot() {
        let hello = serde_json::to_string(&AgentMsg::Hello {
            version: PROTO_VERSION,
            agent: "sbx-agent 0.1.0".into(),
            features: vec![FEATURE_FS.into()],
        })
        .unwrap();
        assert_eq!(
            hello,
            r#"{"type":"hello","version":1,"agent":"sbx-agent 0.1.0","features":["fs"]}"#
        );
        // An older agent's hello has no features.
        let old: AgentMsg =
            serde_json::from_str(r#"{"type":"hello","version":1,"agent":"a"}"#).unwrap();
        assert!(matches!(old, AgentMsg::Hello { features, .. } if features.is_empty()));
        let exited = serde_json::to_string(&AgentMsg::Exited {
            exec_id: "exe-x".into(),
            exit: ExitInfo {
                status: ExitStatus::Exited,
                exit_code: 0,
                signal: None,
                duration_ns: 1,
                cpu_ns: 2,
                max_rss_bytes: 3,
            },
            output: OutputCounts::default(),
        })
        .unwrap();
        assert_eq!(
            exited,
            r#"{"type":"exited","exec_id":"exe-x","exit":{"status":"exited","exit_code":0,"signal":null,"duration_ns":1,"cpu_ns":2,"max_rss_bytes":3},"output":{"stdout_bytes":0,"stderr_bytes":0,"start":0,"end":0}}"#
        );
        let exec = serde_json::to_string(&HostMsg::Exec(ExecSpec {
            exec_id: "exe-x".into(),
            program: Program::Shell("true".into()),
            env: vec![],
            cwd: None,
            user: None,
            timeout_ms: None,
            stdin_open: false,
            stdin_null: false,
            attach: false,
            tty: false,
            wait_for_reader: false,
            rows: 24,
            cols: 80,
        }))
        .unwrap();
        assert_eq!(
            exec,
            r#"{"type":"exec","exec_id":"exe-x","program":{"shell":"true"},"env":[],"cwd":null,"user":null,"timeout_ms":null,"stdin_open":false,"stdin_null":false,"attach":false,"tty":false,"wait_for_reader":false,"rows":24,"cols":80}"#
        );
        // An older host that sends no optional fields is still understood.
        let old: HostMsg =
            serde_json::from_str(r#"{"type":"exec","exec_id":"e","program":{"argv":["a"]}}"#)
                .unwrap();
        assert!(matches!(old, HostMsg::Exec(ExecSpec { attach: false, .. })));
    }
    /// Pins the wire shape of starts and of commands that could not be executed: the kind is
    /// added compatibly (absent when the command runs; an older agent's start without it, and
    /// a kind this peer does not know, read as `other`).
    #[test]
    fn start_schema_snapshot() {
        let started = serde_json::to_string(&AgentMsg::Started {
            exec_id: "exe-x".into(),
            pid: 42,
            started_at_ns: 7,
            failed: None,
        })
        .unwrap();
        assert_eq!(
            started,
            r#"{"type":"started","exec_id":"exe-x","pid":42,"started_at_ns":7}"#
        );
        let failed = serde_json::to_string(&AgentMsg::Started {
            exec_id: "exe-x".into(),
            pid: 0,
            started_at_ns: 7,
            failed: Some(StartFailure::new(
                StartFailKind::CwdMissing,
                "cannot change to directory /nope: No such file or directory",
            )),
        })
        .unwrap();
        assert_eq!(
            failed,
            r#"{"type":"started","exec_id":"exe-x","pid":0,"started_at_ns":7,"failed":{"kind":"cwd_missing","message":"cannot change to directory /nope: No such file or directory"}}"#
        );
        for (kind, text, code) in [
            (StartFailKind::CwdMissing, "cwd_missing", 126),
            (StartFailKind::CwdNotDirectory, "cwd_not_directory", 126),
            (StartFailKind::NotFound, "not_found", 127),
            (StartFailKind::Permission, "permission", 126),
            (StartFailKind::NotExecutable, "not_executable", 126),
            (StartFailKind::Other, "other", 126),
        ] {
            assert_eq!(serde_json::to_string(&kind).unwrap(), format!("\"{text}\""));
            assert_eq!(kind.exit_code(), code, "{text}");
        }
        // An older agent's start has no `failed`: pid 0 says it failed, of kind other.
        let old: AgentMsg =
            serde_json::from_str(r#"{"type":"started","exec_id":"e","pid":0,"started_at_ns":1}"#)
                .unwrap();
        let AgentMsg::Started { pid, failed, .. } = old else {
            panic!("{old:?}");
        };
        assert_eq!(failed, None);
        assert_eq!(
            StartFailure::of_start(pid, failed),
            Some(StartFailure::new(StartFailKind::Other, ""))
        );
        assert_eq!(StartFailure::of_start(9, None), None);
        // A newer agent's kind, or a failure without one, reads as other.
        let newer: StartFailure =
            serde_json::from_str(r#"{"kind":"seccomp_refused","message":"m"}"#).unwrap();
        assert_eq!(newer, StartFailure::new(StartFailKind::Other, "m"));
        let bare: StartFailure = serde_json::from_str("{}").unwrap();
        assert_eq!(bare, StartFailure::new(StartFailKind::Other, ""));
        // The state of a command carries it too, and leaves it out when it ran.
        let mut state = ExecState {
            exec_id: "exe-x".into(),
            pid: 3,
            started_at_ns: 1,
            exit: None,
            output: OutputCounts::default(),
            failed: None,
        };
        assert_eq!(
            serde_json::to_string(&state).unwrap(),
            r#"{"exec_id":"exe-x","pid":3,"started_at_ns":1,"exit":null,"output":{"stdout_bytes":0,"stderr_bytes":0,"start":0,"end":0}}"#
        );
        state.failed = Some(StartFailure::new(
            StartFailKind::NotFound,
            "x: command not found",
        ));
        let json = serde_json::to_string(&state).unwrap();
        assert!(
            json.ends_with(r#","failed":{"kind":"not_found","message":"x: command not found"}}"#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<ExecState>(&json).unwrap(), state);
        // The refusals keep their shape; a newer kind reads as internal.
        let refused = serde_json::to_string(&AgentMsg::ExecFailed {
            exec_id: "e".into(),
            kind: ExecFailKind::NoSuchUser,
            message: "bob".into(),
        })
        .unwrap();
        assert_eq!(
            refused,
            r#"{"type":"exec_failed","exec_id":"e","kind":"no_such_user","message":"bob"}"#
        );
        let newer: AgentMsg = serde_json::from_str(
            r#"{"type":"exec_failed","exec_id":"e","kind":"quota","message":"m"}"#,
        )
        .unwrap();
        assert!(matches!(
            newer,
            AgentMsg::ExecFailed {
                kind: ExecFailKind::Internal,
                ..
            }
        ));
    }

    /// Pins the wire shape of file operations.
    #[test]
    fn fs_schema_snapshot() {
        let write = serde_json::to_string(&HostMsg::Fs {
            id: "f1".into(),
            op: FsOp::Write {
                path: "/a".into(),
                mode: Some(0o644),
                parents: true,
                owner: None,
                in_place: false,
                xattrs: None,
            },
        })
        .unwrap();
        assert_eq!(
            write,
            r#"{"type":"fs","id":"f1","op":{"op":"write","path":"/a","mode":420,"parents":true,"owner":null}}"#
        );
        let grep = serde_json::to_string(&FsOp::Grep(GrepSpec {
            path: "/w".into(),
            pattern: "x".into(),
            literal: false,
            recursive: true,
            ignore_case: false,
            include: vec!["*.rs".into()],
            exclude: vec![],
            max_matches: Some(5),
            max_line_bytes: None,
        }))
        .unwrap();
        assert_eq!(
            grep,
            r#"{"op":"grep","path":"/w","pattern":"x","literal":false,"recursive":true,"ignore_case":false,"include":["*.rs"],"exclude":[],"max_matches":5,"max_line_bytes":null}"#
        );
        let end = serde_json::to_string(&HostMsg::FsEnd { id: "f1".into() }).unwrap();
        assert_eq!(end, r#"{"type":"fs_end","id":"f1"}"#);
        let entry = FsEntry {
            name: "a".into(),
            path: "/a".into(),
            kind: FsKind::File,
            size: 3,
            mode: 0o644,
            uid: 0,
            gid: 0,
            mtime_ns: 1,
            target: None,
            target_kind: None,
            resolved: None,
            xattrs: Default::default(),
        };
        let done = serde_json::to_string(&AgentMsg::FsDone {
            id: "f1".into(),
            result: FsResult::Written {
                entry,
                bytes: 3,
                created: true,
            },
        })
        .unwrap();
        assert_eq!(
            done,
            r#"{"type":"fs_done","id":"f1","result":{"kind":"written","entry":{"name":"a","path":"/a","type":"file","size":3,"mode":420,"uid":0,"gid":0,"mtime_ns":1,"target":null},"bytes":3,"created":true}}"#
        );
        let opened = serde_json::to_string(&AgentMsg::FsOpened {
            id: "f1".into(),
            size: 9,
            offset: 2,
            length: Some(7),
        })
        .unwrap();
        assert_eq!(
            opened,
            r#"{"type":"fs_opened","id":"f1","size":9,"offset":2,"length":7}"#
        );
        let err = serde_json::to_string(&AgentMsg::FsError {
            id: "f1".into(),
            error: FsFailure::new(FsErrorCode::NotEmpty, "/d: not empty").param("path"),
        })
        .unwrap();
        assert_eq!(
            err,
            r#"{"type":"fs_error","id":"f1","error":{"code":"not_empty","message":"/d: not empty","param":"path"}}"#
        );
        // An op from a newer node is understood as one this agent does not know.
        let newer: HostMsg =
            serde_json::from_str(r#"{"type":"fs","id":"f2","op":{"op":"compress","path":"/"}}"#)
                .unwrap();
        assert_eq!(
            newer,
            HostMsg::Fs {
                id: "f2".into(),
                op: FsOp::Unknown
            }
        );
    }

    /// Pins the wire shape of watches (feature `watch`).
    #[test]
    fn watch_schema_snapshot() {
        let w = serde_json::to_string(&HostMsg::Watch {
            id: "w".into(),
            path: "/d".into(),
            recursive: true,
        })
        .unwrap();
        assert_eq!(
            w,
            r#"{"type":"watch","id":"w","path":"/d","recursive":true}"#
        );
        let ev = serde_json::to_string(&AgentMsg::WatchEvents {
            id: "w".into(),
            events: vec![WatchEvent {
                name: "a/b".into(),
                kind: WatchKind::Create,
            }],
            overflow: false,
        })
        .unwrap();
        assert_eq!(
            ev,
            r#"{"type":"watch_events","id":"w","events":[{"name":"a/b","kind":"create"}],"overflow":false}"#
        );
        let newer: WatchEvent = serde_json::from_str(r#"{"name":"x","kind":"open"}"#).unwrap();
        assert_eq!(newer.kind, WatchKind::Other);
        // The additive fields stay off the wire when unset: an older agent reads the same.
        let list = serde_json::to_string(&FsOp::List {
            path: "/".into(),
            limit: None,
            depth: None,
        })
        .unwrap();
        assert_eq!(list, r#"{"op":"list","path":"/","limit":null}"#);
        assert_eq!(
            serde_json::to_string(&FsOp::Users).unwrap(),
            r#"{"op":"users"}"#
        );
    }

    #[tokio::test]
    async fn file_data_frames_round_trip() {
        let buf = encode_data("f1", Stream::File, 1 << 40, b"\x00bin");
        let mut r = &buf[..];
        let f: Frame<AgentMsg> = read_frame(&mut r).await.unwrap().unwrap();
        assert_eq!(
            f,
            Frame::Data {
                exec_id: "f1".into(),
                stream: Stream::File,
                pos: 1 << 40,
                bytes: b"\x00bin".to_vec()
            }
        );
    }
}
