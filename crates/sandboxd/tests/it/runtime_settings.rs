//! `runtime` (issue #16): ulimits every command of the sandbox has (and the agent does not),
//! sysctls of the sandbox's own namespaces, tmpfs mounts (nosuid, nodev), /dev/shm's size,
//! shown in the sandbox object; a template of their own; runs; sleep and wake; every 400.

use std::time::Duration;

use crate::common::{assert_error, get_json, stdout, TestNode};
use serde_json::{json, Value};

/// Runs `command` (sh -c) in sandbox `id` and waits: its stdout; it must exit 0.
fn sh(node: &TestNode, id: &str, command: &str) -> String {
    let v = node.exec(id, &json!({ "command": command, "wait_seconds": 30 }));
    assert_eq!(v["exit_code"], 0, "{command}: {v}");
    stdout(&v).to_string()
}

/// The soft and hard limit of the line of `/proc/<pid>/limits` that starts with `name`.
fn limits_line(limits: &str, name: &str) -> (String, String) {
    let line = limits
        .lines()
        .find(|l| l.starts_with(name))
        .unwrap_or_else(|| panic!("no {name} in {limits}"));
    let rest: Vec<&str> = line[name.len()..].split_whitespace().collect();
    (rest[0].to_string(), rest[1].to_string())
}

/// Whether this process (root, as the test node is) holds CAP_SYS_RESOURCE.
fn has_sys_resource() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
        .unwrap();
    eff & (1 << 24) != 0
}

fn runtime() -> Value {
    json!({
        "ulimits": {
            "nofile": {"soft": 64, "hard": 128},
            "nproc": 200,
            "core": 0,
            "stack": {"soft": 4194304, "hard": -1}
        },
        "sysctls": {
            "net.ipv4.ip_unprivileged_port_start": 80,
            "kernel.shmmax": "1073741824",
            "fs.mqueue.msg_max": "20"
        },
        "tmpfs": [
            {"path": "/scratch", "size_bytes": 8388608, "mode": 1023},
            "/var/cache/rt"
        ],
        "shm_size_bytes": 33554432
    })
}

/// A statvfs of `path` inside the sandbox: (total bytes, nosuid, nodev).
const STATVFS: &str = "import os,sys\ns=os.statvfs(sys.argv[1])\nprint(s.f_blocks*s.f_frsize, bool(s.f_flag & os.ST_NOSUID), bool(s.f_flag & os.ST_NODEV))";

fn statvfs(node: &TestNode, id: &str, path: &str) -> String {
    let v = node.exec(
        id,
        &json!({ "command": ["python3", "-c", STATVFS, path], "wait_seconds": 30 }),
    );
    assert_eq!(v["exit_code"], 0, "{v}");
    stdout(&v).trim().to_string()
}

