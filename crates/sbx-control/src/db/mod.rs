//! The control plane's store: its tables of nodes, sandboxes and moves, on SQLite or
//! PostgreSQL (chosen by the URL given to [`Db::open`]).
//!
//! Every query is one SQL text shared by both backends (the constants below): `?` stands for a
//! parameter and `@now` for the database's clock in milliseconds since the epoch; each backend
//! module turns them into its dialect (`$1…`, its clock expression). Times are always the
//! database's: a node's lease runs out by the database's clock, never a caller's.
//!
//! Two rules are the database's to keep, so that racing control planes cannot break them:
//! - the owner of a sandbox changes only by compare-and-set on its epoch ([`Db::move_owner`]),
//!   and a move's step only by compare-and-set on its step ([`Db::update_move`]);
//! - a sandbox has at most one unfinished move (a partial unique index on `moves(sandbox_id)`
//!   where the step is neither `done` nor `failed`), surfaced as [`DbError::AlreadyMoving`].
//!
//! And every write is fenced by the control plane's lease (`lease`): a handle that took part in
//! it writes only while the `control_lease` row has its term, checked in the write's own
//! transaction ([`DbError::Deposed`] otherwise), in one place (`Backend`), whoever wrote the call.
//!
//! The schema of each backend is in one place (`sqlite::MIGRATIONS`, `postgres::MIGRATIONS`),
//! a list of numbered steps recorded in a `schema_version` table; [`Db::open`] applies those
//! a database has not had yet.

mod lease;
mod postgres;
mod sqlite;
#[cfg(test)]
pub(crate) mod tests;

use std::sync::Arc;

use serde::{Deserialize, Serialize};

pub use lease::{ControlLease, LeaseHolder};

/// Prefix of a node's id.
pub const NODE_PREFIX: &str = "nod";
/// Prefix of a move's id.
pub const MOVE_PREFIX: &str = "mov";
/// The steps of a move (the spec's `move.step`).
pub const MOVE_STEPS: [&str; 6] = [
    "releasing",
    "taking_over",
    "reclaiming",
    "restoring",
    "done",
    "failed",
];
/// The steps that end a move: a sandbox may have a new move once its last one is at one of them.
pub const FINISHED_STEPS: [&str; 2] = ["done", "failed"];

/// What the store failed at.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    /// The row the call names is not in the table (a heartbeat of an unknown node).
    #[error("not found")]
    NotFound,
    /// Another sandbox of the fleet has this name.
    #[error("the name {name:?} is taken")]
    NameTaken { name: String },
    /// A sandbox (or move) with this id is already in the table.
    #[error("the id {id} is taken")]
    IdTaken { id: String },
    /// The sandbox has a move that is not over.
    #[error("the sandbox is being moved ({move_id})")]
    AlreadyMoving { move_id: String },
    /// The node has a batch of this kind that is not over.
    #[error("the node has a batch under way ({batch_id})")]
    BatchUnderWay { batch_id: String },
    /// This control plane's term of the lease is over (another copy took it), or it holds
    /// none (a standby): it writes nothing. `active`: the copy the write found holding it.
    #[error("this control plane is not the active one (the lease is {active:?})")]
    Deposed { active: Option<LeaseHolder> },
    /// The row names a node or sandbox that is not in the table.
    #[error("unknown reference: {0}")]
    UnknownReference(String),
    /// A value the call passed is not one the table holds (a step, an epoch going back).
    #[error("invalid: {0}")]
    Invalid(String),
    /// The URL names no backend, or cannot be read.
    #[error("database URL: {0}")]
    Url(String),
    /// The database was migrated by a newer control plane than this one.
    #[error("the database's schema is at version {found}; this control plane knows up to {known}")]
    SchemaTooNew { found: i64, known: i64 },
    /// PostgreSQL cannot be reached (the next call tries to connect again).
    #[error("PostgreSQL at {target} is unreachable: {source}")]
    Connect {
        target: String,
        #[source]
        source: tokio_postgres::Error,
    },
    /// A row the database returned is not what the schema says (a bug, or a database edited
    /// by hand).
    #[error("unexpected row: {0}")]
    Corrupt(String),
    /// A blocking SQLite call did not finish (its thread panicked, or the runtime is stopping).
    #[error("SQLite call did not finish: {0}")]
    Join(String),
    #[error("SQLite: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("PostgreSQL: {0}")]
    Postgres(#[from] tokio_postgres::Error),
}

/// What a node says of itself when it registers and at each heartbeat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeReg {
    pub name: String,
    pub url: String,
    pub build: String,
    pub capacity: Capacity,
    /// Where E2B's SDKs reach the node (`http://HOST:PORT` of its `--e2b-listen`); none when
    /// it is off. The control plane's E2B listener forwards there.
    #[serde(default)]
    pub e2b_url: Option<String>,
    /// Where the node's preview listener is (`http://HOST:PORT`); none when it is off. The
    /// control plane's preview listener forwards there.
    #[serde(default)]
    pub preview_url: Option<String>,
    /// The sandboxes the node holds (not released or forgotten; running or asleep), each at
    /// its epoch: the heartbeat's answer names those the fleet has elsewhere now (`taken`,
    /// `held.rs`). Not stored in the nodes' table.
    #[serde(default)]
    pub held: Vec<HeldSandbox>,
}

