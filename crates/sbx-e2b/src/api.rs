//! E2B's control plane over the node's core: sandboxes made (`POST /v2/sandboxes`, the older
//! `POST /sandboxes`), connected to, listed (`GET /v2/sandboxes` with its metadata, state,
//! template and `startedAfter` filters, `order` by start and `X-Next-Token` paging, the older
//! `GET /sandboxes`), found, timed (`…/timeout`, `…/refreshes`), measured (`…/metrics`),
//! paused (the node's sleep, held asleep: connect resumes it; a filesystem-only pause is the
//! node's restart then its sleep, and a resume of one the node's restart) and killed, with
//! E2B's field names, statuses and error body `{code, message}`. Snapshots (`snapshots.rs`), forks
//! (`fork.rs`), metrics over time (`metrics.rs`) and network updates (`network.rs`) are the
//! node's snapshots, forks, cgroups and egress rules. What the node does not do (volumes,
//! IAM) is refused with a message that says so. Templates built through E2B's API
//! (`templates.rs`) are snapshots of a build's sandbox.

// A refusal here is the answer itself (E2B's error body), made once per request: returned
// as it is rather than boxed.
#![allow(clippy::result_large_err)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post, put};
use axum::{Json, Router};
use sbx_api::{ApiError, SandboxObject, SandboxStatus};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::{e2b_error, interp, ENVD_PORT, ENVD_VERSION};
use crate::node::sandbox::ListQuery;
use crate::node::Node;

/// The `clientID` of every sandbox (E2B's cluster client; one node here).
const CLIENT_ID: &str = "sbx";
/// E2B's default timeout of a sandbox, in seconds, when a create gives none.
const DEFAULT_TIMEOUT_S: u64 = 15;
/// The least timeout an auto-resumed sandbox is given (E2B's: its create's, at least this).
const AUTO_RESUME_MIN_S: u64 = 300;
/// The longest timeout a call may set (E2B's Pro plan's: 24 hours).
const MAX_TIMEOUT_S: u64 = 24 * 3600;
/// How long a create waits for its sandbox to run (a pull, a ready check).
const CREATE_WAIT: Duration = Duration::from_secs(300);
/// The most sandboxes a list page holds, and its default.
const MAX_PAGE: usize = 100;

type St = State<Arc<Node>>;

mod fork;
mod metrics;
mod network;
mod snapshots;
mod templates;

pub use templates::Builds;
pub(crate) use templates::Defaults as TemplateDefaults;

pub fn router(node: Arc<Node>) -> Router {
    // An auto-resumed sandbox (woken by a request) times out again: E2B's timeout after an
    // auto-resume, its create's timeout but at least 5 minutes, from the wake.
    node.set_wake_hook(Box::new(|node, id| {
        let Ok(o) = node.sandbox(id) else { return };
        let secs = o
            .metadata
            .get(RESUME_TIMEOUT_KEY)
            .and_then(|v| v.parse::<u64>().ok());
        if let (None, Some(secs)) = (&o.expires_at, secs) {
            let secs = secs.max(AUTO_RESUME_MIN_S);
            if set_end(node, &o, secs, false).is_err() {
                tracing::warn!(sandbox = %id, "an auto-resumed sandbox's end not set again");
            }
        }
    }));
    let (metrics_one, metrics_many) = metrics::routes(&node);
    Router::new()
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/sandboxes", post(create).get(list_v1))
        .route("/v2/sandboxes", post(create).get(list_v2))
        .route("/sandboxes/{id}", get(get_one).delete(kill))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/refreshes", post(refresh))
        .route("/sandboxes/{id}/metrics", metrics_one)
        .route("/sandboxes/metrics", metrics_many)
        .route("/sandboxes/{id}/network", put(network::update))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/resume", post(resume))
        .route("/sandboxes/{id}/snapshots", post(snapshots::create))
        .route("/snapshots", get(snapshots::list))
        .route("/sandboxes/{id}/fork", post(fork::fork))
        .route("/sandboxes/{id}/logs", get(not_yet_logs))
        .route("/v2/sandboxes/{id}/logs", get(not_yet_logs))
        .route("/templates", any(not_yet_templates))
        .route("/templates/{*rest}", any(templates::dispatch))
        .route("/v2/templates", any(not_yet_templates))
        .route("/v2/templates/{*rest}", any(templates::v2))
        .route(
            "/v3/templates",
            post(templates::request_build).fallback(not_yet_templates),
        )
        .route("/v3/templates/{*rest}", any(not_yet_templates))
        .route("/e2b-uploads/{hash}", put(templates::upload))
        .fallback(not_served)
        .layer(axum::Extension(Arc::new(Builds::new())))
        .with_state(node)
}

/// The node's error as E2B's: its status where E2B's clients know it, its message and code.
fn api_error(e: ApiError) -> Response {
    let status = match e.status() {
        s @ (400 | 401 | 403 | 404 | 409 | 429 | 500 | 503 | 504) => s,
        413 | 422 => 400,
        _ => 500,
    };
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    e2b_error(status, format!("{} ({})", e.message, e.code.as_str()))
}

fn sandbox_not_found(id: &str) -> Response {
    e2b_error(
        StatusCode::NOT_FOUND,
        format!("sandbox {id} not found on this node"),
    )
}

/// A refusal of what the node does not serve (yet): 501 (E2B's SDKs raise their
/// SandboxException with the message; a 503 would read "please retry").
fn not_served_yet(what: &str) -> Response {
    let mut r = e2b_error(
        StatusCode::NOT_IMPLEMENTED,
        format!("{what} is not served by this sbx node yet"),
    );
    r.headers_mut()
        .insert("should-retry", HeaderValue::from_static("false"));
    r
}

