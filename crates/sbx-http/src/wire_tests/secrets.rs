//! Secrets: `PUT /v1/secrets/{name}`, list, get, delete. A value is write-only: no answer, log
//! line or byte of the state database holds it; the node key that seals it is `node.key`
//! (0600), and a node started again over the same data directory still opens what it sealed.
//! `image_pull_secret` of a run is checked against the secret (404, 403, 400). (`secret_env`
//! of a kept sandbox, opened again in a real sandbox: `crates/sandboxd/tests/it/secrets.rs`.)

use std::os::unix::fs::PermissionsExt;

use serde_json::{json, Value};

use super::{capture_logs, logs, unique, Answer, Wire};

async fn put(w: &Wire, name: &str, body: &Value) -> Answer {
    put_raw(w, name, body.to_string().as_bytes()).await
}

async fn put_raw(w: &Wire, name: &str, body: &[u8]) -> Answer {
    w.call("PUT", &format!("/v1/secrets/{name}"))
        .json_bytes(body)
        .send()
        .await
}

/// The bytes of every file of the state database (WAL included).
fn state_bytes(w: &Wire) -> Vec<u8> {
    let mut all = Vec::new();
    for f in ["state.db", "state.db-wal", "state.db-shm"] {
        if let Ok(b) = std::fs::read(w.dir.path().join(f)) {
            all.extend(b);
        }
    }
    all
}

fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

