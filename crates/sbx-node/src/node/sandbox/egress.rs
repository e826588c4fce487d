//! A sandbox's egress rules: checked at create, run and PATCH (their shape by sbx-api, the
//! secrets they name here), put in force before anything of the caller runs in the sandbox,
//! and changed live (`PATCH /v1/sandboxes/{id}` `{"egress": {...}}`, merged key by key).

use std::sync::Arc;

use sbx_api::egress::{merge, Egress};
use sbx_api::{ApiError, ErrorCode, SandboxObject};
use serde_json::Value;

use crate::node::credentials::{host_allowed, not_found};
use crate::node::sandbox::Managed;
use crate::node::Node;
use crate::sync::LockExt;

impl Node {
    /// The rules of a create or a run (`None`: none given, or none that say anything), with
    /// the secrets of `inject` checked: 404 secret_not_found, 403 secret_host_not_allowed.
    /// A sandbox without the node's network cannot have rules: 503 not_served_here.
    pub fn check_egress(
        &self,
        given: Option<&Value>,
        network: bool,
    ) -> Result<Option<Arc<Egress>>, ApiError> {
        let mut v = match given.filter(|v| !v.is_null()) {
            Some(v) => v.clone(),
            None if self.cfg.egress_default_deny && network => serde_json::json!({}),
            None => return Ok(None),
        };
        if let Some(obj) = v.as_object_mut() {
            if self.cfg.egress_default_deny && obj.get("default").is_none_or(Value::is_null) {
                obj.insert("default".into(), Value::from("deny"));
            }
        }
        let e = Egress::parse(&v)?;
        if e == Egress::default() {
            return Ok(None);
        }
        if !network {
            let why = if self.has_net() {
                "this sandbox has no network (network: false): egress rules have nothing to hold"
            } else {
                "this node gives sandboxes no network (--egress-default none): it puts no egress \
                 rules in force"
            };
            return Err(ApiError::new(ErrorCode::NotServedHere, why).with_param("egress"));
        }
        for (i, inj) in e.inject.iter().enumerate() {
            let Some(row) = self.secret_row(&inj.secret)? else {
                return Err(not_found(
                    &inj.secret,
                    Some(&format!("egress.inject[{i}].secret")),
                ));
            };
            let host = inj.host.as_text();
            if !host_allowed(row.allowed_hosts.as_deref(), &host) {
                let allowed = row.allowed_hosts.clone().unwrap_or_default();
                return Err(ApiError::new(
                    ErrorCode::SecretHostNotAllowed,
                    format!(
                        "secret {} may not go to {host}: its allowed_hosts are [{}]",
                        inj.secret,
                        allowed.join(", ")
                    ),
                )
                .with_param(format!("egress.inject[{i}].host"))
                .with_beside("allowed_hosts", serde_json::json!(allowed)));
            }
        }
        Ok(Some(Arc::new(e)))
    }

    /// Puts sandbox `id`'s rules in force (its namespace leased already); a failure is a 500
    /// (the sandbox must not run without its rules).
    pub fn apply_egress(&self, id: &str, e: Option<Arc<Egress>>) -> Result<(), ApiError> {
        let Some(net) = self.net.as_ref() else {
            return Ok(());
        };
        net.set_egress(id, e).map_err(|err| {
            tracing::error!(sandbox = %id, error = %err, "egress rules not set");
            ApiError::internal()
        })
    }

    /// `PATCH /v1/sandboxes/{id}`: `{"egress": {...}}` merged key by key into the sandbox's
    /// rules (a null key removes it), in force for its next connection or question.
    pub fn patch_sandbox(
        self: &Arc<Self>,
        id: &str,
        body: &Value,
    ) -> Result<SandboxObject, ApiError> {
        let Some(obj) = body.as_object() else {
            return Err(ApiError::new(
                ErrorCode::InvalidJson,
                "the body is not a JSON object",
            ));
        };
        if let Some(k) = obj
            .keys()
            .find(|k| !matches!(k.as_str(), "egress" | "expires_at" | "held_asleep"))
        {
            return Err(ApiError::new(
                ErrorCode::UnknownField,
                format!(
                    "{k} is not a field this call takes (egress, expires_at and held_asleep are)"
                ),
            )
            .with_param(k.clone()));
        }
        let m = self.managed(id)?;
        let held = match obj.get("held_asleep") {
            None => None,
            Some(Value::Null) => Some(false),
            Some(Value::Bool(b)) => Some(*b),
            Some(_) => {
                return Err(ApiError::invalid_field(
                    "held_asleep",
                    "held_asleep must be true, false or null",
                ))
            }
        };
        let expires_at = match obj.get("expires_at") {
            None => None,
            Some(Value::Null) => Some(None),
            Some(Value::String(s)) => Some(Some(s.clone())),
            Some(_) => {
                return Err(ApiError::invalid_field(
                    "expires_at",
                    "expires_at must be an RFC 3339 time or null",
                ))
            }
        };
        if let Some(h) = held {
            // The rules are checked before anything changes.
            if let Some(e) = obj.get("egress").filter(|e| e.is_object()) {
                let merged = merge(m.egress.locked().as_ref(), e);
                self.check_egress(merged.as_ref(), m.spec.network)?;
            }
            self.set_held(&m, h)?;
        }
        if let Some(at) = expires_at {
            if let Some(e) = obj.get("egress") {
                // Both or neither: the rules are checked before the expiry changes.
                let merged = merge(m.egress.locked().as_ref(), e);
                if !e.is_null() {
                    self.check_egress(merged.as_ref(), m.spec.network)?;
                }
            }
            self.set_expiry(&m, at)?;
        }
        let Some(patch) = obj.get("egress") else {
            return Ok(self.sandbox_object(&m));
        };
        // Under the sandbox's rules' lock, as a boot puts them in force (`apply_egress_of`):
        // whichever comes second puts in force the latest.
        let mut kept = m.egress.locked();
        let current = kept.clone();
        let merged = if patch.is_null() {
            None
        } else {
            if !patch.is_object() {
                return Err(ApiError::new(
                    ErrorCode::InvalidEgress,
                    "egress must be an object or null",
                )
                .with_param("egress"));
            }
            merge(current.as_ref(), patch)
        };
        let rules = self.check_egress(merged.as_ref(), m.spec.network)?;
        let mut spec = m.spec.clone();
        spec.egress = merged.clone();
        spec.expires_at = m.expiry.locked().0.clone();
        spec.held_asleep = m.held.load(std::sync::atomic::Ordering::SeqCst);
        let json = serde_json::to_string(&spec)
            .map_err(crate::node::internal("a sandbox's spec as JSON"))?;
        self.store
            .update_sandbox_spec(&m.id, &json)
            .map_err(super::store_err)?;
        *kept = merged;
        if m.machine.locked().is_some() {
            self.apply_egress(&m.id, rules)?;
        }
        drop(kept);
        Ok(self.sandbox_object(&m))
    }

    /// Puts a kept sandbox's current rules in force (at each boot, before its start command).
    pub fn apply_egress_of(&self, m: &Managed) -> Result<(), ApiError> {
        let kept = m.egress.locked();
        let rules = self.check_egress(kept.as_ref(), m.spec.network)?;
        self.apply_egress(&m.id, rules)
    }
}
