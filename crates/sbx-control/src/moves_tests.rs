//! Moves on a control plane on loopback (SQLite, and PostgreSQL where `SBX_TEST_PG_URL` is
//! set) with fake nodes: small axum servers that speak the node's side of a move (release,
//! takeover, forget, and `moved` on /v1 once released) as the contract says, count what they
//! are asked, and can be told to refuse, fail for a while, or hold a call until let go.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, post};
use axum::{Json, Router};
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use sbx_api::moves::{parse_forget, parse_release, parse_takeover};
use sbx_api::{ApiError, ErrorCode};
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use crate::db::tests::run_both;
use crate::db::{Capacity, Db, MoveRow, NodeReg, SandboxRow};
use crate::server::{router, Ctl};

/// The machine both fake nodes are on (a takeover reads the old node's files directly).
const HOST: &str = "fakehost";
/// How long a test waits for a move to get somewhere.
const WAIT: Duration = Duration::from_secs(20);

static NEXT: AtomicUsize = AtomicUsize::new(0);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// ---- the fake node ----

/// What a fake node is told to do.
#[derive(Default)]
struct Behave {
    /// Its release answers 503 copy_behind this many more times.
    copy_behind: u32,
    /// Its takeover answers 503 takeover_failed this many more times.
    takeover_503: u32,
    /// Its takeover (not a reclaim) is refused with this code (409).
    takeover_refuse: Option<ErrorCode>,
    /// A release keeps nothing (a reclaim then answers 404).
    keep_nothing: bool,
    /// A release is held (after the sandbox is fenced) until the gate lets it go.
    hold_release: bool,
    /// A takeover that is not a reclaim is held (before it takes) until the gate lets it go.
    hold_takeover: bool,
    /// A reclaim is held until the gate lets it go.
    hold_reclaim: bool,
}

struct Held {
    epoch: u64,
    status: String,
    volumes: bool,
    /// The release's answer once released (fenced, kept asleep).
    released: Option<Value>,
}

#[derive(Default)]
struct FakeState {
    sandboxes: HashMap<String, Held>,
    /// What the node knows of sandboxes it holds no more: the epoch and where they went.
    tombs: HashMap<String, (u64, Option<String>)>,
    /// Releases answered, by move.
    releases: HashMap<String, Value>,
    /// Takeovers answered, by sandbox and epoch.
    takeovers: HashMap<(String, u64), Value>,
}

struct Fake {
    name: String,
    state: Mutex<FakeState>,
    behave: Mutex<Behave>,
    gate: Semaphore,
    /// Every call of a move's routes: its verb and body.
    calls: Mutex<Vec<(String, Value)>>,
    /// Every call of /v1 routes: method and path.
    v1: Mutex<Vec<String>>,
}

impl Fake {
    fn calls(&self, verb: &str) -> Vec<Value> {
        lock(&self.calls)
            .iter()
            .filter(|(v, _)| v == verb)
            .map(|(_, b)| b.clone())
            .collect()
    }

    fn hold(&self, id: &str, epoch: u64, status: &str, volumes: bool) {
        lock(&self.state).sandboxes.insert(
            id.to_string(),
            Held {
                epoch,
                status: status.into(),
                volumes,
                released: None,
            },
        );
    }

    fn epoch_of(&self, id: &str) -> Option<(u64, bool)> {
        lock(&self.state)
            .sandboxes
            .get(id)
            .map(|h| (h.epoch, h.released.is_some()))
    }

    fn open(&self, n: usize) {
        self.gate.add_permits(n);
    }

    async fn wait_gate(&self) {
        if let Ok(p) = self.gate.acquire().await {
            p.forget();
        }
    }
}

fn err(code: ErrorCode, message: &str, beside: &[(&str, Value)]) -> Response {
    let mut e = ApiError::new(code, message);
    for (k, v) in beside {
        e = e.with_beside(*k, v.clone());
    }
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, Json(sbx_api::error_body(&e, "req-fake", None))).into_response()
}

fn bad(e: ApiError) -> Response {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::BAD_REQUEST);
    (status, Json(sbx_api::error_body(&e, "req-fake", None))).into_response()
}

async fn fake_release(State(n): State<Arc<Fake>>, Path(id): Path<String>, body: Bytes) -> Response {
    lock(&n.calls).push((
        "release".into(),
        serde_json::from_slice(&body).unwrap_or(Value::Null),
    ));
    let r = match parse_release(&body) {
        Ok(r) => r,
        Err(e) => return bad(e),
    };
    {
        let st = lock(&n.state);
        if let Some(a) = st.releases.get(&r.move_id) {
            return Json(a.clone()).into_response();
        }
        let Some(h) = st.sandboxes.get(&id) else {
            return err(ErrorCode::SandboxNotFound, "no such sandbox", &[]);
        };
        if h.released.is_some() || h.epoch != r.epoch {
            return err(
                ErrorCode::WrongEpoch,
                "not at that epoch",
                &[("epoch", json!(h.epoch))],
            );
        }
        if h.volumes {
            return err(ErrorCode::NotMovable, "it has volumes", &[]);
        }
    }
    let keep_nothing = {
        let mut b = lock(&n.behave);
        if b.copy_behind > 0 {
            b.copy_behind -= 1;
            return err(
                ErrorCode::CopyBehind,
                "the store is behind",
                &[("disk_ms", json!(5)), ("memory_ms", json!(5))],
            );
        }
        b.keep_nothing
    };
    let answer = {
        let mut st = lock(&n.state);
        let Some(h) = st.sandboxes.get_mut(&id) else {
            return err(ErrorCode::SandboxNotFound, "no such sandbox", &[]);
        };
        let slept = h.status == "running";
        h.status = "sleeping".into();
        let answer = json!({
            "sandbox_id": id, "epoch": r.epoch, "to": r.to, "move_id": r.move_id,
            "slept": slept,
            "stored": {"epoch": r.epoch, "generation": 3, "build": "0123456789abcdef",
                "image": "img-1", "bytes": 100, "stored_bytes": 50},
            "waited_ms": 1,
            "local": {"host": HOST, "memory": format!("/fake/{}/memory", n.name),
                "disk": format!("/fake/{}/disk", n.name)},
        });
        h.released = Some(answer.clone());
        if keep_nothing {
            st.sandboxes.remove(&id);
            st.tombs.insert(id.clone(), (r.epoch, Some(r.to.clone())));
        }
        st.releases.insert(r.move_id.clone(), answer.clone());
        answer
    };
    if lock(&n.behave).hold_release {
        n.wait_gate().await;
    }
    Json(answer).into_response()
}

