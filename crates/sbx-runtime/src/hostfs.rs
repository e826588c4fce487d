//! Host-side file helpers of the node: an exclusive lock held for the node's life (flock),
//! tightening a directory's mode, and a nosuid view of a directory (a bind mount onto itself).

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum HostFsError {
    /// Another process holds the lock; `holder` is what it wrote in the lock file.
    #[error("held by another process ({holder})")]
    Held { holder: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> HostFsError + '_ {
    move |source| HostFsError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// An exclusive `flock` on a file, held until dropped (or until the process dies: the kernel
/// releases it, so a lock is never stale). The descriptor is close-on-exec: the processes the
/// holder starts (sandboxes' agents, which outlive a node) do not hold it. Dropping it removes
/// the file first (a locker that opened it meanwhile sees it gone and makes a new one).
#[derive(Debug)]
pub struct FileLock {
    /// Held open for the lock; closed after the file is removed (fields drop after `drop`).
    _file: File,
    path: PathBuf,
}

impl FileLock {
    /// Takes the lock on `path` (made, with its folder, if missing) without waiting, and
    /// writes `holder` (who holds it, for the message of the next one that tries) into it.
    pub fn try_acquire(path: &Path, holder: &str) -> Result<FileLock, HostFsError> {
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(io_err(dir))?;
        }
        loop {
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(path)
                .map_err(io_err(path))?;
            // SAFETY: flock takes a descriptor we own, which stays open for the call; it
            // touches no memory of ours.
            let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            if r != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                    let mut text = String::new();
                    let _ = file.read_to_string(&mut text);
                    let holder = text.trim().to_string();
                    return Err(HostFsError::Held {
                        holder: if holder.is_empty() {
                            "unknown".into()
                        } else {
                            holder
                        },
                    });
                }
                return Err(io_err(path)(e));
            }
            // The holder before us may have removed the file after we opened it: a lock on
            // a file no longer at `path` is no lock. Open it again then.
            let mine = file.metadata().map_err(io_err(path))?;
            match fs::metadata(path) {
                Ok(now) if now.ino() == mine.ino() && now.dev() == mine.dev() => {}
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io_err(path)(e)),
            }
            file.set_len(0).map_err(io_err(path))?;
            file.seek(SeekFrom::Start(0)).map_err(io_err(path))?;
            file.write_all(holder.as_bytes()).map_err(io_err(path))?;
            return Ok(FileLock {
                _file: file,
                path: path.to_path_buf(),
            });
        }
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        // Removed while still locked; the lock goes when the file closes, after this.
        let _ = fs::remove_file(&self.path);
    }
}

/// Makes `dir` (and its parents) if missing, and gives it to root with mode 0700 when it is
/// looser (or another's): no other host user may traverse it. Returns whether it changed it.
pub fn make_private_dir(dir: &Path) -> Result<bool, HostFsError> {
    fs::create_dir_all(dir).map_err(io_err(dir))?;
    let meta = fs::metadata(dir).map_err(io_err(dir))?;
    let mut changed = false;
    if meta.uid() != 0 || meta.gid() != 0 {
        std::os::unix::fs::chown(dir, Some(0), Some(0)).map_err(io_err(dir))?;
        changed = true;
    }
    if meta.mode() & 0o7777 != 0o700 {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(io_err(dir))?;
        changed = true;
    }
    Ok(changed)
}

/// `dir` bound onto itself with `nosuid,nodev` while this value lives: nothing under it
/// (sandboxes' upper directories, where a sandbox's root writes what it likes) runs setuid or
/// opens as a device from the host. Inside a sandbox the overlay's own mount decides that
/// (setuid there raises a process to the sandbox's root only). Dropping it detaches the
/// bind mount it made; sandboxes made meanwhile keep their overlays (their mounts live in their
/// own namespaces).
#[derive(Debug)]
pub struct NosuidBind {
    path: PathBuf,
    made: bool,
}

impl NosuidBind {
    /// Binds `dir` (canonical) onto itself with `nosuid,nodev`, unless it is a `nosuid` mount
    /// point already (one a node killed earlier left, or the machine's own: then nothing is
    /// made, and nothing is undone on drop).
    pub fn new(dir: &Path) -> Result<NosuidBind, HostFsError> {
        NosuidBind::of(dir, dir)
    }

    /// Binds `src` onto `dir` (both canonical) with `nosuid,nodev`, unless `dir` is a `nosuid`
    /// mount point already (as [`NosuidBind::new`]).
    pub fn of(src: &Path, dir: &Path) -> Result<NosuidBind, HostFsError> {
        use nix::mount::{mount, MsFlags};
        let info = fs::read_to_string("/proc/self/mountinfo")
            .map_err(io_err(Path::new("/proc/self/mountinfo")))?;
        if is_nosuid_mount_point(&info, dir) {
            return Ok(NosuidBind {
                path: dir.to_path_buf(),
                made: false,
            });
        }
        let nix_err = |e: nix::errno::Errno| HostFsError::Io {
            path: dir.to_path_buf(),
            source: std::io::Error::from(e),
        };
        mount(Some(src), dir, None::<&str>, MsFlags::MS_BIND, None::<&str>).map_err(nix_err)?;
        let flags = MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        if let Err(e) = mount(None::<&str>, dir, None::<&str>, flags, None::<&str>) {
            let _ = nix::mount::umount2(dir, nix::mount::MntFlags::MNT_DETACH);
            return Err(nix_err(e));
        }
        Ok(NosuidBind {
            path: dir.to_path_buf(),
            made: true,
        })
    }
}