/// A node without checkpoints (no CRIU) cannot pause: 501 as for anything not served.
fn pausing_refused(node: &Node) -> Option<Response> {
    node.checkpointer()
        .err()
        .map(|e| not_served_yet(&format!("pausing and resuming a sandbox ({})", e.message)))
}

/// `POST /sandboxes/{id}/pause`: E2B's pause is the node's sleep, held asleep (a request to
/// one of its ports does not wake it; connect does). 409 when it is paused already.
async fn pause(State(node): St, Path(id): Path<String>, body: Bytes) -> Response {
    if let Some(r) = pausing_refused(&node) {
        return r;
    }
    let b: PauseBody = match parse_body(&body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    let o = match find(&node, &id) {
        Ok(o) => o,
        Err(r) => return r,
    };
    if o.status == SandboxStatus::Sleeping {
        return e2b_error(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already paused"),
        );
    }
    // A filesystem-only pause: the node's restart ends what runs in it and boots it again
    // over its disk, and that fresh machine is what sleeps: a resume finds its files and none
    // of the processes that ran before the pause.
    if b.memory == Some(false) {
        if let Err(r) = reboot(&node, &o.id, false).await {
            return r;
        }
    }
    match node.sleep_held(&o.id).await {
        // A paused sandbox does not time out (E2B's): its end is set again when it resumes.
        Ok(()) => match clear_end(&node, &o.id) {
            Ok(()) => StatusCode::NO_CONTENT.into_response(),
            Err(r) => r,
        },
        Err(e) if e.code == sbx_api::ErrorCode::SandboxNotFound => sandbox_not_found(&id),
        Err(e) => api_error(e),
    }
}

/// `POST /sandboxes/{id}/pause`'s body: `memory` false asks for a filesystem-only pause
/// (E2B's `mode: "filesystem"`);
/// `requireHealthyGuest` is taken and not checked (a sleep checkpoints the guest as it is).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PauseBody {
    memory: Option<bool>,
    #[allow(dead_code)]
    require_healthy_guest: Option<bool>,
}

/// Resumes a paused (sleeping) sandbox and lifts its hold; true when it was paused. With
/// `memory` false (E2B's `on_resume: "reboot"`), or one whose timeout pauses it
/// filesystem-only (`autoPauseMemory: false`), it is booted again over its disk (the node's
/// restart of a sleeping sandbox: its saved processes dropped) rather than woken.
async fn resume_if_paused(
    node: &Arc<Node>,
    o: &SandboxObject,
    memory: Option<bool>,
) -> Result<bool, Response> {
    let fs_only = o.metadata.get(AUTO_PAUSE_KEY).map(String::as_str) == Some(FILESYSTEM);
    if o.status == SandboxStatus::Sleeping && (memory == Some(false) || fs_only) {
        reboot(node, &o.id, true).await?;
        return Ok(true);
    }
    match node.wake_and_release(&o.id).await {
        Ok(asleep) => Ok(asleep),
        Err(e) if e.code == sbx_api::ErrorCode::SandboxNotFound => Err(sandbox_not_found(&o.id)),
        Err(e) => Err(api_error(e)),
    }
}

/// The node's restart of sandbox `id` (`release`: and its hold lifted), waited for until it
/// runs again.
async fn reboot(node: &Arc<Node>, id: &str, release: bool) -> Result<(), Response> {
    let done = if release {
        node.reboot_and_release(id).await
    } else {
        node.restart_sandbox(id).await
    };
    match done {
        Ok(_) => {}
        Err(e) if e.code == sbx_api::ErrorCode::SandboxNotFound => {
            return Err(sandbox_not_found(id))
        }
        Err(e) => return Err(api_error(e)),
    }
    wait_running(node, id).await.map(|_| ()).map_err(|why| {
        e2b_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("sandbox {id} did not boot again: {why}"),
        )
    })
}

/// Takes away sandbox `id`'s end (a paused one does not time out).
fn clear_end(node: &Arc<Node>, id: &str) -> Result<(), Response> {
    let patch = sbx_api::SandboxPatch {
        expires_at: Some(None),
        ..Default::default()
    };
    node.patch_sandbox(id, patch).map(|_| ()).map_err(api_error)
}

/// `POST /sandboxes/{id}/resume` (the older call; connect does the same): 201 with the
/// sandbox, 409 when it is not paused.
async fn resume(State(node): St, Path(id): Path<String>, body: Bytes) -> Response {
    if let Some(r) = pausing_refused(&node) {
        return r;
    }
    let (b, o) = match timeout_and_sandbox(&node, &id, &body) {
        Ok(x) => x,
        Err(r) => return r,
    };
    if o.status != SandboxStatus::Sleeping {
        return e2b_error(StatusCode::CONFLICT, format!("sandbox {id} is not paused"));
    }
    if let Err(r) = resume_if_paused(&node, &o, b.memory).await {
        return r;
    }
    if let Err(r) = set_end(&node, &o, b.timeout.unwrap_or(DEFAULT_TIMEOUT_S), false) {
        return r;
    }
    match find(&node, &id) {
        Ok(o) => (StatusCode::CREATED, Json(sandbox_json(&node, &o))).into_response(),
        Err(r) => r,
    }
}

async fn not_yet_logs() -> Response {
    not_served_yet("a sandbox's logs (its commands' output is kept by each command)")
}

async fn not_yet_templates() -> Response {
    not_served_yet(
        "this call about templates (a node builds them, gives their status and tags, and \
         deletes them; it does not list or update them)",
    )
}

