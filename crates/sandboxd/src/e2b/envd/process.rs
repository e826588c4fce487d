//! `process.Process`: commands of the sandbox, by pid (and tag).

use axum::body::Body;
use axum::http::Request;
use axum::response::Response;

use super::Ctx;
use crate::e2b::connect::RpcError;

/// Processes started through envd.
#[derive(Default)]
pub(crate) struct Processes {}

pub(crate) async fn call(_ctx: Ctx, name: &str, _req: Request<Body>) -> Response {
    RpcError::unimplemented(format!("process.Process/{name}")).response()
}
