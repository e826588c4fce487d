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

use std::collections::BTreeMap;
use std::fmt;

use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD};
use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{ApiError, ErrorCode};
use crate::exec::{parse_rfc3339, signal_name, signal_number};
use crate::ids::{valid_name, RESERVED_NAME_PREFIXES};

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

/// The largest request body: 64 MiB (413 `body_too_large` beyond).
pub const MAX_BODY_BYTES: usize = 64 << 20;
/// Most arguments of a command.
pub const MAX_ARGS: usize = 1000;
/// The longest single argument, shell command or env entry (`NAME=value`): Linux refuses to
/// exec a longer one (MAX_ARG_STRLEN, 32 pages with its NUL).
pub const MAX_ARG_BYTES: usize = (128 << 10) - 1;
/// The longest `cwd` (PATH_MAX with its NUL).
pub const MAX_CWD_BYTES: usize = 4095;
/// The shortest `timeout_seconds`: 1 ms (the agent's deadlines are whole milliseconds).
pub const MIN_TIMEOUT_SECONDS: f64 = 0.001;

/// Seconds (a `timeout_seconds`) as the agent's whole milliseconds: rounded up, so a deadline
/// is never shorter than asked, and at least 1 (the agent takes no zero deadline). The one
/// conversion of the node's runs and execs.
pub fn seconds_to_ms(s: f64) -> u64 {
    ((s * 1000.0).ceil() as u64).max(1)
}
/// command, env (and secret_env) and cwd of one request together. The sandbox's agent takes
/// them in one message of at most 4 MiB (sbx-proto `MAX_FRAME`): this much stays under it even
/// escaped as JSON at worst (6 bytes per byte), beside a sandbox's own env of the same size.
pub const MAX_EXEC_BYTES: usize = 256 << 10;

/// Most bytes of a start command (all its arguments together).
pub const MAX_START_COMMAND_BYTES: usize = 64 << 10;
/// A command's time when timeout_seconds is not given.
pub const DEFAULT_TIMEOUT_SECONDS: f64 = 300.0;
/// The most timeout_seconds (and sleep_after_seconds) may be.
pub const MAX_SECONDS: f64 = 1e9;
/// Most virtual CPUs a create may ask for.
pub const MAX_VCPUS: u32 = 32;
/// Least memory a sandbox may have: 128 MiB.
pub const MIN_MEMORY_BYTES: u64 = 128 << 20;
/// A sandbox's memory is a whole number of these: 2 MiB.
pub const MEMORY_STEP_BYTES: u64 = 2 << 20;
/// Most metadata keys.
pub const MAX_METADATA_KEYS: usize = 64;
/// Longest metadata key, in characters.
pub const MAX_METADATA_KEY_CHARS: usize = 64;
/// Longest metadata value, in characters.
pub const MAX_METADATA_VALUE_CHARS: usize = 1024;
/// Longest image reference.
pub const MAX_IMAGE_LEN: usize = 512;
/// Longest image_pull_secret.
pub const MAX_IMAGE_PULL_SECRET_LEN: usize = 128;
/// Longest hostname.
pub const MAX_HOSTNAME_LEN: usize = 63;
/// Longest user, in characters.
pub const MAX_USER_CHARS: usize = 64;
/// Longest Idempotency-Key, in characters.
pub const MAX_IDEMPOTENCY_KEY_CHARS: usize = 255;
/// Longest [`Command::display`], in characters.
pub const MAX_COMMAND_DISPLAY_CHARS: usize = 1024;
/// Most ports in egress.deny_ports.
pub const MAX_DENY_PORTS: usize = 64;
/// Longest stop.grace_ms: ten minutes.
pub const MAX_GRACE_MS: u32 = 600_000;
/// stop.grace_ms when it is not given.
pub const DEFAULT_GRACE_MS: u32 = 10_000;
/// The signals stop.signal may name (with `SIG` or without).
pub const STOP_SIGNALS: [&str; 21] = [
    "SIGTERM", "SIGINT", "SIGQUIT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGKILL", "SIGALRM",
    "SIGABRT", "SIGCONT", "SIGSTOP", "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGWINCH", "SIGPIPE",
    "SIGTRAP", "SIGBUS", "SIGSEGV", "SIGFPE", "SIGILL",
];

/// A command: one line for `sh -c`, or a list of arguments run without a shell.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Command {
    /// A line for `/bin/sh -c`.
    Shell(String),
    /// Arguments, the first found along the PATH of the command's own environment.
    Argv(Vec<String>),
}

impl Command {
    /// The command as text: the line, or the arguments joined by spaces, cut to 1024
    /// characters.
    pub fn display(&self) -> String {
        let full = match self {
            Command::Shell(line) => std::borrow::Cow::Borrowed(line.as_str()),
            Command::Argv(args) => std::borrow::Cow::Owned(args.join(" ")),
        };
        match full.char_indices().nth(MAX_COMMAND_DISPLAY_CHARS) {
            Some((cut, _)) => full[..cut].to_owned(),
            None => full.into_owned(),
        }
    }

    /// The arguments to execute: `["/bin/sh", "-c", line]` for a line, the list as it is
    /// otherwise.
    pub fn argv(&self) -> Vec<String> {
        match self {
            Command::Shell(line) => vec!["/bin/sh".to_owned(), "-c".to_owned(), line.clone()],
            Command::Argv(args) => args.clone(),
        }
    }
}

/// How stdin is given and stdout and stderr are returned.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// Text; output bytes that are not UTF-8 are replaced.
    #[default]
    Utf8,
    /// Standard base64 (with padding when written; with or without when read).
    Base64,
}

impl Encoding {
    /// The encoding as it is written on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Encoding::Utf8 => "utf8",
            Encoding::Base64 => "base64",
        }
    }

    /// Output bytes as this encoding writes them: lossy UTF-8, or padded standard base64.
    pub fn encode(self, bytes: &[u8]) -> String {
        match self {
            Encoding::Utf8 => String::from_utf8_lossy(bytes).into_owned(),
            Encoding::Base64 => STANDARD.encode(bytes),
        }
    }

    /// Input as bytes: the text's UTF-8, or the base64 decoded (standard alphabet, with its
    /// padding or with none). `None` for base64 that does not decode.
    pub fn decode(self, s: &str) -> Option<Vec<u8>> {
        match self {
            Encoding::Utf8 => Some(s.as_bytes().to_vec()),
            Encoding::Base64 => STANDARD
                .decode(s)
                .or_else(|_| STANDARD_NO_PAD.decode(s))
                .ok(),
        }
    }
}

/// Where the sandbox's /tmp is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tmp {
    /// On its disk (the default).
    #[default]
    Disk,
    /// A tmpfs of at most half its memory.
    Memory,
}

/// What the sandbox's PID 1 is, when it is not the platform's init.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Init {
    /// The image's own systemd.
    Systemd,
}

/// What expires_at does when it comes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnExpiry {
    /// Delete the sandbox (the default).
    #[default]
    Delete,
    /// Put it to sleep and keep it.
    Sleep,
    /// Put it to sleep, held asleep.
    Hold,
}

/// A region of the platform.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Region {
    /// North America.
    Na,
    /// Europe.
    Eu,
    /// Asia-Pacific.
    Ap,
}

/// When the machine of the sandbox's template counts as up.
///
/// The spec says "one of three objects" without their shapes; this crate reads them as
/// `{"tcp": {"port": P}}`, `{"http": {"port": P, "path": "/health"}}` (path defaults to `/`)
/// and `{"command": "..." | ["...", ...]}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ready {
    /// The port takes a TCP connection, tried from the host.
    Tcp {
        /// 1 to 65535.
        port: u16,
    },
    /// A GET of path on the port answers 200 to 399, tried from the host.
    Http {
        /// 1 to 65535.
        port: u16,
        /// Begins with `/`.
        path: String,
    },
    /// A command that succeeds in the sandbox, run as the image's user by sh.
    Command(Command),
}

/// The shape a create asks for; a part not given is the node's base template's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    /// Virtual CPUs, 1 to 32.
    pub vcpus: Option<u32>,
    /// Memory in bytes: at least 128 MiB, a whole number of 2 MiB.
    pub memory_bytes: Option<u64>,
}

/// How the sandbox's start command is stopped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stop {
    /// The signal, by its full name (`SIGTERM`), as given with `SIG` or without. `None`: the
    /// image's STOPSIGNAL, else SIGTERM.
    pub signal: Option<String>,
    /// `None`: [`DEFAULT_GRACE_MS`].
    pub grace_ms: Option<u32>,
}

impl Stop {
    /// The grace, with its default.
    pub fn grace_ms_or_default(&self) -> u32 {
        self.grace_ms.unwrap_or(DEFAULT_GRACE_MS)
    }

    /// The signal's number, if one was given.
    pub fn signal_number(&self) -> Option<i32> {
        self.signal.as_deref().and_then(signal_number)
    }
}

/// A volume to mount.
#[derive(Clone, Debug, PartialEq)]
pub struct VolumeMount {
    /// Absolute, not `/`, without `.` or `..` parts.
    pub path: String,
    /// The volume's id or name (not empty).
    pub volume: String,
    /// Default false.
    pub read_only: bool,
    /// Default false.
    pub copy: bool,
    /// A Drive version (an object), kept as given.
    pub version: Option<Value>,
}

/// secret_env: names to secret values. Its `Debug` shows the names alone.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct SecretEnv(pub BTreeMap<String, String>);

impl fmt::Debug for SecretEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.0.keys().map(|k| (k, "<redacted>")))
            .finish()
    }
}

