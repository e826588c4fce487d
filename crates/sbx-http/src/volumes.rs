//! `/v1/volumes…`: create, list, get (by id or name), delete.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde_json::json;

use super::sandboxes::reply;
use crate::{read_body, AppState, RequestId};

type St = State<Arc<AppState>>;
type Rid = Extension<RequestId>;

pub(super) async fn create(State(st): St, Extension(rid): Rid, body: Body) -> Response {
    let r = async {
        let bytes = read_body(body).await?;
        let c = sbx_api::parse_volume_create(&bytes)?;
        st.node.create_volume(c).await
    }
    .await;
    reply(&st, &rid, StatusCode::CREATED, r)
}

pub(super) async fn list(State(st): St, Extension(rid): Rid) -> Response {
    let r = st
        .node
        .list_volumes()
        .map(|data| json!({ "object": "list", "data": data, "has_more": false }));
    reply(&st, &rid, StatusCode::OK, r)
}

pub(super) async fn get_one(
    State(st): St,
    Extension(rid): Rid,
    Path(id): Path<String>,
) -> Response {
    reply(&st, &rid, StatusCode::OK, st.node.get_volume(&id))
}

pub(super) async fn delete(State(st): St, Extension(rid): Rid, Path(id): Path<String>) -> Response {
    match st.node.delete_volume(&id).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => reply::<()>(&st, &rid, StatusCode::OK, Err(e)),
    }
}
