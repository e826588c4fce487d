//! `runtime`: a sandbox's runtime settings as a Compose file asks for them (ulimits, sysctls,
//! tmpfs, dns, shm_size). Parsed and checked here (every 400 of the field), kept in one
//! canonical form ([`Runtime::to_value`]) and shown in the sandbox object
//! ([`Runtime::shown`]).

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use crate::error::ApiError;

use super::json::{given, invalid, object, reject_unknown, uint_in, unknown_field};
use super::types::RuntimeDns;

/// Docker's names of the resource limits a sandbox's commands may be given.
pub const ULIMIT_NAMES: [&str; 16] = [
    "core",
    "cpu",
    "data",
    "fsize",
    "locks",
    "memlock",
    "msgqueue",
    "nice",
    "nofile",
    "nproc",
    "rss",
    "rtprio",
    "rttime",
    "sigpending",
    "stack",
    "as",
];

/// The most open files a sandbox's command may be given (the kernel's default fs.nr_open).
pub const MAX_NOFILE: i64 = 1_048_576;
/// The most tmpfs mounts of one sandbox.
pub const MAX_TMPFS: usize = 16;
/// The most sysctls of one sandbox.
pub const MAX_SYSCTLS: usize = 64;
/// The longest sysctl value, in bytes.
pub const MAX_SYSCTL_VALUE_BYTES: usize = 1024;
/// A tmpfs's mode when none is given (Docker's: sticky, everybody's).
pub const DEFAULT_TMPFS_MODE: u32 = 0o1777;
/// The least and the most of `shm_size_bytes` and a tmpfs's `size_bytes`.
pub const MIN_SHM_BYTES: u64 = 1 << 20;
pub const MAX_SHM_BYTES: u64 = 1 << 40;
/// The least size of a tmpfs mount (one page).
pub const MIN_TMPFS_BYTES: u64 = 4096;

/// One limit: `-1` is none (unlimited).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ulimit {
    pub soft: i64,
    pub hard: i64,
}

/// A tmpfs mounted at `path` (nosuid, nodev).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TmpfsMount {
    /// Absolute and normal (no `.`, `..` or empty component), not `/`, not under /proc,
    /// /sys or /dev.
    pub path: String,
    /// `None`: the kernel's default (half the host's memory; what is written is charged to
    /// the sandbox's memory all the same).
    pub size_bytes: Option<u64>,
    /// Its root directory's mode (permission bits, sticky, setgid, setuid).
    pub mode: u32,
}

/// `runtime`, checked.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Runtime {
    /// By Docker's name.
    pub ulimits: BTreeMap<String, Ulimit>,
    /// By name (`net.ipv4.ip_unprivileged_port_start`), values as strings.
    pub sysctls: BTreeMap<String, String>,
    pub tmpfs: Vec<TmpfsMount>,
    pub dns: Option<RuntimeDns>,
    pub shm_size_bytes: Option<u64>,
}

