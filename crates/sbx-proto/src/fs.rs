//! File operations: what the node asks of the agent with [`crate::HostMsg::Fs`], and what the
//! agent answers.
//!
//! One operation per connection is the node's habit, but the messages carry the operation's `id`
//! so that several could share one. Bytes of a file move as data frames of stream
//! [`crate::Stream::File`] whose exec id is the operation's id and whose position is the byte
//! offset in the file (or in the tar stream):
//! - an upload ([`FsOp::Write`], [`FsOp::TarExtract`]): the node sends the op, data frames, then
//!   [`crate::HostMsg::FsEnd`]; the agent answers [`crate::AgentMsg::FsDone`] or
//!   [`crate::AgentMsg::FsError`] (which may come early: the node stops sending then). A
//!   connection that closes before `FsEnd` aborts the upload and leaves the old file as it was.
//! - a download ([`FsOp::Read`], [`FsOp::TarCreate`]): the agent answers
//!   [`crate::AgentMsg::FsOpened`], data frames, then `FsDone` (or `FsError` midway).
//! - anything else: one `FsDone` or `FsError`.
//!
//! Paths are the sandbox's own: the agent's `/` is the sandbox's root.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The capability an agent announces in its hello when it serves file operations.
pub const FEATURE_FS: &str = "fs";

/// An operation on the sandbox's files.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum FsOp {
    /// What `path` is (a symlink is described, not followed). Answer: [`FsResult::Entry`].
    Stat { path: String },
    /// The entries of a directory, by name. Answer: [`FsResult::List`].
    List {
        path: String,
        /// The most entries answered (the agent's own cap applies too).
        #[serde(default)]
        limit: Option<u32>,
        /// Levels listed: 1 (or none) is the directory's own entries, 2 also those of its
        /// subdirectories, and so on (symlinks are not followed). An agent without
        /// [`FEATURE_WATCH`] ignores it and lists one level.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        depth: Option<u32>,
    },
    /// Makes a directory. Answer: [`FsResult::Entry`].
    Mkdir {
        path: String,
        /// Makes missing parents too, and an existing directory is not an error.
        #[serde(default)]
        parents: bool,
        /// Permission bits (default 0755).
        #[serde(default)]
        mode: Option<u32>,
        /// A user (name, uid or uid:gid) to own what is made; default: the sandbox's user.
        #[serde(default)]
        owner: Option<String>,
    },
    /// Writes a file from the data frames that follow. The bytes go to a new file that replaces
    /// `path` only once they are all there. Answer: [`FsResult::Written`].
    Write {
        path: String,
        /// Permission bits; default: the replaced file's, or 0644.
        #[serde(default)]
        mode: Option<u32>,
        /// Makes missing parent directories.
        #[serde(default)]
        parents: bool,
        /// Owner; default: the replaced file's, or the sandbox's user.
        #[serde(default)]
        owner: Option<String>,
        /// Writes into the file itself (truncated first) instead of a temporary file that
        /// replaces it: watchers of its directory see it written, not renamed over (E2B's envd
        /// writes so). A new file is written as the bytes come (a cut-off upload leaves it
        /// cut); one that is there, by an agent with [`FEATURE_XATTRS`], once they are all
        /// staged beside it (a cut-off upload leaves it as it was; an agent with only
        /// [`FEATURE_WATCH`] leaves it cut). Only to an agent with [`FEATURE_WATCH`] (an older
        /// one writes through a temporary file).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        in_place: bool,
        /// Once the bytes are there, the file's extended attributes under a prefix become
        /// these. Only to an agent with [`FEATURE_XATTRS`].
        #[serde(default, skip_serializing_if = "Option::is_none")]
        xattrs: Option<XattrSet>,
    },
    /// Reads a regular file (symlinks followed): `FsOpened`, data frames, then
    /// [`FsResult::Read`].
    Read {
        path: String,
        /// The first byte.
        #[serde(default)]
        offset: u64,
        /// At most this many bytes; `None`: to the end.
        #[serde(default)]
        length: Option<u64>,
        /// The last this many bytes instead (`offset` and `length` unused).
        #[serde(default)]
        tail: Option<u64>,
    },
    /// Removes a file, a symlink (not what it points to) or a directory. Answer:
    /// [`FsResult::Removed`].
    Remove {
        path: String,
        /// A directory with everything in it; without, only an empty directory.
        #[serde(default)]
        recursive: bool,
    },
    /// Renames `src` to `dst` (exactly that path, not into it). Answer: [`FsResult::Entry`].
    Move {
        src: String,
        dst: String,
        /// Replaces an existing `dst` (an empty directory, for a directory).
        #[serde(default)]
        overwrite: bool,
    },
    /// Changes permission bits and/or owners. Answer: [`FsResult::Changed`].
    Chmod {
        path: String,
        #[serde(default)]
        mode: Option<u32>,
        #[serde(default)]
        uid: Option<u32>,
        #[serde(default)]
        gid: Option<u32>,
        /// Everything under a directory too (symlinks are not followed; their mode is left).
        #[serde(default)]
        recursive: bool,
    },
    /// Searches text files for a pattern. Answer: [`FsResult::Grep`].
    Grep(GrepSpec),
    /// Replaces a pattern in text files. Answer: [`FsResult::Sed`].
    Sed(SedSpec),
    /// A tar stream of a directory (or of one file): `FsOpened`, data frames, then
    /// [`FsResult::Tar`].
    TarCreate { path: String },
    /// Unpacks the tar stream of the data frames that follow into the directory `path`.
    /// Answer: [`FsResult::Tar`].
    TarExtract {
        path: String,
        /// Makes `path` and its missing parents.
        #[serde(default)]
        parents: bool,
        /// Owner of everything unpacked; default: the sandbox's user.
        #[serde(default)]
        owner: Option<String>,
        /// Keep the owners written in the archive instead.
        #[serde(default)]
        preserve_owners: bool,
    },
    /// The sandbox's users and groups (its /etc/passwd and /etc/group) and the image's user.
    /// Answer: [`FsResult::Users`]. Only to an agent with [`FEATURE_WATCH`].
    Users,
    /// An operation this agent does not know (sent by a newer node): answered `unsupported`.
    #[serde(other)]
    Unknown,
}

