//! Idle sandboxes pause: a kept sandbox that nobody uses for `sleep_after_seconds` (the
//! node's `--sleep-after-seconds` when the create said nothing; null: never) is frozen by its
//! cgroup's freezer (about a millisecond): none of its processes runs, its memory stays. Any
//! use of it (a call of the API on it but the read of its object, a command, its files, a
//! terminal, a stream, its preview, E2B's envd, the functions interface) thaws it first, and
//! holds it awake until that use ends ([`InUse`]).
//!
//! In use means: a request for it in flight (its answer's body included, so an event stream
//! or a download holds it), a terminal open, a command of its running. The start command
//! does not count: it is the machine's own service, paused with the rest.
//!
//! A sandbox paused for `suspend_after_ms` (the node's `--suspend-after-seconds` when the
//! create said nothing) sleeps for real, where the node checkpoints (`node/checkpoint.rs`):
//! its processes are saved to disk with their memory, which is freed; status `sleeping`.
//! `POST /v1/sandboxes/{id}/sleep` does it at once, whatever runs in it (its commands keep their
//! ids, output and positions). Any use wakes it, as a paused one is resumed; it survives the
//! node's restart asleep. Where the host's available memory falls below
//! `--sleep-memory-below-bytes`, paused sandboxes sleep at once, the longest paused first.
//!
//! Programs of a sandbox may put its pause off: connected to `/run/sbx/awake` (served by its
//! agent), they raise a hold with `+` and lower it with `-` (or by closing the connection).
//! Once its idle time has run out, the node asks the agent what is held: while a hold is
//! raised the sandbox runs on, up to `sleep_hold_max_ms` (null: 30 s; 0: holds are not
//! heeded) past that time; it pauses `sleep_after` after the last hold is lowered. With
//! `sleep_notice_ms`, the programs connected are sent `sleep N` that long before the pause
//! (where none is connected, the pause is not put off).

use std::sync::Arc;
use std::time::{Duration, Instant};

use sbx_api::{ApiError, ErrorCode, SandboxObject, SandboxStatus};
use serde::{Deserialize, Serialize};

use super::{store_err, wrong_state, Managed, START_EXEC};
use crate::node::checkpoint::{images_dir, Checkpointer};
use crate::node::Node;
use crate::sync::LockExt;
use sbx_runtime::Sandbox;

/// How often the node looks for idle sandboxes.
const SWEEP: Duration = Duration::from_millis(250);
/// How long holds keep a sandbox up past its idle time where its create said nothing.
const HOLD_MAX_DEFAULT: Duration = Duration::from_secs(30);
/// How often the node reads the host's available memory.
const MEMORY_EVERY: u32 = 4;

/// How long the holds raised in sandbox `spec` keep it up past its idle time.
pub(crate) fn hold_max(spec: &super::StoredSpec) -> Duration {
    spec.sleep_hold_max_ms
        .map(|ms| Duration::from_millis(u64::from(ms)))
        .unwrap_or(HOLD_MAX_DEFAULT)
}

/// The notice sandbox `spec`'s programs are given before it pauses.
fn notice(spec: &super::StoredSpec) -> Option<Duration> {
    spec.sleep_notice_ms
        .filter(|ms| *ms > 0)
        .map(|ms| Duration::from_millis(u64::from(ms)))
}

/// `--sleep-memory-below-bytes` where not given: a tenth of the host's memory, at least 512 MiB.
pub fn default_memory_low() -> u64 {
    let total = meminfo("MemTotal:").unwrap_or(0);
    (total / 10).max(512 << 20)
}

/// A line of /proc/meminfo, in bytes.
fn meminfo(key: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line[key.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib.saturating_mul(1024))
}

/// `sleep_after_seconds` as a create gave it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub(crate) enum SleepAfter {
    /// Not given: the node's `--sleep-after-seconds`.
    #[default]
    NodeDefault,
    /// null: never by itself.
    Never,
    Seconds(f64),
}

