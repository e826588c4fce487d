//! Tests of sandbox networking. Each test builds a lab of its own: a "node" network namespace
//! (the host, as far as the code under test knows: its table, its veths, its forwarding) and
//! an "outside" namespace behind the node's default route, with the addresses of a small test
//! internet. Traffic goes only between these namespaces; the machine's own namespace, tables
//! and routes are never touched. Everything goes with the lab's descriptors, even on a panic.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::time::Duration;

use super::*;

/// The node's side of its uplink, and the outside's.
const UPLINK_NODE: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
const UPLINK_OUT: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
/// A public address of the test internet (in the outside namespace).
const PUBLIC: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
/// Private addresses in the outside namespace: refused unless allowed.
const PRIVATE_A: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 1);
const PRIVATE_B: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 1);
/// The gateway's open ports in these tests.
const OPEN_TCP: u16 = 8053;
const OPEN_UDP: u16 = 53;

/// How long a connection that must fail is tried, and one that must work.
const SHORT: Duration = Duration::from_millis(400);
const LONG: Duration = Duration::from_secs(5);

pub(crate) fn root() -> bool {
    nix::unistd::geteuid().is_root()
}

fn dup(fd: &OwnedFd) -> OwnedFd {
    fd.try_clone().expect("dup")
}

/// Runs `f` on a thread in namespace `ns`.
fn within<T: Send + 'static>(
    ns: &OwnedFd,
    f: impl FnOnce() -> Result<T, NetError> + Send + 'static,
) -> T {
    ns::within(dup(ns), f).expect("work in a namespace")
}

fn io<T>(r: std::io::Result<T>) -> Result<T, NetError> {
    r.map_err(|e| NetError::Io {
        what: "test".into(),
        source: e,
    })
}

pub(crate) struct Lab {
    // Dropped in this order: the network (its sockets and pool), then the namespaces.
    net: Option<Network>,
    pub(crate) node: OwnedFd,
    outside: OwnedFd,
}

pub(crate) fn config() -> NetConfig {
    NetConfig {
        table: format!("sbxtest{}", std::process::id()),
        prefix: "sbt".into(),
        range: "10.123.0.0/24".parse().expect("range"),
        gateway_ports: vec![(Proto::Tcp, OPEN_TCP), (Proto::Udp, OPEN_UDP)],
        allow: Vec::new(),
        refuse: Vec::new(),
        proxy_port: Some(OPEN_TCP),
        pool: 0,
        ct_limit: super::DEFAULT_CT_LIMIT,
    }
}

pub(crate) fn lab(cfg: NetConfig) -> Lab {
    let node = new_netns().expect("node namespace");
    let outside = new_netns().expect("outside namespace");
    let out = dup(&outside);
    within(&node, move || {
        let mut rt = Conn::new(netlink_sys::protocols::NETLINK_ROUTE)?;
        link::create_veth(&mut rt, "up0", "up1", out.as_fd())?;
        let up0 = link::index_of(&mut rt, "up0")?.ok_or(NetError::NotOurs)?;
        link::add_address(&mut rt, up0, UPLINK_NODE, 24)?;
        link::add_route(&mut rt, Ipv4Addr::UNSPECIFIED, 0, UPLINK_OUT, up0)?;
        set_ipv4_forwarding(true)
    });
    within(&outside, || {
        let mut rt = Conn::new(netlink_sys::protocols::NETLINK_ROUTE)?;
        let up1 = link::index_of(&mut rt, "up1")?.ok_or(NetError::NotOurs)?;
        link::set_up(&mut rt, up1)?;
        link::add_address(&mut rt, up1, UPLINK_OUT, 24)?;
        for a in [PUBLIC, PRIVATE_A, PRIVATE_B] {
            link::add_address(&mut rt, up1, a, 32)?;
        }
        Ok(())
    });
    let net = within(&node, move || Network::new(cfg));
    Lab {
        net: Some(net),
        node,
        outside,
    }
}

impl Lab {
    pub(crate) fn net(&self) -> &Network {
        self.net.as_ref().expect("network")
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.net.take();
    }
}

/// A TCP listener made in namespace `ns`.
fn listen(ns: &OwnedFd, addr: SocketAddr) -> TcpListener {
    within(ns, move || io(TcpListener::bind(addr)))
}

/// Accepts one connection on `l` (for a while) and answers with the address of its peer.
fn serve_once(l: TcpListener) -> std::thread::JoinHandle<Option<SocketAddr>> {
    std::thread::spawn(move || {
        l.set_nonblocking(true).ok()?;
        let end = std::time::Instant::now() + Duration::from_secs(5);
        while std::time::Instant::now() < end {
            match l.accept() {
                Ok((mut s, peer)) => {
                    s.set_nonblocking(false).ok()?;
                    let _ = s.write_all(peer.ip().to_string().as_bytes());
                    return Some(peer);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
        None
    })
}

/// Connects from namespace `ns` to `to` and returns what the server says, or the error.
fn connect(ns: &OwnedFd, to: SocketAddr) -> Result<String, String> {
    connect_within(ns, to, LONG)
}

/// Whether a connection from namespace `ns` to `to` fails (within a short while: a refused
/// destination drops the packets, so the attempt only times out).
fn refused(ns: &OwnedFd, to: SocketAddr) -> bool {
    connect_within(ns, to, SHORT).is_err()
}

fn connect_within(ns: &OwnedFd, to: SocketAddr, timeout: Duration) -> Result<String, String> {
    ns::within(dup(ns), move || {
        let mut s = io(TcpStream::connect_timeout(&to, timeout))?;
        io(s.set_read_timeout(Some(Duration::from_secs(2))))?;
        let mut out = String::new();
        io(s.read_to_string(&mut out))?;
        Ok(out)
    })
    .map_err(|e| e.to_string())
}

fn sa(ip: Ipv4Addr, port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(ip), port)
}

/// What `/proc/thread-self/net/route` says the default route is, in namespace `ns`.
fn default_route(ns: &OwnedFd) -> Option<(String, Ipv4Addr)> {
    within(ns, || {
        let table = io(std::fs::read_to_string("/proc/thread-self/net/route"))?;
        Ok(table.lines().skip(1).find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.get(1) != Some(&"00000000") {
                return None;
            }
            let gw = u32::from_str_radix(f.get(2)?, 16).ok()?;
            Some((f[0].to_string(), Ipv4Addr::from(gw.to_ne_bytes())))
        }))
    })
}

