//! The exec object (a command's result, as `POST /v1/run` answers with it), signal names,
//! and RFC 3339 time stamps.

use serde::{Deserialize, Serialize};

pub use crate::run::Encoding;

/// The value of an exec object's `object` field: always `"exec"`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ExecObjectKind {
    /// `"exec"`.
    #[default]
    #[serde(rename = "exec")]
    Exec,
}

/// Where a command stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecStatus {
    /// It ended by itself, with any exit code.
    Exited,
    /// timeout_seconds was up.
    TimedOut,
    /// A signal ended it.
    Killed,
    /// It has not ended.
    Running,
}

impl ExecStatus {
    /// The status as it is written on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            ExecStatus::Exited => "exited",
            ExecStatus::TimedOut => "timed_out",
            ExecStatus::Killed => "killed",
            ExecStatus::Running => "running",
        }
    }

    /// Whether the command has ended.
    pub fn is_done(self) -> bool {
        self != ExecStatus::Running
    }
}

/// What a command used (null while it runs).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExecUsage {
    /// User and system CPU time of the command and the children it waited for.
    pub cpu_seconds: f64,
    /// The largest resident set of any of them.
    pub max_memory_bytes: u64,
}

/// How much the command has written and which part of it can still be read. Positions count
/// the bytes of both streams together, in the order they were written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputInfo {
    /// Bytes written to stdout so far.
    pub stdout_bytes: u64,
    /// Bytes written to stderr so far.
    pub stderr_bytes: u64,
    /// The position of the oldest byte still kept.
    pub start: u64,
    /// The position after the newest byte.
    pub end: u64,
}

/// A command and its result: the 200 answer of `POST /v1/run` (and of `GET …/exec/{id}`).
/// Every field is always written; the `Option`s are written as null.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExecObject {
    /// `exe-` and 16 characters.
    pub id: String,
    /// Always `"exec"`.
    pub object: ExecObjectKind,
    /// `sbx-` and 16 characters.
    pub sandbox_id: String,
    /// The command as text, at most 1024 characters ([`crate::run::Command::display`]).
    pub command: String,
    /// Whether it runs on a terminal.
    pub tty: bool,
    /// Where it stands.
    pub status: ExecStatus,
    /// Null while running; 128 plus the signal's number when a signal ended it.
    pub exit_code: Option<i32>,
    /// The signal that ended it (`SIGTERM`, `SIG<n>`, see [`signal_name`]); null otherwise.
    pub signal: Option<String>,
    /// RFC 3339, UTC, with milliseconds ([`format_rfc3339_millis`]).
    pub started_at: String,
    /// Its process id in the sandbox.
    pub pid: u32,
    /// Wall time from start to end; null while running.
    pub duration_seconds: Option<f64>,
    /// Null while running.
    pub usage: Option<ExecUsage>,
    /// How much it wrote, and what is still kept.
    pub output: OutputInfo,
    /// The last 1 MiB of stdout: text (bytes that are not UTF-8 replaced), or base64.
    pub stdout: String,
    /// The last 1 MiB of stderr.
    pub stderr: String,
    /// Either stream was longer than 1 MiB, or part of the output is no longer kept.
    pub truncated: bool,
    /// How stdout and stderr are written: as the request asked.
    pub encoding: Encoding,
}

/// Why the node refused a command, or a call on one: a typed detail of an [`ApiError`]
/// ([`ApiError::exec_failure`]) beside its code, for a front end that says each its own way
/// (E2B's envd) without reading the message. Not in the error body: the HTTP API says it with
/// the code, and there a command that could not be executed is no error (it ends with 126 or
/// 127; see `Node::exec_must_start` for the call that refuses it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecFailKind {
    /// The working directory does not exist.
    CwdMissing,
    /// The working directory is not a directory.
    CwdNotDirectory,
    /// The program is not found (along PATH, or its file or interpreter is missing).
    NotFound,
    /// The program may not be executed (no execute permission, a directory, a noexec mount).
    Permission,
    /// The program is not a format the kernel runs.
    NotExecutable,
    /// `user` is not a user of the sandbox.
    NoSuchUser,
    /// The sandbox runs as many commands at once as it may.
    TooMany,
    /// The command has ended (a call that needs it running: stdin, a signal, a resize).
    Ended,
    /// It could not be executed for another reason (or the sandbox's agent, older than the
    /// node, does not say why).
    Other,
}

