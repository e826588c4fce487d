//! A node with `--store` uploads each sleep and snapshot of a kept sandbox to the object store
//! in the background: `sandboxes/<id>/e1/` (a snapshot under its own id), the disk and CRIU's
//! images as zstd tar parts, the manifest last. Against a directory always, and against
//! SeaweedFS (S3) when `weed` is found ($SBX_WEED, PATH, /opt/sbx-seaweedfs).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use sbx_blob::testing::{find_weed, Weed};

use serde_json::{json, Value};

use crate::common::{create_req, TestNode};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

/// A command in the sandbox, waited for: its stdout (it must succeed).
fn sh(node: &TestNode, id: &str, line: &str) -> String {
    let v = node.exec(id, &json!({ "command": line, "wait_seconds": 20 }));
    assert_eq!(v["exit_code"], 0, "{line}: {v}");
    v["stdout"].as_str().unwrap_or_default().to_string()
}

fn post(node: &TestNode, path: &str) -> Value {
    let r = node.post_json(path, &json!({}));
    assert!(r.status < 300, "POST {path}: {} {}", r.status, r.text());
    r.json()
}

fn node_store_info(node: &TestNode) -> Value {
    let r = node.get("/internal/node", &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["store"].clone()
}

/// A sandbox with a file and a process that counts into /tmp/count.
fn counting_sandbox(node: &TestNode) -> String {
    let id = node
        .client()
        .create_sandbox(&create_req())
        .expect("create")
        .id
        .clone();
    sh(node, &id, "echo 'hello store' > /root/hello.txt");
    sh(
        node,
        &id,
        "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done' >/dev/null 2>&1 < /dev/null &",
    );
    std::thread::sleep(Duration::from_millis(300));
    id
}

fn count(node: &TestNode, id: &str) -> u64 {
    sh(node, id, "cat /tmp/count")
        .trim()
        .parse()
        .expect("a count")
}

/// The manifest of `id` at epoch 1 once it is there (and, with `not`, names no part of
/// that generation's), within `within`.
fn wait_manifest(
    store: &sbx_blob::Store,
    id: &str,
    not: Option<&str>,
    within: Duration,
) -> sbx_blob::Manifest {
    let end = Instant::now() + within;
    let rt = rt();
    loop {
        match rt.block_on(store.manifest(id, 1)) {
            Ok(m) if not.is_none_or(|n| m.part(n).is_none()) => return m,
            Ok(_) => {}
            Err(e) if e.is_not_found() => {}
            Err(e) => panic!("the manifest of {id}: {e}"),
        }
        assert!(Instant::now() < end, "no manifest of {id} in {within:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The part of `kind` (`disk`, `memory`, `execs`): `<kind>-<generation>`.
fn part<'a>(m: &'a sbx_blob::Manifest, kind: &str) -> &'a str {
    m.parts
        .iter()
        .map(|p| p.name.as_str())
        .find(|n| n.strip_prefix(kind).is_some_and(|r| r.starts_with('-')))
        .unwrap_or_else(|| panic!("no {kind} part in {m:?}"))
}

fn unpack(store: &sbx_blob::Store, m: &sbx_blob::Manifest, kind: &str, dest: &Path) {
    let _ = std::fs::remove_dir_all(dest);
    rt().block_on(store.get_part_tree(m, part(m, kind), dest))
        .unwrap_or_else(|e| panic!("unpack {kind}: {e}"));
}

/// Sleep, wake and snapshot of a counting sandbox, each in the store.
fn sleep_wake_snapshot(node: &TestNode, store: &sbx_blob::Store) {
    let id = counting_sandbox(node);
    let before = count(node, &id);
    post(node, &format!("/v1/sandboxes/{id}/sleep"));
    let m = wait_manifest(store, &id, None, Duration::from_secs(30));
    assert_eq!(m.kind, sbx_blob::Kind::Sleep);
    assert_eq!((m.sandbox_id.as_str(), m.epoch), (id.as_str(), 1));
    assert!(!m.build.is_empty() && m.image == "base", "{m:?}");
    let out = node.root.join("unpacked");
    unpack(store, &m, "disk", &out.join("disk"));
    assert_eq!(
        std::fs::read_to_string(out.join("disk/root/hello.txt")).expect("the file"),
        "hello store\n"
    );
    unpack(store, &m, "memory", &out.join("memory"));
    for img in ["inventory.img", "pstree.img"] {
        assert!(out.join("memory").join(img).is_file(), "no {img}");
    }
    // The node shows it stored, and how long it took.
    let info = node_store_info(node);
    assert!(
        info["store"]
            .as_str()
            .is_some_and(|s| !s.contains("secret")),
        "{info}"
    );
    let last = info["last"]
        .as_array()
        .and_then(|l| l.iter().find(|x| x["id"] == id.as_str()))
        .cloned()
        .unwrap_or_else(|| panic!("no last of {id}: {info}"));
    assert_eq!(
        (last["kind"].as_str(), last["epoch"].as_u64()),
        (Some("sleep"), Some(1))
    );
    assert!(last["ms"].is_u64(), "{last}");

    // It wakes where it was: the counter goes on.
    post(node, &format!("/v1/sandboxes/{id}/wake"));
    let after = count(node, &id);
    assert!(after >= before, "{before} then {after}");
    std::thread::sleep(Duration::from_millis(300));
    assert!(count(node, &id) > after, "the counter stopped");

    // A snapshot: under its own id.
    let snap = post(node, &format!("/v1/sandboxes/{id}/snapshots"));
    let snap_id = snap["id"].as_str().expect("a snapshot id").to_string();
    let sm = wait_manifest(store, &snap_id, None, Duration::from_secs(30));
    assert_eq!(sm.kind, sbx_blob::Kind::Snapshot);
    unpack(store, &sm, "disk", &out.join("snap-disk"));
    assert!(out.join("snap-disk/root/hello.txt").is_file());
    unpack(store, &sm, "memory", &out.join("snap-memory"));
    assert!(out.join("snap-memory/inventory.img").is_file());
    part(&sm, "execs");

    // The next sleep replaces the epoch's manifest whole; the first one's parts go.
    sh(node, &id, "echo second > /root/hello.txt");
    let first = part(&m, "memory").to_string();
    post(node, &format!("/v1/sandboxes/{id}/sleep"));
    let m2 = wait_manifest(store, &id, Some(&first), Duration::from_secs(30));
    unpack(store, &m2, "disk", &out.join("disk2"));
    assert_eq!(
        std::fs::read_to_string(out.join("disk2/root/hello.txt")).expect("the file"),
        "second\n"
    );
    // The old parts are removed after the new manifest is put (replica.rs): soon after.
    let old = sbx_blob::part_key(&id, 1, &first, sbx_blob::Format::Tar).expect("key");
    let end = Instant::now() + Duration::from_secs(10);
    while rt().block_on(store.exists(&old)).expect("exists") {
        assert!(Instant::now() < end, "the first sleep's part {old} stays");
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// A directory store of the test's own: its directory, URL and the store.
fn file_store(tag: &str) -> (PathBuf, String, sbx_blob::Store) {
    let dir = std::env::temp_dir().join(format!("sbx-it-store-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let url = format!("file://{}", dir.display());
    let store = sbx_blob::Store::open(&url).expect("the store");
    (dir, url, store)
}

#[test]
fn sleeps_and_snapshots_go_to_a_directory_store() {
    let (dir, url, store) = file_store("dir");
    let mut node = TestNode::start_with(&["--store", &url]);
    node.owns(dir);
    sleep_wake_snapshot(&node, &store);
}

/// A wake that comes while the sleep uploads wakes at once, and what is stored is the sleep's
/// (not what the woken sandbox writes): its disk held by a btrfs snapshot (the node's disk),
/// or, without a disk of the node, the wake waiting for the disk's read.
fn wake_during_upload(extra: &[&str]) {
    let (dir, url, store) = file_store(if extra.is_empty() {
        "wake"
    } else {
        "wake-nodisk"
    });
    let mut args = vec!["--store", url.as_str()];
    args.extend_from_slice(extra);
    let mut node = TestNode::start_with(&args);
    node.owns(dir);
    let id = counting_sandbox(&node);
    // Enough for the upload to take a while; written out (sync) before the sleep, so that no
    // process of it waits on the host's writeback when it is frozen.
    sh(
        &node,
        &id,
        "head -c 48000000 /dev/urandom > /root/big && echo v1 > /root/mark && sync",
    );
    post(&node, &format!("/v1/sandboxes/{id}/sleep"));
    // Woken while the upload runs (a wake before it starts drops that sleep, by design).
    wait_running(&node);
    post(&node, &format!("/v1/sandboxes/{id}/wake"));
    sh(&node, &id, "echo v2 > /root/mark && rm /root/big");
    let m = wait_manifest(&store, &id, None, Duration::from_secs(120));
    let out = node.root.join("unpacked");
    unpack(&store, &m, "disk", &out);
    assert_eq!(
        std::fs::read_to_string(out.join("root/mark")).expect("mark"),
        "v1\n"
    );
    assert_eq!(
        std::fs::metadata(out.join("root/big")).expect("big").len(),
        48_000_000
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// Waits (up to 10 s) until the node's store runs an upload.
fn wait_running(node: &TestNode) {
    let end = Instant::now() + Duration::from_secs(10);
    while node_store_info(node)["running"] != 1 {
        assert!(Instant::now() < end, "no upload ran");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_wake_during_the_upload_wakes_and_the_store_holds_the_sleep() {
    wake_during_upload(&[]);
}

#[test]
fn without_a_disk_a_wake_waits_for_the_disk_to_be_read() {
    wake_during_upload(&["--no-disk"]);
}

#[test]
fn a_node_killed_during_an_upload_leaves_no_manifest_and_sends_it_whole_after() {
    let (dir, url, store) = file_store("kill");
    let mut node = TestNode::start_with(&["--store", &url]);
    node.owns(dir);
    let id = counting_sandbox(&node);
    sh(
        &node,
        &id,
        "head -c 120000000 /dev/urandom > /root/big && md5sum /root/big > /root/big.md5 && sync",
    );
    let want = sh(&node, &id, "cat /root/big.md5");
    post(&node, &format!("/v1/sandboxes/{id}/sleep"));
    // Killed while the upload runs.
    wait_running(&node);
    node.kill();
    let cut = rt().block_on(store.manifest(&id, 1));
    assert!(
        cut.as_ref().is_err_and(|e| e.is_not_found()),
        "a manifest of a cut upload: {cut:?}"
    );
    node.restart();
    let m = wait_manifest(&store, &id, None, Duration::from_secs(120));
    let out = node.root.join("unpacked");
    unpack(&store, &m, "disk", &out);
    let got = Command::new("md5sum")
        .arg("big")
        .current_dir(out.join("root"))
        .output()
        .expect("md5sum");
    assert_eq!(
        String::from_utf8_lossy(&got.stdout)
            .split_whitespace()
            .next(),
        want.split_whitespace().next()
    );
    let _ = std::fs::remove_dir_all(&out);
    // It sleeps on, and wakes from the node's own images.
    post(&node, &format!("/v1/sandboxes/{id}/wake"));
    assert!(count(&node, &id) > 0);
}

#[test]
fn sleeps_and_snapshots_go_to_seaweedfs() {
    let Some(bin) = find_weed() else {
        eprintln!("skipped: no weed ($SBX_WEED, PATH or scripts/seaweedfs.sh's)");
        return;
    };
    let weed = Weed::start(&bin);
    weed.make_bucket("sbx-it");
    // The node reads the AWS_* variables of its environment (the test's): no other test of
    // this binary reads them.
    for (k, v) in weed.env() {
        std::env::set_var(k, v);
    }
    let url = "s3://sbx-it/fleet";
    let node = TestNode::start_with(&["--store", url]);
    let store = sbx_blob::Store::open_with_env(url, weed.env()).expect("the store");
    let info = node_store_info(&node);
    assert!(
        info["store"]
            .as_str()
            .is_some_and(|s| s.starts_with("s3://sbx-it/fleet") && !s.contains("sbx-test-secret")),
        "{info}"
    );
    sleep_wake_snapshot(&node, &store);
    drop(node);
}
