//! Event streams of a command: its events as SSE, the output text escaped in bulk (8 bytes at a
//! time), a UTF-8 character cut between chunks carried to the next.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue};
use axum::response::Response;
use sbx_api::{ApiError, Encoding, EventKind};
use tokio::sync::mpsc;

use super::*;
use crate::node::output::{Collected, OutputCounts, Stream};
use crate::node::RunEvent;

pub(super) const KEEPALIVE_EVERY: Duration = Duration::from_secs(5);

/// How many bytes at the end of `b` begin a UTF-8 character that is not complete yet.
pub(super) fn incomplete_suffix(b: &[u8]) -> usize {
    for back in 1..=b.len().min(3) {
        let c = b[b.len() - back];
        if c & 0xC0 == 0x80 {
            continue;
        }
        let need = match c {
            0xF0.. => 4,
            0xE0.. => 3,
            0xC0.. => 2,
            _ => 1,
        };
        return if need > back { back } else { 0 };
    }
    0
}

/// Text of a stream's bytes for an event, keeping a UTF-8 character cut by a chunk for the next.
/// Returns the text (borrowed from `data` when it is valid and nothing was carried) and how
/// many bytes (carried ones included) it stands for.
pub(super) fn take_text<'a>(
    carry: &mut Vec<u8>,
    data: &'a [u8],
    encoding: Encoding,
) -> (std::borrow::Cow<'a, str>, usize) {
    if encoding == Encoding::Base64 {
        return (encoding.encode(data).into(), data.len());
    }
    if carry.is_empty() {
        // The common case: no copy of the bytes before they are escaped.
        let emit = data.len() - incomplete_suffix(data);
        carry.extend_from_slice(&data[emit..]);
        return (utf8_lossy(&data[..emit]), emit);
    }
    let mut all = std::mem::take(carry);
    all.extend_from_slice(data);
    let emit = all.len() - incomplete_suffix(&all);
    *carry = all[emit..].to_vec();
    (
        String::from_utf8_lossy(&all[..emit]).into_owned().into(),
        emit,
    )
}

/// `String::from_utf8_lossy`, with the validation of valid text (the usual case) done by the
/// fast `str::from_utf8` first.
pub(super) fn utf8_lossy(b: &[u8]) -> std::borrow::Cow<'_, str> {
    match std::str::from_utf8(b) {
        Ok(s) => s.into(),
        Err(_) => String::from_utf8_lossy(b),
    }
}

pub(super) const LOW_BITS: u64 = 0x0101_0101_0101_0101;

pub(super) const HIGH_BITS: u64 = 0x8080_8080_8080_8080;

/// The bytes of `w` (8 bytes, little-endian) that JSON strings must escape: control characters,
/// `"` and `\`. The lowest set high bit marks the first such byte exactly (bits above it may be
/// false positives).
pub(super) fn escapes_in(w: u64) -> u64 {
    let zero_byte = |v: u64| v.wrapping_sub(LOW_BITS) & !v & HIGH_BITS;
    let control = w.wrapping_sub(LOW_BITS * 0x20) & !w & HIGH_BITS;
    control | zero_byte(w ^ (LOW_BITS * b'"' as u64)) | zero_byte(w ^ (LOW_BITS * b'\\' as u64))
}

/// Appends `s` as a JSON string, escaped as serde_json does (`\"`, `\\`, `\b \f \n \r \t`,
/// other control characters as `\u00XX`; everything else as it is). Runs that need no escape are
/// found 8 bytes at a time and copied whole.
pub(super) fn push_json_str(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let b = s.as_bytes();
    out.reserve(b.len() + b.len() / 8 + 2);
    out.push(b'"');
    let (mut run, mut i) = (0, 0);
    while i < b.len() {
        // The next byte to escape, from i on.
        let at = match b.get(i..i + 8) {
            Some(word) => {
                let mut w = [0u8; 8];
                w.copy_from_slice(word);
                let m = escapes_in(u64::from_le_bytes(w));
                if m == 0 {
                    i += 8;
                    continue;
                }
                i + (m.trailing_zeros() / 8) as usize
            }
            None => {
                match b[i..]
                    .iter()
                    .position(|&c| c < 0x20 || c == b'"' || c == b'\\')
                {
                    Some(p) => i + p,
                    None => break,
                }
            }
        };
        out.extend_from_slice(&b[run..at]);
        let c = b[at];
        match c {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x0c => out.extend_from_slice(b"\\f"),
            _ => out.extend_from_slice(&[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[(c >> 4) as usize],
                HEX[(c & 0xf) as usize],
            ]),
        }
        i = at + 1;
        run = i;
    }
    out.extend_from_slice(&b[run..]);
    out.push(b'"');
}

/// An output event, written by hand: the text is escaped once, straight into the event.
pub(super) fn output_event(kind: EventKind, id: u64, from: u64, text: &str) -> Bytes {
    use std::io::Write;
    let mut out = Vec::with_capacity(text.len() + text.len() / 16 + 96);
    let _ = write!(out, "event: {}\nid: {id}\ndata: {{\"data\":", kind.as_str());
    push_json_str(&mut out, text);
    let _ = write!(out, ",\"position\":{from}}}\n\n");
    Bytes::from(out)
}

pub(super) struct SseState {
    rx: mpsc::Receiver<RunEvent>,
    meta: ExecMeta,
    rid: String,
    docs: Option<String>,
    /// The output so far, for the exit event's object.
    c: Collected,
    carry_out: Vec<u8>,
    carry_err: Vec<u8>,
    cursor: u64,
    done: bool,
}

pub(super) fn sse_response(
    rx: mpsc::Receiver<RunEvent>,
    meta: ExecMeta,
    rid: String,
    docs: Option<String>,
) -> Response {
    event_stream(rx, meta, Started::default(), 0, rid, docs)
}

