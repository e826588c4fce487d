//! Paths of the sandbox (normalised against its root) and the errors of the operations
//! (an errno as a code and a message).

use std::io;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use sbx_proto::{FsErrorCode, FsFailure};

use super::Res;

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

pub(super) fn invalid(message: impl Into<String>, param: &str) -> FsFailure {
    FsFailure::new(FsErrorCode::Invalid, message).param(param)
}

pub(super) fn aborted(message: impl Into<String>) -> FsFailure {
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
pub(super) fn errno_of(e: &io::Error) -> Option<Errno> {
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
pub(super) fn fail(e: &io::Error, path: &Path, param: &str) -> FsFailure {
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

pub(super) fn io_of(e: Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

#[cfg(test)]
mod fuzz;

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
    fn errnos_map_to_codes() {
        let e = io::Error::from_raw_os_error(Errno::ENOTEMPTY as i32);
        let f = fail(&e, Path::new("/d"), "path");
        assert_eq!(f.code, FsErrorCode::NotEmpty);
        assert_eq!(f.message, "/d: directory not empty");
        assert_eq!(code_of_errno(Errno::ENOSPC), FsErrorCode::Io);
        assert_eq!(code_of_errno(Errno::EROFS), FsErrorCode::PermissionDenied);
        assert_eq!(code_of_errno(Errno::ENOTDIR), FsErrorCode::WrongType);
    }
}
