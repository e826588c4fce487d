//! The node: the sandbox table, the driver, and the actions the API (and later the functions
//! interface and the CLI) run. Handlers parse and validate; this module acts.

pub mod capacity;
pub mod checkpoint;
pub mod credentials;
pub mod dns;
pub mod egress;
#[cfg(test)]
pub(crate) mod fake;
pub mod files;
pub mod health;
mod machine;
pub mod net;
pub mod output;
mod run;
pub(crate) mod runtime_settings;
pub mod sandbox;
pub mod templates;
#[cfg(test)]
mod tests;
pub mod volume;
mod warm;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sbx_api::{ApiError, ErrorCode};
use sbx_runtime::{Driver, Sandbox};

use crate::image::{ImageStore, PullError};
use crate::sync::LockExt;

pub use machine::Machine;
pub use run::{RunEvent, RunPlan};
use warm::Warm;

/// The node's settings.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub data_dir: PathBuf,
    /// `--egress-default deny`: a sandbox's rules without `default` refuse what they do not
    /// allow.
    pub egress_default_deny: bool,
    pub default_memory_bytes: u64,
    pub default_vcpus: u32,
    pub pids_max: u32,
    pub max_memory_bytes: u64,
    pub max_vcpus: u32,
    /// Sandboxes of the base image kept made ahead, so that a run does not wait for one.
    pub warm_pool: usize,
    /// Commands one sandbox may run at once.
    pub max_execs_per_sandbox: usize,
    /// When set, only these image names boot (the config file's image_allowlist, with the
    /// local images its custom images boot as).
    pub image_allowlist: Option<Vec<String>>,
    /// The most sandboxes (runs' and kept ones) the node holds at once (`capacity.rs`).
    pub max_sandboxes: usize,
    /// Free bytes of the data disk under which `/healthz` answers 503.
    pub min_free_disk_bytes: u64,
    /// How long a kept sandbox may be idle before it pauses, where its create said nothing
    /// (`--sleep-after-seconds`; `None`: never).
    pub sleep_after: Option<Duration>,
    /// How long a kept sandbox stays paused before it sleeps for real, where its create gives
    /// no suspend_after_ms (`--suspend-after-seconds`).
    pub suspend_after: Duration,
    /// Below this much available memory (the host's MemAvailable), paused sandboxes sleep
    /// before their suspend_after_ms, the longest paused first (`--sleep-memory-below-bytes`;
    /// 0: never for memory).
    pub sleep_memory_below: u64,
}

/// A sandbox in the table.
#[derive(Debug, Clone)]
struct Entry {
    name: Option<String>,
}

#[derive(Default)]
struct Table {
    by_id: HashMap<String, Entry>,
    names: HashMap<String, String>,
}

pub struct Node {
    pub cfg: NodeConfig,
    pub(crate) store: crate::store::Store,
    pub(crate) templates: crate::node::templates::Templates,
    pub(crate) managed: Mutex<HashMap<String, Arc<crate::node::sandbox::Managed>>>,
    warm: Mutex<Vec<Warm>>,
    refilling: AtomicBool,
    /// The warm sandbox the refiller is making (its directory and cgroups exist before it is
    /// ready): the node's own, never a run's leftover.
    warm_making: Mutex<Option<String>>,
    pub(crate) driver: Arc<dyn Driver>,
    pub(crate) images: ImageStore,
    table: Mutex<Table>,
    /// Held from a sandbox's capacity check (`max_sandboxes`) to its entry in the table (a
    /// run's) or among the kept ones: two sandboxes admitted at once cannot both take the last
    /// place.
    admission: Mutex<()>,
    live: Mutex<HashMap<String, Arc<Sandbox>>>,
    teardowns: AtomicUsize,
    /// Set when the node stops: no sandbox is made from then on.
    stopping: AtomicBool,
    /// The node's network (none: every sandbox has `lo` only); set once at start.
    pub(crate) net: std::sync::OnceLock<Arc<net::NodeNet>>,
    /// The preview listener (none: it is off); set once, when it is bound.
    pub(crate) preview: std::sync::OnceLock<crate::node::sandbox::PreviewSettings>,
    /// Whether (and with what) the node checkpoints sandboxes; set once at start.
    pub(crate) checkpoints: std::sync::OnceLock<checkpoint::Checkpoints>,
    /// The last answer of the health checks (`health.rs`).
    health: health::HealthCache,
    /// Where `max_sandboxes` comes from (`capacity.rs`); set once at start.
    pub(crate) capacity: std::sync::OnceLock<capacity::Capacity>,
    /// The node's disk and the runs' volumes (none: no volumes).
    pub(crate) volumes: volume::Volumes,
}

