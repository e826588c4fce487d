//! Sandboxes on the network (`--egress-default allow`): a "test internet" namespace made here
//! (203.0.113.0/24, routed from the host through a veth of its own, with an HTTP server and a
//! DNS server, dnsmasq, that names it `web.test`), reached by address and by name through the
//! node's DNS; what must never be reached is not (the host's services, metadata addresses,
//! private ranges, another sandbox); a node without network (`none`) gives `lo` only; nothing
//! of the network is left once the sandboxes and the node are gone. Traffic goes only to
//! loopback and to the namespace this test makes.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common::{HostLock, TestNode};

/// The test internet: a namespace with a veth to the host, its servers, removed when dropped.
/// One at a time on the machine (its addresses are fixed): the tests that use it take turns
/// ([`HostLock`], across test processes too).
pub(crate) struct TestInternet {
    ns: String,
    host_if: String,
    servers: Vec<Child>,
    _turn: HostLock,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl TestInternet {
    /// `203.0.113.10` (HTTP on 8080, DNS on 53), `169.254.169.254` and `192.168.77.5` (HTTP
    /// on 8080, both: if the node let them through they would answer), behind `203.0.113.1`.
    /// Its interfaces are not named `sbx…`: a node's table takes every interface with its
    /// prefix (`sbx` for the node of /var/lib/sbx, which may be running) for a sandbox's.
    pub(crate) fn start() -> TestInternet {
        let turn = HostLock::take("test-internet");
        let tag = std::process::id() % 10_000;
        let (ns, host_if, inner_if) = (
            format!("tinet{tag}"),
            format!("tinet{tag}h"),
            format!("tinet{tag}i"),
        );
        let _ = Command::new("ip").args(["netns", "del", &ns]).status();
        let _ = Command::new("ip").args(["link", "del", &host_if]).status();
        let t = TestInternet {
            ns: ns.clone(),
            host_if: host_if.clone(),
            servers: Vec::new(),
            _turn: turn,
        };
        ip(&["netns", "add", &ns]);
        ip(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", &inner_if,
        ]);
        ip(&["link", "set", &inner_if, "netns", &ns]);
        ip(&["addr", "add", "203.0.113.1/24", "dev", &host_if]);
        ip(&["link", "set", &host_if, "up"]);
        // The "private" and "metadata" addresses of the test internet, routed to it.
        ip(&[
            "route",
            "add",
            "169.254.169.254/32",
            "dev",
            &host_if,
            "via",
            "203.0.113.10",
        ]);
        ip(&[
            "route",
            "add",
            "192.168.77.5/32",
            "dev",
            &host_if,
            "via",
            "203.0.113.10",
        ]);
        let inside = |args: &[&str]| {
            let mut a = vec!["netns", "exec", ns.as_str(), "ip"];
            a.extend_from_slice(args);
            ip(&a);
        };
        inside(&["addr", "add", "203.0.113.10/24", "dev", &inner_if]);
        inside(&["addr", "add", "169.254.169.254/32", "dev", &inner_if]);
        inside(&["addr", "add", "192.168.77.5/32", "dev", &inner_if]);
        inside(&["link", "set", &inner_if, "up"]);
        inside(&["link", "set", "lo", "up"]);
        inside(&["route", "add", "default", "via", "203.0.113.1"]);
        t
    }

    /// dnsmasq on 203.0.113.10:53 naming each of `names` 203.0.113.10; `extra` flags added.
    pub(crate) fn spawn_dns(&mut self, names: &[&str], extra: &[&str]) {
        let mut args: Vec<String> = [
            "dnsmasq",
            "--no-daemon",
            "--no-resolv",
            "--no-hosts",
            "--listen-address=203.0.113.10",
            "--bind-interfaces",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        args.extend(names.iter().map(|n| format!("--address=/{n}/203.0.113.10")));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.spawn(&args);
    }

    pub(crate) fn spawn(&mut self, args: &[&str]) {
        let mut a = vec!["netns", "exec", self.ns.as_str()];
        a.extend_from_slice(args);
        let child = Command::new("ip")
            .args(&a)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("a server in the test internet");
        self.servers.push(child);
    }
}

impl Drop for TestInternet {
    fn drop(&mut self) {
        for c in &mut self.servers {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_if])
            .status();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
        let _ = Command::new("ip")
            .args(["route", "del", "169.254.169.254/32"])
            .status();
        let _ = Command::new("ip")
            .args(["route", "del", "192.168.77.5/32"])
            .status();
    }
}