/// A sandbox a node holds, at the epoch it holds it at (a heartbeat's `held`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldSandbox {
    pub id: String,
    pub epoch: u64,
}

/// A sandbox a node holds that the fleet has elsewhere now (a heartbeat's answer's `taken`):
/// the node removes its copy before it serves anything again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TakenSandbox {
    pub id: String,
    /// The epoch the fleet has it at now.
    pub epoch: u64,
    /// The name of the node that has it now; `None` where the table has it on no node.
    pub to: Option<String>,
}

/// A node's room, as it last told it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    pub max_sandboxes: u64,
    pub sandboxes: u64,
    /// The image refs and ids it holds.
    #[serde(default)]
    pub images: Vec<String>,
}

/// A node's state, computed at each read with the database's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeState {
    /// Its lease runs, and it takes new sandboxes.
    Ready,
    /// An operator set it draining: it takes no new sandboxes (whatever its lease).
    Draining,
    /// Its lease ran out (`lease_until` is before the database's now).
    Lost,
}

impl NodeState {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Ready => "ready",
            NodeState::Draining => "draining",
            NodeState::Lost => "lost",
        }
    }

    fn parse(s: &str) -> Result<NodeState, DbError> {
        match s {
            "ready" => Ok(NodeState::Ready),
            "draining" => Ok(NodeState::Draining),
            "lost" => Ok(NodeState::Lost),
            other => Err(DbError::Corrupt(format!("node state {other:?}"))),
        }
    }
}

/// A row of the nodes' table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRow {
    pub id: String,
    pub name: String,
    pub url: String,
    pub state: NodeState,
    pub lease_until_ms: i64,
    pub build: String,
    pub capacity: Capacity,
    pub registered_at_ms: i64,
    pub heartbeat_at_ms: i64,
    /// The node's E2B listener (`http://HOST:PORT`), as it last told it.
    pub e2b_url: Option<String>,
    /// The node's preview listener (`http://HOST:PORT`), as it last told it.
    pub preview_url: Option<String>,
}

/// A row of the sandboxes' table: where a sandbox of the fleet lives, at which epoch.
///
/// `created_at_ms` and `updated_at_ms` are the database's: [`Db::insert_sandbox`] sets both to
/// its now (whatever the row passed says), and every update sets `updated_at_ms`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxRow {
    pub id: String,
    /// Unique across the fleet where set.
    pub name: Option<String>,
    pub node_id: String,
    pub epoch: i64,
    pub status: String,
    pub build: String,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

/// A row of the moves' table: a durable move of a sandbox from one node to another.
///
/// `release`, `takeover` and `error` are JSON texts (the spec's objects). `created_at_ms` and
/// `updated_at_ms` are the database's, as of [`SandboxRow`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoveRow {
    /// `mov-` and 16 characters ([`new_move_id`]).
    pub id: String,
    pub sandbox_id: String,
    pub from_node: String,
    pub to_node: String,
    /// The epoch the table held the sandbox at when the move began.
    pub epoch: i64,
    /// One of [`MOVE_STEPS`].
    pub step: String,
    pub why: String,
    pub wake: bool,
    pub from_store: bool,
    pub release: Option<String>,
    pub takeover: Option<String>,
    pub error: Option<String>,
    pub attempts: i64,
    pub next_attempt_at_ms: Option<i64>,
    /// An operator asked to cancel it (it never goes back to false: [`Db::update_move`] keeps
    /// it once set).
    pub cancel: bool,
    /// The new node's refusal (a JSON error object) of a move going back to the old node:
    /// the `error` it ends with once the old node has the sandbox again (`error` meanwhile is
    /// what the step at hand was last told).
    pub refusal: Option<String>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    /// When it reached `done` or `failed` (the database's now then); `None` while under way.
    pub ended_at_ms: Option<i64>,
    /// The evacuation (`evc-…`) or recovery (`rcv-…`) it is of; `None` for an operator's.
    pub batch: Option<String>,
}

/// A new node id: `nod-` and 16 random characters of `[0-9a-hjkmnp-tv-z]`.
pub fn new_node_id() -> String {
    sbx_api::ids::new_id(NODE_PREFIX)
}

/// A new move id: `mov-` and 16 random characters of `[0-9a-hjkmnp-tv-z]`.
pub fn new_move_id() -> String {
    sbx_api::ids::new_id(MOVE_PREFIX)
}

/// A value passed to or read from either backend.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Val {
    Null,
    I64(i64),
    Text(String),
    Bool(bool),
}

impl Val {
    fn text(s: &str) -> Val {
        Val::Text(s.to_owned())
    }

    fn opt_text(s: Option<&str>) -> Val {
        s.map_or(Val::Null, Val::text)
    }

    fn opt_i64(v: Option<i64>) -> Val {
        v.map_or(Val::Null, Val::I64)
    }
}

