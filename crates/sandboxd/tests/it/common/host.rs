//! What a node leaves on the host: its cgroup folders, the processes in them, its sandboxes'
//! directories and mounts; the checks that nothing is left, and the clean-up after a node.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::node::TestNode;

/// The v1 controllers the node makes sandboxes' groups in.
const V1_CONTROLLERS: [&str; 4] = ["memory", "pids", "cpu", "freezer"];

/// The folder at each hierarchy's root the daemon puts nodes' folders in by default.
const STABLE_PARENT: &str = "sbx.slice";

/// Where the node's cgroup folders are: one per hierarchy at the stable place
/// (`<hierarchy>/sbx.slice/<name>`), or under the tests' own cgroup where the daemon fell back
/// to it (or a node of the old layout ran); both when both exist (the stable place first).
pub(super) fn node_cgroup_dirs(name: &str) -> Vec<(String, PathBuf)> {
    let (stable, own) = cgroup_places(name);
    let exists = |dirs: &[(String, PathBuf)]| dirs.iter().any(|(_, d)| d.is_dir());
    match (exists(&stable), exists(&own)) {
        (true, true) => stable.into_iter().chain(own).collect(),
        (false, true) => own,
        _ => stable,
    }
}

/// The node's folders at the stable place and under the tests' own cgroup.
#[allow(clippy::type_complexity)]
fn cgroup_places(name: &str) -> (Vec<(String, PathBuf)>, Vec<(String, PathBuf)>) {
    let own = fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let own: Vec<(String, String)> = own
        .lines()
        .filter_map(|l| {
            let mut it = l.splitn(3, ':');
            let _ = it.next()?;
            Some((it.next()?.to_string(), it.next()?.to_string()))
        })
        .collect();
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    // (root, mount point, fstype, super options)
    let mounts: Vec<(String, PathBuf, String, Vec<String>)> = mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let l: Vec<&str> = left.split(' ').collect();
            let r: Vec<&str> = right.split(' ').collect();
            Some((
                l.get(3)?.to_string(),
                PathBuf::from(l.get(4)?),
                r.first()?.to_string(),
                r.get(2)?.split(',').map(String::from).collect(),
            ))
        })
        .collect();
    let mut stable = Vec::new();
    let mut v1 = Vec::new();
    for ctrl in V1_CONTROLLERS {
        let mount = mounts
            .iter()
            .find(|m| m.2 == "cgroup" && m.3.iter().any(|o| o == ctrl));
        let path = own
            .iter()
            .find(|(c, _)| c.split(',').any(|c| c == ctrl))
            .map(|(_, p)| p.clone());
        if let (Some(m), Some(p)) = (mount, path) {
            let rel = p.trim_start_matches('/');
            let root = m.0.trim_start_matches('/');
            let rel = rel
                .strip_prefix(root)
                .unwrap_or(rel)
                .trim_start_matches('/');
            v1.push((ctrl.to_string(), m.1.join(rel).join(name)));
            stable.push((ctrl.to_string(), m.1.join(STABLE_PARENT).join(name)));
        }
    }
    if v1.iter().any(|(c, _)| c == "memory") && v1.iter().any(|(c, _)| c == "pids") {
        return (stable, v1);
    }
    let Some(unified) = mounts.iter().find(|m| m.2 == "cgroup2") else {
        return (Vec::new(), Vec::new());
    };
    let path = own
        .iter()
        .find(|(c, _)| c.is_empty())
        .map(|(_, p)| p.clone())
        .unwrap_or_else(|| "/".into());
    (
        vec![("unified".into(), unified.1.join(STABLE_PARENT).join(name))],
        vec![(
            "unified".into(),
            unified.1.join(path.trim_start_matches('/')).join(name),
        )],
    )
}

