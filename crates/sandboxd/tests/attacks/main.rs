//! Escape and abuse attempts, each run inside a real sandbox (the attacker) beside another one
//! (its neighbour) on a real node. Each test asserts that the attempt was contained and that
//! the host, the node and the neighbour are unharmed afterwards: the node answers `/healthz`
//! and makes a new sandbox, the neighbour's file and process are as they were and it runs
//! commands.
//!
//! Covered elsewhere (not repeated here): Docker's refused syscalls one by one
//! (`tests/it/seccomp.rs`), ptrace of PID 1 and the agent's memory
//! (`isolation::the_agent_cannot_be_inspected_from_inside`), fork and memory bombs
//! (`isolation.rs`), the node's API, other sandboxes, the host's loopback, metadata and private
//! ranges over the network (`network::sandboxes_reach_the_internet_by_name_and_address_and_nothing_they_must_not`),
//! a full disk and a full volume (`tests/it/disk.rs`, `volumes.rs`).
//!
//! An attack script prints one line per attempt, `what: refused …` or `what: ALLOWED …`; a
//! test fails on any `ALLOWED`.

#[allow(dead_code, unused_imports)]
#[path = "../it/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::{stdout, TestNode};
use serde_json::json;

/// A node, an attacker and a neighbour holding a file and a process of its own.
struct Arena {
    node: TestNode,
    attacker: String,
    neighbour: String,
}

impl Arena {
    fn new() -> Arena {
        Arena::with(&[])
    }

    fn with(args: &[&str]) -> Arena {
        let node = TestNode::start_with(args);
        let attacker = node.create_sandbox(&json!({ "sleep_after_seconds": null }));
        let neighbour = node.create_sandbox(&json!({ "sleep_after_seconds": null }));
        let arena = Arena {
            attacker: attacker["id"].as_str().expect("an id").to_string(),
            neighbour: neighbour["id"].as_str().expect("an id").to_string(),
            node,
        };
        let v = arena.sh(
            &arena.neighbour,
            "echo precious > /tmp/precious && (setsid sleep 100000 >/dev/null 2>&1 </dev/null &) && true",
        );
        assert_eq!(v["exit_code"], 0, "{v}");
        arena
    }

    fn sh(&self, id: &str, line: &str) -> serde_json::Value {
        self.node
            .exec(id, &json!({ "command": line, "wait_seconds": 120 }))
    }

    /// Runs Python `script` in the attacker: its lines.
    fn attack(&self, script: &str) -> Vec<String> {
        let v = self.node.exec(
            &self.attacker,
            &json!({ "command": ["python3", "-c", script], "wait_seconds": 120 }),
        );
        assert_eq!(v["status"], "exited", "{v}");
        let lines: Vec<String> = stdout(&v).lines().map(str::to_string).collect();
        for l in &lines {
            eprintln!("attack: {l}");
        }
        lines
    }

    /// No attempt of `lines` got through, and there were `at_least` of them.
    fn assert_contained(&self, lines: &[String], at_least: usize) {
        let allowed: Vec<&String> = lines.iter().filter(|l| l.contains("ALLOWED")).collect();
        assert!(allowed.is_empty(), "not contained: {allowed:#?}");
        assert!(
            lines.len() >= at_least,
            "the attack did not run all its attempts: {lines:#?}"
        );
    }

    /// The node answers and makes sandboxes; the neighbour's file and process are there and
    /// it runs commands.
    fn assert_unharmed(&self) {
        let r = self.node.get("/healthz", &[]);
        assert_eq!(r.status, 200, "the node after the attack: {}", r.text());
        let v = self
            .node
            .run_ok(&json!({ "command": "echo fresh", "timeout_seconds": 60 }));
        assert_eq!(stdout(&v), "fresh\n", "{v}");
        let v = self.sh(
            &self.neighbour,
            "cat /tmp/precious && pgrep -x sleep >/dev/null && echo running",
        );
        assert_eq!(stdout(&v), "precious\nrunning\n", "the neighbour: {v}");
    }

    /// Runs attack `script` (at least `at_least` attempts), checks it was contained and that
    /// nothing was harmed, and ends the arena.
    fn contained(self, script: &str, at_least: usize) {
        let lines = self.attack(script);
        self.assert_contained(&lines, at_least);
        self.assert_unharmed();
        self.finish();
    }

