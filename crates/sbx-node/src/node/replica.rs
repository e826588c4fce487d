//! Replicas: after every sleep and every snapshot of a kept sandbox, what it wrote goes to the
//! fleet's object store (`--store`), in the background. The core speaks no HTTP: it names the
//! store as the [`Replicas`] trait (sandboxd implements it over `sbx-blob`) and keeps the
//! queue, the staging and the record of what is stored here.
//!
//! - **Stable state.** What an upload reads is taken out of the sandbox's way before the sleep
//!   (or snapshot) answers, under the sandbox's op lock, so a wake that comes at once does not
//!   change it: CRIU's images hard-linked into `DATA_DIR/replica/<id>.<generation>/memory`
//!   (a wake renames them away and a new sleep writes new files: the links keep the sleep's);
//!   the disk (its `upper` directory) a read-only btrfs snapshot of the sandbox's subvolume
//!   (`DATA_DIR/disk/replica/<id>.<generation>`) where its directory is one. Where it is not
//!   (a node without its disk, `--no-disk`), the upload reads the live `upper` directory and a
//!   wake waits until that read is done ([`Node::replica_wake_gate`]); an upload that finds
//!   the sandbox woken (or slept again) before it read the disk drops that sleep. A snapshot's
//!   directory (its `images`, `upper`, `execs.json`) is hard-linked the same way, so its
//!   delete does not cut an upload short. Staging goes once its upload ends.
//! - **Record.** Each sleep carries the sandbox's record (`SandboxRecord`: its row, its
//!   spec with its token and secret variables in clear (another node's key seals them again),
//!   its commands' rows, its epoch), taken with the staging (the state of that sleep), sealed
//!   with the fleet's store key (`credentials::seal_record`) into `record.json` (mode 0600)
//!   and stored as the part `record-<g>`: what a node that takes the sandbox over
//!   (`sandbox/move_in.rs`, which opens it with the same key) makes it of.
//! - **Background.** The sleep's answer does not wait. One upload per sandbox at a time; a
//!   newer sleep supersedes one queued and not started; at most `CONCURRENT` uploads run at
//!   once. A failed upload is logged and tried again with a backoff (1 s doubling to 60 s) until
//!   it is stored or superseded; it never fails the sleep.
//! - **Where.** A sleep at `sandboxes/<id>/e<epoch>/` (the epoch kept with the sandbox's row,
//!   1 until moves exist); a snapshot under its own id, `sandboxes/<snap-id>/e1/` (written
//!   once: a snapshot does not change). Each sleep of an epoch has its own parts (named with
//!   its generation, the dump's time) and replaces the epoch's manifest whole (see sandboxd's
//!   `replica.rs`).
//! - **Restart.** At its start ([`Node::start_replicas`]) the node removes the staging a killed
//!   node left and stages again every sleeping sandbox and every snapshot: a sleep or snapshot
//!   the store holds already is not sent twice; one cut short (no manifest) is sent whole.
//! - `GET /internal/node` `store` shows the store (its description, never its keys), the
//!   uploads queued and running, the last error, and per sandbox the last sleep stored and how
//!   long it took ([`Node::replicas_info`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use sbx_api::SandboxStatus;
use tokio::sync::{OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock, Semaphore};

use crate::node::Node;
use crate::sync::LockExt;

/// Uploads running at once, node-wide.
pub(crate) const CONCURRENT: usize = 2;
/// The first wait before a failed upload is tried again; it doubles up to [`BACKOFF_MAX`].
const BACKOFF_FIRST: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(60);
/// The staging folder in the data directory, and on the node's disk.
const STAGING: &str = "replica";
/// The part a sleep's record is stored as (`record-<g>`), and its file in the staging.
pub const RECORD_PART: &str = "record";
const RECORD_FILE: &str = "record.json";

/// A boxed future, as a trait object's method returns one.
pub type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'static>>;

