//! The sandbox's agent against what a sandbox can do to it: root stays a user whatever
//! /etc/passwd holds; the output of many commands does not grow the agent; an agent that dies
//! fails its sandbox at once; deep tar uploads.

mod common;

use std::time::Duration;

use common::{assert_error, TestNode};
use serde_json::{json, Value};

const CLEAN: Duration = Duration::from_secs(10);
const WAIT: Duration = Duration::from_secs(60);

/// Runs `command` (sh) in `sandbox` as `user` (`None`: the default) and waits: the final object.
fn run(node: &TestNode, sandbox: &str, command: &str, user: Option<&str>) -> Value {
    let mut body = json!({"command": command, "wait_seconds": 30});
    if let Some(u) = user {
        body["user"] = json!(u);
    }
    let v = node.exec(sandbox, &body);
    let id = v["id"].as_str().expect("exec id").to_string();
    node.exec_wait(sandbox, &id, WAIT)
}

#[test]
fn root_resolves_when_etc_passwd_is_broken() {
    let node = TestNode::start();
    let sb = node.create_sandbox(&json!({}));
    let id = sb["id"].as_str().expect("id").to_string();
    for (how, line) in [
        ("truncated", ": > /etc/passwd"),
        (
            "garbage",
            "printf 'root:x:zero\\n\\0\\0::::\\n' > /etc/passwd",
        ),
        ("removed", "rm -f /etc/passwd"),
    ] {
        let broke = run(&node, &id, line, None);
        assert_eq!(broke["exit_code"], 0, "{how}: {broke}");
        for user in [None, Some("root"), Some("0")] {
            let v = run(&node, &id, "id -u; id -g; echo $HOME", user);
            assert_eq!(v["status"], "exited", "{how}, user {user:?}: {v}");
            assert_eq!(v["stdout"], "0\n0\n/root\n", "{how}, user {user:?}: {v}");
        }
        // Another user still needs its line.
        let r = node.post_json(
            &format!("/v1/sandboxes/{id}/exec"),
            &json!({"command": "true", "user": "nobody"}),
        );
        assert_error(r.status, &r.json(), 400, "no_such_user", Some("user"));
        let fix = run(
            &node,
            &id,
            "echo 'root:x:0:0:root:/root:/bin/sh' > /etc/passwd",
            None,
        );
        assert_eq!(fix["exit_code"], 0, "{fix}");
    }
    node.delete_sandbox(&id);
    node.assert_clean(CLEAN);
}
