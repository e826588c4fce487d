//! The store on PostgreSQL (tokio-postgres): one connection, its task on the runtime; a
//! connection that broke is replaced at the next call (the call that found it broken fails
//! with the reason, and so does every call while the server cannot be reached).

use std::error::Error as StdError;
use std::str::FromStr;
use std::sync::Arc;

use bytes::BytesMut;
use tokio::sync::Mutex;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{IsNull, ToSql, Type};
use tokio_postgres::{Client, Config, NoTls};

use super::{lease, DbError, Failure, Row, UniqueOn, Val, Written};

/// The database's clock in ms since the epoch: the time the server took the statement, fixed
/// for its length (as SQLite's 'now' is), so that a row's times made by one statement agree
/// (`clock_timestamp()` moves between two columns of one INSERT); not the transaction's start.
const NOW: &str = "(extract(epoch from statement_timestamp()) * 1000)::bigint";

/// Key of the advisory lock two control planes migrating one database take in turn.
const MIGRATION_LOCK: i64 = 0x5b78_c0de_0028;

/// The schema: numbered steps, applied in order, each once (the `schema_version` table).
/// Times are ms since the epoch; `seq` is the order rows were made in (lists are in it: many
/// rows share a millisecond); constraints are named so that a failure says which.
pub(super) const MIGRATIONS: &[(i64, &str)] = &[
    (
        1,
        "CREATE TABLE nodes (
        id TEXT NOT NULL,
        name TEXT NOT NULL,
        url TEXT NOT NULL,
        build TEXT NOT NULL,
        capacity TEXT NOT NULL,
        draining BOOLEAN NOT NULL DEFAULT FALSE,
        lease_until BIGINT NOT NULL,
        registered_at BIGINT NOT NULL,
        heartbeat_at BIGINT NOT NULL,
        CONSTRAINT nodes_pkey PRIMARY KEY (id),
        CONSTRAINT nodes_name_key UNIQUE (name)
    );
    CREATE TABLE sandboxes (
        seq BIGINT GENERATED ALWAYS AS IDENTITY,
        id TEXT NOT NULL,
        name TEXT,
        node_id TEXT NOT NULL,
        epoch BIGINT NOT NULL,
        status TEXT NOT NULL,
        build TEXT NOT NULL,
        created_at BIGINT NOT NULL,
        updated_at BIGINT NOT NULL,
        CONSTRAINT sandboxes_pkey PRIMARY KEY (seq),
        CONSTRAINT sandboxes_id_key UNIQUE (id),
        CONSTRAINT sandboxes_node_fkey FOREIGN KEY (node_id) REFERENCES nodes(id)
    );
    CREATE UNIQUE INDEX sandboxes_name_key ON sandboxes(name) WHERE name IS NOT NULL;
    CREATE INDEX sandboxes_node ON sandboxes(node_id);
    CREATE TABLE moves (
        seq BIGINT GENERATED ALWAYS AS IDENTITY,
        id TEXT NOT NULL,
        sandbox_id TEXT NOT NULL,
        from_node TEXT NOT NULL,
        to_node TEXT NOT NULL,
        epoch BIGINT NOT NULL,
        step TEXT NOT NULL,
        why TEXT NOT NULL,
        wake BOOLEAN NOT NULL,
        from_store BOOLEAN NOT NULL,
        release TEXT,
        takeover TEXT,
        error TEXT,
        attempts BIGINT NOT NULL DEFAULT 0,
        next_attempt_at BIGINT,
        created_at BIGINT NOT NULL,
        updated_at BIGINT NOT NULL,
        CONSTRAINT moves_pkey PRIMARY KEY (seq),
        CONSTRAINT moves_id_key UNIQUE (id),
        CONSTRAINT moves_sandbox_fkey FOREIGN KEY (sandbox_id) REFERENCES sandboxes(id)
            ON DELETE CASCADE,
        CONSTRAINT moves_from_fkey FOREIGN KEY (from_node) REFERENCES nodes(id),
        CONSTRAINT moves_to_fkey FOREIGN KEY (to_node) REFERENCES nodes(id),
        CONSTRAINT moves_step_check CHECK (step IN
            ('releasing', 'taking_over', 'reclaiming', 'restoring', 'done', 'failed'))
    );
    CREATE UNIQUE INDEX moves_unfinished ON moves(sandbox_id)
        WHERE step NOT IN ('done', 'failed');
    CREATE INDEX moves_sandbox ON moves(sandbox_id, seq);",
    ),
    (
        2,
        "ALTER TABLE moves ADD COLUMN cancel BOOLEAN NOT NULL DEFAULT FALSE,
        ADD COLUMN refusal TEXT, ADD COLUMN ended_at BIGINT;",
    ),
    (
        3,
        "CREATE TABLE batches (
        seq BIGINT GENERATED ALWAYS AS IDENTITY,
        id TEXT NOT NULL,
        kind TEXT NOT NULL,
        node_id TEXT NOT NULL,
        error TEXT,
        created_at BIGINT NOT NULL,
        updated_at BIGINT NOT NULL,
        ended_at BIGINT,
        CONSTRAINT batches_pkey PRIMARY KEY (seq),
        CONSTRAINT batches_id_key UNIQUE (id),
        CONSTRAINT batches_node_fkey FOREIGN KEY (node_id) REFERENCES nodes(id),
        CONSTRAINT batches_kind_check CHECK (kind IN ('evacuation', 'recovery'))
    );
    CREATE UNIQUE INDEX batches_unfinished ON batches(node_id, kind) WHERE ended_at IS NULL;
    CREATE INDEX batches_node ON batches(node_id, seq);
    ALTER TABLE moves ADD COLUMN batch TEXT,
        ADD CONSTRAINT moves_batch_fkey FOREIGN KEY (batch) REFERENCES batches(id);
    CREATE INDEX moves_batch ON moves(batch, seq);",
    ),
    (
        4,
        "CREATE TABLE control_lease (
        id BIGINT NOT NULL,
        holder TEXT NOT NULL,
        url TEXT NOT NULL,
        term BIGINT NOT NULL,
        lease_until BIGINT NOT NULL,
        taken_at BIGINT NOT NULL,
        CONSTRAINT control_lease_pkey PRIMARY KEY (id),
        CONSTRAINT control_lease_one CHECK (id = 1)
    );
    INSERT INTO control_lease (id, holder, url, term, lease_until, taken_at)
        VALUES (1, '', '', 0, 0, 0);",
    ),
    (
        5,
        "ALTER TABLE nodes ADD COLUMN e2b_url TEXT;
    ALTER TABLE nodes ADD COLUMN preview_url TEXT;",
    ),
];

