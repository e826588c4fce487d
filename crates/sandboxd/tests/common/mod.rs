//! The fixture of sandboxd's integration tests: a real node, on loopback, with its own data
//! directory and its own cgroup folder, making real sandboxes.
//!
//! Every node is started with `--cgroup-name sbx-test-<pid>-<n>`, so tests that run at the same
//! time (and a dev node on the machine) never see each other's sandboxes. [`TestNode::leftovers`]
//! lists what is left of the node's sandboxes on the host; dropping a node stops it and removes
//! everything it may have left, so that a failing test leaves nothing behind.

#![allow(dead_code)]

use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

/// The v1 controllers the node makes sandboxes' groups in.
const V1_CONTROLLERS: [&str; 4] = ["memory", "pids", "cpu", "freezer"];

static NEXT_NODE: AtomicUsize = AtomicUsize::new(0);
static BUILD_LOCK: Mutex<()> = Mutex::new(());

/// A unique name for files and markers: pid, a counter and the clock.
pub fn unique(prefix: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{prefix}-{}-{}-{nanos:x}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// The images directory the tests use: `SBX_TEST_IMAGES`, else the machine's.
pub fn images_dir() -> PathBuf {
    std::env::var_os("SBX_TEST_IMAGES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/sbx/images"))
}

pub fn sandboxd_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_sandboxd"))
}

fn agent_bin() -> PathBuf {
    let agent = sandboxd_bin().with_file_name("sbx-agent");
    if !agent.is_file() {
        panic!(
            "the sandbox agent is not built: {} is missing. Build it first with \
             `cargo build -p sbx-agent` (then run `cargo test -p sandboxd` again)",
            agent.display()
        );
    }
    agent
}

/// Makes sure the base image is there (builds it once, ~45 s, when it is not).
fn ensure_base_image(images: &Path) {
    if images.join("base/image.json").is_file() {
        return;
    }
    let _g = BUILD_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if images.join("base/image.json").is_file() {
        return;
    }
    eprintln!(
        "no base image in {}: building it (sandboxd build-base, about a minute)",
        images.display()
    );
    let status = Command::new(sandboxd_bin())
        .arg("--images-dir")
        .arg(images)
        .arg("build-base")
        .status()
        .expect("run sandboxd build-base");
    assert!(
        status.success(),
        "sandboxd build-base failed ({status}); build the base image by hand with \
         `target/debug/sandboxd --images-dir {} build-base`",
        images.display()
    );
}

/// Where the node's cgroup folders are: one per hierarchy, as the daemon finds them.
fn node_cgroup_dirs(name: &str) -> Vec<(String, PathBuf)> {
    let own = fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let own: Vec<(String, String)> = own
        .lines()
        .filter_map(|l| {
            let mut it = l.splitn(3, ':');
            let _ = it.next()?;
            Some((it.next()?.to_string(), it.next()?.to_string()))
        })
        .collect();
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    // (root, mount point, fstype, super options)
    let mounts: Vec<(String, PathBuf, String, Vec<String>)> = mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let l: Vec<&str> = left.split(' ').collect();
            let r: Vec<&str> = right.split(' ').collect();
            Some((
                l.get(3)?.to_string(),
                PathBuf::from(l.get(4)?),
                r.first()?.to_string(),
                r.get(2)?.split(',').map(String::from).collect(),
            ))
        })
        .collect();
    let mut v1 = Vec::new();
    for ctrl in V1_CONTROLLERS {
        let mount = mounts
            .iter()
            .find(|m| m.2 == "cgroup" && m.3.iter().any(|o| o == ctrl));
        let path = own
            .iter()
            .find(|(c, _)| c.split(',').any(|c| c == ctrl))
            .map(|(_, p)| p.clone());
        if let (Some(m), Some(p)) = (mount, path) {
            let rel = p.trim_start_matches('/');
            let root = m.0.trim_start_matches('/');
            let rel = rel
                .strip_prefix(root)
                .unwrap_or(rel)
                .trim_start_matches('/');
            v1.push((ctrl.to_string(), m.1.join(rel).join(name)));
        }
    }
    if v1.iter().any(|(c, _)| c == "memory") && v1.iter().any(|(c, _)| c == "pids") {
        return v1;
    }
    let Some(unified) = mounts.iter().find(|m| m.2 == "cgroup2") else {
        return Vec::new();
    };
    let path = own
        .iter()
        .find(|(c, _)| c.is_empty())
        .map(|(_, p)| p.clone())
        .unwrap_or_else(|| "/".into());
    vec![(
        "unified".into(),
        unified.1.join(path.trim_start_matches('/')).join(name),
    )]
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind a free port on loopback");
    l.local_addr().expect("local addr").port()
}

