//! The API's wire in-process: requests through the node's router (`crate::router`, its edge
//! included) over a node on the fake driver (`sbx_node::node::fake`), answered without a
//! socket, root, cgroups or a disk image. What a request is refused for, what the edge answers,
//! who may call, secrets and the functions' payloads: one file each, as in
//! `crates/sandboxd/tests/it`, where what needs a real sandbox or a real listener stays.
//!
//! [`Wire`] is a node and its router; [`Call`] one request (from a loopback caller, with a
//! loopback `Host` and a `Content-Length` unless the test says otherwise); [`Answer`] its
//! answer; [`assert_error`] the one error body of the API. [`logs`] holds every log line of the
//! test binary, for the checks that a value is in none.

mod auth;
mod bad_input;
mod edge;
mod functions;
mod secrets;

use std::collections::HashSet;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::Router;
use serde_json::Value;
use tower::ServiceExt;

use sbx_node::node::fake::{node_in, TempDir, World};
use sbx_node::node::{Node, NodeConfig};
use sbx_node::sync::LockExt;

use crate::AppState;

/// The `Host` of a request unless a test gives another: the node's loopback address.
pub(crate) const HOST: &str = "127.0.0.1:7700";

/// A loopback caller.
pub(crate) const LOOPBACK: ([u8; 4], u16) = ([127, 0, 0, 1], 40000);

/// What the node's flags give its router: `--api-keys` (the keys the file holds),
/// `--docs-url`, `--cors-origin` (as `main` normalizes them: no trailing `/`, lowercase).
#[derive(Clone, Default)]
pub(crate) struct Flags {
    pub api_keys: Option<Vec<String>>,
    pub docs_url: Option<String>,
    pub cors_origins: Vec<String>,
}

/// A node on the fake driver over a directory of its own, and its router.
pub(crate) struct Wire {
    pub dir: TempDir,
    pub world: Arc<World>,
    pub node: Arc<Node>,
    pub app: Router,
    flags: Flags,
    tweak: fn(&mut NodeConfig),
}

fn app(node: &Arc<Node>, flags: &Flags) -> Router {
    crate::router(Arc::new(AppState {
        node: node.clone(),
        api_keys: flags
            .api_keys
            .as_ref()
            .map(|k| k.iter().cloned().collect::<HashSet<String>>()),
        docs_url: flags.docs_url.clone(),
        cors_origins: flags.cors_origins.clone(),
    }))
}

impl Wire {
    /// A node as `sandboxd` with no flags makes it (on the fake driver).
    pub fn start(tag: &str) -> Wire {
        Wire::start_with(tag, Flags::default(), |_| {})
    }

    /// A node with `flags`, its settings changed by `tweak`.
    pub fn start_with(tag: &str, flags: Flags, tweak: fn(&mut NodeConfig)) -> Wire {
        let dir = TempDir::new(tag);
        let world = World::new();
        let node = node_in(dir.path(), &world, tweak);
        let app = app(&node, &flags);
        Wire {
            dir,
            world,
            node,
            app,
            flags,
            tweak,
        }
    }

    /// The node stopped (every sandbox of its own ended) and gone, then a node started again
    /// over the same data directory and the same sandboxes, as a restart of `sandboxd` does.
    pub async fn restart(self) -> Wire {
        self.stop().await;
        let Wire {
            dir,
            world,
            node,
            app: router,
            flags,
            tweak,
        } = self;
        drop(router);
        // The store is the node's alone until the last holder of the node lets it go.
        let t0 = Instant::now();
        while Arc::strong_count(&node) > 1 {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the stopped node is still held"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(node);
        let node = node_in(dir.path(), &world, tweak);
        let app = app(&node, &flags);
        Wire {
            dir,
            world,
            node,
            app,
            flags,
            tweak,
        }
    }

    /// Stops the node and waits (at most 10 s) for its teardowns.
    pub async fn stop(&self) {
        self.node.shutdown().await;
        let t0 = Instant::now();
        while self.node.pending_teardowns() > 0 && t0.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Nothing of what the node was asked is left: no sandbox was made at all (`made` false),
    /// or every one made is ended (its agent is gone).
    pub async fn assert_clean(&self, made: bool) {
        if !made {
            assert_eq!(self.world.creates(), 0, "a refused request made a sandbox");
        }
        let t0 = Instant::now();
        while !self.world.alive().is_empty() && t0.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(self.world.alive(), HashSet::new(), "sandboxes left running");
    }

    /// A request to build.
    pub fn call(&self, method: &str, path: &str) -> Call<'_> {
        Call {
            wire: self,
            method: method.to_string(),
            path: path.to_string(),
            headers: Vec::new(),
            body: Vec::new(),
            peer: SocketAddr::from(LOOPBACK),
            host: Some(HOST.to_string()),
        }
    }

    pub async fn get(&self, path: &str) -> Answer {
        self.call("GET", path).send().await
    }

    pub async fn delete(&self, path: &str) -> Answer {
        self.call("DELETE", path).send().await
    }

    /// A POST of JSON bytes as they are (`Content-Type: application/json`).
    pub async fn post(&self, path: &str, body: &[u8]) -> Answer {
        self.call("POST", path).json_bytes(body).send().await
    }

    pub async fn post_json(&self, path: &str, body: &Value) -> Answer {
        self.post(path, body.to_string().as_bytes()).await
    }

    /// `POST /v1/run` with `body`.
    pub async fn run(&self, body: &Value) -> Answer {
        self.post_json("/v1/run", body).await
    }

    /// `POST /v1/sandboxes` that must answer 201 with a running sandbox: its id.
    pub async fn create_sandbox(&self, body: &Value) -> String {
        let a = self.post_json("/v1/sandboxes", body).await;
        let v = a.json();
        assert_eq!(a.status, 201, "create {body}: {v}");
        assert_eq!(v["status"], "running", "create {body}: {v}");
        v["id"].as_str().expect("an id").to_string()
    }
}

/// One request being built.
pub(crate) struct Call<'a> {
    wire: &'a Wire,
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    peer: SocketAddr,
    host: Option<String>,
}

