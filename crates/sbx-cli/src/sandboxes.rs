//! `sbx create | ls | exec | logs | rm | restart | url`.

use std::io::{BufRead, BufReader, Read, Write};
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use serde_json::{json, Map, Value};

use crate::{agent, api_error, ensure_node, parse_memory, Cli};

#[derive(clap::Args, Debug)]
pub struct CreateArgs {
    /// Name of the sandbox.
    #[arg(long)]
    name: Option<String>,
    /// Image or catalog name (python, node); default: the node's base image.
    #[arg(long)]
    image: Option<String>,
    /// Environment variable, K=V (repeatable).
    #[arg(short = 'e', long = "env", value_name = "K=V")]
    env: Vec<String>,
    /// Metadata, K=V (repeatable).
    #[arg(long = "metadata", value_name = "K=V")]
    metadata: Vec<String>,
    /// A volume to mount: VOLUME:/PATH[:ro][,copy] (repeatable).
    #[arg(short = 'v', long = "volume", value_name = "VOLUME:/PATH[:ro]")]
    volumes: Vec<String>,
    /// Memory limit: bytes, or with a unit (512m, 1g).
    #[arg(long)]
    memory: Option<String>,
    /// vCPUs.
    #[arg(long)]
    cpus: Option<u32>,
    /// A start command (a line for sh -c), kept running as exe-start.
    #[arg(long, conflicts_with_all = ["image_start", "no_start"])]
    start: Option<String>,
    /// Start the image's own start command (its ENTRYPOINT and CMD).
    #[arg(long, conflicts_with = "no_start")]
    image_start: bool,
    /// Start nothing, whatever the image's labels ask for.
    #[arg(long)]
    no_start: bool,
    /// When the sandbox counts as up: tcp:PORT, http:PORT[/PATH] (tried from the host) or
    /// cmd:LINE (run in the sandbox by sh).
    #[arg(long, value_name = "CHECK")]
    ready: Option<String>,
    /// Make it from a template of the node (a key of `GET /internal/node`: base, img-…).
    #[arg(long)]
    template: Option<String>,
    /// Make it from a snapshot (id or name, `sbx snapshot --ls`): it goes on from the instant
    /// the snapshot was taken, processes included.
    #[arg(long, conflicts_with_all = ["image", "template"])]
    snapshot: Option<String>,
    /// The secret holding the image registry's login (`sbx` secrets: PUT /v1/secrets/NAME).
    #[arg(long, value_name = "SECRET")]
    pull_secret: Option<String>,
    /// Build the template of these settings ahead and keep no sandbox (POST
    /// /internal/templates); prints the template's key once it is built.
    #[arg(long, conflicts_with_all = ["name", "metadata", "template"])]
    template_only: bool,
    /// Answer at once, while the sandbox may still be starting (its image pulled, its check
    /// waited for); by default sbx waits until it is running or failed.
    #[arg(long)]
    no_wait: bool,
    /// A port anybody may open at the sandbox's preview URL, without its token (repeatable).
    #[arg(long = "public-port", value_name = "PORT",
          value_parser = clap::value_parser!(u16).range(1..))]
    public_ports: Vec<u16>,
    /// Print the sandbox object as JSON.
    #[arg(long)]
    json: bool,
}

/// `sbx url`.
#[derive(clap::Args, Debug)]
pub struct UrlArgs {
    /// The sandbox (id or name).
    sandbox: String,
    /// The port of the sandbox.
    #[arg(value_parser = clap::value_parser!(u16).range(1..))]
    port: u16,
    /// Leave the sandbox's token out (for a public port).
    #[arg(long)]
    no_token: bool,
}

