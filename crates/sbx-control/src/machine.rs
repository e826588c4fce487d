//! The move machine: one task per control plane drives every unfinished move of the table, a
//! task of its own per move (a move's long call does not hold up another's). It is woken when
//! a move is made or cancelled, rescans the table every few seconds (a move another control
//! plane made, or one whose task ended on a database error), and at its start takes up every
//! unfinished move: a control plane killed mid-move resumes each where the table has it.
//!
//! A move at epoch E (the table's when it began):
//! - `releasing`: the old node releases the sandbox at E (`…/release`). 200: its answer is
//!   kept (`release`), the table goes E → E+1 to the new node, then `taking_over` (or
//!   `reclaiming` for a move cancelled meanwhile). 409 `wrong_epoch` and other refusals (4xx):
//!   `failed` with the node's error. 5xx, no answer: asked again (backoff 1 s doubling to 30 s).
//! - `taking_over`: the new node takes it over at E+1 (`…/takeover`, from the old node's
//!   files where both share a machine: the release's `local`). 200: its answer is kept
//!   (`takeover`, written before the step so that a cancel meanwhile is refused), `done`,
//!   then the old node forgets it (best effort). A refusal (4xx: `build_missing`,
//!   `image_missing`, `wrong_epoch`, …): `reclaiming`, the refusal kept. 5xx, no answer: again.
//! - `reclaiming`: the new node forgets what it has at E+1 (and so refuses a late takeover),
//!   until it answers 200; the table goes to the old node at E+2; the old node takes back its
//!   released copy (`reclaim`). 200: `failed` with the refusal. A refusal (404: it kept
//!   nothing): `restoring`.
//! - `restoring`: the table at E+3 on the old node, which takes it from the object store
//!   (`from_store`). 200: `failed` with the refusal; a refusal: `failed` with it.
//!
//! A recovery's move (`why` `recovery`, made by `batch.rs` for a lost node) starts at
//! `taking_over` with `from_store`: the table goes E → E+3 to the new node (compare-and-set,
//! done again harmlessly when resumed), which takes it over at E+3 from the object store alone
//! (no local copy). 200: `done` (the lost node is not asked to forget: it learns that its
//! copy was taken from its heartbeat's `taken`). A refusal, or [`RECOVERY_TRIES`] asks with no
//! answer that settles it: no reclaim is possible (the old node is lost), so the new node is
//! asked to forget what it may have made at E+3 (best effort), the table goes E+3 → E+4 back
//! to the lost node, its status `lost`, and the move ends `failed` with the refusal (its
//! batch tries it once more on another node; a later recovery of the node takes it up again).
//!
//! Every transition is a compare-and-set on the step ([`Db::update_move`]); one lost to another
//! writer (a racing control plane, an operator's cancel) is dropped and the move read again.
//! Each call of a step counts in `attempts` as it is made (a control plane killed during a
//! release knows, when it starts again, that the node may have released).
//!
//! [`Db::update_move`]: crate::db::Db::update_move

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::Method;
use sbx_api::moves::{FromNode, LocalCopy, ReleaseRequest, TakeoverRequest};
use serde_json::{json, Value};
use tokio::sync::Notify;

use crate::db::{DbError, MoveRow, NodeRow, FINISHED_STEPS};
use crate::nodecall::{self, own_error, Answer, CallError};
use crate::server::{locked, Ctl};

pub const RELEASING: &str = "releasing";
pub const TAKING_OVER: &str = "taking_over";
pub const RECLAIMING: &str = "reclaiming";
pub const RESTORING: &str = "restoring";
pub const DONE: &str = "done";
pub const FAILED: &str = "failed";

