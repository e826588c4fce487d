//! Server-sent events, framed: [`FrameReader`] reads an event stream (`text/event-stream`) into
//! [`Frame`]s as the HTML standard's event-stream interpretation does: `field: value` lines, a
//! blank line ends an event, `data` lines joined by `\n`, comments (`: keepalive`) skipped, an
//! event cut off by the end of the stream dropped. Lines end with `\n` or `\r\n`.
//!
//! It knows nothing of the API's events: the typed readers ([`crate::ExecEvents`],
//! [`crate::PullEvents`]) are built on it, and so is anything that wants the raw frames (a
//! benchmark that counts bytes without parsing them).

use std::io::{self, BufRead};

use serde::de::DeserializeOwned;

/// One event of a stream.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Frame {
    /// Its kind (`event:`), `message` when it names none.
    pub event: String,
    /// Its `id:` field, if it has one.
    pub id: Option<String>,
    /// Its `data:` lines, joined by `\n`.
    pub data: String,
}

impl Frame {
    /// The id as a number (the API's ids are positions in a command's output).
    pub fn id_u64(&self) -> Option<u64> {
        self.id.as_deref().and_then(|i| i.trim().parse().ok())
    }

    /// The data read as JSON, as `T` (the API's events carry a JSON object each).
    pub fn data_as<T: DeserializeOwned>(&self) -> serde_json::Result<T> {
        serde_json::from_str(&self.data)
    }
}

/// Reads frames off a buffered reader, counting the bytes it took.
pub struct FrameReader<R> {
    inner: R,
    line: Vec<u8>,
    bytes: u64,
    /// The stream ended inside an event: after a field of one, or in the middle of a line.
    cut_off: bool,
}

impl<R: BufRead> FrameReader<R> {
    pub fn new(inner: R) -> FrameReader<R> {
        FrameReader {
            inner,
            line: Vec::new(),
            bytes: 0,
            cut_off: false,
        }
    }

    /// Whether the stream ended inside an event (after one of its fields, or in the middle of
    /// a line), the event dropped: a stream the server cut off rather than ended. False until
    /// [`FrameReader::next_frame`] has answered `None`.
    pub fn ended_inside_event(&self) -> bool {
        self.cut_off
    }

    /// Bytes read off the stream so far (what came over the wire).
    pub fn bytes_read(&self) -> u64 {
        self.bytes
    }

    /// The next event; `None` when the stream ends (an event it cut off is dropped); an error
    /// when reading fails (a connection that broke).
    pub fn next_frame(&mut self) -> io::Result<Option<Frame>> {
        let mut frame = Frame::default();
        // The data lines, each with its `\n`, read straight into the event's bytes.
        let mut data: Vec<u8> = Vec::new();
        let mut has_data = false;
        loop {
            // A data line whose field is in the buffer already (the usual case): its value is
            // read into `data` without going through `line`, one copy of output events' bytes.
            let buf = self.inner.fill_buf()?;
            let prefix = if buf.starts_with(b"data: ") {
                6
            } else if buf.len() >= 6 && buf.starts_with(b"data:") {
                5
            } else {
                0
            };
            if prefix > 0 {
                self.inner.consume(prefix);
                let n = self.inner.read_until(b'\n', &mut data)?;
                self.bytes += (prefix + n) as u64;
                if data.pop() != Some(b'\n') {
                    self.cut_off = true;
                    return Ok(None);
                }
                if data.last() == Some(&b'\r') {
                    data.pop();
                }
                data.push(b'\n');
                has_data = true;
                continue;
            }
            self.line.clear();
            let n = self.inner.read_until(b'\n', &mut self.line)?;
            if n == 0 {
                self.cut_off = has_data || !frame.event.is_empty() || frame.id.is_some();
                return Ok(None);
            }
            self.bytes += n as u64;
            let mut line: &[u8] = &self.line;
            if line.last() != Some(&b'\n') {
                // The last line of a stream that ended without its line break: no event
                // ends there.
                self.cut_off = true;
                return Ok(None);
            }
            line = &line[..line.len() - 1];
            if line.last() == Some(&b'\r') {
                line = &line[..line.len() - 1];
            }
            if line.is_empty() {
                if has_data {
                    data.pop();
                    frame.data = match String::from_utf8(data) {
                        Ok(s) => s,
                        Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
                    };
                    if frame.event.is_empty() {
                        frame.event.push_str("message");
                    }
                    return Ok(Some(frame));
                }
                frame = Frame::default();
                continue;
            }
            if line[0] == b':' {
                continue;
            }
            let (field, value) = match line.iter().position(|&b| b == b':') {
                Some(i) => {
                    let v = &line[i + 1..];
                    (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
                }
                None => (line, &b""[..]),
            };
            match field {
                b"data" => {
                    data.extend_from_slice(value);
                    data.push(b'\n');
                    has_data = true;
                }
                b"event" => frame.event = String::from_utf8_lossy(value).into_owned(),
                b"id" if !value.contains(&0) => {
                    frame.id = Some(String::from_utf8_lossy(value).into_owned())
                }
                _ => {}
            }
        }
    }
}

impl<R: BufRead> Iterator for FrameReader<R> {
    type Item = io::Result<Frame>;

