//! E2B's snapshots as the node's: `POST /sandboxes/{id}/snapshots` is the node's snapshot of
//! a running sandbox (its processes and files at one instant), `GET /snapshots` lists the
//! node's snapshots (by sandbox, by name, paged), `DELETE /templates/{id}` deletes one (E2B's
//! snapshots are templates), and a create whose `templateID` is a snapshot's id goes on from
//! it (the node's create from a snapshot).
//!
//! E2B's names are free text; the node's are DNS labels. An E2B name is kept as the node's
//! name `e2b-` + its bytes, `[a-z0-9]` as they are and any other byte as `-` and two hex
//! digits (`my_snap` is `e2b-my-5fsnap`), read back the same way.

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use sbx_api::{ErrorCode, SnapshotObject};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{api_error, find, not_served_yet, page_limit, parse_body, query_one, query_pairs, St};
use crate::e2b_error;
use crate::node::Node;

/// The prefix of the node's name of a snapshot E2B named.
const NAME_PREFIX: &str = "e2b-";
/// The longest name of the node (a DNS label).
const MAX_NODE_NAME: usize = 63;

/// Whether E2B's `templateID` of a create names one of the node's snapshots (by its id).
pub(super) fn is_snapshot_id(template: &str) -> bool {
    template.starts_with("snap-")
}

/// The node's name of E2B's snapshot name `name`; `None` when it is too long to be one.
fn node_name(name: &str) -> Option<String> {
    let mut out = String::from(NAME_PREFIX);
    for b in name.bytes() {
        if b.is_ascii_lowercase() || b.is_ascii_digit() {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("-{b:02x}"));
        }
    }
    (!name.is_empty() && out.len() <= MAX_NODE_NAME).then_some(out)
}

/// E2B's name of a snapshot the node names `name` (one E2B named, read back; any other name
/// as it is).
fn e2b_name(name: &str) -> String {
    let Some(rest) = name.strip_prefix(NAME_PREFIX) else {
        return name.to_string();
    };
    let mut out = Vec::with_capacity(rest.len());
    let b = rest.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'-' {
            let byte = rest
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            match byte {
                Some(byte) => out.push(byte),
                None => return name.to_string(),
            }
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).unwrap_or_else(|_| name.to_string())
}

/// E2B's `SnapshotInfo` of a snapshot of the node.
fn info(s: &SnapshotObject) -> Value {
    let names: Vec<String> = s.name.iter().map(|n| e2b_name(n)).collect();
    json!({ "snapshotID": s.id, "names": names })
}

/// A node without checkpoints (no CRIU) takes no snapshot: 501 as for anything not served.
fn refused(node: &Node) -> Option<Response> {
    node.checkpointer()
        .err()
        .map(|e| not_served_yet(&format!("snapshots and forks of a sandbox ({})", e.message)))
}

/// Sandbox `id` in use while a snapshot of it is taken (this call is the one use the snapshot
/// lets go on: any other, a command's stream, makes it wait, then 503). One that sleeps
/// after its timeout (`autoResume`) is woken; one paused (held asleep): 409, connect resumes
/// it first.
pub(super) async fn in_use(
    node: &std::sync::Arc<Node>,
    id: &str,
) -> Result<Option<crate::node::sandbox::sleep::InUse>, Response> {
    match node.use_sandbox_port(id).await {
        None => Ok(None),
        Some(Ok(h)) => Ok(Some(h)),
        Some(Err(e)) if e.code == ErrorCode::SandboxPaused => Err(e2b_error(
            StatusCode::CONFLICT,
            format!("sandbox {id} is paused: connect resumes it"),
        )),
        Some(Err(e)) => Err(api_error(e)),
    }
}

/// `POST /sandboxes/{id}/snapshots`'s body.
#[derive(Debug, Deserialize)]
struct SnapshotBody {
    name: Option<String>,
    /// false: a filesystem-only snapshot (a cold boot from it), which the node does not take.
    memory: Option<bool>,
}