async fn not_served(uri: axum::http::Uri) -> Response {
    e2b_error(
        StatusCode::NOT_FOUND,
        format!(
            "{} is not a route of this sbx node's E2B API (sandboxes only: templates are the \
             node's images)",
            uri.path()
        ),
    )
}

fn parse_body<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T, Response> {
    let body: &[u8] = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        body
    };
    serde_json::from_slice(body)
        .map_err(|e| e2b_error(StatusCode::BAD_REQUEST, format!("the body: {e}")))
}

/// `POST /v2/sandboxes`'s body (and the older `POST /sandboxes`'s).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    timeout: Option<u64>,
    auto_pause: Option<bool>,
    auto_pause_memory: Option<Value>,
    auto_resume: Option<Value>,
    #[allow(dead_code)]
    secure: Option<bool>,
    #[serde(rename = "allow_internet_access", alias = "allowInternetAccess")]
    allow_internet_access: Option<bool>,
    network: Option<NetworkConfig>,
    metadata: Option<BTreeMap<String, String>>,
    env_vars: Option<BTreeMap<String, String>>,
    /// Taken, for E2B's SDK starts the MCP gateway itself.
    #[allow(dead_code)]
    mcp: Option<Value>,
    iam: Option<Value>,
    volume_mounts: Option<Vec<Value>>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NetworkConfig {
    allow_out: Option<Vec<String>>,
    deny_out: Option<Vec<String>>,
    allow_public_traffic: Option<bool>,
    mask_request_host: Option<String>,
    rules: Option<Value>,
    egress_proxy: Option<Value>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// Whether a value asks for something: not null, false, empty or `{enabled: false}`.
fn set(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => {
            !o.is_empty() && o.get("enabled").is_none_or(|e| e != &Value::Bool(false))
        }
        Some(_) => true,
    }
}

/// E2B's create as the node's: the body of `POST /v1/sandboxes`, or the refusal of what the
/// node does not do.
fn node_create_body(n: &NewSandbox, now_ns: i128, can_pause: bool) -> Result<Value, Response> {
    let refuse = |what: &str| Err(not_served_yet(what));
    if let Some((k, _)) = n.rest.iter().find(|(_, v)| set(&Some((*v).clone()))) {
        return Err(e2b_error(
            StatusCode::BAD_REQUEST,
            format!("{k} is not a field this node takes"),
        ));
    }
    // autoPause: at its timeout the sandbox is paused (the node's sleep), not killed; held
    // asleep unless autoResume lets a request to it wake it.
    let auto_pause = n.auto_pause == Some(true);
    if (auto_pause || set(&n.auto_resume)) && !can_pause {
        return refuse("autoPause / autoResume (this node has no CRIU to pause a sandbox)");
    }
    // autoPauseMemory: true (or unset) is the node's sleep, memory kept; false a
    // filesystem-only pause: asleep all the same, and booted again over its disk by the
    // connect that resumes it (marked in its metadata). A request cannot resume it (E2B's).
    let fs_only = auto_pause && n.auto_pause_memory == Some(Value::Bool(false));
    if fs_only && set(&n.auto_resume) {
        return Err(e2b_error(
            StatusCode::BAD_REQUEST,
            "autoPauseMemory: false (a filesystem-only pause) cannot be combined with autoResume",
        ));
    }
    // mcp: E2B's SDK starts the gateway itself (`mcp-gateway` run in the sandbox once it
    // is made, the sandbox killed when that fails): nothing of it is the node's.
    if set(&n.iam) {
        return refuse("iam");
    }
    if n.volume_mounts.as_ref().is_some_and(|v| !v.is_empty()) {
        return refuse("volumeMounts (volumes)");
    }
    let net = n.network.as_ref();
    if let Some(net) = net {
        if let Some((k, _)) = net.rest.iter().find(|(_, v)| set(&Some((*v).clone()))) {
            return Err(e2b_error(
                StatusCode::BAD_REQUEST,
                format!("network.{k} is not a field this node takes"),
            ));
        }
        if let Some(m) = net.mask_request_host.as_deref().filter(|s| !s.is_empty()) {
            let sample = m.replace("${PORT}", "65535");
            let ok = sample.len() <= 255
                && sample
                    .bytes()
                    .all(|b| b.is_ascii_graphic() && !matches!(b, b'/' | b'@' | b'?' | b'#'));
            if !ok {
                return Err(e2b_error(
                    StatusCode::BAD_REQUEST,
                    format!("network.maskRequestHost {m:?} is not a host (and ${{PORT}})"),
                ));
            }
        }
        if set(&net.rules) {
            return refuse(
                "network.rules (header transforms; the node's own API has egress.inject)",
            );
        }
        if set(&net.egress_proxy) {
            return refuse("network.egressProxy");
        }
    }
    let timeout = n.timeout.unwrap_or(DEFAULT_TIMEOUT_S);
    if timeout == 0 || timeout > MAX_TIMEOUT_S {
        return Err(e2b_error(
            StatusCode::BAD_REQUEST,
            format!("timeout must be 1 to {MAX_TIMEOUT_S} seconds"),
        ));
    }
    let mut body = Map::new();
    let template = n.template_id.trim();
    match template {
        "" | "base" => {}
        t if t == interp::TEMPLATE || t == "code-interpreter" => {
            body.insert("image".into(), json!(interp::IMAGE));
            body.insert("start_command".into(), json!(interp::start_command()));
            body.insert("ready".into(), json!(interp::ready_check()));
        }
        // A snapshot of the node (E2B's snapshots are templates): a sandbox that goes on
        // from it.
        t if snapshots::is_snapshot_id(t) => {
            if n.env_vars.as_ref().is_some_and(|e| !e.is_empty()) {
                return refuse(
                    "envVars for a sandbox made from a snapshot (it goes on with the \
                     snapshot's processes and their environment)",
                );
            }
            body.insert("snapshot".into(), json!(t));
        }
        t if t.starts_with("img-") => {
            body.insert("template".into(), json!(t));
        }
        t => {
            body.insert("image".into(), json!(t));
        }
    }
    let mut env = n.env_vars.clone().unwrap_or_default();
    if template == interp::TEMPLATE || template == "code-interpreter" {
        for (k, v) in interp::start_env() {
            env.entry(k).or_insert(v);
        }
    }
    if !env.is_empty() {
        body.insert("env".into(), json!(env));
    }
    // The caller's metadata, and what E2B's settings keep with the sandbox (hidden from
    // E2B's answers): the Host its ports are sent (maskRequestHost, the preview proxy's), a
    // filesystem-only auto-pause, the timeout an auto-resume gives it again.
    let mut meta = n.metadata.clone().unwrap_or_default();
    if let Some(k) = meta.keys().find(|k| KEPT_KEYS.contains(&k.as_str())) {
        return Err(e2b_error(
            StatusCode::BAD_REQUEST,
            format!("metadata key {k:?} is this node's own"),
        ));
    }
    if let Some(m) = net
        .and_then(|n| n.mask_request_host.as_deref())
        .filter(|s| !s.is_empty())
    {
        meta.insert(PREVIEW_HOST_KEY.into(), m.into());
    }
    if fs_only {
        meta.insert(AUTO_PAUSE_KEY.into(), FILESYSTEM.into());
    }
    if auto_pause && set(&n.auto_resume) {
        meta.insert(RESUME_TIMEOUT_KEY.into(), timeout.to_string());
    }
    if !meta.is_empty() {
        body.insert("metadata".into(), json!(meta));
    }
    if auto_pause {
        let on = if set(&n.auto_resume) { "sleep" } else { "hold" };
        body.insert("on_expiry".into(), json!(on));
    }
    body.insert(
        "expires_at".into(),
        json!(sbx_api::format_rfc3339_millis(
            now_ns + i128::from(timeout) * 1_000_000_000
        )),
    );
    // Every port is public but envd's (E2B's default); allowPublicTraffic: false makes every
    // port need the traffic access token.
    if net.and_then(|n| n.allow_public_traffic) == Some(false) {
        body.insert("public_ports".into(), json!([]));
    } else {
        body.insert("public_ports_except".into(), json!([ENVD_PORT]));
    }
    // Egress: E2B's rules as the node's (`network.rs`).
    if let Some(e) = network::egress_keys(
        n.allow_internet_access,
        net.and_then(|n| n.allow_out.as_deref()).unwrap_or_default(),
        net.and_then(|n| n.deny_out.as_deref()).unwrap_or_default(),
    ) {
        body.insert("egress".into(), Value::Object(e));
    }
    Ok(Value::Object(body))
}

