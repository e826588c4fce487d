//! OCI images: a node pulls from a real registry on loopback (Debian's `docker-registry`,
//! started per test with its own storage and port) and runs commands in the image. The image
//! is built here by hand from a few files of the base image (dash and the libraries it needs):
//! layer 1 has /bin/sh and /etc/hidden, layer 2 adds /app/hello.txt and a whiteout over
//! /etc/hidden; its config sets Env and WorkingDir.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::common::{self, assert_error, stdout, TestNode};
use sbx_testreg::{Compression, Layer, Registry, Tar};
use serde_json::{json, Value};

// ---------------------------------------------------------------------------------------------
// The registry (sbx-testreg) and the test image.

/// A registry on loopback, without auth.
fn registry() -> Registry {
    Registry::start(None).unwrap()
}

/// Builds and pushes the test image as `repo:tag`; its manifest digest. `nonce` goes into the
/// top layer and the config, so that the node's store (shared by the tests) has neither yet.
fn push_probe(reg: &Registry, repo: &str, tag: &str, nonce: &str) -> String {
    let layers = [
        Layer::new(layer_one(), Compression::None),
        Layer::new(layer_two(nonce), Compression::None),
    ];
    let config = json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/bin", "GREETING=hi from the image"],
            "WorkingDir": "/app",
            "Labels": { "nonce": nonce },
        },
        "rootfs": {
            "type": "layers",
            "diff_ids": layers.iter().map(|l| l.diff_id.clone()).collect::<Vec<_>>(),
        },
    });
    let config = serde_json::to_vec(&config).unwrap();
    reg.push_image(repo, Some(tag), &layers, &config).unwrap().0
}

/// Reads `path` of the base image, following symlinks inside it (an absolute one is taken
/// against the image's root, not the host's).
fn read_base(path: &str) -> Vec<u8> {
    let root = common::images_dir().join("base/rootfs");
    let mut rel = PathBuf::from(path.trim_start_matches('/'));
    for _ in 0..16 {
        let p = root.join(&rel);
        match fs::read_link(&p) {
            Ok(target) if target.is_absolute() => {
                rel = target.strip_prefix("/").unwrap().to_path_buf();
            }
            Ok(target) => {
                rel = rel.parent().unwrap_or(Path::new("")).join(target);
            }
            Err(_) => return fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
        }
    }
    panic!("{path}: too many symlinks");
}

/// /bin/sh (dash) with its loader and libc, a few directories, /etc/hidden.
pub(crate) fn layer_one() -> Vec<u8> {
    let mut t = Tar::new();
    for d in [
        "bin",
        "lib",
        "lib/x86_64-linux-gnu",
        "lib64",
        "etc",
        "app",
        "root",
    ] {
        t.dir_mode(d, 0o755);
    }
    for d in ["proc", "dev", "sys"] {
        t.dir_mode(d, 0o555);
    }
    t.dir_mode("tmp", 0o1777);
    t.file_mode("bin/sh", 0o755, &read_base("/usr/bin/dash"));
    t.file_mode(
        "lib64/ld-linux-x86-64.so.2",
        0o755,
        &read_base("/lib64/ld-linux-x86-64.so.2"),
    );
    t.file_mode(
        "lib/x86_64-linux-gnu/libc.so.6",
        0o755,
        &read_base("/lib/x86_64-linux-gnu/libc.so.6"),
    );
    t.file_mode("etc/passwd", 0o644, b"root:x:0:0:root:/root:/bin/sh\n");
    t.file_mode("etc/group", 0o644, b"root:x:0:\n");
    t.file_mode("etc/hidden", 0o644, b"from layer one\n");
    t.file_mode("etc/kept", 0o644, b"kept\n");
    t.done()
}

/// /app/hello.txt and a whiteout over /etc/hidden.
fn layer_two(nonce: &str) -> Vec<u8> {
    let mut t = Tar::new();
    t.dir_mode("app", 0o755).dir_mode("etc", 0o755);
    t.file_mode("app/nonce", 0o644, nonce.as_bytes());
    t.file_mode("app/hello.txt", 0o644, b"hello from layer two\n");
    t.file_mode("etc/.wh.hidden", 0o644, b"");
    t.done()
}

