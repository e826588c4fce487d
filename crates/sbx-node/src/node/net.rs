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
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};

use sbx_api::egress::{Egress, Verdict};
use sbx_runtime::net::{Lease, NetConfig, Network, Proto, SandboxRules};

use crate::sync::LockExt;

/// The node's network: `None` in a node of `--egress-default none` (every sandbox has `lo`
/// only).
pub struct NodeNet {
    network: Network,
    leases: Mutex<HashMap<String, Lease>>,
    /// Sandboxes whose namespace had sysctls of theirs written (`runtime.sysctls`): it never
    /// goes back to the pool for another sandbox.
    no_recycle: Mutex<std::collections::HashSet<String>>,
    resolv_conf: String,
    policies: Arc<Policies>,
    ca_bundle: Option<PathBuf>,
    limits: NetLimits,
}

/// Where a sandbox's CA bundle is (the node's bundle is mounted over it).
pub(crate) const SANDBOX_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
/// The variables that point TLS clients at it (OpenSSL, Python's requests and pip, curl,
/// Node), set where the image has the bundle and does not set them itself.
pub(crate) const CA_ENV: [&str; 4] = [
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
];

/// The egress rules of the sandboxes that have some, by address: what the node's DNS and its
/// egress proxy ask of each connection or question.
#[derive(Default)]
pub struct Policies {
    by_addr: RwLock<HashMap<Ipv4Addr, (String, Arc<Egress>)>>,
}

impl Policies {
    /// The sandbox at `addr` and its rules (`None`: a sandbox without rules, or none).
    pub fn get(&self, addr: Ipv4Addr) -> Option<(String, Arc<Egress>)> {
        self.by_addr
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&addr)
            .cloned()
    }

    /// Whether the sandbox at `from` may have `name` resolved.
    pub fn name_allowed(&self, from: IpAddr, name: &str) -> bool {
        let IpAddr::V4(a) = from else {
            return true;
        };
        match self.get(a) {
            Some((_, e)) => !e.restricts_names() || e.name(name) == Verdict::Allow,
            None => true,
        }
    }

    fn set(&self, addr: Ipv4Addr, v: Option<(String, Arc<Egress>)>) {
        let mut m = self
            .by_addr
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match v {
            Some(v) => m.insert(addr, v),
            None => m.remove(&addr),
        };
    }
}

/// What the kernel enforces of `e`; `None` when it holds nothing more than the node's rules.
pub(crate) fn kernel_rules(e: &Egress) -> Option<SandboxRules> {
    let r = SandboxRules {
        default_deny: e.default_deny,
        exceptions: e.exceptions4(),
        deny_ports: e.deny_ports.clone(),
        proxied: e.proxied(),
        restrict_names: e.restricts_names(),
    };
    (r != SandboxRules::default()).then_some(r)
}

/// What `--egress-*` and `--net-*` set.
#[derive(Clone)]
pub struct NetSettings {
    pub table: String,
    pub prefix: String,
    pub range: ipnet::Ipv4Net,
    pub allow: Vec<ipnet::Ipv4Net>,
    /// Where the node's DNS asks (the caller resolves the host's own when none is given).
    pub dns_upstreams: Vec<SocketAddr>,
    pub pool: usize,
    /// Where the node's egress CA and the sandboxes' CA bundle are kept.
    pub data_dir: PathBuf,
    /// `--egress-ca-file`.
    pub extra_roots: Option<PathBuf>,
    /// A secret's value by name, for the egress proxy's inject.
    pub secrets: SecretLookup,
    /// What one sandbox may take of the node's DNS, its proxy and the conntrack table.
    pub limits: NetLimits,
    /// The DNS forwarder and the egress proxy (sbx-net's).
    pub services: Arc<dyn GatewayServices>,
}

