//! The sandbox's agent against what a sandbox can do to it: root stays a user whatever
//! /etc/passwd holds; the output of many commands does not grow the agent; an agent that dies
//! fails its sandbox at once; deep tar uploads.

use std::time::{Duration, Instant};

use crate::common::{assert_error, TestNode};
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
    // A signal to its command: a conflict (the sandbox is not running, or the command has
    // ended), never "try again".
    let r = node.post_json(
        &format!("/v1/sandboxes/{id}/exec/{long_id}/signal"),
        &json!({"signal": "SIGTERM"}),
    );
    let v = r.json();
    assert_eq!(r.status, 409, "{v}");
    assert_eq!(v["error"]["retryable"], false, "{v}");
    // Nothing of it is left on the host (cgroups, directory, processes), before any delete.
    let deadline = Instant::now() + CLEAN;
    while !node.traces_of(&id).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(node.traces_of(&id), Vec::<String>::new());
    node.delete_sandbox(&id);
    node.assert_clean(CLEAN);
}

/// A tar of `depth` nested directories `d/d/…` (an entry each) and, at the bottom, `file`.
fn deep_tar(depth: usize, content: &[u8]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut path = String::new();
    for _ in 0..depth {
        path.push_str("d/");
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Directory);
        h.set_mode(0o755);
        h.set_size(0);
        b.append_data(&mut h, &path, &[][..])
            .expect("a directory entry");
    }
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_mode(0o644);
    h.set_size(content.len() as u64);
    b.append_data(&mut h, format!("{path}file"), content)
        .expect("the file entry");
    b.into_inner().expect("the archive")
}

/// `POST …/files/tar?path=`: the status and the answer.
fn tar_up(node: &TestNode, sandbox: &str, path: &str, archive: &[u8]) -> (u16, Value) {
    let r = node.post(
        &format!("/v1/sandboxes/{sandbox}/files/tar?path={path}"),
        &[("Content-Type", "application/x-tar")],
        archive,
    );
    (r.status, r.json())
}

#[test]
fn deeply_nested_tar_uploads_complete() {
    let node = TestNode::start();
    let sb = node.create_sandbox(&json!({}));
    let id = sb["id"].as_str().expect("id").to_string();
    for depth in [1000usize, 2000] {
        let content = format!("at depth {depth}\n");
        let dst = format!("/work/deep{depth}");
        let (status, v) = tar_up(&node, &id, &dst, &deep_tar(depth, content.as_bytes()));
        assert_eq!(status, 200, "depth {depth}: {v}");
        assert_eq!(v["entries"], depth as u64 + 1, "depth {depth}: {v}");
        assert_eq!(v["skipped"], 0, "depth {depth}: {v}");
        // Every directory, and the file with its bytes (read through a descriptor walk: the
        // path is longer than PATH_MAX at depth 2000).
        let check = run(
            &node,
            &id,
            &format!(
                "find {dst} -type d | wc -l; find {dst} -type f -name file -size {}c | wc -l",
                content.len()
            ),
            None,
        );
        assert_eq!(
            check["stdout"],
            format!("{}\n1\n", depth + 1),
            "depth {depth}: {check}"
        );
        // Uploading it again over itself (everything exists) works as well.
        let (status, v) = tar_up(&node, &id, &dst, &deep_tar(depth, b"again\n"));
        assert_eq!(status, 200, "again, depth {depth}: {v}");
        let check = run(
            &node,
            &id,
            &format!("find {dst} -type f -name file -size 6c | wc -l"),
            None,
        );
        assert_eq!(check["stdout"], "1\n", "again, depth {depth}: {check}");
    }
    // A file at depth 1000 reads back through the file API.
    let path = format!("/work/deep1000/{}file", "d/".repeat(1000));
    let r = node.get(&format!("/v1/sandboxes/{id}/files?path={path}"), &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.text(), "again\n");
    node.delete_sandbox(&id);
    node.assert_clean(CLEAN);
}

/// Whether any descriptor of process `pid` names `path` (as the process sees it).
fn holds_open(pid: u32, path: &str) -> bool {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    dir.flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .any(|l| l.to_string_lossy() == path)
}

/// Polls `f` every 20 ms until it is true or `timeout` is up: whether it became true.
fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_tar_upload_whose_client_hangs_up_stops() {
    use std::io::Write;
    let node = TestNode::start();
    let sb = node.create_sandbox(&json!({}));
    let id = sb["id"].as_str().expect("id").to_string();
    let agent = node.agent_pid(&id).expect("the agent's host pid");
    // An archive of one 256 MiB file, of which 8 MiB are sent before the client goes.
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_mode(0o644);
    h.set_size(256 << 20);
    h.set_path("big").expect("path");
    h.set_cksum();
    {
        let mut s = std::net::TcpStream::connect(&node.addr).expect("connect");
        let head = format!(
            "POST /v1/sandboxes/{id}/files/tar?path=/work/cut HTTP/1.1\r\nHost: {}\r\n\
             Content-Type: application/x-tar\r\nContent-Length: {}\r\n\r\n",
            node.addr,
            (256u64 << 20) + 1024 + 512
        );
        s.write_all(head.as_bytes()).expect("head");
        s.write_all(h.as_bytes()).expect("tar header");
        s.write_all(&vec![b'x'; 8 << 20]).expect("some data");
        assert!(
            eventually(WAIT, || holds_open(agent, "/work/cut/big")),
            "the agent never opened the file it unpacks"
        );
        // The client goes away (the socket closed without a word).
    }
    assert!(
        eventually(WAIT, || !holds_open(agent, "/work/cut/big")),
        "the agent still writes the upload after its client hung up"
    );
    // The agent lives on and serves.
    assert_eq!(node.agent_pid(&id), Some(agent));
    let v = run(&node, &id, "echo ok", None);
    assert_eq!(v["stdout"], "ok\n", "{v}");
    node.delete_sandbox(&id);
    node.assert_clean(CLEAN);
}

#[test]
fn tar_entries_never_go_through_symlinks() {
    let node = TestNode::start();
    let sb = node.create_sandbox(&json!({}));
    let id = sb["id"].as_str().expect("id").to_string();
    let before = run(&node, &id, "sha256sum /etc/passwd", None);
    let mut b = tar::Builder::new(Vec::new());
    let mut link = |name: &str, to: &str| {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        h.set_mode(0o777);
        b.append_link(&mut h, name, to).expect("symlink entry");
    };
    link("etc", "/etc");
    link("pw", "/etc/passwd");
    let mut file = |name: &str, data: &[u8]| {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        b.append_data(&mut h, name, data).expect("file entry");
    };
    // Through a symlink of the archive: skipped. Over a symlink: the symlink is replaced.
    file("etc/passwd", b"pwned\n");
    file("pw", b"pwned\n");
    let archive = b.into_inner().expect("archive");
    let (status, v) = tar_up(&node, &id, "/work/links", &archive);
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        (v["entries"].clone(), v["skipped"].clone()),
        (json!(3), json!(1)),
        "{v}"
    );
    let after = run(&node, &id, "sha256sum /etc/passwd", None);
    assert_eq!(after["stdout"], before["stdout"], "/etc/passwd was changed");
    let check = run(
        &node,
        &id,
        "cat /work/links/pw; readlink /work/links/etc",
        None,
    );
    assert_eq!(check["stdout"], "pwned\n/etc\n", "{check}");
    node.delete_sandbox(&id);
    node.assert_clean(CLEAN);
}
