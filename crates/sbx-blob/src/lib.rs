//! The fleet's object store: a sandbox's sleeps and snapshots as objects, through the
//! `object_store` crate, in a directory (`file:///path`, a single machine's default) or an S3
//! bucket (`s3://bucket/prefix`; SeaweedFS, MinIO, AWS).
//!
//! - [`Store::open`] takes the URL (S3's endpoint, region and keys from the `AWS_*` variables);
//!   [`Store::describe`] names it for logs.
//! - Trees and files go up and down streamed, zstd-compressed, with bounded memory whatever
//!   their size: [`Store::put_tree`] / [`Store::get_tree`] (a directory as a tar stream: files,
//!   holes, directories, symlinks, hard links, devices (an overlay's whiteouts), FIFOs, modes,
//!   owners, mtimes, extended attributes), [`Store::put_file`] / [`Store::get_file`] (a disk
//!   image; zeros come back as holes), [`Store::put_reader`] / [`Store::get_writer`] (a
//!   `btrfs send` stream). A download refuses every path that would land outside its
//!   destination. An upload that fails or is dropped is aborted: nothing is left at its key.
//! - A sandbox's epochs: `sandboxes/<id>/e<epoch>/<part>.tar.zst` and `manifest.json` written
//!   last ([`EpochWriter`]), so that a manifest means its parts are whole:
//!   [`Store::manifest`], [`Store::latest`], [`Store::epochs`], [`Store::delete_epoch`], and the
//!   parts read back checked against the manifest's sizes and sha256
//!   ([`Store::get_part_tree`], ...).
//!
//! Errors are [`BlobError`]; [`BlobError::NotFound`] is apart from every failure.

#![forbid(unsafe_code)]

mod error;
mod layout;
mod pack;
mod pipe;
mod sparse;
mod store;
mod unpack;

pub use error::{BlobError, Result};
pub use layout::{
    epoch_prefix, manifest_key, part_key, EpochWriter, Format, Kind, Manifest, Part, MANIFEST,
    SANDBOXES,
};
pub use store::{Stats, Store};

#[cfg(feature = "testing")]
pub mod testing;