#[test]
fn a_sandbox_has_its_address_and_route_and_reaches_only_what_is_open() {
    if !root() {
        return;
    }
    let lab = lab(config());
    let net = lab.net();
    assert_eq!(net.fill(2).expect("fill"), 2);
    assert_eq!(net.ready(), 2);
    let a = net.take().expect("take a");
    let b = net.take().expect("take b");
    assert_eq!(net.ready(), 0);
    let gw = net.gateway();
    assert_eq!(gw, Ipv4Addr::new(10, 123, 0, 1));
    assert_ne!(a.address(), b.address());
    assert!(config().range.contains(&a.address()));
    let ans = dup(&a.ns_handle().expect("handle a"));
    let bns = dup(&b.ns_handle().expect("handle b"));

    // Inside: eth0 with the address, the default route via the gateway, lo up, no IPv6.
    let want = a.address();
    let (addrs, v6_off, v6_addrs) = within(&ans, move || {
        let mut rt = Conn::new(netlink_sys::protocols::NETLINK_ROUTE)?;
        let eth0 = link::index_of(&mut rt, INNER_IFNAME)?.ok_or(NetError::NotOurs)?;
        let addrs = link::addresses(&mut rt, eth0)?;
        let v6 = ns::read_sysctl("net/ipv6/conf/eth0/disable_ipv6")?;
        let v6_addrs = io(std::fs::read_to_string("/proc/thread-self/net/if_inet6"))?;
        Ok((addrs, v6 == "1", v6_addrs))
    });
    assert_eq!(addrs, vec![want]);
    assert!(v6_off, "IPv6 is off on eth0");
    assert!(!v6_addrs.contains(INNER_IFNAME), "{v6_addrs}");
    assert!(v6_addrs.contains(" lo"), "lo keeps ::1: {v6_addrs}");
    let host_v6 = within(&lab.node, || {
        io(std::fs::read_to_string("/proc/thread-self/net/if_inet6"))
    });
    assert!(!host_v6.contains(a.host_ifname()), "{host_v6}");
    assert_eq!(
        default_route(&ans),
        Some((INNER_IFNAME.to_string(), gw)),
        "default route via the gateway"
    );
    // The sandbox's own loopback works.
    let l = listen(&ans, sa(Ipv4Addr::LOCALHOST, 7100));
    let t = serve_once(l);
    assert_eq!(
        connect(&ans, sa(Ipv4Addr::LOCALHOST, 7100)).as_deref(),
        Ok("127.0.0.1")
    );
    t.join().expect("server");

    // The gateway's open port answers, with the sandbox's own address as the peer.
    let t = serve_once(listen(&lab.node, sa(gw, OPEN_TCP)));
    assert_eq!(connect(&ans, sa(gw, OPEN_TCP)), Ok(a.address().to_string()));
    t.join().expect("server");
    // UDP to the gateway's open port too.
    let u = within(&lab.node, move || io(UdpSocket::bind(sa(gw, OPEN_UDP))));
    io(u.set_read_timeout(Some(Duration::from_secs(2)))).expect("timeout");
    within(&ans, move || {
        let s = io(UdpSocket::bind(sa(Ipv4Addr::UNSPECIFIED, 0)))?;
        io(s.send_to(b"q", sa(gw, OPEN_UDP)))?;
        Ok(())
    });
    let mut buf = [0u8; 8];
    let (n, from) = u.recv_from(&mut buf).expect("a datagram from the sandbox");
    assert_eq!((&buf[..n], from.ip()), (&b"q"[..], IpAddr::V4(a.address())));

    // The host's other ports and addresses are refused: a listener on every address, a port
    // not opened; and one on the host's loopback.
    let l = listen(&lab.node, sa(Ipv4Addr::UNSPECIFIED, 8054));
    assert!(refused(&ans, sa(gw, 8054)), "a port not opened");
    assert!(
        refused(&ans, sa(UPLINK_NODE, 8054)),
        "the host's other address"
    );
    assert!(
        refused(&ans, sa(UPLINK_NODE, OPEN_TCP)),
        "the open port, elsewhere"
    );
    drop(l);
    let l = listen(&lab.node, sa(Ipv4Addr::LOCALHOST, 8055));
    assert!(
        refused(&ans, sa(gw, 8055)),
        "the host's loopback via the gateway"
    );
    assert!(
        refused(&ans, sa(Ipv4Addr::LOCALHOST, 8055)),
        "the host's loopback"
    );
    drop(l);

    // Another sandbox is unreachable, though the host reaches it.
    let bl = listen(&bns, sa(b.address(), 9000));
    assert!(refused(&ans, sa(b.address(), 9000)), "another sandbox");
    let t = serve_once(bl);
    assert_eq!(
        connect(&lab.node, sa(b.address(), 9000)),
        Ok(gw.to_string())
    );
    t.join().expect("server");

    // The outside: reached through NAT (the server sees the node's address).
    let t = serve_once(listen(&lab.outside, sa(PUBLIC, 7000)));
    assert_eq!(
        connect(&ans, sa(PUBLIC, 7000)),
        Ok(UPLINK_NODE.to_string()),
        "masqueraded to the node's uplink address"
    );
    assert_eq!(
        t.join().expect("server").map(|p| p.ip()),
        Some(IpAddr::V4(UPLINK_NODE))
    );
    // Private destinations are refused (the outside answers them: the host reaches them).
    for p in [PRIVATE_A, PRIVATE_B] {
        let l = listen(&lab.outside, sa(p, 7000));
        assert!(refused(&ans, sa(p, 7000)), "refused: {p}");
        let t = serve_once(l);
        assert!(
            connect(&lab.node, sa(p, 7000)).is_ok(),
            "the host reaches {p}"
        );
        t.join().expect("server");
    }

    // Its connections are told apart: conntrack entries marked with its address.
    let audit = net.audit().expect("audit");
    assert!(audit.table);
    assert!(audit.is_clean(), "{audit:?}");
    assert_eq!(audit.leased, 2);
    let mark = nft::ct_mark(a.address());
    assert!(
        audit
            .conntrack
            .iter()
            .any(|e| e.mark == mark && e.dst == IpAddr::V4(PUBLIC)),
        "{:?}",
        audit.conntrack
    );
    let mut elements = audit.elements.clone();
    elements.sort();
    let mut want = vec![
        (a.host_ifname().to_string(), a.address()),
        (b.host_ifname().to_string(), b.address()),
    ];
    want.sort();
    assert_eq!(elements, want);

    // Released: elements, conntrack entries, interfaces gone.
    net.release(a).expect("release a");
    drop(b);
    drop((ans, bns));
    let audit = net.audit_settled(Duration::from_secs(20)).expect("audit");
    assert!(audit.is_clean(), "{audit:?}");
    assert_eq!((audit.ready, audit.leased), (0, 0));
    assert!(audit.interfaces.is_empty(), "{audit:?}");
    assert!(audit.elements.is_empty(), "{audit:?}");
    assert!(audit.conntrack.is_empty(), "{audit:?}");
}