/// What went wrong staging or storing a sleep or a snapshot.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    /// The object store failed (its error as text: the store's crate is not the core's).
    #[error("the store: {0}")]
    Store(String),
    /// A file of the staging could not be made or read.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A blocking task ended without an answer.
    #[error("a staging thread failed: {0}")]
    Thread(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ReplicaError + '_ {
    move |source| ReplicaError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What an upload is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum UploadKind {
    Sleep,
    Snapshot,
}

/// One sleep or snapshot, staged: what the store is to get.
#[derive(Debug, Clone)]
pub struct Upload {
    /// Its folder's id in the store: the sandbox's (a sleep) or the snapshot's.
    pub id: String,
    /// The sandbox it is of.
    pub sandbox_id: String,
    pub epoch: u64,
    pub kind: UploadKind,
    /// Names this sleep (the CRIU dump's time, ns since the epoch): a sleep the store holds
    /// already is not sent again.
    pub generation: u64,
    /// The image the sandbox's disk is over (its reference; `@digest` when pulled).
    pub image: String,
    /// CRIU's images (a directory).
    pub memory: PathBuf,
    /// The sandbox's files: its overlay's upper directory.
    pub disk: PathBuf,
    /// Files beside them, as (part name, path): a snapshot's commands.
    pub files: Vec<(String, PathBuf)>,
}

/// What one upload stored.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stored {
    /// The parts' plain bytes and their stored (compressed) bytes.
    pub bytes: u64,
    pub stored_bytes: u64,
    /// The store held it already: nothing was sent.
    pub already: bool,
}

/// Called by [`Replicas::put`] once it has read the disk part (or given up on it): a wake
/// waiting for that read goes on.
pub struct DiskRead(Option<Box<dyn FnOnce() + Send>>);

impl DiskRead {
    /// Tells nobody (an upload no wake waits for).
    pub fn noop() -> DiskRead {
        DiskRead(None)
    }

    /// The disk part is read.
    pub fn done(mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}

impl Drop for DiskRead {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}

/// A sandbox's record as each of its sleeps carries it (the part `record-<g>`): what a node
/// that takes the sandbox over makes its rows of.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct SandboxRecord {
    pub id: String,
    pub name: Option<String>,
    /// Its status as the row kept it (`sleeping`: the record is a sleep's).
    pub status: String,
    /// Its spec as the node keeps it (the create), but its token and its secret variables
    /// in clear: the node that takes it over seals them with its own key.
    pub spec: serde_json::Value,
    pub created_at_ns: i64,
    pub started_at_ns: Option<i64>,
    pub restarts: u32,
    pub failure_code: Option<String>,
    pub failure: Option<String>,
    /// The epoch it was held at.
    pub epoch: u64,
    /// Its commands' rows.
    pub execs: Vec<RecordExec>,
}

/// A command's row in a [`SandboxRecord`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct RecordExec {
    pub exec_id: String,
    pub command: String,
    pub tty: bool,
    pub encoding: String,
    pub created_at_ns: i64,
    pub boot: u32,
    pub final_json: Option<String>,
    #[serde(default)]
    pub stdin_closed: bool,
}

/// A sleep the store holds whole (its manifest names its parts), as a takeover reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredSleepRef {
    pub sandbox_id: String,
    /// The epoch folder it is in.
    pub epoch: u64,
    /// The sleep's generation (its parts are named with it).
    pub generation: u64,
    /// The build that wrote its memory.
    pub build: String,
    /// The image its disk is over (`<reference>@<digest>` for a pulled one).
    pub image: String,
    /// Plain and stored bytes of its parts.
    pub bytes: u64,
    pub stored_bytes: u64,
    /// Whether it carries the sandbox's record (a sleep of an older node does not).
    pub has_record: bool,
}

/// A part of a stored sleep that is a tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SleepPart {
    /// The sandbox's files (its overlay's upper directory).
    Disk,
    /// CRIU's images.
    Memory,
}

/// What fetching a part brought.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Fetched {
    /// The plain stream's bytes.
    pub bytes: u64,
    pub ms: u64,
}

/// The fleet's object store as the core sees it.
pub trait Replicas: Send + Sync {
    /// The store, for logs and `GET /internal/node` (its URL, endpoint, region; never keys).
    fn describe(&self) -> String;
    /// The build this node's manifests name (a sleep of another build cannot be woken here).
    fn build(&self) -> String;
    /// Stores `up` whole (its manifest last), or fails leaving no manifest of it. The disk
    /// part is read first; `disk_read` is told once it is.
    fn put(&self, up: Upload, disk_read: DiskRead) -> BoxFuture<Result<Stored, ReplicaError>>;
    /// The latest sleep of sandbox `sandbox_id` the store holds whole at an epoch below
    /// `below` (`None`: none).
    fn latest_sleep(
        &self,
        sandbox_id: &str,
        below: u64,
    ) -> BoxFuture<Result<Option<StoredSleepRef>, ReplicaError>>;
    /// The record a stored sleep carries (its bytes, checked against its manifest).
    fn fetch_record(&self, sleep: &StoredSleepRef) -> BoxFuture<Result<Vec<u8>, ReplicaError>>;
    /// Unpacks a part of a stored sleep into `dest` (new or empty), checked against its
    /// manifest; on a failure what it made there is taken away.
    fn fetch_part(
        &self,
        sleep: &StoredSleepRef,
        part: SleepPart,
        dest: PathBuf,
    ) -> BoxFuture<Result<Fetched, ReplicaError>>;
}

