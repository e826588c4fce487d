//! Cgroups for sandboxes, v1 and v2 behind one interface.
//!
//! Each sandbox gets a group `<parent>/<node>/<id>` in every hierarchy that it uses (v1:
//! memory, cpu, pids, freezer; v2: the unified tree with those controllers enabled). The
//! parent is a place no caller's scope owns: [`DEFAULT_PARENT`] (`sbx.slice`) at each
//! hierarchy's root, or the one the operator gives (`--cgroup-parent`). So a node started from a
//! shell, a login session or a supervisor's scope does not leave its sandboxes there: when that
//! scope is cleaned up (its processes killed, its folders removed), the sandboxes live on. Where
//! a hierarchy's root cannot be written (a node nested in a container whose cgroups are
//! read-only, or a v2 root that holds processes), that hierarchy falls back to the node's own
//! cgroup (read from `/proc/self/cgroup`: the layout of older nodes), with the reason logged.
//! Sandboxes an older node made under its own cgroup are still found there (`legacy`).

use std::fs;
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("no cgroup hierarchy holds the {0} controller")]
    NoController(&'static str),
    #[error("cgroup {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cgroup {0} still has processes")]
    Busy(PathBuf),
    #[error("cgroup folder {folder} is in use by another sandboxd ({holder}); give this node another --cgroup-name")]
    InUse { folder: PathBuf, holder: String },
    #[error("the lock of cgroup folder {folder}: {source}")]
    Lock {
        folder: PathBuf,
        #[source]
        source: crate::hostfs::HostFsError,
    },
}

/// The data directory whose node keeps the cgroup folder name `sbx`.
pub const DEFAULT_DATA_DIR: &str = "/var/lib/sbx";

/// Where the locks of cgroup folders are kept.
pub const LOCK_DIR: &str = "/run/sbx";

/// The cgroup folder name of a node whose data directory is `data_dir` (canonical): `sbx` for
/// [`DEFAULT_DATA_DIR`], `sbx-` and a short hash of the path otherwise, so that two nodes of
/// different data directories never share a folder.
pub fn default_name(data_dir: &Path) -> String {
    if data_dir == Path::new(DEFAULT_DATA_DIR) {
        return "sbx".into();
    }
    let hash = crate::hostfs::short_hash(data_dir.as_os_str().as_encoded_bytes());
    format!("sbx-{}", &hash[..12])
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CgroupError + '_ {
    move |source| CgroupError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Resource limits of one sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub memory_bytes: u64,
    pub vcpus: u32,
    pub pids: u32,
}

/// Which cgroup layout the node runs under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    /// v1 hierarchies: controller -> the node's group directory in it.
    V1(Vec<(&'static str, PathBuf)>),
    /// The unified hierarchy: the directory sandboxes' groups are made in.
    V2(PathBuf),
}

impl Layout {
    fn dirs(&self) -> Vec<PathBuf> {
        match self {
            Layout::V1(dirs) => dirs.iter().map(|(_, d)| d.clone()).collect(),
            Layout::V2(base) => vec![base.clone()],
        }
    }

    fn group(&self, id: &str) -> Group {
        let dirs = match self {
            Layout::V1(dirs) => dirs.iter().map(|(c, d)| (Some(*c), d.join(id))).collect(),
            Layout::V2(base) => vec![(None, base.join(id))],
        };
        Group { dirs }
    }

    /// The folder sandboxes' groups are listed from (the first hierarchy's on v1).
    fn first(&self) -> Option<&Path> {
        match self {
            Layout::V1(dirs) => dirs.first().map(|(_, d)| d.as_path()),
            Layout::V2(b) => Some(b.as_path()),
        }
    }
}

const V1_CONTROLLERS: [&str; 4] = ["memory", "cpu", "pids", "freezer"];

/// The folder at each hierarchy's root that nodes' folders go in by default.
pub const DEFAULT_PARENT: &str = "sbx.slice";

/// Where the node's folders go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parent {
    /// [`DEFAULT_PARENT`] at each hierarchy's root; a hierarchy whose root cannot be written
    /// falls back to the node's own cgroup (the reason is in [`Cgroups::placement`]).
    Auto,
    /// This path under each hierarchy's root (`--cgroup-parent`); no fallback: a node that
    /// cannot make its folders there does not start.
    Given(PathBuf),
    /// Under the node's own cgroup, as nodes before the stable place did (tests of the
    /// upgrade; a node that wants its sandboxes inside its own limits).
    Own,
}

/// Where the node's folder went in one hierarchy, and why it is not at the stable place when
/// it is not.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Placement {
    /// The controller (`memory`, ...) or `unified`.
    pub controller: String,
    pub folder: PathBuf,
    /// Set when the hierarchy fell back to the node's own cgroup.
    pub fallback: Option<String>,
}

/// The node's folders of the old layout (under its own cgroup).
#[derive(Debug, Clone)]
struct Legacy {
    /// Every hierarchy's old folder (where a hierarchy fell back, the same as the current).
    layout: Layout,
    /// The old folder of a hierarchy where it differs from the current one: a sandbox whose
    /// group is there is an old one.
    probe: PathBuf,
    /// The old folders that are not current ones (what goes once empty).
    only: Vec<PathBuf>,
}

/// One hierarchy the node uses: its mount and the node's own cgroup in it.
struct Hierarchy {
    ctrl: Option<&'static str>,
    mount: PathBuf,
    /// The node's own cgroup, relative to the mount.
    own: PathBuf,
}

/// How often [`Cgroups::keep_warm`] migrates: well within the shortest grace period.
pub const WARM_EVERY: Duration = Duration::from_millis(4);

