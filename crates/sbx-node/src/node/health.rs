//! Whether the node can make a sandbox now, for `GET /healthz`: its cgroup folders are usable
//! (the driver makes gone ones again), its data directory's filesystem has room above a margin,
//! its disk (the btrfs at DATA_DIR/disk where sandboxes' disks and volumes are) has room above
//! a margin and can promise one more sandbox's disk, its base image is there. Checked at most
//! once a second ([`REFRESH`]); callers in between get the last answer.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::Node;
use crate::sync::LockExt;

/// How long an answer of the checks is reused.
pub(crate) const REFRESH: Duration = Duration::from_secs(1);

/// Free inodes under which the data disk counts as full (a sandbox's upper directory and its
/// agent's files need some).
pub(crate) const MIN_FREE_INODES: u64 = 4096;

/// One check and its outcome.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Check {
    /// `cgroups`, `disk` (DATA_DIR's filesystem), `node_disk` (DATA_DIR/disk: only on a node
    /// that has one) or `base_image`.
    pub name: &'static str,
    pub ok: bool,
    /// Why it failed (none when it passed).
    pub reason: Option<String>,
}

impl Check {
    fn of(name: &'static str, r: Result<(), String>) -> Check {
        Check {
            name,
            ok: r.is_ok(),
            reason: r.err(),
        }
    }
}

/// The outcome of every check.
#[derive(Debug, Clone)]
pub struct Health {
    pub checks: Vec<Check>,
}

impl Health {
    pub fn ok(&self) -> bool {
        self.checks.iter().all(|c| c.ok)
    }

    /// The failed checks' reasons, `name: reason`, joined.
    pub fn reason(&self) -> Option<String> {
        let failed: Vec<String> = self
            .checks
            .iter()
            .filter(|c| !c.ok)
            .map(|c| format!("{}: {}", c.name, c.reason.as_deref().unwrap_or("failed")))
            .collect();
        (!failed.is_empty()).then(|| failed.join("; "))
    }
}

/// The last answer and when it was made.
#[derive(Default)]
pub(crate) struct HealthCache(Mutex<Option<(Instant, Arc<Health>)>>);

/// The data disk's check: room and inodes above the margins.
fn disk(path: &std::path::Path, min_bytes: u64) -> Result<(), String> {
    let free = sbx_runtime::hostfs::disk_free(path)
        .map_err(|e| format!("statvfs {}: {e}", path.display()))?;
    if free.bytes < min_bytes {
        return Err(format!(
            "the data disk ({}) has {} bytes free, under the margin of {min_bytes} \
             (--min-free-disk-bytes)",
            path.display(),
            free.bytes
        ));
    }
    if let Some(inodes) = free.inodes.filter(|n| *n < MIN_FREE_INODES) {
        return Err(format!(
            "the data disk ({}) has {inodes} inodes free, under {MIN_FREE_INODES}",
            path.display()
        ));
    }
    Ok(())
}

/// The node's disk's check (the btrfs at `path`): free bytes above the margin (`min_bytes`,
/// at most a tenth of its size), and room to promise one more sandbox's disk.
fn node_disk(
    path: &std::path::Path,
    space: sbx_runtime::diskfs::DiskSpace,
    min_bytes: u64,
    promise: Option<super::volume::Promise>,
) -> Result<(), String> {
    let margin = min_bytes.min(space.total_bytes / 10);
    if space.free_bytes < margin {
        return Err(format!(
            "the node's disk ({}) has {} bytes free of {}, under the margin of {margin} \
             (--min-free-disk-bytes, at most a tenth of it)",
            path.display(),
            space.free_bytes,
            space.total_bytes
        ));
    }
    match promise {
        Some(p) if !p.fits(p.disk_bytes) => Err(p.refusal(p.disk_bytes, "one more sandbox's disk")),
        _ => Ok(()),
    }
}

