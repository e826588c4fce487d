//! A sandbox's files, as the node acts on them. Each verb is run by the sandbox's agent (which
//! does the work inside the sandbox, so that paths, owners and permissions are the sandbox's
//! own; see sbx-agent's `fs`) and answers in the node's types, never the agent protocol's:
//!
//! - [`Node::fs_call`]: a body-less call of the HTTP API and the functions interface (sbx-api's
//!   [`FsRequest`], parsed from [`sbx_api::files::FsParams`]), answered with the object both
//!   send ([`FsObject`]).
//! - [`Node::fs_stat`], [`Node::fs_list`], [`Node::fs_mkdir`], [`Node::fs_move`],
//!   [`Node::fs_remove`], [`Node::fs_users`], [`Node::fs_watch`]: the same, typed, for front
//!   ends that answer in their own words (E2B's envd).
//! - [`Node::fs_write`], [`Node::fs_unpack`]: uploads, their bytes streamed in;
//!   [`Node::fs_read`], [`Node::fs_tar`]: downloads, their bytes streamed out ([`Download`]).

use std::time::Duration;

use bytes::Bytes;
use sbx_api::files::{
    ChmodObject, FileListObject, FileObject, FsObject, FsRequest, GrepObject, SedObject, TarObject,
    UnpackRequest, WriteRequest,
};
use sbx_api::{ApiError, ErrorCode};
use sbx_proto::{FsOp, FsResult, GrepSpec, SedSpec};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

pub use sbx_api::files::FileKind;

use crate::agent::files::{self as agent_files, unexpected, TaskGuard};
use crate::agent::AgentConn;
use crate::node::Node;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A file as the sandbox sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsEntry {
    pub name: String,
    pub path: String,
    pub kind: FileKind,
    pub size: u64,
    /// Permission bits with setuid, setgid and sticky (`0o7777` at most).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Last modification, nanoseconds since the epoch.
    pub mtime_ns: i64,
    /// What a symlink points to.
    pub target: Option<String>,
    /// A symlink's target, every link on the way followed: its kind and absolute path (none
    /// when it dangles, or from an older agent).
    pub target_kind: Option<FileKind>,
    pub resolved: Option<String>,
    /// Its extended attributes of the `user.` namespace whose values are text (names in
    /// full; none from an older agent).
    pub xattrs: std::collections::BTreeMap<String, String>,
}

impl FsEntry {
    /// The entry as the API answers it (`object: "file"`), nothing added.
    pub fn object(&self) -> FileObject {
        FileObject {
            bytes_written: None,
            created: None,
            gid: self.gid,
            mode: format!("{:04o}", self.mode),
            modified_at: sbx_api::format_rfc3339_millis(i128::from(self.mtime_ns)),
            name: self.name.clone(),
            object: "file".into(),
            path: self.path.clone(),
            removed: None,
            size: self.size,
            src: None,
            target: self.target.clone(),
            kind: self.kind,
            uid: self.uid,
        }
    }
}

fn kind_of(k: sbx_proto::FsKind) -> FileKind {
    match k {
        sbx_proto::FsKind::File => FileKind::File,
        sbx_proto::FsKind::Dir => FileKind::Dir,
        sbx_proto::FsKind::Symlink => FileKind::Symlink,
        sbx_proto::FsKind::Fifo => FileKind::Fifo,
        sbx_proto::FsKind::Socket => FileKind::Socket,
        sbx_proto::FsKind::CharDevice => FileKind::CharDevice,
        sbx_proto::FsKind::BlockDevice => FileKind::BlockDevice,
    }
}

impl From<sbx_proto::FsEntry> for FsEntry {
    fn from(e: sbx_proto::FsEntry) -> FsEntry {
        FsEntry {
            name: e.name,
            path: e.path,
            kind: kind_of(e.kind),
            size: e.size,
            mode: e.mode,
            uid: e.uid,
            gid: e.gid,
            mtime_ns: e.mtime_ns,
            target: e.target,
            target_kind: e.target_kind.map(kind_of),
            resolved: e.resolved,
            xattrs: e.xattrs,
        }
    }
}

/// A directory's entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsListing {
    pub entries: Vec<FsEntry>,
    /// Cut at the limit asked for (or the agent's own).
    pub truncated: bool,
}