    fn finish(self) {
        for id in [&self.attacker, &self.neighbour] {
            self.node.delete_sandbox(id);
        }
        self.node.assert_clean(Duration::from_secs(15));
    }
}

/// Python: one line per path written, `refused` with its errno or `ALLOWED`.
const PROC_AND_SYS: &str = r#"
import errno
def err(e): return errno.errorcode.get(e.errno, str(e.errno))
writes = [
    ("/proc/sysrq-trigger", "h"),
    ("/proc/sys/kernel/core_pattern", "|/tmp/pwn"),
    ("/proc/sys/kernel/modprobe", "/tmp/pwn"),
    ("/proc/sys/kernel/panic", "1"),
    ("/proc/sys/kernel/randomize_va_space", "0"),
    ("/proc/sys/vm/drop_caches", "3"),
    ("/proc/sys/vm/overcommit_memory", "1"),
    ("/proc/sys/fs/file-max", "100"),
    ("/proc/sys/net/core/somaxconn", "1"),
    ("/sys/kernel/uevent_helper", "/tmp/pwn"),
    ("/sys/kernel/mm/transparent_hugepage/enabled", "never"),
    ("/sys/power/state", "mem"),
    ("/sys/class/block/vda/queue/scheduler", "none"),
    ("/proc/1/oom_score_adj", "-1000"),
    ("/proc/self/attr/current", "unconfined"),
]
for path, value in writes:
    try:
        with open(path, "w") as f:
            f.write(value)
        print(f"write {path}: ALLOWED")
    except OSError as e:
        print(f"write {path}: refused {err(e)}")
for path in ["/proc/kmsg", "/dev/kmsg", "/proc/1/mem", "/proc/1/environ", "/dev/mem", "/dev/port"]:
    try:
        with open(path, "rb") as f:
            data = f.read(64)
        print(f"read {path}: ALLOWED ({len(data)} bytes)")
    except OSError as e:
        print(f"read {path}: refused {err(e)}")
# Bound to /dev/null: nothing of the host's memory or keys.
for path in ["/proc/kcore", "/proc/keys", "/proc/timer_list"]:
    try:
        with open(path, "rb") as f:
            data = f.read(64)
        print(f"read {path}: " + ("refused (empty)" if not data else f"ALLOWED ({len(data)} bytes)"))
    except OSError as e:
        print(f"read {path}: refused {err(e)}")
"#;

/// The host's settings an attack on /proc/sys would change, read on the host.
fn host_settings() -> Vec<String> {
    [
        "/proc/sys/kernel/core_pattern",
        "/proc/sys/kernel/modprobe",
        "/proc/sys/kernel/panic",
        "/proc/sys/vm/overcommit_memory",
        "/proc/sys/fs/file-max",
    ]
    .iter()
    .map(|p| std::fs::read_to_string(p).unwrap_or_default())
    .collect()
}

#[test]
fn proc_and_sys_cannot_be_written_nor_the_kernel_read() {
    let before = host_settings();
    let a = Arena::new();
    let lines = a.attack(PROC_AND_SYS);
    a.assert_contained(&lines, 24);
    assert_eq!(before, host_settings(), "the host's settings changed");
    a.assert_unharmed();
    a.finish();
}

const DEVICES: &str = r#"
import os, stat, errno
def err(e): return errno.errorcode.get(e.errno, str(e.errno))
for name, kind, dev in [("sda", stat.S_IFBLK, os.makedev(8, 0)), ("vda", stat.S_IFBLK, os.makedev(253, 0)),
                        ("loop0", stat.S_IFBLK, os.makedev(7, 0)), ("mem", stat.S_IFCHR, os.makedev(1, 1)),
                        ("kmsg", stat.S_IFCHR, os.makedev(1, 11)), ("fuse", stat.S_IFCHR, os.makedev(10, 229))]:
    path = f"/tmp/{name}"
    try:
        os.mknod(path, kind | 0o600, dev)
    except OSError as e:
        print(f"mknod {name}: refused {err(e)}")
        continue
    try:
        fd = os.open(path, os.O_RDWR)
        os.close(fd)
        print(f"mknod {name}: ALLOWED (opened)")
    except OSError as e:
        print(f"mknod {name}: refused at open {err(e)}")
