//! The proxy on 127.0.0.1 with a fake node: a [`FakeView`], a tiny DNS server answering A
//! questions from a table, upstreams that echo what they were sent (plain and TLS, with a
//! test CA given as extra roots), and the original destination injected.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use hickory_resolver::proto::op::{Message, MessageType, ResponseCode};
use hickory_resolver::proto::rr::{rdata::A, RData, Record, RecordType};
use http_body_util::Full;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use sbx_api::egress::Egress;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

use super::*;

// ---- the fake node ----

struct FakeView {
    rules: Mutex<Arc<Egress>>,
    secrets: Mutex<HashMap<String, String>>,
    refused: Vec<IpAddr>,
}

impl EgressView for FakeView {
    fn rules_of(&self, addr: Ipv4Addr) -> Option<(String, Arc<Egress>)> {
        let id = match addr {
            Ipv4Addr::LOCALHOST => "sbx_test",
            OTHER_SANDBOX => "sbx_other",
            _ => return None,
        };
        Some((id.to_string(), self.rules.lock().unwrap().clone()))
    }
    fn secret(&self, name: &str) -> Option<String> {
        self.secrets.lock().unwrap().get(name).cloned()
    }
    fn refused(&self, ip: IpAddr) -> bool {
        self.refused.contains(&ip)
    }
}

/// A second sandbox's address (the first is 127.0.0.1).
const OTHER_SANDBOX: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 4);

/// The address the tests' DNS gives to names the node must refuse.
const REFUSED: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
/// An original destination nothing listens on: a proxy that dialed it instead of the name
/// would fail.
const NOWHERE: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 9);

fn temp_dir(tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!(
        "sbx-egress-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A DNS server on 127.0.0.1 answering A questions from `names` (others: NXDOMAIN; AAAA:
/// no answer).
async fn dns_server(names: &[(&str, Ipv4Addr)]) -> SocketAddr {
    let table: HashMap<String, Ipv4Addr> =
        names.iter().map(|(n, a)| (format!("{n}."), *a)).collect();
    let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = sock.local_addr().unwrap();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 4096];
        loop {
            let Ok((n, from)) = sock.recv_from(&mut buf).await else {
                return;
            };
            let Ok(q) = Message::from_vec(&buf[..n]) else {
                continue;
            };
            let mut r = Message::new();
            r.set_id(q.id())
                .set_message_type(MessageType::Response)
                .set_op_code(q.op_code())
                .set_recursion_desired(q.recursion_desired())
                .set_recursion_available(true);
            let mut code = ResponseCode::NoError;
            for query in q.queries() {
                r.add_query(query.clone());
                let name = query.name().to_ascii().to_ascii_lowercase();
                match table.get(&name) {
                    Some(ip) if query.query_type() == RecordType::A => {
                        r.add_answer(Record::from_rdata(
                            query.name().clone(),
                            60,
                            RData::A(A(*ip)),
                        ));
                    }
                    Some(_) => {}
                    None => code = ResponseCode::NXDomain,
                }
            }
            r.set_response_code(code);
            let _ = sock.send_to(&r.to_vec().unwrap(), from).await;
        }
    });
    addr
}

/// A test CA and a certificate of it for `names`.
struct TestPki {
    ca_pem: String,
    chain: Vec<CertificateDer<'static>>,
    key_der: Vec<u8>,
}

fn test_pki(names: &[&str]) -> TestPki {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "test upstream CA");
    ca_params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign];
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let key = rcgen::KeyPair::generate().unwrap();
    let params =
        rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .unwrap();
    let cert = params.signed_by(&key, &issuer).unwrap();
    TestPki {
        ca_pem: ca_cert.pem(),
        chain: vec![cert.der().clone()],
        key_der: key.serialize_der(),
    }
}

/// What an echo upstream saw of each request.
#[derive(Clone, Default)]
struct Seen {
    conns: Arc<AtomicUsize>,
    requests: Arc<Mutex<Vec<String>>>,
}

