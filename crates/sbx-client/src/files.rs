//! The options of a sandbox's file calls (`/v1/sandboxes/{id}/files…`), and a download: the
//! bytes as they come, never held whole.

use std::io::Read;

use serde::Serialize;

use crate::events::Body;

/// `PUT …/files`: how an upload is written.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Upload {
    /// Permission bits, octal (`0644`); `None`: the node's default.
    pub mode: Option<String>,
    /// Make missing parent directories.
    pub parents: bool,
    /// Owner (name, uid or uid:gid); `None`: the sandbox's user.
    pub owner: Option<String>,
}

/// `POST …/files/tar`: how a tar stream is unpacked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TarUpload {
    /// Make the directory and its parents (default true).
    pub parents: bool,
    /// Owner of what is unpacked; `None`: the sandbox's user.
    pub owner: Option<String>,
    /// Keep the archive's owners.
    pub preserve_owners: bool,
}

impl Default for TarUpload {
    fn default() -> TarUpload {
        TarUpload {
            parents: true,
            owner: None,
            preserve_owners: false,
        }
    }
}

/// `POST …/files/mkdir`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Mkdir {
    /// Make missing parents; an existing directory is no error.
    pub parents: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

/// `POST …/files/chmod`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Chmod {
    /// Permission bits, octal; `None`: left as they are.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
    pub recursive: bool,
}

/// `POST …/files/grep`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Grep {
    /// A regular expression, or text with `literal`.
    pub pattern: String,
    pub literal: bool,
    /// Into subdirectories (default true).
    pub recursive: bool,
    pub ignore_case: bool,
    /// Only files matching these globs.
    pub include: Vec<String>,
    /// Leave out files and directories matching these globs.
    pub exclude: Vec<String>,
    /// Stop after this many matching lines (the node's default: 1000).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_matches: Option<u64>,
    /// Cut longer lines (the node's default: 4096).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_line_bytes: Option<u64>,
}

impl Grep {
    /// A recursive search for `pattern`, every other option at its default.
    pub fn new(pattern: impl Into<String>) -> Grep {
        Grep {
            pattern: pattern.into(),
            literal: false,
            recursive: true,
            ignore_case: false,
            include: Vec::new(),
            exclude: Vec::new(),
            max_matches: None,
            max_line_bytes: None,
        }
    }
}

/// `POST …/files/sed`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Sed {
    pub pattern: String,
    /// `$1`, `${name}` for groups (text with `literal`).
    pub replacement: String,
    pub literal: bool,
    /// Only the first match of each file.
    pub first_only: bool,
    pub ignore_case: bool,
    pub recursive: bool,
    pub include: Vec<String>,
    pub exclude: Vec<String>,
}

impl Sed {
    /// A recursive replacement of `pattern` by `replacement`, every other option at its
    /// default.
    pub fn new(pattern: impl Into<String>, replacement: impl Into<String>) -> Sed {
        Sed {
            pattern: pattern.into(),
            replacement: replacement.into(),
            literal: false,
            first_only: false,
            ignore_case: false,
            recursive: true,
            include: Vec::new(),
            exclude: Vec::new(),
        }
    }
}

/// A part of a file: `Range: bytes=…`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Range {
    /// From a byte to another (inclusive), or to the end.
    From(u64, Option<u64>),
    /// The last bytes.
    Tail(u64),
}

impl Range {
    pub(crate) fn header(self) -> String {
        match self {
            Range::From(a, Some(b)) => format!("bytes={a}-{b}"),
            Range::From(a, None) => format!("bytes={a}-"),
            Range::Tail(n) => format!("bytes=-{n}"),
        }
    }
}

/// A download (`GET …/files`, `GET …/files/tar`): read it as it comes.
pub struct Download {
    /// The bytes to come (`Content-Length`), when the node says.
    pub len: Option<u64>,
    /// `Content-Range` of a part (`bytes 0-99/1000`).
    pub content_range: Option<String>,
    pub(crate) body: Body,
}

impl Read for Download {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.body.read(buf)
    }
}

impl std::fmt::Debug for Download {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Download")
            .field("len", &self.len)
            .field("content_range", &self.content_range)
            .finish()
    }
}
