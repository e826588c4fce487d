//! The control plane's listener is the node's (`sbx-listen`): a connection that sends no
//! request head, or nothing after an answer, is closed after the header and keep-alive
//! timeouts, and one past `--max-connections` is answered 503 `unavailable` and closed.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::harness::ControlPlane;

/// Everything the peer sends until it closes the connection; fails if it is still open after
/// 10 s.
fn read_to_close(s: &mut TcpStream, what: &str) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    let t0 = Instant::now();
    let mut all = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return all,
            Ok(n) => all.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return all,
            Err(e) => panic!(
                "{what}: the control plane kept the connection open {:?}: {e}",
                t0.elapsed()
            ),
        }
    }
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

#[test]
fn the_control_plane_closes_stalled_and_idle_connections_and_caps_them() {
    let cp = ControlPlane::start_args(
        None,
        None,
        &args(&[
            "--header-timeout-ms",
            "300",
            "--keepalive-timeout-ms",
            "300",
        ]),
    );
    // Nothing sent at all: closed after the header timeout.
    let mut s = TcpStream::connect(&cp.addr).expect("connect");
    assert!(read_to_close(&mut s, "no request").is_empty());
    // A head that never ends.
    let mut s = TcpStream::connect(&cp.addr).expect("connect");
    write!(s, "GET /healthz HTTP/1.1\r\nHost: {}\r\n", cp.addr).expect("write");
    assert!(read_to_close(&mut s, "a head that never ends").is_empty());
    // A keep-alive connection after its answer.
    let mut s = TcpStream::connect(&cp.addr).expect("connect");
    write!(s, "GET /healthz HTTP/1.1\r\nHost: {}\r\n\r\n", cp.addr).expect("write");
    let answer = String::from_utf8_lossy(&read_to_close(&mut s, "idle keep-alive")).to_string();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    drop(cp);

    // One connection at most: a second is answered 503 unavailable while the first is open.
    let cp = ControlPlane::start_args(None, None, &args(&["--max-connections", "1"]));
    // The first is taken (its answer came), and kept open. The harness's own health check
    // holds the one place until the control plane has seen it closed: asked again meanwhile.
    let deadline = Instant::now() + Duration::from_secs(5);
    let _first = loop {
        let mut first = TcpStream::connect(&cp.addr).expect("connect");
        write!(first, "GET /healthz HTTP/1.1\r\nHost: {}\r\n\r\n", cp.addr).expect("write");
        let mut head = [0u8; 12];
        first.read_exact(&mut head).expect("the first answer");
        if &head == b"HTTP/1.1 200" {
            break first;
        }
        assert_eq!(&head, b"HTTP/1.1 503", "the first answer");
        assert!(
            Instant::now() < deadline,
            "the one place is still taken after 5 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut second = TcpStream::connect(&cp.addr).expect("connect");
    write!(second, "GET /healthz HTTP/1.1\r\nHost: {}\r\n\r\n", cp.addr).expect("write");
    let answer = String::from_utf8_lossy(&read_to_close(&mut second, "over the cap")).to_string();
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("\"code\":\"unavailable\""), "{answer}");
    assert!(answer.contains("\"retryable\":true"), "{answer}");
}
