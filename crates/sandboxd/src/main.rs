//! `sandboxd`: the sbx node daemon.

#![forbid(unsafe_code)]

mod replica;

use sbx_e2b as e2b;
use sbx_front::listen;
use sbx_functions::{self as functions, iii};
use sbx_http as http;
use sbx_node::{config, image, node, store};
use sbx_preview as preview;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use sha2::Digest as _;

#[derive(Parser, Debug)]
#[command(
    name = "sandboxd",
    version,
    about = "The sbx node: isolated sandboxes over an HTTP API"
)]
struct Cli {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7700", env = "SBX_LISTEN")]
    listen: SocketAddr,
    /// Where the node keeps its state.
    #[arg(long, default_value = "/var/lib/sbx", env = "SBX_DATA_DIR")]
    data_dir: PathBuf,
    /// Where images are kept (default: DATA_DIR/images). Several nodes may share one.
    #[arg(long, env = "SBX_IMAGES_DIR")]
    images_dir: Option<PathBuf>,
    /// A registry (`HOST:PORT`, as image references write it) spoken to over plain HTTP.
    /// Repeatable.
    #[arg(long = "insecure-registry", value_name = "HOST:PORT")]
    insecure_registries: Vec<String>,
    /// A file of API keys, one a line. Without it the node serves loopback callers only.
    #[arg(long)]
    api_keys: Option<PathBuf>,
    /// Base of the docs_url of errors (the code is appended).
    #[arg(long)]
    docs_url: Option<String>,
    /// The sbx-agent binary (default: next to this one).
    #[arg(long)]
    agent: Option<PathBuf>,
    /// Name of the cgroup folder the node's sandboxes go in (under --cgroup-parent).
    /// Default: `sbx` for the data directory /var/lib/sbx, else `sbx-` and a hash of the data
    /// directory. A folder another living node holds is refused at start.
    #[arg(long)]
    cgroup_name: Option<String>,
    /// Where the node's cgroup folder goes in each hierarchy: a path under the hierarchy's
    /// root (`/sbx.slice`, `/machine.slice/sbx`), made if missing; the node does not start
    /// when it cannot be. `own`: under the node's own cgroup (as nodes did before the stable
    /// place). Default: `/sbx.slice` where the root can be written, else (logged, per
    /// hierarchy) the node's own cgroup.
    #[arg(long, value_name = "PATH|own", value_parser = parse_cgroup_parent)]
    cgroup_parent: Option<sbx_runtime::cgroup::Parent>,
    /// The most sandboxes (runs' and kept ones) the node holds at once; one more is 503
    /// no_capacity. Default: the config file's max_sandboxes, else derived from the machine's
    /// memory, pids and open files (GET /internal/node `capacity` shows how).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    max_sandboxes: Option<u64>,
    /// Free bytes under which GET /healthz answers 503 (the node cannot make sandboxes): of
    /// DATA_DIR's filesystem (the database, images), and of the node's disk (DATA_DIR/disk),
    /// there at most a tenth of its size.
    #[arg(long, default_value_t = 512 << 20, value_name = "BYTES")]
    min_free_disk_bytes: u64,
    /// Host uid that is root in sandboxes (65536 uids from it are theirs).
    #[arg(long, default_value_t = 100_000)]
    uid_base: u32,
    /// Memory of a sandbox that asks for none, in bytes.
    #[arg(long, default_value_t = 512 << 20)]
    default_memory_bytes: u64,
    /// vCPUs of a sandbox that asks for none.
    #[arg(long, default_value_t = 1)]
    default_vcpus: u32,
    /// Most processes in one sandbox.
    #[arg(long, default_value_t = 1024)]
    pids_max: u32,
    /// Each sandbox's disk (its writable layer), in bytes: a write past it fails in the
    /// sandbox (EDQUOT), its neighbours and the node unharmed. Promised in full on the node's
    /// disk (--disk-overcommit).
    #[arg(long, default_value_t = 1 << 30, value_name = "BYTES")]
    disk_bytes: u64,
    /// The size of the node's disk (DATA_DIR/disk.img, where sandboxes' disks and volumes
    /// are), made once, its blocks reserved on DATA_DIR's filesystem then (an image made
    /// sparse by an older node is reserved at start); a host without the room refuses the
    /// start. Default: half of what DATA_DIR's filesystem has free then (another node on the
    /// same filesystem finds room too).
    #[arg(long, value_name = "BYTES")]
    disk_image_bytes: Option<u64>,
    /// How many times what the node's disk holds (its size less a tenth and 64 MiB kept for
    /// btrfs's metadata) its sandboxes' disks (--disk-bytes each) and volumes may be
    /// promised. 1.0: never more than it holds, and a create, volume or restore past it is
    /// 503 drive_full. Over 1.0 the disk may fill before its sandboxes' disks do: writes then
    /// fail with ENOSPC. GET /internal/node `disk.promise` shows it.
    #[arg(long, default_value_t = 1.0, value_name = "RATIO", value_parser = parse_overcommit)]
    disk_overcommit: f64,
    /// A volume's size when its create gives none, in bytes.
    #[arg(long, default_value_t = 1 << 30)]
    volume_bytes: u64,
    /// The most a volume may have, in bytes.
    #[arg(long, default_value_t = 64 << 30)]
    max_volume_bytes: u64,
    /// No disk of the node: sandboxes write to DATA_DIR's filesystem unbounded, and there are
    /// no volumes.
    #[arg(long)]
    no_disk: bool,
    /// Sandboxes of the base image kept made ahead, so that a run does not wait for one
    /// (0: none).
    #[arg(long, default_value_t = 2)]
    warm_pool: usize,
    /// Sandboxes of the base image made ahead for runs only (0: none; default: as many as
    /// --warm-pool). Made as a run's own is (its overlay not synced, its agent in PID 1's
    /// process), they cost less than --warm-pool's, which runs take only when this is 0.
    #[arg(long)]
    warm_runs: Option<usize>,
    /// Commands one sandbox may run at once.
    #[arg(long, default_value_t = 4)]
    max_execs_per_sandbox: usize,
    /// How long a kept sandbox may be idle before it pauses (its processes frozen, its
    /// memory kept; the next use thaws it in about a millisecond), where its create gives no
    /// sleep_after_seconds: seconds, or `never`.
    #[arg(long, default_value = "30", value_name = "SECONDS|never")]
    sleep_after_seconds: SleepAfterFlag,
    /// How long a paused sandbox stays paused before it sleeps for real (its processes saved
    /// to disk with CRIU, its memory freed), where its create gives no suspend_after_ms.
    #[arg(long, default_value_t = 600.0, value_name = "SECONDS")]
    suspend_after_seconds: f64,
    /// When the host's available memory (MemAvailable) falls below this, paused sandboxes
    /// sleep at once (longest paused first) instead of after their suspend time. Default: a
    /// tenth of the host's memory, at least 512 MiB; 0: never for memory.
    #[arg(long, value_name = "BYTES")]
    sleep_memory_below_bytes: Option<u64>,
    /// The CRIU binary (4.2 or newer) sandboxes are checkpointed with (sleep, snapshots,
    /// forks); a name is looked up in PATH. Without a usable one those calls are 503
    /// not_served_here and `GET /internal/node` says why.
    #[arg(long, default_value = "criu", value_name = "PATH")]
    criu: PathBuf,
    /// The config file (TOML): the functions interface's settings (see config.rs / README).
    /// Its max_concurrent_exec_per_sandbox, default_cpus and default_memory_mb override the
    /// options above.
    #[arg(long, env = "SBX_CONFIG")]
    config: Option<PathBuf>,
    /// An iii engine to serve the sandbox::* functions to (ws://HOST:PORT): the node connects
    /// as a worker, registers them, and reconnects when the engine goes away (iii.rs).
    #[arg(long, env = "III_URL")]
    iii_url: Option<String>,
    /// An origin (`https://app.example.com`) whose pages may call the node from a browser:
    /// its requests and CORS preflights are answered with CORS headers. Repeatable. Other
    /// origins than the node's own are refused (403 origin_not_allowed).
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    cors_origins: Vec<String>,
    #[command(flatten)]
    conns: ListenFlags,
    /// What the HTTP API's sandboxes reach: `allow`, the internet (through NAT; the host,
    /// other sandboxes, loopback, link-local and private ranges are always refused), `deny`,
    /// nothing but what a sandbox's own egress rules allow (its `default` decides where it
    /// gives one), or `none`, only `lo` (no network namespace plumbing at all: the fastest).
    #[arg(long, default_value = "allow", value_parser = ["allow", "deny", "none"])]
    egress_default: String,
    /// CA certificates (PEM) the egress proxy trusts besides the public roots when it
    /// re-encrypts a sandbox's HTTPS to a host with `http` or `inject` rules (a private CA,
    /// a test's).
    #[arg(long, value_name = "FILE")]
    egress_ca_file: Option<PathBuf>,
    /// A private range (CIDR) sandboxes may reach after all, e.g. a company network.
    /// Repeatable.
    #[arg(long = "egress-allow-cidr", value_name = "CIDR")]
    egress_allow_cidrs: Vec<ipnet::Ipv4Net>,
    /// A DNS server (ADDR or ADDR:PORT) the node asks the sandboxes' questions of. Repeatable.
    /// Default: the host's /etc/resolv.conf.
    #[arg(long = "dns-upstream", value_name = "ADDR[:PORT]")]
    dns_upstreams: Vec<String>,
    /// The node's sandbox network: the gateway is its second address, each sandbox has one of
    /// the others. Default: 10.250.0.0/16 for the data directory /var/lib/sbx, else a /20 in
    /// 10.251.0.0/16 chosen by the data directory's hash. It must not overlap the host's
    /// networks or another node's.
    #[arg(long, value_name = "CIDR")]
    net_range: Option<ipnet::Ipv4Net>,
    /// Connections one sandbox has at once in the host's conntrack table (which the host and
    /// every node share); the kernel drops a new one past it. 0: no limit.
    #[arg(long, default_value_t = sbx_runtime::net::DEFAULT_CT_LIMIT, value_name = "N")]
    net_ct_per_sandbox: u32,
    /// Questions of one sandbox the node's DNS forwards at once over UDP (256 for all); one
    /// more is answered SERVFAIL at once.
    #[arg(long, default_value_t = 32, value_name = "N")]
    dns_in_flight_per_sandbox: usize,
    /// TCP connections of one sandbox to the node's DNS at once (256 for all); one more is
    /// closed at once.
    #[arg(long, default_value_t = 16, value_name = "N")]
    dns_tcp_per_sandbox: usize,
    /// A TCP connection to the node's DNS that sends no whole question this long is closed.
    #[arg(long, default_value_t = 5_000, value_name = "MS")]
    dns_tcp_idle_ms: u64,
    /// Connections of one sandbox the egress proxy serves at once (8192 for all); one more is
    /// closed at once.
    #[arg(long, default_value_t = 1024, value_name = "N")]
    egress_proxy_per_sandbox: usize,
    /// Where the preview listener listens: a request to `{port}-{sandbox}.{domain}` there
    /// reaches that port of the sandbox. `off`: no listener (port 0: one the system picks,
    /// shown in GET /internal/node).
    #[arg(long, default_value = "127.0.0.1:7780", value_name = "ADDR|off",
          value_parser = preview::parse_listen)]
    preview_listen: preview::Listen,
    /// Where E2B's SDKs reach the node (E2B_API_URL and E2B_SANDBOX_URL: `http://ADDR`):
    /// E2B's control plane and envd, routed by the SDK's E2b-Sandbox-Id header. Off unless
    /// given. Keys: `--api-keys` (the SDK sends E2B_API_KEY as X-API-KEY); without them,
    /// loopback callers only.
    #[arg(long, value_name = "ADDR")]
    e2b_listen: Option<SocketAddr>,
    /// The domain of the preview URLs (`{port}-{sandbox}.DOMAIN`); a wildcard DNS name
    /// (`*.DOMAIN`) should point at the listener. `localhost` resolves on the machine itself.
    #[arg(long, default_value = "localhost", value_name = "DOMAIN")]
    preview_domain: String,
    /// The certificate chain (PEM) of the preview listener, for `*.DOMAIN`: it serves HTTPS
    /// (ALPN h2 and http/1.1). Goes with --preview-tls-key.
    #[arg(long, value_name = "FILE", requires = "preview_tls_key")]
    preview_tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --preview-tls-cert.
    #[arg(long, value_name = "FILE", requires = "preview_tls_cert")]
    preview_tls_key: Option<PathBuf>,
    /// The fleet's control plane to join (`http://HOST:PORT` of `sandboxd control`): the node
    /// registers with it and renews its lease by heartbeats (docs/fleet.md). Several,
    /// comma-separated (copies on one PostgreSQL database): the node goes to the active one (a
    /// standby answers 503 `standby` naming it). Without it the node stands alone.
    #[arg(long, value_name = "URL", requires = "node_name")]
    control: Option<String>,
    /// The node's name in the fleet (1 to 64 letters, digits, `.`, `_`, `-`): the same name
    /// keeps the same node id across restarts. Goes with --control.
    #[arg(long, value_name = "NAME", requires = "control")]
    node_name: Option<String>,
    /// Where the control plane reaches this node's API (`http://HOST:PORT`). Default:
    /// `http://` and --listen (which must then be an address others can reach).
    #[arg(long, value_name = "URL", requires = "control")]
    advertise_url: Option<String>,
    /// The fleet's object store (`file:///path`, `s3://bucket/prefix`), for the sleeps and
    /// snapshots that moves take (kept in the node's settings; moves come later).
    #[arg(long, value_name = "URL")]
    store: Option<String>,
    /// The key that seals what the node puts in the store that is secret (a sandbox's record:
    /// its token and secret variables): 32 bytes, made (mode 0600) if the file is missing.
    /// Every node of a fleet needs the same file (a takeover opens the record with it).
    /// Default: `DATA_DIR/store.key`.
    #[arg(long, value_name = "FILE", requires = "store")]
    store_key: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Cmd>,
}

