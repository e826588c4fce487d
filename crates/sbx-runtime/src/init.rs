//! Making a sandbox from the inside: the stages of `sbx-agent init`, in the layout CRIU can
//! checkpoint (issue #15; see docs/criu-spike/FINDINGS.md §3 and §7).
//!
//! Stage 0 runs as host root in the host's namespaces. It joins the sandbox's cgroups and forks
//! stage 1, which enters the sandbox's **user namespace first**: the one that owns the leased
//! network namespace (`InitConfig::netns`, made by the pool with its own user namespace), or a
//! new one whose maps stage 0 writes (sandbox root is the host's `uid_base`). From inside it,
//! stage 1 unshares the mount, UTS, IPC and cgroup namespaces (and the network one when none is
//! leased), so the sandbox's user namespace owns every namespace of the sandbox. Stage 0 then
//! joins stage 1's mount namespace and, as host root, mounts what needs the host's paths: the
//! overlay (its lowers are under the 0700 image store), /dev with the host's device nodes,
//! /tmp, the CA bundle, the files of /etc, and the agent's binary read-only at [`AGENT_PATH`].
//! Stage 1 mounts /sys (it shows the mounter's network namespace) and unshares the PID
//! namespace; its child, stage 2, is PID 1: it calls setsid(), mounts /proc, pivots into the
//! root, binds the agent's listening socket (the abstract [`AGENT_SOCKET`] in the sandbox's
//! network namespace), bounds its capabilities, installs the seccomp filter (without
//! no_new_privs: setuid files of the image work inside the sandbox), and execs the agent from
//! [`AGENT_PATH`] with every descriptor but that socket closed. The agent makes itself not
//! dumpable at once ([`agent_listener`]). Stage 0 prints the agent's host pid and exits.
//!
//! Every mount is made in the sandbox's own mount namespace: when its last process is gone, so
//! are its mounts. Nothing is mounted in the host's namespace.

use std::fs;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{symlink, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::unistd::{chdir, fork, pivot_root, sethostname, ForkResult, Gid, Uid};
use serde::{Deserialize, Serialize};

/// What stage 0 is told, as JSON on its stdin.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InitConfig {
    pub id: String,
    /// The image's layers, top first: the overlay's lower directories (joined with ':').
    pub lowers: Vec<PathBuf>,
    /// The sandbox's directory on the host: upper/, work/, rootfs/ and agent.sock.
    pub dir: PathBuf,
    pub hostname: String,
    pub uid_base: u32,
    pub uid_count: u32,
    /// The `cgroup.procs` files to join.
    pub cgroup_procs: Vec<PathBuf>,
    /// Mount /tmp as a tmpfs of this size.
    pub tmp_memory_bytes: Option<u64>,
    /// A run's own sandbox ([`crate::SandboxSpec::scratch`]): never kept, slept, checkpointed
    /// or moved. Its overlay is mounted `volatile` (no sync of the node's disk at its end);
    /// PID 1 serves in its own process, as forked, instead of executing the agent's binary
    /// from inside (the exec only makes the agent's mappings the sandbox's own, for CRIU; ~1 ms
    /// of CPU, docs/throughput.md), and the binary is not bound in; /dev's nodes are made, not
    /// bound ([`build_dev`]); the agent serves no /run/sbx/awake.
    #[serde(default)]
    pub scratch: bool,
    /// The image's environment, user and working directory: the agent's defaults for commands.
    #[serde(default)]
    pub image_env: Vec<(String, String)>,
    #[serde(default)]
    pub image_user: Option<String>,
    #[serde(default)]
    pub image_workdir: Option<String>,
    /// A network namespace to join (a path to open: a namespace file, or a descriptor of
    /// the node's in /proc, see [`crate::net::Lease::ns_path`]) instead of unsharing a new
    /// one with only `lo`.
    #[serde(default)]
    pub netns: Option<PathBuf>,
    /// The sandbox's /etc/resolv.conf (its DNS servers), written over the image's; `None`:
    /// the image's.
    #[serde(default)]
    pub resolv_conf: Option<String>,
    /// A file of the host mounted read-only over the image's CA bundle
    /// (/etc/ssl/certs/ca-certificates.crt, where that is a regular file).
    #[serde(default)]
    pub ca_bundle: Option<PathBuf>,
    /// Runtime settings: the commands' limits, sysctls, tmpfs, /dev/shm's size
    /// ([`crate::rtset`]).
    #[serde(default)]
    pub runtime: crate::rtset::RuntimeSettings,
    /// Volumes bound into the sandbox ([`crate::volume`]).
    #[serde(default)]
    pub volumes: Vec<crate::volume::VolumeBind>,
}

#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error("{what}: {source}")]
    Sys {
        what: String,
        #[source]
        source: nix::Error,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Other(String),
}

trait Ctx<T> {
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T, InitError>;
}

impl<T> Ctx<T> for nix::Result<T> {
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T, InitError> {
        self.map_err(|source| InitError::Sys {
            what: what(),
            source,
        })
    }
}

impl<T> Ctx<T> for std::io::Result<T> {
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T, InitError> {
        self.map_err(|source| InitError::Io {
            what: what(),
            source,
        })
    }
}

