//! Commands in a kept sandbox: start, wait, stdin, signal.

use std::sync::Arc;
use std::time::Duration;

use sbx_api::{ApiError, ErrorCode, ExecFailKind, ExecObject, ExecRequest};
use sbx_proto::{AgentMsg, ExecSpec, ExecState, Frame, HostMsg, StartFailure};
use sbx_runtime::Sandbox;

use super::*;
use crate::agent::{one_shot, program, AgentConn};
use crate::node::output::{Collected, Started};
use crate::node::Node;
use crate::store::ExecRow;
use crate::sync::LockExt;

/// How long a waited command may run before its row is written (a shorter one is written once,
/// with its end).
pub(super) const ROW_AFTER: Duration = Duration::from_millis(5);

/// A command's place among its sandbox's running commands (`Managed::running`, the cap of
/// `max_execs_per_sandbox`): held from before the command starts until its end is recorded,
/// given back when dropped, on every path (it did not start, it ended, its watcher is done).
pub(crate) struct ExecSlot {
    m: Arc<Managed>,
    exec_id: String,
    /// False when the id was in the set already (not this slot's to give back).
    owned: bool,
}

impl ExecSlot {
    /// A slot if the sandbox runs fewer than `max` commands; else how many it runs.
    pub fn take(m: &Arc<Managed>, exec_id: &str, max: usize) -> Result<ExecSlot, usize> {
        let mut running = m.running.locked();
        if running.len() >= max {
            return Err(running.len());
        }
        let owned = running.insert(exec_id.to_string());
        Ok(ExecSlot {
            m: m.clone(),
            exec_id: exec_id.to_string(),
            owned,
        })
    }

    /// A slot whatever the cap: a start command, a command found running after a restart.
    pub fn hold(m: &Arc<Managed>, exec_id: &str) -> ExecSlot {
        let owned = m.running.locked().insert(exec_id.to_string());
        ExecSlot {
            m: m.clone(),
            exec_id: exec_id.to_string(),
            owned,
        }
    }
}

impl Drop for ExecSlot {
    fn drop(&mut self) {
        if self.owned {
            self.m.running.locked().remove(&self.exec_id);
        }
    }
}

/// Whether a command is started with its stdin left open for later input.
pub(super) fn stdin_open_of(req: &ExecRequest) -> bool {
    req.stdin_open || req.tty
}

