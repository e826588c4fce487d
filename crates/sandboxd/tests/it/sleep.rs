//! Idle sandboxes pause: after `sleep_after_seconds` with nothing of them in use, their
//! processes are frozen (the cgroup freezer); the next use resumes them. A sandbox with a
//! command running, or with `sleep_after_seconds: null`, never pauses.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::common::{get_json, stdout, TestNode};
use serde_json::json;

/// The freezer state of a sandbox's cgroup, read on the host (`FROZEN`, `THAWED`).
fn freezer_state(node: &TestNode, id: &str) -> String {
    let pid = node.agent_pid(id).expect("the sandbox's agent");
    let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("its cgroups");
    let path = cg
        .lines()
        .find_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, ctrl, path) = (parts.next()?, parts.next()?, parts.next()?);
            ctrl.split(',')
                .any(|c| c == "freezer")
                .then(|| path.to_string())
        })
        .expect("a freezer cgroup (cgroup v1)");
    let f = PathBuf::from("/sys/fs/cgroup/freezer")
        .join(path.trim_start_matches('/'))
        .join("freezer.state");
    std::fs::read_to_string(&f)
        .unwrap_or_else(|e| panic!("{}: {e}", f.display()))
        .trim()
        .to_string()
}

fn paused(node: &TestNode, id: &str) -> bool {
    let (status, v) = get_json(node, &format!("/v1/sandboxes/{id}"));
    assert_eq!(status, 200, "{v}");
    v["paused"].as_bool().expect("paused")
}

fn wait_paused(node: &TestNode, id: &str, within: Duration) -> bool {
    let end = Instant::now() + within;
    while Instant::now() < end {
        if paused(node, id) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

#[test]
fn an_idle_sandbox_pauses_and_its_next_use_resumes_it() {
    let node = TestNode::start_with(&["--sleep-after-seconds", "1"]);
    // The node's default (1 s), null (never), and one with a command running.
    let idle = node.create_sandbox(&json!({}));
    let idle_id = idle["id"].as_str().unwrap().to_string();
    assert_eq!(idle["sleep_after_seconds"], json!(1.0), "{idle}");
    assert_eq!(idle["paused"], json!(false), "{idle}");
    let never = node.create_sandbox(&json!({ "sleep_after_seconds": null }));
    let never_id = never["id"].as_str().unwrap().to_string();
    assert!(never["sleep_after_seconds"].is_null(), "{never}");
    let busy = node.create_sandbox(&json!({ "sleep_after_seconds": 1 }));
    let busy_id = busy["id"].as_str().unwrap().to_string();
    let running = node.exec(
        &busy_id,
        &json!({ "command": "sleep 4; echo slept", "wait_seconds": 0 }),
    );
    let running_id = running["id"].as_str().unwrap().to_string();

    // A process of its own counts in the background of the idle one: frozen, it stops.
    let v = node.exec(
        &idle_id,
        &json!({
            "command": "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.05; done' >/dev/null 2>&1 < /dev/null &",
            "wait_seconds": 10,
        }),
    );
    assert_eq!(v["exit_code"], 0, "{v}");

    assert!(
        wait_paused(&node, &idle_id, Duration::from_secs(10)),
        "an idle sandbox did not pause"
    );
    assert_eq!(freezer_state(&node, &idle_id), "FROZEN");
    let count = node
        .data_dir
        .join("sandboxes")
        .join(&idle_id)
        .join("upper/tmp/count");
    let before = std::fs::read_to_string(&count).expect("the counter's file");
    std::thread::sleep(Duration::from_millis(400));
    let after = std::fs::read_to_string(&count).expect("the counter's file");
    assert_eq!(before, after, "a process of a paused sandbox ran");

    // The next use resumes it, and its processes go on.
    let v = node.exec(
        &idle_id,
        &json!({ "command": "sleep 0.3; cat /tmp/count", "wait_seconds": 10 }),
    );
    assert_eq!(v["exit_code"], 0, "{v}");
    let n: u64 = stdout(&v).trim().parse().expect("a count");
    assert!(
        n > before.trim().parse::<u64>().expect("a count"),
        "the count did not go on: {before} then {n}"
    );
    assert_ne!(freezer_state(&node, &idle_id), "FROZEN");

    // Never by itself, and never while a command runs.
    assert!(!paused(&node, &never_id), "sleep_after_seconds null paused");
    assert!(
        !paused(&node, &busy_id),
        "a sandbox with a command running paused"
    );
    let done = node.exec_wait(&busy_id, &running_id, Duration::from_secs(20));
    assert_eq!(stdout(&done), "slept\n", "{done}");
    // Its command done, it pauses in turn.
    assert!(
        wait_paused(&node, &busy_id, Duration::from_secs(10)),
        "a sandbox whose command ended did not pause"
    );
    // A paused sandbox is deleted as any other, and nothing of it is left.
    for id in [&idle_id, &never_id, &busy_id] {
        node.delete_sandbox(id);
    }
    node.assert_clean(Duration::from_secs(10));
}
