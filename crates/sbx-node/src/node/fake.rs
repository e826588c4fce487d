//! A fake driver for the node's tests: sandboxes that need no root, no namespaces, no cgroups
//! and no image, so that the node's lifecycle rules get fast unit tests.
//!
//! A [`World`] is what outlives a node, as a host does: the fake sandboxes' agents. Each
//! sandbox [`FakeDriver::create`] makes is
//! - its directory, with a unix socket at `agent.sock` where a fake agent answers the node in
//!   the real protocol (frames of sbx-proto, the hello of the real agent and its features), on
//!   the world's own runtime (it runs on while a node is dropped, as an agent outlives the node
//!   that made it);
//! - a cheap real process (`sleep`) that stands for the agent's process: the node watches it
//!   through its pidfd, as it watches a real agent. [`World::kill_agent`] plays an agent that
//!   dies (its connections close, its socket goes, its process is killed).
//!
//! Two drivers of one world (one per node) see the same sandboxes: a test plays a node's restart
//! by making a second node over the same data directory and store with the same world.
//!
//! The fake agent runs commands by a tiny interpretation of their words (a shell line is split at
//! blanks; nothing of a shell is run):
//! - `true` exits 0, `false` 1, `exit N` with N;
//! - `echo WORDS…` writes the words and a newline to stdout, `echo-err WORDS…` to stderr;
//! - `sleep S` ends after S seconds (a fraction is fine);
//! - `cat` copies its stdin to stdout until stdin is closed;
//! - `gate NAME` exits 0 when the world's gate NAME is open ([`World::open_gate`]), else 1;
//! - `await NAME [N]` runs until gate NAME opens, then exits with N (0);
//! - anything else exits 127, `sbx: WORD: command not found` on stderr.
//!
//! A command's `timeout_ms` ends it `timed_out` (SIGKILL); a signal that would end a process
//! ends it `killed`. A user other than `root`, `0`, `user` and `1000` is refused
//! (`no_such_user`), a command id the agent knows is refused (`duplicate_id`). Output is kept
//! whole (no ring, no gaps); file operations are refused (`unsupported`); terminals are not
//! served (a `tty` command runs as any other).

use std::collections::{HashMap, HashSet};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sbx_proto::{
    read_frame, AgentMsg, ExecFailKind, ExecSpec, ExecState, ExitInfo, ExitStatus, Frame,
    FsErrorCode, FsFailure, HostMsg, OutputCounts, Program, Stream, PROTO_VERSION,
};
use sbx_runtime::process::PidFd;
use sbx_runtime::{Driver, RuntimeError, Sandbox, SandboxSpec};
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;

use sbx_api::{ApiError, SandboxObject};

use super::{Node, NodeConfig};
use crate::image::{ImageMeta, ImageStore};
use crate::store::Store;
use crate::sync::LockExt;

/// How long the process that stands for an agent lives if nothing ends it (a test that panics
/// leaves it behind at most this long).
const AGENT_PROCESS_SECS: &str = "300";

/// The users the fake agent knows.
const USERS: [&str; 4] = ["root", "0", "user", "1000"];

/// Tasks of one agent: ended all at once when it dies.
#[derive(Default)]
struct Tasks {
    dead: bool,
    handles: Vec<AbortHandle>,
}

type SharedTasks = Arc<Mutex<Tasks>>;

/// Spawns a task of the agent of `tasks` (on the runtime of the caller: the world's).
fn spawn_in<F>(tasks: &SharedTasks, fut: F)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    track(tasks, tokio::spawn(fut).abort_handle());
}

fn track(tasks: &SharedTasks, h: AbortHandle) {
    let mut t = tasks.locked();
    if t.dead {
        // Spawned while the agent was being killed: it dies with it.
        h.abort();
    } else {
        t.handles.retain(|h| !h.is_finished());
        t.handles.push(h);
    }
}

/// A fake agent as the world keeps it.
struct AgentProc {
    pid: u32,
    /// The process that stands for the agent.
    process: PidFd,
    tasks: SharedTasks,
    socket: PathBuf,
}

impl AgentProc {
    fn alive(&self) -> bool {
        !self.tasks.locked().dead && !self.process.has_exited()
    }

