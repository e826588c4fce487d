//! The client against a tiny HTTP server on loopback that answers canned wire answers (the
//! node's shapes): what it sends, how it types answers and errors, and how an event stream
//! that drops is read on. The real proof is the CLI's tests against a real node (sandboxd's
//! `it` tests); these pin what a real node is not made to do on purpose (drop a stream
//! midway).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use sbx_api::{Command, ErrorCode, ExecRequest, RunRequest, SandboxCreate};
use sbx_client::{Client, Code, Error, ExecEvent, PullEvent, Upload};
use serde_json::{json, Value};

/// A request as the server read it.
#[derive(Clone, Debug)]
struct Seen {
    method: String,
    target: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("a JSON body")
    }
}

/// What the server writes back: a whole answer, or bytes after which it hangs up.
enum Answer {
    Full {
        status: u16,
        headers: Vec<(&'static str, String)>,
        body: Vec<u8>,
    },
    /// A head announcing an event stream, these bytes, then the connection is cut.
    Cut(Vec<u8>),
}

fn json_answer(status: u16, v: Value) -> Answer {
    Answer::Full {
        status,
        headers: vec![("content-type", "application/json".into())],
        body: v.to_string().into_bytes(),
    }
}

fn events_answer(events: &str) -> Answer {
    Answer::Full {
        status: 200,
        headers: vec![("content-type", "text/event-stream".into())],
        body: events.as_bytes().to_vec(),
    }
}

/// A server that answers each connection's one request with the next of `answers`.
struct Server {
    url: String,
    seen: Arc<Mutex<Vec<Seen>>>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    fn start(answers: Vec<Answer>) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a port");
        let url = format!("http://{}", listener.local_addr().expect("its address"));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let thread = std::thread::spawn(move || {
            for answer in answers {
                let Ok((conn, _)) = listener.accept() else {
                    return;
                };
                let req = read_request(&conn);
                log.lock().expect("the log").push(req);
                write_answer(conn, answer);
            }
        });
        Server {
            url,
            seen,
            thread: Some(thread),
        }
    }

    /// The requests read, once every answer is written.
    fn requests(mut self) -> Vec<Seen> {
        if let Some(t) = self.thread.take() {
            t.join().expect("the server");
        }
        self.seen.lock().expect("the log").clone()
    }
}