/// What [`Cgroups::keep_warm`] returns: the migrations stop when it is dropped.
#[derive(Debug)]
pub struct WarmGuard {
    _stop: std::sync::mpsc::Sender<()>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl WarmGuard {
    /// Waits for the thread to end (it ends at once once the guard's sender is gone); for
    /// tests.
    pub fn finish(mut self) -> bool {
        let t = self.thread.take();
        drop(self);
        t.is_some_and(|t| t.join().is_ok())
    }
}

/// The node's cgroup layout, found from `/proc/self/mountinfo` and `/proc/self/cgroup`.
#[derive(Debug)]
pub struct Cgroups {
    layout: Layout,
    placement: Vec<Placement>,
    /// The node's folders under its own cgroup (the layout of older nodes), where they exist
    /// and differ from `layout`: sandboxes an older node made there are adopted and ended
    /// there. `None` once they are gone.
    legacy: std::sync::Mutex<Option<Legacy>>,
    /// Serializes making the folders again (two creates that find them gone at once).
    remake: std::sync::Mutex<()>,
    /// The `cgroup.procs` of the node's own cgroup in one hierarchy ([`Cgroups::warm_migration`]).
    own_procs: Option<PathBuf>,
}

/// The hierarchies the node uses: the v1 ones of [`V1_CONTROLLERS`] when memory and pids are
/// among them, else the unified one (which must have memory).
fn hierarchies() -> Result<Vec<Hierarchy>, CgroupError> {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo")
        .map_err(io_err(Path::new("/proc/self/mountinfo")))?;
    let own =
        fs::read_to_string("/proc/self/cgroup").map_err(io_err(Path::new("/proc/self/cgroup")))?;
    let mounts = parse_mountinfo(&mountinfo);
    let own = parse_proc_cgroup(&own);
    let mut v1 = Vec::new();
    for ctrl in V1_CONTROLLERS {
        let mount = mounts
            .iter()
            .find(|m| m.fstype == "cgroup" && m.options.iter().any(|o| o == ctrl));
        let path = own
            .iter()
            .find(|(ctrls, _)| ctrls.split(',').any(|c| c == ctrl))
            .map(|(_, p)| p.clone());
        if let (Some(m), Some(p)) = (mount, path) {
            let rel = p.trim_start_matches('/');
            // The mount's root is a prefix of the path we are in.
            let root = m.root.trim_start_matches('/');
            let rel = rel
                .strip_prefix(root)
                .unwrap_or(rel)
                .trim_start_matches('/');
            v1.push(Hierarchy {
                ctrl: Some(ctrl),
                mount: m.mount_point.clone(),
                own: PathBuf::from(rel),
            });
        }
    }
    if v1.iter().any(|h| h.ctrl == Some("memory")) && v1.iter().any(|h| h.ctrl == Some("pids")) {
        return Ok(v1);
    }
    let unified = mounts
        .iter()
        .find(|m| m.fstype == "cgroup2")
        .ok_or(CgroupError::NoController("memory"))?;
    let controllers =
        fs::read_to_string(unified.mount_point.join("cgroup.controllers")).unwrap_or_default();
    if !controllers.split_whitespace().any(|c| c == "memory") {
        return Err(CgroupError::NoController("memory"));
    }
    let path = own
        .iter()
        .find(|(ctrls, _)| ctrls.is_empty())
        .map(|(_, p)| p.clone())
        .unwrap_or_else(|| "/".into());
    Ok(vec![Hierarchy {
        ctrl: None,
        mount: unified.mount_point.clone(),
        own: PathBuf::from(path.trim_start_matches('/')),
    }])
}

/// The controllers a v2 folder enables for its children.
const V2_ENABLE: &[u8] = b"+memory +cpu +pids";

/// Makes `rel` (relative) under the mount `mount` as far as it does not exist, and on v2
/// enables the controllers in every folder from the root down to it (the root's children
/// need them enabled in the root, and so on down). Fails on the first folder that cannot be
/// made or written.
fn make_parent(mount: &Path, rel: &Path, v2: bool) -> Result<(), CgroupError> {
    let mut dir = mount.to_path_buf();
    if v2 {
        enable_v2(&dir)?;
    }
    for part in rel.components() {
        dir.push(part);
        match fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_err(&dir)(e)),
        }
        if v2 {
            enable_v2(&dir)?;
        }
    }
    // A folder that exists on a read-only mount (or one this user may not write) is found
    // here, before the node relies on it.
    nix::unistd::access(&dir, nix::unistd::AccessFlags::W_OK).map_err(|e| CgroupError::Io {
        path: dir.clone(),
        source: std::io::Error::from(e),
    })
}

fn enable_v2(dir: &Path) -> Result<(), CgroupError> {
    let ctl = dir.join("cgroup.subtree_control");
    let mut f = fs::OpenOptions::new()
        .write(true)
        .open(&ctl)
        .map_err(io_err(&ctl))?;
    f.write_all(V2_ENABLE).map_err(io_err(&ctl))
}

impl Cgroups {
    /// Finds where sandboxes' groups go, the default way ([`Parent::Auto`]). `name` is the
    /// node's folder (e.g. `sbx`).
    pub fn discover(name: &str) -> Result<Cgroups, CgroupError> {
        Cgroups::place(name, &Parent::Auto)
    }

    /// Finds where sandboxes' groups go: the folder `name` under `parent` in each hierarchy.
    /// Makes the parent folders (not the node's own folder: [`Cgroups::prepare`] does, after
    /// the node's lock is taken).
    pub fn place(name: &str, parent: &Parent) -> Result<Cgroups, CgroupError> {
        let hs = hierarchies()?;
        let v2 = hs.iter().any(|h| h.ctrl.is_none());
        let mut placement = Vec::new();
        let mut olds = Vec::new();
        let mut only = Vec::new();
        for h in &hs {
            let own = h.mount.join(&h.own).join(name);
            let (folder, fallback) = match parent {
                Parent::Own => (own.clone(), None),
                Parent::Given(p) => {
                    let rel = p.strip_prefix("/").unwrap_or(p);
                    make_parent(&h.mount, rel, v2)?;
                    (h.mount.join(rel).join(name), None)
                }
                Parent::Auto => match make_parent(&h.mount, Path::new(DEFAULT_PARENT), v2) {
                    Ok(()) => (h.mount.join(DEFAULT_PARENT).join(name), None),
                    Err(e) => (
                        own.clone(),
                        Some(format!(
                            "{e}: the node's folder goes under its own cgroup in this hierarchy"
                        )),
                    ),
                },
            };
            if folder != own {
                only.push(own.clone());
            }
            olds.push((h.ctrl, own));
            placement.push(Placement {
                controller: h.ctrl.unwrap_or("unified").to_string(),
                folder,
                fallback,
            });
        }
        let layout = if v2 {
            Layout::V2(placement[0].folder.clone())
        } else {
            Layout::V1(
                hs.iter()
                    .zip(&placement)
                    .filter_map(|(h, p)| Some((h.ctrl?, p.folder.clone())))
                    .collect(),
            )
        };
        // The old folders are worth a look only where they exist (a node of the old layout
        // ran here with this name).
        let legacy = match only.first() {
            Some(probe) if probe.is_dir() => Some(Legacy {
                layout: if v2 {
                    Layout::V2(olds[0].1.clone())
                } else {
                    Layout::V1(
                        olds.into_iter()
                            .filter_map(|(c, d)| Some((c?, d)))
                            .collect(),
                    )
                },
                probe: probe.clone(),
                only,
            }),
            _ => None,
        };
        Ok(Cgroups {
            layout,
            placement,
            legacy: std::sync::Mutex::new(legacy),
            remake: std::sync::Mutex::new(()),
            own_procs: hs
                .first()
                .map(|h| h.mount.join(&h.own).join("cgroup.procs")),
        })
    }

