//! Terminals: a command on a PTY, driven over the node's WebSocket.

mod common;

use std::time::{Duration, Instant};

use common::TestNode;
use serde_json::{json, Value};
use tungstenite::stream::MaybeTlsStream;
use tungstenite::Message;

type Ws = tungstenite::WebSocket<MaybeTlsStream<std::net::TcpStream>>;

fn open(node: &TestNode, sandbox: &str, exec: &str) -> Ws {
    let url = node
        .url(&format!("/v1/sandboxes/{sandbox}/exec/{exec}/terminal"))
        .replacen("http", "ws", 1);
    let (mut ws, _) = tungstenite::connect(url).expect("websocket");
    if let MaybeTlsStream::Plain(s) = ws.get_mut() {
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    }
    ws
}

/// Reads output until `want` appears (or the exit message); returns all output read.
fn read_until(ws: &mut Ws, want: &str, exit: &mut Option<Value>) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = Vec::new();
    while Instant::now() < deadline {
        match ws.read() {
            Ok(Message::Binary(b)) => {
                seen.extend_from_slice(&b);
                if String::from_utf8_lossy(&seen).contains(want) {
                    break;
                }
            }
            Ok(Message::Text(t)) => {
                let v: Value = serde_json::from_str(t.as_str()).unwrap();
                if v["type"] == "exit" {
                    *exit = Some(v);
                    break;
                }
            }
            Ok(Message::Close(_)) => break,
            Ok(_) => {}
            Err(tungstenite::Error::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => panic!("websocket: {e}"),
        }
    }
    String::from_utf8_lossy(&seen).into_owned()
}

#[test]
fn a_terminal_echoes_input_and_honours_resize() {
    let node = TestNode::start();
    let r = node.post_json("/v1/sandboxes", &json!({ "name": "tty-box" }));
    assert_eq!(r.status, 201, "{}", r.text());
    let r = node.post_json(
        "/v1/sandboxes/tty-box/exec",
        &json!({ "command": "sh", "tty": true, "rows": 30, "cols": 100 }),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let exec = r.json();
    assert_eq!(exec["tty"], true, "{exec}");
    let id = exec["id"].as_str().unwrap().to_string();
    let mut ws = open(&node, "tty-box", &id);
    let mut exit = None;
    ws.send(Message::Binary(
        b"echo marker-$((6*7)); tty; stty size\n".to_vec().into(),
    ))
    .unwrap();
    let out = read_until(&mut ws, "30 100", &mut exit);
    // The terminal echoes what is typed, then the command's answers.
    assert!(out.contains("echo marker-$((6*7))"), "no echo in {out:?}");
    assert!(out.contains("marker-42"), "{out:?}");
    assert!(out.contains("/dev/pts/"), "not on a terminal: {out:?}");
    assert!(out.contains("30 100"), "{out:?}");
    ws.send(Message::Text(
        json!({ "type": "resize", "rows": 50, "cols": 132 })
            .to_string()
            .into(),
    ))
    .unwrap();
    ws.send(Message::Binary(b"stty size\n".to_vec().into()))
        .unwrap();
    let out = read_until(&mut ws, "50 132", &mut exit);
    assert!(out.contains("50 132"), "resize not seen: {out:?}");
    ws.send(Message::Binary(b"exit 7\n".to_vec().into()))
        .unwrap();
    read_until(&mut ws, "\u{0}never", &mut exit);
    let exit = exit.expect("an exit message");
    assert_eq!(exit["exit_code"], 7, "{exit}");
    assert_eq!(exit["status"], "exited", "{exit}");
    // The terminal's output is kept like any command's.
    let r = node.get(&format!("/v1/sandboxes/tty-box/exec/{id}/output"), &[]);
    let v = r.json();
    let all: String = v["chunks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["data"].as_str().unwrap().to_string())
        .collect();
    assert!(all.contains("marker-42"), "{v}");
    // A second session replays the screen from the start, then sees the end.
    let r = node.get(&format!("/v1/sandboxes/tty-box/exec/{id}/terminal"), &[]);
    assert_eq!(
        r.status,
        409,
        "an ended command has no terminal: {}",
        r.text()
    );
    let r = node.delete("/v1/sandboxes/tty-box", &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn a_command_without_a_terminal_has_no_terminal_route() {
    let node = TestNode::start();
    let r = node.post_json("/v1/sandboxes", &json!({}));
    let sb = r.json()["id"].as_str().unwrap().to_string();
    let r = node.post_json(
        &format!("/v1/sandboxes/{sb}/exec"),
        &json!({ "command": "sleep 5" }),
    );
    let id = r.json()["id"].as_str().unwrap().to_string();
    let r = node.get(&format!("/v1/sandboxes/{sb}/exec/{id}/terminal"), &[]);
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "invalid_field");
    let r = node.delete(&format!("/v1/sandboxes/{sb}"), &[]);
    assert_eq!(r.status, 200);
    node.assert_clean(Duration::from_secs(10));
}
