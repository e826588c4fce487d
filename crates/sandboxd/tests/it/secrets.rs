//! Secrets: `PUT /v1/secrets/{name}`, list, get, delete. A value is write-only: no answer, log
//! line or byte of the state database holds it; the node key that seals it is `node.key`
//! (0600), and a node started again over the same data directory still opens what it sealed.
//! `image_pull_secret` of a run is checked against the secret (404, 403, 400).

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use crate::common::{assert_error, unique, Reply, TestNode};
use serde_json::{json, Value};

fn put(node: &TestNode, name: &str, body: &Value) -> Reply {
    put_raw(node, name, &serde_json::to_vec(body).unwrap())
}

fn put_raw(node: &TestNode, name: &str, body: &[u8]) -> Reply {
    let r = ureq::put(&node.url(&format!("/v1/secrets/{name}")))
        .set("Content-Type", "application/json")
        .send_bytes(body);
    let resp = match r {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("PUT failed: {e}\n{}", node.log_tail(30)),
    };
    let status = resp.status();
    let mut out = Vec::new();
    std::io::Read::read_to_end(&mut resp.into_reader(), &mut out).unwrap();
    Reply {
        status,
        headers: Vec::new(),
        body: out,
    }
}

/// The bytes of every file of the state database (WAL included).
fn state_bytes(node: &TestNode) -> Vec<u8> {
    let mut all = Vec::new();
    for f in ["state.db", "state.db-wal", "state.db-shm"] {
        if let Ok(b) = std::fs::read(node.data_dir.join(f)) {
            all.extend(b);
        }
    }
    all
}

fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

fn assert_hidden(node: &TestNode, what: &str, body: &[u8], value: &str) {
    assert!(
        !contains(body, value),
        "{what}: the value is in the answer: {}",
        String::from_utf8_lossy(body)
    );
    assert!(
        !node.log_text().contains(value),
        "{what}: the value is in the node's log"
    );
}

fn check_object(v: &Value, name: &str) {
    let o = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"));
    let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "allowed_hosts",
            "created_at",
            "name",
            "object",
            "updated_at"
        ],
        "{v}"
    );
    assert_eq!(v["object"], "secret", "{v}");
    assert_eq!(v["name"], name, "{v}");
    assert!(
        v["created_at"].as_str().is_some_and(|s| s.ends_with('Z')),
        "{v}"
    );
}

#[test]
fn put_get_list_delete_and_the_value_is_never_shown() {
    let mut node = TestNode::start();
    let value = unique("s3cr3t-value");
    let name = "registry-login";

    let r = put(
        &node,
        name,
        &json!({"value": value, "allowed_hosts": ["ghcr.io", "*.example.com"]}),
    );
    assert_hidden(&node, "put", &r.body, &value);
    let v = r.json();
    assert_eq!(r.status, 201, "{v}");
    check_object(&v, name);
    assert_eq!(
        v["allowed_hosts"],
        json!(["ghcr.io", "*.example.com"]),
        "{v}"
    );
    assert_eq!(v["created_at"], v["updated_at"], "{v}");

    let r = put(&node, "other", &json!({"value": "x"}));
    assert_eq!(r.status, 201, "{}", r.text());
    assert!(r.json()["allowed_hosts"].is_null(), "{}", r.text());

    let r = node.get(&format!("/v1/secrets/{name}"), &[]);
    assert_hidden(&node, "get", &r.body, &value);
    assert_eq!(r.status, 200, "{}", r.text());
    check_object(&r.json(), name);

    let r = node.get("/v1/secrets", &[]);
    assert_hidden(&node, "list", &r.body, &value);
    let v = r.json();
    assert_eq!(r.status, 200, "{v}");
    assert_eq!(v["object"], "list", "{v}");
    let names: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["other", name], "{v}");
    for s in v["data"].as_array().unwrap() {
        check_object(s, s["name"].as_str().unwrap());
    }

    // Sealed at rest with the node key, which only the node's user reads.
    assert!(
        !contains(&state_bytes(&node), &value),
        "a value in clear in state.db"
    );
    let key = node.data_dir.join("node.key");
    let meta = std::fs::metadata(&key).expect("node.key");
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(meta.len(), 32);
    let key_bytes = std::fs::read(&key).unwrap();

    // A node started again over the same data directory keeps its key and opens its secrets.
    node.stop();
    node.restart();
    assert_eq!(std::fs::read(&key).unwrap(), key_bytes, "the key changed");
    let r = node.get(&format!("/v1/secrets/{name}"), &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    let created = r.json()["created_at"].clone();
    // A pull that uses the secret opens it: its value is no login pair, so 400 (a value that
    // did not open would be 500).
    let (status, v) = node.run(&json!({
        "command": "true",
        "image": "ghcr.io/org/app:1",
        "image_pull_secret": name,
    }));
    assert_error(status, &v, 400, "invalid_field", Some("image_pull_secret"));
    assert_hidden(&node, "run", v.to_string().as_bytes(), &value);

    // The same name again: replaced, 200, created_at kept.
    let value2 = unique("second-value");
    let r = put(&node, name, &json!({"value": value2}));
    assert_hidden(&node, "put again", &r.body, &value2);
    let v = r.json();
    assert_eq!(r.status, 200, "{v}");
    check_object(&v, name);
    assert!(v["allowed_hosts"].is_null(), "{v}");
    assert_eq!(v["created_at"], created, "{v}");
    assert!(!contains(&state_bytes(&node), &value2));

    let r = node.delete(&format!("/v1/secrets/{name}"), &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["name"], name);
    let r = node.get(&format!("/v1/secrets/{name}"), &[]);
    assert_error(r.status, &r.json(), 404, "secret_not_found", Some("name"));
    let r = node.delete(&format!("/v1/secrets/{name}"), &[]);
    assert_error(r.status, &r.json(), 404, "secret_not_found", Some("name"));
    let names: Vec<String> = node.get("/v1/secrets", &[]).json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names, ["other"]);
    assert!(!node.log_text().contains(&value) && !node.log_text().contains(&value2));
}

