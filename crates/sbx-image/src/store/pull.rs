//! A pull: the manifest (an index resolved to its linux/amd64 image), the config, the layer
//! blobs downloaded and verified, the layers unpacked; and the registry client's errors as
//! this crate's.

use std::fs::File;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use futures_util::StreamExt;
use nix::fcntl::Flock;
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::{DigestError, OciDistributionError, OciErrorCode};
use oci_client::manifest::OciDescriptor;
use oci_client::secrets::RegistryAuth;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

use crate::error::ImageError;
use crate::manifest::{
    digest_hex, parse_config, parse_manifest, pick_linux_amd64, Descriptor, Manifest,
    ACCEPTED_MANIFESTS,
};
use crate::reference::{parse_reference, Reference};

use super::layout::{sha256_digest, ImageRecord, LayerRecord, Layout, TempPath};
use super::{Credentials, Image, Progress, Store};

impl Store {
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

    pub(super) async fn pull_inner(
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
