//! The node's state that outlives it: the sandbox table, commands, idempotency records. SQLite
//! in the data directory (WAL), one connection behind a mutex; every call is short.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;

use crate::sync::LockExt;

use rusqlite::{params, Connection, OptionalExtension};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("state database: {0}")]
    Sql(#[from] rusqlite::Error),
    #[error("the state database is in use by another sandboxd (one node per data directory)")]
    InUse,
}

/// A sandbox as the table keeps it.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxRow {
    pub id: String,
    pub name: Option<String>,
    pub status: String,
    /// The create request as the node keeps it (JSON), to remake the machine on restart.
    pub spec: String,
    pub pid: Option<u32>,
    pub start_time: Option<u64>,
    pub created_at_ns: i64,
    pub started_at_ns: Option<i64>,
    pub failure_code: Option<String>,
    pub failure: Option<String>,
    pub restarts: u32,
}

/// A command as the table keeps it (its output is the agent's).
#[derive(Debug, Clone, PartialEq)]
pub struct ExecRow {
    pub sandbox_id: String,
    pub exec_id: String,
    pub command: String,
    pub tty: bool,
    pub encoding: String,
    pub created_at_ns: i64,
    /// The boot of the sandbox it ran in (restarts count up).
    pub boot: u32,
    /// The final exec object, once known (JSON).
    pub final_json: Option<String>,
}

/// A snapshot as the table keeps it: what its sandbox was made with (`spec`, JSON) goes
/// with it, so a sandbox is made from it after its own is gone.
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotRow {
    pub id: String,
    pub name: Option<String>,
    pub sandbox_id: String,
    /// `creating`, `ready`, `failed` or `lost`.
    pub status: String,
    pub size_bytes: u64,
    pub created_at_ns: i64,
    pub spec: String,
}

const SNAPSHOT_COLS: &str = "id, name, sandbox_id, status, size_bytes, created_at_ns, spec";

fn snapshot_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<SnapshotRow> {
    Ok(SnapshotRow {
        id: r.get(0)?,
        name: r.get(1)?,
        sandbox_id: r.get(2)?,
        status: r.get(3)?,
        size_bytes: r.get::<_, i64>(4)?.max(0) as u64,
        created_at_ns: r.get(5)?,
        spec: r.get(6)?,
    })
}

/// What an idempotency key finds.
#[derive(Debug, Clone, PartialEq)]
pub enum IdemBegin {
    /// First use: the caller goes on and records the answer.
    Fresh,
    /// The same request was answered: here is the answer.
    Replay { status: u16, body: String },
    /// The key was used with another request.
    Reused,
    /// The first request with the key is still running.
    InProgress,
}

/// Statements run from the connection's cache of prepared statements.
trait Cached {
    fn run<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize>;
    fn row<T, P, F>(&self, sql: &str, params: P, f: F) -> rusqlite::Result<T>
    where
        P: rusqlite::Params,
        F: FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>;
}

impl Cached for Connection {
    fn run<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize> {
        self.prepare_cached(sql)?.execute(params)
    }

    fn row<T, P, F>(&self, sql: &str, params: P, f: F) -> rusqlite::Result<T>
    where
        P: rusqlite::Params,
        F: FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    {
        self.prepare_cached(sql)?.query_row(params, f)
    }
}

/// A sandbox this node no longer holds: released to another node (its copy kept here,
/// asleep and fenced, until a forget or a take-back) or forgotten (a tombstone). Every call
/// for it answers 409 `moved` with `to` and `epoch`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MovedRow {
    pub id: String,
    /// The epoch it was released at (a tombstone: the forget's).
    pub epoch: u64,
    /// The node it went to, as the control plane names it.
    pub to: Option<String>,
    /// The move that released it (none for a tombstone).
    pub move_id: Option<String>,
    /// The release's answer (JSON), given again to the same move.
    pub answer: Option<String>,
    /// True while its released copy is kept here; false for a tombstone.
    pub kept: bool,
}

