//! What the store's tests share: a tree of every kind of entry, a comparison of two trees,
//! and a SeaweedFS server on loopback.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

pub fn am_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Pseudo-random bytes (xorshift): incompressible, the same for a seed.
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    // Seeds mixed (so that close seeds give unrelated streams), never 0.
    let mut x = seed.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

const MTIME: i64 = 1_600_000_000;

fn set_mtime(p: &Path) {
    let t = filetime::FileTime::from_unix_time(MTIME, 0);
    filetime::set_symlink_file_times(p, t, t).unwrap();
}

/// A tree of every kind of entry a sandbox's upper directory or CRIU's images have, with a file
/// of `big` bytes (half noise, half text). Devices, owners and trusted.* attributes only as
/// root.
pub fn make_tree(root: &Path, big: usize) {
    fs::create_dir_all(root).unwrap();
    let w = |p: &str, data: &[u8], mode: u32| {
        let path = root.join(p);
        fs::write(&path, data).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
    };
    fs::create_dir_all(root.join("etc/app")).unwrap();
    fs::create_dir_all(root.join("empty")).unwrap();
    fs::create_dir_all(root.join("ro")).unwrap();
    w("etc/app/config.toml", b"name = \"sbx\"\n", 0o644);
    w("etc/app/secret", b"s3cr3t", 0o600);
    w("run.sh", b"#!/bin/sh\necho hi\n", 0o755);
    w("suid", b"\x7fELF-not-really", 0o4755);
    w("ro/inside", b"in a read-only directory", 0o444);
    w("empty-file", b"", 0o644);
    // A name of 150 bytes (GNU long names) in a deep path.
    let long = "n".repeat(150);
    fs::create_dir_all(root.join("deep/a/b/c")).unwrap();
    w(&format!("deep/a/b/c/{long}"), b"long name", 0o644);
    // The big file: half incompressible, half compressible.
    let mut data = noise(7, big / 2);
    data.extend(b"compressible text ".iter().cycle().take(big - big / 2));
    w("big.bin", &data, 0o644);
    // A sparse file: 1 MiB of data at 32 MiB in 64 MiB.
    {
        let f = fs::File::create(root.join("sparse.img")).unwrap();
        f.set_len(64 << 20).unwrap();
        use std::os::unix::fs::FileExt;
        f.write_all_at(&noise(9, 1 << 20), 32 << 20).unwrap();
    }
    // Symlinks: relative, absolute (a path in the sandbox's root), dangling.
    std::os::unix::fs::symlink("etc/app/config.toml", root.join("config")).unwrap();
    std::os::unix::fs::symlink("/usr/bin/python3", root.join("python")).unwrap();
    std::os::unix::fs::symlink("nowhere/at/all", root.join("dangling")).unwrap();
    // Hard links.
    fs::hard_link(root.join("run.sh"), root.join("etc/run-link")).unwrap();
    // A FIFO.
    rustix::fs::mknodat(
        rustix::fs::CWD,
        root.join("fifo"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o640),
        0,
    )
    .unwrap();
    rustix::fs::lsetxattr(
        root.join("etc/app/config.toml"),
        "user.sbx.note",
        b"kept\0binary\xff",
        rustix::fs::XattrFlags::empty(),
    )
    .unwrap();
    if am_root() {
        // An overlay's whiteout and opaque directory, and a sandbox's owners.
        rustix::fs::mknodat(
            rustix::fs::CWD,
            root.join("etc/deleted"),
            rustix::fs::FileType::CharacterDevice,
            rustix::fs::Mode::from_raw_mode(0o000),
            rustix::fs::makedev(0, 0),
        )
        .unwrap();
        rustix::fs::lsetxattr(
            root.join("etc/app"),
            "trusted.overlay.opaque",
            b"y",
            rustix::fs::XattrFlags::empty(),
        )
        .unwrap();
        for p in ["etc/app/config.toml", "etc/app", "run.sh", "."] {
            std::os::unix::fs::lchown(root.join(p), Some(100_000), Some(100_000)).unwrap();
        }
        std::os::unix::fs::lchown(root.join("config"), Some(100_001), Some(100_002)).unwrap();
    }
    fs::set_permissions(root.join("ro"), fs::Permissions::from_mode(0o555)).unwrap();
    // Fixed mtimes, directories last.
    let mut all = walk(root);
    all.reverse();
    for p in all {
        set_mtime(&root.join(p));
    }
    set_mtime(root);
}

