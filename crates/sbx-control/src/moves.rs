//! The moves' API of the control plane: `POST /internal/moves` (a move of a sandbox to another
//! node: 202 and the move, which the machine then drives), `GET /internal/moves/{id}`, `GET
//! /internal/moves?sandbox_id=` and `POST /internal/moves/{id}/cancel`; the move object of the
//! spec.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use sbx_api::{ApiError, ErrorCode};
use serde_json::{json, Value};

use crate::db::{new_move_id, DbError, MoveRow, NodeRow, NodeState};
use crate::machine::{self, RELEASING, TAKING_OVER};
use crate::nodecall;
use crate::server::{db_failed, fail, read_limited, rfc3339, Ctl, Rid};

/// The project of every move (the control plane has one project: its table keeps none).
pub const PROJECT: &str = "default";
/// What made a move of `POST /internal/moves` (`why`; an evacuation's and a recovery's are
/// [`machine::WHY_EVACUATION`], [`machine::WHY_RECOVERY`]).
pub const WHY_OPERATOR: &str = "operator";
/// The most bytes of a move's body.
const MAX_BODY: usize = 64 << 10;

type St = State<Arc<Ctl>>;
type RidExt = Extension<Rid>;

fn text_json(t: Option<&str>) -> Value {
    t.and_then(|t| serde_json::from_str(t).ok())
        .unwrap_or(Value::Null)
}

fn node_ref(id: &str, nodes: &[NodeRow]) -> Value {
    let name = nodes.iter().find(|n| n.id == id).map(|n| n.name.clone());
    json!({ "id": id, "name": name })
}

/// The move object of the spec.
pub fn move_json(m: &MoveRow, nodes: &[NodeRow]) -> Value {
    json!({
        "object": "move",
        "id": m.id,
        "sandbox_id": m.sandbox_id,
        "project_id": PROJECT,
        "from": node_ref(&m.from_node, nodes),
        "to": node_ref(&m.to_node, nodes),
        "epoch": m.epoch,
        "step": m.step,
        "why": m.why,
        "wake": m.wake,
        "from_store": m.from_store,
        "release": text_json(m.release.as_deref()),
        "takeover": text_json(m.takeover.as_deref()),
        "error": text_json(m.error.as_deref()),
        "attempts": m.attempts,
        "next_attempt_at": m.next_attempt_at_ms.map(rfc3339),
        "batch": m.batch,
        "created_at": rfc3339(m.created_at_ms),
        "updated_at": rfc3339(m.updated_at_ms),
        "ended_at": m.ended_at_ms.map(rfc3339),
    })
}

async fn move_answer(ctl: &Ctl, rid: &str, status: StatusCode, m: &MoveRow) -> Response {
    match ctl.db.nodes().await {
        Ok(nodes) => (status, Json(move_json(m, &nodes))).into_response(),
        Err(e) => db_failed(rid, &e),
    }
}

/// What `POST /internal/moves` asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoveAsk {
    pub sandbox_id: String,
    pub to: String,
    pub wake: Option<bool>,
}

/// A move's body: `{"sandbox_id", "to", "wake"?}`, nothing else.
pub fn parse_move(body: &[u8]) -> Result<MoveAsk, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            ErrorCode::InvalidJson,
            format!("the body of a move is not JSON: {e}"),
        )
    })?;
    let Value::Object(o) = v else {
        return Err(ApiError::new(
            ErrorCode::InvalidJson,
            "the body of a move is a JSON object {\"sandbox_id\", \"to\", \"wake\"}",
        ));
    };
    if let Some(k) = o
        .keys()
        .find(|k| !["sandbox_id", "to", "wake"].contains(&k.as_str()))
    {
        return Err(ApiError::new(
            ErrorCode::UnknownField,
            format!("a move takes sandbox_id, to and wake, not {k}"),
        )
        .with_param(k.clone()));
    }
    let text = |k: &str| match o.get(k) {
        Some(Value::String(s)) if !s.is_empty() && s.len() <= 255 => Ok(s.clone()),
        _ => Err(ApiError::invalid_field(
            k,
            format!("{k} is required: a string of 1 to 255 characters"),
        )),
    };
    let sandbox_id = text("sandbox_id")?;
    let to = text("to")?;
    let wake = match o.get("wake") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(_) => {
            return Err(ApiError::invalid_field(
                "wake",
                "wake must be true or false",
            ))
        }
    };
    Ok(MoveAsk {
        sandbox_id,
        to,
        wake,
    })
}

