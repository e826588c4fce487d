//! `filesystem.Filesystem`: stat, list, make, move, remove and watch the sandbox's files.

use axum::body::Body;
use axum::http::Request;
use axum::response::Response;

use super::Ctx;
use crate::e2b::connect::RpcError;

/// Watchers made by CreateWatcher.
#[derive(Default)]
pub(crate) struct Watchers {}

pub(crate) async fn call(_ctx: Ctx, name: &str, _req: Request<Body>) -> Response {
    RpcError::unimplemented(format!("filesystem.Filesystem/{name}")).response()
}
