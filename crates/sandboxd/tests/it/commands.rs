//! A kept sandbox's commands: exec, wait, output (JSON and events, ranges, resumes), stdin,
//! the per-sandbox cap, the list of commands.

use std::time::{Duration, Instant};

use crate::common::{
    self, assert_error, assert_refused, create_req, exec_req, get_json, is_id, unique, TestNode,
};
use sbx_api::{Command, Encoding, ExecObject, ExecRequest, ExecStatus};
use sbx_client::{Client, Signal};
use serde_json::{json, Value};

use super::sandboxes::CLEAN;

pub(crate) const WAIT: Duration = Duration::from_secs(30);

/// A piece of output: its stream, position and text.
type Piece = (String, u64, String);

/// A command that waits up to 20 s for its end.
fn waited(command: Command) -> ExecRequest {
    ExecRequest {
        wait_seconds: 20.0,
        ..ExecRequest::new(command)
    }
}

/// The command line `line`, waited for up to 20 s.
fn waited_sh(line: &str) -> ExecRequest {
    waited(Command::Shell(line.into()))
}

/// The arguments `args`, run without a shell.
fn argv(args: &[&str]) -> Command {
    Command::Argv(args.iter().map(|a| a.to_string()).collect())
}

/// A new sandbox of the defaults: its id.
fn new_sandbox(c: &Client) -> String {
    c.create_sandbox(&create_req()).expect("create").id.clone()
}

/// A command's final object, which must come within [`WAIT`].
fn ended(c: &Client, sandbox: &str, exec: &str) -> ExecObject {
    let o = c
        .wait_exec_for(sandbox, exec, WAIT)
        .unwrap_or_else(|e| panic!("wait for {exec}: {e}"));
    assert!(
        o.status.is_done(),
        "{exec} still runs after {WAIT:?}: {o:?}"
    );
    o
}

/// A command's object as it is now.
fn exec_now(c: &Client, sandbox: &str, exec: &str) -> ExecObject {
    c.exec_object(sandbox, exec, 0.0, Encoding::Utf8)
        .unwrap_or_else(|e| panic!("get {exec}: {e}"))
}

