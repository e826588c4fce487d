//! A kept sandbox's commands: exec, wait, output (JSON and events, ranges, resumes), stdin,
//! the per-sandbox cap, the list of commands.

use std::time::{Duration, Instant};

use crate::common::{self, assert_error, get_json, is_id, unique, TestNode};
use serde_json::{json, Value};

use super::sandboxes::CLEAN;

pub(crate) const WAIT: Duration = Duration::from_secs(30);

/// A piece of output: its stream, position and text.
type Piece = (String, u64, String);

#[test]
fn exec_wait_and_output() {
    let node = TestNode::start();
    let sb = node.create_sandbox(&json!({}));
    let id = sb["id"].as_str().unwrap().to_string();
    let exec_path = format!("/v1/sandboxes/{id}/exec");

    // Ended within wait_seconds: the final object.
    let v = node.exec(
        &id,
        &json!({"command": "echo out; echo err >&2; exit 3", "wait_seconds": 20}),
    );
    let first = v["id"].as_str().unwrap().to_string();
    assert!(is_id("exe", &first), "{v}");
    assert_eq!(v["sandbox_id"], id.as_str(), "{v}");
    assert_eq!(v["status"], "exited", "{v}");
    assert_eq!(v["exit_code"], 3, "{v}");
    assert_eq!(v["stdout"], "out\n", "{v}");
    assert_eq!(v["stderr"], "err\n", "{v}");
    assert_eq!(v["output"]["stdout_bytes"], 4, "{v}");
    assert_eq!(v["output"]["stderr_bytes"], 4, "{v}");
    assert_eq!(v["output"]["end"], 8, "{v}");
    let (status, got) = get_json(&node, &format!("{exec_path}/{first}"));
    assert_eq!(status, 200, "{got}");
    assert_eq!(
        (
            got["status"].clone(),
            got["exit_code"].clone(),
            got["stdout"].clone()
        ),
        (json!("exited"), json!(3), json!("out\n")),
        "{got}"
    );

    // Not ended: running at once; a long poll answers when it ends.
    let t = Instant::now();
    let v = node.exec(&id, &json!({"command": "sleep 1.5; echo done"}));
    let slow = v["id"].as_str().unwrap().to_string();
    assert_eq!(v["status"], "running", "{v}");
    assert!(v["exit_code"].is_null(), "{v}");
    let (status, v) = get_json(&node, &format!("{exec_path}/{slow}"));
    assert_eq!(
        (status, v["status"].as_str()),
        (200, Some("running")),
        "{v}"
    );
    let (status, v) = get_json(&node, &format!("{exec_path}/{slow}?wait_seconds=20"));
    let took = t.elapsed();
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["status"], "exited",
        "the long poll answered before the end: {v}"
    );
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(v["stdout"], "done\n", "{v}");
    assert!(
        took >= Duration::from_millis(1400) && took < Duration::from_secs(10),
        "the long poll took {took:?}"
    );
    // A long poll that times out answers the running object.
    let v = node.exec(&id, &json!({"command": "sleep 5"}));
    let sleeper = v["id"].as_str().unwrap().to_string();
    let t = Instant::now();
    let (status, v) = get_json(&node, &format!("{exec_path}/{sleeper}?wait_seconds=0.5"));
    let took = t.elapsed();
    assert_eq!(
        (status, v["status"].as_str()),
        (200, Some("running")),
        "{v}"
    );
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_secs(4),
        "wait_seconds=0.5 took {took:?}"
    );
    // What is not a signal is refused, and sends nothing (it used to send SIGTERM).
    for bad in [
        json!(9.5),
        Value::Null,
        json!(["SIGKILL"]),
        json!("SIGBOGUS"),
        json!(0),
        json!(65),
        json!(-9),
        json!({"n": 9}),
    ] {
        let r = node.post_json(
            &format!("{exec_path}/{sleeper}/signal"),
            &json!({ "signal": bad }),
        );
        assert_error(r.status, &r.json(), 400, "invalid_field", Some("signal"));
    }
    let (_, v) = get_json(&node, &format!("{exec_path}/{sleeper}"));
    assert_eq!(v["status"], "running", "{v}");
    // A number is a signal too.
    let r = node.post_json(
        &format!("{exec_path}/{sleeper}/signal"),
        &json!({"signal": 9}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["signal"], "SIGKILL", "{}", r.text());
    let v = node.exec_wait(&id, &sleeper, WAIT);
    assert_eq!(v["status"], "killed", "{v}");
    assert_eq!(v["signal"], "SIGKILL", "{v}");
    // An ended command takes no signal.
    let r = node.post_json(
        &format!("{exec_path}/{sleeper}/signal"),
        &json!({"signal": "SIGTERM"}),
    );
    assert_error(r.status, &r.json(), 409, "exec_ended", None);

    // An argv command; a missing program is 127.
    let v = node.exec(&id, &json!({"command": ["false"], "wait_seconds": 20}));
    let argv = v["id"].as_str().unwrap().to_string();
    assert_eq!(
        (v["status"].as_str(), v["exit_code"].as_i64()),
        (Some("exited"), Some(1)),
        "{v}"
    );
    let v = node.exec(
        &id,
        &json!({"command": ["no-such-program"], "wait_seconds": 20}),
    );
    assert_eq!(v["exit_code"], 127, "{v}");
    let missing = v["id"].as_str().unwrap().to_string();

    // `…/run`: starts and waits.
    let r = node.post_json(
        &format!("/v1/sandboxes/{id}/run"),
        &json!({"command": "echo via-run; exit 4"}),
    );
    let v = r.json();
    assert_eq!(r.status, 200, "{v}");
    assert_eq!(
        (v["exit_code"].as_i64(), v["stdout"].as_str()),
        (Some(4), Some("via-run\n")),
        "{v}"
    );
    let ran = v["id"].as_str().unwrap().to_string();
    // … or as events.
    let mut s = node.open_sse_post(
        &format!("/v1/sandboxes/{id}/run"),
        &json!({"command": "echo a; echo b >&2", "stream": true}),
    );
    let events = s.rest();
    let kinds: Vec<&str> = events.iter().map(|e| e.event.as_str()).collect();
    assert_eq!(kinds.first(), Some(&"start"), "{kinds:?}");
    assert_eq!(kinds.last(), Some(&"exit"), "{kinds:?}");
    let exit = &events.last().unwrap().data;
    assert_eq!(exit["exit_code"], 0, "{exit}");
    let out: String = events
        .iter()
        .filter(|e| e.event == "stdout")
        .map(|e| e.data["data"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(out, "a\n");
    let streamed = exit["id"].as_str().unwrap().to_string();

    // The list of commands, oldest first.
    let (status, v) = get_json(&node, &exec_path);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "list", "{v}");
    let listed: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        listed,
        [&first, &slow, &sleeper, &argv, &missing, &ran, &streamed].map(String::as_str),
        "{v}"
    );
    for e in v["data"].as_array().unwrap() {
        assert_eq!(e["object"], "exec", "{e}");
        assert_ne!(e["status"], "running", "{e}");
    }
    assert_eq!(v["data"][0]["exit_code"], 3, "{v}");

    // Not found, and parameters.
    let ghost = "sbx-0000000000000000";
    let r = node.post_json(
        &format!("/v1/sandboxes/{ghost}/exec"),
        &json!({"command": "true"}),
    );
    assert_error(r.status, &r.json(), 404, "sandbox_not_found", None);
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{ghost}/exec/{first}"));
    assert_error(status, &v, 404, "sandbox_not_found", None);
    let (status, v) = get_json(&node, &format!("/v1/sandboxes/{ghost}/exec"));
    assert_error(status, &v, 404, "sandbox_not_found", None);
    let nope = "exe-0000000000000000";
    for path in [
        format!("{exec_path}/{nope}"),
        format!("{exec_path}/{nope}?wait_seconds=1"),
        format!("{exec_path}/{nope}/output"),
    ] {
        let (status, v) = get_json(&node, &path);
        assert_error(status, &v, 404, "exec_not_found", None);
    }
    let r = node.post_json(&format!("{exec_path}/{nope}/stdin"), &json!({"data": "x"}));
    assert_error(r.status, &r.json(), 404, "exec_not_found", None);
    let r = node.post_json(
        &format!("{exec_path}/{nope}/signal"),
        &json!({"signal": "SIGTERM"}),
    );
    assert_error(r.status, &r.json(), 404, "exec_not_found", None);
    for path in [
        format!("{exec_path}/{first}?bogus=1"),
        format!("{exec_path}/{first}/output?bogus=1"),
        format!("{exec_path}/{first}?wait_seconds=1&waitseconds=2"),
    ] {
        let (status, v) = get_json(&node, &path);
        let bad = if path.contains("waitseconds") {
            "waitseconds"
        } else {
            "bogus"
        };
        assert_error(status, &v, 400, "unknown_parameter", Some(bad));
    }
    let (status, v) = get_json(&node, &format!("{exec_path}/{first}?wait_seconds=301"));
    assert_error(status, &v, 400, "invalid_field", Some("wait_seconds"));
    let r = node.post_json(&exec_path, &json!({"command": "true", "bogus": 1}));
    assert_error(r.status, &r.json(), 400, "unknown_field", Some("bogus"));
    let r = node.post_json(&exec_path, &json!({}));
    assert_error(r.status, &r.json(), 400, "missing_command", Some("command"));

    node.delete_sandbox(&id);
    let (status, v) = get_json(&node, &format!("{exec_path}/{first}"));
    assert_error(status, &v, 404, "sandbox_not_found", None);
    node.assert_clean(CLEAN);
}

