//! E2B's SDK and preview URLs on the fleet (issue #29): a control plane with `--e2b-listen`
//! and `--preview-listen`, two nodes with their own (all with one key file, as the nodes of
//! tests/it/e2b.rs), and E2B's real Python SDK (scripts/e2b-sdks.sh) pointed at the control
//! plane only (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY):
//!
//! - the SDK creates a sandbox through the control plane (placed on a node, in the table at
//!   epoch 1), runs commands, writes a file and starts a web server in it;
//! - the web server is reached through the control plane's preview listener
//!   (`8000-{id}.localhost`), the Host kept for the node, and a WebSocket to its echo server
//!   (`8001-{id}.localhost`) bridged both ways;
//! - the sandbox is moved to the other node (`POST /internal/moves`); the SDK connects to it
//!   by id through the same URLs, reads the file, runs commands; the preview URL serves again;
//! - E2B's list through the control plane has it; E2B's DELETE removes it and its row.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::harness::{free_port, ControlPlane, FleetStore, Node, NodeMore, NodeOpts, PgDatabase};
use crate::http::{Http, Reply};

/// E2B's form of key: `e2b_` and 40 hex digits (the fleet's one key).
const KEY: &str = "e2b_7a1c0e9d2b3f4a5c6d7e8f90a1b2c3d4e5f6a7b8";

/// Where scripts/e2b-sdks.sh put the SDKs.
fn sdk_dir() -> PathBuf {
    let dir = std::env::var_os("SBX_E2B_SDK_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/e2b-sdk"));
    assert!(
        dir.join("stamp").is_file(),
        "E2B's SDKs are not installed in {}: run scripts/e2b-sdks.sh (test.sh does)",
        dir.display()
    );
    dir
}

