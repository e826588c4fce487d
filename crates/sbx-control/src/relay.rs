//! A call of one sandbox passed to a listener of its node other than the API (E2B's, the
//! preview listener), by the table, as the fleet's `/v1` passes its calls (`fleet.rs`: the
//! same lookup, the same answers while the sandbox is moved, the same one-time route again).
//!
//! While the sandbox is being moved: at `releasing` the call goes to the old node; past it
//! (taking over, going back) it is refused, 503 unavailable (the caller's front end adds
//! `Retry-After: 1`). A call the old node refused (any error status: E2B's listener and envd
//! speak their own error bodies, which do not all name `moved`) while the table was at
//! `releasing`, or after which the table names another node or epoch, waits briefly for the
//! move to end and is routed by the table again, once (where its body is small enough to send
//! twice).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use sbx_api::{ApiError, ErrorCode};

use crate::db::{DbError, NodeRow, NodeState, SandboxRow};
use crate::fleet::{self, Replay};
use crate::{machine, proxy, server::Ctl};

/// A listener of a node that the control plane forwards to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    /// `--e2b-listen`: E2B's control plane and envd.
    E2b,
    /// `--preview-listen`: `{port}-{sandbox}.{domain}`, the Host kept.
    Preview,
}

impl Listener {
    /// Where `node` serves it, when it does.
    pub fn url(self, node: &NodeRow) -> Option<&str> {
        match self {
            Listener::E2b => node.e2b_url.as_deref(),
            Listener::Preview => node.preview_url.as_deref(),
        }
    }

    fn flag(self) -> &'static str {
        match self {
            Listener::E2b => "--e2b-listen",
            Listener::Preview => "--preview-listen",
        }
    }
}

/// Why a call was not passed on (or its node did not answer).
#[derive(Debug)]
pub enum Refused {
    /// The error to answer, in the listener's own form.
    Api(ApiError),
    /// The control plane's database failed (logged here).
    Db,
}

impl From<ApiError> for Refused {
    fn from(e: ApiError) -> Refused {
        Refused::Api(e)
    }
}

fn db(rid: &str, e: &DbError) -> Refused {
    tracing::error!(request_id = %rid, error = %e, "the control plane's database failed");
    Refused::Db
}

/// The node does not serve the listener asked for.
pub fn not_served(node: &NodeRow, listener: Listener, sandbox: &str) -> ApiError {
    ApiError::new(
        ErrorCode::Unavailable,
        format!(
            "sandbox {sandbox} is on node {} ({}), which serves no {} listener (start it with {})",
            node.name,
            node.id,
            match listener {
                Listener::E2b => "E2B",
                Listener::Preview => "preview",
            },
            listener.flag()
        ),
    )
}

/// Whether an answer of the node calls for a look at the table (the node may have released
/// the sandbox).
pub fn may_have_moved(status: u16) -> bool {
    status >= 400
}

/// Whether the table names another place for the sandbox than `before`.
pub fn moved_on(before: &SandboxRow, now: Option<&SandboxRow>) -> bool {
    match now {
        Some(r) => r.node_id != before.node_id || r.epoch != before.epoch,
        None => false,
    }
}

/// The sandbox `key` (an id or a name) as the table has it, with its node: refused while it is
/// past `releasing` in a move, when its node is lost, or serves no such listener.
async fn target(
    ctl: &Ctl,
    rid: &str,
    key: &str,
    listener: Listener,
) -> Result<(SandboxRow, NodeRow, String, bool), Refused> {
    let row = match ctl.lookup(key).await {
        Ok(Some(r)) => r,
        Ok(None) => return Err(fleet::sandbox_not_found(key).into()),
        Err(e) => return Err(db(rid, &e)),
    };
    let releasing = match ctl.db.unfinished_move_of(&row.id).await {
        Ok(Some(m)) if m.step != machine::RELEASING => {
            return Err(fleet::being_moved(&row, &m).into())
        }
        Ok(m) => m.is_some(),
        Err(e) => return Err(db(rid, &e)),
    };
    let node = match ctl.db.node(&row.node_id).await {
        Ok(Some(n)) => n,
        Ok(None) => {
            return Err(ApiError::new(
                ErrorCode::Unavailable,
                format!(
                    "sandbox {} is on node {}, which the control plane's table no longer has",
                    row.id, row.node_id
                ),
            )
            .into())
        }
        Err(e) => return Err(db(rid, &e)),
    };
    if node.state == NodeState::Lost {
        return Err(fleet::node_lost(&node, &row.id).into());
    }
    let Some(url) = listener.url(&node).map(String::from) else {
        return Err(not_served(&node, listener, &row.id).into());
    };
    Ok((row, node, url, releasing))
}

