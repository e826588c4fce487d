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

use std::sync::Arc;
use std::time::{Duration, Instant};

use sbx_api::{ApiError, SandboxStatus};
use serde::{Deserialize, Serialize};

use super::Managed;
use crate::node::Node;
use crate::sync::LockExt;

/// How often the node looks for idle sandboxes.
const SWEEP: Duration = Duration::from_millis(250);

/// `sleep_after_seconds` as a create gave it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub enum SleepAfter {
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
    pub(crate) fn resolve(self, node_default: Option<Duration>) -> Option<Duration> {
        match self {
            SleepAfter::NodeDefault => node_default,
            SleepAfter::Never => None,
            SleepAfter::Seconds(s) => Some(Duration::from_secs_f64(s.max(0.0))),
        }
    }
}

/// A kept sandbox's use.
#[derive(Debug)]
pub(crate) struct Idle {
    /// When the last use ended (or began, while one goes on).
    last: Instant,
    /// Uses going on now.
    users: u32,
    /// Since when it is paused (frozen).
    paused_since: Option<Instant>,
}

impl Idle {
    pub(crate) fn new() -> Idle {
        Idle {
            last: Instant::now(),
            users: 0,
            paused_since: None,
        }
    }

    pub(crate) fn is_paused(&self) -> bool {
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

impl Drop for InUse {
    fn drop(&mut self) {
        let mut idle = self.m.idle.locked();
        idle.users = idle.users.saturating_sub(1);
        idle.last = Instant::now();
    }
}

impl Node {
    /// Marks kept sandbox `id_or_name` in use, thawing it first if it is paused; `None` for
    /// a sandbox the node does not keep (the caller's own lookup answers for it).
    pub fn use_sandbox(&self, id_or_name: &str) -> Option<Result<InUse, ApiError>> {
        let m = self.managed(id_or_name).ok()?;
        Some(self.use_managed(&m))
    }

    pub(crate) fn use_managed(&self, m: &Arc<Managed>) -> Result<InUse, ApiError> {
        let mut idle = m.idle.locked();
        if idle.paused_since.is_some() {
            if let Some(sb) = m.machine() {
                if let Err(e) = sb.set_paused(false) {
                    tracing::error!(sandbox = %m.id, error = %e, "thaw");
                    return Err(ApiError::internal());
                }
                tracing::debug!(sandbox = %m.id, "resumed");
            }
            idle.paused_since = None;
        }
        idle.users += 1;
        idle.last = Instant::now();
        Ok(InUse { m: m.clone() })
    }

    /// Whether kept sandbox `m` is paused now.
    pub(crate) fn is_paused(&self, m: &Managed) -> bool {
        m.idle.locked().is_paused()
    }

    /// How long sandbox `m` may be idle before it pauses.
    pub(crate) fn sleep_after(&self, m: &Managed) -> Option<Duration> {
        m.spec.sleep_after.resolve(self.cfg.sleep_after)
    }

    /// Pauses `m` if it has been idle long enough: running, nothing of it in use, no command
    /// of its running. The decision and the freeze are made under its use lock, so a use that
    /// comes meanwhile finds it paused and thaws it.
    fn pause_if_idle(&self, m: &Arc<Managed>, now: Instant) {
        let Some(after) = self.sleep_after(m) else {
            return;
        };
        if m.status() != SandboxStatus::Running || !m.running.locked().is_empty() {
            return;
        }
        let Some(sb) = m.machine() else {
            return;
        };
        let mut idle = m.idle.locked();
        if idle.paused_since.is_some()
            || idle.users > 0
            || now.saturating_duration_since(idle.last) < after
        {
            return;
        }
        // A lifecycle change (delete, restart) in progress: leave it alone.
        let Ok(_op) = m.op.try_lock() else {
            return;
        };
        match sb.set_paused(true) {
            Ok(()) => {
                idle.paused_since = Some(now);
                tracing::debug!(sandbox = %m.id, "paused: idle");
            }
            Err(e) => tracing::warn!(sandbox = %m.id, error = %e, "pause"),
        }
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
            loop {
                tick.tick().await;
                let Some(node) = node.upgrade() else {
                    return;
                };
                if node.is_stopping() {
                    return;
                }
                let all: Vec<Arc<Managed>> = node.managed.locked().values().cloned().collect();
                let now = Instant::now();
                for m in all {
                    node.pause_if_idle(&m, now);
                }
            }
        });
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
