//! The node's egress proxy (issue #13): the kernel sends every TCP connection of a proxied
//! sandbox to ports 80 and 443 here (DNAT to the gateway's proxy port), and the proxy decides
//! by name what the kernel can only decide by address.
//!
//! Per connection (the peer is the sandbox's own address; the rules are read again from the
//! [`EgressView`] at each new connection, so they change live):
//!
//! - A TLS handshake (first byte 0x16): the ClientHello is read (rustls' `Acceptor`, the bytes
//!   kept). With a server name (SNI) the rules decide by name; without one (a literal
//!   address) by the original destination's address. Denied: closed. Allowed and not
//!   inspected: the proxy dials the name itself (resolved through the node's DNS upstreams,
//!   never the address the sandbox chose), writes the ClientHello it read and copies both
//!   ways: the sandbox sees the real server's certificate. Inspected (an `http` or `inject`
//!   rule names the host): TLS ends at the proxy with a certificate for the name minted by
//!   the node's CA ([`NodeCa`]), and the requests are served as inspected HTTP, forwarded over
//!   TLS verified against the real roots and `--egress-ca-file`.
//! - Anything else is read as HTTP/1: the request head (64 KiB, 30 s), its Host decides.
//!   Denied: `403 egress_denied`. Allowed and not inspected: the proxy dials the host, writes
//!   the head it read and copies both ways. Inspected: each request is checked against the
//!   `http` rules (`403 egress_denied`), gets its `inject` headers (the secrets' values never
//!   go to a log or an answer; a secret gone: `502 upstream_failed`) and is forwarded, bodies
//!   streamed.
//! - Only connections the kernel sent here are served: one whose original destination is
//!   the proxy's own address (a sandbox that dialed the gateway's proxy port itself) is
//!   closed, or the proxy would dial its Host on that port past the sandbox's rules.
//! - Connections are served in fair shares: at most `per_sandbox` of one sandbox and
//!   `max_connections` of all at once; one past either is closed at once, never queued
//!   ahead of another sandbox's ([`share::Shares`]).
//! - Every address the proxy dials passes [`EgressView::refused`] (a name resolving to
//!   10.x, 127.x or 169.254.x is refused like the address itself). A failed dial or lookup:
//!   `502 upstream_failed` for HTTP, a closed connection for TLS.

mod ca;
mod dial;
mod http;
mod io;
pub mod share;
mod tls;

#[cfg(test)]
mod tests;

use std::net::{IpAddr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sbx_api::egress::{Egress, Verdict};
use tokio::net::TcpStream;
use tracing::{debug, warn};

pub use ca::NodeCa;

pub use sbx_node::node::net::EgressView;

/// The proxy's settings.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// Where names are resolved (the node's DNS upstreams).
    pub upstream_dns: Vec<SocketAddr>,
    /// `--egress-ca-file`: PEM CAs trusted besides the real roots, for upstream TLS.
    pub extra_roots: Option<PathBuf>,
    /// Where the node's CA is kept (DATA_DIR).
    pub ca_dir: PathBuf,
    /// Most connections of one sandbox served at once.
    pub per_sandbox: usize,
    /// Most connections served at once.
    pub max_connections: usize,
}

/// How the proxy learns where a connection was going: `sbx_runtime::net::original_dst` in
/// the node; injectable for tests.
pub type OrigDst = Arc<dyn Fn(&TcpStream) -> std::io::Result<SocketAddrV4> + Send + Sync>;

