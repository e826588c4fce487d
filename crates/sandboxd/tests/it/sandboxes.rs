//! Long-lived sandboxes (`/v1/sandboxes`): create, get, list, delete, restart, expiry;
//! idempotency keys; stop signals; nothing left after many cycles. Their commands: commands.rs.

use std::time::{Duration, Instant};

use crate::common::{self, assert_error, get_json, is_id, unique, TestNode};
use serde_json::{json, Value};

pub(crate) const CLEAN: Duration = Duration::from_secs(10);

/// Every sandbox of `GET /v1/sandboxes?query`, walking pages of `limit` with `next_cursor`.
fn list_all(node: &TestNode, query: &str, limit: usize) -> Vec<Value> {
    let mut out = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..1000 {
        let mut path = format!("/v1/sandboxes?limit={limit}");
        if !query.is_empty() {
            path.push('&');
            path.push_str(query);
        }
        if let Some(c) = &cursor {
            path.push_str(&format!("&cursor={c}"));
        }
        let (status, v) = get_json(node, &path);
        assert_eq!(status, 200, "{path}: {v}");
        assert_eq!(v["object"], "list", "{v}");
        let data = v["data"].as_array().expect("data");
        assert!(data.len() <= limit, "{path}: more than {limit}: {v}");
        out.extend(data.iter().cloned());
        if v["has_more"] == true {
            let next = v["next_cursor"]
                .as_str()
                .expect("next_cursor with has_more");
            cursor = Some(next.to_string());
        } else {
            assert!(
                v["next_cursor"].is_null(),
                "next_cursor without has_more: {v}"
            );
            return out;
        }
    }
    panic!("the list of {query} did not end in 1000 pages")
}

fn ids(list: &[Value]) -> Vec<String> {
    list.iter()
        .map(|s| s["id"].as_str().expect("id").to_string())
        .collect()
}

fn assert_no_secret(what: &str, body: &[u8], secret: &str) {
    let text = String::from_utf8_lossy(body);
    assert!(
        !text.contains(secret),
        "{what}: a secret_env value is in the answer: {text}"
    );
}