/// The sandbox's token (the envd access token).
fn token_of(node: &Node, id: &str) -> Option<String> {
    node.sandbox_token(id)
        .ok()
        .flatten()
        .map(|t| t.reveal().to_string())
}

/// The template a sandbox is of, as E2B names it.
fn template_of(o: &SandboxObject) -> String {
    if o.metadata.contains_key(TEMPLATE_KEY) {
        return o.metadata[TEMPLATE_KEY].clone();
    }
    match o.image.as_str() {
        "base" | "" => "base".into(),
        i => i.to_string(),
    }
}

/// The metadata key where the E2B template id of a sandbox is kept (not shown to E2B's
/// callers).
const TEMPLATE_KEY: &str = "e2b.template";
/// The metadata key of a sandbox whose timeout pauses it filesystem-only (`FILESYSTEM`).
const AUTO_PAUSE_KEY: &str = "e2b.auto_pause";
const FILESYSTEM: &str = "filesystem";
/// The metadata key of an autoResume sandbox's timeout (seconds): what it is given again
/// when a request wakes it.
const RESUME_TIMEOUT_KEY: &str = "e2b.resume_timeout";
use crate::node::sandbox::PREVIEW_HOST_KEY;
/// The metadata keys E2B's settings keep with a sandbox: not the caller's, not shown.
const KEPT_KEYS: [&str; 4] = [
    TEMPLATE_KEY,
    AUTO_PAUSE_KEY,
    RESUME_TIMEOUT_KEY,
    PREVIEW_HOST_KEY,
];

