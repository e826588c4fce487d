//! The JSON documents of an image: index, manifest, config. Only the fields this store uses;
//! both the OCI and the Docker v2 forms.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};

use crate::error::ImageError;

pub(crate) const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub(crate) const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub(crate) const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub(crate) const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";

/// Every manifest kind asked for (the Accept header of a manifest request).
pub(crate) const ACCEPTED_MANIFESTS: &[&str] =
    &[OCI_INDEX, DOCKER_LIST, OCI_MANIFEST, DOCKER_MANIFEST];

const CONFIG_TYPES: &[&str] = &[
    "application/vnd.oci.image.config.v1+json",
    "application/vnd.docker.container.image.v1+json",
];

const LAYER_TYPES: &[&str] = &[
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
];

/// A content descriptor.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Descriptor {
    #[serde(default)]
    pub media_type: String,
    pub digest: String,
    #[serde(default)]
    pub size: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub urls: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<Platform>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct Platform {
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub os: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variant: Option<String>,
}

/// What a manifest request answered.
pub(crate) enum Manifest {
    Index(Vec<Descriptor>),
    Image {
        config: Descriptor,
        layers: Vec<Descriptor>,
    },
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawManifest {
    schema_version: Option<i64>,
    media_type: Option<String>,
    config: Option<Descriptor>,
    layers: Option<Vec<Descriptor>>,
    manifests: Option<Vec<Descriptor>>,
}

/// Parses a manifest or an index (one without a media type is told by its fields).
pub(crate) fn parse_manifest(body: &[u8]) -> Result<Manifest, ImageError> {
    let raw: RawManifest =
        serde_json::from_slice(body).map_err(|e| ImageError::invalid(format!("manifest: {e}")))?;
    if raw.schema_version != Some(2) {
        return Err(ImageError::UnsupportedMediaType(format!(
            "manifest schema version {}",
            raw.schema_version.unwrap_or(0)
        )));
    }
    let kind = match raw.media_type.as_deref() {
        Some(t) => t.to_string(),
        None if raw.manifests.is_some() => OCI_INDEX.to_string(),
        None => OCI_MANIFEST.to_string(),
    };
    match kind.as_str() {
        OCI_INDEX | DOCKER_LIST => Ok(Manifest::Index(raw.manifests.unwrap_or_default())),
        OCI_MANIFEST | DOCKER_MANIFEST => {
            let config = raw
                .config
                .ok_or_else(|| ImageError::invalid("manifest without config"))?;
            if !CONFIG_TYPES.contains(&config.media_type.as_str()) {
                return Err(ImageError::UnsupportedMediaType(config.media_type));
            }
            let layers = raw.layers.unwrap_or_default();
            for l in &layers {
                if !LAYER_TYPES.contains(&l.media_type.as_str()) {
                    return Err(ImageError::UnsupportedMediaType(l.media_type.clone()));
                }
            }
            for d in std::iter::once(&config).chain(&layers) {
                digest_hex(&d.digest)?;
            }
            Ok(Manifest::Image { config, layers })
        }
        other => Err(ImageError::UnsupportedMediaType(other.to_string())),
    }
}

/// The linux/amd64 image of an index (the first one; variant-less or v1 preferred).
pub(crate) fn pick_linux_amd64(entries: &[Descriptor]) -> Option<&Descriptor> {
    let candidates = entries.iter().filter(|d| {
        d.platform
            .as_ref()
            .is_some_and(|p| p.os == "linux" && p.architecture == "amd64")
    });
    let mut first = None;
    for d in candidates {
        let variant = d.platform.as_ref().and_then(|p| p.variant.as_deref());
        if matches!(variant, None | Some("v1")) {
            return Some(d);
        }
        first.get_or_insert(d);
    }
    first
}

/// The hex part of a `sha256:` digest, checked.
pub(crate) fn digest_hex(digest: &str) -> Result<&str, ImageError> {
    match digest.strip_prefix("sha256:") {
        Some(hex) if crate::reference::is_sha256_hex(hex) => Ok(hex),
        _ => Err(ImageError::UnsupportedMediaType(format!(
            "digest {digest:?} (only sha256 is supported)"
        ))),
    }
}

/// The image config: how the image's authors meant it to run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ImageConfig {
    /// `KEY=value` pairs, in order.
    #[serde(default, deserialize_with = "null_default")]
    pub env: Vec<String>,
    #[serde(default, deserialize_with = "non_empty")]
    pub working_dir: Option<String>,
    #[serde(default, deserialize_with = "non_empty")]
    pub user: Option<String>,
    #[serde(default)]
    pub entrypoint: Option<Vec<String>>,
    #[serde(default)]
    pub cmd: Option<Vec<String>>,
    #[serde(default, deserialize_with = "non_empty")]
    pub stop_signal: Option<String>,
    /// Every label, `sbx.start` and `sbx.ready` included.
    #[serde(default, deserialize_with = "null_default")]
    pub labels: BTreeMap<String, String>,
}