pub(super) struct Postgres {
    config: Config,
    /// Where it connects, for errors (no password).
    target: String,
    client: Mutex<Option<Arc<Client>>>,
    /// Idle connections of fenced writes (a transaction needs a connection of its own).
    writers: std::sync::Mutex<Vec<Client>>,
}

/// How many idle connections of fenced writes are kept.
const WRITERS_IDLE: usize = 4;

impl Postgres {
    /// Connects and applies the migrations the database has not had.
    pub(super) async fn open(url: &str) -> Result<Postgres, DbError> {
        let config = Config::from_str(url).map_err(|e| DbError::Url(e.to_string()))?;
        let target = describe(&config);
        let mut client = connect(&config, &target).await?;
        migrate(&mut client).await?;
        Ok(Postgres {
            config,
            target,
            client: Mutex::new(Some(Arc::new(client))),
            writers: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// A write in one transaction after a read of the lease's term `FOR SHARE` (a take of the
    /// lease waits for it to end), refused with [`DbError::Deposed`] where the term is not
    /// `term`. On a connection of its own (the shared one is used by every call at once).
    pub(super) async fn write_fenced(
        &self,
        sql: &'static str,
        params: Vec<Val>,
        term: i64,
        returning: bool,
    ) -> Result<Written, Failure> {
        let idle = self
            .writers
            .lock()
            .map(|mut v| v.pop())
            .unwrap_or(None)
            .filter(|c| !c.is_closed());
        let mut client = match idle {
            Some(c) => c,
            None => connect(&self.config, &self.target).await?,
        };
        let out = fenced(&mut client, &dialect(sql), &params, term, returning).await;
        if !client.is_closed() {
            if let Ok(mut v) = self.writers.lock() {
                if v.len() < WRITERS_IDLE {
                    v.push(client);
                }
            }
        }
        out
    }

    pub(super) async fn query(
        &self,
        sql: &'static str,
        params: Vec<Val>,
    ) -> Result<Vec<Row>, Failure> {
        let client = self.client().await?;
        let sql = dialect(sql);
        let refs: Vec<&(dyn ToSql + Sync)> =
            params.iter().map(|p| p as &(dyn ToSql + Sync)).collect();
        let rows = client.query(sql.as_str(), &refs).await.map_err(failure)?;
        rows.iter().map(read_row).collect()
    }

    pub(super) async fn execute(
        &self,
        sql: &'static str,
        params: Vec<Val>,
    ) -> Result<u64, Failure> {
        let client = self.client().await?;
        let sql = dialect(sql);
        let refs: Vec<&(dyn ToSql + Sync)> =
            params.iter().map(|p| p as &(dyn ToSql + Sync)).collect();
        client.execute(sql.as_str(), &refs).await.map_err(failure)
    }

    /// The connection, or a new one where it broke.
    async fn client(&self) -> Result<Arc<Client>, Failure> {
        let mut slot = self.client.lock().await;
        if let Some(c) = slot.as_ref() {
            if !c.is_closed() {
                return Ok(Arc::clone(c));
            }
            tracing::warn!(target = %self.target, "the connection to PostgreSQL broke: connecting again");
        }
        *slot = None;
        let c = Arc::new(connect(&self.config, &self.target).await?);
        *slot = Some(Arc::clone(&c));
        Ok(c)
    }

    /// The server process of the connection (tests break it on purpose).
    #[cfg(test)]
    pub(super) async fn backend_pid(&self) -> Result<i32, DbError> {
        let client = self.client().await.map_err(DbError::from)?;
        let row = client.query_one("SELECT pg_backend_pid()", &[]).await?;
        Ok(row.try_get(0)?)
    }
}

async fn fenced(
    client: &mut Client,
    sql: &str,
    params: &[Val],
    term: i64,
    returning: bool,
) -> Result<Written, Failure> {
    let tx = client.transaction().await.map_err(failure)?;
    let lease = format!("{} FOR SHARE", lease::SQL_LEASE_TERM);
    let found = tx.query_opt(lease.as_str(), &[]).await.map_err(failure)?;
    let (found_term, holder, url) = match found {
        Some(r) => (
            r.try_get::<_, i64>(0).map_err(failure)?,
            r.try_get::<_, String>(1).map_err(failure)?,
            r.try_get::<_, String>(2).map_err(failure)?,
        ),
        None => (0, String::new(), String::new()),
    };
    if found_term != term {
        // Dropped, the transaction is rolled back.
        return Err(Failure::Other(lease::deposed(found_term, holder, url)));
    }
    let refs: Vec<&(dyn ToSql + Sync)> = params.iter().map(|p| p as &(dyn ToSql + Sync)).collect();
    let out = if returning {
        let rows = tx.query(sql, &refs).await.map_err(failure)?;
        Written::Rows(rows.iter().map(read_row).collect::<Result<_, _>>()?)
    } else {
        Written::Count(tx.execute(sql, &refs).await.map_err(failure)?)
    };
    tx.commit().await.map_err(failure)?;
    Ok(out)
}

async fn connect(config: &Config, target: &str) -> Result<Client, DbError> {
    let (client, connection) = config
        .connect(NoTls)
        .await
        .map_err(|source| DbError::Connect {
            target: target.to_owned(),
            source,
        })?;
    let target = target.to_owned();
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::warn!(%target, error = %e, "the connection to PostgreSQL ended");
        }
    });
    Ok(client)
}