fn already_moving(sandbox: &str, move_id: &str) -> ApiError {
    ApiError::new(
        ErrorCode::AlreadyMoving,
        format!("sandbox {sandbox} is being moved ({move_id}): one move at a time"),
    )
    .with_param("sandbox_id")
    .with_beside("move_id", json!(move_id))
}

fn not_movable(param: &str, message: String) -> ApiError {
    ApiError::new(ErrorCode::NotMovable, message).with_param(param)
}

/// `POST /internal/moves`.
pub async fn create(State(ctl): St, Extension(Rid(rid)): RidExt, req: Request) -> Response {
    let bytes = match read_limited(req.into_body(), MAX_BODY).await {
        Ok(b) => b,
        Err(_) => {
            return fail(
                &rid,
                ApiError::new(
                    ErrorCode::InvalidJson,
                    "the body could not be read (a move's is at most 64 KiB)",
                ),
            )
        }
    };
    let ask = match parse_move(&bytes) {
        Ok(a) => a,
        Err(e) => return fail(&rid, e),
    };
    match start(&ctl, &rid, &ask).await {
        Ok(m) => {
            ctl.machine.nudge(Some(&m.id));
            tracing::info!(request_id = %rid, move_id = %m.id, sandbox = %m.sandbox_id, from = %m.from_node, to = %m.to_node, epoch = m.epoch, "a move begins");
            move_answer(&ctl, &rid, StatusCode::ACCEPTED, &m).await
        }
        Err(resp) => resp,
    }
}

async fn start(ctl: &Ctl, rid: &str, ask: &MoveAsk) -> Result<MoveRow, Response> {
    let dbf = |e: DbError| db_failed(rid, &e);
    let row = ctl
        .lookup(&ask.sandbox_id)
        .await
        .map_err(dbf)?
        .ok_or_else(|| {
            fail(
                rid,
                ApiError::new(
                    ErrorCode::SandboxNotFound,
                    format!("no sandbox {} in the fleet's table", ask.sandbox_id),
                )
                .with_param("sandbox_id"),
            )
        })?;
    let to = ctl.db.node(&ask.to).await.map_err(dbf)?.ok_or_else(|| {
        fail(
            rid,
            ApiError::new(
                ErrorCode::NotFound,
                format!("no node {} in the control plane's table", ask.to),
            )
            .with_param("to"),
        )
    })?;
    if let Some(m) = ctl.db.unfinished_move_of(&row.id).await.map_err(dbf)? {
        return Err(fail(rid, already_moving(&row.id, &m.id)));
    }
    if to.id == row.node_id {
        return Err(fail(
            rid,
            not_movable(
                "to",
                format!("sandbox {} is on node {} already", row.id, to.name),
            ),
        ));
    }
    if to.state != NodeState::Ready {
        return Err(fail(
            rid,
            not_movable(
                "to",
                format!(
                    "node {} is {}: a sandbox moves to a ready node",
                    to.name,
                    to.state.as_str()
                ),
            ),
        ));
    }
    let from = ctl
        .db
        .node(&row.node_id)
        .await
        .map_err(dbf)?
        .ok_or_else(|| {
            fail(
                rid,
                ApiError::new(
                    ErrorCode::Unavailable,
                    format!(
                        "sandbox {} is on node {}, which the control plane's table no longer has",
                        row.id, row.node_id
                    ),
                ),
            )
        })?;
    if from.state == NodeState::Lost {
        return Err(fail(
            rid,
            ApiError::new(
                ErrorCode::Unavailable,
                format!(
                    "sandbox {} is on node {}, which is lost (its lease ran out at {}): it cannot \
                     release it",
                    row.id,
                    from.name,
                    rfc3339(from.lease_until_ms)
                ),
            ),
        ));
    }
    // The sandbox as its node has it: its volumes (not movable), and whether it runs.
    let seen = nodecall::call(
        &ctl.client,
        ctl.node_key.as_deref(),
        &from.url,
        Method::GET,
        &format!("/v1/sandboxes/{}", row.id),
        None,
        nodecall::SHORT_CALL_TIMEOUT,
    )
    .await
    .map_err(|e| {
        fail(
            rid,
            ApiError::new(
                ErrorCode::Unavailable,
                format!(
                    "the node {} ({}) did not answer about sandbox {}: {e}",
                    from.name, from.url, row.id
                ),
            ),
        )
    })?;
    if !seen.ok() {
        let body = seen.body.clone();
        let status = StatusCode::from_u16(seen.status).unwrap_or(StatusCode::BAD_GATEWAY);
        if body.get("error").is_some() {
            return Err((status, Json(body)).into_response());
        }
        return Err(fail(
            rid,
            ApiError::new(
                ErrorCode::Unavailable,
                format!(
                    "the node {} answered {} about sandbox {}",
                    from.name, seen.status, row.id
                ),
            ),
        ));
    }
    if seen
        .body
        .get("volumes")
        .and_then(Value::as_array)
        .is_some_and(|v| !v.is_empty())
    {
        return Err(fail(
            rid,
            not_movable(
                "sandbox_id",
                format!(
                    "sandbox {} has volumes: a sandbox with volumes is not moved (its volumes \
                     are its node's)",
                    row.id
                ),
            ),
        ));
    }
    let ran = seen.body.get("status").and_then(Value::as_str) == Some("running");
    let m = MoveRow {
        id: new_move_id(),
        sandbox_id: row.id.clone(),
        from_node: from.id.clone(),
        to_node: to.id.clone(),
        epoch: row.epoch,
        step: RELEASING.into(),
        why: WHY_OPERATOR.into(),
        wake: ask.wake.unwrap_or(ran),
        from_store: false,
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
        batch: None,
    };
    match ctl.db.insert_move(&m).await {
        Ok(()) => {}
        Err(DbError::AlreadyMoving { move_id }) => {
            return Err(fail(rid, already_moving(&row.id, &move_id)))
        }
        Err(e) => return Err(db_failed(rid, &e)),
    }
    ctl.db
        .get_move(&m.id)
        .await
        .map_err(dbf)?
        .ok_or_else(|| fail(rid, no_move(&m.id)))
}

