//! Extended attributes of a file: those of a namespace read, set and removed (a symlink's
//! own, never what it points to). The agent keeps files' metadata in them (E2B's
//! `user.e2b.*`).

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// The most bytes of one attribute's value read (the kernel's own limit).
const MAX_VALUE: usize = 64 << 10;

/// The names of the attributes of `path` (a symlink's own); none where the filesystem has none.
fn names(path: &Path) -> io::Result<Vec<Vec<u8>>> {
    let mut buf = vec![0u8; 4096];
    loop {
        match rustix::fs::llistxattr(path, &mut buf) {
            Ok(n) => {
                return Ok(buf[..n]
                    .split(|b| *b == 0)
                    .filter(|n| !n.is_empty())
                    .map(<[u8]>::to_vec)
                    .collect())
            }
            Err(rustix::io::Errno::RANGE) if buf.len() < 1 << 20 => buf.resize(buf.len() * 4, 0),
            Err(rustix::io::Errno::NOTSUP) => return Ok(Vec::new()),
            Err(e) => return Err(e.into()),
        }
    }
}

/// The attributes of `path` whose names start with `prefix` (names in full), those whose
/// value is UTF-8 text.
pub fn read(path: &Path, prefix: &str) -> io::Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for name in names(path)? {
        if !name.starts_with(prefix.as_bytes()) {
            continue;
        }
        let Ok(text) = String::from_utf8(name.clone()) else {
            continue;
        };
        let mut value = vec![0u8; MAX_VALUE];
        let n = match rustix::fs::lgetxattr(path, OsStr::from_bytes(&name), &mut value) {
            Ok(n) => n,
            // Removed since listed.
            Err(rustix::io::Errno::NODATA) => continue,
            Err(e) => return Err(e.into()),
        };
        value.truncate(n);
        if let Ok(v) = String::from_utf8(value) {
            out.insert(text, v);
        }
    }
    Ok(out)
}

/// Makes the attributes of `path` under `prefix` exactly `values` (names in full, each under
/// `prefix`): the others under it are removed.
pub fn replace(path: &Path, prefix: &str, values: &BTreeMap<String, String>) -> io::Result<()> {
    for name in names(path)? {
        if name.starts_with(prefix.as_bytes())
            && !values.keys().any(|k| k.as_bytes() == name.as_slice())
        {
            match rustix::fs::lremovexattr(path, OsStr::from_bytes(&name)) {
                Ok(()) | Err(rustix::io::Errno::NODATA) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    for (k, v) in values {
        rustix::fs::lsetxattr(
            path,
            k.as_str(),
            v.as_bytes(),
            rustix::fs::XattrFlags::empty(),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_read_and_replaced_under_a_prefix() {
        let dir = std::env::temp_dir().join(format!("sbx-xattr-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("a");
        std::fs::write(&f, b"x").unwrap();
        struct Gone(std::path::PathBuf);
        impl Drop for Gone {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
        let _gone = Gone(dir.clone());
        let mut v = BTreeMap::new();
        v.insert("user.t.a".to_string(), "1".to_string());
        v.insert("user.t.b".to_string(), "two".to_string());
        if let Err(e) = replace(&f, "user.t.", &v) {
            // A filesystem without user xattrs (tmpfs of an old kernel): nothing to test.
            assert_eq!(e.raw_os_error(), Some(libc::EOPNOTSUPP), "{e}");
            return;
        }
        rustix::fs::lsetxattr(&f, "user.other", b"o", rustix::fs::XattrFlags::empty()).unwrap();
        assert_eq!(read(&f, "user.t.").unwrap(), v);
        let mut w = BTreeMap::new();
        w.insert("user.t.c".to_string(), "3".to_string());
        replace(&f, "user.t.", &w).unwrap();
        assert_eq!(read(&f, "user.t.").unwrap(), w);
        // Outside the prefix: left.
        assert_eq!(
            read(&f, "user.o")
                .unwrap()
                .get("user.other")
                .map(String::as_str),
            Some("o")
        );
        replace(&f, "user.t.", &BTreeMap::new()).unwrap();
        assert!(read(&f, "user.t.").unwrap().is_empty());
    }
}
