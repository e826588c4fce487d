//! One command: its process, pipes, output ring, deadline and exit.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::rc::{Rc, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sbx_proto::{
    ExecFailKind, ExecSpec, ExecState, ExitInfo, ExitStatus, OutputCounts, Program, StartFailKind,
    StartFailure, Stream,
};
use sbx_runtime::process::{self, Ended, Reaped, SpawnSpec};
use tokio::io::unix::AsyncFd;
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, watch};
use tokio::task::{spawn_local, AbortHandle};

use crate::ring::{Ring, CAPACITY};
use crate::users;

/// The image's defaults for commands.
#[derive(Debug, Clone)]
pub struct Defaults {
    pub env: Vec<(String, String)>,
    pub user: Option<String>,
    pub workdir: Option<String>,
    pub hostname: String,
    /// The limits of every command (the sandbox's runtime ulimits), set in its child before
    /// it executes; the agent keeps its own.
    pub rlimits: Vec<sbx_runtime::rtset::Rlimit>,
}

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// How long output is still read after the command ended while something it left behind
/// holds its pipes open.
const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(100);

/// The output all finished commands keep together: the newest first, the oldest trimmed first
/// (from their start: a command's tail is what stays).
pub const FINISHED_BUDGET: usize = 16 << 20;
/// What a finished command keeps of its output at least (its last bytes), while it is known.
pub const FINISHED_TAIL: usize = 4 << 10;
/// Finished commands known at most; the oldest finished is forgotten first (the node has its
/// final object).
pub const FINISHED_RECORDS: usize = 1024;

/// The agent's commands by id, and the finished ones in the order they finished: what bounds
/// the agent's memory whatever the number of commands (running ones keep up to [`CAPACITY`]
/// each; finished ones [`FINISHED_BUDGET`] together, [`FINISHED_TAIL`] each at least, and
/// [`FINISHED_RECORDS`] of them).
#[derive(Default)]
pub struct Registry {
    execs: RefCell<HashMap<String, Rc<Exec>>>,
    finished: RefCell<VecDeque<Rc<Exec>>>,
    /// The bytes the finished commands' rings keep together (kept as they change, so that a
    /// command's end does not add up every finished ring again).
    finished_kept: Cell<usize>,
}

impl Registry {
    pub fn new() -> Rc<Registry> {
        Rc::new(Registry::default())
    }

    pub fn get(&self, id: &str) -> Option<Rc<Exec>> {
        self.execs.borrow().get(id).cloned()
    }

    pub fn all(&self) -> Vec<Rc<Exec>> {
        self.execs.borrow().values().cloned().collect()
    }

    /// Keeps a command just started (one that could not run is finished already).
    pub fn insert(&self, e: Rc<Exec>) {
        self.execs.borrow_mut().insert(e.id.clone(), e.clone());
        if e.state.borrow().exit.is_some() {
            self.retire(e);
        }
    }

    /// A command has finished: its output joins the finished commands' budget.
    fn retire(&self, e: Rc<Exec>) {
        e.state.borrow_mut().ring.shrink();
        let mut finished = self.finished.borrow_mut();
        let mut total = self.finished_kept.get() + e.state.borrow().ring.kept();
        finished.push_back(e);
        for old in finished.iter() {
            if total <= FINISHED_BUDGET {
                break;
            }
            let mut st = old.state.borrow_mut();
            let before = st.ring.kept();
            let keep = before
                .saturating_sub(total - FINISHED_BUDGET)
                .max(FINISHED_TAIL);
            st.ring.trim_to(keep);
            total -= before - st.ring.kept();
        }
        while finished.len() > FINISHED_RECORDS {
            let Some(old) = finished.pop_front() else {
                break;
            };
            total -= old.state.borrow().ring.kept();
            let mut execs = self.execs.borrow_mut();
            if execs.get(&old.id).is_some_and(|e| Rc::ptr_eq(e, &old)) {
                execs.remove(&old.id);
            }
        }
        self.finished_kept.set(total);
    }
}

