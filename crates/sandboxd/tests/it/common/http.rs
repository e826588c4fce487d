//! Requests to a node and its answers: the typed client of a node ([`TestNode::client`], and
//! requests built by type: [`sh`], [`run_req`], [`exec_req`], [`create_with`]), [`Reply`],
//! event streams ([`SseStream`], framed by sbx-client's reader), the fixture's calls (runs,
//! sandboxes, execs, output) through the client, raw requests for the tests of the wire (bad
//! input, headers, exact shapes), and the error body checks.

use std::io::{BufReader, Read};
use std::time::Duration;

use sbx_api::{Command, Encoding, ExecRequest, RunRequest, SandboxCreate, SandboxStatus};
use sbx_client::sse::{Frame, FrameReader};
use sbx_client::{Client, NodeError};
use serde_json::Value;

use super::data::{b64_decode, truncate, valid_request_id};
use super::node::TestNode;

/// The command line `line`, for `sh -c`.
pub fn sh(line: &str) -> Command {
    Command::Shell(line.to_string())
}

/// A run of `line` with every other field at its default.
pub fn run_req(line: &str) -> RunRequest {
    RunRequest::new(sh(line))
}

/// A command `line` of a kept sandbox, every other field at its default.
pub fn exec_req(line: &str) -> ExecRequest {
    ExecRequest::new(sh(line))
}

/// A create with every field at its default (the body `{}`).
pub fn create_req() -> SandboxCreate {
    SandboxCreate {
        spec: RunRequest::new(Command::Argv(Vec::new())),
        network: None,
    }
}

/// A create with the fields `set` sets.
pub fn create_with(set: impl FnOnce(&mut RunRequest)) -> SandboxCreate {
    let mut c = create_req();
    set(&mut c.spec);
    c
}

/// The node's refusal of a call of the client, checked as [`assert_error`] checks an error
/// answer (the status, the code, the param, the body's exact shape); a panic if the call
/// succeeded or failed another way.
pub fn assert_refused<T: std::fmt::Debug>(
    r: Result<T, sbx_client::Error>,
    want_status: u16,
    code: &str,
    param: Option<&str>,
) -> NodeError {
    match r {
        Ok(v) => panic!("expected {want_status} {code}, the call succeeded: {v:?}"),
        Err(sbx_client::Error::Node(e)) => {
            assert_error(e.status, &e.body, want_status, code, param);
            *e
        }
        Err(e) => panic!("expected {want_status} {code}, the call failed: {e}"),
    }
}

/// One server-sent event: a frame of sbx-client's reader whose id is a number (every event
/// of the API has one) and whose data is JSON.
#[derive(Debug, Clone)]
pub struct Event {
    pub event: String,
    pub id: u64,
    pub data: Value,
}

impl Event {
    fn of(f: Frame) -> Event {
        let id = f
            .id_u64()
            .unwrap_or_else(|| panic!("event {} has no numeric id: {:?}", f.event, f.id));
        let data = f
            .data_as()
            .unwrap_or_else(|e| panic!("event {}: data is not JSON: {e}: {}", f.event, f.data));
        Event {
            event: f.event,
            id,
            data,
        }
    }
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

/// The body of a stream, as read off the connection.
type Body = Box<dyn Read + Send + Sync + 'static>;

/// An event stream of status 200 being read, event by event ([`FrameReader`]). Dropping it
/// hangs up.
pub struct SseStream {
    frames: FrameReader<BufReader<Body>>,
}

impl SseStream {
    fn new(body: Body) -> SseStream {
        SseStream {
            frames: FrameReader::new(BufReader::new(body)),
        }
    }

