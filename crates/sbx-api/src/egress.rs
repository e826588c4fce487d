//! Egress rules: what a sandbox may reach (`egress` of a create, a run or a PATCH), parsed
//! into typed rules and decided here, so that the node's kernel rules, its DNS and its egress
//! proxy decide alike.
//!
//! - `default`: `allow` (or null) or `deny`: what holds where no rule speaks.
//! - `allow`, `deny`: entries, each an IP (`203.0.113.7`, `2001:db8::1`), a CIDR
//!   (`203.0.113.0/24`), a DNS name (`api.example.com`), `*.name` (any subdomain of name, not
//!   name itself) or `*` (everything).
//! - The most specific rule that matches decides: for an address the longest prefix (`*` is
//!   /0); for a name the name itself, then the wildcard of its longest suffix, then `*`. At the
//!   same level allow wins over deny. Names and addresses are apart: a name rule does not
//!   speak for an address written in a URL, nor an address rule for a name.
//! - `deny_ports` (TCP and UDP) holds whatever else the rules say.
//! - `http`: `[{host, methods?, paths?}]`: requests to host pass only when one rule of that
//!   host matches (method among `methods`, exactly: `get` is not `GET`; path matching one of
//!   `paths`, where `*` is any run of characters). A path is matched only in its normal form
//!   ([`normal_path`]): one that is not (`/v1/../admin`, `/v1/%2e%2e/admin`, an encoded `/`)
//!   is refused, as a server would read it otherwise than the rule did.
//! - `inject`: `[{host, secret, header?, value?}]`: the egress proxy sets `header` (default
//!   `Authorization`) to `value` (default `{secret}`) with the secret's value in the place of
//!   `{secret}`, on every request to host.
//!
//! The rules are kept as the calls gave them ([`EgressRules`]: each part absent, null or as
//! written) and parsed again where they are used ([`Egress`]); [`merge`] is a PATCH's
//! key-by-key merge.

use std::net::{IpAddr, Ipv4Addr};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{ApiError, ErrorCode};
use crate::Field;

/// Most entries of `allow` or `deny`.
pub const MAX_TARGETS: usize = 256;
/// Most rules of `http` or `inject`.
pub const MAX_HTTP_RULES: usize = 64;
/// Most ports in `deny_ports`.
pub use crate::run::MAX_DENY_PORTS;
/// Most bytes of the rules as JSON.
pub const MAX_EGRESS_BYTES: usize = 256 * 1024;

/// Allowed or not (`allow`, `deny`: `default` of the rules).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Allow,
    Deny,
}

/// One entry of `allow` or `deny`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// `*`.
    Any,
    /// An address (a /32 or /128) or a CIDR.
    Net(ipnet::IpNet),
    /// A DNS name, lower-case, without a trailing dot.
    Name(String),
    /// `*.suffix`: any name under suffix.
    Suffix(String),
}

/// A rule of `http`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpRule {
    pub host: HostPattern,
    /// Upper-case; empty: any.
    pub methods: Vec<String>,
    /// Patterns (`*` any run of characters); empty: any.
    pub paths: Vec<String>,
}

/// A rule of `inject`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inject {
    pub host: HostPattern,
    pub secret: String,
    /// Lower-case header name.
    pub header: String,
    /// With `{secret}` where the value goes.
    pub value: String,
}

/// A host of an `http` or `inject` rule: a name or `*.name`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostPattern {
    Name(String),
    Suffix(String),
}

impl HostPattern {
    /// Whether `host` (lower-case, no trailing dot) is this pattern's.
    pub fn matches(&self, host: &str) -> bool {
        match self {
            HostPattern::Name(n) => n == host,
            HostPattern::Suffix(s) => is_under(host, s),
        }
    }

    /// As written in the rules (`api.example.com`, `*.example.com`).
    pub fn as_text(&self) -> String {
        match self {
            HostPattern::Name(n) => n.clone(),
            HostPattern::Suffix(s) => format!("*.{s}"),
        }
    }
}

/// A sandbox's egress rules, parsed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Egress {
    pub default_deny: bool,
    pub allow: Vec<Target>,
    pub deny: Vec<Target>,
    pub http: Vec<HttpRule>,
    pub inject: Vec<Inject>,
    pub deny_ports: Vec<u16>,
}

fn bad(param: &str, msg: &str) -> ApiError {
    ApiError::new(ErrorCode::InvalidEgress, format!("{param} {msg}")).with_param(param)
}

/// `host` lower-cased without a trailing dot.
pub fn normal_host(host: &str) -> String {
    host.trim_end_matches('.').to_ascii_lowercase()
}

