//! `GET /files` and `POST /files`: a file's bytes down and up, as envd serves them. Paths
//! are envd's (relative to the user's home: `?username=`, else the request's user, else
//! envd's default user; a name the sandbox does not know is refused, 401); an upload makes
//! the missing directories and the file, the user's. A file is written into itself as envd
//! does (its directory's watchers see it written, not renamed over): a new one as the bytes
//! come (removed when the upload fails), one that is there once all its bytes are staged
//! beside it (an upload that fails leaves it as it was). Its metadata (`X-Metadata-<key>`
//! headers) become its `user.e2b.<key>` extended attributes, replacing those it had; reads
//! answer them as `metadata`. A signed URL (`?signature=`, `signature_expiration`) stands for
//! the sandbox's token (`signature.rs`). Nothing is held whole: the bytes stream
//! through the node's upload and download paths (`Node::fs_upload`, `Node::fs_download`), a
//! multipart body is parsed as it comes, gzip is decoded (at most [`MAX_GUNZIPPED`] bytes)
//! and encoded chunk by chunk.

use std::io::Write;

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderValue, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use futures_util::{Stream, StreamExt};
use sbx_api::files::WriteRequest;
use sbx_api::{ApiError, ErrorCode};
use serde_json::{json, Value};

use super::filesystem::entry::{metadata_of, resolve, users_for, Users, METADATA_XATTRS};
use super::Ctx;
use crate::e2b_error;
use crate::node::files::{FsRead, FsWrite, XattrSet};
use crate::node::sandbox::SandboxToken;

/// A stream of body bytes whose errors are text.
type Bytestream = std::pin::Pin<Box<dyn Stream<Item = Result<Bytes, String>> + Send>>;

/// The most bytes of one part's headers.
const MAX_PART_HEAD: usize = 16 << 10;
/// The most files of one multipart upload.
const MAX_PARTS: usize = 1000;
/// The most bytes a gzip body of an upload decodes to: a sandbox's disk by default
/// (`--disk-bytes`). A gzip bomb stops there with an error, and its file is not left behind.
const MAX_GUNZIPPED: u64 = 10 << 30;

fn query(req: &Request<Body>) -> Vec<(String, String)> {
    req.uri()
        .query()
        .map(|q| {
            crate::url_pairs(q)
                .into_iter()
                .collect::<Vec<(String, String)>>()
        })
        .unwrap_or_default()
}

fn param(q: &[(String, String)], k: &str) -> Option<String> {
    q.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
}

/// A signed URL of `/files` (`?signature=v1_…`, maybe `signature_expiration`): E2B's SDK
/// signs `{path}:{read|write}:{username}:{token}[:{expiration}]` with the sandbox's token
/// (sha256, base64 without padding), so that a URL alone reads or writes one file.
pub struct Signed {
    message: String,
    signature: String,
    /// Unix seconds.
    expiration: Option<i64>,
}

impl Signed {
    /// The signature of a request of `/files` (an error: why it cannot be one, envd answers
    /// it 400); `None` without one.
    pub fn of(req: &Request<Body>) -> Option<Result<Signed, &'static str>> {
        let q = query(req);
        let signature = param(&q, "signature")?;
        let op = if req.method() == axum::http::Method::POST {
            "write"
        } else {
            "read"
        };
        let path = param(&q, "path").unwrap_or_default();
        let user = param(&q, "username").unwrap_or_default();
        let expiration = match param(&q, "signature_expiration").filter(|e| !e.is_empty()) {
            None => None,
            Some(e) => match e.parse::<i64>() {
                Ok(e) => Some(e),
                Err(_) => return Some(Err("signature_expiration is not a number of seconds")),
            },
        };
        Some(Ok(Signed {
            message: format!("{path}:{op}:{user}"),
            signature,
            expiration,
        }))
    }

    /// Whether `token` made this signature (compared in constant time).
    pub fn made_with(&self, token: &SandboxToken) -> bool {
        let want = sign(&self.message, token.reveal(), self.expiration);
        let (a, b) = (want.as_bytes(), self.signature.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }

    /// A signature made with `token` and not expired, or why not (envd answers it 401).
    pub fn check(&self, token: Option<&SandboxToken>) -> Result<(), &'static str> {
        if !token.is_some_and(|t| self.made_with(t)) {
            return Err("invalid signature");
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        match self.expiration {
            Some(e) if e < now => Err("signature is already expired"),
            _ => Ok(()),
        }
    }
}

