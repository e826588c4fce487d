//! Idempotency-Key, which lives in the HTTP layer (`http::sandboxes::idempotent`) over the
//! store's records: requests through the node's router, on the fake driver.

use axum::http::StatusCode;
use serde_json::Value;

use sbx_node::node::fake::{create, until};

use crate::wire_tests::{Flags, Wire};

/// One request from a loopback caller, with `Idempotency-Key: key` when given: its status and
/// JSON body.
async fn call(
    w: &Wire,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: &str,
) -> (StatusCode, Value) {
    let mut c = w.call(method, path).json_bytes(body.as_bytes());
    if let Some(k) = key {
        c = c.header("idempotency-key", k);
    }
    let a = c.send().await;
    (
        a.status,
        serde_json::from_slice(&a.body).unwrap_or(Value::Null),
    )
}

fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_retried_with_its_key_makes_one_sandbox() {
    let w = Wire::start_with("idemcreate", Flags::default(), |c| c.max_sandboxes = 2);
    let (world, node, app) = (&w.world, &w.node, &w);
    let body = r#"{"metadata":{"try":"1"}}"#;
    let (s1, first) = call(app, "POST", "/v1/sandboxes", Some("k-1"), body).await;
    assert_eq!(s1, StatusCode::CREATED, "{first}");
    let (s2, again) = call(app, "POST", "/v1/sandboxes", Some("k-1"), body).await;
    assert_eq!(s2, StatusCode::CREATED);
    assert_eq!(again["id"], first["id"], "the first answer, replayed");
    assert_eq!(world.creates(), 1);
    assert_eq!(
        node.list_sandboxes(&sbx_node::node::sandbox::ListQuery {
            limit: 100,
            ..Default::default()
        })
        .0
        .len(),
        1
    );

    let (s, v) = call(app, "POST", "/v1/sandboxes", Some("k-1"), "{}").await;
    assert_eq!(
        (s, code(&v)),
        (StatusCode::CONFLICT, "idempotency_key_reused")
    );

    // A refusal worth retrying is not kept: the retry runs again.
    call(app, "POST", "/v1/sandboxes", None, "{}").await;
    let (s, v) = call(app, "POST", "/v1/sandboxes", Some("k-2"), "{}").await;
    assert_eq!(code(&v), "no_capacity", "{s} {v}");
    let id = first["id"].as_str().expect("an id");
    node.delete_sandbox(id).await.expect("delete");
    let (s, v) = call(app, "POST", "/v1/sandboxes", Some("k-2"), "{}").await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(world.creates(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exec_retried_with_its_key_runs_one_command() {
    let w = std::sync::Arc::new(Wire::start("idemexec"));
    let (world, node, app) = (&w.world, &w.node, &w);
    let s = create(node, r#"{"name":"x"}"#).await.expect("create");
    let body = r#"{"command":"await go","wait_seconds":5}"#;
    let first = {
        let w = w.clone();
        tokio::spawn(
            async move { call(&w, "POST", "/v1/sandboxes/x/exec", Some("e-1"), body).await },
        )
    };
    until("the first command runs", || node.running_execs(&s.id) == 1).await;
    // By its id or its name, the sandbox is one scope.
    let path = format!("/v1/sandboxes/{}/exec", s.id);
    let (st, v) = call(app, "POST", &path, Some("e-1"), body).await;
    assert_eq!(
        (st, code(&v)),
        (StatusCode::CONFLICT, "idempotency_in_progress")
    );
    world.open_gate("go");
    let (st, done) = first.await.expect("the first request");
    assert_eq!(st, StatusCode::CREATED, "{done}");
    assert_eq!(done["status"], "exited");
    let (st, again) = call(app, "POST", &path, Some("e-1"), body).await;
    assert_eq!(st, StatusCode::CREATED);
    assert_eq!(again["id"], done["id"], "replayed");
    assert_eq!(
        node.exec_list(&s.id).await.expect("commands").len(),
        1,
        "one command ran"
    );
    // Another key is another command.
    let (st, other) = call(app, "POST", &path, Some("e-2"), body).await;
    assert_eq!(st, StatusCode::CREATED);
    assert_ne!(other["id"], done["id"]);
}