/// A validated `POST /v1/run` body. Every field of the spec is here; defaults are filled in
/// where the spec gives one that does not depend on the node.
///
/// Maps (`env`, `secret_env`, `metadata`) are `BTreeMap`s, ordered by name: a JSON object's
/// order is not kept by the parser, and an environment's order means nothing.
#[derive(Clone, Debug, PartialEq)]
pub struct RunRequest {
    /// The command (required).
    pub command: Command,
    /// Start the image's own start command (`None`: not given).
    pub start: Option<bool>,
    /// The start command (at most 64 KiB).
    pub start_command: Option<Command>,
    /// When the template's machine counts as up.
    pub ready: Option<Ready>,
    /// Egress rules, checked for their shape and kept as given.
    pub egress: Option<Value>,
    /// `None`: the node's setting.
    pub guest_mitigations: Option<bool>,
    /// Default [`Tmp::Disk`].
    pub tmp: Tmp,
    /// Runtime settings (ulimits, sysctls, tmpfs, dns, shm_size_bytes), kept as given.
    pub runtime: Option<Value>,
    /// `None`: the platform's init.
    pub init: Option<Init>,
    /// Default false.
    pub project_network: bool,
    /// An OCI image reference (1 to 512 bytes, no whitespace). `None`: the node's base image.
    pub image: Option<String>,
    /// A secret's name (1 to 128 bytes); only with image.
    pub image_pull_secret: Option<String>,
    /// A snapshot's id or name.
    pub snapshot: Option<String>,
    /// A template's key on the node.
    pub template: Option<String>,
    /// The shape asked for.
    pub limits: Limits,
    /// A valid name ([`valid_name`]).
    pub name: Option<String>,
    /// Added to the sandbox's env for this command.
    pub env: BTreeMap<String, String>,
    /// Free key-value pairs.
    pub metadata: BTreeMap<String, String>,
    /// Volumes to mount.
    pub volumes: Vec<VolumeMount>,
    /// Public ports, each once, in order.
    pub public_ports: Vec<u16>,
    /// `None` (null, the default): only public_ports; `Some([])`: every port.
    pub public_ports_except: Option<Vec<u16>>,
    /// Inbound ports, an array kept as given.
    pub inbound: Option<Value>,
    /// `None`: not given (the node's default); `Some(None)`: null, never by itself;
    /// `Some(Some(s))`: after s seconds idle (1 to 1e9).
    pub sleep_after_seconds: Option<Option<f64>>,
    /// RFC 3339 (its shape checked here; "in the past" is the node's to check, with
    /// [`parse_rfc3339`]).
    pub expires_at: Option<String>,
    /// Default [`OnExpiry::Delete`].
    pub on_expiry: OnExpiry,
    /// Default false.
    pub held_asleep: bool,
    /// 0 to 60000.
    pub sleep_notice_ms: Option<u32>,
    /// 0 to 900000.
    pub sleep_hold_max_ms: Option<u32>,
    /// 1000 to 86400000.
    pub suspend_after_ms: Option<u32>,
    /// `HH:MM`, UTC.
    pub wake_daily_at: Option<String>,
    /// Checkpoint settings (an object), kept as given.
    pub checkpoint: Option<Value>,
    /// 1000 or more.
    pub delete_after_idle_ms: Option<u64>,
    /// Lower-case DNS name, at most 63 bytes.
    pub hostname: Option<String>,
    /// How the start command is stopped.
    pub stop: Option<Stop>,
    /// Secret variables; none of their names in env.
    pub secret_env: SecretEnv,
    /// An absolute path. `None`: the image's working directory.
    pub cwd: Option<String>,
    /// A user name, a uid, or uid:gid (1 to 64 characters). `None`: the image's user.
    pub user: Option<String>,
    /// Greater than 0, at most 1e9; default [`DEFAULT_TIMEOUT_SECONDS`].
    pub timeout_seconds: f64,
    /// The input's bytes (decoded from base64 when encoding is base64).
    pub stdin: Option<Vec<u8>>,
    /// Default [`Encoding::Utf8`].
    pub encoding: Encoding,
    /// `None`: as the request's Accept says.
    pub stream: Option<bool>,
    /// Default false.
    pub wait_for_reader: bool,
    /// `None`: the API's own region.
    pub region: Option<Region>,
}

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
    let timeout_seconds = given(obj, "timeout_seconds")
        .map(|v| {
            number_in(
                v,
                "timeout_seconds",
                |n| (MIN_TIMEOUT_SECONDS..=MAX_SECONDS).contains(&n),
                "a number from 0.001 (1 ms) to 1000000000",
            )
        })
        .transpose()?
        .unwrap_or(DEFAULT_TIMEOUT_SECONDS);
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
        timeout_seconds,
        stdin,
        encoding,
        stream,
        wait_for_reader,
        region,
    };
    check_across_fields(&req)?;
    Ok(req)
}

/// The highest uid and gid in a sandbox: its user namespace maps 65536 ids (0 to 65535).
pub const MAX_SANDBOX_ID: u64 = 65535;

/// Whether the numbers of a `user` or `owner` (a name, a uid, or uid:gid) are ids a sandbox
/// has: a number over [`MAX_SANDBOX_ID`] names nobody there (and 4294967295 would be "no
/// change" to chown). Names are looked up by the agent.
pub fn user_ids_in_range(spec: &str) -> bool {
    spec.split(':').all(|part| {
        part.is_empty()
            || !part.bytes().all(|b| b.is_ascii_digit())
            || part.parse::<u64>().is_ok_and(|n| n <= MAX_SANDBOX_ID)
    })
}

/// `user` of a run or a command: 1 to 64 characters, and ids a sandbox has (else 400
/// no_such_user).
pub(crate) fn check_user(user: Option<&str>) -> Result<(), ApiError> {
    let Some(u) = user else {
        return Ok(());
    };
    if u.is_empty() || u.chars().count() > MAX_USER_CHARS || u.contains('\0') {
        return Err(invalid("user", "user must be 1 to 64 characters"));
    }
    if !user_ids_in_range(u) {
        return Err(ApiError::new(
            ErrorCode::NoSuchUser,
            format!("user {u}: the ids of a sandbox go from 0 to {MAX_SANDBOX_ID}"),
        )
        .with_param("user"));
    }
    Ok(())
}

/// The sizes of what a command is started with (400 at validation, not a command lost later):
/// each argument, shell command and env entry at most [`MAX_ARG_BYTES`], `cwd` at most
/// [`MAX_CWD_BYTES`], all of them together at most [`MAX_EXEC_BYTES`].
pub(crate) fn check_exec_size<'a>(
    command: &Command,
    env: impl IntoIterator<Item = (&'a String, &'a String)>,
    env_field: &str,
    cwd: Option<&str>,
) -> Result<(), ApiError> {
    let parts: &[String] = match command {
        Command::Shell(s) => std::slice::from_ref(s),
        Command::Argv(args) => args,
    };
    let mut total = 0usize;
    for p in parts {
        if p.len() > MAX_ARG_BYTES {
            return Err(invalid(
                "command",
                format!(
                    "command has an argument of {} bytes, over {MAX_ARG_BYTES} (what Linux execs)",
                    p.len()
                ),
            ));
        }
        total += p.len() + 1;
    }
    for (k, v) in env {
        let n = k.len() + 1 + v.len();
        if n > MAX_ARG_BYTES {
            let param = format!("{env_field}.{k}");
            return Err(ApiError::new(
                ErrorCode::InvalidEnv,
                format!(
                    "{param} is {n} bytes with its name, over {MAX_ARG_BYTES} (what Linux execs)"
                ),
            )
            .with_param(param));
        }
        total += n + 1;
    }
    if let Some(c) = cwd {
        if c.len() > MAX_CWD_BYTES {
            return Err(invalid("cwd", format!("cwd is over {MAX_CWD_BYTES} bytes")));
        }
        total += c.len();
    }
    if total > MAX_EXEC_BYTES {
        return Err(invalid(
            "command",
            format!("command, env and cwd come to {total} bytes together, over {MAX_EXEC_BYTES}"),
        ));
    }
    Ok(())
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

// ---- field parsers ----

pub(crate) fn parse_command(
    v: &Value,
    param: &str,
    max_bytes: Option<usize>,
) -> Result<Command, ApiError> {
    let bad = |what: &str| invalid(param, format!("{param} {what}"));
    let cmd = match v {
        Value::String(s) => {
            if s.is_empty() {
                return Err(bad("is empty"));
            }
            Command::Shell(s.clone())
        }
        Value::Array(items) => {
            if items.is_empty() {
                return Err(bad("is an empty list"));
            }
            if items.len() > MAX_ARGS {
                return Err(bad("has more than 1000 arguments"));
            }
            let mut args = Vec::with_capacity(items.len());
            for item in items {
                match item {
                    Value::String(s) => args.push(s.clone()),
                    _ => return Err(bad("must be a list of strings")),
                }
            }
            if args.first().is_some_and(String::is_empty) {
                return Err(bad("has an empty first argument"));
            }
            Command::Argv(args)
        }
        _ => return Err(bad("must be a string or a list of strings")),
    };
    let parts: &[String] = match &cmd {
        Command::Shell(s) => std::slice::from_ref(s),
        Command::Argv(args) => args,
    };
    if parts.iter().any(|p| p.contains('\0')) {
        return Err(bad("holds a NUL byte"));
    }
    if let Some(max) = max_bytes {
        if parts.iter().map(String::len).sum::<usize>() > max {
            return Err(bad("is over 64 KiB"));
        }
    }
    Ok(cmd)
}

fn parse_ready(v: &Value) -> Result<Ready, ApiError> {
    let obj = object(v, "ready")?;
    reject_unknown(obj, "ready", &["tcp", "http", "command"])?;
    let given_keys: Vec<&str> = ["tcp", "http", "command"]
        .into_iter()
        .filter(|k| given(obj, k).is_some())
        .collect();
    if given_keys.len() != 1 {
        return Err(invalid(
            "ready",
            "ready must have exactly one of tcp, http and command",
        ));
    }
    match (given(obj, "tcp"), given(obj, "http"), given(obj, "command")) {
        (Some(tcp), _, _) => {
            let tcp = object(tcp, "ready.tcp")?;
            reject_unknown(tcp, "ready.tcp", &["port"])?;
            Ok(Ready::Tcp {
                port: required_port(tcp, "port", "ready.tcp.port")?,
            })
        }
        (_, Some(http), _) => {
            let http = object(http, "ready.http")?;
            reject_unknown(http, "ready.http", &["port", "path"])?;
            let port = required_port(http, "port", "ready.http.port")?;
            let path = match opt_str_at(http, "path", "ready.http.path")? {
                None => "/".to_owned(),
                Some(p)
                    if p.starts_with('/')
                        && !p.chars().any(|c| c.is_whitespace() || c.is_control()) =>
                {
                    p.to_owned()
                }
                Some(_) => {
                    return Err(invalid(
                        "ready.http.path",
                        "ready.http.path must be a path beginning with /",
                    ))
                }
            };
            Ok(Ready::Http { port, path })
        }
        (_, _, Some(cmd)) => Ok(Ready::Command(parse_command(cmd, "ready.command", None)?)),
        (None, None, None) => Err(invalid(
            "ready",
            "ready must have exactly one of tcp, http and command",
        )),
    }
}

fn required_port(obj: &Map<String, Value>, key: &str, param: &str) -> Result<u16, ApiError> {
    match given(obj, key) {
        Some(v) => port(v, param),
        None => Err(invalid(param, format!("{param} is required"))),
    }
}

fn port(v: &Value, param: &str) -> Result<u16, ApiError> {
    let n = uint_in(v, param, 1, 65_535)?;
    u16::try_from(n).map_err(|_| invalid(param, format!("{param} must be from 1 to 65535")))
}

fn check_egress(v: &Value) -> Result<Value, ApiError> {
    let bad = |param: &str, msg: &str| {
        ApiError::new(ErrorCode::InvalidEgress, format!("{param} {msg}")).with_param(param)
    };
    let Some(obj) = v.as_object() else {
        return Err(bad("egress", "must be an object or null"));
    };
    for (key, val) in obj {
        let param = format!("egress.{key}");
        match key.as_str() {
            "default" => match val {
                Value::Null => {}
                Value::String(s) if s == "allow" || s == "deny" => {}
                _ => return Err(bad(&param, "must be allow, deny or null")),
            },
            "allow" | "deny" | "http" | "inject" => {
                if !val.is_null() && !val.is_array() {
                    return Err(bad(&param, "must be an array or null"));
                }
            }
            "deny_ports" => match val {
                Value::Null => {}
                Value::Array(ports) => {
                    if ports.len() > MAX_DENY_PORTS {
                        return Err(bad(&param, "has more than 64 ports"));
                    }
                    for (i, p) in ports.iter().enumerate() {
                        if !p.as_u64().is_some_and(|n| (1..=65_535).contains(&n)) {
                            return Err(bad(
                                &format!("egress.deny_ports[{i}]"),
                                "must be a port from 1 to 65535",
                            ));
                        }
                    }
                }
                _ => return Err(bad(&param, "must be an array or null")),
            },
            _ => return Err(bad(&param, "is not a part of egress rules")),
        }
    }
    Ok(v.clone())
}

fn check_runtime(v: &Value) -> Result<Value, ApiError> {
    let obj = object(v, "runtime")?;
    reject_unknown(
        obj,
        "runtime",
        &["ulimits", "sysctls", "tmpfs", "dns", "shm_size_bytes"],
    )?;
    for key in ["ulimits", "sysctls", "dns"] {
        if let Some(val) = given(obj, key) {
            object(val, &format!("runtime.{key}"))?;
        }
    }
    if let Some(val) = given(obj, "tmpfs") {
        if !val.is_array() {
            return Err(invalid("runtime.tmpfs", "runtime.tmpfs must be an array"));
        }
    }
    if let Some(val) = given(obj, "shm_size_bytes") {
        uint_in(val, "runtime.shm_size_bytes", 1 << 20, 1 << 40)?;
    }
    Ok(v.clone())
}

fn check_image(s: &str) -> Result<String, ApiError> {
    if s.is_empty()
        || s.len() > MAX_IMAGE_LEN
        || s.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(ApiError::new(
            ErrorCode::InvalidImage,
            "image must be an image reference of 1 to 512 characters, without spaces",
        )
        .with_param("image"));
    }
    Ok(s.to_owned())
}

