//! The HTTP edge: routing, request ids, authentication, body limits, and the one mapping of
//! errors to status + body. Handlers parse and validate, then hand a typed plan to the node.

use std::collections::{HashSet, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use sbx_api::{
    ApiError, Encoding, ErrorCode, EventKind, ExecObject, ExecObjectKind, ExecStatus, ExecUsage,
    OutputInfo,
};
use sbx_proto::{ExitInfo, OutputCounts, Stream};
use tokio::sync::mpsc;

use crate::node::{Node, RunEvent};

/// The most a request body may hold.
pub const MAX_BODY: usize = 64 << 20;
const KEEPALIVE_EVERY: Duration = Duration::from_secs(5);

pub struct AppState {
    pub node: Arc<Node>,
    pub api_keys: Option<HashSet<String>>,
    pub docs_url: Option<String>,
    /// Origins (`scheme://host[:port]`, lowercase) that `--cors-origin` allows besides the
    /// node's own.
    pub cors_origins: Vec<String>,
}

/// Methods and request headers a CORS preflight of an allowed origin is answered with.
const CORS_METHODS: &str = "GET, POST, PUT, DELETE";
const CORS_HEADERS: &str =
    "authorization, content-type, accept, idempotency-key, x-request-id, last-event-id, range";

#[derive(Clone)]
pub(crate) struct RequestId(pub String);

/// The router of the node's API.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/v1/run", post(run))
        .route("/internal/node", get(node_info))
        .merge(crate::api::routes())
        .merge(crate::files::routes())
        .merge(crate::functions::routes())
        .merge(crate::terminal::routes())
        .merge(crate::images_api::routes())
        .merge(crate::secrets::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), edge))
        .with_state(state)
}

/// `map_err` for a failure the caller can do nothing about: logged with its cause (`what`
/// failed), answered 500 internal, whose message sends the reader to the log.
pub(crate) fn internal<E: std::fmt::Display>(what: &'static str) -> impl FnOnce(E) -> ApiError {
    move |e| {
        tracing::error!(error = %e, "{what}");
        ApiError::internal()
    }
}

pub(crate) fn error_response(err: &ApiError, request_id: &str, docs: Option<&str>) -> Response {
    let status = StatusCode::from_u16(err.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = sbx_api::error_body(err, request_id, docs);
    let mut resp = (status, axum::Json(body)).into_response();
    if err.retryable() && status == StatusCode::SERVICE_UNAVAILABLE {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    resp
}

/// Request ids, the checks of where a request comes from (Host, Origin, CORS preflights), its
/// body's type, authentication, for every route; and every refusal as the one error body.
async fn edge(
    State(st): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    mut req: Request,
    next: Next,
) -> Response {
    let rid = sbx_api::request_id_or_new(
        req.headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok()),
    );
    req.extensions_mut().insert(RequestId(rid.clone()));
    let has_body = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim() != "0")
        || req.headers().contains_key(header::TRANSFER_ENCODING);
    let docs = st.docs_url.as_deref();
    let origin = match check_origin(&st, &req) {
        Ok(o) => o,
        Err(e) => return finish(error_response(&e, &rid, docs), &rid, has_body, None),
    };
    if let Some(o) = &origin {
        if req.method() == axum::http::Method::OPTIONS
            && req
                .headers()
                .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD)
        {
            return finish(preflight(), &rid, has_body, Some(o));
        }
    }
    let checked = check_uri(req.uri())
        .and_then(|()| {
            if req.uri().path() == "/healthz" {
                Ok(())
            } else {
                authenticate(&st, req.headers(), peer)
            }
        })
        .and_then(|()| check_content_type(&req, has_body));
    let resp = match checked {
        Ok(()) => {
            let resp = next.run(req).await;
            as_error_body(resp, &rid, docs).await
        }
        Err(e) => error_response(&e, &rid, docs),
    };
    finish(resp, &rid, has_body, origin.as_deref())
}