/// The capability an agent announces when it serves [`crate::HostMsg::Watch`], `List`'s
/// `depth`, `Write`'s `in_place` and [`FsOp::Users`].
pub const FEATURE_WATCH: &str = "watch";

/// The capability an agent announces when its entries carry their `user.` extended attributes
/// and a symlink's resolved target (`FsEntry::xattrs`, `target_kind`, `resolved`), and it
/// takes `Write`'s `xattrs`.
pub const FEATURE_XATTRS: &str = "xattrs";

/// Extended attributes a write leaves on its file: those named under `prefix` become exactly
/// `values` (names in full, each under `prefix`, which is under `user.`); the others under
/// it are removed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct XattrSet {
    pub prefix: String,
    #[serde(default)]
    pub values: BTreeMap<String, String>,
}

/// A user of the sandbox (a line of its /etc/passwd).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserInfo {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
}

/// A group of the sandbox (a line of its /etc/group).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupInfo {
    pub name: String,
    pub gid: u32,
}

/// What changed in a watched directory (inotify's events, as E2B's envd names them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
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
    /// A kind this peer does not know (a newer agent's).
    #[serde(other)]
    Other,
}

/// One change in a watched directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchEvent {
    /// The path changed, relative to the watched directory (`.` for the directory itself).
    pub name: String,
    pub kind: WatchKind,
}

/// What to search for, and where.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GrepSpec {
    pub path: String,
    pub pattern: String,
    /// The pattern is text, not a regular expression.
    #[serde(default)]
    pub literal: bool,
    /// Into subdirectories (else only the files of `path` itself).
    #[serde(default)]
    pub recursive: bool,
    #[serde(default)]
    pub ignore_case: bool,
    /// Globs a file must match (its name, or its path under `path` when the glob has a `/`).
    #[serde(default)]
    pub include: Vec<String>,
    /// Globs of files to leave out.
    #[serde(default)]
    pub exclude: Vec<String>,
    /// Stop after this many matching lines (the answer says `truncated`).
    #[serde(default)]
    pub max_matches: Option<u64>,
    /// Cut each line answered to this many bytes.
    #[serde(default)]
    pub max_line_bytes: Option<u32>,
}

/// What to replace, with what, and where.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SedSpec {
    pub path: String,
    pub pattern: String,
    /// `$1`, `${name}` name groups of a regular expression (unless `literal`).
    pub replacement: String,
    /// Pattern and replacement are text, not a regular expression and a template.
    #[serde(default)]
    pub literal: bool,
    /// Only the first match of each file.
    #[serde(default)]
    pub first_only: bool,
    #[serde(default)]
    pub ignore_case: bool,
    #[serde(default)]
    pub recursive: bool,
    #[serde(default)]
    pub include: Vec<String>,
    #[serde(default)]
    pub exclude: Vec<String>,
}

