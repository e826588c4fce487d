//! The tests of `POST /v1/run`'s parsing: the body as a whole, the order of the checks and the
//! checks across fields; [`command`] and [`fields`] test the fields one by one.

mod command;
mod fields;

use super::*;

#[test]
fn seconds_to_ms_rounds_up_to_at_least_one() {
    assert_eq!(seconds_to_ms(MIN_TIMEOUT_SECONDS), 1);
    assert_eq!(seconds_to_ms(0.0015), 2);
    assert_eq!(seconds_to_ms(0.5), 500);
    // A decimal's product a hair above its whole number is that number.
    assert_eq!(seconds_to_ms(2.007), 2007);
    assert_eq!(seconds_to_ms(2056.11), 2_056_110);
    assert_eq!(seconds_to_ms(2.0071), 2008);
    assert_eq!(seconds_to_ms(DEFAULT_TIMEOUT_SECONDS), 300_000);
    assert_eq!(seconds_to_ms(MAX_SECONDS), 1_000_000_000_000);
    assert_eq!(seconds_to_ms(0.0), 1);
    assert_eq!(seconds_to_ms(1e-9), 1);
}
use serde_json::json;

fn ok(body: Value) -> RunRequest {
    match parse_run_request(body.to_string().as_bytes()) {
        Ok(r) => r,
        Err(e) => panic!("{body}: {e:?}"),
    }
}

fn err(body: Value) -> (ErrorCode, Option<String>) {
    match parse_run_request(body.to_string().as_bytes()) {
        Ok(r) => panic!("{body} was taken: {r:?}"),
        Err(e) => (e.code, e.param),
    }
}

fn with(extra: Value) -> Value {
    let mut body = json!({"command": "true"});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    body
}

fn field_err(extra: Value) -> (ErrorCode, Option<String>) {
    err(with(extra))
}

fn is(code: ErrorCode, param: &str) -> (ErrorCode, Option<String>) {
    (code, Some(param.to_owned()))
}

use ErrorCode::*;

#[test]
fn command_env_and_cwd_sizes_are_checked_at_validation() {
    let big = "x".repeat(MAX_ARG_BYTES + 1);
    let fits = "x".repeat(MAX_ARG_BYTES);
    assert_eq!(err(json!({ "command": big })), is(InvalidField, "command"));
    assert_eq!(
        err(json!({ "command": ["echo", big] })),
        is(InvalidField, "command")
    );
    assert!(parse_run_request(json!({ "command": fits }).to_string().as_bytes()).is_ok());
    // A 10 MB command, argv, env or cwd: 400, never a command lost at the agent.
    let huge = "y".repeat(10 << 20);
    assert_eq!(err(json!({ "command": huge })), is(InvalidField, "command"));
    assert_eq!(
        field_err(json!({ "env": { "A": huge } })),
        is(InvalidEnv, "env.A")
    );
    assert_eq!(
        field_err(json!({ "secret_env": { "S": huge } })),
        is(InvalidEnv, "secret_env.S")
    );
    assert_eq!(
        field_err(json!({ "cwd": format!("/{huge}") })),
        is(InvalidField, "cwd")
    );
    // Each part fits, together they do not.
    let args: Vec<String> = (0..3).map(|_| "z".repeat(100 << 10)).collect();
    assert_eq!(err(json!({ "command": args })), is(InvalidField, "command"));
    let env: serde_json::Map<String, Value> = (0..3)
        .map(|i| (format!("E{i}"), json!("z".repeat(100 << 10))))
        .collect();
    assert_eq!(
        field_err(json!({ "env": env })),
        is(InvalidField, "command")
    );
    // A create checks its env the same way.
    let e = crate::parse_sandbox_create(json!({ "env": { "A": huge } }).to_string().as_bytes())
        .unwrap_err();
    assert_eq!((e.code, e.param.as_deref()), (InvalidEnv, Some("env.A")));
}