/// What one sandbox may hold at once of what the sandboxes share: the host's conntrack table
/// (the kernel counts, by its source address), the node's DNS and its egress proxy (the node
/// counts, by peer address). Past a limit a new connection is dropped or closed and a
/// question answered SERVFAIL at once; the other sandboxes' go on.
#[derive(Clone, Debug)]
pub struct NetLimits {
    /// Connections in the host's conntrack table (`--net-ct-per-sandbox`; 0: no limit).
    pub ct_per_sandbox: u32,
    /// The node's DNS.
    pub dns: DnsLimits,
    /// Connections at the egress proxy (`--egress-proxy-per-sandbox`).
    pub proxy_per_sandbox: usize,
}

impl Default for NetLimits {
    fn default() -> Self {
        NetLimits {
            ct_per_sandbox: sbx_runtime::net::DEFAULT_CT_LIMIT,
            dns: DnsLimits::default(),
            proxy_per_sandbox: PROXY_PER_SANDBOX,
        }
    }
}

/// A secret's value by name (`None`: no such secret).
pub(crate) type SecretLookup = Arc<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// What one sandbox, and all of them, may have of the node's DNS at once.
#[derive(Clone, Debug)]
pub struct DnsLimits {
    /// Questions over UDP waiting for an upstream, of one sandbox (`--dns-in-flight-per-sandbox`).
    pub udp_per_sandbox: usize,
    /// The same, of all (each is a socket of the node's).
    pub udp_total: usize,
    /// TCP connections of one sandbox (`--dns-tcp-per-sandbox`).
    pub tcp_per_sandbox: usize,
    /// TCP connections of all.
    pub tcp_total: usize,
    /// A TCP connection that sends no whole question this long is closed (`--dns-tcp-idle-ms`).
    pub tcp_idle: std::time::Duration,
}

impl Default for DnsLimits {
    fn default() -> Self {
        DnsLimits {
            udp_per_sandbox: 32,
            udp_total: 256,
            tcp_per_sandbox: 16,
            tcp_total: 256,
            tcp_idle: std::time::Duration::from_secs(5),
        }
    }
}

/// Most connections the egress proxy serves at once (more are closed at once).
pub const PROXY_MAX_CONNECTIONS: usize = 8192;
/// Most connections of one sandbox it serves at once (`--egress-proxy-per-sandbox`).
pub const PROXY_PER_SANDBOX: usize = 1024;

/// What the egress proxy asks of the node.
pub trait EgressView: Send + Sync + 'static {
    /// The sandbox at this address: its id and its rules; None: not a sandbox of the node
    /// (refuse the connection).
    fn rules_of(&self, addr: Ipv4Addr) -> Option<(String, Arc<Egress>)>;
    /// A secret's value by name (None: there is no such secret any more).
    fn secret(&self, name: &str) -> Option<String>;
    /// Whether the node refuses this address whatever a sandbox's rules say (the host, other
    /// sandboxes, loopback, link-local, private ranges not opened by the operator...).
    fn refused(&self, ip: IpAddr) -> bool;
}

/// The DNS forwarder's start: its sockets on the gateway, where it asks, the rules it reads.
pub struct DnsStart {
    pub udp: std::net::UdpSocket,
    pub tcp: std::net::TcpListener,
    pub upstreams: Vec<SocketAddr>,
    pub policies: Arc<Policies>,
    pub limits: DnsLimits,
}

/// The egress proxy's start: its listener on the gateway and its settings.
pub struct ProxyStart {
    pub listener: std::net::TcpListener,
    pub view: Arc<dyn EgressView>,
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

/// The services the node runs on its sandboxes' gateway, which speak DNS, HTTP and TLS: made
/// outside the core (sbx-net) and given to [`NodeNet::start`]. Both serve on the current tokio
/// runtime until it ends.
pub trait GatewayServices: Send + Sync + 'static {
    /// Starts the DNS forwarder.
    fn serve_dns(&self, dns: DnsStart) -> anyhow::Result<()>;
    /// Starts the egress proxy; the PEM of its CA, which sandboxes are to trust.
    fn start_proxy(&self, proxy: ProxyStart) -> anyhow::Result<String>;
}

/// What the egress proxy asks of the node.
struct View {
    policies: Arc<Policies>,
    secrets: SecretLookup,
    refused: Arc<dyn Fn(IpAddr) -> bool + Send + Sync>,
}