#[test]
fn the_allow_list_opens_a_refused_range() {
    if !root() {
        return;
    }
    let mut cfg = config();
    cfg.allow = vec!["10.99.0.0/24".parse().expect("cidr")];
    let lab1 = lab(cfg);
    let a = lab1.net().take().expect("take");
    let ans = a.ns_handle().expect("handle");
    let t = serve_once(listen(&lab1.outside, sa(PRIVATE_A, 7000)));
    assert_eq!(
        connect(&ans, sa(PRIVATE_A, 7000)),
        Ok(UPLINK_NODE.to_string())
    );
    t.join().expect("server");
    let _l = listen(&lab1.outside, sa(PRIVATE_B, 7000));
    assert!(refused(&ans, sa(PRIVATE_B, 7000)), "still refused");
    // The node's own range is refused whatever the list says (here: a free slot's address,
    // which the outside has, to answer if the packet got there).
    let mut cfg = config();
    cfg.allow = vec!["10.0.0.0/8".parse().expect("cidr")];
    drop((a, ans));
    drop(lab1);
    let lab2 = lab(cfg);
    let a = lab2.net().take().expect("take");
    let ans = a.ns_handle().expect("handle");
    let free = Ipv4Addr::from(u32::from(a.address()) + 7);
    within(&lab2.outside, move || {
        let mut rt = Conn::new(netlink_sys::protocols::NETLINK_ROUTE)?;
        let up1 = link::index_of(&mut rt, "up1")?.ok_or(NetError::NotOurs)?;
        link::add_address(&mut rt, up1, free, 32)
    });
    let l = listen(&lab2.outside, sa(free, 7000));
    assert!(refused(&ans, sa(free, 7000)), "the node's range");
    let t = serve_once(l);
    assert!(
        connect(&lab2.node, sa(free, 7000)).is_ok(),
        "the host reaches it"
    );
    t.join().expect("server");
}

