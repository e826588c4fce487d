//! The old node's side of a move (`POST /internal/sandboxes/{id}/release`, `…/forget`, and the
//! take-back of a reclaim that `move_in.rs`'s takeover calls).
//!
//! - **Release** at the epoch the node holds the sandbox at: a running sandbox is put to sleep
//!   (the normal sleep; its streams, waits and terminals end with `sandbox_moved` as it
//!   begins), then the node waits until its store holds that sleep (`Node::last_stored`), then
//!   the sandbox is fenced: the table `moved` of the node's store keeps its epoch, where it
//!   went, the move and the answer (a release asked again for the same move answers the same).
//!   A fenced sandbox stays in the node's table, asleep (its files kept for a take-back or a
//!   new node on the same machine), but it is not the node's: every call for it answers 409
//!   `moved` (`Node::managed`), it is not listed, not counted against `max_sandboxes`, never
//!   woken, and its expiry does nothing. It survives the node's restart so (the row `moved`).
//! - **Forget** removes what the node keeps of a sandbox (released, or held at an epoch up to
//!   the forget's: a takeover the control plane abandons) as a delete does, and leaves a
//!   tombstone: later calls for it answer `moved`; its name is free again.
//! - **Take-back** (a reclaim, epoch E+2): the released copy is held again at the new epoch,
//!   unfenced, and woken if asked.

use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sbx_api::moves::{
    ForgetAnswer, ForgetRequest, LocalCopy, ReleaseAnswer, ReleaseRequest, StoredSleep,
    TakeoverAnswer, TakeoverSource,
};
use sbx_api::{ApiError, ErrorCode, SandboxStatus};
use serde_json::json;

use super::move_in::host_id;
use super::{not_found, store_err, wrong_state, Managed};
use crate::node::checkpoint::images_dir;
use crate::node::replica::{generation_of, UploadKind};
use crate::node::Node;
use crate::store::MovedRow;
use crate::sync::LockExt;

/// How long a release waits for the store to hold the sleep before it answers `copy_behind`.
const STORE_WAIT: Duration = Duration::from_secs(30);
/// How often it looks.
const STORE_POLL: Duration = Duration::from_millis(100);
/// The status a row has on disk while its sandbox is being removed (as a delete writes it: a
/// node killed meanwhile finishes the removal at its start).
const DELETING: &str = "deleting";

/// Where a sandbox being moved goes: what its streams' `sandbox_moved` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MoveNote {
    pub to: Option<String>,
    pub epoch: u64,
}

/// 409 `moved`: the sandbox is another node's (`to`, at `epoch`).
pub(crate) fn moved(to: Option<&str>, epoch: u64) -> ApiError {
    let whom = to.map_or_else(|| "another node".to_string(), |t| format!("node {t}"));
    ApiError::new(
        ErrorCode::Moved,
        format!(
            "the sandbox was moved to {whom} (epoch {epoch}): call it through the control plane"
        ),
    )
    .with_beside("to", json!(to))
    .with_beside("epoch", json!(epoch))
}

/// `sandbox_moved`: a stream, wait or terminal ended by a release (`offset`, `exec_id` are
/// added by who knows them).
pub(crate) fn sandbox_moved(note: &MoveNote) -> ApiError {
    let whom = note
        .to
        .as_deref()
        .map_or_else(|| "another node".to_string(), |t| format!("node {t}"));
    ApiError::new(
        ErrorCode::SandboxMoved,
        format!(
            "the sandbox is being moved to {whom} (epoch {}): read on from where this ended through the control plane",
            note.epoch
        ),
    )
    .with_beside("to", json!(note.to))
    .with_beside("epoch", json!(note.epoch))
}

/// 409 `wrong_epoch`: the node holds (or released) the sandbox at `at`, not at `asked`.
fn wrong_epoch(at: u64, asked: u64, how: &str) -> ApiError {
    ApiError::new(
        ErrorCode::WrongEpoch,
        format!("this node {how} the sandbox at epoch {at}, not {asked}"),
    )
    .with_param("epoch")
    .with_beside("epoch", json!(at))
}

fn not_movable(why: &str) -> ApiError {
    ApiError::new(ErrorCode::NotMovable, why.to_string())
}

