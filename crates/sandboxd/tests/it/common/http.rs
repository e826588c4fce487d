//! Requests to a node and its answers: [`Reply`], event streams ([`SseStream`]), the API's
//! calls (runs, sandboxes, execs, output), a raw POST over a socket, and the error body check.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::data::{b64_decode, truncate, valid_request_id};
use super::node::TestNode;

/// One server-sent event.
#[derive(Debug, Clone)]
pub struct Event {
    pub event: String,
    pub id: u64,
    pub data: Value,
}

/// An answer, whatever its status.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "the answer ({}) is not JSON: {e}: {}",
                self.status,
                truncate(&self.text(), 2000)
            )
        })
    }
}

/// An event stream being read, event by event. Dropping it hangs up.
pub struct SseStream {
    pub status: u16,
    // No test reads a stream's headers yet.
    #[allow(dead_code)]
    pub headers: Vec<(String, String)>,
    reader: BufReader<Box<dyn Read + Send + Sync + 'static>>,
}

impl SseStream {
    #[allow(dead_code)]
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The next event; `None` at the end of the stream.
    pub fn next_event(&mut self) -> Option<Event> {
        let mut event = String::new();
        let mut id = None;
        let mut data: Vec<String> = Vec::new();
        let mut seen = false;
        loop {
            let mut line = String::new();
            let n = self
                .reader
                .read_line(&mut line)
                .expect("read the event stream");
            if n == 0 {
                assert!(!seen, "the stream ended inside an event");
                return None;
            }
            let line = line.trim_end_matches('\n').trim_end_matches('\r');
            if line.is_empty() {
                if seen {
                    let text = data.join("\n");
                    let data = serde_json::from_str(&text)
                        .unwrap_or_else(|e| panic!("event {event}: data is not JSON: {e}: {text}"));
                    let id = id.unwrap_or_else(|| panic!("event {event} has no id"));
                    return Some(Event { event, id, data });
                }
                continue;
            }
            if line.starts_with(':') {
                continue;
            }
            seen = true;
            let (field, value) = line.split_once(':').unwrap_or((line, ""));
            let value = value.strip_prefix(' ').unwrap_or(value);
            match field {
                "event" => event = value.to_string(),
                "id" => {
                    id = Some(
                        value
                            .parse()
                            .unwrap_or_else(|_| panic!("event id {value:?} is not a number")),
                    )
                }
                "data" => data.push(value.to_string()),
                other => panic!("unexpected field {other:?} in the event stream"),
            }
        }
    }

    /// Every event to the end of the stream.
    pub fn rest(&mut self) -> Vec<Event> {
        let mut out = Vec::new();
        while let Some(e) = self.next_event() {
            out.push(e);
        }
        out
    }
}

impl TestNode {
    fn finish(&self, result: Result<ureq::Response, ureq::Error>) -> Reply {
        let resp = match result {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("request to the node failed: {e}\n{}", self.log_tail(30)),
        };
        let status = resp.status();
        let headers = resp
            .headers_names()
            .into_iter()
            .filter_map(|n| resp.header(&n).map(|v| (n.clone(), v.to_string())))
            .collect();
        let mut body = Vec::new();
        resp.into_reader()
            .read_to_end(&mut body)
            .expect("read the answer's body");
        Reply {
            status,
            headers,
            body,
        }
    }

    /// POST of raw bytes with headers.
    pub fn post(&self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
        let mut req = self
            .http
            .post(&self.url(path))
            .set("Content-Type", "application/json");
        for (k, v) in headers {
            req = req.set(k, v);
        }
        self.finish(req.send_bytes(body))
    }

    pub fn get(&self, path: &str, headers: &[(&str, &str)]) -> Reply {
        let mut req = self.http.get(&self.url(path));
        for (k, v) in headers {
            req = req.set(k, v);
        }
        self.finish(req.call())
    }

    /// `POST /v1/run` with headers; the whole answer.
    pub fn run_with(&self, body: &Value, headers: &[(&str, &str)]) -> Reply {
        self.post("/v1/run", headers, &serde_json::to_vec(body).unwrap())
    }

