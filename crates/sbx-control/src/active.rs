//! The control plane's own failover: which of the copies sharing a database is active.
//!
//! The active copy holds the lease of the database's `control_lease` row (`db::lease`) with a
//! term; the others are standbys. [`run`] is the loop of each copy:
//! - a standby tries to take the lease every third of it (where it ran out, or was its own);
//!   taken, the copy is active with the new term and starts its duties ([`Active::start`]: the
//!   move machine, which resumes every unfinished move, and the batches);
//! - the active copy renews the lease every third of it, by compare-and-set on its term. It
//!   stops acting (its duties stopped, its writes refused, a standby again) when a renewal finds
//!   another copy took the lease, when a write finds the term over, or when no renewal was
//!   answered before its lease could have run out by its own monotonic clock, counted from when
//!   it sent the last renewal that was answered, less a margin (as a node counts its lease).
//!
//! So a standby takes over within about 1⅓ lease of the active copy's death. Every write of the
//! table is fenced by the term in the database (`db::lease`): a copy that lost its term writes
//! nothing, whatever its clock says. While standby, every route but `GET /healthz` answers 503
//! `standby` with the active copy (`{name, url, term}`, as read at the request, or last read
//! where the database does not answer; null while none holds the lease) and `Retry-After: 1`
//! ([`gate`]); nodes go to the copy it names (`join`).
//!
//! SQLite: one control plane owns the file (a second one on it is refused at start by an
//! exclusive lock of `FILE.lock`: [`lock_sqlite`]); it takes the lease at start whoever held it
//! last (term 1, 2, … across restarts) and is active. Failover is PostgreSQL's.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use sbx_api::{ApiError, ErrorCode};
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::db::{ControlLease, DbError, LeaseHolder};
use crate::server::{fail, locked, Ctl, Rid};

/// How a control plane takes part in the lease (`sandboxd control`'s `--name`,
/// `--advertise-url`, `--control-lease-seconds`).
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    /// Its name (the lease's `holder`): unique among the copies of one database.
    pub name: String,
    /// Where nodes and callers reach it (`http://HOST:PORT`).
    pub url: String,
    /// How long a take or a renewal holds the lease (the database's clock).
    pub lease: Duration,
    /// Take the lease whoever holds it (SQLite: the file's lock says no other copy runs).
    pub force: bool,
}

/// What the active copy runs besides serving (`serve` builds it from its config).
#[derive(Debug, Clone, Default)]
pub struct Duties {
    /// `--recover-after-seconds` of the batches' runner.
    pub recover_after: Option<Duration>,
    /// `--iii-url`: the functions interface's worker (`functions.rs`) runs on the active copy
    /// only (two workers cannot both own `sandbox::*` in the engine's default namespace, and a
    /// standby writes nothing).
    pub iii_url: Option<String>,
}

/// What a control plane knows of the lease: its own name, and the active copy as it last read
/// it (for a standby's answers).
#[derive(Debug, Default)]
pub struct Role {
    name: String,
    active: Mutex<Option<LeaseHolder>>,
}

impl Role {
    pub fn new(name: &str) -> Role {
        Role {
            name: name.to_owned(),
            active: Mutex::new(None),
        }
    }

    /// This copy's name (empty where it takes no part in a lease: tests).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The active copy as last read; `None` while none held the lease.
    pub fn active(&self) -> Option<LeaseHolder> {
        locked(&self.active).clone()
    }

    fn set_active(&self, a: Option<LeaseHolder>) {
        *locked(&self.active) = a;
    }
}

/// The duties of the active copy, running; stopped (aborted) when dropped. The one place that
/// starts and stops what only the active copy may do.
pub struct Active {
    tasks: Vec<tokio::task::JoinHandle<()>>,
    worker: Option<iii_sdk::IIIClient>,
}

