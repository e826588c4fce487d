//! A real OCI registry on loopback for sbx's tests and benches, and images written by hand to
//! push to it. Dev-only (`publish = false`): sbx-image's and sandboxd's tests and the images
//! bench use it; nothing of the product does.
//!
//! - [`Registry`]: Debian's `docker-registry` (distribution 2.8) started on `127.0.0.1` with its
//!   own storage and a free port, with or without htpasswd auth (the bcrypt hash is written
//!   here), killed and its directory removed when dropped — also when a test fails. Blobs,
//!   manifests, images and multi-arch indexes are pushed with the registry's own push API.
//! - [`Tar`]: layer tars entry by entry, or a whole directory tree with owners shifted back
//!   ([`Tar::tree`]). [`Layer`]: a tar compressed (gzip, zstd or none), its digest and diff_id.
//!
//! Nothing here names a host but loopback: tests and benches never pull from the internet.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::json;
use sha2::{Digest, Sha256};

pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const OCI_LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
pub const OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const OCI_LAYER_ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";

/// Why starting the registry, pushing to it or writing a layer failed.
#[derive(Debug, thiserror::Error)]
pub enum RegError {
    #[error(
        "Debian's docker-registry is not installed (apt-get install docker-registry): \
         the registry tests and the images bench need it"
    )]
    NotInstalled,
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("the registry did not start: {0}")]
    Start(String),
    #[error("htpasswd: {0}")]
    Htpasswd(String),
    /// A push the registry refused or did not answer.
    #[error("{what}: {message}")]
    Push { what: String, message: String },
    /// A tar entry a header cannot hold.
    #[error("tar entry {name}: {source}")]
    Tar {
        name: String,
        #[source]
        source: io::Error,
    },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> RegError {
    let what = what.into();
    move |source| RegError::Io { what, source }
}

/// `sha256:<hex>` of `body`.
pub fn sha256(body: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(body)))
}

/// The hex part of a `sha256:` digest.
pub fn hex_of(digest: &str) -> &str {
    digest.trim_start_matches("sha256:")
}

// ---------------------------------------------------------------------------------------------
// The registry.

/// A `docker-registry` serving on loopback. Dropping it kills it and removes its storage.
pub struct Registry {
    child: Child,
    dir: tempfile::TempDir,
    port: u16,
    auth: Option<(String, String)>,
    http: ureq::Agent,
}

impl Registry {
    /// Starts a registry with its storage in a new directory under the system's temp
    /// directory. With `auth` (`user`, `password`) every request needs that login (htpasswd,
    /// HTTP basic).
    pub fn start(auth: Option<(&str, &str)>) -> Result<Registry, RegError> {
        Registry::start_in(&std::env::temp_dir(), auth)
    }

