//! The preview listener (`--preview-listen`, default 127.0.0.1:7780): a request whose Host is
//! `{port}-{sandbox id or name}.{domain}[:listen port]` reaches that TCP port of the sandbox.
//!
//! - mod.rs: the listener (plain or HTTPS with ALPN h2 and http/1.1; HTTP/1.1 and HTTP/2 from
//!   clients, hyper-util's auto builder, upgrades kept), the Host's parse, the order of
//!   decisions, and refusals as the API's one error body.
//! - auth.rs: who may open a port: public ports (`public_ports`, `public_ports_except`) for
//!   anybody, the others with the sandbox's token (`X-Sbx-Token`, `?sbx_token=` answered with
//!   a 307 and a cookie, that cookie) or one of the node's API keys; every credential of the
//!   node taken out of the request before it goes on (`crate::guard`, shared with E2B's
//!   listener).
//! - upstream.rs: the connection to 127.0.0.1:{port} inside the sandbox's network namespace
//!   (a socket made there through sbx-runtime's `netns`, as the ready probes make theirs), the
//!   request over HTTP/1.1, bodies streamed both ways, `Upgrade:` (WebSocket) passed through.
//!
//! A request from a page (its `Origin`) is served only to the preview host's own origin
//! (`http(s)://{host}`), a page of another port of the same sandbox, or one of
//! `--cors-origin`: a page of another site (or of another sandbox) cannot drive a sandbox's
//! service, nor envd's port, through a user's browser.
//!
//! What it needs of a sandbox it asks `node/` with typed calls (`Node::preview_target`,
//! `Node::sandbox_netns`): no HTTP type goes into the core.

#![forbid(unsafe_code)]

use sbx_api::preview::parse_host;
use sbx_front::guard;
use sbx_node::node;

mod auth;
use sbx_front::upstream;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use hyper::header::{self, HeaderValue};
use hyper::{Request, Response, StatusCode};
use sbx_api::{ApiError, ErrorCode};
use tokio::net::TcpListener;

use crate::node::sandbox::PreviewSettings;
use crate::node::Node;

/// The body of the listener's answers: the sandbox's service's, streamed, or an error body.
pub type Body = axum::body::Body;

/// Connections open at once; one more waits for a place.
const MAX_CONNECTIONS: usize = 1024;

/// A TLS handshake not done this long after the connection is closed (a request head then
/// has the listeners' header timeout, `sbx_front::listen::Timeouts::STREAMS`).
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);

/// The listener's settings, from the node's flags.
#[derive(Debug, Clone)]
pub struct Config {
    /// `None`: `--preview-listen off`.
    pub listen: Option<SocketAddr>,
    pub domain: String,
    /// The certificate chain and key (PEM) of `--preview-tls-cert` and `--preview-tls-key`.
    pub tls: Option<(PathBuf, PathBuf)>,
}

/// `--preview-listen`: an address, or `off` (`None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Listen(pub Option<SocketAddr>);

/// Parses `--preview-listen`.
pub fn parse_listen(s: &str) -> Result<Listen, String> {
    if s.trim().eq_ignore_ascii_case("off") {
        return Ok(Listen(None));
    }
    s.trim()
        .parse::<SocketAddr>()
        .map(|a| Listen(Some(a)))
        .map_err(|e| format!("{s:?} is not ADDR:PORT or off: {e}"))
}

/// What every request of the listener reads.
struct Shared {
    node: Arc<Node>,
    domain: String,
    https: bool,
    api_keys: Option<HashSet<String>>,
    docs_url: Option<String>,
    /// `--cors-origin`: origins besides a preview host's own whose pages it serves.
    cors_origins: Vec<String>,
    /// Ports of every sandbox that front ends serve themselves.
    ports: Vec<Arc<dyn sbx_front::PortFront>>,
}

/// The preview listener bound, not serving yet: the node is told its settings when it is
/// built ([`serve`] then serves).
pub struct Bound {
    listener: TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    /// The address bound (its port, when 0 was asked, the one given), the domain, HTTPS.
    pub settings: PreviewSettings,
}

/// Binds the listener, when it is on.
pub async fn bind(cfg: Config) -> anyhow::Result<Option<Bound>> {
    let Some(listen) = cfg.listen else {
        tracing::info!("preview listener off");
        return Ok(None);
    };
    let domain = cfg.domain.trim().trim_matches('.').to_ascii_lowercase();
    anyhow::ensure!(
        !domain.is_empty() && !domain.contains(':') && !domain.contains('/'),
        "--preview-domain {:?} is not a domain",
        cfg.domain
    );
    let tls = match &cfg.tls {
        Some((cert, key)) => Some(tls_acceptor(cert, key)?),
        None => None,
    };
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("preview listener: listen on {listen}"))?;
    let bound = listener
        .local_addr()
        .context("preview listener's address")?;
    let settings = PreviewSettings {
        listen: bound,
        domain,
        tls: tls.is_some(),
    };
    Ok(Some(Bound {
        listener,
        tls,
        settings,
    }))
}

