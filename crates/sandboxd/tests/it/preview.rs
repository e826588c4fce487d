//! Preview URLs and sandbox tokens: a request to `{port}-{sandbox}.localhost` at the node's
//! preview listener reaches that port of the sandbox (a python server run in it), with the
//! sandbox's token or on a public port; the token on the API acts on its own sandbox only.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common::{assert_error, free_port, sbx, unique, TestNode};

/// A server of the stdlib alone: `/headers` (what it was sent, as JSON), `/sse` (3 events,
/// 0.7 s apart), `/ws` (a WebSocket that echoes), POST (the body back), anything else a hello.
const SERVER: &str = r#"
import sys, json, time, hashlib, base64, struct
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def reply(self, code, body, ctype="text/plain"):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.path.startswith("/headers"):
            h = {k.lower(): v for k, v in self.headers.items()}
            self.reply(200, json.dumps({"path": self.path, "headers": h}).encode(), "application/json")
        elif self.path == "/sse":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            for i in range(3):
                self.wfile.write(("data: event-%d\n\n" % i).encode())
                self.wfile.flush()
                time.sleep(0.7)
        elif self.path == "/ws":
            key = self.headers["Sec-WebSocket-Key"] + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
            acc = base64.b64encode(hashlib.sha1(key.encode()).digest()).decode()
            self.send_response(101)
            self.send_header("Upgrade", "websocket")
            self.send_header("Connection", "Upgrade")
            self.send_header("Sec-WebSocket-Accept", acc)
            self.end_headers()
            self.wfile.flush()
            self.close_connection = True
            while True:
                h = self.rfile.read(2)
                if len(h) < 2:
                    return
                op, n = h[0] & 15, h[1] & 127
                if n == 126:
                    n = struct.unpack(">H", self.rfile.read(2))[0]
                elif n == 127:
                    n = struct.unpack(">Q", self.rfile.read(8))[0]
                mask = self.rfile.read(4) if h[1] & 128 else b"\0\0\0\0"
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(n)))
                if op == 8:
                    self.wfile.write(b"\x88\x00")
                    self.wfile.flush()
                    return
                if op in (1, 2):
                    out = b"echo: " + data
                    self.wfile.write(bytes([0x80 | op, len(out)]) + out)
                    self.wfile.flush()
        else:
            self.reply(200, ("hello from %s" % self.path).encode())
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.reply(200, b"got: " + body)
ThreadingHTTPServer((sys.argv[2], int(sys.argv[1])), H).serve_forever()
"#;

/// An answer read whole (the connection closed after it).
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }
}

