//! The node's own routes: health, what it holds, and the answers of unknown routes and methods.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use sbx_api::{ApiError, ErrorCode};

use super::*;

/// 200 `ok` when the node can make a sandbox; else 503 `unavailable` (the error body, nothing
/// beside it) whose message names each failed check and its reason. The checks
/// (`node/health.rs`) run at most once a second; `GET /internal/node` lists them (`health`).
pub(super) async fn healthz(State(st): State<Arc<AppState>>) -> HttpResult<&'static str> {
    let node = st.node.clone();
    let health = tokio::task::spawn_blocking(move || node.health())
        .await
        .map_err(|e| {
            tracing::error!(error = %e, "the health checks failed");
            ApiError::internal()
        })?;
    match health.reason() {
        None => Ok("ok\n"),
        Some(reason) => Err(ApiError::new(
            ErrorCode::Unavailable,
            format!("the node cannot make sandboxes: {reason}"),
        )
        .into()),
    }
}

/// What the node is and holds: its driver, its shape limits, the warm pool.
pub(super) async fn node_info(State(st): State<Arc<AppState>>) -> Json<serde_json::Value> {
    let n = &st.node;
    let disk = n.disk_info();
    Json(serde_json::json!({
        "object": "node",
        "driver": n.driver_name(),
        "max_vcpus": n.cfg.max_vcpus,
        "max_memory_bytes": n.cfg.max_memory_bytes,
        "default_vcpus": n.cfg.default_vcpus,
        "default_memory_bytes": n.cfg.default_memory_bytes,
        "pids_max": n.cfg.pids_max,
        "sandboxes": n.held_sandboxes(),
        "runs": n.sandbox_count(),
        "kept": n.kept_count(),
        "max_sandboxes": n.cfg.max_sandboxes,
        "capacity": n.capacity.as_ref(),
        "lease": n.lease_info(),
        "cgroups": n.cgroups_info(),
        "health": health_info(&n.health()),
        "teardowns": n.pending_teardowns(),
        "warm_pool": {
            "target": n.cfg.warm_pool,
            "runs_target": n.cfg.warm_runs,
            "ready": n.warm_ids(),
            "making": n.warm_making(),
        },
        "templates": n.template_objects(),
        "network": n.net_info(),
        "checkpoints": n.checkpoints_info(),
        "store": n.replicas_info(),
        "disk_bytes": disk.disk_bytes,
        "disk": disk.disk,
        "volumes": disk.volumes,
        "preview": n.preview().map(|p| serde_json::json!({
            "listen": p.listen.to_string(),
            "domain": p.domain,
            "tls": p.tls,
        })),
    }))
}

fn health_info(h: &crate::node::health::Health) -> serde_json::Value {
    serde_json::json!({ "ok": h.ok(), "checks": h.checks })
}

pub(super) async fn not_found() -> HttpError {
    ApiError::new(ErrorCode::NotFound, "no such route").into()
}

pub(super) async fn method_not_allowed() -> HttpError {
    ApiError::new(
        ErrorCode::MethodNotAllowed,
        "this route does not take that method",
    )
    .into()
}
