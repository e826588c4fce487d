//! The node's side of a connection to a sandbox's agent.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use crate::sync::LockExt;

pub mod files;
pub mod watch;

use sbx_api::exec::ExecFailKind;
use sbx_proto::{
    read_frame, AgentMsg, Frame, HostMsg, Program, ProtoError, StartFailKind, Stream, PROTO_VERSION,
};
use sbx_runtime::sock::{Conn, ReadHalf, WriteHalf};
use tokio::io::BufReader;

/// What the agent runs for a command of the API: a string through `/bin/sh -c`, a list as argv.
/// The one conversion, for runs, execs and start commands.
pub fn program(c: &sbx_api::Command) -> Program {
    match c {
        sbx_api::Command::Shell(s) => Program::Shell(s.clone()),
        sbx_api::Command::Argv(a) => Program::Argv(a.clone()),
    }
}

/// The API's kind of a command the agent could not execute. The one conversion from the
/// protocol's kind (sbx-api and sbx-proto do not depend on each other, so it lives here).
pub(crate) fn start_fail_kind(k: StartFailKind) -> ExecFailKind {
    match k {
        StartFailKind::CwdMissing => ExecFailKind::CwdMissing,
        StartFailKind::CwdNotDirectory => ExecFailKind::CwdNotDirectory,
        StartFailKind::NotFound => ExecFailKind::NotFound,
        StartFailKind::Permission => ExecFailKind::Permission,
        StartFailKind::NotExecutable => ExecFailKind::NotExecutable,
        StartFailKind::Other => ExecFailKind::Other,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("cannot reach the sandbox's agent: {0}")]
    Connect(std::io::Error),
    #[error("the agent did not answer in time")]
    Timeout,
    #[error("the agent speaks protocol {0}, this node {PROTO_VERSION}")]
    Version(u32),
    #[error("the agent closed the connection")]
    Closed,
    #[error("agent protocol: {0}")]
    Proto(#[from] ProtoError),
}

impl AgentError {
    /// A message over the agent's frame limit (nothing was sent): the request's size, not a
    /// fault of the agent. 400 invalid_field on `param`.
    pub fn too_large(&self, param: &str) -> Option<sbx_api::ApiError> {
        match self {
            AgentError::Proto(ProtoError::TooLarge(n)) => Some(sbx_api::ApiError::invalid_field(
                param,
                format!(
                    "the {param} with its env and cwd comes to {n} bytes for the sandbox's agent, over its limit of {} bytes",
                    sbx_proto::MAX_FRAME
                ),
            )),
            _ => None,
        }
    }
}

pub struct AgentConn {
    rd: BufReader<ReadHalf>,
    wr: WriteHalf,
    socket: PathBuf,
    /// The agent takes [`sbx_proto::ExecSpec::stdin_null`] (its hello says so).
    stdin_null: bool,
    /// The agent serves file operations ([`sbx_proto::FEATURE_FS`]).
    fs: bool,
    /// The agent serves watches and the file operations of [`sbx_proto::FEATURE_WATCH`].
    watch: bool,
    xattrs: bool,
    /// The agent serves `/run/sbx/awake` ([`sbx_proto::FEATURE_AWAKE`]).
    awake: bool,
    /// The agent watches the node's lease ([`sbx_proto::FEATURE_LEASE`]).
    lease: bool,
}

/// Connections whose exchanges are all over, by agent socket: the next operation on the same
/// agent takes one instead of connecting and reading a hello again.
static IDLE: LazyLock<Mutex<HashMap<PathBuf, Vec<AgentConn>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));
/// Idle connections kept per agent, and in all.
const IDLE_PER_AGENT: usize = 4;
const IDLE_MAX: usize = 256;
static RELEASES: AtomicUsize = AtomicUsize::new(0);

impl AgentConn {
    /// Connects and reads the agent's hello.
    pub async fn connect(socket: &Path, timeout: Duration) -> Result<AgentConn, AgentError> {
        // Registered for reading only: the agent reading a request does not wake this side.
        let stream = Conn::connect(socket).await.map_err(AgentError::Connect)?;
        let (rd, wr) = stream.into_split();
        let mut conn = AgentConn {
            rd: BufReader::with_capacity(256 << 10, rd),
            wr,
            socket: socket.to_path_buf(),
            stdin_null: false,
            fs: false,
            watch: false,
            xattrs: false,
            awake: false,
            lease: false,
        };
        let hello = tokio::time::timeout(timeout, conn.recv())
            .await
            .map_err(|_| AgentError::Timeout)??;
        match hello {
            Frame::Msg(AgentMsg::Hello {
                version, features, ..
            }) if version == PROTO_VERSION => {
                conn.stdin_null = features.iter().any(|f| f == sbx_proto::FEATURE_STDIN_NULL);
                conn.fs = features.iter().any(|f| f == sbx_proto::FEATURE_FS);
                conn.watch = features.iter().any(|f| f == sbx_proto::FEATURE_WATCH);
                conn.xattrs = features.iter().any(|f| f == sbx_proto::FEATURE_XATTRS);
                conn.awake = features.iter().any(|f| f == sbx_proto::FEATURE_AWAKE);
                conn.lease = features.iter().any(|f| f == sbx_proto::FEATURE_LEASE);
                Ok(conn)
            }
            Frame::Msg(AgentMsg::Hello { version, .. }) => Err(AgentError::Version(version)),
            _ => Err(AgentError::Proto(ProtoError::Malformed(
                "no hello from the agent".into(),
            ))),
        }
    }