#[test]
fn bad_names_values_and_fields_are_400_with_their_param() {
    let node = TestNode::start();
    let value = unique("never-echoed");
    let cases: Vec<(&str, Vec<u8>, &str, &str)> = vec![
        (
            "Bad_Name",
            br#"{"value":"x"}"#.to_vec(),
            "invalid_name",
            "name",
        ),
        ("-x", br#"{"value":"x"}"#.to_vec(), "invalid_name", "name"),
        (
            "sbx-a",
            br#"{"value":"x"}"#.to_vec(),
            "invalid_name",
            "name",
        ),
        ("ok", br#"{}"#.to_vec(), "invalid_field", "value"),
        ("ok", br#"{"value":""}"#.to_vec(), "invalid_field", "value"),
        ("ok", br#"{"value":5}"#.to_vec(), "invalid_field", "value"),
        (
            "ok",
            serde_json::to_vec(&json!({"value": "a".repeat((64 << 10) + 1)})).unwrap(),
            "invalid_field",
            "value",
        ),
        (
            "ok",
            serde_json::to_vec(&json!({"value": value, "nope": 1})).unwrap(),
            "unknown_field",
            "nope",
        ),
        (
            "ok",
            serde_json::to_vec(&json!({"value": value, "allowed_hosts": "ghcr.io"})).unwrap(),
            "invalid_field",
            "allowed_hosts",
        ),
        (
            "ok",
            serde_json::to_vec(
                &json!({"value": value, "allowed_hosts": ["ghcr.io", "https://x.io/"]}),
            )
            .unwrap(),
            "invalid_field",
            "allowed_hosts[1]",
        ),
    ];
    for (name, body, code, param) in cases {
        let r = put_raw(&node, name, &body);
        assert_hidden(&node, code, &r.body, &value);
        assert_error(r.status, &r.json(), 400, code, Some(param));
    }
    // Broken JSON around a value: the message does not quote it.
    let r = put_raw(&node, "ok", format!(r#"{{"value": "{value}"#).as_bytes());
    assert_hidden(&node, "bad json", &r.body, &value);
    assert_error(r.status, &r.json(), 400, "invalid_json", None);
    // 64 KiB exactly is fine.
    let r = put(&node, "big", &json!({"value": "a".repeat(64 << 10)}));
    assert_eq!(r.status, 201, "{}", r.text());
    // Nothing was made by the refusals.
    let v = node.get("/v1/secrets", &[]).json();
    assert_eq!(v["data"].as_array().unwrap().len(), 1, "{v}");
    let r = node.get("/v1/secrets/Bad_Name", &[]);
    assert_error(r.status, &r.json(), 400, "invalid_name", Some("name"));
    let r = node.get("/v1/secrets/missing", &[]);
    assert_error(r.status, &r.json(), 404, "secret_not_found", Some("name"));
}

#[test]
fn image_pull_secret_is_checked_against_the_secret() {
    let node = TestNode::start();
    let run = |image: &str, secret: &str| {
        node.run(&json!({"command": "true", "image": image, "image_pull_secret": secret}))
    };
    let (s, v) = run("ghcr.io/org/app:1", "missing");
    assert_error(s, &v, 404, "secret_not_found", Some("image_pull_secret"));

    let pass = unique("pw");
    let r = put(
        &node,
        "scoped",
        &json!({"value": format!("user:{pass}"), "allowed_hosts": ["registry.example.com", "*.corp.example"]}),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let (s, v) = run("ghcr.io/org/app:1", "scoped");
    assert_error(
        s,
        &v,
        403,
        "secret_host_not_allowed",
        Some("image_pull_secret"),
    );
    assert_eq!(
        v["allowed_hosts"],
        json!(["registry.example.com", "*.corp.example"]),
        "where it may go, beside error: {v}"
    );
    assert_hidden(&node, "403", v.to_string().as_bytes(), &pass);
    // No host: docker.io, which the list does not cover.
    let (s, v) = run("python:3.12", "scoped");
    assert_error(
        s,
        &v,
        403,
        "secret_host_not_allowed",
        Some("image_pull_secret"),
    );
    // The apex of a wildcard is not one of its subdomains.
    let (s, v) = run("corp.example/app:1", "scoped");
    assert_error(
        s,
        &v,
        403,
        "secret_host_not_allowed",
        Some("image_pull_secret"),
    );

    for (i, bad) in ["no-colon", ":nouser", "user:", "user:pä"]
        .iter()
        .enumerate()
    {
        let name = format!("bad-{i}");
        let r = put(&node, &name, &json!({"value": bad}));
        assert_eq!(r.status, 201, "{}", r.text());
        let (s, v) = run("ghcr.io/org/app:1", &name);
        assert_error(s, &v, 400, "invalid_field", Some("image_pull_secret"));
        assert!(!v.to_string().contains(bad), "{v}");
    }

    // A good pair to a registry that is not there (a closed port on loopback): the run fails,
    // and neither its answer nor the log has the password.
    let r = put(
        &node,
        "loopback",
        &json!({"value": format!("user:{pass}"), "allowed_hosts": ["127.0.0.1"]}),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let r = node.run_with(
        &json!({"command": "true", "image": format!("127.0.0.1:{closed}/org/app:1"), "image_pull_secret": "loopback"}),
        &[],
    );
    assert_ne!(r.status, 200, "{}", r.text());
    std::thread::sleep(Duration::from_millis(200));
    assert_hidden(&node, "failed pull", &r.body, &pass);
}

#[test]
fn secret_env_of_a_kept_sandbox_is_sealed_at_rest() {
    let mut node = TestNode::start();
    let value = unique("env-secret");
    let sb = node.create_sandbox(&json!({"secret_env": {"TOK": value}}));
    let id = sb["id"].as_str().unwrap().to_string();
    assert!(
        !contains(&state_bytes(&node), &value),
        "a secret_env value in clear in state.db"
    );
    // Killed and started again: the node adopts the sandbox, and its spec opens.
    node.kill();
    node.restart();
    let r = node.get(&format!("/v1/sandboxes/{id}"), &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["status"], "running", "{}", r.text());
    // Its hex, so that neither the command nor its output holds the value.
    let e = node.exec(
        &id,
        &json!({"command": "printf %s \"$TOK\" | od -An -tx1 | tr -d ' \\n'"}),
    );
    let done = node.exec_wait(&id, e["id"].as_str().unwrap(), Duration::from_secs(30));
    assert_eq!(done["exit_code"], 0, "{done}");
    let hex: String = value.bytes().map(|b| format!("{b:02x}")).collect();
    assert_eq!(done["stdout"], hex, "{done}");
    assert!(!node.log_text().contains(&value));
    node.delete_sandbox(&id);
}
