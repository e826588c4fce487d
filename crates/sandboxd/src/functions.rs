//! The functions interface: `POST /v1/functions/{function_id}` serves `sandbox::*` (JSON in,
//! JSON out, errors as `{"error":{code,type,message,retryable,docs_url}}` with the S-codes of
//! [`sbx_api::functions`]).
//!
//! Every function is a thin translation onto the HTTP API's own actions, never a second
//! implementation: `run` is `Node::plan_run` + `Node::run`; `create`, `exec`, `list`, `stop`
//! are `Node::create_sandbox`, `Node::exec`/`exec_get`, `Node::list_sandboxes`,
//! `Node::delete_sandbox`; the `fs::*` functions are dispatched in-process to the handlers of
//! `/v1/sandboxes/{id}/files…` (files.rs), so that their parameters, streaming and error codes
//! are the same ones. What is only the interface's lives here: the config file's checks
//! (allowlist, custom images, sandbox cap, exec timeout cap), stopped ids (S004) and the idle
//! reaper.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, Method, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use base64::Engine as _;
use sbx_api::functions::{FnError, CONTRACT, DEFAULT_DOCS_BASE};
use sbx_api::{ApiError, Encoding, ErrorCode, ExecObject, ExecStatus, SandboxStatus};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;
use tower::ServiceExt;

use crate::config::Config;
use crate::files;
use crate::http::{read_body, AppState, RequestId};
use crate::node::{Node, RunEvent};
use crate::sandboxes::ListQuery;
use crate::sync::LockExt;

/// What `sandbox::fs::read` answers inline.
const INLINE_MAX: u64 = 1 << 20;
const OUTPUT_CAP: usize = sbx_api::exec::EXEC_OUTPUT_TAIL_BYTES;
const PRESETS: [&str; 3] = ["python", "node", "base"];
const STOPPED_KEPT: usize = 10_000;

/// Every function served.
pub const FUNCTIONS: [&str; 17] = [
    "sandbox::run",
    "sandbox::create",
    "sandbox::exec",
    "sandbox::list",
    "sandbox::stop",
    "sandbox::catalog::list",
    "sandbox::fs::mkdir",
    "sandbox::fs::write",
    "sandbox::fs::ls",
    "sandbox::fs::stat",
    "sandbox::fs::read",
    "sandbox::fs::chmod",
    "sandbox::fs::grep",
    "sandbox::fs::sed",
    "sandbox::fs::mv",
    "sandbox::fs::rm",
    "sandbox::adapter::info",
];

struct Activity {
    last: Instant,
    idle: Option<Duration>,
    /// The image name the caller asked for (a custom image's own name).
    image: String,
}

/// The interface's own state: its config, when sandboxes were last used, stopped ids.
pub struct Fns {
    cfg: Config,
    docs_base: String,
    activity: Mutex<HashMap<String, Activity>>,
    stopped: Mutex<HashSet<String>>,
    create_lock: tokio::sync::Mutex<()>,
}

static FNS: OnceLock<Arc<Fns>> = OnceLock::new();

fn fns() -> Arc<Fns> {
    FNS.get_or_init(|| Arc::new(Fns::new(Config::default(), None)))
        .clone()
}

impl Fns {
    fn new(cfg: Config, docs_url: Option<String>) -> Fns {
        let docs_base = cfg
            .docs_base_url
            .clone()
            .or(docs_url)
            .unwrap_or_else(|| DEFAULT_DOCS_BASE.to_string());
        Fns {
            cfg,
            docs_base,
            activity: Mutex::new(HashMap::new()),
            stopped: Mutex::new(HashSet::new()),
            create_lock: tokio::sync::Mutex::new(()),
        }
    }

    fn touch(&self, id: &str) {
        if let Some(x) = self.activity.locked().get_mut(id) {
            x.last = Instant::now();
        }
    }

    fn mark_stopped(&self, id: &str) {
        self.activity.locked().remove(id);
        let mut s = self.stopped.locked();
        if s.len() >= STOPPED_KEPT {
            s.clear();
        }
        s.insert(id.to_string());
    }

    fn was_stopped(&self, id: &str) -> bool {
        self.stopped.locked().contains(id)
    }
}

/// Sets the interface's config and starts its idle reaper (call once, inside the runtime).
pub fn init(cfg: Config, docs_url: Option<String>, node: Arc<Node>) {
    let f = Arc::new(Fns::new(cfg, docs_url));
    let f = match FNS.set(f.clone()) {
        Ok(()) => f,
        Err(_) => fns(),
    };
    tokio::spawn(reaper(f, node));
}