/// How often the table is read again for moves nobody woke the machine for.
const RESCAN: Duration = Duration::from_secs(5);
/// How long a task waits after its database failed.
const DB_PAUSE: Duration = Duration::from_secs(1);
/// How many times the old node is asked to forget a sandbox after a move is done.
const FORGET_TRIES: u32 = 3;
/// How many asks of a recovery's takeover without an answer that settles it (5xx, none) end
/// it as refused (with the backoff, about a minute: a new node killed mid-takeover and
/// started again within it finishes the takeover).
pub const RECOVERY_TRIES: i64 = 8;
/// A move's `why`: an evacuation's, a recovery's.
pub const WHY_EVACUATION: &str = "evacuation";
pub const WHY_RECOVERY: &str = "recovery";
/// The table's status of a sandbox its recovery could not bring back.
pub const LOST: &str = "lost";

/// Whether `m` is a recovery's move (a takeover from the store at E+3, no release).
pub fn is_recovery(m: &MoveRow) -> bool {
    m.why == WHY_RECOVERY
}

/// The wait before the next ask of a step asked `attempts` times: 1 s, doubling, at most 30 s.
pub fn backoff(attempts: i64) -> Duration {
    let doublings = u32::try_from(attempts.clamp(1, 6) - 1).unwrap_or(0);
    Duration::from_secs((1u64 << doublings).min(30))
}

/// What the control plane's state holds of the machine: how to wake it, and the moves it
/// drives now (each with a way to wake its task).
#[derive(Default)]
pub struct Machine {
    wake: Notify,
    running: Mutex<HashMap<String, Arc<Notify>>>,
}

impl Machine {
    /// Wakes the machine (a new move), and the task of `move_id` if it runs (a cancel).
    pub fn nudge(&self, move_id: Option<&str>) {
        if let Some(id) = move_id {
            if let Some(n) = locked(&self.running).get(id) {
                n.notify_one();
            }
        }
        self.wake.notify_one();
    }
}

/// Starts the machine: it runs until the handle is aborted (which ends every move's task with
/// it; the table keeps where each was).
pub fn start(ctl: Arc<Ctl>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(supervise(ctl))
}

async fn supervise(ctl: Arc<Ctl>) {
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        match ctl.db.unfinished_moves().await {
            Ok(moves) => {
                for m in moves {
                    let nudge = {
                        let mut running = locked(&ctl.machine.running);
                        if running.contains_key(&m.id) {
                            continue;
                        }
                        let n = Arc::new(Notify::new());
                        running.insert(m.id.clone(), n.clone());
                        n
                    };
                    tasks.spawn(drive(ctl.clone(), m.id, nudge));
                }
            }
            Err(e) => tracing::warn!(error = %e, "the move machine could not read the moves"),
        }
        while tasks.try_join_next().is_some() {}
        tokio::select! {
            () = ctl.machine.wake.notified() => {}
            () = tokio::time::sleep(RESCAN) => {}
        }
    }
}

/// Takes a move out of the running ones when its task ends (or is aborted).
struct Running {
    ctl: Arc<Ctl>,
    id: String,
}

impl Drop for Running {
    fn drop(&mut self) {
        locked(&self.ctl.machine.running).remove(&self.id);
    }
}

fn ms(d: i64) -> Duration {
    Duration::from_millis(u64::try_from(d).unwrap_or(0))
}

/// Drives one move until it is over (or gone from the table).
async fn drive(ctl: Arc<Ctl>, id: String, nudge: Arc<Notify>) {
    let _running = Running {
        ctl: ctl.clone(),
        id: id.clone(),
    };
    loop {
        let m = match ctl.db.get_move(&id).await {
            Ok(Some(m)) => m,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(move_id = %id, error = %e, "a move could not be read");
                tokio::time::sleep(DB_PAUSE).await;
                continue;
            }
        };
        if FINISHED_STEPS.contains(&m.step.as_str()) {
            return;
        }
        if let Some(at) = m.next_attempt_at_ms {
            let now = match ctl.db.now_ms().await {
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!(move_id = %id, error = %e, "the database's clock could not be read");
                    tokio::time::sleep(DB_PAUSE).await;
                    continue;
                }
            };
            let cancelled_now = m.step == RELEASING && m.cancel && !release_outstanding(&m);
            if at > now && !cancelled_now {
                tokio::select! {
                    () = tokio::time::sleep(ms(at - now)) => {}
                    () = nudge.notified() => {}
                }
                continue;
            }
        }
        let step = m.step.clone();
        if let Err(e) = advance(&ctl, &nudge, m).await {
            tracing::warn!(move_id = %id, %step, error = %e, "a move's step failed on the database");
            tokio::time::sleep(DB_PAUSE).await;
        }
    }
}

