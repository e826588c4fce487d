//! `POST /sandboxes/{id}/fork {timeout, count}`: the node's fork (a snapshot of the running
//! sandbox, which runs on, and `count` sandboxes made from it), each fork given its own end
//! (`timeout` seconds from now, E2B's 15 by default). The snapshot a fork takes is the fork's
//! own: it goes once the forks are made (they are their own machines). 201 with one result per
//! fork, `{sandbox}` or `{error: {code, message}}`.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{
    api_error, find, not_served_yet, parse_body, sandbox_json, set_end, St, DEFAULT_TIMEOUT_S,
};
use crate::e2b_error;

#[derive(Debug, Deserialize)]
struct ForkBody {
    timeout: Option<u64>,
    count: Option<u32>,
}

pub(super) async fn fork(State(node): St, Path(id): Path<String>, body: Bytes) -> Response {
    if let Err(e) = node.checkpointer() {
        return not_served_yet(&format!("snapshots and forks of a sandbox ({})", e.message));
    }
    let b: ForkBody = match parse_body(&body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    // The node's fork decides how many one call makes (400 past its most).
    let count = b.count.unwrap_or(1);
    let timeout = b.timeout.unwrap_or(DEFAULT_TIMEOUT_S);
    if timeout == 0 {
        return e2b_error(StatusCode::BAD_REQUEST, "timeout must be at least 1 second");
    }
    let o = match find(&node, &id) {
        Ok(o) => o,
        Err(r) => return r,
    };
    let in_use = match super::snapshots::in_use(&node, &o.id).await {
        Ok(h) => h,
        Err(r) => return r,
    };
    let forked = node.fork_sandbox(&o.id, count).await;
    drop(in_use);
    let (snap, forks) = match forked {
        Ok(x) => x,
        Err(e) => return api_error(e),
    };
    let mut results: Vec<Value> = Vec::with_capacity(forks.len());
    for f in &forks {
        match set_end(&node, f, timeout, false) {
            Ok(()) => results.push(json!({ "sandbox": sandbox_json(&node, f) })),
            Err(r) => {
                // A fork without its end would outlive what the caller asked: it goes.
                let _ = node.delete_sandbox(&f.id).await;
                let status = r.status().as_u16();
                results.push(json!({ "error": {
                    "code": status,
                    "message": format!("the fork's timeout could not be set (status {status})"),
                }}));
            }
        }
    }
    if let Err(e) = node.delete_snapshot(&snap.id).await {
        tracing::warn!(snapshot = %snap.id, error = %e.message, "a fork's snapshot not deleted");
    }
    (StatusCode::CREATED, Json(Value::Array(results))).into_response()
}
