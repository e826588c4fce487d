//! Long-lived sandboxes (`/v1/sandboxes`): create, get, list, delete, restart, expiry;
//! idempotency keys; stop signals; nothing left after many cycles. Their commands: commands.rs.

use std::time::{Duration, Instant};

use crate::common::{
    self, assert_error, assert_refused, create_with, exec_req, get_json, is_id, kv, unique,
    TestNode,
};
use sbx_api::{Command, Encoding, ExecRequest, ExecStatus, Limits, SandboxStatus, SecretEnv, Stop};
use sbx_client::{Client, Field, Sandbox, SandboxQuery};
use serde_json::{json, Value};

pub(crate) const CLEAN: Duration = Duration::from_secs(10);

/// The query of the sandboxes in `status` (any if `None`) with the metadata `meta`.
fn query(status: Option<&str>, meta: &[(&str, &str)]) -> SandboxQuery {
    SandboxQuery {
        status: status.map(str::to_string),
        metadata: kv(meta),
        ..SandboxQuery::default()
    }
}

/// Every sandbox of `q`, walking pages of `limit` with `next_cursor`.
fn list_all(c: &Client, q: &SandboxQuery, limit: u32) -> Vec<Sandbox> {
    let mut q = SandboxQuery {
        limit: Some(limit),
        ..q.clone()
    };
    let mut out = Vec::new();
    for _ in 0..1000 {
        let page = c.sandboxes(&q).unwrap_or_else(|e| panic!("{q:?}: {e}"));
        assert_eq!(page.object, "list", "{page:?}");
        assert!(
            page.data.len() <= limit as usize,
            "{q:?}: more than {limit}: {page:?}"
        );
        out.extend(page.data);
        if page.has_more == Some(true) {
            let Field::Value(next) = page.next_cursor else {
                panic!("has_more without next_cursor: {:?}", page.next_cursor);
            };
            q.cursor = Some(next);
        } else {
            assert_eq!(
                page.next_cursor,
                Field::Null,
                "next_cursor without has_more"
            );
            return out;
        }
    }
    panic!("the list of {q:?} did not end in 1000 pages")
}

/// Every sandbox of the node, pages of 100.
fn list_every(c: &Client) -> Vec<Sandbox> {
    list_all(c, &SandboxQuery::default(), 100)
}

fn ids(list: &[Sandbox]) -> Vec<String> {
    list.iter().map(|s| s.id.clone()).collect()
}

/// An answer, as the client writes it back (the JSON the node sent), holds no `secret`.
fn assert_no_secret(what: &str, answer: &impl serde::Serialize, secret: &str) {
    let text = serde_json::to_string(answer).expect("an answer as JSON");
    assert!(
        !text.contains(secret),
        "{what}: a secret_env value is in the answer: {text}"
    );
}

/// A not-found refusal of a call about a sandbox that is gone.
fn assert_gone<T: std::fmt::Debug>(r: Result<T, sbx_client::Error>) {
    assert_refused(r, 404, "sandbox_not_found", None);
}