fn send_signal(pid: u32, sig: i32) {
    // SAFETY: kill has no memory effects; an error (the process is gone) is ignored.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// The pids of processes whose cgroup path has the folder `name` in it, with their lines.
fn processes_in(name: &str) -> Vec<(u32, String)> {
    let me = std::process::id();
    let mut out = Vec::new();
    let Ok(rd) = fs::read_dir("/proc") else {
        return out;
    };
    let inner = format!("/{name}/");
    let last = format!("/{name}");
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(cg) = fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
            continue;
        };
        if let Some(line) = cg
            .lines()
            .find(|l| l.contains(&inner) || l.ends_with(&last))
        {
            out.push((pid, line.to_string()));
        }
    }
    out
}

fn comm(pid: u32) -> String {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

fn subdirs(dir: &Path) -> Vec<PathBuf> {
    fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default()
}

/// One server-sent event.
#[derive(Debug, Clone)]
pub struct Event {
    pub event: String,
    pub id: u64,
    pub data: Value,
}

/// An answer, whatever its status.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "the answer ({}) is not JSON: {e}: {}",
                self.status,
                truncate(&self.text(), 2000)
            )
        })
    }
}

pub fn truncate(s: &str, n: usize) -> String {
    if s.len() <= n {
        return s.to_string();
    }
    let mut cut = n;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}… ({} bytes)", &s[..cut], s.len())
}

/// An event stream being read, event by event. Dropping it hangs up.
pub struct SseStream {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    reader: BufReader<Box<dyn Read + Send + Sync + 'static>>,
}

impl SseStream {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The next event; `None` at the end of the stream.
    pub fn next_event(&mut self) -> Option<Event> {
        let mut event = String::new();
        let mut id = None;
        let mut data: Vec<String> = Vec::new();
        let mut seen = false;
        loop {
            let mut line = String::new();
            let n = self
                .reader
                .read_line(&mut line)
                .expect("read the event stream");
            if n == 0 {
                assert!(!seen, "the stream ended inside an event");
                return None;
            }
            let line = line.trim_end_matches('\n').trim_end_matches('\r');
            if line.is_empty() {
                if seen {
                    let text = data.join("\n");
                    let data = serde_json::from_str(&text)
                        .unwrap_or_else(|e| panic!("event {event}: data is not JSON: {e}: {text}"));
                    let id = id.unwrap_or_else(|| panic!("event {event} has no id"));
                    return Some(Event { event, id, data });
                }
                continue;
            }
            if line.starts_with(':') {
                continue;
            }
            seen = true;
            let (field, value) = line.split_once(':').unwrap_or((line, ""));
            let value = value.strip_prefix(' ').unwrap_or(value);
            match field {
                "event" => event = value.to_string(),
                "id" => {
                    id = Some(
                        value
                            .parse()
                            .unwrap_or_else(|_| panic!("event id {value:?} is not a number")),
                    )
                }
                "data" => data.push(value.to_string()),
                other => panic!("unexpected field {other:?} in the event stream"),
            }
        }
    }

    /// Every event to the end of the stream.
    pub fn rest(&mut self) -> Vec<Event> {
        let mut out = Vec::new();
        while let Some(e) = self.next_event() {
            out.push(e);
        }
        out
    }
}

/// A sandboxd node made for a test.
pub struct TestNode {
    child: Option<Child>,
    pub addr: String,
    pub root: PathBuf,
    pub data_dir: PathBuf,
    pub images_dir: PathBuf,
    pub cgroup_name: String,
    cgroup_dirs: Vec<(String, PathBuf)>,
    log: PathBuf,
    http: ureq::Agent,
    agent: PathBuf,
    args: Vec<String>,
    /// An `Authorization` value the fixture's own calls (`warm_ids`) send.
    pub auth: Option<String>,
}

impl TestNode {
    /// A node with the defaults of the tests.
    pub fn start() -> TestNode {
        TestNode::start_with(&[])
    }

