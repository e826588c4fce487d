//! Batches of moves that empty a node: an evacuation (`POST /internal/nodes/{id}/evacuate`,
//! `evc-…`) of a node that is up, and a recovery (`POST /internal/nodes/{id}/recover`,
//! `rcv-…`, recoverNode) of a node that is lost; `GET /internal/batches/{id}` and `GET
//! /internal/batches?node_id=`.
//!
//! A batch is a row of the `batches` table; its moves are moves of the `moves` table that name
//! it (`moves.batch`), driven by the move machine like any move. The batch's runner (one task
//! per control plane, woken when a batch is made or one of its moves ends, and every second)
//! places, for each unfinished batch, the moves it has not made yet: every sandbox the table
//! has on the node (a name reservation aside) that has no move of the batch gets one, at most
//! [`PARALLEL`] of a batch under way at once, each to a ready node with room (`place.rs`,
//! never the batch's node; nodes of the sandbox's build first). A sandbox with a move of
//! someone else's under way waits for it to end. The batch ends when every sandbox of its node
//! has a finished move of it. A control plane started again takes up every unfinished batch
//! where the table has it (the moves made resume in the machine; the rest are placed).
//!
//! - An evacuation: the node is set `draining` first (it stays draining after). Its sleeping
//!   sandboxes move first, then the running ones (released, they sleep; `wake: true`, they
//!   wake on arrival), as the node's own list says they are. A sandbox with volumes gets a
//!   move that is `failed` at once (`not_movable`): it stays.
//! - A recovery: refused (409 `lease_held`, `lease_until` beside) until the node's lease and
//!   the grace after it ([`grace`]) ran out. Each sandbox the object store holds a sleep of
//!   (below E+3) gets a move that starts at `taking_over` with `from_store` (the machine: the
//!   table E → E+3, a takeover at E+3 from the store, no local copy), `wake` as the table last
//!   knew it (it ran: it wakes). One the store holds nothing of gets a move `failed` at once
//!   with `node_lost`, its `to` its own node (it goes nowhere); its row stays on the lost node,
//!   status `lost` (should the node come back, it serves it again). One whose takeover the
//!   new node refused (the machine put it back on the lost node at E+4, `lost`) is tried once
//!   more on another node (a second move of it; none with room: that move `failed` at once,
//!   `no_capacity`). A node that comes back
//!   (heartbeats) during its recovery keeps the sandboxes not placed yet: the batch places no
//!   more and ends once its moves are over (`error` says so).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use sbx_api::{ApiError, ErrorCode};
use serde_json::{json, Value};
use tokio::sync::{Mutex, Notify};

use crate::db::batch::{new_batch_id, BatchRow, EVACUATION, RECOVERY};
use crate::db::{new_move_id, DbError, MoveRow, NodeRow, NodeState, SandboxRow, FINISHED_STEPS};
use crate::machine::{self, LOST, WHY_EVACUATION, WHY_RECOVERY};
use crate::moves::move_json;
use crate::nodecall::{self, own_error};
use crate::server::{db_failed, fail, no_node, rfc3339, Ctl, Rid};
use crate::{fleet, place};

/// The most moves of one batch under way at once.
pub const PARALLEL: usize = 4;
/// How often the runner looks at the batches nobody woke it for.
const TICK: Duration = Duration::from_secs(1);

type St = State<Arc<Ctl>>;
type RidExt = Extension<Rid>;

/// What the control plane's state holds of the runner: how to wake it, and the lock that makes
/// one round of placing at a time (a request's and the runner's).
#[derive(Default)]
pub struct Batches {
    wake: Notify,
    rounds: Mutex<()>,
}

impl Batches {
    /// Wakes the runner (a batch was made, or a move of one ended).
    pub fn nudge(&self) {
        self.wake.notify_one();
    }
}