pub struct State {
    pub ring: Ring,
    pub exit: Option<ExitInfo>,
    reaped: Option<Reaped>,
    open_pipes: u8,
    timed_out: bool,
    readers: Vec<AbortHandle>,
}

pub struct Exec {
    /// Whether output is read only as fast as a reader takes it.
    wait_for_reader: Cell<bool>,
    /// The furthest position a reader has been sent.
    sent: watch::Sender<u64>,
    /// The terminal's master side, for a command on a PTY.
    pty: RefCell<Option<Rc<AsyncFd<OwnedFd>>>>,
    pub id: String,
    pub pid: u32,
    pub started_at_ns: i64,
    /// Why it could not be executed (then its pid is 0 and it has ended).
    pub failed: Option<StartFailure>,
    started: Instant,
    pub state: RefCell<State>,
    notify: watch::Sender<u64>,
    stdin: RefCell<Option<mpsc::UnboundedSender<Vec<u8>>>>,
    /// Told when the command finishes.
    registry: Weak<Registry>,
}

fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

fn find_on_path(name: &str, path: &str) -> Option<PathBuf> {
    if name.contains('/') {
        return Some(PathBuf::from(name));
    }
    path.split(':')
        .filter(|d| !d.is_empty())
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

impl Exec {
    fn new(
        id: String,
        pid: u32,
        readers: u8,
        failed: Option<StartFailure>,
        registry: &Rc<Registry>,
    ) -> Rc<Exec> {
        let (notify, _) = watch::channel(0);
        Rc::new(Exec {
            wait_for_reader: Cell::new(false),
            sent: watch::channel(0).0,
            pty: RefCell::new(None),
            id,
            pid,
            started_at_ns: now_ns(),
            failed,
            started: Instant::now(),
            state: RefCell::new(State {
                ring: Ring::new(CAPACITY),
                exit: None,
                reaped: None,
                open_pipes: readers,
                timed_out: false,
                readers: Vec::new(),
            }),
            notify,
            stdin: RefCell::new(None),
            registry: Rc::downgrade(registry),
        })
    }

    /// A command that could not be executed: it "ran" (pid 0) and ended with its kind's exit
    /// code (126 or 127, as in a shell), `sbx: ` and its message on stderr.
    fn failed(id: String, failure: StartFailure, registry: &Rc<Registry>) -> Rc<Exec> {
        let code = failure.kind.exit_code();
        let said = format!("sbx: {}\n", failure.message);
        let e = Exec::new(id, 0, 0, Some(failure), registry);
        {
            let mut st = e.state.borrow_mut();
            st.ring.push(Stream::Stderr, said.as_bytes());
            st.exit = Some(ExitInfo {
                status: ExitStatus::Exited,
                exit_code: code,
                signal: None,
                duration_ns: 0,
                cpu_ns: 0,
                max_rss_bytes: 0,
            });
        }
        e
    }

    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.notify.subscribe()
    }

    fn bump(&self) {
        self.notify.send_modify(|v| *v += 1);
    }

    pub fn snapshot(&self) -> ExecState {
        ExecState {
            exec_id: self.id.clone(),
            pid: self.pid,
            started_at_ns: self.started_at_ns,
            exit: self.state.borrow().exit.clone(),
            output: self.counts(),
            failed: self.failed.clone(),
        }
    }

    pub fn counts(&self) -> OutputCounts {
        let st = self.state.borrow();
        OutputCounts {
            stdout_bytes: st.ring.stdout_bytes,
            stderr_bytes: st.ring.stderr_bytes,
            start: st.ring.start(),
            end: st.ring.end(),
        }
    }

    /// A reader has been sent the output up to `pos`.
    pub fn sent_up_to(&self, pos: u64) {
        self.sent.send_if_modified(|v| {
            if pos > *v {
                *v = pos;
                true
            } else {
                false
            }
        });
    }

    /// With `wait_for_reader`: waits while a reader is more than half the ring behind.
    async fn wait_for_room(&self) {
        if !self.wait_for_reader.get() {
            return;
        }
        let mut sent = self.sent.subscribe();
        loop {
            let end = self.state.borrow().ring.end();
            if end.saturating_sub(*sent.borrow_and_update()) < (CAPACITY / 2) as u64 {
                return;
            }
            if sent.changed().await.is_err() {
                return;
            }
        }
    }

    fn push(&self, stream: Stream, data: &[u8]) {
        self.state.borrow_mut().ring.push(stream, data);
        self.bump();
    }

    pub fn write_stdin(&self, data: Vec<u8>) {
        if let Some(tx) = self.stdin.borrow().as_ref() {
            let _ = tx.send(data);
        }
    }

    pub fn close_stdin(&self) {
        self.stdin.borrow_mut().take();
    }

    /// A terminal's new size.
    pub fn resize(&self, rows: u16, cols: u16) {
        if let Some(p) = self.pty.borrow().as_ref() {
            let _ = process::set_winsize(p.get_ref(), rows, cols);
        }
    }

    pub fn signal(&self, sig: i32) {
        if self.state.borrow().exit.is_none() {
            process::kill_group(self.pid, sig);
        }
    }

    fn pipe_closed(self: &Rc<Self>) {
        let ready = {
            let mut st = self.state.borrow_mut();
            st.open_pipes = st.open_pipes.saturating_sub(1);
            st.open_pipes == 0 && st.reaped.is_some()
        };
        if ready {
            self.finish();
        }
    }

    pub fn on_reaped(self: &Rc<Self>, r: Reaped) {
        let pipes_open = {
            let mut st = self.state.borrow_mut();
            st.reaped = Some(r);
            st.open_pipes
        };
        if pipes_open == 0 {
            self.finish();
        } else {
            let me = self.clone();
            spawn_local(async move {
                tokio::time::sleep(DRAIN_AFTER_EXIT).await;
                me.finish();
            });
        }
    }

    fn finish(self: &Rc<Self>) {
        let mut st = self.state.borrow_mut();
        if st.exit.is_some() {
            return;
        }
        let Some(r) = st.reaped else {
            return;
        };
        for h in st.readers.drain(..) {
            h.abort();
        }
        let (status, exit_code, signal) = match r.ended {
            // Its own exit, even when the deadline came before it was reaped (a zombie by
            // then): the kill did not end it, so it did not time out.
            Ended::Exited(c) => (ExitStatus::Exited, c, None),
            Ended::Signaled(s) if st.timed_out => (ExitStatus::TimedOut, 128 + s, Some(s)),
            Ended::Signaled(s) => (ExitStatus::Killed, 128 + s, Some(s)),
        };
        st.exit = Some(ExitInfo {
            status,
            exit_code,
            signal,
            duration_ns: self.started.elapsed().as_nanos() as u64,
            cpu_ns: r.cpu.as_nanos() as u64,
            max_rss_bytes: r.max_rss_bytes,
        });
        drop(st);
        self.close_stdin();
        self.bump();
        if let Some(r) = self.registry.upgrade() {
            r.retire(self.clone());
        }
    }
}