#[test]
fn create_get_list_and_delete() {
    let node = TestNode::start();
    let secret = unique("secretvalue");
    let name_a = unique("box-a");
    let name_b = unique("box-b");
    let body_a = json!({
        "name": name_a,
        "env": {"GREETING": "hello"},
        "secret_env": {"TOKEN": secret},
        "metadata": {"team": "red", "tier": "1"},
        "limits": {"vcpus": 1, "memory_bytes": 256u64 << 20},
        "hostname": "box-a-host",
        "cwd": "/tmp",
    });
    let r = node.post_json("/v1/sandboxes", &body_a);
    assert_no_secret("create", &r.body, &secret);
    let a = r.json();
    assert_eq!(r.status, 201, "create: {a}");
    let id_a = a["id"].as_str().expect("id").to_string();
    assert!(is_id("sbx", &id_a), "{a}");
    assert_eq!(a["object"], "sandbox", "{a}");
    assert_eq!(a["name"], name_a.as_str(), "{a}");
    assert_eq!(a["status"], "running", "{a}");
    assert_eq!(a["image"], "base", "{a}");
    assert_eq!(
        a["limits"],
        json!({"vcpus": 1, "memory_bytes": 256u64 << 20}),
        "{a}"
    );
    assert_eq!(a["hostname"], "box-a-host", "{a}");
    assert_eq!(a["metadata"], json!({"team": "red", "tier": "1"}), "{a}");
    assert_eq!(a["env"], json!({"GREETING": "hello"}), "{a}");
    assert_eq!(a["secret_env"], json!(["TOKEN"]), "{a}");
    assert!(a["created_at"].is_string(), "{a}");
    assert!(a["started_at"].is_string(), "{a}");
    assert!(a["expires_at"].is_null(), "{a}");
    assert!(a["failure_code"].is_null() && a["failure"].is_null(), "{a}");
    assert_eq!(a["restarts"], 0, "{a}");

    // The sandbox is what it says: its hostname, cwd, env; the secret is set, not shown.
    let r = node.post_json(
        &format!("/v1/sandboxes/{id_a}/exec"),
        &json!({
            "command": "hostname; pwd; echo $GREETING; test \"$TOKEN\" = \"$WANT\" && echo secret-ok",
            "env": {"WANT": secret},
            "wait_seconds": 20,
        }),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let v = r.json();
    assert_eq!(v["status"], "exited", "{v}");
    assert_eq!(v["stdout"], "box-a-host\n/tmp\nhello\nsecret-ok\n", "{v}");

    let b = node.create_sandbox(&json!({"name": name_b, "metadata": {"team": "blue"}}));
    let id_b = b["id"].as_str().unwrap().to_string();
    let c = node.create_sandbox(&json!({"metadata": {"team": "red", "tier": "2"}}));
    let id_c = c["id"].as_str().unwrap().to_string();
    assert!(c["name"].is_null(), "{c}");
    assert_eq!(
        c["hostname"],
        id_c.as_str(),
        "the default hostname is the id: {c}"
    );
    assert_eq!(c["secret_env"], json!([]), "{c}");

    // Get by id and by name.
    for key in [id_a.as_str(), name_a.as_str()] {
        let r = node.get(&format!("/v1/sandboxes/{key}"), &[]);
        assert_no_secret("get", &r.body, &secret);
        assert_eq!(r.status, 200, "get {key}: {}", r.text());
        let v = r.json();
        assert_eq!(v["id"], id_a.as_str(), "{v}");
        assert_eq!(v, a, "get {key} is not the created object");
    }
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{name_b}"));
    assert_eq!(
        (status, v["id"].as_str()),
        (200, Some(id_b.as_str())),
        "{v}"
    );

    // A name is taken while its sandbox lives.
    let r = node.post_json("/v1/sandboxes", &json!({"name": name_a}));
    assert_error(r.status, &r.json(), 409, "name_taken", Some("name"));

    // Lists: everything, by status, by metadata.
    let r = node.get("/v1/sandboxes", &[]);
    assert_no_secret("list", &r.body, &secret);
    let all = r.json();
    assert_eq!(r.status, 200, "{all}");
    assert_eq!(all["object"], "list");
    assert_eq!(all["has_more"], false);
    assert!(all["next_cursor"].is_null(), "{all}");
    let want = vec![id_a.clone(), id_b.clone(), id_c.clone()];
    assert_eq!(ids(all["data"].as_array().unwrap()), want, "oldest first");
    // ... without its token, which only POST and GET of the sandbox show.
    let mut a_listed = a.clone();
    let token = a_listed
        .as_object_mut()
        .and_then(|o| o.remove("token"))
        .expect("a sandbox's token");
    assert!(token.as_str().is_some_and(|t| t.starts_with("sbt_")), "{a}");
    assert_eq!(all["data"][0], a_listed, "a listed sandbox is its object");
    assert!(!r.text().contains("sbt_"), "a list shows no token: {all}");
    assert_eq!(ids(&list_all(&node, "status=running", 100)), want);
    assert!(list_all(&node, "status=failed", 100).is_empty());
    assert!(list_all(&node, "status=stopping", 100).is_empty());
    assert_eq!(
        ids(&list_all(&node, "metadata.team=red", 100)),
        vec![id_a.clone(), id_c.clone()]
    );
    assert_eq!(
        ids(&list_all(&node, "metadata.team=red&metadata.tier=2", 100)),
        vec![id_c.clone()]
    );
    assert_eq!(
        ids(&list_all(&node, "metadata.team=blue&status=running", 100)),
        vec![id_b.clone()]
    );
    assert!(list_all(&node, "metadata.team=green", 100).is_empty());
    assert!(list_all(&node, "metadata.nokey=red", 100).is_empty());
    // Pages of one walk them all, each once.
    assert_eq!(ids(&list_all(&node, "", 1)), want);
    assert_eq!(ids(&list_all(&node, "", 2)), want);
    assert_eq!(
        ids(&list_all(&node, "metadata.team=red", 1)),
        vec![id_a.clone(), id_c.clone()]
    );
    let (status, v) = get_json(&node, "/v1/sandboxes?limit=1");
    assert_eq!(status, 200);
    assert_eq!(v["has_more"], true, "{v}");
    assert!(v["next_cursor"].is_string(), "{v}");
    let (status, v) = get_json(&node, "/v1/sandboxes?bogus=1");
    assert_error(status, &v, 400, "unknown_parameter", Some("bogus"));
    // sleeping is a status (none sleeps here); a word that is none is refused.
    let (status, v) = get_json(&node, "/v1/sandboxes?status=sleeping");
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["data"], json!([]), "{v}");
    let (status, v) = get_json(&node, "/v1/sandboxes?status=asleep");
    assert_error(status, &v, 400, "invalid_field", Some("status"));
    let (status, v) = get_json(&node, "/v1/sandboxes?limit=0");
    assert_error(status, &v, 400, "invalid_field", Some("limit"));

    // Delete: the object with status deleted, then 404 by id and by name.
    let r = node.delete(&format!("/v1/sandboxes/{id_a}"), &[]);
    assert_no_secret("delete", &r.body, &secret);
    let v = r.json();
    assert_eq!(r.status, 200, "{v}");
    assert_eq!(v["status"], "deleted", "{v}");
    assert_eq!(v["id"], id_a.as_str(), "{v}");
    assert_eq!(v["secret_env"], json!(["TOKEN"]), "{v}");
    for key in [id_a.as_str(), name_a.as_str()] {
        let (status, v) = get_json(&node, &format!("/v1/sandboxes/{key}"));
        assert_error(status, &v, 404, "sandbox_not_found", None);
    }
    let r = node.delete(&format!("/v1/sandboxes/{id_a}"), &[]);
    assert_error(r.status, &r.json(), 404, "sandbox_not_found", None);
    assert!(
        node.traces_of(&id_a).is_empty(),
        "left of {id_a}: {:?}",
        node.traces_of(&id_a)
    );
    assert_eq!(
        ids(&list_all(&node, "", 100)),
        vec![id_b.clone(), id_c.clone()]
    );

    // The name is free again once its sandbox is gone.
    let again = node.create_sandbox(&json!({"name": name_a}));
    let id_again = again["id"].as_str().unwrap().to_string();
    assert_ne!(id_again, id_a);
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{name_a}"));
    assert_eq!((status, v["id"].as_str()), (200, Some(id_again.as_str())));

    for id in [&id_b, &id_c, &id_again] {
        node.delete_sandbox(id);
        let (status, v) = get_json(&node, &format!("/v1/sandboxes/{id}"));
        assert_error(status, &v, 404, "sandbox_not_found", None);
    }
    assert!(list_all(&node, "", 100).is_empty(), "rows are left");
    node.assert_clean(CLEAN);
}