/// A lock of the whole machine, held until dropped: tests that use something of the host only
/// one may use at a time (fixed addresses) take turns with it, whether they run as threads of
/// one test binary or as processes of their own (`cargo nextest` runs each test in its own).
pub struct HostLock(#[allow(dead_code)] fs::File);

impl HostLock {
    /// Waits for the lock `name` (a file of `sbx-test-locks` in the temporary directory,
    /// `flock`ed).
    pub fn take(name: &str) -> HostLock {
        loop {
            match HostLock::lock(name, 0) {
                Ok(l) => return l,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => panic!("flock {name}: {e}"),
            }
        }
    }

    /// The lock `name` if nothing holds it, without waiting.
    pub fn try_take(name: &str) -> Option<HostLock> {
        match HostLock::lock(name, libc::LOCK_NB) {
            Ok(l) => Some(l),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => None,
            Err(e) => panic!("flock {name}: {e}"),
        }
    }

    fn lock(name: &str, flags: i32) -> std::io::Result<HostLock> {
        use std::os::fd::AsRawFd;
        // Kept (a lock file removed while another process waits on it would not be the next
        // one's): a few small files in one folder.
        let dir = std::env::temp_dir().join("sbx-test-locks");
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        let path = dir.join(format!("{name}.lock"));
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
        // SAFETY: flock takes a descriptor that `file` keeps open for the call.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | flags) } == 0 {
            Ok(HostLock(file))
        } else {
            Err(std::io::Error::last_os_error())
        }
    }
}

/// A network range (a /24 of 10.249.0.0/16) no other node of the tests on the machine has
/// while the lock it comes with is held: the default ranges of nodes (a /20 of 10.251.0.0/16
/// by their cgroup folder's hash, 16 in all) are too few for the tests that run at once.
pub(super) fn own_net_range() -> (String, HostLock) {
    let from = std::process::id() as usize;
    for i in 0..250 {
        let k = (from + i) % 250;
        if let Some(lock) = HostLock::try_take(&format!("net-10.249.{k}")) {
            return (format!("10.249.{k}.0/24"), lock);
        }
    }
    panic!("every network range of 10.249.0.0/16 is held by a node of the tests");
}

pub(super) fn send_signal(pid: u32, sig: i32) {
    // SAFETY: kill has no memory effects; an error (the process is gone) is ignored.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// The pids of processes whose cgroup path has the folder `name` in it, with their lines.
pub(super) fn processes_in(name: &str) -> Vec<(u32, String)> {
    let me = std::process::id();
    let mut out = Vec::new();
    let Ok(rd) = fs::read_dir("/proc") else {
        return out;
    };
    let inner = format!("/{name}/");
    let last = format!("/{name}");
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(cg) = fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
            continue;
        };
        if let Some(line) = cg
            .lines()
            .find(|l| l.contains(&inner) || l.ends_with(&last))
        {
            out.push((pid, line.to_string()));
        }
    }
    out
}

