//! `sbx-bench-images`: OCI images through a node, over a registry on loopback. Starts Debian's
//! `docker-registry` (sbx-testreg) and a sandboxd of its own (its data and images directories
//! are temporary; the base image is the machine's), writes and pushes a large image — the base
//! image's rootfs as one gzip layer, `--random-mib` of random bytes as another — and measures:
//!
//! - `POST /v1/sandboxes {image}` until the sandbox is `running` when the node does not have
//!   the image: the pull (download, digest checks, unpacking) and the first sandbox. Each of
//!   `--pulls` rounds pushes a fresh image (a nonce in both layers), so every layer is new;
//! - the same for a sandbox of an image the node has (`--creates` of them);
//! - `POST /v1/run` of `echo hi` in that image (`--runs`);
//! - the last two with the base image, for comparison.
//!
//! Prints a table. Everything it started and wrote is stopped and removed at the end, also
//! after an error.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use sbx_testreg::{Compression, Layer, Registry, Tar};
use serde_json::{json, Value};

#[derive(Parser, Debug)]
struct Args {
    /// The sandboxd binary.
    #[arg(long, default_value = "target/release/sandboxd")]
    sandboxd: PathBuf,
    /// The sbx-agent binary (default: next to sandboxd).
    #[arg(long)]
    agent: Option<PathBuf>,
    /// The machine's images directory: its base image is used (not written).
    #[arg(long, default_value = "/var/lib/sbx/images")]
    images_dir: PathBuf,
    /// Where the registry's storage and the node's data and images go (a temporary directory
    /// made in it, removed at the end).
    #[arg(long, default_value = "/var/tmp")]
    work_dir: PathBuf,
    /// The uid base the base image is stored at (its owners are shifted back in the layer).
    #[arg(long, default_value_t = 100_000)]
    uid_base: u32,
    /// MiB of random bytes in the image's second layer.
    #[arg(long, default_value_t = 100)]
    random_mib: usize,
    /// Fresh images pulled (each a create that pulls every layer).
    #[arg(long, default_value_t = 5)]
    pulls: usize,
    /// Creates of a sandbox of an image the node has.
    #[arg(long, default_value_t = 20)]
    creates: usize,
    /// Runs of `echo hi`.
    #[arg(long, default_value_t = 20)]
    runs: usize,
}

/// Latencies of one row, ms.
struct Row {
    what: String,
    ms: Vec<f64>,
}

impl Row {
    fn pct(&self, p: f64) -> f64 {
        let mut v = self.ms.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        let i = ((v.len() as f64 - 1.0) * p).round() as usize;
        v.get(i).copied().unwrap_or(f64::NAN)
    }
}

/// The node the bench starts. Dropping it deletes the sandboxes it still has, stops it
/// (SIGTERM, then SIGKILL after 10 s) and removes its directories.
struct Node {
    child: Child,
    url: String,
    http: ureq::Agent,
    log: PathBuf,
    live: Vec<String>,
}

