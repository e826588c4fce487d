//! One sandbox cannot take what the node's sandboxes share: the node's DNS (questions in
//! flight over UDP, TCP connections, idle ones closed), its egress proxy (connections) and
//! the host's conntrack table (the kernel's count per sandbox address). Driven from inside
//! sandboxes against the test internet (network.rs), with small limits given by flags.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{json, Value};

use crate::common::{get_json, TestNode};
use crate::network::{stdout_of, wait_tcp, TestInternet};

/// A DNS server for the test internet: every A question is answered 203.0.113.10, but
/// those under slow.test, which are never answered (a slow upstream of the attacker's).
const DNS: &str = r#"
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(('203.0.113.10', 53))
while True:
    q, a = s.recvfrom(4096)
    if len(q) < 17:
        continue
    i, labels = 12, []
    while i < len(q) and q[i]:
        n = q[i]
        labels.append(q[i + 1:i + 1 + n].decode('ascii', 'replace'))
        i += 1 + n
    name = '.'.join(labels).lower()
    if name.endswith('slow.test'):
        continue
    end = i + 5
    r = bytearray(q[:end])
    r[2] |= 0x80
    r[3] = 0x80
    r[8:12] = b'\0\0\0\0'
    if q[i + 1:i + 3] == b'\0\1':
        r[6:8] = b'\0\1'
        r += b'\xc0\x0c\0\1\0\1\0\0\0\x3c\0\4' + bytes([203, 0, 113, 10])
    else:
        r[6:8] = b'\0\0'
    s.sendto(bytes(r), a)
"#;

/// A TCP server on 9000 that never accepts: the kernel completes each handshake into its
/// backlog and the connection stays open.
const HOLDER: &str = r#"
import socket, threading
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('203.0.113.10', 9000))
s.listen(4096)
threading.Event().wait()
"#;

/// An HTTP server on 80 serving the directory it is given.
const WEB: &str = r#"
import functools, http.server, sys
h = functools.partial(http.server.SimpleHTTPRequestHandler, directory=sys.argv[1])
http.server.ThreadingHTTPServer(('0.0.0.0', 80), h).serve_forever()
"#;

/// Python in a sandbox: the gateway (the nameserver of its resolv.conf).
const GW: &str =
    "gw = [l.split()[1] for l in open('/etc/resolv.conf') if l.startswith('nameserver')][0]\n";

/// Python: whether socket `c` was closed by its peer (readable, at its end).
const CLOSED: &str = "import select\n\
def closed(c):\n    \
    r, _, _ = select.select([c], [], [], 0)\n    \
    if not r: return False\n    \
    try: return c.recv(1) == b''\n    \
    except OSError: return True\n";