async fn fake_takeover(
    State(n): State<Arc<Fake>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    lock(&n.calls).push((
        "takeover".into(),
        serde_json::from_slice(&body).unwrap_or(Value::Null),
    ));
    let r = match parse_takeover(&body) {
        Ok(r) => r,
        Err(e) => return bad(e),
    };
    let known = |st: &FakeState| {
        let held = st.sandboxes.get(&id).map(|h| h.epoch);
        let tomb = st.tombs.get(&id).map(|t| t.0);
        held.max(tomb)
    };
    {
        let st = lock(&n.state);
        if let Some(a) = st.takeovers.get(&(id.clone(), r.epoch)) {
            return Json(a.clone()).into_response();
        }
        if let Some(k) = known(&st).filter(|k| r.epoch <= *k) {
            return err(
                ErrorCode::WrongEpoch,
                "a takeover at an old epoch",
                &[("epoch", json!(k))],
            );
        }
    }
    if r.reclaim {
        if lock(&n.behave).hold_reclaim {
            n.wait_gate().await;
        }
        let mut st = lock(&n.state);
        let Some(h) = st.sandboxes.get_mut(&id).filter(|h| h.released.is_some()) else {
            return err(ErrorCode::SandboxNotFound, "it kept nothing", &[]);
        };
        h.released = None;
        h.epoch = r.epoch;
        h.status = if r.wake { "running" } else { "sleeping" }.into();
        let a = json!({"sandbox_id": id, "epoch": r.epoch, "source": "kept",
            "disk_ms": 0, "memory_ms": 0, "memory": 10, "woke": r.wake});
        st.takeovers.insert((id.clone(), r.epoch), a.clone());
        return Json(a).into_response();
    }
    if lock(&n.behave).hold_takeover {
        n.wait_gate().await;
    }
    {
        let mut b = lock(&n.behave);
        if b.takeover_503 > 0 {
            b.takeover_503 -= 1;
            return err(ErrorCode::TakeoverFailed, "the store did not answer", &[]);
        }
        match b.takeover_refuse {
            Some(ErrorCode::BuildMissing) => {
                return err(
                    ErrorCode::BuildMissing,
                    "another build wrote its memory",
                    &[("build", json!("fedcba9876543210"))],
                )
            }
            Some(ErrorCode::ImageMissing) => {
                return err(
                    ErrorCode::ImageMissing,
                    "its image is not to be had",
                    &[("image", json!("img-1"))],
                )
            }
            Some(code) => return err(code, "refused", &[]),
            None => {}
        }
    }
    let mut st = lock(&n.state);
    // A forget that came while it was held fences it.
    if let Some(k) = known(&st).filter(|k| r.epoch <= *k) {
        return err(
            ErrorCode::WrongEpoch,
            "forgotten meanwhile",
            &[("epoch", json!(k))],
        );
    }
    let local_here = r.from.local.as_ref().is_some_and(|l| l.host == HOST);
    let source = if !r.from_store && local_here {
        "disk"
    } else {
        "store"
    };
    st.sandboxes.insert(
        id.clone(),
        Held {
            epoch: r.epoch,
            status: if r.wake { "running" } else { "sleeping" }.into(),
            volumes: false,
            released: None,
        },
    );
    st.tombs.remove(&id);
    let a = json!({"sandbox_id": id, "epoch": r.epoch, "source": source,
        "disk_ms": 3, "memory_ms": 4, "memory": 1000, "woke": r.wake});
    st.takeovers.insert((id.clone(), r.epoch), a.clone());
    Json(a).into_response()
}

async fn fake_forget(State(n): State<Arc<Fake>>, Path(id): Path<String>, body: Bytes) -> Response {
    lock(&n.calls).push((
        "forget".into(),
        serde_json::from_slice(&body).unwrap_or(Value::Null),
    ));
    let r = match parse_forget(&body) {
        Ok(r) => r,
        Err(e) => return bad(e),
    };
    let mut st = lock(&n.state);
    if let Some(h) = st.sandboxes.get(&id) {
        if h.epoch > r.epoch {
            return err(
                ErrorCode::WrongEpoch,
                "held at a later epoch",
                &[("epoch", json!(h.epoch))],
            );
        }
    }
    let removed = st.sandboxes.remove(&id).is_some();
    let epoch = st.tombs.get(&id).map_or(r.epoch, |t| t.0.max(r.epoch));
    st.tombs.insert(id.clone(), (epoch, r.to.clone()));
    Json(json!({"sandbox_id": id, "epoch": r.epoch, "removed": removed})).into_response()
}

/// `/v1/sandboxes/{id}` and below: served while held, `moved` once released or forgotten.
async fn fake_v1(State(n): State<Arc<Fake>>, req: axum::extract::Request) -> Response {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    lock(&n.v1).push(format!("{method} {path}"));
    let rest = path.strip_prefix("/v1/sandboxes/").unwrap_or("");
    let (id, tail) = rest.split_once('/').unwrap_or((rest, ""));
    let (id, tail) = (id.to_string(), tail.to_string());
    let body = req
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let mut st = lock(&n.state);
    let moved = |epoch: u64, to: Option<String>| {
        err(
            ErrorCode::Moved,
            "the sandbox was moved",
            &[("to", json!(to)), ("epoch", json!(epoch))],
        )
    };
    match st.sandboxes.get(&id) {
        Some(h) if h.released.is_none() => {}
        Some(h) => {
            let to = h
                .released
                .as_ref()
                .and_then(|r| r["to"].as_str())
                .map(String::from);
            return moved(h.epoch, to);
        }
        None => {
            return match st.tombs.get(&id) {
                Some((e, to)) => moved(*e, to.clone()),
                None => err(ErrorCode::SandboxNotFound, "no such sandbox", &[]),
            }
        }
    }
    if tail.is_empty() && method == Method::DELETE {
        st.sandboxes.remove(&id);
        return Json(json!({"object": "sandbox", "id": id, "status": "deleted"})).into_response();
    }
    let Some(h) = st.sandboxes.get(&id) else {
        return err(ErrorCode::SandboxNotFound, "no such sandbox", &[]);
    };
    if tail.is_empty() {
        let mut v = json!({"object": "sandbox", "id": id, "status": h.status,
            "served_by": n.name});
        if h.volumes {
            v["volumes"] = json!([{"volume": "vol-1", "path": "/data"}]);
        }
        return Json(v).into_response();
    }
    Json(
        json!({"served_by": n.name, "tail": tail, "method": method.as_str(),
        "body": String::from_utf8_lossy(&body)}),
    )
    .into_response()
}

