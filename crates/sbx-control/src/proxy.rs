//! The control plane's calls to nodes: one pooled HTTP/1 client (hyper's), requests passed on
//! with their bodies streamed both ways (nothing buffered), hop-by-hop headers dropped, and an
//! upgraded connection (a terminal's WebSocket) bridged byte for byte once both sides have
//! switched protocols.

use std::time::Duration;

use axum::body::Body;
use axum::http::header::{self, HeaderMap, HeaderName, HeaderValue};
use axum::http::{Request, Response, StatusCode, Uri, Version};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};

/// The client every call to a node goes through (connections kept between calls).
pub type NodeClient = Client<HttpConnector, Body>;

/// Why a node could not be asked.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("{url}{path} is not a URL: {source}")]
    Uri {
        url: String,
        path: String,
        #[source]
        source: axum::http::uri::InvalidUri,
    },
    #[error("{0}")]
    Send(#[from] hyper_util::client::legacy::Error),
}

/// The pooled client (connect timeout 5 s; idle connections closed after 30 s).
pub fn client() -> NodeClient {
    let mut http = HttpConnector::new();
    http.set_connect_timeout(Some(Duration::from_secs(5)));
    http.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(http)
}

/// Headers that are one connection's, never passed on.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Drops the hop-by-hop headers, and those the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        headers.remove(n);
    }
    for n in HOP_BY_HOP {
        headers.remove(n);
    }
}

/// The protocol a request asks to switch to (`Connection: upgrade` with `Upgrade`).
pub fn upgrade_of(headers: &HeaderMap) -> Option<HeaderValue> {
    let asks = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    if asks {
        headers.get(header::UPGRADE).cloned()
    } else {
        None
    }
}

/// Sends `req` (its URI a path and query) to the node at `node_url` (`http://HOST:PORT`), and
/// gives back the node's answer with its body streaming. The request's body streams to the
/// node as it comes. A request to switch protocols that the node accepts (101) is bridged: the
/// caller's connection and the node's are copied into each other until either closes.
pub async fn forward(
    client: &NodeClient,
    node_url: &str,
    req: Request<Body>,
) -> Result<Response<Body>, ProxyError> {
    send(client, node_url, req, false).await
}

/// [`forward`], the request's `Host` and `Origin` kept: the node's preview listener reads the
/// sandbox from the Host, and judges the page (`Origin`) itself.
pub async fn forward_keeping_host(
    client: &NodeClient,
    node_url: &str,
    req: Request<Body>,
) -> Result<Response<Body>, ProxyError> {
    send(client, node_url, req, true).await
}

async fn send(
    client: &NodeClient,
    node_url: &str,
    mut req: Request<Body>,
    keep_host: bool,
) -> Result<Response<Body>, ProxyError> {
    let on_caller = req.extensions_mut().remove::<hyper::upgrade::OnUpgrade>();
    // A request to switch protocols is passed on as one only when the caller's side can switch.
    let upgrade = upgrade_of(req.headers()).filter(|_| on_caller.is_some());
    let path = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    let base = node_url.trim_end_matches('/');
    let uri: Uri = format!("{base}{path}")
        .parse()
        .map_err(|source| ProxyError::Uri {
            url: base.to_string(),
            path: path.clone(),
            source,
        })?;
    let (mut parts, body) = req.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    // The node's own Host (hyper's client sets it from the URI); a browser's Origin was the
    // control plane's to judge, and is not the node's.
    if !keep_host {
        parts.headers.remove(header::HOST);
        parts.headers.remove(header::ORIGIN);
    }
    if let Some(u) = &upgrade {
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        parts.headers.insert(header::UPGRADE, u.clone());
    }
    parts.uri = uri;
    parts.version = Version::HTTP_11;
    parts.extensions = Default::default();
    let mut resp = client.request(Request::from_parts(parts, body)).await?;
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        if let (Some(on_caller), Some(_)) = (on_caller, &upgrade) {
            let on_node = hyper::upgrade::on(&mut resp);
            tokio::spawn(async move {
                match tokio::try_join!(on_caller, on_node) {
                    Ok((caller, node)) => {
                        let mut caller = TokioIo::new(caller);
                        let mut node = TokioIo::new(node);
                        if let Err(e) = tokio::io::copy_bidirectional(&mut caller, &mut node).await
                        {
                            tracing::debug!(error = %e, "an upgraded connection ended");
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "a connection did not switch protocols"),
                }
            });
        }
        let (parts, _) = resp.into_parts();
        return Ok(Response::from_parts(parts, Body::empty()));
    }
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Ok(Response::from_parts(parts, Body::new(body)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_are_dropped() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("keep-alive, x-one"));
        h.insert("x-one", HeaderValue::from_static("1"));
        h.insert("x-two", HeaderValue::from_static("2"));
        h.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        h.insert("authorization", HeaderValue::from_static("Bearer k"));
        strip_hop_by_hop(&mut h);
        let mut left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        left.sort_unstable();
        assert_eq!(left, ["authorization", "x-two"]);
    }

    #[test]
    fn an_upgrade_is_asked_with_connection_and_upgrade() {
        let mut h = HeaderMap::new();
        h.insert("upgrade", HeaderValue::from_static("websocket"));
        assert_eq!(upgrade_of(&h), None);
        h.insert(
            "connection",
            HeaderValue::from_static("keep-alive, Upgrade"),
        );
        assert_eq!(upgrade_of(&h), Some(HeaderValue::from_static("websocket")));
    }
}
