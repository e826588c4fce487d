//! Trees as tar streams: a directory (or file) sent as an archive, an archive unpacked into
//! a directory through directory handles.

use std::ffi::{OsStr, OsString};
use std::fs::{self, File, Permissions};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{fchown, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use sbx_proto::{AgentMsg, FsErrorCode, FsFailure, FsResult, Stream};
use tokio::sync::mpsc;

use super::path::{aborted, errno_of, fail, invalid, io_of, normalize};
use super::tree::{ensure_dir, new_owner, unsupported_kind};
use super::walk::{walk, Flow};
use super::{Chunk, Ctx, Res, CHUNK};

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

pub(super) fn tar_create(c: &Ctx, path: &str) -> Res<FsResult> {
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

pub(super) fn tar_extract(
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