pub struct Store {
    conn: Mutex<Connection>,
    /// The table `moved` in memory: every call for a sandbox looks there.
    moved: Mutex<HashMap<String, MovedRow>>,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS sandboxes (
  id TEXT PRIMARY KEY,
  name TEXT UNIQUE,
  status TEXT NOT NULL,
  spec TEXT NOT NULL,
  pid INTEGER,
  start_time INTEGER,
  created_at_ns INTEGER NOT NULL,
  started_at_ns INTEGER,
  failure_code TEXT,
  failure TEXT,
  restarts INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS execs (
  sandbox_id TEXT NOT NULL,
  exec_id TEXT NOT NULL,
  command TEXT NOT NULL,
  tty INTEGER NOT NULL,
  encoding TEXT NOT NULL,
  created_at_ns INTEGER NOT NULL,
  boot INTEGER NOT NULL,
  final_json TEXT,
  PRIMARY KEY (sandbox_id, exec_id)
);
CREATE TABLE IF NOT EXISTS snapshots (
  id TEXT PRIMARY KEY,
  name TEXT UNIQUE,
  sandbox_id TEXT NOT NULL,
  status TEXT NOT NULL,
  size_bytes INTEGER NOT NULL DEFAULT 0,
  created_at_ns INTEGER NOT NULL,
  spec TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS moved (
  id TEXT PRIMARY KEY,
  epoch INTEGER NOT NULL,
  to_node TEXT,
  move_id TEXT,
  answer TEXT,
  kept INTEGER NOT NULL,
  at_ns INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS idempotency (
  scope TEXT NOT NULL,
  key TEXT NOT NULL,
  body_hash TEXT NOT NULL,
  status INTEGER,
  body TEXT,
  created_at_ns INTEGER NOT NULL,
  PRIMARY KEY (scope, key)
);
";

fn sandbox_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<SandboxRow> {
    Ok(SandboxRow {
        id: r.get(0)?,
        name: r.get(1)?,
        status: r.get(2)?,
        spec: r.get(3)?,
        pid: r.get(4)?,
        start_time: r.get::<_, Option<i64>>(5)?.map(|v| v as u64),
        created_at_ns: r.get(6)?,
        started_at_ns: r.get(7)?,
        failure_code: r.get(8)?,
        failure: r.get(9)?,
        restarts: r.get(10)?,
    })
}

const SANDBOX_COLS: &str = "id, name, status, spec, pid, start_time, created_at_ns, started_at_ns, failure_code, failure, restarts";

fn put_moved(c: &Connection, row: &MovedRow) -> rusqlite::Result<()> {
    c.run(
        "INSERT OR REPLACE INTO moved (id, epoch, to_node, move_id, answer, kept, at_ns) VALUES (?1,?2,?3,?4,?5,?6,?7)",
        params![
            row.id,
            i64::try_from(row.epoch).unwrap_or(i64::MAX),
            row.to,
            row.move_id,
            row.answer,
            row.kept,
            crate::image::now_ns() as i64
        ],
    )
    .map(|_| ())
}

fn read_moved(c: &Connection) -> rusqlite::Result<HashMap<String, MovedRow>> {
    let mut st = c.prepare("SELECT id, epoch, to_node, move_id, answer, kept FROM moved")?;
    let rows = st.query_map([], |r| {
        Ok(MovedRow {
            id: r.get(0)?,
            epoch: r.get::<_, i64>(1)?.max(0) as u64,
            to: r.get(2)?,
            move_id: r.get(3)?,
            answer: r.get(4)?,
            kept: r.get(5)?,
        })
    })?;
    rows.map(|r| r.map(|m| (m.id.clone(), m))).collect()
}

fn exec_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<ExecRow> {
    Ok(ExecRow {
        sandbox_id: r.get(0)?,
        exec_id: r.get(1)?,
        command: r.get(2)?,
        tty: r.get(3)?,
        encoding: r.get(4)?,
        created_at_ns: r.get(5)?,
        boot: r.get(6)?,
        final_json: r.get(7)?,
    })
}

const EXEC_COLS: &str =
    "sandbox_id, exec_id, command, tty, encoding, created_at_ns, boot, final_json";

impl Store {
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        Store::open_locked(path).map_err(|e| match e {
            StoreError::Sql(ref s)
                if s.sqlite_error_code() == Some(rusqlite::ErrorCode::DatabaseBusy) =>
            {
                StoreError::InUse
            }
            e => e,
        })
    }

    fn open_locked(path: &Path) -> Result<Store, StoreError> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(std::time::Duration::from_secs(2))?;
        // The node is the database's only user: it holds the lock for as long as it runs (no
        // file lock taken and released per statement, the WAL index in memory), and a second
        // node on the same data directory is refused instead of sharing it.
        conn.pragma_update(None, "locking_mode", "EXCLUSIVE")?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        // Taken now, not at the first write: a second node stops here.
        conn.execute_batch("BEGIN EXCLUSIVE; COMMIT;")?;
        // Every statement of the store is kept prepared: a command's rows are written without
        // parsing SQL again.
        conn.set_prepared_statement_cache_capacity(64);
        conn.execute_batch(SCHEMA)?;
        // Added after the first schema: whether a command's stdin is closed (a database of an
        // older node gets the column, its rows open).
        let has_stdin_closed = conn
            .prepare("SELECT 1 FROM pragma_table_info('execs') WHERE name='stdin_closed'")?
            .exists([])?;
        if !has_stdin_closed {
            conn.execute_batch(
                "ALTER TABLE execs ADD COLUMN stdin_closed INTEGER NOT NULL DEFAULT 0",
            )?;
        }
        // Added for the fleet: the epoch a sandbox is held at (1 until it moves).
        let has_epoch = conn
            .prepare("SELECT 1 FROM pragma_table_info('sandboxes') WHERE name='epoch'")?
            .exists([])?;
        if !has_epoch {
            conn.execute_batch(
                "ALTER TABLE sandboxes ADD COLUMN epoch INTEGER NOT NULL DEFAULT 1",
            )?;
        }
        let moved = read_moved(&conn)?;
        Ok(Store {
            conn: Mutex::new(conn),
            moved: Mutex::new(moved),
        })
    }

    /// What the node keeps of sandbox `id` that it released or forgot (none: it holds it, or
    /// never had it).
    pub fn moved(&self, id: &str) -> Option<MovedRow> {
        self.moved.locked().get(id).cloned()
    }

    /// Whether sandbox `id` is released or forgotten here.
    pub(crate) fn is_moved(&self, id: &str) -> bool {
        self.moved.locked().contains_key(id)
    }

    /// Records sandbox `id` released (its copy kept, fenced): from now on it is not this
    /// node's.
    pub(crate) fn set_released(&self, row: &MovedRow) -> Result<(), StoreError> {
        self.with(|c| put_moved(c, row))?;
        self.moved.locked().insert(row.id.clone(), row.clone());
        Ok(())
    }

    /// Removes sandbox `id`'s rows (and its commands') and records its tombstone `row`, at
    /// once.
    pub fn forget_sandbox(&self, row: &MovedRow) -> Result<(), StoreError> {
        self.with(|c| {
            let tx = c.unchecked_transaction()?;
            tx.run("DELETE FROM execs WHERE sandbox_id=?1", params![row.id])?;
            tx.run("DELETE FROM sandboxes WHERE id=?1", params![row.id])?;
            put_moved(&tx, row)?;
            tx.commit()
        })?;
        self.moved.locked().insert(row.id.clone(), row.clone());
        Ok(())
    }

    /// Takes released sandbox `id` back (a reclaim): held again at `epoch`, no longer fenced,
    /// at once.
    pub(crate) fn unfence(&self, id: &str, epoch: u64) -> Result<(), StoreError> {
        let epoch = i64::try_from(epoch).unwrap_or(i64::MAX);
        self.with(|c| {
            let tx = c.unchecked_transaction()?;
            tx.run(
                "UPDATE sandboxes SET epoch=?2 WHERE id=?1",
                params![id, epoch],
            )?;
            tx.run("DELETE FROM moved WHERE id=?1", params![id])?;
            tx.commit()
        })?;
        self.moved.locked().remove(id);
        Ok(())
    }

    /// The epoch sandbox `id` is held at (1 for one that is not in the table).
    pub(crate) fn sandbox_epoch(&self, id: &str) -> Result<u64, StoreError> {
        self.with(|c| {
            c.row(
                "SELECT epoch FROM sandboxes WHERE id=?1",
                params![id],
                |r| r.get::<_, i64>(0),
            )
            .optional()
            .map(|e| e.map_or(1, |e| e.max(0) as u64))
        })
    }

    /// Sets the epoch sandbox `id` is held at (a takeover's).
    pub(crate) fn set_sandbox_epoch(&self, id: &str, epoch: u64) -> Result<(), StoreError> {
        let epoch = i64::try_from(epoch).unwrap_or(i64::MAX);
        self.with(|c| {
            c.run(
                "UPDATE sandboxes SET epoch=?2 WHERE id=?1",
                params![id, epoch],
            )
            .map(|_| ())
        })
    }

    fn with<T>(&self, f: impl FnOnce(&Connection) -> rusqlite::Result<T>) -> Result<T, StoreError> {
        // A panic inside `f` unwound through any open Transaction (its drop rolls back).
        let c = self.conn.locked();
        Ok(f(&c)?)
    }

    pub fn insert_sandbox(&self, s: &SandboxRow) -> Result<(), StoreError> {
        self.with(|c| {
            c.run(
                &format!("INSERT INTO sandboxes ({SANDBOX_COLS}) VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11)"),
                params![
                    s.id,
                    s.name,
                    s.status,
                    s.spec,
                    s.pid,
                    s.start_time.map(|v| v as i64),
                    s.created_at_ns,
                    s.started_at_ns,
                    s.failure_code,
                    s.failure,
                    s.restarts
                ],
            )
            .map(|_| ())
        })
    }

    /// Writes a sandbox's changing fields.
    pub fn update_sandbox(&self, s: &SandboxRow) -> Result<(), StoreError> {
        self.with(|c| {
            c.run(
                "UPDATE sandboxes SET status=?2, pid=?3, start_time=?4, started_at_ns=?5, failure_code=?6, failure=?7, restarts=?8 WHERE id=?1",
                params![
                    s.id,
                    s.status,
                    s.pid,
                    s.start_time.map(|v| v as i64),
                    s.started_at_ns,
                    s.failure_code,
                    s.failure,
                    s.restarts
                ],
            )
            .map(|_| ())
        })
    }

    /// Writes a sandbox's spec (a PATCH of its rules).
    pub(crate) fn update_sandbox_spec(&self, id: &str, spec: &str) -> Result<(), StoreError> {
        self.with(|c| {
            c.run(
                "UPDATE sandboxes SET spec=?2 WHERE id=?1",
                params![id, spec],
            )
            .map(|_| ())
        })
    }

    /// Removes a sandbox and its commands.
    pub fn delete_sandbox(&self, id: &str) -> Result<(), StoreError> {
        self.with(|c| {
            c.run("DELETE FROM execs WHERE sandbox_id=?1", params![id])?;
            c.run("DELETE FROM sandboxes WHERE id=?1", params![id])
                .map(|_| ())
        })
    }

    pub fn sandboxes(&self) -> Result<Vec<SandboxRow>, StoreError> {
        self.with(|c| {
            let mut st = c.prepare_cached(&format!(
                "SELECT {SANDBOX_COLS} FROM sandboxes ORDER BY created_at_ns, id"
            ))?;
            let rows = st.query_map([], sandbox_row)?;
            rows.collect()
        })
    }

    pub(crate) fn insert_snapshot(&self, s: &SnapshotRow) -> Result<(), StoreError> {
        self.with(|c| {
            c.run(
                &format!("INSERT INTO snapshots ({SNAPSHOT_COLS}) VALUES (?1,?2,?3,?4,?5,?6,?7)"),
                params![
                    s.id,
                    s.name,
                    s.sandbox_id,
                    s.status,
                    s.size_bytes as i64,
                    s.created_at_ns,
                    s.spec
                ],
            )
            .map(|_| ())
        })
    }

    pub fn delete_snapshot(&self, id: &str) -> Result<(), StoreError> {
        self.with(|c| {
            c.run("DELETE FROM snapshots WHERE id=?1", params![id])
                .map(|_| ())
        })
    }

    pub fn snapshots(&self) -> Result<Vec<SnapshotRow>, StoreError> {
        self.with(|c| {
            let mut st = c.prepare_cached(&format!(
                "SELECT {SNAPSHOT_COLS} FROM snapshots ORDER BY created_at_ns, id"
            ))?;
            let rows = st.query_map([], snapshot_row)?;
            rows.collect()
        })
    }

    /// Records a command (one statement: its stdin already closed or not).
    pub(crate) fn insert_exec(&self, e: &ExecRow, stdin_closed: bool) -> Result<(), StoreError> {
        self.with(|c| {
            c.run(
                &format!(
                    "INSERT INTO execs ({EXEC_COLS}, stdin_closed) VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9)"
                ),
                params![
                    e.sandbox_id,
                    e.exec_id,
                    e.command,
                    e.tty,
                    e.encoding,
                    e.created_at_ns,
                    e.boot,
                    e.final_json,
                    stdin_closed
                ],
            )
            .map(|_| ())
        })
    }

    pub(crate) fn set_exec_final(
        &self,
        sandbox_id: &str,
        exec_id: &str,
        json: &str,
    ) -> Result<(), StoreError> {
        self.with(|c| {
            c.run(
                "UPDATE execs SET final_json=?3 WHERE sandbox_id=?1 AND exec_id=?2",
                params![sandbox_id, exec_id, json],
            )
            .map(|_| ())
        })
    }

    /// Records that a command's stdin is closed: later input is refused, not lost.
    pub(crate) fn close_exec_stdin(
        &self,
        sandbox_id: &str,
        exec_id: &str,
    ) -> Result<(), StoreError> {
        self.with(|c| {
            c.run(
                "UPDATE execs SET stdin_closed=1 WHERE sandbox_id=?1 AND exec_id=?2",
                params![sandbox_id, exec_id],
            )
            .map(|_| ())
        })
    }

    /// Whether a command's stdin is closed (false for a command the table does not have).
    pub(crate) fn exec_stdin_closed(
        &self,
        sandbox_id: &str,
        exec_id: &str,
    ) -> Result<bool, StoreError> {
        self.with(|c| {
            c.row(
                "SELECT stdin_closed FROM execs WHERE sandbox_id=?1 AND exec_id=?2",
                params![sandbox_id, exec_id],
                |r| r.get::<_, bool>(0),
            )
            .optional()
            .map(|v| v.unwrap_or(false))
        })
    }

    /// Forgets a command (the start command of an earlier boot, which a restart starts again).
    pub(crate) fn delete_exec(&self, sandbox_id: &str, exec_id: &str) -> Result<(), StoreError> {
        self.with(|c| {
            c.run(
                "DELETE FROM execs WHERE sandbox_id=?1 AND exec_id=?2",
                params![sandbox_id, exec_id],
            )
            .map(|_| ())
        })
    }

    pub fn exec(&self, sandbox_id: &str, exec_id: &str) -> Result<Option<ExecRow>, StoreError> {
        self.with(|c| {
            c.row(
                &format!("SELECT {EXEC_COLS} FROM execs WHERE sandbox_id=?1 AND exec_id=?2"),
                params![sandbox_id, exec_id],
                exec_row,
            )
            .optional()
        })
    }

    pub fn execs(&self, sandbox_id: &str) -> Result<Vec<ExecRow>, StoreError> {
        self.with(|c| {
            let mut st = c.prepare_cached(&format!(
                "SELECT {EXEC_COLS} FROM execs WHERE sandbox_id=?1 ORDER BY created_at_ns, exec_id"
            ))?;
            let rows = st.query_map(params![sandbox_id], exec_row)?;
            rows.collect()
        })
    }

    /// Starts a request with an idempotency key.
    pub fn idem_begin(&self, scope: &str, key: &str, hash: &str) -> Result<IdemBegin, StoreError> {
        self.with(|c| {
            let found: Option<(String, Option<u16>, Option<String>)> = c
                .query_row(
                    "SELECT body_hash, status, body FROM idempotency WHERE scope=?1 AND key=?2",
                    params![scope, key],
                    |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
                )
                .optional()?;
            match found {
                None => {
                    c.run(
                        "INSERT INTO idempotency (scope, key, body_hash, created_at_ns) VALUES (?1,?2,?3,?4)",
                        params![scope, key, hash, crate::image::now_ns() as i64],
                    )?;
                    Ok(IdemBegin::Fresh)
                }
                Some((h, _, _)) if h != hash => Ok(IdemBegin::Reused),
                Some((_, Some(status), Some(body))) => Ok(IdemBegin::Replay { status, body }),
                Some(_) => Ok(IdemBegin::InProgress),
            }
        })
    }

    /// Records the answer of a request with a key.
    pub fn idem_finish(
        &self,
        scope: &str,
        key: &str,
        status: u16,
        body: &str,
    ) -> Result<(), StoreError> {
        self.with(|c| {
            c.run(
                "UPDATE idempotency SET status=?3, body=?4 WHERE scope=?1 AND key=?2",
                params![scope, key, status, body],
            )
            .map(|_| ())
        })
    }

    /// Forgets a key whose request failed in a way worth trying again.
    pub fn idem_forget(&self, scope: &str, key: &str) -> Result<(), StoreError> {
        self.with(|c| {
            c.run(
                "DELETE FROM idempotency WHERE scope=?1 AND key=?2",
                params![scope, key],
            )
            .map(|_| ())
        })
    }

    /// At start: requests that were running when the node stopped will never finish; records
    /// older than a day are dropped.
    pub fn idem_tidy(&self) -> Result<(), StoreError> {
        let day_ago = crate::image::now_ns() as i64 - 86_400_000_000_000;
        self.with(|c| {
            c.run("DELETE FROM idempotency WHERE status IS NULL", [])?;
            c.run(
                "DELETE FROM idempotency WHERE created_at_ns < ?1",
                params![day_ago],
            )
            .map(|_| ())
        })
    }
}

impl Store {
    /// Runs `f` on the connection, for the tables of other modules (`node/credentials.rs`).
    pub fn with_conn<T>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T>,
    ) -> Result<T, StoreError> {
        self.with(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_node_per_database_and_the_next_after_it() {
        let dir = std::env::temp_dir().join(format!("sbx-store-lock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("state.db");
        let first = Store::open(&path).unwrap();
        first
            .insert_sandbox(&SandboxRow {
                id: "sbx-kept".into(),
                name: None,
                status: "running".into(),
                spec: "{}".into(),
                pid: None,
                start_time: None,
                created_at_ns: 1,
                started_at_ns: None,
                failure_code: None,
                failure: None,
                restarts: 0,
            })
            .unwrap();
        let second = Store::open(&path);
        assert!(
            matches!(second, Err(StoreError::InUse)),
            "a second store opened a held database: {:?}",
            second.err()
        );
        drop(first);
        let next = Store::open(&path).unwrap();
        assert_eq!(
            next.sandboxes().unwrap().len(),
            1,
            "the first one's rows are there"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn released_and_forgotten_sandboxes_outlive_the_node() {
        let dir = std::env::temp_dir().join(format!("sbx-store-moved-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("state.db");
        let s = Store::open(&path).unwrap();
        let row = |id: &str| SandboxRow {
            id: id.into(),
            name: None,
            status: "sleeping".into(),
            spec: "{}".into(),
            pid: None,
            start_time: None,
            created_at_ns: 1,
            started_at_ns: None,
            failure_code: None,
            failure: None,
            restarts: 0,
        };
        s.insert_sandbox(&row("sbx-a")).unwrap();
        s.insert_sandbox(&row("sbx-b")).unwrap();
        s.insert_exec(
            &ExecRow {
                sandbox_id: "sbx-b".into(),
                exec_id: "exe-1".into(),
                command: "ls".into(),
                tty: false,
                encoding: "utf8".into(),
                created_at_ns: 3,
                boot: 0,
                final_json: None,
            },
            false,
        )
        .unwrap();
        let released = MovedRow {
            id: "sbx-a".into(),
            epoch: 3,
            to: Some("b".into()),
            move_id: Some("mov-1".into()),
            answer: Some("{}".into()),
            kept: true,
        };
        s.set_released(&released).unwrap();
        let tomb = MovedRow {
            id: "sbx-b".into(),
            epoch: 2,
            to: None,
            move_id: None,
            answer: None,
            kept: false,
        };
        s.forget_sandbox(&tomb).unwrap();
        assert!(
            s.exec("sbx-b", "exe-1").unwrap().is_none(),
            "its commands go"
        );
        assert!(!s.is_moved("sbx-c"));
        drop(s);
        let s = Store::open(&path).unwrap();
        assert_eq!(s.moved("sbx-a"), Some(released));
        assert_eq!(s.moved("sbx-b"), Some(tomb));
        let ids: Vec<String> = s.sandboxes().unwrap().into_iter().map(|r| r.id).collect();
        assert_eq!(ids, vec!["sbx-a".to_string()], "a forgotten row goes");
        // Taken back: held again at the new epoch, no longer moved, also after a restart.
        s.unfence("sbx-a", 5).unwrap();
        assert!(!s.is_moved("sbx-a"));
        drop(s);
        let s = Store::open(&path).unwrap();
        assert!(!s.is_moved("sbx-a"));
        assert_eq!(s.sandbox_epoch("sbx-a").unwrap(), 5);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn sandboxes_execs_and_keys() {
        let dir = std::env::temp_dir().join(format!("sbx-store-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let s = Store::open(&dir.join("state.db")).unwrap();
        let mut row = SandboxRow {
            id: "sbx-a".into(),
            name: Some("a".into()),
            status: "running".into(),
            spec: "{}".into(),
            pid: Some(5),
            start_time: Some(7),
            created_at_ns: 1,
            started_at_ns: Some(2),
            failure_code: None,
            failure: None,
            restarts: 0,
        };
        s.insert_sandbox(&row).unwrap();
        assert!(s.insert_sandbox(&row).is_err(), "ids are unique");
        row.status = "failed".into();
        s.update_sandbox(&row).unwrap();
        assert_eq!(s.sandboxes().unwrap(), vec![row.clone()]);
        let e = ExecRow {
            sandbox_id: "sbx-a".into(),
            exec_id: "exe-1".into(),
            command: "ls".into(),
            tty: false,
            encoding: "utf8".into(),
            created_at_ns: 3,
            boot: 0,
            final_json: None,
        };
        s.insert_exec(&e, false).unwrap();
        s.set_exec_final("sbx-a", "exe-1", "{}").unwrap();
        assert_eq!(
            s.execs("sbx-a").unwrap()[0].final_json.as_deref(),
            Some("{}")
        );
        s.delete_sandbox("sbx-a").unwrap();
        assert!(s.sandboxes().unwrap().is_empty());
        assert!(s.exec("sbx-a", "exe-1").unwrap().is_none());

        assert_eq!(
            s.idem_begin("POST /x", "k", "h1").unwrap(),
            IdemBegin::Fresh
        );
        assert_eq!(
            s.idem_begin("POST /x", "k", "h1").unwrap(),
            IdemBegin::InProgress
        );
        assert_eq!(
            s.idem_begin("POST /x", "k", "h2").unwrap(),
            IdemBegin::Reused
        );
        s.idem_finish("POST /x", "k", 201, "{\"id\":1}").unwrap();
        assert_eq!(
            s.idem_begin("POST /x", "k", "h1").unwrap(),
            IdemBegin::Replay {
                status: 201,
                body: "{\"id\":1}".into()
            }
        );
        assert_eq!(
            s.idem_begin("POST /y", "k", "h2").unwrap(),
            IdemBegin::Fresh
        );
        s.idem_tidy().unwrap();
        assert_eq!(
            s.idem_begin("POST /y", "k", "h3").unwrap(),
            IdemBegin::Fresh
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}
