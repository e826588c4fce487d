//! `/v1/volumes…`: create, list, get (by id or name), delete.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use sbx_api::VolumeObject;
use serde_json::{json, Value};

use crate::{read_body, AppState, HttpResult};

type St = State<Arc<AppState>>;

pub(super) async fn create(
    State(st): St,
    body: Body,
) -> HttpResult<(StatusCode, Json<VolumeObject>)> {
    let bytes = read_body(body).await?;
    let c = sbx_api::parse_volume_create(&bytes)?;
    let v = st.node.create_volume(c).await?;
    Ok((StatusCode::CREATED, Json(v)))
}

pub(super) async fn list(State(st): St) -> HttpResult<Json<Value>> {
    let data = st.node.list_volumes()?;
    Ok(Json(
        json!({ "object": "list", "data": data, "has_more": false }),
    ))
}

pub(super) async fn get_one(
    State(st): St,
    Path(id): Path<String>,
) -> HttpResult<Json<VolumeObject>> {
    Ok(Json(st.node.get_volume(&id)?))
}

pub(super) async fn delete(State(st): St, Path(id): Path<String>) -> HttpResult<StatusCode> {
    st.node.delete_volume(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}
