//! The functions interface (`sandbox::*`) of the fleet, on an iii engine: with `--iii-url` the
//! control plane joins the engine as a worker (`sbx-control`) and registers every function of
//! `sbx_api::functions::FUNCTIONS` in the engine's default namespace; the fleet's nodes join
//! the same engine, each registering its own in the namespace `sbx-<node name>` (so no two
//! workers claim one id in one namespace: the engine refuses the second).
//!
//! Each call is routed by the table, to a node's `POST /v1/functions/{id}` (its HTTP
//! interface, with the control plane's key):
//! - `sandbox::create`, `sandbox::run`: placed as the fleet's `/v1` create is (`fleet::place`:
//!   a name reserved, a node chosen, the sandbox's row recorded from the reply's `sandbox_id`;
//!   a run leaves a row only with `keep_sandbox`);
//! - a call naming a sandbox (`exec`, `stop`, `fs::*`): to the node the table has it on (by id
//!   or name); a call the old node refuses while the table moved it (a move's release) is
//!   sent once more where the table has it now; `stop` deletes its row and store objects;
//! - `sandbox::list`: every node's, merged (each row with `node` and the table's `epoch`; the
//!   lost nodes named in `missing_nodes`); `sandbox::catalog::list`: the nodes' images, merged
//!   by name; `sandbox::adapter::info`: a node's, with the fleet's `max_sandboxes` and nodes.
//!
//! Errors are the spec's S-codes: a node's own pass through; a sandbox the table does not have
//! is S002; a node lost, not answering, or a sandbox being moved is S301 (transient,
//! retryable); no node with room is S400.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, Method};
use iii_sdk::iii::WorkerMetadata;
use iii_sdk::{register_worker, Error, IIIClient, InitOptions, RegisterFunction};
use sbx_api::functions::{
    describe, s_code, schemas, FnError, CONTRACT, DEFAULT_DOCS_BASE, FUNCTIONS,
};
use sbx_api::{ApiError, ErrorCode};
use serde_json::{json, Map, Value};

use crate::db::{NodeRow, NodeState, SandboxRow};
use crate::fleet::{self, Kind};
use crate::machine;
use crate::nodecall::{self, CallError, MOVE_CALL_TIMEOUT, SHORT_CALL_TIMEOUT};
use crate::server::{read_limited, Ctl};

/// The worker's name in the engine (a node's is `sbx`, in its own namespace).
pub const WORKER_NAME: &str = "sbx-control";
/// The most bytes of a reply read from a node.
const MAX_REPLY: usize = 16 << 20;

/// Where a function's call goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Placed on a node: `made` when it leaves a sandbox.
    Place { made: bool },
    /// To the node of the sandbox its `sandbox_id` names.
    Sandbox,
    /// Every node's list, merged.
    List,
    /// The nodes' catalogs, merged.
    Catalog,
    /// A node's adapter info, with the fleet's.
    Info,
    /// Not a function of the interface.
    Unknown,
}

/// Where `function_id` goes, given its payload (a run's `keep_sandbox`).
pub fn route(function_id: &str, payload: &Map<String, Value>) -> Route {
    match function_id {
        "sandbox::create" => Route::Place { made: true },
        "sandbox::run" => Route::Place {
            made: truthy(payload.get("keep_sandbox")),
        },
        "sandbox::exec" | "sandbox::stop" => Route::Sandbox,
        "sandbox::list" => Route::List,
        "sandbox::catalog::list" => Route::Catalog,
        "sandbox::adapter::info" => Route::Info,
        f if f.starts_with("sandbox::fs::") && FUNCTIONS.contains(&f) => Route::Sandbox,
        _ => Route::Unknown,
    }
}

/// A flag as the functions read it: `true` or `"true"`.
fn truthy(v: Option<&Value>) -> bool {
    match v {
        Some(Value::Bool(b)) => *b,
        Some(Value::String(s)) => s.trim() == "true",
        _ => false,
    }
}