/// A directory made (or there already, with `parents`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsMade {
    pub entry: FsEntry,
    /// It was made now.
    pub created: bool,
}

/// A file written by an upload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsWritten {
    pub entry: FsEntry,
    pub bytes: u64,
    /// No file was at the path before.
    pub created: bool,
}

/// A tar stream unpacked: its entries and file bytes; `skipped`: entries of kinds that are
/// not made (sockets, devices, fifos) or that would land outside the directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsUnpacked {
    pub entries: u64,
    pub bytes: u64,
    pub skipped: u64,
}

/// A user of the sandbox (a line of its /etc/passwd).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserInfo {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
}

/// A group of the sandbox (a line of its /etc/group).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupInfo {
    pub name: String,
    pub gid: u32,
}

/// The sandbox's users and groups; `default_user`: the image's user, if it names one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SandboxUsers {
    pub users: Vec<UserInfo>,
    pub groups: Vec<GroupInfo>,
    pub default_user: Option<String>,
}

/// A read of a regular file (symlinks followed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsRead {
    pub path: String,
    /// The first byte.
    pub offset: u64,
    /// At most this many bytes; `None`: to the end.
    pub length: Option<u64>,
    /// The last this many bytes instead (`offset` and `length` unused).
    pub tail: Option<u64>,
}

impl FsRead {
    /// The whole file at `path`.
    pub fn whole(path: impl Into<String>) -> FsRead {
        FsRead {
            path: path.into(),
            offset: 0,
            length: None,
            tail: None,
        }
    }
}

/// An upload's file: sbx-api's [`WriteRequest`], and how the bytes go in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsWrite {
    pub file: WriteRequest,
    /// Writes into the file itself (truncated first) instead of a temporary file that
    /// replaces it once all the bytes are there: watchers of its directory see it written, not
    /// renamed over (E2B's envd writes so). A new file is written as the bytes come (a cut-off
    /// upload leaves it cut), one that is there once they are all staged beside it (a cut-off
    /// upload leaves it as it was). An agent older than the node writes through a temporary
    /// file all the same.
    pub in_place: bool,
    /// Once the bytes are there, the file's extended attributes under a prefix (of `user.`)
    /// become these: `unsupported` from an agent older than the node.
    pub xattrs: Option<XattrSet>,
}

/// Extended attributes a write leaves on its file: those named under `prefix` (which is under
/// `user.`) become exactly `values` (names in full, each under `prefix`); the others under it
/// are removed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct XattrSet {
    pub prefix: String,
    pub values: std::collections::BTreeMap<String, String>,
}

impl From<WriteRequest> for FsWrite {
    fn from(file: WriteRequest) -> FsWrite {
        FsWrite {
            file,
            in_place: false,
            xattrs: None,
        }
    }
}

/// A download's bytes, in order; an error ends it midway (the reader sees it cut).
pub type Chunks = ReceiverStream<Result<Bytes, std::io::Error>>;

/// A download as the agent opened it.
pub struct Download {
    /// The file's size.
    pub size: u64,
    /// Where the bytes start, and how many come (`None`: to the end).
    pub offset: u64,
    pub length: Option<u64>,
    pub chunks: Chunks,
}

/// What changed in a watched directory (inotify's events, as E2B's envd names them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchKind {
    /// Made, or moved in.
    Create,
    /// Its contents written.
    Write,
    /// Removed.
    Remove,
    /// Moved away (or the watched directory itself moved).
    Rename,
    /// Its mode, owner or times changed.
    Chmod,
    /// A kind the node does not know (a newer agent's).
    Other,
}

/// One change in a watched directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchEvent {
    /// The path changed, relative to the watched directory (`.` for the directory itself).
    pub name: String,
    pub kind: WatchKind,
}

impl From<sbx_proto::WatchEvent> for WatchEvent {
    fn from(e: sbx_proto::WatchEvent) -> WatchEvent {
        let kind = match e.kind {
            sbx_proto::WatchKind::Create => WatchKind::Create,
            sbx_proto::WatchKind::Write => WatchKind::Write,
            sbx_proto::WatchKind::Remove => WatchKind::Remove,
            sbx_proto::WatchKind::Rename => WatchKind::Rename,
            sbx_proto::WatchKind::Chmod => WatchKind::Chmod,
            sbx_proto::WatchKind::Other => WatchKind::Other,
        };
        WatchEvent { name: e.name, kind }
    }
}

