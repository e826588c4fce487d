//! The fleet's `/v1`: creates and runs placed on a node, every call of a sandbox passed to the
//! node the table names, and the list of every node's sandboxes.
//!
//! A sandbox object in an answer (create, GET, PATCH, DELETE, restart, sleep, wake, fork, the
//! list) gets `node: {id, name}` and `epoch` (the table's). Names are the fleet's: a name is
//! reserved in the table (a row of status `reserved`) before the call goes to a node, and kept
//! by the sandbox's row once the node made it (or freed when it refused; a run's when the run
//! is over).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method, Response as HttpResponse, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use futures_util::future::join_all;
use http_body::{Frame, SizeHint};
use sbx_api::{ApiError, ErrorCode};
use serde_json::{json, Value};

use crate::db::{DbError, MoveRow, NodeRow, NodeState, SandboxRow};
use crate::list::{merge, FleetCursor, Pos};
use crate::machine;
use crate::place;
use crate::proxy;
use crate::server::{db_failed, fail, locked, read_limited, rfc3339, Ctl, ReadError, Rid};

/// The status of a row that only holds a name for a create or a run under way.
pub const RESERVED: &str = "reserved";
/// The most bytes of a create's or a run's body (read to place it: its name and image).
const MAX_PLACED_BODY: usize = 8 << 20;
/// The most bytes of a node's answer the control plane reads to add to it (a sandbox object,
/// a fork's, a page of a list).
const MAX_ANSWER: usize = 16 << 20;

type St = State<Arc<Ctl>>;
type RidExt = Extension<Rid>;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Create,
    Run,
    /// `POST /v1/functions/sandbox::create` or `::run` for the functions interface
    /// (`functions.rs`): `made` when it leaves a sandbox (a create, a run with
    /// `keep_sandbox`), recorded from the reply's `sandbox_id`.
    Function {
        made: bool,
    },
}

/// What a create's or a run's body says of where it should go.
#[derive(Default)]
struct Hints {
    name: Option<String>,
    image: Option<String>,
    snapshot: Option<String>,
}

impl Hints {
    /// Read leniently: a body the node will refuse (not JSON, a name of the wrong type) is
    /// passed on for the node to say why.
    fn of(body: &[u8]) -> Hints {
        let Ok(Value::Object(o)) = serde_json::from_slice::<Value>(body) else {
            return Hints::default();
        };
        let s = |k: &str| o.get(k).and_then(Value::as_str).map(String::from);
        Hints {
            name: s("name").filter(|n| !n.is_empty()),
            image: s("image"),
            snapshot: s("snapshot"),
        }
    }
}

/// The node's own error for a name another sandbox of the fleet has.
fn name_taken(name: &str) -> ApiError {
    ApiError::new(ErrorCode::NameTaken, format!("a sandbox is named {name}")).with_param("name")
}

/// The node's own error for a sandbox nobody has.
pub(crate) fn sandbox_not_found(key: &str) -> ApiError {
    ApiError::new(ErrorCode::SandboxNotFound, format!("no sandbox {key}"))
}

pub(crate) fn node_away(node: &NodeRow, e: &proxy::ProxyError) -> ApiError {
    ApiError::new(
        ErrorCode::Unavailable,
        format!(
            "the node {} ({}) at {} did not answer: {e}",
            node.name, node.id, node.url
        ),
    )
}

pub(crate) fn node_lost(node: &NodeRow, sandbox: &str) -> ApiError {
    ApiError::new(
        ErrorCode::Unavailable,
        format!(
            "sandbox {sandbox} is on node {} ({}), which is lost: its lease ran out at {} and it \
             has not come back; calls for its sandboxes fail until it joins again",
            node.name,
            node.id,
            rfc3339(node.lease_until_ms)
        ),
    )
}

/// `node: {id, name}` and `epoch` added to a sandbox object.
fn augment(v: &mut Value, node: &NodeRow, epoch: Option<i64>) {
    if let Some(o) = v.as_object_mut() {
        o.insert("node".into(), json!({ "id": node.id, "name": node.name }));
        o.insert("epoch".into(), json!(epoch));
    }
}

/// A JSON answer with the status and headers of the node's (its length is the new body's).
fn json_answer(mut parts: axum::http::response::Parts, v: &Value) -> Response {
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    let body = serde_json::to_vec(v).unwrap_or_default();
    HttpResponse::from_parts(parts, Body::from(body))
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|c| c.starts_with("application/json"))
}

