//! Egress rules, enforced: the test internet (network.rs) serves HTTP on 80 and 8080 and
//! HTTPS on 443 (a certificate of a test CA the node is given with --egress-ca-file), logs
//! every request it sees, and names itself web.test, api.web.test, other.test and
//! secure.test (all 203.0.113.10). Sandboxes with rules reach exactly what the rules say, by
//! the kernel (addresses, ports), the node's DNS (names: NXDOMAIN) and its egress proxy
//! (Host / SNI on 80 and 443, http rules, secrets injected); rules change live.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common::{assert_error, TestNode};
use crate::network::{connect, fetch, stdout_of, wait_tcp, TestInternet};

/// The test internet's server: every request is logged (one line: method, Host, path,
/// Authorization) and answered with JSON of what it saw.
const SERVER: &str = r#"
import http.server, json, ssl, sys, threading
log = open(sys.argv[1], 'a', buffering=1)
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'
    def answer(self):
        n = int(self.headers.get('Content-Length') or 0)
        body = self.rfile.read(n) if n else b''
        seen = {'method': self.command, 'path': self.path, 'host': self.headers.get('Host'),
                'authorization': self.headers.get('Authorization'), 'body': body.decode()}
        log.write(json.dumps(seen) + '\n')
        out = json.dumps(seen).encode()
        self.send_response(200)
        self.send_header('Content-Type', 'application/json')
        self.send_header('Content-Length', str(len(out)))
        self.end_headers()
        self.wfile.write(out)
    do_GET = do_POST = do_PUT = do_DELETE = answer
    def log_message(self, *a): pass
def serve(port, tls):
    s = http.server.ThreadingHTTPServer(('0.0.0.0', port), H)
    if tls:
        c = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        c.load_cert_chain(sys.argv[2], sys.argv[3])
        s.socket = c.wrap_socket(s.socket, server_side=True)
    s.serve_forever()
for port, tls in ((80, False), (8080, False), (443, True)):
    threading.Thread(target=serve, args=(port, tls), daemon=True).start()
threading.Event().wait()
"#;

/// Dropped in this order: the node (its network gone before the next test's), the files,
/// then the test internet (the next test's turn).
struct World {
    node: TestNode,
    dir: PathBuf,
    _net: TestInternet,
}