/// The S-code error of a node's failed answer: its own S-code when it sent one (the functions
/// interface's body), else the HTTP API's code (the control plane's own refusals: no room, a
/// name taken, a node away) mapped to its S-code.
pub fn error_of(status: u16, body: &Value) -> FnError {
    let e = body.get("error").unwrap_or(&Value::Null);
    let code = e.get("code").and_then(Value::as_str).unwrap_or("");
    let message = e
        .get("message")
        .and_then(Value::as_str)
        .map(String::from)
        .unwrap_or_else(|| format!("the node answered {status}"));
    if let Some(s) = s_code(code) {
        return FnError::new(s.code, message);
    }
    match ErrorCode::from_code(code) {
        Some(ErrorCode::Unavailable) | None if status >= 500 || code.is_empty() => {
            FnError::new("S301", message)
        }
        Some(c) => {
            let mut api = ApiError::new(c, message);
            api.param = e.get("param").and_then(Value::as_str).map(String::from);
            FnError::from(api)
        }
        None => FnError::new("S300", message),
    }
}

/// Whether a call a node refused with `code` is sent once more: the table moved the sandbox
/// since it was read (another node or epoch), or a move of it is under way. A node that
/// released a sandbox answers for it as one it does not have (or has stopped), so only those
/// refusals are looked at again; the call did not run there.
pub fn sent_again(code: &str, before: &SandboxRow, now: Option<&SandboxRow>, moving: bool) -> bool {
    if !matches!(code, "S001" | "S002" | "S004") {
        return false;
    }
    moving || now.is_some_and(|n| n.node_id != before.node_id || n.epoch != before.epoch)
}

fn unavailable(message: impl Into<String>) -> FnError {
    FnError::new("S301", message)
}

fn db_failed(e: &crate::db::DbError) -> FnError {
    tracing::error!(error = %e, "the control plane's database failed");
    unavailable("the control plane's database did not answer; its log has the reason")
}

fn node_away(node: &NodeRow, e: &CallError) -> FnError {
    unavailable(format!(
        "the node {} ({}) at {} did not answer: {e}",
        node.name, node.id, node.url
    ))
}

/// The one entry point: a function id and its payload -> the reply, or the S-code error.
pub async fn invoke(
    ctl: &Arc<Ctl>,
    rid: &str,
    function_id: &str,
    payload: Value,
) -> Result<Value, FnError> {
    let payload = sbx_api::functions::call_payload(payload)?;
    match route(function_id, &payload) {
        Route::Place { made } => place(ctl, rid, function_id, payload, made).await,
        Route::Sandbox => sandbox_call(ctl, function_id, payload).await,
        Route::List => list(ctl, payload).await,
        Route::Catalog => catalog(ctl, payload).await,
        Route::Info => info(ctl, payload).await,
        Route::Unknown => Err(FnError::new(
            "S304",
            format!(
                "no function {function_id} (the fleet serves: {})",
                FUNCTIONS.join(", ")
            ),
        )),
    }
}

/// `sandbox::create` / `sandbox::run`: through the fleet's placement (`fleet::place`).
async fn place(
    ctl: &Arc<Ctl>,
    rid: &str,
    function_id: &str,
    payload: Map<String, Value>,
    made: bool,
) -> Result<Value, FnError> {
    let body = serde_json::to_vec(&Value::Object(payload))
        .map_err(|e| FnError::invalid(format!("the payload: {e}")))?;
    let mut req = Request::new(Body::from(body));
    *req.method_mut() = Method::POST;
    *req.uri_mut() = format!("/v1/functions/{function_id}")
        .parse()
        .map_err(|_| FnError::new("S304", format!("{function_id} is not a function id")))?;
    let h = req.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    if let Ok(v) = header::HeaderValue::from_str(rid) {
        h.insert("x-request-id", v);
    }
    if let Some(k) = &ctl.node_key {
        if let Ok(v) = header::HeaderValue::from_str(&format!("Bearer {k}")) {
            h.insert(header::AUTHORIZATION, v);
        }
    }
    let resp = fleet::place(ctl.clone(), rid.to_string(), req, Kind::Function { made }).await;
    let status = resp.status().as_u16();
    let bytes = read_limited(resp.into_body(), MAX_REPLY)
        .await
        .map_err(|_| unavailable("the node's reply broke off"))?;
    let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    if (200..300).contains(&status) {
        return Ok(v);
    }
    Err(error_of(status, &v))
}

