//! The control plane's E2B and preview listeners in-process, over fake nodes (axum servers on
//! loopback that answer as a node's E2B and preview listeners would, and say who they are):
//! creates placed and recorded, a sandbox's requests routed by the table with their headers
//! and bodies as sent, a call the old node refused after the table moved on routed again,
//! lists merged, a lost node's sandbox 503 with `Retry-After`, preview hosts kept, a DELETE
//! removing the row.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use serde_json::{json, Value};

use crate::db::{Db, NodeReg, NodeRow, SandboxRow};
use crate::server::{read_limited, Ctl};

struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let p = std::env::temp_dir().join(format!(
            "sbx-control-e2b-{}-{}",
            std::process::id(),
            sbx_api::ids::new_id("t")
        ));
        std::fs::create_dir_all(&p).expect("make a temporary folder");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fake node's E2B and preview listener (one server for both): it answers who it is and
/// what it was sent. Node `a` releases `sbx-moving` to `b` (the table's owner changed) and
/// answers E2B's 409 when it is asked for it.
async fn fake(name: &'static str, db: Db, b_id: Arc<std::sync::Mutex<String>>) -> SocketAddr {
    let app = Router::new().fallback(move |req: Request| {
        let db = db.clone();
        let b_id = b_id.clone();
        async move { fake_answer(name, &db, &b_id, req).await }
    });
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a fake node");
    let addr = l.local_addr().expect("its address");
    tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    addr
}

async fn fake_answer(
    name: &str,
    db: &Db,
    b_id: &std::sync::Mutex<String>,
    req: Request,
) -> Response {
    let (host, sandbox, key, token) = {
        let h = |k: &str| {
            req.headers()
                .get(k)
                .and_then(|v| v.to_str().ok())
                .map(String::from)
        };
        (
            h("host"),
            h("e2b-sandbox-id"),
            h("x-api-key"),
            h("x-access-token"),
        )
    };
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let body = read_limited(req.into_body(), 1 << 20)
        .await
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    let moving = sandbox.as_deref() == Some("sbx-moving") || path.contains("sbx-moving");
    if name == "a" && moving {
        let to = b_id.lock().map(|g| g.clone()).unwrap_or_default();
        let moved = db.move_owner("sbx-moving", 1, &to, 2).await;
        assert!(matches!(moved, Ok(true)), "{moved:?}");
        return (
            StatusCode::CONFLICT,
            axum::Json(json!({"code": 409, "message": "sandbox sbx-moving moved (moved)"})),
        )
            .into_response();
    }
    match (method.as_str(), path.as_str()) {
        ("POST", "/sandboxes") => (
            StatusCode::CREATED,
            axum::Json(json!({
                "sandboxID": format!("sbx-made-on-{name}"),
                "domain": format!("{name}.node:7780"),
                "envdAccessToken": "sbt_x",
            })),
        )
            .into_response(),
        ("GET", "/sandboxes") => axum::Json(json!([
            {"sandboxID": format!("sbx-{name}-2"), "startedAt": format!("2026-01-01T00:00:0{}Z", if name == "a" { 3 } else { 2 }), "state": "running"},
            {"sandboxID": format!("sbx-{name}-1"), "startedAt": format!("2026-01-01T00:00:0{}Z", if name == "a" { 1 } else { 4 }), "state": "paused"},
        ]))
        .into_response(),
        ("DELETE", _) => StatusCode::NO_CONTENT.into_response(),
        _ => axum::Json(json!({
            "sandboxID": sandbox.clone().unwrap_or_default(),
            "domain": format!("{name}.node:7780"),
            "node": name,
            "method": method.as_str(),
            "path": path,
            "host": host,
            "sandbox": sandbox,
            "key": key,
            "token": token,
            "body": body,
        }))
        .into_response(),
    }
}

fn reg(name: &str, at: SocketAddr) -> NodeReg {
    serde_json::from_value(json!({
        "name": name,
        "url": format!("http://{at}"),
        "build": "b1",
        "capacity": {"max_sandboxes": 10, "sandboxes": 0, "images": []},
        "e2b_url": format!("http://{at}"),
        "preview_url": format!("http://{at}"),
    }))
    .expect("a registration")
}