/// The headers every answer gets: its request id, CORS headers for an origin `--cors-origin`
/// allows, `Connection: close` after a refusal of a request with a body.
fn finish(mut resp: Response, rid: &str, has_body: bool, cors: Option<&str>) -> Response {
    if let Ok(v) = HeaderValue::from_str(rid) {
        resp.headers_mut().insert("x-request-id", v);
    }
    if let Some(v) = cors.and_then(|o| HeaderValue::from_str(o).ok()) {
        let h = resp.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
        h.insert(
            header::ACCESS_CONTROL_EXPOSE_HEADERS,
            HeaderValue::from_static("x-request-id, retry-after"),
        );
        h.append(header::VARY, HeaderValue::from_static("origin"));
    }
    // A refusal may come before the request's body was read: the connection is not reused
    // then, or a client that sends its next request on it would find it closed under it.
    if has_body && (resp.status().is_client_error() || resp.status().is_server_error()) {
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

/// The answer to a CORS preflight of an origin `--cors-origin` allows.
fn preflight() -> Response {
    let mut resp = StatusCode::NO_CONTENT.into_response();
    let h = resp.headers_mut();
    h.insert(
        header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static(CORS_METHODS),
    );
    h.insert(
        header::ACCESS_CONTROL_ALLOW_HEADERS,
        HeaderValue::from_static(CORS_HEADERS),
    );
    h.insert(
        header::ACCESS_CONTROL_MAX_AGE,
        HeaderValue::from_static("600"),
    );
    resp
}

/// The request's `Host` (or, without one, its URI's authority).
fn request_host(req: &Request) -> Option<&str> {
    req.headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .or_else(|| req.uri().authority().map(|a| a.as_str()))
        .map(str::trim)
}

/// Whether `host` (a `Host` value: a name or address, maybe with a port) is loopback:
/// `localhost`, a name under `.localhost`, 127.0.0.0/8 or ::1.
pub(crate) fn is_loopback_host(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        match rest.split_once(']') {
            Some((v6, port)) if port.is_empty() || port.starts_with(':') => v6,
            _ => return false,
        }
    } else {
        match host.rsplit_once(':') {
            Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
            _ => host,
        }
    };
    if let Ok(ip) = name.parse::<std::net::IpAddr>() {
        return ip.is_loopback();
    }
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    name == "localhost" || name.ends_with(".localhost")
}

/// Where the request comes from: without API keys only a loopback `Host` (a page that rebinds
/// its own name to 127.0.0.1 still sends that name); an `Origin` (a browser's request) only
/// the node's own or one of `--cors-origin`. The origin returned is one `--cors-origin` allows
/// (its answer gets CORS headers).
fn check_origin(st: &AppState, req: &Request) -> Result<Option<String>, ApiError> {
    let host = request_host(req);
    if st.api_keys.is_none() && !host.is_some_and(is_loopback_host) {
        let shown = host.unwrap_or("");
        return Err(ApiError::new(
            ErrorCode::ForbiddenHost,
            format!(
                "this node has no API keys and serves requests to a loopback name or address \
                 only, not to Host {shown:?}"
            ),
        )
        .with_param("Host"));
    }
    let Some(origin) = req.headers().get(header::ORIGIN) else {
        return Ok(None);
    };
    let origin = origin
        .to_str()
        .unwrap_or("")
        .trim()
        .trim_end_matches('/')
        .to_ascii_lowercase();
    if st.cors_origins.contains(&origin) {
        return Ok(Some(origin));
    }
    let own = host.map(|h| format!("http://{}", h.to_ascii_lowercase()));
    if own.as_deref() == Some(origin.as_str()) {
        return Ok(None);
    }
    Err(ApiError::new(
        ErrorCode::OriginNotAllowed,
        format!(
            "requests from pages of {origin:?} are refused (sandboxd --cors-origin ORIGIN allows \
             one)"
        ),
    )
    .with_param("Origin"))
}

/// A path and query that are valid UTF-8 once percent-decoded (what every route's extractors
/// need), so that a bad escape is answered here with the field at fault.
fn check_uri(uri: &axum::http::Uri) -> Result<(), ApiError> {
    // (`+` for a space in a query is ASCII either way: it cannot make the text invalid.)
    fn decodes(s: &str) -> bool {
        percent_encoding::percent_decode_str(s)
            .decode_utf8()
            .is_ok()
    }
    if !decodes(uri.path()) {
        return Err(ApiError::invalid_field(
            "path",
            "the path holds a percent-escape that is not UTF-8",
        ));
    }
    if let Some(q) = uri.query() {
        if let Some(bad) = q.split('&').find(|kv| !decodes(kv)) {
            let name = bad.split('=').next().unwrap_or("");
            let name = if decodes(name) { name } else { "query" };
            return Err(ApiError::invalid_field(
                name.to_string(),
                "the query holds a percent-escape that is not UTF-8",
            ));
        }
    }
    Ok(())
}

/// The content type a route's body must have: JSON, except an upload's bytes (`PUT …/files`:
/// any type, the file's own; a browser cannot send a PUT without a preflight) and a tar stream
/// (`POST …/files/tar`). A request without a body needs none.
fn check_content_type(req: &Request, has_body: bool) -> Result<(), ApiError> {
    if !has_body {
        return Ok(());
    }
    let path = req.uri().path();
    let method = req.method();
    if *method == axum::http::Method::PUT && path.ends_with("/files") {
        return Ok(());
    }
    let given = req
        .headers()
        .get(header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap_or("?"));
    let base = given
        .and_then(|g| g.split(';').next())
        .map(|b| b.trim().to_ascii_lowercase());
    let (ok, want) = if *method == axum::http::Method::POST && path.ends_with("/files/tar") {
        (
            matches!(
                base.as_deref(),
                Some("application/x-tar" | "application/tar" | "application/octet-stream")
            ),
            "application/x-tar",
        )
    } else {
        (
            base.as_deref() == Some("application/json"),
            "application/json",
        )
    };
    if ok {
        return Ok(());
    }
    let what = match given {
        Some(g) => format!("not {g:?}"),
        None => "and none was given".to_string(),
    };
    Err(ApiError::new(
        ErrorCode::UnsupportedMediaType,
        format!("the body must be sent as Content-Type: {want}, {what}"),
    )
    .with_param("Content-Type"))
}

/// An answer that is an error without the error body (an extractor's rejection: a bad path
/// parameter, a query that does not parse, ...) gets it, with the code of its status.
async fn as_error_body(resp: Response, rid: &str, docs: Option<&str>) -> Response {
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return resp;
    }
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|c| c.starts_with("application/json"));
    if is_json {
        return resp;
    }
    let text = match axum::body::to_bytes(resp.into_body(), 16 << 10).await {
        Ok(b) => String::from_utf8_lossy(&b).trim().to_string(),
        Err(_) => String::new(),
    };
    let code = match status.as_u16() {
        404 => ErrorCode::NotFound,
        405 => ErrorCode::MethodNotAllowed,
        413 => ErrorCode::BodyTooLarge,
        415 => ErrorCode::UnsupportedMediaType,
        416 => ErrorCode::InvalidRange,
        422 => ErrorCode::InvalidJson,
        400..=499 => ErrorCode::InvalidField,
        _ => {
            tracing::warn!(request_id = %rid, status = status.as_u16(), %text, "a handler failed");
            return error_response(&ApiError::internal(), rid, docs);
        }
    };
    let text = if text.is_empty() {
        status.canonical_reason().unwrap_or("refused").to_string()
    } else {
        text
    };
    error_response(&ApiError::new(code, text), rid, docs)
}

