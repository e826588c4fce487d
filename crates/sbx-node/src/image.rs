//! The node's images. Two it makes itself ([`LocalImage`]): the base image, a Debian (or
//! Ubuntu, as the host is) root with python3 (also as `python`), nodejs, and E2B's user `user`, who may sudo without a
//! password, made by debootstrap from the machine's configured apt sources and kept under the
//! images directory:
//!
//! ```text
//! <images>/base/image.json   what the image is: env, user, workdir, the uid base it is stored at
//! <images>/base/rootfs/      the tree, owners shifted by the uid base (see sbx-runtime fsutil)
//! ```
//!
//! and the code interpreter's image (`<images>/code-interpreter`, [`INTERP_IMAGE`]): the same
//! with E2B's data stack from Debian (numpy, pandas, matplotlib, ...), which E2B's template
//! `code-interpreter-v1` runs on.
//!
//! An image is made in `<images>/.build-<name>` and renamed into place when complete, so a
//! half-built image is never used; a lock file keeps two builders apart.
//!
//! Every other image name is an OCI reference, pulled by sbx-image into `<images>/oci` (its
//! content-addressed store: layers unpacked once, owners shifted, shared by every sandbox of
//! the image). A pulled image's layers are the overlay's lower directories, top first; its
//! config gives the agent's env, user and working directory.

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error(
        "no base image at {0}: run `sbx image build-base` (or start sandboxd, which builds it)"
    )]
    NoBase(PathBuf),
    #[error("image {0} is not on this node")]
    Unknown(String),
    #[error(
        "no code interpreter image at {0}: run `sandboxd build-base --code-interpreter` (or start sandboxd with --e2b-listen, which builds it)"
    )]
    NoInterp(PathBuf),
    #[error("{0}")]
    InvalidReference(String),
    #[error("the base image was stored for uid base {stored}, this node uses {wanted}")]
    UidBase { stored: u32, wanted: u32 },
    #[error("cannot build the base image: {0}")]
    Build(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

/// Why a pull failed: the registry or its content, or the node's side of it.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error(transparent)]
    Pull(sbx_image::ImageError),
    #[error(transparent)]
    Node(ImageError),
}

impl PullError {
    /// The sandbox's `failure_code` for it.
    pub fn code(&self) -> &'static str {
        match self {
            PullError::Pull(e) => pull_failure_code(e),
            PullError::Node(_) => "invalid_image",
        }
    }
}

/// Why a gc of the images stopped.
#[derive(Debug, thiserror::Error)]
pub enum GcError {
    #[error("image store: {0}")]
    Store(#[from] sbx_image::ImageError),
    #[error(transparent)]
    Node(#[from] ImageError),
}

/// What a gc of the images removed: sbx-image's report, and the private markers of images no
/// longer in the store.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcSummary {
    pub store: sbx_image::GcReport,
    pub markers_removed: u64,
}

impl std::fmt::Display for GcSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.store;
        write!(
            f,
            "{} blobs ({} bytes), {} layers, {} temp files, {} records, {} private markers",
            s.blobs_removed,
            s.bytes_freed,
            s.layers_removed,
            s.temps_removed,
            s.records_removed,
            self.markers_removed
        )
    }
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ImageError {
    let what = what.into();
    move |source| ImageError::Io { what, source }
}

/// What an image is.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ImageMeta {
    pub name: String,
    pub created_at: String,
    pub env: Vec<(String, String)>,
    pub user: Option<String>,
    pub workdir: Option<String>,
    pub uid_base: u32,
    pub source: String,
    /// The image's own start command: ENTRYPOINT then CMD (`start: true`).
    #[serde(default)]
    pub start: Vec<String>,
    /// STOPSIGNAL, as the image names it.
    #[serde(default)]
    pub stop_signal: Option<String>,
    /// Its labels (`sbx.start`, `sbx.ready`).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// An image ready to be a sandbox's lower layers.
#[derive(Debug, Clone)]
pub struct Image {
    pub meta: ImageMeta,
    /// The base image's tree; for a pulled image its top layer.
    pub rootfs: PathBuf,
    /// The overlay's lower directories, top first.
    pub lowers: Vec<PathBuf>,
    /// A pulled image's manifest digest and config.
    pub oci: Option<OciInfo>,
}

/// What a pulled image adds.
#[derive(Debug, Clone)]
pub struct OciInfo {
    /// The manifest's digest.
    pub digest: String,
}

/// An image as a create names it: on the node, or to be pulled (its normalised reference).
#[derive(Debug, Clone)]
pub enum Source {
    Local(Box<Image>),
    Remote(String),
}

impl Source {
    pub(crate) fn is_base(&self) -> bool {
        matches!(self, Source::Local(i) if i.meta.name == "base")
    }
}

/// Why a pull failed, as a sandbox's `failure_code`: `registry_auth_failed` (the registry
/// refused the credentials or wants some), `invalid_image` (no such image, or not one this node
/// runs), `image_pull_failed` (the registry could not be reached, the disk).
pub(crate) fn pull_failure_code(e: &sbx_image::ImageError) -> &'static str {
    use sbx_image::ImageError as E;
    match e {
        E::Unauthorized { .. } => "registry_auth_failed",
        E::InvalidReference { .. }
        | E::NotFound(_)
        | E::DigestMismatch { .. }
        | E::UnsupportedMediaType(_)
        | E::InvalidImage(_) => "invalid_image",
        E::Network { .. } | E::Io { .. } => "image_pull_failed",
    }
}