/// The sandbox's id or name of a call's payload.
fn sandbox_key(payload: &Map<String, Value>) -> Result<String, FnError> {
    match payload.get("sandbox_id") {
        Some(Value::String(s)) if !s.trim().is_empty() => Ok(s.trim().to_string()),
        Some(Value::Number(n)) => Ok(n.to_string()),
        None | Some(Value::Null) => Err(FnError::invalid("sandbox_id is required")),
        Some(_) => Err(FnError::invalid("sandbox_id must be a string")),
    }
}

/// A call naming a sandbox: to its node, as the table has it.
async fn sandbox_call(
    ctl: &Arc<Ctl>,
    function_id: &str,
    mut payload: Map<String, Value>,
) -> Result<Value, FnError> {
    let key = sandbox_key(&payload)?;
    let path = format!("/v1/functions/{function_id}");
    for round in 0..2 {
        let row = match ctl.lookup(&key).await {
            Ok(Some(r)) => r,
            Ok(None) => {
                return Err(FnError::new(
                    "S002",
                    format!("no sandbox {key} in the fleet"),
                ))
            }
            Err(e) => return Err(db_failed(&e)),
        };
        match ctl.db.unfinished_move_of(&row.id).await {
            Ok(Some(m)) if m.step != machine::RELEASING => {
                return Err(unavailable(format!(
                    "sandbox {} is being moved ({}, step {}): call again in a moment",
                    row.id, m.id, m.step
                )))
            }
            Ok(_) => {}
            Err(e) => return Err(db_failed(&e)),
        }
        let node = match ctl.db.node(&row.node_id).await {
            Ok(Some(n)) => n,
            Ok(None) => {
                return Err(unavailable(format!(
                    "sandbox {} is on node {}, which the control plane's table no longer has",
                    row.id, row.node_id
                )))
            }
            Err(e) => return Err(db_failed(&e)),
        };
        if node.state == NodeState::Lost {
            return Err(unavailable(format!(
                "sandbox {} is on node {} ({}), which is lost: calls for its sandboxes fail \
                 until it joins again",
                row.id, node.name, node.id
            )));
        }
        payload.insert("sandbox_id".into(), json!(row.id));
        let answer = nodecall::call(
            &ctl.client,
            ctl.node_key.as_deref(),
            &node.url,
            Method::POST,
            &path,
            Some(&Value::Object(payload.clone())),
            MOVE_CALL_TIMEOUT,
        )
        .await
        .map_err(|e| node_away(&node, &e))?;
        if answer.ok() {
            if function_id == "sandbox::stop" {
                forget(ctl, &row).await;
            }
            return Ok(answer.body);
        }
        let err = error_of(answer.status, &answer.body);
        if round == 0 {
            let moving = matches!(ctl.db.unfinished_move_of(&row.id).await, Ok(Some(_)));
            let now = ctl.lookup(&row.id).await.ok().flatten();
            if sent_again(err.code.code, &row, now.as_ref(), moving) {
                tracing::info!(sandbox = %row.id, node = %node.name, function = %function_id, "the node released the sandbox: routed again");
                fleet::wait_moved(ctl, &row).await;
                continue;
            }
        }
        if function_id == "sandbox::stop" && err.code.code == "S002" {
            // The node has it no more: neither has the fleet.
            forget(ctl, &row).await;
        }
        return Err(err);
    }
    Err(unavailable(format!(
        "sandbox {key} moved while it was called: call again"
    )))
}

/// A stopped sandbox's row and store objects go (a failure is logged: the stop stands).
async fn forget(ctl: &Ctl, row: &SandboxRow) {
    if let Err(e) = ctl.db.delete_sandbox(&row.id).await {
        tracing::error!(sandbox = %row.id, error = %e, "a stopped sandbox's row stays");
    }
    if let Some(store) = &ctl.store {
        if let Err(e) = store.delete_sandbox(&row.id).await {
            tracing::warn!(sandbox = %row.id, error = %e, "a stopped sandbox's objects stay in the store");
        }
    }
}

fn no_fields(payload: &Map<String, Value>) -> Result<(), FnError> {
    match payload.keys().next() {
        Some(k) => Err(FnError::invalid(format!(
            "unknown field {k} (this function takes none)"
        ))),
        None => Ok(()),
    }
}

