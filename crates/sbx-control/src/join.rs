//! A node's side of the fleet: it joins a control plane (`POST /internal/nodes`), then renews
//! its lease with a heartbeat every third of it (`POST /internal/nodes/{id}/heartbeat`), each
//! time with its room as it is then. A control plane that is away is logged (once, then once
//! when it is back), never fatal: the node serves its own API meanwhile. A heartbeat the control
//! plane does not know the node of (a new database) joins again. The same name keeps its id
//! across the node's restarts (the control plane's table keys nodes by name).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::header;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;
use sha2::Digest as _;

use crate::db::{Capacity, NodeReg};

/// What a node joins with.
#[derive(Debug, Clone)]
pub struct JoinConfig {
    /// The control plane's base URL (`http://HOST:PORT`).
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
}

/// The node's room now (called off the async runtime's threads: it may read the disk).
pub type CapacityFn = Arc<dyn Fn() -> Capacity + Send + Sync>;

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
}

/// The control plane's answer to a join or a heartbeat.
#[derive(Debug, Clone, Deserialize)]
pub struct Lease {
    pub id: String,
    pub name: String,
    pub lease_until: String,
    pub lease_seconds: f64,
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

type JoinClient = Client<HttpConnector, Full<Bytes>>;

fn client() -> JoinClient {
    let mut http = HttpConnector::new();
    http.set_connect_timeout(Some(Duration::from_secs(5)));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(http)
}

/// One call: `POST {control}{path}` with `reg`; `Ok(None)` on 404 (an unknown node).
async fn post(
    client: &JoinClient,
    cfg: &JoinConfig,
    path: &str,
    reg: &NodeReg,
) -> Result<Option<Lease>, JoinError> {
    let url = format!("{}{path}", cfg.control.trim_end_matches('/'));
    let uri: hyper::Uri = url.parse().map_err(|_| JoinError::Url(url.clone()))?;
    let mut b = hyper::Request::post(uri).header(header::CONTENT_TYPE, "application/json");
    if let Some(k) = &cfg.api_key {
        b = b.header(header::AUTHORIZATION, format!("Bearer {k}"));
    }
    let req = b.body(Full::new(Bytes::from(serde_json::to_vec(reg)?)))?;
    let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
        .await
        .map_err(|_| JoinError::Status {
            status: 0,
            body: "no answer in 10 s".into(),
        })??;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    if status == hyper::StatusCode::NOT_FOUND {
        return Ok(None);
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
async fn reg_now(cfg: &JoinConfig, capacity: &CapacityFn) -> Result<NodeReg, JoinError> {
    let f = capacity.clone();
    let capacity = tokio::task::spawn_blocking(move || f())
        .await
        .map_err(|e| JoinError::Capacity(e.to_string()))?;
    Ok(NodeReg {
        name: cfg.name.clone(),
        url: cfg.url.clone(),
        build: cfg.build.clone(),
        capacity,
    })
}

/// The node's place in the fleet as the loop knows it.
struct Joined {
    lease: Lease,
}

/// Joins, then heartbeats, until the task is dropped (aborted with the node).
pub fn start(cfg: JoinConfig, capacity: CapacityFn) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let client = client();
        let mut joined: Option<Joined> = None;
        // Whether the last call failed (its failure was logged; the next success is too).
        let mut failing = false;
        loop {
            let result = async {
                let reg = reg_now(&cfg, &capacity).await?;
                match &joined {
                    Some(j) => {
                        let path = format!("/internal/nodes/{}/heartbeat", j.lease.id);
                        match post(&client, &cfg, &path, &reg).await? {
                            Some(l) => Ok(l),
                            None => {
                                tracing::warn!(
                                    control = %cfg.control,
                                    id = %j.lease.id,
                                    "the control plane does not know this node: joining again"
                                );
                                post(&client, &cfg, "/internal/nodes", &reg).await?.ok_or(
                                    JoinError::Status {
                                        status: 404,
                                        body: "POST /internal/nodes is not served".into(),
                                    },
                                )
                            }
                        }
                    }
                    None => post(&client, &cfg, "/internal/nodes", &reg).await?.ok_or(
                        JoinError::Status {
                            status: 404,
                            body: "POST /internal/nodes is not served".into(),
                        },
                    ),
                }
            }
            .await;
            let wait = match result {
                Ok(lease) => {
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
                    let every = Duration::from_secs_f64((lease.lease_seconds / 3.0).max(0.1));
                    joined = Some(Joined { lease });
                    every
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
}
