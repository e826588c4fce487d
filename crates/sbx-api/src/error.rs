//! The error-code table (code -> type, status, retryable) and the error body.
//!
//! Every failure of the API answers with the same body:
//! `{"error":{"type","code","message","param","retryable","request_id","docs_url"}}`.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::fmt;

/// Which failure. Serialized as its snake_case name ([`ErrorCode::as_str`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    // 400 invalid_request
    /// The body is not a JSON object.
    InvalidJson,
    /// The body has a field this call does not take.
    UnknownField,
    /// The query has a parameter this call does not take.
    UnknownParameter,
    /// A field or query parameter has the wrong type or is out of range.
    InvalidField,
    /// `name` is not a valid name.
    InvalidName,
    /// `env` (or `secret_env`) has a name or a value an environment cannot hold.
    InvalidEnv,
    /// `metadata` is over its limits.
    InvalidMetadata,
    /// `expires_at` is not in the future.
    ExpiresInThePast,
    /// `egress` is not a set of rules.
    InvalidEgress,
    /// start, start_command and ready do not go together as given.
    InvalidStart,
    /// More than one of image, snapshot and template.
    AmbiguousSource,
    /// `image` is not a reference to an image in a registry.
    InvalidImage,
    /// A volume's path is not absolute or is `/`.
    InvalidPath,
    /// No command.
    MissingCommand,
    /// `user` is not a user of the sandbox.
    NoSuchUser,
    /// `Idempotency-Key` is empty or over 255 characters.
    InvalidIdempotencyKey,
    /// `region` is not a region.
    UnknownRegion,
    /// The method is not one this path takes (status 405, type invalid_request).
    MethodNotAllowed,
    /// A request with a body whose `Content-Type` is not the route's (`application/json`;
    /// uploads: `application/octet-stream`, `application/x-tar`) (status 415, type
    /// invalid_request).
    UnsupportedMediaType,

    // 401 unauthenticated
    /// No API key was given.
    MissingApiKey,
    /// The API key is not one the node knows.
    InvalidApiKey,
    /// The sandbox token given (a preview URL's `X-Sbx-Token`, `sbx_token` or cookie) is not
    /// the sandbox's, or none was given for a private port.
    InvalidToken,

    // 403 forbidden
    /// A secret would be sent to a host it may not go to.
    SecretHostNotAllowed,
    /// A sandbox token cannot do this (only its own sandbox's exec, files and output).
    NeedsApiKey,
    /// The egress proxy refused a request of a sandbox (its `egress` rules: a name, a method
    /// or a path not allowed).
    EgressDenied,
    /// The image is not in the node's image_allowlist.
    ImageNotAllowed,
    /// A node without API keys serves only requests whose `Host` is a loopback name or
    /// address (a page's DNS rebinding cannot reach it).
    ForbiddenHost,
    /// The request's `Origin` is neither the node's own nor one `--cors-origin` allows.
    OriginNotAllowed,

    // 404 not_found
    /// The path names nothing (no route, or an object of no more precise kind).
    NotFound,
    /// No such sandbox.
    SandboxNotFound,
    /// No such command.
    ExecNotFound,
    /// No such snapshot.
    SnapshotNotFound,
    /// No such template.
    TemplateNotFound,
    /// A volume named in volumes does not exist.
    VolumeNotFound,
    /// A secret named in egress.inject or image_pull_secret does not exist.
    SecretNotFound,

    // 409 conflict
    /// The name is taken.
    NameTaken,
    /// The Idempotency-Key was used with another body.
    IdempotencyKeyReused,
    /// The first request with the Idempotency-Key is still running.
    IdempotencyInProgress,
    /// The sandbox could not be started: the message says why.
    SandboxFailed,
    /// The command went away while the call waited for it.
    CommandLost,
    /// A volume in volumes that is not shared is another sandbox's.
    VolumeInUse,
    /// A volume is listed twice in volumes.
    DuplicateVolume,
    /// Two volumes in volumes have one path.
    MountPathTaken,
    /// volumes has more volumes that are not shared than the machine has spare drives.
    TooManyVolumes,
    /// The snapshot's status is lost.
    SnapshotLost,
    /// project_network was asked for, and the node has no address of the project to spare.
    NoProjectAddress,
    /// inbound is not empty, and the node has no pool of IPv6 addresses.
    NoIpv6,
    /// checkpoint is on, and this node takes no checkpoints.
    CheckpointsUnavailable,
    /// The sandbox is not in a state that takes this call (its status says which it is in).
    SandboxNotRunning,
    /// The sandbox runs as many commands at once as it may.
    TooManyCommands,
    /// The command's stdin is closed, or it has ended.
    StdinClosed,
    /// The command has ended: it takes no signal.
    ExecEnded,

    // 413 too_large
    /// The request body is over 64 MiB.
    BodyTooLarge,

    // 500 internal
    /// The node failed; its log has the reason under the request's id.
    Internal,

    // 503 unavailable
    /// The node is shutting down, or something it waited for did not answer in time.
    Unavailable,
    /// Every network slot of the node is in use.
    NoCapacity,
    /// A machine the call has to start does not fit in the host's memory.
    MemoryFull,
    /// The node's data drive has no room for a template the call needs.
    DriveFull,
    /// This node does not do what the request asks (egress rules, project networks, images
    /// it would have to fetch, ...).
    NotServedHere,

    // Moves of sandboxes between nodes (the fleet).
    /// The sandbox was moved to another node: `to` and `epoch` beside the error name where and at which epoch it was released.
    Moved,
    /// An event stream, terminal or waiting run ended because its sandbox was moved: `offset` (and `exec_id` of a run) say where to read on through the control plane.
    SandboxMoved,
    /// A release or takeover named an epoch this node does not hold the sandbox at: `epoch` beside the error is the one it holds or released it at.
    WrongEpoch,
    /// The sandbox has a move under way: `move_id` beside the error names it.
    AlreadyMoving,
    /// The sandbox cannot be moved (it has volumes, or it is not kept).
    NotMovable,
    /// The move has ended (done or failed): there is nothing to cancel.
    MoveOver,
    /// The move is already going back to the old node.
    MoveGoingBack,
    /// The new node has taken the sandbox over: the move cannot be cancelled.
    MoveTakenOver,
    /// The sandbox's memory was written by a build (kernel, CRIU, agent) this node does not have: `build` beside the error.
    BuildMissing,
    /// The image the sandbox's disk is over is neither on this node nor to be had: `image` beside the error.
    ImageMissing,
    /// The release waited for the store to hold the sandbox's last sleep and it did not yet: `disk_ms` and `memory_ms` say how long it waited.
    CopyBehind,
    /// The takeover could not bring the sandbox (the store or the old node's copy could not be read).
    TakeoverFailed,

    // Node leases, recoveries and the control plane's failover (the fleet, part 2).
    /// The node's lease fences the sandbox: the node could not renew its lease with the control plane, froze its sandboxes and serves none of them until it renews.
    Fenced,
    /// A recovery of a node whose lease may still be held: `lease_until` beside the error says until when (the node's lease and the time after it for the node to have seen it run out).
    LeaseHeld,
    /// This control plane is a standby: `active` beside the error names the copy that holds the lease (null while none does).
    Standby,
    /// The node that had the sandbox was lost, and the object store holds nothing of it to bring it back from.
    NodeLost,

    // 504 timeout
    /// The caller hung up.
    CallerGone,

    // File operations (`/v1/sandboxes/{id}/files…`). Each maps 1:1 to an S-code of the
    // functions interface's `sandbox::fs::*` ([`ErrorCode::s_code`]):
    //   fs_invalid        400  S210  the operation is invalid as asked (NUL in a path, a bad
    //                                mode or parameter, removing /, a bad archive); param set
    //   path_not_found    404  S211  the path does not exist
    //   wrong_type        409  S212  a file where a directory is needed, or the reverse
    //   path_exists       409  S213  the path exists already
    //   not_empty         409  S214  the directory is not empty
    //   permission_denied 403  S215  the sandbox refuses it (owner not mapped, read-only fs)
    //   io_error          500  S216  the filesystem failed (no space, I/O error)
    //   bad_pattern       400  S217  grep's or sed's pattern (or a glob) does not compile
    //   stream_aborted    503  S218  the bytes' stream broke midway; retryable
    //   unsupported       501  S219  a kind of file or an operation the sandbox's agent does
    //                                not serve (restart the sandbox to update its agent)
    // `invalid_range` (416) is HTTP's own (a Range header past the end) and has no S-code.
    /// The file operation is invalid as asked.
    FsInvalid,
    /// The path does not exist in the sandbox.
    PathNotFound,
    /// A file where a directory is needed, or the reverse.
    WrongType,
    /// The path exists already.
    PathExists,
    /// The directory is not empty.
    NotEmpty,
    /// The sandbox does not permit it.
    PermissionDenied,
    /// The sandbox's filesystem failed.
    IoError,
    /// The pattern (or a glob) does not compile.
    BadPattern,
    /// A stream of file bytes broke midway.
    StreamAborted,
    /// Not something the sandbox's agent does.
    Unsupported,
    /// The Range asked for is past the end of the file (status 416).
    InvalidRange,

    // 502 bad_gateway (the preview listener, the egress proxy)
    /// Nothing listens on the sandbox's port a preview URL names.
    PortNotOpen,
    /// The egress proxy could not reach the host a sandbox asked for.
    UpstreamFailed,
    /// The sandbox is held asleep (`held_asleep`): a request to its port does not wake it.
    SandboxPaused,
}

