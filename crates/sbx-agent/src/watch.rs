//! Watches of directories ([`HostMsg::Watch`](sbx_proto::HostMsg::Watch)): the kernel's inotify
//! events of a directory (and of every directory under it, for a recursive watch, those made
//! later too), sent to the node as they come.
//!
//! A watch belongs to its connection: it ends with `Unwatch`, with the connection (the node
//! hung up), or when its directory goes. Nothing is queued in the agent: while the node does
//! not read, the watch does not read the kernel's queue either, which is bounded (the kernel
//! drops what is over and says so: `overflow`). A recursive watch holds at most
//! [`MAX_WATCHES`] directories.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use sbx_proto::{AgentMsg, FsErrorCode, FsFailure, WatchEvent, WatchKind};
use sbx_runtime::inotify::{AsyncInotify, Event, Inotify, Wd};
use tokio::sync::{mpsc, oneshot};
use tokio::task::spawn_local;

type Out = mpsc::Sender<Vec<u8>>;

/// The most directories one watch holds (a recursive watch of a large tree stops there).
pub const MAX_WATCHES: usize = 8192;

/// The watches of one connection; dropped with it, which ends them.
pub struct Watches {
    out: Out,
    stops: Rc<RefCell<HashMap<String, oneshot::Sender<()>>>>,
}

impl Watches {
    pub fn new(out: Out) -> Watches {
        Watches {
            out,
            stops: Rc::new(RefCell::new(HashMap::new())),
        }
    }

    /// Starts watch `id` of `path`.
    pub fn start(&self, id: String, path: String, recursive: bool) {
        let (tx, rx) = oneshot::channel();
        if let Some(old) = self.stops.borrow_mut().insert(id.clone(), tx) {
            let _ = old.send(());
        }
        let out = self.out.clone();
        let stops = self.stops.clone();
        spawn_local(async move {
            let end = run(&id, &path, recursive, &out, rx).await;
            stops.borrow_mut().remove(&id);
            if let Some(error) = end {
                send(&out, &AgentMsg::WatchEnded { id, error }).await;
            }
        });
    }

    /// Ends watch `id` (nothing when there is none).
    pub fn stop(&self, id: &str) {
        if let Some(tx) = self.stops.borrow_mut().remove(id) {
            let _ = tx.send(());
        }
    }
}

impl Drop for Watches {
    /// The connection is gone: its watches end (their tasks hold the map too, so dropping it
    /// alone would not stop them).
    fn drop(&mut self) {
        let stops: Vec<oneshot::Sender<()>> =
            self.stops.borrow_mut().drain().map(|(_, tx)| tx).collect();
        for tx in stops {
            let _ = tx.send(());
        }
    }
}

async fn send(out: &Out, msg: &AgentMsg) -> bool {
    match sbx_proto::encode_msg(msg) {
        Ok(b) => out.send(b).await.is_ok(),
        Err(_) => false,
    }
}

fn failure(code: FsErrorCode, message: impl Into<String>) -> FsFailure {
    FsFailure::new(code, message).param("path")
}

/// The directories watched, by watch and by path relative to the root ("" for the root).
struct Tree {
    ino: AsyncInotify,
    root: PathBuf,
    recursive: bool,
    by_wd: HashMap<Wd, PathBuf>,
    root_wd: Wd,
}

impl Tree {
    /// Watches `rel` (under the root) and, when recursive, the directories under it; false
    /// when the cap is reached.
    fn add_tree(&mut self, rel: &Path) {
        let mut stack = vec![rel.to_path_buf()];
        while let Some(rel) = stack.pop() {
            if self.by_wd.len() >= MAX_WATCHES {
                return;
            }
            let abs = self.root.join(&rel);
            let Ok(wd) = self.ino.get().watch_dir(&abs, false) else {
                continue;
            };
            self.by_wd.insert(wd, rel.clone());
            if !self.recursive {
                continue;
            }
            let Ok(rd) = std::fs::read_dir(&abs) else {
                continue;
            };
            for e in rd.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    stack.push(rel.join(e.file_name()));
                }
            }
        }
    }

    /// Drops the watches of `rel` and what is under it (a directory moved away).
    fn drop_tree(&mut self, rel: &Path) {
        let gone: Vec<Wd> = self
            .by_wd
            .iter()
            .filter(|(wd, p)| **wd != self.root_wd && p.starts_with(rel))
            .map(|(wd, _)| *wd)
            .collect();
        for wd in gone {
            self.by_wd.remove(&wd);
            let _ = self.ino.get().unwatch(wd);
        }
    }

    /// The events of one kernel event (one per kind, as envd reports them), and whether the
    /// root has gone.
    fn translate(&mut self, e: &Event, out: &mut Vec<WatchEvent>) -> bool {
        let Some(wd) = e.wd else {
            return false;
        };
        let Some(dir) = self.by_wd.get(&wd).cloned() else {
            return false;
        };
        if e.ignored {
            self.by_wd.remove(&wd);
            return wd == self.root_wd;
        }
        let rel = match &e.name {
            Some(n) => dir.join(n),
            // An event of the directory itself: only the root's are reported (a
            // subdirectory's removal is its parent's event).
            None if wd == self.root_wd => PathBuf::new(),
            None => return false,
        };
        let name = if rel.as_os_str().is_empty() {
            ".".to_string()
        } else {
            rel.to_string_lossy().into_owned()
        };
        let mut push = |kind| {
            out.push(WatchEvent {
                name: name.clone(),
                kind,
            })
        };
        if e.created || e.moved_to {
            push(WatchKind::Create);
        }
        if e.moved_from || e.move_self {
            push(WatchKind::Rename);
        }
        if e.attrib {
            push(WatchKind::Chmod);
        }
        if e.modified {
            push(WatchKind::Write);
        }
        if e.deleted || e.delete_self {
            push(WatchKind::Remove);
        }
        if self.recursive && e.is_dir && e.name.is_some() {
            if e.created || e.moved_to {
                self.add_tree(&rel);
            } else if e.moved_from {
                self.drop_tree(&rel);
            }
        }
        false
    }
}