/// Python in the sandbox: fetches `url` and prints its body, or prints `refused: <error>`.
pub(crate) fn fetch(url: &str) -> Value {
    json!([
        "python3",
        "-c",
        format!(
            "import urllib.request,sys\ntry:\n print(urllib.request.urlopen('{url}', timeout=3).read().decode(), end='')\nexcept Exception as e:\n print('refused:', type(e).__name__, e)"
        )
    ])
}

/// Python in the sandbox: a TCP connection to `host:port` within 2 s: `open` or `refused`.
pub(crate) fn connect(host: &str, port: u16) -> Value {
    json!([
        "python3",
        "-c",
        format!(
            "import socket\ntry:\n socket.create_connection(('{host}', {port}), timeout=2); print('open')\nexcept Exception as e:\n print('refused', type(e).__name__)"
        )
    ])
}

pub(crate) fn stdout_of(v: &Value) -> String {
    v["stdout"].as_str().unwrap_or_default().to_string()
}

/// Waits until `addr` answers TCP from the host.
pub(crate) fn wait_tcp(addr: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_millis(200))
        .is_err()
    {
        assert!(Instant::now() < deadline, "{addr} did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn host_interfaces(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/sys/class/net")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(prefix))
                .collect()
        })
        .unwrap_or_default()
}

