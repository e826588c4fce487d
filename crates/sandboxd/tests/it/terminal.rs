//! Terminals: a command on a PTY, driven over the node's WebSocket.

use std::time::{Duration, Instant};

use crate::common::TestNode;
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

/// A writer over a clone of `ws`'s socket, so that one thread writes while another reads (the
/// node sends no pings, so the reader never has to answer on the socket).
fn writer_of(ws: &mut Ws) -> Ws {
    let MaybeTlsStream::Plain(s) = ws.get_mut() else {
        panic!("not a plain socket");
    };
    s.set_write_timeout(Some(Duration::from_secs(120))).unwrap();
    let clone = s.try_clone().expect("clone the socket");
    tungstenite::WebSocket::from_raw_socket(
        MaybeTlsStream::Plain(clone),
        tungstenite::protocol::Role::Client,
        None,
    )
}

/// What a reader saw until the exit message, a close or `limit`: output bytes, the exit
/// message, the close frame.
struct Seen {
    output: u64,
    exit: Option<Value>,
    close: Option<Option<tungstenite::protocol::CloseFrame>>,
    error: Option<String>,
}

fn read_to_end(mut ws: Ws, limit: Duration) -> Seen {
    let deadline = Instant::now() + limit;
    let mut seen = Seen {
        output: 0,
        exit: None,
        close: None,
        error: None,
    };
    while Instant::now() < deadline {
        match ws.read() {
            Ok(Message::Binary(b)) => seen.output += b.len() as u64,
            Ok(Message::Text(t)) => {
                let v: Value = serde_json::from_str(t.as_str()).unwrap();
                if v["type"] == "exit" {
                    seen.exit = Some(v);
                }
            }
            Ok(Message::Close(c)) => {
                seen.close = Some(c);
                return seen;
            }
            Ok(_) => {}
            Err(tungstenite::Error::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(tungstenite::Error::ConnectionClosed) => return seen,
            Err(e) => {
                seen.error = Some(e.to_string());
                return seen;
            }
        }
    }
    seen
}

/// A sandbox `name` running `command` on a terminal; its exec id.
fn tty_exec(node: &TestNode, name: &str, command: &str) -> String {
    let r = node.post_json("/v1/sandboxes", &json!({ "name": name }));
    assert_eq!(r.status, 201, "{}", r.text());
    let r = node.post_json(
        &format!("/v1/sandboxes/{name}/exec"),
        &json!({ "command": command, "tty": true }),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    r.json()["id"].as_str().unwrap().to_string()
}

#[test]
fn a_flood_of_input_never_turns_output_into_protocol() {
    let node = TestNode::start();
    // Output flows while input floods in: a frame of the agent is often half read when a
    // message of the client comes.
    let id = tty_exec(
        &node,
        "tty-flood",
        "head -c 25000000 /dev/zero | tr '\\0' G; sleep 600",
    );
    let mut ws = open(&node, "tty-flood", &id);
    let mut writer = writer_of(&mut ws);
    let reader = std::thread::spawn(move || read_to_end(ws, Duration::from_secs(300)));
    // 100 messages of 256 KiB (each one a chance to come while a frame is half read): the
    // terminal echoes them while the node reads more input.
    let chunk = vec![b'G'; 256 << 10];
    for i in 0..100 {
        if let Err(e) = writer.send(Message::Binary(chunk.clone().into())) {
            panic!("the node stopped taking input after {i} messages: {e}");
        }
    }
    // The session still works: ^C reaches the command, whose end comes back.
    writer
        .send(Message::Binary(b"\x03".to_vec().into()))
        .expect("send ^C");
    let seen = reader.join().expect("the reader");
    assert!(seen.error.is_none(), "websocket: {:?}", seen.error);
    assert!(seen.output > 0, "no echo of the input");
    let exit = seen.exit.unwrap_or_else(|| {
        panic!(
            "no exit message (close {:?}); the node's log:\n{}",
            seen.close,
            node.log_tail(20)
        )
    });
    assert_eq!(exit["signal"], "SIGINT", "{exit}");
    assert!(
        !node.log_text().contains("over the limit"),
        "{}",
        node.log_tail(20)
    );
    let r = node.delete("/v1/sandboxes/tty-flood", &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn a_fragmented_message_over_the_cap_is_refused_with_a_close_frame() {
    use tungstenite::protocol::frame::coding::{Data, OpCode};
    use tungstenite::protocol::frame::Frame;
    let node = TestNode::start();
    let id = tty_exec(&node, "tty-frag", "sleep 600");
    let mut ws = open(&node, "tty-frag", &id);
    let mut writer = writer_of(&mut ws);
    let reader = std::thread::spawn(move || read_to_end(ws, Duration::from_secs(60)));
    // 64 fragments of 1 MiB, each under the frame limit, 64 MiB in all: the node must not
    // gather them.
    let chunk = vec![b'x'; 1 << 20];
    for i in 0..64 {
        let op = if i == 0 { Data::Binary } else { Data::Continue };
        let frame = Frame::message(chunk.clone(), OpCode::Data(op), i == 63);
        if writer.send(Message::Frame(frame)).is_err() {
            break; // the node closed: what is wanted
        }
    }
    let seen = reader.join().expect("the reader");
    let close = seen
        .close
        .unwrap_or_else(|| panic!("no close frame: {:?}", seen.error))
        .expect("a close frame with a code");
    assert_eq!(u16::from(close.code), 1009, "{close:?}");
    // The command is not touched by a session that ended.
    let r = node.get(&format!("/v1/sandboxes/tty-frag/exec/{id}"), &[]);
    assert_eq!(r.json()["status"], "running", "{}", r.text());
    let r = node.delete("/v1/sandboxes/tty-frag", &[]);
    assert_eq!(r.status, 200, "{}", r.text());
    node.assert_clean(Duration::from_secs(10));
}
