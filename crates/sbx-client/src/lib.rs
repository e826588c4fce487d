//! A typed client of the sbx node's HTTP API, blocking (on `ureq`): what the `sbx` CLI, the
//! benchmarks and the tests call the node with.
//!
//! ```no_run
//! use sbx_api::{Command, RunRequest};
//! use sbx_client::{Client, ExecEvent};
//!
//! let node = Client::new("http://127.0.0.1:7700");
//! // A command in a sandbox made for it, its result as JSON...
//! let done = node.run(&RunRequest::new(Command::Shell("echo hi".into())))?;
//! assert_eq!(done.stdout, "hi\n");
//! // ...or its events as they come.
//! for ev in node.run_stream(&RunRequest::new(Command::Shell("seq 3".into())))? {
//!     if let ExecEvent::Stdout(out) = ev? {
//!         print!("{}", out.data);
//!     }
//! }
//! # Ok::<(), sbx_client::Error>(())
//! ```
//!
//! - Requests are the types the node parses, from sbx-api ([`RunRequest`], [`SandboxCreate`],
//!   [`ExecRequest`], [`SandboxPatch`], [`VolumeCreate`], [`SecretPut`]), sent as their
//!   `to_json`: the body that parses back to the same value (sbx-api's property tests).
//! - Answers are typed: sbx-api's objects ([`ExecObject`], [`SnapshotObject`],
//!   [`VolumeObject`], [`SecretObject`]) and this crate's [`answers`] (a [`Sandbox`] with its
//!   token, lists, file entries, templates, ...). Written back with serde, an answer is the
//!   JSON the node sent (keys this client does not name are kept).
//! - Errors ([`Error`]): the node's error body read into a [`NodeError`] (its code an
//!   [`sbx_api::ErrorCode`] where it is one, `retryable`, `param`, `request_id`), apart from
//!   transport failures and answers of another shape.
//! - Event streams: [`sse::FrameReader`] frames any `text/event-stream`; [`ExecEvents`]
//!   reads a command's events and, when the connection drops, reads on with
//!   `Last-Event-ID` from the last event's id; [`PullEvents`] an image pull's.
//! - Files go both ways as streams: an upload is read from an `impl Read` as it is sent, a
//!   [`Download`] is read as it comes.
//!
//! Every route of the node's router has a method here (`crates/sandboxd/src/http/router.rs`;
//! the contract is the spec's).

#![forbid(unsafe_code)]

pub mod answers;
mod error;
mod events;
pub mod files;
pub mod sse;
mod terminal;

use std::io::Read;
use std::time::Duration;

pub use answers::{
    Chmodded, Field, FileEntry, FileList, FileWritten, Fork, Grepped, Image, List, NodeInfo,
    OutputPage, Pulled, Sandbox, SandboxQuery, SecretDeleted, Sedded, SignalSent, StdinWritten,
    Template, TerminalExit, Unpacked,
};
pub use error::{Code, Error, NodeError};
pub use events::{ExecEvent, ExecEvents, PullEvent, PullEvents};
pub use files::{Chmod, Download, Grep, Mkdir, Range, Sed, TarUpload, Upload};
pub use sbx_api::{
    Encoding, ExecObject, ExecRequest, RunRequest, SandboxCreate, SandboxPatch, SecretObject,
    SecretPut, SnapshotObject, VolumeCreate, VolumeObject,
};
pub use terminal::{Terminal, TerminalEvent};

use events::Body;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

/// The node's default address.
pub const DEFAULT_URL: &str = "http://127.0.0.1:7700";

