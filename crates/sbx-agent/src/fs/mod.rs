//! File operations of the node ([`HostMsg::Fs`](sbx_proto::HostMsg::Fs)), served inside the
//! sandbox.
//!
//! The agent's `/` is the sandbox's root (stage 1 pivot_roots before it starts), so no path,
//! `..` or symlink can name a host file: paths are still refused with a NUL byte and
//! normalised lexically against `/`. Each operation runs on a blocking thread of the runtime;
//! an upload's bytes reach it through a channel of [`UPLOAD_QUEUE`] chunks (the connection
//! stops reading while it is full), a download's bytes leave through the connection's bounded
//! output queue, [`CHUNK`] bytes a frame. So the agent holds a few chunks of a file, whatever
//! its size.
//!
//! A file is written to a temporary file beside it, which replaces it once every byte is
//! there: an upload cut off leaves the old file as it was.

mod path;
mod search;
mod tar;
mod transfer;
mod tree;
mod walk;

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use sbx_proto::{AgentMsg, FsErrorCode, FsFailure, FsOp, FsResult};
use tokio::sync::mpsc;

use self::path::aborted;
pub(crate) use self::path::normalize;
use self::search::{grep, sed};
use self::tar::{tar_create, tar_extract};
use self::transfer::{read_file, write_file};
use self::tree::{chmod, list, mkdir, remove, rename, stat};

type Out = mpsc::Sender<Vec<u8>>;
type Res<T> = Result<T, FsFailure>;

/// The most file bytes in one data frame the agent sends.
pub const CHUNK: usize = 256 << 10;
/// Chunks of an upload queued for its writer.
pub const UPLOAD_QUEUE: usize = 4;
/// The most bytes of names and lines an answer carries (a message frame is at most 4 MiB).
const REPLY_BUDGET: usize = 2 << 20;

enum Chunk {
    Data(Vec<u8>),
    End,
}

/// The file operations of one connection.
pub struct Files {
    /// The sandbox's user (the image's), who owns what is written unless told otherwise.
    user: Option<String>,
    out: Out,
    uploads: RefCell<HashMap<String, mpsc::Sender<Chunk>>>,
    /// Set when the connection ends: long operations stop.
    cancel: Arc<AtomicBool>,
}

impl Drop for Files {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

impl Files {
    pub fn new(user: Option<String>, out: Out) -> Files {
        Files {
            user,
            out,
            uploads: RefCell::new(HashMap::new()),
            cancel: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Starts an operation; its answer goes to the connection when it is done.
    pub fn start(&self, id: String, op: FsOp) {
        let ctx = Ctx {
            id: id.clone(),
            out: self.out.clone(),
            cancel: self.cancel.clone(),
            user: self.user.clone(),
        };
        match op {
            FsOp::Write {
                path,
                mode,
                parents,
                owner,
                in_place,
                xattrs,
            } => {
                let rx = self.upload(id);
                spawn(ctx, move |c| {
                    let how = transfer::WriteHow {
                        mode,
                        parents,
                        owner: owner.as_deref(),
                        in_place,
                        xattrs: xattrs.as_ref(),
                    };
                    write_file(c, &path, how, rx)
                });
            }
            FsOp::TarExtract {
                path,
                parents,
                owner,
                preserve_owners,
            } => {
                let rx = self.upload(id);
                spawn(ctx, move |c| {
                    tar_extract(c, &path, parents, owner.as_deref(), preserve_owners, rx)
                });
            }
            other => spawn(ctx, move |c| run(c, other)),
        }
    }

    fn upload(&self, id: String) -> mpsc::Receiver<Chunk> {
        let (tx, rx) = mpsc::channel(UPLOAD_QUEUE);
        self.uploads.borrow_mut().insert(id, tx);
        rx
    }

    /// Bytes of an upload, queued for its writer (waits while the queue is full). Bytes of an
    /// upload that failed are dropped.
    pub async fn data(&self, id: &str, bytes: Vec<u8>) {
        let tx = self.uploads.borrow().get(id).cloned();
        if let Some(tx) = tx {
            let _ = tx.send(Chunk::Data(bytes)).await;
        }
    }

    /// The end of an upload's bytes.
    pub async fn end(&self, id: &str) {
        let tx = self.uploads.borrow_mut().remove(id);
        if let Some(tx) = tx {
            let _ = tx.send(Chunk::End).await;
        }
    }
}

/// What an operation's thread has of its connection.
struct Ctx {
    id: String,
    out: Out,
    cancel: Arc<AtomicBool>,
    user: Option<String>,
}

impl Ctx {
    fn send(&self, msg: &AgentMsg) -> bool {
        match sbx_proto::encode_msg(msg) {
            Ok(b) => self.out.blocking_send(b).is_ok(),
            Err(_) => false,
        }
    }

    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }

    fn check(&self) -> Res<()> {
        if self.cancelled() {
            return Err(aborted("the node hung up"));
        }
        Ok(())
    }
}

fn spawn(ctx: Ctx, f: impl FnOnce(&Ctx) -> Res<FsResult> + Send + 'static) {
    tokio::task::spawn_blocking(move || {
        let msg = match f(&ctx) {
            Ok(result) => AgentMsg::FsDone {
                id: ctx.id.clone(),
                result,
            },
            Err(error) => AgentMsg::FsError {
                id: ctx.id.clone(),
                error,
            },
        };
        ctx.send(&msg);
    });
}

fn run(c: &Ctx, op: FsOp) -> Res<FsResult> {
    match op {
        FsOp::Stat { path } => stat(&path),
        FsOp::List { path, limit, depth } => list(&path, limit, depth),
        FsOp::Users => Ok(crate::users::table(c.user.clone())),
        FsOp::Mkdir {
            path,
            parents,
            mode,
            owner,
        } => mkdir(c, &path, parents, mode, owner.as_deref()),
        FsOp::Read {
            path,
            offset,
            length,
            tail,
        } => read_file(c, &path, offset, length, tail),
        FsOp::Remove { path, recursive } => remove(&path, recursive),
        FsOp::Move {
            src,
            dst,
            overwrite,
        } => rename(&src, &dst, overwrite),
        FsOp::Chmod {
            path,
            mode,
            uid,
            gid,
            recursive,
        } => chmod(c, &path, mode, uid, gid, recursive),
        FsOp::Grep(g) => grep(c, &g),
        FsOp::Sed(s) => sed(c, &s),
        FsOp::TarCreate { path } => tar_create(c, &path),
        FsOp::Write { .. } | FsOp::TarExtract { .. } => Err(FsFailure::new(
            FsErrorCode::Invalid,
            "an upload without its bytes",
        )),
        FsOp::Unknown => Err(FsFailure::new(
            FsErrorCode::Unsupported,
            "this sandbox's agent does not know that file operation: restart the sandbox to \
             update its agent",
        )),
    }
}
