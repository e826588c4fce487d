//! `sbx-net`: what the node serves its sandboxes over the network, which speaks DNS, HTTP and
//! TLS (the core, sbx-node, speaks none of them): the DNS forwarder on the gateway, the egress
//! proxy with the node's CA, the ready checks over TCP and HTTP, and the hop-by-hop rules the
//! node's proxies (egress, previews) share. The node's binary gives [`Services`] and
//! [`probe::NetProber`] to the core when it builds the node.

#![forbid(unsafe_code)]

pub mod dns;
pub mod egress;
pub mod hop;
pub mod probe;

use std::sync::Arc;

use sbx_node::node::net::{DnsStart, GatewayServices, ProxyStart};

/// The DNS forwarder and the egress proxy, as the core's [`GatewayServices`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Services;

impl GatewayServices for Services {
    fn serve_dns(&self, d: DnsStart) -> anyhow::Result<()> {
        dns::serve(d.udp, d.tcp, d.upstreams, d.policies, d.limits)?;
        Ok(())
    }

    fn start_proxy(&self, p: ProxyStart) -> anyhow::Result<String> {
        let ca = Arc::new(egress::NodeCa::load_or_create(&p.ca_dir)?);
        let pem = ca.cert_pem().to_string();
        egress::start(
            p.listener,
            p.view,
            ca,
            egress::ProxyConfig {
                upstream_dns: p.upstream_dns,
                extra_roots: p.extra_roots,
                ca_dir: p.ca_dir,
                per_sandbox: p.per_sandbox,
                max_connections: p.max_connections,
            },
        )?;
        Ok(pem)
    }
}