    /// A node with more arguments (`--api-keys FILE`, `--docs-url URL`, ...).
    pub fn start_with(args: &[&str]) -> TestNode {
        TestNode::start_opts(args, false)
    }

    /// A node with an images directory of its own (`<root>/images`, removed with the node):
    /// the machine's base image (a symlink to it) and an OCI store no other node uses.
    pub fn start_private_images(args: &[&str]) -> TestNode {
        TestNode::start_opts(args, true)
    }

    fn start_opts(args: &[&str], private_images: bool) -> TestNode {
        let agent = agent_bin();
        let shared = images_dir();
        ensure_base_image(&shared);
        let n = NEXT_NODE.fetch_add(1, Ordering::SeqCst);
        let pid = std::process::id();
        let cgroup_name = format!("sbx-test-{pid}-{n}");
        let root = std::env::temp_dir().join(format!("sbx-test-{pid}-{n}"));
        let _ = fs::remove_dir_all(&root);
        let data_dir = root.join("data");
        fs::create_dir_all(&data_dir).expect("make the node's data directory");
        let images = if private_images {
            let own = root.join("images");
            fs::create_dir_all(&own).expect("make the node's images directory");
            std::os::unix::fs::symlink(shared.join("base"), own.join("base"))
                .expect("link the base image");
            own
        } else {
            shared
        };
        let log = root.join("node.log");
        let http = ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_secs(5))
            .timeout_read(Duration::from_secs(120))
            .timeout_write(Duration::from_secs(120))
            .build();
        let mut node = TestNode {
            child: None,
            addr: String::new(),
            root,
            data_dir,
            images_dir: images,
            cgroup_dirs: node_cgroup_dirs(&cgroup_name),
            cgroup_name,
            log,
            http,
            agent,
            args: args.iter().map(|a| a.to_string()).collect(),
            auth: None,
        };
        assert!(
            !node.cgroup_dirs.is_empty(),
            "found no cgroup hierarchy with memory and pids"
        );
        // A port picked here may be taken before the node binds it: try again then.
        for attempt in 0..3 {
            node.addr = format!("127.0.0.1:{}", free_port());
            match node.spawn() {
                Ok(()) => return node,
                Err(e) if attempt < 2 && node.log_text().contains("listen on") => {
                    eprintln!("sandboxd did not start ({e}); trying another port");
                    node.stop();
                }
                Err(e) => panic!("sandboxd did not start: {e}\n{}", node.log_tail(60)),
            }
        }
        unreachable!()
    }

    /// Starts the daemon with this node's settings and waits for it to be healthy.
    fn spawn(&mut self) -> Result<(), String> {
        let logfile = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("open the node's log");
        let child = Command::new(sandboxd_bin())
            .arg("--listen")
            .arg(&self.addr)
            .arg("--data-dir")
            .arg(&self.data_dir)
            .arg("--images-dir")
            .arg(&self.images_dir)
            .arg("--agent")
            .arg(&self.agent)
            .arg("--cgroup-name")
            .arg(&self.cgroup_name)
            .arg("--pids-max")
            .arg("128")
            .args(&self.args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(logfile.try_clone().expect("log"))
            .stderr(logfile)
            .spawn()
            .expect("start sandboxd");
        self.child = Some(child);
        self.wait_healthy(Duration::from_secs(20))
    }

    /// Kills the daemon with SIGKILL: its sandboxes are left as they are.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the daemon again (after [`TestNode::kill`] or [`TestNode::stop`]) with the same
    /// data directory, cgroup folder and address.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "the node still runs");
        if let Err(e) = self.spawn() {
            panic!("sandboxd did not start again: {e}\n{}", self.log_tail(60));
        }
    }

    fn wait_healthy(&mut self, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    return Err(format!("sandboxd exited with {status}"));
                }
            }
            if let Ok(r) = self.http.get(&self.url("/healthz")).call() {
                if r.status() == 200 {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                return Err(format!("GET /healthz did not answer in {timeout:?}"));
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// The node's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn log_tail(&self, lines: usize) -> String {
        let text = self.log_text();
        let all: Vec<&str> = text.lines().collect();
        let from = all.len().saturating_sub(lines);
        format!(
            "--- last lines of the node's log ({}) ---\n{}",
            self.log.display(),
            all[from..].join("\n")
        )
    }

    /// The node's folder in a hierarchy (`memory`, `pids`, ...), where sandboxes' groups go.
    pub fn cgroup_dir(&self, controller: &str) -> Option<PathBuf> {
        self.cgroup_dirs
            .iter()
            .find(|(c, _)| c == controller || c == "unified")
            .map(|(_, d)| d.clone())
    }

    /// A sandbox's directory on the host.
    pub fn sandbox_dir(&self, sandbox_id: &str) -> PathBuf {
        self.data_dir.join("sandboxes").join(sandbox_id)
    }

    fn finish(&self, result: Result<ureq::Response, ureq::Error>) -> Reply {
        let resp = match result {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("request to the node failed: {e}\n{}", self.log_tail(30)),
        };
        let status = resp.status();
        let headers = resp
            .headers_names()
            .into_iter()
            .filter_map(|n| resp.header(&n).map(|v| (n.clone(), v.to_string())))
            .collect();
        let mut body = Vec::new();
        resp.into_reader()
            .read_to_end(&mut body)
            .expect("read the answer's body");
        Reply {
            status,
            headers,
            body,
        }
    }

    /// POST of raw bytes with headers.
    pub fn post(&self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
        let mut req = self
            .http
            .post(&self.url(path))
            .set("Content-Type", "application/json");
        for (k, v) in headers {
            req = req.set(k, v);
        }
        self.finish(req.send_bytes(body))
    }

    pub fn get(&self, path: &str, headers: &[(&str, &str)]) -> Reply {
        let mut req = self.http.get(&self.url(path));
        for (k, v) in headers {
            req = req.set(k, v);
        }
        self.finish(req.call())
    }

    /// `POST /v1/run` with headers; the whole answer.
    pub fn run_with(&self, body: &Value, headers: &[(&str, &str)]) -> Reply {
        self.post("/v1/run", headers, &serde_json::to_vec(body).unwrap())
    }

    /// `POST /v1/run`, answered as JSON: the status and the body.
    pub fn run(&self, body: &Value) -> (u16, Value) {
        let r = self.run_with(body, &[]);
        let v = r.json();
        (r.status, v)
    }

    /// `POST /v1/run` that must end with 200: the exec object.
    pub fn run_ok(&self, body: &Value) -> Value {
        let (status, v) = self.run(body);
        assert_eq!(status, 200, "run {body} answered {status}: {v}");
        assert_eq!(v["object"], "exec", "not an exec object: {v}");
        v
    }

    /// Opens a run as an event stream (`Accept: text/event-stream`), to read event by event.
    pub fn open_sse_with(&self, body: &Value, headers: &[(&str, &str)]) -> SseStream {
        let mut req = self
            .http
            .post(&self.url("/v1/run"))
            .set("Content-Type", "application/json")
            .set("Accept", "text/event-stream");
        for (k, v) in headers {
            req = req.set(k, v);
        }
        let sent = req.send_bytes(&serde_json::to_vec(body).unwrap());
        self.event_stream(&format!("run {body}"), sent)
    }

    pub fn open_sse(&self, body: &Value) -> SseStream {
        self.open_sse_with(body, &[])
    }

    /// A run as an event stream, read to its end.
    pub fn run_sse(&self, body: &Value) -> Vec<Event> {
        self.open_sse(body).rest()
    }

    /// What is left on the host of this node's sandboxes: their directories, cgroups, mounts
    /// and processes. Empty when every sandbox is gone.
    /// Ids of the sandboxes the node keeps made ahead (its warm pool): they are the node's,
    /// not leftovers of a run. Empty when the node does not answer.
    pub fn warm_ids(&self) -> Vec<String> {
        if self.child.is_none() {
            return Vec::new();
        }
        let r = match &self.auth {
            Some(a) => self.get("/internal/node", &[("Authorization", a.as_str())]),
            None => self.get("/internal/node", &[]),
        };
        if r.status != 200 {
            return Vec::new();
        }
        r.json()["warm_pool"]["ready"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// What is left of runs' sandboxes: everything of the node's sandboxes but its warm pool.
    pub fn leftovers(&self) -> Vec<String> {
        let warm = self.warm_ids();
        let mut all = self.all_sandbox_traces();
        all.retain(|l| !warm.iter().any(|w| l.contains(w.as_str())));
        all
    }

    /// Everything of the node's sandboxes on the host, warm ones included.
    pub fn all_sandbox_traces(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Ok(rd) = fs::read_dir(self.data_dir.join("sandboxes")) {
            for e in rd.flatten() {
                out.push(format!("sandbox directory {}", e.path().display()));
            }
        }
        for (_, dir) in &self.cgroup_dirs {
            for d in subdirs(dir) {
                out.push(format!("cgroup {}", d.display()));
            }
        }
        let data = self.data_dir.to_string_lossy().into_owned();
        // The node's own nosuid view of its sandboxes' directory is not a sandbox's.
        let own = format!(" {}/sandboxes ", data);
        if let Ok(mounts) = fs::read_to_string("/proc/mounts") {
            for l in mounts
                .lines()
                .filter(|l| l.contains(&data) && !l.contains(&own))
            {
                out.push(format!("mount {l}"));
            }
        }
        for (pid, line) in processes_in(&self.cgroup_name) {
            out.push(format!("process {pid} ({}) in {line}", comm(pid)));
        }
        out
    }

    /// Polls [`TestNode::leftovers`] until it is empty or `timeout` is up; what is left then.
    pub fn wait_clean(&self, timeout: Duration) -> Vec<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = self.leftovers();
            if left.is_empty() || Instant::now() > deadline {
                return left;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Asserts that nothing of the node's sandboxes is left within `timeout`.
    pub fn assert_clean(&self, timeout: Duration) {
        let left = self.wait_clean(timeout);
        assert!(
            left.is_empty(),
            "left on the host after {timeout:?}:\n  {}\n{}",
            left.join("\n  "),
            self.log_tail(20)
        );
    }

    /// Stops the node: SIGTERM, up to 10 s, then SIGKILL. Its exit status (None if it was not
    /// running).
    pub fn stop(&mut self) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        send_signal(child.id(), libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(s)) = child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("sandboxd did not stop in 10 s after SIGTERM: killing it");
        let _ = child.kill();
        child.wait().ok()
    }

    /// Removes whatever is left of the node's sandboxes (after the node is stopped).
    fn force_clean(&self) {
        let dirs: Vec<PathBuf> = self.cgroup_dirs.iter().map(|(_, d)| d.clone()).collect();
        for _ in 0..250 {
            let mut busy = false;
            for (pid, _) in processes_in(&self.cgroup_name) {
                send_signal(pid, libc::SIGKILL);
                busy = true;
            }
            for dir in &dirs {
                for sub in subdirs(dir) {
                    let procs = fs::read_to_string(sub.join("cgroup.procs")).unwrap_or_default();
                    for pid in procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
                        send_signal(pid, libc::SIGKILL);
                    }
                    if fs::remove_dir(&sub).is_err() {
                        busy = true;
                    }
                }
            }
            if !busy {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        for dir in &dirs {
            let _ = fs::remove_dir(dir);
        }
        let data = self.data_dir.to_string_lossy().into_owned();
        if let Ok(mounts) = fs::read_to_string("/proc/mounts") {
            let mut points: Vec<&str> = mounts
                .lines()
                .filter_map(|l| l.split(' ').nth(1))
                .filter(|p| p.contains(&data))
                .collect();
            points.reverse();
            for p in points {
                if let Ok(c) = std::ffi::CString::new(p) {
                    // SAFETY: umount2 reads the NUL-terminated path, which lives for the call.
                    unsafe {
                        libc::umount2(c.as_ptr(), libc::MNT_DETACH);
                    }
                }
            }
        }
    }
}

impl Drop for TestNode {
    fn drop(&mut self) {
        let failing = std::thread::panicking();
        self.stop();
        if failing {
            eprintln!("{}", self.log_tail(40));
        }
        self.force_clean();
        let _ = fs::remove_dir_all(&self.root);
    }
}

/// Checks an error answer: the status, and a body of exactly
/// `{error:{type,code,message,param,retryable,request_id,docs_url}}`.
pub fn assert_error(status: u16, body: &Value, want_status: u16, code: &str, param: Option<&str>) {
    assert_eq!(
        status, want_status,
        "expected {want_status} {code}, got {status}: {body}"
    );
    let top = body
        .as_object()
        .unwrap_or_else(|| panic!("error body is not an object: {body}"));
    // secret_host_not_allowed carries allowed_hosts beside error, as the spec says.
    let beside =
        usize::from(code == "secret_host_not_allowed" && top.contains_key("allowed_hosts"));
    assert_eq!(
        top.len() - beside,
        1,
        "error body has other keys than error: {body}"
    );
    let e = body["error"]
        .as_object()
        .unwrap_or_else(|| panic!("no error object: {body}"));
    let mut keys: Vec<&str> = e.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "code",
            "docs_url",
            "message",
            "param",
            "request_id",
            "retryable",
            "type"
        ],
        "error body keys: {body}"
    );
    assert_eq!(e["code"], code, "error code: {body}");
    let want_type = match want_status {
        400 | 405 | 415 | 416 => "invalid_request",
        401 => "unauthenticated",
        403 => "forbidden",
        404 => "not_found",
        409 => "conflict",
        413 => "too_large",
        500 => "internal",
        501 => "not_implemented",
        503 => "unavailable",
        504 => "timeout",
        _ => panic!("no error type for {want_status}"),
    };
    assert_eq!(e["type"], want_type, "error type: {body}");
    match param {
        Some(p) => assert_eq!(e["param"], p, "error param: {body}"),
        None => assert!(e["param"].is_null(), "error param should be null: {body}"),
    }
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "error message: {body}"
    );
    assert!(e["retryable"].is_boolean(), "retryable: {body}");
    assert!(
        e["request_id"].as_str().is_some_and(valid_request_id),
        "request_id: {body}"
    );
    assert!(
        e["docs_url"].is_null() || e["docs_url"].is_string(),
        "docs_url: {body}"
    );
}

