//! `POST /v1/run`: its body, parsed and validated into a [`RunRequest`].
//!
//! Every 400 of the call happens here, before anything is touched. The checks run in this
//! order, and the first failure is the answer:
//!
//! 1. the body is over [`MAX_BODY_BYTES`]: `body_too_large` (413);
//! 2. the body is not a JSON object: `invalid_json` (param null);
//! 3. a top-level key that is not in [`RUN_FIELDS`]: `unknown_field` (param: the key);
//! 4. each field, in the spec's order ([`RUN_FIELDS`]);
//! 5. the checks across fields: `ambiguous_source`, `invalid_start`, then `image_pull_secret`
//!    without `image` (`invalid_field`).
//!
//! Conventions:
//! - A field that is null counts as not given (except `command`: `missing_command`, and
//!   `sleep_after_seconds`, where null means "never" and is kept apart from absent).
//! - A value of the wrong JSON type is `invalid_field`, also for fields with their own code
//!   (`name`, `env`, `metadata`, `image`): those codes are for values of the right type that
//!   break the field's rules.
//! - `param` is the path of the value at fault: `limits.memory_bytes`, `env.FOO`,
//!   `volumes[0].path`, `ready.http.port`.
//! - Fields the node may refuse as not served here (egress, volumes, snapshot, template,
//!   image, image_pull_secret, project_network, init, runtime, inbound, public_ports,
//!   checkpoint, ...) are checked for their type and kept, so that the node can refuse them
//!   with a precise code.

mod command;
mod fields;
mod json;
mod limits;
mod runtime;
mod types;
mod wire;

use std::collections::BTreeMap;

use serde_json::Value;

use crate::error::{ApiError, ErrorCode};
use crate::exec::parse_rfc3339;

use command::{parse_ready, parse_stop};
use fields::{
    check_egress, check_image, check_name, check_runtime, parse_limits, parse_metadata,
    parse_ports, parse_volumes, valid_hostname, valid_time_of_day,
};
use json::{opt_nonempty_str, opt_u32};

pub(crate) use command::{check_command, parse_command};
pub(crate) use fields::{check_env, parse_env};
pub(crate) use json::{given, invalid, number_in, opt_bool, opt_str, uint_in, unknown_field};
pub(crate) use limits::{check_exec_size, check_user};
pub use limits::{
    ms_to_seconds, run_timeout, seconds_to_ms, user_ids_in_range, DEFAULT_GRACE_MS,
    DEFAULT_TIMEOUT_SECONDS, MAX_ARGS, MAX_ARG_BYTES, MAX_BODY_BYTES, MAX_COMMAND_DISPLAY_CHARS,
    MAX_CWD_BYTES, MAX_DENY_PORTS, MAX_EXEC_BYTES, MAX_GRACE_MS, MAX_HOSTNAME_LEN,
    MAX_IDEMPOTENCY_KEY_CHARS, MAX_IMAGE_LEN, MAX_IMAGE_PULL_SECRET_LEN, MAX_METADATA_KEYS,
    MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS, MAX_SANDBOX_ID, MAX_SECONDS,
    MAX_START_COMMAND_BYTES, MAX_USER_CHARS, MAX_VCPUS, MEMORY_STEP_BYTES, MIN_MEMORY_BYTES,
    MIN_TIMEOUT_SECONDS, STOP_SIGNALS,
};
pub use runtime::{
    sysctl_allowed, Runtime, TmpfsMount, Ulimit, DEFAULT_TMPFS_MODE, MAX_NOFILE, ULIMIT_NAMES,
};
pub use types::{
    Command, Encoding, Init, Limits, OnExpiry, Ready, Region, RunRequest, RuntimeDns, SecretEnv,
    Stop, Tmp, VolumeMount,
};
pub(crate) use wire::{command_value, seconds_value, stdin_value};