/// Capabilities root keeps in a sandbox (Docker's default set).
const KEEP_CAPS: &[caps::Capability] = &[
    caps::Capability::CAP_CHOWN,
    caps::Capability::CAP_DAC_OVERRIDE,
    caps::Capability::CAP_FSETID,
    caps::Capability::CAP_FOWNER,
    caps::Capability::CAP_MKNOD,
    caps::Capability::CAP_NET_RAW,
    caps::Capability::CAP_SETGID,
    caps::Capability::CAP_SETUID,
    caps::Capability::CAP_SETFCAP,
    caps::Capability::CAP_SETPCAP,
    caps::Capability::CAP_NET_BIND_SERVICE,
    caps::Capability::CAP_SYS_CHROOT,
    caps::Capability::CAP_KILL,
    caps::Capability::CAP_AUDIT_WRITE,
];

fn mnt(
    src: Option<&str>,
    target: &Path,
    fstype: Option<&str>,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<(), InitError> {
    mount(src, target, fstype, flags, data).ctx(|| format!("mount {}", target.display()))
}

fn loopback_up() -> Result<(), InitError> {
    // SAFETY: socket() returns a new fd or -1; the fd is owned below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(InitError::Io {
            what: "socket".into(),
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: fd is a new descriptor nothing else owns.
    let sock: OwnedFd = unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) };
    // SAFETY: an all-zero ifreq is a valid value of this plain C struct.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (i, b) in b"lo".iter().enumerate() {
        req.ifr_name[i] = *b as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads the name and writes the flags of the ifreq we own.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(InitError::Io {
            what: "SIOCGIFFLAGS lo".into(),
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: the union's flags member is the one SIOCGIFFLAGS filled in.
    unsafe {
        req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    }
    // SAFETY: SIOCSIFFLAGS reads the ifreq we own.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(InitError::Io {
            what: "SIOCSIFFLAGS lo".into(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Joins the network namespace at `path` (tests: a lease's path names its namespace).
#[cfg(test)]
pub(crate) fn join_netns(path: &Path) -> Result<(), InitError> {
    let ns = fs::File::open(path).ctx(|| format!("open {}", path.display()))?;
    nix::sched::setns(&ns, CloneFlags::CLONE_NEWNET)
        .ctx(|| format!("join the network namespace {}", path.display()))
}

fn write_new(path: &Path, contents: &str, uid: u32) -> Result<(), InitError> {
    let _ = fs::remove_file(path);
    fs::write(path, contents).ctx(|| format!("write {}", path.display()))?;
    std::os::unix::fs::lchown(path, Some(uid), Some(uid))
        .ctx(|| format!("chown {}", path.display()))
}

/// The device nodes of a sandbox's /dev: the host's, as (name, major, minor).
const DEV_NODES: [(&str, u64, u64); 6] = [
    ("null", 1, 3),
    ("zero", 1, 5),
    ("full", 1, 7),
    ("random", 1, 8),
    ("urandom", 1, 9),
    ("tty", 5, 0),
];

/// /dev: a tmpfs with the usual device nodes, /dev/pts, /dev/shm and the links to /proc.
///
/// The nodes are the host's bound one by one (six mounts), except in a sandbox never
/// checkpointed (`make_nodes`: [`InitConfig::scratch`]): there they are made in the tmpfs (host root's
/// `mknod`), six mounts fewer to make and to release (issue #31), and the tmpfs is not
/// `nodev`. Nothing of the sandbox can add a device node to it: a device's `mknod` takes
/// CAP_MKNOD of the host's user namespace (the tmpfs is host root's), which no process of a
/// sandbox has. A checkpointed sandbox keeps the binds, which CRIU restores as external
/// mounts (`criu.rs`).
fn build_dev(
    root: &Path,
    base: u32,
    shm_bytes: Option<u64>,
    make_nodes: bool,
) -> Result<(), InitError> {
    let dev = root.join("dev");
    fs::create_dir_all(&dev).ctx(|| "mkdir /dev".into())?;
    let owner = format!("uid={base},gid={base}");
    let nodev = if make_nodes {
        MsFlags::empty()
    } else {
        MsFlags::MS_NODEV
    };
    mnt(
        Some("tmpfs"),
        &dev,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | nodev | MsFlags::MS_STRICTATIME,
        Some(&format!(
            "mode=755,size={},{owner}",
            crate::rtset::DEFAULT_SHM_BYTES
        )),
    )?;
    for (name, major, minor) in DEV_NODES {
        let target = dev.join(name);
        if make_nodes {
            nix::sys::stat::mknod(
                &target,
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::from_bits_truncate(0o666),
                nix::sys::stat::makedev(major, minor),
            )
            .ctx(|| format!("mknod /dev/{name}"))?;
            // Not narrowed by the umask.
            fs::set_permissions(&target, fs::Permissions::from_mode(0o666))
                .ctx(|| format!("chmod /dev/{name}"))?;
            continue;
        }
        fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o666)
            .open(&target)
            .ctx(|| format!("create /dev/{name}"))?;
        mnt(
            Some(&format!("/dev/{name}")),
            &target,
            None,
            MsFlags::MS_BIND,
            None,
        )?;
    }
    let pts = dev.join("pts");
    fs::create_dir(&pts).ctx(|| "mkdir /dev/pts".into())?;
    mnt(
        Some("devpts"),
        &pts,
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some(&format!(
            "newinstance,ptmxmode=0666,mode=0620,gid={}",
            base + 5
        )),
    )?;
    symlink("pts/ptmx", dev.join("ptmx")).ctx(|| "symlink /dev/ptmx".into())?;
    let shm = dev.join("shm");
    fs::create_dir(&shm).ctx(|| "mkdir /dev/shm".into())?;
    match shm_bytes {
        // Of the size asked for: a tmpfs of its own.
        Some(_) => mnt(
            Some("shm"),
            &shm,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some(&crate::rtset::shm_options(shm_bytes, base)),
        )?,
        // Else a directory of /dev's tmpfs, whose 64 MiB are Docker's /dev/shm's (/dev holds
        // nothing else of size): one tmpfs less for every checkpoint to archive and restore
        // (CRIU runs tar for each, ~8 ms).
        None => {
            fs::set_permissions(&shm, fs::Permissions::from_mode(0o1777))
                .ctx(|| "chmod /dev/shm".into())?;
            // Sandbox root's, as the tmpfs of its own would be.
            std::os::unix::fs::chown(&shm, Some(base), Some(base))
                .ctx(|| "chown /dev/shm".into())?;
        }
    }
    for (name, to) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("core", "/proc/kcore"),
    ] {
        symlink(to, dev.join(name)).ctx(|| format!("symlink /dev/{name}"))?;
    }
    Ok(())
}

fn write_byte(fd: &OwnedFd, b: &[u8]) -> Result<(), InitError> {
    nix::unistd::write(fd, b).ctx(|| "sync pipe".into())?;
    Ok(())
}

fn read_byte(fd: &OwnedFd) -> Result<u8, InitError> {
    let mut b = [0u8; 1];
    let n = nix::unistd::read(fd, &mut b).ctx(|| "sync pipe".into())?;
    if n == 0 {
        return Err(InitError::Other("the other stage ended".into()));
    }
    Ok(b[0])
}

/// Marks every descriptor from `from` up close-on-exec (`close_range` with
/// `CLOSE_RANGE_CLOEXEC`): none of them reaches what the process execs.
fn cloexec_from(from: u32) -> Result<(), InitError> {
    // SAFETY: close_range with CLOSE_RANGE_CLOEXEC only sets a flag on descriptors; no owner
    // loses its descriptor.
    let r = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            from,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error()).ctx(|| "close-on-exec inherited descriptors".into())
    }
}

