//! HTTP routes of a sandbox's files, `/v1/sandboxes/{id}/files…`: parse, then stream to and
//! from the sandbox's agent, which does the file work inside the sandbox (so that paths,
//! owners and permissions are the sandbox's own; see sbx-agent's `fs`).
//!
//! | method, path          | what                                                     |
//! |-----------------------|----------------------------------------------------------|
//! | GET  …/files          | download (raw body; `Range: bytes=` gives 206)           |
//! | PUT  …/files          | upload (raw body; mode, parents, owner)                  |
//! | GET  …/files/list     | a directory's entries                                    |
//! | GET  …/files/stat     | one entry                                                |
//! | POST …/files/mkdir    | parents, mode, owner                                     |
//! | POST …/files/rm       | recursive                                                |
//! | POST …/files/mv       | dst, overwrite                                           |
//! | POST …/files/chmod    | mode, uid, gid, recursive                                |
//! | POST …/files/grep     | pattern, literal, recursive, ignore_case, include, ...   |
//! | POST …/files/sed      | pattern, replacement, literal, first_only, ...           |
//! | GET  …/files/tar      | a directory as a tar stream (application/x-tar)          |
//! | POST …/files/tar      | a tar stream unpacked into a directory                   |
//!
//! The path is always `?path=`; the other parameters come in the query or, for POSTs, in a
//! JSON object body. The node never holds a file: a request body becomes data frames as it
//! is read (at most [`FRAME`] bytes gathered), data frames become the response body as they
//! come (a queue of [`DOWNLOAD_QUEUE`] chunks); each side waits for the other, so a slow
//! reader slows the writer and memory does not grow with the size of a file.

use std::collections::HashMap;
use std::path::Path as FsPath;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use futures_util::StreamExt;
use sbx_api::{ApiError, ErrorCode};
use sbx_proto::{
    read_frame, AgentMsg, Frame, FsEntry, FsErrorCode, FsFailure, FsOp, FsResult, GrepSpec,
    HostMsg, SedSpec, Stream, FEATURE_FS, MAX_DATA, PROTO_VERSION,
};
use serde_json::{json, Map, Value};
use tokio::io::{AsyncWriteExt, BufReader, BufWriter};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::mpsc;

use crate::http::{error_response, read_body, AppState, RequestId};

type St = State<Arc<AppState>>;
type Rid = Extension<RequestId>;
type Q = Result<Query<Vec<(String, String)>>, QueryRejection>;

/// The id of the one operation of a connection.
const OP: &str = "fs";
/// Upload bytes gathered into one data frame.
pub const FRAME: usize = MAX_DATA;
/// Download chunks queued for the response body.
pub const DOWNLOAD_QUEUE: usize = 4;
/// How long the rest of an upload is read (and dropped) after the agent refused it, so that the
/// client reads the answer instead of a reset connection.
const DRAIN_FOR: Duration = Duration::from_secs(30);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/sandboxes/{id}/files", get(download).put(upload))
        .route("/v1/sandboxes/{id}/files/list", get(list))
        .route("/v1/sandboxes/{id}/files/stat", get(stat))
        .route("/v1/sandboxes/{id}/files/mkdir", post(mkdir))
        .route("/v1/sandboxes/{id}/files/rm", post(rm))
        .route("/v1/sandboxes/{id}/files/mv", post(mv))
        .route("/v1/sandboxes/{id}/files/chmod", post(chmod))
        .route("/v1/sandboxes/{id}/files/grep", post(grep))
        .route("/v1/sandboxes/{id}/files/sed", post(sed))
        .route("/v1/sandboxes/{id}/files/tar", get(tar_down).post(tar_up))
}

fn respond(st: &AppState, rid: &RequestId, r: Result<Response, ApiError>) -> Response {
    r.unwrap_or_else(|e| error_response(&e, &rid.0, st.docs_url.as_deref()))
}

fn fs_invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::FsInvalid, message).with_param(param)
}

fn aborted(message: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::StreamAborted, message)
}

/// A failure of the agent as the API's error (one code for each).
fn api_error(f: FsFailure) -> ApiError {
    let code = match f.code {
        FsErrorCode::Invalid => ErrorCode::FsInvalid,
        FsErrorCode::NotFound => ErrorCode::PathNotFound,
        FsErrorCode::WrongType => ErrorCode::WrongType,
        FsErrorCode::Exists => ErrorCode::PathExists,
        FsErrorCode::NotEmpty => ErrorCode::NotEmpty,
        FsErrorCode::PermissionDenied => ErrorCode::PermissionDenied,
        FsErrorCode::Io => ErrorCode::IoError,
        FsErrorCode::BadPattern => ErrorCode::BadPattern,
        FsErrorCode::Aborted => ErrorCode::StreamAborted,
        FsErrorCode::Unsupported => ErrorCode::Unsupported,
    };
    let e = ApiError::new(code, f.message);
    match f.param {
        Some(p) => e.with_param(p),
        None => e,
    }
}

// ---- parameters ----

