//! The functions interface: `sandbox::*` over `POST /v1/functions/{function_id}`
//! (`http/functions.rs`) and the iii worker (`iii.rs`), both through [`invoke`] (JSON in, JSON
//! out, errors as `{"error":{code,type,message,retryable,docs_url}}` with the S-codes of
//! [`sbx_api::functions`]).
//!
//! Every function is a thin translation onto the node's own actions, with typed values, never
//! a second implementation: `run` is `Node::plan_run` + `Node::run`; `create`, `exec`, `list`,
//! `stop` are `Node::create_sandbox`, `Node::exec`/`exec_get`, `Node::list_sandboxes`,
//! `Node::delete_sandbox` (the requests built by type and checked by the HTTP API's rules:
//! `RunRequest::check`, `ExecRequest::check`); the `fs::*` functions are `Node::fs_call`,
//! `fs_write`, `fs_read` with the file routes' own `FsParams` (sbx-api's), so that their
//! parameters and error codes are the same ones. What is only the interface's lives here: the config file's checks
//! (allowlist, custom images, sandbox cap, exec timeout cap), stopped ids (S004) and the idle
//! reaper.

#![forbid(unsafe_code)]

pub mod iii;

use sbx_node::{config, image, node, sync};

mod exec;
mod fs;
mod payload;
mod sandboxes;

use exec::*;
use fs::*;
use sandboxes::*;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use sbx_api::functions::{FnError, CONTRACT, DEFAULT_DOCS_BASE};
use serde_json::{json, Map, Value};

use crate::config::Config;
use crate::node::Node;
use crate::sync::LockExt;
use tracing::Instrument;

use payload::Payload;

/// What `sandbox::fs::read` answers inline.
const INLINE_MAX: u64 = 1 << 20;

const OUTPUT_CAP: usize = sbx_api::exec::EXEC_OUTPUT_TAIL_BYTES;

const PRESETS: [&str; 3] = ["python", "node", "base"];

const STOPPED_KEPT: usize = 10_000;

/// Every function served (the list lives in sbx-api, shared with the control plane).
pub use sbx_api::functions::FUNCTIONS;

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

/// The one entry point of the interface: a function id and its JSON payload (an object; null
/// is none) -> the reply, or the S-code error. `POST /v1/functions/{id}` and the iii worker
/// (iii.rs) both call it.
pub async fn invoke(
    node: &Arc<Node>,
    rid: &str,
    function_id: &str,
    payload: Value,
) -> Result<Value, FnError> {
    let payload = sbx_api::functions::call_payload(payload)?;
    let span = tracing::info_span!("function", request_id = %rid, function = %function_id);
    dispatch(node, &fns(), function_id, Payload(payload))
        .instrument(span)
        .await
}

/// The iii engine's metadata field on every object payload it forwards: the calling worker.
pub const CALLER_WORKER_ID: &str = "_caller_worker_id";

/// Takes out the fields an engine adds to a payload, names starting with `_` (the iii engine's
/// `_caller_worker_id` on every call, its queue bridges' `__traceparent` and `__baggage`), so
/// that no function reads them as its own; any other unknown field is still S001. Returns them.
pub fn take_engine_fields(payload: &mut Map<String, Value>) -> Map<String, Value> {
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
pub fn error_body(e: &FnError) -> Value {
    e.body(&fns().docs_base)
}

async fn dispatch(
    node: &Arc<Node>,
    f: &Arc<Fns>,
    function_id: &str,
    p: Payload,
) -> Result<Value, FnError> {
    match function_id {
        "sandbox::run" => run(node, f, p).await,
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
            let (id, image) = create(node, f, CreateArgs::of(node, &p)?).await?;
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
            let id = resolve(node, f, &p.req_str("sandbox_id")?)?;
            let _held = node.use_sandbox(&id).await.transpose()?;
            let req = exec_request(f, exec_argv(&p)?, &p)?;
            let (reply, timed_out, limit) = exec(node, f, &id, req).await?;
            if timed_out {
                return Err(FnError::new(
                    "S200",
                    format!(
                        "the command ran over its timeout_ms ({} ms)",
                        limit.as_millis()
                    ),
                ));
            }
            Ok(reply)
        }
        "sandbox::list" => {
            p.known(&[])?;
            Ok(list(node, f))
        }
        "sandbox::stop" => {
            p.known(&["sandbox_id", "wait"])?;
            let id = resolve(node, f, &p.req_str("sandbox_id")?)?;
            stop(node, f, &id, p.bool("wait")?.unwrap_or(true)).await?;
            Ok(json!({ "sandbox_id": id, "stopped": true }))
        }
        "sandbox::catalog::list" => {
            p.known(&[])?;
            Ok(catalog(node, f))
        }
        "sandbox::adapter::info" => {
            p.known(&[])?;
            Ok(json!({
                "contract": CONTRACT,
                "info": {
                    "name": "sbx",
                    "version": env!("CARGO_PKG_VERSION"),
                    "contract": CONTRACT,
                    "driver": node.driver_name(),
                    "functions": FUNCTIONS,
                    "max_concurrent_exec_per_sandbox": node.cfg.max_execs_per_sandbox,
                    "max_exec_timeout_ms": f.cfg.max_exec_timeout_ms,
                    "max_sandboxes": node.cfg.max_sandboxes,
                },
            }))
        }
        fs if fs.starts_with("sandbox::fs::") => {
            let id = resolve(node, f, &p.req_str("sandbox_id")?)?;
            let _held = node.use_sandbox(&id).await.transpose()?;
            f.touch(&id);
            let r = fs_call(node, &fs["sandbox::fs::".len()..], &id, p).await;
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
