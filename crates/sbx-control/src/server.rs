//! The control plane's HTTP server: its state, its one table of routes, what every request goes
//! through (its request id, who may make it), the error body, and the nodes' routes
//! (`/internal/nodes…`: join, heartbeat, list, drain).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Path, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Extension, Json, Router};
use http_body_util::BodyExt as _;
use sbx_api::{ApiError, ErrorCode};
use serde_json::{json, Value};

use crate::db::{Db, DbError, NodeReg, NodeRow};
use crate::proxy::NodeClient;
use crate::{auth, fleet};

/// The request's id (its valid `X-Request-Id`, or one made for it): in its answer, its error
/// bodies, the log, and the requests it makes of nodes.
#[derive(Clone, Debug)]
pub struct Rid(pub String);

/// The control plane's state, shared by every request.
pub struct Ctl {
    pub db: Db,
    pub client: NodeClient,
    /// A node's lease: it is `lost` this long after its last heartbeat.
    pub lease: Duration,
    pub keys: Option<HashSet<String>>,
    /// Names being given now (a create or a run forwarded, its row not written yet): a second
    /// call with one is refused here before the table is asked.
    pub names: Mutex<HashSet<String>>,
    /// Name reservations of runs that are over, whose rows are being deleted: a call that meets
    /// one in the table deletes it and goes on.
    pub released: Mutex<HashSet<String>>,
    /// Sandboxes placed on each node that its last heartbeat did not count: creates and runs
    /// under way, and those it made since.
    pub pending: Mutex<HashMap<String, Pending>>,
    /// The node each Idempotency-Key's first create or run went to (a retry goes there too).
    pub idem: Mutex<HashMap<String, (String, Instant)>>,
    /// The key the control plane's own calls to nodes carry (a move's release, takeover,
    /// forget): one of its keys (the fleet shares one file); none without keys.
    pub node_key: Option<String>,
    /// The object store of the nodes' sleeps (a deleted sandbox's objects are removed).
    pub store: Option<sbx_blob::Store>,
    /// The move machine's handle (`machine::start` runs it).
    pub machine: crate::machine::Machine,
    /// This copy's name and the active copy as last read (`active`: the lease of the control
    /// plane).
    pub role: crate::active::Role,
    /// The batches' runner's handle (evacuations and recoveries: `batch::start` runs it).
    pub batches: crate::batch::Batches,
}

/// Locks `m`, whatever a panicking holder left (the maps stay usable).
pub fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// How long an Idempotency-Key's node is remembered (the nodes keep their records a day).
const IDEM_KEEP: Duration = Duration::from_secs(24 * 3600);

impl Ctl {
    pub fn new(db: Db, lease: Duration, keys: Option<HashSet<String>>) -> Ctl {
        let node_key = keys.as_ref().and_then(|k| k.iter().min().cloned());
        Ctl {
            node_key,
            store: None,
            machine: crate::machine::Machine::default(),
            role: crate::active::Role::default(),
            batches: crate::batch::Batches::default(),
            db,
            client: crate::proxy::client(),
            lease,
            keys,
            names: Mutex::new(HashSet::new()),
            released: Mutex::new(HashSet::new()),
            pending: Mutex::new(HashMap::new()),
            idem: Mutex::new(HashMap::new()),
        }
    }

    /// The same, deleting a sandbox's objects from `store` when it is deleted.
    #[must_use]
    pub fn with_store(mut self, store: sbx_blob::Store) -> Ctl {
        self.store = Some(store);
        self
    }

    /// The same, taking part in the control plane's lease as `role` names it.
    #[must_use]
    pub fn with_role(mut self, role: crate::active::Role) -> Ctl {
        self.role = role;
        self
    }

    pub fn lease_ms(&self) -> i64 {
        i64::try_from(self.lease.as_millis()).unwrap_or(i64::MAX)
    }

    /// The node a key's first call went to.
    pub fn idem_node(&self, scope: &str) -> Option<String> {
        locked(&self.idem)
            .get(scope)
            .filter(|(_, at)| at.elapsed() < IDEM_KEEP)
            .map(|(n, _)| n.clone())
    }

