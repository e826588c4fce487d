//! A [`RunRequest`] written back as the body it is parsed from: what a client sends. For every
//! request the parser gives, `parse_run_value(&r.to_json()) == Ok(r)` (the property tests of
//! `tests/wire.rs`). A field at its default is left out, as a caller who did not give it.

use serde_json::{json, Map, Value};

use super::limits::{ms_to_seconds, seconds_to_ms, DEFAULT_TIMEOUT_SECONDS};
use super::ms_of;
use super::types::{
    Command, Encoding, Limits, OnExpiry, Ready, RunRequest, Stop, Tmp, VolumeMount,
};

/// A command as a body writes it: a string for `sh -c`, a list of arguments otherwise.
pub(crate) fn command_value(c: &Command) -> Value {
    match c {
        Command::Shell(line) => Value::String(line.clone()),
        Command::Argv(args) => json!(args),
    }
}

/// A deadline of whole milliseconds as the `timeout_seconds` that parses back to it.
pub(crate) fn seconds_value(d: std::time::Duration) -> Value {
    json!(ms_to_seconds(ms_of(d)))
}

/// The input's bytes as `encoding` writes them (UTF-8 input that is not UTF-8 is replaced:
/// such a request is not one the parser gives; send it as base64).
pub(crate) fn stdin_value(bytes: &[u8], encoding: Encoding) -> Value {
    Value::String(encoding.encode(bytes))
}

fn ready_value(r: &Ready) -> Value {
    match r {
        Ready::Tcp { port } => json!({ "tcp": { "port": port } }),
        Ready::Http { port, path } => json!({ "http": { "port": port, "path": path } }),
        Ready::Command(c) => json!({ "command": command_value(c) }),
    }
}

fn stop_value(s: &Stop) -> Value {
    let mut o = Map::new();
    if let Some(sig) = &s.signal {
        o.insert("signal".into(), json!(sig));
    }
    if let Some(g) = s.grace_ms {
        o.insert("grace_ms".into(), json!(g));
    }
    Value::Object(o)
}

fn limits_value(l: &Limits) -> Option<Value> {
    let mut o = Map::new();
    if let Some(v) = l.vcpus {
        o.insert("vcpus".into(), json!(v));
    }
    if let Some(m) = l.memory_bytes {
        o.insert("memory_bytes".into(), json!(m));
    }
    (!o.is_empty()).then_some(Value::Object(o))
}

fn volume_value(v: &VolumeMount) -> Value {
    let mut o = Map::new();
    o.insert("path".into(), json!(v.path));
    o.insert("volume".into(), json!(v.volume));
    if v.read_only {
        o.insert("read_only".into(), Value::Bool(true));
    }
    if v.copy {
        o.insert("copy".into(), Value::Bool(true));
    }
    if let Some(version) = &v.version {
        o.insert("version".into(), version.clone());
    }
    Value::Object(o)
}

/// The name of a unit enum as serde writes it (`"memory"`, `"systemd"`, `"eu"`).
fn word<T: serde::Serialize>(x: T) -> Value {
    serde_json::to_value(x).unwrap_or(Value::Null)
}