impl Call<'_> {
    /// A header (`Host` replaces the default one).
    pub fn header(mut self, name: &str, value: &str) -> Self {
        if name.eq_ignore_ascii_case("host") {
            self.host = Some(value.to_string());
        } else {
            self.headers.push((name.to_string(), value.to_string()));
        }
        self
    }

    /// The body, sent with its `Content-Length` (no `Content-Type` unless a header gives one).
    pub fn body(mut self, body: &[u8]) -> Self {
        self.body = body.to_vec();
        self
    }

    /// A body of JSON (bytes as they are), `Content-Type: application/json`.
    pub fn json_bytes(self, body: &[u8]) -> Self {
        self.header("content-type", "application/json").body(body)
    }

    /// From this caller's address.
    pub fn from(mut self, peer: SocketAddr) -> Self {
        self.peer = peer;
        self
    }

    /// The request, and its whole answer.
    pub async fn send(self) -> Answer {
        let mut req = Request::builder()
            .method(self.method.as_str())
            .uri(&self.path);
        if let Some(h) = &self.host {
            req = req.header("host", h);
        }
        let given_length = self
            .headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("content-length"));
        for (k, v) in &self.headers {
            req = req.header(k.as_str(), v.as_str());
        }
        if !self.body.is_empty() && !given_length {
            req = req.header("content-length", self.body.len());
        }
        let mut req = req.body(Body::from(self.body)).expect("a request");
        req.extensions_mut().insert(ConnectInfo(self.peer));
        let resp = match self.wire.app.clone().oneshot(req).await {
            Ok(r) => r,
            Err(never) => match never {},
        };
        let status = resp.status();
        let headers = resp.headers().clone();
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .expect("the answer's body")
            .to_bytes()
            .to_vec();
        Answer {
            status,
            headers,
            body,
        }
    }
}

/// An answer, whatever its status.
#[derive(Debug)]
pub(crate) struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            let text = self.text();
            let cut: String = text.chars().take(2000).collect();
            panic!("the answer ({}) is not JSON: {e}: {cut}", self.status)
        })
    }

    /// Checks that this is the API's error answer of `status`, `code` and `param`.
    pub fn assert_error(&self, status: u16, code: &str, param: Option<&str>) -> Value {
        let v = self.json();
        assert_error(self.status.as_u16(), &v, status, code, param);
        v
    }
}

/// `^[A-Za-z0-9._\-]{1,64}$`
pub(crate) fn valid_request_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
}

/// Checks an error answer: the status, and a body of exactly
/// `{error:{type,code,message,param,retryable,request_id,docs_url}}` (with `allowed_hosts`
/// beside `error` for `secret_host_not_allowed`, as the spec says).
pub(crate) fn assert_error(
    status: u16,
    body: &Value,
    want_status: u16,
    code: &str,
    param: Option<&str>,
) {
    assert_eq!(
        status, want_status,
        "expected {want_status} {code}, got {status}: {body}"
    );
    let top = body
        .as_object()
        .unwrap_or_else(|| panic!("error body is not an object: {body}"));
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

/// A name of its own: `prefix`, the process and a counter.
pub(crate) fn unique(prefix: &str) -> String {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
    )
}

/// Every log line of this test binary, at every level, from the first call on (the process's
/// one subscriber, installed then).
pub(crate) fn logs() -> String {
    let buf = log_buffer();
    let bytes = buf.locked();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Installs the subscriber that writes every log line to [`logs`]; call before what is logged.
pub(crate) fn capture_logs() {
    log_buffer();
}

fn log_buffer() -> Arc<Mutex<Vec<u8>>> {
    static BUF: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    BUF.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let sink = Sink(buf.clone());
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(move || sink.clone())
            .finish();
        // The process's one subscriber: no other test of this crate sets one.
        if let Err(e) = tracing::subscriber::set_global_default(subscriber) {
            panic!("the log subscriber of the tests: {e}");
        }
        buf
    })
    .clone()
}

#[derive(Clone)]
struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.locked().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
