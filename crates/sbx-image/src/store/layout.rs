//! The store on disk: its paths, the records (images, refs), temp paths renamed into place,
//! the lock, blobs and layers put in place, images recorded and looked up, and gc.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::ImageError;
use crate::manifest::{digest_hex, ImageConfig};
use crate::reference::Reference;
use crate::unpack::unpack_blob;

use super::{GcReport, Image};

/// A resolved image as stored in `images/<hex>.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct ImageRecord {
    pub(super) digest: String,
    pub(super) references: Vec<String>,
    #[serde(default)]
    pub(super) index_digests: Vec<String>,
    pub(super) config_digest: String,
    pub(super) layers: Vec<LayerRecord>,
    pub(super) config: ImageConfig,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct LayerRecord {
    pub(super) digest: String,
    pub(super) diff_id: String,
    pub(super) media_type: String,
    pub(super) size: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct RefRecord {
    reference: String,
    pub(super) digest: String,
}

#[derive(Serialize, Deserialize)]
struct StoreMeta {
    uid_base: u32,
}

const TMP_PREFIX: &str = ".tmp-";
static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A temp path removed when dropped, unless kept.
pub(super) struct TempPath {
    pub(super) path: PathBuf,
    keep: bool,
}

impl TempPath {
    pub(super) fn new(dir: &Path, what: &str) -> TempPath {
        let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("{TMP_PREFIX}{}-{n}-{what}", std::process::id()));
        TempPath { path, keep: false }
    }

    /// Renames it to `to`. `Ok(false)` when `to` (a directory) already exists complete.
    pub(super) fn persist(mut self, to: &Path) -> io::Result<bool> {
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

pub(super) fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Option<T> {
    serde_json::from_slice(&fs::read(path).ok()?).ok()
}

/// A record for gc: `None` when its content is not one (it is then garbage); an error when it
/// cannot be read, so that a failing disk never makes gc drop a live image and its layers.
fn read_record<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Option<T>, ImageError> {
    let body = fs::read(path).map_err(ImageError::io(format!("read {}", path.display())))?;
    Ok(serde_json::from_slice(&body).ok())
}

pub(super) fn sha256_digest(body: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(body)))
}

/// Paths of the store and the operations on them that need no network.
#[derive(Clone)]
pub(super) struct Layout {
    root: PathBuf,
}

impl Layout {
    pub(super) fn new(root: &Path) -> Layout {
        Layout {
            root: root.to_path_buf(),
        }
    }

    pub(super) fn blobs(&self) -> PathBuf {
        self.root.join("blobs").join("sha256")
    }
    pub(super) fn blob(&self, hex: &str) -> PathBuf {
        self.blobs().join(hex)
    }
    fn layers(&self) -> PathBuf {
        self.root.join("layers")
    }
    pub(super) fn layer(&self, hex: &str) -> PathBuf {
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
    pub(super) fn reference(&self, normalised: &str) -> PathBuf {
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

    pub(super) fn init(&self, uid_base: u32) -> Result<(), ImageError> {
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

    pub(super) fn uid_base_is(&self, uid_base: u32) -> bool {
        read_json::<StoreMeta>(&self.root.join("store.json"))
            .is_some_and(|m| m.uid_base == uid_base)
    }

    pub(super) fn lock(&self, arg: FlockArg) -> Result<Flock<File>, ImageError> {
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
    pub(super) async fn lock_for_pull(&self) -> Result<Flock<File>, ImageError> {
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

    pub(super) fn put_blob(&self, digest: &str, body: &[u8]) -> Result<(), ImageError> {
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

    pub(super) fn read_blob(&self, digest: &str) -> Option<Vec<u8>> {
        fs::read(self.blob(digest_hex(digest).ok()?)).ok()
    }

    /// Unpacks a layer blob into a temp directory and renames it to `layers/<diff_id hex>`.
    pub(super) fn make_layer(
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
    pub(super) fn complete(&self, digest: &str) -> Option<ImageRecord> {
        let rec: ImageRecord = read_json(&self.image_path(digest_hex(digest).ok()?))?;
        let all = rec
            .layers
            .iter()
            .all(|l| digest_hex(&l.diff_id).is_ok_and(|h| self.layer(h).is_dir()));
        all.then_some(rec)
    }

    /// The complete image a digest names: an image manifest's, or an index's that was resolved.
    pub(super) fn complete_by_digest(&self, digest: &str) -> Option<ImageRecord> {
        self.complete(digest).or_else(|| self.index_target(digest))
    }

    pub(super) fn index_target(&self, index_digest: &str) -> Option<ImageRecord> {
        let rf: RefRecord = read_json(&self.indexes().join(digest_hex(index_digest).ok()?))?;
        self.complete(&rf.digest)
    }

    /// Records that `r` (and `index_digest`, when the image came through an index) names `rec`,
    /// writes the record, and returns the image.
    pub(super) fn remember(
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

    pub(super) fn image(&self, r: &Reference, rec: &ImageRecord) -> Option<Image> {
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

    pub(super) fn gc(&self) -> Result<GcReport, ImageError> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