for name in sorted(os.listdir("/dev")):
    st = os.lstat("/dev/" + name)
    if stat.S_ISBLK(st.st_mode):
        print(f"/dev/{name}: ALLOWED (a block device)")
    if stat.S_ISCHR(st.st_mode) and name not in ("null", "zero", "full", "random", "urandom", "tty", "ptmx", "console"):
        print(f"/dev/{name}: ALLOWED (a character device)")
print("devices listed: refused (only the usual ones)")
"#;

#[test]
fn device_nodes_cannot_be_made_or_opened() {
    Arena::new().contained(DEVICES, 7);
}

const MOUNTS: &str = r#"
import ctypes, os, errno
libc = ctypes.CDLL(None, use_errno=True)
def err(): return errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
os.makedirs("/tmp/m", exist_ok=True)
MS_BIND, MS_REC, MS_REMOUNT, MS_RDONLY = 4096, 16384, 32, 1
tries = [
    ("mount tmpfs", lambda: libc.mount(b"none", b"/tmp/m", b"tmpfs", 0, None)),
    ("mount proc", lambda: libc.mount(b"proc", b"/tmp/m", b"proc", 0, None)),
    ("mount sysfs", lambda: libc.mount(b"sysfs", b"/tmp/m", b"sysfs", 0, None)),
    ("mount cgroup", lambda: libc.mount(b"cgroup", b"/tmp/m", b"cgroup", 0, b"memory")),
    ("bind /", lambda: libc.mount(b"/", b"/tmp/m", None, MS_BIND | MS_REC, None)),
    ("remount the agent's binary writable", lambda: libc.mount(None, b"/dev/.sbx-agent", None, MS_REMOUNT | MS_BIND, None)),
    ("umount /proc/kcore", lambda: libc.umount2(b"/proc/kcore", 2)),
    ("umount /proc", lambda: libc.umount2(b"/proc", 2)),
    ("pivot_root", lambda: libc.syscall(155, b"/tmp", b"/tmp/m")),
    ("open_tree", lambda: libc.syscall(428, -100, b"/", 1)),
    ("move_mount", lambda: libc.syscall(429, -100, b"/tmp", -100, b"/tmp/m", 0)),
    ("fsopen", lambda: libc.syscall(430, b"tmpfs", 0)),
    ("fsmount", lambda: libc.syscall(432, 3, 0, 0)),
    ("mount_setattr", lambda: libc.syscall(442, -100, b"/", 0, None, 0)),
]
for name, call in tries:
    r = call()
    print(f"{name}: " + ("ALLOWED" if r >= 0 else f"refused {err()}"))
"#;

#[test]
fn mounts_are_refused_by_the_old_and_the_new_api() {
    Arena::new().contained(MOUNTS, 14);
}

const CGROUPS: &str = r#"
import glob, os, errno
def err(e): return errno.errorcode.get(e.errno, str(e.errno))
before = open("/proc/self/cgroup").read()
procs = sorted(set(glob.glob("/sys/fs/cgroup/cgroup.procs") + glob.glob("/sys/fs/cgroup/*/cgroup.procs")
                   + glob.glob("/sys/fs/cgroup/*/*/cgroup.procs")))[:40]
moved = 0
for p in procs:
    try:
        with open(p, "w") as f:
            f.write(str(os.getpid()))
        if open("/proc/self/cgroup").read() != before:
            print(f"move into {p}: ALLOWED")
            moved += 1
    except OSError as e:
        pass
print(f"moves into {len(procs)} cgroups: refused (none left the sandbox's)" if moved == 0 else "moves: ALLOWED")
for pattern in ["/sys/fs/cgroup/*/memory.limit_in_bytes", "/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/*/pids.max",
                "/sys/fs/cgroup/pids.max", "/sys/fs/cgroup/*/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu.max"]:
    for p in glob.glob(pattern):
        try:
            with open(p, "w") as f:
                f.write("-1" if "cfs" in p or "limit" in p else "max")
            print(f"raise {p}: ALLOWED")
        except OSError as e:
            print(f"raise {p}: refused {err(e)}")
