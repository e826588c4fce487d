//! `POST /v1/run`: parse, plan, then answer the run's events as one exec object or as an event
//! stream.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use sbx_api::ApiError;

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
) -> Response {
    let docs = st.docs_url.clone();
    let fail = |e: ApiError| error_response(&e, &rid.0, docs.as_deref());
    if let Some(key) = headers.get("idempotency-key") {
        let key = key.to_str().unwrap_or("");
        if let Err(e) = sbx_api::validate_idempotency_key(key) {
            return fail(e);
        }
    }
    let bytes = match read_body(body).await {
        Ok(b) => b,
        Err(e) => return fail(e),
    };
    let req = match sbx_api::parse_run_request(&bytes) {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    let wants_stream = req.stream.unwrap_or_else(|| accepts_event_stream(&headers));
    let plan = match st.node.plan_run(req) {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    let meta = plan.meta();
    tracing::info!(request_id = %rid.0, sandbox = %meta.sandbox_id, exec = %meta.exec_id, "run");
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(st.node.clone().run(plan, tx));
    if wants_stream {
        sse_response(rx, meta, rid.0, docs)
    } else {
        json_response(rx, meta, &rid.0, docs.as_deref()).await
    }
}

pub(super) async fn json_response(
    mut rx: mpsc::Receiver<RunEvent>,
    meta: ExecMeta,
    rid: &str,
    docs: Option<&str>,
) -> Response {
    let mut c = Collected::default();
    while let Some(ev) = rx.recv().await {
        match c.take(&meta, ev) {
            Some(Ok(obj)) => return (StatusCode::OK, axum::Json(obj)).into_response(),
            Some(Err(e)) => return error_response(&e, rid, docs),
            None => {}
        }
    }
    error_response(&ApiError::internal(), rid, docs)
}