/// The bytes of the files under `dir` (0 where it cannot be read).
fn tree_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) => total += m.len(),
                Err(_) => {}
            }
        }
    }
    total
}

impl Node {
    /// Kept sandbox `id` (by id only: the control plane names sandboxes so), released or not.
    fn entry_by_id(&self, id: &str) -> Option<Arc<Managed>> {
        self.managed.locked().get(id).cloned()
    }

    /// 409 `moved` for sandbox `id` when it is released or forgotten here. `in_table`: the
    /// node's table has it (a tombstone then is older than a takeover that brought it back).
    pub(crate) fn moved_error(&self, id: &str, in_table: bool) -> Option<ApiError> {
        let row = self.store.moved(id)?;
        if !row.kept && in_table {
            return None;
        }
        Some(moved(row.to.as_deref(), row.epoch))
    }

    /// Refuses the wake of `m` while it is released (409 `moved`) or being released (503
    /// `unavailable`, asked again in a moment).
    pub(crate) fn refuse_wake_if_moving(&self, m: &Managed) -> Result<(), ApiError> {
        if let Some(e) = self.moved_error(&m.id, true) {
            return Err(e);
        }
        if m.moving.borrow().is_some() {
            return Err(ApiError::new(
                ErrorCode::Unavailable,
                "the sandbox is being moved to another node: ask again in a moment",
            ));
        }
        Ok(())
    }

