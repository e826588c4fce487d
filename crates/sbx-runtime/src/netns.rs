//! Work done from the host inside a sandbox's network namespace: a socket made there stays
//! there, so the node can reach a sandbox's ports without running anything in the sandbox.

use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;

use nix::sched::CloneFlags;

/// Runs `f` on a new thread that has joined the network namespace of process `pid` (a
/// sandbox's agent), and returns what it returns. A socket `f` makes belongs to that
/// namespace for its whole life, wherever it is used afterwards. The thread ends with `f`, so
/// no thread of the caller is left in the sandbox's namespace. Blocks for the thread's life.
pub fn in_netns_of<T, F>(pid: i32, f: F) -> io::Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> io::Result<T> + Send + 'static,
{
    let ns = File::open(format!("/proc/{pid}/ns/net"))?;
    in_netns_of_handle(OwnedFd::from(ns), f)
}

/// [`in_netns_of`] with a handle instead of a pid: a pidfd (setns takes one since Linux 5.8;
/// a reused pid cannot redirect it) or a namespace file.
pub fn in_netns_of_handle<T, F>(ns: OwnedFd, f: F) -> io::Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> io::Result<T> + Send + 'static,
{
    std::thread::Builder::new()
        .name("sbx-netns".into())
        .spawn(move || {
            nix::sched::setns(&ns, CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
            f()
        })?
        .join()
        .map_err(|_| io::Error::other("the thread in the sandbox's network namespace panicked"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_closure_runs_in_the_namespace_named_and_the_caller_stays_in_its_own() {
        // Making a network namespace needs root; skip where the tests do not run as root.
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let ours = std::fs::read_link("/proc/thread-self/ns/net").map_err(|e| e.to_string());
        // A thread of its own unshares a new network namespace and hands out a handle on it.
        let made = std::thread::spawn(|| -> io::Result<(File, std::path::PathBuf)> {
            nix::sched::unshare(CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
            let link = std::fs::read_link("/proc/thread-self/ns/net")?;
            Ok((File::open("/proc/thread-self/ns/net")?, link))
        })
        .join()
        .expect("thread");
        let (ns, theirs) = made.expect("a new network namespace");
        assert_ne!(Ok(theirs.clone()), ours.clone(), "a namespace of its own");
        let seen = in_netns_of_handle(OwnedFd::from(ns), || {
            std::fs::read_link("/proc/thread-self/ns/net")
        })
        .expect("joined");
        assert_eq!(seen, theirs, "the closure ran in the namespace named");
        let after = std::fs::read_link("/proc/thread-self/ns/net").map_err(|e| e.to_string());
        assert_eq!(after, ours, "the caller did not move");
    }

    #[test]
    fn a_pidfd_names_the_namespace_too() {
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let me = crate::process::PidFd::open(std::process::id()).expect("pidfd");
        let ours = std::fs::read_link("/proc/self/ns/net").map_err(|e| e.to_string());
        let theirs = in_netns_of_handle(me.try_clone_fd().expect("dup"), || {
            std::fs::read_link("/proc/thread-self/ns/net")
        })
        .map_err(|e| e.to_string());
        assert_eq!(ours, theirs);
    }

    #[test]
    fn a_process_that_is_gone_is_an_error() {
        assert!(in_netns_of(i32::MAX, || Ok(())).is_err());
    }
}
