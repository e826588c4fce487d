//! The processes of a fleet test: a control plane (`sandboxd control`) and nodes that join it,
//! each on loopback ports, a data directory and a cgroup folder of its own. Everything is
//! stopped and removed when dropped, also when a test fails: the processes (SIGTERM, then
//! SIGKILL), what the nodes' sandboxes left (their processes, cgroups, mounts), the folders.
//! (What is needed of tests/it/common, copied: that fixture is another's.)

use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::ports;

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// The nodes' lease of the tests' control planes (s): short, so that a node is lost soon,
/// yet long enough that a node of a loaded 2-core machine renews it in time (it fences
/// itself a second before its end, and renews every second).
pub const NODE_LEASE_SECONDS: u64 = 3;

pub fn sandboxd_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_sandboxd"))
}

fn agent_bin() -> PathBuf {
    let agent = sandboxd_bin().with_file_name("sbx-agent");
    assert!(
        agent.is_file(),
        "the sandbox agent is not built: {} is missing (cargo build -p sbx-agent)",
        agent.display()
    );
    agent
}

/// The images directory the tests use: `SBX_TEST_IMAGES`, else the machine's; its base image
/// must be there (test.sh builds it).
pub fn images_dir() -> PathBuf {
    let dir = std::env::var_os("SBX_TEST_IMAGES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/sbx/images"));
    assert!(
        dir.join("base/image.json").is_file(),
        "no base image in {}: build it with `target/debug/sandboxd --images-dir {} build-base`",
        dir.display(),
        dir.display()
    );
    dir
}

pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind a free port on loopback");
    l.local_addr().expect("local addr").port()
}

fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::SeqCst)
    )
}

fn send_signal(pid: u32, sig: i32) {
    // SAFETY: kill has no memory effects; an error (the process is gone) is ignored.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// A daemon of the test, its output in a log file.
struct Proc {
    child: Option<Child>,
    log: PathBuf,
}

impl Proc {
    fn spawn(args: &[String], env: &[(String, String)], log: &Path) -> Proc {
        let out = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .expect("open a log");
        let child = Command::new(sandboxd_bin())
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log"))
            .stderr(out)
            .spawn()
            .expect("start sandboxd");
        Proc {
            child: Some(child),
            log: log.to_path_buf(),
        }
    }

    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// SIGKILL.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, up to 10 s, then SIGKILL.
    fn stop(&mut self) {
        let Some(mut c) = self.child.take() else {
            return;
        };
        send_signal(c.id(), libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = c.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
    }

    fn tail(&self, lines: usize) -> String {
        let text = fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        let from = all.len().saturating_sub(lines);
        format!(
            "--- last lines of {} ---\n{}",
            self.log.display(),
            all[from..].join("\n")
        )
    }
}

/// Waits until `url` answers 200 or `proc` exits.
fn wait_healthy(proc: &mut Proc, url: &str, timeout: Duration) -> Result<(), String> {
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(2))
        .build();
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(s) = proc.exited() {
            return Err(format!("it exited with {s}"));
        }
        // Healthy, and from this process: a port chosen free may have been taken by another
        // process, which answers in its place while this one fails to bind it.
        let ours = match (proc.child.as_ref(), ports::port_of(url)) {
            (Some(c), Some(port)) => ports::listens_on(c.id(), port),
            _ => true,
        };
        if let Ok(r) = agent.get(url).call() {
            if ours && r.status() == 200 {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            return Err(format!("{url} did not answer 200 in {timeout:?}"));
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// The fleet's object store, shared by its nodes and its control plane: a directory
/// (`file:///…`) or a SeaweedFS server on loopback (`s3://…`, its `AWS_*` settings in each
/// process's environment). Removed (the server stopped) when dropped: drop it after the
/// processes that use it.
pub struct FleetStore {
    pub url: String,
    pub env: Vec<(String, String)>,
    /// The fleet's store key (`--store-key`), one file for every node of the test.
    pub key: PathBuf,
    dir: Option<PathBuf>,
    _weed: Option<sbx_blob::testing::Weed>,
}

impl FleetStore {
    /// A directory of the test's own.
    pub fn dir() -> FleetStore {
        let dir = std::env::temp_dir().join(unique("sbx-fleet-store"));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("make the store's directory");
        FleetStore {
            url: format!("file://{}", dir.display()),
            env: Vec::new(),
            key: store_key_file(),
            dir: Some(dir),
            _weed: None,
        }
    }

    /// A SeaweedFS server of the test's own and a bucket on it; None (the reason printed)
    /// where `weed` is not found ($SBX_WEED, PATH, scripts/seaweedfs.sh's).
    pub fn weed() -> Option<FleetStore> {
        let Some(bin) = sbx_blob::testing::find_weed() else {
            eprintln!("skipped: no weed ($SBX_WEED, PATH or scripts/seaweedfs.sh's)");
            return None;
        };
        let weed = sbx_blob::testing::Weed::start(&bin);
        weed.make_bucket("sbx-fleet");
        Some(FleetStore {
            url: "s3://sbx-fleet/moves".to_string(),
            env: weed.env(),
            key: store_key_file(),
            dir: None,
            _weed: Some(weed),
        })
    }

    /// The store as the tests read it.
    pub fn open(&self) -> sbx_blob::Store {
        sbx_blob::Store::open_with_env(&self.url, self.env.clone())
            .unwrap_or_else(|e| panic!("open the store {}: {e}", self.url))
    }
}

/// A store key of 32 random bytes in a file of the test's own (made before any node starts:
/// nodes started at once would each make one).
fn store_key_file() -> PathBuf {
    let path = std::env::temp_dir().join(unique("sbx-fleet-store-key"));
    let mut key = [0u8; 32];
    fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut key))
        .expect("random bytes");
    fs::write(&path, key).expect("write the store key");
    path
}

impl Drop for FleetStore {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.key);
        if let Some(dir) = &self.dir {
            let _ = fs::remove_dir_all(dir);
        }
    }
}

