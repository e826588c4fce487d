//! The iii engine worker (`--iii-url`): a node against an engine-protocol peer played by this
//! test (the iii engine is not installable here), on a loopback port. The peer speaks the
//! engine's side of the iii-sdk protocol (WebSocket, JSON text frames; iii-sdk
//! `src/protocol.rs`): it reads the `registerfunction` frames, answers with `workerregistered`,
//! sends `invokefunction` and reads the `invocationresult`, then drops the connection and
//! waits for the worker to come back (`reattach`, then every registration again).

mod common;

use std::collections::BTreeSet;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use common::TestNode;
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

    // An invocation gets its result.
    let r = invoke(
        &mut ws,
        &node,
        "00000000-0000-4000-8000-000000000001",
        "sandbox::run",
        json!({"image": "python", "lang": "python", "code": "print(2+2)"}),
    );
    assert!(r.get("error").is_none(), "{r}");
    assert_eq!(r["result"]["stdout"], "4\n", "{r}");
    assert_eq!(r["result"]["exit_code"], 0, "{r}");
    assert_eq!(r["result"]["success"], true, "{r}");

    // An error: the S-code, and the interface's whole error body in the message.
    let r = invoke(
        &mut ws,
        &node,
        "00000000-0000-4000-8000-000000000002",
        "sandbox::exec",
        json!({"sandbox_id": "sbx-0000000000000000", "cmd": "true"}),
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
    let r = invoke(
        &mut ws,
        &node,
        "00000000-0000-4000-8000-000000000003",
        "sandbox::list",
        json!({}),
    );
    assert!(r["result"]["sandboxes"].is_array(), "{r}");
}
