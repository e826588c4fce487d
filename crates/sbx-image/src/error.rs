//! The one error type of the crate. Each variant is one stable code at the node's edge.

use std::io;

/// Why a pull, a look-up or a gc failed.
///
/// Messages never contain a password: a registry's refusal names only the registry, and every
/// other message built from a registry's answer has the caller's password scrubbed out.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The reference is not `[host[:port]/]name[:tag][@digest]`.
    #[error("invalid image reference {reference:?}: {reason}")]
    InvalidReference { reference: String, reason: String },
    /// The registry does not know the image (manifest or repository unknown), or an index has
    /// no linux/amd64 image.
    #[error("image {0} not found")]
    NotFound(String),
    /// The registry refused the credentials given (or wants some and none were given).
    /// Code: `registry_auth_failed`.
    #[error("registry {registry} refused the credentials")]
    Unauthorized { registry: String },
    /// Content whose sha256 is not the one its descriptor names; nothing of it was kept.
    #[error("digest mismatch for {what}: expected {expected}, got {actual}")]
    DigestMismatch {
        what: String,
        expected: String,
        actual: String,
    },
    /// A manifest, config or layer of a kind this store does not handle (schema 1 manifests,
    /// artifacts, unknown layer compressions).
    #[error("unsupported media type {0}")]
    UnsupportedMediaType(String),
    /// Content that is not what it claims: an unparsable manifest or config, a layer tar with a
    /// path leaving the layer, a hard link to nothing.
    #[error("invalid image content: {0}")]
    InvalidImage(String),
    /// The registry could not be reached or answered with a server error.
    #[error("registry {registry}: {message}")]
    Network { registry: String, message: String },
    /// The store on disk.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
}

impl ImageError {
    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(io::Error) -> ImageError {
        let what = what.into();
        move |source| ImageError::Io { what, source }
    }

    pub(crate) fn invalid(msg: impl Into<String>) -> ImageError {
        ImageError::InvalidImage(msg.into())
    }
}
