//! The control plane's E2B listener (`sandboxd control --e2b-listen ADDR`): E2B's SDKs, given
//! `E2B_API_URL` and `E2B_SANDBOX_URL` of the control plane, drive the whole fleet, and go on
//! with a sandbox that moved. The control plane links no part of E2B's front end: it passes
//! each request to the E2B listener of a node (`e2b_url`, told by the node at each heartbeat).
//!
//! - A request that names a sandbox (`E2b-Sandbox-Id`: envd's RPCs and files, any port of the
//!   sandbox) goes to the node the table names for it, unchanged: envd's access token and the
//!   sandbox's traffic token are the node's to check. Streams pass both ways as they come.
//! - E2B's control plane: `POST /sandboxes` (and `/v2/sandboxes`) is placed as the fleet's
//!   `/v1` create (`place::choose` over the nodes that serve E2B; the row recorded from the
//!   answer's `sandboxID` at epoch 1); `GET /sandboxes` and `/v2/sandboxes` merge every node's
//!   list (in start order; `/v2`'s `limit` and `nextToken` page across nodes);
//!   `GET /sandboxes/metrics` merges the nodes' maps; `/sandboxes/{id}` and below (and `/v2`'s)
//!   go to the sandbox's node (a DELETE the node did, or that it answers 404, removes the row
//!   and the sandbox's objects in the store). The `domain` of a sandbox in an answer is the
//!   control plane's preview listener's (null when it has none), so that the SDK's
//!   `get_host(port)` goes through the control plane too. Anything else goes to a node that
//!   serves E2B: templates built through E2B's API are the first such node's. A create of a
//!   snapshot (`snap-…`) or of a built template (its name or `name:tag`) goes to the node that
//!   holds it, as does a snapshot's `DELETE /templates/{id}` (`template_holder`).
//!
//! Who may call: the node's rules, checked here: without `--api-keys` loopback callers that
//! name a loopback `Host` only; with keys, E2B's control plane wants one in `X-API-KEY` (or
//! `Authorization: Bearer`). A page's `Origin` other than the listener's own is refused.
//! Errors are E2B's body, `{code, message}`; a retryable 503 has `Retry-After: 1`.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use futures_util::future::join_all;
use sbx_api::{ApiError, ErrorCode};
use serde_json::{json, Map, Value};

use crate::auth;
use crate::db::{DbError, NodeRow, NodeState, SandboxRow};
use crate::relay::{self, Listener, Refused};
use crate::server::{read_limited, Ctl, ReadError};
use crate::{place, proxy};

/// The most bytes of a create's body (E2B's creates are small).
const MAX_CREATE_BODY: usize = 1 << 20;
/// The most bytes of a node's answer read to change it (a sandbox, a list).
const MAX_ANSWER: usize = 16 << 20;
/// The most sandboxes of a `/v2` page (the node's own most).
const MAX_PAGE: usize = 100;

/// What the listener's requests share.
pub struct E2bState {
    pub ctl: Arc<Ctl>,
    /// The `domain` a sandbox has in E2B's answers: the control plane's preview listener
    /// (`DOMAIN` or `DOMAIN:PORT`), or null.
    pub domain: Value,
}

/// The listener's router.
pub fn router(ctl: Arc<Ctl>, domain: Value) -> Router {
    Router::new()
        .fallback(handle)
        .with_state(Arc::new(E2bState { ctl, domain }))
}

/// Serves the E2B listener on `listener` until the task is aborted.
pub fn spawn(
    listener: tokio::net::TcpListener,
    ctl: Arc<Ctl>,
    domain: Value,
) -> tokio::task::JoinHandle<()> {
    let app = router(ctl, domain);
    tokio::spawn(sbx_listen::serve_streams(
        listener,
        "control plane's E2B listener",
        app,
        sbx_listen::MAX_STREAM_CONNECTIONS,
    ))
}