/// `function` of every node that is not lost (`{}` payload): each node and its answer.
async fn ask_all(
    ctl: &Ctl,
    function: &str,
) -> Result<
    (
        Vec<(NodeRow, Result<nodecall::Answer, CallError>)>,
        Vec<NodeRow>,
    ),
    FnError,
> {
    let nodes = ctl.db.nodes().await.map_err(|e| db_failed(&e))?;
    let (live, lost): (Vec<NodeRow>, Vec<NodeRow>) =
        nodes.into_iter().partition(|n| n.state != NodeState::Lost);
    let path = format!("/v1/functions/{function}");
    let empty = json!({});
    let answers = futures_util::future::join_all(live.iter().map(|n| {
        nodecall::call(
            &ctl.client,
            ctl.node_key.as_deref(),
            &n.url,
            Method::POST,
            &path,
            Some(&empty),
            SHORT_CALL_TIMEOUT,
        )
    }))
    .await;
    Ok((live.into_iter().zip(answers).collect(), lost))
}

/// `sandbox::list`: every node's, merged; a node that does not answer fails it (S301), as the
/// fleet's `GET /v1/sandboxes` does; a lost node's are missing (`missing_nodes`).
async fn list(ctl: &Ctl, payload: Map<String, Value>) -> Result<Value, FnError> {
    no_fields(&payload)?;
    let (answers, lost) = ask_all(ctl, "sandbox::list").await?;
    let rows = ctl.db.sandboxes(None).await.map_err(|e| db_failed(&e))?;
    let epochs: BTreeMap<String, i64> = rows.into_iter().map(|r| (r.id, r.epoch)).collect();
    let mut pages = Vec::new();
    for (node, answer) in answers {
        let a = answer.map_err(|e| node_away(&node, &e))?;
        if !a.ok() {
            return Err(error_of(a.status, &a.body));
        }
        pages.push((node, a.body));
    }
    Ok(merge_lists(pages, &epochs, &lost))
}

/// The nodes' `sandbox::list` replies as one: each row with `node: {id, name}` and the table's
/// `epoch` (null for one the table does not have), oldest first.
pub fn merge_lists(
    pages: Vec<(NodeRow, Value)>,
    epochs: &BTreeMap<String, i64>,
    lost: &[NodeRow],
) -> Value {
    let mut all: Vec<Value> = Vec::new();
    for (node, page) in pages {
        let rows = page
            .get("sandboxes")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        for mut r in rows {
            let epoch = r
                .get("sandbox_id")
                .and_then(Value::as_str)
                .and_then(|id| epochs.get(id).copied());
            if let Some(o) = r.as_object_mut() {
                o.insert("node".into(), json!({ "id": node.id, "name": node.name }));
                o.insert("epoch".into(), json!(epoch));
            }
            all.push(r);
        }
    }
    // Oldest first (the greatest age), then by id: one order for one fleet.
    all.sort_by(|a, b| {
        let age = |v: &Value| v.get("age_secs").and_then(Value::as_u64).unwrap_or(0);
        let id = |v: &Value| {
            v.get("sandbox_id")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        };
        age(b).cmp(&age(a)).then_with(|| id(a).cmp(&id(b)))
    });
    let mut out = json!({ "sandboxes": all });
    if !lost.is_empty() {
        out["missing_nodes"] = json!(lost
            .iter()
            .map(|n| json!({ "id": n.id, "name": n.name, "state": n.state.as_str() }))
            .collect::<Vec<_>>());
    }
    out
}

/// `sandbox::catalog::list`: the images the answering nodes can boot, merged by name (a node
/// that does not answer is left out; none answering is S301).
async fn catalog(ctl: &Ctl, payload: Map<String, Value>) -> Result<Value, FnError> {
    no_fields(&payload)?;
    let (answers, _) = ask_all(ctl, "sandbox::catalog::list").await?;
    let mut by_name: BTreeMap<String, Value> = BTreeMap::new();
    let mut answered = 0;
    let mut last_err = None;
    for (node, answer) in answers {
        match answer {
            Ok(a) if a.ok() => {
                answered += 1;
                for img in a
                    .body
                    .get("images")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    if let Some(name) = img.get("name").and_then(Value::as_str) {
                        by_name
                            .entry(name.to_string())
                            .or_insert_with(|| img.clone());
                    }
                }
            }
            Ok(a) => last_err = Some(error_of(a.status, &a.body)),
            Err(e) => last_err = Some(node_away(&node, &e)),
        }
    }
    if answered == 0 {
        return Err(last_err.unwrap_or_else(|| unavailable("no node has joined the fleet")));
    }
    Ok(json!({ "images": by_name.into_values().collect::<Vec<_>>() }))
}

