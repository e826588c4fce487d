//! The node's own routes: health, what it holds, and the answers of unknown routes and methods.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use sbx_api::{ApiError, ErrorCode};

use super::*;

/// 200 `ok` when the node can make a sandbox; else 503 `unavailable` (the error body, nothing
/// beside it) whose message names each failed check and its reason. The checks
/// (`node/health.rs`) run at most once a second; `GET /internal/node` lists them (`health`).
pub(super) async fn healthz(
    State(st): State<Arc<AppState>>,
    Extension(rid): Extension<RequestId>,
) -> Response {
    let node = st.node.clone();
    let health = match tokio::task::spawn_blocking(move || node.health()).await {
        Ok(h) => h,
        Err(e) => {
            tracing::error!(error = %e, "the health checks failed");
            return error_response(&ApiError::internal(), &rid.0, st.docs_url.as_deref());
        }
    };
    match health.reason() {
        None => "ok\n".into_response(),
        Some(reason) => error_response(
            &ApiError::new(
                ErrorCode::Unavailable,
                format!("the node cannot make sandboxes: {reason}"),
            ),
            &rid.0,
            st.docs_url.as_deref(),
        ),
    }
}

/// What the node is and holds: its driver, its shape limits, the warm pool.
pub(super) async fn node_info(State(st): State<Arc<AppState>>) -> Response {
    let n = &st.node;
    let disk = n.disk_info();
    axum::Json(serde_json::json!({
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
        "cgroups": n.driver.placement(),
        "health": health_info(&n.health()),
        "teardowns": n.pending_teardowns(),
        "warm_pool": {
            "target": n.cfg.warm_pool,
            "ready": n.warm_ids(),
            "making": n.warm_making(),
        },
        "templates": n.template_objects(),
        "network": n.net.as_ref().map(|net| net.info()),
        "checkpoints": n.checkpoints_info(),
        "disk_bytes": disk["disk_bytes"],
        "disk": disk["disk"],
        "volumes": disk["volumes"],
        "preview": n.preview().map(|p| serde_json::json!({
            "listen": p.listen.to_string(),
            "domain": p.domain,
            "tls": p.tls,
        })),
    }))
    .into_response()
}

fn health_info(h: &crate::node::health::Health) -> serde_json::Value {
    serde_json::json!({ "ok": h.ok(), "checks": h.checks })
}

pub(super) async fn not_found(
    State(st): State<Arc<AppState>>,
    Extension(rid): Extension<RequestId>,
) -> Response {
    error_response(
        &ApiError::new(ErrorCode::NotFound, "no such route"),
        &rid.0,
        st.docs_url.as_deref(),
    )
}

pub(super) async fn method_not_allowed(
    State(st): State<Arc<AppState>>,
    Extension(rid): Extension<RequestId>,
) -> Response {
    error_response(
        &ApiError::new(
            ErrorCode::MethodNotAllowed,
            "this route does not take that method",
        ),
        &rid.0,
        st.docs_url.as_deref(),
    )
}
