//! What a sandbox can do to the host and to other nodes: a fork bomb ends at its timeout and
//! leaves nothing; host users cannot reach sandboxes' files; two nodes on one host keep to their
//! own cgroup folders.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::common::{self, TestNode};
use serde_json::json;

/// Forks for ever; each child leaves the command's process group and session (the agent's
/// kill of the group misses it), takes 16 MiB and forks too.
const SETSID_BOMB: &str = "import os\nwhile True:\n    try:\n        if os.fork() == 0:\n            os.setsid()\n            b = bytearray(16 << 20)\n    except OSError:\n        pass\n";

/// The classic one: each `:` starts two more in the background, through a pipe; the command's
/// shell then spins (builtins only: it needs no fork) until its timeout.
const SHELL_BOMB: &str = ":(){ :|:& };:; while true; do true; done";

/// A fork bomb (the node's pids limit, 128 in tests, caps it) is answered `timed_out` at its
/// timeout, and its sandbox is gone afterwards: no process, cgroup, mount or directory.
#[test]
fn a_fork_bomb_times_out_and_leaves_nothing() {
    let node = TestNode::start_with(&["--warm-pool", "0"]);
    for command in [
        json!(["python3", "-c", SETSID_BOMB]),
        json!(["bash", "-c", SHELL_BOMB]),
    ] {
        let (status, v) = node.run(&json!({
            "command": command,
            "timeout_seconds": 3,
            "limits": { "memory_bytes": 128u64 << 20, "vcpus": 1 },
        }));
        assert_eq!(status, 200, "{command}: {v}\n{}", node.log_tail(30));
        assert_eq!(v["status"], "timed_out", "{command}: {v}");
        node.assert_clean(Duration::from_secs(60));
    }
}

/// Freezes a sandbox's cgroup from the host, and thaws it when dropped (a frozen process
/// cannot die: a failing test must not leave one).
struct Frozen(PathBuf, &'static str);

impl Frozen {
    fn freeze(node: &TestNode, sandbox_id: &str) -> Frozen {
        let (dir, file, thawed, frozen) = match node.cgroup_dir("freezer") {
            Some(d) if d.join(sandbox_id).join("freezer.state").exists() => {
                (d.join(sandbox_id), "freezer.state", "THAWED", "FROZEN")
            }
            _ => (
                node.cgroup_dir("unified")
                    .expect("a freezer")
                    .join(sandbox_id),
                "cgroup.freeze",
                "0",
                "1",
            ),
        };
        let f = Frozen(dir.join(file), thawed);
        std::fs::write(&f.0, frozen).expect("freeze the sandbox's group");
        f
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.0, self.1);
    }
}

/// An agent that cannot act at the deadline (here its group is frozen from the host, as a
/// fork bomb starves it under the sandbox's CPU quota) does not hold the run: the node's own
/// deadline answers `timed_out`, and the teardown kills a frozen group's processes (it freezes,
/// kills and thaws) and leaves nothing.
#[test]
fn a_run_whose_agent_cannot_act_is_answered_timed_out_and_ended() {
    let node = TestNode::start_with(&["--warm-pool", "0"]);
    let mut s = node.open_sse(&json!({
        "command": "echo up; sleep 1000",
        "timeout_seconds": 3,
        "stream": true,
    }));
    let start = s.next_event().expect("start event");
    assert_eq!(start.event, "start", "{:?}", start.data);
    let id = start.data["sandbox_id"].as_str().unwrap().to_string();
    let first = s.next_event().expect("output");
    assert_eq!(first.data["data"], "up\n", "{:?}", first.data);
    let _frozen = Frozen::freeze(&node, &id);
    let rest = s.rest();
    let exit = rest.last().expect("events");
    assert_eq!(exit.event, "exit", "{rest:?}\n{}", node.log_tail(20));
    assert_eq!(exit.data["status"], "timed_out", "{:?}", exit.data);
    assert_eq!(exit.data["signal"], "SIGKILL", "{:?}", exit.data);
    node.assert_clean(Duration::from_secs(60));
}

/// A sandboxd started by hand, with its own data directory; killed and removed when dropped.
struct OtherNode {
    child: Child,
    root: PathBuf,
}

impl OtherNode {
    fn spawn(args: &[&str]) -> OtherNode {
        let root = std::env::temp_dir().join(common::unique("sbx-test-other"));
        std::fs::create_dir_all(root.join("data")).expect("make its data directory");
        let log = std::fs::File::create(root.join("node.log")).expect("its log");
        let bin = common::sandboxd_bin();
        let child = Command::new(&bin)
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--data-dir")
            .arg(root.join("data"))
            .arg("--images-dir")
            .arg(common::images_dir())
            .arg("--agent")
            .arg(bin.with_file_name("sbx-agent"))
            .args(["--warm-pool", "0", "--pids-max", "128"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start sandboxd");
        OtherNode { child, root }
    }

    /// Its exit status, if it exits within `timeout`.
    fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.root.join("node.log")).unwrap_or_default()
    }
}