fn read_request(conn: &TcpStream) -> Seen {
    let mut r = BufReader::new(conn);
    let mut line = String::new();
    r.read_line(&mut line).expect("a request line");
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or_default().to_string();
    let target = parts.next().unwrap_or_default().to_string();
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        r.read_line(&mut h).expect("a header");
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    let get = |name: &str| {
        headers
            .iter()
            .find(|(k, _): &&(String, String)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    };
    let mut body = Vec::new();
    if let Some(n) = get("content-length").and_then(|v| v.parse::<usize>().ok()) {
        body.resize(n, 0);
        r.read_exact(&mut body).expect("the body");
    } else if get("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).expect("a chunk's size");
            let n = usize::from_str_radix(size.trim(), 16).expect("a size");
            let mut chunk = vec![0; n + 2];
            r.read_exact(&mut chunk).expect("a chunk");
            if n == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
    }
    Seen {
        method,
        target,
        headers,
        body,
    }
}

fn write_answer(mut conn: TcpStream, a: Answer) {
    match a {
        Answer::Full {
            status,
            headers,
            body,
        } => {
            let mut head = format!("HTTP/1.1 {status} X\r\ncontent-length: {}\r\n", body.len());
            for (k, v) in headers {
                head.push_str(&format!("{k}: {v}\r\n"));
            }
            head.push_str("connection: close\r\n\r\n");
            let _ = conn.write_all(head.as_bytes());
            let _ = conn.write_all(&body);
        }
        Answer::Cut(bytes) => {
            let head =
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
            let _ = conn.write_all(head.as_bytes());
            let _ = conn.write_all(&bytes);
        }
    }
    let _ = conn.flush();
    let _ = conn.shutdown(std::net::Shutdown::Both);
}

fn exec_object(status: &str, exit_code: Option<i32>, end: u64) -> Value {
    json!({
        "id": "exe-aaaaaaaaaaaaaaaa", "object": "exec", "sandbox_id": "sbx-bbbbbbbbbbbbbbbb",
        "command": "x", "tty": false, "status": status, "exit_code": exit_code,
        "signal": null, "started_at": "2026-01-01T00:00:00.000Z", "pid": 7,
        "duration_seconds": exit_code.map(|_| 0.5), "usage": null,
        "output": {"stdout_bytes": end, "stderr_bytes": 0, "start": 0, "end": end},
        "stdout": "", "stderr": "", "truncated": false, "encoding": "utf8",
    })
}

fn event(kind: &str, id: u64, data: &Value) -> String {
    sbx_api::sse_event(kind, id, data)
}

fn error_body(code: &str, param: Option<&str>) -> Value {
    let c = ErrorCode::from_code(code).expect("a code");
    json!({"error": {"type": c.error_type(), "code": code, "message": "no such thing",
        "param": param, "retryable": c.retryable(), "request_id": "req-1", "docs_url": null}})
}

#[test]
fn the_node_s_error_body_is_typed_and_kept_apart_from_other_failures() {
    let mut a = json_answer(503, error_body("memory_full", None));
    if let Answer::Full { headers, .. } = &mut a {
        headers.push(("retry-after", "2".into()));
    }
    let s = Server::start(vec![
        json_answer(404, error_body("sandbox_not_found", Some("id"))),
        a,
        Answer::Full {
            status: 502,
            headers: vec![],
            body: b"<html>bad gateway</html>".to_vec(),
        },
        json_answer(200, json!({"not": "a sandbox"})),
    ]);
    let c = Client::new(&s.url);
    let e = c.sandbox("nosuch").unwrap_err();
    let n = e.node().expect("the node's error");
    assert_eq!(
        (
            n.status,
            &n.code,
            n.param.as_deref(),
            n.request_id.as_deref()
        ),
        (
            404,
            &Code::Api(ErrorCode::SandboxNotFound),
            Some("id"),
            Some("req-1")
        )
    );
    assert_eq!(e.to_string(), "sandbox_not_found: no such thing (param id)");
    assert!(!e.retryable());
    let e = c.sandbox("x").unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::MemoryFull));
    assert!(e.retryable());
    assert_eq!(e.node().unwrap().retry_after, Some(Duration::from_secs(2)));
    let e = c.sandbox("x").unwrap_err();
    assert!(matches!(&e, Error::Status { status: 502, body } if body.contains("bad gateway")));
    assert_eq!(e.to_string(), "the node answered 502");
    let e = c.sandbox("x").unwrap_err();
    assert!(matches!(e, Error::Decode(_)), "{e:?}");
    let seen = s.requests();
    assert_eq!(seen[0].target, "/v1/sandboxes/nosuch");
    // Nobody at the address: a transport failure, retryable.
    let e = Client::new("http://127.0.0.1:1").sandbox("x").unwrap_err();
    assert!(matches!(e, Error::Transport(_)) && e.retryable(), "{e:?}");
    assert!(e.to_string().starts_with("cannot reach the node: "), "{e}");
}