/// The top-level fields of `POST /v1/run`, in the spec's order (which is the order they are
/// checked in).
pub const RUN_FIELDS: [&str; 43] = [
    "command",
    "start",
    "start_command",
    "ready",
    "egress",
    "guest_mitigations",
    "tmp",
    "runtime",
    "init",
    "project_network",
    "image",
    "image_pull_secret",
    "snapshot",
    "template",
    "limits",
    "name",
    "env",
    "metadata",
    "volumes",
    "public_ports",
    "public_ports_except",
    "inbound",
    "sleep_after_seconds",
    "expires_at",
    "on_expiry",
    "held_asleep",
    "sleep_notice_ms",
    "sleep_hold_max_ms",
    "suspend_after_ms",
    "wake_daily_at",
    "checkpoint",
    "delete_after_idle_ms",
    "hostname",
    "stop",
    "secret_env",
    "cwd",
    "user",
    "timeout_seconds",
    "stdin",
    "encoding",
    "stream",
    "wait_for_reader",
    "region",
];

/// Checks an `Idempotency-Key` header: 1 to 255 characters, else `invalid_idempotency_key`
/// (param `Idempotency-Key`).
pub fn validate_idempotency_key(s: &str) -> Result<(), ApiError> {
    let n = s.chars().count();
    if (1..=MAX_IDEMPOTENCY_KEY_CHARS).contains(&n) {
        Ok(())
    } else {
        Err(ApiError::new(
            ErrorCode::InvalidIdempotencyKey,
            "Idempotency-Key must be 1 to 255 characters",
        )
        .with_param("Idempotency-Key"))
    }
}

/// Parses and validates a `POST /v1/run` body (see the module's documentation for the order
/// of the checks).
pub fn parse_run_request(body: &[u8]) -> Result<RunRequest, ApiError> {
    if body.len() > MAX_BODY_BYTES {
        return Err(ApiError::new(
            ErrorCode::BodyTooLarge,
            "the request body is over 64 MiB",
        ));
    }
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            ErrorCode::InvalidJson,
            format!("the body is not a JSON object: {e}"),
        )
    })?;
    parse_run_value(&value)
}