/// An image of `GET /v1/images`.
#[derive(Debug, Clone, Serialize)]
pub struct ImageInfo {
    pub object: &'static str,
    /// `base`, or the pulled image's normalised references.
    pub references: Vec<String>,
    pub digest: Option<String>,
    /// Bytes of the layers as the registry served them (for the base image: none).
    pub size: Option<u64>,
    pub layers: usize,
}

/// The parts of sbx-image's image record (`<oci>/images/<hex>.json`) a listing shows.
#[derive(Deserialize)]
struct RecordView {
    digest: String,
    #[serde(default)]
    references: Vec<String>,
    #[serde(default)]
    layers: Vec<LayerView>,
}

#[derive(Deserialize)]
struct LayerView {
    #[serde(default)]
    size: i64,
}

/// Names the catalog resolves to the base image.
pub(crate) const CATALOG: &[&str] = &["python", "node", "base"];

/// What the base image has beyond Debian's minbase: the languages, and what a first command
/// on the network usually needs (`pip install`, `git clone`, `curl`, TLS roots). A base image
/// built with another list (an older node's) is built again at the next start.
pub(crate) const BASE_PACKAGES: &[&str] = &[
    "python3",
    "nodejs",
    "procps",
    "ca-certificates",
    "curl",
    "git",
    "python3-pip",
    "python3-venv",
    "sudo",
    "python-is-python3",
    // `ss` and `ip`: E2B's `wait_for_port` runs `ss` in the sandbox.
    "iproute2",
];

/// The account the base image has beside root, as E2B's templates do (E2B's SDKs run
/// commands as `user`, in `/home/user`, by default): uid and gid 1000, a login shell of bash.
/// It may `sudo` without a password, as in E2B's base template ([`BASE_SUDOERS`]).
pub(crate) const BASE_USER: (&str, u32) = ("user", 1000);

/// `/etc/sudoers.d/<BASE_USER>` of the base image (mode 0440, root's).
pub(crate) const BASE_SUDOERS: &str = "user ALL=(ALL:ALL) NOPASSWD: ALL\n";

/// The version of what the base image is made of beyond its package list: the user, its
/// sudoers file, the C.UTF-8 locale in a locale archive ([`archive_locale`]). Raise it with any
/// change to [`add_base_user`], [`BASE_SUDOERS`] or [`archive_locale`]: a base image of another
/// version is built again at the next start.
pub(crate) const BASE_RECIPE: u32 = 3;

/// The `source` an image.json of the base image has when it holds [`BASE_PACKAGES`],
/// [`BASE_USER`] and the rest of recipe [`BASE_RECIPE`].
pub(crate) fn base_source(suite: &str) -> String {
    format!(
        "recipe {BASE_RECIPE}; user {} (sudo); debootstrap {suite} minbase + {}",
        BASE_USER.0,
        BASE_PACKAGES.join(" ")
    )
}

/// The node's second local image, `<images>/code-interpreter`: the base image's packages and
/// E2B's code interpreter's data stack as Debian ships it ([`INTERP_PACKAGES`]), made the same
/// way (debootstrap from the machine's apt source, [`BASE_USER`]), then `apt-get install` in
/// it from the same source (apt, unlike debootstrap, takes a dependency's alternative that is
/// being installed: fonttools' `python3-scipy | python3-munkres` does not bring scipy and a
/// C++ compiler). E2B's template `code-interpreter-v1` runs on it. A name no OCI reference is
/// looked up as.
pub const INTERP_IMAGE: &str = "code-interpreter";

/// What the code interpreter's image has beyond [`BASE_PACKAGES`]: E2B's data stack where
/// Debian has it cheaply (no scipy, scikit-learn or seaborn: they would double the image).
pub(crate) const INTERP_PACKAGES: &[&str] = &[
    "python3-numpy",
    "python3-pandas",
    "python3-matplotlib",
    "python3-openpyxl",
    "python3-bs4",
    "python3-requests",
    // fonttools' (matplotlib's) `python3-scipy | python3-munkres`: the small one.
    "python3-munkres",
    // TypeScript contexts: its compiler takes the types away (and nothing else).
    "node-typescript",
    // R contexts: a persistent R process each.
    "r-base-core",
    // Java contexts: a JVM each, evaluating with JShell (the JDK's).
    "default-jdk-headless",
];

/// The version of the code interpreter's image beyond its package list and the base recipe.
pub(crate) const INTERP_RECIPE: u32 = 1;

/// The `source` an image.json of the code interpreter's image has when current.
pub(crate) fn interp_source(suite: &str) -> String {
    format!(
        "interp recipe {INTERP_RECIPE}; base recipe {BASE_RECIPE}; user {} (sudo); debootstrap {suite} minbase + {}; apt-get install {}",
        BASE_USER.0,
        BASE_PACKAGES.join(" "),
        INTERP_PACKAGES.join(" ")
    )
}

fn interp_is_current(source: &str) -> bool {
    source.starts_with(&format!(
        "interp recipe {INTERP_RECIPE}; base recipe {BASE_RECIPE}; user {} ",
        BASE_USER.0
    )) && source.ends_with(&format!(
        "minbase + {}; apt-get install {}",
        BASE_PACKAGES.join(" "),
        INTERP_PACKAGES.join(" ")
    ))
}

