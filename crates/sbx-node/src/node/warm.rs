//! The warm pool: sandboxes of the base image made ahead, their agents' hellos read, taken
//! by runs and boots that fit them, refilled in the background.
//!
//! Two kinds (issue #31): `--warm-pool` sandboxes that may become kept ones (their overlay
//! synced at its end, their agent exec'd from the image, so that they can be checkpointed),
//! taken by creates (and by runs on a node with no pool for runs); and `--warm-runs` sandboxes
//! made as a run's own (`SandboxSpec::scratch`: a volatile overlay, PID 1 serving in process),
//! taken by runs only. A run's sandbox is never kept, slept or moved: the kept kind's sync of
//! the node's disk at its end and its agent's exec are work a run does not need
//! (docs/throughput.md).

use std::sync::Arc;
use std::time::Duration;

use sbx_runtime::{Limits, Sandbox, SandboxSpec};

use super::*;
use crate::agent::AgentConn;
use crate::sync::LockExt;

/// A sandbox made ahead of the request that will use it, with its agent's hello already read.
pub(super) struct Warm {
    pub(super) sandbox: Arc<Sandbox>,
    pub(super) conn: AgentConn,
    pub(super) limits: Limits,
    /// Made as a run's own (`--warm-runs`): never becomes a kept sandbox.
    pub(super) for_runs: bool,
}

impl Node {
    /// Takes a warm sandbox whose agent still runs: for a run, one made for runs (one of the
    /// kept kind only on a node that makes none for runs, `--warm-runs 0`: under load, a run
    /// that took one had the refiller make another of the dearer kind); for a kept sandbox
    /// (`for_run` false), one of the kept kind. One found dead (killed from outside while it
    /// waited) is ended, and the next one is tried.
    pub(super) fn take_live_warm(&self, for_run: bool) -> Option<Warm> {
        loop {
            let w = {
                let mut pool = self.warm.locked();
                let kind = for_run && self.cfg.warm_runs > 0;
                let at = pool.iter().rposition(|w| w.for_runs == kind);
                pool.remove(at?)
            };
            if w.sandbox.is_alive() {
                return Some(w);
            }
            tracing::warn!(sandbox = %w.sandbox.id, "a warm sandbox had died: ended");
            self.live_remove(&w.sandbox.id);
            // Its agent is gone already: what is left (cgroups, directory) goes at once.
            if let Err(e) = self.driver.destroy(&w.sandbox) {
                tracing::warn!(sandbox = %w.sandbox.id, error = %e, "teardown");
            }
            self.release_net(&w.sandbox.id);
            let _ = sbx_runtime::driver::remove_dir(&w.sandbox.dir);
        }
    }

    /// Takes a warm sandbox (out of the node's live table: the caller keeps it).
    pub(crate) fn pop_warm(self: &Arc<Self>) -> Option<Arc<Sandbox>> {
        let w = self.take_live_warm(false);
        // Refilled whether one was taken or every one was found dead.
        self.refill();
        let w = w?;
        self.live_remove(&w.sandbox.id);
        Some(w.sandbox)
    }

    /// Whether the pool has fewer sandboxes of a kind than it keeps.
    pub(crate) fn warm_below_target(&self) -> bool {
        self.warm_to_make().is_some()
    }

    /// The kind of warm sandbox to make next (`Some(true)`: one for runs), the one further
    /// below its target (runs' on a tie); `None`: both are full.
    fn warm_to_make(&self) -> Option<bool> {
        let (runs, kept) = {
            let pool = self.warm.locked();
            let runs = pool.iter().filter(|w| w.for_runs).count();
            (runs, pool.len() - runs)
        };
        let runs_short = self.cfg.warm_runs.saturating_sub(runs);
        let kept_short = self.cfg.warm_pool.saturating_sub(kept);
        match (runs_short, kept_short) {
            (0, 0) => None,
            (r, k) => Some(r >= k),
        }
    }

    /// Ids of the warm sandboxes (both kinds).
    pub fn warm_ids(&self) -> Vec<String> {
        self.warm
            .locked()
            .iter()
            .map(|w| w.sandbox.id.clone())
            .collect()
    }

    /// The id of the warm sandbox being made, if one is.
    pub fn warm_making(&self) -> Option<String> {
        self.warm_making.locked().clone()
    }

    /// Makes warm sandboxes until the pool is full (one refiller at a time, in the background).
    pub fn refill(self: &Arc<Self>) {
        if self.cfg.warm_pool + self.cfg.warm_runs == 0 || self.refilling.send_replace(true) {
            return;
        }
        let node = self.clone();
        tokio::spawn(async move {
            while let Some(for_runs) = node.warm_to_make() {
                if node.is_stopping() {
                    break;
                }
                let Ok(image) = node.images.base() else {
                    break;
                };
                let id = sbx_api::new_id("sbx");
                *node.warm_making.locked() = Some(id.clone());
                // Its disk is promised until its directory counts it; none when the node's
                // disk has promised all it may (the next pop tries again).
                let Ok(_disk) = node.hold_sandbox_disk(&id) else {
                    *node.warm_making.locked() = None;
                    break;
                };
                let limits = Limits {
                    memory_bytes: node.cfg.default_memory_bytes,
                    vcpus: node.cfg.default_vcpus,
                    pids: node.cfg.pids_max,
                };
                let spec = SandboxSpec {
                    id: id.clone(),
                    lowers: image.lowers.clone(),
                    dir: node.sandboxes_dir().join(&id),
                    hostname: id.clone(),
                    limits,
                    tmp_memory: false,
                    // One of the kept kind may become a kept sandbox (`pop_warm`): its disk is
                    // synced and its agent exec'd. One for runs is made as a run's own.
                    scratch: for_runs,
                    image_env: image.meta.env.clone(),
                    image_user: image.meta.user.clone(),
                    image_workdir: image.meta.workdir.clone(),
                    netns: None,
                    resolv_conf: None,
                    ca_bundle: None,
                    runtime: Default::default(),
                    volumes: Vec::new(),
                };
                match node.create(spec, node.has_net()).await {
                    Ok((sandbox, conn)) => {
                        // `create` put it in `live` too, so that a stopping node ends it.
                        node.warm.locked().push(Warm {
                            sandbox,
                            conn,
                            limits,
                            for_runs,
                        });
                        *node.warm_making.locked() = None;
                        if node.is_stopping() {
                            // `shutdown` may have run between the check above and now.
                            node.drain_warm();
                        }
                    }
                    Err(_) => {
                        let sb = node.live.locked().remove(&id);
                        match sb {
                            Some(sb) => node.teardown(sb),
                            // Not started (its cgroup folders gone under it, say): its
                            // directory was left (it stayed on the host until the node's end).
                            None => {
                                super::machine::remove_unstarted_dir(node.sandboxes_dir().join(&id))
                                    .await
                            }
                        }
                        *node.warm_making.locked() = None;
                        // Do not spin on a node that cannot make sandboxes.
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
            node.refilling.send_replace(false);
        });
    }

    pub(crate) fn drain_warm(self: &Arc<Self>) {
        let warm: Vec<Warm> = self.warm.locked().drain(..).collect();
        for w in warm {
            let sb = self.live.locked().remove(&w.sandbox.id);
            if let Some(sb) = sb {
                self.teardown(sb);
            }
        }
    }
}