fn comm(pid: u32) -> String {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

fn subdirs(dir: &Path) -> Vec<PathBuf> {
    fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default()
}

impl TestNode {
    /// Ids of the sandboxes ready in the node's warm pool. Empty when the node does not answer.
    pub fn warm_ids(&self) -> Vec<String> {
        self.warm_pool(false)
    }

    /// Ids of the sandboxes of the node's warm pool, ready or being made (one being made has
    /// its directory and cgroups before it is ready): the node's, not leftovers of a run.
    pub fn pool_ids(&self) -> Vec<String> {
        self.warm_pool(true)
    }

    fn warm_pool(&self, making: bool) -> Vec<String> {
        if self.child.is_none() {
            return Vec::new();
        }
        // Through the typed client, with the node's key if it has one.
        let Ok(info) = self.client().node_info() else {
            return Vec::new();
        };
        let v = serde_json::Value::Object(info.other);
        let mut ids: Vec<String> = v["warm_pool"]["ready"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        if making {
            ids.extend(v["warm_pool"]["making"].as_str().map(String::from));
        }
        ids
    }

    /// What is left of runs' sandboxes: everything of the node's sandboxes but its warm pool.
    pub fn leftovers(&self) -> Vec<String> {
        // Traces first: a warm sandbox started after them is not among them, and one among
        // them is still the pool's when its ids are read (nothing takes it meanwhile but a run).
        let mut all = self.all_sandbox_traces();
        let warm = self.pool_ids();
        all.retain(|l| !warm.iter().any(|w| l.contains(w.as_str())));
        all
    }

    /// Everything of the node's sandboxes on the host, warm ones included.
    pub fn all_sandbox_traces(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Ok(rd) = fs::read_dir(self.data_dir.join("sandboxes")) {
            for e in rd.flatten() {
                out.push(format!("sandbox directory {}", e.path().display()));
            }
        }
        for (_, dir) in &self.cgroup_dirs {
            for d in subdirs(dir) {
                out.push(format!("cgroup {}", d.display()));
            }
        }
        let data = self.data_dir.to_string_lossy().into_owned();
        // The node's own nosuid view of its sandboxes' directory is not a sandbox's.
        let own = format!(" {}/sandboxes ", data);
        // Nor is its disk (volumes and sandboxes' layers, DATA_DIR/disk).
        let disk = format!(" {}/disk ", data);
        if let Ok(mounts) = fs::read_to_string("/proc/mounts") {
            for l in mounts
                .lines()
                .filter(|l| l.contains(&data) && !l.contains(&own) && !l.contains(&disk))
            {
                out.push(format!("mount {l}"));
            }
        }
        for (pid, line) in processes_in(&self.cgroup_name) {
            out.push(format!("process {pid} ({}) in {line}", comm(pid)));
        }
        out
    }

    /// Polls [`TestNode::leftovers`] until it is empty or `timeout` is up; what is left then.
    pub fn wait_clean(&self, timeout: Duration) -> Vec<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = self.leftovers();
            if left.is_empty() || Instant::now() > deadline {
                return left;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Asserts that nothing of the node's sandboxes is left within `timeout`.
    pub fn assert_clean(&self, timeout: Duration) {
        let left = self.wait_clean(timeout);
        assert!(
            left.is_empty(),
            "left on the host after {timeout:?}:\n  {}\n{}",
            left.join("\n  "),
            self.log_tail(20)
        );
    }

    /// Removes whatever is left of the node's sandboxes (after the node is stopped).
    pub(super) fn force_clean(&self) {
        let dirs: Vec<PathBuf> = self.cgroup_dirs.iter().map(|(_, d)| d.clone()).collect();
        for _ in 0..250 {
            let mut busy = false;
            for (pid, _) in processes_in(&self.cgroup_name) {
                send_signal(pid, libc::SIGKILL);
                busy = true;
            }
            for dir in &dirs {
                for sub in subdirs(dir) {
                    // A frozen (paused) sandbox's processes die only once thawed.
                    let _ = fs::write(sub.join("freezer.state"), "THAWED");
                    let _ = fs::write(sub.join("cgroup.freeze"), "0");
                    let procs = fs::read_to_string(sub.join("cgroup.procs")).unwrap_or_default();
                    for pid in procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
                        send_signal(pid, libc::SIGKILL);
                    }
                    if fs::remove_dir(&sub).is_err() {
                        busy = true;
                    }
                }
            }
            if !busy {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        for dir in &dirs {
            let _ = fs::remove_dir(dir);
        }
        let data = self.data_dir.to_string_lossy().into_owned();
        if let Ok(mounts) = fs::read_to_string("/proc/mounts") {
            let mut points: Vec<&str> = mounts
                .lines()
                .filter_map(|l| l.split(' ').nth(1))
                .filter(|p| p.contains(&data))
                .collect();
            points.reverse();
            for p in points {
                if let Ok(c) = std::ffi::CString::new(p) {
                    // SAFETY: umount2 reads the NUL-terminated path, which lives for the call.
                    unsafe {
                        libc::umount2(c.as_ptr(), libc::MNT_DETACH);
                    }
                }
            }
        }
    }

    /// The host pid of a sandbox's agent: the process of the sandbox's cgroup that is PID 1 of
    /// its PID namespace.
    pub fn agent_pid(&self, sandbox_id: &str) -> Option<u32> {
        processes_in(&self.cgroup_name)
            .into_iter()
            .filter(|(_, line)| line.contains(sandbox_id))
            .map(|(pid, _)| pid)
            .find(|pid| {
                fs::read_to_string(format!("/proc/{pid}/status"))
                    .ok()
                    .and_then(|s| {
                        s.lines()
                            .find_map(|l| l.strip_prefix("NSpid:"))
                            .map(|v| v.split_whitespace().last() == Some("1"))
                    })
                    .unwrap_or(false)
            })
    }

    /// What is left on the host of one sandbox: its directory, cgroups and processes.
    pub fn traces_of(&self, sandbox_id: &str) -> Vec<String> {
        self.all_sandbox_traces()
            .into_iter()
            .filter(|l| l.contains(sandbox_id))
            .collect()
    }
}