impl SleepAfter {
    pub(crate) fn from_request(v: Option<Option<f64>>) -> SleepAfter {
        match v {
            None => SleepAfter::NodeDefault,
            Some(None) => SleepAfter::Never,
            Some(Some(s)) => SleepAfter::Seconds(s),
        }
    }

    /// How long the sandbox may be idle before it pauses (`None`: never).
    pub fn resolve(self, node_default: Option<Duration>) -> Option<Duration> {
        match self {
            SleepAfter::NodeDefault => node_default,
            SleepAfter::Never => None,
            SleepAfter::Seconds(s) => Some(Duration::from_secs_f64(s.max(0.0))),
        }
    }
}

/// A kept sandbox's use.
#[derive(Debug)]
pub struct Idle {
    /// When the last use ended (or began, while one goes on).
    last: Instant,
    /// Uses going on now.
    pub(super) users: u32,
    /// Since when it is paused (frozen).
    paused_since: Option<Instant>,
    /// Being put to sleep or woken: a use waits for the sandbox's op lock, then looks again.
    pub(super) changing: bool,
    /// Its programs were told it pauses: at this instant.
    stop_at: Option<Instant>,
    /// Its agent is being asked what is held.
    asking: bool,
}

impl Default for Idle {
    fn default() -> Self {
        Idle::new()
    }
}

impl Idle {
    pub fn new() -> Idle {
        Idle {
            last: Instant::now(),
            users: 0,
            paused_since: None,
            changing: false,
            stop_at: None,
            asking: false,
        }
    }

    pub fn is_paused(&self) -> bool {
        self.paused_since.is_some()
    }
}

/// Holds a sandbox awake while it is used: the use ends when this is dropped.
#[must_use = "the sandbox may pause as soon as this is dropped"]
pub struct InUse {
    m: Arc<Managed>,
}

impl std::fmt::Debug for InUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InUse")
            .field("sandbox", &self.m.id)
            .finish()
    }
}

impl InUse {
    /// Resolves when a sleep asked for cuts this use (`POST …/sleep` while it is open): the
    /// holder ends it then (an answer stops being sent, a terminal closes).
    pub fn cut(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.m.cut.subscribe();
        async move {
            // An error is the sender's end, which cannot come while this use holds it.
            let _ = rx.changed().await;
        }
    }
}

impl Drop for InUse {
    fn drop(&mut self) {
        let mut idle = self.m.idle.locked();
        idle.users = idle.users.saturating_sub(1);
        idle.last = Instant::now();
    }
}

impl Node {
    /// Marks kept sandbox `id_or_name` in use, waking it first if it sleeps and resuming it
    /// if it is paused; `None` for a sandbox the node does not keep (the caller's own lookup
    /// answers for it).
    pub async fn use_sandbox(
        self: &Arc<Self>,
        id_or_name: &str,
    ) -> Option<Result<InUse, ApiError>> {
        let m = self.managed(id_or_name).ok()?;
        Some(self.use_managed(&m).await)
    }

    /// Like [`Node::use_sandbox`], for a request to one of the sandbox's ports: one held
    /// asleep (E2B's pause) is not woken, also when it was put to sleep while this waited:
    /// 409 `sandbox_paused`.
    pub async fn use_sandbox_port(
        self: &Arc<Self>,
        id_or_name: &str,
    ) -> Option<Result<InUse, ApiError>> {
        let m = self.managed(id_or_name).ok()?;
        Some(self.use_managed_as(&m, false).await)
    }

    pub(crate) async fn use_managed(self: &Arc<Self>, m: &Arc<Managed>) -> Result<InUse, ApiError> {
        self.use_managed_as(m, true).await
    }

