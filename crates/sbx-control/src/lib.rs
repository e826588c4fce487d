//! The fleet's control plane (`sandboxd control`): its table of nodes, sandboxes and moves
//! (`db`, SQLite or PostgreSQL), the nodes joining it (`join`, the node's side), placement
//! (`place`), the fleet's `/v1` API, every call of a sandbox passed to the node that has it
//! (`fleet`, over `proxy`), and moves of sandboxes between nodes (`moves`: the API; `machine`:
//! the durable move machine; `nodecall`: its calls to nodes). It is a client of nodes over
//! HTTP: it links no part of a node.
//!
//! Routes (`server::router`): `GET /healthz`; `GET|POST /internal/nodes`, `GET
//! /internal/nodes/{id}`, `POST /internal/nodes/{id}/heartbeat`, `POST
//! /internal/nodes/{id}/drain`; `POST|GET /internal/moves`, `GET /internal/moves/{id}`, `POST
//! /internal/moves/{id}/cancel`; `POST /v1/run`, `POST|GET /v1/sandboxes`, every method of
//! `/v1/sandboxes/{id}` and below. docs/fleet.md tells how to run a fleet.

#![forbid(unsafe_code)]

pub mod auth;
pub mod db;
pub mod fleet;
pub mod join;
pub mod list;
pub mod machine;
pub mod moves;
#[cfg(test)]
mod moves_tests;
pub mod nodecall;
pub mod place;
pub mod proxy;
pub mod server;
#[cfg(test)]
mod server_tests;

use std::collections::HashSet;
use std::future::{Future, IntoFuture};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// How the control plane runs (`sandboxd control`'s flags).
#[derive(Debug, Clone)]
pub struct ControlConfig {
    pub listen: SocketAddr,
    /// Where it keeps its state (the SQLite database by default).
    pub data_dir: PathBuf,
    /// `sqlite:/abs/path.db`, `postgres://…` or `postgresql://…`.
    pub db_url: String,
    /// The object store of the nodes' sleeps and snapshots (a deleted sandbox's objects are
    /// removed from it).
    pub store_url: String,
    /// A node is `lost` this long after its last heartbeat.
    pub node_lease: Duration,
    /// The keys callers must send; `None`: loopback callers only.
    pub api_keys: Option<HashSet<String>>,
}

impl ControlConfig {
    /// `sqlite:DATA_DIR/control.db`.
    pub fn default_db_url(data_dir: &std::path::Path) -> String {
        format!("sqlite:{}", data_dir.join("control.db").display())
    }

    /// `file://DATA_DIR/store`.
    pub fn default_store_url(data_dir: &std::path::Path) -> String {
        format!("file://{}", data_dir.join("store").display())
    }
}

/// Why the control plane could not start.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("make {path}")]
    DataDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the database ({url})")]
    Db {
        url: String,
        #[source]
        source: db::DbError,
    },
    #[error("the object store ({url})")]
    Store {
        url: String,
        #[source]
        source: sbx_blob::BlobError,
    },
    #[error("listen on {addr}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("serving")]
    Serve(#[source] std::io::Error),
}

/// A database URL with its password hidden, for logs and errors.
pub fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let Some((userinfo, host)) = rest.split_once('@') else {
        return url.to_string();
    };
    match userinfo.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
        None => url.to_string(),
    }
}

/// Opens the database and binds the listener (what can fail at start), then serves until
/// `stop` completes.
pub async fn serve(
    cfg: ControlConfig,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ControlError> {
    std::fs::create_dir_all(&cfg.data_dir).map_err(|source| ControlError::DataDir {
        path: cfg.data_dir.clone(),
        source,
    })?;
    let db = db::Db::open(&cfg.db_url)
        .await
        .map_err(|source| ControlError::Db {
            url: redacted(&cfg.db_url),
            source,
        })?;
    // Names reserved by calls of a control plane that stopped mid-call are free again.
    let stale = db
        .sandboxes(None)
        .await
        .map_err(|source| ControlError::Db {
            url: redacted(&cfg.db_url),
            source,
        })?;
    for r in stale.iter().filter(|r| r.status == fleet::RESERVED) {
        if let Err(e) = db.delete_sandbox(&r.id).await {
            tracing::warn!(error = %e, id = %r.id, "a stale name reservation stays");
        }
    }
    let store = sbx_blob::Store::open(&cfg.store_url).map_err(|source| ControlError::Store {
        url: cfg.store_url.clone(),
        source,
    })?;
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|source| ControlError::Listen {
            addr: cfg.listen,
            source,
        })?;
    tracing::info!(
        listen = %cfg.listen,
        db = %redacted(&cfg.db_url),
        kind = db.kind(),
        store = %cfg.store_url,
        lease_seconds = cfg.node_lease.as_secs_f64(),
        keys = cfg.api_keys.is_some(),
        "the control plane serves"
    );
    let ctl = Arc::new(server::Ctl::new(db, cfg.node_lease, cfg.api_keys).with_store(store));
    // Every unfinished move of the table is taken up (a control plane stopped mid-move).
    let moves = machine::start(ctl.clone());
    let app = server::router(ctl).into_make_service_with_connect_info::<SocketAddr>();
    // A stop ends the control plane at once: its streams (a command's output, a terminal)
    // are the nodes', and a caller goes on with them through another control plane or the
    // same one started again.
    let served = tokio::select! {
        r = axum::serve(listener, app).into_future() => r.map_err(ControlError::Serve),
        () = stop => {
            tracing::info!("the control plane stops");
            Ok(())
        }
    };
    moves.abort();
    served
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_hidden() {
        assert_eq!(
            redacted("postgres://u:secret@127.0.0.1:5432/db"),
            "postgres://u:***@127.0.0.1:5432/db"
        );
        assert_eq!(redacted("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(redacted("sqlite:/var/lib/x.db"), "sqlite:/var/lib/x.db");
    }
}
