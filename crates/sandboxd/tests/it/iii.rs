//! The iii engine worker (`--iii-url`).
//!
//! `real_engine_serves_the_functions` runs the real iii engine (its binary from `III_BIN`;
//! test.sh sets it from `../shared/tools/iii` when that file is there) and calls the functions
//! through `iii trigger`. No registry serves the engine, so a user's machine may not have it:
//! the other test plays the engine, with the frames the real one sends, on a loopback port.
//!
//! The played peer speaks the
//! engine's side of the iii-sdk protocol (WebSocket, JSON text frames; iii-sdk
//! `src/protocol.rs`): it reads the `registerfunction` frames, answers with `workerregistered`,
//! sends `invokefunction` and reads the `invocationresult`, then drops the connection and
//! waits for the worker to come back (`reattach`, then every registration again).

use std::collections::BTreeSet;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::common::{self, TestNode};
use serde_json::{json, Value};
use tungstenite::{Message, WebSocket};

type Ws = WebSocket<TcpStream>;

/// Accepts the worker's next connection (within `within`).
fn accept(listener: &TcpListener, within: Duration, node: &TestNode) -> Ws {
    listener.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + within;
    let stream = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(
                    Instant::now() < deadline,
                    "the worker did not connect to the engine\n{}",
                    node.log_tail(40)
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("accept: {e}"),
        }
    };
    stream.set_nonblocking(false).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    tungstenite::accept(stream).expect("the WebSocket handshake")
}

