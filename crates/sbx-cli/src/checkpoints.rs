//! `sbx sleep`, `sbx wake`, `sbx snapshot`, `sbx fork`: a sandbox's processes checkpointed
//! to disk and back (the node's CRIU), its snapshots, and copies of it that go on from now.

use crate::{print_json, Cli};

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

/// `sbx sleep` (`wake: false`) and `sbx wake`.
pub fn sleep(cli: &Cli, a: &SleepArgs, wake: bool) -> anyhow::Result<u8> {
    let client = cli.client();
    let mut code = 0;
    let mut all = Vec::new();
    for s in &a.sandboxes {
        let r = if wake {
            client.wake_sandbox(s)
        } else {
            client.sleep_sandbox(s)
        };
        match r {
            Ok(obj) if a.json => all.push(obj),
            Ok(obj) => println!("{} {}", obj.id, obj.status.as_str()),
            Err(e) => {
                eprintln!("sbx: {s}: {e}");
                code = 1;
            }
        }
    }
    if a.json {
        print_json(&all)?;
    }
    Ok(code)
}

pub fn snapshot(cli: &Cli, a: &SnapshotArgs) -> anyhow::Result<u8> {
    let client = cli.client();
    if a.ls {
        let v = client.snapshots()?;
        if a.json {
            print_json(&v)?;
            return Ok(0);
        }
        println!(
            "{:<22} {:<20} {:<10} {:>10}  {:<22} CREATED",
            "ID", "NAME", "STATUS", "SIZE", "SANDBOX"
        );
        for s in &v.data {
            println!(
                "{:<22} {:<20} {:<10} {:>10}  {:<22} {}",
                s.id,
                s.name.as_deref().unwrap_or("-"),
                s.status,
                human_size(s.size_bytes),
                s.sandbox_id,
                s.created_at,
            );
        }
        return Ok(0);
    }
    if let Some(snap) = &a.rm {
        client.delete_snapshot(snap)?;
        println!("{snap}");
        return Ok(0);
    }
    let Some(sandbox) = &a.sandbox else {
        anyhow::bail!("name a sandbox (or --ls, --rm SNAPSHOT)");
    };
    let v = client.snapshot_sandbox(sandbox, a.name.as_deref())?;
    if a.json {
        print_json(&v)?;
    } else {
        println!("{}", v.id);
    }
    Ok(0)
}

pub fn fork(cli: &Cli, a: &ForkArgs) -> anyhow::Result<u8> {
    let v = cli.client().fork_sandbox(&a.sandbox, a.count)?;
    if a.json {
        print_json(&v)?;
    } else {
        for s in &v.sandboxes {
            println!("{}", s.id);
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