/// An event stream of a command's events from position `from` (`started`: what is known of it
/// when the stream does not begin with its start).
pub fn event_stream(
    rx: mpsc::Receiver<RunEvent>,
    meta: ExecMeta,
    started: Started,
    from: u64,
    rid: String,
    docs: Option<String>,
) -> Response {
    let state = SseState {
        rx,
        meta,
        rid,
        docs,
        c: Collected::of(started),
        carry_out: Vec::new(),
        carry_err: Vec::new(),
        cursor: from,
        done: false,
    };
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        if s.done {
            return None;
        }
        let chunk = next_sse(&mut s).await;
        Some((Ok::<_, Infallible>(chunk), s))
    });
    event_stream_answer(Body::from_stream(stream))
}

/// An event-stream answer of `body`: its content type, not cached, not buffered by a proxy.
pub fn event_stream_answer(body: Body) -> Response {
    let mut resp = Response::new(body);
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    resp
}

pub(super) async fn next_sse(s: &mut SseState) -> Bytes {
    loop {
        let ev = match tokio::time::timeout(KEEPALIVE_EVERY, s.rx.recv()).await {
            Err(_) => return Bytes::from_static(sbx_api::events::SSE_KEEPALIVE.as_bytes()),
            Ok(ev) => ev,
        };
        let Some(ev) = ev else {
            s.done = true;
            let body = sbx_api::error_body(&ApiError::internal(), &s.rid, s.docs.as_deref());
            return sbx_api::sse(EventKind::Error, s.cursor, &body).into();
        };
        match ev {
            RunEvent::Started { pid, started_at_ns } => {
                s.c.started = Started { pid, started_at_ns };
                let obj = Collected::of(s.c.started).object(&s.meta, None, OutputCounts::default());
                let data = serde_json::to_value(obj).unwrap_or_default();
                return sbx_api::sse(EventKind::Start, 0, &data).into();
            }
            RunEvent::Output { stream, pos, data } => {
                let (kind, carry) = match stream {
                    Stream::Stderr => (EventKind::Stderr, &mut s.carry_err),
                    _ => (EventKind::Stdout, &mut s.carry_out),
                };
                let data = Bytes::from(data);
                s.c.push(stream, data.clone());
                let carried = carry.len() as u64;
                let (text, emitted) = take_text(carry, &data, s.meta.encoding);
                if emitted == 0 {
                    continue;
                }
                let from = pos - carried;
                s.cursor = from + emitted as u64;
                return output_event(kind, s.cursor, from, &text);
            }
            RunEvent::Gap { from, to } => {
                s.c.gap = true;
                s.carry_out.clear();
                s.carry_err.clear();
                s.cursor = to;
                return sbx_api::sse(
                    EventKind::Gap,
                    to,
                    &serde_json::json!({ "from": from, "to": to }),
                )
                .into();
            }
            RunEvent::Exited { exit, output } => {
                s.done = true;
                let mut tail = String::new();
                // Bytes of an unfinished character at the very end go out as they are.
                for (kind, carry) in [
                    (EventKind::Stdout, &mut s.carry_out),
                    (EventKind::Stderr, &mut s.carry_err),
                ] {
                    if !carry.is_empty() {
                        let text = String::from_utf8_lossy(carry).into_owned();
                        let from = s.cursor;
                        s.cursor += carry.len() as u64;
                        carry.clear();
                        tail.push_str(&sbx_api::sse(
                            kind,
                            s.cursor,
                            &serde_json::json!({ "position": from, "data": text }),
                        ));
                    }
                }
                let obj = s.c.object(&s.meta, Some(&exit), output);
                let data = serde_json::to_value(obj).unwrap_or_default();
                tail.push_str(&sbx_api::sse(EventKind::Exit, output.end, &data));
                return tail.into();
            }
            RunEvent::Failed(mut e) => {
                s.done = true;
                if e.code == sbx_api::ErrorCode::SandboxMoved {
                    // Where to read on from, where the sandbox went.
                    e = e
                        .with_beside("offset", serde_json::json!(s.cursor))
                        .with_beside("exec_id", serde_json::json!(s.meta.exec_id));
                }
                let body = sbx_api::error_body(&e, &s.rid, s.docs.as_deref());
                return sbx_api::sse(EventKind::Error, s.cursor, &body).into();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_cut_between_chunks_is_carried() {
        let mut carry = Vec::new();
        let euro = "€".as_bytes(); // 3 bytes
        let first = [b'a', euro[0]];
        let (t, n) = take_text(&mut carry, &first, Encoding::Utf8);
        assert_eq!((&*t, n), ("a", 1));
        let (t, n) = take_text(&mut carry, &euro[1..], Encoding::Utf8);
        assert_eq!((&*t, n), ("€", 3));
        assert!(carry.is_empty());
        let (t, _) = take_text(&mut carry, b"x\xffy", Encoding::Utf8);
        assert_eq!(t, "x\u{fffd}y");
    }

    #[test]
    fn json_strings_are_escaped_as_serde_json_does() {
        let mut all: Vec<u8> = (0u8..0x80).collect();
        all.extend_from_slice("é€😀 plain text of some length\n\"q\" \\ end".as_bytes());
        let text = String::from_utf8(all).unwrap();
        // Every start and length, so that each byte is met in every place of a word.
        for start in 0..text.len() {
            for end in start..=text.len() {
                let Some(s) = text.get(start..end) else {
                    continue;
                };
                let mut ours = Vec::new();
                push_json_str(&mut ours, s);
                assert_eq!(
                    String::from_utf8(ours).unwrap(),
                    serde_json::to_string(s).unwrap(),
                    "{s:?}"
                );
            }
        }
    }
}
