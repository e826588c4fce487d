//! Secrets of a kept sandbox: `secret_env` is sealed at rest with the node key, and a node
//! killed and started again over the same data directory adopts the sandbox and opens its spec.
//! The secrets API (`PUT /v1/secrets/{name}`, list, get, delete: the value never shown, sealed
//! with `node.key`, kept across a restart) and `image_pull_secret`'s checks run in-process on
//! the fake driver: `crates/sbx-http/src/wire_tests/secrets.rs`.

use std::time::Duration;

use crate::common::{unique, TestNode};
use serde_json::json;

/// The bytes of every file of the state database (WAL included).
fn state_bytes(node: &TestNode) -> Vec<u8> {
    let mut all = Vec::new();
    for f in ["state.db", "state.db-wal", "state.db-shm"] {
        if let Ok(b) = std::fs::read(node.data_dir.join(f)) {
            all.extend(b);
        }
    }
    all
}

fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

#[test]
fn secret_env_of_a_kept_sandbox_is_sealed_at_rest() {
    let mut node = TestNode::start();
    let value = unique("env-secret");
    let sb = node.create_sandbox(&json!({"secret_env": {"TOK": value}}));
    let id = sb["id"].as_str().unwrap().to_string();
    assert!(
        !contains(&state_bytes(&node), &value),
        "a secret_env value in clear in state.db"
    );
    // Killed and started again: the node adopts the sandbox, and its spec opens.
    node.kill();
    node.restart();
    let r = node.get(&format!("/v1/sandboxes/{id}"), &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["status"], "running", "{}", r.text());
    // Its hex, so that neither the command nor its output holds the value.
    let e = node.exec(
        &id,
        &json!({"command": "printf %s \"$TOK\" | od -An -tx1 | tr -d ' \\n'"}),
    );
    let done = node.exec_wait(&id, e["id"].as_str().unwrap(), Duration::from_secs(30));
    assert_eq!(done["exit_code"], 0, "{done}");
    let hex: String = value.bytes().map(|b| format!("{b:02x}")).collect();
    assert_eq!(done["stdout"], hex, "{done}");
    assert!(!node.log_text().contains(&value));
    node.delete_sandbox(&id);
}
