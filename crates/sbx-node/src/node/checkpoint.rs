//! The node's side of checkpoints (sbx-runtime's `criu` does the work): whether this node can
//! put sandboxes to sleep, snapshot and fork them, and the one interface the sandbox verbs
//! (`sandbox/sleep.rs`, `sandbox/snapshot.rs`) call, so that a node test can put a fake in its
//! place.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sbx_api::{ApiError, ErrorCode};
use sbx_runtime::driver::{NamespaceDriver, SandboxSpec};
use sbx_runtime::Sandbox;

/// What checkpoints a sandbox's processes and restores them. Every call blocks (hundreds of
/// milliseconds): call it from a blocking thread.
pub trait Checkpointer: Send + Sync {
    /// What does it, for `GET /internal/node` (`criu 4.2.1`).
    fn describe(&self) -> String;
    /// Freezes `sb`, saves its processes into `images` and ends them: its memory is freed.
    /// `network`: it is in a leased namespace (kept meanwhile). On failure the sandbox runs on
    /// as it was.
    fn sleep(&self, sb: &Sandbox, images: &Path, network: bool) -> Result<(), String>;
    /// Makes the sandbox `spec` describes (its directory, cgroups and network as before the
    /// sleep) go on from `images`. Returns it running, its agent listening again.
    fn wake(
        &self,
        spec: &SandboxSpec,
        images: &Path,
        net: Option<NetPlace>,
    ) -> Result<Sandbox, String>;
    /// Saves `sb`'s processes into `dir/images` and its files into `dir/upper` while it is
    /// frozen, then lets it run on. Returns the bytes `dir` takes.
    fn snapshot(&self, sb: &Sandbox, dir: &Path, network: bool) -> Result<u64, String>;
    /// Makes a new sandbox (`spec`: its own id, directory, cgroups and network) that goes on
    /// from the snapshot at `dir`: its files a copy of the snapshot's, its established
    /// connections dropped.
    fn restore_copy(
        &self,
        spec: &SandboxSpec,
        dir: &Path,
        net: Option<NetPlace>,
    ) -> Result<Sandbox, String>;
    /// The node is stopping: what the checkpointer keeps ready ends (nothing by default).
    fn stop(&self) {}
    /// The node's data directory: what the checkpointer keeps ready holds its disk and no
    /// other node's (nothing by default).
    fn set_data_dir(&self, _dir: &Path) {}
}

/// How a restored sandbox gets its network again: from its lease.
pub(crate) type NetPlace = sbx_runtime::net::Relink;

/// This node's checkpoints: a checkpointer, or why there is none.
pub enum Checkpoints {
    Ready(std::sync::Arc<dyn Checkpointer>),
    Off(String),
}

impl Checkpoints {
    /// The checkpointer, or 503 not_served_here saying why there is none.
    pub fn get(&self) -> Result<std::sync::Arc<dyn Checkpointer>, ApiError> {
        match self {
            Checkpoints::Ready(c) => Ok(c.clone()),
            Checkpoints::Off(why) => Err(ApiError::new(
                ErrorCode::NotServedHere,
                format!("this node does not checkpoint sandboxes (sleep, snapshots, forks): {why}"),
            )),
        }
    }

    /// The node's data directory ([`Checkpointer::set_data_dir`]).
    pub(crate) fn set_data_dir(&self, dir: &Path) {
        if let Checkpoints::Ready(c) = self {
            c.set_data_dir(dir);
        }
    }

    /// The node is stopping ([`Checkpointer::stop`]).
    pub fn stop(&self) {
        if let Checkpoints::Ready(c) = self {
            c.stop();
        }
    }

    /// For `GET /internal/node`.
    pub fn info(&self) -> CheckpointsInfo {
        match self {
            Checkpoints::Ready(c) => CheckpointsInfo {
                available: true,
                by: Some(c.describe()),
                reason: None,
            },
            Checkpoints::Off(why) => CheckpointsInfo::off(why),
        }
    }
}

