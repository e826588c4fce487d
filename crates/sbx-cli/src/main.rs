//! `sbx`: the command line of an sbx node.

#![forbid(unsafe_code)]

mod call;
mod checkpoints;
mod egress;
mod files;
mod images;
mod sandboxes;
mod terminal;
mod volumes;

use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use clap::{Parser, Subcommand};
use sbx_api::{Command as Cmdline, Limits, RunRequest};
use sbx_client::Client;

#[derive(Parser, Debug)]
#[command(
    name = "sbx",
    version,
    about = "Run commands in isolated sandboxes on an sbx node"
)]
pub(crate) struct Cli {
    /// The node (also SBX_URL).
    #[arg(
        long,
        env = "SBX_URL",
        default_value = "http://127.0.0.1:7700",
        global = true
    )]
    pub(crate) url: String,
    /// API key (also SBX_API_KEY).
    #[arg(long, env = "SBX_API_KEY", hide_env_values = true, global = true)]
    pub(crate) api_key: Option<String>,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run a command in a new sandbox and stream its output; exits with the command's code.
    ///
    /// One argument after -- is a line for sh -c; several are run as they are, without a shell.
    Run(RunArgs),
    /// Images of the node.
    Image {
        #[command(subcommand)]
        command: ImageCmd,
    },
    /// Have the node pull an OCI image (a progress bar per layer).
    Pull(images::PullArgs),
    /// List the node's images: the base image and the pulled ones.
    Images(images::ImagesArgs),
    /// List the node's templates (keys for `sbx create --template`).
    Templates(images::ImagesArgs),
    /// Make a sandbox that lives until it is removed; prints its id.
    Create(sandboxes::CreateArgs),
    /// List sandboxes.
    Ls(sandboxes::LsArgs),
    /// Run a command in a sandbox; streams its output and exits with its code (-d: detach).
    Exec(sandboxes::ExecArgs),
    /// Print a command's output (-f: follow it until it ends, resuming if the stream drops).
    Logs(sandboxes::LogsArgs),
    /// Remove sandboxes (their start command is stopped with its stop signal first).
    Rm(sandboxes::RmArgs),
    /// Restart a sandbox: its machine is booted again over the same disk.
    Restart(sandboxes::RestartArgs),
    /// Put sandboxes to sleep: their processes are saved to disk with their memory, which is
    /// freed; the next use (or sbx wake) wakes them where they were.
    Sleep(checkpoints::SleepArgs),
    /// Wake sleeping sandboxes.
    Wake(checkpoints::SleepArgs),
    /// Take a snapshot of a sandbox, processes included (--ls lists them, --rm deletes one);
    /// sbx create --snapshot ID makes a sandbox that goes on from it.
    Snapshot(checkpoints::SnapshotArgs),
    /// Copy a running sandbox, processes included: the copies go on from now, apart.
    Fork(checkpoints::ForkArgs),
    /// Copy a file or a directory between here and a sandbox: sbx cp LOCAL SANDBOX:PATH, or
    /// sbx cp SANDBOX:PATH LOCAL.
    Cp(files::CpArgs),
    /// A sandbox's files: ls, stat, mkdir, rm, mv, chmod, grep, sed.
    Fs {
        #[command(subcommand)]
        command: files::FsCmd,
    },
    /// Change a sandbox's egress rules live: sbx egress dev --allow pypi.org --deny '*'.
    Egress(egress::EgressArgs),
    /// Print the preview URL of a port of a sandbox, with its token (?sbx_token=): open it in
    /// a browser.
    Url(sandboxes::UrlArgs),
    /// Volumes: sbx volume create|ls|rm; mount one with sbx run|create -v NAME:/PATH[:ro].
    Volume {
        #[command(subcommand)]
        command: volumes::VolumeCmd,
    },
    /// Call a function of the node (sandbox::run, sandbox::exec, sandbox::fs::read, ...) with
    /// key=value arguments (or --json); prints the reply as JSON.
    Call(call::CallArgs),
}