fn user_metadata(o: &SandboxObject) -> BTreeMap<String, String> {
    o.metadata
        .iter()
        .filter(|(k, _)| !KEPT_KEYS.contains(&k.as_str()) && !templates::Defaults::is_key(k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// The domain E2B's SDK builds a port's host from (`{port}-{id}.{domain}`, `get_host`): the
/// preview listener's, with its port when it is not the scheme's own; none when it is off.
fn domain_of(node: &Node) -> Value {
    let Some(p) = node.preview() else {
        return Value::Null;
    };
    let port = p.listen.port();
    if port == if p.tls { 443 } else { 80 } {
        json!(p.domain)
    } else {
        json!(format!("{}:{port}", p.domain))
    }
}

/// E2B's `Sandbox` (the create and connect answer).
fn sandbox_json(node: &Node, o: &SandboxObject) -> Value {
    let public = o.public_ports_except.is_some();
    let token = token_of(node, &o.id);
    json!({
        "sandboxID": o.id,
        "templateID": template_of(o),
        "alias": template_of(o),
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": token,
        "trafficAccessToken": if public { None } else { token_of(node, &o.id) },
        "domain": domain_of(node),
    })
}

/// E2B's state of a sandbox: the node's running (and starting) are `running`, sleeping is
/// E2B's `paused`.
fn state_of(o: &SandboxObject) -> Option<&'static str> {
    match o.status {
        SandboxStatus::Running | SandboxStatus::Starting => Some("running"),
        SandboxStatus::Sleeping => Some("paused"),
        _ => None,
    }
}

/// Why a request for a port of sandbox `id` (envd's or another) cannot reach it: it is not
/// on this node, not running (killed, ended, failed), or paused without autoResume (held
/// asleep: connect resumes it). `None`: it runs, or sleeps and a request wakes it.
pub fn not_reachable(node: &Node, id: &str) -> Option<&'static str> {
    let Ok(o) = node.sandbox(id) else {
        return Some("it is not on this node: killed, or past its timeout");
    };
    match o.status {
        SandboxStatus::Running | SandboxStatus::Starting => None,
        SandboxStatus::Sleeping if node.is_held_asleep(&o.id) => {
            Some("it is paused: connect resumes it")
        }
        SandboxStatus::Sleeping => None,
        _ => Some("it was killed or reached its timeout"),
    }
}

/// E2B's `ListedSandbox` (and, with `detail`, `SandboxDetail`).
fn listed_json(node: &Node, o: &SandboxObject, detail: bool) -> Value {
    let started = o.started_at.clone().unwrap_or_else(|| o.created_at.clone());
    let end = o
        .expires_at
        .clone()
        .unwrap_or_else(|| "9999-12-31T23:59:59.000Z".into());
    let mut v = json!({
        "sandboxID": o.id,
        "templateID": template_of(o),
        "alias": template_of(o),
        "clientID": CLIENT_ID,
        "startedAt": started,
        "endAt": end,
        "cpuCount": o.limits.vcpus,
        "memoryMB": o.limits.memory_bytes >> 20,
        "diskSizeMB": 0,
        "state": state_of(o).unwrap_or("running"),
        "envdVersion": ENVD_VERSION,
        "metadata": user_metadata(o),
    });
    if detail {
        if let Some(m) = v.as_object_mut() {
            m.insert("envdAccessToken".into(), json!(token_of(node, &o.id)));
            m.insert("domain".into(), domain_of(node));
            let closed = o
                .egress
                .as_ref()
                .and_then(|e| e.get("default"))
                .is_some_and(|d| d == "deny");
            m.insert("allowInternetAccess".into(), json!(!closed));
        }
    }
    v
}

/// Waits until a sandbox just made runs: `Err` with why when it failed or did not in time.
async fn wait_running(node: &Arc<Node>, id: &str) -> Result<SandboxObject, String> {
    let end = tokio::time::Instant::now() + CREATE_WAIT;
    loop {
        let o = node.sandbox(id).map_err(|e| e.message)?;
        match o.status {
            SandboxStatus::Running => return Ok(o),
            SandboxStatus::Starting if tokio::time::Instant::now() < end => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            SandboxStatus::Starting => return Err("it did not start in time".into()),
            _ => {
                return Err(o
                    .failure
                    .unwrap_or_else(|| format!("it is {}", o.status.as_str())))
            }
        }
    }
}

async fn create(State(node): St, body: Bytes) -> Response {
    let mut n: NewSandbox = match parse_body(&body) {
        Ok(n) => n,
        Err(r) => return r,
    };
    let can_pause = node.checkpointer().is_ok();
    // A template built through E2B's API (by name, `name:tag` or id): its snapshot, and the
    // defaults its steps set for envd's commands.
    let asked = n.template_id.trim().to_string();
    let mut built = templates::resolve(&node, &asked);
    if let Some(r) = &mut built {
        n.template_id = r.snapshot_id.clone();
        // The create's envVars are those of its commands (E2B's: the start command runs
        // already), over the template's.
        r.defaults.env.extend(n.env_vars.take().unwrap_or_default());
    }
    let mut create_body = match node_create_body(&n, crate::image::now_ns(), can_pause) {
        Ok(b) => b,
        Err(r) => return r,
    };
    // The template as E2B named it, for the answers (kept with the sandbox).
    if let Some(obj) = create_body.as_object_mut() {
        let t = asked.as_str();
        if !matches!(t, "" | "base") {
            let meta = obj
                .entry("metadata")
                .or_insert_with(|| Value::Object(Map::new()));
            if let Some(m) = meta.as_object_mut() {
                m.insert(TEMPLATE_KEY.into(), json!(t));
                for (k, v) in built.iter().flat_map(|r| r.defaults.metadata()) {
                    m.insert(k, json!(v));
                }
            }
        }
    }
    let bytes = create_body.to_string();
    let c = match sbx_api::parse_sandbox_create(bytes.as_bytes()) {
        Ok(c) => c,
        Err(e) => return api_error(e),
    };
    let o = match node.create_sandbox(c).await {
        Ok(o) => o,
        Err(e) => return api_error(e),
    };
    let o = match wait_running(&node, &o.id).await {
        Ok(o) => o,
        Err(why) => {
            let _ = node.delete_sandbox(&o.id).await;
            return e2b_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!(
                    "the sandbox of template {:?} did not start: {why}",
                    n.template_id
                ),
            );
        }
    };
    (StatusCode::CREATED, Json(sandbox_json(&node, &o))).into_response()
}

