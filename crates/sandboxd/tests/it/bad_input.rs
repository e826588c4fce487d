//! Requests the node refuses: each with its status, its code, the field at fault, and the one
//! error body of the API. Nothing of a refused request is left on the host.

use std::time::Duration;

use crate::common::{assert_error, raw_post, TestNode};
use serde_json::{json, Value};

const CLEAN: Duration = Duration::from_secs(10);

/// Sends `body` (raw bytes) with `headers` and checks the error answer, also its request id.
fn refused(
    node: &TestNode,
    body: &[u8],
    headers: &[(&str, &str)],
    status: u16,
    code: &str,
    param: Option<&str>,
) -> Value {
    let rid = format!("bad-input.{code}");
    let mut all = headers.to_vec();
    all.push(("X-Request-Id", rid.as_str()));
    let r = node.post("/v1/run", &all, body);
    let v = r.json();
    assert_error(r.status, &v, status, code, param);
    assert_eq!(v["error"]["request_id"], rid.as_str(), "{v}");
    assert_eq!(r.header("x-request-id"), Some(rid.as_str()));
    assert_eq!(v["error"]["retryable"], false, "{v}");
    assert!(
        r.header("content-type")
            .is_some_and(|c| c.starts_with("application/json")),
        "{:?}",
        r.headers
    );
    v
}

fn refused_json(node: &TestNode, body: Value, status: u16, code: &str, param: Option<&str>) {
    refused(
        node,
        &serde_json::to_vec(&body).unwrap(),
        &[],
        status,
        code,
        param,
    );
}

#[test]
fn invalid_requests_are_400_with_the_field_at_fault() {
    let node = TestNode::start();
    refused(&node, b"not json", &[], 400, "invalid_json", None);
    refused(&node, b"[1, 2]", &[], 400, "invalid_json", None);
    refused(&node, b"", &[], 400, "invalid_json", None);
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
        (
            json!({ "command": "id", "user": "no-such-user" }),
            "no_such_user",
            "user",
        ),
    ];
    for (body, code, param) in cases {
        refused_json(&node, body, 400, code, Some(param));
    }
    let key = "k".repeat(300);
    refused(
        &node,
        br#"{"command":"true"}"#,
        &[("Idempotency-Key", key.as_str())],
        400,
        "invalid_idempotency_key",
        Some("Idempotency-Key"),
    );
    node.assert_clean(CLEAN);
    // The node still runs commands, and a valid Idempotency-Key is taken.
    let r = node.post(
        "/v1/run",
        &[("Idempotency-Key", "k".repeat(255).as_str())],
        br#"{"command":"echo fine"}"#,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["stdout"], "fine\n");
    node.assert_clean(CLEAN);
}

#[test]
fn limits_beyond_the_node_are_refused() {
    let node = TestNode::start();
    let cpus = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(32);
    if cpus < 32 {
        refused_json(
            &node,
            json!({ "command": "true", "limits": { "vcpus": cpus + 1 } }),
            400,
            "invalid_field",
            Some("limits.vcpus"),
        );
    }
    // 64 TiB: an even number of MiB, more than this host has.
    refused_json(
        &node,
        json!({ "command": "true", "limits": { "memory_bytes": 1u64 << 46 } }),
        400,
        "invalid_field",
        Some("limits.memory_bytes"),
    );
    node.assert_clean(CLEAN);
}

#[test]
fn unknown_routes_and_methods() {
    let node = TestNode::start();
    let r = node.get("/v1/nothing", &[("X-Request-Id", "route-1")]);
    assert_error(r.status, &r.json(), 404, "not_found", None);
    assert_eq!(r.header("x-request-id"), Some("route-1"));
    let r = node.get("/v1/run", &[]);
    assert_error(r.status, &r.json(), 405, "method_not_allowed", None);
    node.assert_clean(CLEAN);
}