/// Stops the sandboxes made by `sandbox::create` that were idle for their idle timeout (an
/// exec or a file operation through the interface is activity; a running exec keeps it).
async fn reaper(f: Arc<Fns>, node: Arc<Node>) {
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if node.is_stopping() {
            return;
        }
        let due: Vec<String> = f
            .activity
            .locked()
            .iter()
            .filter(|(id, x)| {
                x.idle.is_some_and(|idle| x.last.elapsed() >= idle) && node.running_execs(id) == 0
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in due {
            tracing::info!(sandbox = %id, "idle: stopping");
            f.mark_stopped(&id);
            let _ = node.delete_sandbox(&id).await;
        }
    }
}

pub fn routes() -> Router<Arc<AppState>> {
    Router::new().route("/v1/functions/{function_id}", post(call))
}

async fn call(
    State(st): State<Arc<AppState>>,
    Extension(rid): Extension<RequestId>,
    Path(function_id): Path<String>,
    body: Body,
) -> Response {
    let f = fns();
    let r = async {
        let bytes = read_body(body).await.map_err(FnError::from)?;
        let payload = if bytes.iter().all(u8::is_ascii_whitespace) {
            Value::Null
        } else {
            serde_json::from_slice::<Value>(&bytes)
                .map_err(|_| FnError::invalid("the payload is not a JSON object"))?
        };
        invoke(&st, &rid.0, &function_id, payload).await
    }
    .await;
    match r {
        Ok(v) => (StatusCode::OK, Json(v)).into_response(),
        Err(e) => {
            tracing::info!(request_id = %rid.0, function = %function_id, code = e.code.code, message = %e.message, "function failed");
            let status =
                StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let mut resp = (status, Json(json!({ "error": e.body(&f.docs_base) }))).into_response();
            if e.code.retryable {
                resp.headers_mut()
                    .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
            }
            resp
        }
    }
}

/// The one entry point of the interface: a function id and its JSON payload (an object; null
/// is none) -> the reply, or the S-code error. `POST /v1/functions/{id}` and the iii worker
/// (iii.rs) both call it.
pub(crate) async fn invoke(
    st: &Arc<AppState>,
    rid: &str,
    function_id: &str,
    payload: Value,
) -> Result<Value, FnError> {
    let mut payload = match payload {
        Value::Object(m) => m,
        Value::Null => Map::new(),
        _ => return Err(FnError::invalid("the payload is not a JSON object")),
    };
    take_engine_fields(&mut payload);
    dispatch(st, &fns(), rid, function_id, Payload(payload)).await
}

/// The iii engine's metadata field on every object payload it forwards: the calling worker.
pub(crate) const CALLER_WORKER_ID: &str = "_caller_worker_id";

/// Takes out the fields an engine adds to a payload, names starting with `_` (the iii engine's
/// `_caller_worker_id` on every call, its queue bridges' `__traceparent` and `__baggage`), so
/// that no function reads them as its own; any other unknown field is still S001. Returns them.
pub(crate) fn take_engine_fields(payload: &mut Map<String, Value>) -> Map<String, Value> {
    let keys: Vec<String> = payload
        .keys()
        .filter(|k| k.starts_with('_'))
        .cloned()
        .collect();
    keys.into_iter()
        .filter_map(|k| payload.remove_entry(&k))
        .collect()
}

/// An error's body, `{code, type, message, retryable, docs_url}`, with the interface's docs base.
pub(crate) fn error_body(e: &FnError) -> Value {
    e.body(&fns().docs_base)
}

async fn dispatch(
    st: &Arc<AppState>,
    f: &Arc<Fns>,
    rid: &str,
    function_id: &str,
    p: Payload,
) -> Result<Value, FnError> {
    match function_id {
        "sandbox::run" => run(st, f, rid, p).await,
        "sandbox::create" => {
            p.known(&[
                "image",
                "cpus",
                "memory_mb",
                "name",
                "network",
                "idle_timeout_secs",
                "env",
            ])?;
            let (id, image) = create(st, f, &p).await?;
            Ok(json!({ "sandbox_id": id, "image": image }))
        }
        "sandbox::exec" => {
            p.known(&[
                "sandbox_id",
                "cmd",
                "args",
                "argv",
                "stdin",
                "env",
                "timeout_ms",
                "workdir",
            ])?;
            let id = resolve(st, f, &p.req_str("sandbox_id")?)?;
            let argv = exec_argv(&p)?;
            let (reply, timed_out, limit) = exec(st, f, &id, argv, &p).await?;
            if timed_out {
                return Err(FnError::new(
                    "S200",
                    format!("the command ran over its timeout_ms ({limit} ms)"),
                ));
            }
            Ok(reply)
        }
        "sandbox::list" => {
            p.known(&[])?;
            Ok(list(st, f))
        }
        "sandbox::stop" => {
            p.known(&["sandbox_id", "wait"])?;
            let id = resolve(st, f, &p.req_str("sandbox_id")?)?;
            stop(st, f, &id, p.bool("wait")?.unwrap_or(true)).await?;
            Ok(json!({ "sandbox_id": id, "stopped": true }))
        }
        "sandbox::catalog::list" => {
            p.known(&[])?;
            Ok(catalog(st, f))
        }
        "sandbox::adapter::info" => {
            p.known(&[])?;
            Ok(json!({
                "contract": CONTRACT,
                "info": {
                    "name": "sbx",
                    "version": env!("CARGO_PKG_VERSION"),
                    "contract": CONTRACT,
                    "driver": st.node.driver_name(),
                    "functions": FUNCTIONS,
                    "max_concurrent_exec_per_sandbox": st.node.cfg.max_execs_per_sandbox,
                    "max_exec_timeout_ms": f.cfg.max_exec_timeout_ms,
                    "max_sandboxes": f.cfg.max_sandboxes,
                },
            }))
        }
        fs if fs.starts_with("sandbox::fs::") => {
            let id = resolve(st, f, &p.req_str("sandbox_id")?)?;
            f.touch(&id);
            let r = fs_call(st, rid, &fs["sandbox::fs::".len()..], &id, p).await;
            f.touch(&id);
            r
        }
        other => Err(FnError::new(
            "S304",
            format!(
                "no function {other} (this node serves: {})",
                FUNCTIONS.join(", ")
            ),
        )),
    }
}

// ---- payloads ----

struct Payload(Map<String, Value>);

impl Payload {
    fn known(&self, keys: &[&str]) -> Result<(), FnError> {
        match self.0.keys().find(|k| !keys.contains(&k.as_str())) {
            Some(k) => Err(FnError::invalid(format!(
                "this function takes no field {k}"
            ))),
            None => Ok(()),
        }
    }

    fn get(&self, k: &str) -> Option<&Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }

    fn str(&self, k: &str) -> Result<Option<String>, FnError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(Value::Number(n)) => Ok(Some(n.to_string())),
            Some(Value::Bool(b)) => Ok(Some(b.to_string())),
            Some(_) => Err(FnError::invalid(format!("{k} must be a string"))),
        }
    }

    fn req_str(&self, k: &str) -> Result<String, FnError> {
        match self.str(k)? {
            Some(s) if !s.is_empty() => Ok(s),
            _ => Err(FnError::invalid(format!("{k} is required"))),
        }
    }

    fn u64(&self, k: &str) -> Result<Option<u64>, FnError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Number(n)) if n.as_u64().is_some() => Ok(n.as_u64()),
            Some(Value::String(s)) if s.trim().parse::<u64>().is_ok() => {
                Ok(s.trim().parse::<u64>().ok())
            }
            Some(_) => Err(FnError::invalid(format!("{k} must be a whole number"))),
        }
    }

    fn bool(&self, k: &str) -> Result<Option<bool>, FnError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(Value::String(s)) if s == "true" || s == "false" => Ok(Some(s == "true")),
            Some(_) => Err(FnError::invalid(format!("{k} must be true or false"))),
        }
    }

    fn str_list(&self, k: &str) -> Result<Option<Vec<String>>, FnError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    Value::Number(n) => Ok(n.to_string()),
                    _ => Err(FnError::invalid(format!("{k} must be a list of strings"))),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(_) => Err(FnError::invalid(format!("{k} must be a list of strings"))),
        }
    }

    /// `env`: an object of strings, or a list of `K=V` (a single `K=V` string too).
    fn env(&self) -> Result<Option<BTreeMap<String, String>>, FnError> {
        let bad = || FnError::invalid("env must be an object or a list of K=V");
        let pair = |s: &str| -> Result<(String, String), FnError> {
            s.split_once('=')
                .filter(|(k, _)| !k.is_empty())
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .ok_or_else(bad)
        };
        match self.get("env") {
            None => Ok(None),
            Some(Value::Object(m)) => m
                .iter()
                .map(|(k, v)| match v {
                    Value::String(s) => Ok((k.clone(), s.clone())),
                    Value::Number(_) | Value::Bool(_) => Ok((k.clone(), v.to_string())),
                    _ => Err(bad()),
                })
                .collect::<Result<_, _>>()
                .map(Some),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_str().ok_or_else(bad).and_then(pair))
                .collect::<Result<_, _>>()
                .map(Some),
            Some(Value::String(s)) => Ok(Some([pair(s)?].into_iter().collect())),
            Some(_) => Err(bad()),
        }
    }
}

