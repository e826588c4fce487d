//! The node: the sandbox table, the driver, and the actions the API (and later the functions
//! interface and the CLI) run. Handlers parse and validate; this module acts.

pub mod capacity;
pub mod checkpoint;
pub mod credentials;
#[cfg(any(test, feature = "fake"))]
pub mod fake;
pub mod files;
pub mod health;
pub mod lease;
mod machine;
pub mod net;
pub mod output;
pub mod replica;
mod run;
pub(crate) mod runtime_settings;
pub mod sandbox;
pub mod templates;
pub mod terminal;
#[cfg(test)]
mod tests;
pub mod volume;
mod warm;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
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
    /// Sandboxes of the base image kept made ahead, so that a create (or a run) does not wait
    /// for one; each may become a kept sandbox.
    pub warm_pool: usize,
    /// Sandboxes of the base image made ahead for runs only (a run's own kind: volatile
    /// overlay, agent in PID 1's process), the only ones runs take; with 0, runs take
    /// `warm_pool`'s (`warm.rs`).
    pub warm_runs: usize,
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

/// How long a stop waits for the warm pool's refiller, then for the teardowns under way.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(30);

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
    pub(crate) store: Arc<crate::store::Store>,
    pub(crate) templates: crate::node::templates::Templates,
    pub(crate) managed: Mutex<HashMap<String, Arc<crate::node::sandbox::Managed>>>,
    warm: Mutex<Vec<Warm>>,
    /// True while the refiller runs (`warm.rs`); `shutdown` waits for it to turn false.
    refilling: tokio::sync::watch::Sender<bool>,
    /// The warm sandbox the refiller is making (its directory and cgroups exist before it is
    /// ready): the node's own, never a run's leftover.
    warm_making: Mutex<Option<String>>,
    pub(crate) driver: Arc<dyn Driver>,
    pub images: ImageStore,
    table: Mutex<Table>,
    /// Held from a sandbox's capacity check (`max_sandboxes`) to its entry in the table (a
    /// run's) or among the kept ones: two sandboxes admitted at once cannot both take the last
    /// place.
    admission: Mutex<()>,
    live: Mutex<HashMap<String, Arc<Sandbox>>>,
    /// Teardowns under way (`run.rs`); `shutdown` waits for none.
    teardowns: tokio::sync::watch::Sender<usize>,
    /// Set when the node stops: no sandbox is made from then on.
    stopping: AtomicBool,
    /// The node's network (none: every sandbox has `lo` only).
    pub(crate) net: Option<Arc<net::NodeNet>>,
    /// The preview listener (none: it is off).
    pub(crate) preview: Option<crate::node::sandbox::PreviewSettings>,
    /// Whether (and with what) the node checkpoints sandboxes (none: not served).
    pub(crate) checkpoints: Option<checkpoint::Checkpoints>,
    /// What tries the `ready.tcp` and `ready.http` checks.
    pub(crate) prober: Arc<dyn crate::probe::Prober>,
    /// The last answer of the health checks (`health.rs`).
    health: health::HealthCache,
    /// Where `max_sandboxes` comes from (`capacity.rs`; none: given as it is).
    pub capacity: Option<capacity::Capacity>,
    /// The node's disk and the runs' volumes (none: no volumes).
    pub(crate) volumes: volume::Volumes,
    /// The fleet's object store that sleeps and snapshots go to (none: not stored).
    replicas: Option<replica::ReplicaQueue>,
    /// The node's lease with its control plane, and its fence (`lease.rs`).
    lease: lease::NodeLease,
    /// What a front end does after a request woke a sleeping sandbox (set once: E2B's sets
    /// the end of an auto-resumed sandbox again).
    wake_hook: std::sync::OnceLock<WakeHook>,
}

/// Called with a sandbox's id after a use of it woke it from its sleep (`Node::set_wake_hook`).
pub type WakeHook = Box<dyn Fn(&Arc<Node>, &str) + Send + Sync>;

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

pub use crate::fail::internal;

fn not_served(param: &str, what: &str) -> ApiError {
    ApiError::new(
        ErrorCode::NotServedHere,
        format!("this node does not serve {what} yet"),
    )
    .with_param(param)
}