/// `sandbox::adapter::info`: the fleet's (its nodes, the sum of their `max_sandboxes`) over a
/// node's (its driver and limits, from the first node that answers).
async fn info(ctl: &Ctl, payload: Map<String, Value>) -> Result<Value, FnError> {
    no_fields(&payload)?;
    let (answers, lost) = ask_all(ctl, "sandbox::adapter::info").await?;
    let mut of_node = None;
    let mut nodes = Vec::new();
    let mut max = 0u64;
    for (node, answer) in &answers {
        if node.state == NodeState::Ready {
            max = max.saturating_add(node.capacity.max_sandboxes);
        }
        nodes.push(json!({ "id": node.id, "name": node.name, "state": node.state.as_str() }));
        if of_node.is_none() {
            if let Ok(a) = answer {
                if a.ok() {
                    of_node = a.body.get("info").cloned();
                }
            }
        }
    }
    nodes.extend(
        lost.iter()
            .map(|n| json!({ "id": n.id, "name": n.name, "state": n.state.as_str() })),
    );
    Ok(fleet_info(of_node, max, nodes))
}

/// The adapter info of the fleet, over a node's `info` when one answered.
pub fn fleet_info(of_node: Option<Value>, max_sandboxes: u64, nodes: Vec<Value>) -> Value {
    let mut info = match of_node {
        Some(Value::Object(m)) => m,
        _ => Map::new(),
    };
    info.insert("name".into(), json!("sbx"));
    info.insert("version".into(), json!(env!("CARGO_PKG_VERSION")));
    info.insert("contract".into(), json!(CONTRACT));
    info.insert("functions".into(), json!(FUNCTIONS));
    info.insert("max_sandboxes".into(), json!(max_sandboxes));
    info.insert("fleet".into(), json!(true));
    info.insert("nodes".into(), json!(nodes));
    json!({ "contract": CONTRACT, "info": info })
}

/// An error's body, `{code, type, message, retryable, docs_url}`.
pub fn error_body(e: &FnError) -> Value {
    e.body(DEFAULT_DOCS_BASE)
}

/// Starts the worker (the SDK connects, and reconnects, on its own thread) in the engine's
/// default namespace. Call inside the control plane's runtime.
pub fn start(url: &str, ctl: Arc<Ctl>) -> IIIClient {
    let metadata = WorkerMetadata {
        // Each copy of the control plane its own worker name (`sbx-control-<name>`): the
        // engine closes a second worker of one name in a namespace for good, and a copy that
        // takes the lease must register while a stopped (not dead) one is still connected.
        name: match ctl.role.name() {
            "" => WORKER_NAME.to_string(),
            n => format!("{WORKER_NAME}-{n}"),
        },
        version: env!("CARGO_PKG_VERSION").to_string(),
        description: Some(
            "sbx control plane: the fleet's sandbox::* functions, routed to its nodes".to_string(),
        ),
        ..WorkerMetadata::default()
    };
    let otel = iii_helpers::observability::OtelConfig {
        enabled: Some(
            std::env::var("OTEL_ENABLED").is_ok_and(|v| matches!(v.as_str(), "1" | "true")),
        ),
        ..Default::default()
    };
    let worker = register_worker(
        url,
        InitOptions {
            metadata: Some(metadata),
            otel: Some(otel),
            ..InitOptions::default()
        },
    );
    let rt = tokio::runtime::Handle::current();
    for id in FUNCTIONS {
        let (ctl, rt) = (ctl.clone(), rt.clone());
        let handler = move |data: Value| {
            let (ctl, rt) = (ctl.clone(), rt.clone());
            async move { serve_one(rt, ctl, id, data).await }
        };
        let (request, response) = schemas(id);
        worker.register_function(
            id,
            RegisterFunction::new_async(handler)
                .description(describe(id))
                .request_format(request)
                .response_format(response),
        );
    }
    tracing::info!(%url, functions = FUNCTIONS.len(), "iii worker: connecting to the engine (default namespace)");
    worker
}