/// `^[A-Za-z0-9._\-]{1,64}$`
pub fn valid_request_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
}

/// The spec's id shape: the prefix, `-` and 16 characters of the id alphabet.
pub fn is_id(prefix: &str, s: &str) -> bool {
    let Some(rest) = s.strip_prefix(prefix).and_then(|r| r.strip_prefix('-')) else {
        return false;
    };
    rest.len() == 16
        && rest
            .bytes()
            .all(|b| b"0123456789abcdefghjkmnpqrstvwxyz".contains(&b))
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64, padded.
pub fn b64_encode(data: &[u8]) -> String {
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(B64[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Standard base64 (padding optional).
pub fn b64_decode(s: &str) -> Vec<u8> {
    let mut out = Vec::new();
    let mut acc = 0u32;
    let mut bits = 0;
    for c in s.bytes().filter(|c| *c != b'=') {
        let v = B64
            .iter()
            .position(|x| *x == c)
            .unwrap_or_else(|| panic!("{c:?} is not base64")) as u32;
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    out
}

/// A raw HTTP/1.1 POST over a plain socket, for bodies a client library will not send whole:
/// the body is written from another thread while the answer is read.
pub fn raw_post(addr: &str, path: &str, body_len: usize, fill: u8) -> (u16, Value) {
    let mut sock = TcpStream::connect(addr).expect("connect to the node");
    sock.set_read_timeout(Some(Duration::from_secs(60))).ok();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {body_len}\r\nConnection: close\r\n\r\n"
    );
    sock.write_all(head.as_bytes()).expect("write the head");
    let mut writer = sock.try_clone().expect("clone the socket");
    let sender = std::thread::spawn(move || {
        let prefix = b"{\"command\":\"true\",\"stdin\":\"";
        let mut left = body_len;
        let first = &prefix[..prefix.len().min(left)];
        if writer.write_all(first).is_err() {
            return;
        }
        left -= first.len();
        let chunk = vec![fill; 1 << 20];
        while left > 0 {
            let n = left.min(chunk.len());
            if writer.write_all(&chunk[..n]).is_err() {
                return;
            }
            left -= n;
        }
    });
    let mut reader = BufReader::new(sock.try_clone().expect("clone the socket"));
    let mut status = 0u16;
    let mut content_length = None;
    loop {
        let mut line = String::new();
        let n = reader.read_line(&mut line).expect("read the answer");
        assert!(n > 0, "the node closed the connection without an answer");
        let line = line.trim_end();
        if line.is_empty() {
            if status == 100 {
                status = 0;
                continue;
            }
            break;
        }
        if let Some(rest) = line.strip_prefix("HTTP/1.1 ") {
            status = rest[..3].parse().expect("status code");
        } else if let Some((k, v)) = line.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                content_length = v.trim().parse::<usize>().ok();
            }
        }
    }
    let mut body = vec![0u8; content_length.expect("the answer has a Content-Length")];
    reader.read_exact(&mut body).expect("read the answer body");
    let _ = sock.shutdown(std::net::Shutdown::Both);
    let _ = sender.join();
    let v = serde_json::from_slice(&body).unwrap_or(Value::Null);
    (status, v)
}

// ---- Long-lived sandboxes (`/v1/sandboxes`) ----

impl TestNode {
    /// DELETE with headers; the whole answer.
    pub fn delete(&self, path: &str, headers: &[(&str, &str)]) -> Reply {
        let mut req = self.http.delete(&self.url(path));
        for (k, v) in headers {
            req = req.set(k, v);
        }
        self.finish(req.call())
    }

    /// POST of a JSON value; the whole answer.
    pub fn post_json(&self, path: &str, body: &Value) -> Reply {
        self.post(path, &[], &serde_json::to_vec(body).unwrap())
    }

    /// `POST /v1/sandboxes` that must answer 201 with a running sandbox: the sandbox object.
    pub fn create_sandbox(&self, body: &Value) -> Value {
        let r = self.post_json("/v1/sandboxes", body);
        let v = r.json();
        assert_eq!(r.status, 201, "create {body} answered {}: {v}", r.status);
        assert_eq!(v["object"], "sandbox", "not a sandbox object: {v}");
        assert_eq!(v["status"], "running", "create {body}: {v}");
        v
    }

    /// `DELETE /v1/sandboxes/{id}` that must answer 200 with the object, status deleted.
    pub fn delete_sandbox(&self, id: &str) -> Value {
        let r = self.delete(&format!("/v1/sandboxes/{id}"), &[]);
        let v = r.json();
        assert_eq!(r.status, 200, "delete {id} answered {}: {v}", r.status);
        assert_eq!(v["status"], "deleted", "delete {id}: {v}");
        v
    }

    /// `POST /v1/sandboxes/{id}/exec` that must answer 201: the exec object.
    pub fn exec(&self, sandbox: &str, body: &Value) -> Value {
        let r = self.post_json(&format!("/v1/sandboxes/{sandbox}/exec"), body);
        let v = r.json();
        assert_eq!(r.status, 201, "exec {body} answered {}: {v}", r.status);
        assert_eq!(v["object"], "exec", "not an exec object: {v}");
        v
    }

    /// `GET …/exec/{exec_id}?wait_seconds=…` until the command has ended (at most `timeout`):
    /// its final object.
    pub fn exec_wait(&self, sandbox: &str, exec_id: &str, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let r = self.get(
                &format!("/v1/sandboxes/{sandbox}/exec/{exec_id}?wait_seconds=10"),
                &[],
            );
            let v = r.json();
            assert_eq!(r.status, 200, "get {exec_id}: {v}");
            if v["status"] != "running" {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "{exec_id} still runs after {timeout:?}: {v}"
            );
        }
    }

    /// Opens a GET as an event stream (`Accept: text/event-stream`), to read event by event.
    pub fn open_sse_get(&self, path: &str, headers: &[(&str, &str)]) -> SseStream {
        let mut req = self
            .http
            .get(&self.url(path))
            .set("Accept", "text/event-stream");
        for (k, v) in headers {
            req = req.set(k, v);
        }
        self.event_stream(&format!("GET {path}"), req.call())
    }

    /// A command's whole output through the JSON output endpoint, from position 0, paging with
    /// `next` until the end it reports (the command must have ended): the chunks' bytes of
    /// (stdout, stderr, both in position order). Panics on a gap or a chunk out of place.
    pub fn output_all(&self, sandbox: &str, exec_id: &str) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
        let (mut out, mut err, mut all) = (Vec::new(), Vec::new(), Vec::new());
        let mut from = 0u64;
        for _ in 0..10_000 {
            let r = self.get(
                &format!(
                    "/v1/sandboxes/{sandbox}/exec/{exec_id}/output?from={from}&encoding=base64"
                ),
                &[],
            );
            let v = r.json();
            assert_eq!(r.status, 200, "output of {exec_id} from {from}: {v}");
            assert_eq!(v["object"], "output", "{v}");
            assert!(v["gap"].is_null(), "a gap in the output of {exec_id}: {v}");
            let mut cursor = from;
            for c in v["chunks"].as_array().expect("chunks") {
                let pos = c["position"].as_u64().expect("position");
                assert_eq!(pos, cursor, "chunk out of place in {v}");
                let data = b64_decode(c["data"].as_str().expect("data"));
                cursor += data.len() as u64;
                match c["stream"].as_str() {
                    Some("stdout") => out.extend_from_slice(&data),
                    Some("stderr") => err.extend_from_slice(&data),
                    other => panic!("chunk of stream {other:?}: {v}"),
                }
                all.extend_from_slice(&data);
            }
            let next = v["next"].as_u64().expect("next");
            assert_eq!(next, cursor, "next is not after the last chunk: {v}");
            let end = v["end"].as_u64().expect("end");
            if next >= end {
                assert_eq!(v["exited"], true, "output of {exec_id} read while running");
                return (out, err, all);
            }
            assert!(next > from, "no progress from {from}: {v}");
            from = next;
        }
        panic!("the output of {exec_id} did not end in 10000 pages")
    }

    /// The host pid of a sandbox's agent: the process of the sandbox's cgroup that is PID 1 of
    /// its PID namespace.
    pub fn agent_pid(&self, sandbox_id: &str) -> Option<u32> {
        processes_in(&self.cgroup_name)
            .into_iter()
            .filter(|(_, line)| line.contains(sandbox_id))
            .map(|(pid, _)| pid)
            .find(|pid| {
                fs::read_to_string(format!("/proc/{pid}/status"))
                    .ok()
                    .and_then(|s| {
                        s.lines()
                            .find_map(|l| l.strip_prefix("NSpid:"))
                            .map(|v| v.split_whitespace().last() == Some("1"))
                    })
                    .unwrap_or(false)
            })
    }

    /// What is left on the host of one sandbox: its directory, cgroups and processes.
    pub fn traces_of(&self, sandbox_id: &str) -> Vec<String> {
        self.all_sandbox_traces()
            .into_iter()
            .filter(|l| l.contains(sandbox_id))
            .collect()
    }
}

