//! A sandbox's runtime settings (issue #16): resource limits of its commands, sysctls of its
//! own namespaces, tmpfs mounts and the size of /dev/shm. What init does with them:
//!
//! - **Limits** ([`Rlimit`]) are the commands' ones, not the agent's: the agent (PID 1) keeps
//!   the node's limits and each command's child sets its own with `prlimit` just before its
//!   exec ([`crate::process::SpawnSpec::rlimits`]), so a sandbox with `nofile: 64` or
//!   `nproc: 20` still has an agent that can hold its connections, pipes and threads (a limit
//!   set on PID 1 would bind the agent too; nproc counts its threads). Stage 0, host root,
//!   first raises the hard limits the commands are to get above the node's own
//!   ([`raise_hard_limits`]): only it may (CAP_SYS_RESOURCE of the host), and a child can only
//!   lower its hard limit.
//! - **Sysctls** are written by PID 1 through its own /proc before it drops its capabilities
//!   ([`write_sysctls`]): it is root of the sandbox's user namespace, which owns the sandbox's
//!   network and IPC namespaces, so the kernel lets it write their settings (and nothing
//!   else's: a sysctl that is not of those namespaces has no file there or is read-only).
//! - **tmpfs** mounts are made by stage 0 in the sandbox's mount namespace beside the /tmp of
//!   `tmp: memory` ([`mount_tmpfs`]), each path resolved inside the sandbox's root
//!   (`openat2` with `RESOLVE_IN_ROOT`: a symlink of the image cannot lead outside), nosuid
//!   and nodev, owned by sandbox root.
//! - **/dev/shm** is a tmpfs of the given size ([`shm_size`]); without a size, a directory of
//!   /dev's tmpfs (as large as Docker's /dev/shm).

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;

use nix::mount::MsFlags;
use serde::{Deserialize, Serialize};

/// /dev/shm's size when none is given (Docker's: 64 MiB).
pub const DEFAULT_SHM_BYTES: u64 = 64 << 20;

/// A sandbox's runtime settings, as init is told them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeSettings {
    /// The limits of every command of the sandbox.
    #[serde(default)]
    pub rlimits: Vec<Rlimit>,
    /// Sysctls by dotted name (`net.ipv4.ip_unprivileged_port_start`), written in order.
    #[serde(default)]
    pub sysctls: Vec<(String, String)>,
    #[serde(default)]
    pub tmpfs: Vec<Tmpfs>,
    /// /dev/shm's size; `None`: [`DEFAULT_SHM_BYTES`].
    #[serde(default)]
    pub shm_size_bytes: Option<u64>,
}

impl RuntimeSettings {
    pub fn is_empty(&self) -> bool {
        self.rlimits.is_empty()
            && self.sysctls.is_empty()
            && self.tmpfs.is_empty()
            && self.shm_size_bytes.is_none()
    }

    /// Whether a sysctl of the network namespace is set (a leased namespace that had one
    /// written is not given to another sandbox).
    pub fn sets_net_sysctls(&self) -> bool {
        self.sysctls.iter().any(|(k, _)| k.starts_with("net."))
    }
}

/// A resource limit by Docker's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Resource {
    Core,
    Cpu,
    Data,
    Fsize,
    Locks,
    Memlock,
    Msgqueue,
    Nice,
    Nofile,
    Nproc,
    Rss,
    Rtprio,
    Rttime,
    Sigpending,
    Stack,
    As,
}

impl Resource {
    /// The resource of Docker's `name` (`nofile`, `nproc`, ...).
    pub fn from_name(name: &str) -> Option<Resource> {
        use Resource::*;
        Some(match name {
            "core" => Core,
            "cpu" => Cpu,
            "data" => Data,
            "fsize" => Fsize,
            "locks" => Locks,
            "memlock" => Memlock,
            "msgqueue" => Msgqueue,
            "nice" => Nice,
            "nofile" => Nofile,
            "nproc" => Nproc,
            "rss" => Rss,
            "rtprio" => Rtprio,
            "rttime" => Rttime,
            "sigpending" => Sigpending,
            "stack" => Stack,
            "as" => As,
            _ => return None,
        })
    }