#[test]
fn idempotent_creates_make_one_sandbox() {
    let node = TestNode::start();
    let create = |key: &str, body: &Value| {
        node.post(
            "/v1/sandboxes",
            &[("Idempotency-Key", key)],
            &serde_json::to_vec(body).unwrap(),
        )
    };

    // Sequential: the same answer twice.
    let key1 = unique("key-seq");
    let name1 = unique("keyed");
    let body1 = json!({"name": name1, "metadata": {"key": key1}, "env": {"A": "1"}});
    let r1 = create(&key1, &body1);
    let v1 = r1.json();
    assert_eq!(r1.status, 201, "{v1}");
    let id1 = v1["id"].as_str().unwrap().to_string();
    let r2 = create(&key1, &body1);
    let v2 = r2.json();
    assert_eq!(r2.status, 201, "the replay: {v2}");
    assert_eq!(
        v2["id"],
        id1.as_str(),
        "the replay made another sandbox: {v2}"
    );
    assert_eq!(v2, v1, "the replay is not the first answer");
    // Another body with the key.
    let r = create(
        &key1,
        &json!({"metadata": {"key": key1}, "env": {"A": "2"}}),
    );
    assert_error(
        r.status,
        &r.json(),
        409,
        "idempotency_key_reused",
        Some("Idempotency-Key"),
    );
    assert_eq!(
        ids(&list_all(&node, &format!("metadata.key={key1}"), 100)),
        vec![id1.clone()]
    );

    // Concurrent: 8 callers with one key and one body.
    let key2 = unique("key-par");
    let body2 = json!({"metadata": {"key": key2}});
    let answers: Vec<(u16, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                s.spawn(|| {
                    let deadline = Instant::now() + Duration::from_secs(30);
                    let mut seen = Vec::new();
                    loop {
                        let r = create(&key2, &body2);
                        let v = r.json();
                        if r.status == 409 && v["error"]["code"] == "idempotency_in_progress" {
                            assert_eq!(v["error"]["retryable"], true, "{v}");
                            seen.push((r.status, v));
                            assert!(Instant::now() < deadline, "still in progress");
                            std::thread::sleep(Duration::from_millis(50));
                            continue;
                        }
                        seen.push((r.status, v));
                        return seen;
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    let mut made = None;
    for (status, v) in &answers {
        match status {
            201 => {
                let id = v["id"].as_str().unwrap().to_string();
                match &made {
                    None => made = Some(id),
                    Some(m) => assert_eq!(&id, m, "two sandboxes for one key: {answers:?}"),
                }
            }
            409 => assert_error(
                *status,
                v,
                409,
                "idempotency_in_progress",
                Some("Idempotency-Key"),
            ),
            _ => panic!("answer {status}: {v}"),
        }
    }
    let id2 = made.expect("no 201");
    let in_key = list_all(&node, &format!("metadata.key={key2}"), 100);
    assert_eq!(ids(&in_key), vec![id2.clone()], "one sandbox for the key");
    assert_eq!(
        ids(&list_all(&node, "", 100)),
        vec![id1.clone(), id2.clone()]
    );
    let r = create(
        &key2,
        &json!({"metadata": {"key": key2}, "name": unique("other")}),
    );
    assert_error(
        r.status,
        &r.json(),
        409,
        "idempotency_key_reused",
        Some("Idempotency-Key"),
    );

    // An exec with a key: its id is derived from the key; a retry is the same command.
    let exec_key = unique("key-exec");
    let exec_body = json!({"command": "echo ran >> /tmp/runs; cat /tmp/runs", "wait_seconds": 20});
    let exec = |sb: &str| {
        let r = node.post(
            &format!("/v1/sandboxes/{sb}/exec"),
            &[("Idempotency-Key", exec_key.as_str())],
            &serde_json::to_vec(&exec_body).unwrap(),
        );
        let v = r.json();
        assert_eq!(r.status, 201, "{v}");
        v
    };
    let e1 = exec(&id1);
    let e2 = exec(&id1);
    assert_eq!(e1["id"], e2["id"], "{e1} / {e2}");
    assert!(is_id("exe", e1["id"].as_str().unwrap()), "{e1}");
    assert_eq!(e2["stdout"], "ran\n", "the command ran twice: {e2}");
    // The sandbox by its name is the same sandbox: the same command.
    let e4 = exec(&name1);
    assert_eq!(
        e4["id"], e1["id"],
        "by name, the key names another command: {e4}"
    );
    assert_eq!(e4["stdout"], "ran\n", "the command ran twice: {e4}");
    // While the first request with a key runs, a second one is told so.
    let slow_key = unique("key-slow");
    let slow_body =
        serde_json::to_vec(&json!({"command": "sleep 1.5", "wait_seconds": 20})).unwrap();
    let slow = || {
        node.post(
            &format!("/v1/sandboxes/{id1}/exec"),
            &[("Idempotency-Key", slow_key.as_str())],
            &slow_body,
        )
    };
    std::thread::scope(|s| {
        let first = s.spawn(slow);
        std::thread::sleep(Duration::from_millis(500));
        let r = slow();
        let v = r.json();
        assert_error(
            r.status,
            &v,
            409,
            "idempotency_in_progress",
            Some("Idempotency-Key"),
        );
        assert_eq!(v["error"]["retryable"], true, "{v}");
        let r = first.join().unwrap();
        assert_eq!(r.status, 201, "{}", r.text());
        let first = r.json();
        assert_eq!(first["status"], "exited", "{first}");
        // Once it answered, the key replays it.
        let r = slow();
        assert_eq!(r.status, 201);
        assert_eq!(r.json()["id"], first["id"]);
    });
    // The same key in another sandbox names another command.
    let e3 = exec(&id2);
    assert_ne!(e3["id"], e1["id"]);
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{id1}/exec"));
    assert_eq!(status, 200);
    assert_eq!(
        v["data"].as_array().unwrap().len(),
        2,
        "one command per key: {v}"
    );

    node.delete_sandbox(&id1);
    node.delete_sandbox(&id2);
    assert!(list_all(&node, "", 100).is_empty());
    node.assert_clean(CLEAN);
}

#[test]
fn delete_stops_the_start_command_with_its_signal_then_grace() {
    let node = TestNode::start();
    // A start command that takes SIGTERM, writes a marker, and keeps running.
    let stubborn = node.create_sandbox(&json!({
        "start_command": "trap 'echo got-term; touch /tmp/got-term' TERM; while true; do sleep 0.05; done",
        "stop": {"signal": "SIGTERM", "grace_ms": 1500},
    }));
    let id = stubborn["id"].as_str().unwrap().to_string();
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{id}/exec/exe-start"));
    assert_eq!(
        (status, v["status"].as_str()),
        (200, Some("running")),
        "{v}"
    );
    let marker = node.sandbox_dir(&id).join("upper/tmp/got-term");
    assert!(!marker.exists());
    let (took, seen) = std::thread::scope(|s| {
        let deleting = s.spawn(|| {
            let t = Instant::now();
            node.delete_sandbox(&id);
            t.elapsed()
        });
        let mut seen = false;
        let mut answers = Vec::new();
        while !deleting.is_finished() {
            seen |= marker.exists();
            // The sandbox and its commands answer while it stops.
            let r = node.get(&format!("/v1/sandboxes/{id}/exec/exe-start"), &[]);
            if r.status != 404 {
                answers.push((r.status, r.text()));
            }
            let r = node.get(&format!("/v1/sandboxes/{id}"), &[]);
            if r.status != 404 {
                answers.push((r.status, r.text()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            answers.iter().all(|(s, _)| *s == 200),
            "answers while stopping: {answers:?}"
        );
        (deleting.join().unwrap(), seen)
    });
    assert!(
        seen,
        "the start command did not get SIGTERM (no marker while deleting)"
    );
    assert!(
        took >= Duration::from_millis(1400) && took < Duration::from_secs(10),
        "a start command that ignores its stop signal ended after {took:?}, not its grace"
    );
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{id}"));
    assert_error(status, &v, 404, "sandbox_not_found", None);

    // A start command that ends on SIGTERM: the delete does not wait for the grace.
    let polite = node.create_sandbox(&json!({
        "start_command": "trap 'exit 0' TERM; while true; do sleep 0.05; done",
        "stop": {"grace_ms": 8000},
    }));
    let id = polite["id"].as_str().unwrap().to_string();
    let t = Instant::now();
    node.delete_sandbox(&id);
    let took = t.elapsed();
    assert!(took < Duration::from_secs(1), "the delete took {took:?}");

    // Another stop signal: only it makes the command end in time.
    let usr1 = node.create_sandbox(&json!({
        "start_command": "trap 'exit 0' USR1; trap '' TERM; while true; do sleep 0.05; done",
        "stop": {"signal": "USR1", "grace_ms": 8000},
    }));
    let id = usr1["id"].as_str().unwrap().to_string();
    let t = Instant::now();
    node.delete_sandbox(&id);
    let took = t.elapsed();
    assert!(took < Duration::from_secs(1), "the delete took {took:?}");
    node.assert_clean(CLEAN);
}

#[test]
fn restart_boots_again_over_the_same_disk() {
    let node = TestNode::start();
    let sb = node.create_sandbox(&json!({
        "start_command": "echo boot >> /var/tmp/boots; exec sleep 1000",
        "stop": {"grace_ms": 500},
    }));
    let id = sb["id"].as_str().unwrap().to_string();
    let start_path = format!("/v1/sandboxes/{id}/exec/exe-start");
    let (status, before) = get_json(&node, &start_path);
    assert_eq!(
        (status, before["status"].as_str()),
        (200, Some("running")),
        "{before}"
    );
    let v = node.exec(
        &id,
        &json!({"command": "echo kept > /root/file; sleep 0.2; cat /var/tmp/boots", "wait_seconds": 20}),
    );
    assert_eq!(v["stdout"], "boot\n", "{v}");
    let before_exec = v["id"].as_str().unwrap().to_string();
    let running = node.exec(&id, &json!({"command": "sleep 100"}));
    let running = running["id"].as_str().unwrap().to_string();

    let r = node.post(&format!("/v1/sandboxes/{id}/restart"), &[], b"");
    let v = r.json();
    assert_eq!(r.status, 200, "{v}");
    assert_eq!(v["id"], id.as_str(), "{v}");
    assert_eq!(v["status"], "running", "{v}");
    assert_eq!(v["restarts"], 1, "{v}");
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{id}"));
    assert_eq!((status, v["restarts"].as_i64()), (200, Some(1)), "{v}");

    // The start command ran again: a new exe-start.
    let (status, after) = get_json(&node, &start_path);
    assert_eq!(
        (status, after["status"].as_str()),
        (200, Some("running")),
        "{after}"
    );
    assert!(
        after["started_at"] != before["started_at"] || after["pid"] != before["pid"],
        "exe-start is the old one: {before} / {after}"
    );
    // Same disk: what was written is there, and the start command wrote again.
    let v = node.exec(
        &id,
        &json!({"command": "cat /root/file /var/tmp/boots", "wait_seconds": 20}),
    );
    assert_eq!(v["stdout"], "kept\nboot\nboot\n", "{v}");
    // The commands of the first boot ended with it and keep their final objects.
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{id}/exec/{before_exec}"));
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        (v["status"].as_str(), v["exit_code"].as_i64()),
        (Some("exited"), Some(0)),
        "{v}"
    );
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{id}/exec/{running}"));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["status"], "killed", "a command of the first boot: {v}");
    let r = node.post_json(
        &format!("/v1/sandboxes/{id}/exec/{running}/stdin"),
        &json!({"data": "x"}),
    );
    assert_error(r.status, &r.json(), 409, "stdin_closed", None);

    node.delete_sandbox(&id);
    let r = node.post(&format!("/v1/sandboxes/{id}/restart"), &[], b"");
    assert_error(r.status, &r.json(), 404, "sandbox_not_found", None);
    node.assert_clean(CLEAN);
}

#[test]
fn twenty_cycles_leave_nothing() {
    let node = TestNode::start_with(&["--warm-pool", "2"]);
    for i in 0..20 {
        let body = if i % 2 == 0 {
            json!({"name": format!("cycle-{i}"), "start_command": "exec sleep 1000", "stop": {"grace_ms": 200}})
        } else {
            // Not the default shape: a sandbox made for it, not a warm one.
            json!({"limits": {"memory_bytes": 256u64 << 20}})
        };
        let sb = node.create_sandbox(&body);
        let id = sb["id"].as_str().unwrap().to_string();
        let v = node.exec(
            &id,
            &json!({"command": "echo hi; echo x > /tmp/f", "wait_seconds": 20}),
        );
        assert_eq!(v["stdout"], "hi\n", "cycle {i}: {v}");
        node.exec(&id, &json!({"command": "sleep 60"}));
        node.delete_sandbox(&id);
        assert!(
            node.traces_of(&id).is_empty(),
            "cycle {i}: left of {id}: {:?}",
            node.traces_of(&id)
        );
    }
    assert!(list_all(&node, "", 100).is_empty(), "rows are left");
    node.assert_clean(CLEAN);
    // Nothing of them under the data directory either.
    // (Read before the pool's ids: a warm sandbox started after the read is not in it.)
    let entries: Vec<_> = std::fs::read_dir(node.data_dir.join("sandboxes"))
        .unwrap()
        .flatten()
        .collect();
    let warm = node.pool_ids();
    let left: Vec<_> = entries
        .iter()
        .filter(|e| !warm.iter().any(|w| e.file_name().to_str() == Some(w)))
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn a_sandbox_is_deleted_when_it_expires() {
    let node = TestNode::start();
    let t = Instant::now();
    let at = common::rfc3339_in(Duration::from_secs(2));
    let sb = node.create_sandbox(&json!({
        "expires_at": at,
        "start_command": "exec sleep 1000",
        "stop": {"grace_ms": 500},
    }));
    let id = sb["id"].as_str().unwrap().to_string();
    assert_eq!(sb["expires_at"], at.as_str(), "{sb}");
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{id}"));
    assert_eq!(
        (status, v["status"].as_str()),
        (200, Some("running")),
        "{v}"
    );
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (status, v) = get_json(&node, &format!("/v1/sandboxes/{id}"));
        if status == 404 {
            assert_error(status, &v, 404, "sandbox_not_found", None);
            break;
        }
        assert!(Instant::now() < deadline, "not deleted at its expiry: {v}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        t.elapsed() >= Duration::from_millis(1500),
        "deleted {:?} after its create, before it expired",
        t.elapsed()
    );
    assert!(list_all(&node, "", 100).is_empty());
    node.assert_clean(CLEAN);
}