impl EgressView for View {
    fn rules_of(&self, addr: Ipv4Addr) -> Option<(String, Arc<Egress>)> {
        self.policies.get(addr)
    }

    fn secret(&self, name: &str) -> Option<String> {
        (self.secrets)(name)
    }

    fn refused(&self, ip: IpAddr) -> bool {
        // The node's refusals, and any address of the host itself (the proxy dials from the
        // host: a name resolving to one of its public addresses must not reach its services).
        (self.refused)(ip) || std::net::UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
    }
}

/// A directory of the node's for files anybody may read (the sandboxes' CA bundle, nothing
/// secret): `/run/sbx/<table>`, root's, mode 0755, made if missing; refused when it (or
/// `/run/sbx`) is not a real directory of root's.
fn public_dir(table: &str) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let base = PathBuf::from("/run/sbx");
    let dir = base.join(table);
    for d in [&base, &dir] {
        match std::fs::create_dir(d) {
            Ok(()) => std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))?,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        let m = std::fs::symlink_metadata(d)?;
        if !m.is_dir() || m.uid() != 0 || m.mode() & 0o022 != 0 {
            return Err(std::io::Error::other(format!(
                "{} is not a directory only root may write",
                d.display()
            )));
        }
    }
    Ok(dir)
}

/// The host's CA bundle (Debian's place, else none) and the node's CA, in one file for the
/// sandboxes: `egress-ca-bundle-<hash of its bytes>.pem`, written (to a temporary name, then
/// renamed) only when no file of that name is there. A file a sandbox binds is never replaced
/// or removed while the sandbox lives: a restart writes the same bytes under the same name (or,
/// when the host's roots or the CA changed, a new name beside it), so a sandbox made before
/// keeps a live file bound, which CRIU can checkpoint (a bind of a deleted file cannot be
/// restored: "Can't re-create deleted file"). The files go with /run at the host's reboot,
/// with every sandbox that bound them.
fn write_bundle(dir: &std::path::Path, ca_pem: &str) -> std::io::Result<PathBuf> {
    use sha2::Digest;
    let host = std::fs::read_to_string(SANDBOX_CA_BUNDLE).unwrap_or_default();
    let mut text = host;
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(ca_pem);
    let hash = sha2::Sha256::digest(text.as_bytes());
    let name: String = hash[..8].iter().map(|b| format!("{b:02x}")).collect();
    let path = dir.join(format!("egress-ca-bundle-{name}.pem"));
    if std::fs::read(&path).is_ok_and(|b| b == text.as_bytes()) {
        return Ok(path);
    }
    let tmp = dir.join(format!(
        "egress-ca-bundle-{name}.pem.{}.tmp",
        std::process::id()
    ));
    std::fs::write(&tmp, text)?;
    std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
    // Over a file of this name only where its bytes are not the name's (never one a sandbox
    // was given: that one was whole when it was renamed there).
    std::fs::rename(&tmp, &path)?;
    Ok(path)
}

/// The egress proxy's port on the gateway.
pub(crate) const PROXY_PORT: u16 = 3129;

