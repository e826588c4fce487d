//! Checkpoint and restore of a sandbox with CRIU (issue #15): sleep (freeze, dump, the tree
//! gone) and wake (restore into the same directory and cgroups, the same address).
//!
//! The `criu` binary (≥ 4.2) is driven through its RPC (`criu swrk`, [`rpc`]): one request
//! per dump or restore, its notifications answered in this process (no action script, no
//! shell); `criu --version` and `criu check` at [`detect`]. What the node does around these
//! calls is in [`crate::driver::NamespaceDriver::sleep`] and
//! [`crate::driver::NamespaceDriver::wake`].
//!
//! - Sleep: the sandbox's freezer cgroup is frozen first (CRIU then skips its own polling),
//!   then a dump of the agent's tree with the network lock skipped (the node holds the
//!   sandbox's traffic at the host instead: [`crate::net::Lease::hold_traffic`]), file locks,
//!   established TCP connections, the freezer cgroup named, an external mount for every bind
//!   of a host file (the device nodes, the masked /proc files, the CA bundle, the agent's
//!   binary), and for a sandbox on the network its namespace's links, addresses and routes
//!   not dumped (`empty_ns`: they are the node's to give again). The group is thawed after,
//!   on success (it is empty then) as on failure (the tree runs on).
//! - Wake: a restore with its root on the sandbox's overlay, mounted in a private mount
//!   namespace of the criu process only (nothing is mounted in the host's), the external
//!   mounts mapped back to host paths, and for a sandbox with a network an empty network
//!   namespace which, at CRIU's `setup-namespaces` notification, gets a new veth whose `eth0`
//!   is born in it, its host side under the old one's name (which is retired), configured by
//!   netlink ([`crate::net::Relink::apply`]): the sandbox keeps its address, its nft
//!   element and its established TCP connections. The restored tree is the node's child.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum CriuError {
    #[error("criu is not usable: {0}")]
    Unavailable(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("criu {action} failed ({status}): {log}")]
    Failed {
        action: &'static str,
        status: String,
        log: String,
    },
    #[error("the sandbox's cgroup did not freeze")]
    Freeze,
    #[error("{0}")]
    Other(String),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> CriuError {
    let what = what.into();
    move |source| CriuError::Io { what, source }
}

/// A usable criu binary ([`detect`]).
#[derive(Debug, Clone)]
pub struct Criu {
    pub bin: PathBuf,
    pub version: (u32, u32, u32),
    /// A tmpfs shown to criu as its /run, where the host's /run is not one: criu keeps what it
    /// learns of the kernel (`/run/criu.kdat`, tens of milliseconds a run) only on a tmpfs.
    /// A detached mount ([`kdat_run`]).
    pub run: Option<std::sync::Arc<OwnedFd>>,
    /// The host's cgroup hierarchies as criu's cgroup yard, where each is mounted where criu
    /// would mount it in a yard of its own ([`host_cgroup_yard`]): no ~25 ms of mounts for
    /// every dump and restore.
    pub cgroup_yard: Option<PathBuf>,
    /// `criu swrk` processes started ahead of their requests.
    workers: std::sync::Arc<worker::Workers>,
}

impl Criu {
    /// Ends the workers waiting ready, and starts no more ahead (the node is stopping: each
    /// holds a copy of the node's mounts, its disk among them).
    pub fn stop_workers(&self) {
        self.workers.stop();
    }

    /// The node's data directory (its disk at `<dir>/disk`): the workers keep its disk in
    /// their mount namespaces, and no other node's.
    pub fn set_data_dirs(&self, dirs: &[PathBuf]) {
        self.workers.set_own_dirs(dirs, self);
    }
}

