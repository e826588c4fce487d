//! The node's side of a connection to a sandbox's agent.

use std::path::Path;
use std::time::Duration;

use sbx_proto::{read_frame, AgentMsg, Frame, HostMsg, ProtoError, Stream, PROTO_VERSION};
use tokio::io::BufReader;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;

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

pub struct AgentConn {
    rd: BufReader<OwnedReadHalf>,
    wr: OwnedWriteHalf,
}

impl AgentConn {
    /// Connects and reads the agent's hello.
    pub async fn connect(socket: &Path, timeout: Duration) -> Result<AgentConn, AgentError> {
        let stream = UnixStream::connect(socket)
            .await
            .map_err(AgentError::Connect)?;
        let (rd, wr) = stream.into_split();
        let mut conn = AgentConn {
            rd: BufReader::with_capacity(256 << 10, rd),
            wr,
        };
        let hello = tokio::time::timeout(timeout, conn.recv())
            .await
            .map_err(|_| AgentError::Timeout)??;
        match hello {
            Frame::Msg(AgentMsg::Hello { version, .. }) if version == PROTO_VERSION => Ok(conn),
            Frame::Msg(AgentMsg::Hello { version, .. }) => Err(AgentError::Version(version)),
            _ => Err(AgentError::Proto(ProtoError::Malformed(
                "no hello from the agent".into(),
            ))),
        }
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

/// One request on a connection of its own; its answer within 10 s (`Wait` excepted: its
/// answer comes when the command ends, and the caller bounds it).
pub async fn one_shot(socket: &Path, msg: &HostMsg) -> Result<AgentMsg, AgentError> {
    let mut c = AgentConn::connect(socket, Duration::from_secs(5)).await?;
    if matches!(msg, HostMsg::Wait { .. }) {
        return c.request(msg).await;
    }
    tokio::time::timeout(Duration::from_secs(10), c.request(msg))
        .await
        .map_err(|_| AgentError::Timeout)?
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
