//! `sbx volume create|ls|rm`, and `-v NAME:/path[:ro][,copy]` of `sbx run` and `sbx create`.

use anyhow::bail;
use sbx_api::{VolumeCreate, VolumeMount};

use crate::{parse_memory, print_json, Cli};

#[derive(clap::Subcommand, Debug)]
pub enum VolumeCmd {
    /// Make a volume (its id is printed): a directory of the node's disk of its own size that
    /// outlives sandboxes.
    Create {
        /// Its name (mount it by name or id), as in `docker volume create NAME`.
        #[arg(value_name = "NAME", conflicts_with = "name")]
        given: Option<String>,
        /// Its name, the same as NAME.
        #[arg(long)]
        name: Option<String>,
        /// Its size: bytes, or with a unit (512m, 10g); default: the node's.
        #[arg(long)]
        size: Option<String>,
        /// Several sandboxes may mount it at once.
        #[arg(long)]
        shared: bool,
        /// Print the volume object as JSON.
        #[arg(long)]
        json: bool,
    },
    /// List the node's volumes.
    Ls {
        /// Print the list as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Delete volumes (ids or names) with their files; one still mounted is refused.
    Rm {
        #[arg(required = true)]
        volumes: Vec<String>,
    },
}

pub fn volume(cli: &Cli, cmd: &VolumeCmd) -> anyhow::Result<u8> {
    match cmd {
        VolumeCmd::Create {
            given,
            name,
            size,
            shared,
            json,
        } => {
            let c = VolumeCreate {
                name: given.clone().or_else(|| name.clone()),
                size_bytes: size.as_deref().map(parse_memory).transpose()?,
                shared: *shared,
            };
            let v = cli.client().create_volume(&c)?;
            if *json {
                print_json(&v)?;
            } else {
                println!("{}", v.id);
            }
            Ok(0)
        }
        VolumeCmd::Ls { json } => {
            let v = cli.client().volumes()?;
            if *json {
                print_json(&v)?;
                return Ok(0);
            }
            println!(
                "{:<22} {:<20} {:>10} {:>10} {:<6}  SANDBOXES",
                "ID", "NAME", "SIZE", "USED", "SHARED"
            );
            for vol in &v.data {
                println!(
                    "{:<22} {:<20} {:>10} {:>10} {:<6}  {}",
                    vol.id,
                    vol.name.as_deref().unwrap_or("-"),
                    human(vol.size_bytes),
                    human(vol.used_bytes),
                    if vol.shared { "yes" } else { "no" },
                    if vol.sandboxes.is_empty() {
                        "-".to_string()
                    } else {
                        vol.sandboxes.join(",")
                    },
                );
            }
            Ok(0)
        }
        VolumeCmd::Rm { volumes } => {
            let client = cli.client();
            let mut code = 0;
            for v in volumes {
                match client.delete_volume(v) {
                    Ok(()) => println!("{v}"),
                    Err(e) => {
                        eprintln!("sbx: {v}: {e}");
                        code = 1;
                    }
                }
            }
            Ok(code)
        }
    }
}

fn human(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n}B")
    } else {
        format!("{v:.1}{}", UNITS[u])
    }
}

/// `-v NAME:/path[:OPTS]` (OPTS: `ro`, `copy`, comma-separated) as the body's `volumes`.
pub fn mounts(specs: &[String]) -> anyhow::Result<Vec<VolumeMount>> {
    let mut out = Vec::new();
    for s in specs {
        let mut parts = s.splitn(3, ':');
        let (Some(vol), Some(path)) = (parts.next(), parts.next()) else {
            bail!("-v {s:?}: give VOLUME:/PATH[:ro][,copy]");
        };
        if vol.is_empty() || !path.starts_with('/') {
            bail!("-v {s:?}: give VOLUME:/PATH[:ro][,copy] (an absolute path)");
        }
        let mut m = VolumeMount {
            path: path.to_string(),
            volume: vol.to_string(),
            read_only: false,
            copy: false,
            version: None,
        };
        for opt in parts.next().into_iter().flat_map(|o| o.split(',')) {
            match opt {
                "ro" => m.read_only = true,
                "rw" => m.read_only = false,
                "copy" => m.copy = true,
                other => bail!("-v {s:?}: unknown option {other:?} (ro, rw, copy)"),
            }
        }
        out.push(m);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_flags_are_parsed() {
        let v = mounts(&[
            "db:/data".into(),
            "vol-0123456789abcdef:/x/y:ro,copy".into(),
        ])
        .unwrap();
        let mut r = sbx_api::RunRequest::new(sbx_api::Command::Shell("true".into()));
        r.volumes = v;
        assert_eq!(
            r.to_json()["volumes"],
            serde_json::json!([
                {"volume": "db", "path": "/data"},
                {"volume": "vol-0123456789abcdef", "path": "/x/y", "read_only": true, "copy": true},
            ])
        );
        assert!(mounts(&[]).unwrap().is_empty());
        assert!(mounts(&["db".into()]).is_err());
        assert!(mounts(&["db:rel".into()]).is_err());
        assert!(mounts(&["db:/a:rx".into()]).is_err());
        assert_eq!(human(1 << 30), "1.0GiB");
    }
}