impl Active {
    /// Starts them, the lease taken at `taken_at_ms` (the database's clock): names reserved by
    /// calls of a copy that stopped mid-call are freed, every unfinished move is taken up (the
    /// move machine), every unfinished batch too.
    pub fn start(ctl: &Arc<Ctl>, duties: &Duties, taken_at_ms: i64) -> Active {
        let c = ctl.clone();
        let stale = tokio::spawn(async move { free_stale_names(&c, taken_at_ms).await });
        Active {
            tasks: vec![
                stale,
                crate::machine::start(ctl.clone()),
                crate::batch::start(ctl.clone(), duties.recover_after),
            ],
            worker: duties
                .iii_url
                .as_deref()
                .map(|url| crate::functions::start(url, ctl.clone())),
        }
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        // The worker leaves the engine, so that the copy that takes the lease registers.
        if let Some(w) = self.worker.take() {
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn(async move { w.shutdown_async().await });
                }
                Err(_) => drop(w),
            }
        }
    }
}

/// Names reserved by calls of a control plane that stopped mid-call are free again: those
/// reserved before the lease was taken at `before_ms`, but for the names this copy is giving
/// now (its own calls under way when it took the lease again).
async fn free_stale_names(ctl: &Ctl, before_ms: i64) {
    let rows = match ctl.db.sandboxes(None).await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "the stale name reservations could not be read");
            return;
        }
    };
    let giving = locked(&ctl.names).clone();
    let stale = rows.iter().filter(|r| {
        r.status == crate::fleet::RESERVED
            && r.created_at_ms < before_ms
            && !r.name.as_ref().is_some_and(|n| giving.contains(n))
    });
    for r in stale {
        if let Err(e) = ctl.db.delete_sandbox(&r.id).await {
            tracing::warn!(error = %e, id = %r.id, "a stale name reservation stays");
        }
    }
}

/// How long before its lease could run out (by its own clock) the active copy stops acting:
/// max(1 s, lease/5), at most half the lease.
pub fn margin(lease: Duration) -> Duration {
    (lease / 5).max(Duration::from_secs(1)).min(lease / 2)
}

/// How often the active copy renews: every third of the lease, and so that a renewal has as
/// long to be answered as the one before it took to come due (half of what the margin leaves;
/// a short lease's margin is half of it).
pub fn renew_every(lease: Duration) -> Duration {
    (lease / 3).min((lease - margin(lease)) / 2)
}

fn lease_ms(lease: Duration) -> i64 {
    i64::try_from(lease.as_millis()).unwrap_or(i64::MAX)
}

/// A take of the lease that worked: the lease, and when the take was sent (this copy's clock).
#[derive(Debug, Clone)]
pub struct Taken {
    pub lease: ControlLease,
    pub sent: Instant,
}

/// One try to take the lease (`serve` makes the first before it serves, so that a lone copy is
/// active from its first request).
pub async fn take(ctl: &Ctl, cfg: &LeaseConfig) -> Result<Option<Taken>, DbError> {
    let sent = Instant::now();
    let lease = ctl
        .db
        .take_lease(&cfg.name, &cfg.url, lease_ms(cfg.lease), cfg.force)
        .await?;
    Ok(lease.map(|lease| Taken { lease, sent }))
}

/// The loop of a copy: standby, active, standby again…, until the task is aborted (it then
/// drops the duties it runs). `first`: a take made before.
pub async fn run(ctl: Arc<Ctl>, cfg: LeaseConfig, duties: Duties, mut first: Option<Taken>) {
    let tick = cfg.lease / 3;
    // Whether the last try failed (logged once, and once when it works again).
    let mut failing = false;
    let mut standby_of: Option<Option<LeaseHolder>> = None;
    loop {
        let sent = Instant::now();
        let tried = match first.take() {
            Some(t) => Ok(Some(t)),
            None => take(&ctl, &cfg).await,
        };
        match tried {
            Ok(Some(Taken { lease, sent })) => {
                failing = false;
                standby_of = None;
                let term = lease.term;
                ctl.role.set_active(lease.active());
                tracing::info!(name = %cfg.name, term, "this control plane is active");
                let running = Active::start(&ctl, &duties, lease.now_ms);
                let why = hold(&ctl, &cfg, term, sent).await;
                ctl.db.step_down(term);
                drop(running);
                tracing::warn!(name = %cfg.name, term, why, "this control plane stopped acting: it stands by");
            }
            Ok(None) => {
                failing = false;
                match ctl.db.control_lease().await {
                    Ok(l) => {
                        let active = l.active();
                        if standby_of.as_ref() != Some(&active) {
                            tracing::info!(name = %cfg.name, active = ?active, "this control plane stands by");
                            standby_of = Some(active.clone());
                        }
                        ctl.role.set_active(active);
                    }
                    Err(e) => tracing::warn!(error = %e, "the lease could not be read"),
                }
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(error = %e, "the lease could not be taken (tried again)");
                }
                failing = true;
            }
        }
        tokio::time::sleep_until(sent + tick).await;
    }
}

