//! Plain HTTP connections of a sandbox, and the requests of an inspected host (plain or out
//! of TLS ended at the proxy).
//!
//! The request head is read once with httparse (64 KiB, 30 s) for its Host; what was read
//! is then written to the upstream as it came (passed through) or read again by hyper
//! (inspected, or answered with an error body). One host decides: a request whose absolute
//! URI (`GET http://a.example/`) names another host than its Host header is refused (403
//! egress_denied), as the rules would decide on one and the server read the other.
//!
//! An inspected request is refused (403 egress_denied) where its method is not in upper
//! case (`get`: a lenient server reads it as GET, which the rules may not allow) or is TRACE
//! or TRACK (the server would echo the request, injected secrets and all, to the sandbox);
//! its path is matched by the `http` rules in its normal form only
//! ([`sbx_api::egress::normal_path`]). Secrets are injected into plain HTTP too (port 80):
//! they cross the network in the clear from the node on; rules for https are the safe ones.

use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::header::{HeaderName, HeaderValue, CONTENT_TYPE, HOST, UPGRADE};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use sbx_api::egress::{normal_host, Verdict};
use sbx_api::{ApiError, ErrorCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tracing::{debug, info};

use super::io::{Io, Prefixed};
use super::{Conn, Target, HEAD_TIMEOUT, MAX_HEAD};

/// Why a request head could not be read.
#[derive(Debug, thiserror::Error)]
pub(super) enum HeadError {
    #[error("the sandbox closed the connection before a whole request head")]
    Closed,
    #[error("no request head within 30 s")]
    Timeout,
    #[error("the request head is over 64 KiB")]
    TooLarge,
    #[error("the request head is not HTTP/1: {0}")]
    Malformed(httparse::Error),
    #[error("the request has Host headers that differ")]
    TwoHosts,
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Why an inspected request could not be forwarded.
#[derive(Debug, thiserror::Error)]
pub(super) enum ForwardError {
    #[error("{0}")]
    Dial(#[from] super::dial::DialError),
    #[error("TLS to the upstream: {0}")]
    Tls(#[from] super::tls::TlsError),
    #[error("HTTP to the upstream: {0}")]
    Http(#[from] hyper::Error),
}

type Body = BoxBody<Bytes, hyper::Error>;

/// A request head as read: its bytes (and whatever followed them in the same reads) and its
/// host (without a port): the absolute URI's, else the Host header's.
struct Head {
    bytes: Vec<u8>,
    host: Option<String>,
    /// The Host header, where it names another host than the absolute URI.
    other_host: Option<String>,
}

/// `host[:port]` or `[v6][:port]` without the port (and without the brackets).
fn strip_port(authority: &str) -> &str {
    let a = authority.rsplit('@').next().unwrap_or(authority).trim();
    if let Some(rest) = a.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match a.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') && p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => a,
    }
}

/// The request's host (the absolute URI's, else the Host header's) and, where the two
/// differ, the Host header's.
fn host_of(req: &httparse::Request<'_, '_>) -> Result<(Option<String>, Option<String>), HeadError> {
    let header = host_header(req)?;
    if let Some(path) = req.path {
        for scheme in ["http://", "https://"] {
            if let Some(rest) = path.strip_prefix(scheme) {
                let authority = rest.split(['/', '?', '#']).next().unwrap_or(rest);
                let host = strip_port(authority).to_string();
                let other = header.filter(|h| normal_host(h) != normal_host(&host));
                return Ok((Some(host), other));
            }
        }
    }
    Ok((header, None))
}

/// The Host header's host (without its port).
fn host_header(req: &httparse::Request<'_, '_>) -> Result<Option<String>, HeadError> {
    let mut host: Option<&[u8]> = None;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("host") {
            match host {
                Some(seen) if seen != h.value => return Err(HeadError::TwoHosts),
                _ => host = Some(h.value),
            }
        }
    }
    Ok(host
        .and_then(|v| std::str::from_utf8(v).ok())
        .map(|v| strip_port(v).to_string())
        .filter(|v| !v.is_empty()))
}

async fn read_head(stream: &mut TcpStream) -> Result<Head, HeadError> {
    let mut bytes = Vec::with_capacity(4096);
    let mut buf = vec![0u8; 8192];
    loop {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Err(HeadError::Closed);
        }
        bytes.extend_from_slice(&buf[..n]);
        let (host, other_host) = {
            let mut headers = [httparse::EMPTY_HEADER; 128];
            let mut req = httparse::Request::new(&mut headers);
            match req.parse(&bytes) {
                Ok(httparse::Status::Complete(_)) => host_of(&req)?,
                Ok(httparse::Status::Partial) if bytes.len() < MAX_HEAD => continue,
                Ok(httparse::Status::Partial) => return Err(HeadError::TooLarge),
                Err(e) => return Err(HeadError::Malformed(e)),
            }
        };
        return Ok(Head {
            bytes,
            host,
            other_host,
        });
    }
}

/// Serves a connection that does not start with a TLS record: HTTP/1.
pub(super) async fn serve(conn: Arc<Conn>, mut stream: TcpStream) {
    let head = match tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut stream)).await {
        Ok(Ok(h)) => h,
        Ok(Err(e)) => {
            debug!(sandbox = conn.sandbox, "egress proxy: HTTP: {e}");
            return;
        }
        Err(_) => {
            debug!(
                sandbox = conn.sandbox,
                "egress proxy: HTTP: {}",
                HeadError::Timeout
            );
            return;
        }
    };
    let port = conn.orig.port();
    if let (Some(h), Some(other)) = (head.host.as_deref(), head.other_host.as_deref()) {
        info!(
            sandbox = conn.sandbox,
            host = h,
            other,
            "egress proxy: two hosts, denied"
        );
        let msg = format!("the request's URI names {h} and its Host header {other}");
        let io = Prefixed::new(head.bytes, stream);
        return answer(Box::new(io), ApiError::new(ErrorCode::EgressDenied, msg)).await;
    }
    let target = match head.host.as_deref() {
        Some(h) => match Target::parse(h) {
            Some(t) => t,
            None => {
                let msg = format!("{h} is not a host name or an address");
                let io = Prefixed::new(head.bytes, stream);
                return answer(Box::new(io), ApiError::new(ErrorCode::EgressDenied, msg)).await;
            }
        },
        // HTTP/1.0 without Host: the address the sandbox connected to.
        None => Target::Ip(IpAddr::V4(*conn.orig.ip())),
    };
    if target.verdict(&conn.rules) == Verdict::Deny {
        info!(sandbox = conn.sandbox, host = %target, "egress proxy: HTTP denied");
        let msg = format!("the sandbox's egress rules do not allow {target}");
        let io = Prefixed::new(head.bytes, stream);
        return answer(Box::new(io), ApiError::new(ErrorCode::EgressDenied, msg)).await;
    }
    if let Some(host) = target.inspected(&conn.rules) {
        let host = host.to_string();
        let io = Prefixed::new(head.bytes, stream);
        return serve_inspected(conn, Box::new(io), host, port, false).await;
    }
    let mut up = match conn.proxy.dialer.dial(&target, port).await {
        Ok(s) => s,
        Err(e) => {
            info!(sandbox = conn.sandbox, "egress proxy: {e}");
            let io = Prefixed::new(head.bytes, stream);
            let err = ApiError::new(ErrorCode::UpstreamFailed, e.to_string());
            return answer(Box::new(io), err).await;
        }
    };
    if up.write_all(&head.bytes).await.is_err() {
        return;
    }
    let _ = tokio::io::copy_bidirectional(&mut stream, &mut up).await;
}

fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into())
        .map_err(|n: Infallible| match n {})
        .boxed()
}

/// The error body as an answer.
fn error_response(err: &ApiError) -> Response<Body> {
    let rid = sbx_api::ids::new_request_id();
    let body = err.body(&rid, None).to_string();
    let mut resp = Response::new(full(body));
    *resp.status_mut() =
        StatusCode::from_u16(err.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Ok(v) = HeaderValue::from_str(&rid) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

/// Answers the request on `io` with `err` and closes.
async fn answer(io: Box<dyn Io>, err: ApiError) {
    let svc = hyper::service::service_fn(move |_req: Request<Incoming>| {
        let resp = error_response(&err);
        async move { Ok::<_, Infallible>(resp) }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .keep_alive(false)
        .timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .serve_connection(TokioIo::new(io), svc)
        .await;
}

/// Serves the requests of an inspected `host` on `io` (keep-alive), each checked and
/// forwarded to host:port (`tls`: over TLS).
pub(super) async fn serve_inspected(
    conn: Arc<Conn>,
    io: Box<dyn Io>,
    host: String,
    port: u16,
    tls: bool,
) {
    let up = Arc::new(Upstream {
        conn,
        host,
        port,
        tls,
        sender: tokio::sync::Mutex::new(None),
    });
    let svc = hyper::service::service_fn(move |req| {
        let up = up.clone();
        async move { Ok::<_, Infallible>(up.handle(req).await) }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .max_buf_size(MAX_HEAD)
        .serve_connection(TokioIo::new(io), svc)
        .with_upgrades()
        .await;
}

/// The upstream of one inspected connection: one HTTP/1 connection to it, made at the
/// first request and again when it is closed.
struct Upstream {
    conn: Arc<Conn>,
    host: String,
    port: u16,
    tls: bool,
    sender: tokio::sync::Mutex<Option<SendRequest<Incoming>>>,
}

impl Upstream {
    async fn handle(&self, mut req: Request<Incoming>) -> Response<Body> {
        let rules = &self.conn.rules;
        // Both the absolute URI's host and the Host header, where given, are this one's.
        let header = req.headers().get(HOST).map(|v| match v.to_str() {
            Ok(h) => strip_port(h).to_string(),
            Err(_) => String::new(),
        });
        let uri_host = req.uri().host().map(str::to_owned);
        for h in [uri_host, header].into_iter().flatten() {
            if normal_host(&h) != self.host {
                let msg = format!(
                    "this connection goes to {}; a request for {h} needs its own",
                    self.host
                );
                return error_response(&ApiError::new(ErrorCode::EgressDenied, msg));
            }
        }
        let method = req.method().as_str().to_string();
        if method.bytes().any(|b| b.is_ascii_lowercase())
            || method.eq_ignore_ascii_case("TRACE")
            || method.eq_ignore_ascii_case("TRACK")
        {
            info!(
                sandbox = self.conn.sandbox,
                host = self.host,
                method,
                "egress proxy: method refused"
            );
            let msg = format!(
                "the egress proxy does not forward {method} to {}, whose requests it reads \
                 (TRACE and TRACK echo the request; a method is in upper case)",
                self.host
            );
            return error_response(&ApiError::new(ErrorCode::EgressDenied, msg));
        }
        let path = req.uri().path().to_string();
        if !rules.http_allows(&self.host, &method, &path) {
            info!(
                sandbox = self.conn.sandbox,
                host = self.host,
                method,
                path,
                "egress proxy: request denied"
            );
            let msg = format!(
                "the sandbox's egress rules do not allow {method} {path} on {}",
                self.host
            );
            return error_response(&ApiError::new(ErrorCode::EgressDenied, msg));
        }
        for inject in rules.injects_for(&self.host) {
            let Some(secret) = self.conn.proxy.view.secret(&inject.secret) else {
                let msg = format!(
                    "the secret {} that the egress rules inject for {} is gone",
                    inject.secret, self.host
                );
                return error_response(&ApiError::new(ErrorCode::UpstreamFailed, msg));
            };
            let value = inject.value.replace("{secret}", &secret);
            let (Ok(name), Ok(mut value)) = (
                HeaderName::from_bytes(inject.header.as_bytes()),
                HeaderValue::from_str(&value),
            ) else {
                let msg = format!(
                    "the secret {} cannot be sent in a header (it holds a line break or a \
                     control character)",
                    inject.secret
                );
                return error_response(&ApiError::new(ErrorCode::UpstreamFailed, msg));
            };
            value.set_sensitive(true);
            req.headers_mut().insert(name, value);
        }
        let upgrade = req.headers().contains_key(UPGRADE);
        crate::hop::strip_hop_by_hop(req.headers_mut(), upgrade);
        let origin_form = req
            .uri()
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .parse::<hyper::Uri>();
        match origin_form {
            Ok(u) => *req.uri_mut() = u,
            Err(_) => {
                let msg = "the request's target is not a path".to_string();
                return error_response(&ApiError::new(ErrorCode::EgressDenied, msg));
            }
        }
        if !req.headers().contains_key(HOST) {
            let default = if self.tls { 443 } else { 80 };
            let h = if self.port == default {
                self.host.clone()
            } else {
                format!("{}:{}", self.host, self.port)
            };
            if let Ok(v) = HeaderValue::from_str(&h) {
                req.headers_mut().insert(HOST, v);
            }
        }
        let down = upgrade.then(|| hyper::upgrade::on(&mut req));
        let mut resp = match self.send(req).await {
            Ok(r) => r,
            Err(e) => {
                info!(
                    sandbox = self.conn.sandbox,
                    host = self.host,
                    "egress proxy: {e}"
                );
                let msg = format!("{}: {e}", self.host);
                return error_response(&ApiError::new(ErrorCode::UpstreamFailed, msg));
            }
        };
        if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
            if let Some(down) = down {
                let up = hyper::upgrade::on(&mut resp);
                tokio::spawn(async move {
                    if let (Ok(d), Ok(u)) = (down.await, up.await) {
                        let (mut d, mut u) = (TokioIo::new(d), TokioIo::new(u));
                        let _ = tokio::io::copy_bidirectional(&mut d, &mut u).await;
                    }
                });
                return resp.map(|_| full(Bytes::new()));
            }
        }
        crate::hop::strip_hop_by_hop(resp.headers_mut(), false);
        resp.map(BodyExt::boxed)
    }

    /// Sends on the kept upstream connection, made again when it is gone.
    async fn send(&self, req: Request<Incoming>) -> Result<Response<Incoming>, ForwardError> {
        let mut slot = self.sender.lock().await;
        let kept = match slot.take() {
            Some(mut s) => s.ready().await.is_ok().then_some(s),
            None => None,
        };
        let mut sender = match kept {
            Some(s) => s,
            None => self.connect().await?,
        };
        let resp = sender.send_request(req).await;
        *slot = Some(sender);
        Ok(resp?)
    }

    async fn connect(&self) -> Result<SendRequest<Incoming>, ForwardError> {
        let target = Target::Name(self.host.clone());
        let tcp = self.conn.proxy.dialer.dial(&target, self.port).await?;
        let io: Box<dyn Io> = if self.tls {
            super::tls::connect_upstream(&self.conn, &self.host, tcp).await?
        } else {
            Box::new(tcp)
        };
        let (sender, connection) = hyper::client::conn::http1::Builder::new()
            .handshake(TokioIo::new(io))
            .await?;
        tokio::spawn(async move {
            let _ = connection.with_upgrades().await;
        });
        Ok(sender)
    }
}
