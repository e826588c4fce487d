//! Requests the node refuses: each with its status, its code, the field at fault, and the one
//! error body of the API. Nothing of a refused request is made. (What needs a real sandbox to
//! be refused, a user the image lacks or a volume of a node's disk, is in
//! `crates/sandboxd/tests/it/bad_input.rs`.)

use serde_json::{json, Value};

use super::{Flags, Wire};

/// Sends `body` (raw bytes, `Content-Type: application/json`) to `/v1/run` with `headers`
/// and checks the error answer, also its request id.
async fn refused(
    w: &Wire,
    body: &[u8],
    headers: &[(&str, &str)],
    status: u16,
    code: &str,
    param: Option<&str>,
) -> Value {
    let rid = format!("bad-input.{code}");
    let mut call = w.call("POST", "/v1/run").json_bytes(body);
    for (k, v) in headers {
        call = call.header(k, v);
    }
    let a = call.header("X-Request-Id", &rid).send().await;
    let v = a.assert_error(status, code, param);
    assert_eq!(v["error"]["request_id"], rid.as_str(), "{v}");
    assert_eq!(a.header("x-request-id"), Some(rid.as_str()));
    assert_eq!(v["error"]["retryable"], false, "{v}");
    assert!(
        a.header("content-type")
            .is_some_and(|c| c.starts_with("application/json")),
        "{:?}",
        a.headers
    );
    v
}

