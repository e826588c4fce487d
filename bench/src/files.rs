//! `sbx-bench-files`: the file API's throughput, one upload (`PUT …/files`) and one download
//! (`GET …/files`) of `--bytes` to and from a live sandbox over loopback, and the node's memory
//! meanwhile: its RSS sampled every 20 ms during each transfer and its VmHWM (peak RSS over its
//! life) from /proc/<pid>/status. The node must not hold a file: its peak stays near its idle
//! RSS whatever the size. Prints a table; exits non-zero when a transfer is short or wrong.

#![forbid(unsafe_code)]

use std::io::Read;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use serde_json::{json, Value};

#[derive(Parser, Debug)]
struct Args {
    /// The node to measure.
    #[arg(long, default_value = "http://127.0.0.1:7799")]
    url: String,
    /// The node's pid (its memory is read from /proc).
    #[arg(long)]
    pid: u32,
    /// Bytes of each transfer.
    #[arg(long, default_value_t = 1 << 30)]
    bytes: u64,
    /// Also a pass of this many bytes each way, for memory only (0: none).
    #[arg(long, default_value_t = 0)]
    memory_pass_bytes: u64,
    /// Fail when the node's peak RSS during a transfer is over this many MiB.
    #[arg(long, default_value_t = 256)]
    max_rss_mib: u64,
}

/// `len` bytes of a 1 MiB block that does not compress, cheap to make.
struct Source {
    block: Vec<u8>,
    at: usize,
    left: u64,
}

impl Source {
    fn new(len: u64) -> Source {
        let mut s = 0x2545_f491_4f6c_dd1du64;
        let block = (0..1 << 20)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s as u8
            })
            .collect();
        Source {
            block,
            at: 0,
            left: len,
        }
    }
}

impl Read for Source {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = (buf.len() as u64)
            .min(self.left)
            .min((self.block.len() - self.at) as u64) as usize;
        buf[..n].copy_from_slice(&self.block[self.at..self.at + n]);
        self.at = (self.at + n) % self.block.len();
        self.left -= n as u64;
        Ok(n)
    }
}

fn status_kib(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Samples the node's RSS until stopped: the highest seen, KiB.
struct Sampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    handle: std::thread::JoinHandle<()>,
}

impl Sampler {
    fn start(pid: u32) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(0));
        let (s, p) = (stop.clone(), peak.clone());
        let handle = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                p.fetch_max(status_kib(pid, "VmRSS:"), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        Sampler { stop, peak, handle }
    }

    fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.handle.join();
        self.peak.load(Ordering::Relaxed)
    }
}

struct Row {
    what: String,
    bytes: u64,
    secs: f64,
    peak_rss_kib: u64,
}

fn upload(agent: &ureq::Agent, url: &str, sb: &str, path: &str, len: u64) -> anyhow::Result<f64> {
    let t = Instant::now();
    let resp = agent
        .put(&format!("{url}/v1/sandboxes/{sb}/files"))
        .query("path", path)
        .set("content-type", "application/octet-stream")
        .set("content-length", &len.to_string())
        .send(Source::new(len));
    let v: Value = match resp {
        Ok(r) => r.into_json()?,
        Err(ureq::Error::Status(c, r)) => bail!("upload: {c}: {}", r.into_string()?),
        Err(e) => bail!("upload: {e}"),
    };
    let secs = t.elapsed().as_secs_f64();
    if v["bytes_written"].as_u64() != Some(len) {
        bail!("upload: {v}");
    }
    Ok(secs)
}

fn download(agent: &ureq::Agent, url: &str, sb: &str, path: &str, len: u64) -> anyhow::Result<f64> {
    let t = Instant::now();
    let resp = agent
        .get(&format!("{url}/v1/sandboxes/{sb}/files"))
        .query("path", path)
        .call()
        .context("download")?;
    let mut r = resp.into_reader();
    let mut buf = vec![0u8; 1 << 20];
    let mut want = Source::new(len);
    let mut cmp = vec![0u8; 1 << 20];
    let mut got = 0u64;
    loop {
        let n = r.read(&mut buf)?;
        if n == 0 {
            break;
        }
        // Every byte is checked against what was sent.
        want.read_exact(&mut cmp[..n])?;
        if buf[..n] != cmp[..n] {
            bail!("download: the bytes at {got} differ");
        }
        got += n as u64;
    }
    let secs = t.elapsed().as_secs_f64();
    if got != len {
        bail!("download: {got} bytes of {len}");
    }
    Ok(secs)
}

fn pass(
    args: &Args,
    agent: &ureq::Agent,
    sb: &str,
    len: u64,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let url = args.url.trim_end_matches('/');
    let path = format!("/tmp/bench-{len}");
    let s = Sampler::start(args.pid);
    let secs = upload(agent, url, sb, &path, len)?;
    rows.push(Row {
        what: format!("upload {} MiB", len >> 20),
        bytes: len,
        secs,
        peak_rss_kib: s.finish(),
    });
    let s = Sampler::start(args.pid);
    let secs = download(agent, url, sb, &path, len)?;
    rows.push(Row {
        what: format!("download {} MiB", len >> 20),
        bytes: len,
        secs,
        peak_rss_kib: s.finish(),
    });
    let _ = agent
        .post(&format!("{url}/v1/sandboxes/{sb}/files/rm"))
        .query("path", &path)
        .call();
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let agent = ureq::AgentBuilder::new()
        .timeout_connect(Duration::from_secs(5))
        .build();
    let url = args.url.trim_end_matches('/');
    let created: Value = agent
        .post(&format!("{url}/v1/sandboxes"))
        .send_json(json!({ "limits": { "memory_bytes": 1u64 << 30 } }))
        .context("create a sandbox")?
        .into_json()?;
    let sb = created["id"].as_str().unwrap_or("").to_string();
    if created["status"] != "running" {
        bail!("the sandbox did not start: {created}");
    }
    let idle = status_kib(args.pid, "VmRSS:");
    let mut rows = Vec::new();
    let r = (|| {
        pass(&args, &agent, &sb, args.bytes, &mut rows)?;
        if args.memory_pass_bytes > 0 {
            pass(&args, &agent, &sb, args.memory_pass_bytes, &mut rows)?;
        }
        anyhow::Ok(())
    })();
    let _ = agent.delete(&format!("{url}/v1/sandboxes/{sb}")).call();
    r?;
    let hwm = status_kib(args.pid, "VmHWM:");
    println!("sbx file API over loopback (one sandbox, one transfer at a time)");
    println!(
        "{:<20} {:>10} {:>10} {:>16}",
        "transfer", "seconds", "MB/s", "node peak RSS"
    );
    for r in &rows {
        println!(
            "{:<20} {:>10.2} {:>10.0} {:>12.1} MiB",
            r.what,
            r.secs,
            r.bytes as f64 / r.secs / 1e6,
            r.peak_rss_kib as f64 / 1024.0
        );
    }
    println!(
        "node RSS idle {:.1} MiB, VmHWM (peak over its life) {:.1} MiB",
        idle as f64 / 1024.0,
        hwm as f64 / 1024.0
    );
    if hwm > args.max_rss_mib << 10 {
        bail!(
            "the node's peak RSS {} MiB is over {} MiB",
            hwm >> 10,
            args.max_rss_mib
        );
    }
    Ok(())
}