impl ExecFailKind {
    /// The kind as its snake_case name.
    pub fn as_str(self) -> &'static str {
        match self {
            ExecFailKind::CwdMissing => "cwd_missing",
            ExecFailKind::CwdNotDirectory => "cwd_not_directory",
            ExecFailKind::NotFound => "not_found",
            ExecFailKind::Permission => "permission",
            ExecFailKind::NotExecutable => "not_executable",
            ExecFailKind::NoSuchUser => "no_such_user",
            ExecFailKind::TooMany => "too_many",
            ExecFailKind::Ended => "ended",
            ExecFailKind::Other => "other",
        }
    }
}

/// How much of each stream the exec object carries: the last 1 MiB.
pub const EXEC_OUTPUT_TAIL_BYTES: usize = 1 << 20;

/// Linux's signal numbers (x86_64 and aarch64 share them) and names.
const SIGNALS: [(i32, &str); 31] = [
    (1, "SIGHUP"),
    (2, "SIGINT"),
    (3, "SIGQUIT"),
    (4, "SIGILL"),
    (5, "SIGTRAP"),
    (6, "SIGABRT"),
    (7, "SIGBUS"),
    (8, "SIGFPE"),
    (9, "SIGKILL"),
    (10, "SIGUSR1"),
    (11, "SIGSEGV"),
    (12, "SIGUSR2"),
    (13, "SIGPIPE"),
    (14, "SIGALRM"),
    (15, "SIGTERM"),
    (16, "SIGSTKFLT"),
    (17, "SIGCHLD"),
    (18, "SIGCONT"),
    (19, "SIGSTOP"),
    (20, "SIGTSTP"),
    (21, "SIGTTIN"),
    (22, "SIGTTOU"),
    (23, "SIGURG"),
    (24, "SIGXCPU"),
    (25, "SIGXFSZ"),
    (26, "SIGVTALRM"),
    (27, "SIGPROF"),
    (28, "SIGWINCH"),
    (29, "SIGIO"),
    (30, "SIGPWR"),
    (31, "SIGSYS"),
];

/// Other names of some signals, accepted by [`signal_number`].
const SIGNAL_ALIASES: [(i32, &str); 3] = [(6, "SIGIOT"), (17, "SIGCLD"), (29, "SIGPOLL")];

/// Highest signal number (`SIGRTMAX` on Linux).
pub const MAX_SIGNAL: i32 = 64;

/// The name of signal `n` (`SIGTERM` for 15), or `SIG<n>` for one without a name (the real-time
/// signals, and numbers that are none).
pub fn signal_name(n: i32) -> String {
    SIGNALS
        .iter()
        .find(|(num, _)| *num == n)
        .map(|(_, name)| (*name).to_owned())
        .unwrap_or_else(|| format!("SIG{n}"))
}

/// SIGTERM's number (Linux, every architecture): the default signal of a stop or of
/// `POST …/exec/{exec_id}/signal`. Written out because this crate is pure data, without libc.
pub const SIGTERM: i32 = 15;

/// The `signal` field of `POST …/exec/{exec_id}/signal`: absent is SIGTERM; a name as
/// [`signal_number`] takes it, or a whole number from 1 to [`MAX_SIGNAL`]. Anything else (null,
/// a fraction, a list, 0, an unknown name) is 400 invalid_field: a call that cannot say which
/// signal it means sends none.
pub fn signal_field(v: Option<&serde_json::Value>) -> Result<i32, crate::ApiError> {
    use serde_json::Value;
    let bad = |what: String| {
        crate::ApiError::invalid_field(
            "signal",
            format!("{what}: signal takes a name such as SIGTERM or SIGKILL, or a number from 1 to {MAX_SIGNAL}"),
        )
    };
    match v {
        None => Ok(SIGTERM),
        Some(Value::String(name)) => {
            signal_number(name).ok_or_else(|| bad(format!("{name} is not a signal")))
        }
        Some(Value::Number(n)) => n
            .as_u64()
            .filter(|n| (1..=MAX_SIGNAL as u64).contains(n))
            .map(|n| n as i32)
            .ok_or_else(|| bad(format!("{n} is not a signal number"))),
        Some(Value::Null) => Err(bad("signal is null".to_string())),
        Some(_) => Err(bad("signal is not a name or a number".to_string())),
    }
}

