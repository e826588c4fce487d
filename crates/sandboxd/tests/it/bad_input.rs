//! Requests the node refuses for what only a real node knows: a user its image does not have,
//! a volume its disk does not hold; and what it does serve of the same fields. Every other
//! refusal (each field at fault, sizes, routes, a body over 64 MiB, docs_url) is checked
//! in-process on the fake driver: `crates/sbx-http/src/wire_tests/bad_input.rs`.

use std::time::Duration;

use crate::common::{assert_error, TestNode};
use serde_json::{json, Value};

const CLEAN: Duration = Duration::from_secs(10);

/// Runs `body` and checks the error answer, also its request id.
fn refused_json(node: &TestNode, body: Value, status: u16, code: &str, param: Option<&str>) {
    let rid = format!("bad-input.{code}");
    let r = node.post(
        "/v1/run",
        &[("X-Request-Id", rid.as_str())],
        &serde_json::to_vec(&body).unwrap(),
    );
    let v = r.json();
    assert_error(r.status, &v, status, code, param);
    assert_eq!(v["error"]["request_id"], rid.as_str(), "{v}");
    assert_eq!(r.header("x-request-id"), Some(rid.as_str()));
    assert_eq!(v["error"]["retryable"], false, "{v}");
}

/// A user name is looked up in the image's own `/etc/passwd`.
#[test]
fn a_user_the_image_does_not_have_is_400() {
    let node = TestNode::start();
    refused_json(
        &node,
        json!({ "command": "id", "user": "no-such-user" }),
        400,
        "no_such_user",
        Some("user"),
    );
    node.assert_clean(CLEAN);
}

#[test]
fn a_volume_the_node_lacks_is_404_and_what_it_serves_runs() {
    let node = TestNode::start();
    refused_json(
        &node,
        json!({ "command": "true", "volumes": [{ "path": "/data", "volume": "my-volume" }] }),
        404,
        "volume_not_found",
        Some("volumes[0].volume"),
    );
    // What the node does serve of the fields it refuses (wire_tests/bad_input.rs).
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