fn no_move(id: &str) -> ApiError {
    ApiError::new(ErrorCode::NotFound, format!("no move {id}"))
}

/// `GET /internal/moves/{id}`.
pub async fn get(State(ctl): St, Extension(Rid(rid)): RidExt, Path(id): Path<String>) -> Response {
    match ctl.db.get_move(&id).await {
        Ok(Some(m)) => move_answer(&ctl, &rid, StatusCode::OK, &m).await,
        Ok(None) => fail(&rid, no_move(&id)),
        Err(e) => db_failed(&rid, &e),
    }
}

/// `GET /internal/moves[?sandbox_id=ID or name]`: the moves of a sandbox (or every move),
/// oldest first.
pub async fn list(State(ctl): St, Extension(Rid(rid)): RidExt, req: Request<Body>) -> Response {
    let mut sandbox = None;
    for pair in req.uri().query().unwrap_or("").split('&') {
        if pair.is_empty() {
            continue;
        }
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "sandbox_id" if !v.is_empty() => sandbox = Some(crate::fleet::decode_segment(v)),
            "sandbox_id" => {
                return fail(
                    &rid,
                    ApiError::invalid_field("sandbox_id", "sandbox_id is a sandbox's id or name"),
                )
            }
            other => {
                return fail(
                    &rid,
                    ApiError::new(
                        ErrorCode::UnknownParameter,
                        format!("the moves' list takes sandbox_id, not {other}"),
                    )
                    .with_param(other.to_string()),
                )
            }
        }
    }
    let moves = match &sandbox {
        Some(key) => {
            let id = match ctl.lookup(key).await {
                Ok(Some(r)) => r.id,
                Ok(None) => key.clone(),
                Err(e) => return db_failed(&rid, &e),
            };
            ctl.db.moves_of(&id).await
        }
        None => ctl.db.all_moves().await,
    };
    let moves = match moves {
        Ok(m) => m,
        Err(e) => return db_failed(&rid, &e),
    };
    let nodes = match ctl.db.nodes().await {
        Ok(n) => n,
        Err(e) => return db_failed(&rid, &e),
    };
    Json(json!({
        "object": "list",
        "data": moves.iter().map(|m| move_json(m, &nodes)).collect::<Vec<_>>(),
        "has_more": false,
        "next_cursor": null,
    }))
    .into_response()
}