/// `sandboxd control`: the fleet's control plane.
#[derive(clap::Args, Debug)]
struct ControlArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7701")]
    listen: SocketAddr,
    #[command(flatten)]
    conns: ListenFlags,
    /// Where the control plane keeps its state.
    #[arg(long, default_value = "/var/lib/sbx-control")]
    data_dir: PathBuf,
    /// The database: `sqlite:/abs/path.db`, or `postgres://USER:PASSWORD@HOST:PORT/DB`.
    /// Default: `sqlite:DATA_DIR/control.db`.
    #[arg(long, value_name = "URL")]
    db: Option<String>,
    /// The fleet's object store (`file:///path`, `s3://bucket/prefix`), for moves (which come
    /// later). Default: `file://DATA_DIR/store`.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
    /// A node whose last heartbeat is older than this is `lost` (its sandboxes' calls are 503
    /// until it comes back). Nodes heartbeat every third of it.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS", value_parser = parse_lease)]
    node_lease_seconds: f64,
    /// A file of API keys, one a line (the nodes' file: the control plane passes a caller's key
    /// on to the node). Without it the control plane serves loopback callers only.
    #[arg(long, value_name = "FILE")]
    api_keys: Option<PathBuf>,
    /// An iii engine (ws://HOST:PORT) the fleet's nodes also join: the control plane registers
    /// the sandbox::* functions in its default namespace and routes each call to a node (each
    /// node serves its own in the namespace `sbx-<node name>`).
    #[arg(long = "iii-url", value_name = "URL")]
    iii_url: Option<String>,
    /// Where E2B's SDKs reach the fleet (E2B_API_URL and E2B_SANDBOX_URL: `http://ADDR`): each
    /// request goes to the E2B listener of the node the table names (the nodes' --e2b-listen).
    /// Off unless given.
    #[arg(long, value_name = "ADDR")]
    e2b_listen: Option<SocketAddr>,
    /// Where the fleet's preview URLs are served: `{port}-{sandbox}.{domain}` goes to the
    /// preview listener of the sandbox's node, the Host kept. Off unless given.
    #[arg(long, value_name = "ADDR")]
    preview_listen: Option<SocketAddr>,
    /// The domain of the preview URLs (`{port}-{sandbox}.DOMAIN`): the nodes' --preview-domain.
    #[arg(long, default_value = "localhost", value_name = "DOMAIN")]
    preview_domain: String,
    /// Recover a node by itself once it has been lost this long past its lease and the grace
    /// after it (as `POST /internal/nodes/{id}/recover` would); 0 (the default): only when
    /// asked.
    #[arg(long, default_value_t = 0, value_name = "SECONDS")]
    recover_after_seconds: u64,
    /// This control plane's name among those sharing one database (PostgreSQL: one is
    /// active, the others stand by). Default: the host's name and --listen's port.
    #[arg(long, value_name = "NAME")]
    name: Option<String>,
    /// Where nodes and callers reach this control plane (`http://HOST:PORT`): a standby's 503
    /// `standby` names the active one's. Default: `http://` and --listen (the host's name
    /// where --listen is 0.0.0.0 or [::]).
    #[arg(long, value_name = "URL")]
    advertise_url: Option<String>,
    /// How long the active control plane's lease runs without a renewal (the database's
    /// clock; renewed every third of it): a standby takes over within about 1⅓ of it after
    /// the active one dies.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS", value_parser = parse_lease)]
    control_lease_seconds: f64,
}