/// What one read of a command's output did.
enum Read {
    /// This many bytes, now in the ring.
    Some(usize),
    /// Nothing yet (the readiness was stale).
    Again,
    /// The writers are gone (end of file) or the descriptor failed.
    End,
}

thread_local! {
    /// The buffer every output read of this (single-threaded) agent goes through: the bytes
    /// are copied into the command's ring at once, so one buffer serves all commands, and a
    /// command costs no buffer of its own to start.
    static READ_BUF: RefCell<Vec<u8>> = RefCell::new(vec![0u8; 256 << 10]);
}

/// One read of `fd` through [`READ_BUF`] into the command's ring as `stream`.
fn read_into(
    exec: &Exec,
    stream: Stream,
    read: impl FnOnce(&mut [u8]) -> std::io::Result<usize>,
) -> Read {
    READ_BUF.with_borrow_mut(|buf| match read(buf) {
        Ok(0) => Read::End,
        Ok(n) => {
            exec.push(stream, &buf[..n]);
            Read::Some(n)
        }
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Read::Again,
        Err(_) => Read::End,
    })
}

fn reader(exec: Rc<Exec>, fd: OwnedFd, stream: Stream) -> AbortHandle {
    let task = spawn_local(async move {
        if let Ok(rx) = tokio::net::unix::pipe::Receiver::from_owned_fd(fd) {
            let mut grown = false;
            loop {
                exec.wait_for_room().await;
                if rx.readable().await.is_err() {
                    break;
                }
                match read_into(&exec, stream, |buf| rx.try_read(buf)) {
                    Read::End => break,
                    // A command that filled half the default pipe writes a lot: a larger pipe
                    // wakes this reader less often.
                    Read::Some(n) if !grown && n >= 32 << 10 => {
                        process::grow_pipe(&rx);
                        grown = true;
                    }
                    Read::Some(_) | Read::Again => {}
                }
            }
        }
        exec.pipe_closed();
    });
    task.abort_handle()
}

