//! Long-lived sandboxes: create, get, list, delete, restart; their commands: exec, wait,
//! output, stdin, signal. The table is in SQLite ([`crate::store`]); the commands' output is
//! their agent's. A sandbox's agent outlives the node: a node that starts again adopts it.

mod access;
mod boot;
mod egress;
mod exec;
mod lifecycle;
mod move_in;
mod move_out;
mod output;
pub mod sleep;
mod snapshot;

pub use access::{PreviewSettings, PreviewTarget, SandboxToken, PREVIEW_HOST_KEY, TOKEN_PREFIX};
pub(crate) use egress::egress_of;
pub(crate) use exec::Attached;
use exec::*;
pub(crate) use move_out::moved as moved_error_of;
use output::*;

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};

use sbx_api::{
    ApiError, Command, EgressRules, ErrorCode, SandboxLimits, SandboxObject, SandboxStatus,
};
use sbx_runtime::Sandbox;
use serde::{Deserialize, Serialize};

use crate::agent::AgentError;
use crate::image::{ImageMeta, Source};
use crate::node::templates::{self, Settings, BASE};
use crate::node::Node;
use crate::probe::Probe;
use crate::store::SandboxRow;
use crate::sync::LockExt;

/// The id of the start command's exec.
pub(crate) const START_EXEC: &str = "exe-start";

/// What the node keeps of a create, to make the machine again.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct StoredSpec {
    pub image: String,
    pub vcpus: u32,
    pub memory_bytes: u64,
    pub hostname: Option<String>,
    pub tmp_memory: bool,
    pub env: BTreeMap<String, String>,
    /// Sealed with the node key in the state database ([`crate::node::credentials::sealed_env`]).
    #[serde(with = "crate::node::credentials::sealed_env")]
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
    /// The key of its template ([`crate::node::templates`]); `None` in a row of an older node.
    #[serde(default)]
    pub template: Option<String>,
    /// On the node's network (a row of an older node: `lo` only, as it was made).
    #[serde(default)]
    pub network: bool,
    /// Its egress rules as the calls gave them (a PATCH merges into them); the current ones
    /// are `Managed::egress`.
    #[serde(default)]
    pub egress: Option<EgressRules>,
    /// `runtime` as given, in its canonical form (one that no longer parses reads as none).
    #[serde(default, deserialize_with = "crate::node::runtime_settings::read_kept")]
    pub runtime: Option<sbx_api::run::Runtime>,
    /// Ports anybody may open at the sandbox's preview URL (`public_ports`, as given).
    #[serde(default)]
    pub public_ports: Vec<u16>,
    /// `public_ports_except` as given: every port but these is public (`[]`: every port).
    #[serde(default)]
    pub public_ports_except: Option<Vec<u16>>,
    /// Its token (made at create; `None` in a row of an older node), sealed with the node key
    /// in the state database.
    #[serde(default, with = "access::sealed_token")]
    pub token: Option<SandboxToken>,
    /// `sleep_after_seconds` as the create gave it (absent: the node's default).
    #[serde(default)]
    pub sleep_after: sleep::SleepAfter,
    /// The volumes it mounts (ids), attached from its create to its delete.
    #[serde(default)]
    pub volumes: Vec<crate::node::volume::StoredVolume>,
    /// `suspend_after_ms` as the create gave it (none: the node's).
    #[serde(default)]
    pub suspend_after_ms: Option<u32>,
    /// `sleep_notice_ms` as the create gave it (none or 0: not told).
    #[serde(default)]
    pub sleep_notice_ms: Option<u32>,
    /// `sleep_hold_max_ms` as the create gave it (none: 30 s).
    #[serde(default)]
    pub sleep_hold_max_ms: Option<u32>,
    /// What its expires_at does when it comes.
    #[serde(default)]
    pub on_expiry: sbx_api::OnExpiry,
    /// `held_asleep` (a PATCH, E2B's pause and connect change it).
    #[serde(default)]
    pub held_asleep: bool,
}

impl SandboxRow {
    /// The row of a sandbox made now, `starting`.
    pub(crate) fn starting(
        id: &str,
        name: Option<String>,
        spec: &StoredSpec,
    ) -> Result<SandboxRow, ApiError> {
        Ok(SandboxRow {
            id: id.to_string(),
            name,
            status: "starting".into(),
            spec: serde_json::to_string(spec)
                .map_err(crate::node::internal("a sandbox's spec as JSON"))?,
            pid: None,
            start_time: None,
            created_at_ns: crate::image::now_ns() as i64,
            started_at_ns: None,
            failure_code: None,
            failure: None,
            restarts: 0,
        })
    }
}

impl StoredSpec {
    /// Whether start, start_command or ready was given: then the image's labels are not read.
    pub(crate) fn start_given(&self) -> bool {
        self.start.is_some()
            || self.start_command.is_some()
            || self.ready_command.is_some()
            || self.ready_probe.is_some()
    }

    /// The settings that make its template.
    pub(crate) fn template_settings(&self) -> Settings {
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
            runtime: crate::node::runtime_settings::template_part(self.runtime.as_ref()),
        }
    }
}