    pub fn remember_idem(&self, scope: String, node_id: &str) {
        let mut m = locked(&self.idem);
        if m.len() >= 4096 {
            m.retain(|_, (_, at)| at.elapsed() < IDEM_KEEP);
        }
        m.entry(scope)
            .or_insert_with(|| (node_id.to_string(), Instant::now()));
    }

    /// A create or a run goes to `node_id`.
    pub fn placing(&self, node_id: &str) {
        let mut p = locked(&self.pending);
        let e = p.entry(node_id.to_string()).or_default();
        e.under_way = e.under_way.saturating_add(1);
    }

    /// A create or a run `placing` counted is answered: `made` when the node made a sandbox.
    pub fn placed(&self, node_id: &str, made: bool) {
        let mut p = locked(&self.pending);
        let e = p.entry(node_id.to_string()).or_default();
        e.under_way = e.under_way.saturating_sub(1);
        if made {
            e.since_heartbeat = e.since_heartbeat.saturating_add(1);
        }
    }

    /// A heartbeat counted what the node holds now.
    pub fn counted(&self, node_id: &str) {
        if let Some(e) = locked(&self.pending).get_mut(node_id) {
            e.since_heartbeat = 0;
        }
    }

    /// What each node holds beyond its last heartbeat's count.
    pub fn extra_load(&self) -> HashMap<String, u64> {
        locked(&self.pending)
            .iter()
            .map(|(k, v)| (k.clone(), v.under_way.saturating_add(v.since_heartbeat)))
            .collect()
    }
}

/// Sandboxes of a node its last heartbeat did not count.
#[derive(Debug, Default, Clone, Copy)]
pub struct Pending {
    /// Creates and runs sent to it and not answered yet.
    pub under_way: u64,
    /// Sandboxes it made since its last heartbeat.
    pub since_heartbeat: u64,
}

/// The router of the control plane.
pub fn router(ctl: Arc<Ctl>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/internal/nodes", get(list_nodes).post(register))
        .route("/internal/nodes/{id}", get(get_node))
        .route("/internal/nodes/{id}/heartbeat", post(heartbeat))
        .route("/internal/nodes/{id}/drain", post(drain))
        .route("/internal/nodes/{id}/recover", post(crate::batch::recover))
        .route(
            "/internal/nodes/{id}/evacuate",
            post(crate::batch::evacuate),
        )
        .route("/internal/batches", get(crate::batch::list))
        .route("/internal/batches/{id}", get(crate::batch::get))
        .route(
            "/internal/moves",
            post(crate::moves::create).get(crate::moves::list),
        )
        .route("/internal/moves/{id}", get(crate::moves::get))
        .route("/internal/moves/{id}/cancel", post(crate::moves::cancel))
        .route("/v1/run", post(fleet::run))
        .route("/v1/sandboxes", post(fleet::create).get(fleet::list))
        .route("/v1/sandboxes/{id}", any(fleet::sandbox_call))
        .route("/v1/sandboxes/{id}/{*rest}", any(fleet::sandbox_call))
        .fallback(fallback)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            ctl.clone(),
            crate::active::gate,
        ))
        .layer(middleware::from_fn_with_state(ctl.clone(), edge))
        .with_state(ctl)
}

/// Every request: its id (also sent on to nodes, so their answers and logs carry it), and who
/// may make it (every route but `/healthz`).
async fn edge(
    State(ctl): State<Arc<Ctl>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    mut req: Request,
    next: Next,
) -> Response {
    let rid = sbx_api::request_id_or_new(
        req.headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok()),
    );
    req.extensions_mut().insert(Rid(rid.clone()));
    if let Ok(v) = HeaderValue::from_str(&rid) {
        req.headers_mut().insert("x-request-id", v);
    }
    let mut resp = if req.uri().path() == "/healthz" {
        next.run(req).await
    } else {
        match auth::check(ctl.keys.as_ref(), peer, req.uri().path(), req.headers()) {
            Ok(()) => next.run(req).await,
            Err(e) => fail(&rid, e),
        }
    };
    if let Ok(v) = HeaderValue::from_str(&rid) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

