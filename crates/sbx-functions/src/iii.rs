//! The iii engine worker: with `--iii-url ws://HOST:PORT` (or the iii SDK's `III_URL`), the node
//! connects to an iii engine with the `iii-sdk` crate and registers every `sandbox::*` function
//! of the functions interface (`functions::FUNCTIONS`), each with its request and response JSON
//! schema, so `iii trigger sandbox::run image=python lang=python code='print(2+2)'` reaches it.
//! A node of a fleet registers them in the namespace `sbx-<node name>` (the control plane owns
//! the default namespace's, and routes them to the nodes: `sbx-control/src/functions.rs`); a
//! node standing alone in the default one.
//!
//! Nothing here implements a function: an invocation is handed to `functions::invoke`, the one
//! entry point `POST /v1/functions/{id}` uses too. The engine is the edge here (the node's API
//! keys are not asked for).
//!
//! The SDK speaks the engine protocol (WebSocket, JSON text frames, iii-sdk `src/protocol.rs`
//! `Message`): it sends `{"type":"registerfunction","id",…,"request_format","response_format"}`
//! per function, answers `{"type":"invokefunction","invocation_id","function_id","data"}` with
//! `{"type":"invocationresult","invocation_id","function_id","result"|"error"}`, and when the
//! connection drops it reconnects (every 2 s, `ConnTimings::retry_delay` in `src/iii.rs`) and
//! replays every registration. An error is the SDK's `ErrorBody {code, message}`: `code` is the
//! S-code and `message` the JSON text of the interface's whole error body
//! (`{code, type, message, retryable, docs_url}`), the way the SDK's `Error::Remote` carries a
//! structured error (iii-sdk `tests/error_wire.rs`).
//!
//! The SDK runs its connection and the handlers on a thread of its own (its own runtime); each
//! invocation is run on the node's runtime, where the node's tasks and sockets live.

use std::sync::Arc;

use iii_sdk::iii::WorkerMetadata;
use iii_sdk::{register_worker, Error, IIIClient, InitOptions, RegisterFunction};
use sbx_api::functions::{describe, schemas};
use serde_json::Value;

use crate as functions;
use crate::node::Node;
use crate::FUNCTIONS;

/// The engine namespace of a node of a fleet: `sbx-<node name>` (the control plane registers
/// `sandbox::*` in the default namespace and routes each call to a node; a node's own
/// functions are reached with the namespace named, e.g. `iii trigger -n sbx-a sandbox::exec`).
pub fn fleet_namespace(node_name: &str) -> String {
    format!("sbx-{node_name}")
}

/// Starts the worker (in the background: the SDK connects, and reconnects, on its own thread).
/// Call inside the node's runtime. `namespace`: the engine namespace its functions register in
/// (a node of a fleet: [`fleet_namespace`]); `None`: the engine's default, as a node standing
/// alone (or the SDK's `III_NAMESPACE`, as before).
pub fn start(url: &str, node: Arc<Node>, namespace: Option<String>) -> IIIClient {
    let metadata = WorkerMetadata {
        name: "sbx".to_string(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        description: Some("sbx node: the sandbox::* functions".to_string()),
        namespace: namespace.clone(),
        ..WorkerMetadata::default()
    };
    let otel = iii_helpers::observability::OtelConfig {
        // The node logs on its own; spans go to the engine only when asked for.
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
            namespace: namespace.clone(),
            ..InitOptions::default()
        },
    );
    let rt = tokio::runtime::Handle::current();
    for id in FUNCTIONS {
        let (node, rt) = (node.clone(), rt.clone());
        let handler = move |data: Value| {
            let (node, rt) = (node.clone(), rt.clone());
            async move { invoke(rt, node, id, data).await }
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
    let ns = namespace.as_deref().unwrap_or("default");
    tracing::info!(%url, namespace = %ns, functions = FUNCTIONS.len(), "iii worker: connecting to the engine");
    worker
}

/// One invocation, run on the node's runtime: the reply, or the S-code error.
async fn invoke(
    rt: tokio::runtime::Handle,
    node: Arc<Node>,
    id: &'static str,
    data: Value,
) -> Result<Value, Error> {
    let rid = iii_sdk::current_invocation()
        .map(|c| format!("iii-{}", c.invocation_id))
        .unwrap_or_else(|| "iii".to_string());
    // The engine names the calling worker in every object payload (functions::invoke drops
    // it with the engine's other `_` fields before the function reads the payload).
    let caller = data
        .get(functions::CALLER_WORKER_ID)
        .and_then(Value::as_str)
        .unwrap_or("-")
        .to_string();
    tracing::info!(request_id = %rid, function = %id, caller_worker_id = %caller, "iii invocation");
    let r = rt
        .spawn(async move {
            let r = functions::invoke(&node, &rid, id, data).await;
            r.map_err(|e| {
                tracing::info!(request_id = %rid, function = %id, caller_worker_id = %caller, code = e.code.code, message = %e.message, "function failed");
                (e.code.code, functions::error_body(&e))
            })
        })
        .await;
    let (code, body) = match r {
        Ok(Ok(v)) => return Ok(v),
        Ok(Err(e)) => e,
        Err(_) => {
            let e = sbx_api::functions::FnError::new("S300", "the function's task ended");
            (e.code.code, functions::error_body(&e))
        }
    };
    Err(Error::Remote {
        code: code.to_string(),
        message: body.to_string(),
        stacktrace: None,
    })
}