/// Dropped in this order: the node, the files, then the test internet.
struct World {
    node: TestNode,
    dir: PathBuf,
    _net: TestInternet,
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The test internet (its DNS, an HTTP server on 80, the holder on 9000) and a node of
/// small limits per sandbox: 8 questions in flight, 4 TCP connections to its DNS (idle 3 s),
/// 16 connections at its proxy, 100 entries in the conntrack table.
fn world() -> World {
    let mut net = TestInternet::start();
    let dir = std::env::temp_dir().join(format!("sbx-netlimits-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("www")).unwrap();
    std::fs::write(dir.join("www/index.html"), "hello from web.test\n").unwrap();
    std::fs::write(dir.join("dns.py"), DNS).unwrap();
    std::fs::write(dir.join("holder.py"), HOLDER).unwrap();
    let d = |f: &str| dir.join(f).to_string_lossy().into_owned();
    net.spawn(&["python3", &d("dns.py")]);
    net.spawn(&["python3", &d("holder.py")]);
    std::fs::write(dir.join("web.py"), WEB).unwrap();
    net.spawn(&["python3", &d("web.py"), &d("www")]);
    for a in ["203.0.113.10:80", "203.0.113.10:9000"] {
        wait_tcp(a);
    }
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let range = format!("10.254.{}.0/24", (std::process::id() * 3 + k) % 250);
    let node = TestNode::start_with(&[
        "--egress-default",
        "allow",
        "--net-range",
        &range,
        "--dns-upstream",
        "203.0.113.10",
        "--dns-in-flight-per-sandbox",
        "8",
        "--dns-tcp-per-sandbox",
        "4",
        "--dns-tcp-idle-ms",
        "3000",
        "--egress-proxy-per-sandbox",
        "16",
        "--net-ct-per-sandbox",
        "100",
        "--warm-pool",
        "1",
    ]);
    World {
        node,
        dir,
        _net: net,
    }
}

fn python(code: &str) -> Value {
    json!(["python3", "-c", code])
}

/// Starts `code` in a new sandbox (egress rules `egress`); (sandbox, exec).
fn start_in_sandbox(w: &World, egress: Option<&Value>, code: &str) -> (String, String) {
    let body = match egress {
        Some(e) => json!({ "egress": e }),
        None => json!({}),
    };
    let sb = w.node.create_sandbox(&body);
    let id = sb["id"].as_str().unwrap().to_string();
    let ex = w.node.exec(&id, &json!({ "command": python(code) }));
    (id, ex["id"].as_str().unwrap().to_string())
}

/// Tells the program of `sandbox` that waits for `/tmp/stop` that it may end.
fn stop_in_sandbox(w: &World, sandbox: &str) {
    let v = w.node.exec(
        sandbox,
        &json!({ "command": "touch /tmp/stop", "wait_seconds": 10 }),
    );
    assert_eq!(v["exit_code"], 0, "{v}");
}

/// A sandbox asking the node's DNS without end for names of a server that never answers
/// is told SERVFAIL past its share, and another sandbox's names are still resolved. Its TCP
/// connections to the DNS past its share are closed at once, and idle ones after the idle
/// time.
#[test]
fn one_sandbox_cannot_starve_the_node_s_dns() {
    let w = world();
    // It floods until the test says it may stop (`/tmp/stop`), 12 s at most.
    let flood = format!(
        "{GW}import os, socket, struct, time\n\
         s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         s.setblocking(False)\n\
         end, i, servfail = time.time() + 12, 0, 0\n\
         while time.time() < end and not (i % 100 == 0 and os.path.exists('/tmp/stop')):\n    \
             name = b''.join(bytes([len(x)]) + x for x in (b'n%d' % i, b'slow', b'test'))\n    \
             q = struct.pack('>HHHHHH', i % 65536, 0x0100, 1, 0, 0, 0) + name + b'\\0\\0\\1\\0\\1'\n    \
             try: s.sendto(q, (gw, 53))\n    \
             except (BlockingIOError, OSError): pass\n    \
             i += 1\n    \
             try:\n        \
                 while True:\n            \
                     r = s.recv(512)\n            \
                     if len(r) >= 4 and r[3] & 15 == 2: servfail += 1\n    \
             except (BlockingIOError, OSError): pass\n    \
             if i % 20 == 0: time.sleep(0.002)\n\
         print('sent', i, 'servfail', servfail)\n"
    );
    let (a, flood_exec) = start_in_sandbox(&w, None, &flood);
    // While it floods, another sandbox resolves a name (glibc: 5 s a try, two tries).
    std::thread::sleep(Duration::from_secs(2));
    let v = w.node.run_ok(&json!({ "command": python(
        "import socket\n\
         try: print(socket.getaddrinfo('web.test', 80, socket.AF_INET)[0][4][0])\n\
         except Exception as e: print('failed', e)"
    ) }));
    assert_eq!(
        stdout_of(&v).trim(),
        "203.0.113.10",
        "another sandbox's lookup while one floods: {v}"
    );
    stop_in_sandbox(&w, &a);
    let v = w.node.exec_wait(&a, &flood_exec, Duration::from_secs(60));
    let out = stdout_of(&v);
    let servfail: u64 = out
        .split_whitespace()
        .last()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(servfail > 0, "the flooding sandbox is told SERVFAIL: {v}");

    // TCP: 12 connections, none asking anything.
    let tcp = format!(
        "{GW}{CLOSED}import socket, time\n\
         cs = [socket.create_connection((gw, 53), timeout=5) for _ in range(12)]\n\
         time.sleep(1)\n\
         print('open', sum(not closed(c) for c in cs))\n\
         time.sleep(5)\n\
         print('idle', sum(not closed(c) for c in cs))\n"
    );
    let (b, tcp_exec) = start_in_sandbox(&w, None, &tcp);
    let v = w.node.exec_wait(&b, &tcp_exec, Duration::from_secs(60));
    let out = stdout_of(&v);
    let count = |word: &str| -> Option<u64> {
        out.lines()
            .find_map(|l| l.strip_prefix(word))
            .and_then(|n| n.trim().parse().ok())
    };
    let open = count("open ").unwrap_or_else(|| panic!("{v}"));
    assert!(
        open <= 4,
        "connections past the sandbox's share are closed: {v}"
    );
    assert_eq!(count("idle "), Some(0), "idle connections are closed: {v}");
    w.node.delete_sandbox(&a);
    w.node.delete_sandbox(&b);
}

/// A sandbox's connections to the egress proxy past its share are closed at once, and
/// another sandbox's requests are served while it holds its share.
#[test]
fn one_sandbox_cannot_fill_the_egress_proxy() {
    let w = world();
    let egress = json!({"default": "deny", "allow": ["web.test"]});
    // It holds its connections until the test says it may stop (`/tmp/stop`), 8 s at most.
    let hold = format!(
        "{CLOSED}import os, socket, time\n\
         ip = socket.getaddrinfo('web.test', 80, socket.AF_INET)[0][4][0]\n\
         cs = [socket.create_connection((ip, 80), timeout=5) for _ in range(24)]\n\
         time.sleep(1)\n\
         print('open', sum(not closed(c) for c in cs), flush=True)\n\
         end = time.time() + 8\n\
         while time.time() < end and not os.path.exists('/tmp/stop'): time.sleep(0.05)\n"
    );
    let (a, hold_exec) = start_in_sandbox(&w, Some(&egress), &hold);
    std::thread::sleep(Duration::from_secs(3));
    let v = w.node.run_ok(&json!({
        "command": crate::network::fetch("http://web.test/"),
        "egress": egress,
    }));
    assert!(
        stdout_of(&v).contains("hello from web.test"),
        "another sandbox's request: {v}"
    );
    stop_in_sandbox(&w, &a);
    let v = w.node.exec_wait(&a, &hold_exec, Duration::from_secs(60));
    let open: u64 = stdout_of(&v)
        .trim()
        .strip_prefix("open ")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{v}"));
    assert!(
        (1..=16).contains(&open),
        "its connections past 16 are closed: {v}"
    );
    w.node.delete_sandbox(&a);
}

/// A sandbox holds at most its share of the host's conntrack table: its connections past
/// it are dropped by the kernel (here TCP to a server that keeps every one), and
/// GET /internal/node shows the table and the limit.
#[test]
fn one_sandbox_cannot_fill_the_conntrack_table() {
    let w = world();
    let code = "import socket, select, time\n\
        cs = []\n\
        for _ in range(150):\n    \
            c = socket.socket()\n    \
            c.setblocking(False)\n    \
            c.connect_ex(('203.0.113.10', 9000))\n    \
            cs.append(c)\n\
        time.sleep(3)\n\
        _, w, _ = select.select([], cs, [], 0)\n\
        print(sum(1 for c in w if c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0))\n";
    let v = w.node.run_ok(&json!({ "command": python(code) }));
    let opened: u64 = stdout_of(&v)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("{v}"));
    assert!(
        (50..=100).contains(&opened),
        "of 150 connections at most 100 open: {v}"
    );

    let (s, info) = get_json(&w.node, "/internal/node");
    assert_eq!(s, 200);
    let ct = &info["network"]["conntrack"];
    assert_eq!(ct["per_sandbox"], 100, "{info}");
    assert!(ct["count"].is_u64() && ct["max"].is_u64(), "{info}");
    let limits = &info["network"]["limits"];
    assert_eq!(limits["dns_in_flight_per_sandbox"], 8, "{info}");
    assert_eq!(limits["dns_tcp_per_sandbox"], 4, "{info}");
    assert_eq!(limits["proxy_per_sandbox"], 16, "{info}");
}
