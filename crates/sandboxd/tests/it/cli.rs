//! The `sbx` CLI against a real node, command by command: what it prints, on which stream,
//! and the code it exits with. The CLI makes every call through sbx-client; these are the
//! proof that its typed requests and answers say what the node's JSON says.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::{self, unique, TestNode};
use serde_json::Value;

const CLEAN: Duration = Duration::from_secs(10);

/// `sbx ARGS…` against `node`, with `stdin` as its input: (exit code, stdout, stderr).
fn sbx_in(node: &TestNode, args: &[&str], stdin: &[u8]) -> (i32, String, String) {
    let mut child = Command::new(common::sbx_bin())
        .args(args)
        .env("SBX_URL", node.url(""))
        .env_remove("SBX_API_KEY")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run sbx");
    let mut input = child.stdin.take().expect("its stdin");
    let data = stdin.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = input.write_all(&data);
    });
    let out = child.wait_with_output().expect("sbx's output");
    writer.join().expect("the writer");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json(out: &str) -> Value {
    serde_json::from_str(out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

#[test]
fn sbx_run_streams_and_exits_with_the_command_s_code() {
    let node = TestNode::start();
    let sbx = |args: &[&str]| common::sbx(&node, args);
    let (c, out, err) = sbx(&["run", "--", "echo out; echo err >&2; exit 3"]);
    assert_eq!((c, out.as_str(), err.as_str()), (3, "out\n", "err\n"));
    let (c, out, err) = sbx(&[
        "run",
        "-e",
        "A=1=2",
        "--cwd",
        "/tmp",
        "-u",
        "1000",
        "--memory",
        "256m",
        "--",
        "sh",
        "-c",
        "echo $A; pwd; id -u",
    ]);
    assert_eq!((c, out.as_str()), (0, "1=2\n/tmp\n1000\n"), "{err}");
    let (c, out, err) = sbx(&["run", "--json", "--", "echo", "hi"]);
    assert_eq!(c, 0, "{err}");
    let v = json(&out);
    assert_eq!(
        (v["stdout"].as_str(), v["exit_code"].as_i64()),
        (Some("hi\n"), Some(0))
    );
    assert!(out.starts_with("{\n  \"command\": \"echo hi\",\n"), "{out}");
    let (c, _, err) = sbx(&["run", "--timeout", "0.3", "--", "sleep", "5"]);
    assert_eq!((c, err.as_str()), (137, "sbx: the command timed out\n"));
    let (c, _, err) = sbx(&["run", "--", "kill -9 $$"]);
    assert_eq!(
        (c, err.as_str()),
        (137, "sbx: the command was killed by SIGKILL\n")
    );
    // Refusals: the node's, and a deadline refused as the node words it.
    let (c, _, err) = sbx(&["run", "--name", "Bad", "--", "true"]);
    assert_eq!(c, 125);
    assert!(
        err.starts_with("sbx: invalid_name: ") && err.ends_with("(param name)\n"),
        "{err}"
    );
    let (c, _, err) = sbx(&["run", "--timeout", "0", "--", "true"]);
    assert_eq!(
        (c, err.as_str()),
        (125, "sbx: invalid_field: timeout_seconds must be a number from 0.001 (1 ms) to 1000000000 (param timeout_seconds)\n")
    );
    let (c, _, err) = common::sbx(&node, &["ls", "--url", "http://127.0.0.1:1"]);
    assert_eq!(c, 125);
    assert!(err.starts_with("sbx: cannot reach the node: "), "{err}");
    node.assert_clean(CLEAN);
}

#[test]
fn sbx_kept_sandboxes_their_commands_and_their_output() {
    let node = TestNode::start();
    let sbx = |args: &[&str]| common::sbx(&node, args);
    let name = unique("cli");
    let (c, out, err) = sbx(&[
        "create",
        "--json",
        "--name",
        &name,
        "-e",
        "K=v",
        "--metadata",
        "m=1",
    ]);
    assert_eq!(c, 0, "{err}");
    let v = json(&out);
    let id = v["id"].as_str().expect("an id").to_string();
    assert_eq!(
        (v["name"].as_str(), v["status"].as_str()),
        (Some(name.as_str()), Some("running"))
    );
    assert!(v["token"].as_str().is_some_and(|t| !t.is_empty()), "{v}");
    assert_eq!(v["env"]["K"], "v");
    let (c, _, err) = sbx(&["create", "--name", &name]);
    assert!(c == 125 && err.starts_with("sbx: name_taken: "), "{err}");
    let (c, out, _) = sbx(&["ls"]);
    assert_eq!(c, 0);
    let line = out
        .lines()
        .find(|l| l.starts_with(&id))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        line.contains(&name) && line.contains(" running ") && line.contains(" 512M "),
        "{line}"
    );
    let (_, out, _) = sbx(&["ls", "--json", "--status", "running"]);
    let all = json(&out);
    let listed = all
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == id.as_str())
        .unwrap();
    assert!(
        listed.get("token").is_none(),
        "a list has no tokens: {listed}"
    );

    // Commands: streamed, detached, as JSON, with stdin.
    let (c, out, err) = sbx(&["exec", &name, "--", "echo a; echo b >&2; exit 2"]);
    assert_eq!((c, out.as_str(), err.as_str()), (2, "a\n", "b\n"));
    let (c, out, _) = sbx(&["exec", "--json", &name, "--", "echo", "hi"]);
    assert_eq!(c, 0);
    assert_eq!(json(&out)["stdout"], "hi\n");
    let (c, out, _) = sbx(&[
        "exec",
        "-d",
        &name,
        "--",
        "for i in 1 2 3; do echo $i; sleep 0.2; done; echo e >&2",
    ]);
    assert_eq!(c, 0);
    let exe = out.trim().to_string();
    assert!(exe.starts_with("exe-"), "{out}");
    let (c, out, err) = sbx(&["logs", "-f", &name, &exe]);
    assert_eq!((c, out.as_str(), err.as_str()), (0, "1\n2\n3\n", "e\n"));
    let (c, out, err) = sbx(&["logs", &name, &exe]);
    assert_eq!((c, out.as_str(), err.as_str()), (0, "1\n2\n3\n", "e\n"));
    let (c, _, err) = sbx(&["logs", &name, "exe-0000000000000000"]);
    assert!(
        c == 125 && err.starts_with("sbx: exec_not_found: "),
        "{err}"
    );
    let input = b"twelve bytes".repeat(100_000);
    let (c, out, err) = sbx_in(&node, &["exec", "-i", &name, "--", "wc", "-c"], &input);
    assert_eq!((c, out.trim()), (0, "1200000"), "{err}");
    let (c, _, err) = sbx(&["exec", "nosuch", "--", "true"]);
    assert!(
        c == 125 && err.starts_with("sbx: sandbox_not_found: "),
        "{err}"
    );

    // Restart, the preview URL, rm.
    let (c, out, _) = sbx(&["restart", &name]);
    assert_eq!((c, out.as_str()), (0, format!("{id} running\n").as_str()));
    let (c, out, _) = sbx(&["url", &name, "8000"]);
    assert_eq!(c, 0);
    let token = v["token"].as_str().unwrap();
    assert!(
        out.trim().ends_with(&format!("/?sbx_token={token}")),
        "{out}"
    );
    let (c, out, err) = sbx(&["rm", "--json", &name, "nosuch"]);
    assert_eq!(c, 1);
    assert_eq!(json(&out)[0]["id"], id.as_str());
    assert!(err.starts_with("sbx: nosuch: sandbox_not_found: "), "{err}");
    node.assert_clean(CLEAN);
}