/// `--node-lease-seconds`: a number of seconds over 0 (at most a day).
fn parse_lease(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 86_400.0 => Ok(v),
        _ => Err(format!("{s:?} is not a number of seconds over 0")),
    }
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Serve the API (the default).
    Serve,
    /// Run the fleet's control plane: nodes join it (`--control`), and its /v1 API places
    /// sandboxes on them and passes every call of a sandbox to its node (docs/fleet.md).
    Control(Box<ControlArgs>),
    /// Build the base image now (debootstrap from the machine's apt sources) and exit; with
    /// `--code-interpreter`, E2B's code interpreter's image too (a node with `--e2b-listen`
    /// builds it at start otherwise).
    BuildBase {
        #[arg(long)]
        code_interpreter: bool,
    },
    /// Remove what no pulled image uses from the images directory (blobs, layers, refs, temp
    /// files of pulls no longer running), print what was removed and exit. Safe while nodes
    /// run on the same directory: it waits for their pulls.
    Gc,
}

fn host_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(1 << 30)
}

/// A node that cannot start says why in one line (its causes joined), not with a backtrace;
/// an address another process holds names the flag that gives this node another.
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sandboxd: {}", one_line(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// A listener of the node, by the flag that places it: the context of its bind's error.
#[derive(Debug)]
struct Listener {
    flag: &'static str,
    /// Whether `FLAG off` turns it off.
    can_be_off: bool,
}

impl std::fmt::Display for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.flag)
    }
}

