//! Entries (stat, lstat, their kinds), owners and modes of what is made, directories made
//! with their parents, and the operations on the tree: stat, list, mkdir, rm, mv, chmod.

use std::fs::{self, Metadata, Permissions};
use std::io;
use std::os::unix::fs::{chown, lchown, DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use sbx_proto::{FsEntry, FsErrorCode, FsFailure, FsKind, FsResult};

use super::path::{errno_of, fail, invalid, normalize};
use super::walk::{walk, Flow};
use super::{Ctx, Res, REPLY_BUDGET};

/// The most entries a listing answers.
const MAX_LIST: u32 = 10_000;

fn kind_of(md: &Metadata) -> FsKind {
    let ft = md.file_type();
    if ft.is_dir() {
        FsKind::Dir
    } else if ft.is_symlink() {
        FsKind::Symlink
    } else if ft.is_file() {
        FsKind::File
    } else if ft.is_fifo() {
        FsKind::Fifo
    } else if ft.is_socket() {
        FsKind::Socket
    } else if ft.is_char_device() {
        FsKind::CharDevice
    } else {
        FsKind::BlockDevice
    }
}

/// The extended attributes an entry carries: those of the `user.` namespace.
const ENTRY_XATTRS: &str = "user.";

pub(super) fn entry_of(path: &Path, md: &Metadata) -> FsEntry {
    let kind = kind_of(md);
    // What a symlink resolves to (every link followed); nothing when it dangles.
    let (target_kind, resolved) = if kind == FsKind::Symlink {
        match (fs::metadata(path), fs::canonicalize(path)) {
            (Ok(t), Ok(r)) => (Some(kind_of(&t)), Some(r.to_string_lossy().into_owned())),
            _ => (None, None),
        }
    } else {
        (None, None)
    };
    FsEntry {
        target_kind,
        resolved,
        // A file whose attributes cannot be read (gone since) is described without them.
        xattrs: sbx_runtime::xattr::read(path, ENTRY_XATTRS).unwrap_or_default(),
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "/".into()),
        path: path.to_string_lossy().into_owned(),
        kind,
        size: md.len(),
        mode: md.mode() & 0o7777,
        uid: md.uid(),
        gid: md.gid(),
        mtime_ns: md.mtime().saturating_mul(1_000_000_000) + md.mtime_nsec(),
        target: (kind == FsKind::Symlink)
            .then(|| fs::read_link(path).ok())
            .flatten()
            .map(|t| t.to_string_lossy().into_owned()),
    }
}

fn lstat(path: &Path, param: &str) -> Res<Metadata> {
    fs::symlink_metadata(path).map_err(|e| fail(&e, path, param))
}

pub(super) fn unsupported_kind(path: &Path, md: &Metadata) -> FsFailure {
    FsFailure::new(
        FsErrorCode::Unsupported,
        format!(
            "{} is a {}: only regular files, directories and symlinks are moved",
            path.display(),
            kind_of(md).as_str()
        ),
    )
    .param("path")
}

/// The uid and gid of a user of the sandbox (a name, a uid or uid:gid).
fn ids_of(owner: &str) -> Res<(u32, u32)> {
    crate::users::lookup(owner)
        .map(|u| (u.uid, u.gid))
        .ok_or_else(|| invalid(format!("{owner} is not a user of the sandbox"), "owner"))
}

/// Who owns what an operation makes: the owner asked for, else the sandbox's user. `None`:
/// the agent's own (root).
pub(super) fn new_owner(c: &Ctx, owner: Option<&str>) -> Res<Option<(u32, u32)>> {
    match (owner, c.user.as_deref()) {
        (Some(o), _) => ids_of(o).map(Some),
        (None, Some(u)) => Ok(crate::users::lookup(u).map(|u| (u.uid, u.gid))),
        (None, None) => Ok(None),
    }
}

pub(super) fn check_mode(mode: Option<u32>) -> Res<()> {
    match mode {
        Some(m) if m > 0o7777 => Err(invalid(format!("mode {m:o} is over 7777 (octal)"), "mode")),
        _ => Ok(()),
    }
}

/// A directory made with exactly `mode` (not cut by the umask) and owned by `ids`.
fn make_dir(dir: &Path, mode: u32, ids: Option<(u32, u32)>) -> io::Result<()> {
    fs::DirBuilder::new().mode(mode).create(dir)?;
    if let Some((u, g)) = ids {
        chown(dir, Some(u), Some(g))?;
    }
    fs::set_permissions(dir, Permissions::from_mode(mode))
}