    /// Whether a command given no input can be started with no stdin at all
    /// ([`sbx_proto::ExecSpec::stdin_null`]), so that no `CloseStdin` has to follow.
    pub(crate) fn takes_stdin_null(&self) -> bool {
        self.stdin_null
    }

    /// Whether the agent serves file operations (see [`files`]).
    pub(crate) fn serves_fs(&self) -> bool {
        self.fs
    }

    /// Whether the agent serves watches, `List`'s depth, `Write`'s `in_place` and `Users`
    /// ([`sbx_proto::FEATURE_WATCH`]).
    pub(crate) fn serves_watch(&self) -> bool {
        self.watch
    }

    /// Whether the agent's entries carry extended attributes and resolved symlinks, and it
    /// writes attributes ([`sbx_proto::FEATURE_XATTRS`]).
    pub(crate) fn serves_xattrs(&self) -> bool {
        self.xattrs
    }

    /// The connection's two halves, for a stream that reads and writes at once (an upload).
    fn into_parts(self) -> (BufReader<ReadHalf>, WriteHalf) {
        (self.rd, self.wr)
    }

    /// An idle connection to the agent at `socket` if there is one (see [`AgentConn::release`]),
    /// else a new one.
    pub async fn open(socket: &Path, timeout: Duration) -> Result<AgentConn, AgentError> {
        match take_idle(socket) {
            Some(c) => Ok(c),
            None => AgentConn::connect(socket, timeout).await,
        }
    }

    /// Gives back a connection on which every answer was read and nothing is streaming, for
    /// the next operation on the same agent.
    pub fn release(self) {
        if !self.clean() {
            return;
        }
        let mut idle = IDLE.locked();
        // Connections to agents that are gone (their sandbox ended) are dropped now and then
        // (each costs a poll), and whenever the idle set is full.
        let sweep = RELEASES.fetch_add(1, Ordering::Relaxed).is_multiple_of(64);
        if sweep || idle.values().map(Vec::len).sum::<usize>() >= IDLE_MAX {
            idle.retain(|_, conns| {
                conns.retain(AgentConn::clean);
                !conns.is_empty()
            });
            if idle.values().map(Vec::len).sum::<usize>() >= IDLE_MAX {
                return;
            }
        }
        let conns = idle.entry(self.socket.clone()).or_default();
        if conns.len() < IDLE_PER_AGENT {
            conns.push(self);
        }
    }

    /// Nothing to read: no frame left over, and the agent has not closed its end.
    fn clean(&self) -> bool {
        self.rd.buffer().is_empty() && !sbx_runtime::process::readable_now(self.rd.get_ref())
    }

    pub async fn send(&mut self, msg: &HostMsg) -> Result<(), AgentError> {
        sbx_proto::write_msg(&mut self.wr, msg).await?;
        Ok(())
    }

    pub async fn send_stdin(&mut self, exec_id: &str, bytes: &[u8]) -> Result<(), AgentError> {
        sbx_proto::write_data(&mut self.wr, exec_id, Stream::Stdin, 0, bytes).await?;
        Ok(())
    }

    /// The next frame from the agent.
    pub async fn recv(&mut self) -> Result<Frame<AgentMsg>, AgentError> {
        match read_frame::<AgentMsg, _>(&mut self.rd).await? {
            Some(f) => Ok(f),
            None => Err(AgentError::Closed),
        }
    }
}

impl AgentConn {
    /// Sends `msg` and returns the agent's next message (data frames before it are skipped).
    pub async fn request(&mut self, msg: &HostMsg) -> Result<AgentMsg, AgentError> {
        self.send(msg).await?;
        loop {
            if let Frame::Msg(m) = self.recv().await? {
                return Ok(m);
            }
        }
    }
}

fn take_idle(socket: &Path) -> Option<AgentConn> {
    let mut idle = IDLE.locked();
    let conns = idle.get_mut(socket)?;
    while let Some(c) = conns.pop() {
        if c.clean() {
            return Some(c);
        }
    }
    idle.remove(socket);
    None
}

/// Closes the idle connections to the agent at `socket`: before a checkpoint, since an open
/// connection to the node is a peer outside the sandbox, which CRIU refuses; and when the
/// sandbox ends.
pub(crate) fn close_idle(socket: &Path) {
    IDLE.locked().remove(socket);
}