#[test]
fn a_kept_sandbox_has_its_ulimits_sysctls_tmpfs_and_shm() {
    let node = TestNode::start();
    let host_shmmax = std::fs::read_to_string("/proc/sys/kernel/shmmax").expect("shmmax");
    let sb = node.create_sandbox(&json!({ "runtime": runtime() }));
    let id = sb["id"].as_str().unwrap().to_string();

    // Shown as the spec's Runtime: limits as {soft, hard}, sysctls as strings.
    let rt = &sb["runtime"];
    assert_eq!(
        rt["ulimits"]["nofile"],
        json!({"soft": 64, "hard": 128}),
        "{sb}"
    );
    assert_eq!(rt["ulimits"]["nproc"], json!({"soft": 200, "hard": 200}));
    assert_eq!(rt["ulimits"]["stack"], json!({"soft": 4194304, "hard": -1}));
    assert_eq!(rt["sysctls"]["net.ipv4.ip_unprivileged_port_start"], "80");
    assert_eq!(
        rt["tmpfs"],
        json!([
            {"path": "/scratch", "size_bytes": 8388608, "mode": 1023},
            {"path": "/var/cache/rt", "size_bytes": null, "mode": 1023}
        ])
    );
    assert_eq!(
        rt["dns"],
        json!({"servers": [], "search": [], "options": []})
    );
    assert_eq!(rt["shm_size_bytes"], 33554432);
    assert!(
        sb["template"].as_str().unwrap().starts_with("img-"),
        "a template of its own: {sb}"
    );
    let (s, again) = get_json(&node, &format!("/v1/sandboxes/{id}"));
    assert_eq!(s, 200);
    assert_eq!(again["runtime"], sb["runtime"]);

    // ulimit -a in sh, and the kernel's own account.
    let all = sh(&node, &id, "ulimit -a");
    assert!(
        all.lines()
            .any(|l| (l.contains("nofile") || l.contains("open files")) && l.ends_with(" 64")),
        "ulimit -a: {all}"
    );
    assert_eq!(sh(&node, &id, "ulimit -n; ulimit -Hn"), "64\n128\n");
    let limits = sh(&node, &id, "cat /proc/self/limits");
    assert_eq!(
        limits_line(&limits, "Max open files"),
        ("64".into(), "128".into())
    );
    assert_eq!(
        limits_line(&limits, "Max processes"),
        ("200".into(), "200".into())
    );
    assert_eq!(
        limits_line(&limits, "Max core file size"),
        ("0".into(), "0".into())
    );
    assert_eq!(
        limits_line(&limits, "Max stack size"),
        ("4194304".into(), "unlimited".into())
    );
    // The agent (PID 1) keeps its own: it is not bound by the commands' 64 files.
    let agent = sh(&node, &id, "cat /proc/1/limits");
    assert_ne!(limits_line(&agent, "Max open files").0, "64", "{agent}");
    // A command cannot open more than its limit.
    let v = node.exec(
        &id,
        &json!({ "command": ["python3", "-c", "fs=[open('/dev/null') for _ in range(100)]"], "wait_seconds": 30 }),
    );
    assert_ne!(v["exit_code"], 0, "100 files under a limit of 64: {v}");
    assert!(
        v["stderr"]
            .as_str()
            .unwrap_or("")
            .contains("Too many open files"),
        "{v}"
    );
    // Commands at once (the per-sandbox cap of a test node): the agent serves them all.
    let ids: Vec<String> = (0..4)
        .map(|i| {
            let v = node.exec(
                &id,
                &json!({ "command": format!("sleep 0.5; echo {i}"), "wait_seconds": 0 }),
            );
            v["id"].as_str().unwrap().to_string()
        })
        .collect();
    for (i, e) in ids.iter().enumerate() {
        let done = node.exec_wait(&id, e, Duration::from_secs(30));
        assert_eq!(stdout(&done), format!("{i}\n"), "{done}");
    }

    // Sysctls read back in the sandbox; the host's are untouched.
    assert_eq!(
        sh(
            &node,
            &id,
            "cat /proc/sys/net/ipv4/ip_unprivileged_port_start /proc/sys/kernel/shmmax /proc/sys/fs/mqueue/msg_max"
        ),
        "80\n1073741824\n20\n"
    );
    assert_eq!(
        std::fs::read_to_string("/proc/sys/kernel/shmmax").unwrap(),
        host_shmmax
    );

    // The tmpfs mounts: in /proc/mounts nosuid,nodev, of their size and mode, sandbox root's.
    let mounts = sh(&node, &id, "cat /proc/mounts");
    for path in ["/scratch", "/var/cache/rt"] {
        let line = mounts
            .lines()
            .find(|l| l.split(' ').nth(1) == Some(path))
            .unwrap_or_else(|| panic!("no mount at {path}: {mounts}"));
        assert!(line.starts_with("tmpfs "), "{line}");
        let opts = line.split(' ').nth(3).unwrap();
        assert!(
            opts.split(',').any(|o| o == "nosuid") && opts.split(',').any(|o| o == "nodev"),
            "{line}"
        );
    }
    assert_eq!(
        sh(&node, &id, "stat -c '%a %u' /scratch /var/cache/rt"),
        "1777 0\n1777 0\n"
    );
    assert_eq!(statvfs(&node, &id, "/scratch"), "8388608 True True");
    // A setuid-root copy of id run by nobody: still nobody.
    sh(
        &node,
        &id,
        "cp /usr/bin/id /scratch/sid && chmod 4755 /scratch/sid && echo ok > /scratch/f",
    );
    let v = node.exec(
        &id,
        &json!({ "command": ["/scratch/sid", "-u"], "user": "65534", "wait_seconds": 30 }),
    );
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(stdout(&v), "65534\n", "setuid took effect on a tmpfs: {v}");
    // Its files are in memory, not in the sandbox's upper directory.
    let upper = node.sandbox_dir(&id).join("upper/scratch/f");
    assert!(!upper.exists(), "{} exists", upper.display());

    // /dev/shm of the given size.
    assert_eq!(statvfs(&node, &id, "/dev/shm"), "33554432 True True");

    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn runtime_makes_a_template_of_its_own_and_a_sandbox_of_the_template_has_it() {
    let node = TestNode::start();
    let plain = node.create_sandbox(&json!({}));
    assert!(plain["runtime"].is_null(), "{plain}");
    let rt = json!({"ulimits": {"nofile": 100}, "shm_size_bytes": 2097152});
    let a = node.create_sandbox(&json!({ "runtime": rt }));
    let b = node.create_sandbox(&json!({ "runtime": rt }));
    let c = node.create_sandbox(&json!({ "runtime": {"ulimits": {"nofile": 101}} }));
    let key = a["template"].as_str().unwrap().to_string();
    assert_ne!(key, plain["template"].as_str().unwrap());
    assert_eq!(
        b["template"], a["template"],
        "the same runtime, the same template"
    );
    assert_ne!(
        c["template"], a["template"],
        "another runtime, another template"
    );
    // A sandbox of that template has its machine: its runtime.
    let d = node.create_sandbox(&json!({ "template": key }));
    let did = d["id"].as_str().unwrap().to_string();
    assert_eq!(d["runtime"], a["runtime"], "{d}");
    assert_eq!(sh(&node, &did, "ulimit -n"), "100\n");
    assert_eq!(statvfs(&node, &did, "/dev/shm"), "2097152 True True");
    // The default one's machine is unchanged.
    let pid = plain["id"].as_str().unwrap();
    assert_eq!(statvfs(&node, pid, "/dev/shm"), "67108864 True True");
    // Sandbox root's, writable by all, sticky, as a tmpfs of its own would be.
    assert_eq!(
        sh(&node, pid, "stat -c '%U %G %a' /dev/shm"),
        "root root 1777\n"
    );
    for v in [&plain, &a, &b, &c, &d] {
        node.delete_sandbox(v["id"].as_str().unwrap());
    }
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn a_run_with_runtime_gets_it_and_the_next_run_does_not() {
    let node = TestNode::start();
    let v = node.run_ok(&json!({
        "command": "ulimit -n; cat /proc/sys/kernel/msgmax; grep ' /scratch ' /proc/mounts | cut -d' ' -f1,4; df -k /dev/shm | tail -1 | awk '{print $2}'",
        "runtime": {
            "ulimits": {"nofile": 256},
            "sysctls": {"kernel.msgmax": "16384"},
            "tmpfs": [{"path": "/scratch", "size_bytes": 1048576}],
            "shm_size_bytes": 4194304
        }
    }));
    assert_eq!(v["exit_code"], 0, "{v}");
    let out = stdout(&v);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "256", "{out}");
    assert_eq!(lines[1], "16384", "{out}");
    assert!(
        lines[2].starts_with("tmpfs ")
            && lines[2].contains("nosuid")
            && lines[2].contains("nodev")
            && lines[2].contains("size=1024k"),
        "{out}"
    );
    assert_eq!(lines[3], "4096", "{out}");
    // Above the node's own hard limit: init raises it as host root where the node may
    // (CAP_SYS_RESOURCE); a node without it refuses what it cannot give, before anything is
    // made. As another user.
    let body = json!({
        "command": "ulimit -Sn; ulimit -Hn; id -u",
        "user": "65534",
        "runtime": {"ulimits": {"nofile": {"soft": 1024, "hard": 1048576}}}
    });
    if has_sys_resource() {
        let v = node.run_ok(&body);
        assert_eq!(stdout(&v), "1024\n1048576\n65534\n", "{v}");
    } else {
        let (s, v) = node.run(&body);
        assert_error(s, &v, 400, "invalid_field", Some("runtime.ulimits.nofile"));
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("on this node"),
            "{v}"
        );
    }
    // A run without runtime (a warm sandbox, or a new one) has the defaults.
    let v = node.run_ok(&json!({
        "command": "cat /proc/sys/kernel/msgmax; grep -c ' /scratch ' /proc/mounts; df -k /dev/shm | tail -1 | awk '{print $2}'"
    }));
    let host_msgmax = std::fs::read_to_string("/proc/sys/kernel/msgmax").unwrap();
    assert_eq!(stdout(&v), format!("{}0\n65536\n", host_msgmax), "{v}");
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn a_sysctl_the_sandbox_does_not_have_fails_its_start_and_leaves_nothing() {
    let node = TestNode::start();
    // net.core.rmem_max is the host's alone: no file of it in the sandbox's namespace.
    let (s, v) = node.run(&json!({
        "command": ["true"],
        "runtime": {"sysctls": {"net.core.rmem_max": "1048576"}}
    }));
    assert_error(s, &v, 409, "sandbox_failed", None);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("net.core.rmem_max"),
        "{v}"
    );
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn bad_runtime_settings_are_400s_of_their_part() {
    let node = TestNode::start();
    for (runtime, code, param) in [
        (
            json!({"ulimits": {"files": 10}}),
            "invalid_field",
            "runtime.ulimits.files",
        ),
        (
            json!({"ulimits": {"nofile": 0}}),
            "invalid_field",
            "runtime.ulimits.nofile",
        ),
        (
            json!({"ulimits": {"nofile": -1}}),
            "invalid_field",
            "runtime.ulimits.nofile",
        ),
        (
            json!({"ulimits": {"nofile": 2_000_000}}),
            "invalid_field",
            "runtime.ulimits.nofile",
        ),
        (
            json!({"ulimits": {"nproc": {"soft": 20, "hard": 10}}}),
            "invalid_field",
            "runtime.ulimits.nproc.soft",
        ),
        (
            json!({"ulimits": {"nproc": {"soft": 1, "hard": 2, "x": 3}}}),
            "unknown_field",
            "runtime.ulimits.nproc.x",
        ),
        (
            json!({"sysctls": {"kernel.hostname": "x"}}),
            "invalid_field",
            "runtime.sysctls.kernel.hostname",
        ),
        (
            json!({"sysctls": {"vm.swappiness": "1"}}),
            "invalid_field",
            "runtime.sysctls.vm.swappiness",
        ),
        (
            json!({"sysctls": {"net.core.somaxconn": "1\n2"}}),
            "invalid_field",
            "runtime.sysctls.net.core.somaxconn",
        ),
        (
            json!({"tmpfs": ["run"]}),
            "invalid_field",
            "runtime.tmpfs[0].path",
        ),
        (
            json!({"tmpfs": ["/proc/x"]}),
            "invalid_field",
            "runtime.tmpfs[0].path",
        ),
        (
            json!({"tmpfs": [{"path": "/a", "mode": 99999}]}),
            "invalid_field",
            "runtime.tmpfs[0].mode",
        ),
        (
            json!({"shm_size_bytes": 1024}),
            "invalid_field",
            "runtime.shm_size_bytes",
        ),
        (
            json!({"cap_add": ["SYS_ADMIN"]}),
            "unknown_field",
            "runtime.cap_add",
        ),
    ] {
        let (s, v) = node.run(&json!({ "command": ["true"], "runtime": runtime }));
        assert_error(s, &v, 400, code, Some(param));
        let r = node.post_json("/v1/sandboxes", &json!({ "runtime": runtime }));
        assert_error(r.status, &r.json(), 400, code, Some(param));
    }
    // A sandbox made from a snapshot or a template goes on with its machine's.
    for source in [
        json!({"snapshot": "snap-0123456789abcdef"}),
        json!({"template": "base"}),
    ] {
        let mut body = source.clone();
        body["runtime"] = json!({"ulimits": {"nofile": 64}});
        let r = node.post_json("/v1/sandboxes", &body);
        assert_error(r.status, &r.json(), 400, "invalid_start", Some("runtime"));
    }
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn a_sandbox_with_tmpfs_and_shm_sleeps_and_wakes_with_their_files_and_its_limits() {
    let node = TestNode::start();
    let (s, info) = get_json(&node, "/internal/node");
    assert_eq!(s, 200);
    assert_eq!(info["checkpoints"]["available"], true, "{info}");
    let sb = node.create_sandbox(&json!({ "runtime": runtime() }));
    let id = sb["id"].as_str().unwrap().to_string();
    sh(
        &node,
        &id,
        "echo in-tmpfs > /scratch/a && echo in-shm > /dev/shm/b && echo deep > /var/cache/rt/c",
    );
    let r = node.post_json(&format!("/v1/sandboxes/{id}/sleep"), &json!({}));
    let v = r.json();
    assert_eq!(r.status, 200, "{v}\n{}", node.log_tail(30));
    assert_eq!(v["status"], "sleeping", "{v}");
    let r = node.post_json(&format!("/v1/sandboxes/{id}/wake"), &json!({}));
    assert_eq!(r.status, 200, "{}", r.json());
    assert_eq!(
        sh(
            &node,
            &id,
            "cat /scratch/a /dev/shm/b /var/cache/rt/c; ulimit -n"
        ),
        "in-tmpfs\nin-shm\ndeep\n64\n"
    );
    assert_eq!(statvfs(&node, &id, "/scratch"), "8388608 True True");
    assert_eq!(statvfs(&node, &id, "/dev/shm"), "33554432 True True");
    assert_eq!(
        sh(
            &node,
            &id,
            "cat /proc/sys/kernel/shmmax /proc/sys/fs/mqueue/msg_max /proc/sys/net/ipv4/ip_unprivileged_port_start"
        ),
        "1073741824\n20\n80\n"
    );
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}

/// A tmpfs path is resolved inside the sandbox's root: a symlink the sandbox put in its way
/// (its disk outlives a restart) cannot lead the node's mount out to the host.
#[test]
fn a_tmpfs_behind_a_symlink_of_the_sandbox_stays_inside_it() {
    let node = TestNode::start();
    let name = crate::common::unique("rt-escape");
    let sb = node.create_sandbox(&json!({ "runtime": {"tmpfs": [format!("/data/{name}")]} }));
    let id = sb["id"].as_str().unwrap().to_string();
    // /data becomes a symlink that climbs far above / to /tmp.
    sh(
        &node,
        &id,
        "mv /data /data.old && ln -s ../../../../../../../../../../tmp /data",
    );
    let r = node.post(&format!("/v1/sandboxes/{id}/restart"), &[], b"");
    assert_eq!(r.status, 200, "{}\n{}", r.json(), node.log_tail(20));
    assert_eq!(r.json()["status"], "running", "{}", r.json());
    // Mounted at the sandbox's own /tmp/<name>; nothing made on the host.
    let mounts = sh(&node, &id, "cat /proc/mounts");
    assert!(
        mounts
            .lines()
            .any(|l| l.split(' ').nth(1) == Some(&format!("/tmp/{name}"))),
        "{mounts}"
    );
    let host = std::path::Path::new("/tmp").join(&name);
    assert!(!host.exists(), "{} was made on the host", host.display());
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}

/// On a node with network (a pool of namespaces): net sysctls are written in the sandbox's
/// leased namespace, kept while it sleeps, and that namespace is never another sandbox's.
#[test]
fn net_sysctls_in_a_leased_namespace_stay_its_own() {
    let node = TestNode::start_with(&["--egress-default", "allow"]);
    let default = node.run_ok(&json!({
        "command": "cat /proc/sys/net/ipv4/ip_unprivileged_port_start"
    }));
    let default = stdout(&default).to_string();
    assert_ne!(default, "99\n");
    let sb = node.create_sandbox(&json!({
        "runtime": {"sysctls": {"net.ipv4.ip_unprivileged_port_start": "99", "net.ipv4.tcp_keepalive_time": "600"}}
    }));
    let id = sb["id"].as_str().unwrap().to_string();
    let read =
        "cat /proc/sys/net/ipv4/ip_unprivileged_port_start /proc/sys/net/ipv4/tcp_keepalive_time";
    assert_eq!(sh(&node, &id, read), "99\n600\n");
    let r = node.post_json(&format!("/v1/sandboxes/{id}/sleep"), &json!({}));
    assert_eq!(r.status, 200, "{}", r.json());
    assert_eq!(sh(&node, &id, read), "99\n600\n", "after a wake");
    node.delete_sandbox(&id);
    // The namespaces runs get afterwards (the pool's, recycled ones among them) have the
    // kernel's defaults.
    for _ in 0..6 {
        let v = node.run_ok(&json!({
            "command": "cat /proc/sys/net/ipv4/ip_unprivileged_port_start"
        }));
        assert_eq!(stdout(&v), default, "{v}");
    }
    node.assert_clean(Duration::from_secs(30));
}