for d in ["/sys/fs/cgroup/escape", "/sys/fs/cgroup/memory/escape"]:
    try:
        os.mkdir(d)
        print(f"mkdir {d}: ALLOWED")
    except OSError as e:
        print(f"mkdir {d}: refused {err(e)}")
try:
    with open("/sys/fs/cgroup/cgroup.subtree_control", "w") as f:
        f.write("+memory")
    print("subtree_control: ALLOWED")
except OSError as e:
    print(f"subtree_control: refused {err(e)}")
"#;

#[test]
fn a_sandbox_cannot_leave_or_raise_its_cgroups() {
    let a = Arena::new();
    let limits_before = cgroup_limits(&a.node, &a.attacker);
    let lines = a.attack(CGROUPS);
    a.assert_contained(&lines, 3);
    assert_eq!(
        cgroup_limits(&a.node, &a.attacker),
        limits_before,
        "the attacker's limits changed"
    );
    // Its agent is where the node put it.
    let pid = a.node.agent_pid(&a.attacker).expect("the attacker's agent");
    let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("its cgroups");
    assert!(
        cg.lines()
            .filter(|l| l.contains(":memory:") || l.contains(":pids:"))
            .all(|l| l.contains(&a.attacker)),
        "the attacker's agent left its cgroup: {cg}"
    );
    a.assert_unharmed();
    a.finish();
}

/// The memory and pids limits of sandbox `id`'s cgroups, read on the host.
fn cgroup_limits(node: &TestNode, id: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (ctrl, file) in [
        ("memory", "memory.limit_in_bytes"),
        ("memory", "memory.max"),
        ("pids", "pids.max"),
    ] {
        if let Some(dir) = node.cgroup_dir(ctrl) {
            if let Ok(v) = std::fs::read_to_string(dir.join(id).join(file)) {
                out.push(format!("{file}={}", v.trim()));
            }
        }
    }
    assert!(!out.is_empty(), "no cgroup limits found for {id}");
    out
}

const NAMESPACES_AND_CAPS: &str = r#"
import ctypes, os, errno, signal, time
libc = ctypes.CDLL(None, use_errno=True)
def err(): return errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
for name, flag in [("user", 0x10000000), ("net", 0x40000000), ("mnt", 0x20000), ("pid", 0x20000000),
                   ("ipc", 0x08000000), ("uts", 0x04000000), ("cgroup", 0x02000000), ("time", 0x80)]:
    r = libc.unshare(flag)
    print(f"unshare {name}: " + ("ALLOWED" if r == 0 else f"refused {err()}"))
for ns in ["net", "mnt", "user", "pid"]:
    try:
        fd = os.open(f"/proc/1/ns/{ns}", os.O_RDONLY)
        r = libc.setns(fd, 0)
        print(f"setns {ns} of PID 1: " + ("ALLOWED" if r == 0 else f"refused {err()}"))
        os.close(fd)
    except OSError as e:
        print(f"setns {ns} of PID 1: refused at open {e.errno}")
status = dict(l.split(":\t", 1) for l in open("/proc/self/status").read().splitlines() if ":\t" in l)
bad = {"DAC_READ_SEARCH": 2, "NET_ADMIN": 12, "SYS_MODULE": 16, "SYS_RAWIO": 17, "SYS_PTRACE": 19, "SYS_ADMIN": 21,
       "SYS_BOOT": 22, "SYS_NICE": 23, "SYS_RESOURCE": 24, "SYS_TIME": 25, "MAC_ADMIN": 33, "SYSLOG": 34,
       "WAKE_ALARM": 35, "BLOCK_SUSPEND": 36, "PERFMON": 38, "BPF": 39, "CHECKPOINT_RESTORE": 40, "LINUX_IMMUTABLE": 9,
       "IPC_LOCK": 14, "LEASE": 28, "AUDIT_CONTROL": 30, "MAC_OVERRIDE": 32}
