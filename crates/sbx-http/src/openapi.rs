//! `GET /openapi.json`: the OpenAPI 3.1 document of the node's API, kept at
//! `crates/sandboxd/openapi/openapi.json` and served as it is (a key is needed as for every
//! call but `/healthz`).
//!
//! The document is written by hand; its tests hold it to the node: every route of
//! [`super::router::table`] documented and nothing else, every operation complete (request
//! bodies, answers, error answers), every error code of [`sbx_api::ErrorCode`] with its status,
//! and real answers of a node on the fake driver valid against its schemas.

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};

/// The document, as it is checked in.
pub const DOCUMENT: &str = include_str!("../../sandboxd/openapi/openapi.json");

pub(super) async fn document() -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        DOCUMENT,
    )
        .into_response()
}

#[cfg(test)]
mod tests;
