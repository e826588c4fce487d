//! Moves of sandboxes between the fleet's nodes (issue #28, second half), end to end: a control
//! plane and two real nodes sharing an object store (a directory, or SeaweedFS over S3), driven
//! through `POST /internal/moves` and the fleet's `/v1`, the nodes also called directly.
//!
//! - a sleeping and a running sandbox move: the table names the new node at epoch 2; its
//!   counter process goes on from where it was, its file is there, an old command's object and
//!   output read the same; the old node answers 409 `moved` (to, epoch) and runs nothing of it;
//!   an event stream opened on the old node ends with `sandbox_moved`;
//! - fencing: a release or a takeover at an epoch the node does not hold is 409 `wrong_epoch`;
//! - a takeover refused (the new node is of another build: `build_missing`) is reclaimed: the
//!   move ends `failed`, the sandbox back on the old node at epoch 3 and working;
//! - the control plane killed mid-move and started again, the new node killed mid-takeover and
//!   started again: the move ends done or failed, the sandbox on exactly one node, nothing lost;
//! - a second move while one runs: 409 `already_moving`; a sandbox with a volume: 409
//!   `not_movable`.
//!
//! Each on SQLite and on PostgreSQL (when `SBX_TEST_PG_URL` is set); the running sandbox's
//! move also through SeaweedFS (when `weed` is found).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::calls::At;
use crate::harness::{ControlPlane, FleetStore, Node, NodeOpts, PgDatabase};
use crate::http::{assert_error, Http, Reply};

/// The keys of a move object, exactly (the spec's `move`).
const MOVE_KEYS: [&str; 20] = [
    "attempts",
    "batch",
    "created_at",
    "ended_at",
    "epoch",
    "error",
    "from",
    "from_store",
    "id",
    "next_attempt_at",
    "object",
    "project_id",
    "release",
    "sandbox_id",
    "step",
    "takeover",
    "to",
    "updated_at",
    "wake",
    "why",
];

/// A control plane and two nodes on one object store. Dropped in this order: the nodes, the
/// control plane, the store (SeaweedFS stopped), the database.
struct Fleet {
    a: Node,
    b: Node,
    ctl: ControlPlane,
    store: FleetStore,
    _db: Option<PgDatabase>,
    http: Http,
    /// The nodes' ids by name.
    ids: HashMap<String, String>,
}

impl Fleet {
    /// The fleet on `db` (None: SQLite) and `store`; node B of another build when
    /// `b_other_build`.
    fn start(db: Option<PgDatabase>, store: FleetStore, b_other_build: bool) -> Fleet {
        let ctl = ControlPlane::start_with(db.as_ref().map(|d| d.url.as_str()), Some(&store));
        let a = Node::start_with(
            "node-a",
            &ctl,
            NodeOpts {
                store: Some(&store),
                other_build: false,
            },
        );
        let b = Node::start_with(
            "node-b",
            &ctl,
            NodeOpts {
                store: Some(&store),
                other_build: b_other_build,
            },
        );
        let mut f = Fleet {
            a,
            b,
            ctl,
            store,
            _db: db,
            http: Http::new(),
            ids: HashMap::new(),
        };
        for name in ["node-a", "node-b"] {
            let n = f.wait_ready(name, Duration::from_secs(30));
            let id = n["id"].as_str().unwrap_or_default().to_string();
            f.ids.insert(name.to_string(), id);
        }
        f
    }

    fn url(&self, path: &str) -> String {
        self.ctl.url(path)
    }

    fn node(&self, name: &str) -> &Node {
        if name == self.a.name {
            &self.a
        } else {
            &self.b
        }
    }