impl NodeNet {
    /// Loads the node's table, turns forwarding on, starts the DNS forwarder on the gateway
    /// (call inside the runtime).
    pub fn start(s: NetSettings) -> anyhow::Result<Arc<NodeNet>> {
        sbx_runtime::net::set_ipv4_forwarding(true)?;
        let public = public_dir(&s.table)?;
        let network = Network::new(NetConfig {
            table: s.table,
            prefix: s.prefix,
            range: s.range,
            gateway_ports: vec![(Proto::Udp, 53), (Proto::Tcp, 53), (Proto::Tcp, PROXY_PORT)],
            allow: s.allow,
            refuse: Vec::new(),
            proxy_port: Some(PROXY_PORT),
            pool: s.pool,
            ct_limit: s.limits.ct_per_sandbox,
        })?;
        let gw = network.gateway();
        let (udp, tcp) = sbx_runtime::net::bind_gateway(SocketAddrV4::new(gw, 53))?;
        let upstreams = s.dns_upstreams;
        tracing::info!(gateway = %gw, ?upstreams, "network: DNS on the gateway");
        let policies = Arc::new(Policies::default());
        s.services.serve_dns(DnsStart {
            udp,
            tcp,
            upstreams: upstreams.clone(),
            policies: policies.clone(),
            limits: s.limits.dns.clone(),
        })?;
        let (_, proxy) = sbx_runtime::net::bind_gateway(SocketAddrV4::new(gw, PROXY_PORT))?;
        let view = Arc::new(View {
            policies: policies.clone(),
            secrets: s.secrets.clone(),
            refused: network.refusals(),
        });
        // The egress proxy, with the node's CA (made once, kept in the data directory).
        let ca_pem = s.services.start_proxy(ProxyStart {
            listener: proxy,
            view,
            upstream_dns: upstreams,
            extra_roots: s.extra_roots.clone(),
            ca_dir: s.data_dir.clone(),
            per_sandbox: s.limits.proxy_per_sandbox,
            max_connections: PROXY_MAX_CONNECTIONS,
        })?;
        // Outside the node's private data directory: a checkpoint's restore binds it into the
        // sandbox again from inside the sandbox's user namespace, which must reach it.
        let ca_bundle = write_bundle(&public, &ca_pem)?;
        Ok(Arc::new(NodeNet {
            network,
            leases: Mutex::new(HashMap::new()),
            no_recycle: Mutex::new(std::collections::HashSet::new()),
            resolv_conf: format!("nameserver {gw}\noptions edns0\n"),
            policies,
            ca_bundle: Some(ca_bundle),
            limits: s.limits,
        }))
    }

    /// A namespace for sandbox `id`, held until [`NodeNet::release`], put in `spec`: its
    /// path, the resolv.conf naming the node's DNS, the CA bundle that trusts the node's
    /// egress CA (and the variables that name it, where the image has a bundle).
    pub fn take(
        &self,
        id: &str,
        spec: &mut sbx_runtime::SandboxSpec,
    ) -> Result<(), sbx_runtime::net::NetError> {
        let lease = self.network.take()?;
        spec.netns = Some(lease.ns_path());
        self.leases.locked().insert(id.to_string(), lease);
        // Its init writes them in this namespace, which is then its alone.
        if spec.runtime.sets_net_sysctls() {
            self.no_recycle.locked().insert(id.to_string());
        }
        self.fill_spec(spec);
        Ok(())
    }

    /// For a sandbox that wakes: the namespace it kept while it slept, or a new one when it
    /// has none (after the node's restart: then true). Where it is.
    pub(crate) fn keep_or_take(
        &self,
        id: &str,
        spec: &mut sbx_runtime::SandboxSpec,
    ) -> Result<(crate::node::checkpoint::NetPlace, bool), sbx_runtime::net::NetError> {
        let fresh = !self.leases.locked().contains_key(id);
        if fresh {
            self.take(id, spec)?;
        } else {
            self.fill_spec(spec);
        }
        let leases = self.leases.locked();
        let l = leases.get(id).ok_or(sbx_runtime::net::NetError::NotOurs)?;
        spec.netns = Some(l.ns_path());
        Ok((l.relinker(), fresh))
    }

    /// A sandbox's DNS and CA bundle (its image's, where it has one).
    fn fill_spec(&self, spec: &mut sbx_runtime::SandboxSpec) {
        // `runtime.dns`'s, where the caller wrote one.
        if spec.resolv_conf.is_none() {
            spec.resolv_conf = Some(self.resolv_conf.clone());
        }
        if let Some(bundle) = &self.ca_bundle {
            let rel = SANDBOX_CA_BUNDLE.trim_start_matches('/');
            if spec.lowers.iter().any(|l| l.join(rel).is_file()) {
                spec.ca_bundle = Some(bundle.clone());
                for var in CA_ENV {
                    if !spec.image_env.iter().any(|(k, _)| k == var) {
                        spec.image_env
                            .push((var.to_string(), SANDBOX_CA_BUNDLE.to_string()));
                    }
                }
            }
        }
    }