#[test]
fn stdin_in_several_calls_arrives_in_order() {
    let node = TestNode::start();
    let id = node.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let v = node.exec(&id, &json!({"command": ["cat"], "stdin_open": true}));
    let exec_id = v["id"].as_str().unwrap().to_string();
    assert_eq!(v["status"], "running", "{v}");
    let stdin = format!("/v1/sandboxes/{id}/exec/{exec_id}/stdin");
    let parts = ["first line\n", "second ", "third, the last"];
    for (i, part) in parts.iter().enumerate() {
        let last = i == parts.len() - 1;
        let r = node.post_json(&stdin, &json!({"data": part, "close": last}));
        let v = r.json();
        assert_eq!(r.status, 200, "stdin {i}: {v}");
        assert_eq!(v["written"], part.len(), "{v}");
        assert_eq!(v["closed"], last, "{v}");
    }
    let v = node.exec_wait(&id, &exec_id, WAIT);
    assert_eq!(v["status"], "exited", "{v}");
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(v["stdout"], parts.concat(), "{v}");
    let (_, _, all) = node.output_all(&id, &exec_id);
    assert_eq!(String::from_utf8_lossy(&all), parts.concat());

    // Base64 input, to a command reading bytes.
    let v = node.exec(
        &id,
        &json!({"command": "od -An -tx1 | tr -d ' \\n'", "stdin_open": true}),
    );
    let od = v["id"].as_str().unwrap().to_string();
    let r = node.post_json(
        &format!("/v1/sandboxes/{id}/exec/{od}/stdin"),
        &json!({"data": common::b64_encode(&[0, 255, 10]), "encoding": "base64", "close": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = node.exec_wait(&id, &od, WAIT);
    assert_eq!(v["stdout"], "00ff0a", "{v}");

    // Closed, the command still running: more is refused, not lost.
    let v = node.exec(
        &id,
        &json!({"command": "cat; sleep 30", "stdin_open": true}),
    );
    let closed = v["id"].as_str().unwrap().to_string();
    let closed_stdin = format!("/v1/sandboxes/{id}/exec/{closed}/stdin");
    let r = node.post_json(&closed_stdin, &json!({"data": "only\n", "close": true}));
    assert_eq!(r.status, 200, "{}", r.text());
    let r = node.post_json(&closed_stdin, &json!({"data": "lost?\n"}));
    assert_error(r.status, &r.json(), 409, "stdin_closed", None);
    // A command started without stdin_open has its stdin closed.
    let v = node.exec(&id, &json!({"command": "sleep 30"}));
    let r = node.post_json(
        &format!(
            "/v1/sandboxes/{id}/exec/{}/stdin",
            v["id"].as_str().unwrap()
        ),
        &json!({"data": "x"}),
    );
    assert_error(r.status, &r.json(), 409, "stdin_closed", None);

    // The command has ended: its stdin is closed.
    let r = node.post_json(&stdin, &json!({"data": "late"}));
    assert_error(r.status, &r.json(), 409, "stdin_closed", None);
    // … as soon as its end is known.
    for i in 0..10 {
        let v = node.exec(
            &id,
            &json!({"command": ["cat"], "stdin": format!("{i}"), "wait_seconds": 20}),
        );
        assert_eq!(v["status"], "exited", "{v}");
        assert_eq!(v["stdout"], format!("{i}"), "{v}");
        let r = node.post_json(
            &format!(
                "/v1/sandboxes/{id}/exec/{}/stdin",
                v["id"].as_str().unwrap()
            ),
            &json!({"data": "late"}),
        );
        assert_error(r.status, &r.json(), 409, "stdin_closed", None);
    }

    node.delete_sandbox(&id);
    node.assert_clean(CLEAN);
}

#[test]
fn an_event_stream_cut_and_resumed_has_every_byte_once() {
    let node = TestNode::start();
    let id = node.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let v = node.exec(
        &id,
        &json!({"command": "for i in $(seq 1 200); do echo \"line $i\"; sleep 0.01; done"}),
    );
    let exec_id = v["id"].as_str().unwrap().to_string();
    let expected: String = (1..=200).map(|i| format!("line {i}\n")).collect();
    let path = format!("/v1/sandboxes/{id}/exec/{exec_id}/output");

    let mut data = String::new();
    let mut last_id = 0u64;
    let check = |e: &common::Event, data: &mut String, last_id: &mut u64| {
        assert_eq!(e.event, "stdout", "{e:?}");
        let pos = e.data["position"].as_u64().expect("position");
        let text = e.data["data"].as_str().expect("data");
        assert_eq!(
            pos, *last_id,
            "an event does not begin where the last ended: {e:?}"
        );
        assert!(
            e.id > *last_id,
            "event ids do not increase: {} after {}",
            e.id,
            *last_id
        );
        assert_eq!(
            e.id,
            pos + text.len() as u64,
            "the id is not the position after: {e:?}"
        );
        *last_id = e.id;
        data.push_str(text);
    };
    {
        let mut s = node.open_sse_get(&path, &[]);
        assert_eq!(s.status, 200);
        for _ in 0..20 {
            let e = s.next_event().expect("the stream ended before 20 events");
            check(&e, &mut data, &mut last_id);
        }
        // Dropped here: the caller hangs up.
    }
    assert!(last_id > 0);
    let cut_at = last_id;
    let mut s = node.open_sse_get(&path, &[("Last-Event-ID", &cut_at.to_string())]);
    let mut exit = None;
    while let Some(e) = s.next_event() {
        if e.event == "exit" {
            exit = Some(e);
            break;
        }
        check(&e, &mut data, &mut last_id);
    }
    assert!(s.next_event().is_none(), "events after exit");
    let exit = exit.expect("no exit event");
    assert_eq!(exit.data["status"], "exited", "{:?}", exit.data);
    assert_eq!(exit.data["exit_code"], 0, "{:?}", exit.data);
    assert_eq!(exit.id, expected.len() as u64, "{exit:?}");
    assert_eq!(
        data.len(),
        expected.len(),
        "bytes lost or doubled (cut at {cut_at})"
    );
    assert_eq!(data, expected, "cut at {cut_at}");

    // Resuming from the query's `from`, after the end: the rest, then the exit.
    let mid = 100u64;
    let mut s = node.open_sse_get(&format!("{path}?from={mid}"), &[]);
    let events = s.rest();
    let rest: String = events
        .iter()
        .filter(|e| e.event == "stdout")
        .map(|e| e.data["data"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(rest, expected[mid as usize..], "from={mid}");
    assert_eq!(events.last().map(|e| e.event.as_str()), Some("exit"));
    // `?stream=true` streams without the Accept header.
    let r = node.get(&format!("{path}?stream=true&from={}", expected.len()), &[]);
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("content-type"),
        Some("text/event-stream"),
        "{}",
        r.text()
    );
    assert!(r.text().contains("event: exit"), "{}", r.text());
    // The JSON pages have the same bytes.
    let (out, err, _) = node.output_all(&id, &exec_id);
    assert_eq!(String::from_utf8_lossy(&out), expected);
    assert!(err.is_empty());

    node.delete_sandbox(&id);
    node.assert_clean(CLEAN);
}

#[test]
fn json_output_ranges_slice_exactly() {
    let node = TestNode::start();
    let id = node.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let v = node.exec(
        &id,
        &json!({
            "command": "printf 0123456789; sleep 0.3; printf abcdefghij >&2; sleep 0.3; printf KLMNO",
            "wait_seconds": 20,
        }),
    );
    let exec_id = v["id"].as_str().unwrap().to_string();
    assert_eq!(v["status"], "exited", "{v}");
    let path = format!("/v1/sandboxes/{id}/exec/{exec_id}/output");
    // (from, to) -> the (stream, position, data) chunks and next.
    let range = |q: &str| -> (Vec<Piece>, u64, Value) {
        let (status, v) = get_json(&node, &format!("{path}{q}"));
        assert_eq!(status, 200, "{q}: {v}");
        assert_eq!(v["object"], "output", "{v}");
        assert_eq!(v["start"], 0, "{v}");
        assert_eq!(v["end"], 25, "{v}");
        assert_eq!(v["exited"], true, "{v}");
        assert!(v["gap"].is_null(), "{v}");
        // Chunks of one stream next to each other are one piece of the range.
        let mut pieces: Vec<Piece> = Vec::new();
        for c in v["chunks"].as_array().unwrap() {
            let stream = c["stream"].as_str().unwrap().to_string();
            let pos = c["position"].as_u64().unwrap();
            let data = c["data"].as_str().unwrap().to_string();
            match pieces.last_mut() {
                Some(p) if p.0 == stream && p.1 + p.2.len() as u64 == pos => p.2.push_str(&data),
                _ => pieces.push((stream, pos, data)),
            }
        }
        (pieces, v["next"].as_u64().unwrap(), v)
    };
    let p = |s: &str, pos: u64, d: &str| (s.to_string(), pos, d.to_string());
    let (all, next, v) = range("");
    assert_eq!(
        all,
        vec![
            p("stdout", 0, "0123456789"),
            p("stderr", 10, "abcdefghij"),
            p("stdout", 20, "KLMNO")
        ],
        "{v}"
    );
    assert_eq!(next, 25);
    assert_eq!(v["from"], 0, "{v}");
    let cases: Vec<(&str, Vec<Piece>, u64)> = vec![
        ("?from=3&to=7", vec![p("stdout", 3, "3456")], 7),
        ("?from=0&to=10", vec![p("stdout", 0, "0123456789")], 10),
        (
            "?from=8&to=13",
            vec![p("stdout", 8, "89"), p("stderr", 10, "abc")],
            13,
        ),
        (
            "?from=19&to=21",
            vec![p("stderr", 19, "j"), p("stdout", 20, "K")],
            21,
        ),
        ("?from=20", vec![p("stdout", 20, "KLMNO")], 25),
        ("?from=22&to=1000", vec![p("stdout", 22, "MNO")], 25),
        ("?to=2", vec![p("stdout", 0, "01")], 2),
        ("?from=5&to=5", vec![], 5),
        ("?from=25", vec![], 25),
    ];
    for (q, want, want_next) in cases {
        let (got, next, v) = range(q);
        assert_eq!(got, want, "{q}: {v}");
        assert_eq!(next, want_next, "{q}: next: {v}");
    }
    // Base64 slices are the same bytes.
    let (status, v) = get_json(&node, &format!("{path}?from=12&to=15&encoding=base64"));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["chunks"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(
        common::b64_decode(v["chunks"][0]["data"].as_str().unwrap()),
        b"cde"
    );
    let (status, v) = get_json(&node, &format!("{path}?from=x"));
    assert_error(status, &v, 400, "invalid_field", Some("from"));

    node.delete_sandbox(&id);
    node.assert_clean(CLEAN);
}

#[test]
fn a_sandbox_runs_four_commands_at_once() {
    let node = TestNode::start();
    let id = node.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let sleepers: Vec<String> = (0..4)
        .map(|_| {
            let v = node.exec(&id, &json!({"command": "sleep 30"}));
            assert_eq!(v["status"], "running", "{v}");
            v["id"].as_str().unwrap().to_string()
        })
        .collect();
    let r = node.post_json(
        &format!("/v1/sandboxes/{id}/exec"),
        &json!({"command": "echo fifth"}),
    );
    let v = r.json();
    assert_error(r.status, &v, 409, "too_many_commands", None);
    assert_eq!(v["error"]["retryable"], true, "{v}");
    // `…/run` counts too.
    let r = node.post_json(
        &format!("/v1/sandboxes/{id}/run"),
        &json!({"command": "true"}),
    );
    assert_error(r.status, &r.json(), 409, "too_many_commands", None);
    // A refusal worth retrying is not what a key replays: the retry, once there is room,
    // runs the command.
    let key = unique("key-full");
    let keyed = json!({"command": "echo keyed", "wait_seconds": 20});
    let keyed_exec = || {
        node.post(
            &format!("/v1/sandboxes/{id}/exec"),
            &[("Idempotency-Key", key.as_str())],
            &serde_json::to_vec(&keyed).unwrap(),
        )
    };
    let r = keyed_exec();
    assert_error(r.status, &r.json(), 409, "too_many_commands", None);

    let r = node.post_json(
        &format!("/v1/sandboxes/{id}/exec/{}/signal", sleepers[0]),
        &json!({"signal": "SIGKILL"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["signal"], "SIGKILL");
    let v = node.exec_wait(&id, &sleepers[0], WAIT);
    assert_eq!(v["status"], "killed", "{v}");
    assert_eq!(v["exit_code"], 137, "{v}");
    let r = keyed_exec();
    let v = r.json();
    assert_eq!(
        r.status, 201,
        "the retry with the key, once there is room: {v}"
    );
    assert_eq!(v["stdout"], "keyed\n", "{v}");
    let again = keyed_exec();
    assert_eq!(again.status, 201);
    assert_eq!(again.json()["id"], v["id"], "the key names one command");
    // The slot of a command that ended is free as soon as its end is known: one command
    // after another in the last slot, each started when the one before answered its end.
    for i in 0..30 {
        let r = node.post_json(
            &format!("/v1/sandboxes/{id}/exec"),
            &json!({"command": format!("echo {i}"), "wait_seconds": 20}),
        );
        let v = r.json();
        assert_eq!(r.status, 201, "command {i} in the freed slot: {v}");
        assert_eq!(v["status"], "exited", "{v}");
        assert_eq!(v["stdout"], format!("{i}\n"), "{v}");
    }
    for s in &sleepers[1..] {
        let (status, v) = get_json(&node, &format!("/v1/sandboxes/{id}/exec/{s}"));
        assert_eq!(
            (status, v["status"].as_str()),
            (200, Some("running")),
            "{v}"
        );
    }
    // Four running again: the next waits.
    let v = node.exec(&id, &json!({"command": "sleep 30"}));
    assert_eq!(v["status"], "running", "{v}");
    let r = node.post_json(
        &format!("/v1/sandboxes/{id}/exec"),
        &json!({"command": "echo one-too-many"}),
    );
    assert_error(r.status, &r.json(), 409, "too_many_commands", None);

    // Deleting ends the running ones.
    node.delete_sandbox(&id);

    // Eight at once in an empty sandbox: four start, four are refused.
    let id = node.create_sandbox(&json!({}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let statuses: Vec<(u16, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                s.spawn(|| {
                    let r = node.post_json(
                        &format!("/v1/sandboxes/{id}/exec"),
                        &json!({"command": "sleep 30"}),
                    );
                    (r.status, r.json())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let started = statuses.iter().filter(|(s, _)| *s == 201).count();
    for (status, v) in statuses.iter().filter(|(s, _)| *s != 201) {
        assert_error(*status, v, 409, "too_many_commands", None);
    }
    assert_eq!(started, 4, "{statuses:?}");
    let (_, v) = get_json(&node, &format!("/v1/sandboxes/{id}/exec"));
    let running = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["status"] == "running")
        .count();
    assert_eq!(running, 4, "{v}");
    node.delete_sandbox(&id);
    node.assert_clean(CLEAN);
}

#[test]
fn a_waited_command_is_listed_while_it_runs_and_new_users_are_known_at_once() {
    let node = TestNode::start();
    let sb = node.create_sandbox(&json!({}));
    let id = sb["id"].as_str().unwrap().to_string();
    let list_path = format!("/v1/sandboxes/{id}/exec");
    // A caller waits for a command; others see it running meanwhile, and its end after.
    let cmd = "sleep 1.5; echo slept";
    let seen_running = std::thread::scope(|s| {
        let waiter = s.spawn(|| node.exec(&id, &json!({"command": cmd, "wait_seconds": 20})));
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut seen = None;
        while seen.is_none() && Instant::now() < deadline && !waiter.is_finished() {
            let (status, v) = get_json(&node, &list_path);
            assert_eq!(status, 200, "{v}");
            seen = v["data"]
                .as_array()
                .unwrap()
                .iter()
                .find(|e| e["command"] == cmd && e["status"] == "running")
                .cloned();
            std::thread::sleep(Duration::from_millis(20));
        }
        let v = waiter.join().unwrap();
        assert_eq!(
            (v["status"].as_str(), v["stdout"].as_str()),
            (Some("exited"), Some("slept\n")),
            "{v}"
        );
        let (status, got) = get_json(&node, &format!("{list_path}/{}", v["id"].as_str().unwrap()));
        assert_eq!(
            (status, got["status"].as_str()),
            (200, Some("exited")),
            "{got}"
        );
        seen.map(|e| (e["id"].clone(), v["id"].clone()))
    });
    let (listed, answered) = seen_running.expect("the waited command was never listed as running");
    assert_eq!(listed, answered);

    // A user added by one command is known to the next at once, and a user changed later too
    // (the agent reads /etc/passwd again when it changes).
    let run_as = |user: &str| -> Value {
        node.exec(
            &id,
            &json!({"command": ["id", "-u"], "user": user, "wait_seconds": 20}),
        )
    };
    let v = node.exec(
        &id,
        &json!({"command": "echo 'alice:x:1234:1234::/home/alice:/bin/sh' >> /etc/passwd", "wait_seconds": 20}),
    );
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(run_as("alice")["stdout"], "1234\n");
    // Settled (older than a second): now served from what the agent kept.
    std::thread::sleep(Duration::from_millis(2100));
    assert_eq!(run_as("alice")["stdout"], "1234\n");
    let v = node.exec(
        &id,
        &json!({"command": "sed -i 's/^alice:x:1234:/alice:x:1235:/' /etc/passwd", "wait_seconds": 20}),
    );
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(run_as("alice")["stdout"], "1235\n");
    let r = node.post_json(
        &list_path,
        &json!({"command": ["id", "-u"], "user": "bob", "wait_seconds": 20}),
    );
    let v = r.json();
    assert_error(r.status, &v, 400, "no_such_user", Some("user"));
    node.delete_sandbox(&id);
    node.assert_clean(CLEAN);
}