impl Runtime {
    /// `runtime` as given (or in its canonical form): 400 invalid_field / unknown_field with
    /// `param` naming the part at fault.
    pub fn parse(v: &Value) -> Result<Runtime, ApiError> {
        let obj = object(v, "runtime")?;
        reject_unknown(
            obj,
            "runtime",
            &["ulimits", "sysctls", "tmpfs", "dns", "shm_size_bytes"],
        )?;
        let mut rt = Runtime::default();
        if let Some(val) = given(obj, "ulimits") {
            for (name, limit) in object(val, "runtime.ulimits")? {
                rt.ulimits.insert(name.clone(), parse_ulimit(name, limit)?);
            }
        }
        if let Some(val) = given(obj, "sysctls") {
            let map = object(val, "runtime.sysctls")?;
            if map.len() > MAX_SYSCTLS {
                return Err(invalid(
                    "runtime.sysctls",
                    format!("runtime.sysctls may name at most {MAX_SYSCTLS} settings"),
                ));
            }
            for (name, value) in map {
                let (name, value) = parse_sysctl(name, value)?;
                rt.sysctls.insert(name, value);
            }
        }
        if let Some(val) = given(obj, "tmpfs") {
            let Some(list) = val.as_array() else {
                return Err(invalid("runtime.tmpfs", "runtime.tmpfs must be an array"));
            };
            if list.len() > MAX_TMPFS {
                return Err(invalid(
                    "runtime.tmpfs",
                    format!("runtime.tmpfs may hold at most {MAX_TMPFS} mounts"),
                ));
            }
            for (i, item) in list.iter().enumerate() {
                let t = parse_tmpfs(i, item)?;
                if rt.tmpfs.iter().any(|o| o.path == t.path) {
                    return Err(invalid(
                        format!("runtime.tmpfs[{i}].path"),
                        format!("{} is mounted twice", t.path),
                    ));
                }
                rt.tmpfs.push(t);
            }
        }
        if let Some(val) = given(obj, "dns") {
            rt.dns = Some(RuntimeDns::parse(val)?);
        }
        if let Some(val) = given(obj, "shm_size_bytes") {
            rt.shm_size_bytes = Some(uint_in(
                val,
                "runtime.shm_size_bytes",
                MIN_SHM_BYTES,
                MAX_SHM_BYTES,
            )?);
        }
        Ok(rt)
    }

    /// Whether nothing is set.
    pub fn is_empty(&self) -> bool {
        self.ulimits.is_empty()
            && self.sysctls.is_empty()
            && self.tmpfs.is_empty()
            && self.dns.is_none()
            && self.shm_size_bytes.is_none()
    }

    /// Whether it changes the sandbox's machine beyond its /etc/resolv.conf (what a warm
    /// sandbox, made ahead without it, cannot become).
    pub fn changes_machine(&self) -> bool {
        !(self.ulimits.is_empty()
            && self.sysctls.is_empty()
            && self.tmpfs.is_empty()
            && self.shm_size_bytes.is_none())
    }

    /// The canonical form the node keeps (and hashes into a template's key): every part, the
    /// limits as `{soft, hard}`, sysctls as strings, each tmpfs as `{path, size_bytes, mode}`,
    /// `dns` null when not given. [`Runtime::parse`] reads it back to the same value.
    pub fn to_value(&self) -> Value {
        json!({
            "ulimits": self.ulimits_value(),
            "sysctls": self.sysctls,
            "tmpfs": self.tmpfs_value(),
            "dns": self.dns.as_ref().map(dns_value),
            "shm_size_bytes": self.shm_size_bytes,
        })
    }

    /// As the sandbox object shows it (the spec's `Runtime`): as [`Runtime::to_value`], with
    /// `dns` an object of empty lists when not given.
    pub fn shown(&self) -> Value {
        let mut v = self.to_value();
        if self.dns.is_none() {
            v["dns"] = dns_value(&RuntimeDns::default());
        }
        v
    }

    fn ulimits_value(&self) -> Value {
        let mut out = Map::new();
        for (name, l) in &self.ulimits {
            out.insert(name.clone(), json!({"soft": l.soft, "hard": l.hard}));
        }
        Value::Object(out)
    }

    fn tmpfs_value(&self) -> Value {
        Value::Array(
            self.tmpfs
                .iter()
                .map(|t| json!({"path": t.path, "size_bytes": t.size_bytes, "mode": t.mode}))
                .collect(),
        )
    }
}

/// Written in its canonical form ([`Runtime::to_value`]), as the node keeps it (and hashes it
/// into a template's key).
impl serde::Serialize for Runtime {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_value().serialize(s)
    }
}

/// Read as [`Runtime::parse`] reads it: a runtime that does not parse is an error (its
/// message the parse's).
impl<'de> serde::Deserialize<'de> for Runtime {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Runtime, D::Error> {
        let v = Value::deserialize(d)?;
        Runtime::parse(&v).map_err(|e| serde::de::Error::custom(e.message))
    }
}

fn dns_value(d: &RuntimeDns) -> Value {
    let servers: Vec<String> = d.servers.iter().map(|s| s.to_string()).collect();
    json!({"servers": servers, "search": d.search, "options": d.options})
}

