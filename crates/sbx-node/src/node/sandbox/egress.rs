//! A sandbox's egress rules: checked at create, run and PATCH (their shape by sbx-api, the
//! secrets they name here), put in force before anything of the caller runs in the sandbox,
//! and changed live (`PATCH /v1/sandboxes/{id}` `{"egress": {...}}`, merged key by key).

use std::sync::Arc;

use sbx_api::egress::Egress;
use sbx_api::{ApiError, EgressRules, ErrorCode, SandboxObject, SandboxPatch};
use serde_json::Value;

use crate::node::credentials::{host_allowed, not_found};
use crate::node::sandbox::Managed;
use crate::node::Node;
use crate::sync::LockExt;

/// The rules of a request (`egress` of a run or a create, checked for their shape when it was
/// parsed), as given; `None`: not given, or null.
pub(crate) fn egress_of(given: Option<&Value>) -> Result<Option<EgressRules>, ApiError> {
    given
        .filter(|v| !v.is_null())
        .map(EgressRules::from_value)
        .transpose()
}

impl Node {
    /// The rules in force of rules as given (`None`: none given, or none that say anything),
    /// with the secrets of `inject` checked: 404 secret_not_found, 403
    /// secret_host_not_allowed. A sandbox without the node's network cannot have rules: 503
    /// not_served_here.
    pub(crate) fn check_egress(
        &self,
        given: Option<&EgressRules>,
        network: bool,
    ) -> Result<Option<Arc<Egress>>, ApiError> {
        let deny = self.cfg.egress_default_deny;
        let e = match given {
            Some(rules) => rules.rules(deny)?,
            None if deny && network => EgressRules::default().rules(true)?,
            None => return Ok(None),
        };
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
    pub(crate) fn apply_egress(&self, id: &str, e: Option<Arc<Egress>>) -> Result<(), ApiError> {
        let Some(net) = self.net.as_ref() else {
            return Ok(());
        };
        net.set_egress(id, e).map_err(|err| {
            tracing::error!(sandbox = %id, error = %err, "egress rules not set");
            ApiError::internal()
        })
    }

    /// `PATCH /v1/sandboxes/{id}` (sbx-api's [`sbx_api::parse_sandbox_patch`]): `egress` merged
    /// key by key into the sandbox's rules (a null key removes it), in force for its next
    /// connection or question; `expires_at`; `held_asleep`. The rules as merged are checked
    /// before anything changes.
    pub fn patch_sandbox(
        self: &Arc<Self>,
        id: &str,
        patch: SandboxPatch,
    ) -> Result<SandboxObject, ApiError> {
        let m = self.managed(id)?;
        let SandboxPatch {
            egress,
            expires_at,
            held_asleep,
        } = patch;
        if held_asleep.is_some() || expires_at.is_some() {
            if let Some(Some(keys)) = &egress {
                let merged = EgressRules::merge(m.egress.locked().as_ref(), keys)?;
                self.check_egress(merged.as_ref(), m.spec.network)?;
            }
        }
        if let Some(h) = held_asleep {
            self.set_held(&m, h)?;
        }
        if let Some(at) = expires_at {
            self.set_expiry(&m, at)?;
        }
        let Some(egress) = egress else {
            return Ok(self.sandbox_object(&m));
        };
        // Under the sandbox's rules' lock, as a boot puts them in force (`apply_egress_of`):
        // whichever comes second puts in force the latest.
        let mut kept = m.egress.locked();
        let merged = match &egress {
            None => None,
            Some(keys) => EgressRules::merge(kept.as_ref(), keys)?,
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
    pub(crate) fn apply_egress_of(&self, m: &Managed) -> Result<(), ApiError> {
        let kept = m.egress.locked();
        let rules = self.check_egress(kept.as_ref(), m.spec.network)?;
        self.apply_egress(&m.id, rules)
    }
}