    /// Ends the agent: no new connection, every connection closed, its process killed (and
    /// reaped).
    fn kill(&self) {
        let _ = std::fs::remove_file(&self.socket);
        {
            let mut t = self.tasks.locked();
            t.dead = true;
            for h in t.handles.drain(..) {
                h.abort();
            }
        }
        let _ = self.process.signal(libc::SIGKILL);
        self.process.wait_exit(Duration::from_secs(5));
    }
}

/// What the fake sandboxes share across the nodes of a test: their agents, the gates their
/// commands wait on, and counts of the driver's calls.
pub struct World {
    rt: Option<tokio::runtime::Runtime>,
    agents: Mutex<HashMap<String, AgentProc>>,
    gates: watch::Sender<HashSet<String>>,
    creates: AtomicUsize,
    destroys: AtomicUsize,
    adopts: AtomicUsize,
    leftovers: AtomicUsize,
    fail_creates: AtomicUsize,
    /// Ids of the sandboxes made as a run's own (`SandboxSpec::scratch`).
    scratch: Mutex<HashSet<String>>,
}

impl World {
    pub fn new() -> Arc<World> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("fake-agents")
            .enable_all()
            .build()
            .expect("the fake agents' runtime");
        Arc::new(World {
            rt: Some(rt),
            agents: Mutex::new(HashMap::new()),
            gates: watch::channel(HashSet::new()).0,
            creates: AtomicUsize::new(0),
            destroys: AtomicUsize::new(0),
            adopts: AtomicUsize::new(0),
            leftovers: AtomicUsize::new(0),
            fail_creates: AtomicUsize::new(0),
            scratch: Mutex::new(HashSet::new()),
        })
    }

    /// Sandboxes the driver was asked to make (failed ones too).
    pub fn creates(&self) -> usize {
        self.creates.load(Ordering::SeqCst)
    }

    /// Whether sandbox `id` was made as a run's own (`SandboxSpec::scratch`).
    pub fn made_scratch(&self, id: &str) -> bool {
        self.scratch.locked().contains(id)
    }

    /// Sandboxes the driver was asked to end.
    pub fn destroys(&self) -> usize {
        self.destroys.load(Ordering::SeqCst)
    }

    /// Adoptions the driver was asked for (found or not).
    pub fn adopts(&self) -> usize {
        self.adopts.load(Ordering::SeqCst)
    }

    /// Leftovers the driver was asked to remove.
    pub fn leftovers(&self) -> usize {
        self.leftovers.load(Ordering::SeqCst)
    }

    /// The next `n` creates fail (as a sandbox that does not start).
    pub fn fail_next_creates(&self, n: usize) {
        self.fail_creates.store(n, Ordering::SeqCst);
    }

    /// Opens gate `name`: `gate NAME` exits 0 from now on, `await NAME` ends.
    pub fn open_gate(&self, name: &str) {
        self.gates.send_modify(|g| {
            g.insert(name.to_string());
        });
    }

    /// Ids of the sandboxes whose agents run now.
    pub fn alive(&self) -> HashSet<String> {
        self.agents
            .locked()
            .iter()
            .filter(|(_, a)| a.alive())
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Plays the death of sandbox `id`'s agent (killed from outside the node). False when it
    /// has none.
    pub fn kill_agent(&self, id: &str) -> bool {
        let agents = self.agents.locked();
        match agents.get(id) {
            Some(a) => {
                a.kill();
                true
            }
            None => false,
        }
    }

    fn handle(&self) -> &tokio::runtime::Handle {
        self.rt.as_ref().expect("the fake agents' runtime").handle()
    }
}