/// An error and its causes in one line; for an address in use, the flag that moves it.
fn one_line(e: &anyhow::Error) -> String {
    let listener = e.downcast_ref::<Listener>();
    let causes: Vec<String> = e
        .chain()
        .map(|c| c.to_string())
        .filter(|c| listener.is_none_or(|l| *c != l.flag))
        .collect();
    let mut line = causes.join(": ");
    let in_use = e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::AddrInUse)
    });
    if let (true, Some(l)) = (in_use, listener) {
        line.push_str(&format!(
            " (another process, another sandboxd maybe, holds it: give this node another \
             address with {} ADDR:PORT{})",
            l.flag,
            if l.can_be_off {
                format!(", or {} off", l.flag)
            } else {
                String::new()
            }
        ));
    }
    line
}

fn run() -> anyhow::Result<()> {
    // What the node's caller left open is passed to nothing the node starts (an agent would
    // carry it into its sandbox).
    let inherited = sbx_runtime::hostfs::cloexec_inherited();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = inherited {
        tracing::warn!(error = %e, "could not mark inherited descriptors close-on-exec");
    }
    // Each sandbox costs the node descriptors: the soft limit goes up to the hard one.
    match sbx_runtime::process::raise_nofile_limit() {
        Ok((soft, hard)) => tracing::debug!(soft, hard, "open files limit"),
        Err(e) => tracing::warn!(error = %e, "could not raise the open files limit"),
    }
    let mut cli = Cli::parse();
    if matches!(cli.command, Some(Cmd::Control(_))) {
        if let Some(Cmd::Control(args)) = cli.command.take() {
            return run_control(*args);
        }
    }
    let images_dir = cli
        .images_dir
        .clone()
        .unwrap_or_else(|| cli.data_dir.join("images"));
    let fn_cfg = match &cli.config {
        Some(p) => config::Config::load(p)?,
        None => config::Config::default(),
    };
    // Plain HTTP for the registries of --insecure-registry and of the config file.
    let mut insecure = cli.insecure_registries.clone();
    insecure.extend(fn_cfg.insecure_registries.iter().cloned());
    let mut images = image::ImageStore::with_insecure(images_dir.clone(), cli.uid_base, insecure);
    images.set_catalog(&fn_cfg.catalog);
    let mut progress = |line: &str| tracing::info!("{line}");
    match cli.command {
        Some(Cmd::BuildBase { code_interpreter }) => {
            let img = images.build_base(&mut progress)?;
            println!("base image ready at {}", img.rootfs.display());
            if code_interpreter {
                let img = images.build_interp(&mut progress)?;
                println!("code interpreter image ready at {}", img.rootfs.display());
            }
            return Ok(());
        }
        Some(Cmd::Gc) => {
            let removed = images.gc()?;
            println!("removed {removed}");
            return Ok(());
        }
        Some(Cmd::Serve) | Some(Cmd::Control(_)) | None => {}
    }
    // The fleet's settings are checked before anything of the node is made.
    let mut join = match &cli.control {
        Some(control) => Some(join_config(&cli, control)?),
        None => None,
    };
    // The fleet's object store, where sleeps and snapshots go (its URL checked now).
    let blob_store =
        (cli.store.as_deref().map(sbx_blob::Store::open).transpose()).context("--store")?;
    // The data directory is this node's alone (the database's lock): a second node stops here,
    // before it builds, makes or touches anything.
    std::fs::create_dir_all(cli.data_dir.join("sandboxes"))
        .with_context(|| format!("mkdir {}", cli.data_dir.display()))?;
    let store =
        store::Store::open(&cli.data_dir.join("state.db")).context("open the state database")?;
    let data_dir = std::fs::canonicalize(&cli.data_dir)
        .with_context(|| format!("resolve {}", cli.data_dir.display()))?;
    // No other host user reaches what sandboxes wrote (their upper directories hold files of
    // host uid 100000+, setuid ones too) or the images' layers (setuid binaries owned by the
    // sandboxes' root): root-owned 0700, made so at every start; and nothing under
    // `sandboxes/` runs setuid from the host (a nosuid bind mount, detached when the node ends).
    for dir in [data_dir.clone(), data_dir.join("sandboxes"), images_dir] {
        if sbx_runtime::hostfs::make_private_dir(&dir)
            .with_context(|| format!("make {} private", dir.display()))?
        {
            tracing::info!(dir = %dir.display(), "made private: root's, mode 0700");
        }
    }
    // The node's disk (sandboxes' layers and volumes, each of its own size), made or mounted
    // now, off the request path; `sandboxes/` is its `sandboxes/`.
    let disk = if cli.no_disk {
        None
    } else {
        let image_bytes = cli
            .disk_image_bytes
            .unwrap_or_else(|| default_image_bytes(&data_dir));
        match sbx_runtime::diskfs::Disk::open(&data_dir, image_bytes) {
            Ok(d) => Some(Arc::new(d)),
            // A disk the host has not the room for would fail its sandboxes' writes with EIO.
            Err(e @ sbx_runtime::diskfs::DiskError::NoRoom { .. }) => {
                return Err(anyhow::Error::new(e).context("the node's disk"));
            }
            Err(e) => {
                tracing::warn!(error = %e, "no disk of the node: sandboxes' disks unbounded, no volumes (--no-disk to say so)");
                None
            }
        }
    };
    let _nosuid = match &disk {
        Some(d) => sbx_runtime::hostfs::NosuidBind::of(&d.sandboxes(), &data_dir.join("sandboxes")),
        None => sbx_runtime::hostfs::NosuidBind::new(&data_dir.join("sandboxes")),
    }
    .context("bind the sandboxes' directory nosuid")?;
    let cgroup_name = cli
        .cgroup_name
        .clone()
        .unwrap_or_else(|| sbx_runtime::cgroup::default_name(&data_dir));
    if images.base().is_err() {
        images.build_base(&mut progress)?;
    }
    // E2B's code-interpreter-v1 runs on it: built (again) here when missing or older, on a
    // node that serves E2B (no other front end uses it).
    if cli.e2b_listen.is_some() && images.interp().is_err() {
        images.build_interp(&mut progress)?;
    }
    let agent = match &cli.agent {
        Some(a) => a.clone(),
        None => std::env::current_exe()
            .context("where is sandboxd")?
            .with_file_name("sbx-agent"),
    };
    let replicas: Option<Arc<dyn node::replica::Replicas>> = match blob_store {
        Some(s) => Some(replica::BlobReplicas::new(
            s,
            replica::node_build(&cli.criu, &agent)?,
        )),
        None => None,
    };
    // The cgroup folder is this node's alone (its lock, taken before anything is made or
    // cleaned in it): a node on a folder another one holds stops here.
    let driver = sbx_runtime::driver::NamespaceDriver::with_cgroups(
        agent,
        &cgroup_name,
        cli.cgroup_parent
            .as_ref()
            .unwrap_or(&sbx_runtime::cgroup::Parent::Auto),
        &format!(
            "pid {}, data dir {}",
            std::process::id(),
            data_dir.display()
        ),
        cli.uid_base,
        65536,
    )
    .context("the namespace driver")?;
    let driver = match &disk {
        Some(_) => driver.with_disk_bytes(cli.disk_bytes),
        None => driver,
    };
    let api_keys = match &cli.api_keys {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("read {}", p.display()))?;
            let keys: HashSet<String> = text
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(String::from)
                .collect();
            anyhow::ensure!(!keys.is_empty(), "{} holds no key", p.display());
            Some(keys)
        }
        None => None,
    };
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get() as u32)
        .unwrap_or(1)
        .min(32);
    let warm_runs = cli.warm_runs.unwrap_or(cli.warm_pool);
    let capacity = node::capacity::resolve(
        cli.max_sandboxes
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        fn_cfg.max_sandboxes,
        node::capacity::derive(
            &node::capacity::Host::read(host_memory()),
            cli.warm_pool + warm_runs,
        ),
    );
    tracing::info!(
        max_sandboxes = capacity.max_sandboxes,
        from = capacity.source,
        derived = capacity.derived.max_sandboxes,
        limited_by = capacity.derived.limited_by,
        "capacity"
    );
    let cfg = node::NodeConfig {
        data_dir: cli.data_dir.clone(),
        default_memory_bytes: fn_cfg
            .default_memory_mb
            .map(|m| m << 20)
            .unwrap_or(cli.default_memory_bytes),
        default_vcpus: fn_cfg
            .default_cpus
            .unwrap_or(cli.default_vcpus)
            .clamp(1, cpus),
        pids_max: cli.pids_max,
        max_memory_bytes: host_memory(),
        max_vcpus: cpus,
        warm_pool: cli.warm_pool,
        warm_runs,
        egress_default_deny: cli.egress_default == "deny",
        max_execs_per_sandbox: fn_cfg
            .max_concurrent_exec_per_sandbox
            .unwrap_or(cli.max_execs_per_sandbox)
            .max(1),
        image_allowlist: fn_cfg.image_allowlist.as_ref().map(|names| {
            let mut all = names.clone();
            // A custom image that is allowed boots as its local image: that one is allowed too.
            all.extend(
                fn_cfg
                    .custom_images
                    .iter()
                    .filter(|c| names.contains(&c.name))
                    .filter_map(|c| c.image.clone()),
            );
            all
        }),
        max_sandboxes: capacity.max_sandboxes,
        min_free_disk_bytes: cli.min_free_disk_bytes,
        sleep_after: cli.sleep_after_seconds.resolve(),
        suspend_after: Duration::from_secs_f64(cli.suspend_after_seconds.max(0.0)),
        sleep_memory_below: cli
            .sleep_memory_below_bytes
            .unwrap_or_else(node::sandbox::sleep::default_memory_low),
    };
    store.idem_tidy().context("tidy idempotency records")?;
    node::credentials::init(&cli.data_dir, &store).context("the node key and the secrets table")?;
    if cli.store.is_some() {
        let path = cli
            .store_key
            .clone()
            .unwrap_or_else(|| cli.data_dir.join("store.key"));
        node::credentials::init_store_key(&path)
            .with_context(|| format!("the store key (--store-key {})", path.display()))?;
    }
    let templates = node::templates::Templates::open(&store).context("the templates table")?;
    let driver = Arc::new(driver);
    let checkpoints = node::checkpoint::detect(&cli.criu, driver.clone());
    match &checkpoints {
        node::checkpoint::Checkpoints::Ready(c) => {
            tracing::info!(by = %c.describe(), "sleep, snapshots and forks: served")
        }
        node::checkpoint::Checkpoints::Off(why) => {
            tracing::warn!(%why, "sleep, snapshots and forks: not served (no usable CRIU)")
        }
    }
    let volumes = disk.as_ref().map(|d| node::volume::VolumeSettings {
        disk: d.clone(),
        default_bytes: cli.volume_bytes.min(cli.max_volume_bytes),
        max_bytes: cli.max_volume_bytes,
        disk_bytes: cli.disk_bytes,
        uid_base: cli.uid_base,
        overcommit: cli.disk_overcommit,
    });
    let store = Arc::new(store);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    rt.block_on(async move {
        // What the node serves besides sandboxes is made before it is: a failure here gives
        // back the disk (nothing else of the node runs yet).
        let release = |e: anyhow::Error| {
            if let Some(d) = &disk {
                d.release();
            }
            e
        };
        let net = if cli.egress_default == "none" {
            None
        } else {
            let range = cli.net_range.unwrap_or_else(|| default_range(&cgroup_name));
            let upstreams = cli
                .dns_upstreams
                .iter()
                .map(|a| parse_upstream(a))
                .collect::<anyhow::Result<Vec<_>>>()
                .map_err(release)?;
            let upstreams = if upstreams.is_empty() {
                sbx_net::dns::host_upstreams()
            } else {
                upstreams
            };
            let n = node::net::NodeNet::start(node::net::NetSettings {
                table: format!("sbx_{}", cgroup_name.replace('-', "_")),
                prefix: net_prefix(&cgroup_name),
                range,
                allow: cli.egress_allow_cidrs.clone(),
                dns_upstreams: upstreams,
                pool: 4,
                data_dir: cli.data_dir.clone(),
                extra_roots: cli.egress_ca_file.clone(),
                secrets: {
                    let store = store.clone();
                    Arc::new(move |name: &str| node::credentials::secret_for_inject(&store, name))
                },
                limits: node::net::NetLimits {
                    ct_per_sandbox: cli.net_ct_per_sandbox,
                    dns: node::net::DnsLimits {
                        udp_per_sandbox: cli.dns_in_flight_per_sandbox,
                        tcp_per_sandbox: cli.dns_tcp_per_sandbox,
                        tcp_idle: std::time::Duration::from_millis(cli.dns_tcp_idle_ms),
                        ..Default::default()
                    },
                    proxy_per_sandbox: cli.egress_proxy_per_sandbox,
                },
                services: Arc::new(sbx_net::Services),
            })
            .context("the sandbox network (--egress-default none runs without one)")
            .map_err(release)?;
            Some(n)
        };
        let preview = preview::bind(preview::Config {
            listen: cli.preview_listen.0,
            domain: cli.preview_domain.clone(),
            tls: cli
                .preview_tls_cert
                .clone()
                .zip(cli.preview_tls_key.clone()),
        })
        .await
        .context(Listener {
            flag: "--preview-listen",
            can_be_off: true,
        })
        .map_err(release)?;
        // The fleet's control plane forwards preview hosts to this listener (plain HTTP only:
        // one with TLS is the node's own).
        if let (Some(j), Some(p)) = (join.as_mut(), preview.as_ref()) {
            if !p.settings.tls {
                j.preview_url = Some(reachable_url(p.settings.listen, &j.url));
            }
        }
        let node = node::Node::builder(
            cfg,
            driver,
            images,
            store,
            templates,
            Arc::new(sbx_net::probe::NetProber),
        )
        .checkpoints(checkpoints)
        .capacity(capacity)
        .volumes(volumes)
        .net(net.clone())
        .preview(preview.as_ref().map(|p| p.settings.clone()))
        .replicas(replicas)
        // A node of a fleet keeps a lease: fenced until its first join (`node/lease.rs`).
        .leased(cli.control.is_some())
        .build()
        .context("the volumes table")
        .map_err(release)?;
        let (adopted, lost) = node.recover();
        if adopted + lost > 0 {
            tracing::info!(adopted, lost, "sandboxes of the previous run");
        }
        let removed = node.reconcile();
        if removed > 0 {
            tracing::info!(removed, "removed what a previous run left");
        }
        if let Some(net) = &net {
            net.remove_leftovers();
        }
        gc_images(node.images.clone());
        functions::init(fn_cfg, cli.docs_url.clone(), node.clone());
        node.start_sleeper();
        node.start_replicas();
        let cors_origins: Vec<String> = cli
            .cors_origins
            .iter()
            .map(|o| o.trim().trim_end_matches('/').to_ascii_lowercase())
            .collect();
        let limits = cli.conns.limits();
        // A listener that cannot start stops the node as a stop would (its disk released,
        // its runs ended, kept sandboxes left running for the next node).
        let started = async {
            let envd = e2b::start(
                cli.e2b_listen,
                node.clone(),
                api_keys.clone(),
                cors_origins.clone(),
            )
            .await
            .context(Listener {
                flag: "--e2b-listen",
                can_be_off: false,
            })?;
            if let Some(p) = preview {
                let ports: Vec<Arc<dyn sbx_front::PortFront>> = envd
                    .map(|e| Arc::new(e) as Arc<dyn sbx_front::PortFront>)
                    .into_iter()
                    .collect();
                preview::serve(
                    p,
                    node.clone(),
                    api_keys.clone(),
                    cli.docs_url.clone(),
                    cors_origins.clone(),
                    ports,
                );
            }
            Ok::<(), anyhow::Error>(())
        }
        .await;
        if let Err(e) = started {
            node.shutdown().await;
            return Err(e);
        }
        serve(
            cli.listen,
            node,
            api_keys,
            cli.docs_url,
            cli.iii_url,
            cors_origins,
            limits,
            join,
        )
        .await
    })
}