impl Drop for OtherNode {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A node killed keeps its disk mounted (the next one over the same data directory
        // finds it): taken away here, with the sandboxes' bind on it.
        for m in ["data/sandboxes", "data/disk"] {
            if let Ok(c) = std::ffi::CString::new(self.root.join(m).as_os_str().as_encoded_bytes())
            {
                // SAFETY: umount2 reads the NUL-terminated path, which lives for the call.
                unsafe {
                    libc::umount2(c.as_ptr(), libc::MNT_DETACH);
                }
            }
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// Two nodes on one host, another data directory each, one cgroup folder (the same
/// `--cgroup-name`): the second stops at start, naming the first's data directory, before it
/// touches anything; the first node's sandboxes (a kept one and its warm pool) keep running
/// and answering, and it still makes new ones.
#[test]
fn a_second_node_on_a_held_cgroup_folder_stops_and_touches_nothing() {
    let node = TestNode::start_with(&["--warm-pool", "2"]);
    let sb = node.create_sandbox(&json!({}));
    let id = sb["id"].as_str().expect("id").to_string();
    let agent = node.agent_pid(&id).expect("the sandbox's agent");
    let warm = node.warm_ids();
    let mut other = OtherNode::spawn(&["--cgroup-name", &node.cgroup_name]);
    let status = other.wait_exit(Duration::from_secs(60));
    let log = other.log();
    assert!(
        status.is_some_and(|s| !s.success()),
        "the second node did not stop ({status:?}):\n{log}"
    );
    assert!(
        log.contains("is in use by another sandboxd"),
        "its message:\n{log}"
    );
    let data = std::fs::canonicalize(&node.data_dir).unwrap();
    assert!(
        log.contains(&data.display().to_string()),
        "it does not name the first node's data directory:\n{log}"
    );
    drop(other);
    // The first node's sandboxes are as they were, and answer.
    assert_eq!(node.agent_pid(&id), Some(agent), "the kept sandbox's agent");
    let e = node.exec(&id, &json!({ "command": "echo still here" }));
    let e = node.exec_wait(&id, e["id"].as_str().unwrap(), Duration::from_secs(60));
    assert_eq!(e["stdout"], "still here\n", "{e}");
    for w in &warm {
        assert!(node.agent_pid(w).is_some(), "warm sandbox {w} was ended");
    }
    let v = node.run_ok(&json!({ "command": "echo made" }));
    assert_eq!(v["stdout"], "made\n", "{v}");
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(30));
}

/// Runs `sh -c script` in a kept sandbox and asserts it exited 0; its stdout.
fn sh(node: &TestNode, id: &str, script: &str) -> String {
    let e = node.exec(id, &json!({ "command": script }));
    let e = node.exec_wait(id, e["id"].as_str().unwrap(), Duration::from_secs(60));
    assert_eq!(e["exit_code"], 0, "{script}: {e}");
    e["stdout"].as_str().unwrap_or_default().to_string()
}

/// `program args` run on the host as `nobody` (uid and gid 65534): its status and output, or
/// the error of its start.
fn as_nobody(program: &Path, args: &[&Path]) -> Result<(ExitStatus, String), std::io::Error> {
    let out = Command::new(program)
        .args(args)
        .uid(65534)
        .gid(65534)
        .current_dir("/")
        .env_clear()
        .stdin(Stdio::null())
        .output()?;
    Ok((
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    ))
}

/// A setuid copy of `cat` made in a sandbox (its owner is the sandboxes' root, host uid
/// 100000) does not let a host user read that sandbox's files or another's: the data directory
/// is root's alone (0700), and the sandboxes' directory is mounted nosuid on the host.
#[test]
fn host_users_cannot_reach_sandboxes_through_a_setuid_file() {
    let node = TestNode::start_with(&["--warm-pool", "0"]);
    let a = node.create_sandbox(&json!({}));
    let a = a["id"].as_str().unwrap().to_string();
    let b = node.create_sandbox(&json!({}));
    let b = b["id"].as_str().unwrap().to_string();
    sh(
        &node,
        &a,
        "cp /bin/cat /tmp/suid_cat && chmod 4755 /tmp/suid_cat && \
         echo secret-a > /tmp/secret && chmod 600 /tmp/secret",
    );
    sh(
        &node,
        &b,
        "echo secret-b > /tmp/secret && chmod 600 /tmp/secret",
    );
    let suid = node.sandbox_dir(&a).join("upper/tmp/suid_cat");
    let secret_a = node.sandbox_dir(&a).join("upper/tmp/secret");
    let secret_b = node.sandbox_dir(&b).join("upper/tmp/secret");
    // The file is there on the host, setuid, owned by the sandboxes' root.
    let meta = std::fs::metadata(&suid).expect("the setuid copy in the upper directory");
    assert_eq!(meta.mode() & 0o7777, 0o4755, "{}", suid.display());
    assert_eq!(meta.uid(), 100_000);
    assert_eq!(std::fs::read_to_string(&secret_b).unwrap(), "secret-b\n");
    // As nobody: neither the setuid copy runs nor are the files read, directly or through it.
    for (program, args) in [
        (suid.as_path(), vec![secret_a.as_path()]),
        (suid.as_path(), vec![secret_b.as_path()]),
        (Path::new("/bin/cat"), vec![secret_a.as_path()]),
        (Path::new("/bin/cat"), vec![secret_b.as_path()]),
    ] {
        match as_nobody(program, &args) {
            Err(_) => {}
            Ok((status, out)) => {
                assert!(
                    !status.success() && !out.contains("secret-"),
                    "{} {args:?} as nobody: {status}: {out}",
                    program.display()
                );
            }
        }
    }
    // The host's view of the sandboxes' directory is nosuid.
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let dir = std::fs::canonicalize(node.data_dir.join("sandboxes")).unwrap();
    let dir = dir.to_string_lossy();
    let opts: Vec<&str> = info
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (f.get(4) == Some(&dir.as_ref())).then(|| f[5])
        })
        .collect();
    assert!(
        opts.last()
            .is_some_and(|o| o.split(',').any(|o| o == "nosuid")),
        "mounts at {dir}: {opts:?}"
    );
    // Inside, the sandbox is unchanged: its files are its own.
    assert_eq!(sh(&node, &a, "/tmp/suid_cat /tmp/secret"), "secret-a\n");
    node.delete_sandbox(&a);
    node.delete_sandbox(&b);
    node.assert_clean(Duration::from_secs(30));
}

