//! Users of the sandbox, from its own /etc/passwd and /etc/group.

use std::fs;
use std::os::unix::fs::MetadataExt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    pub home: String,
    pub name: Option<String>,
}

struct PwEntry {
    name: String,
    uid: u32,
    gid: u32,
    home: String,
}

fn passwd(text: &str) -> Vec<PwEntry> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            Some(PwEntry {
                name: f.first()?.to_string(),
                uid: f.get(2)?.parse().ok()?,
                gid: f.get(3)?.parse().ok()?,
                home: f.get(5).unwrap_or(&"/").to_string(),
            })
        })
        .collect()
}

fn supplementary(group_text: &str, name: &str, gid: u32) -> Vec<u32> {
    let mut out = vec![gid];
    for l in group_text.lines() {
        let f: Vec<&str> = l.split(':').collect();
        let (Some(g), Some(members)) = (f.get(2).and_then(|g| g.parse().ok()), f.get(3)) else {
            continue;
        };
        if members.split(',').any(|m| m == name) && !out.contains(&g) {
            out.push(g);
        }
    }
    out
}

/// Root as it is when /etc/passwd does not say (missing, empty, garbage, or without a root
/// line): uid 0, gid 0, home /root.
fn root() -> User {
    User {
        uid: 0,
        gid: 0,
        groups: vec![0],
        home: "/root".into(),
        name: Some("root".into()),
    }
}

/// Resolves a user as a name, a uid or uid:gid. `None`: no such user. `root` and uid 0 always
/// resolve: the sandbox's own files (which its commands may break) cannot lock root out.
pub fn resolve(spec: &str, passwd_text: &str, group_text: &str) -> Option<User> {
    let entries = passwd(passwd_text);
    // Root must resolve whatever the files say; a root line that names another uid (or a
    // uid 0 line under another name) does not count.
    if spec == "root" && !entries.iter().any(|e| e.name == "root" && e.uid == 0) {
        return Some(root());
    }
    if spec.parse::<u32>() == Ok(0) && !entries.iter().any(|e| e.uid == 0) {
        return Some(root());
    }
    if let Some((u, g)) = spec.split_once(':') {
        let uid: u32 = u.parse().ok()?;
        let gid: u32 = g.parse().ok()?;
        let e = entries.iter().find(|e| e.uid == uid);
        return Some(User {
            uid,
            gid,
            groups: vec![gid],
            home: e.map(|e| e.home.clone()).unwrap_or_else(|| "/".into()),
            name: e.map(|e| e.name.clone()),
        });
    }
    if let Ok(uid) = spec.parse::<u32>() {
        return Some(match entries.iter().find(|e| e.uid == uid) {
            Some(e) => User {
                uid,
                gid: e.gid,
                groups: supplementary(group_text, &e.name, e.gid),
                home: e.home.clone(),
                name: Some(e.name.clone()),
            },
            None => User {
                uid,
                gid: uid,
                groups: vec![uid],
                home: "/".into(),
                name: None,
            },
        });
    }
    let e = entries.iter().find(|e| e.name == spec)?;
    Some(User {
        uid: e.uid,
        gid: e.gid,
        groups: supplementary(group_text, &e.name, e.gid),
        home: e.home.clone(),
        name: Some(e.name.clone()),
    })
}

/// What identifies one version of a file: a file changed since has another stamp (its change
/// time moves with any write, and a replaced file is another inode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    size: u64,
    ctime: (i64, i64),
    mtime: (i64, i64),
}