/// `/sys/fs/cgroup` if every cgroup hierarchy this process is in is mounted there under the
/// name criu gives it in a yard (the controllers as /proc/self/cgroup lists them, `name=`
/// dropped, `unified` for cgroup v2), as systemd's hybrid and legacy layouts have them; else
/// `None` (criu mounts its own yard).
fn host_cgroup_yard() -> Option<PathBuf> {
    use nix::sys::statfs::{statfs, CGROUP2_SUPER_MAGIC, CGROUP_SUPER_MAGIC};
    let yard = Path::new("/sys/fs/cgroup");
    let listed = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut any = false;
    for line in listed.lines() {
        let mut f = line.splitn(3, ':');
        let (_, names) = (f.next()?, f.next()?);
        let (dir, magic) = match names {
            "" => ("unified", CGROUP2_SUPER_MAGIC),
            n => (n.strip_prefix("name=").unwrap_or(n), CGROUP_SUPER_MAGIC),
        };
        if dir.is_empty() || dir.contains('/') {
            return None;
        }
        let st = statfs(&yard.join(dir)).ok()?;
        if st.filesystem_type() != magic {
            return None;
        }
        any = true;
    }
    any.then(|| yard.to_path_buf())
}

/// Where earlier versions mounted the tmpfs criu is given as /run, on the host, for good.
const OLD_KDAT_RUN: &str = "/run/sbx/criu-run";

/// The tmpfs for criu's /run ([`Criu::run`]): `None` where the host's /run is a tmpfs (criu
/// keeps its cache there itself) or one cannot be made (criu then learns the kernel anew each
/// run). A detached mount (`fsmount`) that this process holds, never in the host's tree: each
/// worker shows a clone of it (the same files) as its /run, and it goes with the node. A
/// mount earlier versions left at [`OLD_KDAT_RUN`] is taken away (detached: a worker that has
/// it keeps it).
fn kdat_run() -> Option<std::sync::Arc<OwnedFd>> {
    use nix::sys::statfs::{statfs, TMPFS_MAGIC};
    use rustix::mount::{
        fsconfig_create, fsconfig_set_string, fsmount, fsopen, FsMountFlags, FsOpenFlags,
        MountAttrFlags,
    };
    let is_tmpfs = |p: &Path| statfs(p).is_ok_and(|s| s.filesystem_type() == TMPFS_MAGIC);
    if is_tmpfs(Path::new(OLD_KDAT_RUN)) {
        let _ = nix::mount::umount2(OLD_KDAT_RUN, nix::mount::MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(OLD_KDAT_RUN);
    }
    if is_tmpfs(Path::new("/run")) {
        return None;
    }
    // The host's /run/sbx (the CA bundles a restore binds) is shown at the clone's `sbx`.
    std::fs::create_dir_all("/run/sbx").ok()?;
    let fs = fsopen("tmpfs", FsOpenFlags::FSOPEN_CLOEXEC).ok()?;
    fsconfig_set_string(&fs, "size", "4m").ok()?;
    fsconfig_set_string(&fs, "mode", "0755").ok()?;
    fsconfig_create(&fs).ok()?;
    let mnt = fsmount(
        &fs,
        FsMountFlags::FSMOUNT_CLOEXEC,
        MountAttrFlags::MOUNT_ATTR_NOSUID | MountAttrFlags::MOUNT_ATTR_NODEV,
    )
    .ok()?;
    rustix::fs::mkdirat(&mnt, "sbx", rustix::fs::Mode::from_raw_mode(0o755)).ok()?;
    Some(std::sync::Arc::new(mnt))
}

fn run(bin: &Path, args: &[&str]) -> Result<(bool, String), CriuError> {
    let out = Command::new(bin)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(io(format!("run {}", bin.display())))?;
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    Ok((out.status.success(), text))
}

/// `Version: 4.2.1` (or `4.2`) in `criu --version`'s output.
fn parse_version(text: &str) -> Option<(u32, u32, u32)> {
    let v = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Version:"))?
        .trim();
    let mut parts = v.split('.').map(|p| p.trim().parse::<u32>());
    let major = parts.next()?.ok()?;
    let minor = parts.next()?.ok()?;
    let patch = parts.next().and_then(|p| p.ok()).unwrap_or(0);
    Some((major, minor, patch))
}

/// Checks the criu binary `bin`: version 4.2 or newer, and `criu check` passes. Ok with it, or
/// the reason it cannot be used.
pub fn detect(bin: &Path) -> Result<Criu, CriuError> {
    let (ok, text) = run(bin, &["--version"]).map_err(|e| CriuError::Unavailable(e.to_string()))?;
    if !ok {
        return Err(CriuError::Unavailable(format!(
            "{} --version: {}",
            bin.display(),
            text.trim()
        )));
    }
    let version = parse_version(&text)
        .ok_or_else(|| CriuError::Unavailable(format!("no version in {:?}", text.trim())))?;
    if version < (4, 2, 0) {
        return Err(CriuError::Unavailable(format!(
            "criu {}.{}.{} is older than 4.2",
            version.0, version.1, version.2
        )));
    }
    let (ok, text) = run(bin, &["check"]).map_err(|e| CriuError::Unavailable(e.to_string()))?;
    if !ok {
        return Err(CriuError::Unavailable(format!(
            "criu check: {}",
            text.trim()
        )));
    }
    Ok(Criu {
        bin: bin.to_path_buf(),
        version,
        run: kdat_run(),
        cgroup_yard: host_cgroup_yard(),
        workers: Default::default(),
    })
}

/// The binds of host files a sandbox has (mount points inside it), each an external mount for
/// CRIU, and what each is on the host at a restore (`None`: given by the caller).
const EXTERNAL: &[(&str, Option<&str>)] = &[
    ("/dev/null", Some("/dev/null")),
    ("/dev/zero", Some("/dev/zero")),
    ("/dev/full", Some("/dev/full")),
    ("/dev/random", Some("/dev/random")),
    ("/dev/urandom", Some("/dev/urandom")),
    ("/dev/tty", Some("/dev/tty")),
    ("/proc/kcore", Some("/dev/null")),
    ("/proc/keys", Some("/dev/null")),
    ("/proc/timer_list", Some("/dev/null")),
    ("/proc/sysrq-trigger", Some("/dev/null")),
    (crate::init::AGENT_PATH, None),
    ("/etc/ssl/certs/ca-certificates.crt", None),
];

/// The key of an external mount: `m` and its mount point with every other byte than
/// letters, digits and '-' as '_'.
fn key(mountpoint: &str) -> String {
    let mut k = String::from("m");
    for c in mountpoint.chars() {
        k.push(if c.is_ascii_alphanumeric() || c == '-' {
            c
        } else {
            '_'
        });
    }
    k
}

/// What a dump recorded for its restore (`sbx-checkpoint.json` in the images directory).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Recorded {
    /// The external mounts' mount points.
    external: Vec<String>,
    /// Whether the sandbox had a network of its own (a leased namespace).
    network: bool,
    /// Volumes bound into it: (mount point inside, directory on the host), each an external
    /// mount too.
    #[serde(default)]
    volumes: Vec<(String, PathBuf)>,
}