impl Drop for NosuidBind {
    fn drop(&mut self) {
        if self.made {
            let _ = nix::mount::umount2(&self.path, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

/// Whether `mountinfo` (the text of /proc/self/mountinfo) has a mount at `dir` whose own
/// options hold `nosuid`; the topmost mount at a point is the last line naming it.
fn is_nosuid_mount_point(mountinfo: &str, dir: &Path) -> bool {
    let want = escape_mount_path(&dir.to_string_lossy());
    mountinfo
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            Some((*f.get(4)?, *f.get(5)?))
        })
        .rfind(|(point, _)| *point == want)
        .is_some_and(|(_, opts)| opts.split(',').any(|o| o == "nosuid"))
}

/// A path as /proc/self/mountinfo writes it (space, tab, newline and backslash in octal).
fn escape_mount_path(p: &str) -> String {
    let mut out = String::with_capacity(p.len());
    for c in p.chars() {
        match c {
            ' ' => out.push_str("\\040"),
            '\t' => out.push_str("\\011"),
            '\n' => out.push_str("\\012"),
            '\\' => out.push_str("\\134"),
            c => out.push(c),
        }
    }
    out
}

/// Marks every descriptor of this process from 3 up close-on-exec (`close_range` with
/// `CLOSE_RANGE_CLOEXEC`): what the node's caller left open (a shell's pipe, a supervisor's
/// socket) is not passed on to anything the node starts, sandboxes' agents above all. Call
/// first thing, before the process opens descriptors of its own.
pub fn cloexec_inherited() -> std::io::Result<()> {
    // SAFETY: close_range with CLOSE_RANGE_CLOEXEC only sets a flag on descriptors of this
    // process; it frees nothing that any code holds.
    let r = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3u32,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC as libc::c_uint,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// A short, stable hash of `s` (the first 8 bytes of its SHA-256) in hex: names derived from
/// paths stay the same across builds and Rust versions (std's hasher does not promise that).
pub fn short_hash(s: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(s)[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_a_file_is_refused_with_the_holder() {
        let dir = std::env::temp_dir().join(format!("sbx-lock-test-{}", std::process::id()));
        let path = dir.join("x.lock");
        let first = FileLock::try_acquire(&path, "data dir /a").unwrap();
        match FileLock::try_acquire(&path, "data dir /b") {
            Err(HostFsError::Held { holder }) => assert_eq!(holder, "data dir /a"),
            other => panic!("a second lock was not refused: {other:?}"),
        }
        drop(first);
        assert!(
            !path.exists(),
            "the lock file stays after its holder let go"
        );
        let again = FileLock::try_acquire(&path, "data dir /b").unwrap();
        drop(again);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_loose_directory_is_made_private() {
        let dir = std::env::temp_dir().join(format!("sbx-private-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
        assert!(make_private_dir(&dir).unwrap());
        assert_eq!(fs::metadata(&dir).unwrap().mode() & 0o7777, 0o700);
        assert!(!make_private_dir(&dir).unwrap());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn finds_nosuid_mount_points() {
        let info = "36 25 8:1 / /var/lib/sbx rw,relatime shared:1 - ext4 /dev/sda1 rw\n\
                    90 36 8:1 /var/lib/sbx/sandboxes /var/lib/sbx/sandboxes rw,nosuid,nodev,relatime shared:1 - ext4 /dev/sda1 rw\n\
                    91 36 8:1 /d /a\\040b rw,nosuid - ext4 /dev/sda1 rw\n";
        assert!(is_nosuid_mount_point(
            info,
            Path::new("/var/lib/sbx/sandboxes")
        ));
        assert!(!is_nosuid_mount_point(info, Path::new("/var/lib/sbx")));
        assert!(!is_nosuid_mount_point(info, Path::new("/elsewhere")));
        assert!(is_nosuid_mount_point(info, Path::new("/a b")));
    }

    #[test]
    fn short_hash_is_stable() {
        assert_eq!(short_hash(b""), "e3b0c44298fc1c14");
        assert_eq!(short_hash(b"a"), "ca978112ca1bbdca");
    }
}

/// Room left on the filesystem of a path (`statvfs`), as an unprivileged writer sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskFree {
    /// Bytes a non-root writer may still take (f_bavail × f_frsize).
    pub bytes: u64,
    /// Inodes still free (f_favail); `None` on filesystems that report no inode count (btrfs,
    /// some overlays: f_files is 0).
    pub inodes: Option<u64>,
}

/// [`DiskFree`] of the filesystem `path` is on.
pub fn disk_free(path: &Path) -> std::io::Result<DiskFree> {
    let st = rustix::fs::statvfs(path).map_err(std::io::Error::from)?;
    Ok(DiskFree {
        bytes: st.f_bavail.saturating_mul(st.f_frsize),
        inodes: (st.f_files > 0).then_some(st.f_favail),
    })
}