impl Drop for World {
    fn drop(&mut self) {
        for (_, a) in self.agents.locked().drain() {
            a.kill();
        }
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// The driver of a node in a [`World`].
pub struct FakeDriver {
    world: Arc<World>,
}

impl FakeDriver {
    pub fn new(world: Arc<World>) -> FakeDriver {
        FakeDriver { world }
    }
}

fn io_err(what: &str) -> impl FnOnce(std::io::Error) -> RuntimeError + '_ {
    move |source| RuntimeError::Io {
        what: what.to_string(),
        source,
    }
}

impl Driver for FakeDriver {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn create(&self, spec: &SandboxSpec) -> Result<Sandbox, RuntimeError> {
        let w = &self.world;
        w.creates.fetch_add(1, Ordering::SeqCst);
        if spec.scratch {
            w.scratch.locked().insert(spec.id.clone());
        }
        // Made first: as the namespace driver, a sandbox that does not start leaves its
        // directory to the caller.
        std::fs::create_dir_all(&spec.dir).map_err(io_err("mkdir"))?;
        let fail = w
            .fail_creates
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if fail.is_ok() {
            return Err(RuntimeError::Start(
                "the fake driver was told to fail".into(),
            ));
        }
        let socket = spec.dir.join("agent.sock");
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket).map_err(io_err("bind the agent's socket"))?;
        listener
            .set_nonblocking(true)
            .map_err(io_err("the agent's socket"))?;
        let child = std::process::Command::new("sleep")
            .arg(AGENT_PROCESS_SECS)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(io_err("start the agent's process"))?;
        // Not waited for here: it is reaped through its pidfd when it ends.
        let pid = child.id();
        drop(child);
        let process = PidFd::open(pid).map_err(io_err("pidfd"))?;
        let sandbox = Sandbox::for_process(&spec.id, pid, &spec.dir).map_err(io_err("pidfd"))?;
        let tasks = SharedTasks::default();
        let agent = Arc::new(Agent {
            execs: Mutex::new(Vec::new()),
            next_pid: AtomicU32::new(2),
            gates: w.gates.subscribe(),
            tasks: tasks.clone(),
        });
        track(
            &tasks,
            w.handle().spawn(serve(listener, agent)).abort_handle(),
        );
        let old = w.agents.locked().insert(
            spec.id.clone(),
            AgentProc {
                pid,
                process,
                tasks,
                socket,
            },
        );
        if let Some(old) = old {
            // A sandbox made again under its id (a restart) after its agent was ended.
            old.kill();
        }
        Ok(sandbox)
    }

    fn destroy(&self, sandbox: &Sandbox) -> Result<(), RuntimeError> {
        self.world.destroys.fetch_add(1, Ordering::SeqCst);
        let mut agents = self.world.agents.locked();
        if agents
            .get(&sandbox.id)
            .is_some_and(|a| a.pid == sandbox.pid)
        {
            if let Some(a) = agents.remove(&sandbox.id) {
                a.kill();
            }
        }
        Ok(())
    }

    fn adopt(&self, id: &str, dir: &Path, pid: u32, start_time: Option<u64>) -> Option<Sandbox> {
        self.world.adopts.fetch_add(1, Ordering::SeqCst);
        let agents = self.world.agents.locked();
        let a = agents.get(id).filter(|a| a.pid == pid && a.alive())?;
        let sb = Sandbox::for_process(id, a.pid, dir).ok()?;
        if start_time.is_some() && sb.start_time != start_time {
            return None;
        }
        Some(sb)
    }

    fn remove_leftovers(&self, id: &str) -> Result<(), RuntimeError> {
        self.world.leftovers.fetch_add(1, Ordering::SeqCst);
        if let Some(a) = self.world.agents.locked().remove(id) {
            a.kill();
        }
        Ok(())
    }

    fn list_groups(&self) -> Vec<String> {
        self.world.agents.locked().keys().cloned().collect()
    }
}

// ---- The fake agent ----

/// One sandbox's agent: the commands it knows.
struct Agent {
    execs: Mutex<Vec<Arc<Exec>>>,
    next_pid: AtomicU32,
    gates: watch::Receiver<HashSet<String>>,
    tasks: SharedTasks,
}

#[derive(Default)]
struct ExecSt {
    /// Output as written: position, stream, bytes (kept whole).
    chunks: Vec<(u64, Stream, Vec<u8>)>,
    end: u64,
    stdout_bytes: u64,
    stderr_bytes: u64,
    exit: Option<ExitInfo>,
}

/// A command of the fake agent.
struct Exec {
    id: String,
    pid: u32,
    started_at_ns: i64,
    started: Instant,
    st: Mutex<ExecSt>,
    /// Bumped at every change (output, end).
    notify: watch::Sender<u64>,
    stdin: Mutex<Option<mpsc::UnboundedSender<Vec<u8>>>>,
    /// A signal sent to it.
    signal: watch::Sender<Option<i32>>,
}