/// `POST /sandboxes/{id}/snapshots`: the node's snapshot of the running sandbox (it runs on),
/// 201 with E2B's `SnapshotInfo`.
pub(super) async fn create(State(node): St, Path(id): Path<String>, body: Bytes) -> Response {
    if let Some(r) = refused(&node) {
        return r;
    }
    let b: SnapshotBody = match parse_body(&body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    if b.memory == Some(false) {
        return not_served_yet("a filesystem-only snapshot (memory: false)");
    }
    let name = match b.name.as_deref().filter(|n| !n.is_empty()) {
        None => None,
        Some(n) => match node_name(n) {
            Some(n) => Some(n),
            None => {
                return e2b_error(
                    StatusCode::BAD_REQUEST,
                    format!("the snapshot name {n:?} is too long for this node"),
                )
            }
        },
    };
    let o = match find(&node, &id) {
        Ok(o) => o,
        Err(r) => return r,
    };
    let _in_use = match in_use(&node, &o.id).await {
        Ok(h) => h,
        Err(r) => return r,
    };
    match node.snapshot_sandbox(&o.id, name).await {
        Ok(s) => (StatusCode::CREATED, Json(info(&s))).into_response(),
        Err(e) => api_error(e),
    }
}

/// `GET /snapshots?sandboxID=&name=&limit=&nextToken=`: the node's snapshots (`name`: E2B's
/// name or the id), the newest first, paged by `X-Next-Token` (the id of a page's last one).
pub(super) async fn list(State(node): St, RawQuery(q): RawQuery) -> Response {
    let pairs = query_pairs(q.as_deref());
    let one = |name: &str| query_one(&pairs, name);
    let limit = match page_limit(one("limit")) {
        Ok(n) => n,
        Err(r) => return r,
    };
    let mut all = match node.list_snapshots() {
        Ok(l) => l,
        Err(e) => return api_error(e),
    };
    let (sandbox, name) = (one("sandboxID"), one("name"));
    all.retain(|s| {
        sandbox.is_none_or(|id| s.sandbox_id == id)
            && name.is_none_or(|n| s.id == n || s.name.as_deref().is_some_and(|m| e2b_name(m) == n))
    });
    let key = |s: &SnapshotObject| (sbx_api::parse_rfc3339(&s.created_at), s.id.clone());
    all.sort_by_key(|s| std::cmp::Reverse(key(s)));
    let from = match one("nextToken") {
        None => 0,
        Some(t) => match all.iter().position(|s| s.id == t) {
            Some(i) => i + 1,
            None => {
                return e2b_error(
                    StatusCode::BAD_REQUEST,
                    format!("nextToken {t:?} is not a snapshot of this node's list"),
                )
            }
        },
    };
    let page: Vec<&SnapshotObject> = all.iter().skip(from).take(limit).collect();
    let next = (from + page.len() < all.len())
        .then(|| page.last().map(|s| s.id.clone()))
        .flatten();
    let items: Vec<Value> = page.iter().map(|s| info(s)).collect();
    let mut r = Json(Value::Array(items)).into_response();
    if let Some(Ok(v)) = next.map(|n| HeaderValue::from_str(&n)) {
        r.headers_mut().insert("x-next-token", v);
    }
    r
}

/// `DELETE /templates/{id}` of a snapshot (by its id or E2B's name): 204, 404 when there is
/// none (a template built through E2B's API is deleted by `templates.rs` first). The node's
/// own templates (`img-…`) are not deleted through E2B's API: 501.
pub(super) async fn delete(node: &std::sync::Arc<Node>, id: &str) -> Response {
    let id = id.to_string();
    let found = node
        .get_snapshot(&id)
        .ok()
        .filter(|_| is_snapshot_id(&id))
        .or_else(|| node_name(&id).and_then(|n| node.get_snapshot(&n).ok()));
    let Some(s) = found else {
        if id.starts_with("img-") {
            return super::not_yet_templates().await;
        }
        return e2b_error(
            StatusCode::NOT_FOUND,
            format!("no snapshot {id} on this node"),
        );
    };
    match node.delete_snapshot(&s.id).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) if e.code == ErrorCode::SnapshotNotFound => e2b_error(
            StatusCode::NOT_FOUND,
            format!("no snapshot {id} on this node"),
        ),
        Err(e) => api_error(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_create_of_a_snapshot_s_id_goes_on_from_it() {
        let new = |v: Value| -> super::super::NewSandbox { serde_json::from_value(v).unwrap() };
        let n = new(json!({"templateID": "snap-0123456789abcdef", "timeout": 30, "envVars": {}}));
        let b = super::super::node_create_body(&n, 0, true).unwrap();
        assert_eq!(b["snapshot"], "snap-0123456789abcdef");
        assert!(b.get("image").is_none() && b.get("template").is_none());
        sbx_api::parse_sandbox_create(b.to_string().as_bytes()).unwrap();
        // Its environment is the snapshot's processes': envVars are refused, not ignored.
        let n = new(json!({"templateID": "snap-0123456789abcdef", "envVars": {"A": "1"}}));
        let refused = super::super::node_create_body(&n, 0, true).unwrap_err();
        assert_eq!(refused.status(), StatusCode::NOT_IMPLEMENTED);
    }

    #[test]
    fn e2b_names_are_node_names_and_back() {
        for n in ["snap-filter-test_ab12cd34", "team/My Snap:v2", "plain", "ü"] {
            let node = node_name(n).expect("short enough");
            assert!(sbx_api::valid_name(&node), "{node}");
            assert_eq!(e2b_name(&node), n);
        }
        assert_eq!(node_name("my_snap").as_deref(), Some("e2b-my-5fsnap"));
        assert!(node_name("").is_none());
        assert!(node_name(&"X".repeat(30)).is_none());
        // A name the node's own API gave is shown as it is.
        assert_eq!(e2b_name("nightly"), "nightly");
        assert_eq!(e2b_name("e2b-bad-zz"), "e2b-bad-zz");
    }
}