/// Makes `path` (with `mode`) and its missing parents (0755); true when `path` itself was made.
fn mkdir_all(path: &Path, mode: u32, ids: Option<(u32, u32)>, param: &str) -> Res<bool> {
    let mut missing: Vec<&Path> = Vec::new();
    let mut cur = path;
    loop {
        match fs::metadata(cur) {
            Ok(md) if md.is_dir() => break,
            Ok(_) => {
                return Err(FsFailure::new(
                    FsErrorCode::WrongType,
                    format!("{} is not a directory", cur.display()),
                )
                .param(param))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                missing.push(cur);
                match cur.parent() {
                    Some(p) => cur = p,
                    None => break,
                }
            }
            Err(e) => return Err(fail(&e, cur, param)),
        }
    }
    let made_self = missing.first().is_some_and(|p| *p == path);
    for dir in missing.iter().rev() {
        // Parents get 0755, as `mkdir -p -m` gives them.
        let m = if *dir == path { mode } else { 0o755 };
        match make_dir(dir, m, ids) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => {}
            Err(e) => return Err(fail(&e, dir, param)),
        }
    }
    Ok(made_self)
}

/// The directory a new file goes in: there, or made when `parents`.
pub(super) fn ensure_dir(
    dir: &Path,
    parents: bool,
    ids: Option<(u32, u32)>,
    param: &str,
) -> Res<()> {
    match fs::metadata(dir) {
        Ok(md) if md.is_dir() => Ok(()),
        Ok(_) => Err(FsFailure::new(
            FsErrorCode::WrongType,
            format!("{} is not a directory", dir.display()),
        )
        .param(param)),
        Err(e) if e.kind() == io::ErrorKind::NotFound && parents => {
            mkdir_all(dir, 0o755, ids, param).map(|_| ())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(FsFailure::new(
            FsErrorCode::NotFound,
            format!(
                "{}: no such directory (parents=true makes it)",
                dir.display()
            ),
        )
        .param(param)),
        Err(e) => Err(fail(&e, dir, param)),
    }
}

pub(super) fn stat(path: &str) -> Res<FsResult> {
    let p = normalize(path, "path")?;
    let md = lstat(&p, "path")?;
    Ok(FsResult::Entry {
        entry: entry_of(&p, &md),
        created: false,
    })
}

pub(super) fn list(path: &str, limit: Option<u32>, depth: Option<u32>) -> Res<FsResult> {
    let p = normalize(path, "path")?;
    let md = fs::metadata(&p).map_err(|e| fail(&e, &p, "path"))?;
    if !md.is_dir() {
        return Err(FsFailure::new(
            FsErrorCode::WrongType,
            format!("{} is not a directory", p.display()),
        )
        .param("path"));
    }
    let limit = limit.unwrap_or(MAX_LIST).min(MAX_LIST) as usize;
    let depth = depth.unwrap_or(1).max(1);
    let mut entries = Vec::new();
    let mut truncated = false;
    let mut budget = 0;
    // Depth first, each directory's entries by name, a directory before what is in it.
    list_into(
        &p,
        1,
        depth,
        limit,
        &mut entries,
        &mut truncated,
        &mut budget,
        &p,
    )?;
    Ok(FsResult::List { entries, truncated })
}

/// The entries of `dir` (level `level`) and, down to `depth`, of its subdirectories.
#[allow(clippy::too_many_arguments)]
fn list_into(
    dir: &Path,
    level: u32,
    depth: u32,
    limit: usize,
    entries: &mut Vec<FsEntry>,
    truncated: &mut bool,
    budget: &mut usize,
    top: &Path,
) -> Res<()> {
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        // Below the top, a directory that cannot be read (or went) is left out.
        Err(_) if dir != top => return Ok(()),
        Err(e) => return Err(fail(&e, dir, "path")),
    };
    let mut names: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
    names.sort();
    for n in names {
        if *truncated {
            return Ok(());
        }
        if entries.len() >= limit {
            *truncated = true;
            return Ok(());
        }
        // An entry removed since the directory was read is left out.
        let Ok(md) = fs::symlink_metadata(&n) else {
            continue;
        };
        let e = entry_of(&n, &md);
        *budget += e.path.len() + e.name.len() + e.target.as_ref().map_or(0, String::len) + 128;
        if *budget > REPLY_BUDGET {
            *truncated = true;
            return Ok(());
        }
        entries.push(e);
        if level < depth && md.is_dir() {
            list_into(&n, level + 1, depth, limit, entries, truncated, budget, top)?;
        }
    }
    Ok(())
}

pub(super) fn mkdir(
    c: &Ctx,
    path: &str,
    parents: bool,
    mode: Option<u32>,
    owner: Option<&str>,
) -> Res<FsResult> {
    let p = normalize(path, "path")?;
    check_mode(mode)?;
    let mode = mode.unwrap_or(0o755);
    let ids = new_owner(c, owner)?;
    let created = if parents {
        match fs::metadata(&p) {
            Ok(md) if !md.is_dir() => {
                return Err(FsFailure::new(
                    FsErrorCode::Exists,
                    format!("{} exists and is not a directory", p.display()),
                )
                .param("path"))
            }
            _ => mkdir_all(&p, mode, ids, "path")?,
        }
    } else {
        let Some(parent) = p.parent() else {
            return Err(FsFailure::new(FsErrorCode::Exists, "/ exists").param("path"));
        };
        ensure_dir(parent, false, ids, "path")?;
        make_dir(&p, mode, ids).map_err(|e| fail(&e, &p, "path"))?;
        true
    };
    let md = lstat(&p, "path")?;
    Ok(FsResult::Entry {
        entry: entry_of(&p, &md),
        created,
    })
}

