//! Sandboxes leave nothing behind: no process, mount, cgroup or directory, after many runs,
//! after a caller hangs up, and when the node stops.

use std::time::{Duration, Instant};

use crate::common::TestNode;
use serde_json::json;

#[test]
fn two_hundred_runs_leave_nothing() {
    let node = TestNode::start();
    const THREADS: usize = 4;
    const RUNS: usize = 200;
    std::thread::scope(|s| {
        for _ in 0..THREADS {
            s.spawn(|| {
                for _ in 0..RUNS / THREADS {
                    let v = node.run_ok(&json!({ "command": "echo hi" }));
                    assert_eq!(v["stdout"], "hi\n", "{v}");
                    assert_eq!(v["exit_code"], 0, "{v}");
                }
            });
        }
    });
    node.assert_clean(Duration::from_secs(30));
    // Nothing of the node's sandboxes is anywhere: each kind checked on its own.
    // (The warm pool's sandboxes are the node's own, made ahead for the next runs.)
    // The directories are read before the pool's ids: one the refiller starts after them is
    // not among them.
    let sandboxes: Vec<_> = std::fs::read_dir(node.data_dir.join("sandboxes"))
        .unwrap()
        .flatten()
        .collect();
    let groups: Vec<(std::path::PathBuf, Vec<std::fs::DirEntry>)> = ["memory", "pids"]
        .into_iter()
        .map(|ctrl| {
            let dir = node.cgroup_dir(ctrl).unwrap();
            let subs = std::fs::read_dir(&dir)
                .unwrap()
                .flatten()
                .filter(|e| e.path().is_dir())
                .collect();
            (dir, subs)
        })
        .collect();
    let warm = node.pool_ids();
    let is_warm = |e: &std::fs::DirEntry| warm.iter().any(|w| e.file_name().to_str() == Some(w));
    let left = sandboxes.iter().filter(|e| !is_warm(e)).count();
    assert_eq!(left, 0, "upper directories left (warm: {warm:?})");
    for (dir, subs) in &groups {
        let left = subs.iter().filter(|e| !is_warm(e)).count();
        assert_eq!(
            left,
            0,
            "cgroups left in {} (warm: {warm:?})",
            dir.display()
        );
    }
}

