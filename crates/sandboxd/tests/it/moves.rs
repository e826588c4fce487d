//! The old node's side of a move (`POST /internal/sandboxes/{id}/release` and `…/forget`, the
//! take-back of a reclaim through `…/takeover`): one real node with a directory store. A
//! running sandbox is put to sleep, the store holds that sleep, and from then on the node
//! answers 409 `moved` for it (also after a restart); its open event stream ends with
//! `sandbox_moved`; a reclaim takes it back with its processes; a forget leaves nothing.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common::{create_with, Event, TestNode};

/// A command in the sandbox, waited for: its stdout (it must succeed).
fn sh(node: &TestNode, id: &str, line: &str) -> String {
    let v = node.exec(id, &json!({ "command": line, "wait_seconds": 20 }));
    assert_eq!(v["exit_code"], 0, "{line}: {v}");
    v["stdout"].as_str().unwrap_or_default().to_string()
}

fn count(node: &TestNode, id: &str) -> u64 {
    sh(node, id, "cat /tmp/count")
        .trim()
        .parse()
        .expect("a count")
}

/// A directory store of the test's own, removed when dropped (also where its node did not
/// start).
struct StoreDir(PathBuf);

impl Drop for StoreDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A directory store of the test's own: its directory (removed with it) and URL.
fn file_store(tag: &str) -> (StoreDir, String) {
    let dir = std::env::temp_dir().join(format!("sbx-it-moves-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let url = format!("file://{}", dir.display());
    (StoreDir(dir), url)
}

/// A named sandbox with a file and a process that counts into /tmp/count.
fn counting_sandbox(node: &TestNode, name: &str) -> String {
    let name = name.to_string();
    let id = node
        .client()
        .create_sandbox(&create_with(|r| r.name = Some(name)))
        .expect("create")
        .id
        .clone();
    sh(node, &id, "echo 'hello move' > /root/hello.txt");
    sh(
        node,
        &id,
        "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done' >/dev/null 2>&1 < /dev/null &",
    );
    std::thread::sleep(Duration::from_millis(300));
    id
}

fn release(node: &TestNode, id: &str, epoch: u64, to: &str, move_id: &str) -> (u16, Value) {
    let r = node.post_json(
        &format!("/internal/sandboxes/{id}/release"),
        &json!({ "epoch": epoch, "to": to, "move_id": move_id }),
    );
    (r.status, r.json())
}

fn forget(node: &TestNode, id: &str, body: &Value) -> (u16, Value) {
    let r = node.post_json(&format!("/internal/sandboxes/{id}/forget"), body);
    (r.status, r.json())
}

/// Asserts a 409 `moved` naming `to` and `epoch` beside the error.
fn assert_moved(status: u16, body: &Value, to: Option<&str>, epoch: u64, what: &str) {
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (409, Some("moved")),
        "{what}: {body}"
    );
    assert_eq!(body["to"], json!(to), "{what}: {body}");
    assert_eq!(body["epoch"], json!(epoch), "{what}: {body}");
}

fn code(body: &Value) -> &str {
    body["error"]["code"].as_str().unwrap_or_default()
}

/// Every call of the API for a released sandbox answers 409 moved.
fn assert_fenced(node: &TestNode, id: &str, name: &str, to: Option<&str>, epoch: u64) {
    let r = node.get(&format!("/v1/sandboxes/{id}"), &[]);
    assert_moved(r.status, &r.json(), to, epoch, "GET by id");
    let r = node.get(&format!("/v1/sandboxes/{name}"), &[]);
    assert_moved(r.status, &r.json(), to, epoch, "GET by name");
    let r = node.post_json(
        &format!("/v1/sandboxes/{id}/exec"),
        &json!({ "command": "true" }),
    );
    assert_moved(r.status, &r.json(), to, epoch, "exec");
    let r = node.get(
        &format!("/v1/sandboxes/{id}/files?path=/root/hello.txt"),
        &[],
    );
    assert_moved(r.status, &r.json(), to, epoch, "files");
    let r = node.post_json(&format!("/v1/sandboxes/{id}/wake"), &json!({}));
    assert_moved(r.status, &r.json(), to, epoch, "wake");
    let r = node.delete(&format!("/v1/sandboxes/{id}"), &[]);
    assert_moved(r.status, &r.json(), to, epoch, "delete");
    // Not this node's: not listed, not counted.
    let r = node.get("/v1/sandboxes", &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    let listed = r.json()["data"]
        .as_array()
        .is_some_and(|a| a.iter().any(|s| s["id"] == id));
    assert!(!listed, "a released sandbox listed: {}", r.text());
    let info = node.get("/internal/node", &[]).json();
    assert_eq!(info["kept"], 0, "{info}");
    // Nothing of it runs.
    assert_eq!(node.agent_pid(id), None, "a released sandbox runs");
}

/// Reads an event stream to its end in a thread of its own.
fn read_stream(
    node: &TestNode,
    path: String,
) -> (
    std::thread::JoinHandle<Vec<Event>>,
    std::sync::mpsc::Receiver<()>,
) {
    let mut stream = node.open_sse_get(&path, &[]);
    let (tx, rx) = std::sync::mpsc::channel();
    let h = std::thread::spawn(move || {
        let mut out = Vec::new();
        while let Some(e) = stream.next_event() {
            if e.event == "stdout" {
                let _ = tx.send(());
            }
            out.push(e);
        }
        out
    });
    (h, rx)
}

/// Names of files and directories under `dir` that contain `id`.
fn files_named(dir: &Path, id: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if e.file_name().to_string_lossy().contains(id) {
                out.push(p.display().to_string());
            }
            if e.file_type().is_ok_and(|t| t.is_dir() && !t.is_symlink()) {
                stack.push(p);
            }
        }
    }
    out
}