/// Serves the bound listener in the background.
pub fn serve(
    bound: Bound,
    node: Arc<Node>,
    api_keys: Option<HashSet<String>>,
    docs_url: Option<String>,
    cors_origins: Vec<String>,
    ports: Vec<Arc<dyn sbx_front::PortFront>>,
) {
    let Bound {
        listener,
        tls,
        settings,
    } = bound;
    tracing::info!(listen = %settings.listen, domain = %settings.domain, tls = settings.tls, "preview listener serves");
    let shared = Arc::new(Shared {
        node,
        domain: settings.domain,
        https: settings.tls,
        api_keys,
        docs_url,
        cors_origins,
        ports,
    });
    tokio::spawn(accept_loop(listener, tls, shared));
}

/// The TLS settings of `--preview-tls-cert` and `--preview-tls-key`: ALPN h2 and http/1.1.
fn tls_acceptor(cert: &PathBuf, key: &PathBuf) -> anyhow::Result<tokio_rustls::TlsAcceptor> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_file_iter(cert)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| anyhow::anyhow!("--preview-tls-cert {}: {e}", cert.display()))?;
    anyhow::ensure!(
        !certs.is_empty(),
        "--preview-tls-cert {} holds no certificate",
        cert.display()
    );
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| anyhow::anyhow!("--preview-tls-key {}: {e}", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS versions")?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("--preview-tls-cert and --preview-tls-key do not make a pair")?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

async fn accept_loop(
    listener: TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    shared: Arc<Shared>,
) {
    sbx_front::listen::accept_loop(
        listener,
        "preview listener",
        MAX_CONNECTIONS,
        std::future::pending(),
        move |stream, peer| {
            let (tls, shared) = (tls.clone(), shared.clone());
            async move {
                match tls {
                    None => serve_conn(stream, peer, shared).await,
                    Some(acceptor) => {
                        match tokio::time::timeout(HEAD_TIMEOUT, acceptor.accept(stream)).await {
                            Ok(Ok(s)) => serve_conn(s, peer, shared).await,
                            Ok(Err(e)) => tracing::debug!(error = %e, "preview: TLS handshake"),
                            Err(_) => tracing::debug!("preview: TLS handshake timed out"),
                        }
                    }
                }
            }
        },
    )
    .await;
}

/// One client connection: HTTP/1.1 (with upgrades) or HTTP/2, with the timeouts of every
/// listener of the node (`sbx_front::listen`): only idle time counts, never total time, so
/// that forwarded streams and WebSockets last as long as they are used.
async fn serve_conn<I>(io: I, peer: SocketAddr, shared: Arc<Shared>)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use sbx_front::listen::{Protocol, Timeouts};
    sbx_front::listen::serve_conn(
        io,
        peer,
        Timeouts::STREAMS,
        Protocol::Http1And2,
        None,
        move |req| {
            let shared = shared.clone();
            async move { handle(req, peer, &shared).await }
        },
    )
    .await;
}