/// A sandbox's ready check.
#[derive(Debug, Clone, PartialEq)]
pub enum Check {
    /// Run in the sandbox by sh, as the image's user.
    Command(String),
    /// Tried from the host.
    Probe(Probe),
}

/// What a boot starts and checks, resolved against its image.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
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

    pub fn cancel(&self) {
        self.0.send_replace(true);
    }

    pub(crate) fn is_set(&self) -> bool {
        *self.0.borrow()
    }

    pub async fn wait(&self) {
        let mut rx = self.0.subscribe();
        let _ = rx.wait_for(|c| *c).await;
    }
}

/// A sandbox the node keeps.
impl Managed {
    /// Its lifecycle lock, for work of another module that must not overlap a lifecycle change
    /// (the lease told to its agent: a connection open during a checkpoint fails the dump).
    pub(crate) fn op_lock(&self) -> Arc<tokio::sync::Mutex<()>> {
        self.op.clone()
    }

    /// The volumes it has attached.
    pub fn volumes(&self) -> &[crate::node::volume::StoredVolume] {
        &self.spec.volumes
    }
}

pub(crate) struct Managed {
    pub id: String,
    row: Mutex<SandboxRow>,
    spec: StoredSpec,
    pub machine: Mutex<Option<Arc<Sandbox>>>,
    running: Mutex<HashSet<String>>,
    /// One lifecycle change at a time.
    op: Arc<tokio::sync::Mutex<()>>,
    /// What the current boot started and checks.
    resolved: Mutex<Resolved>,
    cancel: Cancel,
    /// Its egress rules as kept (a PATCH changes them).
    pub egress: Mutex<Option<EgressRules>>,
    /// When it expires (a PATCH changes it), and the number of the timer in force: a timer
    /// armed before the last change does nothing when it fires.
    pub expiry: Mutex<(Option<String>, u64)>,
    /// When it was last used, by how many now, and whether it is paused
    /// ([`sleep`](super::sandbox::sleep)).
    pub idle: Mutex<sleep::Idle>,
    /// True from before a sleep's checkpoint to after its wake: the node's watchers of its
    /// commands let go of the agent meanwhile.
    pub asleep: tokio::sync::watch::Sender<bool>,
    /// Raised (its count moved on) when a sleep asked for cuts the uses still open: answers
    /// being sent end, terminals close ([`sleep::InUse::cut`]).
    pub cut: tokio::sync::watch::Sender<u64>,
    /// Connections of the node's watchers open to its agent now.
    pub attached: std::sync::atomic::AtomicUsize,
    /// Asleep when the node started: its commands have no watcher until it wakes.
    pub rewatch: std::sync::atomic::AtomicBool,
    /// `held_asleep`: while it sleeps, a request to one of its ports does not wake it.
    pub held: std::sync::atomic::AtomicBool,
    /// Set when a release moves it to another node (`move_out.rs`): it is not woken, and its
    /// streams, waits and terminals end with `sandbox_moved`.
    pub(crate) moving: tokio::sync::watch::Sender<Option<move_out::MoveNote>>,
}

impl Managed {
    fn new(row: SandboxRow, spec: StoredSpec) -> Managed {
        Managed {
            id: row.id.clone(),
            row: Mutex::new(row),
            machine: Mutex::new(None),
            running: Mutex::new(HashSet::new()),
            op: Arc::new(tokio::sync::Mutex::new(())),
            resolved: Mutex::new(Resolved::default()),
            cancel: Cancel::new(),
            egress: Mutex::new(spec.egress.clone()),
            expiry: Mutex::new((spec.expires_at.clone(), 0)),
            idle: Mutex::new(sleep::Idle::new()),
            asleep: tokio::sync::watch::Sender::new(false),
            cut: tokio::sync::watch::Sender::new(0),
            attached: std::sync::atomic::AtomicUsize::new(0),
            rewatch: std::sync::atomic::AtomicBool::new(false),
            held: std::sync::atomic::AtomicBool::new(spec.held_asleep),
            moving: tokio::sync::watch::Sender::new(None),
            spec,
        }
    }

    pub fn resolved(&self) -> Resolved {
        self.resolved.locked().clone()
    }

    pub fn status(&self) -> SandboxStatus {
        SandboxStatus::parse(&self.row.locked().status).unwrap_or(SandboxStatus::Failed)
    }

    pub(crate) fn boot(&self) -> u32 {
        self.row.locked().restarts
    }

    pub fn machine(&self) -> Option<Arc<Sandbox>> {
        self.machine.locked().clone()
    }

    pub fn name(&self) -> Option<String> {
        self.row.locked().name.clone()
    }
}

fn not_found(id: &str) -> ApiError {
    ApiError::new(ErrorCode::SandboxNotFound, format!("no sandbox {id}"))
}

pub(crate) fn wrong_state(status: SandboxStatus, what: &str) -> ApiError {
    ApiError::new(
        ErrorCode::SandboxNotRunning,
        format!("the sandbox is {}: it cannot {what}", status.as_str()),
    )
}