/// An HTTP upstream on `ip` (TLS with `pki` when given) answering each request with
/// `METHOD PATH auth=<authorization> host=<host>`.
async fn upstream(ip: Ipv4Addr, pki: Option<&TestPki>) -> (u16, Seen) {
    upstream_at(ip, 0, pki).await
}

/// [`upstream`] on a port given (0: any).
async fn upstream_at(ip: Ipv4Addr, port: u16, pki: Option<&TestPki>) -> (u16, Seen) {
    let l = TcpListener::bind((ip, port)).await.unwrap();
    let port = l.local_addr().unwrap().port();
    let seen = Seen::default();
    let tls = pki.map(|p| {
        let cfg = rustls::ServerConfig::builder_with_provider(tls::provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                p.chain.clone(),
                PrivateKeyDer::try_from(p.key_der.clone()).unwrap(),
            )
            .unwrap();
        tokio_rustls::TlsAcceptor::from(Arc::new(cfg))
    });
    let s = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = l.accept().await else {
                return;
            };
            s.conns.fetch_add(1, Ordering::SeqCst);
            let s = s.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                let io: Box<dyn io::Io> = match tls {
                    Some(a) => match a.accept(stream).await {
                        Ok(t) => Box::new(t),
                        Err(_) => return,
                    },
                    None => Box::new(stream),
                };
                let svc =
                    hyper::service::service_fn(move |mut req: Request<hyper::body::Incoming>| {
                        let h = |n: &str| {
                            req.headers()
                                .get(n)
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or("-")
                                .to_string()
                        };
                        let mut line = format!(
                            "{} {} auth={} host={}",
                            req.method(),
                            req.uri(),
                            h("authorization"),
                            h("host")
                        );
                        if req.headers().contains_key("x-api-key") {
                            line.push_str(&format!(" key={}", h("x-api-key")));
                        }
                        s.requests.lock().unwrap().push(line.clone());
                        let resp = if req.headers().contains_key("upgrade") {
                            // An upgrade: 101, then the bytes echoed.
                            let on = hyper::upgrade::on(&mut req);
                            tokio::spawn(async move {
                                let Ok(u) = on.await else { return };
                                let mut u = TokioIo::new(u);
                                let mut buf = [0u8; 1024];
                                while let Ok(n @ 1..) = u.read(&mut buf).await {
                                    if u.write_all(&buf[..n]).await.is_err() {
                                        return;
                                    }
                                }
                            });
                            Response::builder()
                                .status(101)
                                .header("connection", "upgrade")
                                .header("upgrade", "echo")
                                .body(Full::new(Bytes::new()))
                                .unwrap()
                        } else {
                            Response::new(Full::new(Bytes::from(line)))
                        };
                        async move { Ok::<_, Infallible>(resp) }
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(io), svc)
                    .with_upgrades()
                    .await;
            });
        }
    });
    (port, seen)
}

struct Harness {
    proxy: SocketAddr,
    view: Arc<FakeView>,
    ca: Arc<NodeCa>,
    dir: PathBuf,
}

