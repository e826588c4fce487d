//! The node's lease with its control plane, and its self-fencing (a node of a fleet only: a
//! node built without [`NodeBuilder::leased`](super::NodeBuilder::leased) has no lease and
//! never fences).
//!
//! The join loop (`sbx-control`'s `join.rs`, wired by `main.rs`) hands every renewal here
//! ([`Node::lease_renewed`]): the deadline the node fences itself at (the renewing call's
//! send instant + the lease − a margin), and the sandboxes the fleet has elsewhere now
//! (`taken`). A renewal first removes every taken sandbox (its processes killed, its files,
//! cgroups and network removed as a forget does, a tombstone kept: calls for it answer 409
//! `moved`, a release or takeover at a lower epoch 409 `wrong_epoch`, across restarts too),
//! then moves the deadline on, thaws what the fence froze and tells each running sandbox's
//! agent the new lease (the agent is the watchdog of a node that is stopped or killed:
//! `sbx-agent`'s `lease.rs`).
//!
//! Fenced (past the deadline without a renewal, and from the node's start until its first
//! join):
//! - every call for one of its sandboxes ([`Node::managed`] and what goes through it: the
//!   API by id or name, commands, streams, files, terminals, sleep, wake, E2B's and the
//!   preview's calls), every create and run, and a move's release and takeover answer 503
//!   `fenced` (retryable), the message saying since when;
//! - its running sandboxes are frozen (their cgroups' freezer; the fence's watch does it at
//!   the deadline); idle ones are not put to sleep, and expiries wait for the renewal;
//! - event streams and terminals open at the fence stay open: they get nothing while the
//!   sandbox is frozen, and go on after the renewal.
//! - Adopted sandboxes at a start are not frozen by the node (their agents' own deadlines
//!   stop them if the node was away longer than its lease).
//!
//! The agents are told a deadline half a margin after the node's own: a node that is alive
//! freezes first; the agent stops its sandbox only when its node could not.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sbx_api::moves::ForgetRequest;
use sbx_api::{ApiError, ErrorCode, SandboxStatus};
use serde::Serialize;

use crate::node::Node;
use crate::sync::LockExt;

/// A sandbox the fleet has elsewhere now (a renewal's `taken`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Taken {
    pub id: String,
    /// The epoch the fleet has it at.
    pub epoch: u64,
    /// The node that has it, as the control plane names it (none: no node).
    pub to: Option<String>,
}

/// A renewal of the node's lease.
#[derive(Debug, Clone)]
pub struct Renewal {
    /// When the node fences itself without a newer renewal.
    pub deadline: Instant,
    /// When the lease runs out by the node's clock (sent + lease): the agents are told a
    /// deadline between the two.
    pub lease_end: Instant,
    pub taken: Vec<Taken>,
}

/// What `GET /internal/node` shows of the lease.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct LeaseInfo {
    /// The node has a control plane (a lease to keep).
    pub leased: bool,
    pub fenced: bool,
    /// Since when it is fenced (RFC 3339).
    pub fenced_since: Option<String>,
    /// How long until it fences itself without a renewal (ms; none while fenced).
    pub left_ms: Option<u64>,
    /// Sandboxes the fence froze.
    pub frozen: usize,
}

/// How long an agent has to take its lease.
const AGENT_WAIT: Duration = Duration::from_secs(3);

#[derive(Debug)]
struct State {
    /// When the node fences itself; `None` until its first renewal.
    deadline: Option<Instant>,
    /// The deadline the agents are told.
    agent_until: Option<Instant>,
    /// The fence's start, once the watch saw it (its instant and wall clock, ns).
    fenced_at: Option<(Instant, i128)>,
    /// Sandboxes the fence froze (thawed at the renewal).
    frozen: HashSet<String>,
    /// Taken sandboxes whose removal failed (tried again at the next renewal): answered
    /// `moved`, kept frozen.
    taken_left: HashMap<String, Taken>,
}

/// The node's lease (part of [`Node`]).
pub struct NodeLease {
    leased: bool,
    state: Mutex<State>,
    changed: tokio::sync::Notify,
    watching: AtomicBool,
    /// The node's start (a node that never joined is fenced since then).
    started: (Instant, i128),
}

impl NodeLease {
    pub(crate) fn new(leased: bool) -> NodeLease {
        NodeLease {
            leased,
            state: Mutex::new(State {
                deadline: None,
                agent_until: None,
                fenced_at: None,
                frozen: HashSet::new(),
                taken_left: HashMap::new(),
            }),
            changed: tokio::sync::Notify::new(),
            watching: AtomicBool::new(false),
            started: (Instant::now(), crate::image::now_ns()),
        }
    }

