//! A sandbox is kept apart from the host and from other sandboxes: processes, files,
//! hostname, network, users, memory, processes' count and syscalls.

use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use crate::common::{stdout, unique, TestNode};
use serde_json::json;

const CLEAN: Duration = Duration::from_secs(10);

#[test]
fn sandbox_sees_only_its_own_processes() {
    let node = TestNode::start();
    let node_pid = node.pid().unwrap();
    let v = node.run_ok(&json!({
        "command": format!(
            "ls /proc; echo ---; test -e /proc/{node_pid} && echo NODE-SEEN || echo NODE-HIDDEN"
        )
    }));
    assert_eq!(v["exit_code"], 0, "{v}");
    let out = stdout(&v);
    let (listing, rest) = out.split_once("---\n").expect("the separator");
    let pids: Vec<u32> = listing
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    // The agent (1), the shell (2) and ls (3): nothing of the host.
    assert!(
        !pids.is_empty() && pids.len() <= 4,
        "pids seen in the sandbox: {pids:?}"
    );
    assert!(pids.contains(&1), "no PID 1 in the sandbox: {pids:?}");
    assert!(pids.iter().all(|p| *p < 10), "host pids seen: {pids:?}");
    let host_pids = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|s| s.parse::<u32>().is_ok())
        })
        .count();
    assert!(host_pids > pids.len(), "the host has {host_pids} processes");
    assert_eq!(rest.trim(), "NODE-HIDDEN", "the node's own pid is visible");

    // A run's own sandbox (never checkpointed; this node has no warm pool) has its agent
    // serve in the process that made it (forked by the node's zygote, or `sbx-agent init`):
    // PID 1 is the agent, and its command line names no path of the host.
    let v = node.run_ok(&json!({ "command": ["cat", "/proc/1/cmdline"] }));
    let cmdline: Vec<&str> = stdout(&v).split('\0').collect();
    assert!(
        matches!(
            cmdline.as_slice(),
            ["sbx-agent", "zygote", ..] | ["sbx-agent", "init", ..]
        ),
        "PID 1 of a run's sandbox: {cmdline:?}"
    );
    // A kept sandbox's agent is exec'd by init from inside it (the read-only bind
    // /dev/.sbx-agent): its mappings are the sandbox's own, so it can be checkpointed.
    let kept = node.create_sandbox(&json!({}));
    let id = kept["id"].as_str().unwrap().to_string();
    let v = node.exec(
        &id,
        &json!({ "command": ["cat", "/proc/1/cmdline"], "wait_seconds": 10 }),
    );
    let cmdline: Vec<&str> = stdout(&v).split('\0').collect();
    assert_eq!(
        cmdline.get(..2),
        Some(&["sbx-agent", "serve"][..]),
        "{cmdline:?}"
    );
    node.delete_sandbox(&id);
    node.assert_clean(CLEAN);
}

#[test]
fn sandbox_cannot_see_host_files() {
    let node = TestNode::start();
    let name = unique("sbx-marker");
    let marker = std::env::temp_dir().join(&name);
    std::fs::write(&marker, "host secret\n").unwrap();
    let host_file = marker.display().to_string();
    let data_dir = node.data_dir.display().to_string();
    let v = node.run_ok(&json!({
        "command": format!(
            "for p in {host_file} {data_dir} /var/lib/sbx/images/base/image.json; do \
               if test -e $p; then echo SEEN $p; else echo ABSENT $p; fi; done; \
             cat {host_file} 2>&1; true"
        )
    }));
    let out = stdout(&v);
    assert!(marker.exists(), "the marker is gone from the host");
    let _ = std::fs::remove_file(&marker);
    assert!(!out.contains("SEEN"), "the sandbox sees host files:\n{out}");
    assert_eq!(out.matches("ABSENT").count(), 3, "{out}");
    assert!(!out.contains("host secret"), "read the host's file:\n{out}");
    node.assert_clean(CLEAN);
}

