//! The sandbox's side of a preview request: a TCP connection to 127.0.0.1:{port} inside the
//! sandbox's network namespace (its socket made there by sbx-runtime's `netns`, as the ready
//! probes make theirs, then connected from the node's runtime), so a service bound to
//! 127.0.0.1 or to every address is reached, with or without the node's network. The request
//! goes over HTTP/1.1 (hyper's client connection), bodies streamed both ways as they come; an
//! `Upgrade:` (WebSocket) that the service accepts with 101 becomes a byte pipe between both
//! upgraded connections.

use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::OwnedFd;
use std::time::Duration;

use hyper::header::{self, HeaderValue};
use hyper::{Request, Response, StatusCode, Uri, Version};
use hyper_util::rt::TokioIo;
use sbx_api::{ApiError, ErrorCode};
use tokio::net::TcpStream;

use axum::body::Body;

/// How long a connection to the sandbox's port may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why no connection to the sandbox's port was made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("no socket in the sandbox's network: {0}")]
    Socket(std::io::Error),
    #[error("nothing listens on it ({0})")]
    Refused(std::io::Error),
    #[error("it did not take the connection in {0:?}")]
    Timeout(Duration),
    #[error("{0}")]
    Other(std::io::Error),
}

impl ConnectError {
    /// 502 port_not_open when nothing listens (or it does not answer); 502 upstream_failed
    /// otherwise.
    pub fn api_error(&self, sandbox: &str, port: u16) -> ApiError {
        let code = match self {
            ConnectError::Refused(_) | ConnectError::Timeout(_) => ErrorCode::PortNotOpen,
            ConnectError::Socket(_) | ConnectError::Other(_) => ErrorCode::UpstreamFailed,
        };
        ApiError::new(
            code,
            format!("port {port} of sandbox {sandbox} is not open: {self}"),
        )
    }
}

/// A connection to 127.0.0.1:`port` in the network namespace `ns` names (a handle on the
/// sandbox's agent).
pub async fn connect(ns: OwnedFd, port: u16) -> Result<TcpStream, ConnectError> {
    let socket = tokio::task::spawn_blocking(move || {
        sbx_runtime::netns::in_netns_of_handle(ns, tokio::net::TcpSocket::new_v4)
    })
    .await
    .map_err(|e| ConnectError::Socket(std::io::Error::other(e.to_string())))?
    .map_err(ConnectError::Socket)?;
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    match tokio::time::timeout(CONNECT_TIMEOUT, socket.connect(addr)).await {
        Ok(Ok(s)) => {
            let _ = s.set_nodelay(true);
            Ok(s)
        }
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            Err(ConnectError::Refused(e))
        }
        Ok(Err(e)) => Err(ConnectError::Other(e)),
        Err(_) => Err(ConnectError::Timeout(CONNECT_TIMEOUT)),
    }
}

/// Where a request came from, for the `X-Forwarded-*` headers.
pub struct Forwarded {
    pub client: SocketAddr,
    /// The preview host the client asked for.
    pub host: String,
    /// The `Host` the service is sent instead (the sandbox's `PreviewTarget::host`); the
    /// client's stays in `X-Forwarded-Host`.
    pub masked_host: Option<String>,
    pub proto: &'static str,
    /// Holds the sandbox awake until the answer is sent (or the upgraded connection ends).
    pub held: Option<sbx_node::node::sandbox::sleep::InUse>,
}

/// Why a request did not get the service's answer.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("HTTP/1.1 with the service: {0}")]
    Handshake(hyper::Error),
    #[error("the service did not answer: {0}")]
    Request(hyper::Error),
    #[error("a bad request target: {0}")]
    Uri(hyper::http::Error),
}

/// Whether an HTTP/1.1 request asks to switch protocols (`Connection: upgrade` + `Upgrade`).
fn wants_upgrade<B>(req: &Request<B>) -> bool {
    req.version() <= Version::HTTP_11
        && req.headers().contains_key(header::UPGRADE)
        && req
            .headers()
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
}

