//! The node's config file (`sandboxd --config FILE`, TOML): the settings of the functions
//! interface (`sandbox::*`) and the node settings they share with the command line.
//!
//! ```toml
//! image_allowlist = ["python", "node"]   # when set, only these images boot (others: S100)
//! max_concurrent_exec_per_sandbox = 4    # execs at once in one sandbox (over it: S003)
//! max_exec_timeout_ms = 300000           # the longest (and the default) exec timeout
//! idle_timeout_secs = 600                # default idle timeout of sandbox::create (0: none)
//! max_sandboxes = 64                     # sandboxes at once (over it: S400; default: from the
//!                                        # machine, see README "Capacity"; --max-sandboxes wins)
//! default_cpus = 1                       # shape of a sandbox that asks for none
//! default_memory_mb = 512
//! docs_base_url = "https://iii.dev/docs/sandbox#"   # errors' docs_url is this + the S-code
//!
//! insecure_registries = ["127.0.0.1:5000"]   # plain HTTP to these (= --insecure-registry)
//!
//! [catalog]                             # catalog names -> images of a registry; the base
//! python = "127.0.0.1:5000/library/python:3.12"  # image serves when the registry cannot be
//! node = "127.0.0.1:5000/library/node:22"        # reached (offline)
//!
//! [[custom_images]]                      # more catalog names
//! name = "py"
//! oci_ref = "docker.io/library/python:3.12"
//! image = "python"                       # the local image it boots (none: S101 on boot)
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;
use serde::Deserialize;

/// An image the operator registered.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct CustomImage {
    pub name: String,
    pub oci_ref: String,
    /// The local image (a catalog name) it boots as; without it its rootfs is missing.
    #[serde(default)]
    pub image: Option<String>,
}

/// The config file.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub image_allowlist: Option<Vec<String>>,
    pub custom_images: Vec<CustomImage>,
    pub max_concurrent_exec_per_sandbox: Option<usize>,
    pub max_exec_timeout_ms: u64,
    pub idle_timeout_secs: u64,
    /// The most sandboxes at once; none: `--max-sandboxes`, else derived from the machine
    /// (`node::capacity`).
    pub max_sandboxes: Option<usize>,
    pub default_cpus: Option<u32>,
    pub default_memory_mb: Option<u64>,
    pub docs_base_url: Option<String>,
    /// `python` / `node` -> an OCI reference, pulled like any image; the base image when its
    /// registry cannot be reached. Not set: the base image.
    pub catalog: BTreeMap<String, String>,
    /// Registries (`HOST:PORT`) pulled from over plain HTTP, with `--insecure-registry`'s.
    pub insecure_registries: Vec<String>,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            image_allowlist: None,
            custom_images: Vec::new(),
            max_concurrent_exec_per_sandbox: None,
            max_exec_timeout_ms: 300_000,
            idle_timeout_secs: 600,
            max_sandboxes: None,
            default_cpus: None,
            default_memory_mb: None,
            docs_base_url: None,
            catalog: BTreeMap::new(),
            insecure_registries: Vec::new(),
        }
    }
}

impl Config {
    /// Reads and checks a config file.
    pub fn load(path: &Path) -> anyhow::Result<Config> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
        let cfg: Config =
            toml::from_str(&text).with_context(|| format!("parse {}", path.display()))?;
        anyhow::ensure!(
            cfg.max_exec_timeout_ms > 0,
            "max_exec_timeout_ms must be over 0"
        );
        anyhow::ensure!(cfg.max_sandboxes != Some(0), "max_sandboxes must be over 0");
        anyhow::ensure!(
            cfg.max_concurrent_exec_per_sandbox != Some(0),
            "max_concurrent_exec_per_sandbox must be over 0"
        );
        for (name, reference) in &cfg.catalog {
            anyhow::ensure!(
                matches!(name.as_str(), "python" | "node"),
                "catalog: {name} is not a catalog name (python, node)"
            );
            sbx_image::parse_reference(reference)
                .map_err(|e| anyhow::anyhow!("catalog.{name}: {e}"))?;
        }
        Ok(cfg)
    }

    /// Whether `name` may boot.
    pub fn allowed(&self, name: &str) -> bool {
        match &self.image_allowlist {
            None => true,
            Some(l) => l.iter().any(|n| n == name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_key_and_defaults() {
        let c: Config = toml::from_str(
            "image_allowlist = [\"python\"]\nmax_concurrent_exec_per_sandbox = 2\n\
             max_exec_timeout_ms = 1000\nidle_timeout_secs = 5\nmax_sandboxes = 3\n\
             default_cpus = 1\ndefault_memory_mb = 256\n\
             [[custom_images]]\nname = \"py\"\noci_ref = \"x/y:1\"\nimage = \"python\"\n",
        )
        .unwrap();
        assert_eq!(c.max_concurrent_exec_per_sandbox, Some(2));
        assert!(c.allowed("python") && !c.allowed("node"));
        assert_eq!(c.custom_images[0].image.as_deref(), Some("python"));
        let d: Config = toml::from_str("").unwrap();
        assert_eq!(d, Config::default());
        assert!(d.allowed("node"));
        assert!(toml::from_str::<Config>("nope = 1").is_err());
        let c: Config = toml::from_str("insecure_registries = [\"127.0.0.1:5000\"]\n").unwrap();
        assert_eq!(c.insecure_registries, ["127.0.0.1:5000"]);
        let c: Config = toml::from_str("[catalog]\npython = \"127.0.0.1:5000/py:3\"\n").unwrap();
        assert_eq!(c.catalog["python"], "127.0.0.1:5000/py:3");
    }

    #[test]
    fn catalog_entries_are_checked() {
        let dir = std::env::temp_dir().join(format!("sbx-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.toml");
        for (text, ok) in [
            ("[catalog]\npython = \"127.0.0.1:5000/py:3\"\n", true),
            ("[catalog]\nruby = \"127.0.0.1:5000/rb:3\"\n", false),
            ("[catalog]\nnode = \"UPPER/Case\"\n", false),
        ] {
            std::fs::write(&path, text).unwrap();
            assert_eq!(Config::load(&path).is_ok(), ok, "{text}");
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}