/// Whether an `Accept` header asks for an event stream: `text/event-stream` listed with a
/// quality above 0 (`q=0` means not acceptable).
pub(crate) fn accepts_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|range| {
            let mut parts = range.split(';');
            let media = parts.next().unwrap_or("").trim();
            if !media.eq_ignore_ascii_case("text/event-stream") {
                return false;
            }
            let q = parts
                .filter_map(|p| p.split_once('='))
                .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
                .map(|(_, v)| v.trim().parse::<f32>().unwrap_or(0.0))
                .unwrap_or(1.0);
            q > 0.0
        })
}

fn authenticate(st: &AppState, headers: &HeaderMap, peer: SocketAddr) -> Result<(), ApiError> {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.strip_prefix("Bearer ").unwrap_or(v).trim().to_string());
    match &st.api_keys {
        None if peer.ip().is_loopback() => Ok(()),
        None => Err(ApiError::new(
            ErrorCode::MissingApiKey,
            "this node has no API keys and serves loopback callers only",
        )),
        Some(keys) => match given {
            None => Err(ApiError::new(
                ErrorCode::MissingApiKey,
                "send Authorization: Bearer KEY",
            )),
            Some(k) if keys.contains(&k) => Ok(()),
            Some(_) => Err(ApiError::new(
                ErrorCode::InvalidApiKey,
                "that API key is not valid",
            )),
        },
    }
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// What the node is and holds: its driver, its shape limits, the warm pool.
async fn node_info(State(st): State<Arc<AppState>>) -> Response {
    let n = &st.node;
    axum::Json(serde_json::json!({
        "object": "node",
        "driver": n.driver_name(),
        "max_vcpus": n.cfg.max_vcpus,
        "max_memory_bytes": n.cfg.max_memory_bytes,
        "default_vcpus": n.cfg.default_vcpus,
        "default_memory_bytes": n.cfg.default_memory_bytes,
        "pids_max": n.cfg.pids_max,
        "sandboxes": n.sandbox_count(),
        "teardowns": n.pending_teardowns(),
        "warm_pool": { "target": n.cfg.warm_pool, "ready": n.warm_ids() },
        "templates": n.template_objects(),
    }))
    .into_response()
}