#[test]
fn a_running_sandbox_is_released_fenced_taken_back_and_forgotten() {
    let (_dir, url) = file_store("main");
    let mut node = TestNode::start_with(&["--store", &url]);
    let id = counting_sandbox(&node, "mover");
    // A command printing a line every 100 ms, its output streamed.
    let ticker = node.exec(
        &id,
        &json!({ "command": "i=0; while :; do echo tick$i; i=$((i+1)); sleep 0.1; done" }),
    );
    let exec_id = ticker["id"].as_str().expect("an exec id").to_string();
    let (reader, ticks) = read_stream(&node, format!("/v1/sandboxes/{id}/exec/{exec_id}/output"));
    for _ in 0..3 {
        ticks
            .recv_timeout(Duration::from_secs(10))
            .expect("the stream's output");
    }
    let before = count(&node, &id);

    // Another epoch than the node's: refused, the node's beside.
    let (s, b) = release(&node, &id, 2, "node-b", "mov-0000000000000001");
    assert_eq!((s, code(&b)), (409, "wrong_epoch"), "{b}");
    assert_eq!(b["epoch"], 1, "{b}");

    let started = Instant::now();
    let (s, answer) = release(&node, &id, 1, "node-b", "mov-0000000000000002");
    assert_eq!(s, 200, "{answer}\n{}", node.log_tail(30));
    eprintln!("released in {:?}: {answer}", started.elapsed());
    assert_eq!(answer["sandbox_id"], id.as_str());
    assert_eq!(
        (
            answer["epoch"].as_u64(),
            answer["to"].as_str(),
            answer["slept"].as_bool()
        ),
        (Some(1), Some("node-b"), Some(true))
    );
    assert_eq!(answer["move_id"], "mov-0000000000000002");
    let stored = &answer["stored"];
    let generation = stored["generation"].as_u64().expect("a generation");
    assert_eq!(stored["epoch"], 1, "{stored}");
    assert_eq!(stored["image"], "base", "{stored}");
    assert!(
        stored["build"].as_str().is_some_and(|b| !b.is_empty()),
        "{stored}"
    );
    assert!(stored["bytes"].as_u64().is_some_and(|b| b > 0), "{stored}");
    // The store holds that very sleep: its manifest names its parts.
    let store = sbx_blob::Store::open(&url).expect("the store");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let m = rt.block_on(store.manifest(&id, 1)).expect("the manifest");
    assert_eq!(m.build, stored["build"].as_str().unwrap_or_default());
    assert!(
        m.parts
            .iter()
            .any(|p| p.name == format!("memory-{generation}")),
        "{m:?}"
    );
    // Its files where they are kept, for a node on this machine.
    let local = &answer["local"];
    let host = format!(
        "{}:{}",
        std::fs::read_to_string("/etc/machine-id")
            .unwrap_or_default()
            .trim(),
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .unwrap_or_default()
            .trim()
    );
    assert_eq!(local["host"], host.as_str(), "{local}");
    let memory = PathBuf::from(local["memory"].as_str().expect("memory"));
    assert!(memory.join("inventory.img").is_file(), "{local}");
    let disk = PathBuf::from(local["disk"].as_str().expect("disk"));
    assert_eq!(
        std::fs::read_to_string(disk.join("root/hello.txt")).expect("the file"),
        "hello move\n"
    );

    // The open stream ended with sandbox_moved, where it was.
    let events = reader.join().expect("the stream's reader");
    let last = events.last().expect("events");
    assert_eq!(last.event, "error", "{events:?}");
    assert_eq!(code(&last.data), "sandbox_moved", "{:?}", last.data);
    assert_eq!(last.data["to"], "node-b");
    assert_eq!(last.data["epoch"], 1);
    assert_eq!(last.data["exec_id"], exec_id.as_str());
    let before_last = &events[events.len() - 2];
    assert_eq!(before_last.event, "stdout", "{events:?}");
    assert_eq!(last.data["offset"], before_last.id, "{events:?}");
    let offset = before_last.id;

    // The same release again: the same answer; another move: no.
    let (s, again) = release(&node, &id, 1, "node-b", "mov-0000000000000002");
    assert_eq!((s, &again), (200, &answer));
    let (s, b) = release(&node, &id, 1, "node-c", "mov-0000000000000003");
    assert_eq!((s, code(&b)), (409, "wrong_epoch"), "{b}");
    assert_eq!(b["epoch"], 1, "{b}");

    assert_fenced(&node, &id, "mover", Some("node-b"), 1);
    // The name stays taken while the copy is kept.
    let r = node.post_json("/v1/sandboxes", &json!({ "name": "mover" }));
    assert_eq!(
        (r.status, code(&r.json())),
        (409, "name_taken"),
        "{}",
        r.text()
    );

    // A restart keeps it fenced, asleep, its files kept.
    node.stop();
    node.restart();
    assert_fenced(&node, &id, "mover", Some("node-b"), 1);
    assert!(node.sandbox_dir(&id).is_dir());
    let (s, again) = release(&node, &id, 1, "node-b", "mov-0000000000000002");
    assert_eq!((s, &again), (200, &answer), "after a restart");

    // A reclaim (E+2) takes it back: it runs on with its processes and its command.
    let reclaim = json!({
        "epoch": 3,
        "from": { "id": "nod-b", "name": "node-b", "url": "http://127.0.0.1:1" },
        "reclaim": true,
        "wake": true,
    });
    let r = node.post_json(&format!("/internal/sandboxes/{id}/takeover"), &reclaim);
    assert_eq!(r.status, 200, "{}\n{}", r.text(), node.log_tail(30));
    let back = r.json();
    // The same reclaim asked again (its answer lost on the way): the same answer, not
    // wrong_epoch.
    let r = node.post_json(&format!("/internal/sandboxes/{id}/takeover"), &reclaim);
    assert_eq!(
        (r.status, r.json()),
        (200, back.clone()),
        "a reclaim asked again"
    );
    assert_eq!(
        (
            back["source"].as_str(),
            back["epoch"].as_u64(),
            back["woke"].as_bool()
        ),
        (Some("kept"), Some(3), Some(true)),
        "{back}"
    );
    assert!(back["memory"].as_u64().is_some_and(|b| b > 0), "{back}");
    let sb = node.get("/v1/sandboxes/mover", &[]);
    assert_eq!(sb.status, 200, "{}", sb.text());
    assert_eq!(sb.json()["status"], "running");
    let after = count(&node, &id);
    assert!(
        after >= before,
        "the counter went back: {before} then {after}"
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(count(&node, &id) > after, "the counter stopped");
    // The command goes on: its stream read on from where it ended.
    let mut stream = node.open_sse_get(
        &format!("/v1/sandboxes/{id}/exec/{exec_id}/output"),
        &[("Last-Event-ID", &offset.to_string())],
    );
    let next = stream.next_event().expect("an event");
    assert_eq!(next.event, "stdout", "{next:?}");
    assert_eq!(next.data["position"], offset, "{next:?}");
    drop(stream);
    let listed = node.get("/v1/sandboxes", &[]).json();
    assert!(
        listed["data"]
            .as_array()
            .is_some_and(|a| a.iter().any(|s| s["id"] == id.as_str())),
        "{listed}"
    );

    // Released again at its new epoch, then forgotten: nothing of it is left.
    let (s, b) = release(&node, &id, 1, "node-b", "mov-0000000000000004");
    assert_eq!((s, code(&b)), (409, "wrong_epoch"), "{b}");
    assert_eq!(b["epoch"], 3, "{b}");
    let (s, b) = release(&node, &id, 3, "node-b", "mov-0000000000000004");
    assert_eq!(s, 200, "{b}");
    let (s, b) = forget(&node, &id, &json!({ "epoch": 2, "to": "node-b" }));
    assert_eq!((s, code(&b)), (409, "wrong_epoch"), "{b}");
    assert_eq!(b["epoch"], 3, "{b}");
    let (s, b) = forget(&node, &id, &json!({ "epoch": 4, "to": "node-b" }));
    assert_eq!(s, 200, "{b}");
    assert_eq!(b, json!({ "sandbox_id": id, "epoch": 4, "removed": true }));
    let r = node.get(&format!("/v1/sandboxes/{id}"), &[]);
    assert_moved(r.status, &r.json(), Some("node-b"), 4, "after a forget");
    let left = node.traces_of(&id);
    assert!(left.is_empty(), "left of a forgotten sandbox: {left:?}");
    let named = files_named(&node.data_dir, &id);
    assert!(named.is_empty(), "files of a forgotten sandbox: {named:?}");
    // Its name is free again; asked again, the forget answers the same.
    let r = node.post_json("/v1/sandboxes", &json!({ "name": "mover" }));
    assert_eq!(r.status, 201, "{}", r.text());
    let other = r.json()["id"].as_str().expect("an id").to_string();
    let (s, b) = forget(&node, &id, &json!({ "epoch": 4, "to": "node-b" }));
    assert_eq!((s, b["removed"].as_bool()), (200, Some(false)), "{b}");
    // A takeover at the tombstone's epoch or below: no.
    let r = node.post_json(
        &format!("/internal/sandboxes/{id}/takeover"),
        &json!({ "epoch": 4, "from": { "id": "nod-b", "name": "node-b", "url": "http://127.0.0.1:1" } }),
    );
    assert_eq!(
        (r.status, code(&r.json())),
        (409, "wrong_epoch"),
        "{}",
        r.text()
    );
    // The tombstone survives a restart.
    node.stop();
    node.restart();
    let r = node.get(&format!("/v1/sandboxes/{id}"), &[]);
    assert_moved(
        r.status,
        &r.json(),
        Some("node-b"),
        4,
        "a tombstone after a restart",
    );
    let r = node.get("/v1/sandboxes/mover", &[]);
    assert_eq!(
        (r.status, r.json()["id"].as_str()),
        (200, Some(other.as_str()))
    );
}

#[test]
fn a_forget_removes_a_sandbox_held_at_its_epoch_and_leaves_a_tombstone_for_unknown_ones() {
    let (_dir, url) = file_store("forget");
    let node = TestNode::start_with(&["--store", &url]);
    // A running sandbox held at epoch 1 (a takeover the control plane abandons).
    let id = counting_sandbox(&node, "held");
    assert!(node.agent_pid(&id).is_some());
    let (s, b) = forget(&node, &id, &json!({ "epoch": 1 }));
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["removed"], true, "{b}");
    let left = node.traces_of(&id);
    assert!(left.is_empty(), "left of a forgotten sandbox: {left:?}");
    assert!(files_named(&node.data_dir, &id).is_empty());
    let r = node.get(&format!("/v1/sandboxes/{id}"), &[]);
    assert_moved(r.status, &r.json(), None, 1, "forgotten");
    let r = node.get(&format!("/v1/sandboxes/{id}/exec"), &[]);
    assert_moved(r.status, &r.json(), None, 1, "its commands");

    // Unknown: the tombstone alone.
    let unknown = "sbx-0123456789abcdef";
    let (s, b) = forget(&node, unknown, &json!({ "epoch": 5, "to": "node-x" }));
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["removed"], false, "{b}");
    let r = node.get(&format!("/v1/sandboxes/{unknown}"), &[]);
    assert_moved(r.status, &r.json(), Some("node-x"), 5, "a tombstone");
    let (s, b) = release(&node, unknown, 5, "node-y", "mov-0000000000000009");
    assert_eq!((s, code(&b)), (404, "sandbox_not_found"), "{b}");

    // Bad bodies.
    for (path, body, want, param) in [
        (
            "release",
            json!({ "epoch": 1, "to": "b", "move_id": "mov-0000000000000001", "x": 1 }),
            "unknown_field",
            None,
        ),
        (
            "release",
            json!({ "epoch": 0, "to": "b", "move_id": "mov-0000000000000001" }),
            "invalid_field",
            Some("epoch"),
        ),
        (
            "release",
            json!({ "epoch": 1, "to": "b", "move_id": "nope" }),
            "invalid_field",
            Some("move_id"),
        ),
        ("release", json!({ "epoch": 1 }), "invalid_field", None),
        (
            "forget",
            json!({ "epoch": 0 }),
            "invalid_field",
            Some("epoch"),
        ),
        (
            "forget",
            json!({ "epoch": 1, "from": "x" }),
            "unknown_field",
            None,
        ),
    ] {
        let r = node.post_json(&format!("/internal/sandboxes/{unknown}/{path}"), &body);
        let b = r.json();
        assert_eq!((r.status, code(&b)), (400, want), "{path} {body}: {b}");
        if let Some(p) = param {
            assert_eq!(b["error"]["param"], p, "{path} {body}: {b}");
        }
    }
    let r = node.post(
        &format!("/internal/sandboxes/{unknown}/release"),
        &[("Content-Type", "application/json")],
        b"[1]",
    );
    assert_eq!((r.status, code(&r.json())), (400, "invalid_json"));
}