    /// Resolves with `sandbox_moved` once a release begins on kept sandbox `id_or_name` (at
    /// once if one has); never for a sandbox the node does not keep. A stream, a wait or a
    /// terminal of it ends with that error.
    pub fn moved_signal(
        &self,
        id_or_name: &str,
    ) -> impl Future<Output = ApiError> + Send + 'static {
        let rx = self.managed_entry(id_or_name).map(|m| m.moving.subscribe());
        async move {
            let note = match rx {
                Some(mut rx) => match rx.wait_for(|n| n.is_some()).await {
                    Ok(n) => n.clone(),
                    Err(_) => None,
                },
                None => None,
            };
            match note {
                Some(n) => sandbox_moved(&n),
                None => std::future::pending().await,
            }
        }
    }

    /// The highest epoch the node knows sandbox `id` at: held, released or forgotten.
    pub(crate) fn known_epoch(&self, id: &str) -> Option<u64> {
        let held = self
            .entry_by_id(id)
            .is_some()
            .then(|| self.sandbox_epoch(id));
        let moved = self.store.moved(id).map(|r| r.epoch);
        held.max(moved)
    }

    /// `POST /internal/sandboxes/{id}/release`: puts the sandbox to sleep if it runs, waits
    /// until the store holds that sleep, and fences it (see the module's notes).
    pub async fn release_sandbox(
        self: &Arc<Self>,
        id: &str,
        r: ReleaseRequest,
    ) -> Result<ReleaseAnswer, ApiError> {
        let m = self.entry_by_id(id);
        if let Some(done) = self.store.moved(id) {
            if done.kept || m.is_none() {
                return released_before(id, &done, &r);
            }
        }
        // A fenced node releases nothing (asked again once it renews its lease).
        if let Some(e) = self.fence_error() {
            return Err(e);
        }
        let Some(m) = m else {
            return Err(not_found(id));
        };
        if self.replica_store().is_none() {
            return Err(not_movable(
                "this node has no store (--store): its sandboxes cannot be moved",
            ));
        }
        let held = self.sandbox_epoch(id);
        if held != r.epoch {
            return Err(wrong_epoch(held, r.epoch, "holds"));
        }
        if !m.volumes().is_empty() {
            return Err(not_movable(
                "the sandbox has volumes attached: a sandbox with volumes cannot be moved",
            ));
        }
        match m.status() {
            SandboxStatus::Running | SandboxStatus::Sleeping => {}
            s => return Err(wrong_state(s, "be moved")),
        }
        let note = MoveNote {
            to: Some(r.to.clone()),
            epoch: r.epoch,
        };
        // From here its streams end, and nothing wakes it.
        let claimed = m.moving.send_if_modified(|n| {
            if n.is_none() {
                *n = Some(note.clone());
                true
            } else {
                false
            }
        });
        if !claimed {
            return Err(ApiError::new(
                ErrorCode::Unavailable,
                "a release of the sandbox is under way: ask again in a moment",
            ));
        }
        let result = self.release_claimed(&m, &r).await;
        if result.is_err() && !self.store.is_moved(&m.id) {
            m.moving.send_replace(None);
        }
        result
    }

    async fn release_claimed(
        self: &Arc<Self>,
        m: &Arc<Managed>,
        r: &ReleaseRequest,
    ) -> Result<ReleaseAnswer, ApiError> {
        let slept = match m.status() {
            SandboxStatus::Running => {
                self.sleep_managed(m, true).await?;
                true
            }
            SandboxStatus::Sleeping => false,
            s => return Err(wrong_state(s, "be moved")),
        };
        let images = images_dir(&self.cfg.data_dir, &m.id);
        let Some(generation) = generation_of(&images) else {
            tracing::error!(sandbox = %m.id, "a sleeping sandbox without the images of its sleep");
            return Err(ApiError::new(
                ErrorCode::Internal,
                "the sandbox sleeps without the images of its sleep: it cannot be moved",
            ));
        };
        let stored = self.wait_stored(m, r.epoch, generation, slept).await?;
        // Fenced under its op lock: nothing changed it since (a delete, a restart, a wake
        // that came before the release).
        let _op = m.op.lock().await;
        let same = self
            .entry_by_id(&m.id)
            .is_some_and(|now| Arc::ptr_eq(&now, m));
        if !same {
            return Err(not_found(&m.id));
        }
        if m.status() != SandboxStatus::Sleeping || generation_of(&images) != Some(generation) {
            return Err(ApiError::new(
                ErrorCode::Unavailable,
                "the sandbox changed during its release (woken, slept again or restarted): ask again",
            ));
        }
        let build = self.replica_store().map(|s| s.build()).unwrap_or_default();
        let answer = ReleaseAnswer {
            sandbox_id: m.id.clone(),
            epoch: r.epoch,
            to: r.to.clone(),
            move_id: r.move_id.clone(),
            slept,
            stored: StoredSleep {
                epoch: stored.epoch,
                generation: stored.generation,
                build,
                image: super::sleep::replica_image(m),
                bytes: stored.bytes,
                stored_bytes: stored.stored_bytes,
            },
            waited_ms: stored.waited_ms,
            local: Some(LocalCopy {
                host: host_id(),
                memory: images.display().to_string(),
                disk: self
                    .sandboxes_dir()
                    .join(&m.id)
                    .join("upper")
                    .display()
                    .to_string(),
            }),
        };
        let json =
            serde_json::to_string(&answer).map_err(crate::node::internal("a release as JSON"))?;
        self.store
            .set_released(&MovedRow {
                id: m.id.clone(),
                epoch: r.epoch,
                to: Some(r.to.clone()),
                move_id: Some(r.move_id.clone()),
                answer: Some(json),
                kept: true,
            })
            .map_err(store_err)?;
        // Its expiry's timer is void: it is not this node's to end.
        m.expiry.locked().1 += 1;
        tracing::info!(sandbox = %m.id, epoch = r.epoch, to = %r.to, move_id = %r.move_id, slept, waited_ms = stored.waited_ms, "released");
        Ok(answer)
    }

    /// Waits (up to [`STORE_WAIT`]) until the store holds `m`'s sleep `generation` at
    /// `epoch`; 503 `copy_behind` after. A sleep made before the release (`slept` false) is
    /// staged again when the store does not hold it and no upload is under way (a node that
    /// took it over, or whose staging failed); the store holding it already, nothing is sent
    /// twice.
    async fn wait_stored(
        self: &Arc<Self>,
        m: &Arc<Managed>,
        epoch: u64,
        generation: u64,
        slept: bool,
    ) -> Result<Stored, ApiError> {
        let started = Instant::now();
        let mut staged = slept;
        loop {
            let last = self.last_stored(&m.id).filter(|s| {
                s.kind == UploadKind::Sleep && s.epoch == epoch && s.generation == generation
            });
            if let Some(s) = last {
                return Ok(Stored {
                    epoch: s.epoch,
                    generation: s.generation,
                    bytes: s.bytes,
                    stored_bytes: s.stored_bytes,
                    waited_ms: started.elapsed().as_millis() as u64,
                });
            }
            if !staged && self.uploads_idle(&m.id) {
                staged = true;
                self.restage_sleep(m).await;
                continue;
            }
            let waited = started.elapsed();
            if waited >= STORE_WAIT {
                let ms = waited.as_millis() as u64;
                tracing::warn!(sandbox = %m.id, epoch, generation, ms, "release: the store does not hold the sleep yet");
                return Err(ApiError::new(
                    ErrorCode::CopyBehind,
                    format!("the store does not hold the sandbox's sleep yet (waited {ms} ms); it stays asleep here: ask again"),
                )
                .with_beside("disk_ms", json!(ms))
                .with_beside("memory_ms", json!(ms)));
            }
            tokio::time::sleep(STORE_POLL).await;
        }
    }

    /// Whether no upload runs or waits (queued, or failed and to be tried again) that could be
    /// of `id`'s sleep: staging the same sleep again while one is under way would take its
    /// files from under it.
    fn uploads_idle(&self, id: &str) -> bool {
        self.replicas_info().is_some_and(|i| {
            i.queued == 0 && i.running == 0 && i.last_error.is_none_or(|e| e.id != id)
        })
    }

    /// `POST /internal/sandboxes/{id}/forget`: removes what the node keeps of the sandbox (a
    /// released copy, or one held at an epoch up to the forget's) and leaves a tombstone.
    pub async fn forget_sandbox(
        self: &Arc<Self>,
        id: &str,
        r: ForgetRequest,
    ) -> Result<ForgetAnswer, ApiError> {
        // A takeover of it under way (`move_in.rs`) ends first (done or undone): asked again
        // then, the forget removes what it made.
        if let Some(e) = self.takeover_error(id) {
            return Err(e);
        }
        let prior = self.store.moved(id);
        let mut tomb = MovedRow {
            id: id.to_string(),
            epoch: r.epoch,
            to: r.to.clone(),
            move_id: None,
            answer: None,
            kept: false,
        };
        let Some(m) = self.entry_by_id(id) else {
            // Nothing here: the tombstone alone (a higher one known stays).
            if let Some(p) = prior.filter(|p| p.epoch > r.epoch) {
                tomb.epoch = p.epoch;
                tomb.to = p.to;
            }
            self.store.forget_sandbox(&tomb).map_err(store_err)?;
            return Ok(ForgetAnswer {
                sandbox_id: id.to_string(),
                epoch: r.epoch,
                removed: false,
            });
        };
        let (at, how) = match prior.filter(|p| p.kept) {
            Some(p) => (p.epoch, "released"),
            None => (self.sandbox_epoch(id), "holds"),
        };
        if at > r.epoch {
            return Err(wrong_epoch(at, r.epoch, how));
        }
        self.remove_moved(&m, &tomb).await?;
        tracing::info!(sandbox = %id, epoch = r.epoch, "forgotten");
        Ok(ForgetAnswer {
            sandbox_id: id.to_string(),
            epoch: r.epoch,
            removed: true,
        })
    }

    /// Removes `m` as a delete does (its machine, saved processes, files, network, cgroups,
    /// rows and its commands') and records `tomb` with the removal of its rows.
    async fn remove_moved(
        self: &Arc<Self>,
        m: &Arc<Managed>,
        tomb: &MovedRow,
    ) -> Result<(), ApiError> {
        // Nothing wakes it from here; streams of it end.
        m.moving.send_replace(Some(MoveNote {
            to: tomb.to.clone(),
            epoch: tomb.epoch,
        }));
        if m.status() == SandboxStatus::Starting {
            m.cancel.cancel();
        }
        let _op = m.op.lock().await;
        {
            let mut row = m.row.locked();
            row.status = "stopping".into();
            let mut stored = row.clone();
            stored.status = DELETING.into();
            let _ = self.store.update_sandbox(&stored);
        }
        self.end_machine(m).await;
        let dir = self.sandboxes_dir().join(&m.id);
        let removed = tokio::task::spawn_blocking(move || sbx_runtime::driver::remove_dir(&dir))
            .await
            .map_err(crate::node::internal("a forget's thread"))?;
        if let Err(e) = removed {
            tracing::warn!(sandbox = %m.id, error = %e, "the files of a forgotten sandbox");
        }
        if let Err(e) = self.driver.remove_leftovers(&m.id) {
            tracing::warn!(sandbox = %m.id, error = %e, "the cgroups of a forgotten sandbox");
        }
        self.store.forget_sandbox(tomb).map_err(store_err)?;
        self.managed.locked().remove(&m.id);
        // The answer of a takeover that brought it here is void now (a takeover at that
        // epoch again must not be answered with it).
        self.drop_takeover_answer(&m.id);
        self.release_name(m.name().as_deref());
        m.expiry.locked().1 += 1;
        m.row.locked().status = "deleted".into();
        Ok(())
    }

    /// A reclaim (E+2): the released copy of `id` kept here is held again at `epoch`,
    /// unfenced, and woken if asked. `None`: no released copy of it is kept here.
    pub(crate) async fn take_back(
        self: &Arc<Self>,
        id: &str,
        epoch: u64,
        wake: bool,
    ) -> Result<Option<TakeoverAnswer>, ApiError> {
        let Some(fence) = self.store.moved(id).filter(|r| r.kept) else {
            return Ok(None);
        };
        let Some(m) = self.entry_by_id(id) else {
            return Ok(None);
        };
        if epoch <= fence.epoch {
            return Err(wrong_epoch(fence.epoch, epoch, "released"));
        }
        {
            let _op = m.op.lock().await;
            self.store.unfence(id, epoch).map_err(store_err)?;
            m.moving.send_replace(None);
        }
        // Its expiry is armed again, as after a restart (a timer armed before is void).
        m.expiry.locked().1 += 1;
        if let Some(at) = m
            .spec
            .expires_at
            .as_deref()
            .and_then(sbx_api::parse_rfc3339)
        {
            let left_ms = (at - crate::image::now_ns()).max(0) / 1_000_000;
            self.expire_at(&m, left_ms as u64 + 1);
        }
        let images = images_dir(&self.cfg.data_dir, id);
        let memory = tokio::task::spawn_blocking(move || tree_bytes(&images))
            .await
            .unwrap_or(0);
        tracing::info!(sandbox = %id, epoch, wake, "taken back");
        if wake {
            // It is this node's again whatever the wake does: one that fails leaves it asleep
            // (`woke` false), woken by its next use.
            if let Err(e) = self.wake_managed(&m).await {
                tracing::warn!(sandbox = %id, error = %e.message, "taken back, not woken");
            }
        }
        Ok(Some(TakeoverAnswer {
            sandbox_id: id.to_string(),
            epoch,
            source: TakeoverSource::Kept,
            disk_ms: 0,
            memory_ms: 0,
            memory,
            woke: m.status() == SandboxStatus::Running,
        }))
    }
}