#[test]
fn a_sandbox_s_own_rules_hold_change_at_once_and_go_with_it() {
    if !root() {
        return;
    }
    let lab = lab(config());
    let net = lab.net();
    let a = net.take().expect("take a");
    let b = net.take().expect("take b");
    let (ans, bns) = (
        a.ns_handle().expect("handle a"),
        b.ns_handle().expect("handle b"),
    );
    let other = Ipv4Addr::new(203, 0, 113, 11);
    within(&lab.outside, move || {
        let mut rt = Conn::new(netlink_sys::protocols::NETLINK_ROUTE)?;
        let up1 = link::index_of(&mut rt, "up1")?.ok_or(NetError::NotOurs)?;
        link::add_address(&mut rt, up1, other, 32)
    });
    // Default deny but PUBLIC; port 7001 refused whatever.
    let rules = SandboxRules {
        default_deny: true,
        exceptions: vec![(PUBLIC, PUBLIC)],
        deny_ports: vec![7001],
        proxied: false,
        restrict_names: false,
    };
    net.set_rules(&a, Some(&rules)).expect("rules");
    let t = serve_once(listen(&lab.outside, sa(PUBLIC, 7000)));
    assert_eq!(connect(&ans, sa(PUBLIC, 7000)), Ok(UPLINK_NODE.to_string()));
    t.join().expect("server");
    let _l1 = listen(&lab.outside, sa(PUBLIC, 7001));
    assert!(refused(&ans, sa(PUBLIC, 7001)), "deny_ports wins");
    let _l2 = listen(&lab.outside, sa(other, 7000));
    assert!(refused(&ans, sa(other, 7000)), "default deny");
    // The neighbour has no rules: it reaches both.
    let t = serve_once(listen(&lab.outside, sa(other, 7002)));
    assert!(connect(&bns, sa(other, 7002)).is_ok(), "b is not a's rules");
    t.join().expect("server");
    // Changed: default allow but PUBLIC, and TCP 80 to the proxy (the gateway's open port).
    let rules = SandboxRules {
        default_deny: false,
        exceptions: vec![(PUBLIC, PUBLIC)],
        deny_ports: Vec::new(),
        proxied: true,
        restrict_names: true,
    };
    net.set_rules(&a, Some(&rules)).expect("rules changed");
    let t = serve_once(listen(&lab.outside, sa(other, 7003)));
    assert!(connect(&ans, sa(other, 7003)).is_ok(), "now allowed");
    t.join().expect("server");
    let _l3 = listen(&lab.outside, sa(PUBLIC, 7004));
    assert!(refused(&ans, sa(PUBLIC, 7004)), "now refused");
    let gw = net.gateway();
    let t = serve_once(listen(&lab.node, sa(gw, OPEN_TCP)));
    assert_eq!(
        connect(&ans, sa(other, 80)),
        Ok(a.address().to_string()),
        "port 80 anywhere reaches the proxy"
    );
    t.join().expect("proxy");
    let u = within(&lab.outside, move || io(UdpSocket::bind(sa(other, 853))));
    io(u.set_read_timeout(Some(SHORT))).expect("timeout");
    within(&ans, move || {
        let s = io(UdpSocket::bind(sa(Ipv4Addr::UNSPECIFIED, 0)))?;
        io(s.send_to(b"q", sa(other, 853)))
    });
    assert!(u.recv_from(&mut [0u8; 8]).is_err(), "DNS over TLS refused");
    // DNS asked of another server goes to the gateway's.
    let dns = within(&lab.node, move || io(UdpSocket::bind(sa(gw, OPEN_UDP))));
    io(dns.set_read_timeout(Some(LONG))).expect("timeout");
    within(&ans, move || {
        let s = io(UdpSocket::bind(sa(Ipv4Addr::UNSPECIFIED, 0)))?;
        io(s.send_to(b"q", sa(other, 53)))
    });
    let (_, from) = dns
        .recv_from(&mut [0u8; 8])
        .expect("DNS to another server at the gateway");
    assert_eq!(from.ip(), IpAddr::V4(a.address()));
    // Taken away: as any sandbox again.
    net.set_rules(&a, None).expect("rules removed");
    let t = serve_once(listen(&lab.outside, sa(PUBLIC, 7005)));
    assert!(connect(&ans, sa(PUBLIC, 7005)).is_ok(), "rules gone");
    t.join().expect("server");
    // Set again, then released with the lease: nothing of them is left.
    net.set_rules(&a, Some(&rules)).expect("rules again");
    net.release(a).expect("release");
    let c = net.take().expect("take c");
    net.set_rules(&c, Some(&rules))
        .expect("a new sandbox's rules");
    net.release(c).expect("release c");
    drop((ans, bns, b));
}

#[test]
fn a_destroyed_sandbox_s_namespace_goes_back_to_the_pool_clean() {
    if !root() {
        return;
    }
    let mut cfg = config();
    cfg.pool = 1;
    let lab = lab(cfg);
    let net = lab.net();
    let a = net.take().expect("take");
    let (slot, addr) = (a.slot(), a.address());
    let rules = SandboxRules {
        default_deny: true,
        ..SandboxRules::default()
    };
    net.set_rules(&a, Some(&rules)).expect("rules");
    // The pool's thread refills to 1 after the take; the recycled one comes in front of it.
    let deadline = std::time::Instant::now() + LONG;
    while net.ready() < 1 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    net.recycle(a).expect("recycle");
    assert_eq!(net.ready(), 2, "back in the pool, beside the thread's");
    let b = net.take().expect("take again");
    assert_eq!(
        (b.slot(), b.address()),
        (slot, addr),
        "the recycled one first"
    );
    // Leased again with its element, without the rules of the sandbox before.
    let bns = b.ns_handle().expect("handle");
    let t = serve_once(listen(&lab.outside, sa(PUBLIC, 7010)));
    assert!(
        connect(&bns, sa(PUBLIC, 7010)).is_ok(),
        "no rules left over"
    );
    t.join().expect("server");
    // At twice the pool's size a recycled namespace is released for good.
    let c = net.take().expect("take c");
    net.recycle(b).expect("recycle b");
    net.recycle(c).expect("recycle c");
    assert!(net.ready() <= 2, "{}", net.ready());
    drop(bns);
}

#[test]
fn the_pool_thread_keeps_namespaces_ready() {
    if !root() {
        return;
    }
    let mut cfg = config();
    cfg.pool = 3;
    let lab = lab(cfg);
    let net = lab.net();
    let wait = |n: usize| {
        let end = std::time::Instant::now() + Duration::from_secs(20);
        while net.ready() < n && std::time::Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
        }
        net.ready()
    };
    assert_eq!(wait(3), 3);
    let a = net.take().expect("take");
    assert_eq!(wait(3), 3, "made again after a take");
    drop(a);
    let audit = net.audit().expect("audit");
    assert_eq!((audit.ready, audit.leased), (3, 0));
}

