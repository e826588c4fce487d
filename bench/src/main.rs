//! `sbx-bench run`: `POST /v1/run` of `echo hi` against `runc run` of the same command on the
//! same root filesystem, at concurrency 1 and 8, in one run. Prints a table.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use sbx_api::{Command as Cmdline, ExecObject, ExecRequest, GapData, RunRequest, SandboxCreate};
use sbx_client::sse::FrameReader;
use sbx_client::Client;
use serde_json::{json, Value};

#[derive(Parser, Debug)]
struct Args {
    /// The node to measure.
    #[arg(long, default_value = "http://127.0.0.1:7799")]
    url: String,
    /// Root filesystem for runc (the node's base image rootfs).
    #[arg(long)]
    rootfs: PathBuf,
    /// Where the runc bundle is written.
    #[arg(long, default_value = "/tmp/sbx-bench-bundle")]
    bundle: PathBuf,
    /// Runs per cell.
    #[arg(long, default_value_t = 200)]
    runs: usize,
    /// Runs per runc cell (runc is slow).
    #[arg(long, default_value_t = 60)]
    runc_runs: usize,
    /// Skip runc.
    #[arg(long)]
    no_runc: bool,
    /// What to measure: run (POST /v1/run against runc), exec (a command in a live sandbox
    /// against fork+exec on the host, and event-stream throughput), or all.
    #[arg(long, default_value = "all")]
    suite: String,
    /// Bytes the throughput command writes.
    #[arg(long, default_value_t = 1 << 30)]
    stream_bytes: u64,
    /// A second node, whose sandboxes have no network (`--egress-default none`): the run
    /// suite measures runs and creates on both, to show what the network costs.
    #[arg(long)]
    url_no_net: Option<String>,
    /// The concurrencies of the run suite's sbx cells (comma-separated; runc's stay 1 and 8).
    #[arg(long, value_delimiter = ',', default_values_t = [1, 8])]
    concs: Vec<usize>,
}

#[derive(Default)]
struct Cell {
    lat: Vec<Duration>,
    wall: Duration,
}

impl Cell {
    fn pct(&self, p: f64) -> f64 {
        let mut v: Vec<f64> = self.lat.iter().map(|d| d.as_secs_f64() * 1e3).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        let i = ((v.len() as f64 - 1.0) * p).round() as usize;
        v.get(i).copied().unwrap_or(f64::NAN)
    }
    fn rate(&self) -> f64 {
        self.lat.len() as f64 / self.wall.as_secs_f64()
    }
}

/// Runs `one` `runs` times on `conc` threads.
fn measure(
    runs: usize,
    conc: usize,
    one: Arc<dyn Fn(usize) -> anyhow::Result<()> + Send + Sync>,
) -> anyhow::Result<Cell> {
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut handles = Vec::new();
    for _ in 0..conc {
        let next = next.clone();
        let one = one.clone();
        handles.push(std::thread::spawn(
            move || -> anyhow::Result<Vec<Duration>> {
                let mut lat = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= runs {
                        return Ok(lat);
                    }
                    let t = Instant::now();
                    one(i)?;
                    lat.push(t.elapsed());
                }
            },
        ));
    }
    let mut lat = Vec::new();
    for h in handles {
        match h.join() {
            Ok(r) => lat.extend(r?),
            Err(_) => bail!("a bench thread panicked"),
        }
    }
    Ok(Cell {
        lat,
        wall: start.elapsed(),
    })
}

fn sbx_one(node: &Client) -> anyhow::Result<()> {
    let cmd = Cmdline::Argv(vec!["echo".into(), "hi".into()]);
    let resp = node.run(&RunRequest::new(cmd)).context("POST /v1/run")?;
    if resp.stdout != "hi\n" || resp.exit_code != Some(0) {
        bail!("unexpected answer: {}", serde_json::to_string(&resp)?);
    }
    Ok(())
}

/// A create of the node's base template.
fn bare_create() -> SandboxCreate {
    SandboxCreate {
        spec: RunRequest::new(Cmdline::Argv(Vec::new())),
        network: None,
    }
}

/// A kept sandbox made (`POST /v1/sandboxes` until it answers running), then deleted (not
/// timed: `measure` times the whole call, so the delete goes on a thread of its own).
fn sbx_create(node: &Client) -> anyhow::Result<()> {
    let resp = node
        .create_sandbox(&bare_create())
        .context("POST /v1/sandboxes")?;
    if resp.status != sbx_api::SandboxStatus::Running {
        bail!("unexpected answer: {}", serde_json::to_string(&resp)?);
    }
    let (node, id) = (node.clone(), resp.object.id);
    std::thread::spawn(move || {
        let _ = node.delete_sandbox(&id);
    });
    Ok(())
}

