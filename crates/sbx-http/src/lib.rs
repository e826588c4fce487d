//! The HTTP edge: the node's API over axum. Each resource's routes parse a request into typed
//! values, call the node (`crate::node`), and answer (an `HttpResult`: a failure is an
//! `HttpError` value, its body written by the edge); `router.rs` is the one table of routes;
//! `edge.rs` checks every request (where it comes from, its key, its body's type);
//! `openapi.rs` serves the API's document, which its tests hold to the routes.

#![forbid(unsafe_code)]

use sbx_front::guard;
use sbx_functions as functions;
use sbx_node::{image, node, store};

mod checkpoints;
mod edge;
pub mod files;
pub mod function_routes;
mod images;
mod moves;
mod node_routes;
#[cfg(test)]
mod node_tests;
mod openapi;
mod router;
mod run;
mod sandboxes;
mod secrets;
mod sse;
mod takeover;
mod terminal;
mod volumes;
#[cfg(test)]
mod wire_tests;

use std::collections::HashSet;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderName, HeaderValue, StatusCode};
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

/// What a handler returns: its answer, or the error to answer with.
pub(crate) type HttpResult<T> = Result<T, HttpError>;

/// A failed call as a handler returns it (`Err(..)` of an [`HttpResult`]): the [`ApiError`]
/// to answer with, and the headers its answer carries besides (a 416's `Content-Range`).
///
/// Its answer has the status sbx-api's table gives the code, `Retry-After: 1` when that is a
/// 503 worth retrying, and the error body
/// `{"error":{type,code,message,param,retryable,request_id,docs_url}}`. The body holds the
/// request's id and the node's docs URL, which the edge has: [`IntoResponse`] gives an answer
/// without it, holding the error, and the edge writes it ([`HttpError::answer`]) before the
/// answer leaves the node. Every route is behind the edge.
#[derive(Clone, Debug)]
pub(crate) struct HttpError {
    err: ApiError,
    headers: Vec<(HeaderName, HeaderValue)>,
}

impl HttpError {
    /// The same error, its answer carrying `name: value` (set over one of the same name).
    #[must_use]
    pub fn with_header(mut self, name: HeaderName, value: HeaderValue) -> HttpError {
        self.headers.push((name, value));
        self
    }

    /// The error's whole answer, its body naming request `request_id` and the docs at `docs`.
    pub fn answer(&self, request_id: &str, docs: Option<&str>) -> Response {
        let err = &self.err;
        let status =
            StatusCode::from_u16(err.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = sbx_api::error_body(err, request_id, docs);
        let mut resp = (status, axum::Json(body)).into_response();
        if err.retryable() && status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        for (name, value) in &self.headers {
            resp.headers_mut().insert(name.clone(), value.clone());
        }
        resp
    }
}

impl From<ApiError> for HttpError {
    fn from(err: ApiError) -> HttpError {
        HttpError {
            err,
            headers: Vec::new(),
        }
    }
}

/// An error answer whose body the edge has yet to write: the extension of the answer
/// [`HttpError`]'s `IntoResponse` gives.
#[derive(Clone)]
pub(crate) struct Unwritten(pub(crate) HttpError);

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.err.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut resp = status.into_response();
        resp.extensions_mut().insert(Unwritten(self));
        resp
    }
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