async fn advance(ctl: &Ctl, nudge: &Notify, m: MoveRow) -> Result<(), DbError> {
    match m.step.as_str() {
        RELEASING => releasing(ctl, nudge, m).await,
        TAKING_OVER => taking_over(ctl, nudge, m).await,
        RECLAIMING => reclaiming(ctl, nudge, m).await,
        RESTORING => restoring(ctl, nudge, m).await,
        _ => Ok(()),
    }
}

/// The error a cancelled move ends with.
pub fn cancelled(move_id: &str) -> Value {
    own_error(
        "cancelled",
        &format!("the move {move_id} was cancelled (POST /internal/moves/{move_id}/cancel)"),
        false,
    )
}

fn code_of(error: Option<&str>) -> Option<String> {
    let v: Value = serde_json::from_str(error?).ok()?;
    v.get("code").and_then(Value::as_str).map(String::from)
}

/// Whether the old node may have released the sandbox for this move: a release was asked,
/// and what it last said (if anything) was not that it kept it (`copy_behind` fences
/// nothing). A cancel of such a move asks the release again to know.
fn release_outstanding(m: &MoveRow) -> bool {
    m.attempts > 0 && code_of(m.error.as_deref()).as_deref() != Some("copy_behind")
}

/// The epoch `k` past the move's.
fn epoch(m: &MoveRow, k: i64) -> u64 {
    u64::try_from(m.epoch.saturating_add(k)).unwrap_or(0)
}

/// What a node's answer means for a step.
enum Said {
    Ok(Value),
    /// A 4xx: the node refuses, and will again.
    Refused {
        status: u16,
        error: Value,
    },
    /// A 5xx or no answer: asked again.
    Again(Value),
}

fn said(r: Result<Answer, CallError>, node: &NodeRow, what: &str) -> Said {
    match r {
        Ok(a) if a.ok() => Said::Ok(a.body),
        Ok(a) if (400..500).contains(&a.status) => Said::Refused {
            status: a.status,
            error: a.error(),
        },
        Ok(a) => Said::Again(a.error()),
        Err(e) => Said::Again(own_error(
            "unavailable",
            &format!(
                "the node {} ({}) did not answer the {what}: {e}",
                node.name, node.url
            ),
            true,
        )),
    }
}

/// [`ask`], given up (`None`) where the move leaves its step meanwhile (an operator's
/// cancel: the task is nudged, and reads the move again).
async fn ask_while(
    ctl: &Ctl,
    nudge: &Notify,
    m: &MoveRow,
    node: &NodeRow,
    verb: &str,
    body: Value,
    timeout: Duration,
) -> Option<Result<Answer, CallError>> {
    let call = ask(ctl, node, &m.sandbox_id, verb, body, timeout);
    tokio::pin!(call);
    loop {
        tokio::select! {
            r = &mut call => return Some(r),
            () = nudge.notified() => match ctl.db.get_move(&m.id).await {
                Ok(Some(now)) if now.step == m.step => {}
                Ok(_) => {
                    tracing::info!(move_id = %m.id, step = %m.step, %verb, "a move left its step during a call: the call is given up");
                    return None;
                }
                Err(e) => tracing::warn!(move_id = %m.id, error = %e, "a move could not be read"),
            },
        }
    }
}