#[test]
fn hostname_is_the_sandboxes_own() {
    let node = TestNode::start();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let v = node.run_ok(&json!({ "command": "hostname; cat /etc/hostname; echo $HOSTNAME" }));
    let id = v["sandbox_id"].as_str().unwrap();
    let lines: Vec<&str> = stdout(&v).lines().collect();
    assert_eq!(lines, [id, id, id], "{v}");
    assert_ne!(lines[0], host.trim(), "the sandbox has the host's hostname");

    let v = node.run_ok(&json!({
        "command": "hostname; cat /etc/hostname",
        "hostname": "box-one.example"
    }));
    let lines: Vec<&str> = stdout(&v).lines().collect();
    assert_eq!(lines, ["box-one.example", "box-one.example"], "{v}");
    // The host's name is untouched.
    assert_eq!(
        std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap(),
        host
    );
    node.assert_clean(CLEAN);
}

/// /dev has the usual devices, working, in a run's own sandbox (nodes made in its /dev) and in
/// a kept one (the host's bound); no process of either can add a device, in /dev or anywhere.
/// Only a kept sandbox, which may sleep, has /run/sbx/awake.
#[test]
fn dev_has_the_usual_devices_and_a_sandbox_adds_none() {
    let node = TestNode::start();
    let script =
        "for d in null zero full random urandom tty; do stat -c '%n %F %t:%T' /dev/$d; done; \
        echo x > /dev/null && echo null-writes; \
        head -c 4 /dev/zero | od -An -tx1 | tr -d ' \\n'; echo; \
        head -c 16 /dev/urandom | wc -c; \
        (echo x > /dev/full) 2>/dev/null || echo full-refuses; \
        for p in /dev/sda /dev/mem2 /dev/shm/mem /tmp/mem; do \
          mknod $p c 1 1 2>/dev/null && echo MADE-$p || echo refused; done; \
        test -e /run/sbx/awake && echo awake || echo no-awake";
    let want = |awake: &'static str| {
        [
            "/dev/null character special file 1:3",
            "/dev/zero character special file 1:5",
            "/dev/full character special file 1:7",
            "/dev/random character special file 1:8",
            "/dev/urandom character special file 1:9",
            "/dev/tty character special file 5:0",
            "null-writes",
            "00000000",
            "16",
            "full-refuses",
            "refused",
            "refused",
            "refused",
            "refused",
        ]
        .into_iter()
        .chain([awake])
        .collect::<Vec<_>>()
    };
    let v = node.run_ok(&json!({ "command": script }));
    assert_eq!(
        stdout(&v).lines().collect::<Vec<_>>(),
        want("no-awake"),
        "a run: {v}"
    );
    let sb = node.create_sandbox(&json!({}));
    let id = sb["id"].as_str().unwrap().to_string();
    let v = node.exec(&id, &json!({ "command": script, "wait_seconds": 10 }));
    assert_eq!(
        stdout(&v).lines().collect::<Vec<_>>(),
        want("awake"),
        "a kept sandbox: {v}"
    );
    node.delete_sandbox(&id);
    node.assert_clean(CLEAN);
}

#[test]
fn network_is_loopback_only() {
    let node = TestNode::start();
    let v = node.run_ok(&json!({ "command": ["cat", "/proc/net/dev"] }));
    let ifaces: Vec<&str> = stdout(&v)
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next())
        .map(str::trim)
        .collect();
    assert_eq!(ifaces, ["lo"], "{}", stdout(&v));
    node.assert_clean(CLEAN);
}