const RECORD: &str = "sbx-checkpoint.json";

/// Written into the images directory once CRIU has answered a dump (the images whole): a
/// node that starts after one killed midway knows from it whether the sandbox's processes
/// are on disk ([`dump_complete`]).
const DUMPED: &str = "sbx-dumped";

/// Whether the dump into `images` completed: CRIU answered it, or (a node killed before the
/// answer) CRIU wrote its `stats-dump`, which it writes only at the end of a dump that
/// succeeded. Its images can be restored.
pub fn dump_complete(images: &Path) -> bool {
    images.join(DUMPED).is_file() || images.join("stats-dump").is_file()
}

/// Waits until no criu process has a file of `dirs` open (a criu of a node killed during a dump
/// or a restore runs on to its end, and its dump or restore is then whole or undone), at most
/// `timeout`. Whether none has.
pub fn wait_unused(dirs: &[PathBuf], timeout: Duration) -> bool {
    let end = std::time::Instant::now() + timeout;
    loop {
        if !dirs_in_use(dirs) {
            return true;
        }
        if std::time::Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether a criu process other than this one has a file (or its working directory) in `dirs`.
fn dirs_in_use(dirs: &[PathBuf]) -> bool {
    let me = std::process::id().to_string();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return false;
    };
    let inside = |p: &Path| dirs.iter().any(|d| p.starts_with(d));
    for p in procs.flatten() {
        let name = p.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        let base = p.path();
        // Only criu's processes (under its own name or the loader's): a node with many
        // sandboxes has many processes, and their descriptors are not read.
        let criu = std::fs::read(base.join("cmdline"))
            .is_ok_and(|c| c.split(|b| *b == 0).any(|a| a.ends_with(b"criu")));
        if !criu {
            continue;
        }
        if std::fs::read_link(base.join("cwd")).is_ok_and(|l| inside(&l)) {
            return true;
        }
        for fd in std::fs::read_dir(base.join("fd"))
            .into_iter()
            .flatten()
            .flatten()
        {
            if std::fs::read_link(fd.path()).is_ok_and(|l| inside(&l)) {
                return true;
            }
        }
    }
    false
}

/// Forgets that the dump into `images` completed (a wake recorded: the images are spent).
pub fn forget_dump(images: &Path) {
    let _ = std::fs::remove_file(images.join(DUMPED));
    let _ = std::fs::remove_file(images.join("stats-dump"));
}

/// Mount points of the process `pid` (as it sees them), from its mountinfo.
fn mountpoints(pid: u32) -> Result<Vec<String>, CriuError> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
        .map_err(io(format!("read /proc/{pid}/mountinfo")))?;
    Ok(text
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
        .collect())
}