    /// Puts sandbox `id`'s egress rules in force (`None`: none of its own): the kernel's part
    /// in one transaction, then what its DNS and proxy read.
    pub(crate) fn set_egress(
        &self,
        id: &str,
        e: Option<Arc<Egress>>,
    ) -> Result<(), sbx_runtime::net::NetError> {
        let leases = self.leases.locked();
        let Some(lease) = leases.get(id) else {
            return Ok(());
        };
        let rules = e.as_deref().and_then(kernel_rules);
        self.network.set_rules(lease, rules.as_ref())?;
        let keep = e.filter(|e| **e != Egress::default());
        self.policies
            .set(lease.address(), keep.map(|e| (id.to_string(), e)));
        Ok(())
    }

    /// Gives back sandbox `id`'s namespace (after its processes are gone); `destroyed`: the
    /// caller destroyed the sandbox (none of its processes is left), so the namespace may go
    /// back to the pool.
    pub fn release(&self, id: &str, destroyed: bool) {
        let lease = self.leases.locked().remove(id);
        let own_sysctls = self.no_recycle.locked().remove(id);
        if let Some(lease) = lease {
            self.policies.set(lease.address(), None);
            let r = if destroyed && !own_sysctls {
                self.network.recycle(lease)
            } else {
                self.network.release(lease)
            };
            if let Err(e) = r {
                tracing::warn!(sandbox = %id, error = %e, "network: release");
            }
        }
    }

    /// Marks sandbox `id`'s namespace as its alone (sysctls of its own were written there):
    /// it is not given to another sandbox after it. For an adopted one.
    pub(crate) fn keep_own(&self, id: &str) {
        self.no_recycle.locked().insert(id.to_string());
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
            Err(e) => tracing::warn!(sandbox = %id, error = %e, "network: not adopted"),
        }
    }

    /// Holds (`true`) sandbox `id`'s traffic at the host, or lets it through again
    /// ([`sbx_runtime::net::Lease::hold_traffic`]): the network lock of its checkpoints
    /// (CRIU is told to skip its own, which costs ~20 ms of nftables each restore). Nothing
    /// for a sandbox without a lease.
    pub fn hold(&self, id: &str, held: bool) -> Result<(), sbx_runtime::net::NetError> {
        match self.leases.locked().get(id) {
            Some(l) => l.hold_traffic(held),
            None => Ok(()),
        }
    }

    /// After sandbox `id` woke: its lease holds the namespace its `eth0` is in now (the
    /// restored one), for its next sleep.
    pub fn follow(
        &self,
        id: &str,
        sb: &sbx_runtime::Sandbox,
    ) -> Result<(), sbx_runtime::net::NetError> {
        let handle = sb
            .netns_handle()
            .map_err(|e| sbx_runtime::net::NetError::Io {
                what: "a handle on the woken agent".into(),
                source: e,
            })?;
        match self.leases.locked().get_mut(id) {
            Some(l) => l.follow(handle),
            None => Ok(()),
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

    /// Leaves the namespaces of the sandboxes that run on after the node stops as they are
    /// (their elements stay in the table, for the next node to adopt): a lease dropped would
    /// be released, and the next node would find the sandbox off the network.
    pub fn leave_running(&self) {
        let leases: Vec<Lease> = self.leases.locked().drain().map(|(_, l)| l).collect();
        for l in leases {
            l.leave_running();
        }
    }

    /// Removes the node's table (at a stop that leaves no sandbox running).
    pub(crate) fn uninstall(&self) {
        if let Err(e) = self.network.uninstall() {
            tracing::debug!(error = %e, "network: uninstall");
        }
        // No sandbox binds the CA bundle any more (a sleeping one is given the next node's at
        // its wake): its directory (`/run/sbx/<table>`) goes too.
        if let Some(dir) = self.ca_bundle.as_deref().and_then(std::path::Path::parent) {
            if let Err(e) = std::fs::remove_dir_all(dir) {
                tracing::debug!(dir = %dir.display(), error = %e, "network: the CA bundle's directory");
            }
        }
    }

    /// The gateway: the sandboxes' default route, DNS server and egress proxy.
    pub fn gateway(&self) -> Ipv4Addr {
        self.network.gateway()
    }

    /// The gateway, the leases held and the namespaces ready, the limits per sandbox and the
    /// host's conntrack table (entries, most), for `GET /internal/node`.
    pub fn info(&self) -> NetInfo {
        let ct = sbx_runtime::net::conntrack_usage();
        let l = &self.limits;
        NetInfo {
            conntrack: ConntrackInfo {
                count: ct.map(|c| c.0),
                max: ct.map(|c| c.1),
                per_sandbox: l.ct_per_sandbox,
            },
            gateway: self.network.gateway().to_string(),
            interface_prefix: self.network.config().prefix.clone(),
            leased: self.leases.locked().len(),
            limits: NetLimitsInfo {
                conntrack_per_sandbox: l.ct_per_sandbox,
                dns_in_flight: l.dns.udp_total,
                dns_in_flight_per_sandbox: l.dns.udp_per_sandbox,
                dns_tcp: l.dns.tcp_total,
                dns_tcp_idle_ms: l.dns.tcp_idle.as_millis() as u64,
                dns_tcp_per_sandbox: l.dns.tcp_per_sandbox,
                proxy: PROXY_MAX_CONNECTIONS,
                proxy_per_sandbox: l.proxy_per_sandbox,
            },
            range: self.network.config().range.to_string(),
            ready: self.network.ready(),
            table: self.network.config().table.clone(),
        }
    }
}

/// The sandboxes' network (`network` of `GET /internal/node`). Keys in name order (as the API
/// has always written them).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NetInfo {
    pub conntrack: ConntrackInfo,
    /// The sandboxes' default route, DNS server and egress proxy.
    pub gateway: String,
    /// Host-side interfaces are named this and a number.
    pub interface_prefix: String,
    /// Namespaces leased to sandboxes.
    pub leased: usize,
    pub limits: NetLimitsInfo,
    /// The sandboxes' addresses (a CIDR).
    pub range: String,
    /// Namespaces made ahead, ready to lease.
    pub ready: usize,
    /// The node's nftables table.
    pub table: String,
}

