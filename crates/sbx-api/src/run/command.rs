//! The parsers of the command fields: `command` and `start_command` (also an exec's
//! command), `ready` and `stop`.

use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::exec::{signal_name, signal_number};

use super::json::{given, invalid, object, opt_str_at, port, reject_unknown, uint_in};
use super::limits::{MAX_ARGS, MAX_GRACE_MS, STOP_SIGNALS};
use super::types::{Command, Ready, Stop};

/// The rules of a command's value: not empty, at most 1000 arguments, a first argument, no
/// NUL byte.
pub(crate) fn check_command(cmd: &Command, param: &str) -> Result<(), ApiError> {
    let bad = |what: &str| invalid(param, format!("{param} {what}"));
    let parts: &[String] = match cmd {
        Command::Shell(s) if s.is_empty() => return Err(bad("is empty")),
        Command::Shell(s) => std::slice::from_ref(s),
        Command::Argv(a) if a.is_empty() => return Err(bad("is an empty list")),
        Command::Argv(a) if a.len() > MAX_ARGS => return Err(bad("has more than 1000 arguments")),
        Command::Argv(a) if a[0].is_empty() => return Err(bad("has an empty first argument")),
        Command::Argv(a) => a,
    };
    if parts.iter().any(|p| p.contains('\0')) {
        return Err(bad("holds a NUL byte"));
    }
    Ok(())
}

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
    check_command(&cmd, param)?;
    let parts: &[String] = match &cmd {
        Command::Shell(s) => std::slice::from_ref(s),
        Command::Argv(args) => args,
    };
    if let Some(max) = max_bytes {
        if parts.iter().map(String::len).sum::<usize>() > max {
            return Err(bad("is over 64 KiB"));
        }
    }
    Ok(cmd)
}

pub(super) fn parse_ready(v: &Value) -> Result<Ready, ApiError> {
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

pub(super) fn parse_stop(v: &Value) -> Result<Stop, ApiError> {
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