/// One invocation, run on the control plane's runtime.
async fn serve_one(
    rt: tokio::runtime::Handle,
    ctl: Arc<Ctl>,
    id: &'static str,
    data: Value,
) -> Result<Value, Error> {
    let rid = sbx_api::ids::new_request_id();
    let inv = iii_sdk::current_invocation()
        .map(|c| c.invocation_id.to_string())
        .unwrap_or_default();
    tracing::info!(request_id = %rid, invocation = %inv, function = %id, "iii invocation");
    let r = rt
        .spawn(async move {
            invoke(&ctl, &rid, id, data).await.inspect_err(|e| {
                tracing::info!(request_id = %rid, function = %id, code = e.code.code, message = %e.message, "function failed");
            })
        })
        .await;
    let e = match r {
        Ok(Ok(v)) => return Ok(v),
        Ok(Err(e)) => e,
        Err(_) => FnError::new("S300", "the function's task ended"),
    };
    Err(Error::Remote {
        code: e.code.code.to_string(),
        message: error_body(&e).to_string(),
        stacktrace: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => Map::new(),
        }
    }

    fn row(node: &str, epoch: i64) -> SandboxRow {
        SandboxRow {
            id: "sbx-1".into(),
            name: None,
            node_id: node.into(),
            epoch,
            status: "running".into(),
            build: "b".into(),
            created_at_ms: 0,
            updated_at_ms: 0,
        }
    }

    /// A node row (built from JSON: the fields the table gains later keep their defaults).
    fn node(id: &str, name: &str) -> NodeRow {
        serde_json::from_value(json!({
            "id": id,
            "name": name,
            "url": format!("http://{name}"),
            "state": "ready",
            "lease_until_ms": 0,
            "build": "b",
            "capacity": {"max_sandboxes": 4, "sandboxes": 0, "images": []},
            "registered_at_ms": 0,
            "heartbeat_at_ms": 0,
        }))
        .expect("a node row")
    }

    #[test]
    fn every_function_has_a_route() {
        for f in FUNCTIONS {
            assert_ne!(route(f, &Map::new()), Route::Unknown, "{f}");
        }
        assert_eq!(
            route("sandbox::create", &Map::new()),
            Route::Place { made: true }
        );
        assert_eq!(
            route("sandbox::run", &Map::new()),
            Route::Place { made: false }
        );
        for keep in [json!(true), json!("true")] {
            assert_eq!(
                route("sandbox::run", &m(json!({ "keep_sandbox": keep }))),
                Route::Place { made: true }
            );
        }
        assert_eq!(
            route("sandbox::run", &m(json!({"keep_sandbox": "false"}))),
            Route::Place { made: false }
        );
        assert_eq!(route("sandbox::exec", &Map::new()), Route::Sandbox);
        assert_eq!(route("sandbox::stop", &Map::new()), Route::Sandbox);
        assert_eq!(route("sandbox::fs::read", &Map::new()), Route::Sandbox);
        assert_eq!(route("sandbox::list", &Map::new()), Route::List);
        assert_eq!(route("sandbox::catalog::list", &Map::new()), Route::Catalog);
        assert_eq!(route("sandbox::adapter::info", &Map::new()), Route::Info);
        assert_eq!(route("sandbox::fs::bogus", &Map::new()), Route::Unknown);
        assert_eq!(route("other::fn", &Map::new()), Route::Unknown);
    }

    #[test]
    fn errors_keep_the_nodes_s_code_and_map_the_control_planes() {
        let e = error_of(
            422,
            &json!({"error": {"code": "S211", "type": "filesystem", "message": "no /x"}}),
        );
        assert_eq!((e.code.code, e.message.as_str()), ("S211", "no /x"));
        // The control plane's own refusals (the HTTP API's body).
        let e = error_of(
            503,
            &json!({"error": {"code": "no_capacity", "message": "full"}}),
        );
        assert_eq!(e.code.code, "S400");
        let e = error_of(
            503,
            &json!({"error": {"code": "unavailable", "message": "away"}}),
        );
        assert_eq!(e.code.code, "S301");
        assert!(e.code.retryable);
        let e = error_of(
            409,
            &json!({"error": {"code": "name_taken", "message": "taken", "param": "name"}}),
        );
        assert_eq!(e.code.code, "S001");
        let e = error_of(
            404,
            &json!({"error": {"code": "sandbox_not_found", "message": "no"}}),
        );
        assert_eq!(e.code.code, "S002");
        // No body the control plane knows: a 5xx is the node away, else the adapter failed.
        assert_eq!(error_of(502, &Value::Null).code.code, "S301");
    }

    #[test]
    fn a_refused_call_is_sent_again_only_when_the_table_moved_the_sandbox() {
        let before = row("nod-a", 1);
        // The table has it where it was: the refusal is the answer.
        assert!(!sent_again("S002", &before, Some(&row("nod-a", 1)), false));
        // Moved to another node (or the same at a later epoch): once more.
        assert!(sent_again("S002", &before, Some(&row("nod-b", 2)), false));
        assert!(sent_again("S004", &before, Some(&row("nod-a", 3)), false));
        assert!(sent_again("S001", &before, Some(&row("nod-a", 1)), true));
        // A refusal of the call itself (a timeout, a file error) is never sent again.
        assert!(!sent_again("S200", &before, Some(&row("nod-b", 2)), true));
        assert!(!sent_again("S211", &before, Some(&row("nod-b", 2)), false));
        // Gone from the table: not sent again (the next lookup says S002).
        assert!(!sent_again("S002", &before, None, false));
    }

    #[test]
    fn lists_merge_with_node_and_epoch() {
        let (a, b) = (node("nod-a", "a"), node("nod-b", "b"));
        let mut lost = node("nod-c", "c");
        lost.state = NodeState::Lost;
        let epochs = BTreeMap::from([("sbx-1".to_string(), 4)]);
        let v = merge_lists(
            vec![
                (
                    a,
                    json!({"sandboxes": [{"sandbox_id": "sbx-1", "age_secs": 5}]}),
                ),
                (
                    b,
                    json!({"sandboxes": [{"sandbox_id": "sbx-2", "age_secs": 9}]}),
                ),
            ],
            &epochs,
            &[lost],
        );
        let rows = v["sandboxes"].as_array().cloned().unwrap_or_default();
        assert_eq!(rows.len(), 2, "{v}");
        assert_eq!(rows[0]["sandbox_id"], "sbx-2", "oldest first: {v}");
        assert_eq!(rows[0]["node"]["name"], "b");
        assert_eq!(rows[0]["epoch"], Value::Null);
        assert_eq!(rows[1]["node"]["id"], "nod-a");
        assert_eq!(rows[1]["epoch"], 4);
        assert_eq!(v["missing_nodes"][0]["name"], "c", "{v}");
        let v = merge_lists(Vec::new(), &epochs, &[]);
        assert_eq!(v, json!({"sandboxes": []}));
    }

    #[test]
    fn the_fleets_info_is_over_a_nodes() {
        let v = fleet_info(
            Some(
                json!({"name": "sbx", "driver": "linux", "max_exec_timeout_ms": 5, "max_sandboxes": 2}),
            ),
            8,
            vec![json!({"id": "nod-a"})],
        );
        assert_eq!(v["contract"], CONTRACT);
        assert_eq!(v["info"]["driver"], "linux");
        assert_eq!(v["info"]["max_exec_timeout_ms"], 5);
        assert_eq!(v["info"]["max_sandboxes"], 8);
        assert_eq!(v["info"]["functions"].as_array().map(Vec::len), Some(17));
        assert_eq!(v["info"]["nodes"][0]["id"], "nod-a");
        let v = fleet_info(None, 0, Vec::new());
        assert_eq!(v["info"]["name"], "sbx");
        assert!(v["info"].get("driver").is_none());
    }

    #[test]
    fn sandbox_keys_are_checked() {
        assert_eq!(
            sandbox_key(&m(json!({"sandbox_id": " web "})))
                .ok()
                .as_deref(),
            Some("web")
        );
        assert_eq!(
            sandbox_key(&Map::new()).map_err(|e| e.code.code),
            Err("S001")
        );
        assert_eq!(
            sandbox_key(&m(json!({"sandbox_id": [1]}))).map_err(|e| e.code.code),
            Err("S001")
        );
    }
}