fn runc_bundle(bundle: &Path, rootfs: &Path) -> anyhow::Result<()> {
    let _ = std::fs::remove_dir_all(bundle);
    std::fs::create_dir_all(bundle)?;
    let st = Command::new("runc")
        .args(["spec", "--bundle"])
        .arg(bundle)
        .status()
        .context("runc spec (apt-get install runc)")?;
    if !st.success() {
        bail!("runc spec failed");
    }
    let path = bundle.join("config.json");
    let mut cfg: Value = serde_json::from_slice(&std::fs::read(&path)?)?;
    cfg["process"]["terminal"] = json!(false);
    cfg["process"]["args"] = json!(["echo", "hi"]);
    cfg["root"]["path"] = json!(rootfs);
    cfg["root"]["readonly"] = json!(true);
    std::fs::write(&path, serde_json::to_vec_pretty(&cfg)?)?;
    Ok(())
}

fn runc_one(bundle: &Path, i: usize) -> anyhow::Result<()> {
    let out = Command::new("runc")
        .args(["run", "--bundle"])
        .arg(bundle)
        .arg(format!("sbx-bench-{}-{i}", std::process::id()))
        .stdin(Stdio::null())
        .output()
        .context("runc run")?;
    if out.stdout != b"hi\n" {
        bail!(
            "runc: {} {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let url = args.url.trim_end_matches('/').to_string();
    let agent = ureq::AgentBuilder::new().max_idle_connections(16).build();
    if args.suite == "run" || args.suite == "all" {
        run_suite(&args, &agent, &url)?;
        if args.suite == "all" {
            // What the run cells leave to the kernel (the sandboxes' teardowns, btrfs's
            // cleaner, the warm pool's refill) is over before the exec cells, which measure a
            // command's latency and a stream, not that.
            std::thread::sleep(std::time::Duration::from_secs(3));
        }
    }
    if args.suite == "exec" || args.suite == "all" {
        exec_suite(&args, &Client::with_agent(&url, agent.clone()))?;
    }
    Ok(())
}

/// A command in a live sandbox against fork+exec on the host; then the event stream's
/// throughput.
fn exec_suite(args: &Args, node: &Client) -> anyhow::Result<()> {
    let sb = node
        .create_sandbox(&bare_create())
        .context("create a sandbox")?;
    let result = exec_cells(args, node, &sb.id);
    let _ = node.delete_sandbox(&sb.id);
    result
}

fn exec_cells(args: &Args, node: &Client, id: &str) -> anyhow::Result<()> {
    let mut exec = ExecRequest::new(Cmdline::Argv(vec!["true".into()]));
    exec.wait_seconds = 10.0;
    let exec_true = || -> anyhow::Result<()> {
        let v = node.exec(id, &exec)?;
        if v.status != sbx_api::ExecStatus::Exited || v.exit_code != Some(0) {
            bail!("unexpected answer: {}", serde_json::to_string(&v)?);
        }
        Ok(())
    };
    let host_true = || -> anyhow::Result<()> {
        let st = Command::new("/bin/true").status()?;
        if !st.success() {
            bail!("/bin/true failed");
        }
        Ok(())
    };
    for _ in 0..10 {
        exec_true()?;
        host_true()?;
    }
    // Interleaved, one of each in turn: a machine whose speed drifts (a shared host) moves
    // both columns alike instead of skewing their ratio.
    let (mut sbx, mut host) = (Cell::default(), Cell::default());
    for _ in 0..args.runs {
        let t = Instant::now();
        exec_true()?;
        sbx.lat.push(t.elapsed());
        let t = Instant::now();
        host_true()?;
        host.lat.push(t.elapsed());
    }
    println!();
    println!("a command in a live sandbox (true), against fork+exec of /bin/true on the host (interleaved)");
    println!(
        "{:<34} {:>6} {:>9} {:>9}",
        "what", "runs", "p50 ms", "p95 ms"
    );
    for (what, c) in [("sbx POST …/exec (wait)", &sbx), ("host fork+exec", &host)] {
        println!(
            "{:<34} {:>6} {:>9.2} {:>9.2}",
            what,
            c.lat.len(),
            c.pct(0.5),
            c.pct(0.95)
        );
    }
    println!(
        "sbx p50 / host p50: {:.2}x (goal <= 1.3x)",
        sbx.pct(0.5) / host.pct(0.5)
    );
    // Throughput: a command writes stream_bytes of text; the stream carries it to us.
    let cmd = format!(
        "yes abcdefghijklmnopqrstuvwxyz0123456789 | head -c {}",
        args.stream_bytes
    );
    let mut writer = ExecRequest::new(Cmdline::Shell(cmd));
    writer.wait_for_reader = true;
    let started = node.exec(id, &writer)?;
    let t = Instant::now();
    let body = node.output_events_raw(id, &started.id, None, sbx_api::Encoding::Utf8)?;
    // The client's frame reader: output events are counted, not parsed (the client must not
    // be what is measured); only the gaps and the exit are read.
    let mut frames = FrameReader::new(std::io::BufReader::with_capacity(1 << 20, body));
    let (mut data_bytes, mut gap_bytes) = (0u64, 0u64);
    while let Some(f) = frames.next_frame()? {
        match f.event.as_str() {
            "gap" => {
                let g: GapData = serde_json::from_str(&f.data)?;
                gap_bytes += g.to - g.from;
            }
            "exit" => {
                let o: ExecObject = serde_json::from_str(&f.data)?;
                data_bytes = o.output.end - gap_bytes;
                break;
            }
            "error" => bail!("the stream ended with an error: {}", f.data),
            _ => {}
        }
    }
    let wire = frames.bytes_read();
    let secs = t.elapsed().as_secs_f64();
    println!();
    println!(
        "event stream of a command writing {} MiB: {} MiB delivered in {:.2} s = {:.0} MB/s ({} MiB skipped as gaps; {} MiB on the wire)",
        args.stream_bytes >> 20,
        data_bytes >> 20,
        secs,
        data_bytes as f64 / secs / 1e6,
        gap_bytes >> 20,
        wire >> 20
    );
    println!("goal: >= 500 MB/s");
    Ok(())
}

fn run_suite(args: &Args, agent: &ureq::Agent, url: &str) -> anyhow::Result<()> {
    let node = Client::with_agent(url, agent.clone());
    // Warm up: the first runs pay for page cache and allocator growth.
    for _ in 0..10 {
        sbx_one(&node)?;
    }
    let mut rows = Vec::new();
    for &conc in &args.concs {
        let n = node.clone();
        let cell = measure(args.runs, conc, Arc::new(move |_| sbx_one(&n)))?;
        rows.push(("sbx POST /v1/run", conc, cell));
    }
    if let Some(lo) = &args.url_no_net {
        let no_net = Client::with_agent(lo, agent.clone());
        for _ in 0..10 {
            sbx_one(&no_net)?;
        }
        for &conc in &args.concs {
            let n = no_net.clone();
            let cell = measure(args.runs, conc, Arc::new(move |_| sbx_one(&n)))?;
            rows.push(("sbx run, no net", conc, cell));
        }
        // Kept sandboxes (each deleted right after, off the measured path), at 1 and 8 with
        // the network, at 1 without.
        for (what, conc, n) in [
            ("sbx create", 1, node.clone()),
            ("sbx create", 8, node.clone()),
            ("sbx create, no net", 1, no_net),
        ] {
            let cell = measure(args.runs / 2, conc, Arc::new(move |_| sbx_create(&n)))?;
            rows.push((what, conc, cell));
        }
    }
    if !args.no_runc {
        runc_bundle(&args.bundle, &args.rootfs)?;
        runc_one(&args.bundle, usize::MAX)?;
        for conc in [1, 8] {
            let b = args.bundle.clone();
            let cell = measure(args.runc_runs, conc, Arc::new(move |i| runc_one(&b, i)))?;
            rows.push(("runc run", conc, cell));
        }
    }
    println!(
        "echo hi in a new sandbox, on this machine ({} cores)",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)
    );
    println!(
        "{:<20} {:>5} {:>6} {:>9} {:>9} {:>9}",
        "what", "conc", "runs", "p50 ms", "p95 ms", "runs/s"
    );
    for (what, conc, c) in &rows {
        println!(
            "{:<20} {:>5} {:>6} {:>9.2} {:>9.2} {:>9.1}",
            what,
            conc,
            c.lat.len(),
            c.pct(0.5),
            c.pct(0.95),
            c.rate()
        );
    }
    let p50 = |name: &str, conc: usize| {
        rows.iter()
            .find(|(w, c, _)| *w == name && *c == conc)
            .map(|(_, _, c)| c.pct(0.5))
    };
    if let (Some(n), Some(l)) = (p50("sbx POST /v1/run", 1), p50("sbx run, no net", 1)) {
        println!(
            "a run with network - without, p50 at concurrency 1: {:+.2} ms (goal <= 1 ms)",
            n - l
        );
    }
    if let (Some(n), Some(l)) = (p50("sbx create", 1), p50("sbx create, no net", 1)) {
        println!(
            "create -> running with network - without, p50: {:+.2} ms (goal <= 1 ms)",
            n - l
        );
    }
    if let (Some(s), Some(r)) = (p50("sbx POST /v1/run", 1), p50("runc run", 1)) {
        println!(
            "sbx p50 / runc p50 at concurrency 1: {:.3}x (goal <= 0.2x; p50 goal <= 5 ms)",
            s / r
        );
    }
    Ok(())
}
