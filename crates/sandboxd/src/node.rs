//! The node: the sandbox table, the driver, and the actions the API (and later the functions
//! interface and the CLI) run. Handlers parse and validate; this module acts.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sbx_api::{ApiError, Encoding, ErrorCode, RunRequest, Tmp};
use sbx_proto::{AgentMsg, ExecFailKind, ExecSpec, ExitInfo, Frame, HostMsg, OutputCounts, Stream};
use sbx_runtime::{Driver, Limits, Sandbox, SandboxSpec};
use tokio::sync::mpsc;

use crate::agent::AgentConn;
use crate::image::{Image, ImageError, ImageStore, PullError, Source};
use crate::sync::LockExt;

/// How long past a run's timeout the node waits for the agent to report its end.
const RUN_GRACE: Duration = Duration::from_secs(2);

/// Rounds of a teardown (each kills what is in the sandbox's cgroup for up to 30 s).
const TEARDOWN_ROUNDS: u32 = 10;

/// The node's settings.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub data_dir: PathBuf,
    pub default_memory_bytes: u64,
    pub default_vcpus: u32,
    pub pids_max: u32,
    pub max_memory_bytes: u64,
    pub max_vcpus: u32,
    /// Sandboxes of the base image kept made ahead, so that a run does not wait for one.
    pub warm_pool: usize,
    /// Commands one sandbox may run at once.
    pub max_execs_per_sandbox: usize,
    /// When set, only these image names boot (the config file's image_allowlist, with the
    /// local images its custom images boot as).
    pub image_allowlist: Option<Vec<String>>,
    /// The most sandboxes (runs' and kept ones) the node holds at once.
    pub max_sandboxes: usize,
}

/// A sandbox in the table.
#[derive(Debug, Clone)]
struct Entry {
    name: Option<String>,
}

#[derive(Default)]
struct Table {
    by_id: HashMap<String, Entry>,
    names: HashMap<String, String>,
}

/// A sandbox made ahead of the request that will use it, with its agent's hello already read.
struct Warm {
    sandbox: Arc<Sandbox>,
    conn: AgentConn,
    limits: Limits,
}

pub struct Node {
    pub cfg: NodeConfig,
    pub(crate) store: crate::store::Store,
    pub(crate) templates: crate::templates::Templates,
    pub(crate) managed: Mutex<HashMap<String, Arc<crate::sandboxes::Managed>>>,
    warm: Mutex<Vec<Warm>>,
    refilling: AtomicBool,
    pub(crate) driver: Arc<dyn Driver>,
    pub(crate) images: ImageStore,
    table: Mutex<Table>,
    live: Mutex<HashMap<String, Arc<Sandbox>>>,
    teardowns: AtomicUsize,
    /// Set when the node stops: no sandbox is made from then on.
    stopping: AtomicBool,
}

/// What a sandbox is made of, resolved.
pub struct Machine {
    /// The image, or the reference to pull (a create waits for it; a run pulls first).
    pub image: Source,
    /// The registry login of `image_pull_secret`, for the pull alone.
    pub creds: Option<sbx_image::Credentials>,
    pub limits: Limits,
    /// Milliseconds until `expires_at`.
    pub expires_in_ms: Option<u64>,
}

/// A run, validated and resolved: nothing is made yet (but a warm sandbox may be taken).
pub struct RunPlan {
    pub sandbox_id: String,
    pub exec_id: String,
    pub command: String,
    pub encoding: Encoding,
    image: Source,
    creds: Option<sbx_image::Credentials>,
    limits: Limits,
    hostname: String,
    tmp_memory: bool,
    exec: ExecSpec,
    stdin: Option<Vec<u8>>,
    warm: Option<Warm>,
}

/// What a run reports, in order: `Started`, output and gaps, then `Exited` or `Failed`.
#[derive(Debug)]
pub enum RunEvent {
    Started {
        pid: u32,
        started_at_ns: i64,
    },
    Output {
        stream: Stream,
        pos: u64,
        data: Vec<u8>,
    },
    Gap {
        from: u64,
        to: u64,
    },
    Exited {
        exit: ExitInfo,
        output: OutputCounts,
    },
    Failed(ApiError),
}

