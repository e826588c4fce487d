//! `POST /v1/run`'s action: plan (refusals, limits, a name reserved, a warm sandbox taken),
//! run (the command's events sent as they come), teardown.

use std::sync::Arc;
use std::time::Duration;

use sbx_api::{ApiError, Encoding, ErrorCode, RunRequest, Tmp};
use sbx_proto::{AgentMsg, ExecFailKind, ExecSpec, Frame, HostMsg};
use sbx_runtime::{Limits, Sandbox};
use tokio::sync::mpsc;

use super::*;
use crate::image::Source;
use crate::node::output::{ExecMeta, ExitInfo, ExitStatus, OutputCounts, Stream};
use crate::sync::LockExt;

/// How long past a run's timeout the node waits for the agent to report its end.
pub(super) const RUN_GRACE: Duration = Duration::from_secs(2);

/// Rounds of a teardown (each kills what is in the sandbox's cgroup for up to 30 s).
pub(super) const TEARDOWN_ROUNDS: u32 = 10;

/// A run, validated and resolved: nothing is made yet (but a warm sandbox may be taken).
pub struct RunPlan {
    pub sandbox_id: String,
    pub exec_id: String,
    pub command: String,
    pub encoding: Encoding,
    pub(super) image: Source,
    pub(super) creds: Option<sbx_image::Credentials>,
    pub(super) limits: Limits,
    pub(super) hostname: String,
    pub(super) tmp_memory: bool,
    pub(super) exec: ExecSpec,
    pub(super) stdin: Option<Vec<u8>>,
    pub(super) warm: Option<Warm>,
    /// Made in a namespace of the node's network.
    pub(super) network: bool,
    /// `runtime.dns`'s resolv.conf.
    pub(super) resolv_conf: Option<String>,
    /// The rest of `runtime` (limits, sysctls, tmpfs, /dev/shm).
    pub(super) runtime: sbx_runtime::rtset::RuntimeSettings,
    /// Its egress rules (put in force before the command starts).
    pub(super) egress: Option<std::sync::Arc<sbx_api::egress::Egress>>,
    /// Its volumes, bound by init.
    pub(super) volumes: Vec<sbx_runtime::volume::VolumeBind>,
}

impl RunPlan {
    /// What every exec object of the run's command shares.
    pub fn meta(&self) -> ExecMeta {
        ExecMeta {
            sandbox_id: self.sandbox_id.clone(),
            exec_id: self.exec_id.clone(),
            command: self.command.clone(),
            encoding: self.encoding,
            tty: false,
        }
    }
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

impl Node {
    /// Checks a run against what this node serves and reserves its name. Every refusal
    /// happens here, before anything is made.
    pub fn plan_run(&self, req: RunRequest) -> Result<RunPlan, ApiError> {
        if self.is_stopping() {
            return Err(stopping_error());
        }
        if let Some(e) = self.fence_error() {
            return Err(e);
        }
        // Until the run is in the table: its place is taken.
        let _admission = self.admission.locked();
        let Machine {
            image,
            creds,
            limits,
            expires_in_ms,
            volumes,
        } = self.check_machine(&req, false)?;
        let mut deadline_ms = sbx_api::run::ms_of(req.timeout);
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
        let given = super::sandbox::egress_of(req.egress.as_ref())?;
        let egress = self.check_egress(given.as_ref(), self.has_net())?;
        let rt = super::runtime_settings::of_request(req.runtime.as_ref())?;
        let resolv_conf = self.resolv_for(rt.as_ref(), self.has_net());
        let runtime = super::runtime_settings::settings(rt.as_ref());
        let can_be_warm = resolv_conf.is_none()
            && runtime.is_empty()
            && image.is_base()
            && req.hostname.is_none()
            && req.tmp == Tmp::Disk
            && volumes.is_empty();
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
                self.take_live_warm(true)
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
            self.attach_run_volumes(&sandbox_id, &volumes);
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
            network: self.has_net(),
            egress,
            resolv_conf,
            runtime,
            volumes: self.volume_binds(&volumes),
        })
    }

    /// Runs a planned command in its own sandbox; events go to `tx`. The sandbox is deleted
    /// when the command ends, when the receiver is dropped (the caller hung up), or on failure.
    pub async fn run(self: Arc<Self>, plan: RunPlan, tx: mpsc::Sender<RunEvent>) {
        let id = plan.sandbox_id.clone();
        let result = self.run_inner(plan, &tx).await;
        // The name is free before the caller hears the end; so are its volumes.
        self.release(&id);
        self.detach_run_volumes(&id);
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

    pub(crate) fn teardown(self: &Arc<Self>, sb: Arc<Sandbox>) {
        self.teardowns.send_modify(|n| *n += 1);
        // Connections kept for its next call would outlive it (a descriptor each).
        crate::agent::close_idle(&sb.socket);
        let node = self.clone();
        tokio::task::spawn_blocking(move || {
            // A group that still has processes after a round (each kills for 30 s) is tried
            // again: the sandbox is never given up while something of it runs.
            for round in 1..=TEARDOWN_ROUNDS {
                match node.driver.destroy(&sb) {
                    Ok(()) => {
                        node.recycle_net(&sb.id);
                        break;
                    }
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
            node.teardowns.send_modify(|n| *n = n.saturating_sub(1));
        });
    }

    pub(crate) async fn run_inner(
        self: &Arc<Self>,
        mut plan: RunPlan,
        tx: &mpsc::Sender<RunEvent>,
    ) -> Result<Option<(ExitInfo, OutputCounts)>, ApiError> {
        let t0 = std::time::Instant::now();
        let warm = plan.warm.take();
        let from_pool = warm.is_some();
        if warm.is_some() || self.warm_below_target() {
            // One taken, or none found alive (a pool whose sandboxes all died is made again).
            self.refill();
        }
        let (sandbox, mut conn) = match warm {
            Some(w) => {
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
        self.apply_egress(&plan.sandbox_id, plan.egress.clone())?;
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
                        status: ExitStatus::TimedOut,
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
                        sbx_proto::Stream::Stdout => seen.stdout_bytes += n,
                        sbx_proto::Stream::Stderr => seen.stderr_bytes += n,
                        _ => {}
                    }
                    seen.end = seen.end.max(pos + n);
                    RunEvent::Output {
                        stream: Stream::of(stream),
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
                    return Ok(Some((exit.into(), output.into())));
                }
                Frame::Msg(AgentMsg::ExecFailed { kind, message, .. }) => {
                    return Err(match kind {
                        ExecFailKind::NoSuchUser => ApiError::new(ErrorCode::NoSuchUser, message)
                            .with_param("user")
                            .with_exec_failure(sbx_api::ExecFailKind::NoSuchUser),
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

    /// Ends a sandbox of the node's live table now (in the background).
    pub(crate) fn end_run_sandbox(self: &Arc<Self>, id: &str) {
        let sb = self.live.locked().remove(id);
        if let Some(sb) = sb {
            self.teardown(sb);
        }
    }
}