/// What a watch reports.
#[derive(Debug)]
pub enum WatchItem {
    /// Changes, in order; `overflow`: some before them were lost.
    Events {
        events: Vec<WatchEvent>,
        overflow: bool,
    },
    /// The watch ended by itself (its directory went, its sandbox went to sleep, or the agent
    /// went): why.
    Ended(ApiError),
}

/// A running watch of a directory ([`Node::fs_watch`]): dropping it ends the watch.
pub struct Watcher {
    pub(crate) items: mpsc::Receiver<WatchItem>,
    pub(crate) _task: TaskGuard,
}

impl Watcher {
    /// The next report; `None` once the watch is over (after its [`WatchItem::Ended`]).
    pub async fn next(&mut self) -> Option<WatchItem> {
        self.items.recv().await
    }
}

/// An operation's answer: its object, and whether it made something (201 over HTTP).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsReply {
    pub object: FsObject,
    pub created: bool,
}

impl FsReply {
    fn of(object: FsObject) -> FsReply {
        FsReply {
            object,
            created: false,
        }
    }
}

/// The agent's operation of a request.
fn op_of(r: &FsRequest) -> FsOp {
    match r.clone() {
        FsRequest::List { path, limit } => FsOp::List {
            path,
            limit,
            depth: None,
        },
        FsRequest::Stat { path } => FsOp::Stat { path },
        FsRequest::Mkdir {
            path,
            parents,
            mode,
            owner,
        } => FsOp::Mkdir {
            path,
            parents,
            mode,
            owner,
        },
        FsRequest::Remove { path, recursive } => FsOp::Remove { path, recursive },
        FsRequest::Move {
            src,
            dst,
            overwrite,
        } => FsOp::Move {
            src,
            dst,
            overwrite,
        },
        FsRequest::Chmod {
            path,
            mode,
            uid,
            gid,
            recursive,
        } => FsOp::Chmod {
            path,
            mode,
            uid,
            gid,
            recursive,
        },
        FsRequest::Grep(g) => FsOp::Grep(GrepSpec {
            path: g.path,
            pattern: g.pattern,
            literal: g.literal,
            recursive: g.recursive,
            ignore_case: g.ignore_case,
            include: g.include,
            exclude: g.exclude,
            max_matches: Some(g.max_matches),
            max_line_bytes: Some(g.max_line_bytes),
        }),
        FsRequest::Sed(s) => FsOp::Sed(SedSpec {
            path: s.path,
            pattern: s.pattern,
            replacement: s.replacement,
            literal: s.literal,
            first_only: s.first_only,
            ignore_case: s.ignore_case,
            recursive: s.recursive,
            include: s.include,
            exclude: s.exclude,
        }),
    }
}