pub(crate) fn stopping_error() -> ApiError {
    ApiError::new(
        ErrorCode::Unavailable,
        "the node is stopping: its sandboxes are ended",
    )
}

/// A run's pull that failed: 409 sandbox_failed, the failure code first in the message.
pub(crate) fn pull_refused(reference: &str, e: &PullError) -> ApiError {
    tracing::info!(image = %reference, error = %e, "pull failed");
    ApiError::new(
        ErrorCode::SandboxFailed,
        format!("{}: image {reference}: {e}", e.code()),
    )
    .with_param("image")
}

fn not_served(param: &str, what: &str) -> ApiError {
    ApiError::new(
        ErrorCode::NotServedHere,
        format!("this node does not serve {what} yet"),
    )
    .with_param(param)
}

impl Node {
    pub fn new(
        cfg: NodeConfig,
        driver: Arc<dyn Driver>,
        images: ImageStore,
        store: crate::store::Store,
        templates: crate::templates::Templates,
    ) -> Arc<Node> {
        Arc::new(Node {
            cfg,
            store,
            templates,
            managed: Mutex::new(HashMap::new()),
            warm: Mutex::new(Vec::new()),
            refilling: AtomicBool::new(false),
            driver,
            images,
            table: Mutex::new(Table::default()),
            live: Mutex::new(HashMap::new()),
            teardowns: AtomicUsize::new(0),
            stopping: AtomicBool::new(false),
        })
    }