#[test]
fn a_waiting_run_ends_with_sandbox_moved_and_a_node_without_a_store_moves_nothing() {
    let (_dir, url) = file_store("run");
    let node = TestNode::start_with(&["--store", &url]);
    let id = counting_sandbox(&node, "runner");
    // A run waits for its command (JSON); the release ends the wait.
    let addr = node.url(&format!("/v1/sandboxes/{id}/run"));
    let waiting = std::thread::spawn(move || {
        let r = ureq::post(&addr)
            .set("Content-Type", "application/json")
            .send_bytes(br#"{"command":"sleep 30; echo done"}"#);
        match r {
            Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
            Err(ureq::Error::Status(s, r)) => (s, r.into_string().unwrap_or_default()),
            Err(e) => (0, e.to_string()),
        }
    });
    std::thread::sleep(Duration::from_millis(700));
    let (s, b) = release(&node, &id, 1, "node-b", "mov-0000000000000005");
    assert_eq!(s, 200, "{b}");
    let (status, body) = waiting.join().expect("the run");
    let body: Value = serde_json::from_str(&body).unwrap_or_else(|_| json!({ "raw": body }));
    assert_eq!((status, code(&body)), (409, "sandbox_moved"), "{body}");
    assert!(
        body["exec_id"]
            .as_str()
            .is_some_and(|e| e.starts_with("exe-")),
        "{body}"
    );
    assert_eq!(
        (body["to"].as_str(), body["epoch"].as_u64()),
        (Some("node-b"), Some(1))
    );
    assert_eq!(body["offset"], 0, "{body}");
    drop(node);

    // Without a store nothing can be moved.
    let node = TestNode::start();
    let id = node
        .client()
        .create_sandbox(&create_with(|_| {}))
        .expect("create")
        .id
        .clone();
    let (s, b) = release(&node, &id, 1, "node-b", "mov-0000000000000006");
    assert_eq!((s, code(&b)), (409, "not_movable"), "{b}");
    assert!(
        b["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("no store")),
        "{b}"
    );
    let r = node.get(&format!("/v1/sandboxes/{id}"), &[]);
    assert_eq!(r.status, 200, "not fenced: {}", r.text());
}

/// A terminal open on a command of the sandbox ends with an error message `sandbox_moved`
/// (the output position it sent up to), then a close.
#[test]
fn a_terminal_ends_with_sandbox_moved() {
    use tungstenite::stream::MaybeTlsStream;
    use tungstenite::Message;
    let (_dir, url) = file_store("tty");
    let node = TestNode::start_with(&["--store", &url]);
    let id = counting_sandbox(&node, "tty-mover");
    let r = node.post_json(
        &format!("/v1/sandboxes/{id}/exec"),
        &json!({ "command": "sh", "tty": true }),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let exec = r.json()["id"].as_str().expect("an exec id").to_string();
    let ws_url = node
        .url(&format!("/v1/sandboxes/{id}/exec/{exec}/terminal"))
        .replacen("http", "ws", 1);
    let (mut ws, _) = tungstenite::connect(ws_url).expect("websocket");
    if let MaybeTlsStream::Plain(s) = ws.get_mut() {
        s.set_read_timeout(Some(Duration::from_millis(50)))
            .expect("a timeout");
    }
    ws.send(Message::Binary(b"echo mark-$((6*7))\n".to_vec().into()))
        .expect("input");
    let releasing = {
        let addr = node.url(&format!("/internal/sandboxes/{id}/release"));
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(800));
            match ureq::post(&addr)
                .set("Content-Type", "application/json")
                .send_bytes(br#"{"epoch":1,"to":"node-b","move_id":"mov-0000000000000007"}"#)
            {
                Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
                Err(ureq::Error::Status(s, r)) => (s, r.into_string().unwrap_or_default()),
                Err(e) => (0, e.to_string()),
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let (mut seen, mut end, mut closed) = (0u64, None, false);
    while Instant::now() < deadline && !closed {
        match ws.read() {
            Ok(Message::Binary(b)) => seen += b.len() as u64,
            Ok(Message::Text(t)) => {
                end = Some(serde_json::from_str::<Value>(t.as_str()).expect("JSON"))
            }
            Ok(Message::Close(_)) => closed = true,
            Ok(_) => {}
            Err(tungstenite::Error::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => closed = true,
        }
    }
    let (status, body) = releasing.join().expect("the release");
    let end = end.expect("an error message before the close");
    assert_eq!(end["type"], "error", "{end}");
    assert_eq!(code(&end), "sandbox_moved", "{end}");
    assert_eq!(
        (end["to"].as_str(), end["epoch"].as_u64()),
        (Some("node-b"), Some(1))
    );
    assert!(seen > 0, "no output before the end");
    assert_eq!(end["offset"], seen, "{end}");
    assert!(closed, "not closed");
    // CRIU cannot dump a process on a terminal whose other end is the agent's (a sleep of a
    // sandbox with a terminal's command running fails so): then the release fails, nothing is
    // fenced, and the sandbox runs on here.
    if status != 200 {
        assert_eq!(status, 500, "{body}");
        // (Or, under load, its processes were not all frozen in time for the checkpoint.)
        assert!(
            body.contains("could not be put to sleep")
                || body.contains("could not be readied for a checkpoint"),
            "{body}"
        );
        let r = node.get(&format!("/v1/sandboxes/{id}"), &[]);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["status"], "running");
        assert!(count(&node, &id) > 0);
    }
}

/// A release waits for the store: a store that cannot take the sleep answers 503
/// copy_behind, and the sandbox stays this node's (asleep, woken by its next use). A sandbox
/// asleep already is released as it is (slept false), and its expiry does nothing once it is
/// released.
#[test]
fn a_store_that_is_behind_leaves_the_sandbox_here() {
    let (dir, url) = file_store("behind");
    let node = TestNode::start_with(&["--store", &url]);
    // Asleep before the release, expiring in a few seconds.
    let expiry = Instant::now() + Duration::from_secs(15);
    let expires = crate::common::rfc3339_in(Duration::from_secs(15));
    let id = node
        .client()
        .create_sandbox(&create_with(|r| r.expires_at = Some(expires)))
        .expect("create")
        .id
        .clone();
    sh(&node, &id, "echo kept > /root/kept.txt");
    let r = node.post_json(&format!("/v1/sandboxes/{id}/sleep"), &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    let (s, b) = release(&node, &id, 1, "node-b", "mov-000000000000000a");
    assert_eq!(s, 200, "{b}\n{}", node.log_tail(20));
    assert_eq!(b["slept"], false, "{b}");
    let now = Instant::now();
    assert!(now < expiry, "the release came after the sandbox's expiry");
    std::thread::sleep(expiry - now + Duration::from_secs(2));
    assert!(
        node.sandbox_dir(&id).is_dir(),
        "an expiry ended a released sandbox"
    );
    let r = node.get(&format!("/v1/sandboxes/{id}"), &[]);
    assert_moved(r.status, &r.json(), Some("node-b"), 1, "past its expiry");

    // The store cannot be written to: the release of a running sandbox waits, then 503.
    let other = counting_sandbox(&node, "behind");
    let _ = std::fs::remove_dir_all(&dir.0);
    std::fs::write(&dir.0, b"not a directory").expect("a file in the store's place");
    let started = Instant::now();
    let (s, b) = release(&node, &other, 1, "node-b", "mov-000000000000000b");
    let took = started.elapsed();
    assert_eq!((s, code(&b)), (503, "copy_behind"), "{b}");
    assert!(took >= Duration::from_secs(25), "answered in {took:?}");
    assert!(b["disk_ms"].as_u64().is_some_and(|ms| ms >= 25_000), "{b}");
    assert!(
        b["memory_ms"].as_u64().is_some_and(|ms| ms >= 25_000),
        "{b}"
    );
    assert_eq!(b["error"]["retryable"], true, "{b}");
    // Not fenced: it sleeps here, and its next use wakes it where it was.
    let r = node.get(&format!("/v1/sandboxes/{other}"), &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["status"], "sleeping");
    assert!(count(&node, &other) > 0);
    let listed = node.get("/v1/sandboxes", &[]).json();
    assert!(
        listed["data"]
            .as_array()
            .is_some_and(|a| a.iter().any(|s| s["id"] == other.as_str())),
        "{listed}"
    );
}

/// Without a disk of the node (no btrfs snapshot of the sandbox's files: the upload reads them
/// where they are), a release waits for that read as well, and fences.
#[test]
fn a_node_without_its_disk_releases_too() {
    let (_dir, url) = file_store("nodisk");
    let node = TestNode::start_with(&["--store", &url, "--no-disk"]);
    let id = counting_sandbox(&node, "nodisk");
    sh(
        &node,
        &id,
        "head -c 20000000 /dev/urandom > /root/big && sync",
    );
    // The same release twice at once: one releases it; the other is told to ask again
    // (503, Retry-After: 1) or, coming after, answered the same.
    let url = node.url(&format!("/internal/sandboxes/{id}/release"));
    let second = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        match ureq::post(&url)
            .set("Content-Type", "application/json")
            .send_bytes(br#"{"epoch":1,"to":"node-b","move_id":"mov-000000000000000c"}"#)
        {
            Ok(r) => (r.status(), None, r.into_string().unwrap_or_default()),
            Err(ureq::Error::Status(s, r)) => (
                s,
                r.header("retry-after").map(str::to_string),
                r.into_string().unwrap_or_default(),
            ),
            Err(e) => (0, None, e.to_string()),
        }
    });
    let (s, b) = release(&node, &id, 1, "node-b", "mov-000000000000000c");
    assert_eq!(s, 200, "{b}\n{}", node.log_tail(20));
    let (s2, retry, b2) = second.join().expect("the second release");
    let b2: Value = serde_json::from_str(&b2).expect("JSON");
    eprintln!("the second release: {s2}");
    match s2 {
        200 => assert_eq!(b2, b),
        503 => {
            assert_eq!(code(&b2), "unavailable", "{b2}");
            assert_eq!(retry.as_deref(), Some("1"));
            let (s, again) = release(&node, &id, 1, "node-b", "mov-000000000000000c");
            assert_eq!((s, &again), (200, &b));
        }
        s => panic!("the second release: {s} {b2}"),
    }
    assert!(
        b["stored"]["bytes"]
            .as_u64()
            .is_some_and(|n| n > 20_000_000),
        "{b}"
    );
    assert_fenced(&node, &id, "nodisk", Some("node-b"), 1);

    // Taken back asleep (E+2): the store has no sleep of it at its new epoch, so the next
    // release stages the sleep again and waits for it there.
    let r = node.post_json(
        &format!("/internal/sandboxes/{id}/takeover"),
        &json!({
            "epoch": 3,
            "from": { "id": "nod-b", "name": "node-b", "url": "http://127.0.0.1:1" },
            "reclaim": true,
        }),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["woke"], false, "{}", r.text());
    let sb = node.get(&format!("/v1/sandboxes/{id}"), &[]);
    assert_eq!(sb.json()["status"], "sleeping", "{}", sb.text());
    let (s, b) = release(&node, &id, 3, "node-c", "mov-000000000000000d");
    assert_eq!(s, 200, "{b}\n{}", node.log_tail(20));
    assert_eq!(
        (b["slept"].as_bool(), b["stored"]["epoch"].as_u64()),
        (Some(false), Some(3)),
        "{b}"
    );
    assert_fenced(&node, &id, "nodisk", Some("node-c"), 3);
}