    /// `wake_held`: a sandbox held asleep is woken too (a call of the API), or refused.
    async fn use_managed_as(
        self: &Arc<Self>,
        m: &Arc<Managed>,
        wake_held: bool,
    ) -> Result<InUse, ApiError> {
        loop {
            if m.status() == SandboxStatus::Sleeping {
                if !wake_held && m.held.load(std::sync::atomic::Ordering::SeqCst) {
                    return Err(ApiError::new(
                        ErrorCode::SandboxPaused,
                        format!("sandbox {} is paused: a call of the API wakes it", m.id),
                    ));
                }
                if self.wake_managed(m).await? {
                    self.woken_by_use(&m.id);
                }
            }
            {
                let mut idle = m.idle.locked();
                if !idle.changing && m.status() != SandboxStatus::Sleeping {
                    if idle.paused_since.is_some() {
                        if let Some(sb) = m.machine() {
                            if let Err(e) = sb.set_paused(false) {
                                tracing::error!(sandbox = %m.id, error = %e, "thaw");
                                return Err(ApiError::internal());
                            }
                            // Its agent's lease may have run out while it was frozen.
                            self.lease_agent(m.op.clone(), &sb);
                            tracing::debug!(sandbox = %m.id, "resumed");
                        }
                        idle.paused_since = None;
                    }
                    idle.users += 1;
                    idle.last = Instant::now();
                    idle.stop_at = None;
                    return Ok(InUse { m: m.clone() });
                }
            }
            // Being put to sleep (or woken): wait for that to end, then look again.
            drop(m.op.lock().await);
        }
    }

    /// Whether kept sandbox `m` is paused now.
    pub(crate) fn is_paused(&self, m: &Managed) -> bool {
        m.idle.locked().is_paused()
    }

    /// How long sandbox `m` may be idle before it pauses.
    pub(crate) fn sleep_after(&self, m: &Managed) -> Option<Duration> {
        m.spec.sleep_after.resolve(self.cfg.sleep_after)
    }

    /// Whether `m` may pause now: running, no command of its running, nothing of it in use,
    /// not paused, not changing; its machine then.
    fn may_pause(&self, m: &Managed, idle: &Idle) -> Option<Arc<Sandbox>> {
        if m.status() != SandboxStatus::Running
            || m.running.locked().iter().any(|e| e != START_EXEC)
            || idle.paused_since.is_some()
            || idle.users > 0
            || idle.changing
        {
            return None;
        }
        m.machine()
    }

    /// Pauses `m` if it has been idle long enough. Where its programs may hold it up or be
    /// told first (`/run/sbx/awake`), its agent is asked ([`Node::decide_pause`]); else the
    /// freeze is made here. The decision and the freeze are made under its use lock, so a
    /// use that comes meanwhile finds it paused and thaws it.
    fn pause_if_idle(self: &Arc<Self>, m: &Arc<Managed>, now: Instant) {
        let Some(after) = self.sleep_after(m) else {
            return;
        };
        let mut idle = m.idle.locked();
        let Some(sb) = self.may_pause(m, &idle) else {
            return;
        };
        if now.saturating_duration_since(idle.last) < after {
            idle.stop_at = None;
            return;
        }
        if notice(&m.spec).is_none() && hold_max(&m.spec).is_zero() {
            freeze(m, &sb, &mut idle, now);
            return;
        }
        if idle.asking {
            return;
        }
        idle.asking = true;
        drop(idle);
        let (node, m) = (self.clone(), m.clone());
        tokio::spawn(async move {
            node.decide_pause(&m, &sb, after).await;
        });
    }

    /// Asks `m`'s agent what its programs hold, then pauses it, tells its programs it will,
    /// or leaves it running while a hold is raised (up to its `sleep_hold_max_ms`).
    async fn decide_pause(&self, m: &Arc<Managed>, sb: &Arc<Sandbox>, after: Duration) {
        let held = crate::agent::holds(&sb.socket, None)
            .await
            .unwrap_or_else(|e| {
                tracing::debug!(sandbox = %m.id, error = %e, "the holds of /run/sbx/awake");
                crate::agent::Holds::default()
            });
        let now = Instant::now();
        let Some(n) = self.decide_locked(m, sb, after, held, now) else {
            return;
        };
        let ms = u32::try_from(n.as_millis()).unwrap_or(u32::MAX);
        if let Err(e) = crate::agent::holds(&sb.socket, Some(ms)).await {
            tracing::debug!(sandbox = %m.id, error = %e, "the notice of a pause");
        }
        tracing::debug!(sandbox = %m.id, ms, "told it pauses");
    }