// ---- sandboxes ----

/// The sandbox's id (a name is taken too); S004 for one stopped, S002 for one never seen.
fn resolve(st: &AppState, f: &Fns, id: &str) -> Result<String, FnError> {
    let stopped = || {
        FnError::new(
            "S004",
            format!("the sandbox {id} is stopped; create a new one"),
        )
    };
    match st.node.managed(id) {
        // Stopped with wait: false, and not gone yet.
        Ok(m) if f.was_stopped(&m.id) => Err(stopped()),
        Ok(m) => Ok(m.id.clone()),
        Err(_) if f.was_stopped(id) => Err(stopped()),
        Err(e) => Err(e.into()),
    }
}

/// The local image an image name boots as: S100 when it is not allowed or not in the
/// catalog, S101 for a custom image with no local rootfs.
fn local_image(f: &Fns, name: &str) -> Result<String, FnError> {
    if !f.cfg.allowed(name) {
        return Err(FnError::new(
            "S100",
            format!("image {name} is not in this node's image_allowlist"),
        ));
    }
    if PRESETS.contains(&name) {
        return Ok(name.to_string());
    }
    match f.cfg.custom_images.iter().find(|c| c.name == name) {
        Some(c) => match &c.image {
            Some(local) if PRESETS.contains(&local.as_str()) => Ok(local.clone()),
            _ => Err(FnError::new(
                "S101",
                format!(
                    "image {name} ({}) has no rootfs on this node, and it pulls no images",
                    c.oci_ref
                ),
            )),
        },
        None => Err(FnError::new(
            "S100",
            format!("image {name} is not in the catalog (sandbox::catalog::list)"),
        )),
    }
}

