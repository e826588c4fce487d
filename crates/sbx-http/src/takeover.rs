//! `POST /internal/sandboxes/{id}/takeover`: the new node's side of a move (the control plane
//! asks it). Parse, then call the node (`move_in.rs` of the core).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::Json;
use sbx_api::moves::TakeoverAnswer;

use crate::{read_body, AppState, HttpResult};

type St = State<Arc<AppState>>;

/// Makes sandbox `id` this node's at the request's epoch (from the old node's files on this
/// machine, or from the store), and wakes it if asked.
pub(super) async fn takeover(
    State(st): St,
    Path(id): Path<String>,
    body: Body,
) -> HttpResult<Json<TakeoverAnswer>> {
    let bytes = read_body(body).await?;
    let r = sbx_api::moves::parse_takeover(&bytes)?;
    // On a task of its own: a caller that hangs up (a control plane killed mid-move) does not
    // cut the takeover short with its marker left; the same takeover asked again finds it
    // done, or under way.
    let node = st.node.clone();
    let task = tokio::spawn(async move { node.takeover_sandbox(&id, r).await });
    match task.await {
        Ok(answer) => Ok(Json(answer?)),
        Err(e) => {
            tracing::error!(error = %e, "a takeover's task failed");
            Err(sbx_api::ApiError::internal().into())
        }
    }
}