/// Runs an SDK script (tests/e2b/) against the control plane's E2B listener; its output.
fn run_script(e2b: &str, script: &str, args: &[&str]) -> String {
    let sdk = sdk_dir();
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/e2b")
        .join(script);
    let url = format!("http://{e2b}");
    let path_env = format!(
        "{}:{}",
        sdk.join("venv/bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new(sdk.join("venv/bin/python"))
        .arg(&path)
        .args(args)
        .env("PATH", path_env)
        .env("E2B_API_URL", &url)
        .env("E2B_SANDBOX_URL", &url)
        .env("E2B_API_KEY", KEY)
        .env_remove("E2B_DOMAIN")
        .env_remove("E2B_DEBUG")
        .output()
        .unwrap_or_else(|e| panic!("run {script}: {e}"));
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("all passed"),
        "{script} failed ({}):\n{text}",
        out.status
    );
    text
}

/// A request over a plain TCP connection, the Host as given: its status and body.
fn raw(
    addr: &str,
    method: &str,
    host: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("a read timeout");
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).expect("send the request");
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).expect("read the answer");
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse::<u16>().ok())
        .unwrap_or_else(|| panic!("no status in {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// The fleet: a control plane with both listeners, two nodes with theirs, one key file.
struct Fleet {
    a: Node,
    b: Node,
    ctl: ControlPlane,
    _store: FleetStore,
    http: Http,
    e2b: String,
    preview: String,
    node_e2b: [String; 2],
    _keys_dir: KeysDir,
}

/// The folder of the key file, removed when dropped (also when a start fails half way).
struct KeysDir(PathBuf);

impl Drop for KeysDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Fleet {
    /// The fleet on `db` (a database URL; None: SQLite).
    fn start(db: Option<&str>) -> Fleet {
        // A folder of this fleet's own (two fleets of this file may run at once).
        static FLEETS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = FLEETS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let keys_dir =
            std::env::temp_dir().join(format!("sbx-fleet-e2b-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&keys_dir).expect("make the keys' folder");
        let keys_dir = KeysDir(keys_dir);
        let keys = keys_dir.0.join("keys");
        std::fs::write(&keys, format!("{KEY}\n")).expect("write the key file");
        let keys = keys.to_string_lossy().into_owned();
        let store = FleetStore::dir();
        let e2b = format!("127.0.0.1:{}", free_port());
        let preview = format!("127.0.0.1:{}", free_port());
        let ctl = ControlPlane::start_args(
            db,
            Some(&store),
            &[
                "--api-keys".into(),
                keys.clone(),
                "--e2b-listen".into(),
                e2b.clone(),
                "--preview-listen".into(),
                preview.clone(),
            ],
        );
        let node_e2b = [
            format!("127.0.0.1:{}", free_port()),
            format!("127.0.0.1:{}", free_port()),
        ];
        let start = |name: &str, listen: &str| {
            Node::start_more(
                name,
                &ctl,
                NodeOpts {
                    store: Some(&store),
                    other_build: false,
                },
                NodeMore {
                    args: vec![
                        "--api-keys".into(),
                        keys.clone(),
                        "--e2b-listen".into(),
                        listen.to_string(),
                    ],
                    standalone: false,
                },
            )
        };
        let a = start("node-a", &node_e2b[0]);
        let b = start("node-b", &node_e2b[1]);
        Fleet {
            a,
            b,
            ctl,
            _store: store,
            http: Http::new(),
            e2b,
            preview,
            node_e2b,
            _keys_dir: keys_dir,
        }
    }

    fn logs(&self) -> String {
        format!(
            "{}\n{}\n{}",
            self.ctl.log_tail(30),
            self.a.log_tail(30),
            self.b.log_tail(30)
        )
    }

    /// A call of the control plane's API with the key.
    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Reply {
        let auth = format!("Bearer {KEY}");
        let bytes = body.map(|b| b.to_string().into_bytes());
        self.http.call(
            method,
            &self.ctl.url(path),
            &[("Authorization", &auth)],
            bytes.as_deref().map(|b| ("application/json", b)),
        )
    }

    /// The nodes' list once both are ready, by name.
    fn ready_nodes(&self) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let r = self.call("GET", "/internal/nodes", None);
            assert_eq!(r.status, 200, "{}", r.text());
            let v = r.json();
            let nodes: Vec<Value> = v["data"].as_array().cloned().unwrap_or_default();
            if nodes.len() == 2 && nodes.iter().all(|n| n["state"] == "ready") {
                return nodes;
            }
            assert!(
                Instant::now() < deadline,
                "nodes not ready: {v}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The table's sandbox (node and epoch) through `/v1`.
    fn sandbox(&self, id: &str) -> Value {
        let r = self.call("GET", &format!("/v1/sandboxes/{id}"), None);
        assert_eq!(r.status, 200, "GET {id}: {}\n{}", r.text(), self.logs());
        r.json()
    }

    /// Moves `id` to node `to` and waits until the move is done.
    fn move_to(&self, id: &str, to: &str) {
        let r = self.call(
            "POST",
            "/internal/moves",
            Some(&json!({ "sandbox_id": id, "to": to })),
        );
        assert_eq!(r.status, 202, "move: {}\n{}", r.text(), self.logs());
        let mv = r.json()["id"].as_str().unwrap_or_default().to_string();
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let r = self.call("GET", &format!("/internal/moves/{mv}"), None);
            let v = r.json();
            match v["step"].as_str() {
                Some("done") => return,
                Some("failed") => panic!("the move failed: {v}\n{}", self.logs()),
                _ => {}
            }
            assert!(
                Instant::now() < deadline,
                "the move is not done: {v}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The preview host of port 8000 of `sandbox` at the control plane.
    fn preview_host(&self, sandbox: &str) -> String {
        let port = self.preview.rsplit(':').next().unwrap_or("");
        format!("8000-{sandbox}.localhost:{port}")
    }

    /// `GET /fleet.txt` of the sandbox's web server through the control plane's preview
    /// listener, with the key (port 8000 is not public): tried until it answers 200 (a woken
    /// sandbox's server takes a moment).
    fn preview_file(&self, sandbox: &str) -> String {
        let auth = format!("Bearer {KEY}");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (status, body) = raw(
                &self.preview,
                "GET",
                &self.preview_host(sandbox),
                "/fleet.txt",
                &[("Authorization", &auth)],
            );
            if status == 200 {
                return body;
            }
            assert!(
                Instant::now() < deadline,
                "the preview answers {status}: {body}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// A WebSocket to port 8001 of `sandbox` through the control plane's preview listener (the
/// Host names the sandbox): a text sent comes back from the sandbox's echo server.
fn websocket_echo(f: &Fleet, sandbox: &str, text: &str) {
    let port = f.preview.rsplit(':').next().unwrap_or("");
    let url = format!("ws://8001-{sandbox}.localhost:{port}/echo");
    let stream = TcpStream::connect(&f.preview).expect("connect to the preview listener");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("a read timeout");
    let (mut ws, resp) = tungstenite::client::client(url.as_str(), stream)
        .unwrap_or_else(|e| panic!("the WebSocket through the control plane: {e}\n{}", f.logs()));
    assert_eq!(resp.status().as_u16(), 101);
    ws.send(tungstenite::Message::Text(text.to_string().into()))
        .expect("send a text");
    match ws.read().expect("the echo") {
        tungstenite::Message::Text(t) => assert_eq!(t.as_str(), text),
        other => panic!("not a text: {other:?}"),
    }
    let _ = ws.close(None);
}

#[test]
fn e2b_s_sdk_and_preview_urls_follow_a_moved_sandbox() {
    scenario(&Fleet::start(None));
}

#[test]
fn e2b_s_sdk_and_preview_urls_follow_a_moved_sandbox_on_postgres() {
    let Ok(admin) = std::env::var("SBX_TEST_PG_URL") else {
        eprintln!("SBX_TEST_PG_URL is not set: E2B on a fleet on PostgreSQL was skipped");
        return;
    };
    let db = PgDatabase::create(&admin);
    let f = Fleet::start(Some(&db.url));
    scenario(&f);
    // The fleet stops before its database is dropped.
    drop(f);
    drop(db);
}

fn scenario(f: &Fleet) {
    // Each node tells the control plane where its E2B and preview listeners are.
    let nodes = f.ready_nodes();
    for n in &nodes {
        let name = n["name"].as_str().unwrap_or_default();
        let (e2b, preview) = if name == "node-a" {
            (&f.node_e2b[0], &f.a)
        } else {
            (&f.node_e2b[1], &f.b)
        };
        assert_eq!(n["e2b_url"], format!("http://{e2b}"), "{n}");
        let pv = n["preview_url"].as_str().unwrap_or_default();
        assert!(pv.starts_with("http://127.0.0.1:"), "{n}");
        assert_ne!(pv, format!("http://{}", preview.addr), "{n}");
    }

    // E2B's control plane at the control plane wants the key; the SDK sends it.
    let (status, body) = raw(&f.e2b, "GET", &f.e2b, "/v2/sandboxes", &[]);
    assert_eq!(status, 401, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap_or_default();
    assert_eq!(v["code"], 401, "{v}");

    // The SDK makes a sandbox through the control plane.
    let out = run_script(&f.e2b, "fleet_create.py", &[]);
    eprintln!("{out}");
    let id = out
        .lines()
        .find_map(|l| l.strip_prefix("sandbox: "))
        .unwrap_or_else(|| panic!("no sandbox id in:\n{out}"))
        .trim()
        .to_string();
    let sb = f.sandbox(&id);
    assert_eq!(sb["epoch"], 1, "{sb}");
    let first = sb["node"]["name"].as_str().unwrap_or_default().to_string();
    let other = if first == "node-a" {
        "node-b"
    } else {
        "node-a"
    };

    // Its web server through the control plane's preview listener (E2B's sandboxes' ports are
    // public by E2B's default: the node lets a request without credentials in).
    assert_eq!(f.preview_file(&id), "written before the move");
    let (status, body) = raw(&f.preview, "GET", &f.preview_host(&id), "/fleet.txt", &[]);
    assert_eq!((status, body.as_str()), (200, "written before the move"));
    websocket_echo(f, &id, "before the move");
    let (status, body) = raw(&f.preview, "GET", "localhost", "/", &[]);
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("not a preview host"), "{body}");
    let (status, body) = raw(
        &f.preview,
        "GET",
        &f.preview_host("sbx-0000000000000000"),
        "/",
        &[],
    );
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("sandbox_not_found"), "{body}");

    // Moved to the other node: the table says so (epoch 2).
    f.move_to(&id, other);
    let sb = f.sandbox(&id);
    assert_eq!(sb["node"]["name"], other, "{sb}");
    assert_eq!(sb["epoch"], 2, "{sb}");

    // The SDK goes on with the same URLs: connect by id, the file, commands.
    let out = run_script(&f.e2b, "fleet_connect.py", &[&id]);
    eprintln!("{out}");
    // The preview URL serves again, from the new node.
    assert_eq!(f.preview_file(&id), "written before the move");
    websocket_echo(f, &id, "after the move");

    // A snapshot of it through the control plane is taken on its node; sandboxes made of the
    // snapshot go to that node (the one that holds it), whichever is placed first otherwise;
    // the snapshot's delete goes there too.
    let e2b_call = |method: &str, path: &str, body: Option<&str>| {
        f.http.call(
            method,
            &format!("http://{}{path}", f.e2b),
            &[("X-API-KEY", KEY)],
            body.map(|b| ("application/json", b.as_bytes())),
        )
    };
    let snap = e2b_call("POST", &format!("/sandboxes/{id}/snapshots"), Some("{}"));
    assert!(snap.status == 201 || snap.status == 200, "{}", snap.text());
    let snap_id = snap.json()["snapshotID"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(snap_id.starts_with("snap-"), "{}", snap.text());
    for _ in 0..3 {
        let made = e2b_call(
            "POST",
            "/sandboxes",
            Some(&json!({"templateID": snap_id, "timeout": 120}).to_string()),
        );
        assert_eq!(made.status, 201, "{}", made.text());
        let new_id = made.json()["sandboxID"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert_eq!(f.sandbox(&new_id)["node"]["name"], other, "{}", made.text());
        let r = e2b_call("DELETE", &format!("/sandboxes/{new_id}"), None);
        assert!(r.status == 204 || r.status == 200, "{}", r.text());
    }
    let r = e2b_call("DELETE", &format!("/templates/{snap_id}"), None);
    assert!(r.status == 204 || r.status == 200, "{}", r.text());

    // E2B's list through the control plane has it; its detail names the control plane's
    // preview domain.
    let list = f.http.call(
        "GET",
        &format!("http://{}/v2/sandboxes?state=running", f.e2b),
        &[("X-API-KEY", KEY)],
        None,
    );
    assert_eq!(list.status, 200, "{}", list.text());
    let ids: Vec<String> = list
        .json()
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter_map(|s| s["sandboxID"].as_str().map(String::from))
        .collect();
    assert!(ids.contains(&id), "{ids:?}");
    let detail = f.http.call(
        "GET",
        &format!("http://{}/sandboxes/{id}", f.e2b),
        &[("X-API-KEY", KEY)],
        None,
    );
    assert_eq!(detail.status, 200, "{}", detail.text());
    let port = f.preview.rsplit(':').next().unwrap_or("");
    assert_eq!(
        detail.json()["domain"],
        format!("localhost:{port}"),
        "{}",
        detail.text()
    );

    // E2B's kill through the control plane: gone from the node and from the table.
    let r = f.http.call(
        "DELETE",
        &format!("http://{}/sandboxes/{id}", f.e2b),
        &[("X-API-KEY", KEY)],
        None,
    );
    assert!(
        r.status == 204 || r.status == 200,
        "{} {}",
        r.status,
        r.text()
    );
    let r = f.call("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(r.status, 404, "{}", r.text());
}