/// How long a connection to the node may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A node's API. Cheap to clone (the connections are shared).
#[derive(Clone)]
pub struct Client {
    base: String,
    api_key: Option<String>,
    agent: ureq::Agent,
    /// Headers sent with every call of this handle (`Idempotency-Key`, `X-Request-Id`).
    headers: Vec<(&'static str, String)>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("base", &self.base)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// A signal by name (`SIGTERM`, `TERM`) or number.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Signal {
    Name(String),
    Number(i32),
}

fn url_part(s: &str) -> String {
    // Ids and names are [a-z0-9-]; anything else is escaped so that it stays one segment.
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~:@".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl Client {
    /// A client of the node at `url` (`http://127.0.0.1:7700`), without an API key.
    pub fn new(url: &str) -> Client {
        Client::with_agent(
            url,
            ureq::AgentBuilder::new()
                .timeout_connect(CONNECT_TIMEOUT)
                .build(),
        )
    }

    /// A client that makes its calls with `agent` (its own timeouts, pool of connections).
    pub fn with_agent(url: &str, agent: ureq::Agent) -> Client {
        Client {
            base: url.trim_end_matches('/').to_string(),
            api_key: None,
            agent,
            headers: Vec::new(),
        }
    }

    /// The same client, sending `Authorization: Bearer KEY`.
    #[must_use]
    pub fn api_key(mut self, key: Option<String>) -> Client {
        self.api_key = key;
        self
    }

    /// The node's address, as given (without a trailing `/`).
    pub fn url(&self) -> &str {
        &self.base
    }

    /// A handle whose calls carry `Idempotency-Key: key`: sent again with the same body, a
    /// create, exec or restart is answered as the first time instead of done twice.
    pub fn idempotent(&self, key: &str) -> Client {
        let mut c = self.clone();
        c.headers.push(("idempotency-key", key.to_string()));
        c
    }

    /// A handle whose calls carry `X-Request-Id: id` (the node's log and error bodies name
    /// the request by it).
    pub fn request_id(&self, id: &str) -> Client {
        let mut c = self.clone();
        c.headers.push(("x-request-id", id.to_string()));
        c
    }

    fn req(&self, method: &str, path: &str) -> ureq::Request {
        let mut r = self.agent.request(method, &format!("{}{path}", self.base));
        if let Some(k) = &self.api_key {
            r = r.set("authorization", &format!("Bearer {k}"));
        }
        for (h, v) in &self.headers {
            r = r.set(h, v);
        }
        r
    }

    fn json_req(&self, method: &str, path: &str) -> ureq::Request {
        self.req(method, path)
            .set("content-type", "application/json")
    }

    fn sandbox_path(id: &str, tail: &str) -> String {
        format!("/v1/sandboxes/{}{tail}", url_part(id))
    }

    fn exec_path(sandbox: &str, exec: &str, tail: &str) -> String {
        Client::sandbox_path(sandbox, &format!("/exec/{}{tail}", url_part(exec)))
    }

    /// Sends `r` (with `body` as JSON, if any) and reads the answer as `T`.
    fn call<T: DeserializeOwned>(r: ureq::Request, body: Option<&Value>) -> Result<T, Error> {
        let resp = match body {
            Some(b) => r.send_string(&b.to_string()),
            None => r.call(),
        }
        .map_err(error::of_ureq)?;
        read_json(resp)
    }

    /// Sends `r` and answers its body as a stream.
    fn open(r: ureq::Request, body: Option<&Value>) -> Result<Body, Error> {
        let resp = match body {
            Some(b) => r.send_string(&b.to_string()),
            None => r.call(),
        }
        .map_err(error::of_ureq)?;
        Ok(resp.into_reader())
    }

    // The node.

    /// `GET /healthz`: `Ok` when the node can make sandboxes, its 503 otherwise (the message
    /// names each failed check). `timeout`: how long to wait for it.
    pub fn health(&self, timeout: Duration) -> Result<(), Error> {
        self.req("GET", "/healthz")
            .timeout(timeout)
            .call()
            .map_err(error::of_ureq)?;
        Ok(())
    }

    /// `GET /internal/node`: what the node is and holds.
    pub fn node_info(&self) -> Result<NodeInfo, Error> {
        Client::call(self.req("GET", "/internal/node"), None)
    }

    /// `GET /internal/templates`: the node's templates, `base` first.
    pub fn templates(&self) -> Result<List<Template>, Error> {
        Client::call(self.req("GET", "/internal/templates"), None)
    }

    /// `POST /internal/templates`: the template of a create's settings, built ahead (its
    /// status `building` until it is `ready` or `failed`).
    pub fn build_template(&self, c: &SandboxCreate) -> Result<Template, Error> {
        Client::call(
            self.json_req("POST", "/internal/templates"),
            Some(&c.to_json()),
        )
    }

    // One-shot runs.

    /// `POST /v1/run`, answered as JSON when the command has ended (`stream` is sent false).
    pub fn run(&self, r: &RunRequest) -> Result<ExecObject, Error> {
        let mut r = r.clone();
        r.stream = Some(false);
        Client::call(self.json_req("POST", "/v1/run"), Some(&r.to_json()))
    }

    /// `POST /v1/run` as an event stream (`stream` is sent true). The sandbox lives as long
    /// as the connection: a stream that drops is not read on.
    pub fn run_stream(&self, r: &RunRequest) -> Result<ExecEvents, Error> {
        let mut r = r.clone();
        r.stream = Some(true);
        let body = Client::open(
            self.json_req("POST", "/v1/run")
                .set("accept", "text/event-stream"),
            Some(&r.to_json()),
        )?;
        Ok(ExecEvents::once(body))
    }

    /// `POST /v1/run` as the raw event stream (`stream` is sent true), for a reader of its own
    /// frames ([`sse::FrameReader`]): a test of the stream's framing, ids and order.
    pub fn run_events_raw(&self, r: &RunRequest) -> Result<Download, Error> {
        let mut r = r.clone();
        r.stream = Some(true);
        Ok(Download {
            len: None,
            content_range: None,
            body: Client::open(
                self.json_req("POST", "/v1/run")
                    .set("accept", "text/event-stream"),
                Some(&r.to_json()),
            )?,
        })
    }

    // Kept sandboxes.

    /// `POST /v1/sandboxes`: a sandbox, possibly `starting` (its image pulled, its template
    /// built, its check waited for); [`Client::wait_started`] waits.
    pub fn create_sandbox(&self, c: &SandboxCreate) -> Result<Sandbox, Error> {
        Client::call(self.json_req("POST", "/v1/sandboxes"), Some(&c.to_json()))
    }

    /// `GET /v1/sandboxes/{id}` (by id or name), with its token.
    pub fn sandbox(&self, id: &str) -> Result<Sandbox, Error> {
        Client::call(self.req("GET", &Client::sandbox_path(id, "")), None)
    }

    /// Polls a sandbox every `every` until it is not `starting`, calling `waiting` with the
    /// time waited before each pause.
    pub fn wait_started(
        &self,
        id: &str,
        every: Duration,
        mut waiting: impl FnMut(Duration),
    ) -> Result<Sandbox, Error> {
        let t = std::time::Instant::now();
        loop {
            let s = self.sandbox(id)?;
            if s.status != sbx_api::SandboxStatus::Starting {
                return Ok(s);
            }
            waiting(t.elapsed());
            std::thread::sleep(every);
        }
    }

    /// `GET /v1/sandboxes`: one page.
    pub fn sandboxes(&self, q: &SandboxQuery) -> Result<List<Sandbox>, Error> {
        let mut r = self.req("GET", "/v1/sandboxes");
        if let Some(s) = &q.status {
            r = r.query("status", s);
        }
        if let Some(l) = q.limit {
            r = r.query("limit", &l.to_string());
        }
        if let Some(c) = &q.cursor {
            r = r.query("cursor", c);
        }
        for (k, v) in &q.metadata {
            r = r.query(&format!("metadata.{k}"), v);
        }
        Client::call(r, None)
    }

    /// Every sandbox of `q`, page after page.
    pub fn all_sandboxes(&self, q: &SandboxQuery) -> Result<Vec<Sandbox>, Error> {
        let mut q = q.clone();
        let mut all = Vec::new();
        loop {
            let page = self.sandboxes(&q)?;
            all.extend(page.data);
            match page.next_cursor {
                Field::Value(c) => q.cursor = Some(c),
                _ => return Ok(all),
            }
        }
    }

    /// `PATCH /v1/sandboxes/{id}`: its egress rules (merged key by key), expiry, hold.
    pub fn patch_sandbox(&self, id: &str, p: &SandboxPatch) -> Result<Sandbox, Error> {
        Client::call(
            self.json_req("PATCH", &Client::sandbox_path(id, "")),
            Some(&p.to_json()),
        )
    }

    /// `DELETE /v1/sandboxes/{id}`: the sandbox object as it was deleted.
    pub fn delete_sandbox(&self, id: &str) -> Result<Sandbox, Error> {
        Client::call(self.req("DELETE", &Client::sandbox_path(id, "")), None)
    }

    /// `POST /v1/sandboxes/{id}/restart`: its machine booted again over the same disk.
    pub fn restart_sandbox(&self, id: &str) -> Result<Sandbox, Error> {
        Client::call(
            self.req("POST", &Client::sandbox_path(id, "/restart")),
            None,
        )
    }

    /// `POST /v1/sandboxes/{id}/sleep`: its processes saved to disk, its memory freed.
    pub fn sleep_sandbox(&self, id: &str) -> Result<Sandbox, Error> {
        Client::call(
            self.json_req("POST", &Client::sandbox_path(id, "/sleep")),
            Some(&json!({})),
        )
    }

    /// `POST /v1/sandboxes/{id}/wake`.
    pub fn wake_sandbox(&self, id: &str) -> Result<Sandbox, Error> {
        Client::call(
            self.json_req("POST", &Client::sandbox_path(id, "/wake")),
            Some(&json!({})),
        )
    }

    /// `POST /v1/sandboxes/{id}/snapshots`: a snapshot of it, processes included.
    pub fn snapshot_sandbox(&self, id: &str, name: Option<&str>) -> Result<SnapshotObject, Error> {
        let mut body = serde_json::Map::new();
        if let Some(n) = name {
            body.insert("name".into(), json!(n));
        }
        Client::call(
            self.json_req("POST", &Client::sandbox_path(id, "/snapshots")),
            Some(&Value::Object(body)),
        )
    }

    /// `POST /v1/sandboxes/{id}/fork`: `count` copies going on from now.
    pub fn fork_sandbox(&self, id: &str, count: u32) -> Result<Fork, Error> {
        Client::call(
            self.json_req("POST", &Client::sandbox_path(id, "/fork")),
            Some(&json!({ "count": count })),
        )
    }

    /// `GET /v1/snapshots`.
    pub fn snapshots(&self) -> Result<List<SnapshotObject>, Error> {
        Client::call(self.req("GET", "/v1/snapshots"), None)
    }

    /// `GET /v1/snapshots/{id}` (by id or name).
    pub fn snapshot(&self, id: &str) -> Result<SnapshotObject, Error> {
        Client::call(
            self.req("GET", &format!("/v1/snapshots/{}", url_part(id))),
            None,
        )
    }

    /// `DELETE /v1/snapshots/{id}`.
    pub fn delete_snapshot(&self, id: &str) -> Result<SnapshotObject, Error> {
        Client::call(
            self.req("DELETE", &format!("/v1/snapshots/{}", url_part(id))),
            None,
        )
    }

    // Commands of kept sandboxes.

    /// `POST /v1/sandboxes/{id}/exec`: starts a command (waiting up to `wait_seconds` for its
    /// end).
    pub fn exec(&self, sandbox: &str, r: &ExecRequest) -> Result<ExecObject, Error> {
        Client::call(
            self.json_req("POST", &Client::sandbox_path(sandbox, "/exec")),
            Some(&r.to_json()),
        )
    }

    /// `POST /v1/sandboxes/{id}/run`: starts a command and answers when it has ended.
    pub fn exec_run(&self, sandbox: &str, r: &ExecRequest) -> Result<ExecObject, Error> {
        let mut r = r.clone();
        r.stream = Some(false);
        Client::call(
            self.json_req("POST", &Client::sandbox_path(sandbox, "/run")),
            Some(&r.to_json()),
        )
    }

    /// `POST /v1/sandboxes/{id}/run` as an event stream, read on from the command's output
    /// if it drops after its start.
    pub fn exec_run_stream(&self, sandbox: &str, r: &ExecRequest) -> Result<ExecEvents, Error> {
        let mut r = r.clone();
        r.stream = Some(true);
        let body = Client::open(
            self.json_req("POST", &Client::sandbox_path(sandbox, "/run"))
                .set("accept", "text/event-stream"),
            Some(&r.to_json()),
        )?;
        Ok(ExecEvents::after_start(body, self.clone(), r.encoding))
    }

    /// `GET /v1/sandboxes/{id}/exec`: its commands.
    pub fn execs(&self, sandbox: &str) -> Result<List<ExecObject>, Error> {
        Client::call(
            self.req("GET", &Client::sandbox_path(sandbox, "/exec")),
            None,
        )
    }

    /// `GET …/exec/{exec_id}`, waiting up to `wait_seconds` (0 to 300) for its end.
    pub fn exec_object(
        &self,
        sandbox: &str,
        exec: &str,
        wait_seconds: f64,
        encoding: Encoding,
    ) -> Result<ExecObject, Error> {
        let mut r = self.req("GET", &Client::exec_path(sandbox, exec, ""));
        if wait_seconds > 0.0 {
            r = r.query("wait_seconds", &wait_seconds.to_string());
        }
        if encoding != Encoding::Utf8 {
            r = r.query("encoding", encoding.as_str());
        }
        Client::call(r, None)
    }

    /// The final exec object of a command: `GET …/exec/{exec_id}?wait_seconds=60` until it has
    /// ended.
    pub fn wait_exec(&self, sandbox: &str, exec: &str) -> Result<ExecObject, Error> {
        loop {
            let o = self.exec_object(sandbox, exec, 60.0, Encoding::Utf8)?;
            if o.status.is_done() {
                return Ok(o);
            }
        }
    }

    /// The exec object of a command once it has ended, or as it is when `timeout` is up
    /// (`status` running then): `GET …/exec/{exec_id}?wait_seconds=` until one or the other.
    pub fn wait_exec_for(
        &self,
        sandbox: &str,
        exec: &str,
        timeout: Duration,
    ) -> Result<ExecObject, Error> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            // Whole milliseconds, at most a minute a call (the node takes up to 300 s).
            let wait = (left.as_millis().min(60_000) as f64) / 1000.0;
            let o = self.exec_object(sandbox, exec, wait, Encoding::Utf8)?;
            if o.status.is_done() || left.is_zero() {
                return Ok(o);
            }
        }
    }

    /// `GET …/exec/{exec_id}/output` as JSON: a page of output from `from` (to `to`).
    pub fn output(
        &self,
        sandbox: &str,
        exec: &str,
        from: u64,
        to: Option<u64>,
        encoding: Encoding,
    ) -> Result<OutputPage, Error> {
        let mut r = self
            .req("GET", &Client::exec_path(sandbox, exec, "/output"))
            .query("from", &from.to_string());
        if let Some(t) = to {
            r = r.query("to", &t.to_string());
        }
        if encoding != Encoding::Utf8 {
            r = r.query("encoding", encoding.as_str());
        }
        Client::call(r, None)
    }

    /// `GET …/exec/{exec_id}/output` as an event stream from `from` to the command's exit,
    /// read on with `Last-Event-ID` when it drops.
    pub fn output_stream(
        &self,
        sandbox: &str,
        exec: &str,
        from: u64,
        encoding: Encoding,
    ) -> Result<ExecEvents, Error> {
        let body = self.output_body(sandbox, exec, (from > 0).then_some(from), encoding)?;
        Ok(ExecEvents::output(
            Some(body),
            self.clone(),
            sandbox,
            exec,
            from,
            encoding,
        ))
    }

    /// [`Client::output_stream`] that connects at its first read, and counts a failure to
    /// connect as a drop: read on up to [`ExecEvents::max_reconnects`] times (a node that
    /// restarts, a command whose sandbox is being woken).
    pub fn follow_output(
        &self,
        sandbox: &str,
        exec: &str,
        from: u64,
        encoding: Encoding,
    ) -> ExecEvents {
        ExecEvents::output(None, self.clone(), sandbox, exec, from, encoding)
    }

    /// `GET …/exec/{exec_id}/output` as the raw event stream from `last_id`
    /// (`Last-Event-ID`), for a reader of its own frames ([`sse::FrameReader`]): a benchmark
    /// that counts the bytes without parsing them.
    pub fn output_events_raw(
        &self,
        sandbox: &str,
        exec: &str,
        last_id: Option<u64>,
        encoding: Encoding,
    ) -> Result<Download, Error> {
        Ok(Download {
            len: None,
            content_range: None,
            body: self.output_body(sandbox, exec, last_id, encoding)?,
        })
    }

    /// The output's event stream from `last_id` (`Last-Event-ID`).
    pub(crate) fn output_body(
        &self,
        sandbox: &str,
        exec: &str,
        last_id: Option<u64>,
        encoding: Encoding,
    ) -> Result<Body, Error> {
        let mut r = self
            .req("GET", &Client::exec_path(sandbox, exec, "/output"))
            .set("accept", "text/event-stream");
        if let Some(id) = last_id {
            r = r.set("last-event-id", &id.to_string());
        }
        if encoding != Encoding::Utf8 {
            r = r.query("encoding", encoding.as_str());
        }
        Client::open(r, None)
    }

    /// `POST …/exec/{exec_id}/stdin`: bytes to a command started with `stdin_open` (sent as
    /// base64); `close` closes its stdin after them.
    pub fn write_stdin(
        &self,
        sandbox: &str,
        exec: &str,
        data: &[u8],
        close: bool,
    ) -> Result<StdinWritten, Error> {
        let body = json!({
            "data": Encoding::Base64.encode(data),
            "encoding": "base64",
            "close": close,
        });
        Client::call(
            self.json_req("POST", &Client::exec_path(sandbox, exec, "/stdin")),
            Some(&body),
        )
    }

    /// `POST …/exec/{exec_id}/signal`.
    pub fn signal(&self, sandbox: &str, exec: &str, signal: &Signal) -> Result<SignalSent, Error> {
        let sig = match signal {
            Signal::Name(n) => json!(n),
            Signal::Number(n) => json!(n),
        };
        Client::call(
            self.json_req("POST", &Client::exec_path(sandbox, exec, "/signal")),
            Some(&json!({ "signal": sig })),
        )
    }

    /// `GET …/exec/{exec_id}/terminal`: the WebSocket of a command started with `tty`, its
    /// output replayed from `from`.
    pub fn terminal(&self, sandbox: &str, exec: &str, from: u64) -> Result<Terminal, Error> {
        let ws = self.base.replacen("http", "ws", 1);
        let mut url = format!("{ws}{}", Client::exec_path(sandbox, exec, "/terminal"));
        if from > 0 {
            url.push_str(&format!("?from={from}"));
        }
        Terminal::open(&url, self.api_key.as_deref())
    }

    // A sandbox's files.

    fn files(&self, method: &str, sandbox: &str, tail: &str, path: &str) -> ureq::Request {
        self.req(
            method,
            &Client::sandbox_path(sandbox, &format!("/files{tail}")),
        )
        .query("path", path)
    }

    /// `PUT …/files?path=`: `body` becomes the file, sent as it is read (`len`: its length,
    /// when known; chunked otherwise).
    pub fn upload(
        &self,
        sandbox: &str,
        path: &str,
        opts: &Upload,
        body: impl Read,
        len: Option<u64>,
    ) -> Result<FileWritten, Error> {
        let mut r = self
            .files("PUT", sandbox, "", path)
            .set("content-type", "application/octet-stream");
        if opts.parents {
            r = r.query("parents", "true");
        }
        if let Some(m) = &opts.mode {
            r = r.query("mode", m);
        }
        if let Some(o) = &opts.owner {
            r = r.query("owner", o);
        }
        if let Some(l) = len {
            r = r.set("content-length", &l.to_string());
        }
        read_json(r.send(body).map_err(error::of_ureq)?)
    }

    /// `GET …/files?path=`: the file's bytes (a part of them with `range`), as they come.
    pub fn download(
        &self,
        sandbox: &str,
        path: &str,
        range: Option<Range>,
    ) -> Result<Download, Error> {
        let mut r = self.files("GET", sandbox, "", path);
        if let Some(range) = range {
            r = r.set("range", &range.header());
        }
        let resp = r.call().map_err(error::of_ureq)?;
        Ok(download(resp))
    }

    /// `GET …/files/list?path=`.
    pub fn list_files(
        &self,
        sandbox: &str,
        path: &str,
        limit: Option<u32>,
    ) -> Result<FileList, Error> {
        let mut r = self.files("GET", sandbox, "/list", path);
        if let Some(l) = limit {
            r = r.query("limit", &l.to_string());
        }
        Client::call(r, None)
    }

    /// `GET …/files/stat?path=` (a symlink is described, not followed).
    pub fn stat(&self, sandbox: &str, path: &str) -> Result<FileEntry, Error> {
        Client::call(self.files("GET", sandbox, "/stat", path), None)
    }

    /// [`Client::stat`], `None` where nothing is at `path` (404 path_not_found).
    pub fn stat_if_any(&self, sandbox: &str, path: &str) -> Result<Option<FileEntry>, Error> {
        match self.stat(sandbox, path) {
            Ok(e) => Ok(Some(e)),
            Err(e) if e.code() == Some(sbx_api::ErrorCode::PathNotFound) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn file_call<T: DeserializeOwned>(
        &self,
        sandbox: &str,
        tail: &str,
        path: &str,
        body: &impl serde::Serialize,
    ) -> Result<T, Error> {
        let body = serde_json::to_value(body).map_err(|e| Error::Decode(e.to_string()))?;
        Client::call(
            self.files("POST", sandbox, tail, path)
                .set("content-type", "application/json"),
            Some(&body),
        )
    }

    /// `POST …/files/mkdir?path=`: the directory (`other.created`: whether it is new).
    pub fn mkdir(&self, sandbox: &str, path: &str, m: &Mkdir) -> Result<FileEntry, Error> {
        self.file_call(sandbox, "/mkdir", path, m)
    }

    /// `POST …/files/rm?path=`: what was removed.
    pub fn remove(&self, sandbox: &str, path: &str, recursive: bool) -> Result<FileEntry, Error> {
        self.file_call(sandbox, "/rm", path, &json!({ "recursive": recursive }))
    }

    /// `POST …/files/mv?path=SRC`: SRC renamed to `dst` (exactly that path).
    pub fn rename(
        &self,
        sandbox: &str,
        src: &str,
        dst: &str,
        overwrite: bool,
    ) -> Result<FileEntry, Error> {
        self.file_call(
            sandbox,
            "/mv",
            src,
            &json!({ "dst": dst, "overwrite": overwrite }),
        )
    }

    /// `POST …/files/chmod?path=`.
    pub fn chmod(&self, sandbox: &str, path: &str, c: &Chmod) -> Result<Chmodded, Error> {
        self.file_call(sandbox, "/chmod", path, c)
    }

    /// `POST …/files/grep?path=`.
    pub fn grep(&self, sandbox: &str, path: &str, g: &Grep) -> Result<Grepped, Error> {
        self.file_call(sandbox, "/grep", path, g)
    }

    /// `POST …/files/sed?path=`.
    pub fn sed(&self, sandbox: &str, path: &str, s: &Sed) -> Result<Sedded, Error> {
        self.file_call(sandbox, "/sed", path, s)
    }

    /// `GET …/files/tar?path=`: a directory (or a file) as a tar stream, as it comes.
    pub fn download_tar(&self, sandbox: &str, path: &str) -> Result<Download, Error> {
        let resp = self
            .files("GET", sandbox, "/tar", path)
            .call()
            .map_err(error::of_ureq)?;
        Ok(download(resp))
    }

    /// `POST …/files/tar?path=`: a tar stream, sent as it is read, unpacked into `path`.
    pub fn upload_tar(
        &self,
        sandbox: &str,
        path: &str,
        opts: &TarUpload,
        tar: impl Read,
    ) -> Result<Unpacked, Error> {
        let mut r = self
            .files("POST", sandbox, "/tar", path)
            .set("content-type", "application/x-tar");
        if !opts.parents {
            r = r.query("parents", "false");
        }
        if let Some(o) = &opts.owner {
            r = r.query("owner", o);
        }
        if opts.preserve_owners {
            r = r.query("preserve_owners", "true");
        }
        read_json(r.send(tar).map_err(error::of_ureq)?)
    }

    // Images.

    /// `GET /v1/images`: the base image and the pulled ones.
    pub fn images(&self) -> Result<List<Image>, Error> {
        Client::call(self.req("GET", "/v1/images"), None)
    }

    /// `POST /v1/images/pull`: its events, a progress per layer, then done or failed.
    pub fn pull_image(&self, image: &str, secret: Option<&str>) -> Result<PullEvents, Error> {
        let mut body = json!({ "image": image });
        if let Some(s) = secret {
            body["image_pull_secret"] = json!(s);
        }
        let body = Client::open(
            self.json_req("POST", "/v1/images/pull")
                .set("accept", "text/event-stream"),
            Some(&body),
        )?;
        Ok(PullEvents::new(body))
    }

    // Volumes.

    /// `POST /v1/volumes`.
    pub fn create_volume(&self, c: &VolumeCreate) -> Result<VolumeObject, Error> {
        Client::call(self.json_req("POST", "/v1/volumes"), Some(&c.to_json()))
    }

    /// `GET /v1/volumes`.
    pub fn volumes(&self) -> Result<List<VolumeObject>, Error> {
        Client::call(self.req("GET", "/v1/volumes"), None)
    }

    /// `GET /v1/volumes/{id}` (by id or name).
    pub fn volume(&self, id: &str) -> Result<VolumeObject, Error> {
        Client::call(
            self.req("GET", &format!("/v1/volumes/{}", url_part(id))),
            None,
        )
    }

    /// `DELETE /v1/volumes/{id}`: the volume and its files (one still mounted is refused).
    pub fn delete_volume(&self, id: &str) -> Result<(), Error> {
        self.req("DELETE", &format!("/v1/volumes/{}", url_part(id)))
            .call()
            .map_err(error::of_ureq)?;
        Ok(())
    }

    // Secrets.

    /// `PUT /v1/secrets/{name}`: makes or replaces it.
    pub fn put_secret(&self, name: &str, s: &SecretPut) -> Result<SecretObject, Error> {
        Client::call(
            self.json_req("PUT", &format!("/v1/secrets/{}", url_part(name))),
            Some(&s.to_json()),
        )
    }

    /// `GET /v1/secrets`: their names and hosts (never a value).
    pub fn secrets(&self) -> Result<List<SecretObject>, Error> {
        Client::call(self.req("GET", "/v1/secrets"), None)
    }

    /// `GET /v1/secrets/{name}`.
    pub fn secret(&self, name: &str) -> Result<SecretObject, Error> {
        Client::call(
            self.req("GET", &format!("/v1/secrets/{}", url_part(name))),
            None,
        )
    }

    /// `DELETE /v1/secrets/{name}`.
    pub fn delete_secret(&self, name: &str) -> Result<SecretDeleted, Error> {
        Client::call(
            self.req("DELETE", &format!("/v1/secrets/{}", url_part(name))),
            None,
        )
    }

    // The functions interface.

    /// `POST /v1/functions/{function_id}` (`sandbox::run`, `sandbox::fs::read`, ...): its
    /// reply. A failure is [`Error::Node`] with the function's S-code ([`Code::Other`]).
    pub fn call_function(&self, function_id: &str, payload: &Value) -> Result<Value, Error> {
        Client::call(
            self.json_req("POST", &format!("/v1/functions/{}", url_part(function_id))),
            Some(payload),
        )
    }
}

fn read_json<T: DeserializeOwned>(resp: ureq::Response) -> Result<T, Error> {
    let mut text = String::new();
    resp.into_reader()
        .read_to_string(&mut text)
        .map_err(|e| Error::Transport(format!("reading the answer: {e}")))?;
    serde_json::from_str(&text).map_err(|e| Error::Decode(e.to_string()))
}

fn download(resp: ureq::Response) -> Download {
    Download {
        len: resp
            .header("content-length")
            .and_then(|v| v.parse::<u64>().ok()),
        content_range: resp.header("content-range").map(str::to_string),
        body: resp.into_reader(),
    }
}