    /// Since when (wall clock, ns) the node is fenced at `now`; `None` when it is not.
    fn fenced_since(&self, now: Instant) -> Option<i128> {
        if !self.leased {
            return None;
        }
        let st = self.state.locked();
        match st.deadline {
            None => Some(self.started.1),
            Some(d) if now >= d => Some(match st.fenced_at {
                Some((_, wall)) => wall,
                None => wall_of(d),
            }),
            Some(_) => None,
        }
    }
}

/// 503 `fenced`: the node could not renew its lease (since `since_ns`).
fn fenced(since_ns: i128, never_joined: bool) -> ApiError {
    let since = sbx_api::format_rfc3339_millis(since_ns);
    let why = if never_joined {
        "this node could not renew its lease with the control plane since it started (it has \
         not joined yet)"
            .to_string()
    } else {
        "this node could not renew its lease with the control plane".to_string()
    };
    ApiError::new(
        ErrorCode::Fenced,
        format!(
            "{why}: it is fenced since {since} (its sandboxes are frozen, and none is made) \
             until it renews; ask again in a moment, or through the control plane"
        ),
    )
    .with_beside("fenced_since", serde_json::json!(since))
}

/// A wall-clock instant of `at`, by the distance of `at` from now.
fn wall_of(at: Instant) -> i128 {
    let now = Instant::now();
    let wall = crate::image::now_ns();
    if at >= now {
        wall + at.duration_since(now).as_nanos() as i128
    } else {
        wall - now.duration_since(at).as_nanos() as i128
    }
}

/// CLOCK_BOOTTIME milliseconds of `at` (what the agents are told).
fn boottime_of(at: Instant) -> u64 {
    let now = Instant::now();
    let boot = sbx_runtime::process::boottime_ms();
    if at >= now {
        boot.saturating_add(at.duration_since(now).as_millis() as u64)
    } else {
        boot.saturating_sub(now.duration_since(at).as_millis() as u64)
    }
}

/// The deadline the agents are told: half way from the node's fence to its lease's end.
pub(crate) fn agent_deadline(deadline: Instant, lease_end: Instant) -> Instant {
    deadline + lease_end.saturating_duration_since(deadline) / 2
}

impl Node {
    /// 503 `fenced` while the node is fenced (a node without a lease never is).
    pub(crate) fn fence_error(&self) -> Option<ApiError> {
        let since = self.lease.fenced_since(Instant::now())?;
        let never = self.lease.state.locked().deadline.is_none();
        Some(fenced(since, never))
    }

    /// Whether the node is fenced now.
    pub(crate) fn is_fenced(&self) -> bool {
        self.lease.fenced_since(Instant::now()).is_some()
    }

    /// 409 `moved` for a taken sandbox whose removal is still to be done.
    pub(crate) fn taken_error(&self, id: &str) -> Option<ApiError> {
        let st = self.lease.state.locked();
        let t = st.taken_left.get(id)?;
        Some(super::sandbox::moved_error_of(t.to.as_deref(), t.epoch))
    }

    /// For `GET /internal/node`.
    pub fn lease_info(&self) -> LeaseInfo {
        let now = Instant::now();
        let since = self.lease.fenced_since(now);
        let st = self.lease.state.locked();
        LeaseInfo {
            leased: self.lease.leased,
            fenced: since.is_some(),
            fenced_since: since.map(sbx_api::format_rfc3339_millis),
            left_ms: st
                .deadline
                .filter(|_| since.is_none())
                .map(|d| d.saturating_duration_since(now).as_millis() as u64),
            frozen: st.frozen.len(),
        }
    }

    /// The sandboxes the node holds (not released or forgotten), each at its epoch: a
    /// heartbeat's `held`. Reads the store: call it off the async runtime's threads.
    pub fn held_list(&self) -> Vec<(String, u64)> {
        let ids: Vec<String> = self.managed.locked().keys().cloned().collect();
        ids.into_iter()
            .filter(|id| !self.store.is_moved(id))
            .map(|id| {
                let epoch = self.sandbox_epoch(&id);
                (id, epoch)
            })
            .collect()
    }

