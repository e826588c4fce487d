//! The functions interface (`sandbox::*`): the S-code table (code -> type, retryable, docs
//! anchor), the HTTP status of each type, the mapping of the HTTP API's [`ErrorCode`]s to
//! S-codes, and the one error shape `{code, type, message, retryable, docs_url}`.

use serde_json::{json, Value};

use crate::{ApiError, ErrorCode};

mod schemas;
pub use schemas::{describe, schemas, FUNCTIONS};

/// The docs page the S-codes' anchors (`#S001`…) are on, unless the node is told another.
pub const DEFAULT_DOCS_BASE: &str = "https://iii.dev/docs/sandbox#";

/// The contract version of `sandbox::*` this node implements (1.1: replies carry
/// `stdout_truncated` / `stderr_truncated`).
pub const CONTRACT: &str = "1.1";

/// One S-code of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SCode {
    /// `S001`…
    pub code: &'static str,
    /// `validation`, `config`, `internal`, `transient`, `execution`, `filesystem`, `platform`.
    pub kind: &'static str,
    /// Whether the same call may pass later without anything else changing.
    pub retryable: bool,
    /// The table's text.
    pub summary: &'static str,
}

const fn s(
    code: &'static str,
    kind: &'static str,
    retryable: bool,
    summary: &'static str,
) -> SCode {
    SCode {
        code,
        kind,
        retryable,
        summary,
    }
}

/// The S-code table. `retryable` is true for the `transient` codes, and for S003 (a slot frees
/// when an in-flight exec ends).
pub const S_CODES: [SCode; 30] = [
    s(
        "S001",
        "validation",
        false,
        "request payload failed validation",
    ),
    s("S002", "validation", false, "sandbox not found"),
    s(
        "S003",
        "validation",
        true,
        "sandbox is at its exec concurrency cap",
    ),
    s(
        "S004",
        "validation",
        false,
        "sandbox already stopped; create a new one",
    ),
    s("S100", "config", false, "image not in catalog or allowlist"),
    s("S101", "internal", false, "rootfs missing on disk"),
    s(
        "S102",
        "transient",
        true,
        "auto-install pull/extract failed; retry",
    ),
    s("S200", "execution", false, "exec exceeded timeout_ms"),
    s("S210", "filesystem", false, "fs op rejected as invalid"),
    s("S211", "filesystem", false, "path does not exist"),
    s(
        "S212",
        "filesystem",
        false,
        "path is wrong type (file vs dir)",
    ),
    s("S213", "filesystem", false, "path already exists"),
    s("S214", "filesystem", false, "directory is not empty"),
    s("S215", "filesystem", false, "permission denied"),
    s("S216", "filesystem", false, "generic fs I/O failure"),
    s(
        "S217",
        "filesystem",
        false,
        "invalid regex/pattern in grep or sed",
    ),
    s(
        "S218",
        "transient",
        true,
        "fs streaming channel aborted mid-flight; retry",
    ),
    s(
        "S219",
        "filesystem",
        false,
        "fs op unsupported by this supervisor",
    ),
    s(
        "S300",
        "platform",
        false,
        "VM boot or supervisor session failure",
    ),
    s("S301", "transient", true, "AdapterUnavailable"),
    s("S302", "config", false, "ContractMismatch"),
    s("S303", "config", false, "NoAdapterConfigured"),
    s("S304", "platform", false, "OperationUnsupported"),
    s(
        "S400",
        "config",
        false,
        "resource limit exceeded (cpu/memory/concurrency cap)",
    ),
    s("S501", "validation", false, "SourceRejected"),
    s("S502", "validation", false, "StateBusy"),
    s("S503", "validation", false, "InstanceMismatch"),
    s("S504", "validation", false, "VmNotFound"),
    s("S505", "validation", false, "Unauthorized"),
    s("S506", "transient", true, "PrepareFailed; retry"),
];

/// The entry of a code (`None` for a code not in the table).
pub fn s_code(code: &str) -> Option<&'static SCode> {
    S_CODES.iter().find(|c| c.code == code)
}

/// The HTTP status of a failed `POST /v1/functions/…`, from the S-code's type.
pub fn kind_status(kind: &str) -> u16 {
    match kind {
        "validation" => 400,
        "config" => 422,
        "execution" => 408,
        "filesystem" => 422,
        "transient" => 503,
        "platform" => 502,
        _ => 500,
    }
}

/// A failed `sandbox::*` call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FnError {
    pub code: &'static SCode,
    pub message: String,
}