/// One HTTP/1.1 request over `s` (`Connection: close`), its answer read to the end.
fn exchange<S: Read + Write>(
    mut s: S,
    method: &str,
    host: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Answer {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() || method == "POST" {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).expect("send the head");
    s.write_all(body).expect("send the body");
    s.flush().expect("flush");
    let mut raw = Vec::new();
    // A TLS peer may close without close_notify: what was read counts.
    let _ = s.read_to_end(&mut raw);
    parse_answer(&raw)
}

fn parse_answer(raw: &[u8]) -> Answer {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no answer head in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .expect("a status");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let rest = &raw[end + 4..];
    let chunked = headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    });
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_vec()
    };
    Answer {
        status,
        headers,
        body,
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = b.windows(2).position(|w| w == b"\r\n") {
        let size =
            usize::from_str_radix(String::from_utf8_lossy(&b[..eol]).trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        let start = eol + 2;
        out.extend_from_slice(&b[start..(start + size).min(b.len())]);
        b = &b[(start + size + 2).min(b.len())..];
    }
    out
}

/// The preview listener of a node, and the requests the tests send it.
struct Preview {
    addr: String,
}

impl Preview {
    fn of(node: &TestNode) -> Preview {
        Preview {
            addr: node.preview_addr().expect("the node's preview listener"),
        }
    }

    fn port(&self) -> u16 {
        self.addr
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("a port")
    }

    /// The host of `port` of `sandbox`, as a browser sends it.
    fn host(&self, port: u16, sandbox: &str) -> String {
        format!("{port}-{sandbox}.localhost:{}", self.port())
    }

    fn send(
        &self,
        method: &str,
        host: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Answer {
        let s = TcpStream::connect(&self.addr).expect("connect to the preview listener");
        s.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        exchange(s, method, host, path, headers, body)
    }

    fn get(&self, host: &str, path: &str, headers: &[(&str, &str)]) -> Answer {
        self.send("GET", host, path, headers, b"")
    }

    /// Waits (up to 20 s) until `port` of `sandbox` answers something but 502.
    fn wait_open(&self, port: u16, sandbox: &str, token: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let a = self.get(&self.host(port, sandbox), "/", &[("X-Sbx-Token", token)]);
            if a.status != 502 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "port {port} of {sandbox} did not open: {}",
                a.text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A GET over HTTP/2 (cleartext, prior knowledge) to the preview listener: the host is the
/// request's `:authority`. (status, body)
fn h2_get(addr: &str, authority: &str, path: &str, token: &str) -> (u16, String) {
    use http_body_util::BodyExt;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (mut send, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(tcp),
        )
        .await
        .expect("the HTTP/2 handshake");
        tokio::spawn(conn);
        let req = hyper::Request::get(format!("http://{authority}{path}"))
            .header("x-sbx-token", token)
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .expect("request");
        let resp = send.send_request(req).await.expect("an HTTP/2 answer");
        assert_eq!(resp.version(), hyper::Version::HTTP_2);
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    })
}

/// Starts the test server on `port` of `sandbox`, bound to `bind`, through `auth`.
fn serve(node: &TestNode, sandbox: &str, port: u16, bind: &str, auth: &[(&str, &str)]) {
    let body = json!({ "command": ["python3", "-c", SERVER, port.to_string(), bind] });
    let r = node.post(
        &format!("/v1/sandboxes/{sandbox}/exec"),
        auth,
        body.to_string().as_bytes(),
    );
    assert_eq!(r.status, 201, "start the server: {}", r.text());
}

fn token_of(v: &Value) -> String {
    let t = v["token"]
        .as_str()
        .unwrap_or_else(|| panic!("no token in {v}"));
    assert!(
        t.starts_with("sbt_") && t.len() >= 4 + 32,
        "a token of 128 bits or more: {t}"
    );
    t.to_string()
}

#[test]
fn preview_urls_reach_a_sandboxs_ports_with_its_token_or_when_public() {
    let node = TestNode::start();
    let pv = Preview::of(&node);
    let sb = node.create_sandbox(&json!({ "public_ports": [8001] }));
    let id = sb["id"].as_str().expect("id").to_string();
    let token = token_of(&sb);
    assert_eq!(sb["public_ports"], json!([8001]), "{sb}");
    assert_eq!(sb["public_ports_except"], Value::Null, "{sb}");
    assert_eq!(
        sb["preview_url"],
        json!(format!("http://{{port}}-{id}.localhost:{}", pv.port())),
        "{sb}"
    );
    let got = node.get(&format!("/v1/sandboxes/{id}"), &[]).json();
    assert_eq!(
        got["token"],
        json!(token),
        "GET of the sandbox shows its token"
    );
    let list = node.get("/v1/sandboxes", &[]);
    assert_eq!(list.status, 200);
    assert!(!list.text().contains(&token), "the list shows no token");
    assert!(
        list.json()["data"]
            .as_array()
            .expect("data")
            .iter()
            .all(|s| s.get("token").is_none() && s["preview_url"].is_string()),
        "{}",
        list.text()
    );

    // The CLI: `sbx url` prints the URL with the token; `sbx create --public-port`.
    let (code, out, err) = sbx(&node, &["url", &id, "8000"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        out.trim(),
        format!(
            "http://8000-{id}.localhost:{}/?sbx_token={token}",
            pv.port()
        )
    );
    let (code, out, err) = sbx(
        &node,
        &[
            "create",
            "--public-port",
            "9000",
            "--public-port",
            "9001",
            "--json",
        ],
    );
    assert_eq!(code, 0, "{err}");
    let made: Value = serde_json::from_str(&out).expect("the sandbox object");
    assert_eq!(made["public_ports"], json!([9000, 9001]), "{made}");
    node.delete_sandbox(made["id"].as_str().expect("id"));

    // 8000 on every address (private), 8001 on 127.0.0.1 alone (public).
    serve(&node, &id, 8000, "0.0.0.0", &[]);
    serve(&node, &id, 8001, "127.0.0.1", &[]);
    pv.wait_open(8000, &id, &token);
    pv.wait_open(8001, &id, &token);
    let private = pv.host(8000, &id);
    let with_token = [("X-Sbx-Token", token.as_str())];

    // Private without a token; with a wrong one.
    let a = pv.get(&private, "/hello", &[]);
    assert_error(a.status, &a.json(), 401, "invalid_token", None);
    let a = pv.get(
        &private,
        "/hello",
        &[("X-Sbx-Token", "sbt_00000000000000000000000000000000")],
    );
    assert_error(a.status, &a.json(), 401, "invalid_token", None);

    // With the header: through, and the service does not see it.
    let a = pv.get(&private, "/hello", &with_token);
    assert_eq!((a.status, a.text()), (200, "hello from /hello".into()));
    let a = pv.get(
        &private,
        "/headers",
        &[("X-Sbx-Token", &token), ("X-Mine", "kept")],
    );
    assert_eq!(a.status, 200, "{}", a.text());
    let seen = a.json();
    let h = &seen["headers"];
    assert!(
        h.get("x-sbx-token").is_none(),
        "the service saw the token: {seen}"
    );
    assert!(!a.text().contains(&token), "{seen}");
    assert_eq!(h["x-mine"], "kept", "{seen}");
    assert_eq!(h["host"], json!(private), "{seen}");
    assert_eq!(h["x-forwarded-host"], json!(private), "{seen}");
    assert_eq!(h["x-forwarded-proto"], "http", "{seen}");
    assert_eq!(h["x-forwarded-for"], "127.0.0.1", "{seen}");

    // HTTP/2 from the client (its :authority names the port), HTTP/1.1 to the service.
    let (status, body) = h2_get(&pv.addr, &private, "/headers?over=h2", &token);
    assert_eq!(status, 200, "{body}");
    let seen: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(seen["path"], "/headers?over=h2", "{seen}");
    assert_eq!(seen["headers"]["host"], json!(private), "{seen}");
    assert!(seen["headers"].get("x-sbx-token").is_none(), "{seen}");

    // A POST body.
    let a = pv.send(
        "POST",
        &private,
        "/echo",
        &with_token,
        b"a body of the test",
    );
    assert_eq!(
        (a.status, a.text()),
        (200, "got: a body of the test".into())
    );

    // ?sbx_token=: 307 to the URL without it and a cookie for that host; then the cookie.
    let a = pv.get(
        &private,
        &format!("/headers?a=1&sbx_token={token}&b=2"),
        &[],
    );
    assert_eq!(a.status, 307, "{}", a.text());
    assert_eq!(a.header("location"), Some("/headers?a=1&b=2"));
    let cookie = a.header("set-cookie").expect("a cookie").to_string();
    assert!(
        cookie.starts_with(&format!("sbx_token={token}")),
        "{cookie}"
    );
    for attr in ["HttpOnly", "SameSite=Lax", "Path=/"] {
        assert!(cookie.contains(attr), "{cookie}");
    }
    assert!(
        !cookie.contains("Secure") && !cookie.contains("Domain"),
        "{cookie}"
    );
    let pair = cookie.split(';').next().expect("pair");
    let a = pv.get(
        &private,
        "/headers?a=1&b=2",
        &[("Cookie", &format!("theirs=1; {pair}"))],
    );
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.json()["headers"]["cookie"], "theirs=1", "{}", a.text());
    let a = pv.get(&private, "/x?sbx_token=sbt_wrong", &[]);
    assert_error(a.status, &a.json(), 401, "invalid_token", None);

    // Public (and bound to 127.0.0.1 alone): no token needed.
    let a = pv.get(&pv.host(8001, &id), "/open", &[]);
    assert_eq!((a.status, a.text()), (200, "hello from /open".into()));

    // SSE: each event as it is sent, before the stream ends.
    let mut s = TcpStream::connect(&pv.addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        s,
        "GET /sse HTTP/1.1\r\nHost: {private}\r\nX-Sbx-Token: {token}\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let started = Instant::now();
    let mut r = BufReader::new(s);
    let mut seen_at = Vec::new();
    let mut line = String::new();
    while seen_at.len() < 3 {
        line.clear();
        let n = r.read_line(&mut line).expect("read the stream");
        assert!(n > 0, "the stream ended after {seen_at:?}");
        if let Some(ev) = line.trim().strip_prefix("data: ") {
            seen_at.push((ev.to_string(), started.elapsed()));
        }
    }
    let names: Vec<&str> = seen_at.iter().map(|(e, _)| e.as_str()).collect();
    assert_eq!(names, ["event-0", "event-1", "event-2"]);
    assert!(
        seen_at[1].1 - seen_at[0].1 >= Duration::from_millis(400),
        "events came one by one, not at the end: {seen_at:?}"
    );

    // A WebSocket through the preview URL.
    let s = TcpStream::connect(&pv.addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let url = format!("ws://{private}/ws");
    let mut req =
        tungstenite::client::IntoClientRequest::into_client_request(url.as_str()).expect("request");
    req.headers_mut()
        .insert("x-sbx-token", token.parse().expect("header"));
    let (mut ws, resp) = tungstenite::client::client(req, s).expect("the WebSocket handshake");
    assert_eq!(resp.status(), 101);
    for msg in ["one", "two"] {
        ws.send(tungstenite::Message::text(msg)).expect("send");
        let got = ws.read().expect("read");
        assert_eq!(got.to_text().expect("text"), format!("echo: {msg}"));
    }
    let _ = ws.close(None);

    // Nothing listens; no such sandbox; not a preview host.
    let a = pv.get(&pv.host(8002, &id), "/", &with_token);
    assert_error(a.status, &a.json(), 502, "port_not_open", None);
    assert_eq!(a.json()["error"]["type"], "bad_gateway");
    let a = pv.get(
        &pv.host(8000, "sbx-nosuchsandbox0000000000"),
        "/",
        &with_token,
    );
    assert_error(a.status, &a.json(), 404, "sandbox_not_found", None);
    let a = pv.get("example.com", "/", &[]);
    assert_error(a.status, &a.json(), 404, "not_found", Some("Host"));

    // The sandbox token on the API: its own sandbox, nothing else.
    let other = node.create_sandbox(&json!({}));
    let other_id = other["id"].as_str().expect("id");
    let bearer = format!("Bearer {token}");
    let auth = [("Authorization", bearer.as_str())];
    let r = node.post(
        &format!("/v1/sandboxes/{id}/exec"),
        &auth,
        json!({ "command": "echo mine", "wait_seconds": 10 })
            .to_string()
            .as_bytes(),
    );
    assert_eq!(r.status, 201, "exec in its own sandbox: {}", r.text());
    assert_eq!(r.json()["stdout"], "mine\n", "{}", r.text());
    let r = node.get(&format!("/v1/sandboxes/{id}"), &auth);
    assert_eq!(r.status, 200, "{}", r.text());
    let r = node.get(&format!("/v1/sandboxes/{id}/files/list?path=/"), &auth);
    assert_eq!(r.status, 200, "{}", r.text());
    for (status, body) in [
        {
            let r = node.get(&format!("/v1/sandboxes/{other_id}"), &auth);
            (r.status, r.json())
        },
        {
            let r = node.get("/v1/sandboxes", &auth);
            (r.status, r.json())
        },
        {
            let r = node.post("/v1/sandboxes", &auth, b"{}");
            (r.status, r.json())
        },
        {
            let r = node.delete(&format!("/v1/sandboxes/{id}"), &auth);
            (r.status, r.json())
        },
        {
            let r = node.post(&format!("/v1/sandboxes/{id}/restart"), &auth, b"");
            (r.status, r.json())
        },
        {
            let r = node.get("/internal/node", &auth);
            (r.status, r.json())
        },
        {
            let r = node.get("/v1/secrets", &auth);
            (r.status, r.json())
        },
    ] {
        assert_error(status, &body, 403, "needs_api_key", None);
    }
    let r = node.get(
        &format!("/v1/sandboxes/{id}"),
        &[(
            "Authorization",
            "Bearer sbt_00000000000000000000000000000000",
        )],
    );
    assert_error(r.status, &r.json(), 401, "invalid_token", None);

    node.delete_sandbox(other_id);
    node.delete_sandbox(&id);
    // A deleted sandbox's token opens nothing.
    let r = node.get(&format!("/v1/sandboxes/{id}"), &auth);
    assert_error(r.status, &r.json(), 401, "invalid_token", None);
    assert!(
        !node.log_text().contains(&token),
        "the token is in the node's log"
    );
    node.assert_clean(Duration::from_secs(10));
}

/// A CA and a certificate of `*.preview.localhost` it signs: (CA DER, cert PEM, key PEM).
/// (Not `*.localhost`: a wildcard over a single label matches nothing for webpki, as for
/// browsers.)
fn test_certs() -> (Vec<u8>, String, String) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().expect("CA key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = params.self_signed(&ca_key).expect("CA");
    let issuer = Issuer::new(params, ca_key);
    let key = KeyPair::generate().expect("key");
    let leaf = CertificateParams::new(vec!["*.preview.localhost".to_string()])
        .expect("params")
        .signed_by(&key, &issuer)
        .expect("cert");
    (ca.der().to_vec(), leaf.pem(), key.serialize_pem())
}

fn tls_client(ca: &[u8], alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls::pki_types::CertificateDer::from(ca.to_vec()))
        .expect("the test CA");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(cfg)
}

/// A TLS connection to the preview listener for `host` (SNI without the port).
fn tls_connect(
    addr: &str,
    host: &str,
    cfg: Arc<rustls::ClientConfig>,
) -> rustls::StreamOwned<rustls::ClientConnection, TcpStream> {
    let name = host.split(':').next().expect("name").to_string();
    let server = rustls::pki_types::ServerName::try_from(name).expect("a server name");
    let conn = rustls::ClientConnection::new(cfg, server).expect("TLS client");
    let tcp = TcpStream::connect(addr).expect("connect");
    tcp.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let mut s = rustls::StreamOwned::new(conn, tcp);
    while s.conn.is_handshaking() {
        s.conn.complete_io(&mut s.sock).expect("the TLS handshake");
    }
    s
}

#[test]
fn https_previews_and_tokens_beside_api_keys() {
    let dir = std::env::temp_dir().join(unique("sbx-test-preview"));
    std::fs::create_dir_all(&dir).expect("dir");
    let (ca, cert, key) = test_certs();
    let (cert_file, key_file, keys_file) =
        (dir.join("cert.pem"), dir.join("key.pem"), dir.join("keys"));
    std::fs::write(&cert_file, cert).expect("cert");
    std::fs::write(&key_file, key).expect("key");
    std::fs::write(&keys_file, "key-of-the-test-4d2\n").expect("keys");
    let mut node = TestNode::start_with(&[
        "--api-keys",
        keys_file.to_str().expect("path"),
        "--preview-tls-cert",
        cert_file.to_str().expect("path"),
        "--preview-tls-key",
        key_file.to_str().expect("path"),
        "--preview-domain",
        "preview.localhost",
    ]);
    let _ = std::fs::remove_dir_all(&dir);
    let api_key = "Bearer key-of-the-test-4d2";
    node.auth = Some(api_key.into());
    let with_key = [("Authorization", api_key)];
    let pv = Preview::of(&node);
    let r = node.get("/internal/node", &with_key);
    assert_eq!(r.json()["preview"]["tls"], true, "{}", r.text());
    assert_eq!(
        r.json()["preview"]["domain"],
        "preview.localhost",
        "{}",
        r.text()
    );

    let r = node.post("/v1/sandboxes", &with_key, b"{}");
    assert_eq!(r.status, 201, "{}", r.text());
    let sb = r.json();
    let id = sb["id"].as_str().expect("id").to_string();
    let token = token_of(&sb);
    assert_eq!(
        sb["preview_url"],
        json!(format!(
            "https://{{port}}-{id}.preview.localhost:{}",
            pv.port()
        )),
        "{sb}"
    );
    serve(&node, &id, 8000, "0.0.0.0", &with_key);
    let host = format!("8000-{id}.preview.localhost:{}", pv.port());

    // HTTPS, with ALPN h2 and http/1.1 offered by the listener.
    let h2 = tls_connect(&pv.addr, &host, tls_client(&ca, &[b"h2", b"http/1.1"]));
    assert_eq!(h2.conn.alpn_protocol(), Some(&b"h2"[..]));
    drop(h2);
    let http1 = tls_client(&ca, &[b"http/1.1"]);
    let get = |path: &str, headers: &[(&str, &str)]| {
        exchange(
            tls_connect(&pv.addr, &host, http1.clone()),
            "GET",
            &host,
            path,
            headers,
            b"",
        )
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let a = get("/", &[("X-Sbx-Token", &token)]);
        if a.status == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the server did not open: {}",
            a.text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let a = get("/hello", &[]);
    assert_error(a.status, &a.json(), 401, "invalid_token", None);
    let a = get("/headers", &[("X-Sbx-Token", &token)]);
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(
        a.json()["headers"]["x-forwarded-proto"],
        "https",
        "{}",
        a.text()
    );
    // An API key opens it too, and stays behind; another Authorization is the service's.
    let a = get("/headers", &with_key);
    assert_eq!(a.status, 200, "{}", a.text());
    assert!(
        a.json()["headers"].get("authorization").is_none(),
        "{}",
        a.text()
    );
    let a = get(
        "/headers",
        &[("Authorization", "Bearer theirs"), ("X-Sbx-Token", &token)],
    );
    assert_eq!(
        a.json()["headers"]["authorization"],
        "Bearer theirs",
        "{}",
        a.text()
    );
    let a = get(&format!("/p?sbx_token={token}"), &[]);
    assert_eq!(a.status, 307, "{}", a.text());
    let cookie = a.header("set-cookie").expect("cookie");
    assert!(cookie.contains("; Secure"), "{cookie}");

    // With keys, the token is another credential: its own sandbox only.
    let bearer = format!("Bearer {token}");
    let auth = [("Authorization", bearer.as_str())];
    let r = node.get(&format!("/v1/sandboxes/{id}"), &auth);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["token"], json!(token));
    let r = node.post(
        &format!("/v1/sandboxes/{id}/exec"),
        &auth,
        json!({ "command": "echo via-token", "wait_seconds": 10 })
            .to_string()
            .as_bytes(),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["stdout"], "via-token\n", "{}", r.text());
    let r = node.get("/v1/sandboxes", &auth);
    assert_error(r.status, &r.json(), 403, "needs_api_key", None);
    let r = node.get("/v1/sandboxes", &[]);
    assert_error(r.status, &r.json(), 401, "missing_api_key", None);
    let r = node.get("/v1/sandboxes", &with_key);
    assert_eq!(r.status, 200);
    assert!(!r.text().contains(&token), "the list shows no token");

    let r = node.delete(&format!("/v1/sandboxes/{id}"), &with_key);
    assert_eq!(r.status, 200, "{}", r.text());
    node.assert_clean(Duration::from_secs(10));
}

/// A sandbox on the node's network (its own namespace with a veth, not `lo` alone) is reached
/// the same way, on every address and on 127.0.0.1.
#[test]
fn sandboxes_with_network_are_reached_too() {
    let range = format!("10.253.{}.0/24", std::process::id() % 250);
    let node = TestNode::start_with(&[
        "--egress-default",
        "allow",
        "--net-range",
        &range,
        "--warm-pool",
        "0",
    ]);
    let pv = Preview::of(&node);
    let sb = node.create_sandbox(&json!({}));
    let id = sb["id"].as_str().expect("id").to_string();
    let token = token_of(&sb);
    serve(&node, &id, 8000, "0.0.0.0", &[]);
    serve(&node, &id, 8001, "127.0.0.1", &[]);
    for port in [8000, 8001] {
        pv.wait_open(port, &id, &token);
        let a = pv.get(&pv.host(port, &id), "/net", &[("X-Sbx-Token", &token)]);
        assert_eq!(
            (a.status, a.text()),
            (200, "hello from /net".into()),
            "port {port}"
        );
    }
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}

/// A sandbox's token is kept across a node's restart (sealed in its row), and its preview
/// URL works on with it.
#[test]
fn tokens_and_previews_outlive_a_node_restart() {
    let mut node = TestNode::start();
    let sb = node.create_sandbox(&json!({ "public_ports_except": [8000] }));
    let id = sb["id"].as_str().expect("id").to_string();
    let token = token_of(&sb);
    serve(&node, &id, 8000, "0.0.0.0", &[]);
    serve(&node, &id, 8001, "0.0.0.0", &[]);
    let pv = Preview::of(&node);
    pv.wait_open(8000, &id, &token);
    pv.wait_open(8001, &id, &token);
    for file in ["state.db", "state.db-wal"] {
        let bytes = std::fs::read(node.data_dir.join(file)).unwrap_or_default();
        assert!(
            !bytes.windows(token.len()).any(|w| w == token.as_bytes()),
            "the token is in {file} in clear"
        );
    }
    node.kill();
    node.restart();
    let got = node.get(&format!("/v1/sandboxes/{id}"), &[]).json();
    assert_eq!(got["status"], "running", "{got}");
    assert_eq!(got["token"], json!(token), "{got}");
    assert_eq!(got["preview_url"], sb["preview_url"], "{got}");
    assert_eq!(got["public_ports_except"], json!([8000]), "{got}");
    let pv = Preview::of(&node);
    let a = pv.get(&pv.host(8000, &id), "/after", &[]);
    assert_error(a.status, &a.json(), 401, "invalid_token", None);
    let a = pv.get(&pv.host(8000, &id), "/after", &[("X-Sbx-Token", &token)]);
    assert_eq!((a.status, a.text()), (200, "hello from /after".into()));
    // Every port but 8000 is public.
    let a = pv.get(&pv.host(8001, &id), "/open", &[]);
    assert_eq!((a.status, a.text()), (200, "hello from /open".into()));
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}

/// A page of any site can send a request without a CORS preflight (a form's POST, a fetch
/// with no Content-Type) to a preview host of a node without keys: it reaches neither envd's
/// port (E2B's, `49983-…`) to change anything, nor any port from a foreign origin; and the
/// `?sbx_token=` redirect stays on the preview host.
#[test]
fn pages_of_other_sites_change_nothing_through_preview_hosts() {
    let e2b = format!("127.0.0.1:{}", free_port());
    let node = TestNode::start_with(&["--e2b-listen", &e2b]);
    let pv = Preview::of(&node);
    let sb = node.create_sandbox(&json!({}));
    let id = sb["id"].as_str().expect("id").to_string();
    let token = token_of(&sb);
    let cat = || {
        let r = node.post(
            &format!("/v1/sandboxes/{id}/exec"),
            &[],
            json!({ "command": "cat /tmp/victim || echo gone", "wait_seconds": 10 })
                .to_string()
                .as_bytes(),
        );
        assert_eq!(r.status, 201, "{}", r.text());
        r.json()["stdout"].as_str().expect("stdout").to_string()
    };
    let r = node.post(
        &format!("/v1/sandboxes/{id}/exec"),
        &[],
        br#"{"command": "echo keep > /tmp/victim", "wait_seconds": 10}"#,
    );
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(cat(), "keep\n");
    let envd = pv.host(49983, &id);
    // A Connect call with no Content-Type, a multipart upload: refused without the token.
    let a = pv.send(
        "POST",
        &envd,
        "/filesystem.Filesystem/Remove",
        &[],
        br#"{"path":"/tmp/victim"}"#,
    );
    assert_eq!(a.status, 403, "{}", a.text());
    let form = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"victim\"\r\n\r\nowned\r\n--XyZ--\r\n";
    let multipart = ("Content-Type", "multipart/form-data; boundary=XyZ");
    let a = pv.send("POST", &envd, "/files?path=/tmp/victim", &[multipart], form);
    assert_eq!(a.status, 403, "{}", a.text());
    assert_eq!(cat(), "keep\n");
    // From a page of another site, whatever it sends.
    let evil = ("Origin", "http://evil.example");
    let a = pv.send(
        "POST",
        &envd,
        "/filesystem.Filesystem/Remove",
        &[
            evil,
            ("Content-Type", "application/json"),
            ("Connect-Protocol-Version", "1"),
        ],
        br#"{"path":"/tmp/victim"}"#,
    );
    assert_error(
        a.status,
        &a.json(),
        403,
        "origin_not_allowed",
        Some("Origin"),
    );
    assert_eq!(cat(), "keep\n");
    // With the token (as E2B's SDK sends it): the upload is made.
    let a = pv.send(
        "POST",
        &envd,
        "/files?path=/tmp/victim",
        &[multipart, ("X-Access-Token", &token)],
        form,
    );
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(cat(), "owned");

    // Any other port: a foreign origin refused, the preview host's own served.
    serve(&node, &id, 8000, "0.0.0.0", &[]);
    pv.wait_open(8000, &id, &token);
    let web = pv.host(8000, &id);
    let with_token = ("X-Sbx-Token", token.as_str());
    let a = pv.get(&web, "/headers", &[with_token, evil]);
    assert_error(
        a.status,
        &a.json(),
        403,
        "origin_not_allowed",
        Some("Origin"),
    );
    let a = pv.send("POST", &web, "/form", &[evil], b"a=1");
    assert_error(
        a.status,
        &a.json(),
        403,
        "origin_not_allowed",
        Some("Origin"),
    );
    let own = format!("http://{web}");
    let a = pv.get(&web, "/headers", &[with_token, ("Origin", &own)]);
    assert_eq!(a.status, 200, "{}", a.text());
    // A page of another port of the same sandbox (its front end calling its API) is served;
    // one of another sandbox is not.
    let front = format!("http://{}", pv.host(3000, &id));
    let a = pv.get(&web, "/headers", &[with_token, ("Origin", &front)]);
    assert_eq!(a.status, 200, "{}", a.text());
    let other = format!("http://{}", pv.host(3000, "sbx-0000000000000000"));
    let a = pv.get(&web, "/headers", &[with_token, ("Origin", &other)]);
    assert_error(
        a.status,
        &a.json(),
        403,
        "origin_not_allowed",
        Some("Origin"),
    );

    // The redirect that trades `?sbx_token=` for a cookie goes to a path of this host, never
    // to `//other.host/`.
    for (path, want) in [
        (
            format!("//evil.example/?sbx_token={token}"),
            "/evil.example/",
        ),
        (
            format!("///evil.example/x?sbx_token={token}&b=1"),
            "/evil.example/x?b=1",
        ),
        (format!("/ok?sbx_token={token}"), "/ok"),
    ] {
        let a = pv.get(&web, &path, &[]);
        assert_eq!(a.status, 307, "{path}: {}", a.text());
        assert_eq!(a.header("location"), Some(want), "{path}");
    }
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}