#[test]
fn create_get_list_and_delete() {
    let node = TestNode::start();
    let c = node.client();
    let secret = unique("secretvalue");
    let name_a = unique("box-a");
    let name_b = unique("box-b");
    let create_a = create_with(|s| {
        s.name = Some(name_a.clone());
        s.env = kv(&[("GREETING", "hello")]);
        s.secret_env = SecretEnv(kv(&[("TOKEN", &secret)]));
        s.metadata = kv(&[("team", "red"), ("tier", "1")]);
        s.limits = Limits {
            vcpus: Some(1),
            memory_bytes: Some(256 << 20),
        };
        s.hostname = Some("box-a-host".into());
        s.cwd = Some("/tmp".into());
    });
    let a = c.create_sandbox(&create_a).expect("create a");
    assert_no_secret("create", &a, &secret);
    let id_a = a.id.clone();
    assert!(is_id("sbx", &id_a), "{a:?}");
    assert_eq!(a.object.object, "sandbox", "{a:?}");
    assert_eq!(a.name.as_deref(), Some(name_a.as_str()), "{a:?}");
    assert_eq!(a.status, SandboxStatus::Running, "{a:?}");
    assert_eq!(a.image, "base", "{a:?}");
    assert_eq!(
        (a.limits.vcpus, a.limits.memory_bytes),
        (1, 256 << 20),
        "{a:?}"
    );
    assert_eq!(a.hostname, "box-a-host", "{a:?}");
    assert_eq!(a.metadata, kv(&[("team", "red"), ("tier", "1")]), "{a:?}");
    assert_eq!(a.env, kv(&[("GREETING", "hello")]), "{a:?}");
    assert_eq!(a.secret_env, ["TOKEN"], "{a:?}");
    assert!(!a.created_at.is_empty(), "{a:?}");
    assert!(a.started_at.is_some(), "{a:?}");
    assert!(a.expires_at.is_none(), "{a:?}");
    assert!(a.failure_code.is_none() && a.failure.is_none(), "{a:?}");
    assert_eq!(a.restarts, 0, "{a:?}");

    // The sandbox is what it says: its hostname, cwd, env; the secret is set, not shown.
    let v = c
        .exec(
            &id_a,
            &ExecRequest {
                env: kv(&[("WANT", &secret)]),
                wait_seconds: 20.0,
                ..exec_req(
                    "hostname; pwd; echo $GREETING; test \"$TOKEN\" = \"$WANT\" && echo secret-ok",
                )
            },
        )
        .expect("exec");
    assert_eq!(v.status, ExecStatus::Exited, "{v:?}");
    assert_eq!(v.stdout, "box-a-host\n/tmp\nhello\nsecret-ok\n", "{v:?}");

    let b = c
        .create_sandbox(&create_with(|s| {
            s.name = Some(name_b.clone());
            s.metadata = kv(&[("team", "blue")]);
        }))
        .expect("create b");
    let id_b = b.id.clone();
    let cc = c
        .create_sandbox(&create_with(|s| {
            s.metadata = kv(&[("team", "red"), ("tier", "2")]);
        }))
        .expect("create c");
    let id_c = cc.id.clone();
    assert!(cc.name.is_none(), "{cc:?}");
    assert_eq!(cc.hostname, id_c, "the default hostname is the id: {cc:?}");
    assert!(cc.secret_env.is_empty(), "{cc:?}");

    // Get by id and by name.
    for key in [id_a.as_str(), name_a.as_str()] {
        let v = c.sandbox(key).unwrap_or_else(|e| panic!("get {key}: {e}"));
        assert_no_secret("get", &v, &secret);
        assert_eq!(v.id, id_a, "{v:?}");
        assert_eq!(v, a, "get {key} is not the created object");
    }
    assert_eq!(c.sandbox(&name_b).expect("get b").id, id_b);

    // A name is taken while its sandbox lives.
    assert_refused(
        c.create_sandbox(&create_with(|s| s.name = Some(name_a.clone()))),
        409,
        "name_taken",
        Some("name"),
    );

    // Lists: everything, by status, by metadata.
    let all = c.sandboxes(&SandboxQuery::default()).expect("list");
    assert_no_secret("list", &all, &secret);
    assert_eq!(all.object, "list");
    assert_eq!(all.has_more, Some(false));
    assert_eq!(all.next_cursor, Field::Null, "{all:?}");
    let want = vec![id_a.clone(), id_b.clone(), id_c.clone()];
    assert_eq!(ids(&all.data), want, "oldest first");
    // ... without its token, which only POST and GET of the sandbox show.
    assert!(
        a.token.get().is_some_and(|t| t.starts_with("sbt_")),
        "{a:?}"
    );
    let a_listed = Sandbox {
        token: Field::Absent,
        ..a.clone()
    };
    assert_eq!(all.data[0], a_listed, "a listed sandbox is its object");
    assert!(
        !serde_json::to_string(&all).expect("json").contains("sbt_"),
        "a list shows no token: {all:?}"
    );
    let running = query(Some("running"), &[]);
    assert_eq!(ids(&list_all(&c, &running, 100)), want);
    assert!(list_all(&c, &query(Some("failed"), &[]), 100).is_empty());
    assert!(list_all(&c, &query(Some("stopping"), &[]), 100).is_empty());
    let red = query(None, &[("team", "red")]);
    assert_eq!(
        ids(&list_all(&c, &red, 100)),
        vec![id_a.clone(), id_c.clone()]
    );
    assert_eq!(
        ids(&list_all(
            &c,
            &query(None, &[("team", "red"), ("tier", "2")]),
            100
        )),
        vec![id_c.clone()]
    );
    assert_eq!(
        ids(&list_all(
            &c,
            &query(Some("running"), &[("team", "blue")]),
            100
        )),
        vec![id_b.clone()]
    );
    assert!(list_all(&c, &query(None, &[("team", "green")]), 100).is_empty());
    assert!(list_all(&c, &query(None, &[("nokey", "red")]), 100).is_empty());
    // Pages of one walk them all, each once.
    assert_eq!(ids(&list_all(&c, &SandboxQuery::default(), 1)), want);
    assert_eq!(ids(&list_all(&c, &SandboxQuery::default(), 2)), want);
    assert_eq!(
        ids(&list_all(&c, &red, 1)),
        vec![id_a.clone(), id_c.clone()]
    );
    let page = c
        .sandboxes(&SandboxQuery {
            limit: Some(1),
            ..SandboxQuery::default()
        })
        .expect("a page of one");
    assert_eq!(page.has_more, Some(true), "{page:?}");
    assert!(page.next_cursor.get().is_some(), "{page:?}");
    // A parameter the list does not take (the wire: no client sends it).
    let (status, v) = get_json(&node, "/v1/sandboxes?bogus=1");
    assert_error(status, &v, 400, "unknown_parameter", Some("bogus"));
    // sleeping is a status (none sleeps here); a word that is none is refused.
    let sleeping = c
        .sandboxes(&query(Some("sleeping"), &[]))
        .expect("sleeping ones");
    assert!(sleeping.data.is_empty(), "{sleeping:?}");
    assert_refused(
        c.sandboxes(&query(Some("asleep"), &[])),
        400,
        "invalid_field",
        Some("status"),
    );
    assert_refused(
        c.sandboxes(&SandboxQuery {
            limit: Some(0),
            ..SandboxQuery::default()
        }),
        400,
        "invalid_field",
        Some("limit"),
    );

    // Delete: the object with status deleted, then 404 by id and by name.
    let v = c.delete_sandbox(&id_a).expect("delete a");
    assert_no_secret("delete", &v, &secret);
    assert_eq!(v.status, SandboxStatus::Deleted, "{v:?}");
    assert_eq!(v.id, id_a, "{v:?}");
    assert_eq!(v.secret_env, ["TOKEN"], "{v:?}");
    for key in [id_a.as_str(), name_a.as_str()] {
        assert_gone(c.sandbox(key));
    }
    assert_gone(c.delete_sandbox(&id_a));
    assert!(
        node.traces_of(&id_a).is_empty(),
        "left of {id_a}: {:?}",
        node.traces_of(&id_a)
    );
    assert_eq!(ids(&list_every(&c)), vec![id_b.clone(), id_c.clone()]);

    // The name is free again once its sandbox is gone.
    let again = c
        .create_sandbox(&create_with(|s| s.name = Some(name_a.clone())))
        .expect("create a again");
    assert_ne!(again.id, id_a);
    assert_eq!(c.sandbox(&name_a).expect("get by name").id, again.id);

    for id in [&id_b, &id_c, &again.id] {
        let v = c.delete_sandbox(id).expect("delete");
        assert_eq!(v.status, SandboxStatus::Deleted, "{v:?}");
        assert_gone(c.sandbox(id));
    }
    assert!(list_every(&c).is_empty(), "rows are left");
    node.assert_clean(CLEAN);
}

