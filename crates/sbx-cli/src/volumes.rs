//! `sbx volume create|ls|rm`, and `-v NAME:/path[:ro][,copy]` of `sbx run` and `sbx create`.

use anyhow::bail;
use serde_json::{json, Map, Value};

use crate::sandboxes::req;
use crate::{api_error, parse_memory, Cli};

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
            let mut body = Map::new();
            if let Some(n) = given.as_ref().or(name.as_ref()) {
                body.insert("name".into(), json!(n));
            }
            if let Some(s) = size {
                body.insert("size_bytes".into(), json!(parse_memory(s)?));
            }
            if *shared {
                body.insert("shared".into(), json!(true));
            }
            let v: Value = req(cli, "POST", "/v1/volumes")
                .send_json(Value::Object(body))
                .map_err(api_error)?
                .into_json()?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                println!("{}", v["id"].as_str().unwrap_or(""));
            }
            Ok(0)
        }
        VolumeCmd::Ls { json } => {
            let v: Value = req(cli, "GET", "/v1/volumes")
                .call()
                .map_err(api_error)?
                .into_json()?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&v)?);
                return Ok(0);
            }
            println!(
                "{:<22} {:<20} {:>10} {:>10} {:<6}  SANDBOXES",
                "ID", "NAME", "SIZE", "USED", "SHARED"
            );
            for vol in v["data"].as_array().into_iter().flatten() {
                let users: Vec<&str> = vol["sandboxes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .collect();
                println!(
                    "{:<22} {:<20} {:>10} {:>10} {:<6}  {}",
                    vol["id"].as_str().unwrap_or(""),
                    vol["name"].as_str().unwrap_or("-"),
                    human(vol["size_bytes"].as_u64().unwrap_or(0)),
                    human(vol["used_bytes"].as_u64().unwrap_or(0)),
                    if vol["shared"].as_bool() == Some(true) {
                        "yes"
                    } else {
                        "no"
                    },
                    if users.is_empty() {
                        "-".to_string()
                    } else {
                        users.join(",")
                    },
                );
            }
            Ok(0)
        }
        VolumeCmd::Rm { volumes } => {
            let mut code = 0;
            for v in volumes {
                match req(cli, "DELETE", &format!("/v1/volumes/{v}")).call() {
                    Ok(_) => println!("{v}"),
                    Err(e) => {
                        eprintln!("sbx: {v}: {:#}", api_error(e));
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
pub fn mounts(specs: &[String]) -> anyhow::Result<Option<Value>> {
    if specs.is_empty() {
        return Ok(None);
    }
    let mut out = Vec::new();
    for s in specs {
        let mut parts = s.splitn(3, ':');
        let (Some(vol), Some(path)) = (parts.next(), parts.next()) else {
            bail!("-v {s:?}: give VOLUME:/PATH[:ro][,copy]");
        };
        if vol.is_empty() || !path.starts_with('/') {
            bail!("-v {s:?}: give VOLUME:/PATH[:ro][,copy] (an absolute path)");
        }
        let mut m = json!({"volume": vol, "path": path});
        for opt in parts.next().into_iter().flat_map(|o| o.split(',')) {
            match opt {
                "ro" => m["read_only"] = json!(true),
                "rw" => m["read_only"] = json!(false),
                "copy" => m["copy"] = json!(true),
                other => bail!("-v {s:?}: unknown option {other:?} (ro, rw, copy)"),
            }
        }
        out.push(m);
    }
    Ok(Some(Value::Array(out)))
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
        .unwrap()
        .unwrap();
        assert_eq!(
            v,
            json!([
                {"volume": "db", "path": "/data"},
                {"volume": "vol-0123456789abcdef", "path": "/x/y", "read_only": true, "copy": true},
            ])
        );
        assert!(mounts(&[]).unwrap().is_none());
        assert!(mounts(&["db".into()]).is_err());
        assert!(mounts(&["db:rel".into()]).is_err());
        assert!(mounts(&["db:/a:rx".into()]).is_err());
        assert_eq!(human(1 << 30), "1.0GiB");
    }
}