/// An error answer: the spec's body, its status; `Retry-After: 1` on a retryable 503.
pub fn fail(rid: &str, e: ApiError) -> Response {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut resp = (status, Json(sbx_api::error_body(&e, rid, None))).into_response();
    if status == StatusCode::SERVICE_UNAVAILABLE && e.retryable() {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    resp
}

/// The control plane's database failed: 503 unavailable (retryable), the reason in the log.
pub fn db_failed(rid: &str, e: &DbError) -> Response {
    if let DbError::Deposed { active } = e {
        return fail(rid, crate::active::standby_error(active.as_ref()));
    }
    tracing::error!(request_id = %rid, error = %e, "the control plane's database failed");
    fail(
        rid,
        ApiError::new(
            ErrorCode::Unavailable,
            "the control plane's database did not answer; its log has the reason",
        ),
    )
}

/// Why a body could not be read.
#[derive(Debug)]
pub enum ReadError {
    TooLarge,
    Broken(String),
}

/// A body read whole, up to `max` bytes.
pub async fn read_limited(body: Body, max: usize) -> Result<Bytes, ReadError> {
    match http_body_util::Limited::new(body, max).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e)
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(ReadError::TooLarge)
        }
        Err(e) => Err(ReadError::Broken(e.to_string())),
    }
}

/// A time of the database's clock (ms since the epoch) in RFC 3339.
pub fn rfc3339(ms: i64) -> String {
    sbx_api::exec::format_rfc3339_millis(i128::from(ms) * 1_000_000)
}

/// A node as `GET /internal/nodes` shows it.
pub fn node_json(n: &NodeRow) -> Value {
    json!({
        "object": "node",
        "id": n.id,
        "name": n.name,
        "url": n.url,
        "state": n.state.as_str(),
        "lease_until": rfc3339(n.lease_until_ms),
        "build": n.build,
        "capacity": n.capacity,
        "registered_at": rfc3339(n.registered_at_ms),
        "heartbeat_at": rfc3339(n.heartbeat_at_ms),
        "e2b_url": n.e2b_url,
        "preview_url": n.preview_url,
    })
}

async fn healthz(State(ctl): State<Arc<Ctl>>, Extension(Rid(rid)): Extension<Rid>) -> Response {
    match ctl.db.now_ms().await {
        Ok(_) => Json(json!({
            "ok": true,
            "db": ctl.db.kind(),
            "role": "active",
            "name": ctl.role.name(),
            "term": ctl.db.term(),
        }))
        .into_response(),
        Err(e) => db_failed(&rid, &e),
    }
}

async fn list_nodes(State(ctl): State<Arc<Ctl>>, Extension(Rid(rid)): Extension<Rid>) -> Response {
    match ctl.db.nodes().await {
        Ok(nodes) => Json(json!({
            "object": "list",
            "data": nodes.iter().map(node_json).collect::<Vec<_>>(),
        }))
        .into_response(),
        Err(e) => db_failed(&rid, &e),
    }
}

async fn get_node(
    State(ctl): State<Arc<Ctl>>,
    Extension(Rid(rid)): Extension<Rid>,
    Path(id): Path<String>,
) -> Response {
    match ctl.db.node(&id).await {
        Ok(Some(n)) => Json(node_json(&n)).into_response(),
        Ok(None) => fail(&rid, no_node(&id)),
        Err(e) => db_failed(&rid, &e),
    }
}

pub fn no_node(id: &str) -> ApiError {
    ApiError::new(
        ErrorCode::NotFound,
        format!(
            "no node {id} in the control plane's table (a node joins with POST /internal/nodes)"
        ),
    )
}

/// The most bytes of a node's registration or heartbeat.
const MAX_REG_BODY: usize = 1 << 20;