/// A path as mountinfo writes it, unescaped (`\040` and the like).
fn unescape(p: &str) -> String {
    let b = p.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = (b[i] == b'\\' && i + 3 < b.len())
            .then(|| &b[i + 1..i + 4])
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .map(|d| d.iter().fold(0u32, |n, c| n * 8 + u32::from(c - b'0')))
            .and_then(|n| u8::try_from(n).ok());
        if let Some(n) = octal {
            out.push(n);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The volumes bound into the process `pid`'s mount namespace ([`crate::volume`]): mounts
/// of a subvolume under `/volumes/` of a btrfs, with the directory each is on the host (the
/// host's mount of that filesystem's root, from the node's own mountinfo).
fn volume_mounts(pid: u32) -> Result<Vec<(String, PathBuf)>, CriuError> {
    let inside = std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
        .map_err(io(format!("read /proc/{pid}/mountinfo")))?;
    let host =
        std::fs::read_to_string("/proc/self/mountinfo").map_err(io("read /proc/self/mountinfo"))?;
    // (major:minor, root, mount point, fstype)
    let parse = |l: &str| -> Option<(String, String, String, String)> {
        let f: Vec<&str> = l.split(' ').collect();
        let dash = f.iter().position(|x| *x == "-")?;
        Some((
            f.get(2)?.to_string(),
            unescape(f.get(3)?),
            unescape(f.get(4)?),
            f.get(dash + 1)?.to_string(),
        ))
    };
    let mut out = Vec::new();
    for (dev, root, point, fstype) in inside.lines().filter_map(parse) {
        if fstype != "btrfs" || !root.starts_with("/volumes/") {
            continue;
        }
        let base = host
            .lines()
            .filter_map(parse)
            .find(|(d, r, _, _)| *d == dev && r == "/")
            .map(|(_, _, p, _)| p)
            .ok_or_else(|| {
                CriuError::Other(format!(
                    "the volume at {point} is on a filesystem the node has not mounted"
                ))
            })?;
        out.push((point, Path::new(&base).join(root.trim_start_matches('/'))));
    }
    Ok(out)
}

/// The last lines of a criu log (for an error).
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let errors: Vec<&str> = lines
        .iter()
        .filter(|l| l.contains("Error") || l.contains("error"))
        .copied()
        .collect();
    let pick = if errors.is_empty() {
        &lines[..]
    } else {
        &errors[..]
    };
    pick[pick.len().saturating_sub(8)..].join("\n")
}

/// What a sleep needs of a sandbox.
#[derive(Debug)]
pub struct DumpSpec<'a> {
    /// The agent's host pid (the tree's root).
    pub pid: u32,
    /// The sandbox's cgroup.
    pub group: &'a crate::cgroup::Group,
    /// Where the images go (made if missing; the caller's to remove after the wake).
    pub images: &'a Path,
    /// Whether the sandbox is in a leased network namespace (which the caller keeps while
    /// it sleeps).
    pub network: bool,
    /// Keep the tree running (a snapshot) instead of ending it.
    pub leave_running: bool,
}

