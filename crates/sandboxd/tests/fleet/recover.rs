//! Recoveries and evacuations (issue #29), end to end: a control plane (node leases of 3 s)
//! and three real nodes sharing an object store (a directory), driven through `POST
//! /internal/nodes/{id}/recover|evacuate` and `GET /internal/batches/{id}`.
//!
//! - a node stopped (SIGSTOP) past its lease: recoverNode is `lease_held` at first, then 202;
//!   its two sleeping sandboxes come back on the other nodes from the store (a file, and a
//!   counter that goes on once woken), the one that never slept ends `node_lost` and stays on
//!   it; the node let go (SIGCONT) serves none of the recovered ones and keeps nothing of them
//!   (the split-brain check: the heartbeat's `taken`), and serves the lost one again;
//! - an evacuation of three sleeping sandboxes and a running one: all on other nodes, the
//!   running one running, the counts right, a second evacuation refused while it runs;
//! - the new node killed (SIGKILL) during a recovery and started again: each sandbox on exactly
//!   one node;
//! - the control plane killed during an evacuation and started again: the evacuation ends,
//!   each sandbox on exactly one node.
//!
//! Each on SQLite, and the first two on PostgreSQL too (when `SBX_TEST_PG_URL` is set).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::calls::At;
use crate::harness::{ControlPlane, FleetStore, Node, NodeOpts, PgDatabase};
use crate::http::{assert_error, Http, Reply};

const NAMES: [&str; 3] = ["node-a", "node-b", "node-c"];

/// A control plane and three nodes on one object store (dropped: the nodes, the control
/// plane, the store, the database).
struct Fleet {
    nodes: Vec<Node>,
    ctl: ControlPlane,
    /// A second control plane on the same PostgreSQL database, standing by (`start_pair`).
    standby: Option<ControlPlane>,
    store: FleetStore,
    _db: Option<PgDatabase>,
    http: Http,
    ids: HashMap<String, String>,
}

impl Fleet {
    fn start(db: Option<PgDatabase>) -> Fleet {
        Fleet::start_copies(db, false)
    }

    /// Two control planes on one PostgreSQL database (the first active, the second standing
    /// by); the nodes are given both.
    fn start_pair(db: PgDatabase) -> Fleet {
        Fleet::start_copies(Some(db), true)
    }

    fn start_copies(db: Option<PgDatabase>, pair: bool) -> Fleet {
        let store = FleetStore::dir();
        let db_url = db.as_ref().map(|d| d.url.clone());
        let copy = |name: &str| {
            let args: Vec<String> = ["--name", name, "--control-lease-seconds", "3"]
                .iter()
                .map(|s| s.to_string())
                .collect();
            ControlPlane::start_args(db_url.as_deref(), Some(&store), &args)
        };
        let ctl = copy("cp-1");
        let standby = pair.then(|| {
            // The first copy takes the lease before the second starts.
            let http = Http::new();
            let deadline = Instant::now() + Duration::from_secs(10);
            while http.get(&ctl.url("/healthz")).json()["role"] != "active" {
                assert!(Instant::now() < deadline, "cp-1 never active");
                std::thread::sleep(Duration::from_millis(50));
            }
            copy("cp-2")
        });
        let opts = || NodeOpts {
            store: Some(&store),
            other_build: false,
        };
        let nodes = NAMES
            .iter()
            .map(|n| match &standby {
                Some(s) => Node::start_joining(n, &[&ctl, s], opts()),
                None => Node::start_with(n, &ctl, opts()),
            })
            .collect();
        let mut f = Fleet {
            nodes,
            ctl,
            standby,
            store,
            _db: db,
            http: Http::new(),
            ids: HashMap::new(),
        };
        for name in NAMES {
            let n = f.wait_ready(name, Duration::from_secs(30));
            let id = n["id"].as_str().unwrap_or_default().to_string();
            f.ids.insert(name.to_string(), id);
        }
        f
    }

    fn node(&self, name: &str) -> &Node {
        let i = NAMES.iter().position(|n| *n == name).unwrap_or(0);
        &self.nodes[i]
    }

    fn node_mut(&mut self, name: &str) -> &mut Node {
        let i = NAMES.iter().position(|n| *n == name).unwrap_or(0);
        &mut self.nodes[i]
    }