/// Reads a terminal's output until its last slave closes (EIO).
fn pty_reader(exec: Rc<Exec>, pty: Rc<AsyncFd<OwnedFd>>) -> AbortHandle {
    let task = spawn_local(async move {
        loop {
            exec.wait_for_room().await;
            let Ok(mut ready) = pty.readable().await else {
                break;
            };
            // A stale readiness (would block) is cleared by try_io and read as Again.
            let read = read_into(&exec, Stream::Stdout, |buf| {
                ready
                    .try_io(|fd| process::read_nb(fd.get_ref(), buf))
                    .unwrap_or_else(|_would_block| Err(std::io::ErrorKind::WouldBlock.into()))
            });
            if let Read::End = read {
                break;
            }
        }
        exec.pipe_closed();
    });
    task.abort_handle()
}

/// Writes input to a terminal.
fn pty_writer(pty: Rc<AsyncFd<OwnedFd>>) -> mpsc::UnboundedSender<Vec<u8>> {
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
    spawn_local(async move {
        while let Some(buf) = rx.recv().await {
            let mut at = 0;
            while at < buf.len() {
                let Ok(mut ready) = pty.writable().await else {
                    return;
                };
                match ready.try_io(|fd| process::write_nb(fd.get_ref(), &buf[at..])) {
                    Ok(Ok(n)) => at += n,
                    Ok(Err(_)) => return,
                    Err(_would_block) => continue,
                }
            }
        }
    });
    tx
}

fn stdin_writer(fd: OwnedFd) -> mpsc::UnboundedSender<Vec<u8>> {
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
    spawn_local(async move {
        let Ok(mut pipe) = tokio::net::unix::pipe::Sender::from_owned_fd(fd) else {
            return;
        };
        while let Some(buf) = rx.recv().await {
            if pipe.write_all(&buf).await.is_err() {
                break;
            }
        }
    });
    tx
}