/// A DNS name of letters, digits, hyphens and underscores, labels of 1 to 63, at most 253.
pub fn valid_dns_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            let b = label.as_bytes();
            !b.is_empty()
                && b.len() <= 63
                && b.iter()
                    .all(|c| c.is_ascii_alphanumeric() || *c == b'-' || *c == b'_')
                && b[0] != b'-'
                && b[b.len() - 1] != b'-'
        })
}

/// Whether `name` is a subdomain of `suffix` (not suffix itself).
fn is_under(name: &str, suffix: &str) -> bool {
    name.strip_suffix(suffix)
        .is_some_and(|head| head.len() > 1 && head.ends_with('.'))
}

fn parse_target(v: &Value, param: &str) -> Result<Target, ApiError> {
    let Some(s) = v.as_str() else {
        return Err(bad(
            param,
            "must be a string: an IP, a CIDR, a DNS name, *.name or *",
        ));
    };
    let s = s.trim();
    if s == "*" {
        return Ok(Target::Any);
    }
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Ok(Target::Net(ipnet::IpNet::from(ip)));
    }
    if s.contains('/') {
        return match s.parse::<ipnet::IpNet>() {
            Ok(net) => Ok(Target::Net(net.trunc())),
            Err(_) => Err(bad(param, "is not a CIDR (203.0.113.0/24)")),
        };
    }
    let name = normal_host(s);
    if let Some(suffix) = name.strip_prefix("*.") {
        if valid_dns_name(suffix) {
            return Ok(Target::Suffix(suffix.to_string()));
        }
    } else if valid_dns_name(&name) {
        return Ok(Target::Name(name));
    }
    Err(bad(
        param,
        "is not an IP, a CIDR, a DNS name, *.name (any subdomain) or *",
    ))
}

fn parse_host(v: Option<&Value>, param: &str) -> Result<HostPattern, ApiError> {
    let Some(s) = v.and_then(Value::as_str) else {
        return Err(bad(param, "is required: a DNS name or *.name"));
    };
    let name = normal_host(s);
    match name.strip_prefix("*.") {
        Some(suffix) if valid_dns_name(suffix) => Ok(HostPattern::Suffix(suffix.to_string())),
        None if valid_dns_name(&name) && name.parse::<IpAddr>().is_err() => {
            Ok(HostPattern::Name(name))
        }
        _ => Err(bad(param, "must be a DNS name or *.name")),
    }
}

fn strings(v: Option<&Value>, param: &str, max: usize) -> Result<Vec<String>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) if items.len() <= max => items
            .iter()
            .enumerate()
            .map(|(i, x)| match x.as_str() {
                Some(s) if !s.is_empty() && s.len() <= 2048 => Ok(s.to_string()),
                _ => Err(bad(
                    &format!("{param}[{i}]"),
                    "must be a string of 1 to 2048 bytes",
                )),
            })
            .collect(),
        Some(_) => Err(bad(
            param,
            &format!("must be an array of at most {max} strings"),
        )),
    }
}

fn rule_object<'a>(
    v: &'a Value,
    param: &str,
    keys: &[&str],
) -> Result<&'a Map<String, Value>, ApiError> {
    let Some(obj) = v.as_object() else {
        return Err(bad(param, "must be an object"));
    };
    if let Some(k) = obj.keys().find(|k| !keys.contains(&k.as_str())) {
        return Err(bad(&format!("{param}.{k}"), "is not a part of this rule"));
    }
    Ok(obj)
}

fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Headers the proxy itself writes: an inject may not set them.
const RESERVED_HEADERS: [&str; 7] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "upgrade",
    "te",
    "trailer",
];

fn list<'a>(obj: &'a Map<String, Value>, key: &str, max: usize) -> Result<&'a [Value], ApiError> {
    let param = format!("egress.{key}");
    match obj.get(key) {
        None | Some(Value::Null) => Ok(&[]),
        Some(Value::Array(items)) if items.len() <= max => Ok(items),
        Some(Value::Array(_)) => Err(bad(&param, &format!("has more than {max} entries"))),
        Some(_) => Err(bad(&param, "must be an array or null")),
    }
}

