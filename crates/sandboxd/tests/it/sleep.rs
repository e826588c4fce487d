//! Idle sandboxes pause: after `sleep_after_seconds` with nothing of them in use, their
//! processes are frozen (the cgroup freezer); the next use resumes them. A sandbox with a
//! command running, or with `sleep_after_seconds: null`, never pauses.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::common::{get_json, stdout, TestNode};
use serde_json::json;

/// The freezer state of a sandbox's cgroup, read on the host (`FROZEN`, `THAWED`).
fn freezer_state(node: &TestNode, id: &str) -> String {
    let f = cgroup_dir(node, id, "freezer").join("freezer.state");
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
            "command": "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done' >/dev/null 2>&1 < /dev/null &",
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

/// A Python service of the sandbox's own: it holds 40 MiB resident, and each TCP
/// connection to port 7000 that sends `+` adds one to a count in its memory and answers the
/// count (the ready check's connection sends nothing).
const COUNTER: &str = r#"import socket
blob = bytearray(b'x') * (40 << 20)
n = 0
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', 7000))
s.listen(16)
while True:
    c, _ = s.accept()
    if c.recv(1) == b'+':
        n += 1
        c.sendall(str(n).encode())
    c.close()
"#;

const ASK: &str = "import socket; c = socket.create_connection(('127.0.0.1', 7000), timeout=5); c.sendall(b'+'); print(c.recv(64).decode())";

fn counter_sandbox(node: &TestNode, extra: serde_json::Value) -> String {
    let mut body = json!({
        "start_command": ["python3", "-c", COUNTER],
        "ready": { "command": "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 7000), timeout=1)\"" },
        "sleep_after_seconds": null,
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    let r = node.post_json("/v1/sandboxes", &body);
    let v = r.json();
    assert_eq!(r.status, 201, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    // The first sandbox of its settings builds their template: answered starting.
    let end = Instant::now() + Duration::from_secs(120);
    while status(node, &id) != "running" {
        assert!(Instant::now() < end, "not running: {v}");
        std::thread::sleep(Duration::from_millis(100));
    }
    id
}

/// One connection to the counter: the count it answers.
fn ask(node: &TestNode, id: &str) -> u64 {
    let v = node.exec(
        id,
        &json!({ "command": ["python3", "-c", ASK], "wait_seconds": 20 }),
    );
    assert_eq!(v["exit_code"], 0, "{v}");
    stdout(&v)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("a count: {v}"))
}

fn status(node: &TestNode, id: &str) -> String {
    let (s, v) = get_json(node, &format!("/v1/sandboxes/{id}"));
    assert_eq!(s, 200, "{v}");
    v["status"].as_str().unwrap().to_string()
}

/// The host directory of a running sandbox's cgroup of controller `ctrl` (cgroup v1).
fn cgroup_dir(node: &TestNode, id: &str, ctrl: &str) -> PathBuf {
    let pid = node.agent_pid(id).expect("the sandbox's agent");
    let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("its cgroups");
    let path = cg
        .lines()
        .find_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
            ctrls
                .split(',')
                .any(|c| c == ctrl)
                .then(|| path.to_string())
        })
        .unwrap_or_else(|| panic!("a {ctrl} cgroup (cgroup v1)"));
    PathBuf::from("/sys/fs/cgroup")
        .join(ctrl)
        .join(path.trim_start_matches('/'))
}

/// The memory the cgroup at `dir` holds now.
fn memory_usage(dir: &std::path::Path) -> u64 {
    std::fs::read_to_string(dir.join("memory.usage_in_bytes"))
        .map(|s| s.trim().parse().unwrap_or(0))
        .unwrap_or(0)
}

fn post(node: &TestNode, path: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
    let r = node.post_json(path, &body);
    (r.status, r.json())
}

#[test]
fn a_sleeping_sandbox_keeps_its_processes_memory_and_socket_across_wake_and_node_restart() {
    let mut node = TestNode::start();
    let (s, info) = get_json(&node, "/internal/node");
    assert_eq!(s, 200);
    assert_eq!(info["checkpoints"]["available"], true, "{info}");
    let id = counter_sandbox(&node, json!({}));
    assert_eq!(ask(&node, &id), 1);
    assert_eq!(ask(&node, &id), 2);
    let mem = cgroup_dir(&node, &id, "memory");
    let awake = memory_usage(&mem);
    assert!(awake > 40 << 20, "the counter's memory: {awake}");

    let (s, v) = post(&node, &format!("/v1/sandboxes/{id}/sleep"), json!({}));
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["status"], "sleeping", "{v}");
    let asleep = memory_usage(&mem);
    assert!(
        asleep < awake / 4,
        "asleep, its memory was not freed: {awake} then {asleep}"
    );
    // The next use wakes it where it was: the count in memory, the listening socket.
    assert_eq!(ask(&node, &id), 3);
    assert_eq!(status(&node, &id), "running");

    // Asleep across a restart of the node, and woken after it.
    let (s, v) = post(&node, &format!("/v1/sandboxes/{id}/sleep"), json!({}));
    assert_eq!(s, 200, "{v}");
    node.stop();
    node.restart();
    assert_eq!(status(&node, &id), "sleeping");
    let (s, v) = post(&node, &format!("/v1/sandboxes/{id}/wake"), json!({}));
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["status"], "running", "{v}");
    assert_eq!(ask(&node, &id), 4);
    // A command started before a sleep keeps its id and output across it.
    let v = node.exec(
        &id,
        &json!({ "command": "echo before; sleep 2; echo after", "wait_seconds": 0 }),
    );
    let exec_id = v["id"].as_str().unwrap().to_string();
    std::thread::sleep(Duration::from_millis(300));
    let (s, v) = post(&node, &format!("/v1/sandboxes/{id}/sleep"), json!({}));
    assert_eq!(s, 200, "{v}");
    let done = node.exec_wait(&id, &exec_id, Duration::from_secs(30));
    assert_eq!(stdout(&done), "before\nafter\n", "{done}");
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn forks_go_on_from_the_same_count_then_apart_and_a_snapshot_outlives_its_sandbox() {
    let node = TestNode::start();
    let id = counter_sandbox(&node, json!({}));
    for want in 1..=3 {
        assert_eq!(ask(&node, &id), want);
    }
    node.exec(
        &id,
        &json!({ "command": "echo original > /tmp/who", "wait_seconds": 10 }),
    );
    let (s, v) = post(
        &node,
        &format!("/v1/sandboxes/{id}/fork"),
        json!({ "count": 2 }),
    );
    assert_eq!(s, 201, "{v}");
    let snap = v["snapshot"]["id"].as_str().unwrap().to_string();
    assert!(snap.starts_with("snap-"), "{v}");
    let forks: Vec<String> = v["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(forks.len(), 2, "{v}");
    for f in &forks {
        assert_ne!(f, &id);
        assert_eq!(status(&node, f), "running");
    }
    // Each goes on from the count of the instant of the fork, on its own.
    assert_eq!(ask(&node, &forks[0]), 4);
    assert_eq!(ask(&node, &forks[0]), 5);
    assert_eq!(ask(&node, &forks[1]), 4);
    assert_eq!(ask(&node, &id), 4);
    // Its own files: a write in one is not in the other.
    node.exec(
        &forks[0],
        &json!({ "command": "echo fork > /tmp/who", "wait_seconds": 10 }),
    );
    let v = node.exec(
        &forks[1],
        &json!({ "command": "cat /tmp/who", "wait_seconds": 10 }),
    );
    assert_eq!(stdout(&v), "original\n", "{v}");
    // Its own hostname.
    let v = node.exec(
        &forks[1],
        &json!({ "command": "hostname", "wait_seconds": 10 }),
    );
    assert_eq!(stdout(&v).trim(), forks[1], "{v}");

    // The snapshot is listed, and outlives its sandbox.
    let (s, v) = get_json(&node, "/v1/snapshots");
    assert_eq!(s, 200, "{v}");
    assert!(
        v["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["id"] == snap),
        "{v}"
    );
    node.delete_sandbox(&id);
    let (s, v) = get_json(&node, &format!("/v1/snapshots/{snap}"));
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["status"], "ready", "{v}");
    assert_eq!(v["sandbox_id"], id, "{v}");
    assert!(v["size_bytes"].as_u64().unwrap() > 0, "{v}");
    let made = node.create_sandbox(&json!({ "snapshot": snap }));
    let made_id = made["id"].as_str().unwrap().to_string();
    assert_eq!(made["status"], "running", "{made}");
    assert_eq!(ask(&node, &made_id), 4);
    // The refusals of a create from a snapshot.
    let (s, v) = post(
        &node,
        "/v1/sandboxes",
        json!({ "snapshot": snap, "start_command": "true" }),
    );
    assert_eq!(s, 400, "{v}");
    let (s, v) = post(
        &node,
        "/v1/sandboxes",
        json!({ "snapshot": "snap-nothere" }),
    );
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (404, Some("snapshot_not_found")),
        "{v}"
    );
    let (s, v) = node_delete(&node, &format!("/v1/snapshots/{snap}"));
    assert_eq!(s, 200, "{v}");
    for f in forks.iter().chain([&made_id]) {
        node.delete_sandbox(f);
    }
    node.assert_clean(Duration::from_secs(10));
}

