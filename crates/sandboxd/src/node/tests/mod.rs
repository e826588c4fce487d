//! The node's lifecycle rules, tested through its typed API on the fake driver
//! ([`super::fake`]): no root, no image, no cgroup; each test in its own data directory, in
//! well under a second.
//!
//! - [`kept`]: names, capacity, the exec cap, command ids, agents that die, restarts, deletes,
//!   expiry;
//! - [`commands`]: a kept sandbox's commands: stdin, signals, output;
//! - [`runs`]: one-shot runs, the warm pool, a stopping node;
//! - [`templates`]: creates that wait on one build, failed and cancelled builds;
//! - [`restart`]: a node that starts again adopts what runs and fails what was lost;
//! - [`http`]: Idempotency-Key (the HTTP layer's) on creates and commands.

mod commands;
mod http;
mod kept;
mod restart;
mod runs;
mod templates;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sbx_api::exec::ExecStatus;
use sbx_api::{ApiError, Encoding, ExecObject, SandboxObject, SandboxStatus};
use sbx_proto::{ExitInfo, Stream};
use tokio::sync::mpsc;

use super::fake::{FakeDriver, World};
use super::{Node, NodeConfig, RunEvent, RunPlan};
use crate::image::{ImageMeta, ImageStore};
use crate::store::Store;

/// A directory of its own for a test, removed when it ends.
pub(super) struct TempDir(pub PathBuf);

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

pub(super) const DEFAULT_MEMORY: u64 = 256 << 20;

fn config(dir: &Path) -> NodeConfig {
    NodeConfig {
        data_dir: dir.to_path_buf(),
        default_memory_bytes: DEFAULT_MEMORY,
        default_vcpus: 1,
        pids_max: 64,
        max_memory_bytes: 1 << 30,
        max_vcpus: 2,
        warm_pool: 0,
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
pub(super) fn node_in(
    dir: &Path,
    world: &Arc<World>,
    tweak: impl FnOnce(&mut NodeConfig),
) -> Arc<Node> {
    let mut cfg = config(dir);
    tweak(&mut cfg);
    let store = Store::open(&dir.join("state.db")).expect("the state database");
    crate::node::credentials::init(dir, &store).expect("the node key");
    let templates = crate::node::templates::Templates::open(&store).expect("templates");
    let driver = Arc::new(FakeDriver::new(world.clone()));
    Node::new(cfg, driver, images(dir), store, templates)
}

/// `POST /v1/sandboxes` with `body`.
pub(super) async fn create(node: &Arc<Node>, body: &str) -> Result<SandboxObject, ApiError> {
    let c = sbx_api::parse_sandbox_create(body.as_bytes()).expect("a valid create");
    node.create_sandbox(c).await
}

/// `POST /v1/sandboxes/{id}/exec` with `body`.
pub(super) async fn exec(node: &Arc<Node>, id: &str, body: &str) -> Result<ExecObject, ApiError> {
    let req = sbx_api::parse_exec_request(body.as_bytes()).expect("a valid exec");
    node.exec(id, req, None).await
}

/// `GET …/exec/{exec_id}`.
pub(super) async fn exec_get(node: &Arc<Node>, id: &str, exec_id: &str) -> ExecObject {
    node.exec_get(id, exec_id, 0.0, Encoding::Utf8)
        .await
        .expect("the command's object")
}

/// The sandbox's status and failure code.
pub(super) fn state(node: &Node, id: &str) -> (SandboxStatus, Option<String>) {
    let m = node.managed(id).expect("a sandbox of the node");
    let o = node.sandbox_object(&m);
    (o.status, o.failure_code)
}

/// Waits (at most 3 s) until `done`.
pub(super) async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !done() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "waited in vain: {what}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

pub(super) fn run_request(body: &str) -> sbx_api::RunRequest {
    sbx_api::parse_run_request(body.as_bytes()).expect("a valid run")
}

/// A run's events to its end.
pub(super) async fn run_plan(node: &Arc<Node>, plan: RunPlan) -> Vec<RunEvent> {
    let (tx, mut rx) = mpsc::channel(64);
    let task = tokio::spawn(node.clone().run(plan, tx));
    let mut events = Vec::new();
    while let Some(e) = rx.recv().await {
        events.push(e);
    }
    task.await.expect("the run");
    events
}

/// What a run ended with: its exit, stdout, stderr.
pub(super) fn ended(events: &[RunEvent]) -> (ExitInfo, String, String) {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let mut exit = None;
    for e in events {
        match e {
            RunEvent::Output { stream, data, .. } => match stream {
                Stream::Stdout => out.extend_from_slice(data),
                _ => err.extend_from_slice(data),
            },
            RunEvent::Exited { exit: x, .. } => exit = Some(x.clone()),
            RunEvent::Failed(e) => panic!("the run failed: {e:?}"),
            _ => {}
        }
    }
    let exit = exit.expect("the run's end");
    (
        exit,
        String::from_utf8_lossy(&out).into_owned(),
        String::from_utf8_lossy(&err).into_owned(),
    )
}

/// Asserts a command's status (and exit code when it ended).
pub(super) fn assert_exec(o: &ExecObject, status: ExecStatus, code: Option<i32>) {
    assert_eq!((o.status, o.exit_code), (status, code), "{o:?}");
}

/// Stops the node as `main` does and waits until nothing of it is under way (a refill, a
/// teardown), so that nothing is made in the test's directory after the test.
pub(super) async fn stop(node: &Arc<Node>) {
    node.shutdown().await;
    until("the node is idle", || {
        !node.refilling.load(Ordering::SeqCst) && node.pending_teardowns() == 0
    })
    .await;
}

/// `expires_at` `ms` milliseconds from now.
pub(super) fn expires_in(ms: i128) -> String {
    sbx_api::format_rfc3339_millis(crate::image::now_ns() + ms * 1_000_000)
}

/// Whether the sandbox's directory is gone.
pub(super) fn dir_gone(dir: &Path, id: &str) -> bool {
    !dir.join("sandboxes").join(id).exists()
}