impl RunRequest {
    /// This request as the JSON body of `POST /v1/run` that parses back to it (see the
    /// module's documentation). Fields at their defaults are left out.
    pub fn to_json(&self) -> Value {
        let mut o = Map::new();
        let mut put = |k: &str, v: Value| {
            o.insert(k.to_owned(), v);
        };
        put("command", command_value(&self.command));
        if let Some(b) = self.start {
            put("start", Value::Bool(b));
        }
        if let Some(c) = &self.start_command {
            put("start_command", command_value(c));
        }
        if let Some(r) = &self.ready {
            put("ready", ready_value(r));
        }
        if let Some(e) = &self.egress {
            put("egress", e.clone());
        }
        if let Some(b) = self.guest_mitigations {
            put("guest_mitigations", Value::Bool(b));
        }
        if self.tmp != Tmp::Disk {
            put("tmp", word(self.tmp));
        }
        if let Some(r) = &self.runtime {
            put("runtime", r.clone());
        }
        if let Some(i) = self.init {
            put("init", word(i));
        }
        if self.project_network {
            put("project_network", Value::Bool(true));
        }
        for (k, v) in [
            ("image", &self.image),
            ("image_pull_secret", &self.image_pull_secret),
            ("snapshot", &self.snapshot),
            ("template", &self.template),
        ] {
            if let Some(s) = v {
                put(k, json!(s));
            }
        }
        if let Some(l) = limits_value(&self.limits) {
            put("limits", l);
        }
        if let Some(n) = &self.name {
            put("name", json!(n));
        }
        if !self.env.is_empty() {
            put("env", json!(self.env));
        }
        if !self.metadata.is_empty() {
            put("metadata", json!(self.metadata));
        }
        if !self.volumes.is_empty() {
            put(
                "volumes",
                Value::Array(self.volumes.iter().map(volume_value).collect()),
            );
        }
        if !self.public_ports.is_empty() {
            put("public_ports", json!(self.public_ports));
        }
        if let Some(p) = &self.public_ports_except {
            put("public_ports_except", json!(p));
        }
        if let Some(i) = &self.inbound {
            put("inbound", i.clone());
        }
        match self.sleep_after_seconds {
            None => {}
            Some(None) => put("sleep_after_seconds", Value::Null),
            Some(Some(s)) => put("sleep_after_seconds", json!(s)),
        }
        if let Some(e) = &self.expires_at {
            put("expires_at", json!(e));
        }
        if self.on_expiry != OnExpiry::Delete {
            put("on_expiry", word(self.on_expiry));
        }
        if self.held_asleep {
            put("held_asleep", Value::Bool(true));
        }
        for (k, v) in [
            ("sleep_notice_ms", self.sleep_notice_ms),
            ("sleep_hold_max_ms", self.sleep_hold_max_ms),
            ("suspend_after_ms", self.suspend_after_ms),
        ] {
            if let Some(n) = v {
                put(k, json!(n));
            }
        }
        if let Some(w) = &self.wake_daily_at {
            put("wake_daily_at", json!(w));
        }
        if let Some(c) = &self.checkpoint {
            put("checkpoint", c.clone());
        }
        if let Some(n) = self.delete_after_idle_ms {
            put("delete_after_idle_ms", json!(n));
        }
        if let Some(h) = &self.hostname {
            put("hostname", json!(h));
        }
        if let Some(s) = &self.stop {
            put("stop", stop_value(s));
        }
        if !self.secret_env.0.is_empty() {
            put("secret_env", json!(self.secret_env.0));
        }
        if let Some(c) = &self.cwd {
            put("cwd", json!(c));
        }
        if let Some(u) = &self.user {
            put("user", json!(u));
        }
        if ms_of(self.timeout) != seconds_to_ms(DEFAULT_TIMEOUT_SECONDS) {
            put("timeout_seconds", seconds_value(self.timeout));
        }
        if let Some(s) = &self.stdin {
            put("stdin", stdin_value(s, self.encoding));
        }
        if self.encoding != Encoding::Utf8 {
            put("encoding", json!(self.encoding.as_str()));
        }
        if let Some(b) = self.stream {
            put("stream", Value::Bool(b));
        }
        if self.wait_for_reader {
            put("wait_for_reader", Value::Bool(true));
        }
        if let Some(r) = self.region {
            put("region", word(r));
        }
        Value::Object(o)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{parse_run_value, Command, RunRequest};
    use serde_json::json;

    #[test]
    fn a_bare_run_is_its_command() {
        let r = RunRequest::new(Command::Shell("echo hi".into()));
        assert_eq!(r.to_json(), json!({"command": "echo hi"}));
        assert_eq!(parse_run_value(&r.to_json()), Ok(r));
    }

    #[test]
    fn a_parsed_body_is_written_back_as_it_was_given() {
        let body = json!({
            "command": ["python3", "-c", "print(2+2)"],
            "image": "python:3.12",
            "limits": {"memory_bytes": 268435456},
            "env": {"A": "1"},
            "timeout_seconds": 2.007,
            "stream": false,
            "volumes": [{"path": "/data", "volume": "db", "read_only": true}],
            "sleep_after_seconds": null,
            "stop": {"signal": "SIGINT"},
        });
        let r = parse_run_value(&body).unwrap();
        assert_eq!(r.timeout.as_millis(), 2007);
        assert_eq!(r.to_json(), body);
    }
}