    pub(crate) fn sandboxes_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("sandboxes")
    }

    /// Removes what a previous run of the node left that the table does not keep: the
    /// sandboxes of runs and the warm pool (call after `recover`).
    pub fn reconcile(&self) -> usize {
        let kept = self.kept_ids();
        let known: std::collections::HashSet<String> =
            self.managed.locked().keys().cloned().collect();
        let mut n = 0;
        let mut busy = Vec::new();
        for id in self.driver.list_groups() {
            if kept.contains(&id) {
                continue;
            }
            if let Err(e) = self.driver.remove_leftovers(&id) {
                tracing::info!(sandbox = %id, error = %e, "a leftover cgroup is still busy: tried again in the background");
                busy.push(id);
            }
            n += 1;
        }
        if !busy.is_empty() {
            // Its last process is a zombie its new parent (the host's init, after a kill -9 of
            // the node) has not reaped yet: the group goes once it has.
            let driver = self.driver.clone();
            std::thread::spawn(move || {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
                while !busy.is_empty() && std::time::Instant::now() < deadline {
                    std::thread::sleep(std::time::Duration::from_millis(200));
                    busy.retain(|id| driver.remove_leftovers(id).is_err());
                }
                for id in busy {
                    tracing::warn!(sandbox = %id, "cannot remove a leftover cgroup");
                }
            });
        }
        if let Ok(rd) = std::fs::read_dir(self.sandboxes_dir()) {
            for e in rd.flatten() {
                if e.file_name().to_str().is_some_and(|id| known.contains(id)) {
                    continue;
                }
                let _ = sbx_runtime::driver::remove_dir(&e.path());
                n += 1;
            }
        }
        n
    }

    pub(crate) fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    pub fn driver_name(&self) -> &'static str {
        self.driver.name()
    }

    /// Sandboxes in use by runs now (not counting warm ones).
    pub fn sandbox_count(&self) -> usize {
        self.table.locked().by_id.len()
    }

    /// Teardowns still under way.
    pub fn pending_teardowns(&self) -> usize {
        self.teardowns.load(Ordering::SeqCst)
    }

    fn release(&self, id: &str) {
        let mut t = self.table.locked();
        if let Some(e) = t.by_id.remove(id) {
            if let Some(n) = e.name {
                t.names.remove(&n);
            }
        }
    }

    /// Checks what a run or a create asks of the machine against what this node serves, and
    /// resolves its image and shape. Every refusal happens here, before anything is made.
    pub fn check_machine(&self, req: &RunRequest, long_lived: bool) -> Result<Machine, ApiError> {
        if let Some(allowed) = &self.cfg.image_allowlist {
            let name = req.image.as_deref().unwrap_or("base");
            if !allowed.iter().any(|a| a == name) {
                return Err(ApiError::new(
                    ErrorCode::ImageNotAllowed,
                    format!("image {name} is not in this node's image_allowlist"),
                )
                .with_param("image"));
            }
        }
        let held = self.sandbox_count() + self.managed.locked().len();
        if held >= self.cfg.max_sandboxes {
            return Err(ApiError::new(
                ErrorCode::NoCapacity,
                format!(
                    "the node holds {held} sandboxes, its most (max_sandboxes {})",
                    self.cfg.max_sandboxes
                ),
            ));
        }
        if req.egress.as_ref().is_some_and(|e| !e.is_null()) {
            return Err(not_served("egress", "egress rules"));
        }
        if let Some(v) = req.volumes.first() {
            return Err(ApiError::new(
                ErrorCode::VolumeNotFound,
                format!("no volume {} on this node", v.volume),
            )
            .with_param("volumes[0].volume"));
        }
        if let Some(s) = &req.snapshot {
            return Err(ApiError::new(
                ErrorCode::SnapshotNotFound,
                format!("no snapshot {s} on this node"),
            )
            .with_param("snapshot"));
        }
        // A kept sandbox's template is looked up when its settings are taken
        // (`Node::apply_template`); a run is made from the base template alone.
        if let Some(t) = req.template.as_ref().filter(|_| !long_lived) {
            if t != crate::templates::BASE {
                return Err(ApiError::new(
                    ErrorCode::TemplateNotFound,
                    format!("no template {t} on this node"),
                )
                .with_param("template"));
            }
        }
        if req.project_network {
            return Err(not_served("project_network", "project networks"));
        }
        if req.init.is_some() {
            return Err(ApiError::new(
                ErrorCode::InvalidStart,
                "this node has no image of a whole system (--systemd-image)",
            )
            .with_param("init"));
        }
        if req.runtime.as_ref().is_some_and(|r| !r.is_null()) {
            return Err(not_served("runtime", "runtime settings"));
        }
        if !long_lived && (req.ready.is_some() || req.start_command.is_some()) {
            let param = if req.ready.is_some() {
                "ready"
            } else {
                "start_command"
            };
            return Err(not_served(param, "start commands in a run"));
        }
        if req.on_expiry != sbx_api::OnExpiry::Delete {
            return Err(not_served("on_expiry", "sleep"));
        }
        if req.guest_mitigations == Some(true) {
            return Err(not_served(
                "guest_mitigations",
                "guest kernels (its sandboxes share the host's kernel)",
            ));
        }
        if !req.public_ports.is_empty() || req.public_ports_except.is_some() {
            let p = if req.public_ports.is_empty() {
                "public_ports_except"
            } else {
                "public_ports"
            };
            return Err(not_served(p, "preview URLs"));
        }
        if req
            .inbound
            .as_ref()
            .and_then(|v| v.as_array())
            .is_some_and(|a| !a.is_empty())
        {
            return Err(ApiError::new(
                ErrorCode::NoIpv6,
                "this node has no pool of IPv6 addresses",
            )
            .with_param("inbound"));
        }
        if req.checkpoint.as_ref().is_some_and(|c| !c.is_null()) {
            return Err(ApiError::new(
                ErrorCode::CheckpointsUnavailable,
                "this node takes no checkpoints",
            )
            .with_param("checkpoint"));
        }
        let mut expires_in_ms = None;
        if let Some(at) = &req.expires_at {
            let at_ns = sbx_api::parse_rfc3339(at).ok_or_else(|| {
                ApiError::invalid_field("expires_at", "expires_at is not an RFC 3339 time")
            })?;
            let left_ns = at_ns - crate::image::now_ns();
            if left_ns <= 0 {
                return Err(ApiError::new(
                    ErrorCode::ExpiresInThePast,
                    "expires_at is not in the future",
                )
                .with_param("expires_at"));
            }
            expires_in_ms = Some((left_ns / 1_000_000) as u64 + 1);
        }
        let memory = req
            .limits
            .memory_bytes
            .unwrap_or(self.cfg.default_memory_bytes);
        if memory > self.cfg.max_memory_bytes {
            return Err(ApiError::invalid_field(
                "limits.memory_bytes",
                format!("at most {} bytes on this node", self.cfg.max_memory_bytes),
            ));
        }
        let vcpus = req.limits.vcpus.unwrap_or(self.cfg.default_vcpus);
        if vcpus > self.cfg.max_vcpus {
            return Err(ApiError::invalid_field(
                "limits.vcpus",
                format!("at most {} on this node", self.cfg.max_vcpus),
            ));
        }
        let mut image = match self.images.lookup(req.image.as_deref()) {
            Ok(i) => i,
            Err(ImageError::InvalidReference(why)) => {
                return Err(ApiError::new(ErrorCode::InvalidImage, why).with_param("image"))
            }
            Err(e) => {
                tracing::error!(error = %e, "no image");
                return Err(ApiError::new(ErrorCode::Unavailable, e.to_string()));
            }
        };
        let creds = match &req.image_pull_secret {
            Some(secret) => {
                let (login, source) = self.image_login(req.image.as_deref(), secret)?;
                image = source;
                Some(login)
            }
            None => None,
        };
        if !long_lived && req.start == Some(true) && !image.is_base() {
            // A run starts no start command; the base image has none to start.
            return Err(not_served("start", "start commands in a run"));
        }
        let limits = Limits {
            memory_bytes: memory,
            vcpus,
            pids: self.cfg.pids_max,
        };
        Ok(Machine {
            image,
            creds,
            limits,
            expires_in_ms,
        })
    }

    /// The registry login of `image_pull_secret` for `image` (a reference: with a login it is
    /// always asked of its registry), and the image to pull. The secret's refusals: 404
    /// secret_not_found, 403 secret_host_not_allowed, 400 invalid_field.
    pub(crate) fn image_login(
        &self,
        image: Option<&str>,
        secret: &str,
    ) -> Result<(sbx_image::Credentials, Source), ApiError> {
        let reference = match image {
            Some(i) if !ImageStore::is_catalog(Some(i)) => {
                sbx_image::parse_reference(i).map_err(|e| {
                    ApiError::new(ErrorCode::InvalidImage, e.to_string()).with_param("image")
                })?
            }
            _ => {
                return Err(ApiError::invalid_field(
                    "image_pull_secret",
                    "image_pull_secret goes with an image of a registry, not a catalog name",
                ))
            }
        };
        let (username, password) = self.pull_credentials(secret, reference.registry())?;
        Ok((
            sbx_image::Credentials { username, password },
            Source::Remote(reference.to_string()),
        ))
    }

    /// Checks a run against what this node serves and reserves its name. Every refusal
    /// happens here, before anything is made.
    pub fn plan_run(&self, req: RunRequest) -> Result<RunPlan, ApiError> {
        if self.is_stopping() {
            return Err(stopping_error());
        }
        let Machine {
            image,
            creds,
            limits,
            expires_in_ms,
        } = self.check_machine(&req, false)?;
        let mut deadline_ms = sbx_api::seconds_to_ms(req.timeout_seconds);
        if let Some(left) = expires_in_ms {
            // The sandbox is deleted when it expires: the command ends then at the latest.
            deadline_ms = deadline_ms.min(left);
        }
        let exec_id = sbx_api::new_id("exe");
        let mut env: Vec<(String, String)> = req.env.clone().into_iter().collect();
        env.extend(req.secret_env.0.clone());
        let exec = ExecSpec {
            exec_id: exec_id.clone(),
            program: crate::agent::program(&req.command),
            env,
            cwd: req.cwd.clone(),
            user: req.user.clone(),
            timeout_ms: Some(deadline_ms.max(1)),
            stdin_open: false,
            stdin_null: false,
            attach: true,
            tty: false,
            wait_for_reader: req.wait_for_reader,
            rows: 24,
            cols: 80,
        };
        // A warm sandbox serves a run of the base image whose machine it can become: any
        // limits (set on its cgroup), but not another hostname or a /tmp in memory.
        let can_be_warm = image.is_base() && req.hostname.is_none() && req.tmp == Tmp::Disk;
        let (sandbox_id, warm) = {
            let mut t = self.table.locked();
            if let Some(n) = &req.name {
                if t.names.contains_key(n) {
                    return Err(ApiError::new(
                        ErrorCode::NameTaken,
                        format!("a sandbox is named {n}"),
                    )
                    .with_param("name"));
                }
            }
            let warm = if can_be_warm {
                self.take_live_warm()
            } else {
                None
            };
            let sandbox_id = match &warm {
                Some(w) => w.sandbox.id.clone(),
                None => sbx_api::new_id("sbx"),
            };
            if let Some(n) = &req.name {
                t.names.insert(n.clone(), sandbox_id.clone());
            }
            t.by_id.insert(
                sandbox_id.clone(),
                Entry {
                    name: req.name.clone(),
                },
            );
            (sandbox_id, warm)
        };
        Ok(RunPlan {
            hostname: req.hostname.clone().unwrap_or_else(|| sandbox_id.clone()),
            sandbox_id,
            exec_id,
            command: req.command.display(),
            encoding: req.encoding,
            image,
            creds,
            limits,
            tmp_memory: req.tmp == Tmp::Memory,
            exec,
            stdin: req.stdin,
            warm,
        })
    }

    /// Runs a planned command in its own sandbox; events go to `tx`. The sandbox is deleted
    /// when the command ends, when the receiver is dropped (the caller hung up), or on failure.
    pub async fn run(self: Arc<Self>, plan: RunPlan, tx: mpsc::Sender<RunEvent>) {
        let id = plan.sandbox_id.clone();
        let result = self.run_inner(plan, &tx).await;
        // The name is free before the caller hears the end.
        self.release(&id);
        let sandbox = self.live.locked().remove(&id);
        match result {
            Ok(Some((exit, output))) => {
                let _ = tx.send(RunEvent::Exited { exit, output }).await;
            }
            Ok(None) => {
                tracing::info!(sandbox = %id, "caller_gone: the caller hung up; sandbox ended");
            }
            Err(e) => {
                let _ = tx.send(RunEvent::Failed(e)).await;
            }
        }
        if let Some(sb) = sandbox {
            self.teardown(sb);
        }
    }

    fn teardown(self: &Arc<Self>, sb: Arc<Sandbox>) {
        self.teardowns.fetch_add(1, Ordering::SeqCst);
        let node = self.clone();
        tokio::task::spawn_blocking(move || {
            // A group that still has processes after a round (each kills for 30 s) is tried
            // again: the sandbox is never given up while something of it runs.
            for round in 1..=TEARDOWN_ROUNDS {
                match node.driver.destroy(&sb) {
                    Ok(()) => break,
                    Err(e) if round < TEARDOWN_ROUNDS => {
                        tracing::warn!(sandbox = %sb.id, error = %e, round, "teardown: trying again");
                        std::thread::sleep(Duration::from_secs(1));
                    }
                    Err(e) => tracing::error!(sandbox = %sb.id, error = %e, "teardown gave up"),
                }
            }
            if let Err(e) = sbx_runtime::driver::remove_dir(&sb.dir) {
                tracing::warn!(sandbox = %sb.id, error = %e, "remove sandbox directory");
            }
            node.teardowns.fetch_sub(1, Ordering::SeqCst);
        });
    }

    async fn run_inner(
        self: &Arc<Self>,
        mut plan: RunPlan,
        tx: &mpsc::Sender<RunEvent>,
    ) -> Result<Option<(ExitInfo, OutputCounts)>, ApiError> {
        let t0 = std::time::Instant::now();
        let warm = plan.warm.take();
        let from_pool = warm.is_some();
        let (sandbox, mut conn) = match warm {
            Some(w) => {
                self.refill();
                if w.limits != plan.limits {
                    if let Err(e) = w.sandbox.set_limits(&plan.limits) {
                        tracing::error!(sandbox = %plan.sandbox_id, error = %e, "set limits");
                        self.live_insert(&w.sandbox);
                        return Err(ApiError::internal());
                    }
                }
                self.live_insert(&w.sandbox);
                (w.sandbox, w.conn)
            }
            None => {
                let image = match &plan.image {
                    Source::Local(i) => (**i).clone(),
                    Source::Remote(r) => self
                        .images
                        .pull(r, plan.creds.as_ref(), &|_| {})
                        .await
                        .map_err(|e| pull_refused(r, &e))?,
                };
                self.make(&plan, &image).await?
            }
        };
        let t_ready = t0.elapsed();
        if self.is_stopping() {
            // Made while the node began to stop: `shutdown` did not see it; `run` ends it.
            return Err(stopping_error());
        }
        let failed = |e: crate::agent::AgentError| {
            if let Some(too_large) = e.too_large("command") {
                return too_large;
            }
            if self.is_stopping() {
                return stopping_error();
            }
            tracing::error!(sandbox = %plan.sandbox_id, error = %e, "agent");
            if sandbox.oom_killed() {
                ApiError::new(
                    ErrorCode::SandboxFailed,
                    "the sandbox ran out of memory (limits.memory_bytes)",
                )
            } else {
                ApiError::new(
                    ErrorCode::CommandLost,
                    format!("the command went away: {e}"),
                )
            }
        };
        // A run given no input reads /dev/null: no stdin pipe, no CloseStdin after it.
        let no_stdin = conn.takes_stdin_null() && plan.stdin.is_none();
        let mut exec = plan.exec.clone();
        exec.stdin_null = no_stdin;
        conn.send(&HostMsg::Exec(exec)).await.map_err(failed)?;
        if let Some(input) = &plan.stdin {
            conn.send_stdin(&plan.exec_id, input)
                .await
                .map_err(failed)?;
        }
        if !no_stdin {
            conn.send(&HostMsg::CloseStdin {
                exec_id: plan.exec_id.clone(),
            })
            .await
            .map_err(failed)?;
        }
        // The agent enforces the deadline. The node's own holds too: an agent that has not
        // reported the end `RUN_GRACE` after it (starved by a fork bomb under the sandbox's
        // CPU quota and pids limit, or stuck) does not hold the run; the run is answered
        // `timed_out` and `run` ends the sandbox through its cgroup.
        let sent = std::time::Instant::now();
        let timeout = Duration::from_millis(plan.exec.timeout_ms.unwrap_or(0));
        let deadline = tokio::time::Instant::now() + timeout + RUN_GRACE;
        let mut started = None;
        let mut seen = OutputCounts::default();
        loop {
            let frame = tokio::select! {
                f = conn.recv() => f.map_err(failed)?,
                _ = tx.closed() => return Ok(None),
                _ = tokio::time::sleep_until(deadline) => {
                    tracing::warn!(sandbox = %plan.sandbox_id, "the agent did not report the end of a run past its timeout: the sandbox is ended");
                    let since = started.unwrap_or(sent);
                    let exit = ExitInfo {
                        status: sbx_proto::ExitStatus::TimedOut,
                        // Reported killed by SIGKILL, as the agent would have.
                        exit_code: 128 + libc::SIGKILL,
                        signal: Some(libc::SIGKILL),
                        duration_ns: since.elapsed().as_nanos() as u64,
                        cpu_ns: 0,
                        max_rss_bytes: 0,
                    };
                    return Ok(Some((exit, seen)));
                }
            };
            let event = match frame {
                Frame::Data {
                    stream, pos, bytes, ..
                } => {
                    let n = bytes.len() as u64;
                    match stream {
                        Stream::Stdout => seen.stdout_bytes += n,
                        Stream::Stderr => seen.stderr_bytes += n,
                        _ => {}
                    }
                    seen.end = seen.end.max(pos + n);
                    RunEvent::Output {
                        stream,
                        pos,
                        data: bytes,
                    }
                }
                Frame::Msg(AgentMsg::Started {
                    pid, started_at_ns, ..
                }) => {
                    started = Some(std::time::Instant::now());
                    RunEvent::Started { pid, started_at_ns }
                }
                Frame::Msg(AgentMsg::Gap { from, to, .. }) => {
                    seen.end = seen.end.max(to);
                    RunEvent::Gap { from, to }
                }
                Frame::Msg(AgentMsg::Exited { exit, output, .. }) => {
                    tracing::debug!(
                        sandbox = %plan.sandbox_id,
                        from_pool,
                        ready_us = t_ready.as_micros() as u64,
                        exited_us = t0.elapsed().as_micros() as u64,
                        "run timings"
                    );
                    return Ok(Some((exit, output)));
                }
                Frame::Msg(AgentMsg::ExecFailed { kind, message, .. }) => {
                    return Err(match kind {
                        ExecFailKind::NoSuchUser => {
                            ApiError::new(ErrorCode::NoSuchUser, message).with_param("user")
                        }
                        _ => {
                            tracing::error!(sandbox = %plan.sandbox_id, %message, "exec failed");
                            ApiError::internal()
                        }
                    });
                }
                Frame::Msg(_) => continue,
            };
            if tx.send(event).await.is_err() {
                return Ok(None);
            }
        }
    }

    pub(crate) fn live_insert(&self, sb: &Arc<Sandbox>) {
        self.live.locked().insert(sb.id.clone(), sb.clone());
    }

    pub(crate) fn live_remove(&self, id: &str) {
        self.live.locked().remove(id);
    }

    /// Ends a sandbox of the node's live table now (in the background).
    pub(crate) fn end_run_sandbox(self: &Arc<Self>, id: &str) {
        let sb = self.live.locked().remove(id);
        if let Some(sb) = sb {
            self.teardown(sb);
        }
    }

    /// Takes a warm sandbox whose agent still runs; one found dead (killed from outside while
    /// it waited) is ended, and the next one is tried.
    fn take_live_warm(&self) -> Option<Warm> {
        loop {
            let w = self.warm.locked().pop()?;
            if w.sandbox.is_alive() {
                return Some(w);
            }
            tracing::warn!(sandbox = %w.sandbox.id, "a warm sandbox had died: ended");
            self.live_remove(&w.sandbox.id);
            // Its agent is gone already: what is left (cgroups, directory) goes at once.
            if let Err(e) = self.driver.destroy(&w.sandbox) {
                tracing::warn!(sandbox = %w.sandbox.id, error = %e, "teardown");
            }
            let _ = sbx_runtime::driver::remove_dir(&w.sandbox.dir);
        }
    }

    /// Takes a warm sandbox (out of the node's live table: the caller keeps it).
    pub(crate) fn pop_warm(self: &Arc<Self>) -> Option<Arc<Sandbox>> {
        let w = self.take_live_warm()?;
        self.live_remove(&w.sandbox.id);
        self.refill();
        Some(w.sandbox)
    }

    /// Reserves a name for sandbox `id` (409 name_taken when another has it).
    pub(crate) fn reserve_name(&self, name: Option<&str>, id: &str) -> Result<(), ApiError> {
        let Some(n) = name else {
            return Ok(());
        };
        let mut t = self.table.locked();
        match t.names.get(n) {
            Some(other) if other != id => Err(ApiError::new(
                ErrorCode::NameTaken,
                format!("a sandbox is named {n}"),
            )
            .with_param("name")),
            _ => {
                t.names.insert(n.to_string(), id.to_string());
                Ok(())
            }
        }
    }

    pub(crate) fn release_name(&self, name: Option<&str>) {
        if let Some(n) = name {
            self.table.locked().names.remove(n);
        }
    }

    /// Makes a sandbox (in the node's table of live ones) and connects to its agent.
    pub(crate) async fn create(
        self: &Arc<Self>,
        spec: SandboxSpec,
    ) -> Result<(Arc<Sandbox>, AgentConn), ApiError> {
        let id = spec.id.clone();
        let driver = self.driver.clone();
        let made = tokio::task::spawn_blocking(move || driver.create(&spec))
            .await
            .map_err(crate::http::internal("making a sandbox"))?;
        let sandbox = match made {
            Ok(sb) => Arc::new(sb),
            Err(e) => {
                tracing::error!(sandbox = %id, error = %e, "sandbox did not start");
                return Err(ApiError::new(
                    ErrorCode::SandboxFailed,
                    format!("the sandbox could not be started: {e}"),
                ));
            }
        };
        self.live_insert(&sandbox);
        match AgentConn::connect(&sandbox.socket, Duration::from_secs(10)).await {
            Ok(conn) => Ok((sandbox, conn)),
            Err(e) => {
                tracing::error!(sandbox = %id, error = %e, "agent did not answer");
                Err(ApiError::new(
                    ErrorCode::SandboxFailed,
                    format!("the sandbox's agent did not answer: {e}"),
                ))
            }
        }
    }

    async fn make(
        self: &Arc<Self>,
        plan: &RunPlan,
        image: &Image,
    ) -> Result<(Arc<Sandbox>, AgentConn), ApiError> {
        self.create(SandboxSpec {
            id: plan.sandbox_id.clone(),
            lowers: image.lowers.clone(),
            dir: self.sandboxes_dir().join(&plan.sandbox_id),
            hostname: plan.hostname.clone(),
            limits: plan.limits,
            tmp_memory: plan.tmp_memory,
            image_env: image.meta.env.clone(),
            image_user: image.meta.user.clone(),
            image_workdir: image.meta.workdir.clone(),
            netns: None,
        })
        .await
    }

    /// Ids of the warm sandboxes.
    pub fn warm_ids(&self) -> Vec<String> {
        self.warm
            .locked()
            .iter()
            .map(|w| w.sandbox.id.clone())
            .collect()
    }

    /// Makes warm sandboxes until the pool is full (one refiller at a time, in the background).
    pub fn refill(self: &Arc<Self>) {
        if self.cfg.warm_pool == 0 || self.refilling.swap(true, Ordering::SeqCst) {
            return;
        }
        let node = self.clone();
        tokio::spawn(async move {
            loop {
                let have = node.warm.locked().len();
                if have >= node.cfg.warm_pool || node.is_stopping() {
                    break;
                }
                let Ok(image) = node.images.base() else {
                    break;
                };
                let id = sbx_api::new_id("sbx");
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
                    image_env: image.meta.env.clone(),
                    image_user: image.meta.user.clone(),
                    image_workdir: image.meta.workdir.clone(),
                    netns: None,
                };
                match node.create(spec).await {
                    Ok((sandbox, conn)) => {
                        // `create` put it in `live` too, so that a stopping node ends it.
                        node.warm.locked().push(Warm {
                            sandbox,
                            conn,
                            limits,
                        });
                        if node.is_stopping() {
                            // `shutdown` may have run between the check above and now.
                            node.drain_warm();
                        }
                    }
                    Err(_) => {
                        let sb = node.live.locked().remove(&id);
                        if let Some(sb) = sb {
                            node.teardown(sb);
                        }
                        // Do not spin on a node that cannot make sandboxes.
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
            node.refilling.store(false, Ordering::SeqCst);
        });
    }

    fn drain_warm(self: &Arc<Self>) {
        let warm: Vec<Warm> = self.warm.locked().drain(..).collect();
        for w in warm {
            let sb = self.live.locked().remove(&w.sandbox.id);
            if let Some(sb) = sb {
                self.teardown(sb);
            }
        }
    }

    /// Ends every sandbox (the node is stopping) and waits for their teardown.
    pub async fn shutdown(self: &Arc<Self>) {
        self.stopping.store(true, Ordering::SeqCst);
        self.drain_warm();
        let all: Vec<Arc<Sandbox>> = self.live.locked().drain().map(|(_, s)| s).collect();
        for sb in all {
            self.teardown(sb);
        }
        for _ in 0..3000 {
            if self.pending_teardowns() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Kept sandboxes run on (the next node adopts them): their groups keep the folder.
        self.driver.release();
    }
}