    fn other(name: &str) -> &'static str {
        if name == "node-a" {
            "node-b"
        } else {
            "node-a"
        }
    }

    /// The last lines of every process's log (for a failure's message).
    fn logs(&self) -> String {
        format!(
            "{}\n{}\n{}",
            self.ctl.log_tail(30),
            self.a.log_tail(30),
            self.b.log_tail(30)
        )
    }

    fn get(&self, path: &str) -> Reply {
        self.http.get(&self.url(path))
    }

    fn post(&self, path: &str, body: &Value) -> Reply {
        self.http.post_json(&self.url(path), body)
    }

    /// Node `name`'s object once the control plane has it ready.
    fn wait_ready(&self, name: &str, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let r = self.get(&format!("/internal/nodes/{name}"));
            if r.status == 200 && r.json()["state"] == "ready" {
                return r.json();
            }
            assert!(
                Instant::now() < deadline,
                "node {name} is not ready after {timeout:?}: {} {}\n{}",
                r.status,
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
        assert_eq!(r.status, 200, "drain {name} {draining}: {}", r.text());
    }

    /// A kept sandbox made through the control plane on node `on` (the other node draining
    /// meanwhile, so that placement has no choice), running: its object.
    fn create_on(&self, on: &str, body: &Value) -> Value {
        let other = Fleet::other(on);
        self.drain(other, true);
        let r = self.post("/v1/sandboxes", body);
        self.drain(other, false);
        assert_eq!(r.status, 201, "create: {}\n{}", r.text(), self.logs());
        let v = r.json();
        assert_eq!(v["node"]["name"], on, "{v}");
        assert_eq!(v["epoch"], 1, "{v}");
        let id = v["id"].as_str().unwrap_or_default().to_string();
        self.wait_status(&id, "running", Duration::from_secs(60))
    }

    /// The sandbox through the control plane.
    fn sandbox(&self, id: &str) -> Value {
        let r = self.get(&format!("/v1/sandboxes/{id}"));
        assert_eq!(r.status, 200, "GET {id}: {}\n{}", r.text(), self.logs());
        r.json()
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

    fn sh_obj(&self, id: &str, line: &str) -> Value {
        self.at().sh_obj(id, line)
    }

    fn sh(&self, id: &str, line: &str) -> String {
        self.at().sh(id, line)
    }

    fn count(&self, id: &str) -> u64 {
        self.at().count(id)
    }

    /// The counter started as a command of its own: its id, once it has counted.
    fn start_counter(&self, id: &str) -> String {
        self.at().start_counter(id)
    }

    /// The counter goes on from `before` (it was not started again, nor stopped): two reads,
    /// the first at least `before`, the second above the first.
    fn counter_goes_on(&self, id: &str, before: u64) {
        let first = self.count(id);
        std::thread::sleep(Duration::from_millis(600));
        let second = self.count(id);
        assert!(
            first >= before,
            "the counter began again: {first} after {before} before the move"
        );
        assert!(second > first, "the counter stopped: {first} then {second}");
    }

    fn put_file(&self, id: &str, path: &str, data: &[u8]) {
        let r = self.http.call(
            "PUT",
            &self.url(&format!("/v1/sandboxes/{id}/files?path={path}")),
            &[],
            Some(("application/octet-stream", data)),
        );
        assert!(
            r.status == 200 || r.status == 201,
            "PUT {path}: {}",
            r.text()
        );
    }

    fn file_is(&self, id: &str, path: &str, data: &[u8]) {
        let r = self.get(&format!("/v1/sandboxes/{id}/files?path={path}"));
        assert_eq!(r.status, 200, "GET {path}: {}", r.text());
        assert!(
            r.body == data,
            "{path} came back other: {} bytes, {} written",
            r.body.len(),
            data.len()
        );
    }

    /// A command's object and its output (JSON), through the control plane.
    fn command(&self, id: &str, exec: &str) -> (Value, Value) {
        let o = self.get(&format!("/v1/sandboxes/{id}/exec/{exec}"));
        assert_eq!(o.status, 200, "{}", o.text());
        let out = self.get(&format!("/v1/sandboxes/{id}/exec/{exec}/output"));
        assert_eq!(out.status, 200, "{}", out.text());
        (o.json(), out.json())
    }

    /// `POST /internal/moves`: 202 and the move, checked against the sandbox and the nodes.
    fn start_move(&self, id: &str, from: &str, to: &str, wake: Option<bool>) -> Value {
        let mut body = json!({ "sandbox_id": id, "to": to });
        if let Some(w) = wake {
            body["wake"] = json!(w);
        }
        let r = self.post("/internal/moves", &body);
        assert_eq!(
            r.status,
            202,
            "POST /internal/moves: {}\n{}",
            r.text(),
            self.logs()
        );
        let m = r.json();
        check_move_shape(&m);
        assert_eq!(m["sandbox_id"], id, "{m}");
        assert_eq!(m["from"]["name"], from, "{m}");
        assert_eq!(m["from"]["id"], self.ids[from].as_str(), "{m}");
        assert_eq!(m["to"]["name"], to, "{m}");
        assert_eq!(m["to"]["id"], self.ids[to].as_str(), "{m}");
        assert_eq!(m["from_store"], false, "{m}");
        assert!(
            ["releasing", "taking_over", "done"].contains(&m["step"].as_str().unwrap_or("")),
            "{m}"
        );
        m
    }

    /// The move as it is.
    fn move_now(&self, move_id: &str) -> Value {
        let r = self.get(&format!("/internal/moves/{move_id}"));
        assert_eq!(r.status, 200, "GET the move: {}\n{}", r.text(), self.logs());
        let m = r.json();
        check_move_shape(&m);
        m
    }

    /// Polls the move until it is over (done or failed), within `timeout`.
    fn wait_move(&self, move_id: &str, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let m = self.move_now(move_id);
            if m["step"] == "done" || m["step"] == "failed" {
                assert!(
                    m["ended_at"].as_str().is_some_and(|t| t.ends_with('Z')),
                    "{m}"
                );
                assert_eq!(m["next_attempt_at"], Value::Null, "{m}");
                return m;
            }
            assert!(
                Instant::now() < deadline,
                "the move is not over after {timeout:?}: {m}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Polls the move until it is at `step`, within `timeout`; panics if it ends first.
    fn wait_step(&self, move_id: &str, step: &str, every: Duration, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let m = self.move_now(move_id);
            if m["step"] == step {
                return m;
            }
            assert!(
                m["step"] != "done" && m["step"] != "failed",
                "the move ended before it was seen {step}: {m}\n{}",
                self.logs()
            );
            assert!(
                Instant::now() < deadline,
                "the move is not {step} after {timeout:?}: {m}\n{}",
                self.logs()
            );
            std::thread::sleep(every);
        }
    }

    /// After a move to `to` (node name) at `epoch`: the control plane names the node and the
    /// epoch, the node has it in its list, the other not.
    fn is_on(&self, id: &str, on: &str, epoch: u64) -> Value {
        let s = self.sandbox(id);
        assert_eq!(s["node"]["name"], on, "{s}");
        assert_eq!(s["node"]["id"], self.ids[on].as_str(), "{s}");
        assert_eq!(s["epoch"], epoch, "{s}");
        assert!(
            listed(self.node(on), id),
            "{on}'s own list does not have {id}"
        );
        s
    }

    /// Node `name` runs nothing of `id` (no process in its cgroup) and does not list it; it
    /// answers its calls 409 `moved` (to `to`, at `epoch`), and once it forgot it (the control
    /// plane's forget after the move) keeps no file of it.
    fn gone_from(&self, name: &str, id: &str, to: &str, epoch: u64) {
        let node = self.node(name);
        let r = self.http.get(&node.url(&format!("/v1/sandboxes/{id}")));
        assert_moved(&r, to, epoch);
        let r = self.http.post_json(
            &node.url(&format!("/v1/sandboxes/{id}/exec")),
            &json!({ "command": "true", "wait_seconds": 5 }),
        );
        assert_moved(&r, to, epoch);
        let r = self
            .http
            .get(&node.url(&format!("/v1/sandboxes/{id}/files?path=/tmp/c")));
        assert_moved(&r, to, epoch);
        assert!(!listed(node, id), "{name} still lists {id}");
        self.runs_nothing_of(name, id);
        // The forget comes after the move is done: its files go within a while.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = node.files_of(id);
            if left.is_empty() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{name} keeps files of {id} 30 s after the move: {left:?}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
        // Forgotten: still `moved`.
        let r = self.http.get(&node.url(&format!("/v1/sandboxes/{id}")));
        assert_moved(&r, to, epoch);
    }

    /// Node `name` runs no process of `id`, and does not list it.
    fn runs_nothing_of(&self, name: &str, id: &str) {
        let node = self.node(name);
        let procs = node.sandbox_processes(id);
        assert!(procs.is_empty(), "{name} runs processes of {id}: {procs:?}");
        assert!(!listed(node, id), "{name} lists {id}");
    }

    /// Node `name` runs processes of `id`.
    fn runs(&self, name: &str, id: &str) {
        let procs = self.node(name).sandbox_processes(id);
        assert!(!procs.is_empty(), "{name} runs no process of {id}");
    }

    fn delete(&self, id: &str) {
        let r = self.http.delete(&self.url(&format!("/v1/sandboxes/{id}")));
        assert_eq!(r.status, 200, "DELETE {id}: {}\n{}", r.text(), self.logs());
    }
}

/// Whether node `node`'s own `GET /v1/sandboxes` has `id`.
fn listed(node: &Node, id: &str) -> bool {
    let http = Http::new();
    let r = http.get(&node.url("/v1/sandboxes?limit=1000"));
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["data"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|s| s["id"] == id)
}

/// A move object with the spec's keys, exactly, and their types.
fn check_move_shape(m: &Value) {
    let mut keys: Vec<&str> = m
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {m}"))
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    assert_eq!(keys, MOVE_KEYS, "{m}");
    assert_eq!(m["object"], "move", "{m}");
    let id = m["id"].as_str().unwrap_or_default();
    assert!(
        id.len() == 20
            && id.starts_with("mov-")
            && id[4..]
                .bytes()
                .all(|c| c.is_ascii_digit() || (c.is_ascii_lowercase() && !b"ilou".contains(&c))),
        "{m}"
    );
    assert!(m["epoch"].as_u64().is_some_and(|e| e >= 1), "{m}");
    assert!(m["attempts"].as_u64().is_some(), "{m}");
    assert!(
        m["wake"].is_boolean() && m["from_store"].is_boolean(),
        "{m}"
    );
    assert!(m["why"].is_string() && m["project_id"].is_string(), "{m}");
    assert_eq!(m["batch"], Value::Null, "{m}");
    for k in ["created_at", "updated_at"] {
        assert!(m[k].as_str().is_some_and(|t| t.ends_with('Z')), "{k}: {m}");
    }
}

/// A 409 `moved` with `to` and `epoch` beside the error.
fn assert_moved(r: &Reply, to: &str, epoch: u64) {
    assert_code(r, 409, "moved");
    let v = r.json();
    assert_eq!(v["to"], to, "{v}");
    assert_eq!(v["epoch"], epoch, "{v}");
}

/// An error answer of `status` and `code` (its param whatever it is): the body.
fn assert_code(r: &Reply, status: u16, code: &str) -> Value {
    assert_eq!(r.status, status, "{}", r.text());
    let v = r.json();
    let param = v["error"]["param"].as_str().map(str::to_string);
    assert_error(r, status, code, param.as_deref());
    v
}

/// The code of an error as a move keeps it: an error body (`{error: {code}}`) or its inner
/// object (`{code}`).
fn code_of(e: &Value) -> Option<&str> {
    e["error"]["code"].as_str().or_else(|| e["code"].as_str())
}

/// Bytes that are not all alike.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15 ^ seed;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// An event of an event stream: its name, id and data.
#[derive(Debug, Clone)]
struct Event {
    event: String,
    id: Option<u64>,
    data: Value,
}

/// Reads an event stream in a thread of its own: each event sent on the channel as it comes;
/// the channel ends with the stream.
fn read_events(reader: Box<dyn Read + Send + Sync>) -> mpsc::Receiver<Event> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut event = String::new();
        let mut id = None;
        let mut data = String::new();
        for line in BufReader::new(reader).lines() {
            let Ok(line) = line else {
                return;
            };
            if line.is_empty() {
                if !event.is_empty() {
                    let v = serde_json::from_str(&data).unwrap_or(Value::String(data.clone()));
                    let ev = Event {
                        event: std::mem::take(&mut event),
                        id: id.take(),
                        data: v,
                    };
                    if tx.send(ev).is_err() {
                        return;
                    }
                }
                data.clear();
            } else if let Some(e) = line.strip_prefix("event: ") {
                event = e.to_string();
            } else if let Some(i) = line.strip_prefix("id: ") {
                id = i.trim().parse().ok();
            } else if let Some(d) = line.strip_prefix("data: ") {
                data.push_str(d);
            }
        }
    });
    rx
}

