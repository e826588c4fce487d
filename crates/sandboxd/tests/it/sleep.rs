//! Idle sandboxes pause: after `sleep_after_seconds` with nothing of them in use, their
//! processes are frozen (the cgroup freezer); the next use resumes them. A sandbox with a
//! command running, or with `sleep_after_seconds: null`, never pauses.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::common::{assert_refused, create_req, create_with, exec_req, TestNode};
use sbx_api::{Command, ExecRequest, OnExpiry, Ready, RunRequest, SandboxStatus};
use sbx_client::{Client, Sandbox};

/// The freezer state of a sandbox's cgroup, read on the host (`FROZEN`, `THAWED`).
fn freezer_state(node: &TestNode, id: &str) -> String {
    let f = cgroup_dir(node, id, "freezer").join("freezer.state");
    std::fs::read_to_string(&f)
        .unwrap_or_else(|e| panic!("{}: {e}", f.display()))
        .trim()
        .to_string()
}

fn paused(c: &Client, id: &str) -> bool {
    c.sandbox(id).expect("get the sandbox").paused
}

fn wait_paused(c: &Client, id: &str, within: Duration) -> bool {
    let end = Instant::now() + within;
    while Instant::now() < end {
        if paused(c, id) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

#[test]
fn an_idle_sandbox_pauses_and_its_next_use_resumes_it() {
    let node = TestNode::start_with(&["--sleep-after-seconds", "1"]);
    let c = node.client();
    // The node's default (1 s), null (never), and one with a command running.
    let idle = c.create_sandbox(&create_req()).expect("create");
    let idle_id = idle.id.clone();
    assert_eq!(idle.sleep_after_seconds, Some(1.0), "{idle:?}");
    assert!(!idle.paused, "{idle:?}");
    let never = c
        .create_sandbox(&create_with(|s| s.sleep_after_seconds = Some(None)))
        .expect("create");
    let never_id = never.id.clone();
    assert!(never.sleep_after_seconds.is_none(), "{never:?}");
    let busy = c
        .create_sandbox(&create_with(|s| s.sleep_after_seconds = Some(Some(1.0))))
        .expect("create");
    let busy_id = busy.id.clone();
    let running_id = c
        .exec(&busy_id, &exec_req("sleep 4; echo slept"))
        .expect("exec")
        .id;

    // A process of its own counts in the background of the idle one: frozen, it stops.
    run_in(
        &c,
        &idle_id,
        "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done' >/dev/null 2>&1 < /dev/null &",
    );

    assert!(
        wait_paused(&c, &idle_id, Duration::from_secs(10)),
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
    let out = run_in(&c, &idle_id, "sleep 0.3; cat /tmp/count");
    let n: u64 = out.trim().parse().expect("a count");
    assert!(
        n > before.trim().parse::<u64>().expect("a count"),
        "the count did not go on: {before} then {n}"
    );
    assert_ne!(freezer_state(&node, &idle_id), "FROZEN");

    // Never by itself, and never while a command runs.
    assert!(!paused(&c, &never_id), "sleep_after_seconds null paused");
    assert!(
        !paused(&c, &busy_id),
        "a sandbox with a command running paused"
    );
    let done = c
        .wait_exec_for(&busy_id, &running_id, Duration::from_secs(20))
        .expect("wait");
    assert_eq!(done.stdout, "slept\n", "{done:?}");
    // Its command done, it pauses in turn.
    assert!(
        wait_paused(&c, &busy_id, Duration::from_secs(10)),
        "a sandbox whose command ended did not pause"
    );
    // A paused sandbox is deleted as any other, and nothing of it is left.
    for id in [&idle_id, &never_id, &busy_id] {
        c.delete_sandbox(id).expect("delete");
    }
    node.assert_clean(Duration::from_secs(10));
}

/// The command line `line`, waited for up to 10 s: its stdout (it must exit 0).
fn run_in(c: &Client, id: &str, line: &str) -> String {
    let v = c
        .exec(
            id,
            &ExecRequest {
                wait_seconds: 10.0,
                ..exec_req(line)
            },
        )
        .unwrap_or_else(|e| panic!("{line}: {e}"));
    assert_eq!(v.exit_code, Some(0), "{line}: {v:?}");
    v.stdout
}

/// `python3 -c CODE` in the sandbox, waited for up to 10 s: its stdout.
fn python_in(c: &Client, id: &str, code: &str) -> String {
    let v = c
        .exec(
            id,
            &ExecRequest {
                wait_seconds: 10.0,
                ..ExecRequest::new(argv(&["python3", "-c", code]))
            },
        )
        .unwrap_or_else(|e| panic!("python3 -c {code}: {e}"));
    assert_eq!(v.exit_code, Some(0), "{v:?}");
    v.stdout
}

fn argv(args: &[&str]) -> Command {
    Command::Argv(args.iter().map(|a| a.to_string()).collect())
}

/// Python that prints the sandbox's address: the source of a route out (no packet is sent).
const ADDR: &str = "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect(('203.0.113.1', 9)); print(s.getsockname()[0])";

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

/// A sandbox whose start command is `python3 -c CODE`, up once `check` (Python) succeeds,
/// never paused by itself, with what `set` sets: its id, once it is running (the first
/// sandbox of its settings builds their template: answered starting).
fn service_sandbox(
    c: &Client,
    code: &str,
    check: &str,
    set: impl FnOnce(&mut RunRequest),
) -> String {
    let create = create_with(|s| {
        s.start_command = Some(argv(&["python3", "-c", code]));
        s.ready = Some(Ready::Command(Command::Shell(format!(
            "python3 -c \"{check}\""
        ))));
        s.sleep_after_seconds = Some(None);
        set(s);
    });
    let v = c.create_sandbox(&create).expect("create");
    let end = Instant::now() + Duration::from_secs(120);
    while status(c, &v.id) != SandboxStatus::Running {
        assert!(Instant::now() < end, "not running: {v:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    v.id.clone()
}

fn counter_sandbox(c: &Client, set: impl FnOnce(&mut RunRequest)) -> String {
    service_sandbox(
        c,
        COUNTER,
        "import socket; socket.create_connection(('127.0.0.1', 7000), timeout=1)",
        set,
    )
}

/// One connection to the counter: the count it answers.
fn ask(c: &Client, id: &str) -> u64 {
    let out = python_in(c, id, ASK);
    out.trim()
        .parse()
        .unwrap_or_else(|_| panic!("a count: {out:?}"))
}

fn status(c: &Client, id: &str) -> SandboxStatus {
    c.sandbox(id).expect("get the sandbox").status
}

/// `POST …/sleep`, which must succeed: the sandbox, asleep.
fn sleep(c: &Client, id: &str) -> Sandbox {
    let v = c
        .sleep_sandbox(id)
        .unwrap_or_else(|e| panic!("sleep {id}: {e}"));
    assert_eq!(v.status, SandboxStatus::Sleeping, "{v:?}");
    v
}

/// `POST …/wake`, which must succeed: the sandbox, running.
fn wake(c: &Client, id: &str) -> Sandbox {
    let v = c
        .wake_sandbox(id)
        .unwrap_or_else(|e| panic!("wake {id}: {e}"));
    assert_eq!(v.status, SandboxStatus::Running, "{v:?}");
    v
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

#[test]
fn a_sleeping_sandbox_keeps_its_processes_memory_and_socket_across_wake_and_node_restart() {
    let mut node = TestNode::start();
    let c = node.client();
    let info = c.node_info().expect("the node");
    assert_eq!(info.other["checkpoints"]["available"], true, "{info:?}");
    let id = counter_sandbox(&c, |_| {});
    assert_eq!(ask(&c, &id), 1);
    assert_eq!(ask(&c, &id), 2);
    let mem = cgroup_dir(&node, &id, "memory");
    let awake = memory_usage(&mem);
    assert!(awake > 40 << 20, "the counter's memory: {awake}");

    sleep(&c, &id);
    let asleep = memory_usage(&mem);
    assert!(
        asleep < awake / 4,
        "asleep, its memory was not freed: {awake} then {asleep}"
    );
    // The next use wakes it where it was: the count in memory, the listening socket.
    assert_eq!(ask(&c, &id), 3);
    assert_eq!(status(&c, &id), SandboxStatus::Running);

    // Asleep across a restart of the node, and woken after it.
    sleep(&c, &id);
    node.stop();
    node.restart();
    let c = node.client();
    assert_eq!(status(&c, &id), SandboxStatus::Sleeping);
    wake(&c, &id);
    assert_eq!(ask(&c, &id), 4);
    // A command started before a sleep keeps its id and output across it.
    let exec_id = c
        .exec(&id, &exec_req("echo before; sleep 2; echo after"))
        .expect("exec")
        .id;
    std::thread::sleep(Duration::from_millis(300));
    sleep(&c, &id);
    let done = c
        .wait_exec_for(&id, &exec_id, Duration::from_secs(30))
        .expect("wait");
    assert_eq!(done.stdout, "before\nafter\n", "{done:?}");
    c.delete_sandbox(&id).expect("delete");
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn forks_go_on_from_the_same_count_then_apart_and_a_snapshot_outlives_its_sandbox() {
    let node = TestNode::start();
    let c = node.client();
    let id = counter_sandbox(&c, |_| {});
    for want in 1..=3 {
        assert_eq!(ask(&c, &id), want);
    }
    run_in(&c, &id, "echo original > /tmp/who");
    let v = c.fork_sandbox(&id, 2).expect("fork");
    let snap = v.snapshot.id.clone();
    assert!(snap.starts_with("snap-"), "{v:?}");
    let forks: Vec<String> = v.sandboxes.iter().map(|s| s.id.clone()).collect();
    assert_eq!(forks.len(), 2, "{v:?}");
    for f in &forks {
        assert_ne!(f, &id);
        assert_eq!(status(&c, f), SandboxStatus::Running);
    }
    // Each goes on from the count of the instant of the fork, on its own.
    assert_eq!(ask(&c, &forks[0]), 4);
    assert_eq!(ask(&c, &forks[0]), 5);
    assert_eq!(ask(&c, &forks[1]), 4);
    assert_eq!(ask(&c, &id), 4);
    // Its own files: a write in one is not in the other.
    run_in(&c, &forks[0], "echo fork > /tmp/who");
    assert_eq!(run_in(&c, &forks[1], "cat /tmp/who"), "original\n");
    // Its own hostname.
    assert_eq!(run_in(&c, &forks[1], "hostname").trim(), forks[1]);

    // The snapshot is listed, and outlives its sandbox.
    let list = c.snapshots().expect("the snapshots");
    assert!(list.data.iter().any(|x| x.id == snap), "{list:?}");
    c.delete_sandbox(&id).expect("delete");
    let v = c.snapshot(&snap).expect("the snapshot");
    assert_eq!(v.status, "ready", "{v:?}");
    assert_eq!(v.sandbox_id, id, "{v:?}");
    assert!(v.size_bytes > 0, "{v:?}");
    let made = c
        .create_sandbox(&create_with(|s| s.snapshot = Some(snap.clone())))
        .expect("a create from the snapshot");
    assert_eq!(made.status, SandboxStatus::Running, "{made:?}");
    assert_eq!(ask(&c, &made.id), 4);
    // The refusals of a create from a snapshot.
    let e = c
        .create_sandbox(&create_with(|s| {
            s.snapshot = Some(snap.clone());
            s.start_command = Some(Command::Shell("true".into()));
        }))
        .expect_err("a snapshot with a start command");
    assert_eq!(e.node().map(|n| n.status), Some(400), "{e:?}");
    assert_refused(
        c.create_sandbox(&create_with(|s| s.snapshot = Some("snap-nothere".into()))),
        404,
        "snapshot_not_found",
        Some("snapshot"),
    );
    c.delete_snapshot(&snap).expect("delete the snapshot");
    for f in forks.iter().chain([&made.id]) {
        c.delete_sandbox(f).expect("delete");
    }
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn an_idle_sandbox_pauses_then_sleeps_and_the_next_exec_wakes_it() {
    let node = TestNode::start();
    let c = node.client();
    let id = counter_sandbox(&c, |s| {
        s.sleep_after_seconds = Some(Some(1.0));
        s.suspend_after_ms = Some(1000);
    });
    assert_eq!(ask(&c, &id), 1);
    let mem = cgroup_dir(&node, &id, "memory");
    let awake = memory_usage(&mem);
    let end = Instant::now() + Duration::from_secs(20);
    while status(&c, &id) != SandboxStatus::Sleeping {
        assert!(Instant::now() < end, "an idle sandbox did not sleep");
        std::thread::sleep(Duration::from_millis(200));
    }
    let asleep = memory_usage(&mem);
    assert!(asleep < awake / 4, "memory {awake} then {asleep}");
    assert_eq!(ask(&c, &id), 2);
    c.delete_sandbox(&id).expect("delete");
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn a_node_without_criu_says_so_and_refuses_sleep_with_503() {
    let node = TestNode::start_with(&["--criu", "/nonexistent/criu"]);
    let c = node.client();
    let info = c.node_info().expect("the node");
    assert_eq!(info.other["checkpoints"]["available"], false, "{info:?}");
    assert!(info.other["checkpoints"]["reason"].is_string(), "{info:?}");
    let id = c.create_sandbox(&create_req()).expect("create").id.clone();
    let refused = |what: &str, e: sbx_client::Error| {
        assert_eq!(
            (e.node().map(|n| n.status), e.code().map(|c| c.as_str())),
            (Some(503), Some("not_served_here")),
            "{what}: {e:?}"
        );
    };
    refused("sleep", c.sleep_sandbox(&id).expect_err("a sleep"));
    refused(
        "snapshot",
        c.snapshot_sandbox(&id, None).expect_err("a snapshot"),
    );
    refused("fork", c.fork_sandbox(&id, 1).expect_err("a fork"));
    refused(
        "on_expiry sleep",
        c.create_sandbox(&create_with(|s| {
            s.on_expiry = OnExpiry::Sleep;
            s.expires_at = Some(crate::common::rfc3339_in(Duration::from_secs(60)));
        }))
        .expect_err("a create that sleeps at its expiry"),
    );
    // Everything else works.
    assert_eq!(run_in(&c, &id, "echo ok"), "ok\n");
    c.delete_sandbox(&id).expect("delete");
}

#[test]
fn a_sandbox_on_the_network_sleeps_and_wakes_again_and_again_and_forks() {
    let node = TestNode::start_with(&["--egress-default", "allow"]);
    let c = node.client();
    let id = counter_sandbox(&c, |_| {});
    // The sandbox's address: the source of a route out (no packet is sent).
    let addr = |id: &str| python_in(&c, id, ADDR).trim().to_string();
    let before = addr(&id);
    assert!(before.starts_with("10."), "{before}");
    for want in 1..=3 {
        sleep(&c, &id);
        assert_eq!(ask(&c, &id), want, "wake {want}");
        assert_eq!(addr(&id), before, "its address after wake {want}");
    }
    let v = c.fork_sandbox(&id, 1).expect("fork");
    let fork = v.sandboxes[0].id.clone();
    assert_eq!(ask(&c, &fork), 4);
    assert_ne!(addr(&fork), before, "a fork has an address of its own");
    // The fork sleeps and wakes as any sandbox.
    sleep(&c, &fork);
    assert_eq!(ask(&c, &fork), 5);
    c.delete_sandbox(&fork).expect("delete");
    c.delete_sandbox(&id).expect("delete");
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
fn start_holder(c: &Client, id: &str) {
    let v = c
        .exec(
            id,
            &ExecRequest {
                env: crate::common::kv(&[("HOLDER", HOLDER)]),
                wait_seconds: 10.0,
                ..exec_req(
                    "printf '%s' \"$HOLDER\" > /tmp/holder.py && setsid python3 /tmp/holder.py >/tmp/holder.log 2>&1 </dev/null &",
                )
            },
        )
        .expect("start the holder");
    assert_eq!(v.exit_code, Some(0), "{v:?}");
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let out = run_in(c, id, "cat /tmp/held /tmp/holder.log 2>/dev/null; true");
        if out.starts_with("yes") {
            return;
        }
        assert!(Instant::now() < end, "the holder did not hold: {out}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_hold_on_run_sbx_awake_keeps_a_sandbox_up_and_its_programs_are_told_before_it_pauses() {
    let node = TestNode::start_with(&["--sleep-after-seconds", "1"]);
    let c = node.client();
    let held = c
        .create_sandbox(&create_with(|s| {
            s.sleep_notice_ms = Some(1500);
            s.sleep_hold_max_ms = Some(600000);
        }))
        .expect("create");
    assert_eq!(held.sleep_notice_ms, Some(1500), "{held:?}");
    assert_eq!(held.sleep_hold_max_ms, 600000, "{held:?}");
    let held = held.id.clone();
    let capped = c
        .create_sandbox(&create_with(|s| s.sleep_hold_max_ms = Some(1000)))
        .expect("create");
    assert!(capped.sleep_notice_ms.is_none(), "{capped:?}");
    let capped = capped.id.clone();
    let plain = c.create_sandbox(&create_req()).expect("create");
    assert_eq!(plain.sleep_hold_max_ms, 30000, "the default: {plain:?}");
    let plain = plain.id.clone();
    start_holder(&c, &held);
    start_holder(&c, &capped);

    // Idle for three times its sleep_after_seconds, the held one runs on (reading its object
    // is not a use); past its sleep_hold_max_ms the capped one pauses whatever holds it.
    assert!(
        wait_paused(&c, &capped, Duration::from_secs(15)),
        "a hold past sleep_hold_max_ms kept a sandbox up"
    );
    assert!(
        wait_paused(&c, &plain, Duration::from_secs(15)),
        "a sandbox without holds did not pause"
    );
    std::thread::sleep(Duration::from_secs(3));
    assert!(!paused(&c, &held), "a held sandbox paused");
    assert_ne!(freezer_state(&node, &held), "FROZEN");

    // Its hold lowered, it pauses: its program told first.
    run_in(&c, &held, "touch /tmp/lower");
    assert!(
        wait_paused(&c, &held, Duration::from_secs(20)),
        "a sandbox whose hold was lowered did not pause"
    );
    assert_eq!(run_in(&c, &held, "cat /tmp/notices"), "sleep 1500\n");
    for id in [&held, &capped, &plain] {
        c.delete_sandbox(id).expect("delete");
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
    let c = node.client();
    let id = counter_sandbox(&c, |s| {
        s.sleep_after_seconds = Some(Some(1.0));
        s.suspend_after_ms = Some(600000);
    });
    assert_eq!(ask(&c, &id), 1);
    let end = Instant::now() + Duration::from_secs(30);
    while status(&c, &id) != SandboxStatus::Sleeping {
        assert!(
            Instant::now() < end,
            "a paused sandbox did not sleep for memory"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(ask(&c, &id), 2);
    c.delete_sandbox(&id).expect("delete");
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn a_sleep_asked_for_cuts_the_streams_still_open_and_the_command_goes_on_after() {
    use std::io::{Read, Write};
    let node = TestNode::start();
    let c = node.client();
    let id = c
        .create_sandbox(&create_with(|s| s.sleep_after_seconds = Some(None)))
        .expect("create")
        .id
        .clone();
    let exe = c
        .exec(
            &id,
            &exec_req("i=0; while :; do i=$((i+1)); echo $i; sleep 0.1; done"),
        )
        .expect("exec")
        .id;
    // An event stream of its output, open while the sleep is asked for (over a socket of its
    // own: how the connection ends is what is looked at).
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
    sleep(&c, &id);
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
    wake(&c, &id);
    std::thread::sleep(Duration::from_millis(500));
    let v = c
        .exec_object(&id, &exe, 0.0, sbx_api::Encoding::Utf8)
        .expect("the command");
    assert_eq!(v.status, sbx_api::ExecStatus::Running, "{v:?}");
    c.delete_sandbox(&id).expect("delete");
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
    let c = node.client();
    let id = service_sandbox(
        &c,
        ECHO,
        "import socket; socket.create_connection(('127.0.0.1', 7100), timeout=1)",
        |_| {},
    );
    let addr: std::net::Ipv4Addr = python_in(&c, &id, ADDR)
        .trim()
        .parse()
        .expect("its address");
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
    sleep(&c, &id);
    assert_eq!(status(&c, &id), SandboxStatus::Sleeping);
    // Held at the host while it sleeps: dropped (retransmitted later), not reset.
    w.write_all(b"asleep\n").expect("write while it sleeps");
    std::thread::sleep(Duration::from_millis(300));
    wake(&c, &id);
    echo("asleep\n");
    w.write_all(b"after\n").expect("write");
    echo("after\n");
    c.delete_sandbox(&id).expect("delete");
    node.assert_clean(Duration::from_secs(10));
}

/// A network of its own for a test (`--net-range`): every host interface on it is its node's.
fn own_range(second: u8) -> String {
    format!("10.{second}.{}.0/24", std::process::id() % 250)
}

/// Host interfaces with an address on the node's range that are not named as the node's own
/// (a veth's host side that a restore retired, left behind).
fn foreign_links(node: &TestNode) -> Vec<String> {
    let info = node.client().node_info().expect("the node");
    let v = &info.other;
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
    let c = node.client();
    let id = counter_sandbox(&c, |_| {});
    assert_eq!(ask(&c, &id), 1);
    node.stop();
    node.restart();
    let c = node.client();
    assert_eq!(ask(&c, &id), 2);
    sleep(&c, &id);
    if let Err(e) = c.wake_sandbox(&id) {
        panic!("a sandbox made before the restart does not wake: {e}");
    }
    assert_eq!(ask(&c, &id), 3);
    let v = c.fork_sandbox(&id, 1).expect("fork");
    let fork = v.sandboxes[0].id.clone();
    assert_eq!(ask(&c, &fork), 4);
    // Again after a kill of the node: the sandbox runs on, sleeps and wakes.
    node.kill();
    node.restart();
    let c = node.client();
    sleep(&c, &id);
    assert_eq!(ask(&c, &id), 4);
    c.delete_sandbox(&fork).expect("delete");
    c.delete_sandbox(&id).expect("delete");
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn a_wake_that_fails_leaves_the_sandbox_asleep_with_its_images_and_no_link_behind() {
    let range = own_range(254);
    let node = TestNode::start_with(&["--egress-default", "allow", "--net-range", &range]);
    let c = node.client();
    let id = counter_sandbox(&c, |_| {});
    assert_eq!(ask(&c, &id), 1);
    sleep(&c, &id);
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
    let e = c.wake_sandbox(&id).expect_err("a wake without its pages");
    let n = e
        .node()
        .unwrap_or_else(|| panic!("not the node's refusal: {e}"));
    assert_eq!(n.status, 500, "a wake without its pages: {n:?}");
    assert!(n.message.contains("could not be woken"), "{n:?}");
    assert_eq!(status(&c, &id), SandboxStatus::Sleeping);
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
    assert_eq!(ask(&c, &id), 2);
    c.delete_sandbox(&id).expect("delete");
    node.assert_clean(Duration::from_secs(10));
}