fn node_delete(node: &TestNode, path: &str) -> (u16, serde_json::Value) {
    let r = node.delete(path, &[]);
    (r.status, r.json())
}

#[test]
fn an_idle_sandbox_pauses_then_sleeps_and_the_next_exec_wakes_it() {
    let node = TestNode::start();
    let id = counter_sandbox(
        &node,
        json!({ "sleep_after_seconds": 1, "suspend_after_ms": 1000 }),
    );
    assert_eq!(ask(&node, &id), 1);
    let mem = cgroup_dir(&node, &id, "memory");
    let awake = memory_usage(&mem);
    let end = Instant::now() + Duration::from_secs(20);
    while status(&node, &id) != "sleeping" {
        assert!(Instant::now() < end, "an idle sandbox did not sleep");
        std::thread::sleep(Duration::from_millis(200));
    }
    let asleep = memory_usage(&mem);
    assert!(asleep < awake / 4, "memory {awake} then {asleep}");
    assert_eq!(ask(&node, &id), 2);
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn a_node_without_criu_says_so_and_refuses_sleep_with_503() {
    let node = TestNode::start_with(&["--criu", "/nonexistent/criu"]);
    let (s, info) = get_json(&node, "/internal/node");
    assert_eq!(s, 200);
    assert_eq!(info["checkpoints"]["available"], false, "{info}");
    assert!(info["checkpoints"]["reason"].is_string(), "{info}");
    let v = node.create_sandbox(&json!({}));
    let id = v["id"].as_str().unwrap().to_string();
    for path in [
        format!("/v1/sandboxes/{id}/sleep"),
        format!("/v1/sandboxes/{id}/snapshots"),
        format!("/v1/sandboxes/{id}/fork"),
    ] {
        let (s, v) = post(&node, &path, json!({}));
        assert_eq!(
            (s, v["error"]["code"].as_str()),
            (503, Some("not_served_here")),
            "{path}: {v}"
        );
    }
    let (s, v) = post(
        &node,
        "/v1/sandboxes",
        json!({ "on_expiry": "sleep", "expires_at": crate::common::rfc3339_in(Duration::from_secs(60)) }),
    );
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (503, Some("not_served_here")),
        "{v}"
    );
    // Everything else works.
    let v = node.exec(&id, &json!({ "command": "echo ok", "wait_seconds": 10 }));
    assert_eq!(stdout(&v), "ok\n");
    node.delete_sandbox(&id);
}