/// [`parse_run_request`] of a body already parsed as JSON.
pub fn parse_run_value(value: &Value) -> Result<RunRequest, ApiError> {
    let Some(obj) = value.as_object() else {
        return Err(ApiError::new(
            ErrorCode::InvalidJson,
            "the body is not a JSON object",
        ));
    };
    if let Some(key) = obj.keys().find(|k| !RUN_FIELDS.contains(&k.as_str())) {
        return Err(unknown_field(key, "this call"));
    }

    let command = match given(obj, "command") {
        Some(v) => parse_command(v, "command", None)?,
        None => {
            return Err(
                ApiError::new(ErrorCode::MissingCommand, "command is required")
                    .with_param("command"),
            )
        }
    };
    let start = opt_bool(obj, "start")?;
    let start_command = given(obj, "start_command")
        .map(|v| parse_command(v, "start_command", Some(MAX_START_COMMAND_BYTES)))
        .transpose()?;
    let ready = given(obj, "ready").map(parse_ready).transpose()?;
    let egress = given(obj, "egress").map(check_egress).transpose()?;
    let guest_mitigations = opt_bool(obj, "guest_mitigations")?;
    let tmp = match opt_str(obj, "tmp")? {
        None | Some("disk") => Tmp::Disk,
        Some("memory") => Tmp::Memory,
        Some(_) => return Err(invalid("tmp", "tmp must be disk or memory")),
    };
    let runtime = given(obj, "runtime").map(check_runtime).transpose()?;
    let init = match opt_str(obj, "init")? {
        None => None,
        Some("systemd") => Some(Init::Systemd),
        Some(_) => return Err(invalid("init", "init must be systemd or null")),
    };
    let project_network = opt_bool(obj, "project_network")?.unwrap_or(false);
    let image = opt_str(obj, "image")?.map(check_image).transpose()?;
    let image_pull_secret = match opt_str(obj, "image_pull_secret")? {
        Some(s) if s.is_empty() || s.len() > MAX_IMAGE_PULL_SECRET_LEN => {
            return Err(invalid(
                "image_pull_secret",
                "image_pull_secret must be a secret's name of 1 to 128 bytes",
            ))
        }
        s => s.map(str::to_owned),
    };
    let snapshot = opt_nonempty_str(obj, "snapshot")?;
    let template = opt_nonempty_str(obj, "template")?;
    let limits = given(obj, "limits")
        .map(parse_limits)
        .transpose()?
        .unwrap_or_default();
    let name = opt_str(obj, "name")?.map(check_name).transpose()?;
    let env = given(obj, "env")
        .map(|v| parse_env(v, "env"))
        .transpose()?
        .unwrap_or_default();
    let metadata = given(obj, "metadata")
        .map(parse_metadata)
        .transpose()?
        .unwrap_or_default();
    let volumes = given(obj, "volumes")
        .map(parse_volumes)
        .transpose()?
        .unwrap_or_default();
    let public_ports = given(obj, "public_ports")
        .map(|v| parse_ports(v, "public_ports"))
        .transpose()?
        .unwrap_or_default();
    let public_ports_except = given(obj, "public_ports_except")
        .map(|v| parse_ports(v, "public_ports_except"))
        .transpose()?;
    let inbound = match given(obj, "inbound") {
        Some(v) if !v.is_array() => return Err(invalid("inbound", "inbound must be an array")),
        v => v.cloned(),
    };
    let sleep_after_seconds = match obj.get("sleep_after_seconds") {
        None => None,
        Some(Value::Null) => Some(None),
        Some(v) => Some(Some(number_in(
            v,
            "sleep_after_seconds",
            |n| (1.0..=MAX_SECONDS).contains(&n),
            "a number from 1 to 1000000000",
        )?)),
    };
    let expires_at = match opt_str(obj, "expires_at")? {
        Some(s) if parse_rfc3339(s).is_none() => {
            return Err(invalid(
                "expires_at",
                "expires_at must be an RFC 3339 date-time",
            ))
        }
        s => s.map(str::to_owned),
    };
    let on_expiry = match opt_str(obj, "on_expiry")? {
        None | Some("delete") => OnExpiry::Delete,
        Some("sleep") => OnExpiry::Sleep,
        Some("hold") => OnExpiry::Hold,
        Some(_) => {
            return Err(invalid(
                "on_expiry",
                "on_expiry must be delete, sleep, hold or null",
            ))
        }
    };
    let held_asleep = opt_bool(obj, "held_asleep")?.unwrap_or(false);
    let sleep_notice_ms = opt_u32(obj, "sleep_notice_ms", 0, 60_000)?;
    let sleep_hold_max_ms = opt_u32(obj, "sleep_hold_max_ms", 0, 900_000)?;
    let suspend_after_ms = opt_u32(obj, "suspend_after_ms", 1000, 86_400_000)?;
    let wake_daily_at = match opt_str(obj, "wake_daily_at")? {
        Some(s) if !valid_time_of_day(s) => {
            return Err(invalid(
                "wake_daily_at",
                "wake_daily_at must be a time of day, HH:MM",
            ))
        }
        s => s.map(str::to_owned),
    };
    let checkpoint = match given(obj, "checkpoint") {
        Some(v) if !v.is_object() => {
            return Err(invalid(
                "checkpoint",
                "checkpoint must be an object or null",
            ))
        }
        v => v.cloned(),
    };
    let delete_after_idle_ms = given(obj, "delete_after_idle_ms")
        .map(|v| uint_in(v, "delete_after_idle_ms", 1000, i64::MAX.unsigned_abs()))
        .transpose()?;
    let hostname = match opt_str(obj, "hostname")? {
        Some(s) if !valid_hostname(s) => {
            return Err(invalid(
                "hostname",
                "hostname must be a lower-case DNS name of at most 63 characters",
            ))
        }
        s => s.map(str::to_owned),
    };
    let stop = given(obj, "stop").map(parse_stop).transpose()?;
    let secret_env = match given(obj, "secret_env") {
        None => SecretEnv::default(),
        Some(v) => {
            let map = parse_env(v, "secret_env")?;
            if let Some(k) = map.keys().find(|k| env.contains_key(*k)) {
                return Err(invalid(
                    format!("secret_env.{k}"),
                    format!("secret_env.{k} is in env too"),
                ));
            }
            SecretEnv(map)
        }
    };
    let cwd = match opt_str(obj, "cwd")? {
        Some(s) if !s.starts_with('/') || s.contains('\0') => {
            return Err(invalid("cwd", "cwd must be an absolute path"))
        }
        s => s.map(str::to_owned),
    };
    let user = opt_str(obj, "user")?;
    check_user(user)?;
    let user = user.map(str::to_owned);
    let timeout = match given(obj, "timeout_seconds") {
        None => std::time::Duration::from_millis(seconds_to_ms(DEFAULT_TIMEOUT_SECONDS)),
        Some(v) => match v.as_f64() {
            Some(n) if v.is_number() => run_timeout(n)?,
            _ => return Err(invalid("timeout_seconds", limits::RUN_TIMEOUT_RANGE)),
        },
    };
    let stdin_text = opt_str(obj, "stdin")?;
    let encoding = match opt_str(obj, "encoding")? {
        None | Some("utf8") => Encoding::Utf8,
        Some("base64") => Encoding::Base64,
        Some(_) => return Err(invalid("encoding", "encoding must be utf8 or base64")),
    };
    let stdin = match stdin_text {
        None => None,
        Some(s) => Some(
            encoding
                .decode(s)
                .ok_or_else(|| invalid("stdin", "stdin is not base64"))?,
        ),
    };
    let stream = opt_bool(obj, "stream")?;
    let wait_for_reader = opt_bool(obj, "wait_for_reader")?.unwrap_or(false);
    let region = match given(obj, "region") {
        None => None,
        Some(Value::String(s)) => Some(match s.as_str() {
            "na" => Region::Na,
            "eu" => Region::Eu,
            "ap" => Region::Ap,
            _ => {
                return Err(ApiError::new(
                    ErrorCode::UnknownRegion,
                    "region must be na, eu, ap or null",
                )
                .with_param("region"))
            }
        }),
        Some(_) => return Err(invalid("region", "region must be a string or null")),
    };

    let req = RunRequest {
        command,
        start,
        start_command,
        ready,
        egress,
        guest_mitigations,
        tmp,
        runtime,
        init,
        project_network,
        image,
        image_pull_secret,
        snapshot,
        template,
        limits,
        name,
        env,
        metadata,
        volumes,
        public_ports,
        public_ports_except,
        inbound,
        sleep_after_seconds,
        expires_at,
        on_expiry,
        held_asleep,
        sleep_notice_ms,
        sleep_hold_max_ms,
        suspend_after_ms,
        wake_daily_at,
        checkpoint,
        delete_after_idle_ms,
        hostname,
        stop,
        secret_env,
        cwd,
        user,
        timeout,
        stdin,
        encoding,
        stream,
        wait_for_reader,
        region,
    };
    check_across_fields(&req)?;
    Ok(req)
}