impl Drop for Harness {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn harness(
    rules: Value,
    names: &[(&str, Ipv4Addr)],
    orig: SocketAddrV4,
    extra_roots: Option<&str>,
) -> Harness {
    let orig: OrigDst = Arc::new(move |_: &TcpStream| Ok(orig));
    harness_with(rules, names, orig, extra_roots, PER_SANDBOX).await
}

/// [`harness`] with the original destination's lookup and the share of a sandbox given.
async fn harness_with(
    rules: Value,
    names: &[(&str, Ipv4Addr)],
    orig: OrigDst,
    extra_roots: Option<&str>,
    per_sandbox: usize,
) -> Harness {
    let dir = temp_dir("proxy");
    let roots = extra_roots.map(|pem| {
        let p = dir.join("extra.pem");
        std::fs::write(&p, pem).unwrap();
        p
    });
    let view = Arc::new(FakeView {
        rules: Mutex::new(Arc::new(Egress::parse(&rules).unwrap())),
        secrets: Mutex::new(HashMap::from([("tok".to_string(), "s3cret".to_string())])),
        refused: vec![IpAddr::V4(REFUSED)],
    });
    let ca = Arc::new(NodeCa::load_or_create(&dir).unwrap());
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let proxy = listener.local_addr().unwrap();
    let cfg = ProxyConfig {
        upstream_dns: vec![dns_server(names).await],
        extra_roots: roots,
        ca_dir: dir.clone(),
        per_sandbox,
        max_connections: MAX_CONNECTIONS,
    };
    start_with(listener, view.clone(), ca.clone(), cfg, orig).unwrap();
    Harness {
        proxy,
        view,
        ca,
        dir,
    }
}

/// Sends `request` and reads until the proxy closes: (status, body).
async fn exchange(io: &mut (impl AsyncRead + AsyncWrite + Unpin), request: &str) -> (u16, String) {
    io.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(20), async {
        let mut buf = [0u8; 4096];
        loop {
            match io.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(r.is_ok(), "no answer in 20 s");
    let text = String::from_utf8_lossy(&out).to_string();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .unwrap_or("")
        .to_string();
    (status, body)
}

async fn http(h: &Harness, request: &str) -> (u16, String) {
    let mut s = TcpStream::connect(h.proxy).await.unwrap();
    exchange(&mut s, request).await
}

fn get(host: &str, path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer fake\r\nConnection: close\r\n\r\n")
}

fn error_code(body: &str) -> String {
    // A chunked body: the JSON is between the chunk sizes.
    let start = body.find('{').unwrap_or(0);
    let end = body.rfind('}').map_or(body.len(), |e| e + 1);
    let v: Value = serde_json::from_str(&body[start..end]).unwrap_or(Value::Null);
    v["error"]["code"].as_str().unwrap_or("").to_string()
}

fn tls_client(root_pem: &str) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(root_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let cfg = rustls::ClientConfig::builder_with_provider(tls::provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(cfg))
}

// ---- plain HTTP ----

#[tokio::test]
async fn http_to_an_allowed_name_goes_where_the_proxy_resolves_it() {
    let (port, seen) = upstream(Ipv4Addr::LOCALHOST, None).await;
    let h = harness(
        json!({"default": "deny", "allow": ["allowed.test", "nx.test"]}),
        &[("allowed.test", Ipv4Addr::LOCALHOST)],
        SocketAddrV4::new(NOWHERE, port),
        None,
    )
    .await;
    let (status, body) = http(&h, &get("Allowed.Test:80", "/hello")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, "GET /hello auth=Bearer fake host=Allowed.Test:80");
    assert_eq!(seen.conns.load(Ordering::SeqCst), 1);
    // A name the upstream DNS does not know: 502.
    let (status, body) = http(&h, &get("nx.test", "/")).await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(error_code(&body), "upstream_failed");
}

#[tokio::test]
async fn http_to_a_denied_host_is_403_egress_denied() {
    let (port, seen) = upstream(Ipv4Addr::LOCALHOST, None).await;
    let h = harness(
        json!({"allow": ["allowed.test"], "deny": ["*"]}),
        &[
            ("allowed.test", Ipv4Addr::LOCALHOST),
            ("evil.test", Ipv4Addr::LOCALHOST),
        ],
        SocketAddrV4::new(Ipv4Addr::LOCALHOST, port),
        None,
    )
    .await;
    let (status, body) = http(&h, &get("evil.test", "/")).await;
    assert_eq!(status, 403);
    assert_eq!(error_code(&body), "egress_denied");
    assert!(body.contains("evil.test"), "{body}");
    // A literal address is decided by the address rules.
    let (status, _) = http(&h, &get("127.0.0.1", "/")).await;
    assert_eq!(status, 403);
    assert_eq!(seen.conns.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn rules_change_live() {
    let (port, _seen) = upstream(Ipv4Addr::LOCALHOST, None).await;
    let h = harness(
        json!({"deny": ["*"]}),
        &[("a.test", Ipv4Addr::LOCALHOST)],
        SocketAddrV4::new(NOWHERE, port),
        None,
    )
    .await;
    assert_eq!(http(&h, &get("a.test", "/")).await.0, 403);
    *h.view.rules.lock().unwrap() =
        Arc::new(Egress::parse(&json!({"allow": ["a.test"], "deny": ["*"]})).unwrap());
    assert_eq!(http(&h, &get("a.test", "/")).await.0, 200);
}

#[tokio::test]
async fn http_rules_pass_get_on_the_path_and_refuse_the_rest() {
    let (port, seen) = upstream(Ipv4Addr::LOCALHOST, None).await;
    let h = harness(
        json!({"default": "deny", "allow": ["api.test"],
               "http": [{"host": "api.test", "methods": ["GET"], "paths": ["/v1/*"]}]}),
        &[("api.test", Ipv4Addr::LOCALHOST)],
        SocketAddrV4::new(NOWHERE, port),
        None,
    )
    .await;
    let (status, body) = http(&h, &get("api.test", "/v1/models?x=1")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, "GET /v1/models?x=1 auth=Bearer fake host=api.test");
    let post = "POST /v1/models HTTP/1.1\r\nHost: api.test\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}";
    let (status, body) = http(&h, post).await;
    assert_eq!(status, 403);
    assert_eq!(error_code(&body), "egress_denied");
    let (status, _) = http(&h, &get("api.test", "/v2/models")).await;
    assert_eq!(status, 403);
    assert_eq!(seen.requests.lock().unwrap().len(), 1);

    // Keep-alive: each request on one connection is checked.
    let mut s = TcpStream::connect(h.proxy).await.unwrap();
    let two = "GET /v1/a HTTP/1.1\r\nHost: api.test\r\n\r\nDELETE /v1/a HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n";
    s.write_all(two.as_bytes()).await.unwrap();
    let mut all = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(20), s.read_to_string(&mut all)).await;
    assert!(all.starts_with("HTTP/1.1 200"), "{all}");
    assert!(all.contains("HTTP/1.1 403"), "{all}");
}

#[tokio::test]
async fn inject_over_http_replaces_the_header() {
    let (port, seen) = upstream(Ipv4Addr::LOCALHOST, None).await;
    let h = harness(
        json!({"inject": [{"host": "api.test", "secret": "tok", "value": "Bearer {secret}"},
                          {"host": "gone.test", "secret": "missing"}]}),
        &[
            ("api.test", Ipv4Addr::LOCALHOST),
            ("gone.test", Ipv4Addr::LOCALHOST),
        ],
        SocketAddrV4::new(NOWHERE, port),
        None,
    )
    .await;
    let (status, body) = http(&h, &get("api.test", "/x")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        seen.requests.lock().unwrap().as_slice(),
        ["GET /x auth=Bearer s3cret host=api.test"]
    );
    // A secret gone: 502, never forwarded; the answer names the secret, not a value.
    let (status, body) = http(&h, &get("gone.test", "/x")).await;
    assert_eq!(status, 502);
    assert_eq!(error_code(&body), "upstream_failed");
    assert!(
        body.contains("missing") && !body.contains("s3cret"),
        "{body}"
    );
    assert_eq!(seen.requests.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn an_upgrade_to_an_inspected_host_is_checked_then_passed_through() {
    let (port, seen) = upstream(Ipv4Addr::LOCALHOST, None).await;
    let h = harness(
        json!({"http": [{"host": "ws.test", "methods": ["GET"], "paths": ["/ws"]}]}),
        &[("ws.test", Ipv4Addr::LOCALHOST)],
        SocketAddrV4::new(NOWHERE, port),
        None,
    )
    .await;
    let up = |path: &str, conn: &str| {
        format!(
            "GET {path} HTTP/1.1\r\nHost: ws.test\r\nConnection: {conn}\r\nUpgrade: echo\r\n\r\n"
        )
    };
    let (status, _) = http(&h, &up("/other", "Upgrade, close")).await;
    assert_eq!(status, 403);
    let mut s = TcpStream::connect(h.proxy).await.unwrap();
    s.write_all(up("/ws", "Upgrade").as_bytes()).await.unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(s.read(&mut byte).await.unwrap(), 1, "{head:?}");
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).to_string();
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    s.write_all(b"ping").await.unwrap();
    let mut back = [0u8; 4];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut back))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&back, b"ping");
    assert_eq!(seen.requests.lock().unwrap().len(), 1);
}

// ---- TLS ----

#[tokio::test]
async fn inject_over_https_with_the_node_ca() {
    let pki = test_pki(&["api.test"]);
    let (port, seen) = upstream(Ipv4Addr::LOCALHOST, Some(&pki)).await;
    let h = harness(
        json!({"default": "deny", "allow": ["api.test"],
               "inject": [{"host": "api.test", "secret": "tok", "header": "X-Api-Key"}]}),
        &[("api.test", Ipv4Addr::LOCALHOST)],
        SocketAddrV4::new(NOWHERE, port),
        Some(&pki.ca_pem),
    )
    .await;
    let tcp = TcpStream::connect(h.proxy).await.unwrap();
    let mut tls = tls_client(h.ca.cert_pem())
        .connect(ServerName::try_from("api.test").unwrap(), tcp)
        .await
        .expect("the client trusts the node's CA");
    let req =
        "GET /secure HTTP/1.1\r\nHost: api.test\r\nX-Api-Key: fake\r\nConnection: close\r\n\r\n";
    let (status, body) = exchange(&mut tls, req).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, "GET /secure auth=- host=api.test key=s3cret");
    assert_eq!(seen.requests.lock().unwrap().len(), 1);
    drop(tls);
    // The default header (authorization), with a value around the secret.
    *h.view.rules.lock().unwrap() = Arc::new(
        Egress::parse(&json!({"default": "deny", "allow": ["api.test"],
                              "inject": [{"host": "api.test", "secret": "tok", "value": "Bearer {secret}"}]}))
        .unwrap(),
    );
    let tcp = TcpStream::connect(h.proxy).await.unwrap();
    let mut tls = tls_client(h.ca.cert_pem())
        .connect(ServerName::try_from("api.test").unwrap(), tcp)
        .await
        .unwrap();
    let (status, body) = exchange(&mut tls, &get("api.test", "/secure")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, "GET /secure auth=Bearer s3cret host=api.test");
}

#[tokio::test]
async fn inspected_https_to_an_upstream_the_roots_do_not_trust_is_502() {
    let pki = test_pki(&["api.test"]);
    let (port, seen) = upstream(Ipv4Addr::LOCALHOST, Some(&pki)).await;
    let h = harness(
        json!({"inject": [{"host": "api.test", "secret": "tok"}]}),
        &[("api.test", Ipv4Addr::LOCALHOST)],
        SocketAddrV4::new(NOWHERE, port),
        None,
    )
    .await;
    let tcp = TcpStream::connect(h.proxy).await.unwrap();
    let mut tls = tls_client(h.ca.cert_pem())
        .connect(ServerName::try_from("api.test").unwrap(), tcp)
        .await
        .unwrap();
    let (status, body) = exchange(&mut tls, &get("api.test", "/")).await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(error_code(&body), "upstream_failed");
    assert!(seen.requests.lock().unwrap().is_empty());
}

#[tokio::test]
async fn tls_to_a_name_not_inspected_passes_through() {
    let pki = test_pki(&["plain.test"]);
    let (port, seen) = upstream(Ipv4Addr::LOCALHOST, Some(&pki)).await;
    let h = harness(
        json!({"default": "deny", "allow": ["plain.test"]}),
        &[
            ("plain.test", Ipv4Addr::LOCALHOST),
            ("denied.test", Ipv4Addr::LOCALHOST),
        ],
        SocketAddrV4::new(NOWHERE, port),
        None,
    )
    .await;
    let tcp = TcpStream::connect(h.proxy).await.unwrap();
    // The client trusts only the upstream's CA: the certificate it gets is the upstream's.
    let mut tls = tls_client(&pki.ca_pem)
        .connect(ServerName::try_from("plain.test").unwrap(), tcp)
        .await
        .expect("the upstream's own certificate");
    let (_, conn) = tls.get_ref();
    assert_eq!(conn.peer_certificates().unwrap()[0], pki.chain[0]);
    let (status, body) = exchange(&mut tls, &get("plain.test", "/p")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, "GET /p auth=Bearer fake host=plain.test");

    // A denied name: closed, never dialed.
    let tcp = TcpStream::connect(h.proxy).await.unwrap();
    let r = tls_client(&pki.ca_pem)
        .connect(ServerName::try_from("denied.test").unwrap(), tcp)
        .await;
    assert!(r.is_err());
    assert_eq!(seen.conns.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn tls_without_a_server_name_is_decided_by_the_address() {
    let pki = test_pki(&["127.0.0.1"]);
    let (port, _seen) = upstream(Ipv4Addr::LOCALHOST, Some(&pki)).await;
    let h = harness(
        json!({"default": "deny", "allow": ["127.0.0.1"]}),
        &[],
        SocketAddrV4::new(Ipv4Addr::LOCALHOST, port),
        None,
    )
    .await;
    let tcp = TcpStream::connect(h.proxy).await.unwrap();
    // An IP server name sends no SNI.
    let mut tls = tls_client(&pki.ca_pem)
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .expect("passed through to the original destination");
    let (status, _) = exchange(&mut tls, &get("127.0.0.1", "/")).await;
    assert_eq!(status, 200);
    *h.view.rules.lock().unwrap() = Arc::new(Egress::parse(&json!({"deny": ["*"]})).unwrap());
    let tcp = TcpStream::connect(h.proxy).await.unwrap();
    assert!(tls_client(&pki.ca_pem)
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .is_err());
}

// ---- refusals ----

#[tokio::test]
async fn refused_addresses_are_never_dialed() {
    let pki = test_pki(&["evil.test"]);
    let (port, seen) = upstream(REFUSED, Some(&pki)).await;
    let (plain_port, plain_seen) = upstream(REFUSED, None).await;
    let h = harness(
        json!({"allow": ["*", "127.0.0.0/8"]}),
        &[("evil.test", REFUSED)],
        SocketAddrV4::new(REFUSED, plain_port),
        None,
    )
    .await;
    // A name resolving to a refused address (DNS rebinding).
    let (status, body) = http(&h, &get("evil.test", "/")).await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(error_code(&body), "upstream_failed");
    // The address itself.
    let (status, _) = http(&h, &get("127.0.0.2", "/")).await;
    assert_eq!(status, 502);
    // Without a Host: the original destination, refused too.
    let (status, _) = http(&h, "GET / HTTP/1.0\r\n\r\n").await;
    assert_eq!(status, 502);
    assert_eq!(plain_seen.conns.load(Ordering::SeqCst), 0);

    // TLS by name: closed.
    let _ = port;
    let tcp = TcpStream::connect(h.proxy).await.unwrap();
    assert!(tls_client(&pki.ca_pem)
        .connect(ServerName::try_from("evil.test").unwrap(), tcp)
        .await
        .is_err());
    assert_eq!(seen.conns.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_connection_not_from_a_sandbox_is_closed() {
    let (port, seen) = upstream(Ipv4Addr::LOCALHOST, None).await;
    let h = harness(
        json!({}),
        &[("a.test", Ipv4Addr::LOCALHOST)],
        SocketAddrV4::new(NOWHERE, port),
        None,
    )
    .await;
    let sock = TcpSocket::new_v4().unwrap();
    sock.bind("127.0.0.3:0".parse().unwrap()).unwrap();
    let mut s = sock.connect(h.proxy).await.unwrap();
    let (status, body) = exchange(&mut s, &get("a.test", "/")).await;
    assert_eq!((status, body.as_str()), (0, ""));
    assert_eq!(seen.conns.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_denied_port_is_closed() {
    let (port, seen) = upstream(Ipv4Addr::LOCALHOST, None).await;
    let h = harness(
        json!({"deny_ports": [port]}),
        &[("a.test", Ipv4Addr::LOCALHOST)],
        SocketAddrV4::new(NOWHERE, port),
        None,
    )
    .await;
    let (status, body) = http(&h, &get("a.test", "/")).await;
    assert_eq!((status, body.as_str()), (0, ""));
    assert_eq!(seen.conns.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_connection_to_the_proxy_itself_is_closed() {
    // Not redirected: the original destination is the proxy's own address.
    let orig: OrigDst = Arc::new(|s: &TcpStream| match s.local_addr()? {
        SocketAddr::V4(a) => Ok(a),
        SocketAddr::V6(_) => Err(std::io::Error::other("v6")),
    });
    let h = harness_with(
        json!({"default": "deny", "allow": ["a.test"]}),
        &[("a.test", Ipv4Addr::new(127, 0, 0, 5))],
        orig,
        None,
        PER_SANDBOX,
    )
    .await;
    // A server on the proxy's port elsewhere: the proxy must not dial it for the sandbox.
    let (_, seen) = upstream_at(Ipv4Addr::new(127, 0, 0, 5), h.proxy.port(), None).await;
    let (status, body) = http(&h, &get("a.test", "/")).await;
    assert_eq!((status, body.as_str()), (0, ""));
    assert_eq!(seen.conns.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_sandbox_past_its_share_of_connections_is_closed_and_another_is_served() {
    let (port, seen) = upstream(Ipv4Addr::LOCALHOST, None).await;
    let orig = SocketAddrV4::new(NOWHERE, port);
    let h = harness_with(
        json!({}),
        &[("a.test", Ipv4Addr::LOCALHOST)],
        Arc::new(move |_: &TcpStream| Ok(orig)),
        None,
        4,
    )
    .await;
    // Four idle connections of the first sandbox hold its share (each is served: it waits
    // for its request head).
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(TcpStream::connect(h.proxy).await.unwrap());
    }
    // Its fifth is closed at once, with nothing read.
    let mut fifth = TcpStream::connect(h.proxy).await.unwrap();
    let mut b = [0u8; 1];
    let n = tokio::time::timeout(Duration::from_secs(10), fifth.read(&mut b))
        .await
        .expect("closed at once, not kept waiting")
        .unwrap_or(0);
    assert_eq!(n, 0);
    // Another sandbox's request is served.
    let sock = TcpSocket::new_v4().unwrap();
    sock.bind(SocketAddr::from((OTHER_SANDBOX, 0))).unwrap();
    let mut s = sock.connect(h.proxy).await.unwrap();
    let (status, body) = exchange(&mut s, &get("a.test", "/other")).await;
    assert_eq!(status, 200, "{body}");
    // One idle connection closed: the first sandbox has a place again.
    drop(idle.pop());
    let mut served = false;
    for _ in 0..50 {
        let (status, _) = http(&h, &get("a.test", "/again")).await;
        if status == 200 {
            served = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(served, "a place given back is taken again");
    assert_eq!(seen.requests.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn inspected_requests_are_read_as_the_server_reads_them() {
    let (port, seen) = upstream(Ipv4Addr::LOCALHOST, None).await;
    let h = harness(
        json!({"default": "deny", "allow": ["api.test", "other.test"],
               "http": [{"host": "api.test", "methods": ["GET"], "paths": ["/v1/*"]}],
               "inject": [{"host": "api.test", "secret": "tok"}]}),
        &[
            ("api.test", Ipv4Addr::LOCALHOST),
            ("other.test", Ipv4Addr::LOCALHOST),
        ],
        SocketAddrV4::new(NOWHERE, port),
        None,
    )
    .await;
    for path in [
        "/v1/../admin",
        "/v1/%2e%2e/admin",
        "/v1/..%2fadmin",
        "/v1/x/../../admin",
        "/v1/..;/admin",
    ] {
        let (status, body) = http(&h, &get("api.test", path)).await;
        assert_eq!(status, 403, "{path}: {body}");
        assert_eq!(error_code(&body), "egress_denied", "{path}");
    }
    // A method is upper case; TRACE and TRACK would echo the injected secret.
    for method in ["get", "TRACE", "TRACK"] {
        let req = format!("{method} /v1/x HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n");
        let (status, body) = http(&h, &req).await;
        assert_eq!(status, 403, "{method}: {body}");
    }
    // An absolute URI and a Host that differ: one host decides, the request is refused.
    let two = "GET http://api.test/v1/x HTTP/1.1\r\nHost: other.test\r\nConnection: close\r\n\r\n";
    let (status, body) = http(&h, two).await;
    assert_eq!(status, 403, "{body}");
    let two = "GET http://other.test/x HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n";
    let (status, body) = http(&h, two).await;
    assert_eq!(status, 403, "{body}");
    assert!(
        seen.requests.lock().unwrap().is_empty(),
        "nothing forwarded"
    );
    // Normal requests pass, with the secret.
    let (status, body) = http(&h, &get("api.test", "/v1/models")).await;
    assert_eq!(status, 200, "{body}");
    let same = "GET http://api.test/v1/y HTTP/1.1\r\nHost: api.test\r\nConnection: close\r\n\r\n";
    let (status, body) = http(&h, same).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        seen.requests.lock().unwrap().as_slice(),
        [
            "GET /v1/models auth=s3cret host=api.test",
            "GET /v1/y auth=s3cret host=api.test"
        ]
    );
}

// ---- the CA ----

use rustls::client::danger::ServerCertVerifier;

fn verify_leaf(ca_pem: &str, leaf: &CertificateDer<'_>, host: &str) -> Result<(), rustls::Error> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).unwrap())
        .unwrap();
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
        Arc::new(roots),
        tls::provider(),
    )
    .build()
    .unwrap();
    verifier
        .verify_server_cert(
            leaf,
            &[],
            &ServerName::try_from(host.to_string()).unwrap(),
            &[],
            rustls::pki_types::UnixTime::now(),
        )
        .map(|_| ())
}

#[test]
fn node_ca_is_kept_and_loaded_again() {
    let dir = temp_dir("ca");
    let first = NodeCa::load_or_create(&dir).unwrap();
    let pem = first.cert_pem().to_string();
    let key_file = dir.join("egress-ca.key");
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&key_file).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    assert_eq!(
        std::fs::read_to_string(dir.join("egress-ca.pem")).unwrap(),
        pem
    );
    let leaf = first.leaf("api.test").unwrap();
    verify_leaf(&pem, &leaf.cert[0], "api.test").unwrap();
    assert!(verify_leaf(&pem, &leaf.cert[0], "other.test").is_err());
    assert!(
        Arc::ptr_eq(&leaf, &first.leaf("api.test").unwrap()),
        "kept per host"
    );
    drop(first);

    let again = NodeCa::load_or_create(&dir).unwrap();
    assert_eq!(again.cert_pem(), pem, "the same CA after a restart");
    let leaf = again.leaf("api.test").unwrap();
    verify_leaf(&pem, &leaf.cert[0], "api.test").expect("a leaf of the reloaded CA");

    // Half a CA is an error, not replaced.
    std::fs::remove_file(&key_file).unwrap();
    assert!(matches!(
        NodeCa::load_or_create(&dir),
        Err(EgressError::CaBad { .. })
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn hosts_are_read_without_their_port() {
    assert_eq!(
        Target::parse("Example.COM."),
        Some(Target::Name("example.com".into()))
    );
    assert_eq!(
        Target::parse("[::1]"),
        Some(Target::Ip("::1".parse().unwrap()))
    );
    assert_eq!(
        Target::parse("10.0.0.1"),
        Some(Target::Ip("10.0.0.1".parse().unwrap()))
    );
    assert_eq!(Target::parse("bad host"), None);
}