impl Egress {
    /// Parses rules as a call gives them (an object, keys as the module says); 400
    /// invalid_egress with `param` naming the part that is wrong (`egress.allow[2]`).
    pub fn parse(v: &Value) -> Result<Egress, ApiError> {
        let Some(obj) = v.as_object() else {
            return Err(bad("egress", "must be an object or null"));
        };
        if let Some(k) = obj.keys().find(|k| {
            !["default", "allow", "deny", "http", "inject", "deny_ports"].contains(&k.as_str())
        }) {
            return Err(bad(&format!("egress.{k}"), "is not a part of egress rules"));
        }
        if serde_json::to_vec(v).map_or(true, |b| b.len() > MAX_EGRESS_BYTES) {
            return Err(bad("egress", "is over 256 KiB"));
        }
        let mut e = Egress::default();
        match obj.get("default") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == "allow" => {}
            Some(Value::String(s)) if s == "deny" => e.default_deny = true,
            Some(_) => return Err(bad("egress.default", "must be allow, deny or null")),
        }
        for (key, out) in [("allow", &mut e.allow), ("deny", &mut e.deny)] {
            for (i, t) in list(obj, key, MAX_TARGETS)?.iter().enumerate() {
                out.push(parse_target(t, &format!("egress.{key}[{i}]"))?);
            }
        }
        for (i, r) in list(obj, "http", MAX_HTTP_RULES)?.iter().enumerate() {
            let param = format!("egress.http[{i}]");
            let o = rule_object(r, &param, &["host", "methods", "paths"])?;
            let host = parse_host(o.get("host"), &format!("{param}.host"))?;
            let methods = strings(o.get("methods"), &format!("{param}.methods"), 16)?;
            for (j, m) in methods.iter().enumerate() {
                if !is_token(m) {
                    return Err(bad(
                        &format!("{param}.methods[{j}]"),
                        "is not an HTTP method",
                    ));
                }
            }
            let paths = strings(o.get("paths"), &format!("{param}.paths"), 64)?;
            for (j, p) in paths.iter().enumerate() {
                if !p.starts_with('/') && p != "*" {
                    return Err(bad(&format!("{param}.paths[{j}]"), "must start with /"));
                }
            }
            e.http.push(HttpRule {
                host,
                methods: methods.iter().map(|m| m.to_ascii_uppercase()).collect(),
                paths,
            });
        }
        for (i, r) in list(obj, "inject", MAX_HTTP_RULES)?.iter().enumerate() {
            let param = format!("egress.inject[{i}]");
            let o = rule_object(r, &param, &["host", "secret", "header", "value"])?;
            let host = parse_host(o.get("host"), &format!("{param}.host"))?;
            let secret = match o.get("secret").and_then(Value::as_str) {
                Some(s) if crate::ids::valid_name(s) => s.to_string(),
                _ => return Err(bad(&format!("{param}.secret"), "must be a secret's name")),
            };
            let header = match o.get("header") {
                None | Some(Value::Null) => "authorization".to_string(),
                Some(Value::String(h))
                    if is_token(h)
                        && !RESERVED_HEADERS.contains(&h.to_ascii_lowercase().as_str()) =>
                {
                    h.to_ascii_lowercase()
                }
                Some(_) => {
                    return Err(bad(
                        &format!("{param}.header"),
                        "must be an HTTP header name (not Host, Content-Length, Connection...)",
                    ))
                }
            };
            let value = match o.get("value") {
                None | Some(Value::Null) => "{secret}".to_string(),
                Some(Value::String(v))
                    if v.contains("{secret}")
                        && v.len() <= 1024
                        && v.bytes().all(|b| b == b'\t' || (0x20..0x7f).contains(&b)) =>
                {
                    v.clone()
                }
                Some(_) => {
                    return Err(bad(
                        &format!("{param}.value"),
                        "must be printable text of at most 1 KiB holding {secret}",
                    ))
                }
            };
            e.inject.push(Inject {
                host,
                secret,
                header,
                value,
            });
        }
        for (i, p) in list(obj, "deny_ports", MAX_DENY_PORTS)?.iter().enumerate() {
            match p.as_u64() {
                Some(n @ 1..=65_535) => e.deny_ports.push(n as u16),
                _ => {
                    return Err(bad(
                        &format!("egress.deny_ports[{i}]"),
                        "must be a port from 1 to 65535",
                    ))
                }
            }
        }
        e.deny_ports.sort_unstable();
        e.deny_ports.dedup();
        Ok(e)
    }

    /// These rules as the JSON a call gives (`egress` of a create, a run or a PATCH) that
    /// [`Egress::parse`] reads back to them: each target as text (`*`, `203.0.113.0/24`,
    /// `api.example.com`, `*.example.com`), the parts that say nothing left out.
    pub fn to_json(&self) -> Value {
        let target = |t: &Target| match t {
            Target::Any => "*".to_string(),
            Target::Net(n) => n.to_string(),
            Target::Name(n) => n.clone(),
            Target::Suffix(s) => format!("*.{s}"),
        };
        let mut o = Map::new();
        if self.default_deny {
            o.insert("default".into(), Value::String("deny".into()));
        }
        for (key, list) in [("allow", &self.allow), ("deny", &self.deny)] {
            if !list.is_empty() {
                o.insert(key.into(), list.iter().map(target).collect());
            }
        }
        if !self.http.is_empty() {
            let rules = self.http.iter().map(|r| {
                let mut rule = Map::new();
                rule.insert("host".into(), Value::String(r.host.as_text()));
                if !r.methods.is_empty() {
                    rule.insert("methods".into(), r.methods.clone().into());
                }
                if !r.paths.is_empty() {
                    rule.insert("paths".into(), r.paths.clone().into());
                }
                Value::Object(rule)
            });
            o.insert("http".into(), rules.collect());
        }
        if !self.inject.is_empty() {
            let rules = self.inject.iter().map(|r| {
                serde_json::json!({
                    "host": r.host.as_text(),
                    "secret": r.secret,
                    "header": r.header,
                    "value": r.value,
                })
            });
            o.insert("inject".into(), rules.collect());
        }
        if !self.deny_ports.is_empty() {
            o.insert("deny_ports".into(), self.deny_ports.clone().into());
        }
        Value::Object(o)
    }

    /// The verdict for a DNS name (any case, a trailing dot or not).
    pub fn name(&self, host: &str) -> Verdict {
        let host = normal_host(host);
        // Level: 0 for `*`, 1 + labels of the suffix for `*.suffix`, u32::MAX for the name.
        let level = |t: &Target| -> Option<u32> {
            match t {
                Target::Any => Some(0),
                Target::Name(n) if *n == host => Some(u32::MAX),
                Target::Suffix(s) if is_under(&host, s) => Some(1 + s.split('.').count() as u32),
                _ => None,
            }
        };
        self.decide(level)
    }

    /// The verdict for an address (the always-refused ranges are the node's, not here).
    pub fn ip(&self, ip: IpAddr) -> Verdict {
        let level = |t: &Target| -> Option<u32> {
            match t {
                Target::Any => Some(0),
                Target::Net(n) if n.contains(&ip) => Some(1 + u32::from(n.prefix_len())),
                _ => None,
            }
        };
        self.decide(level)
    }

    fn decide(&self, level: impl Fn(&Target) -> Option<u32>) -> Verdict {
        let best = |list: &[Target]| list.iter().filter_map(&level).max();
        match (best(&self.allow), best(&self.deny)) {
            (None, None) => self.fallback(),
            (Some(_), None) => Verdict::Allow,
            (None, Some(_)) => Verdict::Deny,
            (Some(a), Some(d)) if a >= d => Verdict::Allow,
            _ => Verdict::Deny,
        }
    }

    fn fallback(&self) -> Verdict {
        if self.default_deny {
            Verdict::Deny
        } else {
            Verdict::Allow
        }
    }

    /// Whether some name may be refused (the node then answers DNS for the sandbox by the
    /// rules and checks ports 80/443 by Host/SNI at its proxy).
    pub fn restricts_names(&self) -> bool {
        self.default_deny
            || self
                .deny
                .iter()
                .any(|t| matches!(t, Target::Any | Target::Name(_) | Target::Suffix(_)))
    }

    /// Whether the sandbox's TCP to ports 80 and 443 goes through the node's egress proxy.
    pub fn proxied(&self) -> bool {
        self.restricts_names() || !self.http.is_empty() || !self.inject.is_empty()
    }

    /// Whether the proxy reads (and for HTTPS terminates) requests to `host`: it has an
    /// `http` or an `inject` rule.
    pub fn inspects(&self, host: &str) -> bool {
        let host = normal_host(host);
        self.http.iter().any(|r| r.host.matches(&host))
            || self.inject.iter().any(|r| r.host.matches(&host))
    }

    /// Whether a request `method path` to `host` passes the `http` rules (true where no rule
    /// names the host). Where one does, a path not in its normal form ([`normal_path`]) or a
    /// method not in upper case does not pass.
    pub fn http_allows(&self, host: &str, method: &str, path: &str) -> bool {
        let host = normal_host(host);
        let mut rules = self
            .http
            .iter()
            .filter(|r| r.host.matches(&host))
            .peekable();
        if rules.peek().is_none() {
            return true;
        }
        let path = path.split('?').next().unwrap_or(path);
        // What the rule sees is what the server gets: a path that a server would read as
        // another (dot segments, encoded dots or slashes) is refused, not matched.
        // (`*` alone is the asterisk form of `OPTIONS *`, no path at all.)
        if path != "*" && normal_path(path).as_deref() != Ok(path) {
            return false;
        }
        // A method is a case-sensitive token: `get` is not `GET`, but a lenient server
        // might read it so.
        if !is_upper_token(method) {
            return false;
        }
        rules.any(|r| {
            (r.methods.is_empty() || r.methods.iter().any(|m| m == method))
                && (r.paths.is_empty() || r.paths.iter().any(|p| glob(p, path)))
        })
    }

    /// The injects for `host`, in order (a later one for the same header wins).
    pub fn injects_for<'a>(&'a self, host: &str) -> impl Iterator<Item = &'a Inject> + 'a {
        let host = normal_host(host);
        self.inject.iter().filter(move |r| r.host.matches(&host))
    }

    /// The IPv4 space cut into the ranges (first, last) whose verdict is not the default's:
    /// with `default_deny` the ranges allowed, else the ranges refused; adjacent ranges
    /// joined. What the kernel's rules are made of.
    pub fn exceptions4(&self) -> Vec<(Ipv4Addr, Ipv4Addr)> {
        let mut bounds: Vec<u64> = vec![0, 1 << 32];
        let nets: Vec<ipnet::Ipv4Net> = self
            .allow
            .iter()
            .chain(&self.deny)
            .filter_map(|t| match t {
                Target::Net(ipnet::IpNet::V4(n)) => Some(*n),
                _ => None,
            })
            .collect();
        for n in &nets {
            bounds.push(u64::from(u32::from(n.network())));
            bounds.push(u64::from(u32::from(n.broadcast())) + 1);
        }
        bounds.sort_unstable();
        bounds.dedup();
        let want = if self.default_deny {
            Verdict::Allow
        } else {
            Verdict::Deny
        };
        let mut out: Vec<(u64, u64)> = Vec::new();
        for w in bounds.windows(2) {
            let (lo, hi) = (w[0], w[1] - 1);
            let Ok(lo32) = u32::try_from(lo) else {
                continue;
            };
            if self.ip(IpAddr::V4(Ipv4Addr::from(lo32))) != want {
                continue;
            }
            match out.last_mut() {
                Some(last) if last.1 + 1 == lo => last.1 = hi,
                _ => out.push((lo, hi)),
            }
        }
        out.into_iter()
            .filter_map(|(lo, hi)| {
                Some((
                    Ipv4Addr::from(u32::try_from(lo).ok()?),
                    Ipv4Addr::from(u32::try_from(hi).ok()?),
                ))
            })
            .collect()
    }
}