/// The last sleep or snapshot of a sandbox fully stored.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LastStored {
    pub id: String,
    pub kind: UploadKind,
    pub epoch: u64,
    pub generation: u64,
    /// How long its upload took (the last attempt).
    pub ms: u64,
    pub bytes: u64,
    pub stored_bytes: u64,
    /// The store held it already (a restart's check).
    pub already: bool,
    /// RFC 3339.
    pub stored_at: String,
}

/// The last failure of an upload.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LastError {
    pub id: String,
    pub message: String,
    pub at: String,
}

/// The store's part of `GET /internal/node`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ReplicasInfo {
    /// The store (never its keys).
    pub store: String,
    pub queued: usize,
    pub running: usize,
    pub stored: u64,
    pub failed: u64,
    pub last_error: Option<LastError>,
    /// Per sandbox (or snapshot), the last stored.
    pub last: Vec<LastStored>,
}

/// A sandbox whose disk an upload reads where it lives (no snapshot of it could be made).
struct LiveDisk {
    node: Weak<Node>,
    gate: Arc<RwLock<()>>,
}

/// A staged upload and what goes with it.
struct Job {
    up: Upload,
    /// The staging folder (removed when the job ends).
    staging: PathBuf,
    /// A read-only snapshot of the sandbox's subvolume (removed when the job ends).
    disk_snapshot: Option<PathBuf>,
    live: Option<LiveDisk>,
}

impl Job {
    /// Removes its staging (off the async threads).
    fn discard(self) {
        let (staging, snap) = (self.staging, self.disk_snapshot);
        let clean = move || {
            if let Some(s) = snap {
                if let Err(e) = sbx_runtime::diskfs::remove_subvolume(&s) {
                    tracing::warn!(snapshot = %s.display(), error = %e, "a staged disk snapshot");
                }
            }
            let _ = std::fs::remove_dir_all(&staging);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(h) => drop(h.spawn_blocking(clean)),
            Err(_) => clean(),
        }
    }
}

#[derive(Default)]
struct Slot {
    queued: Option<Job>,
    running: bool,
    last: Option<LastStored>,
}

#[derive(Default)]
struct State {
    slots: HashMap<String, Slot>,
    /// The gates of sandboxes whose live disk an upload may read ([`LiveDisk`]).
    gates: HashMap<String, Arc<RwLock<()>>>,
    running: usize,
    stored: u64,
    failed: u64,
    last_error: Option<LastError>,
}

/// The node's uploads.
pub(crate) struct ReplicaQueue {
    replicas: Arc<dyn Replicas>,
    state: Arc<Mutex<State>>,
    permits: Arc<Semaphore>,
}

impl ReplicaQueue {
    pub fn new(replicas: Arc<dyn Replicas>) -> ReplicaQueue {
        ReplicaQueue {
            replicas,
            state: Arc::new(Mutex::new(State::default())),
            permits: Arc::new(Semaphore::new(CONCURRENT)),
        }
    }

    fn info(&self) -> ReplicasInfo {
        let st = self.state.locked();
        let mut last: Vec<LastStored> = st.slots.values().filter_map(|s| s.last.clone()).collect();
        last.sort_by(|a, b| a.id.cmp(&b.id));
        ReplicasInfo {
            store: self.replicas.describe(),
            queued: st.slots.values().filter(|s| s.queued.is_some()).count(),
            running: st.running,
            stored: st.stored,
            failed: st.failed,
            last_error: st.last_error.clone(),
            last,
        }
    }

    /// Queues `job` (superseding one of the same id not started) and starts its worker.
    fn enqueue(&self, job: Job) {
        let id = job.up.id.clone();
        let start = {
            let mut st = self.state.locked();
            let slot = st.slots.entry(id.clone()).or_default();
            if let Some(old) = slot.queued.replace(job) {
                tracing::info!(id = %id, generation = old.up.generation, "a queued upload superseded by a newer one");
                old.discard();
            }
            !std::mem::replace(&mut slot.running, true)
        };
        if start {
            let (replicas, state, permits) = (
                self.replicas.clone(),
                self.state.clone(),
                self.permits.clone(),
            );
            tokio::spawn(worker(id, replicas, state, permits));
        }
    }

    /// The gate of sandbox `id`'s live disk (made when missing).
    fn gate(&self, id: &str) -> Arc<RwLock<()>> {
        self.state
            .locked()
            .gates
            .entry(id.to_string())
            .or_default()
            .clone()
    }
}

