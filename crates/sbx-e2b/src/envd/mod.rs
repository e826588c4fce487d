//! envd, E2B's in-sandbox daemon, served by the node over the sandbox's agent: its Connect
//! services (`process.Process`, `filesystem.Filesystem`; `connect.rs` has the protocol),
//! `GET/POST /files` and `GET /health`. A request reaches here with the sandbox named (the
//! `E2b-Sandbox-Id` header, or the `49983-{id}.{domain}` host of the preview listener); it
//! runs as the user its `Authorization: Basic` names (E2B's SDK sends `user:`), else as
//! [`DEFAULT_USER`].
//!
//! Access: the sandbox's token in `X-Access-Token` (the create answer's `envdAccessToken`),
//! or a caller the control plane takes (a key of the node; loopback on a node without keys).
//! A loopback peer may be the user's browser, sent there by any page: a request such a page
//! can send without a CORS preflight (`crate::guard::browser_simple`: no Content-Type or a
//! form's, no header of its own) may read but not change anything (every envd call but a
//! `GET` or `HEAD`) unless it carries the token. E2B's SDKs send the token, and Connect's
//! `Content-Type: application/json` and `Connect-Protocol-Version`.

pub mod files;
pub mod filesystem;
pub mod process;

use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;

use super::connect::RpcError;
use super::{Access, Shared};
use crate::node::Node;

/// The user a request runs as when it names none: E2B's templates' user.
pub const DEFAULT_USER: &str = "user";

/// envd's state on the node: what outlives one request.
#[derive(Default)]
pub struct State {
    /// Processes started through `process.Process` (by pid, tag).
    pub processes: process::Processes,
    /// Watchers of `filesystem.Filesystem` (CreateWatcher .. RemoveWatcher).
    pub watchers: filesystem::Watchers,
}

/// One envd request's context.
pub struct Ctx {
    pub shared: Arc<Shared>,
    /// The sandbox's id (the request may name it by its name).
    pub sandbox: String,
    /// The user the request named (`Authorization: Basic`), if any.
    pub user: Option<String>,
}

impl Ctx {
    pub fn node(&self) -> &Arc<Node> {
        &self.shared.node
    }

    pub fn state(&self) -> &State {
        &self.shared.envd
    }

    /// The user to run as: the one named, else [`DEFAULT_USER`].
    pub fn user(&self) -> &str {
        self.user.as_deref().unwrap_or(DEFAULT_USER)
    }
}

/// The user of `Authorization: Basic base64(user:password)` (the password is not used).
fn basic_user(headers: &axum::http::HeaderMap) -> Option<String> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let b = v
        .strip_prefix("Basic ")
        .or_else(|| v.strip_prefix("basic "))?;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b.trim())
        .ok()?;
    let s = String::from_utf8(raw).ok()?;
    let user = s.split(':').next().unwrap_or("").trim().to_string();
    (!user.is_empty()).then_some(user)
}

/// A request of envd for sandbox `id`.
pub async fn handle(
    shared: &Arc<Shared>,
    req: Request<Body>,
    access: &Access,
    id: &str,
) -> Response {
    let Some(sandbox) = shared.node.sandbox_id(id) else {
        return RpcError::not_found(format!("sandbox {id} is not on this node")).response();
    };
    let token = shared.node.sandbox_token(&sandbox).ok().flatten();
    let mut token_ok = token.as_ref().is_some_and(|t| {
        access
            .creds
            .token_in(&["x-access-token"])
            .any(|given| t.matches(given))
    });
    // A signed URL of `/files` stands for the token (for that file and operation only).
    if !token_ok && req.uri().path() == "/files" {
        match files::Signed::of(&req) {
            Some(Ok(signed)) => match signed.check(token.as_ref()) {
                Ok(()) => token_ok = true,
                Err(why) => return crate::e2b_error(StatusCode::UNAUTHORIZED, why),
            },
            Some(Err(why)) => return crate::e2b_error(StatusCode::BAD_REQUEST, why),
            None => {}
        }
    }
    if !token_ok && !access.caller {
        return RpcError::new(
            super::connect::Code::Unauthenticated,
            "send the sandbox's access token (envdAccessToken) in X-Access-Token",
        )
        .response();
    }
    let reads = req.method() == Method::GET || req.method() == Method::HEAD;
    if !token_ok && !reads && access.browser_simple {
        return RpcError::new(
            super::connect::Code::PermissionDenied,
            "a request any web page could send (no Content-Type or a form's, and no \
             X-Access-Token) does not change a sandbox: send the sandbox's access token \
             (envdAccessToken) in X-Access-Token",
        )
        .response();
    }
    let ctx = Ctx {
        shared: shared.clone(),
        sandbox,
        user: basic_user(req.headers()),
    };
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    match (method, path.as_str()) {
        (Method::GET, "/health") => StatusCode::NO_CONTENT.into_response(),
        (Method::GET, "/files") => files::download(&ctx, req).await,
        (Method::POST, "/files") => files::upload(&ctx, req).await,
        (Method::POST, p) if p.starts_with("/process.Process/") => {
            let name = p["/process.Process/".len()..].to_string();
            process::call(ctx, &name, req).await
        }
        (Method::POST, p) if p.starts_with("/filesystem.Filesystem/") => {
            let name = p["/filesystem.Filesystem/".len()..].to_string();
            filesystem::call(ctx, &name, req).await
        }
        (m, p) => RpcError::not_found(format!("envd has no {m} {p}")).response(),
    }
}