/// A failure of one statement, as a backend tells it: the constraints the calls turn into
/// their errors, or anything else.
#[derive(Debug)]
pub(crate) enum Failure {
    Unique(UniqueOn),
    ForeignKey(String),
    Other(DbError),
}

/// Which unique constraint a statement ran into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum UniqueOn {
    NodeId,
    NodeName,
    SandboxId,
    SandboxName,
    MoveId,
    /// The sandbox has a move that is not over.
    MoveUnfinished,
    Other(String),
}

impl From<DbError> for Failure {
    fn from(e: DbError) -> Failure {
        Failure::Other(e)
    }
}

impl From<Failure> for DbError {
    fn from(f: Failure) -> DbError {
        match f {
            Failure::Unique(on) => DbError::Invalid(format!("unique constraint on {on:?}")),
            Failure::ForeignKey(msg) => DbError::UnknownReference(msg),
            Failure::Other(e) => e,
        }
    }
}

type Row = Vec<Val>;

/// A database and the fence of its writes (`lease`): every statement of the store goes
/// through [`Backend::query`] or [`Backend::execute`], so every write is fenced here, whoever
/// wrote its call.
struct Backend {
    kind: Kind,
    fence: lease::Fence,
}

enum Kind {
    Sqlite(sqlite::Sqlite),
    Postgres(Box<postgres::Postgres>),
}

/// What a write answered: its rows (a RETURNING) or how many rows it changed.
pub(crate) enum Written {
    Rows(Vec<Row>),
    Count(u64),
}

/// Whether a statement changes rows: its first word, a RETURNING, or a WITH that writes.
fn changes_rows(sql: &str) -> bool {
    let upper = sql.trim_start().to_ascii_uppercase();
    const WRITES: [&str; 5] = ["INSERT", "UPDATE", "DELETE", "REPLACE", "UPSERT"];
    WRITES.iter().any(|w| upper.starts_with(w))
        || upper.contains("RETURNING")
        || (upper.starts_with("WITH") && WRITES.iter().any(|w| upper.contains(w)))
}

impl Backend {
    async fn query(&self, sql: &'static str, params: Vec<Val>) -> Result<Vec<Row>, Failure> {
        if changes_rows(sql) {
            return match self.write(sql, params, true).await? {
                Written::Rows(rows) => Ok(rows),
                Written::Count(_) => Ok(Vec::new()),
            };
        }
        self.query_unfenced(sql, params).await
    }

    async fn execute(&self, sql: &'static str, params: Vec<Val>) -> Result<u64, Failure> {
        match self.write(sql, params, false).await? {
            Written::Count(n) => Ok(n),
            Written::Rows(rows) => Ok(rows.len() as u64),
        }
    }

    /// A write, fenced by the lease's term where the handle is fenced.
    async fn write(
        &self,
        sql: &'static str,
        params: Vec<Val>,
        returning: bool,
    ) -> Result<Written, Failure> {
        match self.fence.guard() {
            Some(lease::Guard::Open) => {
                if returning {
                    self.query_unfenced(sql, params).await.map(Written::Rows)
                } else {
                    self.execute_unfenced(sql, params).await.map(Written::Count)
                }
            }
            Some(lease::Guard::Term(term)) => {
                let out = match &self.kind {
                    Kind::Sqlite(b) => b.write_fenced(sql, params, term, returning).await,
                    Kind::Postgres(b) => b.write_fenced(sql, params, term, returning).await,
                };
                if let Err(Failure::Other(DbError::Deposed { .. })) = &out {
                    self.fence.lost(term);
                }
                out
            }
            None => {
                // No term: nothing is written; the answer names the copy that holds the lease.
                let rows = self.query_unfenced(lease::SQL_LEASE_TERM, vec![]).await?;
                let (term, holder, url) = match rows.into_iter().next() {
                    Some(row) => {
                        let mut c = Cols::new(row);
                        (c.i64()?, c.text()?, c.text()?)
                    }
                    None => (0, String::new(), String::new()),
                };
                Err(Failure::Other(lease::deposed(term, holder, url)))
            }
        }
    }

    async fn query_unfenced(
        &self,
        sql: &'static str,
        params: Vec<Val>,
    ) -> Result<Vec<Row>, Failure> {
        match &self.kind {
            Kind::Sqlite(b) => b.query(sql, params).await,
            Kind::Postgres(b) => b.query(sql, params).await,
        }
    }

    async fn execute_unfenced(&self, sql: &'static str, params: Vec<Val>) -> Result<u64, Failure> {
        match &self.kind {
            Kind::Sqlite(b) => b.execute(sql, params).await,
            Kind::Postgres(b) => b.execute(sql, params).await,
        }
    }
}

/// The store. Cheap to clone (all clones share the backend).
#[derive(Clone)]
pub struct Db {
    backend: Arc<Backend>,
}

impl std::fmt::Debug for Db {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Db").field("kind", &self.kind()).finish()
    }
}

// The columns of a node, its state computed with the database's clock.
macro_rules! node_cols {
    () => {
        "id, name, url, \
         CASE WHEN draining THEN 'draining' WHEN lease_until < @now THEN 'lost' ELSE 'ready' END, \
         lease_until, build, capacity, registered_at, heartbeat_at, e2b_url, preview_url"
    };
}