fn check_name(s: &str) -> Result<String, ApiError> {
    if valid_name(s) {
        return Ok(s.to_owned());
    }
    let msg = if RESERVED_NAME_PREFIXES.iter().any(|p| s.starts_with(p)) {
        "name may not start with an id prefix (sbx-, exe-, snap-, vol-, evt-, req-)"
    } else {
        "name must be 1 to 63 lower-case letters, digits and hyphens, not starting or ending with a hyphen"
    };
    Err(ApiError::new(ErrorCode::InvalidName, msg).with_param("name"))
}

fn parse_limits(v: &Value) -> Result<Limits, ApiError> {
    let obj = object(v, "limits")?;
    if let Some(key) = obj
        .keys()
        .find(|k| !["vcpus", "memory_bytes", "disk_bytes"].contains(&k.as_str()))
    {
        return Err(unknown_field(&format!("limits.{key}"), "limits"));
    }
    if obj.contains_key("disk_bytes") {
        return Err(invalid(
            "limits.disk_bytes",
            "the disk's size is the node's: limits.disk_bytes cannot be set",
        ));
    }
    let vcpus = match given(obj, "vcpus") {
        None => None,
        Some(v) => {
            let n = uint_in(v, "limits.vcpus", 1, u64::from(MAX_VCPUS))?;
            Some(u32::try_from(n).map_err(|_| invalid("limits.vcpus", "out of range"))?)
        }
    };
    let memory_bytes = match given(obj, "memory_bytes") {
        None => None,
        Some(v) => match v.as_u64() {
            Some(n) if n >= MIN_MEMORY_BYTES && n % MEMORY_STEP_BYTES == 0 => Some(n),
            _ => {
                return Err(invalid(
                    "limits.memory_bytes",
                    "limits.memory_bytes must be at least 134217728 (128 MiB) and an even number of MiB",
                ))
            }
        },
    };
    Ok(Limits {
        vcpus,
        memory_bytes,
    })
}

pub(crate) fn parse_env(v: &Value, field: &str) -> Result<BTreeMap<String, String>, ApiError> {
    let obj = object(v, field)?;
    let mut out = BTreeMap::new();
    for (key, val) in obj {
        let param = format!("{field}.{key}");
        let bad = |msg: &str| {
            ApiError::new(ErrorCode::InvalidEnv, format!("{param} {msg}")).with_param(&param)
        };
        if key.is_empty() {
            return Err(bad("has an empty name"));
        }
        if key.contains('=') || key.contains('\0') {
            return Err(bad("has a name with = or a NUL byte"));
        }
        let Value::String(s) = val else {
            return Err(bad("must be a string"));
        };
        if s.contains('\0') {
            return Err(bad("has a NUL byte"));
        }
        out.insert(key.clone(), s.clone());
    }
    Ok(out)
}

fn parse_metadata(v: &Value) -> Result<BTreeMap<String, String>, ApiError> {
    let obj = object(v, "metadata")?;
    let bad =
        |param: &str, msg: String| ApiError::new(ErrorCode::InvalidMetadata, msg).with_param(param);
    if obj.len() > MAX_METADATA_KEYS {
        return Err(bad("metadata", "metadata has more than 64 keys".to_owned()));
    }
    let mut out = BTreeMap::new();
    for (key, val) in obj {
        let param = format!("metadata.{key}");
        if !(1..=MAX_METADATA_KEY_CHARS).contains(&key.chars().count()) {
            return Err(bad(
                &param,
                "metadata keys must be 1 to 64 characters".to_owned(),
            ));
        }
        match val {
            Value::String(s) if s.chars().count() <= MAX_METADATA_VALUE_CHARS => {
                out.insert(key.clone(), s.clone());
            }
            Value::String(_) => {
                return Err(bad(&param, format!("{param} is over 1024 characters")))
            }
            _ => return Err(bad(&param, format!("{param} must be a string"))),
        }
    }
    Ok(out)
}

fn parse_volumes(v: &Value) -> Result<Vec<VolumeMount>, ApiError> {
    let Value::Array(items) = v else {
        return Err(invalid("volumes", "volumes must be an array"));
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = format!("volumes[{i}]");
        let obj = object(item, &at)?;
        reject_unknown(
            obj,
            &at,
            &["path", "volume", "read_only", "copy", "version"],
        )?;
        let path_param = format!("{at}.path");
        let path = match given(obj, "path") {
            Some(Value::String(p)) => p,
            Some(_) => {
                return Err(invalid(
                    &path_param,
                    format!("{path_param} must be a string"),
                ))
            }
            None => return Err(invalid(&path_param, format!("{path_param} is required"))),
        };
        if !valid_mount_path(path) {
            return Err(ApiError::new(
                ErrorCode::InvalidPath,
                format!("{path_param} must be an absolute path other than /"),
            )
            .with_param(path_param));
        }
        let volume_param = format!("{at}.volume");
        let volume = match given(obj, "volume") {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            Some(_) => {
                return Err(invalid(
                    &volume_param,
                    format!("{volume_param} must be a volume's id or name"),
                ))
            }
            None => {
                return Err(invalid(
                    &volume_param,
                    format!("{volume_param} is required"),
                ))
            }
        };
        let read_only = opt_bool_at(obj, "read_only", &format!("{at}.read_only"))?.unwrap_or(false);
        let copy = opt_bool_at(obj, "copy", &format!("{at}.copy"))?.unwrap_or(false);
        let version = match given(obj, "version") {
            Some(v) if !v.is_object() => {
                let p = format!("{at}.version");
                return Err(invalid(&p, format!("{p} must be an object or null")));
            }
            v => v.cloned(),
        };
        out.push(VolumeMount {
            path: path.clone(),
            volume,
            read_only,
            copy,
            version,
        });
    }
    Ok(out)
}

/// Absolute, not `/` (however written), no `.` or `..` part, no NUL.
fn valid_mount_path(p: &str) -> bool {
    p.starts_with('/')
        && !p.contains('\0')
        && p.split('/').any(|part| !part.is_empty())
        && p.split('/').all(|part| part != "." && part != "..")
}