impl RunRequest {
    /// A run of `command` with every other field at its default, as a body of only
    /// `{"command": …}` gives: for callers that build a request by type (the functions
    /// interface), then [`RunRequest::check`] it.
    pub fn new(command: Command) -> RunRequest {
        RunRequest {
            command,
            start: None,
            start_command: None,
            ready: None,
            egress: None,
            guest_mitigations: None,
            tmp: Tmp::default(),
            runtime: None,
            init: None,
            project_network: false,
            image: None,
            image_pull_secret: None,
            snapshot: None,
            template: None,
            limits: Limits::default(),
            name: None,
            env: BTreeMap::new(),
            metadata: BTreeMap::new(),
            volumes: Vec::new(),
            public_ports: Vec::new(),
            public_ports_except: None,
            inbound: None,
            sleep_after_seconds: None,
            expires_at: None,
            on_expiry: OnExpiry::default(),
            held_asleep: false,
            sleep_notice_ms: None,
            sleep_hold_max_ms: None,
            suspend_after_ms: None,
            wake_daily_at: None,
            checkpoint: None,
            delete_after_idle_ms: None,
            hostname: None,
            stop: None,
            secret_env: SecretEnv::default(),
            cwd: None,
            user: None,
            timeout: std::time::Duration::from_millis(seconds_to_ms(DEFAULT_TIMEOUT_SECONDS)),
            stdin: None,
            encoding: Encoding::Utf8,
            stream: None,
            wait_for_reader: false,
            region: None,
        }
    }

