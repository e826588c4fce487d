//! HTTP routes of sleep, wake, snapshots and forks. Parse, then call the node.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Extension;
use sbx_api::ApiError;
use serde_json::{json, Map, Value};

use super::sandboxes::reply;
use crate::{read_body, AppState, RequestId};

type St = State<Arc<AppState>>;
type Rid = Extension<RequestId>;

/// A JSON object body with only `known` keys (an empty body is `{}`).
async fn object_body(body: Body, known: &[&str]) -> Result<Map<String, Value>, ApiError> {
    let bytes = read_body(body).await?;
    if bytes.iter().all(|b| b.is_ascii_whitespace()) {
        return Ok(Map::new());
    }
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::new(
            sbx_api::ErrorCode::InvalidJson,
            format!("the body is not JSON: {e}"),
        )
    })?;
    let Value::Object(o) = v else {
        return Err(ApiError::new(
            sbx_api::ErrorCode::InvalidJson,
            "the body is not a JSON object",
        ));
    };
    if let Some(k) = o.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(ApiError::new(
            sbx_api::ErrorCode::UnknownField,
            format!("this call takes no field {k}"),
        )
        .with_param(k.as_str()));
    }
    Ok(o)
}

pub(super) async fn sleep(st: St, rid: Rid, id: Path<String>, body: Body) -> Response {
    sleep_or_wake(st, rid, id, body, false).await
}

pub(super) async fn wake(st: St, rid: Rid, id: Path<String>, body: Body) -> Response {
    sleep_or_wake(st, rid, id, body, true).await
}

async fn sleep_or_wake(
    State(st): St,
    Extension(rid): Rid,
    Path(id): Path<String>,
    body: Body,
    wake: bool,
) -> Response {
    let r = match object_body(body, &[]).await {
        Ok(_) if wake => st.node.wake_sandbox(&id).await,
        Ok(_) => st.node.sleep_sandbox(&id).await,
        Err(e) => Err(e),
    };
    reply(&st, &rid, StatusCode::OK, r)
}

pub(super) async fn snapshot(
    State(st): St,
    Extension(rid): Rid,
    Path(id): Path<String>,
    body: Body,
) -> Response {
    let r = async {
        let o = object_body(body, &["name"]).await?;
        let name = match o.get("name") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => return Err(ApiError::invalid_field("name", "name must be a string")),
        };
        st.node.snapshot_sandbox(&id, name).await
    }
    .await;
    reply(&st, &rid, StatusCode::CREATED, r)
}

pub(super) async fn fork(
    State(st): St,
    Extension(rid): Rid,
    Path(id): Path<String>,
    body: Body,
) -> Response {
    let r = async {
        let o = object_body(body, &["count"]).await?;
        let count = match o.get("count") {
            None | Some(Value::Null) => 1,
            Some(v) => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| ApiError::invalid_field("count", "count must be a whole number"))?,
        };
        let (snap, made) = st.node.fork_sandbox(&id, count).await?;
        Ok(json!({ "object": "fork", "snapshot": snap, "sandboxes": made }))
    }
    .await;
    reply(&st, &rid, StatusCode::CREATED, r)
}

pub(super) async fn list(State(st): St, Extension(rid): Rid) -> Response {
    let r = st
        .node
        .list_snapshots()
        .map(|data| json!({ "object": "list", "data": data, "has_more": false }));
    reply(&st, &rid, StatusCode::OK, r)
}

pub(super) async fn get_one(
    State(st): St,
    Extension(rid): Rid,
    Path(id): Path<String>,
) -> Response {
    reply(&st, &rid, StatusCode::OK, st.node.get_snapshot(&id))
}

pub(super) async fn delete(State(st): St, Extension(rid): Rid, Path(id): Path<String>) -> Response {
    let r = st.node.delete_snapshot(&id).await;
    reply(&st, &rid, StatusCode::OK, r)
}