/// Now, RFC 3339 with milliseconds, UTC (a manifest's `written_at`).
pub fn now_rfc3339() -> String {
    sbx_api::format_rfc3339_millis(crate::image::now_ns())
}

/// Uploads the jobs of `id` one after the other until none is queued.
async fn worker(
    id: String,
    replicas: Arc<dyn Replicas>,
    state: Arc<Mutex<State>>,
    permits: Arc<Semaphore>,
) {
    loop {
        let job = {
            let mut st = state.locked();
            let Some(slot) = st.slots.get_mut(&id) else {
                return;
            };
            match slot.queued.take() {
                Some(j) => j,
                None => {
                    slot.running = false;
                    return;
                }
            }
        };
        let mut wait = BACKOFF_FIRST;
        let mut job = Some(job);
        while let Some(j) = job.take() {
            let Ok(permit) = permits.clone().acquire_owned().await else {
                return;
            };
            // A sleep whose disk is read live: held from a wake while read; dropped when the
            // sandbox woke (or slept again) since.
            let disk_read = match &j.live {
                None => DiskRead::noop(),
                Some(live) => match hold_live(live, &j.up).await {
                    Some(guard) => DiskRead(Some(Box::new(move || drop(guard)))),
                    None => {
                        tracing::info!(sandbox = %j.up.sandbox_id, generation = j.up.generation, "not stored: the sandbox woke before its disk was read (no snapshot of its disk could be made)");
                        j.discard();
                        break;
                    }
                },
            };
            state.locked().running += 1;
            let started = Instant::now();
            let r = replicas.put(j.up.clone(), disk_read).await;
            drop(permit);
            let ms = started.elapsed().as_millis() as u64;
            let failed = record(&state, &id, &j.up, ms, r, wait);
            if !failed {
                j.discard();
                continue;
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(BACKOFF_MAX);
            // A newer one queued meanwhile goes instead.
            let newer = state
                .locked()
                .slots
                .get(&id)
                .is_some_and(|s| s.queued.is_some());
            if newer {
                j.discard();
            } else if !j.staging.exists() {
                // Its staging went (the sandbox was deleted or forgotten meanwhile): nothing
                // is left to store, and asking again would fail for ever.
                tracing::info!(id = %j.up.id, generation = j.up.generation, "an upload whose staging is gone: dropped");
                j.discard();
            } else {
                job = Some(j);
            }
        }
    }
}

/// Records the end of an upload of `up`; true when it failed.
fn record(
    state: &Mutex<State>,
    id: &str,
    up: &Upload,
    ms: u64,
    r: Result<Stored, ReplicaError>,
    wait: Duration,
) -> bool {
    let mut st = state.locked();
    st.running -= 1;
    match r {
        Ok(stored) => {
            tracing::info!(id = %up.id, kind = ?up.kind, epoch = up.epoch, generation = up.generation, ms, bytes = stored.bytes, stored_bytes = stored.stored_bytes, already = stored.already, "stored");
            st.stored += 1;
            if let Some(slot) = st.slots.get_mut(id) {
                slot.last = Some(LastStored {
                    id: up.id.clone(),
                    kind: up.kind,
                    epoch: up.epoch,
                    generation: up.generation,
                    ms,
                    bytes: stored.bytes,
                    stored_bytes: stored.stored_bytes,
                    already: stored.already,
                    stored_at: now_rfc3339(),
                });
            }
            false
        }
        Err(e) => {
            tracing::warn!(id = %up.id, generation = up.generation, error = %e, retry_in_ms = wait.as_millis() as u64, "an upload failed: tried again");
            st.failed += 1;
            st.last_error = Some(LastError {
                id: up.id.clone(),
                message: e.to_string(),
                at: now_rfc3339(),
            });
            true
        }
    }
}

/// Holds the live disk of `up`'s sandbox from its wake, if it still sleeps the same sleep.
async fn hold_live(live: &LiveDisk, up: &Upload) -> Option<OwnedRwLockReadGuard<()>> {
    let guard = live.gate.clone().read_owned().await;
    let node = live.node.upgrade()?;
    let m = node.managed(&up.sandbox_id).ok()?;
    if m.status() != SandboxStatus::Sleeping {
        return None;
    }
    let images = crate::node::checkpoint::images_dir(&node.cfg.data_dir, &up.sandbox_id);
    (generation_of(&images) == Some(up.generation)).then_some(guard)
}

/// A generation of now (where CRIU's inventory has no time).
fn now_generation() -> u64 {
    u64::try_from(crate::image::now_ns()).unwrap_or(0)
}

/// A sleep's generation: when CRIU wrote its inventory (ns since the epoch).
pub(crate) fn generation_of(images: &Path) -> Option<u64> {
    let m = std::fs::metadata(images.join("inventory.img")).ok()?;
    let t = m.modified().ok()?;
    let d = t.duration_since(std::time::UNIX_EPOCH).ok()?;
    u64::try_from(d.as_nanos()).ok()
}

/// Hard links of the tree `src` at `dst`; a copy where a link cannot be made (another
/// filesystem).
fn link_or_copy(src: &Path, dst: &Path) -> Result<(), ReplicaError> {
    match sbx_runtime::tree::link_tree(src, dst) {
        Ok(_) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
            let _ = std::fs::remove_dir_all(dst);
            sbx_runtime::tree::copy_tree(src, dst)
                .map(drop)
                .map_err(io_err(src))
        }
        Err(e) => Err(io_err(src)(e)),
    }
}