#[test]
fn users_are_ids_a_sandbox_has() {
    for u in [
        "65536",
        "0:999999999",
        "4294967295",
        "1000:65536",
        "99999999999999999999",
    ] {
        assert_eq!(
            field_err(json!({ "user": u })),
            is(NoSuchUser, "user"),
            "{u}"
        );
    }
    for u in [
        "0",
        "65535",
        "0:0",
        "1000:1000",
        "root",
        "nobody",
        "a1:2",
        "user:65536x",
    ] {
        assert!(
            parse_run_request(with(json!({ "user": u })).to_string().as_bytes()).is_ok(),
            "{u}"
        );
    }
    assert!(user_ids_in_range("65535:65535"));
    assert!(!user_ids_in_range("65535:65536"));
}

#[test]
fn timeouts_are_at_least_a_millisecond() {
    for t in [json!(1e-320), json!(0.0009), json!(0), json!(-1)] {
        assert_eq!(
            field_err(json!({ "timeout_seconds": t })),
            is(InvalidField, "timeout_seconds"),
            "{t}"
        );
    }
    assert_eq!(
        ok(with(json!({ "timeout_seconds": 0.001 }))).timeout,
        std::time::Duration::from_millis(1)
    );
}

#[test]
fn defaults() {
    let r = ok(json!({"command": "echo hi"}));
    assert_eq!(r.command, Command::Shell("echo hi".into()));
    assert_eq!(r.timeout, std::time::Duration::from_secs(300));
    assert_eq!(r.encoding, Encoding::Utf8);
    assert_eq!(r.tmp, Tmp::Disk);
    assert_eq!(r.on_expiry, OnExpiry::Delete);
    assert_eq!(r.limits, Limits::default());
    assert!(!r.project_network && !r.held_asleep && !r.wait_for_reader);
    assert_eq!(r.stdin, None);
    assert_eq!(r.stream, None);
    assert_eq!(r.start, None);
    assert_eq!(r.sleep_after_seconds, None);
    assert_eq!(r.region, None);
    assert!(r.env.is_empty() && r.secret_env.0.is_empty() && r.metadata.is_empty());
    assert!(r.volumes.is_empty() && r.public_ports.is_empty());
    assert_eq!(r.public_ports_except, None);
    assert_eq!(r.stop, None);
}

#[test]
fn nulls_count_as_not_given() {
    let mut body = serde_json::Map::new();
    for f in RUN_FIELDS {
        body.insert(f.to_owned(), Value::Null);
    }
    body.insert("command".into(), json!(["ls", "-l"]));
    let r = ok(Value::Object(body));
    assert_eq!(r.command, Command::Argv(vec!["ls".into(), "-l".into()]));
    assert_eq!(r.timeout, std::time::Duration::from_secs(300));
    assert_eq!(r.sleep_after_seconds, Some(None));
}

