//! A tar stream (of [`crate::pack`]) back into a directory, refusing whatever would land outside.
//!
//! Refused: absolute paths and `..`; an entry whose path goes through a symlink or a file (an
//! archive that makes `a -> /etc` then writes `a/passwd`); a hard link to a path refused so, or to
//! nothing yet unpacked; an entry whose path is already taken but by a directory; entry types
//! other than files, directories, symlinks, hard links, devices and FIFOs. A symlink's target is
//! kept as written (an absolute one means a path in the sandbox's root, not the host's): it is
//! never followed here. Owners are kept when this process is root (else the files are its own);
//! modes, mtimes and extended attributes always. Directories get their attributes last, deepest
//! first, so that a read-only one still takes its entries.

use std::ffi::OsStr;
use std::fs;
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

use tar::{Archive, EntryType};

use crate::error::{BlobError, Result};

/// What was unpacked.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Unpacked {
    pub entries: u64,
}

struct DirAttrs {
    path: PathBuf,
    mode: u32,
    owner: Option<(u64, u64)>,
    mtime: u64,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

/// Unpacks the tar stream `r` into `dest`, an existing directory (empty: the caller sees to it).
/// `key` names the object in errors.
pub(crate) fn unpack_tree(key: &str, r: &mut dyn Read, dest: &Path) -> Result<Unpacked> {
    let root = dest.canonicalize().map_err(|e| BlobError::io(dest, e))?;
    let am_root = rustix::process::geteuid().is_root();
    let corrupt = |e: io::Error| BlobError::Corrupt {
        key: key.to_string(),
        why: e.to_string(),
    };
    let refuse = |entry: &Path, why: &str| BlobError::Unsafe {
        key: key.to_string(),
        entry: entry.display().to_string(),
        why: why.to_string(),
    };
    let mut ar = Archive::new(r);
    ar.set_preserve_permissions(true);
    ar.set_preserve_mtime(true);
    ar.set_preserve_ownerships(am_root);
    ar.set_unpack_xattrs(false);
    ar.set_overwrite(false);
    ar.set_mask(0);
    let mut dirs = Vec::new();
    let mut out = Unpacked::default();
    for entry in ar.entries().map_err(corrupt)? {
        let mut entry = entry.map_err(corrupt)?;
        let raw = entry.path_bytes().into_owned();
        let shown = Path::new(OsStr::from_bytes(&raw)).to_path_buf();
        let rel = safe_rel(&raw).map_err(|why| refuse(&shown, why))?;
        let target = root.join(&rel);
        make_parents(&root, &rel).map_err(|e| match e {
            Walk::Refused(why) => refuse(&shown, why),
            Walk::Io(p, e) => BlobError::io(p, e),
        })?;
        let xattrs = pax_xattrs(&mut entry).map_err(corrupt)?;
        let h = entry.header();
        let kind = h.entry_type();
        let mode = h.mode().map_err(corrupt)?;
        let owner = if am_root {
            Some((h.uid().map_err(corrupt)?, h.gid().map_err(corrupt)?))
        } else {
            None
        };
        let mtime = h.mtime().map_err(corrupt)?;
        let io_err = |e: io::Error| BlobError::io(&target, e);
        match kind {
            EntryType::Directory => {
                if !rel.as_os_str().is_empty() {
                    match fs::symlink_metadata(&target) {
                        Ok(m) if m.is_dir() => {}
                        Ok(_) => return Err(refuse(&shown, "its path is taken")),
                        Err(e) if e.kind() == io::ErrorKind::NotFound => {
                            fs::create_dir(&target).map_err(io_err)?
                        }
                        Err(e) => return Err(io_err(e)),
                    }
                }
                dirs.push(DirAttrs {
                    path: target,
                    mode,
                    owner,
                    mtime,
                    xattrs,
                });
            }
            EntryType::Regular
            | EntryType::Continuous
            | EntryType::GNUSparse
            | EntryType::Symlink => {
                if rel.as_os_str().is_empty() {
                    return Err(refuse(&shown, "the root must be a directory"));
                }
                // tar opens files with O_CREAT|O_EXCL and makes symlinks that must not exist.
                entry.unpack(&target).map_err(io_err)?;
                if kind != EntryType::Symlink {
                    set_xattrs(&target, &xattrs).map_err(io_err)?;
                }
            }
            EntryType::Link => {
                let link = match entry.link_name_bytes() {
                    Some(l) => l.into_owned(),
                    None => return Err(refuse(&shown, "a hard link without a target")),
                };
                let src_rel = safe_rel(&link).map_err(|why| refuse(&shown, why))?;
                if src_rel.as_os_str().is_empty() || rel.as_os_str().is_empty() {
                    return Err(refuse(&shown, "a hard link of the root"));
                }
                check_within(&root, &src_rel).map_err(|e| match e {
                    Walk::Refused(why) => refuse(&shown, why),
                    Walk::Io(p, e) => BlobError::io(p, e),
                })?;
                let src = root.join(&src_rel);
                match fs::symlink_metadata(&src) {
                    Ok(m) if !m.is_dir() => {}
                    Ok(_) => return Err(refuse(&shown, "a hard link to a directory")),
                    Err(_) => return Err(refuse(&shown, "a hard link to nothing unpacked")),
                }
                fs::hard_link(&src, &target).map_err(io_err)?;
            }
            EntryType::Char | EntryType::Block | EntryType::Fifo => {
                if rel.as_os_str().is_empty() {
                    return Err(refuse(&shown, "the root must be a directory"));
                }
                let (file_type, dev) = match kind {
                    EntryType::Fifo => (rustix::fs::FileType::Fifo, 0),
                    _ => {
                        let major = h.device_major().map_err(corrupt)?.unwrap_or(0);
                        let minor = h.device_minor().map_err(corrupt)?.unwrap_or(0);
                        let t = if kind == EntryType::Char {
                            rustix::fs::FileType::CharacterDevice
                        } else {
                            rustix::fs::FileType::BlockDevice
                        };
                        (t, rustix::fs::makedev(major, minor))
                    }
                };
                rustix::fs::mknodat(
                    rustix::fs::CWD,
                    &target,
                    file_type,
                    rustix::fs::Mode::from_raw_mode(mode & 0o777),
                    dev,
                )
                .map_err(|e| io_err(e.into()))?;
                set_attrs(&target, mode, owner, mtime, &xattrs).map_err(io_err)?;
            }
            EntryType::XGlobalHeader => continue,
            other => {
                return Err(refuse(
                    &shown,
                    &format!("entry type {other:?} is not taken"),
                ))
            }
        }
        out.entries += 1;
    }
    // Deepest first: a directory's own times and mode once nothing more is made in it.
    dirs.sort_by(|a, b| b.path.cmp(&a.path));
    for d in dirs {
        set_attrs(&d.path, d.mode, d.owner, d.mtime, &d.xattrs)
            .map_err(|e| BlobError::io(&d.path, e))?;
    }
    Ok(out)
}

/// An archive's path as a relative path of normal components (empty: the root, `.`).
fn safe_rel(raw: &[u8]) -> Result<PathBuf, &'static str> {
    if raw.is_empty() {
        return Err("an empty path");
    }
    if raw.contains(&0) {
        return Err("a path with a NUL byte");
    }
    let mut rel = PathBuf::new();
    for c in Path::new(OsStr::from_bytes(raw)).components() {
        match c {
            Component::Normal(n) => rel.push(n),
            Component::CurDir => {}
            Component::ParentDir => return Err("a path with `..`"),
            Component::RootDir | Component::Prefix(_) => return Err("an absolute path"),
        }
    }
    Ok(rel)
}

