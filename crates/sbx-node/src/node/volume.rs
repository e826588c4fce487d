//! Volumes: `vol-` ids, a table of the node's store, each a subvolume of the node's disk
//! (`DATA_DIR/disk/volumes/<id>`, [`sbx_runtime::diskfs`]) of its own size, owned by the
//! sandboxes' root. They outlive sandboxes and node restarts.
//!
//! A volume is attached to a sandbox from its create (or its run's plan) to its delete (or
//! the run's end): a kept sandbox's are in its `StoredSpec` (so in `Node::managed`, also
//! after a restart), a run's in [`Volumes::runs`]. Both are decided under the node's
//! admission lock, which `check_volumes` runs under, so two creates cannot both take an
//! exclusive volume.
//!
//! The disk's promise ([`Promise`], [`super::capacity::DiskRoom`]): every sandbox's disk and
//! every volume's size is a limit that may be filled, and their sum stays within what the disk
//! may promise. Checked under the admission lock by what adds to it (a sandbox's create, run or
//! restore, a volume's create, a warm sandbox made ahead), each counted from its check: a
//! sandbox by its id (in the table, among the kept ones, or its directory on the disk), a
//! volume by its row, and what is between its check and those by a hold ([`DiskHold`]).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use rusqlite::params;
use sbx_api::{ApiError, ErrorCode, SandboxVolume, VolumeCreate, VolumeMount, VolumeObject};
use sbx_runtime::diskfs::Disk;
use sbx_runtime::volume::VolumeBind;

use super::Node;
use crate::fail::store_err;
use crate::sync::LockExt;

/// The most volumes that are not shared a sandbox mounts (too_many_volumes past it).
pub(crate) const MAX_EXCLUSIVE_VOLUMES: usize = 8;

/// The node's disk and the sizes it gives (set once at start).
#[derive(Debug)]
pub struct VolumeSettings {
    pub disk: Arc<Disk>,
    /// A volume's size when its create gives none, and the most one may have.
    pub default_bytes: u64,
    pub max_bytes: u64,
    /// Each sandbox's disk (`--disk-bytes`).
    pub disk_bytes: u64,
    /// Host uid of the sandboxes' root: a new volume's owner.
    pub uid_base: u32,
    /// `--disk-overcommit`: how many times what the disk holds (less its margin) it may
    /// promise.
    pub overcommit: f64,
}

/// A volume a kept sandbox mounts, as its spec keeps it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StoredVolume {
    /// The volume's id.
    pub volume: String,
    pub path: String,
    pub read_only: bool,
    #[serde(default)]
    pub copy: bool,
}

pub struct Volumes {
    settings: Option<VolumeSettings>,
    /// Runs' sandboxes -> the volumes they mount.
    runs: Mutex<HashMap<String, Vec<StoredVolume>>>,
    /// Disk promised and not yet counted otherwise: a sandbox's or a volume's id -> bytes.
    held: Mutex<HashMap<String, u64>>,
}

/// The node's disk and volumes, for `GET /internal/node` (its `disk_bytes`, `disk` and
/// `volumes`; each null without a disk).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DiskInfo {
    /// Each sandbox's disk.
    pub disk_bytes: Option<u64>,
    pub disk: Option<DiskState>,
    pub volumes: Option<VolumeLimits>,
}

/// What the node's disk filesystem has, and has promised. Keys in name order (as the API has
/// always written them).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DiskState {
    /// Always `btrfs`.
    pub filesystem: String,
    pub free_bytes: u64,
    /// Its mount point.
    pub path: String,
    pub promise: Option<Promise>,
    pub promised_bytes: Option<u64>,
    pub total_bytes: u64,
}

/// The sizes a volume may have, and how many a sandbox may hold alone. Keys in name order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct VolumeLimits {
    pub default_size_bytes: u64,
    pub max_exclusive_per_sandbox: usize,
    pub max_size_bytes: u64,
}