fn parse_ulimit(name: &str, v: &Value) -> Result<Ulimit, ApiError> {
    let param = format!("runtime.ulimits.{name}");
    if !ULIMIT_NAMES.contains(&name) {
        return Err(invalid(
            &param,
            format!(
                "{name} is not a ulimit (one of {})",
                ULIMIT_NAMES.join(", ")
            ),
        ));
    }
    let number = |v: &Value, param: &str| -> Result<i64, ApiError> {
        match v.as_i64() {
            Some(n) if n >= -1 => Ok(n),
            _ => Err(invalid(
                param,
                format!("{param} must be an integer, -1 for none"),
            )),
        }
    };
    let limit = match v {
        Value::Object(o) => {
            reject_unknown(o, &param, &["soft", "hard"])?;
            let part = |key: &str| -> Result<i64, ApiError> {
                let p = format!("{param}.{key}");
                match given(o, key) {
                    Some(v) => number(v, &p),
                    None => Err(invalid(&p, format!("{p} is required"))),
                }
            };
            Ulimit {
                soft: part("soft")?,
                hard: part("hard")?,
            }
        }
        _ => {
            let n = number(v, &param)?;
            Ulimit { soft: n, hard: n }
        }
    };
    // -1 (none) is above every number.
    let above = |a: i64, b: i64| b != -1 && (a == -1 || a > b);
    if above(limit.soft, limit.hard) {
        return Err(invalid(
            format!("{param}.soft"),
            format!("{param}.soft must be no higher than its hard limit"),
        ));
    }
    let in_nofile = |n: i64| (1..=MAX_NOFILE).contains(&n);
    if name == "nofile" && !(in_nofile(limit.soft) && in_nofile(limit.hard)) {
        return Err(invalid(
            &param,
            format!("{param} must be from 1 to {MAX_NOFILE} (never -1)"),
        ));
    }
    Ok(limit)
}

/// Whether `name` is a sysctl Docker lets a container set: those of its own network and IPC
/// namespaces.
pub fn sysctl_allowed(name: &str) -> bool {
    name.starts_with("net.")
        || name.starts_with("kernel.shm")
        || name.starts_with("kernel.msg")
        || name == "kernel.sem"
        || name.starts_with("fs.mqueue.")
}

fn parse_sysctl(name: &str, v: &Value) -> Result<(String, String), ApiError> {
    let param = format!("runtime.sysctls.{name}");
    let well_formed = !name.is_empty()
        && name.len() <= 255
        && name.split('.').all(|c| {
            !c.is_empty()
                && c.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        });
    if !well_formed {
        return Err(invalid(
            &param,
            format!(
                "{name} is not a sysctl's name (words of letters, digits, _ and - between dots)"
            ),
        ));
    }
    if !sysctl_allowed(name) {
        return Err(invalid(
            &param,
            format!(
                "{name} is not a sysctl a sandbox may set (net.*, kernel.shm*, kernel.msg*, kernel.sem, fs.mqueue.*)"
            ),
        ));
    }
    let value = match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        _ => {
            return Err(invalid(
                &param,
                format!("{param} must be a string or a number"),
            ))
        }
    };
    if value.is_empty()
        || value.len() > MAX_SYSCTL_VALUE_BYTES
        || value.contains(['\n', '\r', '\0'])
    {
        return Err(invalid(
            &param,
            format!("{param} must be 1 to {MAX_SYSCTL_VALUE_BYTES} bytes on one line"),
        ));
    }
    Ok((name.to_string(), value))
}

