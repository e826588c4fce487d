//! The listener's timeouts and its cap on connections, against raw sockets on loopback: a
//! client that stalls is closed, one that keeps sending (or a stream that keeps answering) is
//! not, and connections over the cap are answered 503 at once.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::common::{assert_error, run_req, TestNode};
use sbx_client::ExecEvent;
use serde_json::{json, Value};

/// Long enough that a node that never closes fails the test instead of hanging it.
const WAIT: Duration = Duration::from_secs(20);

fn connect(node: &TestNode) -> TcpStream {
    let s = TcpStream::connect(&node.addr).expect("connect");
    s.set_read_timeout(Some(WAIT)).unwrap();
    s
}

/// Reads until the node closes the connection: what it sent. Panics when it keeps it open.
fn read_to_close(s: &mut TcpStream, what: &str) -> Vec<u8> {
    let mut all = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return all,
            Ok(n) => all.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return all,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                panic!(
                    "{what}: the node kept the connection open; got {:?}",
                    String::from_utf8_lossy(&all)
                )
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

fn status_of(answer: &[u8]) -> u16 {
    let text = String::from_utf8_lossy(answer);
    text.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no answer: {text:?}"))
}

fn body_of(answer: &[u8]) -> Value {
    let at = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("an answer head");
    serde_json::from_slice(&answer[at + 4..]).expect("a JSON body")
}

/// A node whose header, body-idle and keep-alive timeouts are all 300 ms.
fn short_timeouts_node() -> TestNode {
    TestNode::start_with(&[
        "--header-timeout-ms",
        "300",
        "--body-idle-timeout-ms",
        "300",
        "--keepalive-timeout-ms",
        "300",
    ])
}

#[test]
fn stalled_heads_bodies_and_idle_connections_are_closed() {
    let node = short_timeouts_node();
    let addr = node.addr.clone();

    // Nothing sent at all.
    let mut s = connect(&node);
    assert!(read_to_close(&mut s, "no request").is_empty());

    // A head that never ends (its bytes keep coming, slowly, but never the blank line).
    let mut s = connect(&node);
    write!(s, "GET /healthz HTTP/1.1\r\nHost: {addr}\r\n").unwrap();
    let mut closed = false;
    for _ in 0..200 {
        if s.write_all(b"X-Slow: 1\r\n").is_err() {
            closed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    if !closed {
        read_to_close(&mut s, "a head that never ends");
    }

    // A keep-alive connection after its answer.
    let mut s = connect(&node);
    write!(s, "GET /healthz HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let answer = read_to_close(&mut s, "an idle keep-alive connection");
    assert_eq!(status_of(&answer), 200);

    // A short body: the handler's read fails, the connection closes.
    let mut s = connect(&node);
    write!(
        s,
        "POST /v1/run HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: 100\r\n\r\n{{\"command\""
    )
    .unwrap();
    let answer = read_to_close(&mut s, "a short body");
    assert_eq!(
        status_of(&answer),
        400,
        "{}",
        String::from_utf8_lossy(&answer)
    );

    // A chunked body whose chunks stop coming.
    let mut s = connect(&node);
    write!(
        s,
        "POST /v1/run HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\n\r\n5\r\n{{\"com\r\n"
    )
    .unwrap();
    let answer = read_to_close(&mut s, "a chunked body that stops");
    assert_eq!(
        status_of(&answer),
        400,
        "{}",
        String::from_utf8_lossy(&answer)
    );
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn bodies_that_keep_coming_and_streams_that_keep_answering_are_not_cut() {
    let node = short_timeouts_node();
    let addr = node.addr.clone();
    // A body sent in pieces, each within the body-idle timeout, over several of them.
    let body =
        serde_json::to_vec(&json!({ "command": "echo slow", "stdin": "x".repeat(20) })).unwrap();
    let mut s = connect(&node);
    write!(
        s,
        "POST /v1/run HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .unwrap();
    for piece in body.chunks(4) {
        s.write_all(piece).unwrap();
        std::thread::sleep(Duration::from_millis(100));
    }
    let answer = read_to_close(&mut s, "a slow body");
    assert_eq!(
        status_of(&answer),
        200,
        "{}",
        String::from_utf8_lossy(&answer)
    );
    assert_eq!(body_of(&answer)["stdout"], "slow\n");

    // An event stream quiet for longer than every timeout, then its end.
    let events: Vec<ExecEvent> = node
        .client()
        .run_stream(&run_req("sleep 2; echo done"))
        .expect("a run as events")
        .collect::<Result<_, _>>()
        .expect("its events to the end");
    let Some(ExecEvent::Exit(last)) = events.last() else {
        panic!("the last event is not exit: {events:?}");
    };
    assert_eq!(last.stdout, "done\n");
    node.assert_clean(Duration::from_secs(10));
}

#[test]
fn connections_over_the_cap_are_answered_503_and_logged() {
    let node = TestNode::start_with(&["--max-connections", "4", "--keepalive-timeout-ms", "1500"]);
    let addr = node.addr.clone();
    // Idle connections: more than the cap (the fixture may hold one of its own).
    let idle: Vec<TcpStream> = (0..6).map(|_| connect(&node)).collect();
    let mut s = connect(&node);
    write!(s, "GET /healthz HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let answer = read_to_close(&mut s, "a connection over the cap");
    assert_eq!(
        status_of(&answer),
        503,
        "{}",
        String::from_utf8_lossy(&answer)
    );
    let v = body_of(&answer);
    assert_error(503, &v, 503, "unavailable", None);
    assert_eq!(v["error"]["retryable"], true);
    assert!(
        node.log_text().contains("connection cap reached"),
        "{}",
        node.log_tail(20)
    );
    // Once the idle ones time out (those over the cap were answered 503 at once), requests are
    // served again.
    for mut c in idle {
        let answer = read_to_close(&mut c, "an idle connection");
        assert!(answer.is_empty() || status_of(&answer) == 503);
    }
    let mut s = connect(&node);
    write!(
        s,
        "GET /healthz HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let answer = read_to_close(&mut s, "a request after the idle ones closed");
    assert_eq!(
        status_of(&answer),
        200,
        "{}",
        String::from_utf8_lossy(&answer)
    );
    node.assert_clean(Duration::from_secs(10));
}

/// Out of file descriptors (the probe's 720 idle connections under a 700-descriptor limit):
/// accept fails with EMFILE. The node logs it, answers through the descriptor it keeps in
/// reserve instead of leaving clients hanging, and serves again once descriptors come free.
#[test]
fn out_of_descriptors_a_request_is_answered_and_serving_resumes() {
    let node = TestNode::start_with(&[
        "--warm-pool",
        "0",
        "--max-connections",
        "1000",
        "--keepalive-timeout-ms",
        "2000",
    ]);
    let addr = node.addr.clone();
    let pid = node.pid().expect("the node's pid");
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the node's descriptors")
        .count();
    // Room for a few connections only.
    let limit = open + 12;
    let lowered = std::process::Command::new("prlimit")
        .arg("--pid")
        .arg(pid.to_string())
        .arg(format!("--nofile={limit}:{limit}"))
        .status()
        .expect("run prlimit");
    assert!(lowered.success(), "prlimit failed");
    // More idle connections than descriptors left: the kernel queues the rest.
    let idle: Vec<TcpStream> = (0..30).map(|_| connect(&node)).collect();
    let mut s = connect(&node);
    write!(
        s,
        "GET /healthz HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    // Answered, not left waiting: 503 while descriptors are out, 200 once idle ones closed.
    let answer = read_to_close(&mut s, "a request while the node is out of descriptors");
    match status_of(&answer) {
        503 => assert_error(503, &body_of(&answer), 503, "unavailable", None),
        200 => {}
        other => panic!("{other}: {}", String::from_utf8_lossy(&answer)),
    }
    assert!(
        node.log_text().contains("out of file descriptors"),
        "{}",
        node.log_tail(20)
    );
    drop(idle);
    // Serving goes on.
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let mut s = connect(&node);
        write!(
            s,
            "GET /healthz HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let answer = read_to_close(&mut s, "a request after the idle connections went");
        if status_of(&answer) == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not served again: {}",
            String::from_utf8_lossy(&answer)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let v = node
        .client()
        .run(&run_req("echo still here"))
        .expect("a run");
    assert_eq!(v.stdout, "still here\n", "{v:?}");
    node.assert_clean(Duration::from_secs(10));
}
