//! Long-lived sandboxes: create, get, list, delete, restart; their commands: exec, wait,
//! output, stdin, signal. The table is in SQLite ([`crate::store`]); the commands' output is
//! their agent's. A sandbox's agent outlives the node: a node that starts again adopts it.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sbx_api::{
    ApiError, Command, Encoding, ErrorCode, ExecObject, ExecRequest, SandboxCreate, SandboxLimits,
    SandboxObject, SandboxStatus,
};
use sbx_proto::{AgentMsg, ExecFailKind, ExecSpec, ExecState, Frame, HostMsg, Program, Stream};
use sbx_runtime::{Limits, Sandbox, SandboxSpec};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::agent::{one_shot, program, AgentConn, AgentError};
use crate::http::{exec_object, ExecMeta, Started, Tail};
use crate::image::{ImageMeta, Source};
use crate::node::{Machine, Node, RunEvent};
use crate::probe::Probe;
use crate::store::{ExecRow, SandboxRow};
use crate::sync::LockExt;
use crate::templates::{self, Plan, Settings, BASE, CANCELLED};

/// The id of the start command's exec.
pub const START_EXEC: &str = "exe-start";

/// What the node keeps of a create, to make the machine again.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StoredSpec {
    pub image: String,
    pub vcpus: u32,
    pub memory_bytes: u64,
    pub hostname: Option<String>,
    pub tmp_memory: bool,
    pub env: BTreeMap<String, String>,
    /// Sealed with the node key in the state database ([`crate::secrets::sealed_env`]).
    #[serde(with = "crate::secrets::sealed_env")]
    pub secret_env: BTreeMap<String, String>,
    pub metadata: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub user: Option<String>,
    pub start_command: Option<Command>,
    /// A command that succeeds once the sandbox is up (`ready.command`).
    #[serde(default)]
    pub ready_command: Option<Command>,
    /// `ready.tcp` / `ready.http`, tried from the host.
    #[serde(default)]
    pub ready_probe: Option<Probe>,
    /// `start` as given: true starts the image's ENTRYPOINT and CMD, false nothing; not given
    /// (and no start_command, no ready) the image's labels `sbx.start` and `sbx.ready` decide.
    #[serde(default)]
    pub start: Option<bool>,
    /// The signal that stops the start command; `None`: the image's STOPSIGNAL, else SIGTERM.
    #[serde(default)]
    pub stop_signal: Option<i32>,
    pub stop_grace_ms: u32,
    pub expires_at: Option<String>,
    /// The secret of the image's registry login: each boot pulls with it.
    #[serde(default)]
    pub image_pull_secret: Option<String>,
    /// The key of its template ([`crate::templates`]); `None` in a row of an older node.
    #[serde(default)]
    pub template: Option<String>,
}

impl StoredSpec {
    /// Whether start, start_command or ready was given: then the image's labels are not read.
    fn start_given(&self) -> bool {
        self.start.is_some()
            || self.start_command.is_some()
            || self.ready_command.is_some()
            || self.ready_probe.is_some()
    }

    /// The settings that make its template.
    pub fn template_settings(&self) -> Settings {
        let nothing_started =
            self.start == Some(false) || (self.image == "base" && !self.start_given());
        Settings {
            image: self.image.clone(),
            image_pull_secret: self.image_pull_secret.clone(),
            start: self.start,
            start_command: self.start_command.clone(),
            ready_command: self.ready_command.clone(),
            ready_probe: self.ready_probe.clone(),
            env: if nothing_started {
                BTreeMap::new()
            } else {
                self.env.clone()
            },
            vcpus: self.vcpus,
            memory_bytes: self.memory_bytes,
        }
    }
}

/// A sandbox's ready check.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Check {
    /// Run in the sandbox by sh, as the image's user.
    Command(String),
    /// Tried from the host.
    Probe(Probe),
}

/// What a boot starts and checks, resolved against its image.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Resolved {
    pub start: Option<Command>,
    pub ready: Option<Check>,
    pub stop_signal: i32,
    /// The manifest digest of a pulled image.
    pub digest: Option<String>,
}

impl Default for Resolved {
    fn default() -> Resolved {
        Resolved {
            start: None,
            ready: None,
            stop_signal: libc::SIGTERM,
            digest: None,
        }
    }
}

/// Resolves what `spec` starts against its image (`None`: the base image, which has no start
/// command, labels or STOPSIGNAL). `Err` says why the image cannot be started as asked
/// (failure_code `invalid_image`).
pub(crate) fn resolve(spec: &StoredSpec, meta: Option<&ImageMeta>) -> Result<Resolved, String> {
    let label = |name: &str| {
        meta.and_then(|m| m.labels.get(name))
            .filter(|v| !v.trim().is_empty())
            .cloned()
    };
    let (start, ready) = if spec.start_given() {
        let start = match (&spec.start_command, spec.start) {
            (Some(c), _) => Some(c.clone()),
            // The base image (no meta) has no start command of its own: nothing to start.
            (None, Some(true)) => match meta.map(|m| &m.start) {
                None => None,
                Some(argv) if !argv.is_empty() => Some(Command::Argv(argv.clone())),
                Some(_) => {
                    return Err(format!(
                        "start: true, and the image {} has no start command (ENTRYPOINT or CMD)",
                        spec.image
                    ))
                }
            },
            _ => None,
        };
        let ready = match (&spec.ready_command, &spec.ready_probe) {
            (Some(c), _) => Some(Check::Command(shell_line(c))),
            (None, Some(p)) => Some(Check::Probe(p.clone())),
            (None, None) => None,
        };
        (start, ready)
    } else {
        let start = label("sbx.start").map(Command::Shell);
        // A ready label without a start label has nothing to wait for.
        let ready = label("sbx.ready")
            .filter(|_| start.is_some())
            .map(Check::Command);
        (start, ready)
    };
    // STOPSIGNAL is a name (SIGTERM) or a number (15), as Docker takes it.
    let image_signal = meta.and_then(|m| m.stop_signal.as_deref()).and_then(|s| {
        sbx_api::signal_number(s).or_else(|| s.parse().ok().filter(|n| (1..=64).contains(n)))
    });
    Ok(Resolved {
        start,
        ready,
        stop_signal: spec.stop_signal.or(image_signal).unwrap_or(libc::SIGTERM),
        digest: None,
    })
}

/// A command as one line for sh.
fn shell_line(c: &Command) -> String {
    match c {
        Command::Shell(s) => s.clone(),
        Command::Argv(a) => a.join(" "),
    }
}

/// The `<registry>/<repository>@<digest>` of `image` (a reference) pinned to `digest`.
fn pinned_reference(image: &str, digest: &str) -> Option<String> {
    let r = sbx_image::parse_reference(image).ok()?;
    Some(format!(
        "{}/{}@{}",
        r.registry_addr(),
        r.repository(),
        digest
    ))
}

/// Set when a sandbox is deleted while it starts: its pull, its template wait and its ready
/// check end at once.
struct Cancel(tokio::sync::watch::Sender<bool>);

impl Cancel {
    fn new() -> Cancel {
        Cancel(tokio::sync::watch::channel(false).0)
    }

    fn cancel(&self) {
        self.0.send_replace(true);
    }

    fn is_set(&self) -> bool {
        *self.0.borrow()
    }

    async fn wait(&self) {
        let mut rx = self.0.subscribe();
        let _ = rx.wait_for(|c| *c).await;
    }
}

/// A sandbox the node keeps.
pub struct Managed {
    pub id: String,
    row: Mutex<SandboxRow>,
    spec: StoredSpec,
    machine: Mutex<Option<Arc<Sandbox>>>,
    running: Mutex<HashSet<String>>,
    /// One lifecycle change at a time.
    op: Arc<tokio::sync::Mutex<()>>,
    /// What the current boot started and checks.
    resolved: Mutex<Resolved>,
    cancel: Cancel,
}

impl Managed {
    fn new(row: SandboxRow, spec: StoredSpec) -> Managed {
        Managed {
            id: row.id.clone(),
            row: Mutex::new(row),
            spec,
            machine: Mutex::new(None),
            running: Mutex::new(HashSet::new()),
            op: Arc::new(tokio::sync::Mutex::new(())),
            resolved: Mutex::new(Resolved::default()),
            cancel: Cancel::new(),
        }
    }

    fn resolved(&self) -> Resolved {
        self.resolved.locked().clone()
    }

    fn status(&self) -> SandboxStatus {
        SandboxStatus::parse(&self.row.locked().status).unwrap_or(SandboxStatus::Failed)
    }

    pub(crate) fn boot(&self) -> u32 {
        self.row.locked().restarts
    }

    fn machine(&self) -> Option<Arc<Sandbox>> {
        self.machine.locked().clone()
    }

    fn name(&self) -> Option<String> {
        self.row.locked().name.clone()
    }
}

fn not_found(id: &str) -> ApiError {
    ApiError::new(ErrorCode::SandboxNotFound, format!("no sandbox {id}"))
}

fn wrong_state(status: SandboxStatus, what: &str) -> ApiError {
    ApiError::new(
        ErrorCode::SandboxNotRunning,
        format!("the sandbox is {}: it cannot {what}", status.as_str()),
    )
}

fn store_err(e: crate::store::StoreError) -> ApiError {
    tracing::error!(error = %e, "state database");
    ApiError::internal()
}

fn agent_lost(e: AgentError) -> ApiError {
    if let Some(too_large) = e.too_large("command") {
        return too_large;
    }
    tracing::warn!(error = %e, "agent");
    ApiError::new(
        ErrorCode::CommandLost,
        format!("the sandbox's agent did not answer: {e}"),
    )
}

/// Filters and page of `GET /v1/sandboxes`.
#[derive(Debug, Default, Clone)]
pub struct ListQuery {
    pub status: Option<SandboxStatus>,
    pub metadata: Vec<(String, String)>,
    pub limit: usize,
    pub cursor: Option<String>,
}

