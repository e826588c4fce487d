//! The store: opened from a URL, and its streamed uploads and downloads of trees and files.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::Path;
use std::sync::Arc;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjectPath;
use object_store::prefix::PrefixStore;
use object_store::{ClientConfigKey, ObjectStore, ObjectStoreExt};

use crate::error::{BlobError, Result};
use crate::pipe::{self, Expect, Moved, Target};
use crate::sparse::SparseWriter;
use crate::{pack, unpack};

/// The fleet's object store: a directory (`file:///path`) or an S3 bucket (`s3://bucket/prefix`).
/// Cheap to clone (one client shared).
#[derive(Clone)]
pub struct Store {
    pub(crate) inner: Arc<dyn ObjectStore>,
    desc: String,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Store").field(&self.desc).finish()
    }
}

/// What one upload or download moved and how long it took.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stats {
    /// The plain stream's bytes: the tar stream of a tree, a file's length.
    pub bytes: u64,
    /// The object's bytes (zstd-compressed).
    pub stored_bytes: u64,
    /// The object's sha256 (of the stored bytes), lowercase hex.
    pub sha256: String,
    /// A tree's entries (files, directories, links, devices, the root); 0 for a file.
    pub entries: u64,
    pub ms: u64,
}

impl Stats {
    fn new(m: Moved, entries: u64) -> Self {
        Stats {
            bytes: m.bytes,
            stored_bytes: m.stored_bytes,
            sha256: m.sha256,
            entries,
            ms: m.ms,
        }
    }

    /// Plain megabytes (10^6 bytes) per second.
    pub fn mb_per_s(&self) -> f64 {
        self.bytes as f64 / 1e6 / (self.ms.max(1) as f64 / 1e3)
    }
}

fn truthy(v: &str) -> bool {
    matches!(
        v.trim().to_ascii_lowercase().as_str(),
        "1" | "true" | "on" | "yes" | "y"
    )
}

impl Store {
    /// Opens the store a URL names, S3's settings from this process's environment (see
    /// [`Store::open_with_env`]).
    pub fn open(url: &str) -> Result<Store> {
        Self::open_with_env(url, std::env::vars())
    }