for field in ["CapEff", "CapPrm", "CapBnd", "CapAmb"]:
    caps = int(status[field].strip(), 16)
    held = [n for n, bit in bad.items() if caps >> bit & 1]
    print(f"{field}: " + (f"ALLOWED {held}" if held else "refused (none of the dangerous ones)"))
print("seccomp: " + ("refused (filtered)" if status.get("Seccomp", "0").strip() == "2" else "ALLOWED (no filter)"))
# Signals to PID 1 (the agent) from inside: the kernel ignores those it has no handler for.
for sig in [signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGSTOP, signal.SIGSEGV]:
    try:
        os.kill(1, sig)
    except OSError as e:
        pass
time.sleep(0.2)
state = [l for l in open("/proc/1/status").read().splitlines() if l.startswith("State:")][0]
print("signals to PID 1: " + ("ALLOWED " + state if "T" in state.split()[1] else "refused (it runs)"))
os.kill(1, signal.SIGCONT)
"#;

#[test]
fn namespaces_capabilities_and_pid_1_are_out_of_reach() {
    let a = Arena::new();
    let lines = a.attack(NAMESPACES_AND_CAPS);
    a.assert_contained(&lines, 18);
    // The attacker's agent outlived the signals: the sandbox still serves.
    let v = a.sh(&a.attacker, "echo alive");
    assert_eq!(stdout(&v), "alive\n", "{v}");
    a.assert_unharmed();
    a.finish();
}

#[test]
fn an_fd_bomb_stays_in_its_sandbox() {
    let a = Arena::new();
    let lines = a.attack(
        r#"
import os, resource, errno
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
except (ValueError, OSError):
    pass
fds = []
try:
    while True:
        fds.append(os.open("/dev/null", os.O_RDONLY))
except OSError as e:
    print(f"fds: refused {errno.errorcode.get(e.errno)} after {len(fds)}" if len(fds) <= 1 << 20 else "fds: ALLOWED")
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard * 2, hard * 2))
    print("raise the fd limit: ALLOWED")
except (ValueError, OSError):
    print("raise the fd limit: refused")
"#,
    );
    a.assert_contained(&lines, 2);
    a.assert_unharmed();
    a.finish();
}

/// Through the file API, paths are resolved in the sandbox: a directory swapped with a symlink
/// to `/` (or to the host's paths) while uploads and renames go on lands nothing outside it.
#[test]
fn symlink_and_rename_races_through_the_file_api_stay_inside() {
    let a = Arena::new();
    let marker = format!("sbx-race-{}", std::process::id());
    let flip = a.node.exec(
        &a.attacker,
        &json!({
            "command": "mkdir -p /tmp/real && while :; do rm -rf /tmp/race; mkdir /tmp/race; rm -rf /tmp/race; ln -s / /tmp/race; rm -f /tmp/race; ln -s /proc/1/root /tmp/race; done",
            "wait_seconds": 0,
        }),
    );
    let flip_id = flip["id"].as_str().expect("an exec id").to_string();
    let end = Instant::now() + Duration::from_secs(4);
    let mut tries = 0;
    while Instant::now() < end {
        tries += 1;
        let path = format!("/tmp/race/{marker}");
        let _ = ureq::put(
            &a.node
                .url(&format!("/v1/sandboxes/{}/files?path={path}", a.attacker)),
        )
        .send_bytes(b"escaped?");
        let _ = a.node.post_json(
            &format!(
                "/v1/sandboxes/{}/files/mv?path=/tmp/real&dst=/tmp/race/{marker}-dir",
                a.attacker
            ),
            &json!({}),
        );
        let _ = a.node.post_json(
            &format!(
                "/v1/sandboxes/{}/files/mkdir?path=/tmp/race/{marker}-mkdir",
                a.attacker
            ),
            &json!({}),
        );
    }
    assert!(tries > 10, "too few tries: {tries}");
    let _ = a.node.post_json(
        &format!("/v1/sandboxes/{}/exec/{flip_id}/signal", a.attacker),
        &json!({ "signal": "SIGKILL" }),
    );
    // Nothing of it on the host: not at its root, not in the node's data directory outside
    // the attacker's own.
    for p in [
        format!("/{marker}"),
        format!("/{marker}-dir"),
        format!("/{marker}-mkdir"),
    ] {
        assert!(
            !std::path::Path::new(&p).exists(),
            "{p} was made on the host"
        );
    }
    let found = std::process::Command::new("find")
        .arg(&a.node.data_dir)
        .args(["-name", &format!("{marker}*")])
        .output()
        .expect("find");
    let outside: Vec<String> = String::from_utf8_lossy(&found.stdout)
        .lines()
        .filter(|l| !l.contains(&a.attacker))
        .map(str::to_string)
        .collect();
    assert!(outside.is_empty(), "made outside the attacker: {outside:?}");
    eprintln!(
        "attack: {tries} rounds of upload, mv and mkdir through a flipping symlink: contained"
    );
    a.assert_unharmed();
    a.finish();
}