/// Holds the lease of `term` (taken by a call sent at `sent`): renews it every third of it
/// (less for a short lease: [`renew_every`]), until it is lost. Says why it was.
async fn hold(ctl: &Ctl, cfg: &LeaseConfig, term: i64, mut sent: Instant) -> &'static str {
    let tick = renew_every(cfg.lease);
    let margin = margin(cfg.lease);
    let mut next = sent + tick;
    loop {
        let until = sent + cfg.lease - margin;
        tokio::select! {
            () = tokio::time::sleep_until(next.min(until)) => {}
            () = ctl.db.deposed() => {
                if ctl.db.term() != Some(term) {
                    return "a write found the term over (another copy took the lease)";
                }
                continue;
            }
        }
        let at = Instant::now();
        if at >= until {
            return "no renewal was answered before the lease could run out";
        }
        if at < next {
            continue;
        }
        let renewal = ctl.db.renew_lease(&cfg.name, &cfg.url, lease_ms(cfg.lease));
        match tokio::time::timeout_at(until, renewal).await {
            Ok(Ok(Some(_))) => {
                sent = at;
                next = at + tick;
            }
            Ok(Ok(None)) => return "another copy took the lease",
            Ok(Err(e)) => {
                tracing::warn!(error = %e, term, "the lease could not be renewed (tried again)");
                next = Instant::now() + tick.min(Duration::from_millis(200));
            }
            Err(_) => return "no renewal was answered before the lease could run out",
        }
    }
}

/// The active copy as the spec's `active` says it: `{name, url, term}`, or null.
pub fn active_json(active: Option<&LeaseHolder>) -> Value {
    match active {
        Some(a) => json!({ "name": a.name, "url": a.url, "term": a.term }),
        None => Value::Null,
    }
}

/// 503 `standby`, `active` beside.
pub fn standby_error(active: Option<&LeaseHolder>) -> ApiError {
    let message = match active {
        Some(a) => format!(
            "this control plane is a standby: the active one is {} at {} (term {}); ask it",
            a.name, a.url, a.term
        ),
        None => "this control plane is a standby, and no control plane holds the lease now \
                 (one takes it within a lease): ask again"
            .to_string(),
    };
    ApiError::new(ErrorCode::Standby, message).with_beside("active", active_json(active))
}

/// Every request of a standby: `GET /healthz` says so (200); every other 503 `standby`.
pub async fn gate(State(ctl): State<Arc<Ctl>>, req: Request, next: Next) -> Response {
    if ctl.db.writable() {
        return next.run(req).await;
    }
    // The lease as it is now (a standby's answers are few); as last read where the database
    // does not answer at once.
    let active = match tokio::time::timeout(Duration::from_secs(1), ctl.db.control_lease()).await {
        Ok(Ok(l)) => {
            let a = l.active();
            ctl.role.set_active(a.clone());
            a
        }
        _ => ctl.role.active(),
    };
    if req.uri().path() == "/healthz" {
        return Json(json!({
            "ok": true,
            "role": "standby",
            "name": ctl.role.name(),
            "db": ctl.db.kind(),
            "active": active_json(active.as_ref()),
        }))
        .into_response();
    }
    let rid = req
        .extensions()
        .get::<Rid>()
        .map(|r| r.0.clone())
        .unwrap_or_default();
    fail(&rid, standby_error(active.as_ref()))
}