async fn ask(
    ctl: &Ctl,
    node: &NodeRow,
    sandbox_id: &str,
    verb: &str,
    body: Value,
    timeout: Duration,
) -> Result<Answer, CallError> {
    nodecall::call(
        &ctl.client,
        ctl.node_key.as_deref(),
        &node.url,
        Method::POST,
        &format!("/internal/sandboxes/{sandbox_id}/{verb}"),
        Some(&body),
        timeout,
    )
    .await
}

fn to_json<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

/// The old and the new node of a move; `None` (the move asked again later) where the table has
/// lost one.
async fn ends(ctl: &Ctl, m: &MoveRow) -> Result<Option<(NodeRow, NodeRow)>, DbError> {
    let from = ctl.db.node(&m.from_node).await?;
    let to = ctl.db.node(&m.to_node).await?;
    match (from, to) {
        (Some(f), Some(t)) => Ok(Some((f, t))),
        (f, _) => {
            let gone = if f.is_none() {
                &m.from_node
            } else {
                &m.to_node
            };
            let e = own_error(
                "unavailable",
                &format!("the node {gone} is not in the control plane's table"),
                true,
            );
            retry(ctl, m.clone(), e).await?;
            Ok(None)
        }
    }
}

/// Writes `m` if its step is still `expect`; a write lost to another writer is dropped.
async fn write(ctl: &Ctl, m: &MoveRow, expect: &str) -> Result<bool, DbError> {
    let won = ctl.db.update_move(m, expect).await?;
    if won {
        if m.step != expect {
            tracing::info!(move_id = %m.id, sandbox = %m.sandbox_id, from = expect, to = %m.step, "a move's step");
            if m.batch.is_some() && FINISHED_STEPS.contains(&m.step.as_str()) {
                // Its batch places its next moves (or ends).
                ctl.batches.nudge();
            }
        }
    } else {
        tracing::info!(move_id = %m.id, step = expect, "a move's transition lost to another writer: dropped");
    }
    Ok(won)
}

/// Counts the ask about to be made; `None` where the move changed meanwhile.
async fn begin(ctl: &Ctl, m: MoveRow) -> Result<Option<MoveRow>, DbError> {
    let mut m = m;
    m.attempts = m.attempts.saturating_add(1);
    m.next_attempt_at_ms = None;
    let step = m.step.clone();
    Ok(write(ctl, &m, &step).await?.then_some(m))
}

/// The move as the table has it now, if it is still at `step`.
async fn reread(ctl: &Ctl, m: &MoveRow, step: &str) -> Result<Option<MoveRow>, DbError> {
    Ok(ctl.db.get_move(&m.id).await?.filter(|c| c.step == step))
}

/// Asks the step again after the backoff of its attempts, `error` what it was told.
async fn retry(ctl: &Ctl, mut m: MoveRow, error: Value) -> Result<(), DbError> {
    let now = ctl.db.now_ms().await?;
    let wait = i64::try_from(backoff(m.attempts.max(1)).as_millis()).unwrap_or(30_000);
    tracing::info!(move_id = %m.id, step = %m.step, attempts = m.attempts, error = %error, "a move's step is asked again");
    m.error = Some(error.to_string());
    m.next_attempt_at_ms = Some(now.saturating_add(wait));
    let step = m.step.clone();
    write(ctl, &m, &step).await.map(|_| ())
}

/// Moves `m` on to `step` (attempts and the next attempt cleared).
async fn go(ctl: &Ctl, mut m: MoveRow, step: &str) -> Result<bool, DbError> {
    let expect = m.step.clone();
    m.step = step.to_string();
    m.attempts = 0;
    m.next_attempt_at_ms = None;
    write(ctl, &m, &expect).await
}

/// Ends `m` failed with `error`.
async fn fail(ctl: &Ctl, mut m: MoveRow, error: Value) -> Result<(), DbError> {
    tracing::warn!(move_id = %m.id, sandbox = %m.sandbox_id, step = %m.step, %error, "a move failed");
    m.error = Some(error.to_string());
    go(ctl, m, FAILED).await.map(|_| ())
}