impl TestNode {
    /// POSTs `body` to `path` asking for an event stream, to read event by event.
    pub fn open_sse_post(&self, path: &str, body: &Value) -> SseStream {
        let sent = self
            .http
            .post(&self.url(path))
            .set("Content-Type", "application/json")
            .set("Accept", "text/event-stream")
            .send_bytes(&serde_json::to_vec(body).unwrap());
        self.event_stream(&format!("POST {path} {body}"), sent)
    }

    /// The event stream `what` answered; a panic that says what came instead.
    fn event_stream(&self, what: &str, sent: Result<ureq::Response, ureq::Error>) -> SseStream {
        let resp = match sent {
            Ok(r) => r,
            Err(ureq::Error::Status(code, r)) => panic!(
                "{what} answered {code} instead of a stream: {}",
                r.into_string().unwrap_or_default()
            ),
            Err(e) => panic!("request to the node failed: {e}\n{}", self.log_tail(30)),
        };
        let status = resp.status();
        let headers: Vec<(String, String)> = resp
            .headers_names()
            .into_iter()
            .filter_map(|n| resp.header(&n).map(|v| (n.clone(), v.to_string())))
            .collect();
        let ct = resp.content_type().to_string();
        assert_eq!(
            ct,
            "text/event-stream",
            "{what}: not an event stream: {}",
            resp.into_string().unwrap_or_default()
        );
        SseStream {
            status,
            headers,
            reader: BufReader::new(resp.into_reader()),
        }
    }
}

/// The time `from_now` from now, as RFC 3339 in UTC with milliseconds (`expires_at`).
pub fn rfc3339_in(from_now: Duration) -> String {
    let t = SystemTime::now() + from_now;
    let d = t.duration_since(UNIX_EPOCH).expect("after 1970");
    let secs = d.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_millis()
    )
}

/// The `sbx` CLI built beside sandboxd (`cargo build --workspace`).
#[allow(dead_code)]
pub fn sbx_bin() -> PathBuf {
    let p = sandboxd_bin().with_file_name("sbx");
    assert!(
        p.is_file(),
        "{} is missing: run `cargo build --workspace` first",
        p.display()
    );
    p
}

/// Runs `sbx ARGS…` against `node`: (exit code, stdout, stderr).
#[allow(dead_code)]
pub fn sbx(node: &TestNode, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(sbx_bin())
        .args(args)
        .env("SBX_URL", node.url(""))
        .env_remove("SBX_API_KEY")
        .output()
        .expect("run sbx");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