/// The images the node makes itself (debootstrap), each in `<images>/<name>`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LocalImage {
    Base,
    Interp,
}

impl LocalImage {
    pub fn name(self) -> &'static str {
        match self {
            LocalImage::Base => "base",
            LocalImage::Interp => INTERP_IMAGE,
        }
    }

    /// What `apt-get install` adds after debootstrap.
    fn apt_packages(self) -> &'static [&'static str] {
        match self {
            LocalImage::Base => &[],
            LocalImage::Interp => INTERP_PACKAGES,
        }
    }

    fn source(self, suite: &str) -> String {
        match self {
            LocalImage::Base => base_source(suite),
            LocalImage::Interp => interp_source(suite),
        }
    }

    fn is_current(self, source: &str) -> bool {
        match self {
            LocalImage::Base => base_is_current(source),
            LocalImage::Interp => interp_is_current(source),
        }
    }

    fn missing(self, dir: PathBuf) -> ImageError {
        match self {
            LocalImage::Base => ImageError::NoBase(dir),
            LocalImage::Interp => ImageError::NoInterp(dir),
        }
    }
}

/// Whether a base image's `source` says it is of recipe [`BASE_RECIPE`] and holds
/// [`BASE_PACKAGES`] (recipe 1, `user user; debootstrap …`, is not: it has no sudo).
fn base_is_current(source: &str) -> bool {
    source.starts_with(&format!("recipe {BASE_RECIPE}; user {} ", BASE_USER.0))
        && source.ends_with(&format!("minbase + {}", BASE_PACKAGES.join(" ")))
}

/// Adds [`BASE_USER`] to a root file system just made (before its owners are shifted):
/// its lines in /etc/passwd, /etc/group and /etc/shadow, and its home from /etc/skel.
fn add_base_user(rootfs: &Path) -> std::io::Result<()> {
    let (name, id) = BASE_USER;
    let add_line = |file: &str, line: String| -> std::io::Result<()> {
        let p = rootfs.join(file);
        let mut text = match fs::read_to_string(&p) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        if text.lines().any(|l| l.split(':').next() == Some(name)) {
            return Ok(());
        }
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&line);
        text.push('\n');
        fs::write(&p, text)
    };
    add_line(
        "etc/passwd",
        format!("{name}:x:{id}:{id}::/home/{name}:/bin/bash"),
    )?;
    add_line("etc/group", format!("{name}:x:{id}:"))?;
    add_line("etc/shadow", format!("{name}:!:19000:0:99999:7:::"))?;
    let home = rootfs.join("home").join(name);
    fs::create_dir_all(&home)?;
    if let Ok(rd) = fs::read_dir(rootfs.join("etc/skel")) {
        for e in rd.flatten() {
            if e.path().is_file() {
                let to = home.join(e.file_name());
                fs::copy(e.path(), &to)?;
                std::os::unix::fs::chown(&to, Some(id), Some(id))?;
            }
        }
    }
    std::os::unix::fs::chown(&home, Some(id), Some(id))?;
    fs::set_permissions(&home, std::os::unix::fs::PermissionsExt::from_mode(0o750))?;
    // The sudo package made /etc/sudoers.d (and the `@includedir` line that reads it); the
    // file is root's (shifted with the rest), 0440 as sudo wants it.
    let sudoers = rootfs.join("etc/sudoers.d").join(name);
    fs::write(&sudoers, BASE_SUDOERS)?;
    std::os::unix::fs::chown(&sudoers, Some(0), Some(0))?;
    fs::set_permissions(
        &sudoers,
        std::os::unix::fs::PermissionsExt::from_mode(0o440),
    )
}

#[derive(Clone)]
pub struct ImageStore {
    dir: PathBuf,
    uid_base: u32,
    oci: std::sync::Arc<sbx_image::Store>,
    /// Catalog names mapped to normalised references (the node's config).
    catalog: BTreeMap<String, String>,
}

impl std::fmt::Debug for ImageStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageStore")
            .field("dir", &self.dir)
            .finish()
    }
}

impl ImageStore {
    /// A store whose pulls speak plain HTTP to the registries of `insecure` (`HOST:PORT`).
    pub fn with_insecure(dir: PathBuf, uid_base: u32, insecure: Vec<String>) -> ImageStore {
        let oci = sbx_image::Store::new(dir.join("oci"), uid_base, insecure);
        ImageStore {
            dir,
            uid_base,
            oci: std::sync::Arc::new(oci),
            catalog: BTreeMap::new(),
        }
    }

    /// Maps catalog names (`python`, `node`) to registries' images (normalised here).
    pub fn set_catalog(&mut self, catalog: &BTreeMap<String, String>) {
        self.catalog = catalog
            .iter()
            .filter_map(|(name, r)| {
                let r = sbx_image::parse_reference(r).ok()?;
                Some((name.clone(), r.to_string()))
            })
            .collect();
    }

    /// An image name of the catalog (or none: the base image).
    pub fn is_catalog(name: Option<&str>) -> bool {
        name.is_none_or(|n| CATALOG.contains(&n))
    }

