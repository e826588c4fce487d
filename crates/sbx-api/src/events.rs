//! Server-sent events: the kinds a run's stream carries and their framing.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::fmt;

/// The kinds of event of a command's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// The command started.
    Start,
    /// Bytes it wrote to stdout.
    Stdout,
    /// Bytes it wrote to stderr.
    Stderr,
    /// Output that is no longer kept was skipped.
    Gap,
    /// The command ended: the last event of a stream that went well.
    Exit,
    /// The stream ends with a failure (its data is an error body).
    Error,
}

impl EventKind {
    /// Every kind.
    pub const ALL: [EventKind; 6] = [
        EventKind::Start,
        EventKind::Stdout,
        EventKind::Stderr,
        EventKind::Gap,
        EventKind::Exit,
        EventKind::Error,
    ];

    /// The kind as written after `event: `.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Start => "start",
            EventKind::Stdout => "stdout",
            EventKind::Stderr => "stderr",
            EventKind::Gap => "gap",
            EventKind::Exit => "exit",
            EventKind::Error => "error",
        }
    }

    /// The kind of its name, if it is one.
    pub fn from_name(s: &str) -> Option<EventKind> {
        EventKind::ALL.iter().copied().find(|k| k.as_str() == s)
    }

    /// Whether a stream ends with this event.
    pub fn is_final(self) -> bool {
        matches!(self, EventKind::Exit | EventKind::Error)
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The data of a `stdout` or `stderr` event: the text (or base64) of the bytes from
/// `position` on. The event's id is the position after them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputData {
    pub data: String,
    pub position: u64,
}

/// The data of a `gap` event: output from `from` to `to` is no longer kept. Its id is `to`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GapData {
    pub from: u64,
    pub to: u64,
}

/// The content type of an event stream.
pub const SSE_CONTENT_TYPE: &str = "text/event-stream";

/// A comment line that keeps a quiet stream's connection open; clients ignore it.
pub const SSE_KEEPALIVE: &str = ": keepalive\n\n";

/// One event: `event: KIND\nid: ID\ndata: JSON\n\n`. The data is `data_json` on one line
/// (serde_json escapes every line break inside strings). Line breaks in `kind` are dropped so
/// that it cannot split the frame.
pub fn sse_event(kind: &str, id: u64, data_json: &Value) -> String {
    let data = serde_json::to_string(data_json).unwrap_or_else(|_| "null".to_owned());
    let kind: String = kind.chars().filter(|c| *c != '\n' && *c != '\r').collect();
    format!("event: {kind}\nid: {id}\ndata: {data}\n\n")
}

/// [`sse_event`] with a typed kind.
pub fn sse(kind: EventKind, id: u64, data_json: &Value) -> String {
    sse_event(kind.as_str(), id, data_json)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn frames_one_event() {
        let s = sse_event("stdout", 42, &json!({"data": "a\nb\r\n", "n": 1}));
        assert_eq!(
            s,
            "event: stdout\nid: 42\ndata: {\"data\":\"a\\nb\\r\\n\",\"n\":1}\n\n"
        );
        assert_eq!(s.matches('\n').count(), 4);
    }

    #[test]
    fn typed_kinds() {
        assert_eq!(
            sse(EventKind::Exit, 0, &json!(null)),
            "event: exit\nid: 0\ndata: null\n\n"
        );
        for k in EventKind::ALL {
            assert_eq!(EventKind::from_name(k.as_str()), Some(k));
            assert_eq!(serde_json::to_value(k).unwrap(), json!(k.as_str()));
            assert_eq!(k.to_string(), k.as_str());
        }
        assert_eq!(EventKind::from_name("end"), None);
        assert!(EventKind::Exit.is_final());
        assert!(EventKind::Error.is_final());
        assert!(!EventKind::Gap.is_final());
    }

    #[test]
    fn kind_cannot_split_the_frame() {
        assert_eq!(
            sse_event("std\nout\r", 1, &json!(1)),
            "event: stdout\nid: 1\ndata: 1\n\n"
        );
    }

    #[test]
    fn keepalive_is_a_comment() {
        assert!(SSE_KEEPALIVE.starts_with(':'));
        assert!(SSE_KEEPALIVE.ends_with("\n\n"));
    }
}
