//! The fleet (issue #28): a control plane (`sandboxd control`) and two real nodes on this
//! machine that join it (`--control`, `--node-name`), driven through the control plane's API:
//! nodes join and show `ready`; creates are placed on both; a sandbox's calls (commands, event
//! streams, files both ways, a terminal's WebSocket, DELETE) go to its node; names are the
//! fleet's; lists merge the nodes' and page across them; a node killed is `lost` after its
//! lease and its sandboxes' calls are 503, and it joins again with the same id. On SQLite, and
//! on PostgreSQL when `SBX_TEST_PG_URL` names a server (scripts/postgres.sh).
//!
//! Needs root, the base image (SBX_TEST_IMAGES or /var/lib/sbx/images) and the agent built.

mod calls;
mod e2b;
mod failover;
mod harness;
mod http;
mod iii;
mod lease;
mod listen;
mod moves;
#[path = "../support/ports.rs"]
mod ports;
mod recover;

use std::collections::{BTreeSet, HashMap};
use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use harness::{ControlPlane, Node, PgDatabase};
use http::{assert_error, Http};
use serde_json::{json, Value};
use tungstenite::stream::MaybeTlsStream;
use tungstenite::Message;

/// A control plane and two nodes. Nodes are dropped first (then the control plane).
struct Fleet {
    a: Node,
    b: Node,
    ctl: ControlPlane,
    http: Http,
}

impl Fleet {
    fn start(db: Option<&str>) -> Fleet {
        let ctl = ControlPlane::start(db);
        let a = Node::start("node-a", &ctl);
        let b = Node::start("node-b", &ctl);
        Fleet {
            a,
            b,
            ctl,
            http: Http::new(),
        }
    }

    fn url(&self, path: &str) -> String {
        self.ctl.url(path)
    }

    /// The nodes' list, by name.
    fn nodes(&self) -> HashMap<String, Value> {
        let r = self.http.get(&self.url("/internal/nodes"));
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_eq!(v["object"], "list", "{v}");
        v["data"]
            .as_array()
            .unwrap_or_else(|| panic!("no data: {v}"))
            .iter()
            .map(|n| (n["name"].as_str().unwrap_or("").to_string(), n.clone()))
            .collect()
    }