/// A request: its host names a port of a sandbox, which it may open, and which answers.
async fn handle(req: Request<Body>, peer: SocketAddr, shared: &Shared) -> Response<Body> {
    let rid = sbx_api::request_id_or_new(
        req.headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok()),
    );
    let fail = |e: ApiError| error_response(&e, &rid, shared.docs_url.as_deref());
    let host = match request_host(&req) {
        Some(h) => h,
        None => return fail(not_a_preview_host("")),
    };
    let Some((port, sandbox)) = parse_host(&host, &shared.domain) else {
        return fail(not_a_preview_host(&host));
    };
    // A page of another site is refused, whatever the port: a request a page sends without
    // a preflight (a form's POST, say) would otherwise reach the service with the user's
    // cookies, or envd of a node without keys with no token at all.
    let scheme = if shared.https { "https" } else { "http" };
    let origin = req.headers().get(header::ORIGIN);
    if let Err(crate::guard::Refusal::Origin(o) | crate::guard::Refusal::Host(o)) =
        crate::guard::check_origin(false, Some(&host), origin, scheme, &shared.cors_origins)
    {
        // (A page of another port of the same sandbox is served: its code could call it.)
        if !same_sandbox_origin(shared, &o, scheme, &sandbox) {
            return fail(
                ApiError::new(
                    ErrorCode::OriginNotAllowed,
                    format!(
                        "requests from pages of {o:?} are refused: a preview host serves its \
                         own sandbox's pages ({scheme}://{{port}}-{sandbox}.{}) and those of \
                         --cors-origin",
                        shared.domain
                    ),
                )
                .with_param("Origin"),
            );
        }
    }
    // A port a front end serves itself (envd's, when E2B's front end is on: E2B's SDK, given
    // E2B_DOMAIN, calls `49983-{id}.{domain}`).
    if let Some(front) = shared.ports.iter().find(|f| f.port() == port) {
        return front.serve(req, peer, sandbox).await;
    }
    let target = match shared.node.preview_target(&sandbox, port) {
        Ok(t) => t,
        Err(e) => return fail(e),
    };
    let (mut parts, body) = req.into_parts();
    match auth::decide(&mut parts, &target, shared.api_keys.as_ref(), shared.https) {
        auth::Decision::Pass => {}
        auth::Decision::Redirect { location, cookie } => return redirect(&location, &cookie),
        auth::Decision::Refuse => {
            return fail(ApiError::new(
                ErrorCode::InvalidToken,
                format!(
                    "port {port} of sandbox {} is not public: send the sandbox's token \
                     (X-Sbx-Token, ?sbx_token=, its cookie) or Authorization: Bearer API_KEY",
                    target.id
                ),
            ))
        }
    }
    // Held asleep: a request to a port does not wake it (only a call of the API does).
    if shared.node.is_held_asleep(&target.id) {
        return fail(ApiError::new(
            ErrorCode::SandboxPaused,
            format!(
                "sandbox {} is held asleep: a call of the API wakes it",
                target.id
            ),
        ));
    }
    // A paused sandbox is thawed for the request (a sleeping one woken), and kept awake until
    // it is answered; one held asleep meanwhile is not woken.
    let held = match shared.node.use_sandbox_port(&target.id).await {
        Some(Ok(h)) => Some(h),
        Some(Err(e)) => return fail(e),
        None => None,
    };
    let ns = match shared.node.sandbox_netns(&target.id, port) {
        Ok(ns) => ns,
        Err(e) => return fail(e),
    };
    let stream = match upstream::connect(ns, port).await {
        Ok(s) => s,
        Err(e) => return fail(e.api_error(&target.id, port)),
    };
    let fwd = upstream::Forwarded {
        client: peer,
        host,
        masked_host: target.host.clone(),
        proto: if shared.https { "https" } else { "http" },
        held,
    };
    let req = Request::from_parts(parts, body);
    match upstream::forward(req, stream, fwd).await {
        Ok(resp) => resp,
        Err(e) => {
            tracing::info!(sandbox = %target.id, port, error = %e, "preview: upstream");
            fail(ApiError::new(
                ErrorCode::UpstreamFailed,
                format!("port {port} of sandbox {}: {e}", target.id),
            ))
        }
    }
}

/// Whether `origin` (`{scheme}://{port}-{sandbox}.{domain}[:port]`) is a page of another port
/// of `sandbox` (an id or a name): a sandbox's front end may call its own API on another port,
/// which its code could reach from inside all the same; a page of another sandbox may not.
fn same_sandbox_origin(shared: &Shared, origin: &str, scheme: &str, sandbox: &str) -> bool {
    let Some(host) = origin
        .strip_prefix(scheme)
        .and_then(|r| r.strip_prefix("://"))
    else {
        return false;
    };
    let Some((port, other)) = parse_host(host, &shared.domain) else {
        return false;
    };
    let id = |s: &str| shared.node.preview_target(s, port).ok().map(|t| t.id);
    other == sandbox || matches!((id(&other), id(sandbox)), (Some(a), Some(b)) if a == b)
}

fn not_a_preview_host(host: &str) -> ApiError {
    ApiError::new(
        ErrorCode::NotFound,
        format!("{host:?} is not a preview host ({{port}}-{{sandbox}}.{{domain}})"),
    )
    .with_param("Host")
}

/// The request's host: `Host`, or an HTTP/2 request's `:authority`.
fn request_host(req: &Request<Body>) -> Option<String> {
    req.headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| req.uri().authority().map(|a| a.as_str().to_string()))
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
}

/// A refusal as the API's one error body.
fn error_response(err: &ApiError, rid: &str, docs: Option<&str>) -> Response<Body> {
    let status = StatusCode::from_u16(err.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = sbx_api::error_body(err, rid, docs).to_string();
    let mut resp = Response::new(Body::from(Bytes::from(body)));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if let Ok(v) = HeaderValue::from_str(rid) {
        h.insert("x-request-id", v);
    }
    resp
}

/// The answer to a request with a right `?sbx_token=`: to the same URL without it, with the
/// cookie that stands for it from then on.
fn redirect(location: &str, cookie: &str) -> Response<Body> {
    let mut resp = Response::new(Body::empty());
    *resp.status_mut() = StatusCode::TEMPORARY_REDIRECT;
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(location) {
        h.insert(header::LOCATION, v);
    }
    if let Ok(v) = HeaderValue::from_str(cookie) {
        h.insert(header::SET_COOKIE, v);
    }
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_off_or_an_address() {
        assert_eq!(parse_listen("off"), Ok(Listen(None)));
        assert_eq!(
            parse_listen("127.0.0.1:0"),
            Ok(Listen(Some("127.0.0.1:0".parse().expect("addr"))))
        );
        assert!(parse_listen("nope").is_err());
    }
}
