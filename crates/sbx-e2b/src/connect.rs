//! The Connect protocol (connectrpc.com/docs/protocol) with the JSON codec, as E2B's envd
//! speaks it and E2B's SDKs call it: unary calls (`application/json` both ways, an error as
//! `{code, message}` with the code's HTTP status), server streams (`application/connect+json`:
//! envelopes of a flag byte and a big-endian u32 length, then an end-of-stream envelope, flag
//! 0x02, holding `{}` or `{"error": {code, message}}`), and client streams (envelopes in the
//! request body).

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::{Stream, StreamExt};
use http_body_util::BodyExt;
use sbx_api::ApiError;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

/// The most one message (an envelope's payload, a unary body) may hold.
pub const MAX_MESSAGE: usize = 64 << 20;

/// An envelope's flag: the end of the stream (its payload is the end message).
const END_STREAM: u8 = 0x02;
/// An envelope's flag: its payload is compressed (never asked for by the SDK: refused).
const COMPRESSED: u8 = 0x01;

/// Connect's error codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Canceled,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
    Unauthenticated,
}

impl Code {
    /// Its name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary answer with this code (the protocol's table).
    pub fn status(self) -> StatusCode {
        let s = match self {
            Code::Canceled => 499,
            Code::InvalidArgument => 400,
            Code::DeadlineExceeded => 504,
            Code::NotFound => 404,
            Code::AlreadyExists => 409,
            Code::PermissionDenied => 403,
            Code::ResourceExhausted => 429,
            Code::FailedPrecondition => 400,
            Code::Unimplemented => 501,
            Code::Internal => 500,
            Code::Unavailable => 503,
            Code::Unauthenticated => 401,
        };
        StatusCode::from_u16(s).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }
}

/// An RPC's failure: a code and a message for people.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", code.as_str())]
pub struct RpcError {
    pub code: Code,
    pub message: String,
}

impl RpcError {
    pub fn new(code: Code, message: impl Into<String>) -> RpcError {
        RpcError {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> RpcError {
        RpcError::new(Code::InvalidArgument, message)
    }

    pub fn not_found(message: impl Into<String>) -> RpcError {
        RpcError::new(Code::NotFound, message)
    }

    pub fn internal(message: impl Into<String>) -> RpcError {
        RpcError::new(Code::Internal, message)
    }

    /// What sbx does not do (yet): said so, never ignored.
    pub fn unimplemented(message: impl Into<String>) -> RpcError {
        RpcError::new(Code::Unimplemented, message)
    }

    /// `{code, message}`: a unary error's body, and a stream's end's `error`.
    pub fn body(&self) -> Value {
        json!({ "code": self.code.as_str(), "message": self.message })
    }

    /// A unary call's error answer.
    pub fn response(&self) -> Response {
        let mut r = (self.code.status(), axum::Json(self.body())).into_response();
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        r
    }
}

impl From<ApiError> for RpcError {
    /// The node's error, by its HTTP status, with its code named in the message.
    fn from(e: ApiError) -> RpcError {
        let code = match e.code.status() {
            400 | 413 | 422 => Code::InvalidArgument,
            401 => Code::Unauthenticated,
            403 => Code::PermissionDenied,
            404 => Code::NotFound,
            409 => Code::FailedPrecondition,
            429 => Code::ResourceExhausted,
            501 => Code::Unimplemented,
            503 => Code::Unavailable,
            504 => Code::DeadlineExceeded,
            _ => Code::Internal,
        };
        RpcError::new(code, format!("{} ({})", e.message, e.code.as_str()))
    }
}

/// Reads a unary call's request: its JSON body (`application/json`). An empty body is `{}`.
pub async fn read_unary<T: DeserializeOwned>(
    headers: &HeaderMap,
    body: Body,
) -> Result<T, RpcError> {
    check_encoding(headers)?;
    let ct = content_type(headers);
    if !ct.is_empty() && ct != "application/json" {
        return Err(RpcError::unimplemented(format!(
            "content type {ct:?}: this node speaks Connect with the JSON codec (application/json)"
        )));
    }
    let bytes = read_all(body, MAX_MESSAGE).await?;
    decode(&bytes)
}

/// Reads a server-streaming call's request: one envelope (`application/connect+json`).
pub async fn read_stream_request<T: DeserializeOwned>(
    headers: &HeaderMap,
    body: Body,
) -> Result<T, RpcError> {
    check_stream_type(headers)?;
    let bytes = read_all(body, MAX_MESSAGE + 5).await?;
    let mut frames = Frames::default();
    frames.push(&bytes);
    match frames.next_frame()? {
        Some((flags, payload)) if flags & END_STREAM == 0 => decode(&payload),
        _ => decode(b"{}"),
    }
}

/// The messages of a client-streaming call's request body, one at a time as they come.
pub fn read_client_stream<T: DeserializeOwned + Send + 'static>(
    headers: &HeaderMap,
    body: Body,
) -> Result<impl Stream<Item = Result<T, RpcError>> + Send, RpcError> {
    check_stream_type(headers)?;
    let state = (body.into_data_stream(), Frames::default(), false);
    Ok(futures_util::stream::unfold(
        state,
        |(mut data, mut frames, done)| async move {
            if done {
                return None;
            }
            loop {
                match frames.next_frame() {
                    Err(e) => return Some((Err(e), (data, frames, true))),
                    Ok(Some((flags, _))) if flags & END_STREAM != 0 => return None,
                    Ok(Some((_, payload))) => {
                        return Some((decode(&payload), (data, frames, false)));
                    }
                    Ok(None) => {}
                }
                match data.next().await {
                    Some(Ok(chunk)) => frames.push(&chunk),
                    Some(Err(e)) => {
                        let e = RpcError::new(Code::Canceled, format!("the request body: {e}"));
                        return Some((Err(e), (data, frames, true)));
                    }
                    None if frames.buf.is_empty() => return None,
                    None => {
                        let e = RpcError::invalid("the request body ends inside an envelope");
                        return Some((Err(e), (data, frames, true)));
                    }
                }
            }
        },
    ))
}

/// A unary call's answer.
pub fn unary_reply<T: Serialize>(r: Result<T, RpcError>) -> Response {
    match r.and_then(|v| serde_json::to_vec(&v).map_err(|e| RpcError::internal(e.to_string()))) {
        Ok(body) => {
            let mut resp = Response::new(Body::from(body));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            resp
        }
        Err(e) => e.response(),
    }
}

/// The keepalive interval a streaming call asked for (`Keepalive-Ping-Interval`, seconds).
pub fn keepalive_interval(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(|s| Duration::from_secs_f64(s.clamp(0.05, 3600.0)))
}

/// A server stream's sender: each message goes out as one envelope, flushed by itself; the
/// stream ends with [`StreamSender::end`] (or when the sender is dropped: a clean end).
pub struct StreamSender {
    tx: mpsc::Sender<Bytes>,
}

impl StreamSender {
    /// Sends one message; false when the caller has gone.
    pub async fn send<T: Serialize>(&self, msg: &T) -> bool {
        match serde_json::to_vec(msg) {
            Ok(payload) => self.tx.send(envelope(0, &payload)).await.is_ok(),
            Err(e) => {
                self.end(Err(RpcError::internal(e.to_string()))).await;
                false
            }
        }
    }