    /// As [`Registry::start`], with the storage in a new directory under `parent` (a bench
    /// pushing large images picks a disk).
    pub fn start_in(parent: &Path, auth: Option<(&str, &str)>) -> Result<Registry, RegError> {
        let bin = "docker-registry";
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {bin}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            return Err(RegError::NotInstalled);
        }
        // A port picked here may be taken before the registry binds it: then another one.
        let mut last = String::new();
        for _ in 0..3 {
            match Registry::spawn(bin, parent, auth)? {
                Ok(reg) => return Ok(reg),
                Err(why) => last = why,
            }
        }
        Err(RegError::Start(last))
    }

    /// One attempt: the registry, or why it did not come up (its log).
    fn spawn(
        bin: &str,
        parent: &Path,
        auth: Option<(&str, &str)>,
    ) -> Result<Result<Registry, String>, RegError> {
        let dir = tempfile::Builder::new()
            .prefix("sbx-registry-")
            .tempdir_in(parent)
            .map_err(io_err(format!("mkdir in {}", parent.display())))?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(io_err("pick a free port on loopback"))?
            .port();
        let storage = dir.path().join("storage");
        fs::create_dir(&storage).map_err(io_err(format!("mkdir {}", storage.display())))?;
        let mut config = format!(
            "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: false\n\
             storage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\n\
             http:\n  addr: 127.0.0.1:{port}\n",
            storage.display()
        );
        if let Some((user, pass)) = auth {
            let hash = bcrypt::hash_with_result(pass, 4)
                .map_err(|e| RegError::Htpasswd(e.to_string()))?
                .format_for_version(bcrypt::Version::TwoA);
            let htpasswd = dir.path().join("htpasswd");
            fs::write(&htpasswd, format!("{user}:{hash}\n"))
                .map_err(io_err(format!("write {}", htpasswd.display())))?;
            config.push_str(&format!(
                "auth:\n  htpasswd:\n    realm: sbx-test\n    path: {}\n",
                htpasswd.display()
            ));
        }
        let config_path = dir.path().join("config.yml");
        fs::write(&config_path, config)
            .map_err(io_err(format!("write {}", config_path.display())))?;
        let log_path = dir.path().join("registry.log");
        let log = fs::File::create(&log_path)
            .map_err(io_err(format!("create {}", log_path.display())))?;
        let log2 = log
            .try_clone()
            .map_err(io_err(format!("open {}", log_path.display())))?;
        let child = Command::new(bin)
            .arg("serve")
            .arg(&config_path)
            .stdin(Stdio::null())
            .stdout(log2)
            .stderr(log)
            .spawn()
            .map_err(io_err(format!("start {bin}")))?;
        let http = ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_secs(5))
            .timeout_read(Duration::from_secs(300))
            .timeout_write(Duration::from_secs(300))
            .build();
        let mut reg = Registry {
            child,
            dir,
            port,
            auth: auth.map(|(u, p)| (u.to_string(), p.to_string())),
            http,
        };
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            match reg.http.get(&format!("{}/v2/", reg.url())).call() {
                Ok(_) | Err(ureq::Error::Status(401, _)) => return Ok(Ok(reg)),
                Err(e) => {
                    let exited = matches!(reg.child.try_wait(), Ok(Some(_)));
                    if exited || Instant::now() > deadline {
                        return Ok(Err(format!("{e}\n{}", reg.log())));
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// `127.0.0.1:PORT`, as image references write it (and `--insecure-registry` takes it).
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The registry's log (its access log included).
    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("registry.log")).unwrap_or_default()
    }

    /// GETs of `kind` (`blobs` or `manifests`) in the access log.
    pub fn gets(&self, kind: &str) -> usize {
        // The access log line is written as the response completes.
        std::thread::sleep(Duration::from_millis(150));
        self.log()
            .lines()
            .filter(|l| l.contains("\"GET /v2/") && l.contains(&format!("/{kind}/")))
            .count()
    }

    fn authorize(&self, req: ureq::Request) -> ureq::Request {
        match &self.auth {
            Some((u, p)) => {
                let token = base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"));
                req.set("Authorization", &format!("Basic {token}"))
            }
            None => req,
        }
    }

    /// Pushes a blob (a monolithic upload); its digest.
    pub fn push_blob(&self, repo: &str, body: &[u8]) -> Result<String, RegError> {
        let digest = sha256(body);
        let what = || format!("push blob {digest} to {repo}");
        let push_err = |e: ureq::Error| RegError::Push {
            what: what(),
            message: e.to_string(),
        };
        let res = self
            .authorize(
                self.http
                    .post(&format!("{}/v2/{repo}/blobs/uploads/", self.url())),
            )
            .call()
            .map_err(push_err)?;
        let Some(location) = res.header("Location") else {
            return Err(RegError::Push {
                what: what(),
                message: "the upload has no Location".into(),
            });
        };
        let location = if location.starts_with('/') {
            format!("{}{location}", self.url())
        } else {
            location.to_string()
        };
        let sep = if location.contains('?') { '&' } else { '?' };
        self.authorize(self.http.put(&format!("{location}{sep}digest={digest}")))
            .set("Content-Type", "application/octet-stream")
            .send_bytes(body)
            .map_err(push_err)?;
        Ok(digest)
    }

    /// Pushes a manifest or index as `repo:reference` (a tag or its digest); its digest.
    pub fn push_manifest(
        &self,
        repo: &str,
        reference: &str,
        media_type: &str,
        body: &[u8],
    ) -> Result<String, RegError> {
        self.authorize(
            self.http
                .put(&format!("{}/v2/{repo}/manifests/{reference}", self.url())),
        )
        .set("Content-Type", media_type)
        .send_bytes(body)
        .map_err(|e| RegError::Push {
            what: format!("push manifest {repo}:{reference}"),
            message: e.to_string(),
        })?;
        Ok(sha256(body))
    }

    /// Pushes `layers`, `config` and an OCI image manifest of them, tagged `tag` (or only by
    /// its digest). Returns the manifest's (digest, size).
    pub fn push_image(
        &self,
        repo: &str,
        tag: Option<&str>,
        layers: &[Layer],
        config: &[u8],
    ) -> Result<(String, usize), RegError> {
        for l in layers {
            self.push_blob(repo, &l.blob)?;
        }
        let config_digest = self.push_blob(repo, config)?;
        let manifest = image_manifest(&config_digest, config.len(), layers);
        let digest = sha256(&manifest);
        self.push_manifest(repo, tag.unwrap_or(&digest), OCI_MANIFEST, &manifest)?;
        Ok((digest, manifest.len()))
    }

    /// Pushes an OCI index of image manifests already pushed, tagged `tag`; its digest.
    pub fn push_index(
        &self,
        repo: &str,
        tag: &str,
        manifests: &[IndexEntry],
    ) -> Result<String, RegError> {
        let entries: Vec<serde_json::Value> = manifests
            .iter()
            .map(|m| {
                let mut platform = json!({"architecture": m.architecture, "os": "linux"});
                if let Some(v) = m.variant {
                    platform["variant"] = json!(v);
                }
                json!({"mediaType": OCI_MANIFEST, "digest": m.digest, "size": m.size,
                       "platform": platform})
            })
            .collect();
        let index = json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries});
        self.push_manifest(repo, tag, OCI_INDEX, index.to_string().as_bytes())
    }

    /// The registry's own copy of a blob (to corrupt it, or to read a manifest back).
    pub fn blob_data(&self, digest: &str) -> PathBuf {
        let hex = hex_of(digest);
        self.dir
            .path()
            .join("storage/docker/registry/v2/blobs/sha256")
            .join(hex.get(..2).unwrap_or(""))
            .join(hex)
            .join("data")
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The storage goes with `dir`.
    }
}