fn parse_ports(v: &Value, field: &str) -> Result<Vec<u16>, ApiError> {
    let Value::Array(items) = v else {
        return Err(invalid(field, format!("{field} must be an array of ports")));
    };
    let mut out: Vec<u16> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let p = port(item, &format!("{field}[{i}]"))?;
        if !out.contains(&p) {
            out.push(p);
        }
    }
    Ok(out)
}

fn parse_stop(v: &Value) -> Result<Stop, ApiError> {
    let obj = object(v, "stop")?;
    reject_unknown(obj, "stop", &["signal", "grace_ms"])?;
    let signal = match opt_str_at(obj, "signal", "stop.signal")? {
        None => None,
        Some(s) => {
            let full = if s.starts_with("SIG") {
                s.to_owned()
            } else {
                format!("SIG{s}")
            };
            if !STOP_SIGNALS.contains(&full.as_str()) {
                return Err(invalid(
                    "stop.signal",
                    "stop.signal must be a signal's name, as SIGTERM or TERM",
                ));
            }
            // Normalize through the number, so the name is the one signal_name gives.
            Some(signal_number(&full).map(signal_name).unwrap_or(full))
        }
    };
    let grace_ms = match given(obj, "grace_ms") {
        None => None,
        Some(v) => {
            let n = uint_in(v, "stop.grace_ms", 0, u64::from(MAX_GRACE_MS))?;
            Some(u32::try_from(n).map_err(|_| invalid("stop.grace_ms", "out of range"))?)
        }
    };
    Ok(Stop { signal, grace_ms })
}

fn valid_hostname(s: &str) -> bool {
    let label_ok = |l: &str| {
        let b = l.as_bytes();
        let edge = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
        b.first().is_some_and(edge)
            && b.last().is_some_and(edge)
            && b.iter().all(|c| edge(c) || *c == b'-')
    };
    !s.is_empty() && s.len() <= MAX_HOSTNAME_LEN && s.split('.').all(label_ok)
}

/// `^([01][0-9]|2[0-3]):[0-5][0-9]$`
fn valid_time_of_day(s: &str) -> bool {
    match s.as_bytes() {
        [h1, h2, b':', m1, m2] => {
            let hour_ok = matches!((h1, h2), (b'0'..=b'1', b'0'..=b'9') | (b'2', b'0'..=b'3'));
            hour_ok && matches!(m1, b'0'..=b'5') && m2.is_ascii_digit()
        }
        _ => false,
    }
}

// ---- helpers ----

pub(crate) fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
    ApiError::invalid_field(param, message)
}

pub(crate) fn unknown_field(param: &str, of: &str) -> ApiError {
    ApiError::new(
        ErrorCode::UnknownField,
        format!("{param} is not a field {of} takes"),
    )
    .with_param(param)
}

/// The field's value, unless it is absent or null.
pub(crate) fn given<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

fn object<'a>(v: &'a Value, param: &str) -> Result<&'a Map<String, Value>, ApiError> {
    v.as_object()
        .ok_or_else(|| invalid(param, format!("{param} must be an object")))
}

fn reject_unknown(obj: &Map<String, Value>, at: &str, known: &[&str]) -> Result<(), ApiError> {
    match obj.keys().find(|k| !known.contains(&k.as_str())) {
        Some(key) => Err(unknown_field(&format!("{at}.{key}"), at)),
        None => Ok(()),
    }
}

pub(crate) fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, ApiError> {
    opt_bool_at(obj, key, key)
}

fn opt_bool_at(obj: &Map<String, Value>, key: &str, param: &str) -> Result<Option<bool>, ApiError> {
    match given(obj, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(invalid(param, format!("{param} must be true or false"))),
    }
}

pub(crate) fn opt_str<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
) -> Result<Option<&'a str>, ApiError> {
    opt_str_at(obj, key, key)
}

fn opt_str_at<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
    param: &str,
) -> Result<Option<&'a str>, ApiError> {
    match given(obj, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(invalid(param, format!("{param} must be a string"))),
    }
}

fn opt_nonempty_str(obj: &Map<String, Value>, key: &str) -> Result<Option<String>, ApiError> {
    match opt_str(obj, key)? {
        Some("") => Err(invalid(key, format!("{key} must not be empty"))),
        s => Ok(s.map(str::to_owned)),
    }
}