/// The answer of the agent's result to request `req` (a result of another kind is a fault:
/// 500).
fn reply_of(req: &FsRequest, r: FsResult) -> Result<FsReply, ApiError> {
    match (req, r) {
        (FsRequest::List { path, .. }, FsResult::List { entries, truncated }) => {
            Ok(FsReply::of(FsObject::List(FileListObject {
                entries: entries
                    .into_iter()
                    .map(|e| FsEntry::from(e).object())
                    .collect(),
                object: "list".into(),
                path: path.clone(),
                truncated,
            })))
        }
        (FsRequest::Stat { .. }, FsResult::Entry { entry, .. }) => {
            Ok(FsReply::of(FsObject::File(FsEntry::from(entry).object())))
        }
        (FsRequest::Mkdir { .. }, FsResult::Entry { entry, created }) => Ok(FsReply {
            object: FsObject::File(FileObject {
                created: Some(created),
                ..FsEntry::from(entry).object()
            }),
            created,
        }),
        (FsRequest::Remove { .. }, FsResult::Removed { entry }) => {
            Ok(FsReply::of(FsObject::File(FileObject {
                removed: Some(true),
                ..FsEntry::from(entry).object()
            })))
        }
        (FsRequest::Move { src, .. }, FsResult::Entry { entry, .. }) => {
            Ok(FsReply::of(FsObject::File(FileObject {
                src: Some(src.clone()),
                ..FsEntry::from(entry).object()
            })))
        }
        (FsRequest::Chmod { path, .. }, FsResult::Changed { count }) => {
            Ok(FsReply::of(FsObject::Chmod(ChmodObject {
                changed: count,
                object: "chmod".into(),
                path: path.clone(),
            })))
        }
        (
            FsRequest::Grep(_),
            FsResult::Grep {
                matches,
                truncated,
                files_scanned,
            },
        ) => Ok(FsReply::of(FsObject::Grep(GrepObject {
            files_scanned,
            matches: matches
                .into_iter()
                .map(|m| sbx_api::files::GrepMatch {
                    column: m.column,
                    line: m.line,
                    line_truncated: m.line_truncated,
                    path: m.path,
                    text: m.text,
                })
                .collect(),
            object: "grep".into(),
            truncated,
        }))),
        (
            FsRequest::Sed(_),
            FsResult::Sed {
                files,
                replacements,
                files_scanned,
                truncated,
            },
        ) => Ok(FsReply::of(FsObject::Sed(SedObject {
            files_changed: files.len() as u64,
            files: files
                .into_iter()
                .map(|f| sbx_api::files::SedFile {
                    path: f.path,
                    replacements: f.replacements,
                })
                .collect(),
            files_scanned,
            object: "sed".into(),
            replacements,
            truncated,
        }))),
        (_, other) => Err(unexpected(&other)),
    }
}

impl FsWritten {
    /// The answer of an upload: the file, its bytes, whether it is new (201 over HTTP).
    pub fn reply(&self) -> FsReply {
        FsReply {
            object: FsObject::File(FileObject {
                bytes_written: Some(self.bytes),
                created: Some(self.created),
                ..self.entry.object()
            }),
            created: self.created,
        }
    }
}

impl FsUnpacked {
    /// The answer of a tar stream unpacked into `path`.
    pub fn reply(&self, path: &str) -> FsReply {
        FsReply::of(FsObject::Tar(TarObject {
            bytes: self.bytes,
            entries: self.entries,
            object: "tar".into(),
            path: path.to_string(),
            skipped: self.skipped,
        }))
    }
}

fn entry_of(r: FsResult) -> Result<FsEntry, ApiError> {
    match r {
        FsResult::Entry { entry, .. } => Ok(entry.into()),
        other => Err(unexpected(&other)),
    }
}

impl Node {
    /// A connection to the agent of a running sandbox that serves file operations.
    async fn fs_conn(&self, id: &str) -> Result<AgentConn, ApiError> {
        let m = self.managed(id)?;
        let status = self.sandbox_object(&m).status;
        if !status.can_exec() {
            return Err(ApiError::new(
                ErrorCode::SandboxNotRunning,
                format!(
                    "the sandbox is {}: its files cannot be reached",
                    status.as_str()
                ),
            ));
        }
        let socket = self.sandboxes_dir().join(&m.id).join("agent.sock");
        // An idle connection when there is one (a new one is a thread in the sandbox's
        // network namespace and a hello: ~0.25 ms).
        let conn = AgentConn::open(&socket, CONNECT_TIMEOUT)
            .await
            .map_err(|e| {
                tracing::warn!(socket = %socket.display(), error = %e, "agent");
                ApiError::new(
                    ErrorCode::Unavailable,
                    format!("the sandbox's agent cannot be reached: {e}"),
                )
            })?;
        if !conn.serves_fs() {
            return Err(ApiError::new(
                ErrorCode::Unsupported,
                "the sandbox's agent serves no file operations: restart the sandbox to update it",
            ));
        }
        Ok(conn)
    }

    /// Runs operation `op` (one without bytes) in sandbox `id`: the agent's result.
    async fn fs_op(&self, id: &str, op: FsOp) -> Result<FsResult, ApiError> {
        agent_files::call(self.fs_conn(id).await?, op).await
    }

    /// Runs a body-less file operation in sandbox `id` (an id or a name): its answer.
    pub async fn fs_call(&self, id: &str, req: &FsRequest) -> Result<FsReply, ApiError> {
        let r = self.fs_op(id, op_of(req)).await?;
        reply_of(req, r)
    }

