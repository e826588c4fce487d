//! `criu swrk` processes started ahead of their request ([`Workers`]): starting one costs the
//! node 10 to 15 ms on this project's machines (the fork of the node, then criu and its twenty
//! libraries loaded and relocated, each page a fault), which no dump or restore then waits
//! for. A worker waits in a mount namespace of its own ([`crate::process::PrivateMount`]: the
//! kernel cache tmpfs as its /run, the scratch folder of its cgroup yard where the host's
//! hierarchies are not one), made when it started; a restore mounts the sandbox's overlay in it
//! before it sends the request ([`crate::process::mount_overlay_in`]).
//!
//! A worker's namespace is a copy of the node's mounts as they were when it started: what is
//! mounted on the host for one request only (the binds of a restore's volumes) is not in it,
//! so such a request starts a worker of its own ([`Workers::fresh`]). Other nodes' disks are
//! not kept in it ([`foreign_disks`]): a worker waiting for its request would otherwise hold
//! another node's disk mounted (its loop device busy) after that node stopped and released
//! it. Its mounts are slaves of the host's (`MS_SLAVE`, where the host's are shared): an
//! unmount on the host reaches it, and nothing it mounts reaches the host.

use std::ffi::CString;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};

use super::{io, Criu, CriuError, CGROUP_YARD};

/// How many workers wait ready (a fork is a dump and a restore back to back).
pub(super) const READY: usize = 2;

/// A `criu swrk` waiting for its request on `sock`.
pub(super) struct Worker {
    pub sock: OwnedFd,
    pub child: Child,
    /// What it writes to its stderr (read to its end by a thread of its own).
    pub stderr: Option<std::thread::JoinHandle<String>>,
}