/// The connection cap: as given, else 512; at most a quarter of the open files limit unless
/// given (each connection may hold a descriptor of its own and one to an agent, beside the
/// sandboxes' sockets and pidfds), with a warning when a given cap is over that.
/// `--cgroup-parent`: `own`, or an absolute path under each hierarchy's root.
fn parse_cgroup_parent(s: &str) -> Result<sbx_runtime::cgroup::Parent, String> {
    if s == "own" {
        return Ok(sbx_runtime::cgroup::Parent::Own);
    }
    let p = PathBuf::from(s);
    let plain = p.is_absolute()
        && p.components()
            .skip(1)
            .all(|c| matches!(c, std::path::Component::Normal(_)));
    if !plain || p.components().count() < 2 {
        return Err("an absolute path below the hierarchy's root (e.g. /sbx.slice), or own".into());
    }
    Ok(sbx_runtime::cgroup::Parent::Given(p))
}

/// A DNS upstream: `ADDR` (port 53) or `ADDR:PORT`.
fn parse_upstream(a: &str) -> anyhow::Result<SocketAddr> {
    if let Ok(ip) = a.parse::<std::net::IpAddr>() {
        return Ok(SocketAddr::new(ip, 53));
    }
    a.parse::<SocketAddr>()
        .with_context(|| format!("--dns-upstream {a}: not ADDR or ADDR:PORT"))
}

