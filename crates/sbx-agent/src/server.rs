//! The agent's side of the protocol: connections from the node, the reaper.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use sbx_proto::{read_frame, AgentMsg, ExecFailKind, Frame, HostMsg, Stream, PROTO_VERSION};
use sbx_runtime::process::reap_any;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;
use tokio::task::{spawn_local, LocalSet};

use crate::exec::{self, Defaults, Exec};
use crate::fs;
use crate::watch;

struct Agent {
    defaults: Defaults,
    execs: Rc<exec::Registry>,
    by_pid: RefCell<HashMap<u32, Rc<Exec>>>,
    /// `/run/sbx/awake`, served by PID 1 of a sandbox (not by an agent started outside one).
    awake: Option<Rc<crate::awake::Awake>>,
    /// The watchdog of the node's lease (`lease.rs`), of PID 1 of a sandbox only.
    lease: Option<Rc<crate::lease::Watchdog>>,
}

type Out = mpsc::Sender<Vec<u8>>;

/// Serves the node until the sandbox ends.
pub fn run(listener: std::os::unix::net::UnixListener, defaults: Defaults, awake: bool) -> ! {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(_) => std::process::exit(1),
    };
    let local = LocalSet::new();
    local.block_on(&rt, serve(listener, defaults, awake));
    std::process::exit(0)
}

async fn serve(listener: std::os::unix::net::UnixListener, defaults: Defaults, awake: bool) {
    if listener.set_nonblocking(true).is_err() {
        return;
    }
    let Ok(listener) = tokio::net::UnixListener::from_std(listener) else {
        return;
    };
    let agent = Rc::new(Agent {
        defaults,
        execs: exec::Registry::new(),
        by_pid: RefCell::new(HashMap::new()),
        awake: if awake && std::process::id() == 1 {
            crate::awake::Awake::serve(std::path::Path::new(sbx_proto::AWAKE_SOCKET))
        } else {
            None
        },
        lease: (std::process::id() == 1).then(crate::lease::Watchdog::of_sandbox),
    });
    spawn_local(reaper(agent.clone()));
    if let Some(l) = &agent.lease {
        spawn_local(l.clone().run());
    }
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                // Only the node, from outside the sandbox, is served: its pid reads 0 in this
                // PID namespace. A process of the sandbox is refused.
                if from_outside(&stream) {
                    spawn_local(connection(agent.clone(), stream));
                }
            }
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(10)).await,
        }
    }
}

/// Whether the peer of `stream` is outside the agent's PID namespace (its pid reads 0 here).
/// An agent started outside a sandbox (its tests) is PID 1 of nothing: every peer is served.
fn from_outside(stream: &tokio::net::UnixStream) -> bool {
    if std::process::id() != 1 {
        return true;
    }
    matches!(sbx_runtime::sock::peer_pid(stream), Ok(0))
}

async fn reaper(agent: Rc<Agent>) {
    let Ok(mut sig) = signal(SignalKind::child()) else {
        return;
    };
    loop {
        // PID 1 reaps every process that ends in the sandbox, its own commands or orphans.
        while let Some(r) = reap_any() {
            let exec = agent.by_pid.borrow_mut().remove(&r.pid);
            if let Some(e) = exec {
                e.on_reaped(r);
            }
        }
        if sig.recv().await.is_none() {
            return;
        }
    }
}

/// Writes every buffer of `bufs`, in order, with as few writes as the socket takes.
async fn write_all_of(
    wr: &mut sbx_runtime::sock::WriteHalf,
    bufs: &[Vec<u8>],
) -> std::io::Result<()> {
    let mut slices: Vec<std::io::IoSlice<'_>> =
        bufs.iter().map(|b| std::io::IoSlice::new(b)).collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        let n = wr.write_vectored(rest).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        std::io::IoSlice::advance_slices(&mut rest, n);
    }
    Ok(())
}

async fn send(out: &Out, msg: &AgentMsg) -> bool {
    match sbx_proto::encode_msg(msg) {
        Ok(buf) => out.send(buf).await.is_ok(),
        Err(_) => false,
    }
}

