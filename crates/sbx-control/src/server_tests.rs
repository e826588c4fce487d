//! The control plane on loopback (SQLite in a temporary folder), with nodes that join it
//! (`join`, against the real server) and fake nodes (small axum servers that answer as a node
//! does) behind its `/v1`: placement, names, a run's name freed as its answer ends, event
//! streams passed on as they come, paging across nodes, an upgraded connection bridged.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::db::{Capacity, Db, NodeReg};
use crate::server::{router, Ctl};

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// A temporary folder, removed when dropped.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let p = std::env::temp_dir().join(format!(
            "sbx-control-srv-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("make a temporary folder");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A control plane serving on `listener`, and its database; the server stops when dropped.
struct Control {
    addr: SocketAddr,
    db: Db,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Control {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn control_on(listener: tokio::net::TcpListener, dir: &TempDir, lease: Duration) -> Control {
    let addr = listener.local_addr().expect("local addr");
    let db = Db::open(&format!("sqlite:{}", dir.0.join("control.db").display()))
        .await
        .expect("open the database");
    let ctl = Arc::new(Ctl::new(db.clone(), lease, None));
    let app = router(ctl).into_make_service_with_connect_info::<SocketAddr>();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Control { addr, db, task }
}

async fn control(dir: &TempDir, lease: Duration) -> Control {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    control_on(l, dir, lease).await
}

type TestClient = Client<HttpConnector, Full<Bytes>>;

fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// An answer read whole: its status, headers and JSON body (Null when it is not JSON).
async fn call(c: &TestClient, method: &str, url: &str, body: Option<Value>) -> (u16, Value) {
    let mut b = hyper::Request::builder().method(method).uri(url);
    if body.is_some() {
        b = b.header(header::CONTENT_TYPE, "application/json");
    }
    let req = b
        .body(Full::new(Bytes::from(
            body.map(|v| v.to_string()).unwrap_or_default(),
        )))
        .expect("a request");
    let resp = c.request(req).await.expect("an answer");
    let status = resp.status().as_u16();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .expect("the body")
        .to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !f().await {
        assert!(Instant::now() < deadline, "{what}: not within {timeout:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn node_named(c: &TestClient, ctl: SocketAddr, name: &str) -> Option<Value> {
    let (_, v) = call(c, "GET", &format!("http://{ctl}/internal/nodes"), None).await;
    v["data"]
        .as_array()?
        .iter()
        .find(|n| n["name"] == name)
        .cloned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_joins_a_control_plane_that_comes_late_and_joins_a_new_one_again() {
    let c = client();
    // The control plane's port, not served yet: the node tries again meanwhile.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let counter = Arc::new(AtomicU64::new(0));
    let n = counter.clone();
    let join = crate::join::start(
        crate::join::JoinConfig {
            control: format!("http://127.0.0.1:{port}"),
            name: "n1".into(),
            url: "http://127.0.0.1:1".into(),
            build: "0123456789abcdef".into(),
            api_key: None,
            e2b_url: Some("http://127.0.0.1:2".into()),
            preview_url: None,
        },
        Arc::new(move || Capacity {
            max_sandboxes: 10,
            sandboxes: n.fetch_add(1, Ordering::SeqCst),
            images: vec!["base".into()],
        }),
    );
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let dir = TempDir::new();
    let first = control_on(
        tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("bind the control plane's port"),
        &dir,
        Duration::from_millis(900),
    )
    .await;
    wait_for("the node joins", Duration::from_secs(5), || async {
        node_named(&c, first.addr, "n1")
            .await
            .is_some_and(|n| n["state"] == "ready")
    })
    .await;
    let joined = node_named(&c, first.addr, "n1").await.unwrap_or_default();
    let id = joined["id"].as_str().unwrap_or("").to_string();
    assert!(id.starts_with("nod-"), "{joined}");
    // Its E2B listener is the table's; its preview listener is off.
    assert_eq!(joined["e2b_url"], "http://127.0.0.1:2", "{joined}");
    assert!(joined["preview_url"].is_null(), "{joined}");
    // Heartbeats every third of the lease, each with the room as it is then.
    let seen = joined["capacity"]["sandboxes"].as_u64().unwrap_or(0);
    wait_for("heartbeats", Duration::from_secs(5), || async {
        node_named(&c, first.addr, "n1")
            .await
            .and_then(|n| n["capacity"]["sandboxes"].as_u64())
            .is_some_and(|s| s >= seen + 3)
    })
    .await;
    assert_eq!(
        node_named(&c, first.addr, "n1").await.unwrap_or_default()["id"],
        id.as_str()
    );
    // A control plane of another database does not know the node: it joins it again.
    drop(first);
    let dir2 = TempDir::new();
    let mut second = None;
    for _ in 0..50 {
        if let Ok(l) = tokio::net::TcpListener::bind(("127.0.0.1", port)).await {
            second = Some(control_on(l, &dir2, Duration::from_millis(900)).await);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let second = second.expect("the port again");
    wait_for("the node joins again", Duration::from_secs(5), || async {
        node_named(&c, second.addr, "n1")
            .await
            .is_some_and(|n| n["state"] == "ready")
    })
    .await;
    // Without heartbeats its lease runs out.
    join.abort();
    wait_for("the node is lost", Duration::from_secs(5), || async {
        node_named(&c, second.addr, "n1")
            .await
            .is_some_and(|n| n["state"] == "lost")
    })
    .await;
    // A heartbeat of an id the table has not: 404, the node's cue to join again.
    let reg = json!({"name": "n1", "url": "http://127.0.0.1:1", "build": "b",
        "capacity": {"max_sandboxes": 1, "sandboxes": 0, "images": []}});
    let (status, v) = call(
        &c,
        "POST",
        &format!(
            "http://{}/internal/nodes/nod-0000000000000000/heartbeat",
            second.addr
        ),
        Some(reg),
    )
    .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (404, Some("not_found")),
        "{v}"
    );
    let bad = json!({"name": "n 1", "url": "ftp://x", "build": "b",
        "capacity": {"max_sandboxes": 1, "sandboxes": 0}});
    let (status, v) = call(
        &c,
        "POST",
        &format!("http://{}/internal/nodes", second.addr),
        Some(bad),
    )
    .await;
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("name")),
        "{v}"
    );
}

/// A fake node: its sandboxes (made by its creates) in order of creation.
#[derive(Default)]
struct FakeNode {
    sandboxes: Mutex<Vec<Value>>,
}

/// A creation time shared by every fake node: later calls, later times.
static CLOCK: AtomicU64 = AtomicU64::new(1);

fn key(v: &Value) -> String {
    format!(
        "{:020}.{}",
        v["seq"].as_u64().unwrap_or(0),
        v["id"].as_str().unwrap_or("")
    )
}

async fn fake_create(State(n): State<Arc<FakeNode>>, body: Bytes) -> Response {
    let v: Value = serde_json::from_slice(&body).unwrap_or(json!({}));
    let name = v["name"].as_str().map(String::from);
    if name.as_deref().is_some_and(|n| n.starts_with("refuse")) {
        return (
            StatusCode::CONFLICT,
            Json(
                json!({"error": {"type": "conflict", "code": "sandbox_failed",
                "message": "refused", "param": null, "retryable": false,
                "request_id": "req-x", "docs_url": null}}),
            ),
        )
            .into_response();
    }
    let seq = CLOCK.fetch_add(1, Ordering::SeqCst);
    let obj = json!({
        "id": sbx_api::ids::new_id("sbx"),
        "object": "sandbox",
        "name": name,
        "status": "running",
        "created_at": format!("2030-01-01T00:{:02}:{:02}.{:03}Z", seq / 60_000, (seq / 1000) % 60, seq % 1000),
        "seq": seq,
    });
    n.sandboxes
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(obj.clone());
    (StatusCode::CREATED, Json(obj)).into_response()
}

async fn fake_list(
    State(n): State<Arc<FakeNode>>,
    Query(q): Query<std::collections::HashMap<String, String>>,
) -> Json<Value> {
    let limit: usize = q.get("limit").and_then(|l| l.parse().ok()).unwrap_or(100);
    let all = n
        .sandboxes
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let after: Vec<Value> = all
        .into_iter()
        .filter(|v| q.get("cursor").is_none_or(|c| key(v) > *c))
        .collect();
    let more = after.len() > limit;
    let page: Vec<Value> = after.into_iter().take(limit).collect();
    let next = if more { page.last().map(key) } else { None };
    Json(json!({"object": "list", "data": page, "has_more": more, "next_cursor": next}))
}

async fn fake_get(State(n): State<Arc<FakeNode>>, Path(id): Path<String>) -> Response {
    let all = n
        .sandboxes
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    match all
        .into_iter()
        .find(|v| v["id"] == id.as_str() || v["name"] == id.as_str())
    {
        Some(v) => Json(v).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

/// A run's events: `start` at once, `exit` after 400 ms.
async fn fake_run() -> Response {
    let events = futures_util::stream::unfold(0u8, |step| async move {
        match step {
            0 => Some((
                Ok::<_, std::io::Error>(Bytes::from_static(b"event: start\nid: 0\ndata: {}\n\n")),
                1,
            )),
            1 => {
                tokio::time::sleep(Duration::from_millis(400)).await;
                Some((
                    Ok(Bytes::from_static(
                        b"event: exit\nid: 1\ndata: {\"exit_code\":0}\n\n",
                    )),
                    2,
                ))
            }
            _ => None,
        }
    });
    (
        [(header::CONTENT_TYPE, "text/event-stream")],
        Body::from_stream(events),
    )
        .into_response()
}

/// Switches to the protocol `echo`: what comes is sent back.
async fn fake_echo(mut req: Request) -> Response {
    let Some(on) = req.extensions_mut().remove::<hyper::upgrade::OnUpgrade>() else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    tokio::spawn(async move {
        if let Ok(up) = on.await {
            let mut io = TokioIo::new(up);
            let mut buf = [0u8; 64];
            while let Ok(n) = io.read(&mut buf).await {
                if n == 0 || io.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        }
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::CONNECTION, "upgrade")
        .header(header::UPGRADE, "echo")
        .body(Body::empty())
        .unwrap_or_default()
}

async fn fake_node() -> (SocketAddr, Arc<FakeNode>, tokio::task::JoinHandle<()>) {
    let n = Arc::new(FakeNode::default());
    let app = Router::new()
        .route("/v1/sandboxes", post(fake_create).get(fake_list))
        .route("/v1/sandboxes/{id}", get(fake_get))
        .route("/v1/sandboxes/{id}/echo", get(fake_echo))
        .route("/v1/run", post(fake_run))
        .with_state(n.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    (addr, n, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleets_v1_over_fake_nodes() {
    let dir = TempDir::new();
    let ctl = control(&dir, Duration::from_secs(30)).await;
    let (a_addr, _a, a_task) = fake_node().await;
    let (b_addr, _b, b_task) = fake_node().await;
    for (name, addr) in [("a", a_addr), ("b", b_addr)] {
        let reg = NodeReg {
            name: name.into(),
            url: format!("http://{addr}"),
            build: "0123456789abcdef".into(),
            capacity: Capacity {
                max_sandboxes: 100,
                sandboxes: 0,
                images: vec![],
            },
            e2b_url: None,
            preview_url: None,
            held: Vec::new(),
        };
        ctl.db
            .register_node(&reg, 30_000)
            .await
            .expect("register a fake node");
    }
    let c = client();
    let url = |p: &str| format!("http://{}{p}", ctl.addr);

    // Creates spread over both nodes, and every one is listed once across pages of 2.
    let mut made = BTreeSet::new();
    let mut on = BTreeSet::new();
    for _ in 0..7 {
        let (s, v) = call(&c, "POST", &url("/v1/sandboxes"), Some(json!({}))).await;
        assert_eq!(s, 201, "{v}");
        assert_eq!(v["epoch"], 1, "{v}");
        on.insert(v["node"]["name"].as_str().unwrap_or("").to_string());
        made.insert(v["id"].as_str().unwrap_or("").to_string());
    }
    assert_eq!(on.len(), 2, "both nodes");
    let mut seen = Vec::new();
    let mut times = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..10 {
        let q = match &cursor {
            Some(cur) => format!("/v1/sandboxes?limit=2&cursor={cur}"),
            None => "/v1/sandboxes?limit=2".to_string(),
        };
        let (s, v) = call(&c, "GET", &url(&q), None).await;
        assert_eq!(s, 200, "{v}");
        for o in v["data"].as_array().into_iter().flatten() {
            seen.push(o["id"].as_str().unwrap_or("").to_string());
            times.push(o["created_at"].as_str().unwrap_or("").to_string());
            assert!(o["node"]["id"].as_str().is_some(), "{o}");
        }
        cursor = v["next_cursor"].as_str().map(String::from);
        if cursor.is_none() {
            break;
        }
    }
    assert_eq!(seen.len(), 7, "{seen:?}");
    assert_eq!(seen.iter().cloned().collect::<BTreeSet<_>>(), made);
    let mut sorted = times.clone();
    sorted.sort();
    assert_eq!(times, sorted, "in creation order across nodes");

    // A name refused by its node is free again; a name the fleet has is refused before any
    // node is asked.
    let (s, v) = call(
        &c,
        "POST",
        &url("/v1/sandboxes"),
        Some(json!({"name": "refuse-me"})),
    )
    .await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (409, Some("sandbox_failed")),
        "{v}"
    );
    assert!(ctl
        .db
        .sandbox_by_name("refuse-me")
        .await
        .expect("db")
        .is_none());
    let (s, v) = call(
        &c,
        "POST",
        &url("/v1/sandboxes"),
        Some(json!({"name": "web"})),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let (s, v) = call(
        &c,
        "POST",
        &url("/v1/sandboxes"),
        Some(json!({"name": "web"})),
    )
    .await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (409, Some("name_taken")),
        "{v}"
    );
    let (s, v) = call(&c, "GET", &url("/v1/sandboxes/web"), None).await;
    assert_eq!((s, v["name"].as_str()), (200, Some("web")), "{v}");

    // A run's events pass as they come; its name is held while it runs and free as soon as
    // its last event is read.
    let req = hyper::Request::post(url("/v1/run"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(
            json!({"command": "x", "name": "job"}).to_string(),
        )))
        .expect("a request");
    let t0 = Instant::now();
    let resp = c.request(req).await.expect("the run's answer");
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let first = body
        .frame()
        .await
        .and_then(|f| f.ok())
        .and_then(|f| f.into_data().ok())
        .expect("the first event");
    assert!(first.starts_with(b"event: start"), "{first:?}");
    assert!(
        t0.elapsed() < Duration::from_millis(350),
        "the first event was held back ({:?})",
        t0.elapsed()
    );
    let (s, v) = call(
        &c,
        "POST",
        &url("/v1/sandboxes"),
        Some(json!({"name": "job"})),
    )
    .await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (409, Some("name_taken")),
        "{v}"
    );
    let mut rest = Vec::new();
    while let Some(f) = body.frame().await {
        if let Ok(d) = f.expect("a frame").into_data() {
            rest.extend_from_slice(&d);
        }
    }
    assert!(
        rest.starts_with(b"event: exit"),
        "{:?}",
        String::from_utf8_lossy(&rest)
    );
    let (s, v) = call(
        &c,
        "POST",
        &url("/v1/sandboxes"),
        Some(json!({"name": "job"})),
    )
    .await;
    assert_eq!(s, 201, "the run's name is free once it is over: {v}");

    // A sandbox the table does not have, and a route the fleet does not serve.
    let (s, v) = call(&c, "GET", &url("/v1/sandboxes/nothing"), None).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (404, Some("sandbox_not_found")),
        "{v}"
    );
    let (s, v) = call(&c, "GET", &url("/v1/images"), None).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (503, Some("not_served_here")),
        "{v}"
    );

    // An upgraded connection is bridged both ways.
    let id = made.iter().next().cloned().unwrap_or_default();
    let mut tcp = tokio::net::TcpStream::connect(ctl.addr)
        .await
        .expect("connect");
    tcp.write_all(
        format!(
            "GET /v1/sandboxes/{id}/echo HTTP/1.1\r\nHost: {}\r\nConnection: upgrade\r\n\
             Upgrade: echo\r\n\r\n",
            ctl.addr
        )
        .as_bytes(),
    )
    .await
    .expect("write");
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut b = [0u8; 1];
        assert_eq!(tcp.read(&mut b).await.expect("read"), 1, "{head:?}");
        head.push(b[0]);
    }
    let head = String::from_utf8_lossy(&head).to_string();
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    tcp.write_all(b"ping-pong").await.expect("write");
    let mut back = [0u8; 9];
    tokio::time::timeout(Duration::from_secs(5), tcp.read_exact(&mut back))
        .await
        .expect("the echo in time")
        .expect("read");
    assert_eq!(&back, b"ping-pong");

    // A node that does not answer: 503, retryable.
    let away = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let c_node = ctl
        .db
        .register_node(
            &NodeReg {
                name: "c".into(),
                url: format!("http://{away}"),
                build: "0123456789abcdef".into(),
                capacity: Capacity::default(),
                e2b_url: None,
                preview_url: None,
                held: Vec::new(),
            },
            30_000,
        )
        .await
        .expect("register");
    ctl.db
        .insert_sandbox(&crate::db::SandboxRow {
            id: "sbx-cccccccccccccccc".into(),
            name: None,
            node_id: c_node.id.clone(),
            epoch: 1,
            status: "running".into(),
            build: "0123456789abcdef".into(),
            created_at_ms: 0,
            updated_at_ms: 0,
        })
        .await
        .expect("a row");
    let (s, v) = call(&c, "GET", &url("/v1/sandboxes/sbx-cccccccccccccccc"), None).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (503, Some("unavailable")),
        "{v}"
    );
    assert_eq!(v["error"]["retryable"], true, "{v}");
    a_task.abort();
    b_task.abort();
}