/// Passes `req` to `listener` of the node that has sandbox `key`; the answer streams back.
/// The table's row and node it went to come with it.
pub async fn to_sandbox(
    ctl: &Arc<Ctl>,
    rid: &str,
    key: &str,
    listener: Listener,
    req: Request,
) -> Result<(SandboxRow, NodeRow, Response), Refused> {
    let mut pending = Some(req);
    let mut replay: Option<Replay> = None;
    for round in 0..2 {
        let (row, node, url, releasing) = target(ctl, rid, key, listener).await?;
        let req = match (pending.take(), &replay) {
            (Some(req), _) if round == 0 => match fleet::replayable(req).await {
                Ok(r) => {
                    let req = r.request();
                    replay = Some(r);
                    req
                }
                Err(req) => req,
            },
            (_, Some(r)) => r.request(),
            (Some(req), None) => req,
            (None, None) => return Err(ApiError::internal().into()),
        };
        let sent = match listener {
            Listener::E2b => proxy::forward(&ctl.client, &url, req).await,
            Listener::Preview => proxy::forward_keeping_host(&ctl.client, &url, req).await,
        };
        let resp = match sent {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(request_id = %rid, node = %node.name, error = %e, "a node did not answer");
                return Err(fleet::node_away(&node, &e).into());
            }
        };
        if round == 0 && replay.is_some() && may_have_moved(resp.status().as_u16()) {
            if releasing {
                fleet::wait_moved(ctl, &row).await;
            }
            let now = ctl.lookup(key).await.map_err(|e| db(rid, &e))?;
            if moved_on(&row, now.as_ref()) {
                tracing::info!(request_id = %rid, sandbox = %row.id, node = %node.name, "the sandbox is elsewhere now: routed again");
                continue;
            }
        }
        return Ok((row, node, resp));
    }
    Err(ApiError::internal().into())
}

/// The bytes of a body of at most `max`; `None` when it broke off or is larger.
pub async fn read_body(body: Body, max: usize) -> Option<axum::body::Bytes> {
    crate::server::read_limited(body, max).await.ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(node: &str, epoch: i64) -> SandboxRow {
        SandboxRow {
            id: "sbx-1".into(),
            name: None,
            node_id: node.into(),
            epoch,
            status: "running".into(),
            build: "b".into(),
            created_at_ms: 0,
            updated_at_ms: 0,
        }
    }

    #[test]
    fn a_call_is_routed_again_only_when_the_table_moved_on() {
        let before = row("nod-a", 1);
        assert!(!moved_on(&before, Some(&row("nod-a", 1))));
        assert!(moved_on(&before, Some(&row("nod-b", 4))));
        // Taken back onto the same node (a reclaim): a new epoch, routed again.
        assert!(moved_on(&before, Some(&row("nod-a", 3))));
        // Deleted meanwhile: the node's answer stands.
        assert!(!moved_on(&before, None));
        assert!(may_have_moved(409) && may_have_moved(404) && may_have_moved(502));
        assert!(!may_have_moved(200) && !may_have_moved(101) && !may_have_moved(307));
    }

    #[test]
    fn a_listener_is_the_node_s_when_it_serves_one() {
        let mut n = NodeRow {
            id: "nod-a".into(),
            name: "a".into(),
            url: "http://127.0.0.1:1".into(),
            state: NodeState::Ready,
            lease_until_ms: 0,
            build: "b".into(),
            capacity: Default::default(),
            registered_at_ms: 0,
            heartbeat_at_ms: 0,
            e2b_url: Some("http://127.0.0.1:2".into()),
            preview_url: None,
        };
        assert_eq!(Listener::E2b.url(&n), Some("http://127.0.0.1:2"));
        assert_eq!(Listener::Preview.url(&n), None);
        let e = not_served(&n, Listener::Preview, "sbx-1");
        assert_eq!(e.code, ErrorCode::Unavailable);
        assert!(e.message.contains("--preview-listen"), "{}", e.message);
        n.preview_url = Some("http://127.0.0.1:3".into());
        assert_eq!(Listener::Preview.url(&n), Some("http://127.0.0.1:3"));
    }
}