pub(crate) fn uint_in(v: &Value, param: &str, min: u64, max: u64) -> Result<u64, ApiError> {
    match v.as_u64() {
        Some(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(invalid(
            param,
            format!("{param} must be an integer from {min} to {max}"),
        )),
    }
}

fn opt_u32(
    obj: &Map<String, Value>,
    key: &str,
    min: u32,
    max: u32,
) -> Result<Option<u32>, ApiError> {
    match given(obj, key) {
        None => Ok(None),
        Some(v) => {
            let n = uint_in(v, key, u64::from(min), u64::from(max))?;
            Ok(Some(
                u32::try_from(n).map_err(|_| invalid(key, "out of range"))?,
            ))
        }
    }
}

pub(crate) fn number_in(
    v: &Value,
    param: &str,
    ok: impl Fn(f64) -> bool,
    what: &str,
) -> Result<f64, ApiError> {
    match v.as_f64() {
        Some(n) if v.is_number() && ok(n) => Ok(n),
        _ => Err(invalid(param, format!("{param} must be {what}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_to_ms_rounds_up_to_at_least_one() {
        assert_eq!(seconds_to_ms(MIN_TIMEOUT_SECONDS), 1);
        assert_eq!(seconds_to_ms(0.0015), 2);
        assert_eq!(seconds_to_ms(0.5), 500);
        assert_eq!(seconds_to_ms(DEFAULT_TIMEOUT_SECONDS), 300_000);
        assert_eq!(seconds_to_ms(MAX_SECONDS), 1_000_000_000_000);
        assert_eq!(seconds_to_ms(0.0), 1);
        assert_eq!(seconds_to_ms(1e-9), 1);
    }
    use serde_json::json;

    fn ok(body: Value) -> RunRequest {
        match parse_run_request(body.to_string().as_bytes()) {
            Ok(r) => r,
            Err(e) => panic!("{body}: {e:?}"),
        }
    }

    fn err(body: Value) -> (ErrorCode, Option<String>) {
        match parse_run_request(body.to_string().as_bytes()) {
            Ok(r) => panic!("{body} was taken: {r:?}"),
            Err(e) => (e.code, e.param),
        }
    }

    fn with(extra: Value) -> Value {
        let mut body = json!({"command": "true"});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                b.insert(k.clone(), v.clone());
            }
        }
        body
    }

    fn field_err(extra: Value) -> (ErrorCode, Option<String>) {
        err(with(extra))
    }

    fn is(code: ErrorCode, param: &str) -> (ErrorCode, Option<String>) {
        (code, Some(param.to_owned()))
    }

    use ErrorCode::*;

    #[test]
    fn command_env_and_cwd_sizes_are_checked_at_validation() {
        let big = "x".repeat(MAX_ARG_BYTES + 1);
        let fits = "x".repeat(MAX_ARG_BYTES);
        assert_eq!(err(json!({ "command": big })), is(InvalidField, "command"));
        assert_eq!(
            err(json!({ "command": ["echo", big] })),
            is(InvalidField, "command")
        );
        assert!(parse_run_request(json!({ "command": fits }).to_string().as_bytes()).is_ok());
        // A 10 MB command, argv, env or cwd: 400, never a command lost at the agent.
        let huge = "y".repeat(10 << 20);
        assert_eq!(err(json!({ "command": huge })), is(InvalidField, "command"));
        assert_eq!(
            field_err(json!({ "env": { "A": huge } })),
            is(InvalidEnv, "env.A")
        );
        assert_eq!(
            field_err(json!({ "secret_env": { "S": huge } })),
            is(InvalidEnv, "secret_env.S")
        );
        assert_eq!(
            field_err(json!({ "cwd": format!("/{huge}") })),
            is(InvalidField, "cwd")
        );
        // Each part fits, together they do not.
        let args: Vec<String> = (0..3).map(|_| "z".repeat(100 << 10)).collect();
        assert_eq!(err(json!({ "command": args })), is(InvalidField, "command"));
        let env: serde_json::Map<String, Value> = (0..3)
            .map(|i| (format!("E{i}"), json!("z".repeat(100 << 10))))
            .collect();
        assert_eq!(
            field_err(json!({ "env": env })),
            is(InvalidField, "command")
        );
        // A create checks its env the same way.
        let e = crate::parse_sandbox_create(json!({ "env": { "A": huge } }).to_string().as_bytes())
            .unwrap_err();
        assert_eq!((e.code, e.param.as_deref()), (InvalidEnv, Some("env.A")));
    }

    #[test]
    fn users_are_ids_a_sandbox_has() {
        for u in [
            "65536",
            "0:999999999",
            "4294967295",
            "1000:65536",
            "99999999999999999999",
        ] {
            assert_eq!(
                field_err(json!({ "user": u })),
                is(NoSuchUser, "user"),
                "{u}"
            );
        }
        for u in [
            "0",
            "65535",
            "0:0",
            "1000:1000",
            "root",
            "nobody",
            "a1:2",
            "user:65536x",
        ] {
            assert!(
                parse_run_request(with(json!({ "user": u })).to_string().as_bytes()).is_ok(),
                "{u}"
            );
        }
        assert!(user_ids_in_range("65535:65535"));
        assert!(!user_ids_in_range("65535:65536"));
    }

    #[test]
    fn timeouts_are_at_least_a_millisecond() {
        for t in [json!(1e-320), json!(0.0009), json!(0), json!(-1)] {
            assert_eq!(
                field_err(json!({ "timeout_seconds": t })),
                is(InvalidField, "timeout_seconds"),
                "{t}"
            );
        }
        assert_eq!(
            ok(with(json!({ "timeout_seconds": 0.001 }))).timeout_seconds,
            0.001
        );
    }

    #[test]
    fn defaults() {
        let r = ok(json!({"command": "echo hi"}));
        assert_eq!(r.command, Command::Shell("echo hi".into()));
        assert_eq!(r.timeout_seconds, 300.0);
        assert_eq!(r.encoding, Encoding::Utf8);
        assert_eq!(r.tmp, Tmp::Disk);
        assert_eq!(r.on_expiry, OnExpiry::Delete);
        assert_eq!(r.limits, Limits::default());
        assert!(!r.project_network && !r.held_asleep && !r.wait_for_reader);
        assert_eq!(r.stdin, None);
        assert_eq!(r.stream, None);
        assert_eq!(r.start, None);
        assert_eq!(r.sleep_after_seconds, None);
        assert_eq!(r.region, None);
        assert!(r.env.is_empty() && r.secret_env.0.is_empty() && r.metadata.is_empty());
        assert!(r.volumes.is_empty() && r.public_ports.is_empty());
        assert_eq!(r.public_ports_except, None);
        assert_eq!(r.stop, None);
    }

    #[test]
    fn nulls_count_as_not_given() {
        let mut body = serde_json::Map::new();
        for f in RUN_FIELDS {
            body.insert(f.to_owned(), Value::Null);
        }
        body.insert("command".into(), json!(["ls", "-l"]));
        let r = ok(Value::Object(body));
        assert_eq!(r.command, Command::Argv(vec!["ls".into(), "-l".into()]));
        assert_eq!(r.timeout_seconds, 300.0);
        assert_eq!(r.sleep_after_seconds, Some(None));
    }

    #[test]
    fn everything_given() {
        let r = ok(json!({
            "command": ["python3", "-c", "print(1)"],
            "start": true,
            "start_command": "nginx -g 'daemon off;'",
            "ready": {"http": {"port": 8080, "path": "/healthz"}},
            "egress": {"default": "deny", "allow": ["example.com"], "deny_ports": [25]},
            "guest_mitigations": true,
            "tmp": "memory",
            "runtime": {"ulimits": {"nofile": 1024}, "shm_size_bytes": 1048576},
            "project_network": true,
            "image": "python:3.12",
            "image_pull_secret": "ghcr-login",
            "limits": {"vcpus": 2, "memory_bytes": 536870912u64},
            "name": "my-run",
            "env": {"FOO": "bar", "EMPTY": ""},
            "metadata": {"team": "a"},
            "volumes": [{"path": "/data", "volume": "vol-0123456789abcdef", "read_only": true, "copy": null}],
            "public_ports": [8080, 8080, 3000],
            "public_ports_except": [],
            "inbound": [],
            "sleep_after_seconds": 60,
            "expires_at": "2030-01-01T00:00:00Z",
            "on_expiry": "hold",
            "held_asleep": true,
            "sleep_notice_ms": 0,
            "sleep_hold_max_ms": 900000,
            "suspend_after_ms": 1000,
            "wake_daily_at": "23:59",
            "checkpoint": {},
            "delete_after_idle_ms": 1000,
            "hostname": "box.internal",
            "stop": {"signal": "INT", "grace_ms": 600000},
            "secret_env": {"TOKEN": "s3cret"},
            "cwd": "/srv",
            "user": "1000:1000",
            "timeout_seconds": 0.5,
            "stdin": "aGk=",
            "encoding": "base64",
            "stream": false,
            "wait_for_reader": true,
            "region": "eu",
        }));
        assert_eq!(
            r.ready,
            Some(Ready::Http {
                port: 8080,
                path: "/healthz".into()
            })
        );
        assert_eq!(r.tmp, Tmp::Memory);
        assert_eq!(r.limits.vcpus, Some(2));
        assert_eq!(r.limits.memory_bytes, Some(512 << 20));
        assert_eq!(r.env.get("FOO").map(String::as_str), Some("bar"));
        assert_eq!(r.volumes.len(), 1);
        assert!(r.volumes[0].read_only && !r.volumes[0].copy);
        assert_eq!(r.public_ports, vec![8080, 3000]);
        assert_eq!(r.public_ports_except, Some(vec![]));
        assert_eq!(r.sleep_after_seconds, Some(Some(60.0)));
        assert_eq!(r.on_expiry, OnExpiry::Hold);
        assert_eq!(
            r.stop,
            Some(Stop {
                signal: Some("SIGINT".into()),
                grace_ms: Some(600_000)
            })
        );
        assert_eq!(r.stop.as_ref().and_then(Stop::signal_number), Some(2));
        assert_eq!(r.timeout_seconds, 0.5);
        assert_eq!(r.stdin, Some(b"hi".to_vec()));
        assert_eq!(r.encoding, Encoding::Base64);
        assert_eq!(r.stream, Some(false));
        assert_eq!(r.region, Some(Region::Eu));
        assert_eq!(r.user.as_deref(), Some("1000:1000"));
        assert!(r.egress.is_some() && r.runtime.is_some() && r.checkpoint.is_some());
        let dbg = format!("{r:?}");
        assert!(!dbg.contains("s3cret"), "{dbg}");
        assert!(dbg.contains("TOKEN"));
    }

    #[test]
    fn not_json_object_is_invalid_json() {
        for body in [
            &b"not json"[..],
            b"",
            b"[]",
            b"\"x\"",
            b"1",
            b"null",
            b"{",
            b"\xff",
        ] {
            let e = parse_run_request(body).unwrap_err();
            assert_eq!(e.code, InvalidJson);
            assert_eq!(e.param, None);
            assert_eq!(e.status(), 400);
        }
    }

    #[test]
    fn too_large_body() {
        let body = vec![b' '; MAX_BODY_BYTES + 1];
        assert_eq!(parse_run_request(&body).unwrap_err().code, BodyTooLarge);
    }

    #[test]
    fn unknown_fields() {
        assert_eq!(field_err(json!({"tty": true})), is(UnknownField, "tty"));
        assert_eq!(
            field_err(json!({"stdin_open": true})),
            is(UnknownField, "stdin_open")
        );
        // unknown_field comes before missing_command and before any field's check.
        assert_eq!(err(json!({"nope": 1})), is(UnknownField, "nope"));
        assert_eq!(
            field_err(json!({"timeout_seconds": -1, "zzz": 1})),
            is(UnknownField, "zzz")
        );
        assert_eq!(
            field_err(json!({"limits": {"gpus": 1}})),
            is(UnknownField, "limits.gpus")
        );
        assert_eq!(
            field_err(json!({"stop": {"signal": "TERM", "after": 1}})),
            is(UnknownField, "stop.after")
        );
        assert_eq!(
            field_err(json!({"volumes": [{"path": "/a", "volume": "v", "mode": "rw"}]})),
            is(UnknownField, "volumes[0].mode")
        );
        assert_eq!(
            field_err(json!({"start": true, "ready": {"tcp": {"port": 1}, "udp": 1}})),
            is(UnknownField, "ready.udp")
        );
        assert_eq!(
            field_err(json!({"start": true, "ready": {"tcp": {"port": 1, "host": "x"}}})),
            is(UnknownField, "ready.tcp.host")
        );
        assert_eq!(
            field_err(json!({"runtime": {"cap_add": []}})),
            is(UnknownField, "runtime.cap_add")
        );
    }

    #[test]
    fn missing_command() {
        assert_eq!(err(json!({})), is(MissingCommand, "command"));
        assert_eq!(err(json!({"command": null})), is(MissingCommand, "command"));
        let e = parse_run_request(b"{}").unwrap_err();
        assert_eq!(e.status(), 400);
    }

    #[test]
    fn invalid_commands() {
        let bad = |c: Value| err(json!({ "command": c }));
        let cmd = is(InvalidField, "command");
        assert_eq!(bad(json!("")), cmd);
        assert_eq!(bad(json!([])), cmd);
        assert_eq!(bad(json!([""])), cmd);
        assert_eq!(bad(json!(["", "x"])), cmd);
        assert_eq!(bad(json!("a\u{0}b")), cmd);
        assert_eq!(bad(json!(["ls", "a\u{0}"])), cmd);
        assert_eq!(bad(json!(["ls", 1])), cmd);
        assert_eq!(bad(json!(1)), cmd);
        assert_eq!(bad(json!({"sh": "x"})), cmd);
        let too_many: Vec<String> = (0..=MAX_ARGS).map(|i| i.to_string()).collect();
        assert_eq!(bad(json!(too_many)), cmd);
        let just_enough: Vec<String> = (0..MAX_ARGS).map(|i| i.to_string()).collect();
        assert!(matches!(
            ok(json!({ "command": just_enough })).command,
            Command::Argv(a) if a.len() == MAX_ARGS
        ));
        // Later arguments may be empty.
        ok(json!({"command": ["echo", ""]}));
    }

    #[test]
    fn command_display_and_argv() {
        let c = Command::Argv(vec!["echo".into(), "a b".into()]);
        assert_eq!(c.display(), "echo a b");
        assert_eq!(c.argv(), vec!["echo", "a b"]);
        let s = Command::Shell("echo hi | wc".into());
        assert_eq!(s.display(), "echo hi | wc");
        assert_eq!(s.argv(), vec!["/bin/sh", "-c", "echo hi | wc"]);
        let long = Command::Shell("é".repeat(2000));
        assert_eq!(long.display().chars().count(), 1024);
        let exact = Command::Shell("x".repeat(1024));
        assert_eq!(exact.display().len(), 1024);
        let args = Command::Argv(vec!["a".repeat(1000), "b".repeat(100)]);
        assert_eq!(args.display().len(), 1024);
        assert!(args.display().ends_with(&format!(" {}", "b".repeat(23))));
    }

    #[test]
    fn start_command_rules() {
        let r = ok(with(json!({"start_command": ["/app", "--port", "80"]})));
        assert!(matches!(r.start_command, Some(Command::Argv(_))));
        assert_eq!(
            field_err(json!({"start_command": ""})),
            is(InvalidField, "start_command")
        );
        assert_eq!(
            field_err(json!({"start_command": ["", "x"]})),
            is(InvalidField, "start_command")
        );
        assert_eq!(
            field_err(json!({"start_command": "x".repeat(MAX_START_COMMAND_BYTES + 1)})),
            is(InvalidField, "start_command")
        );
        assert_eq!(
            field_err(json!({"start_command": ["a".repeat(40_000), "b".repeat(40_000)]})),
            is(InvalidField, "start_command")
        );
        ok(with(
            json!({"start_command": "x".repeat(MAX_START_COMMAND_BYTES)}),
        ));
        assert_eq!(
            field_err(json!({"start": "yes"})),
            is(InvalidField, "start")
        );
    }

    #[test]
    fn ready_shapes() {
        let r = ok(with(
            json!({"start": true, "ready": {"tcp": {"port": 5432}}}),
        ));
        assert_eq!(r.ready, Some(Ready::Tcp { port: 5432 }));
        let r = ok(with(
            json!({"start_command": "x", "ready": {"http": {"port": 80}}}),
        ));
        assert_eq!(
            r.ready,
            Some(Ready::Http {
                port: 80,
                path: "/".into()
            })
        );
        let r = ok(with(
            json!({"start": true, "ready": {"command": "pg_isready"}}),
        ));
        assert_eq!(
            r.ready,
            Some(Ready::Command(Command::Shell("pg_isready".into())))
        );
        let bad = |ready: Value| field_err(json!({"start": true, "ready": ready}));
        assert_eq!(bad(json!({})), is(InvalidField, "ready"));
        assert_eq!(bad(json!("tcp")), is(InvalidField, "ready"));
        assert_eq!(
            bad(json!({"tcp": {"port": 1}, "command": "x"})),
            is(InvalidField, "ready")
        );
        assert_eq!(bad(json!({"tcp": {}})), is(InvalidField, "ready.tcp.port"));
        assert_eq!(bad(json!({"tcp": 80})), is(InvalidField, "ready.tcp"));
        assert_eq!(
            bad(json!({"tcp": {"port": 0}})),
            is(InvalidField, "ready.tcp.port")
        );
        assert_eq!(
            bad(json!({"tcp": {"port": 65536}})),
            is(InvalidField, "ready.tcp.port")
        );
        assert_eq!(
            bad(json!({"http": {"port": 80, "path": "health"}})),
            is(InvalidField, "ready.http.path")
        );
        assert_eq!(
            bad(json!({"http": {"port": 80, "path": 1}})),
            is(InvalidField, "ready.http.path")
        );
        assert_eq!(
            bad(json!({"command": ""})),
            is(InvalidField, "ready.command")
        );
    }

    #[test]
    fn egress_shapes() {
        let bad = |e: Value| field_err(json!({ "egress": e }));
        assert_eq!(bad(json!([])), is(InvalidEgress, "egress"));
        assert_eq!(
            bad(json!({"default": "maybe"})),
            is(InvalidEgress, "egress.default")
        );
        assert_eq!(
            bad(json!({"allow": "x"})),
            is(InvalidEgress, "egress.allow")
        );
        assert_eq!(
            bad(json!({"inject": {}})),
            is(InvalidEgress, "egress.inject")
        );
        assert_eq!(bad(json!({"rules": []})), is(InvalidEgress, "egress.rules"));
        assert_eq!(
            bad(json!({"deny_ports": [22, 0]})),
            is(InvalidEgress, "egress.deny_ports[1]")
        );
        let many: Vec<u16> = (1..=65).collect();
        assert_eq!(
            bad(json!({ "deny_ports": many })),
            is(InvalidEgress, "egress.deny_ports")
        );
        let r = ok(with(
            json!({"egress": {"default": null, "deny_ports": null}}),
        ));
        assert!(r.egress.is_some());
        assert_eq!(ok(with(json!({"egress": null}))).egress, None);
    }

    #[test]
    fn simple_enums_and_flags() {
        assert_eq!(field_err(json!({"tmp": "ram"})), is(InvalidField, "tmp"));
        assert_eq!(field_err(json!({"tmp": 1})), is(InvalidField, "tmp"));
        assert_eq!(
            field_err(json!({"init": "openrc"})),
            is(InvalidField, "init")
        );
        assert_eq!(
            ok(with(json!({"init": "systemd"}))).init,
            Some(Init::Systemd)
        );
        assert_eq!(
            field_err(json!({"guest_mitigations": 1})),
            is(InvalidField, "guest_mitigations")
        );
        assert_eq!(
            field_err(json!({"project_network": "true"})),
            is(InvalidField, "project_network")
        );
        assert_eq!(
            field_err(json!({"runtime": 1})),
            is(InvalidField, "runtime")
        );
        assert_eq!(
            field_err(json!({"runtime": {"ulimits": []}})),
            is(InvalidField, "runtime.ulimits")
        );
        assert_eq!(
            field_err(json!({"runtime": {"tmpfs": {}}})),
            is(InvalidField, "runtime.tmpfs")
        );
        assert_eq!(
            field_err(json!({"runtime": {"shm_size_bytes": 1}})),
            is(InvalidField, "runtime.shm_size_bytes")
        );
        assert_eq!(
            field_err(json!({"on_expiry": "pause"})),
            is(InvalidField, "on_expiry")
        );
        assert_eq!(
            ok(with(json!({"on_expiry": "sleep"}))).on_expiry,
            OnExpiry::Sleep
        );
        assert_eq!(
            field_err(json!({"held_asleep": 0})),
            is(InvalidField, "held_asleep")
        );
        assert_eq!(
            field_err(json!({"stream": "yes"})),
            is(InvalidField, "stream")
        );
        assert_eq!(
            field_err(json!({"wait_for_reader": 1})),
            is(InvalidField, "wait_for_reader")
        );
        assert_eq!(ok(with(json!({"stream": true}))).stream, Some(true));
    }

    #[test]
    fn images_and_sources() {
        assert_eq!(field_err(json!({"image": ""})), is(InvalidImage, "image"));
        assert_eq!(
            field_err(json!({"image": "a b"})),
            is(InvalidImage, "image")
        );
        assert_eq!(
            field_err(json!({"image": "a\tb"})),
            is(InvalidImage, "image")
        );
        assert_eq!(
            field_err(json!({"image": "x".repeat(513)})),
            is(InvalidImage, "image")
        );
        assert_eq!(field_err(json!({"image": 5})), is(InvalidField, "image"));
        ok(with(json!({"image": "x".repeat(512)})));
        ok(with(json!({"image": "ghcr.io/org/app@sha256:abc"})));
        assert_eq!(
            field_err(json!({"image": "a", "image_pull_secret": ""})),
            is(InvalidField, "image_pull_secret")
        );
        assert_eq!(
            field_err(json!({"image": "a", "image_pull_secret": "x".repeat(129)})),
            is(InvalidField, "image_pull_secret")
        );
        assert_eq!(
            field_err(json!({"snapshot": ""})),
            is(InvalidField, "snapshot")
        );
        assert_eq!(
            field_err(json!({"template": 1})),
            is(InvalidField, "template")
        );
        let r = ok(with(json!({"snapshot": "snap-0123456789abcdef"})));
        assert_eq!(r.snapshot.as_deref(), Some("snap-0123456789abcdef"));
        let r = ok(with(json!({"template": "base"})));
        assert_eq!(r.template.as_deref(), Some("base"));
    }

    #[test]
    fn ambiguous_source() {
        assert_eq!(
            field_err(json!({"image": "a", "snapshot": "s"})),
            is(AmbiguousSource, "snapshot")
        );
        assert_eq!(
            field_err(json!({"image": "a", "template": "t"})),
            is(AmbiguousSource, "template")
        );
        assert_eq!(
            field_err(json!({"snapshot": "s", "template": "t"})),
            is(AmbiguousSource, "template")
        );
        // Cross-field checks come after every field's own.
        assert_eq!(
            field_err(json!({"image": "a", "snapshot": "s", "cwd": "rel"})),
            is(InvalidField, "cwd")
        );
        // null is not given.
        ok(with(json!({"image": "a", "snapshot": null})));
    }

    #[test]
    fn image_pull_secret_needs_image() {
        assert_eq!(
            field_err(json!({"image_pull_secret": "creds"})),
            is(InvalidField, "image_pull_secret")
        );
        assert_eq!(
            field_err(json!({"snapshot": "s", "image_pull_secret": "creds"})),
            is(InvalidField, "image_pull_secret")
        );
        ok(with(json!({"image": "a", "image_pull_secret": "creds"})));
    }

    #[test]
    fn invalid_start() {
        assert_eq!(
            field_err(json!({"ready": {"tcp": {"port": 80}}})),
            is(InvalidStart, "ready")
        );
        assert_eq!(
            field_err(json!({"start": false, "ready": {"tcp": {"port": 80}}})),
            is(InvalidStart, "ready")
        );
        assert_eq!(
            field_err(json!({"start": false, "start_command": "x"})),
            is(InvalidStart, "start_command")
        );
        assert_eq!(
            field_err(json!({"init": "systemd", "start": true})),
            is(InvalidStart, "start")
        );
        assert_eq!(
            field_err(json!({"init": "systemd", "start_command": "x"})),
            is(InvalidStart, "start_command")
        );
        assert_eq!(
            field_err(json!({"snapshot": "s", "start": false})),
            is(InvalidStart, "start")
        );
        assert_eq!(
            field_err(json!({"template": "t", "runtime": {}})),
            is(InvalidStart, "runtime")
        );
        assert_eq!(
            field_err(json!({"snapshot": "s", "init": "systemd"})),
            is(InvalidStart, "init")
        );
        // ambiguous_source is checked first.
        assert_eq!(
            field_err(json!({"image": "a", "snapshot": "s", "ready": {"command": "x"}})),
            is(AmbiguousSource, "snapshot")
        );
        ok(with(
            json!({"start": true, "start_command": "x", "ready": {"command": "true"}}),
        ));
        ok(with(json!({"start": false})));
        ok(with(json!({"init": "systemd", "image": "debian"})));
    }

    #[test]
    fn limits() {
        let lim = |l: Value| field_err(json!({ "limits": l }));
        assert_eq!(lim(json!(2)), is(InvalidField, "limits"));
        assert_eq!(
            lim(json!({"disk_bytes": 1073741824u64})),
            is(InvalidField, "limits.disk_bytes")
        );
        assert_eq!(lim(json!({"vcpus": 0})), is(InvalidField, "limits.vcpus"));
        assert_eq!(lim(json!({"vcpus": 33})), is(InvalidField, "limits.vcpus"));
        assert_eq!(lim(json!({"vcpus": 1.5})), is(InvalidField, "limits.vcpus"));
        assert_eq!(lim(json!({"vcpus": "2"})), is(InvalidField, "limits.vcpus"));
        assert_eq!(
            lim(json!({"memory_bytes": 134217728u64 - 2097152})),
            is(InvalidField, "limits.memory_bytes")
        );
        assert_eq!(
            lim(json!({"memory_bytes": 285u64 << 20})),
            is(InvalidField, "limits.memory_bytes")
        );
        assert_eq!(
            lim(json!({"memory_bytes": (256u64 << 20) + 1})),
            is(InvalidField, "limits.memory_bytes")
        );
        assert_eq!(
            lim(json!({"memory_bytes": -1})),
            is(InvalidField, "limits.memory_bytes")
        );
        let r = ok(with(
            json!({"limits": {"vcpus": 32, "memory_bytes": 134217728u64}}),
        ));
        assert_eq!(
            r.limits,
            Limits {
                vcpus: Some(32),
                memory_bytes: Some(128 << 20)
            }
        );
        let r = ok(with(
            json!({"limits": {"vcpus": null, "memory_bytes": 286u64 << 20}}),
        ));
        assert_eq!(r.limits.vcpus, None);
        assert_eq!(r.limits.memory_bytes, Some(286 << 20));
    }

    #[test]
    fn names() {
        assert_eq!(field_err(json!({"name": "Web"})), is(InvalidName, "name"));
        assert_eq!(field_err(json!({"name": ""})), is(InvalidName, "name"));
        assert_eq!(field_err(json!({"name": "-a"})), is(InvalidName, "name"));
        assert_eq!(field_err(json!({"name": "a-"})), is(InvalidName, "name"));
        assert_eq!(
            field_err(json!({"name": "a".repeat(64)})),
            is(InvalidName, "name")
        );
        for p in RESERVED_NAME_PREFIXES {
            assert_eq!(
                field_err(json!({"name": format!("{p}web")})),
                is(InvalidName, "name")
            );
        }
        assert_eq!(field_err(json!({"name": 1})), is(InvalidField, "name"));
        assert_eq!(
            ok(with(json!({"name": "snapshot-1"}))).name.as_deref(),
            Some("snapshot-1")
        );
    }

    #[test]
    fn env_rules() {
        let env = |e: Value| field_err(json!({ "env": e }));
        assert_eq!(env(json!({"": "x"})), is(InvalidEnv, "env."));
        assert_eq!(env(json!({"A=B": "x"})), is(InvalidEnv, "env.A=B"));
        assert_eq!(env(json!({"A\u{0}": "x"})), is(InvalidEnv, "env.A\u{0}"));
        assert_eq!(env(json!({"FOO": "a\u{0}b"})), is(InvalidEnv, "env.FOO"));
        assert_eq!(env(json!({"FOO": 1})), is(InvalidEnv, "env.FOO"));
        assert_eq!(env(json!({"FOO": null})), is(InvalidEnv, "env.FOO"));
        assert_eq!(env(json!(["FOO=1"])), is(InvalidField, "env"));
        let r = ok(with(json!({"env": {"B": "2", "A": "1"}})));
        let keys: Vec<&str> = r.env.keys().map(String::as_str).collect();
        assert_eq!(keys, ["A", "B"]);
    }

    #[test]
    fn secret_env_rules() {
        assert_eq!(
            field_err(json!({"env": {"TOKEN": "a"}, "secret_env": {"TOKEN": "b"}})),
            is(InvalidField, "secret_env.TOKEN")
        );
        assert_eq!(
            field_err(json!({"secret_env": {"A=B": "x"}})),
            is(InvalidEnv, "secret_env.A=B")
        );
        assert_eq!(
            field_err(json!({"secret_env": {"A": 1}})),
            is(InvalidEnv, "secret_env.A")
        );
        assert_eq!(
            field_err(json!({"secret_env": "x"})),
            is(InvalidField, "secret_env")
        );
        let e = parse_run_request(
            with(json!({"env": {"K": "a"}, "secret_env": {"K": "topsecret"}}))
                .to_string()
                .as_bytes(),
        )
        .unwrap_err();
        assert!(!e.message.contains("topsecret"));
        let r = ok(with(json!({"env": {"A": "1"}, "secret_env": {"B": "2"}})));
        assert_eq!(r.secret_env.0.get("B").map(String::as_str), Some("2"));
    }

    #[test]
    fn metadata_rules() {
        let md = |m: Value| field_err(json!({ "metadata": m }));
        let mut many = serde_json::Map::new();
        for i in 0..65 {
            many.insert(format!("k{i}"), json!("v"));
        }
        assert_eq!(
            md(Value::Object(many.clone())),
            is(InvalidMetadata, "metadata")
        );
        many.remove("k0");
        assert_eq!(ok(with(json!({ "metadata": many }))).metadata.len(), 64);
        assert_eq!(md(json!({"": "v"})), is(InvalidMetadata, "metadata."));
        let long_key = "k".repeat(65);
        assert_eq!(
            md(json!({ long_key.clone(): "v" })),
            is(InvalidMetadata, &format!("metadata.{long_key}"))
        );
        ok(with(
            json!({"metadata": { "k".repeat(64): "v".repeat(1024) }}),
        ));
        ok(with(
            json!({"metadata": { "é".repeat(64): "é".repeat(1024) }}),
        ));
        assert_eq!(
            md(json!({"k": "v".repeat(1025)})),
            is(InvalidMetadata, "metadata.k")
        );
        assert_eq!(md(json!({"k": 1})), is(InvalidMetadata, "metadata.k"));
        assert_eq!(md(json!({"k": null})), is(InvalidMetadata, "metadata.k"));
        assert_eq!(md(json!("k=v")), is(InvalidField, "metadata"));
    }

    #[test]
    fn volumes() {
        let vols = |v: Value| field_err(json!({ "volumes": v }));
        assert_eq!(vols(json!({})), is(InvalidField, "volumes"));
        assert_eq!(vols(json!(["v"])), is(InvalidField, "volumes[0]"));
        for bad in ["data", "/", "//", "/./", "/a/../b", "", "/a\u{0}"] {
            assert_eq!(
                vols(json!([{"path": bad, "volume": "v"}])),
                is(InvalidPath, "volumes[0].path"),
                "{bad:?}"
            );
        }
        assert_eq!(
            vols(json!([{"path": "/a", "volume": "v"}, {"path": "rel", "volume": "w"}])),
            is(InvalidPath, "volumes[1].path")
        );
        assert_eq!(
            vols(json!([{"volume": "v"}])),
            is(InvalidField, "volumes[0].path")
        );
        assert_eq!(
            vols(json!([{"path": 1, "volume": "v"}])),
            is(InvalidField, "volumes[0].path")
        );
        assert_eq!(
            vols(json!([{"path": "/a"}])),
            is(InvalidField, "volumes[0].volume")
        );
        assert_eq!(
            vols(json!([{"path": "/a", "volume": ""}])),
            is(InvalidField, "volumes[0].volume")
        );
        assert_eq!(
            vols(json!([{"path": "/a", "volume": "v", "read_only": "yes"}])),
            is(InvalidField, "volumes[0].read_only")
        );
        assert_eq!(
            vols(json!([{"path": "/a", "volume": "v", "copy": 1}])),
            is(InvalidField, "volumes[0].copy")
        );
        assert_eq!(
            vols(json!([{"path": "/a", "volume": "v", "version": "x"}])),
            is(InvalidField, "volumes[0].version")
        );
        let r = ok(with(json!({"volumes": [
            {"path": "/data/", "volume": "db", "copy": true, "version": {"name": "x"}}
        ]})));
        assert_eq!(
            r.volumes,
            vec![VolumeMount {
                path: "/data/".into(),
                volume: "db".into(),
                read_only: false,
                copy: true,
                version: Some(json!({"name": "x"})),
            }]
        );
    }

    #[test]
    fn ports() {
        assert_eq!(
            field_err(json!({"public_ports": [80, 0]})),
            is(InvalidField, "public_ports[1]")
        );
        assert_eq!(
            field_err(json!({"public_ports": [65536]})),
            is(InvalidField, "public_ports[0]")
        );
        assert_eq!(
            field_err(json!({"public_ports": 80})),
            is(InvalidField, "public_ports")
        );
        assert_eq!(
            field_err(json!({"public_ports_except": ["80"]})),
            is(InvalidField, "public_ports_except[0]")
        );
        assert_eq!(
            ok(with(json!({"public_ports_except": [49983, 49983]}))).public_ports_except,
            Some(vec![49983])
        );
        assert_eq!(
            field_err(json!({"inbound": {}})),
            is(InvalidField, "inbound")
        );
    }

    #[test]
    fn sleep_and_expiry_fields() {
        let f = |k: &str, v: Value| {
            let mut m = serde_json::Map::new();
            m.insert(k.to_owned(), v);
            field_err(Value::Object(m))
        };
        assert_eq!(
            f("sleep_after_seconds", json!(0.5)),
            is(InvalidField, "sleep_after_seconds")
        );
        assert_eq!(
            f("sleep_after_seconds", json!(1e9 + 1.0)),
            is(InvalidField, "sleep_after_seconds")
        );
        assert_eq!(
            f("sleep_after_seconds", json!("30")),
            is(InvalidField, "sleep_after_seconds")
        );
        assert_eq!(
            ok(with(json!({"sleep_after_seconds": 1.5}))).sleep_after_seconds,
            Some(Some(1.5))
        );
        for bad in [json!("tomorrow"), json!("2030-01-01"), json!(1_900_000_000)] {
            assert_eq!(f("expires_at", bad), is(InvalidField, "expires_at"));
        }
        // A time in the past is the node's to refuse (expires_in_the_past).
        assert_eq!(
            ok(with(json!({"expires_at": "2000-01-01T00:00:00.5+01:00"})))
                .expires_at
                .as_deref(),
            Some("2000-01-01T00:00:00.5+01:00")
        );
        assert_eq!(
            f("sleep_notice_ms", json!(60_001)),
            is(InvalidField, "sleep_notice_ms")
        );
        assert_eq!(
            f("sleep_notice_ms", json!(-1)),
            is(InvalidField, "sleep_notice_ms")
        );
        assert_eq!(
            f("sleep_hold_max_ms", json!(900_001)),
            is(InvalidField, "sleep_hold_max_ms")
        );
        assert_eq!(
            f("suspend_after_ms", json!(999)),
            is(InvalidField, "suspend_after_ms")
        );
        assert_eq!(
            f("suspend_after_ms", json!(86_400_001)),
            is(InvalidField, "suspend_after_ms")
        );
        assert_eq!(
            f("delete_after_idle_ms", json!(999)),
            is(InvalidField, "delete_after_idle_ms")
        );
        for bad in ["24:00", "9:00", "12:60", "12:5", "12-00", "1200"] {
            assert_eq!(
                f("wake_daily_at", json!(bad)),
                is(InvalidField, "wake_daily_at"),
                "{bad}"
            );
        }
        for good in ["00:00", "19:59", "23:59", "20:30"] {
            ok(with(json!({ "wake_daily_at": good })));
        }
        assert_eq!(f("checkpoint", json!(true)), is(InvalidField, "checkpoint"));
    }

    #[test]
    fn hostnames() {
        for bad in ["", "-a", "a-", "A", "a..b", ".a", "a.", "a_b"] {
            assert_eq!(
                field_err(json!({ "hostname": bad })),
                is(InvalidField, "hostname"),
                "{bad:?}"
            );
        }
        assert_eq!(
            field_err(json!({"hostname": "a".repeat(64)})),
            is(InvalidField, "hostname")
        );
        for good in ["a", "web-1", "a.b-c.d", &"a".repeat(63)] {
            ok(with(json!({ "hostname": good })));
        }
    }

    #[test]
    fn stop_rules() {
        let stop = |s: Value| field_err(json!({ "stop": s }));
        assert_eq!(stop(json!("TERM")), is(InvalidField, "stop"));
        assert_eq!(
            stop(json!({"signal": "SIGCHLD"})),
            is(InvalidField, "stop.signal")
        );
        assert_eq!(
            stop(json!({"signal": "NOPE"})),
            is(InvalidField, "stop.signal")
        );
        assert_eq!(
            stop(json!({"signal": "sigterm"})),
            is(InvalidField, "stop.signal")
        );
        assert_eq!(stop(json!({"signal": 15})), is(InvalidField, "stop.signal"));
        assert_eq!(
            stop(json!({"grace_ms": 600_001})),
            is(InvalidField, "stop.grace_ms")
        );
        assert_eq!(
            stop(json!({"grace_ms": -1})),
            is(InvalidField, "stop.grace_ms")
        );
        for name in STOP_SIGNALS {
            let r = ok(with(json!({"stop": {"signal": name}})));
            assert_eq!(r.stop.and_then(|s| s.signal).as_deref(), Some(name));
            let r = ok(with(json!({"stop": {"signal": &name[3..]}})));
            assert_eq!(r.stop.and_then(|s| s.signal).as_deref(), Some(name));
        }
        let s = ok(with(json!({"stop": {"signal": null}}))).stop;
        assert_eq!(s, Some(Stop::default()));
        assert_eq!(Stop::default().grace_ms_or_default(), 10_000);
        assert_eq!(Stop::default().signal_number(), None);
    }

    #[test]
    fn cwd_and_user() {
        assert_eq!(field_err(json!({"cwd": "srv"})), is(InvalidField, "cwd"));
        assert_eq!(field_err(json!({"cwd": ""})), is(InvalidField, "cwd"));
        assert_eq!(field_err(json!({"cwd": 1})), is(InvalidField, "cwd"));
        assert_eq!(ok(with(json!({"cwd": "/"}))).cwd.as_deref(), Some("/"));
        assert_eq!(field_err(json!({"user": ""})), is(InvalidField, "user"));
        assert_eq!(
            field_err(json!({"user": "u".repeat(65)})),
            is(InvalidField, "user")
        );
        assert_eq!(field_err(json!({"user": 0})), is(InvalidField, "user"));
        ok(with(json!({"user": "u".repeat(64)})));
        ok(with(json!({"user": "root"})));
    }

    #[test]
    fn timeouts() {
        for bad in [
            json!(0),
            json!(-1),
            json!(1e9 + 1.0),
            json!("300"),
            json!(true),
        ] {
            assert_eq!(
                field_err(json!({ "timeout_seconds": bad })),
                is(InvalidField, "timeout_seconds")
            );
        }
        assert_eq!(
            ok(with(json!({"timeout_seconds": 1e9}))).timeout_seconds,
            1e9
        );
        assert_eq!(ok(with(json!({"timeout_seconds": 5}))).timeout_seconds, 5.0);
        assert_eq!(
            ok(with(json!({"timeout_seconds": 0.001}))).timeout_seconds,
            0.001
        );
    }

    #[test]
    fn stdin_and_encoding() {
        let r = ok(with(json!({"stdin": "héllo\n"})));
        assert_eq!(r.stdin, Some("héllo\n".as_bytes().to_vec()));
        assert_eq!(r.encoding, Encoding::Utf8);
        let r = ok(with(json!({"stdin": "AAEC/w==", "encoding": "base64"})));
        assert_eq!(r.stdin, Some(vec![0, 1, 2, 255]));
        let r = ok(with(json!({"stdin": "AAEC/w", "encoding": "base64"})));
        assert_eq!(r.stdin, Some(vec![0, 1, 2, 255]));
        let r = ok(with(json!({"stdin": "", "encoding": "base64"})));
        assert_eq!(r.stdin, Some(vec![]));
        for bad in ["!!!", "AAEC/w=", "a", "aGk= ", "aGk=\n"] {
            assert_eq!(
                field_err(json!({"stdin": bad, "encoding": "base64"})),
                is(InvalidField, "stdin"),
                "{bad:?}"
            );
        }
        assert_eq!(field_err(json!({"stdin": 1})), is(InvalidField, "stdin"));
        assert_eq!(
            field_err(json!({"encoding": "hex"})),
            is(InvalidField, "encoding")
        );
        assert_eq!(
            field_err(json!({"encoding": "UTF8"})),
            is(InvalidField, "encoding")
        );
        assert_eq!(ok(with(json!({"encoding": "base64"}))).stdin, None);
    }

    #[test]
    fn encoding_helpers() {
        assert_eq!(Encoding::Base64.encode(&[0, 1, 2, 255]), "AAEC/w==");
        assert_eq!(Encoding::Utf8.encode(b"a\xffb"), "a\u{fffd}b");
        assert_eq!(Encoding::Utf8.decode("x"), Some(b"x".to_vec()));
        assert_eq!(Encoding::Base64.decode("x"), None);
        assert_eq!(Encoding::Base64.as_str(), "base64");
        assert_eq!(Encoding::Utf8.as_str(), "utf8");
        assert_eq!(serde_json::to_value(Encoding::Utf8).unwrap(), json!("utf8"));
        assert_eq!(
            serde_json::from_value::<Encoding>(json!("base64")).unwrap(),
            Encoding::Base64
        );
    }

    #[test]
    fn regions() {
        assert_eq!(ok(with(json!({"region": "na"}))).region, Some(Region::Na));
        assert_eq!(ok(with(json!({"region": "ap"}))).region, Some(Region::Ap));
        assert_eq!(ok(with(json!({"region": null}))).region, None);
        assert_eq!(
            field_err(json!({"region": "us"})),
            is(UnknownRegion, "region")
        );
        assert_eq!(field_err(json!({"region": 1})), is(InvalidField, "region"));
    }

    #[test]
    fn checks_run_in_spec_order() {
        // Several bad fields: the first in the spec's order is the answer.
        assert_eq!(
            field_err(json!({"region": "xx", "timeout_seconds": 0, "name": "BAD", "tmp": "x"})),
            is(InvalidField, "tmp")
        );
        assert_eq!(
            field_err(json!({"region": "xx", "timeout_seconds": 0, "name": "BAD"})),
            is(InvalidName, "name")
        );
        assert_eq!(
            field_err(json!({"region": "xx", "timeout_seconds": 0})),
            is(InvalidField, "timeout_seconds")
        );
        assert_eq!(
            err(json!({"command": "", "name": "BAD"})),
            is(InvalidField, "command")
        );
        assert_eq!(err(json!({"name": "BAD"})), is(MissingCommand, "command"));
    }

    #[test]
    fn idempotency_keys() {
        assert!(validate_idempotency_key("a").is_ok());
        assert!(validate_idempotency_key(&"k".repeat(255)).is_ok());
        assert!(validate_idempotency_key(&"é".repeat(255)).is_ok());
        for bad in [String::new(), "k".repeat(256)] {
            let e = validate_idempotency_key(&bad).unwrap_err();
            assert_eq!(e.code, InvalidIdempotencyKey);
            assert_eq!(e.param.as_deref(), Some("Idempotency-Key"));
            assert_eq!(e.status(), 400);
        }
    }

    #[test]
    fn parse_run_value_takes_a_value() {
        let r = parse_run_value(&json!({"command": ["true"]}));
        assert!(r.is_ok());
        assert_eq!(parse_run_value(&json!([1])).unwrap_err().code, InvalidJson);
    }
}