    /// [`Node::decide_pause`] under `m`'s use lock: the notice to send, if one is due.
    fn decide_locked(
        &self,
        m: &Managed,
        sb: &Sandbox,
        after: Duration,
        held: crate::agent::Holds,
        now: Instant,
    ) -> Option<Duration> {
        let mut idle = m.idle.locked();
        idle.asking = false;
        self.may_pause(m, &idle)?;
        // Idle from when its last hold was lowered.
        if let Some(t) = held
            .lowered_ms_ago
            .and_then(|ago| now.checked_sub(Duration::from_millis(ago)))
        {
            if t > idle.last {
                idle.last = t;
            }
        }
        let due = idle.last + after;
        if now < due {
            idle.stop_at = None;
            return None;
        }
        let max = hold_max(&m.spec);
        if held.holds > 0 && !max.is_zero() && now < due + max {
            idle.stop_at = None;
            return None;
        }
        match (idle.stop_at, notice(&m.spec)) {
            (Some(at), _) if now < at => None,
            (None, Some(n)) if held.connected > 0 => {
                idle.stop_at = Some(now + n);
                Some(n)
            }
            _ => {
                freeze(m, sb, &mut idle, now);
                None
            }
        }
    }

    /// How long `m` stays paused before it sleeps for real.
    pub(crate) fn suspend_after(&self, m: &Managed) -> Duration {
        m.spec
            .suspend_after_ms
            .map(|ms| Duration::from_millis(u64::from(ms)))
            .unwrap_or(self.cfg.suspend_after)
    }

    /// Whether `m` has been paused long enough to sleep (on a node that checkpoints).
    fn suspend_due(&self, m: &Managed, now: Instant) -> bool {
        if self.checkpointer().is_err() {
            return false;
        }
        let idle = m.idle.locked();
        !idle.changing
            && idle.users == 0
            && idle
                .paused_since
                .is_some_and(|t| now.saturating_duration_since(t) >= self.suspend_after(m))
    }

    /// Whether the host is short of memory (`--sleep-memory-below-bytes`), on a node that
    /// checkpoints.
    fn memory_short(&self) -> bool {
        let below = self.cfg.sleep_memory_below;
        below > 0
            && self.checkpointer().is_ok()
            && meminfo("MemAvailable:").is_some_and(|avail| avail < below)
    }

    /// The sandbox of `all` paused longest that may sleep now.
    fn longest_paused(all: &[Arc<Managed>]) -> Option<Arc<Managed>> {
        all.iter()
            .filter(|m| m.status() == SandboxStatus::Running)
            .filter_map(|m| {
                let idle = m.idle.locked();
                let since = idle
                    .paused_since
                    .filter(|_| !idle.changing && idle.users == 0)?;
                Some((since, m))
            })
            .min_by_key(|(since, _)| *since)
            .map(|(_, m)| m.clone())
    }

    /// The node's checkpointer, or 503 not_served_here saying why it has none.
    pub fn checkpointer(&self) -> Result<Arc<dyn Checkpointer>, ApiError> {
        match self.checkpoints.as_ref() {
            Some(c) => c.get(),
            None => crate::node::checkpoint::Checkpoints::Off("not checked yet".into()).get(),
        }
    }

    /// `POST /v1/sandboxes/{id}/sleep`: puts it to sleep now, whatever runs in it.
    pub async fn sleep_sandbox(self: &Arc<Self>, id: &str) -> Result<SandboxObject, ApiError> {
        let m = self.managed(id)?;
        self.sleep_managed(&m, true).await?;
        Ok(self.sandbox_object(&m))
    }