/// A call's parameters: the query's, and a JSON object body's.
struct Params {
    map: HashMap<String, Value>,
}

impl Params {
    fn new(q: Q, body: Option<Map<String, Value>>, known: &[&str]) -> Result<Params, ApiError> {
        let Query(pairs) = q.map_err(|e| fs_invalid("query", format!("the query: {e}")))?;
        let mut map: HashMap<String, Value> = HashMap::new();
        for (k, v) in pairs {
            let list = k == "include" || k == "exclude";
            match map.get_mut(&k) {
                Some(Value::Array(a)) if list => a.push(Value::String(v)),
                Some(_) => return Err(fs_invalid(&k, format!("{k} is given twice"))),
                None if list => {
                    map.insert(k, Value::Array(vec![Value::String(v)]));
                }
                None => {
                    map.insert(k, Value::String(v));
                }
            }
        }
        for (k, v) in body.unwrap_or_default() {
            if map.contains_key(&k) {
                return Err(fs_invalid(
                    &k,
                    format!("{k} is given in both the query and the body"),
                ));
            }
            map.insert(k, v);
        }
        if let Some(k) = map.keys().find(|k| !known.contains(&k.as_str())) {
            return Err(fs_invalid(k, format!("this call takes no parameter {k}")));
        }
        Ok(Params { map })
    }

    fn str(&self, k: &str) -> Result<Option<String>, ApiError> {
        match self.map.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(Value::Number(n)) => Ok(Some(n.to_string())),
            Some(_) => Err(fs_invalid(k, format!("{k} must be a string"))),
        }
    }

    /// `owner`: a name, a uid or uid:gid; numbers a sandbox has no id for are refused here
    /// (the agent looks names up).
    fn owner(&self) -> Result<Option<String>, ApiError> {
        let owner = self.str("owner")?;
        match owner {
            Some(o) if !sbx_api::run::user_ids_in_range(&o) => Err(fs_invalid(
                "owner",
                format!(
                    "{o} is not a user of the sandbox (its ids go from 0 to {})",
                    sbx_api::run::MAX_SANDBOX_ID
                ),
            )),
            o => Ok(o),
        }
    }

    fn required(&self, k: &str) -> Result<String, ApiError> {
        match self.str(k)? {
            Some(s) if !s.is_empty() => Ok(s),
            _ => Err(fs_invalid(k, format!("{k} is required"))),
        }
    }

    fn path(&self) -> Result<String, ApiError> {
        self.required("path")
    }

    fn bool(&self, k: &str, default: bool) -> Result<bool, ApiError> {
        match self.map.get(k) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(Value::String(s)) => match s.as_str() {
                "" | "true" | "1" | "yes" => Ok(true),
                "false" | "0" | "no" => Ok(false),
                _ => Err(fs_invalid(k, format!("{k} must be true or false"))),
            },
            Some(_) => Err(fs_invalid(k, format!("{k} must be true or false"))),
        }
    }

    fn u64(&self, k: &str, max: u64) -> Result<Option<u64>, ApiError> {
        let bad = || fs_invalid(k, format!("{k} must be a whole number from 0 to {max}"));
        let n = match self.map.get(k) {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::Number(n)) => n.as_u64().ok_or_else(bad)?,
            Some(Value::String(s)) => s.trim().parse::<u64>().map_err(|_| bad())?,
            Some(_) => return Err(bad()),
        };
        if n > max {
            return Err(bad());
        }
        Ok(Some(n))
    }

    /// Permission bits, octal: "0644", "644", "0o644" (a JSON number's digits are read as
    /// octal too: 644).
    fn mode(&self, k: &str) -> Result<Option<u32>, ApiError> {
        let Some(s) = self.str(k)? else {
            return Ok(None);
        };
        parse_mode(&s)
            .map(Some)
            .ok_or_else(|| fs_invalid(k, format!("{k} must be octal permission bits such as 0644")))
    }

    fn list(&self, k: &str) -> Result<Vec<String>, ApiError> {
        let bad = || fs_invalid(k, format!("{k} must be a glob or a list of globs"));
        match self.map.get(k) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::String(s)) => Ok(vec![s.clone()]),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_str().map(String::from).ok_or_else(bad))
                .collect(),
            Some(_) => Err(bad()),
        }
    }
}

fn parse_mode(s: &str) -> Option<u32> {
    let t = s.trim();
    let t = t.strip_prefix("0o").unwrap_or(t);
    if t.is_empty() || t.len() > 5 || !t.bytes().all(|b| (b'0'..=b'7').contains(&b)) {
        return None;
    }
    u32::from_str_radix(t, 8).ok().filter(|m| *m <= 0o7777)
}

/// A POST's JSON object body, if it has one.
async fn json_body(body: Body) -> Result<Option<Map<String, Value>>, ApiError> {
    let bytes = read_body(body).await?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(m)) => Ok(Some(m)),
        _ => Err(fs_invalid("body", "the body is not a JSON object")),
    }
}