#[derive(Subcommand, Debug)]
enum ImageCmd {
    /// Build the base image now (debootstrap from this machine's apt sources), with progress.
    BuildBase {
        /// The node's data directory.
        #[arg(long, default_value = "/var/lib/sbx", env = "SBX_DATA_DIR")]
        data_dir: PathBuf,
    },
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// Image or catalog name (python, node); default: the node's base image.
    #[arg(long)]
    image: Option<String>,
    #[command(flatten)]
    opts: sandboxes::CommandOpts,
    /// Memory limit: bytes, or with a unit (512m, 1g, 256MiB).
    #[arg(long)]
    memory: Option<String>,
    /// vCPUs.
    #[arg(long)]
    cpus: Option<u32>,
    /// Name of the sandbox.
    #[arg(long)]
    name: Option<String>,
    /// A volume to mount: VOLUME:/PATH[:ro][,copy] (repeatable).
    #[arg(short = 'v', long = "volume", value_name = "VOLUME:/PATH[:ro]")]
    volumes: Vec<String>,
    /// Print the exec object as JSON at the end instead of streaming.
    #[arg(long)]
    json: bool,
    /// The command.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match real_main(cli) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("sbx: {e:#}");
            ExitCode::from(125)
        }
    }
}

fn real_main(cli: Cli) -> anyhow::Result<u8> {
    match &cli.command {
        Cmd::Run(args) => {
            ensure_node(&cli)?;
            run(&cli, args)
        }
        Cmd::Image {
            command: ImageCmd::BuildBase { data_dir },
        } => {
            build_base(data_dir)?;
            Ok(0)
        }
        Cmd::Pull(a) => images::pull(&cli, a),
        Cmd::Images(a) => images::images(&cli, a),
        Cmd::Templates(a) => images::templates(&cli, a),
        Cmd::Create(a) => sandboxes::create(&cli, a),
        Cmd::Ls(a) => sandboxes::ls(&cli, a),
        Cmd::Exec(a) => sandboxes::exec(&cli, a),
        Cmd::Logs(a) => sandboxes::logs(&cli, a),
        Cmd::Rm(a) => sandboxes::rm(&cli, a),
        Cmd::Restart(a) => sandboxes::restart(&cli, a),
        Cmd::Sleep(a) => checkpoints::sleep(&cli, a, false),
        Cmd::Wake(a) => checkpoints::sleep(&cli, a, true),
        Cmd::Snapshot(a) => checkpoints::snapshot(&cli, a),
        Cmd::Fork(a) => checkpoints::fork(&cli, a),
        Cmd::Cp(a) => files::cp(&cli, a),
        Cmd::Fs { command } => files::fs(&cli, command),
        Cmd::Call(a) => call::call(&cli, a),
        Cmd::Egress(a) => egress::egress(&cli, a),
        Cmd::Url(a) => sandboxes::url_cmd(&cli, a),
        Cmd::Volume { command } => volumes::volume(&cli, command),
    }
}

/// Parses 512m, 1g, 256MiB, 1.5G or plain bytes.
pub(crate) fn parse_memory(s: &str) -> anyhow::Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| anyhow!("bad memory size {s:?}"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        other => bail!("bad memory unit {other:?} (use k, m or g)"),
    };
    Ok((n * mult as f64) as u64)
}

/// The command of `sbx run` and `sbx exec`: one argument is a line for `sh -c`, several are
/// run as they are.
pub(crate) fn command_of(args: &[String]) -> Cmdline {
    match args {
        [line] => Cmdline::Shell(line.clone()),
        _ => Cmdline::Argv(args.to_vec()),
    }
}

/// The shape of `--memory` and `--cpus`.
pub(crate) fn limits_of(memory: Option<&str>, cpus: Option<u32>) -> anyhow::Result<Limits> {
    Ok(Limits {
        vcpus: cpus,
        memory_bytes: memory.map(parse_memory).transpose()?,
    })
}