/// The `domain` of E2B's answers for a preview listener on `listen` with `domain`: the port
/// is left out when it is HTTP's own.
pub fn answer_domain(preview: Option<(&str, SocketAddr)>) -> Value {
    match preview {
        None => Value::Null,
        Some((d, a)) if a.port() == 80 => json!(d),
        Some((d, a)) => json!(format!("{d}:{}", a.port())),
    }
}

/// E2B's error body: `{code, message}`, the status as its code; `Retry-After: 1` on a 503.
pub fn e2b_error(status: StatusCode, message: impl Into<String>) -> Response {
    let mut r = (
        status,
        axum::Json(json!({ "code": status.as_u16(), "message": message.into() })),
    )
        .into_response();
    if status == StatusCode::SERVICE_UNAVAILABLE {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

/// The control plane's error as E2B's (its message names the spec's code).
fn api_error(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    e2b_error(status, format!("{} ({})", e.message, e.code.as_str()))
}

fn refused(r: Refused) -> Response {
    match r {
        Refused::Api(e) => api_error(&e),
        Refused::Db => db_failed_e2b(),
    }
}

fn db_failed_e2b() -> Response {
    e2b_error(
        StatusCode::SERVICE_UNAVAILABLE,
        "the control plane's database did not answer; its log has the reason",
    )
}

fn db_failed(rid: &str, e: &DbError) -> Response {
    tracing::error!(request_id = %rid, error = %e, "the control plane's database failed");
    db_failed_e2b()
}

/// What a request of E2B's control plane is.
#[derive(Debug, PartialEq, Eq)]
pub enum Route {
    Health,
    /// `POST /sandboxes`, `POST /v2/sandboxes`.
    Create,
    /// `GET /sandboxes` (every sandbox at once) or `GET /v2/sandboxes` (paged).
    List {
        v2: bool,
    },
    /// `GET /sandboxes/metrics`.
    Metrics,
    /// `/sandboxes/{id}` and below, `/v2/sandboxes/{id}/…`: `rest` is what follows the id.
    Sandbox {
        id: String,
        rest: String,
    },
    /// Anything else (templates, …): a node's to answer.
    Other,
}

/// The route of `method` `path`.
pub fn classify(method: &Method, path: &str) -> Route {
    let p = path.trim_end_matches('/');
    if p == "/health" {
        return Route::Health;
    }
    let (v2, rest) = match p.strip_prefix("/v2") {
        Some(r) => (true, r),
        None => (false, p),
    };
    if rest == "/sandboxes" {
        return match *method {
            Method::POST => Route::Create,
            Method::GET => Route::List { v2 },
            _ => Route::Other,
        };
    }
    let Some(after) = rest.strip_prefix("/sandboxes/") else {
        return Route::Other;
    };
    let (id, tail) = after.split_once('/').unwrap_or((after, ""));
    if id.is_empty() {
        return Route::Other;
    }
    if id == "metrics" && tail.is_empty() && !v2 {
        return if *method == Method::GET {
            Route::Metrics
        } else {
            Route::Other
        };
    }
    Route::Sandbox {
        id: crate::fleet::decode_segment(id),
        rest: tail.to_string(),
    }
}

/// Where a request comes from, as a node's E2B listener decides it: without keys a loopback
/// `Host` only; a page (`Origin`) only of the listener's own origin.
pub fn where_from(keys: bool, headers: &HeaderMap) -> Result<(), String> {
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::trim);
    if !keys && !host.is_some_and(auth::is_loopback_host) {
        return Err(format!(
            "this control plane has no API keys and serves requests to a loopback name or \
             address only, not to Host {:?}",
            host.unwrap_or("")
        ));
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin
            .to_str()
            .unwrap_or("")
            .trim()
            .trim_end_matches('/')
            .to_ascii_lowercase();
        let own = host.map(|h| format!("http://{}", h.to_ascii_lowercase()));
        if own.as_deref() != Some(origin.as_str()) {
            return Err(format!(
                "requests from pages of {origin:?} are refused by the control plane"
            ));
        }
    }
    Ok(())
}

/// Whether the caller may use E2B's control plane: one of the keys in `X-API-KEY` (or
/// `Authorization: Bearer`); without keys, a loopback caller.
pub fn caller_may(keys: Option<&HashSet<String>>, headers: &HeaderMap, peer: SocketAddr) -> bool {
    match keys {
        None => peer.ip().is_loopback(),
        Some(keys) => headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .or_else(|| auth::bearer(headers))
            .is_some_and(|k| auth::is_key(keys, k)),
    }
}

async fn handle(
    State(st): State<Arc<E2bState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    mut req: Request,
) -> Response {
    let rid = sbx_api::request_id_or_new(
        req.headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok()),
    );
    if let Ok(v) = HeaderValue::from_str(&rid) {
        req.headers_mut().insert("x-request-id", v);
    }
    if let Err(why) = where_from(st.ctl.keys.is_some(), req.headers()) {
        return e2b_error(StatusCode::FORBIDDEN, why);
    }
    // A standby control plane routes nothing (its table may be behind the active one's).
    if !st.ctl.db.writable() {
        return api_error(&crate::active::standby_error(st.ctl.role.active().as_ref()));
    }
    let sandbox = req
        .headers()
        .get("e2b-sandbox-id")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from);
    if let Some(id) = sandbox {
        // A sandbox's side (envd, a port): its node checks the sandbox's tokens and keys.
        return match relay::to_sandbox(&st.ctl, &rid, &id, Listener::E2b, req).await {
            Ok((_, _, resp)) => resp,
            Err(r) => refused(r),
        };
    }
    if !caller_may(st.ctl.keys.as_ref(), req.headers(), peer) {
        let msg = if st.ctl.keys.is_some() {
            "send one of the fleet's API keys in X-API-KEY (E2B_API_KEY)"
        } else {
            "this control plane takes calls from loopback only (start it with --api-keys to \
             open it)"
        };
        return e2b_error(StatusCode::UNAUTHORIZED, msg);
    }
    match classify(req.method(), req.uri().path()) {
        Route::Health => StatusCode::OK.into_response(),
        Route::Create => create(&st, &rid, req).await,
        Route::List { v2 } => list(&st, &rid, req, v2).await,
        Route::Metrics => metrics(&st, &rid, req).await,
        Route::Sandbox { id, rest } => sandbox_call(&st, &rid, &id, &rest, req).await,
        Route::Other => any_node(&st, &rid, req).await,
    }
}