#[test]
fn idempotent_creates_make_one_sandbox() {
    // Idempotency-Key replays are the wire's: the requests are sent as they are.
    let node = TestNode::start();
    let c = node.client();
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
        ids(&list_all(&c, &query(None, &[("key", &key1)]), 100)),
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
    let in_key = list_all(&c, &query(None, &[("key", &key2)]), 100);
    assert_eq!(ids(&in_key), vec![id2.clone()], "one sandbox for the key");
    assert_eq!(ids(&list_every(&c)), vec![id1.clone(), id2.clone()]);
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
    let execs = c.execs(&id1).expect("the commands");
    assert_eq!(execs.data.len(), 2, "one command per key: {execs:?}");

    c.delete_sandbox(&id1).expect("delete");
    c.delete_sandbox(&id2).expect("delete");
    assert!(list_every(&c).is_empty());
    node.assert_clean(CLEAN);
}

#[test]
fn delete_stops_the_start_command_with_its_signal_then_grace() {
    let node = TestNode::start();
    let c = node.client();
    // A start command that takes SIGTERM, writes a marker, and keeps running.
    let stubborn = c
        .create_sandbox(&create_with(|s| {
            s.start_command = Some(Command::Shell(
                "trap 'echo got-term; touch /tmp/got-term' TERM; while true; do sleep 0.05; done"
                    .into(),
            ));
            s.stop = Some(Stop {
                signal: Some("SIGTERM".into()),
                grace_ms: Some(1500),
            });
        }))
        .expect("create");
    let id = stubborn.id.clone();
    let start = c
        .exec_object(&id, "exe-start", 0.0, Encoding::Utf8)
        .expect("exe-start");
    assert_eq!(start.status, ExecStatus::Running, "{start:?}");
    let marker = node.sandbox_dir(&id).join("upper/tmp/got-term");
    assert!(!marker.exists());
    let (took, seen) = std::thread::scope(|s| {
        let deleting = s.spawn(|| {
            let t = Instant::now();
            c.delete_sandbox(&id).expect("delete");
            t.elapsed()
        });
        let mut seen = false;
        let mut answers = Vec::new();
        // Answered, or not found once it is gone; anything else is kept.
        let mut keep = |r: Result<(), sbx_client::Error>| match r {
            Ok(()) => {}
            Err(e) if e.node().is_some_and(|n| n.status == 404) => {}
            Err(e) => answers.push(e.to_string()),
        };
        while !deleting.is_finished() {
            seen |= marker.exists();
            // The sandbox and its commands answer while it stops.
            keep(
                c.exec_object(&id, "exe-start", 0.0, Encoding::Utf8)
                    .map(drop),
            );
            keep(c.sandbox(&id).map(drop));
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(answers.is_empty(), "answers while stopping: {answers:?}");
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
    assert_gone(c.sandbox(&id));

    // A start command that ends on SIGTERM: the delete does not wait for the grace.
    let polite = c
        .create_sandbox(&create_with(|s| {
            s.start_command = Some(Command::Shell(
                "trap 'exit 0' TERM; while true; do sleep 0.05; done".into(),
            ));
            s.stop = Some(Stop {
                signal: None,
                grace_ms: Some(8000),
            });
        }))
        .expect("create");
    let t = Instant::now();
    c.delete_sandbox(&polite.id).expect("delete");
    let took = t.elapsed();
    assert!(took < Duration::from_secs(1), "the delete took {took:?}");

    // Another stop signal: only it makes the command end in time.
    let usr1 = c
        .create_sandbox(&create_with(|s| {
            s.start_command = Some(Command::Shell(
                "trap 'exit 0' USR1; trap '' TERM; while true; do sleep 0.05; done".into(),
            ));
            s.stop = Some(Stop {
                signal: Some("USR1".into()),
                grace_ms: Some(8000),
            });
        }))
        .expect("create");
    let t = Instant::now();
    c.delete_sandbox(&usr1.id).expect("delete");
    let took = t.elapsed();
    assert!(took < Duration::from_secs(1), "the delete took {took:?}");
    node.assert_clean(CLEAN);
}

/// A create whose start command is `line`, stopped with a grace of `grace_ms`.
fn started(line: &str, grace_ms: u32) -> sbx_api::SandboxCreate {
    create_with(|s| {
        s.start_command = Some(Command::Shell(line.into()));
        s.stop = Some(Stop {
            signal: None,
            grace_ms: Some(grace_ms),
        });
    })
}

/// A command that waits up to 20 s for its end.
fn waited(line: &str) -> ExecRequest {
    ExecRequest {
        wait_seconds: 20.0,
        ..exec_req(line)
    }
}

#[test]
fn restart_boots_again_over_the_same_disk() {
    let node = TestNode::start();
    let c = node.client();
    let sb = c
        .create_sandbox(&started(
            "echo boot >> /var/tmp/boots; exec sleep 1000",
            500,
        ))
        .expect("create");
    let id = sb.id.clone();
    let before = c
        .exec_object(&id, "exe-start", 0.0, Encoding::Utf8)
        .expect("exe-start");
    assert_eq!(before.status, ExecStatus::Running, "{before:?}");
    let v = c
        .exec(
            &id,
            &waited("echo kept > /root/file; sleep 0.2; cat /var/tmp/boots"),
        )
        .expect("exec");
    assert_eq!(v.stdout, "boot\n", "{v:?}");
    let before_exec = v.id.clone();
    let running = c.exec(&id, &exec_req("sleep 100")).expect("exec").id;

    let v = c.restart_sandbox(&id).expect("restart");
    assert_eq!(v.id, id, "{v:?}");
    assert_eq!(v.status, SandboxStatus::Running, "{v:?}");
    assert_eq!(v.restarts, 1, "{v:?}");
    assert_eq!(c.sandbox(&id).expect("get").restarts, 1);

    // The start command ran again: a new exe-start.
    let after = c
        .exec_object(&id, "exe-start", 0.0, Encoding::Utf8)
        .expect("exe-start");
    assert_eq!(after.status, ExecStatus::Running, "{after:?}");
    assert!(
        after.started_at != before.started_at || after.pid != before.pid,
        "exe-start is the old one: {before:?} / {after:?}"
    );
    // Same disk: what was written is there, and the start command wrote again.
    let v = c
        .exec(&id, &waited("cat /root/file /var/tmp/boots"))
        .expect("exec");
    assert_eq!(v.stdout, "kept\nboot\nboot\n", "{v:?}");
    // The commands of the first boot ended with it and keep their final objects.
    let v = c
        .exec_object(&id, &before_exec, 0.0, Encoding::Utf8)
        .expect("a command of the first boot");
    assert_eq!(
        (v.status, v.exit_code),
        (ExecStatus::Exited, Some(0)),
        "{v:?}"
    );
    let v = c
        .exec_object(&id, &running, 0.0, Encoding::Utf8)
        .expect("a command of the first boot");
    assert_eq!(
        v.status,
        ExecStatus::Killed,
        "a command of the first boot: {v:?}"
    );
    assert_refused(
        c.write_stdin(&id, &running, b"x", false),
        409,
        "stdin_closed",
        None,
    );

    c.delete_sandbox(&id).expect("delete");
    assert_gone(c.restart_sandbox(&id));
    node.assert_clean(CLEAN);
}

#[test]
fn twenty_cycles_leave_nothing() {
    let node = TestNode::start_with(&["--warm-pool", "2"]);
    let c = node.client();
    for i in 0..20 {
        let create = if i % 2 == 0 {
            let mut c = started("exec sleep 1000", 200);
            c.spec.name = Some(format!("cycle-{i}"));
            c
        } else {
            // Not the default shape: a sandbox made for it, not a warm one.
            create_with(|s| s.limits.memory_bytes = Some(256 << 20))
        };
        let sb = c.create_sandbox(&create).expect("create");
        assert_eq!(sb.status, SandboxStatus::Running, "cycle {i}: {sb:?}");
        let id = sb.id.clone();
        let v = c
            .exec(&id, &waited("echo hi; echo x > /tmp/f"))
            .expect("exec");
        assert_eq!(v.stdout, "hi\n", "cycle {i}: {v:?}");
        c.exec(&id, &exec_req("sleep 60")).expect("exec");
        c.delete_sandbox(&id).expect("delete");
        assert!(
            node.traces_of(&id).is_empty(),
            "cycle {i}: left of {id}: {:?}",
            node.traces_of(&id)
        );
    }
    assert!(list_every(&c).is_empty(), "rows are left");
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
    let c = node.client();
    let t = Instant::now();
    let at = common::rfc3339_in(Duration::from_secs(2));
    let mut create = started("exec sleep 1000", 500);
    create.spec.expires_at = Some(at.clone());
    let sb = c.create_sandbox(&create).expect("create");
    let id = sb.id.clone();
    assert_eq!(sb.expires_at.as_deref(), Some(at.as_str()), "{sb:?}");
    let v = c.sandbox(&id).expect("get");
    assert_eq!(v.status, SandboxStatus::Running, "{v:?}");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match c.sandbox(&id) {
            Err(e) if e.node().is_some_and(|n| n.status == 404) => {
                assert_gone(Err::<(), _>(e));
                break;
            }
            v => assert!(
                Instant::now() < deadline,
                "not deleted at its expiry: {v:?}"
            ),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        t.elapsed() >= Duration::from_millis(1500),
        "deleted {:?} after its create, before it expired",
        t.elapsed()
    );
    assert!(list_every(&c).is_empty());
    node.assert_clean(CLEAN);
}