fn sandboxes_now(node: &Node) -> usize {
    let q = ListQuery {
        limit: usize::MAX,
        ..ListQuery::default()
    };
    node.list_sandboxes(&q).0.len() + node.sandbox_count()
}

fn capacity(st: &AppState, f: &Fns) -> Result<(), FnError> {
    let n = sandboxes_now(&st.node);
    if n >= f.cfg.max_sandboxes {
        return Err(FnError::new(
            "S400",
            format!(
                "the node holds {n} sandboxes, its max_sandboxes ({})",
                f.cfg.max_sandboxes
            ),
        ));
    }
    Ok(())
}

async fn create(
    st: &Arc<AppState>,
    f: &Arc<Fns>,
    p: &Payload,
) -> Result<(String, String), FnError> {
    let image = p.req_str("image")?;
    let local = local_image(f, &image)?;
    if p.bool("network")? == Some(true) {
        return Err(FnError::new(
            "S304",
            "this node gives sandboxes no network (network: true)",
        ));
    }
    let mut body = Map::new();
    body.insert("image".into(), json!(local));
    let mut limits = Map::new();
    if let Some(c) = p.u64("cpus")? {
        limits.insert("vcpus".into(), json!(c));
    }
    if let Some(m) = p.u64("memory_mb")? {
        limits.insert("memory_bytes".into(), json!(m.saturating_mul(1 << 20)));
    }
    if !limits.is_empty() {
        body.insert("limits".into(), Value::Object(limits));
    }
    if let Some(n) = p.str("name")? {
        body.insert("name".into(), json!(n));
    }
    if let Some(env) = p.env()? {
        body.insert("env".into(), json!(env));
    }
    let idle = p
        .u64("idle_timeout_secs")?
        .unwrap_or(f.cfg.idle_timeout_secs);
    let spec =
        serde_json::to_vec(&Value::Object(body)).map_err(|_| FnError::new("S300", "json"))?;
    let req = sbx_api::parse_sandbox_create(&spec)?;
    let _one = f.create_lock.lock().await;
    capacity(st, f)?;
    let obj = st.node.create_sandbox(req).await?;
    if obj.status != SandboxStatus::Running {
        let why = obj.failure.clone().unwrap_or_default();
        let _ = st.node.delete_sandbox(&obj.id).await;
        return Err(FnError::new(
            "S300",
            format!("the sandbox did not boot: {why}"),
        ));
    }
    {
        let mut a = f.activity.locked();
        a.insert(
            obj.id.clone(),
            Activity {
                last: Instant::now(),
                idle: (idle > 0).then(|| Duration::from_secs(idle)),
                image: image.clone(),
            },
        );
    }
    Ok((obj.id, image))
}

async fn stop(st: &Arc<AppState>, f: &Arc<Fns>, id: &str, wait: bool) -> Result<(), FnError> {
    f.mark_stopped(id);
    if wait {
        st.node.delete_sandbox(id).await?;
    } else {
        let node = st.node.clone();
        let id = id.to_string();
        tokio::spawn(async move {
            let _ = node.delete_sandbox(&id).await;
        });
    }
    Ok(())
}