    /// `POST /v1/run`, answered as JSON: the status and the body.
    pub fn run(&self, body: &Value) -> (u16, Value) {
        let r = self.run_with(body, &[]);
        let v = r.json();
        (r.status, v)
    }

    /// `POST /v1/run` that must end with 200: the exec object.
    pub fn run_ok(&self, body: &Value) -> Value {
        let (status, v) = self.run(body);
        assert_eq!(status, 200, "run {body} answered {status}: {v}");
        assert_eq!(v["object"], "exec", "not an exec object: {v}");
        v
    }

    /// Opens a run as an event stream (`Accept: text/event-stream`), to read event by event.
    pub fn open_sse_with(&self, body: &Value, headers: &[(&str, &str)]) -> SseStream {
        let mut req = self
            .http
            .post(&self.url("/v1/run"))
            .set("Content-Type", "application/json")
            .set("Accept", "text/event-stream");
        for (k, v) in headers {
            req = req.set(k, v);
        }
        let sent = req.send_bytes(&serde_json::to_vec(body).unwrap());
        self.event_stream(&format!("run {body}"), sent)
    }

    pub fn open_sse(&self, body: &Value) -> SseStream {
        self.open_sse_with(body, &[])
    }

    /// A run as an event stream, read to its end.
    pub fn run_sse(&self, body: &Value) -> Vec<Event> {
        self.open_sse(body).rest()
    }

    /// DELETE with headers; the whole answer.
    pub fn delete(&self, path: &str, headers: &[(&str, &str)]) -> Reply {
        let mut req = self.http.delete(&self.url(path));
        for (k, v) in headers {
            req = req.set(k, v);
        }
        self.finish(req.call())
    }

    /// PATCH of a JSON value; the whole answer.
    pub fn patch_json(&self, path: &str, body: &Value) -> Reply {
        let req = self
            .http
            .request("PATCH", &self.url(path))
            .set("Content-Type", "application/json");
        self.finish(req.send_bytes(&serde_json::to_vec(body).unwrap()))
    }

    /// POST of a JSON value; the whole answer.
    pub fn post_json(&self, path: &str, body: &Value) -> Reply {
        self.post(path, &[], &serde_json::to_vec(body).unwrap())
    }

    /// `POST /v1/sandboxes` that must answer 201 with a running sandbox: the sandbox object.
    pub fn create_sandbox(&self, body: &Value) -> Value {
        let r = self.post_json("/v1/sandboxes", body);
        let v = r.json();
        assert_eq!(r.status, 201, "create {body} answered {}: {v}", r.status);
        assert_eq!(v["object"], "sandbox", "not a sandbox object: {v}");
        assert_eq!(v["status"], "running", "create {body}: {v}");
        v
    }

    /// `DELETE /v1/sandboxes/{id}` that must answer 200 with the object, status deleted.
    pub fn delete_sandbox(&self, id: &str) -> Value {
        let r = self.delete(&format!("/v1/sandboxes/{id}"), &[]);
        let v = r.json();
        assert_eq!(r.status, 200, "delete {id} answered {}: {v}", r.status);
        assert_eq!(v["status"], "deleted", "delete {id}: {v}");
        v
    }

    /// `POST /v1/sandboxes/{id}/exec` that must answer 201: the exec object.
    pub fn exec(&self, sandbox: &str, body: &Value) -> Value {
        let r = self.post_json(&format!("/v1/sandboxes/{sandbox}/exec"), body);
        let v = r.json();
        assert_eq!(r.status, 201, "exec {body} answered {}: {v}", r.status);
        assert_eq!(v["object"], "exec", "not an exec object: {v}");
        v
    }