/// Why the SQLite file is not this control plane's.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("open {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "another control plane runs on this SQLite file (it holds {path}); one control plane \
         owns a SQLite file: failover takes PostgreSQL"
    )]
    Held { path: PathBuf },
    #[error("lock {path}")]
    Lock {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The file of a `sqlite:` URL (as `Db::open` reads it); `None` for another backend.
pub fn sqlite_path(db_url: &str) -> Option<PathBuf> {
    let path = db_url.strip_prefix("sqlite:")?;
    let path = path.strip_prefix("//").unwrap_or(path);
    (!path.is_empty()).then(|| PathBuf::from(path))
}

/// Locks `DB.lock` beside the SQLite file `db` for as long as the file returned is open: a
/// second control plane on the file is refused.
pub fn lock_sqlite(db: &Path) -> Result<std::fs::File, LockError> {
    let mut name = db.as_os_str().to_owned();
    name.push(".lock");
    let path = PathBuf::from(name);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|source| LockError::Open {
            path: path.clone(),
            source,
        })?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(LockError::Held { path }),
        Err(std::fs::TryLockError::Error(source)) => Err(LockError::Lock { path, source }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_margin_is_a_fifth_at_least_a_second_at_most_half() {
        assert_eq!(margin(Duration::from_secs(10)), Duration::from_secs(2));
        assert_eq!(margin(Duration::from_secs(2)), Duration::from_secs(1));
        assert_eq!(margin(Duration::from_secs(4)), Duration::from_secs(1));
        assert_eq!(margin(Duration::from_secs(1)), Duration::from_millis(500));
        assert_eq!(
            renew_every(Duration::from_secs(2)),
            Duration::from_millis(500)
        );
        assert_eq!(renew_every(Duration::from_secs(3)), Duration::from_secs(1));
        assert_eq!(
            renew_every(Duration::from_secs(30)),
            Duration::from_secs(10)
        );
    }

    /// GET `url`: its status, `Retry-After` and JSON body.
    async fn get(url: &str) -> (u16, Option<String>, Value) {
        type Body = http_body_util::Full<bytes::Bytes>;
        let c: hyper_util::client::legacy::Client<_, Body> =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build(hyper_util::client::legacy::connect::HttpConnector::new());
        let req = axum::http::Request::get(url)
            .body(Body::default())
            .expect("a request");
        let resp = c.request(req).await.expect("an answer");
        let status = resp.status().as_u16();
        let retry = resp
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .map(String::from);
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .expect("a body")
            .to_bytes();
        (
            status,
            retry,
            serde_json::from_slice(&body).unwrap_or(Value::Null),
        )
    }

    /// A copy of the control plane on loopback with `db`, in the lease as `name`.
    async fn copy(
        db: crate::db::Db,
        name: &str,
    ) -> (
        String,
        tokio::task::JoinHandle<()>,
        tokio::task::JoinHandle<()>,
    ) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", l.local_addr().expect("addr"));
        db.fence_writes();
        let ctl = Arc::new(Ctl::new(db, Duration::from_secs(2), None).with_role(Role::new(name)));
        let app = crate::server::router(ctl.clone())
            .into_make_service_with_connect_info::<std::net::SocketAddr>();
        let serving = tokio::spawn(async move {
            let _ = axum::serve(l, app).await;
        });
        let cfg = LeaseConfig {
            name: name.to_owned(),
            url: url.clone(),
            lease: Duration::from_secs(1),
            force: false,
        };
        let lease = tokio::spawn(run(ctl, cfg, Duties::default(), None));
        (url, serving, lease)
    }

    async fn wait_role(url: &str, role: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (status, _, v) = get(&format!("{url}/healthz")).await;
            if status == 200 && v["role"] == role {
                return v;
            }
            assert!(Instant::now() < deadline, "not {role}: {status} {v}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Two copies on one database (SQLite, the lease not forced): A is active, B answers 503
    /// `standby` naming it; a node given B first joins A; A stops renewing (its loop ended):
    /// B takes over within about 1⅓ lease, A's next write (the node's heartbeat) is refused
    /// by the term, 503 `standby` naming B, and the node follows it to B.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_standby_takes_over_and_the_node_follows() {
        let dir = std::env::temp_dir().join(sbx_api::ids::new_id("failover"));
        std::fs::create_dir_all(&dir).expect("a temp dir");
        let url = format!("sqlite:{}", dir.join("control.db").display());
        let db_a = crate::db::Db::open(&url).await.expect("open");
        let (a, serving_a, lease_a) = copy(db_a, "cp-a").await;
        let h = wait_role(&a, "active").await;
        assert_eq!(h["term"], 1, "{h}");
        let db_b = crate::db::Db::open(&url).await.expect("open");
        let (b, serving_b, lease_b) = copy(db_b.clone(), "cp-b").await;
        let h = wait_role(&b, "standby").await;
        assert_eq!(
            h["active"],
            json!({"name": "cp-a", "url": a, "term": 1}),
            "{h}"
        );
        let (status, retry, v) = get(&format!("{b}/internal/nodes")).await;
        assert_eq!(status, 503, "{v}");
        assert_eq!(retry.as_deref(), Some("1"));
        assert_eq!(v["error"]["code"], "standby", "{v}");
        assert_eq!(v["error"]["retryable"], true, "{v}");
        assert_eq!(
            v["active"],
            json!({"name": "cp-a", "url": a, "term": 1}),
            "{v}"
        );

        // A node given B first joins A.
        let node = crate::join::start(
            crate::join::JoinConfig {
                control: format!("{b},{a}"),
                name: "n1".into(),
                url: "http://127.0.0.1:1".into(),
                build: "0123456789abcdef".into(),
                api_key: None,
                e2b_url: None,
                preview_url: None,
            },
            Arc::new(|| crate::db::Capacity {
                max_sandboxes: 10,
                sandboxes: 0,
                images: vec![],
            }),
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        let first = loop {
            let (status, _, v) = get(&format!("{a}/internal/nodes/n1")).await;
            if status == 200 {
                break v["heartbeat_at"].clone();
            }
            assert!(Instant::now() < deadline, "n1 never joined A: {status} {v}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };

        // A stops renewing (its loop ends; it still serves, its term still its own here).
        lease_a.abort();
        let stopped = Instant::now();
        let h = wait_role(&b, "active").await;
        let took = stopped.elapsed();
        assert_eq!(h["term"], 2, "{h}");
        assert!(took < Duration::from_millis(2500), "B took {took:?}");
        // The node's heartbeat to A is refused by the term, naming B; it goes on with B.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (status, _, v) = get(&format!("{b}/internal/nodes/n1")).await;
            assert_eq!(status, 200, "{v}");
            if v["heartbeat_at"] != first && v["heartbeat_at"].as_str() > first.as_str() {
                let since = v["heartbeat_at"].clone();
                tokio::time::sleep(Duration::from_millis(800)).await;
                let (_, _, again) = get(&format!("{b}/internal/nodes/n1")).await;
                if again["heartbeat_at"] != since {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "n1 does not heartbeat to B: {v}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let (status, _, v) = get(&format!("{a}/internal/nodes")).await;
        assert_eq!(status, 503, "A still answers: {v}");
        assert_eq!(
            v["active"],
            json!({"name": "cp-b", "url": b, "term": 2}),
            "{v}"
        );
        assert_eq!(db_b.term(), Some(2));
        node.abort();
        for t in [serving_a, serving_b, lease_b] {
            t.abort();
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_second_lock_of_one_file_is_refused() {
        let dir = std::env::temp_dir().join(sbx_api::ids::new_id("lock"));
        std::fs::create_dir_all(&dir).expect("a temp dir");
        let db = dir.join("control.db");
        let first = lock_sqlite(&db).expect("the first lock");
        assert!(matches!(lock_sqlite(&db), Err(LockError::Held { .. })));
        drop(first);
        let again = lock_sqlite(&db).expect("free again once the first is closed");
        drop(again);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
