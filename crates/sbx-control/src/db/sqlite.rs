//! The store on SQLite (rusqlite): WAL, a busy timeout, foreign keys on; every call runs on
//! the blocking pool with a connection of a small pool of them.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rusqlite::types::{ToSqlOutput, Value, ValueRef};
use rusqlite::{Connection, ErrorCode};

use super::{lease, DbError, Failure, Row, UniqueOn, Val, Written};

/// The database's clock in ms since the epoch. `julianday('now')` has a resolution of 1 ms
/// (SQLite keeps 'now' in ms) and is fixed for the length of a statement; as a double of some
/// 2.46e6 days it is exact to some 40 µs, so the product is rounded, not truncated (a
/// truncation would make x.999… one ms short).
const NOW: &str = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)";

/// How long a statement waits for another connection's write lock.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// How many idle connections are kept.
const POOL_IDLE: usize = 4;

/// The schema: numbered steps, applied in order, each once (the `schema_version` table).
/// Booleans are 0 and 1 (`BOOLEAN` has numeric affinity); times are ms since the epoch; `seq`
/// is the order rows were made in (lists are in it: many rows share a millisecond).
pub(super) const MIGRATIONS: &[(i64, &str)] = &[
    (
        1,
        "CREATE TABLE nodes (
        id TEXT NOT NULL PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        url TEXT NOT NULL,
        build TEXT NOT NULL,
        capacity TEXT NOT NULL,
        draining BOOLEAN NOT NULL DEFAULT FALSE,
        lease_until INTEGER NOT NULL,
        registered_at INTEGER NOT NULL,
        heartbeat_at INTEGER NOT NULL
    );
    CREATE TABLE sandboxes (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        name TEXT,
        node_id TEXT NOT NULL REFERENCES nodes(id),
        epoch INTEGER NOT NULL,
        status TEXT NOT NULL,
        build TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL
    );
    CREATE UNIQUE INDEX sandboxes_name_key ON sandboxes(name) WHERE name IS NOT NULL;
    CREATE INDEX sandboxes_node ON sandboxes(node_id);
    CREATE TABLE moves (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        sandbox_id TEXT NOT NULL REFERENCES sandboxes(id) ON DELETE CASCADE,
        from_node TEXT NOT NULL REFERENCES nodes(id),
        to_node TEXT NOT NULL REFERENCES nodes(id),
        epoch INTEGER NOT NULL,
        step TEXT NOT NULL CHECK (step IN
            ('releasing', 'taking_over', 'reclaiming', 'restoring', 'done', 'failed')),
        why TEXT NOT NULL,
        wake BOOLEAN NOT NULL,
        from_store BOOLEAN NOT NULL,
        release TEXT,
        takeover TEXT,
        error TEXT,
        attempts INTEGER NOT NULL DEFAULT 0,
        next_attempt_at INTEGER,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL
    );
    CREATE UNIQUE INDEX moves_unfinished ON moves(sandbox_id)
        WHERE step NOT IN ('done', 'failed');
    CREATE INDEX moves_sandbox ON moves(sandbox_id, seq);",
    ),
    (
        2,
        "ALTER TABLE moves ADD COLUMN cancel BOOLEAN NOT NULL DEFAULT FALSE;
    ALTER TABLE moves ADD COLUMN refusal TEXT;
    ALTER TABLE moves ADD COLUMN ended_at INTEGER;",
    ),
    (
        3,
        "CREATE TABLE batches (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        kind TEXT NOT NULL CHECK (kind IN ('evacuation', 'recovery')),
        node_id TEXT NOT NULL REFERENCES nodes(id),
        error TEXT,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL,
        ended_at INTEGER
    );
    CREATE UNIQUE INDEX batches_unfinished ON batches(node_id, kind) WHERE ended_at IS NULL;
    CREATE INDEX batches_node ON batches(node_id, seq);
    ALTER TABLE moves ADD COLUMN batch TEXT REFERENCES batches(id);
    CREATE INDEX moves_batch ON moves(batch, seq);",
    ),
    (
        4,
        "CREATE TABLE control_lease (
        id INTEGER NOT NULL PRIMARY KEY CHECK (id = 1),
        holder TEXT NOT NULL,
        url TEXT NOT NULL,
        term INTEGER NOT NULL,
        lease_until INTEGER NOT NULL,
        taken_at INTEGER NOT NULL
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

pub(super) struct Sqlite {
    path: PathBuf,
    idle: Arc<Mutex<Vec<Connection>>>,
}

impl Sqlite {
    /// Opens (or makes) the file and applies the migrations it has not had.
    pub(super) async fn open(path: PathBuf) -> Result<Sqlite, DbError> {
        let db = Sqlite {
            path,
            idle: Arc::new(Mutex::new(Vec::new())),
        };
        db.with_conn(|conn| migrate(conn).map_err(Failure::Other))
            .await
            .map_err(DbError::from)?;
        Ok(db)
    }

    pub(super) async fn query(
        &self,
        sql: &'static str,
        params: Vec<Val>,
    ) -> Result<Vec<Row>, Failure> {
        let sql = dialect(sql);
        self.with_conn(move |conn| run_query(conn, &sql, &params))
            .await
    }

    pub(super) async fn execute(
        &self,
        sql: &'static str,
        params: Vec<Val>,
    ) -> Result<u64, Failure> {
        let sql = dialect(sql);
        self.with_conn(move |conn| run_execute(conn, &sql, &params))
            .await
    }

    /// A write in one transaction with a read of the lease's term (`BEGIN IMMEDIATE`: no
    /// other writer between the two), refused with [`DbError::Deposed`] where the term is
    /// not `term`.
    pub(super) async fn write_fenced(
        &self,
        sql: &'static str,
        params: Vec<Val>,
        term: i64,
        returning: bool,
    ) -> Result<Written, Failure> {
        let sql = dialect(sql);
        self.with_conn(move |conn| {
            conn.execute_batch("BEGIN IMMEDIATE").map_err(failure)?;
            let result = (|| {
                let found = conn
                    .query_row(lease::SQL_LEASE_TERM, [], |r| {
                        Ok((
                            r.get::<_, i64>(0)?,
                            r.get::<_, String>(1)?,
                            r.get::<_, String>(2)?,
                        ))
                    })
                    .map_err(failure)?;
                if found.0 != term {
                    return Err(Failure::Other(lease::deposed(found.0, found.1, found.2)));
                }
                if returning {
                    run_query(conn, &sql, &params).map(Written::Rows)
                } else {
                    run_execute(conn, &sql, &params).map(Written::Count)
                }
            })();
            match result {
                Ok(w) => match conn.execute_batch("COMMIT") {
                    Ok(()) => Ok(w),
                    Err(e) => {
                        // Not left open on the connection that goes back to the pool.
                        let _ = conn.execute_batch("ROLLBACK");
                        Err(failure(e))
                    }
                },
                Err(e) => {
                    // The error that matters is the statement's (or the fence's).
                    let _ = conn.execute_batch("ROLLBACK");
                    Err(e)
                }
            }
        })
        .await
    }

    /// Runs `f` on the blocking pool with a connection: an idle one, or a new one.
    async fn with_conn<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, Failure> + Send + 'static,
    ) -> Result<T, Failure> {
        let path = self.path.clone();
        let idle = Arc::clone(&self.idle);
        tokio::task::spawn_blocking(move || {
            let taken = idle.lock().map(|mut v| v.pop()).unwrap_or(None);
            let conn = match taken {
                Some(c) => c,
                None => connect(&path).map_err(Failure::Other)?,
            };
            let out = f(&conn);
            if let Ok(mut v) = idle.lock() {
                if v.len() < POOL_IDLE {
                    v.push(conn);
                }
            }
            out
        })
        .await
        .map_err(|e| Failure::Other(DbError::Join(e.to_string())))?
    }
}

