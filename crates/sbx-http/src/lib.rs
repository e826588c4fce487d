//! The HTTP edge: the node's API over axum. Each resource's routes parse a request into typed
//! values, call the node (`crate::node`), and answer; `router.rs` is the one table of routes;
//! `edge.rs` checks every request (where it comes from, its key, its body's type);
//! `openapi.rs` serves the API's document, which its tests hold to the routes.

#![forbid(unsafe_code)]

use sbx_front::guard;
use sbx_functions as functions;
use sbx_node::{agent, image, node, store};

mod checkpoints;
mod edge;
pub mod files;
pub mod function_routes;
mod images;
mod node_routes;
#[cfg(test)]
mod node_tests;
mod openapi;
mod router;
mod run;
mod sandboxes;
mod secrets;
mod sse;
mod terminal;
mod volumes;

use std::collections::HashSet;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use sbx_api::{ApiError, ErrorCode};

use crate::node::Node;

pub use crate::node::internal;
pub use crate::node::output::{ExecMeta, Started};
pub use edge::accepts_event_stream;
pub use router::router;
pub use sbx_front::held::hold_while_sent;
pub use sse::{event_stream, event_stream_answer};

/// The most a request body may hold.
pub const MAX_BODY: usize = 64 << 20;

/// The id of a request (its `X-Request-Id`, or a new one), set by the edge for every route.
#[derive(Clone)]
pub struct RequestId(pub String);

pub struct AppState {
    pub node: Arc<Node>,
    pub api_keys: Option<HashSet<String>>,
    pub docs_url: Option<String>,
    /// Origins (`scheme://host[:port]`, lowercase) that `--cors-origin` allows besides the
    /// node's own.
    pub cors_origins: Vec<String>,
}

pub fn error_response(err: &ApiError, request_id: &str, docs: Option<&str>) -> Response {
    let status = StatusCode::from_u16(err.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = sbx_api::error_body(err, request_id, docs);
    let mut resp = (status, axum::Json(body)).into_response();
    if err.retryable() && status == StatusCode::SERVICE_UNAVAILABLE {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    resp
}

pub async fn read_body(body: Body) -> Result<Bytes, ApiError> {
    use http_body_util::{BodyExt, Limited};
    match Limited::new(body, MAX_BODY).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e)
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(ApiError::new(
                ErrorCode::BodyTooLarge,
                "the request body is over 64 MiB",
            ))
        }
        Err(e) => Err(ApiError::new(
            ErrorCode::InvalidJson,
            format!("the body could not be read: {e}"),
        )),
    }
}