/// The node of `nodes` that holds template `asked` of an E2B create: a snapshot
/// (`snap-…`, asked of each node's API) or a template built through E2B's API (its name, or
/// `name:tag`, asked of each node's E2B listener), with the control plane's key. `None` for
/// what every node serves (the base image, the code interpreter's, an image reference no node
/// built a template of), or when no node answers that it holds it.
async fn template_holder<'a>(ctl: &Ctl, nodes: &'a [NodeRow], asked: &str) -> Option<&'a NodeRow> {
    let asked = asked.trim();
    if matches!(asked, "" | "base") || asked == "code-interpreter-v1" {
        return None;
    }
    let live: Vec<&NodeRow> = nodes
        .iter()
        .filter(|n| n.state != NodeState::Lost)
        .collect();
    let snapshot = asked.starts_with("snap-");
    let name = asked.split(':').next().unwrap_or(asked);
    if !snapshot && (name.is_empty() || name.contains('/') || name.contains('.')) {
        // An image reference (a registry's host or a repository path): every node pulls it.
        return None;
    }
    let asks = live.iter().map(|n| {
        let (url, path) = if snapshot {
            (
                Some(n.url.clone()),
                format!("/v1/snapshots/{}", crate::fleet::escape_segment(asked)),
            )
        } else {
            (
                n.e2b_url.clone(),
                format!("/templates/aliases/{}", crate::fleet::escape_segment(name)),
            )
        };
        async move {
            let url = url?;
            crate::nodecall::call(
                &ctl.client,
                ctl.node_key.as_deref(),
                &url,
                Method::GET,
                &path,
                None,
                std::time::Duration::from_secs(5),
            )
            .await
            .ok()
            .filter(|a| a.ok())
        }
    });
    let answers = join_all(asks).await;
    live.into_iter()
        .zip(answers)
        .find(|(_, a)| a.is_some())
        .map(|(n, _)| n)
}