/// E2B's v1 signature of `{path}:{operation}:{user}` (`message`) with `token`.
fn sign(message: &str, token: &str, expiration: Option<i64>) -> String {
    use base64::Engine;
    use sha2::Digest;
    let mut raw = format!("{message}:{token}");
    if let Some(e) = expiration {
        raw.push_str(&format!(":{e}"));
    }
    let digest = sha2::Sha256::digest(raw.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}

/// The node's error as envd's: `{code, message}` with the status of its kind.
fn http_error(e: ApiError) -> Response {
    let status = match e.code {
        ErrorCode::PathNotFound => StatusCode::NOT_FOUND,
        ErrorCode::WrongType | ErrorCode::FsInvalid | ErrorCode::PathExists => {
            StatusCode::BAD_REQUEST
        }
        ErrorCode::PermissionDenied => StatusCode::FORBIDDEN,
        _ => StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
    };
    e2b_error(status, e.message)
}

/// The request's user (`?username=`, else its `Authorization`) and the sandbox's users.
async fn who(
    ctx: &Ctx,
    q: &[(String, String)],
) -> Result<(String, std::sync::Arc<Users>), Response> {
    let user = param(q, "username")
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| ctx.user().to_string());
    match users_for(ctx, &user).await {
        Ok(u) => Ok((user, u)),
        Err(e) => Err(e2b_error(e.code.status(), e.message)),
    }
}

fn wants_gzip(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|c| {
            let mut it = c.split(';');
            let name = it.next().unwrap_or("").trim();
            let q0 = it.any(|p| {
                p.trim()
                    .strip_prefix("q=")
                    .and_then(|q| q.trim().parse::<f32>().ok())
                    .is_some_and(|q| q == 0.0)
            });
            name.eq_ignore_ascii_case("gzip") && !q0
        })
}

pub async fn download(ctx: &Ctx, req: Request<Body>) -> Response {
    let q = query(&req);
    let (user, users) = match who(ctx, &q).await {
        Ok(w) => w,
        Err(r) => return r,
    };
    let path = match resolve(&param(&q, "path").unwrap_or_default(), &users.home(&user)) {
        Ok(p) => p,
        Err(e) => return e2b_error(StatusCode::BAD_REQUEST, e.message),
    };
    let dl = match ctx
        .node()
        .fs_read(&ctx.sandbox, FsRead::whole(path.clone()))
        .await
    {
        Ok(d) => d,
        Err(e) if e.code == ErrorCode::PathNotFound => {
            return e2b_error(
                StatusCode::NOT_FOUND,
                format!("path '{path}' does not exist"),
            )
        }
        Err(e) if e.code == ErrorCode::WrongType => {
            return e2b_error(
                StatusCode::BAD_REQUEST,
                format!("path '{path}' is a directory"),
            )
        }
        Err(e) => return http_error(e),
    };
    let mut resp = if wants_gzip(req.headers()) {
        let mut r = Response::new(Body::from_stream(gzip_stream(dl.chunks)));
        r.headers_mut()
            .insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        r
    } else {
        let mut r = Response::new(Body::from_stream(dl.chunks));
        r.headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from(dl.size));
        r
    };
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::VARY, HeaderValue::from_static("Accept-Encoding"));
    resp
}

/// `chunks` gzip-compressed, chunk by chunk.
fn gzip_stream<S>(chunks: S) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send
where
    S: Stream<Item = Result<Bytes, std::io::Error>> + Send + Unpin + 'static,
{
    let enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    futures_util::stream::unfold((chunks, Some(enc)), |(mut chunks, enc)| async move {
        let mut enc = enc?;
        loop {
            match chunks.next().await {
                Some(Ok(b)) => {
                    if let Err(e) = enc.write_all(&b) {
                        return Some((Err(e), (chunks, None)));
                    }
                    let out = std::mem::take(enc.get_mut());
                    if !out.is_empty() {
                        return Some((Ok(Bytes::from(out)), (chunks, Some(enc))));
                    }
                }
                Some(Err(e)) => return Some((Err(e), (chunks, None))),
                None => {
                    return match enc.finish() {
                        Ok(out) => Some((Ok(Bytes::from(out)), (chunks, None))),
                        Err(e) => Some((Err(e), (chunks, None))),
                    }
                }
            }
        }
    })
}

