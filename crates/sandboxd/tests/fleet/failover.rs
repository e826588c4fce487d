//! The control plane's own failover (issue #29): two control planes on one PostgreSQL database
//! (`--name`, `--control-lease-seconds 3`) and two nodes given both (`--control URL,URL`).
//!
//! - the standby answers 503 `standby` naming the active copy `{name, url, term}` (Retry-After:
//!   1), its `/healthz` 200 with `role: standby`;
//! - a running sandbox's move is started on the active copy, which is killed (SIGKILL) while the
//!   move is under way: the standby is active within about 1½ leases, the move ends done (the
//!   sandbox on the new node at epoch 2, its counter going on, its file there), the nodes
//!   heartbeat to it, `/v1` works through it;
//! - the active copy held still (SIGSTOP) past its lease: the standby takes over; let go
//!   (SIGCONT), the old one finds itself deposed: a write asked of it is refused (503 `standby`
//!   naming the new one, nothing written), and it answers as a standby from then on.
//!
//! PostgreSQL only (`SBX_TEST_PG_URL`; skipped, said so, without it).

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::calls::At;
use crate::harness::{ControlPlane, FleetStore, Node, NodeOpts, PgDatabase};
use crate::http::{Http, Reply};

/// The control planes' lease (s).
const LEASE: f64 = 2.0;