/// What the node's disk has promised, and what it may.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Promise {
    /// Sandboxes that have a disk on it (kept ones of every status, runs', warm ones, and
    /// ones being made or removed), each of `disk_bytes`.
    pub sandboxes: u64,
    pub disk_bytes: u64,
    /// The volumes' sizes.
    pub volume_bytes: u64,
    pub promised_bytes: u64,
    #[serde(flatten)]
    pub room: super::capacity::DiskRoom,
}

impl Promise {
    /// Whether `more` bytes fit in what the disk may promise.
    pub fn fits(&self, more: u64) -> bool {
        self.promised_bytes.saturating_add(more) <= self.room.promisable_bytes
    }

    /// Why `more` bytes (`what`) do not fit, for a refusal or the health check.
    pub fn refusal(&self, more: u64, what: &str) -> String {
        format!(
            "the node's disk cannot promise {what} of {more} bytes: it has promised \
             {} bytes ({} sandboxes' disks of {} bytes, {} bytes of volumes) of the {} it may \
             (its {} bytes less {} kept for btrfs's metadata, times --disk-overcommit {})",
            self.promised_bytes,
            self.sandboxes,
            self.disk_bytes,
            self.volume_bytes,
            self.room.promisable_bytes,
            self.room.size_bytes,
            self.room.margin_bytes,
            self.room.overcommit
        )
    }
}

/// Disk promised to a sandbox or a volume being made, until it is counted by its id (its
/// directory, its entry, its row): dropped, the hold goes.
pub(crate) struct DiskHold {
    node: std::sync::Weak<Node>,
    id: String,
}

impl Drop for DiskHold {
    fn drop(&mut self) {
        if let Some(node) = self.node.upgrade() {
            node.volumes.held.locked().remove(&self.id);
        }
    }
}

fn drive_full(message: String) -> ApiError {
    ApiError::new(ErrorCode::DriveFull, message)
}

/// A row of the `volumes` table.
#[derive(Debug, Clone)]
struct VolumeRow {
    id: String,
    name: Option<String>,
    size_bytes: u64,
    shared: bool,
    created_at_ns: i64,
}

const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS volumes (
  id TEXT PRIMARY KEY,
  name TEXT UNIQUE,
  size_bytes INTEGER NOT NULL,
  shared INTEGER NOT NULL,
  created_at_ns INTEGER NOT NULL
)";

fn no_volume(v: &str) -> ApiError {
    ApiError::new(
        ErrorCode::VolumeNotFound,
        format!("no volume {v} on this node"),
    )
}

fn no_disk() -> ApiError {
    ApiError::new(
        ErrorCode::NotServedHere,
        "this node has no disk for volumes (it was started without one)",
    )
}

impl Volumes {
    /// The node's volumes over its disk (none: no volumes); the volumes' table made when it has
    /// a disk.
    pub fn open(
        store: &crate::store::Store,
        settings: Option<VolumeSettings>,
    ) -> Result<Volumes, crate::store::StoreError> {
        if settings.is_some() {
            store.with_conn(|c| c.execute_batch(SCHEMA))?;
        }
        Ok(Volumes {
            settings,
            runs: Mutex::new(HashMap::new()),
            held: Mutex::new(HashMap::new()),
        })
    }
}

impl Node {
    /// The node's disk, for `GET /internal/node`: each sandbox's size, what the disk
    /// filesystem has, and what it has promised ([`Promise`]).
    pub fn disk_info(&self) -> DiskInfo {
        match self.volumes.settings.as_ref() {
            Some(s) => {
                let space = s.disk.space();
                let promise = self.disk_promise().ok().flatten();
                DiskInfo {
                    disk_bytes: Some(s.disk_bytes),
                    disk: Some(DiskState {
                        filesystem: "btrfs".into(),
                        free_bytes: space.free_bytes,
                        path: s.disk.root().to_string_lossy().into_owned(),
                        promise,
                        promised_bytes: promise.map(|p| p.promised_bytes),
                        total_bytes: space.total_bytes,
                    }),
                    volumes: Some(VolumeLimits {
                        default_size_bytes: s.default_bytes,
                        max_exclusive_per_sandbox: MAX_EXCLUSIVE_VOLUMES,
                        max_size_bytes: s.max_bytes,
                    }),
                }
            }
            None => DiskInfo {
                disk_bytes: None,
                disk: None,
                volumes: None,
            },
        }
    }

