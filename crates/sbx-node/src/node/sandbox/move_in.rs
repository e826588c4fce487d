//! Takeover: the new node's side of a move (`POST /internal/sandboxes/{id}/takeover`, asked by
//! the control plane). The old node released the sandbox at epoch E (asleep, its last sleep in
//! the store); this node makes it its own at the request's epoch:
//!
//! - **Checks.** The epoch is above every epoch the node knows the sandbox at (else 409
//!   `wrong_epoch`); a copy this node released itself is taken back (`move_out.rs`, source
//!   `kept`); a reclaim without one is 404. The store's latest sleep below the epoch is read
//!   (none: 502 `takeover_failed`); its build must be this node's (else 409 `build_missing`,
//!   `build` beside) and the image its disk is over this node's or pullable here (else 409
//!   `image_missing`, `image` beside).
//! - **Files.** Its disk (the overlay's `upper`) goes into a new directory of the node's
//!   sandboxes (its btrfs subvolume with the node's limit, as a create makes it) and CRIU's
//!   images where a sleeping sandbox's are (`DATA_DIR/sleep/<id>`): copied from the old node's
//!   places where it released it on this machine (`from.local`, its host this one's; source
//!   `disk`), else unpacked from the store (source `store`). The images are marked as another
//!   node's ([`sbx_runtime::driver::MOVED`]): the wake puts its processes into this node's
//!   cgroups and drops its established connections (its address here is another).
//! - **Rows.** From the record its sleep carries (`replica.rs`, [`SandboxRecord`]): its row
//!   (`sleeping`, id, name, created and started times, token and secret variables sealed
//!   again with this node's key), its commands' rows, its epoch. It is then a sleeping
//!   sandbox of this node, as if it had slept here, and is woken by the normal wake path if
//!   asked (a new network address of this node's range).
//! - **Under way.** A mark `DATA_DIR/takeover/<id>` is made first (exclusively: a second
//!   takeover of it meanwhile is 503) and removed last; calls for the sandbox meanwhile answer
//!   503 `unavailable` (Retry-After: 1). A failure removes everything it made; a node killed
//!   midway removes it at its next start ([`Node::remove_half_made_takeovers`]). The answer is
//!   kept (`<id>.done`): the same takeover asked again gets it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use base64::Engine;
use sbx_api::moves::{TakeoverAnswer, TakeoverRequest, TakeoverSource};
use sbx_api::{ApiError, ErrorCode};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::{not_found, store_err, Managed, StoredSpec};
use crate::image::Source;
use crate::node::replica::{
    RecordExec, ReplicaError, Replicas, SandboxRecord, SleepPart, StoredSleepRef,
};
use crate::node::Node;
use crate::store::{ExecRow, SandboxRow};
use crate::sync::LockExt;

/// The folder of the marks of takeovers under way and of the answers given.
const TAKEOVER: &str = "takeover";
/// The answer of a takeover done: `<id>.done`.
const DONE: &str = "done";
/// How a sandbox's token is sealed in its spec (`access.rs`'s `sealed_token`).
const TOKEN_PREFIX: &str = "sealed:v1:";
const TOKEN_AAD: &[u8] = b"sandbox_token";

/// What the mark of a takeover under way holds.
#[derive(Debug, Serialize, Deserialize)]
struct Mark {
    epoch: u64,
    /// The sandbox's name, once its record is read (calls by name answer 503 too).
    name: Option<String>,
}

/// A takeover's answer as kept for the same takeover asked again.
#[derive(Debug, Serialize, Deserialize)]
struct Done {
    epoch: u64,
    answer: TakeoverAnswer,
}

/// What went wrong placing a sandbox's files.
#[derive(Debug, thiserror::Error)]
enum PlaceError {
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the store: {0}")]
    Store(#[from] ReplicaError),
    #[error("a thread ended without an answer: {0}")]
    Thread(String),
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> PlaceError + 'a {
    move |source| PlaceError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// This machine and its boot, as a release's `local.host` names it: `/etc/machine-id`, `:`,
/// the boot id.
pub(crate) fn host_id() -> String {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    };
    format!(
        "{}:{}",
        read("/etc/machine-id"),
        read("/proc/sys/kernel/random/boot_id")
    )
}

fn takeover_failed(why: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::TakeoverFailed, why)
}