/// What a command in the image prints: the image's env and working directory, a file of the
/// top layer, the whited-out file and one of the bottom layer.
const PROBE: &str = "echo \"$GREETING\"; pwd; read l < hello.txt; echo \"$l\"; \
                     if test -e /etc/hidden; then echo hidden-seen; else echo hidden-gone; fi; \
                     read k < /etc/kept; echo \"$k\"";
const PROBE_OUT: &str = "hi from the image\n/app\nhello from layer two\nhidden-gone\nkept\n";

fn wait_status(node: &TestNode, id: &str, not: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v = node.get(&format!("/v1/sandboxes/{id}"), &[]).json();
        if v["status"] != not || Instant::now() > deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn node_for(reg: &Registry) -> TestNode {
    TestNode::start_with(&["--insecure-registry", &reg.host(), "--warm-pool", "0"])
}

#[test]
fn an_image_of_a_registry_runs_by_tag_and_by_digest() {
    let reg = registry();
    let repo = "sbx/probe";
    let digest = push_probe(&reg, repo, "v1", &common::unique("n"));
    let node = node_for(&reg);
    let by_tag = format!("{}/{repo}:v1", reg.host());
    let by_digest = format!("{}/{repo}@{digest}", reg.host());

    // A run pulls first, then runs in the image.
    let v = node.run_ok(&json!({ "image": by_tag, "command": PROBE }));
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(v["stdout"], PROBE_OUT, "{v}");
    // The config and the top layer at least (the bottom one may be in the store already).
    let blobs = reg.gets("blobs");
    assert!(blobs >= 2, "config and top layer: {blobs}\n{}", reg.log());

    // A run starts no start command: asking for the image's is refused, not ignored.
    let (status, v) = node.run(&json!({ "image": by_tag, "command": "true", "start": true }));
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], "not_served_here", "{v}");
    assert_eq!(v["error"]["param"], "start", "{v}");

    // By digest: the store has it, no registry request at all.
    let manifests = reg.gets("manifests");
    let v = node.run_ok(&json!({ "image": by_digest, "command": PROBE }));
    assert_eq!(v["stdout"], PROBE_OUT, "{v}");
    assert_eq!(
        reg.gets("manifests"),
        manifests,
        "by digest asked the registry"
    );

    // A sandbox: answered `starting` only when it must pull; here the image is on the node.
    let r = node.post_json("/v1/sandboxes", &json!({ "image": by_tag }));
    assert_eq!(r.status, 201, "{}", r.text());
    let id = r.json()["id"].as_str().unwrap().to_string();
    let sb = wait_status(&node, &id, "starting");
    assert_eq!(sb["status"], "running", "{sb}");
    assert_eq!(sb["image"], by_tag.as_str(), "{sb}");
    let e = node.exec(&id, &json!({ "command": PROBE }));
    let done = node.exec_wait(&id, e["id"].as_str().unwrap(), Duration::from_secs(10));
    assert_eq!(done["stdout"], PROBE_OUT, "{done}");
    // Writes go to the sandbox's own upper layer.
    let e = node.exec(
        &id,
        &json!({ "command": "echo mine > /app/hello.txt; read l < /app/hello.txt; echo \"$l\"" }),
    );
    let done = node.exec_wait(&id, e["id"].as_str().unwrap(), Duration::from_secs(10));
    assert_eq!(done["stdout"], "mine\n", "{done}");

    // A second sandbox of the pulled image: no blob is fetched again.
    let sb2 = node.create_sandbox(&json!({ "image": by_digest }));
    let id2 = sb2["id"].as_str().unwrap().to_string();
    let e = node.exec(&id2, &json!({ "command": PROBE }));
    let done = node.exec_wait(&id2, e["id"].as_str().unwrap(), Duration::from_secs(10));
    assert_eq!(
        done["stdout"], PROBE_OUT,
        "the first sandbox's write is its own: {done}"
    );
    assert_eq!(reg.gets("blobs"), blobs, "a second sandbox fetched blobs");

    // The node's images.
    let list = node.get("/v1/images", &[]).json();
    let data = list["data"].as_array().unwrap();
    assert!(data.iter().any(|i| i["references"][0] == "base"), "{list}");
    let mine = data
        .iter()
        .find(|i| i["digest"] == digest.as_str())
        .unwrap_or_else(|| panic!("{list}"));
    assert!(mine["size"].as_u64().unwrap() > 100_000, "{mine}");
    assert_eq!(mine["layers"], 2, "{mine}");

    node.delete_sandbox(&id);
    node.delete_sandbox(&id2);
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn a_sandbox_waits_for_its_pull_and_pulls_stream_progress() {
    let reg = registry();
    let repo = "sbx/pulled";
    let nonce = common::unique("n");
    let digest = push_probe(&reg, repo, "v2", &nonce);
    let tag = "v3";
    let node = node_for(&reg);

    // The pull API: progress, then done with the digest.
    let r = node.post_json(
        "/v1/images/pull",
        &json!({ "image": format!("{}/{repo}:v2", reg.host()) }),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let text = r.text();
    assert!(text.contains("event: done"), "{text}");
    assert!(text.contains(&digest), "{text}");
    assert!(text.contains("event: progress"), "{text}");

    // A create of an image not pulled yet is answered `starting`, then runs.
    let other = format!("{}/sbx/other:{tag}", reg.host());
    let d = push_probe(&reg, "sbx/other", tag, &nonce);
    assert_eq!(d, digest);
    let r = node.post_json(
        "/v1/sandboxes",
        &json!({ "image": other, "env": {"X": "1"} }),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let v = r.json();
    assert_eq!(v["status"], "starting", "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let v = wait_status(&node, &id, "starting");
    assert_eq!(v["status"], "running", "{v}");
    let e = node.exec(&id, &json!({ "command": "echo \"$X $GREETING\"" }));
    let done = node.exec_wait(&id, e["id"].as_str().unwrap(), Duration::from_secs(10));
    assert_eq!(done["stdout"], "1 hi from the image\n", "{done}");
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn bad_and_missing_images_are_refused() {
    let reg = registry();
    let node = node_for(&reg);
    // Not a reference: 400 before anything is made.
    for bad in ["UPPER/case", "a/b:c:d", "x@sha256:123"] {
        let (status, v) = node.run(&json!({ "image": bad, "command": "true" }));
        assert_error(status, &v, 400, "invalid_image", Some("image"));
        let r = node.post_json("/v1/sandboxes", &json!({ "image": bad }));
        assert_error(r.status, &r.json(), 400, "invalid_image", Some("image"));
        let r = node.post_json("/v1/images/pull", &json!({ "image": bad }));
        assert_error(r.status, &r.json(), 400, "invalid_image", Some("image"));
    }
    // Not in the registry: the run fails (sandbox_failed, invalid_image first in its message),
    // the sandbox is `failed` with failure_code invalid_image, the pull ends with an error.
    let missing = format!("{}/sbx/missing:v1", reg.host());
    let (status, v) = node.run(&json!({ "image": missing, "command": "true" }));
    assert_error(status, &v, 409, "sandbox_failed", Some("image"));
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.starts_with("invalid_image:"), "{v}");
    let r = node.post_json("/v1/sandboxes", &json!({ "image": missing }));
    assert_eq!(r.status, 201, "{}", r.text());
    let id = r.json()["id"].as_str().unwrap().to_string();
    let v = wait_status(&node, &id, "starting");
    assert_eq!(v["status"], "failed", "{v}");
    assert_eq!(v["failure_code"], "invalid_image", "{v}");
    node.delete_sandbox(&id);
    let r = node.post_json("/v1/images/pull", &json!({ "image": missing }));
    let text = r.text();
    assert!(text.contains("event: error"), "{text}");
    assert!(text.contains("invalid_image"), "{text}");
    // A registry that is not there.
    let r = node.post_json(
        "/v1/images/pull",
        &json!({ "image": "127.0.0.1:9/sbx/none:v1" }),
    );
    assert!(r.text().contains("event: error"), "{}", r.text());
    // A pull secret that does not exist.
    let (status, v) = node.run(&json!({
        "image": missing, "image_pull_secret": "nope", "command": "true"
    }));
    assert_error(
        status,
        &v,
        404,
        "secret_not_found",
        Some("image_pull_secret"),
    );
    node.assert_clean(Duration::from_secs(10));
}

/// `PUT /v1/secrets/{name}`: must answer 201 or 200.
fn put_secret(node: &TestNode, name: &str, body: &Value) {
    let r = ureq::put(&node.url(&format!("/v1/secrets/{name}")))
        .set("Content-Type", "application/json")
        .send_bytes(&serde_json::to_vec(body).unwrap());
    match r {
        Ok(r) => assert!([200, 201].contains(&r.status()), "PUT secret {name}"),
        Err(e) => panic!("PUT secret {name}: {e}\n{}", node.log_tail(20)),
    }
}

/// A create that must be answered `starting` (its image is pulled in the background), then
/// the sandbox once it is no longer `starting`.
fn create_pulling(node: &TestNode, body: &Value) -> (String, Value) {
    let r = node.post_json("/v1/sandboxes", body);
    assert_eq!(r.status, 201, "{}", r.text());
    let v = r.json();
    assert_eq!(v["status"], "starting", "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let sb = wait_status(node, &id, "starting");
    (id, sb)
}

#[test]
fn a_private_registry_needs_the_right_pull_secret() {
    let password = common::unique("Right-Pa55");
    let wrong = common::unique("Wrong-Pa55");
    let reg = Registry::start(Some(("sbx", &password))).unwrap();
    let repo = "private/probe";
    let digest = push_probe(&reg, repo, "v1", &common::unique("n"));
    let image = format!("{}/{repo}:v1", reg.host());
    let by_digest = format!("{}/{repo}@{digest}", reg.host());
    let node = node_for(&reg);
    put_secret(
        &node,
        "wrong-login",
        &json!({ "value": format!("sbx:{wrong}"), "allowed_hosts": ["127.0.0.1"] }),
    );
    put_secret(
        &node,
        "right-login",
        &json!({ "value": format!("sbx:{password}"), "allowed_hosts": ["127.0.0.1"] }),
    );
    let hidden = |what: &str, text: &str| {
        for secret in [&password, &wrong] {
            assert!(
                !text.contains(secret.as_str()),
                "{what} holds a password: {text}"
            );
        }
    };
    // A refused pull, as a sandbox: `starting`, then `failed` with registry_auth_failed.
    let assert_refused = |body: &Value| {
        let (id, sb) = create_pulling(&node, body);
        assert_eq!(sb["status"], "failed", "{body}: {sb}");
        assert_eq!(sb["failure_code"], "registry_auth_failed", "{sb}");
        let failure = sb["failure"].as_str().unwrap_or_default();
        assert!(failure.contains(&reg.host()), "{sb}");
        hidden("the sandbox", &sb.to_string());
        hidden("the list", &node.get("/v1/sandboxes", &[]).text());
        node.delete_sandbox(&id);
    };
    // As a run: 409 sandbox_failed, the failure code first in its message.
    let assert_run_refused = |body: &Value| {
        let (status, v) = node.run(body);
        assert_error(status, &v, 409, "sandbox_failed", Some("image"));
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.starts_with("registry_auth_failed:"), "{v}");
        hidden("the run's error", &v.to_string());
    };

    // The wrong password.
    assert_refused(&json!({ "image": image, "image_pull_secret": "wrong-login" }));
    assert_run_refused(&json!({
        "image": image, "image_pull_secret": "wrong-login", "command": "true"
    }));
    // No secret at all: the registry wants a login.
    assert_refused(&json!({ "image": image }));
    assert_run_refused(&json!({ "image": image, "command": "true" }));

    // The right one: the sandbox runs, and so does a command in it and a run.
    let (id, sb) = create_pulling(
        &node,
        &json!({ "image": image, "image_pull_secret": "right-login" }),
    );
    assert_eq!(sb["status"], "running", "{sb}");
    let e = node.exec(&id, &json!({ "command": PROBE }));
    let done = node.exec_wait(&id, e["id"].as_str().unwrap(), Duration::from_secs(10));
    assert_eq!(done["stdout"], PROBE_OUT, "{done}");
    node.delete_sandbox(&id);
    let v = node.run_ok(&json!({
        "image": image, "image_pull_secret": "right-login", "command": PROBE
    }));
    assert_eq!(v["stdout"], PROBE_OUT, "{v}");

    // Pulled with a login, the image is not served from the node's store to a create without
    // one, nor to one with a wrong login, by tag or by digest: the registry is asked again and
    // refuses.
    for name in [&image, &by_digest] {
        assert_refused(&json!({ "image": name }));
        assert_run_refused(&json!({ "image": name, "command": "true" }));
        assert_refused(&json!({ "image": name, "image_pull_secret": "wrong-login" }));
        assert_run_refused(&json!({
            "image": name, "image_pull_secret": "wrong-login", "command": "true"
        }));
    }
    // With the right one by digest it runs (from the store: no blob fetched again).
    let blobs = reg.gets("blobs");
    let v = node.run_ok(&json!({
        "image": by_digest, "image_pull_secret": "right-login", "command": PROBE
    }));
    assert_eq!(v["stdout"], PROBE_OUT, "{v}");
    assert_eq!(reg.gets("blobs"), blobs);

    std::thread::sleep(Duration::from_millis(200));
    hidden("the node's log", &node.log_text());
    node.assert_clean(Duration::from_secs(10));
}

/// The node's `image gc:` log lines, once there are at least `n` (at most 30 s).
fn gc_lines(node: &TestNode, n: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let lines: Vec<String> = node
            .log_text()
            .lines()
            .filter(|l| l.contains("image gc"))
            .map(String::from)
            .collect();
        if lines.len() >= n {
            return lines;
        }
        assert!(
            Instant::now() < deadline,
            "no image gc in the log\n{}",
            node.log_tail(30)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_node_start_collects_what_no_image_uses() {
    let reg = registry();
    let repo = "sbx/kept";
    let digest = push_probe(&reg, repo, "v1", &common::unique("n"));
    let by_digest = format!("{}/{repo}@{digest}", reg.host());
    let mut node =
        TestNode::start_private_images(&["--insecure-registry", &reg.host(), "--warm-pool", "0"]);
    let images = node.images_dir.clone();
    let oci = images.join("oci");
    // The first start finds no store: nothing removed.
    let first = gc_lines(&node, 1);
    assert!(
        first[0].contains("removed 0 blobs (0 bytes), 0 layers"),
        "{first:?}"
    );
    let v = node.run_ok(&json!({ "image": by_digest, "command": PROBE }));
    assert_eq!(v["stdout"], PROBE_OUT, "{v}");
    // A kept sandbox of the image runs across the node's restart (and its gc).
    let sb = node.create_sandbox(&json!({ "image": by_digest }));
    let id = sb["id"].as_str().unwrap().to_string();
    node.stop();

    // What a killed pull leaves (a half-unpacked layer, a half-written blob), what no image
    // names (a layer, a blob), and the private marker of an image no longer stored.
    let half_layer = oci.join("layers/.tmp-1-0-half");
    fs::create_dir(&half_layer).unwrap();
    fs::write(half_layer.join("file"), b"half").unwrap();
    let half_blob = oci.join("blobs/sha256/.tmp-1-1-part");
    fs::write(&half_blob, b"part").unwrap();
    let stray_layer = oci.join("layers").join("5".repeat(64));
    fs::create_dir(&stray_layer).unwrap();
    fs::write(stray_layer.join("file"), b"stray").unwrap();
    let stray_blob = oci.join("blobs/sha256").join("6".repeat(64));
    fs::write(&stray_blob, b"0123456789").unwrap();
    let marker = images.join("oci-private").join("7".repeat(64));
    fs::create_dir_all(marker.parent().unwrap()).unwrap();
    fs::write(&marker, b"").unwrap();
    let layers_before = fs::read_dir(oci.join("layers")).unwrap().count();

    node.restart();
    let lines = gc_lines(&node, 2);
    assert!(
        lines[1].contains(
            "removed 1 blobs (10 bytes), 1 layers, 2 temp files, 0 records, 1 private markers"
        ),
        "{lines:?}"
    );
    for gone in [&half_layer, &half_blob, &stray_layer, &stray_blob, &marker] {
        assert!(!gone.exists(), "{} is left", gone.display());
    }
    assert_eq!(
        fs::read_dir(oci.join("layers")).unwrap().count(),
        layers_before - 2,
        "the image's layers are kept"
    );
    // The image still runs from the store (no blob fetched again), and so does the kept
    // sandbox on it.
    let blobs = reg.gets("blobs");
    let v = node.run_ok(&json!({ "image": by_digest, "command": PROBE }));
    assert_eq!(v["stdout"], PROBE_OUT, "{v}");
    assert_eq!(reg.gets("blobs"), blobs, "a blob was fetched again");
    let e = node.exec(&id, &json!({ "command": PROBE }));
    let done = node.exec_wait(&id, e["id"].as_str().unwrap(), Duration::from_secs(10));
    assert_eq!(done["stdout"], PROBE_OUT, "{done}");

    // The same as a command, beside the running node.
    fs::write(&stray_blob, b"01234").unwrap();
    let gc = |what: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_sandboxd"))
            .arg("--images-dir")
            .arg(&images)
            .arg("gc")
            .output()
            .unwrap();
        assert!(out.status.success(), "{what}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    assert_eq!(
        gc("gc"),
        "removed 1 blobs (5 bytes), 0 layers, 0 temp files, 0 records, 0 private markers\n"
    );
    assert!(!stray_blob.exists());
    assert!(gc("gc again").starts_with("removed 0 blobs (0 bytes), 0 layers"));
    let v = node.run_ok(&json!({ "image": by_digest, "command": PROBE }));
    assert_eq!(v["stdout"], PROBE_OUT, "{v}");

    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}

// ---------------------------------------------------------------------------------------------
// The image's own start: ENTRYPOINT/CMD, labels, STOPSIGNAL; templates pinned by digest.

/// An image whose config starts a service three ways: ENTRYPOINT+CMD, the labels sbx.start and
/// sbx.ready; STOPSIGNAL SIGQUIT, which its CMD traps. `nonce` is in /app/nonce.
fn push_service(reg: &Registry, repo: &str, tag: &str, nonce: &str) -> String {
    let mut t = Tar::new();
    t.dir_mode("bin", 0o755).dir_mode("app", 0o755);
    t.file_mode("bin/sleep", 0o755, &read_base("/usr/bin/sleep"));
    t.file_mode("app/nonce", 0o644, nonce.as_bytes());
    let layers = [
        Layer::new(layer_one(), Compression::None),
        Layer::new(t.done(), Compression::Gzip),
    ];
    let config = json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/bin"],
            "Entrypoint": ["/bin/sh", "-c"],
            "Cmd": ["echo by-cmd > /tmp/cmd; trap 'echo got-quit > /tmp/sig; exit 0' QUIT; sleep 1000 & wait"],
            "StopSignal": "SIGQUIT",
            "Labels": {
                "sbx.start": "echo by-label > /tmp/label; exec sleep 1000",
                "sbx.ready": "test -f /tmp/label",
            },
        },
        "rootfs": {
            "type": "layers",
            "diff_ids": layers.iter().map(|l| l.diff_id.clone()).collect::<Vec<_>>(),
        },
    });
    let config = serde_json::to_vec(&config).unwrap();
    reg.push_image(repo, Some(tag), &layers, &config).unwrap().0
}

fn sh(node: &TestNode, id: &str, command: &str) -> String {
    let r = node.post_json(
        &format!("/v1/sandboxes/{id}/run"),
        &json!({ "command": command }),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["stdout"].as_str().unwrap_or_default().to_string()
}

fn running(node: &TestNode, body: &Value) -> String {
    let r = node.post_json("/v1/sandboxes", body);
    assert_eq!(r.status, 201, "{}", r.text());
    let id = r.json()["id"].as_str().unwrap().to_string();
    let v = wait_status(node, &id, "starting");
    assert_eq!(v["status"], "running", "{v}");
    id
}

#[test]
fn an_images_own_start_labels_and_stop_signal_are_honoured() {
    let reg = registry();
    let repo = "sbx/service";
    let nonce = common::unique("n");
    push_service(&reg, repo, "v1", &nonce);
    // Plain HTTP to the registry because the config file says so (no --insecure-registry).
    let dir = std::env::temp_dir().join(common::unique("sbx-img-cfg"));
    fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("sandboxd.toml");
    fs::write(
        &cfg,
        format!("insecure_registries = [\"{}\"]\n", reg.host()),
    )
    .unwrap();
    let node = TestNode::start_with(&["--config", cfg.to_str().unwrap(), "--warm-pool", "0"]);
    let image = format!("{}/{repo}:v1", reg.host());

    // Nothing said of the start: the labels start it, and it is running once sbx.ready passes.
    let labels = running(&node, &json!({ "image": image }));
    assert_eq!(
        sh(&node, &labels, "read l < /tmp/label; echo $l"),
        "by-label\n"
    );
    let e = node
        .get(&format!("/v1/sandboxes/{labels}/exec/exe-start"), &[])
        .json();
    assert_eq!(e["status"], "running", "{e}");

    // start: true: ENTRYPOINT then CMD, not the labels; a restart stops it with STOPSIGNAL.
    let cmd = running(&node, &json!({ "image": image, "start": true }));
    let out = sh(
        &node,
        &cmd,
        "while ! test -e /tmp/cmd; do sleep 0.05; done; read c < /tmp/cmd; echo $c; \
         test -e /tmp/label || echo no-label",
    );
    assert_eq!(out, "by-cmd\nno-label\n");
    let r = node.post_json(&format!("/v1/sandboxes/{cmd}/restart"), &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = wait_status(&node, &cmd, "starting");
    assert_eq!(v["status"], "running", "{v}");
    assert_eq!(
        sh(&node, &cmd, "read s < /tmp/sig; echo $s"),
        "got-quit\n",
        "SIGQUIT, the image's STOPSIGNAL"
    );

    // start: false: nothing.
    let none = running(&node, &json!({ "image": image, "start": false }));
    let r = node.get(&format!("/v1/sandboxes/{none}/exec/exe-start"), &[]);
    assert_eq!(r.status, 404, "{}", r.text());

    // Three settings, three templates, each pinned to the image's digest.
    let info = node.get("/internal/node", &[]).json();
    let ts: Vec<&Value> = info["templates"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["image"] == image.as_str())
        .collect();
    assert_eq!(ts.len(), 3, "{info}");
    let digest = ts[0]["digest"].as_str().unwrap().to_string();
    assert!(
        ts.iter()
            .all(|t| t["status"] == "ready" && t["digest"] == digest.as_str()),
        "{info}"
    );

    // The tag moves: a later sandbox of the same settings is still made of the template's
    // digest, with no registry request; an explicit pull forgets the template, and the next
    // one is of the new image.
    let nonce2 = common::unique("n");
    push_service(&reg, repo, "v1", &nonce2);
    let manifests = reg.gets("manifests");
    let later = running(&node, &json!({ "image": image, "start": false }));
    assert_eq!(
        sh(&node, &later, "read n < /app/nonce; echo $n"),
        format!("{nonce}\n")
    );
    assert_eq!(
        reg.gets("manifests"),
        manifests,
        "no registry request: {}",
        reg.log()
    );
    let mut s = node.open_sse_post("/v1/images/pull", &json!({ "image": image }));
    let done = s.rest().pop().unwrap();
    assert_eq!(done.event, "done", "{:?}", done.data);
    assert_eq!(done.data["templates_forgotten"], 3, "{:?}", done.data);
    let newer = running(&node, &json!({ "image": image, "start": false }));
    assert_eq!(
        sh(&node, &newer, "read n < /app/nonce; echo $n"),
        format!("{nonce2}\n")
    );

    for id in [&labels, &cmd, &none, &later, &newer] {
        node.delete_sandbox(id);
    }
    node.assert_clean(Duration::from_secs(10));
    let _ = fs::remove_dir_all(dir);
}

#[test]
fn an_image_without_a_start_command_fails_start_true_as_invalid_image() {
    let reg = registry();
    let repo = "sbx/probe-nostart";
    push_probe(&reg, repo, "v1", &common::unique("n"));
    let node = node_for(&reg);
    let image = format!("{}/{repo}:v1", reg.host());
    let r = node.post_json("/v1/sandboxes", &json!({ "image": image, "start": true }));
    assert_eq!(r.status, 201, "{}", r.text());
    let id = r.json()["id"].as_str().unwrap().to_string();
    let v = wait_status(&node, &id, "starting");
    assert_eq!(v["status"], "failed", "{v}");
    assert_eq!(v["failure_code"], "invalid_image", "{v}");
    assert!(
        v["failure"].as_str().unwrap().contains("ENTRYPOINT or CMD"),
        "{v}"
    );
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}

// ---------------------------------------------------------------------------------------------
// The base image: what E2B's base template gives code (issue #30): `sudo` for `user`, without
// a password, and `python` as python3.

/// Runs `command` (sh) in `sandbox` as `user` and waits: the final exec object.
fn run_as(node: &TestNode, sandbox: &str, user: &str, command: &str) -> Value {
    let v = node.exec(
        sandbox,
        &json!({ "command": command, "user": user, "wait_seconds": 30 }),
    );
    let id = v["id"].as_str().expect("exec id").to_string();
    node.exec_wait(sandbox, &id, Duration::from_secs(60))
}

/// The base image's LANG, C.UTF-8, is in its locale archive: a program that sets its locale
/// opens that one file, not the locale's 13 (recipe 3).
#[test]
fn the_base_image_s_locale_is_archived() {
    let node = TestNode::start();
    let v = node.run_ok(&json!({ "command": "echo $LANG; localedef --list-archive" }));
    assert_eq!(stdout(&v), "C.UTF-8\nC.utf8\n", "{v}");
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn the_base_image_s_user_may_sudo_and_python_is_python3() {
    let node = TestNode::start();
    let sb = node.create_sandbox(&json!({}));
    let id = sb["id"].as_str().expect("id").to_string();
    // sudo is setuid root of the image: it raises `user` to the sandbox's root (uid 0 of the
    // sandbox's user namespace), with no password (the image's /etc/sudoers.d/user), and no
    // further: the capabilities are the sandbox root's bounded set and the seccomp filter stays.
    let v = run_as(
        &node,
        &id,
        "user",
        "id -u; sudo -n id -u; sudo -n true && echo sudo-ok; python --version; \
         sudo -n grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status",
    );
    assert_eq!(v["exit_code"], 0, "{v}");
    let out = v["stdout"].as_str().unwrap_or_default().to_string();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 7, "{v}");
    assert_eq!(&lines[..3], ["1000", "0", "sudo-ok"], "{v}");
    assert!(lines[3].starts_with("Python 3."), "{v}");
    assert_eq!(
        &lines[4..],
        ["CapEff:\t00000000a80425fb", "NoNewPrivs:\t0", "Seccomp:\t2"],
        "{v}"
    );
    assert_eq!(v["stderr"].as_str().unwrap_or_default(), "", "{v}");
    // What sudo made as root is root's; the sudoers file is not the user's to read.
    let v = run_as(
        &node,
        &id,
        "user",
        "sudo -n touch /etc/made-by-sudo && stat -c '%u %a' /etc/made-by-sudo /etc/sudoers.d/user; \
         cat /etc/sudoers.d/user",
    );
    assert_ne!(v["exit_code"], 0, "{v}");
    assert_eq!(v["stdout"], "0 644\n0 440\n", "{v}");
    assert!(
        v["stderr"]
            .as_str()
            .unwrap_or_default()
            .contains("Permission denied"),
        "{v}"
    );
    // Only `user` is in sudoers: another account is asked for a password, which -n refuses.
    let v = run_as(&node, &id, "nobody", "sudo -n id -u");
    assert_eq!(v["exit_code"], 1, "{v}");
    assert_eq!(v["stdout"], "", "{v}");
    assert!(
        v["stderr"]
            .as_str()
            .unwrap_or_default()
            .contains("a password is required"),
        "{v}"
    );
    // A sandbox put to sleep (CRIU) and woken keeps it: the filter restored, sudo still works.
    let c = node.client();
    let v = c.sleep_sandbox(&id).expect("sleep");
    assert_eq!(v.status, sbx_api::SandboxStatus::Sleeping, "{v:?}");
    let v = c.wake_sandbox(&id).expect("wake");
    assert_eq!(v.status, sbx_api::SandboxStatus::Running, "{v:?}");
    let v = run_as(
        &node,
        &id,
        "user",
        "sudo -n id -u; grep -E '^(NoNewPrivs|Seccomp):' /proc/self/status",
    );
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(v["stdout"], "0\nNoNewPrivs:\t0\nSeccomp:\t2\n", "{v}");
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}