fn entry_json(e: &FsEntry) -> Map<String, Value> {
    let v = json!({
        "object": "file",
        "name": e.name,
        "path": e.path,
        "type": e.kind.as_str(),
        "size": e.size,
        "mode": format!("{:04o}", e.mode),
        "uid": e.uid,
        "gid": e.gid,
        "modified_at": sbx_api::format_rfc3339_millis(i128::from(e.mtime_ns)),
        "target": e.target,
    });
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

fn unexpected(r: &FsResult) -> ApiError {
    tracing::error!(result = ?r, "the agent answered a file operation with another's result");
    ApiError::internal()
}

// ---- the agent ----

/// A connection to a sandbox's agent, for one file operation.
struct Link {
    rd: BufReader<OwnedReadHalf>,
    wr: BufWriter<OwnedWriteHalf>,
}

/// Connects to the agent of a running sandbox.
async fn open(st: &AppState, id: &str) -> Result<Link, ApiError> {
    let m = st.node.managed(id)?;
    let status = st.node.sandbox_object(&m).status;
    if !status.can_exec() {
        return Err(ApiError::new(
            ErrorCode::SandboxNotRunning,
            format!(
                "the sandbox is {}: its files cannot be reached",
                status.as_str()
            ),
        ));
    }
    connect(&st.node.sandboxes_dir().join(&m.id).join("agent.sock")).await
}

async fn connect(socket: &FsPath) -> Result<Link, ApiError> {
    let unreachable = |why: String| {
        tracing::warn!(socket = %socket.display(), why, "agent");
        ApiError::new(
            ErrorCode::Unavailable,
            format!("the sandbox's agent cannot be reached: {why}"),
        )
    };
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, UnixStream::connect(socket))
        .await
        .map_err(|_| unreachable("timed out".into()))?
        .map_err(|e| unreachable(e.to_string()))?;
    let (rd, wr) = stream.into_split();
    let mut link = Link {
        rd: BufReader::with_capacity(256 << 10, rd),
        wr: BufWriter::with_capacity(64 << 10, wr),
    };
    let hello = tokio::time::timeout(CONNECT_TIMEOUT, read_frame::<AgentMsg, _>(&mut link.rd))
        .await
        .map_err(|_| unreachable("no hello in time".into()))?
        .map_err(|e| unreachable(e.to_string()))?;
    match hello {
        Some(Frame::Msg(AgentMsg::Hello {
            version, features, ..
        })) if version == PROTO_VERSION && features.iter().any(|f| f == FEATURE_FS) => Ok(link),
        Some(Frame::Msg(AgentMsg::Hello { .. })) => Err(ApiError::new(
            ErrorCode::Unsupported,
            "the sandbox's agent serves no file operations: restart the sandbox to update it",
        )),
        _ => Err(unreachable("no hello".into())),
    }
}

impl Link {
    async fn send(&mut self, msg: &HostMsg) -> Result<(), ApiError> {
        let buf = sbx_proto::encode_msg(msg).map_err(|_| ApiError::internal())?;
        self.wr.write_all(&buf).await.map_err(gone)?;
        self.wr.flush().await.map_err(gone)
    }

    async fn recv(&mut self) -> Result<Frame<AgentMsg>, ApiError> {
        match read_frame::<AgentMsg, _>(&mut self.rd).await {
            Ok(Some(f)) => Ok(f),
            Ok(None) => Err(aborted("the sandbox's agent closed the connection")),
            Err(e) => Err(gone(e)),
        }
    }

    /// An operation without bytes: its result.
    async fn call(mut self, op: FsOp) -> Result<FsResult, ApiError> {
        self.send(&HostMsg::Fs { id: OP.into(), op }).await?;
        loop {
            match self.recv().await? {
                Frame::Msg(AgentMsg::FsDone { result, .. }) => return Ok(result),
                Frame::Msg(AgentMsg::FsError { error, .. }) => return Err(api_error(error)),
                _ => {}
            }
        }
    }
}

fn gone(e: impl std::fmt::Display) -> ApiError {
    aborted(format!("the connection to the sandbox's agent broke: {e}"))
}

/// Aborts a task when dropped.
struct TaskGuard(tokio::task::JoinHandle<()>);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The agent's messages, read on a task of their own (reading a frame is not cancel-safe).
async fn read_msgs(mut rd: BufReader<OwnedReadHalf>, tx: mpsc::Sender<Result<AgentMsg, String>>) {
    loop {
        let m = match read_frame::<AgentMsg, _>(&mut rd).await {
            Ok(Some(Frame::Msg(m))) => Ok(m),
            Ok(Some(Frame::Data { .. })) => continue,
            Ok(None) => Err("the sandbox's agent closed the connection".to_string()),
            Err(e) => Err(e.to_string()),
        };
        let end = m.is_err();
        if tx.send(m).await.is_err() || end {
            return;
        }
    }
}