#[test]
fn hundreds_of_cycles_leave_nothing_behind() {
    if !root() {
        return;
    }
    let lab = lab(config());
    let net = lab.net();
    for i in 0..300 {
        net.prepare().expect("prepare");
        let lease = net.take().expect("take");
        if i % 50 == 0 {
            // Some traffic, for conntrack entries to flush.
            let gw = net.gateway();
            let t = serve_once(listen(&lab.node, sa(gw, OPEN_TCP)));
            let ns = lease.ns_handle().expect("handle");
            assert!(connect(&ns, sa(gw, OPEN_TCP)).is_ok());
            t.join().expect("server");
        }
        net.release(lease).expect("release");
    }
    // The kernel removes released namespaces in batches of its own time: on a loaded machine
    // (a build beside the tests) the last one took more than a minute once.
    let audit = net.audit_settled(Duration::from_secs(180)).expect("audit");
    assert!(audit.is_clean(), "{audit:?}");
    assert!(audit.interfaces.is_empty(), "{audit:?}");
    assert!(audit.elements.is_empty(), "{audit:?}");
    assert!(audit.conntrack.is_empty(), "{audit:?}");
    assert_eq!((audit.ready, audit.leased), (0, 0));
    // No interface left means no namespace left: a namespace that anything still holds
    // keeps the peer of its host-side veth. (Namespace ids are no proof: the kernel reuses
    // them at once, for the other tests' namespaces.)
}