fn run_query(conn: &Connection, sql: &str, params: &[Val]) -> Result<Vec<Row>, Failure> {
    let mut stmt = conn.prepare_cached(sql).map_err(failure)?;
    let ncols = stmt.column_count();
    let mut rows = stmt
        .query(rusqlite::params_from_iter(params.iter()))
        .map_err(failure)?;
    let mut out = Vec::new();
    while let Some(row) = rows.next().map_err(failure)? {
        let mut vals = Vec::with_capacity(ncols);
        for i in 0..ncols {
            vals.push(read(row.get_ref(i).map_err(failure)?)?);
        }
        out.push(vals);
    }
    Ok(out)
}

fn run_execute(conn: &Connection, sql: &str, params: &[Val]) -> Result<u64, Failure> {
    let mut stmt = conn.prepare_cached(sql).map_err(failure)?;
    let n = stmt
        .execute(rusqlite::params_from_iter(params.iter()))
        .map_err(failure)?;
    Ok(n as u64)
}

fn connect(path: &std::path::Path) -> Result<Connection, DbError> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    conn.pragma_update(None, "foreign_keys", "ON")?;
    Ok(conn)
}

fn migrate(conn: &Connection) -> Result<(), DbError> {
    let known = MIGRATIONS.last().map_or(0, |m| m.0);
    // IMMEDIATE: two control planes opening one file at once migrate one after the other.
    conn.execute_batch("BEGIN IMMEDIATE")?;
    let result = (|| -> Result<(), DbError> {
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS schema_version (
                version INTEGER NOT NULL PRIMARY KEY,
                applied_at INTEGER NOT NULL
            )",
        )?;
        let found: i64 = conn.query_row(
            "SELECT COALESCE(MAX(version), 0) FROM schema_version",
            [],
            |r| r.get(0),
        )?;
        if found > known {
            return Err(DbError::SchemaTooNew { found, known });
        }
        for (version, sql) in MIGRATIONS.iter().filter(|m| m.0 > found) {
            conn.execute_batch(sql)?;
            conn.execute(
                &format!("INSERT INTO schema_version (version, applied_at) VALUES (?1, {NOW})"),
                [version],
            )?;
        }
        Ok(())
    })();
    match result {
        Ok(()) => {
            conn.execute_batch("COMMIT")?;
            Ok(())
        }
        Err(e) => {
            // The error that matters is the migration's; a failed rollback leaves the
            // transaction to end with the connection.
            let _ = conn.execute_batch("ROLLBACK");
            Err(e)
        }
    }
}

