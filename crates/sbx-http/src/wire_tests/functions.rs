//! The functions interface's refusals (`POST /v1/functions/{function_id}`): payloads that are
//! not what a function takes (S001), sandboxes and functions that are not there (S002, S304),
//! an image of no catalog (S100), more memory than the node has (S400), a sandbox stopped
//! (S004), each in the interface's one error shape. The interface's config is the default one here (it is the process's, set once), so
//! what depends on a config file (allowlist, custom images, caps, docs base) and what runs
//! real commands or files is in `crates/sandboxd/tests/it/functions.rs`.

use serde_json::{json, Value};

use super::Wire;

/// POST /v1/functions/{f}: (status, body).
async fn call(w: &Wire, f: &str, payload: &Value) -> (u16, Value) {
    let a = w.post_json(&format!("/v1/functions/{f}"), payload).await;
    (a.status.as_u16(), a.json())
}

async fn ok(w: &Wire, f: &str, payload: Value) -> Value {
    let (s, v) = call(w, f, &payload).await;
    assert_eq!(s, 200, "{f} {payload}: {v}");
    v
}

/// Checks the one error shape of a failed call: the S-code's type, retryable, status and
/// docs_url (the default docs base and the code).
fn assert_fails(status: u16, v: &Value, code: &str) {
    let e = &v["error"];
    assert_eq!(e["code"], code, "{v}");
    let entry = sbx_api::s_code(code).unwrap_or_else(|| panic!("no S-code {code}"));
    let mut keys: Vec<&str> = e
        .as_object()
        .unwrap_or_else(|| panic!("no error object: {v}"))
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    assert_eq!(keys, ["code", "docs_url", "message", "retryable", "type"]);
    assert_eq!(e["type"], entry.kind, "{v}");
    assert_eq!(e["retryable"], entry.retryable, "{v}");
    assert_eq!(
        e["docs_url"],
        format!("{}{code}", sbx_api::functions::DEFAULT_DOCS_BASE),
        "{v}"
    );
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert_eq!(status, sbx_api::functions::kind_status(entry.kind), "{v}");
}

async fn fails(w: &Wire, f: &str, payload: Value, code: &str) -> Value {
    let (s, v) = call(w, f, &payload).await;
    assert_fails(s, &v, code);
    v
}

/// `sandbox::create` of a python sandbox (the base image on this node): its id.
async fn create(w: &Wire) -> String {
    let v = ok(w, "sandbox::create", json!({"image": "python"})).await;
    assert_eq!(v["image"], "python");
    v["sandbox_id"].as_str().expect("an id").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_a_function_does_not_take_are_s001() {
    let w = Wire::start("fnpayload");
    fails(&w, "sandbox::create", json!({}), "S001").await;
    fails(&w, "sandbox::exec", json!({"cmd": "true"}), "S001").await;
    fails(
        &w,
        "sandbox::run",
        json!({"image": "python", "lang": "ruby", "code": "1"}),
        "S001",
    )
    .await;
    fails(
        &w,
        "sandbox::create",
        json!({"image": "python", "bogus": 1}),
        "S001",
    )
    .await;
    let a = w.post("/v1/functions/sandbox::list", b"[1,2]").await;
    assert_fails(a.status.as_u16(), &a.json(), "S001");
    fails(&w, "sandbox::fs::ls", json!({"path": "/"}), "S001").await;
    w.assert_clean(false).await;

    // What a sandbox's calls refuse before they run anything.
    let sb = create(&w).await;
    fails(&w, "sandbox::exec", json!({"sandbox_id": sb}), "S001").await;
    fails(
        &w,
        "sandbox::exec",
        json!({"sandbox_id": sb, "cmd": "true", "env": {"A=B": "1"}}),
        "S001",
    )
    .await;
    fails(
        &w,
        "sandbox::fs::write",
        json!({"sandbox_id": sb, "path": "/work/x"}),
        "S001",
    )
    .await;
    fails(
        &w,
        "sandbox::fs::write",
        json!({"sandbox_id": sb, "path": "/work/x", "content": "a", "content_b64": "YQ=="}),
        "S001",
    )
    .await;
    assert!(
        w.node
            .exec_list(&sb)
            .await
            .expect("its commands")
            .is_empty(),
        "a refused call ran a command"
    );
    ok(&w, "sandbox::stop", json!({"sandbox_id": sb})).await;
    w.assert_clean(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_is_not_there_or_more_than_the_node_has_is_refused() {
    let w = Wire::start("fnmissing");
    fails(
        &w,
        "sandbox::exec",
        json!({"sandbox_id": "sbx-0000000000000000", "cmd": "true"}),
        "S002",
    )
    .await;
    fails(&w, "sandbox::stop", json!({"sandbox_id": "nope"}), "S002").await;
    fails(
        &w,
        "sandbox::fs::ls",
        json!({"sandbox_id": "sbx-0000000000000000", "path": "/"}),
        "S002",
    )
    .await;
    fails(
        &w,
        "sandbox::run",
        json!({"image": "ruby", "lang": "shell", "code": "true"}),
        "S100",
    )
    .await;
    fails(&w, "sandbox::nope", json!({}), "S304").await;
    fails(
        &w,
        "sandbox::create",
        json!({"image": "python", "memory_mb": 1u64 << 30}),
        "S400",
    )
    .await;
    w.assert_clean(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_sandbox_is_s004() {
    let w = Wire::start("fnstopped");
    let sb = create(&w).await;
    let v = ok(&w, "sandbox::stop", json!({"sandbox_id": sb})).await;
    assert_eq!(v["stopped"], true);
    fails(
        &w,
        "sandbox::exec",
        json!({"sandbox_id": sb, "cmd": "true"}),
        "S004",
    )
    .await;
    fails(
        &w,
        "sandbox::fs::ls",
        json!({"sandbox_id": sb, "path": "/"}),
        "S004",
    )
    .await;
    fails(&w, "sandbox::stop", json!({"sandbox_id": sb}), "S004").await;
    // stop wait=false answers at once; the sandbox ends meanwhile.
    let sb2 = create(&w).await;
    ok(
        &w,
        "sandbox::stop",
        json!({"sandbox_id": sb2, "wait": false}),
    )
    .await;
    fails(
        &w,
        "sandbox::exec",
        json!({"sandbox_id": sb2, "cmd": "true"}),
        "S004",
    )
    .await;
    w.assert_clean(true).await;
}