/// Starts a command. `Err` only for what the node must answer with an error (no such user);
/// a command that cannot be executed "runs" and ends with 126 or 127, as in a shell.
pub fn start(
    spec: ExecSpec,
    d: &Defaults,
    registry: &Rc<Registry>,
) -> Result<Rc<Exec>, (ExecFailKind, String)> {
    let user_spec = spec.user.as_deref().or(d.user.as_deref()).unwrap_or("0");
    let user = users::lookup(user_spec).ok_or_else(|| {
        (
            ExecFailKind::NoSuchUser,
            format!("{user_spec} is not a user of the sandbox"),
        )
    })?;
    let mut env: Vec<(String, String)> = vec![
        ("PATH".into(), DEFAULT_PATH.into()),
        ("HOME".into(), user.home.clone()),
        ("HOSTNAME".into(), d.hostname.clone()),
    ];
    if let Some(name) = &user.name {
        env.push(("USER".into(), name.clone()));
        env.push(("LOGNAME".into(), name.clone()));
    }
    for (k, v) in d.env.iter().chain(spec.env.iter()) {
        match env.iter_mut().find(|(ek, _)| ek == k) {
            Some(slot) => slot.1 = v.clone(),
            None => env.push((k.clone(), v.clone())),
        }
    }
    let cwd = spec
        .cwd
        .clone()
        .or_else(|| d.workdir.clone())
        .unwrap_or_else(|| "/".into());
    if let Some(failure) = cwd_failure(&cwd) {
        return Ok(Exec::failed(spec.exec_id, failure, registry));
    }
    let argv: Vec<String> = match &spec.program {
        Program::Shell(line) => vec!["/bin/sh".into(), "-c".into(), line.clone()],
        Program::Argv(a) => a.clone(),
    };
    let Some(first) = argv.first() else {
        // As a shell says of an empty command name: not found.
        let failure = StartFailure::new(StartFailKind::NotFound, "empty command");
        return Ok(Exec::failed(spec.exec_id, failure, registry));
    };
    let path_var = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.as_str())
        .unwrap_or(DEFAULT_PATH);
    let Some(program) = find_on_path(first, path_var) else {
        let failure = StartFailure::new(
            StartFailKind::NotFound,
            format!("{first}: command not found"),
        );
        return Ok(Exec::failed(spec.exec_id, failure, registry));
    };
    if spec.tty && !env.iter().any(|(k, _)| k == "TERM") {
        env.push(("TERM".into(), "xterm-256color".into()));
    }
    let how = SpawnSpec {
        program: &program,
        argv: &argv,
        env: &env,
        cwd: Path::new(&cwd),
        uid: user.uid,
        gid: user.gid,
        groups: &user.groups,
        stdin_null: spec.stdin_null && !spec.stdin_open,
        rlimits: &d.rlimits,
    };
    if spec.tty {
        let on_pty = process::spawn_pty(&how, spec.rows, spec.cols)
            .and_then(|p| Ok((p.pid, process::async_fd(p.master)?)));
        let (pid, master) = match on_pty {
            Ok(p) => p,
            Err(e) => return Ok(spawn_failed(spec.exec_id, first, &cwd, &e, registry)),
        };
        let master = Rc::new(master);
        let exec = Exec::new(spec.exec_id, pid, 1, None, registry);
        exec.wait_for_reader.set(spec.wait_for_reader);
        let r = pty_reader(exec.clone(), master.clone());
        exec.state.borrow_mut().readers = vec![r];
        *exec.stdin.borrow_mut() = Some(pty_writer(master.clone()));
        *exec.pty.borrow_mut() = Some(master);
        deadline(&exec, spec.timeout_ms);
        return Ok(exec);
    }
    let spawned = match process::spawn(&how) {
        Ok(s) => s,
        Err(e) => return Ok(spawn_failed(spec.exec_id, first, &cwd, &e, registry)),
    };
    let exec = Exec::new(spec.exec_id, spawned.pid, 2, None, registry);
    exec.wait_for_reader.set(spec.wait_for_reader);
    let r1 = reader(exec.clone(), spawned.stdout, Stream::Stdout);
    let r2 = reader(exec.clone(), spawned.stderr, Stream::Stderr);
    exec.state.borrow_mut().readers = vec![r1, r2];
    *exec.stdin.borrow_mut() = spawned.stdin.map(stdin_writer);
    deadline(&exec, spec.timeout_ms);
    Ok(exec)
}

