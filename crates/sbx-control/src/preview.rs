//! The control plane's preview listener (`sandboxd control --preview-listen ADDR`): a request
//! whose Host is `{port}-{sandbox id or name}.{domain}[:port]` goes to the preview listener of
//! the node the table names for that sandbox (`preview_url`, told by the node at each
//! heartbeat), its Host and Origin kept (the node reads the sandbox from the Host and judges
//! the page and the credentials: a public port, the sandbox's token, a key), its body and the
//! answer streamed, a WebSocket bridged once both sides switch (`proxy`). A sandbox that
//! moved is reached on its new node by the same URL. The nodes and the control plane share
//! `--preview-domain`.
//!
//! What the control plane answers itself is the API's error body: 404 `not_found` (param
//! `Host`) for a host that is not a preview host, 404 `sandbox_not_found`, and 503
//! `unavailable` (retryable, `Retry-After: 1`) while the sandbox is being moved, when its node
//! is lost or serves no preview listener.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header;
use axum::response::Response;
use axum::Router;
use sbx_api::preview::parse_host;
use sbx_api::{ApiError, ErrorCode};

use crate::relay::{self, Listener, Refused};
use crate::server::{fail, Ctl};

/// What the listener's requests share.
pub struct PreviewState {
    pub ctl: Arc<Ctl>,
    /// `--preview-domain`, lowercased, without dots at its ends.
    pub domain: String,
}

/// `--preview-domain` as the listener matches it; `None` when it is not a domain.
pub fn domain_of(flag: &str) -> Option<String> {
    let d = flag.trim().trim_matches('.').to_ascii_lowercase();
    (!d.is_empty() && !d.contains(':') && !d.contains('/') && !d.contains(' ')).then_some(d)
}

/// The request's host: `Host`, or an HTTP/2 request's `:authority`.
fn request_host(req: &Request) -> Option<String> {
    req.headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| req.uri().authority().map(|a| a.as_str().to_string()))
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
}

fn not_a_preview_host(host: &str, domain: &str) -> ApiError {
    ApiError::new(
        ErrorCode::NotFound,
        format!("{host:?} is not a preview host ({{port}}-{{sandbox}}.{domain})"),
    )
    .with_param("Host")
}

/// The listener's router: every request is one of a sandbox's port.
pub fn router(ctl: Arc<Ctl>, domain: String) -> Router {
    Router::new()
        .fallback(handle)
        .with_state(Arc::new(PreviewState { ctl, domain }))
}

async fn handle(State(st): State<Arc<PreviewState>>, mut req: Request) -> Response {
    let rid = sbx_api::request_id_or_new(
        req.headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok()),
    );
    if let Ok(v) = header::HeaderValue::from_str(&rid) {
        req.headers_mut().insert("x-request-id", v);
    }
    // A standby control plane routes nothing (its table may be behind the active one's).
    if !st.ctl.db.writable() {
        return fail(
            &rid,
            crate::active::standby_error(st.ctl.role.active().as_ref()),
        );
    }
    let host = request_host(&req).unwrap_or_default();
    let Some((_, sandbox)) = parse_host(&host, &st.domain) else {
        return fail(&rid, not_a_preview_host(&host, &st.domain));
    };
    // An HTTP/2 request's authority becomes the Host the node reads.
    if !req.headers().contains_key(header::HOST) {
        if let Ok(v) = header::HeaderValue::from_str(&host) {
            req.headers_mut().insert(header::HOST, v);
        }
    }
    match relay::to_sandbox(&st.ctl, &rid, &sandbox, Listener::Preview, req).await {
        Ok((_, _, resp)) => resp,
        Err(Refused::Api(e)) => fail(&rid, e),
        Err(Refused::Db) => fail(
            &rid,
            ApiError::new(
                ErrorCode::Unavailable,
                "the control plane's database did not answer; its log has the reason",
            ),
        ),
    }
}

/// Serves the preview listener on `listener` until the task is aborted.
pub fn spawn(
    listener: tokio::net::TcpListener,
    ctl: Arc<Ctl>,
    domain: String,
) -> tokio::task::JoinHandle<()> {
    let app = router(ctl, domain);
    tokio::spawn(sbx_listen::serve_streams(
        listener,
        "control plane's preview listener",
        app,
        sbx_listen::MAX_STREAM_CONNECTIONS,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_domain_flag() {
        assert_eq!(
            domain_of("Preview.Example.com."),
            Some("preview.example.com".into())
        );
        assert_eq!(domain_of("localhost"), Some("localhost".into()));
        assert_eq!(domain_of(""), None);
        assert_eq!(domain_of("a:80"), None);
        assert_eq!(domain_of("a/b"), None);
    }
}