impl ErrorCode {
    /// Every code, in the order of the table above.
    pub const ALL: [ErrorCode; 90] = [
        ErrorCode::InvalidJson,
        ErrorCode::UnknownField,
        ErrorCode::UnknownParameter,
        ErrorCode::InvalidField,
        ErrorCode::InvalidName,
        ErrorCode::InvalidEnv,
        ErrorCode::InvalidMetadata,
        ErrorCode::ExpiresInThePast,
        ErrorCode::InvalidEgress,
        ErrorCode::InvalidStart,
        ErrorCode::AmbiguousSource,
        ErrorCode::InvalidImage,
        ErrorCode::InvalidPath,
        ErrorCode::MissingCommand,
        ErrorCode::NoSuchUser,
        ErrorCode::InvalidIdempotencyKey,
        ErrorCode::UnknownRegion,
        ErrorCode::MethodNotAllowed,
        ErrorCode::UnsupportedMediaType,
        ErrorCode::MissingApiKey,
        ErrorCode::InvalidApiKey,
        ErrorCode::SecretHostNotAllowed,
        ErrorCode::ImageNotAllowed,
        ErrorCode::ForbiddenHost,
        ErrorCode::OriginNotAllowed,
        ErrorCode::NotFound,
        ErrorCode::SandboxNotFound,
        ErrorCode::ExecNotFound,
        ErrorCode::SnapshotNotFound,
        ErrorCode::TemplateNotFound,
        ErrorCode::VolumeNotFound,
        ErrorCode::SecretNotFound,
        ErrorCode::NameTaken,
        ErrorCode::IdempotencyKeyReused,
        ErrorCode::IdempotencyInProgress,
        ErrorCode::SandboxFailed,
        ErrorCode::CommandLost,
        ErrorCode::VolumeInUse,
        ErrorCode::DuplicateVolume,
        ErrorCode::MountPathTaken,
        ErrorCode::TooManyVolumes,
        ErrorCode::SnapshotLost,
        ErrorCode::NoProjectAddress,
        ErrorCode::NoIpv6,
        ErrorCode::CheckpointsUnavailable,
        ErrorCode::SandboxNotRunning,
        ErrorCode::TooManyCommands,
        ErrorCode::StdinClosed,
        ErrorCode::ExecEnded,
        ErrorCode::BodyTooLarge,
        ErrorCode::Internal,
        ErrorCode::Unavailable,
        ErrorCode::NoCapacity,
        ErrorCode::MemoryFull,
        ErrorCode::DriveFull,
        ErrorCode::NotServedHere,
        ErrorCode::CallerGone,
        ErrorCode::FsInvalid,
        ErrorCode::PathNotFound,
        ErrorCode::WrongType,
        ErrorCode::PathExists,
        ErrorCode::NotEmpty,
        ErrorCode::PermissionDenied,
        ErrorCode::IoError,
        ErrorCode::BadPattern,
        ErrorCode::StreamAborted,
        ErrorCode::Unsupported,
        ErrorCode::InvalidRange,
        ErrorCode::InvalidToken,
        ErrorCode::NeedsApiKey,
        ErrorCode::EgressDenied,
        ErrorCode::PortNotOpen,
        ErrorCode::UpstreamFailed,
        ErrorCode::SandboxPaused,
        ErrorCode::Moved,
        ErrorCode::SandboxMoved,
        ErrorCode::WrongEpoch,
        ErrorCode::AlreadyMoving,
        ErrorCode::NotMovable,
        ErrorCode::MoveOver,
        ErrorCode::MoveGoingBack,
        ErrorCode::MoveTakenOver,
        ErrorCode::BuildMissing,
        ErrorCode::ImageMissing,
        ErrorCode::CopyBehind,
        ErrorCode::TakeoverFailed,
        ErrorCode::Fenced,
        ErrorCode::LeaseHeld,
        ErrorCode::Standby,
        ErrorCode::NodeLost,
    ];