macro_rules! sandbox_cols {
    () => {
        "id, name, node_id, epoch, status, build, created_at, updated_at"
    };
}

macro_rules! move_cols {
    () => {
        "id, sandbox_id, from_node, to_node, epoch, step, why, wake, from_store, release, \
         takeover, error, attempts, next_attempt_at, cancel, refusal, created_at, updated_at, \
         ended_at, batch"
    };
}

// The batches' queries (after the macros above, which they use).
pub mod batch;

const SQL_NOW: &str = "SELECT @now";

const SQL_REGISTER: &str = concat!(
    "INSERT INTO nodes (id, name, url, build, capacity, draining, lease_until, registered_at, \
     heartbeat_at, e2b_url, preview_url) VALUES (?, ?, ?, ?, ?, FALSE, @now + ?, @now, @now, \
     ?, ?) \
     ON CONFLICT (name) DO UPDATE SET url = excluded.url, build = excluded.build, \
     capacity = excluded.capacity, lease_until = excluded.lease_until, \
     registered_at = excluded.registered_at, heartbeat_at = excluded.heartbeat_at, \
     e2b_url = excluded.e2b_url, preview_url = excluded.preview_url \
     RETURNING ",
    node_cols!()
);
const SQL_HEARTBEAT: &str = concat!(
    "UPDATE nodes SET url = ?, build = ?, capacity = ?, lease_until = @now + ?, \
     heartbeat_at = @now, e2b_url = ?, preview_url = ? WHERE id = ? RETURNING ",
    node_cols!()
);
const SQL_NODES: &str = concat!("SELECT ", node_cols!(), " FROM nodes ORDER BY name");
const SQL_NODE: &str = concat!(
    "SELECT ",
    node_cols!(),
    " FROM nodes WHERE id = ? OR name = ? ORDER BY id = ? DESC LIMIT 1"
);
const SQL_SET_DRAINING: &str = "UPDATE nodes SET draining = ? WHERE id = ?";

const SQL_INSERT_SANDBOX: &str = "INSERT INTO sandboxes (id, name, node_id, epoch, status, build, \
     created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, @now, @now)";
const SQL_SANDBOX: &str = concat!("SELECT ", sandbox_cols!(), " FROM sandboxes WHERE id = ?");
const SQL_SANDBOX_BY_NAME: &str =
    concat!("SELECT ", sandbox_cols!(), " FROM sandboxes WHERE name = ?");
const SQL_SANDBOXES: &str = concat!("SELECT ", sandbox_cols!(), " FROM sandboxes ORDER BY seq");
const SQL_SANDBOXES_OF_NODE: &str = concat!(
    "SELECT ",
    sandbox_cols!(),
    " FROM sandboxes WHERE node_id = ? ORDER BY seq"
);
const SQL_UPDATE_SANDBOX: &str = "UPDATE sandboxes SET status = COALESCE(?, status), \
     name = CASE WHEN ? THEN ? ELSE name END, updated_at = @now WHERE id = ?";
const SQL_DELETE_SANDBOX: &str = "DELETE FROM sandboxes WHERE id = ?";
const SQL_MOVE_OWNER: &str = "UPDATE sandboxes SET node_id = ?, epoch = ?, updated_at = @now \
     WHERE id = ? AND epoch = ?";

const SQL_INSERT_MOVE: &str = "INSERT INTO moves (id, sandbox_id, from_node, to_node, epoch, \
     step, why, wake, from_store, release, takeover, error, attempts, next_attempt_at, \
     cancel, refusal, created_at, updated_at, ended_at, batch) VALUES (?, ?, ?, ?, ?, ?, ?, ?, \
     ?, ?, ?, ?, ?, ?, ?, ?, @now, @now, CASE WHEN ? IN ('done', 'failed') THEN @now ELSE NULL \
     END, ?)";
const SQL_UPDATE_MOVE: &str = "UPDATE moves SET step = ?, wake = ?, from_store = ?, \
     release = ?, takeover = ?, error = ?, attempts = ?, next_attempt_at = ?, \
     cancel = (cancel OR ?), refusal = ?, \
     ended_at = CASE WHEN ? IN ('done', 'failed') THEN COALESCE(ended_at, @now) ELSE NULL END, \
     updated_at = @now WHERE id = ? AND step = ?";
const SQL_CANCEL_RELEASING: &str = "UPDATE moves SET cancel = TRUE, updated_at = @now \
     WHERE id = ? AND step = 'releasing'";
const SQL_CANCEL_TAKING_OVER: &str = "UPDATE moves SET step = 'reclaiming', cancel = TRUE, \
     refusal = ?, error = NULL, attempts = 0, next_attempt_at = NULL, updated_at = @now \
     WHERE id = ? AND step = 'taking_over' AND takeover IS NULL";