#[test]
fn a_restarted_node_adopts_running_sandboxes_and_removes_leftovers() {
    if !root() {
        return;
    }
    let mut lab = lab(config());
    let gw = lab.net().gateway();
    // Three sandboxes, then the node dies without releasing them: the first keeps running
    // (adopted later), the second is gone, the third's namespace is held by a stray process.
    let (running, gone, stray) = {
        let net = lab.net();
        let leases: Vec<Lease> = (0..3).map(|_| net.take().expect("take")).collect();
        for l in &leases {
            // A connection each: conntrack entries.
            let t = serve_once(listen(&lab.node, sa(gw, OPEN_TCP)));
            assert!(connect(&l.ns_handle().expect("handle"), sa(gw, OPEN_TCP)).is_ok());
            t.join().expect("server");
        }
        let handles: Vec<(OwnedFd, Ipv4Addr, String)> = leases
            .iter()
            .map(|l| {
                (
                    l.ns_handle().expect("handle"),
                    l.address(),
                    l.host_ifname().to_string(),
                )
            })
            .collect();
        for l in leases {
            l.leave_running();
        }
        let mut h = handles.into_iter();
        (
            h.next().expect("1"),
            h.next().expect("2"),
            h.next().expect("3"),
        )
    };
    lab.net.take();
    drop(gone.0);
    // The node starts again: its table is loaded again, with the elements it had.
    let node = dup(&lab.node);
    lab.net = Some(within(&node, || Network::new(config())));
    let net = lab.net();
    // The gone one's veth goes with its namespace, in the kernel's time.
    let end = std::time::Instant::now() + Duration::from_secs(20);
    let audit = loop {
        let a = net.audit().expect("audit");
        if !a.interfaces.contains(&gone.2) || std::time::Instant::now() > end {
            break a;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(audit.elements.len(), 3, "{audit:?}");
    assert_eq!(audit.leftover_elements.len(), 3, "{audit:?}");
    assert_eq!(
        audit.leftover_interfaces,
        vec![running.2.clone(), stray.2.clone()],
        "the gone one's went with its namespace"
    );
    assert_eq!((audit.ready, audit.leased), (0, 0));
    assert!(!audit.leftover_conntrack.is_empty(), "{audit:?}");

    // The pool, filling before the adoptions (its thread starts with the network), takes
    // none of the slots whose elements the previous node left.
    net.fill(2).expect("fill");
    let early: Vec<Lease> = (0..2).map(|_| net.take().expect("take")).collect();
    for l in &early {
        assert!(
            ![running.1, gone.1, stray.1].contains(&l.address()),
            "a slot the previous node's sandbox has: {}",
            l.address()
        );
    }
    drop(early);

    let adopted = net.adopt(running.0).expect("adopt");
    assert_eq!(adopted.address(), running.1);
    assert_eq!(adopted.host_ifname(), running.2);
    // It works as before.
    let t = serve_once(listen(&lab.node, sa(gw, OPEN_TCP)));
    assert_eq!(
        connect(&adopted.ns_handle().expect("handle"), sa(gw, OPEN_TCP)),
        Ok(running.1.to_string())
    );
    t.join().expect("server");
    assert!(matches!(
        net.adopt(adopted.ns_handle().expect("handle")),
        Err(NetError::InUse(_))
    ));

    let audit = net.remove_leftovers().expect("remove");
    assert!(audit.is_clean(), "{audit:?}");
    assert_eq!(audit.elements, vec![(running.2.clone(), running.1)]);
    assert_eq!(audit.interfaces, vec![running.2.clone()]);
    assert!(audit
        .conntrack
        .iter()
        .all(|e| e.src == IpAddr::V4(running.1) || e.dst == IpAddr::V4(running.1)));
    // The stray holder's namespace lost its veth.
    let left = within(&stray.0, || {
        link::list(&mut Conn::new(netlink_sys::protocols::NETLINK_ROUTE)?)
    });
    assert!(left.iter().all(|(_, n)| n != INNER_IFNAME), "{left:?}");
    // A new sandbox does not get a slot in use.
    let fresh = net.take().expect("take");
    assert!(![running.1, stray.1].contains(&fresh.address()));
    drop(fresh);
    net.release(adopted).expect("release");
    drop(stray);
    let audit = net.audit_settled(Duration::from_secs(20)).expect("audit");
    assert!(audit.is_clean() && audit.interfaces.is_empty(), "{audit:?}");
}

#[test]
fn a_running_sandbox_whose_element_was_lost_keeps_its_slot_for_adoption() {
    if !root() {
        return;
    }
    let mut lab = lab(config());
    // A node that dropped a kept sandbox's lease at its exit removed its element; the
    // namespace lives on with the sandbox's processes (here, a handle on it).
    let (handle, address) = {
        let net = lab.net();
        let lease = net.take().expect("take");
        let out = (lease.ns_handle().expect("handle"), lease.address());
        drop(lease);
        out
    };
    lab.net.take();
    let node = dup(&lab.node);
    lab.net = Some(within(&node, || Network::new(config())));
    let net = lab.net();
    assert!(net.audit().expect("audit").elements.is_empty());
    // Its slot is out of the free list from the start: the pool's thread, which starts with
    // the network, never tries it (a make that fails there holds the slot meanwhile, and the
    // adoption would find it in use).
    let slot = net.inner.slot_of(address).expect("slot");
    assert!(
        !locked(&net.inner.state).free.contains(&slot),
        "the slot of a running sandbox's interface is free"
    );
    // The pool fills before the adoption and takes none of the slot whose interface is there.
    net.fill(3).expect("fill");
    let early: Vec<Lease> = (0..3).map(|_| net.take().expect("take")).collect();
    assert!(
        early.iter().all(|l| l.address() != address),
        "the pool took the slot of a sandbox that runs"
    );
    drop(early);
    let adopted = net.adopt(handle).expect("adopt");
    assert_eq!(adopted.address(), address);
    let gw = net.gateway();
    let t = serve_once(listen(&lab.node, sa(gw, OPEN_TCP)));
    assert_eq!(
        connect(&adopted.ns_handle().expect("handle"), sa(gw, OPEN_TCP)),
        Ok(address.to_string())
    );
    t.join().expect("server");
    net.remove_leftovers().expect("remove");
    net.release(adopted).expect("release");
    let audit = net.audit_settled(Duration::from_secs(20)).expect("audit");
    assert!(audit.is_clean() && audit.interfaces.is_empty(), "{audit:?}");
}

#[test]
fn the_path_of_a_lease_names_its_namespace_for_init() {
    if !root() {
        return;
    }
    let lab = lab(config());
    let lease = lab.net().take().expect("take");
    let want = std::fs::read_link(lease.ns_path()).expect("link");
    let path = lease.ns_path();
    let seen = ns::within(dup(&lab.node), move || {
        crate::init::join_netns(&path).map_err(|e| NetError::Config(e.to_string()))?;
        io(std::fs::read_link("/proc/thread-self/ns/net"))
    })
    .expect("joined");
    assert_eq!(seen, want);
    // Owned by a user namespace of its own (not the host's), which the sandbox joins.
    let f = std::fs::File::open(lease.ns_path()).expect("open");
    let owner = crate::init::owner_userns(&f).expect("owner");
    assert!(!crate::init::is_initial_userns(&owner).expect("compare"));
}

#[test]
fn bad_settings_are_refused() {
    let with_prefix = |p: &str| NetConfig {
        prefix: p.into(),
        ..NetConfig::default()
    };
    let with_range = |r: &str| NetConfig {
        range: r.parse().expect("range"),
        ..NetConfig::default()
    };
    assert!(matches!(
        with_prefix("waytoolongprefix").check(),
        Err(NetError::Config(_))
    ));
    assert!(with_prefix("sb*").check().is_err());
    assert!(
        with_prefix("sbx1").check().is_err(),
        "a prefix ending in a digit"
    );
    assert!(with_range("10.1.2.0/31").check().is_err());
    assert!(
        with_range("10.1.2.1/24").check().is_err(),
        "not a network address"
    );
    assert_eq!(with_range("10.1.2.0/30").check().ok(), Some(1));
    assert_eq!(NetConfig::default().check().ok(), Some(65533));
}

/// The agent binary beside this test's (built by `cargo build --workspace`) and the base
/// image's root (`SBX_TEST_IMAGES`, else the machine's), when both are there.
pub(crate) fn agent_and_rootfs() -> Option<(PathBuf, PathBuf)> {
    let exe = std::env::current_exe().ok()?;
    let agent = exe.parent()?.parent()?.join("sbx-agent");
    let images = std::env::var_os("SBX_TEST_IMAGES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/sbx/images"));
    let rootfs = images.join("base/rootfs");
    (agent.is_file() && rootfs.join("bin").exists()).then_some((agent, rootfs))
}

/// Ends a sandbox when dropped.
struct Running<'a> {
    driver: &'a crate::driver::NamespaceDriver,
    sandbox: crate::driver::Sandbox,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        use crate::driver::Driver;
        let _ = self.driver.destroy(&self.sandbox);
    }
}