    /// The code as it is written on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidJson => "invalid_json",
            ErrorCode::UnknownField => "unknown_field",
            ErrorCode::UnknownParameter => "unknown_parameter",
            ErrorCode::InvalidField => "invalid_field",
            ErrorCode::InvalidName => "invalid_name",
            ErrorCode::InvalidEnv => "invalid_env",
            ErrorCode::InvalidMetadata => "invalid_metadata",
            ErrorCode::ExpiresInThePast => "expires_in_the_past",
            ErrorCode::InvalidEgress => "invalid_egress",
            ErrorCode::InvalidStart => "invalid_start",
            ErrorCode::AmbiguousSource => "ambiguous_source",
            ErrorCode::InvalidImage => "invalid_image",
            ErrorCode::InvalidPath => "invalid_path",
            ErrorCode::MissingCommand => "missing_command",
            ErrorCode::NoSuchUser => "no_such_user",
            ErrorCode::InvalidIdempotencyKey => "invalid_idempotency_key",
            ErrorCode::UnknownRegion => "unknown_region",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::UnsupportedMediaType => "unsupported_media_type",
            ErrorCode::MissingApiKey => "missing_api_key",
            ErrorCode::InvalidApiKey => "invalid_api_key",
            ErrorCode::InvalidToken => "invalid_token",
            ErrorCode::NeedsApiKey => "needs_api_key",
            ErrorCode::EgressDenied => "egress_denied",
            ErrorCode::PortNotOpen => "port_not_open",
            ErrorCode::UpstreamFailed => "upstream_failed",
            ErrorCode::SandboxPaused => "sandbox_paused",
            ErrorCode::SecretHostNotAllowed => "secret_host_not_allowed",
            ErrorCode::ImageNotAllowed => "image_not_allowed",
            ErrorCode::ForbiddenHost => "forbidden_host",
            ErrorCode::OriginNotAllowed => "origin_not_allowed",
            ErrorCode::NotFound => "not_found",
            ErrorCode::SandboxNotFound => "sandbox_not_found",
            ErrorCode::ExecNotFound => "exec_not_found",
            ErrorCode::SnapshotNotFound => "snapshot_not_found",
            ErrorCode::TemplateNotFound => "template_not_found",
            ErrorCode::VolumeNotFound => "volume_not_found",
            ErrorCode::SecretNotFound => "secret_not_found",
            ErrorCode::NameTaken => "name_taken",
            ErrorCode::IdempotencyKeyReused => "idempotency_key_reused",
            ErrorCode::IdempotencyInProgress => "idempotency_in_progress",
            ErrorCode::SandboxFailed => "sandbox_failed",
            ErrorCode::CommandLost => "command_lost",
            ErrorCode::VolumeInUse => "volume_in_use",
            ErrorCode::DuplicateVolume => "duplicate_volume",
            ErrorCode::MountPathTaken => "mount_path_taken",
            ErrorCode::TooManyVolumes => "too_many_volumes",
            ErrorCode::SnapshotLost => "snapshot_lost",
            ErrorCode::NoProjectAddress => "no_project_address",
            ErrorCode::NoIpv6 => "no_ipv6",
            ErrorCode::CheckpointsUnavailable => "checkpoints_unavailable",
            ErrorCode::SandboxNotRunning => "sandbox_not_running",
            ErrorCode::TooManyCommands => "too_many_commands",
            ErrorCode::StdinClosed => "stdin_closed",
            ErrorCode::ExecEnded => "exec_ended",
            ErrorCode::BodyTooLarge => "body_too_large",
            ErrorCode::Internal => "internal",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::NoCapacity => "no_capacity",
            ErrorCode::MemoryFull => "memory_full",
            ErrorCode::DriveFull => "drive_full",
            ErrorCode::NotServedHere => "not_served_here",
            ErrorCode::Moved => "moved",
            ErrorCode::SandboxMoved => "sandbox_moved",
            ErrorCode::WrongEpoch => "wrong_epoch",
            ErrorCode::AlreadyMoving => "already_moving",
            ErrorCode::NotMovable => "not_movable",
            ErrorCode::MoveOver => "move_over",
            ErrorCode::MoveGoingBack => "move_going_back",
            ErrorCode::MoveTakenOver => "move_taken_over",
            ErrorCode::BuildMissing => "build_missing",
            ErrorCode::ImageMissing => "image_missing",
            ErrorCode::CopyBehind => "copy_behind",
            ErrorCode::TakeoverFailed => "takeover_failed",
            ErrorCode::Fenced => "fenced",
            ErrorCode::LeaseHeld => "lease_held",
            ErrorCode::Standby => "standby",
            ErrorCode::NodeLost => "node_lost",
            ErrorCode::CallerGone => "caller_gone",
            ErrorCode::FsInvalid => "fs_invalid",
            ErrorCode::PathNotFound => "path_not_found",
            ErrorCode::WrongType => "wrong_type",
            ErrorCode::PathExists => "path_exists",
            ErrorCode::NotEmpty => "not_empty",
            ErrorCode::PermissionDenied => "permission_denied",
            ErrorCode::IoError => "io_error",
            ErrorCode::BadPattern => "bad_pattern",
            ErrorCode::StreamAborted => "stream_aborted",
            ErrorCode::Unsupported => "unsupported",
            ErrorCode::InvalidRange => "invalid_range",
        }
    }

    /// The code of its wire name, if it is one.
    pub fn from_code(s: &str) -> Option<ErrorCode> {
        ErrorCode::ALL.iter().copied().find(|c| c.as_str() == s)
    }

    /// The S-code of the functions interface (`sandbox::fs::*`) this code is, for the file
    /// codes (S210–S219, one each); `None` for the others.
    pub fn s_code(self) -> Option<&'static str> {
        Some(match self {
            ErrorCode::FsInvalid => "S210",
            ErrorCode::PathNotFound => "S211",
            ErrorCode::WrongType => "S212",
            ErrorCode::PathExists => "S213",
            ErrorCode::NotEmpty => "S214",
            ErrorCode::PermissionDenied => "S215",
            ErrorCode::IoError => "S216",
            ErrorCode::BadPattern => "S217",
            ErrorCode::StreamAborted => "S218",
            ErrorCode::Unsupported => "S219",
            _ => return None,
        })
    }

    /// The kind of failure, which decides the status.
    pub fn error_type(self) -> &'static str {
        match self.status() {
            400 | 405 | 415 | 416 => "invalid_request",
            401 => "unauthenticated",
            403 => "forbidden",
            404 => "not_found",
            409 => "conflict",
            413 => "too_large",
            501 => "not_implemented",
            502 => "bad_gateway",
            503 => "unavailable",
            504 => "timeout",
            _ => "internal",
        }
    }

    /// The HTTP status of an answer with this code.
    pub fn status(self) -> u16 {
        use ErrorCode::*;
        match self {
            InvalidJson
            | UnknownField
            | UnknownParameter
            | InvalidField
            | InvalidName
            | InvalidEnv
            | InvalidMetadata
            | ExpiresInThePast
            | InvalidEgress
            | InvalidStart
            | AmbiguousSource
            | InvalidImage
            | InvalidPath
            | MissingCommand
            | NoSuchUser
            | InvalidIdempotencyKey
            | UnknownRegion => 400,
            MethodNotAllowed => 405,
            UnsupportedMediaType => 415,
            MissingApiKey | InvalidApiKey | InvalidToken => 401,
            SecretHostNotAllowed | NeedsApiKey | EgressDenied | ImageNotAllowed | ForbiddenHost
            | OriginNotAllowed => 403,
            PortNotOpen | UpstreamFailed | SandboxPaused => 502,
            NotFound | SandboxNotFound | ExecNotFound | SnapshotNotFound | TemplateNotFound
            | VolumeNotFound | SecretNotFound => 404,
            NameTaken
            | IdempotencyKeyReused
            | IdempotencyInProgress
            | SandboxFailed
            | CommandLost
            | VolumeInUse
            | DuplicateVolume
            | MountPathTaken
            | TooManyVolumes
            | SnapshotLost
            | NoProjectAddress
            | NoIpv6
            | CheckpointsUnavailable
            | SandboxNotRunning
            | TooManyCommands
            | StdinClosed
            | ExecEnded
            | Moved
            | SandboxMoved
            | WrongEpoch
            | AlreadyMoving
            | NotMovable
            | MoveOver
            | MoveGoingBack
            | MoveTakenOver
            | BuildMissing
            | ImageMissing
            | LeaseHeld
            | NodeLost => 409,
            BodyTooLarge => 413,
            Internal => 500,
            Unavailable | NoCapacity | MemoryFull | DriveFull | NotServedHere => 503,
            CopyBehind | Fenced | Standby => 503,
            TakeoverFailed => 502,
            CallerGone => 504,
            FsInvalid | BadPattern => 400,
            PathNotFound => 404,
            WrongType | PathExists | NotEmpty => 409,
            PermissionDenied => 403,
            IoError => 500,
            StreamAborted => 503,
            Unsupported => 501,
            InvalidRange => 416,
        }
    }

    /// True when the same request may succeed later without anything else changing.
    ///
    /// - Every 400/401/403/404/405/413/415 is false: the request itself (or what it names) has to
    ///   change.
    /// - 409: only `idempotency_in_progress` (the first request ends, and the same one then
    ///   answers with its result). `name_taken`, `sandbox_failed`, `command_lost` and the
    ///   volume conflicts are false: something has to change first, and for `command_lost`
    ///   sending a run again would run the command again, which no client should do blindly.
    /// - 500 `internal`: false (the node failed; nothing says it will not again).
    /// - 503: `unavailable`, `no_capacity`, `memory_full`, `drive_full` and `copy_behind`
    ///   (the store catches up), `fenced` (the node renews its lease) and `standby` (a
    ///   control plane takes the lease) are true; 502 `takeover_failed` too (the store or the old
    ///   node answers again);
    ///   `not_served_here` is false (this node does not do it, now or later).
    /// - 504 `caller_gone`: false (nobody is there to retry; only logs see it).
    /// - File codes: only `stream_aborted` (503; S218 is transient: the same transfer again
    ///   may pass).
    pub fn retryable(self) -> bool {
        matches!(
            self,
            ErrorCode::IdempotencyInProgress
                | ErrorCode::TooManyCommands
                | ErrorCode::Unavailable
                | ErrorCode::NoCapacity
                | ErrorCode::MemoryFull
                | ErrorCode::DriveFull
                | ErrorCode::StreamAborted
                | ErrorCode::CopyBehind
                | ErrorCode::TakeoverFailed
                | ErrorCode::Fenced
                | ErrorCode::Standby
        )
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The most characters of a `param` an error carries: a longer one (a field named by the
/// caller) is cut there, with `…`.
pub const MAX_PARAM_CHARS: usize = 200;
/// The most characters of a `message` an error carries, cut with `…` past it: a message that
/// echoes what the caller sent stays small whatever was sent.
pub const MAX_MESSAGE_CHARS: usize = 2000;

/// `s` cut to its first `max` characters, with `…` when something was cut.
pub fn cap_echo(s: &str, max: usize) -> std::borrow::Cow<'_, str> {
    match s.char_indices().nth(max) {
        None => s.into(),
        Some((at, _)) => format!("{}…", &s[..at]).into(),
    }
}

fn cap_owned(s: String, max: usize) -> String {
    match cap_echo(&s, max) {
        std::borrow::Cow::Borrowed(_) => s,
        std::borrow::Cow::Owned(c) => c,
    }
}

/// A failure of the API: a code, a message for people (English), and the field or query
/// parameter at fault where there is one. Both are capped where they are set
/// ([`MAX_MESSAGE_CHARS`], [`MAX_PARAM_CHARS`]) and again in [`error_body`], since they may
/// echo what the caller sent.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiError {
    /// Which failure.
    pub code: ErrorCode,
    /// For people. English; never holds a secret's value.
    pub message: String,
    /// The field or query parameter at fault (`limits.memory_bytes`, `env.FOO`, ...).
    pub param: Option<String>,
    /// Keys the answer carries beside `error` (`allowed_hosts` of secret_host_not_allowed).
    pub beside: Option<serde_json::Map<String, Value>>,
    /// Why a command was refused, typed, for front ends (never in the body).
    pub exec_failure: Option<crate::exec::ExecFailKind>,
}

