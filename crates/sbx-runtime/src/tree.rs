//! Copies of a sandbox's upper directory (a snapshot's files, a fork's own copy of them), as
//! the overlay reads them: owners, modes, times, symlinks, device nodes (an overlay's
//! whiteouts are character devices 0:0) and extended attributes (`trusted.overlay.opaque`),
//! hard links (one file linked again, not copied twice), nothing followed out of the tree.
//! The source is not changing meanwhile (its sandbox is frozen, or it is a snapshot's). A
//! volume's first contents (`copy`) are a copy of the image's directory into it.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Files of more than one link seen so far: (device, inode) -> where the first was copied.
type Links = HashMap<(u64, u64), PathBuf>;

/// Copies the tree at `src` to `dst` (which must not exist). Returns the bytes of the
/// regular files copied.
pub fn copy_tree(src: &Path, dst: &Path) -> io::Result<u64> {
    let meta = fs::symlink_metadata(src)?;
    if !meta.is_dir() {
        return Err(io::Error::other(format!(
            "{} is not a directory",
            src.display()
        )));
    }
    copy_entry(src, dst, &meta, &mut Links::new())
}

/// Copies what the directory `src` holds into the directory `dst` (which exists), and `src`'s
/// owner, mode, times and extended attributes onto `dst`. Returns the bytes of the regular
/// files copied.
pub fn copy_into(src: &Path, dst: &Path) -> io::Result<u64> {
    let meta = fs::symlink_metadata(src)?;
    if !meta.is_dir() {
        return Err(io::Error::other(format!(
            "{} is not a directory",
            src.display()
        )));
    }
    let mut links = Links::new();
    let bytes = copy_children(src, dst, &mut links)?;
    copy_attrs(src, dst, &meta)?;
    Ok(bytes)
}

/// Makes `dst` (which must not exist) a tree of hard links to what the tree at `src` holds:
/// its directories made anew with their owners, modes, times and extended attributes, every
/// other entry (file, symlink, device node, FIFO) linked, sockets left out. Nothing is copied:
/// a cheap hold on what `src` holds now, which a later rename or removal in `src` does not
/// change (a write into a file of `src` does: its file is the same). `dst` must be on the
/// same mount as `src` (else EXDEV). Returns the entries linked.
pub fn link_tree(src: &Path, dst: &Path) -> io::Result<u64> {
    let meta = fs::symlink_metadata(src)?;
    if !meta.is_dir() {
        return Err(io::Error::other(format!(
            "{} is not a directory",
            src.display()
        )));
    }
    link_dir(src, dst, &meta)
}

fn link_dir(src: &Path, dst: &Path, meta: &fs::Metadata) -> io::Result<u64> {
    fs::create_dir(dst)?;
    let mut n = 0;
    for e in fs::read_dir(src)? {
        let e = e?;
        let m = fs::symlink_metadata(e.path())?;
        let ft = m.file_type();
        let to = dst.join(e.file_name());
        if ft.is_dir() {
            n += link_dir(&e.path(), &to, &m)?;
        } else if !ft.is_socket() {
            // link(2) links a symlink itself, never what it points to.
            fs::hard_link(e.path(), &to)?;
            n += 1;
        }
    }
    copy_attrs(src, dst, meta)?;
    Ok(n)
}

fn copy_children(src: &Path, dst: &Path, links: &mut Links) -> io::Result<u64> {
    let mut bytes = 0;
    for e in fs::read_dir(src)? {
        let e = e?;
        let m = fs::symlink_metadata(e.path())?;
        bytes += copy_entry(&e.path(), &dst.join(e.file_name()), &m, links)?;
    }
    Ok(bytes)
}