/// Sends `req` to the service over `stream` and answers with its answer, streamed.
pub async fn forward<B>(
    mut req: Request<B>,
    stream: TcpStream,
    fwd: Forwarded,
) -> Result<Response<Body>, ForwardError>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let upgrading = wants_upgrade(&req);
    let client_upgrade = upgrading.then(|| hyper::upgrade::on(&mut req));
    let (mut parts, body) = req.into_parts();
    sbx_net::hop::strip_hop_by_hop(&mut parts.headers, upgrading);
    // HTTP/1.1 to the service: the target in origin form, a Host (an HTTP/2 request has its
    // :authority instead).
    let pq = parts
        .uri
        .path_and_query()
        .map(|pq| pq.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    parts.uri = pq.parse::<Uri>().map_err(|e| ForwardError::Uri(e.into()))?;
    parts.version = Version::HTTP_11;
    if let Ok(v) = HeaderValue::from_str(&fwd.host) {
        parts.headers.insert(header::HOST, v.clone());
        parts.headers.insert("x-forwarded-host", v);
    }
    if let Some(Ok(v)) = fwd.masked_host.as_deref().map(HeaderValue::from_str) {
        parts.headers.insert(header::HOST, v);
    }
    let ip = fwd.client.ip().to_string();
    let xff = match parts
        .headers
        .get("x-forwarded-for")
        .and_then(|v| v.to_str().ok())
    {
        Some(before) => format!("{before}, {ip}"),
        None => ip,
    };
    if let Ok(v) = HeaderValue::from_str(&xff) {
        parts.headers.insert("x-forwarded-for", v);
    }
    parts
        .headers
        .insert("x-forwarded-proto", HeaderValue::from_static(fwd.proto));
    let (mut sender, conn) = hyper::client::conn::http1::Builder::new()
        .handshake(TokioIo::new(stream))
        .await
        .map_err(ForwardError::Handshake)?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "preview: a connection to a sandbox's port");
        }
    });
    let mut resp = sender
        .send_request(Request::from_parts(parts, body))
        .await
        .map_err(ForwardError::Request)?;
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        if let Some(client_upgrade) = client_upgrade {
            let service_upgrade = hyper::upgrade::on(&mut resp);
            let held = fwd.held;
            tokio::spawn(async move {
                let _held = held;
                let (client, service) = match tokio::join!(client_upgrade, service_upgrade) {
                    (Ok(c), Ok(s)) => (c, s),
                    (Err(e), _) | (_, Err(e)) => {
                        tracing::debug!(error = %e, "preview: an upgrade");
                        return;
                    }
                };
                let (mut client, mut service) = (TokioIo::new(client), TokioIo::new(service));
                let _ = tokio::io::copy_bidirectional(&mut client, &mut service).await;
            });
            let (parts, _) = resp.into_parts();
            return Ok(Response::from_parts(parts, Body::empty()));
        }
    }
    sbx_net::hop::strip_hop_by_hop(resp.headers_mut(), false);
    let resp = resp.map(Body::new);
    Ok(match fwd.held {
        Some(h) => crate::held::hold_while_sent(resp, h),
        None => resp,
    })
}

/// Forwards `req` to port `port` in the network namespace `ns` names (for the E2B front
/// end's requests of a sandbox's port), with `Host: masked_host` when it is given.
pub async fn forward_to<B>(
    req: Request<B>,
    ns: std::os::fd::OwnedFd,
    port: u16,
    client: SocketAddr,
    host: String,
    masked_host: Option<String>,
    held: Option<sbx_node::node::sandbox::sleep::InUse>,
) -> Result<Response<Body>, String>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let stream = connect(ns, port).await.map_err(|e| e.to_string())?;
    let fwd = Forwarded {
        client,
        host,
        masked_host,
        proto: "http",
        held,
    };
    forward(req, stream, fwd).await.map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_stay_behind() {
        let mut h = header::HeaderMap::new();
        h.insert(
            "connection",
            HeaderValue::from_static("keep-alive, x-mine, Upgrade"),
        );
        h.insert("x-mine", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("upgrade", HeaderValue::from_static("websocket"));
        h.insert("x-kept", HeaderValue::from_static("2"));
        let mut up = h.clone();
        sbx_net::hop::strip_hop_by_hop(&mut h, false);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));
        sbx_net::hop::strip_hop_by_hop(&mut up, true);
        assert_eq!(
            up.get("connection").map(|v| v.as_bytes()),
            Some(&b"upgrade"[..])
        );
        assert_eq!(
            up.get("upgrade").map(|v| v.as_bytes()),
            Some(&b"websocket"[..])
        );
        assert!(!up.contains_key("x-mine") && up.contains_key("x-kept"));
    }
}