impl Node {
    pub(crate) fn managed(&self, id_or_name: &str) -> Result<Arc<Managed>, ApiError> {
        let m = self.managed.locked();
        if let Some(s) = m.get(id_or_name) {
            return Ok(s.clone());
        }
        m.values()
            .find(|s| s.name().as_deref() == Some(id_or_name))
            .cloned()
            .ok_or_else(|| not_found(id_or_name))
    }

    pub fn sandbox_object(&self, m: &Managed) -> SandboxObject {
        let row = m.row.locked().clone();
        SandboxObject {
            id: m.id.clone(),
            object: "sandbox".into(),
            name: row.name,
            status: SandboxStatus::parse(&row.status).unwrap_or(SandboxStatus::Failed),
            image: m.spec.image.clone(),
            limits: SandboxLimits {
                vcpus: m.spec.vcpus,
                memory_bytes: m.spec.memory_bytes,
            },
            hostname: m.spec.hostname.clone().unwrap_or_else(|| m.id.clone()),
            metadata: m.spec.metadata.clone(),
            env: m.spec.env.clone(),
            secret_env: m.spec.secret_env.keys().cloned().collect(),
            created_at: sbx_api::format_rfc3339_millis(i128::from(row.created_at_ns)),
            started_at: row
                .started_at_ns
                .map(|t| sbx_api::format_rfc3339_millis(i128::from(t))),
            expires_at: m.spec.expires_at.clone(),
            failure_code: row.failure_code,
            failure: row.failure,
            restarts: row.restarts,
            template: m.spec.template.clone(),
        }
    }

    /// The image of `spec`'s template pinned by digest, once the template is built of a
    /// pulled image.
    fn pinned_image(&self, spec: &StoredSpec) -> Option<String> {
        spec.template
            .as_deref()
            .filter(|k| *k != BASE)
            .and_then(|k| templates::get(&self.store, k).ok().flatten())
            .filter(|t| t.status == "ready")
            .and_then(|t| t.digest)
            .and_then(|d| pinned_reference(&spec.image, &d))
    }

    /// What an adopted sandbox's boot started, resolved again from the node's store (no
    /// pull): its start command's stop signal, for its delete.
    fn resolve_adopted(&self, spec: &StoredSpec) -> Resolved {
        let pinned = self.pinned_image(spec);
        let name = pinned.as_deref().unwrap_or(&spec.image);
        let meta = match self.images.lookup_private(name) {
            Ok(Source::Local(i)) if i.meta.name != "base" => Some(i.meta),
            _ => None,
        };
        resolve(spec, meta.as_ref()).unwrap_or_default()
    }

    /// The machine of `m` and what it starts: its image resolved (its template's, pinned by
    /// digest, once the template is built; a pulled image from the node's store, pulled again
    /// when the store no longer has it). Errors carry the sandbox's failure code.
    async fn machine_spec(
        &self,
        m: &Managed,
    ) -> Result<(SandboxSpec, Resolved), (&'static str, ApiError)> {
        let failed =
            |code: &'static str, why: String| (code, ApiError::new(ErrorCode::SandboxFailed, why));
        let pinned = self.pinned_image(&m.spec);
        let name = pinned.as_deref().unwrap_or(&m.spec.image);
        let (looked_up, creds) = match &m.spec.image_pull_secret {
            Some(secret) => match self.image_login(Some(name), secret) {
                // The template of this login is its own: a built one is on the node.
                Ok((creds, source)) => {
                    match pinned.as_deref().map(|p| self.images.lookup_private(p)) {
                        Some(Ok(Source::Local(i))) => (Ok(Source::Local(i)), Some(creds)),
                        _ => (Ok(source), Some(creds)),
                    }
                }
                Err(e) => {
                    let code = e.code.as_str();
                    return Err((code, e));
                }
            },
            None => (self.images.lookup(Some(name)), None),
        };
        let image = match looked_up {
            Ok(Source::Local(i)) => *i,
            Ok(Source::Remote(r)) => {
                let pull = self.images.pull(&r, creds.as_ref(), &|_| {});
                tokio::select! {
                    got = pull => got.map_err(|e| {
                        let code = e.code();
                        (code, crate::node::pull_refused(&r, &e))
                    })?,
                    _ = m.cancel.wait() => {
                        return Err(failed("boot_failed", "deleted while its image was pulled".into()))
                    }
                }
            }
            Err(e) => return Err(failed("boot_failed", format!("image: {e}"))),
        };
        let meta = (!image.meta.name.eq("base")).then_some(&image.meta);
        let mut resolved = resolve(&m.spec, meta).map_err(|why| failed("invalid_image", why))?;
        resolved.digest = image.oci.as_ref().map(|o| o.digest.clone());
        let spec = SandboxSpec {
            id: m.id.clone(),
            lowers: image.lowers.clone(),
            dir: self.sandboxes_dir().join(&m.id),
            hostname: m.spec.hostname.clone().unwrap_or_else(|| m.id.clone()),
            limits: Limits {
                memory_bytes: m.spec.memory_bytes,
                vcpus: m.spec.vcpus,
                pids: self.cfg.pids_max,
            },
            tmp_memory: m.spec.tmp_memory,
            image_env: image.meta.env.clone(),
            image_user: image.meta.user.clone(),
            image_workdir: image.meta.workdir.clone(),
            netns: None,
        };
        Ok((spec, resolved))
    }