#[test]
fn requests_are_sbx_api_s_bodies_with_the_call_s_headers() {
    let sandbox = json!({"id": "sbx-bbbbbbbbbbbbbbbb", "object": "sandbox", "name": "dev",
        "status": "running", "image": "base", "limits": {"vcpus": 1, "memory_bytes": 536870912},
        "hostname": "sbx-bbbbbbbbbbbbbbbb", "metadata": {}, "env": {}, "secret_env": [],
        "created_at": "t", "started_at": "t", "expires_at": null, "failure_code": null,
        "failure": null, "restarts": 0, "template": "base", "egress": null, "public_ports": [],
        "public_ports_except": null, "preview_url": null, "paused": false,
        "sleep_after_seconds": 30.0, "sleep_notice_ms": null, "sleep_hold_max_ms": 30000,
        "runtime": null, "token": "sbt_x", "a_newer_field": {"kept": true}});
    let s = Server::start(vec![
        json_answer(201, sandbox.clone()),
        json_answer(201, exec_object("running", None, 0)),
    ]);
    let c = Client::new(&s.url)
        .api_key(Some("k1".into()))
        .idempotent("key-1");
    let mut spec = RunRequest::new(Command::Argv(Vec::new()));
    spec.name = Some("dev".into());
    spec.env.insert("A".into(), "1".into());
    let create = SandboxCreate {
        spec,
        network: None,
    };
    let got = c.create_sandbox(&create).unwrap();
    assert_eq!(got.token.get().map(String::as_str), Some("sbt_x"));
    // Written back, the answer is what the node sent, the keys this client does not name
    // kept.
    assert_eq!(serde_json::to_value(&got).unwrap(), sandbox);
    let mut exec = ExecRequest::new(Command::Shell("echo hi".into()));
    exec.timeout = Some(Duration::from_millis(2007));
    c.exec("dev", &exec).unwrap();
    let seen = s.requests();
    assert_eq!(
        (seen[0].method.as_str(), seen[0].target.as_str()),
        ("POST", "/v1/sandboxes")
    );
    assert_eq!(seen[0].json(), create.to_json());
    assert_eq!(seen[0].header("authorization"), Some("Bearer k1"));
    assert_eq!(seen[0].header("idempotency-key"), Some("key-1"));
    assert_eq!(seen[0].header("content-type"), Some("application/json"));
    assert_eq!(seen[1].target, "/v1/sandboxes/dev/exec");
    assert_eq!(
        seen[1].json(),
        json!({"command": "echo hi", "timeout_seconds": 2.007})
    );
    assert_eq!(sbx_api::parse_exec_request(&seen[1].body), Ok(exec));
}

