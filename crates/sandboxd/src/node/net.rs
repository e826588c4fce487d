//! The node's side of sandbox networking (sbx-runtime's `net` does the kernel's): the
//! `Network` (the nft table, the pool of ready namespaces), each sandbox's lease for its life,
//! and the DNS forwarder on the gateway that the sandboxes' resolv.conf names.
//!
//! A sandbox with network is made in a leased namespace (`SandboxSpec::netns`): a veth to the
//! node, its own address, a default route to the gateway, NAT out; refused whatever else:
//! the host (but the gateway's DNS), other sandboxes, loopback, link-local and the private
//! ranges (but what `--egress-allow-cidr` opens). Taking a lease is one nft element (tens of
//! microseconds); making namespaces happens off the request path, in the pool's thread.

use std::collections::HashMap;
use std::net::{SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use sbx_runtime::net::{Lease, NetConfig, Network, Proto};

use crate::sync::LockExt;

/// The node's network: `None` in a node of `--egress-default none` (every sandbox has `lo`
/// only).
pub struct NodeNet {
    network: Network,
    leases: Mutex<HashMap<String, Lease>>,
    resolv_conf: String,
}

/// What `--egress-*` and `--net-*` set.
#[derive(Debug, Clone)]
pub struct NetSettings {
    pub table: String,
    pub prefix: String,
    pub range: ipnet::Ipv4Net,
    pub allow: Vec<ipnet::Ipv4Net>,
    pub dns_upstreams: Vec<SocketAddr>,
    pub pool: usize,
}

impl NodeNet {
    /// Loads the node's table, turns forwarding on, starts the DNS forwarder on the gateway
    /// (call inside the runtime).
    pub fn start(s: NetSettings) -> anyhow::Result<Arc<NodeNet>> {
        sbx_runtime::net::set_ipv4_forwarding(true)?;
        let network = Network::new(NetConfig {
            table: s.table,
            prefix: s.prefix,
            range: s.range,
            gateway_ports: vec![(Proto::Udp, 53), (Proto::Tcp, 53)],
            allow: s.allow,
            refuse: Vec::new(),
            pool: s.pool,
        })?;
        let gw = network.gateway();
        let (udp, tcp) = sbx_runtime::net::bind_gateway(SocketAddrV4::new(gw, 53))?;
        let upstreams = if s.dns_upstreams.is_empty() {
            super::dns::host_upstreams()
        } else {
            s.dns_upstreams
        };
        tracing::info!(gateway = %gw, ?upstreams, "network: DNS on the gateway");
        super::dns::serve(udp, tcp, upstreams)?;
        Ok(Arc::new(NodeNet {
            network,
            leases: Mutex::new(HashMap::new()),
            resolv_conf: format!("nameserver {gw}\noptions edns0\n"),
        }))
    }

    /// A namespace for sandbox `id`, held until [`NodeNet::release`]: its path (for
    /// `SandboxSpec::netns`) and the resolv.conf naming the node's DNS.
    pub fn take(&self, id: &str) -> Result<(PathBuf, String), sbx_runtime::net::NetError> {
        let lease = self.network.take()?;
        let path = lease.ns_path();
        self.leases.locked().insert(id.to_string(), lease);
        Ok((path, self.resolv_conf.clone()))
    }

    /// Gives back sandbox `id`'s namespace (after its processes are gone).
    pub fn release(&self, id: &str) {
        let lease = self.leases.locked().remove(id);
        if let Some(lease) = lease {
            if let Err(e) = self.network.release(lease) {
                tracing::warn!(sandbox = %id, error = %e, "network: release");
            }
        }
    }

    /// Takes back the namespace of a sandbox a previous node made (after a restart); a
    /// sandbox with `lo` only has none to take.
    pub fn adopt(&self, id: &str, sb: &sbx_runtime::Sandbox) {
        let Ok(handle) = sb.netns_handle() else {
            return;
        };
        match self.network.adopt(handle) {
            Ok(lease) => {
                self.leases.locked().insert(id.to_string(), lease);
            }
            Err(e) => tracing::debug!(sandbox = %id, error = %e, "network: not adopted"),
        }
    }

    /// Removes what a previous node left that no sandbox holds (interfaces, elements,
    /// conntrack entries); call after every adoption.
    pub fn remove_leftovers(&self) {
        match self.network.remove_leftovers() {
            Ok(a) if !a.leftover_interfaces.is_empty() || !a.leftover_elements.is_empty() => {
                tracing::info!(
                    interfaces = a.leftover_interfaces.len(),
                    elements = a.leftover_elements.len(),
                    "network: removed what a previous run left"
                );
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "network: leftovers"),
        }
    }

    /// Removes the node's table (at a stop that leaves no sandbox running).
    pub fn uninstall(&self) {
        if let Err(e) = self.network.uninstall() {
            tracing::debug!(error = %e, "network: uninstall");
        }
    }

    /// The gateway, the leases held and the namespaces ready, for `GET /internal/node`.
    pub fn info(&self) -> serde_json::Value {
        serde_json::json!({
            "gateway": self.network.gateway().to_string(),
            "range": self.network.config().range.to_string(),
            "table": self.network.config().table,
            "interface_prefix": self.network.config().prefix,
            "ready": self.network.ready(),
            "leased": self.leases.locked().len(),
        })
    }
}