/// `POST /internal/moves/{id}/cancel`: a move at `releasing` is marked (the machine ends it
/// `failed`, or takes the sandbox back where the release answered meanwhile); one at
/// `taking_over` whose takeover has not answered goes `reclaiming`. 202 with the move. Refused
/// (409, the move beside): over (`move_over`), going back already (`move_going_back`), taken
/// over (`move_taken_over`).
pub async fn cancel(
    State(ctl): St,
    Extension(Rid(rid)): RidExt,
    Path(id): Path<String>,
) -> Response {
    for _ in 0..5 {
        let m = match ctl.db.get_move(&id).await {
            Ok(Some(m)) => m,
            Ok(None) => return fail(&rid, no_move(&id)),
            Err(e) => return db_failed(&rid, &e),
        };
        let step = m.step.as_str();
        let refused = match step {
            machine::DONE | machine::FAILED => {
                Some((ErrorCode::MoveOver, format!("is over ({step})")))
            }
            _ if machine::is_recovery(&m) => Some((
                ErrorCode::MoveTakenOver,
                "cannot be cancelled: it is a recovery's, and its old node is lost".to_string(),
            )),
            machine::RECLAIMING | machine::RESTORING => Some((
                ErrorCode::MoveGoingBack,
                "is already going back to the old node".to_string(),
            )),
            TAKING_OVER if m.takeover.is_some() => Some((
                ErrorCode::MoveTakenOver,
                "cannot be cancelled: the new node has taken the sandbox over".to_string(),
            )),
            RELEASING if m.cancel => {
                return move_answer(&ctl, &rid, StatusCode::ACCEPTED, &m).await;
            }
            _ => None,
        };
        if let Some((code, why)) = refused {
            return match ctl.db.nodes().await {
                Ok(nodes) => fail(
                    &rid,
                    ApiError::new(code, format!("the move {} {why}", m.id))
                        .with_beside("move", move_json(&m, &nodes)),
                ),
                Err(e) => db_failed(&rid, &e),
            };
        }
        let error = machine::cancelled(&m.id).to_string();
        match ctl.db.cancel_move(&m.id, step, &error).await {
            Ok(true) => {
                ctl.machine.nudge(Some(&m.id));
                tracing::info!(request_id = %rid, move_id = %m.id, %step, "a move is cancelled");
                return match ctl.db.get_move(&m.id).await {
                    Ok(Some(m)) => move_answer(&ctl, &rid, StatusCode::ACCEPTED, &m).await,
                    Ok(None) => fail(&rid, no_move(&id)),
                    Err(e) => db_failed(&rid, &e),
                };
            }
            // The move changed meanwhile: read it again.
            Ok(false) => continue,
            Err(e) => return db_failed(&rid, &e),
        }
    }
    fail(
        &rid,
        ApiError::new(
            ErrorCode::Unavailable,
            format!("the move {id} kept changing; ask again"),
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_moves_body_is_parsed_strictly() {
        let a = parse_move(br#"{"sandbox_id":"sbx-1","to":"b"}"#).expect("a move");
        assert_eq!(
            a,
            MoveAsk {
                sandbox_id: "sbx-1".into(),
                to: "b".into(),
                wake: None
            }
        );
        assert_eq!(
            parse_move(br#"{"sandbox_id":"s","to":"b","wake":true}"#)
                .expect("a move")
                .wake,
            Some(true)
        );
        let e = parse_move(br#"{"sandbox_id":"s","to":"b","x":1}"#).expect_err("unknown");
        assert_eq!(
            (e.code, e.param.as_deref()),
            (ErrorCode::UnknownField, Some("x"))
        );
        let e = parse_move(br#"{"sandbox_id":"s"}"#).expect_err("no to");
        assert_eq!(e.param.as_deref(), Some("to"));
        let e = parse_move(br#"{"sandbox_id":"s","to":"b","wake":"yes"}"#).expect_err("wake");
        assert_eq!(e.param.as_deref(), Some("wake"));
        let e = parse_move(br#"{"sandbox_id":7,"to":"b"}"#).expect_err("not a string");
        assert_eq!(e.param.as_deref(), Some("sandbox_id"));
        assert_eq!(
            parse_move(b"[]").expect_err("array").code,
            ErrorCode::InvalidJson
        );
    }
}