const SQL_MOVES: &str = concat!("SELECT ", move_cols!(), " FROM moves ORDER BY seq");
const SQL_MOVE: &str = concat!("SELECT ", move_cols!(), " FROM moves WHERE id = ?");
const SQL_MOVES_OF: &str = concat!(
    "SELECT ",
    move_cols!(),
    " FROM moves WHERE sandbox_id = ? ORDER BY seq"
);
const SQL_UNFINISHED_MOVES: &str = concat!(
    "SELECT ",
    move_cols!(),
    " FROM moves WHERE step NOT IN ('done', 'failed') ORDER BY seq"
);
const SQL_UNFINISHED_MOVE_OF: &str = concat!(
    "SELECT ",
    move_cols!(),
    " FROM moves WHERE sandbox_id = ? AND step NOT IN ('done', 'failed')"
);

impl Db {
    /// Opens the store at `url` and brings its schema up to date: `sqlite:/abs/path.db` (the
    /// file is made if missing; its folder must exist), `postgres://…` or `postgresql://…`.
    pub async fn open(url: &str) -> Result<Db, DbError> {
        let backend = if let Some(path) = url.strip_prefix("sqlite:") {
            // `sqlite:///abs` is taken as `sqlite:/abs` too.
            let path = path.strip_prefix("//").unwrap_or(path);
            if path.is_empty() {
                return Err(DbError::Url("sqlite: without a path".into()));
            }
            if path == ":memory:" {
                return Err(DbError::Url(
                    "sqlite::memory: is not supported: the store needs a file".into(),
                ));
            }
            Kind::Sqlite(sqlite::Sqlite::open(path.into()).await?)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Kind::Postgres(Box::new(postgres::Postgres::open(url).await?))
        } else {
            return Err(DbError::Url(
                "expected sqlite:/path, postgres://… or postgresql://…".into(),
            ));
        };
        Ok(Db {
            backend: Arc::new(Backend {
                kind: backend,
                fence: lease::Fence::default(),
            }),
        })
    }