fn copy_entry(src: &Path, dst: &Path, meta: &fs::Metadata, links: &mut Links) -> io::Result<u64> {
    let ft = meta.file_type();
    let mut bytes = 0;
    if !ft.is_dir() && meta.nlink() > 1 {
        if let Some(first) = links.get(&(meta.dev(), meta.ino())) {
            // A hard link to a file copied already: the same file again, attributes and all.
            fs::hard_link(first, dst)?;
            return Ok(0);
        }
        links.insert((meta.dev(), meta.ino()), dst.to_path_buf());
    }
    if ft.is_dir() {
        fs::create_dir(dst)?;
        bytes += copy_children(src, dst, links)?;
    } else if ft.is_file() {
        let mut from = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(src)?;
        let mut to = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(dst)?;
        bytes += io::copy(&mut from, &mut to)?;
    } else if ft.is_symlink() {
        std::os::unix::fs::symlink(fs::read_link(src)?, dst)?;
    } else if ft.is_char_device() || ft.is_block_device() || ft.is_fifo() || ft.is_socket() {
        let kind = if ft.is_char_device() {
            nix::sys::stat::SFlag::S_IFCHR
        } else if ft.is_block_device() {
            nix::sys::stat::SFlag::S_IFBLK
        } else if ft.is_fifo() {
            nix::sys::stat::SFlag::S_IFIFO
        } else {
            nix::sys::stat::SFlag::S_IFSOCK
        };
        nix::sys::stat::mknod(
            dst,
            kind,
            nix::sys::stat::Mode::from_bits_truncate(meta.mode() & 0o7777),
            meta.rdev(),
        )
        .map_err(io::Error::from)?;
    }
    copy_attrs(src, dst, meta)?;
    Ok(bytes)
}

/// The owner, extended attributes, mode and times of `src` onto `dst` (a symlink's own).
fn copy_attrs(src: &Path, dst: &Path, meta: &fs::Metadata) -> io::Result<()> {
    std::os::unix::fs::lchown(dst, Some(meta.uid()), Some(meta.gid()))?;
    let mut names = vec![0u8; 4096];
    let n = match rustix::fs::llistxattr(src, &mut names) {
        Ok(n) => n,
        Err(rustix::io::Errno::NOTSUP) => 0,
        Err(e) => return Err(e.into()),
    };
    for name in names[..n].split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let name = <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(name);
        let mut value = vec![0u8; 65536];
        let len = rustix::fs::lgetxattr(src, name, &mut value)?;
        rustix::fs::lsetxattr(dst, name, &value[..len], rustix::fs::XattrFlags::empty())?;
    }
    if !meta.file_type().is_symlink() {
        fs::set_permissions(dst, fs::Permissions::from_mode(meta.mode() & 0o7777))?;
    }
    let times = [
        nix::sys::time::TimeSpec::new(meta.atime(), meta.atime_nsec()),
        nix::sys::time::TimeSpec::new(meta.mtime(), meta.mtime_nsec()),
    ];
    nix::sys::stat::utimensat(
        nix::fcntl::AT_FDCWD,
        dst,
        &times[0],
        &times[1],
        nix::sys::stat::UtimensatFlags::NoFollowSymlink,
    )
    .map_err(io::Error::from)
}