fn answer(m: Option<Result<AgentMsg, String>>) -> Result<FsResult, ApiError> {
    match m {
        Some(Ok(AgentMsg::FsDone { result, .. })) => Ok(result),
        Some(Ok(AgentMsg::FsError { error, .. })) => Err(api_error(error)),
        Some(Ok(other)) => {
            tracing::error!(msg = ?other, "unexpected message during an upload");
            Err(ApiError::internal())
        }
        Some(Err(e)) => Err(gone(e)),
        None => Err(aborted("the sandbox's agent went away")),
    }
}

async fn write_frames(
    wr: &mut BufWriter<OwnedWriteHalf>,
    data: &[u8],
    pos: &mut u64,
) -> std::io::Result<()> {
    for chunk in data.chunks(MAX_DATA) {
        wr.write_all(&sbx_proto::encode_data_header(
            OP,
            Stream::File,
            *pos,
            chunk.len(),
        ))
        .await?;
        wr.write_all(chunk).await?;
        *pos += chunk.len() as u64;
    }
    Ok(())
}

/// Reads what is left of a request body, for at most [`DRAIN_FOR`].
async fn drain(stream: &mut axum::body::BodyDataStream) {
    let _ = tokio::time::timeout(DRAIN_FOR, async {
        while let Some(Ok(_)) = stream.next().await {}
    })
    .await;
}

/// An upload: `op`, the body as data frames as it is read, its end; the agent's result. The
/// agent may fail it midway (its answer comes before the end): the rest of the body is read
/// and dropped, and its error answered.
async fn send_body(link: Link, op: FsOp, body: Body) -> Result<FsResult, ApiError> {
    let Link { rd, mut wr } = link;
    let (mtx, mut mrx) = mpsc::channel(4);
    let _reader = TaskGuard(tokio::spawn(read_msgs(rd, mtx)));
    let start = sbx_proto::encode_msg(&HostMsg::Fs { id: OP.into(), op })
        .map_err(crate::http::internal("encoding a file operation"))?;
    let broke = |e: std::io::Error, mrx: &mut mpsc::Receiver<Result<AgentMsg, String>>| {
        // The agent's own answer says more than a broken pipe, when it sent one.
        match mrx.try_recv() {
            Ok(m) => answer(Some(m)).and(Err(gone(&e))),
            Err(_) => Err(gone(e)),
        }
    };
    if let Err(e) = async {
        wr.write_all(&start).await?;
        wr.flush().await
    }
    .await
    {
        return broke(e, &mut mrx);
    }
    let mut stream = body.into_data_stream();
    let mut buf: Vec<u8> = Vec::with_capacity(FRAME);
    let mut pos = 0u64;
    loop {
        tokio::select! {
            m = mrx.recv() => {
                let r = answer(m);
                drain(&mut stream).await;
                return r;
            }
            chunk = stream.next() => match chunk {
                Some(Ok(bytes)) => {
                    let r = if buf.is_empty() && bytes.len() >= FRAME {
                        write_frames(&mut wr, &bytes, &mut pos).await
                    } else {
                        buf.extend_from_slice(&bytes);
                        if buf.len() >= FRAME {
                            let r = write_frames(&mut wr, &buf, &mut pos).await;
                            buf.clear();
                            r
                        } else {
                            Ok(())
                        }
                    };
                    if let Err(e) = r {
                        return broke(e, &mut mrx);
                    }
                }
                Some(Err(e)) => {
                    // Dropping the connection aborts the upload: the old file stays.
                    return Err(aborted(format!("the request body broke off: {e}"))
                        .with_param("body"));
                }
                None => break,
            }
        }
    }
    let end = sbx_proto::encode_msg(&HostMsg::FsEnd { id: OP.into() })
        .map_err(crate::http::internal("encoding an upload's end"))?;
    let finish = async {
        write_frames(&mut wr, &buf, &mut pos).await?;
        wr.write_all(&end).await?;
        wr.flush().await
    };
    if let Err(e) = finish.await {
        return broke(e, &mut mrx);
    }
    answer(mrx.recv().await)
}

/// A download as the agent opened it.
struct Opened {
    size: u64,
    offset: u64,
    length: Option<u64>,
    body: Body,
}

/// A download: `op`, the agent's `FsOpened`, then its data frames as the response body. A
/// failure midway ends the body with an error (the client sees it cut).
async fn open_body(mut link: Link, op: FsOp) -> Result<Opened, ApiError> {
    link.send(&HostMsg::Fs { id: OP.into(), op }).await?;
    let (size, offset, length) = loop {
        match link.recv().await? {
            Frame::Msg(AgentMsg::FsOpened {
                size,
                offset,
                length,
                ..
            }) => break (size, offset, length),
            Frame::Msg(AgentMsg::FsError { error, .. }) => return Err(api_error(error)),
            Frame::Msg(AgentMsg::FsDone { result, .. }) => return Err(unexpected(&result)),
            _ => {}
        }
    };
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(DOWNLOAD_QUEUE);
    tokio::spawn(pump(link, tx, length));
    Ok(Opened {
        size,
        offset,
        length,
        body: Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)),
    })
}