    /// Ends the stream, with or without an error.
    pub async fn end(&self, r: Result<(), RpcError>) {
        let _ = self.tx.send(end_envelope(r.err().as_ref())).await;
    }

    /// Resolves when the caller has gone.
    pub async fn closed(&self) {
        self.tx.closed().await
    }
}

/// Starts a server stream's answer: `produce` gets the sender and writes the messages; the
/// stream's end is sent once it returns (its error in the end envelope). While nothing else
/// is sent, `keepalive` (when the caller asked for an interval) is sent at that interval.
pub fn stream_reply<F, Fut>(keepalive: Option<(Duration, Value)>, produce: F) -> Response
where
    F: FnOnce(StreamSender) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<(), RpcError>> + Send + 'static,
{
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    let (out_tx, out_rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    let sender = StreamSender { tx: tx.clone() };
    tokio::spawn(async move {
        let r = produce(sender).await;
        let _ = tx.send(end_envelope(r.err().as_ref())).await;
    });
    tokio::spawn(pump(rx, out_tx, keepalive));
    let mut resp = Response::new(Body::from_stream(
        tokio_stream::wrappers::ReceiverStream::new(out_rx),
    ));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/connect+json"),
    );
    resp
}

/// A server stream that fails before its first message: 200 with only the end envelope.
pub fn stream_error(e: RpcError) -> Response {
    let mut resp = Response::new(Body::from(end_envelope(Some(&e))));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/connect+json"),
    );
    resp
}

/// Copies envelopes to the body until the end envelope, adding keepalives while idle.
async fn pump(
    mut rx: mpsc::Receiver<Bytes>,
    out: mpsc::Sender<Result<Bytes, std::io::Error>>,
    keepalive: Option<(Duration, Value)>,
) {
    let ka = keepalive.and_then(|(d, v)| Some((d, envelope(0, &serde_json::to_vec(&v).ok()?))));
    loop {
        let next = match &ka {
            Some((d, _)) => match tokio::time::timeout(*d, rx.recv()).await {
                Ok(m) => m,
                Err(_) => {
                    if let Some((_, k)) = &ka {
                        if out.send(Ok(k.clone())).await.is_err() {
                            return;
                        }
                    }
                    continue;
                }
            },
            None => rx.recv().await,
        };
        let Some(frame) = next else { return };
        let last = frame.first().is_some_and(|f| f & END_STREAM != 0);
        if out.send(Ok(frame)).await.is_err() || last {
            return;
        }
    }
}

fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut b = Vec::with_capacity(5 + payload.len());
    b.push(flags);
    b.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    b.extend_from_slice(payload);
    Bytes::from(b)
}

