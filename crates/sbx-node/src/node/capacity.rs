//! The most sandboxes the node holds at once when no one says (`--max-sandboxes`, the config
//! file's max_sandboxes): derived from the machine. Three bounds, each what the host has
//! minus a reserve, divided by what one idle sandbox costs; the least of them, less the warm
//! pool's sandboxes (made ahead, not counted among the held ones), is the limit:
//!
//! - memory: MemTotal, less a fifth (at least 1 GiB) for the host, over [`SANDBOX_MEMORY`];
//! - pids: the lesser of kernel.pid_max and kernel.threads-max, less a fifth (at least 1024)
//!   for the host, over [`SANDBOX_PIDS`];
//! - descriptors: the node's open files limit (its soft limit, raised to the hard one at start),
//!   less half of it for connections (the connection cap is at most a quarter of it, and a
//!   connection may hold a second descriptor to an agent) and [`NODE_FDS`] for the node itself,
//!   over [`SANDBOX_FDS`].
//!
//! The costs are measured (README "Capacity"): a fresh kept sandbox of the base image with
//! nothing started, its memory cgroup's usage plus the node's own memory per sandbox; its pids
//! (pids.current); the node's descriptors per sandbox (/proc/<node>/fd before and after).

/// Memory of one idle sandbox: its memory cgroup's usage (1.35 MB on average over 30 fresh
/// kept sandboxes here, 1.2 MB the least: the agent, its page tables, the kernel's objects of
/// its namespaces, the page cache it touched) plus the node's own per sandbox (its resident
/// memory grew by 150 KB per sandbox), rounded up: 1.5 MiB.
pub(crate) const SANDBOX_MEMORY: u64 = 3 << 19;

/// Processes of one sandbox: an idle one has its agent alone (pids.current 1); one more for
/// the command it runs.
pub(crate) const SANDBOX_PIDS: u64 = 2;

/// Descriptors the node holds per sandbox: 3 for an idle one (counted: its agent's pidfd, the
/// copy registered for its connections, an idle connection to its agent), one more for a
/// running command's watcher.
pub(crate) const SANDBOX_FDS: u64 = 4;

/// Descriptors the node keeps for itself: database, listeners, logs, the network's, and the
/// idle connections to agents beyond one per sandbox (256 in all at most).
pub(crate) const NODE_FDS: u64 = 512;

/// What the host has, as the node reads it at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Host {
    pub memory_bytes: u64,
    pub pid_max: u64,
    pub threads_max: u64,
    /// The node's soft limit on open files (`u64::MAX`: none).
    pub open_files: u64,
}

impl Host {
    /// The host's figures: /proc/meminfo, /proc/sys/kernel/{pid_max,threads-max}, the open
    /// files limit. A figure that cannot be read counts as no bound.
    pub fn read(memory_bytes: u64) -> Host {
        Host {
            memory_bytes,
            pid_max: sbx_runtime::process::sysctl_u64("kernel/pid_max").unwrap_or(u64::MAX),
            threads_max: sbx_runtime::process::sysctl_u64("kernel/threads-max").unwrap_or(u64::MAX),
            open_files: sbx_runtime::process::nofile_limit().unwrap_or(u64::MAX),
        }
    }
}

/// One bound: what the host has, what is kept for others, what a sandbox costs, and how many
/// sandboxes that gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Bound {
    pub host: u64,
    pub reserved: u64,
    pub per_sandbox: u64,
    pub sandboxes: u64,
}

impl Bound {
    fn new(host: u64, reserved: u64, per_sandbox: u64) -> Bound {
        Bound {
            host,
            reserved,
            per_sandbox,
            sandboxes: host.saturating_sub(reserved) / per_sandbox.max(1),
        }
    }
}

