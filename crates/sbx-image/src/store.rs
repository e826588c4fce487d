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

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use futures_util::StreamExt;
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::{DigestError, OciDistributionError, OciErrorCode};
use oci_client::manifest::OciDescriptor;
use oci_client::secrets::RegistryAuth;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

use crate::error::ImageError;
use crate::manifest::{
    digest_hex, parse_config, parse_manifest, pick_linux_amd64, Descriptor, ImageConfig, Manifest,
    ACCEPTED_MANIFESTS,
};
use crate::reference::{parse_reference, Reference};
use crate::unpack::unpack_blob;

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

/// A resolved image as stored in `images/<hex>.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct ImageRecord {
    digest: String,
    references: Vec<String>,
    #[serde(default)]
    index_digests: Vec<String>,
    config_digest: String,
    layers: Vec<LayerRecord>,
    config: ImageConfig,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct LayerRecord {
    digest: String,
    diff_id: String,
    media_type: String,
    size: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct RefRecord {
    reference: String,
    digest: String,
}

#[derive(Serialize, Deserialize)]
struct StoreMeta {
    uid_base: u32,
}

const TMP_PREFIX: &str = ".tmp-";
static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

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

    /// A registry client for one pull: the client keeps the first credentials it was given for
    /// a registry, and each pull comes with its own.
    fn client(&self) -> oci_client::Client {
        oci_client::Client::new(ClientConfig {
            protocol: ClientProtocol::HttpsExcept(self.insecure.clone()),
            platform_resolver: Some(Box::new(oci_client::client::linux_amd64_resolver)),
            connect_timeout: Some(std::time::Duration::from_secs(30)),
            read_timeout: Some(std::time::Duration::from_secs(120)),
            ..ClientConfig::default()
        })
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

    async fn pull_inner(
        &self,
        reference: &str,
        creds: Option<&Credentials>,
        progress: &(dyn Fn(Progress) + Send + Sync),
        ask_registry: bool,
    ) -> Result<Image, ImageError> {
        let r = parse_reference(reference)?;
        let layout = Layout::new(&self.root);
        layout.init(self.uid_base)?;
        let lock = Arc::new(layout.lock_for_pull().await?);

        if let (Some(d), false) = (r.digest(), ask_registry) {
            if let Some(rec) = layout.complete_by_digest(d) {
                return layout.remember(&r, rec, None);
            }
        }

        let client = self.client();
        let p = Puller {
            client: &client,
            r: &r,
            oref: r.to_oci(),
            auth: match creds {
                Some(c) => RegistryAuth::Basic(c.username.clone(), c.password.clone()),
                None => RegistryAuth::Anonymous,
            },
            secret: creds.map(|c| c.password.clone()).unwrap_or_default(),
        };

        // The manifest the reference names; an index is resolved to its linux/amd64 image.
        let (top, top_digest) = p.manifest(&r, r.digest()).await?;
        let (manifest, manifest_digest, index) = match parse_manifest(&top)? {
            Manifest::Index(entries) => {
                if let Some(rec) = layout.index_target(&top_digest) {
                    return layout.remember(&r, rec, Some(&top_digest));
                }
                let entry = pick_linux_amd64(&entries).ok_or_else(|| {
                    ImageError::NotFound(format!("{r} (its index has no linux/amd64 image)"))
                })?;
                if let Some(rec) = layout.complete(&entry.digest) {
                    return layout.remember(&r, rec, Some(&top_digest));
                }
                let (body, digest) = p
                    .manifest(&r.with_digest(&entry.digest), Some(&entry.digest))
                    .await?;
                (body, digest, Some((top, top_digest)))
            }
            Manifest::Image { .. } => {
                if let Some(rec) = layout.complete(&top_digest) {
                    return layout.remember(&r, rec, None);
                }
                (top, top_digest, None)
            }
        };
        let Manifest::Image { config, layers } = parse_manifest(&manifest)? else {
            return Err(ImageError::UnsupportedMediaType(
                "an index inside an index".into(),
            ));
        };
        layout.put_blob(&manifest_digest, &manifest)?;
        if let Some((body, digest)) = &index {
            layout.put_blob(digest, body)?;
        }

        let config_body = match layout.read_blob(&config.digest) {
            Some(body) => body,
            None => {
                let body = p.small_blob(&config).await?;
                layout.put_blob(&config.digest, &body)?;
                body
            }
        };
        let config_blob = parse_config(&config_body)?;
        let diff_ids = config_blob.rootfs.diff_ids;
        if diff_ids.len() != layers.len() {
            return Err(ImageError::invalid(format!(
                "{} layers but {} diff_ids in the config",
                layers.len(),
                diff_ids.len()
            )));
        }

        // Layers to make, each once; their blobs are downloaded (verified) before any is
        // unpacked, so a pull stopped while downloading leaves no layer behind.
        let mut missing: Vec<(&Descriptor, &str)> = Vec::new();
        for (d, diff_id) in layers.iter().zip(&diff_ids) {
            let exists = layout.layer(digest_hex(diff_id)?).is_dir();
            if exists || missing.iter().any(|(_, id)| id == diff_id) {
                let size = u64::try_from(d.size).unwrap_or(0);
                progress(Progress {
                    layer: d.digest.clone(),
                    done: size,
                    total: size,
                });
            } else {
                missing.push((d, diff_id));
            }
        }
        let slots = tokio::sync::Semaphore::new(3);
        let mut downloads = Vec::new();
        for (d, _) in &missing {
            downloads.push(p.layer_blob_in(&slots, &layout, d, progress));
        }
        futures_util::future::try_join_all(downloads).await?;

        let cancel = CancelOnDrop(Arc::new(AtomicBool::new(false)));
        let slots = Arc::new(tokio::sync::Semaphore::new(
            std::thread::available_parallelism().map_or(2, |n| n.get()),
        ));
        let mut unpacks = Vec::new();
        for (d, diff_id) in &missing {
            unpacks.push(make_layer(
                slots.clone(),
                layout.clone(),
                layout.blob(digest_hex(&d.digest)?),
                diff_id.to_string(),
                self.uid_base,
                cancel.0.clone(),
                lock.clone(),
            ));
        }
        // Every unpack has ended (after a failure the others stop and remove their temp
        // directories) before the pull returns; the failure reported is the one that stopped
        // the others.
        let errors: Vec<ImageError> = futures_util::future::join_all(unpacks)
            .await
            .into_iter()
            .filter_map(Result::err)
            .collect();
        if let Some(e) = errors.into_iter().min_by_key(is_cancelled) {
            return Err(e);
        }

        let rec = ImageRecord {
            digest: manifest_digest.clone(),
            references: Vec::new(),
            index_digests: Vec::new(),
            config_digest: config.digest.clone(),
            layers: layers
                .iter()
                .zip(&diff_ids)
                .map(|(d, diff_id)| LayerRecord {
                    digest: d.digest.clone(),
                    diff_id: diff_id.clone(),
                    media_type: d.media_type.clone(),
                    size: d.size,
                })
                .collect(),
            config: config_blob.config.unwrap_or_default(),
        };
        let index_digest = index.as_ref().map(|(_, d)| d.as_str());
        layout.remember(&r, rec, index_digest)
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

/// Unpacks one layer on a blocking thread, when a slot is free. A failure stops the others.
async fn make_layer(
    slots: Arc<tokio::sync::Semaphore>,
    layout: Layout,
    blob: PathBuf,
    diff_id: String,
    uid_base: u32,
    cancel: Arc<AtomicBool>,
    lock: Arc<Flock<File>>,
) -> Result<(), ImageError> {
    let _slot = slots
        .acquire()
        .await
        .map_err(|e| ImageError::io("unpacking a layer")(io::Error::other(e)))?;
    let flag = cancel.clone();
    let res = tokio::task::spawn_blocking(move || {
        // The store stays locked while an unpack runs, even when the pull was dropped.
        let _lock = lock;
        layout.make_layer(&blob, &diff_id, uid_base, &flag)
    })
    .await
    .map_err(|e| ImageError::io("unpacking a layer")(io::Error::other(e)))
    .and_then(|r| r);
    if res.is_err() {
        cancel.store(true, Ordering::Relaxed);
    }
    res
}

fn is_cancelled(e: &ImageError) -> bool {
    matches!(e, ImageError::Io { source, .. } if source.kind() == io::ErrorKind::Interrupted)
}

/// Sets its flag when dropped: blocking unpacks stop when the pull is dropped.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A temp path removed when dropped, unless kept.
struct TempPath {
    path: PathBuf,
    keep: bool,
}

impl TempPath {
    fn new(dir: &Path, what: &str) -> TempPath {
        let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("{TMP_PREFIX}{}-{n}-{what}", std::process::id()));
        TempPath { path, keep: false }
    }

    /// Renames it to `to`. `Ok(false)` when `to` (a directory) already exists complete.
    fn persist(mut self, to: &Path) -> io::Result<bool> {
        match fs::rename(&self.path, to) {
            Ok(()) => {
                self.keep = true;
                Ok(true)
            }
            Err(e) if matches!(e.raw_os_error(), Some(c) if c == Errno::ENOTEMPTY as i32 || c == Errno::EEXIST as i32) => {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        if !self.keep {
            let _ = remove_any(&self.path);
        }
    }
}

fn remove_any(path: &Path) -> io::Result<()> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Option<T> {
    serde_json::from_slice(&fs::read(path).ok()?).ok()
}

/// A record for gc: `None` when its content is not one (it is then garbage); an error when it
/// cannot be read, so that a failing disk never makes gc drop a live image and its layers.
fn read_record<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Option<T>, ImageError> {
    let body = fs::read(path).map_err(ImageError::io(format!("read {}", path.display())))?;
    Ok(serde_json::from_slice(&body).ok())
}

fn sha256_digest(body: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(body)))
}

/// Paths of the store and the operations on them that need no network.
#[derive(Clone)]
struct Layout {
    root: PathBuf,
}

impl Layout {
    fn new(root: &Path) -> Layout {
        Layout {
            root: root.to_path_buf(),
        }
    }

    fn blobs(&self) -> PathBuf {
        self.root.join("blobs").join("sha256")
    }
    fn blob(&self, hex: &str) -> PathBuf {
        self.blobs().join(hex)
    }
    fn layers(&self) -> PathBuf {
        self.root.join("layers")
    }
    fn layer(&self, hex: &str) -> PathBuf {
        self.layers().join(hex)
    }
    fn images(&self) -> PathBuf {
        self.root.join("images")
    }
    fn image_path(&self, hex: &str) -> PathBuf {
        self.images().join(format!("{hex}.json"))
    }
    fn refs(&self) -> PathBuf {
        self.root.join("refs")
    }
    fn indexes(&self) -> PathBuf {
        self.refs().join("index")
    }
    fn reference(&self, normalised: &str) -> PathBuf {
        let name = normalised
            .replace('%', "%25")
            .replace('/', "%2F")
            .replace(':', "%3A")
            .replace('@', "%40");
        if name.len() <= 240 {
            self.refs().join(name)
        } else {
            self.refs().join(format!(
                "sha256-{}",
                hex::encode(Sha256::digest(normalised))
            ))
        }
    }
    fn temp_dirs(&self) -> Vec<PathBuf> {
        vec![
            self.root.clone(),
            self.blobs(),
            self.layers(),
            self.images(),
            self.refs(),
            self.indexes(),
        ]
    }

    fn init(&self, uid_base: u32) -> Result<(), ImageError> {
        for dir in [self.blobs(), self.layers(), self.images(), self.indexes()] {
            fs::create_dir_all(&dir).map_err(ImageError::io(format!("mkdir {}", dir.display())))?;
        }
        let meta = self.root.join("store.json");
        match read_json::<StoreMeta>(&meta) {
            Some(m) if m.uid_base == uid_base => Ok(()),
            Some(m) => Err(ImageError::io(format!("store {}", self.root.display()))(
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "its layers are stored for uid base {}, not {uid_base}",
                        m.uid_base
                    ),
                ),
            )),
            None => self.write_atomic(
                &self.root,
                &meta,
                &serde_json::json!({ "uid_base": uid_base })
                    .to_string()
                    .into_bytes(),
            ),
        }
    }

    fn uid_base_is(&self, uid_base: u32) -> bool {
        read_json::<StoreMeta>(&self.root.join("store.json"))
            .is_some_and(|m| m.uid_base == uid_base)
    }

    fn lock(&self, arg: FlockArg) -> Result<Flock<File>, ImageError> {
        let path = self.root.join("lock");
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(ImageError::io(format!("open {}", path.display())))?;
        Flock::lock(file, arg)
            .map_err(|(_, e)| ImageError::io(format!("lock {}", path.display()))(e.into()))
    }

    /// The shared lock of a pull. When no other pull (and no gc) holds the lock, the temp files
    /// of pulls that were killed are removed first.
    async fn lock_for_pull(&self) -> Result<Flock<File>, ImageError> {
        let layout = self.clone();
        tokio::task::spawn_blocking(move || match layout.lock(FlockArg::LockExclusiveNonblock) {
            Ok(lock) => {
                layout.remove_temps()?;
                lock.relock(FlockArg::LockShared)
                    .map_err(|e| ImageError::io("lock the store")(e.into()))?;
                Ok(lock)
            }
            Err(ImageError::Io { source, .. })
                if source.raw_os_error() == Some(Errno::EWOULDBLOCK as i32) =>
            {
                layout.lock(FlockArg::LockShared)
            }
            Err(e) => Err(e),
        })
        .await
        .map_err(|e| ImageError::io("lock the store")(io::Error::other(e)))?
    }

    fn remove_temps(&self) -> Result<u64, ImageError> {
        let mut n = 0;
        for dir in self.temp_dirs() {
            let Ok(entries) = fs::read_dir(&dir) else {
                continue;
            };
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with(TMP_PREFIX) {
                    remove_any(&e.path())
                        .map_err(ImageError::io(format!("remove {}", e.path().display())))?;
                    n += 1;
                }
            }
        }
        Ok(n)
    }

    /// Writes `body` to `path` through a temp file in `dir`, fsynced, renamed into place.
    fn write_atomic(&self, dir: &Path, path: &Path, body: &[u8]) -> Result<(), ImageError> {
        let tmp = TempPath::new(dir, "file");
        let write = || -> io::Result<()> {
            let mut f = File::create(&tmp.path)?;
            f.write_all(body)?;
            f.sync_all()
        };
        write().map_err(ImageError::io(format!("write {}", tmp.path.display())))?;
        tmp.persist(path)
            .map_err(ImageError::io(format!("rename to {}", path.display())))?;
        Ok(())
    }

    fn put_blob(&self, digest: &str, body: &[u8]) -> Result<(), ImageError> {
        let path = self.blob(digest_hex(digest)?);
        if path.exists() {
            return Ok(());
        }
        let actual = sha256_digest(body);
        if actual != digest {
            return Err(ImageError::DigestMismatch {
                what: "blob".into(),
                expected: digest.to_string(),
                actual,
            });
        }
        self.write_atomic(&self.blobs(), &path, body)
    }

    fn read_blob(&self, digest: &str) -> Option<Vec<u8>> {
        fs::read(self.blob(digest_hex(digest).ok()?)).ok()
    }

    /// Unpacks a layer blob into a temp directory and renames it to `layers/<diff_id hex>`.
    fn make_layer(
        &self,
        blob: &Path,
        diff_id: &str,
        uid_base: u32,
        cancel: &AtomicBool,
    ) -> Result<(), ImageError> {
        let hex = digest_hex(diff_id)?;
        let dest = self.layer(hex);
        if dest.is_dir() {
            return Ok(());
        }
        let tmp = TempPath::new(&self.layers(), hex);
        fs::create_dir(&tmp.path)
            .map_err(ImageError::io(format!("mkdir {}", tmp.path.display())))?;
        std::os::unix::fs::lchown(&tmp.path, Some(uid_base), Some(uid_base))
            .map_err(ImageError::io(format!("chown {}", tmp.path.display())))?;
        unpack_blob(blob, &tmp.path, diff_id, uid_base, cancel)?;
        // The layer's contents on disk before its name.
        let dir = File::open(&tmp.path)
            .map_err(ImageError::io(format!("open {}", tmp.path.display())))?;
        nix::unistd::syncfs(&dir).map_err(|e| ImageError::io("syncfs")(e.into()))?;
        if cancel.load(Ordering::Relaxed) {
            return Err(ImageError::io("unpacking a layer")(io::Error::new(
                io::ErrorKind::Interrupted,
                "pull cancelled",
            )));
        }
        tmp.persist(&dest)
            .map_err(ImageError::io(format!("rename to {}", dest.display())))?;
        Ok(())
    }

    /// The image record for `digest` if the image is complete (record and every layer).
    fn complete(&self, digest: &str) -> Option<ImageRecord> {
        let rec: ImageRecord = read_json(&self.image_path(digest_hex(digest).ok()?))?;
        let all = rec
            .layers
            .iter()
            .all(|l| digest_hex(&l.diff_id).is_ok_and(|h| self.layer(h).is_dir()));
        all.then_some(rec)
    }

    /// The complete image a digest names: an image manifest's, or an index's that was resolved.
    fn complete_by_digest(&self, digest: &str) -> Option<ImageRecord> {
        self.complete(digest).or_else(|| self.index_target(digest))
    }

    fn index_target(&self, index_digest: &str) -> Option<ImageRecord> {
        let rf: RefRecord = read_json(&self.indexes().join(digest_hex(index_digest).ok()?))?;
        self.complete(&rf.digest)
    }

    /// Records that `r` (and `index_digest`, when the image came through an index) names `rec`,
    /// writes the record, and returns the image.
    fn remember(
        &self,
        r: &Reference,
        mut rec: ImageRecord,
        index_digest: Option<&str>,
    ) -> Result<Image, ImageError> {
        let name = r.to_string();
        let record_path = self.image_path(digest_hex(&rec.digest)?);
        let mut changed = false;
        // What an earlier pull of the same image recorded is kept.
        if let Some(old) = read_json::<ImageRecord>(&record_path) {
            for n in old.references {
                if !rec.references.contains(&n) {
                    rec.references.push(n);
                    changed = true;
                }
            }
            for d in old.index_digests {
                if !rec.index_digests.contains(&d) {
                    rec.index_digests.push(d);
                    changed = true;
                }
            }
        }
        if !rec.references.contains(&name) {
            rec.references.push(name.clone());
            changed = true;
        }
        if let Some(idx) = index_digest {
            if !rec.index_digests.iter().any(|d| d == idx) {
                rec.index_digests.push(idx.to_string());
                changed = true;
            }
            let path = self.indexes().join(digest_hex(idx)?);
            if !path.exists() {
                let body = serde_json::to_vec(&RefRecord {
                    reference: r.with_digest(idx).to_string(),
                    digest: rec.digest.clone(),
                })
                .map_err(|e| ImageError::io("encode")(e.into()))?;
                self.write_atomic(&self.indexes(), &path, &body)?;
            }
        }
        if changed || !record_path.exists() {
            let body =
                serde_json::to_vec_pretty(&rec).map_err(|e| ImageError::io("encode")(e.into()))?;
            self.write_atomic(&self.images(), &record_path, &body)?;
        }
        if r.digest().is_none() {
            let path = self.reference(&name);
            let current: Option<RefRecord> = read_json(&path);
            if current.is_none_or(|c| c.digest != rec.digest) {
                let body = serde_json::to_vec(&RefRecord {
                    reference: name,
                    digest: rec.digest.clone(),
                })
                .map_err(|e| ImageError::io("encode")(e.into()))?;
                self.write_atomic(&self.refs(), &path, &body)?;
            }
        }
        self.image(r, &rec).ok_or_else(|| {
            ImageError::io(format!("image {}", rec.digest))(io::Error::new(
                io::ErrorKind::NotFound,
                "a layer went missing",
            ))
        })
    }

    fn image(&self, r: &Reference, rec: &ImageRecord) -> Option<Image> {
        let mut layers: Vec<PathBuf> = Vec::new();
        // Bottom first; a repeated layer only at its topmost place.
        for (i, l) in rec.layers.iter().enumerate() {
            if rec.layers[i + 1..]
                .iter()
                .any(|above| above.diff_id == l.diff_id)
            {
                continue;
            }
            let path = self.layer(digest_hex(&l.diff_id).ok()?);
            if !path.is_dir() {
                return None;
            }
            layers.push(path);
        }
        Some(Image {
            digest: rec.digest.clone(),
            reference: r.to_string(),
            layers,
            config: rec.config.clone(),
        })
    }

    fn gc(&self) -> Result<GcReport, ImageError> {
        let mut report = GcReport {
            temps_removed: self.remove_temps()?,
            ..GcReport::default()
        };
        let mut blobs = std::collections::HashSet::new();
        let mut layers = std::collections::HashSet::new();
        let mut images = std::collections::HashSet::new();
        for e in read_dir(&self.images())? {
            let named = e.file_name().to_str().is_some_and(|n| n.ends_with(".json"));
            let rec = match named {
                true => read_record::<ImageRecord>(&e.path())?,
                false => None,
            };
            let Some(rec) = rec else {
                remove_any(&e.path())
                    .map_err(ImageError::io(format!("remove {}", e.path().display())))?;
                report.records_removed += 1;
                continue;
            };
            for d in std::iter::once(&rec.digest)
                .chain(&rec.index_digests)
                .chain(std::iter::once(&rec.config_digest))
                .chain(rec.layers.iter().map(|l| &l.digest))
            {
                blobs.insert(d.trim_start_matches("sha256:").to_string());
            }
            for l in &rec.layers {
                layers.insert(l.diff_id.trim_start_matches("sha256:").to_string());
            }
            images.insert(rec.digest.clone());
        }
        for dir in [self.refs(), self.indexes()] {
            for e in read_dir(&dir)? {
                if e.path() == self.indexes() {
                    continue;
                }
                let live = read_record::<RefRecord>(&e.path())?
                    .is_some_and(|r| images.contains(&r.digest));
                if !live {
                    remove_any(&e.path())
                        .map_err(ImageError::io(format!("remove {}", e.path().display())))?;
                    report.records_removed += 1;
                }
            }
        }
        for e in read_dir(&self.blobs())? {
            if !blobs.contains(e.file_name().to_string_lossy().as_ref()) {
                let size = e.metadata().map(|m| m.len()).unwrap_or(0);
                remove_any(&e.path())
                    .map_err(ImageError::io(format!("remove {}", e.path().display())))?;
                report.blobs_removed += 1;
                report.bytes_freed += size;
            }
        }
        for e in read_dir(&self.layers())? {
            if !layers.contains(e.file_name().to_string_lossy().as_ref()) {
                remove_any(&e.path())
                    .map_err(ImageError::io(format!("remove {}", e.path().display())))?;
                report.layers_removed += 1;
            }
        }
        Ok(report)
    }
}

