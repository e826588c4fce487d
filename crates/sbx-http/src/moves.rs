//! The old node's routes of a move between nodes (the control plane calls them):
//! `POST /internal/sandboxes/{id}/release` and `POST /internal/sandboxes/{id}/forget`. Bodies
//! are parsed strictly (`sbx_api::moves`), then the node acts (`move_out.rs`).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::Json;
use sbx_api::moves::{ForgetAnswer, ReleaseAnswer};

use crate::{read_body, AppState, HttpResult};

type St = State<Arc<AppState>>;

/// `POST /internal/sandboxes/{id}/release`.
pub(super) async fn release(
    State(st): St,
    Path(id): Path<String>,
    body: Body,
) -> HttpResult<Json<ReleaseAnswer>> {
    let bytes = read_body(body).await?;
    let r = sbx_api::moves::parse_release(&bytes)?;
    // On a task of its own: a caller that hangs up does not cut the release short midway.
    let node = st.node.clone();
    let task = tokio::spawn(async move { node.release_sandbox(&id, r).await });
    match task.await {
        Ok(answer) => Ok(Json(answer?)),
        Err(e) => {
            tracing::error!(error = %e, "a release's task failed");
            Err(sbx_api::ApiError::internal().into())
        }
    }
}

/// `POST /internal/sandboxes/{id}/forget`.
pub(super) async fn forget(
    State(st): St,
    Path(id): Path<String>,
    body: Body,
) -> HttpResult<Json<ForgetAnswer>> {
    let bytes = read_body(body).await?;
    let r = sbx_api::moves::parse_forget(&bytes)?;
    Ok(Json(st.node.forget_sandbox(&id, r).await?))
}