    /// At a stop: the node's mount of its disk goes (lazily: sandboxes that run on keep
    /// theirs, and the next node mounts the same device again).
    pub(crate) fn release_disk(&self) {
        if let Some(s) = self.volumes.settings.as_ref() {
            s.disk.release();
        }
    }

    /// The node's disk's mount point and what its filesystem has (none: no disk).
    pub(crate) fn disk_space(&self) -> Option<(PathBuf, sbx_runtime::diskfs::DiskSpace)> {
        let s = self.volumes.settings.as_ref()?;
        Some((s.disk.root().to_path_buf(), s.disk.space()))
    }

    /// What the node's disk has promised (none: the node has no disk).
    pub(crate) fn disk_promise(&self) -> Result<Option<Promise>, ApiError> {
        let Some(s) = self.volumes.settings.as_ref() else {
            return Ok(None);
        };
        let mut ids: HashMap<String, u64> = HashMap::new();
        // Sandboxes: their directories on the disk (warm ones, ones being removed, kept ones
        // asleep), the table's and the kept ones (made, and being made).
        if let Ok(rd) = std::fs::read_dir(s.disk.sandboxes()) {
            // Each directory (the kind read with the entry: no call per sandbox) is a sandbox's.
            for e in rd.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    ids.insert(e.file_name().to_string_lossy().into_owned(), s.disk_bytes);
                }
            }
        }
        for id in self.table.locked().by_id.keys() {
            ids.insert(id.clone(), s.disk_bytes);
        }
        for id in self.managed.locked().keys() {
            ids.insert(id.clone(), s.disk_bytes);
        }
        let sandboxes = ids.len() as u64;
        for r in self.volume_rows()? {
            ids.insert(r.id, r.size_bytes);
        }
        let mut held_sandboxes = 0;
        for (id, bytes) in self.volumes.held.locked().iter() {
            if !ids.contains_key(id) {
                ids.insert(id.clone(), *bytes);
                if !id.starts_with("vol") {
                    held_sandboxes += 1;
                }
            }
        }
        let sandboxes = sandboxes + held_sandboxes;
        let promised = ids.values().fold(0u64, |a, b| a.saturating_add(*b));
        let sandbox_bytes = sandboxes.saturating_mul(s.disk_bytes);
        Ok(Some(Promise {
            sandboxes,
            disk_bytes: s.disk_bytes,
            volume_bytes: promised.saturating_sub(sandbox_bytes),
            promised_bytes: promised,
            room: super::capacity::disk_room(s.disk.space().total_bytes, s.overcommit),
        }))
    }

    /// 503 drive_full when one more sandbox's disk would pass what the node's disk may
    /// promise. Called under the admission lock, before the sandbox is counted.
    pub(crate) fn check_sandbox_disk(&self) -> Result<(), ApiError> {
        match self.disk_promise()? {
            Some(p) if !p.fits(p.disk_bytes) => Err(drive_full(
                p.refusal(p.disk_bytes, "one more sandbox's disk"),
            )),
            _ => Ok(()),
        }
    }

    /// Holds one sandbox's disk for `id` (a warm sandbox about to be made) until the hold is
    /// dropped (its directory is there by then); `Ok(None)`: the node has no disk. 503
    /// drive_full when it does not fit.
    pub(crate) fn hold_sandbox_disk(
        self: &Arc<Self>,
        id: &str,
    ) -> Result<Option<DiskHold>, ApiError> {
        let _admission = self.admission.locked();
        self.check_sandbox_disk()?;
        match self.volumes.settings.as_ref() {
            Some(s) => Ok(Some(self.hold_disk(id, s.disk_bytes))),
            None => Ok(None),
        }
    }

    fn hold_disk(self: &Arc<Self>, id: &str, bytes: u64) -> DiskHold {
        self.volumes.held.locked().insert(id.to_string(), bytes);
        DiskHold {
            node: Arc::downgrade(self),
            id: id.to_string(),
        }
    }

    fn volume_settings(&self) -> Result<&VolumeSettings, ApiError> {
        self.volumes.settings.as_ref().ok_or_else(no_disk)
    }

    fn volume_rows(&self) -> Result<Vec<VolumeRow>, ApiError> {
        self.store
            .with_conn(|c| {
                let mut st = c.prepare_cached(
                    "SELECT id, name, size_bytes, shared, created_at_ns FROM volumes \
                     ORDER BY created_at_ns, id",
                )?;
                let rows = st.query_map([], |r| {
                    Ok(VolumeRow {
                        id: r.get(0)?,
                        name: r.get(1)?,
                        size_bytes: r.get::<_, i64>(2)?.max(0) as u64,
                        shared: r.get::<_, i64>(3)? != 0,
                        created_at_ns: r.get(4)?,
                    })
                })?;
                rows.collect()
            })
            .map_err(store_err)
    }

    fn volume_row(&self, id_or_name: &str) -> Result<Option<VolumeRow>, ApiError> {
        Ok(self
            .volume_rows()?
            .into_iter()
            .find(|r| r.id == id_or_name || r.name.as_deref() == Some(id_or_name)))
    }

    fn volume_path(&self, id: &str) -> Result<PathBuf, ApiError> {
        Ok(self.volume_settings()?.disk.volumes().join(id))
    }

    /// Sandboxes (kept ones and runs') that have volume `id` attached.
    fn volume_users(&self, id: &str) -> Vec<String> {
        let mut users: Vec<String> = self
            .managed
            .locked()
            .values()
            .filter(|m| m.volumes().iter().any(|v| v.volume == id))
            .map(|m| m.id.clone())
            .collect();
        users.extend(
            self.volumes
                .runs
                .locked()
                .iter()
                .filter(|(_, vs)| vs.iter().any(|v| v.volume == id))
                .map(|(s, _)| s.clone()),
        );
        users.sort();
        users
    }

    fn volume_object(&self, r: &VolumeRow) -> VolumeObject {
        let used_bytes = self
            .volume_path(&r.id)
            .ok()
            .and_then(|p| sbx_runtime::diskfs::used_bytes(&p).ok())
            .unwrap_or(0);
        VolumeObject {
            id: r.id.clone(),
            object: "volume".into(),
            name: r.name.clone(),
            size_bytes: r.size_bytes,
            used_bytes,
            shared: r.shared,
            created_at: sbx_api::format_rfc3339_millis(i128::from(r.created_at_ns)),
            sandboxes: self.volume_users(&r.id),
        }
    }

    /// `POST /v1/volumes`: 503 drive_full when its size would pass what the node's disk may
    /// promise.
    pub async fn create_volume(
        self: &Arc<Self>,
        c: VolumeCreate,
    ) -> Result<VolumeObject, ApiError> {
        let s = self.volume_settings()?;
        let size = c.size_bytes.unwrap_or(s.default_bytes);
        if size > s.max_bytes {
            return Err(ApiError::invalid_field(
                "size_bytes",
                format!("at most {} bytes on this node", s.max_bytes),
            ));
        }
        let row = VolumeRow {
            id: sbx_api::new_id("vol"),
            name: c.name.clone(),
            size_bytes: size,
            shared: c.shared,
            created_at_ns: crate::image::now_ns() as i64,
        };
        let name_taken = |n: &str| {
            ApiError::new(ErrorCode::NameTaken, format!("a volume is named {n}")).with_param("name")
        };
        if let Some(n) = &row.name {
            if self.volume_row(n)?.is_some() {
                return Err(name_taken(n));
            }
        }
        // Its size is promised from here; the hold goes once its row counts it (or it failed).
        let _hold = {
            let _admission = self.admission.locked();
            if let Some(p) = self.disk_promise()? {
                if !p.fits(size) {
                    return Err(drive_full(p.refusal(size, "a volume")).with_param("size_bytes"));
                }
            }
            self.hold_disk(&row.id, size)
        };
        let path = s.disk.volumes().join(&row.id);
        let uid = s.uid_base;
        let made = tokio::task::spawn_blocking({
            let path = path.clone();
            move || sbx_runtime::diskfs::make_subvolume(&path, size, Some(uid))
        })
        .await
        .map_err(crate::node::internal("making a volume"))?;
        made.map_err(crate::node::internal("making a volume's subvolume"))?;
        let inserted = self.store.with_conn(|c| {
            c.execute(
                "INSERT INTO volumes (id, name, size_bytes, shared, created_at_ns) \
                 VALUES (?1,?2,?3,?4,?5)",
                params![
                    row.id,
                    row.name,
                    row.size_bytes as i64,
                    row.shared as i64,
                    row.created_at_ns
                ],
            )
        });
        if let Err(e) = inserted {
            let _ = sbx_runtime::diskfs::remove_subvolume(&path);
            // The name's UNIQUE constraint: another create took it meanwhile.
            if let Some(n) = &row.name {
                if self.volume_row(n)?.is_some() {
                    return Err(name_taken(n));
                }
            }
            return Err(store_err(e));
        }
        Ok(self.volume_object(&row))
    }

    /// `GET /v1/volumes`.
    pub fn list_volumes(&self) -> Result<Vec<VolumeObject>, ApiError> {
        self.volume_settings()?;
        Ok(self
            .volume_rows()?
            .iter()
            .map(|r| self.volume_object(r))
            .collect())
    }

    /// `GET /v1/volumes/{id-or-name}`.
    pub fn get_volume(&self, id_or_name: &str) -> Result<VolumeObject, ApiError> {
        self.volume_settings()?;
        let r = self
            .volume_row(id_or_name)?
            .ok_or_else(|| no_volume(id_or_name))?;
        Ok(self.volume_object(&r))
    }

    /// `DELETE /v1/volumes/{id-or-name}`: 409 volume_in_use while a sandbox has it; else its
    /// files and its size go back to the disk.
    pub async fn delete_volume(&self, id_or_name: &str) -> Result<(), ApiError> {
        self.volume_settings()?;
        // Under the admission lock: no create takes it meanwhile.
        let (row, path) = {
            let _admission = self.admission.locked();
            let r = self
                .volume_row(id_or_name)?
                .ok_or_else(|| no_volume(id_or_name))?;
            let users = self.volume_users(&r.id);
            if !users.is_empty() {
                return Err(ApiError::new(
                    ErrorCode::VolumeInUse,
                    format!("volume {} is mounted in {}", r.id, users.join(", ")),
                ));
            }
            self.store
                .with_conn(|c| c.execute("DELETE FROM volumes WHERE id=?1", params![r.id]))
                .map_err(store_err)?;
            let path = self.volume_path(&r.id)?;
            (r, path)
        };
        let removed =
            tokio::task::spawn_blocking(move || sbx_runtime::diskfs::remove_subvolume(&path))
                .await
                .map_err(crate::node::internal("removing a volume"))?;
        if let Err(e) = removed {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(volume = %row.id, error = %e, "remove the volume's subvolume");
            }
        }
        Ok(())
    }

    /// A create's or a run's `volumes`, checked in the seed's order (invalid_path is the
    /// parser's): duplicate_volume, mount_path_taken, volume_in_use, too_many_volumes,
    /// volume_not_found. Called under the admission lock.
    pub(crate) fn check_volumes(
        &self,
        mounts: &[VolumeMount],
    ) -> Result<Vec<StoredVolume>, ApiError> {
        if mounts.is_empty() {
            return Ok(Vec::new());
        }
        self.volume_settings()
            .map_err(|e| e.with_param("volumes"))?;
        let rows = self.volume_rows()?;
        let found: Vec<Option<&VolumeRow>> = mounts
            .iter()
            .map(|m| {
                rows.iter()
                    .find(|r| r.id == m.volume || r.name.as_deref() == Some(m.volume.as_str()))
            })
            .collect();
        // One volume twice (named by id once and by name once counts).
        for (i, m) in mounts.iter().enumerate() {
            let key = |j: usize| found[j].map_or(mounts[j].volume.as_str(), |r| r.id.as_str());
            if (0..i).any(|j| key(j) == key(i)) {
                return Err(ApiError::new(
                    ErrorCode::DuplicateVolume,
                    format!("volume {} is listed twice", m.volume),
                )
                .with_param(format!("volumes[{i}].volume")));
            }
        }
        for (i, m) in mounts.iter().enumerate() {
            if mounts[..i].iter().any(|o| o.path == m.path) {
                return Err(ApiError::new(
                    ErrorCode::MountPathTaken,
                    format!("two volumes are mounted at {}", m.path),
                )
                .with_param(format!("volumes[{i}].path")));
            }
        }
        for (i, r) in found.iter().enumerate() {
            if let Some(r) = r.filter(|r| !r.shared) {
                let users = self.volume_users(&r.id);
                if let Some(other) = users.first() {
                    return Err(ApiError::new(
                        ErrorCode::VolumeInUse,
                        format!("volume {} is not shared, and sandbox {other} has it", r.id),
                    )
                    .with_param(format!("volumes[{i}].volume")));
                }
            }
        }
        let exclusive = found
            .iter()
            .filter(|r| r.is_some_and(|r| !r.shared))
            .count();
        if exclusive > MAX_EXCLUSIVE_VOLUMES {
            return Err(ApiError::new(
                ErrorCode::TooManyVolumes,
                format!(
                    "{exclusive} volumes that are not shared; a sandbox mounts at most \
                     {MAX_EXCLUSIVE_VOLUMES}"
                ),
            )
            .with_param("volumes"));
        }
        let mut out = Vec::with_capacity(mounts.len());
        for (i, (m, r)) in mounts.iter().zip(&found).enumerate() {
            let r =
                r.ok_or_else(|| no_volume(&m.volume).with_param(format!("volumes[{i}].volume")))?;
            out.push(StoredVolume {
                volume: r.id.clone(),
                path: m.path.clone(),
                read_only: m.read_only,
                copy: m.copy,
            });
        }
        Ok(out)
    }

    /// Records a run's sandbox as having `vols` (under the admission lock, after
    /// [`Node::check_volumes`]).
    pub(crate) fn attach_run_volumes(&self, sandbox: &str, vols: &[StoredVolume]) {
        if !vols.is_empty() {
            self.volumes
                .runs
                .locked()
                .insert(sandbox.to_string(), vols.to_vec());
        }
    }

    /// A run's sandbox is ended: its volumes are free.
    pub(crate) fn detach_run_volumes(&self, sandbox: &str) {
        self.volumes.runs.locked().remove(sandbox);
    }

    /// What init binds for `vols`.
    pub(crate) fn volume_binds(&self, vols: &[StoredVolume]) -> Vec<VolumeBind> {
        let Some(s) = self.volumes.settings.as_ref() else {
            return Vec::new();
        };
        vols.iter()
            .map(|v| VolumeBind {
                host: s.disk.volumes().join(&v.volume),
                path: v.path.clone(),
                read_only: v.read_only,
                copy: v.copy,
            })
            .collect()
    }
}

/// The sandbox object's `volumes`.
pub(crate) fn sandbox_volumes(vols: &[StoredVolume]) -> Vec<SandboxVolume> {
    vols.iter()
        .map(|v| SandboxVolume {
            volume: v.volume.clone(),
            path: v.path.clone(),
            read_only: v.read_only,
        })
        .collect()
}