    fn base_env(m: &Managed) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = m.spec.env.clone().into_iter().collect();
        env.extend(m.spec.secret_env.clone());
        env
    }

    /// Boots the machine of `m` (made, or taken warm), starts its start command and waits for
    /// its ready check; on failure the sandbox is `failed` with its `failure_code`.
    async fn boot(
        self: &Arc<Self>,
        m: &Arc<Managed>,
        warm: Option<Arc<Sandbox>>,
    ) -> Result<(), ApiError> {
        let made = match warm {
            // A warm sandbox is of the base image: nothing of an image to resolve.
            Some(sb) => resolve(&m.spec, None).map(|r| (sb, r)).map_err(|why| {
                (
                    "invalid_image",
                    ApiError::new(ErrorCode::SandboxFailed, why),
                )
            }),
            None => match self.machine_spec(m).await {
                Ok((spec, resolved)) => self
                    .create(spec)
                    .await
                    .map(|(sb, _conn)| (sb, resolved))
                    .map_err(|e| ("boot_failed", e)),
                Err(failed) => Err(failed),
            },
        };
        let (sb, resolved) = match made {
            Ok(x) => x,
            Err((code, e)) => {
                self.set_failed(m, code, &e.message);
                return Err(ApiError::new(ErrorCode::SandboxFailed, e.message));
            }
        };
        // `create` put it among the node's run sandboxes; a kept sandbox is its own.
        self.live_remove(&m.id);
        *m.machine.locked() = Some(sb.clone());
        self.watch_agent(m, &sb);
        {
            let mut r = m.resolved.locked();
            *r = resolved.clone();
        }
        if let Some(start) = &resolved.start {
            // exe-start is this boot's start command: an earlier boot's record gives way.
            self.store
                .delete_exec(&m.id, START_EXEC)
                .map_err(store_err)?;
            let spec = ExecSpec {
                exec_id: START_EXEC.into(),
                program: program(start),
                env: Self::base_env(m),
                cwd: m.spec.cwd.clone(),
                user: m.spec.user.clone(),
                timeout_ms: None,
                stdin_open: false,
                stdin_null: false,
                attach: false,
                tty: false,
                wait_for_reader: false,
                rows: 24,
                cols: 80,
            };
            if let Err(e) = self
                .start_exec(m, &sb, spec, start.display(), None, false)
                .await
                .map(|_| ())
            {
                self.set_failed(
                    m,
                    "boot_failed",
                    &format!("the start command: {}", e.message),
                );
                self.end_machine(m).await;
                return Err(ApiError::new(ErrorCode::SandboxFailed, e.message));
            }
        }
        if let Some(check) = &resolved.ready {
            if let Err(why) = self
                .wait_ready(m, &sb, check, resolved.start.is_some())
                .await
            {
                self.set_failed(m, "boot_failed", &why);
                self.end_machine(m).await;
                return Err(ApiError::new(ErrorCode::SandboxFailed, why));
            }
        }
        let mut row = m.row.locked();
        row.status = "running".into();
        row.pid = Some(sb.pid);
        row.start_time = sb.start_time;
        row.started_at_ns = Some(crate::image::now_ns() as i64);
        row.failure_code = None;
        row.failure = None;
        self.store.update_sandbox(&row).map_err(store_err)?;
        Ok(())
    }

    /// Boots `m` as its template's plan says: the base template and a built one at once; the
    /// first sandbox of new settings builds the template (and reports its end to the other
    /// first sandboxes, which wait for it, then boot from it).
    async fn boot_planned(
        self: &Arc<Self>,
        m: &Arc<Managed>,
        warm: Option<Arc<Sandbox>>,
        plan: Plan,
    ) -> Result<(), ApiError> {
        match plan {
            Plan::Base | Plan::Ready => self.boot(m, warm).await,
            Plan::Build(builder) => {
                let r = self.boot(m, warm).await;
                match &r {
                    Ok(()) => {
                        let digest = m.resolved().digest;
                        self.templates.ready(&self.store, builder, digest);
                    }
                    Err(_) if m.cancel.is_set() => self.templates.cancel(&self.store, builder),
                    Err(e) => {
                        let (code, why) = {
                            let r = m.row.locked();
                            (r.failure_code.clone(), r.failure.clone())
                        };
                        self.templates.failed(
                            &self.store,
                            builder,
                            code.as_deref().unwrap_or("boot_failed"),
                            why.as_deref().unwrap_or(&e.message),
                        );
                    }
                }
                r
            }
            Plan::Wait(rx) => {
                let got = tokio::select! {
                    got = templates::wait(rx) => got,
                    _ = m.cancel.wait() => Err(("boot_failed".into(), "deleted while its template was built".into())),
                };
                match got {
                    Ok(()) => self.boot(m, warm).await,
                    Err((code, _)) if code == CANCELLED && !m.cancel.is_set() => {
                        // The first sandbox went away midway: this one builds.
                        let key = m.spec.template.clone().unwrap_or_default();
                        let settings = m.spec.template_settings();
                        match self.templates.plan(&self.store, &key, &settings, &m.id) {
                            Ok(plan) => Box::pin(self.boot_planned(m, warm, plan)).await,
                            Err(e) => {
                                tracing::error!(error = %e, "templates");
                                self.give_back_warm(warm);
                                self.set_failed(m, "boot_failed", "the node failed");
                                Err(ApiError::internal())
                            }
                        }
                    }
                    Err((code, why)) => {
                        // A warm machine taken for it goes back to be ended.
                        self.give_back_warm(warm);
                        let why = format!("its template did not build: {why}");
                        self.set_failed(m, &code, &why);
                        Err(ApiError::new(ErrorCode::SandboxFailed, why))
                    }
                }
            }
        }
    }

    /// Ends a warm machine taken for a sandbox that will not use it.
    fn give_back_warm(self: &Arc<Self>, warm: Option<Arc<Sandbox>>) {
        if let Some(sb) = warm {
            self.live_insert(&sb);
            self.end_run_sandbox(&sb.id);
        }
    }

    /// Runs the ready check every 0.2 s for at most 120 s (a command as the image's user by
    /// sh, a tcp or http check from the host); a start command that ends with a failure
    /// meanwhile ends the wait at once. The error says what the check last got and what the
    /// start command printed last.
    async fn wait_ready(
        &self,
        m: &Managed,
        sb: &Sandbox,
        check: &Check,
        has_start: bool,
    ) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        let mut last = String::new();
        for n in 0u32.. {
            if m.cancel.is_set() {
                return Err("deleted while its ready check was waited for".into());
            }
            let got = match check {
                Check::Command(line) => self.ready_command_once(m, sb, line, n).await?,
                Check::Probe(p) => match sb.netns_handle() {
                    Ok(ns) => p.try_once(ns).await,
                    Err(e) => Err(format!("no handle on the sandbox: {e}")),
                },
            };
            match got {
                Ok(()) => return Ok(()),
                Err(what) => last = what,
            }
            if has_start {
                if let Ok(AgentMsg::State(st)) = one_shot(
                    &sb.socket,
                    &HostMsg::Status {
                        exec_id: START_EXEC.into(),
                    },
                )
                .await
                {
                    if let Some(x) = st.exit.filter(|x| x.exit_code != 0) {
                        return Err(format!(
                            "the start command ended with exit code {} before the ready check passed; the check last got {last}{}",
                            x.exit_code,
                            start_output(sb).await
                        ));
                    }
                }
            }
            if tokio::time::Instant::now() + Duration::from_millis(200) > deadline {
                break;
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                _ = m.cancel.wait() => {}
            }
        }
        let printed = if has_start {
            start_output(sb).await
        } else {
            String::new()
        };
        Err(format!(
            "the ready check did not pass in 120 s; it last got {last}{printed}"
        ))
    }

    /// One try of a `ready.command`: `Ok(Err(what))` when it did not pass, `Err` when the
    /// agent could not run it.
    async fn ready_command_once(
        &self,
        m: &Managed,
        sb: &Sandbox,
        line: &str,
        n: u32,
    ) -> Result<Result<(), String>, String> {
        let spec = ExecSpec {
            exec_id: format!("exe-ready-{n}"),
            program: Program::Shell(line.to_string()),
            env: Self::base_env(m),
            cwd: m.spec.cwd.clone(),
            user: None,
            timeout_ms: Some(10_000),
            stdin_open: false,
            stdin_null: false,
            attach: true,
            tty: false,
            wait_for_reader: false,
            rows: 24,
            cols: 80,
        };
        let mut conn = AgentConn::connect(&sb.socket, Duration::from_secs(5))
            .await
            .map_err(|e| e.to_string())?;
        conn.send(&HostMsg::Exec(spec))
            .await
            .map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        let code = loop {
            match conn.recv().await.map_err(|e| e.to_string())? {
                Frame::Data { bytes, .. } => out.extend_from_slice(&bytes),
                Frame::Msg(AgentMsg::Exited { exit, .. }) => break exit.exit_code,
                Frame::Msg(AgentMsg::ExecFailed { message, .. }) => return Err(message),
                Frame::Msg(_) => {}
            }
        };
        if code == 0 {
            return Ok(Ok(()));
        }
        let text = String::from_utf8_lossy(&out);
        Ok(Err(format!(
            "exit code {code}: {}",
            text.trim().chars().take(500).collect::<String>()
        )))
    }

    fn set_failed(&self, m: &Managed, code: &str, why: &str) {
        {
            let mut row = m.row.locked();
            row.status = "failed".into();
            row.failure_code = Some(code.into());
            row.failure = Some(why.into());
            row.pid = None;
            let _ = self.store.update_sandbox(&row);
        }
    }

    /// `POST /v1/sandboxes`.
    pub async fn create_sandbox(
        self: &Arc<Self>,
        c: SandboxCreate,
    ) -> Result<SandboxObject, ApiError> {
        if self.is_stopping() {
            return Err(crate::node::stopping_error());
        }
        let req = c.spec;
        let Machine {
            image,
            creds: _,
            limits,
            expires_in_ms,
        } = self.check_machine(&req, true)?;
        let spec = self.stored_spec(&req, &limits)?;
        let settings = spec.template_settings();
        let key = spec.template.clone().unwrap_or_else(|| BASE.into());
        // The first sandbox of a template that pulls, or waits for a check, is answered
        // `starting`; so is one that waits for another's build.
        let checks = spec.ready_command.is_some()
            || spec.ready_probe.is_some()
            || match &image {
                Source::Local(i) if !spec.start_given() => i.meta.labels.contains_key("sbx.ready"),
                _ => false,
            };
        let pulls = matches!(image, Source::Remote(_));
        // A warm sandbox is a machine of the base image in the default shape, whatever it is
        // then to start.
        let warm_ok = image.is_base()
            && spec.image == "base"
            && spec.hostname.is_none()
            && !spec.tmp_memory
            && spec.memory_bytes == self.cfg.default_memory_bytes
            && spec.vcpus == self.cfg.default_vcpus;
        let warm = if warm_ok { self.pop_warm() } else { None };
        let id = match &warm {
            Some(sb) => sb.id.clone(),
            None => sbx_api::new_id("sbx"),
        };
        let row = SandboxRow {
            id: id.clone(),
            name: req.name.clone(),
            status: "starting".into(),
            spec: serde_json::to_string(&spec)
                .map_err(crate::http::internal("a sandbox's spec as JSON"))?,
            pid: None,
            start_time: None,
            created_at_ns: crate::image::now_ns() as i64,
            started_at_ns: None,
            failure_code: None,
            failure: None,
            restarts: 0,
        };
        let give_back = |node: &Arc<Self>, warm: Option<Arc<Sandbox>>| node.give_back_warm(warm);
        if let Err(e) = self.reserve_name(req.name.as_deref(), &id) {
            give_back(self, warm);
            return Err(e);
        }
        let plan = match self.templates.plan(&self.store, &key, &settings, &id) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(error = %e, "templates");
                self.release_name(req.name.as_deref());
                give_back(self, warm);
                return Err(ApiError::internal());
            }
        };
        if let Err(e) = self.store.insert_sandbox(&row) {
            self.release_name(req.name.as_deref());
            give_back(self, warm);
            return Err(store_err(e));
        }
        let m = Arc::new(Managed::new(row, spec));
        self.managed.locked().insert(id.clone(), m.clone());
        if let Some(ms) = expires_in_ms {
            self.expire_at(&m, ms);
        }
        let answer_starting = match &plan {
            Plan::Base | Plan::Ready => false,
            Plan::Build(_) => pulls || checks,
            Plan::Wait(_) => true,
        };
        if answer_starting {
            // Answered `starting`: the sandbox becomes running or failed when its template's
            // build (its image's pull, its check) says.
            let op = m.op.clone().lock_owned().await;
            let (node, m2) = (self.clone(), m.clone());
            tokio::spawn(async move {
                let _op = op;
                let _ = node.boot_planned(&m2, warm, plan).await;
            });
            return Ok(self.sandbox_object(&m));
        }
        let _op = m.op.lock().await;
        // A failed boot leaves the sandbox `failed`, to be seen and deleted.
        let _ = self.boot_planned(&m, warm, plan).await;
        Ok(self.sandbox_object(&m))
    }

    /// `POST /internal/templates`: builds the template of a create's settings ahead, keeping
    /// no sandbox. A build sandbox is made (metadata `sbx.template_build`, so a listing says
    /// what it is) and deleted once the template is built or failed. Answers whether the
    /// template is done (built already, or failed at once) and its object.
    pub async fn build_template(
        self: &Arc<Self>,
        c: SandboxCreate,
    ) -> Result<(bool, serde_json::Value), ApiError> {
        let req = &c.spec;
        let not_for_a_template = [
            ("name", req.name.is_some()),
            ("metadata", !req.metadata.is_empty()),
            ("expires_at", req.expires_at.is_some()),
            ("template", req.template.is_some()),
        ];
        if let Some((param, _)) = not_for_a_template.iter().find(|(_, given)| *given) {
            return Err(ApiError::invalid_field(
                *param,
                format!("a template is built from an image and its settings, without {param}"),
            ));
        }
        let Machine { limits, .. } = self.check_machine(req, true)?;
        let key = self
            .stored_spec(req, &limits)?
            .template
            .unwrap_or_else(|| BASE.into());
        let row = |node: &Node| {
            templates::get(&node.store, &key).map_err(|e| {
                tracing::error!(error = %e, "templates");
                ApiError::internal()
            })
        };
        if key == BASE {
            return Ok((true, self.base_template_object()));
        }
        if let Some(t) = row(self)?.filter(|t| t.status == "ready") {
            return Ok((true, templates::object_of(&t)));
        }
        let mut c = c;
        c.spec
            .metadata
            .insert("sbx.template_build".into(), key.clone());
        let sb = self.create_sandbox(c).await?;
        let node = self.clone();
        tokio::spawn(async move {
            // The build holds the sandbox's op lock until it is running or failed.
            if let Ok(m) = node.managed(&sb.id) {
                drop(m.op.lock().await);
            }
            if let Err(e) = node.delete_sandbox(&sb.id).await {
                tracing::warn!(sandbox = %sb.id, error = %e.message, "the template build's sandbox");
            }
        });
        match row(self)? {
            Some(t) => Ok((t.status != "building", templates::object_of(&t))),
            None => Err(ApiError::internal()),
        }
    }

    /// What the node keeps of a create (after `check_machine`): its settings, those of the
    /// template it names, and its template's key.
    fn stored_spec(
        &self,
        req: &sbx_api::RunRequest,
        limits: &Limits,
    ) -> Result<StoredSpec, ApiError> {
        let (stop_signal, stop_grace_ms) = match &req.stop {
            Some(s) => (s.signal_number(), s.grace_ms_or_default()),
            None => (None, sbx_api::run::DEFAULT_GRACE_MS),
        };
        let mut spec = StoredSpec {
            image: req.image.clone().unwrap_or_else(|| "base".into()),
            vcpus: limits.vcpus,
            memory_bytes: limits.memory_bytes,
            hostname: req.hostname.clone(),
            tmp_memory: req.tmp == sbx_api::Tmp::Memory,
            env: req.env.clone(),
            secret_env: req.secret_env.0.clone(),
            metadata: req.metadata.clone(),
            cwd: req.cwd.clone(),
            user: req.user.clone(),
            start_command: req.start_command.clone(),
            ready_command: match &req.ready {
                Some(sbx_api::Ready::Command(c)) => Some(c.clone()),
                _ => None,
            },
            ready_probe: match &req.ready {
                Some(sbx_api::Ready::Tcp { port }) => Some(Probe::Tcp { port: *port }),
                Some(sbx_api::Ready::Http { port, path }) => Some(Probe::Http {
                    port: *port,
                    path: path.clone(),
                }),
                _ => None,
            },
            start: req.start,
            stop_signal,
            stop_grace_ms,
            expires_at: req.expires_at.clone(),
            image_pull_secret: req.image_pull_secret.clone(),
            template: None,
        };
        if let Some(key) = req.template.as_deref().filter(|k| *k != BASE) {
            self.apply_template(&mut spec, key, &req.limits)?;
        }
        let key = match req.template.as_deref() {
            Some(k) => k.to_string(),
            None => spec
                .template_settings()
                .key(self.cfg.default_vcpus, self.cfg.default_memory_bytes),
        };
        spec.template = Some(key);
        Ok(spec)
    }

    /// A create that names a template (`template: "img-…"`): its image and the settings that
    /// made it; the create's own env is added to the template's. Its shape is the template's:
    /// another is 400 invalid_field (param limits).
    fn apply_template(
        &self,
        spec: &mut StoredSpec,
        key: &str,
        limits: &sbx_api::Limits,
    ) -> Result<(), ApiError> {
        let row = templates::get(&self.store, key)
            .map_err(|e| {
                tracing::error!(error = %e, "templates");
                ApiError::internal()
            })?
            .ok_or_else(|| {
                ApiError::new(
                    ErrorCode::TemplateNotFound,
                    format!("no template {key} on this node"),
                )
                .with_param("template")
            })?;
        let t = row.settings;
        let other_shape = limits.vcpus.is_some_and(|v| v != t.vcpus)
            || limits.memory_bytes.is_some_and(|b| b != t.memory_bytes);
        if other_shape {
            return Err(ApiError::invalid_field(
                "limits",
                format!(
                    "the template {key} has {} vcpus and {} bytes of memory",
                    t.vcpus, t.memory_bytes
                ),
            ));
        }
        let mut env = t.env;
        env.extend(std::mem::take(&mut spec.env));
        spec.env = env;
        spec.image = t.image;
        spec.image_pull_secret = t.image_pull_secret;
        spec.start = t.start;
        spec.start_command = t.start_command;
        spec.ready_command = t.ready_command;
        spec.ready_probe = t.ready_probe;
        spec.vcpus = t.vcpus;
        spec.memory_bytes = t.memory_bytes;
        Ok(())
    }

    fn expire_at(self: &Arc<Self>, m: &Arc<Managed>, ms: u64) {
        let node = self.clone();
        let id = m.id.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            tracing::info!(sandbox = %id, "expired: deleting");
            let _ = node.delete_sandbox(&id).await;
        });
    }

    /// `GET /v1/sandboxes`.
    pub fn list_sandboxes(&self, q: &ListQuery) -> (Vec<SandboxObject>, Option<String>) {
        let mut all: Vec<Arc<Managed>> = self.managed.locked().values().cloned().collect();
        all.sort_by_key(|m| (m.row.locked().created_at_ns, m.id.clone()));
        let key = |m: &Managed| format!("{:020}.{}", m.row.locked().created_at_ns, m.id);
        let mut out: Vec<(String, SandboxObject)> = Vec::new();
        let mut more = false;
        for m in all {
            if let Some(c) = &q.cursor {
                if key(&m) <= *c {
                    continue;
                }
            }
            if q.status.is_some_and(|s| s != m.status()) {
                continue;
            }
            if !q
                .metadata
                .iter()
                .all(|(k, v)| m.spec.metadata.get(k) == Some(v))
            {
                continue;
            }
            if out.len() == q.limit {
                more = true;
                break;
            }
            out.push((key(&m), self.sandbox_object(&m)));
        }
        let next = if more {
            out.last().map(|(k, _)| k.clone())
        } else {
            None
        };
        (out.into_iter().map(|(_, o)| o).collect(), next)
    }

    /// Stops the start command (its stop signal, then grace), then ends the machine.
    async fn end_machine(self: &Arc<Self>, m: &Arc<Managed>) {
        // The machine stays visible until its commands' final objects are recorded: a command
        // asked about meanwhile is answered by the agent, then by its record.
        let Some(sb) = m.machine() else {
            return;
        };
        let resolved = m.resolved();
        let stop_first = resolved.start.is_some() && sb.is_alive();
        if stop_first
            && crate::agent::signal(&sb.socket, START_EXEC, resolved.stop_signal)
                .await
                .is_ok()
        {
            let wait = HostMsg::Wait {
                exec_id: START_EXEC.into(),
            };
            let grace = Duration::from_millis(u64::from(m.spec.stop_grace_ms));
            let _ = tokio::time::timeout(grace, one_shot(&sb.socket, &wait)).await;
        }
        // What ran in this boot is final now: record it before the agent goes.
        self.record_finals(m, &sb).await;
        m.machine.locked().take();
        let driver = self.driver.clone();
        let _ = tokio::task::spawn_blocking(move || driver.destroy(&sb)).await;
    }

    async fn record_finals(&self, m: &Arc<Managed>, sb: &Sandbox) {
        let states = match one_shot(&sb.socket, &HostMsg::List).await {
            Ok(AgentMsg::Execs { execs }) => execs,
            _ => Vec::new(),
        };
        let rows = self.store.execs(&m.id).unwrap_or_default();
        for row in rows
            .iter()
            .filter(|r| r.final_json.is_none() && r.boot == m.boot())
        {
            let state = states.iter().find(|s| s.exec_id == row.exec_id);
            let obj = final_object(m, row, state);
            if let Ok(json) = serde_json::to_string(&obj) {
                let _ = self.store.set_exec_final(&m.id, &row.exec_id, &json);
            }
        }
        m.running.locked().clear();
    }

    /// `DELETE /v1/sandboxes/{id}`.
    pub async fn delete_sandbox(self: &Arc<Self>, id: &str) -> Result<SandboxObject, ApiError> {
        let m = self.managed(id)?;
        // A sandbox still starting stops waiting for its pull, template or check.
        if m.status() == SandboxStatus::Starting {
            m.cancel.cancel();
        }
        let _op = m.op.lock().await;
        if !m.status().can_delete() {
            return Err(not_found(id));
        }
        {
            let mut row = m.row.locked();
            row.status = "stopping".into();
            let _ = self.store.update_sandbox(&row);
        }
        self.end_machine(&m).await;
        let dir = self.sandboxes_dir().join(&m.id);
        let _ = tokio::task::spawn_blocking(move || sbx_runtime::driver::remove_dir(&dir)).await;
        self.store.delete_sandbox(&m.id).map_err(store_err)?;
        self.managed.locked().remove(&m.id);
        self.release_name(m.name().as_deref());
        m.row.locked().status = "deleted".into();
        Ok(self.sandbox_object(&m))
    }

    /// `POST /v1/sandboxes/{id}/restart`: the machine is ended (start command stopped as on a
    /// delete) and booted again over the same disk.
    pub async fn restart_sandbox(self: &Arc<Self>, id: &str) -> Result<SandboxObject, ApiError> {
        let m = self.managed(id)?;
        let _op = m.op.lock().await;
        let status = m.status();
        if !status.can_restart() {
            return Err(wrong_state(status, "be restarted"));
        }
        {
            let mut row = m.row.locked();
            row.status = "stopping".into();
            let _ = self.store.update_sandbox(&row);
        }
        self.end_machine(&m).await;
        {
            let mut row = m.row.locked();
            row.restarts += 1;
            row.status = "starting".into();
            let _ = self.store.update_sandbox(&row);
        }
        let _ = self.boot(&m, None).await;
        Ok(self.sandbox_object(&m))
    }

    /// Commands running now in sandbox `id` (0 for an unknown one). For the functions
    /// interface's `sandbox::list` and its idle reaper.
    pub(crate) fn running_execs(&self, id: &str) -> usize {
        self.managed(id)
            .ok()
            .map(|m| m.running.locked().len())
            .unwrap_or(0)
    }

    pub(crate) fn running_machine(&self, m: &Managed) -> Result<Arc<Sandbox>, ApiError> {
        let status = m.status();
        if !status.can_exec() {
            return Err(wrong_state(status, "run commands"));
        }
        m.machine()
            .ok_or_else(|| wrong_state(SandboxStatus::Starting, "run commands"))
    }

    /// Starts a command in `sb` and records it. `stdin` is sent before the answer; with
    /// `close` stdin is closed after it.
    async fn start_exec(
        self: &Arc<Self>,
        m: &Arc<Managed>,
        sb: &Arc<Sandbox>,
        spec: ExecSpec,
        command: String,
        stdin: Option<&[u8]>,
        stdin_open: bool,
    ) -> Result<(ExecState, AgentConn, ExecRow), ApiError> {
        let mut spec = spec;
        let exec_id = spec.exec_id.clone();
        let attach = spec.attach;
        let tty = spec.tty;
        let mut conn = AgentConn::open(&sb.socket, Duration::from_secs(5))
            .await
            .map_err(agent_lost)?;
        // A command given no input reads /dev/null: no stdin pipe, no CloseStdin after it.
        let no_stdin = conn.takes_stdin_null() && stdin.is_none() && !stdin_open && !tty;
        spec.stdin_null = no_stdin;
        conn.send(&HostMsg::Exec(spec)).await.map_err(agent_lost)?;
        // Its input follows at once, not after the agent's answer: an attached command's start
        // is told with its first output or its end, which may need that input.
        if let Some(data) = stdin {
            conn.send_stdin(&exec_id, data).await.map_err(agent_lost)?;
        }
        if !stdin_open && !no_stdin {
            conn.send(&HostMsg::CloseStdin {
                exec_id: exec_id.clone(),
            })
            .await
            .map_err(agent_lost)?;
        }
        let answer = loop {
            if let Frame::Msg(m) = conn.recv().await.map_err(agent_lost)? {
                break m;
            }
        };
        let state = match answer {
            AgentMsg::Started {
                pid, started_at_ns, ..
            } => ExecState {
                exec_id: exec_id.clone(),
                pid,
                started_at_ns,
                exit: None,
                output: sbx_proto::OutputCounts::default(),
            },
            AgentMsg::ExecFailed { kind, message, .. } => {
                return Err(match kind {
                    ExecFailKind::NoSuchUser => {
                        ApiError::new(ErrorCode::NoSuchUser, message).with_param("user")
                    }
                    ExecFailKind::DuplicateId => ApiError::new(
                        ErrorCode::IdempotencyKeyReused,
                        format!("a command {exec_id} exists"),
                    ),
                    _ => ApiError::internal(),
                })
            }
            other => {
                tracing::error!(?other, "unexpected agent answer");
                return Err(ApiError::internal());
            }
        };
        let row = ExecRow {
            sandbox_id: m.id.clone(),
            exec_id: exec_id.clone(),
            command,
            tty,
            encoding: "utf8".into(),
            created_at_ns: state.started_at_ns,
            boot: m.boot(),
            final_json: None,
        };
        // An attached command's row is the caller's to write (see `exec`): a short one is
        // written once, with its end.
        if !attach {
            self.store
                .insert_exec(&row, !stdin_open)
                .map_err(store_err)?;
        }
        m.running.locked().insert(exec_id.clone());
        if !attach {
            // An attached caller reads the end on its own connection (and watches if it
            // stops waiting first).
            self.watch_exec(m.clone(), sb.clone(), row.clone());
        }
        Ok((state, conn, row))
    }

    /// Watches the agent of `m`'s machine `sb` through a pidfd: when it ends while `sb` is
    /// still the machine (not ended by a delete or a restart), the sandbox is failed at once
    /// with `agent_lost`, as a node that starts and finds an agent gone marks it (`recover`).
    fn watch_agent(self: &Arc<Self>, m: &Arc<Managed>, sb: &Arc<Sandbox>) {
        // A second descriptor of the node's pidfd of the agent: readable once it has ended.
        let fd = match sb.netns_handle().and_then(sbx_runtime::process::async_fd) {
            Ok(fd) => fd,
            Err(e) => {
                tracing::warn!(sandbox = %m.id, error = %e, "cannot watch the sandbox's agent");
                return;
            }
        };
        let (node, m, sb) = (self.clone(), m.clone(), sb.clone());
        tokio::spawn(async move {
            if let Err(e) = fd.readable().await {
                tracing::warn!(sandbox = %m.id, error = %e, "cannot watch the sandbox's agent");
                return;
            }
            drop(fd);
            node.agent_ended(&m, &sb).await;
        });
    }

    /// The agent of `sb` has ended. Unless the machine was ended on purpose meanwhile (a delete,
    /// a restart: they hold the sandbox's op lock while they do), the sandbox is `failed`
    /// (`agent_lost`), its unfinished commands recorded as killed, its cgroups and directory
    /// removed.
    async fn agent_ended(self: &Arc<Self>, m: &Arc<Managed>, sb: &Arc<Sandbox>) {
        let _op = m.op.lock().await;
        let current = m.machine().is_some_and(|now| Arc::ptr_eq(&now, sb));
        if !current {
            return;
        }
        let why = if sb.oom_killed() {
            "the sandbox's agent ended: killed by the kernel's OOM killer (the sandbox's memory limit)"
        } else {
            "the sandbox's agent ended (killed)"
        };
        tracing::warn!(sandbox = %m.id, why, "agent lost");
        self.set_failed(m, "agent_lost", why);
        self.record_finals(m, sb).await;
        m.machine.locked().take();
        let driver = self.driver.clone();
        let (sb, dir) = (sb.clone(), self.sandboxes_dir().join(&m.id));
        let _ = tokio::task::spawn_blocking(move || {
            if let Err(e) = driver.destroy(&sb) {
                tracing::warn!(sandbox = %sb.id, error = %e, "removing a lost agent's sandbox");
            }
            sbx_runtime::driver::remove_dir(&dir)
        })
        .await;
    }

    /// Waits for a command to end, then records its final object and frees its slot.
    fn watch_exec(self: &Arc<Self>, m: Arc<Managed>, sb: Arc<Sandbox>, row: ExecRow) {
        let node = self.clone();
        tokio::spawn(async move {
            let wait = HostMsg::Wait {
                exec_id: row.exec_id.clone(),
            };
            if let Ok(AgentMsg::State(state)) = one_shot(&sb.socket, &wait).await {
                let obj = final_object(&m, &row, Some(&state));
                if let Ok(json) = serde_json::to_string(&obj) {
                    let _ = node.store.set_exec_final(&m.id, &row.exec_id, &json);
                }
            }
            m.running.locked().remove(&row.exec_id);
        });
    }

    /// `POST /v1/sandboxes/{id}/exec`.
    pub async fn exec(
        self: &Arc<Self>,
        id: &str,
        req: ExecRequest,
        exec_id: Option<String>,
    ) -> Result<ExecObject, ApiError> {
        let m = self.managed(id)?;
        let sb = self.running_machine(&m)?;
        let exec_id = exec_id.unwrap_or_else(|| sbx_api::new_id("exe"));
        // The slot is taken here, under the lock: calls at the same time cannot all pass the
        // check before any of them is counted. Given back if the command does not start.
        let mut reserved = None;
        for pass in 0..2 {
            {
                let mut running = m.running.locked();
                if running.len() < self.cfg.max_execs_per_sandbox {
                    reserved = Some(running.insert(exec_id.clone()));
                    break;
                }
                if pass == 1 {
                    return Err(ApiError::new(
                        ErrorCode::TooManyCommands,
                        format!(
                            "the sandbox runs {} commands, as many as it may at once",
                            running.len()
                        ),
                    ));
                }
            }
            // A command that ended may not have given its slot back yet (its watcher records
            // it first), though its end was already answered: the agent knows.
            if let Ok(AgentMsg::Execs { execs }) = one_shot(&sb.socket, &HostMsg::List).await {
                {
                    let mut running = m.running.locked();
                    for s in execs.iter().filter(|s| s.exit.is_some()) {
                        running.remove(&s.exec_id);
                    }
                }
            }
        }
        let reserved = reserved.unwrap_or(false);
        let mut env = Self::base_env(&m);
        env.extend(req.env.clone());
        let spec = ExecSpec {
            exec_id: exec_id.clone(),
            program: program(&req.command),
            env,
            cwd: req.cwd.clone().or_else(|| m.spec.cwd.clone()),
            user: req.user.clone().or_else(|| m.spec.user.clone()),
            timeout_ms: req.timeout_seconds.map(sbx_api::seconds_to_ms),
            stdin_open: req.stdin_open || req.tty,
            stdin_null: false,
            // A call that waits reads the output on the connection that starts the command.
            attach: req.wait_seconds > 0.0 && !req.tty,
            tty: req.tty,
            wait_for_reader: req.wait_for_reader,
            rows: req.rows,
            cols: req.cols,
        };
        let started = self
            .start_exec(
                &m,
                &sb,
                spec,
                req.command.display(),
                req.stdin.as_deref(),
                req.stdin_open || req.tty,
            )
            .await;
        let (state, mut conn, row) = match started {
            Ok(s) => s,
            Err(e) => {
                if reserved {
                    m.running.locked().remove(&exec_id);
                }
                return Err(e);
            }
        };
        let attached = req.wait_seconds > 0.0 && !req.tty;
        if !attached {
            conn.release();
            return self.exec_get(id, &exec_id, 0.0, req.encoding).await;
        }
        let meta = meta_of(&m, &row, req.encoding);
        let (mut out, mut err, mut gap) = (Tail::new(), Tail::new(), false);
        let (waited, row_written, unrecorded) = {
            let collect = async {
                loop {
                    match conn.recv().await {
                        Ok(Frame::Data { stream, bytes, .. }) => match stream {
                            Stream::Stderr => err.push(&bytes),
                            _ => out.push(&bytes),
                        },
                        Ok(Frame::Msg(AgentMsg::Gap { .. })) => gap = true,
                        Ok(Frame::Msg(AgentMsg::Exited { exit, output, .. })) => {
                            return Some((exit, output))
                        }
                        Ok(Frame::Msg(_)) => {}
                        Err(_) => return None,
                    }
                }
            };
            tokio::pin!(collect);
            // The row is written once when the command ends within ROW_AFTER (with its end), else
            // then, while it runs on (and its end later).
            let wait = Duration::from_secs_f64(req.wait_seconds);
            let mut waited = tokio::time::timeout(wait.min(ROW_AFTER), &mut collect).await;
            let (mut row_written, mut unrecorded) = (false, None);
            if waited.is_err() {
                match self.store.insert_exec(&row, !stdin_open_of(&req)) {
                    Ok(()) => {
                        row_written = true;
                        waited = tokio::time::timeout(wait.saturating_sub(ROW_AFTER), &mut collect)
                            .await;
                    }
                    Err(e) => unrecorded = Some(e),
                }
            }
            (waited, row_written, unrecorded)
        };
        if let Some(e) = unrecorded {
            // Not recorded: the caller is told; the command is still watched, so that its slot
            // is given back when it ends.
            drop(conn);
            self.watch_exec(m.clone(), sb.clone(), row);
            return Err(store_err(e));
        }
        if let Ok(Some((exit, output))) = waited {
            let started = Started {
                pid: state.pid,
                started_at_ns: state.started_at_ns,
            };
            // The end is known here: record it and free the slot, as the watcher would.
            let ended = ExecState {
                exit: Some(exit.clone()),
                output,
                ..state.clone()
            };
            let json = serde_json::to_string(&final_object(&m, &row, Some(&ended)));
            // It ended: its slot is free whether or not its row can be written.
            m.running.locked().remove(&row.exec_id);
            let json = json.map_err(crate::http::internal("a command's final object as JSON"))?;
            if row_written {
                // The row is committed; its end is written after the answer: a node killed
                // before it lands finds the command running at start and asks the agent.
                let node = self.clone();
                let (sandbox_id, exec_id) = (m.id.clone(), row.exec_id.clone());
                tokio::spawn(async move {
                    let _ = node.store.set_exec_final(&sandbox_id, &exec_id, &json);
                });
            } else {
                // One write, before the answer: whoever is told of the command finds it.
                let row = ExecRow {
                    final_json: Some(json),
                    ..row.clone()
                };
                self.store
                    .insert_exec(&row, !stdin_open_of(&req))
                    .map_err(store_err)?;
            }
            // Every frame of the command was read: the connection serves the next call.
            conn.release();
            return Ok(exec_object(
                &meta,
                &started,
                Some(&exit),
                output,
                &mut out,
                &mut err,
                gap,
            ));
        }
        // Still running when the wait ended, or its agent was lost: a watcher takes it from
        // here (its output may still be streaming on this connection), and a row not written
        // yet is written as the command stands.
        drop(conn);
        let written = if row_written {
            Ok(())
        } else {
            self.store.insert_exec(&row, !stdin_open_of(&req))
        };
        self.watch_exec(m.clone(), sb.clone(), row);
        written.map_err(store_err)?;
        self.exec_get(id, &exec_id, 0.0, req.encoding).await
    }

    /// The final object of a command whose machine is gone. It was recorded before the machine
    /// went, maybe after the caller read the row (a delete or a restart ending it meanwhile):
    /// read again.
    fn recorded_final(&self, m: &Managed, exec_id: &str) -> Result<ExecObject, ApiError> {
        let row = self.exec_row(m, exec_id)?;
        final_from_row(&row).ok_or_else(|| {
            ApiError::new(
                ErrorCode::CommandLost,
                format!("the machine of {exec_id} ended and its end was not recorded"),
            )
        })
    }

    pub(crate) fn exec_row(&self, m: &Managed, exec_id: &str) -> Result<ExecRow, ApiError> {
        self.store
            .exec(&m.id, exec_id)
            .map_err(store_err)?
            .ok_or_else(|| ApiError::new(ErrorCode::ExecNotFound, format!("no command {exec_id}")))
    }

    /// `GET …/exec/{exec_id}?wait_seconds=`: the exec object, with the last 1 MiB of each
    /// stream while the agent still has them.
    pub async fn exec_get(
        &self,
        id: &str,
        exec_id: &str,
        wait_seconds: f64,
        encoding: Encoding,
    ) -> Result<ExecObject, ApiError> {
        let m = self.managed(id)?;
        let row = self.exec_row(&m, exec_id)?;
        let sb = m.machine().filter(|_| row.boot == m.boot());
        let Some(sb) = sb else {
            return self.recorded_final(&m, exec_id);
        };
        if wait_seconds > 0.0 {
            let wait = HostMsg::Wait {
                exec_id: exec_id.into(),
            };
            let _ = tokio::time::timeout(
                Duration::from_secs_f64(wait_seconds),
                one_shot(&sb.socket, &wait),
            )
            .await;
        }
        let (state, out, err, gap) = match read_all(&sb, exec_id).await {
            Ok(x) => x,
            // The machine ended meanwhile (a delete, a restart): what was recorded of it.
            Err(e) => {
                return self
                    .exec_row(&m, exec_id)
                    .ok()
                    .and_then(|r| final_from_row(&r))
                    .ok_or(e)
            }
        };
        let meta = meta_of(&m, &row, encoding);
        let (mut o, mut e) = (out, err);
        Ok(exec_object(
            &meta,
            &Started {
                pid: state.pid,
                started_at_ns: state.started_at_ns,
            },
            state.exit.as_ref(),
            state.output,
            &mut o,
            &mut e,
            gap,
        ))
    }

    /// `GET …/exec`: the commands of a sandbox, oldest first (without their output).
    pub async fn exec_list(&self, id: &str) -> Result<Vec<ExecObject>, ApiError> {
        let m = self.managed(id)?;
        let rows = self.store.execs(&m.id).map_err(store_err)?;
        let states = match m.machine() {
            Some(sb) => match one_shot(&sb.socket, &HostMsg::List).await {
                Ok(AgentMsg::Execs { execs }) => execs,
                _ => Vec::new(),
            },
            None => Vec::new(),
        };
        let mut out = Vec::new();
        for row in rows {
            if let Some(obj) = final_from_row(&row) {
                out.push(obj);
                continue;
            }
            let state = states.iter().find(|s| s.exec_id == row.exec_id);
            out.push(current_object(&m, &row, state));
        }
        Ok(out)
    }

    /// `POST …/exec/{exec_id}/stdin`: appends `data` (in order with earlier calls), then
    /// closes stdin when `close`.
    pub async fn exec_stdin(
        &self,
        id: &str,
        exec_id: &str,
        data: &[u8],
        close: bool,
    ) -> Result<(), ApiError> {
        let m = self.managed(id)?;
        let row = self.exec_row(&m, exec_id)?;
        let sb = self.running_machine(&m)?;
        if row.final_json.is_some() || row.boot != m.boot() {
            return Err(ApiError::new(
                ErrorCode::StdinClosed,
                "the command has ended",
            ));
        }
        // Input after a close would be dropped by the agent: refused instead.
        if self
            .store
            .exec_stdin_closed(&m.id, exec_id)
            .map_err(store_err)?
        {
            return Err(ApiError::new(
                ErrorCode::StdinClosed,
                "the command's stdin is closed",
            ));
        }
        let mut conn = AgentConn::connect(&sb.socket, Duration::from_secs(5))
            .await
            .map_err(agent_lost)?;
        // Its end may not be recorded yet: the agent knows.
        if let AgentMsg::State(s) = conn
            .request(&HostMsg::Status {
                exec_id: exec_id.into(),
            })
            .await
            .map_err(agent_lost)?
        {
            if s.exit.is_some() {
                return Err(ApiError::new(
                    ErrorCode::StdinClosed,
                    "the command has ended",
                ));
            }
        }
        if !data.is_empty() {
            conn.send_stdin(exec_id, data).await.map_err(agent_lost)?;
        }
        if close {
            conn.send(&HostMsg::CloseStdin {
                exec_id: exec_id.into(),
            })
            .await
            .map_err(agent_lost)?;
        }
        conn.request(&HostMsg::Sync { token: 1 })
            .await
            .map_err(agent_lost)?;
        if close {
            self.store
                .close_exec_stdin(&m.id, exec_id)
                .map_err(store_err)?;
        }
        Ok(())
    }

    /// `POST …/exec/{exec_id}/signal`: 409 exec_ended when the command has ended (recorded, of
    /// an earlier boot, or ended by the time the agent is asked).
    pub async fn exec_signal(&self, id: &str, exec_id: &str, signal: i32) -> Result<(), ApiError> {
        let m = self.managed(id)?;
        let row = self.exec_row(&m, exec_id)?;
        let ended = || {
            ApiError::new(
                ErrorCode::ExecEnded,
                format!("the command {exec_id} has ended: there is nothing to signal"),
            )
        };
        if row.final_json.is_some() || row.boot != m.boot() {
            return Err(ended());
        }
        let sb = self.running_machine(&m)?;
        let (mut conn, state) = status_conn(&sb, exec_id).await?;
        if state.exit.is_some() {
            conn.release();
            return Err(ended());
        }
        conn.send(&HostMsg::Signal {
            exec_id: exec_id.into(),
            signal,
        })
        .await
        .map_err(agent_lost)?;
        // Answered once the agent has sent it.
        tokio::time::timeout(
            Duration::from_secs(10),
            conn.request(&HostMsg::Sync { token: 0 }),
        )
        .await
        .map_err(|_| agent_lost(crate::agent::AgentError::Timeout))?
        .map_err(agent_lost)?;
        conn.release();
        Ok(())
    }

    /// `GET …/exec/{exec_id}/output` as events: from `from`, live, to the end. The sender's
    /// receiver going away ends the reading.
    pub async fn exec_output_events(
        &self,
        id: &str,
        exec_id: &str,
        from: u64,
        encoding: Encoding,
    ) -> Result<(ExecMeta, Started, mpsc::Receiver<RunEvent>), ApiError> {
        let m = self.managed(id)?;
        let row = self.exec_row(&m, exec_id)?;
        let meta = meta_of(&m, &row, encoding);
        let (tx, rx) = mpsc::channel(64);
        let sb = m.machine().filter(|_| row.boot == m.boot());
        let live = live_exec(sb, &row).await?;
        let Some((mut conn, state)) = live else {
            // The machine it ran in is gone: its output with it.
            let obj = self.recorded_final(&m, exec_id)?;
            let exit = exit_of(&obj);
            let output = sbx_proto::OutputCounts {
                stdout_bytes: obj.output.stdout_bytes,
                stderr_bytes: obj.output.stderr_bytes,
                start: obj.output.end,
                end: obj.output.end,
            };
            let started = Started {
                pid: obj.pid,
                started_at_ns: row.created_at_ns,
            };
            tokio::spawn(async move {
                if from < output.end {
                    let _ = tx
                        .send(RunEvent::Gap {
                            from,
                            to: output.end,
                        })
                        .await;
                }
                let _ = tx.send(RunEvent::Exited { exit, output }).await;
            });
            return Ok((meta, started, rx));
        };
        conn.send(&HostMsg::Attach {
            exec_id: exec_id.into(),
            from,
        })
        .await
        .map_err(agent_lost)?;
        tokio::spawn(async move {
            loop {
                let ev = tokio::select! {
                    f = conn.recv() => match f {
                        Ok(Frame::Data { stream, pos, bytes, .. }) => RunEvent::Output { stream, pos, data: bytes },
                        Ok(Frame::Msg(AgentMsg::Gap { from, to, .. })) => RunEvent::Gap { from, to },
                        Ok(Frame::Msg(AgentMsg::Exited { exit, output, .. })) => {
                            let _ = tx.send(RunEvent::Exited { exit, output }).await;
                            return;
                        }
                        Ok(Frame::Msg(_)) => continue,
                        Err(e) => {
                            let _ = tx.send(RunEvent::Failed(agent_lost(e))).await;
                            return;
                        }
                    },
                    _ = tx.closed() => return,
                };
                if tx.send(ev).await.is_err() {
                    return;
                }
            }
        });
        Ok((
            meta,
            Started {
                pid: state.pid,
                started_at_ns: state.started_at_ns,
            },
            rx,
        ))
    }

    /// Output between positions, as it is now: `(state, pieces, gap)`.
    pub async fn exec_output_range(
        &self,
        id: &str,
        exec_id: &str,
        from: u64,
        to: Option<u64>,
    ) -> Result<(ExecState, Vec<(Stream, u64, Vec<u8>)>, Option<(u64, u64)>), ApiError> {
        let m = self.managed(id)?;
        let row = self.exec_row(&m, exec_id)?;
        let sb = m.machine().filter(|_| row.boot == m.boot());
        let live = live_exec(sb, &row).await?;
        let Some((mut conn, state)) = live else {
            let obj = self.recorded_final(&m, exec_id)?;
            let end = obj.output.end;
            let state = ExecState {
                exec_id: exec_id.into(),
                pid: obj.pid,
                started_at_ns: row.created_at_ns,
                exit: Some(exit_of(&obj)),
                output: sbx_proto::OutputCounts {
                    stdout_bytes: obj.output.stdout_bytes,
                    stderr_bytes: obj.output.stderr_bytes,
                    start: end,
                    end,
                },
            };
            let gap = (from < end).then_some((from, end));
            return Ok((state, Vec::new(), gap));
        };
        let end = to.unwrap_or(u64::MAX).min(state.output.end);
        let mut pieces = Vec::new();
        let gap = read_range(&mut conn, exec_id, from, end, |stream, pos, data| {
            pieces.push((stream, pos, data.to_vec()))
        })
        .await?;
        Ok((state, pieces, gap))
    }

    /// At start: adopts the sandboxes whose agents still run, marks the others failed (and
    /// removes what is left of them), and ends whatever else is in the node's cgroups.
    pub fn recover(self: &Arc<Self>) -> (usize, usize) {
        let rows = self.store.sandboxes().unwrap_or_default();
        let (mut adopted, mut lost) = (0, 0);
        for row in rows {
            let spec: StoredSpec = match serde_json::from_str(&row.spec) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(sandbox = %row.id, error = %e, "unreadable spec");
                    continue;
                }
            };
            let m = Arc::new(Managed::new(row.clone(), spec));
            let dir = self.sandboxes_dir().join(&row.id);
            let alive = match (row.status.as_str(), row.pid) {
                // A zombie (an agent that died while no node reaped it) is no agent.
                ("running" | "starting" | "stopping", Some(pid)) => self
                    .driver
                    .adopt(&row.id, &dir, pid, row.start_time)
                    .filter(|sb| sb.is_alive()),
                _ => None,
            };
            match alive {
                Some(sb) => {
                    let sb = Arc::new(sb);
                    {
                        let mut mm = m.machine.locked();
                        *mm = Some(sb.clone());
                    }
                    self.watch_agent(&m, &sb);
                    {
                        let mut r = m.resolved.locked();
                        *r = self.resolve_adopted(&m.spec);
                    }
                    {
                        let mut r = m.row.locked();
                        r.status = "running".into();
                        let _ = self.store.update_sandbox(&r);
                    }
                    for e in self.store.execs(&row.id).unwrap_or_default() {
                        if e.final_json.is_none() && e.boot == row.restarts {
                            m.running.locked().insert(e.exec_id.clone());
                            self.watch_exec(m.clone(), sb.clone(), e);
                        }
                    }
                    adopted += 1;
                }
                None => {
                    if row.status != "failed" {
                        self.set_failed(
                            &m,
                            "agent_lost",
                            "the sandbox's agent was gone when the node started",
                        );
                        lost += 1;
                    }
                    // Its commands ended with its agent: their objects say so from now on.
                    for e in self.store.execs(&row.id).unwrap_or_default() {
                        if e.final_json.is_none() {
                            let obj = final_object(&m, &e, None);
                            if let Ok(json) = serde_json::to_string(&obj) {
                                let _ = self.store.set_exec_final(&row.id, &e.exec_id, &json);
                            }
                        }
                    }
                    let _ = self.driver.remove_leftovers(&row.id);
                    let _ = sbx_runtime::driver::remove_dir(&dir);
                }
            }
            if let Some(n) = m.name() {
                let _ = self.reserve_name(Some(&n), &m.id);
            }
            self.managed.locked().insert(m.id.clone(), m.clone());
            // Its expiry was a timer of the node that stopped: armed again (at once if it
            // passed meanwhile).
            if let Some(at) = m
                .spec
                .expires_at
                .as_deref()
                .and_then(sbx_api::parse_rfc3339)
            {
                let left_ms = (at - crate::image::now_ns()).max(0) / 1_000_000;
                self.expire_at(&m, left_ms as u64 + 1);
            }
        }
        (adopted, lost)
    }

    /// Ids of the sandboxes the node keeps whose machine runs.
    pub(crate) fn kept_ids(&self) -> HashSet<String> {
        self.managed
            .locked()
            .values()
            .filter(|s| s.machine().is_some())
            .map(|s| s.id.clone())
            .collect()
    }
}