/// `--ready`: `tcp:PORT`, `http:PORT[/PATH]`, `cmd:LINE`.
fn ready_check(s: &str) -> anyhow::Result<Value> {
    let port = |p: &str| -> anyhow::Result<u16> {
        p.parse::<u16>()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| anyhow!("--ready: {p:?} is not a port (1-65535)"))
    };
    match s.split_once(':') {
        Some(("tcp", p)) => Ok(json!({ "tcp": { "port": port(p)? } })),
        Some(("http", rest)) => {
            let (p, path) = match rest.find('/') {
                Some(i) => (&rest[..i], &rest[i..]),
                None => (rest, "/"),
            };
            Ok(json!({ "http": { "port": port(p)?, "path": path } }))
        }
        Some(("cmd", line)) if !line.is_empty() => Ok(json!({ "command": line })),
        _ => bail!("--ready takes tcp:PORT, http:PORT[/PATH] or cmd:LINE"),
    }
}

#[derive(clap::Args, Debug)]
pub struct LsArgs {
    /// Only sandboxes in this status.
    #[arg(long)]
    status: Option<String>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// How a command runs: the options `sbx run` and `sbx exec` share.
#[derive(clap::Args, Debug)]
pub struct CommandOpts {
    /// Environment variable, K=V (repeatable).
    #[arg(short = 'e', long = "env", value_name = "K=V")]
    pub env: Vec<String>,
    /// Directory to run in.
    #[arg(long)]
    pub cwd: Option<String>,
    /// User to run as (name, uid or uid:gid).
    #[arg(long, short = 'u')]
    pub user: Option<String>,
    /// Seconds before the command is killed.
    #[arg(long)]
    pub timeout: Option<f64>,
}

impl CommandOpts {
    /// Writes these options into a request body.
    pub fn write(&self, body: &mut Map<String, Value>) -> anyhow::Result<()> {
        if !self.env.is_empty() {
            body.insert("env".into(), Value::Object(kv_map(&self.env, "-e")?));
        }
        if let Some(c) = &self.cwd {
            body.insert("cwd".into(), json!(c));
        }
        if let Some(u) = &self.user {
            body.insert("user".into(), json!(u));
        }
        if let Some(t) = self.timeout {
            body.insert("timeout_seconds".into(), json!(t));
        }
        Ok(())
    }
}

#[derive(clap::Args, Debug)]
pub struct ExecArgs {
    /// Start the command and print its id, without waiting.
    #[arg(short = 'd', long)]
    detach: bool,
    /// Interactive terminal (a PTY, stdin attached).
    #[arg(short = 'i', long)]
    interactive: bool,
    /// With -i: allocate a terminal.
    #[arg(short = 't', long)]
    tty: bool,
    #[command(flatten)]
    opts: CommandOpts,
    /// Print the exec object as JSON.
    #[arg(long)]
    json: bool,
    /// The sandbox (id or name).
    sandbox: String,
    /// The command: one argument is a line for sh -c, several run without a shell.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

#[derive(clap::Args, Debug)]
pub struct LogsArgs {
    /// Follow the output until the command ends.
    #[arg(short = 'f', long)]
    follow: bool,
    /// The sandbox (id or name).
    sandbox: String,
    /// The command's id (exe-…, exe-start for the start command).
    exec: String,
}

#[derive(clap::Args, Debug)]
pub struct RmArgs {
    /// Sandboxes (ids or names).
    #[arg(required = true)]
    sandboxes: Vec<String>,
    /// Print the deleted sandboxes' objects as a JSON list.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
pub struct RestartArgs {
    /// The sandbox (id or name).
    sandbox: String,
    /// Print the sandbox object as JSON.
    #[arg(long)]
    json: bool,
}

fn url(cli: &Cli, path: &str) -> String {
    format!("{}{path}", cli.url.trim_end_matches('/'))
}

pub(crate) fn req(cli: &Cli, method: &str, path: &str) -> ureq::Request {
    let mut r = agent().request(method, &url(cli, path));
    if let Some(k) = &cli.api_key {
        r = r.set("authorization", &format!("Bearer {k}"));
    }
    r
}

fn kv_map(items: &[String], what: &str) -> anyhow::Result<Map<String, Value>> {
    let mut m = Map::new();
    for kv in items {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| anyhow!("{what} takes K=V, got {kv:?}"))?;
        m.insert(k.into(), json!(v));
    }
    Ok(m)
}

fn command_value(command: &[String]) -> Value {
    if command.len() == 1 {
        json!(command[0])
    } else {
        json!(command)
    }
}

pub fn create(cli: &Cli, a: &CreateArgs) -> anyhow::Result<u8> {
    ensure_node(cli)?;
    let mut body = Map::new();
    if let Some(n) = &a.name {
        body.insert("name".into(), json!(n));
    }
    if let Some(i) = &a.image {
        body.insert("image".into(), json!(i));
    }
    if !a.env.is_empty() {
        body.insert("env".into(), Value::Object(kv_map(&a.env, "-e")?));
    }
    if !a.metadata.is_empty() {
        body.insert(
            "metadata".into(),
            Value::Object(kv_map(&a.metadata, "--metadata")?),
        );
    }
    if let Some(v) = crate::volumes::mounts(&a.volumes)? {
        body.insert("volumes".into(), v);
    }
    let mut limits = Map::new();
    if let Some(m) = &a.memory {
        limits.insert("memory_bytes".into(), json!(parse_memory(m)?));
    }
    if let Some(c) = a.cpus {
        limits.insert("vcpus".into(), json!(c));
    }
    if !limits.is_empty() {
        body.insert("limits".into(), Value::Object(limits));
    }
    if let Some(s) = &a.start {
        body.insert("start_command".into(), json!(s));
    }
    if a.image_start {
        body.insert("start".into(), json!(true));
    }
    if a.no_start {
        body.insert("start".into(), json!(false));
    }
    if let Some(r) = &a.ready {
        body.insert("ready".into(), ready_check(r)?);
    }
    if let Some(s) = &a.snapshot {
        body.insert("snapshot".into(), json!(s));
    }
    if let Some(t) = &a.template {
        body.insert("template".into(), json!(t));
    }
    if let Some(p) = &a.pull_secret {
        body.insert("image_pull_secret".into(), json!(p));
    }
    if !a.public_ports.is_empty() {
        body.insert("public_ports".into(), json!(a.public_ports));
    }
    if a.template_only {
        return build_template(cli, a, Value::Object(body));
    }
    let mut obj: Value = req(cli, "POST", "/v1/sandboxes")
        .send_json(Value::Object(body))
        .map_err(api_error)?
        .into_json()?;
    if !a.no_wait && obj["status"] == "starting" {
        obj = wait_started(cli, &obj)?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&obj)?);
    } else {
        println!("{}", obj["id"].as_str().unwrap_or(""));
        if obj["status"] == "failed" {
            eprintln!(
                "sbx: the sandbox failed: {} ({})",
                obj["failure"].as_str().unwrap_or(""),
                obj["failure_code"].as_str().unwrap_or("")
            );
            return Ok(1);
        }
    }
    Ok(0)
}