    /// Where a create's image comes from: the base image, a pulled image the node has, or a
    /// pull. An image name that is not a reference is `InvalidReference`.
    pub fn lookup(&self, name: Option<&str>) -> Result<Source, ImageError> {
        self.lookup_as(name, false)
    }

    /// [`ImageStore::lookup`] for the owner of a private image (a create that names the
    /// login it was pulled with, of a template built with it): the store's copy serves.
    pub(crate) fn lookup_private(&self, name: &str) -> Result<Source, ImageError> {
        self.lookup_as(Some(name), true)
    }

    fn lookup_as(&self, name: Option<&str>, owner: bool) -> Result<Source, ImageError> {
        // A catalog name the node maps to a registry's image is that image.
        let mapped = name.and_then(|n| self.catalog.get(n));
        let name = mapped.map(String::as_str).or(name);
        match name {
            n if Self::is_catalog(n) => self.base().map(|i| Source::Local(Box::new(i))),
            Some(INTERP_IMAGE) => self.interp().map(|i| Source::Local(Box::new(i))),
            Some(n) => {
                let r = sbx_image::parse_reference(n)
                    .map_err(|e| ImageError::InvalidReference(e.to_string()))?;
                match self.oci.get(n) {
                    // An image pulled with credentials is asked of its registry again when
                    // named without them: the registry decides whether it is public.
                    Some(img) if owner || !self.is_private(&img.digest) => {
                        self.of_oci(img).map(|i| Source::Local(Box::new(i)))
                    }
                    _ => Ok(Source::Remote(r.to_string())),
                }
            }
            None => self.base().map(|i| Source::Local(Box::new(i))),
        }
    }

    /// Pulls `reference`: the registry is always asked (only the manifest when the store has
    /// the image), by digest too. A create gets here when the store does not have the image,
    /// when its copy was pulled with a login, or with a login of its own: the registry then
    /// decides whether the caller may have it.
    pub async fn pull(
        &self,
        reference: &str,
        creds: Option<&sbx_image::Credentials>,
        progress: &(dyn Fn(sbx_image::Progress) + Send + Sync),
    ) -> Result<Image, PullError> {
        let img = match self
            .oci
            .pull_from_registry(reference, creds, progress)
            .await
        {
            Ok(img) => img,
            // The image of a catalog name: offline, the base image serves.
            Err(e)
                if pull_failure_code(&e) == "image_pull_failed"
                    && self.catalog.values().any(|r| r == reference) =>
            {
                tracing::warn!(image = %reference, error = %e, "a catalog image cannot be pulled: the base image serves");
                return self.base().map_err(PullError::Node);
            }
            Err(e) => return Err(PullError::Pull(e)),
        };
        if creds.is_some() {
            self.mark_private(&img.digest).map_err(PullError::Node)?;
        }
        self.of_oci(img).map_err(PullError::Node)
    }

    /// `<images>/oci-private/<hex>`: the images pulled with credentials.
    fn private_marker(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
        self.dir.join("oci-private").join(hex)
    }

    fn is_private(&self, digest: &str) -> bool {
        self.private_marker(digest).exists()
    }