/// How long a waited command may run before its row is written (a shorter one is written once,
/// with its end).
const ROW_AFTER: Duration = Duration::from_millis(5);

/// Whether a command is started with its stdin left open for later input.
fn stdin_open_of(req: &ExecRequest) -> bool {
    req.stdin_open || req.tty
}

fn meta_of(m: &Managed, row: &ExecRow, encoding: Encoding) -> ExecMeta {
    ExecMeta {
        sandbox_id: m.id.clone(),
        exec_id: row.exec_id.clone(),
        command: row.command.clone(),
        encoding,
        tty: row.tty,
    }
}

fn final_from_row(row: &ExecRow) -> Option<ExecObject> {
    row.final_json
        .as_deref()
        .and_then(|j| serde_json::from_str(j).ok())
}

fn exit_of(obj: &ExecObject) -> sbx_proto::ExitInfo {
    sbx_proto::ExitInfo {
        status: crate::agent::exit_status(obj.status),
        exit_code: obj.exit_code.unwrap_or(128 + libc::SIGKILL),
        signal: obj.signal.as_deref().and_then(sbx_api::signal_number),
        duration_ns: (obj.duration_seconds.unwrap_or(0.0) * 1e9) as u64,
        cpu_ns: obj
            .usage
            .as_ref()
            .map(|u| (u.cpu_seconds * 1e9) as u64)
            .unwrap_or(0),
        max_rss_bytes: obj.usage.as_ref().map(|u| u.max_memory_bytes).unwrap_or(0),
    }
}

