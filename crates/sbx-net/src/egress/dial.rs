//! Dialing for the proxy: names resolved through the node's DNS upstreams (never the
//! sandbox's resolver or /etc/hosts), and every address dialed checked against the node's
//! refusals first, so a name that resolves to the host, loopback or a private range is
//! refused like the address itself.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use hickory_resolver::config::{
    LookupIpStrategy, NameServerConfig, NameServerConfigGroup, ResolveHosts, ResolverConfig,
    ResolverOpts,
};
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::proto::xfer::Protocol;
use hickory_resolver::TokioResolver;
use tokio::net::TcpStream;

use super::{EgressView, Target, CONNECT_TIMEOUT};

/// Why a dial failed.
#[derive(Debug, thiserror::Error)]
pub(super) enum DialError {
    #[error("{name} could not be resolved: {why}")]
    Resolve { name: String, why: String },
    #[error("{0} is an address the node refuses")]
    Refused(String),
    #[error("{target} did not answer: {source}")]
    Connect {
        target: String,
        source: std::io::Error,
    },
    #[error("{0} did not answer within 10 s")]
    Timeout(String),
}

/// Resolves and connects.
pub(super) struct Dialer {
    resolver: TokioResolver,
    view: Arc<dyn EgressView>,
}

impl Dialer {
    pub(super) fn new(upstreams: &[SocketAddr], view: Arc<dyn EgressView>) -> Dialer {
        let mut servers = Vec::with_capacity(upstreams.len() * 2);
        for a in upstreams {
            servers.push(NameServerConfig::new(*a, Protocol::Udp));
            servers.push(NameServerConfig::new(*a, Protocol::Tcp));
        }
        let config =
            ResolverConfig::from_parts(None, Vec::new(), NameServerConfigGroup::from(servers));
        let mut opts = ResolverOpts::default();
        opts.use_hosts_file = ResolveHosts::Never;
        opts.ip_strategy = LookupIpStrategy::Ipv4thenIpv6;
        opts.timeout = std::time::Duration::from_secs(3);
        opts.attempts = 2;
        let resolver =
            TokioResolver::builder_with_config(config, TokioConnectionProvider::default())
                .with_options(opts)
                .build();
        Dialer { resolver, view }
    }

    /// The addresses of `target` the node does not refuse, in the resolver's order.
    pub(super) async fn addresses(&self, target: &Target) -> Result<Vec<IpAddr>, DialError> {
        let all: Vec<IpAddr> = match target {
            Target::Ip(ip) => vec![*ip],
            Target::Name(name) => {
                // Absolute: no search domain is ever tried.
                let fqdn = format!("{name}.");
                let found =
                    self.resolver
                        .lookup_ip(fqdn)
                        .await
                        .map_err(|e| DialError::Resolve {
                            name: name.clone(),
                            why: e.to_string(),
                        })?;
                found.iter().collect()
            }
        };
        if all.is_empty() {
            return Err(DialError::Resolve {
                name: target.to_string(),
                why: "no address".into(),
            });
        }
        let open: Vec<IpAddr> = all
            .into_iter()
            .filter(|ip| !self.view.refused(*ip))
            .collect();
        if open.is_empty() {
            return Err(DialError::Refused(target.to_string()));
        }
        Ok(open)
    }

    /// A connection to `target`:`port` (each address the node allows in turn, 10 s in all).
    pub(super) async fn dial(&self, target: &Target, port: u16) -> Result<TcpStream, DialError> {
        let attempt = async {
            let addrs = self.addresses(target).await?;
            let mut last = None;
            for ip in addrs {
                match TcpStream::connect(SocketAddr::new(ip, port)).await {
                    Ok(s) => {
                        let _ = s.set_nodelay(true);
                        return Ok(s);
                    }
                    Err(e) => last = Some(e),
                }
            }
            Err(DialError::Connect {
                target: format!("{target}:{port}"),
                source: last.unwrap_or_else(|| std::io::ErrorKind::NotFound.into()),
            })
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, attempt).await {
            Ok(r) => r,
            Err(_) => Err(DialError::Timeout(format!("{target}:{port}"))),
        }
    }
}