    /// `POST /v1/sandboxes/{id}/wake`.
    pub async fn wake_sandbox(self: &Arc<Self>, id: &str) -> Result<SandboxObject, ApiError> {
        let m = self.managed(id)?;
        self.checkpointer()?;
        self.wake_managed(&m).await?;
        Ok(self.sandbox_object(&m))
    }

    /// Puts `m` to sleep: its processes saved to its directory, its memory freed. `asked`: a
    /// caller asked (it waits a moment for uses going on to end; commands running are saved
    /// with the rest); else the node's own timer (nothing may be in use or running).
    pub(crate) async fn sleep_managed(
        self: &Arc<Self>,
        m: &Arc<Managed>,
        asked: bool,
    ) -> Result<(), ApiError> {
        let ck = self.checkpointer()?;
        let _op = m.op.lock().await;
        match m.status() {
            SandboxStatus::Sleeping => return Ok(()),
            SandboxStatus::Running => {}
            s => return Err(wrong_state(s, "sleep")),
        }
        let Some(sb) = m.machine() else {
            return Err(wrong_state(SandboxStatus::Starting, "sleep"));
        };
        // A command running keeps it awake but for a sleep asked for.
        if !asked && m.running.locked().iter().any(|e| e != START_EXEC) {
            return Err(ApiError::new(
                ErrorCode::Unavailable,
                "a command runs in the sandbox",
            ));
        }
        // Nothing of it in use from here on: a use that comes waits for the op lock. Asked
        // for, it cuts the uses still open after a moment.
        self.quiesce(m, 0, asked).await?;
        let result = self.put_to_sleep(m, &sb, ck).await;
        m.idle.locked().changing = false;
        result
    }

    async fn put_to_sleep(
        self: &Arc<Self>,
        m: &Arc<Managed>,
        sb: &Arc<Sandbox>,
        ck: Arc<dyn Checkpointer>,
    ) -> Result<(), ApiError> {
        let started = Instant::now();
        let images = images_dir(&self.cfg.data_dir, &m.id);
        let sb2 = sb.clone();
        let network = m.spec.network && self.net.as_ref().is_some();
        // Held from now until it is awake again.
        if let Err(e) = self.hold_traffic(m, true) {
            self.unquiesce(m, sb).await;
            return Err(e);
        }
        let done = tokio::task::spawn_blocking(move || {
            crate::node::checkpoint::remove_spent(&images);
            let _ = std::fs::remove_dir_all(&images);
            std::fs::create_dir_all(&images).map_err(|e| e.to_string())?;
            ck.sleep(&sb2, &images, network)
        })
        .await
        .map_err(crate::node::internal("a sleep's thread"))?;
        if let Err(why) = done {
            let _ = self.hold_traffic(m, false);
            self.unquiesce(m, sb).await;
            tracing::error!(sandbox = %m.id, error = %why, "sleep");
            return Err(ApiError::new(
                ErrorCode::Internal,
                format!("the sandbox could not be put to sleep: {why}"),
            ));
        }
        m.machine.locked().take();
        {
            let mut row = m.row.locked();
            row.status = SandboxStatus::Sleeping.as_str().into();
            row.pid = None;
            row.start_time = None;
            self.store.update_sandbox(&row).map_err(store_err)?;
        }
        tracing::info!(sandbox = %m.id, ms = started.elapsed().as_millis() as u64, "asleep");
        // To the fleet's store, in the background (staged now, out of a wake's way).
        self.replicate_sleep(&m.id, replica_image(m)).await;
        Ok(())
    }

    /// Stages `m`'s sleep for the store again, if it still sleeps (the node's start).
    pub(crate) async fn restage_sleep(self: &Arc<Self>, m: &Arc<Managed>) {
        let _op = m.op.lock().await;
        if m.status() == SandboxStatus::Sleeping {
            self.replicate_sleep(&m.id, replica_image(m)).await;
        }
    }