impl FnError {
    /// An error of `code` (an unknown code is S300).
    pub fn new(code: &str, message: impl Into<String>) -> FnError {
        FnError {
            code: s_code(code).unwrap_or(&S_CODES[18]),
            message: message.into(),
        }
    }

    /// S001 with a message.
    pub fn invalid(message: impl Into<String>) -> FnError {
        FnError::new("S001", message)
    }

    /// The HTTP status of this error's answer.
    pub fn status(&self) -> u16 {
        kind_status(self.code.kind)
    }

    /// `{code, type, message, retryable, docs_url}`.
    pub fn body(&self, docs_base: &str) -> Value {
        json!({
            "code": self.code.code,
            "type": self.code.kind,
            "message": self.message,
            "retryable": self.code.retryable,
            "docs_url": format!("{docs_base}{}", self.code.code),
        })
    }
}

/// A call's payload as the functions read it: an object (null is none; anything else is
/// S001), without the fields an engine adds (names starting with `_`: the iii engine's
/// `_caller_worker_id` on every call, its queue bridges' `__traceparent` and `__baggage`), so
/// that no function reads them as its own (any other unknown field is still S001). The node's
/// and the control plane's dispatch both read payloads so.
pub fn call_payload(
    payload: serde_json::Value,
) -> Result<serde_json::Map<String, serde_json::Value>, FnError> {
    let mut payload = match payload {
        serde_json::Value::Object(m) => m,
        serde_json::Value::Null => serde_json::Map::new(),
        _ => return Err(FnError::invalid("the payload is not a JSON object")),
    };
    payload.retain(|k, _| !k.starts_with('_'));
    Ok(payload)
}

/// The S-code of an error of the HTTP API's actions.
pub fn s_code_of(err: &ApiError) -> &'static str {
    use ErrorCode::*;
    if let Some(s) = err.code.s_code() {
        return s;
    }
    let param = err.param.as_deref().unwrap_or("");
    match err.code {
        SandboxNotFound => "S002",
        TooManyCommands => "S003",
        SandboxNotRunning => "S004",
        NotServedHere if param == "image" => "S100",
        ImageNotAllowed => "S100",
        NotServedHere => "S304",
        NoCapacity | MemoryFull | DriveFull => "S400",
        InvalidField if param.starts_with("limits.") => "S400",
        SandboxFailed | CommandLost | Unavailable | Internal | CallerGone => "S300",
        // The node cannot serve it now and will (it renews its lease; a control plane takes
        // the lease): the same call again later.
        Fenced | Standby | CopyBehind | TakeoverFailed => "S301",
        _ => "S001",
    }
}

impl From<ApiError> for FnError {
    fn from(e: ApiError) -> FnError {
        let message = match &e.param {
            Some(p) => format!("{} ({p})", e.message),
            None => e.message.clone(),
        };
        FnError::new(s_code_of(&e), message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_unique_and_retryable_is_transient_or_s003() {
        let mut codes: Vec<&str> = S_CODES.iter().map(|c| c.code).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), S_CODES.len());
        for c in S_CODES {
            assert_eq!(
                c.retryable,
                c.kind == "transient" || c.code == "S003",
                "{}",
                c.code
            );
        }
        assert_eq!(FnError::new("S999", "x").code.code, "S300");
    }

    #[test]
    fn api_errors_map_to_s_codes() {
        let e = |c, p: Option<&str>| {
            let mut e = ApiError::new(c, "m");
            e.param = p.map(String::from);
            FnError::from(e).code.code
        };
        assert_eq!(e(ErrorCode::SandboxNotFound, None), "S002");
        assert_eq!(e(ErrorCode::TooManyCommands, None), "S003");
        assert_eq!(e(ErrorCode::SandboxNotRunning, None), "S004");
        assert_eq!(e(ErrorCode::NotServedHere, Some("image")), "S100");
        assert_eq!(e(ErrorCode::PathNotFound, None), "S211");
        assert_eq!(e(ErrorCode::BadPattern, None), "S217");
        assert_eq!(e(ErrorCode::InvalidField, Some("limits.vcpus")), "S400");
        assert_eq!(e(ErrorCode::InvalidEnv, Some("env.X")), "S001");
        let b = FnError::new("S003", "full").body("https://d/#");
        assert_eq!(b["retryable"], true);
        assert_eq!(b["docs_url"], "https://d/#S003");
        assert_eq!(b["type"], "validation");
    }
}