/// The object of a command without its output, as it ended: one still running (its machine is
/// going) or that the agent no longer knows ended with its machine (SIGKILL).
fn final_object(m: &Managed, row: &ExecRow, state: Option<&ExecState>) -> ExecObject {
    object_of(m, row, state, true)
}

/// The object of a command without its output, as the agent says it is now.
fn current_object(m: &Managed, row: &ExecRow, state: Option<&ExecState>) -> ExecObject {
    object_of(m, row, state, false)
}

fn object_of(m: &Managed, row: &ExecRow, state: Option<&ExecState>, ending: bool) -> ExecObject {
    let meta = meta_of(m, row, Encoding::Utf8);
    let killed = sbx_proto::ExitInfo {
        status: sbx_proto::ExitStatus::Killed,
        exit_code: 128 + libc::SIGKILL,
        signal: Some(libc::SIGKILL),
        duration_ns: 0,
        cpu_ns: 0,
        max_rss_bytes: 0,
    };
    let (started, exit, output) = match state {
        Some(s) => (
            Started {
                pid: s.pid,
                started_at_ns: s.started_at_ns,
            },
            s.exit.clone().or(ending.then_some(killed)),
            s.output,
        ),
        None => (
            Started {
                pid: 0,
                started_at_ns: row.created_at_ns,
            },
            Some(killed),
            sbx_proto::OutputCounts::default(),
        ),
    };
    exec_object(
        &meta,
        &started,
        exit.as_ref(),
        output,
        &mut Tail::new(),
        &mut Tail::new(),
        false,
    )
}

