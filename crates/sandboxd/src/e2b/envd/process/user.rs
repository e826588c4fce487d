//! Who a process runs as and where: the user of the request (`Authorization: Basic`, else
//! envd's default user) looked up in the sandbox's /etc/passwd, and its working directory as
//! envd resolves it (unset: the user's home; `~/…`; relative to the home).

use crate::e2b::connect::{Code, RpcError};
use crate::e2b::envd::DEFAULT_USER;

/// A line of /etc/passwd: what is used of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PasswdEntry {
    pub name: String,
    pub uid: u32,
    pub home: String,
}

/// The entries of an /etc/passwd text (lines that do not parse are skipped).
pub fn parse_passwd(text: &str) -> Vec<PasswdEntry> {
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            if f.len() < 6 || f[0].is_empty() {
                return None;
            }
            Some(PasswdEntry {
                name: f[0].to_string(),
                uid: f[2].parse().ok()?,
                home: if f[5].is_empty() { "/" } else { f[5] }.to_string(),
            })
        })
        .collect()
}

/// The user a process runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunAs {
    /// For the node's exec (`None`: the sandbox's own user, as the image says).
    pub user: Option<String>,
    /// Its home directory, when known.
    pub home: Option<String>,
}

/// The user named (`None`: envd's default, `user`) as the sandbox knows it. The default user
/// missing from the image runs as the image's user; another name missing is refused as envd
/// refuses it (unauthenticated `invalid username`); a uid (or `uid:gid`) runs as it is.
pub fn resolve(named: Option<&str>, passwd: &[PasswdEntry]) -> Result<RunAs, RpcError> {
    let name = named.unwrap_or(DEFAULT_USER);
    if let Some(e) = passwd.iter().find(|e| e.name == name) {
        return Ok(RunAs {
            user: Some(name.to_string()),
            home: Some(e.home.clone()),
        });
    }
    let uid = name.split(':').next().and_then(|u| u.parse::<u32>().ok());
    if let Some(uid) = uid {
        return Ok(RunAs {
            user: Some(name.to_string()),
            home: passwd.iter().find(|e| e.uid == uid).map(|e| e.home.clone()),
        });
    }
    if name == DEFAULT_USER {
        return Ok(RunAs {
            user: None,
            home: None,
        });
    }
    Err(RpcError::new(
        Code::Unauthenticated,
        format!("invalid username: '{name}'"),
    ))
}

/// The working directory of a process (`None`: the sandbox's own): `cwd` as given when
/// absolute, else under the home (`~`, `~/x`, `x`); unset: the home.
pub fn resolve_cwd(cwd: Option<&str>, home: Option<&str>) -> Result<Option<String>, RpcError> {
    let base = home.unwrap_or("/");
    let path = match cwd.filter(|c| !c.is_empty()) {
        None => return Ok(home.map(normalize)),
        Some(c) if c.starts_with('/') => c.to_string(),
        Some("~") => base.to_string(),
        Some(c) if c.starts_with("~/") => format!("{base}/{}", &c[2..]),
        Some(c) if c.starts_with('~') => {
            return Err(RpcError::invalid(format!(
                "cwd '{c}': cannot expand user-specific home dir"
            )))
        }
        Some(c) => format!("{base}/{c}"),
    };
    Ok(Some(normalize(&path)))
}

/// An absolute path with `.`, `..` and repeated slashes resolved (as Go's filepath.Clean).
fn normalize(path: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for p in path.split('/') {
        match p {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    format!("/{}", parts.join("/"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: &str = "root:x:0:0:root:/root:/bin/bash\n# a comment\nbroken\nuser:x:1000:1000::/home/user:/bin/bash\nnohome:x:1001:1001:::/bin/sh\n";

    #[test]
    fn passwd_lines() {
        let p = parse_passwd(P);
        assert_eq!(p.len(), 3);
        assert_eq!(p[1].name, "user");
        assert_eq!(p[1].uid, 1000);
        assert_eq!(p[2].home, "/");
    }

    #[test]
    fn users_are_found_or_fall_back() {
        let p = parse_passwd(P);
        let u = resolve(None, &p).unwrap();
        assert_eq!(u.user.as_deref(), Some("user"));
        assert_eq!(u.home.as_deref(), Some("/home/user"));
        let r = resolve(Some("root"), &p).unwrap();
        assert_eq!(r.home.as_deref(), Some("/root"));
        let n = resolve(Some("1000:1000"), &p).unwrap();
        assert_eq!(n.user.as_deref(), Some("1000:1000"));
        assert_eq!(n.home.as_deref(), Some("/home/user"));
        let none = resolve(Some("4242"), &p).unwrap();
        assert_eq!(none.home, None);
        // An image without `user`: its own user.
        let only_root = parse_passwd("root:x:0:0::/root:/bin/sh\n");
        for named in [None, Some("user")] {
            let f = resolve(named, &only_root).unwrap();
            assert_eq!((f.user, f.home), (None, None));
        }
        let e = resolve(Some("alice"), &p).unwrap_err();
        assert_eq!(e.code, Code::Unauthenticated);
        assert_eq!(e.message, "invalid username: 'alice'");
    }

    #[test]
    fn cwd_as_envd_resolves_it() {
        let h = Some("/home/user");
        assert_eq!(resolve_cwd(None, h).unwrap().as_deref(), Some("/home/user"));
        assert_eq!(
            resolve_cwd(Some(""), h).unwrap().as_deref(),
            Some("/home/user")
        );
        assert_eq!(resolve_cwd(None, None).unwrap(), None);
        assert_eq!(
            resolve_cwd(Some("/tmp/"), h).unwrap().as_deref(),
            Some("/tmp")
        );
        assert_eq!(
            resolve_cwd(Some("~"), h).unwrap().as_deref(),
            Some("/home/user")
        );
        assert_eq!(
            resolve_cwd(Some("~/a/./b/../c"), h).unwrap().as_deref(),
            Some("/home/user/a/c")
        );
        assert_eq!(
            resolve_cwd(Some("src"), h).unwrap().as_deref(),
            Some("/home/user/src")
        );
        assert_eq!(
            resolve_cwd(Some("src"), None).unwrap().as_deref(),
            Some("/src")
        );
        assert_eq!(
            resolve_cwd(Some("/../.."), h).unwrap().as_deref(),
            Some("/")
        );
        assert!(resolve_cwd(Some("~bob/x"), h).is_err());
    }
}
