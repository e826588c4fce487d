//! What `filesystem.Filesystem` says of files: paths as envd resolves them (relative to the
//! user's home, `~` expanded), users and groups by name, and the agent's entries as proto
//! `EntryInfo`s.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use crate::connect::RpcError;
use crate::envd::Ctx;
use crate::node::files::{FileKind as FsKind, FsEntry, GroupInfo, SandboxUsers, UserInfo};
use crate::sync::LockExt;

/// The sandbox's users and groups, as its agent read them.
#[derive(Debug, Default)]
pub struct Users {
    users: Vec<UserInfo>,
    groups: Vec<GroupInfo>,
    default_user: Option<String>,
}

/// How long a sandbox's users are trusted (a command may add one).
const USERS_FOR: Duration = Duration::from_secs(2);
/// The most sandboxes whose users are kept.
const USERS_KEPT: usize = 256;

/// Users by sandbox, with when they were read.
type Cache = HashMap<String, (Instant, Arc<Users>)>;

static CACHE: LazyLock<Mutex<Cache>> = LazyLock::new(|| Mutex::new(HashMap::new()));

impl Users {
    pub fn of(u: SandboxUsers) -> Users {
        Users {
            users: u.users,
            groups: u.groups,
            default_user: u.default_user,
        }
    }

    pub fn user(&self, name: &str) -> Option<&UserInfo> {
        self.users.iter().find(|u| u.name == name)
    }

    /// The home of `user`; when there is no such user, the image user's, else `/`.
    pub fn home(&self, user: &str) -> String {
        self.user(user)
            .or_else(|| self.default_user.as_deref().and_then(|d| self.user(d)))
            .map(|u| u.home.clone())
            .filter(|h| h.starts_with('/'))
            .unwrap_or_else(|| "/".to_string())
    }

    /// Whether a request may act as `user`, as envd decides it for processes (one decision:
    /// [`crate::envd::process::user::resolve`]): a user of the sandbox, a uid (`1000`,
    /// `1000:1000`), or envd's default user (the image's own user when the image lacks it).
    /// Any other name is refused (unauthenticated `invalid username`), not served as the
    /// image's user. A sandbox whose users are not known (an older agent) takes any.
    pub fn check(&self, user: &str) -> Result<(), RpcError> {
        if self.users.is_empty() {
            return Ok(());
        }
        crate::envd::process::user::resolve(Some(user), &self.users, self.default_user.as_deref())
            .map(|_| ())
    }

    /// Who owns what a request of `user` makes: that user, when the sandbox has it.
    pub fn owner(&self, user: &str) -> Option<String> {
        self.user(user).map(|u| u.name.clone())
    }

    fn owner_name(&self, uid: u32) -> String {
        self.users
            .iter()
            .find(|u| u.uid == uid)
            .map(|u| u.name.clone())
            .unwrap_or_else(|| uid.to_string())
    }

    fn group_name(&self, gid: u32) -> String {
        self.groups
            .iter()
            .find(|g| g.gid == gid)
            .map(|g| g.name.clone())
            .unwrap_or_else(|| gid.to_string())
    }
}

/// The users of the request's sandbox (kept for [`USERS_FOR`]). An agent that cannot list
/// them (an older one) gives none: homes are `/`, owners numbers.
pub async fn users(ctx: &Ctx) -> Result<Arc<Users>, RpcError> {
    if let Some((at, u)) = CACHE.locked().get(&ctx.sandbox) {
        if at.elapsed() < USERS_FOR {
            return Ok(u.clone());
        }
    }
    let users = match ctx.node().fs_users(&ctx.sandbox).await {
        Ok(u) => Users::of(u),
        Err(e) if e.code == sbx_api::ErrorCode::Unsupported => Users::default(),
        Err(e) => return Err(e.into()),
    };
    let users = Arc::new(users);
    let mut cache = CACHE.locked();
    if cache.len() >= USERS_KEPT {
        cache.retain(|_, (at, _)| at.elapsed() < USERS_FOR);
        if cache.len() >= USERS_KEPT {
            cache.clear();
        }
    }
    cache.insert(ctx.sandbox.clone(), (Instant::now(), users.clone()));
    Ok(users)
}

/// The sandbox's users ([`users`]), once `user` is one a request may act as
/// ([`Users::check`]).
pub async fn users_for(ctx: &Ctx, user: &str) -> Result<Arc<Users>, RpcError> {
    let users = users(ctx).await?;
    users.check(user)?;
    Ok(users)
}