fn end_envelope(err: Option<&RpcError>) -> Bytes {
    let v = match err {
        Some(e) => json!({ "error": e.body() }),
        None => json!({}),
    };
    envelope(END_STREAM, v.to_string().as_bytes())
}

/// Envelopes being read out of chunks.
#[derive(Default)]
struct Frames {
    buf: Vec<u8>,
}

impl Frames {
    fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next whole envelope, if the buffer holds one.
    fn next_frame(&mut self) -> Result<Option<(u8, Vec<u8>)>, RpcError> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let flags = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if flags & COMPRESSED != 0 {
            return Err(RpcError::unimplemented(
                "compressed messages: this node takes them uncompressed",
            ));
        }
        if len > MAX_MESSAGE {
            return Err(RpcError::new(
                Code::ResourceExhausted,
                format!("a message of {len} bytes is over the node's {MAX_MESSAGE}"),
            ));
        }
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        let payload = self.buf[5..5 + len].to_vec();
        self.buf.drain(..5 + len);
        Ok(Some((flags, payload)))
    }
}

fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, RpcError> {
    let bytes = if bytes.iter().all(u8::is_ascii_whitespace) {
        &b"{}"[..]
    } else {
        bytes
    };
    serde_json::from_slice(bytes).map_err(|e| RpcError::invalid(format!("the message: {e}")))
}

fn content_type(headers: &HeaderMap) -> String {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|s| {
            s.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        })
        .unwrap_or_default()
}

fn check_stream_type(headers: &HeaderMap) -> Result<(), RpcError> {
    check_encoding(headers)?;
    let ct = content_type(headers);
    if ct != "application/connect+json" {
        return Err(RpcError::unimplemented(format!(
            "content type {ct:?}: this node's streams are application/connect+json"
        )));
    }
    Ok(())
}

fn check_encoding(headers: &HeaderMap) -> Result<(), RpcError> {
    for h in ["content-encoding", "connect-content-encoding"] {
        if let Some(v) = headers.get(h).and_then(|v| v.to_str().ok()) {
            if !v.eq_ignore_ascii_case("identity") {
                return Err(RpcError::unimplemented(format!(
                    "{h} {v}: this node takes messages uncompressed"
                )));
            }
        }
    }
    Ok(())
}

async fn read_all(body: Body, max: usize) -> Result<Bytes, RpcError> {
    match http_body_util::Limited::new(body, max).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) => Err(RpcError::new(
            Code::ResourceExhausted,
            format!("the request body: {e}"),
        )),
    }
}

/// Base64 of `bytes` fields (proto3 JSON: standard alphabet, padded; either alphabet read).
pub mod b64 {
    use base64::Engine;

    pub fn encode(b: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(b)
    }

    pub fn decode(s: &str) -> Result<Vec<u8>, String> {
        let t = s.trim_end_matches('=');
        base64::engine::general_purpose::STANDARD_NO_PAD
            .decode(t)
            .or_else(|_| base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(t))
            .map_err(|e| format!("not base64: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_are_read_across_chunks_and_the_end_is_seen() {
        let mut f = Frames::default();
        let one = envelope(0, br#"{"a":1}"#);
        let end = end_envelope(None);
        let all: Vec<u8> = one.iter().chain(end.iter()).copied().collect();
        f.push(&all[..3]);
        assert_eq!(f.next_frame().unwrap(), None);
        f.push(&all[3..9]);
        assert_eq!(f.next_frame().unwrap(), None);
        f.push(&all[9..]);
        assert_eq!(f.next_frame().unwrap(), Some((0, br#"{"a":1}"#.to_vec())));
        assert_eq!(f.next_frame().unwrap(), Some((END_STREAM, b"{}".to_vec())));
        assert_eq!(f.next_frame().unwrap(), None);
    }

    #[test]
    fn an_error_end_holds_code_and_message() {
        let e = end_envelope(Some(&RpcError::not_found("no such process")));
        assert_eq!(e[0], END_STREAM);
        let v: Value = serde_json::from_slice(&e[5..]).unwrap();
        assert_eq!(v["error"]["code"], "not_found");
        assert_eq!(v["error"]["message"], "no such process");
        assert_eq!(Code::NotFound.status(), StatusCode::NOT_FOUND);
    }

    #[test]
    fn compressed_and_oversized_messages_are_refused() {
        let mut f = Frames::default();
        f.push(&envelope(COMPRESSED, b"x"));
        assert_eq!(f.next_frame().unwrap_err().code, Code::Unimplemented);
        let mut f = Frames::default();
        f.push(&[0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(f.next_frame().unwrap_err().code, Code::ResourceExhausted);
    }

    #[test]
    fn bytes_are_base64_both_ways() {
        assert_eq!(b64::encode(b"hi\n"), "aGkK");
        assert_eq!(b64::decode("aGkK").unwrap(), b"hi\n");
        assert_eq!(b64::decode("aGk=").unwrap(), b"hi");
        assert_eq!(b64::decode("_-8").unwrap(), vec![0xff, 0xef]);
    }
}