#[test]
fn sbx_volumes_images_and_checkpoints() {
    let node = TestNode::start();
    let sbx = |args: &[&str]| common::sbx(&node, args);
    let vol = unique("data");
    let (c, out, err) = sbx(&["volume", "create", &vol, "--size", "16m"]);
    assert_eq!(c, 0, "{err}");
    assert!(out.starts_with("vol-"), "{out}");
    let (c, out, err) = sbx(&[
        "run",
        "-v",
        &format!("{vol}:/data"),
        "--",
        "echo kept > /data/f",
    ]);
    assert_eq!(c, 0, "{out}{err}");
    let (c, out, _) = sbx(&["run", "-v", &format!("{vol}:/data:ro"), "--", "cat /data/f"]);
    assert_eq!((c, out.as_str()), (0, "kept\n"));
    let (_, out, _) = sbx(&["volume", "ls"]);
    assert!(
        out.lines()
            .any(|l| l.contains(&vol) && l.contains("16.0MiB")),
        "{out}"
    );
    let (_, out, _) = sbx(&["volume", "ls", "--json"]);
    assert_eq!(json(&out)["object"], "list");
    let (c, out, _) = sbx(&["volume", "rm", &vol]);
    assert_eq!((c, out.trim()), (0, vol.as_str()));

    let (c, out, _) = sbx(&["images"]);
    assert_eq!(c, 0);
    assert!(out.lines().any(|l| l.starts_with("base ")), "{out}");
    let (_, out, _) = sbx(&["templates", "--json"]);
    let base = &json(&out)[0];
    assert_eq!(base["key"], "base");
    // The base template's object as the node wrote it: no keys it does not have.
    assert!(base.get("digest").is_none(), "{base}");

    let name = unique("ck");
    let (c, _, err) = sbx(&["create", "--name", &name]);
    assert_eq!(c, 0, "{err}");
    let (c, out, err) = sbx(&["sleep", &name]);
    assert_eq!(c, 0, "{err}");
    assert!(out.trim().ends_with(" sleeping"), "{out}");
    let (c, out, _) = sbx(&["wake", "--json", &name]);
    assert_eq!(c, 0);
    assert_eq!(json(&out)[0]["status"], "running");
    let snap = unique("shot");
    let (c, out, err) = sbx(&["snapshot", "--name", &snap, &name]);
    assert_eq!(c, 0, "{err}");
    assert!(out.starts_with("snap-"), "{out}");
    let (_, out, _) = sbx(&["snapshot", "--ls"]);
    assert!(out.contains(&snap), "{out}");
    let (c, out, err) = sbx(&["fork", "--json", &name]);
    assert_eq!(c, 0, "{err}");
    let fork = json(&out);
    let copy = fork["sandboxes"][0]["id"]
        .as_str()
        .expect("a copy")
        .to_string();
    let (c, _, err) = sbx(&["rm", &copy, &name]);
    assert_eq!(c, 0, "{err}");
    let (c, _, _) = sbx(&["snapshot", "--rm", &snap]);
    assert_eq!(c, 0);
    if let Some(s) = fork["snapshot"]["id"].as_str() {
        sbx(&["snapshot", "--rm", s]);
    }

    node.assert_clean(CLEAN);
}