    /// Docker's name of it.
    pub fn name(self) -> &'static str {
        use Resource::*;
        match self {
            Core => "core",
            Cpu => "cpu",
            Data => "data",
            Fsize => "fsize",
            Locks => "locks",
            Memlock => "memlock",
            Msgqueue => "msgqueue",
            Nice => "nice",
            Nofile => "nofile",
            Nproc => "nproc",
            Rss => "rss",
            Rtprio => "rtprio",
            Rttime => "rttime",
            Sigpending => "sigpending",
            Stack => "stack",
            As => "as",
        }
    }

    /// The highest hard limit this process can give its children's commands (`None`: no
    /// bound): with CAP_SYS_RESOURCE any (nofile up to fs.nr_open, which the API's range
    /// keeps to); without it (a node in a container that lacks it), its own hard limit.
    pub fn ceiling(self) -> Option<u64> {
        let can_raise = caps::has_cap(
            None,
            caps::CapSet::Effective,
            caps::Capability::CAP_SYS_RESOURCE,
        )
        .unwrap_or(false);
        if can_raise {
            return None;
        }
        match getrlimit(self.raw()) {
            Ok(l) if l.rlim_max != u64::MAX => Some(l.rlim_max),
            Ok(_) => None,
            Err(_) => Some(0),
        }
    }

    /// The kernel's number of it (`RLIMIT_*`).
    pub(crate) fn raw(self) -> libc::c_int {
        use Resource::*;
        (match self {
            Core => libc::RLIMIT_CORE,
            Cpu => libc::RLIMIT_CPU,
            Data => libc::RLIMIT_DATA,
            Fsize => libc::RLIMIT_FSIZE,
            Locks => libc::RLIMIT_LOCKS,
            Memlock => libc::RLIMIT_MEMLOCK,
            Msgqueue => libc::RLIMIT_MSGQUEUE,
            Nice => libc::RLIMIT_NICE,
            Nofile => libc::RLIMIT_NOFILE,
            Nproc => libc::RLIMIT_NPROC,
            Rss => libc::RLIMIT_RSS,
            Rtprio => libc::RLIMIT_RTPRIO,
            Rttime => libc::RLIMIT_RTTIME,
            Sigpending => libc::RLIMIT_SIGPENDING,
            Stack => libc::RLIMIT_STACK,
            As => libc::RLIMIT_AS,
        }) as libc::c_int
    }
}

/// One limit; `None` is none (`RLIM_INFINITY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rlimit {
    pub resource: Resource,
    pub soft: Option<u64>,
    pub hard: Option<u64>,
}

impl Rlimit {
    /// As the kernel takes it.
    pub(crate) fn raw(&self) -> (libc::c_int, libc::rlimit64) {
        (
            self.resource.raw(),
            libc::rlimit64 {
                rlim_cur: self.soft.unwrap_or(u64::MAX),
                rlim_max: self.hard.unwrap_or(u64::MAX),
            },
        )
    }
}

/// A tmpfs mounted at `path` in the sandbox (nosuid, nodev).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tmpfs {
    /// Absolute, inside the sandbox's root.
    pub path: String,
    /// `None`: the kernel's default.
    pub size_bytes: Option<u64>,
    /// Its root's mode (0o1777: everybody's, sticky).
    pub mode: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum RtsetError {
    #[error("ulimit {}: {source}", resource.name())]
    Limit {
        resource: Resource,
        #[source]
        source: std::io::Error,
    },
    #[error("sysctl {name}: {why}")]
    Sysctl { name: String, why: String },
    #[error("tmpfs at {path}: {why}")]
    Tmpfs { path: String, why: String },
}