fn read_dir(dir: &Path) -> Result<Vec<fs::DirEntry>, ImageError> {
    let what = format!("read {}", dir.display());
    fs::read_dir(dir)
        .and_then(|it| it.collect::<io::Result<Vec<_>>>())
        .map_err(ImageError::io(what))
}

/// One pull's registry side.
struct Puller<'a> {
    client: &'a oci_client::Client,
    r: &'a Reference,
    oref: oci_client::Reference,
    auth: RegistryAuth,
    secret: String,
}

impl Puller<'_> {
    /// A manifest or index, checked against `expected` when the digest is known.
    async fn manifest(
        &self,
        r: &Reference,
        expected: Option<&str>,
    ) -> Result<(Vec<u8>, String), ImageError> {
        let (body, _) = self
            .client
            .pull_manifest_raw(&r.to_oci(), &self.auth, ACCEPTED_MANIFESTS)
            .await
            .map_err(|e| self.error(e, &format!("manifest of {r}")))?;
        let digest = sha256_digest(&body);
        if let Some(expected) = expected {
            if digest != expected {
                return Err(ImageError::DigestMismatch {
                    what: format!("manifest of {r}"),
                    expected: expected.to_string(),
                    actual: digest,
                });
            }
        }
        Ok((body.to_vec(), digest))
    }

    /// A small blob (a config), in memory, verified.
    async fn small_blob(&self, d: &Descriptor) -> Result<Vec<u8>, ImageError> {
        let mut body = Vec::new();
        self.client
            .pull_blob(&self.oref, &descriptor(d), &mut body)
            .await
            .map_err(|e| self.error(e, &format!("blob {}", d.digest)))?;
        let actual = sha256_digest(&body);
        if actual != d.digest {
            return Err(ImageError::DigestMismatch {
                what: format!("blob {}", d.digest),
                expected: d.digest.clone(),
                actual,
            });
        }
        Ok(body)
    }

    /// [`Self::layer_blob`] when one of `slots` is free.
    async fn layer_blob_in(
        &self,
        slots: &tokio::sync::Semaphore,
        layout: &Layout,
        d: &Descriptor,
        progress: &(dyn Fn(Progress) + Send + Sync),
    ) -> Result<(), ImageError> {
        let _slot = slots
            .acquire()
            .await
            .map_err(|e| ImageError::io("downloading a layer")(io::Error::other(e)))?;
        self.layer_blob(layout, d, progress).await
    }

    /// Downloads a layer blob into `blobs/`, verified on the way (a temp file renamed into
    /// place only when its sha256 and size are the descriptor's).
    async fn layer_blob(
        &self,
        layout: &Layout,
        d: &Descriptor,
        progress: &(dyn Fn(Progress) + Send + Sync),
    ) -> Result<(), ImageError> {
        let hex = digest_hex(&d.digest)?;
        let path = layout.blob(hex);
        let total = u64::try_from(d.size).unwrap_or(0);
        if path.exists() {
            progress(Progress {
                layer: d.digest.clone(),
                done: total,
                total,
            });
            return Ok(());
        }
        let what = format!("blob {}", d.digest);
        let tmp = TempPath::new(&layout.blobs(), hex);
        let mut stream = self
            .client
            .pull_blob_stream(&self.oref, &descriptor(d))
            .await
            .map_err(|e| self.error(e, &what))?;
        // Made here, not on a blocking thread, so that a dropped pull's guard never races
        // with the file's creation.
        let mut file = tokio::fs::File::from_std(
            File::create(&tmp.path)
                .map_err(ImageError::io(format!("create {}", tmp.path.display())))?,
        );
        let mut hasher = Sha256::new();
        let mut done = 0u64;
        let mismatch = |actual: String| ImageError::DigestMismatch {
            what: what.clone(),
            expected: d.digest.clone(),
            actual,
        };
        progress(Progress {
            layer: d.digest.clone(),
            done,
            total,
        });
        while let Some(chunk) = stream.next().await {
            let chunk = match chunk {
                Ok(c) => c,
                Err(e) => {
                    if e.get_ref().is_some_and(|i| i.is::<DigestError>()) {
                        return Err(mismatch(format!(
                            "sha256:{}",
                            hex::encode(hasher.finalize())
                        )));
                    }
                    return Err(self.network(format!("{what}: {e}")));
                }
            };
            hasher.update(&chunk);
            done += chunk.len() as u64;
            if total > 0 && done > total {
                return Err(mismatch(format!("more than the {total} bytes announced")));
            }
            file.write_all(&chunk)
                .await
                .map_err(ImageError::io(format!("write {}", tmp.path.display())))?;
            progress(Progress {
                layer: d.digest.clone(),
                done,
                total,
            });
        }
        file.sync_all()
            .await
            .map_err(ImageError::io(format!("write {}", tmp.path.display())))?;
        drop(file);
        let actual = format!("sha256:{}", hex::encode(hasher.finalize()));
        if actual != d.digest {
            return Err(mismatch(actual));
        }
        if total > 0 && done != total {
            return Err(mismatch(format!("{done} bytes, not {total}")));
        }
        tmp.persist(&path)
            .map_err(ImageError::io(format!("rename to {}", path.display())))?;
        Ok(())
    }

    fn network(&self, message: String) -> ImageError {
        ImageError::Network {
            registry: self.r.registry_addr().to_string(),
            message: self.scrub(message),
        }
    }

    fn scrub(&self, message: String) -> String {
        if self.secret.is_empty() {
            message
        } else {
            message.replace(&self.secret, "<redacted>")
        }
    }

    /// A registry client's error as this crate's.
    fn error(&self, e: OciDistributionError, what: &str) -> ImageError {
        use OciDistributionError as E;
        let unauthorized = || ImageError::Unauthorized {
            registry: self.r.registry_addr().to_string(),
        };
        let not_found = || ImageError::NotFound(what.to_string());
        match e {
            E::UnauthorizedError { .. } | E::AuthenticationFailure(_) => unauthorized(),
            E::RegistryError { envelope, .. } => {
                let codes: Vec<&OciErrorCode> = envelope.errors.iter().map(|e| &e.code).collect();
                if codes
                    .iter()
                    .any(|c| matches!(c, OciErrorCode::Unauthorized | OciErrorCode::Denied))
                {
                    unauthorized()
                } else if codes.iter().any(|c| {
                    matches!(
                        c,
                        OciErrorCode::ManifestUnknown
                            | OciErrorCode::NameUnknown
                            | OciErrorCode::NotFound
                            | OciErrorCode::BlobUnknown
                    )
                }) {
                    not_found()
                } else {
                    self.network(format!("{what}: {envelope}"))
                }
            }
            E::ServerError { code, message, .. } => match code {
                401 | 403 => unauthorized(),
                404 => not_found(),
                _ => self.network(format!("{what}: HTTP {code}: {message}")),
            },
            E::ImageManifestNotFoundError(_) => not_found(),
            E::DigestError(DigestError::VerificationError { expected, actual }) => {
                ImageError::DigestMismatch {
                    what: what.to_string(),
                    expected,
                    actual,
                }
            }
            E::UnsupportedMediaTypeError(t) | E::IncompatibleLayerMediaTypeError(t) => {
                ImageError::UnsupportedMediaType(t)
            }
            E::UnsupportedSchemaVersionError(v) => {
                ImageError::UnsupportedMediaType(format!("manifest schema version {v}"))
            }
            E::ManifestParsingError(m) | E::VersionedParsingError(m) => {
                ImageError::invalid(format!("{what}: {m}"))
            }
            other => self.network(format!("{what}: {}", error_chain(&other))),
        }
    }
}

/// An error with its sources (reqwest's own message alone says only "error sending request").
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        let msg = inner.to_string();
        if !s.contains(&msg) {
            s.push_str(": ");
            s.push_str(&msg);
        }
        cur = inner.source();
    }
    s
}

fn descriptor(d: &Descriptor) -> OciDescriptor {
    OciDescriptor {
        media_type: d.media_type.clone(),
        digest: d.digest.clone(),
        size: d.size,
        urls: d.urls.clone(),
        ..OciDescriptor::default()
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
    fn reference_file_names() {
        let l = Layout::new(Path::new("/s"));
        assert_eq!(
            l.reference("127.0.0.1:5000/team/app:v1"),
            Path::new("/s/refs/127.0.0.1%3A5000%2Fteam%2Fapp%3Av1")
        );
        let long = format!("docker.io/{}:t", "a".repeat(300));
        let name = l.reference(&long);
        assert!(name.file_name().unwrap().len() < 100);
        assert_ne!(
            name,
            l.reference(&format!("docker.io/{}:u", "a".repeat(300)))
        );
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