/// A path's segment, percent-escapes decoded (ids and names need none; a client may send them).
pub(crate) fn decode_segment(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3).unwrap_or(&[])).unwrap_or("");
            if let Ok(v) = u8::from_str_radix(hex, 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A name held for a call under way.
struct Reservation {
    /// Its row's id (`rsv-…`).
    id: String,
    name: String,
}

impl Ctl {
    /// Reserves `name` in the table for a call going to `node`. `Ok(None)`: a retry of a call
    /// with an Idempotency-Key whose sandbox holds the name on that node: the node answers it.
    async fn reserve(
        &self,
        rid: &str,
        name: &str,
        node: &NodeRow,
        retry_of_key: bool,
    ) -> Result<Option<Reservation>, Response> {
        {
            let mut names = locked(&self.names);
            if !names.insert(name.to_string()) {
                return Err(fail(rid, name_taken(name)));
            }
        }
        let unlock = || {
            locked(&self.names).remove(name);
        };
        let row = SandboxRow {
            id: sbx_api::ids::new_id("rsv"),
            name: Some(name.to_string()),
            node_id: node.id.clone(),
            epoch: 1,
            status: RESERVED.into(),
            build: node.build.clone(),
            created_at_ms: 0,
            updated_at_ms: 0,
        };
        for _ in 0..3 {
            match self.db.insert_sandbox(&row).await {
                Ok(()) => {
                    return Ok(Some(Reservation {
                        id: row.id,
                        name: name.to_string(),
                    }))
                }
                Err(DbError::NameTaken { .. }) => {}
                Err(e) => {
                    unlock();
                    return Err(db_failed(rid, &e));
                }
            }
            let holder = match self.db.sandbox_by_name(name).await {
                Ok(h) => h,
                Err(e) => {
                    unlock();
                    return Err(db_failed(rid, &e));
                }
            };
            match holder {
                // Freed meanwhile.
                None => continue,
                // A run that is over: its row goes now.
                Some(h) if h.status == RESERVED && locked(&self.released).contains(&h.id) => {
                    if let Err(e) = self.db.delete_sandbox(&h.id).await {
                        unlock();
                        return Err(db_failed(rid, &e));
                    }
                    locked(&self.released).remove(&h.id);
                }
                Some(h) if retry_of_key && h.node_id == node.id && h.status != RESERVED => {
                    unlock();
                    return Ok(None);
                }
                Some(_) => {
                    unlock();
                    return Err(fail(rid, name_taken(name)));
                }
            }
        }
        unlock();
        Err(fail(rid, name_taken(name)))
    }

    /// Frees a reservation whose call the node refused (or did not answer).
    async fn unreserve(&self, r: Reservation) {
        if let Err(e) = self.db.delete_sandbox(&r.id).await {
            tracing::error!(error = %e, name = %r.name, "a name's reservation could not be freed");
            locked(&self.released).insert(r.id);
        }
        locked(&self.names).remove(&r.name);
    }

    /// The sandbox a path names, by id or by name, as the table has it.
    pub(crate) async fn lookup(&self, key: &str) -> Result<Option<SandboxRow>, DbError> {
        let row = match self.db.sandbox(key).await? {
            Some(r) => Some(r),
            None => self.db.sandbox_by_name(key).await?,
        };
        Ok(row.filter(|r| r.status != RESERVED))
    }
}

/// `POST /v1/sandboxes`.
pub async fn create(State(ctl): St, Extension(Rid(rid)): RidExt, req: Request) -> Response {
    place(ctl, rid, req, Kind::Create).await
}

/// `POST /v1/run`.
pub async fn run(State(ctl): St, Extension(Rid(rid)): RidExt, req: Request) -> Response {
    place(ctl, rid, req, Kind::Run).await
}

/// A GET of `path` on `node` with the caller's headers (its key, its request id).
async fn ask(ctl: &Ctl, node: &NodeRow, path: &str, headers: &HeaderMap) -> Option<Response> {
    let mut req = Request::new(Body::empty());
    *req.uri_mut() = path.parse().ok()?;
    *req.headers_mut() = headers.clone();
    req.headers_mut().remove(header::CONTENT_LENGTH);
    req.headers_mut().remove(header::CONTENT_TYPE);
    proxy::forward(&ctl.client, &node.url, req).await.ok()
}

/// The node that holds snapshot `snap` (a sandbox made from it goes there).
async fn snapshot_holder<'a>(
    ctl: &Ctl,
    nodes: &'a [NodeRow],
    snap: &str,
    headers: &HeaderMap,
) -> Option<&'a NodeRow> {
    let path = format!("/v1/snapshots/{}", escape_segment(snap));
    let live: Vec<&NodeRow> = nodes
        .iter()
        .filter(|n| n.state != NodeState::Lost)
        .collect();
    let answers = join_all(live.iter().map(|n| ask(ctl, n, &path, headers))).await;
    live.into_iter()
        .zip(answers)
        .find(|(_, a)| a.as_ref().is_some_and(|r| r.status().is_success()))
        .map(|(n, _)| n)
}

