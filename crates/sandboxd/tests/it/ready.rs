//! Ready checks: a sandbox with `ready.command` is answered `starting` and becomes `running`
//! once the check passes, or `failed` (`boot_failed`) with what the check last got.

use std::time::{Duration, Instant};

use crate::common::{self, assert_error, TestNode};
use serde_json::{json, Value};

fn create_starting(node: &TestNode, body: &Value) -> Value {
    let r = node.post_json("/v1/sandboxes", body);
    assert_eq!(r.status, 201, "{}", r.text());
    r.json()
}

/// `POST /v1/sandboxes/{id}/run` of `command`: its answer.
fn run_in(node: &TestNode, id: &str, command: &str) -> Value {
    let r = node.post_json(
        &format!("/v1/sandboxes/{id}/run"),
        &json!({ "command": command }),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

fn wait_status(node: &TestNode, id: &str, not: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let v = node.get(&format!("/v1/sandboxes/{id}"), &[]).json();
        if v["status"] != not || Instant::now() > deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_sandbox_is_running_once_its_ready_check_passes() {
    let node = TestNode::start();
    let t = Instant::now();
    let v = create_starting(
        &node,
        &json!({
            "start_command": "sleep 1; touch /tmp/up; exec sleep 1000",
            "ready": { "command": "test -f /tmp/up" },
        }),
    );
    assert_eq!(v["status"], "starting", "{v}");
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "the answer waited for the check"
    );
    let id = v["id"].as_str().unwrap().to_string();
    let v = wait_status(&node, &id, "starting");
    assert_eq!(v["status"], "running", "{v}");
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "running before the check could pass"
    );
    let e = node
        .get(&format!("/v1/sandboxes/{id}/exec/exe-start"), &[])
        .json();
    assert_eq!(e["status"], "running", "{e}");
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn a_start_command_that_fails_ends_the_wait() {
    let node = TestNode::start();
    let t = Instant::now();
    let v = create_starting(
        &node,
        &json!({
            "start_command": "echo starting; exit 3",
            "ready": { "command": "echo not yet; false" },
        }),
    );
    let id = v["id"].as_str().unwrap().to_string();
    let v = wait_status(&node, &id, "starting");
    assert_eq!(v["status"], "failed", "{v}");
    assert_eq!(v["failure_code"], "boot_failed", "{v}");
    let why = v["failure"].as_str().unwrap();
    assert!(why.contains("exit code 3"), "{why}");
    assert!(why.contains("not yet"), "what the check last got: {why}");
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "the wait went on: {:?}",
        t.elapsed()
    );
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn tcp_and_http_checks_are_tried_from_the_host_and_start_true_is_the_base_images_none() {
    let node = TestNode::start();
    // A service on every address: the tcp check passes once it listens.
    let serve = "sleep 0.5; exec python3 -m http.server 8080 --bind 0.0.0.0 --directory /etc";
    let v = create_starting(
        &node,
        &json!({ "start_command": serve, "ready": { "tcp": { "port": 8080 } } }),
    );
    assert_eq!(v["status"], "starting", "{v}");
    let tcp = v["id"].as_str().unwrap().to_string();
    let v = wait_status(&node, &tcp, "starting");
    assert_eq!(v["status"], "running", "{v}");
    // An http check of a path that answers 200.
    let v = create_starting(
        &node,
        &json!({ "start_command": serve, "ready": { "http": { "port": 8080, "path": "/hostname" } } }),
    );
    let http = v["id"].as_str().unwrap().to_string();
    let v = wait_status(&node, &http, "starting");
    assert_eq!(v["status"], "running", "{v}");
    // Nothing ran in the sandbox for them: its only commands are the start commands.
    for id in [&tcp, &http] {
        let list = node.get(&format!("/v1/sandboxes/{id}/exec"), &[]).json();
        let ids: Vec<&str> = list["data"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|e| e["id"].as_str())
            .collect();
        assert_eq!(ids, ["exe-start"], "{list}");
        node.delete_sandbox(id);
    }
    // An http check of a path that answers 404 never passes; a start command that dies
    // meanwhile ends the wait, and the failure says what the check last got and what the
    // start command printed.
    let v = create_starting(
        &node,
        &json!({
            "start_command": "python3 -m http.server 8080 --bind 0.0.0.0 --directory /etc 2>/dev/null & sleep 2; echo going down; exit 4",
            "ready": { "http": { "port": 8080, "path": "/no-such-file" } },
        }),
    );
    let id = v["id"].as_str().unwrap().to_string();
    let v = wait_status(&node, &id, "starting");
    assert_eq!(v["status"], "failed", "{v}");
    assert_eq!(v["failure_code"], "boot_failed", "{v}");
    let why = v["failure"].as_str().unwrap();
    // (HTTP 404 while the server ran; its last try may meet the server going down.)
    assert!(
        why.contains("GET /no-such-file on port 8080"),
        "what the check last got: {why}"
    );
    assert!(
        why.contains("going down"),
        "what the start command printed: {why}"
    );
    node.delete_sandbox(&id);

    // The base image has no start command of its own: start: true starts nothing.
    let v = node.create_sandbox(&json!({ "start": true }));
    assert_eq!(v["status"], "running", "{v}");
    node.delete_sandbox(v["id"].as_str().unwrap());
    let (status, body) = node.run(&json!({ "command": "true", "start": true }));
    assert_eq!(status, 200, "{body}");
    let (status, body) = node.run(&json!({ "command": "true", "start_command": "sleep 1" }));
    assert_error(status, &body, 503, "not_served_here", Some("start_command"));
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn a_service_on_127_0_0_1_alone_does_not_pass_a_tcp_check() {
    let node = TestNode::start();
    // It listens on the sandbox's 127.0.0.1 only, then gives up after 3 s: the check never
    // passed (the node tries the address the preview URLs would reach), and says so.
    let v = create_starting(
        &node,
        &json!({
            "start_command": "timeout 3 python3 -m http.server 8081 --bind 127.0.0.1; exit 7",
            "ready": { "tcp": { "port": 8081 } },
        }),
    );
    let id = v["id"].as_str().unwrap().to_string();
    let v = wait_status(&node, &id, "starting");
    assert_eq!(v["status"], "failed", "{v}");
    let why = v["failure"].as_str().unwrap();
    assert!(why.contains("exit code 7"), "{why}");
    assert!(why.contains("port 8081"), "{why}");
    node.delete_sandbox(&id);
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn a_sandbox_deleted_while_it_waits_for_its_check_goes_at_once() {
    let node = TestNode::start();
    let v = create_starting(
        &node,
        &json!({ "start_command": "exec sleep 1000", "ready": { "command": "false" } }),
    );
    let id = v["id"].as_str().unwrap().to_string();
    std::thread::sleep(Duration::from_millis(500));
    let t = Instant::now();
    let r = node.delete(&format!("/v1/sandboxes/{id}"), &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "the delete waited for the check's 120 s: {:?}",
        t.elapsed()
    );
    let r = node.get(&format!("/v1/sandboxes/{id}"), &[]);
    assert_eq!(r.status, 404, "{}", r.text());
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn the_first_sandbox_of_settings_builds_their_template_and_later_ones_start_from_it() {
    let node = TestNode::start();
    let body = json!({
        "start_command": "sleep 1; touch /tmp/up; exec sleep 1000",
        "ready": { "command": "test -f /tmp/up" },
        "env": { "ROLE": "web" },
    });
    // Two first sandboxes at once: one build, both starting, both running after it.
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| create_starting(&node, &body));
        let b = s.spawn(|| create_starting(&node, &body));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!(
        (a["status"].as_str(), b["status"].as_str()),
        (Some("starting"), Some("starting"))
    );
    let key = a["template"].as_str().unwrap().to_string();
    assert!(key.starts_with("img-") && key.len() == 20, "{a}");
    assert_eq!(b["template"], key.as_str());
    let ids = [
        a["id"].as_str().unwrap().to_string(),
        b["id"].as_str().unwrap().to_string(),
    ];
    for id in &ids {
        let v = wait_status(&node, id, "starting");
        assert_eq!(v["status"], "running", "{v}");
    }
    let info = node.get("/internal/node", &[]).json();
    let templates = info["templates"].as_array().unwrap();
    assert_eq!(templates[0]["key"], "base", "{info}");
    let t: Vec<&Value> = templates
        .iter()
        .filter(|t| t["key"] == key.as_str())
        .collect();
    assert_eq!(t.len(), 1, "one template: {info}");
    assert_eq!(t[0]["status"], "ready", "{info}");
    assert_eq!(t[0]["env"], json!(["ROLE"]), "env by names only: {info}");
    assert!(ids.iter().any(|i| t[0]["built_by"] == i.as_str()), "{info}");

    // A later one starts from it: answered running, its check passed, its start command
    // running.
    let c = node.create_sandbox(&body);
    assert_eq!(c["status"], "running", "{c}");
    assert_eq!(c["template"], key.as_str());
    let cid = c["id"].as_str().unwrap().to_string();
    let v = run_in(&node, &cid, "test -f /tmp/up && echo up");
    assert_eq!(v["stdout"], "up\n", "{v}");
    // By its key: the same settings, the create's env added.
    let d = node.create_sandbox(&json!({ "template": key, "env": { "EXTRA": "1" } }));
    assert_eq!(d["status"], "running", "{d}");
    let did = d["id"].as_str().unwrap().to_string();
    let v = run_in(&node, &did, "echo $ROLE $EXTRA; test -f /tmp/up && echo up");
    assert_eq!(v["stdout"], "web 1\nup\n", "{v}");
    let e = node
        .get(&format!("/v1/sandboxes/{did}/exec/exe-start"), &[])
        .json();
    assert_eq!(e["status"], "running", "{e}");

    // Refusals: an unknown key, another shape, start settings with a template.
    let r = node.post_json(
        "/v1/sandboxes",
        &json!({ "template": "img-0000000000000000" }),
    );
    assert_error(
        r.status,
        &r.json(),
        404,
        "template_not_found",
        Some("template"),
    );
    let r = node.post_json(
        "/v1/sandboxes",
        &json!({ "template": key, "limits": { "vcpus": 2 } }),
    );
    assert_error(r.status, &r.json(), 400, "invalid_field", Some("limits"));
    let r = node.post_json(
        "/v1/sandboxes",
        &json!({ "template": key, "start_command": "true" }),
    );
    assert_error(
        r.status,
        &r.json(),
        400,
        "invalid_start",
        Some("start_command"),
    );

    for id in ids.iter().chain([&cid, &did]) {
        node.delete_sandbox(id);
    }
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn sbx_create_waits_for_the_check_and_takes_a_template() {
    let node = TestNode::start();
    let (code, out, err) = common::sbx(
        &node,
        &[
            "create",
            "--start",
            "sleep 0.5; exec python3 -m http.server 8080 --bind 0.0.0.0",
            "--ready",
            "http:8080/",
        ],
    );
    assert_eq!(code, 0, "{out}{err}");
    let id = out.trim().to_string();
    assert!(common::is_id("sbx", &id), "{out}");
    // It waited: the sandbox is running as sbx answers.
    let v = node.get(&format!("/v1/sandboxes/{id}"), &[]).json();
    assert_eq!(v["status"], "running", "{v}");
    let key = v["template"].as_str().unwrap().to_string();
    // `sbx templates` lists it, built.
    let (code, out, err) = common::sbx(&node, &["templates"]);
    assert_eq!(code, 0, "{out}{err}");
    let line = out
        .lines()
        .find(|l| l.starts_with(&key))
        .unwrap_or_default();
    assert!(
        line.contains("ready") && line.contains("exec python3"),
        "{out}"
    );
    // From its template, by key, as JSON.
    let (code, out, err) = common::sbx(&node, &["create", "--template", &key, "--json"]);
    assert_eq!(code, 0, "{out}{err}");
    let made: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (made["status"].as_str(), made["template"].as_str()),
        (Some("running"), Some(key.as_str())),
        "{made}"
    );
    // A check sbx cannot read is refused before any request.
    let (code, _, err) = common::sbx(&node, &["create", "--ready", "udp:53"]);
    assert_ne!(code, 0);
    assert!(err.contains("tcp:PORT"), "{err}");
    // restart and rm, as JSON for scripts: the restart waits for the check again.
    let (code, out, err) = common::sbx(&node, &["restart", "--json", &id]);
    assert_eq!(code, 0, "{out}{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (v["status"].as_str(), v["restarts"].as_i64()),
        (Some("running"), Some(1)),
        "{v}"
    );
    let made_id = made["id"].as_str().unwrap();
    let (code, out, err) = common::sbx(&node, &["rm", "--json", &id, made_id]);
    assert_eq!(code, 0, "{out}{err}");
    let gone: Value = serde_json::from_str(&out).unwrap();
    let ids: Vec<&str> = gone
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["id"].as_str())
        .collect();
    assert_eq!(ids, [id.as_str(), made_id], "{gone}");
    assert!(
        gone.as_array()
            .unwrap()
            .iter()
            .all(|v| v["status"] == "deleted"),
        "{gone}"
    );
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn a_template_built_ahead_serves_the_first_sandbox_at_once_and_keeps_no_sandbox() {
    let node = TestNode::start();
    let settings = json!({
        "start_command": "sleep 0.5; touch /tmp/up; exec sleep 1000",
        "ready": { "command": "test -f /tmp/up" },
    });
    let r = node.post_json("/internal/templates", &settings);
    assert_eq!(r.status, 202, "{}", r.text());
    let t = r.json();
    assert_eq!(t["status"], "building", "{t}");
    let key = t["key"].as_str().unwrap().to_string();
    // Built once its check passes; its build sandbox goes.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let all = node.get("/internal/templates", &[]).json();
        let ready = all["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["key"] == key.as_str() && t["status"] == "ready");
        let sandboxes = node.get("/v1/sandboxes", &[]).json();
        if ready && sandboxes["data"].as_array().is_some_and(|d| d.is_empty()) {
            break;
        }
        assert!(Instant::now() < deadline, "{all}\n{sandboxes}");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Asked again: built already.
    let r = node.post_json("/internal/templates", &settings);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["status"], "ready");
    // The first sandbox of these settings starts from it: running as it is answered.
    let v = node.create_sandbox(&settings);
    assert_eq!(
        (v["status"].as_str(), v["template"].as_str()),
        (Some("running"), Some(key.as_str())),
        "{v}"
    );
    node.delete_sandbox(v["id"].as_str().unwrap());
    // What a template has no use for is refused.
    for (field, value) in [("name", json!("t")), ("metadata", json!({"a": "b"}))] {
        let mut body = settings.clone();
        body[field] = value;
        let r = node.post_json("/internal/templates", &body);
        assert_error(r.status, &r.json(), 400, "invalid_field", Some(field));
    }
    // The CLI: `sbx create --template-only` waits for the build and prints the key.
    let (code, out, err) = common::sbx(
        &node,
        &[
            "create",
            "--template-only",
            "--start",
            "exec sleep 1000",
            "--ready",
            "cmd:true",
        ],
    );
    assert_eq!(code, 0, "{out}{err}");
    let cli_key = out.trim();
    assert!(cli_key.starts_with("img-") && cli_key != key, "{out}");
    let all = node.get("/internal/templates", &[]).json();
    assert!(
        all["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["key"] == cli_key && t["status"] == "ready"),
        "{all}"
    );
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn sandboxes_that_waited_for_a_failed_build_fail_with_it_and_leave_nothing() {
    let node = TestNode::start_with(&["--warm-pool", "2"]);
    let body = json!({
        "start_command": "echo broken; exit 3",
        "ready": { "command": "false" },
    });
    // Both take a warm machine; one builds, the other waits for its build.
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| create_starting(&node, &body));
        let b = s.spawn(|| create_starting(&node, &body));
        (a.join().unwrap(), b.join().unwrap())
    });
    let mut whys = Vec::new();
    for v in [&a, &b] {
        let id = v["id"].as_str().unwrap();
        let v = wait_status(&node, id, "starting");
        assert_eq!(v["status"], "failed", "{v}");
        assert_eq!(v["failure_code"], "boot_failed", "{v}");
        whys.push(v["failure"].as_str().unwrap().to_string());
    }
    assert!(whys.iter().any(|w| w.contains("exit code 3")), "{whys:?}");
    let info = node.get("/internal/node", &[]).json();
    let t = info["templates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["key"] == a["template"])
        .cloned()
        .unwrap_or_default();
    assert_eq!(t["status"], "failed", "{info}");
    for v in [&a, &b] {
        node.delete_sandbox(v["id"].as_str().unwrap());
    }
    // No machine of either is left, the warm ones they took included.
    node.assert_clean(Duration::from_secs(10));
}
