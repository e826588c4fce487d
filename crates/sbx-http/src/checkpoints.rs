//! HTTP routes of sleep, wake, snapshots and forks. Parse, then call the node.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use sbx_api::{ApiError, SandboxObject, SnapshotObject};
use serde_json::{json, Map, Value};

use crate::{read_body, AppState, HttpResult};

type St = State<Arc<AppState>>;

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

pub(super) async fn sleep(st: St, id: Path<String>, body: Body) -> HttpResult<Json<SandboxObject>> {
    sleep_or_wake(st, id, body, false).await
}

pub(super) async fn wake(st: St, id: Path<String>, body: Body) -> HttpResult<Json<SandboxObject>> {
    sleep_or_wake(st, id, body, true).await
}

async fn sleep_or_wake(
    State(st): St,
    Path(id): Path<String>,
    body: Body,
    wake: bool,
) -> HttpResult<Json<SandboxObject>> {
    object_body(body, &[]).await?;
    let o = if wake {
        st.node.wake_sandbox(&id).await?
    } else {
        st.node.sleep_sandbox(&id).await?
    };
    Ok(Json(o))
}

pub(super) async fn snapshot(
    State(st): St,
    Path(id): Path<String>,
    body: Body,
) -> HttpResult<(StatusCode, Json<SnapshotObject>)> {
    let o = object_body(body, &["name"]).await?;
    let name = match o.get("name") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(ApiError::invalid_field("name", "name must be a string").into()),
    };
    let snap = st.node.snapshot_sandbox(&id, name).await?;
    Ok((StatusCode::CREATED, Json(snap)))
}

pub(super) async fn fork(
    State(st): St,
    Path(id): Path<String>,
    body: Body,
) -> HttpResult<(StatusCode, Json<Value>)> {
    let o = object_body(body, &["count"]).await?;
    let count = match o.get("count") {
        None | Some(Value::Null) => 1,
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| ApiError::invalid_field("count", "count must be a whole number"))?,
    };
    let (snap, made) = st.node.fork_sandbox(&id, count).await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "object": "fork", "snapshot": snap, "sandboxes": made })),
    ))
}

pub(super) async fn list(State(st): St) -> HttpResult<Json<Value>> {
    let data = st.node.list_snapshots()?;
    Ok(Json(
        json!({ "object": "list", "data": data, "has_more": false }),
    ))
}

pub(super) async fn get_one(
    State(st): St,
    Path(id): Path<String>,
) -> HttpResult<Json<SnapshotObject>> {
    Ok(Json(st.node.get_snapshot(&id)?))
}

pub(super) async fn delete(
    State(st): St,
    Path(id): Path<String>,
) -> HttpResult<Json<SnapshotObject>> {
    Ok(Json(st.node.delete_snapshot(&id).await?))
}