/// The text of a command's output chunks (JSON).
fn chunks_text(out: &Value) -> String {
    out["chunks"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| c["data"].as_str().unwrap_or_default())
        .collect()
}

/// What a sandbox is made of before its move, to hold it to after.
struct Made {
    id: String,
    /// Its file /root/moved.bin.
    file: Vec<u8>,
    /// The counter's command.
    counter: String,
    /// A command that ended: its id, object and output.
    known: (String, Value, Value),
}

/// A sandbox on `on` with a file, the counter, and a command that ended.
fn make(f: &Fleet, on: &str, seed: u64) -> Made {
    let s = f.create_on(on, &json!({ "sleep_after_seconds": null }));
    let id = s["id"].as_str().unwrap_or_default().to_string();
    let file = pattern(1 << 20, seed);
    f.put_file(&id, "/root/moved.bin", &file);
    let counter = f.start_counter(&id);
    let k = f.sh_obj(&id, "echo known-output; echo to-stderr >&2; uname -s");
    assert_eq!(k["stdout"], "known-output\nLinux\n", "{k}");
    let known_id = k["id"].as_str().unwrap_or_default().to_string();
    let (obj, out) = f.command(&id, &known_id);
    Made {
        id,
        file,
        counter,
        known: (known_id, obj, out),
    }
}