#[test]
fn the_driver_starts_a_sandbox_in_its_leased_namespace() {
    use crate::driver::{Driver, NamespaceDriver, SandboxSpec};
    if !root() {
        return;
    }
    let Some((agent, rootfs)) = agent_and_rootfs() else {
        eprintln!("skipped: no sbx-agent beside the tests, or no base image");
        return;
    };
    let mut lab = lab(config());
    let lease = lab.net().take().expect("take");
    let pid = std::process::id();
    let dir = crate::TempDir::new("net-test");
    let driver = NamespaceDriver::with_cgroup_name(
        agent,
        &format!("sbx-net-test-{pid}"),
        &dir.path().display().to_string(),
        100_000,
        65_536,
    )
    .expect("driver");
    // Its cgroup folder goes once the sandboxes have.
    struct Release<'a>(&'a NamespaceDriver);
    impl Drop for Release<'_> {
        fn drop(&mut self) {
            self.0.release();
        }
    }
    let _release = Release(&driver);
    let spec = |id: &str, netns: Option<PathBuf>| SandboxSpec {
        netns,
        ..SandboxSpec::for_test(id, &rootfs, dir.path())
    };
    let ns_of = |pid: u32| std::fs::read_link(format!("/proc/{pid}/ns/net")).expect("ns");
    let joined = Running {
        driver: &driver,
        sandbox: driver
            .create(&spec("sbnet1", Some(lease.ns_path())))
            .expect("a sandbox in the lease's namespace"),
    };
    let unshared = Running {
        driver: &driver,
        sandbox: driver
            .create(&spec("sbnet2", None))
            .expect("a sandbox with a namespace of its own"),
    };
    let want = std::fs::read_link(lease.ns_path()).expect("lease ns");
    assert_eq!(
        ns_of(joined.sandbox.pid),
        want,
        "the agent is in the lease's namespace"
    );
    let unshared_ns = ns_of(unshared.sandbox.pid);
    assert_ne!(unshared_ns, want);
    assert_ne!(unshared_ns, ns_of(pid), "not the test's either");
    // The other sandbox's links, seen from inside it: only lo, as before.
    let links = ns::within(unshared.sandbox.netns_handle().expect("handle"), || {
        link::list(&mut Conn::new(netlink_sys::protocols::NETLINK_ROUTE)?)
    })
    .expect("links");
    let links: Vec<String> = links.into_iter().map(|(_, n)| n).collect();
    assert_eq!(links, vec!["lo".to_string()]);
    drop(unshared);

    // The node restarts: the sandbox keeps its namespace, which is adopted by its agent's
    // pidfd, with its address.
    let address = lease.address();
    lease.leave_running();
    lab.net.take();
    let node = dup(&lab.node);
    lab.net = Some(within(&node, || Network::new(config())));
    let adopted = lab
        .net()
        .adopt(joined.sandbox.netns_handle().expect("pidfd"))
        .expect("adopt");
    assert_eq!(adopted.address(), address);
    assert_eq!(std::fs::read_link(adopted.ns_path()).expect("ns"), want);
    let gw = lab.net().gateway();
    let t = serve_once(listen(&lab.node, sa(gw, OPEN_TCP)));
    assert_eq!(
        connect(&adopted.ns_handle().expect("handle"), sa(gw, OPEN_TCP)),
        Ok(address.to_string())
    );
    t.join().expect("server");

    drop(joined);
    lab.net().release(adopted).expect("release");
    let audit = lab
        .net()
        .audit_settled(Duration::from_secs(20))
        .expect("audit");
    assert!(audit.is_clean() && audit.interfaces.is_empty(), "{audit:?}");
}

#[test]
fn traffic_of_a_namespace_not_leased_or_of_a_spoofed_address_is_dropped() {
    if !root() {
        return;
    }
    let lab = lab(config());
    let net = lab.net();
    net.fill(1).expect("fill");
    let a = net.take().expect("take");
    net.fill(1).expect("fill");
    let pooled = {
        let st = locked(&net.inner.state);
        let r = st.ready.front().expect("a ready namespace");
        (dup(&r.ns), net.inner.address(r.slot))
    };
    let gw = net.gateway();
    let l = listen(&lab.node, sa(gw, OPEN_TCP));
    // A namespace still in the pool has its veth, its address and its route, but no element.
    assert!(refused(&pooled.0, sa(gw, OPEN_TCP)), "a pooled namespace");
    // A leased one whose process took another address (here the test, root of it): its
    // packets do not match its element.
    let ans = a.ns_handle().expect("handle");
    let other = pooled.1;
    within(&ans, move || {
        let mut rt = Conn::new(netlink_sys::protocols::NETLINK_ROUTE)?;
        let eth0 = link::index_of(&mut rt, INNER_IFNAME)?.ok_or(NetError::NotOurs)?;
        link::add_address(&mut rt, eth0, other, 32)
    });
    let spoofed = ns::within(dup(&ans), move || {
        let s = io(std::net::TcpStream::connect_timeout(
            &sa(gw, OPEN_TCP),
            LONG,
        ));
        Ok(s.is_ok())
    })
    .expect("from the sandbox");
    assert!(spoofed, "its own address still works");
    let u = within(&lab.node, move || io(UdpSocket::bind(sa(gw, OPEN_UDP))));
    io(u.set_read_timeout(Some(SHORT))).expect("timeout");
    // A datagram from the other address (a socket bound to it), then one from its own.
    within(&ans, move || {
        let sock = io(std::net::UdpSocket::bind(sa(other, 0)))?;
        io(sock.send_to(b"x", sa(gw, OPEN_UDP)))?;
        let mine = io(std::net::UdpSocket::bind(sa(Ipv4Addr::UNSPECIFIED, 0)))?;
        io(mine.send_to(b"y", sa(gw, OPEN_UDP)))?;
        Ok(())
    });
    let mut got = Vec::new();
    let mut buf = [0u8; 8];
    while let Ok((n, from)) = u.recv_from(&mut buf) {
        got.push((buf[..n].to_vec(), from.ip()));
    }
    assert_eq!(got, vec![(b"y".to_vec(), IpAddr::V4(a.address()))]);
    drop(l);
}

#[test]
fn leases_are_taken_and_released_from_many_threads() {
    fn shared<T: Send + Sync>(_: &T) {}
    if !root() {
        return;
    }
    let mut cfg = config();
    cfg.pool = 4;
    let lab = lab(cfg);
    let net = lab.net();
    shared(net);
    let seen = std::sync::Mutex::new(std::collections::HashSet::new());
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..40 {
                    let lease = net.take().expect("take");
                    // No two live leases share a slot.
                    assert!(locked(&seen).insert(lease.slot()), "slot {}", lease.slot());
                    std::thread::sleep(Duration::from_millis(1));
                    locked(&seen).remove(&lease.slot());
                    net.release(lease).expect("release");
                }
            });
        }
    });
    let audit = net.audit().expect("audit");
    assert_eq!(audit.leased, 0);
    assert!(audit.elements.is_empty(), "{audit:?}");
}

