//! Takeover (`POST /internal/sandboxes/{id}/takeover`): two real nodes of this machine share a
//! directory store; a sandbox of node A sleeps (the store gets the sleep and its record), and
//! node B makes it its own at epoch 2, from the store or from A's files directly, and wakes
//! it: its processes go on where they were, its files, commands, id, name and token are the
//! same. Refusals (wrong epoch, another build), the same takeover asked again, and a node B
//! killed midway (nothing left, and the takeover asked again works).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common::{create_with, TestNode};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

/// A command in the sandbox, waited for: its stdout (it must succeed).
fn sh(node: &TestNode, id: &str, line: &str) -> String {
    let v = node.exec(id, &json!({ "command": line, "wait_seconds": 60 }));
    assert_eq!(v["exit_code"], 0, "{line}: {v}");
    v["stdout"].as_str().unwrap_or_default().to_string()
}

fn get(node: &TestNode, path: &str) -> (u16, Value) {
    let r = node.get(path, &[]);
    (r.status, r.json())
}

/// A store directory of the test's own, its URL and the store.
fn file_store(tag: &str) -> (PathBuf, String, sbx_blob::Store) {
    let dir = std::env::temp_dir().join(format!("sbx-it-takeover-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let url = format!("file://{}", dir.display());
    let store = sbx_blob::Store::open(&url).expect("the store");
    (dir, url, store)
}

/// The store key of the nodes on the store in `dir`, beside it (made before they start: two
/// nodes started at once would each make one).
fn store_key(dir: &std::path::Path) -> PathBuf {
    let path = dir.with_extension("key");
    let mut key = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut key))
        .expect("random bytes");
    std::fs::write(&path, key).expect("write the store key");
    path
}

/// Two nodes on one store.
fn two_nodes(tag: &str) -> (TestNode, TestNode, PathBuf, sbx_blob::Store) {
    let (dir, url, store) = file_store(tag);
    let key_file = store_key(&dir);
    let key = key_file.display().to_string();
    let mut a = TestNode::start_with(&["--store", &url, "--store-key", &key]);
    let b = TestNode::start_with(&["--store", &url, "--store-key", &key]);
    a.owns(dir.clone());
    a.owns(key_file);
    (a, b, dir, store)
}

/// This machine and boot, as a release names them.
fn host_id() -> String {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    format!(
        "{}:{}",
        read("/etc/machine-id"),
        read("/proc/sys/kernel/random/boot_id")
    )
}

/// What a sandbox of node A was before its sleep.
struct Before {
    id: String,
    name: String,
    token: Value,
    exec_id: String,
    exec: Value,
    output: (Vec<u8>, Vec<u8>, Vec<u8>),
    count: u64,
}

fn count(node: &TestNode, id: &str) -> u64 {
    sh(node, id, "cat /tmp/c").trim().parse().expect("a count")
}