#[test]
fn a_sandbox_on_the_network_sleeps_and_wakes_again_and_again_and_forks() {
    let node = TestNode::start_with(&["--egress-default", "allow"]);
    let id = counter_sandbox(&node, json!({}));
    // The sandbox's address: the source of a route out (no packet is sent).
    let addr = |id: &str| {
        let v2 = node.exec(
            id,
            &json!({ "command": ["python3", "-c", "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect(('203.0.113.1', 9)); print(s.getsockname()[0])"], "wait_seconds": 10 }),
        );
        stdout(&v2).trim().to_string()
    };
    let before = addr(&id);
    assert!(before.starts_with("10."), "{before}");
    for want in 1..=3 {
        let (s, v) = post(&node, &format!("/v1/sandboxes/{id}/sleep"), json!({}));
        assert_eq!(s, 200, "sleep {want}: {v}");
        assert_eq!(ask(&node, &id), want, "wake {want}");
        assert_eq!(addr(&id), before, "its address after wake {want}");
    }
    let (s, v) = post(
        &node,
        &format!("/v1/sandboxes/{id}/fork"),
        json!({ "count": 1 }),
    );
    assert_eq!(s, 201, "{v}");
    let fork = v["sandboxes"][0]["id"].as_str().unwrap().to_string();
    assert_eq!(ask(&node, &fork), 4);
    assert_ne!(addr(&fork), before, "a fork has an address of its own");
    // The fork sleeps and wakes as any sandbox.
    let (s, v) = post(&node, &format!("/v1/sandboxes/{fork}/sleep"), json!({}));
    assert_eq!(s, 200, "{v}");
    assert_eq!(ask(&node, &fork), 5);
    node.delete_sandbox(&fork);
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}