/// The nodes that serve E2B and are not lost.
async fn e2b_nodes(ctl: &Ctl) -> Result<Vec<NodeRow>, DbError> {
    Ok(ctl
        .db
        .nodes()
        .await?
        .into_iter()
        .filter(|n| n.e2b_url.is_some())
        .collect())
}

/// A sandbox object of E2B's answer with the control plane's preview domain.
fn with_domain(v: &mut Value, domain: &Value) {
    if let Some(o) = v.as_object_mut() {
        if o.contains_key("sandboxID") && o.contains_key("domain") {
            o.insert("domain".into(), domain.clone());
        }
    }
}

/// A node's JSON answer with `f` applied (a body that is not JSON, or too large, as it was).
async fn rewrite(resp: Response, f: impl FnOnce(&mut Value)) -> Response {
    let json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|c| c.starts_with("application/json"));
    if !json {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    let bytes = match read_limited(body, MAX_ANSWER).await {
        Ok(b) => b,
        Err(_) => {
            return e2b_error(
                StatusCode::BAD_GATEWAY,
                "the node's answer broke off or is too large",
            )
        }
    };
    let Ok(mut v) = serde_json::from_slice::<Value>(&bytes) else {
        return Response::from_parts(parts, Body::from(bytes));
    };
    f(&mut v);
    parts.headers.remove(header::CONTENT_LENGTH);
    let out = serde_json::to_vec(&v).unwrap_or_else(|_| bytes.to_vec());
    Response::from_parts(parts, Body::from(out))
}

/// `POST /sandboxes`: placed on a node that serves E2B, as the fleet's `/v1` create is.
async fn create(st: &E2bState, rid: &str, req: Request) -> Response {
    let ctl = &st.ctl;
    let (parts, body) = req.into_parts();
    let bytes = match read_limited(body, MAX_CREATE_BODY).await {
        Ok(b) => b,
        Err(ReadError::TooLarge) => {
            return e2b_error(StatusCode::BAD_REQUEST, "the body is over 1 MiB")
        }
        Err(ReadError::Broken(e)) => {
            return e2b_error(
                StatusCode::BAD_REQUEST,
                format!("the body could not be read: {e}"),
            )
        }
    };
    let nodes = match e2b_nodes(ctl).await {
        Ok(n) => n,
        Err(e) => return db_failed(rid, &e),
    };
    // A sandbox of a snapshot, or of a template built through E2B's API, goes to the node
    // that holds it (each node keeps its own).
    let asked = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| {
            v.get("templateID")
                .and_then(Value::as_str)
                .map(String::from)
        })
        .unwrap_or_default();
    let held = template_holder(ctl, &nodes, &asked).await;
    let chosen = match held {
        Some(n) => Ok(n),
        None => place::choose(&nodes, &ctl.extra_load(), None),
    };
    let node = match chosen {
        Ok(n) => n.clone(),
        Err(why) => {
            return api_error(&ApiError::new(
                ErrorCode::NoCapacity,
                format!("{why} (of the nodes that serve E2B: --e2b-listen)"),
            ))
        }
    };
    let Some(url) = node.e2b_url.clone() else {
        return api_error(&relay::not_served(&node, Listener::E2b, "new"));
    };
    ctl.placing(&node.id);
    let sent = proxy::forward(
        &ctl.client,
        &url,
        Request::from_parts(parts, Body::from(bytes)),
    )
    .await;
    let resp = match sent {
        Ok(r) => r,
        Err(e) => {
            ctl.placed(&node.id, false);
            tracing::warn!(request_id = %rid, node = %node.name, error = %e, "a node did not answer");
            return api_error(&crate::fleet::node_away(&node, &e));
        }
    };
    let made = resp.status().is_success();
    ctl.placed(&node.id, made);
    if !made {
        return resp;
    }
    let ctl = ctl.clone();
    let domain = st.domain.clone();
    let mut id = None;
    let resp = rewrite(resp, |v| {
        id = v.get("sandboxID").and_then(Value::as_str).map(String::from);
        with_domain(v, &domain);
    })
    .await;
    match id {
        Some(id) => {
            let row = SandboxRow {
                id: id.clone(),
                name: None,
                node_id: node.id.clone(),
                epoch: 1,
                status: "running".into(),
                build: node.build.clone(),
                created_at_ms: 0,
                updated_at_ms: 0,
            };
            match ctl.db.insert_sandbox(&row).await {
                Ok(()) | Err(DbError::IdTaken { .. }) => {}
                Err(e) => {
                    tracing::error!(request_id = %rid, sandbox = %id, error = %e, "a sandbox's row could not be written")
                }
            }
        }
        None => {
            tracing::warn!(request_id = %rid, node = %node.name, "an E2B create's answer names no sandboxID")
        }
    }
    resp
}