/// The host-side interfaces' prefix of a node's sandboxes: `sbx` for the cgroup folder `sbx`
/// (the node of /var/lib/sbx), else `sb` and 4 hex digits of the folder's name (so that two
/// nodes' interfaces never mix).
fn net_prefix(cgroup_name: &str) -> String {
    if cgroup_name == "sbx" {
        return "sbx".into();
    }
    let h = sha2::Sha256::digest(cgroup_name.as_bytes());
    format!("sb{:02x}{:02x}x", h[0], h[1])
}

/// The default range of a node: 10.250.0.0/16 for the folder `sbx`, else one of the /20s of
/// 10.251.0.0/16 by the folder's hash.
fn default_range(cgroup_name: &str) -> ipnet::Ipv4Net {
    let fallback = ipnet::Ipv4Net::default();
    if cgroup_name == "sbx" {
        return ipnet::Ipv4Net::new(std::net::Ipv4Addr::new(10, 250, 0, 0), 16).unwrap_or(fallback);
    }
    let h = sha2::Sha256::digest(cgroup_name.as_bytes());
    let third = (h[0] & 0x0f) << 4;
    ipnet::Ipv4Net::new(std::net::Ipv4Addr::new(10, 251, third, 0), 20).unwrap_or(fallback)
}

/// The timeouts and the cap of a listener's connections (the node's API; the control plane's).
#[derive(clap::Args, Debug, Clone)]
struct ListenFlags {
    /// A request head not complete this long after its first byte closes its connection.
    #[arg(long, default_value_t = 10_000, value_name = "MS")]
    header_timeout_ms: u64,
    /// A request body the node waits for that sends nothing this long fails, and its
    /// connection closes.
    #[arg(long, default_value_t = 30_000, value_name = "MS")]
    body_idle_timeout_ms: u64,
    /// A connection with no request for this long is closed.
    #[arg(long, default_value_t = 60_000, value_name = "MS")]
    keepalive_timeout_ms: u64,
    /// Connections open at once; one more is answered 503 and closed, with a log line.
    /// Default: 512, or a quarter of the open files limit when that is less.
    #[arg(long)]
    max_connections: Option<usize>,
}