/// What was made reads the same after the move (and the counter's command still runs).
fn same_as_made(f: &Fleet, m: &Made) {
    f.file_is(&m.id, "/root/moved.bin", &m.file);
    let (known, obj, out) = &m.known;
    let (obj2, out2) = f.command(&m.id, known);
    assert_eq!(
        &obj2, obj,
        "the ended command's object changed with the move"
    );
    assert_eq!(
        &out2, out,
        "the ended command's output changed with the move"
    );
    let (counter, _) = f.command(&m.id, &m.counter);
    assert_eq!(counter["status"], "running", "{counter}");
}

/// Case 1 (and 3, 7's volume). A sleeping sandbox moves and wakes on the new node as it was;
/// fencing answers; a move's refusals.
fn a_sleeping_sandbox_moves(db: Option<PgDatabase>) {
    let f = Fleet::start(db, FleetStore::dir(), false);
    let m = make(&f, "node-a", 1);
    let id = m.id.as_str();
    std::thread::sleep(Duration::from_millis(300));
    let before = f.count(id);

    // Refusals: an unknown sandbox, an unknown node.
    let r = f.post(
        "/internal/moves",
        &json!({ "sandbox_id": "sbx-0000000000000000", "to": "node-b" }),
    );
    assert_code(&r, 404, "sandbox_not_found");
    let r = f.post(
        "/internal/moves",
        &json!({ "sandbox_id": id, "to": "node-z" }),
    );
    assert_error(&r, 404, "not_found", Some("to"));

    // Fencing before the move: a release at another epoch than the node's is refused, and
    // changes nothing.
    let r = f.http.post_json(
        &f.a.url(&format!("/internal/sandboxes/{id}/release")),
        &json!({ "epoch": 2, "to": "node-b", "move_id": "mov-0000000000000000" }),
    );
    assert_code(&r, 409, "wrong_epoch");
    assert_eq!(r.json()["epoch"], 1, "{}", r.text());
    assert_eq!(f.sandbox(id)["status"], "running");

    // Asleep, moved (not woken: it slept).
    let r = f.post(&format!("/v1/sandboxes/{id}/sleep"), &json!({}));
    assert_eq!(r.status, 200, "sleep: {}", r.text());
    assert_eq!(r.json()["status"], "sleeping", "{}", r.text());
    let mv = f.start_move(id, "node-a", "node-b", None);
    assert_eq!(mv["wake"], false, "it slept: {mv}");
    assert_eq!(mv["epoch"], 1, "{mv}");
    let move_id = mv["id"].as_str().unwrap_or_default().to_string();
    let done = f.wait_move(&move_id, Duration::from_secs(120));
    assert_eq!(done["step"], "done", "{done}\n{}", f.logs());
    assert_eq!(done["error"], Value::Null, "{done}");
    assert_eq!(done["release"]["epoch"], 1, "{done}");
    assert_eq!(done["release"]["slept"], false, "it slept already: {done}");
    assert_eq!(done["takeover"]["epoch"], 2, "{done}");
    assert_eq!(done["takeover"]["woke"], false, "{done}");
    assert!(
        ["disk", "store"].contains(&done["takeover"]["source"].as_str().unwrap_or("")),
        "{done}"
    );
    let r = f.get(&format!("/internal/moves?sandbox_id={id}"));
    assert_eq!(r.status, 200, "{}", r.text());
    let list = r.json();
    assert_eq!(list["object"], "list", "{list}");
    assert!(
        list["data"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|x| x["id"] == move_id.as_str()),
        "{list}"
    );

    // On node B at epoch 2, asleep; woken there it goes on.
    let s = f.is_on(id, "node-b", 2);
    assert_eq!(s["status"], "sleeping", "{s}");
    let r = f.post(&format!("/v1/sandboxes/{id}/wake"), &json!({}));
    assert_eq!(r.status, 200, "wake: {}\n{}", r.text(), f.logs());
    assert_eq!(r.json()["status"], "running", "{}", r.text());
    f.counter_goes_on(id, before);
    same_as_made(&f, &m);
    f.runs("node-b", id);
    f.gone_from("node-a", id, "node-b", 1);

    // Fencing after it: B holds it at 2, A forgot it at 1.
    let from_a = json!({ "id": f.ids["node-a"], "name": "node-a", "url": f.a.url("") });
    let from_b = json!({ "id": f.ids["node-b"], "name": "node-b", "url": f.b.url("") });
    for epoch in [1, 3] {
        let r = f.http.post_json(
            &f.b.url(&format!("/internal/sandboxes/{id}/release")),
            &json!({ "epoch": epoch, "to": "node-a", "move_id": "mov-0000000000000001" }),
        );
        assert_code(&r, 409, "wrong_epoch");
        assert_eq!(r.json()["epoch"], 2, "{}", r.text());
    }
    let r = f.http.post_json(
        &f.b.url(&format!("/internal/sandboxes/{id}/takeover")),
        &json!({ "epoch": 1, "from": from_a, "wake": false }),
    );
    assert_code(&r, 409, "wrong_epoch");
    assert_eq!(r.json()["epoch"], 2, "{}", r.text());
    let r = f.http.post_json(
        &f.a.url(&format!("/internal/sandboxes/{id}/takeover")),
        &json!({ "epoch": 1, "from": from_b, "wake": false }),
    );
    assert_code(&r, 409, "wrong_epoch");
    assert_eq!(r.json()["epoch"], 1, "{}", r.text());
    // None of it moved anything.
    f.is_on(id, "node-b", 2);
    f.counter_goes_on(id, before);
    f.runs_nothing_of("node-a", id);

    // A sandbox with a volume is not moved.
    let r = f
        .http
        .post_json(&f.a.url("/v1/volumes"), &json!({ "name": "move-vol" }));
    assert_eq!(r.status, 201, "a volume: {}", r.text());
    let vol = r.json()["id"].as_str().unwrap_or_default().to_string();
    let with = f.create_on(
        "node-a",
        &json!({ "volumes": [{ "path": "/data", "volume": vol }] }),
    );
    let with = with["id"].as_str().unwrap_or_default().to_string();
    let r = f.post(
        "/internal/moves",
        &json!({ "sandbox_id": with, "to": "node-b" }),
    );
    assert_code(&r, 409, "not_movable");
    f.is_on(&with, "node-a", 1);

    f.delete(&with);
    f.delete(id);
    f.runs_nothing_of("node-b", id);
}