#[test]
fn exec_wait_and_output() {
    let node = TestNode::start();
    let c = node.client();
    let id = new_sandbox(&c);
    let exec_path = format!("/v1/sandboxes/{id}/exec");

    // Ended within wait_seconds: the final object.
    let v = c
        .exec(&id, &waited_sh("echo out; echo err >&2; exit 3"))
        .expect("exec");
    let first = v.id.clone();
    assert!(is_id("exe", &first), "{v:?}");
    assert_eq!(v.sandbox_id, id, "{v:?}");
    assert_eq!(v.status, ExecStatus::Exited, "{v:?}");
    assert_eq!(v.exit_code, Some(3), "{v:?}");
    assert_eq!(v.stdout, "out\n", "{v:?}");
    assert_eq!(v.stderr, "err\n", "{v:?}");
    assert_eq!(v.output.stdout_bytes, 4, "{v:?}");
    assert_eq!(v.output.stderr_bytes, 4, "{v:?}");
    assert_eq!(v.output.end, 8, "{v:?}");
    let got = exec_now(&c, &id, &first);
    assert_eq!(
        (got.status, got.exit_code, got.stdout.as_str()),
        (ExecStatus::Exited, Some(3), "out\n"),
        "{got:?}"
    );

    // Not ended: running at once; a long poll answers when it ends.
    let t = Instant::now();
    let v = c
        .exec(&id, &exec_req("sleep 1.5; echo done"))
        .expect("exec");
    let slow = v.id.clone();
    assert_eq!(v.status, ExecStatus::Running, "{v:?}");
    assert!(v.exit_code.is_none(), "{v:?}");
    let v = exec_now(&c, &id, &slow);
    assert_eq!(v.status, ExecStatus::Running, "{v:?}");
    let v = c
        .exec_object(&id, &slow, 20.0, Encoding::Utf8)
        .expect("a long poll");
    let took = t.elapsed();
    assert_eq!(
        v.status,
        ExecStatus::Exited,
        "the long poll answered before the end: {v:?}"
    );
    assert_eq!(v.exit_code, Some(0), "{v:?}");
    assert_eq!(v.stdout, "done\n", "{v:?}");
    assert!(
        took >= Duration::from_millis(1400) && took < Duration::from_secs(10),
        "the long poll took {took:?}"
    );
    // A long poll that times out answers the running object.
    let sleeper = c.exec(&id, &exec_req("sleep 5")).expect("exec").id;
    let t = Instant::now();
    let v = c
        .exec_object(&id, &sleeper, 0.5, Encoding::Utf8)
        .expect("a long poll");
    let took = t.elapsed();
    assert_eq!(v.status, ExecStatus::Running, "{v:?}");
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_secs(4),
        "wait_seconds=0.5 took {took:?}"
    );
    // What is not a signal is refused, and sends nothing (it used to send SIGTERM): bodies
    // no client sends, as they are.
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
    let v = exec_now(&c, &id, &sleeper);
    assert_eq!(v.status, ExecStatus::Running, "{v:?}");
    // A number is a signal too.
    let sent = c
        .signal(&id, &sleeper, &Signal::Number(9))
        .expect("signal 9");
    assert_eq!(sent.signal, "SIGKILL", "{sent:?}");
    let v = ended(&c, &id, &sleeper);
    assert_eq!(v.status, ExecStatus::Killed, "{v:?}");
    assert_eq!(v.signal.as_deref(), Some("SIGKILL"), "{v:?}");
    // An ended command takes no signal.
    assert_refused(
        c.signal(&id, &sleeper, &Signal::Name("SIGTERM".into())),
        409,
        "exec_ended",
        None,
    );

    // An argv command; a missing program is 127.
    let v = c.exec(&id, &waited(argv(&["false"]))).expect("exec");
    let argv_id = v.id.clone();
    assert_eq!(
        (v.status, v.exit_code),
        (ExecStatus::Exited, Some(1)),
        "{v:?}"
    );
    let v = c
        .exec(&id, &waited(argv(&["no-such-program"])))
        .expect("exec");
    assert_eq!(v.exit_code, Some(127), "{v:?}");
    let missing = v.id.clone();

    // `…/run`: starts and waits.
    let v = c
        .exec_run(&id, &exec_req("echo via-run; exit 4"))
        .expect("run");
    assert_eq!(
        (v.exit_code, v.stdout.as_str()),
        (Some(4), "via-run\n"),
        "{v:?}"
    );
    let ran = v.id.clone();
    // … or as events.
    let events: Vec<sbx_client::ExecEvent> = c
        .exec_run_stream(&id, &exec_req("echo a; echo b >&2"))
        .expect("run as events")
        .collect::<Result<_, _>>()
        .expect("the events");
    assert!(
        matches!(events.first(), Some(sbx_client::ExecEvent::Start(_))),
        "{events:?}"
    );
    let Some(sbx_client::ExecEvent::Exit(exit)) = events.last() else {
        panic!("the last event is not exit: {events:?}");
    };
    assert_eq!(exit.exit_code, Some(0), "{exit:?}");
    let out: String = events
        .iter()
        .filter_map(|e| match e {
            sbx_client::ExecEvent::Stdout(d) => Some(d.data.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(out, "a\n");
    let streamed = exit.id.clone();

    // The list of commands, oldest first.
    let list = c.execs(&id).expect("the commands");
    assert_eq!(list.object, "list", "{list:?}");
    let listed: Vec<&str> = list.data.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(
        listed,
        [&first, &slow, &sleeper, &argv_id, &missing, &ran, &streamed].map(String::as_str),
        "{list:?}"
    );
    for e in &list.data {
        assert_ne!(e.status, ExecStatus::Running, "{e:?}");
    }
    assert_eq!(list.data[0].exit_code, Some(3), "{list:?}");

    // Not found, and parameters.
    let ghost = "sbx-0000000000000000";
    assert_refused(
        c.exec(ghost, &exec_req("true")),
        404,
        "sandbox_not_found",
        None,
    );
    assert_refused(
        c.exec_object(ghost, &first, 0.0, Encoding::Utf8),
        404,
        "sandbox_not_found",
        None,
    );
    assert_refused(c.execs(ghost), 404, "sandbox_not_found", None);
    let nope = "exe-0000000000000000";
    assert_refused(
        c.exec_object(&id, nope, 0.0, Encoding::Utf8),
        404,
        "exec_not_found",
        None,
    );
    assert_refused(
        c.exec_object(&id, nope, 1.0, Encoding::Utf8),
        404,
        "exec_not_found",
        None,
    );
    assert_refused(
        c.output(&id, nope, 0, None, Encoding::Utf8),
        404,
        "exec_not_found",
        None,
    );
    assert_refused(
        c.write_stdin(&id, nope, b"x", false),
        404,
        "exec_not_found",
        None,
    );
    assert_refused(
        c.signal(&id, nope, &Signal::Name("SIGTERM".into())),
        404,
        "exec_not_found",
        None,
    );
    // Parameters and fields no client sends, as they are.
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
    assert_refused(
        c.exec_object(&id, &first, 301.0, Encoding::Utf8),
        400,
        "invalid_field",
        Some("wait_seconds"),
    );
    let r = node.post_json(&exec_path, &json!({"command": "true", "bogus": 1}));
    assert_error(r.status, &r.json(), 400, "unknown_field", Some("bogus"));
    let r = node.post_json(&exec_path, &json!({}));
    assert_error(r.status, &r.json(), 400, "missing_command", Some("command"));

    c.delete_sandbox(&id).expect("delete");
    assert_refused(
        c.exec_object(&id, &first, 0.0, Encoding::Utf8),
        404,
        "sandbox_not_found",
        None,
    );
    node.assert_clean(CLEAN);
}

#[test]
fn stdin_in_several_calls_arrives_in_order() {
    let node = TestNode::start();
    let c = node.client();
    let id = new_sandbox(&c);
    let v = c
        .exec(
            &id,
            &ExecRequest {
                stdin_open: true,
                ..ExecRequest::new(argv(&["cat"]))
            },
        )
        .expect("exec");
    let exec_id = v.id.clone();
    assert_eq!(v.status, ExecStatus::Running, "{v:?}");
    let parts = ["first line\n", "second ", "third, the last"];
    for (i, part) in parts.iter().enumerate() {
        let last = i == parts.len() - 1;
        let w = c
            .write_stdin(&id, &exec_id, part.as_bytes(), last)
            .unwrap_or_else(|e| panic!("stdin {i}: {e}"));
        assert_eq!(w.written, part.len() as u64, "{w:?}");
        assert_eq!(w.closed, last, "{w:?}");
    }
    let v = ended(&c, &id, &exec_id);
    assert_eq!(v.status, ExecStatus::Exited, "{v:?}");
    assert_eq!(v.exit_code, Some(0), "{v:?}");
    assert_eq!(v.stdout, parts.concat(), "{v:?}");
    let (_, _, all) = node.output_all(&id, &exec_id);
    assert_eq!(String::from_utf8_lossy(&all), parts.concat());

    // Bytes that are not text (the client sends stdin as base64), to a command reading bytes.
    let open = |line: &str| ExecRequest {
        stdin_open: true,
        ..exec_req(line)
    };
    let od = c
        .exec(&id, &open("od -An -tx1 | tr -d ' \\n'"))
        .expect("exec")
        .id;
    c.write_stdin(&id, &od, &[0, 255, 10], true)
        .expect("stdin of od");
    let v = ended(&c, &id, &od);
    assert_eq!(v.stdout, "00ff0a", "{v:?}");

    // Closed, the command still running: more is refused, not lost.
    let closed = c.exec(&id, &open("cat; sleep 30")).expect("exec").id;
    c.write_stdin(&id, &closed, b"only\n", true)
        .expect("stdin, then closed");
    assert_refused(
        c.write_stdin(&id, &closed, b"lost?\n", false),
        409,
        "stdin_closed",
        None,
    );
    // A command started without stdin_open has its stdin closed.
    let v = c.exec(&id, &exec_req("sleep 30")).expect("exec");
    assert_refused(
        c.write_stdin(&id, &v.id, b"x", false),
        409,
        "stdin_closed",
        None,
    );

    // The command has ended: its stdin is closed.
    assert_refused(
        c.write_stdin(&id, &exec_id, b"late", false),
        409,
        "stdin_closed",
        None,
    );
    // … as soon as its end is known.
    for i in 0..10 {
        let v = c
            .exec(
                &id,
                &ExecRequest {
                    stdin: Some(format!("{i}").into_bytes()),
                    ..waited(argv(&["cat"]))
                },
            )
            .expect("exec");
        assert_eq!(v.status, ExecStatus::Exited, "{v:?}");
        assert_eq!(v.stdout, format!("{i}"), "{v:?}");
        assert_refused(
            c.write_stdin(&id, &v.id, b"late", false),
            409,
            "stdin_closed",
            None,
        );
    }

    c.delete_sandbox(&id).expect("delete");
    node.assert_clean(CLEAN);
}

#[test]
fn an_event_stream_cut_and_resumed_has_every_byte_once() {
    // The stream's framing, ids and `Last-Event-ID` are the wire's: read as it is.
    let node = TestNode::start();
    let c = node.client();
    let id = new_sandbox(&c);
    let exec_id = c
        .exec(
            &id,
            &exec_req("for i in $(seq 1 200); do echo \"line $i\"; sleep 0.01; done"),
        )
        .expect("exec")
        .id;
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

    c.delete_sandbox(&id).expect("delete");
    node.assert_clean(CLEAN);
}

#[test]
fn json_output_ranges_slice_exactly() {
    let node = TestNode::start();
    let c = node.client();
    let id = new_sandbox(&c);
    let v = c
        .exec(
            &id,
            &waited_sh(
                "printf 0123456789; sleep 0.3; printf abcdefghij >&2; sleep 0.3; printf KLMNO",
            ),
        )
        .expect("exec");
    let exec_id = v.id.clone();
    assert_eq!(v.status, ExecStatus::Exited, "{v:?}");
    let path = format!("/v1/sandboxes/{id}/exec/{exec_id}/output");
    // (from, to) -> the (stream, position, data) chunks and next.
    let range = |from: u64, to: Option<u64>| -> (Vec<Piece>, u64, sbx_client::OutputPage) {
        let v = c
            .output(&id, &exec_id, from, to, Encoding::Utf8)
            .unwrap_or_else(|e| panic!("{from}..{to:?}: {e}"));
        assert_eq!(v.object, "output", "{v:?}");
        assert_eq!(v.start, 0, "{v:?}");
        assert_eq!(v.end, 25, "{v:?}");
        assert!(v.exited, "{v:?}");
        assert!(v.gap.is_none(), "{v:?}");
        // Chunks of one stream next to each other are one piece of the range.
        let mut pieces: Vec<Piece> = Vec::new();
        for c in &v.chunks {
            match pieces.last_mut() {
                Some(p) if p.0 == c.stream && p.1 + p.2.len() as u64 == c.position => {
                    p.2.push_str(&c.data)
                }
                _ => pieces.push((c.stream.clone(), c.position, c.data.clone())),
            }
        }
        (pieces, v.next, v)
    };
    let p = |s: &str, pos: u64, d: &str| (s.to_string(), pos, d.to_string());
    let (all, next, v) = range(0, None);
    assert_eq!(
        all,
        vec![
            p("stdout", 0, "0123456789"),
            p("stderr", 10, "abcdefghij"),
            p("stdout", 20, "KLMNO")
        ],
        "{v:?}"
    );
    assert_eq!(next, 25);
    assert_eq!(v.from, 0, "{v:?}");
    let cases: Vec<(u64, Option<u64>, Vec<Piece>, u64)> = vec![
        (3, Some(7), vec![p("stdout", 3, "3456")], 7),
        (0, Some(10), vec![p("stdout", 0, "0123456789")], 10),
        (
            8,
            Some(13),
            vec![p("stdout", 8, "89"), p("stderr", 10, "abc")],
            13,
        ),
        (
            19,
            Some(21),
            vec![p("stderr", 19, "j"), p("stdout", 20, "K")],
            21,
        ),
        (20, None, vec![p("stdout", 20, "KLMNO")], 25),
        (22, Some(1000), vec![p("stdout", 22, "MNO")], 25),
        (0, Some(2), vec![p("stdout", 0, "01")], 2),
        (5, Some(5), vec![], 5),
        (25, None, vec![], 25),
    ];
    for (from, to, want, want_next) in cases {
        let (got, next, v) = range(from, to);
        assert_eq!(got, want, "{from}..{to:?}: {v:?}");
        assert_eq!(next, want_next, "{from}..{to:?}: next: {v:?}");
    }
    // `to` left out of the query is the end, `from` left out is 0 (the wire: as it is).
    let (status, v) = get_json(&node, &format!("{path}?to=2"));
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["chunks"],
        json!([{"stream": "stdout", "position": 0, "data": "01"}])
    );
    // Base64 slices are the same bytes.
    let v = c
        .output(&id, &exec_id, 12, Some(15), Encoding::Base64)
        .expect("a base64 slice");
    assert_eq!(v.chunks.len(), 1, "{v:?}");
    assert_eq!(common::b64_decode(&v.chunks[0].data), b"cde");
    let (status, v) = get_json(&node, &format!("{path}?from=x"));
    assert_error(status, &v, 400, "invalid_field", Some("from"));

    c.delete_sandbox(&id).expect("delete");
    node.assert_clean(CLEAN);
}

#[test]
fn a_sandbox_runs_four_commands_at_once() {
    let node = TestNode::start();
    let c = node.client();
    let id = new_sandbox(&c);
    let sleepers: Vec<String> = (0..4)
        .map(|_| {
            let v = c.exec(&id, &exec_req("sleep 30")).expect("exec");
            assert_eq!(v.status, ExecStatus::Running, "{v:?}");
            v.id
        })
        .collect();
    let e = assert_refused(
        c.exec(&id, &exec_req("echo fifth")),
        409,
        "too_many_commands",
        None,
    );
    assert!(e.retryable, "{e:?}");
    // `…/run` counts too.
    assert_refused(
        c.exec_run(&id, &exec_req("true")),
        409,
        "too_many_commands",
        None,
    );
    // A refusal worth retrying is not what a key replays: the retry, once there is room,
    // runs the command (Idempotency-Key replays: the wire's, sent as they are).
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

    let sent = c
        .signal(&id, &sleepers[0], &Signal::Name("SIGKILL".into()))
        .expect("signal");
    assert_eq!(sent.signal, "SIGKILL");
    let v = ended(&c, &id, &sleepers[0]);
    assert_eq!(v.status, ExecStatus::Killed, "{v:?}");
    assert_eq!(v.exit_code, Some(137), "{v:?}");
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
        let v = c
            .exec(&id, &waited_sh(&format!("echo {i}")))
            .unwrap_or_else(|e| panic!("command {i} in the freed slot: {e}"));
        assert_eq!(v.status, ExecStatus::Exited, "{v:?}");
        assert_eq!(v.stdout, format!("{i}\n"), "{v:?}");
    }
    for s in &sleepers[1..] {
        let v = exec_now(&c, &id, s);
        assert_eq!(v.status, ExecStatus::Running, "{v:?}");
    }
    // Four running again: the next waits.
    let v = c.exec(&id, &exec_req("sleep 30")).expect("exec");
    assert_eq!(v.status, ExecStatus::Running, "{v:?}");
    assert_refused(
        c.exec(&id, &exec_req("echo one-too-many")),
        409,
        "too_many_commands",
        None,
    );

    // Deleting ends the running ones.
    c.delete_sandbox(&id).expect("delete");

    // Eight at once in an empty sandbox: four start, four are refused.
    let id = new_sandbox(&c);
    let answers: Vec<Result<ExecObject, sbx_client::Error>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|_| s.spawn(|| c.exec(&id, &exec_req("sleep 30"))))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let started = answers.iter().filter(|r| r.is_ok()).count();
    for e in answers.iter().filter_map(|r| r.as_ref().err()) {
        let n = e
            .node()
            .unwrap_or_else(|| panic!("not the node's refusal: {e}"));
        assert_error(n.status, &n.body, 409, "too_many_commands", None);
    }
    assert_eq!(started, 4, "{answers:?}");
    let list = c.execs(&id).expect("the commands");
    let running = list
        .data
        .iter()
        .filter(|e| e.status == ExecStatus::Running)
        .count();
    assert_eq!(running, 4, "{list:?}");
    c.delete_sandbox(&id).expect("delete");
    node.assert_clean(CLEAN);
}