fn list(st: &AppState, f: &Fns) -> Value {
    let q = ListQuery {
        limit: usize::MAX,
        ..ListQuery::default()
    };
    let now = crate::image::now_ns();
    let max = st.node.cfg.max_execs_per_sandbox;
    let images: HashMap<String, String> = f
        .activity
        .locked()
        .iter()
        .map(|(k, v)| (k.clone(), v.image.clone()))
        .collect();
    let rows: Vec<Value> = st
        .node
        .list_sandboxes(&q)
        .0
        .into_iter()
        .map(|o| {
            let in_flight = st.node.running_execs(&o.id);
            let created = sbx_api::parse_rfc3339(&o.created_at).unwrap_or(now);
            json!({
                "sandbox_id": o.id,
                "name": o.name,
                "image": images.get(&o.id).cloned().unwrap_or(o.image),
                "age_secs": ((now - created).max(0) / 1_000_000_000) as u64,
                "exec_in_progress": in_flight > 0,
                "exec_in_flight": in_flight,
                "exec_slots_free": max.saturating_sub(in_flight),
                "stopped": !matches!(o.status, SandboxStatus::Running | SandboxStatus::Starting),
                "status": o.status.as_str(),
            })
        })
        .collect();
    json!({ "sandboxes": rows })
}

fn catalog(st: &AppState, f: &Fns) -> Value {
    let mut images = Vec::new();
    for name in PRESETS {
        if !f.cfg.allowed(name) {
            continue;
        }
        let oci_ref = st
            .node
            .images
            .resolve(Some(name))
            .map(|i| format!("local/{}", i.meta.name))
            .unwrap_or_default();
        images.push(json!({ "name": name, "oci_ref": oci_ref, "kind": "preset" }));
    }
    for c in &f.cfg.custom_images {
        if f.cfg.allowed(&c.name) {
            images.push(json!({ "name": c.name, "oci_ref": c.oci_ref, "kind": "custom" }));
        }
    }
    json!({ "images": images })
}

// ---- commands ----

/// The argv of `sandbox::exec`: `argv`, `cmd` + `args`, or `cmd` split at whitespace (not a
/// shell: no variables, quotes or pipes).
fn exec_argv(p: &Payload) -> Result<Vec<String>, FnError> {
    let argv = p.str_list("argv")?.unwrap_or_default();
    let args = p.str_list("args")?.unwrap_or_default();
    let cmd = p.str("cmd")?.unwrap_or_default();
    let out: Vec<String> = if !argv.is_empty() {
        if !cmd.is_empty() || !args.is_empty() {
            return Err(FnError::invalid("give argv, or cmd (and args), not both"));
        }
        argv
    } else if cmd.trim().is_empty() {
        return Err(FnError::invalid("cmd (or argv) is required"));
    } else if args.is_empty() {
        cmd.split_whitespace().map(String::from).collect()
    } else {
        std::iter::once(cmd).chain(args).collect()
    };
    Ok(out)
}

/// The argv that runs `code` in `lang`.
fn lang_argv(lang: &str, code: &str) -> Result<Vec<String>, FnError> {
    let (bin, flag) = match lang {
        "python" => ("python3", "-c"),
        "node" => ("node", "-e"),
        "shell" => ("sh", "-c"),
        path if path.starts_with('/') => {
            let base = path.rsplit('/').next().unwrap_or("");
            (path, if base.starts_with("node") { "-e" } else { "-c" })
        }
        other => {
            return Err(FnError::invalid(format!(
                "lang {other} is not node, python, shell or an interpreter's absolute path"
            )))
        }
    };
    Ok(vec![bin.to_string(), flag.to_string(), code.to_string()])
}

fn timeout_ms(f: &Fns, p: &Payload) -> Result<u64, FnError> {
    let max = f.cfg.max_exec_timeout_ms;
    match p.u64("timeout_ms")? {
        Some(0) => Err(FnError::invalid("timeout_ms must be over 0")),
        Some(t) => Ok(t.min(max)),
        None => Ok(max),
    }
}

fn truncation(obj: &ExecObject) -> (bool, bool) {
    let cap = OUTPUT_CAP as u64;
    let (o, e) = (obj.output.stdout_bytes > cap, obj.output.stderr_bytes > cap);
    if obj.truncated && !o && !e {
        // Bytes were dropped before the tails (a gap): which stream is not known.
        return (true, true);
    }
    (o, e)
}