/// A connection to `sb`'s agent and the state of command `exec_id` (404 exec_not_found when the
/// agent does not know it).
async fn status_conn(sb: &Sandbox, exec_id: &str) -> Result<(AgentConn, ExecState), ApiError> {
    let mut conn = AgentConn::connect(&sb.socket, Duration::from_secs(5))
        .await
        .map_err(agent_lost)?;
    let status = HostMsg::Status {
        exec_id: exec_id.into(),
    };
    match conn.request(&status).await.map_err(agent_lost)? {
        AgentMsg::State(s) => Ok((conn, s)),
        AgentMsg::ExecFailed { .. } => Err(ApiError::new(
            ErrorCode::ExecNotFound,
            format!("no command {exec_id}"),
        )),
        _ => Err(ApiError::internal()),
    }
}

/// A connection to the agent that runs (or ran) the command of `row` and its state; `None` when
/// its machine is gone, or its agent no longer knows it and its end is recorded (an agent
/// forgets the oldest of many finished commands): then its output is gone.
async fn live_exec(
    sb: Option<Arc<Sandbox>>,
    row: &ExecRow,
) -> Result<Option<(AgentConn, ExecState)>, ApiError> {
    let Some(sb) = sb else {
        return Ok(None);
    };
    match status_conn(&sb, &row.exec_id).await {
        Ok(x) => Ok(Some(x)),
        Err(e) if e.code == ErrorCode::ExecNotFound && row.final_json.is_some() => Ok(None),
        Err(e) => Err(e),
    }
}