/// A data directory left with loose modes (another user's, world-writable) is made root's
/// alone (0700) at start, with its sandboxes' and images' directories.
#[test]
fn a_loose_data_directory_is_tightened_at_start() {
    let mut node = TestNode::start_private_images(&["--warm-pool", "0"]);
    node.stop();
    let dirs = [
        node.data_dir.clone(),
        node.data_dir.join("sandboxes"),
        node.images_dir.clone(),
    ];
    for d in &dirs {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o777)).unwrap();
        std::os::unix::fs::chown(d, Some(65534), Some(65534)).unwrap();
    }
    node.restart();
    for d in &dirs {
        let meta = std::fs::metadata(d).unwrap();
        assert_eq!(meta.mode() & 0o7777, 0o700, "{}", d.display());
        assert_eq!((meta.uid(), meta.gid()), (0, 0), "{}", d.display());
    }
    let v = node.run_ok(&json!({ "command": "echo ok" }));
    assert_eq!(v["stdout"], "ok\n", "{v}");
    node.assert_clean(Duration::from_secs(30));
}

/// The node's zygote (`sbx-agent zygote`, its child that forks each sandbox's stage 0): a
/// killed one is started again at the next sandbox, which runs as ever; the node's stop ends
/// it.
#[test]
fn a_killed_zygote_is_started_again_and_ends_with_the_node() {
    let mut node = TestNode::start();
    let zygotes = |node_pid: u32| -> Vec<u32> {
        let mut found = Vec::new();
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
            let ppid = stat
                .rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            // A run's agent serving in process was forked from the zygote (its command line)
            // and is the node's child too once its stages ended: it is PID 1 of a PID
            // namespace of its own (two pids on its NSpid line), the zygote is not.
            let status = std::fs::read_to_string(e.path().join("status")).unwrap_or_default();
            let host_only = status
                .lines()
                .find_map(|l| l.strip_prefix("NSpid:"))
                .is_some_and(|p| p.split_whitespace().count() == 1);
            if ppid == Some(node_pid) && cmdline == b"sbx-agent\0zygote\0" && host_only {
                found.push(pid);
            }
        }
        found
    };
    let node_pid = node.pid().unwrap();
    let v = node.run_ok(&json!({ "command": ["echo", "one"] }));
    assert_eq!(common::stdout(&v), "one\n", "{v}");
    let first = zygotes(node_pid);
    assert_eq!(first.len(), 1, "the node's zygotes: {first:?}");
    // SAFETY: a signal to the zygote found above, the node's child.
    unsafe { libc::kill(first[0] as i32, libc::SIGKILL) };
    let v = node.run_ok(&json!({ "command": ["echo", "two"] }));
    assert_eq!(common::stdout(&v), "two\n", "{v}");
    let second = zygotes(node_pid);
    assert!(
        second.len() == 1 && second != first,
        "after the kill: {second:?}, before: {first:?}"
    );
    node.stop();
    let deadline = Instant::now() + Duration::from_secs(10);
    while Path::new(&format!("/proc/{}", second[0])).exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        !Path::new(&format!("/proc/{}", second[0])).exists(),
        "the zygote outlived its node"
    );
}
