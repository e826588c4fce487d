//! What `POST /v1/run` answers: exits, signals, timeouts, input, environment, users, output
//! limits, event streams, request ids and names.

use std::time::{Duration, Instant};

use crate::common::{
    assert_error, b64_decode, b64_encode, is_id, stdout, valid_request_id, TestNode,
};
use serde_json::json;

const CLEAN: Duration = Duration::from_secs(10);

#[test]
fn exit_codes_are_results() {
    let node = TestNode::start();
    for (command, code) in [
        (json!("true"), 0),
        (json!("exit 3"), 3),
        (json!(["false"]), 1),
        (json!("exit 255"), 255),
        (json!(["no-such-command-here"]), 127),
        (json!("no-such-command-here"), 127),
        (json!(["/etc/passwd"]), 126),
        (json!("kill -KILL $$; echo not reached"), 137),
    ] {
        let v = node.run_ok(&json!({ "command": command }));
        assert_eq!(v["exit_code"], code, "{command}: {v}");
        if code == 137 {
            assert_eq!(v["status"], "killed", "{command}: {v}");
            assert_eq!(v["signal"], "SIGKILL", "{command}: {v}");
            assert_eq!(v["stdout"], "", "{command}: {v}");
        } else {
            assert_eq!(v["status"], "exited", "{command}: {v}");
            assert!(v["signal"].is_null(), "{command}: {v}");
        }
        assert!(is_id("exe", v["id"].as_str().unwrap()), "{v}");
        assert!(is_id("sbx", v["sandbox_id"].as_str().unwrap()), "{v}");
        assert!(v["duration_seconds"].as_f64().unwrap() >= 0.0, "{v}");
        assert!(v["usage"].is_object(), "{v}");
        assert_eq!(v["tty"], false);
        assert_eq!(v["encoding"], "utf8");
    }
    node.assert_clean(CLEAN);
}

#[test]
fn a_signal_death_is_killed() {
    let node = TestNode::start();
    let v = node.run_ok(&json!({ "command": "kill -TERM $$" }));
    assert_eq!(v["status"], "killed", "{v}");
    assert_eq!(v["exit_code"], 143, "{v}");
    assert_eq!(v["signal"], "SIGTERM", "{v}");
    node.assert_clean(CLEAN);
}

#[test]
fn a_timeout_ends_the_command() {
    let node = TestNode::start();
    let t = Instant::now();
    let v = node.run_ok(&json!({ "command": "sleep 100", "timeout_seconds": 1 }));
    let took = t.elapsed();
    assert_eq!(v["status"], "timed_out", "{v}");
    assert!(
        took < Duration::from_secs(5),
        "the answer came after {took:?}"
    );
    let d = v["duration_seconds"].as_f64().unwrap();
    assert!((0.9..5.0).contains(&d), "duration {d}");
    // The process is gone with its sandbox.
    assert_eq!(v["exit_code"], 137, "{v}");
    assert_eq!(v["signal"], "SIGKILL", "{v}");
    // A command that ends by itself as its (shortest) deadline comes is `exited` with its own
    // code; `timed_out` is only ever a kill (it used to say timed_out with exit code 0).
    for _ in 0..10 {
        let v = node.run_ok(&json!({ "command": "true", "timeout_seconds": 0.001 }));
        match v["status"].as_str() {
            Some("exited") => assert_eq!(v["exit_code"], 0, "{v}"),
            Some("timed_out") => {
                assert_eq!(
                    (v["exit_code"].as_i64(), v["signal"].as_str()),
                    (Some(137), Some("SIGKILL")),
                    "{v}"
                )
            }
            _ => panic!("{v}"),
        }
    }
    node.assert_clean(CLEAN);
}

#[test]
fn stdin_as_text_and_as_base64() {
    let node = TestNode::start();
    let text = "héllo\nwörld €\n";
    let v = node.run_ok(&json!({ "command": "cat", "stdin": text }));
    assert_eq!(stdout(&v), text, "{v}");
    assert_eq!(v["output"]["stdout_bytes"], text.len());

    let bytes: Vec<u8> = (0..=255u8).rev().chain(0..=255u8).collect();
    let v = node.run_ok(&json!({
        "command": ["cat"],
        "stdin": b64_encode(&bytes),
        "encoding": "base64"
    }));
    assert_eq!(v["encoding"], "base64", "{v}");
    assert_eq!(b64_decode(stdout(&v)), bytes, "{v}");

    // Output that is not text comes back whole in base64.
    let v = node.run_ok(&json!({
        "command": "printf '\\377\\000\\001abc'; printf '\\376' >&2",
        "encoding": "base64"
    }));
    assert_eq!(b64_decode(stdout(&v)), b"\xff\x00\x01abc", "{v}");
    assert_eq!(b64_decode(v["stderr"].as_str().unwrap()), b"\xfe", "{v}");
    node.assert_clean(CLEAN);
}