/// Freezes the sandbox and dumps its tree into `spec.images`; the tree is gone after (unless
/// `leave_running`). The group is thawed after a sleep's dump only: a tree that runs on (a
/// snapshot's, or one whose dump failed) is left frozen for the caller to thaw once its agent
/// is not dumpable again. The agent must have been made dumpable first (with the rest of the
/// sandbox frozen: `Sandbox::freeze_all_but_agent`), and the node's connections to it closed.
pub fn dump(criu: &Criu, spec: &DumpSpec<'_>) -> Result<(), CriuError> {
    std::fs::create_dir_all(spec.images).map_err(io(format!("mkdir {}", spec.images.display())))?;
    forget_dump(spec.images);
    let present = mountpoints(spec.pid)?;
    let external: Vec<String> = EXTERNAL
        .iter()
        .map(|(m, _)| m.to_string())
        .filter(|m| present.iter().any(|p| p == m))
        .collect();
    let volumes = volume_mounts(spec.pid)?;
    let record = Recorded {
        external: external.clone(),
        network: spec.network,
        volumes: volumes.clone(),
    };
    let record = serde_json::to_vec(&record).map_err(|e| CriuError::Other(e.to_string()))?;
    std::fs::write(spec.images.join(RECORD), record).map_err(io("write the checkpoint record"))?;
    let freezer = spec
        .group
        .freezer_dir()
        .ok_or_else(|| CriuError::Other("the sandbox has no freezer cgroup".into()))?;
    if !spec.group.freeze(Duration::from_secs(5)) {
        return Err(CriuError::Freeze);
    }
    let mut external: Vec<String> = external
        .iter()
        .chain(volumes.iter().map(|(m, _)| m))
        .map(|m| format!("mnt[{m}]:{}", key(m)))
        .collect();
    external.dedup();
    let dir =
        std::fs::File::open(spec.images).map_err(io(format!("open {}", spec.images.display())))?;
    let opts = rpc::Opts {
        images_dir_fd: dir.as_raw_fd(),
        pid: Some(spec.pid as i32),
        log_file: Some("dump.log".into()),
        log_level: log_level(),
        freeze_cgroup: Some(freezer.display().to_string()),
        // The node holds a sandbox's traffic at the host meanwhile (its `live` element out
        // of the table: [`crate::net::Lease::hold_traffic`]); CRIU's own lock, an nftables
        // table in the sandbox's namespace, costs ~20 ms at each restore. A sandbox without a
        // network has only `lo`, whose peers are all in the frozen tree.
        network_lock: Some(rpc::NETWORK_LOCK_SKIP),
        file_locks: Some(true),
        tcp_established: Some(true),
        // An inotify watch (the agent's, of a caller's watch ending as the sleep begins) is
        // dumped by the path of what it watches, found under the sandbox's root.
        irmap_scan_paths: vec!["/".into()],
        leave_running: Some(spec.leave_running),
        // Its interfaces, addresses, routes and sysctls are not dumped (about 50 ms of `ip`
        // and sysctl reads): a restore makes the namespace empty and gives it its eth0 and
        // settings itself ([`crate::net::Relink::apply`]). Its sockets are dumped as ever.
        empty_ns: spec.network.then_some(CLONE_NEWNET),
        external,
        cgroup_yard: criu.cgroup_yard.as_ref().map(|y| y.display().to_string()),
        ..Default::default()
    };
    let result = criu.workers.take(criu).and_then(|worker| {
        rpc::call(
            "dump",
            rpc::DUMP,
            opts,
            worker,
            &mut |_, _| Ok(()),
            &spec.images.join("dump.log"),
        )
    });
    criu.workers.refill(criu);
    // A sleep's tree was killed frozen: thawed, it ends. A tree that runs on (a snapshot, or a
    // dump that failed) stays frozen for the caller, which makes its agent not dumpable again
    // before the thaw (no process of the sandbox runs while the agent is dumpable).
    if result.is_ok() && !spec.leave_running {
        spec.group.thaw();
    }
    result?;
    // The images are whole (and, for a sleep, the tree is gone): not an error of the dump's
    // when this fails, only a node killed before it records the sleep loses the sandbox.
    if let Err(e) = std::fs::write(spec.images.join(DUMPED), b"") {
        tracing::warn!(images = %spec.images.display(), error = %e, "the dump's marker");
    }
    Ok(())
}

