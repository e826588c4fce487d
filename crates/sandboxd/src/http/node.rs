//! The node's own routes: health, what it holds, and the answers of unknown routes and methods.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use sbx_api::{ApiError, ErrorCode};

use super::*;

pub(super) async fn healthz() -> &'static str {
    "ok\n"
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
        "sandboxes": n.sandbox_count(),
        "teardowns": n.pending_teardowns(),
        "warm_pool": { "target": n.cfg.warm_pool, "ready": n.warm_ids() },
        "templates": n.template_objects(),
        "network": n.net.get().map(|net| net.info()),
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