/// One image of an index: its manifest's digest and size, and its platform (os linux).
pub struct IndexEntry<'a> {
    pub digest: &'a str,
    pub size: usize,
    pub architecture: &'a str,
    pub variant: Option<&'a str>,
}

/// An OCI image manifest of a config and layers.
pub fn image_manifest(config_digest: &str, config_size: usize, layers: &[Layer]) -> Vec<u8> {
    json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": config_size},
        "layers": layers.iter().map(|l| json!({
            "mediaType": l.media_type, "digest": l.digest(), "size": l.blob.len()
        })).collect::<Vec<_>>()
    })
    .to_string()
    .into_bytes()
}

// ---------------------------------------------------------------------------------------------
// Layers.

#[derive(Clone, Copy, Debug)]
pub enum Compression {
    Gzip,
    Zstd,
    None,
}

/// A layer blob as a registry serves it.
pub struct Layer {
    pub blob: Vec<u8>,
    pub media_type: &'static str,
    /// sha256 of the uncompressed tar (the config's rootfs.diff_ids).
    pub diff_id: String,
}

impl Layer {
    /// Compresses `tar` (in memory: writing to a Vec does not fail).
    pub fn new(tar: Vec<u8>, c: Compression) -> Layer {
        let diff_id = sha256(&tar);
        let (blob, media_type) = match c {
            Compression::Gzip => {
                let mut e = flate2::write::GzEncoder::new(
                    Vec::with_capacity(tar.len() / 2),
                    flate2::Compression::fast(),
                );
                e.write_all(&tar).expect("gzip into memory");
                (e.finish().expect("gzip into memory"), OCI_LAYER_GZIP)
            }
            Compression::Zstd => (
                zstd::encode_all(&tar[..], 3).expect("zstd into memory"),
                OCI_LAYER_ZSTD,
            ),
            Compression::None => (tar, OCI_LAYER_TAR),
        };
        Layer {
            blob,
            media_type,
            diff_id,
        }
    }

    /// The blob's digest.
    pub fn digest(&self) -> String {
        sha256(&self.blob)
    }
}

/// A layer tar, entry by entry (mtime 1700000000). Entries with names of the caller's own:
/// a name a tar header cannot hold is a bug of the caller and panics; [`Tar::tree`], which
/// reads names from a disk, returns its errors.
pub struct Tar(tar::Builder<Vec<u8>>);

