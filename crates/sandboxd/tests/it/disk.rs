//! Each sandbox's disk has the node's size (`--disk-bytes`), each volume its own: a writer
//! past it gets an error (EDQUOT, "Disk quota exceeded": btrfs qgroups), the node serves the
//! next request and a neighbour writes on; the space comes back when the files go.

use std::time::Duration;

use crate::common::{get_json, stdout, TestNode};
use serde_json::{json, Value};

const CLEAN: Duration = Duration::from_secs(20);
const DISK: u64 = 64 << 20;

fn sh(node: &TestNode, id: &str, command: &str) -> Value {
    let r = node.post_json(
        &format!("/v1/sandboxes/{id}/run"),
        &json!({ "command": command }),
    );
    let v = r.json();
    assert_eq!(r.status, 200, "{command}: {v}");
    v
}

/// Writes MiB after MiB until the write fails, then says how far it got.
const FILL: &str = "i=0; while dd if=/dev/zero of=$F bs=1M count=1 seek=$i conv=notrunc,fsync \
                    status=none 2>/dev/shm/err; do i=$((i+1)); [ $i -ge 1000 ] && break; done; \
                    echo $i; cat /dev/shm/err >&2";

#[test]
fn a_full_disk_stops_its_sandbox_alone() {
    let node = TestNode::start_with(&["--disk-bytes", &DISK.to_string()]);
    let (_, info) = get_json(&node, "/internal/node");
    assert_eq!(info["disk_bytes"], DISK, "{info}");
    assert_eq!(info["disk"]["filesystem"], "btrfs", "{info}");
    assert!(
        info["disk"]["free_bytes"].as_u64().unwrap() > DISK,
        "{info}"
    );
    let a = node.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let b = node.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_string();

    let v = sh(&node, &a, &format!("F=/big; {FILL}"));
    let written: u64 = stdout(&v).trim().parse().unwrap_or_else(|_| panic!("{v}"));
    assert!((32..64).contains(&written), "stopped at {written} MiB: {v}");
    assert!(
        v["stderr"]
            .as_str()
            .unwrap()
            .contains("Disk quota exceeded"),
        "{v}"
    );
    // The sandbox itself goes on; so do the node and the neighbour.
    let v = sh(&node, &a, "echo still here");
    assert_eq!(stdout(&v), "still here\n", "{v}");
    assert_eq!(node.get("/healthz", &[]).status, 200);
    let v = sh(
        &node,
        &b,
        "dd if=/dev/zero of=/ok bs=1M count=16 conv=fsync status=none && echo wrote",
    );
    assert_eq!(stdout(&v), "wrote\n", "{v}");
    // A run (a sandbox of the warm pool) has the same size.
    let v = node.run_ok(&json!({"command": format!("F=/big; {FILL}")}));
    let run_written: u64 = stdout(&v).trim().parse().unwrap_or_else(|_| panic!("{v}"));
    assert!(run_written < 64, "a run wrote {run_written} MiB: {v}");
    // Its files gone, it has its room again.
    let v = sh(
        &node,
        &a,
        "rm /big && sync && sleep 1 && dd if=/dev/zero of=/again bs=1M count=16 conv=fsync status=none && echo wrote",
    );
    assert_eq!(stdout(&v), "wrote\n", "{v}");
    node.delete_sandbox(&a);
    node.delete_sandbox(&b);
    node.assert_clean(CLEAN);
}

#[test]
fn a_full_volume_stops_at_its_size() {
    let node = TestNode::start();
    let r = node.post_json(
        "/v1/volumes",
        &json!({"name": "small", "size_bytes": 16 << 20}),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let a = node.create_sandbox(&json!({"volumes": [{"path": "/vol", "volume": "small"}]}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let b = node.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let v = sh(&node, &a, &format!("F=/vol/big; {FILL}"));
    let written: u64 = stdout(&v).trim().parse().unwrap_or_else(|_| panic!("{v}"));
    assert!((8..16).contains(&written), "stopped at {written} MiB: {v}");
    assert!(
        v["stderr"]
            .as_str()
            .unwrap()
            .contains("Disk quota exceeded"),
        "{v}"
    );
    // Its own disk is not the volume's.
    let v = sh(
        &node,
        &a,
        "dd if=/dev/zero of=/root/ok bs=1M count=32 conv=fsync status=none && echo wrote",
    );
    assert_eq!(stdout(&v), "wrote\n", "{v}");
    let v = sh(
        &node,
        &b,
        "dd if=/dev/zero of=/ok bs=1M count=32 conv=fsync status=none && echo wrote",
    );
    assert_eq!(stdout(&v), "wrote\n", "{v}");
    assert_eq!(node.get("/healthz", &[]).status, 200);
    let (_, vol) = get_json(&node, "/v1/volumes/small");
    let used = vol["used_bytes"].as_u64().unwrap();
    assert!(((8 << 20)..=(16 << 20)).contains(&used), "{vol}");
    node.delete_sandbox(&a);
    node.delete_sandbox(&b);
    let r = node.delete("/v1/volumes/small", &[]);
    assert_eq!(r.status, 204, "{}", r.text());
    node.assert_clean(CLEAN);
}