#[test]
fn an_output_stream_that_drops_is_read_on_from_its_last_event() {
    let first = [
        event("start", 0, &exec_object("running", None, 0)),
        ": keepalive\n\n".to_string(),
        event("stdout", 3, &json!({"data": "hi\n", "position": 0})),
        // Cut midway through an event: it is not taken.
        "event: stdout\nid: 6\ndata: {\"da".to_string(),
    ]
    .concat();
    let second = [
        event("stdout", 6, &json!({"data": "yo\n", "position": 3})),
        event("gap", 10, &json!({"from": 6, "to": 10})),
        event("exit", 10, &exec_object("exited", Some(0), 10)),
    ]
    .concat();
    let s = Server::start(vec![
        Answer::Cut(first.into_bytes()),
        events_answer(&second),
    ]);
    let c = Client::new(&s.url);
    let events = c
        .output_stream("dev", "exe-aaaaaaaaaaaaaaaa", 0, sbx_api::Encoding::Utf8)
        .unwrap()
        .max_reconnects(3, Duration::from_millis(10));
    let got: Vec<ExecEvent> = events.map(|e| e.expect("an event")).collect();
    let out: String = got
        .iter()
        .filter_map(|e| match e {
            ExecEvent::Stdout(d) => Some(d.data.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(out, "hi\nyo\n");
    assert!(matches!(got[0], ExecEvent::Start(_)));
    assert!(matches!(got[3], ExecEvent::Gap(g) if (g.from, g.to) == (6, 10)));
    assert!(matches!(&got[4], ExecEvent::Exit(o) if o.exit_code == Some(0)));
    assert_eq!(got.len(), 5);
    let seen = s.requests();
    assert_eq!(seen[0].header("accept"), Some("text/event-stream"));
    assert_eq!(seen[0].header("last-event-id"), None);
    assert_eq!(
        seen[1].target,
        "/v1/sandboxes/dev/exec/exe-aaaaaaaaaaaaaaaa/output"
    );
    assert_eq!(seen[1].header("last-event-id"), Some("3"));
}

#[test]
fn a_run_stream_that_drops_ends_and_an_error_event_is_the_node_s_error() {
    let cut = event("start", 0, &exec_object("running", None, 0));
    let failed = [
        event("start", 0, &exec_object("running", None, 0)),
        event("error", 0, &error_body("command_lost", None)),
        event("stdout", 3, &json!({"data": "after\n", "position": 0})),
    ]
    .concat();
    let s = Server::start(vec![Answer::Cut(cut.into_bytes()), events_answer(&failed)]);
    let c = Client::new(&s.url);
    let run = RunRequest::new(Command::Shell("x".into()));
    let got: Vec<_> = c.run_stream(&run).unwrap().collect();
    assert!(matches!(got[0], Ok(ExecEvent::Start(_))));
    assert!(
        matches!(got[1], Err(Error::StreamEnded { reconnects: 0 })),
        "{got:?}"
    );
    assert_eq!(got.len(), 2);
    let got: Vec<_> = c.run_stream(&run).unwrap().collect();
    assert_eq!(got.len(), 2, "nothing after the error event: {got:?}");
    let e = got[1].as_ref().unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::CommandLost));
    assert_eq!(e.node().unwrap().status, 409);
    let seen = s.requests();
    assert_eq!(seen.len(), 2, "a /v1/run stream is never read on");
    assert_eq!(seen[0].json(), json!({"command": "x", "stream": true}));
}

#[test]
fn a_sandbox_run_stream_is_read_on_from_the_command_its_start_names() {
    let first = [
        event("start", 0, &exec_object("running", None, 0)),
        event("stdout", 2, &json!({"data": "a\n", "position": 0})),
    ]
    .concat();
    let second = event("exit", 2, &exec_object("exited", Some(3), 2));
    let s = Server::start(vec![
        Answer::Cut(first.into_bytes()),
        events_answer(&second),
    ]);
    let c = Client::new(&s.url);
    let exec = ExecRequest::new(Command::Shell("x".into()));
    let done = c
        .exec_run_stream("dev", &exec)
        .unwrap()
        .max_reconnects(2, Duration::from_millis(10))
        .wait(|_, _| Ok(()), |_| {})
        .unwrap();
    assert_eq!(done.exit_code, Some(3));
    let seen = s.requests();
    assert_eq!(seen[0].target, "/v1/sandboxes/dev/run");
    // By the ids the start event gave, not the name the call used.
    assert_eq!(
        seen[1].target,
        "/v1/sandboxes/sbx-bbbbbbbbbbbbbbbb/exec/exe-aaaaaaaaaaaaaaaa/output"
    );
    assert_eq!(seen[1].header("last-event-id"), Some("2"));
}

#[test]
fn a_stream_that_keeps_dropping_ends_after_its_reconnections() {
    let s = Server::start(vec![
        Answer::Cut(Vec::new()),
        Answer::Cut(Vec::new()),
        Answer::Cut(Vec::new()),
    ]);
    let c = Client::new(&s.url);
    let got: Vec<_> = c
        .follow_output("dev", "exe-aaaaaaaaaaaaaaaa", 5, sbx_api::Encoding::Utf8)
        .max_reconnects(2, Duration::from_millis(10))
        .collect();
    assert!(
        matches!(got[..], [Err(Error::StreamEnded { reconnects: 2 })]),
        "{got:?}"
    );
    let seen = s.requests();
    assert_eq!(seen.len(), 3);
    assert!(seen.iter().all(|r| r.header("last-event-id") == Some("5")));
}

#[test]
fn files_go_as_streams_both_ways() {
    // Bytes that come from a reader as the upload is sent: 5 MiB that are never in one
    // buffer of the client's.
    struct Counting {
        at: u64,
        len: u64,
    }
    impl Read for Counting {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = buf.len().min((self.len - self.at) as usize).min(7919);
            for (i, b) in buf[..n].iter_mut().enumerate() {
                *b = ((self.at as usize + i) % 251) as u8;
            }
            self.at += n as u64;
            Ok(n)
        }
    }
    let counting = |len| Counting { at: 0, len };
    let len = 5u64 << 20;
    let written = json!({"object": "file", "name": "blob", "path": "/w/blob", "type": "file",
        "size": len, "mode": "0600", "uid": 0, "gid": 0, "modified_at": "t", "target": null,
        "bytes_written": len, "created": true});
    let content: Vec<u8> = (0..100_000u32).map(|i| (i % 7) as u8).collect();
    let s = Server::start(vec![
        json_answer(201, written),
        Answer::Full {
            status: 200,
            headers: vec![("content-type", "application/octet-stream".into())],
            body: content.clone(),
        },
        json_answer(404, error_body("path_not_found", Some("path"))),
    ]);
    let c = Client::new(&s.url);
    let opts = Upload {
        mode: Some("0600".into()),
        parents: true,
        owner: None,
    };
    let w = c
        .upload("dev", "/w/blob", &opts, counting(len), Some(len))
        .unwrap();
    assert_eq!(
        (w.bytes_written, w.created, w.entry.kind.as_str()),
        (len, true, "file")
    );
    let mut d = c.download("dev", "/w/a b", None).unwrap();
    assert_eq!(d.len, Some(content.len() as u64));
    let mut got = Vec::new();
    d.read_to_end(&mut got).unwrap();
    assert_eq!(got, content);
    assert_eq!(c.stat_if_any("dev", "/nope").unwrap(), None);
    let seen = s.requests();
    assert_eq!(seen[0].method, "PUT");
    assert_eq!(
        seen[0].target,
        "/v1/sandboxes/dev/files?path=%2Fw%2Fblob&parents=true&mode=0600"
    );
    assert_eq!(
        seen[0].header("content-type"),
        Some("application/octet-stream")
    );
    assert_eq!(seen[0].body.len() as u64, len);
    let mut want = Vec::new();
    counting(len).read_to_end(&mut want).unwrap();
    assert!(seen[0].body == want);
    assert_eq!(seen[1].target, "/v1/sandboxes/dev/files?path=%2Fw%2Fa+b");
}

