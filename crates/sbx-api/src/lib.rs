//! Wire types of the sbx HTTP API: requests, replies, events, ids, names and the error-code
//! table. No I/O (except the OS's randomness for new ids).
//!
//! - [`ids`]: new ids (`sbx-…`, `exe-…`), request ids, names.
//! - [`error`]: [`ErrorCode`] (code -> type, status, retryable), [`ApiError`], [`error_body`].
//! - [`run`]: `POST /v1/run`'s body, parsed and validated: [`parse_run_request`].
//! - [`exec`]: the exec object a run answers with, signal names, RFC 3339 times.
//! - [`events`]: the kinds of a command's event stream, their data and their framing.
//! - [`sandbox`], [`volume`], [`secret`], [`egress`], [`template`]: the other calls' bodies
//!   and objects.
//! - [`files`]: the parameters of a sandbox's file calls and the objects they answer with.
//! - [`moves`]: the bodies of a move between nodes (release, takeover, forget).
//! - [`Field`]: a key of an object absent, null or a value, kept as it came.
//!
//! Each request type the node parses is written back by its `to_json` (`RunRequest`,
//! `SandboxCreate`, `ExecRequest`, `SandboxPatch`, `VolumeCreate`, `SecretPut`, `Egress`) as
//! the body that parses to the same value: what a client (sbx-client) sends.

#![forbid(unsafe_code)]

pub mod egress;
pub mod error;
pub mod events;
pub mod exec;
mod field;
pub mod files;
pub mod functions;
pub mod ids;
pub mod moves;
pub mod preview;
pub mod run;
pub mod sandbox;
pub mod secret;
pub mod template;
pub mod volume;

pub use egress::EgressRules;
pub use error::{error_body, ApiError, ErrorBody, ErrorCode, ErrorDetail};
pub use events::{sse, sse_event, EventKind, GapData, OutputData};
pub use exec::{
    format_rfc3339_millis, parse_rfc3339, signal_field, signal_name, signal_number, ExecFailKind,
    ExecObject, ExecObjectKind, ExecStatus, ExecUsage, OutputInfo,
};
pub use field::Field;
pub use functions::{s_code, s_code_of, FnError, SCode, S_CODES};
pub use ids::{
    derived_id, is_id, new_id, new_request_id, request_id_or_new, valid_name, valid_request_id,
};
pub use run::{
    ms_to_seconds, parse_run_request, parse_run_value, run_timeout, seconds_to_ms,
    validate_idempotency_key, Command, Encoding, Init, Limits, OnExpiry, Ready, Region, RunRequest,
    SecretEnv, Stop, Tmp, VolumeMount,
};
pub use sandbox::{
    exec_timeout, parse_exec_request, parse_sandbox_create, parse_sandbox_patch, ExecRequest,
    SandboxCreate, SandboxLimits, SandboxObject, SandboxPatch, SandboxStatus, SnapshotObject,
};
pub use secret::{parse_secret_put, SecretDeleted, SecretObject, SecretPut};
pub use template::{TemplateObject, TemplateReady};
pub use volume::{parse_volume_create, SandboxVolume, VolumeCreate, VolumeObject};