impl Node {
    /// The node's health: the cached answer when it is under [`REFRESH`] old, else the checks
    /// run again (one caller at a time; the others wait for its answer).
    pub fn health(&self) -> Arc<Health> {
        let mut cache = self.health.0.locked();
        if let Some((at, h)) = cache.as_ref() {
            if at.elapsed() < REFRESH {
                return h.clone();
            }
        }
        let h = Arc::new(self.check_health());
        if let Some(reason) = h.reason() {
            if cache.as_ref().is_none_or(|(_, old)| old.ok()) {
                tracing::warn!(%reason, "the node cannot make sandboxes");
            }
        } else if cache.as_ref().is_some_and(|(_, old)| !old.ok()) {
            tracing::info!("the node can make sandboxes again");
        }
        *cache = Some((Instant::now(), h.clone()));
        h
    }

    fn check_health(&self) -> Health {
        let base = self
            .images
            .base()
            .map_err(|e| format!("no base image: {e}"))
            .and_then(|img| {
                if img.rootfs.is_dir() {
                    Ok(())
                } else {
                    Err(format!(
                        "no base image: {} is not a directory",
                        img.rootfs.display()
                    ))
                }
            });
        let mut checks = vec![
            Check::of("cgroups", self.driver.health()),
            Check::of(
                "disk",
                disk(&self.cfg.data_dir, self.cfg.min_free_disk_bytes),
            ),
        ];
        if let Some((path, space)) = self.disk_space() {
            let promise = self
                .disk_promise()
                .map_err(|e| format!("what the node's disk has promised: {}", e.message));
            checks.push(Check::of(
                "node_disk",
                promise.and_then(|p| node_disk(&path, space, self.cfg.min_free_disk_bytes, p)),
            ));
        }
        checks.push(Check::of("base_image", base));
        Health { checks }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reason_names_each_failed_check() {
        let h = Health {
            checks: vec![
                Check::of("cgroups", Ok(())),
                Check::of("disk", Err("full".into())),
                Check::of("base_image", Err("gone".into())),
            ],
        };
        assert!(!h.ok());
        assert_eq!(h.reason().as_deref(), Some("disk: full; base_image: gone"));
        let fine = Health {
            checks: vec![Check::of("cgroups", Ok(()))],
        };
        assert!(fine.ok());
        assert_eq!(fine.reason(), None);
    }

    #[test]
    fn the_node_disk_fails_when_nearly_full_or_promised_in_full() {
        use sbx_runtime::diskfs::DiskSpace;
        const GIB: u64 = 1 << 30;
        let path = std::path::Path::new("/data/disk");
        let promise = |promised: u64| super::super::volume::Promise {
            sandboxes: promised / (256 << 20),
            disk_bytes: 256 << 20,
            volume_bytes: 0,
            promised_bytes: promised,
            room: super::super::capacity::disk_room(2 * GIB, 1.0),
        };
        let roomy = DiskSpace {
            total_bytes: 2 * GIB,
            free_bytes: GIB,
        };
        assert!(node_disk(path, roomy, 512 << 20, Some(promise(GIB))).is_ok());
        assert!(node_disk(path, roomy, 512 << 20, None).is_ok());
        // Nearly full: under the margin, which is at most a tenth of the disk.
        let full = DiskSpace {
            total_bytes: 2 * GIB,
            free_bytes: 100 << 20,
        };
        let e = node_disk(path, full, 512 << 20, Some(promise(0))).unwrap_err();
        assert!(e.contains("under the margin of 214748364"), "{e}");
        // Promised in full: one more sandbox's disk does not fit.
        let p = promise(6 * (256 << 20));
        assert!(!p.fits(p.disk_bytes));
        let e = node_disk(path, roomy, 512 << 20, Some(p)).unwrap_err();
        assert!(e.contains("cannot promise one more sandbox's disk"), "{e}");
    }

    #[test]
    fn a_disk_under_the_margin_fails_and_one_over_it_passes() {
        let dir = std::env::temp_dir();
        assert!(disk(&dir, 0).is_ok());
        let e = disk(&dir, u64::MAX).unwrap_err();
        assert!(e.contains("under the margin"), "{e}");
        assert!(disk(std::path::Path::new("/no/such/dir"), 0).is_err());
    }
}
