//! Making network namespaces, and sysctls inside one.

use std::fs::File;
use std::io::Write;
use std::os::fd::OwnedFd;

use nix::sched::{unshare, CloneFlags};

use super::nl::Conn;
use super::{link, NetError};

/// Makes a new network namespace on a thread of its own (the caller's thread never changes
/// namespace), brings its `lo` up, runs `setup` there, inside it, and returns a handle on the
/// namespace (its only reference once the thread has ended) and a rtnetlink socket of the
/// namespace, which stays bound to it wherever it is used afterwards. The namespace is the
/// host's user namespace's (for a test's "node" and "outside"; a sandbox's is
/// [`make_owned`]).
pub(crate) fn make<F>(setup: F) -> Result<(OwnedFd, Conn), NetError>
where
    F: FnOnce() -> Result<(), NetError> + Send + 'static,
{
    on_thread(move || {
        unshare(CloneFlags::CLONE_NEWNET).map_err(|e| NetError::Io {
            what: "unshare a network namespace".into(),
            source: e.into(),
        })?;
        let ns = File::open("/proc/thread-self/ns/net").map_err(|e| NetError::Io {
            what: "open the new network namespace".into(),
            source: e,
        })?;
        let conn = configure(setup)?;
        Ok((OwnedFd::from(ns), conn))
    })
}

/// [`make`] of a sandbox's network namespace: owned by a new user namespace that maps
/// `(base, count)` (sandbox root is host uid `base`), so that the sandbox owns it and a
/// checkpoint can dump it. The caller holds the network namespace; it holds its user
/// namespace.
pub(crate) fn make_owned<F>(ids: (u32, u32), setup: F) -> Result<(OwnedFd, Conn), NetError>
where
    F: FnOnce() -> Result<(), NetError> + Send + 'static,
{
    let ns = crate::process::userns_with_netns(ids).map_err(|e| NetError::Io {
        what: "make a user and a network namespace".into(),
        source: e,
    })?;
    let theirs = ns.try_clone().map_err(|e| NetError::Io {
        what: "dup".into(),
        source: e,
    })?;
    let conn = within(theirs, move || configure(setup))?;
    Ok((ns, conn))
}

/// In the calling thread's new network namespace: `lo` up, then `setup`; a rtnetlink socket
/// of the namespace.
fn configure<F>(setup: F) -> Result<Conn, NetError>
where
    F: FnOnce() -> Result<(), NetError>,
{
    let mut conn = Conn::new(netlink_sys::protocols::NETLINK_ROUTE)?;
    // lo is always index 1 (LOOPBACK_IFINDEX) in a new namespace.
    link::set_up(&mut conn, 1)?;
    setup()?;
    Ok(conn)
}

/// Runs `f` on a new thread that has joined the network namespace `ns`, and returns what it
/// returns. The thread ends with `f`.
pub(crate) fn within<T, F>(ns: OwnedFd, f: F) -> Result<T, NetError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, NetError> + Send + 'static,
{
    on_thread(move || {
        nix::sched::setns(&ns, CloneFlags::CLONE_NEWNET).map_err(|e| NetError::Io {
            what: "join a network namespace".into(),
            source: e.into(),
        })?;
        drop(ns);
        f()
    })
}

fn on_thread<T, F>(f: F) -> Result<T, NetError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, NetError> + Send + 'static,
{
    std::thread::Builder::new()
        .name("sbx-netns".into())
        .spawn(f)
        .map_err(|e| NetError::Io {
            what: "start a thread".into(),
            source: e,
        })?
        .join()
        .map_err(|_| NetError::Io {
            what: "work in a network namespace".into(),
            source: std::io::Error::other("the thread panicked"),
        })?
}

/// Writes `value` to `/proc/sys/<key>` (key with '/') in the calling thread's network
/// namespace: /proc/sys/net resolves to the namespace of the thread that opens it.
pub(crate) fn sysctl(key: &str, value: &str) -> Result<(), NetError> {
    let path = format!("/proc/sys/{key}");
    let io = |e| NetError::Io {
        what: format!("write {path}"),
        source: e,
    };
    let mut f = File::options().write(true).open(&path).map_err(io)?;
    f.write_all(value.as_bytes()).map_err(io)
}

/// Reads `/proc/sys/<key>` in the calling thread's network namespace.
pub(crate) fn read_sysctl(key: &str) -> Result<String, NetError> {
    let path = format!("/proc/sys/{key}");
    std::fs::read_to_string(&path)
        .map(|s| s.trim().to_string())
        .map_err(|e| NetError::Io {
            what: format!("read {path}"),
            source: e,
        })
}