/// Reads a command's output from `from` to `end` (what the agent has now), handing each piece
/// to `piece`; the gap the ring no longer holds, if any.
async fn read_range(
    conn: &mut AgentConn,
    exec_id: &str,
    from: u64,
    end: u64,
    mut piece: impl FnMut(Stream, u64, &[u8]),
) -> Result<Option<(u64, u64)>, ApiError> {
    let mut gap = None;
    if from >= end {
        return Ok(gap);
    }
    conn.send(&HostMsg::Attach {
        exec_id: exec_id.into(),
        from,
    })
    .await
    .map_err(agent_lost)?;
    let mut cursor = from;
    while cursor < end {
        match conn.recv().await.map_err(agent_lost)? {
            Frame::Data {
                stream, pos, bytes, ..
            } => {
                let take = ((end - pos) as usize).min(bytes.len());
                cursor = pos + take as u64;
                piece(stream, pos, &bytes[..take]);
            }
            Frame::Msg(AgentMsg::Gap { from, to, .. }) => {
                gap = Some((from, to.min(end)));
                cursor = to;
            }
            Frame::Msg(AgentMsg::Exited { .. }) => break,
            Frame::Msg(_) => {}
        }
    }
    Ok(gap)
}

/// What the start command printed last (its last 500 bytes), for a boot's failure.
async fn start_output(sb: &Sandbox) -> String {
    let Ok((mut conn, state)) = status_conn(sb, START_EXEC).await else {
        return String::new();
    };
    let end = state.output.end;
    let from = end.saturating_sub(500).max(state.output.start);
    let mut out = Vec::new();
    let read = read_range(&mut conn, START_EXEC, from, end, |_, _, d| {
        out.extend_from_slice(d)
    })
    .await;
    let text = String::from_utf8_lossy(&out);
    match text.trim() {
        t if t.is_empty() || read.is_err() => String::new(),
        t => format!("; the start command printed last: {t}"),
    }
}