/// A control plane on a loopback port.
pub struct ControlPlane {
    proc: Proc,
    pub addr: String,
    root: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl ControlPlane {
    /// `sandboxd control` with a data directory of its own, a node lease of [`NODE_LEASE_SECONDS`], and `db` (a
    /// database URL) or its SQLite default.
    pub fn start(db: Option<&str>) -> ControlPlane {
        ControlPlane::start_with(db, None)
    }

    /// The same, with the fleet's object store `store` (else its own default).
    pub fn start_with(db: Option<&str>, store: Option<&FleetStore>) -> ControlPlane {
        ControlPlane::start_args(db, store, &[])
    }

    /// The same, with more flags (`--iii-url …`).
    pub fn start_args(
        db: Option<&str>,
        store: Option<&FleetStore>,
        extra: &[String],
    ) -> ControlPlane {
        let root = std::env::temp_dir().join(unique("sbx-fleet-ctl"));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(&root).expect("make the control plane's folder");
        let env = store.map(|s| s.env.clone()).unwrap_or_default();
        for attempt in 0..3 {
            let addr = format!("127.0.0.1:{}", free_port());
            let mut args: Vec<String> = [
                "control",
                "--listen",
                &addr,
                "--data-dir",
                &root.join("data").to_string_lossy(),
                "--node-lease-seconds",
                &NODE_LEASE_SECONDS.to_string(),
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            if let Some(db) = db {
                args.extend(["--db".to_string(), db.to_string()]);
            }
            if let Some(store) = store {
                args.extend(["--store".to_string(), store.url.clone()]);
            }
            args.extend(extra.iter().cloned());
            let mut proc = Proc::spawn(&args, &env, &root.join("control.log"));
            match wait_healthy(
                &mut proc,
                &format!("http://{addr}/healthz"),
                Duration::from_secs(20),
            ) {
                Ok(()) => {
                    return ControlPlane {
                        proc,
                        addr,
                        root,
                        args,
                        env,
                    }
                }
                Err(e) => {
                    let tail = proc.tail(30);
                    proc.kill();
                    if attempt == 2 || !tail.contains("listen on") {
                        let _ = fs::remove_dir_all(&root);
                        panic!("the control plane did not start: {e}\n{tail}");
                    }
                }
            }
        }
        unreachable!("three attempts")
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn log_tail(&self, lines: usize) -> String {
        self.proc.tail(lines)
    }

    /// SIGKILL: nothing of it is left to end what it was doing.
    pub fn kill(&mut self) {
        self.proc.kill();
    }

    /// SIGSTOP.
    pub fn pause(&self) {
        if let Some(c) = &self.proc.child {
            send_signal(c.id(), libc::SIGSTOP);
        }
    }

    /// SIGCONT.
    pub fn resume(&self) {
        if let Some(c) = &self.proc.child {
            send_signal(c.id(), libc::SIGCONT);
        }
    }

    /// Starts it again, killed, on the same port, data directory, database and store.
    pub fn restart(&mut self) {
        assert!(self.proc.child.is_none(), "the control plane still runs");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            self.proc = Proc::spawn(&self.args, &self.env, &self.root.join("control.log"));
            let health = self.url("/healthz");
            match wait_healthy(&mut self.proc, &health, Duration::from_secs(20)) {
                Ok(()) => return,
                Err(e) => {
                    let tail = self.proc.tail(30);
                    self.proc.kill();
                    // Its port may be held a moment longer by what the killed one left.
                    if Instant::now() > deadline || !tail.contains("listen on") {
                        panic!("the control plane did not start again: {e}\n{tail}");
                    }
                    std::thread::sleep(Duration::from_millis(500));
                }
            }
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.proc.tail(40));
        }
        // A paused control plane takes its SIGTERM once it goes on.
        self.resume();
        self.proc.stop();
        let _ = fs::remove_dir_all(&self.root);
    }
}

/// How a node of a test is started besides its defaults.
#[derive(Default)]
pub struct NodeOpts<'a> {
    /// The fleet's object store (else a directory of the node's own).
    pub store: Option<&'a FleetStore>,
    /// Another build than its peers': the agent binary copied with one byte appended (the
    /// build is a hash over the kernel, CRIU and the agent's bytes; the copy runs the same).
    pub other_build: bool,
}