/// The derived limit and what it comes from.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Derived {
    pub max_sandboxes: usize,
    /// `memory`, `pids` or `fds`: the least bound.
    pub limited_by: &'static str,
    pub memory: Bound,
    pub pids: Bound,
    pub fds: Bound,
    /// The warm pools' sandboxes (both kinds), taken from the least bound.
    pub warm_pool: usize,
}

/// The limit in force and where it comes from.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Capacity {
    pub max_sandboxes: usize,
    /// `--max-sandboxes`, `config` (the config file) or `derived`.
    pub source: &'static str,
    /// What the machine gives, also when a given limit is in force.
    pub derived: Derived,
}

/// The limit the machine gives, with `warm_pool` sandboxes made ahead besides.
pub fn derive(h: &Host, warm_pool: usize) -> Derived {
    let memory = Bound::new(
        h.memory_bytes,
        (h.memory_bytes / 5).max(1 << 30),
        SANDBOX_MEMORY,
    );
    let pid_room = h.pid_max.min(h.threads_max);
    let pids = Bound::new(pid_room, (pid_room / 5).max(1024), SANDBOX_PIDS);
    let fds = Bound::new(
        h.open_files,
        (h.open_files / 2).saturating_add(NODE_FDS),
        SANDBOX_FDS,
    );
    let (limited_by, least) = [("memory", memory), ("pids", pids), ("fds", fds)]
        .into_iter()
        .min_by_key(|(_, b)| b.sandboxes)
        .map(|(n, b)| (n, b.sandboxes))
        .unwrap_or(("memory", memory.sandboxes));
    let max = usize::try_from(least)
        .unwrap_or(usize::MAX)
        .saturating_sub(warm_pool)
        .max(1);
    Derived {
        max_sandboxes: max,
        limited_by,
        memory,
        pids,
        fds,
        warm_pool,
    }
}

/// The limit in force: `flag` (`--max-sandboxes`) over `config` (the config file's) over the
/// derived one.
pub fn resolve(flag: Option<usize>, config: Option<usize>, derived: Derived) -> Capacity {
    let (max, source) = match (flag, config) {
        (Some(n), _) => (n, "--max-sandboxes"),
        (None, Some(n)) => (n, "config"),
        (None, None) => (derived.max_sandboxes, "derived"),
    };
    Capacity {
        max_sandboxes: max.max(1),
        source,
        derived,
    }
}

/// What the node's disk may promise: sandboxes' disks (`--disk-bytes` each) and volumes (their
/// sizes), each a hard limit (a btrfs qgroup) that may be filled at any time. Their sum is kept
/// at most the disk's size less [`disk_margin`], times the overcommit (`--disk-overcommit`,
/// 1.0: never more than the disk holds); a create, volume or restore past it is refused
/// (503 drive_full). With an overcommit over 1.0 the disk may fill before its sandboxes do:
/// their writes then fail with ENOSPC (the image's blocks are reserved on the host: never EIO).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct DiskRoom {
    /// The disk's size (its device's bytes, as statfs gives them).
    pub size_bytes: u64,
    /// Never promised: btrfs's metadata and system chunks, its global reserve, the room a
    /// half-used chunk of one kind holds that another kind cannot take.
    pub margin_bytes: u64,
    pub overcommit: f64,
    /// What may be promised: (size - margin) * overcommit.
    pub promisable_bytes: u64,
}

/// The part of a disk of `size` bytes that is never promised: a tenth of it and 64 MiB. Measured
/// here: a 2 GiB disk (metadata DUP, as mkfs.btrfs makes it) held 1826 MiB of files in
/// subvolumes filled to their limits, 222 MiB less than its size (its metadata chunks took
/// 205 MiB, its system chunks 16 MiB); a tenth and 64 MiB is 269 MiB. A larger disk's chunks
/// are larger (1 GiB of data, 256 MiB of metadata, twice), which its tenth covers.
pub(crate) fn disk_margin(size: u64) -> u64 {
    (size / 10).saturating_add(64 << 20).min(size)
}