#[test]
fn a_waited_command_is_listed_while_it_runs_and_new_users_are_known_at_once() {
    let node = TestNode::start();
    let c = node.client();
    let id = new_sandbox(&c);
    // A caller waits for a command; others see it running meanwhile, and its end after.
    let cmd = "sleep 1.5; echo slept";
    let seen_running = std::thread::scope(|s| {
        let waiter = s.spawn(|| c.exec(&id, &waited_sh(cmd)).expect("exec"));
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut seen = None;
        while seen.is_none() && Instant::now() < deadline && !waiter.is_finished() {
            let list = c.execs(&id).expect("the commands");
            seen = list
                .data
                .into_iter()
                .find(|e| e.command == cmd && e.status == ExecStatus::Running);
            std::thread::sleep(Duration::from_millis(20));
        }
        let v = waiter.join().unwrap();
        assert_eq!(
            (v.status, v.stdout.as_str()),
            (ExecStatus::Exited, "slept\n"),
            "{v:?}"
        );
        let got = exec_now(&c, &id, &v.id);
        assert_eq!(got.status, ExecStatus::Exited, "{got:?}");
        seen.map(|e| (e.id, v.id))
    });
    let (listed, answered) = seen_running.expect("the waited command was never listed as running");
    assert_eq!(listed, answered);

    // A user added by one command is known to the next at once, and a user changed later too
    // (the agent reads /etc/passwd again when it changes).
    let as_user = |user: &str| ExecRequest {
        user: Some(user.into()),
        ..waited(argv(&["id", "-u"]))
    };
    let run_as = |user: &str| -> String { c.exec(&id, &as_user(user)).expect("id -u").stdout };
    let v = c
        .exec(
            &id,
            &waited_sh("echo 'alice:x:1234:1234::/home/alice:/bin/sh' >> /etc/passwd"),
        )
        .expect("exec");
    assert_eq!(v.exit_code, Some(0), "{v:?}");
    assert_eq!(run_as("alice"), "1234\n");
    // Settled (older than a second): now served from what the agent kept.
    std::thread::sleep(Duration::from_millis(2100));
    assert_eq!(run_as("alice"), "1234\n");
    let v = c
        .exec(
            &id,
            &waited_sh("sed -i 's/^alice:x:1234:/alice:x:1235:/' /etc/passwd"),
        )
        .expect("exec");
    assert_eq!(v.exit_code, Some(0), "{v:?}");
    assert_eq!(run_as("alice"), "1235\n");
    assert_refused(
        c.exec(&id, &as_user("bob")),
        400,
        "no_such_user",
        Some("user"),
    );
    c.delete_sandbox(&id).expect("delete");
    node.assert_clean(CLEAN);
}