    /// What `path` is (a symlink is described, not followed).
    pub async fn fs_stat(&self, id: &str, path: &str) -> Result<FsEntry, ApiError> {
        let op = FsOp::Stat {
            path: path.to_string(),
        };
        entry_of(self.fs_op(id, op).await?)
    }

    /// The entries of directory `path`: at most `limit` (the agent's own cap applies too),
    /// `depth` levels (1 or none: its own entries; symlinks are not followed). An agent older
    /// than the node lists one level.
    pub async fn fs_list(
        &self,
        id: &str,
        path: &str,
        limit: Option<u32>,
        depth: Option<u32>,
    ) -> Result<FsListing, ApiError> {
        let op = FsOp::List {
            path: path.to_string(),
            limit,
            depth,
        };
        match self.fs_op(id, op).await? {
            FsResult::List { entries, truncated } => Ok(FsListing {
                entries: entries.into_iter().map(FsEntry::from).collect(),
                truncated,
            }),
            other => Err(unexpected(&other)),
        }
    }

    /// Makes directory `path` (`parents`: its missing parents too, and one that is there is
    /// no error), with permission bits `mode` (default 0755), owned by `owner` (a name, uid or
    /// uid:gid; default the sandbox's user).
    pub async fn fs_mkdir(
        &self,
        id: &str,
        path: &str,
        parents: bool,
        mode: Option<u32>,
        owner: Option<String>,
    ) -> Result<FsMade, ApiError> {
        let op = FsOp::Mkdir {
            path: path.to_string(),
            parents,
            mode,
            owner,
        };
        match self.fs_op(id, op).await? {
            FsResult::Entry { entry, created } => Ok(FsMade {
                entry: entry.into(),
                created,
            }),
            other => Err(unexpected(&other)),
        }
    }

    /// Renames `src` to `dst` (exactly that path; `overwrite`: what is there is replaced, an
    /// empty directory for a directory): the entry at `dst`.
    pub async fn fs_move(
        &self,
        id: &str,
        src: &str,
        dst: &str,
        overwrite: bool,
    ) -> Result<FsEntry, ApiError> {
        let op = FsOp::Move {
            src: src.to_string(),
            dst: dst.to_string(),
            overwrite,
        };
        entry_of(self.fs_op(id, op).await?)
    }

    /// Removes a file, a symlink (not what it points to) or a directory (`recursive`: with
    /// everything in it; else only an empty one): what was removed, as it was.
    pub async fn fs_remove(
        &self,
        id: &str,
        path: &str,
        recursive: bool,
    ) -> Result<FsEntry, ApiError> {
        let op = FsOp::Remove {
            path: path.to_string(),
            recursive,
        };
        match self.fs_op(id, op).await? {
            FsResult::Removed { entry } => Ok(entry.into()),
            other => Err(unexpected(&other)),
        }
    }

    /// The sandbox's users and groups (its /etc/passwd and /etc/group) and the image's user;
    /// `unsupported` from an agent older than the node.
    pub async fn fs_users(&self, id: &str) -> Result<SandboxUsers, ApiError> {
        let conn = self.fs_conn(id).await?;
        if !conn.serves_watch() {
            return Err(ApiError::new(
                ErrorCode::Unsupported,
                "the sandbox's agent does not list its users: restart the sandbox to update it",
            ));
        }
        match agent_files::call(conn, FsOp::Users).await? {
            FsResult::Users {
                users,
                groups,
                default_user,
            } => Ok(SandboxUsers {
                users: users
                    .into_iter()
                    .map(|u| UserInfo {
                        name: u.name,
                        uid: u.uid,
                        gid: u.gid,
                        home: u.home,
                    })
                    .collect(),
                groups: groups
                    .into_iter()
                    .map(|g| GroupInfo {
                        name: g.name,
                        gid: g.gid,
                    })
                    .collect(),
                default_user,
            }),
            other => Err(unexpected(&other)),
        }
    }