    /// `"sqlite"` or `"postgres"`.
    pub fn kind(&self) -> &'static str {
        match self.backend.kind {
            Kind::Sqlite(_) => "sqlite",
            Kind::Postgres(_) => "postgres",
        }
    }

    /// The database's clock, in milliseconds since the epoch.
    pub async fn now_ms(&self) -> Result<i64, DbError> {
        let rows = self.backend.query(SQL_NOW, vec![]).await?;
        let row = rows
            .into_iter()
            .next()
            .ok_or_else(|| DbError::Corrupt("no row of now".into()))?;
        let mut cols = Cols::new(row);
        cols.i64()
    }

    // ---- nodes ----

    /// Registers a node: the same name gets the same id again (its url, build and capacity
    /// are updated; whether it is draining stays). Its lease runs until the database's now +
    /// `lease_ms`.
    pub async fn register_node(&self, reg: &NodeReg, lease_ms: i64) -> Result<NodeRow, DbError> {
        let capacity = capacity_json(&reg.capacity)?;
        let params = vec![
            Val::Text(new_node_id()),
            Val::text(&reg.name),
            Val::text(&reg.url),
            Val::text(&reg.build),
            Val::Text(capacity),
            Val::I64(lease_ms),
            Val::opt_text(reg.e2b_url.as_deref()),
            Val::opt_text(reg.preview_url.as_deref()),
        ];
        match self.backend.query(SQL_REGISTER, params).await {
            Ok(rows) => {
                one(rows, node_row)?.ok_or(DbError::Corrupt("upsert returned no row".into()))
            }
            Err(Failure::Unique(UniqueOn::NodeId)) => {
                // 32^16 ids: a clash of random ids is not worth a retry loop, but cheap to avoid.
                Err(DbError::Corrupt("a random node id was taken".into()))
            }
            Err(f) => Err(f.into()),
        }
    }

    /// A heartbeat of the node `id`: its url, build and capacity as `reg` says (its name stays),
    /// its lease renewed to the database's now + `lease_ms`. [`DbError::NotFound`] if no node
    /// has this id.
    pub async fn heartbeat(
        &self,
        id: &str,
        reg: &NodeReg,
        lease_ms: i64,
    ) -> Result<NodeRow, DbError> {
        let params = vec![
            Val::text(&reg.url),
            Val::text(&reg.build),
            Val::Text(capacity_json(&reg.capacity)?),
            Val::I64(lease_ms),
            Val::opt_text(reg.e2b_url.as_deref()),
            Val::opt_text(reg.preview_url.as_deref()),
            Val::text(id),
        ];
        let rows = self.backend.query(SQL_HEARTBEAT, params).await?;
        one(rows, node_row)?.ok_or(DbError::NotFound)
    }

    /// Every node, by name, its state computed with the database's clock.
    pub async fn nodes(&self) -> Result<Vec<NodeRow>, DbError> {
        let rows = self.backend.query(SQL_NODES, vec![]).await?;
        rows.into_iter().map(node_row).collect()
    }

    /// The node whose id or name is `id_or_name` (an id wins over a name).
    pub async fn node(&self, id_or_name: &str) -> Result<Option<NodeRow>, DbError> {
        let params = vec![
            Val::text(id_or_name),
            Val::text(id_or_name),
            Val::text(id_or_name),
        ];
        let rows = self.backend.query(SQL_NODE, params).await?;
        one(rows, node_row)
    }

    /// Sets or clears the node's draining; false if no node has this id.
    pub async fn set_draining(&self, id: &str, draining: bool) -> Result<bool, DbError> {
        let n = self
            .backend
            .execute(SQL_SET_DRAINING, vec![Val::Bool(draining), Val::text(id)])
            .await?;
        Ok(n > 0)
    }

    // ---- sandboxes ----

    /// Adds a sandbox (its times are the database's now). [`DbError::NameTaken`] if another
    /// sandbox of the fleet has its name, [`DbError::IdTaken`] if its id is in the table,
    /// [`DbError::UnknownReference`] if its node is not.
    pub async fn insert_sandbox(&self, row: &SandboxRow) -> Result<(), DbError> {
        let params = vec![
            Val::text(&row.id),
            Val::opt_text(row.name.as_deref()),
            Val::text(&row.node_id),
            Val::I64(row.epoch),
            Val::text(&row.status),
            Val::text(&row.build),
        ];
        match self.backend.execute(SQL_INSERT_SANDBOX, params).await {
            Ok(_) => Ok(()),
            Err(Failure::Unique(UniqueOn::SandboxId)) => {
                Err(DbError::IdTaken { id: row.id.clone() })
            }
            Err(Failure::Unique(UniqueOn::SandboxName)) => Err(DbError::NameTaken {
                name: row.name.clone().unwrap_or_default(),
            }),
            Err(f) => Err(f.into()),
        }
    }

    pub async fn sandbox(&self, id: &str) -> Result<Option<SandboxRow>, DbError> {
        let rows = self.backend.query(SQL_SANDBOX, vec![Val::text(id)]).await?;
        one(rows, sandbox_row)
    }

    pub async fn sandbox_by_name(&self, name: &str) -> Result<Option<SandboxRow>, DbError> {
        let rows = self
            .backend
            .query(SQL_SANDBOX_BY_NAME, vec![Val::text(name)])
            .await?;
        one(rows, sandbox_row)
    }

    /// The sandboxes of the fleet, or of one node, oldest first.
    pub async fn sandboxes(&self, node_id: Option<&str>) -> Result<Vec<SandboxRow>, DbError> {
        let rows = match node_id {
            Some(node) => {
                self.backend
                    .query(SQL_SANDBOXES_OF_NODE, vec![Val::text(node)])
                    .await?
            }
            None => self.backend.query(SQL_SANDBOXES, vec![]).await?,
        };
        rows.into_iter().map(sandbox_row).collect()
    }

    /// Sets a sandbox's status (where `Some`) and name (where `Some`: `Some(None)` clears it).
    /// False if no sandbox has this id; [`DbError::NameTaken`] if another has the name.
    pub async fn update_sandbox(
        &self,
        id: &str,
        status: Option<&str>,
        name: Option<Option<&str>>,
    ) -> Result<bool, DbError> {
        let params = vec![
            Val::opt_text(status),
            Val::Bool(name.is_some()),
            Val::opt_text(name.flatten()),
            Val::text(id),
        ];
        match self.backend.execute(SQL_UPDATE_SANDBOX, params).await {
            Ok(n) => Ok(n > 0),
            Err(Failure::Unique(UniqueOn::SandboxName)) => Err(DbError::NameTaken {
                name: name.flatten().unwrap_or_default().to_owned(),
            }),
            Err(f) => Err(f.into()),
        }
    }

    /// Removes a sandbox (and the record of its moves); false if it was not there.
    pub async fn delete_sandbox(&self, id: &str) -> Result<bool, DbError> {
        let n = self
            .backend
            .execute(SQL_DELETE_SANDBOX, vec![Val::text(id)])
            .await?;
        Ok(n > 0)
    }

    /// Hands the sandbox to `to_node` at `new_epoch`, if and only if the table still holds it at
    /// `expect_epoch` (compare-and-set): false for a writer that lost a race, or a sandbox that
    /// is not there. An epoch never goes back: `new_epoch` must be above `expect_epoch`.
    pub async fn move_owner(
        &self,
        id: &str,
        expect_epoch: i64,
        to_node: &str,
        new_epoch: i64,
    ) -> Result<bool, DbError> {
        if new_epoch <= expect_epoch {
            return Err(DbError::Invalid(format!(
                "epoch {new_epoch} is not after {expect_epoch}"
            )));
        }
        let params = vec![
            Val::text(to_node),
            Val::I64(new_epoch),
            Val::text(id),
            Val::I64(expect_epoch),
        ];
        let n = self.backend.execute(SQL_MOVE_OWNER, params).await?;
        Ok(n > 0)
    }

    // ---- moves ----

    /// Records a new move (its times are the database's now). [`DbError::AlreadyMoving`] if
    /// the sandbox has a move whose step is neither `done` nor `failed`.
    pub async fn insert_move(&self, m: &MoveRow) -> Result<(), DbError> {
        check_step(&m.step)?;
        let params = vec![
            Val::text(&m.id),
            Val::text(&m.sandbox_id),
            Val::text(&m.from_node),
            Val::text(&m.to_node),
            Val::I64(m.epoch),
            Val::text(&m.step),
            Val::text(&m.why),
            Val::Bool(m.wake),
            Val::Bool(m.from_store),
            Val::opt_text(m.release.as_deref()),
            Val::opt_text(m.takeover.as_deref()),
            Val::opt_text(m.error.as_deref()),
            Val::I64(m.attempts),
            Val::opt_i64(m.next_attempt_at_ms),
            Val::Bool(m.cancel),
            Val::opt_text(m.refusal.as_deref()),
            Val::text(&m.step),
            Val::opt_text(m.batch.as_deref()),
        ];
        // The unfinished move the index found may end between the insert and the look-up: then
        // the insert is tried again.
        for _ in 0..3 {
            match self.backend.execute(SQL_INSERT_MOVE, params.clone()).await {
                Ok(_) => return Ok(()),
                Err(Failure::Unique(UniqueOn::MoveId)) => {
                    return Err(DbError::IdTaken { id: m.id.clone() })
                }
                Err(Failure::Unique(UniqueOn::MoveUnfinished)) => {
                    if let Some(other) = self.unfinished_move_of(&m.sandbox_id).await? {
                        return Err(DbError::AlreadyMoving { move_id: other.id });
                    }
                }
                Err(f) => return Err(f.into()),
            }
        }
        Err(DbError::Corrupt(
            "the sandbox's unfinished move was never found".into(),
        ))
    }

    /// Writes the move's step, wake, from_store, release, takeover, error, attempts and
    /// next_attempt_at, refusal as `m` has them, if and only if its step is still `expect_step`
    /// (compare-and-set): false for a writer that lost a race, or a move that is not there.
    /// Its id, sandbox, nodes, epoch and why never change; `cancel` is only ever set (a
    /// writer that read the row before a cancel does not clear it); `ended_at` is the
    /// database's now when the step first becomes `done` or `failed`.
    pub async fn update_move(&self, m: &MoveRow, expect_step: &str) -> Result<bool, DbError> {
        check_step(&m.step)?;
        check_step(expect_step)?;
        let params = vec![
            Val::text(&m.step),
            Val::Bool(m.wake),
            Val::Bool(m.from_store),
            Val::opt_text(m.release.as_deref()),
            Val::opt_text(m.takeover.as_deref()),
            Val::opt_text(m.error.as_deref()),
            Val::I64(m.attempts),
            Val::opt_i64(m.next_attempt_at_ms),
            Val::Bool(m.cancel),
            Val::opt_text(m.refusal.as_deref()),
            Val::text(&m.step),
            Val::text(&m.id),
            Val::text(expect_step),
        ];
        match self.backend.execute(SQL_UPDATE_MOVE, params).await {
            Ok(n) => Ok(n > 0),
            // A finished move set going again while the sandbox has another one under way.
            Err(Failure::Unique(UniqueOn::MoveUnfinished)) => {
                match self.unfinished_move_of(&m.sandbox_id).await? {
                    Some(other) => Err(DbError::AlreadyMoving { move_id: other.id }),
                    None => Ok(false),
                }
            }
            Err(f) => Err(f.into()),
        }
    }

    pub async fn get_move(&self, id: &str) -> Result<Option<MoveRow>, DbError> {
        let rows = self.backend.query(SQL_MOVE, vec![Val::text(id)]).await?;
        one(rows, move_row)
    }

    /// The moves of a sandbox, oldest first.
    pub async fn moves_of(&self, sandbox_id: &str) -> Result<Vec<MoveRow>, DbError> {
        let rows = self
            .backend
            .query(SQL_MOVES_OF, vec![Val::text(sandbox_id)])
            .await?;
        rows.into_iter().map(move_row).collect()
    }

    /// Every move whose step is neither `done` nor `failed`, oldest first (what a control
    /// plane resumes at its start).
    pub async fn unfinished_moves(&self) -> Result<Vec<MoveRow>, DbError> {
        let rows = self.backend.query(SQL_UNFINISHED_MOVES, vec![]).await?;
        rows.into_iter().map(move_row).collect()
    }

    /// Every move, oldest first.
    pub async fn all_moves(&self) -> Result<Vec<MoveRow>, DbError> {
        let rows = self.backend.query(SQL_MOVES, vec![]).await?;
        rows.into_iter().map(move_row).collect()
    }

    /// The sandbox's move that is under way, if any.
    pub async fn unfinished_move_of(&self, sandbox_id: &str) -> Result<Option<MoveRow>, DbError> {
        let rows = self
            .backend
            .query(SQL_UNFINISHED_MOVE_OF, vec![Val::text(sandbox_id)])
            .await?;
        one(rows, move_row)
    }

    /// An operator's cancel, by compare-and-set on the step the caller read: a move at
    /// `releasing` is marked (the machine ends it); one at `taking_over` whose takeover has not
    /// answered goes `reclaiming` at once, `error` the one it is to end with (its `refusal`;
    /// attempts cleared). False where the
    /// move is no longer as read (the caller reads it again); [`DbError::Invalid`] for another
    /// step.
    pub async fn cancel_move(&self, id: &str, step: &str, error: &str) -> Result<bool, DbError> {
        let n = match step {
            "releasing" => {
                self.backend
                    .execute(SQL_CANCEL_RELEASING, vec![Val::text(id)])
                    .await?
            }
            "taking_over" => {
                self.backend
                    .execute(
                        SQL_CANCEL_TAKING_OVER,
                        vec![Val::text(error), Val::text(id)],
                    )
                    .await?
            }
            other => return Err(DbError::Invalid(format!("a cancel at step {other:?}"))),
        };
        Ok(n > 0)
    }
}