/// `GET /v1/sandboxes`: the sandboxes it holds and has not released, by id.
async fn fake_list(State(n): State<Arc<Fake>>) -> Response {
    let st = lock(&n.state);
    let mut ids: Vec<&String> = st
        .sandboxes
        .iter()
        .filter(|(_, h)| h.released.is_none())
        .map(|(id, _)| id)
        .collect();
    ids.sort();
    let data: Vec<Value> = ids
        .into_iter()
        .filter_map(|id| st.sandboxes.get(id).map(|h| (id, h)))
        .map(|(id, h)| {
            let volumes = if h.volumes {
                json!([{"volume": "vol-1", "path": "/data"}])
            } else {
                json!([])
            };
            json!({"object": "sandbox", "id": id, "status": h.status, "volumes": volumes})
        })
        .collect();
    Json(json!({"object": "list", "data": data, "has_more": false, "next_cursor": null}))
        .into_response()
}

struct FakeNode {
    addr: SocketAddr,
    fake: Arc<Fake>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeNode {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl std::ops::Deref for FakeNode {
    type Target = Fake;
    fn deref(&self) -> &Fake {
        &self.fake
    }
}

async fn fake_node(name: &str) -> anyhow::Result<FakeNode> {
    let fake = Arc::new(Fake {
        name: name.into(),
        state: Mutex::new(FakeState::default()),
        behave: Mutex::new(Behave::default()),
        gate: Semaphore::new(0),
        calls: Mutex::new(Vec::new()),
        v1: Mutex::new(Vec::new()),
    });
    let app = Router::new()
        .route("/internal/sandboxes/{id}/release", post(fake_release))
        .route("/internal/sandboxes/{id}/takeover", post(fake_takeover))
        .route("/internal/sandboxes/{id}/forget", post(fake_forget))
        .route("/v1/sandboxes", axum::routing::get(fake_list))
        .route("/v1/sandboxes/{id}", any(fake_v1))
        .route("/v1/sandboxes/{id}/{*rest}", any(fake_v1))
        .with_state(fake.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    let task = tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    });
    Ok(FakeNode { addr, fake, task })
}

// ---- the control plane ----

/// A temporary folder, removed when dropped.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new() -> anyhow::Result<TempDir> {
        let p = std::env::temp_dir().join(format!(
            "sbx-control-moves-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p)?;
        Ok(TempDir(p))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A control plane on loopback (its server and, if asked, its move machine), stopped when
/// dropped.
struct Control {
    addr: SocketAddr,
    db: Db,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Control {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

async fn control(
    db_url: &str,
    machine: bool,
    store: Option<sbx_blob::Store>,
) -> anyhow::Result<Control> {
    control_with(db_url, machine, store, Duration::from_secs(60), None).await
}

/// [`control`] with nodes' leases of `lease` (its batches' runner runs with its machine, and
/// recovers a node lost `recover_after` past its lease and grace).
async fn control_with(
    db_url: &str,
    machine: bool,
    store: Option<sbx_blob::Store>,
    lease: Duration,
    recover_after: Option<Duration>,
) -> anyhow::Result<Control> {
    let db = Db::open(db_url).await?;
    let mut ctl = Ctl::new(db.clone(), lease, None);
    if let Some(s) = store {
        ctl = ctl.with_store(s);
    }
    let ctl = Arc::new(ctl);
    let mut tasks = Vec::new();
    if machine {
        tasks.push(crate::machine::start(ctl.clone()));
        tasks.push(crate::batch::start(ctl.clone(), recover_after));
    }
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    let app = router(ctl).into_make_service_with_connect_info::<SocketAddr>();
    tasks.push(tokio::spawn(async move {
        let _ = axum::serve(l, app).await;
    }));
    Ok(Control { addr, db, tasks })
}

type TestClient = Client<HttpConnector, Full<Bytes>>;

/// A control plane, two fake nodes `a` and `b` in its table, and a sandbox held by `a` at
/// epoch 1 (running).
struct Fleet {
    ctl: Control,
    a: FakeNode,
    b: FakeNode,
    a_id: String,
    b_id: String,
    sbx: String,
    http: TestClient,
    url: String,
}

impl Fleet {
    async fn new(db_url: &str) -> anyhow::Result<Fleet> {
        Fleet::with(db_url, Duration::from_secs(60), None, None).await
    }

    /// [`Fleet::new`] on a control plane of nodes' leases of `lease`, with `store` (and
    /// `--recover-after-seconds`' `recover_after`).
    async fn with(
        db_url: &str,
        lease: Duration,
        store: Option<sbx_blob::Store>,
        recover_after: Option<Duration>,
    ) -> anyhow::Result<Fleet> {
        let ctl = control_with(db_url, true, store, lease, recover_after).await?;
        let a = fake_node("a").await?;
        let b = fake_node("b").await?;
        let mut ids = Vec::new();
        for (name, addr) in [("a", a.addr), ("b", b.addr)] {
            let reg = NodeReg {
                name: name.into(),
                url: format!("http://{addr}"),
                build: "0123456789abcdef".into(),
                capacity: Capacity {
                    max_sandboxes: 10,
                    sandboxes: 0,
                    images: vec![],
                },
                e2b_url: None,
                preview_url: None,
                held: Vec::new(),
            };
            ids.push(ctl.db.register_node(&reg, 600_000).await?.id);
        }
        let sbx = sbx_api::ids::new_id("sbx");
        ctl.db.insert_sandbox(&row(&sbx, &ids[0], 1)).await?;
        a.hold(&sbx, 1, "running", false);
        let url = format!("http://{}", ctl.addr);
        Ok(Fleet {
            ctl,
            a,
            b,
            a_id: ids[0].clone(),
            b_id: ids[1].clone(),
            sbx,
            http: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
            url,
        })
    }

    /// A call to the control plane: status, headers and JSON body.
    async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<(u16, axum::http::HeaderMap, Value)> {
        let mut b = hyper::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.url));
        if body.is_some() {
            b = b.header(header::CONTENT_TYPE, "application/json");
        }
        let req = b.body(Full::new(Bytes::from(
            body.map(|v| v.to_string()).unwrap_or_default(),
        )))?;
        let resp = tokio::time::timeout(Duration::from_secs(30), self.http.request(req))
            .await
            .context("no answer in 30 s")??;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let bytes = resp.into_body().collect().await?.to_bytes();
        Ok((
            status,
            headers,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        ))
    }

    async fn start_move(&self, body: Value) -> anyhow::Result<Value> {
        let (s, _, v) = self.call("POST", "/internal/moves", Some(body)).await?;
        ensure!(s == 202, "a move: {s} {v}");
        Ok(v)
    }

    async fn get_move(&self, id: &str) -> anyhow::Result<Value> {
        let (s, _, v) = self
            .call("GET", &format!("/internal/moves/{id}"), None)
            .await?;
        ensure!(s == 200, "GET the move: {s} {v}");
        Ok(v)
    }

    /// Waits until the move is at `step`.
    async fn wait_step(&self, id: &str, step: &str) -> anyhow::Result<Value> {
        let deadline = Instant::now() + WAIT;
        loop {
            let v = self.get_move(id).await?;
            if v["step"] == step {
                return Ok(v);
            }
            if Instant::now() > deadline {
                bail!("the move is not {step} in {WAIT:?}: {v}");
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    async fn sandbox_row(&self) -> anyhow::Result<SandboxRow> {
        self.ctl
            .db
            .sandbox(&self.sbx)
            .await?
            .context("the sandbox's row is gone")
    }
}

fn row(id: &str, node: &str, epoch: i64) -> SandboxRow {
    SandboxRow {
        id: id.into(),
        name: None,
        node_id: node.into(),
        epoch,
        status: "running".into(),
        build: "0123456789abcdef".into(),
        created_at_ms: 0,
        updated_at_ms: 0,
    }
}

async fn wait_until(what: &str, mut f: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + WAIT;
    while !f() {
        if Instant::now() > deadline {
            bail!("{what}: not within {WAIT:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

macro_rules! both {
    ($test:ident, $case:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $test() {
            run_both(stringify!($test), |url| Box::pin($case(url))).await;
        }
    };
}

// ---- the cases ----

both!(a_move_goes_releasing_taking_over_done, case_done);
async fn case_done(url: String) -> anyhow::Result<()> {
    let f = Fleet::new(&url).await?;
    let m = f
        .start_move(json!({"sandbox_id": f.sbx, "to": "b"}))
        .await?;
    let id = m["id"].as_str().unwrap_or("").to_string();
    ensure!(sbx_api::ids::is_id("mov", &id), "{m}");
    // The spec's fields, exactly.
    let mut keys: Vec<&str> = m
        .as_object()
        .context("an object")?
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    ensure!(
        keys == [
            "attempts",
            "batch",
            "created_at",
            "ended_at",
            "epoch",
            "error",
            "from",
            "from_store",
            "id",
            "next_attempt_at",
            "object",
            "project_id",
            "release",
            "sandbox_id",
            "step",
            "takeover",
            "to",
            "updated_at",
            "wake",
            "why"
        ],
        "{keys:?}"
    );
    ensure!(
        m["object"] == "move" && m["sandbox_id"] == f.sbx.as_str(),
        "{m}"
    );
    ensure!(
        m["project_id"] == "default" && m["why"] == "operator",
        "{m}"
    );
    ensure!(
        m["from"] == json!({"id": f.a_id, "name": "a"})
            && m["to"] == json!({"id": f.b_id, "name": "b"}),
        "{m}"
    );
    ensure!(m["epoch"] == 1 && m["step"] == "releasing", "{m}");
    // It ran: the new node wakes it.
    ensure!(m["wake"] == true && m["from_store"] == false, "{m}");
    ensure!(m["release"].is_null() && m["takeover"].is_null() && m["error"].is_null());
    ensure!(m["attempts"] == 0 && m["next_attempt_at"].is_null() && m["batch"].is_null());
    ensure!(
        m["created_at"].is_string() && m["ended_at"].is_null(),
        "{m}"
    );

    let done = f.wait_step(&id, "done").await?;
    ensure!(
        done["release"]["epoch"] == 1 && done["release"]["slept"] == true,
        "{done}"
    );
    ensure!(
        done["takeover"]["source"] == "disk" && done["takeover"]["woke"] == true,
        "{done}"
    );
    ensure!(done["error"].is_null() && done["attempts"] == 0, "{done}");
    ensure!(done["ended_at"].is_string(), "{done}");
    // The table: the new node at E+1, running as the takeover left it.
    let r = f.sandbox_row().await?;
    ensure!(
        r.node_id == f.b_id && r.epoch == 2 && r.status == "running",
        "{r:?}"
    );
    // What the nodes were asked.
    let rel = f.a.calls("release");
    ensure!(rel.len() == 1, "{rel:?}");
    ensure!(
        rel[0] == json!({"epoch": 1, "to": "b", "move_id": id}),
        "{}",
        rel[0]
    );
    let tk = f.b.calls("takeover");
    ensure!(tk.len() == 1, "{tk:?}");
    ensure!(tk[0]["epoch"] == 2 && tk[0]["wake"] == true && tk[0]["move_id"] == id.as_str());
    ensure!(
        tk[0]["from"]["id"] == f.a_id.as_str()
            && tk[0]["from"]["name"] == "a"
            && tk[0]["from"]["url"] == format!("http://{}", f.a.addr)
            && tk[0]["from"]["local"]["host"] == HOST
            && tk[0]["from_store"] == false,
        "{}",
        tk[0]
    );
    wait_until("the old node is told to forget", || {
        !f.a.calls("forget").is_empty()
    })
    .await?;
    ensure!(f.a.calls("forget")[0] == json!({"epoch": 1, "to": "b"}));
    ensure!(f.a.epoch_of(&f.sbx).is_none() && f.b.epoch_of(&f.sbx) == Some((2, false)));

    // Calls go to the new node now, with the table's epoch.
    let (s, _, v) = f
        .call("GET", &format!("/v1/sandboxes/{}", f.sbx), None)
        .await?;
    ensure!(
        s == 200 && v["served_by"] == "b" && v["epoch"] == 2,
        "{s} {v}"
    );
    ensure!(v["node"] == json!({"id": f.b_id, "name": "b"}), "{v}");

    // The list of its moves, and a move back: E = 2, to a at 3.
    let (s, _, list) = f
        .call(
            "GET",
            &format!("/internal/moves?sandbox_id={}", f.sbx),
            None,
        )
        .await?;
    ensure!(s == 200 && list["object"] == "list", "{list}");
    ensure!(
        list["data"].as_array().map(Vec::len) == Some(1) && list["data"][0]["id"] == id.as_str()
    );
    let back = f
        .start_move(json!({"sandbox_id": f.sbx, "to": f.a_id, "wake": false}))
        .await?;
    ensure!(back["epoch"] == 2 && back["wake"] == false, "{back}");
    let back_id = back["id"].as_str().unwrap_or("");
    let done = f.wait_step(back_id, "done").await?;
    ensure!(done["takeover"]["woke"] == false, "{done}");
    let r = f.sandbox_row().await?;
    ensure!(
        r.node_id == f.a_id && r.epoch == 3 && r.status == "sleeping",
        "{r:?}"
    );
    let (_, _, all) = f.call("GET", "/internal/moves", None).await?;
    ensure!(all["data"].as_array().map(Vec::len) == Some(2), "{all}");
    let (s, _, v) = f.call("GET", "/internal/moves?x=1", None).await?;
    ensure!(s == 400 && v["error"]["code"] == "unknown_parameter", "{v}");
    let (s, _, v) = f
        .call("GET", "/internal/moves/mov-0000000000000000", None)
        .await?;
    ensure!(s == 404 && v["error"]["code"] == "not_found", "{v}");
    Ok(())
}

both!(a_move_is_refused_where_it_cannot_be, case_refusals);
async fn case_refusals(url: String) -> anyhow::Result<()> {
    let f = Fleet::new(&url).await?;
    let refused = |s: u16, v: &Value, status: u16, code: &str, param: Option<&str>| {
        ensure!(
            s == status && v["error"]["code"] == code && v["error"]["param"].as_str() == param,
            "want {status} {code} ({param:?}): {s} {v}"
        );
        Ok(())
    };
    let (s, _, v) = f
        .call(
            "POST",
            "/internal/moves",
            Some(json!({"sandbox_id": "sbx-0000000000000000", "to": "b"})),
        )
        .await?;
    refused(s, &v, 404, "sandbox_not_found", Some("sandbox_id"))?;
    let (s, _, v) = f
        .call(
            "POST",
            "/internal/moves",
            Some(json!({"sandbox_id": f.sbx, "to": "nowhere"})),
        )
        .await?;
    refused(s, &v, 404, "not_found", Some("to"))?;
    let (s, _, v) = f
        .call(
            "POST",
            "/internal/moves",
            Some(json!({"sandbox_id": f.sbx, "to": "a"})),
        )
        .await?;
    refused(s, &v, 409, "not_movable", Some("to"))?;
    let (s, _, v) = f
        .call(
            "POST",
            "/internal/moves",
            Some(json!({"sandbox_id": f.sbx, "to": "b", "from_store": true})),
        )
        .await?;
    refused(s, &v, 400, "unknown_field", Some("from_store"))?;
    let (s, _, v) = f
        .call("POST", "/internal/moves", Some(json!({"to": "b"})))
        .await?;
    refused(s, &v, 400, "invalid_field", Some("sandbox_id"))?;
    // A node that takes no new sandboxes takes no moves either.
    f.ctl.db.set_draining(&f.b_id, true).await?;
    let (s, _, v) = f
        .call(
            "POST",
            "/internal/moves",
            Some(json!({"sandbox_id": f.sbx, "to": "b"})),
        )
        .await?;
    refused(s, &v, 409, "not_movable", Some("to"))?;
    f.ctl.db.set_draining(&f.b_id, false).await?;
    // A sandbox with volumes (its node says so).
    let vol = sbx_api::ids::new_id("sbx");
    f.ctl.db.insert_sandbox(&row(&vol, &f.a_id, 1)).await?;
    f.a.hold(&vol, 1, "running", true);
    let (s, _, v) = f
        .call(
            "POST",
            "/internal/moves",
            Some(json!({"sandbox_id": vol, "to": "b"})),
        )
        .await?;
    refused(s, &v, 409, "not_movable", Some("sandbox_id"))?;
    ensure!(f.ctl.db.moves_of(&vol).await?.is_empty());
    // A second move while one is under way.
    lock(&f.a.behave).hold_release = true;
    let m = f
        .start_move(json!({"sandbox_id": f.sbx, "to": "b"}))
        .await?;
    let id = m["id"].as_str().unwrap_or("").to_string();
    wait_until("the release is asked", || f.a.calls("release").len() == 1).await?;
    let (s, _, v) = f
        .call(
            "POST",
            "/internal/moves",
            Some(json!({"sandbox_id": f.sbx, "to": "b"})),
        )
        .await?;
    refused(s, &v, 409, "already_moving", Some("sandbox_id"))?;
    ensure!(v["move_id"] == id.as_str(), "{v}");
    f.a.open(1);
    f.wait_step(&id, "done").await?;
    Ok(())
}

both!(copy_behind_is_asked_again_with_backoff, case_copy_behind);
async fn case_copy_behind(url: String) -> anyhow::Result<()> {
    let f = Fleet::new(&url).await?;
    lock(&f.a.behave).copy_behind = 2;
    let m = f
        .start_move(json!({"sandbox_id": f.sbx, "to": "b"}))
        .await?;
    let id = m["id"].as_str().unwrap_or("").to_string();
    wait_until("a first release", || !f.a.calls("release").is_empty()).await?;
    let deadline = Instant::now() + WAIT;
    let waiting = loop {
        let v = f.get_move(&id).await?;
        if v["next_attempt_at"].is_string() {
            break v;
        }
        ensure!(Instant::now() < deadline, "never waiting: {v}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    ensure!(
        waiting["step"] == "releasing" && waiting["attempts"] == 1,
        "{waiting}"
    );
    ensure!(
        waiting["error"]["code"] == "copy_behind" && waiting["error"]["disk_ms"] == 5,
        "{waiting}"
    );
    ensure!(
        waiting["next_attempt_at"].as_str() > waiting["updated_at"].as_str(),
        "{waiting}"
    );
    // The table has not changed meanwhile.
    ensure!(f.sandbox_row().await?.epoch == 1);
    let t0 = Instant::now();
    let done = f.wait_step(&id, "done").await?;
    // 1 s, then 2 s.
    ensure!(
        t0.elapsed() >= Duration::from_millis(1500),
        "{:?}",
        t0.elapsed()
    );
    ensure!(f.a.calls("release").len() == 3);
    ensure!(done["attempts"] == 0 && done["error"].is_null(), "{done}");
    ensure!(f.sandbox_row().await?.epoch == 2);
    Ok(())
}

both!(
    a_takeover_that_fails_for_a_while_is_asked_again,
    case_takeover_503
);
async fn case_takeover_503(url: String) -> anyhow::Result<()> {
    let f = Fleet::new(&url).await?;
    lock(&f.b.behave).takeover_503 = 1;
    let m = f
        .start_move(json!({"sandbox_id": f.sbx, "to": "b"}))
        .await?;
    let id = m["id"].as_str().unwrap_or("");
    let done = f.wait_step(id, "done").await?;
    ensure!(f.b.calls("takeover").len() == 2, "{done}");
    ensure!(f.sandbox_row().await?.epoch == 2);
    Ok(())
}

both!(
    a_refused_takeover_is_reclaimed_by_the_old_node,
    case_reclaim
);
async fn case_reclaim(url: String) -> anyhow::Result<()> {
    let f = Fleet::new(&url).await?;
    lock(&f.b.behave).takeover_refuse = Some(ErrorCode::BuildMissing);
    let m = f
        .start_move(json!({"sandbox_id": f.sbx, "to": "b"}))
        .await?;
    let id = m["id"].as_str().unwrap_or("").to_string();
    let failed = f.wait_step(&id, "failed").await?;
    ensure!(
        failed["error"]["code"] == "build_missing"
            && failed["error"]["build"] == "fedcba9876543210",
        "{failed}"
    );
    ensure!(
        failed["takeover"]["source"] == "kept" && failed["ended_at"].is_string(),
        "{failed}"
    );
    // Back at the old node, two on.
    let r = f.sandbox_row().await?;
    ensure!(
        r.node_id == f.a_id && r.epoch == 3 && r.status == "running",
        "{r:?}"
    );
    ensure!(f.a.epoch_of(&f.sbx) == Some((3, false)));
    // The new node forgot first (at E+1), then the old one took it back (E+2).
    ensure!(f.b.calls("forget") == [json!({"epoch": 2, "to": "a"})]);
    let back = f.a.calls("takeover");
    ensure!(back.len() == 1 && back[0]["reclaim"] == true && back[0]["epoch"] == 3);
    ensure!(back[0]["from"]["name"] == "b" && back[0]["move_id"] == id.as_str());
    // Calls go to the old node again.
    let (s, _, v) = f
        .call("GET", &format!("/v1/sandboxes/{}", f.sbx), None)
        .await?;
    ensure!(
        s == 200 && v["served_by"] == "a" && v["epoch"] == 3,
        "{s} {v}"
    );
    Ok(())
}

both!(
    an_old_node_that_kept_nothing_restores_from_the_store,
    case_restore
);
async fn case_restore(url: String) -> anyhow::Result<()> {
    let f = Fleet::new(&url).await?;
    lock(&f.b.behave).takeover_refuse = Some(ErrorCode::ImageMissing);
    lock(&f.a.behave).keep_nothing = true;
    let m = f
        .start_move(json!({"sandbox_id": f.sbx, "to": "b", "wake": false}))
        .await?;
    let id = m["id"].as_str().unwrap_or("").to_string();
    let failed = f.wait_step(&id, "failed").await?;
    ensure!(
        failed["error"]["code"] == "image_missing" && failed["error"]["image"] == "img-1",
        "{failed}"
    );
    ensure!(failed["takeover"]["source"] == "store", "{failed}");
    let r = f.sandbox_row().await?;
    ensure!(
        r.node_id == f.a_id && r.epoch == 4 && r.status == "sleeping",
        "{r:?}"
    );
    let asked = f.a.calls("takeover");
    ensure!(asked.len() == 2, "{asked:?}");
    ensure!(asked[0]["reclaim"] == true && asked[0]["epoch"] == 3);
    ensure!(
        asked[1]["from_store"] == true && asked[1]["epoch"] == 4 && asked[1]["reclaim"] == false,
        "{}",
        asked[1]
    );
    ensure!(f.a.epoch_of(&f.sbx) == Some((4, false)));
    Ok(())
}

both!(a_control_plane_restarted_mid_move_resumes_it, case_restart);
async fn case_restart(url: String) -> anyhow::Result<()> {
    let mut f = Fleet::new(&url).await?;
    // Stopped while the release is asked, and again while the takeover is.
    lock(&f.a.behave).hold_release = true;
    lock(&f.b.behave).hold_takeover = true;
    let m = f
        .start_move(json!({"sandbox_id": f.sbx, "to": "b"}))
        .await?;
    let id = m["id"].as_str().unwrap_or("").to_string();
    wait_until("the release is asked", || f.a.calls("release").len() == 1).await?;
    f.ctl = control(&url, false, None).await?;
    f.url = format!("http://{}", f.ctl.addr);
    let stopped = f.get_move(&id).await?;
    ensure!(
        stopped["step"] == "releasing" && stopped["attempts"] == 1,
        "{stopped}"
    );
    // The held release ends (its caller is gone); a new control plane on the same database
    // asks it again (the same move: the node answers as it did).
    lock(&f.a.behave).hold_release = false;
    f.a.open(1);
    f.ctl = control(&url, true, None).await?;
    f.url = format!("http://{}", f.ctl.addr);
    let taking = f.wait_step(&id, "taking_over").await?;
    ensure!(taking["release"]["move_id"] == id.as_str(), "{taking}");
    ensure!(f.a.calls("release").len() == 2);
    wait_until("the takeover is asked", || f.b.calls("takeover").len() == 1).await?;
    ensure!(f.sandbox_row().await?.epoch == 2);
    f.ctl = control(&url, false, None).await?;
    lock(&f.b.behave).hold_takeover = false;
    f.b.open(1);
    f.ctl = control(&url, true, None).await?;
    f.url = format!("http://{}", f.ctl.addr);
    let done = f.wait_step(&id, "done").await?;
    ensure!(done["takeover"]["epoch"] == 2, "{done}");
    ensure!(f.b.calls("takeover").len() >= 2);
    let r = f.sandbox_row().await?;
    ensure!(r.node_id == f.b_id && r.epoch == 2, "{r:?}");
    // Nothing is left to do.
    ensure!(f.ctl.db.unfinished_moves().await?.is_empty());
    Ok(())
}

both!(a_move_is_cancelled_at_each_step, case_cancel);
async fn case_cancel(url: String) -> anyhow::Result<()> {
    let f = Fleet::new(&url).await?;
    let cancel = |id: String| {
        let f = &f;
        async move {
            f.call("POST", &format!("/internal/moves/{id}/cancel"), None)
                .await
        }
    };

    // Releasing, the release not answered: marked; the node released meanwhile, so the old
    // node takes it back (E+2) and the move fails as cancelled.
    lock(&f.a.behave).hold_release = true;
    let m = f
        .start_move(json!({"sandbox_id": f.sbx, "to": "b"}))
        .await?;
    let id = m["id"].as_str().unwrap_or("").to_string();
    wait_until("the release is asked", || f.a.calls("release").len() == 1).await?;
    let (s, _, v) = cancel(id.clone()).await?;
    ensure!(
        s == 202 && v["step"] == "releasing" && v["id"] == id.as_str(),
        "{s} {v}"
    );
    lock(&f.a.behave).hold_release = false;
    f.a.open(1);
    let failed = f.wait_step(&id, "failed").await?;
    ensure!(failed["error"]["code"] == "cancelled", "{failed}");
    ensure!(failed["takeover"]["source"] == "kept", "{failed}");
    ensure!(
        f.b.calls("takeover").is_empty(),
        "the new node was not asked"
    );
    ensure!(f.b.calls("forget") == [json!({"epoch": 2, "to": "a"})]);
    let r = f.sandbox_row().await?;
    ensure!(r.node_id == f.a_id && r.epoch == 3, "{r:?}");
    // Over: nothing to cancel.
    let (s, _, v) = cancel(id.clone()).await?;
    ensure!(
        s == 409 && v["error"]["code"] == "move_over" && v["move"]["id"] == id.as_str(),
        "{s} {v}"
    );

    // Releasing, waiting to ask again (the store behind): ends at once, nothing changed.
    lock(&f.a.behave).copy_behind = 100;
    let m = f
        .start_move(json!({"sandbox_id": f.sbx, "to": "b"}))
        .await?;
    let id = m["id"].as_str().unwrap_or("").to_string();
    let deadline = Instant::now() + WAIT;
    while f.get_move(&id).await?["error"]["code"] != "copy_behind" {
        ensure!(Instant::now() < deadline, "no copy_behind");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let asked = f.a.calls("release").len();
    let (s, _, v) = cancel(id.clone()).await?;
    ensure!(s == 202, "{s} {v}");
    let failed = f.wait_step(&id, "failed").await?;
    ensure!(failed["error"]["code"] == "cancelled", "{failed}");
    ensure!(
        f.a.calls("release").len() == asked,
        "asked again after the cancel"
    );
    let r = f.sandbox_row().await?;
    ensure!(r.node_id == f.a_id && r.epoch == 3, "{r:?}");
    lock(&f.a.behave).copy_behind = 0;

    // Taking over, the takeover not answered: reclaiming at once; the new node forgets (and
    // so refuses the takeover once it goes on), the old one takes it back.
    lock(&f.b.behave).hold_takeover = true;
    let m = f
        .start_move(json!({"sandbox_id": f.sbx, "to": "b"}))
        .await?;
    let id = m["id"].as_str().unwrap_or("").to_string();
    let before = f.b.calls("takeover").len();
    wait_until("the takeover is asked", || {
        f.b.calls("takeover").len() == before + 1
    })
    .await?;
    let (s, _, v) = cancel(id.clone()).await?;
    ensure!(s == 202 && v["step"] == "reclaiming", "{s} {v}");
    let failed = f.wait_step(&id, "failed").await?;
    ensure!(failed["error"]["code"] == "cancelled", "{failed}");
    let r = f.sandbox_row().await?;
    ensure!(r.node_id == f.a_id && r.epoch == 5, "{r:?}");
    lock(&f.b.behave).hold_takeover = false;
    f.b.open(1);
    // The held takeover, let go, is refused: the new node holds nothing.
    tokio::time::sleep(Duration::from_millis(100)).await;
    ensure!(f.b.epoch_of(&f.sbx).is_none());
    ensure!(f.a.epoch_of(&f.sbx) == Some((5, false)));

    // Going back: move_going_back, the move beside.
    lock(&f.b.behave).takeover_refuse = Some(ErrorCode::BuildMissing);
    lock(&f.a.behave).hold_reclaim = true;
    let m = f
        .start_move(json!({"sandbox_id": f.sbx, "to": "b"}))
        .await?;
    let id = m["id"].as_str().unwrap_or("").to_string();
    f.wait_step(&id, "reclaiming").await?;
    let (s, _, v) = cancel(id.clone()).await?;
    ensure!(
        s == 409 && v["error"]["code"] == "move_going_back" && v["move"]["step"] == "reclaiming",
        "{s} {v}"
    );
    lock(&f.a.behave).hold_reclaim = false;
    f.a.open(1);
    let failed = f.wait_step(&id, "failed").await?;
    ensure!(failed["error"]["code"] == "build_missing", "{failed}");
    lock(&f.b.behave).takeover_refuse = None;

    // Done: move_over.
    let m = f
        .start_move(json!({"sandbox_id": f.sbx, "to": "b"}))
        .await?;
    let id = m["id"].as_str().unwrap_or("").to_string();
    f.wait_step(&id, "done").await?;
    let (s, _, v) = cancel(id.clone()).await?;
    ensure!(
        s == 409 && v["error"]["code"] == "move_over" && v["move"]["step"] == "done",
        "{s} {v}"
    );
    let (s, _, v) = cancel("mov-0000000000000000".into()).await?;
    ensure!(s == 404 && v["error"]["code"] == "not_found", "{s} {v}");
    Ok(())
}

both!(a_taken_over_move_is_not_cancelled, case_taken_over);
async fn case_taken_over(url: String) -> anyhow::Result<()> {
    // A move whose takeover answered, its step not written done yet (no machine runs here).
    let ctl = control(&url, false, None).await?;
    let a = ctl.db.register_node(&reg("a"), 600_000).await?;
    let b = ctl.db.register_node(&reg("b"), 600_000).await?;
    let sbx = sbx_api::ids::new_id("sbx");
    ctl.db.insert_sandbox(&row(&sbx, &b.id, 2)).await?;
    let m = MoveRow {
        id: crate::db::new_move_id(),
        sandbox_id: sbx.clone(),
        from_node: a.id.clone(),
        to_node: b.id.clone(),
        epoch: 1,
        step: "taking_over".into(),
        why: "operator".into(),
        wake: true,
        from_store: false,
        release: Some("{}".into()),
        takeover: Some(r#"{"source":"disk","woke":true}"#.into()),
        error: None,
        attempts: 1,
        next_attempt_at_ms: None,
        cancel: false,
        refusal: None,
        created_at_ms: 0,
        updated_at_ms: 0,
        ended_at_ms: None,
        batch: None,
    };
    ctl.db.insert_move(&m).await?;
    let http: TestClient = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let req = hyper::Request::post(format!(
        "http://{}/internal/moves/{}/cancel",
        ctl.addr, m.id
    ))
    .body(Full::new(Bytes::new()))?;
    let resp = http.request(req).await?;
    let s = resp.status().as_u16();
    let v: Value = serde_json::from_slice(&resp.into_body().collect().await?.to_bytes())?;
    ensure!(
        s == 409 && v["error"]["code"] == "move_taken_over" && v["move"]["id"] == m.id.as_str(),
        "{s} {v}"
    );
    ensure!(v["move"]["takeover"]["source"] == "disk", "{v}");
    // A machine that starts finishes it: done, the table's status as the takeover left it.
    let ctl2 = control(&url, true, None).await?;
    let deadline = Instant::now() + WAIT;
    loop {
        let got = ctl2.db.get_move(&m.id).await?.context("the move")?;
        if got.step == "done" {
            break;
        }
        ensure!(Instant::now() < deadline, "not done: {got:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

fn reg(name: &str) -> NodeReg {
    NodeReg {
        name: name.into(),
        url: "http://127.0.0.1:9".into(),
        build: "0123456789abcdef".into(),
        capacity: Capacity::default(),
        e2b_url: None,
        preview_url: None,
        held: Vec::new(),
    }
}

both!(calls_during_a_move_wait_or_follow_it, case_proxy);
async fn case_proxy(url: String) -> anyhow::Result<()> {
    let f = Fleet::new(&url).await?;
    let path = format!("/v1/sandboxes/{}/exec", f.sbx);
    // Releasing: the old node answers (it has not released yet: the store is behind until
    // told otherwise).
    lock(&f.a.behave).copy_behind = 1000;
    lock(&f.b.behave).hold_takeover = true;
    let m = f
        .start_move(json!({"sandbox_id": f.sbx, "to": "b"}))
        .await?;
    let id = m["id"].as_str().unwrap_or("").to_string();
    wait_until("a release", || !f.a.calls("release").is_empty()).await?;
    let (s, _, v) = f.call("POST", &path, Some(json!({"command": "x"}))).await?;
    ensure!(s == 200 && v["served_by"] == "a", "{s} {v}");
    ensure!(f.get_move(&id).await?["step"] == "releasing");
    lock(&f.a.behave).copy_behind = 0;
    // Taking over: 503 unavailable, Retry-After: 1, not passed to any node.
    f.wait_step(&id, "taking_over").await?;
    let seen_a = lock(&f.a.v1).len();
    let seen_b = lock(&f.b.v1).len();
    let (s, h, v) = f.call("POST", &path, Some(json!({"command": "x"}))).await?;
    ensure!(
        s == 503 && v["error"]["code"] == "unavailable" && v["error"]["retryable"] == true,
        "{s} {v}"
    );
    ensure!(
        h.get(header::RETRY_AFTER).and_then(|v| v.to_str().ok()) == Some("1"),
        "{h:?}"
    );
    ensure!(lock(&f.a.v1).len() == seen_a && lock(&f.b.v1).len() == seen_b);
    lock(&f.b.behave).hold_takeover = false;
    f.b.open(1);
    f.wait_step(&id, "done").await?;

    // Releasing, the old node released (it answers `moved`) before the table knows: the call
    // waits and goes where the move took it, its body sent again.
    lock(&f.b.behave).hold_release = true;
    let m = f
        .start_move(json!({"sandbox_id": f.sbx, "to": "a"}))
        .await?;
    let id = m["id"].as_str().unwrap_or("").to_string();
    wait_until("the release is asked", || f.b.calls("release").len() == 1).await?;
    // The release is let go once the call has reached the old node (a fixed wait let a slow
    // machine's call come after the move was done).
    let execs = |b: &Fake| lock(&b.v1).iter().filter(|c| c.ends_with("/exec")).count();
    let before = execs(&f.b);
    let opener = {
        let b = f.b.fake.clone();
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(10);
            while execs(&b) == before && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            lock(&b.behave).hold_release = false;
            b.open(1);
        })
    };
    let (s, _, v) = f
        .call("POST", &path, Some(json!({"command": "after"})))
        .await?;
    opener.await?;
    ensure!(s == 200 && v["served_by"] == "a", "{s} {v}");
    ensure!(v["body"].as_str() == Some(r#"{"command":"after"}"#), "{v}");
    ensure!(execs(&f.b) > before, "the old node was asked first");
    f.wait_step(&id, "done").await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_sandbox_leaves_nothing_in_the_store() -> anyhow::Result<()> {
    let dir = TempDir::new()?;
    let store_dir = dir.0.join("store");
    let store = sbx_blob::Store::open(&format!("file://{}", store_dir.display()))?;
    let ctl = control(
        &format!("sqlite:{}", dir.0.join("control.db").display()),
        true,
        Some(store.clone()),
    )
    .await?;
    let a = fake_node("a").await?;
    let node = ctl
        .db
        .register_node(
            &NodeReg {
                name: "a".into(),
                url: format!("http://{}", a.addr),
                build: "0123456789abcdef".into(),
                capacity: Capacity::default(),
                e2b_url: None,
                preview_url: None,
                held: Vec::new(),
            },
            600_000,
        )
        .await?;
    let (gone, kept) = (sbx_api::ids::new_id("sbx"), sbx_api::ids::new_id("sbx"));
    let file = dir.0.join("part");
    std::fs::write(&file, b"memory of a sleep")?;
    for id in [&gone, &kept] {
        ctl.db.insert_sandbox(&row(id, &node.id, 1)).await?;
        a.hold(id, 1, "sleeping", false);
        for epoch in [1u64, 2] {
            let mut w = store.epoch_writer(id, epoch).await?;
            w.put_file("memory-1", &file).await?;
            w.finish("0123456789abcdef", "img-1", sbx_blob::Kind::Sleep)
                .await?;
        }
        ensure!(store.epochs(id).await? == [1, 2]);
    }
    let http: TestClient = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let req = hyper::Request::delete(format!("http://{}/v1/sandboxes/{gone}", ctl.addr))
        .body(Full::new(Bytes::new()))?;
    let resp = http.request(req).await?;
    ensure!(resp.status() == 200, "{}", resp.status());
    ensure!(ctl.db.sandbox(&gone).await?.is_none());
    ensure!(store.epochs(&gone).await?.is_empty());
    ensure!(store.latest(&gone).await?.is_none());
    ensure!(
        store.epochs(&kept).await? == [1, 2],
        "another's objects stay"
    );
    // Nothing of it is left under its folder.
    let left = walk(&store_dir.join("sandboxes").join(&gone));
    ensure!(left.is_empty(), "{left:?}");
    Ok(())
}

fn walk(p: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            let path = e.path();
            if path.is_dir() {
                out.extend(walk(&path));
            } else {
                out.push(path);
            }
        }
    }
    out
}

#[test]
fn moves_bodies_are_what_the_nodes_parse() {
    // The control plane's bodies, as it builds them, pass the nodes' strict parsers.
    let r = sbx_api::moves::ReleaseRequest {
        epoch: 3,
        to: "b".into(),
        move_id: crate::db::new_move_id(),
    };
    let v = serde_json::to_vec(&r).unwrap_or_default();
    assert_eq!(parse_release(&v).ok(), Some(r));
    let f = json!({"epoch": 4, "to": "a"}).to_string();
    assert_eq!(parse_forget(f.as_bytes()).map(|f| f.epoch).ok(), Some(4));
}

// Evacuations and recoveries (batches of moves) on the same fake nodes.
#[path = "batch_tests.rs"]
mod batch_tests;