fn run_request(args: &RunArgs) -> anyhow::Result<RunRequest> {
    let mut r = RunRequest::new(command_of(&args.command));
    r.image = args.image.clone();
    args.opts.apply(&mut r.env, &mut r.cwd, &mut r.user)?;
    if let Some(t) = args.opts.timeout {
        r.timeout = sbx_api::run_timeout(t).map_err(refused)?;
    }
    r.limits = limits_of(args.memory.as_deref(), args.cpus)?;
    r.name = args.name.clone();
    r.volumes = volumes::mounts(&args.volumes)?;
    r.stream = Some(!args.json);
    Ok(r)
}

/// A value the node would refuse, refused here as the node words it (`code: message (param
/// P)`): a deadline out of its range, which a request's type cannot hold.
pub(crate) fn refused(e: sbx_api::ApiError) -> anyhow::Error {
    match &e.param {
        Some(p) => anyhow!("{}: {} (param {p})", e.code, e.message),
        None => anyhow!("{}: {}", e.code, e.message),
    }
}

impl Cli {
    /// The client of the node this command talks to.
    pub(crate) fn client(&self) -> Client {
        Client::new(&self.url).api_key(self.api_key.clone())
    }
}

/// Prints an answer as the node sent it, pretty (keys in order).
pub(crate) fn print_json(v: &impl serde::Serialize) -> anyhow::Result<()> {
    let v = serde_json::to_value(v)?;
    println!("{}", serde_json::to_string_pretty(&v)?);
    Ok(())
}

fn run(cli: &Cli, args: &RunArgs) -> anyhow::Result<u8> {
    let req = run_request(args)?;
    let client = cli.client();
    if args.json {
        let obj = client.run(&req)?;
        print_json(&obj)?;
        return Ok(obj.exit_code.map_or(125, i64::from).clamp(0, 255) as u8);
    }
    match sandboxes::print_events(client.run_stream(&req)?)? {
        sandboxes::StreamEnd::Exit(obj) => Ok(sandboxes::exit_code(&obj)),
        sandboxes::StreamEnd::Dropped => bail!("the node's stream ended without an exit event"),
    }
}

fn sibling(name: &str) -> PathBuf {
    std::env::current_exe()
        .ok()
        .map(|p| p.with_file_name(name))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from(name))
}

fn build_base(data_dir: &PathBuf) -> anyhow::Result<()> {
    let status = Command::new(sibling("sandboxd"))
        .arg("--data-dir")
        .arg(data_dir)
        .arg("build-base")
        .status()
        .context("start sandboxd build-base")?;
    if !status.success() {
        bail!("building the base image failed ({status})");
    }
    Ok(())
}

fn node_addr(url: &str) -> Option<SocketAddr> {
    let rest = url.strip_prefix("http://")?;
    let hostport = rest.split('/').next()?;
    let hostport = hostport.replace("localhost", "127.0.0.1");
    hostport.parse().ok()
}

fn healthy(url: &str) -> bool {
    Client::new(url).health(Duration::from_secs(2)).is_ok()
}

