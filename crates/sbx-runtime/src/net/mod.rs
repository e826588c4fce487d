//! Sandbox networking, the kernel side (issue #13): each sandbox in a network namespace of
//! its own, joined to the node by a veth pair, with a default route to the node, NAT to the
//! outside, and the node's nftables table refusing what a sandbox must never reach.
//!
//! # What the node calls, and when
//!
//! - At start, in the node's network namespace: [`Network::new`] loads the table (once, in
//!   one transaction replacing any table of the same name; the `live` elements of the table
//!   it replaces are kept, for the sandboxes still running), then, for each sandbox adopted
//!   after a restart, [`Network::adopt`] with a handle on its agent's namespace, then
//!   [`Network::audit`] / [`Network::remove_leftovers`] for what a crashed node left.
//!   Forwarding must be on ([`set_ipv4_forwarding`]): this module does not turn it on.
//! - Off the request path: namespaces are prepared ahead into a pool, by a thread of the
//!   [`Network`] when [`NetConfig::pool`] is not 0, or by [`Network::prepare`] /
//!   [`Network::fill`].
//! - On the request path: [`Network::take`] leases a ready namespace (one nft element added:
//!   tens of microseconds), and [`Lease::ns_path`] goes in
//!   [`crate::driver::SandboxSpec::netns`]: the sandbox's init joins that namespace (setns)
//!   instead of unsharing a new one. The [`Lease`] is kept for the sandbox's life.
//! - When the sandbox is gone (after [`crate::Driver::destroy`]): [`Network::release`] (or
//!   dropping the lease): its element is removed, its conntrack entries are flushed, and the
//!   namespace's last reference is closed; the kernel then removes the namespace and both
//!   ends of the veth in its own time, batched (no explicit delete: that costs ~20 ms).
//!
//! # Addressing
//!
//! The node has a range (e.g. 10.250.0.0/16). Its second address is the gateway, `GW`; each
//! sandbox slot `n` has its own address, range + 2 + n, and its own host-side veth,
//! `<prefix><n>`. The sandbox's `eth0` has `A/32` point-to-point with `GW` (so the kernel adds
//! the route to `GW`) and a default route via `GW`; the host's veth has `GW/32`
//! point-to-point with `A` (so the host has the route `A/32 dev <prefix><n> src GW`).
//!
//! Why one address per sandbox rather than one inner address for all: the host's conntrack
//! table is shared, and two sandboxes with the same address connecting to the same place
//! from the same port would be one connection to it (conntrack zones per sandbox would fix
//! that, at the cost of a zone map to keep); and per-sandbox rules can then match `ip saddr`
//! as well as `iifname`. Why /32 point-to-point with one shared gateway rather than a /30
//! per sandbox: one address per sandbox instead of four, and one gateway address for all, so
//! the node's DNS and proxy listen on one address (`GW`, with IP_FREEBIND or after the first
//! veth exists: `GW` is an address of every host-side veth, not of a device of its own). The
//! host answers ARP for `GW` on each veth because `GW` is that veth's own address.
//!
//! Inside, IPv6 is off for `eth0` (`net.ipv6.conf.default.disable_ipv6 = 1` before `eth0`
//! exists; `lo` keeps `::1`, which the sandbox's /etc/hosts names; the host's veth makes no
//! IPv6 address either), `lo` is up, ICMP echo
//! sockets are allowed (`ping_group_range`) and ports below 1024 can be bound by any user of
//! the sandbox (`ip_unprivileged_port_start = 0`; the ports are the namespace's own). A
//! namespace made by init itself (`netns: None`) has neither.
//!
//! Each namespace is owned by a user namespace made for it ([`SANDBOX_IDS`]: the pool's thread
//! clones a short-lived child into both), which the sandbox joins first: the sandbox's user
//! namespace then owns its network namespace, which CRIU needs to dump it.
//!
//! # What is kept where
//!
//! Namespaces are held by descriptors only (the pool's, the leases', and the sandbox
//! processes' own): there is no namespace file or bind mount, so a node that dies leaves no
//! namespace behind but those its running sandboxes hold, and a pooled namespace's veth goes
//! with the process. What outlives a node: its nft table (on purpose: sandboxes that keep
//! running stay fenced in) with its `live` elements, and conntrack entries. [`Network::audit`]
//! lists those and the host-side interfaces, and tells which no ready or leased namespace
//! accounts for.

mod ct;
mod link;
mod listen;
mod nft;
mod nl;
mod ns;
mod orig;
mod policy;

pub use listen::bind_gateway;
pub use orig::original_dst;