fn check_step(step: &str) -> Result<(), DbError> {
    if MOVE_STEPS.contains(&step) {
        Ok(())
    } else {
        Err(DbError::Invalid(format!("move step {step:?}")))
    }
}

fn capacity_json(c: &Capacity) -> Result<String, DbError> {
    serde_json::to_string(c).map_err(|e| DbError::Invalid(format!("capacity: {e}")))
}

fn one<T>(rows: Vec<Row>, f: impl FnOnce(Row) -> Result<T, DbError>) -> Result<Option<T>, DbError> {
    rows.into_iter().next().map(f).transpose()
}

/// Reads a row's columns in order.
struct Cols {
    vals: std::vec::IntoIter<Val>,
    at: usize,
}

impl Cols {
    fn new(row: Row) -> Cols {
        Cols {
            vals: row.into_iter(),
            at: 0,
        }
    }

    fn next(&mut self) -> Result<Val, DbError> {
        self.at += 1;
        self.vals
            .next()
            .ok_or_else(|| DbError::Corrupt(format!("column {} missing", self.at)))
    }

    fn wrong(&self, want: &str, got: &Val) -> DbError {
        DbError::Corrupt(format!("column {}: expected {want}, got {got:?}", self.at))
    }

    fn i64(&mut self) -> Result<i64, DbError> {
        match self.next()? {
            Val::I64(v) => Ok(v),
            other => Err(self.wrong("an integer", &other)),
        }
    }