    /// Opens the store a URL names:
    /// - `file:///absolute/path`: a directory, made if missing; every object written is
    ///   fsynced before the call answers.
    /// - `s3://bucket[/prefix]`: a bucket, its objects under `prefix/`; the endpoint, region
    ///   and keys from the `AWS_*` variables of `env` (`AWS_ENDPOINT_URL`, `AWS_REGION`
    ///   (default `us-east-1`), `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
    ///   `AWS_SESSION_TOKEN`, `AWS_ALLOW_HTTP` for a plain-HTTP endpoint,
    ///   `AWS_VIRTUAL_HOSTED_STYLE_REQUEST`; requests are path-style by default, as SeaweedFS and
    ///   MinIO want). Without keys, the instance's credentials are asked for.
    pub fn open_with_env<I, K, V>(url: &str, env: I) -> Result<Store>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: Into<String>,
    {
        let bad = |why: &str| BlobError::BadUrl {
            url: url.to_string(),
            why: why.to_string(),
        };
        let parsed = url::Url::parse(url).map_err(|e| bad(&format!("not a URL ({e})")))?;
        if parsed.query().is_some() || parsed.fragment().is_some() {
            return Err(bad("a store URL has no query or fragment"));
        }
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err(bad(
                "keys are not taken in the URL (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)",
            ));
        }
        match parsed.scheme() {
            "file" => {
                if parsed.host_str().is_some_and(|h| !h.is_empty()) {
                    return Err(bad("a file URL names no host: file:///absolute/path"));
                }
                let path = parsed
                    .to_file_path()
                    .map_err(|()| bad("not an absolute path"))?;
                let desc = format!("file://{}", path.display());
                let setup = |why: String| BlobError::Setup {
                    store: desc.clone(),
                    why,
                };
                fs::create_dir_all(&path).map_err(|e| setup(e.to_string()))?;
                let local = LocalFileSystem::new_with_prefix(&path)
                    .map_err(|e| setup(e.to_string()))?
                    .with_automatic_cleanup(true)
                    .with_fsync(true);
                Ok(Store {
                    inner: Arc::new(local),
                    desc,
                })
            }
            "s3" => {
                let bucket = parsed
                    .host_str()
                    .filter(|b| !b.is_empty())
                    .ok_or_else(|| bad("no bucket: s3://bucket[/prefix]"))?
                    .to_string();
                let prefix = parsed.path().trim_matches('/').to_string();
                if !prefix.is_empty() {
                    ObjectPath::parse(&prefix)
                        .map_err(|e| bad(&format!("the prefix {prefix:?}: {e}")))?;
                }
                let mut builder = AmazonS3Builder::new();
                for (k, v) in env {
                    let k = k.as_ref();
                    if !k.starts_with("AWS_") {
                        continue;
                    }
                    if let Ok(key) = k.to_ascii_lowercase().parse::<AmazonS3ConfigKey>() {
                        builder = builder.with_config(key, v);
                    }
                }
                builder = builder.with_bucket_name(&bucket);
                let endpoint = builder.get_config_value(&AmazonS3ConfigKey::Endpoint);
                let region = builder
                    .get_config_value(&AmazonS3ConfigKey::Region)
                    .unwrap_or_else(|| "us-east-1".to_string());
                builder = builder.with_region(&region);
                let shown_prefix = if prefix.is_empty() {
                    String::new()
                } else {
                    format!("/{prefix}")
                };
                let desc = format!(
                    "s3://{bucket}{shown_prefix} (endpoint {}, region {region})",
                    endpoint.as_deref().unwrap_or("AWS")
                );
                let setup = |why: String| BlobError::Setup {
                    store: desc.clone(),
                    why,
                };
                let allow_http = builder
                    .get_config_value(&AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp))
                    .is_some_and(|v| truthy(&v));
                if let Some(ep) = &endpoint {
                    if ep.starts_with("http://") && !allow_http {
                        return Err(setup(
                            "AWS_ENDPOINT_URL is plain HTTP: set AWS_ALLOW_HTTP=true to use it"
                                .to_string(),
                        ));
                    }
                }
                let s3 = builder.build().map_err(|e| setup(e.to_string()))?;
                let inner: Arc<dyn ObjectStore> = if prefix.is_empty() {
                    Arc::new(s3)
                } else {
                    Arc::new(PrefixStore::new(s3, prefix.as_str()))
                };
                Ok(Store { inner, desc })
            }
            other => Err(bad(&format!("the scheme {other:?} is not taken"))),
        }
    }

    /// The store for logs: its URL, endpoint and region, never its keys.
    pub fn describe(&self) -> &str {
        &self.desc
    }

    pub(crate) fn target(&self, key: &str) -> Result<Target> {
        Ok(Target {
            store: Arc::clone(&self.inner),
            path: object_path(key)?,
            desc: self.desc.clone(),
        })
    }

    /// Uploads the directory `dir` (see the crate's docs for what a tree keeps) as a
    /// zstd-compressed tar stream at `key`, streamed: memory stays bounded whatever its size.
    /// An upload that fails, or whose future is dropped, leaves nothing at `key`.
    pub async fn put_tree(&self, key: &str, dir: &Path) -> Result<Stats> {
        let target = self.target(key)?;
        put_tree_at(&target, dir).await
    }

    /// Downloads the tree at `key` into `dest`, a new or empty directory (made if missing),
    /// refusing any entry that would land outside it. On a failure what it made is taken away.
    pub async fn get_tree(&self, key: &str, dest: &Path) -> Result<Stats> {
        let target = self.target(key)?;
        get_tree_at(&target, dest, None).await
    }

    /// Uploads one file (a disk image, say) zstd-compressed at `key`, streamed.
    pub async fn put_file(&self, key: &str, path: &Path) -> Result<Stats> {
        let target = self.target(key)?;
        put_file_at(&target, path).await
    }

    /// Downloads the file at `key` into `dest`, which must not exist; runs of zeros become
    /// holes (a sparse disk image stays sparse). On a failure the file is removed.
    pub async fn get_file(&self, key: &str, dest: &Path) -> Result<Stats> {
        let target = self.target(key)?;
        get_file_at(&target, dest, None).await
    }

    /// Uploads what `reader` gives (a `btrfs send` stream, say) zstd-compressed at `key`.
    pub async fn put_reader<R: Read + Send + 'static>(
        &self,
        key: &str,
        reader: R,
    ) -> Result<Stats> {
        let target = self.target(key)?;
        put_reader_at(&target, reader).await
    }

    /// Downloads the object at `key` into `writer` (a `btrfs receive`'s stdin, say), zstd
    /// undone; hands the writer back.
    pub async fn get_writer<W: Write + Send + 'static>(
        &self,
        key: &str,
        writer: W,
    ) -> Result<(W, Stats)> {
        let target = self.target(key)?;
        get_writer_at(&target, writer, None).await
    }

    /// Whether an object is at `key`.
    pub async fn exists(&self, key: &str) -> Result<bool> {
        let target = self.target(key)?;
        match self.inner.head(&target.path).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(target.store_err(e)),
        }
    }

    /// Deletes the object at `key`; one that is not there is no error.
    pub async fn delete(&self, key: &str) -> Result<()> {
        let target = self.target(key)?;
        delete_at(&target).await
    }
}

