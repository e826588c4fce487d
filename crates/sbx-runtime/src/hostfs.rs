//! Host-side file helpers of the node: an exclusive lock held for the node's life (flock), and
//! tightening a directory's mode.

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
/// holder starts (sandboxes' agents, which outlive a node) do not hold it.
#[derive(Debug)]
pub struct FileLock {
    _file: File,
}

impl FileLock {
    /// Takes the lock on `path` (made, with its folder, if missing) without waiting, and
    /// writes `holder` (who holds it, for the message of the next one that tries) into it.
    pub fn try_acquire(path: &Path, holder: &str) -> Result<FileLock, HostFsError> {
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(io_err(dir))?;
        }
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(path)
            .map_err(io_err(path))?;
        // SAFETY: flock takes a descriptor we own, which stays open for the call; it touches
        // no memory of ours.
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
        file.set_len(0).map_err(io_err(path))?;
        file.seek(SeekFrom::Start(0)).map_err(io_err(path))?;
        file.write_all(holder.as_bytes()).map_err(io_err(path))?;
        Ok(FileLock { _file: file })
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

/// A short, stable hash of `s` (FNV-1a, 64 bits) in hex: names derived from paths stay the
/// same across builds and Rust versions (std's hasher does not promise that).
pub fn short_hash(s: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
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
    fn short_hash_is_stable() {
        assert_eq!(short_hash(b""), "cbf29ce484222325");
        assert_eq!(short_hash(b"a"), "af63dc4c8601ec8c");
    }
}
