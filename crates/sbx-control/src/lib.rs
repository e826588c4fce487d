//! The fleet's control plane (`sandboxd control`): its table of nodes, sandboxes and moves
//! (`db`, SQLite or PostgreSQL), the nodes joining it (`join`, the node's side), placement
//! (`place`), the fleet's `/v1` API, every call of a sandbox passed to the node that has it
//! (`fleet`, over `proxy`), and moves of sandboxes between nodes (`moves`: the API; `machine`:
//! the durable move machine; `nodecall`: its calls to nodes), and the functions interface
//! (`sandbox::*`) on an iii engine, each call routed to a node (`functions`). It is a client of
//! nodes over HTTP: it links no part of a node.
//!
//! Several copies may share one PostgreSQL database: one is active by a lease with a term in
//! the database, the others stand by (503 `standby`), and every write is fenced by the term
//! (`active`, `db::lease`).
//!
//! Two more listeners, off unless given: E2B's (`e2b`, `--e2b-listen`) and the preview
//! listener (`preview`, `--preview-listen`), each request passed to the same listener of the
//! sandbox's node by the table (`relay`: the routing they share with `fleet`).
//!
//! Routes (`server::router`): `GET /healthz`; `GET|POST /internal/nodes`, `GET
//! /internal/nodes/{id}`, `POST /internal/nodes/{id}/heartbeat`, `POST
//! /internal/nodes/{id}/drain`; `POST|GET /internal/moves`, `GET /internal/moves/{id}`, `POST
//! /internal/moves/{id}/cancel`; `POST /internal/nodes/{id}/recover|evacuate`, `GET
//! /internal/batches[/{id}]` (`batch`: evacuations and recoveries); `POST /v1/run`, `POST|GET /v1/sandboxes`, every method of
//! `/v1/sandboxes/{id}` and below. docs/fleet.md tells how to run a fleet.

#![forbid(unsafe_code)]

pub mod active;
pub mod auth;
pub mod batch;
pub mod db;
pub mod e2b;
#[cfg(test)]
mod e2b_tests;
pub mod fleet;
pub mod functions;
pub mod held;
pub mod join;
pub mod list;
pub mod machine;
pub mod moves;
#[cfg(test)]
mod moves_tests;
pub mod nodecall;
pub mod place;
pub mod preview;
pub mod proxy;
pub mod relay;
pub mod server;
#[cfg(test)]
mod server_tests;

