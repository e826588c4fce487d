//! Ready checks: a sandbox with `ready.command` is answered `starting` and becomes `running`
//! once the check passes, or `failed` (`boot_failed`) with what the check last got.

mod common;

use std::time::{Duration, Instant};

use common::{assert_error, TestNode};
use serde_json::{json, Value};

fn create_starting(node: &TestNode, body: &Value) -> Value {
    let r = node.post_json("/v1/sandboxes", body);
    assert_eq!(r.status, 201, "{}", r.text());
    r.json()
}

fn wait_status(node: &TestNode, id: &str, not: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let v = node.get(&format!("/v1/sandboxes/{id}"), &[]).json();
        if v["status"] != not || Instant::now() > deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_sandbox_is_running_once_its_ready_check_passes() {
    let node = TestNode::start();
    let t = Instant::now();
    let v = create_starting(
        &node,
        &json!({
            "start_command": "sleep 1; touch /tmp/up; exec sleep 1000",
            "ready": { "command": "test -f /tmp/up" },
        }),
    );
    assert_eq!(v["status"], "starting", "{v}");
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "the answer waited for the check"
    );
    let id = v["id"].as_str().unwrap().to_string();
    let v = wait_status(&node, &id, "starting");
    assert_eq!(v["status"], "running", "{v}");
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "running before the check could pass"
    );
    let e = node
        .get(&format!("/v1/sandboxes/{id}/exec/exe-start"), &[])
        .json();
    assert_eq!(e["status"], "running", "{e}");
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn a_start_command_that_fails_ends_the_wait() {
    let node = TestNode::start();
    let t = Instant::now();
    let v = create_starting(
        &node,
        &json!({
            "start_command": "echo starting; exit 3",
            "ready": { "command": "echo not yet; false" },
        }),
    );
    let id = v["id"].as_str().unwrap().to_string();
    let v = wait_status(&node, &id, "starting");
    assert_eq!(v["status"], "failed", "{v}");
    assert_eq!(v["failure_code"], "boot_failed", "{v}");
    let why = v["failure"].as_str().unwrap();
    assert!(why.contains("exit code 3"), "{why}");
    assert!(why.contains("not yet"), "what the check last got: {why}");
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "the wait went on: {:?}",
        t.elapsed()
    );
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn checks_from_the_host_are_refused_and_start_true_is_the_base_images_none() {
    let node = TestNode::start();
    let r = node.post_json(
        "/v1/sandboxes",
        &json!({ "start": true, "ready": { "tcp": { "port": 8080 } } }),
    );
    assert_error(r.status, &r.json(), 503, "not_served_here", Some("ready"));
    // The base image has no start command of its own: start: true starts nothing.
    let v = node.create_sandbox(&json!({ "start": true }));
    assert_eq!(v["status"], "running", "{v}");
    node.delete_sandbox(v["id"].as_str().unwrap());
    let (status, body) = node.run(&json!({ "command": "true", "start": true }));
    assert_eq!(status, 200, "{body}");
    let (status, body) = node.run(&json!({ "command": "true", "start_command": "sleep 1" }));
    assert_error(status, &body, 503, "not_served_here", Some("start_command"));
    node.assert_clean(Duration::from_secs(10));
}