/// Writes `value` as JSON into the new file `path`, readable by its owner alone (a record
/// holds a sandbox's token).
/// `record` sealed with the store key ([`credentials::seal_record`]) into `path` (0600): its
/// token and secret variables are never in clear in the store.
fn write_sealed_record(path: &Path, record: &SandboxRecord) -> Result<(), ReplicaError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let plain = serde_json::to_vec(record).map_err(|e| ReplicaError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(e),
    })?;
    let sealed = crate::node::credentials::seal_record(&record.id, &plain).map_err(|e| {
        ReplicaError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::other(e.message),
        }
    })?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(io_err(path))?;
    f.write_all(&sealed).map_err(io_err(path))
}

/// What staging a sleep made.
struct SleepStage {
    staging: PathBuf,
    memory: PathBuf,
    disk: PathBuf,
    disk_snapshot: Option<PathBuf>,
}

/// Stages the sleep of sandbox `id` (blocking): its images linked, its disk snapshotted where
/// it is a subvolume.
fn stage_sleep(data_dir: &Path, id: &str, generation: u64) -> Result<SleepStage, ReplicaError> {
    let images = crate::node::checkpoint::images_dir(data_dir, id);
    let staging = data_dir.join(STAGING).join(format!("{id}.{generation}"));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).map_err(io_err(&staging))?;
    let memory = staging.join("memory");
    if let Err(e) = link_or_copy(&images, &memory) {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(e);
    }
    let sandbox_dir = data_dir.join("sandboxes").join(id);
    let mut disk = sandbox_dir.join("upper");
    let mut disk_snapshot = None;
    if sbx_runtime::diskfs::is_subvolume(&sandbox_dir) {
        let name = format!("{id}.{generation}");
        // Where a snapshot of it can be: the node's disk, else beside the staging.
        let places = [
            data_dir.join(sbx_runtime::diskfs::MOUNT).join(STAGING),
            data_dir.join(STAGING).join("disk"),
        ];
        for dir in places {
            let on_btrfs = dir.parent().is_some_and(sbx_runtime::diskfs::is_btrfs);
            if !on_btrfs || std::fs::create_dir_all(&dir).is_err() {
                continue;
            }
            let snap = dir.join(&name);
            if sbx_runtime::diskfs::is_subvolume(&snap) {
                let _ = sbx_runtime::diskfs::remove_subvolume(&snap);
            }
            match sbx_runtime::diskfs::snapshot_readonly(&sandbox_dir, &snap) {
                Ok(()) => {
                    disk = snap.join("upper");
                    disk_snapshot = Some(snap);
                    break;
                }
                Err(e) => {
                    tracing::info!(sandbox = %id, place = %dir.display(), error = %e, "no snapshot of the disk there")
                }
            }
        }
    }
    Ok(SleepStage {
        staging,
        memory,
        disk,
        disk_snapshot,
    })
}

