//! The bodies of a move between nodes: what the control plane sends a node and what the node
//! answers (`POST /internal/sandboxes/{id}/release`, `…/takeover`, `…/forget` of the node's
//! document), and the move object of the control plane (`/internal/moves`).
//!
//! The epoch rule: the table holds a sandbox at epoch E on its node; a move releases it there
//! at E, the new node takes it over at E+1, the old one takes it back at E+2 (the new one
//! refused), and from the object store at E+3 (the old one kept nothing).
//!
//! Requests are parsed strictly (unknown fields refused): [`parse_release`],
//! [`parse_takeover`], [`parse_forget`].

use serde::{Deserialize, Serialize};

use crate::error::{ApiError, ErrorCode};

/// `POST /internal/sandboxes/{id}/release`: the node puts the sandbox to sleep (if it runs),
/// waits until the store holds that sleep, and from then answers every call for it 409
/// `moved` (with `to` and `epoch`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseRequest {
    /// The epoch the control plane's table holds the sandbox at: the node's own must be it
    /// (else 409 `wrong_epoch`).
    pub epoch: u64,
    /// The node it goes to, as the control plane names it (its name).
    pub to: String,
    /// The move it is of (`mov-…`): a release asked again for the same move answers as the
    /// first did.
    pub move_id: String,
}

/// A released sandbox's files where the old node keeps them, for a new node on the same
/// machine (`host` equal to its own) to read directly instead of through the store.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalCopy {
    /// The machine and its boot (`/etc/machine-id` `:` the boot id): a node compares it to
    /// its own.
    pub host: String,
    /// CRIU's images of the sleep (a directory).
    pub memory: String,
    /// The sandbox's files (its overlay's upper directory).
    pub disk: String,
}

/// What the store holds of the sleep a release waited for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredSleep {
    /// The epoch folder it is in (`sandboxes/<id>/e<epoch>/`).
    pub epoch: u64,
    /// The sleep's generation (its parts are named with it).
    pub generation: u64,
    /// The build that wrote its memory.
    pub build: String,
    /// The image its disk is over.
    pub image: String,
    /// Plain and stored (compressed) bytes of its parts.
    pub bytes: u64,
    pub stored_bytes: u64,
}

/// The answer of a release (200).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseAnswer {
    pub sandbox_id: String,
    /// The epoch it was released at.
    pub epoch: u64,
    pub to: String,
    pub move_id: String,
    /// Whether it ran when the release came (it was put to sleep by it).
    pub slept: bool,
    /// What the store holds of it.
    pub stored: StoredSleep,
    /// How long the release waited for the store, ms.
    pub waited_ms: u64,
    /// Where its files are on this node's machine (null: they are not kept readable).
    pub local: Option<LocalCopy>,
}

/// The node a takeover comes from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FromNode {
    pub id: String,
    pub name: String,
    pub url: String,
    /// The release's `local`: read directly where the machine is this node's.
    #[serde(default)]
    pub local: Option<LocalCopy>,
}

/// `POST /internal/sandboxes/{id}/takeover`: the node makes the sandbox its own at `epoch`
/// from the old node's files (same machine) or from the store, and wakes it if asked.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TakeoverRequest {
    /// Higher than every epoch the node knows the sandbox at (else 409 `wrong_epoch`).
    pub epoch: u64,
    pub from: FromNode,
    /// Take it from the object store alone (a restore: E+3).
    #[serde(default)]
    pub from_store: bool,
    /// Wake it once it is here.
    #[serde(default)]
    pub wake: bool,
    /// The old node takes back its own released copy (E+2): 404 `sandbox_not_found` when it
    /// kept none (the control plane then restores it from the store).
    #[serde(default)]
    pub reclaim: bool,
    #[serde(default)]
    pub move_id: Option<String>,
}

/// Where a takeover took the sandbox from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TakeoverSource {
    /// The old node's files on this machine.
    Disk,
    /// The object store.
    Store,
    /// Its own released copy (a reclaim).
    Kept,
}

/// The answer of a takeover (200).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TakeoverAnswer {
    pub sandbox_id: String,
    pub epoch: u64,
    pub source: TakeoverSource,
    /// How long bringing its disk and its memory took, ms.
    pub disk_ms: u64,
    pub memory_ms: u64,
    /// The bytes of its memory images.
    pub memory: u64,
    /// Whether it was woken (it runs now).
    pub woke: bool,
}