fn being_taken_over(id: &str) -> ApiError {
    ApiError::new(
        ErrorCode::Unavailable,
        format!("sandbox {id} is being taken over by this node: try again in a moment"),
    )
}

/// The plain bytes of the files under `dir`.
fn files_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) if m.is_file() => total += m.len(),
                _ => {}
            }
        }
    }
    total
}

/// `token` sealed with this node's key, as a spec keeps it.
fn seal_token(token: &str) -> Result<String, ApiError> {
    let key = crate::node::credentials::node_key()?;
    let sealed = key.seal(token.as_bytes(), TOKEN_AAD)?;
    Ok(format!(
        "{TOKEN_PREFIX}{}",
        base64::engine::general_purpose::STANDARD.encode(sealed)
    ))
}

/// The spec of a record (token and secret variables in clear) as this node keeps it.
fn import_spec(v: &Value) -> Result<StoredSpec, ApiError> {
    let mut v = v.clone();
    let Some(obj) = v.as_object_mut() else {
        return Err(takeover_failed("the sandbox's record has no spec"));
    };
    let token = match obj.remove("token") {
        Some(Value::String(t)) => Value::String(seal_token(&t)?),
        _ => Value::Null,
    };
    obj.insert("token".into(), token);
    serde_json::from_value(v).map_err(|e| {
        takeover_failed(format!(
            "the sandbox's record has a spec this node cannot read: {e}"
        ))
    })
}

impl Node {
    fn takeover_dir(&self) -> PathBuf {
        self.cfg.data_dir.join(TAKEOVER)
    }

    /// Sandbox `id`'s record as of now (its sleep's, taken under its op lock): its row, its
    /// spec with its token and secret variables in clear, its commands, `epoch`.
    pub(crate) fn sleep_record(&self, id: &str, epoch: u64) -> Result<SandboxRecord, ApiError> {
        let row = self
            .store
            .sandboxes()
            .map_err(store_err)?
            .into_iter()
            .find(|r| r.id == id)
            .ok_or_else(|| not_found(id))?;
        let spec: StoredSpec = serde_json::from_str(&row.spec)
            .map_err(crate::node::internal("a sandbox's spec for its record"))?;
        let mut v = serde_json::to_value(&spec)
            .map_err(crate::node::internal("a sandbox's spec for its record"))?;
        if let Some(o) = v.as_object_mut() {
            o.insert(
                "token".into(),
                spec.token
                    .as_ref()
                    .map_or(Value::Null, |t| json!(t.reveal())),
            );
            o.insert("secret_env".into(), json!(spec.secret_env));
        }
        let mut execs = Vec::new();
        for e in self.store.execs(id).map_err(store_err)? {
            let stdin_closed = self
                .store
                .exec_stdin_closed(id, &e.exec_id)
                .map_err(store_err)?;
            execs.push(RecordExec {
                exec_id: e.exec_id,
                command: e.command,
                tty: e.tty,
                encoding: e.encoding,
                created_at_ns: e.created_at_ns,
                boot: e.boot,
                final_json: e.final_json,
                stdin_closed,
            });
        }
        Ok(SandboxRecord {
            id: row.id,
            name: row.name,
            status: row.status,
            spec: v,
            created_at_ns: row.created_at_ns,
            started_at_ns: row.started_at_ns,
            restarts: row.restarts,
            failure_code: row.failure_code,
            failure: row.failure,
            epoch,
            execs,
        })
    }