/// Runs a watch until it is stopped (`None`: ended as asked, or the node is gone) or fails.
/// Watches running now (each holds an inotify instance).
static LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Counts a running watch.
struct Live;

impl Live {
    fn new() -> Live {
        LIVE.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Live
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        LIVE.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Waits (up to `wait`) until no watch runs: before a checkpoint, whose node has closed the
/// watches' connections (a watch's inotify instance cannot be dumped reliably). True when
/// none runs.
pub async fn none_running(wait: std::time::Duration) -> bool {
    let end = tokio::time::Instant::now() + wait;
    while LIVE.load(std::sync::atomic::Ordering::SeqCst) > 0 {
        if tokio::time::Instant::now() >= end {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    true
}

async fn run(
    id: &str,
    path: &str,
    recursive: bool,
    out: &Out,
    mut stop: oneshot::Receiver<()>,
) -> Option<Option<FsFailure>> {
    let _live = Live::new();
    let root = match crate::fs::normalize(path, "path") {
        Ok(p) => p,
        Err(f) => return Some(Some(f)),
    };
    match std::fs::metadata(&root) {
        Ok(md) if md.is_dir() => {}
        Ok(_) => {
            return Some(Some(failure(
                FsErrorCode::WrongType,
                format!("{} is not a directory", root.display()),
            )))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Some(Some(failure(
                FsErrorCode::NotFound,
                format!("{}: no such directory", root.display()),
            )))
        }
        Err(e) => {
            return Some(Some(failure(
                FsErrorCode::Io,
                format!("{}: {e}", root.display()),
            )))
        }
    }
    let io_fail = |what: &str, e: std::io::Error| {
        Some(Some(FsFailure::new(
            FsErrorCode::Io,
            format!("{what} {}: {e}", root.display()),
        )))
    };
    let ino = match Inotify::new() {
        Ok(i) => i,
        Err(e) => return io_fail("cannot watch", e),
    };
    let root_wd = match ino.watch_dir(&root, true) {
        Ok(wd) => wd,
        Err(e) => return io_fail("cannot watch", e),
    };
    let ino = match AsyncInotify::new(ino) {
        Ok(i) => i,
        Err(e) => return io_fail("cannot wait on the watch of", e),
    };
    let mut tree = Tree {
        ino,
        root: root.clone(),
        recursive,
        by_wd: HashMap::from([(root_wd, PathBuf::new())]),
        root_wd,
    };
    if recursive {
        if let Ok(rd) = std::fs::read_dir(&root) {
            for e in rd.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    tree.add_tree(Path::new(&e.file_name()));
                }
            }
        }
    }
    if !send(out, &AgentMsg::WatchStarted { id: id.to_string() }).await {
        return None;
    }
    loop {
        let events = tokio::select! {
            _ = &mut stop => return Some(None),
            _ = out.closed() => return None,
            ev = tree.ino.next() => match ev {
                Ok(ev) => ev,
                Err(e) => return io_fail("reading the watch of", e),
            },
        };
        let mut batch = Vec::new();
        let mut overflow = false;
        let mut gone = false;
        for e in &events {
            overflow |= e.overflow;
            gone |= tree.translate(e, &mut batch);
        }
        if !batch.is_empty() || overflow {
            let msg = AgentMsg::WatchEvents {
                id: id.to_string(),
                events: batch,
                overflow,
            };
            // Waits while the node does not read: the kernel holds (and bounds) the rest.
            tokio::select! {
                ok = send(out, &msg) => if !ok { return None },
                _ = &mut stop => return Some(None),
            }
        }
        if gone {
            return Some(Some(failure(
                FsErrorCode::NotFound,
                format!("{} was removed or moved: the watch ended", root.display()),
            )));
        }
    }
}