enum Owner {
    Ok,
    Not(String),
}

/// The table holds the sandbox on `node_id` at `target`: by compare-and-set from the epoch it
/// holds (at or past the move's, below `target`), or already.
async fn own(ctl: &Ctl, m: &MoveRow, target: i64, node_id: &str) -> Result<Owner, DbError> {
    for _ in 0..5 {
        let Some(row) = ctl.db.sandbox(&m.sandbox_id).await? else {
            return Ok(Owner::Not(
                "the sandbox is no longer in the control plane's table".into(),
            ));
        };
        if row.epoch == target && row.node_id == node_id {
            return Ok(Owner::Ok);
        }
        if row.epoch >= target || row.epoch < m.epoch {
            return Ok(Owner::Not(format!(
                "the table holds the sandbox at epoch {} on {}, which this move (epoch {}) did not \
                 set",
                row.epoch, row.node_id, m.epoch
            )));
        }
        if ctl
            .db
            .move_owner(&m.sandbox_id, row.epoch, node_id, target)
            .await?
        {
            return Ok(Owner::Ok);
        }
    }
    Ok(Owner::Not(
        "the table's epoch of the sandbox kept changing".into(),
    ))
}

fn conflict(why: String) -> Value {
    own_error("conflict", &why, false)
}

/// The table's status of the sandbox as a takeover left it (woken: running).
async fn status_after(ctl: &Ctl, m: &MoveRow, takeover: &Value) {
    let status = if takeover.get("woke").and_then(Value::as_bool) == Some(true) {
        "running"
    } else {
        "sleeping"
    };
    if let Err(e) = ctl
        .db
        .update_sandbox(&m.sandbox_id, Some(status), None)
        .await
    {
        tracing::warn!(sandbox = %m.sandbox_id, error = %e, "a moved sandbox's status could not be written");
    }
}

async fn releasing(ctl: &Ctl, nudge: &Notify, m: MoveRow) -> Result<(), DbError> {
    if m.cancel && !release_outstanding(&m) {
        let e = cancelled(&m.id);
        return fail(ctl, m, e).await;
    }
    let Some((from, to)) = ends(ctl, &m).await? else {
        return Ok(());
    };
    let Some(m) = begin(ctl, m).await? else {
        return Ok(());
    };
    let req = ReleaseRequest {
        epoch: epoch(&m, 0),
        to: to.name.clone(),
        move_id: m.id.clone(),
    };
    let Some(r) = ask_while(
        ctl,
        nudge,
        &m,
        &from,
        "release",
        to_json(&req),
        nodecall::MOVE_CALL_TIMEOUT,
    )
    .await
    else {
        return Ok(());
    };
    let Some(mut cur) = reread(ctl, &m, RELEASING).await? else {
        return Ok(());
    };
    match said(r, &from, "release") {
        Said::Ok(body) => {
            if let Owner::Not(why) = own(ctl, &cur, cur.epoch + 1, &to.id).await? {
                return fail(ctl, cur, conflict(why)).await;
            }
            cur.release = Some(body.to_string());
            cur.error = None;
            if cur.cancel {
                // Cancelled while the release was asked: the old node takes it back.
                cur.refusal = Some(cancelled(&cur.id).to_string());
                go(ctl, cur, RECLAIMING).await.map(|_| ())
            } else {
                go(ctl, cur, TAKING_OVER).await.map(|_| ())
            }
        }
        Said::Refused { error, .. } => fail(ctl, cur, error).await,
        Said::Again(error) => {
            if cur.cancel && error.get("code").and_then(Value::as_str) == Some("copy_behind") {
                let e = cancelled(&cur.id);
                return fail(ctl, cur, e).await;
            }
            retry(ctl, cur, error).await
        }
    }
}