    /// Watches directory `path` of sandbox `id` (`recursive`: every directory under it too):
    /// its changes as they come, until the [`Watcher`] is dropped.
    pub async fn fs_watch(
        &self,
        id: &str,
        path: String,
        recursive: bool,
    ) -> Result<Watcher, ApiError> {
        let conn = self.fs_conn(id).await?;
        if !conn.serves_watch() {
            return Err(ApiError::new(
                ErrorCode::Unsupported,
                "the sandbox's agent does not watch directories: restart the sandbox to update it",
            ));
        }
        // A kept sandbox's watch ends when it goes to sleep (and is counted until then).
        let ends = self.managed(id).ok().map(|m| crate::agent::watch::Ends {
            asleep: m.asleep.subscribe(),
            hold: Box::new(crate::node::sandbox::Attached::new(&m)),
        });
        crate::agent::watch::watch(conn, path, recursive, ends).await
    }

    /// An upload: the file `w` names written from `bytes` as they come. An error of `bytes`
    /// aborts it (a file replaced through a temporary one stays as it was).
    pub async fn fs_write<S, E>(
        &self,
        id: &str,
        w: FsWrite,
        bytes: S,
    ) -> Result<FsWritten, ApiError>
    where
        S: futures_util::Stream<Item = Result<Bytes, E>> + Unpin,
        E: std::fmt::Display,
    {
        let op = FsOp::Write {
            path: w.file.path,
            mode: w.file.mode,
            parents: w.file.parents,
            owner: w.file.owner,
            in_place: w.in_place,
            xattrs: w.xattrs.map(|x| sbx_proto::XattrSet {
                prefix: x.prefix,
                values: x.values,
            }),
        };
        let conn = self.fs_conn(id).await?;
        // An older agent writes none: none to clear (it never wrote any), none to set.
        let op = match op {
            FsOp::Write {
                xattrs: Some(x), ..
            } if !conn.serves_xattrs() && !x.values.is_empty() => {
                return Err(ApiError::new(
                    ErrorCode::Unsupported,
                    "the sandbox's agent does not write extended attributes: restart the sandbox to update it",
                ))
            }
            FsOp::Write {
                path,
                mode,
                parents,
                owner,
                in_place,
                xattrs,
            } => FsOp::Write {
                path,
                mode,
                parents,
                owner,
                // An agent with only FEATURE_WATCH would leave a file that is there cut.
                in_place: in_place && conn.serves_xattrs(),
                xattrs: xattrs.filter(|_| conn.serves_xattrs()),
            },
            other => other,
        };
        match agent_files::upload(conn, op, bytes).await? {
            FsResult::Written {
                entry,
                bytes,
                created,
            } => Ok(FsWritten {
                entry: entry.into(),
                bytes,
                created,
            }),
            other => Err(unexpected(&other)),
        }
    }

    /// A tar stream (`bytes`, as they come) unpacked into the directory `u.path`.
    pub async fn fs_unpack<S, E>(
        &self,
        id: &str,
        u: UnpackRequest,
        bytes: S,
    ) -> Result<FsUnpacked, ApiError>
    where
        S: futures_util::Stream<Item = Result<Bytes, E>> + Unpin,
        E: std::fmt::Display,
    {
        let op = FsOp::TarExtract {
            path: u.path,
            parents: u.parents,
            owner: u.owner,
            preserve_owners: u.preserve_owners,
        };
        let conn = self.fs_conn(id).await?;
        match agent_files::upload(conn, op, bytes).await? {
            FsResult::Tar {
                entries,
                bytes,
                skipped,
            } => Ok(FsUnpacked {
                entries,
                bytes,
                skipped,
            }),
            other => Err(unexpected(&other)),
        }
    }

    /// A download of a file: what the agent opened, its bytes to come.
    pub async fn fs_read(&self, id: &str, r: FsRead) -> Result<Download, ApiError> {
        let op = FsOp::Read {
            path: r.path,
            offset: r.offset,
            length: r.length,
            tail: r.tail,
        };
        let conn = self.fs_conn(id).await?;
        agent_files::download(conn, op).await
    }