/// A body's bytes, gzip-decoded as they come when `gzip` (at most `limit` bytes of them: past
/// it, an error).
fn body_stream(body: Body, gzip: bool, limit: u64) -> Bytestream {
    let raw = body
        .into_data_stream()
        .map(|r| r.map_err(|e| e.to_string()));
    if !gzip {
        return Box::pin(raw);
    }
    let dec = flate2::write::GzDecoder::new(Vec::new());
    let too_big = move || format!("the gzip body decodes to more than {limit} bytes");
    Box::pin(futures_util::stream::unfold(
        (Box::pin(raw), Some(dec), 0u64),
        move |(mut raw, dec, mut decoded)| async move {
            let mut dec = dec?;
            loop {
                match raw.next().await {
                    Some(Ok(b)) => {
                        // In slices, so that what one chunk decodes to is checked as it grows
                        // (a small chunk of a bomb decodes to megabytes).
                        for piece in b.chunks(4 << 10) {
                            if let Err(e) = dec.write_all(piece) {
                                let e = format!("the gzip body: {e}");
                                return Some((Err(e), (raw, None, decoded)));
                            }
                            if decoded + dec.get_ref().len() as u64 > limit {
                                return Some((Err(too_big()), (raw, None, decoded)));
                            }
                        }
                        let out = std::mem::take(dec.get_mut());
                        decoded += out.len() as u64;
                        if !out.is_empty() {
                            return Some((Ok(Bytes::from(out)), (raw, Some(dec), decoded)));
                        }
                    }
                    Some(Err(e)) => return Some((Err(e), (raw, None, decoded))),
                    None => {
                        return match dec.finish() {
                            Ok(out) if out.is_empty() => None,
                            Ok(out) if decoded + out.len() as u64 > limit => {
                                Some((Err(too_big()), (raw, None, decoded)))
                            }
                            Ok(out) => Some((Ok(Bytes::from(out)), (raw, None, decoded))),
                            Err(e) => {
                                Some((Err(format!("the gzip body: {e}")), (raw, None, decoded)))
                            }
                        }
                    }
                }
            }
        },
    ))
}

fn media_type(headers: &HeaderMap) -> (String, Option<String>) {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let mut it = ct.split(';');
    let media = it.next().unwrap_or("").trim().to_ascii_lowercase();
    let boundary = it.find_map(|p| {
        let (k, v) = p.split_once('=')?;
        k.trim()
            .eq_ignore_ascii_case("boundary")
            .then(|| v.trim().trim_matches('"').to_string())
    });
    (media, boundary)
}

pub async fn upload(ctx: &Ctx, req: Request<Body>) -> Response {
    let q = query(&req);
    let (user, users) = match who(ctx, &q).await {
        Ok(w) => w,
        Err(r) => return r,
    };
    let home = users.home(&user);
    let owner = users.owner(&user);
    let gzip = match req
        .headers()
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_ascii_lowercase())
    {
        None => false,
        Some(v) if v == "gzip" => true,
        Some(v) if v.is_empty() || v == "identity" => false,
        Some(v) => {
            return e2b_error(
                StatusCode::BAD_REQUEST,
                format!("Content-Encoding {v}: only gzip is taken"),
            )
        }
    };
    let meta = match metadata(req.headers()) {
        Ok(m) => m,
        Err(m) => return e2b_error(StatusCode::BAD_REQUEST, m),
    };
    let (media, boundary) = media_type(req.headers());
    let query_path = param(&q, "path").filter(|p| !p.is_empty());
    let body = body_stream(req.into_body(), gzip, MAX_GUNZIPPED);
    let written = if media == "application/octet-stream" {
        let Some(p) = query_path else {
            return e2b_error(
                StatusCode::BAD_REQUEST,
                "path query parameter is required for raw body upload",
            );
        };
        match resolve(&p, &home) {
            Ok(path) => write_one(ctx, &path, owner.clone(), &meta, body)
                .await
                .map(|e| vec![e]),
            Err(e) => return e2b_error(StatusCode::BAD_REQUEST, e.message),
        }
    } else if media.starts_with("multipart/") {
        let Some(boundary) = boundary.filter(|b| !b.is_empty() && b.len() <= 200) else {
            return e2b_error(
                StatusCode::BAD_REQUEST,
                "a multipart body without its boundary",
            );
        };
        write_parts(ctx, &home, owner, &meta, query_path, body, &boundary).await
    } else {
        return e2b_error(
            StatusCode::BAD_REQUEST,
            format!("unsupported content type: {media:?}, expected multipart/form-data or application/octet-stream"),
        );
    };
    match written {
        Ok(list) => (StatusCode::OK, axum::Json(Value::Array(list))).into_response(),
        Err(r) => r,
    }
}