    /// A renewal of the node's lease (see the module's notes): taken sandboxes removed, then
    /// the deadline moved on, what the fence froze thawed, the agents told.
    pub async fn lease_renewed(self: &Arc<Self>, r: Renewal) {
        if !self.lease.leased {
            return;
        }
        let mut left = HashMap::new();
        for t in r.taken {
            if let Err(e) = self.remove_taken(&t).await {
                tracing::error!(sandbox = %t.id, epoch = t.epoch, error = %e.message, "a taken sandbox could not be removed: tried again at the next renewal");
                left.insert(t.id.clone(), t);
            }
        }
        let unfenced = {
            let mut st = self.lease.state.locked();
            st.taken_left = left;
            let was = match st.deadline {
                None => true,
                Some(d) => st.fenced_at.is_some() || Instant::now() >= d,
            };
            if Instant::now() >= r.deadline {
                // Renewed too late to count (the call took most of the lease).
                tracing::warn!("a renewal of the lease came after its own deadline: still fenced");
                return;
            }
            st.deadline = Some(r.deadline);
            st.agent_until = Some(agent_deadline(r.deadline, r.lease_end));
            st.fenced_at = None;
            let frozen: Vec<String> = st
                .frozen
                .iter()
                .filter(|id| !st.taken_left.contains_key(*id))
                .cloned()
                .collect();
            for id in &frozen {
                st.frozen.remove(id);
            }
            was.then_some(frozen)
        };
        self.lease.changed.notify_one();
        if let Some(frozen) = unfenced {
            for id in &frozen {
                self.thaw_fenced(id);
            }
            tracing::info!(
                thawed = frozen.len(),
                "the lease with the control plane is renewed: unfenced"
            );
        }
        self.watch_lease();
        self.lease_agents();
    }

    /// Removes taken sandbox `t` here: its processes killed first (they may be frozen, or
    /// stopped by its agent), then what a forget removes, and a tombstone (`moved`).
    async fn remove_taken(self: &Arc<Self>, t: &Taken) -> Result<(), ApiError> {
        if self.store.moved(&t.id).is_some_and(|r| r.kept) {
            // Released by a move: the move's own forget or take-back decides.
            return Ok(());
        }
        let held = self.known_epoch(&t.id).unwrap_or(0);
        let m = self.managed.locked().get(&t.id).cloned();
        if let Some(m) = m {
            if let Some(sb) = m.machine() {
                let driver = self.driver.clone();
                let killed = tokio::task::spawn_blocking(move || driver.destroy(&sb))
                    .await
                    .map_err(crate::node::internal("a taken sandbox's kill"))?;
                if let Err(e) = killed {
                    tracing::warn!(sandbox = %t.id, error = %e, "the kill of a taken sandbox");
                }
            }
        }
        self.lease.state.locked().frozen.remove(&t.id);
        self.forget_sandbox(
            &t.id,
            ForgetRequest {
                epoch: t.epoch.max(held),
                to: t.to.clone(),
            },
        )
        .await?;
        tracing::warn!(sandbox = %t.id, epoch = t.epoch, to = ?t.to, "taken: the fleet has it elsewhere; removed here");
        Ok(())
    }

    /// Thaws sandbox `id` the fence froze (one paused for being idle stays paused).
    fn thaw_fenced(&self, id: &str) {
        let Some(m) = self.managed.locked().get(id).cloned() else {
            return;
        };
        if m.idle.locked().is_paused() {
            return;
        }
        if let Some(sb) = m.machine() {
            if let Err(e) = sb.set_paused(false) {
                tracing::error!(sandbox = %id, error = %e, "thaw after the fence");
            }
        }
    }

    /// Starts the fence's watch (once): at the deadline without a renewal, the node's running
    /// sandboxes are frozen.
    fn watch_lease(self: &Arc<Self>) {
        if self.lease.watching.swap(true, Ordering::SeqCst) {
            return;
        }
        let n = self.clone();
        tokio::spawn(async move {
            // A permit left by `notify_one` wakes the next wait: no renewal is missed.
            while !n.is_stopping() {
                let (deadline, fenced) = {
                    let st = n.lease.state.locked();
                    (st.deadline, st.fenced_at.is_some())
                };
                match deadline {
                    Some(d) if !fenced && Instant::now() < d => {
                        let until = tokio::time::Instant::from_std(d);
                        tokio::select! {
                            _ = tokio::time::sleep_until(until) => {}
                            _ = n.lease.changed.notified() => {}
                        }
                    }
                    Some(d) if !fenced => n.fence(d),
                    // Fenced: until a renewal (looked at every second for the node's stop).
                    _ => {
                        let _ = tokio::time::timeout(
                            Duration::from_secs(1),
                            n.lease.changed.notified(),
                        )
                        .await;
                    }
                }
            }
        });
    }