/// Closes every descriptor from 3 up (`close_range`).
fn close_inherited() -> Result<(), InitError> {
    // SAFETY: called first in `enter`, when this process holds no descriptor of its own above
    // stdio (its config was read from stdin): closing them leaves no owner with a dangling one.
    let r = unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error()).ctx(|| "close inherited descriptors".into())
    }
}

/// Where the agent's binary is bound (read-only) inside every sandbox, and exec'd from.
pub const AGENT_PATH: &str = "/dev/.sbx-agent";
/// The agent's listening socket: this abstract name in the sandbox's network namespace.
pub const AGENT_SOCKET: &str = "sbx-agent";
/// The descriptor the agent finds its listening socket on after its exec.
const AGENT_LISTEN_FD: i32 = 3;

/// What the agent is told on its command line (`sbx-agent serve <json>`): its defaults for
/// commands.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct AgentArgs {
    pub hostname: String,
    #[serde(default)]
    pub image_env: Vec<(String, String)>,
    #[serde(default)]
    pub image_user: Option<String>,
    #[serde(default)]
    pub image_workdir: Option<String>,
    /// The limits each command sets before it executes ([`crate::rtset`]).
    #[serde(default)]
    pub rlimits: Vec<crate::rtset::Rlimit>,
}

/// The user namespace that owns the network namespace `ns` (`NS_GET_USERNS`).
pub(crate) fn owner_userns(ns: &fs::File) -> Result<OwnedFd, InitError> {
    const NS_GET_USERNS: libc::c_ulong = 0xb701;
    // SAFETY: NS_GET_USERNS takes no argument and returns a new descriptor or -1.
    let fd = unsafe { libc::ioctl(ns.as_raw_fd(), NS_GET_USERNS as _) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error())
            .ctx(|| "the owner of the network namespace".into());
    }
    // SAFETY: the ioctl returned a new descriptor nothing else owns.
    Ok(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) })
}

/// Whether `userns` is the caller's own user namespace (the host's).
pub(crate) fn is_initial_userns(userns: &OwnedFd) -> Result<bool, InitError> {
    use std::os::unix::fs::MetadataExt;
    let ours = fs::metadata("/proc/self/ns/user").ctx(|| "stat /proc/self/ns/user".into())?;
    let theirs = fs::File::from(userns.try_clone().ctx(|| "dup".into())?)
        .metadata()
        .ctx(|| "stat a user namespace".into())?;
    Ok(ours.ino() == theirs.ino() && ours.dev() == theirs.dev())
}