/// A GET of `path` on a node's E2B listener with the caller's headers; its JSON answer.
async fn ask_json(
    ctl: &Ctl,
    node: &NodeRow,
    path: &str,
    headers: &HeaderMap,
) -> Result<Value, Response> {
    let Some(url) = node.e2b_url.as_deref() else {
        return Err(api_error(&relay::not_served(
            &node.clone(),
            Listener::E2b,
            "any",
        )));
    };
    let mut req = Request::new(Body::empty());
    *req.uri_mut() = path.parse().map_err(|_| {
        e2b_error(
            StatusCode::BAD_REQUEST,
            "the query is not one a URI can hold",
        )
    })?;
    *req.headers_mut() = headers.clone();
    req.headers_mut().remove(header::CONTENT_LENGTH);
    req.headers_mut().remove(header::CONTENT_TYPE);
    let resp = proxy::forward(&ctl.client, url, req)
        .await
        .map_err(|e| api_error(&crate::fleet::node_away(node, &e)))?;
    if !resp.status().is_success() {
        return Err(resp);
    }
    let bytes = read_limited(resp.into_body(), MAX_ANSWER)
        .await
        .map_err(|_| {
            e2b_error(
                StatusCode::BAD_GATEWAY,
                format!("the node {}'s answer broke off", node.name),
            )
        })?;
    serde_json::from_slice(&bytes).map_err(|_| {
        e2b_error(
            StatusCode::BAD_GATEWAY,
            format!("the node {}'s answer is not JSON", node.name),
        )
    })
}

/// A query's raw `k=v` pairs (still escaped).
fn raw_pairs(q: Option<&str>) -> Vec<(String, String)> {
    q.unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (k.to_string(), v.to_string())
        })
        .collect()
}

/// A `/v2` page's place: after the sandbox started at `.0` with id `.1`.
pub fn encode_token(started: &str, id: &str) -> String {
    format!("{started}\n{id}")
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect()
}