/// A CPU hog in one sandbox (as many spinning processes as the machine has cores, twice over)
/// does not stop a neighbour: its commands still run. The neighbour's exec latency during the
/// hog is printed (a figure to report, not a timed assertion).
#[test]
fn a_cpu_hog_leaves_its_neighbour_running() {
    let a = Arena::new();
    let quiet = exec_latencies(&a, 10);
    let hog = a.node.exec(
        &a.attacker,
        &json!({
            "command": "for i in $(seq 8); do (while :; do :; done) & done; wait",
            "wait_seconds": 0,
        }),
    );
    let hog_id = hog["id"].as_str().expect("an exec id").to_string();
    std::thread::sleep(Duration::from_millis(500));
    let loaded = exec_latencies(&a, 20);
    let pct = |xs: &[f64], p: f64| {
        let mut v = xs.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        v[((p / 100.0) * (v.len() - 1) as f64).round() as usize]
    };
    eprintln!(
        "attack: neighbour exec latency, quiet p50 {:.1} ms; under a CPU hog of 8 spinners p50 {:.1} ms, p99 {:.1} ms",
        pct(&quiet, 50.0),
        pct(&loaded, 50.0),
        pct(&loaded, 99.0)
    );
    let _ = a.node.post_json(
        &format!("/v1/sandboxes/{}/exec/{hog_id}/signal", a.attacker),
        &json!({ "signal": "SIGKILL" }),
    );
    a.assert_unharmed();
    a.finish();
}

/// Milliseconds of `n` execs of `true` in the neighbour, each waited for.
fn exec_latencies(a: &Arena, n: usize) -> Vec<f64> {
    (0..n)
        .map(|_| {
            let t = Instant::now();
            let v = a.sh(&a.neighbour, "true");
            assert_eq!(v["exit_code"], 0, "{v}");
            t.elapsed().as_secs_f64() * 1000.0
        })
        .collect()
}

/// An inode bomb: empty files made until the sandbox's disk refuses more (btrfs counts inodes
/// in its bytes); the node, the host and the neighbour are unharmed. A small disk (16 MiB:
/// tens of thousands of files) is enough to reach its end.
#[test]
fn an_inode_bomb_stops_at_the_sandboxs_disk() {
    let a = Arena::with(&["--disk-bytes", "16777216"]);
    let lines = a.attack(
        r#"
import os, errno
os.makedirs("/tmp/bomb", exist_ok=True)
n = 0
try:
    while n < 3000000:
        d = f"/tmp/bomb/{n // 10000}"
        if n % 10000 == 0:
            os.makedirs(d, exist_ok=True)
        os.close(os.open(f"{d}/{n}", os.O_CREAT | os.O_WRONLY, 0o644))
        n += 1
    print(f"inodes: ALLOWED ({n} files and no end)")
except OSError as e:
    print(f"inodes: refused {errno.errorcode.get(e.errno)} after {n} files")
"#,
    );
    a.assert_contained(&lines, 1);
    assert!(
        lines
            .iter()
            .any(|l| l.contains("EDQUOT") || l.contains("ENOSPC")),
        "the bomb did not stop at the disk's limit: {lines:?}"
    );
    a.assert_unharmed();
    a.finish();
}

