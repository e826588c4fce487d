//! Snapshots and forks: a sandbox's processes (memory, open files, pipes, listening sockets)
//! and files saved at one instant while it runs on, in the node's `snapshots/<id>/`; a
//! sandbox made from one goes on from that instant with its own id, hostname, token, copy of
//! the files and network (its established connections dropped: it is a new machine). A fork
//! is a snapshot and sandboxes made from it, in one call. A snapshot outlives its sandbox.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use sbx_api::{ApiError, ErrorCode, SandboxCreate, SandboxObject, SandboxStatus, SnapshotObject};
use sbx_runtime::Sandbox;

use super::access::SandboxToken;
use super::{store_err, wrong_state, ExecSlot, Managed, StoredSpec, START_EXEC};
use crate::node::checkpoint::Checkpointer;
use crate::node::Node;
use crate::store::{ExecRow, SandboxRow, SnapshotRow};
use crate::sync::LockExt;

/// How long a snapshot waits for the uses of its sandbox going on to end.
const QUIET_WAIT: Duration = Duration::from_secs(5);
/// How long a sleep asked for waits for the uses of the sandbox to end before it cuts them.
const CUT_AFTER: Duration = Duration::from_secs(1);
/// The most sandboxes one fork makes.
pub(crate) const MAX_FORKS: u32 = 16;
/// The commands of the sandbox at the snapshot's instant, kept with it.
const EXECS_FILE: &str = "execs.json";
/// In a snapshot's directory, `copying-<id>` while sandbox `<id>` is being made from it.
const COPYING: &str = "copying-";

/// A command as a snapshot keeps it.
#[derive(serde::Serialize, serde::Deserialize)]
struct KeptExec {
    exec_id: String,
    command: String,
    tty: bool,
    encoding: String,
    created_at_ns: i64,
    final_json: Option<String>,
}