/// Stages snapshot `snap_id` (its directory `dir`), blocking: its images, files and commands
/// linked.
fn stage_snapshot(
    data_dir: &Path,
    snap_id: &str,
    dir: &Path,
    generation: u64,
) -> Result<(PathBuf, Upload), ReplicaError> {
    let staging = data_dir
        .join(STAGING)
        .join(format!("{snap_id}.{generation}"));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).map_err(io_err(&staging))?;
    let made = (|| {
        let memory = staging.join("memory");
        link_or_copy(&dir.join(sbx_runtime::driver::SNAPSHOT_IMAGES), &memory)?;
        let disk = staging.join("disk");
        link_or_copy(&dir.join(sbx_runtime::driver::SNAPSHOT_UPPER), &disk)?;
        let mut files = Vec::new();
        let execs = dir.join("execs.json");
        if execs.is_file() {
            let to = staging.join("execs.json");
            if std::fs::hard_link(&execs, &to).is_err() {
                std::fs::copy(&execs, &to).map_err(io_err(&execs))?;
            }
            files.push(("execs".to_string(), to));
        }
        Ok(Upload {
            id: snap_id.to_string(),
            sandbox_id: String::new(),
            epoch: 1,
            kind: UploadKind::Snapshot,
            generation,
            image: String::new(),
            memory,
            disk,
            files,
        })
    })();
    match made {
        Ok(up) => Ok((staging, up)),
        Err(e) => {
            let _ = std::fs::remove_dir_all(&staging);
            Err(e)
        }
    }
}

impl Node {
    /// For `GET /internal/node` (none: the node has no store).
    pub fn replicas_info(&self) -> Option<ReplicasInfo> {
        self.replicas.as_ref().map(|q| q.info())
    }

    /// The node's store (none: it has none).
    pub(crate) fn replica_store(&self) -> Option<Arc<dyn Replicas>> {
        self.replicas.as_ref().map(|q| q.replicas.clone())
    }

    /// The last sleep (or snapshot) of `id` fully stored.
    pub(crate) fn last_stored(&self, id: &str) -> Option<LastStored> {
        let q = self.replicas.as_ref()?;
        let st = q.state.locked();
        st.slots.get(id).and_then(|s| s.last.clone())
    }

    /// Sandbox `id`'s epoch (1 until it moves).
    pub(crate) fn sandbox_epoch(&self, id: &str) -> u64 {
        self.store.sandbox_epoch(id).unwrap_or_else(|e| {
            tracing::warn!(sandbox = %id, error = %e, "a sandbox's epoch: 1 taken");
            1
        })
    }

    /// Before a wake of `id`: an upload reading its live disk ends that read first; held until
    /// the wake ends (none where no upload reads a live disk of it).
    pub(crate) async fn replica_wake_gate(&self, id: &str) -> Option<OwnedRwLockWriteGuard<()>> {
        let q = self.replicas.as_ref()?;
        let gate = q.state.locked().gates.get(id).cloned()?;
        Some(gate.write_owned().await)
    }