/// A path segment with what is not plain escaped.
pub(crate) fn escape_segment(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

pub(crate) async fn place(ctl: Arc<Ctl>, rid: String, req: Request, kind: Kind) -> Response {
    let (parts, body) = req.into_parts();
    let bytes = match read_limited(body, MAX_PLACED_BODY).await {
        Ok(b) => b,
        Err(ReadError::TooLarge) => return fail(
            &rid,
            ApiError::new(
                ErrorCode::BodyTooLarge,
                "the body is over 8 MiB, the most the control plane takes for a create or a run",
            ),
        ),
        Err(ReadError::Broken(e)) => {
            return fail(
                &rid,
                ApiError::new(
                    ErrorCode::InvalidJson,
                    format!("the body could not be read: {e}"),
                ),
            )
        }
    };
    let hints = Hints::of(&bytes);
    let scope = parts
        .headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(|k| format!("{} {}\n{k}", parts.method, parts.uri.path()));
    let nodes = match ctl.db.nodes().await {
        Ok(n) => n,
        Err(e) => return db_failed(&rid, &e),
    };
    let again = scope
        .as_deref()
        .and_then(|s| ctl.idem_node(s))
        .and_then(|id| {
            nodes
                .iter()
                .find(|n| n.id == id && n.state != NodeState::Lost)
        });
    let node = match again {
        Some(n) => n,
        None => {
            let by_snapshot = match &hints.snapshot {
                Some(s) => snapshot_holder(&ctl, &nodes, s, &parts.headers).await,
                None => None,
            };
            match by_snapshot {
                Some(n) => n,
                None => {
                    let extra = ctl.extra_load();
                    match place::choose(&nodes, &extra, hints.image.as_deref()) {
                        Ok(n) => n,
                        Err(why) => {
                            return fail(
                                &rid,
                                ApiError::new(ErrorCode::NoCapacity, why.to_string()),
                            )
                        }
                    }
                }
            }
        }
    }
    .clone();
    let reservation = match &hints.name {
        Some(name) => match ctl.reserve(&rid, name, &node, again.is_some()).await {
            Ok(r) => r,
            Err(resp) => return resp,
        },
        None => None,
    };
    ctl.placing(&node.id);
    let sent = proxy::forward(
        &ctl.client,
        &node.url,
        Request::from_parts(parts, Body::from(bytes)),
    )
    .await;
    let resp = match sent {
        Ok(r) => r,
        Err(e) => {
            ctl.placed(&node.id, false);
            if let Some(r) = reservation {
                ctl.unreserve(r).await;
            }
            tracing::warn!(request_id = %rid, node = %node.name, error = %e, "a node did not answer");
            return fail(&rid, node_away(&node, &e));
        }
    };
    if let Some(s) = scope {
        ctl.remember_idem(s, &node.id);
    }
    ctl.placed(
        &node.id,
        resp.status().is_success() && matches!(kind, Kind::Create | Kind::Function { made: true }),
    );
    if !resp.status().is_success() {
        if let Some(r) = reservation {
            ctl.unreserve(r).await;
        }
        return resp;
    }
    match kind {
        Kind::Create | Kind::Function { .. } => {
            created(&ctl, &rid, resp, &node, reservation, kind).await
        }
        Kind::Run => match reservation {
            Some(r) => {
                let (parts, body) = resp.into_parts();
                let sse = parts
                    .headers
                    .get(header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .is_some_and(|c| c.starts_with("text/event-stream"));
                let length = parts
                    .headers
                    .get(header::CONTENT_LENGTH)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<u64>().ok());
                let body = RunBody {
                    inner: body,
                    hold: Some(RunHold {
                        ctl: ctl.clone(),
                        id: r.id,
                        name: r.name,
                    }),
                    remaining: length,
                    sse,
                    tail: b"\n".to_vec(),
                };
                HttpResponse::from_parts(parts, Body::new(body))
            }
            None => resp,
        },
    }
}

/// A create the node made: its row written (the name moved to it from the reservation), its
/// answer given with `node` and `epoch`.
async fn created(
    ctl: &Ctl,
    rid: &str,
    resp: Response,
    node: &NodeRow,
    reservation: Option<Reservation>,
    kind: Kind,
) -> Response {
    let (parts, body) = resp.into_parts();
    let bytes = match read_limited(body, MAX_ANSWER).await {
        Ok(b) => b,
        Err(e) => {
            tracing::error!(request_id = %rid, node = %node.name, ?e, "a create's answer could not be read");
            if let Some(r) = reservation {
                ctl.unreserve(r).await;
            }
            return fail(
                rid,
                ApiError::new(
                    ErrorCode::Unavailable,
                    format!(
                        "the node {} made the sandbox, and its answer broke off: GET \
                         /v1/sandboxes lists it",
                        node.name
                    ),
                ),
            );
        }
    };
    let mut v: Value = match serde_json::from_slice(&bytes) {
        Ok(v) => v,
        Err(_) => {
            if let Some(r) = reservation {
                ctl.unreserve(r).await;
            }
            return HttpResponse::from_parts(parts, Body::from(bytes));
        }
    };
    // A function's reply names its sandbox `sandbox_id` (made running: it waited for it).
    let function = matches!(kind, Kind::Function { .. });
    let id_key = if function { "sandbox_id" } else { "id" };
    let Some(id) = v.get(id_key).and_then(Value::as_str).map(String::from) else {
        if let Some(r) = reservation {
            ctl.unreserve(r).await;
        }
        return HttpResponse::from_parts(parts, Body::from(bytes));
    };
    let status = v
        .get("status")
        .and_then(Value::as_str)
        .unwrap_or(if function { "running" } else { "starting" })
        .to_string();
    let row = SandboxRow {
        id: id.clone(),
        name: None,
        node_id: node.id.clone(),
        epoch: 1,
        status,
        build: node.build.clone(),
        created_at_ms: 0,
        updated_at_ms: 0,
    };
    let epoch = match ctl.db.insert_sandbox(&row).await {
        Ok(()) => Some(1),
        // The same create again (an Idempotency-Key's replay): the row is there.
        Err(DbError::IdTaken { .. }) => match ctl.db.sandbox(&id).await {
            Ok(r) => r.map(|r| r.epoch),
            Err(e) => {
                tracing::error!(request_id = %rid, error = %e, "reading a sandbox's row");
                None
            }
        },
        Err(e) => {
            tracing::error!(request_id = %rid, sandbox = %id, error = %e, "a sandbox's row could not be written");
            None
        }
    };
    if let Some(r) = reservation {
        // The name goes from the reservation to the sandbox's row while no other call of this
        // control plane can give it (it is in `names` until then).
        if let Err(e) = ctl.db.delete_sandbox(&r.id).await {
            tracing::error!(request_id = %rid, error = %e, "a name's reservation could not be freed");
        }
        let name = v.get("name").and_then(Value::as_str).unwrap_or(&r.name);
        match ctl.db.update_sandbox(&id, None, Some(Some(name))).await {
            Ok(_) => {}
            Err(e) => {
                tracing::error!(request_id = %rid, sandbox = %id, %name, error = %e, "a sandbox's name could not be written")
            }
        }
        locked(&ctl.names).remove(&r.name);
    }
    augment(&mut v, node, epoch);
    json_answer(parts, &v)
}

/// A run's name held until the run is over: freed (for this control plane at once, in the
/// table right after) when its answer's last bytes pass, or when the answer is dropped.
struct RunHold {
    ctl: Arc<Ctl>,
    id: String,
    name: String,
}

impl RunHold {
    fn release(self) {
        locked(&self.ctl.released).insert(self.id.clone());
        locked(&self.ctl.names).remove(&self.name);
        let RunHold { ctl, id, .. } = self;
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                match ctl.db.delete_sandbox(&id).await {
                    Ok(_) => {
                        locked(&ctl.released).remove(&id);
                    }
                    Err(e) => tracing::warn!(error = %e, "a run's name reservation stays (the next call with the name frees it)"),
                }
            });
        }
    }
}