    /// The value rules of the fields a caller sets by type (command, image, name, limits, env,
    /// cwd, user, timeout) and the checks across fields, with the codes a parsed body gets.
    /// An empty argv is a create's (no command).
    pub fn check(&self) -> Result<(), ApiError> {
        if !matches!(&self.command, Command::Argv(a) if a.is_empty()) {
            check_command(&self.command, "command")?;
        }
        if let Some(image) = &self.image {
            fields::check_image(image)?;
        }
        if let Some(name) = &self.name {
            fields::check_name(name)?;
        }
        fields::check_limits(&self.limits)?;
        check_env(&self.env, "env")?;
        if self.cwd.as_deref().is_some_and(|c| !c.starts_with('/')) {
            return Err(invalid("cwd", "cwd must be an absolute path"));
        }
        check_user(self.user.as_deref())?;
        if !(1..=seconds_to_ms(MAX_SECONDS)).contains(&ms_of(self.timeout)) {
            return Err(invalid("timeout_seconds", limits::RUN_TIMEOUT_RANGE));
        }
        check_exec_size(&self.command, self.env.iter(), "env", self.cwd.as_deref())?;
        check_across_fields(self)
    }
}

/// A deadline in whole milliseconds (saturating).
pub fn ms_of(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The checks that take more than one field.
fn check_across_fields(req: &RunRequest) -> Result<(), ApiError> {
    let sources: Vec<&str> = [
        ("image", req.image.is_some()),
        ("snapshot", req.snapshot.is_some()),
        ("template", req.template.is_some()),
    ]
    .iter()
    .filter(|(_, given)| *given)
    .map(|(name, _)| *name)
    .collect();
    if let Some(second) = sources.get(1) {
        return Err(ApiError::new(
            ErrorCode::AmbiguousSource,
            "give at most one of image, snapshot and template",
        )
        .with_param(*second));
    }

    let invalid_start =
        |param: &str, msg: &str| ApiError::new(ErrorCode::InvalidStart, msg).with_param(param);
    if req.ready.is_some() && req.start != Some(true) && req.start_command.is_none() {
        return Err(invalid_start(
            "ready",
            "ready needs start: true or start_command",
        ));
    }
    if req.start == Some(false) && req.start_command.is_some() {
        return Err(invalid_start(
            "start_command",
            "start_command does not go with start: false",
        ));
    }
    let start_fields = [
        ("start", req.start.is_some()),
        ("start_command", req.start_command.is_some()),
        ("ready", req.ready.is_some()),
    ];
    if req.init == Some(Init::Systemd) {
        if let Some((field, _)) = start_fields.iter().find(|(_, given)| *given) {
            return Err(invalid_start(
                field,
                "with init: systemd, systemd starts what its units say",
            ));
        }
    }
    if req.snapshot.is_some() || req.template.is_some() {
        let machine_fields = [
            ("runtime", req.runtime.is_some()),
            ("init", req.init.is_some()),
        ];
        let mut from_machine = start_fields.iter().chain(machine_fields.iter());
        if let Some((field, _)) = from_machine.find(|(_, given)| *given) {
            return Err(invalid_start(
                field,
                "a sandbox made from a snapshot or a template goes on with what its machine has",
            ));
        }
    }

    // Each secret_env entry named as its own; then everything together.
    check_exec_size(
        &Command::Argv(Vec::new()),
        req.secret_env.0.iter(),
        "secret_env",
        None,
    )?;
    check_exec_size(
        &req.command,
        req.env.iter().chain(req.secret_env.0.iter()),
        "env",
        req.cwd.as_deref(),
    )?;
    if let Some(start) = &req.start_command {
        check_exec_size(start, req.env.iter(), "env", None)?;
    }

    if req.image_pull_secret.is_some() && req.image.is_none() {
        return Err(invalid(
            "image_pull_secret",
            "image_pull_secret goes with image",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