/// What a wake needs.
#[derive(Debug)]
pub struct RestoreSpec<'a> {
    /// The images of a [`dump`].
    pub images: &'a Path,
    /// The image's layers (the overlay's lowers, top first) and the sandbox's directory
    /// (upper/, work/, rootfs/).
    pub lowers: &'a [PathBuf],
    pub dir: &'a Path,
    /// The agent's binary on the host (bound at [`crate::init::AGENT_PATH`]).
    pub agent: &'a Path,
    /// The CA bundle bound over the image's, if the sandbox had one.
    pub ca_bundle: Option<&'a Path>,
    /// For a sandbox with a network: how its lease gives it its network again
    /// ([`crate::net::Lease::relinker`]).
    pub network: Option<crate::net::Relink>,
    /// A copy (a fork, a sandbox made from a snapshot) rather than the same sandbox woken:
    /// where criu's log goes (the images are shared, read only), the copy's cgroup of each
    /// controller (`cgroup_root`), and its established TCP
    /// connections dropped (it is a new machine on the network).
    pub copy: Option<CopyOf<'a>>,
}

/// What a restore of a copy needs beyond a wake's ([`RestoreSpec::copy`]).
#[derive(Debug)]
pub struct CopyOf<'a> {
    pub work: &'a Path,
    /// (controller, path): `None` for the unified hierarchy.
    pub cgroup_roots: Vec<(Option<String>, PathBuf)>,
}