impl Node {
    pub(crate) fn snapshots_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("snapshots")
    }

    fn snapshot_object(&self, r: &SnapshotRow) -> SnapshotObject {
        let image = serde_json::from_str::<StoredSpec>(&r.spec)
            .map(|s| s.image)
            .unwrap_or_default();
        SnapshotObject {
            id: r.id.clone(),
            object: "snapshot".into(),
            name: r.name.clone(),
            status: if r.status == "ready" && !self.snapshots_dir().join(&r.id).is_dir() {
                "lost".into()
            } else {
                r.status.clone()
            },
            size_bytes: r.size_bytes,
            created_at: sbx_api::format_rfc3339_millis(i128::from(r.created_at_ns)),
            sandbox_id: r.sandbox_id.clone(),
            image,
        }
    }

    fn snapshot_row(&self, id_or_name: &str) -> Result<SnapshotRow, ApiError> {
        self.store
            .snapshots()
            .map_err(store_err)?
            .into_iter()
            .find(|r| r.id == id_or_name || r.name.as_deref() == Some(id_or_name))
            .ok_or_else(|| {
                ApiError::new(
                    ErrorCode::SnapshotNotFound,
                    format!("no snapshot {id_or_name} on this node"),
                )
            })
    }

    /// `GET /v1/snapshots`.
    pub fn list_snapshots(&self) -> Result<Vec<SnapshotObject>, ApiError> {
        Ok(self
            .store
            .snapshots()
            .map_err(store_err)?
            .iter()
            .map(|r| self.snapshot_object(r))
            .collect())
    }

    /// `GET /v1/snapshots/{id}`.
    pub fn get_snapshot(&self, id_or_name: &str) -> Result<SnapshotObject, ApiError> {
        self.snapshot_row(id_or_name)
            .map(|r| self.snapshot_object(&r))
    }

    /// `DELETE /v1/snapshots/{id}`: its files go; sandboxes made from it are their own.
    pub async fn delete_snapshot(&self, id_or_name: &str) -> Result<SnapshotObject, ApiError> {
        let r = self.snapshot_row(id_or_name)?;
        let dir = self.snapshots_dir().join(&r.id);
        let _ = tokio::task::spawn_blocking(move || sbx_runtime::driver::remove_dir(&dir)).await;
        self.store.delete_snapshot(&r.id).map_err(store_err)?;
        let mut o = self.snapshot_object(&r);
        o.status = "deleted".into();
        Ok(o)
    }

    /// `POST /v1/sandboxes/{id}/snapshots`.
    pub async fn snapshot_sandbox(
        self: &Arc<Self>,
        id: &str,
        name: Option<String>,
    ) -> Result<SnapshotObject, ApiError> {
        let ck = self.checkpointer()?;
        if let Some(n) = &name {
            if !sbx_api::valid_name(n) {
                return Err(ApiError::new(
                    ErrorCode::InvalidName,
                    format!("{n:?} is not a valid name"),
                )
                .with_param("name"));
            }
            if self.snapshot_row(n).is_ok() {
                return Err(ApiError::new(
                    ErrorCode::NameTaken,
                    format!("a snapshot is named {n}"),
                )
                .with_param("name"));
            }
        }
        let m = self.managed(id)?;
        // A copy would mount the same volumes (an exclusive one twice): not made.
        if !m.volumes().is_empty() {
            return Err(crate::node::not_served(
                "volumes",
                "snapshots or forks of a sandbox with volumes",
            ));
        }
        let _op = m.op.lock().await;
        let status = m.status();
        if status != SandboxStatus::Running {
            return Err(wrong_state(status, "be snapshotted"));
        }
        let sb = m
            .machine()
            .ok_or_else(|| wrong_state(SandboxStatus::Starting, "be snapshotted"))?;
        let row = SnapshotRow {
            id: sbx_api::new_id("snap"),
            name,
            sandbox_id: m.id.clone(),
            status: "ready".into(),
            size_bytes: 0,
            created_at_ns: crate::image::now_ns() as i64,
            spec: serde_json::to_string(&m.spec)
                .map_err(crate::node::internal("a sandbox's spec as JSON"))?,
        };
        let dir = self.snapshots_dir().join(&row.id);
        // The request that asks is a use of the sandbox itself (the edge counts it).
        self.quiesce(&m, 1, false).await?;
        let started = Instant::now();
        let kept: Vec<KeptExec> = self
            .store
            .execs(&m.id)
            .unwrap_or_default()
            .into_iter()
            .filter(|e| e.boot == m.boot() && e.exec_id != START_EXEC)
            .map(|e| KeptExec {
                exec_id: e.exec_id,
                command: e.command,
                tty: e.tty,
                encoding: e.encoding,
                created_at_ns: e.created_at_ns,
                final_json: e.final_json,
            })
            .collect();
        let (sb2, dir2) = (sb.clone(), dir.clone());
        let network = m.spec.network && self.net.as_ref().is_some();
        if let Err(e) = self.hold_traffic(&m, true) {
            self.unquiesce(&m, &sb).await;
            return Err(e);
        }
        let took = tokio::task::spawn_blocking(move || -> Result<u64, String> {
            std::fs::create_dir_all(&dir2).map_err(|e| e.to_string())?;
            let json = serde_json::to_vec(&kept).map_err(|e| e.to_string())?;
            std::fs::write(dir2.join(EXECS_FILE), json).map_err(|e| e.to_string())?;
            ck.snapshot(&sb2, &dir2, network)
        })
        .await;
        let _ = self.hold_traffic(&m, false);
        self.unquiesce(&m, &sb).await;
        let size = match took {
            Ok(Ok(size)) => size,
            Ok(Err(why)) => {
                let _ = std::fs::remove_dir_all(&dir);
                tracing::error!(sandbox = %m.id, error = %why, "snapshot");
                return Err(ApiError::new(
                    ErrorCode::Internal,
                    format!("the snapshot could not be taken: {why}"),
                ));
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(crate::node::internal("a snapshot's thread")(e));
            }
        };
        let row = SnapshotRow {
            size_bytes: size,
            ..row
        };
        if let Err(e) = self.store.insert_snapshot(&row) {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(store_err(e));
        }
        tracing::info!(sandbox = %m.id, snapshot = %row.id, ms = started.elapsed().as_millis() as u64, bytes = size, "snapshot");
        self.replicate_snapshot(&row.id, &m.id, super::sleep::replica_image(&m), &dir)
            .await;
        Ok(self.snapshot_object(&row))
    }

    /// `POST /v1/sandboxes/{id}/fork {count}`: a snapshot, and `count` sandboxes made from it.
    pub async fn fork_sandbox(
        self: &Arc<Self>,
        id: &str,
        count: u32,
    ) -> Result<(SnapshotObject, Vec<SandboxObject>), ApiError> {
        if !(1..=MAX_FORKS).contains(&count) {
            return Err(ApiError::invalid_field(
                "count",
                format!("count must be from 1 to {MAX_FORKS}"),
            ));
        }
        let snap = self.snapshot_sandbox(id, None).await?;
        // Made side by side, as many at once as the node has cores (each is a restore by a
        // criu of its own), answered in order.
        let at_once = std::thread::available_parallelism().map_or(1, |n| n.get());
        let results: Vec<Result<SandboxObject, ApiError>> =
            futures_util::stream::iter((0..count).map(|_| {
                self.create_from_snapshot(SandboxCreate {
                    network: None,
                    spec: sbx_api::RunRequest {
                        snapshot: Some(snap.id.clone()),
                        ..sbx_api::RunRequest::new(sbx_api::Command::Argv(Vec::new()))
                    },
                })
            }))
            .buffered(at_once)
            .collect()
            .await;
        let mut made = Vec::with_capacity(results.len());
        let mut failed = None;
        for r in results {
            match r {
                Ok(o) => made.push(o),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        if let Some(e) = failed {
            // All or nothing: what this call made goes (the caller is told none of its ids).
            for o in &made {
                let _ = self.delete_sandbox(&o.id).await;
            }
            let _ = self.delete_snapshot(&snap.id).await;
            return Err(e);
        }
        Ok((snap, made))
    }

    /// `POST /v1/sandboxes {"snapshot": …}`: a sandbox that goes on from the snapshot.
    pub(crate) async fn create_from_snapshot(
        self: &Arc<Self>,
        c: SandboxCreate,
    ) -> Result<SandboxObject, ApiError> {
        if self.is_stopping() {
            return Err(crate::node::stopping_error());
        }
        let ck = self.checkpointer()?;
        let req = c.spec;
        let snap_id = req.snapshot.clone().unwrap_or_default();
        let snap = self
            .snapshot_row(&snap_id)
            .map_err(|e| e.with_param("snapshot"))?;
        let dir = self.snapshots_dir().join(&snap.id);
        if snap.status != "ready" || !dir.is_dir() {
            return Err(ApiError::new(
                ErrorCode::SnapshotLost,
                format!("snapshot {} is lost: its files are gone", snap.id),
            )
            .with_param("snapshot"));
        }
        let mut spec: StoredSpec =
            serde_json::from_str(&snap.spec).map_err(crate::node::internal("a snapshot's spec"))?;
        // Its shape is the snapshot's.
        let l = &req.limits;
        if l.vcpus.is_some_and(|v| v != spec.vcpus)
            || l.memory_bytes.is_some_and(|b| b != spec.memory_bytes)
        {
            return Err(ApiError::invalid_field(
                "limits",
                "a sandbox made from a snapshot has the snapshot's shape",
            ));
        }
        // What is the new sandbox's own: its name, token, metadata, rules, expiry, sleep.
        spec.hostname = None;
        spec.token = Some(SandboxToken::new()?);
        if !req.metadata.is_empty() {
            spec.metadata = req.metadata.clone();
        }
        if let Some(e) = super::egress::egress_of(req.egress.as_ref())? {
            spec.egress = Some(e);
        }
        spec.expires_at = req.expires_at.clone();
        spec.sleep_after = super::sleep::SleepAfter::from_request(req.sleep_after_seconds);
        spec.suspend_after_ms = req.suspend_after_ms;
        spec.sleep_notice_ms = req.sleep_notice_ms;
        spec.sleep_hold_max_ms = req.sleep_hold_max_ms;
        if spec.network && !self.has_net() {
            spec.network = false;
        }
        self.check_egress(spec.egress.as_ref(), spec.network)?;
        let expires_in_ms = match &spec.expires_at {
            Some(at) => Some(crate::node::machine::expires_in_ms(at)?),
            None => None,
        };
        let admission = self.admission.locked();
        self.check_capacity()?;
        let id = sbx_api::new_id("sbx");
        let row = SandboxRow::starting(&id, req.name.clone(), &spec)?;
        self.reserve_name(req.name.as_deref(), &id)?;
        let m = self.keep(row, spec, expires_in_ms)?;
        drop(admission);
        let _op = m.op.lock().await;
        // Kept until the copy runs (or failed): a node killed meanwhile removes the half-made
        // copy at its start ([`Node::half_made_copies`]).
        let copying = dir.join(format!("{COPYING}{id}"));
        if let Err(e) = std::fs::write(&copying, b"") {
            tracing::warn!(sandbox = %m.id, error = %e, "the mark of a copy being made");
        }
        let made = self.restore_into(&m, &dir, ck).await;
        if let Err(e) = made {
            self.set_failed(&m, "boot_failed", &e.message);
            let _ = std::fs::remove_file(&copying);
            return Err(ApiError::new(ErrorCode::SandboxFailed, e.message));
        }
        let _ = std::fs::remove_file(&copying);
        Ok(self.sandbox_object(&m))
    }

    async fn restore_into(
        self: &Arc<Self>,
        m: &Arc<Managed>,
        dir: &std::path::Path,
        ck: Arc<dyn Checkpointer>,
    ) -> Result<(), ApiError> {
        let started = Instant::now();
        let (mut spec, resolved) = self.machine_spec(m).await.map_err(|(_, e)| e)?;
        let mut place = None;
        if m.spec.network {
            if let Some(net) = self.net.as_ref() {
                let (p, _) = net.keep_or_take(&m.id, &mut spec).map_err(|e| {
                    ApiError::new(
                        ErrorCode::Unavailable,
                        format!("no network for the sandbox: {e}"),
                    )
                })?;
                place = Some(p);
            }
        }
        let dir2 = dir.to_path_buf();
        let made = tokio::task::spawn_blocking(move || ck.restore_copy(&spec, &dir2, place))
            .await
            .map_err(crate::node::internal("a restore's thread"))?;
        let sb: Arc<Sandbox> = match made {
            Ok(sb) => Arc::new(sb),
            Err(why) => {
                self.release_net(&m.id);
                tracing::error!(sandbox = %m.id, error = %why, "restore from a snapshot");
                return Err(ApiError::new(
                    ErrorCode::Internal,
                    format!("the sandbox could not be made from the snapshot: {why}"),
                ));
            }
        };
        crate::node::checkpoint::after(&sb).await.ok();
        *m.machine.locked() = Some(sb.clone());
        if let Some(net) = self.net.as_ref().filter(|_| m.spec.network) {
            if let Err(e) = net.follow(&m.id, &sb) {
                tracing::error!(sandbox = %m.id, error = %e, "the network of a restored sandbox");
            }
        }
        if let Err(e) = self.apply_egress_of(m) {
            tracing::error!(sandbox = %m.id, error = %e.message, "egress rules of a restored sandbox");
        }
        self.watch_agent(m, &sb);
        *m.resolved.locked() = resolved;
        // Its commands as they were at the snapshot's instant, under their ids.
        let kept: Vec<KeptExec> = std::fs::read(dir.join(EXECS_FILE))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        for k in kept {
            let row = ExecRow {
                sandbox_id: m.id.clone(),
                exec_id: k.exec_id,
                command: k.command,
                tty: k.tty,
                encoding: k.encoding,
                created_at_ns: k.created_at_ns,
                boot: 0,
                final_json: k.final_json.map(|j| with_sandbox_id(&j, &m.id)),
            };
            if self.store.insert_exec(&row, true).is_err() {
                continue;
            }
            if row.final_json.is_none() {
                let slot = ExecSlot::hold(m, &row.exec_id);
                self.watch_exec(m.clone(), sb.clone(), row, slot);
            }
        }
        let mut row = m.row.locked();
        row.status = "running".into();
        row.pid = Some(sb.pid);
        row.start_time = sb.start_time;
        row.started_at_ns = Some(crate::image::now_ns() as i64);
        self.store.update_sandbox(&row).map_err(store_err)?;
        tracing::info!(sandbox = %m.id, ms = started.elapsed().as_millis() as u64, "made from a snapshot");
        Ok(())
    }

    /// At start: the sandboxes a node killed midway was making from snapshots (a fork, a
    /// create from a snapshot): their marks are in the snapshots' directories.
    pub(crate) fn half_made_copies(&self) -> std::collections::HashSet<String> {
        let mut out = std::collections::HashSet::new();
        for snap in std::fs::read_dir(self.snapshots_dir())
            .into_iter()
            .flatten()
            .flatten()
        {
            for e in std::fs::read_dir(snap.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                if let Some(id) = e.file_name().to_str().and_then(|n| n.strip_prefix(COPYING)) {
                    out.insert(id.to_string());
                }
            }
        }
        out
    }

    /// At start, after the sandboxes are adopted: the marks of copies being made are gone
    /// (each half-made copy was removed), and so is every snapshot directory without a row:
    /// a snapshot a node killed midway was taking (its sandbox runs on; no snapshot of it
    /// is listed).
    pub(crate) fn tidy_snapshots(&self) {
        let listed: std::collections::HashSet<String> = match self.store.snapshots() {
            Ok(rows) => rows.into_iter().map(|r| r.id).collect(),
            Err(e) => {
                tracing::warn!(error = %e, "snapshots at start");
                return;
            }
        };
        for snap in std::fs::read_dir(self.snapshots_dir())
            .into_iter()
            .flatten()
            .flatten()
        {
            let path = snap.path();
            let known = snap
                .file_name()
                .to_str()
                .is_some_and(|n| listed.contains(n));
            if !known {
                tracing::info!(snapshot = %path.display(), "a snapshot the previous node did not finish: removed");
                let _ = sbx_runtime::driver::remove_dir(&path);
                continue;
            }
            for e in std::fs::read_dir(&path).into_iter().flatten().flatten() {
                if e.file_name()
                    .to_str()
                    .is_some_and(|n| n.starts_with(COPYING))
                {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }

    /// Before a checkpoint of a running sandbox: no use of it but `own` goes on (waits a
    /// moment), none starts until [`Node::unquiesce`], and the node's connections to its
    /// agent are closed (an open one cannot be checkpointed).
    pub(crate) async fn quiesce(
        &self,
        m: &Arc<Managed>,
        own: u32,
        cut: bool,
    ) -> Result<(), ApiError> {
        let start = Instant::now();
        let end = start + QUIET_WAIT;
        let mut cut_sent = false;
        loop {
            {
                let mut idle = m.idle.locked();
                if idle.users <= own {
                    idle.changing = true;
                    break;
                }
                if cut && !cut_sent && start.elapsed() >= CUT_AFTER {
                    tracing::info!(sandbox = %m.id, uses = idle.users - own, "a sleep asked for cuts the uses still open");
                    m.cut.send_modify(|n| *n += 1);
                    cut_sent = true;
                }
                if Instant::now() >= end {
                    return Err(ApiError::new(
                        ErrorCode::Unavailable,
                        "the sandbox is in use (a stream, a terminal or a transfer is open): try again once that ends",
                    ));
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let Some(sb) = m.machine() else {
            m.idle.locked().changing = false;
            return Err(wrong_state(SandboxStatus::Starting, "be checkpointed"));
        };
        if self.is_paused(m) {
            if let Err(e) = sb.set_paused(false) {
                m.idle.locked().changing = false;
                tracing::error!(sandbox = %m.id, error = %e, "thaw before a checkpoint");
                return Err(ApiError::internal());
            }
            self.forget_pause(m);
        }
        m.asleep.send_replace(true);
        let let_go = Instant::now() + Duration::from_secs(2);
        while m.attached.load(std::sync::atomic::Ordering::SeqCst) > 0 && Instant::now() < let_go {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if let Err(e) = crate::node::checkpoint::before(&sb).await {
            self.unquiesce(m, &sb).await;
            tracing::error!(sandbox = %m.id, error = %e, "the agent before a checkpoint");
            return Err(ApiError::new(
                ErrorCode::Internal,
                format!("the sandbox's agent could not be readied for a checkpoint: {e}"),
            ));
        }
        Ok(())
    }

    /// After a checkpoint that `sb` runs on from: its agent is told, uses go on.
    pub(crate) async fn unquiesce(&self, m: &Arc<Managed>, sb: &Sandbox) {
        crate::node::checkpoint::after(sb).await.ok();
        m.asleep.send_replace(false);
        m.idle.locked().changing = false;
    }
}

/// A command's final object (JSON) with `sandbox_id` set to `id` (where it names one).
fn with_sandbox_id(json: &str, id: &str) -> String {
    match serde_json::from_str::<serde_json::Value>(json) {
        Ok(mut v) => {
            if let Some(o) = v.as_object_mut() {
                if o.contains_key("sandbox_id") {
                    o.insert("sandbox_id".into(), serde_json::json!(id));
                }
            }
            v.to_string()
        }
        Err(_) => json.to_string(),
    }
}