/// `path` as envd resolves it for a user whose home is `home`: `~` and `~/…` are the home,
/// a relative path is taken from the home, `.` and `..` are taken lexically; the empty path
/// is the home.
pub fn resolve(path: &str, home: &str) -> Result<String, RpcError> {
    if path.contains('\0') {
        return Err(RpcError::invalid("the path has a NUL byte"));
    }
    let joined = if let Some(rest) = path.strip_prefix('~') {
        if !(rest.is_empty() || rest.starts_with('/')) {
            return Err(RpcError::invalid(format!(
                "{path}: cannot expand another user's home directory"
            )));
        }
        format!("{home}/{rest}")
    } else if path.starts_with('/') {
        path.to_string()
    } else {
        format!("{home}/{path}")
    };
    let mut parts: Vec<&str> = Vec::new();
    for c in joined.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    Ok(format!("/{}", parts.join("/")))
}

/// The parent directory of a resolved path (`/` for `/`).
pub fn parent(path: &str) -> String {
    match path.rfind('/') {
        Some(0) | None => "/".to_string(),
        Some(i) => path[..i].to_string(),
    }
}

/// Go's `FileMode.String()` (what envd answers as `permissions`): the type and special bits
/// as letters (or `-`), then `rwx` three times.
pub fn permissions(kind: FsKind, mode: u32) -> String {
    let mut s = String::with_capacity(12);
    let letters = [
        (kind == FsKind::Dir, 'd'),
        (kind == FsKind::Symlink, 'L'),
        (
            matches!(kind, FsKind::CharDevice | FsKind::BlockDevice),
            'D',
        ),
        (kind == FsKind::Fifo, 'p'),
        (kind == FsKind::Socket, 'S'),
        (mode & 0o4000 != 0, 'u'),
        (mode & 0o2000 != 0, 'g'),
        (kind == FsKind::CharDevice, 'c'),
        (mode & 0o1000 != 0, 't'),
    ];
    for (on, c) in letters {
        if on {
            s.push(c);
        }
    }
    if s.is_empty() {
        s.push('-');
    }
    for (i, c) in "rwxrwxrwx".chars().enumerate() {
        s.push(if mode & (1 << (8 - i)) != 0 { c } else { '-' });
    }
    s
}

/// The proto `FileType` of a kind.
pub fn file_type(kind: FsKind) -> &'static str {
    match kind {
        FsKind::File => "FILE_TYPE_FILE",
        FsKind::Dir => "FILE_TYPE_DIRECTORY",
        FsKind::Symlink => "FILE_TYPE_SYMLINK",
        _ => "FILE_TYPE_UNSPECIFIED",
    }
}

/// The extended attributes that hold a file's E2B metadata: `user.e2b.<key>`.
pub const METADATA_XATTRS: &str = "user.e2b.";

/// A file's E2B metadata: its `user.e2b.*` attributes, the prefix taken off (`None`: none).
pub fn metadata_of(e: &FsEntry) -> Option<Map<String, Value>> {
    let m: Map<String, Value> = e
        .xattrs
        .iter()
        .filter_map(|(k, v)| {
            let key = k.strip_prefix(METADATA_XATTRS)?;
            (!key.is_empty()).then(|| (key.to_string(), json!(v)))
        })
        .collect();
    (!m.is_empty()).then_some(m)
}

