//! `POST /v1/run`: parse, plan, then answer the run's events as one exec object or as an event
//! stream.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use sbx_api::{ApiError, ExecObject};

use tokio::sync::mpsc;

use super::sse::sse_response;
use super::*;
use crate::node::output::Collected;
use crate::node::RunEvent;

pub(super) async fn run(
    State(st): State<Arc<AppState>>,
    Extension(rid): Extension<RequestId>,
    headers: HeaderMap,
    body: Body,
) -> HttpResult<Response> {
    if let Some(key) = headers.get("idempotency-key") {
        sbx_api::validate_idempotency_key(key.to_str().unwrap_or(""))?;
    }
    let bytes = read_body(body).await?;
    let req = sbx_api::parse_run_request(&bytes)?;
    let wants_stream = req.stream.unwrap_or_else(|| accepts_event_stream(&headers));
    let plan = st.node.plan_run(req)?;
    let meta = plan.meta();
    tracing::info!(request_id = %rid.0, sandbox = %meta.sandbox_id, exec = %meta.exec_id, "run");
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(st.node.clone().run(plan, tx));
    if wants_stream {
        Ok(sse_response(rx, meta, rid.0, st.docs_url.clone()))
    } else {
        Ok(json_response(rx, meta).await?.into_response())
    }
}

/// The run's exec object once it has ended, or the error it failed with.
pub(super) async fn json_response(
    mut rx: mpsc::Receiver<RunEvent>,
    meta: ExecMeta,
) -> HttpResult<Json<ExecObject>> {
    let mut c = Collected::default();
    while let Some(ev) = rx.recv().await {
        if let Some(r) = c.take(&meta, ev) {
            return Ok(Json(r?));
        }
    }
    Err(ApiError::internal().into())
}