/// What `Node::start_more` adds to a node's start.
#[derive(Default)]
pub struct NodeMore {
    /// More flags (`--iii-url …`).
    pub args: Vec<String>,
    /// Standing alone: no `--control`, `--node-name` or `--store` (it joins no fleet).
    pub standalone: bool,
}

/// A node that joins a control plane: small (no warm pool, a 512 MiB disk, no network), on
/// ports, a data directory and a cgroup folder of its own.
pub struct Node {
    proc: Proc,
    pub name: String,
    pub addr: String,
    preview: String,
    control: String,
    root: PathBuf,
    data_dir: PathBuf,
    cgroup_name: String,
    store_url: String,
    /// The fleet's store key (its own default, `DATA_DIR/store.key`, without a fleet store).
    store_key: Option<PathBuf>,
    env: Vec<(String, String)>,
    agent: PathBuf,
    extra: Vec<String>,
    standalone: bool,
}

impl Node {
    pub fn start(name: &str, control: &ControlPlane) -> Node {
        Node::start_with(name, control, NodeOpts::default())
    }

    pub fn start_with(name: &str, control: &ControlPlane, opts: NodeOpts) -> Node {
        Node::start_more(name, control, opts, NodeMore::default())
    }

    /// The same, with more flags, or standing alone.
    pub fn start_more(name: &str, control: &ControlPlane, opts: NodeOpts, more: NodeMore) -> Node {
        Node::start_at(name, control.url(""), opts, more)
    }

    /// A node given several control planes (`--control URL,URL`: copies of one fleet's).
    pub fn start_joining(name: &str, controls: &[&ControlPlane], opts: NodeOpts) -> Node {
        let urls: Vec<String> = controls.iter().map(|c| c.url("")).collect();
        Node::start_at(name, urls.join(","), opts, NodeMore::default())
    }

    /// A node joining the control plane at `url` (one of the test's own making).
    pub fn start_at_url(name: &str, url: &str, opts: NodeOpts) -> Node {
        Node::start_at(name, url.to_string(), opts, NodeMore::default())
    }

