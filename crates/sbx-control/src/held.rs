//! The split-brain check's control-plane side: of the sandboxes a node says it holds (its
//! heartbeat's `held`), those the fleet has elsewhere now (`taken` in the answer).
//!
//! A held sandbox is taken when the table has it on another node, or at a higher epoch than
//! the node holds it at (a recovery put it on another node at E+3 while this node was away),
//! or has no row of it while a move of it is recorded (the fleet had it, and has it on no node
//! now). A sandbox the table never knew (made on the node directly, not through the control
//! plane) is not taken. The node removes its copy of each taken sandbox (its processes killed,
//! its files removed, a tombstone that answers `moved`) before it unfences anything else.

use std::collections::HashMap;

use crate::db::{Db, DbError, HeldSandbox, TakenSandbox};

/// The sandboxes of `held` (the node `node_id`'s) that the fleet has elsewhere now, in the
/// order given.
pub async fn taken(
    db: &Db,
    node_id: &str,
    held: &[HeldSandbox],
) -> Result<Vec<TakenSandbox>, DbError> {
    let mut out = Vec::new();
    let mut names: Option<HashMap<String, String>> = None;
    for h in held {
        let epoch = i64::try_from(h.epoch).unwrap_or(i64::MAX);
        match db.sandbox(&h.id).await? {
            Some(row) => {
                if row.node_id == node_id && row.epoch <= epoch {
                    continue;
                }
                if names.is_none() {
                    names = Some(
                        db.nodes()
                            .await?
                            .into_iter()
                            .map(|n| (n.id, n.name))
                            .collect(),
                    );
                }
                let to = names.as_ref().and_then(|n| n.get(&row.node_id)).cloned();
                out.push(TakenSandbox {
                    id: h.id.clone(),
                    epoch: u64::try_from(row.epoch).unwrap_or(0).max(h.epoch),
                    to,
                });
            }
            None => {
                let moves = db.moves_of(&h.id).await?;
                let Some(last) = moves.iter().map(|m| m.epoch).max() else {
                    continue;
                };
                // No row: no epoch of the table's; one past anything either side knew.
                let after = u64::try_from(last).unwrap_or(0).max(h.epoch) + 1;
                out.push(TakenSandbox {
                    id: h.id.clone(),
                    epoch: after,
                    to: None,
                });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::tests::{a_move, reg, run_both, sandbox};
    use anyhow::ensure;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn held_sandboxes_the_fleet_has_elsewhere_are_taken() {
        run_both("held_sandboxes_the_fleet_has_elsewhere_are_taken", |url| {
            Box::pin(case_taken(url))
        })
        .await;
    }

    fn held(id: &str, epoch: u64) -> HeldSandbox {
        HeldSandbox {
            id: id.into(),
            epoch,
        }
    }

    async fn case_taken(url: String) -> anyhow::Result<()> {
        let db = Db::open(&url).await?;
        let a = db.register_node(&reg("a"), 60_000).await?;
        let b = db.register_node(&reg("b"), 60_000).await?;
        // On a at 1 (its own), on a at 4 (a recovery gave it back to a at E+3), on b at 4
        // (recovered there), and one the table never knew.
        let mut mine = sandbox(None, &a.id);
        mine.epoch = 1;
        let mut higher = sandbox(None, &a.id);
        higher.epoch = 4;
        let mut moved = sandbox(None, &b.id);
        moved.epoch = 4;
        for r in [&mine, &higher, &moved] {
            db.insert_sandbox(r).await?;
        }
        let unknown = sbx_api::ids::new_id("sbx");
        let got = taken(
            &db,
            &a.id,
            &[
                held(&mine.id, 1),
                held(&higher.id, 1),
                held(&moved.id, 1),
                held(&unknown, 1),
            ],
        )
        .await?;
        let want = vec![
            TakenSandbox {
                id: higher.id.clone(),
                epoch: 4,
                to: Some("a".into()),
            },
            TakenSandbox {
                id: moved.id.clone(),
                epoch: 4,
                to: Some("b".into()),
            },
        ];
        ensure!(got == want, "{got:?}");
        // At the table's epoch a node holds its own; b holds the one on it.
        ensure!(taken(&db, &a.id, &[held(&higher.id, 4)]).await?.is_empty());
        ensure!(taken(&db, &b.id, &[held(&moved.id, 4)]).await?.is_empty());
        // A node ahead of the table keeps it (a takeover answered before its row is read).
        ensure!(taken(&db, &a.id, &[held(&mine.id, 2)]).await?.is_empty());
        // A move under way from a (releasing at 1): a still holds it.
        let m = a_move(&mine.id, &a.id, &b.id);
        db.insert_move(&m).await?;
        ensure!(taken(&db, &a.id, &[held(&mine.id, 1)]).await?.is_empty());
        // Nothing held, nothing taken.
        ensure!(taken(&db, &a.id, &[]).await?.is_empty());
        Ok(())
    }
}