impl World {
    fn log(&self) -> Vec<Value> {
        std::fs::read_to_string(self.dir.join("requests.log"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    fn clear_log(&self) {
        let _ = std::fs::write(self.dir.join("requests.log"), "");
    }

    fn dns_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("dns.log")).unwrap_or_default()
    }
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The test internet with its server and DNS, and a node of `--egress-default allow` that
/// asks that DNS and trusts the test CA.
fn world() -> World {
    let mut net = TestInternet::start();
    let dir = std::env::temp_dir().join(format!("sbx-egress-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // A test CA and secure.test's certificate.
    openssl(
        &dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=sbx test CA",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
        ],
    );
    openssl(
        &dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=secure.test",
            "-keyout",
            "srv.key",
            "-out",
            "srv.csr",
        ],
    );
    std::fs::write(dir.join("ext.cnf"), "subjectAltName=DNS:secure.test\n").unwrap();
    openssl(
        &dir,
        &[
            "x509",
            "-req",
            "-in",
            "srv.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
            "-out",
            "srv.pem",
        ],
    );
    std::fs::write(dir.join("server.py"), SERVER).unwrap();
    let d = |f: &str| dir.join(f).to_string_lossy().into_owned();
    net.spawn(&[
        "python3",
        &d("server.py"),
        &d("requests.log"),
        &d("srv.pem"),
        &d("srv.key"),
    ]);
    let log_facility = format!("--log-facility={}", d("dns.log"));
    net.spawn_dns(
        &["web.test", "other.test", "secure.test"],
        &["--log-queries", &log_facility],
    );
    for a in ["203.0.113.10:80", "203.0.113.10:443", "203.0.113.10:53"] {
        wait_tcp(a);
    }
    // Each node of this file a range of its own (a node that stops late keeps its gateway).
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let range = format!("10.253.{}.0/24", (std::process::id() * 2 + k) % 250);
    let node = TestNode::start_with(&[
        "--egress-default",
        "allow",
        "--net-range",
        &range,
        "--dns-upstream",
        "203.0.113.10",
        "--egress-ca-file",
        &d("ca.pem"),
        "--warm-pool",
        "1",
    ]);
    World {
        _net: net,
        dir,
        node,
    }
}

fn run_with(w: &World, egress: &Value, command: Value) -> String {
    stdout_of(
        &w.node
            .run_ok(&json!({ "command": command, "egress": egress })),
    )
}

/// curl in the sandbox: the body, or `refused <exit code>` (`-f`: an HTTP error is one).
fn curl(args: &[&str]) -> Value {
    let mut a = vec!["curl", "-sS", "-f", "--max-time", "5"];
    a.extend_from_slice(args);
    let line = a
        .iter()
        .map(|s| format!("'{s}'"))
        .collect::<Vec<_>>()
        .join(" ");
    json!(["sh", "-c", format!("{line} 2>/dev/null || echo refused $?")])
}

#[test]
fn egress_rules_hold_by_address_port_and_name_and_change_live() {
    let mut w = world();
    let n = &w.node;

    // Bad rules: 400 invalid_egress naming the part.
    let (s, v) =
        n.run(&json!({ "command": ["true"], "egress": {"allow": ["ok.test", "not a name"]} }));
    assert_error(s, &v, 400, "invalid_egress", Some("egress.allow[1]"));
    let (s, v) = n.run(&json!({ "command": ["true"], "egress": {"deny_ports": [0]} }));
    assert_error(s, &v, 400, "invalid_egress", Some("egress.deny_ports[0]"));

    // default: deny reaches nothing, and the test internet saw no request, not even DNS.
    w.clear_log();
    let deny = json!({"default": "deny"});
    for cmd in [
        fetch("http://web.test/"),
        fetch("http://203.0.113.10/"),
        fetch("https://secure.test/"),
        connect("203.0.113.10", 8080),
    ] {
        let out = run_with(&w, &deny, cmd.clone());
        assert!(out.starts_with("refused"), "{cmd}: {out}");
    }
    assert!(w.log().is_empty(), "the server saw: {:?}", w.log());
    assert!(!w.dns_log().contains("web.test"), "{}", w.dns_log());

    // allow: [name] reaches exactly that name: not another name of the same server, not
    // its bare address, not through a spoofed /etc/hosts.
    let allow = json!({"default": "deny", "allow": ["web.test"]});
    let out = run_with(&w, &allow, fetch("http://web.test/x"));
    assert!(out.contains("\"host\": \"web.test\""), "{out}");
    for cmd in [
        fetch("http://other.test/"),
        fetch("http://203.0.113.10/"),
        curl(&["-H", "Host: other.test", "http://web.test/"]),
        connect("203.0.113.10", 8080),
    ] {
        let out = run_with(&w, &allow, cmd.clone());
        assert!(out.starts_with("refused"), "{cmd}: {out}");
    }
    // other.test pointed at web.test's address by the sandbox's own /etc/hosts: still
    // other.test to the proxy, refused; web.test pointed elsewhere: the proxy dials the name.
    let spoof =
        json!(["sh", "-c",
        "echo '203.0.113.10 other.test' >> /etc/hosts; echo '192.0.2.1 web.test' >> /etc/hosts; \
         curl -sS -f --max-time 5 http://other.test/ || echo refused; \
         curl -sS -f --max-time 5 http://web.test/spoofed || echo refused"]);
    let out = run_with(&w, &allow, spoof);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.first(), Some(&"refused"), "{out}");
    assert!(out.contains("/spoofed"), "{out}");

    // *.name: any subdomain, not the name itself; HTTPS by SNI passes untouched.
    let wild = json!({"default": "deny", "allow": ["*.web.test", "secure.test"]});
    let out = run_with(&w, &wild, fetch("http://api.web.test/w"));
    assert!(out.contains("api.web.test"), "{out}");
    let out = run_with(&w, &wild, fetch("http://web.test/"));
    assert!(out.starts_with("refused"), "{out}");
    // The sandbox does not trust the test CA: the real certificate reached it (curl: 60).
    let out = run_with(&w, &wild, curl(&["https://secure.test/"]));
    assert_eq!(
        out.trim(),
        "refused 60",
        "TLS passed through untouched: {out}"
    );

    // Addresses and ports: the most specific wins; deny_ports wins whatever.
    let ports = json!({"default": "deny", "allow": ["203.0.113.0/24"], "deny_ports": [8080]});
    let out = run_with(&w, &ports, connect("203.0.113.10", 8080));
    assert!(out.starts_with("refused"), "deny_ports: {out}");
    let out = run_with(&w, &ports, fetch("http://203.0.113.10/ip"));
    assert!(out.contains("/ip"), "allowed by address: {out}");
    let narrow = json!({"allow": ["203.0.113.0/24"], "deny": ["203.0.113.10"]});
    let out = run_with(&w, &narrow, connect("203.0.113.10", 8080));
    assert!(out.starts_with("refused"), "the /32 wins: {out}");

    // A kept sandbox's rules change live (PATCH, merged key by key), within a second.
    let sb = n.create_sandbox(&json!({ "egress": {"deny_ports": [25]} }));
    let id = sb["id"].as_str().unwrap().to_string();
    assert_eq!(sb["egress"], json!({"deny_ports": [25]}));
    let probe = |what: &str| {
        let v = n.exec(
            &id,
            &json!({ "command": connect("203.0.113.10", 8080), "wait_seconds": 10 }),
        );
        let out = stdout_of(&v);
        assert!(out.starts_with(what), "{what}: {v}");
    };
    probe("open");
    let r = n.patch_json(
        &format!("/v1/sandboxes/{id}"),
        &json!({"egress": {"default": "deny"}}),
    );
    assert_eq!(r.status, 200, "{}", r.json());
    assert_eq!(
        r.json()["egress"],
        json!({"deny_ports": [25], "default": "deny"})
    );
    let t = Instant::now();
    probe("refused");
    assert!(t.elapsed() < Duration::from_secs(5));
    let r = n.patch_json(
        &format!("/v1/sandboxes/{id}"),
        &json!({"egress": {"default": null}}),
    );
    assert_eq!(r.json()["egress"], json!({"deny_ports": [25]}));
    probe("open");
    let r = n.patch_json(
        &format!("/v1/sandboxes/{id}"),
        &json!({"egress": {"allow": [7]}}),
    );
    assert_error(
        r.status,
        &r.json(),
        400,
        "invalid_egress",
        Some("egress.allow[0]"),
    );
    // Kept across a restart of the node.
    n.patch_json(
        &format!("/v1/sandboxes/{id}"),
        &json!({"egress": {"default": "deny"}}),
    );
    w.node.stop();
    w.node.restart();
    let node = &w.node;
    let v = node.exec(
        &id,
        &json!({ "command": connect("203.0.113.10", 8080), "wait_seconds": 10 }),
    );
    assert!(stdout_of(&v).starts_with("refused"), "after a restart: {v}");
    node.delete_sandbox(&id);
}

#[test]
fn http_rules_and_secrets_injected_over_http_and_https() {
    let w = world();
    let n = &w.node;
    let secret = "s3cr3t-value-for-the-test";
    let r = ureq::put(&n.url("/v1/secrets/api-token"))
        .set("Content-Type", "application/json")
        .send_json(json!({"value": secret, "allowed_hosts": ["web.test", "secure.test"]}))
        .expect("PUT a secret");
    assert!(r.status() == 200 || r.status() == 201);

    // A secret that may not go there: 403; a missing one: 404 (at run, create and PATCH).
    let (s, v) = n.run(&json!({ "command": ["true"], "egress": {"inject": [{"host": "other.test", "secret": "api-token"}]} }));
    assert_error(
        s,
        &v,
        403,
        "secret_host_not_allowed",
        Some("egress.inject[0].host"),
    );
    let (s, v) = n.run(&json!({ "command": ["true"], "egress": {"inject": [{"host": "web.test", "secret": "nope"}]} }));
    assert_error(
        s,
        &v,
        404,
        "secret_not_found",
        Some("egress.inject[0].secret"),
    );

    let egress = json!({
        "http": [{"host": "web.test", "methods": ["GET"], "paths": ["/ok/*"]}],
        "inject": [
            {"host": "web.test", "secret": "api-token", "value": "Bearer {secret}"},
            {"host": "secure.test", "secret": "api-token", "header": "Authorization", "value": "Token {secret}"},
        ],
    });
    // http rules: GET on an allowed path passes (with the secret put in the place of what
    // the sandbox sent); POST, or another path, is 403.
    let out = run_with(
        &w,
        &egress,
        curl(&["-H", "Authorization: mine", "http://web.test/ok/1"]),
    );
    assert!(out.contains(&format!("Bearer {secret}")), "{out}");
    let out = run_with(
        &w,
        &egress,
        curl(&["-X", "POST", "-d", "x", "http://web.test/ok/1"]),
    );
    assert_eq!(out.trim(), "refused 22", "POST: {out}");
    let out = run_with(&w, &egress, curl(&["http://web.test/other"]));
    assert_eq!(out.trim(), "refused 22", "another path: {out}");
    let v =
        n.run_ok(&json!({ "command": ["curl", "-s", "http://web.test/other"], "egress": egress }));
    let body: Value = serde_json::from_str(&stdout_of(&v)).unwrap_or_default();
    assert_eq!(body["error"]["code"], "egress_denied", "{v}");
    // HTTPS to an inspected host: terminated with the node's CA, which the sandbox trusts by
    // its bundle, re-encrypted to the host (verified with --egress-ca-file).
    let out = run_with(&w, &egress, curl(&["https://secure.test/tls"]));
    assert!(out.contains(&format!("Token {secret}")), "{out}");
    let out = run_with(
        &w,
        &egress,
        json!(["python3", "-c", "import urllib.request;print(urllib.request.urlopen('https://secure.test/py').read().decode())"]),
    );
    assert!(out.contains(&format!("Token {secret}")), "python: {out}");
    // The value is nowhere in the sandbox.
    let look = json!(["sh", "-c", format!(
        "env; cat /proc/1/environ /proc/self/environ 2>/dev/null; grep -rl '{secret}' /etc /root /tmp /run 2>/dev/null; echo end"
    )]);
    let out = run_with(&w, &egress, look);
    assert!(!out.contains(secret), "the secret is in the sandbox: {out}");
    let seen: Vec<Value> = w.log();
    assert!(seen
        .iter()
        .any(|r| r["authorization"] == format!("Bearer {secret}")));
    assert!(
        !seen.iter().any(|r| r["method"] == "POST"),
        "a refused POST reached the server"
    );
}

#[test]
fn runtime_dns_writes_resolv_conf_and_name_rules_still_hold() {
    let w = world();
    let n = &w.node;
    let dns =
        json!({"dns": {"servers": ["203.0.113.10"], "search": ["test"], "options": ["ndots:1"]}});
    let v = n.run_ok(&json!({ "command": ["cat", "/etc/resolv.conf"], "runtime": dns }));
    assert_eq!(
        stdout_of(&v),
        "nameserver 203.0.113.10\nsearch test\noptions ndots:1\n",
        "{v}"
    );
    // Its server is asked directly (no rules restrict names): the short name by `search`.
    let v = n.run_ok(&json!({ "command": fetch("http://web:8080/direct"), "runtime": dns }));
    assert!(stdout_of(&v).contains("/direct"), "{v}");
    // With rules that refuse names, DNS asked of any server is the node's: refused names are
    // NXDOMAIN whatever resolv.conf says.
    let egress = json!({"default": "deny", "allow": ["web.test"]});
    let v = n.run_ok(
        &json!({ "command": fetch("http://other.test/"), "runtime": dns, "egress": egress }),
    );
    assert!(stdout_of(&v).starts_with("refused"), "{v}");
    let v = n.run_ok(
        &json!({ "command": fetch("http://web.test/ok"), "runtime": dns, "egress": egress }),
    );
    assert!(stdout_of(&v).contains("/ok"), "{v}");
    // A kept sandbox: written at its boot.
    let sb = n.create_sandbox(&json!({ "runtime": {"dns": {"options": ["ndots:3"]}} }));
    let id = sb["id"].as_str().unwrap().to_string();
    let v = n.exec(
        &id,
        &json!({ "command": ["cat", "/etc/resolv.conf"], "wait_seconds": 10 }),
    );
    let gw = crate::common::get_json(n, "/internal/node").1["network"]["gateway"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        stdout_of(&v),
        format!("nameserver {gw}\noptions ndots:3\n"),
        "{v}"
    );
    n.delete_sandbox(&id);
    // Refusals.
    let (s, v) = n.run(&json!({ "command": ["true"], "runtime": {"dns": {"servers": ["nope"]}} }));
    assert_error(s, &v, 400, "invalid_field", Some("runtime.dns.servers[0]"));
    // With the other runtime settings (tests/it/runtime_settings.rs), dns still writes it.
    let v = n.run_ok(&json!({
        "command": "cat /etc/resolv.conf; ulimit -n",
        "runtime": {"dns": {"options": ["ndots:4"]}, "ulimits": {"nofile": 10}}
    }));
    assert_eq!(
        stdout_of(&v),
        format!("nameserver {gw}\noptions ndots:4\n10\n"),
        "{v}"
    );
}

/// An `http` rule holds against what a server would read: a path with dot segments (plain or
/// encoded), a method in lower case, TRACE, an absolute URI naming another host than Host,
/// are refused (403 egress_denied) and never reach the server; a sandbox that dials the
/// proxy's port on the gateway itself is not served.
#[test]
fn http_rules_hold_against_what_a_server_reads_otherwise() {
    let w = world();
    let egress = json!({
        "http": [{"host": "web.test", "methods": ["GET", "TRACE"], "paths": ["/ok/*"]}],
    });
    // curl -s, its body (not -f: the answer's body says who refused).
    let body = |args: &[&str]| {
        let mut a = vec!["curl", "-s", "--max-time", "5"];
        a.extend_from_slice(args);
        run_with(&w, &egress, json!(a))
    };
    for path in [
        "/ok/../admin",
        "/ok/%2e%2e/admin",
        "/ok/..%2fadmin",
        "/ok/x/../../admin",
    ] {
        let url = format!("http://web.test{path}");
        let out = body(&["--path-as-is", &url]);
        assert!(out.contains("egress_denied"), "{path}: {out}");
    }
    let out = body(&["-X", "get", "http://web.test/ok/1"]);
    assert!(out.contains("egress_denied"), "get: {out}");
    let out = body(&["-X", "TRACE", "http://web.test/ok/1"]);
    assert!(out.contains("egress_denied"), "TRACE: {out}");
    let out = body(&[
        "--request-target",
        "http://web.test/ok/1",
        "-H",
        "Host: other.test",
        "http://web.test/",
    ]);
    assert!(out.contains("egress_denied"), "two hosts: {out}");
    assert!(
        w.log().is_empty(),
        "a refused request reached the server: {:?}",
        w.log()
    );
    // What the rule allows still passes.
    let out = body(&["http://web.test/ok/1"]);
    assert!(out.contains("\"/ok/1\""), "{out}");

    // The proxy's own port, dialed by the sandbox: closed, nothing answered or dialed.
    let direct = "import socket\n\
        gw = [l.split()[1] for l in open('/etc/resolv.conf') if l.startswith('nameserver')][0]\n\
        s = socket.create_connection((gw, 3129), timeout=5)\n\
        s.sendall(b'GET /direct HTTP/1.1\\r\\nHost: web.test\\r\\nConnection: close\\r\\n\\r\\n')\n\
        got = b''\n\
        try:\n    while True:\n        b = s.recv(4096)\n        if not b: break\n        got += b\n\
        except ConnectionResetError: pass\n\
        print(repr(got))";
    let out = run_with(&w, &egress, json!(["python3", "-c", direct]));
    assert_eq!(out.trim(), "b''", "{out}");
    assert!(!w.log().iter().any(|r| r["path"] == "/direct"));
}