    fn start_at(name: &str, control: String, opts: NodeOpts, more: NodeMore) -> Node {
        let root = std::env::temp_dir().join(unique("sbx-fleet-node"));
        let _ = fs::remove_dir_all(&root);
        let data_dir = root.join("data");
        fs::create_dir_all(&data_dir).expect("make the node's data directory");
        let cgroup_name = unique("sbx-fleet");
        let agent = if opts.other_build {
            let copy = root.join("sbx-agent");
            let mut bytes = fs::read(agent_bin()).expect("read the agent");
            bytes.push(b'\n');
            fs::write(&copy, bytes).expect("write the agent's copy");
            let mut perm = fs::metadata(&copy).expect("the copy").permissions();
            std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
            fs::set_permissions(&copy, perm).expect("make the copy executable");
            copy
        } else {
            agent_bin()
        };
        let (store_url, env, store_key) = match opts.store {
            Some(s) => (s.url.clone(), s.env.clone(), Some(s.key.clone())),
            None => (
                format!("file://{}", root.join("store").display()),
                Vec::new(),
                None,
            ),
        };
        let mut node = Node {
            proc: Proc {
                child: None,
                log: root.join("node.log"),
            },
            name: name.to_string(),
            addr: String::new(),
            preview: String::new(),
            control,
            root,
            data_dir,
            cgroup_name,
            store_url,
            store_key,
            env,
            agent,
            extra: more.args,
            standalone: more.standalone,
        };
        for attempt in 0..3 {
            node.addr = format!("127.0.0.1:{}", free_port());
            node.preview = format!("127.0.0.1:{}", free_port());
            match node.spawn() {
                Ok(()) => return node,
                Err(e) => {
                    let tail = node.proc.tail(40);
                    node.proc.kill();
                    if attempt == 2 || !tail.contains("listen on") {
                        panic!("node {name} did not start: {e}\n{tail}");
                    }
                }
            }
        }
        unreachable!("three attempts")
    }