impl Node {
    fn start(args: &Args, work: &Path, registry: &str) -> anyhow::Result<Node> {
        let data = work.join("data");
        let images = work.join("images");
        std::fs::create_dir_all(&data).context("mkdir data")?;
        std::fs::create_dir_all(&images).context("mkdir images")?;
        let base = args.images_dir.join("base");
        if !base.join("image.json").is_file() {
            bail!(
                "no base image in {}: build it first (sandboxd --images-dir {} build-base)",
                args.images_dir.display(),
                args.images_dir.display()
            );
        }
        std::os::unix::fs::symlink(&base, images.join("base")).context("link the base image")?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .context("a free port")?
            .port();
        let log = data.join("sandboxd.log");
        let out = std::fs::File::create(&log).context("the node's log")?;
        let err = out.try_clone().context("the node's log")?;
        let agent = args
            .agent
            .clone()
            .unwrap_or_else(|| args.sandboxd.with_file_name("sbx-agent"));
        let child = Command::new(&args.sandboxd)
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--data-dir")
            .arg(&data)
            .arg("--images-dir")
            .arg(&images)
            .arg("--agent")
            .arg(agent)
            .arg("--cgroup-name")
            .arg("sbx-bench-images")
            .arg("--warm-pool")
            .arg("0")
            .arg("--uid-base")
            .arg(args.uid_base.to_string())
            .arg("--insecure-registry")
            .arg(registry)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("start {}", args.sandboxd.display()))?;
        let mut node = Node {
            child,
            url: format!("http://127.0.0.1:{port}"),
            http: ureq::AgentBuilder::new()
                .timeout_connect(Duration::from_secs(5))
                .timeout_read(Duration::from_secs(600))
                .build(),
            log,
            live: Vec::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if node.http.get(&node.url("/healthz")).call().is_ok() {
                return Ok(node);
            }
            if let Ok(Some(status)) = node.child.try_wait() {
                bail!("sandboxd exited with {status}:\n{}", node.log_text());
            }
            if Instant::now() > deadline {
                bail!("sandboxd did not answer in 30 s:\n{}", node.log_text());
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn post(&self, path: &str, body: &Value) -> anyhow::Result<(u16, Value)> {
        match self.http.post(&self.url(path)).send_json(body) {
            Ok(r) => Ok((r.status(), r.into_json()?)),
            Err(ureq::Error::Status(code, r)) => Ok((code, r.into_json().unwrap_or(Value::Null))),
            Err(e) => Err(e).with_context(|| format!("POST {path}")),
        }
    }

    /// `POST /v1/sandboxes` until the sandbox is `running`: its id and the time it took.
    fn create(&mut self, body: &Value) -> anyhow::Result<(String, Duration)> {
        let t = Instant::now();
        let (status, mut v) = self.post("/v1/sandboxes", body)?;
        if status != 201 {
            bail!("create {body}: {status} {v}");
        }
        let id = v["id"].as_str().unwrap_or_default().to_string();
        self.live.push(id.clone());
        while v["status"] == "starting" {
            std::thread::sleep(Duration::from_millis(5));
            v = self
                .http
                .get(&self.url(&format!("/v1/sandboxes/{id}")))
                .call()
                .context("GET the sandbox")?
                .into_json()?;
        }
        let took = t.elapsed();
        if v["status"] != "running" {
            bail!("create {body}: the sandbox is {v}");
        }
        Ok((id, took))
    }

    fn delete(&mut self, id: &str) -> anyhow::Result<()> {
        self.http
            .delete(&self.url(&format!("/v1/sandboxes/{id}")))
            .call()
            .with_context(|| format!("DELETE {id}"))?;
        self.live.retain(|l| l != id);
        Ok(())
    }

    /// `POST /v1/run` of `echo hi` in `image`: the time it took.
    fn run_echo(&self, image: Option<&str>) -> anyhow::Result<Duration> {
        let mut body = json!({ "command": "echo hi" });
        if let Some(i) = image {
            body["image"] = json!(i);
        }
        let t = Instant::now();
        let (status, v) = self.post("/v1/run", &body)?;
        let took = t.elapsed();
        if status != 200 || v["stdout"] != "hi\n" {
            bail!("run {body}: {status} {v}");
        }
        Ok(took)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        for id in std::mem::take(&mut self.live) {
            let _ = self
                .http
                .delete(&self.url(&format!("/v1/sandboxes/{id}")))
                .call();
        }
        if let Some(pid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `len` bytes that do not compress, different for every `seed`.
fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        out.extend_from_slice(&s.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// The bench image, `nonce` in both layers. Its layers and config.
struct BenchImage {
    layers: Vec<Layer>,
    config: Vec<u8>,
    tar_bytes: usize,
}

fn bench_image(args: &Args, nonce: u64) -> anyhow::Result<BenchImage> {
    let rootfs = args.images_dir.join("base/rootfs");
    let base = Tar::new()
        .tree(&rootfs, args.uid_base)
        .with_context(|| format!("tar {}", rootfs.display()))?
        .file("etc/sbx-bench-nonce", nonce.to_string().as_bytes())
        .done();
    let noise = Tar::new()
        .dir("opt/")
        .file_mode(
            "opt/noise",
            0o644,
            &random_bytes(args.random_mib << 20, nonce),
        )
        .done();
    let tar_bytes = base.len() + noise.len();
    let layers = vec![
        Layer::new(base, Compression::Gzip),
        Layer::new(noise, Compression::Gzip),
    ];
    let config = json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "WorkingDir": "/",
            "Labels": { "nonce": nonce.to_string() },
        },
        "rootfs": {
            "type": "layers",
            "diff_ids": layers.iter().map(|l| l.diff_id.clone()).collect::<Vec<_>>(),
        },
    });
    Ok(BenchImage {
        layers,
        config: serde_json::to_vec(&config)?,
        tar_bytes,
    })
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let work = tempfile::Builder::new()
        .prefix("sbx-bench-images-")
        .tempdir_in(&args.work_dir)
        .with_context(|| format!("a directory in {}", args.work_dir.display()))?;
    // Dropped in this order: the node (its sandboxes), the registry, then the directory.
    let reg = Registry::start_in(work.path(), None)?;
    let mut node = Node::start(&args, work.path(), &reg.host())?;
    let r = bench(&args, &reg, &mut node);
    if r.is_err() {
        eprintln!("--- the node's log ---\n{}", node.log_text());
    }
    drop(node);
    drop(reg);
    r
}

fn bench(args: &Args, reg: &Registry, node: &mut Node) -> anyhow::Result<()> {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    let mut pulls = Row {
        what: "create, image not on the node (pull + 1st sandbox)".into(),
        ms: Vec::new(),
    };
    let (mut blob_bytes, mut tar_bytes) = (0, 0);
    let mut image = String::new();
    for i in 0..args.pulls.max(1) {
        let nonce = seed.wrapping_add(i as u64);
        let img = bench_image(args, nonce)?;
        blob_bytes = img.layers.iter().map(|l| l.blob.len()).sum::<usize>();
        tar_bytes = img.tar_bytes;
        let tag = format!("n{nonce:x}");
        reg.push_image("bench/big", Some(&tag), &img.layers, &img.config)?;
        drop(img);
        image = format!("{}/bench/big:{tag}", reg.host());
        let (id, took) = node.create(&json!({ "image": image }))?;
        pulls.ms.push(took.as_secs_f64() * 1e3);
        node.delete(&id)?;
    }

    let mut rows = vec![pulls];
    for (what, img) in [
        ("create, image on the node (next sandbox)", Some(&image)),
        ("create, base image (for comparison)", None),
    ] {
        let body = match img {
            Some(i) => json!({ "image": i }),
            None => json!({}),
        };
        let mut row = Row {
            what: what.into(),
            ms: Vec::new(),
        };
        for _ in 0..args.creates {
            let (id, took) = node.create(&body)?;
            row.ms.push(took.as_secs_f64() * 1e3);
            node.delete(&id)?;
        }
        rows.push(row);
    }
    for (what, img) in [
        ("POST /v1/run echo hi, pulled image", Some(image.as_str())),
        ("POST /v1/run echo hi, base image", None),
    ] {
        let mut row = Row {
            what: what.into(),
            ms: Vec::new(),
        };
        for _ in 0..args.runs {
            row.ms.push(node.run_echo(img)?.as_secs_f64() * 1e3);
        }
        rows.push(row);
    }

    println!(
        "sbx images over a loopback registry (docker-registry), on this machine ({} cores)",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)
    );
    println!(
        "image: 2 gzip layers (the base rootfs; {} MiB of random bytes), {:.0} MB as pulled, \
         {:.0} MB as tar; a fresh image (every layer new) per pull",
        args.random_mib,
        blob_bytes as f64 / 1e6,
        tar_bytes as f64 / 1e6
    );
    println!(
        "{:<52} {:>4} {:>9} {:>9} {:>9} {:>9}",
        "what (until running / until the answer)", "n", "p50 ms", "p95 ms", "min ms", "max ms"
    );
    for r in &rows {
        println!(
            "{:<52} {:>4} {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
            r.what,
            r.ms.len(),
            r.pct(0.5),
            r.pct(0.95),
            r.pct(0.0),
            r.pct(1.0)
        );
    }
    if let Some(p) = rows.first() {
        println!(
            "pull + first sandbox p50: {:.0} MB/s of the image as pulled",
            blob_bytes as f64 / (p.pct(0.5) / 1e3) / 1e6
        );
    }
    Ok(())
}