#[test]
fn writes_reach_neither_the_image_nor_another_sandbox() {
    let node = TestNode::start();
    let x = unique("m");
    let image_copy = node
        .images_dir
        .join("base/rootfs/usr")
        .join(format!("marker-{x}"));
    assert!(!image_copy.exists());
    let mut a = node.open_sse(&json!({
        "command": format!(
            "echo data > /usr/marker-{x} && echo data > /tmp/tmp-{x} && echo written; sleep 30"
        ),
        "stream": true
    }));
    let start = a.next_event().expect("start event");
    assert_eq!(start.event, "start");
    let a_id = start.data["sandbox_id"].as_str().unwrap().to_string();
    loop {
        let e = a.next_event().expect("the writer's output");
        assert_ne!(e.event, "exit", "the writer ended: {:?}", e.data);
        if e.event == "stdout" && e.data["data"].as_str().unwrap().contains("written") {
            break;
        }
    }
    // The write went to the writer's own upper layer...
    let upper = node
        .sandbox_dir(&a_id)
        .join("upper/usr")
        .join(format!("marker-{x}"));
    assert!(upper.is_file(), "{} is missing", upper.display());
    // ...not to the image...
    assert!(
        !image_copy.exists(),
        "the write reached the image: {}",
        image_copy.display()
    );
    // ...nor to a sandbox running at the same time.
    let v = node.run_ok(&json!({
        "command": format!(
            "for p in /usr/marker-{x} /tmp/tmp-{x}; do \
               if test -e $p; then echo SEEN $p; else echo ABSENT $p; fi; done"
        )
    }));
    let out = stdout(&v);
    assert!(
        !out.contains("SEEN"),
        "another sandbox sees the write:\n{out}"
    );
    assert_eq!(out.matches("ABSENT").count(), 2, "{out}");
    drop(a);
    node.assert_clean(CLEAN);
    assert!(!image_copy.exists(), "the write reached the image");
}

#[test]
fn root_in_the_sandbox_is_not_root_on_the_host() {
    let node = TestNode::start();
    let v = node.run_ok(&json!({ "command": "id -u; id -g" }));
    assert_eq!(stdout(&v), "0\n0\n", "{v}");

    let mut s = node.open_sse(&json!({ "command": "touch /owned; sleep 20" }));
    let start = s.next_event().expect("start event");
    assert_eq!(start.event, "start", "{:?}", start.data);
    let id = start.data["sandbox_id"].as_str().unwrap().to_string();
    let owned = node.sandbox_dir(&id).join("upper/owned");
    let deadline = Instant::now() + Duration::from_secs(10);
    let meta = loop {
        match std::fs::symlink_metadata(&owned) {
            Ok(m) => break m,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("{}: {e}", owned.display()),
        }
    };
    assert_eq!(meta.uid(), 100_000, "owner on the host of a file root made");
    assert_eq!(meta.gid(), 100_000, "group on the host of a file root made");
    drop(s);
    node.assert_clean(CLEAN);
}

#[test]
fn a_memory_bomb_is_killed_and_the_next_run_works() {
    let node = TestNode::start();
    let v = node.run_ok(&json!({
        "command": ["python3", "-c", "x = b'\\x01' * (1 << 30)\nprint(len(x))"],
        "limits": { "memory_bytes": 134217728 }
    }));
    assert_eq!(v["status"], "killed", "{v}");
    assert_eq!(v["signal"], "SIGKILL", "{v}");
    assert_eq!(v["exit_code"], 137, "{v}");
    assert_eq!(v["stdout"], "", "{v}");
    let peak = v["usage"]["max_memory_bytes"].as_u64().unwrap();
    assert!(
        peak <= 134_217_728 + (8 << 20),
        "peak {peak} over the limit"
    );

    let v = node.run_ok(&json!({ "command": "echo still here" }));
    assert_eq!(v["status"], "exited", "{v}");
    assert_eq!(stdout(&v), "still here\n");
    node.assert_clean(CLEAN);
}