/// Builds a [`Node`]: its parts ([`Node::builder`]), then what it serves besides sandboxes,
/// each given at most once (a second call replaces the first before anything runs).
pub struct NodeBuilder {
    cfg: NodeConfig,
    driver: Arc<dyn Driver>,
    images: ImageStore,
    store: Arc<crate::store::Store>,
    templates: crate::node::templates::Templates,
    prober: Arc<dyn crate::probe::Prober>,
    net: Option<Arc<net::NodeNet>>,
    preview: Option<crate::node::sandbox::PreviewSettings>,
    checkpoints: Option<checkpoint::Checkpoints>,
    capacity: Option<capacity::Capacity>,
    volumes: Option<volume::VolumeSettings>,
    replicas: Option<Arc<dyn replica::Replicas>>,
    leased: bool,
}

impl NodeBuilder {
    /// The node keeps a lease with a control plane (`--control`): fenced until its first
    /// renewal and whenever one is late (`lease.rs`). Without it, it never fences.
    pub fn leased(mut self, leased: bool) -> Self {
        self.leased = leased;
        self
    }

    /// The node's network: sandboxes that have network get a namespace of it.
    pub fn net(mut self, net: Option<Arc<net::NodeNet>>) -> Self {
        self.net = net;
        self
    }

    /// The preview listener's settings (its bound address), when it is on.
    pub fn preview(mut self, p: Option<crate::node::sandbox::PreviewSettings>) -> Self {
        self.preview = p;
        self
    }

    /// What the node checkpoints sandboxes with.
    pub fn checkpoints(mut self, c: checkpoint::Checkpoints) -> Self {
        c.set_data_dir(&self.cfg.data_dir);
        self.checkpoints = Some(c);
        self
    }

    /// Where `max_sandboxes` comes from, for `GET /internal/node`.
    pub fn capacity(mut self, c: capacity::Capacity) -> Self {
        self.capacity = Some(c);
        self
    }

    /// The node's disk and its volumes' settings (none: no volumes).
    pub fn volumes(mut self, v: Option<volume::VolumeSettings>) -> Self {
        self.volumes = v;
        self
    }

    /// The object store that sleeps and snapshots go to (`replica.rs`).
    pub fn replicas(mut self, r: Option<Arc<dyn replica::Replicas>>) -> Self {
        self.replicas = r;
        self
    }

    /// The node (its volumes' table made when it has volumes).
    pub fn build(self) -> Result<Arc<Node>, crate::store::StoreError> {
        let volumes = volume::Volumes::open(&self.store, self.volumes)?;
        Ok(Arc::new(Node {
            cfg: self.cfg,
            store: self.store,
            templates: self.templates,
            managed: Mutex::new(HashMap::new()),
            warm: Mutex::new(Vec::new()),
            refilling: tokio::sync::watch::Sender::new(false),
            warm_making: Mutex::new(None),
            driver: self.driver,
            images: self.images,
            table: Mutex::new(Table::default()),
            admission: Mutex::new(()),
            live: Mutex::new(HashMap::new()),
            teardowns: tokio::sync::watch::Sender::new(0),
            stopping: AtomicBool::new(false),
            net: self.net,
            preview: self.preview,
            checkpoints: self.checkpoints,
            prober: self.prober,
            health: health::HealthCache::default(),
            capacity: self.capacity,
            volumes,
            replicas: self.replicas.map(replica::ReplicaQueue::new),
            lease: lease::NodeLease::new(self.leased),
            wake_hook: std::sync::OnceLock::new(),
        }))
    }
}

impl Node {
    /// Sets what is done after a use of a sandbox (a request to one of its ports, a call of
    /// the API) woke it from its sleep; false when one was set already.
    pub fn set_wake_hook(&self, hook: WakeHook) -> bool {
        self.wake_hook.set(hook).is_ok()
    }

    /// Runs the wake hook, if any, for sandbox `id`.
    pub(crate) fn woken_by_use(self: &Arc<Self>, id: &str) {
        if let Some(h) = self.wake_hook.get() {
            h(self, id);
        }
    }

    /// Gives back sandbox `id`'s network namespace, if it has one (after its processes are
    /// gone).
    pub(crate) fn release_net(&self, id: &str) {
        if let Some(n) = self.net.as_ref() {
            n.release(id, false);
        }
    }

    /// [`Node::release_net`] of a sandbox the driver destroyed: its namespace may be used
    /// again.
    pub(crate) fn recycle_net(&self, id: &str) {
        if let Some(n) = self.net.as_ref() {
            n.release(id, true);
        }
    }