impl ListenFlags {
    fn limits(&self) -> listen::Limits {
        listen::Limits {
            header: Duration::from_millis(self.header_timeout_ms.max(1)),
            body_idle: Duration::from_millis(self.body_idle_timeout_ms.max(1)),
            keepalive: Duration::from_millis(self.keepalive_timeout_ms.max(1)),
            max_connections: max_connections(self.max_connections),
        }
    }
}

fn max_connections(given: Option<usize>) -> usize {
    const DEFAULT: usize = 512;
    let room = sbx_runtime::process::nofile_limit()
        .map_or(usize::MAX, |n| usize::try_from(n / 4).unwrap_or(usize::MAX))
        .max(16);
    match given {
        Some(n) => {
            if n > room {
                tracing::warn!(
                    max_connections = n,
                    open_files_limit = room * 4,
                    "--max-connections is over a quarter of the open files limit: past it, connections are answered 503 as descriptors run out"
                );
            }
            n.max(1)
        }
        None if room < DEFAULT => {
            tracing::info!(
                max_connections = room,
                open_files_limit = room * 4,
                "connection cap lowered to a quarter of the open files limit"
            );
            room
        }
        None => DEFAULT,
    }
}

/// The images' gc, in the background: it waits for pulls of other nodes sharing the images
/// directory, and the node serves meanwhile.
fn gc_images(images: image::ImageStore) {
    tokio::task::spawn_blocking(move || match images.gc() {
        Ok(removed) => tracing::info!(
            blobs = removed.store.blobs_removed,
            layers = removed.store.layers_removed,
            temps = removed.store.temps_removed,
            records = removed.store.records_removed,
            markers = removed.markers_removed,
            bytes = removed.store.bytes_freed,
            "image gc: removed {removed}"
        ),
        Err(e) => tracing::warn!(error = %e, "image gc failed"),
    });
}

#[allow(clippy::too_many_arguments)]
async fn serve(
    listen: SocketAddr,
    node: Arc<node::Node>,
    api_keys: Option<HashSet<String>>,
    docs_url: Option<String>,
    iii_url: Option<String>,
    cors_origins: Vec<String>,
    limits: listen::Limits,
    join: Option<sbx_control::join::JoinConfig>,
) -> anyhow::Result<()> {
    let state = Arc::new(http::AppState {
        node: node.clone(),
        api_keys,
        docs_url,
        cors_origins,
    });
    // A node of a fleet serves its functions in a namespace of its own (the control plane
    // serves the engine's default one); a node standing alone in the default.
    let namespace = join.as_ref().map(|j| iii::fleet_namespace(&j.name));
    let _worker = iii_url
        .filter(|u| !u.trim().is_empty())
        .map(|u| iii::start(&u, state.node.clone(), namespace));
    let app = http::router(state);
    let listener = match tokio::net::TcpListener::bind(listen).await {
        Ok(l) => l,
        Err(e) => {
            node.shutdown().await;
            return Err(anyhow::Error::new(e)
                .context(format!("listen on {listen}"))
                .context(Listener {
                    flag: "--listen",
                    can_be_off: false,
                }));
        }
    };
    tracing::info!(%listen, "sandboxd serves");
    // The fleet: the node joins its control plane once it serves (the control plane may send
    // it calls from then on).
    let joined = join.map(|j| sbx_control::join::start_with(j, node_lease_hooks(node.clone())));
    node.refill();
    // The sandboxes are ended as soon as the node is told to stop: the graceful shutdown waits
    // for every open request, and a run's request lasts as long as its command.
    let stopping = {
        let node = node.clone();
        async move {
            stop_signal().await;
            tracing::info!("stopping: ending every sandbox");
            node.shutdown().await;
        }
    };
    listen::serve(listener, app, limits, stopping).await;
    if let Some(j) = joined {
        j.abort();
    }
    node.shutdown().await;
    Ok(())
}

/// `sandboxd control`.
fn run_control(args: ControlArgs) -> anyhow::Result<()> {
    let api_keys = match &args.api_keys {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("read {}", p.display()))?;
            let keys = sbx_control::auth::parse_keys(&text)
                .with_context(|| format!("{} holds no key", p.display()))?;
            Some(keys)
        }
        None => None,
    };
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("mkdir {}", args.data_dir.display()))?;
    let data_dir = std::fs::canonicalize(&args.data_dir)
        .with_context(|| format!("resolve {}", args.data_dir.display()))?;
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_string());
    let name = match &args.name {
        Some(n) => {
            anyhow::ensure!(
                !n.trim().is_empty() && n.len() <= 200,
                "--name {n:?}: 1 to 200 characters"
            );
            n.clone()
        }
        None => format!("{host}:{}", args.listen.port()),
    };
    let advertise_url = match &args.advertise_url {
        Some(u) => {
            anyhow::ensure!(
                sbx_control::server::is_http_base(u),
                "--advertise-url {u:?}: where nodes reach this control plane, http://HOST:PORT"
            );
            u.trim_end_matches('/').to_string()
        }
        None if args.listen.ip().is_unspecified() => {
            format!("http://{host}:{}", args.listen.port())
        }
        None => format!("http://{}", args.listen),
    };
    let cfg = sbx_control::ControlConfig {
        name,
        advertise_url,
        limits: args.conns.limits(),
        control_lease: Duration::from_secs_f64(args.control_lease_seconds),
        listen: args.listen,
        db_url: args
            .db
            .unwrap_or_else(|| sbx_control::ControlConfig::default_db_url(&data_dir)),
        store_url: args
            .store
            .unwrap_or_else(|| sbx_control::ControlConfig::default_store_url(&data_dir)),
        data_dir,
        node_lease: Duration::from_secs_f64(args.node_lease_seconds),
        api_keys,
        iii_url: args.iii_url.filter(|u| !u.trim().is_empty()),
        e2b_listen: args.e2b_listen,
        preview_listen: args.preview_listen,
        preview_domain: args.preview_domain,
        recover_after: (args.recover_after_seconds > 0)
            .then(|| Duration::from_secs(args.recover_after_seconds)),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    let listen = cfg.listen;
    rt.block_on(sbx_control::serve(cfg, stop_signal()))
        .map_err(|e| match e {
            e @ sbx_control::ControlError::Listen { .. } => {
                anyhow::Error::new(e).context(Listener {
                    flag: "--listen",
                    can_be_off: false,
                })
            }
            e => anyhow::Error::new(e),
        })
        .with_context(|| format!("the control plane on {listen}"))
}

