//! The timeouts of [`serve_conn`] against real loopback sockets, for both protocols: what is
//! idle is closed after its timeout, what keeps moving (however slowly, for however long) is
//! not.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::{Request, Response, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::{accept_loop, serve_conn, Protocol, Timeouts};

const SHORT: Duration = Duration::from_millis(300);
const LONG: Duration = Duration::from_secs(20);
/// The most a test waits for what should come after a timeout.
const AT_MOST: Duration = Duration::from_secs(5);
const TICK: Duration = Duration::from_millis(100);

/// The test's routes: `/` answers at once; `/body` reads the whole body and answers its
/// length (408 with the error when it could not be read); `/stream` streams 12 ticks, one a
/// tick; `/duplex` streams 10 ticks while it reads the body, then the body's length.
async fn handle(req: Request<Body>) -> Response<Body> {
    match req.uri().path() {
        "/body" => match req.into_body().collect().await {
            Ok(b) => Response::new(Body::from(b.to_bytes().len().to_string())),
            Err(e) => {
                let mut r = Response::new(Body::from(e.to_string()));
                *r.status_mut() = StatusCode::REQUEST_TIMEOUT;
                r
            }
        },
        "/stream" => Response::new(ticks(12, None)),
        "/duplex" => {
            let read = tokio::spawn(req.into_body().collect());
            Response::new(ticks(10, Some(read)))
        }
        _ => Response::new(Body::from("ok")),
    }
}

type BodyRead = tokio::task::JoinHandle<Result<http_body_util::Collected<Bytes>, axum::Error>>;

/// `n` chunks `tick\n`, one every [`TICK`]; then, with `read`, `body N\n` or `body error\n`.
fn ticks(n: usize, read: Option<BodyRead>) -> Body {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
    tokio::spawn(async move {
        for _ in 0..n {
            tokio::time::sleep(TICK).await;
            if tx.send(Ok(Bytes::from_static(b"tick\n"))).await.is_err() {
                return;
            }
        }
        if let Some(read) = read {
            let last = match read.await {
                Ok(Ok(b)) => format!("body {}\n", b.to_bytes().len()),
                _ => "body error\n".to_string(),
            };
            let _ = tx.send(Ok(Bytes::from(last))).await;
        }
    });
    Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// A listener serving [`handle`] with `timeouts` over `protocol`, until the test ends.
async fn listener(timeouts: Timeouts, protocol: Protocol) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("its address");
    tokio::spawn(accept_loop(
        l,
        "test listener",
        16,
        std::future::pending(),
        move |stream, peer| serve_conn(stream, peer, timeouts, protocol, None, handle),
    ));
    addr
}

fn timeouts(header: Duration, body_idle: Duration, keepalive: Duration) -> Timeouts {
    Timeouts {
        header,
        body_idle,
        keepalive,
    }
}

/// Reads until the server closes the connection (or resets it): how long that took, and what
/// came before.
async fn until_closed(s: &mut TcpStream, what: &str) -> (Duration, Vec<u8>) {
    let t0 = Instant::now();
    let mut all = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(AT_MOST, s.read(&mut buf)).await {
            Err(_) => panic!(
                "{what}: not closed after {AT_MOST:?}: {}",
                String::from_utf8_lossy(&all)
            ),
            Ok(Ok(0)) | Ok(Err(_)) => return (t0.elapsed(), all),
            Ok(Ok(n)) => all.extend_from_slice(&buf[..n]),
        }
    }
}