fn nft_tables() -> String {
    Command::new("nft")
        .args(["list", "tables"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

#[test]
fn sandboxes_reach_the_internet_by_name_and_address_and_nothing_they_must_not() {
    let mut net = TestInternet::start();
    let dir = std::env::temp_dir().join(format!("sbx-ti-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("hello.txt"), "hello from the test internet\n").unwrap();
    let dir_s = dir.to_string_lossy().into_owned();
    net.spawn(&[
        "python3",
        "-m",
        "http.server",
        "8080",
        "--bind",
        "0.0.0.0",
        "--directory",
        &dir_s,
    ]);
    net.spawn_dns(&["web.test"], &[]);
    wait_tcp("203.0.113.10:8080");
    wait_tcp("203.0.113.10:53");
    // A service of the host on every address: no sandbox may reach it.
    let host_service = TcpListener::bind("0.0.0.0:0").unwrap();
    let host_port = host_service.local_addr().unwrap().port();

    let range = format!("10.252.{}.0/24", std::process::id() % 250);
    let mut node = TestNode::start_with(&[
        "--egress-default",
        "allow",
        "--net-range",
        &range,
        "--dns-upstream",
        "203.0.113.10",
        "--warm-pool",
        "1",
        "--warm-runs",
        "1",
    ]);
    node.owns(dir.clone());
    let (_, info) = crate::common::get_json(&node, "/internal/node");
    let gateway = info["network"]["gateway"].as_str().unwrap().to_string();

    // By address and by name (the node's DNS asks the test internet's).
    let v = node.run_ok(&json!({ "command": fetch("http://203.0.113.10:8080/hello.txt") }));
    assert_eq!(stdout_of(&v), "hello from the test internet\n", "{v}");
    let v = node.run_ok(&json!({ "command": fetch("http://web.test:8080/hello.txt") }));
    assert_eq!(stdout_of(&v), "hello from the test internet\n", "{v}");
    let v = node.run_ok(&json!({ "command": ["cat", "/etc/resolv.conf"] }));
    assert!(
        stdout_of(&v).contains(&format!("nameserver {gateway}")),
        "{v}"
    );

    // Never: the host's services (at the gateway, at the host's address on the way out, the
    // node's API), metadata addresses, private ranges.
    let api_port = node
        .addr
        .rsplit(':')
        .next()
        .unwrap()
        .parse::<u16>()
        .unwrap();
    for (host, port) in [
        (gateway.as_str(), host_port),
        (gateway.as_str(), api_port),
        ("203.0.113.1", host_port),
        ("169.254.169.254", 8080),
        ("192.168.77.5", 8080),
    ] {
        let v = node.run_ok(&json!({ "command": connect(host, port) }));
        assert!(
            stdout_of(&v).starts_with("refused"),
            "{host}:{port} was reached: {v}"
        );
    }
    // The same private address answers the host (the test internet serves it): only the
    // node's rules kept the sandbox out.
    wait_tcp("192.168.77.5:8080");

    // Another sandbox is not reachable, though it listens on every address.
    let b =
        node.create_sandbox(&json!({ "start_command": ["python3", "-m", "http.server", "8000"] }));
    let b_id = b["id"].as_str().unwrap().to_string();
    let addr = node.exec(
        &b_id,
        &json!({
            "command": ["python3", "-c", "import socket;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);s.connect(('203.0.113.10',1));print(s.getsockname()[0])"],
            "wait_seconds": 10,
        }),
    );
    let b_addr = stdout_of(&addr).trim().to_string();
    assert!(b_addr.starts_with("10.252."), "{addr}");
    let a = node.create_sandbox(&json!({}));
    let a_id = a["id"].as_str().unwrap().to_string();
    let v = node.exec(
        &a_id,
        &json!({ "command": connect(&b_addr, 8000), "wait_seconds": 10 }),
    );
    assert!(
        stdout_of(&v).starts_with("refused"),
        "another sandbox was reached: {v}"
    );
    let v = node.exec(
        &a_id,
        &json!({ "command": fetch("http://web.test:8080/hello.txt"), "wait_seconds": 10 }),
    );
    assert_eq!(
        stdout_of(&v),
        "hello from the test internet\n",
        "a kept sandbox: {v}"
    );
    node.delete_sandbox(&a_id);
    node.delete_sandbox(&b_id);

    // The functions interface: network: true puts the sandbox on the network; without it
    // (the default) a sandbox has lo only.
    for (network, expect) in [(true, true), (false, false)] {
        let r = node.post_json(
            "/v1/functions/sandbox::create",
            &json!({ "image": "base", "network": network }),
        );
        assert_eq!(r.status, 200, "{}", r.json());
        let sid = r.json()["sandbox_id"].as_str().unwrap().to_string();
        let r = node.post_json(
            "/v1/functions/sandbox::exec",
            &json!({ "sandbox_id": sid, "argv": fetch("http://203.0.113.10:8080/hello.txt") }),
        );
        let out = r.json()["stdout"].as_str().unwrap_or_default().to_string();
        assert_eq!(
            out == "hello from the test internet\n",
            expect,
            "network {network}: {}",
            r.json()
        );
        let r = node.post_json("/v1/functions/sandbox::stop", &json!({ "sandbox_id": sid }));
        assert_eq!(r.status, 200, "{}", r.json());
    }

    // A kept sandbox keeps its network across a restart of the node.
    let c = node.create_sandbox(&json!({}));
    let c_id = c["id"].as_str().unwrap().to_string();
    node.stop();
    node.restart();
    let v = node.exec(
        &c_id,
        &json!({ "command": fetch("http://web.test:8080/hello.txt"), "wait_seconds": 10 }),
    );
    assert_eq!(
        stdout_of(&v),
        "hello from the test internet\n",
        "after a restart: {v}"
    );
    node.delete_sandbox(&c_id);

    // Many runs leave nothing: every namespace's interface goes with it.
    for _ in 0..20 {
        node.run_ok(&json!({ "command": ["true"] }));
    }
    // Once the last run's teardown is done, the warm sandboxes' leases (one of each kind) are
    // the only ones.
    let deadline = Instant::now() + Duration::from_secs(10);
    let info = loop {
        let (_, info) = crate::common::get_json(&node, "/internal/node");
        if info["network"]["leased"] == 2 || Instant::now() > deadline {
            break info;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        info["network"]["leased"], 2,
        "the warm sandboxes' leases only: {info}"
    );
    let prefix = info["network"]["interface_prefix"]
        .as_str()
        .unwrap()
        .to_string();
    let table = info["network"]["table"].as_str().unwrap().to_string();
    assert!(nft_tables().contains(&table), "{}", nft_tables());
    // A stop with no kept sandbox running leaves nothing of the network.
    drop(node);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = host_interfaces(&prefix);
        let tables = nft_tables();
        if left.is_empty() && !tables.contains(&format!(" {table}\n")) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "left behind: {left:?}, tables: {tables}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_node_without_network_gives_lo_only() {
    let node = TestNode::start();
    let (_, info) = crate::common::get_json(&node, "/internal/node");
    assert!(info["network"].is_null(), "{info}");
    let v = node.run_ok(&json!({ "command": ["cat", "/proc/net/dev"] }));
    let out = stdout_of(&v);
    let ifaces: Vec<&str> = out
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next())
        .map(str::trim)
        .collect();
    assert_eq!(ifaces, ["lo"], "{v}");
}