/// Runs stage 0 (here, host root), which forks stage 1 (in the sandbox's user namespace,
/// where it makes the other namespaces) and mounts the root in stage 1's mount namespace;
/// stage 1 forks stage 2, PID 1 of the sandbox, which pivots into the root, binds the agent's
/// socket and execs the agent from [`AGENT_PATH`]. Stage 0 prints `pid N` (the agent's host
/// pid) on stdout and exits the process; this returns only an error.
pub fn enter(
    cfg: &InitConfig,
    in_process: impl FnOnce(UnixListener) -> std::convert::Infallible,
) -> Result<std::convert::Infallible, InitError> {
    // Nothing the node's process had open reaches the sandbox: every descriptor but stdio
    // (the node's pipes to this stage) is closed before anything else.
    close_inherited()?;
    let pid = std::process::id().to_string();
    for f in &cfg.cgroup_procs {
        fs::write(f, &pid).ctx(|| format!("join {}", f.display()))?;
    }
    let upper = cfg.dir.join("upper");
    let work = cfg.dir.join("work");
    let root = cfg.dir.join("rootfs");
    for d in [&upper, &work, &root] {
        fs::create_dir_all(d).ctx(|| format!("mkdir {}", d.display()))?;
    }
    // Searchable (only) by sandbox root, whose stage 1 reaches the root through it.
    fs::set_permissions(
        &cfg.dir,
        std::os::unix::fs::PermissionsExt::from_mode(0o711),
    )
    .ctx(|| format!("chmod {}", cfg.dir.display()))?;
    // The upper directory is the sandbox root's own /.
    std::os::unix::fs::chown(&upper, Some(cfg.uid_base), Some(cfg.uid_base))
        .ctx(|| "chown upper".into())?;
    if cfg.lowers.is_empty() {
        return Err(InitError::Other("the image has no layer".into()));
    }
    let exe = fs::read_link("/proc/self/exe").ctx(|| "the agent's binary".into())?;
    // Host root: the hard limits the commands are to get, before they are inherited.
    crate::rtset::raise_hard_limits(&cfg.runtime.rlimits)
        .map_err(|e| InitError::Other(e.to_string()))?;
    // A leased network namespace comes with the user namespace made for it (its owner): the
    // sandbox joins both. Without one, it makes both.
    let joined = match &cfg.netns {
        Some(path) => {
            let net = fs::File::open(path).ctx(|| format!("open {}", path.display()))?;
            let user = owner_userns(&net)?;
            if is_initial_userns(&user)? {
                return Err(InitError::Other(format!(
                    "the network namespace {} is the host's user namespace's: the sandbox must own it",
                    path.display()
                )));
            }
            Some((user, OwnedFd::from(net)))
        }
        None => None,
    };
    let (to_child_r, to_child_w) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).ctx(|| "pipe".into())?;
    let (to_parent_r, to_parent_w) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).ctx(|| "pipe".into())?;
    // SAFETY: stage 0 is single-threaded (the agent binary has started no thread yet), so the
    // child may run any code after fork.
    match unsafe { fork() }.ctx(|| "fork".into())? {
        ForkResult::Child => {
            drop(to_child_w);
            drop(to_parent_r);
            let e = match stage1(cfg, joined, &to_child_r, &to_parent_w, in_process) {
                Ok(never) => match never {},
                Err(e) => e,
            };
            let msg = format!("E{e}");
            let _ = nix::unistd::write(&to_parent_w, msg.as_bytes());
            std::process::exit(1);
        }
        ForkResult::Parent { child } => {
            drop(joined);
            drop(to_child_r);
            drop(to_parent_w);
            let child = child.as_raw() as u32;
            match stage0_parent(cfg, &exe, child, &to_child_w, &to_parent_r) {
                Ok(agent) => {
                    let mut out = std::io::stdout();
                    let _ = writeln!(out, "pid {agent}");
                    let _ = out.flush();
                    std::process::exit(0);
                }
                Err((agent, e)) => {
                    crate::process::kill_pid(child, libc::SIGKILL);
                    if let Some(a) = agent {
                        crate::process::kill_pid(a, libc::SIGKILL);
                    }
                    let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(child as i32), None);
                    Err(e)
                }
            }
        }
    }
}

fn stage0_parent(
    cfg: &InitConfig,
    exe: &Path,
    child: u32,
    to_child: &OwnedFd,
    from_child: &OwnedFd,
) -> Result<u32, (Option<u32>, InitError)> {
    let none = |e| (None, e);
    let mut b = read_byte(from_child).map_err(none)?;
    if b == b'U' {
        let map = format!("0 {} {}\n", cfg.uid_base, cfg.uid_count);
        fs::write(format!("/proc/{child}/uid_map"), &map)
            .ctx(|| "write uid_map".into())
            .map_err(none)?;
        fs::write(format!("/proc/{child}/gid_map"), &map)
            .ctx(|| "write gid_map".into())
            .map_err(none)?;
        write_byte(to_child, b"G").map_err(none)?;
        b = read_byte(from_child).map_err(none)?;
    }
    if b != b'M' {
        return Err((None, child_error(b, from_child)));
    }
    // Host root, in the sandbox's mount namespace, mounts what needs the host's paths.
    let mntns = fs::File::open(format!("/proc/{child}/ns/mnt"))
        .ctx(|| "open the sandbox's mount namespace".into())
        .map_err(none)?;
    nix::sched::setns(&mntns, CloneFlags::CLONE_NEWNS)
        .ctx(|| "join the sandbox's mount namespace".into())
        .map_err(none)?;
    drop(mntns);
    host_mounts(cfg, exe).map_err(none)?;
    // 'D': exec the agent from inside; 'd': PID 1 serves in process (the sandbox is never
    // checkpointed, or the image cannot run the agent's binary).
    let runs = !cfg.scratch && image_runs_agent(&cfg.dir.join("rootfs"));
    write_byte(to_child, if runs { b"D" } else { b"d" }).map_err(none)?;
    let b = read_byte(from_child).map_err(none)?;
    if b != b'P' {
        return Err((None, child_error(b, from_child)));
    }
    let mut pid = [0u8; 4];
    let f = from_child
        .try_clone()
        .ctx(|| "sync pipe".into())
        .map_err(none)?;
    let mut f = fs::File::from(f);
    f.read_exact(&mut pid)
        .ctx(|| "sync pipe".into())
        .map_err(none)?;
    let agent = u32::from_le_bytes(pid);
    // Stage 1 ends once it has forked PID 1; PID 1's end of the pipe closes at its exec.
    let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(child as i32), None);
    let mut rest = Vec::new();
    let _ = f.read_to_end(&mut rest);
    if rest.is_empty() {
        Ok(agent)
    } else {
        let msg = String::from_utf8_lossy(rest.strip_prefix(b"E").unwrap_or(&rest)).into_owned();
        Err((Some(agent), InitError::Other(msg)))
    }
}

