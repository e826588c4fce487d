//! The tests of the command fields: command, start_command, ready, stop.

use super::*;

#[test]
fn invalid_commands() {
    let bad = |c: Value| err(json!({ "command": c }));
    let cmd = is(InvalidField, "command");
    assert_eq!(bad(json!("")), cmd);
    assert_eq!(bad(json!([])), cmd);
    assert_eq!(bad(json!([""])), cmd);
    assert_eq!(bad(json!(["", "x"])), cmd);
    assert_eq!(bad(json!("a\u{0}b")), cmd);
    assert_eq!(bad(json!(["ls", "a\u{0}"])), cmd);
    assert_eq!(bad(json!(["ls", 1])), cmd);
    assert_eq!(bad(json!(1)), cmd);
    assert_eq!(bad(json!({"sh": "x"})), cmd);
    let too_many: Vec<String> = (0..=MAX_ARGS).map(|i| i.to_string()).collect();
    assert_eq!(bad(json!(too_many)), cmd);
    let just_enough: Vec<String> = (0..MAX_ARGS).map(|i| i.to_string()).collect();
    assert!(matches!(
        ok(json!({ "command": just_enough })).command,
        Command::Argv(a) if a.len() == MAX_ARGS
    ));
    // Later arguments may be empty.
    ok(json!({"command": ["echo", ""]}));
}

#[test]
fn command_display_and_argv() {
    let c = Command::Argv(vec!["echo".into(), "a b".into()]);
    assert_eq!(c.display(), "echo a b");
    assert_eq!(c.argv(), vec!["echo", "a b"]);
    let s = Command::Shell("echo hi | wc".into());
    assert_eq!(s.display(), "echo hi | wc");
    assert_eq!(s.argv(), vec!["/bin/sh", "-c", "echo hi | wc"]);
    let long = Command::Shell("é".repeat(2000));
    assert_eq!(long.display().chars().count(), 1024);
    let exact = Command::Shell("x".repeat(1024));
    assert_eq!(exact.display().len(), 1024);
    let args = Command::Argv(vec!["a".repeat(1000), "b".repeat(100)]);
    assert_eq!(args.display().len(), 1024);
    assert!(args.display().ends_with(&format!(" {}", "b".repeat(23))));
}

#[test]
fn start_command_rules() {
    let r = ok(with(json!({"start_command": ["/app", "--port", "80"]})));
    assert!(matches!(r.start_command, Some(Command::Argv(_))));
    assert_eq!(
        field_err(json!({"start_command": ""})),
        is(InvalidField, "start_command")
    );
    assert_eq!(
        field_err(json!({"start_command": ["", "x"]})),
        is(InvalidField, "start_command")
    );
    assert_eq!(
        field_err(json!({"start_command": "x".repeat(MAX_START_COMMAND_BYTES + 1)})),
        is(InvalidField, "start_command")
    );
    assert_eq!(
        field_err(json!({"start_command": ["a".repeat(40_000), "b".repeat(40_000)]})),
        is(InvalidField, "start_command")
    );
    ok(with(
        json!({"start_command": "x".repeat(MAX_START_COMMAND_BYTES)}),
    ));
    assert_eq!(
        field_err(json!({"start": "yes"})),
        is(InvalidField, "start")
    );
}

#[test]
fn ready_shapes() {
    let r = ok(with(
        json!({"start": true, "ready": {"tcp": {"port": 5432}}}),
    ));
    assert_eq!(r.ready, Some(Ready::Tcp { port: 5432 }));
    let r = ok(with(
        json!({"start_command": "x", "ready": {"http": {"port": 80}}}),
    ));
    assert_eq!(
        r.ready,
        Some(Ready::Http {
            port: 80,
            path: "/".into()
        })
    );
    let r = ok(with(
        json!({"start": true, "ready": {"command": "pg_isready"}}),
    ));
    assert_eq!(
        r.ready,
        Some(Ready::Command(Command::Shell("pg_isready".into())))
    );
    let bad = |ready: Value| field_err(json!({"start": true, "ready": ready}));
    assert_eq!(bad(json!({})), is(InvalidField, "ready"));
    assert_eq!(bad(json!("tcp")), is(InvalidField, "ready"));
    assert_eq!(
        bad(json!({"tcp": {"port": 1}, "command": "x"})),
        is(InvalidField, "ready")
    );
    assert_eq!(bad(json!({"tcp": {}})), is(InvalidField, "ready.tcp.port"));
    assert_eq!(bad(json!({"tcp": 80})), is(InvalidField, "ready.tcp"));
    assert_eq!(
        bad(json!({"tcp": {"port": 0}})),
        is(InvalidField, "ready.tcp.port")
    );
    assert_eq!(
        bad(json!({"tcp": {"port": 65536}})),
        is(InvalidField, "ready.tcp.port")
    );
    assert_eq!(
        bad(json!({"http": {"port": 80, "path": "health"}})),
        is(InvalidField, "ready.http.path")
    );
    assert_eq!(
        bad(json!({"http": {"port": 80, "path": 1}})),
        is(InvalidField, "ready.http.path")
    );
    assert_eq!(
        bad(json!({"command": ""})),
        is(InvalidField, "ready.command")
    );
}

#[test]
fn stop_rules() {
    let stop = |s: Value| field_err(json!({ "stop": s }));
    assert_eq!(stop(json!("TERM")), is(InvalidField, "stop"));
    assert_eq!(
        stop(json!({"signal": "SIGCHLD"})),
        is(InvalidField, "stop.signal")
    );
    assert_eq!(
        stop(json!({"signal": "NOPE"})),
        is(InvalidField, "stop.signal")
    );
    assert_eq!(
        stop(json!({"signal": "sigterm"})),
        is(InvalidField, "stop.signal")
    );
    assert_eq!(stop(json!({"signal": 15})), is(InvalidField, "stop.signal"));
    assert_eq!(
        stop(json!({"grace_ms": 600_001})),
        is(InvalidField, "stop.grace_ms")
    );
    assert_eq!(
        stop(json!({"grace_ms": -1})),
        is(InvalidField, "stop.grace_ms")
    );
    for name in STOP_SIGNALS {
        let r = ok(with(json!({"stop": {"signal": name}})));
        assert_eq!(r.stop.and_then(|s| s.signal).as_deref(), Some(name));
        let r = ok(with(json!({"stop": {"signal": &name[3..]}})));
        assert_eq!(r.stop.and_then(|s| s.signal).as_deref(), Some(name));
    }
    let s = ok(with(json!({"stop": {"signal": null}}))).stop;
    assert_eq!(s, Some(Stop::default()));
    assert_eq!(Stop::default().grace_ms_or_default(), 10_000);
    assert_eq!(Stop::default().signal_number(), None);
}