/// A program of the sandbox that holds it awake: it raises a hold on `/run/sbx/awake`, writes
/// every line it is sent to /tmp/notices, and lowers its hold once /tmp/lower exists.
const HOLDER: &str = r#"import os, socket
s = socket.socket(socket.AF_UNIX)
s.connect('/run/sbx/awake')
s.sendall(b'+')
open('/tmp/held', 'w').write('yes')
s.settimeout(0.1)
lowered = False
while True:
    try:
        data = s.recv(100)
        if not data:
            break
        with open('/tmp/notices', 'a') as f:
            f.write(data.decode())
    except socket.timeout:
        pass
    if not lowered and os.path.exists('/tmp/lower'):
        s.sendall(b'-')
        lowered = True
"#;

/// Starts [`HOLDER`] in sandbox `id`, in the background, and waits until it holds.
fn start_holder(node: &TestNode, id: &str) {
    let v = node.exec(
        id,
        &json!({
            "command": "printf '%s' \"$HOLDER\" > /tmp/holder.py && setsid python3 /tmp/holder.py >/tmp/holder.log 2>&1 </dev/null &",
            "env": { "HOLDER": HOLDER },
            "wait_seconds": 10,
        }),
    );
    assert_eq!(v["exit_code"], 0, "{v}");
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let v = node.exec(
            id,
            &json!({ "command": "cat /tmp/held /tmp/holder.log 2>/dev/null; true", "wait_seconds": 10 }),
        );
        if stdout(&v).starts_with("yes") {
            return;
        }
        assert!(Instant::now() < end, "the holder did not hold: {v}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_hold_on_run_sbx_awake_keeps_a_sandbox_up_and_its_programs_are_told_before_it_pauses() {
    let node = TestNode::start_with(&["--sleep-after-seconds", "1"]);
    let held =
        node.create_sandbox(&json!({ "sleep_notice_ms": 1500, "sleep_hold_max_ms": 600000 }));
    assert_eq!(held["sleep_notice_ms"], 1500, "{held}");
    assert_eq!(held["sleep_hold_max_ms"], 600000, "{held}");
    let held = held["id"].as_str().unwrap().to_string();
    let capped = node.create_sandbox(&json!({ "sleep_hold_max_ms": 1000 }));
    assert!(capped["sleep_notice_ms"].is_null(), "{capped}");
    let capped = capped["id"].as_str().unwrap().to_string();
    let plain = node.create_sandbox(&json!({}));
    assert_eq!(plain["sleep_hold_max_ms"], 30000, "the default: {plain}");
    let plain = plain["id"].as_str().unwrap().to_string();
    start_holder(&node, &held);
    start_holder(&node, &capped);

    // Idle for three times its sleep_after_seconds, the held one runs on (reading its object
    // is not a use); past its sleep_hold_max_ms the capped one pauses whatever holds it.
    assert!(
        wait_paused(&node, &capped, Duration::from_secs(15)),
        "a hold past sleep_hold_max_ms kept a sandbox up"
    );
    assert!(
        wait_paused(&node, &plain, Duration::from_secs(15)),
        "a sandbox without holds did not pause"
    );
    std::thread::sleep(Duration::from_secs(3));
    assert!(!paused(&node, &held), "a held sandbox paused");
    assert_ne!(freezer_state(&node, &held), "FROZEN");

    // Its hold lowered, it pauses: its program told first.
    let v = node.exec(
        &held,
        &json!({ "command": "touch /tmp/lower", "wait_seconds": 10 }),
    );
    assert_eq!(v["exit_code"], 0, "{v}");
    assert!(
        wait_paused(&node, &held, Duration::from_secs(20)),
        "a sandbox whose hold was lowered did not pause"
    );
    let v = node.exec(
        &held,
        &json!({ "command": "cat /tmp/notices", "wait_seconds": 10 }),
    );
    assert_eq!(stdout(&v), "sleep 1500\n", "{v}");
    for id in [&held, &capped, &plain] {
        node.delete_sandbox(id);
    }
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn paused_sandboxes_sleep_at_once_when_the_host_is_short_of_memory() {
    // Every amount of memory is short of this: a paused sandbox sleeps without waiting for
    // its suspend_after_ms (600 s).
    let node = TestNode::start_with(&[
        "--sleep-after-seconds",
        "1",
        "--sleep-memory-below-bytes",
        "18446744073709551615",
    ]);
    let id = counter_sandbox(
        &node,
        json!({ "sleep_after_seconds": 1, "suspend_after_ms": 600000 }),
    );
    assert_eq!(ask(&node, &id), 1);
    let end = Instant::now() + Duration::from_secs(30);
    while status(&node, &id) != "sleeping" {
        assert!(
            Instant::now() < end,
            "a paused sandbox did not sleep for memory"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(ask(&node, &id), 2);
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn a_sleep_asked_for_cuts_the_streams_still_open_and_the_command_goes_on_after() {
    use std::io::{Read, Write};
    let node = TestNode::start();
    let v = node.create_sandbox(&json!({ "sleep_after_seconds": null }));
    let id = v["id"].as_str().unwrap().to_string();
    let e = node.exec(
        &id,
        &json!({ "command": "i=0; while :; do i=$((i+1)); echo $i; sleep 0.1; done", "wait_seconds": 0 }),
    );
    let exe = e["id"].as_str().unwrap().to_string();
    // An event stream of its output, open while the sleep is asked for.
    let mut stream = std::net::TcpStream::connect(&node.addr).expect("connect");
    write!(
        stream,
        "GET /v1/sandboxes/{id}/exec/{exe}/output HTTP/1.1\r\nHost: {}\r\nAccept: text/event-stream\r\n\r\n",
        node.addr
    )
    .unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut first = [0u8; 512];
    let n = stream.read(&mut first).expect("the stream's first bytes");
    assert!(
        String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&first[..n])
    );
    let (s, v) = post(&node, &format!("/v1/sandboxes/{id}/sleep"), json!({}));
    assert_eq!(s, 200, "a sleep asked for while a stream is open: {v}");
    assert_eq!(v["status"], "sleeping", "{v}");
    // The stream was cut: it ends (or fails) rather than hanging.
    let mut rest = Vec::new();
    let ended = stream.read_to_end(&mut rest);
    assert!(
        ended.is_ok()
            || ended
                .as_ref()
                .is_err_and(|e| e.kind() != std::io::ErrorKind::WouldBlock
                    && e.kind() != std::io::ErrorKind::TimedOut),
        "the stream was not cut: {ended:?}"
    );
    // The command goes on after the wake, under its id.
    let (s, v) = post(&node, &format!("/v1/sandboxes/{id}/wake"), json!({}));
    assert_eq!(s, 200, "{v}");
    std::thread::sleep(Duration::from_millis(500));
    let (s, v) = get_json(&node, &format!("/v1/sandboxes/{id}/exec/{exe}"));
    assert_eq!((s, v["status"].as_str()), (200, Some("running")), "{v}");
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}

/// An echo server on port 7100, a line at a time, one connection after another.
const ECHO: &str = r#"import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', 7100))
s.listen(4)
while True:
    c, _ = s.accept()
    for line in c.makefile('rb'):
        c.sendall(line)
    c.close()
"#;

#[test]
fn a_connection_from_the_host_survives_sleep_and_wake_and_what_it_sent_meanwhile_arrives() {
    use std::io::{BufRead, BufReader, Write};
    let node = TestNode::start_with(&["--egress-default", "allow"]);
    let r = node.post_json(
        "/v1/sandboxes",
        &json!({
            "start_command": ["python3", "-c", ECHO],
            "ready": { "command": "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 7100), timeout=1)\"" },
            "sleep_after_seconds": null,
        }),
    );
    let v = r.json();
    assert_eq!(r.status, 201, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let end = Instant::now() + Duration::from_secs(120);
    while status(&node, &id) != "running" {
        assert!(Instant::now() < end, "not running: {v}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let v2 = node.exec(
        &id,
        &json!({ "command": ["python3", "-c", "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect(('203.0.113.1', 9)); print(s.getsockname()[0])"], "wait_seconds": 10 }),
    );
    let addr: std::net::Ipv4Addr = stdout(&v2).trim().parse().expect("its address");
    let to = std::net::SocketAddr::from((addr, 7100));
    let conn = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(5)).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let mut w = conn.try_clone().expect("clone");
    let mut lines = BufReader::new(conn);
    let mut echo = |sent: &str| {
        let mut got = String::new();
        lines.read_line(&mut got).expect("an echo");
        assert_eq!(got, sent);
    };
    w.write_all(b"before\n").expect("write");
    echo("before\n");
    let (s, v) = post(&node, &format!("/v1/sandboxes/{id}/sleep"), json!({}));
    assert_eq!(s, 200, "{v}");
    assert_eq!(status(&node, &id), "sleeping");
    // Held at the host while it sleeps: dropped (retransmitted later), not reset.
    w.write_all(b"asleep\n").expect("write while it sleeps");
    std::thread::sleep(Duration::from_millis(300));
    let (s, v) = post(&node, &format!("/v1/sandboxes/{id}/wake"), json!({}));
    assert_eq!(s, 200, "{v}");
    echo("asleep\n");
    w.write_all(b"after\n").expect("write");
    echo("after\n");
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}

/// A network of its own for a test (`--net-range`): every host interface on it is its node's.
fn own_range(second: u8) -> String {
    format!("10.{second}.{}.0/24", std::process::id() % 250)
}

/// Host interfaces with an address on the node's range that are not named as the node's own
/// (a veth's host side that a restore retired, left behind).
fn foreign_links(node: &TestNode) -> Vec<String> {
    let (s, v) = get_json(node, "/internal/node");
    assert_eq!(s, 200, "{v}");
    let range: ipnet::Ipv4Net = v["network"]["range"]
        .as_str()
        .expect("the node's range")
        .parse()
        .expect("a range");
    let prefix = v["network"]["interface_prefix"]
        .as_str()
        .expect("the node's prefix")
        .to_string();
    let out = std::process::Command::new("ip")
        .args(["-o", "-4", "addr", "show"])
        .output()
        .expect("ip addr");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let name = f.get(1)?.split('@').next()?.to_string();
            let addr: std::net::Ipv4Addr = f.get(3)?.split('/').next()?.parse().ok()?;
            (range.contains(&addr) && !name.starts_with(&prefix)).then(|| l.to_string())
        })
        .collect()
}

#[test]
fn a_sandbox_made_before_the_node_restarted_sleeps_wakes_and_forks_after_it() {
    // On the network: its CA bundle (the node's egress CA) is bound in it, and each start of
    // the node writes the bundle again.
    let range = own_range(252);
    let mut node = TestNode::start_with(&["--egress-default", "allow", "--net-range", &range]);
    let id = counter_sandbox(&node, json!({}));
    assert_eq!(ask(&node, &id), 1);
    node.stop();
    node.restart();
    assert_eq!(ask(&node, &id), 2);
    let (s, v) = post(&node, &format!("/v1/sandboxes/{id}/sleep"), json!({}));
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["status"], "sleeping", "{v}");
    let (s, v) = post(&node, &format!("/v1/sandboxes/{id}/wake"), json!({}));
    assert_eq!(
        s, 200,
        "a sandbox made before the restart does not wake: {v}"
    );
    assert_eq!(ask(&node, &id), 3);
    let (s, v) = post(
        &node,
        &format!("/v1/sandboxes/{id}/fork"),
        json!({ "count": 1 }),
    );
    assert_eq!(s, 201, "{v}");
    let fork = v["sandboxes"][0]["id"].as_str().unwrap().to_string();
    assert_eq!(ask(&node, &fork), 4);
    // Again after a kill of the node: the sandbox runs on, sleeps and wakes.
    node.kill();
    node.restart();
    let (s, v) = post(&node, &format!("/v1/sandboxes/{id}/sleep"), json!({}));
    assert_eq!(s, 200, "{v}");
    assert_eq!(ask(&node, &id), 4);
    node.delete_sandbox(&fork);
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn a_wake_that_fails_leaves_the_sandbox_asleep_with_its_images_and_no_link_behind() {
    let range = own_range(254);
    let node = TestNode::start_with(&["--egress-default", "allow", "--net-range", &range]);
    let id = counter_sandbox(&node, json!({}));
    assert_eq!(ask(&node, &id), 1);
    let (s, v) = post(&node, &format!("/v1/sandboxes/{id}/sleep"), json!({}));
    assert_eq!(s, 200, "{v}");
    // Its memory's pages out of the way: the restore fails once its network is made.
    let images = node.data_dir.join("sleep").join(&id);
    let pages: Vec<PathBuf> = std::fs::read_dir(&images)
        .expect("the sleep's images")
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("pages-"))
        })
        .collect();
    assert!(!pages.is_empty(), "no pages in {}", images.display());
    for p in &pages {
        std::fs::rename(p, p.with_extension("away")).expect("move the pages away");
    }
    let (s, v) = post(&node, &format!("/v1/sandboxes/{id}/wake"), json!({}));
    assert_eq!(s, 500, "a wake without its pages: {v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("could not be woken")),
        "{v}"
    );
    assert_eq!(status(&node, &id), "sleeping");
    // Nothing of the failed restore stays on the host: no retired host side of its veth.
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let left = foreign_links(&node);
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < end,
            "a failed wake left interfaces: {left:#?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Its images were kept: with its pages back, the next wake goes on where it slept.
    for p in &pages {
        std::fs::rename(p.with_extension("away"), p).expect("the pages back");
    }
    assert_eq!(ask(&node, &id), 2);
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}