async fn pump(
    mut link: Link,
    tx: mpsc::Sender<Result<Bytes, std::io::Error>>,
    length: Option<u64>,
) {
    let cut = |why: String| std::io::Error::other(why);
    let mut got = 0u64;
    loop {
        let f = tokio::select! {
            f = link.recv() => f,
            // The client hung up: dropping the connection stops the agent.
            _ = tx.closed() => return,
        };
        let item = match f {
            Ok(Frame::Data {
                stream: Stream::File,
                bytes,
                ..
            }) => {
                got += bytes.len() as u64;
                Ok(Bytes::from(bytes))
            }
            Ok(Frame::Msg(AgentMsg::FsDone { .. })) => {
                if length.is_some_and(|l| l != got) {
                    let _ = tx
                        .send(Err(cut(format!("{got} bytes sent of {length:?}"))))
                        .await;
                }
                return;
            }
            Ok(Frame::Msg(AgentMsg::FsError { error, .. })) => {
                tracing::warn!(error = %error.message, "a download failed midway");
                let _ = tx.send(Err(cut(error.message))).await;
                return;
            }
            Ok(_) => continue,
            Err(e) => {
                let _ = tx.send(Err(cut(e.message))).await;
                return;
            }
        };
        if tx.send(item).await.is_err() {
            return;
        }
    }
}

// ---- handlers ----

/// `GET …/files?path=`: the file's bytes (a `Range: bytes=a-b`, `a-` or `-n` gives 206).
async fn download(
    State(st): St,
    Extension(rid): Rid,
    Path(id): Path<String>,
    q: Q,
    headers: HeaderMap,
) -> Response {
    let r = async {
        let p = Params::new(q, None, &["path"])?;
        let path = p.path()?;
        let range = parse_range(&headers);
        let op = match range {
            None => FsOp::Read {
                path,
                offset: 0,
                length: None,
                tail: None,
            },
            Some(Want::From(a, b)) => FsOp::Read {
                path,
                offset: a,
                length: b.map(|b| b - a + 1),
                tail: None,
            },
            Some(Want::Tail(n)) => FsOp::Read {
                path,
                offset: 0,
                length: None,
                tail: Some(n),
            },
        };
        let link = open(&st, &id).await?;
        let o = open_body(link, op).await?;
        let unsatisfiable = match range {
            None => false,
            Some(Want::From(a, _)) => a >= o.size,
            Some(Want::Tail(n)) => n == 0 || o.size == 0,
        };
        if unsatisfiable {
            let mut resp = error_response(
                &ApiError::new(
                    ErrorCode::InvalidRange,
                    format!("the range is past the end of the file ({} bytes)", o.size),
                )
                .with_param("Range"),
                &rid.0,
                st.docs_url.as_deref(),
            );
            if let Ok(v) = HeaderValue::from_str(&format!("bytes */{}", o.size)) {
                resp.headers_mut().insert(header::CONTENT_RANGE, v);
            }
            return Ok(resp);
        }
        let mut resp = Response::new(o.body);
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/octet-stream"),
        );
        h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
        if let Some(len) = o.length {
            h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
        }
        if range.is_some() {
            let end = o.offset + o.length.unwrap_or(0);
            let v = format!("bytes {}-{}/{}", o.offset, end.saturating_sub(1), o.size);
            if let Ok(v) = HeaderValue::from_str(&v) {
                h.insert(header::CONTENT_RANGE, v);
            }
            *resp.status_mut() = StatusCode::PARTIAL_CONTENT;
        }
        Ok(resp)
    }
    .await;
    respond(&st, &rid, r)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Want {
    /// From a byte to another (inclusive) or to the end.
    From(u64, Option<u64>),
    /// The last bytes.
    Tail(u64),
}

/// One range of a `Range: bytes=` header; `None` for no header, or one that is not a single
/// valid range (the whole file is answered then, as RFC 9110 allows).
fn parse_range(h: &HeaderMap) -> Option<Want> {
    let v = h.get(header::RANGE)?.to_str().ok()?.trim();
    let spec = v.strip_prefix("bytes=")?.trim();
    if spec.contains(',') {
        return None;
    }
    let (a, b) = spec.split_once('-')?;
    let (a, b) = (a.trim(), b.trim());
    if a.is_empty() {
        return b.parse().ok().map(Want::Tail);
    }
    let start: u64 = a.parse().ok()?;
    if b.is_empty() {
        return Some(Want::From(start, None));
    }
    let end: u64 = b.parse().ok()?;
    (end >= start).then_some(Want::From(start, Some(end)))
}

/// `PUT …/files?path=`: the body becomes the file (mode, parents, owner). 201 when it is new.
async fn upload(
    State(st): St,
    Extension(rid): Rid,
    Path(id): Path<String>,
    q: Q,
    body: Body,
) -> Response {
    let r = async {
        let p = Params::new(q, None, &["path", "mode", "parents", "owner"])?;
        let op = FsOp::Write {
            path: p.path()?,
            mode: p.mode("mode")?,
            parents: p.bool("parents", false)?,
            owner: p.owner()?,
        };
        let link = open(&st, &id).await?;
        match send_body(link, op, body).await? {
            FsResult::Written {
                entry,
                bytes,
                created,
            } => {
                let mut v = entry_json(&entry);
                v.insert("bytes_written".into(), json!(bytes));
                v.insert("created".into(), json!(created));
                let status = if created {
                    StatusCode::CREATED
                } else {
                    StatusCode::OK
                };
                Ok((status, Json(Value::Object(v))).into_response())
            }
            other => Err(unexpected(&other)),
        }
    }
    .await;
    respond(&st, &rid, r)
}