/// The prefix of the headers that carry an upload's metadata: `X-Metadata-<key>: <value>`.
const METADATA_HEADER: &str = "x-metadata-";

/// An upload's metadata (its `X-Metadata-*` headers, keys lowercased) as the extended
/// attributes its files get: `user.e2b.<key>`. Every upload of envd sets them: a file written
/// without metadata loses what it had. A key must be a header's name (a token), a value
/// printable US-ASCII.
fn metadata(headers: &HeaderMap) -> Result<XattrSet, String> {
    let mut values = std::collections::BTreeMap::new();
    for (name, value) in headers {
        let Some(key) = name.as_str().strip_prefix(METADATA_HEADER) else {
            continue;
        };
        if key.is_empty() {
            return Err("a metadata header without its key (X-Metadata-<key>)".into());
        }
        let v = value
            .to_str()
            .ok()
            .filter(|v| v.bytes().all(|b| (0x20..=0x7e).contains(&b)))
            .ok_or_else(|| format!("the value of metadata {key:?} is not printable US-ASCII"))?;
        values.insert(format!("{METADATA_XATTRS}{key}"), v.to_string());
    }
    Ok(XattrSet {
        prefix: METADATA_XATTRS.to_string(),
        values,
    })
}

/// Writes one file from `bytes`, with the extended attributes of `meta`: its entry as envd
/// answers it. It is written into itself, as envd writes (watchers of its directory see it
/// written, not renamed over): a file that is there once all the bytes are (staged beside it:
/// a failed upload leaves it as it was), a new one as they come (removed when the upload
/// fails).
async fn write_one<S>(
    ctx: &Ctx,
    path: &str,
    owner: Option<String>,
    meta: &XattrSet,
    bytes: S,
) -> Result<Value, Response>
where
    S: Stream<Item = Result<Bytes, String>> + Unpin,
{
    let is_new = match ctx.node().fs_stat(&ctx.sandbox, path).await {
        Ok(_) => false,
        Err(e) if e.code == ErrorCode::PathNotFound => true,
        Err(e) => return Err(http_error(e)),
    };
    let w = FsWrite {
        file: WriteRequest {
            path: path.to_string(),
            mode: None,
            parents: true,
            owner,
        },
        in_place: true,
        xattrs: Some(meta.clone()),
    };
    let written = ctx.node().fs_write(&ctx.sandbox, w, bytes).await;
    if written.is_err() && is_new {
        match ctx.node().fs_remove(&ctx.sandbox, path, false).await {
            Ok(_) => {}
            Err(e) if e.code == ErrorCode::PathNotFound => {}
            Err(e) => {
                tracing::warn!(sandbox = %ctx.sandbox, %path, error = %e.message,
                    "E2B upload: the failed upload's file stays")
            }
        }
    }
    match written {
        Ok(w) => {
            let mut v = json!({
                "name": w.entry.name,
                "type": "file",
                "path": path,
            });
            if let Some(m) = metadata_of(&w.entry) {
                v["metadata"] = Value::Object(m);
            }
            Ok(v)
        }
        Err(e) if e.code == ErrorCode::WrongType => Err(e2b_error(
            StatusCode::BAD_REQUEST,
            format!("path is a directory: {path} ({})", e.message),
        )),
        Err(e) => Err(http_error(e)),
    }
}