async fn not_found(
    State(st): State<Arc<AppState>>,
    Extension(rid): Extension<RequestId>,
) -> Response {
    error_response(
        &ApiError::new(ErrorCode::NotFound, "no such route"),
        &rid.0,
        st.docs_url.as_deref(),
    )
}

async fn method_not_allowed(
    State(st): State<Arc<AppState>>,
    Extension(rid): Extension<RequestId>,
) -> Response {
    error_response(
        &ApiError::new(
            ErrorCode::MethodNotAllowed,
            "this route does not take that method",
        ),
        &rid.0,
        st.docs_url.as_deref(),
    )
}

/// What every exec object of a command shares.
#[derive(Clone)]
pub(crate) struct ExecMeta {
    pub sandbox_id: String,
    pub exec_id: String,
    pub command: String,
    pub encoding: Encoding,
    pub tty: bool,
}

#[derive(Default, Clone, Copy)]
pub(crate) struct Started {
    pub pid: u32,
    pub started_at_ns: i64,
}

/// The last bytes of one stream: the latest chunks, shared with whoever else holds them (no
/// copy per chunk), made contiguous only when asked for.
pub(crate) struct Tail {
    chunks: VecDeque<Bytes>,
    /// Bytes in `chunks`.
    len: usize,
    flat: Vec<u8>,
}

impl Tail {
    pub(crate) fn new() -> Tail {
        Tail {
            chunks: VecDeque::new(),
            len: 0,
            flat: Vec::new(),
        }
    }
    pub(crate) fn push(&mut self, data: &[u8]) {
        self.push_bytes(Bytes::copy_from_slice(data));
    }
    pub(crate) fn push_bytes(&mut self, data: Bytes) {
        if data.is_empty() {
            return;
        }
        let cap = sbx_api::exec::EXEC_OUTPUT_TAIL_BYTES;
        self.len += data.len();
        self.chunks.push_back(data);
        // Chunks wholly before the last `cap` bytes are dropped.
        while let Some(front) = self.chunks.front() {
            if self.len - front.len() < cap {
                break;
            }
            self.len -= front.len();
            self.chunks.pop_front();
        }
    }
    fn bytes(&mut self, encoding: Encoding) -> &[u8] {
        let cap = sbx_api::exec::EXEC_OUTPUT_TAIL_BYTES;
        let mut skip = self.len.saturating_sub(cap);
        self.flat.clear();
        self.flat.reserve(self.len - skip);
        for c in &self.chunks {
            let from = skip.min(c.len());
            skip -= from;
            self.flat.extend_from_slice(&c[from..]);
        }
        let s = &self.flat[..];
        if encoding == Encoding::Base64 {
            // Bytes, not text: the tail is the last bytes, whatever they are.
            return s;
        }
        // A tail cut inside a UTF-8 character starts after it.
        let skip = s
            .iter()
            .take(3)
            .take_while(|b| (**b & 0xC0) == 0x80)
            .count();
        &s[skip..]
    }
}