#[test]
fn env_wins_over_the_image_and_its_path_finds_commands() {
    let node = TestNode::start();
    let v = node.run_ok(&json!({ "command": "echo $LANG" }));
    assert_eq!(stdout(&v), "C.UTF-8\n", "the image's LANG");
    let v = node.run_ok(&json!({
        "command": "echo $LANG $EXTRA",
        "env": { "LANG": "en_GB.UTF-8", "EXTRA": "a b" }
    }));
    assert_eq!(stdout(&v), "en_GB.UTF-8 a b\n", "{v}");

    // A list command is found along the PATH that env gives.
    let v = node.run_ok(&json!({
        "command": ["printenv", "PATH"],
        "env": { "PATH": "/usr/bin:/opt/nothing" }
    }));
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(stdout(&v), "/usr/bin:/opt/nothing\n");
    let v = node.run_ok(&json!({
        "command": ["printenv", "PATH"],
        "env": { "PATH": "/opt/nothing" }
    }));
    assert_eq!(v["exit_code"], 127, "found printenv outside PATH: {v}");
    // sysctl is in /usr/sbin only.
    let v = node.run_ok(&json!({
        "command": ["sysctl", "-n", "kernel.ostype"],
        "env": { "PATH": "/usr/sbin" }
    }));
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(stdout(&v), "Linux\n");
    let v = node.run_ok(&json!({
        "command": ["sysctl", "-n", "kernel.ostype"],
        "env": { "PATH": "/usr/bin" }
    }));
    assert_eq!(v["exit_code"], 127, "{v}");
    node.assert_clean(CLEAN);
}

#[test]
fn cwd() {
    let node = TestNode::start();
    let v = node.run_ok(&json!({ "command": "pwd", "cwd": "/etc" }));
    assert_eq!(stdout(&v), "/etc\n");
    let v = node.run_ok(&json!({ "command": "pwd", "cwd": "/does/not/exist" }));
    assert_eq!(v["status"], "exited", "{v}");
    assert_eq!(v["exit_code"], 126, "{v}");
    assert_eq!(v["stdout"], "", "{v}");
    node.assert_clean(CLEAN);
}

#[test]
fn list_and_string_commands() {
    let node = TestNode::start();
    let v = node.run_ok(&json!({ "command": ["echo", "$HOME", "a  b", "*"] }));
    assert_eq!(stdout(&v), "$HOME a  b *\n", "{v}");
    assert_eq!(v["command"], "echo $HOME a  b *");
    let v = node.run_ok(&json!({ "command": "echo $HOME" }));
    assert_eq!(stdout(&v), "/root\n", "{v}");
    assert_eq!(v["command"], "echo $HOME");
    node.assert_clean(CLEAN);
}

#[test]
fn users() {
    let node = TestNode::start();
    let v = node.run_ok(&json!({ "command": "id -u; id -g", "user": "nobody" }));
    assert_eq!(stdout(&v), "65534\n65534\n", "{v}");
    let v = node.run_ok(&json!({ "command": "id -u; id -g; id -G", "user": "1234:5678" }));
    assert_eq!(stdout(&v), "1234\n5678\n5678\n", "{v}");
    let v = node.run_ok(&json!({ "command": "id -u", "user": "0" }));
    assert_eq!(stdout(&v), "0\n", "{v}");
    let (status, body) = node.run(&json!({ "command": "id", "user": "no-such-user" }));
    assert_error(status, &body, 400, "no_such_user", Some("user"));
    node.assert_clean(CLEAN);
}