/// Restores a sandbox from `spec.images`; returns the agent's new host pid. The restored
/// tree's parent is the caller's nearest subreaper (the node).
pub fn restore(criu: &Criu, spec: &RestoreSpec<'_>) -> Result<u32, CriuError> {
    let record: Recorded = serde_json::from_slice(
        &std::fs::read(spec.images.join(RECORD)).map_err(io("read the checkpoint record"))?,
    )
    .map_err(|e| CriuError::Other(format!("the checkpoint record: {e}")))?;
    let work = spec.copy.as_ref().map_or(spec.images, |c| c.work);
    std::fs::create_dir_all(work).map_err(io(format!("mkdir {}", work.display())))?;
    let root = spec.dir.join("rootfs");
    let images =
        std::fs::File::open(spec.images).map_err(io(format!("open {}", spec.images.display())))?;
    let work_dir = std::fs::File::open(work).map_err(io(format!("open {}", work.display())))?;
    let mut opts = rpc::Opts {
        images_dir_fd: images.as_raw_fd(),
        work_dir_fd: Some(work_dir.as_raw_fd()),
        log_file: Some("restore.log".into()),
        log_level: log_level(),
        root: Some(root.display().to_string()),
        // (The network lock is the dump's, which CRIU keeps in the images.)
        file_locks: Some(true),
        // The restored tree is the node's child, as the sandbox's first tree was.
        rst_sibling: Some(true),
        ..Default::default()
    };
    match &spec.copy {
        Some(c) => {
            opts.tcp_close = Some(true);
            opts.cg_root = c
                .cgroup_roots
                .iter()
                .map(|(ctrl, path)| rpc::CgroupRoot {
                    ctrl: ctrl.clone(),
                    path: path.display().to_string(),
                })
                .collect();
        }
        None => opts.tcp_established = Some(true),
    }
    for m in &record.external {
        let host: PathBuf = match EXTERNAL.iter().find(|(p, _)| p == m) {
            Some((_, Some(h))) => PathBuf::from(h),
            Some((p, None)) if *p == crate::init::AGENT_PATH => spec.agent.to_path_buf(),
            _ => match spec.ca_bundle {
                Some(b) => b.to_path_buf(),
                None => {
                    return Err(CriuError::Other(format!(
                        "the checkpoint has {m} bound, and no host file is given for it"
                    )))
                }
            },
        };
        opts.external
            .push(format!("mnt[{}]:{}", key(m), host.display()));
    }
    // The volumes: CRIU opens each from inside the sandbox's user namespace, which cannot
    // pass the data directory (root's 0700): each is bound for the restore's time under a
    // directory of /run/sbx that the sandbox's root owns.
    let staged = VolumeStage::new(&record.volumes)?;
    for (m, host) in &staged.binds {
        opts.external
            .push(format!("mnt[{}]:{}", key(m), host.display()));
    }
    let network = match (&spec.network, record.network) {
        (Some(place), true) => {
            // An empty namespace, given its eth0 when CRIU has made it (setup-namespaces),
            // before any socket of the sandbox is restored.
            opts.empty_ns = Some(CLONE_NEWNET);
            opts.notify_scripts = Some(true);
            Some(place.clone())
        }
        (None, false) => None,
        _ => {
            return Err(CriuError::Other(
                "the checkpoint's network and the wake's differ".into(),
            ))
        }
    };
    let mut on_notify = |step: &str, pid: Option<u32>| -> Result<(), String> {
        let (Some(relink), "setup-namespaces") = (&network, step) else {
            return Ok(());
        };
        let pid = pid.ok_or("criu named no process for setup-namespaces")?;
        let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))
            .map_err(|e| format!("open the network namespace of {pid}: {e}"))?;
        relink.apply(ns.into()).map_err(|e| e.to_string())
    };
    let overlay = overlay_options(spec.lowers, spec.dir)?;
    // criu mounts the cgroup hierarchies it restores into in a yard of its own, which in RPC
    // mode would be made in its work directory: a directory of the node's mount namespace
    // (criu reaches it by /proc/<node>/fd/N), where criu's mounts fail. The yard is the
    // host's own hierarchies where they are laid out as criu's yard would be, else a tmpfs of
    // the worker's own namespace ([`worker`]).
    opts.cgroup_yard = Some(
        criu.cgroup_yard
            .as_ref()
            .map_or(CGROUP_YARD.into(), |y| y.display().to_string()),
    );
    // Binds made on the host for this restore (its volumes) are seen only by a worker started
    // after them.
    let worker = if staged.binds.is_empty() {
        criu.workers.take(criu)?
    } else {
        worker::Workers::fresh(criu)?
    };
    if let Err(e) = worker.mount_root(&root, &overlay) {
        worker.end();
        criu.workers.refill(criu);
        return Err(e);
    }
    let pid = rpc::call(
        "restore",
        rpc::RESTORE,
        opts,
        worker,
        &mut on_notify,
        &work.join("restore.log"),
    );
    criu.workers.refill(criu);
    if pid.is_err() {
        // What the restore changed of the host's network goes back as it was: the sandbox's
        // lease is whole for the next try, no retired link is left.
        if let Some(relink) = &network {
            if let Err(e) = relink.undo() {
                tracing::warn!(error = %e, "undo the network of a failed restore");
            }
        }
    }
    let pid = pid?;
    drop(staged);
    pid.ok_or_else(|| CriuError::Other("criu named no restored process".into()))
}

/// The volumes of a restore, each bound at `/run/sbx/criu-vol-<pid>-<n>/<key>` (the folder
/// owned by the volume's owner, a uid of the sandbox's user namespace, mode 0700: no other
/// host user goes in); unbound and removed when dropped (the restored mounts are CRIU's own
/// clones by then).
struct VolumeStage {
    dir: Option<PathBuf>,
    binds: Vec<(String, PathBuf)>,
}

