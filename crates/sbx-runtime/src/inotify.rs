//! inotify: the kernel's reports of changes in directories, for the agent's watches. A thin
//! safe layer over nix's inotify with the agent's one mask (what E2B's envd reports: made,
//! written, removed, moved, attributes) and events decoded into flags.

use std::ffi::OsString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::path::Path;

use nix::errno::Errno;
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify as NixInotify, WatchDescriptor};

/// An inotify instance (non-blocking, closed on exec); its watches go with it.
#[derive(Debug)]
pub struct Inotify {
    inner: NixInotify,
}

/// A watch of an [`Inotify`]: the directory an event comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Wd(WatchDescriptor);

/// One change, as the kernel reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The watch (`None`: the queue overflowed, [`Event::overflow`]).
    pub wd: Option<Wd>,
    /// The entry of the watched directory it concerns; `None`: the directory itself.
    pub name: Option<OsString>,
    /// The entry is a directory.
    pub is_dir: bool,
    pub created: bool,
    pub modified: bool,
    pub attrib: bool,
    pub deleted: bool,
    pub moved_from: bool,
    pub moved_to: bool,
    pub delete_self: bool,
    pub move_self: bool,
    /// The watch is gone (its directory removed, or the watch removed).
    pub ignored: bool,
    /// Events were lost: the kernel's queue was full.
    pub overflow: bool,
}

fn mask() -> AddWatchFlags {
    AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_MODIFY
        | AddWatchFlags::IN_ATTRIB
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_DELETE_SELF
        | AddWatchFlags::IN_MOVE_SELF
        | AddWatchFlags::IN_ONLYDIR
}

impl Inotify {
    pub fn new() -> io::Result<Inotify> {
        let inner = NixInotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
            .map_err(io::Error::from)?;
        Ok(Inotify { inner })
    }

    /// Watches directory `dir` (a symlink there is followed only when `follow`).
    pub fn watch_dir(&self, dir: &Path, follow: bool) -> io::Result<Wd> {
        let mut m = mask();
        if !follow {
            m |= AddWatchFlags::IN_DONT_FOLLOW;
        }
        self.inner
            .add_watch(dir, m)
            .map(Wd)
            .map_err(io::Error::from)
    }

    /// Ends a watch (its `ignored` event follows). A watch already gone is not an error.
    pub fn unwatch(&self, wd: Wd) -> io::Result<()> {
        match self.inner.rm_watch(wd.0) {
            Ok(()) | Err(Errno::EINVAL) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// The events queued now (none when there are none: it does not block).
    pub fn read(&self) -> io::Result<Vec<Event>> {
        let events = match self.inner.read_events() {
            Ok(e) => e,
            Err(Errno::EAGAIN) => return Ok(Vec::new()),
            Err(e) => return Err(e.into()),
        };
        Ok(events
            .into_iter()
            .map(|e| {
                let m = e.mask;
                let overflow = m.contains(AddWatchFlags::IN_Q_OVERFLOW);
                Event {
                    wd: (!overflow).then_some(Wd(e.wd)),
                    name: e.name.filter(|n| !n.is_empty()),
                    is_dir: m.contains(AddWatchFlags::IN_ISDIR),
                    created: m.contains(AddWatchFlags::IN_CREATE),
                    modified: m.contains(AddWatchFlags::IN_MODIFY),
                    attrib: m.contains(AddWatchFlags::IN_ATTRIB),
                    deleted: m.contains(AddWatchFlags::IN_DELETE),
                    moved_from: m.contains(AddWatchFlags::IN_MOVED_FROM),
                    moved_to: m.contains(AddWatchFlags::IN_MOVED_TO),
                    delete_self: m.contains(AddWatchFlags::IN_DELETE_SELF),
                    move_self: m.contains(AddWatchFlags::IN_MOVE_SELF),
                    ignored: m.contains(AddWatchFlags::IN_IGNORED),
                    overflow,
                }
            })
            .collect())
    }
}

/// An [`Inotify`] whose events are awaited on the tokio runtime.
#[derive(Debug)]
pub struct AsyncInotify {
    fd: tokio::io::unix::AsyncFd<Inotify>,
}

impl AsyncInotify {
    /// Registers `ino` with the runtime (call on one).
    pub fn new(ino: Inotify) -> io::Result<AsyncInotify> {
        // SAFETY: an Inotify always answers the same descriptor from as_raw_fd and closes it
        // only when dropped, which happens after the AsyncFd (its owner) has deregistered it.
        let fd = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(ino, tokio::io::Interest::READABLE)
        }
        .map_err(|e| e.into_parts().1)?;
        Ok(AsyncInotify { fd })
    }

    /// The instance, to add and remove watches.
    pub fn get(&self) -> &Inotify {
        self.fd.get_ref()
    }

    /// The next events (at least one), waiting for them.
    pub async fn next(&self) -> io::Result<Vec<Event>> {
        loop {
            let mut guard = self.fd.readable().await?;
            let ev = self.fd.get_ref().read()?;
            if !ev.is_empty() {
                return Ok(ev);
            }
            guard.clear_ready();
        }
    }
}

impl AsFd for Inotify {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.as_fd()
    }
}

impl AsRawFd for Inotify {
    fn as_raw_fd(&self) -> RawFd {
        self.inner.as_fd().as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_made_written_moved_removed_and_the_directory_gone() {
        let dir = std::env::temp_dir().join(format!("sbx-inotify-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        let ino = Inotify::new().unwrap();
        let wd = ino.watch_dir(&dir, true).unwrap();
        assert!(ino.read().unwrap().is_empty());
        std::fs::write(dir.join("a"), b"x").unwrap();
        std::fs::rename(dir.join("a"), dir.join("b")).unwrap();
        std::fs::remove_file(dir.join("b")).unwrap();
        std::fs::create_dir(dir.join("d")).unwrap();
        let ev = ino.read().unwrap();
        let name = |e: &Event| e.name.clone().unwrap().into_string().unwrap();
        assert!(ev.iter().all(|e| e.wd == Some(wd)));
        assert!(ev.iter().any(|e| e.created && name(e) == "a"));
        assert!(ev.iter().any(|e| e.modified && name(e) == "a"));
        assert!(ev.iter().any(|e| e.moved_from && name(e) == "a"));
        assert!(ev.iter().any(|e| e.moved_to && name(e) == "b"));
        assert!(ev.iter().any(|e| e.deleted && name(e) == "b"));
        assert!(ev.iter().any(|e| e.created && e.is_dir && name(e) == "d"));
        std::fs::remove_dir(dir.join("d")).unwrap();
        std::fs::remove_dir(&dir).unwrap();
        let ev = ino.read().unwrap();
        assert!(ev.iter().any(|e| e.delete_self && e.name.is_none()));
        assert!(ev.iter().any(|e| e.ignored));
        assert!(ino.watch_dir(&dir, true).is_err());
    }
}
