//! Unpacking a layer tar into a directory in overlayfs form.
//!
//! - OCI whiteouts `.wh.NAME` become character devices 0:0 named NAME; an opaque marker
//!   `.wh..wh..opq` becomes `trusted.overlay.opaque=y` on its directory; other `.wh..wh.`
//!   entries (aufs bookkeeping) are skipped.
//! - Owners are stored shifted: uid u, gid g -> uid_base + u, uid_base + g. Modes (set-id bits
//!   included, applied after the chown that clears them), mtimes (directories last), xattrs
//!   (never `trusted.*`: that is overlayfs' own namespace; file capabilities are rewritten to
//!   name the shifted root), symlinks, hard links within the layer, device nodes and fifos.
//! - No entry is written outside the layer directory: absolute paths are taken as relative to
//!   it, `..` is refused, and every directory on the way to an entry must be a real directory
//!   (not a symlink), checked component by component. An existing entry in the way is removed
//!   before a new one is created (`O_EXCL`), so nothing is ever written through a symlink.

use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::fs::{lchown, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use nix::sys::stat::{makedev, mknod, utimensat, Mode, SFlag, UtimensatFlags};
use nix::sys::time::TimeSpec;
use sha2::{Digest, Sha256};

use crate::error::ImageError;

/// The xattr that makes a directory opaque in a lower layer.
pub const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

const WHITEOUT_PREFIX: &str = ".wh.";
const OPAQUE_MARKER: &str = ".wh..wh..opq";

/// Unpacks the layer blob at `blob` (gzip, zstd or plain tar, told by its first bytes) into the
/// existing directory `dest`, and checks that the uncompressed tar's sha256 is `diff_id`.
pub(crate) fn unpack_blob(
    blob: &Path,
    dest: &Path,
    diff_id: &str,
    uid_base: u32,
    cancel: &AtomicBool,
) -> Result<(), ImageError> {
    let file = File::open(blob).map_err(ImageError::io(format!("open {}", blob.display())))?;
    let mut reader = BufReader::with_capacity(1 << 16, file);
    let head = reader
        .fill_buf()
        .map_err(ImageError::io(format!("read {}", blob.display())))?;
    let decoded: Box<dyn Read> = if head.starts_with(&[0x1f, 0x8b]) {
        Box::new(flate2::bufread::MultiGzDecoder::new(reader))
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Box::new(
            zstd::Decoder::with_buffer(reader)
                .map_err(|e| ImageError::invalid(format!("layer {diff_id}: zstd: {e}")))?,
        )
    } else {
        Box::new(reader)
    };
    let mut hashing = HashingReader {
        inner: decoded,
        hasher: Sha256::new(),
    };
    unpack_tar(&mut hashing, dest, uid_base, cancel)?;
    // The end-of-archive blocks and any padding belong to the diff_id too.
    io::copy(&mut hashing, &mut io::sink())
        .map_err(|e| ImageError::invalid(format!("layer {diff_id}: {e}")))?;
    let actual = format!("sha256:{}", hex::encode(hashing.hasher.finalize()));
    if actual != diff_id {
        return Err(ImageError::DigestMismatch {
            what: "uncompressed layer (diff_id)".into(),
            expected: diff_id.to_string(),
            actual,
        });
    }
    Ok(())
}

struct HashingReader<R> {
    inner: R,
    hasher: Sha256,
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

/// Unpacks a tar stream into the existing directory `dest` (see the module's rules).
pub(crate) fn unpack_tar<R: Read>(
    reader: R,
    dest: &Path,
    uid_base: u32,
    cancel: &AtomicBool,
) -> Result<(), ImageError> {
    let mut archive = tar::Archive::new(reader);
    let mut u = Unpacker {
        root: dest,
        uid_base,
        cancel,
        dir_times: Vec::new(),
    };
    for entry in archive.entries().map_err(bad_tar)? {
        u.check_cancel()?;
        let mut entry = entry.map_err(bad_tar)?;
        u.entry(&mut entry)?;
    }
    u.finish()
}

fn bad_tar(e: io::Error) -> ImageError {
    ImageError::invalid(format!("layer tar: {e}"))
}

fn cancelled() -> ImageError {
    ImageError::Io {
        what: "unpacking a layer".into(),
        source: io::Error::new(io::ErrorKind::Interrupted, "pull cancelled"),
    }
}

/// A path inside a layer, relative to its root, without `.` or `..`. `None` is the root itself.
/// Absolute paths are taken as relative to the layer; `..` is refused.
pub(crate) fn clean_path(p: &Path) -> Result<Option<PathBuf>, ImageError> {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir | Component::RootDir => {}
            Component::ParentDir | Component::Prefix(_) => {
                return Err(ImageError::invalid(format!(
                    "layer entry {} leaves the layer",
                    p.display()
                )))
            }
        }
    }
    Ok(if out.as_os_str().is_empty() {
        None
    } else {
        Some(out)
    })
}