/// A registration's or heartbeat's body, checked.
async fn read_reg(body: Body) -> Result<NodeReg, ApiError> {
    let bytes = match read_limited(body, MAX_REG_BODY).await {
        Ok(b) => b,
        Err(ReadError::TooLarge) => {
            return Err(ApiError::new(
                ErrorCode::BodyTooLarge,
                "a node's registration is at most 1 MiB",
            ))
        }
        Err(ReadError::Broken(e)) => {
            return Err(ApiError::new(
                ErrorCode::InvalidJson,
                format!("the body could not be read: {e}"),
            ))
        }
    };
    let reg: NodeReg = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::new(
            ErrorCode::InvalidJson,
            format!("the body is not a node's registration {{name, url, build, capacity}}: {e}"),
        )
    })?;
    check_reg(&reg)?;
    Ok(reg)
}

/// A node's name: 1 to 64 letters, digits, `.`, `_` and `-`.
pub fn valid_node_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
}

/// Whether `u` is `http://HOST:PORT` (a base URL with no path).
pub fn is_http_base(u: &str) -> bool {
    u.strip_prefix("http://")
        .map(|rest| rest.trim_end_matches('/'))
        .is_some_and(|auth| {
            !auth.is_empty()
                && !auth.contains('/')
                && auth.parse::<axum::http::uri::Authority>().is_ok()
        })
}

fn check_reg(reg: &NodeReg) -> Result<(), ApiError> {
    if !valid_node_name(&reg.name) {
        return Err(ApiError::invalid_field(
            "name",
            "a node's name is 1 to 64 letters, digits, '.', '_' and '-'",
        ));
    }
    let url_ok = reg
        .url
        .strip_prefix("http://")
        .map(|rest| rest.trim_end_matches('/'))
        .is_some_and(|auth| {
            !auth.is_empty()
                && !auth.contains('/')
                && auth.parse::<axum::http::uri::Authority>().is_ok()
        });
    if !url_ok {
        return Err(ApiError::invalid_field(
            "url",
            "url must be where the control plane reaches the node: http://HOST:PORT",
        ));
    }
    for (field, u) in [("e2b_url", &reg.e2b_url), ("preview_url", &reg.preview_url)] {
        if u.as_deref().is_some_and(|u| !is_http_base(u)) {
            return Err(ApiError::invalid_field(
                field,
                format!("{field} must be http://HOST:PORT of the node's listener, or null"),
            ));
        }
    }
    if reg.build.is_empty() || reg.build.len() > 64 {
        return Err(ApiError::invalid_field(
            "build",
            "build must be 1 to 64 characters",
        ));
    }
    Ok(())
}

/// A registration's or heartbeat's answer: the node's id and its lease.
/// `taken`: the sandboxes of its `held` the fleet has elsewhere (`held.rs`); the answer is
/// 503 where they cannot be read (the node must not unfence what may be taken).
async fn lease_answer(ctl: &Ctl, rid: &str, n: &NodeRow, reg: &NodeReg) -> Response {
    let taken = match crate::held::taken(&ctl.db, &n.id, &reg.held).await {
        Ok(t) => t,
        Err(e) => return db_failed(rid, &e),
    };
    for t in &taken {
        tracing::warn!(node = %n.name, sandbox = %t.id, epoch = t.epoch, to = ?t.to, "a node holds a sandbox the fleet has elsewhere: taken");
    }
    Json(json!({
        "object": "node_lease",
        "id": n.id,
        "name": n.name,
        "lease_until": rfc3339(n.lease_until_ms),
        "lease_seconds": ctl.lease.as_secs_f64(),
        "taken": taken,
    }))
    .into_response()
}

/// `POST /internal/nodes`: a node joins (or joins again: the same name keeps its id).
async fn register(
    State(ctl): State<Arc<Ctl>>,
    Extension(Rid(rid)): Extension<Rid>,
    req: Request,
) -> Response {
    let reg = match read_reg(req.into_body()).await {
        Ok(r) => r,
        Err(e) => return fail(&rid, e),
    };
    match ctl.db.register_node(&reg, ctl.lease_ms()).await {
        Ok(n) => {
            ctl.counted(&n.id);
            tracing::info!(node = %n.name, id = %n.id, url = %n.url, build = %n.build, "a node joined");
            lease_answer(&ctl, &rid, &n, &reg).await
        }
        Err(e) => db_failed(&rid, &e),
    }
}