    /// Wakes `m` where it was (nothing if it does not sleep); true when this woke it.
    pub(crate) async fn wake_managed(self: &Arc<Self>, m: &Arc<Managed>) -> Result<bool, ApiError> {
        let _op = m.op.lock().await;
        if m.status() != SandboxStatus::Sleeping {
            return Ok(false);
        }
        // Released (or being released) to another node: not woken here.
        self.refuse_wake_if_moving(m)?;
        let ck = self.checkpointer()?;
        m.idle.locked().changing = true;
        let r = self.wake_locked(m, ck).await;
        m.idle.locked().changing = false;
        r.map(|()| true)
    }

    async fn wake_locked(
        self: &Arc<Self>,
        m: &Arc<Managed>,
        ck: Arc<dyn Checkpointer>,
    ) -> Result<(), ApiError> {
        let started = Instant::now();
        // An upload reading its disk where it lives ends that read first (`replica.rs`).
        let _disk_read = self.replica_wake_gate(&m.id).await;
        let (mut spec, _) = self.machine_spec(m).await.map_err(|(_, e)| e)?;
        // Its network as it was: the namespace the node kept (its veth, address, rules), or
        // after the node's restart a new one.
        let mut fresh_network = false;
        let mut place = None;
        if m.spec.network {
            if let Some(net) = self.net.as_ref() {
                let (p, fresh) = net.keep_or_take(&m.id, &mut spec).map_err(|e| {
                    ApiError::new(
                        ErrorCode::Unavailable,
                        format!("no network for the sandbox: {e}"),
                    )
                })?;
                place = Some(p);
                fresh_network = fresh;
            }
        }
        let images = images_dir(&self.cfg.data_dir, &m.id);
        let at = images.clone();
        let woke = tokio::task::spawn_blocking(move || ck.wake(&spec, &at, place))
            .await
            .map_err(crate::node::internal("a wake's thread"))?;
        let sb = match woke {
            Ok(sb) => Arc::new(sb),
            Err(why) => {
                // It sleeps on: its images are kept (a wake is tried again at its next use)
                // and the restore left nothing of its own (CRIU ended what it made, the
                // network is as it was). A lease taken for this wake goes back: the next one
                // takes a new one and puts the sandbox's rules on it.
                if fresh_network {
                    self.release_net(&m.id);
                }
                tracing::error!(sandbox = %m.id, error = %why, "wake");
                return Err(ApiError::new(
                    ErrorCode::Internal,
                    format!("the sandbox could not be woken (it sleeps on; a wake may be tried again): {why}"),
                ));
            }
        };
        crate::node::checkpoint::after(&sb).await.ok();
        *m.machine.locked() = Some(sb.clone());
        if let Some(net) = self.net.as_ref().filter(|_| m.spec.network) {
            if let Err(e) = net.follow(&m.id, &sb) {
                tracing::error!(sandbox = %m.id, error = %e, "the network of a woken sandbox");
            }
        }
        // Its traffic passes again (held since its sleep; a fresh lease was never held).
        let _ = self.hold_traffic(m, false);
        if fresh_network {
            if let Err(e) = self.apply_egress_of(m) {
                tracing::error!(sandbox = %m.id, error = %e.message, "egress rules after a wake");
            }
        }
        self.watch_agent(m, &sb);
        {
            let mut row = m.row.locked();
            row.status = SandboxStatus::Running.as_str().into();
            row.pid = Some(sb.pid);
            row.start_time = sb.start_time;
            self.store.update_sandbox(&row).map_err(store_err)?;
        }
        // The wake is recorded: its saved processes are spent only now (a node killed before
        // wakes it again from them). Moved out of the way at once (a sleep that comes next
        // writes the same place), removed off the wake's path.
        sbx_runtime::criu::forget_dump(&images);
        if let Some(spent) = crate::node::checkpoint::set_aside(&images) {
            tokio::task::spawn_blocking(move || {
                let _ = std::fs::remove_dir_all(spent);
            });
        }
        m.asleep.send_replace(false);
        if m.rewatch.swap(false, std::sync::atomic::Ordering::SeqCst) {
            let boot = m.boot();
            for e in self.store.execs(&m.id).unwrap_or_default() {
                if e.final_json.is_none() && e.boot == boot {
                    let slot = super::ExecSlot::hold(m, &e.exec_id);
                    self.watch_exec(m.clone(), sb.clone(), e, slot);
                }
            }
        }
        {
            let mut idle = m.idle.locked();
            idle.last = Instant::now();
        }
        tracing::info!(sandbox = %m.id, ms = started.elapsed().as_millis() as u64, "awake");
        Ok(())
    }

