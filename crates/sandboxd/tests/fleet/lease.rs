//! Node leases and self-fencing (issue #29): a node that cannot renew its lease fences itself
//! (its sandboxes frozen, their calls 503 `fenced`) and serves them again once it renews; a
//! node that is stopped has its sandboxes stopped by their agents' watchdogs; a node told by
//! its control plane that a sandbox it holds is `taken` removes it and answers `moved` for it
//! (across its restart), and a node starts fenced until its first join.

use std::collections::HashMap;
use std::fs;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::{ControlPlane, Node, NodeOpts, NODE_LEASE_SECONDS};
use crate::http::{assert_error, Http};

/// Counts in `/tmp/c`, ten times a second.
const COUNTER: &str = "i=0; while :; do i=$((i+1)); echo $i > /tmp/c; sleep 0.1; done";

/// What `/proc/<pid>/status` says of a process: its state letter and its pid in its own
/// namespace (the innermost).
fn proc_status(pid: u32) -> Option<(char, u32)> {
    let text = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let state = text
        .lines()
        .find_map(|l| l.strip_prefix("State:"))?
        .trim()
        .chars()
        .next()?;
    let nspid = text
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()?;
    Some((state, nspid))
}

/// The host pid of the sandbox's agent (PID 1 in it).
fn agent_pid(node: &Node, id: &str) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let found = node
            .sandbox_processes(id)
            .into_iter()
            .find(|p| proc_status(*p).is_some_and(|(_, ns)| ns == 1));
        if let Some(p) = found {
            return p;
        }
        assert!(Instant::now() < deadline, "no agent of {id}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The counter's value, read from the host through the agent's root (whatever state the
/// sandbox's processes are in).
fn count(agent: u32) -> u64 {
    fs::read_to_string(format!("/proc/{agent}/root/tmp/c"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Whether the counter moves on within `within`.
fn counts(agent: u32, within: Duration) -> bool {
    let first = count(agent);
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(150));
        if count(agent) > first {
            return true;
        }
    }
    false
}

/// The states of the sandbox's processes but its agent.
fn others_states(node: &Node, id: &str) -> Vec<char> {
    node.sandbox_processes(id)
        .into_iter()
        .filter_map(proc_status)
        .filter(|(_, ns)| *ns != 1)
        .map(|(s, _)| s)
        .collect()
}

fn lease_of(http: &Http, node: &Node) -> Value {
    let r = http.get(&node.url("/internal/node"));
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["lease"].clone()
}

/// Waits until `f` holds (a tenth of a second between looks).
fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool, logs: impl Fn() -> String) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(
            Instant::now() < deadline,
            "{what} after {timeout:?}\n{}",
            logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A kept sandbox with the counter running, made on `node` (directly, or through `ctl`).
fn counting_sandbox(http: &Http, base: &str) -> String {
    let r = http.post_json(&format!("{base}/v1/sandboxes"), &json!({}));
    assert_eq!(r.status, 201, "create: {}", r.text());
    let id = r.json()["id"].as_str().unwrap_or_default().to_string();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let v = http.get(&format!("{base}/v1/sandboxes/{id}")).json();
        if v["status"] == "running" {
            break;
        }
        assert!(Instant::now() < deadline, "not running: {v}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let r = http.post_json(
        &format!("{base}/v1/sandboxes/{id}/exec"),
        &json!({ "command": ["sh", "-c", COUNTER] }),
    );
    assert_eq!(r.status, 201, "the counter: {}", r.text());
    id
}

/// (a) The control plane stopped past the node's lease: the node fences itself (its
/// sandbox's calls, creates and runs 503 `fenced`, the sandbox frozen); once the control plane
/// goes on, the node renews, and the sandbox is served and counts again.
#[test]
fn a_node_that_cannot_renew_its_lease_fences_itself_until_it_does() {
    let ctl = ControlPlane::start(None);
    let a = Node::start("lease-a", &ctl);
    let http = Http::new();
    let logs = || format!("{}\n{}", a.log_tail(30), ctl.log_tail(10));
    wait_for(
        "the node is not unfenced after its join",
        Duration::from_secs(20),
        || lease_of(&http, &a)["fenced"] == false,
        logs,
    );
    let lease = lease_of(&http, &a);
    assert_eq!(lease["leased"], true, "{lease}");
    assert!(
        lease["left_ms"]
            .as_u64()
            .is_some_and(|ms| ms <= (NODE_LEASE_SECONDS - 1) * 1000),
        "{lease}"
    );
    let id = counting_sandbox(&http, &ctl.url(""));
    let agent = agent_pid(&a, &id);
    assert!(
        counts(agent, Duration::from_secs(10)),
        "the counter does not count"
    );

    ctl.pause();
    let fenced_at = Instant::now();
    let mut answer = None;
    wait_for(
        "the node does not answer fenced",
        Duration::from_secs(10),
        || {
            let r = http.get(&a.url(&format!("/v1/sandboxes/{id}")));
            let fenced = r.status == 503;
            answer = Some(r);
            fenced
        },
        logs,
    );
    // The lease less its margin (1 s) from the last renewal sent: before the lease's end.
    assert!(
        fenced_at.elapsed() < Duration::from_secs(NODE_LEASE_SECONDS),
        "fenced {:?} after the control plane stopped",
        fenced_at.elapsed()
    );
    let r = answer.expect("an answer");
    let e = assert_error(&r, 503, "fenced", None);
    assert_eq!(e["retryable"], true, "{e}");
    let msg = e["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("could not renew its lease") && msg.contains("since"),
        "{msg}"
    );
    assert_eq!(r.header("retry-after"), Some("1"), "{:?}", r.headers);
    let lease = lease_of(&http, &a);
    assert_eq!(lease["fenced"], true, "{lease}");
    assert!(lease["fenced_since"].as_str().is_some(), "{lease}");
    // Its commands, files, sleep; new sandboxes and runs: all fenced.
    for (method, path, body) in [
        (
            "POST",
            format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"command": "true"})),
        ),
        ("GET", format!("/v1/sandboxes/{id}/files?path=/tmp/c"), None),
        ("POST", format!("/v1/sandboxes/{id}/sleep"), Some(json!({}))),
        ("POST", "/v1/sandboxes".to_string(), Some(json!({}))),
        (
            "POST",
            "/v1/run".to_string(),
            Some(json!({"command": "true"})),
        ),
    ] {
        let url = a.url(&path);
        let r = match body {
            Some(b) => http.post_json(&url, &b),
            None => http.call(method, &url, &[], None),
        };
        assert_error(&r, 503, "fenced", None);
    }
    // Frozen: the counter stands still.
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !counts(agent, Duration::from_millis(1500)),
        "the counter counts on while the node is fenced"
    );
    assert!(lease_of(&http, &a)["frozen"].as_u64() >= Some(1));

    ctl.resume();
    wait_for(
        "the node does not serve its sandbox again",
        Duration::from_secs(15),
        || http.get(&a.url(&format!("/v1/sandboxes/{id}"))).status == 200,
        logs,
    );
    assert_eq!(lease_of(&http, &a)["fenced"], false);
    assert!(
        counts(agent, Duration::from_secs(5)),
        "the counter does not count after the renewal\n{}",
        logs()
    );
    // Through the control plane too.
    let r = http.post_json(
        &ctl.url(&format!("/v1/sandboxes/{id}/exec")),
        &json!({"command": "cat /tmp/c", "wait_seconds": 10}),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["exit_code"], 0, "{}", r.text());
}

