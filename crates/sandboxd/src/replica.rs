//! The node's sleeps and snapshots in the fleet's object store (`--store`): the core's
//! [`Replicas`] over `sbx-blob` (the core does not depend on the store's HTTP crates).
//!
//! What one upload writes, at `sandboxes/<id>/e<epoch>/` (a snapshot: `<id>` its own, epoch 1):
//! - `disk-<g>.tar.zst`: the sandbox's files (its overlay's upper directory), read first;
//! - `memory-<g>.tar.zst`: CRIU's images;
//! - `execs-<g>.zst`: a snapshot's commands (`execs.json`);
//! - `record-<g>.zst`: a sleep's record of the sandbox (its rows: what a takeover makes it of);
//! - `manifest.json` last (`build`, image, kind, the parts with their sizes and sha256).
//!
//! `<g>` is the sleep's generation (when CRIU wrote it). A sandbox sleeps many times at one
//! epoch: each sleep writes parts of its own, then replaces the manifest whole (one put), then
//! removes the parts of the sleep before it; so the epoch's manifest always names whole parts
//! of one sleep, and an upload cut short leaves the manifest before it. A reader takes the part
//! of each kind with [`part`]. A sleep whose parts the manifest names already is not sent again.

use std::path::Path;
use std::sync::Arc;

use sbx_blob::{BlobError, Format, Kind, Manifest, Part, Store};
use sbx_node::node::replica::{
    now_rfc3339, BoxFuture, DiskRead, Fetched, ReplicaError, Replicas, SleepPart, Stored,
    StoredSleepRef, Upload, UploadKind, RECORD_PART,
};

/// The parts of an upload.
pub const DISK: &str = "disk";
pub const MEMORY: &str = "memory";

/// The part of `kind` (`disk`, `memory`, `execs`, `record`) a manifest names (for a reader of
/// the store: a takeover).
pub fn part<'a>(m: &'a Manifest, kind: &str) -> Option<&'a Part> {
    m.parts.iter().find(|p| {
        p.name == kind
            || p.name
                .strip_prefix(kind)
                .and_then(|rest| rest.strip_prefix('-'))
                .is_some_and(|g| !g.is_empty() && g.bytes().all(|b| b.is_ascii_digit()))
    })
}

/// The store of a node: where its uploads go, and the build its manifests name.
pub struct BlobReplicas {
    store: Store,
    build: String,
}

impl BlobReplicas {
    /// Uploads to `store`, its manifests naming `build`.
    pub fn new(store: Store, build: String) -> Arc<BlobReplicas> {
        Arc::new(BlobReplicas { store, build })
    }
}

/// The node's build as its manifests (and its control plane) name it: a hash of the kernel's
/// release, CRIU's version (`criu --version`) and the agent's binary.
pub fn node_build(criu: &Path, agent: &Path) -> anyhow::Result<String> {
    use anyhow::Context;
    let agent_bytes =
        std::fs::read(agent).with_context(|| format!("read the agent {}", agent.display()))?;
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let version = std::process::Command::new(criu)
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    Ok(sbx_control::join::build_id(
        &kernel,
        version.as_deref(),
        &agent_bytes,
    ))
}

fn store_err(e: BlobError) -> ReplicaError {
    ReplicaError::Store(e.to_string())
}

impl Replicas for BlobReplicas {
    fn describe(&self) -> String {
        self.store.describe().to_string()
    }

    fn build(&self) -> String {
        self.build.clone()
    }

    fn put(&self, up: Upload, disk_read: DiskRead) -> BoxFuture<Result<Stored, ReplicaError>> {
        let (store, build) = (self.store.clone(), self.build.clone());
        Box::pin(async move { put(&store, &build, up, disk_read).await })
    }

    fn latest_sleep(
        &self,
        sandbox_id: &str,
        below: u64,
    ) -> BoxFuture<Result<Option<StoredSleepRef>, ReplicaError>> {
        let (store, id) = (self.store.clone(), sandbox_id.to_string());
        Box::pin(async move { latest_sleep(&store, &id, below).await })
    }