async fn list(State(st): St, Extension(rid): Rid, Path(id): Path<String>, q: Q) -> Response {
    let r = async {
        let p = Params::new(q, None, &["path", "limit"])?;
        let path = p.path()?;
        let limit = p.u64("limit", 10_000)?.map(|l| l.max(1) as u32);
        let link = open(&st, &id).await?;
        match link
            .call(FsOp::List {
                path: path.clone(),
                limit,
            })
            .await?
        {
            FsResult::List { entries, truncated } => {
                let entries: Vec<Value> = entries
                    .iter()
                    .map(|e| Value::Object(entry_json(e)))
                    .collect();
                Ok(Json(json!({
                    "object": "list",
                    "path": path,
                    "entries": entries,
                    "truncated": truncated,
                }))
                .into_response())
            }
            other => Err(unexpected(&other)),
        }
    }
    .await;
    respond(&st, &rid, r)
}

async fn stat(State(st): St, Extension(rid): Rid, Path(id): Path<String>, q: Q) -> Response {
    let r = async {
        let p = Params::new(q, None, &["path"])?;
        let link = open(&st, &id).await?;
        match link.call(FsOp::Stat { path: p.path()? }).await? {
            FsResult::Entry { entry, .. } => {
                Ok(Json(Value::Object(entry_json(&entry))).into_response())
            }
            other => Err(unexpected(&other)),
        }
    }
    .await;
    respond(&st, &rid, r)
}

/// The parameters of a POST: its query and its JSON body.
async fn post_params(q: Q, body: Body, known: &[&str]) -> Result<Params, ApiError> {
    let body = json_body(body).await?;
    Params::new(q, body, known)
}

/// The fields of each POST file operation (query or JSON body); the functions interface
/// takes the same (`sandbox::fs::*`).
pub(crate) const MKDIR_FIELDS: &[&str] = &["path", "parents", "mode", "owner"];
pub(crate) const RM_FIELDS: &[&str] = &["path", "recursive"];
pub(crate) const CHMOD_FIELDS: &[&str] = &["path", "mode", "uid", "gid", "recursive"];
pub(crate) const GREP_FIELDS: &[&str] = &[
    "path",
    "pattern",
    "literal",
    "recursive",
    "ignore_case",
    "include",
    "exclude",
    "max_matches",
    "max_line_bytes",
];
pub(crate) const SED_FIELDS: &[&str] = &[
    "path",
    "pattern",
    "replacement",
    "literal",
    "first_only",
    "ignore_case",
    "recursive",
    "include",
    "exclude",
];

/// A POST file operation: the op its parameters (`known` names) make, run by the agent, and
/// the answer its result makes (`Err` gives back a result of another kind: unexpected).
async fn post_op(
    st: &AppState,
    id: &str,
    q: Q,
    body: Body,
    known: &[&str],
    make: impl FnOnce(&Params) -> Result<FsOp, ApiError>,
    answer: impl FnOnce(FsResult, &Params) -> Result<Response, FsResult>,
) -> Result<Response, ApiError> {
    let p = post_params(q, body, known).await?;
    let op = make(&p)?;
    let result = open(st, id).await?.call(op).await?;
    answer(result, &p).map_err(|other| unexpected(&other))
}