    /// The network lock of a checkpoint of `m`: its traffic held at the host (`true`) or let
    /// through again (CRIU skips its own lock). Nothing for a sandbox off the network. A
    /// failure is logged and, for a hold, answered 503: no checkpoint is taken unlocked.
    pub(crate) fn hold_traffic(&self, m: &Managed, held: bool) -> Result<(), ApiError> {
        let Some(net) = self.net.as_ref().filter(|_| m.spec.network) else {
            return Ok(());
        };
        net.hold(&m.id, held).map_err(|e| {
            tracing::error!(sandbox = %m.id, held, error = %e, "holding a sandbox's traffic");
            ApiError::new(
                ErrorCode::Unavailable,
                format!("the sandbox's network could not be held for a checkpoint: {e}"),
            )
        })
    }

    /// Puts sandbox `id` to sleep held asleep (a request to one of its ports does not wake
    /// it; a wake does): E2B's pause. Its hold is lifted again when the sleep fails.
    pub async fn sleep_held(self: &Arc<Self>, id: &str) -> Result<(), ApiError> {
        let m = self.managed(id)?;
        self.set_held(&m, true)?;
        let r = self.sleep_managed(&m, true).await;
        if r.is_err() {
            let _ = self.set_held(&m, false);
        }
        r
    }

    /// Wakes sandbox `id` when it sleeps and lifts its hold: E2B's resume and connect. True
    /// when it was asleep.
    pub async fn wake_and_release(self: &Arc<Self>, id: &str) -> Result<bool, ApiError> {
        let m = self.managed(id)?;
        let asleep = m.status() == SandboxStatus::Sleeping;
        if asleep {
            self.wake_managed(&m).await?;
        }
        self.set_held(&m, false)?;
        Ok(asleep)
    }

    /// Boots sandbox `id` again over its disk (the node's restart: what ran in it, or what
    /// its sleep saved, is gone) and lifts its hold: E2B's resume of a filesystem-only pause.
    pub async fn reboot_and_release(self: &Arc<Self>, id: &str) -> Result<SandboxObject, ApiError> {
        let o = self.restart_sandbox(id).await?;
        let m = self.managed(id)?;
        self.set_held(&m, false)?;
        Ok(o)
    }

    /// Sets `held_asleep` of `m`, kept across restarts.
    pub(crate) fn set_held(&self, m: &Managed, held: bool) -> Result<(), ApiError> {
        let egress = m.egress.locked();
        let expiry = m.expiry.locked();
        m.held.store(held, std::sync::atomic::Ordering::SeqCst);
        let mut spec = m.spec.clone();
        spec.egress = egress.clone();
        spec.expires_at = expiry.0.clone();
        spec.held_asleep = held;
        let json = serde_json::to_string(&spec)
            .map_err(crate::node::internal("a sandbox's spec as JSON"))?;
        self.store
            .update_sandbox_spec(&m.id, &json)
            .map_err(store_err)
    }