fn parse_tmpfs(i: usize, v: &Value) -> Result<TmpfsMount, ApiError> {
    let at = format!("runtime.tmpfs[{i}]");
    let (path, size_bytes, mode) = match v {
        Value::String(p) => (p.clone(), None, DEFAULT_TMPFS_MODE),
        Value::Object(o) => {
            if let Some(k) = o
                .keys()
                .find(|k| !["path", "size_bytes", "mode"].contains(&k.as_str()))
            {
                return Err(unknown_field(&format!("{at}.{k}"), &at));
            }
            let path = match given(o, "path") {
                Some(Value::String(p)) => p.clone(),
                _ => {
                    let p = format!("{at}.path");
                    return Err(invalid(&p, format!("{p} must be a string")));
                }
            };
            let size = given(o, "size_bytes")
                .map(|s| {
                    uint_in(
                        s,
                        &format!("{at}.size_bytes"),
                        MIN_TMPFS_BYTES,
                        MAX_SHM_BYTES,
                    )
                })
                .transpose()?;
            let mode = match given(o, "mode") {
                Some(m) => uint_in(m, &format!("{at}.mode"), 0, 0o7777)? as u32,
                None => DEFAULT_TMPFS_MODE,
            };
            (path, size, mode)
        }
        _ => {
            return Err(invalid(
                &at,
                format!("{at} must be a path or an object {{path, size_bytes, mode}}"),
            ))
        }
    };
    check_tmpfs_path(&path).map_err(|why| invalid(format!("{at}.path"), why))?;
    Ok(TmpfsMount {
        path,
        size_bytes,
        mode,
    })
}

