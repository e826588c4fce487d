//! Booting a kept sandbox: its machine spec, the machine (a warm one when it fits), its start
//! command and ready check.

use std::sync::Arc;
use std::time::Duration;

use sbx_api::{ApiError, ErrorCode};
use sbx_proto::{AgentMsg, ExecSpec, Frame, HostMsg, Program};
use sbx_runtime::{Limits, Sandbox, SandboxSpec};

use super::*;
use crate::agent::{one_shot, program, AgentConn};
use crate::image::Source;
use crate::node::templates::{self, Plan, CANCELLED};
use crate::node::Node;
use crate::sync::LockExt;

impl Node {
    /// The machine of `m` and what it starts: its image resolved (its template's, pinned by
    /// digest, once the template is built; a pulled image from the node's store, pulled again
    /// when the store no longer has it). Errors carry the sandbox's failure code.
    pub(crate) async fn machine_spec(
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
            scratch: false,
            image_env: image.meta.env.clone(),
            image_user: image.meta.user.clone(),
            image_workdir: image.meta.workdir.clone(),
            netns: None,
            resolv_conf: self.resolv_for(m.spec.runtime.as_ref(), m.spec.network),
            ca_bundle: None,
            runtime: crate::node::runtime_settings::settings(m.spec.runtime.as_ref()),
            volumes: self.volume_binds(&m.spec.volumes),
        };
        Ok((spec, resolved))
    }

    pub(crate) fn base_env(m: &Managed) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = m.spec.env.clone().into_iter().collect();
        env.extend(m.spec.secret_env.clone());
        env
    }

    /// Boots the machine of `m` (made, or taken warm), starts its start command and waits for
    /// its ready check; on failure the sandbox is `failed` with its `failure_code`.
    pub(crate) async fn boot(
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
                    .create(spec, m.spec.network)
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
        // Its rules hold before anything of the caller's runs in it.
        if let Err(e) = self.apply_egress_of(m) {
            self.set_failed(m, "boot_failed", &e.message);
            return Err(ApiError::new(ErrorCode::SandboxFailed, e.message));
        }
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
                .start_exec(
                    m,
                    &sb,
                    spec,
                    start.display(),
                    None,
                    ExecSlot::hold(m, START_EXEC),
                )
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
    pub(crate) async fn boot_planned(
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
    pub(crate) fn give_back_warm(self: &Arc<Self>, warm: Option<Arc<Sandbox>>) {
        if let Some(sb) = warm {
            self.live_insert(&sb);
            self.end_run_sandbox(&sb.id);
        }
    }

    /// Runs the ready check every 0.2 s for at most 120 s (a command as the image's user by
    /// sh, a tcp or http check from the host); a start command that ends with a failure
    /// meanwhile ends the wait at once. The error says what the check last got and what the
    /// start command printed last.
    pub(crate) async fn wait_ready(
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
                    Ok(ns) => self.prober.try_once(p, ns).await,
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
    pub(crate) async fn ready_command_once(
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

    pub(crate) fn set_failed(&self, m: &Managed, code: &str, why: &str) {
        {
            let mut row = m.row.locked();
            row.status = "failed".into();
            row.failure_code = Some(code.into());
            row.failure = Some(why.into());
            row.pid = None;
            let _ = self.store.update_sandbox(&row);
        }
    }
}