/// An agent's entry as proto JSON `EntryInfo`. A symlink is described as envd describes it:
/// the type of what it resolves to, and the absolute path of that as its target (a dangling
/// one: `FILE_TYPE_SYMLINK` and the link's text).
pub fn entry_info(e: &FsEntry, users: &Users) -> Value {
    let mut m = Map::new();
    let kind = match (e.kind, e.target_kind) {
        (FsKind::Symlink, Some(t)) => t,
        (k, _) => k,
    };
    m.insert("name".into(), json!(e.name));
    m.insert("type".into(), json!(file_type(kind)));
    m.insert("path".into(), json!(e.path));
    m.insert("size".into(), json!(e.size.to_string()));
    m.insert("mode".into(), json!(e.mode & 0o777));
    m.insert("permissions".into(), json!(permissions(e.kind, e.mode)));
    m.insert("owner".into(), json!(users.owner_name(e.uid)));
    m.insert("group".into(), json!(users.group_name(e.gid)));
    m.insert(
        "modifiedTime".into(),
        json!(sbx_api::format_rfc3339_millis(i128::from(e.mtime_ns))),
    );
    if e.kind == FsKind::Symlink {
        if let Some(t) = e.resolved.as_ref().or(e.target.as_ref()) {
            m.insert("symlinkTarget".into(), json!(t));
        }
    }
    if let Some(meta) = metadata_of(e) {
        m.insert("metadata".into(), Value::Object(meta));
    }
    Value::Object(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_users_are_refused() {
        let u = users();
        for ok in ["user", "root", "1000", "0:0"] {
            assert!(u.check(ok).is_ok(), "{ok}");
        }
        let e = u.check("alice").unwrap_err();
        assert_eq!(e.message, "invalid username: 'alice'");
        // An image without `user`: the default user is its own; an agent that cannot list
        // users takes any.
        let only_root = Users {
            users: vec![u.users[0].clone()],
            groups: vec![],
            default_user: Some("root".into()),
        };
        assert!(only_root.check("user").is_ok());
        assert!(only_root.check("alice").is_err());
        assert!(Users::default().check("alice").is_ok());
    }

    fn users() -> Users {
        Users {
            users: vec![
                UserInfo {
                    name: "root".into(),
                    uid: 0,
                    gid: 0,
                    home: "/root".into(),
                },
                UserInfo {
                    name: "user".into(),
                    uid: 1000,
                    gid: 1000,
                    home: "/home/user".into(),
                },
            ],
            groups: vec![GroupInfo {
                name: "user".into(),
                gid: 1000,
            }],
            default_user: Some("root".into()),
        }
    }

    #[test]
    fn paths_resolve_against_the_home() {
        let h = "/home/user";
        assert_eq!(resolve("a.txt", h).unwrap(), "/home/user/a.txt");
        assert_eq!(resolve("./d/../b", h).unwrap(), "/home/user/b");
        assert_eq!(resolve("~", h).unwrap(), "/home/user");
        assert_eq!(resolve("~/x/y", h).unwrap(), "/home/user/x/y");
        assert_eq!(resolve("", h).unwrap(), "/home/user");
        assert_eq!(resolve("/tmp//x/", h).unwrap(), "/tmp/x");
        assert_eq!(resolve("/../..", h).unwrap(), "/");
        assert_eq!(resolve("../../../etc", h).unwrap(), "/etc");
        assert!(resolve("~bob/x", h).is_err());
        assert!(resolve("a\0b", h).is_err());
        assert_eq!(parent("/home/user/a"), "/home/user");
        assert_eq!(parent("/a"), "/");
        assert_eq!(parent("/"), "/");
    }

    #[test]
    fn homes_fall_back_to_the_image_user_then_root_dir() {
        let u = users();
        assert_eq!(u.home("user"), "/home/user");
        assert_eq!(u.home("nobody"), "/root");
        assert_eq!(Users::default().home("user"), "/");
        assert_eq!(u.owner("user").as_deref(), Some("user"));
        assert_eq!(u.owner("nobody"), None);
    }

    #[test]
    fn permissions_read_as_go_prints_them() {
        assert_eq!(permissions(FsKind::File, 0o644), "-rw-r--r--");
        assert_eq!(permissions(FsKind::Dir, 0o755), "drwxr-xr-x");
        assert_eq!(permissions(FsKind::Symlink, 0o777), "Lrwxrwxrwx");
        assert_eq!(permissions(FsKind::File, 0o4755), "urwxr-xr-x");
        assert_eq!(permissions(FsKind::Dir, 0o1777), "dtrwxrwxrwx");
        assert_eq!(permissions(FsKind::CharDevice, 0o666), "Dcrw-rw-rw-");
    }

    #[test]
    fn entries_map_to_entry_info() {
        let e = FsEntry {
            name: "a.txt".into(),
            path: "/home/user/a.txt".into(),
            kind: FsKind::File,
            size: 5_000_000_000,
            mode: 0o644,
            uid: 1000,
            gid: 1000,
            mtime_ns: 1_700_000_000_123_000_000,
            target: None,
            target_kind: None,
            resolved: None,
            xattrs: [
                ("user.e2b.author".to_string(), "mish".to_string()),
                ("user.other".to_string(), "x".to_string()),
            ]
            .into_iter()
            .collect(),
        };
        let v = entry_info(&e, &users());
        assert_eq!(v["type"], "FILE_TYPE_FILE");
        assert_eq!(v["size"], "5000000000");
        assert_eq!(v["mode"], 0o644);
        assert_eq!(v["permissions"], "-rw-r--r--");
        assert_eq!(v["owner"], "user");
        assert_eq!(v["group"], "user");
        assert_eq!(v["modifiedTime"], "2023-11-14T22:13:20.123Z");
        assert!(v.get("symlinkTarget").is_none());
        assert_eq!(v["metadata"], json!({"author": "mish"}));
        let l = FsEntry {
            kind: FsKind::Symlink,
            uid: 7,
            gid: 8,
            target: Some("../etc".into()),
            xattrs: Default::default(),
            ..e
        };
        // Dangling: a symlink, its text.
        let v = entry_info(&l, &users());
        assert_eq!(v["type"], "FILE_TYPE_SYMLINK");
        assert_eq!(v["symlinkTarget"], "../etc");
        assert!(v.get("metadata").is_none());
        // Resolved: what it resolves to.
        let l = FsEntry {
            target_kind: Some(FsKind::Dir),
            resolved: Some("/etc".into()),
            ..l
        };
        let v = entry_info(&l, &users());
        assert_eq!(v["type"], "FILE_TYPE_DIRECTORY");
        assert_eq!(v["symlinkTarget"], "/etc");
        assert_eq!(
            (v["owner"].as_str(), v["group"].as_str()),
            (Some("7"), Some("8"))
        );
    }
}