/// A run's answer, passed on as it comes, that frees the run's name before its last bytes go:
/// the last of a length it has, or the event that ends a stream (`exit`, `error`).
struct RunBody {
    inner: Body,
    hold: Option<RunHold>,
    remaining: Option<u64>,
    sse: bool,
    /// The last bytes seen, for an event's name cut by a chunk.
    tail: Vec<u8>,
}

const END_EVENTS: [&[u8]; 2] = [b"\nevent: exit\n", b"\nevent: error\n"];

impl RunBody {
    fn free(&mut self) {
        if let Some(h) = self.hold.take() {
            h.release();
        }
    }

    fn ends_with(&mut self, d: &[u8]) -> bool {
        if let Some(r) = self.remaining.as_mut() {
            *r = r.saturating_sub(d.len() as u64);
            if *r == 0 {
                return true;
            }
        }
        if !self.sse {
            return false;
        }
        let mut seen = std::mem::take(&mut self.tail);
        seen.extend_from_slice(d);
        let end = END_EVENTS
            .iter()
            .any(|e| seen.windows(e.len()).any(|w| w == *e));
        let keep = seen.len().saturating_sub(16);
        self.tail = seen.split_off(keep);
        end
    }
}

impl http_body::Body for RunBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let last = frame.data_ref().is_some_and(|d| this.ends_with(d));
                if last {
                    this.free();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(other) => {
                this.free();
                Poll::Ready(other)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for RunBody {
    fn drop(&mut self) {
        self.free();
    }
}

/// The most bytes of a request's body kept to send it again (a call that met a release).
const MAX_REPLAY: u64 = 1 << 20;
/// How long a call that met a release (`moved`) waits for the table to change.
const MOVED_WAIT: Duration = Duration::from_secs(3);

/// A request that can be sent twice: its head and its whole body.
pub(crate) struct Replay {
    method: Method,
    uri: axum::http::Uri,
    version: axum::http::Version,
    headers: HeaderMap,
    body: Bytes,
}

impl Replay {
    pub(crate) fn request(&self) -> Request {
        let mut r = Request::new(Body::from(self.body.clone()));
        *r.method_mut() = self.method.clone();
        *r.uri_mut() = self.uri.clone();
        *r.version_mut() = self.version;
        *r.headers_mut() = self.headers.clone();
        r
    }
}

/// The request as one that can be sent again, where its body is small (or it has none) and it
/// does not ask to switch protocols; else as it came.
pub(crate) async fn replayable(req: Request) -> Result<Replay, Request> {
    if proxy::upgrade_of(req.headers()).is_some() {
        return Err(req);
    }
    let chunked = req.headers().contains_key(header::TRANSFER_ENCODING);
    let length = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    let small = match length {
        Some(n) => n <= MAX_REPLAY,
        None => !chunked,
    };
    if !small {
        return Err(req);
    }
    let (parts, body) = req.into_parts();
    let limit = usize::try_from(length.unwrap_or(0).min(MAX_REPLAY)).unwrap_or(0);
    match read_limited(body, limit.max(1)).await {
        Ok(body) => Ok(Replay {
            method: parts.method,
            uri: parts.uri,
            version: parts.version,
            headers: parts.headers,
            body,
        }),
        // A body that broke off or lied about its length: sent as it is (empty) for the node
        // to judge.
        Err(_) => Err(Request::from_parts(parts, Body::empty())),
    }
}

pub(crate) fn being_moved(row: &SandboxRow, m: &MoveRow) -> ApiError {
    ApiError::new(
        ErrorCode::Unavailable,
        format!(
            "sandbox {} is being moved ({}, step {}): ask again in a moment",
            row.id, m.id, m.step
        ),
    )
}

/// After a node answered `moved`: waits (briefly) until the sandbox's move is over (the
/// call then goes where the table has it), or the wait is up (a move still under way then
/// answers 503 and the caller asks again).
pub(crate) async fn wait_moved(ctl: &Ctl, row: &SandboxRow) {
    let deadline = tokio::time::Instant::now() + MOVED_WAIT;
    while tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if let Ok(None) = ctl.db.unfinished_move_of(&row.id).await {
            return;
        }
    }
}

/// Every route of a sandbox (`/v1/sandboxes/{id}` and below): passed to the node the table
/// names, streamed both ways. While the sandbox is being moved: at `releasing` to the old node
/// (which may answer 409 `moved` once it released it: the call then waits briefly and is
/// routed by the table again, once, where its body is small enough to send twice); past it
/// (taking over, going back) 503 `unavailable` with `Retry-After: 1`.
pub async fn sandbox_call(State(ctl): St, Extension(Rid(rid)): RidExt, req: Request) -> Response {
    let path = req.uri().path().to_string();
    let rest = path.strip_prefix("/v1/sandboxes/").unwrap_or("");
    let (seg, tail) = rest.split_once('/').unwrap_or((rest, ""));
    let key = decode_segment(seg);
    let tail = tail.to_string();
    let method = req.method().clone();
    let mut pending = Some(req);
    let mut replay: Option<Replay> = None;
    for round in 0..2 {
        let row = match ctl.lookup(&key).await {
            Ok(Some(r)) => r,
            Ok(None) => return fail(&rid, sandbox_not_found(&key)),
            Err(e) => return db_failed(&rid, &e),
        };
        match ctl.db.unfinished_move_of(&row.id).await {
            Ok(Some(m)) if m.step != machine::RELEASING => {
                return fail(&rid, being_moved(&row, &m))
            }
            Ok(_) => {}
            Err(e) => return db_failed(&rid, &e),
        }
        let node = match ctl.db.node(&row.node_id).await {
            Ok(Some(n)) => n,
            Ok(None) => {
                return fail(
                    &rid,
                    ApiError::new(
                        ErrorCode::Unavailable,
                        format!(
                        "sandbox {} is on node {}, which the control plane's table no longer has",
                        row.id, row.node_id
                    ),
                    ),
                )
            }
            Err(e) => return db_failed(&rid, &e),
        };
        if node.state == NodeState::Lost {
            return fail(&rid, node_lost(&node, &row.id));
        }
        let req = match (pending.take(), &replay) {
            (Some(req), _) if round == 0 => match replayable(req).await {
                Ok(r) => {
                    let req = r.request();
                    replay = Some(r);
                    req
                }
                Err(req) => req,
            },
            (_, Some(r)) => r.request(),
            (Some(req), None) => req,
            (None, None) => return fail(&rid, ApiError::internal()),
        };
        let resp = match proxy::forward(&ctl.client, &node.url, req).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(request_id = %rid, node = %node.name, error = %e, "a node did not answer");
                return fail(&rid, node_away(&node, &e));
            }
        };
        if round == 0 && replay.is_some() && resp.status() == StatusCode::CONFLICT {
            let (parts, body) = resp.into_parts();
            let bytes = match read_limited(body, MAX_ANSWER).await {
                Ok(b) => b,
                Err(_) => {
                    return fail(
                        &rid,
                        ApiError::new(
                            ErrorCode::Unavailable,
                            format!("the node {}'s answer broke off", node.name),
                        ),
                    )
                }
            };
            let moved = serde_json::from_slice::<Value>(&bytes)
                .ok()
                .and_then(|v| {
                    v.pointer("/error/code")
                        .and_then(Value::as_str)
                        .map(String::from)
                })
                .is_some_and(|c| c == "moved");
            if moved {
                tracing::info!(request_id = %rid, sandbox = %row.id, node = %node.name, "the node released the sandbox: routed again");
                wait_moved(&ctl, &row).await;
                continue;
            }
            return HttpResponse::from_parts(parts, Body::from(bytes));
        }
        return answered(&ctl, &rid, &row, &node, &method, &tail, resp).await;
    }
    fail(&rid, ApiError::internal())
}