    fn opt_i64(&mut self) -> Result<Option<i64>, DbError> {
        match self.next()? {
            Val::I64(v) => Ok(Some(v)),
            Val::Null => Ok(None),
            other => Err(self.wrong("an integer or null", &other)),
        }
    }

    fn text(&mut self) -> Result<String, DbError> {
        match self.next()? {
            Val::Text(v) => Ok(v),
            other => Err(self.wrong("a text", &other)),
        }
    }

    fn opt_text(&mut self) -> Result<Option<String>, DbError> {
        match self.next()? {
            Val::Text(v) => Ok(Some(v)),
            Val::Null => Ok(None),
            other => Err(self.wrong("a text or null", &other)),
        }
    }

    /// A boolean: PostgreSQL's, or SQLite's 0 and 1.
    fn bool(&mut self) -> Result<bool, DbError> {
        match self.next()? {
            Val::Bool(v) => Ok(v),
            Val::I64(v) => Ok(v != 0),
            other => Err(self.wrong("a boolean", &other)),
        }
    }
}

fn node_row(row: Row) -> Result<NodeRow, DbError> {
    let mut c = Cols::new(row);
    Ok(NodeRow {
        id: c.text()?,
        name: c.text()?,
        url: c.text()?,
        state: NodeState::parse(&c.text()?)?,
        lease_until_ms: c.i64()?,
        build: c.text()?,
        capacity: serde_json::from_str(&c.text()?)
            .map_err(|e| DbError::Corrupt(format!("node capacity: {e}")))?,
        registered_at_ms: c.i64()?,
        heartbeat_at_ms: c.i64()?,
        e2b_url: c.opt_text()?,
        preview_url: c.opt_text()?,
    })
}

fn sandbox_row(row: Row) -> Result<SandboxRow, DbError> {
    let mut c = Cols::new(row);
    Ok(SandboxRow {
        id: c.text()?,
        name: c.opt_text()?,
        node_id: c.text()?,
        epoch: c.i64()?,
        status: c.text()?,
        build: c.text()?,
        created_at_ms: c.i64()?,
        updated_at_ms: c.i64()?,
    })
}

fn move_row(row: Row) -> Result<MoveRow, DbError> {
    let mut c = Cols::new(row);
    Ok(MoveRow {
        id: c.text()?,
        sandbox_id: c.text()?,
        from_node: c.text()?,
        to_node: c.text()?,
        epoch: c.i64()?,
        step: c.text()?,
        why: c.text()?,
        wake: c.bool()?,
        from_store: c.bool()?,
        release: c.opt_text()?,
        takeover: c.opt_text()?,
        error: c.opt_text()?,
        attempts: c.i64()?,
        next_attempt_at_ms: c.opt_i64()?,
        cancel: c.bool()?,
        refusal: c.opt_text()?,
        created_at_ms: c.i64()?,
        updated_at_ms: c.i64()?,
        ended_at_ms: c.opt_i64()?,
        batch: c.opt_text()?,
    })
}