/// (b) The node stopped (SIGSTOP) past its lease: the sandbox's agent stops every other
/// process of it (state T); the node goes on, renews, and they run again.
#[test]
fn a_stopped_node_s_sandboxes_are_stopped_by_their_agents() {
    let ctl = ControlPlane::start(None);
    let a = Node::start("lease-b", &ctl);
    let http = Http::new();
    let logs = || format!("{}\n{}", a.log_tail(30), ctl.log_tail(10));
    wait_for(
        "the node is not unfenced after its join",
        Duration::from_secs(20),
        || lease_of(&http, &a)["fenced"] == false,
        logs,
    );
    let id = counting_sandbox(&http, &a.url(""));
    let agent = agent_pid(&a, &id);
    assert!(
        counts(agent, Duration::from_secs(10)),
        "the counter does not count"
    );
    // Renewals reach the agent (the first one after the counter started).
    std::thread::sleep(Duration::from_secs(1));
    assert!(others_states(&a, &id).iter().all(|s| *s != 'T'));

    a.pause();
    wait_for(
        "the agent does not stop the sandbox's processes",
        Duration::from_secs(10),
        || {
            let s = others_states(&a, &id);
            !s.is_empty() && s.iter().all(|s| *s == 'T')
        },
        logs,
    );
    assert!(
        !counts(agent, Duration::from_millis(1500)),
        "the counter counts on while its node is stopped"
    );
    // The agent itself runs (it waits for a lease).
    assert_ne!(proc_status(agent).map(|s| s.0), Some('T'));

    a.resume();
    wait_for(
        "the sandbox's processes do not run again",
        Duration::from_secs(15),
        || others_states(&a, &id).iter().all(|s| *s != 'T'),
        logs,
    );
    assert!(
        counts(agent, Duration::from_secs(5)),
        "the counter does not count after its node went on\n{}",
        logs()
    );
    let r = http.get(&a.url(&format!("/v1/sandboxes/{id}")));
    assert_eq!(r.status, 200, "{}", r.text());
}