    /// For `GET /internal/node`.
    pub fn checkpoints_info(&self) -> checkpoint::CheckpointsInfo {
        match self.checkpoints.as_ref() {
            Some(c) => c.info(),
            None => checkpoint::CheckpointsInfo::off("not checked yet"),
        }
    }

    /// Runs `f` on the node's store for a table a front end keeps there (E2B's template names
    /// and tags): its schema and rows are the front end's own; the node's tables are reached
    /// through verbs only.
    pub fn with_front_table<T>(
        &self,
        f: impl FnOnce(&rusqlite::Connection) -> rusqlite::Result<T>,
    ) -> Result<T, crate::store::StoreError> {
        self.store.with_conn(f)
    }

    /// Starts a request of the HTTP API with an Idempotency-Key (its records are the node's
    /// store's: a retry after a restart is answered too).
    pub fn idem_begin(
        &self,
        scope: &str,
        key: &str,
        hash: &str,
    ) -> Result<crate::store::IdemBegin, crate::store::StoreError> {
        self.store.idem_begin(scope, key, hash)
    }

    /// Records the answer of a request with an Idempotency-Key.
    pub fn idem_finish(
        &self,
        scope: &str,
        key: &str,
        status: u16,
        body: &str,
    ) -> Result<(), crate::store::StoreError> {
        self.store.idem_finish(scope, key, status, body)
    }

    /// Forgets an Idempotency-Key whose request failed in a way worth trying again.
    pub fn idem_forget(&self, scope: &str, key: &str) -> Result<(), crate::store::StoreError> {
        self.store.idem_forget(scope, key)
    }

    /// For `GET /internal/node`: where the driver's cgroups are.
    pub fn cgroups_info(&self) -> Vec<sbx_runtime::cgroup::Placement> {
        self.driver.placement()
    }

    /// For `GET /internal/node`: the sandboxes' network (none: the node has none).
    pub fn net_info(&self) -> Option<net::NetInfo> {
        self.net.as_ref().map(|net| net.info())
    }

    /// Whether sandboxes of the HTTP API have network (the node has one).
    pub fn has_net(&self) -> bool {
        self.net.as_ref().is_some()
    }

    /// A node of these parts; the rest is given to the [`NodeBuilder`] before it is built.
    pub fn builder(
        cfg: NodeConfig,
        driver: Arc<dyn Driver>,
        images: ImageStore,
        store: Arc<crate::store::Store>,
        templates: crate::node::templates::Templates,
        prober: Arc<dyn crate::probe::Prober>,
    ) -> NodeBuilder {
        NodeBuilder {
            cfg,
            driver,
            images,
            store,
            templates,
            prober,
            net: None,
            preview: None,
            checkpoints: None,
            capacity: None,
            volumes: None,
            replicas: None,
            leased: false,
        }
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

    pub fn is_stopping(&self) -> bool {
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
        self.sandbox_count() + self.kept_count()
    }

    /// Teardowns still under way.
    pub fn pending_teardowns(&self) -> usize {
        *self.teardowns.borrow()
    }

    pub fn release(&self, id: &str) {
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
        // A warm sandbox being made is not left behind: the refiller ends it once made (it
        // sees the node stopping), and stops; at most 30 s (a create's own limits are less).
        let mut refilling = self.refilling.subscribe();
        if tokio::time::timeout(SHUTDOWN_WAIT, refilling.wait_for(|busy| !*busy))
            .await
            .is_err()
        {
            tracing::warn!("the warm pool's refiller did not stop in 30 s");
        }
        self.drain_warm();
        let all: Vec<Arc<Sandbox>> = self.live.locked().drain().map(|(_, s)| s).collect();
        for sb in all {
            self.teardown(sb);
        }
        let mut teardowns = self.teardowns.subscribe();
        if tokio::time::timeout(SHUTDOWN_WAIT, teardowns.wait_for(|n| *n == 0))
            .await
            .is_err()
        {
            tracing::warn!(
                pending = self.pending_teardowns(),
                "teardowns still under way after 30 s"
            );
        }
        // Kept sandboxes run on (the next node adopts them): their groups keep the folder,
        // and the network's table keeps them fenced in. With none, nothing of the node stays.
        self.driver.release();
        // criu's workers hold copies of the node's mounts (its disk among them).
        if let Some(c) = self.checkpoints.as_ref() {
            c.stop();
        }
        self.release_disk();
        if let Some(net) = self.net.as_ref() {
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