/// `sbx create --template-only`: the template of these settings, built ahead.
fn build_template(cli: &Cli, a: &CreateArgs, body: Value) -> anyhow::Result<u8> {
    let mut t: Value = req(cli, "POST", "/internal/templates")
        .send_json(body)
        .map_err(api_error)?
        .into_json()?;
    let key = t["key"].as_str().unwrap_or_default().to_string();
    let started = std::time::Instant::now();
    while t["status"] == "building" && !a.no_wait {
        if started.elapsed() > Duration::from_secs(1) {
            eprint!(
                "\r{key}: building (its image pulled, its check) {} s",
                started.elapsed().as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
        let all: Value = req(cli, "GET", "/internal/templates")
            .call()
            .map_err(api_error)?
            .into_json()?;
        if let Some(now) = all["data"]
            .as_array()
            .and_then(|d| d.iter().find(|x| x["key"] == key.as_str()))
        {
            t = now.clone();
        }
    }
    if started.elapsed() > Duration::from_secs(1) {
        eprintln!();
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&t)?);
    } else {
        println!("{key}");
    }
    if t["status"] == "failed" {
        eprintln!(
            "sbx: the template failed: {} ({})",
            t["failure"].as_str().unwrap_or(""),
            t["failure_code"].as_str().unwrap_or("")
        );
        return Ok(1);
    }
    Ok(0)
}