fn find(node: &Node, id: &str) -> Result<SandboxObject, Response> {
    let o = node.sandbox(id).map_err(|_| sandbox_not_found(id))?;
    if state_of(&o).is_none() {
        return Err(sandbox_not_found(id));
    }
    Ok(o)
}

async fn get_one(State(node): St, Path(id): Path<String>) -> Response {
    match find(&node, &id) {
        Ok(o) => Json(listed_json(&node, &o, true)).into_response(),
        Err(r) => r,
    }
}

async fn kill(State(node): St, Path(id): Path<String>) -> Response {
    if let Err(r) = find(&node, &id) {
        return r;
    }
    match node.delete_sandbox(&id).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => api_error(e),
    }
}

/// A call's `TimeoutBody` and the sandbox it names.
fn timeout_and_sandbox(
    node: &Node,
    id: &str,
    body: &Bytes,
) -> Result<(TimeoutBody, SandboxObject), Response> {
    let b: TimeoutBody = parse_body(body)?;
    Ok((b, find(node, id)?))
}

#[derive(Debug, Deserialize)]
struct TimeoutBody {
    timeout: Option<u64>,
    /// `…/refreshes`' name of it.
    duration: Option<u64>,
    /// Connect's and resume's: false resumes a paused sandbox with a reboot.
    memory: Option<bool>,
}

/// Sets the sandbox to end `secs` from now; `only_extend`: never earlier than it would.
fn set_end(
    node: &Arc<Node>,
    o: &SandboxObject,
    secs: u64,
    only_extend: bool,
) -> Result<(), Response> {
    if secs > MAX_TIMEOUT_S {
        return Err(e2b_error(
            StatusCode::BAD_REQUEST,
            format!("timeout must be at most {MAX_TIMEOUT_S} seconds"),
        ));
    }
    let at_ns = crate::image::now_ns() + i128::from(secs.max(1)) * 1_000_000_000;
    if only_extend {
        let now_end = o.expires_at.as_deref().and_then(sbx_api::parse_rfc3339);
        if now_end.is_none_or(|e| e >= at_ns) {
            return Ok(());
        }
    }
    let at = sbx_api::format_rfc3339_millis(at_ns);
    let patch = sbx_api::SandboxPatch {
        expires_at: Some(Some(at)),
        ..Default::default()
    };
    node.patch_sandbox(&o.id, patch)
        .map(|_| ())
        .map_err(api_error)
}

