//! The control plane's own lease (`control_lease`, one row, migration step 4) and the fence of
//! every write by its term.
//!
//! One control plane of those sharing a database is active: the one that holds the row's lease
//! (`holder`, `url`, `term`, `lease_until` by the database's clock). Taking it bumps the term
//! ([`Db::take_lease`]); the holder renews it ([`Db::renew_lease`]) by compare-and-set on its
//! term and name. A handle that took part in the lease ([`Db::fence_writes`], or a take) is
//! *fenced*: every statement of it that changes rows (every `Backend::execute`, and every
//! `Backend::query` of an INSERT, UPDATE, DELETE or a RETURNING) runs in one transaction with
//! a read of the row's term (PostgreSQL: `FOR SHARE`, so that a take waits for it; SQLite:
//! `BEGIN IMMEDIATE`), and is refused with [`DbError::Deposed`] where the term is no longer
//! this handle's, or where it has none (a standby, or a control plane not yet active). A handle
//! that never took part (tests, tools) writes unfenced, as before the lease.

use std::sync::atomic::{AtomicI64, Ordering};

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use super::{Cols, Db, DbError, Row, Val};

/// The fence of a backend's writes.
pub(super) struct Fence {
    /// [`OPEN`], [`NO_TERM`], or the term this handle holds (terms start at 1).
    term: AtomicI64,
    /// Notified when a write or a renewal found the term gone.
    lost: Notify,
}

/// Writes are not fenced (the handle never took part in the lease).
const OPEN: i64 = -1;
/// Writes are refused: the handle holds no term.
const NO_TERM: i64 = 0;

/// What a write is to be fenced by.
pub(super) enum Guard {
    /// Nothing: the handle is not fenced.
    Open,
    /// The lease's term must still be this.
    Term(i64),
}

impl Default for Fence {
    fn default() -> Fence {
        Fence {
            term: AtomicI64::new(OPEN),
            lost: Notify::new(),
        }
    }
}

impl Fence {
    /// What a write must be fenced by now; `None` where it is refused (no term).
    pub(super) fn guard(&self) -> Option<Guard> {
        match self.term.load(Ordering::SeqCst) {
            OPEN => Some(Guard::Open),
            t if t > 0 => Some(Guard::Term(t)),
            _ => None,
        }
    }

    /// A write or a renewal found `term` gone: writes are refused from now on (unless the
    /// handle holds a newer term meanwhile), and whoever waits on [`Db::deposed`] is woken.
    pub(super) fn lost(&self, term: i64) {
        if self
            .term
            .compare_exchange(term, NO_TERM, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            self.lost.notify_one();
        }
    }
}

/// The read of the row a fenced write runs after, in its transaction (PostgreSQL adds `FOR
/// SHARE`).
pub(super) const SQL_LEASE_TERM: &str = "SELECT term, holder, url FROM control_lease WHERE id = 1";

/// The copy a fenced write found holding the lease: the answer of a refused write.
pub(super) fn deposed(found_term: i64, holder: String, url: String) -> DbError {
    DbError::Deposed {
        active: (found_term > 0 && !holder.is_empty()).then_some(LeaseHolder {
            name: holder,
            url,
            term: found_term,
        }),
    }
}

/// The copy that holds (or held last) the control plane's lease: the spec's `active`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseHolder {
    pub name: String,
    pub url: String,
    pub term: i64,
}

/// The row of the control plane's lease, as read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControlLease {
    /// The name of the copy that took it last; empty before any did.
    pub holder: String,
    pub url: String,
    /// 0 before any copy took it; each take adds one.
    pub term: i64,
    pub lease_until_ms: i64,
    /// The database's now at the read.
    pub now_ms: i64,
}

impl ControlLease {
    /// Whether a copy holds it now (by the database's clock).
    pub fn held(&self) -> bool {
        self.term > 0 && !self.holder.is_empty() && self.lease_until_ms >= self.now_ms
    }

    /// The copy that holds it now; `None` while none does.
    pub fn active(&self) -> Option<LeaseHolder> {
        self.held().then(|| LeaseHolder {
            name: self.holder.clone(),
            url: self.url.clone(),
            term: self.term,
        })
    }
}

const SQL_LEASE: &str = "SELECT holder, url, term, lease_until, @now FROM control_lease \
     WHERE id = 1";
