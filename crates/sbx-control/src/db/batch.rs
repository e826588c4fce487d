//! The batches' table: evacuations (`evc-…`) and recoveries (`rcv-…`) of a node, each a set of
//! moves (`moves.batch`). A node has at most one unfinished batch of each kind (a partial
//! unique index on `batches(node_id, kind)` where `ended_at` is null), surfaced as
//! [`DbError::BatchUnderWay`].

use serde::{Deserialize, Serialize};

use super::{move_row, one, Db, DbError, Failure, MoveRow, Row, Val};

/// A batch's kinds.
pub const EVACUATION: &str = "evacuation";
pub const RECOVERY: &str = "recovery";

/// A row of the batches' table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchRow {
    /// `evc-` or `rcv-` and 16 characters.
    pub id: String,
    /// [`EVACUATION`] or [`RECOVERY`].
    pub kind: String,
    /// The node it empties.
    pub node_id: String,
    /// What its last round of placing could not do (a JSON error object), if anything: no node
    /// with room, for one.
    pub error: Option<String>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    /// When it ended (every sandbox of its node has a finished move of it).
    pub ended_at_ms: Option<i64>,
}

/// A new batch id of `kind`: `evc-` or `rcv-` and 16 random characters of
/// `[0-9a-hjkmnp-tv-z]`.
pub fn new_batch_id(kind: &str) -> String {
    sbx_api::ids::new_id(if kind == RECOVERY { "rcv" } else { "evc" })
}

macro_rules! batch_cols {
    () => {
        "id, kind, node_id, error, created_at, updated_at, ended_at"
    };
}

const SQL_INSERT_BATCH: &str = "INSERT INTO batches (id, kind, node_id, error, created_at, \
     updated_at, ended_at) VALUES (?, ?, ?, NULL, @now, @now, NULL)";
const SQL_BATCH: &str = concat!("SELECT ", batch_cols!(), " FROM batches WHERE id = ?");
const SQL_BATCHES: &str = concat!("SELECT ", batch_cols!(), " FROM batches ORDER BY seq");
const SQL_BATCHES_OF_NODE: &str = concat!(
    "SELECT ",
    batch_cols!(),
    " FROM batches WHERE node_id = ? ORDER BY seq"
);
const SQL_UNFINISHED_BATCHES: &str = concat!(
    "SELECT ",
    batch_cols!(),
    " FROM batches WHERE ended_at IS NULL ORDER BY seq"
);
const SQL_UNFINISHED_BATCH_OF: &str = concat!(
    "SELECT ",
    batch_cols!(),
    " FROM batches WHERE node_id = ? AND kind = ? AND ended_at IS NULL"
);
const SQL_END_BATCH: &str = "UPDATE batches SET ended_at = @now, updated_at = @now \
     WHERE id = ? AND ended_at IS NULL";
const SQL_BATCH_ERROR: &str = "UPDATE batches SET error = ?, updated_at = @now WHERE id = ?";
const SQL_MOVES_OF_BATCH: &str = concat!(
    "SELECT ",
    move_cols!(),
    " FROM moves WHERE batch = ? ORDER BY seq"
);

fn batch_row(row: Row) -> Result<BatchRow, DbError> {
    let mut c = super::Cols::new(row);
    Ok(BatchRow {
        id: c.text()?,
        kind: c.text()?,
        node_id: c.text()?,
        error: c.opt_text()?,
        created_at_ms: c.i64()?,
        updated_at_ms: c.i64()?,
        ended_at_ms: c.opt_i64()?,
    })
}

impl Db {
    /// Records a new batch (its times the database's now). [`DbError::BatchUnderWay`] if the
    /// node has an unfinished batch of the same kind; [`DbError::UnknownReference`] if the
    /// node is not in the table.
    pub async fn insert_batch(&self, b: &BatchRow) -> Result<(), DbError> {
        if b.kind != EVACUATION && b.kind != RECOVERY {
            return Err(DbError::Invalid(format!("batch kind {:?}", b.kind)));
        }
        let params = vec![Val::text(&b.id), Val::text(&b.kind), Val::text(&b.node_id)];
        match self.backend.execute(SQL_INSERT_BATCH, params).await {
            Ok(_) => Ok(()),
            Err(Failure::Unique(_)) => match self.unfinished_batch_of(&b.node_id, &b.kind).await? {
                Some(other) => Err(DbError::BatchUnderWay { batch_id: other.id }),
                None => Err(DbError::IdTaken { id: b.id.clone() }),
            },
            Err(f) => Err(f.into()),
        }
    }

    pub async fn batch(&self, id: &str) -> Result<Option<BatchRow>, DbError> {
        let rows = self.backend.query(SQL_BATCH, vec![Val::text(id)]).await?;
        one(rows, batch_row)
    }

    /// The batches of the fleet, or of one node, oldest first.
    pub async fn batches(&self, node_id: Option<&str>) -> Result<Vec<BatchRow>, DbError> {
        let rows = match node_id {
            Some(n) => {
                self.backend
                    .query(SQL_BATCHES_OF_NODE, vec![Val::text(n)])
                    .await?
            }
            None => self.backend.query(SQL_BATCHES, vec![]).await?,
        };
        rows.into_iter().map(batch_row).collect()
    }

    /// The batches not ended, oldest first (what a control plane takes up at its start).
    pub async fn unfinished_batches(&self) -> Result<Vec<BatchRow>, DbError> {
        let rows = self.backend.query(SQL_UNFINISHED_BATCHES, vec![]).await?;
        rows.into_iter().map(batch_row).collect()
    }