/// The files of a multipart body (its parts named `file`), each written as it is read.
async fn write_parts(
    ctx: &Ctx,
    home: &str,
    owner: Option<String>,
    meta: &XattrSet,
    query_path: Option<String>,
    body: Bytestream,
    boundary: &str,
) -> Result<Vec<Value>, Response> {
    let bad = |m: String| e2b_error(StatusCode::BAD_REQUEST, m);
    let mut mp = Multipart::new(body, boundary);
    let mut out: Vec<Value> = Vec::new();
    let mut paths: Vec<String> = Vec::new();
    while let Some(head) = mp.next_part().await.map_err(bad)? {
        if head.name.as_deref() != Some("file") {
            while mp.next_chunk().await.map_err(bad)?.is_some() {}
            continue;
        }
        if paths.len() >= MAX_PARTS {
            return Err(bad(format!("an upload takes at most {MAX_PARTS} files")));
        }
        let given = match (&query_path, head.filename) {
            (Some(p), _) => p.clone(),
            (None, Some(f)) if !f.is_empty() => f,
            _ => return Err(bad("a file part without a path (filename)".into())),
        };
        let path = resolve(&given, home).map_err(|e| bad(e.message))?;
        if paths.contains(&path) {
            return Err(bad(format!(
                "you cannot upload multiple files to the same path '{path}' in one upload request, only the first specified file was uploaded"
            )));
        }
        let chunks = Box::pin(futures_util::stream::unfold(&mut mp, |mp| async move {
            match mp.next_chunk().await {
                Ok(Some(b)) => Some((Ok(b), mp)),
                Ok(None) => None,
                Err(e) => Some((Err(e), mp)),
            }
        }));
        out.push(write_one(ctx, &path, owner.clone(), meta, chunks).await?);
        paths.push(path);
    }
    Ok(out)
}

/// A part's headers (what of them an upload uses).
#[derive(Debug, Default, PartialEq)]
struct PartHead {
    name: Option<String>,
    filename: Option<String>,
}

#[derive(Debug, PartialEq)]
enum MpState {
    /// Before the first delimiter.
    Preamble,
    /// Reading a part's headers.
    Head,
    /// Reading a part's bytes.
    Data,
    /// Past the closing delimiter.
    Done,
}

/// A multipart body parsed as it comes: the parts' headers, then each part's bytes in chunks.
struct Multipart {
    body: Bytestream,
    buf: BytesMut,
    /// `\r\n--boundary`.
    delim: Vec<u8>,
    state: MpState,
    ended: bool,
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

impl Multipart {
    fn new(body: Bytestream, boundary: &str) -> Multipart {
        let mut delim = b"\r\n--".to_vec();
        delim.extend_from_slice(boundary.as_bytes());
        let mut buf = BytesMut::new();
        // The first delimiter may open the body without its CRLF.
        buf.extend_from_slice(b"\r\n");
        Multipart {
            body,
            buf,
            delim,
            state: MpState::Preamble,
            ended: false,
        }
    }

    /// More of the body into the buffer; false at its end.
    async fn fill(&mut self) -> Result<bool, String> {
        if self.ended {
            return Ok(false);
        }
        match self.body.next().await {
            Some(Ok(b)) => {
                self.buf.extend_from_slice(&b);
                Ok(true)
            }
            Some(Err(e)) => Err(format!("the request body: {e}")),
            None => {
                self.ended = true;
                Ok(false)
            }
        }
    }

    /// After a delimiter: `--` ends the body, else the line's end starts a part.
    async fn after_delimiter(&mut self) -> Result<(), String> {
        loop {
            if self.buf.len() >= 2 && &self.buf[..2] == b"--" {
                self.state = MpState::Done;
                return Ok(());
            }
            if let Some(i) = find(&self.buf, b"\r\n") {
                let _ = self.buf.split_to(i + 2);
                self.state = MpState::Head;
                return Ok(());
            }
            if self.buf.len() > 1024 {
                return Err("a multipart delimiter is followed by garbage".into());
            }
            if !self.fill().await? {
                return Err("the multipart body ends after a delimiter".into());
            }
        }
    }

