//! What can go wrong with the store: one enum, NotFound apart from every other failure.

use std::io;
use std::path::PathBuf;

/// A failure of the object store or of what was read from or written to the disk for it.
#[derive(Debug, thiserror::Error)]
pub enum BlobError {
    /// `Store::open` was given a URL of another form.
    #[error(
        "store URL {url:?}: {why} (the forms taken: file:///absolute/path, s3://bucket[/prefix])"
    )]
    BadUrl { url: String, why: String },
    /// The store could not be set up (its settings, the directory it is in).
    #[error("store {store}: cannot be set up: {why}")]
    Setup { store: String, why: String },
    /// A sandbox id, part name or key that cannot be a segment of an object's key.
    #[error("{what} {value:?} is not a valid name: {why}")]
    BadName {
        what: &'static str,
        value: String,
        why: &'static str,
    },
    /// No object at that key (of a manifest: that epoch was never written whole).
    #[error("{key}: no such object in {store}")]
    NotFound { key: String, store: String },
    /// The store answered with an error (its own error kept as the source).
    #[error("{key}: the store failed ({store}): {source}")]
    Store {
        key: String,
        store: String,
        #[source]
        source: object_store::Error,
    },
    /// A local file or directory could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The directory to upload is not a directory.
    #[error("{}: not a directory", path.display())]
    NotADirectory { path: PathBuf },
    /// The destination of a download is not empty (a tree) or exists (a file).
    #[error("{}: the destination must be new or an empty directory", path.display())]
    DestinationInUse { path: PathBuf },
    /// An archive's entry that would land outside its destination (`..`, an absolute path, a
    /// path through a symlink, a hard link out), or of a type that is not unpacked.
    #[error("{key}: entry {entry:?} refused: {why}")]
    Unsafe {
        key: String,
        entry: String,
        why: String,
    },
    /// An object that is not what was written: bad zstd or tar, or its size or sha256 is not
    /// the manifest's.
    #[error("{key}: damaged: {why}")]
    Corrupt { key: String, why: String },
    /// A manifest that is not JSON of a manifest.
    #[error("{key}: not a manifest: {source}")]
    BadManifest {
        key: String,
        #[source]
        source: serde_json::Error,
    },
    /// A part that the manifest does not list.
    #[error("sandbox {sandbox_id} epoch {epoch}: no part {part:?} in its manifest")]
    NoSuchPart {
        sandbox_id: String,
        epoch: u64,
        part: String,
    },
    /// An epoch that has a manifest already is not written again.
    #[error("sandbox {sandbox_id} epoch {epoch}: written already (it has a manifest)")]
    EpochWritten { sandbox_id: String, epoch: u64 },
    /// The thread that packed or unpacked a stream ended without an answer (it panicked).
    #[error("{key}: the worker thread failed: {why}")]
    Worker { key: String, why: String },
}

impl BlobError {
    /// Whether the object (or manifest) is not there, as opposed to a failure.
    pub fn is_not_found(&self) -> bool {
        matches!(self, BlobError::NotFound { .. })
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: io::Error) -> Self {
        BlobError::Io {
            path: path.into(),
            source,
        }
    }
}

/// The result of every call of this crate.
pub type Result<T, E = BlobError> = std::result::Result<T, E>;