/// A config blob: the runtime config and the layers' diff_ids.
#[derive(Deserialize)]
pub(crate) struct ConfigBlob {
    #[serde(default)]
    pub config: Option<ImageConfig>,
    pub rootfs: RootFs,
    #[serde(default)]
    pub os: Option<String>,
}

#[derive(Deserialize)]
pub(crate) struct RootFs {
    #[serde(default)]
    pub diff_ids: Vec<String>,
}

pub(crate) fn parse_config(body: &[u8]) -> Result<ConfigBlob, ImageError> {
    let c: ConfigBlob = serde_json::from_slice(body)
        .map_err(|e| ImageError::invalid(format!("image config: {e}")))?;
    if let Some(os) = &c.os {
        if os != "linux" {
            return Err(ImageError::UnsupportedMediaType(format!(
                "image for os {os}"
            )));
        }
    }
    for d in &c.rootfs.diff_ids {
        digest_hex(d)?;
    }
    Ok(c)
}

fn null_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

fn non_empty<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(Option::<String>::deserialize(d)?.filter(|s| !s.is_empty()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_docker_form() {
        let body = br#"{"architecture":"amd64","os":"linux",
            "config":{"Env":["PATH=/usr/bin","LANG=C.UTF-8"],"WorkingDir":"","User":"1000:1000",
              "Entrypoint":null,"Cmd":["python3"],"StopSignal":"SIGINT",
              "Labels":{"sbx.start":"python3 -m http.server","sbx.ready":"http:8000/"}},
            "rootfs":{"type":"layers","diff_ids":["sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"]}}"#;
        let c = parse_config(body).unwrap();
        let cfg = c.config.unwrap();
        assert_eq!(cfg.env, vec!["PATH=/usr/bin", "LANG=C.UTF-8"]);
        assert_eq!(cfg.working_dir, None);
        assert_eq!(cfg.user.as_deref(), Some("1000:1000"));
        assert_eq!(cfg.entrypoint, None);
        assert_eq!(cfg.cmd, Some(vec!["python3".to_string()]));
        assert_eq!(cfg.stop_signal.as_deref(), Some("SIGINT"));
        assert_eq!(cfg.labels["sbx.start"], "python3 -m http.server");
        assert_eq!(cfg.labels["sbx.ready"], "http:8000/");
        assert_eq!(c.rootfs.diff_ids.len(), 1);

        let c = parse_config(br#"{"config":{"Env":null,"Labels":null},"rootfs":{}}"#).unwrap();
        assert_eq!(c.config.unwrap(), ImageConfig::default());
        assert!(parse_config(br#"{"os":"windows","rootfs":{}}"#).is_err());
    }

    #[test]
    fn manifests() {
        let m = br#"{"schemaVersion":1,"name":"x"}"#;
        assert!(matches!(
            parse_manifest(m),
            Err(ImageError::UnsupportedMediaType(_))
        ));
        let m = br#"{"schemaVersion":2,"config":{"mediaType":"application/vnd.cncf.helm.config.v1+json","digest":"sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef","size":1},"layers":[]}"#;
        assert!(matches!(
            parse_manifest(m),
            Err(ImageError::UnsupportedMediaType(t)) if t.contains("helm")
        ));
        let idx = br#"{"schemaVersion":2,"manifests":[
            {"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:aa","size":1,"platform":{"os":"linux","architecture":"arm64"}},
            {"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:bb","size":1,"platform":{"os":"linux","architecture":"amd64","variant":"v3"}},
            {"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:cc","size":1,"platform":{"os":"linux","architecture":"amd64"}}]}"#;
        let Ok(Manifest::Index(entries)) = parse_manifest(idx) else {
            panic!("not an index")
        };
        assert_eq!(pick_linux_amd64(&entries).unwrap().digest, "sha256:cc");
        assert_eq!(pick_linux_amd64(&entries[..2]).unwrap().digest, "sha256:bb");
        assert!(pick_linux_amd64(&entries[..1]).is_none());
    }
}