    /// Keeps cgroup migrations from waiting, for as long as the guard lives (a restore: criu
    /// moves each restored task into its groups, at moments tens of milliseconds apart).
    ///
    /// The kernel makes the first cgroup migration after a quiet moment wait for an RCU grace
    /// period (the global threadgroup lock's `rcu_sync`: 8 to 25 ms on this project's
    /// machines); migrations that come within a grace period of the last one do not wait. A
    /// thread of the node's moves the node into the cgroup it is already in (nothing changes)
    /// at once and then every [`WARM_EVERY`]: the first wait runs alongside what the caller
    /// does first (criu's start) instead of inside it, and none comes after. Where the kernel
    /// skips the wait (`favordynmods`), these are cheap writes. A write that fails changes
    /// nothing (the kernel takes the lock before it checks the write).
    pub fn keep_warm(&self) -> WarmGuard {
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let thread = self.own_procs.clone().and_then(|file| {
            let pid = std::process::id().to_string();
            std::thread::Builder::new()
                .name("cgroup-warm".into())
                .spawn(move || loop {
                    if let Ok(mut f) = fs::OpenOptions::new().write(true).open(&file) {
                        let _ = std::io::Write::write_all(&mut f, pid.as_bytes());
                    }
                    match stopped.recv_timeout(WARM_EVERY) {
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                        _ => return,
                    }
                })
                .ok()
        });
        WarmGuard {
            _stop: stop,
            thread,
        }
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Where the node's folder is in each hierarchy, and why where it fell back.
    pub fn placement(&self) -> &[Placement] {
        &self.placement
    }

    fn legacy_layout(&self) -> Option<Legacy> {
        self.legacy
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The node's folder that names it: the memory hierarchy's on v1, the one folder on v2.
    pub fn folder(&self) -> PathBuf {
        match &self.layout {
            Layout::V1(dirs) => dirs
                .iter()
                .find(|(c, _)| *c == "memory")
                .or(dirs.first())
                .map(|(_, d)| d.clone())
                .unwrap_or_default(),
            Layout::V2(base) => base.clone(),
        }
    }

    /// Takes the node's exclusive hold on its folder: a lock file under [`LOCK_DIR`] named by
    /// the folder's path, held until the lock is dropped or the process ends. Another living
    /// node holding it is [`CgroupError::InUse`], with what that node wrote (`holder`). Take
    /// it before anything is made or cleaned in the folder.
    pub fn lock(&self, holder: &str) -> Result<crate::hostfs::FileLock, CgroupError> {
        let folder = self.folder();
        let file = Path::new(LOCK_DIR).join(format!(
            "cgroup-{}.lock",
            crate::hostfs::short_hash(folder.as_os_str().as_encoded_bytes())
        ));
        crate::hostfs::FileLock::try_acquire(&file, holder).map_err(|e| match e {
            crate::hostfs::HostFsError::Held { holder } => CgroupError::InUse { folder, holder },
            source => CgroupError::Lock { folder, source },
        })
    }

    /// Removes the node's folders if no sandbox group is left in them (a node that stops with
    /// no sandbox leaves no cgroup behind); a folder still in use stays. The shared parent
    /// (`sbx.slice`) stays: another node may be making its folder in it.
    pub fn remove_if_empty(&self) {
        for d in self.layout.dirs() {
            let _ = fs::remove_dir(d);
        }
        self.remove_legacy_if_empty();
    }

    /// Removes the node's folders of the old layout if no sandbox group is left in them;
    /// returns the folders removed. From then on only the stable place is looked at.
    pub fn remove_legacy_if_empty(&self) -> Vec<PathBuf> {
        let mut legacy = self.legacy.lock().unwrap_or_else(|e| e.into_inner());
        let Some(l) = legacy.as_ref() else {
            return Vec::new();
        };
        let dirs = l.only.clone();
        if dirs.iter().any(|d| !subgroups(d).is_empty()) {
            return Vec::new();
        }
        let mut removed = Vec::new();
        for d in dirs {
            match fs::remove_dir(&d) {
                Ok(()) => removed.push(d),
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                // A group made meanwhile: try again at the next stop.
                Err(_) => return removed,
            }
        }
        *legacy = None;
        removed
    }

    /// Prepares the node's folders (and, on v2, enables the controllers in them). Also what
    /// makes them again when they are gone (a scope's clean-up, an operator's `rmdir`).
    pub fn prepare(&self) -> Result<(), CgroupError> {
        match &self.layout {
            Layout::V1(dirs) => {
                for (_, d) in dirs {
                    fs::create_dir_all(d).map_err(io_err(d))?;
                }
                Ok(())
            }
            Layout::V2(base) => {
                fs::create_dir_all(base).map_err(io_err(base))?;
                enable_v2(base)
            }
        }
    }

    /// The group of sandbox `id` (not made yet): at the old place when an older node made it
    /// there, else at the node's folder.
    pub fn group(&self, id: &str) -> Group {
        if let Some(l) = self.legacy_layout() {
            if l.probe.join(id).is_dir() {
                return l.layout.group(id);
            }
        }
        self.layout.group(id)
    }

    /// Makes sandbox `id`'s group with `limits`. When the node's folders are gone (removed by
    /// someone else), makes them again and tries once more.
    pub fn create_group(&self, id: &str, limits: &Limits) -> Result<Group, CgroupError> {
        let group = self.group(id);
        match group.create(limits) {
            Err(CgroupError::Io { path, source }) if source.kind() == ErrorKind::NotFound => {
                let _once = self.remake.lock().unwrap_or_else(|e| e.into_inner());
                tracing::warn!(
                    path = %path.display(),
                    "the node's cgroup folder was gone: made again"
                );
                self.prepare()?;
                group.create(limits)?;
                Ok(group)
            }
            r => r.map(|()| group),
        }
    }

    /// Whether sandboxes can be made: each of the node's folders is a cgroup folder (made
    /// again when gone). The reason when not.
    pub fn check(&self) -> Result<(), String> {
        let broken = || {
            self.layout
                .dirs()
                .into_iter()
                .find(|d| !d.join("cgroup.procs").is_file())
        };
        if broken().is_none() {
            return Ok(());
        }
        {
            let _once = self.remake.lock().unwrap_or_else(|e| e.into_inner());
            if let Err(e) = self.prepare() {
                return Err(format!("the node's cgroup folder cannot be made: {e}"));
            }
        }
        match broken() {
            None => {
                tracing::warn!("the node's cgroup folders were gone: made again");
                Ok(())
            }
            Some(d) => Err(format!(
                "{} is not a cgroup folder (no cgroup.procs in it)",
                d.display()
            )),
        }
    }

    /// Names of the groups under the node's folders (sandbox ids), for reconciliation: at the
    /// stable place and at the old one.
    pub fn list(&self) -> Vec<String> {
        let mut out: Vec<String> = self.layout.first().map(subgroups).unwrap_or_default();
        if let Some(l) = self.legacy_layout() {
            for id in subgroups(&l.probe) {
                if !out.contains(&id) {
                    out.push(id);
                }
            }
        }
        out
    }
}

/// Names of the folders in `dir` (none when it does not exist).
fn subgroups(dir: impl AsRef<Path>) -> Vec<String> {
    let Ok(rd) = fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().into_string().ok())
        // A sandbox's holding cgroup ([`Group::hold_out`]) is its group's, not a sandbox.
        .filter(|n| !n.ends_with(".hold"))
        .collect()
}

/// One sandbox's group, in each hierarchy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    dirs: Vec<(Option<&'static str>, PathBuf)>,
}