/// The kind of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FsKind {
    File,
    Dir,
    Symlink,
    Fifo,
    Socket,
    CharDevice,
    BlockDevice,
}

impl FsKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FsKind::File => "file",
            FsKind::Dir => "dir",
            FsKind::Symlink => "symlink",
            FsKind::Fifo => "fifo",
            FsKind::Socket => "socket",
            FsKind::CharDevice => "char_device",
            FsKind::BlockDevice => "block_device",
        }
    }
}

/// A file as the sandbox sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsEntry {
    pub name: String,
    pub path: String,
    #[serde(rename = "type")]
    pub kind: FsKind,
    pub size: u64,
    /// Permission bits with setuid, setgid and sticky (`0o7777` at most).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Last modification, nanoseconds since the epoch.
    pub mtime_ns: i64,
    /// What a symlink points to.
    #[serde(default)]
    pub target: Option<String>,
    /// A symlink's target, every link on the way followed: its kind and absolute path (none
    /// when it dangles). From an agent with [`FEATURE_XATTRS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_kind: Option<FsKind>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolved: Option<String>,
    /// Its extended attributes of the `user.` namespace whose values are text (names in
    /// full). From an agent with [`FEATURE_XATTRS`].
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub xattrs: BTreeMap<String, String>,
}

/// One matching line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrepMatch {
    pub path: String,
    /// 1-based.
    pub line: u64,
    /// 1-based byte column of the first match in the line.
    pub column: u64,
    /// The line (UTF-8, invalid bytes replaced), without its end of line.
    pub text: String,
    /// The line was cut to `max_line_bytes`.
    #[serde(default)]
    pub line_truncated: bool,
}

/// A file sed changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SedFile {
    pub path: String,
    pub replacements: u64,
}

/// The answer to an operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FsResult {
    /// `stat`, `mkdir` (`created`: it was made now), `mv` (the entry at `dst`).
    Entry {
        entry: FsEntry,
        #[serde(default)]
        created: bool,
    },
    List {
        entries: Vec<FsEntry>,
        truncated: bool,
    },
    Written {
        entry: FsEntry,
        bytes: u64,
        /// No file was at the path before.
        created: bool,
    },
    /// The bytes sent.
    Read { bytes: u64 },
    /// What was removed, as it was.
    Removed { entry: FsEntry },
    /// How many files were changed.
    Changed { count: u64 },
    Grep {
        matches: Vec<GrepMatch>,
        /// `max_matches` (or the answer's size cap) stopped the search.
        truncated: bool,
        files_scanned: u64,
    },
    Sed {
        files: Vec<SedFile>,
        replacements: u64,
        files_scanned: u64,
        /// More files changed than the answer lists.
        truncated: bool,
    },
    /// Entries and file bytes put in (or taken from) a tar stream; `skipped`: entries of kinds
    /// that are not moved (sockets, devices, fifos) or that would land outside the directory.
    Tar {
        entries: u64,
        bytes: u64,
        #[serde(default)]
        skipped: u64,
    },
    /// The sandbox's users and groups; `default_user`: the image's user, if it names one.
    Users {
        users: Vec<UserInfo>,
        groups: Vec<GroupInfo>,
        #[serde(default)]
        default_user: Option<String>,
    },
}

/// Why an operation failed. Each maps to one code of the API (and one S-code of the functions
/// interface, S210–S219 in this order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FsErrorCode {
    /// The operation is invalid as asked (a NUL in a path, removing `/`, a bad archive, ...).
    Invalid,
    NotFound,
    /// A file where a directory was needed, or the other way round.
    WrongType,
    Exists,
    NotEmpty,
    PermissionDenied,
    Io,
    BadPattern,
    /// The stream of bytes ended before its end.
    Aborted,
    /// Not something this agent does (a kind of file it does not move, an op it does not know).
    Unsupported,
}

/// A failed operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsFailure {
    pub code: FsErrorCode,
    pub message: String,
    /// The request field at fault (`path`, `dst`, `pattern`, `owner`, `body`...).
    #[serde(default)]
    pub param: Option<String>,
}

impl FsFailure {
    pub fn new(code: FsErrorCode, message: impl Into<String>) -> FsFailure {
        FsFailure {
            code,
            message: message.into(),
            param: None,
        }
    }

    #[must_use]
    pub fn param(mut self, p: &str) -> FsFailure {
        self.param = Some(p.to_string());
        self
    }
}
