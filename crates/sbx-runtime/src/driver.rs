//! The driver trait and the namespace driver, as the node sees them.

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::cgroup::{Cgroups, Group, Held, Limits};
use crate::init::InitConfig;
use crate::process::PidFd;
use crate::RuntimeError;

/// How long a teardown keeps killing what is in a sandbox's cgroup before it reports it busy.
const TEARDOWN_WAIT: Duration = Duration::from_secs(30);
/// How long a teardown waits for a killed sandbox's PID 1 to exit before it kills through
/// the sandbox's cgroup (a sandbox ends in well under a millisecond when nothing starves it).
const EXIT_WAIT: Duration = Duration::from_millis(200);

/// What a sandbox is made of.
#[derive(Debug, Clone)]
pub struct SandboxSpec {
    pub id: String,
    /// The image's layers, top first: the overlay's read-only lower directories (the base
    /// image is one).
    pub lowers: Vec<PathBuf>,
    /// The sandbox's own directory on the host (upper layer, socket).
    pub dir: PathBuf,
    pub hostname: String,
    pub limits: Limits,
    pub tmp_memory: bool,
    /// Its upper layer is thrown away with it and never mounted again (a run's sandbox, which
    /// is never kept, slept or moved): the overlay is mounted `volatile`, so that no sync of
    /// the sandbox reaches the disk, nor does the unmount at its end (which otherwise syncs the
    /// node's whole disk, a btrfs transaction, for each sandbox: issue #31).
    pub scratch: bool,
    pub image_env: Vec<(String, String)>,
    pub image_user: Option<String>,
    pub image_workdir: Option<String>,
    /// The network namespace the sandbox starts in (e.g. [`crate::net::Lease::ns_path`]);
    /// `None`: a new one with only `lo`.
    pub netns: Option<PathBuf>,
    /// The sandbox's /etc/resolv.conf; `None`: the image's.
    pub resolv_conf: Option<String>,
    /// A CA bundle of the host (the public roots and the node's egress CA) mounted read-only
    /// over the image's /etc/ssl/certs/ca-certificates.crt where the image has that file.
    pub ca_bundle: Option<PathBuf>,
    /// Runtime settings (limits, sysctls, tmpfs, /dev/shm's size): [`crate::rtset`].
    pub runtime: crate::rtset::RuntimeSettings,
    /// Volumes bound into the sandbox at its paths ([`crate::volume`]).
    pub volumes: Vec<crate::volume::VolumeBind>,
}

/// The most a freeze or a thaw may take before it counts as failed.
const PAUSE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);
/// The most the freeze before a checkpoint (sleep, snapshot, fork) may take: a process in an
/// uninterruptible wait (a write under the host's writeback pressure) freezes only once that
/// wait ends, which can take seconds on a loaded machine; a checkpoint that fails for it costs
/// the caller more than the wait.
const CHECKPOINT_FREEZE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// A running sandbox.
#[derive(Debug)]
pub struct Sandbox {
    pub id: String,
    /// The agent's pid on the host.
    pub pid: u32,
    /// The agent's start time, to tell a reused pid apart after a restart.
    pub start_time: Option<u64>,
    pub socket: PathBuf,
    pub dir: PathBuf,
    group: Group,
    pidfd: Option<PidFd>,
}

impl Sandbox {
    /// A sandbox whose agent is the process `pid` and whose directory is `dir` (its agent's
    /// socket `dir/agent.sock`), with no cgroup: for a driver that makes none, such as a test's
    /// fake driver (limits are not applied; OOM kills and memory peaks read as none). The
    /// process is held by a pidfd, so that a reused pid is never taken for it.
    pub fn for_process(id: &str, pid: u32, dir: &Path) -> std::io::Result<Sandbox> {
        let pidfd = PidFd::open(pid)?;
        Ok(Sandbox {
            id: id.to_string(),
            pid,
            start_time: crate::process::start_time(pid),
            socket: dir.join("agent.sock"),
            dir: dir.to_path_buf(),
            group: Group::none(),
            pidfd: Some(pidfd),
        })
    }