    /// A download of a directory (or of one file) as a tar stream.
    pub async fn fs_tar(&self, id: &str, path: &str) -> Result<Download, ApiError> {
        let op = FsOp::TarCreate {
            path: path.to_string(),
        };
        let conn = self.fs_conn(id).await?;
        agent_files::download(conn, op).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sbx_api::files::{FsCall, FsParams};
    use serde_json::json;

    fn entry(kind: sbx_proto::FsKind) -> sbx_proto::FsEntry {
        sbx_proto::FsEntry {
            name: "a.txt".into(),
            path: "/w/a.txt".into(),
            kind,
            size: 5,
            mode: 0o4755,
            uid: 1000,
            gid: 1000,
            mtime_ns: 1_700_000_000_123_000_000,
            target: None,
            target_kind: None,
            resolved: None,
            xattrs: Default::default(),
        }
    }

    fn request(call: FsCall, v: serde_json::Value) -> FsRequest {
        let p = FsParams::from_payload(v.as_object().cloned().unwrap_or_default());
        call.request(&p).expect("a request")
    }

    fn answer(req: &FsRequest, r: FsResult) -> serde_json::Value {
        serde_json::to_value(reply_of(req, r).expect("a reply").object).expect("json")
    }

    #[test]
    fn results_become_the_objects_the_api_answered() {
        let stat = request(FsCall::Stat, json!({"path": "/w/a.txt"}));
        assert_eq!(
            answer(
                &stat,
                FsResult::Entry {
                    entry: entry(sbx_proto::FsKind::File),
                    created: false
                }
            ),
            json!({"object": "file", "name": "a.txt", "path": "/w/a.txt", "type": "file",
                   "size": 5, "mode": "4755", "uid": 1000, "gid": 1000,
                   "modified_at": "2023-11-14T22:13:20.123Z", "target": null})
        );
        let mkdir = request(FsCall::Mkdir, json!({"path": "/w/d"}));
        let r = reply_of(
            &mkdir,
            FsResult::Entry {
                entry: entry(sbx_proto::FsKind::Dir),
                created: true,
            },
        )
        .expect("made");
        assert!(r.created);
        let v = serde_json::to_value(r.object).expect("json");
        assert_eq!(
            (v["created"].clone(), v["type"].clone()),
            (json!(true), json!("dir"))
        );
        let mv = request(FsCall::Move, json!({"path": "/w/b", "dst": "/w/a.txt"}));
        let v = answer(
            &mv,
            FsResult::Entry {
                entry: entry(sbx_proto::FsKind::File),
                created: false,
            },
        );
        assert_eq!(v["src"], "/w/b");
        let rm = request(FsCall::Remove, json!({"path": "/w/a.txt"}));
        let v = answer(
            &rm,
            FsResult::Removed {
                entry: entry(sbx_proto::FsKind::Symlink),
            },
        );
        assert_eq!(
            (v["removed"].clone(), v["type"].clone()),
            (json!(true), json!("symlink"))
        );
        let list = request(FsCall::List, json!({"path": "/w"}));
        assert_eq!(
            answer(
                &list,
                FsResult::List {
                    entries: vec![entry(sbx_proto::FsKind::File)],
                    truncated: true
                }
            )["truncated"],
            true
        );
        let sed = request(
            FsCall::Sed,
            json!({"path": "/w", "pattern": "a", "replacement": "b"}),
        );
        let v = answer(
            &sed,
            FsResult::Sed {
                files: vec![sbx_proto::SedFile {
                    path: "/w/a.txt".into(),
                    replacements: 2,
                }],
                replacements: 2,
                files_scanned: 3,
                truncated: false,
            },
        );
        assert_eq!(
            v,
            json!({"object": "sed", "files_changed": 1,
                   "files": [{"path": "/w/a.txt", "replacements": 2}],
                   "replacements": 2, "files_scanned": 3, "truncated": false})
        );
        // Another kind of result is a fault.
        let e = reply_of(&stat, FsResult::Changed { count: 1 }).expect_err("a fault");
        assert_eq!(e.code, ErrorCode::Internal);
    }

    #[test]
    fn uploads_answer_their_file_and_bytes() {
        let w = FsWritten {
            entry: entry(sbx_proto::FsKind::File).into(),
            bytes: 5,
            created: true,
        };
        let r = w.reply();
        assert!(r.created);
        let v = serde_json::to_value(r.object).expect("json");
        assert_eq!(
            (v["bytes_written"].clone(), v["created"].clone()),
            (json!(5), json!(true))
        );
        let u = FsUnpacked {
            entries: 2,
            bytes: 10,
            skipped: 1,
        };
        assert_eq!(
            serde_json::to_value(u.reply("/d").object).expect("json"),
            json!({"object": "tar", "path": "/d", "entries": 2, "bytes": 10, "skipped": 1})
        );
    }
}