/// A take: where the lease ran out, or the copy of this name held it (it lost its term by its
/// own clock and takes it again), or forced (SQLite: the file's lock says no other copy runs).
const SQL_TAKE_LEASE: &str = "UPDATE control_lease SET holder = ?, url = ?, term = term + 1, \
     lease_until = @now + ?, taken_at = @now \
     WHERE id = 1 AND (? OR lease_until < @now OR holder = ?) \
     RETURNING holder, url, term, lease_until, @now";
const SQL_RENEW_LEASE: &str = "UPDATE control_lease SET lease_until = @now + ?, url = ? \
     WHERE id = 1 AND term = ? AND holder = ? \
     RETURNING holder, url, term, lease_until, @now";
const SQL_RELEASE_LEASE: &str = "UPDATE control_lease SET lease_until = @now - 1 \
     WHERE id = 1 AND term = ? AND holder = ?";

fn lease_row(row: Row) -> Result<ControlLease, DbError> {
    let mut c = Cols::new(row);
    Ok(ControlLease {
        holder: c.text()?,
        url: c.text()?,
        term: c.i64()?,
        lease_until_ms: c.i64()?,
        now_ms: c.i64()?,
    })
}

impl Db {
    /// From now on this handle's writes are fenced by the lease's term: refused until it takes
    /// the lease (a control plane just started writes nothing before it is active).
    pub fn fence_writes(&self) {
        let _ = self.backend.fence.term.compare_exchange(
            OPEN,
            NO_TERM,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
    }

    /// The term this handle holds; `None` while it holds none (or is not fenced).
    pub fn term(&self) -> Option<i64> {
        Some(self.backend.fence.term.load(Ordering::SeqCst)).filter(|t| *t > 0)
    }

    /// Whether this handle's writes are taken now: it holds a term, or it is not fenced.
    pub fn writable(&self) -> bool {
        self.backend.fence.guard().is_some()
    }

    /// Waits until a write or a renewal of this handle finds its term gone (it may have taken
    /// a newer one since: compare [`Db::term`]).
    pub async fn deposed(&self) {
        self.backend.fence.lost.notified().await;
    }

    /// Gives up `term` here (the database is not told: see [`Db::release_lease`]): writes are
    /// refused from now on.
    pub fn step_down(&self, term: i64) {
        self.backend.fence.lost(term);
    }

    /// The lease's row as it is now.
    pub async fn control_lease(&self) -> Result<ControlLease, DbError> {
        let rows = self.backend.query_unfenced(SQL_LEASE, vec![]).await?;
        let row = rows
            .into_iter()
            .next()
            .ok_or_else(|| DbError::Corrupt("the control_lease row is missing".into()))?;
        lease_row(row)
    }

    /// Takes the lease for `lease_ms` (the database's clock) as `holder` reached at `url`,
    /// where it ran out or `holder` held it (or `force`: whoever holds it), with the term one
    /// on: this handle's writes are fenced by it from now on. `None` where another copy holds
    /// it.
    pub async fn take_lease(
        &self,
        holder: &str,
        url: &str,
        lease_ms: i64,
        force: bool,
    ) -> Result<Option<ControlLease>, DbError> {
        let params = vec![
            Val::text(holder),
            Val::text(url),
            Val::I64(lease_ms),
            Val::Bool(force),
            Val::text(holder),
        ];
        let rows = self.backend.query_unfenced(SQL_TAKE_LEASE, params).await?;
        let Some(row) = rows.into_iter().next() else {
            return Ok(None);
        };
        let lease = lease_row(row)?;
        self.backend.fence.term.store(lease.term, Ordering::SeqCst);
        Ok(Some(lease))
    }

    /// Renews the lease this handle holds for `lease_ms` more (from the database's now), by
    /// compare-and-set on its term and `holder`. `None` where it holds none, or another copy
    /// took it (the handle's writes are refused from now on).
    pub async fn renew_lease(
        &self,
        holder: &str,
        url: &str,
        lease_ms: i64,
    ) -> Result<Option<ControlLease>, DbError> {
        let Some(term) = self.term() else {
            return Ok(None);
        };
        let params = vec![
            Val::I64(lease_ms),
            Val::text(url),
            Val::I64(term),
            Val::text(holder),
        ];
        let rows = self.backend.query_unfenced(SQL_RENEW_LEASE, params).await?;
        match rows.into_iter().next() {
            Some(row) => lease_row(row).map(Some),
            None => {
                self.backend.fence.lost(term);
                Ok(None)
            }
        }
    }

    /// Gives the lease up (a control plane that stops): writes are refused from now on, and
    /// the lease runs out at once, so that a standby takes it at its next try. False where
    /// this handle did not hold it.
    pub async fn release_lease(&self, holder: &str) -> Result<bool, DbError> {
        let Some(term) = self.term() else {
            return Ok(false);
        };
        self.backend.fence.lost(term);
        let n = self
            .backend
            .execute_unfenced(SQL_RELEASE_LEASE, vec![Val::I64(term), Val::text(holder)])
            .await?;
        Ok(n > 0)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use anyhow::{bail, ensure, Context};

    use crate::db::tests::{a_move, reg, run_both, sandbox};
    use crate::db::{Db, DbError, LeaseHolder};

    /// The copy a refused write named, or why it was not refused.
    fn refused<T: std::fmt::Debug>(r: Result<T, DbError>) -> anyhow::Result<Option<LeaseHolder>> {
        match r {
            Err(DbError::Deposed { active }) => Ok(active),
            other => bail!("not refused as deposed: {other:?}"),
        }
    }

    fn named(a: Option<LeaseHolder>, name: &str, term: i64) -> anyhow::Result<()> {
        let a = a.context("no active copy named")?;
        ensure!(
            a.name == name && a.term == term && a.url == format!("http://{name}"),
            "{a:?}"
        );
        Ok(())
    }

    #[test]
    fn writes_are_told_from_reads() {
        use crate::db::changes_rows;
        for w in [
            super::super::SQL_INSERT_SANDBOX,
            super::super::SQL_MOVE_OWNER,
            super::super::SQL_DELETE_SANDBOX,
            super::super::SQL_REGISTER,
            super::super::SQL_HEARTBEAT,
            "  update x set a = 1",
            "WITH a AS (SELECT 1) DELETE FROM x",
        ] {
            assert!(changes_rows(w), "{w}");
        }
        for r in [
            super::super::SQL_NOW,
            super::super::SQL_SANDBOXES,
            super::super::SQL_UNFINISHED_MOVES,
            super::SQL_LEASE,
            "WITH a AS (SELECT 1) SELECT * FROM a",
        ] {
            assert!(!changes_rows(r), "{r}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn one_copy_holds_the_lease_and_a_deposed_one_writes_nothing() {
        run_both("one_copy_holds_the_lease", |url| Box::pin(case_lease(url))).await;
    }

    /// Two handles on one database, as two control planes: A takes the lease, B cannot until
    /// it runs out; B takes it then (term 2), and A's writes (a move's step, a sandbox's owner,
    /// a new sandbox) are refused with `Deposed` naming B, A's term gone, nothing written.
    async fn case_lease(url: String) -> anyhow::Result<()> {
        let a = Db::open(&url).await?;
        let b = Db::open(&url).await?;
        let l = a.control_lease().await?;
        ensure!(
            l.term == 0 && l.holder.is_empty() && l.active().is_none(),
            "{l:?}"
        );
        // Not fenced yet (tests, tools): writes as before.
        let n1 = a.register_node(&reg("alpha"), 60_000).await?;
        let n2 = a.register_node(&reg("beta"), 60_000).await?;
        let s1 = sandbox(None, &n1.id);
        a.insert_sandbox(&s1).await?;
        a.fence_writes();
        b.fence_writes();
        ensure!(!a.writable() && a.term().is_none());
        // No term: nothing written, no copy named.
        ensure!(refused(a.insert_sandbox(&sandbox(None, &n1.id)).await)?.is_none());
        ensure!(refused(a.set_draining(&n1.id, true).await)?.is_none());

        let la = a
            .take_lease("cp-a", "http://cp-a", 1500, false)
            .await?
            .context("A takes the free lease")?;
        ensure!(la.term == 1 && la.held() && a.term() == Some(1), "{la:?}");
        ensure!(a.writable());
        ensure!(
            b.take_lease("cp-b", "http://cp-b", 1500, false)
                .await?
                .is_none(),
            "B took a lease A holds"
        );
        // A writes; B's writes are refused, naming A.
        let mv = a_move(&s1.id, &n1.id, &n2.id);
        a.insert_move(&mv).await?;
        named(
            refused(b.insert_sandbox(&sandbox(None, &n1.id)).await)?,
            "cp-a",
            1,
        )?;
        let renewed = a
            .renew_lease("cp-a", "http://cp-a", 1500)
            .await?
            .context("A renews")?;
        ensure!(renewed.term == 1 && renewed.lease_until_ms >= la.lease_until_ms);
        ensure!(b
            .take_lease("cp-b", "http://cp-b", 1500, false)
            .await?
            .is_none());

        // Until the lease runs out by the database's clock: then B takes it.
        let lb = loop {
            let now = b.now_ms().await?;
            if let Some(l) = b.take_lease("cp-b", "http://cp-b", 60_000, false).await? {
                ensure!(
                    now >= renewed.lease_until_ms - 50,
                    "B took it at {now}, before {} ran out",
                    renewed.lease_until_ms
                );
                break l;
            }
            ensure!(
                now < renewed.lease_until_ms + 5_000,
                "B never took the lease"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        ensure!(
            lb.term == 2 && lb.holder == "cp-b" && b.term() == Some(2),
            "{lb:?}"
        );
        named(b.control_lease().await?.active(), "cp-b", 2)?;

        // A does not know yet: its writes are refused, naming B; nothing of them is written.
        let mut stepped = mv.clone();
        stepped.step = "taking_over".into();
        named(
            refused(a.update_move(&stepped, "releasing").await)?,
            "cp-b",
            2,
        )?;
        ensure!(a.term().is_none() && !a.writable(), "A still holds a term");
        tokio::time::timeout(Duration::from_secs(1), a.deposed())
            .await
            .context("A's loss was not told")?;
        named(
            refused(a.move_owner(&s1.id, 1, &n2.id, 2).await)?,
            "cp-b",
            2,
        )?;
        let s2 = sandbox(None, &n1.id);
        named(refused(a.insert_sandbox(&s2).await)?, "cp-b", 2)?;
        ensure!(
            a.sandbox(&s2.id).await?.is_none(),
            "a refused insert was written"
        );
        let m = a.get_move(&mv.id).await?.context("the move")?;
        ensure!(m.step == "releasing", "a refused step was written: {m:?}");
        let s = a.sandbox(&s1.id).await?.context("the sandbox")?;
        ensure!(
            s.epoch == 1 && s.node_id == n1.id,
            "a refused owner was written: {s:?}"
        );
        ensure!(a.renew_lease("cp-a", "http://cp-a", 1500).await?.is_none());
        ensure!(a
            .take_lease("cp-a", "http://cp-a", 1500, false)
            .await?
            .is_none());

        // B writes what A could not.
        ensure!(b.update_move(&stepped, "releasing").await?);
        ensure!(b.move_owner(&s1.id, 1, &n2.id, 2).await?);
        b.insert_sandbox(&s2).await?;

        // B gives the lease up: A takes it at once (term 3), and B's writes are refused.
        ensure!(b.release_lease("cp-b").await?);
        ensure!(b.term().is_none());
        let la3 = a
            .take_lease("cp-a", "http://cp-a", 60_000, false)
            .await?
            .context("A takes a lease given up")?;
        ensure!(la3.term == 3, "{la3:?}");
        named(refused(b.delete_sandbox(&s2.id).await)?, "cp-a", 3)?;
        ensure!(b.sandbox(&s2.id).await?.is_some());
        // The copy of a name takes its own lease again (term 4); a forced take (SQLite's one
        // owner) takes it from whoever holds it (term 5).
        let again = a
            .take_lease("cp-a", "http://cp-a", 60_000, false)
            .await?
            .context("A takes its own lease again")?;
        ensure!(again.term == 4 && a.term() == Some(4));
        let forced = b
            .take_lease("cp-b", "http://cp-b", 60_000, true)
            .await?
            .context("a forced take")?;
        ensure!(forced.term == 5 && b.term() == Some(5));
        named(refused(a.set_draining(&n1.id, true).await)?, "cp-b", 5)?;
        ensure!(b.set_draining(&n1.id, true).await?);
        Ok(())
    }
}