/// Binds the agent's binary read-only at [`AGENT_PATH`] under `root`.
fn bind_agent(root: &Path, exe: &Path) -> Result<(), InitError> {
    let agent = root.join(AGENT_PATH.trim_start_matches('/'));
    fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o555)
        .open(&agent)
        .ctx(|| format!("create {AGENT_PATH}"))?;
    mount(
        Some(exe),
        &agent,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .ctx(|| format!("bind the agent at {AGENT_PATH}"))?;
    mnt(
        None,
        &agent,
        None,
        MsFlags::MS_BIND
            | MsFlags::MS_REMOUNT
            | MsFlags::MS_RDONLY
            | MsFlags::MS_NOSUID
            | MsFlags::MS_NODEV,
        None,
    )?;
    Ok(())
}

/// Writes the sandbox's own files of /etc (hostname, hosts, resolv.conf) into the overlay's
/// upper directory, before the overlay is mounted: written through it, each file was a copy-up
/// of /etc, a whiteout over the image's file and a rename (~0.25 ms a sandbox, issue #31). The
/// upper /etc takes the mode and owner of the image's, whose other files show through it.
/// False (nothing written) where the sandbox's /etc is no directory: none in the image, or
/// removed or replaced in the upper directory.
fn write_etc(cfg: &InitConfig, upper: &Path) -> Result<bool, InitError> {
    use std::os::unix::fs::MetadataExt;
    let etc = upper.join("etc");
    match fs::symlink_metadata(&etc) {
        Ok(m) if m.is_dir() => {}
        // A whiteout or another file over the image's /etc.
        Ok(_) => return Ok(false),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // The topmost layer that has an /etc decides what it is.
            let Some(image_etc) = cfg
                .lowers
                .iter()
                .find_map(|l| fs::symlink_metadata(l.join("etc")).ok())
            else {
                return Ok(false);
            };
            if !image_etc.is_dir() {
                return Ok(false);
            }
            fs::create_dir(&etc).ctx(|| format!("mkdir {}", etc.display()))?;
            fs::set_permissions(&etc, fs::Permissions::from_mode(image_etc.mode() & 0o7777))
                .ctx(|| format!("chmod {}", etc.display()))?;
            std::os::unix::fs::lchown(&etc, Some(image_etc.uid()), Some(image_etc.gid()))
                .ctx(|| format!("chown {}", etc.display()))?;
        }
        Err(e) => {
            return Err(InitError::Io {
                what: format!("stat {}", etc.display()),
                source: e,
            })
        }
    }
    write_new(
        &etc.join("hostname"),
        &format!("{}\n", cfg.hostname),
        cfg.uid_base,
    )?;
    write_new(
        &etc.join("hosts"),
        &format!(
            "127.0.0.1\tlocalhost {0}\n::1\tlocalhost ip6-localhost ip6-loopback {0}\n",
            cfg.hostname
        ),
        cfg.uid_base,
    )?;
    if let Some(resolv) = &cfg.resolv_conf {
        write_new(&etc.join("resolv.conf"), resolv, cfg.uid_base)?;
    }
    Ok(true)
}

/// Stage 0's mounts, as host root in the sandbox's mount namespace: the overlay (its lowers
/// are under the host's 0700 image store; the files of /etc written into its upper directory
/// first), /dev with the host's device nodes, /tmp, the CA bundle, and the agent's binary at
/// [`AGENT_PATH`].
fn host_mounts(cfg: &InitConfig, exe: &Path) -> Result<(), InitError> {
    let upper = cfg.dir.join("upper");
    let work = cfg.dir.join("work");
    let root = cfg.dir.join("rootfs");
    let lowers: Vec<String> = cfg.lowers.iter().map(|p| p.display().to_string()).collect();
    let data = format!(
        "lowerdir={},upperdir={},workdir={}{}",
        lowers.join(":"),
        upper.display(),
        work.display(),
        if cfg.scratch { ",volatile" } else { "" }
    );
    // The kernel takes one page of mount options.
    if data.len() >= 4096 {
        return Err(InitError::Other(format!(
            "the image's {} layers do not fit in one overlay mount's options",
            cfg.lowers.len()
        )));
    }
    let etc_written = write_etc(cfg, &upper)?;
    mnt(
        Some("overlay"),
        &root,
        Some("overlay"),
        MsFlags::empty(),
        Some(&data),
    )?;
    build_dev(&root, cfg.uid_base, cfg.runtime.shm_size_bytes, cfg.scratch)?;
    // The agent's binary, read-only: what PID 1 execs, and what a checkpoint finds it mapped
    // from. Running it gives a sandbox process nothing (it serves only a listener it is given).
    // Not bound where PID 1 serves in process.
    if !cfg.scratch {
        bind_agent(&root, exe)?;
    }
    fs::create_dir_all(root.join("sys")).ctx(|| "mkdir /sys".into())?;
    fs::create_dir_all(root.join("proc")).ctx(|| "mkdir /proc".into())?;
    if let Some(size) = cfg.tmp_memory_bytes {
        let tmp = root.join("tmp");
        fs::create_dir_all(&tmp).ctx(|| "mkdir /tmp".into())?;
        mnt(
            Some("tmpfs"),
            &tmp,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some(&format!(
                "mode=1777,size={size},uid={0},gid={0}",
                cfg.uid_base
            )),
        )?;
    }
    crate::rtset::mount_tmpfs(&root, &cfg.runtime.tmpfs, cfg.uid_base)
        .map_err(|e| InitError::Other(e.to_string()))?;
    let etc = root.join("etc");
    if etc_written {
        if let Some(bundle) = &cfg.ca_bundle {
            // Only over a regular file of the image (lstat: a link is not followed out).
            let target = etc.join("ssl/certs/ca-certificates.crt");
            if fs::symlink_metadata(&target).is_ok_and(|m| m.file_type().is_file()) {
                mount(
                    Some(bundle.as_path()),
                    &target,
                    None::<&str>,
                    MsFlags::MS_BIND,
                    None::<&str>,
                )
                .ctx(|| format!("bind the CA bundle over {}", target.display()))?;
                mnt(
                    None,
                    &target,
                    None,
                    MsFlags::MS_BIND
                        | MsFlags::MS_REMOUNT
                        | MsFlags::MS_RDONLY
                        | MsFlags::MS_NOSUID
                        | MsFlags::MS_NODEV
                        | MsFlags::MS_NOEXEC,
                    None,
                )?;
            }
        }
    }
    crate::volume::mount_volumes(&root, cfg.uid_base, &cfg.volumes).ctx(|| "volumes".into())?;
    Ok(())
}