impl Exec {
    fn push(&self, stream: Stream, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        {
            let mut st = self.st.locked();
            let pos = st.end;
            st.chunks.push((pos, stream, data.to_vec()));
            st.end += data.len() as u64;
            match stream {
                Stream::Stdout => st.stdout_bytes += data.len() as u64,
                Stream::Stderr => st.stderr_bytes += data.len() as u64,
                _ => {}
            }
        }
        self.notify.send_modify(|v| *v += 1);
    }

    fn finish(&self, status: ExitStatus, exit_code: i32, signal: Option<i32>) {
        {
            let mut st = self.st.locked();
            if st.exit.is_some() {
                return;
            }
            st.exit = Some(ExitInfo {
                status,
                exit_code,
                signal,
                duration_ns: self.started.elapsed().as_nanos() as u64,
                cpu_ns: 0,
                max_rss_bytes: 0,
            });
        }
        self.stdin.locked().take();
        self.notify.send_modify(|v| *v += 1);
    }

    fn exit(&self) -> Option<ExitInfo> {
        self.st.locked().exit.clone()
    }

    fn counts(&self) -> OutputCounts {
        let st = self.st.locked();
        OutputCounts {
            stdout_bytes: st.stdout_bytes,
            stderr_bytes: st.stderr_bytes,
            start: 0,
            end: st.end,
        }
    }

    fn snapshot(&self) -> ExecState {
        ExecState {
            exec_id: self.id.clone(),
            pid: self.pid,
            started_at_ns: self.started_at_ns,
            exit: self.exit(),
            output: self.counts(),
            failed: None,
        }
    }
}

type Out = mpsc::Sender<Vec<u8>>;

async fn send(out: &Out, msg: &AgentMsg) -> bool {
    match sbx_proto::encode_msg(msg) {
        Ok(buf) => out.send(buf).await.is_ok(),
        Err(_) => false,
    }
}

async fn serve(listener: UnixListener, agent: Arc<Agent>) {
    let Ok(listener) = tokio::net::UnixListener::from_std(listener) else {
        return;
    };
    loop {
        match listener.accept().await {
            Ok((stream, _)) => spawn_in(&agent.tasks, connection(agent.clone(), stream)),
            Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
}

async fn connection(agent: Arc<Agent>, stream: tokio::net::UnixStream) {
    let (rd, mut wr) = stream.into_split();
    let (out, mut rx) = mpsc::channel::<Vec<u8>>(256);
    spawn_in(&agent.tasks, async move {
        while let Some(buf) = rx.recv().await {
            if wr.write_all(&buf).await.is_err() {
                break;
            }
        }
    });
    let hello = AgentMsg::Hello {
        version: PROTO_VERSION,
        agent: "sbx-agent (fake)".into(),
        features: vec![
            sbx_proto::FEATURE_FS.into(),
            sbx_proto::FEATURE_STDIN_NULL.into(),
        ],
    };
    if !send(&out, &hello).await {
        return;
    }
    let mut rd = tokio::io::BufReader::new(rd);
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
                if let Some(e) = agent.find(&exec_id) {
                    if let Some(tx) = e.stdin.locked().as_ref() {
                        let _ = tx.send(bytes);
                    }
                }
            }
            Frame::Data { .. } => {}
            Frame::Msg(msg) => handle(&agent, &out, msg).await,
        }
    }
}

impl Agent {
    fn find(&self, id: &str) -> Option<Arc<Exec>> {
        self.execs.locked().iter().find(|e| e.id == id).cloned()
    }
}

async fn no_such_exec(out: &Out, exec_id: String) {
    let msg = AgentMsg::ExecFailed {
        message: format!("no command {exec_id}"),
        exec_id,
        kind: ExecFailKind::NoSuchExec,
    };
    send(out, &msg).await;
}