/// `user@host:port/dbname` of a config.
fn describe(config: &Config) -> String {
    let host = config
        .get_hosts()
        .first()
        .map(|h| match h {
            tokio_postgres::config::Host::Tcp(s) => s.clone(),
            tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
        })
        .unwrap_or_else(|| "localhost".into());
    let port = config.get_ports().first().copied().unwrap_or(5432);
    format!(
        "{}@{}:{}/{}",
        config.get_user().unwrap_or(""),
        host,
        port,
        config.get_dbname().unwrap_or("")
    )
}

async fn migrate(client: &mut Client) -> Result<(), DbError> {
    let known = MIGRATIONS.last().map_or(0, |m| m.0);
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS schema_version (
            version BIGINT NOT NULL PRIMARY KEY,
            applied_at BIGINT NOT NULL
        )",
    )
    .await?;
    let found: i64 = tx
        .query_one(
            "SELECT COALESCE(MAX(version), 0)::bigint FROM schema_version",
            &[],
        )
        .await?
        .try_get(0)?;
    if found > known {
        return Err(DbError::SchemaTooNew { found, known });
    }
    for (version, sql) in MIGRATIONS.iter().filter(|m| m.0 > found) {
        tx.batch_execute(sql).await?;
        tx.execute(
            &format!("INSERT INTO schema_version (version, applied_at) VALUES ($1, {NOW})"),
            &[version],
        )
        .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// The shared SQL text in PostgreSQL's dialect: the n-th `?` becomes `$n` (outside quotes),
/// `@now` its clock.
pub(super) fn dialect(sql: &str) -> String {
    let sql = sql.replace("@now", NOW);
    let mut out = String::with_capacity(sql.len() + 16);
    let mut n = 0;
    let mut quoted = false;
    for ch in sql.chars() {
        match ch {
            '\'' => {
                quoted = !quoted;
                out.push(ch);
            }
            '?' if !quoted => {
                n += 1;
                out.push('$');
                out.push_str(&n.to_string());
            }
            _ => out.push(ch),
        }
    }
    out
}

impl ToSql for Val {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn StdError + Sync + Send>> {
        match self {
            Val::Null => Ok(IsNull::Yes),
            Val::I64(v) => match *ty {
                Type::INT4 => i32::try_from(*v)?.to_sql(ty, out),
                Type::INT2 => i16::try_from(*v)?.to_sql(ty, out),
                _ => v.to_sql(ty, out),
            },
            Val::Text(s) => s.to_sql(ty, out),
            Val::Bool(b) => b.to_sql(ty, out),
        }
    }

    fn accepts(ty: &Type) -> bool {
        // Which of the value's kinds fits the parameter is checked by `to_sql` (through the
        // checked conversions of i64, str and bool).
        <i64 as ToSql>::accepts(ty)
            || <i32 as ToSql>::accepts(ty)
            || <i16 as ToSql>::accepts(ty)
            || <&str as ToSql>::accepts(ty)
            || <bool as ToSql>::accepts(ty)
    }

    fn to_sql_checked(
        &self,
        ty: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn StdError + Sync + Send>> {
        let fits = match self {
            Val::Null => true,
            Val::I64(_) => {
                <i64 as ToSql>::accepts(ty)
                    || <i32 as ToSql>::accepts(ty)
                    || <i16 as ToSql>::accepts(ty)
            }
            Val::Text(_) => <&str as ToSql>::accepts(ty),
            Val::Bool(_) => <bool as ToSql>::accepts(ty),
        };
        if !fits {
            return Err(format!("{self:?} cannot be passed as {ty}").into());
        }
        self.to_sql(ty, out)
    }
}

fn read_row(row: &tokio_postgres::Row) -> Result<Row, Failure> {
    let mut vals = Vec::with_capacity(row.len());
    for (i, col) in row.columns().iter().enumerate() {
        let v = match *col.type_() {
            Type::INT8 => row
                .try_get::<_, Option<i64>>(i)
                .map(|v| v.map_or(Val::Null, Val::I64)),
            Type::INT4 => row
                .try_get::<_, Option<i32>>(i)
                .map(|v| v.map_or(Val::Null, |v| Val::I64(i64::from(v)))),
            Type::INT2 => row
                .try_get::<_, Option<i16>>(i)
                .map(|v| v.map_or(Val::Null, |v| Val::I64(i64::from(v)))),
            Type::BOOL => row
                .try_get::<_, Option<bool>>(i)
                .map(|v| v.map_or(Val::Null, Val::Bool)),
            Type::TEXT | Type::VARCHAR | Type::BPCHAR | Type::NAME => row
                .try_get::<_, Option<String>>(i)
                .map(|v| v.map_or(Val::Null, Val::Text)),
            ref other => {
                return Err(Failure::Other(DbError::Corrupt(format!(
                    "column {} is of type {other}",
                    col.name()
                ))))
            }
        };
        vals.push(v.map_err(|e| Failure::Other(DbError::Postgres(e)))?);
    }
    Ok(vals)
}

/// Sorts a constraint's failure out of the others, by the constraint's name.
fn failure(e: tokio_postgres::Error) -> Failure {
    if let Some(db) = e.as_db_error() {
        if *db.code() == SqlState::UNIQUE_VIOLATION {
            return Failure::Unique(match db.constraint().unwrap_or_default() {
                "nodes_pkey" => UniqueOn::NodeId,
                "nodes_name_key" => UniqueOn::NodeName,
                "sandboxes_id_key" => UniqueOn::SandboxId,
                "sandboxes_name_key" => UniqueOn::SandboxName,
                "moves_id_key" => UniqueOn::MoveId,
                "moves_unfinished" => UniqueOn::MoveUnfinished,
                other => UniqueOn::Other(other.to_owned()),
            });
        }
        if *db.code() == SqlState::FOREIGN_KEY_VIOLATION {
            return Failure::ForeignKey(db.detail().unwrap_or(db.message()).to_owned());
        }
    }
    Failure::Other(DbError::Postgres(e))
}