fn child_error(first: u8, from_child: &OwnedFd) -> InitError {
    if first != b'E' {
        return InitError::Other(format!("stage 1 said {first}"));
    }
    let mut rest = Vec::new();
    let mut f = fs::File::from(match from_child.try_clone() {
        Ok(f) => f,
        Err(e) => {
            return InitError::Io {
                what: "sync pipe".into(),
                source: e,
            }
        }
    });
    let _ = f.read_to_end(&mut rest);
    InitError::Other(String::from_utf8_lossy(&rest).into_owned())
}

/// Stage 1: enters the sandbox's user namespace first (joined with its network namespace, or
/// made), makes the other namespaces from inside it, so that it owns them all, waits for stage
/// 0's mounts, mounts /sys, and forks PID 1. Returns only an error.
fn stage1(
    cfg: &InitConfig,
    joined: Option<(OwnedFd, OwnedFd)>,
    from_parent: &OwnedFd,
    to_parent: &OwnedFd,
    in_process: impl FnOnce(UnixListener) -> std::convert::Infallible,
) -> Result<std::convert::Infallible, InitError> {
    // Still host root: from here on the root is reached relative to the sandbox's directory
    // (searchable, under the node's 0700 data directory, which sandbox root may not search).
    chdir(&cfg.dir).ctx(|| format!("chdir {}", cfg.dir.display()))?;
    let mut namespaces = CloneFlags::CLONE_NEWNS
        | CloneFlags::CLONE_NEWUTS
        | CloneFlags::CLONE_NEWIPC
        | CloneFlags::CLONE_NEWCGROUP;
    match joined {
        Some((user, net)) => {
            nix::sched::setns(&user, CloneFlags::CLONE_NEWUSER)
                .ctx(|| "join the sandbox's user namespace".into())?;
            nix::sched::setns(&net, CloneFlags::CLONE_NEWNET)
                .ctx(|| "join the sandbox's network namespace".into())?;
        }
        None => {
            unshare(CloneFlags::CLONE_NEWUSER).ctx(|| "unshare user".into())?;
            write_byte(to_parent, b"U")?;
            if read_byte(from_parent)? != b'G' {
                return Err(InitError::Other("uid map not written".into()));
            }
            namespaces |= CloneFlags::CLONE_NEWNET;
        }
    }
    nix::unistd::setgroups(&[]).ctx(|| "setgroups".into())?;
    nix::unistd::setresgid(Gid::from_raw(0), Gid::from_raw(0), Gid::from_raw(0))
        .ctx(|| "setresgid".into())?;
    nix::unistd::setresuid(Uid::from_raw(0), Uid::from_raw(0), Uid::from_raw(0))
        .ctx(|| "setresuid".into())?;
    unshare(namespaces).ctx(|| "unshare".into())?;
    mnt(
        None,
        Path::new("/"),
        None,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None,
    )?;
    sethostname(&cfg.hostname).ctx(|| "sethostname".into())?;
    loopback_up()?;
    write_byte(to_parent, b"M")?;
    let exec = match read_byte(from_parent)? {
        b'D' => true,
        b'd' => false,
        _ => return Err(InitError::Other("the root was not mounted".into())),
    };
    // sysfs shows the network namespace of who mounts it: this one's.
    mnt(
        Some("sysfs"),
        Path::new("rootfs/sys"),
        Some("sysfs"),
        MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None,
    )?;
    // Last: the PID namespace's first child is its PID 1.
    unshare(CloneFlags::CLONE_NEWPID).ctx(|| "unshare pid".into())?;
    let args = AgentArgs {
        hostname: cfg.hostname.clone(),
        image_env: cfg.image_env.clone(),
        image_user: cfg.image_user.clone(),
        image_workdir: cfg.image_workdir.clone(),
        rlimits: cfg.runtime.rlimits.clone(),
    };
    let args = serde_json::to_string(&args).map_err(|e| InitError::Other(e.to_string()))?;
    // SAFETY: stage 1 is single-threaded, so the child may run any code after fork.
    match unsafe { fork() }.ctx(|| "fork PID 1".into())? {
        ForkResult::Child => {
            let e = match stage2(Path::new("rootfs"), &args, &cfg.runtime, exec, in_process) {
                Ok(never) => match never {},
                Err(e) => e,
            };
            let msg = format!("E{e}");
            let _ = nix::unistd::write(to_parent, msg.as_bytes());
            std::process::exit(1);
        }
        ForkResult::Parent { child } => {
            let mut msg = vec![b'P'];
            msg.extend_from_slice(&(child.as_raw() as u32).to_le_bytes());
            write_byte(to_parent, &msg)?;
            std::process::exit(0);
        }
    }
}