/// The exec object of a command: `exit` when it has ended, its output counters, the tails.
pub(crate) fn exec_object(
    meta: &ExecMeta,
    started: &Started,
    exit: Option<&ExitInfo>,
    output: OutputCounts,
    stdout: &mut Tail,
    stderr: &mut Tail,
    gap: bool,
) -> ExecObject {
    let cap = sbx_api::exec::EXEC_OUTPUT_TAIL_BYTES as u64;
    let (status, exit_code, signal, duration, usage) = match exit {
        Some(x) => (
            crate::agent::exec_status(x.status),
            Some(x.exit_code),
            x.signal.map(sbx_api::signal_name),
            Some(x.duration_ns as f64 / 1e9),
            Some(ExecUsage {
                cpu_seconds: x.cpu_ns as f64 / 1e9,
                max_memory_bytes: x.max_rss_bytes,
            }),
        ),
        None => (ExecStatus::Running, None, None, None, None),
    };
    let truncated =
        gap || output.start > 0 || output.stdout_bytes > cap || output.stderr_bytes > cap;
    ExecObject {
        id: meta.exec_id.clone(),
        object: ExecObjectKind::Exec,
        sandbox_id: meta.sandbox_id.clone(),
        command: meta.command.clone(),
        tty: meta.tty,
        status,
        exit_code,
        signal,
        started_at: sbx_api::format_rfc3339_millis(i128::from(started.started_at_ns)),
        pid: started.pid,
        duration_seconds: duration,
        usage,
        output: OutputInfo {
            stdout_bytes: output.stdout_bytes,
            stderr_bytes: output.stderr_bytes,
            start: output.start,
            end: output.end,
        },
        stdout: meta.encoding.encode(stdout.bytes(meta.encoding)),
        stderr: meta.encoding.encode(stderr.bytes(meta.encoding)),
        truncated,
        encoding: meta.encoding,
    }
}

async fn run(
    State(st): State<Arc<AppState>>,
    Extension(rid): Extension<RequestId>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let docs = st.docs_url.clone();
    let fail = |e: ApiError| error_response(&e, &rid.0, docs.as_deref());
    if let Some(key) = headers.get("idempotency-key") {
        let key = key.to_str().unwrap_or("");
        if let Err(e) = sbx_api::validate_idempotency_key(key) {
            return fail(e);
        }
    }
    let bytes = match read_body(body).await {
        Ok(b) => b,
        Err(e) => return fail(e),
    };
    let req = match sbx_api::parse_run_request(&bytes) {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    let wants_stream = req.stream.unwrap_or_else(|| accepts_event_stream(&headers));
    let plan = match st.node.plan_run(req) {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    let meta = ExecMeta {
        sandbox_id: plan.sandbox_id.clone(),
        exec_id: plan.exec_id.clone(),
        command: plan.command.clone(),
        encoding: plan.encoding,
        tty: false,
    };
    tracing::info!(request_id = %rid.0, sandbox = %meta.sandbox_id, exec = %meta.exec_id, "run");
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(st.node.clone().run(plan, tx));
    if wants_stream {
        sse_response(rx, meta, rid.0, docs)
    } else {
        json_response(rx, meta, &rid.0, docs.as_deref()).await
    }
}

pub(crate) async fn read_body(body: Body) -> Result<Bytes, ApiError> {
    use http_body_util::{BodyExt, Limited};
    match Limited::new(body, MAX_BODY).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e)
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(ApiError::new(
                ErrorCode::BodyTooLarge,
                "the request body is over 64 MiB",
            ))
        }
        Err(e) => Err(ApiError::new(
            ErrorCode::InvalidJson,
            format!("the body could not be read: {e}"),
        )),
    }
}

