//! What a sandbox can do to the host and to other nodes: a fork bomb ends at its timeout and
//! leaves nothing; host users cannot reach sandboxes' files; two nodes on one host keep to their
//! own cgroup folders.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::TestNode;
use serde_json::json;

/// Forks for ever; each child leaves the command's process group and session, and forks too.
const BOMB: &str = "import os\nwhile True:\n    try:\n        if os.fork() == 0:\n            os.setsid()\n            b = bytearray(16 << 20)\n    except OSError:\n        pass\n";

/// A fork bomb (the node's pids limit, 128 in tests, caps it) is answered `timed_out` at its
/// timeout, and its sandbox is gone afterwards: no process, cgroup, mount or directory.
#[test]
fn a_fork_bomb_times_out_and_leaves_nothing() {
    let node = TestNode::start_with(&["--warm-pool", "0"]);
    // Each f starts two more in the background, through a pipe; the shell waits meanwhile.
    let (status, v) = node.run(&json!({
        "command": ["python3", "-c", BOMB],
        "timeout_seconds": 3,
        "limits": { "memory_bytes": 128u64 << 20, "vcpus": 1 },
    }));
    assert_eq!(status, 200, "{v}\n{}", node.log_tail(30));
    assert_eq!(v["status"], "timed_out", "{v}");
    node.assert_clean(Duration::from_secs(60));
}

/// Freezes a sandbox's cgroup from the host, and thaws it when dropped (a frozen process
/// cannot die: a failing test must not leave one).
struct Frozen(PathBuf, &'static str);

impl Frozen {
    fn freeze(node: &TestNode, sandbox_id: &str) -> Frozen {
        let (dir, file, thawed, frozen) = match node.cgroup_dir("freezer") {
            Some(d) if d.join(sandbox_id).join("freezer.state").exists() => {
                (d.join(sandbox_id), "freezer.state", "THAWED", "FROZEN")
            }
            _ => (
                node.cgroup_dir("unified")
                    .expect("a freezer")
                    .join(sandbox_id),
                "cgroup.freeze",
                "0",
                "1",
            ),
        };
        let f = Frozen(dir.join(file), thawed);
        std::fs::write(&f.0, frozen).expect("freeze the sandbox's group");
        f
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.0, self.1);
    }
}

/// An agent that cannot act at the deadline (here its group is frozen from the host, as a
/// fork bomb starves it under the sandbox's CPU quota) does not hold the run: the node's own
/// deadline answers `timed_out`, and the teardown kills a frozen group's processes (it freezes,
/// kills and thaws) and leaves nothing.
#[test]
fn a_run_whose_agent_cannot_act_is_answered_timed_out_and_ended() {
    let node = TestNode::start_with(&["--warm-pool", "0"]);
    let mut s = node.open_sse(&json!({
        "command": "echo up; sleep 1000",
        "timeout_seconds": 3,
        "stream": true,
    }));
    let start = s.next_event().expect("start event");
    assert_eq!(start.event, "start", "{:?}", start.data);
    let id = start.data["sandbox_id"].as_str().unwrap().to_string();
    let first = s.next_event().expect("output");
    assert_eq!(first.data["data"], "up\n", "{:?}", first.data);
    let _frozen = Frozen::freeze(&node, &id);
    let rest = s.rest();
    let exit = rest.last().expect("events");
    assert_eq!(exit.event, "exit", "{rest:?}\n{}", node.log_tail(20));
    assert_eq!(exit.data["status"], "timed_out", "{:?}", exit.data);
    assert_eq!(exit.data["signal"], "SIGKILL", "{:?}", exit.data);
    node.assert_clean(Duration::from_secs(60));
}