/// Polls a `starting` sandbox until it is running or failed, saying on stderr that it waits.
fn wait_started(cli: &Cli, obj: &Value) -> anyhow::Result<Value> {
    let id = obj["id"].as_str().unwrap_or_default();
    let started = std::time::Instant::now();
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut said = false;
    loop {
        let v: Value = req(cli, "GET", &format!("/v1/sandboxes/{id}"))
            .call()
            .map_err(api_error)?
            .into_json()?;
        if v["status"] != "starting" {
            if said && tty {
                eprintln!();
            }
            return Ok(v);
        }
        let secs = started.elapsed().as_secs();
        if tty {
            eprint!("\r{id}: starting (its image pulled, its template built, its check) {secs} s");
            said = true;
        } else if !said {
            eprintln!("{id}: starting (its image pulled, its template built, its check)");
            said = true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

pub fn ls(cli: &Cli, a: &LsArgs) -> anyhow::Result<u8> {
    let mut all = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut r = req(cli, "GET", "/v1/sandboxes").query("limit", "1000");
        if let Some(s) = &a.status {
            r = r.query("status", s);
        }
        if let Some(c) = &cursor {
            r = r.query("cursor", c);
        }
        let page: Value = r.call().map_err(api_error)?.into_json()?;
        all.extend(page["data"].as_array().cloned().unwrap_or_default());
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => break,
        }
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(0);
    }
    println!(
        "{:<21} {:<20} {:<9} {:<8} {:<8} CREATED",
        "ID", "NAME", "STATUS", "IMAGE", "MEMORY"
    );
    for s in all {
        println!(
            "{:<21} {:<20} {:<9} {:<8} {:<8} {}",
            s["id"].as_str().unwrap_or(""),
            s["name"].as_str().unwrap_or("-"),
            s["status"].as_str().unwrap_or(""),
            s["image"].as_str().unwrap_or(""),
            format!(
                "{}M",
                s["limits"]["memory_bytes"].as_u64().unwrap_or(0) >> 20
            ),
            s["created_at"].as_str().unwrap_or("")
        );
    }
    Ok(0)
}

/// How an event stream ended.
pub enum StreamEnd {
    /// The exit event: the final exec object.
    Exit(Value),
    /// The stream dropped before its end (the last event id seen is in `last_id`).
    Dropped,
}

/// Prints a command's events (stdout to stdout, stderr to stderr) until its exit event.
pub fn print_events(reader: impl Read, last_id: &mut Option<u64>) -> anyhow::Result<StreamEnd> {
    let reader = BufReader::new(reader);
    let (mut out, mut err) = (std::io::stdout(), std::io::stderr());
    let mut event = String::new();
    for line in reader.lines() {
        let Ok(line) = line else {
            return Ok(StreamEnd::Dropped);
        };
        if let Some(e) = line.strip_prefix("event: ") {
            event = e.to_string();
        } else if let Some(id) = line.strip_prefix("id: ") {
            if let Ok(n) = id.trim().parse() {
                *last_id = Some(n);
            }
        } else if let Some(d) = line.strip_prefix("data: ") {
            let data: Value = serde_json::from_str(d).context("an event's data")?;
            match event.as_str() {
                "stdout" => {
                    out.write_all(data["data"].as_str().unwrap_or("").as_bytes())?;
                    out.flush()?;
                }
                "stderr" => {
                    err.write_all(data["data"].as_str().unwrap_or("").as_bytes())?;
                    err.flush()?;
                }
                "gap" => eprintln!(
                    "sbx: output from {} to {} is no longer kept",
                    data["from"], data["to"]
                ),
                "exit" => return Ok(StreamEnd::Exit(data)),
                "error" => {
                    let e = &data["error"];
                    bail!(
                        "{}: {}",
                        e["code"].as_str().unwrap_or("error"),
                        e["message"].as_str().unwrap_or("")
                    );
                }
                _ => {}
            }
        }
    }
    Ok(StreamEnd::Dropped)
}

/// The exit code `sbx` ends with for a final exec object.
pub fn exit_code(obj: &Value) -> u8 {
    match obj["status"].as_str() {
        Some("timed_out") => eprintln!("sbx: the command timed out"),
        Some("killed") => eprintln!(
            "sbx: the command was killed by {}",
            obj["signal"].as_str().unwrap_or("a signal")
        ),
        _ => {}
    }
    obj["exit_code"].as_i64().unwrap_or(125).clamp(0, 255) as u8
}

/// Follows a command's output from `from` to its end, reconnecting with Last-Event-ID when the
/// stream drops.
fn follow(cli: &Cli, sandbox: &str, exec: &str, from: u64) -> anyhow::Result<u8> {
    let mut last: Option<u64> = if from > 0 { Some(from) } else { None };
    let mut tries = 0;
    loop {
        let mut r = req(
            cli,
            "GET",
            &format!("/v1/sandboxes/{sandbox}/exec/{exec}/output"),
        )
        .set("accept", "text/event-stream");
        if let Some(id) = last {
            r = r.set("last-event-id", &id.to_string());
        }
        match r.call() {
            Ok(resp) => match print_events(resp.into_reader(), &mut last)? {
                StreamEnd::Exit(obj) => return Ok(exit_code(&obj)),
                StreamEnd::Dropped => {}
            },
            Err(ureq::Error::Transport(_)) => {}
            Err(e) => return Err(api_error(e)),
        }
        tries += 1;
        if tries > 30 {
            bail!("the node's stream kept dropping");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Follows a command's output from its start to its end.
pub fn follow_output(cli: &Cli, sandbox: &str, exec: &str) -> anyhow::Result<u8> {
    follow(cli, sandbox, exec, 0)
}

pub fn exec(cli: &Cli, a: &ExecArgs) -> anyhow::Result<u8> {
    if a.interactive || a.tty {
        return crate::terminal::run(cli, &a.sandbox, &a.command, a.tty);
    }
    let mut body = Map::new();
    body.insert("command".into(), command_value(&a.command));
    a.opts.write(&mut body)?;
    let obj: Value = req(cli, "POST", &format!("/v1/sandboxes/{}/exec", a.sandbox))
        .send_json(Value::Object(body))
        .map_err(api_error)?
        .into_json()?;
    let id = obj["id"].as_str().unwrap_or("").to_string();
    if a.detach {
        if a.json {
            println!("{}", serde_json::to_string_pretty(&obj)?);
        } else {
            println!("{id}");
        }
        return Ok(0);
    }
    if a.json {
        let fin: Value = loop {
            let o: Value = req(
                cli,
                "GET",
                &format!("/v1/sandboxes/{}/exec/{id}", a.sandbox),
            )
            .query("wait_seconds", "60")
            .call()
            .map_err(api_error)?
            .into_json()?;
            if o["status"] != "running" {
                break o;
            }
        };
        println!("{}", serde_json::to_string_pretty(&fin)?);
        return Ok(exit_code(&fin));
    }
    follow(cli, &a.sandbox, &id, 0)
}

pub fn logs(cli: &Cli, a: &LogsArgs) -> anyhow::Result<u8> {
    if a.follow {
        return follow(cli, &a.sandbox, &a.exec, 0);
    }
    let (mut out, mut err) = (std::io::stdout(), std::io::stderr());
    let mut from = 0u64;
    loop {
        let page: Value = req(
            cli,
            "GET",
            &format!("/v1/sandboxes/{}/exec/{}/output", a.sandbox, a.exec),
        )
        .query("from", &from.to_string())
        .call()
        .map_err(api_error)?
        .into_json()?;
        if let Some(g) = page["gap"].as_object() {
            eprintln!(
                "sbx: output from {} to {} is no longer kept",
                g["from"], g["to"]
            );
        }
        for c in page["chunks"].as_array().cloned().unwrap_or_default() {
            let data = c["data"].as_str().unwrap_or("");
            if c["stream"] == "stderr" {
                err.write_all(data.as_bytes())?;
            } else {
                out.write_all(data.as_bytes())?;
            }
        }
        let next = page["next"].as_u64().unwrap_or(from);
        if next <= from || next >= page["end"].as_u64().unwrap_or(0) {
            break;
        }
        from = next;
    }
    out.flush()?;
    Ok(0)
}

pub fn rm(cli: &Cli, a: &RmArgs) -> anyhow::Result<u8> {
    let mut code = 0;
    let mut gone = Vec::new();
    for s in &a.sandboxes {
        match req(cli, "DELETE", &format!("/v1/sandboxes/{s}")).call() {
            Ok(r) if a.json => gone.push(r.into_json::<Value>()?),
            Ok(_) => println!("{s}"),
            Err(e) => {
                eprintln!("sbx: {s}: {:#}", api_error(e));
                code = 1;
            }
        }
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&gone)?);
    }
    Ok(code)
}

pub fn restart(cli: &Cli, a: &RestartArgs) -> anyhow::Result<u8> {
    let obj: Value = req(cli, "POST", &format!("/v1/sandboxes/{}/restart", a.sandbox))
        .call()
        .map_err(api_error)?
        .into_json()?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&obj)?);
    } else {
        println!(
            "{} {}",
            obj["id"].as_str().unwrap_or(""),
            obj["status"].as_str().unwrap_or("")
        );
    }
    Ok(if obj["status"] == "running" { 0 } else { 1 })
}