async fn handle(agent: &Arc<Agent>, out: &Out, msg: HostMsg) {
    match msg {
        HostMsg::Exec(spec) => {
            let id = spec.exec_id.clone();
            let refused = if agent.find(&id).is_some() {
                Some((ExecFailKind::DuplicateId, format!("{id} exists")))
            } else if spec.user.as_deref().is_some_and(|u| !USERS.contains(&u)) {
                let u = spec.user.clone().unwrap_or_default();
                Some((
                    ExecFailKind::NoSuchUser,
                    format!("{u} is not a user of the sandbox"),
                ))
            } else {
                None
            };
            if let Some((kind, message)) = refused {
                let msg = AgentMsg::ExecFailed {
                    exec_id: id,
                    kind,
                    message,
                };
                send(out, &msg).await;
                return;
            }
            let attach = spec.attach;
            let e = start(agent, spec);
            let started = AgentMsg::Started {
                exec_id: id,
                pid: e.pid,
                started_at_ns: e.started_at_ns,
                failed: None,
            };
            if attach {
                spawn_in(
                    &agent.tasks,
                    stream_output(out.clone(), e, 0, Some(started)),
                );
            } else {
                send(out, &started).await;
            }
        }
        HostMsg::CloseStdin { exec_id } => match agent.find(&exec_id) {
            Some(e) => {
                e.stdin.locked().take();
            }
            None => no_such_exec(out, exec_id).await,
        },
        HostMsg::Signal { exec_id, signal } => match agent.find(&exec_id) {
            Some(e) => {
                e.signal.send_replace(Some(signal));
            }
            None => no_such_exec(out, exec_id).await,
        },
        HostMsg::Attach { exec_id, from } => match agent.find(&exec_id) {
            Some(e) => spawn_in(&agent.tasks, stream_output(out.clone(), e, from, None)),
            None => no_such_exec(out, exec_id).await,
        },
        HostMsg::Status { exec_id } => match agent.find(&exec_id) {
            Some(e) => {
                send(out, &AgentMsg::State(e.snapshot())).await;
            }
            None => no_such_exec(out, exec_id).await,
        },
        HostMsg::Wait { exec_id } => match agent.find(&exec_id) {
            Some(e) => {
                let out = out.clone();
                spawn_in(&agent.tasks, async move {
                    let mut changed = e.notify.subscribe();
                    while e.exit().is_none() {
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
            let mut execs: Vec<Arc<Exec>> = agent.execs.locked().clone();
            execs.sort_by_key(|e| (e.started_at_ns, e.id.clone()));
            let execs = execs.iter().map(|e| e.snapshot()).collect();
            send(out, &AgentMsg::Execs { execs }).await;
        }
        HostMsg::Resize { exec_id, .. } => {
            if agent.find(&exec_id).is_none() {
                no_such_exec(out, exec_id).await;
            }
        }
        HostMsg::Sync { token } => {
            send(out, &AgentMsg::Synced { token }).await;
        }
        HostMsg::SetDumpable { dumpable } => {
            send(out, &AgentMsg::Dumpable { dumpable }).await;
        }
        // The fake's hello claims no lease watchdog; an agent without one is sent none.
        HostMsg::Lease { .. } => {
            send(out, &AgentMsg::Leased { stopped: false }).await;
        }
        // The fake's hello claims no awake socket; answer as an agent without one.
        HostMsg::Awake { .. } => {
            let held = AgentMsg::Awake {
                holds: 0,
                connected: 0,
                lowered_ms_ago: None,
            };
            send(out, &held).await;
        }
        HostMsg::Fs { id, .. } => {
            let error = FsFailure::new(
                FsErrorCode::Unsupported,
                "the fake agent serves no file operations",
            );
            send(out, &AgentMsg::FsError { id, error }).await;
        }
        HostMsg::FsEnd { .. } => {}
        HostMsg::Watch { id, .. } => {
            let error = Some(FsFailure::new(
                FsErrorCode::Unsupported,
                "the fake agent watches nothing",
            ));
            send(out, &AgentMsg::WatchEnded { id, error }).await;
        }
        HostMsg::Unwatch { .. } => {}
    }
}

/// Starts a command: recorded at once, run by a task of the agent.
fn start(agent: &Arc<Agent>, spec: ExecSpec) -> Arc<Exec> {
    let words: Vec<String> = match &spec.program {
        Program::Shell(line) => line.split_whitespace().map(String::from).collect(),
        Program::Argv(a) => a.clone(),
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let no_stdin = spec.stdin_null && !spec.stdin_open;
    let e = Arc::new(Exec {
        id: spec.exec_id.clone(),
        pid: agent.next_pid.fetch_add(1, Ordering::SeqCst),
        started_at_ns: crate::image::now_ns() as i64,
        started: Instant::now(),
        st: Mutex::new(ExecSt::default()),
        notify: watch::channel(0).0,
        stdin: Mutex::new((!no_stdin).then_some(tx)),
        signal: watch::channel(None).0,
    });
    agent.execs.locked().push(e.clone());
    let gates = agent.gates.clone();
    spawn_in(
        &agent.tasks,
        run_command(e.clone(), words, spec.timeout_ms, rx, gates),
    );
    e
}

/// Whether a signal ends a process that does not handle it (SIGCHLD, SIGCONT, SIGURG and
/// SIGWINCH are ignored by default; 0 sends nothing).
fn ends_process(sig: i32) -> bool {
    sig > 0 && ![libc::SIGCHLD, libc::SIGCONT, libc::SIGURG, libc::SIGWINCH].contains(&sig)
}

async fn run_command(
    e: Arc<Exec>,
    words: Vec<String>,
    timeout_ms: Option<u64>,
    stdin: mpsc::UnboundedReceiver<Vec<u8>>,
    gates: watch::Receiver<HashSet<String>>,
) {
    let mut signals = e.signal.subscribe();
    let deadline = async {
        match timeout_ms {
            Some(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
            None => std::future::pending().await,
        }
    };
    let signalled = async {
        let got = signals
            .wait_for(|s| s.is_some_and(ends_process))
            .await
            .map(|s| (*s).unwrap_or(libc::SIGKILL));
        match got {
            Ok(s) => s,
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        code = script(&e, &words, stdin, gates) => e.finish(ExitStatus::Exited, code, None),
        _ = deadline => e.finish(ExitStatus::TimedOut, 128 + libc::SIGKILL, Some(libc::SIGKILL)),
        sig = signalled => e.finish(ExitStatus::Killed, 128 + sig, Some(sig)),
    }
}

/// What a command does, by its words; its exit code.
async fn script(
    e: &Exec,
    words: &[String],
    mut stdin: mpsc::UnboundedReceiver<Vec<u8>>,
    mut gates: watch::Receiver<HashSet<String>>,
) -> i32 {
    let arg = |i: usize| words.get(i).map(String::as_str).unwrap_or("");
    match arg(0) {
        "true" => 0,
        "false" => 1,
        "exit" => arg(1).parse().unwrap_or(0),
        "echo" => {
            e.push(
                Stream::Stdout,
                format!("{}\n", words[1..].join(" ")).as_bytes(),
            );
            0
        }
        "echo-err" => {
            e.push(
                Stream::Stderr,
                format!("{}\n", words[1..].join(" ")).as_bytes(),
            );
            0
        }
        "sleep" => {
            let secs: f64 = arg(1).parse().unwrap_or(0.0);
            tokio::time::sleep(Duration::from_secs_f64(secs.max(0.0))).await;
            0
        }
        "cat" => {
            while let Some(data) = stdin.recv().await {
                e.push(Stream::Stdout, &data);
            }
            0
        }
        "gate" => i32::from(!gates.borrow().contains(arg(1))),
        "await" => {
            let name = arg(1).to_string();
            let _ = gates.wait_for(|g| g.contains(&name)).await;
            arg(2).parse().unwrap_or(0)
        }
        "" => {
            e.push(Stream::Stderr, b"sbx: empty command\n");
            127
        }
        other => {
            let msg = format!("sbx: {other}: command not found\n");
            e.push(Stream::Stderr, msg.as_bytes());
            127
        }
    }
}

/// Sends `started` (if given), then the command's output from `from` on, live, then its end.
async fn stream_output(out: Out, e: Arc<Exec>, from: u64, started: Option<AgentMsg>) {
    if let Some(started) = started {
        if !send(&out, &started).await {
            return;
        }
    }
    let mut changed = e.notify.subscribe();
    let mut cursor = from;
    loop {
        changed.borrow_and_update();
        let (frames, exit) = {
            let st = e.st.locked();
            let mut frames = Vec::new();
            for (pos, stream, bytes) in &st.chunks {
                let end = pos + bytes.len() as u64;
                if end <= cursor {
                    continue;
                }
                let skip = cursor.saturating_sub(*pos) as usize;
                let at = pos + skip as u64;
                frames.push(sbx_proto::encode_data(&e.id, *stream, at, &bytes[skip..]));
                cursor = end;
            }
            (frames, st.exit.clone())
        };
        if frames.is_empty() {
            if let Some(exit) = exit {
                let msg = AgentMsg::Exited {
                    exec_id: e.id.clone(),
                    exit,
                    output: e.counts(),
                };
                send(&out, &msg).await;
                return;
            }
            if changed.changed().await.is_err() {
                return;
            }
            continue;
        }
        for f in frames {
            if out.send(f).await.is_err() {
                return;
            }
        }
    }
}

// The harness of tests on the fake driver: a node over a directory of its own, as `main`
// makes one; for the node's own tests and for front ends' (feature `fake`).

/// A directory of its own for a test, removed when it ends.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "sbx-node-{tag}-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a test directory");
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const UID_BASE: u32 = 100_000;

pub const DEFAULT_MEMORY: u64 = 256 << 20;

fn config(dir: &Path) -> NodeConfig {
    NodeConfig {
        data_dir: dir.to_path_buf(),
        default_memory_bytes: DEFAULT_MEMORY,
        default_vcpus: 1,
        pids_max: 64,
        max_memory_bytes: 1 << 30,
        max_vcpus: 2,
        warm_pool: 0,
        warm_runs: 0,
        egress_default_deny: false,
        max_execs_per_sandbox: 4,
        image_allowlist: None,
        max_sandboxes: 16,
        min_free_disk_bytes: 0,
        sleep_after: None,
        suspend_after: Duration::from_secs(600),
        sleep_memory_below: 0,
    }
}

/// The node's image store with a base image that is its record alone (the fake driver mounts
/// nothing).
fn images(dir: &Path) -> ImageStore {
    let base = dir.join("images").join("base");
    std::fs::create_dir_all(base.join("rootfs")).expect("the base image's folder");
    let meta = ImageMeta {
        name: "base".into(),
        created_at: String::new(),
        env: Vec::new(),
        user: None,
        workdir: None,
        uid_base: UID_BASE,
        source: crate::image::base_source("fake"),
        start: Vec::new(),
        stop_signal: None,
        labels: Default::default(),
    };
    let json = serde_json::to_vec(&meta).expect("image.json");
    std::fs::write(base.join("image.json"), json).expect("the base image's record");
    ImageStore::with_insecure(dir.join("images"), UID_BASE, Vec::new())
}

/// A node over data directory `dir` whose sandboxes are `world`'s, as `main` makes one (its
/// store, node key and templates table in `dir`); `tweak` changes its settings.
pub fn node_in(dir: &Path, world: &Arc<World>, tweak: impl FnOnce(&mut NodeConfig)) -> Arc<Node> {
    let mut cfg = config(dir);
    tweak(&mut cfg);
    let store = Store::open(&dir.join("state.db")).expect("the state database");
    crate::node::credentials::init(dir, &store).expect("the node key");
    let templates = crate::node::templates::Templates::open(&store).expect("templates");
    let driver = Arc::new(FakeDriver::new(world.clone()));
    Node::builder(
        cfg,
        driver,
        images(dir),
        Arc::new(store),
        templates,
        Arc::new(NoProbes),
    )
    .build()
    .expect("the node")
}

/// `POST /v1/sandboxes` with `body`.
pub async fn create(node: &Arc<Node>, body: &str) -> Result<SandboxObject, ApiError> {
    let c = sbx_api::parse_sandbox_create(body.as_bytes()).expect("a valid create");
    node.create_sandbox(c).await
}

/// Waits (at most 3 s) until `done`.
pub async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !done() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "waited in vain: {what}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// The fake node's prober: a sandbox of the fake driver has no network namespace to try a
/// port in, so every check fails, saying so (its tests check ready commands).
pub struct NoProbes;

impl crate::probe::Prober for NoProbes {
    fn try_once<'a>(
        &'a self,
        check: &'a crate::probe::Probe,
        _ns: std::os::fd::OwnedFd,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = crate::probe::ProbeResult> + Send + 'a>>
    {
        Box::pin(async move {
            Err(format!(
                "port {}: the fake driver's sandboxes have no network",
                check.port()
            ))
        })
    }
}
