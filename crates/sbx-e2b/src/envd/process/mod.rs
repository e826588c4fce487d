//! `process.Process`: commands of the sandbox, by pid (and tag), as E2B's envd serves them,
//! on the node's kept-sandbox commands (the core of `POST /v1/sandboxes/{id}/exec`).
//!
//! - Start (server stream): `{cmd, args, envs, cwd}` runs as argv as the request's user (the
//!   default user missing from the image: the image's user), in its home unless `cwd` says
//!   otherwise, on a terminal with `pty`, with stdin open when `stdin` is (unset: open, as
//!   envd). Events: `start {pid}` (its pid in the sandbox), `data` (stdout / stderr / pty),
//!   `end`, keepalives at the interval the request asked for (`Keepalive-Ping-Interval`, else
//!   envd's 90 s). `Connect-Timeout-Ms` bounds the command as envd bounds it: it is killed
//!   then, and the stream ends with deadline_exceeded.
//! - Connect: the same events for a process started here, its output from now on.
//! - List, SendInput, StreamInput, CloseStdin, SendSignal (SIGTERM, SIGKILL: its process
//!   group), Update (the terminal's size).
//!
//! The processes are kept node-wide in [`Processes`] (`table.rs`); `wire.rs` has the messages,
//! `user.rs` the user and working directory.

mod table;
pub mod user;
mod wire;

pub use table::Processes;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, Request};
use axum::response::Response;
use futures_util::StreamExt;
use sbx_api::{ApiError, Command, Encoding, ErrorCode, ExecFailKind, ExecRequest};
use serde_json::json;

use super::Ctx;
use crate::connect::{
    keepalive_interval, read_client_stream, read_stream_request, read_unary, stream_error,
    stream_reply, unary_reply, Code, RpcError, StreamSender,
};
use crate::node::output::{ExitStatus, Stream};
use crate::node::RunEvent;
use crate::Shared;
use table::{Entry, RETAIN};
use wire::*;

/// envd's keepalive interval when the request asks for none.
const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(90);

pub async fn call(ctx: Ctx, name: &str, req: Request<Body>) -> Response {
    let (parts, body) = req.into_parts();
    let h = &parts.headers;
    match name {
        "Start" => start(ctx, h, body).await,
        "Connect" => connect(ctx, h, body).await,
        "List" => unary_reply(list(&ctx, h, body).await),
        "SendInput" => unary_reply(send_input(&ctx, h, body).await),
        "StreamInput" => stream_input(&ctx, h, body).await,
        "CloseStdin" => unary_reply(close_stdin(&ctx, h, body).await),
        "SendSignal" => unary_reply(send_signal(&ctx, h, body).await),
        "Update" => unary_reply(update(&ctx, h, body).await),
        other => RpcError::new(
            Code::Unimplemented,
            format!("process.Process/{other}: no such method"),
        )
        .response(),
    }
}

/// The keepalive of a stream: the interval asked for, else envd's.
fn keepalive(headers: &HeaderMap) -> Option<(Duration, serde_json::Value)> {
    Some((
        keepalive_interval(headers).unwrap_or(DEFAULT_KEEPALIVE),
        keepalive_event(),
    ))
}

/// `Connect-Timeout-Ms` (0 or none: no deadline).
fn connect_timeout(headers: &HeaderMap) -> Result<Option<Duration>, RpcError> {
    let Some(v) = headers.get("connect-timeout-ms") else {
        return Ok(None);
    };
    let s = v.to_str().unwrap_or("").trim();
    match s.parse::<u64>() {
        Ok(0) => Ok(None),
        Ok(ms) if s.len() <= 10 => Ok(Some(Duration::from_millis(ms))),
        _ => Err(RpcError::invalid(format!(
            "Connect-Timeout-Ms {s:?} is not a number of milliseconds (at most 10 digits)"
        ))),
    }
}