/// A node's answer to a call of a sandbox: its row deleted with it, its status followed, and
/// `node` and `epoch` added to the sandbox objects in it.
async fn answered(
    ctl: &Ctl,
    rid: &str,
    row: &SandboxRow,
    node: &NodeRow,
    method: &Method,
    tail: &str,
    resp: Response,
) -> Response {
    let status = resp.status();
    let deleted = status.is_success() || status == StatusCode::NOT_FOUND;
    if tail.is_empty() && *method == Method::DELETE && deleted {
        if let Err(e) = ctl.db.delete_sandbox(&row.id).await {
            tracing::error!(request_id = %rid, sandbox = %row.id, error = %e, "a deleted sandbox's row stays");
        }
        if let Some(store) = &ctl.store {
            // Its sleeps in the object store go with it (a failure is logged: the objects stay,
            // the delete is done).
            if let Err(e) = store.delete_sandbox(&row.id).await {
                tracing::warn!(request_id = %rid, sandbox = %row.id, error = %e, "a deleted sandbox's objects stay in the store");
            }
        }
    }
    if !status.is_success() || !is_json(resp.headers()) {
        return resp;
    }
    let sandbox_answer = matches!(tail, "" | "restart" | "sleep" | "wake");
    let fork = tail == "fork" && *method == Method::POST;
    if !(sandbox_answer || fork) {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let bytes = match read_limited(body, MAX_ANSWER).await {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(request_id = %rid, node = %node.name, ?e, "an answer could not be read");
            return fail(
                rid,
                ApiError::new(
                    ErrorCode::Unavailable,
                    format!("the node {}'s answer broke off", node.name),
                ),
            );
        }
    };
    let Ok(mut v) = serde_json::from_slice::<Value>(&bytes) else {
        return HttpResponse::from_parts(parts, Body::from(bytes));
    };
    if fork {
        let mut made = Vec::new();
        if let Some(list) = v.get_mut("sandboxes").and_then(Value::as_array_mut) {
            for s in list.iter_mut() {
                let Some(id) = s.get("id").and_then(Value::as_str).map(String::from) else {
                    continue;
                };
                made.push(SandboxRow {
                    id,
                    name: s.get("name").and_then(Value::as_str).map(String::from),
                    node_id: node.id.clone(),
                    epoch: 1,
                    status: s
                        .get("status")
                        .and_then(Value::as_str)
                        .unwrap_or("starting")
                        .to_string(),
                    build: node.build.clone(),
                    created_at_ms: 0,
                    updated_at_ms: 0,
                });
                augment(s, node, Some(1));
            }
        }
        for r in made {
            match ctl.db.insert_sandbox(&r).await {
                Ok(()) | Err(DbError::IdTaken { .. }) => {}
                Err(e) => {
                    tracing::error!(request_id = %rid, sandbox = %r.id, error = %e, "a fork's row could not be written")
                }
            }
        }
        return json_answer(parts, &v);
    }
    if v.get("object").and_then(Value::as_str) == Some("sandbox") {
        if let Some(s) = v.get("status").and_then(Value::as_str) {
            if s != row.status && !(tail.is_empty() && *method == Method::DELETE) {
                if let Err(e) = ctl.db.update_sandbox(&row.id, Some(s), None).await {
                    tracing::warn!(request_id = %rid, error = %e, "a sandbox's status could not be written");
                }
            }
        }
        augment(&mut v, node, Some(row.epoch));
    }
    json_answer(parts, &v)
}