    /// The deadline `d` passed without a renewal: the node is fenced, its running sandboxes
    /// frozen.
    fn fence(&self, d: Instant) {
        let all: Vec<Arc<crate::node::sandbox::Managed>> =
            self.managed.locked().values().cloned().collect();
        let mut frozen = Vec::new();
        for m in all {
            if self.store.is_moved(&m.id) || m.idle.locked().is_paused() {
                continue;
            }
            let Some(sb) = m.machine() else {
                continue;
            };
            match sb.set_paused(true) {
                Ok(()) => frozen.push(m.id.clone()),
                Err(e) => tracing::error!(sandbox = %m.id, error = %e, "the fence's freeze"),
            }
        }
        let n = frozen.len();
        {
            let mut st = self.lease.state.locked();
            if st.deadline != Some(d) {
                // Renewed meanwhile: what was frozen is thawed again.
                drop(st);
                for id in &frozen {
                    self.thaw_fenced(id);
                }
                return;
            }
            st.fenced_at = Some((d, wall_of(d)));
            st.frozen.extend(frozen);
        }
        tracing::warn!(
            frozen = n,
            "the lease with the control plane could not be renewed: fenced (every sandbox \
             frozen, every call answered 503 fenced until it renews)"
        );
    }

    /// Tells every running sandbox's agent the lease (in the background).
    fn lease_agents(self: &Arc<Self>) {
        let all: Vec<Arc<crate::node::sandbox::Managed>> =
            self.managed.locked().values().cloned().collect();
        for m in all {
            if m.status() != SandboxStatus::Running || self.store.is_moved(&m.id) {
                continue;
            }
            if let Some(sb) = m.machine() {
                if !m.idle.locked().is_paused() {
                    self.lease_agent(m.op_lock(), &sb);
                }
            }
        }
    }

    /// Tells the agent of `sb` the lease (in the background), where the node has one: at
    /// every renewal, and as the agent starts, wakes or is thawed. Nothing before the first
    /// renewal (an agent never told one never stops anything).
    ///
    /// Sent under the sandbox's lifecycle lock `op` (waited for up to [`AGENT_WAIT`], else
    /// left to the next renewal): a connection to the agent open while a sleep or snapshot
    /// dumps it would fail the dump (an external socket), and an agent being checkpointed has
    /// its watchdog off until it is told a lease again.
    pub(crate) fn lease_agent(
        &self,
        op: Arc<tokio::sync::Mutex<()>>,
        sb: &Arc<sbx_runtime::Sandbox>,
    ) {
        if !self.lease.leased {
            return;
        }
        let Some(until) = self.lease.state.locked().agent_until else {
            return;
        };
        let until_ms = boottime_of(until);
        let (socket, id) = (sb.socket.clone(), sb.id.clone());
        tokio::spawn(async move {
            let Ok(_op) = tokio::time::timeout(AGENT_WAIT, op.lock_owned()).await else {
                tracing::debug!(sandbox = %id, "the lease not told to the agent: a lifecycle change runs");
                return;
            };
            match tokio::time::timeout(AGENT_WAIT, crate::agent::lease(&socket, Some(until_ms)))
                .await
            {
                Ok(Ok(Some(true))) => {
                    tracing::warn!(sandbox = %id, "its agent stopped its processes: the lease ran out")
                }
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    tracing::debug!(sandbox = %id, error = %e, "the lease not told to the agent")
                }
                Err(_) => tracing::debug!(sandbox = %id, "the lease not told to the agent in time"),
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agents_deadline_is_half_way_to_the_lease_s_end() {
        let now = Instant::now();
        let s = Duration::from_secs;
        assert_eq!(agent_deadline(now + s(8), now + s(10)), now + s(9));
        assert_eq!(
            agent_deadline(now + s(2), now + s(3)),
            now + Duration::from_millis(2500)
        );
        // A lease already at its end: the same instant.
        assert_eq!(agent_deadline(now + s(3), now + s(2)), now + s(3));
    }

    #[test]
    fn a_node_without_a_lease_is_never_fenced_and_one_with_is_until_it_renews() {
        let alone = NodeLease::new(false);
        assert_eq!(alone.fenced_since(Instant::now()), None);
        let leased = NodeLease::new(true);
        let since = leased
            .fenced_since(Instant::now())
            .expect("fenced at start");
        assert_eq!(since, leased.started.1);
        let now = Instant::now();
        leased.state.locked().deadline = Some(now + Duration::from_secs(5));
        assert_eq!(leased.fenced_since(now), None);
        assert_eq!(leased.fenced_since(now + Duration::from_secs(4)), None);
        let past = leased
            .fenced_since(now + Duration::from_secs(6))
            .expect("fenced past the deadline");
        // Since the deadline (about 5 s from now, by the wall clock).
        let want = crate::image::now_ns() + 5_000_000_000;
        assert!((past - want).abs() < 2_000_000_000, "{past} {want}");
    }

    #[test]
    fn fenced_is_a_retryable_503_saying_since_when() {
        let e = fenced(1_700_000_000_000_000_000, false);
        assert_eq!(e.status(), 503);
        assert!(e.retryable());
        assert!(
            e.message.contains("could not renew its lease"),
            "{}",
            e.message
        );
        assert!(e.message.contains("2023-11-14T22:13:20"), "{}", e.message);
    }
}