async fn start(ctx: Ctx, headers: &HeaderMap, body: Body) -> Response {
    let msg: StartRequest = match read_stream_request(headers, body).await {
        Ok(m) => m,
        Err(e) => return stream_error(e),
    };
    let timeout = match connect_timeout(headers) {
        Ok(t) => t,
        Err(e) => return stream_error(e),
    };
    let (pid, entry) = match start_process(&ctx, msg, timeout).await {
        Ok(x) => x,
        Err(e) => return stream_error(e),
    };
    let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
    stream_reply(keepalive(headers), move |tx| async move {
        if !tx.send(&start_event(pid)).await {
            return Ok(());
        }
        follow(&ctx, &entry, 0, deadline, &tx).await
    })
}

/// Starts the command of a Start request and records it: its pid and entry.
async fn start_process(
    ctx: &Ctx,
    msg: StartRequest,
    timeout: Option<Duration>,
) -> Result<(u32, Entry), RpcError> {
    let config = msg.process.unwrap_or_default();
    if config.cmd.is_empty() {
        return Err(RpcError::invalid("process.cmd: name the program to run"));
    }
    // A sandbox of a template built through E2B's API: the user, working directory and env
    // its steps set are the defaults of its commands.
    let defaults = ctx
        .node()
        .sandbox(&ctx.sandbox)
        .map(|o| crate::api::TemplateDefaults::of(&o))
        .unwrap_or_default();
    let named = ctx
        .user
        .as_deref()
        .or(defaults.user.as_deref())
        .unwrap_or(crate::envd::DEFAULT_USER);
    let run_as = match ctx.node().fs_users(&ctx.sandbox).await {
        Ok(u) => user::resolve(Some(named), &u.users, u.default_user.as_deref())?,
        // An agent that lists no users (older than the node): the name as it is.
        Err(e) if e.code == ErrorCode::Unsupported => user::RunAs {
            user: Some(named.to_string()),
            home: None,
        },
        Err(e) => return Err(e.into()),
    };
    let cwd = match (
        config.cwd.as_deref().filter(|c| !c.is_empty()),
        &defaults.workdir,
    ) {
        (None, Some(w)) => Some(w.clone()),
        (c, _) => user::resolve_cwd(c, run_as.home.as_deref())?,
    };
    let tty = msg.pty.is_some();
    let (rows, cols) = msg.pty.unwrap_or_default().rows_cols();
    let mut argv = vec![config.cmd.clone()];
    argv.extend(config.args.iter().cloned());
    let mut req = ExecRequest::new(Command::Argv(argv));
    req.env = defaults.env.clone();
    req.env.extend(config.envs.clone());
    req.cwd = cwd.clone();
    req.user = run_as.user;
    req.timeout = timeout;
    req.tty = tty;
    req.stdin_open = !tty && msg.stdin.unwrap_or(true);
    req.rows = rows;
    req.cols = cols;
    req.check().map_err(RpcError::from)?;
    let node = ctx.node();
    // A command that could not be executed (its directory, its program) is an error here.
    let obj = node
        .exec_must_start(&ctx.sandbox, req, None)
        .await
        .map_err(|e| start_error(e, &config.cmd, cwd.as_deref()))?;
    let entry = Entry::new(obj.id.clone(), msg.tag.clone(), config, tty);
    let processes = &ctx.state().processes;
    processes.insert(&ctx.sandbox, obj.pid, entry.clone());
    tokio::spawn(watch(
        ctx.shared.clone(),
        ctx.sandbox.clone(),
        obj.pid,
        obj.id,
    ));
    Ok((obj.pid, entry))
}

/// The node's refusal of a start of `cmd` in `cwd` (`None`: the user's home), as envd says
/// it, by its kind: an unknown user is unauthenticated; a working directory or a program that
/// cannot be used is invalid_argument; anything else as the node's error.
fn start_error(e: ApiError, cmd: &str, cwd: Option<&str>) -> RpcError {
    let Some(kind) = e.exec_failure else {
        return RpcError::from(e);
    };
    match (kind, cwd) {
        (ExecFailKind::NoSuchUser, _) => RpcError::new(
            Code::Unauthenticated,
            format!("invalid username: {}", e.message),
        ),
        (ExecFailKind::CwdMissing, Some(dir)) => {
            RpcError::invalid(format!("cwd '{dir}' does not exist"))
        }
        (ExecFailKind::CwdNotDirectory, Some(dir)) => {
            RpcError::invalid(format!("cwd '{dir}' is not a directory"))
        }
        (
            ExecFailKind::CwdMissing
            | ExecFailKind::CwdNotDirectory
            | ExecFailKind::NotFound
            | ExecFailKind::Permission
            | ExecFailKind::NotExecutable
            | ExecFailKind::Other,
            _,
        ) => RpcError::invalid(format!("error starting process '{cmd}': {}", e.message)),
        (ExecFailKind::TooMany | ExecFailKind::Ended, _) => RpcError::from(e),
    }
}

