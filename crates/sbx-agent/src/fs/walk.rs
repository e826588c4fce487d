//! Walking a tree (symlinks not followed, /proc and /sys not entered) and the files of a
//! search: include and exclude globs.

use std::fs::{self, Metadata};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use regex::bytes::Regex;
use sbx_proto::{FsErrorCode, FsFailure};

use super::path::fail;
use super::tree::unsupported_kind;
use super::{Ctx, Res};

#[derive(PartialEq, Eq)]
pub(super) enum Flow {
    Continue,
    /// Do not go into this directory.
    Prune,
    Stop,
}

/// Calls `f` on everything under `root` (not `root` itself), symlinks not followed, a
/// directory's entries by name before what is in its subdirectories. Directories on /proc's
/// or /sys's filesystem are not entered (unless `root` is on it); one that cannot be read is
/// passed over.
pub(super) fn walk(
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
pub(super) struct Globs {
    include: Vec<(Regex, bool)>,
    exclude: Vec<(Regex, bool)>,
}

impl Globs {
    pub(super) fn new(include: &[String], exclude: &[String]) -> Res<Globs> {
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
pub(super) fn each_file(
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