/// Case 2: a running sandbox moves (woken there, as it ran); an event stream of its counter
/// opened on the old node ends with `sandbox_moved` at the position it reached, and the
/// counter's output reads on from there through the control plane.
fn a_running_sandbox_moves(db: Option<PgDatabase>, store: FleetStore) {
    let f = Fleet::start(db, store, false);
    let m = make(&f, "node-a", 2);
    let id = m.id.as_str();

    let resp = f
        .http
        .send(
            "GET",
            &f.a.url(&format!(
                "/v1/sandboxes/{id}/exec/{}/output?stream=true",
                m.counter
            )),
            &[("Accept", "text/event-stream")],
            None,
        )
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(resp.status(), 200);
    let events = read_events(resp.into_reader());
    let mut seen: Vec<Event> = Vec::new();
    // The stream serves: output comes.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !seen.iter().any(|e| e.event == "stdout") {
        let left = deadline.saturating_duration_since(Instant::now());
        match events.recv_timeout(left) {
            Ok(e) => seen.push(e),
            Err(e) => panic!("no output on the stream ({e}): {seen:?}"),
        }
    }
    let before = f.count(id);

    let mv = f.start_move(id, "node-a", "node-b", None);
    assert_eq!(mv["wake"], true, "it ran: {mv}");
    let move_id = mv["id"].as_str().unwrap_or_default().to_string();
    let done = f.wait_move(&move_id, Duration::from_secs(120));
    assert_eq!(done["step"], "done", "{done}\n{}", f.logs());
    assert_eq!(done["error"], Value::Null, "{done}");
    assert_eq!(done["release"]["slept"], true, "it ran: {done}");
    assert_eq!(done["release"]["epoch"], 1, "{done}");
    assert_eq!(done["takeover"]["woke"], true, "{done}");

    // The stream on A ended with sandbox_moved, at the position its output reached.
    let deadline = Instant::now() + Duration::from_secs(30);
    let last = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match events.recv_timeout(left) {
            Ok(e) if e.event == "error" || e.event == "exit" => break e,
            Ok(e) => seen.push(e),
            Err(e) => panic!(
                "the stream on node A did not end ({e}) after the move: {:?}",
                seen.last()
            ),
        }
    };
    assert_eq!(last.event, "error", "{last:?}");
    assert_eq!(code_of(&last.data), Some("sandbox_moved"), "{last:?}");
    assert_eq!(last.data["to"], "node-b", "{last:?}");
    assert_eq!(last.data["epoch"], 1, "{last:?}");
    let reached: u64 = seen.iter().filter_map(|e| e.id).max().unwrap_or(0);
    assert_eq!(
        last.data["offset"].as_u64(),
        Some(reached),
        "the offset is the last event's id: {last:?}"
    );
    let streamed: String = seen
        .iter()
        .filter(|e| e.event == "stdout")
        .map(|e| e.data["data"].as_str().unwrap_or_default())
        .collect();

    // On B at epoch 2, running: the counter goes on, its output kept up to the offset and
    // read on from it.
    let s = f.is_on(id, "node-b", 2);
    assert_eq!(s["status"], "running", "{s}");
    f.counter_goes_on(id, before);
    same_as_made(&f, &m);
    assert_eq!(
        reached,
        streamed.len() as u64,
        "the stream's position is the bytes it streamed"
    );
    let r = f.get(&format!(
        "/v1/sandboxes/{id}/exec/{}/output?from={reached}",
        m.counter
    ));
    assert_eq!(r.status, 200, "{}", r.text());
    let on = chunks_text(&r.json());
    let (_, out) = f.command(id, &m.counter);
    let all = chunks_text(&out);
    assert!(
        !on.is_empty() && all.starts_with(&format!("{streamed}{on}")),
        "the counter's output on B does not go on from what A streamed:\nA: {streamed:?}\nB from the offset: {on:?}\nB: {all:?}"
    );
    f.runs("node-b", id);
    f.gone_from("node-a", id, "node-b", 1);

    // What the release said the store holds is there.
    let stored = &done["release"]["stored"];
    let store = f.store.open();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let epoch = stored["epoch"].as_u64().unwrap_or(0);
    let manifest = rt
        .block_on(store.manifest(id, epoch))
        .unwrap_or_else(|e| panic!("the store has no manifest of {id} at e{epoch}: {e}"));
    assert_eq!(
        stored["build"].as_str(),
        Some(manifest.build.as_str()),
        "{done}"
    );

    f.delete(id);
    f.runs_nothing_of("node-b", id);
}