    fn fetch_record(&self, sleep: &StoredSleepRef) -> BoxFuture<Result<Vec<u8>, ReplicaError>> {
        let (store, sleep) = (self.store.clone(), sleep.clone());
        Box::pin(async move {
            let m = manifest_of(&store, &sleep).await?;
            let name = part(&m, RECORD_PART)
                .ok_or_else(|| {
                    ReplicaError::Store(format!(
                        "the sleep of {} at epoch {} carries no record (an older node's)",
                        sleep.sandbox_id, sleep.epoch
                    ))
                })?
                .name
                .clone();
            let (bytes, _) = store
                .get_part_writer(&m, &name, Vec::new())
                .await
                .map_err(store_err)?;
            Ok(bytes)
        })
    }

    fn fetch_part(
        &self,
        sleep: &StoredSleepRef,
        which: SleepPart,
        dest: std::path::PathBuf,
    ) -> BoxFuture<Result<Fetched, ReplicaError>> {
        let (store, sleep) = (self.store.clone(), sleep.clone());
        Box::pin(async move {
            let m = manifest_of(&store, &sleep).await?;
            let kind = match which {
                SleepPart::Disk => DISK,
                SleepPart::Memory => MEMORY,
            };
            let name = part(&m, kind)
                .ok_or_else(|| {
                    ReplicaError::Store(format!(
                        "the sleep of {} at epoch {} has no {kind} part",
                        sleep.sandbox_id, sleep.epoch
                    ))
                })?
                .name
                .clone();
            let stats = store
                .get_part_tree(&m, &name, &dest)
                .await
                .map_err(store_err)?;
            Ok(Fetched {
                bytes: stats.bytes,
                ms: stats.ms,
            })
        })
    }
}

/// The generation a sleep's part is named with (`memory-<g>`).
fn generation(p: &Part) -> Option<u64> {
    p.name.rsplit_once('-').and_then(|(_, g)| g.parse().ok())
}

/// The latest sleep of `id` whole in the store at an epoch below `below`.
async fn latest_sleep(
    store: &Store,
    id: &str,
    below: u64,
) -> Result<Option<StoredSleepRef>, ReplicaError> {
    let epochs = store.epochs(id).await.map_err(store_err)?;
    for epoch in epochs.into_iter().rev().filter(|e| *e < below) {
        let m = match store.manifest(id, epoch).await {
            Ok(m) => m,
            // An epoch cut short (no manifest): the one before it counts.
            Err(e) if e.is_not_found() => continue,
            Err(e) => return Err(store_err(e)),
        };
        if m.kind != Kind::Sleep {
            continue;
        }
        let (Some(memory), Some(_)) = (part(&m, MEMORY), part(&m, DISK)) else {
            continue;
        };
        let Some(generation) = generation(memory) else {
            continue;
        };
        return Ok(Some(StoredSleepRef {
            sandbox_id: id.to_string(),
            epoch,
            generation,
            build: m.build.clone(),
            image: m.image.clone(),
            bytes: m.bytes(),
            stored_bytes: m.stored_bytes(),
            has_record: part(&m, RECORD_PART).is_some(),
        }));
    }
    Ok(None)
}

/// The manifest of `sleep`, read again: still that sleep (a newer one at its epoch replaced
/// its parts, else).
async fn manifest_of(store: &Store, sleep: &StoredSleepRef) -> Result<Manifest, ReplicaError> {
    let m = store
        .manifest(&sleep.sandbox_id, sleep.epoch)
        .await
        .map_err(store_err)?;
    match part(&m, MEMORY).and_then(generation) {
        Some(g) if g == sleep.generation => Ok(m),
        _ => Err(ReplicaError::Store(format!(
            "the sleep of {} at epoch {} was replaced by a newer one meanwhile",
            sleep.sandbox_id, sleep.epoch
        ))),
    }
}

