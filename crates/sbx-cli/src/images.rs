//! `sbx pull IMAGE` (the node pulls an OCI image; a progress bar per layer from the node's
//! event stream), `sbx images` (the node's images: base and pulled ones) and `sbx templates`
//! (the node's templates, from GET /internal/node).

use std::collections::HashMap;
use std::io::{BufRead, BufReader};

use anyhow::{anyhow, bail};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use serde_json::{json, Value};

use crate::{agent, api_error, Cli};

#[derive(clap::Args, Debug)]
pub struct PullArgs {
    /// An image reference: [host[:port]/]name[:tag][@sha256:…].
    image: String,
    /// The secret (PUT /v1/secrets/NAME) holding the registry's username:password.
    #[arg(long)]
    secret: Option<String>,
}

#[derive(clap::Args, Debug)]
pub struct ImagesArgs {
    /// Print the list as JSON.
    #[arg(long)]
    json: bool,
}

fn req(cli: &Cli, method: &str, path: &str) -> ureq::Request {
    let mut r = agent().request(method, &format!("{}{path}", cli.url.trim_end_matches('/')));
    if let Some(k) = &cli.api_key {
        r = r.set("authorization", &format!("Bearer {k}"));
    }
    r
}

pub fn pull(cli: &Cli, a: &PullArgs) -> anyhow::Result<u8> {
    let mut body = json!({ "image": a.image });
    if let Some(s) = &a.secret {
        body["image_pull_secret"] = json!(s);
    }
    let resp = req(cli, "POST", "/v1/images/pull")
        .set("accept", "text/event-stream")
        .send_json(body)
        .map_err(api_error)?;
    let bars = MultiProgress::new();
    let style = ProgressStyle::with_template(
        "{prefix:>14} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}",
    )
    .map_err(|e| anyhow!("{e}"))?
    .progress_chars("=> ");
    let mut layers: HashMap<String, ProgressBar> = HashMap::new();
    let mut event = String::new();
    for line in BufReader::new(resp.into_reader()).lines() {
        let line = line?;
        if let Some(kind) = line.strip_prefix("event: ") {
            event = kind.to_string();
            continue;
        }
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        let v: Value = serde_json::from_str(data)?;
        match event.as_str() {
            "progress" => {
                let layer = v["layer"].as_str().unwrap_or("?").to_string();
                let bar = layers.entry(layer.clone()).or_insert_with(|| {
                    let b = bars.add(ProgressBar::new(v["total"].as_u64().unwrap_or(0)));
                    b.set_style(style.clone());
                    let short = layer.trim_start_matches("sha256:");
                    b.set_prefix(short.chars().take(12).collect::<String>());
                    b
                });
                bar.set_length(v["total"].as_u64().unwrap_or(0));
                bar.set_position(v["done"].as_u64().unwrap_or(0));
            }
            "done" => {
                for b in layers.values() {
                    b.finish();
                }
                println!(
                    "{} {}",
                    v["reference"].as_str().unwrap_or(&a.image),
                    v["digest"].as_str().unwrap_or("")
                );
                return Ok(0);
            }
            "error" => {
                for b in layers.values() {
                    b.abandon();
                }
                bail!(
                    "{}: {}",
                    v["code"].as_str().unwrap_or("error"),
                    v["message"].as_str().unwrap_or("")
                );
            }
            _ => {}
        }
    }
    bail!("the node's stream ended without a done or error event")
}

pub fn images(cli: &Cli, a: &ImagesArgs) -> anyhow::Result<u8> {
    let v: Value = req(cli, "GET", "/v1/images")
        .call()
        .map_err(api_error)?
        .into_json()?;
    let all = v["data"].as_array().cloned().unwrap_or_default();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(0);
    }
    println!("{:<50} {:<20} {:>10}", "REFERENCE", "DIGEST", "SIZE");
    for i in all {
        let refs: Vec<&str> = i["references"]
            .as_array()
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let digest: String = i["digest"]
            .as_str()
            .map(|d| d.chars().take(19).collect())
            .unwrap_or_else(|| "-".into());
        let size = i["size"]
            .as_u64()
            .map(|s| format!("{:.1} MB", s as f64 / 1e6))
            .unwrap_or_else(|| "-".into());
        println!("{:<50} {:<20} {:>10}", refs.join(", "), digest, size);
    }
    Ok(0)
}

/// `sbx templates`: key, status, image, what starts, shape, build time.
pub fn templates(cli: &Cli, a: &ImagesArgs) -> anyhow::Result<u8> {
    let v: Value = req(cli, "GET", "/internal/node")
        .call()
        .map_err(api_error)?
        .into_json()?;
    let all = v["templates"].as_array().cloned().unwrap_or_default();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(0);
    }
    println!(
        "{:<20} {:<9} {:<40} {:<30} {:>5} {:>7} {:>9}",
        "KEY", "STATUS", "IMAGE", "START", "CPUS", "MEMORY", "BUILT"
    );
    for t in all {
        let text = |k: &str| t[k].as_str().unwrap_or("-").to_string();
        let start = match (t["start_command"].as_str(), t["start"].as_bool()) {
            (Some(c), _) => c.to_string(),
            (None, Some(true)) => "(the image's)".into(),
            (None, Some(false)) => "(nothing)".into(),
            (None, None) => "(labels)".into(),
        };
        let start: String = start.chars().take(30).collect();
        let memory = t["memory_bytes"]
            .as_u64()
            .map(|b| format!("{}M", b >> 20))
            .unwrap_or_else(|| "-".into());
        let built = t["built_ms"]
            .as_u64()
            .map(|ms| format!("{ms} ms"))
            .unwrap_or_else(|| "-".into());
        println!(
            "{:<20} {:<9} {:<40} {:<30} {:>5} {:>7} {:>9}",
            text("key"),
            text("status"),
            text("image"),
            if t["key"] == "base" {
                "-".into()
            } else {
                start
            },
            t["vcpus"]
                .as_u64()
                .map(|c| c.to_string())
                .unwrap_or_default(),
            memory,
            built
        );
    }
    Ok(0)
}