/// Whether the node checkpoints sandboxes (sleep, snapshots, forks), with what, or why not
/// (`checkpoints` of `GET /internal/node`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CheckpointsInfo {
    pub available: bool,
    /// What checkpoints them (`criu 4.0.0 (/usr/sbin/criu)`), when available.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    /// Why not, when not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl CheckpointsInfo {
    /// Not available, for `reason`.
    pub(crate) fn off(reason: &str) -> CheckpointsInfo {
        CheckpointsInfo {
            available: false,
            by: None,
            reason: Some(reason.to_string()),
        }
    }
}

/// Where a sleeping sandbox's processes are kept: `DATA_DIR/sleep/<id>`, beside its disk and
/// not on it: not counted in its disk's size, and not flushed with it (when a sleep ends the
/// sandbox's overlay, the kernel syncs the filesystem under it: with the images there, all
/// of its memory just written, ~200 ms). A sandbox put to sleep by an older node has them in
/// its own directory (`<sandbox dir>/sleep`): that place is used while they are there.
pub fn images_dir(data_dir: &Path, id: &str) -> PathBuf {
    let old = data_dir.join("sandboxes").join(id).join("sleep");
    if old.is_dir() {
        return old;
    }
    data_dir.join("sleep").join(id)
}

/// Renames the images of a finished wake out of the way (`<images>.spent-<nanos>`, beside
/// them), to be removed later: a sleep that comes at once writes `images` again while the
/// removal may still run. `None` when the rename failed (then they are removed in place at
/// the next sleep or the delete).
pub(crate) fn set_aside(images: &Path) -> Option<PathBuf> {
    let name = images.file_name()?.to_string_lossy().into_owned();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let spent = images.with_file_name(format!("{name}.spent-{nanos}"));
    std::fs::rename(images, &spent).ok().map(|()| spent)
}

/// Removes what [`set_aside`] left beside `images` (a node that stopped before removing it).
pub(crate) fn remove_spent(images: &Path) {
    let (Some(dir), Some(name)) = (images.parent(), images.file_name()) else {
        return;
    };
    let prefix = format!("{}.spent-", name.to_string_lossy());
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_name().to_string_lossy().starts_with(&prefix) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Before a checkpoint of `sb`: every process of the sandbox but its agent is frozen, then
/// the agent is told (it lets itself be dumped) and frozen with them; no connection of the
/// node's to it stays open (an open one is a peer outside the sandbox, which a checkpoint
/// cannot take). The agent is dumpable only while nothing else of the sandbox runs: a process
/// of the sandbox would otherwise ptrace it (or read its memory) in that window. The sandbox
/// stays frozen until [`after`].
pub async fn before(sb: &Arc<Sandbox>) -> Result<(), String> {
    crate::agent::close_idle(&sb.socket);
    let s = sb.clone();
    let held = tokio::task::spawn_blocking(move || s.freeze_all_but_agent())
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string());
    let held = match held {
        Ok(h) => h,
        Err(e) => {
            sb.thaw();
            return Err(e);
        }
    };
    let r = crate::agent::set_dumpable(&sb.socket, true).await;
    crate::agent::close_idle(&sb.socket);
    if let Some(h) = held {
        let rejoined = tokio::task::spawn_blocking(move || h.rejoin())
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()));
        if let Err(e) = rejoined {
            // The agent would run dumpable while the rest thaws: it is told first.
            crate::agent::set_dumpable(&sb.socket, false).await.ok();
            sb.thaw();
            return Err(e);
        }
    }
    if let Err(e) = r {
        after(sb).await.ok();
        return Err(e.to_string());
    }
    Ok(())
}