    fn spawn(&mut self) -> Result<(), String> {
        let args: Vec<String> = [
            "--listen",
            &self.addr,
            "--data-dir",
            &self.data_dir.to_string_lossy(),
            "--images-dir",
            &images_dir().to_string_lossy(),
            "--agent",
            &self.agent.to_string_lossy(),
            "--cgroup-name",
            &self.cgroup_name,
            "--pids-max",
            "128",
            "--egress-default",
            "none",
            "--warm-pool",
            "0",
            // A small disk (its blocks are reserved on the host: four nodes of each of four
            // tests at once beside the build), promised sixteen times over: tests do not fill it.
            "--disk-image-bytes",
            "536870912",
            "--disk-bytes",
            "268435456",
            "--volume-bytes",
            "268435456",
            "--disk-overcommit",
            "16",
            "--preview-listen",
            &self.preview,
            "--control",
            &self.control,
            "--node-name",
            &self.name,
            "--store",
            &self.store_url,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut args = args;
        if let Some(key) = &self.store_key {
            args.extend(["--store-key".to_string(), key.display().to_string()]);
        }
        if self.standalone {
            // Without `--control URL`, `--node-name NAME` and `--store URL`.
            let mut kept = Vec::new();
            let mut it = args.into_iter();
            while let Some(a) = it.next() {
                if matches!(
                    a.as_str(),
                    "--control" | "--node-name" | "--store" | "--store-key"
                ) {
                    it.next();
                } else {
                    kept.push(a);
                }
            }
            args = kept;
        }
        args.extend(self.extra.iter().cloned());
        self.proc = Proc::spawn(&args, &self.env, &self.root.join("node.log"));
        let health = self.url("/healthz");
        wait_healthy(&mut self.proc, &health, Duration::from_secs(30))
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// SIGKILL: its sandboxes are left as they are (the next start adopts them).
    pub fn kill(&mut self) {
        self.proc.kill();
    }

    /// SIGSTOP: it answers nothing (connections are accepted by the kernel and wait) until
    /// [`Node::resume`].
    pub fn pause(&self) {
        if let Some(c) = &self.proc.child {
            send_signal(c.id(), libc::SIGSTOP);
        }
    }

    /// SIGCONT.
    pub fn resume(&self) {
        if let Some(c) = &self.proc.child {
            send_signal(c.id(), libc::SIGCONT);
        }
    }

    pub fn log_tail(&self, lines: usize) -> String {
        self.proc.tail(lines)
    }

    /// The processes in the cgroup of sandbox `id` of this node.
    pub fn sandbox_processes(&self, id: &str) -> Vec<u32> {
        processes_in(&format!("{}/{id}", self.cgroup_name))
    }

    /// The paths under the node's data directory whose name has `id` in it (what the node
    /// keeps of a sandbox: its folders, images, disk), up to five levels down.
    pub fn files_of(&self, id: &str) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let mut walk = vec![(self.data_dir.clone(), 0)];
        while let Some((dir, depth)) = walk.pop() {
            let Ok(rd) = fs::read_dir(&dir) else {
                continue;
            };
            for e in rd.flatten() {
                let path = e.path();
                if e.file_name().to_string_lossy().contains(id) {
                    out.push(path);
                } else if depth < 4 && e.file_type().is_ok_and(|t| t.is_dir()) {
                    walk.push((path, depth + 1));
                }
            }
        }
        out
    }

    /// Starts it again with the same name, data directory, cgroup folder and ports.
    pub fn restart(&mut self) {
        assert!(self.proc.child.is_none(), "the node still runs");
        if let Err(e) = self.spawn() {
            panic!(
                "node {} did not start again: {e}\n{}",
                self.name,
                self.proc.tail(40)
            );
        }
    }

    /// Removes whatever the node's sandboxes left (after the node is stopped): their
    /// processes, cgroup folders and mounts.
    fn force_clean(&self) {
        let dirs = cgroup_dirs(&self.cgroup_name);
        for _ in 0..250 {
            let mut busy = false;
            for pid in processes_in(&self.cgroup_name) {
                send_signal(pid, libc::SIGKILL);
                busy = true;
            }
            for dir in &dirs {
                for sub in subdirs(dir) {
                    let _ = fs::write(sub.join("freezer.state"), "THAWED");
                    let _ = fs::write(sub.join("cgroup.freeze"), "0");
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

impl Drop for Node {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.proc.tail(40));
        }
        // A paused node takes its SIGTERM once it goes on.
        self.resume();
        self.proc.stop();
        self.force_clean();
        let _ = fs::remove_dir_all(&self.root);
    }
}

/// The folders named `name` in each cgroup hierarchy, at most three levels down (the node's
/// stable place `sbx.slice/<name>`, or under the test's own cgroup).
fn cgroup_dirs(name: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut walk = vec![(PathBuf::from("/sys/fs/cgroup"), 0)];
    while let Some((dir, depth)) = walk.pop() {
        for sub in subdirs(&dir) {
            if sub.file_name().is_some_and(|n| n == name) {
                out.push(sub);
            } else if depth < 3 {
                walk.push((sub, depth + 1));
            }
        }
    }
    out
}

/// Processes whose cgroup path has the folder `name` in it.
fn processes_in(name: &str) -> Vec<u32> {
    let me = std::process::id();
    let inner = format!("/{name}/");
    let last = format!("/{name}");
    let Ok(rd) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()))
        .filter(|pid| *pid != me)
        .filter(|pid| {
            fs::read_to_string(format!("/proc/{pid}/cgroup"))
                .is_ok_and(|cg| cg.lines().any(|l| l.contains(&inner) || l.ends_with(&last)))
        })
        .collect()
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

/// A PostgreSQL database of the test's own on the server of `SBX_TEST_PG_URL`, dropped when
/// dropped (made and dropped with `psql`, which comes with the server's packages).
pub struct PgDatabase {
    admin_url: String,
    name: String,
    pub url: String,
}

impl PgDatabase {
    pub fn create(admin_url: &str) -> PgDatabase {
        let name = unique("sbx_t_fleet").replace('-', "_");
        psql(admin_url, &format!("CREATE DATABASE {name}"));
        // The URL's database is the last path segment (before any query).
        let (base, query) = match admin_url.split_once('?') {
            Some((b, q)) => (b, Some(q)),
            None => (admin_url, None),
        };
        let cut = base
            .rfind('/')
            .filter(|i| base[..*i].ends_with(|c: char| c != '/'))
            .unwrap_or(base.len());
        let mut url = format!("{}/{name}", &base[..cut]);
        if let Some(q) = query {
            url.push('?');
            url.push_str(q);
        }
        PgDatabase {
            admin_url: admin_url.to_string(),
            name,
            url,
        }
    }
}

impl Drop for PgDatabase {
    fn drop(&mut self) {
        let out = Command::new("psql")
            .arg(&self.admin_url)
            .args(["-q", "-v", "ON_ERROR_STOP=1", "-c"])
            .arg(format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ))
            .output();
        if let Ok(o) = out {
            if !o.status.success() {
                eprintln!(
                    "dropping {}: {}",
                    self.name,
                    String::from_utf8_lossy(&o.stderr)
                );
            }
        }
    }
}

fn psql(url: &str, sql: &str) {
    let out = Command::new("psql")
        .arg(url)
        .args(["-q", "-v", "ON_ERROR_STOP=1", "-c", sql])
        .output()
        .expect("run psql (SBX_TEST_PG_URL is set: psql comes with scripts/postgres.sh)");
    assert!(
        out.status.success(),
        "psql {sql:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