/// Starts a node on this machine when none answers at a loopback SBX_URL.
pub(crate) fn ensure_node(cli: &Cli) -> anyhow::Result<()> {
    if healthy(&cli.url) {
        return Ok(());
    }
    let Some(addr) = node_addr(&cli.url).filter(|a| a.ip().is_loopback()) else {
        bail!("no node answers at {}", cli.url);
    };
    if TcpStream::connect_timeout(&addr, Duration::from_millis(300)).is_ok() {
        bail!(
            "something listens at {} but does not answer as a node",
            cli.url
        );
    }
    let data_dir =
        PathBuf::from(std::env::var("SBX_DATA_DIR").unwrap_or_else(|_| "/var/lib/sbx".into()));
    // The node builds what is missing at start, too long for the wait below: the base image
    // is built first, with its progress (the node started here serves no E2B: the code
    // interpreter's image is not needed).
    let base_ready = data_dir.join("images/base/image.json").is_file()
        || std::env::var_os("SBX_IMAGES_DIR").is_some();
    if !base_ready {
        eprintln!("sbx: no node is running; building its base images first");
        build_base(&data_dir)?;
    }
    std::fs::create_dir_all(&data_dir).with_context(|| format!("mkdir {}", data_dir.display()))?;
    let log_path = data_dir.join("sandboxd.log");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("open {}", log_path.display()))?;
    // The node outlives this command: in a process group of its own, a Ctrl-C or a job
    // control signal to the terminal's foreground group does not reach it, and its sandboxes'
    // cgroups are at the stable place (sbx.slice), not in this shell's scope.
    let child = Command::new(sibling("sandboxd"))
        .arg("--listen")
        .arg(addr.to_string())
        .arg("--data-dir")
        .arg(&data_dir)
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("start sandboxd")?;
    eprintln!(
        "sbx: started sandboxd (pid {}) on {addr}; its log is {}",
        child.id(),
        log_path.display()
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if healthy(&cli.url) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!(
        "sandboxd did not answer within 60 s; see {}",
        log_path.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn memory_sizes() {
        assert_eq!(parse_memory("512m").unwrap(), 512 << 20);
        assert_eq!(parse_memory("1g").unwrap(), 1 << 30);
        assert_eq!(parse_memory("256MiB").unwrap(), 256 << 20);
        assert_eq!(parse_memory("1048576").unwrap(), 1 << 20);
        assert!(parse_memory("12x").is_err());
    }

    #[test]
    fn one_argument_is_a_shell_line_several_are_argv() {
        let parse = |v: &[&str]| {
            let mut a = vec!["sbx", "run", "--"];
            a.extend_from_slice(v);
            match Cli::parse_from(a).command {
                Cmd::Run(r) => run_request(&r).unwrap().to_json(),
                _ => unreachable!(),
            }
        };
        assert_eq!(
            parse(&["echo hi | wc -c"]),
            json!({"command": "echo hi | wc -c", "stream": true})
        );
        assert_eq!(
            parse(&["python3", "-c", "print(2+2)"])["command"],
            json!(["python3", "-c", "print(2+2)"])
        );
        // The flags as the body had them.
        let mut a = vec![
            "sbx",
            "run",
            "--memory",
            "256m",
            "--cpus",
            "2",
            "--timeout",
            "2.5",
        ];
        a.extend([
            "-e",
            "A=1",
            "--cwd",
            "/w",
            "-v",
            "db:/data:ro",
            "--json",
            "--",
            "true",
        ]);
        let body = match Cli::parse_from(a).command {
            Cmd::Run(r) => run_request(&r).unwrap().to_json(),
            _ => unreachable!(),
        };
        assert_eq!(
            body,
            json!({"command": "true", "limits": {"vcpus": 2, "memory_bytes": 268435456},
                "timeout_seconds": 2.5, "env": {"A": "1"}, "cwd": "/w", "stream": false,
                "volumes": [{"volume": "db", "path": "/data", "read_only": true}]})
        );
    }

    #[test]
    fn a_volume_s_name_is_given_as_docker_s_or_by_flag_not_both() {
        let name = |v: &[&str]| {
            let mut a = vec!["sbx", "volume", "create"];
            a.extend_from_slice(v);
            match Cli::try_parse_from(a).map(|c| c.command) {
                Ok(Cmd::Volume {
                    command: volumes::VolumeCmd::Create { given, name, .. },
                }) => Ok(given.or(name)),
                Ok(_) => unreachable!(),
                Err(e) => Err(e.kind()),
            }
        };
        assert_eq!(name(&["data"]), Ok(Some("data".to_string())));
        assert_eq!(name(&["--name", "data"]), Ok(Some("data".to_string())));
        assert_eq!(name(&[]), Ok(None));
        assert_eq!(
            name(&["a", "--name", "b"]),
            Err(clap::error::ErrorKind::ArgumentConflict)
        );
    }
}