/// What a node joins its control plane with: its name, where it is reached, its build, a key.
fn join_config(cli: &Cli, control: &str) -> anyhow::Result<sbx_control::join::JoinConfig> {
    let controls = sbx_control::join::control_urls(control);
    anyhow::ensure!(
        !controls.is_empty()
            && controls
                .iter()
                .all(|c| c.starts_with("http://") && c.len() > "http://".len()),
        "--control {control:?}: the control plane's URL is http://HOST:PORT (several, of one \
         fleet's control planes, comma-separated)"
    );
    let name = cli.node_name.clone().unwrap_or_default();
    anyhow::ensure!(
        sbx_control::server::valid_node_name(&name),
        "--node-name {name:?}: 1 to 64 letters, digits, '.', '_' and '-'"
    );
    let url = match &cli.advertise_url {
        Some(u) => {
            anyhow::ensure!(
                u.starts_with("http://") && u.len() > "http://".len(),
                "--advertise-url {u:?}: where the control plane reaches this node, http://HOST:PORT"
            );
            u.trim_end_matches('/').to_string()
        }
        None => {
            anyhow::ensure!(
                !cli.listen.ip().is_unspecified(),
                "--listen {} is no address the control plane can reach: give --advertise-url \
                 http://HOST:PORT",
                cli.listen
            );
            format!("http://{}", cli.listen)
        }
    };
    let agent = match &cli.agent {
        Some(a) => a.clone(),
        None => std::env::current_exe()
            .context("where is sandboxd")?
            .with_file_name("sbx-agent"),
    };
    let agent_bytes =
        std::fs::read(&agent).with_context(|| format!("read the agent {}", agent.display()))?;
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let criu = std::process::Command::new(&cli.criu)
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    let build = sbx_control::join::build_id(&kernel, criu.as_deref(), &agent_bytes);
    // The fleet shares one key file: any of the node's keys is the control plane's too.
    let api_key = match &cli.api_keys {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("read {}", p.display()))?;
            sbx_control::auth::parse_keys(&text).and_then(|k| k.into_iter().min())
        }
        None => None,
    };
    tracing::info!(
        control = %control,
        name = %name,
        url = %url,
        %build,
        store = cli.store.as_deref().unwrap_or("none"),
        "the node joins a fleet"
    );
    Ok(sbx_control::join::JoinConfig {
        control: controls.join(","),
        name,
        e2b_url: cli.e2b_listen.map(|a| reachable_url(a, &url)),
        url,
        preview_url: None,
        build,
        api_key,
    })
}

/// `http://ADDR` of a listener of the node, for the control plane: a wildcard address takes
/// the host of the node's advertised URL (`http://HOST:PORT`).
fn reachable_url(listen: SocketAddr, advertised: &str) -> String {
    if !listen.ip().is_unspecified() {
        return format!("http://{listen}");
    }
    let host = advertised
        .strip_prefix("http://")
        .unwrap_or(advertised)
        .trim_end_matches('/');
    let host = match host.rsplit_once(':') {
        Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => host,
    };
    format!("http://{host}:{}", listen.port())
}

/// What the join loop asks of the node: its room, the sandboxes it holds (`held`), and what
/// it does with a renewal of its lease (its taken sandboxes removed, its fence moved on).
fn node_lease_hooks(node: Arc<node::Node>) -> sbx_control::join::Hooks {
    let held = {
        let node = node.clone();
        Arc::new(move || {
            node.held_list()
                .into_iter()
                .map(|(id, epoch)| sbx_control::db::HeldSandbox { id, epoch })
                .collect()
        }) as sbx_control::join::HeldFn
    };
    let renewed = {
        let node = node.clone();
        Arc::new(move |r: sbx_control::join::Renewal| {
            let node = node.clone();
            Box::pin(async move {
                let taken = r
                    .taken
                    .into_iter()
                    .map(|t| node::lease::Taken {
                        id: t.id,
                        epoch: t.epoch,
                        to: t.to,
                    })
                    .collect();
                node.lease_renewed(node::lease::Renewal {
                    deadline: r.deadline,
                    lease_end: r.sent + r.lease,
                    taken,
                })
                .await;
            }) as std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>
        }) as sbx_control::join::RenewedFn
    };
    sbx_control::join::Hooks {
        capacity: node_capacity(node),
        held: Some(held),
        renewed: Some(renewed),
    }
}

/// The node's room as it tells its control plane: its most sandboxes, those it holds now, the
/// images it has (their references, pinned ones by digest, and the images of its ready
/// templates).
fn node_capacity(node: Arc<node::Node>) -> sbx_control::join::CapacityFn {
    Arc::new(move || {
        let mut images: Vec<String> = Vec::new();
        for i in node.images.list() {
            images.extend(i.references);
        }
        for t in node.template_objects() {
            if t.status == "ready" {
                images.push(t.image);
            }
        }
        images.sort();
        images.dedup();
        sbx_control::db::Capacity {
            max_sandboxes: u64::try_from(node.cfg.max_sandboxes).unwrap_or(u64::MAX),
            sandboxes: u64::try_from(node.held_sandboxes()).unwrap_or(u64::MAX),
            images,
        }
    })
}

async fn stop_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// The default size of the node's disk image: half of what `dir`'s filesystem has free, at
/// least 1 GiB (its blocks are reserved: a host with less refuses the start; the other half
/// is left to the host and to other nodes).
fn default_image_bytes(dir: &std::path::Path) -> u64 {
    let free = sbx_runtime::diskfs::free_bytes(dir);
    (free / 2).max(1 << 30)
}

/// `--disk-overcommit`: a ratio over 0.
fn parse_overcommit(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("{s:?} is not a ratio over 0 (1.0: no overcommit)")),
    }
}

/// `--sleep-after-seconds`: seconds (a number ≥ 0) or `never`.
#[derive(Debug, Clone, Copy)]
struct SleepAfterFlag(Option<f64>);

impl std::str::FromStr for SleepAfterFlag {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "never" || s == "null" {
            return Ok(SleepAfterFlag(None));
        }
        match s.parse::<f64>() {
            Ok(v) if v.is_finite() && v >= 0.0 => Ok(SleepAfterFlag(Some(v))),
            _ => Err(format!("{s:?} is not a number of seconds or never")),
        }
    }
}

impl SleepAfterFlag {
    fn resolve(self) -> Option<Duration> {
        self.0.map(Duration::from_secs_f64)
    }
}