    /// The next event; `None` at the end of the stream (a stream cut inside an event fails).
    pub fn next_event(&mut self) -> Option<Event> {
        match self.frames.next_frame().expect("read the event stream") {
            Some(f) => Some(Event::of(f)),
            None => {
                assert!(
                    !self.frames.ended_inside_event(),
                    "the stream ended inside an event"
                );
                None
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
    /// A typed client of the node (with its API key, when [`TestNode::auth`] is a bearer
    /// key), its connections the fixture's (read and write time out after 120 s).
    pub fn client(&self) -> Client {
        let key = self
            .auth
            .as_deref()
            .map(|a| a.strip_prefix("Bearer ").unwrap_or(a).to_string());
        Client::with_agent(&self.url(""), self.http.clone()).api_key(key)
    }

    /// A call of the client that must succeed; a panic naming `what` and the node's log.
    pub fn ok<T>(&self, what: &str, r: Result<T, sbx_client::Error>) -> T {
        r.unwrap_or_else(|e| panic!("{what}: {e}\n{:?}\n{}", e, self.log_tail(30)))
    }

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

    /// `POST /v1/run`, answered as JSON: the status and the body. A well-formed body (one
    /// sbx-api parses, not asking for a stream) goes through the typed client (its refusal's
    /// body as the node wrote it); any other is sent as it is.
    pub fn run(&self, body: &Value) -> (u16, Value) {
        let typed = serde_json::to_vec(body)
            .ok()
            .and_then(|b| sbx_api::parse_run_request(&b).ok())
            .filter(|r| r.stream != Some(true));
        let Some(req) = typed else {
            let r = self.run_with(body, &[]);
            let v = r.json();
            return (r.status, v);
        };
        match self.client().run(&req) {
            Ok(o) => (
                200,
                serde_json::to_value(&o).expect("an exec object as JSON"),
            ),
            Err(sbx_client::Error::Node(e)) => (e.status, e.body),
            Err(sbx_client::Error::Status { status, body }) => (
                status,
                serde_json::from_str(&body).unwrap_or_else(|e| {
                    panic!(
                        "the answer ({status}) is not JSON: {e}: {}",
                        truncate(&body, 2000)
                    )
                }),
            ),
            Err(e) => panic!("run {body}: {e}\n{}", self.log_tail(30)),
        }
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

    /// Opens a run as an event stream, to read event by event: through the typed client
    /// ([`Client::run_events_raw`]) when sbx-api parses the body, as it is otherwise.
    pub fn open_sse(&self, body: &Value) -> SseStream {
        let typed = serde_json::to_vec(body)
            .ok()
            .and_then(|b| sbx_api::parse_run_request(&b).ok());
        let Some(req) = typed else {
            return self.open_sse_with(body, &[]);
        };
        match self.client().run_events_raw(&req) {
            Ok(d) => SseStream::new(Box::new(d)),
            Err(e) => panic!(
                "run {body} answered {e} instead of a stream\n{}",
                self.log_tail(30)
            ),
        }
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

    /// `POST /v1/sandboxes` through the typed client (the body parsed by sbx-api, as the node
    /// parses it) that must make a running sandbox: the sandbox object as the node wrote it.
    pub fn create_sandbox(&self, body: &Value) -> Value {
        let req = serde_json::to_vec(body)
            .ok()
            .and_then(|b| sbx_api::parse_sandbox_create(&b).ok())
            .unwrap_or_else(|| panic!("not a well-formed create: {body}"));
        let sb = self.ok(
            &format!("create {body}"),
            self.client().create_sandbox(&req),
        );
        assert_eq!(sb.status, SandboxStatus::Running, "create {body}: {sb:?}");
        serde_json::to_value(&sb).expect("a sandbox object as JSON")
    }

    /// `DELETE /v1/sandboxes/{id}` through the typed client that must answer the object,
    /// status deleted.
    pub fn delete_sandbox(&self, id: &str) -> Value {
        let sb = self.ok(&format!("delete {id}"), self.client().delete_sandbox(id));
        assert_eq!(sb.status, SandboxStatus::Deleted, "delete {id}: {sb:?}");
        serde_json::to_value(&sb).expect("a sandbox object as JSON")
    }

    /// `POST /v1/sandboxes/{id}/exec` through the typed client (the body parsed by sbx-api)
    /// that must start the command: the exec object.
    pub fn exec(&self, sandbox: &str, body: &Value) -> Value {
        let req = serde_json::to_vec(body)
            .ok()
            .and_then(|b| sbx_api::parse_exec_request(&b).ok())
            .unwrap_or_else(|| panic!("not a well-formed command: {body}"));
        let o = self.ok(&format!("exec {body}"), self.client().exec(sandbox, &req));
        serde_json::to_value(&o).expect("an exec object as JSON")
    }

    /// The final object of a command (`wait_exec_for` of the client), which must have ended
    /// within `timeout`.
    pub fn exec_wait(&self, sandbox: &str, exec_id: &str, timeout: Duration) -> Value {
        let o = self.ok(
            &format!("wait for {exec_id}"),
            self.client().wait_exec_for(sandbox, exec_id, timeout),
        );
        assert!(
            o.status.is_done(),
            "{exec_id} still runs after {timeout:?}: {o:?}"
        );
        serde_json::to_value(&o).expect("an exec object as JSON")
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

    /// A command's whole output through the JSON output endpoint (the client's
    /// [`Client::output`], base64), from position 0, paging with `next` until the end it
    /// reports (the command must have ended): the chunks' bytes of (stdout, stderr, both in
    /// position order). Panics on a gap or a chunk out of place.
    pub fn output_all(&self, sandbox: &str, exec_id: &str) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
        let client = self.client();
        let (mut out, mut err, mut all) = (Vec::new(), Vec::new(), Vec::new());
        let mut from = 0u64;
        for _ in 0..10_000 {
            let page = self.ok(
                &format!("output of {exec_id} from {from}"),
                client.output(sandbox, exec_id, from, None, Encoding::Base64),
            );
            assert_eq!(page.object, "output", "{page:?}");
            assert!(
                page.gap.is_none(),
                "a gap in the output of {exec_id}: {page:?}"
            );
            let mut cursor = from;
            for c in &page.chunks {
                assert_eq!(c.position, cursor, "chunk out of place in {page:?}");
                let data = b64_decode(&c.data);
                cursor += data.len() as u64;
                match c.stream.as_str() {
                    "stdout" => out.extend_from_slice(&data),
                    "stderr" => err.extend_from_slice(&data),
                    other => panic!("chunk of stream {other:?}: {page:?}"),
                }
                all.extend_from_slice(&data);
            }
            assert_eq!(
                page.next, cursor,
                "next is not after the last chunk: {page:?}"
            );
            if page.next >= page.end {
                assert!(page.exited, "output of {exec_id} read while running");
                return (out, err, all);
            }
            assert!(page.next > from, "no progress from {from}: {page:?}");
            from = page.next;
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

    /// The event stream `what` answered (status 200, `text/event-stream`); a panic that says
    /// what came instead.
    fn event_stream(&self, what: &str, sent: Result<ureq::Response, ureq::Error>) -> SseStream {
        let resp = match sent {
            Ok(r) => r,
            Err(ureq::Error::Status(code, r)) => panic!(
                "{what} answered {code} instead of a stream: {}",
                r.into_string().unwrap_or_default()
            ),
            Err(e) => panic!("request to the node failed: {e}\n{}", self.log_tail(30)),
        };
        assert_eq!(
            resp.status(),
            200,
            "{what}: a stream of status {}",
            resp.status()
        );
        let ct = resp.content_type().to_string();
        assert_eq!(
            ct,
            "text/event-stream",
            "{what}: not an event stream: {}",
            resp.into_string().unwrap_or_default()
        );
        SseStream::new(resp.into_reader())
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
