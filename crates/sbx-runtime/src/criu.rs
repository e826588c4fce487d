//! Checkpoint and restore of a sandbox with CRIU (issue #15): sleep (freeze, dump, the tree
//! gone) and wake (restore into the same directory and cgroups, the same address).
//!
//! The `criu` binary (≥ 4.2) is driven by its command line, never through a shell. What the
//! node does around these calls is in [`crate::driver::NamespaceDriver::sleep`] and
//! [`crate::driver::NamespaceDriver::wake`].
//!
//! - Sleep: the sandbox's freezer cgroup is frozen first (CRIU then skips its own polling),
//!   then `criu dump` of the agent's tree with `--network-lock nftables --file-locks
//!   --tcp-established`, `--freeze-cgroup`, and `--external mnt[...]` for every bind of a host
//!   file (the device nodes, the masked /proc files, the CA bundle, the agent's binary). The
//!   group is thawed after, on success (it is empty then) as on failure (the tree runs on).
//! - Wake: `criu restore -d` with `--root` on the sandbox's overlay, mounted in a private
//!   mount namespace of the criu process only (nothing is mounted in the host's), the external
//!   mounts mapped back to host paths, and for a sandbox with a network `--empty-ns net` and an
//!   action script that is the agent's binary (`sbx-agent`, which acts on
//!   `setup-namespaces`: [`hook`]): it moves the sandbox's `eth0` from the namespace its lease
//!   still holds into the restored tree's new one and configures it by netlink, so the
//!   sandbox keeps its address, its nft element and its established TCP connections.

use std::io::Read;
use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt;
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
    pub run: Option<PathBuf>,
}

/// Where the tmpfs criu is given as /run is mounted (once, kept across the node's restarts).
const KDAT_RUN: &str = "/run/sbx/criu-run";