    /// Waits until node `name` is in `state`; its object.
    fn wait_state(&self, name: &str, state: &str, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let nodes = self.nodes();
            if let Some(n) = nodes.get(name).filter(|n| n["state"] == state) {
                return n.clone();
            }
            assert!(
                Instant::now() < deadline,
                "node {name} is not {state} after {timeout:?}: {nodes:?}\n{}",
                self.ctl.log_tail(20)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn node_mut(&mut self, name: &str) -> &mut Node {
        if self.a.name == name {
            &mut self.a
        } else {
            &mut self.b
        }
    }

    fn node(&self, name: &str) -> &Node {
        if self.a.name == name {
            &self.a
        } else {
            &self.b
        }
    }

    fn create(&self, body: &Value) -> Value {
        let r = self.http.post_json(&self.url("/v1/sandboxes"), body);
        assert_eq!(r.status, 201, "{}\n{}", r.text(), self.ctl.log_tail(20));
        r.json()
    }
}

/// The name of the node an answer's sandbox object says it is on, checked against the table's
/// ids (and its epoch: 1, as made).
fn placed_on(obj: &Value, ids: &HashMap<String, String>) -> String {
    let name = obj["node"]["name"].as_str().unwrap_or("").to_string();
    assert_eq!(
        obj["node"]["id"].as_str(),
        ids.get(&name).map(String::as_str),
        "node of {obj}"
    );
    assert_eq!(obj["epoch"], 1, "{obj}");
    name
}

type Ws = tungstenite::WebSocket<MaybeTlsStream<std::net::TcpStream>>;

/// Reads a terminal's output until `want` appears, or its exit message; the output read.
fn read_until(ws: &mut Ws, want: &str, exit: &mut Option<Value>) -> String {
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut seen = Vec::new();
    while Instant::now() < deadline {
        match ws.read() {
            Ok(Message::Binary(b)) => {
                seen.extend_from_slice(&b);
                if String::from_utf8_lossy(&seen).contains(want) {
                    break;
                }
            }
            Ok(Message::Text(t)) => {
                let v: Value = serde_json::from_str(t.as_str()).expect("a JSON control message");
                if v["type"] == "exit" {
                    *exit = Some(v);
                    break;
                }
            }
            Ok(Message::Close(_)) => break,
            Ok(_) => {}
            Err(tungstenite::Error::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => panic!("websocket: {e}"),
        }
    }
    String::from_utf8_lossy(&seen).into_owned()
}

/// Bytes that are not all alike (a file's round trip must keep every one).
fn pattern(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Every case, in order, on one fleet.
fn scenario(f: &mut Fleet) {
    // Both nodes join and are ready.
    let a = f.wait_state("node-a", "ready", Duration::from_secs(20));
    let b = f.wait_state("node-b", "ready", Duration::from_secs(20));
    let mut ids: HashMap<String, String> = HashMap::new();
    for (n, node) in [(&a, &f.a), (&b, &f.b)] {
        let id = n["id"].as_str().unwrap_or("");
        assert!(id.starts_with("nod-") && id.len() == 20, "{n}");
        assert_eq!(n["object"], "node", "{n}");
        assert_eq!(n["url"], format!("http://{}", node.addr), "{n}");
        let build = n["build"].as_str().unwrap_or("");
        assert!(
            build.len() == 16 && build.bytes().all(|c| c.is_ascii_hexdigit()),
            "{n}"
        );
        assert!(n["capacity"]["max_sandboxes"].as_u64() > Some(0), "{n}");
        assert!(n["capacity"]["images"].as_array().is_some(), "{n}");
        assert!(
            n["lease_until"].as_str().is_some_and(|t| t.ends_with('Z')),
            "{n}"
        );
        ids.insert(node.name.clone(), id.to_string());
    }
    assert_eq!(a["build"], b["build"], "one machine, one build");

    // Two creates land on both nodes (the fewest sandboxes first), their answers name the node
    // and the epoch, and each node has its own.
    let s1 = f.create(&json!({}));
    let s2 = f.create(&json!({}));
    let (id1, id2) = (
        s1["id"].as_str().unwrap_or("").to_string(),
        s2["id"].as_str().unwrap_or("").to_string(),
    );
    let (n1, n2) = (placed_on(&s1, &ids), placed_on(&s2, &ids));
    assert_ne!(n1, n2, "two creates on an empty fleet go to both nodes");
    for (id, on) in [(&id1, &n1), (&id2, &n2)] {
        for node in [&f.a, &f.b] {
            let r = f.http.get(&node.url(&format!("/v1/sandboxes/{id}")));
            let want = if node.name == *on { 200 } else { 404 };
            assert_eq!(r.status, want, "{id} on {}: {}", node.name, r.text());
        }
        let r = f.http.get(&f.url(&format!("/v1/sandboxes/{id}")));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(placed_on(&r.json(), &ids), *on);
    }

    // A command through the control plane, its events streamed as they come (not held until
    // it ends), and read again from its output.
    let t0 = Instant::now();
    let resp = f
        .http
        .send(
            "POST",
            &f.url(&format!("/v1/sandboxes/{id1}/run")),
            &[("Accept", "text/event-stream")],
            Some((
                "application/json",
                json!({"command": "echo first; sleep 2; echo second"})
                    .to_string()
                    .as_bytes(),
            )),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(resp.status(), 200);
    assert!(
        resp.content_type().starts_with("text/event-stream"),
        "{}",
        resp.content_type()
    );
    let mut event = String::new();
    let mut first_at = None;
    let mut exit: Option<(Instant, Value)> = None;
    let mut stdout = String::new();
    let mut exec_id = String::new();
    for line in BufReader::new(resp.into_reader()).lines() {
        let line = line.expect("an event stream's line");
        if let Some(e) = line.strip_prefix("event: ") {
            event = e.to_string();
        } else if let Some(d) = line.strip_prefix("data: ") {
            let v: Value = serde_json::from_str(d).expect("an event's JSON");
            match event.as_str() {
                "start" => exec_id = v["id"].as_str().unwrap_or("").to_string(),
                "stdout" => {
                    stdout.push_str(v["data"].as_str().unwrap_or(""));
                    if stdout.contains("first") && first_at.is_none() {
                        first_at = Some(Instant::now());
                    }
                }
                "exit" => {
                    exit = Some((Instant::now(), v));
                    break;
                }
                _ => {}
            }
        }
    }
    let (exit_at, exit) = exit.expect("an exit event");
    let first_at = first_at.expect("the first line as an event");
    assert_eq!(exit["exit_code"], 0, "{exit}");
    assert_eq!(stdout, "first\nsecond\n");
    assert!(
        exit_at.duration_since(first_at) >= Duration::from_millis(1500),
        "the first line came {:?} before the end: the stream was held back (started {:?} ago)",
        exit_at.duration_since(first_at),
        t0.elapsed()
    );
    let r = f
        .http
        .get(&f.url(&format!("/v1/sandboxes/{id1}/exec/{exec_id}/output")));
    assert_eq!(r.status, 200, "{}", r.text());
    let all: String = r.json()["chunks"]
        .as_array()
        .map(|c| {
            c.iter()
                .map(|c| c["data"].as_str().unwrap_or("").to_string())
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(all, "first\nsecond\n", "{}", r.text());

    // A file up and down through the control plane, byte for byte.
    let data = pattern(3 << 20);
    let r = f.http.call(
        "PUT",
        &f.url(&format!("/v1/sandboxes/{id2}/files?path=/tmp/fleet.bin")),
        &[],
        Some(("application/octet-stream", &data)),
    );
    assert!(r.status == 200 || r.status == 201, "{}", r.text());
    let r = f
        .http
        .get(&f.url(&format!("/v1/sandboxes/{id2}/files?path=/tmp/fleet.bin")));
    assert_eq!(r.status, 200);
    assert!(
        r.body == data,
        "the file came back other ({} bytes)",
        r.body.len()
    );
    let r = f.http.get(&f.url(&format!(
        "/v1/sandboxes/{id2}/files/stat?path=/tmp/fleet.bin"
    )));
    assert_eq!(r.json()["size"], 3 << 20, "{}", r.text());

    // A terminal: its WebSocket through the control plane, both ways.
    let r = f.http.post_json(
        &f.url(&format!("/v1/sandboxes/{id1}/exec")),
        &json!({"command": "sh", "tty": true}),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let tty = r.json()["id"].as_str().unwrap_or("").to_string();
    let ws_url = f
        .url(&format!("/v1/sandboxes/{id1}/exec/{tty}/terminal"))
        .replacen("http", "ws", 1);
    let (mut ws, _) = tungstenite::connect(ws_url).expect("a terminal's WebSocket");
    if let MaybeTlsStream::Plain(s) = ws.get_mut() {
        s.set_read_timeout(Some(Duration::from_millis(50)))
            .expect("a read timeout");
    }
    let mut exit = None;
    ws.send(Message::Binary(b"echo marker-$((6*7))\n".to_vec().into()))
        .expect("send to the terminal");
    let out = read_until(&mut ws, "marker-42", &mut exit);
    assert!(out.contains("marker-42"), "{out:?}");
    ws.send(Message::Binary(b"exit 3\n".to_vec().into()))
        .expect("send to the terminal");
    read_until(&mut ws, "\u{0}never", &mut exit);
    let exit = exit.expect("the terminal's exit message");
    assert_eq!(exit["exit_code"], 3, "{exit}");

    // A fork through the control plane: its new sandbox is the table's, on the same node.
    let r = f
        .http
        .post_json(&f.url(&format!("/v1/sandboxes/{id1}/fork")), &json!({}));
    assert_eq!(r.status, 201, "{}", r.text());
    let fork = r.json();
    let copy = fork["sandboxes"][0].clone();
    assert_eq!(placed_on(&copy, &ids), n1, "{fork}");
    let copy_id = copy["id"].as_str().unwrap_or("").to_string();
    let r = f.http.get(&f.url(&format!("/v1/sandboxes/{copy_id}")));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(placed_on(&r.json(), &ids), n1);

    // Names are the fleet's: a name a sandbox has on one node is refused for a create that
    // would land on the other (the first is draining: nothing else is placed on it), and by
    // the same node's own rule it would be free there.
    let named = f.create(&json!({"name": "fleet-name"}));
    let holder = placed_on(&named, &ids);
    let other = if holder == "node-a" {
        "node-b"
    } else {
        "node-a"
    };
    let r = f.http.post_json(
        &f.url(&format!("/internal/nodes/{}/drain", ids[&holder])),
        &json!({"draining": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["state"], "draining");
    let r = f
        .http
        .post_json(&f.url("/v1/sandboxes"), &json!({"name": "fleet-name"}));
    let e = assert_error(&r, 409, "name_taken", Some("name"));
    assert_eq!(e["retryable"], false);
    let r = f.http.get(&f.node(other).url("/v1/sandboxes/fleet-name"));
    assert_eq!(r.status, 404, "never made on {other}: {}", r.text());
    let r = f.http.post_json(
        &f.url("/v1/run"),
        &json!({"command": "true", "name": "fleet-name"}),
    );
    assert_error(&r, 409, "name_taken", Some("name"));
    let on_other = f.create(&json!({"name": "fleet-other"}));
    assert_eq!(
        placed_on(&on_other, &ids),
        other,
        "a draining node takes nothing"
    );
    let r = f.http.post_json(
        &f.url(&format!("/internal/nodes/{}/drain", ids[&holder])),
        &json!({"draining": false}),
    );
    assert_eq!(r.json()["state"], "ready", "{}", r.text());
    // A run's name is held while it runs and free as soon as it is over.
    for _ in 0..2 {
        let r = f.http.post_json(
            &f.url("/v1/run"),
            &json!({"command": "echo once", "name": "fleet-run"}),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["stdout"], "once\n", "{}", r.text());
    }
    let after_runs = f.create(&json!({"name": "fleet-run"}));
    let r = f.http.delete(&f.url("/v1/sandboxes/fleet-run"));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["id"], after_runs["id"]);

    // The list merges both nodes' sandboxes, and pages across them: every sandbox once.
    let made: BTreeSet<String> = [&s1, &s2, &named, &on_other, &copy]
        .iter()
        .map(|s| s["id"].as_str().unwrap_or("").to_string())
        .collect();
    let r = f.http.get(&f.url("/v1/sandboxes"));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["has_more"], false, "{v}");
    let listed: BTreeSet<String> = v["data"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .map(|s| {
            placed_on(s, &ids);
            s["id"].as_str().unwrap_or("").to_string()
        })
        .collect();
    assert_eq!(listed, made, "{v}");
    let on: BTreeSet<&str> = v["data"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["node"]["name"].as_str())
        .collect();
    assert_eq!(on.len(), 2, "both nodes' sandboxes: {v}");
    let mut paged = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..20 {
        let url = match &cursor {
            Some(c) => f.url(&format!("/v1/sandboxes?limit=1&cursor={c}")),
            None => f.url("/v1/sandboxes?limit=1"),
        };
        let r = f.http.get(&url);
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        let data = v["data"].as_array().cloned().unwrap_or_default();
        assert!(data.len() <= 1, "{v}");
        paged.extend(
            data.iter()
                .map(|s| s["id"].as_str().unwrap_or("").to_string()),
        );
        cursor = v["next_cursor"].as_str().map(String::from);
        assert_eq!(v["has_more"], cursor.is_some(), "{v}");
        if cursor.is_none() {
            break;
        }
    }
    assert!(cursor.is_none(), "the pages did not end: {paged:?}");
    let set: BTreeSet<String> = paged.iter().cloned().collect();
    assert_eq!(set.len(), paged.len(), "a sandbox listed twice: {paged:?}");
    assert_eq!(set, made, "{paged:?}");
    let r = f.http.get(&f.url("/v1/sandboxes?cursor=not-a-cursor"));
    assert_error(&r, 400, "invalid_field", Some("cursor"));

    // A sandbox nobody has: the node's own 404.
    let r = f.http.get(&f.url("/v1/sandboxes/sbx-0000000000000000"));
    let e = assert_error(&r, 404, "sandbox_not_found", None);
    assert_eq!(e["retryable"], false);
    let r = f.http.post_json(
        &f.url("/v1/sandboxes/no-such-box/exec"),
        &json!({"command": "true"}),
    );
    assert_error(&r, 404, "sandbox_not_found", None);
    // A route of a node's own that the fleet does not serve says so.
    let r = f.http.get(&f.url("/v1/volumes"));
    assert_error(&r, 503, "not_served_here", None);

    // DELETE through the control plane: gone from the node and from the table.
    let r = f.http.delete(&f.url("/v1/sandboxes/fleet-other"));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["id"], on_other["id"]);
    let r = f.http.get(&f.url("/v1/sandboxes/fleet-other"));
    assert_error(&r, 404, "sandbox_not_found", None);
    let gone = on_other["id"].as_str().unwrap_or("");
    let r = f
        .http
        .get(&f.node(other).url(&format!("/v1/sandboxes/{gone}")));
    assert_eq!(r.status, 404, "{}", r.text());

    // A node killed is lost once its lease (3 s) runs out; its sandboxes' calls are 503,
    // retryable, and the list says which node it misses.
    f.node_mut(&n2).kill();
    let lost = f.wait_state(&n2, "lost", Duration::from_secs(10));
    assert_eq!(lost["id"], ids[&n2].as_str());
    let r = f.http.get(&f.url(&format!("/v1/sandboxes/{id2}")));
    let e = assert_error(&r, 503, "unavailable", None);
    assert_eq!(e["retryable"], true);
    assert!(
        e["message"].as_str().is_some_and(|m| m.contains("lost")),
        "{e}"
    );
    assert_eq!(r.header("retry-after"), Some("1"));
    let r = f.http.post_json(
        &f.url(&format!("/v1/sandboxes/{id2}/exec")),
        &json!({"command": "true"}),
    );
    assert_error(&r, 503, "unavailable", None);
    let v = f.http.get(&f.url("/v1/sandboxes")).json();
    assert_eq!(v["missing_nodes"][0]["id"], ids[&n2].as_str(), "{v}");
    assert!(
        v["data"]
            .as_array()
            .into_iter()
            .flatten()
            .all(|s| s["id"] != id2.as_str()),
        "{v}"
    );
    // New sandboxes go to the node that is left.
    let s3 = f.create(&json!({}));
    assert_eq!(placed_on(&s3, &ids), n1);

    // Started again with the same name: the same id, ready again, its sandbox served again.
    f.node_mut(&n2).restart();
    let back = f.wait_state(&n2, "ready", Duration::from_secs(20));
    assert_eq!(back["id"], ids[&n2].as_str(), "the same name keeps its id");
    let r = f.http.get(&f.url(&format!("/v1/sandboxes/{id2}")));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(placed_on(&r.json(), &ids), n2);

    // Everything deleted through the control plane; nothing left in the list.
    for id in [
        &id1,
        &id2,
        &copy_id,
        s3["id"].as_str().unwrap_or(""),
        named["id"].as_str().unwrap_or(""),
    ] {
        let r = f.http.delete(&f.url(&format!("/v1/sandboxes/{id}")));
        assert_eq!(r.status, 200, "DELETE {id}: {}", r.text());
    }
    let v = f.http.get(&f.url("/v1/sandboxes")).json();
    assert_eq!(v["data"], json!([]), "{v}");
}

#[test]
fn a_fleet_on_sqlite() {
    let mut f = Fleet::start(None);
    scenario(&mut f);
}

#[test]
fn a_fleet_on_postgres() {
    let Ok(admin) = std::env::var("SBX_TEST_PG_URL") else {
        eprintln!("SBX_TEST_PG_URL is not set: the fleet on PostgreSQL was skipped");
        return;
    };
    let db = PgDatabase::create(&admin);
    let mut f = Fleet::start(Some(&db.url));
    scenario(&mut f);
    // The fleet stops before its database is dropped.
    drop(f);
    drop(db);
}