/// Case 4: node B is of another build: it refuses the takeover (build_missing), node A takes the
/// sandbox back at epoch 3, and it works there as before.
fn a_refused_takeover_is_reclaimed(db: Option<PgDatabase>) {
    let f = Fleet::start(db, FleetStore::dir(), true);
    let nodes = f.get("/internal/nodes").json();
    let builds: Vec<&str> = nodes["data"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n["build"].as_str())
        .collect();
    assert!(
        builds.len() == 2 && builds[0] != builds[1],
        "the nodes are of one build: {nodes}"
    );
    let m = make(&f, "node-a", 4);
    let id = m.id.as_str();
    std::thread::sleep(Duration::from_millis(300));
    let before = f.count(id);

    let mv = f.start_move(id, "node-a", "node-b", None);
    let move_id = mv["id"].as_str().unwrap_or_default().to_string();
    let end = f.wait_move(&move_id, Duration::from_secs(120));
    assert_eq!(end["step"], "failed", "{end}\n{}", f.logs());
    assert_eq!(code_of(&end["error"]), Some("build_missing"), "{end}");

    // Back on A at epoch 3 (E+2), running (it ran), and it works.
    let s = f.is_on(id, "node-a", 3);
    assert_eq!(s["status"], "running", "{s}");
    f.counter_goes_on(id, before);
    same_as_made(&f, &m);
    f.sh(id, "echo after > /root/after.txt");
    assert_eq!(f.sh(id, "cat /root/after.txt"), "after\n");
    f.runs("node-a", id);
    let r = f.http.get(&f.a.url(&format!("/v1/sandboxes/{id}")));
    assert_eq!(r.status, 200, "A serves it again: {}", r.text());
    // B has nothing of it.
    f.runs_nothing_of("node-b", id);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f.b.files_of(id).is_empty() {
        assert!(
            Instant::now() < deadline,
            "node-b keeps files of {id}: {:?}",
            f.b.files_of(id)
        );
        std::thread::sleep(Duration::from_millis(250));
    }

    f.delete(id);
    f.runs_nothing_of("node-a", id);
}