#[test]
fn everything_given() {
    let r = ok(json!({
        "command": ["python3", "-c", "print(1)"],
        "start": true,
        "start_command": "nginx -g 'daemon off;'",
        "ready": {"http": {"port": 8080, "path": "/healthz"}},
        "egress": {"default": "deny", "allow": ["example.com"], "deny_ports": [25]},
        "guest_mitigations": true,
        "tmp": "memory",
        "runtime": {"ulimits": {"nofile": 1024}, "shm_size_bytes": 1048576},
        "project_network": true,
        "image": "python:3.12",
        "image_pull_secret": "ghcr-login",
        "limits": {"vcpus": 2, "memory_bytes": 536870912u64},
        "name": "my-run",
        "env": {"FOO": "bar", "EMPTY": ""},
        "metadata": {"team": "a"},
        "volumes": [{"path": "/data", "volume": "vol-0123456789abcdef", "read_only": true, "copy": null}],
        "public_ports": [8080, 8080, 3000],
        "public_ports_except": [],
        "inbound": [],
        "sleep_after_seconds": 60,
        "expires_at": "2030-01-01T00:00:00Z",
        "on_expiry": "hold",
        "held_asleep": true,
        "sleep_notice_ms": 0,
        "sleep_hold_max_ms": 900000,
        "suspend_after_ms": 1000,
        "wake_daily_at": "23:59",
        "checkpoint": {},
        "delete_after_idle_ms": 1000,
        "hostname": "box.internal",
        "stop": {"signal": "INT", "grace_ms": 600000},
        "secret_env": {"TOKEN": "s3cret"},
        "cwd": "/srv",
        "user": "1000:1000",
        "timeout_seconds": 0.5,
        "stdin": "aGk=",
        "encoding": "base64",
        "stream": false,
        "wait_for_reader": true,
        "region": "eu",
    }));
    assert_eq!(
        r.ready,
        Some(Ready::Http {
            port: 8080,
            path: "/healthz".into()
        })
    );
    assert_eq!(r.tmp, Tmp::Memory);
    assert_eq!(r.limits.vcpus, Some(2));
    assert_eq!(r.limits.memory_bytes, Some(512 << 20));
    assert_eq!(r.env.get("FOO").map(String::as_str), Some("bar"));
    assert_eq!(r.volumes.len(), 1);
    assert!(r.volumes[0].read_only && !r.volumes[0].copy);
    assert_eq!(r.public_ports, vec![8080, 3000]);
    assert_eq!(r.public_ports_except, Some(vec![]));
    assert_eq!(r.sleep_after_seconds, Some(Some(60.0)));
    assert_eq!(r.on_expiry, OnExpiry::Hold);
    assert_eq!(
        r.stop,
        Some(Stop {
            signal: Some("SIGINT".into()),
            grace_ms: Some(600_000)
        })
    );
    assert_eq!(r.stop.as_ref().and_then(Stop::signal_number), Some(2));
    assert_eq!(r.timeout, std::time::Duration::from_millis(500));
    assert_eq!(r.stdin, Some(b"hi".to_vec()));
    assert_eq!(r.encoding, Encoding::Base64);
    assert_eq!(r.stream, Some(false));
    assert_eq!(r.region, Some(Region::Eu));
    assert_eq!(r.user.as_deref(), Some("1000:1000"));
    assert!(r.egress.is_some() && r.runtime.is_some() && r.checkpoint.is_some());
    let dbg = format!("{r:?}");
    assert!(!dbg.contains("s3cret"), "{dbg}");
    assert!(dbg.contains("TOKEN"));
}

#[test]
fn not_json_object_is_invalid_json() {
    for body in [
        &b"not json"[..],
        b"",
        b"[]",
        b"\"x\"",
        b"1",
        b"null",
        b"{",
        b"\xff",
    ] {
        let e = parse_run_request(body).unwrap_err();
        assert_eq!(e.code, InvalidJson);
        assert_eq!(e.param, None);
        assert_eq!(e.status(), 400);
    }
}

#[test]
fn too_large_body() {
    let body = vec![b' '; MAX_BODY_BYTES + 1];
    assert_eq!(parse_run_request(&body).unwrap_err().code, BodyTooLarge);
}

#[test]
fn unknown_fields() {
    assert_eq!(field_err(json!({"tty": true})), is(UnknownField, "tty"));
    assert_eq!(
        field_err(json!({"stdin_open": true})),
        is(UnknownField, "stdin_open")
    );
    // unknown_field comes before missing_command and before any field's check.
    assert_eq!(err(json!({"nope": 1})), is(UnknownField, "nope"));
    assert_eq!(
        field_err(json!({"timeout_seconds": -1, "zzz": 1})),
        is(UnknownField, "zzz")
    );
    assert_eq!(
        field_err(json!({"limits": {"gpus": 1}})),
        is(UnknownField, "limits.gpus")
    );
    assert_eq!(
        field_err(json!({"stop": {"signal": "TERM", "after": 1}})),
        is(UnknownField, "stop.after")
    );
    assert_eq!(
        field_err(json!({"volumes": [{"path": "/a", "volume": "v", "mode": "rw"}]})),
        is(UnknownField, "volumes[0].mode")
    );
    assert_eq!(
        field_err(json!({"start": true, "ready": {"tcp": {"port": 1}, "udp": 1}})),
        is(UnknownField, "ready.udp")
    );
    assert_eq!(
        field_err(json!({"start": true, "ready": {"tcp": {"port": 1, "host": "x"}}})),
        is(UnknownField, "ready.tcp.host")
    );
    assert_eq!(
        field_err(json!({"runtime": {"cap_add": []}})),
        is(UnknownField, "runtime.cap_add")
    );
}

