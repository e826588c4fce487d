//! A node's side of the fleet: it joins a control plane (`POST /internal/nodes`), then renews
//! its lease with a heartbeat every third of it (`POST /internal/nodes/{id}/heartbeat`), each
//! time with its room as it is then. A control plane that is away is logged (once, then once
//! when it is back), never fatal: the node serves its own API meanwhile. A heartbeat the control
//! plane does not know the node of (a new database) joins again. The same name keeps its id
//! across the node's restarts (the control plane's table keys nodes by name).
//!
//! The lease: each body carries the sandboxes the node holds (`held`), each answer the lease's
//! length and the held sandboxes the fleet has elsewhere now (`taken`). The node counts its
//! lease from the instant it SENT the call that renewed it (its monotonic clock: the control
//! plane's `lease_until` is the database's now at the call + the lease, later than that), and
//! fences itself at [`fence_deadline`]: sent + lease − [`fence_margin`]. Each renewal is handed
//! to the node ([`Renewed`]), which removes what was taken before it serves anything again.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::header;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;
use sha2::Digest as _;

use crate::db::{Capacity, HeldSandbox, NodeReg, TakenSandbox};

/// What a node joins with.
#[derive(Debug, Clone)]
pub struct JoinConfig {
    /// The control plane's base URL (`http://HOST:PORT`), or several, comma-separated (the
    /// copies of one fleet's control plane: the node heartbeats to the active one).
    pub control: String,
    /// The node's name in the fleet (its id stays with it).
    pub name: String,
    /// Where the control plane reaches the node's API (`http://HOST:PORT`).
    pub url: String,
    /// [`build_id`] of this node.
    pub build: String,
    /// A key of the control plane's (the fleet shares one key file), sent as `Authorization:
    /// Bearer KEY`; none for a control plane without keys (loopback).
    pub api_key: Option<String>,
    /// Where E2B's SDKs reach the node (`http://HOST:PORT` of `--e2b-listen`); none when off.
    pub e2b_url: Option<String>,
    /// Where the node's preview listener is (`http://HOST:PORT`); none when off.
    pub preview_url: Option<String>,
}

/// The node's room now (called off the async runtime's threads: it may read the disk).
pub type CapacityFn = Arc<dyn Fn() -> Capacity + Send + Sync>;
/// The sandboxes the node holds now (called off the async runtime's threads).
pub type HeldFn = Arc<dyn Fn() -> Vec<HeldSandbox> + Send + Sync>;
/// What the node does with a renewal of its lease (its taken sandboxes first, then the new
/// deadline); the next heartbeat waits for it.
pub type RenewedFn = Arc<dyn Fn(Renewal) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// A renewal of the node's lease, as the node takes it.
#[derive(Debug, Clone)]
pub struct Renewal {
    /// When the call that renewed it was sent (the node's monotonic clock).
    pub sent: Instant,
    /// The lease's length, as the control plane answered.
    pub lease: Duration,
    /// When the node fences itself without a newer renewal ([`fence_deadline`]).
    pub deadline: Instant,
    /// The held sandboxes the fleet has elsewhere now.
    pub taken: Vec<TakenSandbox>,
}

/// How long before its lease can run out (by the node's own clock) a node fences itself:
/// a fifth of the lease, at least a second.
pub fn fence_margin(lease: Duration) -> Duration {
    (lease / 5).max(Duration::from_secs(1))
}

/// When a node whose lease of `lease` was renewed by a call sent at `sent` fences itself:
/// `sent + lease − fence_margin(lease)` (at `sent` for a lease no longer than the margin).
pub fn fence_deadline(sent: Instant, lease: Duration) -> Instant {
    sent + lease.saturating_sub(fence_margin(lease))
}

/// How often a node heartbeats (from one call's send to the next's): a third of its lease,
/// or half of what is left of it before its fence where that is less (a short lease: two
/// heartbeats may be sent before the node fences itself).
pub fn heartbeat_every(lease: Duration) -> Duration {
    (lease / 3)
        .min(lease.saturating_sub(fence_margin(lease)) / 2)
        .max(Duration::from_millis(100))
}

/// What the node gives the loop besides its config.
#[derive(Clone)]
pub struct Hooks {
    pub capacity: CapacityFn,
    /// None: the node tells no `held` (nothing of it is ever taken).
    pub held: Option<HeldFn>,
    /// None: renewals are not handed on.
    pub renewed: Option<RenewedFn>,
}