/// Reads one answer of `Content-Length` (HTTP/1.1): its status and body.
async fn answer(s: &mut TcpStream) -> (u16, String) {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(AT_MOST, s.read(&mut byte))
            .await
            .expect("an answer in time")
            .expect("read");
        assert_eq!(
            n,
            1,
            "closed inside the head: {}",
            String::from_utf8_lossy(&head)
        );
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status: {head}"));
    let len = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .unwrap_or_else(|| panic!("no Content-Length: {head}"));
    let mut body = vec![0u8; len];
    tokio::time::timeout(AT_MOST, s.read_exact(&mut body))
        .await
        .expect("a body in time")
        .expect("read the body");
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Closed after `t` (less a little for the timer's rounding), well before [`AT_MOST`].
fn assert_after(took: Duration, t: Duration, what: &str) {
    assert!(
        took + Duration::from_millis(50) >= t,
        "{what}: closed after {took:?}, before {t:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_sent_head_is_closed_after_the_header_timeout() {
    for protocol in [Protocol::Http1, Protocol::Http1And2] {
        let addr = listener(timeouts(SHORT, LONG, LONG), protocol).await;
        // A whole head is answered.
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        assert_eq!(
            answer(&mut s).await,
            (200, "ok".to_string()),
            "{protocol:?}"
        );
        // Half a head, then nothing: closed after the header timeout, not the keep-alive one.
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
            .await
            .expect("write");
        let (took, got) = until_closed(&mut s, &format!("{protocol:?}: half a head")).await;
        assert!(
            got.is_empty(),
            "{protocol:?}: {}",
            String::from_utf8_lossy(&got)
        );
        assert_after(took, SHORT, "half a head");
        // The same after a first request on the connection (the keep-alive timeout is long).
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        assert_eq!(answer(&mut s).await.0, 200);
        s.write_all(b"GET / HTTP/1.1\r\n").await.expect("write");
        let (took, _) = until_closed(&mut s, &format!("{protocol:?}: half a second head")).await;
        assert_after(took, SHORT, "half a second head");
    }
    // Half of HTTP/2's preface.
    let addr = listener(timeouts(SHORT, LONG, LONG), Protocol::Http1And2).await;
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(b"PRI * HTTP/2.0\r\n").await.expect("write");
    let (took, _) = until_closed(&mut s, "half a preface").await;
    assert_after(took, SHORT, "half a preface");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_without_a_request_is_closed_after_the_keepalive_timeout() {
    for protocol in [Protocol::Http1, Protocol::Http1And2] {
        let addr = listener(timeouts(LONG, LONG, SHORT), protocol).await;
        // Nothing at all.
        let mut s = TcpStream::connect(addr).await.expect("connect");
        let (took, _) = until_closed(&mut s, &format!("{protocol:?}: no request")).await;
        assert_after(took, SHORT, "no request");
        // Nothing after an answer.
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        assert_eq!(answer(&mut s).await.0, 200);
        let (took, _) = until_closed(&mut s, &format!("{protocol:?}: after an answer")).await;
        assert_after(took, SHORT - Duration::from_millis(100), "after an answer");
        // A connection that keeps asking stays open past the timeout.
        let mut s = TcpStream::connect(addr).await.expect("connect");
        let t0 = Instant::now();
        for _ in 0..6 {
            s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .expect("write");
            assert_eq!(answer(&mut s).await.0, 200, "{protocol:?}");
            tokio::time::sleep(TICK).await;
        }
        assert!(t0.elapsed() > SHORT * 2);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_body_fails_and_a_slow_one_is_read_whole() {
    for protocol in [Protocol::Http1, Protocol::Http1And2] {
        let addr = listener(timeouts(LONG, SHORT, LONG), protocol).await;
        let head = b"POST /body HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n";
        // Three bytes of ten, then nothing.
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(head).await.expect("write");
        s.write_all(b"abc").await.expect("write");
        let t0 = Instant::now();
        let (status, body) = answer(&mut s).await;
        assert_eq!(status, 408, "{protocol:?}: {body}");
        assert!(body.contains("sent nothing"), "{body}");
        assert_after(t0.elapsed(), SHORT, "a stalled body");
        // Ten bytes, one a tick: a second in all, never idle for the timeout.
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(head).await.expect("write");
        let t0 = Instant::now();
        for b in b"0123456789" {
            tokio::time::sleep(TICK).await;
            s.write_all(&[*b]).await.expect("write");
        }
        assert_eq!(
            answer(&mut s).await,
            (200, "10".to_string()),
            "{protocol:?}"
        );
        assert!(t0.elapsed() > SHORT * 2);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_streams_is_never_cut_only_idle_time_counts() {
    for protocol in [Protocol::Http1, Protocol::Http1And2] {
        // Every timeout far shorter than the exchanges.
        let addr = listener(timeouts(SHORT, SHORT, SHORT), protocol).await;
        // An answer that streams for 1.2 s.
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .expect("write");
        let (took, got) = until_closed(&mut s, &format!("{protocol:?}: stream")).await;
        let text = String::from_utf8_lossy(&got);
        assert_eq!(text.matches("tick\n").count(), 12, "{protocol:?}: {text}");
        assert!(text.ends_with("0\r\n\r\n"), "{text}");
        assert!(took > SHORT * 3, "{took:?}");
        // A body that waits while its answer streams (a stream forwarded both ways): sent
        // after half a second of ticks, it is read whole.
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(
            b"POST /duplex HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nConnection: close\r\n\r\n",
        )
        .await
        .expect("write");
        let mut seen = Vec::new();
        let mut buf = [0u8; 1024];
        while String::from_utf8_lossy(&seen).matches("tick").count() < 6 {
            let n = tokio::time::timeout(AT_MOST, s.read(&mut buf))
                .await
                .expect("ticks in time")
                .expect("read");
            assert!(n > 0, "closed: {}", String::from_utf8_lossy(&seen));
            seen.extend_from_slice(&buf[..n]);
        }
        s.write_all(b"hello").await.expect("write");
        let (_, rest) = until_closed(&mut s, &format!("{protocol:?}: duplex")).await;
        seen.extend_from_slice(&rest);
        let text = String::from_utf8_lossy(&seen);
        assert!(text.contains("body 5\n"), "{protocol:?}: {text}");
        assert_eq!(text.matches("tick\n").count(), 10, "{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_is_served_and_timed_out_as_http1() {
    let addr = listener(timeouts(SHORT, LONG, SHORT), Protocol::Http1And2).await;
    let s = TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(s),
    )
    .await
    .expect("an HTTP/2 handshake");
    let driving = tokio::spawn(conn);
    let req = Request::builder()
        .uri("http://x/stream")
        .body(http_body_util::Empty::<Bytes>::new())
        .expect("a request");
    let resp = sender.send_request(req).await.expect("an answer");
    assert_eq!(resp.status(), 200);
    let body = resp
        .into_body()
        .collect()
        .await
        .expect("its body")
        .to_bytes();
    assert_eq!(body.len(), 12 * 5, "{body:?}");
    // Nothing more asked: the connection is closed after the keep-alive timeout.
    let t0 = Instant::now();
    tokio::time::timeout(AT_MOST, driving)
        .await
        .expect("closed in time")
        .expect("the connection's task")
        .ok();
    assert_after(
        t0.elapsed(),
        SHORT - Duration::from_millis(100),
        "idle HTTP/2",
    );
}