async fn put(
    store: &Store,
    build: &str,
    up: Upload,
    disk_read: DiskRead,
) -> Result<Stored, ReplicaError> {
    let g = up.generation;
    let names = [format!("{DISK}-{g}"), format!("{MEMORY}-{g}")];
    let current = match store.manifest(&up.id, up.epoch).await {
        Ok(m) => Some(m),
        Err(e) if e.is_not_found() => None,
        Err(e) => return Err(store_err(e)),
    };
    if let Some(m) = &current {
        // This sleep is there already (a restart's second look), or the epoch is another
        // writer's snapshot, written once.
        if m.part(&names[1]).is_some() || up.kind == UploadKind::Snapshot {
            return Ok(Stored {
                bytes: m.bytes(),
                stored_bytes: m.stored_bytes(),
                already: true,
            });
        }
    }
    let mut parts = Vec::new();
    let key = |name: &str, f: Format| sbx_blob::part_key(&up.id, up.epoch, name, f);
    // The disk first: a wake waiting for this read goes on once it is done.
    let disk = store
        .put_tree(&key(&names[0], Format::Tar).map_err(store_err)?, &up.disk)
        .await;
    disk_read.done();
    parts.push(part_of(&names[0], Format::Tar, disk.map_err(store_err)?));
    let memory = store
        .put_tree(&key(&names[1], Format::Tar).map_err(store_err)?, &up.memory)
        .await
        .map_err(store_err)?;
    parts.push(part_of(&names[1], Format::Tar, memory));
    for (name, path) in &up.files {
        let name = format!("{name}-{g}");
        let stats = store
            .put_file(&key(&name, Format::Raw).map_err(store_err)?, path)
            .await
            .map_err(store_err)?;
        parts.push(part_of(&name, Format::Raw, stats));
    }
    let m = Manifest {
        sandbox_id: up.id.clone(),
        epoch: up.epoch,
        build: build.to_string(),
        image: up.image.clone(),
        kind: match up.kind {
            UploadKind::Sleep => Kind::Sleep,
            UploadKind::Snapshot => Kind::Snapshot,
        },
        parts,
        written_at: now_rfc3339(),
    };
    store.put_manifest(&m).await.map_err(store_err)?;
    // The sleep before it: its parts are no manifest's now.
    if let Some(old) = current {
        for p in old.parts.iter().filter(|p| m.part(&p.name).is_none()) {
            let removed = match sbx_blob::part_key(&up.id, up.epoch, &p.name, p.format) {
                Ok(k) => store.delete(&k).await,
                Err(e) => Err(e),
            };
            if let Err(e) = removed {
                tracing::warn!(id = %up.id, part = %p.name, error = %e, "a replaced sleep's part not removed");
            }
        }
    }
    Ok(Stored {
        bytes: m.bytes(),
        stored_bytes: m.stored_bytes(),
        already: false,
    })
}