async fn taking_over(ctl: &Ctl, nudge: &Notify, m: MoveRow) -> Result<(), DbError> {
    if let Some(t) = m.takeover.clone() {
        // The takeover answered (a control plane stopped before the move was written done).
        return done(ctl, m, &t).await;
    }
    if m.cancel {
        let mut m = m;
        m.refusal = Some(cancelled(&m.id).to_string());
        m.error = None;
        return go(ctl, m, RECLAIMING).await.map(|_| ());
    }
    let Some((from, to)) = ends(ctl, &m).await? else {
        return Ok(());
    };
    let recovery = is_recovery(&m);
    // A recovery's: the table goes E → E+3 to the new node first (an operator's move did
    // E → E+1 at its release).
    let k = if recovery { 3 } else { 1 };
    if recovery {
        if let Owner::Not(why) = own(ctl, &m, m.epoch + 3, &to.id).await? {
            return fail(ctl, m, conflict(why)).await;
        }
    }
    let Some(m) = begin(ctl, m).await? else {
        return Ok(());
    };
    let local: Option<LocalCopy> = m
        .release
        .as_deref()
        .and_then(|r| serde_json::from_str::<Value>(r).ok())
        .and_then(|v| v.get("local").cloned())
        .and_then(|l| serde_json::from_value(l).ok());
    let req = TakeoverRequest {
        epoch: epoch(&m, k),
        from: FromNode {
            id: from.id.clone(),
            name: from.name.clone(),
            url: from.url.clone(),
            local: if recovery { None } else { local },
        },
        from_store: m.from_store,
        wake: m.wake,
        reclaim: false,
        move_id: Some(m.id.clone()),
    };
    let Some(r) = ask_while(
        ctl,
        nudge,
        &m,
        &to,
        "takeover",
        to_json(&req),
        nodecall::MOVE_CALL_TIMEOUT,
    )
    .await
    else {
        return Ok(());
    };
    let Some(mut cur) = reread(ctl, &m, TAKING_OVER).await? else {
        return Ok(());
    };
    match said(r, &to, "takeover") {
        Said::Ok(body) => {
            let text = body.to_string();
            cur.takeover = Some(text.clone());
            cur.error = None;
            if !write(ctl, &cur, TAKING_OVER).await? {
                return Ok(());
            }
            done(ctl, cur, &text).await
        }
        Said::Refused { error, .. } if recovery => {
            recovery_refused(ctl, cur, &from, &to, error).await
        }
        Said::Refused { error, .. } => {
            cur.refusal = Some(error.to_string());
            cur.error = None;
            go(ctl, cur, RECLAIMING).await.map(|_| ())
        }
        Said::Again(error) if recovery && cur.attempts >= RECOVERY_TRIES => {
            tracing::warn!(move_id = %cur.id, attempts = cur.attempts, %error, "a recovery's takeover never answered: given up");
            recovery_refused(ctl, cur, &from, &to, error).await
        }
        Said::Again(error) => retry(ctl, cur, error).await,
    }
}

/// A recovery's takeover was refused (or never answered): the new node forgets what it may
/// have made at E+3 (best effort: it may be dead), the table goes back to the lost node at
/// E+4 with status `lost`, and the move fails with `error`.
async fn recovery_refused(
    ctl: &Ctl,
    m: MoveRow,
    from: &NodeRow,
    to: &NodeRow,
    error: Value,
) -> Result<(), DbError> {
    let forget = json!({ "epoch": epoch(&m, 3), "to": from.name });
    for attempt in 1..=FORGET_TRIES {
        let r = ask(
            ctl,
            to,
            &m.sandbox_id,
            "forget",
            forget.clone(),
            nodecall::SHORT_CALL_TIMEOUT,
        )
        .await;
        match said(r, to, "forget") {
            Said::Ok(_) => break,
            Said::Refused { error, .. } | Said::Again(error) => {
                tracing::warn!(move_id = %m.id, node = %to.name, attempt, %error, "the new node of a failed recovery did not forget the sandbox");
            }
        }
    }
    if let Owner::Not(why) = own(ctl, &m, m.epoch + 4, &from.id).await? {
        tracing::warn!(move_id = %m.id, %why, "a failed recovery's sandbox could not be put back on its lost node");
    }
    if let Err(e) = ctl.db.update_sandbox(&m.sandbox_id, Some(LOST), None).await {
        tracing::warn!(sandbox = %m.sandbox_id, error = %e, "a sandbox's status could not be written");
    }
    fail(ctl, m, error).await
}

