//! Making a sandbox from the inside: the two first stages of `sbx-agent init`.
//!
//! Stage 0 runs as host root in the host's namespaces. It joins the sandbox's cgroups, binds the
//! agent's socket on the host (so the node can connect at once, and again after its own restart),
//! unshares the mount, UTS, IPC, network, PID and cgroup namespaces (or, for the network, joins
//! the one the node prepared: `InitConfig::netns`), and builds the root: an
//! overlay of the image (lower) and the sandbox's upper directory, a minimal /dev, /sys read-only.
//! It then forks stage 1, which is PID 1 of the new PID namespace: it mounts /proc, pivots into
//! the root, unshares a user namespace (stage 0 writes its uid and gid maps: sandbox root is the
//! host's `uid_base`), becomes root in it, bounds its capabilities, sets no_new_privs, installs
//! the seccomp filter, and returns to the caller as the agent. Stage 0 prints the agent's host pid
//! and exits.
//!
//! Every mount is made in the sandbox's own mount namespace: when its last process is gone, so
//! are its mounts. Nothing is mounted in the host's namespace.

use std::fs;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{symlink, OpenOptionsExt};
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

/// Joins the network namespace at `path` (before the other namespaces are unshared: the
/// sandbox's user namespace, made later, does not own it, as it does not own one unshared
/// here).
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