    /// A handle on the sandbox's agent (a pidfd) for [`crate::netns::in_netns_of_handle`]:
    /// it names this agent's namespaces even if its pid is reused later.
    pub fn netns_handle(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        match &self.pidfd {
            Some(p) => p.try_clone_fd(),
            None => Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no handle on the sandbox's agent",
            )),
        }
    }

    /// Whether the sandbox's agent still runs.
    pub fn is_alive(&self) -> bool {
        match &self.pidfd {
            Some(p) => !p.has_exited(),
            None => false,
        }
    }

    /// Whether the kernel's OOM killer has killed in the sandbox.
    pub fn oom_killed(&self) -> bool {
        self.group.oom_killed()
    }

    pub fn memory_peak(&self) -> Option<u64> {
        self.group.memory_peak()
    }

    /// Memory the sandbox uses now, and the CPU time it has used (ns).
    pub fn usage(&self) -> (Option<u64>, Option<u64>) {
        (self.group.memory_current(), self.group.cpu_usage_ns())
    }

    /// Freezes (`true`) or thaws every process of the sandbox (its cgroup's freezer: about a
    /// millisecond either way; nothing of it runs while frozen, its memory stays).
    pub fn set_paused(&self, paused: bool) -> Result<(), RuntimeError> {
        self.group.pause(paused, PAUSE_WAIT)?;
        Ok(())
    }

    /// Whether the sandbox's processes are frozen (or being frozen).
    pub fn is_paused(&self) -> bool {
        self.group.is_paused()
    }

    /// Changes the sandbox's limits while it runs.
    pub fn set_limits(&self, limits: &Limits) -> Result<(), RuntimeError> {
        self.group.set_limits(limits)?;
        Ok(())
    }

    /// Freezes every process of the sandbox but its agent, which runs on beside its group
    /// until the [`Held`] rejoins it ([`Group::freeze_all_but`]): the agent is made dumpable
    /// for a checkpoint only while nothing else of the sandbox can run (a process of the
    /// sandbox could ptrace it or read its memory meanwhile). `None` for a sandbox without
    /// cgroups (a fake driver's).
    pub fn freeze_all_but_agent(&self) -> Result<Option<Held>, RuntimeError> {
        if self.group.freezer_dir().is_none() {
            return Ok(None);
        }
        match self.group.freeze_all_but(self.pid, CHECKPOINT_FREEZE_WAIT) {
            Ok(held) => Ok(Some(held)),
            // A process in uninterruptible sleep (its I/O stalled by a busy disk) cannot
            // freeze until it wakes: the group was thawed and the agent put back; once more,
            // after a breath, before the checkpoint fails.
            Err(crate::cgroup::CgroupError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::TimedOut =>
            {
                tracing::warn!(sandbox = %self.id, "the sandbox did not freeze in time (a process in uninterruptible sleep?): trying once more");
                std::thread::sleep(Duration::from_millis(500));
                Ok(Some(
                    self.group
                        .freeze_all_but(self.pid, CHECKPOINT_FREEZE_WAIT)?,
                ))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// For a sandbox left frozen (or being frozen) by a checkpoint: its agent moved out of the
    /// group (it runs; everything else stays frozen), to be made not dumpable before the
    /// thaw. `None` when the sandbox is neither frozen nor being frozen, or has no cgroups.
    pub fn hold_agent_if_frozen(&self) -> Result<Option<Held>, RuntimeError> {
        if self.group.freezer_dir().is_none() || !self.group.is_paused() {
            return Ok(None);
        }
        Ok(Some(self.group.hold_out(self.pid)?))
    }

    /// Thaws the sandbox after a checkpoint left it frozen ([`Sandbox::hold_agent_if_frozen`]).
    pub fn thaw(&self) {
        self.group.thaw();
    }

    /// Processes outside the sandbox that trace one of its own: the CRIU of a checkpoint
    /// that a node killed meanwhile had asked for, still at work (its processes are stopped
    /// under it, and it sets the freezer back as it found it when it ends).
    pub fn outside_tracers(&self) -> Vec<u32> {
        let mut own = self.group.pids();
        own.push(self.pid);
        let mut tracers: Vec<u32> = own
            .iter()
            .filter_map(|p| crate::process::tracer_of(*p))
            .filter(|t| !own.contains(t))
            .collect();
        tracers.sort_unstable();
        tracers.dedup();
        tracers
    }

    /// Waits, `timeout` at most, until no process outside the sandbox traces it
    /// ([`Sandbox::outside_tracers`]); a CRIU still tracing it then is killed (the sandbox's
    /// processes go on untraced, or end if CRIU's code was in them). Whether it ended by
    /// itself.
    pub fn wait_untraced(&self, timeout: Duration) -> bool {
        let end = std::time::Instant::now() + timeout;
        loop {
            let tracers = self.outside_tracers();
            if tracers.is_empty() {
                return true;
            }
            if std::time::Instant::now() >= end {
                for t in tracers {
                    if crate::process::comm_of(t).as_deref() == Some("criu") {
                        tracing::error!(sandbox = %self.id, criu = t, "a checkpoint's CRIU did not end: killed");
                        crate::process::kill_pid(t, libc::SIGKILL);
                    }
                }
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Makes and ends sandboxes. The namespace driver is the one these machines have; a microVM
/// driver comes behind the same trait where KVM boots a guest.
pub trait Driver: Send + Sync {
    fn name(&self) -> &'static str;
    /// Makes a sandbox whose agent listens on `Sandbox::socket`. Blocking (a few ms).
    fn create(&self, spec: &SandboxSpec) -> Result<Sandbox, RuntimeError>;
    /// Ends the sandbox's processes and removes its cgroups. Its directory is the caller's to
    /// remove (`remove_dir`), which may take long for a large upper layer.
    fn destroy(&self, sandbox: &Sandbox) -> Result<(), RuntimeError>;
    /// Finds a sandbox that a previous run of the node made (after a restart), if it still runs.
    fn adopt(&self, id: &str, dir: &Path, pid: u32, start_time: Option<u64>) -> Option<Sandbox>;
    /// Removes what is left of a sandbox that no longer runs (cgroups); for reconciliation.
    fn remove_leftovers(&self, id: &str) -> Result<(), RuntimeError>;
    /// Ids of the sandboxes whose cgroups exist.
    fn list_groups(&self) -> Vec<String>;
    /// At the node's stop: gives back what the driver holds for the node itself (its cgroup
    /// folders, once no sandbox is in them).
    fn release(&self) {}
    /// Whether the driver can make a sandbox now (its cgroup folders are usable; gone ones are
    /// made again); the reason when not.
    fn health(&self) -> Result<(), String> {
        Ok(())
    }
    /// Where the driver's cgroup folders are, per hierarchy (none for a driver without).
    fn placement(&self) -> Vec<crate::cgroup::Placement> {
        Vec::new()
    }
    /// Removes the node's cgroup folders of an older layout once no sandbox is left in them
    /// (after the adoption at start); the folders removed.
    fn tidy_old_layout(&self) -> Vec<PathBuf> {
        Vec::new()
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        crate::sock::unregister_agent(&self.socket, self.pid);
    }
}

/// The node reaches the agent of host pid `pid` through its sandbox's network namespace,
/// under the name `socket` ([`crate::sock::register_agent`]).
fn register(socket: &Path, pid: u32, pidfd: Option<&PidFd>) {
    if let Some(fd) = pidfd.and_then(|p| p.try_clone_fd().ok()) {
        crate::sock::register_agent(socket, pid, fd);
    }
}

/// Sandboxes as Linux namespaces + cgroups + seccomp + an overlay root, with `sbx-agent` as PID 1.
#[derive(Debug)]
pub struct NamespaceDriver {
    agent: PathBuf,
    cgroups: Cgroups,
    /// The node's hold on its cgroup folder, for its whole life.
    _lock: crate::hostfs::FileLock,
    uid_base: u32,
    uid_count: u32,
    /// The size of each sandbox's disk (its directory a subvolume of the node's disk,
    /// [`crate::diskfs`]); `None`: a plain directory.
    disk_bytes: Option<u64>,
    /// Forks each sandbox's stage 0 ([`crate::zygote`]); `sbx-agent init` is executed when it
    /// cannot be reached.
    zygote: crate::zygote::Zygote,
}

impl NamespaceDriver {
    /// Gives every sandbox made from now on a disk of `bytes`: its directory (upper and work
    /// layers) a subvolume of that size where the sandboxes' directory is on a btrfs.
    pub fn with_disk_bytes(mut self, bytes: u64) -> Self {
        self.disk_bytes = Some(bytes);
        self
    }

    /// Makes a sandbox's directory: a subvolume of the node's disk, or a plain directory.
    /// One that exists (a restart's, a wake's) is left as it is.
    fn make_dir(&self, dir: &Path) -> std::io::Result<()> {
        if dir.exists() {
            return Ok(());
        }
        match (self.disk_bytes, dir.parent()) {
            (Some(bytes), Some(parent)) if crate::diskfs::is_btrfs(parent) => {
                crate::diskfs::make_subvolume(dir, bytes, None)
            }
            _ => std::fs::create_dir_all(dir),
        }
    }

    /// `agent` is the `sbx-agent` binary; sandbox root is host uid `uid_base`; sandboxes'
    /// cgroups go in a folder `cgroup_name` at the stable place ([`crate::cgroup::Parent::Auto`]:
    /// `sbx.slice/<cgroup_name>` at each hierarchy's root where it can be written). The folder
    /// is this node's alone: its lock ([`Cgroups::lock`], naming `holder`, e.g. the data
    /// directory) is taken before anything is made in it, and a folder another living node
    /// holds is refused ([`crate::cgroup::CgroupError::InUse`]).
    pub fn with_cgroup_name(
        agent: PathBuf,
        cgroup_name: &str,
        holder: &str,
        uid_base: u32,
        uid_count: u32,
    ) -> Result<Self, RuntimeError> {
        NamespaceDriver::with_cgroups(
            agent,
            cgroup_name,
            &crate::cgroup::Parent::Auto,
            holder,
            uid_base,
            uid_count,
        )
    }

    /// [`NamespaceDriver::with_cgroup_name`] with the node's folders under `parent`.
    pub fn with_cgroups(
        agent: PathBuf,
        cgroup_name: &str,
        parent: &crate::cgroup::Parent,
        holder: &str,
        uid_base: u32,
        uid_count: u32,
    ) -> Result<Self, RuntimeError> {
        if !agent.is_file() {
            return Err(RuntimeError::AgentMissing(agent));
        }
        let cgroups = Cgroups::place(cgroup_name, parent)?;
        for p in cgroups.placement() {
            match &p.fallback {
                Some(why) => tracing::warn!(
                    controller = %p.controller,
                    folder = %p.folder.display(),
                    reason = %why,
                    "sandboxes' cgroups: not at the stable place in this hierarchy"
                ),
                None => tracing::debug!(
                    controller = %p.controller,
                    folder = %p.folder.display(),
                    "sandboxes' cgroups"
                ),
            }
        }
        let lock = cgroups.lock(holder)?;
        cgroups.prepare()?;
        crate::process::set_child_subreaper().map_err(|e| RuntimeError::Io {
            what: "subreaper".into(),
            source: e,
        })?;
        Ok(NamespaceDriver {
            zygote: crate::zygote::Zygote::new(&agent),
            agent,
            cgroups,
            _lock: lock,
            uid_base,
            uid_count,
            disk_bytes: None,
        })
    }

    pub fn uid_base(&self) -> u32 {
        self.uid_base
    }

    fn launch(&self, spec: &SandboxSpec, group: &Group) -> Result<u32, RuntimeError> {
        let cfg = InitConfig {
            id: spec.id.clone(),
            lowers: spec.lowers.clone(),
            dir: spec.dir.clone(),
            hostname: spec.hostname.clone(),
            uid_base: self.uid_base,
            uid_count: self.uid_count,
            cgroup_procs: group.procs_files(),
            tmp_memory_bytes: spec.tmp_memory.then_some(spec.limits.memory_bytes / 2),
            scratch: spec.scratch,
            image_env: spec.image_env.clone(),
            image_user: spec.image_user.clone(),
            image_workdir: spec.image_workdir.clone(),
            netns: spec.netns.clone(),
            resolv_conf: spec.resolv_conf.clone(),
            ca_bundle: spec.ca_bundle.clone(),
            runtime: spec.runtime.clone(),
            volumes: spec.volumes.clone(),
        };
        let cfg = serde_json::to_vec(&cfg).map_err(|e| RuntimeError::Start(e.to_string()))?;
        match self.zygote.launch(&cfg) {
            Ok(out) => {
                return match stage0_pid(&out) {
                    Some(pid) => Ok(pid),
                    None if out.trim().is_empty() => Err(RuntimeError::Start(
                        "agent init ended without a word".into(),
                    )),
                    None => Err(RuntimeError::Start(out.trim().to_string())),
                };
            }
            Err(e) => tracing::warn!(
                error = %e,
                "the agent's zygote cannot be reached: executing sbx-agent init"
            ),
        }
        let io = |what: &str| {
            let what = what.to_string();
            move |source| RuntimeError::Io { what, source }
        };
        // argv[0] without the host's path: PID 1 of a sandbox that serves in process keeps
        // this command line, which its processes can read (/proc/1/cmdline).
        let mut child = Command::new(&self.agent)
            .arg0("sbx-agent")
            .arg("init")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env_clear()
            .spawn()
            .map_err(io("start agent"))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin.write_all(&cfg).map_err(io("agent config"))?;
        }
        let mut out = String::new();
        if let Some(mut stdout) = child.stdout.take() {
            stdout
                .read_to_string(&mut out)
                .map_err(io("agent output"))?;
        }
        let mut err = String::new();
        if let Some(mut stderr) = child.stderr.take() {
            let _ = stderr.read_to_string(&mut err);
        }
        let status = child.wait().map_err(io("agent init"))?;
        match (status.success(), stage0_pid(&out)) {
            (true, Some(pid)) => Ok(pid),
            _ => Err(RuntimeError::Start(if err.trim().is_empty() {
                format!("agent init ended with {status}")
            } else {
                err.trim().to_string()
            })),
        }
    }
}

impl NamespaceDriver {
    /// Puts a sandbox to sleep: freezes it, dumps its tree into `images` with `criu`
    /// ([`crate::criu::dump`]), and waits until its agent has ended (reaped). Its cgroups,
    /// directory and (for `network`) lease are kept: the caller holds them until the wake.
    /// Before: the agent made dumpable (the `SetDumpable` request) and every connection of the
    /// node to it closed. On an error its processes are left whole and frozen: the caller
    /// makes the agent not dumpable and thaws it.
    pub fn sleep(
        &self,
        sandbox: &Sandbox,
        criu: &crate::criu::Criu,
        images: &Path,
        network: bool,
    ) -> Result<(), RuntimeError> {
        crate::criu::dump(
            criu,
            &crate::criu::DumpSpec {
                pid: sandbox.pid,
                group: &sandbox.group,
                images,
                network,
                leave_running: false,
            },
        )?;
        agent_not_dumpable(images);
        let dumped = std::time::Instant::now();
        if let Some(p) = &sandbox.pidfd {
            p.wait_exit(Duration::from_secs(10));
        }
        tracing::debug!(
            sandbox = %sandbox.id,
            reaped_us = dumped.elapsed().as_micros() as u64,
            "asleep: its agent ended"
        );
        Ok(())
    }

    /// Wakes a sandbox put to sleep by [`NamespaceDriver::sleep`]: restores it from `images`
    /// into its directory and cgroups (`spec` is the one it was made with; for a network,
    /// `lease` is the lease it kept: the restored namespace gets a new `eth0` of it). Returns the
    /// sandbox with its agent's new pid and pidfd; the node then makes the agent not dumpable
    /// again (`SetDumpable`), and records the new pid and start time.
    pub fn wake(
        &self,
        spec: &SandboxSpec,
        criu: &crate::criu::Criu,
        images: &Path,
        lease: Option<&crate::net::Lease>,
    ) -> Result<Sandbox, RuntimeError> {
        let network = lease.map(|l| l.relinker());
        self.wake_at(spec, criu, images, network)
    }

    /// [`NamespaceDriver::wake`] with what the lease gives for it ([`crate::net::Lease::relinker`]).
    pub fn wake_at(
        &self,
        spec: &SandboxSpec,
        criu: &crate::criu::Criu,
        images: &Path,
        network: Option<crate::net::Relink>,
    ) -> Result<Sandbox, RuntimeError> {
        let _warm = self.cgroups.keep_warm();
        // Its cgroups with its limits (kept while it slept; made again if a node's restart
        // removed them): CRIU puts the tasks back into them and leaves their settings.
        let group = self.cgroups.create_group(&spec.id, &spec.limits)?;
        agent_not_dumpable(images);
        // Images another node dumped (a move, [`MOVED`]): its tasks go into this node's
        // cgroups of it, not the other node's, and its established connections are dropped
        // (its address here is another).
        let moved = images.join(MOVED).is_file();
        let cgroup_roots = if moved {
            group
                .cgroup_paths()?
                .into_iter()
                .map(|(ctrl, path)| (ctrl.map(str::to_string), path))
                .collect()
        } else {
            Vec::new()
        };
        let restored = crate::criu::restore(
            criu,
            &crate::criu::RestoreSpec {
                images,
                lowers: &spec.lowers,
                dir: &spec.dir,
                agent: &self.agent,
                ca_bundle: spec.ca_bundle.as_deref(),
                network,
                copy: moved.then_some(crate::criu::CopyOf {
                    work: images,
                    cgroup_roots,
                }),
            },
        );
        restored_sandbox(spec, group, restored, false)
    }
}

/// The agent of the checkpoint at `images` comes back from a restore not dumpable
/// ([`crate::criu::undumpable`]). Done after each dump and again before each restore (images
/// of an older node); a failure is logged: the node makes the agent not dumpable after the
/// restore all the same.
fn agent_not_dumpable(images: &Path) {
    if let Err(e) = crate::criu::undumpable::make_agent_not_dumpable(images) {
        tracing::warn!(images = %images.display(), error = %e, "the agent's dumpable flag");
    }
}

/// The sandbox of a restore's result (the agent's new pid): its group thawed (it was frozen
/// when it was dumped, and CRIU may give it back frozen), a pidfd of its agent, registered for
/// connections; `rename`: its hostname set to the spec's (a copy's own name).
fn restored_sandbox(
    spec: &SandboxSpec,
    group: Group,
    restored: Result<u32, crate::criu::CriuError>,
    rename: bool,
) -> Result<Sandbox, RuntimeError> {
    group.thaw();
    let pid = restored?;
    let io = |what: &'static str| {
        move |e| RuntimeError::Io {
            what: what.into(),
            source: e,
        }
    };
    let pidfd = PidFd::open(pid).map_err(io("pidfd of the restored agent"))?;
    if spec.runtime.sets_net_sysctls() {
        // Its processes run again already: a failure here is logged, not theirs to die of.
        let written = pidfd
            .try_clone_fd()
            .map_err(|e| e.to_string())
            .and_then(|h| {
                crate::rtset::restore_net_sysctls(h, &spec.runtime.sysctls)
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = written {
            tracing::error!(sandbox = %spec.id, error = %e, "runtime sysctls after a restore");
        }
    }
    if rename {
        crate::process::set_hostname_of(pid, &spec.hostname)
            .map_err(io("set the copy's hostname"))?;
    }
    register(&spec.dir.join("agent.sock"), pid, Some(&pidfd));
    Ok(Sandbox {
        id: spec.id.clone(),
        pid,
        start_time: crate::process::start_time(pid),
        socket: spec.dir.join("agent.sock"),
        dir: spec.dir.clone(),
        group,
        pidfd: Some(pidfd),
    })
}

/// In a sleeping sandbox's images, the mark of images another node dumped (a move): its
/// first wake here restores it into this node's cgroups ([`NamespaceDriver::wake_at`]).
pub const MOVED: &str = "sbx-moved";

/// Where a snapshot keeps the sandbox's processes (CRIU's images) and its files.
pub const SNAPSHOT_IMAGES: &str = "images";
pub const SNAPSHOT_UPPER: &str = "upper";

impl NamespaceDriver {
    /// Takes a snapshot of a running sandbox into `dir` (made; the caller's to remove on an
    /// error): frozen, its files copied (`dir/upper`) and its processes dumped (`dir/images`).
    /// It is left frozen, also on an error: the caller makes its agent not dumpable and thaws
    /// it ([`Sandbox::hold_agent_if_frozen`], [`Sandbox::thaw`]). Before, as for a sleep: the
    /// agent made dumpable with the rest frozen and the node's connections to it closed.
    /// Returns the bytes `dir` takes.
    pub fn snapshot(
        &self,
        sandbox: &Sandbox,
        criu: &crate::criu::Criu,
        dir: &Path,
        network: bool,
    ) -> Result<u64, RuntimeError> {
        std::fs::create_dir_all(dir).map_err(|e| RuntimeError::Io {
            what: format!("mkdir {}", dir.display()),
            source: e,
        })?;
        if !sandbox.group.freeze(Duration::from_secs(5)) {
            return Err(crate::criu::CriuError::Freeze.into());
        }
        // Its files as of this instant: it is frozen until the dump has its processes too.
        let copied = crate::tree::copy_tree(&sandbox.dir.join("upper"), &dir.join(SNAPSHOT_UPPER))
            .map_err(|e| RuntimeError::Io {
                what: "copy the sandbox's files".into(),
                source: e,
            });
        // (On an error it stays frozen: the caller thaws it once its agent is not dumpable.)
        copied?;
        crate::criu::dump(
            criu,
            &crate::criu::DumpSpec {
                pid: sandbox.pid,
                group: &sandbox.group,
                images: &dir.join(SNAPSHOT_IMAGES),
                network,
                leave_running: true,
            },
        )?;
        agent_not_dumpable(&dir.join(SNAPSHOT_IMAGES));
        Ok(crate::tree::disk_usage(dir))
    }

    /// Makes a new sandbox (`spec`: its own id, directory, limits, hostname) that goes on from
    /// the snapshot at `snapshot`: its files a copy of the snapshot's, its processes restored
    /// into cgroups of its own and, for a network, the place `network` names (a new lease: its
    /// established connections are dropped).
    pub fn restore_copy(
        &self,
        spec: &SandboxSpec,
        criu: &crate::criu::Criu,
        snapshot: &Path,
        network: Option<crate::net::Relink>,
    ) -> Result<Sandbox, RuntimeError> {
        let io = |what: &str| {
            let what = what.to_string();
            move |e| RuntimeError::Io { what, source: e }
        };
        let _warm = self.cgroups.keep_warm();
        self.make_dir(&spec.dir)
            .map_err(io("make the sandbox's directory"))?;
        crate::tree::copy_tree(&snapshot.join(SNAPSHOT_UPPER), &spec.dir.join("upper"))
            .map_err(io("copy the snapshot's files"))?;
        for d in ["work", "rootfs"] {
            std::fs::create_dir_all(spec.dir.join(d)).map_err(io("mkdir"))?;
        }
        let group = self.cgroups.create_group(&spec.id, &spec.limits)?;
        let cgroup_roots = group
            .cgroup_paths()?
            .into_iter()
            .map(|(ctrl, path)| (ctrl.map(str::to_string), path))
            .collect();
        let work = spec.dir.join("restore");
        agent_not_dumpable(&snapshot.join(SNAPSHOT_IMAGES));
        let restored = crate::criu::restore(
            criu,
            &crate::criu::RestoreSpec {
                images: &snapshot.join(SNAPSHOT_IMAGES),
                lowers: &spec.lowers,
                dir: &spec.dir,
                agent: &self.agent,
                ca_bundle: spec.ca_bundle.as_deref(),
                network,
                copy: Some(crate::criu::CopyOf {
                    work: &work,
                    cgroup_roots,
                }),
            },
        );
        // Its own name: the snapshot's sandbox's came back with its UTS namespace.
        restored_sandbox(spec, group, restored, true)
    }
}

impl Driver for NamespaceDriver {
    fn name(&self) -> &'static str {
        "namespace"
    }

    fn create(&self, spec: &SandboxSpec) -> Result<Sandbox, RuntimeError> {
        let group = self.cgroups.create_group(&spec.id, &spec.limits)?;
        if let Err(e) = self.make_dir(&spec.dir) {
            let _ = group.destroy(Duration::from_secs(5));
            return Err(RuntimeError::Io {
                what: format!("make {}", spec.dir.display()),
                source: e,
            });
        }
        let pid = match self.launch(spec, &group) {
            Ok(pid) => pid,
            Err(e) => {
                let _ = group.destroy(Duration::from_secs(5));
                return Err(e);
            }
        };
        let pidfd = PidFd::open(pid).ok();
        register(&spec.dir.join("agent.sock"), pid, pidfd.as_ref());
        Ok(Sandbox {
            id: spec.id.clone(),
            pid,
            start_time: crate::process::start_time(pid),
            socket: spec.dir.join("agent.sock"),
            dir: spec.dir.clone(),
            group,
            pidfd,
        })
    }

    fn destroy(&self, sandbox: &Sandbox) -> Result<(), RuntimeError> {
        if let Some(p) = &sandbox.pidfd {
            // Killing PID 1 of the sandbox's PID namespace ends every process in it, and no
            // process can be made in it from then on.
            let _ = p.signal(libc::SIGKILL);
            // PID 1 exits only once the kernel has killed and released every other process
            // of its namespace: waiting for it (a poll, no CPU) lets the group's kill below
            // find the group empty, instead of freezing and polling a group of exiting
            // processes (CPU that grew with the machine's load, issue #31). A frozen
            // sandbox does not take the signal, and a starved one may take long: the group's
            // kill (which thaws and lifts the CPU quota) takes over after `EXIT_WAIT`.
            if !sandbox.group.is_paused() {
                p.wait_exit(EXIT_WAIT);
            }
        }
        // Whatever is in the group is killed through it too: an agent that is frozen, or
        // starved by a fork bomb under the group's CPU quota, would take minutes to go.
        sandbox.group.kill_all(TEARDOWN_WAIT)?;
        if let Some(p) = &sandbox.pidfd {
            // Reaps it (the node is its subreaper).
            p.wait_exit(Duration::from_secs(10));
        }
        sandbox.group.destroy(TEARDOWN_WAIT)?;
        Ok(())
    }

    fn adopt(&self, id: &str, dir: &Path, pid: u32, start_time: Option<u64>) -> Option<Sandbox> {
        let now = crate::process::start_time(pid)?;
        if start_time.is_some_and(|t| t != now) {
            return None;
        }
        let pidfd = PidFd::open(pid).ok()?;
        register(&dir.join("agent.sock"), pid, Some(&pidfd));
        let group = self.cgroups.group(id);
        // A node that died while it held the agent beside its group (a checkpoint's start):
        // the agent goes back (frozen with the rest, if the group is: the node then makes it
        // not dumpable before the thaw).
        group.reclaim_held();
        Some(Sandbox {
            id: id.to_string(),
            pid,
            start_time: Some(now),
            socket: dir.join("agent.sock"),
            dir: dir.to_path_buf(),
            group,
            pidfd: Some(pidfd),
        })
    }

    fn remove_leftovers(&self, id: &str) -> Result<(), RuntimeError> {
        // Short: the node tries a busy group again in the background.
        self.cgroups.group(id).destroy(Duration::from_secs(2))?;
        Ok(())
    }

    fn list_groups(&self) -> Vec<String> {
        self.cgroups.list()
    }

    fn release(&self) {
        self.cgroups.remove_if_empty();
    }

    fn health(&self) -> Result<(), String> {
        self.cgroups.check()
    }

    fn placement(&self) -> Vec<crate::cgroup::Placement> {
        self.cgroups.placement().to_vec()
    }

    fn tidy_old_layout(&self) -> Vec<PathBuf> {
        self.cgroups.remove_legacy_if_empty()
    }
}

/// Removes a sandbox's directory (its upper layer can be large: call off the request path; a
/// subvolume of the node's disk goes at once, its tree dropped by the kernel).
pub fn remove_dir(dir: &Path) -> std::io::Result<()> {
    if crate::diskfs::is_subvolume(dir) {
        return crate::diskfs::remove_subvolume(dir);
    }
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

/// The agent's host pid that stage 0 reports (`pid N`, [`crate::init::enter`]) in `out`.
fn stage0_pid(out: &str) -> Option<u32> {
    out.lines()
        .find_map(|l| l.trim().strip_prefix("pid "))
        .and_then(|p| p.parse::<u32>().ok())
}

/// The runtime's tests' sandbox: `id` of the image at `rootfs` in `dir`, 256 MiB, one CPU,
/// 256 processes, no network, nothing else.
#[cfg(test)]
impl SandboxSpec {
    pub(crate) fn for_test(id: &str, rootfs: &Path, dir: &Path) -> SandboxSpec {
        SandboxSpec {
            id: id.to_string(),
            lowers: vec![rootfs.to_path_buf()],
            dir: dir.join(id),
            hostname: id.to_string(),
            limits: Limits {
                memory_bytes: 256 << 20,
                vcpus: 1,
                pids: 256,
            },
            tmp_memory: false,
            scratch: false,
            image_env: Vec::new(),
            image_user: None,
            image_workdir: None,
            netns: None,
            resolv_conf: None,
            ca_bundle: None,
            runtime: Default::default(),
            volumes: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sandbox of a plain process (no cgroup): alive while it runs, no limits to set, no OOM.
    #[test]
    fn a_sandbox_of_a_process_follows_it() {
        let mut child = Command::new("sleep").arg("30").spawn().expect("sleep");
        let dir = std::env::temp_dir().join("sbx-for-process");
        let sb = Sandbox::for_process("sbx-a", child.id(), &dir).expect("pidfd");
        assert_eq!(sb.socket, dir.join("agent.sock"));
        assert!(sb.is_alive());
        assert!(sb.start_time.is_some());
        assert!(!sb.oom_killed());
        assert_eq!(sb.memory_peak(), None);
        let limits = Limits {
            memory_bytes: 1 << 20,
            vcpus: 1,
            pids: 8,
        };
        sb.set_limits(&limits).expect("no cgroup: nothing to set");
        assert!(sb.netns_handle().is_ok());
        child.kill().expect("kill");
        child.wait().expect("reaped");
        assert!(!sb.is_alive());
    }
}

/// Create → running → destroy time of the namespace driver (root, the base image, the agent
/// built beside the tests): `cargo test -p sbx-runtime --release bench_create -- --ignored
/// --nocapture`.
#[cfg(test)]
mod bench {
    use super::*;

    /// A driver of a cgroup folder and a directory of its own (`sbx-<tag>-<pid>`), and the
    /// base image's root; `None` (said) without root, the agent or the base image.
    fn bench_driver(tag: &str) -> Option<(NamespaceDriver, PathBuf, PathBuf)> {
        let exe = std::env::current_exe().expect("exe");
        let agent = exe.parent()?.parent()?.join("sbx-agent");
        let rootfs = PathBuf::from("/var/lib/sbx/images/base/rootfs");
        if !agent.is_file() || !rootfs.is_dir() || !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: needs root, the agent and the base image");
            return None;
        }
        let pid = std::process::id();
        let dir = std::env::temp_dir().join(format!("sbx-{tag}-{pid}"));
        let driver = NamespaceDriver::with_cgroup_name(
            agent,
            &format!("sbx-{tag}-{pid}"),
            &dir.display().to_string(),
            100_000,
            65_536,
        )
        .expect("driver");
        Some((driver, dir, rootfs))
    }

    #[test]
    #[ignore]
    fn bench_create() {
        let Some((driver, dir, rootfs)) = bench_driver("bench") else {
            return;
        };
        let n = 20;
        let mut create = Vec::new();
        for i in 0..n {
            let id = format!("bench{i}");
            let spec = SandboxSpec::for_test(&id, &rootfs, &dir);
            let t = std::time::Instant::now();
            let sb = driver.create(&spec).expect("create");
            create.push(t.elapsed());
            driver.destroy(&sb).expect("destroy");
            let _ = remove_dir(&spec.dir);
        }
        driver.release();
        let _ = std::fs::remove_dir_all(&dir);
        create.sort();
        eprintln!(
            "create ({n}): p50 {:?}, mean {:?}, max {:?}",
            create[n / 2],
            create.iter().sum::<Duration>() / n as u32,
            create[n - 1]
        );
    }

    /// CPU time (user + system) of this process and of its reaped children, in µs.
    fn cpu_us() -> u64 {
        use nix::sys::resource::{getrusage, UsageWho};
        let us = |t: nix::sys::time::TimeVal| t.tv_sec() as u64 * 1_000_000 + t.tv_usec() as u64;
        [UsageWho::RUSAGE_SELF, UsageWho::RUSAGE_CHILDREN]
            .into_iter()
            .filter_map(|w| getrusage(w).ok())
            .map(|r| us(r.user_time()) + us(r.system_time()))
            .sum()
    }

    /// The CPU cost of each step of a sandbox made and unmade by the driver (issue #31),
    /// one at a time: `cargo test --release -p sbx-runtime step_costs -- --ignored
    /// --nocapture`. The sandbox's own processes are reaped at its destroy: their CPU (the
    /// agent's start inside) is counted there.
    #[test]
    #[ignore]
    fn step_costs() {
        let Some((driver, dir, rootfs)) = bench_driver("steps") else {
            return;
        };
        let n = 40u64;
        let steps = [
            "cgroup made",
            "init + agent started",
            "destroy",
            "directory removed",
            "destroy, group killed first",
        ];
        let mut cpu = [0u64; 5];
        let mut wall = [Duration::ZERO; 5];
        for i in 0..n {
            let id = format!("step{i}");
            let spec = SandboxSpec::for_test(&id, &rootfs, &dir);
            let mut step = |k: usize, f: &mut dyn FnMut()| {
                let (c, t) = (cpu_us(), std::time::Instant::now());
                f();
                wall[k] += t.elapsed();
                cpu[k] += cpu_us() - c;
            };
            let mut group = None;
            step(0, &mut || {
                group = Some(
                    driver
                        .cgroups
                        .create_group(&id, &spec.limits)
                        .expect("group"),
                )
            });
            let group = group.expect("group");
            let mut pid = 0;
            step(1, &mut || {
                driver.make_dir(&spec.dir).expect("dir");
                pid = driver.launch(&spec, &group).expect("launch");
            });
            let sb = Sandbox {
                id: id.clone(),
                pid,
                start_time: None,
                socket: spec.dir.join("agent.sock"),
                dir: spec.dir.clone(),
                group,
                pidfd: PidFd::open(pid).ok(),
            };
            // The agent listens: what a run would wait for before its command.
            for _ in 0..1000 {
                if std::os::unix::net::UnixStream::connect(&sb.socket).is_ok() {
                    break;
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            if i % 2 == 0 {
                step(2, &mut || driver.destroy(&sb).expect("destroy"));
            } else {
                // The order of a teardown before issue #31: the group killed (frozen, listed,
                // killed, thawed) while the sandbox's processes still exit.
                step(4, &mut || {
                    if let Some(p) = &sb.pidfd {
                        let _ = p.signal(libc::SIGKILL);
                    }
                    sb.group.kill_all(TEARDOWN_WAIT).expect("kill");
                    if let Some(p) = &sb.pidfd {
                        p.wait_exit(Duration::from_secs(10));
                    }
                    sb.group.destroy(TEARDOWN_WAIT).expect("group");
                });
            }
            step(3, &mut || remove_dir(&spec.dir).expect("remove"));
        }
        driver.release();
        let _ = std::fs::remove_dir_all(&dir);
        for (k, name) in steps.iter().enumerate() {
            // The destroys alternate: each of the two is half of the rounds.
            let m = if k == 2 || k == 4 { n / 2 } else { n };
            eprintln!(
                "{name:<30} CPU {:>6} µs   wall {:>6} µs",
                cpu[k] / m,
                wall[k].as_micros() as u64 / m
            );
        }
    }
}