/// Stage 2, PID 1 of the sandbox: a session of its own, /proc, the pivot into the root, the
/// agent's listening socket, the capability bounding set, the seccomp filter, then the exec of
/// the agent. Returns only an error.
// `in_process` never returns (its type is uninhabited): what follows its call is unreachable.
#[allow(unreachable_code)]
fn stage2(
    root: &Path,
    args: &str,
    runtime: &crate::rtset::RuntimeSettings,
    exec: bool,
    in_process: impl FnOnce(UnixListener) -> std::convert::Infallible,
) -> Result<std::convert::Infallible, InitError> {
    nix::unistd::setsid().ctx(|| "setsid".into())?;
    chdir(root).ctx(|| "chdir root".into())?;
    let proc_dir = Path::new("proc");
    mnt(
        Some("proc"),
        proc_dir,
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None,
    )?;
    let null = Path::new("dev/null");
    for masked in ["kcore", "keys", "timer_list", "sysrq-trigger"] {
        let p = proc_dir.join(masked);
        if p.exists() {
            mnt(
                Some(&null.to_string_lossy()),
                &p,
                None,
                MsFlags::MS_BIND,
                None,
            )?;
        }
    }
    pivot_root(".", ".").ctx(|| "pivot_root".into())?;
    umount2(".", MntFlags::MNT_DETACH).ctx(|| "detach old root".into())?;
    chdir("/").ctx(|| "chdir /".into())?;
    // Root of the sandbox's user namespace, capabilities still whole: its namespaces' sysctls.
    crate::rtset::write_sysctls(&runtime.sysctls).map_err(|e| InitError::Other(e.to_string()))?;

    // Bound and listening here, by the agent's own process: the node checks that the listener
    // it reaches is this pid's (SO_PEERCRED of a listener is its listen()er's).
    let listener =
        crate::sock::bind_abstract(AGENT_SOCKET).ctx(|| format!("bind @{AGENT_SOCKET}"))?;

    let keep: caps::CapsHashSet = KEEP_CAPS.iter().copied().collect();
    for cap in caps::all() {
        if !keep.contains(&cap) {
            caps::drop(None, caps::CapSet::Bounding, cap)
                .map_err(|e| InitError::Other(format!("drop {cap}: {e}")))?;
        }
    }
    caps::clear(None, caps::CapSet::Inheritable)
        .map_err(|e| InitError::Other(format!("inheritable caps: {e}")))?;
    // The filter goes in while CAP_SYS_ADMIN (of the sandbox's user namespace) is still
    // effective, which the kernel takes instead of no_new_privs: no_new_privs is not set, so
    // that a setuid file of the image (sudo, su, ping) raises a process of the sandbox to the
    // sandbox's root, as in Docker's default; never past the bounding set above, and only in
    // the sandbox's user namespace.
    crate::seccomp::install().map_err(|e| InitError::Other(e.to_string()))?;
    caps::set(None, caps::CapSet::Effective, &keep)
        .map_err(|e| InitError::Other(format!("effective caps: {e}")))?;
    caps::set(None, caps::CapSet::Permitted, &keep)
        .map_err(|e| InitError::Other(format!("permitted caps: {e}")))?;

    let devnull = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .ctx(|| "open /dev/null".into())?;
    for fd in 0..3 {
        // SAFETY: dup2 onto the standard descriptors; devnull stays open for the call.
        if unsafe { libc::dup2(devnull.as_raw_fd(), fd) } < 0 {
            return Err(InitError::Io {
                what: "dup2".into(),
                source: std::io::Error::last_os_error(),
            });
        }
    }
    drop(devnull);
    crate::process::move_to_inheritable(OwnedFd::from(listener), AGENT_LISTEN_FD)
        .ctx(|| "the agent's listener".into())?;
    // Every other descriptor (the pipe to stage 0 among them) closes at the exec.
    cloexec_from(AGENT_LISTEN_FD as u32 + 1)?;
    let prog = std::ffi::CString::new(AGENT_PATH).map_err(|e| InitError::Other(e.to_string()))?;
    let argv = [
        std::ffi::CString::new("sbx-agent").map_err(|e| InitError::Other(e.to_string()))?,
        std::ffi::CString::new("serve").map_err(|e| InitError::Other(e.to_string()))?,
        std::ffi::CString::new(args).map_err(|e| InitError::Other(e.to_string()))?,
    ];
    let env: [std::ffi::CString; 0] = [];
    let e = if exec {
        match nix::unistd::execve(&prog, &argv, &env) {
            Err(e) => e,
            Ok(never) => match never {},
        }
    } else {
        nix::Error::ENOEXEC
    };
    // An image that cannot run the agent's binary (no dynamic loader of the host's kind):
    // the agent runs on in this process, as it was forked. It serves the same, but it cannot
    // be checkpointed (its executable and mappings are the host's).
    if matches!(
        e,
        nix::Error::ENOENT | nix::Error::ENOEXEC | nix::Error::ELIBBAD | nix::Error::EACCES
    ) {
        // The pipe to stage 0 (and anything else) closes now, as the exec would have.
        close_from(AGENT_LISTEN_FD as u32 + 1)?;
        let listener = agent_listener()?;
        return Ok(in_process(listener));
    }
    Err(InitError::Io {
        what: format!("exec {AGENT_PATH}"),
        source: e.into(),
    })
}