    /// After sandbox `id` went to sleep (its op lock held): stages the sleep and queues its
    /// upload. `image`: what its disk is over. Nothing where the node has no store; a
    /// failure is logged (the sleep stands).
    pub(crate) async fn replicate_sleep(self: &Arc<Self>, id: &str, image: String) {
        let Some(q) = self.replicas.as_ref() else {
            return;
        };
        let data_dir = self.cfg.data_dir.clone();
        let images = crate::node::checkpoint::images_dir(&data_dir, id);
        let generation = generation_of(&images).unwrap_or_else(now_generation);
        // This very sleep staged already: its upload is queued, running or to be tried again
        // (staging goes once its upload ends). Staging it again would take its files away.
        if data_dir
            .join(STAGING)
            .join(format!("{id}.{generation}"))
            .exists()
        {
            tracing::debug!(sandbox = %id, generation, "this sleep is staged already");
            return;
        }
        let epoch = self.sandbox_epoch(id);
        let id2 = id.to_string();
        let staged =
            tokio::task::spawn_blocking(move || stage_sleep(&data_dir, &id2, generation)).await;
        let stage = match staged {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                tracing::error!(sandbox = %id, error = %e, "a sleep not staged for the store");
                return;
            }
            Err(e) => {
                tracing::error!(sandbox = %id, error = %ReplicaError::Thread(e.to_string()), "a sleep not staged for the store");
                return;
            }
        };
        // Its record as of this sleep, beside the staging's other parts.
        let mut files = Vec::new();
        match self.sleep_record(id, epoch) {
            Ok(record) => {
                let path = stage.staging.join(RECORD_FILE);
                match write_sealed_record(&path, &record) {
                    Ok(()) => files.push((RECORD_PART.to_string(), path)),
                    Err(e) => {
                        tracing::error!(sandbox = %id, error = %e, "a sleep's record not staged: the sleep is stored without it")
                    }
                }
            }
            Err(e) => {
                tracing::error!(sandbox = %id, error = %e.message, "a sleep's record not made: the sleep is stored without it")
            }
        }
        let live = stage.disk_snapshot.is_none().then(|| LiveDisk {
            node: Arc::downgrade(self),
            gate: q.gate(id),
        });
        q.enqueue(Job {
            up: Upload {
                id: id.to_string(),
                sandbox_id: id.to_string(),
                epoch,
                kind: UploadKind::Sleep,
                generation,
                image,
                memory: stage.memory,
                disk: stage.disk,
                files,
            },
            staging: stage.staging,
            disk_snapshot: stage.disk_snapshot,
            live,
        });
    }

    /// After snapshot `snap_id` of sandbox `sandbox_id` was taken into `dir`: stages it and
    /// queues its upload.
    pub(crate) async fn replicate_snapshot(
        &self,
        snap_id: &str,
        sandbox_id: &str,
        image: String,
        dir: &Path,
    ) {
        let Some(q) = self.replicas.as_ref() else {
            return;
        };
        let data_dir = self.cfg.data_dir.clone();
        let generation = generation_of(&dir.join(sbx_runtime::driver::SNAPSHOT_IMAGES))
            .unwrap_or_else(now_generation);
        let (snap, dir2) = (snap_id.to_string(), dir.to_path_buf());
        let staged = tokio::task::spawn_blocking(move || {
            stage_snapshot(&data_dir, &snap, &dir2, generation)
        })
        .await;
        match staged {
            Ok(Ok((staging, mut up))) => {
                up.sandbox_id = sandbox_id.to_string();
                up.image = image;
                q.enqueue(Job {
                    up,
                    staging,
                    disk_snapshot: None,
                    live: None,
                });
            }
            Ok(Err(e)) => {
                tracing::error!(snapshot = %snap_id, error = %e, "a snapshot not staged for the store")
            }
            Err(e) => {
                tracing::error!(snapshot = %snap_id, error = %ReplicaError::Thread(e.to_string()), "a snapshot not staged for the store")
            }
        }
    }

    /// At the node's start (after `recover`), where it has a store: the staging a previous
    /// node left goes, and every sleeping sandbox and every snapshot is staged again (what
    /// the store holds already is not sent again).
    pub fn start_replicas(self: &Arc<Self>) {
        // A takeover a killed node left half made goes first: nothing of it is staged.
        self.remove_half_made_takeovers();
        if self.replicas.is_none() {
            return;
        }
        if let Some(q) = self.replicas.as_ref() {
            tracing::info!(store = %q.replicas.describe(), "sleeps and snapshots go to the store");
        }
        let node = self.clone();
        tokio::spawn(async move {
            let data_dir = node.cfg.data_dir.clone();
            let _ = tokio::task::spawn_blocking(move || remove_staging(&data_dir)).await;
            let sleeping: Vec<_> = node
                .managed
                .locked()
                .values()
                .filter(|m| m.status() == SandboxStatus::Sleeping)
                .cloned()
                .collect();
            for m in sleeping {
                node.restage_sleep(&m).await;
            }
            for s in node.store.snapshots().unwrap_or_default() {
                let dir = node.snapshots_dir().join(&s.id);
                if s.status != "ready" || !dir.is_dir() {
                    continue;
                }
                let image = serde_json::from_str::<serde_json::Value>(&s.spec)
                    .ok()
                    .and_then(|v| v["image"].as_str().map(str::to_string))
                    .unwrap_or_default();
                node.replicate_snapshot(&s.id, &s.sandbox_id, image, &dir)
                    .await;
            }
        });
    }
}