/// The manifest of `id` at epoch 1 with a record part, once it is there.
fn wait_stored(store: &sbx_blob::Store, id: &str, within: Duration) -> sbx_blob::Manifest {
    let end = Instant::now() + within;
    let rt = rt();
    loop {
        match rt.block_on(store.manifest(id, 1)) {
            Ok(m) if m.parts.iter().any(|p| p.name.starts_with("record-")) => return m,
            Ok(m) => panic!("a sleep stored without its record: {m:?}"),
            Err(e) if e.is_not_found() => {}
            Err(e) => panic!("the manifest of {id}: {e}"),
        }
        assert!(Instant::now() < end, "no manifest of {id} in {within:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A kept sandbox of `a` with a file, a finished command, a counter running (and `extra`
/// run in it), put to sleep and stored.
fn asleep_on_a(a: &TestNode, store: &sbx_blob::Store, extra: Option<&str>) -> Before {
    let name = crate::common::unique("moved");
    let id = a
        .client()
        .create_sandbox(&create_with(|r| r.name = Some(name.clone())))
        .expect("create")
        .id
        .clone();
    sh(a, &id, "echo 'it moved' > /root/file.txt");
    let done = a.exec(
        &id,
        &json!({ "command": "echo out-line; echo err-line >&2", "wait_seconds": 20 }),
    );
    let exec_id = done["id"].as_str().expect("an exec id").to_string();
    sh(
        a,
        &id,
        "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/c; sleep 0.1; done' >/dev/null 2>&1 < /dev/null &",
    );
    if let Some(line) = extra {
        sh(a, &id, line);
    }
    std::thread::sleep(Duration::from_millis(500));
    let count = count(a, &id);
    let (status, obj) = get(a, &format!("/v1/sandboxes/{id}"));
    assert_eq!(status, 200, "{obj}");
    let (_, exec) = get(a, &format!("/v1/sandboxes/{id}/exec/{exec_id}"));
    let output = a.output_all(&id, &exec_id);
    let r = a.post_json(&format!("/v1/sandboxes/{id}/sleep"), &json!({}));
    assert_eq!(r.status, 200, "sleep: {}", r.text());
    wait_stored(store, &id, Duration::from_secs(120));
    Before {
        id,
        name,
        token: obj["token"].clone(),
        exec_id,
        exec,
        output,
        count,
    }
}

fn takeover_body(epoch: u64, local: Option<Value>, wake: bool) -> Value {
    json!({
        "epoch": epoch,
        "from": { "id": "nod-a", "name": "a", "url": "http://127.0.0.1:1", "local": local },
        "wake": wake,
    })
}

fn takeover(node: &TestNode, id: &str, body: &Value) -> (u16, Value) {
    let r = node.post_json(&format!("/internal/sandboxes/{id}/takeover"), body);
    (r.status, r.json())
}

/// A's files of its sleeping sandbox `id`, as a release names them.
fn local_of(a: &TestNode, id: &str) -> Value {
    json!({
        "host": host_id(),
        "memory": a.data_dir.join("sleep").join(id),
        "disk": a.data_dir.join("sandboxes").join(id).join("upper"),
    })
}

/// B has the sandbox `before` was, running: same id, name, token, file, command; its counter
/// went on from where it was.
fn check_on_b(b: &TestNode, before: &Before) {
    let id = &before.id;
    let (status, obj) = get(b, &format!("/v1/sandboxes/{id}"));
    assert_eq!(status, 200, "{obj}");
    assert_eq!(obj["status"], "running", "{obj}");
    assert_eq!(obj["name"], before.name.as_str());
    assert!(before.token.is_string(), "A's object names its token");
    assert_eq!(obj["token"], before.token, "the token is kept");
    let (status, by_name) = get(b, &format!("/v1/sandboxes/{}", before.name));
    assert_eq!((status, by_name["id"].as_str()), (200, Some(id.as_str())));
    // The counter goes on from where it was, not from 0.
    let c1 = count(b, id);
    assert!(c1 >= before.count, "{} before, {c1} after", before.count);
    std::thread::sleep(Duration::from_millis(500));
    let c2 = count(b, id);
    assert!(c2 > c1, "the counter stopped: {c1} then {c2}");
    assert_eq!(sh(b, id, "cat /root/file.txt"), "it moved\n");
    // The old command: its object and output as they were.
    let (status, exec) = get(b, &format!("/v1/sandboxes/{id}/exec/{}", before.exec_id));
    assert_eq!(status, 200, "{exec}");
    for k in ["id", "status", "exit_code", "command", "stdout", "stderr"] {
        assert_eq!(exec[k], before.exec[k], "{k}: {exec} vs {}", before.exec);
    }
    assert_eq!(b.output_all(id, &before.exec_id), before.output);
    // Its processes are in B's cgroups, none in A's.
    let agent = b.agent_pid(id);
    assert!(agent.is_some(), "no agent of {id} in B's cgroups");
}

#[test]
fn a_sandbox_is_taken_over_from_the_store_and_goes_on() {
    let (a, b, _dir, store) = two_nodes("store");
    let before = asleep_on_a(&a, &store, None);
    let id = before.id.clone();
    // The record in the store is sealed with the fleet's store key: no token in clear.
    let m = wait_stored(&store, &id, Duration::from_secs(10));
    let part = m
        .parts
        .iter()
        .find(|p| p.name.starts_with("record-"))
        .expect("a record part")
        .name
        .clone();
    let (sealed, _) = rt()
        .block_on(store.get_part_writer(&m, &part, Vec::new()))
        .expect("the record part");
    let token = before.token.as_str().expect("a token").to_string();
    assert!(token.len() > 8, "{token}");
    assert!(
        !sealed.windows(token.len()).any(|w| w == token.as_bytes()),
        "the token is in clear in the store"
    );
    assert!(serde_json::from_slice::<Value>(&sealed).is_err());
    // A node with another store key cannot open it: refused, nothing taken.
    let url = format!("file://{}", _dir.display());
    let stranger = TestNode::start_with(&["--store", &url]);
    let (status, refused) = takeover(&stranger, &id, &takeover_body(2, None, true));
    assert!(status >= 400, "{refused}");
    assert_eq!(refused["error"]["code"], "takeover_failed", "{refused}");
    assert!(
        refused["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("store key")),
        "{refused}"
    );
    let (status, _) = get(&stranger, &format!("/v1/sandboxes/{id}"));
    assert_eq!(status, 404);
    drop(stranger);
    let body = takeover_body(2, None, true);
    let (status, answer) = takeover(&b, &id, &body);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["source"], "store", "{answer}");
    assert_eq!(answer["epoch"], 2);
    assert_eq!(answer["woke"], true);
    assert!(answer["memory"].as_u64().is_some_and(|m| m > 0), "{answer}");
    assert!(answer["disk_ms"].is_u64() && answer["memory_ms"].is_u64());
    check_on_b(&b, &before);
    assert!(a.agent_pid(&id).is_none(), "A runs it too");

    // The same takeover again: the same answer; a lower or equal epoch: wrong_epoch.
    let (status, again) = takeover(&b, &id, &body);
    assert_eq!((status, &again), (200, &answer));
    let (status, refused) = takeover(&b, &id, &takeover_body(1, None, true));
    assert_eq!(status, 409, "{refused}");
    assert_eq!(refused["error"]["code"], "wrong_epoch", "{refused}");
    assert_eq!(refused["epoch"], 2, "{refused}");

    // It sleeps on B at epoch 2: the store gets it there.
    let r = b.post_json(&format!("/v1/sandboxes/{id}/sleep"), &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        match rt().block_on(store.manifest(&id, 2)) {
            Ok(m) => {
                assert_eq!(m.epoch, 2);
                break;
            }
            Err(e) if e.is_not_found() => {}
            Err(e) => panic!("{e}"),
        }
        assert!(Instant::now() < end, "no sleep of B at epoch 2 stored");
        std::thread::sleep(Duration::from_millis(100));
    }
    let r = b.post_json(&format!("/v1/sandboxes/{id}/wake"), &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(count(&b, &id) > before.count);
}

#[test]
fn a_sandbox_is_taken_over_from_the_old_node_s_files_on_this_machine() {
    let (a, b, _dir, store) = two_nodes("disk");
    let before = asleep_on_a(&a, &store, None);
    let id = before.id.clone();
    let (status, answer) = takeover(&b, &id, &takeover_body(2, Some(local_of(&a, &id)), true));
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["source"], "disk", "{answer}");
    check_on_b(&b, &before);
    // A's files are A's still (it keeps its released copy until a forget).
    assert!(a
        .data_dir
        .join("sandboxes")
        .join(&id)
        .join("upper")
        .is_dir());

    // Another machine's files (or from_store) are not read: the store is.
    let before2 = asleep_on_a(&a, &store, None);
    let mut other = local_of(&a, &before2.id);
    other["host"] = json!("another-machine:boot");
    let (status, answer) = takeover(&b, &before2.id, &takeover_body(2, Some(other), false));
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        (answer["source"].as_str(), answer["woke"].as_bool()),
        (Some("store"), Some(false))
    );
    let (_, obj) = get(&b, &format!("/v1/sandboxes/{}", before2.id));
    assert_eq!(obj["status"], "sleeping", "{obj}");
    // Its first use wakes it.
    assert!(count(&b, &before2.id) >= before2.count);
}

/// Copies the sleep of `id` at epoch 1 in the store directory `dir` as the sleep of another
/// sandbox `to`, its manifest's `build` set to `build`.
fn copy_sleep(dir: &Path, id: &str, to: &str, build: &str) {
    let from = dir.join("sandboxes").join(id).join("e1");
    let into = dir.join("sandboxes").join(to).join("e1");
    std::fs::create_dir_all(&into).expect("mkdir");
    for e in std::fs::read_dir(&from)
        .expect("the sleep's folder")
        .flatten()
    {
        if e.file_name() != "manifest.json" {
            std::fs::copy(e.path(), into.join(e.file_name())).expect("copy a part");
        }
    }
    let mut m: Value =
        serde_json::from_slice(&std::fs::read(from.join("manifest.json")).expect("manifest"))
            .expect("a manifest");
    m["sandbox_id"] = json!(to);
    m["build"] = json!(build);
    std::fs::write(
        into.join("manifest.json"),
        serde_json::to_vec(&m).expect("json"),
    )
    .expect("write the manifest");
}

#[test]
fn refusals_leave_nothing_and_answer_their_codes() {
    let (a, b, dir, store) = two_nodes("refused");
    let before = asleep_on_a(&a, &store, None);
    // Another build's sleep.
    let other = "sbx-0123456789abcdef";
    copy_sleep(&dir, &before.id, other, "another-build");
    let (status, body) = takeover(&b, other, &takeover_body(2, None, true));
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error"]["code"], "build_missing", "{body}");
    assert_eq!(body["build"], "another-build", "{body}");
    assert!(!b.data_dir.join("sandboxes").join(other).exists());
    assert!(!b.data_dir.join("takeover").join(other).exists());
    // No sleep below the epoch: 502 takeover_failed.
    let (status, body) = takeover(&b, &before.id, &takeover_body(1, None, true));
    assert_eq!(status, 502, "{body}");
    assert_eq!(body["error"]["code"], "takeover_failed", "{body}");
    // A reclaim of a copy this node never had: 404.
    let mut reclaim = takeover_body(2, None, true);
    reclaim["reclaim"] = json!(true);
    let (status, body) = takeover(&b, &before.id, &reclaim);
    assert_eq!(status, 404, "{body}");
    // A body with an unknown field, or epoch 0: 400.
    let mut bad = takeover_body(2, None, true);
    bad["x"] = json!(1);
    assert_eq!(takeover(&b, &before.id, &bad).0, 400);
    assert_eq!(
        takeover(&b, &before.id, &takeover_body(0, None, true)).0,
        400
    );
    let (status, _) = get(&b, &format!("/v1/sandboxes/{}", before.id));
    assert_eq!(status, 404);
    // The sandbox is still A's to take over from.
    let (status, answer) = takeover(&b, &before.id, &takeover_body(2, None, true));
    assert_eq!(status, 200, "{answer}");
}

#[test]
fn a_node_killed_mid_takeover_leaves_nothing_and_the_takeover_works_again() {
    let (a, mut b, _dir, store) = two_nodes("killed");
    let before = asleep_on_a(
        &a,
        &store,
        Some("head -c 150000000 /dev/urandom > /root/big && sync"),
    );
    let id = before.id.clone();
    let url = b.url(&format!("/internal/sandboxes/{id}/takeover"));
    let body = serde_json::to_vec(&takeover_body(2, None, true)).expect("json");
    let call = std::thread::spawn(move || {
        ureq::post(&url)
            .set("Content-Type", "application/json")
            .timeout(Duration::from_secs(120))
            .send_bytes(&body)
            .map(|r| r.status())
            .map_err(|e| e.to_string())
    });
    // Killed while its disk comes down.
    let mark = b.data_dir.join("takeover").join(&id);
    let upper = b.data_dir.join("sandboxes").join(&id).join("upper");
    let end = Instant::now() + Duration::from_secs(60);
    while !(mark.is_file() && upper.is_dir()) {
        assert!(Instant::now() < end, "the takeover did not begin");
        std::thread::sleep(Duration::from_millis(5));
    }
    // Meanwhile calls for it (by id and by name) are 503 with Retry-After: 1.
    let r = b.get(&format!("/v1/sandboxes/{id}"), &[]);
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("1"));
    let r = b.get(&format!("/v1/sandboxes/{}", before.name), &[]);
    assert_eq!(r.status, 503, "by name: {}", r.text());
    assert!(!call.is_finished(), "the takeover ended before the kill");
    b.kill();
    let answered = call.join().expect("the call's thread");
    assert!(answered.is_err(), "a killed node answered: {answered:?}");
    b.restart();
    for p in [
        b.data_dir.join("sandboxes").join(&id),
        b.data_dir.join("sleep").join(&id),
        mark.clone(),
    ] {
        assert!(!p.exists(), "{} is left", p.display());
    }
    let (status, body) = get(&b, &format!("/v1/sandboxes/{id}"));
    assert_eq!(status, 404, "{body}");
    assert!(b.agent_pid(&id).is_none());
    let (status, answer) = takeover(&b, &id, &takeover_body(2, None, true));
    assert_eq!(status, 200, "{answer}");
    check_on_b(&b, &before);
    assert_eq!(sh(&b, &id, "stat -c %s /root/big").trim(), "150000000");
}

/// The IPv4 addresses of the sandbox's own interfaces (not loopback), from the kernel's table.
fn addresses(node: &TestNode, id: &str) -> Vec<String> {
    let trie = sh(node, id, "cat /proc/net/fib_trie");
    let lines: Vec<&str> = trie.lines().collect();
    let mut out = Vec::new();
    for w in lines.windows(2) {
        if w[1].trim() == "/32 host LOCAL" {
            if let Some(a) = w[0].trim().strip_prefix("|-- ") {
                if !a.starts_with("127.") && !out.iter().any(|x| x == a) {
                    out.push(a.to_string());
                }
            }
        }
    }
    out
}

/// The first three octets of a node's gateway (each node of the tests has a /24 of its own).
fn range_of(node: &TestNode) -> String {
    let (_, info) = get(node, "/internal/node");
    let gw = info["network"]["gateway"]
        .as_str()
        .expect("a gateway")
        .to_string();
    gw.rsplit_once('.').expect("an IPv4 address").0.to_string()
}

#[test]
fn a_sandbox_on_the_network_gets_an_address_of_the_new_node() {
    let (dir, url, store) = file_store("net");
    let key_file = store_key(&dir);
    let key = key_file.display().to_string();
    let args = [
        "--store",
        &url,
        "--store-key",
        &key,
        "--egress-default",
        "allow",
    ];
    let mut a = TestNode::start_with(&args);
    let b = TestNode::start_with(&args);
    a.owns(dir);
    a.owns(key_file);
    let before = asleep_on_a(&a, &store, None);
    let id = before.id.clone();
    let (status, answer) = takeover(&b, &id, &takeover_body(2, None, true));
    assert_eq!(status, 200, "{answer}");
    check_on_b(&b, &before);
    let (ra, rb) = (range_of(&a), range_of(&b));
    assert_ne!(ra, rb);
    let got = addresses(&b, &id);
    assert!(
        !got.is_empty() && got.iter().all(|x| x.starts_with(&format!("{rb}."))),
        "{got:?}: not of B's range {rb}.0/24 (A's: {ra}.0/24)"
    );
    // Ended here: a node that stops with a kept sandbox running keeps its network for it (its
    // nft table stayed on the host after every run of this test).
    b.delete_sandbox(&id);
}