#[test]
fn a_pull_s_events_are_typed() {
    let events = [
        event(
            "progress",
            0,
            &json!({"layer": "sha256:ab", "done": 1, "total": 2}),
        ),
        event(
            "done",
            1,
            &json!({"reference": "docker.io/library/x:1", "digest": "sha256:cd",
            "layers": 1, "templates_forgotten": 0}),
        ),
    ]
    .concat();
    let failed = event(
        "error",
        0,
        &json!({"code": "registry_auth_failed", "message": "no"}),
    );
    let s = Server::start(vec![events_answer(&events), events_answer(&failed)]);
    let c = Client::new(&s.url);
    let got: Vec<PullEvent> = c
        .pull_image("x:1", Some("reg"))
        .unwrap()
        .map(|e| e.unwrap())
        .collect();
    assert_eq!(
        got[0],
        PullEvent::Progress {
            layer: "sha256:ab".into(),
            done: 1,
            total: 2
        }
    );
    assert!(matches!(&got[1], PullEvent::Done(p) if p.digest.as_deref() == Some("sha256:cd")));
    let got: Vec<PullEvent> = c
        .pull_image("x:1", None)
        .unwrap()
        .map(|e| e.unwrap())
        .collect();
    assert!(matches!(&got[..], [PullEvent::Failed { code, .. }] if code == "registry_auth_failed"));
    let seen = s.requests();
    assert_eq!(
        seen[0].json(),
        json!({"image": "x:1", "image_pull_secret": "reg"})
    );
}