impl ApiError {
    /// An error without a param.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError {
            code,
            message: cap_owned(message.into(), MAX_MESSAGE_CHARS),
            param: None,
            beside: None,
            exec_failure: None,
        }
    }

    /// The same error, naming the field or parameter at fault.
    #[must_use]
    pub fn with_param(mut self, param: impl Into<String>) -> ApiError {
        self.param = Some(cap_owned(param.into(), MAX_PARAM_CHARS));
        self
    }

    /// The same error, its answer carrying `key` beside `error`.
    #[must_use]
    pub fn with_beside(mut self, key: impl Into<String>, value: Value) -> ApiError {
        self.beside
            .get_or_insert_with(serde_json::Map::new)
            .insert(key.into(), value);
        self
    }

    /// The same error, with why a command was refused.
    #[must_use]
    pub fn with_exec_failure(mut self, kind: crate::exec::ExecFailKind) -> ApiError {
        self.exec_failure = Some(kind);
        self
    }

    /// `invalid_field` naming `param`.
    pub fn invalid_field(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorCode::InvalidField, message).with_param(param)
    }

    /// `internal`, with the message the spec gives it (the reason goes to the node's log).
    pub fn internal() -> ApiError {
        ApiError::new(
            ErrorCode::Internal,
            "the node failed; its log has the reason",
        )
    }

    /// The HTTP status of this error's answer.
    pub fn status(&self) -> u16 {
        self.code.status()
    }

    /// The functions interface's S-code of this error, for the file codes.
    pub fn s_code(&self) -> Option<&'static str> {
        self.code.s_code()
    }

    /// The kind of failure.
    pub fn error_type(&self) -> &'static str {
        self.code.error_type()
    }

    /// Whether the same request may succeed later.
    pub fn retryable(&self) -> bool {
        self.code.retryable()
    }

    /// This error's body (see [`error_body`]).
    pub fn body(&self, request_id: &str, docs_base: Option<&str>) -> Value {
        error_body(self, request_id, docs_base)
    }
}