pub fn decode_token(t: &str) -> Option<(String, String)> {
    if !t.len().is_multiple_of(2) || t.is_empty() {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..t.len())
        .step_by(2)
        .map(|i| t.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
        .collect();
    let s = String::from_utf8(bytes?).ok()?;
    let (a, b) = s.split_once('\n')?;
    Some((a.to_string(), b.to_string()))
}

/// The sort key of a listed sandbox: its start, then its id.
fn key_of(v: &Value) -> (String, String) {
    let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    (s("startedAt"), s("sandboxID"))
}

/// A `/v2` page of the merged list: the sandboxes after `after`, `limit` of them, and the
/// token of the next page when there are more.
pub fn page(
    mut all: Vec<Value>,
    after: Option<&(String, String)>,
    limit: usize,
) -> (Vec<Value>, Option<String>) {
    all.sort_by_key(key_of);
    let rest: Vec<Value> = all
        .into_iter()
        .filter(|v| after.is_none_or(|a| key_of(v) > *a))
        .collect();
    let more = rest.len() > limit;
    let data: Vec<Value> = rest.into_iter().take(limit).collect();
    let next = if more {
        data.last().map(|v| {
            let (s, i) = key_of(v);
            encode_token(&s, &i)
        })
    } else {
        None
    };
    (data, next)
}

/// `GET /sandboxes` and `/v2/sandboxes`: every node's sandboxes (those of lost nodes are
/// missing), in start order.
async fn list(st: &E2bState, rid: &str, req: Request, v2: bool) -> Response {
    let ctl = &st.ctl;
    let pairs = raw_pairs(req.uri().query());
    let mut limit = MAX_PAGE;
    let mut after = None;
    let mut states: Vec<String> = Vec::new();
    if v2 {
        for (k, v) in &pairs {
            match k.as_str() {
                "limit" => match v.parse::<usize>() {
                    Ok(n) if (1..=MAX_PAGE).contains(&n) => limit = n,
                    _ => {
                        return e2b_error(
                            StatusCode::BAD_REQUEST,
                            format!("limit must be 1 to {MAX_PAGE}"),
                        )
                    }
                },
                "nextToken" if !v.is_empty() => match decode_token(v) {
                    Some(t) => after = Some(t),
                    None => {
                        return e2b_error(
                            StatusCode::BAD_REQUEST,
                            "nextToken is not an X-Next-Token of this control plane",
                        )
                    }
                },
                "state" => states.extend(
                    v.replace("%2C", ",")
                        .split(',')
                        .map(|s| s.trim().to_string()),
                ),
                _ => {}
            }
        }
        if let Some(s) = states.iter().find(|s| *s != "running" && *s != "paused") {
            return e2b_error(
                StatusCode::BAD_REQUEST,
                format!("state {s:?} is not running or paused"),
            );
        }
    }
    // Each node's whole list (`/sandboxes` pages through it), with the caller's metadata
    // filter.
    let q: Vec<String> = pairs
        .iter()
        .filter(|(k, _)| k == "metadata")
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    let path = if q.is_empty() {
        "/sandboxes".to_string()
    } else {
        format!("/sandboxes?{}", q.join("&"))
    };
    let nodes = match e2b_nodes(ctl).await {
        Ok(n) => n,
        Err(e) => return db_failed(rid, &e),
    };
    let live: Vec<&NodeRow> = nodes
        .iter()
        .filter(|n| n.state != NodeState::Lost)
        .collect();
    let headers = req.headers().clone();
    let answers = join_all(live.iter().map(|n| ask_json(ctl, n, &path, &headers))).await;
    let mut all = Vec::new();
    for a in answers {
        match a {
            Ok(Value::Array(items)) => all.extend(items),
            Ok(_) => return e2b_error(StatusCode::BAD_GATEWAY, "a node's list is not an array"),
            Err(r) => return r,
        }
    }
    if !v2 {
        all.sort_by_key(key_of);
        return axum::Json(Value::Array(all)).into_response();
    }
    all.retain(|v| {
        states.is_empty()
            || v.get("state")
                .and_then(Value::as_str)
                .is_some_and(|s| states.iter().any(|w| w == s))
    });
    let (data, next) = page(all, after.as_ref(), limit);
    let mut r = axum::Json(Value::Array(data)).into_response();
    if let Some(Ok(v)) = next.map(|n| HeaderValue::from_str(&n)) {
        r.headers_mut().insert("x-next-token", v);
    }
    r
}

/// `GET /sandboxes/metrics?sandbox_ids=…`: every node's answer, merged.
async fn metrics(st: &E2bState, rid: &str, req: Request) -> Response {
    let ctl = &st.ctl;
    let path = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/sandboxes/metrics".into());
    let nodes = match e2b_nodes(ctl).await {
        Ok(n) => n,
        Err(e) => return db_failed(rid, &e),
    };
    let live: Vec<&NodeRow> = nodes
        .iter()
        .filter(|n| n.state != NodeState::Lost)
        .collect();
    let headers = req.headers().clone();
    let answers = join_all(live.iter().map(|n| ask_json(ctl, n, &path, &headers))).await;
    let mut out = Map::new();
    for a in answers {
        match a {
            Ok(v) => {
                if let Some(m) = v.get("sandboxes").and_then(Value::as_object) {
                    out.extend(m.clone());
                }
            }
            Err(r) => return r,
        }
    }
    axum::Json(json!({ "sandboxes": out })).into_response()
}

/// `/sandboxes/{id}` and below: to the sandbox's node; a DELETE it did removes the row.
async fn sandbox_call(st: &E2bState, rid: &str, id: &str, rest: &str, req: Request) -> Response {
    let ctl = &st.ctl;
    let delete = rest.is_empty() && *req.method() == Method::DELETE;
    let (row, _, resp) = match relay::to_sandbox(ctl, rid, id, Listener::E2b, req).await {
        Ok(r) => r,
        Err(r) => return refused(r),
    };
    let status = resp.status();
    if delete && (status.is_success() || status == StatusCode::NOT_FOUND) {
        if let Err(e) = ctl.db.delete_sandbox(&row.id).await {
            tracing::error!(request_id = %rid, sandbox = %row.id, error = %e, "a deleted sandbox's row stays");
        }
        if let Some(store) = &ctl.store {
            if let Err(e) = store.delete_sandbox(&row.id).await {
                tracing::warn!(request_id = %rid, sandbox = %row.id, error = %e, "a deleted sandbox's objects stay in the store");
            }
        }
    }
    if !status.is_success() || !matches!(rest, "" | "connect" | "resume") {
        return resp;
    }
    let domain = st.domain.clone();
    rewrite(resp, |v| with_domain(v, &domain)).await
}

/// A route of E2B's that names no sandbox (templates, …): any node that serves E2B answers.
async fn any_node(st: &E2bState, rid: &str, req: Request) -> Response {
    let nodes = match e2b_nodes(&st.ctl).await {
        Ok(n) => n,
        Err(e) => return db_failed(rid, &e),
    };
    // A snapshot's (E2B's `DELETE /templates/{snapshotID}`): its node's.
    let snapshot = req
        .uri()
        .path()
        .strip_prefix("/templates/")
        .filter(|id| id.starts_with("snap-") && !id.contains('/'))
        .map(String::from);
    let held = match snapshot {
        Some(id) => template_holder(&st.ctl, &nodes, &id).await,
        None => None,
    };
    let Some(node) = held.or_else(|| nodes.iter().find(|n| n.state != NodeState::Lost)) else {
        return e2b_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "no node that serves E2B (--e2b-listen) is in the fleet",
        );
    };
    let Some(url) = node.e2b_url.as_deref() else {
        return api_error(&relay::not_served(node, Listener::E2b, "any"));
    };
    match proxy::forward(&st.ctl.client, url, req).await {
        Ok(r) => r,
        Err(e) => api_error(&crate::fleet::node_away(node, &e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_of_e2b_s_control_plane() {
        let post = Method::POST;
        let get = Method::GET;
        assert_eq!(classify(&get, "/health"), Route::Health);
        assert_eq!(classify(&post, "/sandboxes"), Route::Create);
        assert_eq!(classify(&post, "/v2/sandboxes"), Route::Create);
        assert_eq!(classify(&get, "/sandboxes"), Route::List { v2: false });
        assert_eq!(classify(&get, "/v2/sandboxes/"), Route::List { v2: true });
        assert_eq!(classify(&get, "/sandboxes/metrics"), Route::Metrics);
        assert_eq!(
            classify(&Method::DELETE, "/sandboxes/sbx-1"),
            Route::Sandbox {
                id: "sbx-1".into(),
                rest: String::new()
            }
        );
        assert_eq!(
            classify(&post, "/v2/sandboxes/sbx-1/connect"),
            Route::Sandbox {
                id: "sbx-1".into(),
                rest: "connect".into()
            }
        );
        assert_eq!(
            classify(&get, "/sandboxes/sbx-1/metrics"),
            Route::Sandbox {
                id: "sbx-1".into(),
                rest: "metrics".into()
            }
        );
        assert_eq!(classify(&get, "/templates"), Route::Other);
        assert_eq!(classify(&Method::PUT, "/sandboxes"), Route::Other);
        assert_eq!(classify(&get, "/sandboxes/"), Route::List { v2: false });
    }

    fn h(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut m = HeaderMap::new();
        for (k, v) in pairs {
            m.insert(*k, HeaderValue::from_str(v).expect("a header value"));
        }
        m
    }

    #[test]
    fn who_may_call() {
        let lo: SocketAddr = "127.0.0.1:5000".parse().expect("addr");
        let far: SocketAddr = "10.0.0.9:5000".parse().expect("addr");
        // Without keys: loopback Host and callers only; a page only of the listener's own.
        assert!(where_from(false, &h(&[("host", "127.0.0.1:7790")])).is_ok());
        assert!(where_from(false, &h(&[("host", "evil.example")])).is_err());
        assert!(where_from(true, &h(&[("host", "ctl.example")])).is_ok());
        assert!(where_from(
            true,
            &h(&[("host", "ctl.example"), ("origin", "http://evil.example")])
        )
        .is_err());
        assert!(where_from(
            true,
            &h(&[("host", "ctl.example"), ("origin", "http://ctl.example/")])
        )
        .is_ok());
        assert!(caller_may(None, &HeaderMap::new(), lo));
        assert!(!caller_may(None, &HeaderMap::new(), far));
        let keys: HashSet<String> = ["e2b_k".to_string()].into();
        assert!(caller_may(Some(&keys), &h(&[("x-api-key", "e2b_k")]), far));
        assert!(caller_may(
            Some(&keys),
            &h(&[("authorization", "Bearer e2b_k")]),
            far
        ));
        assert!(!caller_may(Some(&keys), &h(&[("x-api-key", "e2b_x")]), lo));
        assert!(!caller_may(Some(&keys), &HeaderMap::new(), lo));
    }

    #[test]
    fn pages_of_the_merged_list() {
        let sb = |t: &str, id: &str| json!({"sandboxID": id, "startedAt": t});
        let all = vec![
            sb("2026-01-01T00:00:03Z", "sbx-c"),
            sb("2026-01-01T00:00:01Z", "sbx-a"),
            sb("2026-01-01T00:00:02Z", "sbx-b"),
            sb("2026-01-01T00:00:02Z", "sbx-a2"),
        ];
        let (first, next) = page(all.clone(), None, 2);
        let ids = |v: &[Value]| -> Vec<String> { v.iter().map(|s| key_of(s).1).collect() };
        assert_eq!(ids(&first), ["sbx-a", "sbx-a2"]);
        let token = next.expect("a next token");
        let after = decode_token(&token).expect("a token decodes");
        let (second, last) = page(all.clone(), Some(&after), 2);
        assert_eq!(ids(&second), ["sbx-b", "sbx-c"]);
        assert_eq!(last, None);
        let (whole, none) = page(all, None, 100);
        assert_eq!(whole.len(), 4);
        assert_eq!(none, None);
        assert_eq!(decode_token("zz"), None);
        assert_eq!(decode_token("abc"), None);
        assert_eq!(decode_token(""), None);
    }

    #[test]
    fn a_sandbox_s_domain_is_the_control_plane_s() {
        let mut v = json!({"sandboxID": "sbx-1", "domain": "localhost:7781"});
        with_domain(&mut v, &json!("localhost:7790"));
        assert_eq!(v["domain"], "localhost:7790");
        let mut other = json!({"code": 404});
        with_domain(&mut other, &json!("x"));
        assert!(other.get("domain").is_none());
        let a: SocketAddr = "127.0.0.1:7790".parse().expect("addr");
        assert_eq!(
            answer_domain(Some(("localhost", a))),
            json!("localhost:7790")
        );
        let a80: SocketAddr = "0.0.0.0:80".parse().expect("addr");
        assert_eq!(answer_domain(Some(("p.example", a80))), json!("p.example"));
        assert_eq!(answer_domain(None), Value::Null);
    }
}
