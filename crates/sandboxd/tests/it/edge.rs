//! The node's edge against what a browser page (or a rebinding name) can send, and the answers
//! the edge gives instead of a route's: every one the project's error body.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::common::{assert_error, unique, TestNode};
use serde_json::{json, Value};

const CLEAN: Duration = Duration::from_secs(10);

/// An answer read off a raw socket.
struct Raw {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl Raw {
    fn header(&self, name: &str) -> Option<String> {
        self.head.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    }
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "not JSON ({e}): {}\n{}",
                self.head,
                String::from_utf8_lossy(&self.body)
            )
        })
    }
}

/// Sends a request as written (`head` without the final blank line; `Connection: close` is
/// added) and reads the whole answer.
fn raw(node: &TestNode, head: &str, body: &[u8]) -> Raw {
    let mut s = TcpStream::connect(&node.addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut req = format!("{head}\r\nConnection: close\r\n");
    if !body.is_empty() {
        req.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut all = Vec::new();
    let _ = s.read_to_end(&mut all);
    let split = all
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no answer head: {}", String::from_utf8_lossy(&all)));
    let head = String::from_utf8_lossy(&all[..split]).into_owned();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status: {head}"));
    let mut body = all[split + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body);
    }
    Raw { status, head, body }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = b.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let n = usize::from_str_radix(String::from_utf8_lossy(&b[..eol]).trim(), 16).unwrap_or(0);
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + n]);
        b = &b[eol + 2 + n + 2..];
    }
}

const RUN: &[u8] = br#"{"command": "echo ran"}"#;

