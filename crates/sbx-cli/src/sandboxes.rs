//! `sbx create | ls | exec | logs | rm | restart | url`.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

use anyhow::{anyhow, bail};
use sbx_api::{Command, ExecObject, ExecRequest, ExecStatus, Ready, RunRequest, SandboxCreate};
use sbx_client::{Encoding, Error, ExecEvent, ExecEvents, SandboxQuery};

use crate::{command_of, ensure_node, limits_of, print_json, refused, Cli};

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
fn ready_check(s: &str) -> anyhow::Result<Ready> {
    let port = |p: &str| -> anyhow::Result<u16> {
        p.parse::<u16>()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| anyhow!("--ready: {p:?} is not a port (1-65535)"))
    };
    match s.split_once(':') {
        Some(("tcp", p)) => Ok(Ready::Tcp { port: port(p)? }),
        Some(("http", rest)) => {
            let (p, path) = match rest.find('/') {
                Some(i) => (&rest[..i], &rest[i..]),
                None => (rest, "/"),
            };
            Ok(Ready::Http {
                port: port(p)?,
                path: path.to_string(),
            })
        }
        Some(("cmd", line)) if !line.is_empty() => {
            Ok(Ready::Command(Command::Shell(line.to_string())))
        }
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
    /// Sets these options' env, cwd and user in a request (the deadline is the caller's: a
    /// run's and a command's have their own ranges).
    pub fn apply(
        &self,
        env: &mut BTreeMap<String, String>,
        cwd: &mut Option<String>,
        user: &mut Option<String>,
    ) -> anyhow::Result<()> {
        *env = kv_map(&self.env, "-e")?;
        cwd.clone_from(&self.cwd);
        user.clone_from(&self.user);
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

fn kv_map(items: &[String], what: &str) -> anyhow::Result<BTreeMap<String, String>> {
    let mut m = BTreeMap::new();
    for kv in items {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| anyhow!("{what} takes K=V, got {kv:?}"))?;
        m.insert(k.into(), v.into());
    }
    Ok(m)
}

/// The create of `sbx create`'s flags.
fn create_request(a: &CreateArgs) -> anyhow::Result<SandboxCreate> {
    let mut spec = RunRequest::new(Command::Argv(Vec::new()));
    spec.name.clone_from(&a.name);
    spec.image.clone_from(&a.image);
    spec.env = kv_map(&a.env, "-e")?;
    spec.metadata = kv_map(&a.metadata, "--metadata")?;
    spec.volumes = crate::volumes::mounts(&a.volumes)?;
    spec.limits = limits_of(a.memory.as_deref(), a.cpus)?;
    spec.start_command = a.start.clone().map(Command::Shell);
    if a.image_start {
        spec.start = Some(true);
    }
    if a.no_start {
        spec.start = Some(false);
    }
    spec.ready = a.ready.as_deref().map(ready_check).transpose()?;
    spec.snapshot.clone_from(&a.snapshot);
    spec.template.clone_from(&a.template);
    spec.image_pull_secret.clone_from(&a.pull_secret);
    spec.public_ports.clone_from(&a.public_ports);
    Ok(SandboxCreate {
        spec,
        network: None,
    })
}

pub fn create(cli: &Cli, a: &CreateArgs) -> anyhow::Result<u8> {
    ensure_node(cli)?;
    let c = create_request(a)?;
    if a.template_only {
        return build_template(cli, a, &c);
    }
    let client = cli.client();
    let mut obj = client.create_sandbox(&c)?;
    if !a.no_wait && obj.status == sbx_api::SandboxStatus::Starting {
        obj = wait_started(cli, &obj.id)?;
    }
    if a.json {
        print_json(&obj)?;
    } else {
        println!("{}", obj.id);
        if obj.status == sbx_api::SandboxStatus::Failed {
            eprintln!(
                "sbx: the sandbox failed: {} ({})",
                obj.failure.as_deref().unwrap_or(""),
                obj.failure_code.as_deref().unwrap_or("")
            );
            return Ok(1);
        }
    }
    Ok(0)
}

/// `sbx create --template-only`: the template of these settings, built ahead.
fn build_template(cli: &Cli, a: &CreateArgs, c: &SandboxCreate) -> anyhow::Result<u8> {
    let client = cli.client();
    let mut t = client.build_template(c)?;
    let key = t.key.clone();
    let started = std::time::Instant::now();
    while t.status == "building" && !a.no_wait {
        if started.elapsed() > Duration::from_secs(1) {
            eprint!(
                "\r{key}: building (its image pulled, its check) {} s",
                started.elapsed().as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
        if let Some(now) = client.templates()?.data.into_iter().find(|x| x.key == key) {
            t = now;
        }
    }
    if started.elapsed() > Duration::from_secs(1) {
        eprintln!();
    }
    if a.json {
        print_json(&t)?;
    } else {
        println!("{key}");
    }
    if t.status == "failed" {
        eprintln!(
            "sbx: the template failed: {} ({})",
            t.failure.get().map_or("", String::as_str),
            t.failure_code.get().map_or("", String::as_str)
        );
        return Ok(1);
    }
    Ok(0)
}

/// Polls a `starting` sandbox until it is running or failed, saying on stderr that it waits.
fn wait_started(cli: &Cli, id: &str) -> anyhow::Result<sbx_client::Sandbox> {
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut said = false;
    let v = cli
        .client()
        .wait_started(id, Duration::from_millis(200), |waited| {
            let secs = waited.as_secs();
            if tty {
                eprint!(
                    "\r{id}: starting (its image pulled, its template built, its check) {secs} s"
                );
                said = true;
            } else if !said {
                eprintln!("{id}: starting (its image pulled, its template built, its check)");
                said = true;
            }
        })?;
    if said && tty {
        eprintln!();
    }
    Ok(v)
}

pub fn ls(cli: &Cli, a: &LsArgs) -> anyhow::Result<u8> {
    let all = cli.client().all_sandboxes(&SandboxQuery {
        status: a.status.clone(),
        limit: Some(1000),
        ..SandboxQuery::default()
    })?;
    if a.json {
        print_json(&all)?;
        return Ok(0);
    }
    println!(
        "{:<21} {:<20} {:<9} {:<8} {:<8} CREATED",
        "ID", "NAME", "STATUS", "IMAGE", "MEMORY"
    );
    for s in all {
        println!(
            "{:<21} {:<20} {:<9} {:<8} {:<8} {}",
            s.id,
            s.name.as_deref().unwrap_or("-"),
            s.status.as_str(),
            s.image,
            format!("{}M", s.limits.memory_bytes >> 20),
            s.created_at
        );
    }
    Ok(0)
}

/// How an event stream ended.
pub enum StreamEnd {
    /// The exit event: the final exec object.
    Exit(Box<ExecObject>),
    /// The stream dropped before its end, and was not (or could no longer be) read on.
    Dropped,
}

/// Prints a command's events (stdout to stdout, stderr to stderr) until its exit event.
pub fn print_events(events: ExecEvents) -> anyhow::Result<StreamEnd> {
    let (mut out, mut err) = (std::io::stdout(), std::io::stderr());
    for ev in events {
        match ev {
            Ok(ExecEvent::Stdout(d)) => {
                out.write_all(d.data.as_bytes())?;
                out.flush()?;
            }
            Ok(ExecEvent::Stderr(d)) => {
                err.write_all(d.data.as_bytes())?;
                err.flush()?;
            }
            Ok(ExecEvent::Gap(g)) => {
                eprintln!("sbx: output from {} to {} is no longer kept", g.from, g.to)
            }
            Ok(ExecEvent::Exit(obj)) => return Ok(StreamEnd::Exit(Box::new(obj))),
            Ok(ExecEvent::Start(_)) => {}
            // The stream's error event.
            Err(Error::Node(e)) => bail!("{}: {}", e.code, e.message),
            Err(Error::StreamEnded { .. }) => return Ok(StreamEnd::Dropped),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(StreamEnd::Dropped)
}

/// The exit code `sbx` ends with for a final exec object.
pub fn exit_code(obj: &ExecObject) -> u8 {
    match obj.status {
        ExecStatus::TimedOut => eprintln!("sbx: the command timed out"),
        ExecStatus::Killed => eprintln!(
            "sbx: the command was killed by {}",
            obj.signal.as_deref().unwrap_or("a signal")
        ),
        _ => {}
    }
    obj.exit_code.map_or(125, i64::from).clamp(0, 255) as u8
}

/// Follows a command's output from its start to its end, read on with Last-Event-ID when the
/// stream drops.
pub fn follow_output(cli: &Cli, sandbox: &str, exec: &str) -> anyhow::Result<u8> {
    let events = cli.client().follow_output(sandbox, exec, 0, Encoding::Utf8);
    match print_events(events)? {
        StreamEnd::Exit(obj) => Ok(exit_code(&obj)),
        StreamEnd::Dropped => bail!("the node's stream kept dropping"),
    }
}

pub fn exec(cli: &Cli, a: &ExecArgs) -> anyhow::Result<u8> {
    if a.interactive || a.tty {
        return crate::terminal::run(cli, &a.sandbox, &a.command, a.tty);
    }
    let mut r = ExecRequest::new(command_of(&a.command));
    a.opts.apply(&mut r.env, &mut r.cwd, &mut r.user)?;
    if let Some(t) = a.opts.timeout {
        r.timeout = Some(sbx_api::exec_timeout(t).map_err(refused)?);
    }
    let client = cli.client();
    let obj = client.exec(&a.sandbox, &r)?;
    if a.detach {
        if a.json {
            print_json(&obj)?;
        } else {
            println!("{}", obj.id);
        }
        return Ok(0);
    }
    if a.json {
        let fin = client.wait_exec(&a.sandbox, &obj.id)?;
        print_json(&fin)?;
        return Ok(exit_code(&fin));
    }
    follow_output(cli, &a.sandbox, &obj.id)
}

pub fn logs(cli: &Cli, a: &LogsArgs) -> anyhow::Result<u8> {
    if a.follow {
        return follow_output(cli, &a.sandbox, &a.exec);
    }
    let client = cli.client();
    let (mut out, mut err) = (std::io::stdout(), std::io::stderr());
    let mut from = 0u64;
    loop {
        let page = client.output(&a.sandbox, &a.exec, from, None, Encoding::Utf8)?;
        if let Some(g) = page.gap {
            eprintln!("sbx: output from {} to {} is no longer kept", g.from, g.to);
        }
        for c in &page.chunks {
            if c.stream == "stderr" {
                err.write_all(c.data.as_bytes())?;
            } else {
                out.write_all(c.data.as_bytes())?;
            }
        }
        if page.next <= from || page.next >= page.end {
            break;
        }
        from = page.next;
    }
    out.flush()?;
    Ok(0)
}

pub fn rm(cli: &Cli, a: &RmArgs) -> anyhow::Result<u8> {
    let client = cli.client();
    let mut code = 0;
    let mut gone = Vec::new();
    for s in &a.sandboxes {
        match client.delete_sandbox(s) {
            Ok(obj) if a.json => gone.push(obj),
            Ok(_) => println!("{s}"),
            Err(e) => {
                eprintln!("sbx: {s}: {e}");
                code = 1;
            }
        }
    }
    if a.json {
        print_json(&gone)?;
    }
    Ok(code)
}

pub fn restart(cli: &Cli, a: &RestartArgs) -> anyhow::Result<u8> {
    let obj = cli.client().restart_sandbox(&a.sandbox)?;
    if a.json {
        print_json(&obj)?;
    } else {
        println!("{} {}", obj.id, obj.status.as_str());
    }
    Ok(if obj.status == sbx_api::SandboxStatus::Running {
        0
    } else {
        1
    })
}

/// `sbx url SANDBOX PORT`: the preview URL of a port of the sandbox, with `?sbx_token=` (its
/// token, which the preview listener trades for a cookie at the first visit).
pub fn url_cmd(cli: &Cli, a: &UrlArgs) -> anyhow::Result<u8> {
    let obj = cli.client().sandbox(&a.sandbox)?;
    let Some(template) = obj.preview_url.as_deref() else {
        bail!("the node's preview listener is off (sandboxd --preview-listen)");
    };
    let token = obj.token.get().map(String::as_str).filter(|_| !a.no_token);
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
            Some(Ready::Tcp { port: 8080 })
        );
        let http = |port, path: &str| {
            Some(Ready::Http {
                port,
                path: path.into(),
            })
        };
        assert_eq!(
            ready_check("http:80/health?x=1").ok(),
            http(80, "/health?x=1")
        );
        assert_eq!(ready_check("http:80").ok(), http(80, "/"));
        assert_eq!(
            ready_check("cmd:test -f /tmp/up").ok(),
            Some(Ready::Command(Command::Shell("test -f /tmp/up".into())))
        );
        for bad in ["tcp:0", "tcp:70000", "http:x/", "cmd:", "udp:53", "8080"] {
            assert!(ready_check(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn create_flags_make_the_body_they_made() {
        use clap::Parser;
        let mut args = vec![
            "sbx", "create", "--name", "dev", "-e", "A=1", "--memory", "512m",
        ];
        args.extend([
            "--start",
            "python3 -m http.server",
            "--ready",
            "http:8000/up",
        ]);
        args.extend([
            "--public-port",
            "8000",
            "-v",
            "db:/data",
            "--metadata",
            "k=v",
        ]);
        let a = match crate::Cli::parse_from(args).command {
            crate::Cmd::Create(a) => a,
            _ => unreachable!(),
        };
        assert_eq!(
            create_request(&a).unwrap().to_json(),
            serde_json::json!({
                "name": "dev", "env": {"A": "1"}, "metadata": {"k": "v"},
                "limits": {"memory_bytes": 536870912},
                "start_command": "python3 -m http.server",
                "ready": {"http": {"port": 8000, "path": "/up"}},
                "public_ports": [8000], "volumes": [{"volume": "db", "path": "/data"}],
            })
        );
    }
}