/// What the store holds of a release's sleep, and how long the release waited for it.
struct Stored {
    epoch: u64,
    generation: u64,
    bytes: u64,
    stored_bytes: u64,
    waited_ms: u64,
}

/// A release of sandbox `id`, which this node released (or forgot) already as `done`: the same
/// move at the same epoch gets the same answer; another 409 `wrong_epoch`; a tombstone 404.
fn released_before(
    id: &str,
    done: &MovedRow,
    r: &ReleaseRequest,
) -> Result<ReleaseAnswer, ApiError> {
    if !done.kept {
        // A tombstone above the release's epoch (the fleet took it: `lease.rs`): the epoch
        // is not this node's.
        if r.epoch < done.epoch {
            let mut e = wrong_epoch(done.epoch, r.epoch, "knows");
            e.message = format!(
                "the fleet has the sandbox at epoch {} on {} now: this node no longer holds it",
                done.epoch,
                done.to.as_deref().unwrap_or("another node")
            );
            return Err(e);
        }
        return Err(not_found(id));
    }
    if done.move_id.as_deref() == Some(r.move_id.as_str()) && done.epoch == r.epoch {
        return done
            .answer
            .as_deref()
            .and_then(|j| serde_json::from_str(j).ok())
            .ok_or_else(|| {
                tracing::error!(sandbox = %id, "a release's answer unreadable in the store");
                ApiError::internal()
            });
    }
    let mut e = wrong_epoch(done.epoch, r.epoch, "released");
    e.message = format!(
        "this node released the sandbox at epoch {} to {} (move {}): it no longer holds it",
        done.epoch,
        done.to.as_deref().unwrap_or("another node"),
        done.move_id.as_deref().unwrap_or("?")
    );
    Err(e)
}