    /// `GET …/exec/{exec_id}?wait_seconds=…` until the command has ended (at most `timeout`):
    /// its final object.
    pub fn exec_wait(&self, sandbox: &str, exec_id: &str, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let r = self.get(
                &format!("/v1/sandboxes/{sandbox}/exec/{exec_id}?wait_seconds=10"),
                &[],
            );
            let v = r.json();
            assert_eq!(r.status, 200, "get {exec_id}: {v}");
            if v["status"] != "running" {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "{exec_id} still runs after {timeout:?}: {v}"
            );
        }
    }

    /// Opens a GET as an event stream (`Accept: text/event-stream`), to read event by event.
    pub fn open_sse_get(&self, path: &str, headers: &[(&str, &str)]) -> SseStream {
        let mut req = self
            .http
            .get(&self.url(path))
            .set("Accept", "text/event-stream");
        for (k, v) in headers {
            req = req.set(k, v);
        }
        self.event_stream(&format!("GET {path}"), req.call())
    }

    /// A command's whole output through the JSON output endpoint, from position 0, paging with
    /// `next` until the end it reports (the command must have ended): the chunks' bytes of
    /// (stdout, stderr, both in position order). Panics on a gap or a chunk out of place.
    pub fn output_all(&self, sandbox: &str, exec_id: &str) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
        let (mut out, mut err, mut all) = (Vec::new(), Vec::new(), Vec::new());
        let mut from = 0u64;
        for _ in 0..10_000 {
            let r = self.get(
                &format!(
                    "/v1/sandboxes/{sandbox}/exec/{exec_id}/output?from={from}&encoding=base64"
                ),
                &[],
            );
            let v = r.json();
            assert_eq!(r.status, 200, "output of {exec_id} from {from}: {v}");
            assert_eq!(v["object"], "output", "{v}");
            assert!(v["gap"].is_null(), "a gap in the output of {exec_id}: {v}");
            let mut cursor = from;
            for c in v["chunks"].as_array().expect("chunks") {
                let pos = c["position"].as_u64().expect("position");
                assert_eq!(pos, cursor, "chunk out of place in {v}");
                let data = b64_decode(c["data"].as_str().expect("data"));
                cursor += data.len() as u64;
                match c["stream"].as_str() {
                    Some("stdout") => out.extend_from_slice(&data),
                    Some("stderr") => err.extend_from_slice(&data),
                    other => panic!("chunk of stream {other:?}: {v}"),
                }
                all.extend_from_slice(&data);
            }
            let next = v["next"].as_u64().expect("next");
            assert_eq!(next, cursor, "next is not after the last chunk: {v}");
            let end = v["end"].as_u64().expect("end");
            if next >= end {
                assert_eq!(v["exited"], true, "output of {exec_id} read while running");
                return (out, err, all);
            }
            assert!(next > from, "no progress from {from}: {v}");
            from = next;
        }
        panic!("the output of {exec_id} did not end in 10000 pages")
    }

    /// POSTs `body` to `path` asking for an event stream, to read event by event.
    pub fn open_sse_post(&self, path: &str, body: &Value) -> SseStream {
        let sent = self
            .http
            .post(&self.url(path))
            .set("Content-Type", "application/json")
            .set("Accept", "text/event-stream")
            .send_bytes(&serde_json::to_vec(body).unwrap());
        self.event_stream(&format!("POST {path} {body}"), sent)
    }

    /// The event stream `what` answered; a panic that says what came instead.
    fn event_stream(&self, what: &str, sent: Result<ureq::Response, ureq::Error>) -> SseStream {
        let resp = match sent {
            Ok(r) => r,
            Err(ureq::Error::Status(code, r)) => panic!(
                "{what} answered {code} instead of a stream: {}",
                r.into_string().unwrap_or_default()
            ),
            Err(e) => panic!("request to the node failed: {e}\n{}", self.log_tail(30)),
        };
        let status = resp.status();
        let headers: Vec<(String, String)> = resp
            .headers_names()
            .into_iter()
            .filter_map(|n| resp.header(&n).map(|v| (n.clone(), v.to_string())))
            .collect();
        let ct = resp.content_type().to_string();
        assert_eq!(
            ct,
            "text/event-stream",
            "{what}: not an event stream: {}",
            resp.into_string().unwrap_or_default()
        );
        SseStream {
            status,
            headers,
            reader: BufReader::new(resp.into_reader()),
        }
    }
}

/// `GET path`: the status and the JSON body.
pub fn get_json(node: &TestNode, path: &str) -> (u16, Value) {
    let r = node.get(path, &[]);
    (r.status, r.json())
}

/// The `stdout` of an exec object (a text one).
pub fn stdout(v: &Value) -> &str {
    v["stdout"]
        .as_str()
        .unwrap_or_else(|| panic!("no stdout: {v}"))
}