/// Where the sandbox is after a move that ended: on exactly one node (the table's), running
/// and going on, what it had still there; nothing of it runs on the other.
fn on_exactly_one(f: &Fleet, m: &Made, before: u64, end: &Value) -> String {
    let id = m.id.as_str();
    eprintln!(
        "the move ended {}: error {}, takeover {}, attempts {}",
        end["step"], end["error"], end["takeover"], end["attempts"]
    );
    // A node stopped or killed during the move is back first.
    f.wait_ready("node-a", Duration::from_secs(30));
    f.wait_ready("node-b", Duration::from_secs(30));
    let s = f.sandbox(id);
    let holder = s["node"]["name"].as_str().unwrap_or_default().to_string();
    // Done: on B at E+1. Failed: back on A, taken back (E+2) or from the store (E+3).
    let epoch = s["epoch"].as_u64().unwrap_or(0);
    let want = if end["step"] == "done" {
        holder == "node-b" && epoch == 2
    } else {
        holder == "node-a" && (epoch == 3 || epoch == 4)
    };
    assert!(want, "{s}\n{end}");
    f.wait_status(id, "running", Duration::from_secs(30));
    f.counter_goes_on(id, before);
    same_as_made(f, m);
    f.runs(&holder, id);
    assert!(listed(f.node(&holder), id), "{holder} does not list {id}");
    let other = Fleet::other(&holder);
    f.runs_nothing_of(other, id);
    if end["step"] == "done" {
        f.gone_from("node-a", id, "node-b", 1);
    }
    holder
}

/// Case 5 (and 7's second move). The control plane is killed while the takeover hangs (node B
/// stopped), and started again on the same database: the move ends, the sandbox on one node.
fn a_control_plane_killed_mid_move(db: Option<PgDatabase>) {
    let mut f = Fleet::start(db, FleetStore::dir(), false);
    let m = make(&f, "node-a", 5);
    let id = m.id.clone();
    std::thread::sleep(Duration::from_millis(300));
    let before = f.count(&id);

    let mv = f.start_move(&id, "node-a", "node-b", None);
    f.b.pause();
    let move_id = mv["id"].as_str().unwrap_or_default().to_string();
    let at = f.wait_step(
        &move_id,
        "taking_over",
        Duration::from_millis(100),
        Duration::from_secs(90),
    );
    assert_eq!(at["release"]["epoch"], 1, "{at}");
    // A second move while this one runs.
    let r = f.post(
        "/internal/moves",
        &json!({ "sandbox_id": id, "to": "node-b" }),
    );
    assert_code(&r, 409, "already_moving");
    assert_eq!(r.json()["move_id"], move_id.as_str(), "{}", r.text());
    // Its calls wait for the move (not sent to either node).
    let r = f.get(&format!("/v1/sandboxes/{id}"));
    let e = assert_code(&r, 503, "unavailable");
    assert_eq!(e["error"]["retryable"], true, "{e}");
    assert_eq!(r.header("retry-after"), Some("1"));
    // The takeover is asked (and hangs on the stopped node) before the control plane dies.
    std::thread::sleep(Duration::from_millis(1500));
    f.ctl.kill();
    f.b.resume();
    f.ctl.restart();
    f.wait_ready("node-a", Duration::from_secs(30));
    f.wait_ready("node-b", Duration::from_secs(30));
    let end = f.wait_move(&move_id, Duration::from_secs(180));
    assert!(end["step"] == "done" || end["step"] == "failed", "{end}");
    on_exactly_one(&f, &m, before, &end);
    f.delete(&id);
    f.runs_nothing_of("node-a", &id);
    f.runs_nothing_of("node-b", &id);
}