#[test]
fn a_keyless_node_serves_loopback_hosts_json_bodies_and_its_own_origin_only() {
    let node = TestNode::start();
    let addr = node.addr.clone();

    // What a page can send without a preflight: a text/plain or form body, no type at all.
    for ct in [
        "Content-Type: text/plain",
        "Content-Type: application/x-www-form-urlencoded",
        "Content-Type: multipart/form-data; boundary=x",
        "",
    ] {
        let head = format!("POST /v1/run HTTP/1.1\r\nHost: {addr}\r\n{ct}");
        let r = raw(&node, head.trim_end(), RUN);
        assert_error(
            r.status,
            &r.json(),
            415,
            "unsupported_media_type",
            Some("Content-Type"),
        );
        assert_eq!(r.header("connection").as_deref(), Some("close"));
    }
    // Another Host: a name rebound to 127.0.0.1 by a page.
    for host in [
        "evil.example.com",
        "evil.example.com:7700",
        "127.0.0.1.nip.io",
    ] {
        let head =
            format!("POST /v1/run HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json");
        let r = raw(&node, &head, RUN);
        assert_error(r.status, &r.json(), 403, "forbidden_host", Some("Host"));
    }
    // The probe's request: all three at once.
    let head = "POST /v1/run HTTP/1.1\r\nHost: evil.example.com\r\nOrigin: http://evil.com\r\n\
         Content-Type: text/plain";
    let r = raw(&node, head, RUN);
    assert_eq!(r.status, 403, "{}", r.head);
    // Another origin, with the right Host and type.
    for origin in ["http://evil.com", "null", "https://127.0.0.1:1"] {
        let head = format!(
            "POST /v1/run HTTP/1.1\r\nHost: {addr}\r\nOrigin: {origin}\r\n\
             Content-Type: application/json"
        );
        let r = raw(&node, &head, RUN);
        assert_error(
            r.status,
            &r.json(),
            403,
            "origin_not_allowed",
            Some("Origin"),
        );
        assert_eq!(r.header("access-control-allow-origin"), None);
    }
    // A preflight of another origin gets no CORS answer.
    let head = format!(
        "OPTIONS /v1/run HTTP/1.1\r\nHost: {addr}\r\nOrigin: http://evil.com\r\n\
         Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: content-type"
    );
    let r = raw(&node, &head, b"");
    assert_error(
        r.status,
        &r.json(),
        403,
        "origin_not_allowed",
        Some("Origin"),
    );
    assert_eq!(r.header("access-control-allow-origin"), None);

    // Served: loopback names and addresses, JSON with parameters, the node's own origin.
    let port = addr.rsplit(':').next().unwrap();
    for (host, origin) in [
        (addr.clone(), None),
        (format!("localhost:{port}"), None),
        (format!("LocalHost.:{port}"), None),
        (addr.clone(), Some(format!("http://{addr}"))),
    ] {
        let mut head = format!(
            "POST /v1/run HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json; charset=utf-8"
        );
        if let Some(o) = origin {
            head.push_str(&format!("\r\nOrigin: {o}"));
        }
        let r = raw(&node, &head, RUN);
        assert_eq!(
            r.status,
            200,
            "{host}: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert_eq!(r.json()["stdout"], "ran\n");
    }
    // A POST without a body needs no type.
    let r = raw(
        &node,
        &format!("POST /v1/sandboxes/sbx-aaaaaaaaaaaaaaaa/restart HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0"),
        b"",
    );
    assert_error(r.status, &r.json(), 404, "sandbox_not_found", None);
    node.assert_clean(CLEAN);
}

#[test]
fn cors_origin_allows_an_origin_and_answers_its_preflights() {
    let node = TestNode::start_with(&["--cors-origin", "https://App.Example.com/"]);
    let addr = node.addr.clone();
    let head = format!(
        "OPTIONS /v1/run HTTP/1.1\r\nHost: {addr}\r\nOrigin: https://app.example.com\r\n\
         Access-Control-Request-Method: POST\r\n\
         Access-Control-Request-Headers: content-type, idempotency-key"
    );
    let r = raw(&node, &head, b"");
    assert_eq!(r.status, 204, "{}", r.head);
    assert_eq!(
        r.header("access-control-allow-origin").as_deref(),
        Some("https://app.example.com")
    );
    let methods = r.header("access-control-allow-methods").unwrap_or_default();
    assert!(
        methods.contains("POST") && methods.contains("DELETE"),
        "{methods}"
    );
    let headers = r.header("access-control-allow-headers").unwrap_or_default();
    assert!(
        headers.contains("content-type") && headers.contains("idempotency-key"),
        "{headers}"
    );
    assert!(r.header("access-control-max-age").is_some());

    let head = format!(
        "POST /v1/run HTTP/1.1\r\nHost: {addr}\r\nOrigin: https://app.example.com\r\n\
         Content-Type: application/json"
    );
    let r = raw(&node, &head, RUN);
    assert_eq!(r.status, 200, "{}", r.head);
    assert_eq!(
        r.header("access-control-allow-origin").as_deref(),
        Some("https://app.example.com")
    );
    assert!(r
        .header("access-control-expose-headers")
        .is_some_and(|h| h.contains("x-request-id")));
    // Still only that one.
    let head = format!(
        "POST /v1/run HTTP/1.1\r\nHost: {addr}\r\nOrigin: https://app.example.com.evil.com\r\n\
         Content-Type: application/json"
    );
    let r = raw(&node, &head, RUN);
    assert_error(
        r.status,
        &r.json(),
        403,
        "origin_not_allowed",
        Some("Origin"),
    );
    // An OPTIONS that is no preflight is what it was.
    let r = raw(
        &node,
        &format!("OPTIONS /v1/run HTTP/1.1\r\nHost: {addr}"),
        b"",
    );
    assert_error(r.status, &r.json(), 405, "method_not_allowed", None);
    node.assert_clean(CLEAN);
}

#[test]
fn with_api_keys_any_host_is_served_but_not_another_origin() {
    let dir = std::env::temp_dir().join(unique("sbx-test-edge-keys"));
    std::fs::create_dir_all(&dir).unwrap();
    let keys = dir.join("keys");
    std::fs::write(&keys, "edge-key-1\n").unwrap();
    let mut node = TestNode::start_with(&["--api-keys", keys.to_str().unwrap()]);
    let _ = std::fs::remove_dir_all(&dir);
    node.auth = Some("Bearer edge-key-1".into());
    let r = raw(
        &node,
        "GET /internal/node HTTP/1.1\r\nHost: node.example.com:7700\r\nAuthorization: Bearer edge-key-1",
        b"",
    );
    assert_eq!(r.status, 200, "{}", r.head);
    let r = raw(
        &node,
        "POST /v1/run HTTP/1.1\r\nHost: node.example.com\r\nAuthorization: Bearer edge-key-1\r\n\
         Origin: http://evil.com\r\nContent-Type: application/json",
        RUN,
    );
    assert_error(
        r.status,
        &r.json(),
        403,
        "origin_not_allowed",
        Some("Origin"),
    );
    let r = raw(
        &node,
        "POST /v1/run HTTP/1.1\r\nHost: node.example.com\r\nAuthorization: Bearer edge-key-1\r\n\
         Content-Type: text/plain",
        RUN,
    );
    assert_error(
        r.status,
        &r.json(),
        415,
        "unsupported_media_type",
        Some("Content-Type"),
    );
    node.assert_clean(CLEAN);
}

#[test]
fn small_wrong_answers_of_the_edge() {
    let node = TestNode::start();
    // q=0: not acceptable; the answer is JSON.
    let r = node.run_with(
        &json!({ "command": "echo q" }),
        &[("Accept", "text/event-stream;q=0, application/json")],
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r
        .header("content-type")
        .is_some_and(|c| c.starts_with("application/json")));
    assert_eq!(r.json()["stdout"], "q\n");
    let r = node.run_with(
        &json!({ "command": "echo q" }),
        &[("Accept", "application/json, text/event-stream; q=0.5")],
    );
    assert_eq!(r.header("content-type"), Some("text/event-stream"));

    // A cursor that no page gave.
    for bad in [
        "garbage",
        "00000000000000000001.sbx-nope",
        "1.sbx-aaaaaaaaaaaaaaaa",
    ] {
        let r = node.get(&format!("/v1/sandboxes?cursor={bad}"), &[]);
        assert_error(r.status, &r.json(), 400, "invalid_field", Some("cursor"));
    }
    let r = node.get(
        "/v1/sandboxes?cursor=00000000000000000001.sbx-aaaaaaaaaaaaaaaa",
        &[],
    );
    assert_eq!(r.status, 200, "{}", r.text());

    // Percent-escapes that are not UTF-8, in a path and in a query.
    let r = node.get("/v1/sandboxes/%ff", &[]);
    assert_error(r.status, &r.json(), 400, "invalid_field", Some("path"));
    let r = node.get("/v1/sandboxes?status=%ff", &[]);
    assert_error(r.status, &r.json(), 400, "invalid_field", Some("status"));
    let r = node.get(
        "/v1/sandboxes/sbx-aaaaaaaaaaaaaaaa/files/stat?path=%C3%28",
        &[],
    );
    assert_error(r.status, &r.json(), 400, "invalid_field", Some("path"));

    // An unknown field named by 10 MB: the error echoes 200 characters of it.
    let name = "n".repeat(10 << 20);
    let body = format!("{{\"command\": \"true\", \"{name}\": 1}}");
    let r = node.post("/v1/run", &[], body.as_bytes());
    assert!(r.body.len() < 8192, "{} bytes of error", r.body.len());
    let v = r.json();
    assert_eq!(r.status, 400, "{v}");
    assert_eq!(v["error"]["code"], "unknown_field");
    let param = v["error"]["param"].as_str().unwrap();
    assert!(param.starts_with("nnnn") && param.ends_with('…'), "{param}");
    assert_eq!(param.chars().count(), 201);
    node.assert_clean(CLEAN);
}