/// After a checkpoint of `sb` (it runs on, it woke, or the checkpoint failed): its agent is
/// not dumpable again before anything else of the sandbox runs. A sandbox the checkpoint left
/// frozen (a snapshot, a failed dump) has its agent moved out of the frozen group, made not
/// dumpable, moved back, and then the whole is thawed; a restored one came back with its agent
/// not dumpable already (`sbx_runtime::criu` restores it so) and is told again.
pub async fn after(sb: &Sandbox) -> Result<(), String> {
    let held = match sb.hold_agent_if_frozen() {
        Ok(h) => h,
        Err(e) => {
            // Thawed all the same: a sandbox is never left frozen by a checkpoint.
            tracing::error!(sandbox = %sb.id, error = %e, "the agent out of its frozen group");
            None
        }
    };
    let r = crate::agent::set_dumpable(&sb.socket, false).await;
    if let Some(h) = held {
        if let Err(e) = h.rejoin() {
            tracing::error!(sandbox = %sb.id, error = %e, "the agent back into its group");
        }
    }
    sb.thaw();
    r.map_err(|e| e.to_string())
}

/// CRIU with the namespace driver: what a node of this machine checkpoints with.
pub struct Criu {
    criu: sbx_runtime::criu::Criu,
    driver: Arc<NamespaceDriver>,
}

/// This node's checkpoints: CRIU at `bin` (a name is looked up in PATH) if it is 4.2 or
/// newer and `criu check` passes, else why not. Blocking (tens of milliseconds).
pub fn detect(bin: &Path, driver: Arc<NamespaceDriver>) -> Checkpoints {
    match sbx_runtime::criu::detect(bin) {
        Ok(criu) => Checkpoints::Ready(Arc::new(Criu { criu, driver })),
        Err(e) => Checkpoints::Off(e.to_string()),
    }
}

impl Checkpointer for Criu {
    fn stop(&self) {
        self.criu.stop_workers();
    }

    fn set_data_dir(&self, dir: &Path) {
        self.criu.set_data_dirs(&[dir.to_path_buf()]);
    }

    fn describe(&self) -> String {
        let (a, b, c) = self.criu.version;
        format!("criu {a}.{b}.{c} ({})", self.criu.bin.display())
    }

    fn sleep(&self, sb: &Sandbox, images: &Path, network: bool) -> Result<(), String> {
        self.driver
            .sleep(sb, &self.criu, images, network)
            .map_err(|e| e.to_string())
    }

    fn wake(
        &self,
        spec: &SandboxSpec,
        images: &Path,
        net: Option<NetPlace>,
    ) -> Result<Sandbox, String> {
        self.driver
            .wake_at(spec, &self.criu, images, net)
            .map_err(|e| e.to_string())
    }

    fn snapshot(&self, sb: &Sandbox, dir: &Path, network: bool) -> Result<u64, String> {
        self.driver
            .snapshot(sb, &self.criu, dir, network)
            .map_err(|e| e.to_string())
    }

    fn restore_copy(
        &self,
        spec: &SandboxSpec,
        dir: &Path,
        net: Option<NetPlace>,
    ) -> Result<Sandbox, String> {
        self.driver
            .restore_copy(spec, &self.criu, dir, net)
            .map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spent_images_are_set_aside_and_a_new_sleep_s_are_not_touched() {
        let dir = std::env::temp_dir().join(format!("sbx-spent-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let images = dir.join("sbx-a");
        std::fs::create_dir_all(&images).expect("mkdir");
        std::fs::write(images.join("pages-1.img"), b"old").expect("write");
        let spent = set_aside(&images).expect("set aside");
        assert!(!images.exists() && spent.join("pages-1.img").is_file());
        // The next sleep writes its images where they were; the spent ones go, not these.
        std::fs::create_dir_all(&images).expect("mkdir");
        std::fs::write(images.join("pages-1.img"), b"new").expect("write");
        std::fs::create_dir_all(dir.join("sbx-ab.spent-1")).expect("another sandbox's");
        remove_spent(&images);
        assert!(!spent.exists(), "the spent images are gone");
        assert_eq!(
            std::fs::read(images.join("pages-1.img")).expect("read"),
            b"new"
        );
        assert!(
            dir.join("sbx-ab.spent-1").exists(),
            "another sandbox's are not"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