    /// The node's batch of `kind` under way, if any.
    pub async fn unfinished_batch_of(
        &self,
        node_id: &str,
        kind: &str,
    ) -> Result<Option<BatchRow>, DbError> {
        let rows = self
            .backend
            .query(
                SQL_UNFINISHED_BATCH_OF,
                vec![Val::text(node_id), Val::text(kind)],
            )
            .await?;
        one(rows, batch_row)
    }

    /// Ends the batch (`ended_at` the database's now); false if it was ended already.
    pub async fn end_batch(&self, id: &str) -> Result<bool, DbError> {
        let n = self
            .backend
            .execute(SQL_END_BATCH, vec![Val::text(id)])
            .await?;
        Ok(n > 0)
    }

    /// Sets (or clears) what the batch's last round could not do.
    pub async fn set_batch_error(&self, id: &str, error: Option<&str>) -> Result<(), DbError> {
        self.backend
            .execute(SQL_BATCH_ERROR, vec![Val::opt_text(error), Val::text(id)])
            .await?;
        Ok(())
    }

    /// The moves of a batch, oldest first.
    pub async fn moves_of_batch(&self, batch_id: &str) -> Result<Vec<MoveRow>, DbError> {
        let rows = self
            .backend
            .query(SQL_MOVES_OF_BATCH, vec![Val::text(batch_id)])
            .await?;
        rows.into_iter().map(move_row).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::tests::{a_move, reg, run_both, sandbox};
    use anyhow::ensure;

    #[test]
    fn a_batch_id_names_its_kind() {
        assert!(sbx_api::ids::is_id("rcv", &new_batch_id(RECOVERY)));
        assert!(sbx_api::ids::is_id("evc", &new_batch_id(EVACUATION)));
    }

    fn batch(kind: &str, node_id: &str) -> BatchRow {
        BatchRow {
            id: new_batch_id(kind),
            kind: kind.into(),
            node_id: node_id.into(),
            error: None,
            created_at_ms: 0,
            updated_at_ms: 0,
            ended_at_ms: None,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn batches_are_one_of_a_kind_a_node_at_a_time() {
        run_both("batches_are_one_of_a_kind_a_node_at_a_time", |url| {
            Box::pin(case(url))
        })
        .await;
    }

    async fn case(url: String) -> anyhow::Result<()> {
        let db = Db::open(&url).await?;
        let a = db.register_node(&reg("a"), 60_000).await?;
        let b = db.register_node(&reg("b"), 60_000).await?;
        let evc = batch(EVACUATION, &a.id);
        db.insert_batch(&evc).await?;
        // One of each kind at a time on a node; another node's is its own.
        match db.insert_batch(&batch(EVACUATION, &a.id)).await {
            Err(DbError::BatchUnderWay { batch_id }) => ensure!(batch_id == evc.id),
            other => anyhow::bail!("a second evacuation: {other:?}"),
        }
        db.insert_batch(&batch(RECOVERY, &a.id)).await?;
        db.insert_batch(&batch(EVACUATION, &b.id)).await?;
        ensure!(matches!(
            db.insert_batch(&batch("other", &a.id)).await,
            Err(DbError::Invalid(_))
        ));
        ensure!(matches!(
            db.insert_batch(&batch(RECOVERY, "nod-nothere")).await,
            Err(DbError::UnknownReference(_))
        ));
        // Its moves.
        let s = sandbox(None, &a.id);
        db.insert_sandbox(&s).await?;
        let mut m = a_move(&s.id, &a.id, &b.id);
        m.batch = Some(evc.id.clone());
        db.insert_move(&m).await?;
        db.insert_move(&a_move(&sandbox_row(&db, &a.id).await?, &a.id, &b.id))
            .await?;
        let moves = db.moves_of_batch(&evc.id).await?;
        ensure!(moves.len() == 1 && moves[0].id == m.id, "{moves:?}");
        ensure!(db.get_move(&m.id).await?.and_then(|m| m.batch) == Some(evc.id.clone()));
        // Read back, listed, ended once.
        let got = db
            .batch(&evc.id)
            .await?
            .ok_or_else(|| anyhow::anyhow!("gone"))?;
        ensure!(got.kind == EVACUATION && got.node_id == a.id && got.ended_at_ms.is_none());
        ensure!(db.batches(Some(&a.id)).await?.len() == 2);
        ensure!(db.batches(None).await?.len() == 3);
        ensure!(db.unfinished_batches().await?.len() == 3);
        db.set_batch_error(&evc.id, Some("{}")).await?;
        ensure!(db.end_batch(&evc.id).await?);
        ensure!(!db.end_batch(&evc.id).await?);
        let got = db
            .batch(&evc.id)
            .await?
            .ok_or_else(|| anyhow::anyhow!("gone"))?;
        ensure!(got.ended_at_ms.is_some() && got.error.as_deref() == Some("{}"));
        ensure!(db.unfinished_batch_of(&a.id, EVACUATION).await?.is_none());
        // Ended: a new one may begin.
        db.insert_batch(&batch(EVACUATION, &a.id)).await?;
        Ok(())
    }

    /// A second sandbox on `node`, its id.
    async fn sandbox_row(db: &Db, node: &str) -> anyhow::Result<String> {
        let s = sandbox(None, node);
        db.insert_sandbox(&s).await?;
        Ok(s.id)
    }
}