/// The tmpfs for criu's /run ([`Criu::run`]): `None` where the host's /run is a tmpfs (criu
/// keeps its cache there itself) or one cannot be made (criu then learns the kernel anew each
/// run).
fn kdat_run() -> Option<PathBuf> {
    use nix::sys::statfs::{statfs, TMPFS_MAGIC};
    let is_tmpfs = |p: &Path| statfs(p).is_ok_and(|s| s.filesystem_type() == TMPFS_MAGIC);
    if is_tmpfs(Path::new("/run")) {
        return None;
    }
    let dir = PathBuf::from(KDAT_RUN);
    std::fs::create_dir_all(&dir).ok()?;
    if !is_tmpfs(&dir) {
        nix::mount::mount(
            Some("sbx-criu-run"),
            &dir,
            Some("tmpfs"),
            nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV,
            Some("size=4m,mode=0755"),
        )
        .ok()?;
    }
    // The mount point of the host's /run/sbx (the CA bundles a restore binds).
    std::fs::create_dir_all(dir.join("sbx")).ok()?;
    Some(dir)
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
/// `leave_running`). The group is thawed in every case. The agent must have been made
/// dumpable first, and the node's connections to it closed.
pub fn dump(criu: &Criu, spec: &DumpSpec<'_>) -> Result<(), CriuError> {
    std::fs::create_dir_all(spec.images).map_err(io(format!("mkdir {}", spec.images.display())))?;
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
    let mut args: Vec<String> = vec![
        "dump".into(),
        "-t".into(),
        spec.pid.to_string(),
        "-D".into(),
        spec.images.display().to_string(),
        "-o".into(),
        "dump.log".into(),
        "--freeze-cgroup".into(),
        freezer.display().to_string(),
        "--network-lock".into(),
        "nftables".into(),
        "--file-locks".into(),
        "--tcp-established".into(),
        // An inotify watch (the agent's, of a caller's watch ending as the sleep begins) is
        // dumped by the path of what it watches, found under the sandbox's root.
        "--irmap-scan-path".into(),
        "/".into(),
    ];
    if spec.leave_running {
        args.push("--leave-running".into());
    }
    for m in external.iter().chain(volumes.iter().map(|(m, _)| m)) {
        args.push("--external".into());
        args.push(format!("mnt[{m}]:{}", key(m)));
    }
    let result = criu_run(
        criu,
        "dump",
        &args,
        &[],
        None,
        &spec.images.join("dump.log"),
    );
    spec.group.thaw();
    result
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
    /// For a sandbox with a network: the namespace its lease holds (with `eth0` in it; a path
    /// to open, [`crate::net::Lease::ns_path`]), its address and gateway.
    pub network: Option<(PathBuf, Ipv4Addr, Ipv4Addr)>,
    /// A copy (a fork, a sandbox made from a snapshot) rather than the same sandbox woken:
    /// where criu's log and pidfile go (the images are shared, read only), the copy's cgroup
    /// of each controller (`criu --cgroup-root CTRL:PATH`), and its established TCP
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
    let pidfile = work.join("restored.pid");
    let _ = std::fs::remove_file(&pidfile);
    let root = spec.dir.join("rootfs");
    let mut args: Vec<String> = vec![
        "restore".into(),
        "-D".into(),
        spec.images.display().to_string(),
        "-W".into(),
        work.display().to_string(),
        "-o".into(),
        "restore.log".into(),
        "-d".into(),
        "--pidfile".into(),
        pidfile.display().to_string(),
        "--root".into(),
        root.display().to_string(),
        "--network-lock".into(),
        "nftables".into(),
        "--file-locks".into(),
    ];
    match &spec.copy {
        Some(c) => {
            args.push("--tcp-close".into());
            for (ctrl, path) in &c.cgroup_roots {
                args.push("--cgroup-root".into());
                args.push(match ctrl {
                    Some(ctrl) => format!("{ctrl}:{}", path.display()),
                    None => path.display().to_string(),
                });
            }
        }
        None => args.push("--tcp-established".into()),
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
        args.push("--external".into());
        args.push(format!("mnt[{}]:{}", key(m), host.display()));
    }
    // The volumes: CRIU opens each from inside the sandbox's user namespace, which cannot
    // pass the data directory (root's 0700): each is bound for the restore's time under a
    // directory of /run/sbx that the sandbox's root owns.
    let staged = VolumeStage::new(&record.volumes)?;
    for (m, host) in &staged.binds {
        args.push("--external".into());
        args.push(format!("mnt[{}]:{}", key(m), host.display()));
    }
    let mut env: Vec<(String, String)> = Vec::new();
    match (&spec.network, record.network) {
        (Some((ns, addr, gw)), true) => {
            args.push("--empty-ns".into());
            args.push("net".into());
            args.push("--action-script".into());
            args.push(spec.agent.display().to_string());
            env.push((HOOK_NETNS.into(), ns.display().to_string()));
            env.push((HOOK_ADDR.into(), addr.to_string()));
            env.push((HOOK_GW.into(), gw.to_string()));
        }
        (None, false) => {}
        _ => {
            return Err(CriuError::Other(
                "the checkpoint's network and the wake's differ".into(),
            ))
        }
    }
    let overlay = overlay_options(spec.lowers, spec.dir)?;
    criu_run(
        criu,
        "restore",
        &args,
        &env,
        Some((root.clone(), overlay)),
        &work.join("restore.log"),
    )?;
    let pid = std::fs::read_to_string(&pidfile).map_err(io("read criu's pidfile"))?;
    pid.trim()
        .parse::<u32>()
        .map_err(|_| CriuError::Other(format!("criu's pidfile says {pid:?}")))
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

/// Runs criu with `args`, its environment cleared but for `env` (and PATH), in a mount
/// namespace of its own when `overlay` is given (the sandbox's root mounted there, at the
/// path given, for `--root`: it is gone from the host with the criu process).
fn criu_run(
    criu: &Criu,
    action: &'static str,
    args: &[String],
    env: &[(String, String)],
    overlay: Option<(PathBuf, String)>,
    log: &Path,
) -> Result<(), CriuError> {
    let mut cmd = Command::new(&criu.bin);
    cmd.args(args);
    // A log with timestamps of every step, for finding where a checkpoint's time goes.
    if let Some(level) = std::env::var("SBX_CRIU_LOG_LEVEL")
        .ok()
        .filter(|l| matches!(l.as_str(), "0" | "1" | "2" | "3" | "4"))
    {
        cmd.arg(format!("-v{level}"));
    }
    cmd.env_clear()
        .env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        )
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if overlay.is_some() || criu.run.is_some() {
        let mount = crate::process::PrivateMount::new(overlay, criu.run.as_deref())
            .map_err(io("prepare criu's mounts"))?;
        // SAFETY: the closure runs in the forked child before exec and only makes raw
        // syscalls (unshare, mount) on memory prepared before the fork.
        unsafe {
            cmd.pre_exec(move || mount.apply());
        }
    }
    let mut child = cmd
        .spawn()
        .map_err(io(format!("run {}", criu.bin.display())))?;
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    let status = child.wait().map_err(io("wait for criu"))?;
    if status.success() {
        return Ok(());
    }
    let mut text = log_tail(log);
    if text.is_empty() {
        text = err.trim().to_string();
    }
    Err(CriuError::Failed {
        action,
        status: status.to_string(),
        log: text,
    })
}

/// The restore hook's environment: the leased namespace holding `eth0`, the sandbox's address
/// and its gateway.
pub const HOOK_NETNS: &str = "SBX_CRIU_NETNS";
pub const HOOK_ADDR: &str = "SBX_CRIU_ADDR";
pub const HOOK_GW: &str = "SBX_CRIU_GW";

/// Whether this process was started by criu as an action script (`CRTOOLS_SCRIPT_ACTION` is
/// set).
pub fn is_hook() -> bool {
    std::env::var_os("CRTOOLS_SCRIPT_ACTION").is_some()
}

/// The action script's work, run by the agent's binary when criu starts it: on
/// `setup-namespaces`, moves `eth0` from the namespace named by [`HOOK_NETNS`] into the
/// restored tree's network namespace and configures it ([`crate::net::move_sandbox_link`]).
/// Every other action is nothing to do.
pub fn hook() -> Result<(), CriuError> {
    let action = std::env::var("CRTOOLS_SCRIPT_ACTION").unwrap_or_default();
    if action != "setup-namespaces" {
        return Ok(());
    }
    let var = |k: &str| std::env::var(k).map_err(|_| CriuError::Other(format!("{k} is not set")));
    let (Ok(ns), Ok(addr), Ok(gw)) = (var(HOOK_NETNS), var(HOOK_ADDR), var(HOOK_GW)) else {
        // No network to set up (a sandbox without one is restored without this hook).
        return Ok(());
    };
    let pid = var("CRTOOLS_INIT_PID")?;
    let addr: Ipv4Addr = addr
        .parse()
        .map_err(|_| CriuError::Other(format!("bad address {addr}")))?;
    let gw: Ipv4Addr = gw
        .parse()
        .map_err(|_| CriuError::Other(format!("bad gateway {gw}")))?;
    let from = std::fs::File::open(&ns).map_err(io(format!("open {ns}")))?;
    let to = std::fs::File::open(format!("/proc/{pid}/ns/net"))
        .map_err(io(format!("open the network namespace of {pid}")))?;
    crate::net::move_sandbox_link(from.into(), to.into(), addr, gw)
        .map_err(|e| CriuError::Other(e.to_string()))
}

#[cfg(test)]
mod tests;