async fn mkdir(
    State(st): St,
    Extension(rid): Rid,
    Path(id): Path<String>,
    q: Q,
    body: Body,
) -> Response {
    let make = |p: &Params| {
        Ok(FsOp::Mkdir {
            path: p.path()?,
            parents: p.bool("parents", false)?,
            mode: p.mode("mode")?,
            owner: p.owner()?,
        })
    };
    let r = post_op(&st, &id, q, body, MKDIR_FIELDS, make, |res, _| match res {
        FsResult::Entry { entry, created } => {
            let mut v = entry_json(&entry);
            v.insert("created".into(), json!(created));
            let status = if created {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            Ok((status, Json(Value::Object(v))).into_response())
        }
        other => Err(other),
    })
    .await;
    respond(&st, &rid, r)
}

async fn rm(
    State(st): St,
    Extension(rid): Rid,
    Path(id): Path<String>,
    q: Q,
    body: Body,
) -> Response {
    let make = |p: &Params| {
        Ok(FsOp::Remove {
            path: p.path()?,
            recursive: p.bool("recursive", false)?,
        })
    };
    let r = post_op(&st, &id, q, body, RM_FIELDS, make, |res, _| match res {
        FsResult::Removed { entry } => {
            let mut v = entry_json(&entry);
            v.insert("removed".into(), json!(true));
            Ok(Json(Value::Object(v)).into_response())
        }
        other => Err(other),
    })
    .await;
    respond(&st, &rid, r)
}

async fn mv(
    State(st): St,
    Extension(rid): Rid,
    Path(id): Path<String>,
    q: Q,
    body: Body,
) -> Response {
    let make = |p: &Params| {
        Ok(FsOp::Move {
            src: p.path()?,
            dst: p.required("dst")?,
            overwrite: p.bool("overwrite", false)?,
        })
    };
    let known = &["path", "dst", "overwrite"];
    let r = post_op(&st, &id, q, body, known, make, |res, p| match res {
        FsResult::Entry { entry, .. } => {
            let mut v = entry_json(&entry);
            v.insert("src".into(), json!(p.path().ok()));
            Ok(Json(Value::Object(v)).into_response())
        }
        other => Err(other),
    })
    .await;
    respond(&st, &rid, r)
}

async fn chmod(
    State(st): St,
    Extension(rid): Rid,
    Path(id): Path<String>,
    q: Q,
    body: Body,
) -> Response {
    let make = |p: &Params| {
        let id_max = u64::from(u32::MAX - 1);
        Ok(FsOp::Chmod {
            path: p.path()?,
            mode: p.mode("mode")?,
            uid: p.u64("uid", id_max)?.map(|v| v as u32),
            gid: p.u64("gid", id_max)?.map(|v| v as u32),
            recursive: p.bool("recursive", false)?,
        })
    };
    let r = post_op(&st, &id, q, body, CHMOD_FIELDS, make, |res, p| match res {
        FsResult::Changed { count } => Ok(Json(json!({
            "object": "chmod",
            "path": p.path().ok(),
            "changed": count,
        }))
        .into_response()),
        other => Err(other),
    })
    .await;
    respond(&st, &rid, r)
}

async fn grep(
    State(st): St,
    Extension(rid): Rid,
    Path(id): Path<String>,
    q: Q,
    body: Body,
) -> Response {
    let make = |p: &Params| {
        Ok(FsOp::Grep(GrepSpec {
            path: p.path()?,
            pattern: p.required("pattern")?,
            literal: p.bool("literal", false)?,
            recursive: p.bool("recursive", true)?,
            ignore_case: p.bool("ignore_case", false)?,
            include: p.list("include")?,
            exclude: p.list("exclude")?,
            max_matches: Some(p.u64("max_matches", 100_000)?.unwrap_or(1000).max(1)),
            max_line_bytes: Some(p.u64("max_line_bytes", 1 << 20)?.unwrap_or(4096).max(1) as u32),
        }))
    };
    let r = post_op(&st, &id, q, body, GREP_FIELDS, make, |res, _| match res {
        FsResult::Grep {
            matches,
            truncated,
            files_scanned,
        } => Ok(Json(json!({
            "object": "grep",
            "matches": matches,
            "truncated": truncated,
            "files_scanned": files_scanned,
        }))
        .into_response()),
        other => Err(other),
    })
    .await;
    respond(&st, &rid, r)
}

async fn sed(
    State(st): St,
    Extension(rid): Rid,
    Path(id): Path<String>,
    q: Q,
    body: Body,
) -> Response {
    let make = |p: &Params| {
        Ok(FsOp::Sed(SedSpec {
            path: p.path()?,
            pattern: p.required("pattern")?,
            replacement: p
                .str("replacement")?
                .ok_or_else(|| fs_invalid("replacement", "replacement is required"))?,
            literal: p.bool("literal", false)?,
            first_only: p.bool("first_only", false)?,
            ignore_case: p.bool("ignore_case", false)?,
            recursive: p.bool("recursive", true)?,
            include: p.list("include")?,
            exclude: p.list("exclude")?,
        }))
    };
    let r = post_op(&st, &id, q, body, SED_FIELDS, make, |res, _| match res {
        FsResult::Sed {
            files,
            replacements,
            files_scanned,
            truncated,
        } => Ok(Json(json!({
            "object": "sed",
            "files_changed": files.len(),
            "files": files,
            "replacements": replacements,
            "files_scanned": files_scanned,
            "truncated": truncated,
        }))
        .into_response()),
        other => Err(other),
    })
    .await;
    respond(&st, &rid, r)
}

/// `GET …/files/tar?path=`: a directory (or a file) as a tar stream.
async fn tar_down(State(st): St, Extension(rid): Rid, Path(id): Path<String>, q: Q) -> Response {
    let r = async {
        let p = Params::new(q, None, &["path"])?;
        let link = open(&st, &id).await?;
        let o = open_body(link, FsOp::TarCreate { path: p.path()? }).await?;
        let mut resp = Response::new(o.body);
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/x-tar"),
        );
        Ok(resp)
    }
    .await;
    respond(&st, &rid, r)
}