/// The number of a signal by its name, with `SIG` or without (`SIGTERM`, `TERM`), upper case
/// as the spec writes them; also `SIG<n>` for 1 to 64, as [`signal_name`] writes it.
pub fn signal_number(name: &str) -> Option<i32> {
    let bare = name.strip_prefix("SIG").unwrap_or(name);
    if bare.is_empty() {
        return None;
    }
    let by_name = SIGNALS
        .iter()
        .chain(SIGNAL_ALIASES.iter())
        .find(|(_, n)| &n[3..] == bare)
        .map(|(num, _)| *num);
    if by_name.is_some() {
        return by_name;
    }
    if name.starts_with("SIG") && bare.bytes().all(|b| b.is_ascii_digit()) && !bare.starts_with('0')
    {
        return bare
            .parse::<i32>()
            .ok()
            .filter(|n| (1..=MAX_SIGNAL).contains(n));
    }
    None
}

const NANOS_PER_SEC: i128 = 1_000_000_000;
const NANOS_PER_DAY: i128 = 86_400 * NANOS_PER_SEC;
/// 0000-01-01T00:00:00Z, in days since 1970-01-01.
const MIN_DAY: i64 = -719_528;
/// 10000-01-01T00:00:00Z, in days since 1970-01-01.
const END_DAY: i64 = 2_932_897;

/// Days since 1970-01-01 of a date of the proleptic Gregorian calendar (Howard Hinnant's
/// `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400); // [0, 399]
    let mp = (month + 9) % 12; // March is 0
    let doy = (153 * mp + 2) / 5 + day - 1; // [0, 365]
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy; // [0, 146096]
    era * 146_097 + doe - 719_468
}

/// The date of a day since 1970-01-01 (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // [0, 146096]
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // [0, 399]
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // [0, 365]
    let mp = (5 * doy + 2) / 153; // [0, 11]
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn is_leap(year: i64) -> bool {
    year % 4 == 0 && (year % 100 != 0 || year % 400 == 0)
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if is_leap(year) => 29,
        2 => 28,
        _ => 0,
    }
}

/// A time as RFC 3339 in UTC with milliseconds: `2026-11-29T10:59:36.123Z`. Truncates to the
/// millisecond (toward the past, also before 1970). Times outside the years 0000 to 9999 are
/// clamped to them.
pub fn format_rfc3339_millis(unix_nanos: i128) -> String {
    let min = i128::from(MIN_DAY) * NANOS_PER_DAY;
    let max = i128::from(END_DAY) * NANOS_PER_DAY - 1;
    let t = unix_nanos.clamp(min, max);
    let day = i64::try_from(t.div_euclid(NANOS_PER_DAY)).unwrap_or(0);
    let nanos_of_day = t.rem_euclid(NANOS_PER_DAY);
    let secs_of_day = nanos_of_day / NANOS_PER_SEC;
    let millis = (nanos_of_day % NANOS_PER_SEC) / 1_000_000;
    let (year, month, d) = civil_from_days(day);
    format!(
        "{year:04}-{month:02}-{d:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        secs_of_day / 3600,
        secs_of_day / 60 % 60,
        secs_of_day % 60
    )
}