/// The host's conntrack table: (entries, most entries), as /proc/sys/net/netfilter says;
/// `None` where it is not there (the module not loaded).
pub fn conntrack_usage() -> Option<(u64, u64)> {
    let read = |f: &str| -> Option<u64> {
        std::fs::read_to_string(format!("/proc/sys/net/netfilter/{f}"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    Some((read("nf_conntrack_count")?, read("nf_conntrack_max")?))
}
pub use policy::SandboxRules;

#[cfg(test)]
pub(crate) mod tests;

use std::collections::{HashSet, VecDeque};
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ipnet::Ipv4Net;

pub use ct::CtEntry;
use nl::Conn;

/// The ids a sandbox's user namespace maps (`0 base count`): a sandbox's network namespace
/// is owned by a user namespace made for it with these, which the sandbox joins (the driver's
/// `uid_base` and `uid_count`, the same for every sandbox).
pub const SANDBOX_IDS: (u32, u32) = (100_000, 65_536);

/// The name of the sandbox's side of its veth.
pub const INNER_IFNAME: &str = "eth0";
/// The longest interface-name prefix: the name is the prefix and a slot number of up to 5
/// digits, and Linux names have at most 15 bytes.
pub const MAX_PREFIX_LEN: usize = 10;
/// At most this many slots (5 digits in a name).
const MAX_SLOTS: u32 = 99_999;

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// The kernel refused a netlink request (or its answer could not be read).
    #[error("{what}: {source}")]
    Netlink {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("network settings: {0}")]
    Config(String),
    #[error("no free address left in {0}")]
    Exhausted(Ipv4Net),
    #[error("the namespace has no address of this node's range on {INNER_IFNAME}")]
    NotOurs,
    #[error("slot {0} is in use already")]
    InUse(u32),
}

impl NetError {
    fn errno(&self) -> Option<i32> {
        match self {
            NetError::Netlink { source, .. } | NetError::Io { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

/// A transport protocol of [`NetConfig::gateway_ports`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    fn number(self) -> u8 {
        match self {
            Proto::Tcp => libc::IPPROTO_TCP as u8,
            Proto::Udp => libc::IPPROTO_UDP as u8,
        }
    }
}

/// [`NetConfig::ct_limit`]'s default: room for a build's or a crawler's few thousand
/// connections, a small part of a host's table (262,144 entries on most).
pub const DEFAULT_CT_LIMIT: u32 = 8192;

/// The node's network settings.
#[derive(Debug, Clone)]
pub struct NetConfig {
    /// The nftables table (family inet) this node owns.
    pub table: String,
    /// Host-side interfaces are named `<prefix><slot>` (at most [`MAX_PREFIX_LEN`] bytes;
    /// letters, digits, '-' and '_'). The table matches every interface with this prefix as
    /// a sandbox's: no other interface of the host may have it.
    pub prefix: String,
    /// The node's range: its first address is not used, the second is the gateway, each
    /// sandbox has one of the others (but the last). It is refused as a destination (but
    /// for the gateway's ports), whatever [`NetConfig::allow`] says.
    pub range: Ipv4Net,
    /// What a sandbox may reach on the gateway (the node's DNS, its egress proxy); everything
    /// else of the host is refused to sandboxes.
    pub gateway_ports: Vec<(Proto, u16)>,
    /// Destinations the operator opens among the always-refused ranges.
    pub allow: Vec<Ipv4Net>,
    /// More refused destinations (e.g. the networks of the node's own interfaces).
    pub refuse: Vec<Ipv4Net>,
    /// The egress proxy's port on the gateway, where a proxied sandbox's TCP to ports 80 and
    /// 443 is sent ([`SandboxRules::proxied`]); `None`: no proxy (such rules send nothing).
    pub proxy_port: Option<u16>,
    /// How many namespaces a thread of the [`Network`] keeps ready; 0: none is made but by
    /// [`Network::prepare`] and [`Network::fill`] (or by [`Network::take`] on an empty pool).
    pub pool: usize,
    /// The most connections a sandbox has in the host's conntrack table at once (its own
    /// source address counted by the kernel); a new one past it is dropped. 0: no limit.
    pub ct_limit: u32,
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig {
            table: "sbx".into(),
            prefix: "sbx".into(),
            range: Ipv4Net::new(Ipv4Addr::new(10, 250, 0, 0), 16)
                .unwrap_or_else(|_| Ipv4Net::default()),
            gateway_ports: vec![(Proto::Udp, 53), (Proto::Tcp, 53)],
            allow: Vec::new(),
            refuse: Vec::new(),
            proxy_port: None,
            pool: 4,
            ct_limit: DEFAULT_CT_LIMIT,
        }
    }
}

impl NetConfig {
    fn check(&self) -> Result<u32, NetError> {
        let bad = |m: String| Err(NetError::Config(m));
        if self.prefix.is_empty()
            || self.prefix.len() > MAX_PREFIX_LEN
            || !self
                .prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return bad(format!(
                "the interface prefix {:?} must be 1 to {MAX_PREFIX_LEN} letters, digits, '-' or '_'",
                self.prefix
            ));
        }
        if self
            .prefix
            .bytes()
            .last()
            .is_some_and(|b| b.is_ascii_digit())
        {
            return bad(format!(
                "the interface prefix {:?} must not end in a digit (the slot follows it)",
                self.prefix
            ));
        }
        if self.table.is_empty() || self.table.len() > 255 {
            return bad(format!("bad table name {:?}", self.table));
        }
        if self.range.prefix_len() > 30 {
            return bad(format!(
                "the range {} has no room for a sandbox",
                self.range
            ));
        }
        if self.range.network() != self.range.addr() {
            return bad(format!("the range {} is not a network address", self.range));
        }
        let size = 1u64 << (32 - self.range.prefix_len());
        Ok((size - 3).min(MAX_SLOTS as u64) as u32)
    }
}

/// A ready namespace in the pool.
#[derive(Debug)]
struct Ready {
    slot: u32,
    ns: OwnedFd,
}

#[derive(Debug, Default)]
struct State {
    /// Slots with no namespace, oldest-freed first: a slot is made again as late as possible,
    /// after the kernel has long removed its previous veth.
    free: VecDeque<u32>,
    ready: VecDeque<Ready>,
    leased: HashSet<u32>,
    /// Slots being made (not yet ready or leased), or whose leftovers are being removed: in
    /// none of the other three, and not to be touched by anyone else meanwhile.
    busy: HashSet<u32>,
    /// Leased slots with rules of their own in the table ([`Network::set_rules`]).
    ruled: HashSet<u32>,
    /// Slots whose `live` element or host-side interface a previous node left (their
    /// sandboxes may still run): kept
    /// from the pool until [`Network::adopt`] leases them or [`Network::remove_leftovers`]
    /// finds them left over, so that the pool's thread never takes an adopted sandbox's slot.
    held_back: HashSet<u32>,
    stop: bool,
}

impl State {
    /// Whether a namespace of this network has the slot (or is being made with it).
    fn holds(&self, slot: u32) -> bool {
        self.leased.contains(&slot)
            || self.busy.contains(&slot)
            || self.ready.iter().any(|r| r.slot == slot)
    }

    /// A slot made, ready or leased goes back to the free list.
    fn free(&mut self, slot: u32) {
        self.busy.remove(&slot);
        self.leased.remove(&slot);
        self.free.push_back(slot);
    }
}

#[derive(Debug)]
struct Inner {
    cfg: NetConfig,
    gateway: Ipv4Addr,
    slots: u32,
    /// rtnetlink in the node's namespace.
    rt: Mutex<Conn>,
    /// nfnetlink (nftables, conntrack) in the node's namespace.
    nf: Mutex<Conn>,
    state: Mutex<State>,
    /// Wakes the pool's thread: a namespace was taken, or the network stops.
    wake: Condvar,
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The node's sandbox networking. See the module's documentation.
#[derive(Debug)]
pub struct Network {
    inner: Arc<Inner>,
    refill: Option<JoinHandle<()>>,
}

/// A namespace leased to one sandbox. Dropping it releases it (as [`Network::release`], with
/// errors only logged).
#[derive(Debug)]
pub struct Lease {
    slot: u32,
    address: Ipv4Addr,
    ifname: String,
    ns: Option<OwnedFd>,
    net: Arc<Inner>,
}

/// What the node has in the kernel, from [`Network::audit`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Audit {
    /// Whether the node's table is loaded.
    pub table: bool,
    /// Host-side interfaces whose name has the node's prefix.
    pub interfaces: Vec<String>,
    /// The table's `live` elements: (host-side interface, sandbox address).
    pub elements: Vec<(String, Ipv4Addr)>,
    /// Conntrack entries of the node's namespace that belong to a sandbox (by mark or by an
    /// address of the range).
    pub conntrack: Vec<CtEntry>,
    /// Namespaces this [`Network`] holds: ready in the pool, and leased.
    pub ready: usize,
    pub leased: usize,
    /// What none of those accounts for. Interfaces of namespaces released a moment ago are
    /// here until the kernel has removed them (see [`Network::audit_settled`]).
    pub leftover_interfaces: Vec<String>,
    pub leftover_elements: Vec<(String, Ipv4Addr)>,
    pub leftover_conntrack: Vec<CtEntry>,
}

impl Audit {
    /// Nothing left over.
    pub fn is_clean(&self) -> bool {
        self.leftover_interfaces.is_empty()
            && self.leftover_elements.is_empty()
            && self.leftover_conntrack.is_empty()
    }
}

impl Inner {
    fn address(&self, slot: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.cfg.range.network()) + 2 + slot)
    }

    fn ifname(&self, slot: u32) -> String {
        format!("{}{slot}", self.cfg.prefix)
    }

    /// The slot of a sandbox address of the range.
    fn slot_of(&self, addr: Ipv4Addr) -> Option<u32> {
        let a = u32::from(addr);
        let base = u32::from(self.cfg.range.network()) + 2;
        (a >= base && a - base < self.slots).then(|| a - base)
    }

    /// The slot of a host-side interface name.
    fn slot_of_ifname(&self, name: &str) -> Option<u32> {
        let n = name.strip_prefix(&self.cfg.prefix)?;
        if n.is_empty()
            || !n.bytes().all(|b| b.is_ascii_digit())
            || (n.len() > 1 && n.starts_with('0'))
        {
            return None;
        }
        n.parse::<u32>().ok().filter(|s| *s < self.slots)
    }

    /// Makes slot `slot`'s namespace and veth.
    fn make(&self, slot: u32) -> Result<OwnedFd, NetError> {
        let gw = self.gateway;
        let addr = self.address(slot);
        let ifname = self.ifname(slot);
        let (ns, mut inside) = ns::make_owned(SANDBOX_IDS, || {
            // Before eth0 exists, so that it never has an IPv6 address (a kernel without
            // IPv6 has no such file, and no IPv6).
            match ns::sysctl("net/ipv6/conf/default/disable_ipv6", "1") {
                Err(e) if e.errno() == Some(libc::ENOENT) => {}
                r => r?,
            }
            ns::sysctl("net/ipv4/ping_group_range", "0 2147483647")?;
            ns::sysctl("net/ipv4/ip_unprivileged_port_start", "0")
        })?;
        {
            let mut rt = locked(&self.rt);
            link::create_veth(&mut rt, &ifname, INNER_IFNAME, ns.as_fd())?;
            let host = link::index_of(&mut rt, &ifname)?.ok_or_else(|| NetError::Netlink {
                what: format!("find {ifname}"),
                source: std::io::Error::from_raw_os_error(libc::ENODEV),
            })?;
            // IPv6 is not routed to sandboxes: the host side needs no address of it either
            // (eth0 has none: no carrier, so no link-local address, until eth0 is up below).
            link::no_ipv6_addresses(&mut rt, host)?;
            link::add_p2p_address(&mut rt, host, gw, addr)?;
        }
        let eth0 = link::index_of(&mut inside, INNER_IFNAME)?.ok_or_else(|| NetError::Netlink {
            what: format!("find {INNER_IFNAME} in the new namespace"),
            source: std::io::Error::from_raw_os_error(libc::ENODEV),
        })?;
        link::add_p2p_address(&mut inside, eth0, addr, gw)?;
        link::set_up(&mut inside, eth0)?;
        link::add_route(&mut inside, Ipv4Addr::UNSPECIFIED, 0, gw, eth0)?;
        Ok(ns)
    }

    /// Prepares one namespace. Its slot stays `busy` until the caller puts it in the pool
    /// ([`Inner::pool`]) or leases it.
    fn prepare(&self) -> Result<Ready, NetError> {
        // A slot whose veth still exists (its namespace released a moment ago and not yet
        // removed by the kernel, or held by a process) is skipped and tried again later.
        let mut tries = 0;
        loop {
            let slot = {
                let mut st = locked(&self.state);
                let slot = st
                    .free
                    .pop_front()
                    .ok_or(NetError::Exhausted(self.cfg.range))?;
                st.busy.insert(slot);
                slot
            };
            match self.make(slot) {
                Ok(ns) => return Ok(Ready { slot, ns }),
                Err(e) => {
                    locked(&self.state).free(slot);
                    tries += 1;
                    if e.errno() != Some(libc::EEXIST) || tries >= 8 {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// Puts a namespace just made in the pool.
    fn pool(&self, r: Ready) {
        let mut st = locked(&self.state);
        st.busy.remove(&r.slot);
        st.ready.push_back(r);
    }

    /// Leases slot `slot` (taken from the pool, just made, or adopted: in no list, or busy)
    /// with its namespace `ns`. On an error the slot is in no list and not busy.
    fn lease(self: &Arc<Self>, slot: u32, ns: OwnedFd) -> Result<Lease, (OwnedFd, NetError)> {
        let address = self.address(slot);
        let ifname = self.ifname(slot);
        // Leased before its element exists: an audit meanwhile does not take the element for
        // a leftover.
        {
            let mut st = locked(&self.state);
            st.busy.remove(&slot);
            st.leased.insert(slot);
        }
        if let Err(e) = nft::set_live(
            &mut locked(&self.nf),
            &self.cfg.table,
            &ifname,
            address,
            true,
        ) {
            locked(&self.state).leased.remove(&slot);
            return Err((ns, e));
        }
        Ok(Lease {
            slot,
            address,
            ifname,
            ns: Some(ns),
            net: self.clone(),
        })
    }

    fn release(
        &self,
        slot: u32,
        ifname: &str,
        address: Ipv4Addr,
        ns: Option<OwnedFd>,
        reuse: bool,
    ) -> Result<(), NetError> {
        // The element first: from now on whatever comes from the veth is dropped, so no new
        // conntrack entry is made after the flush.
        let r1 = nft::set_live(
            &mut locked(&self.nf),
            &self.cfg.table,
            ifname,
            address,
            false,
        );
        let ruled = locked(&self.state).ruled.remove(&slot);
        let r0 = if ruled {
            policy::remove(&mut locked(&self.nf), &self.cfg.table, slot, address)
        } else {
            Ok(())
        };
        let r2 = ct::flush_mark(&mut locked(&self.nf), nft::ct_mark(address));
        let r = r1.and(r0).and(r2);
        // A namespace whose sandbox is gone is as good as new (nothing of it could be changed
        // from inside: it belongs to the host's user namespace): back to the pool, first in
        // line, up to twice the pool's size (the pool's thread refills to its size after each
        // take, so a recycled one would otherwise find it full): the thread then has nothing
        // to make and the kernel nothing to tear down.
        if let (true, Ok(()), Some(ns)) = (reuse, &r, ns.as_ref()) {
            let mut st = locked(&self.state);
            if !st.stop && st.ready.len() < self.cfg.pool * 2 {
                if let Ok(ns) = ns.try_clone() {
                    st.leased.remove(&slot);
                    st.ready.push_front(Ready { slot, ns });
                    return Ok(());
                }
            }
        }
        // The namespace's last reference (unless a process of the sandbox is still in it):
        // the kernel removes it, and the veth with it, in its own time.
        drop(ns);
        locked(&self.state).free(slot);
        r
    }

    fn ruleset(&self) -> nft::Ruleset {
        let mut refused4 = nft::default_refused4();
        refused4.extend(self.cfg.refuse.iter().copied());
        nft::Ruleset {
            table: self.cfg.table.clone(),
            prefix: self.cfg.prefix.clone(),
            gateway: self.gateway,
            range: self.cfg.range,
            ports: self.cfg.gateway_ports.clone(),
            refused4,
            allowed4: self.cfg.allow.clone(),
            refused6: nft::default_refused6(),
            ct_limit: self.cfg.ct_limit,
        }
    }

    /// The slot a conntrack entry belongs to: by its mark, else by an address of the range.
    fn slot_of_entry(&self, e: &CtEntry) -> Option<u32> {
        let by_mark = self.slot_of(Ipv4Addr::from(e.mark.to_ne_bytes()));
        let by_addr = |ip: IpAddr| match ip {
            IpAddr::V4(a) => self.slot_of(a),
            IpAddr::V6(_) => None,
        };
        by_mark
            .or_else(|| by_addr(e.src))
            .or_else(|| by_addr(e.dst))
    }

    fn in_range(&self, e: &CtEntry) -> bool {
        let r = |ip: IpAddr| matches!(ip, IpAddr::V4(a) if self.cfg.range.contains(&a));
        r(e.src) || r(e.dst) || self.slot_of_entry(e).is_some()
    }

    fn audit(&self) -> Result<Audit, NetError> {
        let links = link::list(&mut locked(&self.rt))?;
        let (elements, conntrack) = {
            let mut nf = locked(&self.nf);
            let elements = nft::list_live(&mut nf, &self.cfg.table)?;
            let conntrack = ct::list(&mut nf)?;
            (elements, conntrack)
        };
        let st = locked(&self.state);
        let held = |slot: u32| st.holds(slot);
        let interfaces: Vec<String> = links
            .into_iter()
            .map(|(_, n)| n)
            .filter(|n| n.starts_with(&self.cfg.prefix))
            .collect();
        let leftover_interfaces = interfaces
            .iter()
            .filter(|n| self.slot_of_ifname(n).is_some_and(|s| !held(s)))
            .cloned()
            .collect();
        let table = elements.is_some();
        let elements = elements.unwrap_or_default();
        let leftover_elements = elements
            .iter()
            .filter(|(n, a)| {
                // An element is the lease's only if both its name and address are the slot's.
                !(self.slot_of_ifname(n) == self.slot_of(*a)
                    && self.slot_of(*a).is_some_and(|s| st.leased.contains(&s)))
            })
            .cloned()
            .collect();
        let conntrack: Vec<CtEntry> = conntrack.into_iter().filter(|e| self.in_range(e)).collect();
        let leftover_conntrack = conntrack
            .iter()
            .filter(|e| {
                !self
                    .slot_of_entry(e)
                    .is_some_and(|s| st.leased.contains(&s))
            })
            .cloned()
            .collect();
        Ok(Audit {
            table,
            interfaces,
            elements,
            conntrack,
            ready: st.ready.len(),
            leased: st.leased.len(),
            leftover_interfaces,
            leftover_elements,
            leftover_conntrack,
        })
    }
}

impl Network {
    /// Loads the node's table in the calling thread's network namespace (the node's) and
    /// opens the sockets every later call uses: the namespace of the thread that later calls
    /// does not matter. Starts the pool's thread when [`NetConfig::pool`] is not 0.
    pub fn new(cfg: NetConfig) -> Result<Network, NetError> {
        let slots = cfg.check()?;
        let gateway = Ipv4Addr::from(u32::from(cfg.range.network()) + 1);
        let rt = Conn::new(netlink_sys::protocols::NETLINK_ROUTE)?;
        let nf = Conn::new(netlink_sys::protocols::NETLINK_NETFILTER)?;
        let inner = Inner {
            cfg,
            gateway,
            slots,
            rt: Mutex::new(rt),
            nf: Mutex::new(nf),
            state: Mutex::new(State {
                free: (0..slots).collect(),
                ..State::default()
            }),
            wake: Condvar::new(),
        };
        // The elements of the table being replaced stay: their sandboxes may still run (they
        // are checked by `adopt` and `audit`). Their slots are held back from the pool until
        // then.
        {
            let mut nf = locked(&inner.nf);
            let keep = nft::list_live(&mut nf, &inner.cfg.table)?.unwrap_or_default();
            nft::load(&mut nf, &inner.ruleset(), &keep)?;
            // A host-side interface of the range means a namespace some process still holds
            // (a sandbox that runs on, or one the kernel has yet to remove): its slot waits too.
            let links = link::list(&mut locked(&inner.rt))?;
            let mut st = locked(&inner.state);
            for (_, name) in &links {
                if let Some(slot) = inner.slot_of_ifname(name) {
                    st.held_back.insert(slot);
                }
            }
            for (name, addr) in &keep {
                if let Some(slot) = inner.slot_of(*addr) {
                    if inner.slot_of_ifname(name) == Some(slot) {
                        st.held_back.insert(slot);
                    }
                }
            }
            let held = std::mem::take(&mut st.held_back);
            st.free.retain(|s| !held.contains(s));
            st.held_back = held;
        }
        let inner = Arc::new(inner);
        let refill = if inner.cfg.pool > 0 {
            let bg = inner.clone();
            Some(
                std::thread::Builder::new()
                    .name("sbx-net-pool".into())
                    .spawn(move || refill(&bg))
                    .map_err(|e| NetError::Io {
                        what: "start the pool's thread".into(),
                        source: e,
                    })?,
            )
        } else {
            None
        };
        Ok(Network { inner, refill })
    }

    /// The gateway: every sandbox's default route, where the node's DNS and proxy listen.
    pub fn gateway(&self) -> Ipv4Addr {
        self.inner.gateway
    }

    /// Whether sandboxes are refused an address whatever their rules (the node's range,
    /// loopback, link-local, private ranges but what the operator opens, multicast; all of
    /// IPv6), as a check that outlives this handle: what the node's egress proxy, which dials
    /// from the host, checks every address against.
    pub fn refusals(&self) -> Arc<dyn Fn(IpAddr) -> bool + Send + Sync> {
        let range = self.inner.cfg.range;
        let mut refused = nft::default_refused4();
        refused.extend(self.inner.cfg.refuse.iter().copied());
        let allow = self.inner.cfg.allow.clone();
        Arc::new(move |ip| match ip {
            IpAddr::V6(_) => true,
            IpAddr::V4(a) => {
                range.contains(&a)
                    || (refused.iter().any(|n| n.contains(&a))
                        && !allow.iter().any(|n| n.contains(&a)))
            }
        })
    }

    /// The settings this network was made with.
    pub fn config(&self) -> &NetConfig {
        &self.inner.cfg
    }

    /// Prepares one namespace into the pool (off the request path: ms).
    pub fn prepare(&self) -> Result<(), NetError> {
        let r = self.inner.prepare()?;
        self.inner.pool(r);
        Ok(())
    }

    /// Prepares namespaces until `n` are ready; returns how many it made.
    pub fn fill(&self, n: usize) -> Result<usize, NetError> {
        let mut made = 0;
        while self.ready() < n {
            self.prepare()?;
            made += 1;
        }
        Ok(made)
    }

    /// How many namespaces are ready.
    pub fn ready(&self) -> usize {
        locked(&self.inner.state).ready.len()
    }

    /// Leases a ready namespace to a sandbox (its `live` element added: the request path's
    /// part). On an empty pool, one is prepared first (ms).
    pub fn take(&self) -> Result<Lease, NetError> {
        let ready = locked(&self.inner.state).ready.pop_front();
        self.inner.wake.notify_all();
        let ready = match ready {
            Some(r) => r,
            None => self.inner.prepare()?,
        };
        let slot = ready.slot;
        self.inner.lease(slot, ready.ns).map_err(|(ns, e)| {
            locked(&self.inner.state)
                .ready
                .push_front(Ready { slot, ns });
            e
        })
    }

    /// Gives back a sandbox's namespace once its processes are gone: its element removed, its
    /// conntrack entries flushed, the namespace's last reference closed. The slot is free
    /// again even on an error (which is returned).
    pub fn release(&self, mut lease: Lease) -> Result<(), NetError> {
        lease.release(false)
    }

    /// [`Network::release`] of a sandbox known to be gone (its processes all ended: the
    /// caller destroyed it): its namespace goes back to the pool when the pool wants one.
    pub fn recycle(&self, mut lease: Lease) -> Result<(), NetError> {
        lease.release(true)
    }

    /// Sets the egress rules of a leased sandbox (`None`: none of its own, only the node's),
    /// in one transaction: they hold for its next connection; established ones are kept.
    pub fn set_rules(&self, lease: &Lease, rules: Option<&SandboxRules>) -> Result<(), NetError> {
        let slot = lease.slot;
        match rules {
            Some(r) => {
                policy::apply(
                    &mut locked(&self.inner.nf),
                    &self.inner.cfg.table,
                    slot,
                    lease.address,
                    self.inner.gateway,
                    self.inner.cfg.proxy_port,
                    r,
                )?;
                locked(&self.inner.state).ruled.insert(slot);
            }
            None => {
                if locked(&self.inner.state).ruled.remove(&slot) {
                    policy::remove(
                        &mut locked(&self.inner.nf),
                        &self.inner.cfg.table,
                        slot,
                        lease.address,
                    )?;
                }
            }
        }
        Ok(())
    }

    /// Leases the namespace of a sandbox that runs already (after the node's restart): `handle`
    /// names it (a pidfd of its agent, [`crate::Sandbox::netns_handle`], or its
    /// /proc/PID/ns/net opened). Its slot comes
    /// from the address of its `eth0`; its element is added again.
    pub fn adopt(&self, handle: OwnedFd) -> Result<Lease, NetError> {
        // The lease holds the namespace itself (a pidfd would not keep it).
        let (addrs, ns) = ns::within(handle, || {
            let ns = std::fs::File::open("/proc/thread-self/ns/net").map_err(|e| NetError::Io {
                what: "open the namespace".into(),
                source: e,
            })?;
            let mut conn = Conn::new(netlink_sys::protocols::NETLINK_ROUTE)?;
            let addrs = match link::index_of(&mut conn, INNER_IFNAME)? {
                Some(i) => link::addresses(&mut conn, i)?,
                None => Vec::new(),
            };
            Ok((addrs, OwnedFd::from(ns)))
        })?;
        let slot = addrs
            .into_iter()
            .find_map(|a| self.inner.slot_of(a))
            .ok_or(NetError::NotOurs)?;
        {
            let mut st = locked(&self.inner.state);
            if st.holds(slot) {
                return Err(NetError::InUse(slot));
            }
            st.held_back.remove(&slot);
            st.free.retain(|s| *s != slot);
            st.busy.insert(slot);
        }
        self.inner.lease(slot, ns).map_err(|(_, e)| {
            locked(&self.inner.state).free(slot);
            e
        })
    }

    /// What the node has in the kernel, and what of it no ready or leased namespace accounts
    /// for.
    pub fn audit(&self) -> Result<Audit, NetError> {
        self.inner.audit()
    }

    /// [`Network::audit`] again until no interface is left over or `timeout` has passed: the
    /// kernel removes released namespaces in batches, after a moment.
    pub fn audit_settled(&self, timeout: Duration) -> Result<Audit, NetError> {
        let end = Instant::now() + timeout;
        loop {
            let a = self.audit()?;
            if a.leftover_interfaces.is_empty() || Instant::now() >= end {
                return Ok(a);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Removes what [`Network::audit`] finds left over (a crashed node's: elements of
    /// sandboxes that are gone, their conntrack entries, interfaces of namespaces that some
    /// process still holds), and audits again. The slots concerned are kept from being made
    /// or leased meanwhile; one taken since the audit is left alone.
    pub fn remove_leftovers(&self) -> Result<Audit, NetError> {
        let inner = &self.inner;
        let a = self.audit()?;
        let mut slots: HashSet<u32> = HashSet::new();
        for (n, addr) in &a.leftover_elements {
            slots.extend(inner.slot_of_ifname(n));
            slots.extend(inner.slot_of(*addr));
        }
        slots.extend(
            a.leftover_interfaces
                .iter()
                .filter_map(|n| inner.slot_of_ifname(n)),
        );
        slots.extend(
            a.leftover_conntrack
                .iter()
                .filter_map(|e| inner.slot_of_entry(e)),
        );
        let reserved: HashSet<u32> = {
            let mut st = locked(&inner.state);
            let mine: HashSet<u32> = slots.into_iter().filter(|s| !st.holds(*s)).collect();
            st.free.retain(|s| !mine.contains(s));
            st.held_back.retain(|s| !mine.contains(s));
            st.busy.extend(mine.iter().copied());
            mine
        };
        let ours = |slot: Option<u32>| match slot {
            Some(s) => reserved.contains(&s),
            None => true,
        };
        let result = (|| {
            for (n, addr) in &a.leftover_elements {
                // The element of a slot leased since the audit is that lease's now.
                if ours(inner.slot_of(*addr)) {
                    nft::set_live(&mut locked(&inner.nf), &inner.cfg.table, n, *addr, false)?;
                }
            }
            for e in a
                .leftover_conntrack
                .iter()
                .filter(|e| ours(inner.slot_of_entry(e)))
            {
                ct::delete(&mut locked(&inner.nf), e)?;
            }
            for n in &a.leftover_interfaces {
                if !ours(inner.slot_of_ifname(n)) {
                    continue;
                }
                let mut rt = locked(&inner.rt);
                if let Some(i) = link::index_of(&mut rt, n)? {
                    match link::delete(&mut rt, i) {
                        Err(e) if e.errno() == Some(libc::ENODEV) => {}
                        r => r?,
                    }
                }
            }
            Ok(())
        })();
        {
            let mut st = locked(&inner.state);
            for s in &reserved {
                st.free(*s);
            }
            // Held back and not adopted, with nothing left over: free again.
            let rest: Vec<u32> = st.held_back.drain().collect();
            for s in rest {
                if !st.holds(s) {
                    st.free.push_back(s);
                }
            }
        }
        result.and_then(|()| self.audit())
    }

    /// Deletes the node's table (an uninstall; a node that only stops keeps it, so that its
    /// running sandboxes stay fenced in).
    pub fn uninstall(&self) -> Result<(), NetError> {
        nft::delete_table(&mut locked(&self.inner.nf), &self.inner.cfg.table)
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        locked(&self.inner.state).stop = true;
        self.inner.wake.notify_all();
        if let Some(t) = self.refill.take() {
            let _ = t.join();
        }
        // The pool's namespaces go with their descriptors.
        locked(&self.inner.state).ready.clear();
    }
}

/// The pool's thread: keeps `cfg.pool` namespaces ready.
fn refill(inner: &Inner) {
    loop {
        {
            let mut st = locked(&inner.state);
            while !st.stop && st.ready.len() >= inner.cfg.pool {
                st = inner.wake.wait(st).unwrap_or_else(PoisonError::into_inner);
            }
            if st.stop {
                return;
            }
        }
        match inner.prepare() {
            Ok(r) => inner.pool(r),
            Err(e) => {
                tracing::warn!(error = %e, "preparing a sandbox network namespace");
                let st = locked(&inner.state);
                let _ = inner.wake.wait_timeout(st, Duration::from_secs(1));
            }
        }
    }
}

impl Lease {
    /// The sandbox's address.
    pub fn address(&self) -> Ipv4Addr {
        self.address
    }

    /// Its default route's gateway.
    pub fn gateway(&self) -> Ipv4Addr {
        self.net.gateway
    }

    /// The host side of its veth.
    pub fn host_ifname(&self) -> &str {
        &self.ifname
    }

    /// The slot (the address's and the interface's number).
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// Holds (`true`) or lets through again the sandbox's traffic at the host: its element
    /// leaves the node's `live` set, so nothing from or to its veth passes (the node's network
    /// lock while CRIU saves or restores its sockets, and while it sleeps: a peer's packets
    /// are dropped, not answered with a reset).
    pub fn hold_traffic(&self, held: bool) -> Result<(), NetError> {
        nft::set_live(
            &mut locked(&self.net.nf),
            &self.net.cfg.table,
            &self.ifname,
            self.address,
            !held,
        )
    }

    /// What a restore of this lease's sandbox needs to give it its network again.
    pub fn relinker(&self) -> Relink {
        Relink {
            net: self.net.clone(),
            ifname: self.ifname.clone(),
            address: self.address,
            gateway: self.net.gateway,
            retired: Arc::new(Mutex::new(None)),
        }
    }

    /// A path naming the namespace for as long as this lease lives, for
    /// [`crate::driver::SandboxSpec::netns`]: the node's own descriptor in /proc, which the
    /// sandbox's init (root, the node's child) opens and joins.
    pub fn ns_path(&self) -> PathBuf {
        let fd = self.ns.as_ref().map(|f| f.as_raw_fd()).unwrap_or(-1);
        PathBuf::from(format!("/proc/{}/fd/{fd}", std::process::id()))
    }

    /// Holds the network namespace of the process `handle` names (a pidfd of a restored
    /// sandbox's agent, whose `eth0` the wake moved into a namespace of its own) instead of the
    /// one held so far: the namespace, with its `eth0`, outlives that sandbox's next sleep.
    pub fn follow(&mut self, handle: OwnedFd) -> Result<(), NetError> {
        let ns = ns::within(handle, || {
            std::fs::File::open("/proc/thread-self/ns/net")
                .map(OwnedFd::from)
                .map_err(|e| NetError::Io {
                    what: "open the namespace".into(),
                    source: e,
                })
        })?;
        self.ns = Some(ns);
        Ok(())
    }

    /// A new handle on the namespace (for [`crate::netns::in_netns_of_handle`]).
    pub fn ns_handle(&self) -> std::io::Result<OwnedFd> {
        match &self.ns {
            Some(f) => f.try_clone(),
            None => Err(std::io::Error::from_raw_os_error(libc::EBADF)),
        }
    }

    /// Forgets the lease without releasing anything, for a sandbox that runs on after the
    /// node stops (the next node adopts it): its element stays in the table, its namespace
    /// lives on with its processes. Also what a node that dies does.
    pub fn leave_running(mut self) {
        self.ns.take();
    }

    fn release(&mut self, reuse: bool) -> Result<(), NetError> {
        let Some(ns) = self.ns.take() else {
            return Ok(());
        };
        self.net
            .release(self.slot, &self.ifname, self.address, Some(ns), reuse)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Err(e) = self.release(false) {
            tracing::warn!(error = %e, slot = self.slot, "releasing a sandbox network namespace");
        }
    }
}

/// A new network namespace with only `lo`, up, held by the handle returned (for a test's or
/// a benchmark's own "node" and "outside" namespaces; join it with
/// [`crate::netns::in_netns_of_handle`]).
pub fn new_netns() -> Result<OwnedFd, NetError> {
    ns::make(|| Ok(())).map(|(ns, _)| ns)
}

/// What a restore needs to give a leased sandbox its network again ([`Lease::relinker`]):
/// the node's network (whose netlink socket is in the namespace of the host sides), the host
/// side's name, the address and the gateway.
#[derive(Clone)]
pub struct Relink {
    net: Arc<Inner>,
    ifname: String,
    address: Ipv4Addr,
    gateway: Ipv4Addr,
    /// The host side [`Relink::apply`] retired (its link's index), for [`Relink::undo`].
    retired: Arc<Mutex<Option<u32>>>,
}

impl std::fmt::Debug for Relink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relink")
            .field("ifname", &self.ifname)
            .field("address", &self.address)
            .field("gateway", &self.gateway)
            .finish()
    }
}

impl Relink {
    /// The sandbox's address.
    pub fn address(&self) -> Ipv4Addr {
        self.address
    }

    /// Gives a restored sandbox, whose new network namespace `to` is still empty, its network
    /// again: a new veth made with its peer directly in `to` as `eth0` (moving the old `eth0`
    /// there would cost ~20 ms of the kernel's), its host side named as before (the node's
    /// table knows a sandbox by that name and its address). The host side of the veth it had
    /// (whose `eth0` stays in the namespace its lease held, which goes once the lease follows
    /// the restored one) is set down and renamed out of the node's prefix first; there is
    /// none after a node's restart or a failed wake. Then configured as the pool does: `lo`
    /// and `eth0` up, `address/32` point-to-point with the gateway, the default route via it,
    /// and the namespace's sysctls. For the restore's `setup-namespaces` step, before any
    /// socket of the sandbox is restored: its listening and established TCP sockets come
    /// back on the same address.
    pub fn apply(&self, to: OwnedFd) -> Result<(), NetError> {
        let (address, gateway, host_ifname) = (self.address, self.gateway, self.ifname.as_str());
        let dup = |f: &OwnedFd| {
            f.try_clone().map_err(|e| NetError::Io {
                what: "dup".into(),
                source: e,
            })
        };
        let (peer_ns, inside) = (dup(&to)?, dup(&to)?);
        // Before eth0 exists, so that it never has an IPv6 address.
        ns::within(to, move || {
            match ns::sysctl("net/ipv6/conf/default/disable_ipv6", "1") {
                Err(e) if e.errno() == Some(libc::ENOENT) => {}
                r => r?,
            }
            ns::sysctl("net/ipv4/ping_group_range", "0 2147483647")?;
            ns::sysctl("net/ipv4/ip_unprivileged_port_start", "0")
        })?;
        {
            let mut rt = locked(&self.net.rt);
            if let Some(old) = link::index_of(&mut rt, host_ifname)? {
                link::set_down(&mut rt, old)?;
                link::rename(&mut rt, old, &retired_name(host_ifname, old))?;
                *locked(&self.retired) = Some(old);
            }
            link::create_veth(&mut rt, host_ifname, INNER_IFNAME, peer_ns.as_fd())?;
            let host = link::index_of(&mut rt, host_ifname)?.ok_or_else(|| NetError::Netlink {
                what: format!("find {host_ifname}"),
                source: std::io::Error::from_raw_os_error(libc::ENODEV),
            })?;
            link::no_ipv6_addresses(&mut rt, host)?;
            link::add_p2p_address(&mut rt, host, gateway, address)?;
        }
        ns::within(inside, move || {
            let mut conn = Conn::new(netlink_sys::protocols::NETLINK_ROUTE)?;
            link::set_up(&mut conn, 1)?;
            let eth0 =
                link::index_of(&mut conn, INNER_IFNAME)?.ok_or_else(|| NetError::Netlink {
                    what: format!("find {INNER_IFNAME} in the restored namespace"),
                    source: std::io::Error::from_raw_os_error(libc::ENODEV),
                })?;
            link::add_p2p_address(&mut conn, eth0, address, gateway)?;
            link::set_up(&mut conn, eth0)?;
            link::add_route(&mut conn, Ipv4Addr::UNSPECIFIED, 0, gateway, eth0)
        })
    }
}

impl Relink {
    /// After a restore that failed once [`Relink::apply`] began: the veth it made goes (where
    /// the kernel has not yet removed it with the failed restore's namespace) and the host side
    /// it retired gets its name back and comes up again. The lease is then as it was before the
    /// restore (its namespace's `eth0` reached through its own host side), ready for the next
    /// one, and no retired (`old<n>`) link is left on the host.
    pub fn undo(&self) -> Result<(), NetError> {
        let retired = locked(&self.retired).take();
        let mut rt = locked(&self.net.rt);
        if let Some(made) = link::index_of(&mut rt, &self.ifname)? {
            if Some(made) != retired {
                match link::delete(&mut rt, made) {
                    Err(e) if e.errno() == Some(libc::ENODEV) => {}
                    r => r?,
                }
            }
        }
        if let Some(old) = retired {
            link::rename(&mut rt, old, &self.ifname)?;
            link::set_up(&mut rt, old)?;
        }
        Ok(())
    }
}

/// A name for the retired host side (link `index`) of `host_ifname`'s veth that does not
/// begin with the node's prefix (the name without its slot's digits): the node's rules and
/// audits take it for no sandbox's.
fn retired_name(host_ifname: &str, index: u32) -> String {
    let prefix = host_ifname.trim_end_matches(|c: char| c.is_ascii_digit());
    ["old", "was", "x"]
        .iter()
        .map(|tag| format!("{tag}{index}"))
        .find(|n| prefix.is_empty() || !n.starts_with(prefix))
        .unwrap_or_else(|| format!("-{index}"))
}

/// Turns IPv4 forwarding on or off in the calling thread's network namespace
/// (`net.ipv4.ip_forward`; this also sets every interface's `forwarding`). Sandboxes reach
/// the outside only with it on.
pub fn set_ipv4_forwarding(on: bool) -> Result<(), NetError> {
    ns::sysctl("net/ipv4/ip_forward", if on { "1" } else { "0" })
}

/// Whether IPv4 forwarding is on in the calling thread's network namespace.
pub fn ipv4_forwarding() -> Result<bool, NetError> {
    Ok(ns::read_sysctl("net/ipv4/ip_forward")? == "1")
}
