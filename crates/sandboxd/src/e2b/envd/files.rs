//! `GET /files` and `POST /files`: a file's bytes down and up.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::Response;

use super::Ctx;
use crate::e2b::e2b_error;

pub(crate) async fn download(_ctx: &Ctx, _req: Request<Body>) -> Response {
    e2b_error(StatusCode::NOT_IMPLEMENTED, "GET /files")
}

pub(crate) async fn upload(_ctx: &Ctx, _req: Request<Body>) -> Response {
    e2b_error(StatusCode::NOT_IMPLEMENTED, "POST /files")
}