pub(crate) fn object_path(key: &str) -> Result<ObjectPath> {
    let bad = |why| BlobError::BadName {
        what: "key",
        value: key.to_string(),
        why,
    };
    if key.is_empty() {
        return Err(bad("empty"));
    }
    ObjectPath::parse(key)
        .map_err(|_| bad("a key is segments joined by `/`, none empty, `.` or `..`"))
}

pub(crate) async fn delete_at(target: &Target) -> Result<()> {
    match target.store.delete(&target.path).await {
        Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
        Err(e) => Err(target.store_err(e)),
    }
}

pub(crate) async fn put_tree_at(target: &Target, dir: &Path) -> Result<Stats> {
    // A missing directory is told before an upload is begun.
    let meta = fs::symlink_metadata(dir).map_err(|e| BlobError::io(dir, e))?;
    if !meta.is_dir() {
        return Err(BlobError::NotADirectory {
            path: dir.to_path_buf(),
        });
    }
    let dir = dir.to_path_buf();
    let (packed, moved) = pipe::upload(target, move |w| pack::pack_tree(&dir, w)).await?;
    if packed.skipped > 0 {
        tracing::debug!(key = %target.key(), sockets = packed.skipped, "sockets left out of a tree");
    }
    Ok(Stats::new(moved, packed.entries))
}

pub(crate) async fn put_file_at(target: &Target, path: &Path) -> Result<Stats> {
    let file = File::open(path).map_err(|e| BlobError::io(path, e))?;
    let meta = file.metadata().map_err(|e| BlobError::io(path, e))?;
    if !meta.is_file() {
        return Err(BlobError::io(
            path,
            io::Error::new(io::ErrorKind::InvalidInput, "not a regular file"),
        ));
    }
    let shown = path.to_path_buf();
    let (_, moved) = pipe::upload(target, move |w| {
        let mut file = file;
        io::copy(&mut file, w).map_err(|e| BlobError::io(&shown, e))
    })
    .await?;
    Ok(Stats::new(moved, 0))
}