/// `POST /internal/sandboxes/{id}/forget`: the node removes what it keeps of a sandbox it
/// released (or took over, or was taking over) at an epoch up to `epoch`, and remembers that
/// it is gone at it (a later call: 409 `moved`; a late takeover at it or below:
/// `wrong_epoch`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForgetRequest {
    pub epoch: u64,
    /// Where it is now, as the control plane names it (for the `moved` answers).
    #[serde(default)]
    pub to: Option<String>,
}

/// The answer of a forget (200).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForgetAnswer {
    pub sandbox_id: String,
    pub epoch: u64,
    /// Whether something of it was here to remove.
    pub removed: bool,
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8], what: &str) -> Result<T, ApiError> {
    let v: serde_json::Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            ErrorCode::InvalidJson,
            format!("the body of a {what} is not JSON: {e}"),
        )
    })?;
    if !v.is_object() {
        return Err(ApiError::new(
            ErrorCode::InvalidJson,
            format!("the body of a {what} is not a JSON object"),
        ));
    }
    serde_json::from_value(v).map_err(|e| {
        let text = e.to_string();
        let code = if text.starts_with("unknown field") {
            ErrorCode::UnknownField
        } else {
            ErrorCode::InvalidField
        };
        ApiError::new(code, format!("a {what}: {text}"))
    })
}

fn epoch_at_least_one(epoch: u64) -> Result<(), ApiError> {
    if epoch == 0 {
        return Err(
            ApiError::new(ErrorCode::InvalidField, "epoch is at least 1").with_param("epoch"),
        );
    }
    Ok(())
}

/// The body of a release.
pub fn parse_release(body: &[u8]) -> Result<ReleaseRequest, ApiError> {
    let r: ReleaseRequest = parse(body, "release")?;
    epoch_at_least_one(r.epoch)?;
    if !crate::ids::is_id("mov", &r.move_id) {
        return Err(
            ApiError::new(ErrorCode::InvalidField, "move_id is a move's id (mov-…)")
                .with_param("move_id"),
        );
    }
    Ok(r)
}

/// The body of a takeover.
pub fn parse_takeover(body: &[u8]) -> Result<TakeoverRequest, ApiError> {
    let r: TakeoverRequest = parse(body, "takeover")?;
    epoch_at_least_one(r.epoch)?;
    Ok(r)
}

/// The body of a forget.
pub fn parse_forget(body: &[u8]) -> Result<ForgetRequest, ApiError> {
    let r: ForgetRequest = parse(body, "forget")?;
    epoch_at_least_one(r.epoch)?;
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_release_is_parsed_strictly() {
        let ok = parse_release(br#"{"epoch":3,"to":"b","move_id":"mov-0123456789abcdef"}"#)
            .expect("a release");
        assert_eq!(ok.epoch, 3);
        let e = parse_release(br#"{"epoch":3,"to":"b","move_id":"mov-0123456789abcdef","x":1}"#)
            .expect_err("unknown field");
        assert_eq!(e.code, ErrorCode::UnknownField);
        let e = parse_release(br#"{"epoch":0,"to":"b","move_id":"mov-0123456789abcdef"}"#)
            .expect_err("epoch 0");
        assert_eq!(e.param.as_deref(), Some("epoch"));
        let e = parse_release(br#"{"epoch":1,"to":"b","move_id":"sbx-0123456789abcdef"}"#)
            .expect_err("not a move id");
        assert_eq!(e.param.as_deref(), Some("move_id"));
        assert_eq!(
            parse_release(b"[1]").expect_err("array").code,
            ErrorCode::InvalidJson
        );
    }

    #[test]
    fn a_takeover_defaults_its_flags() {
        let t = parse_takeover(br#"{"epoch":2,"from":{"id":"nod-a","name":"a","url":"http://x"}}"#)
            .expect("a takeover");
        assert!(!t.from_store && !t.wake && !t.reclaim);
        assert_eq!(t.from.local, None);
        let back: TakeoverRequest =
            serde_json::from_value(serde_json::to_value(&t).expect("json")).expect("parsed");
        assert_eq!(back, t);
    }

    #[test]
    fn sources_are_lowercase() {
        assert_eq!(
            serde_json::to_value(TakeoverSource::Kept).expect("json"),
            serde_json::json!("kept")
        );
    }
}