/// Keeps the table's entry of a process until its end is known plus [`RETAIN`], or its
/// sandbox stops.
async fn watch(shared: Arc<Shared>, sandbox: String, pid: u32, exec_id: String) {
    let processes = &shared.envd.processes;
    if let Ok(state) = shared.node.exec_wait(&sandbox, &exec_id).await {
        if let Some(exit) = state.exit {
            processes.ended(&sandbox, pid, &exec_id, EndEvent::of(&exit));
            tokio::time::sleep(RETAIN).await;
        }
    }
    processes.remove(&sandbox, pid, &exec_id);
}

/// Sends a command's output from `from` as data events, then its end. The caller leaving
/// ends it (the command runs on); so does the stream's deadline (deadline_exceeded).
async fn follow(
    ctx: &Ctx,
    entry: &Entry,
    from: u64,
    deadline: Option<tokio::time::Instant>,
    tx: &StreamSender,
) -> Result<(), RpcError> {
    let deadline_exceeded = || {
        RpcError::new(
            Code::DeadlineExceeded,
            "the stream's timeout (Connect-Timeout-Ms) passed",
        )
    };
    let (_, _, mut rx) = ctx
        .node()
        .exec_output_events(&ctx.sandbox, &entry.exec_id, from, Encoding::Utf8)
        .await?;
    let until = async {
        match deadline {
            Some(d) => tokio::time::sleep_until(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(until);
    loop {
        let ev = tokio::select! {
            ev = rx.recv() => ev,
            _ = tx.closed() => return Ok(()),
            _ = &mut until => return Err(deadline_exceeded()),
        };
        match ev {
            Some(RunEvent::Output { stream, data, .. }) => {
                let out = match stream {
                    _ if entry.tty => Output::Pty,
                    Stream::Stderr => Output::Stderr,
                    _ => Output::Stdout,
                };
                for chunk in data.chunks(DATA_CHUNK) {
                    if !tx.send(&data_event(out, chunk)).await {
                        return Ok(());
                    }
                }
            }
            Some(RunEvent::Exited { exit, .. }) => {
                if exit.status == ExitStatus::TimedOut && deadline.is_some() {
                    // Killed at the request's timeout: envd's stream ends with it.
                    return Err(deadline_exceeded());
                }
                tx.send(&end_event(&EndEvent::of(&exit))).await;
                return Ok(());
            }
            Some(RunEvent::Failed(e)) => return Err(lost(ctx, e)),
            Some(RunEvent::Gap { .. } | RunEvent::Started { .. }) => {}
            None => {
                return Err(RpcError::new(
                    Code::Unavailable,
                    "the command's output ended before its end was told",
                ))
            }
        }
    }
}

/// A stream's command lost with its agent: the sandbox gone is said as E2B's proxy says it
/// (unavailable, "… was not found": the SDK raises SandboxNotRunningException); else
/// unavailable with the node's reason (the SDK probes the sandbox's health).
fn lost(ctx: &Ctx, e: ApiError) -> RpcError {
    let node = ctx.node();
    let running = node
        .sandbox(&ctx.sandbox)
        .is_ok_and(|o| o.status.can_exec());
    if running {
        RpcError::new(
            Code::Unavailable,
            format!("{} ({})", e.message, e.code.as_str()),
        )
    } else {
        RpcError::new(
            Code::Unavailable,
            format!(
                "the connection to sandbox {} ended before the stream completed: it \
                 stopped while the command ran",
                ctx.sandbox
            ),
        )
    }
}

async fn connect(ctx: Ctx, headers: &HeaderMap, body: Body) -> Response {
    let msg: ProcessRequest = match read_stream_request(headers, body).await {
        Ok(m) => m,
        Err(e) => return stream_error(e),
    };
    let found = Selector::of(msg.process.as_ref())
        .and_then(|sel| ctx.state().processes.any(&ctx.sandbox, &sel));
    let (pid, entry) = match found {
        Ok(x) => x,
        Err(e) => return stream_error(e),
    };
    let deadline = match connect_timeout(headers) {
        Ok(t) => t.map(|t| tokio::time::Instant::now() + t),
        Err(e) => return stream_error(e),
    };
    // Its output from now on: from where it stands.
    let now = match &entry.end {
        Some(_) => None,
        None => match ctx
            .node()
            .exec_output_range(&ctx.sandbox, &entry.exec_id, u64::MAX, None)
            .await
        {
            Ok((state, _, _)) => Some((state.output.end, state.exit)),
            Err(e) => return stream_error(e.into()),
        },
    };
    stream_reply(keepalive(headers), move |tx| async move {
        if !tx.send(&start_event(pid)).await {
            return Ok(());
        }
        let from = match now {
            Some((from, None)) => from,
            Some((_, Some(exit))) => {
                tx.send(&end_event(&EndEvent::of(&exit))).await;
                return Ok(());
            }
            None => {
                if let Some(end) = &entry.end {
                    tx.send(&end_event(end)).await;
                }
                return Ok(());
            }
        };
        follow(&ctx, &entry, from, deadline, &tx).await
    })
}

async fn list(ctx: &Ctx, headers: &HeaderMap, body: Body) -> Result<serde_json::Value, RpcError> {
    let _: serde_json::Value = read_unary(headers, body).await?;
    // A sandbox that is not running has no processes: said so.
    let node = ctx.node();
    let status = node.sandbox(&ctx.sandbox)?.status;
    if !status.can_exec() {
        return Err(RpcError::from(ApiError::new(
            ErrorCode::SandboxNotRunning,
            format!("the sandbox is {}", status.as_str()),
        )));
    }
    let processes: Vec<serde_json::Value> = ctx
        .state()
        .processes
        .list(&ctx.sandbox)
        .iter()
        .map(|(pid, e)| process_info(*pid, e.tag.as_deref(), &e.config))
        .collect();
    Ok(json!({ "processes": processes }))
}

/// Writes input to a running process: `stdin` to a pipe, `pty` to a terminal.
async fn write_input(ctx: &Ctx, sel: &Selector, input: Input) -> Result<(), RpcError> {
    let (_, entry) = ctx.state().processes.running(&ctx.sandbox, sel)?;
    let data = match (input, entry.tty) {
        (Input::Stdin(d), false) | (Input::Pty(d), true) => d,
        (Input::Stdin(_), true) => {
            return Err(RpcError::invalid(
                "the process runs on a terminal: send its input as pty, not stdin",
            ))
        }
        (Input::Pty(_), false) => {
            return Err(RpcError::invalid(
                "the process has no terminal: send its input as stdin, not pty",
            ))
        }
    };
    ctx.node()
        .exec_stdin(&ctx.sandbox, &entry.exec_id, &data, false)
        .await
        .map_err(|e| ended_as_not_found(e, sel))
}

/// A command that ended meanwhile is no process any more.
fn ended_as_not_found(e: ApiError, sel: &Selector) -> RpcError {
    if e.exec_failure == Some(ExecFailKind::Ended) {
        return sel.not_found();
    }
    match e.code {
        ErrorCode::ExecEnded | ErrorCode::ExecNotFound => sel.not_found(),
        ErrorCode::StdinClosed => RpcError::new(
            Code::FailedPrecondition,
            "stdin not enabled or closed (start the process with stdin: true)",
        ),
        _ => RpcError::from(e),
    }
}

async fn send_input(
    ctx: &Ctx,
    headers: &HeaderMap,
    body: Body,
) -> Result<serde_json::Value, RpcError> {
    let msg: SendInputRequest = read_unary(headers, body).await?;
    let sel = Selector::of(msg.process.as_ref())?;
    let input = Input::of(msg.input.as_ref())?;
    write_input(ctx, &sel, input).await?;
    Ok(json!({}))
}

/// StreamInput: a client stream (`start` first, then `data` and `keepalive`), answered as a
/// stream of one message once the input ends.
async fn stream_input(ctx: &Ctx, headers: &HeaderMap, body: Body) -> Response {
    let r = async {
        let mut messages = Box::pin(read_client_stream::<StreamInputRequest>(headers, body)?);
        let mut target: Option<Selector> = None;
        while let Some(msg) = messages.next().await {
            match msg?.event()? {
                StreamEvent::Start(sel) => {
                    ctx.state().processes.running(&ctx.sandbox, &sel)?;
                    target = Some(sel);
                }
                StreamEvent::Data(input) => {
                    let sel = target.as_ref().ok_or_else(|| {
                        RpcError::invalid("StreamInput: send start (the process) before data")
                    })?;
                    write_input(ctx, sel, input).await?;
                }
                StreamEvent::Keepalive => {}
            }
        }
        Ok::<(), RpcError>(())
    }
    .await;
    match r {
        Ok(()) => stream_reply(None, |tx| async move {
            tx.send(&json!({})).await;
            Ok(())
        }),
        Err(e) => stream_error(e),
    }
}

async fn close_stdin(
    ctx: &Ctx,
    headers: &HeaderMap,
    body: Body,
) -> Result<serde_json::Value, RpcError> {
    let msg: ProcessRequest = read_unary(headers, body).await?;
    let sel = Selector::of(msg.process.as_ref())?;
    let (_, entry) = ctx.state().processes.running(&ctx.sandbox, &sel)?;
    if entry.tty {
        return Err(RpcError::invalid(
            "cannot close stdin for PTY process — send Ctrl+D (0x04) instead",
        ));
    }
    match ctx
        .node()
        .exec_stdin(&ctx.sandbox, &entry.exec_id, &[], true)
        .await
    {
        Ok(()) => Ok(json!({})),
        // Closed already (or never open): as envd, nothing to do.
        Err(e)
            if e.code == ErrorCode::StdinClosed && e.exec_failure != Some(ExecFailKind::Ended) =>
        {
            Ok(json!({}))
        }
        Err(e) => Err(ended_as_not_found(e, &sel)),
    }
}

async fn send_signal(
    ctx: &Ctx,
    headers: &HeaderMap,
    body: Body,
) -> Result<serde_json::Value, RpcError> {
    let msg: SendSignalRequest = read_unary(headers, body).await?;
    let sel = Selector::of(msg.process.as_ref())?;
    // The process first, then the signal: envd's order (an unknown pid is not_found).
    let (_, entry) = ctx.state().processes.running(&ctx.sandbox, &sel)?;
    let signal = SignalMsg::number(msg.signal.as_ref())?;
    ctx.node()
        .exec_signal(&ctx.sandbox, &entry.exec_id, signal)
        .await
        .map_err(|e| ended_as_not_found(e, &sel))?;
    Ok(json!({}))
}

async fn update(ctx: &Ctx, headers: &HeaderMap, body: Body) -> Result<serde_json::Value, RpcError> {
    let msg: UpdateRequest = read_unary(headers, body).await?;
    let sel = Selector::of(msg.process.as_ref())?;
    let (_, entry) = ctx.state().processes.running(&ctx.sandbox, &sel)?;
    if let Some(pty) = msg.pty {
        if !entry.tty {
            return Err(RpcError::invalid(
                "tty not assigned to process (start it with pty)",
            ));
        }
        let (rows, cols) = pty.rows_cols();
        ctx.node()
            .exec_resize(&ctx.sandbox, &entry.exec_id, rows, cols)
            .await
            .map_err(|e| match e.code {
                ErrorCode::StdinClosed => sel.not_found(),
                _ => RpcError::from(e),
            })?;
    }
    Ok(json!({}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_timeout_header() {
        let mut h = HeaderMap::new();
        assert_eq!(connect_timeout(&h).unwrap(), None);
        h.insert("connect-timeout-ms", "1500".parse().unwrap());
        assert_eq!(
            connect_timeout(&h).unwrap(),
            Some(Duration::from_millis(1500))
        );
        h.insert("connect-timeout-ms", "0".parse().unwrap());
        assert_eq!(connect_timeout(&h).unwrap(), None);
        for bad in ["-1", "1.5", "12345678901"] {
            h.insert("connect-timeout-ms", bad.parse().unwrap());
            assert_eq!(connect_timeout(&h).unwrap_err().code, Code::InvalidArgument);
        }
    }

    #[test]
    fn keepalives_default_to_envds_interval() {
        let mut h = HeaderMap::new();
        assert_eq!(keepalive(&h).unwrap().0, DEFAULT_KEEPALIVE);
        h.insert("keepalive-ping-interval", "50".parse().unwrap());
        let (d, v) = keepalive(&h).unwrap();
        assert_eq!(d, Duration::from_secs(50));
        assert_eq!(v, keepalive_event());
    }

    #[test]
    fn the_nodes_refusals_as_envds() {
        let sel = Selector::Pid(9);
        let ended = ApiError::new(ErrorCode::ExecEnded, "the command exe-1 has ended");
        assert_eq!(ended_as_not_found(ended, &sel).code, Code::NotFound);
        let closed = ApiError::new(ErrorCode::StdinClosed, "the command's stdin is closed");
        assert_eq!(
            ended_as_not_found(closed, &sel).code,
            Code::FailedPrecondition
        );
        // Ended is told by its kind, whatever the message says.
        let ended =
            ApiError::new(ErrorCode::StdinClosed, "gone").with_exec_failure(ExecFailKind::Ended);
        assert_eq!(ended_as_not_found(ended, &sel).code, Code::NotFound);
        let closed = ApiError::new(ErrorCode::StdinClosed, "the command has ended, or not");
        assert_eq!(
            ended_as_not_found(closed, &sel).code,
            Code::FailedPrecondition
        );
    }

    /// Each kind of a refused start, as envd says it; no kind: the node's error as it is.
    #[test]
    fn refused_starts_by_their_kind() {
        let refused = |kind: ExecFailKind, message: &str| {
            ApiError::new(ErrorCode::InvalidField, message).with_exec_failure(kind)
        };
        let user = ApiError::new(ErrorCode::NoSuchUser, "bob is not a user of the sandbox")
            .with_exec_failure(ExecFailKind::NoSuchUser);
        let e = start_error(user, "ls", None);
        assert_eq!(e.code, Code::Unauthenticated);
        assert_eq!(
            e.message,
            "invalid username: bob is not a user of the sandbox"
        );
        let e = start_error(refused(ExecFailKind::CwdMissing, "m"), "ls", Some("/nope"));
        assert_eq!(
            (e.code, e.message.as_str()),
            (Code::InvalidArgument, "cwd '/nope' does not exist")
        );
        let e = start_error(
            refused(ExecFailKind::CwdNotDirectory, "m"),
            "ls",
            Some("/etc/passwd"),
        );
        assert_eq!(
            (e.code, e.message.as_str()),
            (
                Code::InvalidArgument,
                "cwd '/etc/passwd' is not a directory"
            )
        );
        // The user's home missing (no cwd asked for): the start's error.
        let e = start_error(
            refused(
                ExecFailKind::CwdMissing,
                "cannot change to directory /home/u: No such file or directory",
            ),
            "ls",
            None,
        );
        assert_eq!(
            e.message,
            "error starting process 'ls': cannot change to directory /home/u: No such file or directory"
        );
        for kind in [
            ExecFailKind::NotFound,
            ExecFailKind::Permission,
            ExecFailKind::NotExecutable,
            ExecFailKind::Other,
        ] {
            let e = start_error(refused(kind, "nope: command not found"), "nope", Some("/"));
            assert_eq!(e.code, Code::InvalidArgument, "{kind:?}");
            assert_eq!(
                e.message,
                "error starting process 'nope': nope: command not found"
            );
        }
        // Not a failed start: as the node's error.
        let many = ApiError::new(ErrorCode::TooManyCommands, "the sandbox runs 8 commands")
            .with_exec_failure(ExecFailKind::TooMany);
        assert_eq!(start_error(many.clone(), "ls", None), RpcError::from(many));
        let plain = ApiError::new(ErrorCode::InvalidField, "cwd: must be absolute");
        assert_eq!(
            start_error(plain.clone(), "ls", None),
            RpcError::from(plain)
        );
    }
}