fn getrlimit(resource: libc::c_int) -> std::io::Result<libc::rlimit64> {
    let mut old = libc::rlimit64 {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: prlimit64 on this process (pid 0) with no new limit writes only `old`, a live
    // local of the right type.
    let r = unsafe {
        libc::syscall(
            libc::SYS_prlimit64,
            0,
            resource,
            std::ptr::null::<libc::rlimit64>(),
            &mut old as *mut libc::rlimit64,
        )
    };
    if r == 0 {
        Ok(old)
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn setrlimit(resource: libc::c_int, new: &libc::rlimit64) -> std::io::Result<()> {
    // SAFETY: prlimit64 on this process reads only `new`, a live value of the right type.
    let r = unsafe {
        libc::syscall(
            libc::SYS_prlimit64,
            0,
            resource,
            new as *const libc::rlimit64,
            std::ptr::null_mut::<libc::rlimit64>(),
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Stage 0 (host root): raises this process's hard limits to those of `limits` that are
/// higher, its soft ones unchanged, so that the agent it becomes may give its commands those
/// limits (a process without CAP_SYS_RESOURCE can lower a hard limit, not raise it).
pub fn raise_hard_limits(limits: &[Rlimit]) -> Result<(), RtsetError> {
    for l in limits {
        let (resource, want) = l.raw();
        let err = |source| RtsetError::Limit {
            resource: l.resource,
            source,
        };
        let now = getrlimit(resource).map_err(err)?;
        if want.rlim_max > now.rlim_max {
            let new = libc::rlimit64 {
                rlim_cur: now.rlim_cur,
                rlim_max: want.rlim_max,
            };
            setrlimit(resource, &new).map_err(err)?;
        }
    }
    Ok(())
}

/// The file of a sysctl under /proc/sys (`net.ipv4.ip_forward` -> `net/ipv4/ip_forward`);
/// `None` for a name that is not words of letters, digits, `_` and `-` between dots.
fn sysctl_path(name: &str) -> Option<String> {
    let ok = !name.is_empty()
        && name.split('.').all(|c| {
            !c.is_empty()
                && c.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        });
    ok.then(|| format!("/proc/sys/{}", name.replace('.', "/")))
}

/// PID 1, root of the sandbox's user namespace with its capabilities, after it mounted its
/// /proc: writes each sysctl (of the namespaces it is in). A name with no file there (not a
/// setting of those namespaces) or that the kernel refuses fails the sandbox.
pub fn write_sysctls(sysctls: &[(String, String)]) -> Result<(), RtsetError> {
    for (name, value) in sysctls {
        let bad = |why: String| RtsetError::Sysctl {
            name: name.clone(),
            why,
        };
        let path = sysctl_path(name).ok_or_else(|| bad("not a sysctl's name".into()))?;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => {
                    bad("not a setting of the sandbox's own namespaces".into())
                }
                std::io::ErrorKind::PermissionDenied => bad(
                    "read-only in the sandbox's namespaces (a setting of the host's alone)".into(),
                ),
                _ => bad(e.to_string()),
            })?;
        use std::io::Write;
        (&f).write_all(value.as_bytes())
            .map_err(|e| bad(format!("the kernel refused {value:?}: {e}")))?;
    }
    Ok(())
}

use std::os::unix::fs::OpenOptionsExt;

/// After a restore (a wake, a copy): CRIU makes the network namespace again with few of its
/// settings, so the net sysctls are written again, in the namespace of the agent `handle`
/// (a pidfd) names, from a thread of the host's root joined to it. The IPC namespace's are
/// CRIU's to restore (it does).
pub fn restore_net_sysctls(
    handle: OwnedFd,
    sysctls: &[(String, String)],
) -> Result<(), RtsetError> {
    let net: Vec<(String, String)> = sysctls
        .iter()
        .filter(|(k, _)| k.starts_with("net."))
        .cloned()
        .collect();
    if net.is_empty() {
        return Ok(());
    }
    crate::netns::in_netns_of_handle(handle, move || {
        write_sysctls(&net).map_err(|e| std::io::Error::other(e.to_string()))
    })
    .map_err(|e| RtsetError::Sysctl {
        name: "net.*".into(),
        why: format!("after a restore: {e}"),
    })
}

/// The mount options of /dev/shm (mode 1777, owned by sandbox root `base`).
pub fn shm_options(size_bytes: Option<u64>, base: u32) -> String {
    format!(
        "mode=1777,size={},uid={base},gid={base}",
        size_bytes.unwrap_or(DEFAULT_SHM_BYTES)
    )
}

/// Opens (making what is missing, owned by sandbox root `owner`, mode 0755) the directory
/// `path` inside `root`, every component resolved as inside the sandbox (`RESOLVE_IN_ROOT`:
/// `..` and symlinks stay under `root`; no magic links).
fn open_dir_in_root(root: &OwnedFd, path: &str, owner: u32) -> Result<OwnedFd, String> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    let how = ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS;
    let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
    let mut dir = rustix::fs::openat2(root, ".", flags, Mode::empty(), how)
        .map_err(|e| format!("the root: {e}"))?;
    let mut so_far = String::new();
    for comp in path.split('/').filter(|c| !c.is_empty()) {
        so_far.push('/');
        so_far.push_str(comp);
        let opened = match rustix::fs::openat2(root, so_far.as_str(), flags, Mode::empty(), how) {
            Err(rustix::io::Errno::NOENT) => {
                // The parent (resolved in the root) gets the missing directory; a dangling
                // symlink there makes mkdirat fail (EEXIST).
                match rustix::fs::mkdirat(&dir, comp, Mode::from_raw_mode(0o755)) {
                    Ok(()) => {
                        rustix::fs::chownat(
                            &dir,
                            comp,
                            Some(rustix::fs::Uid::from_raw(owner)),
                            Some(rustix::fs::Gid::from_raw(owner)),
                            rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
                        )
                        .map_err(|e| format!("chown {so_far}: {e}"))?;
                    }
                    Err(rustix::io::Errno::EXIST) => {}
                    Err(e) => return Err(format!("mkdir {so_far}: {e}")),
                }
                rustix::fs::openat2(root, so_far.as_str(), flags, Mode::empty(), how)
            }
            other => other,
        };
        dir = opened.map_err(|e| format!("{so_far}: {e}"))?;
    }
    Ok(dir)
}

/// Stage 0 (host root, in the sandbox's mount namespace, its root mounted at `root`): mounts
/// each tmpfs, nosuid and nodev, owned by sandbox root `base`, a parent before what is under
/// it.
pub fn mount_tmpfs(root: &Path, mounts: &[Tmpfs], base: u32) -> Result<(), RtsetError> {
    let mut order: Vec<&Tmpfs> = mounts.iter().collect();
    order.sort_by_key(|t| t.path.matches('/').count());
    for t in order {
        let bad = |why: String| RtsetError::Tmpfs {
            path: t.path.clone(),
            why,
        };
        let root_fd: OwnedFd = std::fs::File::open(root)
            .map_err(|e| bad(format!("open the root: {e}")))?
            .into();
        let dir = open_dir_in_root(&root_fd, &t.path, base).map_err(bad)?;
        // mount(2) follows the descriptor's magic link to the directory it names.
        let target = format!("/proc/self/fd/{}", dir.as_fd().as_raw_fd());
        let mut data = format!("mode={:o},uid={base},gid={base}", t.mode & 0o7777);
        if let Some(size) = t.size_bytes {
            data.push_str(&format!(",size={size}"));
        }
        let data = CString::new(data).map_err(|e| bad(e.to_string()))?;
        nix::mount::mount(
            Some("tmpfs"),
            target.as_str(),
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some(data.as_c_str()),
        )
        .map_err(|e| bad(format!("mount: {e}")))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sysctl_names_become_paths_under_proc_sys() {
        assert_eq!(
            sysctl_path("net.ipv4.ip_unprivileged_port_start").as_deref(),
            Some("/proc/sys/net/ipv4/ip_unprivileged_port_start")
        );
        assert_eq!(
            sysctl_path("kernel.shmmax").as_deref(),
            Some("/proc/sys/kernel/shmmax")
        );
        for bad in ["", "net..x", "net.../x", "net/ipv4", "a.b c", ".net"] {
            assert_eq!(sysctl_path(bad), None, "{bad}");
        }
    }

    #[test]
    fn docker_names_are_the_kernel_resources() {
        assert_eq!(
            Resource::from_name("nofile").map(Resource::raw),
            Some(libc::RLIMIT_NOFILE as libc::c_int)
        );
        assert_eq!(
            Resource::from_name("as").map(Resource::raw),
            Some(libc::RLIMIT_AS as libc::c_int)
        );
        assert_eq!(Resource::from_name("files"), None);
        let l = Rlimit {
            resource: Resource::Core,
            soft: Some(0),
            hard: None,
        };
        let (_, raw) = l.raw();
        assert_eq!((raw.rlim_cur, raw.rlim_max), (0, u64::MAX));
        let json = serde_json::to_string(&l).unwrap();
        assert_eq!(json, r#"{"resource":"core","soft":0,"hard":null}"#);
    }

    #[test]
    fn raising_to_what_is_already_allowed_changes_nothing() {
        let now = getrlimit(libc::RLIMIT_NOFILE as libc::c_int).unwrap();
        raise_hard_limits(&[Rlimit {
            resource: Resource::Nofile,
            soft: Some(1),
            hard: Some(1),
        }])
        .unwrap();
        let after = getrlimit(libc::RLIMIT_NOFILE as libc::c_int).unwrap();
        assert_eq!(
            (now.rlim_cur, now.rlim_max),
            (after.rlim_cur, after.rlim_max)
        );
    }

    #[test]
    fn shm_options_default_to_docker_size() {
        assert_eq!(
            shm_options(None, 100000),
            "mode=1777,size=67108864,uid=100000,gid=100000"
        );
        assert_eq!(
            shm_options(Some(1 << 20), 5),
            "mode=1777,size=1048576,uid=5,gid=5"
        );
    }
}
