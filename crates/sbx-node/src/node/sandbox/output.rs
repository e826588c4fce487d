//! A kept sandbox's commands as exec objects, and their output: from the agent while it knows
//! them, from their rows after.

use std::time::Duration;

use sbx_api::{ApiError, Encoding, ErrorCode, ExecObject};
use sbx_proto::{AgentMsg, ExecState, Frame, HostMsg};
use sbx_runtime::Sandbox;
use tokio::sync::mpsc;

use super::*;
use crate::agent::{one_shot, AgentConn};
use bytes::Bytes;

use crate::node::output::{
    exec_object, Collected, ExecMeta, ExecProgress, ExitInfo, ExitStatus, OutputCounts, Started,
    Stream, Tail,
};
use crate::node::{Node, RunEvent};
use crate::store::ExecRow;

impl Node {
    /// The final object of a command whose machine is gone. It was recorded before the machine
    /// went, maybe after the caller read the row (a delete or a restart ending it meanwhile):
    /// read again.
    pub(crate) fn recorded_final(
        &self,
        m: &Managed,
        exec_id: &str,
    ) -> Result<ExecObject, ApiError> {
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
            // A release ends the wait: the command goes on where the sandbox goes.
            tokio::select! {
                _ = tokio::time::timeout(
                    Duration::from_secs_f64(wait_seconds),
                    one_shot(&sb.socket, &wait),
                ) => {}
                e = self.moved_signal(&m.id) => {
                    return Err(e
                        .with_beside("offset", serde_json::json!(0))
                        .with_beside("exec_id", serde_json::json!(exec_id)));
                }
            }
        }
        let (state, mut c) = match read_all(&sb, exec_id).await {
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
        let state = ExecProgress::from(state);
        Ok(c.object(&meta, state.exit.as_ref(), state.output))
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
            let output = OutputCounts {
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
        let moved = self.moved_signal(&m.id);
        // Counted while it is open: a checkpoint waits for it to let go of the agent.
        let attached = Attached::new(&m);
        let mut asleep = m.asleep.subscribe();
        tokio::spawn(async move {
            tokio::pin!(moved);
            loop {
                let ev = tokio::select! {
                    // A release ends the stream (the event stream adds where it was).
                    e = &mut moved => {
                        let _ = tx.send(RunEvent::Failed(e)).await;
                        return;
                    }
                    // A checkpoint (a sleep, a snapshot, a fork): the agent let go of at once
                    // (a connection open to it cannot be checkpointed), and the stream ends;
                    // the command goes on, its output read again from where this ended.
                    _ = async { asleep.wait_for(|a| *a).await.map(|_| ()) } => {
                        drop(conn);
                        drop(attached);
                        let _ = tx.try_send(RunEvent::Failed(ApiError::new(
                            ErrorCode::Unavailable,
                            "the sandbox was checkpointed (a pause, a snapshot or a fork) \
                             while its output was followed: follow it again from where this \
                             ended",
                        )));
                        return;
                    }
                    f = conn.recv() => match f {
                        Ok(Frame::Data { stream, pos, bytes, .. }) => RunEvent::Output { stream: Stream::of(stream), pos, data: bytes },
                        Ok(Frame::Msg(AgentMsg::Gap { from, to, .. })) => RunEvent::Gap { from, to },
                        Ok(Frame::Msg(AgentMsg::Exited { exit, output, .. })) => {
                            let _ = tx.send(RunEvent::Exited { exit: exit.into(), output: output.into() }).await;
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
    ) -> Result<
        (
            ExecProgress,
            Vec<(Stream, u64, Vec<u8>)>,
            Option<(u64, u64)>,
        ),
        ApiError,
    > {
        let m = self.managed(id)?;
        let row = self.exec_row(&m, exec_id)?;
        let sb = m.machine().filter(|_| row.boot == m.boot());
        let live = live_exec(sb, &row).await?;
        let Some((mut conn, state)) = live else {
            let obj = self.recorded_final(&m, exec_id)?;
            let end = obj.output.end;
            let state = ExecProgress {
                pid: obj.pid,
                started_at_ns: row.created_at_ns,
                exit: Some(exit_of(&obj)),
                output: OutputCounts {
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
        Ok((state.into(), pieces, gap))
    }
}

pub(super) fn meta_of(m: &Managed, row: &ExecRow, encoding: Encoding) -> ExecMeta {
    ExecMeta {
        sandbox_id: m.id.clone(),
        exec_id: row.exec_id.clone(),
        command: row.command.clone(),
        encoding,
        tty: row.tty,
    }
}

pub(super) fn final_from_row(row: &ExecRow) -> Option<ExecObject> {
    row.final_json
        .as_deref()
        .and_then(|j| serde_json::from_str(j).ok())
}

pub(super) fn exit_of(obj: &ExecObject) -> ExitInfo {
    ExitInfo {
        status: ExitStatus::of_exec(obj.status),
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
pub(super) fn final_object(m: &Managed, row: &ExecRow, state: Option<&ExecState>) -> ExecObject {
    object_of(m, row, state, true)
}

/// The object of a command without its output, as the agent says it is now.
pub(super) fn current_object(m: &Managed, row: &ExecRow, state: Option<&ExecState>) -> ExecObject {
    object_of(m, row, state, false)
}

pub(super) fn object_of(
    m: &Managed,
    row: &ExecRow,
    state: Option<&ExecState>,
    ending: bool,
) -> ExecObject {
    let meta = meta_of(m, row, Encoding::Utf8);
    let killed = ExitInfo {
        status: ExitStatus::Killed,
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
            s.exit
                .clone()
                .map(ExitInfo::from)
                .or(ending.then_some(killed)),
            s.output.into(),
        ),
        None => (
            Started {
                pid: 0,
                started_at_ns: row.created_at_ns,
            },
            Some(killed),
            OutputCounts::default(),
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

/// Reads a command's output from `from` to `end` (what the agent has now), handing each piece
/// to `piece`; the gap the ring no longer holds, if any.
pub(super) async fn read_range(
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
                piece(Stream::of(stream), pos, &bytes[..take]);
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
pub(super) async fn start_output(sb: &Sandbox) -> String {
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

/// Everything the agent keeps of a command: its state and its output gathered.
pub(super) async fn read_all(
    sb: &Sandbox,
    exec_id: &str,
) -> Result<(ExecState, Collected), ApiError> {
    let (mut conn, state) = status_conn(sb, exec_id).await?;
    let mut c = Collected::of(Started {
        pid: state.pid,
        started_at_ns: state.started_at_ns,
    });
    let (start, end) = (state.output.start, state.output.end);
    let gap = read_range(&mut conn, exec_id, start, end, |stream, _, data| {
        c.push(stream, Bytes::copy_from_slice(data))
    })
    .await?;
    c.gap = start > 0 || gap.is_some();
    Ok((state, c))
}