async fn connection(agent: Rc<Agent>, stream: tokio::net::UnixStream) {
    // Registered for reading only: the node reading an answer does not wake this agent.
    let Ok(conn) = stream
        .into_std()
        .and_then(sbx_runtime::sock::Conn::from_std)
    else {
        return;
    };
    let (rd, mut wr) = conn.into_split();
    // Frames are read through a buffer: a small message costs one read, not three.
    let mut rd = tokio::io::BufReader::with_capacity(64 << 10, rd);
    let (out, mut rx) = mpsc::channel::<Vec<u8>>(64);
    spawn_local(async move {
        // What is queued when the writer wakes goes out in one write (a start and an end sent
        // back to back wake the node once).
        let mut batch: Vec<Vec<u8>> = Vec::new();
        while rx.recv_many(&mut batch, 64).await > 0 {
            if write_all_of(&mut wr, &batch).await.is_err() {
                break;
            }
            batch.clear();
        }
    });
    let mut features = vec![
        sbx_proto::FEATURE_FS.into(),
        sbx_proto::FEATURE_STDIN_NULL.into(),
        sbx_proto::FEATURE_WATCH.into(),
        sbx_proto::FEATURE_XATTRS.into(),
    ];
    if agent.awake.is_some() {
        features.push(sbx_proto::FEATURE_AWAKE.into());
    }
    if agent.lease.is_some() {
        features.push(sbx_proto::FEATURE_LEASE.into());
    }
    let hello = AgentMsg::Hello {
        version: PROTO_VERSION,
        agent: format!("sbx-agent {}", env!("CARGO_PKG_VERSION")),
        features,
    };
    if !send(&out, &hello).await {
        return;
    }
    let files = fs::Files::new(agent.defaults.user.clone(), out.clone());
    let watches = watch::Watches::new(out.clone());
    loop {
        let frame = match read_frame::<HostMsg, _>(&mut rd).await {
            Ok(Some(f)) => f,
            Ok(None) | Err(_) => return,
        };
        match frame {
            Frame::Data {
                exec_id,
                stream: Stream::Stdin,
                bytes,
                ..
            } => {
                let exec = agent.execs.get(&exec_id);
                if let Some(e) = exec {
                    e.write_stdin(bytes);
                }
            }
            Frame::Data {
                exec_id,
                stream: Stream::File,
                bytes,
                ..
            } => files.data(&exec_id, bytes).await,
            Frame::Data { .. } => {}
            Frame::Msg(HostMsg::Fs { id, op }) => files.start(id, op),
            Frame::Msg(HostMsg::FsEnd { id }) => files.end(&id).await,
            Frame::Msg(HostMsg::Watch {
                id,
                path,
                recursive,
            }) => watches.start(id, path, recursive),
            Frame::Msg(HostMsg::Unwatch { id }) => watches.stop(&id),
            Frame::Msg(msg) => handle(&agent, &out, msg).await,
        }
    }
}

fn find(agent: &Agent, id: &str) -> Option<Rc<Exec>> {
    agent.execs.get(id)
}

async fn no_such_exec(out: &Out, exec_id: String) {
    send(
        out,
        &AgentMsg::ExecFailed {
            message: format!("no command {exec_id}"),
            exec_id,
            kind: ExecFailKind::NoSuchExec,
        },
    )
    .await;
}