pub(crate) async fn put_reader_at<R: Read + Send + 'static>(
    target: &Target,
    reader: R,
) -> Result<Stats> {
    let key = target.key();
    let (_, moved) = pipe::upload(target, move |w| {
        let mut reader = reader;
        io::copy(&mut reader, w).map_err(|e| BlobError::io(format!("the stream for {key}"), e))
    })
    .await?;
    Ok(Stats::new(moved, 0))
}

/// Makes `dest` ready for a tree: true when it was made here.
fn prepare_dest(dest: &Path) -> Result<bool> {
    match fs::symlink_metadata(dest) {
        Ok(m) if m.is_dir() => {
            let mut entries = fs::read_dir(dest).map_err(|e| BlobError::io(dest, e))?;
            if entries.next().is_some() {
                return Err(BlobError::DestinationInUse {
                    path: dest.to_path_buf(),
                });
            }
            Ok(false)
        }
        Ok(_) => Err(BlobError::DestinationInUse {
            path: dest.to_path_buf(),
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            fs::create_dir_all(dest).map_err(|e| BlobError::io(dest, e))?;
            Ok(true)
        }
        Err(e) => Err(BlobError::io(dest, e)),
    }
}

/// Takes away what a failed download made in `dest`.
fn clear_dest(dest: &Path, made: bool) {
    let res = if made {
        fs::remove_dir_all(dest)
    } else {
        fs::read_dir(dest).and_then(|entries| {
            for e in entries {
                let e = e?;
                if e.file_type()?.is_dir() {
                    fs::remove_dir_all(e.path())?;
                } else {
                    fs::remove_file(e.path())?;
                }
            }
            Ok(())
        })
    };
    if let Err(e) = res {
        tracing::warn!("{}: a failed download left files: {e}", dest.display());
    }
}

pub(crate) async fn get_tree_at(
    target: &Target,
    dest: &Path,
    expect: Option<Expect>,
) -> Result<Stats> {
    let made = prepare_dest(dest)?;
    let key = target.key();
    let into = dest.to_path_buf();
    let cleared = dest.to_path_buf();
    let (unpacked, moved) = pipe::download(
        target,
        expect,
        move |r| unpack::unpack_tree(&key, r, &into),
        move || clear_dest(&cleared, made),
    )
    .await?;
    Ok(Stats::new(moved, unpacked.entries))
}

pub(crate) async fn get_file_at(
    target: &Target,
    dest: &Path,
    expect: Option<Expect>,
) -> Result<Stats> {
    let file = File::options()
        .write(true)
        .create_new(true)
        .open(dest)
        .map_err(|e| {
            if e.kind() == io::ErrorKind::AlreadyExists {
                BlobError::DestinationInUse {
                    path: dest.to_path_buf(),
                }
            } else {
                BlobError::io(dest, e)
            }
        })?;
    let into = dest.to_path_buf();
    let removed = dest.to_path_buf();
    let (_, moved) = pipe::download(
        target,
        expect,
        move |r| {
            let mut w = SparseWriter::new(file);
            io::copy(r, &mut w).map_err(|e| BlobError::io(&into, e))?;
            w.finish().map_err(|e| BlobError::io(&into, e))?;
            Ok(())
        },
        move || {
            if let Err(e) = fs::remove_file(&removed) {
                tracing::warn!("{}: a failed download left it: {e}", removed.display());
            }
        },
    )
    .await?;
    Ok(Stats::new(moved, 0))
}

pub(crate) async fn get_writer_at<W: Write + Send + 'static>(
    target: &Target,
    writer: W,
    expect: Option<Expect>,
) -> Result<(W, Stats)> {
    let key = target.key();
    let (writer, moved) = pipe::download(
        target,
        expect,
        move |r| {
            let mut writer = writer;
            io::copy(r, &mut writer)
                .and_then(|_| writer.flush())
                .map_err(|e| BlobError::io(format!("the stream of {key}"), e))?;
            Ok(writer)
        },
        || {},
    )
    .await?;
    Ok((writer, Stats::new(moved, 0)))
}