#[test]
fn output_over_one_mebibyte_keeps_the_last_one() {
    let node = TestNode::start();
    const N: usize = 3_000_000;
    const MIB: usize = 1 << 20;
    let expected: Vec<u8> = (0..N)
        .map(|i| b'a' + ((i * 31 + i / 977) % 26) as u8)
        .collect();
    let script = format!(
        "import sys\n\
         sys.stdout.buffer.write(bytes(97 + (i * 31 + i // 977) % 26 for i in range({N})))\n"
    );
    let v = node.run_ok(&json!({ "command": ["python3", "-c", script] }));
    assert_eq!(v["exit_code"], 0, "{}", v["stderr"]);
    let out = stdout(&v);
    assert_eq!(out.len(), MIB, "stdout is not 1 MiB");
    assert!(
        out.as_bytes() == &expected[N - MIB..],
        "stdout is not the last MiB of the output"
    );
    assert_eq!(v["truncated"], true);
    assert_eq!(v["output"]["stdout_bytes"], N);
    assert_eq!(v["output"]["stderr_bytes"], 0);
    assert_eq!(v["output"]["start"], 0);
    assert_eq!(v["output"]["end"], N);
    node.assert_clean(CLEAN);
}

#[test]
fn binary_output_over_one_mebibyte_keeps_the_last_one_in_base64() {
    let node = TestNode::start();
    const N: usize = 1_500_000;
    const MIB: usize = 1 << 20;
    // Bytes that are not text: a cut among them is no character's middle.
    let expected: Vec<u8> = (0..N).map(|i| 0x80 + (i % 61) as u8).collect();
    let script =
        format!("import sys\nsys.stdout.buffer.write(bytes(0x80 + i % 61 for i in range({N})))\n");
    let v = node.run_ok(&json!({ "command": ["python3", "-c", script], "encoding": "base64" }));
    assert_eq!(v["exit_code"], 0, "{}", v["stderr"]);
    let out = b64_decode(stdout(&v));
    assert_eq!(out.len(), MIB, "stdout is not the last MiB");
    assert!(
        out == expected[N - MIB..],
        "stdout is not the last MiB of the output"
    );
    assert_eq!(v["truncated"], true);
    assert_eq!(v["output"]["stdout_bytes"], N);
    node.assert_clean(CLEAN);
}

#[test]
fn event_stream_order_and_ids() {
    let node = TestNode::start();
    let events = node.run_sse(&json!({
        "command": "for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 0.05; done; printf tail",
        "stream": true
    }));
    let start = &events[0];
    assert_eq!(start.event, "start", "{events:?}");
    assert_eq!(start.id, 0);
    assert_eq!(start.data["status"], "running");
    assert!(start.data["exit_code"].is_null());
    let exit = events.last().unwrap();
    assert_eq!(exit.event, "exit", "{events:?}");
    assert_eq!(exit.data["status"], "exited");
    assert_eq!(exit.data["exit_code"], 0);
    assert_eq!(exit.id, exit.data["output"]["end"].as_u64().unwrap());
    assert_eq!(exit.data["id"], start.data["id"]);
    assert_eq!(exit.data["sandbox_id"], start.data["sandbox_id"]);

    let (mut out, mut err) = (String::new(), String::new());
    let mut cursor = 0u64;
    for e in &events[1..events.len() - 1] {
        let data = e.data["data"].as_str().unwrap();
        let position = e.data["position"].as_u64().unwrap();
        match e.event.as_str() {
            "stdout" => out.push_str(data),
            "stderr" => err.push_str(data),
            other => panic!("unexpected event {other}: {events:?}"),
        }
        assert_eq!(
            position, cursor,
            "events do not follow each other: {events:?}"
        );
        assert_eq!(e.id, position + data.len() as u64, "{e:?}");
        assert!(e.id > cursor, "ids do not increase: {events:?}");
        cursor = e.id;
    }
    assert_eq!(cursor, exit.id, "the exit is not after the last output");
    assert_eq!(out, "out1\nout2\nout3\ntail");
    assert_eq!(err, "err1\nerr2\nerr3\n");
    assert_eq!(exit.data["stdout"], out.as_str());
    assert_eq!(exit.data["stderr"], err.as_str());
    assert_eq!(exit.data["output"]["stdout_bytes"], out.len());
    assert_eq!(exit.data["output"]["stderr_bytes"], err.len());
    node.assert_clean(CLEAN);
}