/// A raw HTTP/1.1 POST over a plain socket, for bodies a client library will not send whole:
/// the body is written from another thread while the answer is read.
pub fn raw_post(addr: &str, path: &str, body_len: usize, fill: u8) -> (u16, Value) {
    let mut sock = TcpStream::connect(addr).expect("connect to the node");
    sock.set_read_timeout(Some(Duration::from_secs(60))).ok();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {body_len}\r\nConnection: close\r\n\r\n"
    );
    sock.write_all(head.as_bytes()).expect("write the head");
    let mut writer = sock.try_clone().expect("clone the socket");
    let sender = std::thread::spawn(move || {
        let prefix = b"{\"command\":\"true\",\"stdin\":\"";
        let mut left = body_len;
        let first = &prefix[..prefix.len().min(left)];
        if writer.write_all(first).is_err() {
            return;
        }
        left -= first.len();
        let chunk = vec![fill; 1 << 20];
        while left > 0 {
            let n = left.min(chunk.len());
            if writer.write_all(&chunk[..n]).is_err() {
                return;
            }
            left -= n;
        }
    });
    let mut reader = BufReader::new(sock.try_clone().expect("clone the socket"));
    let mut status = 0u16;
    let mut content_length = None;
    loop {
        let mut line = String::new();
        let n = reader.read_line(&mut line).expect("read the answer");
        assert!(n > 0, "the node closed the connection without an answer");
        let line = line.trim_end();
        if line.is_empty() {
            if status == 100 {
                status = 0;
                continue;
            }
            break;
        }
        if let Some(rest) = line.strip_prefix("HTTP/1.1 ") {
            status = rest[..3].parse().expect("status code");
        } else if let Some((k, v)) = line.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                content_length = v.trim().parse::<usize>().ok();
            }
        }
    }
    let mut body = vec![0u8; content_length.expect("the answer has a Content-Length")];
    reader.read_exact(&mut body).expect("read the answer body");
    let _ = sock.shutdown(std::net::Shutdown::Both);
    let _ = sender.join();
    let v = serde_json::from_slice(&body).unwrap_or(Value::Null);
    (status, v)
}

/// Checks an error answer: the status, and a body of exactly
/// `{error:{type,code,message,param,retryable,request_id,docs_url}}`.
pub fn assert_error(status: u16, body: &Value, want_status: u16, code: &str, param: Option<&str>) {
    assert_eq!(
        status, want_status,
        "expected {want_status} {code}, got {status}: {body}"
    );
    let top = body
        .as_object()
        .unwrap_or_else(|| panic!("error body is not an object: {body}"));
    // secret_host_not_allowed carries allowed_hosts beside error, as the spec says.
    let beside =
        usize::from(code == "secret_host_not_allowed" && top.contains_key("allowed_hosts"));
    assert_eq!(
        top.len() - beside,
        1,
        "error body has other keys than error: {body}"
    );
    let e = body["error"]
        .as_object()
        .unwrap_or_else(|| panic!("no error object: {body}"));
    let mut keys: Vec<&str> = e.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "code",
            "docs_url",
            "message",
            "param",
            "request_id",
            "retryable",
            "type"
        ],
        "error body keys: {body}"
    );
    assert_eq!(e["code"], code, "error code: {body}");
    let want_type = match want_status {
        400 | 405 | 415 | 416 => "invalid_request",
        401 => "unauthenticated",
        403 => "forbidden",
        404 => "not_found",
        409 => "conflict",
        413 => "too_large",
        500 => "internal",
        501 => "not_implemented",
        502 => "bad_gateway",
        503 => "unavailable",
        504 => "timeout",
        _ => panic!("no error type for {want_status}"),
    };
    assert_eq!(e["type"], want_type, "error type: {body}");
    match param {
        Some(p) => assert_eq!(e["param"], p, "error param: {body}"),
        None => assert!(e["param"].is_null(), "error param should be null: {body}"),
    }
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "error message: {body}"
    );
    assert!(e["retryable"].is_boolean(), "retryable: {body}");
    assert!(
        e["request_id"].as_str().is_some_and(valid_request_id),
        "request_id: {body}"
    );
    assert!(
        e["docs_url"].is_null() || e["docs_url"].is_string(),
        "docs_url: {body}"
    );
}