fn row(id: &str, node: &NodeRow) -> SandboxRow {
    SandboxRow {
        id: id.into(),
        name: None,
        node_id: node.id.clone(),
        epoch: 1,
        status: "running".into(),
        build: "b1".into(),
        created_at_ms: 0,
        updated_at_ms: 0,
    }
}

/// One request: the status, headers and body (JSON, or Null).
async fn send(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, HeaderMap, Value) {
    let mut b = axum::http::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = b.body(Body::from(body.to_string())).expect("a request");
    let resp = crate::proxy::client()
        .request(req)
        .await
        .expect("an answer");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let bytes = read_limited(Body::new(resp.into_body()), 1 << 20)
        .await
        .unwrap_or_default();
    (
        status,
        headers,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

#[tokio::test]
async fn e2b_and_preview_requests_go_where_the_table_says() {
    let dir = TempDir::new();
    let db = Db::open(&format!("sqlite:{}", dir.0.join("control.db").display()))
        .await
        .expect("open the database");
    let b_id = Arc::new(std::sync::Mutex::new(String::new()));
    let fa = fake("a", db.clone(), b_id.clone()).await;
    let fb = fake("b", db.clone(), b_id.clone()).await;
    let fc = fake("c", db.clone(), b_id.clone()).await;
    let a = db.register_node(&reg("a", fa), 60_000).await.expect("a");
    let b = db.register_node(&reg("b", fb), 60_000).await.expect("b");
    // Node c's lease runs out at once: it is lost.
    let c = db.register_node(&reg("c", fc), 1).await.expect("c");
    if let Ok(mut g) = b_id.lock() {
        *g = b.id.clone();
    }
    for (id, n) in [("sbx-s1", &a), ("sbx-moving", &a), ("sbx-lost", &c)] {
        db.insert_sandbox(&row(id, n)).await.expect("a row");
    }
    let ctl = Arc::new(Ctl::new(db.clone(), Duration::from_secs(60), None));
    let bind = || async {
        tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind")
    };
    let (le, lp) = (bind().await, bind().await);
    let (e2b, pv) = (
        le.local_addr().expect("addr"),
        lp.local_addr().expect("addr"),
    );
    let t1 = crate::e2b::spawn(le, ctl.clone(), json!("localhost:7791"));
    let t2 = crate::preview::spawn(lp, ctl.clone(), "localhost".into());
    tokio::time::sleep(Duration::from_millis(20)).await;
    let base = format!("http://{e2b}");

    // A create is placed (a or b: the lost c takes nothing), recorded at epoch 1, and its
    // domain is the control plane's preview listener's.
    let (s, _, v) = send(
        "POST",
        &format!("{base}/sandboxes"),
        &[("x-api-key", "k")],
        "{}",
    )
    .await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["domain"], "localhost:7791", "{v}");
    let made = v["sandboxID"].as_str().unwrap_or_default().to_string();
    let r = db.sandbox(&made).await.expect("read").expect("its row");
    assert_eq!(r.epoch, 1);
    let on = if made == "sbx-made-on-a" { &a } else { &b };
    assert_eq!(r.node_id, on.id, "{made}");

    // envd's side: to the sandbox's node, its headers and body as sent.
    let (s, _, v) = send(
        "POST",
        &format!("{base}/process.Process/Start"),
        &[("e2b-sandbox-id", "sbx-s1"), ("x-access-token", "sbt_tok")],
        "{\"cmd\":\"ls\"}",
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["node"], "a", "{v}");
    assert_eq!(v["sandbox"], "sbx-s1", "{v}");
    assert_eq!(v["token"], "sbt_tok", "{v}");
    assert_eq!(v["path"], "/process.Process/Start", "{v}");
    assert_eq!(v["body"], "{\"cmd\":\"ls\"}", "{v}");

    // Released by a while the call went there (the table names b at epoch 2 now): routed to b.
    let (s, _, v) = send(
        "POST",
        &format!("{base}/filesystem.Filesystem/Stat"),
        &[("e2b-sandbox-id", "sbx-moving")],
        "{}",
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["node"], "b", "{v}");
    // E2B's control plane route of the same sandbox now goes to b at once; the domain is the
    // control plane's.
    let (s, _, v) = send("GET", &format!("{base}/sandboxes/sbx-moving"), &[], "").await;
    assert_eq!((s, v["node"].as_str()), (200, Some("b")), "{v}");
    assert_eq!(v["domain"], "localhost:7791", "{v}");

    // A lost node's sandbox: 503, E2B's body, Retry-After.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let (s, h, v) = send("GET", &format!("{base}/sandboxes/sbx-lost"), &[], "").await;
    assert_eq!(s, 503, "{v}");
    assert_eq!(v["code"], 503, "{v}");
    assert_eq!(
        h.get("retry-after").and_then(|v| v.to_str().ok()),
        Some("1")
    );
    // A sandbox nobody has.
    let (s, _, v) = send(
        "GET",
        &format!("{base}/files"),
        &[("e2b-sandbox-id", "sbx-none")],
        "",
    )
    .await;
    assert_eq!((s, v["code"].as_u64()), (404, Some(404)), "{v}");

    // The list: the live nodes' (c's missing), in start order; /v2 pages across them.
    let (s, _, v) = send("GET", &format!("{base}/sandboxes"), &[], "").await;
    assert_eq!(s, 200, "{v}");
    let ids = |v: &Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s["sandboxID"].as_str().map(String::from))
            .collect()
    };
    assert_eq!(ids(&v), ["sbx-a-1", "sbx-b-2", "sbx-a-2", "sbx-b-1"], "{v}");
    let (s, h, v) = send(
        "GET",
        &format!("{base}/v2/sandboxes?state=running&limit=1"),
        &[],
        "",
    )
    .await;
    assert_eq!((s, ids(&v)), (200, vec!["sbx-b-2".to_string()]), "{v}");
    let next = h
        .get("x-next-token")
        .and_then(|v| v.to_str().ok())
        .expect("a next page")
        .to_string();
    let (_, h, v) = send(
        "GET",
        &format!("{base}/v2/sandboxes?state=running&limit=1&nextToken={next}"),
        &[],
        "",
    )
    .await;
    assert_eq!(ids(&v), ["sbx-a-2"], "{v}");
    assert!(h.get("x-next-token").is_none());
    let (s, _, v) = send("GET", &format!("{base}/v2/sandboxes?nextToken=zz"), &[], "").await;
    assert_eq!(s, 400, "{v}");

    // A page of another site is refused.
    let (s, _, v) = send(
        "GET",
        &format!("{base}/sandboxes"),
        &[("origin", "http://evil.example")],
        "",
    )
    .await;
    assert_eq!(s, 403, "{v}");

    // Preview: the Host kept for the node.
    let host = "8000-sbx-s1.localhost:7791";
    let (s, _, v) = send("GET", &format!("http://{pv}/x"), &[("host", host)], "").await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        (v["node"].as_str(), v["host"].as_str()),
        (Some("a"), Some(host)),
        "{v}"
    );
    let (s, _, v) = send(
        "GET",
        &format!("http://{pv}/"),
        &[("host", "localhost")],
        "",
    )
    .await;
    assert_eq!(s, 404, "{v}");
    assert_eq!(v["error"]["code"], "not_found", "{v}");
    assert_eq!(v["error"]["param"], "Host", "{v}");
    let (s, h, v) = send(
        "GET",
        &format!("http://{pv}/"),
        &[("host", "8000-sbx-lost.localhost")],
        "",
    )
    .await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (503, Some("unavailable")),
        "{v}"
    );
    assert_eq!(
        h.get("retry-after").and_then(|v| v.to_str().ok()),
        Some("1")
    );

    // E2B's kill: the node's 204, the row gone.
    let (s, _, _) = send("DELETE", &format!("{base}/sandboxes/sbx-s1"), &[], "").await;
    assert_eq!(s, 204);
    assert!(db.sandbox("sbx-s1").await.expect("read").is_none());
    t1.abort();
    t2.abort();
}