/// The body of an error answer: exactly
/// `{"error":{"type","code","message","param","retryable","request_id","docs_url"}}`, all seven
/// keys always there; `param` and `docs_url` are null when absent, and `docs_url` is
/// `docs_base` with the code appended.
pub fn error_body(err: &ApiError, request_id: &str, docs_base: Option<&str>) -> Value {
    let code = err.code.as_str();
    let mut body = json!({
        "error": {
            "type": err.code.error_type(),
            "code": code,
            "message": cap_echo(&err.message, MAX_MESSAGE_CHARS),
            "param": err.param.as_deref().map(|p| cap_echo(p, MAX_PARAM_CHARS)),
            "retryable": err.code.retryable(),
            "request_id": request_id,
            "docs_url": docs_base.map(|base| format!("{base}{code}")),
        }
    });
    if let (Some(extra), Some(obj)) = (&err.beside, body.as_object_mut()) {
        for (k, v) in extra {
            if k != "error" {
                obj.insert(k.clone(), v.clone());
            }
        }
    }
    body
}

/// An error answer as a client reads it back: the `error` object of [`error_body`] and the keys
/// the answer carries beside it (`allowed_hosts` of secret_host_not_allowed, ...). The
/// functions interface answers the same shape without `param` and `request_id`, its `code` an
/// S-code (`S210`): `code` is kept as text, [`ErrorDetail::error_code`] reads the API's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
    /// Keys of the answer beside `error`.
    #[serde(flatten)]
    pub beside: serde_json::Map<String, Value>,
}

