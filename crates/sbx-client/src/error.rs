//! What a call can fail with: the node's refusal, read from its error body into a
//! [`NodeError`], apart from failures to reach it or to read what it said.

use std::time::Duration;

use sbx_api::{ErrorBody, ErrorCode};
use serde_json::Value;

/// A failed call.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The node answered with its error body (`{error: {type, code, message, ...}}`); also an
    /// `error` event that ends a stream.
    #[error("{0}")]
    Node(Box<NodeError>),
    /// The node answered a status without an error body the API describes (a proxy's page,
    /// an empty body).
    #[error("the node answered {status}")]
    Status {
        /// The HTTP status.
        status: u16,
        /// The body as text (cut to 4 KiB).
        body: String,
    },
    /// The node could not be reached, or the connection broke before an answer.
    #[error("cannot reach the node: {0}")]
    Transport(String),
    /// An answer that is not the shape the API gives.
    #[error("the node's answer: {0}")]
    Decode(String),
    /// Reading or writing a body (a stream, a file sent) failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// An event stream ended before its last event, and could not be read on from where it
    /// stopped (a `/v1/run` stream, whose sandbox ends with it; or every reconnection failed).
    #[error("the node's stream ended without its last event (after {reconnects} reconnections)")]
    StreamEnded {
        /// How many times it was read on from where it stopped before giving up.
        reconnects: u32,
    },
}

impl Error {
    /// The node's error, when it is one.
    pub fn node(&self) -> Option<&NodeError> {
        match self {
            Error::Node(e) => Some(e),
            _ => None,
        }
    }

    /// The API's code of the node's error, when it is one this client knows.
    pub fn code(&self) -> Option<ErrorCode> {
        self.node().and_then(|e| e.code.api())
    }

    /// Whether the same call may succeed later: the node's `retryable`, and transport
    /// failures (the node may be back).
    pub fn retryable(&self) -> bool {
        match self {
            Error::Node(e) => e.retryable,
            Error::Transport(_) => true,
            _ => false,
        }
    }
}

/// Which failure: one of the API's codes, or one this client does not know (an S-code of the
/// functions interface, a pull's `registry_auth_failed`, a code of a newer node).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Code {
    Api(ErrorCode),
    Other(String),
}

impl Code {
    /// The code of its wire name.
    pub fn of(s: &str) -> Code {
        match ErrorCode::from_code(s) {
            Some(c) => Code::Api(c),
            None => Code::Other(s.to_string()),
        }
    }

    /// As the wire writes it.
    pub fn as_str(&self) -> &str {
        match self {
            Code::Api(c) => c.as_str(),
            Code::Other(s) => s,
        }
    }

    /// The API's code, when it is one.
    pub fn api(&self) -> Option<ErrorCode> {
        match self {
            Code::Api(c) => Some(*c),
            Code::Other(_) => None,
        }
    }
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The node's error answer, typed. Its `Display` is `code: message`, with ` (param P)` when
/// a field is at fault.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeError {
    /// The HTTP status of the answer (for an `error` event, the status of its code).
    pub status: u16,
    /// The kind of failure (`invalid_request`, `not_found`, ...).
    pub kind: String,
    pub code: Code,
    /// For people. English.
    pub message: String,
    /// The field or query parameter at fault.
    pub param: Option<String>,
    /// Whether the same request may succeed later without anything else changing.
    pub retryable: bool,
    /// The id the node knows the request by (its log has the reason of an `internal`).
    pub request_id: Option<String>,
    pub docs_url: Option<String>,
    /// `Retry-After`, when the answer has one.
    pub retry_after: Option<Duration>,
    /// The body as the node wrote it (with the keys beside `error`: `allowed_hosts`, ...).
    pub body: Value,
}

impl NodeError {
    /// The error of a body, if it is the API's error body.
    pub fn from_body(status: u16, body: Value) -> Option<NodeError> {
        let b: ErrorBody = serde_json::from_value(body.clone()).ok()?;
        let e = b.error;
        let status = match (status, ErrorCode::from_code(&e.code)) {
            (0, Some(c)) => c.status(),
            (s, _) => s,
        };
        Some(NodeError {
            status,
            kind: e.kind,
            code: Code::of(&e.code),
            message: e.message,
            param: e.param,
            retryable: e.retryable,
            request_id: e.request_id,
            docs_url: e.docs_url,
            retry_after: None,
            body,
        })
    }
}

impl std::fmt::Display for NodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.message)?;
        if let Some(p) = &self.param {
            write!(f, " (param {p})")?;
        }
        Ok(())
    }
}

impl std::error::Error for NodeError {}

/// The most of a body that is not an error body an [`Error::Status`] keeps.
const STATUS_BODY_MAX: usize = 4096;

/// The error of a failed ureq call: the node's error body, a bare status, or the transport.
pub(crate) fn of_ureq(e: ureq::Error) -> Error {
    match e {
        ureq::Error::Status(status, resp) => {
            let retry_after = resp
                .header("retry-after")
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(Duration::from_secs);
            let text = resp.into_string().unwrap_or_default();
            match serde_json::from_str::<Value>(&text)
                .ok()
                .and_then(|v| NodeError::from_body(status, v))
            {
                Some(mut n) => {
                    n.retry_after = retry_after;
                    Error::Node(Box::new(n))
                }
                None => Error::Status {
                    status,
                    body: cut(text, STATUS_BODY_MAX),
                },
            }
        }
        ureq::Error::Transport(t) => Error::Transport(t.to_string()),
    }
}

fn cut(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut at = max;
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        s.truncate(at);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_error_body_is_typed() {
        let body = json!({"error": {"type": "invalid_request", "code": "invalid_name",
            "message": "bad", "param": "name", "retryable": false, "request_id": "req-1",
            "docs_url": null}});
        let e = NodeError::from_body(400, body.clone()).unwrap();
        assert_eq!(e.code, Code::Api(ErrorCode::InvalidName));
        assert_eq!(e.to_string(), "invalid_name: bad (param name)");
        assert_eq!(e.body, body);
        let s = NodeError::from_body(
            0,
            json!({"error": {"type": "filesystem", "code": "S211", "message": "m",
                "retryable": false, "docs_url": null}}),
        )
        .unwrap();
        assert_eq!(s.code, Code::Other("S211".into()));
        assert_eq!(s.to_string(), "S211: m");
        assert!(NodeError::from_body(500, json!({"oops": 1})).is_none());
        // An error event's status is its code's.
        let ev = NodeError::from_body(
            0,
            json!({"error": {"type": "conflict", "code": "command_lost", "message": "m",
                "param": null, "retryable": false, "request_id": "r", "docs_url": null}}),
        )
        .unwrap();
        assert_eq!(ev.status, 409);
    }
}