/// Why a request path has no normal form.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("the path does not start with /")]
    NotAbsolute,
    #[error("the path holds a character a path may not hold")]
    BadChar,
    #[error("the path holds a % not followed by two hex digits")]
    BadEscape,
    #[error("the path holds an encoded / or \\")]
    EncodedSlash,
    #[error("the path climbs above /")]
    AboveRoot,
}

/// Whether `m` is an HTTP method token in upper case (letters upper-case, no others).
fn is_upper_token(m: &str) -> bool {
    is_token(m) && !m.bytes().any(|b| b.is_ascii_lowercase())
}

/// A request path (no query) in the form a server reads it (RFC 3986 6.2.2): percent-encoded
/// unreserved characters decoded, other escapes in upper-case hex, `.` and `..` segments
/// resolved (a segment is a dot segment also with `;` parameters after it, `..;`, as some
/// servers read it). Refused: an encoded `/` or `\\` (servers split on them or not), a
/// `\\`, a byte a path may not hold, a bad escape, a path that climbs above `/`.
pub fn normal_path(path: &str) -> Result<String, PathError> {
    if !path.starts_with('/') {
        return Err(PathError::NotAbsolute);
    }
    // Escapes decoded where unreserved; each segment as text.
    let b = path.as_bytes();
    let mut decoded = String::with_capacity(path.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'%' {
            let hex = |x: u8| (x as char).to_digit(16);
            let (Some(h), Some(l)) = (
                b.get(i + 1).copied().and_then(hex),
                b.get(i + 2).copied().and_then(hex),
            ) else {
                return Err(PathError::BadEscape);
            };
            let v = (h * 16 + l) as u8;
            if v == b'/' || v == b'\\' {
                return Err(PathError::EncodedSlash);
            }
            if v.is_ascii_alphanumeric() || b"-._~".contains(&v) {
                decoded.push(v as char);
            } else {
                decoded.push_str(&format!("%{v:02X}"));
            }
            i += 3;
            continue;
        }
        // pchar / "/": unreserved, sub-delims, ':' and '@'.
        if !(c.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@/".contains(&c)) {
            return Err(PathError::BadChar);
        }
        decoded.push(c as char);
        i += 1;
    }
    let mut out: Vec<&str> = Vec::new();
    let segments: Vec<&str> = decoded[1..].split('/').collect();
    let last = segments.len() - 1;
    for (n, seg) in segments.iter().enumerate() {
        let name = seg.split(';').next().unwrap_or(seg);
        match name {
            "." => {
                if n == last {
                    out.push("");
                }
            }
            ".." => {
                if out.pop().is_none() {
                    return Err(PathError::AboveRoot);
                }
                if n == last {
                    out.push("");
                }
            }
            _ => out.push(seg),
        }
    }
    Ok(format!("/{}", out.join("/")))
}