pub(crate) fn stopping_error() -> ApiError {
    ApiError::new(
        ErrorCode::Unavailable,
        "the node is stopping: its sandboxes are ended",
    )
}

/// A run's pull that failed: 409 sandbox_failed, the failure code first in the message.
pub(crate) fn pull_refused(reference: &str, e: &PullError) -> ApiError {
    tracing::info!(image = %reference, error = %e, "pull failed");
    ApiError::new(
        ErrorCode::SandboxFailed,
        format!("{}: image {reference}: {e}", e.code()),
    )
    .with_param("image")
}

/// `map_err` for a failure the caller can do nothing about: logged with its cause (`what`
/// failed), answered 500 internal, whose message sends the reader to the log.
pub(crate) fn internal<E: std::fmt::Display>(what: &'static str) -> impl FnOnce(E) -> ApiError {
    move |e| {
        tracing::error!(error = %e, "{what}");
        ApiError::internal()
    }
}

fn not_served(param: &str, what: &str) -> ApiError {
    ApiError::new(
        ErrorCode::NotServedHere,
        format!("this node does not serve {what} yet"),
    )
    .with_param(param)
}

impl Node {
    /// Gives the node its network (once, at start): sandboxes made from then on that have
    /// network get a namespace of it.
    pub fn set_net(&self, net: Arc<net::NodeNet>) {
        let _ = self.net.set(net);
    }

    /// Gives back sandbox `id`'s network namespace, if it has one (after its processes are
    /// gone).
    pub(crate) fn release_net(&self, id: &str) {
        if let Some(n) = self.net.get() {
            n.release(id, false);
        }
    }

    /// [`Node::release_net`] of a sandbox the driver destroyed: its namespace may be used
    /// again.
    pub(crate) fn recycle_net(&self, id: &str) {
        if let Some(n) = self.net.get() {
            n.release(id, true);
        }
    }

    /// Whether sandboxes of the HTTP API have network (the node has one).
    /// Sets what the node checkpoints sandboxes with (once, at start).
    pub fn set_checkpoints(&self, c: checkpoint::Checkpoints) {
        c.set_data_dir(&self.cfg.data_dir);
        let _ = self.checkpoints.set(c);
    }

    /// For `GET /internal/node`.
    pub fn checkpoints_info(&self) -> serde_json::Value {
        match self.checkpoints.get() {
            Some(c) => c.info(),
            None => serde_json::json!({ "available": false, "reason": "not checked yet" }),
        }
    }

    pub fn has_net(&self) -> bool {
        self.net.get().is_some()
    }

    pub fn new(
        cfg: NodeConfig,
        driver: Arc<dyn Driver>,
        images: ImageStore,
        store: crate::store::Store,
        templates: crate::node::templates::Templates,
    ) -> Arc<Node> {
        Arc::new(Node {
            cfg,
            store,
            templates,
            managed: Mutex::new(HashMap::new()),
            warm: Mutex::new(Vec::new()),
            refilling: AtomicBool::new(false),
            warm_making: Mutex::new(None),
            driver,
            images,
            table: Mutex::new(Table::default()),
            admission: Mutex::new(()),
            live: Mutex::new(HashMap::new()),
            teardowns: AtomicUsize::new(0),
            stopping: AtomicBool::new(false),
            net: std::sync::OnceLock::new(),
            preview: std::sync::OnceLock::new(),
            checkpoints: std::sync::OnceLock::new(),
            health: health::HealthCache::default(),
            capacity: std::sync::OnceLock::new(),
            volumes: volume::Volumes::default(),
        })
    }

