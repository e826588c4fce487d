//! A kept sandbox's commands: stdin, signals, output, listings.

use super::*;
use sbx_api::ErrorCode;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_reaches_a_command_in_order_and_is_refused_once_closed() {
    let dir = TempDir::new("stdin");
    let world = World::new();
    let node = node_in(dir.path(), &world, |_| {});
    let s = create(&node, "{}").await.expect("create");
    let e = exec(&node, &s.id, r#"{"command":"cat","stdin_open":true}"#)
        .await
        .expect("cat");
    assert_exec(&e, ExecStatus::Running, None);
    node.exec_stdin(&s.id, &e.id, b"one ", false)
        .await
        .expect("input");
    node.exec_stdin(&s.id, &e.id, b"two", true)
        .await
        .expect("input and close");
    let o = node
        .exec_get(&s.id, &e.id, 2.0, Encoding::Utf8)
        .await
        .expect("its end");
    assert_exec(&o, ExecStatus::Exited, Some(0));
    assert_eq!(o.stdout, "one two");
    let err = node
        .exec_stdin(&s.id, &e.id, b"more", false)
        .await
        .expect_err("after the close");
    assert_eq!(err.code, ErrorCode::StdinClosed);

    // A command given its input whole reads it, then its end.
    let o = exec(
        &node,
        &s.id,
        r#"{"command":"cat","stdin":"whole","wait_seconds":2}"#,
    )
    .await
    .expect("cat");
    assert_eq!((o.exit_code, o.stdout.as_str()), (Some(0), "whole"));
    // A command given none reads nothing (no stdin to close).
    let o = exec(&node, &s.id, r#"{"command":"cat","wait_seconds":2}"#)
        .await
        .expect("cat");
    assert_eq!((o.exit_code, o.stdout.as_str()), (Some(0), ""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_ends_a_running_command_and_an_ended_one_cannot_be_signalled() {
    let dir = TempDir::new("signal");
    let world = World::new();
    let node = node_in(dir.path(), &world, |_| {});
    let s = create(&node, "{}").await.expect("create");
    let e = exec(&node, &s.id, r#"{"command":"await never"}"#)
        .await
        .expect("a command");
    node.exec_signal(&s.id, &e.id, libc::SIGTERM)
        .await
        .expect("signalled");
    let o = node
        .exec_get(&s.id, &e.id, 2.0, Encoding::Utf8)
        .await
        .expect("its end");
    assert_exec(&o, ExecStatus::Killed, Some(128 + libc::SIGTERM));
    assert_eq!(o.signal.as_deref(), Some("SIGTERM"));
    let err = node
        .exec_signal(&s.id, &e.id, libc::SIGTERM)
        .await
        .expect_err("ended");
    assert_eq!(err.code, ErrorCode::ExecEnded);
    let err = node
        .exec_signal(&s.id, "exe-nosuchcommand00", libc::SIGTERM)
        .await
        .expect_err("unknown");
    assert_eq!(err.code, ErrorCode::ExecNotFound);
    // A command's timeout ends it timed out.
    let o = exec(
        &node,
        &s.id,
        r#"{"command":"sleep 30","timeout_seconds":0.02,"wait_seconds":2}"#,
    )
    .await
    .expect("a command with a timeout");
    assert_exec(&o, ExecStatus::TimedOut, Some(128 + libc::SIGKILL));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commands_output_is_read_live_then_from_its_record_once_its_machine_is_gone() {
    let dir = TempDir::new("output");
    let world = World::new();
    let node = node_in(dir.path(), &world, |_| {});
    let s = create(&node, "{}").await.expect("create");
    let e = exec(
        &node,
        &s.id,
        r#"{"command":"echo-err oops","wait_seconds":2}"#,
    )
    .await
    .expect("a command");
    assert_eq!((e.exit_code, e.stderr.as_str()), (Some(0), "oops\n"));
    let (_, _, mut rx) = node
        .exec_output_events(&s.id, &e.id, 0, Encoding::Utf8)
        .await
        .expect("its output");
    let mut got = Vec::new();
    while let Some(ev) = rx.recv().await {
        got.push(ev);
    }
    let (exit, out, err) = ended(&got);
    assert_eq!(
        (exit.exit_code, out.as_str(), err.as_str()),
        (0, "", "oops\n")
    );

    node.restart_sandbox(&s.id).await.expect("restart");
    // Its machine is gone: its output with it; its end is what was recorded.
    let (_, _, mut rx) = node
        .exec_output_events(&s.id, &e.id, 0, Encoding::Utf8)
        .await
        .expect("its record");
    let first = rx.recv().await;
    assert!(
        matches!(first, Some(RunEvent::Gap { from: 0, to: 5 })),
        "{first:?}"
    );
    assert!(matches!(rx.recv().await, Some(RunEvent::Exited { exit, .. }) if exit.exit_code == 0));
    let list = node.exec_list(&s.id).await.expect("its commands");
    assert_eq!(list.len(), 1);
    assert_exec(&list[0], ExecStatus::Exited, Some(0));
}