/// `pattern` with `*` as any run of characters, matched against all of `s`.
pub fn glob(pattern: &str, s: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == s;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !s.starts_with(first) || s.len() < first.len() + last.len() || !s.ends_with(last) {
        return false;
    }
    let mut rest = &s[first.len()..s.len() - last.len()];
    for mid in &parts[1..parts.len() - 1] {
        match rest.find(mid) {
            Some(at) => rest = &rest[at + mid.len()..],
            None => return false,
        }
    }
    true
}

/// A PATCH's merge: each key of `patch` replaces the same key of `base`, a null removes it;
/// null or an empty result is no rules (`None`).
pub fn merge(base: Option<&Value>, patch: &Value) -> Option<Value> {
    let p = patch.as_object()?;
    let mut out = base.and_then(Value::as_object).cloned().unwrap_or_default();
    for (k, v) in p {
        if v.is_null() {
            out.remove(k);
        } else {
            out.insert(k.clone(), v.clone());
        }
    }
    (!out.is_empty()).then_some(Value::Object(out))
}

/// A rule of `http` as given.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HttpRuleGiven {
    pub host: String,
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub methods: Field<Vec<String>>,
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub paths: Field<Vec<String>>,
}

/// A rule of `inject` as given.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InjectGiven {
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub header: Field<String>,
    pub host: String,
    pub secret: String,
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub value: Field<String>,
}