#[test]
fn missing_command() {
    assert_eq!(err(json!({})), is(MissingCommand, "command"));
    assert_eq!(err(json!({"command": null})), is(MissingCommand, "command"));
    let e = parse_run_request(b"{}").unwrap_err();
    assert_eq!(e.status(), 400);
}

#[test]
fn ambiguous_source() {
    assert_eq!(
        field_err(json!({"image": "a", "snapshot": "s"})),
        is(AmbiguousSource, "snapshot")
    );
    assert_eq!(
        field_err(json!({"image": "a", "template": "t"})),
        is(AmbiguousSource, "template")
    );
    assert_eq!(
        field_err(json!({"snapshot": "s", "template": "t"})),
        is(AmbiguousSource, "template")
    );
    // Cross-field checks come after every field's own.
    assert_eq!(
        field_err(json!({"image": "a", "snapshot": "s", "cwd": "rel"})),
        is(InvalidField, "cwd")
    );
    // null is not given.
    ok(with(json!({"image": "a", "snapshot": null})));
}

#[test]
fn image_pull_secret_needs_image() {
    assert_eq!(
        field_err(json!({"image_pull_secret": "creds"})),
        is(InvalidField, "image_pull_secret")
    );
    assert_eq!(
        field_err(json!({"snapshot": "s", "image_pull_secret": "creds"})),
        is(InvalidField, "image_pull_secret")
    );
    ok(with(json!({"image": "a", "image_pull_secret": "creds"})));
}

#[test]
fn invalid_start() {
    assert_eq!(
        field_err(json!({"ready": {"tcp": {"port": 80}}})),
        is(InvalidStart, "ready")
    );
    assert_eq!(
        field_err(json!({"start": false, "ready": {"tcp": {"port": 80}}})),
        is(InvalidStart, "ready")
    );
    assert_eq!(
        field_err(json!({"start": false, "start_command": "x"})),
        is(InvalidStart, "start_command")
    );
    assert_eq!(
        field_err(json!({"init": "systemd", "start": true})),
        is(InvalidStart, "start")
    );
    assert_eq!(
        field_err(json!({"init": "systemd", "start_command": "x"})),
        is(InvalidStart, "start_command")
    );
    assert_eq!(
        field_err(json!({"snapshot": "s", "start": false})),
        is(InvalidStart, "start")
    );
    assert_eq!(
        field_err(json!({"template": "t", "runtime": {}})),
        is(InvalidStart, "runtime")
    );
    assert_eq!(
        field_err(json!({"snapshot": "s", "init": "systemd"})),
        is(InvalidStart, "init")
    );
    // ambiguous_source is checked first.
    assert_eq!(
        field_err(json!({"image": "a", "snapshot": "s", "ready": {"command": "x"}})),
        is(AmbiguousSource, "snapshot")
    );
    ok(with(
        json!({"start": true, "start_command": "x", "ready": {"command": "true"}}),
    ));
    ok(with(json!({"start": false})));
    ok(with(json!({"init": "systemd", "image": "debian"})));
}