    /// 503 `unavailable` for a sandbox (by id or name) this node is taking over now: the
    /// lookup of a sandbox it does not have asks.
    pub(crate) fn takeover_error(&self, id_or_name: &str) -> Option<ApiError> {
        let dir = self.takeover_dir();
        if sbx_api::is_id("sbx", id_or_name) {
            return dir
                .join(id_or_name)
                .is_file()
                .then(|| being_taken_over(id_or_name));
        }
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let id = e.file_name().to_string_lossy().into_owned();
            if !sbx_api::is_id("sbx", &id) {
                continue;
            }
            let named = std::fs::read(e.path())
                .ok()
                .and_then(|b| serde_json::from_slice::<Mark>(&b).ok())
                .and_then(|m| m.name)
                .is_some_and(|n| n == id_or_name);
            if named {
                return Some(being_taken_over(&id));
            }
        }
        None
    }

    /// The answer of the takeover of `id` at `epoch` this node did, if it holds it at that
    /// epoch still.
    fn takeover_done(&self, id: &str, epoch: u64) -> Option<TakeoverAnswer> {
        let path = self.takeover_dir().join(format!("{id}.{DONE}"));
        let done: Done = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
        let held = self.managed.locked().contains_key(id)
            && !self.store.is_moved(id)
            && self.store.sandbox_epoch(id).ok() == Some(epoch);
        (done.epoch == epoch && held).then_some(done.answer)
    }

    /// `POST /internal/sandboxes/{id}/takeover`.
    pub async fn takeover_sandbox(
        self: &Arc<Self>,
        id: &str,
        r: TakeoverRequest,
    ) -> Result<TakeoverAnswer, ApiError> {
        if !sbx_api::is_id("sbx", id) {
            return Err(not_found(id));
        }
        if self.is_stopping() {
            return Err(crate::node::stopping_error());
        }
        // A fenced node takes nothing over (asked again once it renews its lease).
        if let Some(e) = self.fence_error() {
            return Err(e);
        }
        if let Some(a) = self.takeover_done(id, r.epoch) {
            return Ok(a);
        }
        if let Some(known) = self.known_epoch(id) {
            if r.epoch <= known {
                return Err(ApiError::new(
                    ErrorCode::WrongEpoch,
                    format!(
                        "this node knows sandbox {id} at epoch {known}: a takeover is at a higher one"
                    ),
                )
                .with_param("epoch")
                .with_beside("epoch", json!(known)));
            }
        }
        if let Some(a) = self.take_back(id, r.epoch, r.wake).await? {
            // Kept as a takeover's is: the same reclaim asked again (its answer lost) gets it,
            // not `wrong_epoch` (the node holds it at that epoch now).
            let done = Done {
                epoch: r.epoch,
                answer: a.clone(),
            };
            self.keep_takeover_answer(id, &done);
            return Ok(a);
        }
        if r.reclaim {
            return Err(ApiError::new(
                ErrorCode::SandboxNotFound,
                format!("this node keeps no released copy of sandbox {id}"),
            ));
        }
        if self.managed.locked().contains_key(id) && !self.store.is_moved(id) {
            let held = self.store.sandbox_epoch(id).map_err(store_err)?;
            return Err(ApiError::new(
                ErrorCode::WrongEpoch,
                format!("this node holds sandbox {id} at epoch {held} (not released)"),
            )
            .with_param("epoch")
            .with_beside("epoch", json!(held)));
        }
        // The mark: made exclusively, so one takeover of it runs at a time.
        let dir = self.takeover_dir();
        let mark = dir.join(id);
        let made = std::fs::create_dir_all(&dir).and_then(|()| {
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&mark)
        });
        match made {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(being_taken_over(id))
            }
            Err(e) => return Err(crate::node::internal("the mark of a takeover")(e)),
        }
        self.write_mark(id, r.epoch, None);
        let started = Instant::now();
        match self.bring(id, &r).await {
            Ok(answer) => {
                let done = Done {
                    epoch: r.epoch,
                    answer: answer.clone(),
                };
                self.keep_takeover_answer(id, &done);
                let _ = std::fs::remove_file(&mark);
                tracing::info!(sandbox = %id, epoch = r.epoch, source = ?answer.source, disk_ms = answer.disk_ms, memory_ms = answer.memory_ms, woke = answer.woke, ms = started.elapsed().as_millis() as u64, "taken over");
                Ok(answer)
            }
            Err(e) => {
                tracing::warn!(sandbox = %id, epoch = r.epoch, error = %e.message, "a takeover failed: what it made is removed");
                let node = self.clone();
                let id2 = id.to_string();
                let _ = tokio::task::spawn_blocking(move || node.undo_takeover(&id2)).await;
                let _ = std::fs::remove_file(&mark);
                Err(e)
            }
        }
    }

    /// Writes the mark of the takeover of `id` (its epoch, its name once known).
    fn write_mark(&self, id: &str, epoch: u64, name: Option<String>) {
        let path = self.takeover_dir().join(id);
        let body = serde_json::to_vec(&Mark { epoch, name }).unwrap_or_default();
        if let Err(e) = std::fs::write(&path, body) {
            tracing::warn!(sandbox = %id, error = %e, "the mark of a takeover");
        }
    }

    /// Brings sandbox `id` here (the mark is made): checks, files, rows, the wake.
    async fn bring(
        self: &Arc<Self>,
        id: &str,
        r: &TakeoverRequest,
    ) -> Result<TakeoverAnswer, ApiError> {
        self.checkpointer()?;
        let store = self.replica_store().ok_or_else(|| {
            takeover_failed("this node has no store (--store): a sandbox's record is read from it")
        })?;
        let failed = |e: ReplicaError| takeover_failed(format!("the store: {e}"));
        let sleep = store
            .latest_sleep(id, r.epoch)
            .await
            .map_err(failed)?
            .ok_or_else(|| {
                takeover_failed(format!(
                    "the store holds no sleep of sandbox {id} below epoch {}",
                    r.epoch
                ))
            })?;
        let build = store.build();
        if sleep.build != build {
            return Err(ApiError::new(
                ErrorCode::BuildMissing,
                format!(
                    "the sandbox's memory was written by build {} and this node is build {build}: it cannot be woken here",
                    sleep.build
                ),
            )
            .with_beside("build", json!(sleep.build)));
        }
        if !sleep.has_record {
            return Err(takeover_failed(format!(
                "the sleep of sandbox {id} at epoch {} carries no record (an older node's)",
                sleep.epoch
            )));
        }
        let sealed = store.fetch_record(&sleep).await.map_err(failed)?;
        let bytes = crate::node::credentials::open_record(id, &sealed).ok_or_else(|| {
            takeover_failed(format!(
                "the record of sandbox {id} does not open with this node's store key \
                 (--store-key): every node of a fleet needs the same key file"
            ))
        })?;
        let record: SandboxRecord = serde_json::from_slice(&bytes)
            .map_err(|e| takeover_failed(format!("the sandbox's record: {e}")))?;
        if record.id != id {
            return Err(takeover_failed(format!(
                "the record of sandbox {id} is of {}",
                record.id
            )));
        }
        let spec = import_spec(&record.spec)?;
        if !spec.volumes.is_empty() {
            return Err(ApiError::new(
                ErrorCode::NotMovable,
                "a sandbox with volumes does not move between nodes",
            ));
        }
        self.write_mark(id, r.epoch, record.name.clone());
        self.image_here(&spec, &sleep).await?;
        {
            let _admission = self.admission.locked();
            self.check_capacity()?;
            self.reserve_name(record.name.as_deref(), id)?;
        }
        let (source, disk_ms, memory_ms) = match self.place_files(id, r, &sleep, store).await {
            Ok(x) => x,
            Err(e) => {
                tracing::error!(sandbox = %id, error = %e, "a takeover's files");
                return Err(takeover_failed(format!(
                    "the sandbox's files could not be brought here: {e}"
                )));
            }
        };
        let images = crate::node::checkpoint::images_dir(&self.cfg.data_dir, id);
        let memory = files_bytes(&images);
        let m = self.keep_taken(id, r.epoch, &record, spec, &sleep)?;
        let woke = if r.wake {
            self.wake_managed(&m).await?;
            true
        } else {
            false
        };
        // It is this node's: a tombstone of an earlier stay here goes.
        self.store.unfence(id, r.epoch).map_err(store_err)?;
        Ok(TakeoverAnswer {
            sandbox_id: id.to_string(),
            epoch: r.epoch,
            source,
            disk_ms,
            memory_ms,
            memory,
            woke,
        })
    }

    /// 409 `image_missing` (`image` beside) unless the image the sandbox's disk is over is in
    /// this node's store or can be pulled here (it is then).
    async fn image_here(&self, spec: &StoredSpec, sleep: &StoredSleepRef) -> Result<(), ApiError> {
        let name = if sleep.image.is_empty() {
            spec.image.clone()
        } else {
            sleep.image.clone()
        };
        let missing = |why: String| {
            ApiError::new(
                ErrorCode::ImageMissing,
                format!("the sandbox's image {name} cannot be had on this node: {why}"),
            )
            .with_beside("image", json!(name))
        };
        let (looked_up, creds) = match &spec.image_pull_secret {
            Some(secret) => match self.image_login(Some(&name), secret) {
                Ok((creds, source)) => (Ok(source), Some(creds)),
                Err(e) => return Err(missing(e.message)),
            },
            None => (self.images.lookup(Some(&name)), None),
        };
        match looked_up {
            Ok(Source::Local(_)) => Ok(()),
            Ok(Source::Remote(reference)) => self
                .images
                .pull(&reference, creds.as_ref(), &|_| {})
                .await
                .map(drop)
                .map_err(|e| missing(e.to_string())),
            Err(e) => Err(missing(e.to_string())),
        }
    }

    /// Places the sandbox's disk and memory where a sleeping sandbox's are: from the old
    /// node's files on this machine when the request names them, else from the store.
    /// Answers where from and how long each took (ms).
    async fn place_files(
        self: &Arc<Self>,
        id: &str,
        r: &TakeoverRequest,
        sleep: &StoredSleepRef,
        store: Arc<dyn Replicas>,
    ) -> Result<(TakeoverSource, u64, u64), PlaceError> {
        let dir = self.sandboxes_dir().join(id);
        let images = crate::node::checkpoint::images_dir(&self.cfg.data_dir, id);
        let disk_bytes = self.disk_info().disk_bytes;
        let (dir2, images2) = (dir.clone(), images.clone());
        tokio::task::spawn_blocking(move || -> Result<(), PlaceError> {
            make_sandbox_dir(&dir2, disk_bytes)?;
            if let Some(parent) = images2.parent() {
                std::fs::create_dir_all(parent).map_err(io("mkdir", parent))?;
            }
            Ok(())
        })
        .await
        .map_err(|e| PlaceError::Thread(e.to_string()))??;
        let local = r.from.local.as_ref().filter(|l| {
            if r.from_store || l.host != host_id() {
                return false;
            }
            let same = crate::node::replica::generation_of(Path::new(&l.memory))
                == Some(sleep.generation);
            if !same {
                tracing::info!(sandbox = %id, "the old node's files are not the stored sleep's: taken from the store");
            }
            same && Path::new(&l.disk).is_dir()
        });
        let (source, disk_ms, memory_ms) = match local {
            Some(l) => {
                let (from_disk, from_memory) = (PathBuf::from(&l.disk), PathBuf::from(&l.memory));
                let (upper, images2) = (dir.join("upper"), images.clone());
                tokio::task::spawn_blocking(move || -> Result<(u64, u64), PlaceError> {
                    let t = Instant::now();
                    sbx_runtime::tree::copy_tree(&from_disk, &upper)
                        .map_err(io("copy the old node's disk", &from_disk))?;
                    let disk_ms = t.elapsed().as_millis() as u64;
                    let t = Instant::now();
                    sbx_runtime::tree::copy_tree(&from_memory, &images2)
                        .map_err(io("copy the old node's memory", &from_memory))?;
                    Ok((disk_ms, t.elapsed().as_millis() as u64))
                })
                .await
                .map_err(|e| PlaceError::Thread(e.to_string()))?
                .map(|(d, m)| (TakeoverSource::Disk, d, m))?
            }
            None => {
                let t = Instant::now();
                store
                    .fetch_part(sleep, SleepPart::Disk, dir.join("upper"))
                    .await?;
                let disk_ms = t.elapsed().as_millis() as u64;
                let t = Instant::now();
                store
                    .fetch_part(sleep, SleepPart::Memory, images.clone())
                    .await?;
                (
                    TakeoverSource::Store,
                    disk_ms,
                    t.elapsed().as_millis() as u64,
                )
            }
        };
        for d in ["work", "rootfs"] {
            let p = dir.join(d);
            std::fs::create_dir_all(&p).map_err(io("mkdir", &p))?;
        }
        // Another node's images: its first wake here puts it into this node's cgroups.
        let moved = images.join(sbx_runtime::driver::MOVED);
        std::fs::write(&moved, b"").map_err(io("mark", &moved))?;
        Ok((source, disk_ms, memory_ms))
    }

    /// Records the sandbox of `record` as a sleeping sandbox of this node at `epoch`: its row,
    /// its commands' rows, its entry among the kept ones.
    fn keep_taken(
        self: &Arc<Self>,
        id: &str,
        epoch: u64,
        record: &SandboxRecord,
        spec: StoredSpec,
        sleep: &StoredSleepRef,
    ) -> Result<Arc<Managed>, ApiError> {
        let row = SandboxRow {
            id: id.to_string(),
            name: record.name.clone(),
            status: sbx_api::SandboxStatus::Sleeping.as_str().into(),
            spec: serde_json::to_string(&spec)
                .map_err(crate::node::internal("a sandbox's spec as JSON"))?,
            pid: None,
            start_time: None,
            created_at_ns: record.created_at_ns,
            started_at_ns: record.started_at_ns,
            failure_code: record.failure_code.clone(),
            failure: record.failure.clone(),
            restarts: record.restarts,
        };
        self.store.insert_sandbox(&row).map_err(store_err)?;
        self.store.set_sandbox_epoch(id, epoch).map_err(store_err)?;
        for e in &record.execs {
            let exec = ExecRow {
                sandbox_id: id.to_string(),
                exec_id: e.exec_id.clone(),
                command: e.command.clone(),
                tty: e.tty,
                encoding: e.encoding.clone(),
                created_at_ns: e.created_at_ns,
                boot: e.boot,
                final_json: e.final_json.clone(),
            };
            self.store
                .insert_exec(&exec, e.stdin_closed)
                .map_err(store_err)?;
        }
        let m = Arc::new(Managed::new(row, spec));
        // Its commands are watched once it is awake (as a sandbox asleep at the node's start).
        m.rewatch.store(true, std::sync::atomic::Ordering::SeqCst);
        {
            let mut resolved = m.resolved.locked();
            *resolved = self.resolve_adopted(&m.spec);
            resolved.digest = sleep.image.split_once('@').map(|(_, d)| d.to_string());
        }
        self.managed.locked().insert(m.id.clone(), m.clone());
        if let Some(at) = m
            .spec
            .expires_at
            .as_deref()
            .and_then(sbx_api::parse_rfc3339)
        {
            let left_ms = (at - crate::image::now_ns()).max(0) / 1_000_000;
            self.expire_at(&m, left_ms as u64 + 1);
        }
        Ok(m)
    }

    /// Removes whatever a takeover of `id` made (blocking): its entry, name, rows, files,
    /// images, cgroups and network.
    fn undo_takeover(&self, id: &str) {
        let m = self.managed.locked().remove(id);
        if let Some(m) = &m {
            if let Some(sb) = m.machine.locked().take() {
                crate::agent::close_idle(&sb.socket);
                if let Err(e) = self.driver.destroy(&sb) {
                    tracing::warn!(sandbox = %id, error = %e, "ending a sandbox taken over in part");
                }
            }
        }
        let name = m.as_ref().and_then(|m| m.name()).or_else(|| {
            std::fs::read(self.takeover_dir().join(id))
                .ok()
                .and_then(|b| serde_json::from_slice::<Mark>(&b).ok())
                .and_then(|mk| mk.name)
        });
        if let Some(n) = name {
            let ours = self.table.locked().names.get(&n).is_some_and(|o| o == id);
            if ours {
                self.release_name(Some(&n));
            }
        }
        if let Err(e) = self.store.delete_sandbox(id) {
            tracing::error!(sandbox = %id, error = %e, "the rows of a sandbox taken over in part");
        }
        let _ = self.driver.remove_leftovers(id);
        let dir = self.sandboxes_dir().join(id);
        if let Err(e) = sbx_runtime::driver::remove_dir(&dir) {
            tracing::warn!(sandbox = %id, error = %e, "the directory of a sandbox taken over in part");
        }
        let images = crate::node::checkpoint::images_dir(&self.cfg.data_dir, id);
        crate::node::checkpoint::remove_spent(&images);
        let _ = std::fs::remove_dir_all(&images);
        self.release_net(id);
        self.drop_takeover_answer(id);
    }

    /// Keeps the answer of a takeover (or reclaim) of `id` done (`<id>.done`).
    fn keep_takeover_answer(&self, id: &str, done: &Done) {
        let dir = self.takeover_dir();
        let path = dir.join(format!("{id}.{DONE}"));
        if let Err(e) = std::fs::create_dir_all(&dir)
            .and_then(|()| serde_json::to_vec(done).map_err(std::io::Error::other))
            .and_then(|b| std::fs::write(&path, b))
        {
            tracing::warn!(sandbox = %id, error = %e, "the answer of a takeover not kept");
        }
    }

    /// Removes the kept answer of a takeover of `id` (the sandbox is gone from this node).
    pub(crate) fn drop_takeover_answer(&self, id: &str) {
        let path = self.takeover_dir().join(format!("{id}.{DONE}"));
        if let Err(e) = std::fs::remove_file(&path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(sandbox = %id, error = %e, "the answer of a takeover stays");
            }
        }
    }

    /// At the node's start (after `recover`, before anything is staged or served): every
    /// takeover a killed node left under way is removed whole, and the answers of takeovers
    /// of sandboxes the node no longer has go.
    pub(crate) fn remove_half_made_takeovers(&self) {
        let dir = self.takeover_dir();
        let Ok(rd) = std::fs::read_dir(&dir) else {
            return;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if sbx_api::is_id("sbx", &name) {
                tracing::info!(sandbox = %name, "a takeover the previous node did not finish: removed");
                self.undo_takeover(&name);
                let _ = std::fs::remove_file(e.path());
            } else if let Some(id) = name.strip_suffix(&format!(".{DONE}")) {
                if !self.managed.locked().contains_key(id) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }
}

/// Makes a sandbox's directory as the driver does: a subvolume of the node's disk with its
/// limit where the sandboxes' folder is on it, else a plain directory. One that is there (a
/// takeover cut short, removed at start) is refused.
fn make_sandbox_dir(dir: &Path, disk_bytes: Option<u64>) -> Result<(), PlaceError> {
    if dir.exists() {
        return Err(PlaceError::Io {
            what: "make",
            path: dir.to_path_buf(),
            source: std::io::Error::from(std::io::ErrorKind::AlreadyExists),
        });
    }
    match (disk_bytes, dir.parent()) {
        (Some(bytes), Some(parent)) if sbx_runtime::diskfs::is_btrfs(parent) => {
            sbx_runtime::diskfs::make_subvolume(dir, bytes, None).map_err(io("make", dir))
        }
        _ => std::fs::create_dir_all(dir).map_err(io("make", dir)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_is_its_machine_and_boot() {
        let h = host_id();
        let (machine, boot) = h.split_once(':').expect("machine:boot");
        assert_eq!(
            machine,
            std::fs::read_to_string("/etc/machine-id")
                .unwrap_or_default()
                .trim()
        );
        assert!(!boot.is_empty());
    }

    #[test]
    fn files_bytes_counts_regular_files_below() {
        let dir = std::env::temp_dir().join(format!("sbx-move-in-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("a/b")).expect("mkdir");
        std::fs::write(dir.join("x"), b"12345").expect("write");
        std::fs::write(dir.join("a/b/y"), b"123").expect("write");
        assert_eq!(files_bytes(&dir), 8);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