enum Walk {
    Refused(&'static str),
    Io(PathBuf, io::Error),
}

/// Makes the missing directories above `rel` under `root`; refuses one that is a symlink or a
/// file.
fn make_parents(root: &Path, rel: &Path) -> Result<(), Walk> {
    let Some(parent) = rel.parent() else {
        return Ok(());
    };
    let mut cur = root.to_path_buf();
    for c in parent.components() {
        cur.push(c);
        match fs::symlink_metadata(&cur) {
            Ok(m) if m.is_dir() => {}
            Ok(m) if m.file_type().is_symlink() => {
                return Err(Walk::Refused("a path through a symlink"))
            }
            Ok(_) => return Err(Walk::Refused("a path through a file")),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::create_dir(&cur).map_err(|e| Walk::Io(cur.clone(), e))?
            }
            Err(e) => return Err(Walk::Io(cur, e)),
        }
    }
    Ok(())
}

/// Refuses a path whose directories above it, under `root`, are not all directories.
fn check_within(root: &Path, rel: &Path) -> Result<(), Walk> {
    let Some(parent) = rel.parent() else {
        return Ok(());
    };
    let mut cur = root.to_path_buf();
    for c in parent.components() {
        cur.push(c);
        match fs::symlink_metadata(&cur) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(Walk::Refused("a hard link through a symlink or a file")),
            Err(_) => return Err(Walk::Refused("a hard link to nothing unpacked")),
        }
    }
    Ok(())
}

