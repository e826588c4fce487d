//! The types of a validated `POST /v1/run` body: [`RunRequest`] and its parts.

use std::collections::BTreeMap;
use std::fmt;

use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD};
use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::ApiError;
use crate::exec::signal_number;

use super::limits::{DEFAULT_GRACE_MS, MAX_COMMAND_DISPLAY_CHARS};

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
    /// A valid name ([`valid_name`](crate::ids::valid_name)).
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
    /// [`parse_rfc3339`](crate::exec::parse_rfc3339)).
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
    /// The command's deadline: `timeout_seconds` (0.001 to 1e9; default
    /// [`DEFAULT_TIMEOUT_SECONDS`](crate::run::DEFAULT_TIMEOUT_SECONDS)) in the agent's whole
    /// milliseconds, rounded up ([`seconds_to_ms`](crate::run::seconds_to_ms)): decided here,
    /// once.
    pub timeout: std::time::Duration,
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

/// `runtime.dns`: the sandbox's /etc/resolv.conf.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RuntimeDns {
    /// At most 3 (what the C library reads).
    pub servers: Vec<std::net::IpAddr>,
    /// At most 6 domains.
    pub search: Vec<String>,
    /// resolv.conf options (`ndots:2`, `edns0`, ...), at most 16.
    pub options: Vec<String>,
}

impl RuntimeDns {
    /// `runtime.dns` as given (an object of servers, search, options; each an array or
    /// null); 400 invalid_field naming the part.
    pub fn parse(v: &Value) -> Result<RuntimeDns, ApiError> {
        let bad = |p: String, m: &str| ApiError::invalid_field(p.clone(), format!("{p} {m}"));
        let Some(obj) = v.as_object() else {
            return Err(bad("runtime.dns".into(), "must be an object"));
        };
        if let Some(k) = obj
            .keys()
            .find(|k| !["servers", "search", "options"].contains(&k.as_str()))
        {
            return Err(ApiError::new(
                crate::ErrorCode::UnknownField,
                format!("runtime.dns.{k} is not a field of runtime.dns"),
            )
            .with_param(format!("runtime.dns.{k}")));
        }
        let list = |key: &str, max: usize| -> Result<Vec<String>, ApiError> {
            match obj.get(key) {
                None | Some(Value::Null) => Ok(Vec::new()),
                Some(Value::Array(a)) if a.len() <= max => a
                    .iter()
                    .enumerate()
                    .map(|(i, x)| {
                        x.as_str().map(str::to_string).ok_or_else(|| {
                            bad(format!("runtime.dns.{key}[{i}]"), "must be a string")
                        })
                    })
                    .collect(),
                Some(_) => Err(bad(
                    format!("runtime.dns.{key}"),
                    &format!("must be an array of at most {max} strings"),
                )),
            }
        };
        let mut d = RuntimeDns::default();
        for (i, s) in list("servers", 3)?.iter().enumerate() {
            d.servers.push(
                s.parse().map_err(|_| {
                    bad(format!("runtime.dns.servers[{i}]"), "must be an IP address")
                })?,
            );
        }
        for (i, s) in list("search", 6)?.into_iter().enumerate() {
            if !crate::egress::valid_dns_name(s.trim_end_matches('.')) {
                return Err(bad(
                    format!("runtime.dns.search[{i}]"),
                    "must be a domain name",
                ));
            }
            d.search.push(s);
        }
        for (i, s) in list("options", 16)?.into_iter().enumerate() {
            let ok = !s.is_empty()
                && s.len() <= 64
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_:.".contains(&b));
            if !ok {
                return Err(bad(
                    format!("runtime.dns.options[{i}]"),
                    "must be a resolv.conf option (ndots:2, edns0, ...)",
                ));
            }
            d.options.push(s);
        }
        Ok(d)
    }

    /// The resolv.conf: its servers (or `fallback` where it names none), search, options.
    pub fn resolv_conf(&self, fallback: &[std::net::IpAddr]) -> String {
        let servers = if self.servers.is_empty() {
            fallback
        } else {
            &self.servers
        };
        let mut out = String::new();
        for s in servers {
            out.push_str(&format!("nameserver {s}\n"));
        }
        if !self.search.is_empty() {
            out.push_str(&format!("search {}\n", self.search.join(" ")));
        }
        if !self.options.is_empty() {
            out.push_str(&format!("options {}\n", self.options.join(" ")));
        }
        out
    }
}

#[cfg(test)]
mod dns_tests {
    use super::*;

    #[test]
    fn runtime_dns_is_checked_and_written() {
        let d = RuntimeDns::parse(&serde_json::json!({
            "servers": ["1.1.1.1", "2606:4700:4700::1111"], "search": ["corp.example"],
            "options": ["ndots:2", "edns0"]}))
        .unwrap();
        assert_eq!(
            d.resolv_conf(&[]),
            "nameserver 1.1.1.1\nnameserver 2606:4700:4700::1111\nsearch corp.example\noptions ndots:2 edns0\n"
        );
        let gw: std::net::IpAddr = "10.0.0.1".parse().unwrap();
        let only = RuntimeDns::parse(&serde_json::json!({"options": ["ndots:1"]})).unwrap();
        assert_eq!(
            only.resolv_conf(&[gw]),
            "nameserver 10.0.0.1\noptions ndots:1\n"
        );
        let err = |v| RuntimeDns::parse(&v).unwrap_err().param.unwrap_or_default();
        assert_eq!(
            err(serde_json::json!({"servers": ["x"]})),
            "runtime.dns.servers[0]"
        );
        assert_eq!(
            err(serde_json::json!({"servers": ["1.1.1.1","1.1.1.2","1.1.1.3","1.1.1.4"]})),
            "runtime.dns.servers"
        );
        assert_eq!(
            err(serde_json::json!({"search": ["bad name"]})),
            "runtime.dns.search[0]"
        );
        assert_eq!(
            err(serde_json::json!({"options": ["a b"]})),
            "runtime.dns.options[0]"
        );
        assert_eq!(
            err(serde_json::json!({"nameserver": []})),
            "runtime.dns.nameserver"
        );
    }
}