/// Parses an RFC 3339 date-time (`2026-11-29T10:59:36Z`, `2026-11-29t10:59:36.5+02:00`, ...)
/// into nanoseconds since the Unix epoch. `None` for anything else, including dates that do
/// not exist (February 30th). A leap second (`:60`) counts as the second after `:59`.
pub fn parse_rfc3339(s: &str) -> Option<i128> {
    let b = s.as_bytes();
    let digits = |from: usize, len: usize| -> Option<i64> {
        let part = b.get(from..from + len)?;
        if !part.iter().all(u8::is_ascii_digit) {
            return None;
        }
        Some(
            part.iter()
                .fold(0i64, |acc, d| acc * 10 + i64::from(d - b'0')),
        )
    };
    let byte_is = |at: usize, allowed: &[u8]| b.get(at).is_some_and(|c| allowed.contains(c));
    let year = digits(0, 4)?;
    let month = digits(5, 2)?;
    let day = digits(8, 2)?;
    let hour = digits(11, 2)?;
    let minute = digits(14, 2)?;
    let second = digits(17, 2)?;
    if !(byte_is(4, b"-")
        && byte_is(7, b"-")
        && byte_is(10, b"Tt")
        && byte_is(13, b":")
        && byte_is(16, b":"))
    {
        return None;
    }
    if !(1..=12).contains(&month)
        || !(1..=days_in_month(year, month)).contains(&day)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return None;
    }
    let mut at = 19;
    let mut frac_nanos: i128 = 0;
    if byte_is(at, b".") {
        at += 1;
        let start = at;
        while b.get(at).is_some_and(u8::is_ascii_digit) {
            if at - start < 9 {
                frac_nanos = frac_nanos * 10 + i128::from(b[at] - b'0');
            }
            at += 1;
        }
        let n = at - start;
        if n == 0 {
            return None;
        }
        for _ in n..9 {
            frac_nanos *= 10;
        }
    }
    let offset_secs: i64 = match b.get(at) {
        Some(b'Z' | b'z') if at + 1 == b.len() => 0,
        Some(sign @ (b'+' | b'-')) if at + 6 == b.len() => {
            let oh = digits(at + 1, 2)?;
            let om = digits(at + 4, 2)?;
            if !byte_is(at + 3, b":") || oh > 23 || om > 59 {
                return None;
            }
            let off = oh * 3600 + om * 60;
            if *sign == b'-' {
                -off
            } else {
                off
            }
        }
        _ => return None,
    };
    let days = days_from_civil(year, month, day);
    let secs = days * 86_400 + hour * 3600 + minute * 60 + second - offset_secs;
    Some(i128::from(secs) * NANOS_PER_SEC + frac_nanos)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const MS: i128 = 1_000_000;
    const S: i128 = 1_000_000_000;

    #[test]
    fn formats_known_instants() {
        assert_eq!(format_rfc3339_millis(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(format_rfc3339_millis(1), "1970-01-01T00:00:00.000Z");
        assert_eq!(format_rfc3339_millis(999_999), "1970-01-01T00:00:00.000Z");
        assert_eq!(format_rfc3339_millis(MS), "1970-01-01T00:00:00.001Z");
        assert_eq!(
            format_rfc3339_millis(1_000_000_000 * S),
            "2001-09-09T01:46:40.000Z"
        );
        assert_eq!(
            format_rfc3339_millis(1_234_567_890 * S + 123 * MS),
            "2009-02-13T23:31:30.123Z"
        );
        assert_eq!(
            format_rfc3339_millis(1_709_164_800 * S),
            "2024-02-29T00:00:00.000Z"
        );
        assert_eq!(
            format_rfc3339_millis(951_782_400 * S),
            "2000-02-29T00:00:00.000Z"
        );
        assert_eq!(
            format_rfc3339_millis(1_795_949_976 * S + 123 * MS + 456_789),
            "2026-11-29T10:59:36.123Z"
        );
        assert_eq!(
            format_rfc3339_millis(4_102_444_799 * S + 999 * MS),
            "2099-12-31T23:59:59.999Z"
        );
    }

    #[test]
    fn formats_before_1970_toward_the_past() {
        assert_eq!(format_rfc3339_millis(-1), "1969-12-31T23:59:59.999Z");
        assert_eq!(format_rfc3339_millis(-S), "1969-12-31T23:59:59.000Z");
        assert_eq!(
            format_rfc3339_millis(-2_208_988_800 * S),
            "1900-01-01T00:00:00.000Z"
        );
    }

    #[test]
    fn clamps_outside_four_digit_years() {
        assert_eq!(format_rfc3339_millis(i128::MIN), "0000-01-01T00:00:00.000Z");
        assert_eq!(format_rfc3339_millis(i128::MAX), "9999-12-31T23:59:59.999Z");
    }

    #[test]
    fn civil_round_trips_every_day_of_four_centuries() {
        for day in -146_097..(146_097 * 2) {
            let (y, m, d) = civil_from_days(day);
            assert!((1..=12).contains(&m));
            assert!((1..=days_in_month(y, m)).contains(&d));
            assert_eq!(days_from_civil(y, m, d), day);
        }
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(0, 1, 1), MIN_DAY);
        assert_eq!(days_from_civil(10000, 1, 1), END_DAY);
    }

    #[test]
    fn parses_rfc3339() {
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(
            parse_rfc3339("2009-02-13T23:31:30.123Z"),
            Some(1_234_567_890 * S + 123 * MS)
        );
        assert_eq!(
            parse_rfc3339("2009-02-14T00:31:30.123+01:00"),
            Some(1_234_567_890 * S + 123 * MS)
        );
        assert_eq!(
            parse_rfc3339("2009-02-13t22:31:30-01:00"),
            Some(1_234_567_890 * S)
        );
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00.000000001z"), Some(1));
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00.5Z"), Some(500 * MS));
        assert_eq!(
            parse_rfc3339("1970-01-01T00:00:00.1234567891Z"),
            Some(123_456_789)
        );
        assert_eq!(
            parse_rfc3339("2024-02-29T00:00:00Z"),
            Some(1_709_164_800 * S)
        );
        assert_eq!(
            parse_rfc3339("2016-12-31T23:59:60Z"),
            Some(1_483_228_800 * S)
        );
        for s in ["2026-11-29T10:59:36.123Z", "1969-12-31T23:59:59.999Z"] {
            let t = parse_rfc3339(s);
            assert_eq!(t.map(format_rfc3339_millis).as_deref(), Some(s));
        }
    }

    #[test]
    fn rejects_what_is_not_rfc3339() {
        for s in [
            "",
            "2026-11-29",
            "2026-11-29T10:59:36",
            "2026-11-29 10:59:36Z",
            "2026-11-29T10:59Z",
            "2026-13-01T00:00:00Z",
            "2026-00-01T00:00:00Z",
            "2026-02-29T00:00:00Z",
            "2026-04-31T00:00:00Z",
            "2026-01-01T24:00:00Z",
            "2026-01-01T00:60:00Z",
            "2026-01-01T00:00:61Z",
            "2026-01-01T00:00:00.Z",
            "2026-01-01T00:00:00+0100",
            "2026-01-01T00:00:00+24:00",
            "2026-01-01T00:00:00Zjunk",
            "26-01-01T00:00:00Z",
            "2026/01/01T00:00:00Z",
            "+2026-01-01T00:00:00Z",
            "2026-01-01T00:00:00.1a2Z",
        ] {
            assert_eq!(parse_rfc3339(s), None, "{s}");
        }
    }

    #[test]
    fn signal_names() {
        assert_eq!(signal_name(15), "SIGTERM");
        assert_eq!(signal_name(9), "SIGKILL");
        assert_eq!(signal_name(2), "SIGINT");
        assert_eq!(signal_name(11), "SIGSEGV");
        assert_eq!(signal_name(28), "SIGWINCH");
        assert_eq!(signal_name(34), "SIG34");
        assert_eq!(signal_name(0), "SIG0");
        for (n, name) in SIGNALS {
            assert_eq!(signal_name(n), name);
            assert_eq!(signal_number(name), Some(n));
            assert_eq!(signal_number(&name[3..]), Some(n));
        }
    }

    #[test]
    fn signal_fields() {
        use serde_json::json;
        assert_eq!(signal_field(None).unwrap(), 15);
        assert_eq!(signal_field(Some(&json!("SIGKILL"))).unwrap(), 9);
        assert_eq!(signal_field(Some(&json!("INT"))).unwrap(), 2);
        assert_eq!(signal_field(Some(&json!(9))).unwrap(), 9);
        assert_eq!(signal_field(Some(&json!(64))).unwrap(), 64);
        for bad in [
            json!(null),
            json!(9.5),
            json!(0),
            json!(65),
            json!(-9),
            json!(["SIGKILL"]),
            json!({}),
            json!(true),
            json!("SIGBOGUS"),
            json!(""),
        ] {
            let e = signal_field(Some(&bad)).unwrap_err();
            assert_eq!(
                (e.code, e.param.as_deref()),
                (crate::ErrorCode::InvalidField, Some("signal")),
                "{bad}"
            );
        }
    }

    #[test]
    fn signal_numbers() {
        assert_eq!(signal_number("SIGTERM"), Some(15));
        assert_eq!(signal_number("TERM"), Some(15));
        assert_eq!(signal_number("KILL"), Some(9));
        assert_eq!(signal_number("SIGIOT"), Some(6));
        assert_eq!(signal_number("SIG34"), Some(34));
        assert_eq!(signal_number(&signal_name(64)), Some(64));
        assert_eq!(signal_number("SIG65"), None);
        assert_eq!(signal_number("SIG0"), None);
        assert_eq!(signal_number("SIG015"), None);
        assert_eq!(signal_number("15"), None);
        assert_eq!(signal_number("SIG"), None);
        assert_eq!(signal_number(""), None);
        assert_eq!(signal_number("sigterm"), None);
        assert_eq!(signal_number("SIGNOPE"), None);
    }

    fn sample() -> ExecObject {
        ExecObject {
            id: "exe-0123456789abcdef".into(),
            object: ExecObjectKind::Exec,
            sandbox_id: "sbx-0123456789abcdef".into(),
            command: "echo hi".into(),
            tty: false,
            status: ExecStatus::Exited,
            exit_code: Some(0),
            signal: None,
            started_at: "2026-11-29T10:59:36.123Z".into(),
            pid: 7,
            duration_seconds: Some(0.25),
            usage: Some(ExecUsage {
                cpu_seconds: 0.01,
                max_memory_bytes: 4096,
            }),
            output: OutputInfo {
                stdout_bytes: 3,
                stderr_bytes: 0,
                start: 0,
                end: 3,
            },
            stdout: "hi\n".into(),
            stderr: String::new(),
            truncated: false,
            encoding: Encoding::Utf8,
        }
    }

    #[test]
    fn exec_object_serializes_as_the_spec() {
        let v = serde_json::to_value(sample()).unwrap();
        assert_eq!(
            v,
            json!({
                "id": "exe-0123456789abcdef",
                "object": "exec",
                "sandbox_id": "sbx-0123456789abcdef",
                "command": "echo hi",
                "tty": false,
                "status": "exited",
                "exit_code": 0,
                "signal": null,
                "started_at": "2026-11-29T10:59:36.123Z",
                "pid": 7,
                "duration_seconds": 0.25,
                "usage": {"cpu_seconds": 0.01, "max_memory_bytes": 4096},
                "output": {"stdout_bytes": 3, "stderr_bytes": 0, "start": 0, "end": 3},
                "stdout": "hi\n",
                "stderr": "",
                "truncated": false,
                "encoding": "utf8",
            })
        );
        let back: ExecObject = serde_json::from_value(v).unwrap();
        assert_eq!(back, sample());
    }

    #[test]
    fn running_exec_has_nulls() {
        let mut e = sample();
        e.status = ExecStatus::Running;
        e.exit_code = None;
        e.duration_seconds = None;
        e.usage = None;
        e.encoding = Encoding::Base64;
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["status"], "running");
        assert_eq!(v["exit_code"], serde_json::Value::Null);
        assert_eq!(v["duration_seconds"], serde_json::Value::Null);
        assert_eq!(v["usage"], serde_json::Value::Null);
        assert_eq!(v["encoding"], "base64");
        assert_eq!(v.as_object().map(|o| o.len()), Some(17));
        assert!(!ExecStatus::Running.is_done());
        assert!(ExecStatus::Killed.is_done());
    }

    #[test]
    fn statuses_serialize_snake_case() {
        for s in [
            ExecStatus::Exited,
            ExecStatus::TimedOut,
            ExecStatus::Killed,
            ExecStatus::Running,
        ] {
            assert_eq!(serde_json::to_value(s).unwrap(), json!(s.as_str()));
        }
        assert!(serde_json::from_value::<ExecObjectKind>(json!("sandbox")).is_err());
    }
}