    fn logs(&self) -> String {
        let mut s = self.ctl.log_tail(40);
        for n in &self.nodes {
            s.push('\n');
            s.push_str(&n.log_tail(20));
        }
        s
    }

    fn url(&self, path: &str) -> String {
        self.ctl.url(path)
    }

    fn get(&self, path: &str) -> Reply {
        self.http.get(&self.url(path))
    }

    fn post(&self, path: &str, body: &Value) -> Reply {
        self.http.post_json(&self.url(path), body)
    }

    /// A POST sent once more where it met a connection the control plane had closed (a
    /// pooled one: ureq sends a POST again by itself only where it is idempotent).
    fn post_again(&self, path: &str, body: &Value) -> Reply {
        let url = self.url(path);
        let text = body.to_string();
        let mut tried = None;
        for _ in 0..2 {
            match self.http.send(
                "POST",
                &url,
                &[],
                Some(("application/json", text.as_bytes())),
            ) {
                Ok(r) => {
                    let status = r.status();
                    let headers = r
                        .headers_names()
                        .into_iter()
                        .filter_map(|n| r.header(&n).map(|v| (n.clone(), v.to_string())))
                        .collect();
                    let mut body = Vec::new();
                    std::io::Read::read_to_end(&mut r.into_reader(), &mut body)
                        .unwrap_or_else(|e| panic!("POST {url}: reading the answer: {e}"));
                    return Reply {
                        status,
                        headers,
                        body,
                    };
                }
                Err(e) => tried = Some(e),
            }
        }
        panic!("POST {url}: {}", tried.unwrap_or_default())
    }