fn check_tmpfs_path(path: &str) -> Result<(), String> {
    if !path.starts_with('/') || path == "/" {
        return Err(format!("{path:?} is not an absolute path other than /"));
    }
    if path.len() > 4095 || path.contains('\0') {
        return Err("a tmpfs path is at most 4095 bytes, without NUL".into());
    }
    if path[1..]
        .split('/')
        .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err(format!(
            "{path} is not a normal path (no empty, . or .. component, no trailing /)"
        ));
    }
    for own in ["/proc", "/sys", "/dev"] {
        if path == own || path.starts_with(&format!("{own}/")) {
            return Err(format!(
                "{path} is under {own}, which the sandbox mounts itself (/dev/shm: shm_size_bytes)"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorCode;

    fn err(v: Value) -> (ErrorCode, String) {
        let e = Runtime::parse(&v).expect_err("refused");
        (e.code, e.param.unwrap_or_default())
    }

    fn is(code: ErrorCode, param: &str) -> (ErrorCode, String) {
        (code, param.to_string())
    }

    #[test]
    fn ulimits_as_a_number_or_soft_and_hard() {
        let rt = Runtime::parse(&json!({"ulimits": {
            "nofile": 1024, "nproc": {"soft": 10, "hard": 20}, "core": -1,
            "stack": {"soft": 8388608, "hard": -1}, "as": 1073741824
        }}))
        .unwrap();
        assert_eq!(
            rt.ulimits["nofile"],
            Ulimit {
                soft: 1024,
                hard: 1024
            }
        );
        assert_eq!(rt.ulimits["nproc"], Ulimit { soft: 10, hard: 20 });
        assert_eq!(rt.ulimits["core"], Ulimit { soft: -1, hard: -1 });
        assert_eq!(
            rt.ulimits["stack"],
            Ulimit {
                soft: 8388608,
                hard: -1
            }
        );
        assert!(rt.changes_machine());
        assert_eq!(
            rt.to_value()["ulimits"]["nofile"],
            json!({"soft": 1024, "hard": 1024})
        );
    }

    #[test]
    fn bad_ulimits() {
        use ErrorCode::*;
        assert_eq!(
            err(json!({"ulimits": {"files": 10}})),
            is(InvalidField, "runtime.ulimits.files")
        );
        assert_eq!(
            err(json!({"ulimits": {"nproc": {"soft": 20, "hard": 10}}})),
            is(InvalidField, "runtime.ulimits.nproc.soft")
        );
        assert_eq!(
            err(json!({"ulimits": {"nproc": {"soft": -1, "hard": 10}}})),
            is(InvalidField, "runtime.ulimits.nproc.soft")
        );
        assert_eq!(
            err(json!({"ulimits": {"nproc": {"soft": 1}}})),
            is(InvalidField, "runtime.ulimits.nproc.hard")
        );
        assert_eq!(
            err(json!({"ulimits": {"nproc": {"soft": 1, "hard": 2, "max": 3}}})),
            is(UnknownField, "runtime.ulimits.nproc.max")
        );
        assert_eq!(
            err(json!({"ulimits": {"nproc": -2}})),
            is(InvalidField, "runtime.ulimits.nproc")
        );
        assert_eq!(
            err(json!({"ulimits": {"nproc": "10"}})),
            is(InvalidField, "runtime.ulimits.nproc")
        );
        assert_eq!(
            err(json!({"ulimits": {"nproc": 1.5}})),
            is(InvalidField, "runtime.ulimits.nproc")
        );
        for bad in [
            json!(0),
            json!(-1),
            json!(1_048_577),
            json!({"soft": 5, "hard": -1}),
        ] {
            assert_eq!(
                err(json!({"ulimits": {"nofile": bad}})),
                is(InvalidField, "runtime.ulimits.nofile")
            );
        }
        assert!(Runtime::parse(&json!({"ulimits": {"nofile": 1_048_576}})).is_ok());
    }

    #[test]
    fn sysctls_docker_allows() {
        let rt = Runtime::parse(&json!({"sysctls": {
            "net.ipv4.ip_unprivileged_port_start": 0,
            "kernel.shmmax": "68719476736",
            "kernel.msgmax": "65536",
            "kernel.sem": "250 32000 100 128",
            "fs.mqueue.msg_max": "100",
            "net.ipv4.conf.all.forwarding": "1"
        }}))
        .unwrap();
        assert_eq!(rt.sysctls["net.ipv4.ip_unprivileged_port_start"], "0");
        assert_eq!(rt.sysctls["kernel.sem"], "250 32000 100 128");
        assert_eq!(
            rt.to_value()["sysctls"]["kernel.shmmax"],
            json!("68719476736")
        );
    }

    #[test]
    fn bad_sysctls() {
        use ErrorCode::*;
        for name in [
            "kernel.hostname",
            "kernel.domainname",
            "vm.swappiness",
            "fs.file-max",
            "kernel.semx",
            "kernel.pid_max",
            "fs.mqueue",
        ] {
            assert_eq!(
                err(json!({"sysctls": {name: "1"}})),
                is(InvalidField, &format!("runtime.sysctls.{name}")),
                "{name}"
            );
        }
        for name in ["net..ipv4", "net.ipv4/../x", "net.ipv4.", "net.a b"] {
            assert_eq!(
                err(json!({"sysctls": {name: "1"}})),
                is(InvalidField, &format!("runtime.sysctls.{name}")),
                "{name}"
            );
        }
        for value in [
            json!(""),
            json!("1\n2"),
            json!(true),
            json!("x".repeat(1025)),
        ] {
            assert_eq!(
                err(json!({"sysctls": {"net.core.somaxconn": value}})),
                is(InvalidField, "runtime.sysctls.net.core.somaxconn")
            );
        }
        assert_eq!(
            err(json!({"sysctls": ["net.core.somaxconn=1"]})),
            is(InvalidField, "runtime.sysctls")
        );
    }

    #[test]
    fn tmpfs_paths_and_options() {
        let rt = Runtime::parse(&json!({"tmpfs": [
            "/run",
            {"path": "/var/cache", "size_bytes": 1048576, "mode": 448}
        ]}))
        .unwrap();
        assert_eq!(
            rt.tmpfs,
            vec![
                TmpfsMount {
                    path: "/run".into(),
                    size_bytes: None,
                    mode: 0o1777
                },
                TmpfsMount {
                    path: "/var/cache".into(),
                    size_bytes: Some(1 << 20),
                    mode: 0o700
                },
            ]
        );
        assert_eq!(
            rt.to_value()["tmpfs"][0],
            json!({"path": "/run", "size_bytes": null, "mode": 1023})
        );
    }

    #[test]
    fn bad_tmpfs() {
        use ErrorCode::*;
        for (path, at) in [
            ("run", "runtime.tmpfs[0].path"),
            ("/", "runtime.tmpfs[0].path"),
            ("/a/../b", "runtime.tmpfs[0].path"),
            ("/a//b", "runtime.tmpfs[0].path"),
            ("/a/", "runtime.tmpfs[0].path"),
            ("/proc/x", "runtime.tmpfs[0].path"),
            ("/dev/shm", "runtime.tmpfs[0].path"),
            ("/sys", "runtime.tmpfs[0].path"),
        ] {
            assert_eq!(
                err(json!({"tmpfs": [path]})),
                is(InvalidField, at),
                "{path}"
            );
        }
        assert!(Runtime::parse(&json!({"tmpfs": ["/devices", "/proc2"]})).is_ok());
        assert_eq!(
            err(json!({"tmpfs": ["/a", {"path": "/a"}]})),
            is(InvalidField, "runtime.tmpfs[1].path")
        );
        assert_eq!(
            err(json!({"tmpfs": [{"path": "/a", "size_bytes": 10}]})),
            is(InvalidField, "runtime.tmpfs[0].size_bytes")
        );
        assert_eq!(
            err(json!({"tmpfs": [{"path": "/a", "mode": 4096}]})),
            is(InvalidField, "runtime.tmpfs[0].mode")
        );
        assert_eq!(
            err(json!({"tmpfs": [{"path": "/a", "uid": 1}]})),
            is(UnknownField, "runtime.tmpfs[0].uid")
        );
        assert_eq!(
            err(json!({"tmpfs": [7]})),
            is(InvalidField, "runtime.tmpfs[0]")
        );
        assert_eq!(
            err(json!({"tmpfs": "/run"})),
            is(InvalidField, "runtime.tmpfs")
        );
    }

    #[test]
    fn shm_size_and_the_canonical_form() {
        use ErrorCode::*;
        assert_eq!(
            err(json!({"shm_size_bytes": 1000})),
            is(InvalidField, "runtime.shm_size_bytes")
        );
        assert_eq!(
            err(json!({"shm_size_bytes": (1u64 << 40) + 1})),
            is(InvalidField, "runtime.shm_size_bytes")
        );
        assert_eq!(err(json!({"dnss": {}})), is(UnknownField, "runtime.dnss"));
        let given = json!({
            "ulimits": {"nofile": 64}, "sysctls": {"kernel.shmmni": 100},
            "tmpfs": ["/run"], "dns": {"servers": ["1.1.1.1"]}, "shm_size_bytes": 67108864
        });
        let rt = Runtime::parse(&given).unwrap();
        let canonical = rt.to_value();
        assert_eq!(Runtime::parse(&canonical).unwrap(), rt);
        assert_eq!(canonical["dns"]["servers"], json!(["1.1.1.1"]));
        assert_eq!(canonical["shm_size_bytes"], json!(67108864));
        let only_dns = Runtime::parse(&json!({"dns": {"options": ["ndots:2"]}})).unwrap();
        assert!(!only_dns.changes_machine() && !only_dns.is_empty());
        let none = Runtime::parse(&json!({})).unwrap();
        assert!(none.is_empty());
        assert_eq!(none.to_value()["dns"], Value::Null);
        assert_eq!(
            none.shown()["dns"],
            json!({"servers": [], "search": [], "options": []})
        );
    }

    #[test]
    fn serde_writes_the_canonical_form_and_reads_it_back() {
        let rt = Runtime::parse(&json!({"ulimits": {"nofile": 64}, "tmpfs": ["/run"]})).unwrap();
        let text = serde_json::to_string(&rt).unwrap();
        assert_eq!(text, serde_json::to_string(&rt.to_value()).unwrap());
        assert_eq!(serde_json::from_str::<Runtime>(&text).unwrap(), rt);
        let e = serde_json::from_str::<Runtime>(r#"{"ulimits": {"nope": 1}}"#).unwrap_err();
        assert!(e.to_string().contains("nope is not a ulimit"), "{e}");
    }
}