    /// The next part's headers; `None` after the last part.
    async fn next_part(&mut self) -> Result<Option<PartHead>, String> {
        loop {
            match self.state {
                MpState::Done => return Ok(None),
                MpState::Data => while self.next_chunk().await?.is_some() {},
                MpState::Preamble => {
                    let delim = self.delim.clone();
                    loop {
                        if let Some(i) = find(&self.buf, &delim) {
                            let _ = self.buf.split_to(i + delim.len());
                            break;
                        }
                        // Keep what may be the start of the delimiter.
                        let keep = delim.len().min(self.buf.len());
                        let _ = self.buf.split_to(self.buf.len() - keep);
                        if !self.fill().await? {
                            return Err("the multipart body has no part".into());
                        }
                    }
                    self.after_delimiter().await?;
                }
                MpState::Head => {
                    loop {
                        if let Some(i) = find(&self.buf, b"\r\n\r\n") {
                            let head = self.buf.split_to(i + 4);
                            self.state = MpState::Data;
                            return Ok(Some(parse_head(&head[..i])));
                        }
                        // A part without headers.
                        if self.buf.starts_with(b"\r\n") {
                            let _ = self.buf.split_to(2);
                            self.state = MpState::Data;
                            return Ok(Some(PartHead::default()));
                        }
                        if self.buf.len() > MAX_PART_HEAD {
                            return Err("a part's headers are over 16 KiB".into());
                        }
                        if !self.fill().await? {
                            return Err("the multipart body ends in a part's headers".into());
                        }
                    }
                }
            }
        }
    }