/// The `error` object of an error answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// The kind of failure (`invalid_request`, `not_found`, ...), which decides the status.
    #[serde(rename = "type")]
    pub kind: String,
    /// Which failure: an [`ErrorCode`]'s name, or an S-code of the functions interface.
    pub code: String,
    /// For people. English.
    pub message: String,
    /// The field or query parameter at fault.
    #[serde(default)]
    pub param: Option<String>,
    /// Whether the same request may succeed later.
    #[serde(default)]
    pub retryable: bool,
    /// The request's id (absent in the functions interface's answers).
    #[serde(default)]
    pub request_id: Option<String>,
    /// The node's docs page of the code, or null.
    #[serde(default)]
    pub docs_url: Option<String>,
}

impl ErrorDetail {
    /// The code as one of this API's, when it is one.
    pub fn error_code(&self) -> Option<ErrorCode> {
        ErrorCode::from_code(&self.code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_body_reads_back() {
        let e = ApiError::new(ErrorCode::SecretHostNotAllowed, "no")
            .with_param("image_pull_secret")
            .with_beside("allowed_hosts", json!(["a.com"]));
        let body: ErrorBody =
            serde_json::from_value(error_body(&e, "req-1", Some("https://d/"))).unwrap();
        assert_eq!(
            body.error.error_code(),
            Some(ErrorCode::SecretHostNotAllowed)
        );
        assert_eq!(body.error.kind, "forbidden");
        assert_eq!(body.error.param.as_deref(), Some("image_pull_secret"));
        assert_eq!(body.error.request_id.as_deref(), Some("req-1"));
        assert_eq!(
            body.error.docs_url.as_deref(),
            Some("https://d/secret_host_not_allowed")
        );
        assert!(!body.error.retryable);
        assert_eq!(body.beside["allowed_hosts"], json!(["a.com"]));
        // The functions interface's shape: no param, no request_id, an S-code.
        let f: ErrorBody = serde_json::from_value(json!({"error": {"code": "S211",
            "type": "filesystem", "message": "m", "retryable": false, "docs_url": null}}))
        .unwrap();
        assert_eq!((f.error.error_code(), f.error.param), (None, None));
    }

    #[test]
    fn codes_round_trip_through_serde_and_as_str() {
        for code in ErrorCode::ALL {
            let s = serde_json::to_value(code).unwrap();
            assert_eq!(s, Value::String(code.as_str().to_owned()));
            let back: ErrorCode = serde_json::from_value(s).unwrap();
            assert_eq!(back, code);
            assert_eq!(ErrorCode::from_code(code.as_str()), Some(code));
            assert_eq!(code.to_string(), code.as_str());
        }
        assert_eq!(ErrorCode::from_code("nope"), None);
    }

    #[test]
    fn all_lists_every_code_once() {
        let mut names: Vec<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ErrorCode::ALL.len());
    }

    #[test]
    fn status_and_type_agree_with_the_spec_table() {
        let table = [
            ("invalid_request", 400),
            ("unauthenticated", 401),
            ("forbidden", 403),
            ("not_found", 404),
            ("conflict", 409),
            ("too_large", 413),
            ("internal", 500),
            ("not_implemented", 501),
            ("bad_gateway", 502),
            ("unavailable", 503),
            ("timeout", 504),
        ];
        for code in ErrorCode::ALL {
            if matches!(
                code,
                ErrorCode::MethodNotAllowed
                    | ErrorCode::InvalidRange
                    | ErrorCode::UnsupportedMediaType
            ) {
                continue;
            }
            let t = code.error_type();
            let expected = table.iter().find(|(n, _)| *n == t).map(|(_, s)| *s);
            assert_eq!(expected, Some(code.status()), "{code}");
        }
        assert_eq!(ErrorCode::MethodNotAllowed.status(), 405);
        assert_eq!(ErrorCode::MethodNotAllowed.error_type(), "invalid_request");
        assert_eq!(ErrorCode::UnsupportedMediaType.status(), 415);
        assert_eq!(
            ErrorCode::UnsupportedMediaType.error_type(),
            "invalid_request"
        );
        assert_eq!(ErrorCode::ForbiddenHost.status(), 403);
        assert_eq!(ErrorCode::OriginNotAllowed.error_type(), "forbidden");
    }

    #[test]
    fn what_an_error_echoes_is_capped() {
        let name = "n".repeat(10 << 20);
        let e = ApiError::new(ErrorCode::UnknownField, format!("unknown field {name}"))
            .with_param(name.clone());
        let body = serde_json::to_string(&error_body(&e, "r", None)).unwrap();
        assert!(body.len() < 4096, "{} bytes", body.len());
        let p = e.param.as_deref().unwrap();
        assert_eq!(p.chars().count(), MAX_PARAM_CHARS + 1);
        assert!(p.ends_with('…'));
        assert!(e.message.starts_with("unknown field nnn"));
        assert_eq!(e.message.chars().count(), MAX_MESSAGE_CHARS + 1);
        // Fields set by hand are capped on the way out too.
        let mut e = ApiError::new(ErrorCode::InvalidField, "short");
        e.message = "é".repeat(5000);
        e.param = Some("p".repeat(500));
        let b = error_body(&e, "r", None);
        assert_eq!(
            b["error"]["message"].as_str().unwrap().chars().count(),
            MAX_MESSAGE_CHARS + 1
        );
        assert_eq!(
            b["error"]["param"].as_str().unwrap().chars().count(),
            MAX_PARAM_CHARS + 1
        );
        // Short ones are left as they are.
        assert_eq!(cap_echo("abc", 3), "abc");
        assert_eq!(cap_echo("abcd", 3), "abc…");
    }

    #[test]
    fn some_statuses() {
        assert_eq!(ErrorCode::InvalidJson.status(), 400);
        assert_eq!(ErrorCode::MissingCommand.status(), 400);
        assert_eq!(ErrorCode::UnknownRegion.status(), 400);
        assert_eq!(ErrorCode::MissingApiKey.status(), 401);
        assert_eq!(ErrorCode::InvalidApiKey.error_type(), "unauthenticated");
        assert_eq!(ErrorCode::SecretHostNotAllowed.status(), 403);
        assert_eq!(ErrorCode::SandboxNotFound.status(), 404);
        assert_eq!(ErrorCode::NotFound.error_type(), "not_found");
        assert_eq!(ErrorCode::NameTaken.status(), 409);
        assert_eq!(ErrorCode::CommandLost.error_type(), "conflict");
        assert_eq!(ErrorCode::BodyTooLarge.status(), 413);
        assert_eq!(ErrorCode::BodyTooLarge.error_type(), "too_large");
        assert_eq!(ErrorCode::Internal.status(), 500);
        assert_eq!(ErrorCode::Internal.error_type(), "internal");
        assert_eq!(ErrorCode::NotServedHere.status(), 503);
        assert_eq!(ErrorCode::NoCapacity.error_type(), "unavailable");
        assert_eq!(ErrorCode::CallerGone.status(), 504);
        assert_eq!(ErrorCode::CallerGone.error_type(), "timeout");
    }

    #[test]
    fn retryable_codes() {
        let retryable: Vec<ErrorCode> = ErrorCode::ALL
            .iter()
            .copied()
            .filter(|c| c.retryable())
            .collect();
        assert_eq!(
            retryable,
            vec![
                ErrorCode::IdempotencyInProgress,
                ErrorCode::TooManyCommands,
                ErrorCode::Unavailable,
                ErrorCode::NoCapacity,
                ErrorCode::MemoryFull,
                ErrorCode::DriveFull,
                ErrorCode::StreamAborted,
                ErrorCode::CopyBehind,
                ErrorCode::TakeoverFailed,
                ErrorCode::Fenced,
                ErrorCode::Standby,
            ]
        );
        assert!(!ErrorCode::Internal.retryable());
        assert!(!ErrorCode::CallerGone.retryable());
        assert!(!ErrorCode::NotServedHere.retryable());
    }

    #[test]
    fn file_codes_map_one_to_one_to_s_codes() {
        let file: Vec<(ErrorCode, &str)> = ErrorCode::ALL
            .iter()
            .filter_map(|c| c.s_code().map(|s| (*c, s)))
            .collect();
        let want = [
            (ErrorCode::FsInvalid, "S210", 400),
            (ErrorCode::PathNotFound, "S211", 404),
            (ErrorCode::WrongType, "S212", 409),
            (ErrorCode::PathExists, "S213", 409),
            (ErrorCode::NotEmpty, "S214", 409),
            (ErrorCode::PermissionDenied, "S215", 403),
            (ErrorCode::IoError, "S216", 500),
            (ErrorCode::BadPattern, "S217", 400),
            (ErrorCode::StreamAborted, "S218", 503),
            (ErrorCode::Unsupported, "S219", 501),
        ];
        assert_eq!(file.len(), want.len());
        for ((code, s), (wc, ws, status)) in file.iter().zip(want) {
            assert_eq!((*code, *s), (wc, ws));
            assert_eq!(code.status(), status, "{code}");
        }
        assert_eq!(ErrorCode::Unsupported.error_type(), "not_implemented");
        assert_eq!(ErrorCode::InvalidRange.status(), 416);
        assert_eq!(ErrorCode::InvalidRange.error_type(), "invalid_request");
        assert_eq!(ErrorCode::InvalidRange.s_code(), None);
        assert_eq!(ErrorCode::NotFound.s_code(), None);
        let e = ApiError::new(ErrorCode::NotEmpty, "x").with_param("path");
        assert_eq!(e.s_code(), Some("S214"));
    }

    #[test]
    fn error_body_has_exactly_seven_keys() {
        let err = ApiError::new(ErrorCode::InvalidField, "bad").with_param("limits.vcpus");
        let body = error_body(&err, "req-1", Some("https://docs.example/errors#"));
        let top = body.as_object().unwrap();
        assert_eq!(top.len(), 1);
        let inner = body["error"].as_object().unwrap();
        let mut keys: Vec<&str> = inner.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "code",
                "docs_url",
                "message",
                "param",
                "request_id",
                "retryable",
                "type"
            ]
        );
        assert_eq!(
            body,
            json!({"error": {
                "type": "invalid_request",
                "code": "invalid_field",
                "message": "bad",
                "param": "limits.vcpus",
                "retryable": false,
                "request_id": "req-1",
                "docs_url": "https://docs.example/errors#invalid_field",
            }})
        );
    }

    /// The typed detail of a refused command rides beside the code, never in the body.
    #[test]
    fn exec_failure_is_typed_and_off_the_wire() {
        use crate::exec::ExecFailKind;
        let plain = ApiError::new(ErrorCode::StdinClosed, "the command has ended");
        assert_eq!(plain.exec_failure, None);
        let ended = plain.clone().with_exec_failure(ExecFailKind::Ended);
        assert_eq!(ended.exec_failure, Some(ExecFailKind::Ended));
        assert_ne!(ended, plain);
        assert_eq!(ended.body("r", None), plain.body("r", None));
        for k in [
            ExecFailKind::CwdMissing,
            ExecFailKind::CwdNotDirectory,
            ExecFailKind::NotFound,
            ExecFailKind::Permission,
            ExecFailKind::NotExecutable,
            ExecFailKind::NoSuchUser,
            ExecFailKind::TooMany,
            ExecFailKind::Ended,
            ExecFailKind::Other,
        ] {
            assert_eq!(
                serde_json::to_value(k).unwrap(),
                Value::String(k.as_str().into())
            );
        }
    }

    #[test]
    fn error_body_nulls_when_absent() {
        let err = ApiError::new(ErrorCode::NoCapacity, "full");
        let body = err.body("abc", None);
        let inner = body["error"].as_object().unwrap();
        assert_eq!(inner.len(), 7);
        assert_eq!(inner["param"], Value::Null);
        assert_eq!(inner["docs_url"], Value::Null);
        assert_eq!(inner["retryable"], Value::Bool(true));
        assert_eq!(inner["type"], "unavailable");
        assert_eq!(inner["request_id"], "abc");
    }

    #[test]
    fn api_error_helpers() {
        let e = ApiError::invalid_field("cwd", "must be absolute");
        assert_eq!(e.code, ErrorCode::InvalidField);
        assert_eq!(e.param.as_deref(), Some("cwd"));
        assert_eq!(e.status(), 400);
        assert_eq!(e.error_type(), "invalid_request");
        assert!(!e.retryable());
        assert_eq!(e.to_string(), "invalid_field: must be absolute");
        let i = ApiError::internal();
        assert_eq!(i.status(), 500);
        assert_eq!(i.param, None);
        let boxed: Box<dyn std::error::Error> = Box::new(i);
        assert!(boxed.to_string().starts_with("internal: "));
    }
}
