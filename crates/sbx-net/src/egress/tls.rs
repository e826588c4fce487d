//! TLS connections of a sandbox: the ClientHello read (and kept, byte for byte) with rustls'
//! `Acceptor`, decided by its server name, then passed through untouched or, for an
//! inspected name, terminated with a certificate of the node's CA and served as HTTP.

use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::server::Acceptor;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use sbx_api::egress::Verdict;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tracing::{debug, info};

use super::io::{Io, Prefixed};
use super::{Conn, EgressError, Target, HEAD_TIMEOUT, MAX_HEAD};

/// Why a TLS connection ended before it was served.
#[derive(Debug, thiserror::Error)]
pub(super) enum TlsError {
    #[error("the sandbox closed the connection before its ClientHello")]
    Closed,
    #[error("the TLS handshake took too long")]
    Timeout,
    #[error("the ClientHello is over 64 KiB")]
    TooLarge,
    #[error("the ClientHello cannot be read: {0}")]
    Hello(rustls::Error),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0} is not a valid TLS server name")]
    Name(String),
}

/// The crypto the proxy uses (ring), named rather than the process default: more than one
/// provider is built into the node.
pub(super) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The client side toward inspected upstreams: the real roots (webpki-roots) and the PEM
/// CAs of `extra_roots`; HTTP/1.1.
pub(super) fn upstream_config(
    extra_roots: Option<&Path>,
) -> Result<Arc<ClientConfig>, EgressError> {
    let mut roots = RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = extra_roots {
        let bad = |why: String| EgressError::Roots {
            path: path.to_path_buf(),
            why,
        };
        let mut n = 0;
        for cert in CertificateDer::pem_file_iter(path).map_err(|e| bad(e.to_string()))? {
            let cert = cert.map_err(|e| bad(e.to_string()))?;
            roots.add(cert).map_err(|e| bad(e.to_string()))?;
            n += 1;
        }
        if n == 0 {
            return Err(bad("holds no PEM certificate".into()));
        }
    }
    let mut cfg = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// The ClientHello's bytes as read, and its server name.
async fn read_hello(stream: &mut TcpStream) -> Result<(Vec<u8>, Option<String>), TlsError> {
    let mut acceptor = Acceptor::default();
    let mut seen = Vec::new();
    let mut buf = vec![0u8; 8192];
    loop {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Err(TlsError::Closed);
        }
        seen.extend_from_slice(&buf[..n]);
        if seen.len() > MAX_HEAD {
            return Err(TlsError::TooLarge);
        }
        let mut rest = &buf[..n];
        while !rest.is_empty() {
            if acceptor.read_tls(&mut rest)? == 0 {
                return Err(TlsError::TooLarge);
            }
        }
        match acceptor.accept() {
            Ok(None) => continue,
            Ok(Some(accepted)) => {
                let sni = accepted.client_hello().server_name().map(str::to_owned);
                return Ok((seen, sni));
            }
            Err((e, _alert)) => return Err(TlsError::Hello(e)),
        }
    }
}

/// Serves a connection that starts with a TLS handshake record.
pub(super) async fn serve(conn: Arc<Conn>, mut stream: TcpStream) {
    let (hello, sni) = match tokio::time::timeout(HEAD_TIMEOUT, read_hello(&mut stream)).await {
        Ok(Ok(h)) => h,
        Ok(Err(e)) => {
            debug!(sandbox = conn.sandbox, "egress proxy: TLS: {e}");
            return;
        }
        Err(_) => {
            debug!(
                sandbox = conn.sandbox,
                "egress proxy: TLS: {}",
                TlsError::Timeout
            );
            return;
        }
    };
    let port = conn.orig.port();
    let target = match sni.as_deref().map(Target::parse) {
        Some(Some(t)) => t,
        Some(None) => {
            info!(
                sandbox = conn.sandbox,
                "egress proxy: TLS server name not a host: closed"
            );
            return;
        }
        None => Target::Ip(IpAddr::V4(*conn.orig.ip())),
    };
    if target.verdict(&conn.rules) == Verdict::Deny {
        info!(sandbox = conn.sandbox, host = %target, "egress proxy: TLS denied");
        return;
    }
    if let Some(host) = target.inspected(&conn.rules) {
        let host = host.to_string();
        if let Err(e) = inspect(&conn, stream, hello, host.clone(), port).await {
            debug!(
                sandbox = conn.sandbox,
                host, "egress proxy: TLS inspect: {e}"
            );
        }
        return;
    }
    pass_through(&conn, stream, &hello, &target, port).await;
}

/// Dials `target` and copies both ways, `first` written first.
pub(super) async fn pass_through(
    conn: &Conn,
    mut stream: TcpStream,
    first: &[u8],
    target: &Target,
    port: u16,
) {
    let mut up = match conn.proxy.dialer.dial(target, port).await {
        Ok(s) => s,
        Err(e) => {
            info!(sandbox = conn.sandbox, "egress proxy: {e}");
            return;
        }
    };
    if up.write_all(first).await.is_err() {
        return;
    }
    let _ = tokio::io::copy_bidirectional(&mut stream, &mut up).await;
}

/// Ends TLS here with a leaf of the node's CA for `host`, then serves HTTP.
async fn inspect(
    conn: &Arc<Conn>,
    stream: TcpStream,
    hello: Vec<u8>,
    host: String,
    port: u16,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let leaf = conn.proxy.ca.leaf(&host)?;
    let mut cfg = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(rustls::sign::SingleCertAndKey::from(leaf)));
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tls = tokio::time::timeout(
        HEAD_TIMEOUT,
        TlsAcceptor::from(Arc::new(cfg)).accept(Prefixed::new(hello, stream)),
    )
    .await
    .map_err(|_| TlsError::Timeout)??;
    super::http::serve_inspected(conn.clone(), Box::new(tls), host, port, true).await;
    Ok(())
}

/// A TLS connection to an inspected upstream, verified against the roots.
pub(super) async fn connect_upstream(
    conn: &Conn,
    host: &str,
    tcp: TcpStream,
) -> Result<Box<dyn Io>, TlsError> {
    let name =
        ServerName::try_from(host.to_string()).map_err(|_| TlsError::Name(host.to_string()))?;
    let tls = tokio::time::timeout(
        super::CONNECT_TIMEOUT,
        TlsConnector::from(conn.proxy.upstream_tls.clone()).connect(name, tcp),
    )
    .await
    .map_err(|_| TlsError::Timeout)??;
    Ok(Box::new(tls))
}