/// The shared SQL text in SQLite's dialect: `?` is SQLite's own; `@now` becomes its clock.
fn dialect(sql: &str) -> String {
    sql.replace("@now", NOW)
}

impl rusqlite::ToSql for Val {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(match self {
            Val::Null => ToSqlOutput::Owned(Value::Null),
            Val::I64(v) => ToSqlOutput::Owned(Value::Integer(*v)),
            Val::Text(s) => ToSqlOutput::Borrowed(ValueRef::Text(s.as_bytes())),
            Val::Bool(b) => ToSqlOutput::Owned(Value::Integer(i64::from(*b))),
        })
    }
}

fn read(v: ValueRef<'_>) -> Result<Val, Failure> {
    match v {
        ValueRef::Null => Ok(Val::Null),
        ValueRef::Integer(i) => Ok(Val::I64(i)),
        ValueRef::Text(t) => String::from_utf8(t.to_vec())
            .map(Val::Text)
            .map_err(|e| Failure::Other(DbError::Corrupt(format!("text not UTF-8: {e}")))),
        ValueRef::Real(r) => Err(Failure::Other(DbError::Corrupt(format!("a real: {r}")))),
        ValueRef::Blob(_) => Err(Failure::Other(DbError::Corrupt("a blob".into()))),
    }
}

/// Sorts a constraint's failure out of the others. SQLite names a unique constraint by its
/// columns: "UNIQUE constraint failed: sandboxes.name".
fn failure(e: rusqlite::Error) -> Failure {
    if let rusqlite::Error::SqliteFailure(code, msg) = &e {
        if code.code == ErrorCode::ConstraintViolation {
            let msg = msg.clone().unwrap_or_default();
            const UNIQUE: i32 = rusqlite::ffi::SQLITE_CONSTRAINT_UNIQUE;
            const PRIMARY_KEY: i32 = rusqlite::ffi::SQLITE_CONSTRAINT_PRIMARYKEY;
            const FOREIGN_KEY: i32 = rusqlite::ffi::SQLITE_CONSTRAINT_FOREIGNKEY;
            match code.extended_code {
                UNIQUE | PRIMARY_KEY => {
                    let on = msg.rsplit(": ").next().map(str::trim).unwrap_or_default();
                    return Failure::Unique(match on {
                        "nodes.id" => UniqueOn::NodeId,
                        "nodes.name" => UniqueOn::NodeName,
                        "sandboxes.id" => UniqueOn::SandboxId,
                        "sandboxes.name" => UniqueOn::SandboxName,
                        "moves.id" => UniqueOn::MoveId,
                        "moves.sandbox_id" => UniqueOn::MoveUnfinished,
                        other => UniqueOn::Other(other.to_owned()),
                    });
                }
                FOREIGN_KEY => return Failure::ForeignKey(msg),
                _ => {}
            }
        }
    }
    Failure::Other(DbError::Sqlite(e))
}
