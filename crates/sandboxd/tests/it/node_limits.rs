//! The config file's image_allowlist and max_sandboxes hold for the whole node: the HTTP API's
//! calls as much as the functions interface's.

use std::time::Duration;

use crate::common::{self, assert_error, TestNode};
use serde_json::json;

fn node_with(config: &str) -> TestNode {
    let dir = std::env::temp_dir().join(common::unique("sbx-limits"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sandboxd.toml");
    std::fs::write(&path, config).unwrap();
    let path = path.to_string_lossy().into_owned();
    TestNode::start_with(&["--config", &path])
}

#[test]
fn the_allowlist_holds_for_http_calls() {
    let node = node_with("image_allowlist = [\"python\"]\n");
    let v = node.run_ok(&json!({ "image": "python", "command": "echo ok" }));
    assert_eq!(v["stdout"], "ok\n", "{v}");
    for image in [json!("node"), json!(null)] {
        let (status, body) = node.run(&json!({ "image": image, "command": "true" }));
        assert_error(status, &body, 403, "image_not_allowed", Some("image"));
        let r = node.post_json("/v1/sandboxes", &json!({ "image": image }));
        assert_error(r.status, &r.json(), 403, "image_not_allowed", Some("image"));
    }
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn max_sandboxes_holds_for_http_calls() {
    let node = node_with("max_sandboxes = 2\n");
    let a = node.create_sandbox(&json!({}));
    let b = node.create_sandbox(&json!({}));
    let r = node.post_json("/v1/sandboxes", &json!({}));
    assert_error(r.status, &r.json(), 503, "no_capacity", None);
    assert_eq!(r.json()["error"]["retryable"], true);
    let (status, body) = node.run(&json!({ "command": "true" }));
    assert_error(status, &body, 503, "no_capacity", None);
    node.delete_sandbox(a["id"].as_str().unwrap());
    let v = node.run_ok(&json!({ "command": "echo room" }));
    assert_eq!(v["stdout"], "room\n", "{v}");
    node.delete_sandbox(b["id"].as_str().unwrap());
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn a_catalog_name_mapped_to_an_unreachable_registry_falls_back_to_the_base_image() {
    // Nothing listens on port 1: the pull fails as offline pulls do, and the base image
    // serves `python`, in a run and in a kept sandbox alike.
    let node = node_with("[catalog]\npython = \"127.0.0.1:1/library/python:3.12\"\n");
    let v = node.run_ok(&json!({ "image": "python", "command": "python3 -c 'print(2+2)'" }));
    assert_eq!(v["stdout"], "4\n", "{v}");
    let r = node.post_json("/v1/sandboxes", &json!({ "image": "python" }));
    assert_eq!(r.status, 201, "{}", r.text());
    let id = r.json()["id"].as_str().unwrap().to_string();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let v = loop {
        let v = node.get(&format!("/v1/sandboxes/{id}"), &[]).json();
        if v["status"] != "starting" || std::time::Instant::now() > deadline {
            break v;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(v["status"], "running", "{v}");
    assert!(
        node.log_text().contains("the base image serves"),
        "the fallback is logged"
    );
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}
