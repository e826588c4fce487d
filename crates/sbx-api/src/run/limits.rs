//! The bounds of a `POST /v1/run` body (sizes, ranges, defaults, the stop signals), and the
//! checks of a command's sizes and of a user's ids.

use crate::error::{ApiError, ErrorCode};

use super::json::invalid;
use super::types::Command;

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
///
/// `s * 1000.0` of a decimal fraction is sometimes a hair above the whole number it means
/// (2.007 * 1000.0 = 2007.0000000000002): a product within a few units in the last place of a
/// whole number is that number, not the next one up. So [`ms_to_seconds`] of any whole number
/// of milliseconds comes back here as the same number (a client writes its deadlines so).
pub fn seconds_to_ms(s: f64) -> u64 {
    let x = s * 1000.0;
    let whole = x.round();
    let ms = if (x - whole).abs() <= whole.abs() * 4.0 * f64::EPSILON {
        whole
    } else {
        x.ceil()
    };
    (ms as u64).max(1)
}

/// Whole milliseconds as the seconds of a `timeout_seconds` (or `wait_seconds`): the number a
/// request carries, which [`seconds_to_ms`] reads back as `ms`.
pub fn ms_to_seconds(ms: u64) -> f64 {
    ms as f64 / 1000.0
}

/// A `timeout_seconds` of a run as its deadline: 0.001 to 1e9 seconds, else 400 invalid_field
/// (param `timeout_seconds`), the answer the node gives to the same number in a body.
pub fn run_timeout(seconds: f64) -> Result<std::time::Duration, ApiError> {
    if (MIN_TIMEOUT_SECONDS..=MAX_SECONDS).contains(&seconds) {
        Ok(std::time::Duration::from_millis(seconds_to_ms(seconds)))
    } else {
        Err(invalid("timeout_seconds", RUN_TIMEOUT_RANGE))
    }
}

/// The message of a run's `timeout_seconds` out of its range.
pub(crate) const RUN_TIMEOUT_RANGE: &str =
    "timeout_seconds must be a number from 0.001 (1 ms) to 1000000000";

/// The most bytes of the command, env (and secret_env) and cwd of one request together. The
/// sandbox's agent takes them in one message of at most 4 MiB (sbx-proto `MAX_FRAME`): this much stays under it even
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