    fn mark_private(&self, digest: &str) -> Result<(), ImageError> {
        let path = self.private_marker(digest);
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(io("mkdir oci-private"))?;
        }
        fs::write(&path, b"").map_err(io("mark a private image"))
    }

    /// Removes what no pulled image uses: sbx-image's gc of `<images>/oci` (blobs, layers and
    /// refs no image record names, temp files of pulls no longer running; it waits for running
    /// pulls), then the private markers of images the store no longer has. Never a layer an
    /// image record names, so never one a sandbox may run on. Blocking.
    pub fn gc(&self) -> Result<GcSummary, GcError> {
        let store = self.oci.gc()?;
        let mut markers_removed = 0;
        let markers = self.dir.join("oci-private");
        let entries = match fs::read_dir(&markers) {
            Ok(rd) => rd
                .collect::<std::io::Result<Vec<_>>>()
                .map_err(io(format!("read {}", markers.display())))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(io(format!("read {}", markers.display()))(e).into()),
        };
        let records = self.dir.join("oci").join("images");
        for e in entries {
            let name = e.file_name();
            let Some(hex) = name.to_str() else { continue };
            // A marker is written after its image's record, and records are only ever removed
            // by gc: one without a record is of an image gone.
            match fs::symlink_metadata(records.join(format!("{hex}.json"))) {
                Ok(_) => continue,
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                Err(err) => return Err(io(format!("stat the record of {hex}"))(err).into()),
            }
            fs::remove_file(e.path()).map_err(io(format!("remove {}", e.path().display())))?;
            markers_removed += 1;
        }
        Ok(GcSummary {
            store,
            markers_removed,
        })
    }

    fn of_oci(&self, img: sbx_image::Image) -> Result<Image, ImageError> {
        let lowers: Vec<PathBuf> = img.layers.iter().rev().cloned().collect();
        let Some(top) = lowers.first().cloned() else {
            return Err(ImageError::Unknown(format!(
                "{} (an image without layers)",
                img.reference
            )));
        };
        let c = &img.config;
        let env = c
            .env
            .iter()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Ok(Image {
            meta: ImageMeta {
                name: img.reference.clone(),
                created_at: String::new(),
                env,
                user: c.user.clone(),
                workdir: c.working_dir.clone(),
                uid_base: self.uid_base,
                source: img.digest.clone(),
                start: c
                    .entrypoint
                    .iter()
                    .flatten()
                    .chain(c.cmd.iter().flatten())
                    .cloned()
                    .collect(),
                stop_signal: c.stop_signal.clone(),
                labels: c.labels.clone(),
            },
            rootfs: top,
            lowers,
            oci: Some(OciInfo { digest: img.digest }),
        })
    }

    /// The node's images: the base image, then every pulled one (by digest).
    pub fn list(&self) -> Vec<ImageInfo> {
        let mut out = Vec::new();
        if self.base().is_ok() {
            out.push(ImageInfo {
                object: "image",
                references: vec!["base".into()],
                digest: None,
                size: None,
                layers: 1,
            });
        }
        let mut recs: Vec<RecordView> = fs::read_dir(self.dir.join("oci").join("images"))
            .map(|rd| {
                rd.flatten()
                    .filter(|e| e.file_name().to_str().is_some_and(|n| n.ends_with(".json")))
                    .filter_map(|e| fs::read(e.path()).ok())
                    .filter_map(|b| serde_json::from_slice(&b).ok())
                    .collect()
            })
            .unwrap_or_default();
        recs.sort_by(|a, b| a.references.cmp(&b.references));
        for r in recs {
            // Only images the store has complete (what `get` by digest finds).
            let by_digest = r
                .references
                .first()
                .and_then(|x| sbx_image::parse_reference(x).ok())
                .map(|x| format!("{}/{}@{}", x.registry_addr(), x.repository(), r.digest));
            if by_digest.is_some_and(|d| self.oci.get(&d).is_none()) {
                continue;
            }
            out.push(ImageInfo {
                object: "image",
                references: r.references,
                digest: Some(r.digest),
                size: Some(r.layers.iter().map(|l| l.size.max(0) as u64).sum()),
                layers: r.layers.len(),
            });
        }
        out
    }

    /// The base image, if it is built (with [`BASE_PACKAGES`]: one of an older list is
    /// `NoBase` too, so that it is built again).
    pub fn base(&self) -> Result<Image, ImageError> {
        self.local(LocalImage::Base)
    }

    /// The code interpreter's image ([`INTERP_IMAGE`]), if it is built and current.
    pub fn interp(&self) -> Result<Image, ImageError> {
        self.local(LocalImage::Interp)
    }

    /// A local image if it is built as this node makes it (one of an older recipe or package
    /// list is missing too, so that it is built again).
    pub fn local(&self, which: LocalImage) -> Result<Image, ImageError> {
        let dir = self.dir.join(which.name());
        let img = match self.load(which.name()) {
            Ok(img) => img,
            Err(ImageError::NoBase(_)) | Err(ImageError::Unknown(_)) => {
                return Err(which.missing(dir))
            }
            Err(e) => return Err(e),
        };
        if !which.is_current(&img.meta.source) {
            return Err(which.missing(dir));
        }
        Ok(img)
    }

    fn load(&self, name: &str) -> Result<Image, ImageError> {
        let dir = self.dir.join(name);
        let meta_path = dir.join("image.json");
        let text = match fs::read_to_string(&meta_path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(if name == "base" {
                    ImageError::NoBase(dir)
                } else {
                    ImageError::Unknown(name.into())
                })
            }
            Err(e) => return Err(io(format!("read {}", meta_path.display()))(e)),
        };
        let meta: ImageMeta = serde_json::from_str(&text)
            .map_err(|e| ImageError::Build(format!("{}: {e}", meta_path.display())))?;
        if meta.uid_base != self.uid_base {
            return Err(ImageError::UidBase {
                stored: meta.uid_base,
                wanted: self.uid_base,
            });
        }
        let rootfs = dir.join("rootfs");
        Ok(Image {
            meta,
            lowers: vec![rootfs.clone()],
            rootfs,
            oci: None,
        })
    }

    /// Resolves a catalog name (`python`, `node`), nothing (the node's base image) or the
    /// reference of a pulled image the node has (no registry request).
    pub fn resolve(&self, name: Option<&str>) -> Result<Image, ImageError> {
        match self.lookup(name)? {
            Source::Local(i) => Ok(*i),
            Source::Remote(r) => Err(ImageError::Unknown(r)),
        }
    }

    /// Builds the base image unless it is there. `progress` gets a line per step.
    pub fn build_base(&self, progress: &mut dyn FnMut(&str)) -> Result<Image, ImageError> {
        self.build_local(LocalImage::Base, progress)
    }

    /// Builds the code interpreter's image unless it is there.
    pub fn build_interp(&self, progress: &mut dyn FnMut(&str)) -> Result<Image, ImageError> {
        self.build_local(LocalImage::Interp, progress)
    }

    /// Builds a local image unless it is there (current).
    pub fn build_local(
        &self,
        which: LocalImage,
        progress: &mut dyn FnMut(&str),
    ) -> Result<Image, ImageError> {
        let name = which.name();
        fs::create_dir_all(&self.dir).map_err(io(format!("mkdir {}", self.dir.display())))?;
        let lock_path = self.dir.join(".build.lock");
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io("open build lock"))?;
        lock.lock().map_err(io("take build lock"))?;
        if let Ok(img) = self.local(which) {
            return Ok(img);
        }
        let started = Instant::now();
        let source = AptSource::of_host()?;
        progress(&format!(
            "building the {name} image: debootstrap {} from the machine's apt source (a minute or two)",
            source.suite
        ));
        let build = self.dir.join(format!(".build-{name}"));
        if build.exists() {
            fs::remove_dir_all(&build).map_err(io("remove a half-built image"))?;
        }
        let rootfs = build.join("rootfs");
        fs::create_dir_all(&rootfs).map_err(io("mkdir build"))?;
        let mut child = Command::new("debootstrap")
            .arg("--variant=minbase")
            .arg(format!("--include={}", BASE_PACKAGES.join(",")))
            .arg(format!("--components={}", source.components.join(",")))
            .arg(&source.suite)
            .arg(&rootfs)
            .arg(&source.uri)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                ImageError::Build(format!("debootstrap: {e} (apt-get install debootstrap)"))
            })?;
        let mut tail: Vec<String> = Vec::new();
        if let Some(out) = child.stdout.take() {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if line.starts_with("I: Retrieving")
                    || line.starts_with("I: Validating")
                    || line.starts_with("I: Extracting")
                    || line.starts_with("I: Unpacking")
                    || line.starts_with("I: Configuring")
                {
                    // Per-package lines: too many to show; the phase lines below say enough.
                } else {
                    progress(&line);
                }
                tail.push(line);
                if tail.len() > 20 {
                    tail.remove(0);
                }
            }
        }
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut e, &mut err);
        }
        let status = child.wait().map_err(io("wait for debootstrap"))?;
        if !status.success() {
            let _ = fs::remove_dir_all(&build);
            return Err(ImageError::Build(format!(
                "debootstrap ended with {status}: {}{}",
                err.trim(),
                tail.join("\n")
            )));
        }
        if !which.apt_packages().is_empty() {
            progress(&format!(
                "debootstrap done; apt-get install {}",
                which.apt_packages().join(" ")
            ));
            if let Err(e) = apt_install(&rootfs, which.apt_packages()) {
                let _ = fs::remove_dir_all(&build);
                return Err(e);
            }
        }
        progress("trimming caches and shifting owners to the sandbox uid range");
        for junk in [
            "var/cache/apt/archives",
            "var/lib/apt/lists",
            "var/cache/apt",
        ] {
            let p = rootfs.join(junk);
            if let Ok(rd) = fs::read_dir(&p) {
                for e in rd.flatten() {
                    if e.path().is_file() {
                        let _ = fs::remove_file(e.path());
                    }
                }
            }
        }
        add_base_user(&rootfs).map_err(io(format!("add the user `user` to the {name} image")))?;
        if let Err(e) = archive_locale(&rootfs) {
            // Only slower without it: every program that sets its locale reads the files.
            progress(&format!("the C.UTF-8 locale is not archived: {e}"));
        }
        sbx_runtime::fsutil::shift_owners(&rootfs, self.uid_base)
            .map_err(io(format!("shift owners of the {name} image")))?;
        let meta = ImageMeta {
            name: name.into(),
            created_at: sbx_api::format_rfc3339_millis(now_ns()),
            env: vec![
                (
                    "PATH".into(),
                    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
                ),
                ("LANG".into(), "C.UTF-8".into()),
                // A sandbox is its own machine: `pip install` installs (PEP 668's guard is
                // for shared systems).
                ("PIP_BREAK_SYSTEM_PACKAGES".into(), "1".into()),
            ],
            user: Some("root".into()),
            workdir: Some("/".into()),
            uid_base: self.uid_base,
            source: which.source(&source.suite),
            start: Vec::new(),
            stop_signal: None,
            labels: BTreeMap::new(),
        };
        let meta_text =
            serde_json::to_vec_pretty(&meta).map_err(|e| ImageError::Build(e.to_string()))?;
        fs::write(build.join("image.json"), meta_text).map_err(io("write image.json"))?;
        let dest = self.dir.join(name);
        if dest.exists() {
            // An older image: set aside, not removed, since sandboxes running on it hold it as
            // their lower layer (`sandboxd gc` does not touch it; remove it by hand once they
            // are gone).
            let old = self
                .dir
                .join(format!("{name}.old-{}", now_ns() / 1_000_000_000));
            fs::rename(&dest, &old).map_err(io(format!("set the older {name} image aside")))?;
            progress(&format!("the older {name} image is now {}", old.display()));
        }
        fs::rename(&build, &dest).map_err(io(format!("put the {name} image in place")))?;
        progress(&format!(
            "{name} image ready in {:.0} s",
            started.elapsed().as_secs_f64()
        ));
        self.local(which)
    }
}