#[test]
fn checks_run_in_spec_order() {
    // Several bad fields: the first in the spec's order is the answer.
    assert_eq!(
        field_err(json!({"region": "xx", "timeout_seconds": 0, "name": "BAD", "tmp": "x"})),
        is(InvalidField, "tmp")
    );
    assert_eq!(
        field_err(json!({"region": "xx", "timeout_seconds": 0, "name": "BAD"})),
        is(InvalidName, "name")
    );
    assert_eq!(
        field_err(json!({"region": "xx", "timeout_seconds": 0})),
        is(InvalidField, "timeout_seconds")
    );
    assert_eq!(
        err(json!({"command": "", "name": "BAD"})),
        is(InvalidField, "command")
    );
    assert_eq!(err(json!({"name": "BAD"})), is(MissingCommand, "command"));
}

#[test]
fn idempotency_keys() {
    assert!(validate_idempotency_key("a").is_ok());
    assert!(validate_idempotency_key(&"k".repeat(255)).is_ok());
    assert!(validate_idempotency_key(&"é".repeat(255)).is_ok());
    for bad in [String::new(), "k".repeat(256)] {
        let e = validate_idempotency_key(&bad).unwrap_err();
        assert_eq!(e.code, InvalidIdempotencyKey);
        assert_eq!(e.param.as_deref(), Some("Idempotency-Key"));
        assert_eq!(e.status(), 400);
    }
}

#[test]
fn parse_run_value_takes_a_value() {
    let r = parse_run_value(&json!({"command": ["true"]}));
    assert!(r.is_ok());
    assert_eq!(parse_run_value(&json!([1])).unwrap_err().code, InvalidJson);
}

#[test]
fn a_built_request_is_the_parse_of_its_fields() {
    let cmd = Command::Argv(vec!["echo".into(), "hi".into()]);
    let parsed = parse_run_value(&json!({ "command": ["echo", "hi"] })).unwrap();
    assert_eq!(RunRequest::new(cmd.clone()), parsed);
    let mut built = RunRequest::new(cmd);
    built.check().unwrap();
    built.image = Some("base".into());
    built.name = Some("job-1".into());
    built.limits.vcpus = Some(2);
    built.limits.memory_bytes = Some(256 << 20);
    built.env.insert("A".into(), "1".into());
    built.timeout = std::time::Duration::from_millis(1500);
    built.check().unwrap();
    let parsed = parse_run_value(&json!({
        "command": ["echo", "hi"],
        "image": "base",
        "name": "job-1",
        "limits": { "vcpus": 2, "memory_bytes": 256 << 20 },
        "env": { "A": "1" },
        "timeout_seconds": 1.5,
    }))
    .unwrap();
    assert_eq!(built, parsed);
}

#[test]
fn a_built_request_is_refused_as_its_body_would_be() {
    // Each change to a good request, and the same field in a body: one code and param.
    type Change = fn(&mut RunRequest);
    let cases: [(Change, Value); 8] = [
        (
            |r| r.command = Command::Shell(String::new()),
            json!({ "command": "" }),
        ),
        (
            |r| r.name = Some("Bad_Name".into()),
            json!({ "name": "Bad_Name" }),
        ),
        (
            |r| r.limits.vcpus = Some(0),
            json!({ "limits": { "vcpus": 0 } }),
        ),
        (
            |r| r.limits.memory_bytes = Some(100),
            json!({ "limits": { "memory_bytes": 100 } }),
        ),
        (
            |r| {
                r.env.insert("A=B".into(), "1".into());
            },
            json!({ "env": { "A=B": "1" } }),
        ),
        (|r| r.cwd = Some("rel".into()), json!({ "cwd": "rel" })),
        (
            |r| r.timeout = std::time::Duration::ZERO,
            json!({ "timeout_seconds": 0 }),
        ),
        (|r| r.image = Some("a b".into()), json!({ "image": "a b" })),
    ];
    for (change, body) in cases {
        let mut built = RunRequest::new(Command::Shell("true".into()));
        change(&mut built);
        let b = built.check().unwrap_err();
        let mut obj = body.as_object().unwrap().clone();
        obj.entry("command").or_insert(json!("true"));
        let p = parse_run_value(&Value::Object(obj)).unwrap_err();
        assert_eq!(
            (b.code, b.param.clone()),
            (p.code, p.param.clone()),
            "{body}"
        );
    }
}
