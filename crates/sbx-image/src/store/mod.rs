//! The content-addressed store and pulls into it.
//!
//! ```text
//! <root>/store.json                  {"uid_base": N}: the uid base every layer is stored at
//! <root>/lock                        flock: pulls share it, gc takes it alone
//! <root>/blobs/sha256/<hex>          verified blobs: manifests, indexes, configs, layers
//! <root>/layers/<diff_id hex>/       one unpacked layer, in overlayfs form, owners shifted
//! <root>/images/<manifest hex>.json  a resolved image (ImageRecord)
//! <root>/refs/<reference, / : @ as %2F %3A %40>   {"reference", "digest"}: a tag's image
//! <root>/refs/index/<index hex>      {"reference", "digest"}: the linux/amd64 image of an index
//! ```
//!
//! Everything is written as `<dir>/.tmp-…` and renamed into place when complete (files are
//! fsynced first; a layer's filesystem is synced before its directory is renamed). A pull
//! dropped midway removes its own temp files; a killed process leaves them to the next pull that
//! finds no other pull running, or to gc.

mod layout;
mod pull;

use std::path::PathBuf;

use nix::fcntl::FlockArg;

use crate::error::ImageError;
use crate::manifest::ImageConfig;
use crate::reference::parse_reference;

use self::layout::{read_json, Layout, RefRecord};

/// Credentials for a registry (HTTP basic, or exchanged for a bearer token when the registry
/// asks for one).
#[derive(Clone)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// How far a layer's download is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Progress {
    /// The layer blob's digest (`sha256:…`).
    pub layer: String,
    pub done: u64,
    pub total: u64,
}

/// An image ready to be a sandbox's root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    /// The image manifest's digest (`sha256:…`): the image's identity.
    pub digest: String,
    /// The normalised reference it was pulled or looked up by.
    pub reference: String,
    /// Unpacked layer directories, bottom first. A layer that occurs twice is listed once, at
    /// its topmost place (the same content above hides all of it below).
    pub layers: Vec<PathBuf>,
    pub config: ImageConfig,
}

/// What gc removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    pub blobs_removed: u64,
    pub layers_removed: u64,
    pub temps_removed: u64,
    /// Refs to images no longer in the store, and unreadable image records.
    pub records_removed: u64,
    /// Bytes of the blobs removed.
    pub bytes_freed: u64,
}

/// The image store at a root directory.
pub struct Store {
    root: PathBuf,
    uid_base: u32,
    insecure: Vec<String>,
}

impl Store {
    /// A store at `root` (made on first use) whose layers are stored with owners shifted by
    /// `uid_base`. Registries listed in `insecure` (`HOST:PORT`, as in references) are spoken
    /// to over plain HTTP; every other over HTTPS.
    pub fn new(root: PathBuf, uid_base: u32, insecure: Vec<String>) -> Store {
        Store {
            root,
            uid_base,
            insecure,
        }
    }

    /// Pulls `reference` (unless the store has it complete: by digest then no request is made;
    /// by tag only the manifest is asked for) and returns the image.
    pub async fn pull(
        &self,
        reference: &str,
        creds: Option<&Credentials>,
        progress: &(dyn Fn(Progress) + Send + Sync),
    ) -> Result<Image, ImageError> {
        self.pull_inner(reference, creds, progress, false).await
    }

    /// As [`Store::pull`], but the registry is always asked for the manifest, by digest too,
    /// even when the store has the image: for an image the caller may only have when the
    /// registry says so (a private one). Only the manifest is fetched when the store has the
    /// image; a refusal is `Unauthorized`.
    pub async fn pull_from_registry(
        &self,
        reference: &str,
        creds: Option<&Credentials>,
        progress: &(dyn Fn(Progress) + Send + Sync),
    ) -> Result<Image, ImageError> {
        self.pull_inner(reference, creds, progress, true).await
    }

    /// The image `reference` names, if the store has it complete. No network.
    pub fn get(&self, reference: &str) -> Option<Image> {
        let r = parse_reference(reference).ok()?;
        let layout = Layout::new(&self.root);
        if !layout.uid_base_is(self.uid_base) {
            return None;
        }
        let rec = match r.digest() {
            Some(d) => layout.complete_by_digest(d)?,
            None => {
                let rf: RefRecord = read_json(&layout.reference(&r.to_string()))?;
                layout.complete(&rf.digest)?
            }
        };
        layout.image(&r, &rec)
    }

    /// Removes blobs, layers and refs no image uses, and temp files of pulls no longer running.
    /// What an image record names is never removed; a record (or ref) that cannot be read
    /// stops gc with an error before any blob, layer or record is removed (one whose content
    /// is not a record is garbage). Waits for running pulls of this store to finish: call it
    /// where blocking is allowed.
    pub fn gc(&self) -> Result<GcReport, ImageError> {
        let layout = Layout::new(&self.root);
        if !self.root.exists() {
            return Ok(GcReport::default());
        }
        layout.init(self.uid_base)?;
        let _lock = layout.lock(FlockArg::LockExclusive)?;
        layout.gc()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>(_: &T) {}
    fn assert_send<T: Send>(_: T) {}

    #[test]
    fn a_node_can_share_the_store_and_spawn_pulls() {
        let store = Store::new(PathBuf::from("/nonexistent"), 100_000, vec![]);
        assert_send_sync(&store);
        assert_send(store.pull("python:3.12", None, &|_| {}));
    }

    #[test]
    fn credentials_do_not_print_the_password() {
        let c = Credentials {
            username: "me".into(),
            password: "hunter22".into(),
        };
        assert!(!format!("{c:?}").contains("hunter22"));
        let e = ImageError::Unauthorized {
            registry: "r.example".into(),
        };
        assert_eq!(e.to_string(), "registry r.example refused the credentials");
    }
}