pub use crate::fail::store_err;

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
    /// Kept sandbox `id_or_name`; 409 `moved` for one released or forgotten here (it is
    /// another node's now).
    pub(crate) fn managed(&self, id_or_name: &str) -> Result<Arc<Managed>, ApiError> {
        // A node whose lease ran out serves none of its sandboxes (`lease.rs`).
        if let Some(e) = self.fence_error() {
            return Err(e);
        }
        let found = self.managed_entry(id_or_name);
        if let Some(e) = found.as_ref().and_then(|m| self.taken_error(&m.id)) {
            return Err(e);
        }
        let id = found.as_ref().map_or(id_or_name, |m| m.id.as_str());
        // One this node is taking over (`move_in.rs`): 503 until it is here.
        if let Some(e) = found.is_none().then(|| self.takeover_error(id)).flatten() {
            return Err(e);
        }
        if let Some(e) = self.moved_error(id, found.is_some()) {
            return Err(e);
        }
        found.ok_or_else(|| not_found(id_or_name))
    }

    /// Sandbox `id_or_name` in the table, released or not.
    pub(crate) fn managed_entry(&self, id_or_name: &str) -> Option<Arc<Managed>> {
        let m = self.managed.locked();
        if let Some(s) = m.get(id_or_name) {
            return Some(s.clone());
        }
        m.values()
            .find(|s| s.name().as_deref() == Some(id_or_name))
            .cloned()
    }

    /// How many sandboxes the node keeps (made by creates, running or asleep; not those it
    /// released).
    pub fn kept_count(&self) -> usize {
        self.managed
            .locked()
            .keys()
            .filter(|id| !self.store.is_moved(id))
            .count()
    }

    /// Sandbox `id_or_name`'s object (404 `sandbox_not_found` when the node has none).
    pub fn sandbox(&self, id_or_name: &str) -> Result<SandboxObject, ApiError> {
        self.managed(id_or_name).map(|m| self.sandbox_object(&m))
    }

    pub(crate) fn sandbox_object(&self, m: &Managed) -> SandboxObject {
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
            expires_at: m.expiry.locked().0.clone(),
            failure_code: row.failure_code,
            failure: row.failure,
            restarts: row.restarts,
            template: m.spec.template.clone(),
            egress: m.egress.locked().as_ref().map(EgressRules::to_value),
            public_ports: m.spec.public_ports.clone(),
            public_ports_except: m.spec.public_ports_except.clone(),
            preview_url: self.preview_url(&m.id),
            paused: self.is_paused(m),
            sleep_after_seconds: self.sleep_after(m).map(|d| d.as_secs_f64()),
            sleep_notice_ms: m.spec.sleep_notice_ms.filter(|ms| *ms > 0),
            sleep_hold_max_ms: sleep::hold_max(&m.spec).as_millis() as u32,
            runtime: crate::node::runtime_settings::shown(m.spec.runtime.as_ref()),
            volumes: crate::node::volume::sandbox_volumes(&m.spec.volumes),
        }
    }

    /// The image of `spec`'s template pinned by digest, once the template is built of a
    /// pulled image.
    pub(crate) fn pinned_image(&self, spec: &StoredSpec) -> Option<String> {
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
    pub(crate) fn resolve_adopted(&self, spec: &StoredSpec) -> Resolved {
        let pinned = self.pinned_image(spec);
        let name = pinned.as_deref().unwrap_or(&spec.image);
        let meta = match self.images.lookup_private(name) {
            Ok(Source::Local(i)) if i.meta.name != "base" => Some(i.meta),
            _ => None,
        };
        resolve(spec, meta.as_ref()).unwrap_or_default()
    }

    /// `GET /v1/sandboxes`.
    pub fn list_sandboxes(&self, q: &ListQuery) -> (Vec<SandboxObject>, Option<String>) {
        let mut all: Vec<Arc<Managed>> = self.managed.locked().values().cloned().collect();
        all.sort_by_key(|m| (m.row.locked().created_at_ns, m.id.clone()));
        let key = |m: &Managed| format!("{:020}.{}", m.row.locked().created_at_ns, m.id);
        let mut out: Vec<(String, SandboxObject)> = Vec::new();
        let mut more = false;
        for m in all {
            if self.store.is_moved(&m.id) {
                continue;
            }
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

    /// Commands running now in sandbox `id` (0 for an unknown one). For the functions
    /// interface's `sandbox::list` and its idle reaper.
    /// A running sandbox's memory in use now (bytes) and CPU time used (ns).
    pub fn sandbox_usage(&self, id: &str) -> Option<(u64, u64)> {
        let m = self.managed(id).ok()?;
        let sb = m.machine()?;
        let (mem, cpu) = sb.usage();
        Some((mem.unwrap_or(0), cpu.unwrap_or(0)))
    }

    pub fn running_execs(&self, id: &str) -> usize {
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
            network: false,
            egress: None,
            runtime: None,
            public_ports: Vec::new(),
            public_ports_except: None,
            token: None,
            sleep_after: sleep::SleepAfter::default(),
            suspend_after_ms: None,
            sleep_notice_ms: None,
            sleep_hold_max_ms: None,
            volumes: Vec::new(),
            on_expiry: sbx_api::OnExpiry::Delete,
            held_asleep: false,
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
