//! The node of a test: starting it (its own port, data directory and cgroup folder), starting
//! it again, stopping or killing it, its log; dropping it removes everything it left.

use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::host::{node_cgroup_dirs, own_net_range, send_signal, HostLock};

/// The size of a test node's disk image (512 MiB), unless a test gives its own.
const TEST_DISK_IMAGE_BYTES: &str = "536870912";

static NEXT_NODE: AtomicUsize = AtomicUsize::new(0);
static BUILD_LOCK: Mutex<()> = Mutex::new(());

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

/// Makes sure the base and code interpreter images are there (`sandboxd build-base` once,
/// a few minutes, when they are not).
fn ensure_base_image(images: &Path) {
    let built = || {
        images.join("base/image.json").is_file()
            && images.join("code-interpreter/image.json").is_file()
    };
    if built() {
        return;
    }
    let _g = BUILD_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if built() {
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
        .arg("--code-interpreter")
        .status()
        .expect("run sandboxd build-base");
    assert!(
        status.success(),
        "sandboxd build-base failed ({status}); build the base image by hand with \
         `target/debug/sandboxd --images-dir {} build-base --code-interpreter`",
        images.display()
    );
}

/// The client of the fixture's own calls: connections kept open between calls.
fn http_agent() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout_connect(Duration::from_secs(5))
        .timeout_read(Duration::from_secs(120))
        .timeout_write(Duration::from_secs(120))
        .build()
}

pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind a free port on loopback");
    l.local_addr().expect("local addr").port()
}

/// A sandboxd node made for a test.
pub struct TestNode {
    pub(super) child: Option<Child>,
    pub addr: String,
    pub root: PathBuf,
    pub data_dir: PathBuf,
    pub images_dir: PathBuf,
    pub cgroup_name: String,
    pub(super) cgroup_dirs: Vec<(String, PathBuf)>,
    pub(super) log: PathBuf,
    pub(super) http: ureq::Agent,
    pub(super) agent: PathBuf,
    pub(super) args: Vec<String>,
    /// An `Authorization` value the fixture's own calls (`warm_ids`) send.
    pub auth: Option<String>,
    /// The address of the preview listener it is started with (unless its arguments name one).
    pub(super) preview: String,
    /// The network range of a node with network whose arguments name none, kept for its
    /// restarts ([`own_net_range`]).
    pub(super) net_range: Option<(String, HostLock)>,
    /// Directories of the test's own removed with the node ([`TestNode::owns`]).
    pub(super) owned: Vec<PathBuf>,
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
    /// the machine's base and code interpreter images (symlinks) and an OCI store no other
    /// node uses.
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
            for name in ["base", "code-interpreter"] {
                std::os::unix::fs::symlink(shared.join(name), own.join(name))
                    .expect("link the base and code interpreter images");
            }
            own
        } else {
            shared
        };
        let log = root.join("node.log");
        let http = http_agent();
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
            preview: String::new(),
            net_range: None,
            owned: Vec::new(),
        };
        assert!(
            !node.cgroup_dirs.is_empty(),
            "found no cgroup hierarchy with memory and pids"
        );
        // A port picked here may be taken before the node binds it: try again then.
        for attempt in 0..3 {
            node.addr = format!("127.0.0.1:{}", free_port());
            node.preview = format!("127.0.0.1:{}", free_port());
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
        let networked = self
            .args
            .windows(2)
            .any(|w| w[0] == "--egress-default" && w[1] != "none");
        let own_range = networked && !self.args.iter().any(|a| a == "--net-range");
        if own_range && self.net_range.is_none() {
            self.net_range = Some(own_net_range());
        }
        let range = self
            .net_range
            .as_ref()
            .filter(|_| own_range)
            .map(|(r, _)| ["--net-range".to_string(), r.clone()]);
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
            // Without network unless a test asks for it (with a range of its own: nodes of
            // tests that run at once must not share one).
            .args(
                (!self.args.iter().any(|a| a == "--egress-default"))
                    .then_some(["--egress-default", "none"])
                    .into_iter()
                    .flatten(),
            )
            .args(range.into_iter().flatten())
            // No warm pool: a node's two warm sandboxes cost every test their making and their
            // ending (the tests of the pool, and of what runs on warm sandboxes, ask for one).
            // A small disk of its own (its blocks are reserved on the host: a node's default, 90%
            // of what the host has free, would leave none for the next node; four tests at once,
            // a fleet's of four nodes each, must fit beside the build on a CI machine with little
            // room), sandboxes' disks and volumes that fit in it, promised 64 times over (tests do
            // not fill it, and some run a hundred sandboxes at once; disk.rs and the attacks that
            // fill it give their own).
            .args(
                [
                    ["--warm-pool", "0"],
                    ["--disk-image-bytes", TEST_DISK_IMAGE_BYTES],
                    ["--disk-bytes", "268435456"],
                    ["--volume-bytes", "268435456"],
                    ["--disk-overcommit", "64"],
                ]
                .into_iter()
                .filter(|[flag, _]| !self.args.iter().any(|a| a == flag))
                .flatten(),
            )
            // The preview listener on a port of its own ([`TestNode::preview_addr`]), so that
            // nodes of tests that run at once do not take each other's; the same one after a
            // restart (sandbox objects name it in preview_url).
            .args(
                (!self.args.iter().any(|a| a == "--preview-listen"))
                    .then(|| ["--preview-listen".to_string(), self.preview.clone()])
                    .into_iter()
                    .flatten(),
            )
            .args(&self.args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(logfile.try_clone().expect("log"))
            .stderr(logfile)
            .spawn()
            .expect("start sandboxd");
        self.child = Some(child);
        let healthy = self.wait_healthy(Duration::from_secs(20));
        // Where the daemon put its folders (the stable place, or its own cgroup's).
        self.cgroup_dirs = node_cgroup_dirs(&self.cgroup_name);
        healthy
    }

    /// Removes `dir` (the test's: a config file the node reads at every start, files a
    /// server of the test serves) when the node is dropped.
    pub fn owns(&mut self, path: PathBuf) {
        self.owned.push(path);
    }

    /// The arguments the node is started with from its next (re)start on.
    pub fn set_args(&mut self, args: &[&str]) {
        self.args = args.iter().map(|a| a.to_string()).collect();
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
            // Healthy, and from this node: a port chosen free may have been taken by another
            // process, which answers in its place while this node fails to bind it.
            let ours = match (self.child.as_ref(), super::ports::port_of(&self.addr)) {
                (Some(c), Some(port)) => super::ports::listens_on(c.id(), port),
                _ => true,
            };
            if ours && self.client().health(Duration::from_secs(5)).is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("GET /healthz did not answer in {timeout:?}"));
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// The address the node's preview listener is bound to (`GET /internal/node`, with
    /// [`TestNode::auth`]); `None` when it is off.
    pub fn preview_addr(&self) -> Option<String> {
        let info = self.ok("GET /internal/node", self.client().node_info());
        info.other
            .get("preview")
            .and_then(|p| p["listen"].as_str())
            .map(str::to_string)
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

    /// Stops the node: SIGTERM, up to 10 s, then SIGKILL. Its exit status (None if it was not
    /// running).
    pub fn stop(&mut self) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        // The connections the fixture keeps open are closed first: a stopping node gives open
        // connections up to 5 s to finish, idle ones too.
        self.http = http_agent();
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
        for path in &self.owned {
            if path.is_dir() {
                let _ = fs::remove_dir_all(path);
            } else {
                let _ = fs::remove_file(path);
            }
        }
    }
}

/// The `sbx` CLI built beside sandboxd (`cargo build --workspace`).
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