/// Whether the image at `root` has the shared libraries the agent's binary runs with (this
/// process's, from its maps), each the same size as the host's: then PID 1 execs the agent
/// from inside (checkpointable); else it serves in process (an image without the host's
/// glibc, such as a minimal one). A statically linked agent (release builds, see
/// scripts/lib.sh) maps no shared library: every image runs it.
fn image_runs_agent(root: &Path) -> bool {
    let Ok(maps) = fs::read_to_string("/proc/self/maps") else {
        return false;
    };
    let mut libs: Vec<&str> = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .filter(|p| p.starts_with('/') && p.contains(".so"))
        .collect();
    libs.sort_unstable();
    libs.dedup();
    libs.iter().all(|lib| {
        let host = fs::metadata(lib).map(|m| m.len());
        let image = fs::metadata(root.join(lib.trim_start_matches('/'))).map(|m| m.len());
        matches!((host, image), (Ok(a), Ok(b)) if a == b)
    })
}

/// Closes every descriptor from `from` up. Only in stage 2 before it runs the agent in
/// process, which never returns to the frames that own them.
fn close_from(from: u32) -> Result<(), InitError> {
    // SAFETY: the descriptors closed are owned by frames this process never returns to (it
    // serves until it exits), so no owner uses or closes them again.
    let r = unsafe { libc::syscall(libc::SYS_close_range, from, u32::MAX, 0u32) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error()).ctx(|| "close descriptors".into())
    }
}

/// The agent's side after its exec: its listening socket (close-on-exec from now on, so no
/// command of the sandbox gets it), and the agent made not dumpable at once (see
/// [`crate::process::set_dumpable`]).
pub fn agent_listener() -> Result<UnixListener, InitError> {
    crate::process::set_dumpable(false).ctx(|| "not dumpable".into())?;
    crate::process::take_inherited_listener(AGENT_LISTEN_FD).ctx(|| "the inherited listener".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn config(lowers: &[&Path], hostname: &str) -> InitConfig {
        serde_json::from_value(serde_json::json!({
            "id": hostname, "lowers": lowers, "dir": "/nonexistent", "hostname": hostname,
            "uid_base": 100_000, "uid_count": 65_536, "cgroup_procs": [],
            "tmp_memory_bytes": null, "resolv_conf": "nameserver 10.0.0.1\n",
        }))
        .expect("a config")
    }

    /// /etc's files go into the upper directory: a new upper /etc takes the image's mode and
    /// owner, an existing one (a sandbox booted again) has them replaced; an image without an
    /// /etc, or an upper directory that removed it, gets none.
    #[test]
    fn etc_files_are_written_into_the_upper_directory() {
        if !nix::unistd::Uid::effective().is_root() {
            return;
        }
        let dir = crate::TempDir::new("write-etc");
        let (top, bottom, upper) = (
            dir.path().join("top"),
            dir.path().join("bottom"),
            dir.path().join("upper"),
        );
        for d in [&top, &bottom, &upper] {
            fs::create_dir(d).unwrap();
        }
        // The topmost layer with an /etc decides its mode and owner.
        fs::create_dir(bottom.join("etc")).unwrap();
        fs::set_permissions(bottom.join("etc"), fs::Permissions::from_mode(0o750)).unwrap();
        std::os::unix::fs::lchown(bottom.join("etc"), Some(100_000), Some(100_007)).unwrap();
        let cfg = config(&[&top, &bottom], "box-1");
        assert!(write_etc(&cfg, &upper).unwrap());
        let etc = fs::metadata(upper.join("etc")).unwrap();
        assert_eq!(
            (etc.mode() & 0o7777, etc.uid(), etc.gid()),
            (0o750, 100_000, 100_007)
        );
        let read = |f: &str| fs::read_to_string(upper.join("etc").join(f)).unwrap();
        assert_eq!(read("hostname"), "box-1\n");
        assert!(read("hosts").contains("localhost box-1\n"));
        assert_eq!(read("resolv.conf"), "nameserver 10.0.0.1\n");
        let owner = fs::metadata(upper.join("etc/hostname")).unwrap();
        assert_eq!((owner.uid(), owner.gid()), (100_000, 100_000));

        // Booted again under another name: the upper /etc is kept, its files replaced.
        assert!(write_etc(&config(&[&top, &bottom], "box-2"), &upper).unwrap());
        assert_eq!(read("hostname"), "box-2\n");

        // Removed in the upper directory (a whiteout, or a file): nothing written.
        fs::remove_dir_all(upper.join("etc")).unwrap();
        fs::write(upper.join("etc"), "").unwrap();
        assert!(!write_etc(&cfg, &upper).unwrap());
        // No /etc in the image: nothing either.
        let bare = dir.path().join("bare-upper");
        fs::create_dir(&bare).unwrap();
        assert!(!write_etc(&config(&[&top], "box-3"), &bare).unwrap());
        assert!(!bare.join("etc").exists());
    }
}