    fn wait_ready(&self, name: &str, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let r = self.get(&format!("/internal/nodes/{name}"));
            if r.status == 200 && r.json()["state"] == "ready" {
                return r.json();
            }
            assert!(
                Instant::now() < deadline,
                "node {name} is not ready after {timeout:?}: {}\n{}",
                r.text(),
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn drain(&self, name: &str, draining: bool) {
        let r = self.post(
            &format!("/internal/nodes/{name}/drain"),
            &json!({ "draining": draining }),
        );
        assert_eq!(r.status, 200, "drain {name}: {}", r.text());
    }

    /// A kept sandbox made through the control plane on `on` (the others draining meanwhile),
    /// running: its id.
    fn create_on(&self, on: &str) -> String {
        for n in NAMES.iter().filter(|n| **n != on) {
            self.drain(n, true);
        }
        let r = self.post("/v1/sandboxes", &json!({ "sleep_after_seconds": null }));
        for n in NAMES.iter().filter(|n| **n != on) {
            self.drain(n, false);
        }
        assert_eq!(r.status, 201, "create: {}\n{}", r.text(), self.logs());
        let v = r.json();
        assert_eq!(v["node"]["name"], on, "{v}");
        let id = v["id"].as_str().unwrap_or_default().to_string();
        self.wait_status(&id, "running", Duration::from_secs(60));
        id
    }

    /// Its object through the control plane. A 503 that is retryable (a node fenced while
    /// the control plane was away, unfenced at its next heartbeat) is asked again for a while.
    fn sandbox(&self, id: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let r = self.get(&format!("/v1/sandboxes/{id}"));
            let again = r.status == 503 && r.json()["error"]["retryable"] == true;
            if !again || Instant::now() > deadline {
                assert_eq!(r.status, 200, "GET {id}: {}\n{}", r.text(), self.logs());
                return r.json();
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The sandboxes' calls through the control plane.
    fn at(&self) -> At<'_> {
        At {
            http: &self.http,
            base: self.ctl.url(""),
            logs: Box::new(|| self.logs()),
        }
    }

    fn wait_status(&self, id: &str, status: &str, timeout: Duration) -> Value {
        self.at().wait_status(id, status, timeout)
    }

    fn sh(&self, id: &str, line: &str) -> String {
        self.at().sh(id, line)
    }

    fn count(&self, id: &str) -> u64 {
        self.at().count(id)
    }

    fn start_counter(&self, id: &str) {
        self.at().start_counter(id);
    }

    /// Asleep through the control plane.
    fn sleep(&self, id: &str) {
        let r = self.post(&format!("/v1/sandboxes/{id}/sleep"), &json!({}));
        assert_eq!(r.status, 200, "sleep: {}", r.text());
        assert_eq!(r.json()["status"], "sleeping", "{}", r.text());
    }

    /// Waits until the store holds a sleep of `id` at `epoch` (its upload is in the
    /// background).
    fn wait_stored(&self, id: &str, epoch: u64) {
        let store = self.store.open();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Ok(m) = rt.block_on(store.manifest(id, epoch)) {
                if m.kind == sbx_blob::Kind::Sleep {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "the store holds no sleep of {id} at e{epoch}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Polls the batch until it has ended.
    fn wait_batch(&self, id: &str, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let r = self.get(&format!("/internal/batches/{id}"));
            assert_eq!(
                r.status,
                200,
                "GET the batch: {}\n{}",
                r.text(),
                self.logs()
            );
            let b = r.json();
            if !b["ended_at"].is_null() {
                return b;
            }
            assert!(
                Instant::now() < deadline,
                "the batch has not ended after {timeout:?}: {b}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// recoverNode of `name` stopped: 409 `lease_held` (lease_until beside) while its lease
    /// may be held, then 202: the batch.
    fn recover(&self, name: &str) -> Value {
        let path = format!("/internal/nodes/{name}/recover");
        let r = self.post_again(&path, &json!({}));
        let e = assert_error(&r, 409, "lease_held", None);
        assert_eq!(e["retryable"], false, "{e}");
        let until = r.json()["lease_until"].as_str().unwrap_or("").to_string();
        assert!(until.ends_with('Z'), "{}", r.text());
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let r = self.post_again(&path, &json!({}));
            if r.status == 202 {
                let b = r.json();
                assert_eq!(b["object"], "batch", "{b}");
                assert_eq!(b["kind"], "recovery", "{b}");
                assert!(b["id"].as_str().is_some_and(|i| i.starts_with("rcv-")));
                return b;
            }
            assert_error(&r, 409, "lease_held", None);
            assert!(Instant::now() < deadline, "still lease_held: {}", r.text());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Whether `node`'s own list has `id`.
    fn listed(&self, node: &str, id: &str) -> bool {
        let r = self
            .http
            .get(&self.node(node).url("/v1/sandboxes?limit=1000"));
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["data"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|s| s["id"] == id)
    }

    /// The sandbox is on exactly one node, the table's: it lists it (and runs it where
    /// `running`); no other node lists it or runs anything of it. That node's name.
    fn on_exactly_one(&self, id: &str, skip: &[&str]) -> String {
        let s = self.sandbox(id);
        let holder = s["node"]["name"].as_str().unwrap_or_default().to_string();
        assert!(self.listed(&holder, id), "{holder} does not list {id}: {s}");
        if s["status"] == "running" {
            assert!(
                !self.node(&holder).sandbox_processes(id).is_empty(),
                "{holder} runs nothing of {id}"
            );
        }
        for other in NAMES.iter().filter(|n| **n != holder && !skip.contains(n)) {
            assert!(!self.listed(other, id), "{other} lists {id} too");
            let p = self.node(other).sandbox_processes(id);
            assert!(p.is_empty(), "{other} runs processes of {id}: {p:?}");
        }
        holder
    }
}

/// The last move of `id` in the batch (a recovery refused tries once more elsewhere).
fn move_of<'a>(batch: &'a Value, id: &str) -> &'a Value {
    batch["moves"]
        .as_array()
        .into_iter()
        .flatten()
        .rfind(|m| m["sandbox_id"] == id)
        .unwrap_or_else(|| panic!("no move of {id}: {batch}"))
}

/// (a) A node stopped past its lease is recovered; let go, it serves none of what was taken.
fn a_stopped_node_is_recovered(db: Option<PgDatabase>) {
    let f = Fleet::start(db);
    // On A: one with a file and a counter, asleep; one asleep; one that never slept.
    let s1 = f.create_on("node-a");
    f.sh(&s1, "echo recovered-file > /root/kept.txt");
    f.start_counter(&s1);
    std::thread::sleep(Duration::from_millis(300));
    let before = f.count(&s1);
    f.sleep(&s1);
    let s2 = f.create_on("node-a");
    f.sleep(&s2);
    let s3 = f.create_on("node-a");
    f.wait_stored(&s1, 1);
    f.wait_stored(&s2, 1);

    f.node("node-a").pause();
    let b = f.recover("node-a");
    let bid = b["id"].as_str().unwrap_or_default().to_string();
    assert_eq!(b["node"]["name"], "node-a", "{b}");
    let b = f.wait_batch(&bid, Duration::from_secs(180));
    assert_eq!(
        b["counts"],
        json!({"total": 3, "done": 2, "failed": 1, "running": 0, "pending": 0}),
        "{b}\n{}",
        f.logs()
    );
    for id in [&s1, &s2] {
        let m = move_of(&b, id);
        assert_eq!(m["why"], "recovery", "{m}");
        assert_eq!(m["batch"], bid.as_str(), "{m}");
        assert_eq!(m["from_store"], true, "{m}");
        assert_eq!(m["step"], "done", "{m}");
        assert_eq!(m["takeover"]["epoch"], 4, "{m}");
        assert_eq!(m["takeover"]["source"], "store", "{m}");
        let s = f.sandbox(id);
        assert_eq!(s["epoch"], 4, "{s}");
        assert_eq!(s["status"], "sleeping", "it slept: {s}");
        assert_ne!(s["node"]["name"], "node-a", "{s}");
    }
    let m = move_of(&b, &s3);
    assert_eq!(m["step"], "failed", "{m}");
    assert_eq!(m["error"]["code"], "node_lost", "{m}");
    // Its node is lost: its calls are 503 meanwhile.
    let r = f.get(&format!("/v1/sandboxes/{s3}"));
    assert_error(&r, 503, "unavailable", None);

    // Woken where it went: its file, and its counter going on from where it slept.
    let r = f.post(&format!("/v1/sandboxes/{s1}/wake"), &json!({}));
    assert_eq!(r.status, 200, "wake: {}\n{}", r.text(), f.logs());
    assert_eq!(f.sh(&s1, "cat /root/kept.txt"), "recovered-file\n");
    let first = f.count(&s1);
    std::thread::sleep(Duration::from_millis(600));
    let second = f.count(&s1);
    assert!(
        first >= before,
        "the counter began again: {first} < {before}"
    );
    assert!(second > first, "the counter stopped: {first} then {second}");

    // A let go: its heartbeat says s1 and s2 are taken; it removes them and serves neither.
    f.node("node-a").resume();
    f.wait_ready("node-a", Duration::from_secs(30));
    let a = f.node("node-a");
    let deadline = Instant::now() + Duration::from_secs(30);
    for id in [&s1, &s2] {
        loop {
            let r = f.http.get(&a.url(&format!("/v1/sandboxes/{id}")));
            let gone =
                r.status == 409 && a.sandbox_processes(id).is_empty() && a.files_of(id).is_empty();
            if gone {
                assert_eq!(r.json()["error"]["code"], "moved", "{}", r.text());
                break;
            }
            assert!(
                Instant::now() < deadline,
                "node-a still has {id}: {} {}, processes {:?}, files {:?}\n{}",
                r.status,
                r.text(),
                a.sandbox_processes(id),
                a.files_of(id),
                f.logs()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
        assert!(!f.listed("node-a", id), "node-a lists {id}");
    }
    for id in [&s1, &s2] {
        f.on_exactly_one(id, &[]);
    }
    // The lost one was not taken (the fleet had it nowhere else): A serves it again.
    let s = f.wait_status(&s3, "running", Duration::from_secs(30));
    assert_eq!(s["node"]["name"], "node-a", "{s}");
    assert_eq!(s["epoch"], 1, "{s}");
    assert_eq!(f.on_exactly_one(&s3, &[]), "node-a");
}

/// (b) An evacuation: three asleep and one running, all to other nodes.
fn a_node_is_evacuated(db: Option<PgDatabase>) {
    let f = Fleet::start(db);
    let mut asleep = Vec::new();
    for i in 0..3 {
        let id = f.create_on("node-a");
        f.sh(&id, &format!("echo {i} > /root/n"));
        f.sleep(&id);
        asleep.push(id);
    }
    let running = f.create_on("node-a");
    f.start_counter(&running);
    let r = f.post_again("/internal/nodes/node-a/evacuate", &json!({}));
    assert_eq!(r.status, 202, "evacuate: {}\n{}", r.text(), f.logs());
    let b = r.json();
    let bid = b["id"].as_str().unwrap_or_default().to_string();
    assert!(bid.starts_with("evc-"), "{b}");
    assert_eq!(b["kind"], "evacuation", "{b}");
    assert_eq!(b["counts"]["total"], 4, "{b}");
    let r = f.post_again("/internal/nodes/node-a/evacuate", &json!({}));
    assert_error(&r, 409, "already_moving", None);
    assert_eq!(r.json()["batch_id"], bid.as_str(), "{}", r.text());
    assert_eq!(f.get("/internal/nodes/node-a").json()["state"], "draining");
    let b = f.wait_batch(&bid, Duration::from_secs(300));
    assert_eq!(
        b["counts"],
        json!({"total": 4, "done": 4, "failed": 0, "running": 0, "pending": 0}),
        "{b}\n{}",
        f.logs()
    );
    // The running one last, woken there.
    let moves = b["moves"].as_array().cloned().unwrap_or_default();
    assert_eq!(moves[3]["sandbox_id"], running.as_str(), "{b}");
    assert_eq!(moves[3]["wake"], true, "{b}");
    for m in &moves {
        assert_eq!(m["why"], "evacuation", "{m}");
        assert_eq!(m["batch"], bid.as_str(), "{m}");
    }
    for (i, id) in asleep.iter().enumerate() {
        let s = f.sandbox(id);
        assert_eq!(s["status"], "sleeping", "{s}");
        assert_eq!(s["epoch"], 2, "{s}");
        assert_ne!(f.on_exactly_one(id, &[]), "node-a");
        assert_eq!(f.sh(id, "cat /root/n"), format!("{i}\n"));
    }
    let s = f.sandbox(&running);
    assert_eq!(s["status"], "running", "{s}");
    assert_ne!(f.on_exactly_one(&running, &[]), "node-a");
    let first = f.count(&running);
    std::thread::sleep(Duration::from_millis(600));
    assert!(f.count(&running) > first, "the counter stopped");
    let r = f.get("/internal/batches?node_id=node-a");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["data"][0]["id"], bid.as_str());
}

/// (c) The new node killed (SIGKILL) during a recovery, and started again.
fn a_new_node_killed_during_a_recovery(db: Option<PgDatabase>) {
    let mut f = Fleet::start(db);
    let mut ids = Vec::new();
    for _ in 0..2 {
        let id = f.create_on("node-a");
        f.sh(&id, "head -c 20000000 /dev/urandom > /root/big && sync");
        f.sleep(&id);
        ids.push(id);
    }
    for id in &ids {
        f.wait_stored(id, 1);
    }
    // Only B takes them.
    f.drain("node-c", true);
    f.node("node-a").pause();
    let b = f.recover("node-a");
    let bid = b["id"].as_str().unwrap_or_default().to_string();
    // B killed as soon as it writes something of one of them.
    let deadline = Instant::now() + Duration::from_secs(60);
    while ids
        .iter()
        .all(|id| f.node("node-b").files_of(id).is_empty())
    {
        assert!(
            Instant::now() < deadline,
            "node-b took nothing over\n{}",
            f.logs()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    f.node_mut("node-b").kill();
    std::thread::sleep(Duration::from_millis(500));
    f.node_mut("node-b").restart();
    let b = f.wait_batch(&bid, Duration::from_secs(240));
    eprintln!("the recovery ended: {}", b["counts"]);
    assert!(b["counts"]["total"].as_u64() >= Some(2), "{b}");
    assert_eq!(b["counts"]["running"], 0, "{b}");
    f.wait_ready("node-b", Duration::from_secs(30));
    for id in &ids {
        let m = move_of(&b, id);
        let r = f.get(&format!("/v1/sandboxes/{id}"));
        if m["step"] == "done" {
            assert_eq!(r.status, 200, "{}", r.text());
            assert_eq!(r.json()["epoch"], 4, "{}", r.text());
            assert_eq!(f.on_exactly_one(id, &["node-a"]), "node-b");
        } else {
            // Back on the lost node (its calls 503), and B keeps nothing of it.
            assert_error(&r, 503, "unavailable", None);
            assert!(!f.listed("node-b", id), "node-b lists {id}");
            assert!(f.node("node-b").sandbox_processes(id).is_empty());
        }
        assert!(!f.listed("node-c", id));
    }
}

/// (d) The control plane killed (SIGKILL) during an evacuation, and started again.
/// (d) The control plane killed mid-evacuation: started again, or (`pair`) its standby takes
/// the lease and goes on with the batch.
fn a_control_plane_killed_mid_evacuation(db: Option<PgDatabase>, pair: bool) {
    let mut f = match (db, pair) {
        (Some(db), true) => Fleet::start_pair(db),
        (db, _) => Fleet::start(db),
    };
    let mut ids = Vec::new();
    for _ in 0..6 {
        let id = f.create_on("node-a");
        f.sleep(&id);
        ids.push(id);
    }
    let r = f.post_again("/internal/nodes/node-a/evacuate", &json!({}));
    assert_eq!(r.status, 202, "evacuate: {}\n{}", r.text(), f.logs());
    let bid = r.json()["id"].as_str().unwrap_or_default().to_string();
    // Killed once a move is under way (some released, some not placed yet).
    std::thread::sleep(Duration::from_millis(800));
    f.ctl.kill();
    match f.standby.take() {
        Some(standby) => {
            // The standby is the control plane from here (the dead copy is dropped last).
            let dead = std::mem::replace(&mut f.ctl, standby);
            f.standby = Some(dead);
            let deadline = Instant::now() + Duration::from_secs(15);
            while f.get("/healthz").json()["role"] != "active" {
                assert!(
                    Instant::now() < deadline,
                    "cp-2 never took over\n{}",
                    f.logs()
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        None => {
            std::thread::sleep(Duration::from_millis(500));
            f.ctl.restart();
        }
    }
    let b = f.wait_batch(&bid, Duration::from_secs(300));
    assert_eq!(b["counts"]["total"], 6, "{b}");
    assert_eq!(b["counts"]["running"], 0, "{b}");
    // B and C ready; A draining (an evacuation leaves it so).
    for n in ["node-b", "node-c"] {
        f.wait_ready(n, Duration::from_secs(30));
    }
    assert_eq!(f.get("/internal/nodes/node-a").json()["state"], "draining");
    for id in &ids {
        let m = move_of(&b, id);
        let holder = f.on_exactly_one(id, &[]);
        if m["step"] == "done" {
            assert_ne!(holder, "node-a", "{m}");
        } else {
            assert_eq!(holder, "node-a", "{m}");
        }
    }
}

fn postgres() -> Option<PgDatabase> {
    match std::env::var("SBX_TEST_PG_URL") {
        Ok(url) => Some(PgDatabase::create(&url)),
        Err(_) => {
            eprintln!("SBX_TEST_PG_URL is not set: skipped on PostgreSQL");
            None
        }
    }
}

#[test]
fn a_stopped_node_is_recovered_on_sqlite() {
    a_stopped_node_is_recovered(None);
}

#[test]
fn a_stopped_node_is_recovered_on_postgres() {
    if let Some(db) = postgres() {
        a_stopped_node_is_recovered(Some(db));
    }
}

#[test]
fn a_node_is_evacuated_on_sqlite() {
    a_node_is_evacuated(None);
}

#[test]
fn a_node_is_evacuated_on_postgres() {
    if let Some(db) = postgres() {
        a_node_is_evacuated(Some(db));
    }
}

#[test]
fn a_new_node_killed_during_a_recovery_on_sqlite() {
    a_new_node_killed_during_a_recovery(None);
}

#[test]
fn a_control_plane_killed_mid_evacuation_on_sqlite() {
    a_control_plane_killed_mid_evacuation(None, false);
}

#[test]
fn the_active_control_plane_killed_mid_evacuation_its_standby_ends_it() {
    let Some(db) = postgres() else {
        return;
    };
    a_control_plane_killed_mid_evacuation(Some(db), true);
}