impl Worker {
    /// Starts one: `criu swrk FD` in a private mount namespace with criu's /run and, where
    /// the host's cgroup hierarchies are not criu's yard, the yard's scratch tmpfs.
    fn start(criu: &Criu) -> Result<Worker, CriuError> {
        let mut mount = crate::process::PrivateMount::new(criu.run.clone());
        if criu.cgroup_yard.is_none() {
            std::fs::create_dir_all(CGROUP_YARD).map_err(io(format!("mkdir {CGROUP_YARD}")))?;
            mount = mount
                .with_scratch(Path::new(CGROUP_YARD))
                .map_err(io("prepare criu's mounts"))?;
        }
        let (ours, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(|e| CriuError::Other(format!("a socket pair for criu: {e}")))?;
        let fd = theirs.as_raw_fd();
        let foreign = foreign_disks(&criu.workers.own_dirs());
        let mut cmd = Command::new(&criu.bin);
        cmd.arg("swrk")
            .arg(fd.to_string())
            .env_clear()
            .env(
                "PATH",
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // SAFETY: the closure runs in the forked child before exec and only makes raw syscalls
        // (fcntl on a descriptor of its own copy of the table; unshare, mount and umount2 on
        // memory prepared before the fork: each path a NUL-terminated string it owns).
        unsafe {
            cmd.pre_exec(move || {
                if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                mount.apply()?;
                // Other nodes' disks out of its namespace (best effort: one that cannot be
                // detached is only kept, as before).
                for point in &foreign {
                    libc::umount2(point.as_ptr(), libc::MNT_DETACH);
                }
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(io(format!("run {} swrk", criu.bin.display())))?;
        drop(theirs);
        let stderr = child.stderr.take().map(|mut e| {
            std::thread::spawn(move || {
                let mut s = String::new();
                let _ = e.read_to_string(&mut s);
                s
            })
        });
        Ok(Worker {
            sock: ours,
            child,
            stderr,
        })
    }

    /// Ends it unused: its socket closes, criu reads the end and exits; reaped here.
    pub(super) fn end(self) {
        let Worker {
            sock, mut child, ..
        } = self;
        drop(sock);
        let _ = child.wait();
    }

    /// Whether it still waits (it has not ended since it started).
    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Mounts a restore's root (an overlay with options `data` at `target`) in its namespace.
    pub fn mount_root(&self, target: &Path, data: &str) -> Result<(), CriuError> {
        crate::process::mount_overlay_in(self.child.id(), target, data)
            .map_err(io(format!("mount the overlay at {}", target.display())))
    }
}

/// The mount points, deepest first, of the disks of other nodes than the one whose data
/// directories are `own`: every mount (the disk's, its binds) of a btrfs on a loop device that
/// is mounted somewhere at `<dir>/disk` beside `<dir>/disk.img` ([`crate::diskfs`]'s layout)
/// with `<dir>` not one of `own`. Nothing when `own` is empty (the node's own are not known).
pub(super) fn foreign_disks(own: &[PathBuf]) -> Vec<CString> {
    if own.is_empty() {
        return Vec::new();
    }
    let Ok(text) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    // (mount point, fstype, source)
    let mounts: Vec<(PathBuf, String, String)> = text
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let dash = f.iter().position(|x| *x == "-")?;
            Some((
                PathBuf::from(super::unescape(f.get(4)?)),
                f.get(dash + 1)?.to_string(),
                f.get(dash + 2)?.to_string(),
            ))
        })
        .collect();
    let disk = |(point, fstype, source): &(PathBuf, String, String)| {
        fstype == "btrfs" && source.starts_with("/dev/loop") && point.ends_with("disk")
    };
    let foreign: std::collections::HashSet<&str> = mounts
        .iter()
        .filter(|m| disk(m))
        .filter_map(|(point, _, source)| {
            let dir = point.parent()?;
            (dir.join("disk.img").is_file() && !own.iter().any(|o| o == dir))
                .then_some(source.as_str())
        })
        .collect();
    mounts
        .iter()
        .rev()
        .filter(|(_, fstype, source)| fstype == "btrfs" && foreign.contains(source.as_str()))
        .filter_map(|(point, _, _)| {
            CString::new(std::os::unix::ffi::OsStrExt::as_bytes(point.as_os_str())).ok()
        })
        .collect()
}

/// The workers of one [`Criu`]: taken one per request, made again off the request's path.
#[derive(Default)]
pub struct Workers {
    /// The node's data directories: the disks of other nodes are not kept in a worker's
    /// namespace ([`foreign_disks`]).
    own: Mutex<Vec<PathBuf>>,
    ready: Mutex<Vec<Worker>>,
    /// A thread is making workers.
    filling: AtomicBool,
    /// No more are made ahead ([`Workers::stop`]).
    stopped: AtomicBool,
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.ready.lock().map(|r| r.len()).unwrap_or(0);
        f.debug_struct("Workers").field("ready", &n).finish()
    }
}

impl Workers {
    /// Sets the node's data directories ([`Workers::own`]); workers that wait ready are made
    /// again (they may hold other nodes' disks).
    pub(super) fn set_own_dirs(self: &Arc<Self>, dirs: &[PathBuf], criu: &Criu) {
        // As mountinfo names them: absolute, links resolved.
        let dirs: Vec<PathBuf> = dirs
            .iter()
            .map(|d| std::fs::canonicalize(d).unwrap_or_else(|_| d.clone()))
            .collect();
        *self.own.lock().unwrap_or_else(|e| e.into_inner()) = dirs;
        let ready = std::mem::take(&mut *self.ready.lock().unwrap_or_else(|e| e.into_inner()));
        let had = !ready.is_empty();
        for w in ready {
            w.end();
        }
        if had {
            self.refill(criu);
        }
    }

    fn own_dirs(&self) -> Vec<PathBuf> {
        self.own.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A worker for a request: one that waits ready, else one started now.
    pub(super) fn take(&self, criu: &Criu) -> Result<Worker, CriuError> {
        loop {
            let next = self.ready.lock().unwrap_or_else(|e| e.into_inner()).pop();
            let Some(mut w) = next else {
                return Worker::start(criu);
            };
            if w.alive() {
                return Ok(w);
            }
            // Ended while it waited (killed from outside): reaped, and the next one.
            let _ = w.child.wait();
        }
    }

    /// How many wait ready.
    pub(super) fn ready(&self) -> usize {
        self.ready.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The pids of those that wait ready.
    #[cfg(test)]
    pub(super) fn ready_pids(&self) -> Vec<u32> {
        let ready = self.ready.lock().unwrap_or_else(|e| e.into_inner());
        ready.iter().map(|w| w.child.id()).collect()
    }

    /// A worker started now, for a request that needs the host's mounts as they are.
    pub(super) fn fresh(criu: &Criu) -> Result<Worker, CriuError> {
        Worker::start(criu)
    }

    /// Starts workers until [`READY`] wait, on a thread of its own (one at a time).
    pub(super) fn refill(self: &Arc<Self>, criu: &Criu) {
        if self.stopped.load(Ordering::SeqCst) || self.filling.swap(true, Ordering::SeqCst) {
            return;
        }
        let (me, criu) = (self.clone(), criu.clone());
        let started = std::thread::Builder::new()
            .name("criu-workers".into())
            .spawn(move || {
                loop {
                    if me.ready() >= READY || me.stopped.load(Ordering::SeqCst) {
                        break;
                    }
                    match Worker::start(&criu) {
                        Ok(w) => {
                            let mut ready = me.ready.lock().unwrap_or_else(|e| e.into_inner());
                            if me.stopped.load(Ordering::SeqCst) {
                                drop(ready);
                                w.end();
                                break;
                            }
                            ready.push(w);
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "a criu worker could not be started ahead");
                            break;
                        }
                    }
                }
                me.filling.store(false, Ordering::SeqCst);
            });
        if started.is_err() {
            self.filling.store(false, Ordering::SeqCst);
        }
    }
}

impl Workers {
    /// Ends those waiting ready and makes no more ahead.
    pub(super) fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        let ready = std::mem::take(&mut *self.ready.lock().unwrap_or_else(|e| e.into_inner()));
        for w in ready {
            w.end();
        }
        // A worker being made ahead holds a copy of the node's mounts until it ends: the
        // thread making it ends it on seeing `stopped`; wait for that, so that nothing of the
        // node's disk is held once this returns (bounded: a worker starts in milliseconds).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while self.filling.load(Ordering::SeqCst) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.stop();
    }
}