async fn json_response(
    mut rx: mpsc::Receiver<RunEvent>,
    meta: ExecMeta,
    rid: &str,
    docs: Option<&str>,
) -> Response {
    let mut started = Started::default();
    let (mut out, mut err) = (Tail::new(), Tail::new());
    let mut gap = false;
    while let Some(ev) = rx.recv().await {
        match ev {
            RunEvent::Started { pid, started_at_ns } => started = Started { pid, started_at_ns },
            RunEvent::Output { stream, data, .. } => match stream {
                Stream::Stderr => err.push(&data),
                _ => out.push(&data),
            },
            RunEvent::Gap { .. } => gap = true,
            RunEvent::Exited { exit, output } => {
                let obj = exec_object(
                    &meta,
                    &started,
                    Some(&exit),
                    output,
                    &mut out,
                    &mut err,
                    gap,
                );
                return (StatusCode::OK, axum::Json(obj)).into_response();
            }
            RunEvent::Failed(e) => return error_response(&e, rid, docs),
        }
    }
    error_response(&ApiError::internal(), rid, docs)
}

/// How many bytes at the end of `b` begin a UTF-8 character that is not complete yet.
fn incomplete_suffix(b: &[u8]) -> usize {
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
fn take_text<'a>(
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
fn utf8_lossy(b: &[u8]) -> std::borrow::Cow<'_, str> {
    match std::str::from_utf8(b) {
        Ok(s) => s.into(),
        Err(_) => String::from_utf8_lossy(b),
    }
}

const LOW_BITS: u64 = 0x0101_0101_0101_0101;
const HIGH_BITS: u64 = 0x8080_8080_8080_8080;

/// The bytes of `w` (8 bytes, little-endian) that JSON strings must escape: control characters,
/// `"` and `\`. The lowest set high bit marks the first such byte exactly (bits above it may be
/// false positives).
fn escapes_in(w: u64) -> u64 {
    let zero_byte = |v: u64| v.wrapping_sub(LOW_BITS) & !v & HIGH_BITS;
    let control = w.wrapping_sub(LOW_BITS * 0x20) & !w & HIGH_BITS;
    control | zero_byte(w ^ (LOW_BITS * b'"' as u64)) | zero_byte(w ^ (LOW_BITS * b'\\' as u64))
}