/// Puts the image's C.UTF-8 locale (its `LANG`) into `/usr/lib/locale/locale-archive`, with
/// the image's own `localedef` (libc-bin's), through chroot, at build time only. Without the
/// archive, every program that sets its locale (coreutils, Python, bash) opens the locale's 13
/// files one by one: 30 opens for an `echo`, 3 with it (issue #31: the command of a run).
fn archive_locale(rootfs: &Path) -> Result<(), ImageError> {
    if !rootfs.join("usr/lib/locale/C.utf8").is_dir() {
        return Ok(());
    }
    let out = Command::new("chroot")
        .arg(rootfs)
        .args(["localedef", "--add-to-archive", "/usr/lib/locale/C.utf8"])
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| ImageError::Build(format!("chroot localedef: {e}")))?;
    if !out.status.success() {
        return Err(ImageError::Build(format!(
            "localedef ended with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// `apt-get update` and `apt-get install --no-install-recommends` in a root file system just
/// made by debootstrap (its sources.list is the machine's apt source debootstrap was given),
/// through chroot, at build time only. In a mount namespace of its own with a /proc (a JDK's
/// scripts run java, which needs one): the mount ends with it, nothing is left on the host.
fn apt_install(rootfs: &Path, packages: &[&str]) -> Result<(), ImageError> {
    let mut proc_at = std::ffi::OsString::from("--mount-proc=");
    proc_at.push(rootfs.join("proc"));
    let apt = |args: &[&str]| -> Result<(), ImageError> {
        let out = Command::new("unshare")
            .args(["--mount", "--propagation", "private"])
            .arg(&proc_at)
            .arg("chroot")
            .arg(rootfs)
            .arg("apt-get")
            .args(["-q", "-y", "-o", "Dpkg::Use-Pty=0"])
            .args(args)
            .env_clear()
            .env(
                "PATH",
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            )
            .env("LANG", "C.UTF-8")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| ImageError::Build(format!("chroot apt-get: {e}")))?;
        if out.status.success() {
            return Ok(());
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let tail: Vec<&str> = text.lines().rev().take(20).collect();
        Err(ImageError::Build(format!(
            "apt-get {} ended with {}: {}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        )))
    };
    apt(&["update"])?;
    let mut install = vec!["install", "--no-install-recommends"];
    install.extend_from_slice(packages);
    apt(&install)?;
    apt(&["clean"])
}

pub fn now_ns() -> i128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i128)
        .unwrap_or(0)
}

/// The machine's own apt source for its release: where debootstrap fetches from.
#[derive(Debug, Clone, PartialEq)]
struct AptSource {
    uri: String,
    suite: String,
    components: Vec<String>,
}

impl AptSource {
    fn of_host() -> Result<AptSource, ImageError> {
        let os = fs::read_to_string("/etc/os-release").map_err(io("read /etc/os-release"))?;
        let codename = os
            .lines()
            .find_map(|l| l.strip_prefix("VERSION_CODENAME="))
            .map(|s| s.trim_matches('"').to_string())
            .ok_or_else(|| ImageError::Build("/etc/os-release names no VERSION_CODENAME".into()))?;
        let mut texts = Vec::new();
        if let Ok(t) = fs::read_to_string("/etc/apt/sources.list") {
            texts.push(t);
        }
        if let Ok(rd) = fs::read_dir("/etc/apt/sources.list.d") {
            let mut paths: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
            paths.sort();
            for p in paths {
                if let Ok(t) = fs::read_to_string(&p) {
                    texts.push(t);
                }
            }
        }
        texts
            .iter()
            .find_map(|t| find_source(t, &codename))
            .ok_or_else(|| {
                ImageError::Build(format!(
                    "no apt source for {codename} in /etc/apt/sources.list(.d)"
                ))
            })
    }
}

/// Finds a `deb` source of `suite` in a sources.list (one-line) or .sources (deb822) text.
fn find_source(text: &str, suite: &str) -> Option<AptSource> {
    for line in text.lines() {
        let line = line.trim();
        let Some(rest) = line.strip_prefix("deb ") else {
            continue;
        };
        let rest = rest.trim_start();
        let rest = if rest.starts_with('[') {
            rest.split_once(']')
                .map(|(_, r)| r.trim_start())
                .unwrap_or(rest)
        } else {
            rest
        };
        let mut words = rest.split_whitespace();
        let (Some(uri), Some(s)) = (words.next(), words.next()) else {
            continue;
        };
        if s == suite {
            return Some(AptSource {
                uri: uri.into(),
                suite: suite.into(),
                components: words.map(String::from).collect(),
            });
        }
    }
    for stanza in text.split("\n\n") {
        let field = |name: &str| {
            stanza.lines().find_map(|l| {
                l.strip_prefix(name)
                    .and_then(|r| r.strip_prefix(':'))
                    .map(|v| v.trim().to_string())
            })
        };
        let types = field("Types").unwrap_or_default();
        if !types.split_whitespace().any(|t| t == "deb") {
            continue;
        }
        let suites = field("Suites").unwrap_or_default();
        if !suites.split_whitespace().any(|s| s == suite) {
            continue;
        }
        let uri = field("URIs")?.split_whitespace().next()?.to_string();
        let components = field("Components")
            .unwrap_or_else(|| "main".into())
            .split_whitespace()
            .map(String::from)
            .collect();
        return Some(AptSource {
            uri,
            suite: suite.into(),
            components,
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_one_line_and_deb822_sources() {
        let one = "# c\ndeb-src http://m/x bookworm main\ndeb [arch=amd64] http://m/debian bookworm main contrib\n";
        let s = find_source(one, "bookworm").unwrap();
        assert_eq!(s.uri, "http://m/debian");
        assert_eq!(s.components, vec!["main", "contrib"]);
        let d822 = "Types: deb\nURIs: http://a/debian-security\nSuites: bookworm-security\nComponents: main\n\nTypes: deb\nURIs: http://a/debian\nSuites: bookworm bookworm-updates\nComponents: main\n";
        let s = find_source(d822, "bookworm").unwrap();
        assert_eq!(s.uri, "http://a/debian");
        assert!(find_source(d822, "trixie").is_none());
    }

    #[test]
    fn a_base_image_of_an_older_package_list_is_not_current() {
        assert!(base_is_current(&base_source("bookworm")));
        assert!(!base_is_current(
            "debootstrap bookworm minbase + python3 nodejs procps"
        ));
        let without_user = format!("debootstrap bookworm minbase + {}", BASE_PACKAGES.join(" "));
        assert!(!base_is_current(&without_user));
        assert!(!base_is_current("fake"));
        // Recipe 1: the user, no sudo, no `python`.
        assert!(!base_is_current(
            "user user; debootstrap bookworm minbase + python3 nodejs procps ca-certificates curl git python3-pip python3-venv"
        ));
        // Recipe 1's shape with today's package list is not current either.
        let recipe1 = format!(
            "user user; debootstrap bookworm minbase + {}",
            BASE_PACKAGES.join(" ")
        );
        assert!(!base_is_current(&recipe1));
        let older_recipe = base_source("bookworm").replacen(
            &format!("recipe {BASE_RECIPE};"),
            &format!("recipe {};", BASE_RECIPE - 1),
            1,
        );
        assert!(!base_is_current(&older_recipe));
        assert!(BASE_PACKAGES.contains(&"sudo") && BASE_PACKAGES.contains(&"python-is-python3"));
    }

    #[test]
    fn an_interp_image_of_another_recipe_or_list_is_not_current() {
        let src = interp_source("bookworm");
        assert!(interp_is_current(&src));
        assert!(src.ends_with(
            "python-is-python3 iproute2; apt-get install python3-numpy python3-pandas python3-matplotlib python3-openpyxl python3-bs4 python3-requests python3-munkres node-typescript r-base-core default-jdk-headless"
        ));
        // The base image's source is not the interpreter's, nor the other way round.
        assert!(!interp_is_current(&base_source("bookworm")));
        assert!(!base_is_current(&src));
        let older = src.replacen(
            &format!("interp recipe {INTERP_RECIPE};"),
            &format!("interp recipe {};", INTERP_RECIPE + 1),
            1,
        );
        assert!(!interp_is_current(&older));
        let older_base = src.replacen(
            &format!("base recipe {BASE_RECIPE};"),
            &format!("base recipe {};", BASE_RECIPE - 1),
            1,
        );
        assert!(!interp_is_current(&older_base));
        let fewer = src.replacen(" node-typescript", "", 1);
        assert!(!interp_is_current(&fewer));
    }

    #[test]
    fn the_base_user_is_added_with_its_home_and_sudoers_file() {
        use std::os::unix::fs::MetadataExt;
        let root = std::env::temp_dir().join(format!("sbx-img-user-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(root.join("etc/sudoers.d")).unwrap();
        fs::create_dir_all(root.join("etc/skel")).unwrap();
        fs::write(root.join("etc/skel/.bashrc"), "# rc\n").unwrap();
        fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/bash").unwrap();
        fs::write(root.join("etc/group"), "root:x:0:\n").unwrap();
        fs::write(root.join("etc/shadow"), "root:*:19000:0:99999:7:::\n").unwrap();
        add_base_user(&root).unwrap();
        // Twice: the lines are not doubled.
        add_base_user(&root).unwrap();
        let passwd = fs::read_to_string(root.join("etc/passwd")).unwrap();
        assert_eq!(
            passwd,
            "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n"
        );
        let group = fs::read_to_string(root.join("etc/group")).unwrap();
        assert_eq!(group.matches("user:x:1000:").count(), 1);
        let sudoers = root.join("etc/sudoers.d/user");
        assert_eq!(fs::read_to_string(&sudoers).unwrap(), BASE_SUDOERS);
        assert!(BASE_SUDOERS.starts_with(&format!("{} ", BASE_USER.0)));
        let m = fs::metadata(&sudoers).unwrap();
        assert_eq!((m.mode() & 0o7777, m.uid(), m.gid()), (0o440, 0, 0));
        let home = fs::metadata(root.join("home/user")).unwrap();
        assert_eq!((home.mode() & 0o777, home.uid()), (0o750, 1000));
        assert_eq!(
            fs::metadata(root.join("home/user/.bashrc")).unwrap().uid(),
            1000
        );
        // Without sudo installed (no /etc/sudoers.d), the build stops rather than leave a
        // base image whose user cannot sudo.
        fs::remove_dir_all(root.join("etc/sudoers.d")).unwrap();
        assert!(add_base_user(&root).is_err());
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn catalog_names_resolve_to_base_and_others_do_not() {
        let dir = std::env::temp_dir().join(format!("sbx-img-test-{}", std::process::id()));
        let store = ImageStore::with_insecure(dir.clone(), 100000, Vec::new());
        assert!(matches!(
            store.resolve(Some("python")),
            Err(ImageError::NoBase(_))
        ));
        assert!(matches!(
            store.resolve(Some("ubuntu:24.04")),
            Err(ImageError::Unknown(_))
        ));
        // The code interpreter's image is the node's, never a registry's.
        assert!(matches!(
            store.resolve(Some(INTERP_IMAGE)),
            Err(ImageError::NoInterp(_))
        ));
        let _ = fs::remove_dir_all(dir);
    }
}