/// The new node has it: `done`, the table's status as the takeover left it, and the old node
/// forgets its copy (best effort: a failure is logged; the move stays done).
async fn done(ctl: &Ctl, m: MoveRow, takeover: &str) -> Result<(), DbError> {
    let t: Value = serde_json::from_str(takeover).unwrap_or(Value::Null);
    status_after(ctl, &m, &t).await;
    let mut m = m;
    m.error = None;
    if !go(ctl, m.clone(), DONE).await? {
        return Ok(());
    }
    if is_recovery(&m) {
        // The old node is lost: its heartbeat, when it comes back, tells it (`taken`).
        return Ok(());
    }
    let Some((from, to)) = ends(ctl, &m).await? else {
        return Ok(());
    };
    let req = json!({ "epoch": epoch(&m, 0), "to": to.name });
    for attempt in 1..=FORGET_TRIES {
        let r = ask(
            ctl,
            &from,
            &m.sandbox_id,
            "forget",
            req.clone(),
            nodecall::SHORT_CALL_TIMEOUT,
        )
        .await;
        match said(r, &from, "forget") {
            Said::Ok(_) => return Ok(()),
            Said::Refused { error, .. } | Said::Again(error) => {
                tracing::warn!(move_id = %m.id, node = %from.name, attempt, %error, "the old node did not forget a moved sandbox");
                if attempt < FORGET_TRIES {
                    tokio::time::sleep(backoff(i64::from(attempt))).await;
                }
            }
        }
    }
    Ok(())
}

/// The move went back to the old node (a reclaim, or a restore): `failed` with the new node's
/// refusal (or the cancel), the takeover's answer kept, the table's status as it left it.
async fn back(ctl: &Ctl, mut m: MoveRow, takeover: Value) -> Result<(), DbError> {
    status_after(ctl, &m, &takeover).await;
    m.takeover = Some(takeover.to_string());
    let error = m
        .refusal
        .as_deref()
        .and_then(|r| serde_json::from_str::<Value>(r).ok())
        .unwrap_or_else(|| {
            own_error(
                "takeover_failed",
                "the new node did not take the sandbox over",
                false,
            )
        });
    fail(ctl, m, error).await
}

async fn reclaiming(ctl: &Ctl, nudge: &Notify, m: MoveRow) -> Result<(), DbError> {
    let Some((from, to)) = ends(ctl, &m).await? else {
        return Ok(());
    };
    let Some(m) = begin(ctl, m).await? else {
        return Ok(());
    };
    // The new node drops what it has (and refuses a takeover that comes late).
    let forget = json!({ "epoch": epoch(&m, 1), "to": from.name });
    let Some(r) = ask_while(
        ctl,
        nudge,
        &m,
        &to,
        "forget",
        forget,
        nodecall::SHORT_CALL_TIMEOUT,
    )
    .await
    else {
        return Ok(());
    };
    let Some(cur) = reread(ctl, &m, RECLAIMING).await? else {
        return Ok(());
    };
    match said(r, &to, "forget") {
        Said::Ok(_) => {}
        Said::Refused { error, .. } | Said::Again(error) => return retry(ctl, cur, error).await,
    }
    if let Owner::Not(why) = own(ctl, &cur, cur.epoch + 2, &from.id).await? {
        return fail(ctl, cur, conflict(why)).await;
    }
    let Some(r) = take_back(ctl, nudge, &cur, &from, &to, 2).await else {
        return Ok(());
    };
    let Some(mut cur) = reread(ctl, &cur, RECLAIMING).await? else {
        return Ok(());
    };
    match said(r, &from, "takeover") {
        Said::Ok(body) => back(ctl, cur, body).await,
        Said::Refused { status, error } => {
            // It kept nothing (404), or refuses its copy: from the object store.
            if status != 404 {
                tracing::warn!(move_id = %cur.id, %error, "the old node refused to take its copy back: restoring from the store");
            }
            cur.error = None;
            go(ctl, cur, RESTORING).await.map(|_| ())
        }
        Said::Again(error) => retry(ctl, cur, error).await,
    }
}

