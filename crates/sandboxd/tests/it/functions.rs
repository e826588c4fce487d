//! The functions interface: `POST /v1/functions/{function_id}` (`sandbox::*`) and `sbx call`,
//! against a real node (the fixture's), with the config file (`--config`): what runs real
//! commands and files, and what a config sets. The refusals of payloads, ids and functions
//! that need neither are checked in-process: `crates/sbx-http/src/wire_tests/functions.rs`.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::{self, TestNode};
use serde_json::{json, Value};

const DOCS: &str = "https://docs.test/sandbox#";

/// A node with this config file (TOML) and no warm pool.
fn node_with(config: &str) -> TestNode {
    let dir = std::env::temp_dir().join(common::unique("sbx-fn-cfg"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sandboxd.toml");
    std::fs::write(&path, format!("docs_base_url = \"{DOCS}\"\n{config}")).unwrap();
    let path = path.to_str().unwrap().to_string();
    // The folder goes also when the node does not start (the start panics).
    let mut scratch = Scratch(dir);
    let mut node = TestNode::start_with(&["--config", &path, "--warm-pool", "0"]);
    node.owns(std::mem::take(&mut scratch.0));
    node
}

/// A folder removed when dropped, unless handed on (emptied).
struct Scratch(std::path::PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        if !self.0.as_os_str().is_empty() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// POST /v1/functions/{f}: (status, body).
fn call(node: &TestNode, f: &str, payload: Value) -> (u16, Value) {
    let r = node.post(
        &format!("/v1/functions/{f}"),
        &[],
        &serde_json::to_vec(&payload).unwrap(),
    );
    (r.status, r.json())
}

fn ok(node: &TestNode, f: &str, payload: Value) -> Value {
    let (s, v) = call(node, f, payload.clone());
    assert_eq!(s, 200, "{f} {payload}: {v}\n{}", node.log_tail(20));
    v
}

/// Asserts the one error shape and the S-code's type, retryable, docs_url and status.
fn fails(node: &TestNode, f: &str, payload: Value, code: &str) -> Value {
    let (s, v) = call(node, f, payload.clone());
    let e = &v["error"];
    assert_eq!(e["code"], code, "{f} {payload}: {v}");
    let entry = sbx_api::s_code(code).unwrap();
    let mut keys: Vec<&str> = e.as_object().unwrap().keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["code", "docs_url", "message", "retryable", "type"]);
    assert_eq!(e["type"], entry.kind, "{v}");
    assert_eq!(e["retryable"], entry.retryable, "{v}");
    assert_eq!(e["docs_url"], format!("{DOCS}{code}"));
    assert!(!e["message"].as_str().unwrap().is_empty());
    assert_eq!(s, sbx_api::functions::kind_status(entry.kind), "{v}");
    v
}

fn create(node: &TestNode, extra: Value) -> String {
    let mut p = json!({"image": "python"});
    for (k, v) in extra.as_object().unwrap() {
        p[k] = v.clone();
    }
    let v = ok(node, "sandbox::create", p);
    assert_eq!(v["image"], "python");
    v["sandbox_id"].as_str().unwrap().to_string()
}

fn listed(node: &TestNode, id: &str) -> Option<Value> {
    ok(node, "sandbox::list", json!({}))["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["sandbox_id"] == id)
        .cloned()
}

#[test]
fn run_create_exec_list_stop_catalog_info() {
    let node = node_with(
        "image_allowlist = [\"python\", \"node\", \"py\", \"ghost\"]\n\
         [[custom_images]]\nname = \"py\"\noci_ref = \"docker.io/library/python:3.12\"\nimage = \"python\"\n\
         [[custom_images]]\nname = \"ghost\"\noci_ref = \"example.com/ghost:1\"\n",
    );
    // sandbox::run, every lang; env as a map and as K=V; stdin.
    let v = ok(
        &node,
        "sandbox::run",
        json!({"image": "python", "lang": "python", "code": "print(2+2)"}),
    );
    assert_eq!(v["stdout"], "4\n");
    assert_eq!(v["exit_code"], 0);
    assert_eq!(v["success"], true);
    assert_eq!(v["timed_out"], false);
    assert_eq!(v["stdout_truncated"], false);
    assert_eq!(v["stderr_truncated"], false);
    assert!(v["duration_ms"].is_u64());
    assert!(v.get("sandbox_id").is_none());
    let v = ok(
        &node,
        "sandbox::run",
        json!({"image": "node", "lang": "node", "code": "console.log(6*7)"}),
    );
    assert_eq!(v["stdout"], "42\n");
    let v = ok(
        &node,
        "sandbox::run",
        json!({"image": "python", "lang": "shell", "code": "echo $A-$B; cat; exit 3",
               "env": ["A=1", "B=2"], "stdin": "in"}),
    );
    assert_eq!(v["stdout"], "1-2\nin");
    assert_eq!(
        (v["exit_code"].clone(), v["success"].clone()),
        (json!(3), json!(false))
    );
    let v = ok(
        &node,
        "sandbox::run",
        json!({"image": "py", "lang": "/bin/sh", "code": "echo $X", "env": {"X": "y"}}),
    );
    assert_eq!(v["stdout"], "y\n");
    // A run over its timeout: a reply with timed_out.
    let v = ok(
        &node,
        "sandbox::run",
        json!({"image": "python", "lang": "shell", "code": "sleep 5", "timeout_ms": 300}),
    );
    assert_eq!(
        (v["timed_out"].clone(), v["success"].clone()),
        (json!(true), json!(false))
    );
    // Files and keep_sandbox: the sandbox stays, with the files in it.
    let v = ok(
        &node,
        "sandbox::run",
        json!({"image": "python", "lang": "python", "code": "import m; print(m.x)",
               "files": [{"path": "/app/m.py", "content": "x = 7"}], "keep_sandbox": true,
               "env": {"PYTHONPATH": "/app"}}),
    );
    assert_eq!(v["stdout"], "7\n", "{v}");
    let kept = v["sandbox_id"].as_str().unwrap().to_string();
    assert!(listed(&node, &kept).is_some());
    ok(&node, "sandbox::stop", json!({"sandbox_id": kept}));

    // Lifecycle.
    let sb = create(
        &node,
        json!({"cpus": 1, "memory_mb": 256, "name": "fn-dev", "env": {"G": "g"}}),
    );
    let v = ok(
        &node,
        "sandbox::exec",
        json!({"sandbox_id": sb, "cmd": "python3 --version"}),
    );
    assert!(v["stdout"].as_str().unwrap().starts_with("Python 3"), "{v}");
    // A split cmd is not a shell: $G and quotes reach echo as they are.
    let v = ok(
        &node,
        "sandbox::exec",
        json!({"sandbox_id": sb, "cmd": "echo  $G   'a b'"}),
    );
    assert_eq!(v["stdout"], "$G 'a b'\n");
    let v = ok(
        &node,
        "sandbox::exec",
        json!({"sandbox_id": sb, "cmd": "sh", "args": ["-c", "echo $G$H; pwd; cat"],
               "env": ["H=h"], "workdir": "/tmp", "stdin": "s"}),
    );
    assert_eq!(v["stdout"], "gh\n/tmp\ns");
    let v = ok(
        &node,
        "sandbox::exec",
        json!({"sandbox_id": "fn-dev", "argv": ["sh", "-c", "echo err >&2; exit 2"]}),
    );
    assert_eq!(
        (v["stderr"].clone(), v["exit_code"].clone()),
        (json!("err\n"), json!(2))
    );
    assert_eq!(v["success"], false);
    // A finished exec's slot is given back by its watcher, a moment after its reply.
    let deadline = Instant::now() + Duration::from_secs(5);
    let row = loop {
        let row = listed(&node, &sb).unwrap();
        if row["exec_in_flight"] == 0 || Instant::now() > deadline {
            break row;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(row["name"], "fn-dev");
    assert_eq!(row["image"], "python");
    assert_eq!(row["stopped"], false);
    assert_eq!(row["exec_in_progress"], false);
    assert_eq!(row["exec_in_flight"], 0);
    assert_eq!(row["exec_slots_free"], 4);
    assert!(row["age_secs"].is_u64());

    // Catalog and adapter info.
    let cat = ok(&node, "sandbox::catalog::list", json!({}));
    let names: Vec<&str> = cat["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["python", "node", "py", "ghost"]);
    assert_eq!(cat["images"][2]["kind"], "custom");
    assert_eq!(cat["images"][2]["oci_ref"], "docker.io/library/python:3.12");
    assert_eq!(cat["images"][0]["kind"], "preset");
    let info = ok(&node, "sandbox::adapter::info", json!({}));
    assert_eq!(info["contract"], "1.1");
    assert_eq!(info["info"]["contract"], "1.1");

    // Errors of this config (its allowlist, a custom image with no rootfs) and of a real
    // command; every other refusal of a payload, an id or a function is checked in-process
    // (crates/sbx-http/src/wire_tests/functions.rs).
    fails(&node, "sandbox::create", json!({"image": "base"}), "S100");
    fails(&node, "sandbox::create", json!({"image": "ghost"}), "S101");
    fails(
        &node,
        "sandbox::exec",
        json!({"sandbox_id": sb, "cmd": "sleep 5", "timeout_ms": 300}),
        "S200",
    );

    // Stop: the sandbox is gone from the list (a call on it is then S004: wire_tests).
    let v = ok(&node, "sandbox::stop", json!({"sandbox_id": sb}));
    assert_eq!(v["stopped"], true);
    assert!(listed(&node, &sb).is_none());
}

#[test]
fn fs_functions_and_their_codes() {
    let node = node_with("");
    let sb = create(&node, json!({}));
    let p = |extra: Value| {
        let mut v = json!({"sandbox_id": sb});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    };
    let v = ok(
        &node,
        "sandbox::fs::mkdir",
        p(json!({"path": "/work/a", "parents": true})),
    );
    assert_eq!(v["type"], "dir");
    let v = ok(
        &node,
        "sandbox::fs::write",
        p(json!({"path": "/work/main.py", "content": "print(1)\n"})),
    );
    assert_eq!(v["bytes_written"], 9);
    ok(
        &node,
        "sandbox::fs::write",
        p(json!({"path": "/work/bin", "content_b64": "AP8BAg=="})),
    );
    let v = ok(&node, "sandbox::fs::ls", p(json!({"path": "/work"})));
    let mut names: Vec<&str> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    names.sort_unstable();
    assert_eq!(names, ["a", "bin", "main.py"]);
    let v = ok(
        &node,
        "sandbox::fs::stat",
        p(json!({"path": "/work/main.py"})),
    );
    assert_eq!(
        (v["size"].clone(), v["mode"].clone()),
        (json!(9), json!("0644"))
    );
    let v = ok(
        &node,
        "sandbox::fs::read",
        p(json!({"path": "/work/main.py"})),
    );
    assert_eq!(v["body"], "print(1)\n");
    let url = v["content"]["url"].as_str().unwrap();
    assert_eq!(node.get(url, &[]).text(), "print(1)\n");
    let v = ok(&node, "sandbox::fs::read", p(json!({"path": "/work/bin"})));
    assert_eq!(v["content_b64"], "AP8BAg==");
    assert!(v.get("body").is_none());
    ok(
        &node,
        "sandbox::fs::write",
        p(json!({"path": "/work/empty", "content": ""})),
    );
    assert_eq!(
        ok(
            &node,
            "sandbox::fs::read",
            p(json!({"path": "/work/empty"}))
        )["body"],
        ""
    );
    // Over 1 MiB: no body inline, the content channel has it all.
    let big = "x".repeat((1 << 20) + 10);
    ok(
        &node,
        "sandbox::fs::write",
        p(json!({"path": "/work/big", "content": big})),
    );
    let v = ok(&node, "sandbox::fs::read", p(json!({"path": "/work/big"})));
    assert_eq!(v["size"], (1 << 20) + 10);
    assert!(v.get("body").is_none());
    assert_eq!(
        node.get(v["content"]["url"].as_str().unwrap(), &[])
            .body
            .len(),
        (1 << 20) + 10
    );
    let v = ok(
        &node,
        "sandbox::fs::chmod",
        p(json!({"path": "/work/main.py", "mode": "0600"})),
    );
    assert_eq!(v["changed"], 1);
    assert_eq!(
        ok(
            &node,
            "sandbox::fs::stat",
            p(json!({"path": "/work/main.py"}))
        )["mode"],
        "0600"
    );
    let v = ok(
        &node,
        "sandbox::fs::grep",
        p(json!({"path": "/work", "pattern": "print", "include": "*.py"})),
    );
    assert_eq!(v["matches"].as_array().unwrap().len(), 1, "{v}");
    let v = ok(
        &node,
        "sandbox::fs::sed",
        p(json!({"path": "/work", "pattern": "print", "replacement": "log", "include": "*.py"})),
    );
    assert_eq!(v["replacements"], 1);
    ok(
        &node,
        "sandbox::fs::mv",
        p(json!({"src": "/work/main.py", "dst": "/work/app.py"})),
    );
    assert_eq!(
        ok(
            &node,
            "sandbox::fs::read",
            p(json!({"path": "/work/app.py"}))
        )["body"],
        "log(1)\n"
    );
    ok(&node, "sandbox::fs::rm", p(json!({"path": "/work/app.py"})));

    // The codes of the files (a payload's S001 and an unknown sandbox's S002: wire_tests).
    fails(
        &node,
        "sandbox::fs::rm",
        p(json!({"path": "/", "recursive": true})),
        "S210",
    );
    fails(
        &node,
        "sandbox::fs::chmod",
        p(json!({"path": "/work/a", "mode": "0999"})),
        "S210",
    );
    fails(
        &node,
        "sandbox::fs::stat",
        p(json!({"path": "/work/nope"})),
        "S211",
    );
    fails(
        &node,
        "sandbox::fs::ls",
        p(json!({"path": "/work/bin"})),
        "S212",
    );
    fails(
        &node,
        "sandbox::fs::mkdir",
        p(json!({"path": "/work/a"})),
        "S213",
    );
    fails(
        &node,
        "sandbox::fs::rm",
        p(json!({"path": "/work"})),
        "S214",
    );
    fails(
        &node,
        "sandbox::fs::mkdir",
        p(json!({"path": "/sys/x"})),
        "S215",
    );
    fails(
        &node,
        "sandbox::fs::grep",
        p(json!({"path": "/work", "pattern": "(unclosed"})),
        "S217",
    );
    // S216: /dev/shm (64 MiB) is full.
    ok(
        &node,
        "sandbox::exec",
        p(
            json!({"argv": ["sh", "-c", "dd if=/dev/zero of=/dev/shm/fill bs=1M count=80 2>/dev/null; true"]}),
        ),
    );
    fails(
        &node,
        "sandbox::fs::write",
        p(json!({"path": "/dev/shm/more", "content": "x".repeat(1 << 16)})),
        "S216",
    );
    ok(&node, "sandbox::stop", json!({"sandbox_id": sb}));
}

#[test]
fn config_caps_and_idle_reaper() {
    let node = node_with(
        "max_concurrent_exec_per_sandbox = 1\nmax_sandboxes = 2\nmax_exec_timeout_ms = 5000\n",
    );
    let sb = create(&node, json!({"idle_timeout_secs": 0}));
    // One exec at a time: the second is S003 (retryable) while the first runs.
    let addr = node.url("/v1/functions/sandbox::exec");
    let body = json!({"sandbox_id": sb, "cmd": "sleep 2"}).to_string();
    let slow = std::thread::spawn(move || {
        ureq::post(&addr)
            .set("Content-Type", "application/json")
            .send_string(&body)
            .map(|r| r.status())
            .unwrap_or(0)
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    while listed(&node, &sb).unwrap()["exec_in_flight"] != 1 {
        assert!(
            Instant::now() < deadline,
            "the exec never showed as in flight"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let row = listed(&node, &sb).unwrap();
    assert_eq!(
        (
            row["exec_in_progress"].clone(),
            row["exec_slots_free"].clone()
        ),
        (json!(true), json!(0))
    );
    let v = fails(
        &node,
        "sandbox::exec",
        json!({"sandbox_id": sb, "cmd": "true"}),
        "S003",
    );
    assert_eq!(v["error"]["retryable"], true);
    assert_eq!(slow.join().unwrap(), 200);
    ok(
        &node,
        "sandbox::exec",
        json!({"sandbox_id": sb, "cmd": "true"}),
    );
    // max_exec_timeout_ms bounds a longer timeout_ms.
    let t = Instant::now();
    fails(
        &node,
        "sandbox::exec",
        json!({"sandbox_id": sb, "cmd": "sleep 30", "timeout_ms": 60000}),
        "S200",
    );
    assert!(t.elapsed() < Duration::from_secs(15));
    // max_sandboxes = 2.
    let idle = create(&node, json!({"idle_timeout_secs": 1}));
    fails(&node, "sandbox::create", json!({"image": "python"}), "S400");
    fails(
        &node,
        "sandbox::run",
        json!({"image": "python", "lang": "shell", "code": "true"}),
        "S400",
    );
    // The idle one is stopped after its second of quiet; activity (an exec) pushes it back.
    std::thread::sleep(Duration::from_millis(600));
    ok(
        &node,
        "sandbox::exec",
        json!({"sandbox_id": idle, "cmd": "true"}),
    );
    std::thread::sleep(Duration::from_millis(600));
    assert!(
        listed(&node, &idle).is_some(),
        "stopped although it was used"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while listed(&node, &idle).is_some() {
        assert!(
            Instant::now() < deadline,
            "the idle sandbox was not stopped"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    fails(
        &node,
        "sandbox::exec",
        json!({"sandbox_id": idle, "cmd": "true"}),
        "S004",
    );
    assert!(
        listed(&node, &sb).is_some(),
        "idle_timeout_secs = 0 keeps it"
    );
    create(&node, json!({})); // room again
    ok(&node, "sandbox::stop", json!({"sandbox_id": sb}));
}

/// `sbx call F args…`: (exit code, stdout as JSON).
fn sbx_call(node: &TestNode, args: &[&str]) -> (i32, Value) {
    let out = Command::new(common::sbx_bin())
        .arg("call")
        .args(args)
        .env("SBX_URL", node.url(""))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let v = serde_json::from_str(&text)
        .unwrap_or_else(|_| panic!("not JSON: {text}\n{}", String::from_utf8_lossy(&out.stderr)));
    (out.status.code().unwrap_or(-1), v)
}

fn sbx_ok(node: &TestNode, args: &[&str]) -> Value {
    let (code, v) = sbx_call(node, args);
    assert_eq!(code, 0, "sbx call {args:?}: {v}");
    v
}

#[test]
fn every_function_through_sbx_call() {
    let node = node_with("");
    let v = sbx_ok(
        &node,
        &[
            "sandbox::run",
            "image=python",
            "lang=python",
            "code=print(2+2)",
        ],
    );
    assert_eq!(v["stdout"], "4\n");
    let v = sbx_ok(
        &node,
        &[
            "sandbox::run",
            "--json",
            r#"{"env":{"A":"nested"}}"#,
            "image=python",
            "lang=shell",
            "code=echo $A",
            "timeout_ms=5000",
        ],
    );
    assert_eq!(v["stdout"], "nested\n");
    let sb = sbx_ok(&node, &["sandbox::create", "image=python"])["sandbox_id"]
        .as_str()
        .unwrap()
        .to_string();
    let id = format!("sandbox_id={sb}");
    let v = sbx_ok(&node, &["sandbox::exec", &id, "cmd=python3 --version"]);
    assert!(v["stdout"].as_str().unwrap().starts_with("Python 3"));
    let v = sbx_ok(&node, &["sandbox::list"]);
    assert_eq!(v["sandboxes"][0]["sandbox_id"], sb);
    sbx_ok(
        &node,
        &["sandbox::fs::mkdir", &id, "path=/work", "parents=true"],
    );
    sbx_ok(
        &node,
        &[
            "sandbox::fs::write",
            &id,
            "path=/work/main.py",
            "content=print(1)",
        ],
    );
    let v = sbx_ok(&node, &["sandbox::fs::ls", &id, "path=/work"]);
    assert_eq!(v["entries"][0]["name"], "main.py");
    assert_eq!(
        sbx_ok(&node, &["sandbox::fs::stat", &id, "path=/work/main.py"])["size"],
        8
    );
    assert_eq!(
        sbx_ok(&node, &["sandbox::fs::read", &id, "path=/work/main.py"])["body"],
        "print(1)"
    );
    sbx_ok(
        &node,
        &["sandbox::fs::chmod", &id, "path=/work/main.py", "mode=0644"],
    );
    let v = sbx_ok(
        &node,
        &["sandbox::fs::grep", &id, "path=/work", "pattern=print"],
    );
    assert_eq!(v["matches"].as_array().unwrap().len(), 1);
    assert_eq!(
        sbx_ok(
            &node,
            &[
                "sandbox::fs::sed",
                &id,
                "path=/work",
                "pattern=print",
                "replacement=log"
            ]
        )["replacements"],
        1
    );
    sbx_ok(
        &node,
        &[
            "sandbox::fs::mv",
            &id,
            "src=/work/main.py",
            "dst=/work/app.py",
        ],
    );
    sbx_ok(&node, &["sandbox::fs::rm", &id, "path=/work/app.py"]);
    let v = sbx_ok(&node, &["sandbox::catalog::list"]);
    assert_eq!(v["images"][0]["name"], "python");
    assert_eq!(
        sbx_ok(&node, &["sandbox::adapter::info"])["info"]["contract"],
        "1.1"
    );
    sbx_ok(&node, &["sandbox::stop", &id]);
    let (code, v) = sbx_call(&node, &["sandbox::exec", &id, "cmd=true"]);
    assert_eq!(code, 1);
    assert_eq!(v["error"]["code"], "S004");
    assert_eq!(v["error"]["docs_url"], format!("{DOCS}S004"));
    let (code, v) = sbx_call(
        &node,
        &[
            "sandbox::fs::read",
            "sandbox_id=sbx-0000000000000000",
            "path=/x",
        ],
    );
    assert_eq!((code, v["error"]["code"].clone()), (1, json!("S002")));
}
