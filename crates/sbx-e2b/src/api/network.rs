//! E2B's egress rules of a sandbox as the node's: at create (`network.allowOut`, `denyOut`,
//! `allow_internet_access`) and while it runs (`PUT /sandboxes/{id}/network`, which replaces
//! them all: what it leaves out is cleared), put in force by the node's egress rules (a PATCH
//! of its `egress`: in force for its next connection).
//!
//! `network.rules` (E2B's header transforms) stay refused: E2B's carry each header's value
//! itself, while the node's `egress.inject` takes a named secret of the node (its value holds
//! `{secret}`, its host checked against the secret's `allowed_hosts`), so serving them would
//! mean secrets this layer makes and must delete for each sandbox, however it ends.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::{api_error, find, not_served_yet, parse_body, set, St};
use crate::e2b_error;

/// The node's egress keys of E2B's rules (`None`: nothing to say, the node's default).
/// `allow_internet_access` false is default deny, and so is a denyOut of all traffic
/// (`0.0.0.0/0`); the rest of allowOut and denyOut are the node's allow and deny (a more
/// specific rule wins, allow at a tie: E2B's "allow over deny").
pub(super) fn egress_keys(
    allow_internet_access: Option<bool>,
    allow_out: &[String],
    deny_out: &[String],
) -> Option<Map<String, Value>> {
    let all = |d: &String| d == "0.0.0.0/0" || d == "*";
    let deny: Vec<&String> = deny_out.iter().filter(|d| !all(d)).collect();
    let closed = allow_internet_access == Some(false) || deny_out.iter().any(all);
    if !closed && allow_out.is_empty() && deny.is_empty() {
        return None;
    }
    let mut e = Map::new();
    e.insert(
        "default".into(),
        json!(if closed { "deny" } else { "allow" }),
    );
    if !allow_out.is_empty() {
        e.insert("allow".into(), json!(allow_out));
    }
    if !deny.is_empty() {
        e.insert("deny".into(), json!(deny));
    }
    Some(e)
}

/// `PUT /sandboxes/{id}/network`'s body.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NetworkUpdate {
    allow_out: Option<Vec<String>>,
    deny_out: Option<Vec<String>>,
    #[serde(rename = "allow_internet_access", alias = "allowInternetAccess")]
    allow_internet_access: Option<bool>,
    rules: Option<Value>,
    egress_proxy: Option<Value>,
    dns_servers: Option<Value>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// `PUT /sandboxes/{id}/network`: the sandbox's rules replaced (204).
pub(super) async fn update(State(node): St, Path(id): Path<String>, body: Bytes) -> Response {
    let b: NetworkUpdate = match parse_body(&body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    if let Some((k, _)) = b.rest.iter().find(|(_, v)| set(&Some((*v).clone()))) {
        return e2b_error(
            StatusCode::BAD_REQUEST,
            format!("{k} is not a field this node takes"),
        );
    }
    if set(&b.rules) {
        return not_served_yet(
            "network.rules (header transforms; the node's own API has egress.inject)",
        );
    }
    if set(&b.egress_proxy) {
        return not_served_yet("network.egressProxy");
    }
    if set(&b.dns_servers) {
        return not_served_yet("network.dnsServers");
    }
    let o = match find(&node, &id) {
        Ok(o) => o,
        Err(r) => return r,
    };
    let given = egress_keys(
        b.allow_internet_access,
        b.allow_out.as_deref().unwrap_or_default(),
        b.deny_out.as_deref().unwrap_or_default(),
    )
    .unwrap_or_default();
    // Every key E2B's rules are made of: given, or null (removed).
    let mut keys = Map::new();
    for k in ["default", "allow", "deny"] {
        keys.insert(k.into(), given.get(k).cloned().unwrap_or(Value::Null));
    }
    let patch = sbx_api::SandboxPatch {
        egress: Some(Some(keys)),
        ..Default::default()
    };
    match node.patch_sandbox(&o.id, patch) {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => api_error(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn e2b_rules_are_the_node_s_keys() {
        assert_eq!(egress_keys(None, &[], &[]), None);
        assert_eq!(egress_keys(Some(true), &[], &[]), None);
        let closed = egress_keys(Some(false), &[], &[]).map(Value::Object);
        assert_eq!(closed, Some(json!({"default": "deny"})));
        let list = egress_keys(None, &s(&["1.1.1.1"]), &s(&["0.0.0.0/0", "8.8.8.8"]));
        assert_eq!(
            list.map(Value::Object),
            Some(json!({"default": "deny", "allow": ["1.1.1.1"], "deny": ["8.8.8.8"]}))
        );
        let open = egress_keys(None, &[], &s(&["8.8.8.8"])).map(Value::Object);
        assert_eq!(open, Some(json!({"default": "allow", "deny": ["8.8.8.8"]})));
        // The node's parser takes them.
        for v in [
            json!({"default": "deny", "allow": ["1.1.1.1"], "deny": ["8.8.8.8"]}),
            json!({"default": "allow", "deny": ["8.8.8.8"]}),
        ] {
            sbx_api::EgressRules::from_value(&v).expect("rules");
        }
    }
}