/// A control plane of the test's own: it answers joins and heartbeats with a lease of 3 s and
/// whatever `taken` the test sets, records what the node says it holds, and refuses (503)
/// while told to.
struct FakeControl {
    url: String,
    taken: Arc<Mutex<Vec<Value>>>,
    held: Arc<Mutex<HashMap<String, u64>>>,
    refuse: Arc<Mutex<bool>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeControl {
    fn start() -> FakeControl {
        let taken: Arc<Mutex<Vec<Value>>> = Arc::default();
        let held: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
        let refuse: Arc<Mutex<bool>> = Arc::default();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let (t, h, f) = (taken.clone(), held.clone(), refuse.clone());
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let answer = move |body: axum::body::Bytes| {
                    let (t, h, f) = (t.clone(), h.clone(), f.clone());
                    async move {
                        if *f.lock().unwrap_or_else(|e| e.into_inner()) {
                            return (
                                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                                axum::Json(json!({"error": {"code": "unavailable"}})),
                            );
                        }
                        let reg: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                        let mut held = h.lock().unwrap_or_else(|e| e.into_inner());
                        held.clear();
                        for s in reg["held"].as_array().into_iter().flatten() {
                            if let (Some(id), Some(epoch)) = (s["id"].as_str(), s["epoch"].as_u64())
                            {
                                held.insert(id.to_string(), epoch);
                            }
                        }
                        let taken = t.lock().unwrap_or_else(|e| e.into_inner()).clone();
                        (
                            axum::http::StatusCode::OK,
                            axum::Json(json!({
                                "object": "node_lease",
                                "id": "nod-fake0000000000",
                                "name": reg["name"],
                                "lease_until": "2099-01-01T00:00:00.000Z",
                                "lease_seconds": 3.0,
                                "taken": taken,
                            })),
                        )
                    }
                };
                let app = axum::Router::new()
                    .route("/internal/nodes", axum::routing::post(answer.clone()))
                    .route(
                        "/internal/nodes/{id}/heartbeat",
                        axum::routing::post(answer),
                    );
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(async {
                        let _ = rx.await;
                    })
                    .await;
            });
        });
        FakeControl {
            url,
            taken,
            held,
            refuse,
            stop: Some(tx),
            thread: Some(thread),
        }
    }

    fn held(&self) -> HashMap<String, u64> {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn set_taken(&self, t: Vec<Value>) {
        *self.taken.lock().unwrap_or_else(|e| e.into_inner()) = t;
    }

    fn set_refuse(&self, r: bool) {
        *self.refuse.lock().unwrap_or_else(|e| e.into_inner()) = r;
    }
}

