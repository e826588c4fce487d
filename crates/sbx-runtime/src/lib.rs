//! Isolation for sbx. Every syscall and every `unsafe` block of the project lives in this crate,
//! behind safe functions:
//! - [`driver`]: the [`Driver`] trait and the [`NamespaceDriver`] (the node's side);
//! - [`init`]: stages 0 and 1 of a sandbox, run by `sbx-agent init` (the sandbox's side);
//! - [`process`]: starting, reaping and signalling processes (the agent's side);
//! - [`cgroup`]: cgroups v1 and v2 behind one interface;
//! - [`criu`]: checkpoint and restore of a sandbox (sleep, wake, snapshots, forks) with the
//!   `criu` binary;
//! - [`seccomp`]: the sandbox's syscall filter;
//! - [`fsutil`]: ownership shifting of image trees;
//! - [`hostfs`]: the node's host-side locks and private directories;
//! - [`inotify`]: changes of directories (the agent's watches);
//! - [`net`]: sandbox networking: namespaces with a veth to the node, pooled; the node's
//!   nftables table; conntrack;
//! - [`netns`]: sockets made from the host in a sandbox's network namespace;
//! - [`sock`]: node-agent connections registered for what their task waits on only;
//! - [`tree`]: copies of a sandbox's upper directory (snapshots, forks).

pub mod cgroup;
pub mod criu;
pub mod diskfs;
pub mod driver;
pub mod fsutil;
pub mod hostfs;
pub mod init;
pub mod inotify;
pub mod net;
pub mod netns;
pub mod process;
pub mod rtset;
pub mod seccomp;
pub mod sock;
pub mod tree;
pub mod volume;
pub mod xattr;
pub mod zygote;

/// A directory of a test's own, removed when dropped (the test passed or not).
#[cfg(test)]
pub(crate) struct TempDir(std::path::PathBuf);

#[cfg(test)]
impl TempDir {
    /// `<tmp>/sbx-<tag>-<pid>`, made.
    pub(crate) fn new(tag: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!("sbx-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("mkdir a test's directory");
        TempDir(d)
    }

    pub(crate) fn path(&self) -> &std::path::Path {
        &self.0
    }
}

#[cfg(test)]
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub use cgroup::Limits;
pub use driver::{Driver, NamespaceDriver, Sandbox, SandboxSpec};

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("agent binary not found at {0}")]
    AgentMissing(PathBuf),
    #[error(transparent)]
    Cgroup(#[from] cgroup::CgroupError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("sandbox did not start: {0}")]
    Start(String),
    #[error(transparent)]
    Criu(#[from] criu::CriuError),
}