    /// Whether a request to one of sandbox `id`'s ports must not wake it: it sleeps, held
    /// asleep.
    pub fn is_held_asleep(&self, id: &str) -> bool {
        self.managed(id).is_ok_and(|m| {
            m.status() == SandboxStatus::Sleeping
                && m.held.load(std::sync::atomic::Ordering::SeqCst)
        })
    }

    /// Forgets that `m` was paused: its machine is ending or was replaced (a delete, a
    /// restart, an agent lost), and a new one runs thawed.
    pub(crate) fn forget_pause(&self, m: &Managed) {
        m.idle.locked().paused_since = None;
    }

    /// Starts the task that pauses idle sandboxes (once, at the node's start).
    pub fn start_sleeper(self: &Arc<Self>) {
        let node = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SWEEP);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut ticks = 0u32;
            // One sandbox at a time is put to sleep for memory.
            let for_memory = Arc::new(std::sync::atomic::AtomicBool::new(false));
            loop {
                tick.tick().await;
                let Some(node) = node.upgrade() else {
                    return;
                };
                if node.is_stopping() {
                    return;
                }
                // A fenced node changes none of its sandboxes (`lease.rs`).
                if node.is_fenced() {
                    continue;
                }
                let all: Vec<Arc<Managed>> = node.managed.locked().values().cloned().collect();
                let now = Instant::now();
                for m in all {
                    node.pause_if_idle(&m, now);
                    if node.suspend_due(&m, now) {
                        let (node, m) = (node.clone(), m.clone());
                        tokio::spawn(async move {
                            if let Err(e) = node.sleep_managed(&m, false).await {
                                tracing::info!(sandbox = %m.id, error = %e.message, "not put to sleep");
                            }
                        });
                    }
                }
                ticks = ticks.wrapping_add(1);
                if ticks.is_multiple_of(MEMORY_EVERY)
                    && !for_memory.load(std::sync::atomic::Ordering::SeqCst)
                    && node.memory_short()
                {
                    let all: Vec<Arc<Managed>> = node.managed.locked().values().cloned().collect();
                    if let Some(m) = Node::longest_paused(&all) {
                        for_memory.store(true, std::sync::atomic::Ordering::SeqCst);
                        let (node, flag) = (node.clone(), for_memory.clone());
                        tokio::spawn(async move {
                            tracing::info!(sandbox = %m.id, "the host is short of memory: put to sleep");
                            if let Err(e) = node.sleep_managed(&m, false).await {
                                tracing::info!(sandbox = %m.id, error = %e.message, "not put to sleep");
                            }
                            flag.store(false, std::sync::atomic::Ordering::SeqCst);
                        });
                    }
                }
            }
        });
    }
}

/// The image `m`'s disk is over, as the store's manifest names it.
pub(crate) fn replica_image(m: &Managed) -> String {
    match m.resolved().digest {
        Some(d) => format!("{}@{d}", m.spec.image),
        None => m.spec.image.clone(),
    }
}

/// Freezes `m` (idle, decided under its use lock `idle`), unless a lifecycle change (delete,
/// restart) is in progress.
fn freeze(m: &Managed, sb: &Sandbox, idle: &mut Idle, now: Instant) {
    let Ok(_op) = m.op.try_lock() else {
        return;
    };
    match sb.set_paused(true) {
        Ok(()) => {
            idle.paused_since = Some(now);
            idle.stop_at = None;
            tracing::debug!(sandbox = %m.id, "paused: idle");
        }
        Err(e) => tracing::warn!(sandbox = %m.id, error = %e, "pause"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sleep_after_is_the_create_s_or_the_node_s() {
        let node = Some(Duration::from_secs(30));
        assert_eq!(SleepAfter::from_request(None).resolve(node), node);
        assert_eq!(SleepAfter::from_request(Some(None)).resolve(node), None);
        assert_eq!(
            SleepAfter::from_request(Some(Some(1.5))).resolve(node),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(SleepAfter::from_request(None).resolve(None), None);
    }
}