#[test]
fn a_fork_bomb_stops_at_the_pids_limit() {
    let node = TestNode::start();
    // Every fork failure ends dash's subshell; the rest uses builtins (no fork) and exec.
    let mut s = node.open_sse(&json!({
        "command": "(for i in $(seq 300); do sleep 60 & done) 2>/tmp/err; \
                    set -- /proc/[0-9]*; echo procs=$#; \
                    while read -r l; do echo \"err: $l\"; done </tmp/err; exec sleep 2",
    }));
    let start = s.next_event().expect("start event");
    let id = start.data["sandbox_id"].as_str().unwrap().to_string();
    let pids = node.cgroup_dir("pids").expect("a pids hierarchy").join(&id);
    let limit = std::fs::read_to_string(pids.join("pids.max")).unwrap_or_default();
    // Watch the group from the host while the command runs.
    let watcher = std::thread::spawn(move || {
        let mut most = 0u64;
        let mut events = String::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            let Ok(cur) = std::fs::read_to_string(pids.join("pids.current")) else {
                break;
            };
            most = most.max(cur.trim().parse().unwrap_or(0));
            if let Ok(e) = std::fs::read_to_string(pids.join("pids.events")) {
                events = e;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        (most, events)
    });
    let rest = s.rest();
    let exit = rest.last().expect("events");
    assert_eq!(exit.event, "exit", "{rest:?}");
    let out = exit.data["stdout"].as_str().unwrap().to_string();
    let (most, events) = watcher.join().unwrap();
    assert_eq!(limit.trim(), "128", "pids.max of the sandbox's group");
    let procs: u32 = out
        .lines()
        .find_map(|l| l.strip_prefix("procs="))
        .unwrap_or_else(|| panic!("no count: {out}"))
        .parse()
        .unwrap();
    assert!(procs <= 128, "{procs} processes in the sandbox:\n{out}");
    assert!(procs >= 100, "the loop made only {procs} processes:\n{out}");
    assert!(
        out.to_lowercase().contains("fork"),
        "the shell reported no fork failure:\n{out}"
    );
    assert!(most <= 128, "the host saw {most} tasks in the group");
    let max_hits: u64 = events
        .lines()
        .find_map(|l| l.strip_prefix("max "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    assert!(
        max_hits > 0,
        "pids.events shows no refused fork: {events:?}"
    );
    node.assert_clean(CLEAN);
}

#[test]
fn seccomp_refuses_denied_syscalls_with_eperm() {
    let node = TestNode::start();
    let keyctl = if cfg!(target_arch = "aarch64") {
        219
    } else {
        250
    };
    let getpid = if cfg!(target_arch = "aarch64") {
        172
    } else {
        39
    };
    // unshare(CLONE_NEWUSER) needs no capability: only the filter refuses it.
    let script = format!(
        "import ctypes\n\
         libc = ctypes.CDLL(None, use_errno=True)\n\
         def call(name, f):\n\
         \x20   ctypes.set_errno(0)\n\
         \x20   r = f()\n\
         \x20   print(name, r, ctypes.get_errno() if r == -1 else 0)\n\
         call('getpid', lambda: 1 if libc.syscall({getpid}) > 0 else -1)\n\
         call('keyctl', lambda: libc.syscall({keyctl}, 0, 0, 0, 0, 0))\n\
         call('unshare', lambda: libc.unshare(0x10000000))\n\
         call('mount', lambda: libc.mount(b'none', b'/mnt', b'tmpfs', 0, None))\n"
    );
    let v = node.run_ok(&json!({ "command": ["python3", "-c", script] }));
    assert_eq!(v["exit_code"], 0, "{v}");
    let lines: Vec<&str> = stdout(&v).lines().collect();
    assert_eq!(
        lines,
        ["getpid 1 0", "keyctl -1 1", "unshare -1 1", "mount -1 1"],
        "{v}"
    );
    node.assert_clean(CLEAN);
}

#[test]
fn limits_are_set_on_the_sandboxes_cgroup() {
    let node = TestNode::start();
    let read = |ctrl: &str, id: &str, file: &str| {
        let dir = node.cgroup_dir(ctrl).unwrap().join(id);
        std::fs::read_to_string(dir.join(file))
            .unwrap_or_else(|e| panic!("{}/{file}: {e}", dir.display()))
            .trim()
            .to_string()
    };
    for (limits, memory) in [
        (
            json!({ "memory_bytes": 256 << 20, "vcpus": 1 }),
            256u64 << 20,
        ),
        (json!(null), 512 << 20),
    ] {
        let mut s = node.open_sse(&json!({ "command": "sleep 30", "limits": limits }));
        let start = s.next_event().expect("start event");
        let id = start.data["sandbox_id"].as_str().unwrap().to_string();
        if node.cgroup_dir("unified").is_some() {
            assert_eq!(read("memory", &id, "memory.max"), memory.to_string());
            assert_eq!(read("pids", &id, "pids.max"), "128");
        } else {
            assert_eq!(
                read("memory", &id, "memory.limit_in_bytes"),
                memory.to_string()
            );
            assert_eq!(read("pids", &id, "pids.max"), "128");
            if node.cgroup_dir("cpu").is_some() {
                assert_eq!(read("cpu", &id, "cpu.cfs_quota_us"), "100000");
            }
        }
        drop(s);
    }
    node.assert_clean(CLEAN);
}

#[test]
fn the_agent_cannot_be_inspected_from_inside() {
    let node = TestNode::start();
    let v = node.run_ok(&json!({
        "command": "readlink /proc/1/fd/3 >/dev/null 2>&1 && echo FD-SEEN || echo FD-HIDDEN; \
                    cat /proc/1/fd/0 </dev/null >/dev/null 2>&1 && echo FD-OPENED || echo FD-CLOSED; \
                    cat /proc/1/environ >/dev/null 2>&1 && echo ENV-SEEN || echo ENV-HIDDEN; \
                    ls /proc/$$/fd >/dev/null 2>&1 && echo OWN-FD-SEEN"
    }));
    let out = stdout(&v);
    // Root of the sandbox has no CAP_SYS_PTRACE, and the agent is not dumpable: its
    // descriptors (the node's socket) and environment stay closed, while a command's own are
    // open to it. (The agent is exec'd inside the sandbox's user namespace, so the owner of
    // its /proc directories is that namespace's root: sandbox root may list the numbers in
    // /proc/1/fd, but neither read a link nor open one.)
    assert!(out.contains("FD-HIDDEN"), "{out}");
    assert!(out.contains("FD-CLOSED"), "{out}");
    assert!(out.contains("ENV-HIDDEN"), "{out}");
    assert!(out.contains("OWN-FD-SEEN"), "{out}");
    node.assert_clean(CLEAN);
}

/// A descriptor the node's caller left open (not close-on-exec) reaches no sandbox: the node
/// marks what it inherits close-on-exec, and an agent's init closes all but stdio.
#[test]
fn a_descriptor_the_node_inherits_reaches_no_sandbox() {
    use std::os::fd::AsRawFd;
    let dir = std::env::temp_dir().join(unique("sbx-test-fd"));
    std::fs::create_dir_all(&dir).unwrap();
    let canary = dir.join("sbx-inherited-canary");
    let file = std::fs::File::create(&canary).unwrap();
    // SAFETY: dup of a descriptor this test owns; the copy (not close-on-exec, as dup makes
    // it) is closed below once the node has started.
    let leaked = unsafe { libc::dup(file.as_raw_fd()) };
    assert!(leaked > 2);
    let node = TestNode::start();
    // SAFETY: the copy made above, closed once.
    unsafe { libc::close(leaked) };
    let v = node.run_ok(&json!({
        "command": "ls -l /proc/[0-9]*/fd/ 2>/dev/null; echo done",
    }));
    let out = stdout(&v);
    assert!(out.contains("done"), "{v}");
    assert!(!out.contains("sbx-inherited-canary"), "{out}");
    let kept = node.create_sandbox(&json!({}));
    let id = kept["id"].as_str().unwrap().to_string();
    let v = node.exec(
        &id,
        &json!({ "command": "ls -l /proc/1/fd/; echo done", "wait_seconds": 10 }),
    );
    let out = stdout(&v);
    assert!(
        out.contains("done") && !out.contains("sbx-inherited-canary"),
        "{out}"
    );
    node.delete_sandbox(&id);
    let _ = std::fs::remove_dir_all(dir);
}

/// A process of the sandbox that tries to ptrace PID 1 (the agent) and read its environment
/// in a tight loop never succeeds while the sandbox is snapshotted, forked, put to sleep and
/// woken, and every checkpoint succeeds: the agent is made dumpable (as CRIU needs) only while
/// everything else of the sandbox is frozen, and comes back from a restore not dumpable.
#[test]
fn a_process_racing_checkpoints_never_traces_the_agent() {
    let node = TestNode::start();
    let (s, info) = crate::common::get_json(&node, "/internal/node");
    assert_eq!(s, 200, "{info}");
    assert_eq!(info["checkpoints"]["available"], true, "{info}");
    let v = node.create_sandbox(&json!({}));
    let id = v["id"].as_str().unwrap().to_string();
    // The attacker: PTRACE_SEIZE(1) and an open of /proc/1/environ, as fast as it can; a
    // success is written down, and the attacker ends (its trace goes with it).
    let attack = r#"
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
tries = 0
while True:
    tries += 1
    if libc.ptrace(0x4206, 1, None, None) == 0:
        open('/tmp/won', 'a').write('ptrace\n')
        os._exit(0)
    try:
        open('/proc/1/environ', 'rb').read()
        open('/tmp/won', 'a').write('environ\n')
    except OSError:
        pass
    if tries % 2000 == 0:
        open('/tmp/tries.new', 'w').write(str(tries))
        os.rename('/tmp/tries.new', '/tmp/tries')
"#;
    let v = node.exec(
        &id,
        &json!({
            "command": format!("cat > /tmp/attack.py <<'PY'{attack}PY"),
            "wait_seconds": 10,
        }),
    );
    assert_eq!(v["exit_code"], 0, "{v}");
    let v = node.exec(
        &id,
        &json!({
            "command": "setsid python3 /tmp/attack.py >/dev/null 2>&1 < /dev/null &",
            "wait_seconds": 10,
        }),
    );
    assert_eq!(v["exit_code"], 0, "{v}");
    let tries = |node: &TestNode, id: &str| -> u64 {
        let v = node.exec(
            id,
            &json!({ "command": "cat /tmp/tries 2>/dev/null || echo 0", "wait_seconds": 10 }),
        );
        stdout(&v).trim().parse().unwrap_or(0)
    };
    let check = |node: &TestNode, id: &str, after: &str| {
        let v = node.exec(
            id,
            &json!({
                "command": "cat /tmp/won 2>/dev/null; grep TracerPid /proc/1/status",
                "wait_seconds": 10,
            }),
        );
        let out = stdout(&v);
        assert_eq!(out.trim(), "TracerPid:\t0", "after {after}: {out}");
    };
    let end = Instant::now() + Duration::from_secs(20);
    while tries(&node, &id) == 0 {
        assert!(Instant::now() < end, "the attacker never ran");
        std::thread::sleep(Duration::from_millis(100));
    }
    for round in 0..3 {
        let r = node.post_json(&format!("/v1/sandboxes/{id}/snapshots"), &json!({}));
        assert!(
            r.status < 300,
            "snapshot {round}: {} {}",
            r.status,
            r.json()
        );
        check(&node, &id, "a snapshot");
        let r = node.post_json(&format!("/v1/sandboxes/{id}/fork"), &json!({ "count": 1 }));
        assert_eq!(r.status, 201, "fork {round}: {}", r.json());
        let v = r.json();
        let fork = v["sandboxes"][0]["id"].as_str().unwrap().to_string();
        check(&node, &fork, "a fork (the copy)");
        node.delete_sandbox(&fork);
        check(&node, &id, "a fork (the original)");
        let r = node.post_json(&format!("/v1/sandboxes/{id}/sleep"), &json!({}));
        assert_eq!(r.status, 200, "sleep {round}: {}", r.json());
        let r = node.post_json(&format!("/v1/sandboxes/{id}/wake"), &json!({}));
        assert_eq!(r.status, 200, "wake {round}: {}", r.json());
        check(&node, &id, "a sleep and a wake");
    }
    // The attacker went on trying across all of it.
    let before = tries(&node, &id);
    std::thread::sleep(Duration::from_millis(500));
    assert!(tries(&node, &id) > before, "the attacker stopped");
    node.delete_sandbox(&id);
    node.assert_clean(CLEAN);
}