/// Runs `argv` in sandbox `id` through `Node::exec` and waits for its end. Returns the reply,
/// whether it timed out, and its timeout.
async fn exec(
    st: &Arc<AppState>,
    f: &Arc<Fns>,
    id: &str,
    argv: Vec<String>,
    p: &Payload,
) -> Result<(Value, bool, u64), FnError> {
    let limit = timeout_ms(f, p)?;
    let mut body = Map::new();
    body.insert("command".into(), json!(argv));
    body.insert("timeout_seconds".into(), json!(limit as f64 / 1000.0));
    let wait = (limit as f64 / 1000.0 + 5.0).min(sbx_api::sandbox::MAX_WAIT_SECONDS);
    body.insert("wait_seconds".into(), json!(wait));
    if let Some(env) = p.env()? {
        body.insert("env".into(), json!(env));
    }
    if let Some(w) = p.str("workdir")? {
        body.insert("cwd".into(), json!(w));
    }
    if let Some(s) = p.str("stdin")? {
        body.insert("stdin".into(), json!(s));
    }
    let bytes =
        serde_json::to_vec(&Value::Object(body)).map_err(|_| FnError::new("S300", "json"))?;
    let req = sbx_api::parse_exec_request(&bytes)?;
    f.touch(id);
    let r = st.node.exec(id, req, None).await;
    f.touch(id);
    let mut obj = r?;
    while obj.status == ExecStatus::Running {
        obj = st
            .node
            .exec_get(
                id,
                &obj.id,
                sbx_api::sandbox::MAX_WAIT_SECONDS,
                Encoding::Utf8,
            )
            .await?;
        f.touch(id);
    }
    let (so, se) = truncation(&obj);
    let timed_out = obj.status == ExecStatus::TimedOut;
    let exit_code = obj.exit_code.unwrap_or(-1);
    Ok((
        json!({
            "stdout": obj.stdout,
            "stderr": obj.stderr,
            "exit_code": exit_code,
            "timed_out": timed_out,
            "duration_ms": (obj.duration_seconds.unwrap_or(0.0) * 1000.0).round() as u64,
            "success": exit_code == 0 && !timed_out,
            "stdout_truncated": so,
            "stderr_truncated": se,
        }),
        timed_out,
        limit,
    ))
}

/// One stream's last [`OUTPUT_CAP`] bytes.
#[derive(Default)]
struct Capped {
    buf: Vec<u8>,
    total: u64,
}

impl Capped {
    fn push(&mut self, d: &[u8]) {
        self.total += d.len() as u64;
        self.buf.extend_from_slice(d);
        if self.buf.len() > 2 * OUTPUT_CAP {
            let over = self.buf.len() - OUTPUT_CAP;
            self.buf.drain(..over);
        }
    }
    fn text(&self) -> String {
        let from = self.buf.len().saturating_sub(OUTPUT_CAP);
        let mut s = &self.buf[from..];
        if from > 0 {
            let skip = s
                .iter()
                .take(3)
                .take_while(|b| (**b & 0xC0) == 0x80)
                .count();
            s = &s[skip..];
        }
        String::from_utf8_lossy(s).into_owned()
    }
    fn truncated(&self) -> bool {
        self.total > OUTPUT_CAP as u64
    }
}

async fn run(st: &Arc<AppState>, f: &Arc<Fns>, rid: &str, p: Payload) -> Result<Value, FnError> {
    p.known(&[
        "image",
        "lang",
        "code",
        "files",
        "env",
        "stdin",
        "timeout_ms",
        "keep_sandbox",
    ])?;
    let image = p.req_str("image")?;
    let local = local_image(f, &image)?;
    let argv = lang_argv(&p.req_str("lang")?, &p.req_str("code")?)?;
    let keep = p.bool("keep_sandbox")?.unwrap_or(false);
    let files = match p.get("files") {
        None => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(Value::Object(m)) => m
            .iter()
            .map(|(k, v)| json!({ "path": k, "content": v }))
            .collect(),
        Some(_) => return Err(FnError::invalid("files must be a list of {path, content}")),
    };
    if keep || !files.is_empty() {
        return run_kept(st, f, rid, &p, &image, argv, files, keep).await;
    }
    let limit = timeout_ms(f, &p)?;
    let mut body = Map::new();
    body.insert("image".into(), json!(local));
    body.insert("command".into(), json!(argv));
    body.insert("timeout_seconds".into(), json!(limit as f64 / 1000.0));
    if let Some(env) = p.env()? {
        body.insert("env".into(), json!(env));
    }
    if let Some(s) = p.str("stdin")? {
        body.insert("stdin".into(), json!(s));
    }
    let req = sbx_api::parse_run_value(&Value::Object(body))?;
    capacity(st, f)?;
    let plan = st.node.plan_run(req)?;
    let (tx, mut rx) = mpsc::channel(64);
    tokio::spawn(st.node.clone().run(plan, tx));
    let (mut out, mut err) = (Capped::default(), Capped::default());
    let mut gap = false;
    while let Some(ev) = rx.recv().await {
        match ev {
            RunEvent::Started { .. } => {}
            RunEvent::Output { stream, data, .. } => match stream {
                sbx_proto::Stream::Stderr => err.push(&data),
                _ => out.push(&data),
            },
            RunEvent::Gap { .. } => gap = true,
            RunEvent::Exited { exit, .. } => {
                let timed_out = exit.status == sbx_proto::ExitStatus::TimedOut;
                return Ok(json!({
                    "stdout": out.text(),
                    "stderr": err.text(),
                    "exit_code": exit.exit_code,
                    "timed_out": timed_out,
                    "duration_ms": exit.duration_ns / 1_000_000,
                    "success": exit.exit_code == 0 && !timed_out,
                    "stdout_truncated": out.truncated() || gap,
                    "stderr_truncated": err.truncated() || gap,
                }));
            }
            RunEvent::Failed(e) => return Err(e.into()),
        }
    }
    Err(ApiError::internal().into())
}