async fn handle(agent: &Rc<Agent>, out: &Out, msg: HostMsg) {
    match msg {
        HostMsg::Exec(spec) => {
            let id = spec.exec_id.clone();
            if find(agent, &id).is_some() {
                send(
                    out,
                    &AgentMsg::ExecFailed {
                        exec_id: id.clone(),
                        kind: ExecFailKind::DuplicateId,
                        message: format!("{id} exists"),
                    },
                )
                .await;
                return;
            }
            let attach = spec.attach;
            match exec::start(spec, &agent.defaults, &agent.execs) {
                Ok(e) => {
                    agent.execs.insert(e.clone());
                    if e.pid > 0 && e.state.borrow().exit.is_none() {
                        agent.by_pid.borrow_mut().insert(e.pid, e.clone());
                    }
                    let started = AgentMsg::Started {
                        exec_id: id,
                        pid: e.pid,
                        started_at_ns: e.started_at_ns,
                        failed: e.failed.clone(),
                    };
                    if attach {
                        // The caller reads the whole command on this connection: its start
                        // goes with its first output or its end (see `stream_output`).
                        spawn_local(stream_output(out.clone(), e, 0, Some(started)));
                    } else {
                        send(out, &started).await;
                    }
                }
                Err((kind, message)) => {
                    send(
                        out,
                        &AgentMsg::ExecFailed {
                            exec_id: id,
                            kind,
                            message,
                        },
                    )
                    .await;
                }
            }
        }
        HostMsg::CloseStdin { exec_id } => match find(agent, &exec_id) {
            Some(e) => e.close_stdin(),
            None => no_such_exec(out, exec_id).await,
        },
        HostMsg::Signal { exec_id, signal } => match find(agent, &exec_id) {
            Some(e) => e.signal(signal),
            None => no_such_exec(out, exec_id).await,
        },
        HostMsg::Attach { exec_id, from } => match find(agent, &exec_id) {
            Some(e) => {
                spawn_local(stream_output(out.clone(), e, from, None));
            }
            None => no_such_exec(out, exec_id).await,
        },
        HostMsg::Status { exec_id } => match find(agent, &exec_id) {
            Some(e) => {
                send(out, &AgentMsg::State(e.snapshot())).await;
            }
            None => no_such_exec(out, exec_id).await,
        },
        HostMsg::Wait { exec_id } => match find(agent, &exec_id) {
            Some(e) => {
                let out = out.clone();
                spawn_local(async move {
                    let mut changed = e.subscribe();
                    loop {
                        changed.borrow_and_update();
                        if e.state.borrow().exit.is_some() {
                            break;
                        }
                        if changed.changed().await.is_err() {
                            return;
                        }
                    }
                    send(&out, &AgentMsg::State(e.snapshot())).await;
                });
            }
            None => no_such_exec(out, exec_id).await,
        },
        HostMsg::List => {
            let mut execs: Vec<Rc<Exec>> = agent.execs.all();
            execs.sort_by_key(|e| (e.started_at_ns, e.id.clone()));
            let execs = execs.iter().map(|e| e.snapshot()).collect();
            send(out, &AgentMsg::Execs { execs }).await;
        }
        HostMsg::Resize {
            exec_id,
            rows,
            cols,
        } => match find(agent, &exec_id) {
            Some(e) => e.resize(rows, cols),
            None => no_such_exec(out, exec_id).await,
        },
        HostMsg::Sync { token } => {
            send(out, &AgentMsg::Synced { token }).await;
        }
        HostMsg::SetDumpable { dumpable } => {
            // Before a checkpoint: the watches whose connections the node closed are gone.
            if dumpable {
                crate::watch::none_running(Duration::from_secs(2)).await;
                // A sandbox restored from this checkpoint is sent its node's lease then.
                if let Some(l) = &agent.lease {
                    l.disarm();
                }
            }
            let _ = sbx_runtime::process::set_dumpable(dumpable);
            let dumpable = sbx_runtime::process::is_dumpable();
            send(out, &AgentMsg::Dumpable { dumpable }).await;
        }
        HostMsg::Awake { notice_ms } => {
            let held = match &agent.awake {
                Some(a) => {
                    if let Some(ms) = notice_ms {
                        a.notify(ms);
                    }
                    a.held()
                }
                None => crate::awake::Held {
                    holds: 0,
                    connected: 0,
                    lowered_ms_ago: None,
                },
            };
            send(
                out,
                &AgentMsg::Awake {
                    holds: held.holds,
                    connected: held.connected,
                    lowered_ms_ago: held.lowered_ms_ago,
                },
            )
            .await;
        }
        HostMsg::Lease { until_ms } => {
            let stopped = agent.lease.as_ref().is_some_and(|l| l.set(until_ms));
            send(out, &AgentMsg::Leased { stopped }).await;
        }
        // File operations are the connection's (see `connection`).
        HostMsg::Fs { .. } | HostMsg::FsEnd { .. } => {}
        // So are watches.
        HostMsg::Watch { .. } | HostMsg::Unwatch { .. } => {}
    }
}

/// How long the start of an attached command is held back for its end (or much output): a
/// short command's start, output and end then reach the node in one write, which wakes it once
/// instead of once per message.
const HOLD_STARTED: Duration = Duration::from_millis(2);
/// Output that ends the hold at once: the caller should see it streaming.
const HOLD_OUTPUT: u64 = 64 << 10;

/// Sends `started` (if given; see [`HOLD_STARTED`]), then the command's output from `from` on,
/// live, then its exit.
async fn stream_output(out: Out, exec: Rc<Exec>, from: u64, started: Option<AgentMsg>) {
    let mut changed = exec.subscribe();
    if let Some(started) = started {
        let until = tokio::time::Instant::now() + HOLD_STARTED;
        loop {
            changed.borrow_and_update();
            let held = {
                let st = exec.state.borrow();
                st.exit.is_none() && st.ring.end() < from + HOLD_OUTPUT
            };
            if !held {
                break;
            }
            match tokio::time::timeout_at(until, changed.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => break,
            }
        }
        if !send(&out, &started).await {
            return;
        }
    }
    let mut cursor = from;
    loop {
        changed.borrow_and_update();
        let (gap, pieces, exit) = {
            let st = exec.state.borrow();
            let gap = (cursor < st.ring.start()).then(|| (cursor, st.ring.start()));
            let id = &exec.id;
            let pieces = st.ring.read_with(cursor, 1 << 20, |pos, stream, data| {
                sbx_proto::encode_data(id, stream, pos, data)
            });
            (gap, pieces, st.exit.clone())
        };
        if let Some((a, b)) = gap {
            let msg = AgentMsg::Gap {
                exec_id: exec.id.clone(),
                from: a,
                to: b,
            };
            if !send(&out, &msg).await {
                return;
            }
            cursor = b;
        }
        if pieces.is_empty() {
            if let Some(exit) = exit {
                let msg = AgentMsg::Exited {
                    exec_id: exec.id.clone(),
                    exit,
                    output: exec.counts(),
                };
                send(&out, &msg).await;
                return;
            }
            if changed.changed().await.is_err() {
                return;
            }
            continue;
        }
        for (pos, _stream, len, frame) in pieces {
            cursor = pos + len as u64;
            if out.send(frame).await.is_err() {
                return;
            }
            exec.sent_up_to(cursor);
        }
    }
}
