//! A directory as a tar stream: what an overlay's upper directory or CRIU's images hold.
//!
//! The root first (as `.`), then each directory's entries by name, parents before children.
//! Kept: regular files (holes as GNU sparse entries where the filesystem tells them), directories,
//! symlinks (never followed), hard links (one copy of the data), character and block devices
//! and FIFOs (an overlay's whiteouts are character devices 0:0), modes with setuid/setgid/sticky,
//! owners (numeric), mtimes (seconds) and extended attributes (as PAX `SCHILY.xattr.*`, e.g.
//! `trusted.overlay.opaque`). Sockets are left out (nothing can be restored of one).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs;
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use tar::{Builder, EntryType, Header, HeaderMode};

use crate::error::{BlobError, Result};

/// What a tree held.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Packed {
    /// Entries written (the root included).
    pub entries: u64,
    /// Sockets left out.
    pub skipped: u64,
}

/// Writes `dir` as a tar stream into `out`.
pub(crate) fn pack_tree(dir: &Path, out: &mut dyn Write) -> Result<Packed> {
    let meta = fs::symlink_metadata(dir).map_err(|e| BlobError::io(dir, e))?;
    if !meta.is_dir() {
        return Err(BlobError::NotADirectory {
            path: dir.to_path_buf(),
        });
    }
    let mut b = Builder::new(out);
    b.follow_symlinks(false);
    b.mode(HeaderMode::Complete);
    let mut packed = Packed::default();
    // (device, inode) of files with more than one link -> the name written first.
    let mut links: HashMap<(u64, u64), PathBuf> = HashMap::new();
    append(&mut b, dir, Path::new("."), &meta, &mut links)?;
    packed.entries += 1;
    let mut todo = vec![(dir.to_path_buf(), PathBuf::new())];
    while let Some((abs, rel)) = todo.pop() {
        let mut names = Vec::new();
        for e in fs::read_dir(&abs).map_err(|e| BlobError::io(&abs, e))? {
            names.push(e.map_err(|e| BlobError::io(&abs, e))?.file_name());
        }
        names.sort();
        let mut subdirs = Vec::new();
        for name in names {
            let path = abs.join(&name);
            let rel = rel.join(&name);
            let meta = fs::symlink_metadata(&path).map_err(|e| BlobError::io(&path, e))?;
            if is_socket(&meta) {
                packed.skipped += 1;
                continue;
            }
            append(&mut b, &path, &rel, &meta, &mut links)?;
            packed.entries += 1;
            if meta.is_dir() {
                subdirs.push((path, rel));
            }
        }
        // Visited in name order: the stack pops the last first.
        todo.extend(subdirs.into_iter().rev());
    }
    b.into_inner().map_err(|e| BlobError::io(dir, e))?;
    Ok(packed)
}

/// The PAX key prefix of an extended attribute whose value is hex (it holds a newline).
pub(crate) const HEX_XATTR: &str = "SBX.xattr.hex.";

fn hex(v: &[u8]) -> String {
    v.iter().map(|b| format!("{b:02x}")).collect()
}

fn is_socket(meta: &fs::Metadata) -> bool {
    meta.file_type().is_socket()
}

fn append<W: Write>(
    b: &mut Builder<W>,
    path: &Path,
    rel: &Path,
    meta: &fs::Metadata,
    links: &mut HashMap<(u64, u64), PathBuf>,
) -> Result<()> {
    let io_err = |e: io::Error| BlobError::io(path, e);
    let xattrs = read_xattrs(path, meta).map_err(io_err)?;
    if !xattrs.is_empty() {
        // The tar crate reads PAX records by splitting at newlines: a value with one (binary
        // xattrs do: overlay's `trusted.overlay.origin` is a file handle) goes hex-encoded
        // under a key of ours, read back by `unpack::pax_xattrs`.
        let keys: Vec<(String, Vec<u8>)> = xattrs
            .iter()
            .map(|(k, v)| {
                if v.contains(&b'\n') {
                    (format!("{HEX_XATTR}{k}"), hex(v).into_bytes())
                } else {
                    (format!("SCHILY.xattr.{k}"), v.clone())
                }
            })
            .collect();
        b.append_pax_extensions(keys.iter().map(|(k, v)| (k.as_str(), v.as_slice())))
            .map_err(io_err)?;
    }
    if meta.is_file() && meta.nlink() > 1 {
        if let Some(first) = links.get(&(meta.dev(), meta.ino())) {
            let mut h = Header::new_gnu();
            h.set_metadata_in_mode(meta, HeaderMode::Complete);
            h.set_entry_type(EntryType::Link);
            h.set_size(0);
            return b.append_link(&mut h, rel, first).map_err(io_err);
        }
        links.insert((meta.dev(), meta.ino()), rel.to_path_buf());
    }
    let ft = meta.file_type();
    if ft.is_file() || ft.is_dir() || ft.is_symlink() {
        return b.append_path_with_name(path, rel).map_err(io_err);
    }
    // Devices and FIFOs by hand: tar's own puts the source's path in the header, not `rel`.
    let kind = if ft.is_char_device() {
        EntryType::Char
    } else if ft.is_block_device() {
        EntryType::Block
    } else if ft.is_fifo() {
        EntryType::Fifo
    } else {
        return Err(io_err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a file of an unknown type",
        )));
    };
    let mut h = Header::new_gnu();
    h.set_metadata_in_mode(meta, HeaderMode::Complete);
    h.set_entry_type(kind);
    h.set_size(0);
    let rdev = meta.rdev();
    h.set_device_major(rustix::fs::major(rdev))
        .map_err(io_err)?;
    h.set_device_minor(rustix::fs::minor(rdev))
        .map_err(io_err)?;
    b.append_data(&mut h, rel, io::empty()).map_err(io_err)
}

/// The extended attributes of `path` itself (not of a symlink's target), by name.
fn read_xattrs(path: &Path, meta: &fs::Metadata) -> io::Result<Vec<(String, Vec<u8>)>> {
    if meta.file_type().is_symlink() {
        // Only trusted.* and security.* can be on a symlink; tar's unpack sets none there.
        return Ok(Vec::new());
    }
    let size = match rustix::fs::llistxattr_query(path) {
        Ok(n) => n,
        Err(rustix::io::Errno::NOTSUP) => return Ok(Vec::new()),
        Err(e) => return Err(e.into()),
    };
    if size == 0 {
        return Ok(Vec::new());
    }
    let mut names = vec![0u8; size];
    let n = rustix::fs::llistxattr(path, &mut names[..])?;
    let mut out = Vec::new();
    for name in names[..n].split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let os = OsStr::from_bytes(name);
        let Some(text) = os.to_str() else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("an extended attribute's name is not UTF-8: {os:?}"),
            ));
        };
        let len = match rustix::fs::lgetxattr_query(path, os) {
            Ok(n) => n,
            // Gone between the list and the read.
            Err(rustix::io::Errno::NODATA) => continue,
            Err(e) => return Err(e.into()),
        };
        let mut value = vec![0u8; len];
        let len = rustix::fs::lgetxattr(path, os, &mut value[..])?;
        value.truncate(len);
        out.push((text.to_string(), value));
    }
    out.sort();
    Ok(out)
}
