//! Who a process runs as and where: the user of the request (`Authorization: Basic`, else
//! envd's default user) looked up among the sandbox's users (its /etc/passwd, as its agent
//! reads it), and its working directory as envd resolves it (unset: the user's home; `~/…`;
//! relative to the home).

use crate::connect::{Code, RpcError};
use crate::envd::DEFAULT_USER;
use crate::node::files::UserInfo;

/// The user a process runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunAs {
    /// For the node's exec (`None`: the sandbox's own user, as the image says).
    pub user: Option<String>,
    /// Its home directory, when known.
    pub home: Option<String>,
}

/// The user named (`None`: envd's default, `user`) as the sandbox knows it (`users`; the
/// image's user `image_user`). The default user missing from the image runs as the image's
/// user; another name missing is refused as envd refuses it (unauthenticated `invalid
/// username`); a uid (or `uid:gid`) runs as it is.
pub fn resolve(
    named: Option<&str>,
    users: &[UserInfo],
    image_user: Option<&str>,
) -> Result<RunAs, RpcError> {
    let by_uid = |uid: u32| users.iter().find(|u| u.uid == uid);
    let home_of = |spec: &str| {
        users
            .iter()
            .find(|u| u.name == spec)
            .or_else(|| uid_of(spec).and_then(by_uid))
            .map(|u| u.home.clone())
    };
    let name = named.unwrap_or(DEFAULT_USER);
    if let Some(u) = users.iter().find(|u| u.name == name) {
        return Ok(RunAs {
            user: Some(name.to_string()),
            home: Some(u.home.clone()),
        });
    }
    if let Some(uid) = uid_of(name) {
        return Ok(RunAs {
            user: Some(name.to_string()),
            home: by_uid(uid).map(|u| u.home.clone()),
        });
    }
    if name == DEFAULT_USER {
        return Ok(RunAs {
            user: None,
            // The image's user (root when it names none).
            home: home_of(image_user.unwrap_or("0")),
        });
    }
    Err(RpcError::new(
        Code::Unauthenticated,
        format!("invalid username: '{name}'"),
    ))
}

/// The uid of a user spec that is one (`1000`, `1000:1000`).
fn uid_of(spec: &str) -> Option<u32> {
    spec.split(':').next().and_then(|u| u.parse().ok())
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

    fn u(name: &str, uid: u32, home: &str) -> UserInfo {
        UserInfo {
            name: name.into(),
            uid,
            gid: uid,
            home: home.into(),
        }
    }

    #[test]
    fn users_are_found_or_fall_back() {
        let p = vec![u("root", 0, "/root"), u("user", 1000, "/home/user")];
        let r = resolve(None, &p, Some("root")).unwrap();
        assert_eq!(r.user.as_deref(), Some("user"));
        assert_eq!(r.home.as_deref(), Some("/home/user"));
        let r = resolve(Some("root"), &p, None).unwrap();
        assert_eq!(r.home.as_deref(), Some("/root"));
        let n = resolve(Some("1000:1000"), &p, None).unwrap();
        assert_eq!(n.user.as_deref(), Some("1000:1000"));
        assert_eq!(n.home.as_deref(), Some("/home/user"));
        let none = resolve(Some("4242"), &p, None).unwrap();
        assert_eq!(none.home, None);
        // An image without `user`: its own user, in that user's home.
        let only_root = vec![u("root", 0, "/root"), u("app", 500, "/srv/app")];
        for named in [None, Some("user")] {
            let f = resolve(named, &only_root, None).unwrap();
            assert_eq!((f.user, f.home.as_deref()), (None, Some("/root")));
        }
        let f = resolve(None, &only_root, Some("app")).unwrap();
        assert_eq!((f.user, f.home.as_deref()), (None, Some("/srv/app")));
        let f = resolve(None, &only_root, Some("500:500")).unwrap();
        assert_eq!(f.home.as_deref(), Some("/srv/app"));
        let e = resolve(Some("alice"), &p, None).unwrap_err();
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