impl VolumeStage {
    fn new(volumes: &[(String, PathBuf)]) -> Result<VolumeStage, CriuError> {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let mut stage = VolumeStage {
            dir: None,
            binds: Vec::new(),
        };
        let Some((_, first)) = volumes.first() else {
            return Ok(stage);
        };
        let owner = std::fs::metadata(first).map_err(io(format!("stat {}", first.display())))?;
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let dir = PathBuf::from(format!("/run/sbx/criu-vol-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(io(format!("mkdir {}", dir.display())))?;
        stage.dir = Some(dir.clone());
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io("chmod the volumes' stage"))?;
        std::os::unix::fs::chown(&dir, Some(owner.uid()), Some(owner.gid()))
            .map_err(io("chown the volumes' stage"))?;
        for (m, host) in volumes {
            let at = dir.join(key(m));
            std::fs::create_dir(&at).map_err(io(format!("mkdir {}", at.display())))?;
            nix::mount::mount(
                Some(host.as_path()),
                &at,
                None::<&str>,
                nix::mount::MsFlags::MS_BIND,
                None::<&str>,
            )
            .map_err(|e| {
                CriuError::Other(format!("bind {} for the restore: {e}", host.display()))
            })?;
            stage.binds.push((m.clone(), at));
        }
        Ok(stage)
    }
}

impl Drop for VolumeStage {
    fn drop(&mut self) {
        // Empty directories only: never a recursive remove where a volume may still be bound.
        for (_, at) in &self.binds {
            let _ = nix::mount::umount2(at, nix::mount::MntFlags::MNT_DETACH);
            let _ = std::fs::remove_dir(at);
        }
        if let Some(d) = &self.dir {
            let _ = std::fs::remove_dir(d);
        }
    }
}

fn overlay_options(lowers: &[PathBuf], dir: &Path) -> Result<String, CriuError> {
    if lowers.is_empty() {
        return Err(CriuError::Other("the image has no layer".into()));
    }
    let lowers: Vec<String> = lowers.iter().map(|p| p.display().to_string()).collect();
    let data = format!(
        "lowerdir={},upperdir={},workdir={}",
        lowers.join(":"),
        dir.join("upper").display(),
        dir.join("work").display()
    );
    if data.len() >= 4096 {
        return Err(CriuError::Other(
            "the image's layers do not fit in one overlay mount's options".into(),
        ));
    }
    Ok(data)
}

/// `SBX_CRIU_LOG_LEVEL` (0 to 4) of the node's environment: a log with timestamps of every
/// step at 4, for finding where a checkpoint's time goes. CRIU's own default (2) otherwise.
fn log_level() -> Option<i32> {
    std::env::var("SBX_CRIU_LOG_LEVEL")
        .ok()
        .and_then(|l| l.parse::<i32>().ok())
        .filter(|l| (0..=4).contains(l))
}

/// An empty folder on the host that a restoring criu's mount namespace covers with a tmpfs
/// of its own, for its cgroup yard.
const CGROUP_YARD: &str = "/run/sbx/criu-yard";

/// `CLONE_NEWNET` for `criu_opts.empty_ns`.
const CLONE_NEWNET: u32 = 0x4000_0000;

/// With `SBX_CRIU_LOG_DIR` set in the node's environment, a copy of every criu log goes there
/// (`<action>-<time>.log`): a wake's and a copy's logs are removed with their images.
fn keep_log(action: &str, log: &Path) {
    let Some(dir) = std::env::var_os("SBX_CRIU_LOG_DIR") else {
        return;
    };
    let dir = PathBuf::from(dir);
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros());
    if std::fs::create_dir_all(&dir).is_ok() {
        let _ = std::fs::copy(log, dir.join(format!("{action}-{stamp}.log")));
    }
}

mod rpc;
#[cfg(test)]
mod tests;
pub(crate) mod undumpable;
mod worker;
