//! A file's bytes: an upload written to a temporary file that takes the file's place once
//! complete, a download sent as data frames of [`CHUNK`] bytes.

use std::ffi::OsString;
use std::fs::{self, File, Metadata, Permissions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{fchown, MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use sbx_proto::{AgentMsg, FsErrorCode, FsFailure, FsResult, Stream, XattrSet};
use tokio::sync::mpsc;

use super::path::{aborted, fail, io_of, normalize};
use super::tree::{check_mode, ensure_dir, entry_of, new_owner, unsupported_kind};
use super::{Chunk, Ctx, Res, CHUNK};

/// A temporary file beside `target`, removed when dropped unless kept. It is made and renamed
/// through a handle on the directory opened once: a directory of the path swapped for a
/// symlink meanwhile does not move where the file lands.
pub(super) struct Temp {
    dir: File,
    name: OsString,
    keep: bool,
}

impl Temp {
    pub(super) fn create(target: &Path) -> io::Result<(Temp, File)> {
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
            OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
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
    pub(super) fn commit(
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

/// How an upload is written (`FsOp::Write`'s fields but its path).
pub(super) struct WriteHow<'a> {
    pub mode: Option<u32>,
    pub parents: bool,
    pub owner: Option<&'a str>,
    pub in_place: bool,
    pub xattrs: Option<&'a XattrSet>,
}

/// Checks the extended attributes a write is to leave: a prefix under `user.`, each name
/// under it.
fn check_xattrs(x: Option<&XattrSet>) -> Res<()> {
    let Some(x) = x else { return Ok(()) };
    let bad = |m: String| FsFailure::new(FsErrorCode::Invalid, m).param("xattrs");
    if !x.prefix.starts_with("user.") || x.prefix.contains('\0') {
        return Err(bad(format!(
            "{:?}: only attributes of the user. namespace are written",
            x.prefix
        )));
    }
    for (k, v) in &x.values {
        if !k.starts_with(&x.prefix) || k.len() == x.prefix.len() || k.contains('\0') {
            return Err(bad(format!("{k:?} is not a name under {:?}", x.prefix)));
        }
        if v.len() > 64 << 10 {
            return Err(bad(format!("the value of {k} is over 64 KiB")));
        }
    }
    Ok(())
}

/// The attributes a write leaves, set on the file written.
fn set_xattrs(x: Option<&XattrSet>, file: &Path, p: &Path) -> Res<()> {
    match x {
        Some(x) => sbx_runtime::xattr::replace(file, &x.prefix, &x.values)
            .map_err(|e| fail(&e, p, "xattrs")),
        None => Ok(()),
    }
}

pub(super) fn write_file(
    c: &Ctx,
    path: &str,
    how: WriteHow<'_>,
    mut rx: mpsc::Receiver<Chunk>,
) -> Res<FsResult> {
    let WriteHow {
        mode,
        parents,
        owner,
        in_place,
        xattrs,
    } = how;
    let p = normalize(path, "path")?;
    check_mode(mode)?;
    check_xattrs(xattrs)?;
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
    if in_place {
        let written = write_in_place(c, &p, &target, old, mode, owner, ids, rx)?;
        set_xattrs(xattrs, &target, &p)?;
        return Ok(match written {
            FsResult::Written { bytes, created, .. } if xattrs.is_some() => {
                let md = fs::metadata(&target).map_err(|e| fail(&e, &p, "path"))?;
                FsResult::Written {
                    entry: entry_of(&p, &md),
                    bytes,
                    created,
                }
            }
            w => w,
        });
    }
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
    set_xattrs(xattrs, &target, &p)?;
    Ok(FsResult::Written {
        entry: entry_of(&p, &md),
        bytes,
        created: old.is_none(),
    })
}

/// An upload written into the file itself, as E2B's envd writes (watchers see the file
/// written, not renamed over): owned (and, when given, moded) before the first byte,
/// truncated, then written. A new file is written as the bytes come (a cut-off upload leaves
/// it cut); one that is there gets them once they are all staged beside it (a cut-off upload
/// leaves it as it was).
#[allow(clippy::too_many_arguments)]
fn write_in_place(
    c: &Ctx,
    p: &Path,
    target: &Path,
    old: Option<Metadata>,
    mode: Option<u32>,
    owner: Option<&str>,
    ids: Option<(u32, u32)>,
    mut rx: mpsc::Receiver<Chunk>,
) -> Res<FsResult> {
    use std::os::unix::fs::OpenOptionsExt;
    let ids = match (owner, &old) {
        (Some(_), _) | (None, None) => ids,
        (None, Some(m)) => Some((m.uid(), m.gid())),
    };
    // A file that is there: its bytes staged beside it first, and copied in once all there
    // (a cut-off upload leaves it as it was).
    let staged = match &old {
        Some(_) => {
            let (temp, mut staged) = stage(target).map_err(|e| fail(&e, p, "path"))?;
            let n = receive(c, p, &mut staged, &mut rx)?;
            staged
                .seek(SeekFrom::Start(0))
                .map_err(|e| fail(&e, p, "path"))?;
            Some((temp, staged, n))
        }
        None => None,
    };
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode.unwrap_or(0o644))
        .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC).bits())
        .open(target)
        .map_err(|e| fail(&e, p, "path"))?;
    if let Some((u, g)) = ids {
        fchown(&file, Some(u), Some(g)).map_err(|e| fail(&e, p, "path"))?;
    }
    if let Some(m) = mode {
        file.set_permissions(Permissions::from_mode(m))
            .map_err(|e| fail(&e, p, "path"))?;
    }
    let bytes = match staged {
        Some((temp, mut staged, n)) => {
            io::copy(&mut staged, &mut file).map_err(|e| fail(&e, p, "path"))?;
            drop(temp);
            n
        }
        None => receive(c, p, &mut file, &mut rx)?,
    };
    let md = file.metadata().map_err(|e| fail(&e, p, "path"))?;
    Ok(FsResult::Written {
        entry: entry_of(p, &md),
        bytes,
        created: old.is_none(),
    })
}

/// A file to stage an upload's bytes in, on the filesystem of `target`: one without a name
/// (`O_TMPFILE`: watchers of the directory see nothing of it), else a temporary file beside
/// it (removed when its [`Temp`] is dropped).
fn stage(target: &Path) -> io::Result<(Option<Temp>, File)> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = target.parent().unwrap_or(Path::new("/"));
    match fs::OpenOptions::new()
        .read(true)
        .write(true)
        .mode(0o600)
        .custom_flags((OFlag::O_TMPFILE | OFlag::O_CLOEXEC).bits())
        .open(dir)
    {
        Ok(f) => Ok((None, f)),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EOPNOTSUPP) | Some(libc::EISDIR) | Some(libc::EINVAL)
            ) =>
        {
            let (t, f) = Temp::create(target)?;
            Ok((Some(t), f))
        }
        Err(e) => Err(e),
    }
}

/// An upload's bytes into `file`, to their end: how many.
fn receive(c: &Ctx, p: &Path, file: &mut File, rx: &mut mpsc::Receiver<Chunk>) -> Res<u64> {
    let mut bytes = 0u64;
    loop {
        match rx.blocking_recv() {
            Some(Chunk::Data(b)) => {
                file.write_all(&b).map_err(|e| fail(&e, p, "path"))?;
                bytes += b.len() as u64;
                c.check()?;
            }
            Some(Chunk::End) => return Ok(bytes),
            None => {
                return Err(aborted(format!(
                    "the upload of {} was cut off after {bytes} bytes",
                    p.display()
                )))
            }
        }
    }
}

pub(super) fn read_file(
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