fn part_of(name: &str, format: Format, s: sbx_blob::Stats) -> Part {
    Part {
        name: name.to_string(),
        format,
        bytes: s.bytes,
        stored_bytes: s.stored_bytes,
        sha256: Some(s.sha256),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(names: &[&str]) -> Manifest {
        Manifest {
            sandbox_id: "sbx-a".into(),
            epoch: 1,
            build: "b".into(),
            image: "base".into(),
            kind: Kind::Sleep,
            parts: names
                .iter()
                .map(|n| Part {
                    name: n.to_string(),
                    format: Format::Tar,
                    bytes: 1,
                    stored_bytes: 1,
                    sha256: None,
                })
                .collect(),
            written_at: String::new(),
        }
    }

    #[test]
    fn a_part_is_found_by_its_kind() {
        let m = manifest(&["disk-12", "memory-12", "execs-12"]);
        assert_eq!(part(&m, DISK).map(|p| p.name.as_str()), Some("disk-12"));
        assert_eq!(part(&m, MEMORY).map(|p| p.name.as_str()), Some("memory-12"));
        assert_eq!(part(&m, "execs").map(|p| p.name.as_str()), Some("execs-12"));
        assert!(part(&manifest(&["disk-x", "diskette-1"]), DISK).is_none());
    }

    fn tree(root: &std::path::Path, file: &str, body: &[u8]) -> std::path::PathBuf {
        std::fs::create_dir_all(root).expect("mkdir");
        std::fs::write(root.join(file), body).expect("write");
        root.to_path_buf()
    }

    /// A second sleep at one epoch replaces the first whole: the manifest names its parts,
    /// the first's are gone; the same sleep again is not sent.
    #[tokio::test]
    async fn sleeps_of_an_epoch_replace_each_other() {
        let root = std::env::temp_dir().join(format!("sbx-replicas-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let url = format!("file://{}", root.join("store").display());
        let r = BlobReplicas::new(Store::open(&url).expect("store"), "build-1".into());
        let up = |g: u64, body: &[u8]| Upload {
            id: "sbx-a".into(),
            sandbox_id: "sbx-a".into(),
            epoch: 1,
            kind: UploadKind::Sleep,
            generation: g,
            image: "base".into(),
            memory: tree(&root.join(format!("m{g}")), "inventory.img", b"inv"),
            disk: tree(&root.join(format!("d{g}")), "file", body),
            files: Vec::new(),
        };
        let first = r.put(up(1, b"one"), DiskRead::noop()).await.expect("first");
        assert!(!first.already);
        let second = r
            .put(up(2, b"two"), DiskRead::noop())
            .await
            .expect("second");
        assert!(!second.already);
        let again = r.put(up(2, b"two"), DiskRead::noop()).await.expect("again");
        assert!(again.already);
        let m = r.store.manifest("sbx-a", 1).await.expect("manifest");
        assert_eq!(m.build, "build-1");
        let disk = part(&m, DISK).expect("disk").name.clone();
        assert_eq!(disk, "disk-2");
        let out = root.join("out");
        r.store
            .get_part_tree(&m, &disk, &out)
            .await
            .expect("unpacked");
        assert_eq!(std::fs::read(out.join("file")).expect("file"), b"two");
        let old = sbx_blob::part_key("sbx-a", 1, "disk-1", Format::Tar).expect("key");
        assert!(
            !r.store.exists(&old).await.expect("exists"),
            "the first sleep's parts go"
        );
        let _ = std::fs::remove_dir_all(&root);
    }

    /// A takeover's reads: the latest sleep below an epoch (an epoch without a manifest, or
    /// at or above it, does not count), its record and its trees.
    #[tokio::test]
    async fn a_takeover_reads_the_latest_sleep_below_its_epoch() {
        let root = std::env::temp_dir().join(format!("sbx-replicas-t-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let url = format!("file://{}", root.join("store").display());
        let r = BlobReplicas::new(Store::open(&url).expect("store"), "build-1".into());
        assert_eq!(r.build(), "build-1");
        assert_eq!(r.latest_sleep("sbx-a", 9).await.expect("none"), None);
        let record = root.join("record.json");
        std::fs::write(&record, br#"{"id":"sbx-a"}"#).expect("record");
        let up = |epoch: u64, g: u64, body: &[u8]| Upload {
            id: "sbx-a".into(),
            sandbox_id: "sbx-a".into(),
            epoch,
            kind: UploadKind::Sleep,
            generation: g,
            image: "base".into(),
            memory: tree(&root.join(format!("m{g}")), "inventory.img", b"inv"),
            disk: tree(&root.join(format!("d{g}")), "file", body),
            files: vec![(RECORD_PART.to_string(), record.clone())],
        };
        r.put(up(1, 5, b"one"), DiskRead::noop()).await.expect("e1");
        r.put(up(3, 7, b"three"), DiskRead::noop())
            .await
            .expect("e3");
        // Parts of epoch 2 without a manifest (an upload cut short).
        let key = sbx_blob::part_key("sbx-a", 2, "disk-6", Format::Tar).expect("key");
        r.store
            .put_tree(&key, &root.join("d5"))
            .await
            .expect("a part");
        let s = r.latest_sleep("sbx-a", 3).await.expect("read").expect("e1");
        assert_eq!((s.epoch, s.generation, s.build.as_str()), (1, 5, "build-1"));
        assert!(s.has_record && s.image == "base");
        let s = r.latest_sleep("sbx-a", 4).await.expect("read").expect("e3");
        assert_eq!((s.epoch, s.generation), (3, 7));
        assert_eq!(
            r.fetch_record(&s).await.expect("record"),
            br#"{"id":"sbx-a"}"#.to_vec()
        );
        let disk = root.join("out-disk");
        let got = r
            .fetch_part(&s, SleepPart::Disk, disk.clone())
            .await
            .expect("disk");
        assert!(got.bytes > 0);
        assert_eq!(std::fs::read(disk.join("file")).expect("file"), b"three");
        let memory = root.join("out-memory");
        r.fetch_part(&s, SleepPart::Memory, memory.clone())
            .await
            .expect("memory");
        assert!(memory.join("inventory.img").is_file());
        // A sleep replaced since it was read is not read.
        r.put(up(3, 8, b"newer"), DiskRead::noop())
            .await
            .expect("e3 again");
        assert!(r
            .fetch_part(&s, SleepPart::Disk, root.join("out-2"))
            .await
            .is_err());
        let _ = std::fs::remove_dir_all(&root);
    }
}