impl Drop for FakeControl {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// (c) The node's side of the split-brain check: a sandbox the control plane answers
/// `taken` is removed (its processes, its files) and answers 409 `moved` (with `to` and
/// `epoch`), a release or takeover at a lower epoch 409 `wrong_epoch`, also after the node's
/// restart; the node's other sandbox is untouched. A node starts fenced until it joins.
#[test]
fn a_taken_sandbox_is_removed_and_answers_moved_across_a_restart() {
    let fake = FakeControl::start();
    let mut a = Node::start_at_url("lease-c", &fake.url, NodeOpts::default());
    let http = Http::new();
    wait_for(
        "the node is not unfenced after its join",
        Duration::from_secs(20),
        || lease_of(&http, &a)["fenced"] == false,
        || a.log_tail(40),
    );
    let gone = counting_sandbox(&http, &a.url(""));
    let kept = counting_sandbox(&http, &a.url(""));
    wait_for(
        "the heartbeats do not tell both sandboxes held",
        Duration::from_secs(10),
        || {
            let h = fake.held();
            h.contains_key(&gone) && h.contains_key(&kept)
        },
        || a.log_tail(40),
    );
    let held = fake.held()[&gone];
    assert!(!a.sandbox_processes(&gone).is_empty());
    assert!(!a.files_of(&gone).is_empty());

    let epoch = held + 3;
    fake.set_taken(vec![json!({"id": gone, "epoch": epoch, "to": "node-z"})]);
    let mut answer = None;
    wait_for(
        "the taken sandbox does not answer moved",
        Duration::from_secs(15),
        || {
            let r = http.get(&a.url(&format!("/v1/sandboxes/{gone}")));
            let moved = r.status == 409;
            answer = Some(r);
            moved
        },
        || a.log_tail(40),
    );
    let r = answer.expect("an answer");
    let v = r.json();
    assert_error(&r, 409, "moved", None);
    assert_eq!(v["to"], "node-z", "{v}");
    assert_eq!(v["epoch"], epoch, "{v}");
    wait_for(
        "the taken sandbox's processes are not gone",
        Duration::from_secs(10),
        || a.sandbox_processes(&gone).is_empty(),
        || a.log_tail(40),
    );
    assert!(a.files_of(&gone).is_empty(), "{:?}", a.files_of(&gone));
    fake.set_taken(Vec::new());
    wait_for(
        "the node still tells the taken sandbox held",
        Duration::from_secs(10),
        || !fake.held().contains_key(&gone),
        || a.log_tail(40),
    );
    // The other one runs on.
    let r = http.get(&a.url(&format!("/v1/sandboxes/{kept}")));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(counts(agent_pid(&a, &kept), Duration::from_secs(5)));
    let wrong_epochs = |a: &Node| {
        let r = http.post_json(
            &a.url(&format!("/internal/sandboxes/{gone}/release")),
            &json!({"epoch": held, "to": "node-y", "move_id": "mov-0000000000000000"}),
        );
        let v = r.json();
        assert_error(&r, 409, "wrong_epoch", Some("epoch"));
        assert_eq!(v["epoch"], epoch, "{v}");
        let r = http.post_json(
            &a.url(&format!("/internal/sandboxes/{gone}/takeover")),
            &json!({
                "epoch": held + 1,
                "from": {"id": "nod-y000000000000000", "name": "node-y", "url": "http://127.0.0.1:9"},
                "from_store": true,
                "wake": false,
            }),
        );
        assert_error(&r, 409, "wrong_epoch", Some("epoch"));
    };
    wrong_epochs(&a);

    // Restarted (SIGKILL), and its control plane away: fenced from its start.
    fake.set_refuse(true);
    a.kill();
    a.restart();
    let lease = lease_of(&http, &a);
    assert_eq!(lease["fenced"], true, "{lease}");
    let r = http.get(&a.url(&format!("/v1/sandboxes/{kept}")));
    let e = assert_error(&r, 503, "fenced", None);
    assert!(
        e["message"]
            .as_str()
            .is_some_and(|m| m.contains("since it started")),
        "{e}"
    );
    fake.set_refuse(false);
    wait_for(
        "the restarted node is not unfenced after its join",
        Duration::from_secs(20),
        || lease_of(&http, &a)["fenced"] == false,
        || a.log_tail(40),
    );
    let r = http.get(&a.url(&format!("/v1/sandboxes/{gone}")));
    let v = r.json();
    assert_error(&r, 409, "moved", None);
    assert_eq!(
        (&v["to"], &v["epoch"]),
        (&json!("node-z"), &json!(epoch)),
        "{v}"
    );
    wrong_epochs(&a);
    assert!(!fake.held().contains_key(&gone));
    let r = http.get(&a.url(&format!("/v1/sandboxes/{kept}")));
    assert_eq!(r.status, 200, "{}", r.text());
}