/// The `SCHILY.xattr.*` records of an entry's PAX header.
fn pax_xattrs<R: Read>(entry: &mut tar::Entry<'_, R>) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let mut out = Vec::new();
    if let Some(exts) = entry.pax_extensions()? {
        for ext in exts {
            let ext = ext?;
            let key = ext.key_bytes();
            if let Some(name) = key.strip_prefix(b"SCHILY.xattr.") {
                out.push((name.to_vec(), ext.value_bytes().to_vec()));
            } else if let Some(name) = key.strip_prefix(crate::pack::HEX_XATTR.as_bytes()) {
                let value = unhex(ext.value_bytes()).ok_or_else(|| {
                    io::Error::new(
                        io::ErrorKind::InvalidData,
                        "an xattr's hex value is not hex",
                    )
                })?;
                out.push((name.to_vec(), value));
            }
        }
    }
    Ok(out)
}

fn unhex(s: &[u8]) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    s.chunks(2)
        .map(|p| u8::from_str_radix(std::str::from_utf8(p).ok()?, 16).ok())
        .collect()
}

fn set_xattrs(path: &Path, xattrs: &[(Vec<u8>, Vec<u8>)]) -> io::Result<()> {
    for (name, value) in xattrs {
        rustix::fs::lsetxattr(
            path,
            OsStr::from_bytes(name),
            value,
            rustix::fs::XattrFlags::empty(),
        )?;
    }
    Ok(())
}