async fn set_timeout(State(node): St, Path(id): Path<String>, body: Bytes) -> Response {
    let b: TimeoutBody = match parse_body(&body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    let Some(secs) = b.timeout else {
        return e2b_error(StatusCode::BAD_REQUEST, "timeout is required (seconds)");
    };
    let o = match find(&node, &id) {
        Ok(o) => o,
        Err(r) => return r,
    };
    match set_end(&node, &o, secs, false) {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(r) => r,
    }
}

async fn refresh(State(node): St, Path(id): Path<String>, body: Bytes) -> Response {
    let (b, o) = match timeout_and_sandbox(&node, &id, &body) {
        Ok(x) => x,
        Err(r) => return r,
    };
    match set_end(
        &node,
        &o,
        b.duration.or(b.timeout).unwrap_or(DEFAULT_TIMEOUT_S),
        true,
    ) {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(r) => r,
    }
}

async fn connect(State(node): St, Path(id): Path<String>, body: Bytes) -> Response {
    let (b, o) = match timeout_and_sandbox(&node, &id, &body) {
        Ok(x) => x,
        Err(r) => return r,
    };
    // A paused sandbox is resumed (201) and times out afresh; a running one is connected to
    // (200), its end only ever moved later (`memory: false` is nothing to it).
    let resumed = match resume_if_paused(&node, &o, b.memory).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    let end = if resumed {
        set_end(&node, &o, b.timeout.unwrap_or(DEFAULT_TIMEOUT_S), false)
    } else {
        b.timeout
            .map_or(Ok(()), |secs| set_end(&node, &o, secs, true))
    };
    if let Err(r) = end {
        return r;
    }
    let o = match find(&node, &id) {
        Ok(o) => o,
        Err(r) => return r,
    };
    let status = if resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    (status, Json(sandbox_json(&node, &o))).into_response()
}

/// The query's pairs (`metadata`, `state`, `nextToken`, `limit`; `state` may repeat).
fn query_pairs(q: Option<&str>) -> Vec<(String, String)> {
    super::url_pairs(q.unwrap_or(""))
}

/// `metadata=k1%3Dv1%26k2%3Dv2` (one query parameter holding a query of its own).
fn metadata_filter(pairs: &[(String, String)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .filter(|(k, _)| k == "metadata")
        .flat_map(|(_, v)| query_pairs(Some(v)))
        .collect()
}

/// Every sandbox of the node E2B's API shows (running or paused), through the node's own
/// list with its metadata filter, page by page.
fn all_listed(node: &Node, metadata: Vec<(String, String)>) -> Vec<SandboxObject> {
    let mut out = Vec::new();
    let mut cursor = None;
    loop {
        let q = ListQuery {
            status: None,
            metadata: metadata.clone(),
            limit: MAX_PAGE,
            cursor: cursor.take(),
        };
        let (list, next) = node.list_sandboxes(&q);
        // A template's build sandbox is the build's, not listed.
        out.extend(
            list.into_iter().filter(|o| {
                state_of(o).is_some() && !o.metadata.contains_key(templates::BUILD_KEY)
            }),
        );
        match next {
            Some(n) => cursor = Some(n),
            None => return out,
        }
    }
}

/// When a sandbox started (ns since the epoch), E2B's `startedAt`: the order of a list.
fn started_ns(o: &SandboxObject) -> i128 {
    o.started_at
        .as_deref()
        .and_then(sbx_api::parse_rfc3339)
        .or_else(|| sbx_api::parse_rfc3339(&o.created_at))
        .unwrap_or(0)
}

/// A list page's key of a sandbox (and the `nextToken` of the page that ends with it).
fn page_key(o: &SandboxObject) -> (i128, String) {
    (started_ns(o), o.id.clone())
}

/// The first non-empty value of the query's parameter `name`.
fn query_one<'a>(pairs: &'a [(String, String)], name: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .filter(|v| !v.is_empty())
}

/// A page's `limit` (1 to [`MAX_PAGE`], that when not given), or its 400.
fn page_limit(given: Option<&str>) -> Result<usize, Response> {
    match given {
        None => Ok(MAX_PAGE),
        Some(v) => match v.parse::<usize>() {
            Ok(n) if (1..=MAX_PAGE).contains(&n) => Ok(n),
            _ => Err(e2b_error(
                StatusCode::BAD_REQUEST,
                format!("limit must be 1 to {MAX_PAGE}"),
            )),
        },
    }
}

fn token_of_key(k: &(i128, String)) -> String {
    format!("{}.{}", k.0, k.1)
}

fn key_of_token(t: &str) -> Option<(i128, String)> {
    let (ns, id) = t.split_once('.')?;
    Some((ns.parse().ok()?, id.to_string()))
}

/// `GET /v2/sandboxes`: filtered by metadata, state, template and `startedAfter`, ordered by
/// start (`order`: `desc`, the newest first, by default), paged by `limit` and `nextToken`.
async fn list_v2(State(node): St, RawQuery(q): RawQuery) -> Response {
    let pairs = query_pairs(q.as_deref());
    let one = |name: &str| query_one(&pairs, name);
    let states: Vec<String> = pairs
        .iter()
        .filter(|(k, _)| k == "state")
        .flat_map(|(_, v)| v.split(',').map(|s| s.trim().to_string()))
        .filter(|s| !s.is_empty())
        .collect();
    for s in &states {
        if s != "running" && s != "paused" {
            return e2b_error(
                StatusCode::BAD_REQUEST,
                format!("state {s:?} is not running or paused"),
            );
        }
    }
    let limit = match page_limit(one("limit")) {
        Ok(n) => n,
        Err(r) => return r,
    };
    let asc = match one("order") {
        None | Some("desc") => false,
        Some("asc") => true,
        Some(o) => {
            return e2b_error(
                StatusCode::BAD_REQUEST,
                format!("order {o:?} is not asc or desc"),
            )
        }
    };
    let after = match one("startedAfter") {
        None => None,
        Some(v) => match sbx_api::parse_rfc3339(v) {
            Some(ns) => Some(ns),
            None => {
                return e2b_error(
                    StatusCode::BAD_REQUEST,
                    format!("startedAfter {v:?} is not an RFC 3339 time"),
                )
            }
        },
    };
    let template = one("template");
    let cursor = match one("nextToken") {
        None => None,
        Some(t) => match key_of_token(t) {
            Some(k) => Some(k),
            None => {
                return e2b_error(
                    StatusCode::BAD_REQUEST,
                    format!("nextToken {t:?} is not one this node gave"),
                )
            }
        },
    };
    let mut list: Vec<SandboxObject> = all_listed(&node, metadata_filter(&pairs))
        .into_iter()
        .filter(|o| {
            state_of(o).is_some_and(|st| states.is_empty() || states.iter().any(|s| s == st))
        })
        .filter(|o| template.is_none_or(|t| template_of(o) == t))
        .filter(|o| after.is_none_or(|a| started_ns(o) >= a))
        .filter(|o| {
            cursor.as_ref().is_none_or(|c| {
                let k = page_key(o);
                if asc {
                    k > *c
                } else {
                    k < *c
                }
            })
        })
        .collect();
    list.sort_by_key(page_key);
    if !asc {
        list.reverse();
    }
    let more = list.len() > limit;
    list.truncate(limit);
    let next = more
        .then(|| list.last().map(|o| token_of_key(&page_key(o))))
        .flatten();
    let items: Vec<Value> = list.iter().map(|o| listed_json(&node, o, false)).collect();
    let mut r = Json(Value::Array(items)).into_response();
    if let Some(Ok(v)) = next.map(|n| HeaderValue::from_str(&n)) {
        r.headers_mut().insert("x-next-token", v);
    }
    r
}

async fn list_v1(State(node): St, RawQuery(q): RawQuery) -> Response {
    let pairs = query_pairs(q.as_deref());
    let items: Vec<Value> = all_listed(&node, metadata_filter(&pairs))
        .iter()
        .map(|o| listed_json(&node, o, false))
        .collect();
    Json(Value::Array(items)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn new(v: Value) -> NewSandbox {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_create_becomes_the_node_s_with_its_expiry_ports_and_rules() {
        let n = new(json!({
            "templateID": "base", "timeout": 60, "autoPause": false, "secure": true,
            "allow_internet_access": true, "metadata": {"k": "v"}, "envVars": {"A": "1"},
            "network": {"denyOut": ["0.0.0.0/0"], "allowOut": ["example.com"]},
        }));
        let b = node_create_body(&n, 0, false).unwrap();
        assert_eq!(b["expires_at"], "1970-01-01T00:01:00.000Z");
        assert_eq!(b["public_ports_except"], json!([ENVD_PORT]));
        assert_eq!(b["env"], json!({"A": "1"}));
        assert_eq!(b["metadata"], json!({"k": "v"}));
        assert_eq!(
            b["egress"],
            json!({"default": "deny", "allow": ["example.com"]})
        );
        assert!(b.get("image").is_none());
        // The node's parser takes it.
        sbx_api::parse_sandbox_create(b.to_string().as_bytes()).unwrap();
    }

    #[test]
    fn templates_map_to_images_keys_and_the_interpreter() {
        let b = node_create_body(&new(json!({"templateID": "python:3.12"})), 0, false).unwrap();
        assert_eq!(b["image"], "python:3.12");
        let b = node_create_body(&new(json!({"templateID": "img-abc"})), 0, false).unwrap();
        assert_eq!(b["template"], "img-abc");
        let b = node_create_body(&new(json!({"templateID": interp::TEMPLATE})), 0, false).unwrap();
        assert!(b["start_command"].is_array());
        assert_eq!(b["ready"], interp::ready_check());
        let b = node_create_body(
            &new(json!({"templateID": "base", "allow_internet_access": false,
                        "network": {"allowPublicTraffic": false}})),
            0,
            false,
        )
        .unwrap();
        assert_eq!(b["egress"], json!({"default": "deny"}));
        assert_eq!(b["public_ports"], json!([]));
    }

    #[test]
    fn what_the_node_does_not_do_is_refused_not_ignored() {
        for body in [
            json!({"templateID": "base", "autoPause": true}),
            json!({"templateID": "base", "volumeMounts": [{"name": "v", "path": "/v"}]}),
            json!({"templateID": "base", "network": {"maskRequestHost": "a b:${PORT}"}}),
            json!({"templateID": "base", "network": {"maskRequestHost": "h/p"}}),
            json!({"templateID": "base", "metadata": {"sbx.preview_host": "x"}}),
            json!({"templateID": "base", "brandNew": 1}),
            json!({"templateID": "base", "timeout": 0}),
        ] {
            assert!(
                node_create_body(&new(body.clone()), 0, false).is_err(),
                "{body}"
            );
        }
        // Defaults the SDK sends are no request.
        let ok = json!({"templateID": "base", "autoPause": false, "mcp": null,
                        "autoResume": {"enabled": false}, "volumeMounts": []});
        assert!(node_create_body(&new(ok), 0, false).is_ok());
        // A node that checkpoints takes autoPause: held asleep at the timeout, or asleep
        // with autoResume.
        let b = node_create_body(
            &new(json!({"templateID": "base", "autoPause": true})),
            0,
            true,
        )
        .unwrap();
        assert_eq!(b["on_expiry"], "hold");
        let b = node_create_body(
            &new(json!({"templateID": "base", "autoPause": true, "autoResume": {"enabled": true}})),
            0,
            true,
        )
        .unwrap();
        assert_eq!(b["on_expiry"], "sleep");
    }

    #[test]
    fn auto_pause_memory_false_is_marked_and_true_is_the_node_s_sleep() {
        let with =
            |m: Value| new(json!({"templateID": "base", "autoPause": true, "autoPauseMemory": m}));
        let b = node_create_body(&with(json!(false)), 0, true).unwrap();
        assert_eq!(b["on_expiry"], "hold");
        assert_eq!(b["metadata"][AUTO_PAUSE_KEY], FILESYSTEM);
        for m in [json!(true), Value::Null] {
            let b = node_create_body(&with(m.clone()), 0, true).unwrap();
            assert_eq!(b["on_expiry"], "hold", "{m}");
            assert!(b.get("metadata").is_none(), "{m}");
        }
        // A filesystem-only pause is resumed by connect alone (E2B's): not with autoResume.
        let both = new(
            json!({"templateID": "base", "autoPause": true, "autoPauseMemory": false,
                              "autoResume": {"enabled": true}}),
        );
        let r = node_create_body(&both, 0, true).unwrap_err();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        // autoResume keeps the timeout an auto-resume gives again; maskRequestHost the Host.
        let b = node_create_body(
            &new(
                json!({"templateID": "base", "timeout": 42, "autoPause": true,
                        "autoResume": {"enabled": true},
                        "network": {"maskRequestHost": "custom.example.com:${PORT}"}}),
            ),
            0,
            true,
        )
        .unwrap();
        assert_eq!(b["metadata"][RESUME_TIMEOUT_KEY], "42");
        assert_eq!(
            b["metadata"][PREVIEW_HOST_KEY],
            "custom.example.com:${PORT}"
        );
        sbx_api::parse_sandbox_create(b.to_string().as_bytes()).unwrap();
        // mcp is the SDK's to start: taken.
        let b = new(json!({"templateID": "base", "mcp": {"x": {}}}));
        assert!(node_create_body(&b, 0, false).is_ok());
    }

    #[test]
    fn a_list_s_token_is_the_key_of_its_page_s_last_sandbox() {
        let k = (1_700_000_000_123_000_000i128, "sbx-abc".to_string());
        assert_eq!(key_of_token(&token_of_key(&k)), Some(k));
        assert_eq!(key_of_token("sbx-abc"), None);
        assert_eq!(key_of_token("x.sbx-abc"), None);
    }

    #[test]
    fn the_metadata_filter_is_a_query_in_a_parameter() {
        let pairs = query_pairs(Some("metadata=a%3D1%26b%3Dx%2520y&state=running&limit=5"));
        assert_eq!(
            metadata_filter(&pairs),
            vec![
                ("a".to_string(), "1".to_string()),
                ("b".into(), "x y".into())
            ]
        );
    }
}