/// Why a call to the control plane failed.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("{0} is not a URL")]
    Url(String),
    #[error("could not build the request: {0}")]
    Request(#[from] hyper::http::Error),
    #[error("{0}")]
    Send(#[from] hyper_util::client::legacy::Error),
    #[error("its answer broke off: {0}")]
    Body(#[from] hyper::Error),
    #[error("it answered {status}: {body}")]
    Status { status: u16, body: String },
    #[error("its answer is not a lease: {0}")]
    Json(#[from] serde_json::Error),
    #[error("the room of the node could not be read: {0}")]
    Capacity(String),
    /// It is a standby control plane; `active`: the URL of the active one it names.
    #[error("it is a standby (the active control plane: {active:?})")]
    Standby { active: Option<String> },
}

/// The active control plane's URL a 503 `standby` names (`Some(None)`: it names none); `None`
/// for another answer.
fn standby_of(body: &[u8]) -> Option<Option<String>> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    if v["error"]["code"] != "standby" {
        return None;
    }
    Some(
        v["active"]["url"]
            .as_str()
            .map(|u| u.trim_end_matches('/').to_string()),
    )
}

/// The control plane's answer to a join or a heartbeat.
#[derive(Debug, Clone, Deserialize)]
pub struct Lease {
    pub id: String,
    pub name: String,
    pub lease_until: String,
    pub lease_seconds: f64,
    /// The held sandboxes the fleet has elsewhere (absent from an older control plane).
    #[serde(default)]
    pub taken: Vec<TakenSandbox>,
}

/// 16 hex digits of a SHA-256 over what a sandbox's memory image depends on: the kernel's
/// release, CRIU's version (if the node has CRIU) and the agent binary's bytes. Two nodes of
/// one build can take each other's sleeping sandboxes.
pub fn build_id(kernel_release: &str, criu_version: Option<&str>, agent: &[u8]) -> String {
    let mut h = sha2::Sha256::new();
    h.update(b"kernel\0");
    h.update(kernel_release.trim().as_bytes());
    h.update(b"\0criu\0");
    h.update(criu_version.unwrap_or("").trim().as_bytes());
    h.update(b"\0agent\0");
    h.update(agent);
    h.finalize()
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The HTTP client of the loop, and the control plane that answered last (of several: the
/// active one; a standby answers 503 `standby` naming it).
struct JoinClient {
    http: Client<HttpConnector, Full<Bytes>>,
    at: std::sync::Mutex<Option<String>>,
}

fn client() -> JoinClient {
    let mut http = HttpConnector::new();
    http.set_connect_timeout(Some(Duration::from_secs(5)));
    JoinClient {
        http: Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(http),
        at: std::sync::Mutex::new(None),
    }
}

/// The control planes of `--control URL[,URL…]`, in order.
pub fn control_urls(control: &str) -> Vec<String> {
    control
        .split(',')
        .map(|u| u.trim().trim_end_matches('/').to_string())
        .filter(|u| !u.is_empty())
        .collect()
}

/// One call to the fleet's control plane: to the one that answered last, then to the one a
/// standby names (`active.url` of its 503 `standby`), then to the others of the list, within
/// `wait` in all (a control plane that does not answer has its share of it).
async fn post(
    client: &JoinClient,
    cfg: &JoinConfig,
    path: &str,
    reg: &NodeReg,
    wait: Duration,
) -> Result<Option<Lease>, JoinError> {
    let urls = control_urls(&cfg.control);
    let at = client.at.lock().map(|a| a.clone()).unwrap_or(None);
    let mut queue: std::collections::VecDeque<String> =
        at.into_iter().chain(urls.clone()).collect();
    let share = wait / u32::try_from(urls.len().max(1)).unwrap_or(1);
    let deadline = Instant::now() + wait;
    let mut tried: Vec<String> = Vec::new();
    let mut last = JoinError::Url(cfg.control.clone());
    while let Some(base) = queue.pop_front() {
        if tried.contains(&base) {
            continue;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        tried.push(base.clone());
        match post_to(client, cfg, &base, path, reg, share.min(left)).await {
            Ok(answer) => {
                if let Ok(mut a) = client.at.lock() {
                    if a.as_deref() != Some(base.as_str()) {
                        if urls.len() > 1 || base != urls.first().map_or("", String::as_str) {
                            tracing::info!(control = %base, "the node's control plane is this one now");
                        }
                        *a = Some(base);
                    }
                }
                return Ok(answer);
            }
            Err(JoinError::Standby { active }) => {
                if let Some(url) = active.clone() {
                    queue.push_front(url);
                }
                last = JoinError::Standby { active };
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// One call: `POST {base}{path}` with `reg`; `Ok(None)` on 404 (an unknown node).
async fn post_to(
    client: &JoinClient,
    cfg: &JoinConfig,
    base: &str,
    path: &str,
    reg: &NodeReg,
    wait: Duration,
) -> Result<Option<Lease>, JoinError> {
    let url = format!("{}{path}", base.trim_end_matches('/'));
    let uri: hyper::Uri = url.parse().map_err(|_| JoinError::Url(url.clone()))?;
    let mut b = hyper::Request::post(uri).header(header::CONTENT_TYPE, "application/json");
    if let Some(k) = &cfg.api_key {
        b = b.header(header::AUTHORIZATION, format!("Bearer {k}"));
    }
    let req = b.body(Full::new(Bytes::from(serde_json::to_vec(reg)?)))?;
    let resp = tokio::time::timeout(wait, client.http.request(req))
        .await
        .map_err(|_| JoinError::Status {
            status: 0,
            body: format!("no answer in {} ms", wait.as_millis()),
        })??;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    if status == hyper::StatusCode::NOT_FOUND {
        return Ok(None);
    }
    if status == hyper::StatusCode::SERVICE_UNAVAILABLE {
        if let Some(active) = standby_of(&body) {
            return Err(JoinError::Standby { active });
        }
    }
    if !status.is_success() {
        return Err(JoinError::Status {
            status: status.as_u16(),
            body: String::from_utf8_lossy(&body).chars().take(500).collect(),
        });
    }
    Ok(Some(serde_json::from_slice(&body)?))
}

/// What the node says of itself now.
async fn reg_now(cfg: &JoinConfig, hooks: &Hooks) -> Result<NodeReg, JoinError> {
    let (f, h) = (hooks.capacity.clone(), hooks.held.clone());
    let (capacity, held) =
        tokio::task::spawn_blocking(move || (f(), h.map(|h| h()).unwrap_or_default()))
            .await
            .map_err(|e| JoinError::Capacity(e.to_string()))?;
    Ok(NodeReg {
        name: cfg.name.clone(),
        url: cfg.url.clone(),
        build: cfg.build.clone(),
        capacity,
        e2b_url: cfg.e2b_url.clone(),
        preview_url: cfg.preview_url.clone(),
        held,
    })
}

/// The node's place in the fleet as the loop knows it.
struct Joined {
    lease: Lease,
}

/// Joins, then heartbeats, until the task is dropped (aborted with the node).
pub fn start(cfg: JoinConfig, capacity: CapacityFn) -> tokio::task::JoinHandle<()> {
    start_with(
        cfg,
        Hooks {
            capacity,
            held: None,
            renewed: None,
        },
    )
}

/// [`start`], telling the control plane what the node holds and handing each renewal of its
/// lease to the node.
pub fn start_with(cfg: JoinConfig, hooks: Hooks) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let client = client();
        let mut joined: Option<Joined> = None;
        // Whether the last call failed (its failure was logged; the next success is too).
        let mut failing = false;
        loop {
            // A call that takes longer than the lease renews nothing the node could use.
            let wait = joined.as_ref().map_or(Duration::from_secs(10), |j| {
                Duration::from_secs_f64(j.lease.lease_seconds.clamp(1.0, 10.0))
            });
            let result = async {
                let reg = reg_now(&cfg, &hooks).await?;
                let sent = Instant::now();
                match &joined {
                    Some(j) => {
                        let path = format!("/internal/nodes/{}/heartbeat", j.lease.id);
                        match post(&client, &cfg, &path, &reg, wait).await? {
                            Some(l) => Ok((l, sent)),
                            None => {
                                tracing::warn!(
                                    control = %cfg.control,
                                    id = %j.lease.id,
                                    "the control plane does not know this node: joining again"
                                );
                                let sent = Instant::now();
                                post(&client, &cfg, "/internal/nodes", &reg, wait)
                                    .await?
                                    .map(|l| (l, sent))
                                    .ok_or(JoinError::Status {
                                        status: 404,
                                        body: "POST /internal/nodes is not served".into(),
                                    })
                            }
                        }
                    }
                    None => post(&client, &cfg, "/internal/nodes", &reg, wait)
                        .await?
                        .map(|l| (l, sent))
                        .ok_or(JoinError::Status {
                            status: 404,
                            body: "POST /internal/nodes is not served".into(),
                        }),
                }
            }
            .await;
            let wait = match result {
                Ok((lease, sent)) => {
                    let first = joined.as_ref().is_none_or(|j| j.lease.id != lease.id);
                    if first || failing {
                        tracing::info!(
                            control = %cfg.control,
                            id = %lease.id,
                            name = %lease.name,
                            lease_until = %lease.lease_until,
                            lease_seconds = lease.lease_seconds,
                            "joined the control plane"
                        );
                    }
                    failing = false;
                    let length = Duration::from_secs_f64(lease.lease_seconds.max(0.0));
                    if let Some(renewed) = &hooks.renewed {
                        renewed(Renewal {
                            sent,
                            lease: length,
                            deadline: fence_deadline(sent, length),
                            taken: lease.taken.clone(),
                        })
                        .await;
                    }
                    joined = Some(Joined { lease });
                    // The next one is sent a cadence after this one was (not after its answer).
                    heartbeat_every(length)
                        .saturating_sub(sent.elapsed())
                        .max(Duration::from_millis(50))
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(
                            control = %cfg.control,
                            error = %e,
                            "the control plane could not be reached (the node serves on, and \
                             tries again)"
                        );
                    } else {
                        tracing::debug!(control = %cfg.control, error = %e, "control plane still away");
                    }
                    failing = true;
                    match &joined {
                        Some(j) => {
                            Duration::from_secs_f64((j.lease.lease_seconds / 3.0).clamp(0.1, 1.0))
                        }
                        None => Duration::from_secs(1),
                    }
                }
            };
            tokio::time::sleep(wait).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fence_comes_a_margin_before_the_lease_runs_out() {
        let sent = Instant::now();
        let s = Duration::from_secs;
        // A fifth of the lease, at least a second.
        assert_eq!(fence_margin(s(10)), s(2));
        assert_eq!(fence_margin(s(3)), s(1));
        assert_eq!(fence_margin(s(2)), s(1));
        assert_eq!(fence_margin(Duration::from_millis(500)), s(1));
        assert_eq!(fence_deadline(sent, s(10)), sent + s(8));
        assert_eq!(fence_deadline(sent, s(3)), sent + s(2));
        assert_eq!(fence_deadline(sent, s(2)), sent + s(1));
        assert_eq!(fence_deadline(sent, s(60)), sent + s(48));
        // Heartbeats: a third of the lease, or half the time to the fence.
        assert_eq!(heartbeat_every(s(10)), s(10) / 3);
        assert_eq!(heartbeat_every(s(3)), Duration::from_millis(1000));
        assert_eq!(heartbeat_every(s(2)), Duration::from_millis(500));
        assert_eq!(heartbeat_every(s(1)), Duration::from_millis(100));
        // A lease no longer than the margin fences at once.
        assert_eq!(fence_deadline(sent, Duration::from_millis(800)), sent);
        assert_eq!(fence_deadline(sent, Duration::ZERO), sent);
    }

    #[test]
    fn a_lease_answer_carries_taken_sandboxes() {
        let l: Lease = serde_json::from_str(
            r#"{"object":"node_lease","id":"nod-1","name":"a","lease_until":"x","lease_seconds":3,
                "taken":[{"id":"sbx-1","epoch":4,"to":"b"},{"id":"sbx-2","epoch":2,"to":null}]}"#,
        )
        .expect("lease");
        assert_eq!(
            l.taken,
            vec![
                TakenSandbox {
                    id: "sbx-1".into(),
                    epoch: 4,
                    to: Some("b".into())
                },
                TakenSandbox {
                    id: "sbx-2".into(),
                    epoch: 2,
                    to: None
                }
            ]
        );
        // An older control plane's answer has none.
        let old: Lease = serde_json::from_str(
            r#"{"id":"nod-1","name":"a","lease_until":"x","lease_seconds":10}"#,
        )
        .expect("old");
        assert!(old.taken.is_empty());
    }

    #[test]
    fn a_build_is_16_hex_digits_of_what_it_depends_on() {
        let a = build_id("6.1.0-18-amd64\n", Some("Version: 4.2"), b"agent");
        assert_eq!(a.len(), 16);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(
            a,
            build_id("6.1.0-18-amd64", Some("Version: 4.2\n"), b"agent")
        );
        assert_ne!(
            a,
            build_id("6.1.0-19-amd64", Some("Version: 4.2"), b"agent")
        );
        assert_ne!(a, build_id("6.1.0-18-amd64", None, b"agent"));
        assert_ne!(
            a,
            build_id("6.1.0-18-amd64", Some("Version: 4.2"), b"agent2")
        );
    }

    #[test]
    fn a_standby_names_the_active_control_plane() {
        assert_eq!(
            control_urls(" http://a:1/, http://b:2 ,,"),
            vec!["http://a:1".to_string(), "http://b:2".to_string()]
        );
        let body = crate::active::standby_error(Some(&crate::db::LeaseHolder {
            name: "cp-b".into(),
            url: "http://127.0.0.1:7702/".into(),
            term: 2,
        }));
        let body = sbx_api::error_body(&body, "req-1", None).to_string();
        assert_eq!(
            standby_of(body.as_bytes()),
            Some(Some("http://127.0.0.1:7702".to_string()))
        );
        let none = sbx_api::error_body(&crate::active::standby_error(None), "r", None).to_string();
        assert_eq!(standby_of(none.as_bytes()), Some(None));
        let other = sbx_api::error_body(
            &sbx_api::ApiError::new(sbx_api::ErrorCode::Unavailable, "db"),
            "r",
            None,
        )
        .to_string();
        assert_eq!(standby_of(other.as_bytes()), None);
    }
}