fn control_plane(db: &PgDatabase, store: &FleetStore, name: &str) -> ControlPlane {
    let extra: Vec<String> = ["--name", name, "--control-lease-seconds", "3"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    ControlPlane::start_args(Some(&db.url), Some(store), &extra)
}

/// Two control planes and two nodes; dropped nodes first, then the control planes, the store,
/// the database.
struct Fleet {
    a: Node,
    b: Node,
    c1: ControlPlane,
    c2: ControlPlane,
    _store: FleetStore,
    _db: PgDatabase,
    http: Http,
}

impl Fleet {
    fn logs(&self) -> String {
        format!(
            "{}\n{}\n{}\n{}",
            self.c1.log_tail(30),
            self.c2.log_tail(30),
            self.a.log_tail(15),
            self.b.log_tail(15)
        )
    }

    fn cp(&self, which: u8) -> &ControlPlane {
        if which == 1 {
            &self.c1
        } else {
            &self.c2
        }
    }

    fn get(&self, which: u8, path: &str) -> Reply {
        self.http.get(&self.cp(which).url(path))
    }

    fn post(&self, which: u8, path: &str, body: &Value) -> Reply {
        self.http.post_json(&self.cp(which).url(path), body)
    }

    fn health(&self, which: u8) -> Value {
        let r = self.get(which, "/healthz");
        assert_eq!(r.status, 200, "healthz of cp-{which}: {}", r.text());
        r.json()
    }

    /// Waits until control plane `which` is active; its healthz.
    fn wait_active(&self, which: u8, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let r = self.get(which, "/healthz");
            if r.status == 200 && r.json()["role"] == "active" {
                return r.json();
            }
            assert!(
                Instant::now() < deadline,
                "cp-{which} is not active after {timeout:?}: {}\n{}",
                r.text(),
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Control plane `which` is a standby naming cp-`active` at `term` (within a few
    /// seconds): its healthz, and a route's 503 `standby`.
    fn is_standby(&self, which: u8, active: u8, term: u64) {
        let deadline = Instant::now() + Duration::from_secs(5);
        let h = loop {
            let h = self.health(which);
            if h["role"] == "standby" && h["active"]["term"] == term {
                break h;
            }
            assert!(
                Instant::now() < deadline,
                "cp-{which} is no standby naming term {term}: {h}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        assert_eq!(h["name"], format!("cp-{which}"), "{h}");
        self.names_active(&h["active"], active, term);
        let r = self.get(which, "/internal/nodes");
        let e = standby_error(&r);
        self.names_active(&e["active"], active, term);
        let r = self.get(which, "/v1/sandboxes");
        standby_error(&r);
    }

    fn names_active(&self, a: &Value, which: u8, term: u64) {
        assert_eq!(
            a,
            &json!({
                "name": format!("cp-{which}"),
                "url": self.cp(which).url(""),
                "term": term,
            }),
            "{}",
            self.logs()
        );
    }

    /// Waits until node `name` is ready through control plane `which`, with a heartbeat after
    /// `after_ms` (the database's clock, ms): it heartbeats to it.
    fn wait_heartbeat(&self, which: u8, name: &str, after: &str, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let r = self.get(which, &format!("/internal/nodes/{name}"));
            if r.status == 200 {
                let n = r.json();
                if n["state"] == "ready" && n["heartbeat_at"].as_str().unwrap_or("") > after {
                    return n;
                }
            }
            assert!(
                Instant::now() < deadline,
                "node {name} has no heartbeat through cp-{which} after {after} in {timeout:?}: \
                 {} {}\n{}",
                r.status,
                r.text(),
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The sandboxes' calls through control plane `which`.
    fn at(&self, which: u8) -> At<'_> {
        At {
            http: &self.http,
            base: self.cp(which).url(""),
            logs: Box::new(|| self.logs()),
        }
    }

    fn sh(&self, which: u8, id: &str, line: &str) -> String {
        self.at(which).sh(id, line)
    }

    fn count(&self, which: u8, id: &str) -> u64 {
        self.at(which).count(id)
    }

    fn move_now(&self, which: u8, move_id: &str) -> Value {
        let r = self.get(which, &format!("/internal/moves/{move_id}"));
        assert_eq!(r.status, 200, "GET the move: {}\n{}", r.text(), self.logs());
        r.json()
    }
}

/// A 503 `standby`, retryable, `Retry-After: 1`: its body.
fn standby_error(r: &Reply) -> Value {
    assert_eq!(r.status, 503, "{}", r.text());
    let v = r.json();
    assert_eq!(v["error"]["code"], "standby", "{v}");
    assert_eq!(v["error"]["retryable"], true, "{v}");
    assert_eq!(r.header("retry-after"), Some("1"));
    v
}

/// The database's clock now, as RFC 3339 (a node's `heartbeat_at` after it is later).
fn db_now(f: &Fleet, which: u8) -> String {
    // A node's object carries the database's times; `lease_until` − lease ≈ its heartbeat.
    // Simpler: the newest heartbeat the table has now.
    let r = f.get(which, "/internal/nodes");
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["data"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n["heartbeat_at"].as_str().map(String::from))
        .max()
        .unwrap_or_default()
}

#[test]
fn the_control_plane_fails_over_on_postgres() {
    let Ok(admin) = std::env::var("SBX_TEST_PG_URL") else {
        eprintln!("SBX_TEST_PG_URL is not set: the control plane's failover was skipped");
        return;
    };
    let db = PgDatabase::create(&admin);
    let store = FleetStore::dir();
    let c1 = control_plane(&db, &store, "cp-1");
    let http = Http::new();
    // cp-1 takes the free lease (term 1) before cp-2 starts.
    let deadline = Instant::now() + Duration::from_secs(10);
    while http.get(&c1.url("/healthz")).json()["role"] != "active" {
        assert!(
            Instant::now() < deadline,
            "cp-1 never active\n{}",
            c1.log_tail(30)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let c2 = control_plane(&db, &store, "cp-2");
    let opts = || NodeOpts {
        store: Some(&store),
        other_build: false,
    };
    let a = Node::start_joining("node-a", &[&c1, &c2], opts());
    let b = Node::start_joining("node-b", &[&c2, &c1], opts());
    let mut f = Fleet {
        a,
        b,
        c1,
        c2,
        _store: store,
        _db: db,
        http,
    };

    // cp-1 is active at term 1; cp-2 stands by, naming it.
    let h = f.wait_active(1, Duration::from_secs(10));
    assert_eq!(h["term"], 1, "{h}");
    assert_eq!(h["name"], "cp-1", "{h}");
    f.is_standby(2, 1, 1);
    // Both nodes join through cp-1 (node-b was given cp-2 first: it followed `active.url`).
    let since = String::new();
    let na = f.wait_heartbeat(1, "node-a", &since, Duration::from_secs(30));
    f.wait_heartbeat(1, "node-b", &since, Duration::from_secs(30));
    let a_id = na["id"].as_str().unwrap_or_default().to_string();

    // A running sandbox on node-a (node-b draining meanwhile), a file, a counter.
    let r = f.post(
        1,
        "/internal/nodes/node-b/drain",
        &json!({"draining": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let r = f.post(1, "/v1/sandboxes", &json!({ "sleep_after_seconds": null }));
    assert_eq!(r.status, 201, "create: {}\n{}", r.text(), f.logs());
    let s = r.json();
    assert_eq!(s["node"]["name"], "node-a", "{s}");
    let id = s["id"].as_str().unwrap_or_default().to_string();
    let r = f.post(
        1,
        "/internal/nodes/node-b/drain",
        &json!({"draining": false}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    f.sh(1, &id, "echo failover-file > /root/kept.txt");
    f.at(1).start_counter(&id);
    let before = f.count(1, &id);

    // The move is started on cp-1; cp-1 is killed while the node releases the sandbox.
    let r = f.post(
        1,
        "/internal/moves",
        &json!({ "sandbox_id": id, "to": "node-b" }),
    );
    assert_eq!(r.status, 202, "{}\n{}", r.text(), f.logs());
    let move_id = r.json()["id"].as_str().unwrap_or_default().to_string();
    let deadline = Instant::now() + Duration::from_secs(30);
    let at_kill = loop {
        let m = f.move_now(1, &move_id);
        if m["attempts"].as_u64().unwrap_or(0) >= 1 || m["step"] != "releasing" {
            break m;
        }
        assert!(
            Instant::now() < deadline,
            "the release was never asked: {m}"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    f.c1.kill();
    let killed = Instant::now();
    eprintln!(
        "cp-1 killed with the move at {} (attempts {})",
        at_kill["step"], at_kill["attempts"]
    );
    assert!(
        at_kill["step"] != "done" && at_kill["step"] != "failed",
        "the move was over before cp-1 was killed: {at_kill}"
    );

    // cp-2 takes over within about 1½ leases (it tries every third of one).
    let h = f.wait_active(2, Duration::from_secs(10));
    let took = killed.elapsed();
    eprintln!("cp-2 active {took:?} after cp-1 was killed (lease {LEASE} s)");
    assert!(
        took <= Duration::from_secs_f64(LEASE * 1.5 + 0.5),
        "cp-2 took {took:?} to take over"
    );
    assert_eq!(h["term"], 2, "{h}");
    assert_eq!(h["name"], "cp-2", "{h}");

    // The move ends done through cp-2: the sandbox on node-b at epoch 2, going on.
    let deadline = Instant::now() + Duration::from_secs(120);
    let end = loop {
        let m = f.move_now(2, &move_id);
        if m["step"] == "done" || m["step"] == "failed" {
            break m;
        }
        assert!(
            Instant::now() < deadline,
            "the move is not over: {m}\n{}",
            f.logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(end["step"], "done", "{end}\n{}", f.logs());
    let r = f.get(2, &format!("/v1/sandboxes/{id}"));
    assert_eq!(r.status, 200, "{}", r.text());
    let s = r.json();
    assert_eq!(s["node"]["name"], "node-b", "{s}");
    assert_eq!(s["epoch"], 2, "{s}");
    assert_eq!(f.sh(2, &id, "cat /root/kept.txt"), "failover-file\n");
    let first = f.count(2, &id);
    std::thread::sleep(Duration::from_millis(600));
    let second = f.count(2, &id);
    assert!(
        first >= before && second > first,
        "the counter: {before} before, then {first}, {second}"
    );
    // The nodes heartbeat to cp-2 (a heartbeat after its takeover).
    let since = db_now(&f, 2);
    f.wait_heartbeat(2, "node-a", &since, Duration::from_secs(15));
    f.wait_heartbeat(2, "node-b", &since, Duration::from_secs(15));
    // /v1 through it: a new sandbox, listed.
    let r = f.post(2, "/v1/sandboxes", &json!({}));
    assert_eq!(r.status, 201, "{}\n{}", r.text(), f.logs());
    let s2 = r.json()["id"].as_str().unwrap_or_default().to_string();
    let r = f.get(2, "/v1/sandboxes");
    assert_eq!(r.status, 200, "{}", r.text());
    let listed: Vec<&str> = r.json()["data"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["id"].as_str())
        .map(|s| if s == id || s == s2 { "ours" } else { "other" })
        .collect();
    assert_eq!(
        listed.iter().filter(|s| **s == "ours").count(),
        2,
        "{}",
        r.text()
    );

    // cp-1 again: a standby naming cp-2 (term 2).
    f.c1.restart();
    f.is_standby(1, 2, 2);

    // cp-2 held still past its lease: cp-1 takes over (term 3).
    f.c2.pause();
    let paused = Instant::now();
    let h = f.wait_active(1, Duration::from_secs(10));
    eprintln!("cp-1 active {:?} after cp-2 was stopped", paused.elapsed());
    assert_eq!(h["term"], 3, "{h}");
    // Let go: a write asked of cp-2 at once is refused by the term (or by its role, once its
    // loop saw it), naming cp-1; nothing is written.
    f.c2.resume();
    let r = f.post(
        2,
        &format!("/internal/nodes/{a_id}/drain"),
        &json!({"draining": true}),
    );
    let e = standby_error(&r);
    f.names_active(&e["active"], 1, 3);
    // (Its state is `ready` or `lost` by its lease; `draining` comes before either.)
    let r = f.get(1, "/internal/nodes/node-a");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_ne!(
        r.json()["state"],
        "draining",
        "a deposed copy's write was written"
    );
    // And it stands by from then on.
    let deadline = Instant::now() + Duration::from_secs(5);
    while f.health(2)["role"] != "standby" {
        assert!(Instant::now() < deadline, "cp-2 still acts\n{}", f.logs());
        std::thread::sleep(Duration::from_millis(50));
    }
    f.is_standby(2, 1, 3);
    // The nodes heartbeat to cp-1; /v1 works through it.
    let since = db_now(&f, 1);
    f.wait_heartbeat(1, "node-a", &since, Duration::from_secs(15));
    f.wait_heartbeat(1, "node-b", &since, Duration::from_secs(15));
    assert_eq!(f.sh(1, &id, "cat /root/kept.txt"), "failover-file\n");
    for sid in [&id, &s2] {
        let r = f.http.delete(&f.c1.url(&format!("/v1/sandboxes/{sid}")));
        assert_eq!(r.status, 200, "DELETE {sid}: {}", r.text());
    }
}

/// SQLite: one control plane owns the file. A second one on the same data directory is
/// refused at start (it says why); the first is active at term 1 and serves on; started again
/// after it stopped, the file's control plane is active at term 2.
#[test]
fn a_second_control_plane_on_one_sqlite_file_is_refused() {
    let root = std::env::temp_dir().join(format!("sbx-fleet-sqlite-owner-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).expect("a folder");
    let data = root.join("data");
    let start = |port: u16| {
        std::process::Command::new(crate::harness::sandboxd_bin())
            .args([
                "control",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--data-dir",
            ])
            .arg(&data)
            .env("RUST_LOG", "info")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start sandboxd control")
    };
    let http = Http::new();
    let wait_term = |port: u16, term: u64| {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(r) = http.send(
                "GET",
                &format!("http://127.0.0.1:{port}/healthz"),
                &[],
                None,
            ) {
                let v: Value = r.into_json().unwrap_or(Value::Null);
                if v["role"] == "active" {
                    assert_eq!(v["term"], term, "{v}");
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "no active control plane on {port}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let p1 = crate::harness::free_port();
    let mut first = start(p1);
    wait_term(p1, 1);
    let p2 = crate::harness::free_port();
    let second = start(p2)
        .wait_with_output()
        .expect("the second control plane's end");
    let said = String::from_utf8_lossy(&second.stderr).into_owned()
        + &String::from_utf8_lossy(&second.stdout);
    assert!(!second.status.success(), "the second one ran: {said}");
    assert!(
        said.contains("another control plane runs on this SQLite file"),
        "{said}"
    );
    let r = http.get(&format!("http://127.0.0.1:{p1}/internal/nodes"));
    assert_eq!(r.status, 200, "{}", r.text());
    // SIGKILL: the lock goes with the process; the next start takes the lease at once.
    let _ = first.kill();
    let _ = first.wait();
    let mut again = start(p1);
    wait_term(p1, 2);
    let _ = again.kill();
    let _ = again.wait();
    let _ = std::fs::remove_dir_all(&root);
}