async fn refused_json(w: &Wire, body: Value, status: u16, code: &str, param: Option<&str>) {
    refused(w, body.to_string().as_bytes(), &[], status, code, param).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_requests_are_400_with_the_field_at_fault() {
    let w = Wire::start("badinput");
    refused(&w, b"not json", &[], 400, "invalid_json", None).await;
    refused(&w, b"[1, 2]", &[], 400, "invalid_json", None).await;
    refused(&w, b"", &[], 400, "invalid_json", None).await;
    let cases = [
        (
            json!({ "command": "true", "bogus": 1 }),
            "unknown_field",
            "bogus",
        ),
        (
            json!({ "command": "true", "limits": { "memory_bytes": 134217728, "gpus": 1 } }),
            "unknown_field",
            "limits.gpus",
        ),
        (
            json!({ "command": "true", "timeout_seconds": -1 }),
            "invalid_field",
            "timeout_seconds",
        ),
        (
            json!({ "command": "true", "timeout_seconds": "10" }),
            "invalid_field",
            "timeout_seconds",
        ),
        (
            json!({ "command": "true", "limits": { "memory_bytes": 134217729 } }),
            "invalid_field",
            "limits.memory_bytes",
        ),
        (
            json!({ "command": "true", "limits": { "memory_bytes": 1 << 20 } }),
            "invalid_field",
            "limits.memory_bytes",
        ),
        (
            json!({ "command": "true", "limits": { "vcpus": 64 } }),
            "invalid_field",
            "limits.vcpus",
        ),
        (
            json!({ "command": "true", "limits": { "disk_bytes": 1 << 30 } }),
            "invalid_field",
            "limits.disk_bytes",
        ),
        (json!({ "command": 42 }), "invalid_field", "command"),
        (json!({ "command": [] }), "invalid_field", "command"),
        (
            json!({ "command": "true", "cwd": "relative" }),
            "invalid_field",
            "cwd",
        ),
        (
            json!({ "command": "true", "hostname": "Not_A_Host" }),
            "invalid_field",
            "hostname",
        ),
        (
            json!({ "command": "true", "encoding": "hex" }),
            "invalid_field",
            "encoding",
        ),
        (
            json!({ "command": "true", "encoding": "base64", "stdin": "not base64!" }),
            "invalid_field",
            "stdin",
        ),
        (
            json!({ "command": "true", "expires_at": "2000-01-01T00:00:00Z" }),
            "expires_in_the_past",
            "expires_at",
        ),
        (
            json!({ "command": "true", "name": "Bad_Name" }),
            "invalid_name",
            "name",
        ),
        (
            json!({ "command": "true", "name": "sbx-mine" }),
            "invalid_name",
            "name",
        ),
        (
            json!({ "command": "true", "name": "-x" }),
            "invalid_name",
            "name",
        ),
        (
            json!({ "command": "true", "env": { "A=B": "x" } }),
            "invalid_env",
            "env.A=B",
        ),
        (
            json!({ "command": "true", "env": { "N": 1 } }),
            "invalid_env",
            "env.N",
        ),
        (
            json!({ "command": "true", "metadata": { "k": "v".repeat(1025) } }),
            "invalid_metadata",
            "metadata.k",
        ),
        (
            json!({ "command": "true", "image": "python", "template": "base" }),
            "ambiguous_source",
            "template",
        ),
        (json!({}), "missing_command", "command"),
        (json!({ "command": null }), "missing_command", "command"),
        (
            json!({ "command": "true", "image": "has space" }),
            "invalid_image",
            "image",
        ),
        (
            json!({ "command": "true", "image": "" }),
            "invalid_image",
            "image",
        ),
    ];
    for (body, code, param) in cases {
        refused_json(&w, body, 400, code, Some(param)).await;
    }
    let key = "k".repeat(300);
    refused(
        &w,
        br#"{"command":"true"}"#,
        &[("Idempotency-Key", key.as_str())],
        400,
        "invalid_idempotency_key",
        Some("Idempotency-Key"),
    )
    .await;
    w.assert_clean(false).await;
    // The node still runs commands, and a valid Idempotency-Key is taken.
    let a = w
        .call("POST", "/v1/run")
        .json_bytes(br#"{"command":"echo fine"}"#)
        .header("Idempotency-Key", &"k".repeat(255))
        .send()
        .await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.json()["stdout"], "fine\n");
    w.stop().await;
    w.assert_clean(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_beyond_the_node_are_refused() {
    // The node's limits as `main` sets them: the host's CPUs (at most 32).
    fn host_cpus() -> u32 {
        std::thread::available_parallelism()
            .map_or(1, |n| u32::try_from(n.get()).unwrap_or(32))
            .min(32)
    }
    let w = Wire::start_with("limits", Flags::default(), |c| c.max_vcpus = host_cpus());
    let cpus = host_cpus();
    if cpus < 32 {
        refused_json(
            &w,
            json!({ "command": "true", "limits": { "vcpus": cpus + 1 } }),
            400,
            "invalid_field",
            Some("limits.vcpus"),
        )
        .await;
    }
    // 64 TiB: an even number of MiB, more than this node has.
    refused_json(
        &w,
        json!({ "command": "true", "limits": { "memory_bytes": 1u64 << 46 } }),
        400,
        "invalid_field",
        Some("limits.memory_bytes"),
    )
    .await;
    w.assert_clean(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_routes_and_methods() {
    let w = Wire::start("routes");
    let a = w
        .call("GET", "/v1/nothing")
        .header("X-Request-Id", "route-1")
        .send()
        .await;
    a.assert_error(404, "not_found", None);
    assert_eq!(a.header("x-request-id"), Some("route-1"));
    w.get("/v1/run")
        .await
        .assert_error(405, "method_not_allowed", None);
    w.assert_clean(false).await;
}

/// A body of `len` bytes as a client sends one to `/v1/run`: a JSON object's start, then
/// `fill` (never a whole JSON value).
fn big_body(len: usize, fill: u8) -> Vec<u8> {
    let prefix = b"{\"command\":\"true\",\"stdin\":\"";
    let mut body = Vec::with_capacity(len);
    body.extend_from_slice(&prefix[..prefix.len().min(len)]);
    body.resize(len, fill);
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_64_mib_is_413() {
    let w = Wire::start("413");
    w.post("/v1/run", &big_body(65 << 20, b'a'))
        .await
        .assert_error(413, "body_too_large", None);
    // Just under the limit is read (and refused for what it says, not for its size).
    w.post("/v1/run", &big_body((64 << 20) - 16, b'a'))
        .await
        .assert_error(400, "invalid_json", None);
    w.assert_clean(false).await;
}

/// What a node without a network, checkpoints or those names refuses of a run's sources.
/// (A volume a node with a disk does not have: tests/it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fields_this_node_does_not_serve_are_refused() {
    let w = Wire::start("notserved");
    let cases = [
        (
            json!({ "command": "true", "egress": { "default": "deny" } }),
            503,
            "not_served_here",
            "egress",
        ),
        (
            json!({ "command": "true", "template": "nope" }),
            404,
            "template_not_found",
            "template",
        ),
        (
            json!({ "command": "true", "snapshot": "my-snapshot" }),
            404,
            "snapshot_not_found",
            "snapshot",
        ),
        (
            // Any other image is pulled (tests/it/images.rs); one that is no reference is not.
            json!({ "command": "true", "image": "Ubuntu:24.04" }),
            400,
            "invalid_image",
            "image",
        ),
    ];
    for (body, status, code, param) in cases {
        refused_json(&w, body, status, code, Some(param)).await;
    }
    w.assert_clean(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docs_url_is_the_nodes_base_and_the_code() {
    let flags = Flags {
        docs_url: Some("https://docs.example/errors#".into()),
        ..Flags::default()
    };
    let w = Wire::start_with("docsurl", flags, |_| {});
    let v = w
        .post("/v1/run", b"{}")
        .await
        .assert_error(400, "missing_command", Some("command"));
    assert_eq!(
        v["error"]["docs_url"],
        "https://docs.example/errors#missing_command"
    );
    w.assert_clean(false).await;
}

/// Sizes and ids the agent could not take are refused at validation, before any sandbox is
/// made: a 10 MB command, argv, env or cwd was a 409 command_lost ("Broken pipe") after the
/// agent dropped the oversized frame; a uid beyond the sandbox's 65536 ran and failed 126.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_commands_and_foreign_ids_are_400_at_validation() {
    let w = Wire::start("oversized");
    let huge = "y".repeat(10 << 20);
    refused_json(
        &w,
        json!({ "command": huge }),
        400,
        "invalid_field",
        Some("command"),
    )
    .await;
    refused_json(
        &w,
        json!({ "command": ["echo", huge] }),
        400,
        "invalid_field",
        Some("command"),
    )
    .await;
    refused_json(
        &w,
        json!({ "command": "true", "env": { "BIG": huge } }),
        400,
        "invalid_env",
        Some("env.BIG"),
    )
    .await;
    refused_json(
        &w,
        json!({ "command": "true", "cwd": format!("/{huge}") }),
        400,
        "invalid_field",
        Some("cwd"),
    )
    .await;
    for user in ["65536", "0:999999999"] {
        refused_json(
            &w,
            json!({ "command": "id", "user": user }),
            400,
            "no_such_user",
            Some("user"),
        )
        .await;
    }
    refused_json(
        &w,
        json!({ "command": "true", "timeout_seconds": 1e-320 }),
        400,
        "invalid_field",
        Some("timeout_seconds"),
    )
    .await;
    w.assert_clean(false).await;
    // The same through a kept sandbox's exec.
    let id = w.create_sandbox(&json!({})).await;
    let path = format!("/v1/sandboxes/{id}/exec");
    w.post_json(&path, &json!({ "command": huge }))
        .await
        .assert_error(400, "invalid_field", Some("command"));
    w.post_json(&path, &json!({ "command": "id -u", "user": "65536" }))
        .await
        .assert_error(400, "no_such_user", Some("user"));
    assert!(
        w.node
            .exec_list(&id)
            .await
            .expect("its commands")
            .is_empty(),
        "a refused command was started"
    );
    let a = w.delete(&format!("/v1/sandboxes/{id}")).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.json()["status"], "deleted");
    w.assert_clean(true).await;
}