impl Default for Tar {
    fn default() -> Tar {
        Tar::new()
    }
}

impl Tar {
    pub fn new() -> Tar {
        Tar(tar::Builder::new(Vec::new()))
    }

    fn header(kind: tar::EntryType, name: &str, mode: u32, owner: (u64, u64)) -> tar::Header {
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(owner.0);
        h.set_gid(owner.1);
        h.set_mtime(1_700_000_000);
        h.set_size(0);
        if let Err(e) = h.set_path(name) {
            panic!("tar entry {name}: {e}");
        }
        h
    }

    fn append(&mut self, mut h: tar::Header, name: &str, data: &[u8]) -> &mut Tar {
        h.set_cksum();
        if let Err(e) = self.0.append(&h, data) {
            panic!("tar entry {name}: {e}");
        }
        self
    }

    /// An entry of any kind with its data.
    pub fn add(
        &mut self,
        kind: tar::EntryType,
        name: &str,
        mode: u32,
        owner: (u64, u64),
        data: &[u8],
    ) -> &mut Tar {
        let mut h = Tar::header(kind, name, mode, owner);
        h.set_size(data.len() as u64);
        self.append(h, name, data)
    }

    /// A directory, 0755 root's.
    pub fn dir(&mut self, name: &str) -> &mut Tar {
        self.dir_mode(name, 0o755)
    }

    pub fn dir_mode(&mut self, name: &str, mode: u32) -> &mut Tar {
        self.add(tar::EntryType::Directory, name, mode, (0, 0), b"")
    }

    /// A regular file, 0644 root's.
    pub fn file(&mut self, name: &str, data: &[u8]) -> &mut Tar {
        self.file_mode(name, 0o644, data)
    }

    pub fn file_mode(&mut self, name: &str, mode: u32, data: &[u8]) -> &mut Tar {
        self.add(tar::EntryType::Regular, name, mode, (0, 0), data)
    }

    /// A hard link (`tar::EntryType::Link`) or a symlink to `target`.
    pub fn link(&mut self, kind: tar::EntryType, name: &str, target: &str) -> &mut Tar {
        let mut h = Tar::header(kind, name, 0o777, (0, 0));
        if let Err(e) = h.set_link_name(target) {
            panic!("tar entry {name}: {e}");
        }
        self.append(h, name, b"")
    }

    /// A character device.
    pub fn dev(&mut self, name: &str, major: u32, minor: u32) -> &mut Tar {
        let mut h = Tar::header(tar::EntryType::Char, name, 0o666, (0, 0));
        if let Err(e) = h
            .set_device_major(major)
            .and_then(|()| h.set_device_minor(minor))
        {
            panic!("tar entry {name}: {e}");
        }
        self.append(h, name, b"")
    }

    /// Every entry of the directory tree at `root` (its directories, files, symlinks, hard
    /// links, devices and fifos; sockets are skipped), named relative to it, with owners
    /// shifted back by `unshift` (a tree stored with owners shifted into a sandbox's uid
    /// range, as sbx stores images, gives a layer whose root-owned files are root's).
    pub fn tree(&mut self, root: &Path, unshift: u32) -> Result<&mut Tar, RegError> {
        let mut links: HashMap<(u64, u64), String> = HashMap::new();
        self.tree_dir(root, "", unshift, &mut links)?;
        Ok(self)
    }