#[test]
fn accept_header_alone_streams() {
    let node = TestNode::start();
    // No stream field: the Accept header decides.
    let events = node.run_sse(&json!({ "command": "echo hi" }));
    let kinds: Vec<&str> = events.iter().map(|e| e.event.as_str()).collect();
    assert_eq!(kinds, ["start", "stdout", "exit"], "{events:?}");
    assert_eq!(events[1].data["data"], "hi\n");
    // Without it the answer is JSON; stream: false wins over the header.
    let r = node.run_with(&json!({ "command": "echo hi" }), &[]);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("application/json"));
    let r = node.run_with(
        &json!({ "command": "echo hi", "stream": false }),
        &[("Accept", "text/event-stream")],
    );
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("application/json"));
    assert_eq!(r.json()["stdout"], "hi\n");
    let r = node.run_with(
        &json!({ "command": "echo hi", "stream": true }),
        &[("Accept", "application/json")],
    );
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    node.assert_clean(CLEAN);
}

#[test]
fn request_ids_are_echoed_or_made() {
    let node = TestNode::start();
    let r = node.run_with(
        &json!({ "command": "true" }),
        &[("X-Request-Id", "my-req.id_42")],
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-request-id"), Some("my-req.id_42"));

    let r = node.run_with(&json!({}), &[("X-Request-Id", "my-req.id_43")]);
    assert_eq!(r.header("x-request-id"), Some("my-req.id_43"));
    let body = r.json();
    assert_error(r.status, &body, 400, "missing_command", Some("command"));
    assert_eq!(body["error"]["request_id"], "my-req.id_43");

    let long = "x".repeat(65);
    for bad in ["bad id!", "a/b", long.as_str()] {
        let r = node.run_with(&json!({}), &[("X-Request-Id", bad)]);
        let rid = r.header("x-request-id").expect("a request id").to_string();
        assert_ne!(rid, bad);
        assert!(valid_request_id(&rid), "{rid}");
        assert!(is_id("req", &rid), "{rid}");
        let body = r.json();
        assert_eq!(body["error"]["request_id"], rid.as_str());
    }
    // Made ids differ.
    let a = node.run_with(&json!({}), &[]);
    let b = node.run_with(&json!({}), &[]);
    assert_ne!(a.header("x-request-id"), b.header("x-request-id"));
    node.assert_clean(CLEAN);
}

#[test]
fn a_name_is_free_again_after_the_answer() {
    let node = TestNode::start();
    for _ in 0..3 {
        let v = node.run_ok(&json!({ "command": "true", "name": "reused-name" }));
        assert_eq!(v["exit_code"], 0);
    }
    let mut held = node.open_sse(&json!({ "command": "sleep 30", "name": "held-name" }));
    let start = held.next_event().expect("start event");
    assert_eq!(start.event, "start");
    let (status, body) = node.run(&json!({ "command": "true", "name": "held-name" }));
    assert_error(status, &body, 409, "name_taken", Some("name"));
    // Other names are free meanwhile.
    node.run_ok(&json!({ "command": "true", "name": "other-name" }));
    drop(held);
    node.assert_clean(CLEAN);
    let v = node.run_ok(&json!({ "command": "true", "name": "held-name" }));
    assert_eq!(v["exit_code"], 0);
    node.assert_clean(CLEAN);
}

#[test]
fn tmp_in_memory() {
    let node = TestNode::start();
    let v = node.run_ok(&json!({ "command": ["stat", "-f", "-c", "%T", "/tmp"], "tmp": "memory" }));
    assert_eq!(stdout(&v), "tmpfs\n", "{v}");
    let v = node.run_ok(&json!({ "command": ["stat", "-f", "-c", "%T", "/tmp"] }));
    assert_ne!(stdout(&v), "tmpfs\n", "{v}");
    node.assert_clean(CLEAN);
}

#[test]
fn children_left_behind_do_not_hold_the_answer() {
    let node = TestNode::start();
    let t = Instant::now();
    let v = node.run_ok(&json!({ "command": "sleep 60 & echo started" }));
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(v["status"], "exited", "{v}");
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(stdout(&v), "started\n");
    // The sleep goes with the sandbox.
    node.assert_clean(CLEAN);
}

#[test]
fn warm_sandboxes_serve_runs_and_the_pool_refills() {
    // The pool of sandboxes made for runs (the kept kind's is the creates').
    let node = TestNode::start_with(&["--warm-pool", "0", "--warm-runs", "2"]);
    let wait_full = || {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let w = node.warm_ids();
            if w.len() == 2 || Instant::now() > deadline {
                return w;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let before = wait_full();
    assert_eq!(before.len(), 2, "the pool fills at start");
    // A run of the base image takes a warm sandbox, whatever limits it asks for.
    let v = node.run_ok(&json!({ "command": "cat /sys/fs/cgroup/memory.max 2>/dev/null; hostname", "limits": { "memory_bytes": 268435456u64 } }));
    let id = v["sandbox_id"].as_str().unwrap().to_string();
    assert!(before.contains(&id), "{id} was not one of {before:?}");
    assert!(stdout(&v).ends_with(&format!("{id}\n")), "{v}");
    let after = wait_full();
    assert_eq!(after.len(), 2, "the pool refills");
    assert!(
        !after.contains(&id),
        "a used sandbox never goes back to the pool"
    );
    // A run that wants another machine (its own hostname) gets a sandbox made for it.
    let v = node.run_ok(&json!({ "command": "hostname", "hostname": "my-box" }));
    assert_eq!(stdout(&v), "my-box\n");
    assert!(!after.contains(&v["sandbox_id"].as_str().unwrap().to_string()));
    node.assert_clean(CLEAN);
}

#[test]
fn a_warm_sandbox_that_died_is_not_handed_out() {
    let node = TestNode::start_with(&["--warm-pool", "0", "--warm-runs", "2"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut warm = node.warm_ids();
    while warm.len() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        warm = node.warm_ids();
    }
    assert_eq!(warm.len(), 2, "the pool fills at start");
    // Kill every warm agent from the host, as an operator or the OOM killer might.
    let mut pids = Vec::new();
    for id in &warm {
        let pid = node.agent_pid(id).expect("the warm sandbox's agent");
        kill_hard(pid);
        pids.push(pid);
    }
    // Until they have really ended (their exit takes their mounts down first).
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|p| {
        std::fs::read_to_string(format!("/proc/{p}/stat"))
            .is_ok_and(|s| !s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('Z')))
    }) {
        assert!(Instant::now() < deadline, "the killed agents did not end");
        std::thread::sleep(Duration::from_millis(10));
    }
    for _ in 0..3 {
        let v = node.run_ok(&json!({ "command": "echo alive" }));
        assert_eq!(stdout(&v), "alive\n", "{v}");
        assert!(
            !warm.contains(&v["sandbox_id"].as_str().unwrap().to_string()),
            "{v}"
        );
    }
    node.assert_clean(CLEAN);
}

fn kill_hard(pid: u32) {
    let status = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
}

#[test]
fn a_command_given_no_input_reads_dev_null_and_one_given_input_a_pipe() {
    let node = TestNode::start();
    let v = node.run_ok(&json!({ "command": "readlink /proc/self/fd/0; cat; echo end" }));
    assert_eq!(v["stdout"], "/dev/null\nend\n", "{v}");
    let v = node.run_ok(&json!({ "command": "readlink /proc/self/fd/0; cat", "stdin": "in\n" }));
    let out = v["stdout"].as_str().unwrap();
    assert!(out.starts_with("pipe:[") && out.ends_with("]\nin\n"), "{v}");
    // The same in a kept sandbox: an exec without stdin, and one that keeps it open.
    let sb = node.create_sandbox(&json!({}));
    let id = sb["id"].as_str().unwrap();
    let r = node.post_json(
        &format!("/v1/sandboxes/{id}/run"),
        &json!({ "command": "readlink /proc/self/fd/0" }),
    );
    assert_eq!(r.json()["stdout"], "/dev/null\n", "{}", r.text());
    let e = node.exec(
        id,
        &json!({ "command": "readlink /proc/self/fd/0; cat", "stdin_open": true }),
    );
    let eid = e["id"].as_str().unwrap();
    let r = node.post_json(
        &format!("/v1/sandboxes/{id}/exec/{eid}/stdin"),
        &json!({ "data": "late\n", "close": true }),
    );
    assert!(r.status < 300, "{}", r.text());
    let fin = node.exec_wait(id, eid, std::time::Duration::from_secs(10));
    let out = fin["stdout"].as_str().unwrap_or_default();
    assert!(
        out.starts_with("pipe:[") && out.ends_with("]\nlate\n"),
        "{fin}"
    );
    node.delete_sandbox(id);
}