struct Attrs {
    uid: u32,
    gid: u32,
    mode: u32,
    mtime: TimeSpec,
    xattrs: Vec<(String, Vec<u8>)>,
}

struct Unpacker<'a> {
    root: &'a Path,
    uid_base: u32,
    cancel: &'a AtomicBool,
    dir_times: Vec<(PathBuf, TimeSpec)>,
}

impl Unpacker<'_> {
    fn check_cancel(&self) -> Result<(), ImageError> {
        if self.cancel.load(Ordering::Relaxed) {
            Err(cancelled())
        } else {
            Ok(())
        }
    }

    fn entry<R: Read>(&mut self, e: &mut tar::Entry<R>) -> Result<(), ImageError> {
        let raw = e.path().map_err(bad_tar)?.into_owned();
        let rel = clean_path(&raw)?;
        let attrs = self.attrs(e)?;
        let kind = e.header().entry_type();

        let Some(rel) = rel else {
            // The layer's root directory itself ("./").
            if kind.is_dir() {
                self.apply(self.root, &attrs, false)?;
                self.dir_times.push((self.root.to_path_buf(), attrs.mtime));
            }
            return Ok(());
        };
        let name = rel
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();

        if let Some(hidden) = name.strip_prefix(WHITEOUT_PREFIX) {
            return self.whiteout(&rel, &name, hidden, &attrs);
        }

        use tar::EntryType as T;
        match kind {
            T::Directory => {
                let path = self.prepare(&rel, true)?;
                if !path.is_dir() {
                    fs::create_dir(&path).map_err(io_at("mkdir", &path))?;
                }
                self.apply(&path, &attrs, false)?;
                self.dir_times.push((path, attrs.mtime));
            }
            T::Regular | T::Continuous | T::GNUSparse => {
                let path = self.prepare(&rel, false)?;
                let mut file = OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&path)
                    .map_err(io_at("create", &path))?;
                self.copy(e, &mut file, &path)?;
                drop(file);
                self.apply(&path, &attrs, false)?;
            }
            T::Symlink => {
                let target = e
                    .link_name()
                    .map_err(bad_tar)?
                    .ok_or_else(|| ImageError::invalid(format!("symlink {raw:?} has no target")))?
                    .into_owned();
                let path = self.prepare(&rel, false)?;
                std::os::unix::fs::symlink(&target, &path).map_err(io_at("symlink", &path))?;
                self.apply(&path, &attrs, true)?;
            }
            T::Link => {
                let target = e
                    .link_name()
                    .map_err(bad_tar)?
                    .ok_or_else(|| ImageError::invalid(format!("hard link {raw:?} has no target")))?
                    .into_owned();
                let source = self.existing(&target)?;
                let path = self.prepare(&rel, false)?;
                // link(2) does not follow a symlink at `source`: a link to a symlink is a link
                // to the symlink itself. The inode keeps its own owner, mode and times.
                fs::hard_link(&source, &path).map_err(io_at("link", &path))?;
            }
            T::Char | T::Block | T::Fifo => {
                let path = self.prepare(&rel, false)?;
                let (sflag, dev) = match kind {
                    T::Fifo => (SFlag::S_IFIFO, 0),
                    _ => {
                        let major = e.header().device_major().map_err(bad_tar)?.unwrap_or(0);
                        let minor = e.header().device_minor().map_err(bad_tar)?.unwrap_or(0);
                        let flag = if kind == T::Char {
                            SFlag::S_IFCHR
                        } else {
                            SFlag::S_IFBLK
                        };
                        (flag, makedev(u64::from(major), u64::from(minor)))
                    }
                };
                mknod(&path, sflag, Mode::from_bits_truncate(attrs.mode), dev)
                    .map_err(|e| io_at("mknod", &path)(e.into()))?;
                self.apply(&path, &attrs, false)?;
            }
            // Metadata entries the tar reader has already folded into the next entry.
            T::XGlobalHeader | T::XHeader | T::GNULongName | T::GNULongLink => {}
            other => {
                return Err(ImageError::invalid(format!(
                    "layer entry {raw:?} of unsupported type {other:?}"
                )))
            }
        }
        Ok(())
    }

    fn whiteout(
        &mut self,
        rel: &Path,
        name: &str,
        hidden: &str,
        attrs: &Attrs,
    ) -> Result<(), ImageError> {
        let parent = self.parent_dir(rel)?;
        if name == OPAQUE_MARKER {
            xattr::set(&parent, OPAQUE_XATTR, b"y").map_err(io_at("set opaque xattr", &parent))?;
            return Ok(());
        }
        if name.starts_with(".wh..wh.") {
            return Ok(());
        }
        if hidden.is_empty() || hidden == "." || hidden == ".." {
            return Err(ImageError::invalid(format!(
                "bad whiteout {}",
                rel.display()
            )));
        }
        let path = parent.join(hidden);
        remove_existing(&path, false)?;
        mknod(&path, SFlag::S_IFCHR, Mode::empty(), makedev(0, 0))
            .map_err(|e| io_at("mknod whiteout", &path)(e.into()))?;
        lchown(&path, Some(attrs.uid), Some(attrs.gid)).map_err(io_at("chown", &path))?;
        set_times(&path, attrs.mtime)
    }

    /// The owner, mode, mtime and xattrs of an entry, owners shifted.
    fn attrs<R: Read>(&self, e: &mut tar::Entry<R>) -> Result<Attrs, ImageError> {
        let h = e.header();
        let mut uid = h.uid().map_err(bad_tar)?;
        let mut gid = h.gid().map_err(bad_tar)?;
        let mode = h.mode().map_err(bad_tar)? & 0o7777;
        let mut mtime = TimeSpec::new(i64::try_from(h.mtime().map_err(bad_tar)?).unwrap_or(0), 0);
        let mut xattrs = Vec::new();
        if let Some(pax) = e.pax_extensions().map_err(bad_tar)? {
            for ext in pax {
                let ext = ext.map_err(bad_tar)?;
                let Ok(key) = ext.key() else { continue };
                let value = ext.value_bytes();
                match key {
                    "uid" => uid = parse_num(value).unwrap_or(uid),
                    "gid" => gid = parse_num(value).unwrap_or(gid),
                    "mtime" => mtime = parse_pax_time(value).unwrap_or(mtime),
                    _ => {
                        if let Some(name) = key.strip_prefix("SCHILY.xattr.") {
                            xattrs.push((name.to_string(), value.to_vec()));
                        }
                    }
                }
            }
        }
        Ok(Attrs {
            uid: self.shift(uid)?,
            gid: self.shift(gid)?,
            mode,
            mtime,
            xattrs,
        })
    }

    fn shift(&self, id: u64) -> Result<u32, ImageError> {
        u32::try_from(id)
            .ok()
            .and_then(|id| id.checked_add(self.uid_base))
            .filter(|&id| id != u32::MAX)
            .ok_or_else(|| ImageError::invalid(format!("owner id {id} out of range")))
    }

    /// Owner, then mode (chown clears set-id bits), then xattrs (chown clears file
    /// capabilities), then times.
    fn apply(&self, path: &Path, a: &Attrs, symlink: bool) -> Result<(), ImageError> {
        lchown(path, Some(a.uid), Some(a.gid)).map_err(io_at("chown", path))?;
        if !symlink {
            fs::set_permissions(path, Permissions::from_mode(a.mode))
                .map_err(io_at("chmod", path))?;
        }
        for (name, value) in &a.xattrs {
            if name.starts_with("trusted.") {
                continue;
            }
            let value = if name == "security.capability" {
                caps_for_root(value, self.uid_base)
            } else {
                value.clone()
            };
            if let Err(e) = xattr::set(path, name, &value) {
                // Xattrs this filesystem or this kind of file does not take are dropped (user.*
                // on symlinks and devices, security.selinux without SELinux), as Docker does.
                let raw = e.raw_os_error();
                let unsupported = [nix::libc::ENOTSUP, nix::libc::EPERM, nix::libc::EINVAL];
                if !raw.is_some_and(|r| unsupported.contains(&r)) {
                    return Err(io_at("set xattr", path)(e));
                }
            }
        }
        set_times(path, a.mtime)
    }

    /// Checks each directory above `rel` is a real directory in the layer, making missing ones
    /// (root-owned, 0755), and returns the parent's path.
    fn parent_dir(&self, rel: &Path) -> Result<PathBuf, ImageError> {
        let mut cur = self.root.to_path_buf();
        let Some(parent) = rel.parent() else {
            return Ok(cur);
        };
        for c in parent.components() {
            cur.push(c);
            match fs::symlink_metadata(&cur) {
                Ok(m) if m.is_dir() => {}
                Ok(_) => {
                    return Err(ImageError::invalid(format!(
                        "layer entry {} goes through {}, which is not a directory",
                        rel.display(),
                        cur.strip_prefix(self.root).unwrap_or(&cur).display()
                    )))
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    fs::create_dir(&cur).map_err(io_at("mkdir", &cur))?;
                    lchown(&cur, Some(self.uid_base), Some(self.uid_base))
                        .map_err(io_at("chown", &cur))?;
                    fs::set_permissions(&cur, Permissions::from_mode(0o755))
                        .map_err(io_at("chmod", &cur))?;
                }
                Err(e) => return Err(io_at("stat", &cur)(e)),
            }
        }
        Ok(cur)
    }

    /// The path for a new entry at `rel`, with whatever was there removed (a directory is kept
    /// when `keep_dir`: a directory entry over a directory merges).
    fn prepare(&self, rel: &Path, keep_dir: bool) -> Result<PathBuf, ImageError> {
        let parent = self.parent_dir(rel)?;
        let path = match rel.file_name() {
            Some(n) => parent.join(n),
            None => return Err(ImageError::invalid("empty entry name")),
        };
        remove_existing(&path, keep_dir)?;
        Ok(path)
    }

    /// The path of an existing non-directory entry of this layer (a hard link's target).
    fn existing(&self, target: &Path) -> Result<PathBuf, ImageError> {
        let rel = clean_path(target)?
            .ok_or_else(|| ImageError::invalid("hard link to the layer's root"))?;
        let mut cur = self.root.to_path_buf();
        let n = rel.components().count();
        for (i, c) in rel.components().enumerate() {
            cur.push(c);
            let m = fs::symlink_metadata(&cur);
            let ok = match &m {
                Ok(m) if i + 1 < n => m.is_dir(),
                Ok(m) => !m.is_dir(),
                Err(_) => false,
            };
            if !ok {
                return Err(ImageError::invalid(format!(
                    "hard link to {}, which is not a file of this layer",
                    target.display()
                )));
            }
        }
        Ok(cur)
    }

    fn copy<R: Read>(&self, from: &mut R, to: &mut File, path: &Path) -> Result<(), ImageError> {
        let mut buf = vec![0u8; 1 << 16];
        let mut chunks = 0u32;
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) => return Ok(()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(bad_tar(e)),
            };
            to.write_all(&buf[..n]).map_err(io_at("write", path))?;
            chunks = chunks.wrapping_add(1);
            if chunks.is_multiple_of(64) {
                self.check_cancel()?;
            }
        }
    }

    /// Directory times last, deepest first: making their entries changed them.
    fn finish(mut self) -> Result<(), ImageError> {
        self.dir_times
            .sort_by_key(|(p, _)| std::cmp::Reverse(p.components().count()));
        for (path, t) in &self.dir_times {
            set_times(path, *t)?;
        }
        Ok(())
    }
}