/// Everything the agent keeps of a command: its state and the tails of both streams.
async fn read_all(sb: &Sandbox, exec_id: &str) -> Result<(ExecState, Tail, Tail, bool), ApiError> {
    let (mut conn, state) = status_conn(sb, exec_id).await?;
    let (mut out, mut err) = (Tail::new(), Tail::new());
    let (start, end) = (state.output.start, state.output.end);
    let gap = read_range(
        &mut conn,
        exec_id,
        start,
        end,
        |stream, _, data| match stream {
            Stream::Stderr => err.push(data),
            _ => out.push(data),
        },
    )
    .await?;
    Ok((state, out, err, start > 0 || gap.is_some()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// sbx-api writes SIGTERM's number out (it has no libc): it is the system's.
    #[test]
    fn api_sigterm_is_libc_sigterm() {
        assert_eq!(sbx_api::exec::SIGTERM, libc::SIGTERM);
        assert_eq!(Resolved::default().stop_signal, libc::SIGTERM);
    }

    fn spec(image: &str) -> StoredSpec {
        StoredSpec {
            image: image.into(),
            vcpus: 1,
            memory_bytes: 512 << 20,
            hostname: None,
            tmp_memory: false,
            env: BTreeMap::new(),
            secret_env: BTreeMap::new(),
            metadata: BTreeMap::new(),
            cwd: None,
            user: None,
            start_command: None,
            ready_command: None,
            ready_probe: None,
            start: None,
            stop_signal: None,
            stop_grace_ms: 10_000,
            expires_at: None,
            image_pull_secret: None,
            template: None,
        }
    }

    fn meta(start: &[&str], labels: &[(&str, &str)], stop: Option<&str>) -> ImageMeta {
        ImageMeta {
            name: "127.0.0.1:5000/app:1".into(),
            created_at: String::new(),
            env: Vec::new(),
            user: None,
            workdir: None,
            uid_base: 100_000,
            source: "sha256:ab".into(),
            start: start.iter().map(|s| s.to_string()).collect(),
            stop_signal: stop.map(str::to_string),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    #[test]
    fn the_images_labels_start_it_unless_the_create_says_otherwise() {
        let m = meta(
            &["/entry", "serve"],
            &[("sbx.start", "run-me"), ("sbx.ready", "ready-me")],
            Some("SIGQUIT"),
        );
        let s = spec("127.0.0.1:5000/app:1");
        let r = resolve(&s, Some(&m)).expect("labels");
        assert_eq!(r.start, Some(Command::Shell("run-me".into())));
        assert_eq!(r.ready, Some(Check::Command("ready-me".into())));
        assert_eq!(r.stop_signal, 3, "STOPSIGNAL");

        let mut s = spec("127.0.0.1:5000/app:1");
        s.start = Some(true);
        let r = resolve(&s, Some(&m)).expect("entrypoint");
        assert_eq!(
            r.start,
            Some(Command::Argv(vec!["/entry".into(), "serve".into()])),
            "ENTRYPOINT then CMD"
        );
        assert_eq!(
            r.ready, None,
            "given, the start settings are all that count"
        );

        s.start = Some(false);
        assert_eq!(resolve(&s, Some(&m)).expect("nothing").start, None);

        let mut s = spec("127.0.0.1:5000/app:1");
        s.start_command = Some(Command::Shell("mine".into()));
        s.ready_probe = Some(Probe::Tcp { port: 80 });
        s.stop_signal = Some(2);
        let r = resolve(&s, Some(&m)).expect("own");
        assert_eq!(r.start, Some(Command::Shell("mine".into())));
        assert_eq!(r.ready, Some(Check::Probe(Probe::Tcp { port: 80 })));
        assert_eq!(r.stop_signal, 2);
    }

    #[test]
    fn start_true_needs_a_start_command_of_the_image() {
        let mut s = spec("127.0.0.1:5000/app:1");
        s.start = Some(true);
        let err = resolve(&s, Some(&meta(&[], &[], Some("15")))).unwrap_err();
        assert!(err.contains("ENTRYPOINT or CMD"), "{err}");
        // The base image has none: start: true starts nothing there.
        let mut b = spec("base");
        b.start = Some(true);
        assert_eq!(resolve(&b, None).expect("base").start, None);
        // A ready label without a start label waits for nothing; a numeric STOPSIGNAL counts.
        let m = meta(&[], &[("sbx.ready", "x")], Some("10"));
        let r = resolve(&spec("127.0.0.1:5000/app:1"), Some(&m)).expect("r");
        assert_eq!((r.start, r.ready, r.stop_signal), (None, None, 10));
    }

    #[test]
    fn pinned_references_name_the_digest() {
        assert_eq!(
            pinned_reference("127.0.0.1:5000/app:1", "sha256:ab").as_deref(),
            Some("127.0.0.1:5000/app@sha256:ab")
        );
    }
}