    fn tree_dir(
        &mut self,
        dir: &Path,
        rel: &str,
        unshift: u32,
        links: &mut HashMap<(u64, u64), String>,
    ) -> Result<(), RegError> {
        let mut entries: Vec<(String, PathBuf)> = fs::read_dir(dir)
            .and_then(|rd| rd.collect::<io::Result<Vec<_>>>())
            .map_err(io_err(format!("read {}", dir.display())))?
            .into_iter()
            .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
            .collect();
        entries.sort();
        for (name, path) in entries {
            let rel = format!("{rel}{name}");
            let m =
                fs::symlink_metadata(&path).map_err(io_err(format!("stat {}", path.display())))?;
            let ft = m.file_type();
            let mut h = tar::Header::new_gnu();
            h.set_mode(m.mode() & 0o7777);
            h.set_uid(u64::from(m.uid().saturating_sub(unshift)));
            h.set_gid(u64::from(m.gid().saturating_sub(unshift)));
            h.set_mtime(u64::try_from(m.mtime()).unwrap_or(0));
            h.set_size(0);
            let tar_err = |source: io::Error| RegError::Tar {
                name: rel.clone(),
                source,
            };
            if ft.is_dir() {
                h.set_entry_type(tar::EntryType::Directory);
                self.0
                    .append_data(&mut h, format!("{rel}/"), io::empty())
                    .map_err(tar_err)?;
                self.tree_dir(&path, &format!("{rel}/"), unshift, links)?;
            } else if ft.is_symlink() {
                let target =
                    fs::read_link(&path).map_err(io_err(format!("readlink {}", path.display())))?;
                h.set_entry_type(tar::EntryType::Symlink);
                self.0.append_link(&mut h, &rel, &target).map_err(tar_err)?;
            } else if ft.is_file() {
                if m.nlink() > 1 {
                    if let Some(first) = links.get(&(m.dev(), m.ino())) {
                        h.set_entry_type(tar::EntryType::Link);
                        self.0.append_link(&mut h, &rel, first).map_err(tar_err)?;
                        continue;
                    }
                    links.insert((m.dev(), m.ino()), rel.clone());
                }
                let data = fs::read(&path).map_err(io_err(format!("read {}", path.display())))?;
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(data.len() as u64);
                self.0
                    .append_data(&mut h, &rel, &data[..])
                    .map_err(tar_err)?;
            } else if ft.is_char_device() || ft.is_block_device() {
                h.set_entry_type(if ft.is_char_device() {
                    tar::EntryType::Char
                } else {
                    tar::EntryType::Block
                });
                let rdev = m.rdev();
                // glibc's major/minor split of a dev_t.
                let major = ((rdev >> 32) & 0xffff_f000) | ((rdev >> 8) & 0xfff);
                let minor = ((rdev >> 12) & 0xffff_ff00) | (rdev & 0xff);
                h.set_device_major(major as u32).map_err(tar_err)?;
                h.set_device_minor(minor as u32).map_err(tar_err)?;
                self.0
                    .append_data(&mut h, &rel, io::empty())
                    .map_err(tar_err)?;
            } else if ft.is_fifo() {
                h.set_entry_type(tar::EntryType::Fifo);
                self.0
                    .append_data(&mut h, &rel, io::empty())
                    .map_err(tar_err)?;
            }
        }
        Ok(())
    }

    /// The tar's bytes (its end written); the builder is empty again.
    pub fn done(&mut self) -> Vec<u8> {
        std::mem::replace(&mut self.0, tar::Builder::new(Vec::new()))
            .into_inner()
            .expect("a tar in memory")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tree_is_tarred_with_owners_shifted_back() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::create_dir(root.join("etc")).unwrap();
        fs::write(root.join("etc/a"), b"aaa").unwrap();
        fs::hard_link(root.join("etc/a"), root.join("etc/b")).unwrap();
        std::os::unix::fs::symlink("etc/a", root.join("link")).unwrap();
        let long = "x".repeat(150);
        fs::write(root.join(&long), b"long").unwrap();
        std::os::unix::fs::lchown(root.join("etc/a"), Some(100_005), Some(100_007)).unwrap();
        let bytes = Tar::new().tree(root, 100_000).unwrap().done();
        let mut seen = Vec::new();
        let mut ar = tar::Archive::new(&bytes[..]);
        for e in ar.entries().unwrap() {
            let e = e.unwrap();
            if e.path().unwrap().ends_with("etc/a") {
                let h = e.header();
                assert_eq!((h.uid().unwrap(), h.gid().unwrap()), (5, 7));
            }
            seen.push((
                e.path().unwrap().display().to_string(),
                e.header().entry_type(),
            ));
        }
        assert_eq!(
            seen,
            vec![
                ("etc/".to_string(), tar::EntryType::Directory),
                ("etc/a".to_string(), tar::EntryType::Regular),
                ("etc/b".to_string(), tar::EntryType::Link),
                ("link".to_string(), tar::EntryType::Symlink),
                (long, tar::EntryType::Regular),
            ]
        );
    }
}