/// Makes the agent dumpable (`true`, just before a checkpoint: CRIU needs it) or not again
/// (after a wake); on a connection of its own, closed after the answer.
pub async fn set_dumpable(socket: &Path, dumpable: bool) -> Result<(), AgentError> {
    let mut c = AgentConn::connect(socket, Duration::from_secs(5)).await?;
    let answer = tokio::time::timeout(
        Duration::from_secs(10),
        c.request(&HostMsg::SetDumpable { dumpable }),
    )
    .await
    .map_err(|_| AgentError::Timeout)??;
    match answer {
        AgentMsg::Dumpable { dumpable: now } if now == dumpable => Ok(()),
        _ => Err(AgentError::Closed),
    }
}

/// Forgets the idle connections to the agents under `dir`: a test that plays a node's restart
/// in one process starts the next node as a new process would, without the first node's
/// connections (they belong to its runtime, which is gone).
#[cfg(test)]
pub(crate) fn forget_idle_under(dir: &Path) {
    IDLE.locked().retain(|socket, _| !socket.starts_with(dir));
}

/// One request and its answer, on an idle connection or a new one (given back after the
/// answer); the answer within 10 s (`Wait` excepted: its answer comes when the command ends,
/// and the caller bounds it).
pub(crate) async fn one_shot(socket: &Path, msg: &HostMsg) -> Result<AgentMsg, AgentError> {
    let mut c = AgentConn::open(socket, Duration::from_secs(5)).await?;
    let answer = if matches!(msg, HostMsg::Wait { .. }) {
        c.request(msg).await?
    } else {
        tokio::time::timeout(Duration::from_secs(10), c.request(msg))
            .await
            .map_err(|_| AgentError::Timeout)??
    };
    c.release();
    Ok(answer)
}

/// The holds programs of a sandbox raise on `/run/sbx/awake`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Holds {
    /// Holds raised now.
    pub holds: u32,
    /// Programs connected (told before the sandbox stops).
    pub connected: u32,
    /// How long ago the last hold was lowered, in milliseconds.
    pub lowered_ms_ago: Option<u64>,
}

/// What is held in the sandbox of the agent at `socket`; with `notice_ms`, the programs
/// connected are first told `sleep N`. An agent that serves no awake socket holds nothing.
pub async fn holds(socket: &Path, notice_ms: Option<u32>) -> Result<Holds, AgentError> {
    let mut c = AgentConn::open(socket, Duration::from_secs(5)).await?;
    if !c.awake {
        c.release();
        return Ok(Holds::default());
    }
    let answer = tokio::time::timeout(
        Duration::from_secs(10),
        c.request(&HostMsg::Awake { notice_ms }),
    )
    .await
    .map_err(|_| AgentError::Timeout)??;
    c.release();
    match answer {
        AgentMsg::Awake {
            holds,
            connected,
            lowered_ms_ago,
        } => Ok(Holds {
            holds,
            connected,
            lowered_ms_ago,
        }),
        _ => Err(AgentError::Closed),
    }
}

/// Tells the agent at `socket` the node's lease (`until_ms`: CLOCK_BOOTTIME milliseconds;
/// see [`sbx_proto::HostMsg::Lease`]): whether the sandbox's processes are stopped after it;
/// `None` for an agent that does not watch leases (an older one: it is told nothing).
pub async fn lease(socket: &Path, until_ms: Option<u64>) -> Result<Option<bool>, AgentError> {
    let mut c = AgentConn::open(socket, Duration::from_secs(2)).await?;
    if !c.lease {
        c.release();
        return Ok(None);
    }
    let answer = tokio::time::timeout(
        Duration::from_secs(2),
        c.request(&HostMsg::Lease { until_ms }),
    )
    .await
    .map_err(|_| AgentError::Timeout)??;
    c.release();
    match answer {
        AgentMsg::Leased { stopped } => Ok(Some(stopped)),
        _ => Err(AgentError::Closed),
    }
}

/// Sends a signal to a command's process group (and waits until the agent has sent it).
pub async fn signal(socket: &Path, exec_id: &str, signal: i32) -> Result<(), AgentError> {
    let mut c = AgentConn::connect(socket, Duration::from_secs(5)).await?;
    c.send(&HostMsg::Signal {
        exec_id: exec_id.into(),
        signal,
    })
    .await?;
    tokio::time::timeout(
        Duration::from_secs(10),
        c.request(&HostMsg::Sync { token: 0 }),
    )
    .await
    .map_err(|_| AgentError::Timeout)??;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kind of a failed start is the API's kind of the same name.
    #[test]
    fn start_fail_kinds_keep_their_names() {
        for k in [
            StartFailKind::CwdMissing,
            StartFailKind::CwdNotDirectory,
            StartFailKind::NotFound,
            StartFailKind::Permission,
            StartFailKind::NotExecutable,
            StartFailKind::Other,
        ] {
            assert_eq!(
                serde_json::to_value(k).unwrap(),
                serde_json::to_value(start_fail_kind(k)).unwrap()
            );
        }
    }
}
