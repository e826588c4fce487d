//! The sandbox's agent against what a sandbox can do to it: root stays a user whatever
//! /etc/passwd holds; the output of many commands does not grow the agent; an agent that dies
//! fails its sandbox at once; deep tar uploads.

mod common;

use std::time::{Duration, Instant};

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

/// The agent's resident memory (VmRSS) in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("agent status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS");
    kb << 10
}

/// `GET …/output?from=` (JSON): the answer.
fn output_from(node: &TestNode, sandbox: &str, exec_id: &str, from: u64) -> Value {
    let r = node.get(
        &format!("/v1/sandboxes/{sandbox}/exec/{exec_id}/output?from={from}"),
        &[],
    );
    let v = r.json();
    assert_eq!(r.status, 200, "output of {exec_id}: {v}");
    v
}

#[test]
fn many_commands_with_much_output_do_not_grow_the_agent() {
    const PRINTED: u64 = 16_000_000;
    const COMMANDS: usize = 16;
    // Running: one ring of 16 MiB; finished: 16 MiB together; the agent itself and what it
    // queues for the node: some MiB. Without a bound on finished output: 16 MiB more each.
    const BOUND: u64 = 72 << 20;
    let node = TestNode::start();
    let sb = node.create_sandbox(&json!({"limits": {"memory_bytes": 128u64 << 20}}));
    let id = sb["id"].as_str().expect("id").to_string();
    let agent = node.agent_pid(&id).expect("the agent's host pid");
    let mut ids = Vec::new();
    let mut most = 0;
    for n in 0..COMMANDS {
        let v = run(
            &node,
            &id,
            &format!("head -c {PRINTED} /dev/zero | tr '\\0' a"),
            None,
        );
        assert_eq!(v["status"], "exited", "command {n}: {v}");
        assert_eq!(v["exit_code"], 0, "command {n}: {v}");
        assert_eq!(v["output"]["stdout_bytes"], PRINTED, "command {n}: {v}");
        ids.push(v["id"].as_str().expect("id").to_string());
        let now = rss(agent);
        most = most.max(now);
        assert!(
            now < BOUND,
            "after {} commands the agent holds {} MiB (bound {} MiB)",
            n + 1,
            now >> 20,
            BOUND >> 20
        );
    }
    eprintln!("the agent's RSS peaked at {} MiB", most >> 20);
    assert_eq!(
        node.agent_pid(&id),
        Some(agent),
        "the agent was replaced or died"
    );
    let got = node.get(&format!("/v1/sandboxes/{id}"), &[]).json();
    assert_eq!(got["status"], "running", "{got}");
    // The newest command's output is whole; the oldest's is a gap then its tail.
    let last = output_from(&node, &id, &ids[COMMANDS - 1], 0);
    assert_eq!(last["start"], 0, "{}", last["gap"]);
    assert!(last["gap"].is_null(), "{}", last["gap"]);
    let first = output_from(&node, &id, &ids[0], 0);
    let end = first["end"].as_u64().expect("end");
    assert_eq!(end, PRINTED);
    let gap_to = first["gap"]["to"]
        .as_u64()
        .expect("a gap where the output is gone");
    assert_eq!(first["gap"]["from"], 0, "{}", first["gap"]);
    assert_eq!(
        first["start"], gap_to,
        "the gap ends where what is kept starts"
    );
    assert!(gap_to < end, "the tail of a finished command is kept");
    let tail: String = first["chunks"]
        .as_array()
        .expect("chunks")
        .iter()
        .map(|c| c["data"].as_str().expect("data").to_string())
        .collect();
    assert_eq!(tail.len() as u64, end - gap_to);
    assert!(tail.bytes().all(|b| b == b'a'));
    // Still serving.
    let v = run(&node, &id, "echo still here", None);
    assert_eq!(v["stdout"], "still here\n", "{v}");
    node.delete_sandbox(&id);
    node.assert_clean(CLEAN);
}

#[test]
fn an_agent_that_dies_fails_its_sandbox_at_once() {
    let node = TestNode::start();
    let sb = node.create_sandbox(&json!({}));
    let id = sb["id"].as_str().expect("id").to_string();
    let long = node.exec(&id, &json!({"command": "sleep 1000"}));
    let long_id = long["id"].as_str().expect("exec id").to_string();
    assert_eq!(long["status"], "running", "{long}");
    let agent = node.agent_pid(&id).expect("the agent's host pid");
    let killed = std::process::Command::new("kill")
        .args(["-9", &agent.to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    // Noticed without any call to the sandbox (no restart of the node, no exec first).
    let deadline = Instant::now() + Duration::from_secs(30);
    let got = loop {
        let v = node.get(&format!("/v1/sandboxes/{id}"), &[]).json();
        if v["status"] == "failed" {
            break v;
        }
        assert!(
            Instant::now() < deadline,
            "still {} 30 s after its agent was killed: {v}",
            v["status"]
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(got["failure_code"], "agent_lost", "{got}");
    // Its running command ended with it.
    let r = node.get(&format!("/v1/sandboxes/{id}/exec/{long_id}"), &[]);
    let v = r.json();
    assert_eq!(r.status, 200, "{v}");
    assert_eq!(v["status"], "killed", "{v}");
    // Later calls get a terminal answer, not "try again".
    let r = node.post_json(
        &format!("/v1/sandboxes/{id}/exec"),
        &json!({"command": "true"}),
    );
    assert_error(r.status, &r.json(), 409, "sandbox_not_running", None);
    let r = node.get(&format!("/v1/sandboxes/{id}/files/stat?path=/"), &[]);
    assert_error(r.status, &r.json(), 409, "sandbox_not_running", None);
    let r = node.post_json(
        &format!("/v1/sandboxes/{id}/exec/{long_id}/signal"),
        &json!({"signal": "SIGTERM"}),
    );
    assert_error(r.status, &r.json(), 409, "sandbox_not_running", None);
    // Nothing of it is left on the host (cgroups, directory, processes), before any delete.
    let deadline = Instant::now() + CLEAN;
    while !node.traces_of(&id).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(node.traces_of(&id), Vec::<String>::new());
    node.delete_sandbox(&id);
    node.assert_clean(CLEAN);
}