fn assert_hidden(what: &str, body: &[u8], value: &str) {
    assert!(
        !contains(body, value),
        "{what}: the value is in the answer: {}",
        String::from_utf8_lossy(body)
    );
    assert!(
        !logs().contains(value),
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

fn names(v: &Value) -> Vec<String> {
    v["data"]
        .as_array()
        .unwrap_or_else(|| panic!("no data: {v}"))
        .iter()
        .map(|s| s["name"].as_str().unwrap_or_default().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_get_list_delete_and_the_value_is_never_shown() {
    capture_logs();
    let w = Wire::start("secrets");
    let value = unique("s3cr3t-value");
    let name = "registry-login";

    let a = put(
        &w,
        name,
        &json!({"value": value, "allowed_hosts": ["ghcr.io", "*.example.com"]}),
    )
    .await;
    assert_hidden("put", &a.body, &value);
    let v = a.json();
    assert_eq!(a.status, 201, "{v}");
    check_object(&v, name);
    assert_eq!(
        v["allowed_hosts"],
        json!(["ghcr.io", "*.example.com"]),
        "{v}"
    );
    assert_eq!(v["created_at"], v["updated_at"], "{v}");

    let a = put(&w, "other", &json!({"value": "x"})).await;
    assert_eq!(a.status, 201, "{}", a.text());
    assert!(a.json()["allowed_hosts"].is_null(), "{}", a.text());

    let a = w.get(&format!("/v1/secrets/{name}")).await;
    assert_hidden("get", &a.body, &value);
    assert_eq!(a.status, 200, "{}", a.text());
    check_object(&a.json(), name);

    let a = w.get("/v1/secrets").await;
    assert_hidden("list", &a.body, &value);
    let v = a.json();
    assert_eq!(a.status, 200, "{v}");
    assert_eq!(v["object"], "list", "{v}");
    assert_eq!(names(&v), ["other", name], "{v}");
    for s in v["data"].as_array().expect("data") {
        check_object(s, s["name"].as_str().unwrap_or_default());
    }

    // Sealed at rest with the node key, which only the node's user reads.
    assert!(
        !contains(&state_bytes(&w), &value),
        "a value in clear in state.db"
    );
    let key = w.dir.path().join("node.key");
    let meta = std::fs::metadata(&key).expect("node.key");
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(meta.len(), 32);
    let key_bytes = std::fs::read(&key).expect("node.key");

    // A node started again over the same data directory keeps its key and opens its secrets.
    let w = w.restart().await;
    assert_eq!(
        std::fs::read(&key).expect("node.key"),
        key_bytes,
        "the key changed"
    );
    let a = w.get(&format!("/v1/secrets/{name}")).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let created = a.json()["created_at"].clone();
    // A pull that uses the secret opens it: its value is no login pair, so 400 (a value that
    // did not open would be 500).
    let v = w
        .run(&json!({
            "command": "true",
            "image": "ghcr.io/org/app:1",
            "image_pull_secret": name,
        }))
        .await
        .assert_error(400, "invalid_field", Some("image_pull_secret"));
    assert_hidden("run", v.to_string().as_bytes(), &value);

    // The same name again: replaced, 200, created_at kept.
    let value2 = unique("second-value");
    let a = put(&w, name, &json!({"value": value2})).await;
    assert_hidden("put again", &a.body, &value2);
    let v = a.json();
    assert_eq!(a.status, 200, "{v}");
    check_object(&v, name);
    assert!(v["allowed_hosts"].is_null(), "{v}");
    assert_eq!(v["created_at"], created, "{v}");
    assert!(!contains(&state_bytes(&w), &value2));

    let a = w.delete(&format!("/v1/secrets/{name}")).await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(a.json()["name"], name);
    w.get(&format!("/v1/secrets/{name}"))
        .await
        .assert_error(404, "secret_not_found", Some("name"));
    w.delete(&format!("/v1/secrets/{name}")).await.assert_error(
        404,
        "secret_not_found",
        Some("name"),
    );
    assert_eq!(names(&w.get("/v1/secrets").await.json()), ["other"]);
    let log = logs();
    assert!(!log.contains(&value) && !log.contains(&value2));
    assert!(
        log.contains("secret=registry-login"),
        "the node's log is read"
    );
    w.assert_clean(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_names_values_and_fields_are_400_with_their_param() {
    capture_logs();
    let w = Wire::start("secretsbad");
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
            json!({"value": "a".repeat((64 << 10) + 1)})
                .to_string()
                .into_bytes(),
            "invalid_field",
            "value",
        ),
        (
            "ok",
            json!({"value": value, "nope": 1}).to_string().into_bytes(),
            "unknown_field",
            "nope",
        ),
        (
            "ok",
            json!({"value": value, "allowed_hosts": "ghcr.io"})
                .to_string()
                .into_bytes(),
            "invalid_field",
            "allowed_hosts",
        ),
        (
            "ok",
            json!({"value": value, "allowed_hosts": ["ghcr.io", "https://x.io/"]})
                .to_string()
                .into_bytes(),
            "invalid_field",
            "allowed_hosts[1]",
        ),
    ];
    for (name, body, code, param) in cases {
        let a = put_raw(&w, name, &body).await;
        assert_hidden(code, &a.body, &value);
        a.assert_error(400, code, Some(param));
    }
    // Broken JSON around a value: the message does not quote it.
    let a = put_raw(&w, "ok", format!(r#"{{"value": "{value}"#).as_bytes()).await;
    assert_hidden("bad json", &a.body, &value);
    a.assert_error(400, "invalid_json", None);
    // 64 KiB exactly is fine.
    let a = put(&w, "big", &json!({"value": "a".repeat(64 << 10)})).await;
    assert_eq!(a.status, 201, "{}", a.text());
    // Nothing was made by the refusals.
    assert_eq!(names(&w.get("/v1/secrets").await.json()), ["big"]);
    w.get("/v1/secrets/Bad_Name")
        .await
        .assert_error(400, "invalid_name", Some("name"));
    w.get("/v1/secrets/missing")
        .await
        .assert_error(404, "secret_not_found", Some("name"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_pull_secret_is_checked_against_the_secret() {
    capture_logs();
    let w = Wire::start("pullsecret");
    let w = &w;
    let run = |image: &str, secret: &str| {
        let body = json!({"command": "true", "image": image, "image_pull_secret": secret});
        async move { w.run(&body).await }
    };
    run("ghcr.io/org/app:1", "missing").await.assert_error(
        404,
        "secret_not_found",
        Some("image_pull_secret"),
    );

    let pass = unique("pw");
    let a = put(
        w,
        "scoped",
        &json!({"value": format!("user:{pass}"), "allowed_hosts": ["registry.example.com", "*.corp.example"]}),
    )
    .await;
    assert_eq!(a.status, 201, "{}", a.text());
    let v = run("ghcr.io/org/app:1", "scoped").await.assert_error(
        403,
        "secret_host_not_allowed",
        Some("image_pull_secret"),
    );
    assert_eq!(
        v["allowed_hosts"],
        json!(["registry.example.com", "*.corp.example"]),
        "where it may go, beside error: {v}"
    );
    assert_hidden("403", v.to_string().as_bytes(), &pass);
    // No host: docker.io, which the list does not cover.
    run("python:3.12", "scoped").await.assert_error(
        403,
        "secret_host_not_allowed",
        Some("image_pull_secret"),
    );
    // The apex of a wildcard is not one of its subdomains.
    run("corp.example/app:1", "scoped").await.assert_error(
        403,
        "secret_host_not_allowed",
        Some("image_pull_secret"),
    );

    for (i, bad) in ["no-colon", ":nouser", "user:", "user:pä"]
        .iter()
        .enumerate()
    {
        let name = format!("bad-{i}");
        let a = put(w, &name, &json!({"value": bad})).await;
        assert_eq!(a.status, 201, "{}", a.text());
        let v = run("ghcr.io/org/app:1", &name).await.assert_error(
            400,
            "invalid_field",
            Some("image_pull_secret"),
        );
        assert!(!v.to_string().contains(bad), "{v}");
    }
    w.assert_clean(false).await;

    // A good pair to a registry that is not there (a closed port on loopback): the run fails,
    // and neither its answer nor the log has the password.
    let a = put(
        w,
        "loopback",
        &json!({"value": format!("user:{pass}"), "allowed_hosts": ["127.0.0.1"]}),
    )
    .await;
    assert_eq!(a.status, 201, "{}", a.text());
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let a = run(&format!("127.0.0.1:{closed}/org/app:1"), "loopback").await;
    assert_ne!(a.status, 200, "{}", a.text());
    // What the failed pull logs after its answer, too.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert_hidden("failed pull", &a.body, &pass);
    // (The log read is the node's: it has the secret's write and the failed pull.)
    let log = logs();
    assert!(log.contains("secret=loopback") && log.contains("pull failed"));
    w.assert_clean(false).await;
}