/// Appends `s` as a JSON string, escaped as serde_json does (`\"`, `\\`, `\b \f \n \r \t`,
/// other control characters as `\u00XX`; everything else as it is). Runs that need no escape are
/// found 8 bytes at a time and copied whole.
fn push_json_str(out: &mut Vec<u8>, s: &str) {
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
fn output_event(kind: EventKind, id: u64, from: u64, text: &str) -> Bytes {
    use std::io::Write;
    let mut out = Vec::with_capacity(text.len() + text.len() / 16 + 96);
    let _ = write!(out, "event: {}\nid: {id}\ndata: {{\"data\":", kind.as_str());
    push_json_str(&mut out, text);
    let _ = write!(out, ",\"position\":{from}}}\n\n");
    Bytes::from(out)
}

struct SseState {
    rx: mpsc::Receiver<RunEvent>,
    meta: ExecMeta,
    rid: String,
    docs: Option<String>,
    started: Started,
    out: Tail,
    err: Tail,
    carry_out: Vec<u8>,
    carry_err: Vec<u8>,
    cursor: u64,
    gap: bool,
    done: bool,
}

fn sse_response(
    rx: mpsc::Receiver<RunEvent>,
    meta: ExecMeta,
    rid: String,
    docs: Option<String>,
) -> Response {
    event_stream(rx, meta, Started::default(), 0, rid, docs)
}

/// An event stream of a command's events from position `from` (`started`: what is known of it
/// when the stream does not begin with its start).
pub(crate) fn event_stream(
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
        started,
        out: Tail::new(),
        err: Tail::new(),
        carry_out: Vec::new(),
        carry_err: Vec::new(),
        cursor: from,
        gap: false,
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
pub(crate) fn event_stream_answer(body: Body) -> Response {
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

async fn next_sse(s: &mut SseState) -> Bytes {
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
                s.started = Started { pid, started_at_ns };
                let obj = exec_object(
                    &s.meta,
                    &s.started,
                    None,
                    OutputCounts::default(),
                    &mut Tail::new(),
                    &mut Tail::new(),
                    false,
                );
                let data = serde_json::to_value(obj).unwrap_or_default();
                return sbx_api::sse(EventKind::Start, 0, &data).into();
            }
            RunEvent::Output { stream, pos, data } => {
                let (kind, tail, carry) = match stream {
                    Stream::Stderr => (EventKind::Stderr, &mut s.err, &mut s.carry_err),
                    _ => (EventKind::Stdout, &mut s.out, &mut s.carry_out),
                };
                let data = Bytes::from(data);
                tail.push_bytes(data.clone());
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
                s.gap = true;
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
                let obj = exec_object(
                    &s.meta,
                    &s.started,
                    Some(&exit),
                    output,
                    &mut s.out,
                    &mut s.err,
                    s.gap,
                );
                let data = serde_json::to_value(obj).unwrap_or_default();
                tail.push_str(&sbx_api::sse(EventKind::Exit, output.end, &data));
                return tail.into();
            }
            RunEvent::Failed(e) => {
                s.done = true;
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
    fn rejections_without_the_error_body_get_it() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let plain = (
            StatusCode::BAD_REQUEST,
            "Failed to deserialize query string",
        )
            .into_response();
        let resp = rt.block_on(as_error_body(plain, "rid-1", None));
        assert_eq!(resp.status(), 400);
        let body = rt
            .block_on(axum::body::to_bytes(resp.into_body(), 1 << 20))
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "invalid_field");
        assert_eq!(v["error"]["request_id"], "rid-1");
        assert_eq!(v["error"]["message"], "Failed to deserialize query string");
        let unsupported = (StatusCode::UNSUPPORTED_MEDIA_TYPE, "").into_response();
        let resp = rt.block_on(as_error_body(unsupported, "r", None));
        let body = rt
            .block_on(axum::body::to_bytes(resp.into_body(), 1 << 20))
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "unsupported_media_type");
        let ok = (StatusCode::OK, "fine").into_response();
        let resp = rt.block_on(as_error_body(ok, "r", None));
        assert_eq!(resp.status(), 200);
    }

    #[test]
    fn accept_with_q_zero_is_not_acceptable() {
        let h = |v: &str| {
            let mut m = HeaderMap::new();
            m.insert(header::ACCEPT, HeaderValue::from_str(v).unwrap());
            accepts_event_stream(&m)
        };
        assert!(h("text/event-stream"));
        assert!(h("application/json, TEXT/event-stream;q=0.1"));
        assert!(!h("text/event-stream;q=0"));
        assert!(!h("text/event-stream; q=0.0, application/json"));
        assert!(!h("*/*"));
        assert!(!accepts_event_stream(&HeaderMap::new()));
    }

    #[test]
    fn loopback_hosts() {
        for h in [
            "localhost",
            "localhost:7700",
            "LOCALHOST.",
            "a.localhost:1",
            "127.0.0.1",
            "127.1.2.3:80",
            "[::1]:7700",
            "[::1]",
        ] {
            assert!(is_loopback_host(h), "{h}");
        }
        for h in [
            "evil.com",
            "localhost.evil.com",
            "127.0.0.1.nip.io",
            "10.0.0.1:7700",
            "[::2]:1",
            "[::1]x",
            "",
        ] {
            assert!(!is_loopback_host(h), "{h}");
        }
    }

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

    #[test]
    fn tail_keeps_the_last_mebibyte() {
        let mut t = Tail::new();
        t.push(&vec![b'a'; 1 << 20]);
        t.push(b"bc");
        let b = t.bytes(Encoding::Utf8);
        assert_eq!(b.len(), 1 << 20);
        assert_eq!(&b[b.len() - 2..], b"bc");
        // Binary output is cut where the last mebibyte starts, even inside what would be a
        // UTF-8 character.
        let mut t = Tail::new();
        t.push(&vec![0x80; (1 << 20) + 5]);
        assert_eq!(t.bytes(Encoding::Base64).len(), 1 << 20);
        assert_eq!(t.bytes(Encoding::Utf8).len(), (1 << 20) - 3);
    }
}