#[test]
fn a_body_over_64_mib_is_413() {
    let node = TestNode::start();
    let (status, v) = raw_post(&node.addr, "/v1/run", 65 << 20, b'a');
    assert_error(status, &v, 413, "body_too_large", None);
    // Just under the limit is read (and refused for what it says, not for its size).
    let (status, v) = raw_post(&node.addr, "/v1/run", (64 << 20) - 16, b'a');
    assert_error(status, &v, 400, "invalid_json", None);
    node.assert_clean(CLEAN);
}

#[test]
fn fields_this_node_does_not_serve_are_refused() {
    let node = TestNode::start();
    let cases = [
        (
            json!({ "command": "true", "egress": { "default": "deny" } }),
            503,
            "not_served_here",
            "egress",
        ),
        (
            json!({ "command": "true", "volumes": [{ "path": "/data", "volume": "my-volume" }] }),
            404,
            "volume_not_found",
            "volumes[0].volume",
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
            // Any other image is pulled (tests/images.rs); one that is no reference is not.
            json!({ "command": "true", "image": "Ubuntu:24.04" }),
            400,
            "invalid_image",
            "image",
        ),
    ];
    for (body, status, code, param) in cases {
        refused_json(&node, body, status, code, Some(param));
    }
    // What the node does serve of the same fields.
    for body in [
        json!({ "command": "true", "template": "base" }),
        json!({ "command": "true", "image": "python" }),
        json!({ "command": "true", "egress": null, "volumes": [] }),
    ] {
        let v = node.run_ok(&body);
        assert_eq!(v["exit_code"], 0, "{body}: {v}");
    }
    node.assert_clean(CLEAN);
}

#[test]
fn docs_url_is_the_nodes_base_and_the_code() {
    let node = TestNode::start_with(&["--docs-url", "https://docs.example/errors#"]);
    let r = node.post("/v1/run", &[], b"{}");
    let v = r.json();
    assert_error(r.status, &v, 400, "missing_command", Some("command"));
    assert_eq!(
        v["error"]["docs_url"],
        "https://docs.example/errors#missing_command"
    );
    node.assert_clean(CLEAN);
}

/// Sizes and ids the agent could not take are refused at validation, before any sandbox is
/// made: a 10 MB command, argv, env or cwd was a 409 command_lost ("Broken pipe") after the
/// agent dropped the oversized frame; a uid beyond the sandbox's 65536 ran and failed 126.
#[test]
fn oversized_commands_and_foreign_ids_are_400_at_validation() {
    let node = TestNode::start_with(&["--warm-pool", "0"]);
    let huge = "y".repeat(10 << 20);
    refused_json(
        &node,
        json!({ "command": huge }),
        400,
        "invalid_field",
        Some("command"),
    );
    refused_json(
        &node,
        json!({ "command": ["echo", huge] }),
        400,
        "invalid_field",
        Some("command"),
    );
    refused_json(
        &node,
        json!({ "command": "true", "env": { "BIG": huge } }),
        400,
        "invalid_env",
        Some("env.BIG"),
    );
    refused_json(
        &node,
        json!({ "command": "true", "cwd": format!("/{huge}") }),
        400,
        "invalid_field",
        Some("cwd"),
    );
    for user in ["65536", "0:999999999"] {
        refused_json(
            &node,
            json!({ "command": "id", "user": user }),
            400,
            "no_such_user",
            Some("user"),
        );
    }
    refused_json(
        &node,
        json!({ "command": "true", "timeout_seconds": 1e-320 }),
        400,
        "invalid_field",
        Some("timeout_seconds"),
    );
    // The same through a kept sandbox's exec.
    let sb = node.create_sandbox(&json!({}));
    let id = sb["id"].as_str().unwrap().to_string();
    let r = node.post_json(
        &format!("/v1/sandboxes/{id}/exec"),
        &json!({ "command": huge }),
    );
    assert_error(r.status, &r.json(), 400, "invalid_field", Some("command"));
    let r = node.post_json(
        &format!("/v1/sandboxes/{id}/exec"),
        &json!({ "command": "id -u", "user": "65536" }),
    );
    assert_error(r.status, &r.json(), 400, "no_such_user", Some("user"));
    node.delete_sandbox(&id);
    node.assert_clean(CLEAN);
}
