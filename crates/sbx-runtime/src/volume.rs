//! Volumes in a sandbox: each a directory of the host (a subvolume of the node's disk,
//! [`crate::diskfs`]) bound at its path by stage 0 of init, as host root in the sandbox's
//! mount namespace, after the overlay and before the sandbox runs anything (as the CA bundle
//! is). The path is resolved inside the sandbox's root (`openat2` with `RESOLVE_IN_ROOT`: an
//! image's symlink cannot send it out to the host), its missing directories made and given to
//! the sandbox's root. A new volume given `copy` first gets what the image has there
//! ([`crate::tree::copy_into`]: owners, modes, times, xattrs, symlinks, hard links).

use std::fs;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::mount::{mount, MsFlags};
use rustix::fs::{Mode, OFlags, ResolveFlags};

/// A volume to mount in a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VolumeBind {
    /// The volume's directory on the host.
    pub host: PathBuf,
    /// Where in the sandbox (absolute, normalized: no `.`, `..` or empty component).
    pub path: String,
    pub read_only: bool,
    /// An empty volume is first given what the image has at `path`.
    pub copy: bool,
}

fn ctx(what: String) -> impl FnOnce(io::Error) -> io::Error {
    move |e| io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// Mounts `vols` under `root` (the sandbox's root before pivot_root, in its mount namespace);
/// directories made on the way are owned by `uid_base` (the sandbox's root).
pub fn mount_volumes(root: &Path, uid_base: u32, vols: &[VolumeBind]) -> io::Result<()> {
    if vols.is_empty() {
        return Ok(());
    }
    let root_fd = rustix::fs::open(
        root,
        OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    for v in vols {
        let target = dir_in_root(&root_fd, &v.path, uid_base)
            .map_err(ctx(format!("the volume's path {}", v.path)))?;
        let at = PathBuf::from(format!("/proc/self/fd/{}", target.as_raw_fd()));
        if v.copy && is_empty(&v.host)? {
            // `/.` past the descriptor's magic link: the directory, not the link.
            crate::tree::copy_into(&at.join("."), &v.host)
                .map_err(ctx(format!("copy the image's {} into the volume", v.path)))?;
        }
        mount(
            Some(v.host.as_path()),
            &at,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .map_err(|e| ctx(format!("bind the volume at {}", v.path))(e.into()))?;
        let mut flags =
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        if v.read_only {
            flags |= MsFlags::MS_RDONLY;
        }
        // The new mount is the topmost at the path now: remount through the path, resolved in
        // the root again.
        let mounted = dir_in_root(&root_fd, &v.path, uid_base)?;
        let at = PathBuf::from(format!("/proc/self/fd/{}", mounted.as_raw_fd()));
        mount(None::<&str>, &at, None::<&str>, flags, None::<&str>)
            .map_err(|e| ctx(format!("remount the volume at {}", v.path))(e.into()))?;
    }
    Ok(())
}

fn is_empty(dir: &Path) -> io::Result<bool> {
    Ok(fs::read_dir(dir)
        .map_err(ctx(format!("read {}", dir.display())))?
        .next()
        .is_none())
}

/// Opens the directory `path` inside `root` (symlinks resolved as if `root` were `/`), making
/// each missing component (mode 0755, owned by `uid_base`).
fn dir_in_root(root: &OwnedFd, path: &str, uid_base: u32) -> io::Result<OwnedFd> {
    let how = ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS;
    let flags = OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC;
    let mut so_far = String::from("/");
    let mut cur = rustix::fs::openat2(root, "/", flags, Mode::empty(), how)?;
    for comp in path.split('/').filter(|c| !c.is_empty()) {
        so_far.push_str(comp);
        match rustix::fs::openat2(root, so_far.as_str(), flags, Mode::empty(), how) {
            Ok(fd) => cur = fd,
            Err(rustix::io::Errno::NOENT) => {
                // A dangling symlink is not followed into being: mkdirat on its name fails.
                rustix::fs::mkdirat(&cur, comp, Mode::from_raw_mode(0o755))?;
                rustix::fs::chownat(
                    &cur,
                    comp,
                    Some(rustix::fs::Uid::from_raw(uid_base)),
                    Some(rustix::fs::Gid::from_raw(uid_base)),
                    rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
                )?;
                cur = rustix::fs::openat2(root, so_far.as_str(), flags, Mode::empty(), how)?;
            }
            Err(e) => return Err(e.into()),
        }
        so_far.push('/');
    }
    Ok(cur)
}