    pub(crate) fn sandboxes_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("sandboxes")
    }

    /// Removes what a previous run of the node left that the table does not keep: the
    /// sandboxes of runs and the warm pool (call after `recover`).
    pub fn reconcile(&self) -> usize {
        // Sandboxes that run, and sleeping ones (their cgroups wait for their wake).
        let mut kept = self.kept_ids();
        kept.extend(
            self.managed
                .locked()
                .values()
                .filter(|m| m.status() == sbx_api::SandboxStatus::Sleeping)
                .map(|m| m.id.clone()),
        );
        let known: std::collections::HashSet<String> =
            self.managed.locked().keys().cloned().collect();
        let mut n = 0;
        let mut busy = Vec::new();
        for id in self.driver.list_groups() {
            if kept.contains(&id) {
                continue;
            }
            if let Err(e) = self.driver.remove_leftovers(&id) {
                tracing::info!(sandbox = %id, error = %e, "a leftover cgroup is still busy: tried again in the background");
                busy.push(id);
            }
            n += 1;
        }
        if !busy.is_empty() {
            // Its last process is a zombie its new parent (the host's init, after a kill -9 of
            // the node) has not reaped yet: the group goes once it has.
            let driver = self.driver.clone();
            std::thread::spawn(move || {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
                while !busy.is_empty() && std::time::Instant::now() < deadline {
                    std::thread::sleep(std::time::Duration::from_millis(200));
                    busy.retain(|id| driver.remove_leftovers(id).is_err());
                }
                for id in busy {
                    tracing::warn!(sandbox = %id, "cannot remove a leftover cgroup");
                }
            });
        }
        if let Ok(rd) = std::fs::read_dir(self.sandboxes_dir()) {
            for e in rd.flatten() {
                if e.file_name().to_str().is_some_and(|id| known.contains(id)) {
                    continue;
                }
                let _ = sbx_runtime::driver::remove_dir(&e.path());
                n += 1;
            }
        }
        // The folders of an older layout go once nothing of theirs is adopted.
        for dir in self.driver.tidy_old_layout() {
            tracing::info!(folder = %dir.display(), "removed the empty cgroup folder of the old layout");
        }
        n
    }

    pub(crate) fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    pub fn driver_name(&self) -> &'static str {
        self.driver.name()
    }

    /// Sandboxes in use by runs now (not counting warm ones).
    pub fn sandbox_count(&self) -> usize {
        self.table.locked().by_id.len()
    }

    /// Sandboxes the node holds against `max_sandboxes`: runs' and kept ones (of every status),
    /// not the warm pool's.
    pub fn held_sandboxes(&self) -> usize {
        self.sandbox_count() + self.managed.locked().len()
    }

    /// Sets where `max_sandboxes` comes from (once, at start), for `GET /internal/node`.
    pub fn set_capacity(&self, c: capacity::Capacity) {
        let _ = self.capacity.set(c);
    }

    /// Teardowns still under way.
    pub fn pending_teardowns(&self) -> usize {
        self.teardowns.load(Ordering::SeqCst)
    }

    pub(crate) fn release(&self, id: &str) {
        let mut t = self.table.locked();
        if let Some(e) = t.by_id.remove(id) {
            if let Some(n) = e.name {
                t.names.remove(&n);
            }
        }
    }

    pub(crate) fn live_insert(&self, sb: &Arc<Sandbox>) {
        self.live.locked().insert(sb.id.clone(), sb.clone());
    }

    pub(crate) fn live_remove(&self, id: &str) {
        self.live.locked().remove(id);
    }

    /// Reserves a name for sandbox `id` (409 name_taken when another has it).
    pub(crate) fn reserve_name(&self, name: Option<&str>, id: &str) -> Result<(), ApiError> {
        let Some(n) = name else {
            return Ok(());
        };
        let mut t = self.table.locked();
        match t.names.get(n) {
            Some(other) if other != id => Err(ApiError::new(
                ErrorCode::NameTaken,
                format!("a sandbox is named {n}"),
            )
            .with_param("name")),
            _ => {
                t.names.insert(n.to_string(), id.to_string());
                Ok(())
            }
        }
    }

    pub(crate) fn release_name(&self, name: Option<&str>) {
        if let Some(n) = name {
            self.table.locked().names.remove(n);
        }
    }

    /// Ends every sandbox (the node is stopping) and waits for their teardown.
    pub async fn shutdown(self: &Arc<Self>) {
        self.stopping.store(true, Ordering::SeqCst);
        self.drain_warm();
        let all: Vec<Arc<Sandbox>> = self.live.locked().drain().map(|(_, s)| s).collect();
        for sb in all {
            self.teardown(sb);
        }
        for _ in 0..3000 {
            if self.pending_teardowns() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Kept sandboxes run on (the next node adopts them): their groups keep the folder,
        // and the network's table keeps them fenced in. With none, nothing of the node stays.
        self.driver.release();
        // criu's workers hold copies of the node's mounts (its disk among them).
        if let Some(c) = self.checkpoints.get() {
            c.stop();
        }
        self.release_disk();
        if let Some(net) = self.net.get() {
            let kept_running = self
                .managed
                .locked()
                .values()
                .any(|m| m.machine.locked().is_some());
            if kept_running {
                net.leave_running();
            } else {
                net.uninstall();
            }
        }
    }
}
