//! Images for sbx: pulls from any OCI registry into a content-addressed store, each layer
//! unpacked once into overlayfs form, ready to be a sandbox's lower layers.
//!
//! ```no_run
//! # async fn f() -> Result<(), sbx_image::ImageError> {
//! let store = sbx_image::Store::new("/var/lib/sbx/oci".into(), 100_000, vec![]);
//! let image = store.pull("python:3.12", None, &|p| eprintln!("{p:?}")).await?;
//! // overlay lowerdir: the layers top first.
//! let lower: Vec<String> = image.layers.iter().rev().map(|p| p.display().to_string()).collect();
//! # let _ = lower.join(":");
//! # Ok(()) }
//! ```
//!
//! - [`Store`]: `pull`, `get` (local only), `gc`. The layout on disk is described in
//!   `store/mod.rs`.
//! - [`Image`]: manifest digest, reference, layer directories bottom first, [`ImageConfig`].
//! - [`parse_reference`] / [`Reference`]: Docker's normalisation (docker.io, `library/`).
//! - [`ImageError`]: one variant per stable error code.
//!
//! Layers hold overlayfs whiteouts (character devices 0:0) and opaque directories
//! (`trusted.overlay.opaque=y`, see [`OPAQUE_XATTR`]): mount them as root in the host's user
//! namespace (not with `userxattr`). Owners are shifted by the store's uid base.

#![forbid(unsafe_code)]

mod error;
mod manifest;
mod reference;
mod store;
mod unpack;

pub use error::ImageError;
pub use manifest::ImageConfig;
pub use reference::{parse_reference, Reference};
pub use store::{Credentials, GcReport, Image, Progress, Store};
pub use unpack::OPAQUE_XATTR;