/// The query of a list, its pairs as sent (still escaped).
fn query_pairs(q: Option<&str>) -> Vec<(String, String)> {
    q.unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (k.to_string(), v.to_string())
        })
        .collect()
}

/// One node's page of a list.
struct Page {
    data: Vec<Value>,
    has_more: bool,
    next: Option<String>,
}

enum PageError {
    /// The node refused the query: its answer is the list's.
    Refused(Response),
    Away(ApiError),
}

async fn page_of(
    ctl: &Ctl,
    node: &NodeRow,
    params: &[(String, String)],
    limit: usize,
    pos: &Pos,
    headers: &HeaderMap,
) -> Result<Page, PageError> {
    let mut q: Vec<String> = params.iter().map(|(k, v)| format!("{k}={v}")).collect();
    q.push(format!("limit={limit}"));
    if let Pos::After(c) = pos {
        q.push(format!("cursor={c}"));
    }
    let path = format!("/v1/sandboxes?{}", q.join("&"));
    let mut req = Request::new(Body::empty());
    *req.uri_mut() = match path.parse() {
        Ok(u) => u,
        Err(_) => {
            return Err(PageError::Away(ApiError::invalid_field(
                "query",
                "the query is not one a URI can hold",
            )))
        }
    };
    *req.headers_mut() = headers.clone();
    let resp = proxy::forward(&ctl.client, &node.url, req)
        .await
        .map_err(|e| PageError::Away(node_away(node, &e)))?;
    if !resp.status().is_success() {
        return Err(PageError::Refused(resp));
    }
    let bytes = read_limited(resp.into_body(), MAX_ANSWER)
        .await
        .map_err(|_| {
            PageError::Away(ApiError::new(
                ErrorCode::Unavailable,
                format!("the node {}'s list broke off", node.name),
            ))
        })?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|_| {
        PageError::Away(ApiError::new(
            ErrorCode::Unavailable,
            format!("the node {}'s list is not JSON", node.name),
        ))
    })?;
    Ok(Page {
        data: v
            .get("data")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default(),
        has_more: v.get("has_more").and_then(Value::as_bool).unwrap_or(false),
        next: v
            .get("next_cursor")
            .and_then(Value::as_str)
            .map(String::from),
    })
}