/// A sandbox's egress rules as the calls gave them: each part absent, null or as written, so
/// that they are shown back as given (`egress` of the sandbox object) and a PATCH replaces
/// the parts it gives ([`EgressRules::merge`]). [`EgressRules::from_value`] checks them;
/// [`EgressRules::rules`] are the rules in force. Keys in name order (as the API has always
/// written them).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressRules {
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub allow: Field<Vec<String>>,
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub default: Field<Verdict>,
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub deny: Field<Vec<String>>,
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub deny_ports: Field<Vec<u16>>,
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub http: Field<Vec<HttpRuleGiven>>,
    #[serde(default, skip_serializing_if = "Field::is_absent")]
    pub inject: Field<Vec<InjectGiven>>,
}

impl EgressRules {
    /// Rules as a call gives them (`egress` of a create or a run), checked as [`Egress::parse`]
    /// checks them (400 invalid_egress naming the part at fault).
    pub fn from_value(v: &Value) -> Result<EgressRules, ApiError> {
        Egress::parse(v)?;
        serde_json::from_value(v.clone())
            .map_err(|e| bad("egress", &format!("cannot be kept: {e}")))
    }

    /// The rules as given, as JSON (what the sandbox object shows).
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).unwrap_or_else(|_| Value::Object(Map::new()))
    }

    /// The rules in force: these, where they give no `default` the node's (`default_deny`).
    pub fn rules(&self, default_deny: bool) -> Result<Egress, ApiError> {
        let mut v = self.to_value();
        if let Some(obj) = v.as_object_mut() {
            if default_deny && obj.get("default").is_none_or(Value::is_null) {
                obj.insert("default".into(), Value::from("deny"));
            }
        }
        Egress::parse(&v)
    }

    /// A PATCH's `egress` keys merged into `base` ([`merge`]): each key given replaces the
    /// part, each given as null removes it; `None` when no part is left. The rules as merged
    /// are checked (400 invalid_egress).
    pub fn merge(
        base: Option<&EgressRules>,
        patch: &Map<String, Value>,
    ) -> Result<Option<EgressRules>, ApiError> {
        let base = base.map(EgressRules::to_value);
        merge(base.as_ref(), &Value::Object(patch.clone()))
            .map(|v| EgressRules::from_value(&v))
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn e(v: Value) -> Egress {
        Egress::parse(&v).expect("rules")
    }
    fn err(v: Value) -> String {
        Egress::parse(&v)
            .expect_err("refused")
            .param
            .unwrap_or_default()
    }
    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn bad_rules_name_their_part() {
        assert_eq!(
            err(json!({"allow": ["ok.com", "bad name"]})),
            "egress.allow[1]"
        );
        assert_eq!(err(json!({"deny": ["10.0.0.0/33"]})), "egress.deny[0]");
        assert_eq!(err(json!({"deny": [5]})), "egress.deny[0]");
        assert_eq!(
            err(json!({"http": [{"host": "a.com", "methods": ["G T"]}]})),
            "egress.http[0].methods[0]"
        );
        assert_eq!(
            err(json!({"http": [{"methods": ["GET"]}]})),
            "egress.http[0].host"
        );
        assert_eq!(
            err(json!({"http": [{"host": "a.com", "x": 1}]})),
            "egress.http[0].x"
        );
        assert_eq!(
            err(json!({"inject": [{"host": "a.com"}]})),
            "egress.inject[0].secret"
        );
        assert_eq!(
            err(json!({"inject": [{"host": "a.com", "secret": "k", "value": "no"}]})),
            "egress.inject[0].value"
        );
        assert_eq!(
            err(json!({"inject": [{"host": "a.com", "secret": "k", "header": "Host"}]})),
            "egress.inject[0].header"
        );
        assert_eq!(
            err(json!({"inject": [{"host": "1.2.3.4", "secret": "k"}]})),
            "egress.inject[0].host"
        );
        assert_eq!(err(json!({"deny_ports": [0]})), "egress.deny_ports[0]");
        assert_eq!(err(json!({"default": "maybe"})), "egress.default");
        assert_eq!(err(json!({"rules": []})), "egress.rules");
        assert_eq!(err(json!([])), "egress");
    }

    #[test]
    fn more_specific_wins_and_allow_wins_a_tie() {
        let r = e(
            json!({"default": "deny", "allow": ["*.example.com", "203.0.113.0/24"],
                          "deny": ["bad.example.com", "203.0.113.9"]}),
        );
        assert_eq!(r.name("api.example.com"), Verdict::Allow);
        assert_eq!(r.name("API.Example.com."), Verdict::Allow);
        assert_eq!(r.name("bad.example.com"), Verdict::Deny);
        assert_eq!(r.name("example.com"), Verdict::Deny, "*.name is not name");
        assert_eq!(r.name("other.org"), Verdict::Deny);
        assert_eq!(r.ip(ip("203.0.113.7")), Verdict::Allow);
        assert_eq!(r.ip(ip("203.0.113.9")), Verdict::Deny);
        assert_eq!(r.ip(ip("198.51.100.1")), Verdict::Deny);
        let tie = e(json!({"allow": ["a.com", "10.0.0.0/8"], "deny": ["a.com", "10.0.0.0/8"]}));
        assert_eq!(tie.name("a.com"), Verdict::Allow);
        assert_eq!(tie.ip(ip("10.1.1.1")), Verdict::Allow);
        let star = e(json!({"allow": ["pypi.org"], "deny": ["*"]}));
        assert_eq!(star.name("pypi.org"), Verdict::Allow);
        assert_eq!(star.name("evil.org"), Verdict::Deny);
        assert_eq!(star.ip(ip("1.1.1.1")), Verdict::Deny);
        assert!(star.restricts_names() && star.proxied());
        let open = e(json!({"deny": ["198.51.100.0/24"]}));
        assert!(!open.restricts_names() && !open.proxied());
    }

    #[test]
    fn exceptions_cover_exactly_the_other_verdict() {
        let r = e(
            json!({"default": "deny", "allow": ["203.0.113.0/24", "198.51.100.5"],
                          "deny": ["203.0.113.128/25"]}),
        );
        let a = |s: &str| s.parse::<Ipv4Addr>().expect("v4");
        assert_eq!(
            r.exceptions4(),
            vec![
                (a("198.51.100.5"), a("198.51.100.5")),
                (a("203.0.113.0"), a("203.0.113.127"))
            ]
        );
        let allow_all = e(json!({}));
        assert!(allow_all.exceptions4().is_empty());
        let deny_all = e(json!({"deny": ["*"]}));
        assert_eq!(
            deny_all.exceptions4(),
            vec![(a("0.0.0.0"), a("255.255.255.255"))]
        );
    }

    #[test]
    fn http_rules_and_injects() {
        let r = e(
            json!({"http": [{"host": "api.example.com", "methods": ["get"], "paths": ["/v1/*"]}],
                          "inject": [{"host": "*.example.com", "secret": "tok", "value": "Bearer {secret}"}]}),
        );
        assert!(r.http_allows("api.example.com", "GET", "/v1/models?x=1"));
        assert!(!r.http_allows("api.example.com", "POST", "/v1/models"));
        assert!(!r.http_allows("api.example.com", "GET", "/v2/x"));
        assert!(r.http_allows("other.com", "DELETE", "/"));
        let inj: Vec<_> = r.injects_for("a.example.com").collect();
        assert_eq!(inj.len(), 1);
        assert_eq!(inj[0].header, "authorization");
        assert!(
            r.inspects("api.example.com")
                && r.inspects("x.example.com")
                && !r.inspects("example.com")
        );
        assert!(glob("/a/*/c", "/a/b/c") && !glob("/a/*/c", "/a/b/d") && glob("*", "/x"));
    }

    #[test]
    fn paths_are_matched_in_normal_form_only() {
        let r = e(
            json!({"http": [{"host": "api.example.com", "methods": ["GET"], "paths": ["/v1/*"]}]}),
        );
        for bad in [
            "/v1/../admin",
            "/v1/%2e%2e/admin",
            "/v1/%2E%2E/admin",
            "/v1/..%2fadmin",
            "/v1/x/../../admin",
            "/v1/./x",
            "/v1/..;/admin",
            "/v1/%2fadmin",
            "/v1/%5cadmin",
            "/v1\\..\\admin",
            "/v1/%61",
            "/v1/%zz",
        ] {
            assert!(!r.http_allows("api.example.com", "GET", bad), "{bad}");
        }
        assert!(r.http_allows("api.example.com", "GET", "/v1/models"));
        assert!(r.http_allows("api.example.com", "GET", "/v1/a%20b"));
        let any = e(json!({"http": [{"host": "api.example.com", "paths": ["*"]}]}));
        assert!(any.http_allows("api.example.com", "OPTIONS", "*"));
        assert!(!any.http_allows("api.example.com", "GET", "/a/../b"));
        assert!(!r.http_allows("api.example.com", "get", "/v1/models"));
        assert!(!r.http_allows("api.example.com", "Get", "/v1/models"));
        // Hosts without rules are not read.
        assert!(r.http_allows("other.com", "get", "/x/../y"));

        assert_eq!(normal_path("/v1/../admin").as_deref(), Ok("/admin"));
        assert_eq!(normal_path("/v1/%2e%2e/admin").as_deref(), Ok("/admin"));
        assert_eq!(normal_path("/v1/x/../../admin").as_deref(), Ok("/admin"));
        assert_eq!(normal_path("/a/./b/.").as_deref(), Ok("/a/b/"));
        assert_eq!(normal_path("/a/b/..").as_deref(), Ok("/a/"));
        assert_eq!(normal_path("/%7euser/%3f").as_deref(), Ok("/~user/%3F"));
        assert_eq!(normal_path("/").as_deref(), Ok("/"));
        assert_eq!(normal_path("/v1/..%2fadmin"), Err(PathError::EncodedSlash));
        assert_eq!(normal_path("/v1/%5C"), Err(PathError::EncodedSlash));
        assert_eq!(normal_path("/.."), Err(PathError::AboveRoot));
        assert_eq!(normal_path("/a/../../b"), Err(PathError::AboveRoot));
        assert_eq!(normal_path("/a%2"), Err(PathError::BadEscape));
        assert_eq!(normal_path("/a\\b"), Err(PathError::BadChar));
        assert_eq!(normal_path("/a b"), Err(PathError::BadChar));
        assert_eq!(normal_path("a/b"), Err(PathError::NotAbsolute));
    }

    #[test]
    fn merge_is_key_by_key() {
        let base = json!({"default": "deny", "allow": ["a.com"]});
        assert_eq!(
            merge(
                Some(&base),
                &json!({"allow": ["b.com"], "deny_ports": [25]})
            ),
            Some(json!({"default": "deny", "allow": ["b.com"], "deny_ports": [25]}))
        );
        assert_eq!(
            merge(Some(&base), &json!({"default": null, "allow": null})),
            None
        );
        assert_eq!(
            merge(None, &json!({"default": "deny"})),
            Some(json!({"default": "deny"}))
        );
    }

    #[test]
    fn rules_as_given_are_kept_as_given() {
        let given = json!({
            "allow": ["API.example.com", "10.0.0.0/8"], "deny": null, "deny_ports": [25, 25],
            "http": [{"host": "api.example.com", "methods": null}],
            "inject": [{"host": "*.example.com", "secret": "tok", "header": null}]
        });
        let r = EgressRules::from_value(&given).unwrap();
        // Shown back as given: case, nulls and repeats kept; written with sorted keys.
        assert_eq!(r.to_value(), given);
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            serde_json::to_string(&given).unwrap()
        );
        assert_eq!(r.deny, Field::Null);
        assert!(r.default.is_absent());
        // In force: parsed, the node's default where the rules give none.
        let e = r.rules(true).unwrap();
        assert!(e.default_deny);
        assert_eq!(e.deny_ports, vec![25]);
        assert_eq!(e.inject[0].header, "authorization");
        assert!(!r.rules(false).unwrap().default_deny);
        let allow = EgressRules::from_value(&json!({"default": "allow"})).unwrap();
        assert!(!allow.rules(true).unwrap().default_deny);
        // Refused as Egress::parse refuses.
        let e = EgressRules::from_value(&json!({"allow": ["bad name"]})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("egress.allow[0]"));
        // A PATCH's keys.
        let patch = json!({"allow": null, "deny_ports": [22]});
        let merged = EgressRules::merge(Some(&r), patch.as_object().unwrap())
            .unwrap()
            .unwrap();
        assert!(merged.allow.is_absent());
        assert_eq!(merged.deny_ports, Field::Value(vec![22]));
        let only = EgressRules::from_value(&json!({"allow": ["a.com"]})).unwrap();
        let none = json!({"allow": null});
        assert_eq!(
            EgressRules::merge(Some(&only), none.as_object().unwrap()).unwrap(),
            None
        );
    }
}
