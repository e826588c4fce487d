//! Terminals: a session bound to a kept command that runs on a PTY (`tty: true`), in terms of
//! the API (input bytes, a size, output bytes and the command's end), so that a front end never
//! speaks the agent's protocol.
//!
//! A session is opened in two steps: [`Node::terminal`] checks the command (before a front end
//! commits to a session, e.g. upgrades to a WebSocket), and [`TerminalTarget::open`] connects
//! to the sandbox's agent and attaches to the command's output (once the front end holds the
//! sandbox awake). The agent's frames are read by a task of their own into a bounded channel: a
//! read is never cut midway by the session doing something else, so output bytes are never
//! taken for a frame's header.

use std::path::PathBuf;
use std::time::Duration;

use sbx_api::exec::ExecStatus;
use sbx_api::ApiError;
use sbx_proto::{AgentMsg, Frame, HostMsg};
use tokio::sync::mpsc;

use crate::agent::{AgentConn, AgentError};
use crate::node::Node;

/// Frames of the agent read ahead of the session.
const OUTPUT_QUEUE: usize = 8;
/// How long connecting to the agent (and reading its hello) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A terminal session ended: the sandbox's agent could not be reached, refused a message or
/// closed the connection.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct TerminalError(#[from] AgentError);

/// What the command on a terminal did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TerminalEvent {
    /// Bytes it wrote to the terminal, in order (from the position the session was opened
    /// with, then as they come).
    Output(Vec<u8>),
    /// It ended; nothing follows.
    Exit {
        status: ExecStatus,
        exit_code: i32,
        /// The signal number that ended it, if one did.
        signal: Option<i32>,
    },
}

/// A command checked to run on a terminal, not connected to yet.
#[derive(Debug, Clone)]
pub struct TerminalTarget {
    socket: PathBuf,
    exec_id: String,
}

impl Node {
    /// The terminal of command `exec_id` of kept sandbox `id`: 404 for an unknown sandbox or
    /// command, 400 invalid_field (`exec_id`) for a command without a terminal, 409 when the
    /// sandbox does not run or the command has ended.
    pub fn terminal(&self, id: &str, exec_id: &str) -> Result<TerminalTarget, ApiError> {
        let socket = self.terminal_socket(id, exec_id)?;
        Ok(TerminalTarget {
            socket,
            exec_id: exec_id.to_string(),
        })
    }
}

impl TerminalTarget {
    /// Connects to the command: its output from position `from` (0 replays what is kept of
    /// the screen so far), then as it comes, then its end.
    pub async fn open(self, from: u64) -> Result<Terminal, TerminalError> {
        let mut output = AgentConn::connect(&self.socket, CONNECT_TIMEOUT).await?;
        let input = AgentConn::connect(&self.socket, CONNECT_TIMEOUT).await?;
        output
            .send(&HostMsg::Attach {
                exec_id: self.exec_id.clone(),
                from,
            })
            .await?;
        let (reader, frames) = read_output(output);
        Ok(Terminal {
            input,
            exec_id: self.exec_id,
            frames,
            _reader: reader,
        })
    }
}

/// An open terminal session. Dropping it ends the session (the command goes on).
pub struct Terminal {
    input: AgentConn,
    exec_id: String,
    frames: mpsc::Receiver<Result<Frame<AgentMsg>, AgentError>>,
    _reader: AbortOnDrop,
}

impl Terminal {
    /// Writes `bytes` to the terminal (in frames of at most the agent's data limit).
    pub async fn input(&mut self, bytes: &[u8]) -> Result<(), TerminalError> {
        for chunk in bytes.chunks(sbx_proto::MAX_DATA) {
            self.input.send_stdin(&self.exec_id, chunk).await?;
        }
        Ok(())
    }

    /// A new size of the terminal, each side within 1 to 1000.
    pub async fn resize(&mut self, rows: u16, cols: u16) -> Result<(), TerminalError> {
        self.input
            .send(&HostMsg::Resize {
                exec_id: self.exec_id.clone(),
                rows: rows.clamp(1, 1000),
                cols: cols.clamp(1, 1000),
            })
            .await?;
        Ok(())
    }

    /// The next thing the command did; an error when the agent's connection ends before its
    /// end. Cancel-safe: a call dropped before it returns loses nothing (frames are read whole
    /// by a task of their own), so it can race other work in a `select!`.
    pub async fn next_event(&mut self) -> Result<TerminalEvent, TerminalError> {
        loop {
            let Some(frame) = self.frames.recv().await else {
                return Err(TerminalError(AgentError::Closed));
            };
            match frame? {
                Frame::Data { bytes, .. } => return Ok(TerminalEvent::Output(bytes)),
                Frame::Msg(AgentMsg::Exited { exit, .. }) => {
                    return Ok(TerminalEvent::Exit {
                        status: crate::node::output::ExitStatus::from(exit.status).exec_status(),
                        exit_code: exit.exit_code,
                        signal: exit.signal,
                    })
                }
                Frame::Msg(_) => {}
            }
        }
    }
}

/// Aborts the task it holds when dropped: the reader of the agent's frames ends with its
/// session.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Reads the agent's frames on `output` whole and hands them to the session, until the agent
/// ends the connection (its error goes last) or the session is gone.
fn read_output(
    mut output: AgentConn,
) -> (
    AbortOnDrop,
    mpsc::Receiver<Result<Frame<AgentMsg>, AgentError>>,
) {
    let (tx, rx) = mpsc::channel(OUTPUT_QUEUE);
    let task = tokio::spawn(async move {
        loop {
            let frame = output.recv().await;
            let end = frame.is_err();
            if tx.send(frame).await.is_err() || end {
                return;
            }
        }
    });
    (AbortOnDrop(task), rx)
}