use std::collections::HashSet;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// How the control plane runs (`sandboxd control`'s flags).
#[derive(Debug, Clone)]
pub struct ControlConfig {
    pub listen: SocketAddr,
    /// The timeouts and the cap of its API listener's connections (the node's flags:
    /// `--header-timeout-ms`, `--body-idle-timeout-ms`, `--keepalive-timeout-ms`,
    /// `--max-connections`).
    pub limits: sbx_listen::Limits,
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
    /// This copy's name among the control planes of one database (`--name`; the lease's
    /// holder).
    pub name: String,
    /// Where nodes and callers reach this copy (`--advertise-url`, `http://HOST:PORT`): what a
    /// standby's 503 `standby` names.
    pub advertise_url: String,
    /// How long the active copy's lease runs without a renewal (`--control-lease-seconds`;
    /// the database's clock): a standby takes over within about 1⅓ of it (`active`).
    pub control_lease: Duration,
    /// A node lost this long past its lease and grace is recovered by itself
    /// (`--recover-after-seconds`); `None`: only by `POST /internal/nodes/{id}/recover`.
    pub recover_after: Option<Duration>,
    /// E2B's listener (`--e2b-listen`): E2B's SDKs on the fleet, each request forwarded to
    /// the E2B listener of a node by the table (`e2b`); `None`: off.
    pub e2b_listen: Option<SocketAddr>,
    /// The preview listener (`--preview-listen`): `{port}-{sandbox}.{domain}` forwarded to the
    /// preview listener of the sandbox's node (`preview`); `None`: off.
    pub preview_listen: Option<SocketAddr>,
    /// `--preview-domain` (the nodes' own).
    pub preview_domain: String,
    /// An iii engine (`ws://HOST:PORT`) to serve `sandbox::*` on (its default namespace), each
    /// call routed to a node (`functions`); `None`: no worker.
    pub iii_url: Option<String>,
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
    #[error("--preview-domain {0:?} is not a domain")]
    PreviewDomain(String),
    /// `--e2b-listen` or `--preview-listen` could not be bound.
    #[error("{flag}: listen on {addr}")]
    ListenFront {
        flag: &'static str,
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("the SQLite file")]
    Sqlite(#[source] active::LockError),
    #[error("listen on {addr}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
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
    // Nothing is written before this copy holds the control plane's lease (`active`). One
    // control plane owns a SQLite file: it takes the lease whoever held it last.
    db.fence_writes();
    let sqlite_lock = match active::sqlite_path(&cfg.db_url) {
        Some(path) => Some(active::lock_sqlite(&path).map_err(ControlError::Sqlite)?),
        None => None,
    };
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
    // E2B's and the preview listener, bound before anything is served (a port taken stops
    // the start, naming its address).
    let preview_domain = match cfg.preview_listen {
        Some(_) => Some(
            preview::domain_of(&cfg.preview_domain)
                .ok_or_else(|| ControlError::PreviewDomain(cfg.preview_domain.clone()))?,
        ),
        None => None,
    };
    let mut fronts = Vec::new();
    for (flag, addr) in [
        ("--e2b-listen", cfg.e2b_listen),
        ("--preview-listen", cfg.preview_listen),
    ] {
        fronts.push(match addr {
            Some(addr) => Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|source| ControlError::ListenFront { flag, addr, source })?,
            ),
            None => None,
        });
    }
    let preview_listener = fronts.pop().flatten();
    let e2b_listener = fronts.pop().flatten();
    let ctl = Arc::new(
        server::Ctl::new(db, cfg.node_lease, cfg.api_keys)
            .with_store(store)
            .with_role(active::Role::new(&cfg.name)),
    );
    let preview_at = preview_listener
        .as_ref()
        .and_then(|l| l.local_addr().ok())
        .zip(preview_domain.clone());
    let mut listeners = Vec::new();
    if let Some(l) = e2b_listener {
        let domain = e2b::answer_domain(preview_at.as_ref().map(|(a, d)| (d.as_str(), *a)));
        tracing::info!(listen = ?l.local_addr().ok(), "the control plane's E2B listener serves");
        listeners.push(e2b::spawn(l, ctl.clone(), domain));
    }
    if let (Some(l), Some(domain)) = (preview_listener, preview_domain) {
        tracing::info!(listen = ?l.local_addr().ok(), %domain, "the control plane's preview listener serves");
        listeners.push(preview::spawn(l, ctl.clone(), domain));
    }
    // Standby until it takes the lease; active, it takes up every unfinished move (a control
    // plane stopped mid-move) and every unfinished evacuation and recovery (`active::Active`).
    let lease = active::LeaseConfig {
        name: cfg.name.clone(),
        url: cfg.advertise_url.clone(),
        lease: cfg.control_lease,
        force: sqlite_lock.is_some(),
    };
    let duties = active::Duties {
        recover_after: cfg.recover_after,
        iii_url: cfg.iii_url.clone(),
    };
    let first = match active::take(&ctl, &lease).await {
        Ok(t) => t,
        Err(e) => {
            tracing::warn!(error = %e, "the control plane's lease could not be taken (tried again)");
            None
        }
    };
    let role = tokio::spawn(active::run(ctl.clone(), lease, duties, first));
    let db = ctl.db.clone();
    let app = server::router(ctl);
    // A stop ends the control plane at once: its streams (a command's output, a terminal)
    // are the nodes', and a caller goes on with them through another control plane or the
    // same one started again.
    tokio::select! {
        () = sbx_listen::serve(listener, app, cfg.limits, std::future::pending()) => {}
        () = stop => tracing::info!("the control plane stops"),
    };
    // Its duties stop with the loop; the lease is given up, so that a standby takes over at
    // its next try.
    role.abort();
    let _ = role.await;
    match db.release_lease(&cfg.name).await {
        Ok(true) => tracing::info!(name = %cfg.name, "the control plane's lease is given up"),
        Ok(false) => {}
        Err(e) => tracing::warn!(error = %e, "the control plane's lease could not be given up"),
    }
    drop(sqlite_lock);
    for l in listeners {
        l.abort();
    }
    Ok(())
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