/// `POST …/files/tar?path=`: a tar stream unpacked into a directory (made with its parents
/// unless parents=false; owner, or preserve_owners to keep the archive's).
async fn tar_up(
    State(st): St,
    Extension(rid): Rid,
    Path(id): Path<String>,
    q: Q,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let r = async {
        if let Some(ct) = headers.get(header::CONTENT_TYPE) {
            let ct = ct.to_str().unwrap_or("");
            let base = ct.split(';').next().unwrap_or("").trim();
            if !matches!(
                base,
                "application/x-tar" | "application/tar" | "application/octet-stream"
            ) {
                return Err(fs_invalid(
                    "Content-Type",
                    format!("the body must be a tar stream (application/x-tar), not {ct}"),
                ));
            }
        }
        let p = Params::new(q, None, &["path", "parents", "owner", "preserve_owners"])?;
        let path = p.path()?;
        let op = FsOp::TarExtract {
            path: path.clone(),
            parents: p.bool("parents", true)?,
            owner: p.owner()?,
            preserve_owners: p.bool("preserve_owners", false)?,
        };
        let link = open(&st, &id).await?;
        match send_body(link, op, body).await? {
            FsResult::Tar {
                entries,
                bytes,
                skipped,
            } => Ok(Json(json!({
                "object": "tar",
                "path": path,
                "entries": entries,
                "bytes": bytes,
                "skipped": skipped,
            }))
            .into_response()),
            other => Err(unexpected(&other)),
        }
    }
    .await;
    respond(&st, &rid, r)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(v: &str) -> Option<Want> {
        let mut h = HeaderMap::new();
        h.insert(header::RANGE, HeaderValue::from_str(v).unwrap());
        parse_range(&h)
    }

    #[test]
    fn ranges() {
        assert_eq!(range("bytes=0-99"), Some(Want::From(0, Some(99))));
        assert_eq!(range("bytes=100-"), Some(Want::From(100, None)));
        assert_eq!(range("bytes=-5"), Some(Want::Tail(5)));
        assert_eq!(range("bytes=5-1"), None);
        assert_eq!(range("bytes=0-1,3-4"), None);
        assert_eq!(range("items=0-1"), None);
        assert_eq!(parse_range(&HeaderMap::new()), None);
    }

    #[test]
    fn modes() {
        assert_eq!(parse_mode("0644"), Some(0o644));
        assert_eq!(parse_mode("755"), Some(0o755));
        assert_eq!(parse_mode("0o4755"), Some(0o4755));
        assert_eq!(parse_mode("0888"), None);
        assert_eq!(parse_mode("17777"), None);
        assert_eq!(parse_mode(""), None);
        assert_eq!(parse_mode("rwx"), None);
    }

    #[test]
    fn every_agent_failure_has_its_own_code() {
        let codes = [
            FsErrorCode::Invalid,
            FsErrorCode::NotFound,
            FsErrorCode::WrongType,
            FsErrorCode::Exists,
            FsErrorCode::NotEmpty,
            FsErrorCode::PermissionDenied,
            FsErrorCode::Io,
            FsErrorCode::BadPattern,
            FsErrorCode::Aborted,
            FsErrorCode::Unsupported,
        ];
        let s: Vec<&str> = codes
            .iter()
            .map(|c| {
                api_error(FsFailure::new(*c, "x").param("path"))
                    .s_code()
                    .unwrap()
            })
            .collect();
        assert_eq!(
            s,
            ["S210", "S211", "S212", "S213", "S214", "S215", "S216", "S217", "S218", "S219"]
        );
        let e = api_error(FsFailure::new(FsErrorCode::NotFound, "gone").param("dst"));
        assert_eq!(e.param.as_deref(), Some("dst"));
        assert_eq!(e.status(), 404);
    }

    #[test]
    fn params_from_query_and_body() {
        let q: Q = Ok(Query(vec![
            ("path".into(), "/w".into()),
            ("include".into(), "*.rs".into()),
            ("include".into(), "*.py".into()),
            ("recursive".into(), "false".into()),
        ]));
        let body = json!({"mode": "0644", "max_matches": 3})
            .as_object()
            .cloned();
        let p = Params::new(
            q,
            body,
            &["path", "include", "recursive", "mode", "max_matches"],
        )
        .unwrap();
        assert_eq!(p.path().unwrap(), "/w");
        assert_eq!(p.list("include").unwrap(), ["*.rs", "*.py"]);
        assert!(!p.bool("recursive", true).unwrap());
        assert_eq!(p.mode("mode").unwrap(), Some(0o644));
        assert_eq!(p.u64("max_matches", 10).unwrap(), Some(3));
        let q: Q = Ok(Query(vec![("nope".into(), "1".into())]));
        let e = Params::new(q, None, &["path"]).err().unwrap();
        assert_eq!(e.code, ErrorCode::FsInvalid);
        assert_eq!(e.param.as_deref(), Some("nope"));
        let q: Q = Ok(Query(vec![("path".into(), "/a".into())]));
        let e = Params::new(q, json!({"path": "/b"}).as_object().cloned(), &["path"])
            .err()
            .unwrap();
        assert_eq!(e.param.as_deref(), Some("path"));
    }
}