    /// The next bytes of the current part; `None` at its end.
    async fn next_chunk(&mut self) -> Result<Option<Bytes>, String> {
        if self.state != MpState::Data {
            return Ok(None);
        }
        loop {
            if let Some(i) = find(&self.buf, &self.delim) {
                if i > 0 {
                    return Ok(Some(self.buf.split_to(i).freeze()));
                }
                let _ = self.buf.split_to(self.delim.len());
                self.after_delimiter().await?;
                return Ok(None);
            }
            // All but what may be the start of the delimiter can go.
            let safe = self.buf.len().saturating_sub(self.delim.len() - 1);
            if safe >= 64 << 10 || (safe > 0 && self.ended) {
                return Ok(Some(self.buf.split_to(safe).freeze()));
            }
            if !self.fill().await? {
                if safe > 0 {
                    return Ok(Some(self.buf.split_to(safe).freeze()));
                }
                return Err("the multipart body ends inside a part".into());
            }
        }
    }
}

/// The `name` and `filename` of a part's `Content-Disposition`.
fn parse_head(head: &[u8]) -> PartHead {
    let text = String::from_utf8_lossy(head);
    let mut out = PartHead::default();
    for line in text.split("\r\n") {
        let Some((k, v)) = line.split_once(':') else {
            continue;
        };
        if !k.trim().eq_ignore_ascii_case("content-disposition") {
            continue;
        }
        for (pk, pv) in disposition_params(v) {
            match pk.to_ascii_lowercase().as_str() {
                "name" => out.name = Some(pv),
                "filename" => out.filename = Some(pv),
                _ => {}
            }
        }
    }
    out
}

/// `form-data; name="file"; filename="a \"b\".txt"` -> its parameters, quotes and escapes
/// (backslash, and the `%22` browsers and httpx write for a quote) undone.
fn disposition_params(v: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let b = v.as_bytes();
    let mut i = match v.find(';') {
        Some(i) => i + 1,
        None => return out,
    };
    while i < b.len() {
        while i < b.len() && (b[i] == b' ' || b[i] == b';' || b[i] == b'\t') {
            i += 1;
        }
        let ks = i;
        while i < b.len() && b[i] != b'=' && b[i] != b';' {
            i += 1;
        }
        let key = v[ks..i].trim().to_string();
        if i >= b.len() || b[i] == b';' {
            continue;
        }
        i += 1;
        let mut val = Vec::new();
        if i < b.len() && b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' && i + 1 < b.len() {
                    i += 1;
                }
                val.push(b[i]);
                i += 1;
            }
            i += 1;
        } else {
            while i < b.len() && b[i] != b';' {
                val.push(b[i]);
                i += 1;
            }
        }
        let val = String::from_utf8_lossy(&val).trim().replace("%22", "\"");
        out.push((key, val));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream_of(chunks: Vec<&'static [u8]>) -> Bytestream {
        Box::pin(futures_util::stream::iter(
            chunks.into_iter().map(|c| Ok(Bytes::from_static(c))),
        ))
    }

    async fn parts(body: &'static [u8], cut: usize) -> Vec<(PartHead, Vec<u8>)> {
        let chunks: Vec<&'static [u8]> = body.chunks(cut).collect();
        let mut mp = Multipart::new(stream_of(chunks), "XyZ");
        let mut out = Vec::new();
        while let Some(h) = mp.next_part().await.unwrap() {
            let mut data = Vec::new();
            while let Some(c) = mp.next_chunk().await.unwrap() {
                data.extend_from_slice(&c);
            }
            out.push((h, data));
        }
        out
    }

    const BODY: &[u8] = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a/b.txt\"\r\nContent-Type: application/octet-stream\r\n\r\nhello\r\n--X\r\nworld\r\n--XyZ\r\nContent-Disposition: form-data; name=\"other\"\r\n\r\nx\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/tmp/q%22.bin\"\r\n\r\n\r\n--XyZ--\r\n";

    #[tokio::test]
    async fn multipart_parts_are_read_across_any_cut() {
        for cut in [1, 2, 3, 5, 7, 16, 1000] {
            let p = parts(BODY, cut).await;
            assert_eq!(p.len(), 3, "cut {cut}");
            assert_eq!(p[0].0.name.as_deref(), Some("file"));
            assert_eq!(p[0].0.filename.as_deref(), Some("a/b.txt"));
            assert_eq!(p[0].1, b"hello\r\n--X\r\nworld");
            assert_eq!(p[1].0.name.as_deref(), Some("other"));
            assert_eq!(p[1].1, b"x");
            assert_eq!(p[2].0.filename.as_deref(), Some("/tmp/q\".bin"));
            assert_eq!(p[2].1, b"");
        }
    }

    #[tokio::test]
    async fn a_cut_off_multipart_body_is_an_error() {
        let mut mp = Multipart::new(
            stream_of(vec![
                b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nabc",
            ]),
            "XyZ",
        );
        assert!(mp.next_part().await.unwrap().is_some());
        let mut err = None;
        loop {
            match mp.next_chunk().await {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        assert!(err.is_some());
    }

    #[test]
    fn disposition_and_queries() {
        let p = disposition_params(r#"form-data; name="file"; filename="a \"q\" b""#);
        assert_eq!(
            p,
            vec![
                ("name".to_string(), "file".to_string()),
                ("filename".to_string(), "a \"q\" b".to_string())
            ]
        );
        assert_eq!(
            crate::url_pairs("path=%2Fhome%2Fuser%2Fa+b.txt&username=user"),
            vec![
                ("path".to_string(), "/home/user/a b.txt".to_string()),
                ("username".to_string(), "user".to_string())
            ]
        );
        let mut h = HeaderMap::new();
        h.insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("br, gzip"),
        );
        assert!(wants_gzip(&h));
        h.insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("gzip;q=0"),
        );
        assert!(!wants_gzip(&h));
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("multipart/form-data; boundary=\"abc\""),
        );
        assert_eq!(
            media_type(&h),
            ("multipart/form-data".to_string(), Some("abc".to_string()))
        );
    }

    #[test]
    fn metadata_headers_become_user_e2b_attributes() {
        let mut h = HeaderMap::new();
        h.insert("X-Metadata-Author", HeaderValue::from_static("mish"));
        h.insert("x-metadata-purpose", HeaderValue::from_static("up load"));
        h.insert("x-other", HeaderValue::from_static("no"));
        let m = metadata(&h).unwrap();
        assert_eq!(m.prefix, "user.e2b.");
        let want: Vec<(String, String)> = vec![
            ("user.e2b.author".into(), "mish".into()),
            ("user.e2b.purpose".into(), "up load".into()),
        ];
        assert_eq!(m.values.into_iter().collect::<Vec<_>>(), want);
        // None: an empty set (what the file had is cleared).
        assert!(metadata(&HeaderMap::new()).unwrap().values.is_empty());
        let mut h = HeaderMap::new();
        h.insert("x-metadata-", HeaderValue::from_static("v"));
        assert!(metadata(&h).is_err());
        let mut h = HeaderMap::new();
        h.insert(
            "x-metadata-k",
            HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap(),
        );
        assert!(metadata(&h).is_err());
    }

    #[test]
    fn signatures_are_the_sdk_s() {
        // What E2B's SDK (`e2b.sandbox.signature.get_signature`) makes of the same.
        assert_eq!(
            sign("a.txt:read:user", "sbt_00", None),
            "v1_spDsPEsi4YvliPXB5EP1MOep+cc6Nm+lBNmX7r8Jby0"
        );
        assert_eq!(
            sign("a.txt:write:", "sbt_00", Some(1_700_000_000)),
            "v1_mgSRi3keSgB5Ig6DJpj5MuezRmvATheoSvPqeypp5G4"
        );
        let req = |m: &str, q: &str| {
            Request::builder()
                .method(m)
                .uri(format!("/files?{q}"))
                .body(Body::empty())
                .unwrap()
        };
        assert!(Signed::of(&req("GET", "path=a.txt")).is_none());
        let s = Signed::of(&req(
            "POST",
            "path=a.txt&signature=v1_x&signature_expiration=1700000000",
        ))
        .unwrap()
        .unwrap();
        assert_eq!(s.message, "a.txt:write:");
        assert_eq!(s.expiration, Some(1_700_000_000));
        // Made with no token, expired or not: refused.
        assert_eq!(s.check(None), Err("invalid signature"));
        assert!(
            Signed::of(&req("GET", "path=a&signature=v1_x&signature_expiration=x"))
                .unwrap()
                .is_err()
        );
    }

    #[tokio::test]
    async fn gzip_both_ways() {
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let chunks: Vec<Result<Bytes, std::io::Error>> = data
            .chunks(7000)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let gz: Vec<u8> = gzip_stream(futures_util::stream::iter(chunks))
            .map(|r| r.unwrap().to_vec())
            .collect::<Vec<_>>()
            .await
            .concat();
        let body = Body::from(gz);
        let back: Vec<u8> = body_stream(body, true, MAX_GUNZIPPED)
            .map(|r| r.unwrap().to_vec())
            .collect::<Vec<_>>()
            .await
            .concat();
        assert_eq!(back, data);
    }

    /// The gzip of `n` zero bytes (a bomb, when `n` is large).
    fn gzip_zeros(n: usize) -> Vec<u8> {
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        let zeros = vec![0u8; 1 << 20];
        let mut left = n;
        while left > 0 {
            let k = left.min(zeros.len());
            enc.write_all(&zeros[..k]).unwrap();
            left -= k;
        }
        enc.finish().unwrap()
    }

    #[tokio::test]
    async fn a_gzip_body_stops_at_the_limit() {
        // 64 MiB of zeros in some 64 KiB; the limit 8 MiB: an error, and no more than the
        // limit (and a slice's worth) decoded before it.
        let bomb = gzip_zeros(64 << 20);
        assert!(bomb.len() < 1 << 20);
        let mut s = body_stream(Body::from(bomb), true, 8 << 20);
        let mut got = 0usize;
        let mut err = None;
        while let Some(r) = s.next().await {
            match r {
                Ok(b) => got += b.len(),
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        assert!(got <= 8 << 20, "{got}");
        let err = err.expect("an error past the limit");
        assert!(err.contains("more than 8388608 bytes"), "{err}");
        // Up to the limit, whole.
        let s = body_stream(Body::from(gzip_zeros(8 << 20)), true, 8 << 20);
        let back: usize = s
            .map(|r| r.unwrap().len())
            .collect::<Vec<_>>()
            .await
            .iter()
            .sum();
        assert_eq!(back, 8 << 20);
        // A cut-off gzip body is an error, not a short file.
        let mut cut = gzip_zeros(1 << 20);
        cut.truncate(cut.len() / 2);
        let r: Vec<Result<Bytes, String>> = body_stream(Body::from(cut), true, MAX_GUNZIPPED)
            .collect()
            .await;
        assert!(r.iter().any(|x| x.is_err()), "a cut-off stream passed");
    }
}