fn write_file(path: &Path, value: &str) -> Result<(), CgroupError> {
    let mut f = fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(io_err(path))?;
    f.write_all(value.as_bytes()).map_err(io_err(path))
}

impl Group {
    /// A group in no hierarchy, for a sandbox whose driver makes no cgroups (a test's fake
    /// driver): it sets no limits, counts no OOM kill and no memory peak, holds no process.
    pub(crate) fn none() -> Group {
        Group { dirs: Vec::new() }
    }

    fn dir(&self, ctrl: &str) -> Option<&Path> {
        self.dirs
            .iter()
            .find(|(c, _)| c.is_none() || *c == Some(ctrl))
            .map(|(_, d)| d.as_path())
    }

    fn is_v2(&self) -> bool {
        self.dirs.iter().any(|(c, _)| c.is_none())
    }

    /// Makes the group and sets its limits.
    pub fn create(&self, limits: &Limits) -> Result<(), CgroupError> {
        for (_, d) in &self.dirs {
            match fs::create_dir(d) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io_err(d)(e)),
            }
        }
        if !self.is_v2() {
            if let Some(d) = self.dir("memory") {
                let _ = write_file(&d.join("memory.swappiness"), "0");
            }
            if let Some(d) = self.dir("cpu") {
                write_file(&d.join("cpu.cfs_period_us"), "100000")?;
            }
        }
        self.set_limits(limits)
    }

    /// Sets the group's limits (also of a group in use: a sandbox taken from the warm pool).
    pub fn set_limits(&self, limits: &Limits) -> Result<(), CgroupError> {
        let quota = u64::from(limits.vcpus.max(1)) * 100_000;
        let mem = limits.memory_bytes.to_string();
        if self.is_v2() {
            let d = self.dirs[0].1.clone();
            write_file(&d.join("memory.max"), &mem)?;
            // No swap: a sandbox over its memory is killed, not paged out.
            let _ = write_file(&d.join("memory.swap.max"), "0");
            write_file(&d.join("cpu.max"), &format!("{quota} 100000"))?;
            write_file(&d.join("pids.max"), &limits.pids.to_string())?;
            return Ok(());
        }
        if let Some(d) = self.dir("memory") {
            let memsw = d.join("memory.memsw.limit_in_bytes");
            let has_memsw = memsw.exists();
            // memsw may never be below the memory limit: raise in the order that keeps it so.
            let current: u64 = fs::read_to_string(d.join("memory.limit_in_bytes"))
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or(u64::MAX);
            if has_memsw && limits.memory_bytes > current {
                write_file(&memsw, &mem)?;
                write_file(&d.join("memory.limit_in_bytes"), &mem)?;
            } else {
                write_file(&d.join("memory.limit_in_bytes"), &mem)?;
                if has_memsw {
                    write_file(&memsw, &mem)?;
                }
            }
        }
        if let Some(d) = self.dir("cpu") {
            write_file(&d.join("cpu.cfs_quota_us"), &quota.to_string())?;
        }
        if let Some(d) = self.dir("pids") {
            write_file(&d.join("pids.max"), &limits.pids.to_string())?;
        }
        Ok(())
    }

    /// The `cgroup.procs` files a process writes its pid into to join the group.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs
            .iter()
            .map(|(_, d)| d.join("cgroup.procs"))
            .collect()
    }

    /// Moves `pid` into the group.
    pub fn add(&self, pid: u32) -> Result<(), CgroupError> {
        for f in self.procs_files() {
            write_file(&f, &pid.to_string())?;
        }
        Ok(())
    }

    /// Processes in the group now.
    pub fn pids(&self) -> Vec<u32> {
        let Some((_, d)) = self.dirs.first() else {
            return Vec::new();
        };
        fs::read_to_string(d.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// Whether the group was ever OOM-killed in.
    pub fn oom_killed(&self) -> bool {
        if self.is_v2() {
            let d = &self.dirs[0].1;
            return fs::read_to_string(d.join("memory.events"))
                .unwrap_or_default()
                .lines()
                .any(|l| l.starts_with("oom_kill ") && !l.ends_with(" 0"));
        }
        self.dir("memory")
            .and_then(|d| fs::read_to_string(d.join("memory.oom_control")).ok())
            .map(|s| {
                s.lines()
                    .any(|l| l.starts_with("oom_kill ") && !l.ends_with(" 0"))
            })
            .unwrap_or(false)
    }

    /// Peak memory of the group.
    pub fn memory_peak(&self) -> Option<u64> {
        let (d, file) = if self.is_v2() {
            (self.dirs[0].1.as_path(), "memory.peak")
        } else {
            (self.dir("memory")?, "memory.max_usage_in_bytes")
        };
        fs::read_to_string(d.join(file)).ok()?.trim().parse().ok()
    }

    /// Memory the group uses now.
    pub fn memory_current(&self) -> Option<u64> {
        let (d, file) = if self.is_v2() {
            (self.dirs[0].1.as_path(), "memory.current")
        } else {
            (self.dir("memory")?, "memory.usage_in_bytes")
        };
        fs::read_to_string(d.join(file)).ok()?.trim().parse().ok()
    }

    /// CPU time the group has used, in nanoseconds (v1's cpuacct.usage, v2's cpu.stat).
    pub fn cpu_usage_ns(&self) -> Option<u64> {
        if self.is_v2() {
            let s = fs::read_to_string(self.dirs[0].1.join("cpu.stat")).ok()?;
            let us: u64 = s
                .lines()
                .find_map(|l| l.strip_prefix("usage_usec "))?
                .trim()
                .parse()
                .ok()?;
            return Some(us.saturating_mul(1000));
        }
        let d = self.dir("cpuacct").or_else(|| self.dir("cpu"))?;
        fs::read_to_string(d.join("cpuacct.usage"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Freezes (`true`) or thaws the group: v1's freezer, v2's `cgroup.freeze`. False when
    /// the layout has no freezer (the caller kills without one).
    fn set_frozen(&self, frozen: bool) -> bool {
        if self.is_v2() {
            let f = self.dirs[0].1.join("cgroup.freeze");
            return write_file(&f, if frozen { "1" } else { "0" }).is_ok();
        }
        match self.dir("freezer") {
            Some(d) => write_file(
                &d.join("freezer.state"),
                if frozen { "FROZEN" } else { "THAWED" },
            )
            .is_ok(),
            None => false,
        }
    }

    /// Freezes the group and waits until every task is frozen (a checkpoint's first step:
    /// CRIU then finds it FROZEN and skips its own 100 ms polling). False when the group has
    /// no freezer or it did not freeze within `wait` (it is thawed again then).
    pub fn freeze(&self, wait: Duration) -> bool {
        if !self.set_frozen(true) {
            return false;
        }
        let end = std::time::Instant::now() + wait;
        while !self.is_frozen() {
            if std::time::Instant::now() >= end {
                self.set_frozen(false);
                return false;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        true
    }

    /// Thaws the group (after a checkpoint, or one that failed).
    pub fn thaw(&self) -> bool {
        self.set_frozen(false)
    }

    /// The group's v1 freezer directory (for `criu --freeze-cgroup`), or its v2 directory.
    pub fn freezer_dir(&self) -> Option<PathBuf> {
        if self.is_v2() {
            return self.dirs.first().map(|(_, d)| d.clone());
        }
        self.dir("freezer").map(Path::to_path_buf)
    }

    /// The group's directory of each controller on the host: (controller, path); the
    /// controller is `None` for the unified hierarchy.
    pub fn dirs(&self) -> Vec<(Option<&'static str>, PathBuf)> {
        self.dirs.clone()
    }

    /// The group as `/proc/PID/cgroup` names it in each hierarchy (the path under the
    /// hierarchy's root), for `criu --cgroup-root [CTRL:]PATH`: (controller, path).
    pub fn cgroup_paths(&self) -> Result<Vec<(Option<&'static str>, PathBuf)>, CgroupError> {
        let mi = Path::new("/proc/self/mountinfo");
        let mounts = parse_mountinfo(&fs::read_to_string(mi).map_err(io_err(mi))?);
        let mut out = Vec::new();
        for (ctrl, dir) in &self.dirs {
            let m = mounts
                .iter()
                .filter(|m| m.fstype == "cgroup" || m.fstype == "cgroup2")
                .filter(|m| dir.starts_with(&m.mount_point))
                .max_by_key(|m| m.mount_point.as_os_str().len())
                .ok_or_else(|| CgroupError::NoController(ctrl.unwrap_or("unified")))?;
            let rel = dir.strip_prefix(&m.mount_point).unwrap_or(dir);
            out.push((*ctrl, Path::new(&m.root).join(rel)));
        }
        Ok(out)
    }

    /// Whether every task of the group is frozen now (not only being frozen).
    pub fn is_frozen(&self) -> bool {
        if self.is_v2() {
            return fs::read_to_string(self.dirs[0].1.join("cgroup.events"))
                .map(|s| s.lines().any(|l| l.trim() == "frozen 1"))
                .unwrap_or(false);
        }
        self.dir("freezer")
            .and_then(|d| fs::read_to_string(d.join("freezer.state")).ok())
            .is_some_and(|s| s.trim() == "FROZEN")
    }

    /// Freezes (`true`) or thaws the group and waits until the kernel says it is so (a
    /// freeze settles in about a millisecond; `wait` bounds it). Errors when the layout has
    /// no freezer or the state was not reached in time (the group is thawed again then).
    pub fn pause(&self, frozen: bool, wait: Duration) -> Result<(), CgroupError> {
        let what = || {
            self.dir("freezer")
                .map(Path::to_path_buf)
                .unwrap_or_default()
        };
        if self.dirs.is_empty() || !self.set_frozen(frozen) {
            return Err(CgroupError::NoController("freezer"));
        }
        let deadline = Instant::now() + wait;
        let mut pause = Duration::from_micros(100);
        loop {
            let thawed = !self.is_frozen() && !self.is_freezing();
            if (frozen && self.is_frozen()) || (!frozen && thawed) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                if frozen {
                    self.set_frozen(false);
                }
                return Err(CgroupError::Io {
                    path: what(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        if frozen {
                            "did not freeze in time"
                        } else {
                            "did not thaw in time"
                        },
                    ),
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(5));
        }
    }

    /// Whether the group is being frozen or is frozen (v1 `FREEZING`/`FROZEN`, v2
    /// `cgroup.freeze` 1).
    pub fn is_paused(&self) -> bool {
        if self.dirs.is_empty() {
            return false;
        }
        self.is_frozen() || self.is_freezing()
    }

    fn is_freezing(&self) -> bool {
        if self.is_v2() {
            return fs::read_to_string(self.dirs[0].1.join("cgroup.freeze"))
                .is_ok_and(|s| s.trim() == "1");
        }
        self.dir("freezer")
            .and_then(|d| fs::read_to_string(d.join("freezer.state")).ok())
            .is_some_and(|s| s.trim() == "FREEZING")
    }

    /// Lifts the group's CPU quota: processes that are being killed must not wait for the
    /// quota's next period to exit (a throttled fork bomb takes minutes to die otherwise).
    fn lift_cpu_limit(&self) {
        let _ = if self.is_v2() {
            write_file(&self.dirs[0].1.join("cpu.max"), "max 100000")
        } else {
            match self.dir("cpu") {
                Some(d) => write_file(&d.join("cpu.cfs_quota_us"), "-1"),
                None => Ok(()),
            }
        };
    }

    /// Kills every process of the group, until none is left or `wait` is up: each round
    /// freezes the group (nothing in it forks or runs meanwhile), SIGKILLs every process it
    /// lists and thaws it, so that the killed ones exit; on v2 `cgroup.kill` does the same in
    /// one write. Zombies are not counted: they leave when their parent reaps them.
    pub fn kill_all(&self, wait: Duration) -> Result<(), CgroupError> {
        self.reclaim_held();
        let deadline = Instant::now() + wait;
        let mut lifted = false;
        let mut pause = Duration::from_millis(1);
        loop {
            let pids: Vec<u32> = self.pids().into_iter().filter(|p| !is_zombie(*p)).collect();
            if pids.is_empty() {
                return Ok(());
            }
            if !lifted {
                self.lift_cpu_limit();
                lifted = true;
            }
            let kill_file = self
                .is_v2()
                .then(|| self.dirs[0].1.join("cgroup.kill"))
                .filter(|f| f.exists());
            match kill_file {
                Some(f) => {
                    write_file(&f, "1")?;
                }
                None => {
                    let frozen = self.set_frozen(true);
                    if frozen {
                        // A task in an uninterruptible sleep delays FROZEN: wait a little,
                        // then kill what is listed anyway (the next round catches the rest).
                        let until = Instant::now() + Duration::from_millis(200);
                        while !self.is_frozen() && Instant::now() < until {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    }
                    for p in self.pids() {
                        crate::process::kill_pid(p, libc::SIGKILL);
                    }
                    if frozen {
                        self.set_frozen(false);
                    }
                }
            }
            if Instant::now() > deadline {
                return Err(CgroupError::Busy(self.dirs[0].1.clone()));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }

    /// Kills every process left in the group ([`Group::kill_all`]) and removes it. Waits up to
    /// `wait` for the processes to go.
    pub fn destroy(&self, wait: Duration) -> Result<(), CgroupError> {
        self.kill_all(wait)?;
        for (_, d) in &self.dirs {
            let deadline = Instant::now() + wait;
            loop {
                match fs::remove_dir(d) {
                    Ok(()) => break,
                    Err(e) if e.kind() == ErrorKind::NotFound => break,
                    // The last task may still be leaving the group.
                    Err(e)
                        if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline =>
                    {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(e) => return Err(io_err(d)(e)),
                }
            }
        }
        Ok(())
    }

    /// Whether any of the group's folders exist.
    pub fn exists(&self) -> bool {
        self.dirs.iter().any(|(_, d)| d.exists())
    }

    /// Freezes every process of the group but `pid` (its agent), which is first moved out of
    /// the group's freezer into a cgroup of its own beside it (`<group>.hold`), where it runs
    /// whatever the group's state. Nothing else of the group runs until [`Held::rejoin`] and a
    /// thaw. The way a checkpoint readies the agent (makes it dumpable) with no process of the
    /// sandbox able to run meanwhile.
    ///
    /// A process frozen in the middle of a vfork (its child frozen before it executed, the
    /// parent waiting for it) cannot be checkpointed: CRIU seizes the child, which then never
    /// executes, and waits for the parent to stop, which it never does ("Unseizable
    /// non-zombie ... state D" after CRIU's 10 s); and such a group may also stay FREEZING.
    /// So the group is frozen for [`FREEZE_TRY`] at a time, and thawed a moment and frozen
    /// again while it is not frozen by then or a process of it waits in a vfork (a shell
    /// starting a command is out of it in microseconds), until `wait` is spent: then a group
    /// frozen with a vfork is given as it is (its checkpoint fails as it did), one not frozen
    /// is an error.
    pub fn freeze_all_but(&self, pid: u32, wait: Duration) -> Result<Held, CgroupError> {
        let held = self.hold_out(pid)?;
        let end = std::time::Instant::now() + wait;
        loop {
            let left = end.saturating_duration_since(std::time::Instant::now());
            let frozen = self.freeze(FREEZE_TRY.min(left));
            let clean = frozen && !self.pids().into_iter().any(crate::process::in_vfork);
            if clean || (frozen && left <= FREEZE_TRY) {
                return Ok(held);
            }
            if left <= FREEZE_TRY {
                return Err(CgroupError::Io {
                    path: self.freezer_dir().unwrap_or_default(),
                    source: std::io::Error::new(ErrorKind::TimedOut, "did not freeze in time"),
                });
            }
            self.set_frozen(false);
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The cgroup beside the group's freezer where [`Group::hold_out`] holds a process.
    fn hold_dir(&self) -> Option<(PathBuf, PathBuf)> {
        let dir = self.freezer_dir()?;
        let name = format!("{}.hold", dir.file_name()?.to_string_lossy());
        let hold = dir.with_file_name(name);
        Some((dir, hold))
    }

    /// Moves every process left in `<group>.hold` (a node that died while it held the agent
    /// there, or a process the agent started meanwhile) back into the group, and removes it:
    /// no process of a sandbox is ever outside its group for long, nor missed by a kill.
    pub fn reclaim_held(&self) {
        let Some((dir, hold)) = self.hold_dir() else {
            return;
        };
        if !hold.is_dir() {
            return;
        }
        move_all(&hold, &dir);
        let _ = fs::remove_dir(&hold);
    }

    /// Moves `pid` out of the group's freezer into `<group>.hold` (it runs there, also while
    /// the group stays frozen); [`Held::rejoin`] moves it back.
    pub fn hold_out(&self, pid: u32) -> Result<Held, CgroupError> {
        let (dir, hold) = self
            .hold_dir()
            .ok_or(CgroupError::NoController("freezer"))?;
        match fs::create_dir(&hold) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_err(&hold)(e)),
        }
        let held = Held {
            hold,
            home: dir,
            pid,
            done: false,
        };
        write_file(&held.hold.join("cgroup.procs"), &pid.to_string())?;
        Ok(held)
    }
}

/// How long [`Group::freeze_all_but`] waits for a group to freeze before it thaws it and tries
/// again.
const FREEZE_TRY: Duration = Duration::from_millis(100);

/// Moves every process of the cgroup `from` into `to` (one that ended meanwhile is skipped).
fn move_all(from: &Path, to: &Path) {
    let procs = fs::read_to_string(from.join("cgroup.procs")).unwrap_or_default();
    for pid in procs.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let _ = write_file(&to.join("cgroup.procs"), pid);
    }
}

/// A process of a group held beside it ([`Group::hold_out`]): moved back by
/// [`Held::rejoin`], or when dropped.
#[derive(Debug)]
pub struct Held {
    hold: PathBuf,
    home: PathBuf,
    pid: u32,
    done: bool,
}

impl Held {
    /// Moves the process back into its group (frozen at once if the group is frozen) and
    /// removes the holding cgroup.
    pub fn rejoin(mut self) -> Result<(), CgroupError> {
        self.back()
    }

    fn back(&mut self) -> Result<(), CgroupError> {
        if self.done {
            return Ok(());
        }
        self.done = true;
        let moved = match write_file(&self.home.join("cgroup.procs"), &self.pid.to_string()) {
            // A process that has ended has nothing to move.
            Err(CgroupError::Io { source, .. }) if source.raw_os_error() == Some(libc::ESRCH) => {
                Ok(())
            }
            r => r,
        };
        // Anything the held process started meanwhile goes back with it.
        move_all(&self.hold, &self.home);
        let _ = fs::remove_dir(&self.hold);
        moved
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Err(e) = self.back() {
            tracing::warn!(pid = self.pid, error = %e, "a held process could not rejoin its group");
        }
    }
}

struct Mount {
    root: String,
    mount_point: PathBuf,
    fstype: String,
    options: Vec<String>,
}

fn parse_mountinfo(s: &str) -> Vec<Mount> {
    s.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let l: Vec<&str> = left.split(' ').collect();
            let r: Vec<&str> = right.split(' ').collect();
            Some(Mount {
                root: l.get(3)?.to_string(),
                mount_point: PathBuf::from(l.get(4)?),
                fstype: r.first()?.to_string(),
                options: r
                    .get(2)
                    .map(|o| o.split(',').map(String::from).collect())
                    .unwrap_or_default(),
            })
        })
        .collect()
}

/// `(controllers, path)` pairs of `/proc/self/cgroup`.
fn parse_proc_cgroup(s: &str) -> Vec<(String, String)> {
    s.lines()
        .filter_map(|l| {
            let mut it = l.splitn(3, ':');
            let _id = it.next()?;
            let ctrls = it.next()?.to_string();
            let path = it.next()?.to_string();
            Some((ctrls, path))
        })
        .collect()
}

/// Whether process `pid` has exited and waits to be reaped (`Z` in /proc/PID/stat).
fn is_zombie(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            // The state follows the command's closing parenthesis.
            let rest = &s[s.rfind(')')? + 1..];
            rest.split_whitespace().next().map(|st| st == "Z")
        })
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shell that starts commands without pause, frozen again and again: whenever it is
    /// caught waiting in its vfork (its blocked syscall is vfork's, 58 on x86_64, and its child
    /// has not executed yet), `in_vfork` says so; whenever it is elsewhere (waiting for the
    /// command's end, `wait4`), it does not; the child is never the one waiting.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn a_process_frozen_in_a_vfork_is_seen_waiting() {
        let root = Path::new("/sys/fs/cgroup/freezer");
        if !root.join("cgroup.procs").exists() {
            eprintln!("skipped: no cgroup v1 freezer here");
            return;
        }
        let dir = root.join(format!("sbx-test-vfork-{}", std::process::id()));
        fs::create_dir(&dir).unwrap();
        let mut sh = std::process::Command::new("sh")
            .args(["-c", "while :; do /bin/true; done"])
            .spawn()
            .unwrap();
        let shell = sh.id();
        fs::write(dir.join("cgroup.procs"), shell.to_string()).unwrap();
        let procs = || -> Vec<u32> {
            fs::read_to_string(dir.join("cgroup.procs"))
                .unwrap_or_default()
                .lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect()
        };
        let syscall = |p: u32| {
            fs::read_to_string(format!("/proc/{p}/syscall"))
                .unwrap_or_default()
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_string()
        };
        let (mut caught, mut elsewhere, mut wrong) = (0, 0, Vec::new());
        for _ in 0..300 {
            fs::write(dir.join("freezer.state"), "FROZEN").unwrap();
            // Caught in a vfork, a group may stay FREEZING: thawed and tried again.
            let end = std::time::Instant::now() + Duration::from_millis(50);
            let mut frozen = false;
            while !frozen && std::time::Instant::now() < end {
                frozen = fs::read_to_string(dir.join("freezer.state"))
                    .unwrap()
                    .trim()
                    == "FROZEN";
                std::thread::sleep(Duration::from_micros(100));
            }
            let p = procs();
            if frozen {
                let shell_waits = crate::process::in_vfork(shell);
                let in_vfork_call = syscall(shell) == "58" && p.len() > 1;
                match (shell_waits, in_vfork_call) {
                    (true, true) => caught += 1,
                    (false, false) => elsewhere += 1,
                    // Its child executed already but the shell's return from vfork is not
                    // seen yet: not a wait either way.
                    (false, true) => {}
                    (true, false) => wrong.push(format!("shell {}", syscall(shell))),
                }
                for c in p.iter().filter(|c| **c != shell) {
                    if crate::process::in_vfork(*c) {
                        wrong.push(format!("child {c}"));
                    }
                }
            }
            fs::write(dir.join("freezer.state"), "THAWED").unwrap();
            if caught >= 3 && elsewhere >= 3 {
                break;
            }
        }
        let _ = sh.kill();
        let _ = sh.wait();
        while !procs().is_empty() {
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = fs::remove_dir(&dir);
        assert!(wrong.is_empty(), "{wrong:?}");
        assert!(
            caught > 0 && elsewhere > 0,
            "caught in a vfork {caught} times, elsewhere {elsewhere}"
        );
    }

    #[test]
    fn parses_hybrid_layout_files() {
        let mi =
            "30 25 0:26 / /sys/fs/cgroup/memory rw,relatime shared:10 - cgroup cgroup rw,memory\n\
                  31 25 0:27 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n";
        let m = parse_mountinfo(mi);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].mount_point, PathBuf::from("/sys/fs/cgroup/memory"));
        assert!(m[0].options.iter().any(|o| o == "memory"));
        assert_eq!(m[1].fstype, "cgroup2");
        let pc = parse_proc_cgroup("4:memory:/process_api/x\n0::/\n");
        assert_eq!(pc[0], ("memory".into(), "/process_api/x".into()));
        assert_eq!(pc[1], ("".into(), "/".into()));
    }

    #[test]
    fn the_default_name_is_the_data_directory_s() {
        assert_eq!(default_name(Path::new("/var/lib/sbx")), "sbx");
        let a = default_name(Path::new("/srv/sbx-a"));
        let b = default_name(Path::new("/srv/sbx-b"));
        assert!(a.starts_with("sbx-") && a.len() == 16, "{a}");
        assert_ne!(a, b);
        assert_ne!(a, "sbx");
        // Stable: the same directory gives the same folder at every start.
        assert_eq!(a, default_name(Path::new("/srv/sbx-a")));
        assert!(a[4..].chars().all(|c| c.is_ascii_hexdigit()), "{a}");
    }

    #[test]
    fn a_folder_of_the_old_layout_is_looked_at_until_it_is_empty_and_removed() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let name = format!("sbx-legacy-test-{}", std::process::id());
        let limits = Limits {
            memory_bytes: 64 << 20,
            vcpus: 1,
            pids: 16,
        };
        // A node of the old layout made group `old` under its own cgroup.
        let before = Cgroups::place(&name, &Parent::Own).unwrap();
        before.prepare().unwrap();
        let old = before.create_group("old", &limits).unwrap();
        let after = Cgroups::place(&name, &Parent::Auto).unwrap();
        after.prepare().unwrap();
        let moved = after.placement().iter().any(|p| p.fallback.is_none());
        if moved {
            // The old group is found where it is; a new one goes to the stable place.
            assert_eq!(after.group("old"), old);
            let new = after.create_group("new", &limits).unwrap();
            assert_ne!(new, before.group("new"));
            let mut ids = after.list();
            ids.sort();
            assert_eq!(ids, ["new", "old"]);
            assert!(after.remove_legacy_if_empty().is_empty(), "not empty yet");
            old.destroy(Duration::from_secs(5)).unwrap();
            let removed = after.remove_legacy_if_empty();
            assert!(!removed.is_empty() && removed.iter().all(|d| !d.exists()));
            assert_eq!(after.list(), ["new"]);
            assert_eq!(after.group("old"), after.layout().group("old"));
            new.destroy(Duration::from_secs(5)).unwrap();
        } else {
            old.destroy(Duration::from_secs(5)).unwrap();
        }
        after.remove_if_empty();
        before.remove_if_empty();
        assert!(!after.folder().exists() && !before.folder().exists());
    }

    #[test]
    fn a_gone_folder_is_made_again_at_the_next_create() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let cg = Cgroups::discover(&format!("sbx-remake-test-{}", std::process::id())).unwrap();
        cg.prepare().unwrap();
        let limits = Limits {
            memory_bytes: 64 << 20,
            vcpus: 1,
            pids: 16,
        };
        cg.remove_if_empty();
        assert!(!cg.folder().exists());
        assert!(cg.check().is_ok(), "the check makes them again");
        assert!(cg.folder().exists());
        cg.remove_if_empty();
        let g = cg.create_group("a", &limits).unwrap();
        assert!(g.exists());
        g.destroy(Duration::from_secs(5)).unwrap();
        cg.remove_if_empty();
        assert!(!cg.folder().exists());
    }

    #[test]
    fn keeping_migrations_warm_leaves_the_node_where_it_is_and_stops_with_its_guard() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: not root");
            return;
        }
        let before = fs::read_to_string("/proc/self/cgroup").unwrap();
        let cg = Cgroups::discover("sbx-test-warm").unwrap();
        let guard = cg.keep_warm();
        // Several rounds of its migrations.
        std::thread::sleep(WARM_EVERY * 5);
        assert_eq!(fs::read_to_string("/proc/self/cgroup").unwrap(), before);
        assert!(guard.finish(), "its thread ran and ended with the guard");
        let threads = || {
            fs::read_dir("/proc/self/task")
                .unwrap()
                .flatten()
                .filter(|t| {
                    fs::read_to_string(t.path().join("comm"))
                        .is_ok_and(|c| c.trim() == "cgroup-warm")
                })
                .count()
        };
        assert_eq!(threads(), 0, "no warm thread is left");
    }

    #[test]
    fn discovers_this_machine() {
        // Every Linux machine these tests run on has some cgroup layout with memory.
        let cg = Cgroups::discover("sbx-test").unwrap();
        let g = cg.group("x");
        assert!(!g.procs_files().is_empty());
    }
}
