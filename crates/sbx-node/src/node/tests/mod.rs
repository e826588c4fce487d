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

mod commands;
mod kept;
mod restart;
mod runs;
mod templates;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::node::output::{ExitInfo, Stream};
use sbx_api::exec::ExecStatus;
use sbx_api::{ApiError, Encoding, ExecObject, SandboxStatus};
use tokio::sync::mpsc;

pub(super) use super::fake::{create, node_in, until, TempDir, World};
use super::{Node, RunEvent, RunPlan};

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
        !*node.refilling.borrow() && node.pending_teardowns() == 0
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