#[test]
fn a_caller_that_hangs_up_ends_its_sandbox() {
    let node = TestNode::start();
    let mut s = node.open_sse(&json!({ "command": "sleep 60", "stream": true }));
    let start = s.next_event().expect("start event");
    assert_eq!(start.event, "start", "{:?}", start.data);
    let id = start.data["sandbox_id"].as_str().unwrap().to_string();
    assert!(node.sandbox_dir(&id).exists(), "the sandbox is not there");
    assert!(!node.leftovers().is_empty());
    let t = Instant::now();
    drop(s);
    node.assert_clean(Duration::from_secs(10));
    assert!(t.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_json_caller_that_hangs_up_ends_its_sandbox() {
    let node = TestNode::start();
    // A JSON run hung up on: a socket that sends the request and closes.
    use std::io::Write;
    let body = br#"{"command":"sleep 60"}"#;
    let mut sock = std::net::TcpStream::connect(&node.addr).unwrap();
    write!(
        sock,
        "POST /v1/run HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        node.addr,
        body.len()
    )
    .unwrap();
    sock.write_all(body).unwrap();
    // Wait for the sandbox to be there, then hang up.
    let deadline = Instant::now() + Duration::from_secs(10);
    while node.leftovers().iter().all(|l| !l.starts_with("process")) {
        assert!(Instant::now() < deadline, "the sandbox did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(sock);
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn a_stopping_node_ends_its_sandboxes() {
    let mut node = TestNode::start();
    let mut s = node.open_sse(&json!({ "command": "sleep 60", "stream": true }));
    let start = s.next_event().expect("start event");
    assert_eq!(start.event, "start");
    let t = Instant::now();
    let status = node.stop().expect("the node was running");
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "the node took {:?} to stop",
        t.elapsed()
    );
    assert!(status.success(), "the node exited with {status}");
    let left = node.leftovers();
    assert!(left.is_empty(), "left after the node stopped: {left:?}");
    // Not even its own cgroup folder.
    for c in ["memory", "pids"] {
        if let Some(dir) = node.cgroup_dir(c) {
            assert!(!dir.exists(), "{} is left", dir.display());
        }
    }
    // The caller is told why its command ended.
    let rest = s.rest();
    let last = rest.last().expect("an event after the start");
    assert_eq!(last.event, "error", "{rest:?}");
    assert_eq!(last.data["error"]["code"], "unavailable", "{:?}", last.data);
    assert_eq!(last.data["error"]["retryable"], true, "{:?}", last.data);
}

#[test]
fn a_killed_node_cleans_up_when_it_starts_again() {
    let mut node = TestNode::start();
    let mut s = node.open_sse(&json!({ "command": "sleep 60 & sleep 60", "stream": true }));
    let start = s.next_event().expect("start event");
    assert_eq!(start.event, "start");
    node.kill();
    drop(s);
    // Its sandbox outlives the node...
    std::thread::sleep(Duration::from_millis(200));
    let left = node.leftovers();
    assert!(
        left.iter().filter(|l| l.starts_with("process")).count() >= 3,
        "{left:?}"
    );
    // ...until the node starts again and removes what it finds.
    node.restart();
    node.assert_clean(Duration::from_secs(10));
    let v = node.run_ok(&json!({ "command": "echo again" }));
    assert_eq!(v["stdout"], "again\n");
    node.assert_clean(Duration::from_secs(10));
}

/// The node's open descriptors, read on the host.
fn node_fds(node: &TestNode) -> usize {
    let pid = node.pid().expect("the node's pid");
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the node's descriptors")
        .count()
}

#[test]
fn deleted_sandboxes_leave_no_descriptor_in_the_node() {
    let node = TestNode::start();
    // Warm: the base template, the pools, the first connections.
    let first = node.create_sandbox(&json!({}));
    let first = first["id"].as_str().unwrap().to_string();
    node.exec(&first, &json!({ "command": "true", "wait_seconds": 10 }));
    node.delete_sandbox(&first);
    std::thread::sleep(Duration::from_millis(500));
    let before = node_fds(&node);
    let ids: Vec<String> = (0..8)
        .map(|_| {
            let v = node.create_sandbox(&json!({}));
            v["id"].as_str().unwrap().to_string()
        })
        .collect();
    // Calls that leave connections kept for the next one.
    for id in &ids {
        for _ in 0..3 {
            let v = node.exec(id, &json!({ "command": "true", "wait_seconds": 10 }));
            assert_eq!(v["exit_code"], 0, "{v}");
        }
    }
    for id in &ids {
        node.delete_sandbox(id);
    }
    let end = Instant::now() + Duration::from_secs(10);
    let mut after = node_fds(&node);
    while after > before + 2 && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(200));
        after = node_fds(&node);
    }
    assert!(
        after <= before + 2,
        "the node holds {after} descriptors after 8 sandboxes came and went, {before} before"
    );
    node.assert_clean(Duration::from_secs(10));
}

/// Where the node's disk still is on the host: the mounts of its btrfs (at `DATA_DIR/disk`, or
/// anywhere from the loop device of its image: the bind at `DATA_DIR/sandboxes`) and the loop
/// devices whose backing file is its `disk.img`.
fn disk_traces(node: &TestNode) -> Vec<String> {
    let image = node.data_dir.join("disk.img");
    let mut out = Vec::new();
    let mut devices = Vec::new();
    for e in std::fs::read_dir("/sys/block").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        let Ok(backing) = std::fs::read_to_string(e.path().join("loop/backing_file")) else {
            continue;
        };
        // A deleted image reads "(deleted)" after its path.
        let backing = backing.trim_end().trim_end_matches(" (deleted)");
        if std::path::Path::new(backing) == image {
            devices.push(format!("/dev/{name}"));
            out.push(format!("loop device /dev/{name} holds {}", image.display()));
        }
    }
    let disk = node.data_dir.join("disk");
    let disk = disk.to_string_lossy();
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    for l in info.lines() {
        let f: Vec<&str> = l.split(' ').collect();
        // After the separator: the filesystem's type, then its source.
        let source = f.iter().skip_while(|x| **x != "-").nth(2);
        if f.get(4) == Some(&disk.as_ref())
            || source.is_some_and(|s| devices.iter().any(|d| d == s))
        {
            out.push(format!("mount {l}"));
        }
    }
    out
}

/// A node that made no sandbox (no warm pool, or one stopped while it is made; no call) takes
/// its disk away when it stops: no mount of its btrfs is left, and no loop device holds its
/// image.
#[test]
fn a_node_that_made_no_sandbox_releases_its_disk_at_stop() {
    for args in [
        &["--warm-pool", "0"][..],
        &["--warm-pool", "0", "--egress-default", "allow"][..],
        // Stopped while its warm pool is being made.
        &["--warm-pool", "2"][..],
    ] {
        no_sandbox_then_stop(args);
    }
}

fn no_sandbox_then_stop(args: &[&str]) {
    let mut node = TestNode::start_with(args);
    let held = disk_traces(&node);
    assert!(
        held.iter().any(|t| t.starts_with("loop")) && held.iter().any(|t| t.starts_with("mount")),
        "the running node has no disk: {held:?}"
    );
    stop_and_assert_disk_released(&mut node);
}

/// A node killed (its disk left mounted) and started again takes its disk away when it stops,
/// the mounts of the killed one too.
#[test]
fn a_node_started_again_after_a_kill_releases_its_disk_at_stop() {
    let mut node = TestNode::start_with(&["--warm-pool", "0"]);
    node.kill();
    node.restart();
    stop_and_assert_disk_released(&mut node);
}

/// The same for a node that made sandboxes (its warm pool, a kept one deleted, a run).
#[test]
fn a_node_that_made_sandboxes_releases_its_disk_at_stop() {
    let mut node = TestNode::start_with(&["--warm-pool", "2"]);
    let id = node.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    node.delete_sandbox(&id);
    node.run_ok(&json!({ "command": "true" }));
    stop_and_assert_disk_released(&mut node);
}

/// Stops `node` (it must exit 0) and asserts nothing of its disk is left: no loop device, no
/// mount.
fn stop_and_assert_disk_released(node: &mut TestNode) {
    let status = node.stop().expect("the node was running");
    assert!(status.success(), "the node exited with {status}");
    // The node's unmounts are lazy: the kernel drops the filesystem, then detaches the loop
    // device (autoclear), once the last use of it is gone, a moment after the exit.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let mut left = disk_traces(node);
    while !left.is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
        left = disk_traces(node);
    }
    assert!(
        left.is_empty(),
        "left after the node stopped:\n  {}\n{}",
        left.join("\n  "),
        node.log_tail(20)
    );
}