/// Asks the old node (`from`) to take the sandbox back from the new one (`to`): at E+2 its
/// own kept copy (a reclaim), at E+3 from the object store (a restore).
async fn take_back(
    ctl: &Ctl,
    nudge: &Notify,
    m: &MoveRow,
    from: &NodeRow,
    to: &NodeRow,
    k: i64,
) -> Option<Result<Answer, CallError>> {
    let req = TakeoverRequest {
        epoch: epoch(m, k),
        from: FromNode {
            id: to.id.clone(),
            name: to.name.clone(),
            url: to.url.clone(),
            local: None,
        },
        from_store: k == 3,
        wake: m.wake,
        reclaim: k == 2,
        move_id: Some(m.id.clone()),
    };
    ask_while(
        ctl,
        nudge,
        m,
        from,
        "takeover",
        to_json(&req),
        nodecall::MOVE_CALL_TIMEOUT,
    )
    .await
}

async fn restoring(ctl: &Ctl, nudge: &Notify, m: MoveRow) -> Result<(), DbError> {
    let Some((from, to)) = ends(ctl, &m).await? else {
        return Ok(());
    };
    let Some(m) = begin(ctl, m).await? else {
        return Ok(());
    };
    if let Owner::Not(why) = own(ctl, &m, m.epoch + 3, &from.id).await? {
        return fail(ctl, m, conflict(why)).await;
    }
    let Some(r) = take_back(ctl, nudge, &m, &from, &to, 3).await else {
        return Ok(());
    };
    let Some(cur) = reread(ctl, &m, RESTORING).await? else {
        return Ok(());
    };
    match said(r, &from, "takeover") {
        Said::Ok(body) => back(ctl, cur, body).await,
        Said::Refused { error, .. } => fail(ctl, cur, error).await,
        Said::Again(error) => retry(ctl, cur, error).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_doubles_from_one_second_to_thirty() {
        let secs: Vec<u64> = (0..9).map(|a| backoff(a).as_secs()).collect();
        assert_eq!(secs, [1, 1, 2, 4, 8, 16, 30, 30, 30]);
    }

    #[test]
    fn a_release_is_outstanding_once_asked_unless_the_node_kept_it() {
        let mut m = MoveRow {
            id: "mov-0000000000000000".into(),
            sandbox_id: "sbx-0000000000000000".into(),
            from_node: "a".into(),
            to_node: "b".into(),
            epoch: 1,
            step: RELEASING.into(),
            why: "operator".into(),
            wake: false,
            from_store: false,
            release: None,
            takeover: None,
            error: None,
            attempts: 0,
            next_attempt_at_ms: None,
            cancel: true,
            refusal: None,
            created_at_ms: 0,
            updated_at_ms: 0,
            ended_at_ms: None,
            batch: None,
        };
        assert!(!release_outstanding(&m));
        m.attempts = 1;
        assert!(release_outstanding(&m));
        m.error = Some(own_error("copy_behind", "behind", true).to_string());
        assert!(!release_outstanding(&m));
        m.error = Some(own_error("unavailable", "away", true).to_string());
        assert!(release_outstanding(&m));
    }
}