#[test]
fn a_retired_host_side_never_takes_the_node_s_prefix() {
    assert_eq!(retired_name("sbt12", 40), "old40");
    // A prefix that "old…" would begin with: the next tag.
    assert_eq!(retired_name("o3", 7), "was7");
    assert_eq!(retired_name("w3", 7), "old7");
    for (name, index) in [("sbt0", 1), ("old5", 9), ("ol1", 2), ("x9", 3)] {
        let r = retired_name(name, index);
        let prefix = name.trim_end_matches(|c: char| c.is_ascii_digit());
        assert!(!r.starts_with(prefix), "{name} -> {r}");
        assert!(r.len() < 16, "{r}");
    }
}

/// Whether a TCP connection from namespace `ns` to `to` is made within `timeout` (a listener's
/// backlog takes it: nobody needs to accept).
fn connects(ns: &OwnedFd, to: SocketAddr, timeout: Duration) -> bool {
    ns::within(dup(ns), move || {
        Ok(TcpStream::connect_timeout(&to, timeout).is_ok())
    })
    .expect("connect from a namespace")
}

#[test]
fn held_traffic_passes_neither_way_and_flows_again_when_let_go() {
    if !root() {
        return;
    }
    let lab = lab(config());
    let net = lab.net();
    net.fill(1).expect("fill");
    let a = net.take().expect("take");
    let ans = a.ns_handle().expect("handle");
    let gw = net.gateway();
    // The host's service on the gateway, and the sandbox's on its address.
    let _host = listen(&lab.node, sa(gw, OPEN_TCP));
    let _inside = listen(&ans, sa(Ipv4Addr::UNSPECIFIED, 9000));
    let to_host = sa(gw, OPEN_TCP);
    let to_sandbox = sa(a.address(), 9000);
    assert!(connects(&ans, to_host, LONG), "out, before");
    assert!(connects(&lab.node, to_sandbox, LONG), "in, before");
    // A datagram into the sandbox needs no answer: only the node's hold can stop it.
    let u = within(&ans, || {
        io(UdpSocket::bind(sa(Ipv4Addr::UNSPECIFIED, 9001)))
    });
    io(u.set_read_timeout(Some(SHORT))).expect("timeout");
    // Whether the host's kernel let it go out (a local packet its rules drop is EPERM).
    let send = |what: &'static [u8]| -> bool {
        let to = sa(a.address(), 9001);
        within(&lab.node, move || {
            let s = io(UdpSocket::bind(sa(Ipv4Addr::UNSPECIFIED, 0)))?;
            Ok(s.send_to(what, to).is_ok())
        })
    };
    let mut buf = [0u8; 8];
    a.hold_traffic(true).expect("hold");
    assert!(!connects(&ans, to_host, SHORT), "out, held");
    assert!(!connects(&lab.node, to_sandbox, SHORT), "in, held");
    assert!(
        !send(b"held"),
        "the host's rules let a datagram go to a held sandbox"
    );
    assert!(u.recv_from(&mut buf).is_err(), "a datagram in while held");
    a.hold_traffic(false).expect("let go");
    assert!(connects(&ans, to_host, LONG), "out, after");
    assert!(connects(&lab.node, to_sandbox, LONG), "in, after");
    assert!(send(b"free"));
    let (n, _) = u.recv_from(&mut buf).expect("a datagram in after");
    assert_eq!(&buf[..n], b"free");
}

/// The TCP connections from namespace `ns` to `to` that open, of `n` tried (held).
fn open_many(ns: &OwnedFd, to: SocketAddr, n: usize) -> Vec<TcpStream> {
    ns::within(dup(ns), move || {
        Ok((0..n)
            .filter_map(|_| TcpStream::connect_timeout(&to, SHORT).ok())
            .collect::<Vec<_>>())
    })
    .expect("from the sandbox")
}

#[test]
fn a_sandbox_s_connections_in_conntrack_are_limited_and_another_s_are_not() {
    if !root() {
        return;
    }
    let limit = 12;
    let lab = lab(NetConfig {
        ct_limit: limit,
        ..config()
    });
    let net = lab.net();
    net.fill(2).expect("fill");
    let a = net.take().expect("take a");
    let b = net.take().expect("take b");
    // Two destinations: the gateway (the node's own services) and one outside.
    let gw = net.gateway();
    let l = listen(&lab.node, sa(gw, OPEN_TCP));
    let outside = listen(&lab.outside, sa(PUBLIC, 80));
    let ans = a.ns_handle().expect("handle a");
    let bns = b.ns_handle().expect("handle b");
    // a's new connections past the limit are dropped, wherever they go.
    let held_by_a = open_many(&ans, sa(gw, OPEN_TCP), 20);
    assert_eq!(held_by_a.len(), limit as usize, "to the gateway");
    assert_eq!(open_many(&ans, sa(PUBLIC, 80), 3).len(), 0, "out");
    // b has a share of its own, whatever a holds.
    assert_eq!(open_many(&bns, sa(PUBLIC, 80), 5).len(), 5, "b out");
    assert_eq!(
        open_many(&bns, sa(gw, OPEN_TCP), 5).len(),
        5,
        "b to the gateway"
    );
    drop((l, outside, held_by_a));
}
