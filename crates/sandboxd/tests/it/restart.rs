//! A node killed with SIGKILL and started again over its data directory: its sandboxes and
//! their commands ran on, and it adopts them; a sandbox whose agent went away meanwhile is
//! `failed` (agent_lost), and nothing of it is left.

use std::time::{Duration, Instant};

use crate::common::{self, assert_error, get_json, TestNode};
use serde_json::json;

const CLEAN: Duration = Duration::from_secs(10);
const WAIT: Duration = Duration::from_secs(30);

fn list_ids(node: &TestNode) -> Vec<String> {
    let (status, v) = get_json(node, "/v1/sandboxes");
    assert_eq!(status, 200, "{v}");
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_string())
        .collect()
}

fn pid_alive(pid: u32) -> bool {
    // A zombie has no cmdline... but keeps its status; "Z" or "X" is dead.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X')),
        Err(_) => false,
    }
}

#[test]
fn commands_run_on_while_the_node_is_down_and_their_output_is_whole() {
    let mut node = TestNode::start();
    let id = node.create_sandbox(&json!({"name": "survivor", "metadata": {"k": "v"}}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let before = get_json(&node, &format!("/v1/sandboxes/{id}")).1;
    let v = node.exec(
        &id,
        &json!({"command": "for i in $(seq 1 100); do echo line $i; sleep 0.1; done"}),
    );
    let exec_id = v["id"].as_str().unwrap().to_string();
    assert_eq!(v["status"], "running", "{v}");
    let expected: String = (1..=100).map(|i| format!("line {i}\n")).collect();

    // Let it write for a while, then kill the node with SIGKILL.
    std::thread::sleep(Duration::from_millis(1500));
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{id}/exec/{exec_id}/output"));
    assert_eq!(status, 200, "{v}");
    let written_before = v["end"].as_u64().unwrap();
    assert!(written_before > 0, "no output yet: {v}");
    node.kill();
    // The command writes on while no node runs.
    std::thread::sleep(Duration::from_millis(1500));
    let agent = node
        .agent_pid(&id)
        .expect("the sandbox's agent is gone with the node");
    assert!(pid_alive(agent));
    node.restart();

    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{id}"));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["status"], "running", "the sandbox was not adopted: {v}");
    assert_eq!(v, before, "the adopted sandbox is not the same object");
    let (status, v) = get_json(&node, "/v1/sandboxes/survivor");
    assert_eq!((status, v["id"].as_str()), (200, Some(id.as_str())), "{v}");
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{id}/exec/{exec_id}"));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["status"], "running", "{v}");
    let now = v["output"]["end"].as_u64().unwrap();
    assert!(
        now > written_before,
        "no output was written while the node was down: {written_before} then {now}"
    );

    // It ends, and its output from position 0 is whole.
    let v = node.exec_wait(&id, &exec_id, WAIT);
    assert_eq!(v["status"], "exited", "{v}");
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(v["stdout"], expected.as_str(), "{v}");
    assert_eq!(v["output"]["end"], expected.len(), "{v}");
    assert_eq!(v["truncated"], false, "{v}");
    let (out, err, all) = node.output_all(&id, &exec_id);
    assert_eq!(
        String::from_utf8_lossy(&out),
        expected,
        "stdout read from 0"
    );
    assert!(err.is_empty(), "{}", String::from_utf8_lossy(&err));
    assert_eq!(all, expected.as_bytes());
    // In small pages too.
    let mut paged = Vec::new();
    let mut from = 0u64;
    while from < expected.len() as u64 {
        let (status, v) = get_json(
            &node,
            &format!(
                "/v1/sandboxes/{id}/exec/{exec_id}/output?from={from}&to={}",
                from + 97
            ),
        );
        assert_eq!(status, 200, "{v}");
        for c in v["chunks"].as_array().unwrap() {
            paged.extend_from_slice(c["data"].as_str().unwrap().as_bytes());
        }
        let next = v["next"].as_u64().unwrap();
        assert!(next > from, "{v}");
        from = next;
    }
    assert_eq!(String::from_utf8_lossy(&paged), expected);
    // Listed, ended.
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{id}/exec"));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["data"][0]["id"], exec_id.as_str(), "{v}");
    assert_eq!(v["data"][0]["status"], "exited", "{v}");

    // The adopted sandbox serves new commands, its slots are right, and it can be deleted.
    let v = node.exec(&id, &json!({"command": "echo after", "wait_seconds": 20}));
    assert_eq!(v["stdout"], "after\n", "{v}");
    node.delete_sandbox(&id);
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{id}"));
    assert_error(status, &v, 404, "sandbox_not_found", None);
    assert!(list_ids(&node).is_empty());
    node.assert_clean(CLEAN);
}

#[test]
fn a_command_running_across_a_restart_keeps_its_stdin_and_signals() {
    let mut node = TestNode::start();
    let id = node.create_sandbox(&json!({
        "start_command": "trap 'echo stopping; exit 0' TERM; while true; do sleep 0.05; done",
        "stop": {"grace_ms": 5000},
    }))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let cat = node.exec(&id, &json!({"command": ["cat"], "stdin_open": true}));
    let cat = cat["id"].as_str().unwrap().to_string();
    let sleeper = node.exec(&id, &json!({"command": "sleep 100"}));
    let sleeper = sleeper["id"].as_str().unwrap().to_string();
    let stdin = format!("/v1/sandboxes/{id}/exec/{cat}/stdin");
    let r = node.post_json(&stdin, &json!({"data": "before\n"}));
    assert_eq!(r.status, 200, "{}", r.text());

    node.kill();
    node.restart();

    let r = node.post_json(&stdin, &json!({"data": "after\n", "close": true}));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = node.exec_wait(&id, &cat, WAIT);
    assert_eq!(v["status"], "exited", "{v}");
    assert_eq!(v["stdout"], "before\nafter\n", "{v}");
    let r = node.post_json(
        &format!("/v1/sandboxes/{id}/exec/{sleeper}/signal"),
        &json!({"signal": "SIGTERM"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = node.exec_wait(&id, &sleeper, WAIT);
    assert_eq!(v["status"], "killed", "{v}");
    // Closed stdin stays closed across the restart.
    let r = node.post_json(&stdin, &json!({"data": "more\n"}));
    assert_error(r.status, &r.json(), 409, "stdin_closed", None);
    assert_eq!(v["signal"], "SIGTERM", "{v}");
    // The start command is the adopted one, still running; delete stops it with its signal.
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{id}/exec/exe-start"));
    assert_eq!(
        (status, v["status"].as_str()),
        (200, Some("running")),
        "{v}"
    );
    let t = Instant::now();
    node.delete_sandbox(&id);
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "the delete of an adopted sandbox waited {:?}",
        t.elapsed()
    );
    node.assert_clean(CLEAN);
}

#[test]
fn a_sandbox_whose_agent_died_while_the_node_was_down_is_failed_and_gone() {
    let mut node = TestNode::start();
    let lost = node.create_sandbox(&json!({"name": "lost-one", "start_command": "sleep 1000"}));
    let lost = lost["id"].as_str().unwrap().to_string();
    let kept = node.create_sandbox(&json!({"name": "kept-one"}));
    let kept = kept["id"].as_str().unwrap().to_string();
    let v = node.exec(&lost, &json!({"command": "echo hi", "wait_seconds": 20}));
    let lost_exec = v["id"].as_str().unwrap().to_string();
    let v = node.exec(&lost, &json!({"command": "sleep 100"}));
    let lost_running = v["id"].as_str().unwrap().to_string();
    let agent = node.agent_pid(&lost).expect("the agent of the sandbox");
    assert!(node.agent_pid(&kept).is_some());

    node.kill();
    // SAFETY: kill has no memory effects; the pid is the sandbox's agent, found just now.
    unsafe {
        libc::kill(agent as libc::pid_t, libc::SIGKILL);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while pid_alive(agent) {
        assert!(Instant::now() < deadline, "the agent {agent} does not die");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        !node.traces_of(&lost).is_empty(),
        "its cgroups and directory are there while the node is down"
    );
    node.restart();

    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{lost}"));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["status"], "failed", "{v}");
    assert_eq!(v["failure_code"], "agent_lost", "{v}");
    assert!(v["failure"].as_str().is_some_and(|f| !f.is_empty()), "{v}");
    let (status, v) = get_json(&node, "/v1/sandboxes/lost-one");
    assert_eq!(
        (status, v["id"].as_str()),
        (200, Some(lost.as_str())),
        "{v}"
    );
    let (status, v) = get_json(&node, "/v1/sandboxes?status=failed");
    assert_eq!(status, 200);
    assert_eq!(v["data"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v["data"][0]["id"], lost.as_str(), "{v}");
    let left = node.traces_of(&lost);
    assert!(left.is_empty(), "left of the lost sandbox: {left:?}");

    // A failed sandbox runs nothing; what it ran keeps an object.
    let r = node.post_json(
        &format!("/v1/sandboxes/{lost}/exec"),
        &json!({"command": "true"}),
    );
    assert_error(r.status, &r.json(), 409, "sandbox_not_running", None);
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{lost}/exec/{lost_exec}"));
    assert_eq!(status, 200, "{v}");
    assert_ne!(v["status"], "running", "{v}");
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{lost}/exec/{lost_running}"));
    assert_eq!(status, 200, "{v}");
    assert_ne!(
        v["status"], "running",
        "a command of a lost sandbox runs: {v}"
    );
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{lost}/exec"));
    assert_eq!(status, 200, "{v}");
    for e in v["data"].as_array().unwrap() {
        assert_ne!(e["status"], "running", "{e}");
    }

    // The other one was adopted.
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{kept}"));
    assert_eq!(
        (status, v["status"].as_str()),
        (200, Some("running")),
        "{v}"
    );
    let v = node.exec(&kept, &json!({"command": "echo alive", "wait_seconds": 20}));
    assert_eq!(v["stdout"], "alive\n", "{v}");

    // The failed one can be deleted, and its name is free again.
    let v = node.delete_sandbox(&lost);
    assert_eq!(v["failure_code"], "agent_lost", "{v}");
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{lost}"));
    assert_error(status, &v, 404, "sandbox_not_found", None);
    let again = node.create_sandbox(&json!({"name": "lost-one"}));
    let again = again["id"].as_str().unwrap().to_string();
    node.delete_sandbox(&again);
    node.delete_sandbox(&kept);
    assert!(list_ids(&node).is_empty(), "rows are left");
    node.assert_clean(CLEAN);

    // Nothing comes back on the next start either.
    node.kill();
    node.restart();
    assert!(list_ids(&node).is_empty(), "rows came back");
    node.assert_clean(CLEAN);
}

/// A checkpoint's CRIU that outlives a killed node stops the sandbox's processes under it
/// (ptrace) and sets the freezer back as it found it at its end: the next node waits for it
/// before it thaws a sandbox left frozen. Played here by the test itself: the sandbox frozen
/// through its group and its agent traced by a thread of the test while the node is down.
#[test]
fn an_adopted_sandbox_under_a_previous_checkpoint_s_tracer_is_thawed_after_it() {
    let mut node = TestNode::start();
    let id = node.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let agent = node.agent_pid(&id).expect("the sandbox's agent");
    let group = node.cgroup_dir("freezer").expect("a freezer").join(&id);
    let (state_file, frozen, thawed) = if group.join("freezer.state").exists() {
        ("freezer.state", "FROZEN", "THAWED")
    } else {
        ("cgroup.freeze", "1", "0")
    };
    let state = || {
        std::fs::read_to_string(group.join(state_file))
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    node.kill();
    std::fs::write(group.join(state_file), frozen).expect("freeze the sandbox");
    // The tracer: a thread that seizes the agent and ends (the kernel detaches it) when told.
    let (seized_tx, seized_rx) = std::sync::mpsc::channel();
    let (end_tx, end_rx) = std::sync::mpsc::channel::<()>();
    let tracer = std::thread::spawn(move || {
        // SAFETY: PTRACE_SEIZE of the agent's pid with no options; no memory is passed.
        let r = unsafe {
            libc::ptrace(
                libc::PTRACE_SEIZE,
                agent as libc::pid_t,
                std::ptr::null_mut::<libc::c_void>(),
                std::ptr::null_mut::<libc::c_void>(),
            )
        };
        seized_tx.send(r).unwrap();
        let _ = end_rx.recv();
    });
    assert_eq!(seized_rx.recv().unwrap(), 0, "seize the agent");
    node.restart();
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(state(), frozen, "thawed under the tracer");
    assert!(
        node.log_text().contains("still at work"),
        "{}",
        node.log_tail(20)
    );
    end_tx.send(()).unwrap();
    tracer.join().unwrap();
    let deadline = Instant::now() + WAIT;
    while state() != thawed {
        assert!(
            Instant::now() < deadline,
            "not thawed after the tracer ended"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let v = node.exec(&id, &json!({"command": "echo alive", "wait_seconds": 20}));
    assert_eq!(v["stdout"], "alive\n", "{v}");
    node.delete_sandbox(&id);
    node.assert_clean(CLEAN);
}

#[test]
fn an_expiry_outlives_a_node_restart() {
    let mut node = TestNode::start();
    let t = Instant::now();
    // Far enough ahead that a slow restart on a loaded machine does not outlive it.
    let at = common::rfc3339_in(Duration::from_secs(8));
    let sb = node.create_sandbox(&json!({"expires_at": at}));
    let id = sb["id"].as_str().unwrap().to_string();
    node.kill();
    node.restart();
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{id}"));
    assert_eq!(
        (status, v["status"].as_str()),
        (200, Some("running")),
        "{v}"
    );
    assert_eq!(v["expires_at"], at.as_str(), "{v}");
    let deadline = Instant::now() + Duration::from_secs(25);
    loop {
        let (status, v) = get_json(&node, &format!("/v1/sandboxes/{id}"));
        if status == 404 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not deleted {:?} after its create, expiring after 8 s: {v}",
            t.elapsed()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        t.elapsed() >= Duration::from_millis(7500),
        "{:?}",
        t.elapsed()
    );
    assert!(list_ids(&node).is_empty());
    node.assert_clean(CLEAN);

    // One that expired while the node was down is deleted when it starts.
    let at = common::rfc3339_in(Duration::from_secs(1));
    let sb = node.create_sandbox(&json!({"expires_at": at}));
    let id = sb["id"].as_str().unwrap().to_string();
    node.kill();
    std::thread::sleep(Duration::from_millis(1500));
    node.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    while get_json(&node, &format!("/v1/sandboxes/{id}")).0 != 404 {
        assert!(
            Instant::now() < deadline,
            "an expired sandbox outlived the restart"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    node.assert_clean(CLEAN);
}

#[test]
fn a_second_node_on_the_same_data_directory_is_refused() {
    let node = TestNode::start();
    let sb = node.create_sandbox(&json!({}));
    let out = std::process::Command::new(common::sandboxd_bin())
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--data-dir")
        .arg(&node.data_dir)
        .arg("--images-dir")
        .arg(&node.images_dir)
        .arg("--cgroup-name")
        .arg(format!("{}-second", node.cgroup_name))
        .arg("--warm-pool")
        .arg("0")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run a second sandboxd");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a second node started: {stderr}");
    assert!(
        stderr.contains("in use by another sandboxd"),
        "the refusal does not say why: {stderr}"
    );
    // It stopped before it made anything: no cgroup of its own.
    for controller in ["memory", "pids"] {
        let own = node.cgroup_dir(controller).expect("the node's cgroup");
        let dir = own.with_file_name(format!("{}-second", node.cgroup_name));
        assert!(!dir.exists(), "the refused node made {}", dir.display());
    }
    // The first node is untouched: its sandbox still runs commands.
    let id = sb["id"].as_str().unwrap();
    let v = node.exec(id, &json!({"command": "echo still", "wait_seconds": 20}));
    assert_eq!(v["stdout"], "still\n", "{v}");
    node.delete_sandbox(id);
    node.assert_clean(Duration::from_secs(10));
}

/// The `criu swrk` processes the node of pid `node` has waiting (its workers; criu may run
/// under the dynamic loader's name).
fn criu_workers(node: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some((_, rest)) = stat.rsplit_once(") ") else {
            continue;
        };
        let ppid = rest.split(' ').nth(1).and_then(|p| p.parse::<u32>().ok());
        let swrk = std::fs::read(format!("/proc/{pid}/cmdline"))
            .is_ok_and(|c| c.split(|b| *b == 0).any(|a| a == b"swrk"));
        if ppid == Some(node) && swrk {
            out.push(pid);
        }
    }
    out
}

#[test]
fn a_node_s_criu_workers_do_not_hold_another_node_s_disk() {
    let mut other = TestNode::start();
    let node = TestNode::start();
    let other_disk = format!(" {}/", other.data_dir.display());
    // A sleep and a wake take the node's workers; those made again after them start while
    // the other node's disk is mounted.
    let id = node.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    for verb in ["sleep", "wake"] {
        let r = node.post_json(&format!("/v1/sandboxes/{id}/{verb}"), &json!({}));
        assert_eq!(r.status, 200, "{verb}: {}", r.json());
    }
    let pid = node.pid().expect("the node runs");
    let end = Instant::now() + Duration::from_secs(5);
    let workers = loop {
        let w = criu_workers(pid);
        if w.len() >= 2 {
            break w;
        }
        assert!(
            Instant::now() < end,
            "the node {pid} has no criu workers waiting: {w:?}\n{}",
            String::from_utf8_lossy(
                &std::process::Command::new("ps")
                    .args(["-eo", "pid,ppid,comm"])
                    .output()
                    .expect("ps")
                    .stdout
            )
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    other.stop();
    for w in workers {
        let Ok(mounts) = std::fs::read_to_string(format!("/proc/{w}/mountinfo")) else {
            continue;
        };
        let held: Vec<&str> = mounts.lines().filter(|l| l.contains(&other_disk)).collect();
        assert!(
            held.is_empty(),
            "criu worker {w} of the node holds the stopped node's mounts: {held:#?}"
        );
    }
    node.delete_sandbox(&id);
    node.assert_clean(CLEAN);
}