/// Case 6: node B is killed (SIGKILL) during the takeover of a sandbox with 50 MB of files, and
/// started again: the move ends, the sandbox on one node with all its files.
fn a_new_node_killed_during_a_takeover(db: Option<PgDatabase>) {
    let mut f = Fleet::start(db, FleetStore::dir(), false);
    let m = make(&f, "node-a", 6);
    let id = m.id.clone();
    let sum = f.sh(
        &id,
        "head -c 52428800 /dev/urandom > /root/big && sync && sha256sum /root/big",
    );
    std::thread::sleep(Duration::from_millis(300));
    let before = f.count(&id);

    // B held still until the takeover is asked of it; let go, and killed as soon as it
    // writes something of the sandbox (its takeover of 50 MB has begun, and is not over).
    let mv = f.start_move(&id, "node-a", "node-b", None);
    f.b.pause();
    let move_id = mv["id"].as_str().unwrap_or_default().to_string();
    f.wait_step(
        &move_id,
        "taking_over",
        Duration::from_millis(50),
        Duration::from_secs(120),
    );
    std::thread::sleep(Duration::from_millis(300));
    f.b.resume();
    let deadline = Instant::now() + Duration::from_secs(30);
    while f.b.files_of(&id).is_empty() {
        assert!(
            Instant::now() < deadline,
            "node-b wrote nothing of {id} in 30 s of its takeover\n{}",
            f.logs()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    f.b.kill();
    let at_kill = f.move_now(&move_id);
    eprintln!(
        "node-b killed during the takeover (the move {}, node-b had {:?})",
        at_kill["step"],
        f.b.files_of(&id)
    );
    assert_eq!(at_kill["step"], "taking_over", "{at_kill}");
    std::thread::sleep(Duration::from_millis(500));
    f.b.restart();
    let end = f.wait_move(&move_id, Duration::from_secs(180));
    on_exactly_one(&f, &m, before, &end);
    assert_eq!(
        f.sh(&id, "sha256sum /root/big"),
        sum,
        "the 50 MB file changed"
    );
    f.delete(&id);
    f.runs_nothing_of("node-a", &id);
    f.runs_nothing_of("node-b", &id);
}

/// The PostgreSQL database of a test; None (said) when `SBX_TEST_PG_URL` is not set.
fn postgres() -> Option<PgDatabase> {
    match std::env::var("SBX_TEST_PG_URL") {
        Ok(url) => Some(PgDatabase::create(&url)),
        Err(_) => {
            eprintln!("SBX_TEST_PG_URL is not set: skipped on PostgreSQL");
            None
        }
    }
}

/// A test on SQLite and one on PostgreSQL of `body(db)`.
macro_rules! on_both {
    ($sqlite:ident, $pg:ident, $body:expr) => {
        #[test]
        fn $sqlite() {
            ($body)(None);
        }

        #[test]
        fn $pg() {
            if let Some(db) = postgres() {
                ($body)(Some(db));
            }
        }
    };
}

on_both!(
    a_sleeping_sandbox_moves_on_sqlite,
    a_sleeping_sandbox_moves_on_postgres,
    a_sleeping_sandbox_moves
);
on_both!(
    a_running_sandbox_moves_on_sqlite,
    a_running_sandbox_moves_on_postgres,
    |db| a_running_sandbox_moves(db, FleetStore::dir())
);
on_both!(
    a_running_sandbox_moves_through_seaweedfs_on_sqlite,
    a_running_sandbox_moves_through_seaweedfs_on_postgres,
    |db| {
        if let Some(store) = FleetStore::weed() {
            a_running_sandbox_moves(db, store);
        }
    }
);
on_both!(
    a_refused_takeover_is_reclaimed_on_sqlite,
    a_refused_takeover_is_reclaimed_on_postgres,
    a_refused_takeover_is_reclaimed
);
on_both!(
    a_control_plane_killed_mid_move_on_sqlite,
    a_control_plane_killed_mid_move_on_postgres,
    a_control_plane_killed_mid_move
);
on_both!(
    a_new_node_killed_during_a_takeover_on_sqlite,
    a_new_node_killed_during_a_takeover_on_postgres,
    a_new_node_killed_during_a_takeover
);