/// What a disk of `size` bytes may promise with `overcommit`.
pub(crate) fn disk_room(size: u64, overcommit: f64) -> DiskRoom {
    let margin = disk_margin(size);
    let promisable = (size - margin) as f64 * overcommit.max(0.0);
    DiskRoom {
        size_bytes: size,
        margin_bytes: margin,
        overcommit,
        promisable_bytes: if promisable >= u64::MAX as f64 {
            u64::MAX
        } else {
            promisable as u64
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_disk_promises_its_size_less_the_margin_times_the_overcommit() {
        let r = disk_room(2 * GIB, 1.0);
        assert_eq!(r.margin_bytes, 2 * GIB / 10 + (64 << 20));
        assert_eq!(r.promisable_bytes, 2 * GIB - r.margin_bytes);
        // The measured 2 GiB disk held 1826 MiB: never promise more.
        assert!(r.promisable_bytes <= 1826 << 20, "{r:?}");
        assert_eq!(
            disk_room(2 * GIB, 2.0).promisable_bytes,
            2 * r.promisable_bytes
        );
        // A disk smaller than the margin promises nothing.
        assert_eq!(disk_room(32 << 20, 1.0).promisable_bytes, 0);
        assert_eq!(disk_room(u64::MAX, 1e9).promisable_bytes, u64::MAX);
    }

    const GIB: u64 = 1 << 30;

    #[test]
    fn the_least_bound_less_the_warm_pool_is_the_limit() {
        // This machine's figures: 23.5 GiB, pid_max 32768, threads-max 192726, 20000 files.
        let h = Host {
            memory_bytes: 24_683_584 * 1024,
            pid_max: 32768,
            threads_max: 192_726,
            open_files: 20_000,
        };
        let d = derive(&h, 2);
        assert_eq!(d.fds.reserved, 10_000 + NODE_FDS);
        assert_eq!(d.fds.sandboxes, (20_000 - 10_000 - NODE_FDS) / SANDBOX_FDS);
        assert_eq!(d.pids.host, 32768);
        assert_eq!(d.pids.sandboxes, (32768 - 32768 / 5) / SANDBOX_PIDS);
        let least = d
            .memory
            .sandboxes
            .min(d.pids.sandboxes)
            .min(d.fds.sandboxes);
        assert_eq!(d.max_sandboxes as u64, least - 2);
        assert_eq!(d.limited_by, "fds");
    }

    #[test]
    fn a_small_machine_is_bound_by_its_memory_and_never_below_one() {
        let h = Host {
            memory_bytes: 2 * GIB,
            pid_max: 4_194_304,
            threads_max: 4_194_304,
            open_files: 1 << 20,
        };
        let d = derive(&h, 2);
        assert_eq!(d.limited_by, "memory");
        assert_eq!(d.memory.reserved, GIB);
        assert_eq!(d.max_sandboxes as u64, GIB / SANDBOX_MEMORY - 2);
        let tiny = Host {
            memory_bytes: GIB / 2,
            ..h
        };
        assert_eq!(derive(&tiny, 2).max_sandboxes, 1);
        // No limit read: no bound from it.
        let open = Host {
            open_files: u64::MAX,
            ..h
        };
        assert_eq!(derive(&open, 0).limited_by, "memory");
    }

    #[test]
    fn a_given_limit_wins_and_the_derived_one_is_still_shown() {
        let d = derive(
            &Host {
                memory_bytes: 8 * GIB,
                pid_max: 32768,
                threads_max: 32768,
                open_files: 4096,
            },
            0,
        );
        let c = resolve(Some(2), Some(5), d.clone());
        assert_eq!((c.max_sandboxes, c.source), (2, "--max-sandboxes"));
        assert_eq!(c.derived, d);
        assert_eq!(resolve(None, Some(5), d.clone()).source, "config");
        let c = resolve(None, None, d.clone());
        assert_eq!((c.max_sandboxes, c.source), (d.max_sandboxes, "derived"));
    }
}