/// Removes every staging folder and disk snapshot (a previous node's).
fn remove_staging(data_dir: &Path) {
    let disk = data_dir.join(sbx_runtime::diskfs::MOUNT).join(STAGING);
    let staging = data_dir.join(STAGING);
    for dir in [disk, staging.join("disk")] {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if sbx_runtime::diskfs::is_subvolume(&e.path()) {
                if let Err(err) = sbx_runtime::diskfs::remove_subvolume(&e.path()) {
                    tracing::warn!(snapshot = %e.path().display(), error = %err, "a staged disk snapshot of a previous node");
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&staging);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store that records what it is given and fails its first `fail` calls.
    struct Recorder {
        fail: Mutex<u32>,
        got: Mutex<Vec<Upload>>,
        delay: Duration,
    }

    impl Replicas for Recorder {
        fn describe(&self) -> String {
            "recorder".into()
        }
        fn build(&self) -> String {
            "build".into()
        }
        fn latest_sleep(
            &self,
            _: &str,
            _: u64,
        ) -> BoxFuture<Result<Option<StoredSleepRef>, ReplicaError>> {
            Box::pin(async { Ok(None) })
        }
        fn fetch_record(&self, _: &StoredSleepRef) -> BoxFuture<Result<Vec<u8>, ReplicaError>> {
            Box::pin(async { Err(ReplicaError::Store("a recorder keeps nothing".into())) })
        }
        fn fetch_part(
            &self,
            _: &StoredSleepRef,
            _: SleepPart,
            _: PathBuf,
        ) -> BoxFuture<Result<Fetched, ReplicaError>> {
            Box::pin(async { Err(ReplicaError::Store("a recorder keeps nothing".into())) })
        }
        fn put(&self, up: Upload, disk_read: DiskRead) -> BoxFuture<Result<Stored, ReplicaError>> {
            let fail = {
                let mut f = self.fail.locked();
                let now = *f > 0;
                *f = f.saturating_sub(1);
                now
            };
            self.got.locked().push(up);
            let delay = self.delay;
            Box::pin(async move {
                tokio::time::sleep(delay).await;
                disk_read.done();
                if fail {
                    Err(ReplicaError::Store("refused".into()))
                } else {
                    Ok(Stored {
                        bytes: 10,
                        stored_bytes: 5,
                        already: false,
                    })
                }
            })
        }
    }

    fn job(root: &Path, id: &str, generation: u64) -> Job {
        let staging = root.join(format!("{id}.{generation}"));
        std::fs::create_dir_all(&staging).expect("staging");
        Job {
            up: Upload {
                id: id.into(),
                sandbox_id: id.into(),
                epoch: 1,
                kind: UploadKind::Sleep,
                generation,
                image: "base".into(),
                memory: staging.join("memory"),
                disk: staging.join("disk"),
                files: Vec::new(),
            },
            staging,
            disk_snapshot: None,
            live: None,
        }
    }

    async fn settle(q: &ReplicaQueue, stored: u64) -> ReplicasInfo {
        for _ in 0..1000 {
            let i = q.info();
            if i.stored >= stored && i.running == 0 && i.queued == 0 {
                return i;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("not settled: {:?}", q.info());
    }

    #[tokio::test]
    async fn a_newer_sleep_supersedes_a_queued_one_and_a_failure_is_retried() {
        let root = std::env::temp_dir().join(format!("sbx-replica-q-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let rec = Arc::new(Recorder {
            fail: Mutex::new(1),
            got: Mutex::new(Vec::new()),
            delay: Duration::from_millis(50),
        });
        let q = ReplicaQueue::new(rec.clone());
        // The first runs (and fails once); the second waits; the third replaces the second.
        q.enqueue(job(&root, "sbx-a", 1));
        tokio::task::yield_now().await;
        q.enqueue(job(&root, "sbx-a", 2));
        q.enqueue(job(&root, "sbx-a", 3));
        assert_eq!(q.info().queued, 1);
        for _ in 0..100 {
            if !root.join("sbx-a.2").exists() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!root.join("sbx-a.2").exists(), "a superseded staging goes");
        let info = settle(&q, 1).await;
        let gens: Vec<u64> = rec.got.locked().iter().map(|u| u.generation).collect();
        // Generation 1 failed; a newer one was queued meanwhile, so 3 went instead of a retry.
        assert_eq!(gens, vec![1, 3]);
        assert_eq!((info.stored, info.failed), (1, 1));
        assert_eq!(
            info.last_error.as_ref().map(|e| e.id.as_str()),
            Some("sbx-a")
        );
        assert_eq!(info.last[0].generation, 3);
        assert_eq!(info.store, "recorder");
        let _ = std::fs::remove_dir_all(&root);
    }

    #[tokio::test]
    async fn a_failure_alone_is_retried_and_at_most_two_run_at_once() {
        let root = std::env::temp_dir().join(format!("sbx-replica-r-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let rec = Arc::new(Recorder {
            fail: Mutex::new(2),
            got: Mutex::new(Vec::new()),
            delay: Duration::from_millis(100),
        });
        let q = ReplicaQueue::new(rec.clone());
        for id in ["sbx-a", "sbx-b", "sbx-c"] {
            q.enqueue(job(&root, id, 7));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(q.info().running, CONCURRENT);
        let info = settle(&q, 3).await;
        assert_eq!(info.failed, 2);
        assert_eq!(info.last.len(), 3);
        // Each sandbox stored once, the two failed ones tried again.
        assert_eq!(rec.got.locked().len(), 5);
        // Each staging is removed once its upload settled (a moment after, under load).
        let staged = || {
            ["sbx-a", "sbx-b", "sbx-c"]
                .into_iter()
                .filter(|id| root.join(format!("{id}.7")).exists())
                .collect::<Vec<_>>()
        };
        for _ in 0..500 {
            if staged().is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(staged().is_empty(), "staging not removed: {:?}", staged());
        let _ = std::fs::remove_dir_all(&root);
    }
}