/// The disk the tree at `path` takes (its blocks), not following links.
pub fn disk_usage(path: &Path) -> u64 {
    let Ok(meta) = fs::symlink_metadata(path) else {
        return 0;
    };
    let mut n = meta.blocks() * 512;
    if meta.is_dir() {
        if let Ok(rd) = fs::read_dir(path) {
            for e in rd.flatten() {
                n += disk_usage(&e.path());
            }
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tree_is_copied_with_links_modes_devices_and_xattrs() {
        let root = std::env::temp_dir().join(format!("sbx-tree-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let src = root.join("src");
        fs::create_dir_all(src.join("d/e")).unwrap();
        fs::write(src.join("d/e/f"), b"hello").unwrap();
        fs::set_permissions(src.join("d/e/f"), fs::Permissions::from_mode(0o640)).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", src.join("link")).unwrap();
        let root_user = nix::unistd::geteuid().is_root();
        if root_user {
            // An overlay whiteout and an opaque directory.
            nix::sys::stat::mknod(
                &src.join("gone"),
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::empty(),
                0,
            )
            .unwrap();
            rustix::fs::lsetxattr(
                src.join("d"),
                "trusted.overlay.opaque",
                b"y",
                rustix::fs::XattrFlags::empty(),
            )
            .unwrap();
            std::os::unix::fs::lchown(src.join("d/e/f"), Some(100_000), Some(100_000)).unwrap();
        }
        let dst = root.join("dst");
        assert_eq!(copy_tree(&src, &dst).unwrap(), 5);
        assert_eq!(fs::read(dst.join("d/e/f")).unwrap(), b"hello");
        let m = fs::metadata(dst.join("d/e/f")).unwrap();
        assert_eq!(m.mode() & 0o7777, 0o640);
        assert_eq!(
            fs::read_link(dst.join("link")).unwrap(),
            Path::new("/etc/passwd")
        );
        if root_user {
            assert_eq!(m.uid(), 100_000);
            let g = fs::symlink_metadata(dst.join("gone")).unwrap();
            assert!(g.file_type().is_char_device() && g.rdev() == 0);
            let mut v = [0u8; 8];
            let n = rustix::fs::lgetxattr(dst.join("d"), "trusted.overlay.opaque", &mut v).unwrap();
            assert_eq!(&v[..n], b"y");
        }
        assert!(disk_usage(&dst) > 0);
        fs::remove_dir_all(&root).unwrap();
    }

    /// `link_tree` holds what a tree has now: its files the same inodes, its directories
    /// made anew (mode, xattrs), symlinks linked as links; a rename or removal in the source
    /// afterwards leaves the links as they were.
    #[test]
    fn a_tree_of_links_outlives_the_sources_renames() {
        let root = std::env::temp_dir().join(format!("sbx-tree-link-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let src = root.join("src");
        fs::create_dir_all(src.join("d/e")).unwrap();
        fs::write(src.join("d/e/f"), b"hello").unwrap();
        fs::set_permissions(src.join("d"), fs::Permissions::from_mode(0o750)).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", src.join("link")).unwrap();
        let _sock = std::os::unix::net::UnixListener::bind(src.join("sock")).unwrap();
        if nix::unistd::geteuid().is_root() {
            rustix::fs::lsetxattr(
                src.join("d"),
                "trusted.overlay.opaque",
                b"y",
                rustix::fs::XattrFlags::empty(),
            )
            .unwrap();
        }
        let dst = root.join("dst");
        assert_eq!(
            link_tree(&src, &dst).unwrap(),
            2,
            "the file and the symlink"
        );
        let (a, b) = (
            fs::metadata(src.join("d/e/f")).unwrap(),
            fs::metadata(dst.join("d/e/f")).unwrap(),
        );
        assert_eq!(a.ino(), b.ino());
        assert_eq!(fs::metadata(dst.join("d")).unwrap().mode() & 0o7777, 0o750);
        assert_eq!(
            fs::read_link(dst.join("link")).unwrap(),
            Path::new("/etc/passwd")
        );
        assert!(!dst.join("sock").exists(), "sockets are left out");
        if nix::unistd::geteuid().is_root() {
            let mut v = [0u8; 8];
            let n = rustix::fs::lgetxattr(dst.join("d"), "trusted.overlay.opaque", &mut v).unwrap();
            assert_eq!(&v[..n], b"y");
        }
        // The source moves on: a file replaced by a rename, another removed.
        fs::write(src.join("new"), b"other").unwrap();
        fs::rename(src.join("new"), src.join("d/e/f")).unwrap();
        fs::remove_file(src.join("link")).unwrap();
        assert_eq!(fs::read(dst.join("d/e/f")).unwrap(), b"hello");
        assert!(fs::symlink_metadata(dst.join("link")).is_ok());
        assert!(link_tree(&src, &dst).is_err(), "dst must be new");
        fs::remove_dir_all(&root).unwrap();
    }

    /// `copy_into` fills a directory that exists: a hard link stays one file (copied once),
    /// the root takes the source's mode and times.
    #[test]
    fn copy_into_keeps_hard_links_and_the_roots_attributes() {
        let root = std::env::temp_dir().join(format!("sbx-tree-into-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let src = root.join("src");
        fs::create_dir_all(src.join("sub")).unwrap();
        fs::write(src.join("a"), b"shared").unwrap();
        fs::hard_link(src.join("a"), src.join("sub/b")).unwrap();
        fs::set_permissions(&src, fs::Permissions::from_mode(0o2750)).unwrap();
        let dst = root.join("dst");
        fs::create_dir(&dst).unwrap();
        assert_eq!(
            copy_into(&src, &dst).unwrap(),
            6,
            "the linked file is copied once"
        );
        let a = fs::metadata(dst.join("a")).unwrap();
        let b = fs::metadata(dst.join("sub/b")).unwrap();
        assert_eq!((a.ino(), a.nlink()), (b.ino(), 2));
        let d = fs::metadata(&dst).unwrap();
        let s = fs::metadata(&src).unwrap();
        assert_eq!(d.mode() & 0o7777, 0o2750);
        assert_eq!(d.mtime(), s.mtime());
        fs::remove_dir_all(&root).unwrap();
    }
}
