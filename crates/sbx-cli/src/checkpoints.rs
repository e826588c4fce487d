//! `sbx sleep`, `sbx wake`, `sbx snapshot`, `sbx fork`: a sandbox's processes checkpointed
//! to disk and back (the node's CRIU), its snapshots, and copies of it that go on from now.

use serde_json::{json, Value};

use crate::sandboxes::req;
use crate::{api_error, Cli};

#[derive(clap::Args, Debug)]
pub struct SleepArgs {
    /// The sandboxes (ids or names).
    #[arg(required = true)]
    sandboxes: Vec<String>,
    /// Print the sandbox objects as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
pub struct SnapshotArgs {
    /// The sandbox (id or name); with --ls or --rm, nothing.
    sandbox: Option<String>,
    /// A name for the snapshot.
    #[arg(long)]
    name: Option<String>,
    /// List the node's snapshots.
    #[arg(long, conflicts_with_all = ["sandbox", "name", "rm"])]
    ls: bool,
    /// Delete a snapshot (id or name).
    #[arg(long, value_name = "SNAPSHOT", conflicts_with_all = ["sandbox", "name"])]
    rm: Option<String>,
    /// Print the answer as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
pub struct ForkArgs {
    /// The sandbox (id or name) to copy.
    sandbox: String,
    /// How many copies.
    #[arg(long, short = 'n', default_value_t = 1)]
    count: u32,
    /// Print the answer as JSON.
    #[arg(long)]
    json: bool,
}

fn post(cli: &Cli, path: &str, body: Value) -> anyhow::Result<Value> {
    Ok(req(cli, "POST", path)
        .send_json(body)
        .map_err(api_error)?
        .into_json()?)
}

/// `sbx sleep` (`wake: false`) and `sbx wake`.
pub fn sleep(cli: &Cli, a: &SleepArgs, wake: bool) -> anyhow::Result<u8> {
    let verb = if wake { "wake" } else { "sleep" };
    let mut code = 0;
    let mut all = Vec::new();
    for s in &a.sandboxes {
        match post(cli, &format!("/v1/sandboxes/{s}/{verb}"), json!({})) {
            Ok(obj) if a.json => all.push(obj),
            Ok(obj) => println!(
                "{} {}",
                obj["id"].as_str().unwrap_or(s),
                obj["status"].as_str().unwrap_or("")
            ),
            Err(e) => {
                eprintln!("sbx: {s}: {e:#}");
                code = 1;
            }
        }
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&all)?);
    }
    Ok(code)
}

pub fn snapshot(cli: &Cli, a: &SnapshotArgs) -> anyhow::Result<u8> {
    if a.ls {
        let v: Value = req(cli, "GET", "/v1/snapshots")
            .call()
            .map_err(api_error)?
            .into_json()?;
        if a.json {
            println!("{}", serde_json::to_string_pretty(&v)?);
            return Ok(0);
        }
        println!(
            "{:<22} {:<20} {:<10} {:>10}  {:<22} CREATED",
            "ID", "NAME", "STATUS", "SIZE", "SANDBOX"
        );
        for s in v["data"].as_array().into_iter().flatten() {
            println!(
                "{:<22} {:<20} {:<10} {:>10}  {:<22} {}",
                s["id"].as_str().unwrap_or(""),
                s["name"].as_str().unwrap_or("-"),
                s["status"].as_str().unwrap_or(""),
                human_size(s["size_bytes"].as_u64().unwrap_or(0)),
                s["sandbox_id"].as_str().unwrap_or(""),
                s["created_at"].as_str().unwrap_or(""),
            );
        }
        return Ok(0);
    }
    if let Some(snap) = &a.rm {
        req(cli, "DELETE", &format!("/v1/snapshots/{snap}"))
            .call()
            .map_err(api_error)?;
        println!("{snap}");
        return Ok(0);
    }
    let Some(sandbox) = &a.sandbox else {
        anyhow::bail!("name a sandbox (or --ls, --rm SNAPSHOT)");
    };
    let mut body = json!({});
    if let Some(n) = &a.name {
        body["name"] = json!(n);
    }
    let v = post(cli, &format!("/v1/sandboxes/{sandbox}/snapshots"), body)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("{}", v["id"].as_str().unwrap_or(""));
    }
    Ok(0)
}

pub fn fork(cli: &Cli, a: &ForkArgs) -> anyhow::Result<u8> {
    let v = post(
        cli,
        &format!("/v1/sandboxes/{}/fork", a.sandbox),
        json!({ "count": a.count }),
    )?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        for s in v["sandboxes"].as_array().into_iter().flatten() {
            println!("{}", s["id"].as_str().unwrap_or(""));
        }
    }
    Ok(0)
}

fn human_size(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}