pub(super) fn remove(path: &str, recursive: bool) -> Res<FsResult> {
    let p = normalize(path, "path")?;
    if p == Path::new("/") {
        return Err(invalid("/ cannot be removed", "path"));
    }
    let md = lstat(&p, "path")?;
    let entry = entry_of(&p, &md);
    let r = if md.is_dir() {
        if recursive {
            fs::remove_dir_all(&p)
        } else {
            fs::remove_dir(&p)
        }
    } else {
        fs::remove_file(&p)
    };
    r.map_err(|e| fail(&e, &p, "path"))?;
    Ok(FsResult::Removed { entry })
}

pub(super) fn rename(src: &str, dst: &str, overwrite: bool) -> Res<FsResult> {
    let s = normalize(src, "path")?;
    let d = normalize(dst, "dst")?;
    if s == Path::new("/") {
        return Err(invalid("/ cannot be moved", "path"));
    }
    if d == Path::new("/") {
        return Err(invalid("/ cannot be replaced", "dst"));
    }
    if d != s && d.starts_with(&s) {
        return Err(invalid(
            format!("{} cannot be moved into itself", s.display()),
            "dst",
        ));
    }
    lstat(&s, "path")?;
    if let Some(parent) = d.parent() {
        ensure_dir(parent, false, None, "dst")?;
    }
    if s != d {
        let r = if overwrite {
            fs::rename(&s, &d)
        } else {
            match nix::fcntl::renameat2(
                nix::fcntl::AT_FDCWD,
                &s,
                nix::fcntl::AT_FDCWD,
                &d,
                nix::fcntl::RenameFlags::RENAME_NOREPLACE,
            ) {
                Ok(()) => Ok(()),
                // A filesystem without RENAME_NOREPLACE: look, then rename.
                Err(Errno::EINVAL) => {
                    if fs::symlink_metadata(&d).is_ok() {
                        Err(io::Error::from_raw_os_error(Errno::EEXIST as i32))
                    } else {
                        fs::rename(&s, &d)
                    }
                }
                Err(n) => Err(io::Error::from_raw_os_error(n as i32)),
            }
        };
        if let Err(e) = r {
            let f = match errno_of(&e) {
                Some(Errno::ENOENT) => fail(&e, &s, "path"),
                Some(Errno::EEXIST) if overwrite => FsFailure::new(
                    FsErrorCode::NotEmpty,
                    format!("{}: directory not empty", d.display()),
                )
                .param("dst"),
                Some(Errno::EEXIST) => FsFailure::new(
                    FsErrorCode::Exists,
                    format!("{} exists (overwrite=true replaces it)", d.display()),
                )
                .param("dst"),
                _ => fail(&e, &d, "dst"),
            };
            return Err(f);
        }
    }
    let md = lstat(&d, "dst")?;
    Ok(FsResult::Entry {
        entry: entry_of(&d, &md),
        created: false,
    })
}

pub(super) fn chmod(
    c: &Ctx,
    path: &str,
    mode: Option<u32>,
    uid: Option<u32>,
    gid: Option<u32>,
    recursive: bool,
) -> Res<FsResult> {
    let p = normalize(path, "path")?;
    check_mode(mode)?;
    if mode.is_none() && uid.is_none() && gid.is_none() {
        return Err(invalid("give a mode, a uid or a gid", "mode"));
    }
    // The path itself is followed, as chmod(1) does; what is under it is not.
    let md = fs::metadata(&p).map_err(|e| fail(&e, &p, "path"))?;
    let apply = |path: &Path, link: bool| -> Res<()> {
        if uid.is_some() || gid.is_some() {
            let r = if link {
                lchown(path, uid, gid)
            } else {
                chown(path, uid, gid)
            };
            r.map_err(|e| fail(&e, path, "path"))?;
        }
        if let (Some(m), false) = (mode, link) {
            fs::set_permissions(path, Permissions::from_mode(m))
                .map_err(|e| fail(&e, path, "path"))?;
        }
        Ok(())
    };
    apply(&p, false)?;
    let mut count = 1;
    if recursive && md.is_dir() {
        walk(c, &p, true, &mut |path, md| {
            apply(path, md.file_type().is_symlink())?;
            count += 1;
            Ok(Flow::Continue)
        })?;
    }
    Ok(FsResult::Changed { count })
}