/// Why a command cannot run in `cwd`, if it cannot: the directory is missing, is not one, or
/// cannot be looked at. (The child changes to it before it takes the command's user: the
/// agent, root, sees what the child will.)
fn cwd_failure(cwd: &str) -> Option<StartFailure> {
    let (kind, why) = match std::fs::metadata(cwd) {
        Ok(m) if m.is_dir() => return None,
        Ok(_) => (
            StartFailKind::CwdNotDirectory,
            "Not a directory".to_string(),
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => (
            StartFailKind::CwdMissing,
            "No such file or directory".to_string(),
        ),
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => (
            StartFailKind::CwdNotDirectory,
            "Not a directory".to_string(),
        ),
        Err(e) => (StartFailKind::Other, e.to_string()),
    };
    Some(StartFailure::new(
        kind,
        format!("cannot change to directory {cwd}: {why}"),
    ))
}

/// The kind of a failed spawn, by its errno. The errno is of the step that failed in the
/// child: the change to `cwd` (checked just before; gone since, when it is missing now) or
/// execve.
fn spawn_fail_kind(e: &std::io::Error, cwd: &str) -> StartFailKind {
    match e.raw_os_error() {
        Some(libc::ENOENT) if !Path::new(cwd).is_dir() => StartFailKind::CwdMissing,
        Some(libc::ENOENT) => StartFailKind::NotFound,
        Some(libc::EACCES | libc::EPERM) => StartFailKind::Permission,
        Some(libc::ENOEXEC) => StartFailKind::NotExecutable,
        _ => StartFailKind::Other,
    }
}

/// A command whose program could not be executed, as a shell says it: 127 when it is not
/// found, 126 otherwise.
fn spawn_failed(
    exec_id: String,
    program: &str,
    cwd: &str,
    e: &std::io::Error,
    registry: &Rc<Registry>,
) -> Rc<Exec> {
    let failure = match spawn_fail_kind(e, cwd) {
        StartFailKind::CwdMissing => StartFailure::new(
            StartFailKind::CwdMissing,
            format!("cannot change to directory {cwd}: No such file or directory"),
        ),
        kind => StartFailure::new(kind, format!("{program}: {e}")),
    };
    Exec::failed(exec_id, failure, registry)
}

/// Kills the command's process group when its time is up.
fn deadline(exec: &Rc<Exec>, timeout_ms: Option<u64>) {
    if let Some(ms) = timeout_ms {
        let me = exec.clone();
        spawn_local(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            let running = {
                let mut st = me.state.borrow_mut();
                let running = st.reaped.is_none();
                if running {
                    st.timed_out = true;
                }
                running
            };
            if running {
                process::kill_group(me.pid, libc::SIGKILL);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept(r: &Registry) -> usize {
        r.all().iter().map(|e| e.state.borrow().ring.kept()).sum()
    }

    #[test]
    fn finished_output_is_bounded_newest_first_with_tails() {
        let r = Registry::new();
        // Each stderr (`sbx: `, the message, a newline) is 1 MiB.
        let mb = "x".repeat((1 << 20) - 6);
        for i in 0..40 {
            let failure = StartFailure::new(StartFailKind::Other, mb.clone());
            r.insert(Exec::failed(format!("exe-{i}"), failure, &r));
        }
        assert!(kept(&r) <= FINISHED_BUDGET, "{}", kept(&r));
        assert_eq!(
            r.finished_kept.get(),
            kept(&r),
            "the running total is the sum"
        );
        // The newest are whole; the oldest keep their tail, at their end.
        let newest = r.get("exe-39").unwrap();
        assert_eq!(newest.counts().start, 0);
        let oldest = r.get("exe-0").unwrap();
        let c = oldest.counts();
        assert_eq!((c.end - c.start) as usize, FINISHED_TAIL);
        assert_eq!(c.end, 1 << 20);
        assert_eq!(c.stderr_bytes, 1 << 20, "counts stay whole");
    }

    /// Starts `program` in `cwd` as root: the command's failure and its end as it stands.
    fn start_in(cwd: &str, program: Program) -> (Option<StartFailure>, ExecState, String) {
        let d = Defaults {
            env: vec![],
            user: Some("0".into()),
            workdir: None,
            hostname: "t".into(),
            rlimits: vec![],
        };
        let spec = ExecSpec {
            exec_id: "exe-t".into(),
            program,
            env: vec![],
            cwd: Some(cwd.into()),
            user: None,
            timeout_ms: None,
            stdin_open: false,
            stdin_null: true,
            attach: false,
            tty: false,
            wait_for_reader: false,
            rows: 24,
            cols: 80,
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let local = tokio::task::LocalSet::new();
        local.block_on(&rt, async {
            let r = Registry::new();
            let e = start(spec, &d, &r).unwrap();
            let stderr: Vec<u8> = (e.state.borrow().ring.read_from(0, usize::MAX))
                .into_iter()
                .flat_map(|(_, _, data)| data)
                .collect();
            let stderr = String::from_utf8_lossy(&stderr).into_owned();
            (e.failed.clone(), e.snapshot(), stderr)
        })
    }

    /// A command that cannot be executed ends 126 or 127 as in a shell, with its kind (from
    /// the errno of the step that failed) in its start and its state.
    #[test]
    fn failed_starts_carry_their_kind() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap().to_string();
        let file = format!("{d}/file");
        std::fs::write(&file, "plain text, no #! line\n").unwrap();
        let argv = |p: &str| Program::Argv(vec![p.to_string()]);
        let cases = [
            (
                format!("{d}/nope"),
                argv("true"),
                StartFailKind::CwdMissing,
                format!("cannot change to directory {d}/nope: No such file or directory"),
            ),
            (
                file.clone(),
                argv("true"),
                StartFailKind::CwdNotDirectory,
                format!("cannot change to directory {file}: Not a directory"),
            ),
            (
                format!("{file}/below"),
                argv("true"),
                StartFailKind::CwdNotDirectory,
                format!("cannot change to directory {file}/below: Not a directory"),
            ),
            (
                d.clone(),
                argv("no-such-program-here"),
                StartFailKind::NotFound,
                "no-such-program-here: command not found".to_string(),
            ),
            (
                d.clone(),
                Program::Argv(vec![]),
                StartFailKind::NotFound,
                "empty command".to_string(),
            ),
            (
                d.clone(),
                argv(&format!("{d}/absent")),
                StartFailKind::NotFound,
                format!("{d}/absent: No such file or directory (os error 2)"),
            ),
            (
                d.clone(),
                argv(&file),
                StartFailKind::Permission,
                format!("{file}: Permission denied (os error 13)"),
            ),
        ];
        for (cwd, program, kind, message) in cases {
            let (failed, state, stderr) = start_in(&cwd, program);
            let want = StartFailure::new(kind, message.clone());
            assert_eq!(failed.as_ref(), Some(&want), "{cwd}");
            assert_eq!(state.failed, Some(want), "{cwd}");
            assert_eq!(state.pid, 0);
            let exit = state.exit.expect("it has ended");
            assert_eq!(exit.exit_code, kind.exit_code(), "{message}");
            assert_eq!(stderr, format!("sbx: {message}\n"));
        }
        // Executable, but not a format the kernel runs.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o755)).unwrap();
        let (failed, state, _) = start_in(&d, argv(&file));
        assert_eq!(failed.map(|f| f.kind), Some(StartFailKind::NotExecutable));
        assert_eq!(state.exit.map(|x| x.exit_code), Some(126));
    }

    #[test]
    fn spawn_errnos_name_their_kind() {
        let err = std::io::Error::from_raw_os_error;
        assert_eq!(
            spawn_fail_kind(&err(libc::ENOENT), "/"),
            StartFailKind::NotFound
        );
        assert_eq!(
            spawn_fail_kind(&err(libc::ENOENT), "/no/such/dir"),
            StartFailKind::CwdMissing
        );
        assert_eq!(
            spawn_fail_kind(&err(libc::EACCES), "/"),
            StartFailKind::Permission
        );
        assert_eq!(
            spawn_fail_kind(&err(libc::EPERM), "/"),
            StartFailKind::Permission
        );
        assert_eq!(
            spawn_fail_kind(&err(libc::ENOEXEC), "/"),
            StartFailKind::NotExecutable
        );
        assert_eq!(
            spawn_fail_kind(&err(libc::E2BIG), "/"),
            StartFailKind::Other
        );
        assert_eq!(
            spawn_fail_kind(&err(libc::ENOMEM), "/"),
            StartFailKind::Other
        );
    }

    #[test]
    fn the_oldest_finished_records_are_forgotten() {
        let r = Registry::new();
        for i in 0..FINISHED_RECORDS + 10 {
            let failure = StartFailure::new(StartFailKind::NotFound, "no");
            r.insert(Exec::failed(format!("exe-{i}"), failure, &r));
        }
        assert_eq!(r.all().len(), FINISHED_RECORDS);
        assert_eq!(
            r.finished_kept.get(),
            kept(&r),
            "the running total is the sum"
        );
        assert!(r.get("exe-9").is_none());
        assert!(r.get("exe-10").is_some());
    }
}