/// `sbx url SANDBOX PORT`: the preview URL of a port of the sandbox, with `?sbx_token=` (its
/// token, which the preview listener trades for a cookie at the first visit).
pub fn url_cmd(cli: &Cli, a: &UrlArgs) -> anyhow::Result<u8> {
    let obj: Value = req(cli, "GET", &format!("/v1/sandboxes/{}", a.sandbox))
        .call()
        .map_err(api_error)?
        .into_json()?;
    let Some(template) = obj["preview_url"].as_str() else {
        bail!("the node's preview listener is off (sandboxd --preview-listen)");
    };
    let token = obj["token"].as_str().filter(|_| !a.no_token);
    println!("{}", preview_url(template, a.port, token));
    Ok(0)
}

/// The URL of `port` from a sandbox's `preview_url` (with `{port}`), with the token as
/// `?sbx_token=` when given.
fn preview_url(template: &str, port: u16, token: Option<&str>) -> String {
    let base = template.replace("{port}", &port.to_string());
    match token {
        Some(t) => format!("{base}/?sbx_token={t}"),
        None => format!("{base}/"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preview_urls_of_a_port() {
        let t = "http://{port}-sbx-a.localhost:7780";
        assert_eq!(
            preview_url(t, 8080, Some("sbt_1")),
            "http://8080-sbx-a.localhost:7780/?sbx_token=sbt_1"
        );
        assert_eq!(
            preview_url(t, 3000, None),
            "http://3000-sbx-a.localhost:7780/"
        );
    }

    #[test]
    fn ready_checks_read_as_the_api_takes_them() {
        assert_eq!(
            ready_check("tcp:8080").ok(),
            Some(json!({"tcp": {"port": 8080}}))
        );
        assert_eq!(
            ready_check("http:80/health?x=1").ok(),
            Some(json!({"http": {"port": 80, "path": "/health?x=1"}}))
        );
        assert_eq!(
            ready_check("http:80").ok(),
            Some(json!({"http": {"port": 80, "path": "/"}}))
        );
        assert_eq!(
            ready_check("cmd:test -f /tmp/up").ok(),
            Some(json!({"command": "test -f /tmp/up"}))
        );
        for bad in ["tcp:0", "tcp:70000", "http:x/", "cmd:", "udp:53", "8080"] {
            assert!(ready_check(bad).is_err(), "{bad}");
        }
    }
}