/// `sandbox::run` with files or `keep_sandbox`: create, write the files, exec, stop (unless
/// kept).
#[allow(clippy::too_many_arguments)]
async fn run_kept(
    st: &Arc<AppState>,
    f: &Arc<Fns>,
    rid: &str,
    p: &Payload,
    image: &str,
    argv: Vec<String>,
    files: Vec<Value>,
    keep: bool,
) -> Result<Value, FnError> {
    let mut c = Map::new();
    c.insert("image".into(), json!(image));
    if let Some(env) = p.env()? {
        c.insert("env".into(), json!(env));
    }
    let (id, _) = create(st, f, &Payload(c)).await?;
    let r = async {
        for file in files {
            let Value::Object(mut m) = file else {
                return Err(FnError::invalid("files must be a list of {path, content}"));
            };
            m.insert("sandbox_id".into(), json!(id));
            m.entry("parents").or_insert(json!(true));
            fs_call(st, rid, "write", &id, Payload(m)).await?;
        }
        let mut e = Map::new();
        for k in ["stdin", "timeout_ms"] {
            if let Some(v) = p.get(k) {
                e.insert(k.into(), v.clone());
            }
        }
        exec(st, f, &id, argv, &Payload(e)).await
    }
    .await;
    if !keep || r.is_err() {
        let _ = stop(st, f, &id, false).await;
    }
    let (mut reply, _, _) = r?;
    if keep {
        reply["sandbox_id"] = json!(id);
    }
    Ok(reply)
}

// ---- files: the handlers of /v1/sandboxes/{id}/files… ----

fn pct(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            o.push(b as char);
        } else {
            o.push_str(&format!("%{b:02X}"));
        }
    }
    o
}

/// Calls a route of files.rs in-process; an error answer becomes its S-code.
#[allow(clippy::too_many_arguments)]
async fn files_route(
    st: &Arc<AppState>,
    rid: &str,
    method: Method,
    id: &str,
    sub: &str,
    query: &[(&str, String)],
    headers: &[(header::HeaderName, String)],
    body: Body,
) -> Result<(StatusCode, axum::http::HeaderMap, Bytes), FnError> {
    let mut uri = format!("/v1/sandboxes/{}/files{sub}", pct(id).replace('/', "%2F"));
    let q: Vec<String> = query
        .iter()
        .map(|(k, v)| format!("{k}={}", pct(v).replace('/', "%2F")))
        .collect();
    if !q.is_empty() {
        uri = format!("{uri}?{}", q.join("&"));
    }
    let mut b = Request::builder().method(method).uri(uri);
    for (k, v) in headers {
        b = b.header(k, v);
    }
    let mut req = b
        .body(body)
        .map_err(|e| FnError::invalid(format!("bad request: {e}")))?;
    req.extensions_mut().insert(RequestId(rid.to_string()));
    let resp = crate::files::routes()
        .with_state(st.clone())
        .oneshot(req)
        .await
        .map_err(|_| FnError::from(ApiError::internal()))?;
    let (parts, body) = resp.into_parts();
    let bytes = axum::body::to_bytes(body, 2 * INLINE_MAX as usize + 4096)
        .await
        .map_err(|e| FnError::new("S218", format!("the file's bytes broke off: {e}")))?;
    if parts.status.is_client_error() || parts.status.is_server_error() {
        if parts.status == StatusCode::RANGE_NOT_SATISFIABLE {
            return Ok((parts.status, parts.headers, bytes));
        }
        let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        let e = &v["error"];
        let code = e["code"]
            .as_str()
            .and_then(ErrorCode::from_code)
            .unwrap_or(ErrorCode::Internal);
        let mut err = ApiError::new(code, e["message"].as_str().unwrap_or("failed"));
        err.param = e["param"].as_str().map(String::from);
        return Err(err.into());
    }
    Ok((parts.status, parts.headers, bytes))
}

fn body_json(bytes: &Bytes) -> Value {
    serde_json::from_slice(bytes).unwrap_or(Value::Null)
}