/// `GET /v1/sandboxes`: every node's sandboxes (the lost nodes' are not there: `missing_nodes`
/// names those nodes), in creation order, `limit` of them (100 unless given); `next_cursor`
/// pages on across all nodes. The other query parameters (status, metadata.*) go to each node.
pub async fn list(State(ctl): St, Extension(Rid(rid)): RidExt, req: Request) -> Response {
    let headers = req.headers().clone();
    let mut params = query_pairs(req.uri().query());
    let mut limit = 100usize;
    let mut cursor = FleetCursor::default();
    let mut rest = Vec::new();
    for (k, v) in params.drain(..) {
        match k.as_str() {
            "limit" => match v.parse::<usize>() {
                Ok(n) if (1..=1000).contains(&n) => limit = n,
                _ => {
                    return fail(
                        &rid,
                        ApiError::invalid_field("limit", "limit must be from 1 to 1000"),
                    )
                }
            },
            "cursor" => match FleetCursor::decode(&v) {
                Some(c) => cursor = c,
                None => {
                    return fail(
                        &rid,
                        ApiError::invalid_field(
                            "cursor",
                            "cursor must be a next_cursor of an earlier page",
                        ),
                    )
                }
            },
            _ => rest.push((k, v)),
        }
    }
    let nodes = match ctl.db.nodes().await {
        Ok(n) => n,
        Err(e) => return db_failed(&rid, &e),
    };
    let (live, lost): (Vec<NodeRow>, Vec<NodeRow>) =
        nodes.into_iter().partition(|n| n.state != NodeState::Lost);
    let asks = live.iter().map(|n| {
        let pos = cursor.pos(&n.id).clone();
        let (rest, headers, ctl) = (&rest, &headers, &ctl);
        async move {
            if pos == Pos::Done {
                return Ok(Page {
                    data: Vec::new(),
                    has_more: false,
                    next: None,
                });
            }
            page_of(ctl, n, rest, limit, &pos, headers).await
        }
    });
    let mut pages = Vec::new();
    for r in join_all(asks).await {
        match r {
            Ok(p) => pages.push(p),
            Err(PageError::Refused(resp)) => return resp,
            Err(PageError::Away(e)) => return fail(&rid, e),
        }
    }
    let (taken, counts) = merge(pages.iter().map(|p| p.data.clone()).collect(), limit);
    let mut next = cursor.clone();
    for (i, n) in live.iter().enumerate() {
        let pos = cursor.pos(&n.id).clone();
        let p = &pages[i];
        let k = counts.get(i).copied().unwrap_or(0);
        let new = if pos == Pos::Done {
            Pos::Done
        } else if k == p.data.len() {
            match (&p.next, p.has_more) {
                (Some(c), true) => Pos::After(c.clone()),
                _ => Pos::Done,
            }
        } else if k == 0 {
            pos.clone()
        } else {
            // Where the node's list is after the first k of this page: its own cursor, asked of
            // it with the same query cut at k.
            match page_of(&ctl, n, &rest, k, &pos, &headers).await {
                Ok(Page {
                    next: Some(c),
                    has_more: true,
                    ..
                }) => Pos::After(c),
                Ok(_) => Pos::Done,
                Err(PageError::Refused(resp)) => return resp,
                Err(PageError::Away(e)) => return fail(&rid, e),
            }
        };
        next.0.insert(n.id.clone(), new);
    }
    // Epochs of the sandboxes the table has (one not made through the control plane has none).
    let mut epochs: HashMap<String, i64> = HashMap::new();
    for n in &live {
        match ctl.db.sandboxes(Some(&n.id)).await {
            Ok(rows) => epochs.extend(rows.into_iter().map(|r| (r.id, r.epoch))),
            Err(e) => return db_failed(&rid, &e),
        }
    }
    let data: Vec<Value> = taken
        .into_iter()
        .map(|(i, mut v)| {
            let epoch = v
                .get("id")
                .and_then(Value::as_str)
                .and_then(|id| epochs.get(id).copied());
            augment(&mut v, &live[i], epoch);
            v
        })
        .collect();
    let ids: Vec<String> = live.iter().map(|n| n.id.clone()).collect();
    let has_more = !next.all_done(&ids);
    let mut out = json!({
        "object": "list",
        "data": data,
        "has_more": has_more,
        "next_cursor": has_more.then(|| next.encode()),
    });
    if !lost.is_empty() {
        out["missing_nodes"] = json!(lost
            .iter()
            .map(|n| json!({ "id": n.id, "name": n.name, "state": n.state.as_str() }))
            .collect::<Vec<_>>());
    }
    axum::Json(out).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_are_read_leniently() {
        let h = Hints::of(br#"{"name":"web","image":"python:3.12","snapshot":"snap-1"}"#);
        assert_eq!(h.name.as_deref(), Some("web"));
        assert_eq!(h.image.as_deref(), Some("python:3.12"));
        assert_eq!(h.snapshot.as_deref(), Some("snap-1"));
        let h = Hints::of(b"not json");
        assert!(h.name.is_none() && h.image.is_none());
        let h = Hints::of(br#"{"name": 7, "image": ""}"#);
        assert!(h.name.is_none());
        assert_eq!(h.image.as_deref(), Some(""));
    }

    #[test]
    fn segments_decode_and_escape() {
        assert_eq!(decode_segment("sbx-abc"), "sbx-abc");
        assert_eq!(decode_segment("my%2Dbox"), "my-box");
        assert_eq!(decode_segment("bad%zz"), "bad%zz");
        assert_eq!(decode_segment("end%"), "end%");
        assert_eq!(escape_segment("snap-1"), "snap-1");
        assert_eq!(escape_segment("a/b c"), "a%2Fb%20c");
    }

    #[test]
    fn a_run_is_over_at_its_last_byte_or_its_ending_event() {
        let mut b = RunBody {
            inner: Body::empty(),
            hold: None,
            remaining: Some(10),
            sse: false,
            tail: b"\n".to_vec(),
        };
        assert!(!b.ends_with(b"12345"));
        assert!(b.ends_with(b"67890"));
        let mut s = RunBody {
            inner: Body::empty(),
            hold: None,
            remaining: None,
            sse: true,
            tail: b"\n".to_vec(),
        };
        assert!(!s.ends_with(b"event: start\nid: 0\ndata: {}\n\nevent: stdout\ndata: {\"data\":\"event: exit\\n\"}\n\n"));
        // The event's name cut by a chunk.
        assert!(!s.ends_with(b"event: ex"));
        assert!(s.ends_with(b"it\nid: 9\ndata: {}\n\n"));
        let mut first = RunBody {
            inner: Body::empty(),
            hold: None,
            remaining: None,
            sse: true,
            tail: b"\n".to_vec(),
        };
        assert!(first.ends_with(b"event: error\ndata: {}\n\n"));
    }

    #[test]
    fn queries_keep_their_pairs() {
        assert_eq!(
            query_pairs(Some("status=running&metadata.team=a%20b&limit=5")),
            vec![
                ("status".to_string(), "running".to_string()),
                ("metadata.team".to_string(), "a%20b".to_string()),
                ("limit".to_string(), "5".to_string())
            ]
        );
        assert!(query_pairs(None).is_empty());
    }
}