/// What starting the proxy or its CA can fail with.
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    #[error("egress CA {path}: {source}")]
    CaIo {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("egress CA {path}: {why}")]
    CaBad { path: PathBuf, why: String },
    #[error("egress CA: {0}")]
    Cert(#[from] rcgen::Error),
    #[error("egress CA file {path}: {why}")]
    Roots { path: PathBuf, why: String },
    #[error("egress TLS: {0}")]
    Tls(#[from] rustls::Error),
    #[error("egress proxy listener: {0}")]
    Listener(std::io::Error),
}

/// Connect timeout for every dial.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Time a sandbox has to send its request head or its ClientHello.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
/// Most bytes of a request head or a ClientHello.
pub const MAX_HEAD: usize = 64 * 1024;
/// Most connections served at once (more are closed at once).
pub const MAX_CONNECTIONS: usize = sbx_node::node::net::PROXY_MAX_CONNECTIONS;
/// Most connections of one sandbox served at once (`--egress-proxy-per-sandbox`).
pub const PER_SANDBOX: usize = sbx_node::node::net::PROXY_PER_SANDBOX;

/// Starts serving on `listener` (already bound by the node, on the gateway address) on the
/// current tokio runtime. The original destination is read with
/// `sbx_runtime::net::original_dst`.
#[cfg_attr(test, allow(dead_code))] // the tests inject the original destination
pub fn start(
    listener: std::net::TcpListener,
    view: Arc<dyn EgressView>,
    ca: Arc<NodeCa>,
    cfg: ProxyConfig,
) -> Result<(), EgressError> {
    let orig: OrigDst = Arc::new(|s: &TcpStream| sbx_runtime::net::original_dst(s));
    start_with(listener, view, ca, cfg, orig)
}

/// [`start`] with the original destination's lookup given.
pub fn start_with(
    listener: std::net::TcpListener,
    view: Arc<dyn EgressView>,
    ca: Arc<NodeCa>,
    cfg: ProxyConfig,
    orig: OrigDst,
) -> Result<(), EgressError> {
    listener
        .set_nonblocking(true)
        .map_err(EgressError::Listener)?;
    let listener = tokio::net::TcpListener::from_std(listener).map_err(EgressError::Listener)?;
    let upstream_tls = tls::upstream_config(cfg.extra_roots.as_deref())?;
    debug!(
        ca = %cfg.ca_dir.join(ca::CA_CERT_FILE).display(),
        dns = ?cfg.upstream_dns,
        "egress proxy: serving"
    );
    let proxy = Arc::new(Proxy {
        dialer: dial::Dialer::new(&cfg.upstream_dns, view.clone()),
        view,
        ca,
        upstream_tls,
        orig,
    });
    let shares = share::Shares::new(cfg.per_sandbox, cfg.max_connections);
    tokio::spawn(accept_loop(listener, proxy, shares));
    Ok(())
}

/// What every connection shares.
struct Proxy {
    view: Arc<dyn EgressView>,
    ca: Arc<NodeCa>,
    dialer: dial::Dialer,
    upstream_tls: Arc<rustls::ClientConfig>,
    orig: OrigDst,
}

/// One accepted connection: whose, its rules, where it was going.
struct Conn {
    proxy: Arc<Proxy>,
    sandbox: String,
    rules: Arc<Egress>,
    orig: SocketAddrV4,
}

/// What a connection asks for: a name or a literal address.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Target {
    Name(String),
    Ip(IpAddr),
}

impl Target {
    /// A host as written in a Host header or an SNI (no port): an address or a name
    /// (lower-cased, no trailing dot); None: neither.
    fn parse(host: &str) -> Option<Target> {
        let h = host.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = h.parse::<IpAddr>() {
            return Some(Target::Ip(ip));
        }
        let name = sbx_api::egress::normal_host(host);
        sbx_api::egress::valid_dns_name(&name).then_some(Target::Name(name))
    }

    fn verdict(&self, rules: &Egress) -> Verdict {
        match self {
            Target::Name(n) => rules.name(n),
            Target::Ip(ip) => rules.ip(*ip),
        }
    }

    /// Whether requests to it are read (only names have `http` / `inject` rules).
    fn inspected(&self, rules: &Egress) -> Option<&str> {
        match self {
            Target::Name(n) if rules.inspects(n) => Some(n),
            _ => None,
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Name(n) => f.write_str(n),
            Target::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    proxy: Arc<Proxy>,
    shares: Arc<share::Shares>,
) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                // Past its share (or everybody's): closed now, so that the others' go on.
                let Some(slot) = shares.take(peer.ip()) else {
                    debug!(%peer, "egress proxy: the sandbox's share of connections is full, closed");
                    drop(stream);
                    continue;
                };
                let proxy = proxy.clone();
                tokio::spawn(async move {
                    serve(proxy, stream, peer).await;
                    drop(slot);
                });
            }
            Err(e) => {
                // EMFILE and the like: wait for connections to end rather than spin.
                warn!("egress proxy: accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn serve(proxy: Arc<Proxy>, stream: TcpStream, peer: SocketAddr) {
    let IpAddr::V4(addr) = peer.ip() else {
        return;
    };
    let Some((sandbox, rules)) = proxy.view.rules_of(addr) else {
        debug!(%peer, "egress proxy: not a sandbox's connection, closed");
        return;
    };
    let orig = match (proxy.orig)(&stream) {
        Ok(o) => o,
        Err(e) => {
            warn!(sandbox, "egress proxy: original destination unknown: {e}");
            return;
        }
    };
    // Not redirected by the kernel: the sandbox dialed the proxy's port itself.
    if stream.local_addr().ok() == Some(SocketAddr::V4(orig)) {
        debug!(
            sandbox,
            "egress proxy: a connection to the proxy itself, closed"
        );
        return;
    }
    if rules.deny_ports.contains(&orig.port()) {
        debug!(
            sandbox,
            port = orig.port(),
            "egress proxy: port denied, closed"
        );
        return;
    }
    let _ = stream.set_nodelay(true);
    let mut first = [0u8; 1];
    match tokio::time::timeout(HEAD_TIMEOUT, stream.peek(&mut first)).await {
        Ok(Ok(1..)) => {}
        _ => return,
    }
    let conn = Arc::new(Conn {
        proxy,
        sandbox,
        rules,
        orig,
    });
    if first[0] == 0x16 {
        tls::serve(conn, stream).await;
    } else {
        http::serve(conn, stream).await;
    }
}