async fn fs_call(
    st: &Arc<AppState>,
    rid: &str,
    op: &str,
    id: &str,
    p: Payload,
) -> Result<Value, FnError> {
    let mut rest = p.0.clone();
    rest.remove("sandbox_id");
    let post = |sub: &'static str, keys: &'static [&'static str], rest: Map<String, Value>| {
        let p = Payload(rest.clone());
        async move {
            p.known(keys)?;
            let body = serde_json::to_vec(&Value::Object(rest)).unwrap_or_default();
            let (_, _, b) =
                files_route(st, rid, Method::POST, id, sub, &[], &[], Body::from(body)).await?;
            Ok::<Value, FnError>(body_json(&b))
        }
    };
    match op {
        "mkdir" => post("/mkdir", files::MKDIR_FIELDS, rest).await,
        "rm" => post("/rm", files::RM_FIELDS, rest).await,
        "chmod" => post("/chmod", files::CHMOD_FIELDS, rest).await,
        "grep" => post("/grep", files::GREP_FIELDS, rest).await,
        "sed" => post("/sed", files::SED_FIELDS, rest).await,
        "mv" => {
            let q = Payload(rest);
            q.known(&["src", "dst", "overwrite"])?;
            let mut m = Map::new();
            m.insert("path".into(), json!(q.req_str("src")?));
            m.insert("dst".into(), json!(q.req_str("dst")?));
            if let Some(o) = q.bool("overwrite")? {
                m.insert("overwrite".into(), json!(o));
            }
            post("/mv", &["path", "dst", "overwrite"], m).await
        }
        "ls" | "stat" => {
            let q = Payload(rest);
            let mut query = vec![("path", q.req_str("path")?)];
            if op == "ls" {
                q.known(&["path", "limit"])?;
                if let Some(l) = q.u64("limit")? {
                    query.push(("limit", l.to_string()));
                }
            } else {
                q.known(&["path"])?;
            }
            let sub = if op == "ls" { "/list" } else { "/stat" };
            let (_, _, b) =
                files_route(st, rid, Method::GET, id, sub, &query, &[], Body::empty()).await?;
            Ok(body_json(&b))
        }
        "write" => {
            let q = Payload(rest);
            q.known(&["path", "content", "content_b64", "mode", "parents", "owner"])?;
            let bytes = match (q.get("content"), q.str("content_b64")?) {
                (Some(_), Some(_)) => {
                    return Err(FnError::invalid("give content or content_b64, not both"))
                }
                (Some(Value::String(s)), None) => s.clone().into_bytes(),
                (Some(v), None) => v.to_string().into_bytes(),
                (None, Some(b)) => base64::engine::general_purpose::STANDARD
                    .decode(b.trim())
                    .map_err(|_| FnError::invalid("content_b64 is not base64"))?,
                (None, None) => return Err(FnError::invalid("content or content_b64 is required")),
            };
            let mut query = vec![("path", q.req_str("path")?)];
            if let Some(m) = q.str("mode")? {
                query.push(("mode", m));
            }
            if let Some(pa) = q.bool("parents")? {
                query.push(("parents", pa.to_string()));
            }
            if let Some(o) = q.str("owner")? {
                query.push(("owner", o));
            }
            let (_, _, b) =
                files_route(st, rid, Method::PUT, id, "", &query, &[], Body::from(bytes)).await?;
            Ok(body_json(&b))
        }
        "read" => {
            let q = Payload(rest);
            q.known(&["path"])?;
            let path = q.req_str("path")?;
            let range = (header::RANGE, format!("bytes=0-{INLINE_MAX}"));
            let (status, headers, b) = files_route(
                st,
                rid,
                Method::GET,
                id,
                "",
                &[("path", path.clone())],
                &[range],
                Body::empty(),
            )
            .await?;
            let size = headers
                .get(header::CONTENT_RANGE)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.rsplit('/').next())
                .and_then(|s| s.parse::<u64>().ok())
                .unwrap_or(b.len() as u64);
            let bytes: &[u8] = if status == StatusCode::RANGE_NOT_SATISFIABLE {
                &[]
            } else {
                &b
            };
            let mut reply = json!({
                "path": path,
                "size": size,
                "content": {
                    "method": "GET",
                    "url": format!("/v1/sandboxes/{}/files?path={}", pct(id), pct(&path)),
                },
            });
            if size <= INLINE_MAX {
                match std::str::from_utf8(bytes) {
                    Ok(s) => reply["body"] = json!(s),
                    Err(_) => {
                        reply["content_b64"] =
                            json!(base64::engine::general_purpose::STANDARD.encode(bytes))
                    }
                }
            }
            Ok(reply)
        }
        other => Err(FnError::new(
            "S304",
            format!("no function sandbox::fs::{other}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_fields_are_taken_out_and_the_callers_stay() {
        let Value::Object(mut m) = json!({
            "_caller_worker_id": "w-1",
            "__traceparent": "00-abc-def-01",
            "__baggage": "k=v",
            "image": "python",
            "bogus": 1,
        }) else {
            unreachable!()
        };
        let taken = take_engine_fields(&mut m);
        assert_eq!(taken.len(), 3, "{taken:?}");
        assert_eq!(taken[CALLER_WORKER_ID], "w-1");
        let p = Payload(m);
        // What a caller sent is still checked: an unknown field of its own is S001.
        let e = p.known(&["image"]).unwrap_err();
        assert_eq!(e.code.code, "S001");
        assert!(e.message.contains("bogus"), "{}", e.message);
        assert!(p.known(&["image", "bogus"]).is_ok());
    }
}