/// `POST /internal/nodes/{id}/heartbeat`: the node's lease runs on; its room as it is now.
async fn heartbeat(
    State(ctl): State<Arc<Ctl>>,
    Extension(Rid(rid)): Extension<Rid>,
    Path(id): Path<String>,
    req: Request,
) -> Response {
    let reg = match read_reg(req.into_body()).await {
        Ok(r) => r,
        Err(e) => return fail(&rid, e),
    };
    match ctl.db.heartbeat(&id, &reg, ctl.lease_ms()).await {
        Ok(n) => {
            ctl.counted(&n.id);
            lease_answer(&ctl, &rid, &n, &reg).await
        }
        Err(DbError::NotFound) => fail(&rid, no_node(&id)),
        Err(e) => db_failed(&rid, &e),
    }
}

/// `POST /internal/nodes/{id}/drain` (`{"draining": false}` to take it back): a draining node
/// takes no new sandboxes; its own are served as before.
async fn drain(
    State(ctl): State<Arc<Ctl>>,
    Extension(Rid(rid)): Extension<Rid>,
    Path(id): Path<String>,
    req: Request,
) -> Response {
    let bytes = match read_limited(req.into_body(), MAX_REG_BODY).await {
        Ok(b) => b,
        Err(_) => {
            return fail(
                &rid,
                ApiError::new(ErrorCode::InvalidJson, "the body could not be read"),
            )
        }
    };
    let draining = if bytes.iter().all(u8::is_ascii_whitespace) {
        true
    } else {
        match serde_json::from_slice::<Value>(&bytes) {
            Ok(Value::Object(o)) => match o.get("draining") {
                None => true,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return fail(
                        &rid,
                        ApiError::invalid_field("draining", "draining must be true or false"),
                    )
                }
            },
            _ => {
                return fail(
                    &rid,
                    ApiError::new(ErrorCode::InvalidJson, "the body is not a JSON object"),
                )
            }
        }
    };
    let node = match ctl.db.node(&id).await {
        Ok(Some(n)) => n,
        Ok(None) => return fail(&rid, no_node(&id)),
        Err(e) => return db_failed(&rid, &e),
    };
    if let Err(e) = ctl.db.set_draining(&node.id, draining).await {
        return db_failed(&rid, &e);
    }
    match ctl.db.node(&node.id).await {
        Ok(Some(n)) => Json(node_json(&n)).into_response(),
        Ok(None) => fail(&rid, no_node(&id)),
        Err(e) => db_failed(&rid, &e),
    }
}

/// A route the control plane does not have. Under `/v1/`: a route of a node's that the fleet
/// does not serve (images, snapshots, volumes, secrets, templates are each node's own), 503
/// not_served_here naming it; elsewhere 404.
async fn fallback(Extension(Rid(rid)): Extension<Rid>, req: Request) -> Response {
    let path = req.uri().path();
    if path.starts_with("/v1/") {
        return fail(
            &rid,
            ApiError::new(
                ErrorCode::NotServedHere,
                format!(
                    "the control plane does not serve {} {path}: only sandboxes (/v1/run, \
                     /v1/sandboxes and every route of a sandbox) are the fleet's; images, \
                     snapshots, volumes, secrets and templates are each node's own (GET \
                     /internal/nodes lists the nodes' URLs)",
                    req.method()
                ),
            ),
        );
    }
    fail(&rid, ApiError::new(ErrorCode::NotFound, "no such route"))
}

async fn method_not_allowed(Extension(Rid(rid)): Extension<Rid>) -> Response {
    fail(
        &rid,
        ApiError::new(
            ErrorCode::MethodNotAllowed,
            "this route does not take that method",
        ),
    )
}
