//! A command's terminal: the WebSocket of `GET …/exec/{exec_id}/terminal` (a command started
//! with `tty: true`). Input goes as binary messages, a resize as a text control; output comes
//! as binary messages (from `from`, so the screen so far is replayed), then the exit.

use std::net::TcpStream;
use std::time::Duration;

use serde_json::json;
use tungstenite::stream::MaybeTlsStream;
use tungstenite::{Message, WebSocket};

use crate::answers::TerminalExit;
use crate::Error;

/// What a read of the terminal gives.
#[derive(Clone, Debug, PartialEq)]
pub enum TerminalEvent {
    /// Bytes the command wrote.
    Output(Vec<u8>),
    /// The command ended; the node closes the terminal.
    Exit(TerminalExit),
    /// Nothing came within the read timeout ([`Terminal::set_read_timeout`]).
    Idle,
    /// The terminal was closed without an exit.
    Closed,
}

/// An open terminal.
pub struct Terminal {
    ws: WebSocket<MaybeTlsStream<TcpStream>>,
}

fn ws_error(e: tungstenite::Error) -> Error {
    match e {
        tungstenite::Error::Io(e) => Error::Io(e),
        tungstenite::Error::Http(resp) => {
            let status = resp.status().as_u16();
            let body = resp
                .body()
                .as_deref()
                .and_then(|b| serde_json::from_slice(b).ok());
            match body.and_then(|b| crate::NodeError::from_body(status, b)) {
                Some(n) => Error::Node(Box::new(n)),
                None => Error::Status {
                    status,
                    body: String::new(),
                },
            }
        }
        other => Error::Transport(other.to_string()),
    }
}

impl Terminal {
    /// Opens the terminal at `url` (`ws://…`) with the key, if any.
    pub(crate) fn open(url: &str, api_key: Option<&str>) -> Result<Terminal, Error> {
        use tungstenite::client::IntoClientRequest;
        let mut request = url
            .into_client_request()
            .map_err(|e| Error::Transport(e.to_string()))?;
        if let Some(k) = api_key {
            let v = format!("Bearer {k}")
                .parse()
                .map_err(|_| Error::Transport("the API key is not a header value".into()))?;
            request.headers_mut().insert("authorization", v);
        }
        let (ws, _) = tungstenite::connect(request).map_err(ws_error)?;
        Ok(Terminal { ws })
    }

    /// How long a read waits before it answers [`TerminalEvent::Idle`] (`None`: for ever).
    pub fn set_read_timeout(&mut self, t: Option<Duration>) -> Result<(), Error> {
        if let MaybeTlsStream::Plain(s) = self.ws.get_mut() {
            s.set_read_timeout(t)?;
        }
        Ok(())
    }

    /// Sends input.
    pub fn send_input(&mut self, bytes: &[u8]) -> Result<(), Error> {
        self.ws
            .send(Message::Binary(bytes.to_vec().into()))
            .map_err(ws_error)
    }

    /// Tells the node the terminal's size.
    pub fn resize(&mut self, rows: u16, cols: u16) -> Result<(), Error> {
        let m = json!({ "type": "resize", "rows": rows, "cols": cols });
        self.ws
            .send(Message::Text(m.to_string().into()))
            .map_err(ws_error)
    }

    /// The next output, the exit, or [`TerminalEvent::Idle`] when the read timed out.
    pub fn read(&mut self) -> Result<TerminalEvent, Error> {
        loop {
            match self.ws.read() {
                Ok(Message::Binary(b)) => return Ok(TerminalEvent::Output(b.to_vec())),
                Ok(Message::Text(t)) => {
                    let v: serde_json::Value = serde_json::from_str(t.as_str()).unwrap_or_default();
                    if v["type"] == "exit" {
                        let exit = serde_json::from_value(v)
                            .map_err(|e| Error::Decode(format!("a terminal's exit: {e}")))?;
                        return Ok(TerminalEvent::Exit(exit));
                    }
                }
                Ok(Message::Close(_)) => return Ok(TerminalEvent::Closed),
                Ok(_) => {}
                Err(tungstenite::Error::Io(e))
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return Ok(TerminalEvent::Idle)
                }
                Err(tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed) => {
                    return Ok(TerminalEvent::Closed)
                }
                Err(e) => return Err(ws_error(e)),
            }
        }
    }

    /// Closes the terminal (the command goes on).
    pub fn close(mut self) {
        let _ = self.ws.close(None);
        let _ = self.ws.flush();
    }
}