fn build_dev(root: &Path, base: u32) -> Result<(), InitError> {
    let dev = root.join("dev");
    fs::create_dir_all(&dev).ctx(|| "mkdir /dev".into())?;
    let owner = format!("uid={base},gid={base}");
    mnt(
        Some("tmpfs"),
        &dev,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_STRICTATIME,
        Some(&format!("mode=755,size=65536k,{owner}")),
    )?;
    for name in ["null", "zero", "full", "random", "urandom", "tty"] {
        let target = dev.join(name);
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
    mnt(
        Some("shm"),
        &shm,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(&format!("mode=1777,size=65536k,{owner}")),
    )?;
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

/// Runs stage 0 and stage 1. Returns only in stage 1, as the agent, with its listening socket;
/// stage 0 prints `pid N` (the agent's host pid) on stdout and exits the process.
pub fn enter(cfg: &InitConfig) -> Result<UnixListener, InitError> {
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
    // The upper directory is the sandbox root's own /.
    std::os::unix::fs::chown(&upper, Some(cfg.uid_base), Some(cfg.uid_base))
        .ctx(|| "chown upper".into())?;
    let sock = cfg.dir.join("agent.sock");
    let _ = fs::remove_file(&sock);
    let listener = UnixListener::bind(&sock).ctx(|| format!("bind {}", sock.display()))?;

    let mut namespaces = CloneFlags::CLONE_NEWNS
        | CloneFlags::CLONE_NEWUTS
        | CloneFlags::CLONE_NEWIPC
        | CloneFlags::CLONE_NEWPID
        | CloneFlags::CLONE_NEWCGROUP;
    match &cfg.netns {
        Some(path) => join_netns(path)?,
        None => namespaces |= CloneFlags::CLONE_NEWNET,
    }
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

    if cfg.lowers.is_empty() {
        return Err(InitError::Other("the image has no layer".into()));
    }
    let lowers: Vec<String> = cfg.lowers.iter().map(|p| p.display().to_string()).collect();
    let data = format!(
        "lowerdir={},upperdir={},workdir={}",
        lowers.join(":"),
        upper.display(),
        work.display()
    );
    // The kernel takes one page of mount options.
    if data.len() >= 4096 {
        return Err(InitError::Other(format!(
            "the image's {} layers do not fit in one overlay mount's options",
            cfg.lowers.len()
        )));
    }
    mnt(
        Some("overlay"),
        &root,
        Some("overlay"),
        MsFlags::empty(),
        Some(&data),
    )?;
    build_dev(&root, cfg.uid_base)?;
    let sys = root.join("sys");
    fs::create_dir_all(&sys).ctx(|| "mkdir /sys".into())?;
    mnt(
        Some("sysfs"),
        &sys,
        Some("sysfs"),
        MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None,
    )?;
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
    let etc = root.join("etc");
    if etc.is_dir() {
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

    // Stage 1's pivot_root moves every process of this mount namespace, stage 0 too: keep a
    // handle on the host's /proc to write stage 1's maps through.
    let host_proc = fs::File::open("/proc").ctx(|| "open /proc".into())?;
    let (to_child_r, to_child_w) = nix::unistd::pipe().ctx(|| "pipe".into())?;
    let (to_parent_r, to_parent_w) = nix::unistd::pipe().ctx(|| "pipe".into())?;
    // SAFETY: stage 0 is single-threaded (the agent binary has started no thread yet), so the
    // child may run any code after fork.
    match unsafe { fork() }.ctx(|| "fork".into())? {
        ForkResult::Child => {
            drop(to_child_w);
            drop(to_parent_r);
            match stage1(&root, &to_child_r, &to_parent_w) {
                Ok(()) => {
                    write_byte(&to_parent_w, b"R")?;
                    Ok(listener)
                }
                Err(e) => {
                    let msg = format!("E{e}");
                    let _ = nix::unistd::write(&to_parent_w, msg.as_bytes());
                    std::process::exit(1);
                }
            }
        }
        ForkResult::Parent { child } => {
            drop(listener);
            drop(to_child_r);
            drop(to_parent_w);
            let result = stage0_parent(
                cfg,
                &host_proc,
                child.as_raw() as u32,
                &to_child_w,
                &to_parent_r,
            );
            match result {
                Ok(()) => {
                    let mut out = std::io::stdout();
                    let _ = writeln!(out, "pid {}", child.as_raw());
                    let _ = out.flush();
                    std::process::exit(0);
                }
                Err(e) => {
                    crate::process::kill_pid(child.as_raw() as u32, libc::SIGKILL);
                    Err(e)
                }
            }
        }
    }
}

fn write_at(dir: &fs::File, path: &str, contents: &str) -> Result<(), InitError> {
    use nix::fcntl::{openat, OFlag};
    use nix::sys::stat::Mode;
    let fd = openat(dir, path, OFlag::O_WRONLY | OFlag::O_CLOEXEC, Mode::empty())
        .ctx(|| format!("open {path}"))?;
    let mut f = fs::File::from(fd);
    f.write_all(contents.as_bytes())
        .ctx(|| format!("write {path}"))
}

fn stage0_parent(
    cfg: &InitConfig,
    host_proc: &fs::File,
    child: u32,
    to_child: &OwnedFd,
    from_child: &OwnedFd,
) -> Result<(), InitError> {
    let b = read_byte(from_child)?;
    if b == b'U' {
        let map = format!("0 {} {}\n", cfg.uid_base, cfg.uid_count);
        write_at(host_proc, &format!("{child}/uid_map"), &map)?;
        write_at(host_proc, &format!("{child}/gid_map"), &map)?;
        write_byte(to_child, b"G")?;
        let b = read_byte(from_child)?;
        if b == b'R' {
            return Ok(());
        }
        return Err(child_error(b, from_child));
    }
    Err(child_error(b, from_child))
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

fn stage1(root: &Path, from_parent: &OwnedFd, to_parent: &OwnedFd) -> Result<(), InitError> {
    let proc_dir = root.join("proc");
    fs::create_dir_all(&proc_dir).ctx(|| "mkdir /proc".into())?;
    mnt(
        Some("proc"),
        &proc_dir,
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None,
    )?;
    let null = root.join("dev/null");
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
    chdir(root).ctx(|| "chdir root".into())?;
    pivot_root(".", ".").ctx(|| "pivot_root".into())?;
    umount2(".", MntFlags::MNT_DETACH).ctx(|| "detach old root".into())?;
    chdir("/").ctx(|| "chdir /".into())?;

    unshare(CloneFlags::CLONE_NEWUSER).ctx(|| "unshare user".into())?;
    write_byte(to_parent, b"U")?;
    if read_byte(from_parent)? != b'G' {
        return Err(InitError::Other("uid map not written".into()));
    }
    nix::unistd::setgroups(&[]).ctx(|| "setgroups".into())?;
    nix::unistd::setresgid(Gid::from_raw(0), Gid::from_raw(0), Gid::from_raw(0))
        .ctx(|| "setresgid".into())?;
    nix::unistd::setresuid(Uid::from_raw(0), Uid::from_raw(0), Uid::from_raw(0))
        .ctx(|| "setresuid".into())?;

    let keep: caps::CapsHashSet = KEEP_CAPS.iter().copied().collect();
    for cap in caps::all() {
        if !keep.contains(&cap) {
            caps::drop(None, caps::CapSet::Bounding, cap)
                .map_err(|e| InitError::Other(format!("drop {cap}: {e}")))?;
        }
    }
    caps::clear(None, caps::CapSet::Inheritable)
        .map_err(|e| InitError::Other(format!("inheritable caps: {e}")))?;
    caps::set(None, caps::CapSet::Effective, &keep)
        .map_err(|e| InitError::Other(format!("effective caps: {e}")))?;
    caps::set(None, caps::CapSet::Permitted, &keep)
        .map_err(|e| InitError::Other(format!("permitted caps: {e}")))?;
    // The agent is not dumpable: a process of the sandbox (which has no CAP_SYS_PTRACE) can
    // neither ptrace it nor read its memory or its descriptors (the node's socket) in /proc.
    // Commands it starts are dumpable again when they exec.
    // SAFETY: PR_SET_DUMPABLE takes integer arguments and touches no memory.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        return Err(InitError::Io {
            what: "not dumpable".into(),
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: PR_SET_NO_NEW_PRIVS takes integer arguments and touches no memory.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(InitError::Io {
            what: "no_new_privs".into(),
            source: std::io::Error::last_os_error(),
        });
    }
    crate::seccomp::install().map_err(|e| InitError::Other(e.to_string()))?;

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
    Ok(())
}