/// Python: writes MiB after MiB (each synced) to `/fill` until a write fails: one line,
/// `refused` with EDQUOT (its own disk's limit) or ENOSPC (the node's disk full), `ALLOWED`
/// for any other error (EIO: the disk broke under it) or no end.
const FILL_DISK: &str = r#"
import os, errno
n = 0
try:
    fd = os.open("/fill", os.O_CREAT | os.O_WRONLY, 0o644)
    chunk = b"\x07" * (1 << 20)
    while n < 4096:
        os.write(fd, chunk)
        os.fsync(fd)
        n += 1
    os.close(fd)
    print(f"fill: ALLOWED ({n} MiB and no end)")
except OSError as e:
    name = errno.errorcode.get(e.errno, str(e.errno))
    verdict = "refused" if e.errno in (errno.EDQUOT, errno.ENOSPC) else "ALLOWED"
    print(f"fill: {verdict} {name} after {n} MiB")
"#;

/// Sandboxes within their disks' limits fill the node's disk (1 GiB, sandboxes' disks of
/// 128 MiB, promised twice over: --disk-overcommit 2): creates past the promise are refused
/// (503 drive_full), each writer stops at its limit (EDQUOT) or at the full disk (ENOSPC),
/// never EIO, so does the neighbour; GET /healthz says the node's disk is full; once the
/// writers are gone the node, the host and the neighbour are as they were.
#[test]
fn sandboxes_within_their_limits_fill_the_disk_and_get_enospc_never_eio() {
    let a = Arena::with(&[
        "--disk-image-bytes",
        "1073741824",
        "--disk-bytes",
        "134217728",
        "--disk-overcommit",
        "2",
        "--warm-pool",
        "0",
    ]);
    // More sandboxes, until the disk's promise refuses one.
    let mut extra = Vec::new();
    let refused = loop {
        assert!(
            extra.len() < 24,
            "24 sandboxes of 128 MiB on a disk of 1 GiB"
        );
        let r = a
            .node
            .post_json("/v1/sandboxes", &json!({ "sleep_after_seconds": null }));
        if r.status != 201 {
            break r;
        }
        extra.push(r.json()["id"].as_str().expect("an id").to_string());
    };
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert_eq!(
        refused.json()["error"]["code"],
        "drive_full",
        "{}",
        refused.text()
    );
    // (1 GiB - 166 MiB) * 2 / 128 MiB: 13 in all.
    assert!(
        extra.len() + 2 >= 10,
        "{} sandboxes: {}",
        extra.len() + 2,
        refused.text()
    );

    let fill = |id: &str| -> String {
        let v = a.node.exec(
            id,
            &json!({ "command": ["python3", "-c", FILL_DISK], "wait_seconds": 120 }),
        );
        assert_eq!(v["status"], "exited", "{v}");
        let line = stdout(&v).trim().to_string();
        eprintln!("attack {id}: {line}");
        line
    };
    let mut lines = vec![fill(&a.attacker)];
    for id in &extra {
        let line = fill(id);
        let full = line.contains("ENOSPC");
        lines.push(line);
        if full {
            break;
        }
    }
    a.assert_contained(&lines, 2);
    assert!(
        lines.iter().any(|l| l.contains("ENOSPC")),
        "the disk never filled: {lines:?}"
    );
    // The neighbour finds the disk full: ENOSPC, not EIO.
    let line = fill(&a.neighbour);
    assert!(line.contains("refused"), "the neighbour: {line}");
    let v = a.sh(&a.neighbour, "cat /tmp/precious");
    assert_eq!(stdout(&v), "precious\n", "the neighbour: {v}");
    // GET /healthz says why the node cannot make sandboxes (its answer is up to a second old).
    let deadline = Instant::now() + Duration::from_secs(5);
    let r = loop {
        let r = a.node.get("/healthz", &[]);
        if r.status != 200 || Instant::now() > deadline {
            break r;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.text().contains("node_disk"), "{}", r.text());

    // The writers gone, the disk has its room again (btrfs frees a deleted subvolume's
    // blocks in the background).
    for id in &extra {
        a.node.delete_sandbox(id);
    }
    for id in [&a.attacker, &a.neighbour] {
        let v = a.sh(id, "rm -f /fill && sync");
        assert_eq!(v["exit_code"], 0, "{v}");
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while a.node.get("/healthz", &[]).status != 200 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    a.assert_unharmed();
    a.finish();
}