/// Every path under `root`, relative, sorted (root itself as "").
pub fn walk(root: &Path) -> Vec<PathBuf> {
    let mut out = vec![PathBuf::new()];
    let mut todo = vec![PathBuf::new()];
    while let Some(rel) = todo.pop() {
        for e in fs::read_dir(root.join(&rel)).unwrap() {
            let e = e.unwrap();
            let r = rel.join(e.file_name());
            if e.file_type().unwrap().is_dir() {
                todo.push(r.clone());
            }
            out.push(r);
        }
    }
    out.sort();
    out
}

fn xattrs(p: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let Ok(size) = rustix::fs::llistxattr_query(p) else {
        return out;
    };
    let mut names = vec![0u8; size];
    let n = rustix::fs::llistxattr(p, &mut names[..]).unwrap();
    for name in names[..n].split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let os = OsStr::from_bytes(name);
        let len = rustix::fs::lgetxattr_query(p, os).unwrap();
        let mut v = vec![0u8; len];
        let len = rustix::fs::lgetxattr(p, os, &mut v[..]).unwrap();
        v.truncate(len);
        out.insert(os.to_string_lossy().into_owned(), v);
    }
    out
}

/// Whether two files hold the same bytes (read side by side: no hashing, which is slow in
/// a debug build).
fn same_content(a: &Path, b: &Path) -> bool {
    let mut fa = fs::File::open(a).unwrap();
    let mut fb = fs::File::open(b).unwrap();
    let mut ba = vec![0u8; 1 << 20];
    let mut bb = vec![0u8; 1 << 20];
    loop {
        let na = read_full(&mut fa, &mut ba);
        let nb = read_full(&mut fb, &mut bb);
        if na != nb || ba[..na] != bb[..nb] {
            return false;
        }
        if na == 0 {
            return true;
        }
    }
}

fn read_full(f: &mut fs::File, buf: &mut [u8]) -> usize {
    let mut n = 0;
    while n < buf.len() {
        let k = f.read(&mut buf[n..]).unwrap();
        if k == 0 {
            break;
        }
        n += k;
    }
    n
}

/// One entry as the comparison sees it.
fn describe(root: &Path, rel: &Path) -> String {
    let p = root.join(rel);
    let m = fs::symlink_metadata(&p).unwrap();
    let ft = m.file_type();
    let kind = if ft.is_dir() {
        "dir".to_string()
    } else if ft.is_symlink() {
        format!("symlink -> {}", fs::read_link(&p).unwrap().display())
    } else if ft.is_file() {
        format!("file {} bytes links {}", m.len(), m.nlink())
    } else if ft.is_char_device() {
        format!("char {}", m.rdev())
    } else if ft.is_block_device() {
        format!("block {}", m.rdev())
    } else if ft.is_fifo() {
        "fifo".to_string()
    } else {
        "other".to_string()
    };
    let owner = if am_root() {
        format!(" owner {}:{}", m.uid(), m.gid())
    } else {
        String::new()
    };
    let mode = if ft.is_symlink() {
        String::new()
    } else {
        format!(" mode {:o}", m.mode() & 0o7777)
    };
    format!(
        "{}: {kind}{mode}{owner} mtime {} xattrs {:?}",
        rel.display(),
        m.mtime(),
        xattrs(&p)
    )
}

/// Asserts that two trees hold the same entries, kinds, contents, modes, owners (as root),
/// mtimes and extended attributes; hard links stay links.
pub fn assert_same_tree(a: &Path, b: &Path) {
    let wa = walk(a);
    let wb = walk(b);
    assert_eq!(wa, wb, "the trees list different paths");
    for rel in &wa {
        assert_eq!(describe(a, rel), describe(b, rel));
        let pa = a.join(rel);
        if fs::symlink_metadata(&pa).unwrap().is_file() {
            assert!(
                same_content(&pa, &b.join(rel)),
                "{}: the content changed",
                rel.display()
            );
        }
    }
    let ia = fs::metadata(b.join("run.sh")).map(|m| m.ino());
    let ib = fs::metadata(b.join("etc/run-link")).map(|m| m.ino());
    if let (Ok(x), Ok(y)) = (ia, ib) {
        assert_eq!(x, y, "a hard link became a copy");
    }
}

/// Bytes allocated to a file.
pub fn allocated(p: &Path) -> u64 {
    fs::metadata(p).unwrap().blocks() * 512
}

/// Every regular file under `dir` (the local store's objects and staging files).
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    if !dir.exists() {
        return Vec::new();
    }
    walk(dir)
        .into_iter()
        .filter(|r| fs::symlink_metadata(dir.join(r)).unwrap().is_file())
        .collect()
}
