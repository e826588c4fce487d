//! A kept sandbox's life: create (from a template, or building one), expiry, delete, restart,
//! its agent's end, and adoption after the node restarts.

use std::sync::Arc;
use std::time::Duration;

use sbx_api::{ApiError, ErrorCode, SandboxCreate, SandboxObject, SandboxStatus};
use sbx_proto::{AgentMsg, HostMsg};
use sbx_runtime::{Limits, Sandbox};

use super::*;
use crate::agent::one_shot;
use crate::image::Source;
use crate::node::templates::{self, Plan, BASE};
use crate::node::{Machine, Node};

use crate::probe::Probe;
use crate::store::SandboxRow;
use crate::sync::LockExt;

/// How long an adopted sandbox's checkpoint that the previous node left at work (its CRIU
/// still dumping) is given to end before that CRIU is killed: a dump takes well under a
/// second here, a large sandbox's a few.
const CHECKPOINT_LEFT_WAIT: Duration = Duration::from_secs(30);

/// The status a row has on disk while its sandbox is being deleted (the API says `stopping`).
const DELETING: &str = "deleting";

impl Node {
    /// `POST /v1/sandboxes`.
    pub async fn create_sandbox(
        self: &Arc<Self>,
        c: SandboxCreate,
    ) -> Result<SandboxObject, ApiError> {
        if self.is_stopping() {
            return Err(crate::node::stopping_error());
        }
        if let Some(e) = self.fence_error() {
            return Err(e);
        }
        if c.spec.snapshot.is_some() {
            return self.create_from_snapshot(c).await;
        }
        let network = c.network.unwrap_or(self.has_net()) && self.has_net();
        let req = c.spec;
        // Until the sandbox is among the kept ones: its place is taken.
        let admission = self.admission.locked();
        let Machine {
            image,
            creds: _,
            limits,
            expires_in_ms,
            volumes,
        } = self.check_machine(&req, true)?;
        self.check_egress(
            super::egress::egress_of(req.egress.as_ref())?.as_ref(),
            network,
        )?;
        let mut spec = self.stored_spec(&req, &limits)?;
        spec.network = network;
        spec.volumes = volumes;
        spec.token = Some(SandboxToken::new()?);
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
            && spec.runtime.is_none()
            && spec.memory_bytes == self.cfg.default_memory_bytes
            && spec.vcpus == self.cfg.default_vcpus
            && spec.network == self.has_net()
            && spec.volumes.is_empty();
        let warm = if warm_ok { self.pop_warm() } else { None };
        let id = match &warm {
            Some(sb) => sb.id.clone(),
            None => sbx_api::new_id("sbx"),
        };
        let row = SandboxRow::starting(&id, req.name.clone(), &spec)?;
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
        let m = match self.keep(row, spec, expires_in_ms) {
            Ok(m) => m,
            Err(e) => {
                give_back(self, warm);
                return Err(e);
            }
        };
        drop(admission);
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

    /// Records a new sandbox (its name reserved already; given back on failure) among the
    /// kept ones, and arms its expiry.
    pub(crate) fn keep(
        self: &Arc<Self>,
        row: SandboxRow,
        spec: StoredSpec,
        expires_in_ms: Option<u64>,
    ) -> Result<Arc<Managed>, ApiError> {
        if let Err(e) = self.store.insert_sandbox(&row) {
            self.release_name(row.name.as_deref());
            return Err(store_err(e));
        }
        let m = Arc::new(Managed::new(row, spec));
        self.managed.locked().insert(m.id.clone(), m.clone());
        if let Some(ms) = expires_in_ms {
            self.expire_at(&m, ms);
        }
        Ok(m)
    }

    /// `POST /internal/templates`: builds the template of a create's settings ahead, keeping
    /// no sandbox. A build sandbox is made (metadata `sbx.template_build`, so a listing says
    /// what it is) and deleted once the template is built or failed. Answers whether the
    /// template is done (built already, or failed at once) and its object.
    pub async fn build_template(
        self: &Arc<Self>,
        c: SandboxCreate,
    ) -> Result<(bool, sbx_api::TemplateObject), ApiError> {
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
    pub(crate) fn stored_spec(
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
            network: false,
            egress: super::egress::egress_of(req.egress.as_ref())?,
            runtime: crate::node::runtime_settings::of_request(req.runtime.as_ref())?,
            public_ports: req.public_ports.clone(),
            public_ports_except: req.public_ports_except.clone(),
            token: None,
            sleep_after: sleep::SleepAfter::from_request(req.sleep_after_seconds),
            suspend_after_ms: req.suspend_after_ms,
            sleep_notice_ms: req.sleep_notice_ms,
            sleep_hold_max_ms: req.sleep_hold_max_ms,
            volumes: Vec::new(),
            on_expiry: req.on_expiry,
            held_asleep: req.held_asleep,
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
    pub(crate) fn apply_template(
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
        // Its machine is the template's: its runtime settings too.
        spec.runtime = t.runtime;
        Ok(())
    }

    pub(crate) fn expire_at(self: &Arc<Self>, m: &Arc<Managed>, ms: u64) {
        let node = self.clone();
        let id = m.id.clone();
        let armed = m.expiry.locked().1;
        let m_on_expiry = m.spec.on_expiry;
        let m = Arc::downgrade(m);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            // A fenced node ends nothing: the expiry waits for its lease (`lease.rs`).
            while node.is_fenced() && !node.is_stopping() {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            // Changed (or gone) since: not this timer's to do.
            match m.upgrade() {
                Some(m) if m.expiry.locked().1 == armed => {}
                _ => return,
            }
            let on_expiry = m_on_expiry;
            if on_expiry == sbx_api::OnExpiry::Delete {
                tracing::info!(sandbox = %id, "expired: deleting");
                let _ = node.delete_sandbox(&id).await;
                return;
            }
            // sleep / hold: put to sleep whatever goes on in it, and kept; its expires_at is
            // null from then on (hold: held asleep too).
            let Some(m) = node.managed(&id).ok() else {
                return;
            };
            tracing::info!(sandbox = %id, ?on_expiry, "expired: put to sleep");
            if on_expiry == sbx_api::OnExpiry::Hold {
                let _ = node.set_held(&m, true);
            }
            let _ = node.set_expiry(&m, None);
            if let Err(e) = node.sleep_managed(&m, true).await {
                tracing::warn!(sandbox = %id, error = %e.message, "expired: not put to sleep");
            }
        });
    }

    /// Sets when a kept sandbox expires (`None`: never), kept across restarts; the timer
    /// armed before is void.
    pub(crate) fn set_expiry(
        self: &Arc<Self>,
        m: &Arc<Managed>,
        at: Option<String>,
    ) -> Result<(), ApiError> {
        let left_ms = at
            .as_deref()
            .map(crate::node::machine::expires_in_ms)
            .transpose()?;
        // The rules' lock before the expiry's, as PATCH of egress takes them.
        let egress = m.egress.locked();
        let mut expiry = m.expiry.locked();
        let mut spec = m.spec.clone();
        spec.egress = egress.clone();
        spec.expires_at = at.clone();
        spec.held_asleep = m.held.load(std::sync::atomic::Ordering::SeqCst);
        let json = serde_json::to_string(&spec)
            .map_err(crate::node::internal("a sandbox's spec as JSON"))?;
        self.store
            .update_sandbox_spec(&m.id, &json)
            .map_err(store_err)?;
        expiry.0 = at;
        expiry.1 += 1;
        drop(expiry);
        drop(egress);
        if let Some(ms) = left_ms {
            self.expire_at(m, ms);
        }
        Ok(())
    }

    /// Stops the start command (its stop signal, then grace), then ends the machine.
    pub(crate) async fn end_machine(self: &Arc<Self>, m: &Arc<Managed>) {
        // The machine stays visible until its commands' final objects are recorded: a command
        // asked about meanwhile is answered by the agent, then by its record.
        let Some(sb) = m.machine() else {
            if m.status() == SandboxStatus::Sleeping
                || m.asleep.send_replace(false)
                || crate::node::checkpoint::images_dir(&self.cfg.data_dir, &m.id).exists()
            {
                // Asleep: no process of it runs; its saved processes, cgroups and network go.
                self.release_net(&m.id);
                let driver = self.driver.clone();
                let (id, images) = (
                    m.id.clone(),
                    crate::node::checkpoint::images_dir(&self.cfg.data_dir, &m.id),
                );
                let _ = tokio::task::spawn_blocking(move || {
                    crate::node::checkpoint::remove_spent(&images);
                    let _ = std::fs::remove_dir_all(images);
                    driver.remove_leftovers(&id)
                })
                .await;
            }
            return;
        };
        // A paused machine is thawed first: its agent answers, its start command gets its
        // signal.
        if self.is_paused(m) {
            if let Err(e) = sb.set_paused(false) {
                tracing::warn!(sandbox = %m.id, error = %e, "thaw before the end");
            }
            self.forget_pause(m);
        }
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
        // Connections kept for its next call would outlive it (a descriptor each).
        crate::agent::close_idle(&sb.socket);
        let driver = self.driver.clone();
        let id = sb.id.clone();
        let destroyed = tokio::task::spawn_blocking(move || driver.destroy(&sb)).await;
        if matches!(destroyed, Ok(Ok(()))) {
            self.recycle_net(&id);
        } else {
            self.release_net(&id);
        }
    }

    pub(crate) async fn record_finals(&self, m: &Arc<Managed>, sb: &Sandbox) {
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
            // On disk the delete is asked for: a node that goes before it is done finishes it
            // when it starts again (`recover`), rather than keeping a half-ended sandbox.
            let mut stored = row.clone();
            stored.status = DELETING.into();
            let _ = self.store.update_sandbox(&stored);
        }
        self.end_machine(&m).await;
        let dir = self.sandboxes_dir().join(&m.id);
        let _ = tokio::task::spawn_blocking(move || sbx_runtime::driver::remove_dir(&dir)).await;
        self.store.delete_sandbox(&m.id).map_err(store_err)?;
        self.managed.locked().remove(&m.id);
        self.drop_takeover_answer(&m.id);
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

    /// Watches the agent of `m`'s machine `sb` through a pidfd: when it ends while `sb` is
    /// still the machine (not ended by a delete or a restart), the sandbox is failed at once
    /// with `agent_lost`, as a node that starts and finds an agent gone marks it (`recover`).
    pub(crate) fn watch_agent(self: &Arc<Self>, m: &Arc<Managed>, sb: &Arc<Sandbox>) {
        // A node of a fleet tells a new (woken, adopted) agent its lease at once.
        self.lease_agent(m.op.clone(), sb);
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
    pub(crate) async fn agent_ended(self: &Arc<Self>, m: &Arc<Managed>, sb: &Arc<Sandbox>) {
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
        crate::agent::close_idle(&sb.socket);
        let driver = self.driver.clone();
        let (sb, dir) = (sb.clone(), self.sandboxes_dir().join(&m.id));
        let _ = tokio::task::spawn_blocking(move || {
            if let Err(e) = driver.destroy(&sb) {
                tracing::warn!(sandbox = %sb.id, error = %e, "removing a lost agent's sandbox");
            }
            sbx_runtime::driver::remove_dir(&dir)
        })
        .await;
        self.release_net(&m.id);
    }

    /// At start, after the sandboxes are adopted: the images a wake spent that the previous
    /// node had not removed yet (`<id>.spent-…`), and those of sandboxes it no longer has.
    fn tidy_sleep_images(&self) {
        let dir = self.cfg.data_dir.join("sleep");
        let known: std::collections::HashSet<String> =
            self.managed.locked().keys().cloned().collect();
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let id = name.split(".spent-").next().unwrap_or_default();
            if name.contains(".spent-") || !known.contains(id) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }

    /// At start: the delete of sandbox `row` that the previous node did not finish: what runs
    /// of it is ended, what is left of it removed, its row (and its commands') deleted.
    fn finish_delete(&self, row: &super::SandboxRow, dir: &std::path::Path) {
        if let Some(pid) = row.pid {
            if let Some(sb) = self.driver.adopt(&row.id, dir, pid, row.start_time) {
                crate::agent::close_idle(&sb.socket);
                if let Err(e) = self.driver.destroy(&sb) {
                    tracing::warn!(sandbox = %row.id, error = %e, "ending a sandbox being deleted");
                }
            }
        }
        let _ = self.driver.remove_leftovers(&row.id);
        let _ = sbx_runtime::driver::remove_dir(dir);
        if let Err(e) = self.store.delete_sandbox(&row.id) {
            tracing::error!(sandbox = %row.id, error = %e, "the row of a sandbox being deleted");
        }
        tracing::info!(sandbox = %row.id, "a delete the previous node did not finish: done");
    }

    /// At start: adopts the sandboxes whose agents still run, marks the others failed (and
    /// removes what is left of them), and ends whatever else is in the node's cgroups.
    pub fn recover(self: &Arc<Self>) -> (usize, usize) {
        // A checkpoint or restore the previous node had under way when it was killed: its
        // criu runs on to the end (the dump whole, the tree ended or left as it was; the
        // restore done or undone). Waited for, so that what is found below is where it ends.
        let checkpoints = [
            self.cfg.data_dir.join("sleep"),
            self.cfg.data_dir.join("snapshots"),
        ];
        if !sbx_runtime::criu::wait_unused(&checkpoints, Duration::from_secs(60)) {
            tracing::warn!(
                "a checkpoint of the previous node's still runs: sandboxes adopted anyway"
            );
        }
        let copies = self.half_made_copies();
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
            let dir = self.sandboxes_dir().join(&row.id);
            if row.status == DELETING {
                self.finish_delete(&row, &dir);
                continue;
            }
            let m = Arc::new(Managed::new(row.clone(), spec));
            let alive = match (row.status.as_str(), row.pid) {
                // A zombie (an agent that died while no node reaped it) is no agent.
                ("running" | "starting" | "stopping", Some(pid)) => self
                    .driver
                    .adopt(&row.id, &dir, pid, row.start_time)
                    .filter(|sb| sb.is_alive()),
                _ => None,
            };
            let images = crate::node::checkpoint::images_dir(&self.cfg.data_dir, &row.id);
            // A sleep the previous node did not record: CRIU answered the dump (its images are
            // whole) and the tree is gone. It sleeps, and wakes at its next use.
            let slept = alive.is_none()
                && row.status == SandboxStatus::Running.as_str()
                && sbx_runtime::criu::dump_complete(&images);
            if slept {
                tracing::info!(sandbox = %row.id, "a sleep the previous node did not record: asleep");
                let mut r = m.row.locked();
                r.status = SandboxStatus::Sleeping.as_str().into();
                r.pid = None;
                r.start_time = None;
                if let Err(e) = self.store.update_sandbox(&r) {
                    tracing::error!(sandbox = %row.id, error = %e, "record a sleep");
                }
            }
            if slept || row.status == SandboxStatus::Sleeping.as_str() {
                // Asleep on disk: it stays so, and wakes at its next use. Its commands are
                // watched again once it is awake. What runs in its cgroups is a wake the
                // previous node did not record: ended (its images are kept, and the next wake
                // goes on from them), and the cgroups are made again at the wake.
                if let Err(e) = self.driver.remove_leftovers(&row.id) {
                    tracing::warn!(sandbox = %row.id, error = %e, "the cgroups of a sleeping sandbox");
                }
                m.rewatch.store(true, std::sync::atomic::Ordering::SeqCst);
                if let Some(n) = m.name() {
                    let _ = self.reserve_name(Some(&n), &m.id);
                }
                self.managed.locked().insert(m.id.clone(), m.clone());
                adopted += 1;
                continue;
            }
            if alive.is_none() && row.status == "starting" && copies.contains(&row.id) {
                // A copy of a snapshot (a fork) the previous node was making: removed whole;
                // the call that asked for it was never answered.
                tracing::info!(sandbox = %row.id, "a copy of a snapshot the previous node did not finish: removed");
                self.finish_delete(&row, &dir);
                continue;
            }
            if alive.is_none()
                && row.status == "starting"
                && row.pid.is_none()
                && m.spec.template.as_deref().is_none_or(|t| t == BASE)
            {
                // A create of the base image the previous node was making: such a create is
                // answered once its sandbox runs, so this one was never answered. Removed
                // whole, as if it had not been asked. (A create of another template may have
                // been answered `starting`: it is failed below.)
                tracing::info!(sandbox = %row.id, "a create the previous node did not finish: removed");
                self.finish_delete(&row, &dir);
                continue;
            }
            match alive {
                Some(sb) => {
                    // Images of a dump that did not end it (a node killed during a sleep,
                    // before CRIU answered): it runs on, and they are spent.
                    if images.exists() {
                        sbx_runtime::criu::forget_dump(&images);
                        if let Some(spent) = crate::node::checkpoint::set_aside(&images) {
                            let _ = std::fs::remove_dir_all(spent);
                        }
                    }
                    // Paused when the previous node went, or frozen by a checkpoint it did not
                    // finish (its agent perhaps dumpable still): it runs on thawed, its agent
                    // not dumpable first, as after any checkpoint (and pauses again when idle).
                    // The CRIU of such a checkpoint may still be at work (it outlives the
                    // node that asked): it ends first (its images are spent), for it sets
                    // the freezer back as it found it, and until then the sandbox's
                    // processes are stopped under it.
                    let traced = !sb.outside_tracers().is_empty();
                    let frozen = sb.is_paused();
                    let sb = Arc::new(sb);
                    if frozen || traced {
                        let (sb, id) = (sb.clone(), m.id.clone());
                        tokio::spawn(async move {
                            if traced {
                                tracing::info!(sandbox = %id, "a checkpoint the previous node asked for is still at work: waiting for its end");
                                let s = sb.clone();
                                let _ = tokio::task::spawn_blocking(move || {
                                    s.wait_untraced(CHECKPOINT_LEFT_WAIT)
                                })
                                .await;
                            }
                            if !traced || sb.is_paused() {
                                if let Err(e) = crate::node::checkpoint::after(&sb).await {
                                    tracing::warn!(sandbox = %id, error = %e, "an adopted sandbox left frozen");
                                }
                            }
                        });
                    }
                    {
                        let mut mm = m.machine.locked();
                        *mm = Some(sb.clone());
                    }
                    self.watch_agent(&m, &sb);
                    if let Some(n) = self.net.as_ref() {
                        n.adopt(&m.id, &sb);
                        if crate::node::runtime_settings::sets_net_sysctls(m.spec.runtime.as_ref())
                        {
                            n.keep_own(&m.id);
                        }
                        // The table was loaded again: its rules are put back.
                        if let Err(e) = self.apply_egress_of(&m) {
                            tracing::error!(sandbox = %m.id, error = %e.message, "egress rules after a restart");
                        }
                    }
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
                            let slot = ExecSlot::hold(&m, &e.exec_id);
                            self.watch_exec(m.clone(), sb.clone(), e, slot);
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
                    // Images of a sleep that did not complete: nothing to wake from.
                    crate::node::checkpoint::remove_spent(&images);
                    let _ = std::fs::remove_dir_all(&images);
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
        self.tidy_snapshots();
        self.tidy_sleep_images();
        (adopted, lost)
    }
}