/// A stamp to trust for caching: the file's, unless it changed within the last second (file
/// times may be coarser than the writes they stamp, so a fresh one is not trusted yet).
fn settled_stamp(path: &str) -> Option<Stamp> {
    let m = fs::metadata(path).ok()?;
    let stamp = Stamp {
        dev: m.dev(),
        ino: m.ino(),
        size: m.len(),
        ctime: (m.ctime(), m.ctime_nsec()),
        mtime: (m.mtime(), m.mtime_nsec()),
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_secs() as i64;
    (stamp.ctime.0 < now - 1 && stamp.mtime.0 < now - 1).then_some(stamp)
}

/// The most of /etc/passwd or /etc/group that is read.
const MAX_FILE: u64 = 4 << 20;

/// A user database file as text: empty unless it is a regular file (a FIFO or a device put in
/// its place does not block or flood the agent), its first [`MAX_FILE`] bytes.
fn read_small(path: &str) -> String {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(f) = fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_NONBLOCK.bits())
        .open(path)
    else {
        return String::new();
    };
    if !f.metadata().map(|m| m.is_file()).unwrap_or(false) {
        return String::new();
    }
    let mut bytes = Vec::new();
    if f.take(MAX_FILE).read_to_end(&mut bytes).is_err() {
        return String::new();
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// What was read of /etc/passwd and /etc/group while they kept these stamps: their texts and
/// the users resolved against them so far.
struct Cached {
    stamps: (Stamp, Stamp),
    passwd: String,
    group: String,
    resolved: std::collections::HashMap<String, Option<User>>,
}

thread_local! {
    static FILES: std::cell::RefCell<Option<Cached>> = const { std::cell::RefCell::new(None) };
}

/// Resolves against the sandbox's own files. They are read (and a user resolved) again only
/// when they changed: two stats per command instead of two reads and a parse.
pub fn lookup(spec: &str) -> Option<User> {
    let stamps = settled_stamp("/etc/passwd").zip(settled_stamp("/etc/group"));
    FILES.with_borrow_mut(|cache| {
        let hit = match (cache.as_ref(), stamps) {
            (Some(c), Some(now)) => c.stamps == now,
            _ => false,
        };
        if !hit {
            let passwd = read_small("/etc/passwd");
            let group = read_small("/etc/group");
            let user = resolve(spec, &passwd, &group);
            // Kept only when both files are settled; else read again next time.
            *cache = stamps.map(|stamps| Cached {
                stamps,
                passwd,
                group,
                resolved: [(spec.to_string(), user.clone())].into_iter().collect(),
            });
            return user;
        }
        let c = cache.as_mut()?;
        if let Some(user) = c.resolved.get(spec) {
            return user.clone();
        }
        let user = resolve(spec, &c.passwd, &c.group);
        // Bounded: a caller naming ever new users cannot grow it without end.
        if c.resolved.len() < 256 {
            c.resolved.insert(spec.to_string(), user.clone());
        }
        user
    })
}

/// The users and groups of the sandbox's files (at most [`MAX_TABLE`] of each) and the
/// image's user: the answer of `FsOp::Users`.
pub fn table(default_user: Option<String>) -> sbx_proto::FsResult {
    let users = passwd(&read_small("/etc/passwd"))
        .into_iter()
        .take(MAX_TABLE)
        .map(|e| sbx_proto::UserInfo {
            name: e.name,
            uid: e.uid,
            gid: e.gid,
            home: e.home,
        })
        .collect();
    let groups = read_small("/etc/group")
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            Some(sbx_proto::GroupInfo {
                name: f.first()?.to_string(),
                gid: f.get(2)?.parse().ok()?,
            })
        })
        .take(MAX_TABLE)
        .collect();
    sbx_proto::FsResult::Users {
        users,
        groups,
        default_user,
    }
}

/// The most users (and groups) [`table`] answers.
const MAX_TABLE: usize = 4096;

#[cfg(test)]
mod tests {
    use super::*;

    const P: &str = "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:n:/nonexistent:/usr/sbin/nologin\nalice:x:1000:1000::/home/alice:/bin/sh\n";
    const G: &str = "root:x:0:\nstaff:x:50:alice\nalice:x:1000:\n";

    #[test]
    fn resolves_names_uids_and_pairs() {
        let a = resolve("alice", P, G).unwrap();
        assert_eq!(
            (a.uid, a.gid, a.groups.clone()),
            (1000, 1000, vec![1000, 50])
        );
        assert_eq!(a.home, "/home/alice");
        assert_eq!(resolve("0", P, G).unwrap().home, "/root");
        let n = resolve("4242", P, G).unwrap();
        assert_eq!((n.uid, n.gid, n.home.as_str()), (4242, 4242, "/"));
        let pair = resolve("1000:50", P, G).unwrap();
        assert_eq!((pair.uid, pair.gid), (1000, 50));
        assert!(resolve("mallory", P, G).is_none());
        assert!(resolve("x:y", P, G).is_none());
    }

    #[test]
    fn root_always_resolves() {
        let root = User {
            uid: 0,
            gid: 0,
            groups: vec![0],
            home: "/root".into(),
            name: Some("root".into()),
        };
        for text in [
            "",
            "garbage\n\0\0:::::\n",
            "root:x:zero:0:root:/root:/bin/sh\n",
            "root:x:1000:1000::/home/evil:/bin/sh\n",
            "alice:x:1000:1000::/home/alice:/bin/sh\n",
        ] {
            assert_eq!(resolve("root", text, "").as_ref(), Some(&root), "{text:?}");
            assert_eq!(resolve("0", text, "").as_ref(), Some(&root), "{text:?}");
        }
        // Others still need their line.
        assert!(resolve("alice", "", "").is_none());
        // A file that names root is read as it is.
        assert_eq!(
            resolve("root", P, G).map(|u| u.home).as_deref(),
            Some("/root")
        );
    }

    #[test]
    fn only_regular_files_are_read() {
        let dir = std::env::temp_dir().join(format!("sbx-users-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        // A FIFO with no writer would block a plain open: it is read as empty.
        assert_eq!(read_small(fifo.to_str().unwrap()), "");
        assert_eq!(read_small(dir.to_str().unwrap()), "");
        let f = dir.join("passwd");
        fs::write(&f, P).unwrap();
        assert_eq!(read_small(f.to_str().unwrap()), P);
        fs::remove_dir_all(&dir).unwrap();
    }
}