    fn next(&mut self) -> Option<io::Result<Frame>> {
        self.next_frame().transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(s: &str) -> Vec<Frame> {
        FrameReader::new(s.as_bytes())
            .collect::<io::Result<Vec<_>>>()
            .unwrap()
    }

    #[test]
    fn events_are_framed_as_the_standard_says() {
        let s = ": keepalive\n\nevent: stdout\nid: 12\ndata: {\"data\":\"a\"}\n\n\
                 data: one\r\ndata:two\r\n\r\nid: 3\n\nevent: exit\ndata: x\n";
        let f = frames(s);
        assert_eq!(f.len(), 2, "{f:?}");
        assert_eq!(
            f[0],
            Frame {
                event: "stdout".into(),
                id: Some("12".into()),
                data: "{\"data\":\"a\"}".into()
            }
        );
        assert_eq!(f[0].id_u64(), Some(12));
        // Two data lines, no event name: a message; an event without data is none; the
        // last one is cut off by the end of the stream.
        assert_eq!(
            (f[1].event.as_str(), f[1].data.as_str(), f[1].id.as_deref()),
            ("message", "one\ntwo", None)
        );
    }

    #[test]
    fn an_empty_data_line_is_an_event() {
        let f = frames("data\n\ndata:\n\n");
        assert_eq!(f.len(), 2);
        assert!(f.iter().all(|f| f.data.is_empty()));
    }

    #[test]
    fn a_small_buffer_frames_the_same() {
        let s = "event: stdout\nid: 1\ndata: {\"a\":1}\r\ndata:x\ndata\n\n\
                 data: caf\u{e9}\n\ndata: cut";
        for cap in [1, 2, 5, 6, 7, 64] {
            let r = FrameReader::new(std::io::BufReader::with_capacity(cap, s.as_bytes()));
            let f: Vec<Frame> = r.collect::<io::Result<_>>().unwrap();
            assert_eq!(f.len(), 2, "{cap}: {f:?}");
            assert_eq!(f[0].data, "{\"a\":1}\nx\n", "{cap}");
            assert_eq!(f[1].data, "caf\u{e9}", "{cap}");
        }
    }

    #[test]
    fn bytes_that_are_not_utf8_are_replaced() {
        let mut r = FrameReader::new(&b"data: a\xffb\n\n"[..]);
        assert_eq!(r.next_frame().unwrap().unwrap().data, "a\u{fffd}b");
    }

    #[test]
    fn a_stream_cut_inside_an_event_is_told_apart() {
        for (s, cut) in [
            ("data: 1\n\n: bye\n", false),
            ("data: 1\n\n", false),
            ("data: 1\n\ndata: 2\n", true),
            ("data: 1\n\nevent: x\n", true),
            ("data: 1\n\nid: 4\n", true),
            ("data: 1\n\ndata: 2", true),
            ("data: 1\n\nevent: x", true),
        ] {
            let mut r = FrameReader::new(s.as_bytes());
            assert_eq!(
                r.next_frame().unwrap().map(|f| f.data),
                Some("1".into()),
                "{s:?}"
            );
            assert!(!r.ended_inside_event(), "{s:?}");
            assert!(r.next_frame().unwrap().is_none(), "{s:?}");
            assert_eq!(r.ended_inside_event(), cut, "{s:?}");
        }
    }

    #[test]
    fn data_is_read_as_json() {
        let f = FrameReader::new(&b"data: {\"a\":\ndata: 1}\n\n"[..])
            .next()
            .unwrap()
            .unwrap();
        let v: serde_json::Value = f.data_as().unwrap();
        assert_eq!(v["a"], 1);
        assert!(Frame::default().data_as::<serde_json::Value>().is_err());
    }

    #[test]
    fn bytes_are_counted() {
        let s = "event: a\ndata: 1\n\n: c\n\n";
        let mut r = FrameReader::new(s.as_bytes());
        assert!(r.next_frame().unwrap().is_some());
        assert!(r.next_frame().unwrap().is_none());
        assert_eq!(r.bytes_read(), s.len() as u64);
    }
}
