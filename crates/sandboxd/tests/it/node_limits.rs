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
    let mut node = TestNode::start_with(&["--config", &path]);
    node.owns(dir);
    node
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

#[test]
fn max_sandboxes_flag_refuses_the_third_and_internal_node_counts_kept_sandboxes() {
    let node = TestNode::start_with(&[
        "--max-sandboxes",
        "2",
        "--warm-pool",
        "1",
        "--warm-runs",
        "2",
    ]);
    let a = node.create_sandbox(&json!({}));
    let b = node.create_sandbox(&json!({}));
    // Both kept sandboxes are counted (the count said 0 while kept ones were held).
    let (status, info) = common::get_json(&node, "/internal/node");
    assert_eq!(status, 200, "{info}");
    assert_eq!(info["sandboxes"], 2, "{info}");
    assert_eq!(info["kept"], 2, "{info}");
    assert_eq!(info["runs"], 0, "{info}");
    assert_eq!(info["max_sandboxes"], 2, "{info}");
    let cap = &info["capacity"];
    assert_eq!(cap["max_sandboxes"], 2, "{info}");
    assert_eq!(cap["source"], "--max-sandboxes", "{info}");
    // What the machine would give is shown beside it.
    let derived = &cap["derived"];
    assert!(derived["max_sandboxes"].as_u64().unwrap() >= 1, "{info}");
    // Both kinds of warm sandboxes are taken from what the machine gives.
    assert_eq!(derived["warm_pool"], 3, "{info}");
    for bound in ["memory", "pids", "fds"] {
        assert!(
            derived[bound]["per_sandbox"].as_u64().unwrap() > 0,
            "{info}"
        );
    }
    // The third is refused, with the error body.
    let r = node.post_json("/v1/sandboxes", &json!({}));
    let v = r.json();
    assert_error(r.status, &v, 503, "no_capacity", None);
    assert_eq!(v["error"]["retryable"], true, "{v}");
    assert_eq!(v["error"]["type"], "unavailable", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_sandboxes 2"),
        "{v}"
    );
    assert!(
        common::valid_request_id(v["error"]["request_id"].as_str().unwrap()),
        "{v}"
    );
    assert_eq!(r.header("retry-after"), Some("1"));
    let (status, body) = node.run(&json!({ "command": "true" }));
    assert_error(status, &body, 503, "no_capacity", None);
    node.delete_sandbox(a["id"].as_str().unwrap());
    node.delete_sandbox(b["id"].as_str().unwrap());
    let (_, info) = common::get_json(&node, "/internal/node");
    assert_eq!(info["sandboxes"], 0, "{info}");
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn the_default_max_sandboxes_is_derived_from_the_machine() {
    let node = TestNode::start_with(&["--warm-pool", "0"]);
    let (status, info) = common::get_json(&node, "/internal/node");
    assert_eq!(status, 200, "{info}");
    let cap = &info["capacity"];
    assert_eq!(cap["source"], "derived", "{info}");
    let derived = &cap["derived"];
    assert_eq!(cap["max_sandboxes"], derived["max_sandboxes"], "{info}");
    assert_eq!(info["max_sandboxes"], derived["max_sandboxes"], "{info}");
    // The least of the three bounds, each what the host has less its reserve over a
    // sandbox's cost.
    let bounds: Vec<u64> = ["memory", "pids", "fds"]
        .iter()
        .map(|b| {
            let d = &derived[*b];
            let (host, reserved, per) = (
                d["host"].as_u64().unwrap(),
                d["reserved"].as_u64().unwrap(),
                d["per_sandbox"].as_u64().unwrap(),
            );
            assert_eq!(
                d["sandboxes"].as_u64().unwrap(),
                host.saturating_sub(reserved) / per,
                "{d}"
            );
            d["sandboxes"].as_u64().unwrap()
        })
        .collect();
    let least = *bounds.iter().min().unwrap();
    assert_eq!(
        derived["max_sandboxes"].as_u64().unwrap(),
        least.max(1),
        "{info}"
    );
    // The node's open files limit is the hard one (raised at start), as the fds bound says.
    let pid = node.pid().unwrap();
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let f: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(f[3], f[4], "soft = hard: {line}");
    assert_eq!(derived["fds"]["host"].to_string(), f[3], "{info}");
}