/// The host's conntrack table: its entries and most (null where the kernel does not say), and
/// what one sandbox may hold of it (0: no limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ConntrackInfo {
    pub count: Option<u64>,
    pub max: Option<u64>,
    pub per_sandbox: u32,
}

/// What one sandbox, and all of them, may hold at once ([`NetLimits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct NetLimitsInfo {
    pub conntrack_per_sandbox: u32,
    pub dns_in_flight: usize,
    pub dns_in_flight_per_sandbox: usize,
    pub dns_tcp: usize,
    pub dns_tcp_idle_ms: u64,
    pub dns_tcp_per_sandbox: usize,
    pub proxy: usize,
    pub proxy_per_sandbox: usize,
}

#[cfg(test)]
mod bundle_tests {
    use super::write_bundle;

    #[test]
    fn the_bundle_is_never_replaced_and_a_new_one_goes_beside_it() {
        use std::os::unix::fs::MetadataExt;
        let dir = std::env::temp_dir().join(format!("sbx-bundle-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("mkdir");
        let first = write_bundle(&dir, "CA ONE\n").expect("write");
        let ino = std::fs::metadata(&first).expect("stat").ino();
        // A restart of the node with the same CA: the same file, not a new inode (a sandbox's
        // bind of it stays on a live file).
        let again = write_bundle(&dir, "CA ONE\n").expect("write again");
        assert_eq!(again, first);
        assert_eq!(std::fs::metadata(&again).expect("stat").ino(), ino);
        // Other bytes: another file, the first kept as it was.
        let other = write_bundle(&dir, "CA TWO\n").expect("write another");
        assert_ne!(other, first);
        assert!(std::fs::read_to_string(&first)
            .expect("the first")
            .ends_with("CA ONE\n"));
        assert!(std::fs::read_to_string(&other)
            .expect("the second")
            .ends_with("CA TWO\n"));
        assert_eq!(std::fs::metadata(&first).expect("stat").ino(), ino);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
