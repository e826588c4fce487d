//! File operations of the node ([`HostMsg::Fs`](sbx_proto::HostMsg::Fs)), served inside the
//! sandbox.
//!
//! The agent's `/` is the sandbox's root (stage 1 pivot_roots before it starts), so no path,
//! `..` or symlink can name a host file: paths are still refused with a NUL byte and
//! normalised lexically against `/`. Each operation runs on a blocking thread of the runtime;
//! an upload's bytes reach it through a channel of [`UPLOAD_QUEUE`] chunks (the connection
//! stops reading while it is full), a download's bytes leave through the connection's bounded
//! output queue, [`CHUNK`] bytes a frame. So the agent holds a few chunks of a file, whatever
//! its size.
//!
//! A file is written to a temporary file beside it, which replaces it once every byte is
//! there: an upload cut off leaves the old file as it was.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::fs::{self, File, Metadata, Permissions};
use std::io::{self, BufRead, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{
    chown, fchown, lchown, DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt,
};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use regex::bytes::{Regex, RegexBuilder};
use sbx_proto::{
    AgentMsg, FsEntry, FsErrorCode, FsFailure, FsKind, FsOp, FsResult, GrepMatch, GrepSpec,
    SedFile, SedSpec, Stream,
};
use tokio::sync::mpsc;

type Out = mpsc::Sender<Vec<u8>>;
type Res<T> = Result<T, FsFailure>;

/// The most file bytes in one data frame the agent sends.
pub const CHUNK: usize = 256 << 10;
/// Chunks of an upload queued for its writer.
pub const UPLOAD_QUEUE: usize = 4;
/// The most bytes of names and lines an answer carries (a message frame is at most 4 MiB).
const REPLY_BUDGET: usize = 2 << 20;
/// The most entries a listing answers.
const MAX_LIST: u32 = 10_000;
/// The part of a line grep looks at; the rest of a longer line is skipped.
const GREP_LINE_CAP: usize = 1 << 20;
/// sed leaves a file with a longer line as it is.
const SED_LINE_CAP: usize = 16 << 20;
/// A file with a NUL byte in its first this many bytes is binary: grep and sed skip it.
const BINARY_PROBE: usize = 8 << 10;

enum Chunk {
    Data(Vec<u8>),
    End,
}

/// The file operations of one connection.
pub struct Files {
    /// The sandbox's user (the image's), who owns what is written unless told otherwise.
    user: Option<String>,
    out: Out,
    uploads: RefCell<HashMap<String, mpsc::Sender<Chunk>>>,
    /// Set when the connection ends: long operations stop.
    cancel: Arc<AtomicBool>,
}

impl Drop for Files {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

impl Files {
    pub fn new(user: Option<String>, out: Out) -> Files {
        Files {
            user,
            out,
            uploads: RefCell::new(HashMap::new()),
            cancel: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Starts an operation; its answer goes to the connection when it is done.
    pub fn start(&self, id: String, op: FsOp) {
        let ctx = Ctx {
            id: id.clone(),
            out: self.out.clone(),
            cancel: self.cancel.clone(),
            user: self.user.clone(),
        };
        match op {
            FsOp::Write {
                path,
                mode,
                parents,
                owner,
            } => {
                let rx = self.upload(id);
                spawn(ctx, move |c| {
                    write_file(c, &path, mode, parents, owner.as_deref(), rx)
                });
            }
            FsOp::TarExtract {
                path,
                parents,
                owner,
                preserve_owners,
            } => {
                let rx = self.upload(id);
                spawn(ctx, move |c| {
                    tar_extract(c, &path, parents, owner.as_deref(), preserve_owners, rx)
                });
            }
            other => spawn(ctx, move |c| run(c, other)),
        }
    }

    fn upload(&self, id: String) -> mpsc::Receiver<Chunk> {
        let (tx, rx) = mpsc::channel(UPLOAD_QUEUE);
        self.uploads.borrow_mut().insert(id, tx);
        rx
    }

    /// Bytes of an upload, queued for its writer (waits while the queue is full). Bytes of an
    /// upload that failed are dropped.
    pub async fn data(&self, id: &str, bytes: Vec<u8>) {
        let tx = self.uploads.borrow().get(id).cloned();
        if let Some(tx) = tx {
            let _ = tx.send(Chunk::Data(bytes)).await;
        }
    }

    /// The end of an upload's bytes.
    pub async fn end(&self, id: &str) {
        let tx = self.uploads.borrow_mut().remove(id);
        if let Some(tx) = tx {
            let _ = tx.send(Chunk::End).await;
        }
    }
}

/// What an operation's thread has of its connection.
struct Ctx {
    id: String,
    out: Out,
    cancel: Arc<AtomicBool>,
    user: Option<String>,
}

impl Ctx {
    fn send(&self, msg: &AgentMsg) -> bool {
        match sbx_proto::encode_msg(msg) {
            Ok(b) => self.out.blocking_send(b).is_ok(),
            Err(_) => false,
        }
    }

    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }

    fn check(&self) -> Res<()> {
        if self.cancelled() {
            return Err(aborted("the node hung up"));
        }
        Ok(())
    }
}

fn spawn(ctx: Ctx, f: impl FnOnce(&Ctx) -> Res<FsResult> + Send + 'static) {
    tokio::task::spawn_blocking(move || {
        let msg = match f(&ctx) {
            Ok(result) => AgentMsg::FsDone {
                id: ctx.id.clone(),
                result,
            },
            Err(error) => AgentMsg::FsError {
                id: ctx.id.clone(),
                error,
            },
        };
        ctx.send(&msg);
    });
}

fn run(c: &Ctx, op: FsOp) -> Res<FsResult> {
    match op {
        FsOp::Stat { path } => stat(&path),
        FsOp::List { path, limit } => list(&path, limit),
        FsOp::Mkdir {
            path,
            parents,
            mode,
            owner,
        } => mkdir(c, &path, parents, mode, owner.as_deref()),
        FsOp::Read {
            path,
            offset,
            length,
            tail,
        } => read_file(c, &path, offset, length, tail),
        FsOp::Remove { path, recursive } => remove(&path, recursive),
        FsOp::Move {
            src,
            dst,
            overwrite,
        } => rename(&src, &dst, overwrite),
        FsOp::Chmod {
            path,
            mode,
            uid,
            gid,
            recursive,
        } => chmod(c, &path, mode, uid, gid, recursive),
        FsOp::Grep(g) => grep(c, &g),
        FsOp::Sed(s) => sed(c, &s),
        FsOp::TarCreate { path } => tar_create(c, &path),
        FsOp::Write { .. } | FsOp::TarExtract { .. } => Err(FsFailure::new(
            FsErrorCode::Invalid,
            "an upload without its bytes",
        )),
        FsOp::Unknown => Err(FsFailure::new(
            FsErrorCode::Unsupported,
            "this sandbox's agent does not know that file operation: restart the sandbox to \
             update its agent",
        )),
    }
}

// ---- paths, errors, entries ----

/// `p` as an absolute path of the sandbox: `.` and empty components dropped, `..` taken
/// lexically (never above `/`). A relative path is taken from `/`.
pub fn normalize(p: &str, param: &str) -> Res<PathBuf> {
    if p.is_empty() {
        return Err(invalid(format!("{param} is empty"), param));
    }
    if p.contains('\0') {
        return Err(invalid(format!("{param} has a NUL byte"), param));
    }
    if p.len() > 4096 {
        return Err(invalid(format!("{param} is over 4096 bytes"), param));
    }
    let mut parts: Vec<&str> = Vec::new();
    for c in p.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    Ok(PathBuf::from(format!("/{}", parts.join("/"))))
}

fn invalid(message: impl Into<String>, param: &str) -> FsFailure {
    FsFailure::new(FsErrorCode::Invalid, message).param(param)
}

fn aborted(message: impl Into<String>) -> FsFailure {
    FsFailure::new(FsErrorCode::Aborted, message)
}

fn code_of_errno(n: Errno) -> FsErrorCode {
    match n {
        Errno::ENOENT => FsErrorCode::NotFound,
        Errno::ENOTDIR | Errno::EISDIR => FsErrorCode::WrongType,
        Errno::EEXIST => FsErrorCode::Exists,
        Errno::ENOTEMPTY => FsErrorCode::NotEmpty,
        Errno::EACCES | Errno::EPERM | Errno::EROFS => FsErrorCode::PermissionDenied,
        Errno::EINVAL | Errno::ENAMETOOLONG | Errno::ELOOP => FsErrorCode::Invalid,
        Errno::EXDEV | Errno::EOPNOTSUPP | Errno::ENOSYS => FsErrorCode::Unsupported,
        _ => FsErrorCode::Io,
    }
}

/// The errno under an error, looking through the errors that wrap it (the tar crate's).
fn errno_of(e: &io::Error) -> Option<Errno> {
    if let Some(n) = e.raw_os_error() {
        return Some(Errno::from_raw(n));
    }
    let mut src: Option<&(dyn std::error::Error + 'static)> =
        e.get_ref().map(|x| x as &(dyn std::error::Error + 'static));
    while let Some(s) = src {
        if let Some(n) = s.downcast_ref::<io::Error>().and_then(|x| x.raw_os_error()) {
            return Some(Errno::from_raw(n));
        }
        src = s.source();
    }
    None
}

/// An I/O error on `path` as a failure of the request's `param`.
fn fail(e: &io::Error, path: &Path, param: &str) -> FsFailure {
    let (code, why) = match errno_of(e) {
        Some(Errno::EXDEV) => (
            FsErrorCode::Unsupported,
            "on another filesystem: moving across filesystems is not supported".to_string(),
        ),
        Some(n) => (code_of_errno(n), n.desc().to_lowercase()),
        None => (
            match e.kind() {
                io::ErrorKind::NotFound => FsErrorCode::NotFound,
                io::ErrorKind::PermissionDenied => FsErrorCode::PermissionDenied,
                io::ErrorKind::AlreadyExists => FsErrorCode::Exists,
                io::ErrorKind::InvalidInput | io::ErrorKind::InvalidData => FsErrorCode::Invalid,
                _ => FsErrorCode::Io,
            },
            e.to_string(),
        ),
    };
    FsFailure::new(code, format!("{}: {why}", path.display())).param(param)
}

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

fn entry_of(path: &Path, md: &Metadata) -> FsEntry {
    let kind = kind_of(md);
    FsEntry {
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

fn unsupported_kind(path: &Path, md: &Metadata) -> FsFailure {
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
fn new_owner(c: &Ctx, owner: Option<&str>) -> Res<Option<(u32, u32)>> {
    match (owner, c.user.as_deref()) {
        (Some(o), _) => ids_of(o).map(Some),
        (None, Some(u)) => Ok(crate::users::lookup(u).map(|u| (u.uid, u.gid))),
        (None, None) => Ok(None),
    }
}

fn check_mode(mode: Option<u32>) -> Res<()> {
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
fn ensure_dir(dir: &Path, parents: bool, ids: Option<(u32, u32)>, param: &str) -> Res<()> {
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

/// A temporary file beside `target`, removed when dropped unless kept. It is made and renamed
/// through a handle on the directory opened once: a directory of the path swapped for a
/// symlink meanwhile does not move where the file lands.
struct Temp {
    dir: File,
    name: OsString,
    keep: bool,
}

fn io_of(e: Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

impl Temp {
    fn create(target: &Path) -> io::Result<(Temp, File)> {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = File::open(target.parent().unwrap_or(Path::new("/")))?;
        let base = target.file_name().map(|n| n.as_bytes()).unwrap_or(b"file");
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let mut tmp = b".".to_vec();
        tmp.extend_from_slice(&base[..base.len().min(180)]);
        tmp.extend_from_slice(
            format!(
                ".sbx-{}-{}-{nanos:x}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            )
            .as_bytes(),
        );
        let name = OsString::from_vec(tmp);
        let fd = nix::fcntl::openat(
            &dir,
            name.as_os_str(),
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o600),
        )
        .map_err(io_of)?;
        Ok((
            Temp {
                dir,
                name,
                keep: false,
            },
            File::from(fd),
        ))
    }

    /// Sets owner and mode and puts the file in place of `target` (in the same directory):
    /// what it is then.
    fn commit(
        mut self,
        file: File,
        target: &Path,
        ids: Option<(u32, u32)>,
        mode: u32,
    ) -> io::Result<Metadata> {
        if let Some((u, g)) = ids {
            fchown(&file, Some(u), Some(g))?;
        }
        // After the chown, which clears setuid and setgid.
        file.set_permissions(Permissions::from_mode(mode))?;
        let name = target.file_name().ok_or_else(|| io_of(Errno::EISDIR))?;
        nix::fcntl::renameat(&self.dir, self.name.as_os_str(), &self.dir, name).map_err(io_of)?;
        self.keep = true;
        file.metadata()
    }
}

impl Drop for Temp {
    fn drop(&mut self) {
        if !self.keep {
            let _ = nix::unistd::unlinkat(
                &self.dir,
                self.name.as_os_str(),
                nix::unistd::UnlinkatFlags::NoRemoveDir,
            );
        }
    }
}

// ---- stat, list, mkdir, rm, mv, chmod ----

fn stat(path: &str) -> Res<FsResult> {
    let p = normalize(path, "path")?;
    let md = lstat(&p, "path")?;
    Ok(FsResult::Entry {
        entry: entry_of(&p, &md),
        created: false,
    })
}

fn list(path: &str, limit: Option<u32>) -> Res<FsResult> {
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
    let rd = fs::read_dir(&p).map_err(|e| fail(&e, &p, "path"))?;
    let mut names: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
    names.sort();
    let mut truncated = names.len() > limit;
    names.truncate(limit);
    let mut entries = Vec::with_capacity(names.len());
    let mut budget = 0;
    for n in names {
        // An entry removed since the directory was read is left out.
        let Ok(md) = fs::symlink_metadata(&n) else {
            continue;
        };
        let e = entry_of(&n, &md);
        budget += e.path.len() + e.name.len() + e.target.as_ref().map_or(0, String::len) + 128;
        if budget > REPLY_BUDGET {
            truncated = true;
            break;
        }
        entries.push(e);
    }
    Ok(FsResult::List { entries, truncated })
}

fn mkdir(
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

fn remove(path: &str, recursive: bool) -> Res<FsResult> {
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

fn rename(src: &str, dst: &str, overwrite: bool) -> Res<FsResult> {
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

fn chmod(
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

// ---- walking a tree ----

#[derive(PartialEq, Eq)]
enum Flow {
    Continue,
    /// Do not go into this directory.
    Prune,
    Stop,
}

/// Calls `f` on everything under `root` (not `root` itself), symlinks not followed, a
/// directory's entries by name before what is in its subdirectories. Directories on /proc's
/// or /sys's filesystem are not entered (unless `root` is on it); one that cannot be read is
/// passed over.
fn walk(
    c: &Ctx,
    root: &Path,
    recursive: bool,
    f: &mut dyn FnMut(&Path, &Metadata) -> Res<Flow>,
) -> Res<()> {
    let root_dev = fs::metadata(root).map(|m| m.dev()).ok();
    let skip: Vec<u64> = ["/proc", "/sys"]
        .iter()
        .filter_map(|p| fs::metadata(p).ok().map(|m| m.dev()))
        .filter(|d| Some(*d) != root_dev)
        .collect();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        c.check()?;
        let rd = match fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) if dir == root => return Err(fail(&e, &dir, "path")),
            Err(_) => continue,
        };
        let mut names: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
        names.sort();
        let mut subdirs = Vec::new();
        for path in names {
            let Ok(md) = fs::symlink_metadata(&path) else {
                continue;
            };
            match f(&path, &md)? {
                Flow::Stop => return Ok(()),
                Flow::Prune => continue,
                Flow::Continue => {}
            }
            if recursive && md.is_dir() && !skip.contains(&md.dev()) {
                subdirs.push(path);
            }
        }
        stack.extend(subdirs.into_iter().rev());
    }
    Ok(())
}

/// A glob as a regular expression: `*` and `?` within a name, `**` across directories,
/// `[...]` a class (`[!...]` its complement).
fn glob_regex(g: &str) -> Result<Regex, String> {
    let chars: Vec<char> = g.chars().collect();
    let mut re = String::from("^");
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '*' if chars.get(i + 1) == Some(&'*') => {
                i += 1;
                if chars.get(i + 1) == Some(&'/') {
                    i += 1;
                    re.push_str("(?:.*/)?");
                } else {
                    re.push_str(".*");
                }
            }
            '*' => re.push_str("[^/]*"),
            '?' => re.push_str("[^/]"),
            '[' => {
                let mut j = i + 1;
                if matches!(chars.get(j), Some('!' | '^')) {
                    j += 1;
                }
                if chars.get(j) == Some(&']') {
                    j += 1;
                }
                while j < chars.len() && chars[j] != ']' {
                    j += 1;
                }
                if j >= chars.len() {
                    re.push_str(r"\[");
                } else {
                    re.push('[');
                    let mut k = i + 1;
                    if matches!(chars[k], '!' | '^') {
                        re.push('^');
                        k += 1;
                    }
                    for ch in &chars[k..j] {
                        if matches!(ch, '\\' | '[' | '&' | '~') {
                            re.push('\\');
                        }
                        re.push(*ch);
                    }
                    re.push(']');
                    i = j;
                }
            }
            ch => re.push_str(&regex::escape(&ch.to_string())),
        }
        i += 1;
    }
    re.push('$');
    Regex::new(&re).map_err(|e| e.to_string())
}

/// Which files a search takes: include and exclude globs, matched against the name, or
/// against the path under the root when the glob has a `/`.
struct Globs {
    include: Vec<(Regex, bool)>,
    exclude: Vec<(Regex, bool)>,
}

impl Globs {
    fn new(include: &[String], exclude: &[String]) -> Res<Globs> {
        let compile = |list: &[String], param: &str| -> Res<Vec<(Regex, bool)>> {
            list.iter()
                .map(|g| {
                    glob_regex(g.trim_start_matches("./"))
                        .map(|re| (re, g.contains('/')))
                        .map_err(|e| {
                            FsFailure::new(FsErrorCode::BadPattern, format!("glob {g:?}: {e}"))
                                .param(param)
                        })
                })
                .collect()
        };
        Ok(Globs {
            include: compile(include, "include")?,
            exclude: compile(exclude, "exclude")?,
        })
    }

    fn hit(list: &[(Regex, bool)], name: &[u8], rel: &[u8]) -> bool {
        list.iter().any(|(re, path)| {
            if *path {
                re.is_match(rel)
            } else {
                re.is_match(name)
            }
        })
    }

    fn excluded(&self, name: &[u8], rel: &[u8]) -> bool {
        Globs::hit(&self.exclude, name, rel)
    }

    fn takes(&self, name: &[u8], rel: &[u8]) -> bool {
        (self.include.is_empty() || Globs::hit(&self.include, name, rel))
            && !self.excluded(name, rel)
    }
}

/// The regular files of a search: `root` itself when it is one, else those under it that the
/// globs take (an excluded directory is not entered). `f` answers whether to go on.
fn each_file(
    c: &Ctx,
    root: &Path,
    recursive: bool,
    globs: &Globs,
    f: &mut dyn FnMut(&Path) -> Res<bool>,
) -> Res<()> {
    let md = fs::metadata(root).map_err(|e| fail(&e, root, "path"))?;
    if md.is_file() {
        f(root)?;
        return Ok(());
    }
    if !md.is_dir() {
        return Err(unsupported_kind(root, &md));
    }
    walk(c, root, recursive, &mut |path, md| {
        let name = path.file_name().map(|n| n.as_bytes()).unwrap_or(b"");
        let rel = path
            .strip_prefix(root)
            .unwrap_or(path)
            .as_os_str()
            .as_bytes();
        if md.is_dir() {
            return Ok(if globs.excluded(name, rel) {
                Flow::Prune
            } else {
                Flow::Continue
            });
        }
        if !md.is_file() || !globs.takes(name, rel) {
            return Ok(Flow::Continue);
        }
        Ok(if f(path)? { Flow::Continue } else { Flow::Stop })
    })
}

fn build_regex(pattern: &str, literal: bool, ignore_case: bool) -> Res<Regex> {
    if pattern.is_empty() {
        return Err(
            FsFailure::new(FsErrorCode::BadPattern, "the pattern is empty").param("pattern"),
        );
    }
    let src = if literal {
        regex::escape(pattern)
    } else {
        pattern.to_string()
    };
    RegexBuilder::new(&src)
        .case_insensitive(ignore_case)
        .size_limit(16 << 20)
        .build()
        .map_err(|e| {
            // The parser's message spans lines (the pattern, a caret, the error): one line.
            let why = e
                .to_string()
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ");
            FsFailure::new(FsErrorCode::BadPattern, format!("the pattern: {why}")).param("pattern")
        })
}

/// Reads one line (with its `\n`) into `line`, keeping at most `cap` bytes of it: the rest of
/// a longer line is read and dropped. Returns the bytes read (0 at the end) and whether the
/// line was cut.
fn read_line_capped<R: BufRead>(
    r: &mut R,
    line: &mut Vec<u8>,
    cap: usize,
) -> io::Result<(usize, bool)> {
    line.clear();
    let (mut total, mut cut) = (0, false);
    loop {
        let (done, used) = {
            let buf = match r.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if buf.is_empty() {
                return Ok((total, cut));
            }
            let (done, used) = match buf.iter().position(|b| *b == b'\n') {
                Some(i) => (true, i + 1),
                None => (false, buf.len()),
            };
            let take = cap.saturating_sub(line.len()).min(used);
            line.extend_from_slice(&buf[..take]);
            cut |= take < used;
            (done, used)
        };
        r.consume(used);
        total += used;
        if done {
            return Ok((total, cut));
        }
    }
}

/// A line without its end of line (`\n` or `\r\n`), and the end of line.
fn split_eol(line: &[u8]) -> (&[u8], &[u8]) {
    if line.ends_with(b"\r\n") {
        line.split_at(line.len() - 2)
    } else if line.ends_with(b"\n") {
        line.split_at(line.len() - 1)
    } else {
        (line, b"")
    }
}

fn is_binary<R: BufRead>(r: &mut R) -> io::Result<bool> {
    let buf = r.fill_buf()?;
    Ok(buf[..buf.len().min(BINARY_PROBE)].contains(&0))
}

fn cut_text(s: &str, max: usize) -> (String, bool) {
    if s.len() <= max {
        return (s.to_string(), false);
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    (s[..end].to_string(), true)
}

// ---- grep, sed ----

struct GrepState {
    matches: Vec<GrepMatch>,
    truncated: bool,
    scanned: u64,
    budget: usize,
}

fn grep(c: &Ctx, g: &GrepSpec) -> Res<FsResult> {
    let re = build_regex(&g.pattern, g.literal, g.ignore_case)?;
    let globs = Globs::new(&g.include, &g.exclude)?;
    let root = normalize(&g.path, "path")?;
    let max = g.max_matches.unwrap_or(1000).max(1);
    let max_line = g.max_line_bytes.unwrap_or(4096).max(1) as usize;
    let mut st = GrepState {
        matches: Vec::new(),
        truncated: false,
        scanned: 0,
        budget: 0,
    };
    let single = fs::metadata(&root).map(|m| m.is_file()).unwrap_or(false);
    each_file(c, &root, g.recursive, &globs, &mut |path| {
        c.check()?;
        match grep_file(c, &re, path, max, max_line, &mut st) {
            Ok(()) => {}
            // A file that cannot be read is passed over in a tree, an error when asked for.
            Err(e) if single => return Err(fail(&e, path, "path")),
            Err(_) => {}
        }
        Ok(!st.truncated)
    })?;
    Ok(FsResult::Grep {
        matches: st.matches,
        truncated: st.truncated,
        files_scanned: st.scanned,
    })
}

fn grep_file(
    c: &Ctx,
    re: &Regex,
    path: &Path,
    max: u64,
    max_line: usize,
    st: &mut GrepState,
) -> io::Result<()> {
    let mut r = BufReader::with_capacity(64 << 10, File::open(path)?);
    st.scanned += 1;
    if is_binary(&mut r)? {
        return Ok(());
    }
    let shown = path.to_string_lossy();
    let mut line = Vec::new();
    let mut n = 0u64;
    loop {
        let (read, cut) = read_line_capped(&mut r, &mut line, GREP_LINE_CAP)?;
        if read == 0 {
            return Ok(());
        }
        n += 1;
        if n.is_multiple_of(8192) && c.cancelled() {
            return Ok(());
        }
        let (body, _) = split_eol(&line);
        let Some(m) = re.find(body) else {
            continue;
        };
        let (text, short) = cut_text(&String::from_utf8_lossy(body), max_line);
        st.budget += text.len() + shown.len() + 64;
        st.matches.push(GrepMatch {
            path: shown.to_string(),
            line: n,
            column: m.start() as u64 + 1,
            text,
            line_truncated: short || cut,
        });
        if st.matches.len() as u64 >= max || st.budget > REPLY_BUDGET {
            st.truncated = true;
            return Ok(());
        }
    }
}

fn sed(c: &Ctx, s: &SedSpec) -> Res<FsResult> {
    let re = build_regex(&s.pattern, s.literal, s.ignore_case)?;
    let globs = Globs::new(&s.include, &s.exclude)?;
    let root = normalize(&s.path, "path")?;
    let single = fs::metadata(&root).map(|m| m.is_file()).unwrap_or(false);
    let (mut files, mut total, mut scanned, mut truncated, mut budget) =
        (Vec::new(), 0, 0, false, 0);
    each_file(c, &root, s.recursive, &globs, &mut |path| {
        c.check()?;
        scanned += 1;
        let n = match sed_file(&re, s.replacement.as_bytes(), s.literal, s.first_only, path) {
            Ok(n) => n,
            Err(e) if single => return Err(fail(&e, path, "path")),
            Err(_) => 0,
        };
        if n > 0 {
            total += n;
            let shown = path.to_string_lossy().into_owned();
            budget += shown.len() + 64;
            if budget > REPLY_BUDGET {
                truncated = true;
            } else {
                files.push(SedFile {
                    path: shown,
                    replacements: n,
                });
            }
        }
        Ok(true)
    })?;
    Ok(FsResult::Sed {
        files,
        replacements: total,
        files_scanned: scanned,
        truncated,
    })
}

/// Replaces in one file (through a temporary file that takes its place, its owner and mode
/// kept); the number of replacements. Binary files, and files with a line over
/// [`SED_LINE_CAP`], are left as they are.
fn sed_file(
    re: &Regex,
    rep: &[u8],
    literal: bool,
    first_only: bool,
    path: &Path,
) -> io::Result<u64> {
    let file = File::open(path)?;
    let md = file.metadata()?;
    if !md.is_file() {
        return Ok(0);
    }
    let mut r = BufReader::with_capacity(64 << 10, file);
    if is_binary(&mut r)? {
        return Ok(0);
    }
    // First: is there anything to replace (most files have nothing)?
    let mut line = Vec::new();
    let mut found = false;
    loop {
        let (read, cut) = read_line_capped(&mut r, &mut line, SED_LINE_CAP)?;
        if read == 0 {
            break;
        }
        if cut {
            return Ok(0);
        }
        if re.is_match(split_eol(&line).0) {
            found = true;
            break;
        }
    }
    if !found {
        return Ok(0);
    }
    r.seek(SeekFrom::Start(0))?;
    let target = fs::canonicalize(path)?;
    let (temp, out) = Temp::create(&target)?;
    let mut w = BufWriter::with_capacity(256 << 10, &out);
    let mut count = 0u64;
    let mut done = false;
    let mut expanded = Vec::new();
    loop {
        let (read, cut) = read_line_capped(&mut r, &mut line, SED_LINE_CAP)?;
        if read == 0 {
            break;
        }
        if cut {
            return Ok(0);
        }
        if done {
            w.write_all(&line)?;
            continue;
        }
        let (body, eol) = split_eol(&line);
        let mut last = 0;
        for caps in re.captures_iter(body) {
            let Some(m) = caps.get(0) else {
                continue;
            };
            w.write_all(&body[last..m.start()])?;
            if literal {
                w.write_all(rep)?;
            } else {
                expanded.clear();
                caps.expand(rep, &mut expanded);
                w.write_all(&expanded)?;
            }
            last = m.end();
            count += 1;
            if first_only {
                done = true;
                break;
            }
        }
        w.write_all(&body[last..])?;
        w.write_all(eol)?;
    }
    w.flush()?;
    drop(w);
    temp.commit(out, &target, Some((md.uid(), md.gid())), md.mode() & 0o7777)?;
    Ok(count)
}

// ---- uploads and downloads ----

fn write_file(
    c: &Ctx,
    path: &str,
    mode: Option<u32>,
    parents: bool,
    owner: Option<&str>,
    mut rx: mpsc::Receiver<Chunk>,
) -> Res<FsResult> {
    let p = normalize(path, "path")?;
    check_mode(mode)?;
    let Some(dir) = p.parent() else {
        return Err(FsFailure::new(FsErrorCode::WrongType, "/ is a directory").param("path"));
    };
    let ids = new_owner(c, owner)?;
    ensure_dir(dir, parents, ids, "path")?;
    // Where the bytes go: the file at the path, or the one a symlink there points to.
    let (target, old) = match fs::symlink_metadata(&p) {
        Ok(md) if md.file_type().is_symlink() => match fs::metadata(&p) {
            Ok(t) if t.is_file() => (
                fs::canonicalize(&p).map_err(|e| fail(&e, &p, "path"))?,
                Some(t),
            ),
            Ok(t) if t.is_dir() => {
                return Err(FsFailure::new(
                    FsErrorCode::WrongType,
                    format!("{} points to a directory", p.display()),
                )
                .param("path"))
            }
            Ok(t) => return Err(unsupported_kind(&p, &t)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // A dangling symlink: the file it names is made.
                let link = fs::read_link(&p).map_err(|e| fail(&e, &p, "path"))?;
                let to = normalize(&dir.join(link).to_string_lossy(), "path")?;
                if let Some(d) = to.parent() {
                    ensure_dir(d, false, None, "path")?;
                }
                (to, None)
            }
            Err(e) => return Err(fail(&e, &p, "path")),
        },
        Ok(md) if md.is_dir() => {
            return Err(FsFailure::new(
                FsErrorCode::WrongType,
                format!("{} is a directory", p.display()),
            )
            .param("path"))
        }
        Ok(md) if md.is_file() => (p.clone(), Some(md)),
        Ok(md) => return Err(unsupported_kind(&p, &md)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => (p.clone(), None),
        Err(e) => return Err(fail(&e, &p, "path")),
    };
    let (temp, mut file) = Temp::create(&target).map_err(|e| fail(&e, &p, "path"))?;
    let mut bytes = 0u64;
    loop {
        match rx.blocking_recv() {
            Some(Chunk::Data(b)) => {
                file.write_all(&b).map_err(|e| fail(&e, &p, "path"))?;
                bytes += b.len() as u64;
                c.check()?;
            }
            Some(Chunk::End) => break,
            None => {
                return Err(aborted(format!(
                    "the upload of {} was cut off; the file is as it was",
                    p.display()
                )))
            }
        }
    }
    // Owner: the one asked for, else the replaced file's, else the sandbox's user.
    let ids = match (owner, &old) {
        (Some(_), _) | (None, None) => ids,
        (None, Some(m)) => Some((m.uid(), m.gid())),
    };
    let mode = mode
        .or(old.as_ref().map(|m| m.mode() & 0o7777))
        .unwrap_or(0o644);
    // The file as written (the path may name something else by now).
    let md = temp
        .commit(file, &target, ids, mode)
        .map_err(|e| fail(&e, &p, "path"))?;
    Ok(FsResult::Written {
        entry: entry_of(&p, &md),
        bytes,
        created: old.is_none(),
    })
}

fn read_file(
    c: &Ctx,
    path: &str,
    offset: u64,
    length: Option<u64>,
    tail: Option<u64>,
) -> Res<FsResult> {
    let p = normalize(path, "path")?;
    let mut f = File::open(&p).map_err(|e| fail(&e, &p, "path"))?;
    let md = f.metadata().map_err(|e| fail(&e, &p, "path"))?;
    if md.is_dir() {
        return Err(FsFailure::new(
            FsErrorCode::WrongType,
            format!(
                "{} is a directory: fetch it as a tar stream (files/tar)",
                p.display()
            ),
        )
        .param("path"));
    }
    if !md.is_file() {
        return Err(unsupported_kind(&p, &md));
    }
    let size = md.len();
    let (start, len) = match tail {
        Some(n) => {
            let s = size.saturating_sub(n);
            (s, Some(size - s))
        }
        None => {
            let avail = size.saturating_sub(offset);
            (offset, Some(length.map_or(avail, |l| l.min(avail))))
        }
    };
    let hdr = sbx_proto::encode_data_header(&c.id, Stream::File, 0, 0).len();
    let read_chunk = |f: &mut File, want: usize| -> Res<(Vec<u8>, usize)> {
        let mut buf = vec![0u8; hdr + want];
        loop {
            match f.read(&mut buf[hdr..]) {
                Ok(n) => return Ok((buf, n)),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(fail(&e, &p, "path")),
            }
        }
    };
    // Files of /proc and the like say 0 bytes and have more: they are read to their end (the
    // length is not known then). An empty file is told apart by a first read.
    let mut first = None;
    let len = if size == 0 && offset == 0 && length.is_none() && tail.is_none() {
        let (buf, n) = read_chunk(&mut f, CHUNK)?;
        if n == 0 {
            Some(0)
        } else {
            first = Some((buf, n));
            None
        }
    } else {
        len
    };
    let opened = AgentMsg::FsOpened {
        id: c.id.clone(),
        size,
        offset: start,
        length: len,
    };
    if !c.send(&opened) {
        return Err(aborted("the node hung up"));
    }
    if len == Some(0) {
        return Ok(FsResult::Read { bytes: 0 });
    }
    if start > 0 {
        f.seek(SeekFrom::Start(start))
            .map_err(|e| fail(&e, &p, "path"))?;
    }
    let mut left = len;
    let mut pos = start;
    loop {
        let want = match left {
            Some(0) => break,
            Some(l) => (l as usize).min(CHUNK),
            None => CHUNK,
        };
        let (mut buf, n) = match first.take() {
            Some(read) => read,
            None => read_chunk(&mut f, want)?,
        };
        if n == 0 {
            if left.is_some() {
                return Err(FsFailure::new(
                    FsErrorCode::Io,
                    format!("{} shrank while it was read", p.display()),
                )
                .param("path"));
            }
            break;
        }
        let header = sbx_proto::encode_data_header(&c.id, Stream::File, pos, n);
        buf[..hdr].copy_from_slice(&header);
        buf.truncate(hdr + n);
        if c.out.blocking_send(buf).is_err() {
            return Err(aborted("the node hung up"));
        }
        pos += n as u64;
        left = left.map(|l| l - n as u64);
    }
    Ok(FsResult::Read { bytes: pos - start })
}

/// Bytes written as data frames of [`CHUNK`] bytes.
struct FrameWriter<'a> {
    c: &'a Ctx,
    buf: Vec<u8>,
    pos: u64,
}

impl FrameWriter<'_> {
    fn send(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let frame = sbx_proto::encode_data(&self.c.id, Stream::File, self.pos, &self.buf);
        self.pos += self.buf.len() as u64;
        self.buf.clear();
        self.c
            .out
            .blocking_send(frame)
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the node hung up"))
    }
}

impl Write for FrameWriter<'_> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.c.cancelled() {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the node hung up",
            ));
        }
        let n = data.len().min(CHUNK - self.buf.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() >= CHUNK {
            self.send()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn tar_fail(e: &io::Error, path: &Path) -> FsFailure {
    if e.kind() == io::ErrorKind::BrokenPipe && errno_of(e).is_none() {
        return aborted("the node hung up");
    }
    fail(e, path, "path")
}

fn tar_create(c: &Ctx, path: &str) -> Res<FsResult> {
    let p = normalize(path, "path")?;
    let md = fs::metadata(&p).map_err(|e| fail(&e, &p, "path"))?;
    if !md.is_dir() && !md.is_file() {
        return Err(unsupported_kind(&p, &md));
    }
    let opened = AgentMsg::FsOpened {
        id: c.id.clone(),
        size: 0,
        offset: 0,
        length: None,
    };
    if !c.send(&opened) {
        return Err(aborted("the node hung up"));
    }
    let w = FrameWriter {
        c,
        buf: Vec::with_capacity(CHUNK),
        pos: 0,
    };
    let mut b = tar::Builder::new(w);
    b.follow_symlinks(false);
    b.mode(tar::HeaderMode::Complete);
    let (mut entries, mut skipped) = (0u64, 0u64);
    let mut bytes = 0u64;
    if md.is_file() {
        let real = fs::canonicalize(&p).map_err(|e| fail(&e, &p, "path"))?;
        let name = p.file_name().map(PathBuf::from).unwrap_or_default();
        b.append_path_with_name(&real, &name)
            .map_err(|e| tar_fail(&e, &p))?;
        entries = 1;
        bytes = md.len();
    } else {
        walk(c, &p, true, &mut |path, md| {
            let ft = md.file_type();
            if !(ft.is_dir() || ft.is_file() || ft.is_symlink()) {
                skipped += 1;
                return Ok(Flow::Continue);
            }
            let rel = path.strip_prefix(&p).unwrap_or(path);
            b.append_path_with_name(path, rel)
                .map_err(|e| tar_fail(&e, path))?;
            entries += 1;
            if ft.is_file() {
                bytes += md.len();
            }
            Ok(Flow::Continue)
        })?;
    }
    let mut w = b.into_inner().map_err(|e| tar_fail(&e, &p))?;
    w.send().map_err(|e| tar_fail(&e, &p))?;
    Ok(FsResult::Tar {
        entries,
        bytes,
        skipped,
    })
}

/// An upload's chunks as a reader.
struct ChunkReader {
    rx: mpsc::Receiver<Chunk>,
    cur: Vec<u8>,
    at: usize,
    ended: bool,
    cut_off: bool,
}

impl Read for ChunkReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        loop {
            if self.at < self.cur.len() {
                let n = out.len().min(self.cur.len() - self.at);
                out[..n].copy_from_slice(&self.cur[self.at..self.at + n]);
                self.at += n;
                return Ok(n);
            }
            if self.ended {
                return Ok(0);
            }
            match self.rx.blocking_recv() {
                Some(Chunk::Data(b)) => {
                    self.cur = b;
                    self.at = 0;
                }
                Some(Chunk::End) => self.ended = true,
                None => {
                    self.cut_off = true;
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the upload was cut off",
                    ));
                }
            }
        }
    }
}

impl ChunkReader {
    /// Reads what is left to the end of the upload (an archive's padding).
    fn drain(&mut self) -> Res<()> {
        let mut sink = [0u8; 8192];
        loop {
            match self.read(&mut sink) {
                Ok(0) => return Ok(()),
                Ok(_) => {}
                Err(_) => return Err(aborted("the upload was cut off")),
            }
        }
    }
}

/// What became of one entry of an archive.
enum Unpacked {
    /// Made (or, for the destination itself, nothing to make).
    Done,
    /// Not unpacked: it would land outside the destination (`..`), or its directory is a
    /// symlink or not a directory.
    Skipped,
}

/// Where an archive is unpacked, by directory handles: each entry's directory is reached from
/// the last entry's directory (one `openat` per new component) or from the destination, never
/// by resolving a path from `/` again. An archive's cost is then linear in its size, at any
/// depth (paths longer than PATH_MAX too), and no component is followed as a symlink, so no
/// entry lands outside the destination.
struct Unpacker {
    root: OwnedFd,
    /// The last entry's directory: its components under the destination and a handle on it.
    last: Vec<OsString>,
    last_fd: Option<OwnedFd>,
    /// Who owns what is made: the archive's owners, else these, else the agent (root).
    preserve_owners: bool,
    ids: Option<(u32, u32)>,
}

/// One step down from `dir` to its directory `name`, made (0755, owned by `ids`) when missing
/// and `make`. `None`: `name` is a symlink or not a directory.
fn step_into(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    make: bool,
    ids: Option<(u32, u32)>,
) -> io::Result<Option<OwnedFd>> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    match nix::fcntl::openat(dir, name, flags, Mode::empty()) {
        Ok(fd) => Ok(Some(fd)),
        Err(Errno::ENOTDIR | Errno::ELOOP) => Ok(None),
        Err(Errno::ENOENT) if make => {
            match nix::sys::stat::mkdirat(dir, name, Mode::from_bits_truncate(0o755)) {
                Ok(()) | Err(Errno::EEXIST) => {}
                Err(e) => return Err(io_of(e)),
            }
            match nix::fcntl::openat(dir, name, flags, Mode::empty()) {
                Ok(fd) => {
                    if let Some((u, g)) = ids {
                        fchown(&fd, Some(u), Some(g))?;
                    }
                    Ok(Some(fd))
                }
                Err(Errno::ENOTDIR | Errno::ELOOP) => Ok(None),
                Err(e) => Err(io_of(e)),
            }
        }
        Err(e) => Err(io_of(e)),
    }
}

/// The parts of an entry's path under the destination; `None` when it has `..`.
fn parts_of(path: &Path) -> Option<Vec<OsString>> {
    let mut out = Vec::new();
    for c in path.components() {
        match c {
            Component::Normal(n) => out.push(n.to_os_string()),
            Component::ParentDir => return None,
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    Some(out)
}

/// A time of an archive as the file's: 0 is taken as 1, as the tar crate does.
fn mtime_of(header: &tar::Header) -> Option<nix::sys::time::TimeSpec> {
    let t = header.mtime().ok()?.max(1);
    Some(nix::sys::time::TimeSpec::new(i64::try_from(t).ok()?, 0))
}

/// Removes `name` from `dir` so that it can be made again (not a directory).
fn unlink_in(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<()> {
    match nix::unistd::unlinkat(dir, name, nix::unistd::UnlinkatFlags::NoRemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => Ok(()),
        Err(e) => Err(io_of(e)),
    }
}

impl Unpacker {
    fn new(dst: &Path, preserve_owners: bool, ids: Option<(u32, u32)>) -> io::Result<Unpacker> {
        let root = File::open(dst)?.into();
        Ok(Unpacker {
            root,
            last: Vec::new(),
            last_fd: None,
            preserve_owners,
            ids,
        })
    }

    /// A handle on the directory `parts` under the destination (made when `make`), reached
    /// from the last one when it lies under it. `None`: a component is a symlink or not a
    /// directory (or missing, when not `make`).
    fn dir(&mut self, parts: &[OsString], make: bool) -> io::Result<Option<BorrowedFd<'_>>> {
        let below_last = self.last_fd.is_some() && parts.starts_with(&self.last);
        if !below_last {
            self.last.clear();
            self.last_fd = None;
        }
        for name in &parts[self.last.len()..] {
            let from = match &self.last_fd {
                Some(fd) => fd.as_fd(),
                None => self.root.as_fd(),
            };
            let next = match step_into(from, name, make, self.ids) {
                Ok(Some(fd)) => fd,
                Ok(None) => {
                    self.last.clear();
                    self.last_fd = None;
                    return Ok(None);
                }
                Err(e) if !make && e.kind() == io::ErrorKind::NotFound => {
                    self.last.clear();
                    self.last_fd = None;
                    return Ok(None);
                }
                Err(e) => {
                    self.last.clear();
                    self.last_fd = None;
                    return Err(e);
                }
            };
            self.last.push(name.clone());
            self.last_fd = Some(next);
        }
        Ok(Some(match &self.last_fd {
            Some(fd) => fd.as_fd(),
            None => self.root.as_fd(),
        }))
    }

    /// The owner an entry gets: the archive's, or the one asked for.
    fn owner_of(&self, header: &tar::Header) -> io::Result<Option<(u32, u32)>> {
        if !self.preserve_owners {
            return Ok(self.ids);
        }
        let id = |v: u64| u32::try_from(v).map_err(|_| io_of(Errno::EINVAL));
        Ok(Some((id(header.uid()?)?, id(header.gid()?)?)))
    }

    /// Unpacks one entry (its data read from `e`).
    fn unpack<R: Read>(&mut self, e: &mut tar::Entry<'_, R>) -> io::Result<Unpacked> {
        let Some(mut parts) = parts_of(&e.path()?) else {
            return Ok(Unpacked::Skipped);
        };
        let Some(name) = parts.pop() else {
            // The destination itself ("./"): nothing to make.
            return Ok(Unpacked::Done);
        };
        let header = e.header().clone();
        let kind = header.entry_type();
        let owner = self.owner_of(&header)?;
        let mode = header.mode().ok().map(|m| m & 0o7777);
        let link = if kind.is_symlink() || kind.is_hard_link() {
            match e.link_name()? {
                Some(l) if l.as_os_str().is_empty() => None,
                Some(l) => Some(l.into_owned()),
                None => None,
            }
        } else {
            None
        };
        // A hard link's source, in the destination, first (it moves the last directory).
        let source = match (kind.is_hard_link(), &link) {
            (true, Some(l)) => {
                let Some(mut src) = parts_of(l) else {
                    return Ok(Unpacked::Skipped);
                };
                let Some(src_name) = src.pop() else {
                    return Ok(Unpacked::Skipped);
                };
                let Some(src_dir) = self.dir(&src, false)? else {
                    return Ok(Unpacked::Skipped);
                };
                let src_dir: OwnedFd = src_dir.try_clone_to_owned()?;
                Some((src_dir, src_name))
            }
            (true, None) => return Err(io_of(Errno::EINVAL)),
            _ => None,
        };
        let old_style_dir = header.as_ustar().is_none() && e.path_bytes().ends_with(b"/");
        let Some(dir) = self.dir(&parts, true)? else {
            return Ok(Unpacked::Skipped);
        };
        let dir: OwnedFd = dir.try_clone_to_owned()?;
        let dir = dir.as_fd();
        let name = name.as_os_str();
        if kind.is_dir() || old_style_dir {
            match nix::sys::stat::mkdirat(dir, name, Mode::from_bits_truncate(0o755)) {
                Ok(()) => {}
                Err(Errno::EEXIST) => {}
                Err(err) => return Err(io_of(err)),
            }
            let Some(fd) = step_into(dir, name, false, None)? else {
                return Err(io_of(Errno::EEXIST));
            };
            if let Some((u, g)) = owner {
                fchown(&fd, Some(u), Some(g))?;
            }
            if let Some(m) = mode {
                nix::sys::stat::fchmod(&fd, Mode::from_bits_truncate(m)).map_err(io_of)?;
            }
            // The next entries are most likely in it.
            let mut here = parts;
            here.push(name.to_os_string());
            self.last = here;
            self.last_fd = Some(fd);
            return Ok(Unpacked::Done);
        }
        if kind.is_symlink() {
            let target = link.ok_or_else(|| io_of(Errno::EINVAL))?;
            match nix::unistd::symlinkat(target.as_os_str(), dir, name) {
                Ok(()) => {}
                Err(Errno::EEXIST) => {
                    unlink_in(dir, name)?;
                    nix::unistd::symlinkat(target.as_os_str(), dir, name).map_err(io_of)?;
                }
                Err(err) => return Err(io_of(err)),
            }
            if let Some((u, g)) = owner {
                nix::unistd::fchownat(
                    dir,
                    name,
                    Some(u.into()),
                    Some(g.into()),
                    nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
                )
                .map_err(io_of)?;
            }
            if let Some(t) = mtime_of(&header) {
                nix::sys::stat::utimensat(
                    dir,
                    name,
                    &t,
                    &t,
                    nix::sys::stat::UtimensatFlags::NoFollowSymlink,
                )
                .map_err(io_of)?;
            }
            return Ok(Unpacked::Done);
        }
        if let Some((src_dir, src_name)) = source {
            let link = |d: BorrowedFd<'_>| {
                nix::unistd::linkat(
                    src_dir.as_fd(),
                    src_name.as_os_str(),
                    d,
                    name,
                    nix::fcntl::AtFlags::empty(),
                )
            };
            match link(dir) {
                Ok(()) => {}
                Err(Errno::EEXIST) => {
                    unlink_in(dir, name)?;
                    link(dir).map_err(io_of)?;
                }
                Err(err) => return Err(io_of(err)),
            }
            return Ok(Unpacked::Done);
        }
        // A regular file, or a kind this does not know (POSIX: taken as a regular file). A
        // new file, not one written over in place.
        let create = || {
            nix::fcntl::openat(
                dir,
                name,
                OFlag::O_WRONLY
                    | OFlag::O_CREAT
                    | OFlag::O_EXCL
                    | OFlag::O_NOFOLLOW
                    | OFlag::O_CLOEXEC,
                Mode::from_bits_truncate(0o600),
            )
        };
        let fd = match create() {
            Ok(fd) => fd,
            Err(Errno::EEXIST) => {
                unlink_in(dir, name)?;
                create().map_err(io_of)?
            }
            Err(err) => return Err(io_of(err)),
        };
        let mut f = File::from(fd);
        io::copy(e, &mut f)?;
        if let Some((u, g)) = owner {
            fchown(&f, Some(u), Some(g))?;
        }
        // After the chown, which clears setuid and setgid.
        if let Some(m) = mode {
            f.set_permissions(Permissions::from_mode(m))?;
        }
        if let Some(t) = mtime_of(&header) {
            nix::sys::stat::futimens(&f, &t, &t).map_err(io_of)?;
        }
        Ok(Unpacked::Done)
    }
}

fn tar_extract(
    c: &Ctx,
    path: &str,
    parents: bool,
    owner: Option<&str>,
    preserve_owners: bool,
    rx: mpsc::Receiver<Chunk>,
) -> Res<FsResult> {
    let p = normalize(path, "path")?;
    let ids = new_owner(c, owner)?;
    match fs::metadata(&p) {
        Ok(md) if md.is_dir() => {}
        Ok(_) => {
            return Err(FsFailure::new(
                FsErrorCode::WrongType,
                format!("{} is not a directory", p.display()),
            )
            .param("path"))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            ensure_dir(&p, parents, ids, "path")?;
        }
        Err(e) => return Err(fail(&e, &p, "path")),
    }
    let mut reader = ChunkReader {
        rx,
        cur: Vec::new(),
        at: 0,
        ended: false,
        cut_off: false,
    };
    let (mut entries, mut bytes, mut skipped) = (0u64, 0u64, 0u64);
    let mut unpacker = Unpacker::new(&p, preserve_owners, ids).map_err(|e| fail(&e, &p, "path"))?;
    let outcome: Result<(), io::Error> = (|| {
        let mut ar = tar::Archive::new(&mut reader);
        for e in ar.entries()? {
            if c.cancelled() {
                return Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "the node hung up",
                ));
            }
            let mut e = e?;
            let t = e.header().entry_type();
            if t.is_character_special() || t.is_block_special() || t.is_fifo() {
                skipped += 1;
                continue;
            }
            if t.is_pax_global_extensions()
                || t.is_pax_local_extensions()
                || t.is_gnu_longname()
                || t.is_gnu_longlink()
            {
                continue;
            }
            let size = e.size();
            match unpacker.unpack(&mut e)? {
                Unpacked::Skipped => skipped += 1,
                Unpacked::Done => {
                    entries += 1;
                    if t.is_file() {
                        bytes += size;
                    }
                }
            }
        }
        Ok(())
    })();
    if let Err(e) = outcome {
        if reader.cut_off {
            return Err(aborted("the upload was cut off"));
        }
        if c.cancelled() {
            return Err(aborted("the node hung up"));
        }
        return Err(match errno_of(&e) {
            Some(_) => fail(&e, &p, "path"),
            None => invalid(
                format!("the body is not a tar stream as expected: {e}"),
                "body",
            ),
        });
    }
    reader.drain()?;
    Ok(FsResult::Tar {
        entries,
        bytes,
        skipped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_normalised_against_the_root() {
        let n = |p: &str| normalize(p, "path").map(|p| p.to_string_lossy().into_owned());
        assert_eq!(n("/a/b").unwrap(), "/a/b");
        assert_eq!(n("../../etc/shadow").unwrap(), "/etc/shadow");
        assert_eq!(n("/a/../../..//b/./c/").unwrap(), "/b/c");
        assert_eq!(n("a").unwrap(), "/a");
        assert_eq!(n("/").unwrap(), "/");
        assert_eq!(n("/..").unwrap(), "/");
        assert_eq!(n("").unwrap_err().code, FsErrorCode::Invalid);
        let nul = n("/a\0b").unwrap_err();
        assert_eq!(nul.code, FsErrorCode::Invalid);
        assert_eq!(nul.param.as_deref(), Some("path"));
    }

    #[test]
    fn globs() {
        let m = |g: &str, s: &str| glob_regex(g).unwrap().is_match(s.as_bytes());
        assert!(m("*.rs", "main.rs"));
        assert!(!m("*.rs", "src/main.rs"));
        assert!(m("src/*.rs", "src/main.rs"));
        assert!(m("**/*.rs", "a/b/c.rs"));
        assert!(m("**/*.rs", "c.rs"));
        assert!(m("file?.txt", "file1.txt"));
        assert!(m("[ab].c", "a.c"));
        assert!(!m("[!ab].c", "a.c"));
        assert!(m("[!ab].c", "z.c"));
        assert!(m("a+b(c).txt", "a+b(c).txt"));
        assert!(m("[", "["));
        let g = Globs::new(&["*.py".into()], &["test_*".into()]).unwrap();
        assert!(g.takes(b"app.py", b"src/app.py"));
        assert!(!g.takes(b"test_app.py", b"test_app.py"));
        assert!(!g.takes(b"app.rs", b"app.rs"));
    }

    #[test]
    fn long_lines_are_capped() {
        let data = b"short\nxxxxxxxxxxxxxxxx\nend";
        let mut r = BufReader::with_capacity(4, &data[..]);
        let mut line = Vec::new();
        assert_eq!(read_line_capped(&mut r, &mut line, 8).unwrap(), (6, false));
        assert_eq!(line, b"short\n");
        assert_eq!(read_line_capped(&mut r, &mut line, 8).unwrap(), (17, true));
        assert_eq!(line, b"xxxxxxxx");
        assert_eq!(read_line_capped(&mut r, &mut line, 8).unwrap(), (3, false));
        assert_eq!(line, b"end");
        assert_eq!(read_line_capped(&mut r, &mut line, 8).unwrap(), (0, false));
    }

    #[test]
    fn errnos_map_to_codes() {
        let e = io::Error::from_raw_os_error(Errno::ENOTEMPTY as i32);
        let f = fail(&e, Path::new("/d"), "path");
        assert_eq!(f.code, FsErrorCode::NotEmpty);
        assert_eq!(f.message, "/d: directory not empty");
        assert_eq!(code_of_errno(Errno::ENOSPC), FsErrorCode::Io);
        assert_eq!(code_of_errno(Errno::EROFS), FsErrorCode::PermissionDenied);
        assert_eq!(code_of_errno(Errno::ENOTDIR), FsErrorCode::WrongType);
    }

    #[test]
    fn cut_text_keeps_whole_characters() {
        assert_eq!(cut_text("héllo", 2), ("h".to_string(), true));
        assert_eq!(cut_text("abc", 3), ("abc".to_string(), false));
    }
}