fn remove_existing(path: &Path, keep_dir: bool) -> Result<(), ImageError> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => {
            if !keep_dir {
                fs::remove_dir_all(path).map_err(io_at("remove", path))?;
            }
        }
        Ok(_) => fs::remove_file(path).map_err(io_at("remove", path))?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_at("stat", path)(e)),
    }
    Ok(())
}

fn set_times(path: &Path, t: TimeSpec) -> Result<(), ImageError> {
    utimensat(
        nix::fcntl::AT_FDCWD,
        path,
        &t,
        &t,
        UtimensatFlags::NoFollowSymlink,
    )
    .map_err(|e| io_at("set times", path)(e.into()))
}

fn io_at(what: &str, path: &Path) -> impl FnOnce(io::Error) -> ImageError {
    ImageError::io(format!("{what} {}", path.display()))
}

fn parse_num(v: &[u8]) -> Option<u64> {
    std::str::from_utf8(v).ok()?.trim().parse().ok()
}

/// A PAX time: decimal seconds with an optional fraction.
fn parse_pax_time(v: &[u8]) -> Option<TimeSpec> {
    let s = std::str::from_utf8(v).ok()?.trim();
    let (secs, frac) = s.split_once('.').unwrap_or((s, ""));
    let secs: i64 = secs.parse().ok()?;
    let digits: String = frac.chars().take(9).collect();
    let nanos = if digits.is_empty() {
        0
    } else {
        let n: i64 = digits.parse().ok()?;
        n * 10i64.pow(9 - u32::try_from(digits.len()).ok()?)
    };
    Some(TimeSpec::new(secs, nanos))
}

