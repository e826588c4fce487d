//! `sbx pull IMAGE` (the node pulls an OCI image; a progress bar per layer from the node's
//! event stream), `sbx images` (the node's images: base and pulled ones) and `sbx templates`
//! (the node's templates, from GET /internal/node).

use std::collections::HashMap;

use anyhow::{anyhow, bail};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use sbx_client::PullEvent;

use crate::{print_json, Cli};

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

pub fn pull(cli: &Cli, a: &PullArgs) -> anyhow::Result<u8> {
    let events = cli.client().pull_image(&a.image, a.secret.as_deref())?;
    let bars = MultiProgress::new();
    let style = ProgressStyle::with_template(
        "{prefix:>14} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}",
    )
    .map_err(|e| anyhow!("{e}"))?
    .progress_chars("=> ");
    let mut layers: HashMap<String, ProgressBar> = HashMap::new();
    for ev in events {
        match ev {
            Ok(PullEvent::Progress { layer, done, total }) => {
                let bar = layers.entry(layer.clone()).or_insert_with(|| {
                    let b = bars.add(ProgressBar::new(total));
                    b.set_style(style.clone());
                    let short = layer.trim_start_matches("sha256:");
                    b.set_prefix(short.chars().take(12).collect::<String>());
                    b
                });
                bar.set_length(total);
                bar.set_position(done);
            }
            Ok(PullEvent::Done(p)) => {
                for b in layers.values() {
                    b.finish();
                }
                println!("{} {}", p.reference, p.digest.as_deref().unwrap_or(""));
                return Ok(0);
            }
            Ok(PullEvent::Failed { code, message }) => {
                for b in layers.values() {
                    b.abandon();
                }
                bail!("{code}: {message}");
            }
            Err(sbx_client::Error::StreamEnded { .. }) => break,
            Err(e) => return Err(e.into()),
        }
    }
    bail!("the node's stream ended without a done or error event")
}

pub fn images(cli: &Cli, a: &ImagesArgs) -> anyhow::Result<u8> {
    let all = cli.client().images()?.data;
    if a.json {
        print_json(&all)?;
        return Ok(0);
    }
    println!("{:<50} {:<20} {:>10}", "REFERENCE", "DIGEST", "SIZE");
    for i in all {
        let digest: String = i
            .digest
            .as_deref()
            .map(|d| d.chars().take(19).collect())
            .unwrap_or_else(|| "-".into());
        let size = i
            .size
            .map(|s| format!("{:.1} MB", s as f64 / 1e6))
            .unwrap_or_else(|| "-".into());
        println!(
            "{:<50} {:<20} {:>10}",
            i.references.join(", "),
            digest,
            size
        );
    }
    Ok(0)
}

/// `sbx templates`: key, status, image, what starts, shape, build time.
pub fn templates(cli: &Cli, a: &ImagesArgs) -> anyhow::Result<u8> {
    let all = cli.client().node_info()?.templates;
    if a.json {
        print_json(&all)?;
        return Ok(0);
    }
    println!(
        "{:<20} {:<9} {:<40} {:<30} {:>5} {:>7} {:>9}",
        "KEY", "STATUS", "IMAGE", "START", "CPUS", "MEMORY", "BUILT"
    );
    for t in all {
        let start = match (t.start_command.get(), t.start.get()) {
            (Some(c), _) => c.clone(),
            (None, Some(true)) => "(the image's)".into(),
            (None, Some(false)) => "(nothing)".into(),
            (None, None) => "(labels)".into(),
        };
        let start: String = start.chars().take(30).collect();
        let built = t
            .built_ms
            .get()
            .map(|ms| format!("{ms} ms"))
            .unwrap_or_else(|| "-".into());
        println!(
            "{:<20} {:<9} {:<40} {:<30} {:>5} {:>7} {:>9}",
            t.key,
            t.status,
            t.image,
            if t.key == "base" { "-".into() } else { start },
            t.vcpus,
            format!("{}M", t.memory_bytes >> 20),
            built
        );
    }
    Ok(0)
}