/// Owner (first: a chown clears setuid bits and capabilities), mode, extended attributes and
/// mtime of a directory or a device node, never through a symlink.
fn set_attrs(
    path: &Path,
    mode: u32,
    owner: Option<(u64, u64)>,
    mtime: u64,
    xattrs: &[(Vec<u8>, Vec<u8>)],
) -> io::Result<()> {
    if let Some((uid, gid)) = owner {
        let uid = u32::try_from(uid).map_err(|_| io::Error::other("a uid over 32 bits"))?;
        let gid = u32::try_from(gid).map_err(|_| io::Error::other("a gid over 32 bits"))?;
        std::os::unix::fs::lchown(path, Some(uid), Some(gid))?;
    }
    fs::set_permissions(path, fs::Permissions::from_mode(mode & 0o7777))?;
    set_xattrs(path, xattrs)?;
    let t = filetime::FileTime::from_unix_time(i64::try_from(mtime).unwrap_or(i64::MAX), 0);
    filetime::set_symlink_file_times(path, t, t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use tar::Header;

    /// A header with a raw name (tar's own setters refuse the evil ones).
    fn header(name: &[u8], kind: EntryType, size: u64) -> Header {
        let mut h = Header::new_gnu();
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        h.set_entry_type(kind);
        h.set_mode(0o644);
        h.set_uid(u64::from(rustix::process::geteuid().as_raw()));
        h.set_gid(u64::from(rustix::process::getegid().as_raw()));
        h.set_size(size);
        h.set_mtime(1_600_000_000);
        h
    }

    fn archive(entries: &[(Header, &[u8])]) -> Vec<u8> {
        let mut out = Vec::new();
        for (h, data) in entries {
            let mut h = h.clone();
            h.set_cksum();
            out.extend_from_slice(h.as_bytes());
            out.extend_from_slice(data);
            let pad = (512 - data.len() % 512) % 512;
            out.extend(std::iter::repeat_n(0u8, pad));
        }
        out.extend([0u8; 1024]);
        out
    }

    fn link(name: &[u8], kind: EntryType, target: &[u8]) -> Header {
        let mut h = header(name, kind, 0);
        h.set_link_name_literal(target).unwrap();
        h
    }

    fn unpack(bytes: &[u8], dest: &Path) -> Result<Unpacked> {
        unpack_tree("test", &mut &bytes[..], dest)
    }

    /// Every file under `dir`, relative.
    fn listing(dir: &Path) -> Vec<String> {
        let mut out = Vec::new();
        let mut todo = vec![dir.to_path_buf()];
        while let Some(d) = todo.pop() {
            for e in fs::read_dir(&d).unwrap() {
                let e = e.unwrap();
                out.push(e.path().strip_prefix(dir).unwrap().display().to_string());
                if e.file_type().unwrap().is_dir() {
                    todo.push(e.path());
                }
            }
        }
        out.sort();
        out
    }

    fn assert_refused(bytes: &[u8], why: &str) {
        let top = tempfile::tempdir().unwrap();
        let dest = top.path().join("dest");
        fs::create_dir(&dest).unwrap();
        let outside = top.path().join("outside");
        fs::create_dir(&outside).unwrap();
        match unpack(bytes, &dest) {
            Err(BlobError::Unsafe { why: w, .. }) => assert!(w.contains(why), "{w}"),
            other => panic!("expected a refusal ({why}), got {other:?}"),
        }
        assert_eq!(listing(&outside), Vec::<String>::new(), "written outside");
        assert!(!top.path().join("evil").exists(), "written next to dest");
    }

    /// Binary extended attributes (a newline among their bytes, as overlay's file handles in
    /// `trusted.overlay.origin` have) go through a pack and an unpack whole, beside plain ones.
    #[test]
    fn binary_xattrs_with_newlines_come_back() {
        let top = tempfile::tempdir().unwrap();
        let src = top.path().join("src");
        fs::create_dir(&src).unwrap();
        let file = src.join("f");
        fs::write(&file, b"data").unwrap();
        let binary: Vec<u8> = vec![0x00, 0xfb, b'\n', 0x0a, b'=', 0x20, 0xff, b'\n'];
        rustix::fs::lsetxattr(&file, "user.bin", &binary, rustix::fs::XattrFlags::empty())
            .expect("user xattrs on the test's temp directory");
        rustix::fs::lsetxattr(
            &file,
            "user.text",
            b"plain",
            rustix::fs::XattrFlags::empty(),
        )
        .unwrap();
        let mut tar = Vec::new();
        crate::pack::pack_tree(&src, &mut tar).unwrap();
        let dest = top.path().join("dest");
        fs::create_dir(&dest).unwrap();
        unpack_tree("t", &mut tar.as_slice(), &dest).unwrap();
        let get = |name: &str| {
            let mut buf = vec![0u8; 64];
            let n = rustix::fs::lgetxattr(dest.join("f"), name, &mut buf).unwrap();
            buf.truncate(n);
            buf
        };
        assert_eq!(get("user.bin"), binary);
        assert_eq!(get("user.text"), b"plain");
        assert_eq!(fs::read(dest.join("f")).unwrap(), b"data");
    }

    #[test]
    fn parent_dirs_and_absolute_paths_are_refused() {
        assert_refused(
            &archive(&[(header(b"../evil", EntryType::Regular, 3), b"bad")]),
            "`..`",
        );
        assert_refused(
            &archive(&[(header(b"a/../../evil", EntryType::Regular, 3), b"bad")]),
            "`..`",
        );
        assert_refused(
            &archive(&[(header(b"/tmp/evil", EntryType::Regular, 3), b"bad")]),
            "absolute",
        );
    }

    #[test]
    fn writing_through_a_symlink_is_refused() {
        let top = tempfile::tempdir().unwrap();
        // Relative (climbs out) and absolute symlinks: kept as links, never written through.
        let abs = top.path().join("outside");
        let bytes = archive(&[
            (link(b"up", EntryType::Symlink, b"../outside"), b""),
            (header(b"up/evil", EntryType::Regular, 3), b"bad"),
        ]);
        assert_refused(&bytes, "symlink");
        let bytes = archive(&[
            (
                link(b"abs", EntryType::Symlink, abs.as_os_str().as_bytes()),
                b"",
            ),
            (header(b"abs/evil", EntryType::Directory, 0), b""),
        ]);
        assert_refused(&bytes, "symlink");
        // A symlink over an existing name is refused too (it exists already).
        let dest = top.path().join("d2");
        fs::create_dir(&dest).unwrap();
        let bytes = archive(&[
            (header(b"f", EntryType::Regular, 2), b"ok"),
            (link(b"f", EntryType::Symlink, b"/etc/passwd"), b""),
        ]);
        assert!(matches!(unpack(&bytes, &dest), Err(BlobError::Io { .. })));
        assert_eq!(fs::read(dest.join("f")).unwrap(), b"ok");
    }

    #[test]
    fn hard_links_out_of_the_tree_are_refused() {
        assert_refused(
            &archive(&[(link(b"h", EntryType::Link, b"../outside/x"), b"")]),
            "`..`",
        );
        assert_refused(
            &archive(&[(link(b"h", EntryType::Link, b"/etc/passwd"), b"")]),
            "absolute",
        );
        assert_refused(
            &archive(&[
                (link(b"up", EntryType::Symlink, b"/etc"), b""),
                (link(b"h", EntryType::Link, b"up/passwd"), b""),
            ]),
            "symlink",
        );
        assert_refused(
            &archive(&[(link(b"h", EntryType::Link, b"nothing"), b"")]),
            "nothing",
        );
    }

    #[test]
    fn a_hard_link_inside_shares_the_inode() {
        use std::os::unix::fs::MetadataExt;
        let top = tempfile::tempdir().unwrap();
        let bytes = archive(&[
            (header(b"d", EntryType::Directory, 0), b""),
            (header(b"d/f", EntryType::Regular, 5), b"hello"),
            (link(b"g", EntryType::Link, b"d/f"), b""),
        ]);
        let got = unpack(&bytes, top.path()).unwrap();
        assert_eq!(got.entries, 3);
        let a = fs::metadata(top.path().join("d/f")).unwrap();
        let b = fs::metadata(top.path().join("g")).unwrap();
        assert_eq!(a.ino(), b.ino());
        assert_eq!(fs::read(top.path().join("g")).unwrap(), b"hello");
    }

    #[test]
    fn a_damaged_stream_is_corrupt_not_a_panic() {
        let top = tempfile::tempdir().unwrap();
        let mut bytes = archive(&[(header(b"f", EntryType::Regular, 5), b"hello")]);
        bytes[150] ^= 0xff; // the checksum no longer matches
        assert!(matches!(
            unpack(&bytes, top.path()),
            Err(BlobError::Corrupt { .. })
        ));
        let mut w = Vec::new();
        w.write_all(b"not a tar stream at all, but long enough to be read as a header")
            .unwrap();
        w.resize(512, b'x');
        assert!(unpack(&w, top.path()).is_err());
    }
}