/// The next JSON frame of the worker, or None when `until` passes.
fn next(ws: &mut Ws, until: Instant) -> Option<Value> {
    while Instant::now() < until {
        match ws.read() {
            Ok(Message::Text(t)) => return Some(serde_json::from_str(t.as_str()).unwrap()),
            Ok(Message::Binary(b)) => return Some(serde_json::from_slice(&b).unwrap()),
            Ok(_) => {}
            Err(tungstenite::Error::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => panic!("the worker's connection: {e}"),
        }
    }
    None
}

/// Reads frames until `want` has seen one it likes; returns every frame read.
fn read_until(
    ws: &mut Ws,
    within: Duration,
    node: &TestNode,
    what: &str,
    mut want: impl FnMut(&Value) -> bool,
) -> Vec<Value> {
    let until = Instant::now() + within;
    let mut seen = Vec::new();
    loop {
        let Some(f) = next(ws, until) else {
            panic!(
                "no {what} within {within:?}; frames: {seen:#?}\n{}",
                node.log_tail(40)
            );
        };
        seen.push(f.clone());
        if want(&f) {
            return seen;
        }
    }
}

fn send(ws: &mut Ws, frame: Value) {
    ws.send(Message::Text(frame.to_string().into())).unwrap();
}

/// Reads the registrations until every function is registered; checks each one's schemas.
fn registrations(ws: &mut Ws, node: &TestNode, functions: &BTreeSet<String>) -> Vec<Value> {
    let mut got = BTreeSet::new();
    let frames = read_until(ws, Duration::from_secs(10), node, "registrations", |f| {
        if f["type"] == "registerfunction" {
            got.insert(f["id"].as_str().unwrap_or_default().to_string());
        }
        functions.is_subset(&got)
    });
    for f in frames.iter().filter(|f| f["type"] == "registerfunction") {
        let id = f["id"].as_str().unwrap();
        assert!(
            functions.contains(id),
            "registered {id}, not a function of the node"
        );
        assert_eq!(f["request_format"]["type"], "object", "{f}");
        assert!(f["request_format"]["properties"].is_object(), "{f}");
        assert_eq!(f["response_format"]["type"], "object", "{f}");
        assert!(f["response_format"]["properties"].is_object(), "{f}");
        assert!(f["description"].is_string(), "{f}");
    }
    frames
}

/// The engine's `invokefunction`, as the real engine sends it (captured from iii v0.23.0-rc.4):
/// the caller's payload with the engine's `_caller_worker_id` added ("standard metadata"), and
/// the queue bridges' `__traceparent` / `__baggage` when `bridged`.
fn invoke_as_engine(
    ws: &mut Ws,
    node: &TestNode,
    inv: &str,
    function: &str,
    mut data: Value,
    bridged: bool,
) -> Value {
    data["_caller_worker_id"] = json!("6f1c2a9e-0b7d-4c1e-9a53-2d8e4f7b1c00");
    if bridged {
        data["__traceparent"] = json!("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        data["__baggage"] = json!("tenant=t1");
    }
    invoke(ws, node, inv, function, data)
}

fn invoke(ws: &mut Ws, node: &TestNode, inv: &str, function: &str, data: Value) -> Value {
    send(
        ws,
        json!({"type": "invokefunction", "invocation_id": inv, "function_id": function, "data": data}),
    );
    let frames = read_until(ws, Duration::from_secs(20), node, "invocationresult", |f| {
        f["type"] == "invocationresult" && f["invocation_id"] == inv
    });
    let r = frames.last().unwrap().clone();
    assert_eq!(r["function_id"], function, "{r}");
    r
}

#[test]
fn iii_worker_registers_serves_and_reconnects() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("ws://{}", listener.local_addr().unwrap());
    let node = TestNode::start_with(&["--iii-url", &url, "--warm-pool", "0"]);

    // The functions the node serves, from its own HTTP interface.
    let info = node.post("/v1/functions/sandbox::adapter::info", &[], b"{}");
    assert_eq!(info.status, 200, "{}", info.text());
    let functions: BTreeSet<String> = info.json()["info"]["functions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap().to_string())
        .collect();
    assert_eq!(functions.len(), 17, "{functions:?}");
    assert!(functions.iter().all(|f| f.starts_with("sandbox::")));

    // Registration: every function, with its schemas.
    let mut ws = accept(&listener, Duration::from_secs(15), &node);
    let frames = registrations(&mut ws, &node, &functions);
    let run = frames
        .iter()
        .find(|f| f["type"] == "registerfunction" && f["id"] == "sandbox::run")
        .unwrap();
    let required = &run["request_format"]["required"];
    for k in ["image", "lang", "code"] {
        assert!(required.as_array().unwrap().contains(&json!(k)), "{run}");
    }
    assert_eq!(
        run["response_format"]["properties"]["stdout"]["type"],
        "string"
    );
    send(
        &mut ws,
        json!({"type": "workerregistered", "worker_id": "w-1", "reattach_token": "tok-1"}),
    );

    // An invocation gets its result (the engine's own fields are ignored).
    let r = invoke_as_engine(
        &mut ws,
        &node,
        "00000000-0000-4000-8000-000000000001",
        "sandbox::run",
        json!({"image": "python", "lang": "python", "code": "print(2+2)"}),
        true,
    );
    assert!(r.get("error").is_none(), "{r}");
    assert_eq!(r["result"]["stdout"], "4\n", "{r}");
    assert_eq!(r["result"]["exit_code"], 0, "{r}");
    assert_eq!(r["result"]["success"], true, "{r}");

    // An error: the S-code, and the interface's whole error body in the message.
    let r = invoke_as_engine(
        &mut ws,
        &node,
        "00000000-0000-4000-8000-000000000002",
        "sandbox::exec",
        json!({"sandbox_id": "sbx-0000000000000000", "cmd": "true"}),
        false,
    );
    assert!(r.get("result").is_none(), "{r}");
    assert_eq!(r["error"]["code"], "S002", "{r}");
    let body: Value = serde_json::from_str(r["error"]["message"].as_str().unwrap()).unwrap();
    assert_eq!(body["code"], "S002", "{body}");
    assert_eq!(body["type"], "validation", "{body}");
    assert_eq!(body["retryable"], false, "{body}");
    assert!(
        body["docs_url"].as_str().unwrap().ends_with("S002"),
        "{body}"
    );
    assert!(!body["message"].as_str().unwrap().is_empty(), "{body}");

    // A field the caller sent that the function does not take is still refused.
    let r = invoke_as_engine(
        &mut ws,
        &node,
        "00000000-0000-4000-8000-000000000004",
        "sandbox::list",
        json!({"bogus": 1}),
        false,
    );
    assert_eq!(r["error"]["code"], "S001", "{r}");
    assert!(
        r["error"]["message"].as_str().unwrap().contains("bogus"),
        "{r}"
    );
    assert!(
        node.log_text()
            .contains("6f1c2a9e-0b7d-4c1e-9a53-2d8e4f7b1c00"),
        "the caller's worker id is logged with the invocation"
    );

    // The engine goes away: the worker comes back, reattaches and registers everything again.
    let _ = ws.close(None);
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until && !matches!(ws.read(), Err(tungstenite::Error::ConnectionClosed))
    {
    }
    drop(ws);
    let mut ws = accept(&listener, Duration::from_secs(15), &node);
    let frames = registrations(&mut ws, &node, &functions);
    let first = frames
        .iter()
        .find(|f| f["type"] != "registerfunction")
        .cloned();
    assert_eq!(
        frames.first().map(|f| f["type"].clone()),
        Some(json!("reattach")),
        "the first frame of a reconnect: {first:?}"
    );
    assert_eq!(frames[0]["previous_worker_id"], "w-1");
    assert_eq!(frames[0]["reattach_token"], "tok-1");

    // And it serves on the new connection.
    let r = invoke_as_engine(
        &mut ws,
        &node,
        "00000000-0000-4000-8000-000000000003",
        "sandbox::list",
        json!({}),
        false,
    );
    assert!(r["result"]["sandboxes"].is_array(), "{r}");
}

// ---- the real engine ----

/// An iii engine of its own: a config in a temporary directory, listening for workers on a
/// loopback port; killed and its directory removed when dropped.
struct Engine {
    bin: std::path::PathBuf,
    dir: std::path::PathBuf,
    port: u16,
    child: Option<std::process::Child>,
}

impl Engine {
    fn start(bin: &std::path::Path) -> Engine {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = std::env::temp_dir().join(common::unique("sbx-iii-engine"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("config.yaml"),
            format!(
                "workers:\n  - name: iii-worker-manager\n    config:\n      host: 127.0.0.1\n      port: {port}\n"
            ),
        )
        .unwrap();
        let mut e = Engine {
            bin: bin.to_path_buf(),
            dir,
            port,
            child: None,
        };
        e.spawn();
        e
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("engine.log"))
            .unwrap();
        let child = std::process::Command::new(&self.bin)
            .args(["--config", "config.yaml", "--no-update-check"])
            .current_dir(&self.dir)
            .env("IIIWORKER_DISABLE_BUILTIN_DAEMONS", "1")
            .env("III_TELEMETRY_ENABLED", "false")
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start the iii engine");
        self.child = Some(child);
        // Until it listens.
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "the engine did not listen\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("engine.log")).unwrap_or_default()
    }

    /// `iii trigger FUNCTION --json PAYLOAD` through this engine: Ok(reply) or Err(the error
    /// object the engine hands back, `{code, message}`).
    fn trigger(&self, function: &str, payload: &Value) -> Result<Value, Value> {
        let out = std::process::Command::new(&self.bin)
            .args(["trigger", "--port", &self.port.to_string()])
            .args([
                "--timeout-ms",
                "60000",
                "--json",
                &payload.to_string(),
                function,
            ])
            .current_dir(&self.dir)
            .env("III_TELEMETRY_ENABLED", "false")
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run iii trigger");
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        if out.status.success() {
            return Ok(serde_json::from_str(stdout.trim())
                .unwrap_or_else(|e| panic!("{function}: not JSON ({e}): {stdout}")));
        }
        // "Error: {…}" (then possibly a backtrace), on either stream.
        let all = format!("{stdout}\n{stderr}");
        let start = all.find("Error: {").map(|i| i + "Error: ".len());
        let parsed = start.and_then(|i| {
            serde_json::Deserializer::from_str(&all[i..])
                .into_iter::<Value>()
                .next()
                .and_then(Result::ok)
        });
        Err(parsed.unwrap_or_else(|| json!({ "code": "", "message": all })))
    }

    /// The error's S-code and the interface's error body carried in its message.
    fn s_error(&self, function: &str, payload: &Value) -> (String, Value) {
        let e = self
            .trigger(function, payload)
            .expect_err(&format!("{function} {payload} should fail"));
        let code = e["code"].as_str().unwrap_or_default().to_string();
        let body = e["message"]
            .as_str()
            .and_then(|m| serde_json::from_str(m).ok())
            .unwrap_or(Value::Null);
        (code, body)
    }

    /// Calls `function` until it answers (the worker connected and registered it).
    fn wait_served(&self, node: &TestNode, function: &str, payload: &Value) -> Value {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match self.trigger(function, payload) {
                Ok(v) => return v,
                Err(e) => assert!(
                    Instant::now() < deadline,
                    "{function} not served through the engine: {e}\nnode:\n{}\nengine:\n{}",
                    node.log_tail(40),
                    self.log()
                ),
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn real_engine_serves_the_functions() {
    let Some(bin) = std::env::var_os("III_BIN").map(std::path::PathBuf::from) else {
        eprintln!("SKIPPED real_engine_serves_the_functions: III_BIN is not set (no iii engine)");
        return;
    };
    assert!(bin.is_file(), "III_BIN={} is not a file", bin.display());
    let mut engine = Engine::start(&bin);
    let url = format!("ws://127.0.0.1:{}", engine.port);
    let node = TestNode::start_with(&["--iii-url", &url, "--warm-pool", "0"]);

    // sandbox::run prints 4.
    let run = json!({"image": "python", "lang": "python", "code": "print(2+2)"});
    let r = engine.wait_served(&node, "sandbox::run", &run);
    assert_eq!(r["stdout"], "4\n", "{r}");
    assert_eq!(r["exit_code"], 0, "{r}");
    assert_eq!(r["success"], true, "{r}");

    // create + fs::write + fs::read + exec + stop.
    let c = engine
        .trigger("sandbox::create", &json!({"image": "python"}))
        .unwrap();
    let id = c["sandbox_id"].as_str().unwrap().to_string();
    assert!(common::is_id("sbx", &id), "{c}");
    let w = engine
        .trigger(
            "sandbox::fs::write",
            &json!({"sandbox_id": id, "path": "/work/a.txt", "content": "hello iii\n", "parents": true}),
        )
        .unwrap();
    assert_eq!(w["size"], 10, "{w}");
    let rd = engine
        .trigger(
            "sandbox::fs::read",
            &json!({"sandbox_id": id, "path": "/work/a.txt"}),
        )
        .unwrap();
    assert_eq!(rd["body"], "hello iii\n", "{rd}");
    let x = engine
        .trigger(
            "sandbox::exec",
            &json!({"sandbox_id": id, "argv": ["sh", "-c", "cat /work/a.txt; exit 3"]}),
        )
        .unwrap();
    assert_eq!(x["stdout"], "hello iii\n", "{x}");
    assert_eq!(x["exit_code"], 3, "{x}");
    let s = engine
        .trigger("sandbox::stop", &json!({"sandbox_id": id}))
        .unwrap();
    assert_eq!(s["stopped"], true, "{s}");
    let (code, body) = engine.s_error("sandbox::exec", &json!({"sandbox_id": id, "cmd": "true"}));
    assert_eq!(code, "S004", "{body}");

    // catalog::list.
    let cat = engine
        .trigger("sandbox::catalog::list", &json!({}))
        .unwrap();
    let names: Vec<&str> = cat["images"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|i| i["name"].as_str())
        .collect();
    assert!(names.contains(&"python"), "{cat}");

    // An S-code error with its code and body; a caller's unknown field is still S001.
    let (code, body) = engine.s_error(
        "sandbox::exec",
        &json!({"sandbox_id": "sbx-0000000000000000", "cmd": "true"}),
    );
    assert_eq!(code, "S002", "{body}");
    assert_eq!(body["code"], "S002", "{body}");
    assert_eq!(body["retryable"], false, "{body}");
    let (code, body) = engine.s_error("sandbox::list", &json!({"bogus": 1}));
    assert_eq!(code, "S001", "{body}");
    assert!(
        body["message"].as_str().unwrap().contains("bogus"),
        "{body}"
    );
    assert!(
        node.log_text().contains("caller_worker_id"),
        "the caller's worker id is logged\n{}",
        node.log_tail(20)
    );

    // The engine restarts: the worker reconnects and serves again.
    engine.kill();
    engine.spawn();
    let r = engine.wait_served(
        &node,
        "sandbox::run",
        &json!({"image": "python", "lang": "python", "code": "print(6*7)"}),
    );
    assert_eq!(r["stdout"], "42\n", "{r}");
    node.assert_clean(Duration::from_secs(10));
}