/// File capabilities for the shifted root: a v2 `security.capability` (valid for the host's
/// root only, so ignored in a user namespace) becomes v3 with rootid `uid_base`; a v3 one has its
/// rootid shifted. Anything else is kept as it is.
pub(crate) fn caps_for_root(value: &[u8], uid_base: u32) -> Vec<u8> {
    const V2: u32 = 0x0200_0000;
    const V3: u32 = 0x0300_0000;
    const REVISION_MASK: u32 = 0xff00_0000;
    if uid_base == 0 || value.len() < 4 {
        return value.to_vec();
    }
    let mut magic_bytes = [0u8; 4];
    magic_bytes.copy_from_slice(&value[..4]);
    let magic = u32::from_le_bytes(magic_bytes);
    match (magic & REVISION_MASK, value.len()) {
        (V2, 20) => {
            let mut out = Vec::with_capacity(24);
            out.extend_from_slice(&((magic & !REVISION_MASK) | V3).to_le_bytes());
            out.extend_from_slice(&value[4..20]);
            out.extend_from_slice(&uid_base.to_le_bytes());
            out
        }
        (V3, 24) => {
            let mut root = [0u8; 4];
            root.copy_from_slice(&value[20..24]);
            let shifted = u32::from_le_bytes(root).saturating_add(uid_base);
            let mut out = value[..20].to_vec();
            out.extend_from_slice(&shifted.to_le_bytes());
            out
        }
        _ => value.to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};

    const BASE: u32 = 100_000;

    /// Builds layer tars entry by entry.
    struct Tar(tar::Builder<Vec<u8>>);

    impl Tar {
        fn new() -> Tar {
            Tar(tar::Builder::new(Vec::new()))
        }

        fn header(kind: tar::EntryType, mode: u32, uid: u64, gid: u64) -> tar::Header {
            let mut h = tar::Header::new_ustar();
            h.set_entry_type(kind);
            h.set_mode(mode);
            h.set_uid(uid);
            h.set_gid(gid);
            h.set_mtime(1_600_000_000);
            h.set_size(0);
            h
        }

        /// An entry whose name is written as is (no checks by the tar crate).
        fn raw(&mut self, mut h: tar::Header, name: &str, data: &[u8]) -> &mut Tar {
            let old = h.as_old_mut();
            old.name = [0; 100];
            old.name[..name.len()].copy_from_slice(name.as_bytes());
            h.set_size(data.len() as u64);
            h.set_cksum();
            self.0.append(&h, data).unwrap();
            self
        }

        fn dir(&mut self, name: &str, mode: u32) -> &mut Tar {
            let h = Tar::header(tar::EntryType::Directory, mode, 0, 0);
            self.raw(h, name, b"")
        }

        fn file(&mut self, name: &str, data: &[u8], mode: u32, uid: u64, gid: u64) -> &mut Tar {
            let h = Tar::header(tar::EntryType::Regular, mode, uid, gid);
            self.raw(h, name, data)
        }

        fn link(&mut self, kind: tar::EntryType, name: &str, target: &str) -> &mut Tar {
            let mut h = Tar::header(kind, 0o777, 0, 0);
            h.set_link_name_literal(target).unwrap();
            self.raw(h, name, b"")
        }

        fn dev(&mut self, kind: tar::EntryType, name: &str, major: u32, minor: u32) -> &mut Tar {
            let mut h = Tar::header(kind, 0o666, 0, 5);
            h.set_device_major(major).unwrap();
            h.set_device_minor(minor).unwrap();
            self.raw(h, name, b"")
        }

        fn pax(&mut self, exts: &[(&str, &[u8])]) -> &mut Tar {
            self.0.append_pax_extensions(exts.iter().copied()).unwrap();
            self
        }

        fn bytes(&mut self) -> Vec<u8> {
            std::mem::replace(&mut self.0, tar::Builder::new(Vec::new()))
                .into_inner()
                .unwrap()
        }
    }

    fn unpack(tar: &[u8]) -> (tempfile::TempDir, Result<(), ImageError>) {
        let dir = tempfile::tempdir().unwrap();
        let res = unpack_tar(tar, dir.path(), BASE, &AtomicBool::new(false));
        (dir, res)
    }

    fn meta(p: &Path) -> fs::Metadata {
        fs::symlink_metadata(p).unwrap()
    }

    #[test]
    fn whiteouts_become_char_devices_and_opaque_dirs_an_xattr() {
        let tar = Tar::new()
            .dir("etc/", 0o755)
            .file("etc/.wh.passwd", b"", 0o644, 0, 0)
            .file(".wh.gone", b"", 0o644, 0, 0)
            .dir("var/cache/", 0o755)
            .file("var/cache/.wh..wh..opq", b"", 0o644, 0, 0)
            .file("var/cache/kept", b"k", 0o644, 0, 0)
            .file("opaque-only/.wh..wh..opq", b"", 0o644, 0, 0)
            .file("etc/.wh..wh.plnk", b"", 0o644, 0, 0)
            .bytes();
        let (dir, res) = unpack(&tar);
        res.unwrap();
        let root = dir.path();
        for w in ["etc/passwd", "gone"] {
            let m = meta(&root.join(w));
            assert!(m.file_type().is_char_device(), "{w}");
            assert_eq!(m.rdev(), 0, "{w}");
            assert_eq!((m.uid(), m.gid()), (BASE, BASE), "{w}");
        }
        for d in ["var/cache", "opaque-only"] {
            assert_eq!(
                xattr::get(root.join(d), OPAQUE_XATTR).unwrap().as_deref(),
                Some(&b"y"[..]),
                "{d}"
            );
        }
        assert_eq!(xattr::get(root.join("etc"), OPAQUE_XATTR).unwrap(), None);
        assert_eq!(fs::read(root.join("var/cache/kept")).unwrap(), b"k");
        // No marker files are left.
        for d in ["", "etc", "var/cache", "opaque-only"] {
            for e in fs::read_dir(root.join(d)).unwrap() {
                let name = e.unwrap().file_name();
                assert!(!name.to_string_lossy().starts_with(".wh."), "{name:?}");
            }
        }
    }

    #[test]
    fn owners_are_shifted_and_modes_times_kept() {
        let tar = Tar::new()
            .dir("./", 0o755)
            .dir("usr/", 0o755)
            .dir("usr/bin/", 0o755)
            .file("usr/bin/su", b"#!", 0o4755, 0, 0)
            .file("usr/bin/wall", b"#!", 0o2755, 0, 5)
            .file("home-file", b"x", 0o600, 1000, 1001)
            .pax(&[
                ("uid", b"70000"),
                ("gid", b"70001"),
                ("mtime", b"1500000000.25"),
            ])
            .file("big-ids", b"", 0o640, 0, 0)
            .link(tar::EntryType::Symlink, "usr/bin/sh", "/bin/dash")
            .bytes();
        let (dir, res) = unpack(&tar);
        res.unwrap();
        let root = dir.path();
        let su = meta(&root.join("usr/bin/su"));
        assert_eq!((su.uid(), su.gid()), (BASE, BASE));
        assert_eq!(su.mode() & 0o7777, 0o4755, "setuid survives the chown");
        let wall = meta(&root.join("usr/bin/wall"));
        assert_eq!((wall.gid(), wall.mode() & 0o7777), (BASE + 5, 0o2755));
        let home = meta(&root.join("home-file"));
        assert_eq!((home.uid(), home.gid()), (BASE + 1000, BASE + 1001));
        assert_eq!(home.mode() & 0o7777, 0o600);
        assert_eq!(home.mtime(), 1_600_000_000);
        let big = meta(&root.join("big-ids"));
        assert_eq!((big.uid(), big.gid()), (BASE + 70000, BASE + 70001));
        assert_eq!(
            (big.mtime(), big.mtime_nsec()),
            (1_500_000_000, 250_000_000)
        );
        let sh = meta(&root.join("usr/bin/sh"));
        assert!(sh.file_type().is_symlink());
        assert_eq!(sh.uid(), BASE);
        assert_eq!(
            fs::read_link(root.join("usr/bin/sh")).unwrap(),
            Path::new("/bin/dash")
        );
        // Directory times are set after their entries were made.
        assert_eq!(meta(&root.join("usr/bin")).mtime(), 1_600_000_000);
        assert_eq!(meta(root).mtime(), 1_600_000_000);
        assert_eq!(meta(root).uid(), BASE);

        // An id past the top of the uid range is refused.
        let tar = Tar::new()
            .file("f", b"", 0o644, u64::from(u32::MAX - 10), 0)
            .bytes();
        assert!(matches!(unpack(&tar).1, Err(ImageError::InvalidImage(_))));
    }

    #[test]
    fn hard_links_device_nodes_and_fifos() {
        let tar = Tar::new()
            .file("bin/busybox", b"elf", 0o755, 0, 0)
            .link(tar::EntryType::Link, "bin/ls", "bin/busybox")
            .link(tar::EntryType::Link, "sbin/init", "./bin/busybox")
            .dev(tar::EntryType::Char, "dev/null", 1, 3)
            .dev(tar::EntryType::Block, "dev/loop0", 7, 0)
            .dev(tar::EntryType::Fifo, "run/fifo", 0, 0)
            .bytes();
        let (dir, res) = unpack(&tar);
        res.unwrap();
        let root = dir.path();
        let bb = meta(&root.join("bin/busybox"));
        assert_eq!(bb.nlink(), 3);
        assert_eq!(meta(&root.join("bin/ls")).ino(), bb.ino());
        assert_eq!(meta(&root.join("sbin/init")).ino(), bb.ino());
        let null = meta(&root.join("dev/null"));
        assert!(null.file_type().is_char_device());
        assert_eq!(null.rdev(), makedev(1, 3));
        assert_eq!(
            (null.uid(), null.gid(), null.mode() & 0o7777),
            (BASE, BASE + 5, 0o666)
        );
        let lp = meta(&root.join("dev/loop0"));
        assert!(lp.file_type().is_block_device());
        assert_eq!(lp.rdev(), makedev(7, 0));
        assert!(meta(&root.join("run/fifo")).file_type().is_fifo());

        // A hard link to nothing, or to a directory, is refused.
        for target in ["missing", "bin"] {
            let tar = Tar::new()
                .dir("bin/", 0o755)
                .link(tar::EntryType::Link, "x", target)
                .bytes();
            assert!(
                matches!(unpack(&tar).1, Err(ImageError::InvalidImage(_))),
                "{target}"
            );
        }
    }

    #[test]
    fn no_path_leaves_the_layer() {
        let outside = tempfile::tempdir().unwrap();
        let out = outside.path().display().to_string();
        let cases: Vec<(&str, Vec<u8>)> = vec![
            (
                "dotdot",
                Tar::new().file("../escaped", b"x", 0o644, 0, 0).bytes(),
            ),
            (
                "inner dotdot",
                Tar::new()
                    .file("a/../../escaped", b"x", 0o644, 0, 0)
                    .bytes(),
            ),
            (
                "through a symlink",
                Tar::new()
                    .link(tar::EntryType::Symlink, "esc", &out)
                    .file("esc/escaped", b"x", 0o644, 0, 0)
                    .bytes(),
            ),
            (
                "through a relative symlink",
                Tar::new()
                    .link(tar::EntryType::Symlink, "up", "../../../../../../..")
                    .dir("up/tmp/", 0o755)
                    .bytes(),
            ),
            (
                "hard link out",
                Tar::new()
                    .link(tar::EntryType::Link, "hl", &format!("../{out}/x"))
                    .bytes(),
            ),
            (
                "hard link through a symlink",
                Tar::new()
                    .link(tar::EntryType::Symlink, "esc", &out)
                    .link(tar::EntryType::Link, "hl", "esc/x")
                    .bytes(),
            ),
            (
                "whiteout through a symlink",
                Tar::new()
                    .link(tar::EntryType::Symlink, "esc", &out)
                    .file("esc/.wh.x", b"", 0o644, 0, 0)
                    .bytes(),
            ),
        ];
        fs::write(outside.path().join("x"), b"victim").unwrap();
        for (name, tar) in cases {
            let (_dir, res) = unpack(&tar);
            assert!(
                matches!(res, Err(ImageError::InvalidImage(_))),
                "{name}: {res:?}"
            );
        }
        assert_eq!(fs::read(outside.path().join("x")).unwrap(), b"victim");
        assert!(!outside.path().join("escaped").exists());
        assert_eq!(fs::read_dir(outside.path()).unwrap().count(), 1);

        // An absolute path is taken inside the layer; a symlink over a file is replaced, not
        // written through.
        let tar = Tar::new()
            .file("/etc/abs", b"a", 0o644, 0, 0)
            .link(tar::EntryType::Symlink, "victim", &format!("{out}/x"))
            .file("victim", b"mine", 0o644, 0, 0)
            .bytes();
        let (dir, res) = unpack(&tar);
        res.unwrap();
        assert_eq!(fs::read(dir.path().join("etc/abs")).unwrap(), b"a");
        assert!(meta(&dir.path().join("victim")).is_file());
        assert_eq!(fs::read(outside.path().join("x")).unwrap(), b"victim");
    }

    #[test]
    fn xattrs_kept_but_never_overlay_ones() {
        let cap_v2: Vec<u8> = [0x0200_0001u32, 0x2000, 0, 0, 0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let tar = Tar::new()
            .pax(&[
                ("SCHILY.xattr.user.note", b"hello"),
                ("SCHILY.xattr.trusted.overlay.redirect", b"/etc"),
                ("SCHILY.xattr.trusted.overlay.opaque", b"y"),
                ("SCHILY.xattr.security.capability", &cap_v2),
            ])
            .file("bin/ping", b"elf", 0o755, 0, 0)
            .bytes();
        let (dir, res) = unpack(&tar);
        res.unwrap();
        let p = dir.path().join("bin/ping");
        assert_eq!(
            xattr::get(&p, "user.note").unwrap().as_deref(),
            Some(&b"hello"[..])
        );
        assert_eq!(xattr::get(&p, "trusted.overlay.redirect").unwrap(), None);
        assert_eq!(xattr::get(&p, OPAQUE_XATTR).unwrap(), None);
        let cap = xattr::get(&p, "security.capability").unwrap().unwrap();
        assert_eq!(cap, caps_for_root(&cap_v2, BASE));
    }

    #[test]
    fn file_capabilities_name_the_shifted_root() {
        let v2: Vec<u8> = [0x0200_0001u32, 0x2000, 0, 0, 0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let v3 = caps_for_root(&v2, BASE);
        let words: Vec<u32> = v3
            .chunks(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(words, vec![0x0300_0001, 0x2000, 0, 0, 0, BASE]);
        let again = caps_for_root(&v3, 5);
        assert_eq!(&again[20..], &(BASE + 5).to_le_bytes());
        assert_eq!(caps_for_root(&v2, 0), v2);
        assert_eq!(caps_for_root(b"junk", BASE), b"junk");
    }

    #[test]
    fn compressed_blobs_and_diff_id_check() {
        let tar = Tar::new().file("hello", b"world", 0o644, 0, 0).bytes();
        let diff_id = format!("sha256:{}", hex::encode(Sha256::digest(&tar)));
        let gz = {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            e.write_all(&tar).unwrap();
            e.finish().unwrap()
        };
        let zst = zstd::encode_all(&tar[..], 3).unwrap();
        let blobs = tempfile::tempdir().unwrap();
        for (name, body) in [("plain", &tar), ("gzip", &gz), ("zstd", &zst)] {
            let blob = blobs.path().join(name);
            fs::write(&blob, body).unwrap();
            let dest = tempfile::tempdir().unwrap();
            unpack_blob(&blob, dest.path(), &diff_id, BASE, &AtomicBool::new(false)).unwrap();
            assert_eq!(
                fs::read(dest.path().join("hello")).unwrap(),
                b"world",
                "{name}"
            );

            let wrong = format!("sha256:{}", "0".repeat(64));
            let dest = tempfile::tempdir().unwrap();
            let res = unpack_blob(&blob, dest.path(), &wrong, BASE, &AtomicBool::new(false));
            assert!(
                matches!(&res, Err(ImageError::DigestMismatch { expected, actual, .. })
                    if *expected == wrong && *actual == diff_id),
                "{name}: {res:?}"
            );
        }
        // A corrupt gzip stream is refused, not half-used.
        let mut bad = gz.clone();
        let mid = bad.len() / 2;
        bad[mid] ^= 0xff;
        bad.truncate(bad.len() - 4);
        let blob = blobs.path().join("bad");
        fs::write(&blob, &bad).unwrap();
        let dest = tempfile::tempdir().unwrap();
        assert!(unpack_blob(&blob, dest.path(), &diff_id, BASE, &AtomicBool::new(false)).is_err());
    }

    #[test]
    fn cancelled_unpack_stops() {
        let tar = Tar::new().file("a", b"1", 0o644, 0, 0).bytes();
        let dir = tempfile::tempdir().unwrap();
        let res = unpack_tar(&tar[..], dir.path(), BASE, &AtomicBool::new(true));
        assert!(matches!(res, Err(ImageError::Io { .. })));
        assert!(!dir.path().join("a").exists());
    }

    #[test]
    fn clean_paths() {
        let c = |s: &str| clean_path(Path::new(s));
        assert_eq!(c("./a/./b/").unwrap(), Some(PathBuf::from("a/b")));
        assert_eq!(c("/abs/x").unwrap(), Some(PathBuf::from("abs/x")));
        assert_eq!(c("./").unwrap(), None);
        assert!(c("a/../b").is_err());
        assert!(c("..").is_err());
    }
}