/// The time after a node's lease for it to have seen the lease run out (and fenced itself):
/// a fifth of the lease and a second. recoverNode is refused until `lease_until` + it.
pub fn grace(lease: Duration) -> Duration {
    lease / 5 + Duration::from_secs(1)
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Starts the runner (and, with `recover_after`, the automatic recovery of a node lost that
/// long past its lease and grace). It runs until the handle is aborted.
pub fn start(ctl: Arc<Ctl>, recover_after: Option<Duration>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            if let Some(after) = recover_after {
                if let Err(e) = auto_recover(&ctl, after).await {
                    tracing::warn!(error = %e, "the automatic recovery could not read the table");
                }
            }
            match ctl.db.unfinished_batches().await {
                Ok(batches) => {
                    for b in batches {
                        if let Err(e) = round(&ctl, &b.id).await {
                            tracing::warn!(batch = %b.id, error = %e, "a batch's round failed on the database");
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e, "the batches could not be read"),
            }
            tokio::select! {
                () = ctl.batches.wake.notified() => {}
                () = tokio::time::sleep(TICK) => {}
            }
        }
    })
}

/// A batch as the table has it: its moves, and the sandboxes of its node it is to make a move
/// of: those it has none of, and (a recovery) those whose one move was refused by its new
/// node (tried once more, on another node: the refused move beside it).
struct Plan {
    moves: Vec<MoveRow>,
    pending: Vec<(SandboxRow, Option<MoveRow>)>,
}

async fn plan(ctl: &Ctl, b: &BatchRow) -> Result<Plan, DbError> {
    let moves = ctl.db.moves_of_batch(&b.id).await?;
    if b.ended_at_ms.is_some() {
        return Ok(Plan {
            moves,
            pending: Vec::new(),
        });
    }
    let mut had: HashMap<&str, Vec<&MoveRow>> = HashMap::new();
    for m in &moves {
        had.entry(m.sandbox_id.as_str()).or_default().push(m);
    }
    let mut pending = Vec::new();
    for r in ctl.db.sandboxes(Some(&b.node_id)).await? {
        if r.status == fleet::RESERVED {
            continue;
        }
        match had.get(r.id.as_str()).map(Vec::as_slice) {
            None => pending.push((r, None)),
            // Refused by the node it went to (and put back here, lost): once more elsewhere.
            Some([m])
                if b.kind == RECOVERY
                    && m.step == machine::FAILED
                    && m.to_node != b.node_id
                    && r.status == LOST =>
            {
                let refused = (*m).clone();
                pending.push((r, Some(refused)));
            }
            Some(_) => {}
        }
    }
    Ok(Plan { moves, pending })
}

fn unfinished(m: &MoveRow) -> bool {
    !FINISHED_STEPS.contains(&m.step.as_str())
}

/// Whether the object store holds a sleep of sandbox `id` below epoch `below` (what a
/// takeover from the store at `below` brings back).
pub async fn stored_sleep(
    store: &sbx_blob::Store,
    id: &str,
    below: u64,
) -> Result<bool, sbx_blob::BlobError> {
    for epoch in store.epochs(id).await?.into_iter().rev() {
        if epoch >= below {
            continue;
        }
        match store.manifest(id, epoch).await {
            Ok(m) if m.kind == sbx_blob::Kind::Sleep => return Ok(true),
            Ok(_) => {}
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(e),
        }
    }
    Ok(false)
}

/// A new move of batch `b` (its times the database's).
fn batch_move(b: &BatchRow, r: &SandboxRow, to: &str, step: &str, wake: bool) -> MoveRow {
    let recovery = b.kind == RECOVERY;
    MoveRow {
        id: new_move_id(),
        sandbox_id: r.id.clone(),
        from_node: b.node_id.clone(),
        to_node: to.to_string(),
        epoch: r.epoch,
        step: step.to_string(),
        why: if recovery {
            WHY_RECOVERY
        } else {
            WHY_EVACUATION
        }
        .into(),
        wake,
        from_store: recovery,
        release: None,
        takeover: None,
        error: None,
        attempts: 0,
        next_attempt_at_ms: None,
        cancel: false,
        refusal: None,
        created_at_ms: 0,
        updated_at_ms: 0,
        ended_at_ms: None,
        batch: Some(b.id.clone()),
    }
}

/// Records `m`; false where the sandbox has a move under way meanwhile (it is placed later).
async fn record(ctl: &Ctl, m: &MoveRow) -> Result<bool, DbError> {
    match ctl.db.insert_move(m).await {
        Ok(()) => {
            tracing::info!(batch = ?m.batch, move_id = %m.id, sandbox = %m.sandbox_id, to = %m.to_node, step = %m.step, "a batch's move");
            Ok(true)
        }
        Err(DbError::AlreadyMoving { .. }) => Ok(false),
        Err(e) => Err(e),
    }
}

/// What the node's own list says of its sandboxes: running, and having volumes.
async fn seen_on(ctl: &Ctl, node: &NodeRow) -> HashMap<String, (bool, bool)> {
    let r = nodecall::call(
        &ctl.client,
        ctl.node_key.as_deref(),
        &node.url,
        Method::GET,
        "/v1/sandboxes?limit=1000",
        None,
        nodecall::SHORT_CALL_TIMEOUT,
    )
    .await;
    let mut out = HashMap::new();
    match r {
        Ok(a) if a.ok() => {
            for s in a.body["data"].as_array().into_iter().flatten() {
                let Some(id) = s["id"].as_str() else { continue };
                let running = s["status"].as_str() == Some("running");
                let volumes = s["volumes"].as_array().is_some_and(|v| !v.is_empty());
                out.insert(id.to_string(), (running, volumes));
            }
        }
        Ok(a) => {
            tracing::warn!(node = %node.name, status = a.status, "an evacuated node's list of sandboxes: the table's statuses are used")
        }
        Err(e) => {
            tracing::warn!(node = %node.name, error = %e, "an evacuated node's list of sandboxes: the table's statuses are used")
        }
    }
    out
}

/// One round of batch `id`: places the moves it can (at most [`PARALLEL`] under way), or ends
/// it. One round at a time per control plane.
pub async fn round(ctl: &Ctl, id: &str) -> Result<(), DbError> {
    let _one = ctl.batches.rounds.lock().await;
    let Some(b) = ctl.db.batch(id).await? else {
        return Ok(());
    };
    if b.ended_at_ms.is_some() {
        return Ok(());
    }
    let p = plan(ctl, &b).await?;
    let running = p.moves.iter().filter(|m| unfinished(m)).count();
    let Some(node) = ctl.db.node(&b.node_id).await? else {
        return Ok(());
    };
    let recovery = b.kind == RECOVERY;
    let now = ctl.db.now_ms().await?;
    let back = recovery && now < node.lease_until_ms.saturating_add(ms(grace(ctl.lease)));
    if p.pending.is_empty() || back {
        if back && !p.pending.is_empty() && b.error.is_none() {
            let e = own_error(
                "conflict",
                &format!(
                    "node {} came back (it renewed its lease) during its recovery: its {} \
                     sandboxes not placed yet stay with it",
                    node.name,
                    p.pending.len()
                ),
                false,
            );
            tracing::warn!(batch = %b.id, node = %node.name, left = p.pending.len(), "a recovered node came back: the recovery places no more moves");
            ctl.db.set_batch_error(&b.id, Some(&e.to_string())).await?;
        }
        if running == 0 && ctl.db.end_batch(&b.id).await? {
            let done = p.moves.iter().filter(|m| m.step == machine::DONE).count();
            tracing::info!(batch = %b.id, kind = %b.kind, node = %node.name, moves = p.moves.len(), done, "a batch ended");
        }
        return Ok(());
    }
    let mut slots = PARALLEL.saturating_sub(running);
    if slots == 0 {
        return Ok(());
    }
    // Those with a move of someone else's under way wait for it.
    let mut cands = Vec::new();
    for (r, avoid) in p.pending {
        if ctl.db.unfinished_move_of(&r.id).await?.is_none() {
            cands.push((r, avoid));
        }
    }
    if cands.is_empty() {
        return Ok(());
    }
    let seen = if recovery {
        HashMap::new()
    } else {
        seen_on(ctl, &node).await
    };
    let ran = |r: &SandboxRow| seen.get(&r.id).map_or(r.status == "running", |s| s.0);
    if !recovery {
        // Sleeping ones first (a stable sort: each group in the table's order).
        cands.sort_by_key(|(r, _)| ran(r));
    }
    let nodes: Vec<NodeRow> = ctl
        .db
        .nodes()
        .await?
        .into_iter()
        .filter(|n| n.id != b.node_id)
        .collect();
    let mut load = ctl.extra_load();
    for m in ctl.db.unfinished_moves().await? {
        *load.entry(m.to_node).or_insert(0) += 1;
    }
    let mut error: Option<Value> = None;
    let mut placed = 0usize;
    for (r, refused) in cands {
        if slots == 0 {
            break;
        }
        let below = u64::try_from(r.epoch.saturating_add(3)).unwrap_or(0);
        if recovery {
            if let Some(store) = &ctl.store {
                match stored_sleep(store, &r.id, below).await {
                    Ok(true) => {}
                    Ok(false) => {
                        let mut m = batch_move(&b, &r, &b.node_id, machine::FAILED, false);
                        m.error = Some(
                            own_error(
                                "node_lost",
                                &format!(
                                    "node {} was lost, and the object store holds nothing of \
                                     sandbox {} (it never slept there, nor was a sleep of it \
                                     uploaded): it stays on that node, lost",
                                    node.name, r.id
                                ),
                                false,
                            )
                            .to_string(),
                        );
                        if record(ctl, &m).await? {
                            ctl.db.update_sandbox(&r.id, Some(LOST), None).await?;
                        }
                        continue;
                    }
                    Err(e) => {
                        error = Some(own_error(
                            "unavailable",
                            &format!("the object store could not be read: {e}"),
                            true,
                        ));
                        continue;
                    }
                }
            }
        } else if seen.get(&r.id).is_some_and(|s| s.1) {
            let mut m = batch_move(&b, &r, &b.node_id, machine::FAILED, false);
            m.error = Some(
                own_error(
                    "not_movable",
                    &format!(
                        "sandbox {} has volumes: a sandbox with volumes is not moved (its \
                         volumes are its node's)",
                        r.id
                    ),
                    false,
                )
                .to_string(),
            );
            record(ctl, &m).await?;
            continue;
        }
        // Nodes of its build first (only they can wake its memory); not the one that refused
        // it, for a second try.
        let others: Vec<NodeRow> = nodes
            .iter()
            .filter(|n| refused.as_ref().is_none_or(|m| m.to_node != n.id))
            .cloned()
            .collect();
        let same: Vec<NodeRow> = others
            .iter()
            .filter(|n| n.build == r.build)
            .cloned()
            .collect();
        let pool = if same.is_empty() { &others } else { &same };
        let to = match place::choose(pool, &load, None) {
            Ok(n) => n.clone(),
            Err(no) if refused.is_some() => {
                // No other node for a second try: it stays lost (this move says why).
                let mut m = batch_move(&b, &r, &b.node_id, machine::FAILED, false);
                m.error = Some(
                    own_error(
                        "no_capacity",
                        &format!(
                            "sandbox {} was refused by the node it was recovered to, and no \
                             other node can take it: {no}",
                            r.id
                        ),
                        false,
                    )
                    .to_string(),
                );
                record(ctl, &m).await?;
                continue;
            }
            Err(no) => {
                error = Some(own_error(
                    "no_capacity",
                    &format!("sandbox {} waits: {no}", r.id),
                    true,
                ));
                break;
            }
        };
        let step = if recovery {
            machine::TAKING_OVER
        } else {
            machine::RELEASING
        };
        let wake = refused.as_ref().map_or_else(|| ran(&r), |m| m.wake);
        let m = batch_move(&b, &r, &to.id, step, wake);
        if record(ctl, &m).await? {
            *load.entry(to.id.clone()).or_insert(0) += 1;
            slots -= 1;
            placed += 1;
        }
    }
    if placed > 0 {
        ctl.machine.nudge(None);
    }
    let text = error.map(|e| e.to_string());
    if text != b.error {
        ctl.db.set_batch_error(&b.id, text.as_deref()).await?;
    }
    Ok(())
}

/// A node lost `after` past its lease and grace is recovered, once a loss (no recovery of it
/// since its last heartbeat), where the table has sandboxes on it.
async fn auto_recover(ctl: &Ctl, after: Duration) -> Result<(), DbError> {
    let now = ctl.db.now_ms().await?;
    let wait = ms(grace(ctl.lease)).saturating_add(ms(after));
    for n in ctl.db.nodes().await? {
        if n.lease_until_ms.saturating_add(wait) > now {
            continue;
        }
        let batches = ctl.db.batches(Some(&n.id)).await?;
        let recovered = batches.iter().any(|b| {
            b.kind == RECOVERY && (b.ended_at_ms.is_none() || b.created_at_ms >= n.heartbeat_at_ms)
        });
        if recovered {
            continue;
        }
        let has = ctl
            .db
            .sandboxes(Some(&n.id))
            .await?
            .iter()
            .any(|r| r.status != fleet::RESERVED && r.status != LOST);
        if !has {
            continue;
        }
        let b = BatchRow {
            id: new_batch_id(RECOVERY),
            kind: RECOVERY.into(),
            node_id: n.id.clone(),
            error: None,
            created_at_ms: 0,
            updated_at_ms: 0,
            ended_at_ms: None,
        };
        match ctl.db.insert_batch(&b).await {
            Ok(()) => {
                tracing::warn!(node = %n.name, batch = %b.id, lease_until = %rfc3339(n.lease_until_ms), after_seconds = after.as_secs_f64(), "a node lost past --recover-after-seconds is recovered");
                round(ctl, &b.id).await?;
            }
            Err(DbError::BatchUnderWay { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

// ---- the API ----

fn node_ref(id: &str, nodes: &[NodeRow]) -> Value {
    let name = nodes.iter().find(|n| n.id == id).map(|n| n.name.clone());
    json!({ "id": id, "name": name })
}

/// The batch object: `{object: "batch", id, kind, node: {id, name}, moves: [move objects],
/// counts: {total, done, failed, running, pending}, error, created_at, ended_at}`.
fn batch_json(b: &BatchRow, p: &Plan, nodes: &[NodeRow]) -> Value {
    let count = |step: &str| p.moves.iter().filter(|m| m.step == step).count();
    let running = p.moves.iter().filter(|m| unfinished(m)).count();
    json!({
        "object": "batch",
        "id": b.id,
        "kind": b.kind,
        "node": node_ref(&b.node_id, nodes),
        "moves": p.moves.iter().map(|m| move_json(m, nodes)).collect::<Vec<_>>(),
        "counts": {
            "total": p.moves.len() + p.pending.len(),
            "done": count(machine::DONE),
            "failed": count(machine::FAILED),
            "running": running,
            "pending": p.pending.len(),
        },
        "error": b.error.as_deref().and_then(|e| serde_json::from_str::<Value>(e).ok()),
        "created_at": rfc3339(b.created_at_ms),
        "updated_at": rfc3339(b.updated_at_ms),
        "ended_at": b.ended_at_ms.map(rfc3339),
    })
}

async fn answer(ctl: &Ctl, rid: &str, status: StatusCode, id: &str) -> Response {
    let b = match ctl.db.batch(id).await {
        Ok(Some(b)) => b,
        Ok(None) => return fail(rid, no_batch(id)),
        Err(e) => return db_failed(rid, &e),
    };
    let p = match plan(ctl, &b).await {
        Ok(p) => p,
        Err(e) => return db_failed(rid, &e),
    };
    match ctl.db.nodes().await {
        Ok(nodes) => (status, Json(batch_json(&b, &p, &nodes))).into_response(),
        Err(e) => db_failed(rid, &e),
    }
}

fn no_batch(id: &str) -> ApiError {
    ApiError::new(ErrorCode::NotFound, format!("no batch {id}"))
}

fn under_way(node: &NodeRow, kind: &str, batch_id: &str) -> ApiError {
    ApiError::new(
        ErrorCode::AlreadyMoving,
        format!(
            "node {} has an {kind} under way ({batch_id}): one at a time",
            node.name
        ),
    )
    .with_beside("batch_id", json!(batch_id))
}

/// Makes a batch of `kind` for `node`, runs its first round, and answers 202 with it.
async fn begin(ctl: &Ctl, rid: &str, node: &NodeRow, kind: &str) -> Response {
    let b = BatchRow {
        id: new_batch_id(kind),
        kind: kind.into(),
        node_id: node.id.clone(),
        error: None,
        created_at_ms: 0,
        updated_at_ms: 0,
        ended_at_ms: None,
    };
    match ctl.db.insert_batch(&b).await {
        Ok(()) => {}
        Err(DbError::BatchUnderWay { batch_id }) => {
            return fail(rid, under_way(node, kind, &batch_id))
        }
        Err(e) => return db_failed(rid, &e),
    }
    tracing::info!(request_id = %rid, batch = %b.id, %kind, node = %node.name, "a batch begins");
    if let Err(e) = round(ctl, &b.id).await {
        // The runner places its moves.
        tracing::warn!(batch = %b.id, error = %e, "a batch's first round failed on the database");
    }
    ctl.batches.nudge();
    answer(ctl, rid, StatusCode::ACCEPTED, &b.id).await
}

async fn node_of(ctl: &Ctl, rid: &str, id: &str) -> Result<NodeRow, Response> {
    match ctl.db.node(id).await {
        Ok(Some(n)) => Ok(n),
        Ok(None) => Err(fail(rid, no_node(id))),
        Err(e) => Err(db_failed(rid, &e)),
    }
}

/// `POST /internal/nodes/{id}/recover` (recoverNode): 409 `lease_held` while the node's lease
/// may still be held (until `lease_until` + [`grace`]), else 202 with a recovery.
pub async fn recover(
    State(ctl): St,
    Extension(Rid(rid)): RidExt,
    Path(id): Path<String>,
) -> Response {
    let node = match node_of(&ctl, &rid, &id).await {
        Ok(n) => n,
        Err(r) => return r,
    };
    let now = match ctl.db.now_ms().await {
        Ok(n) => n,
        Err(e) => return db_failed(&rid, &e),
    };
    let until = node.lease_until_ms.saturating_add(ms(grace(ctl.lease)));
    if now < until {
        return fail(
            &rid,
            ApiError::new(
                ErrorCode::LeaseHeld,
                format!(
                    "node {} may still hold its lease (until {}, and the grace after it for the \
                     node to have seen it run out): it is recovered after {}",
                    node.name,
                    rfc3339(node.lease_until_ms),
                    rfc3339(until)
                ),
            )
            .with_beside("lease_until", json!(rfc3339(until))),
        );
    }
    begin(&ctl, &rid, &node, RECOVERY).await
}

/// `POST /internal/nodes/{id}/evacuate`: the node `draining`, and 202 with an evacuation of
/// its sandboxes. A lost node is not evacuated (409 `not_movable`: recover it).
pub async fn evacuate(
    State(ctl): St,
    Extension(Rid(rid)): RidExt,
    Path(id): Path<String>,
) -> Response {
    let node = match node_of(&ctl, &rid, &id).await {
        Ok(n) => n,
        Err(r) => return r,
    };
    let now = match ctl.db.now_ms().await {
        Ok(n) => n,
        Err(e) => return db_failed(&rid, &e),
    };
    if node.state == NodeState::Lost || node.lease_until_ms < now {
        return fail(
            &rid,
            ApiError::new(
                ErrorCode::NotMovable,
                format!(
                    "node {} is lost (its lease ran out at {}): it cannot release its sandboxes; \
                     recover it (POST /internal/nodes/{}/recover)",
                    node.name,
                    rfc3339(node.lease_until_ms),
                    node.id
                ),
            ),
        );
    }
    if let Err(e) = ctl.db.set_draining(&node.id, true).await {
        return db_failed(&rid, &e);
    }
    begin(&ctl, &rid, &node, EVACUATION).await
}

/// `GET /internal/batches/{id}`.
pub async fn get(State(ctl): St, Extension(Rid(rid)): RidExt, Path(id): Path<String>) -> Response {
    answer(&ctl, &rid, StatusCode::OK, &id).await
}

/// `GET /internal/batches[?node_id=ID or name]`: the batches of a node (or every batch),
/// oldest first.
pub async fn list(State(ctl): St, Extension(Rid(rid)): RidExt, req: Request<Body>) -> Response {
    let mut node = None;
    for pair in req.uri().query().unwrap_or("").split('&') {
        if pair.is_empty() {
            continue;
        }
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "node_id" if !v.is_empty() => node = Some(fleet::decode_segment(v)),
            "node_id" => {
                return fail(
                    &rid,
                    ApiError::invalid_field("node_id", "node_id is a node's id or name"),
                )
            }
            other => {
                return fail(
                    &rid,
                    ApiError::new(
                        ErrorCode::UnknownParameter,
                        format!("the batches' list takes node_id, not {other}"),
                    )
                    .with_param(other.to_string()),
                )
            }
        }
    }
    let node_id = match &node {
        Some(key) => match node_of(&ctl, &rid, key).await {
            Ok(n) => Some(n.id),
            Err(r) => return r,
        },
        None => None,
    };
    let batches = match ctl.db.batches(node_id.as_deref()).await {
        Ok(b) => b,
        Err(e) => return db_failed(&rid, &e),
    };
    let nodes = match ctl.db.nodes().await {
        Ok(n) => n,
        Err(e) => return db_failed(&rid, &e),
    };
    let mut data = Vec::with_capacity(batches.len());
    for b in &batches {
        match plan(&ctl, b).await {
            Ok(p) => data.push(batch_json(b, &p, &nodes)),
            Err(e) => return db_failed(&rid, &e),
        }
    }
    Json(json!({
        "object": "list",
        "data": data,
        "has_more": false,
        "next_cursor": null,
    }))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grace_is_a_fifth_of_the_lease_and_a_second() {
        assert_eq!(grace(Duration::from_secs(10)), Duration::from_secs(3));
        assert_eq!(grace(Duration::from_secs(2)), Duration::from_millis(1400));
    }
}