impl Node {
    /// Starts a command in `sb` and records it. `stdin` is sent before the answer; with
    /// `close` stdin is closed after it.
    pub(crate) async fn start_exec(
        self: &Arc<Self>,
        m: &Arc<Managed>,
        sb: &Arc<Sandbox>,
        spec: ExecSpec,
        command: String,
        stdin: Option<&[u8]>,
        slot: ExecSlot,
    ) -> Result<(ExecState, AgentConn, ExecRow, Option<ExecSlot>), ApiError> {
        let mut spec = spec;
        let stdin_open = spec.stdin_open;
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
                pid,
                started_at_ns,
                failed,
                ..
            } => ExecState {
                exec_id: exec_id.clone(),
                pid,
                started_at_ns,
                exit: None,
                output: sbx_proto::OutputCounts::default(),
                failed: StartFailure::of_start(pid, failed),
            },
            AgentMsg::ExecFailed { kind, message, .. } => {
                return Err(match kind {
                    sbx_proto::ExecFailKind::NoSuchUser => no_such_user(message),
                    sbx_proto::ExecFailKind::DuplicateId => ApiError::new(
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
        if !attach {
            // An attached caller reads the end on its own connection (and watches if it
            // stops waiting first).
            self.watch_exec(m.clone(), sb.clone(), row.clone(), slot);
            return Ok((state, conn, row, None));
        }
        Ok((state, conn, row, Some(slot)))
    }

    /// Waits for a command to end, then records its final object and gives back its slot.
    pub(crate) fn watch_exec(
        self: &Arc<Self>,
        m: Arc<Managed>,
        sb: Arc<Sandbox>,
        row: ExecRow,
        slot: ExecSlot,
    ) {
        let node = self.clone();
        tokio::spawn(async move {
            let wait = HostMsg::Wait {
                exec_id: row.exec_id.clone(),
            };
            let mut asleep = m.asleep.subscribe();
            let mut sb = sb;
            loop {
                let attached = Attached::new(&m);
                tokio::select! {
                    got = one_shot(&sb.socket, &wait) => {
                        if let Ok(AgentMsg::State(state)) = got {
                            let obj = final_object(&m, &row, Some(&state));
                            if let Ok(json) = serde_json::to_string(&obj) {
                                let _ = node.store.set_exec_final(&m.id, &row.exec_id, &json);
                            }
                        }
                        break;
                    }
                    // The sandbox goes to sleep: let go of its agent (a connection open to it
                    // cannot be checkpointed), and wait again once it is awake.
                    _ = async { asleep.wait_for(|a| *a).await.map(|_| ()) } => {
                        drop(attached);
                        let woke = async { asleep.wait_for(|a| !*a).await.map(|_| ()) }.await;
                        if woke.is_err() {
                            break;
                        }
                        match m.machine() {
                            Some(now) => sb = now,
                            None => break,
                        }
                    }
                }
            }
            drop(slot);
        });
    }

    /// `POST /v1/sandboxes/{id}/exec`. A command that could not be executed (its directory,
    /// its program) is no error here: its object says it ended with 126 or 127, its stderr
    /// why.
    pub async fn exec(
        self: &Arc<Self>,
        id: &str,
        req: ExecRequest,
        exec_id: Option<String>,
    ) -> Result<ExecObject, ApiError> {
        Ok(self.exec_as_told(id, req, exec_id).await?.0)
    }

    /// As [`Node::exec`], for a front end that tells a command that could not be executed
    /// as an error (E2B's envd): then an error with its kind ([`ApiError::exec_failure`];
    /// `invalid_field` on `cwd` or `command`), the command recorded as `exec` records it.
    pub async fn exec_must_start(
        self: &Arc<Self>,
        id: &str,
        req: ExecRequest,
        exec_id: Option<String>,
    ) -> Result<ExecObject, ApiError> {
        match self.exec_as_told(id, req, exec_id).await? {
            (obj, None) => Ok(obj),
            (obj, Some(failure)) => Err(start_refused(&failure, &obj)),
        }
    }

    /// The command's object, and why it could not be executed if it could not.
    async fn exec_as_told(
        self: &Arc<Self>,
        id: &str,
        req: ExecRequest,
        exec_id: Option<String>,
    ) -> Result<(ExecObject, Option<StartFailure>), ApiError> {
        let m = self.managed(id)?;
        let sb = self.running_machine(&m)?;
        let exec_id = exec_id.unwrap_or_else(|| sbx_api::new_id("exe"));
        // The slot is taken here, under the lock: calls at the same time cannot all pass the
        // check before any of them is counted. Given back (dropped) if the command does not
        // start.
        let mut slot = ExecSlot::take(&m, &exec_id, self.cfg.max_execs_per_sandbox);
        if slot.is_err() {
            // A command that ended may not have given its slot back yet (its watcher records
            // it first), though its end was already answered: the agent knows.
            if let Ok(AgentMsg::Execs { execs }) = one_shot(&sb.socket, &HostMsg::List).await {
                let mut running = m.running.locked();
                for s in execs.iter().filter(|s| s.exit.is_some()) {
                    running.remove(&s.exec_id);
                }
            }
            slot = ExecSlot::take(&m, &exec_id, self.cfg.max_execs_per_sandbox);
        }
        let slot = slot.map_err(|running| {
            ApiError::new(
                ErrorCode::TooManyCommands,
                format!("the sandbox runs {running} commands, as many as it may at once"),
            )
            .with_exec_failure(ExecFailKind::TooMany)
        })?;
        let mut env = Self::base_env(&m);
        env.extend(req.env.clone());
        let spec = ExecSpec {
            exec_id: exec_id.clone(),
            program: program(&req.command),
            env,
            cwd: req.cwd.clone().or_else(|| m.spec.cwd.clone()),
            user: req.user.clone().or_else(|| m.spec.user.clone()),
            timeout_ms: req.timeout.map(sbx_api::run::ms_of),
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
                slot,
            )
            .await;
        let (state, mut conn, row, slot) = started?;
        let failed = state.failed.clone();
        let attached = req.wait_seconds > 0.0 && !req.tty;
        if !attached {
            conn.release();
            let obj = self.exec_get(id, &exec_id, 0.0, req.encoding).await?;
            return Ok((obj, failed));
        }
        let meta = meta_of(&m, &row, req.encoding);
        let mut c = Collected::default();
        let (waited, row_written, unrecorded) = {
            let collect = async {
                loop {
                    match conn.recv().await {
                        Ok(Frame::Data { stream, bytes, .. }) => {
                            c.push(crate::node::output::Stream::of(stream), bytes.into())
                        }
                        Ok(Frame::Msg(AgentMsg::Gap { .. })) => c.gap = true,
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
            if let Some(slot) = slot {
                self.watch_exec(m.clone(), sb.clone(), row, slot);
            }
            return Err(store_err(e));
        }
        if let Ok(Some((exit, output))) = waited {
            c.started = Started {
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
            drop(slot);
            let json = json.map_err(crate::node::internal("a command's final object as JSON"))?;
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
            return Ok((c.object(&meta, Some(&exit.into()), output.into()), failed));
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
        if let Some(slot) = slot {
            self.watch_exec(m.clone(), sb.clone(), row, slot);
        }
        written.map_err(store_err)?;
        let obj = self.exec_get(id, &exec_id, 0.0, req.encoding).await?;
        Ok((obj, failed))
    }

    /// The agent socket of a command on a terminal that a session can attach to.
    pub(crate) fn terminal_socket(
        &self,
        id: &str,
        exec_id: &str,
    ) -> Result<std::path::PathBuf, ApiError> {
        let m = self.managed(id)?;
        let row = self.exec_row(&m, exec_id)?;
        if !row.tty {
            return Err(ApiError::new(
                ErrorCode::InvalidField,
                format!("{exec_id} does not run on a terminal (start it with tty: true)"),
            )
            .with_param("exec_id"));
        }
        let sb = self.running_machine(&m)?;
        if row.boot != m.boot() || row.final_json.is_some() {
            return Err(ended(ApiError::new(
                ErrorCode::StdinClosed,
                format!("{exec_id} has ended"),
            )));
        }
        Ok(sb.socket.clone())
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
            return Err(ended(ApiError::new(
                ErrorCode::StdinClosed,
                "the command has ended",
            )));
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
                return Err(ended(ApiError::new(
                    ErrorCode::StdinClosed,
                    "the command has ended",
                )));
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

    /// Waits (without a deadline) for a kept command to end: its final state. An error when
    /// its sandbox is not running or its agent goes (the sandbox stopped, restarted, deleted).
    pub async fn exec_wait(
        &self,
        id: &str,
        exec_id: &str,
    ) -> Result<crate::node::output::ExecProgress, ApiError> {
        let m = self.managed(id)?;
        let mut sb = self.running_machine(&m)?;
        let wait = HostMsg::Wait {
            exec_id: exec_id.into(),
        };
        let mut asleep = m.asleep.subscribe();
        let got = loop {
            let attached = Attached::new(&m);
            // A release ends the wait: the command goes on where the sandbox goes.
            tokio::select! {
                got = one_shot(&sb.socket, &wait) => break got,
                e = self.moved_signal(&m.id) => {
                    return Err(e.with_beside("exec_id", serde_json::json!(exec_id)));
                }
                // A checkpoint (a sleep, a snapshot, a fork): its agent let go of (a
                // connection open to it cannot be checkpointed), asked again once it runs.
                _ = async { asleep.wait_for(|a| *a).await.map(|_| ()) } => {
                    drop(attached);
                    if asleep.wait_for(|a| !*a).await.is_err() {
                        return Err(ApiError::new(
                            ErrorCode::SandboxNotFound,
                            format!("sandbox {id} is gone"),
                        ));
                    }
                    sb = self.running_machine(&m)?;
                }
            }
        };
        match got.map_err(agent_lost)? {
            AgentMsg::State(s) => Ok(s.into()),
            AgentMsg::ExecFailed { .. } => Err(ApiError::new(
                ErrorCode::ExecNotFound,
                format!("no command {exec_id}"),
            )),
            _ => Err(ApiError::internal()),
        }
    }

    /// A new size of the terminal of a running command (`tty: true`), as the terminal route's
    /// resize message sets it.
    pub async fn exec_resize(
        &self,
        id: &str,
        exec_id: &str,
        rows: u16,
        cols: u16,
    ) -> Result<(), ApiError> {
        let socket = self.terminal_socket(id, exec_id)?;
        let mut conn = AgentConn::connect(&socket, Duration::from_secs(5))
            .await
            .map_err(agent_lost)?;
        conn.send(&HostMsg::Resize {
            exec_id: exec_id.into(),
            rows: rows.clamp(1, 1000),
            cols: cols.clamp(1, 1000),
        })
        .await
        .map_err(agent_lost)?;
        acted_on(conn).await
    }

    /// `POST …/exec/{exec_id}/signal`: 409 exec_ended when the command has ended (recorded, of
    /// an earlier boot, or ended by the time the agent is asked).
    pub async fn exec_signal(&self, id: &str, exec_id: &str, signal: i32) -> Result<(), ApiError> {
        let m = self.managed(id)?;
        let row = self.exec_row(&m, exec_id)?;
        let has_ended = || {
            ended(ApiError::new(
                ErrorCode::ExecEnded,
                format!("the command {exec_id} has ended: there is nothing to signal"),
            ))
        };
        if row.final_json.is_some() || row.boot != m.boot() {
            return Err(has_ended());
        }
        let sb = self.running_machine(&m)?;
        let (mut conn, state) = status_conn(&sb, exec_id).await?;
        if state.exit.is_some() {
            conn.release();
            return Err(has_ended());
        }
        conn.send(&HostMsg::Signal {
            exec_id: exec_id.into(),
            signal,
        })
        .await
        .map_err(agent_lost)?;
        // Answered once the agent has sent it.
        acted_on(conn).await
    }
}

/// 400 no_such_user, as the agent refused `user`.
pub(crate) fn no_such_user(message: String) -> ApiError {
    ApiError::new(ErrorCode::NoSuchUser, message)
        .with_param("user")
        .with_exec_failure(ExecFailKind::NoSuchUser)
}

/// A refusal because the command has ended, said so in its kind.
fn ended(e: ApiError) -> ApiError {
    e.with_exec_failure(ExecFailKind::Ended)
}

/// The error of a command that could not be executed (see [`Node::exec_must_start`]): its
/// kind, `invalid_field` on what is at fault (`cwd`, else `command`), and the agent's message;
/// an older agent sends none, and its stderr says it.
pub(crate) fn start_refused(failure: &StartFailure, obj: &ExecObject) -> ApiError {
    let kind = crate::agent::start_fail_kind(failure.kind);
    let param = match kind {
        ExecFailKind::CwdMissing | ExecFailKind::CwdNotDirectory => "cwd",
        _ => "command",
    };
    let message = if failure.message.is_empty() {
        let said = obj.stderr.trim().trim_start_matches("sbx: ");
        format!(
            "the command could not be executed{}{said}",
            if said.is_empty() { "" } else { ": " }
        )
    } else {
        failure.message.clone()
    };
    ApiError::invalid_field(param, message).with_exec_failure(kind)
}

/// A connection to `sb`'s agent and the state of command `exec_id` (404 exec_not_found when the
/// agent does not know it).
pub(super) async fn status_conn(
    sb: &Sandbox,
    exec_id: &str,
) -> Result<(AgentConn, ExecState), ApiError> {
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
pub(super) async fn live_exec(
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

/// Waits until the agent has acted on what was sent on `conn` before (a Sync after it is
/// answered in order), then gives the connection back.
async fn acted_on(mut conn: AgentConn) -> Result<(), ApiError> {
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

/// Counts a watcher's connection to the sandbox's agent while it is open (a sleep waits for
/// none to be).
pub(crate) struct Attached(Arc<Managed>);

impl Attached {
    pub fn new(m: &Arc<Managed>) -> Attached {
        m.attached.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Attached(m.clone())
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        self.0
            .attached
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sbx_api::{Encoding, ExecObjectKind, ExecStatus, OutputInfo};
    use sbx_proto::StartFailKind;

    fn ended_126(stderr: &str) -> ExecObject {
        ExecObject {
            id: "exe-0123456789abcdef".into(),
            object: ExecObjectKind::Exec,
            sandbox_id: "sbx-0123456789abcdef".into(),
            command: "x".into(),
            tty: false,
            status: ExecStatus::Exited,
            exit_code: Some(126),
            signal: None,
            started_at: "2025-01-01T00:00:00.000Z".into(),
            pid: 0,
            duration_seconds: Some(0.0),
            usage: None,
            output: OutputInfo::default(),
            stdout: String::new(),
            stderr: stderr.into(),
            truncated: false,
            encoding: Encoding::Utf8,
        }
    }

    /// A command that could not be executed, as an error: its kind typed, the field at fault,
    /// the agent's message (or, from an older agent without one, its stderr).
    #[test]
    fn a_failed_start_as_an_error() {
        let cwd = StartFailure::new(
            StartFailKind::CwdMissing,
            "cannot change to directory /nope: No such file or directory",
        );
        let e = start_refused(&cwd, &ended_126("sbx: whatever\n"));
        assert_eq!(e.code, ErrorCode::InvalidField);
        assert_eq!(e.param.as_deref(), Some("cwd"));
        assert_eq!(e.exec_failure, Some(ExecFailKind::CwdMissing));
        assert_eq!(e.message, cwd.message);
        let not_dir = StartFailure::new(StartFailKind::CwdNotDirectory, "m");
        let e = start_refused(&not_dir, &ended_126(""));
        assert_eq!(
            (e.param.as_deref(), e.exec_failure),
            (Some("cwd"), Some(ExecFailKind::CwdNotDirectory))
        );
        for (kind, want) in [
            (StartFailKind::NotFound, ExecFailKind::NotFound),
            (StartFailKind::Permission, ExecFailKind::Permission),
            (StartFailKind::NotExecutable, ExecFailKind::NotExecutable),
            (StartFailKind::Other, ExecFailKind::Other),
        ] {
            let e = start_refused(&StartFailure::new(kind, "p: why"), &ended_126(""));
            assert_eq!(e.param.as_deref(), Some("command"));
            assert_eq!(e.exec_failure, Some(want));
            assert_eq!(e.message, "p: why");
        }
        // An older agent: pid 0 and no kind.
        let old = StartFailure::of_start(0, None).unwrap();
        let e = start_refused(&old, &ended_126("sbx: foo: command not found\n"));
        assert_eq!(e.exec_failure, Some(ExecFailKind::Other));
        assert_eq!(
            e.message,
            "the command could not be executed: foo: command not found"
        );
        let e = start_refused(&old, &ended_126(""));
        assert_eq!(e.message, "the command could not be executed");
    }

    #[test]
    fn refusals_say_their_kind() {
        let e = no_such_user("bob is not a user of the sandbox".into());
        assert_eq!(e.code, ErrorCode::NoSuchUser);
        assert_eq!(e.exec_failure, Some(ExecFailKind::NoSuchUser));
        let e = ended(ApiError::new(
            ErrorCode::StdinClosed,
            "the command has ended",
        ));
        assert_eq!(e.exec_failure, Some(ExecFailKind::Ended));
    }
}
