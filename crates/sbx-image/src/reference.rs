//! Image references: `[host[:port]/]name[:tag][@sha256:hex]`, normalised as Docker does
//! (docker.io when there is no host, `library/` before a one-part name on docker.io, `latest`
//! when there is neither tag nor digest).

use std::fmt;

use crate::error::ImageError;

/// A parsed, normalised image reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// `host[:port]`, as connected to.
    addr: String,
    repository: String,
    tag: Option<String>,
    digest: Option<String>,
}

/// Parses an image reference (`python:3.12`, `host:5000/team/app@sha256:…`).
pub fn parse_reference(s: &str) -> Result<Reference, ImageError> {
    let invalid = |reason: String| ImageError::InvalidReference {
        reference: s.to_string(),
        reason,
    };
    let parsed = oci_client::Reference::try_from(s).map_err(|e| invalid(e.to_string()))?;
    if parsed.repository().bytes().any(|b| b.is_ascii_uppercase()) {
        return Err(invalid("repository names are lowercase".into()));
    }
    if let Some(digest) = parsed.digest() {
        // Only sha256 is stored (the store is addressed by sha256).
        let hex = digest
            .strip_prefix("sha256:")
            .ok_or_else(|| invalid("only sha256 digests are supported".into()))?;
        if !is_sha256_hex(hex) {
            return Err(invalid("a sha256 digest is 64 lowercase hex digits".into()));
        }
    }
    Ok(Reference {
        addr: parsed.registry().to_string(),
        repository: parsed.repository().to_string(),
        // With a digest, the tag is only a label: the digest names the image.
        tag: parsed.tag().map(str::to_string),
        digest: parsed.digest().map(str::to_string),
    })
}

pub(crate) fn is_sha256_hex(hex: &str) -> bool {
    hex.len() == 64
        && hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl Reference {
    /// The registry's host name without a port (`docker.io` when the reference names none):
    /// what credentials and secrets are checked against.
    pub fn registry(&self) -> &str {
        match self.addr.rsplit_once(':') {
            Some((host, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => {
                host
            }
            _ => &self.addr,
        }
    }

    /// `host[:port]` as connected to (and as listed in a store's insecure registries).
    pub fn registry_addr(&self) -> &str {
        &self.addr
    }

    /// The repository, e.g. `library/python`.
    pub fn repository(&self) -> &str {
        &self.repository
    }

    /// The tag, if the reference has one (`latest` when it has neither tag nor digest).
    pub fn tag(&self) -> Option<&str> {
        self.tag.as_deref()
    }

    /// The digest (`sha256:…`), if the reference has one.
    pub fn digest(&self) -> Option<&str> {
        self.digest.as_deref()
    }

    pub(crate) fn to_oci(&self) -> oci_client::Reference {
        match (&self.tag, &self.digest) {
            (Some(t), Some(d)) => oci_client::Reference::with_tag_and_digest(
                self.addr.clone(),
                self.repository.clone(),
                t.clone(),
                d.clone(),
            ),
            (_, Some(d)) => oci_client::Reference::with_digest(
                self.addr.clone(),
                self.repository.clone(),
                d.clone(),
            ),
            (t, None) => oci_client::Reference::with_tag(
                self.addr.clone(),
                self.repository.clone(),
                t.clone().unwrap_or_else(|| "latest".into()),
            ),
        }
    }

    /// `host/repo@digest`: the same repository pinned to `digest`.
    pub(crate) fn with_digest(&self, digest: &str) -> Reference {
        Reference {
            addr: self.addr.clone(),
            repository: self.repository.clone(),
            tag: None,
            digest: Some(digest.to_string()),
        }
    }
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEX: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn docker_hub_defaults() {
        let r = parse_reference("python:3.12").unwrap();
        assert_eq!(r.registry(), "docker.io");
        assert_eq!(r.registry_addr(), "docker.io");
        assert_eq!(r.repository(), "library/python");
        assert_eq!(r.tag(), Some("3.12"));
        assert_eq!(r.digest(), None);
        assert_eq!(r.to_string(), "docker.io/library/python:3.12");

        let r = parse_reference("ubuntu").unwrap();
        assert_eq!(r.to_string(), "docker.io/library/ubuntu:latest");
        let r = parse_reference("someone/app").unwrap();
        assert_eq!(r.to_string(), "docker.io/someone/app:latest");
        let r = parse_reference("index.docker.io/library/alpine:3").unwrap();
        assert_eq!(r.to_string(), "docker.io/library/alpine:3");
    }

    #[test]
    fn host_port_and_digest() {
        let s = format!("127.0.0.1:5000/team/app@sha256:{HEX}");
        let r = parse_reference(&s).unwrap();
        assert_eq!(r.registry(), "127.0.0.1");
        assert_eq!(r.registry_addr(), "127.0.0.1:5000");
        assert_eq!(r.repository(), "team/app");
        assert_eq!(r.tag(), None);
        assert_eq!(r.digest(), Some(format!("sha256:{HEX}").as_str()));
        assert_eq!(r.to_string(), s);

        let r = parse_reference(&format!("ghcr.io/o/app:v1@sha256:{HEX}")).unwrap();
        assert_eq!(r.registry(), "ghcr.io");
        assert_eq!(r.tag(), Some("v1"));
        assert!(r.digest().is_some());

        let r = parse_reference("localhost/app").unwrap();
        assert_eq!(r.registry(), "localhost");
        assert_eq!(r.repository(), "app");
        let r = parse_reference("localhost:5000/app:t").unwrap();
        assert_eq!(r.registry(), "localhost");
        assert_eq!(r.registry_addr(), "localhost:5000");
        // A port-like tag on a one-part name is a tag.
        let r = parse_reference("test.com:5000").unwrap();
        assert_eq!(r.to_string(), "docker.io/library/test.com:5000");
    }

    #[test]
    fn refused() {
        for bad in [
            "",
            "Upper/case",
            "a b",
            "app:",
            "app@sha256:abc",
            "app@md5:0123456789abcdef0123456789abcdef",
            &format!("app@sha512:{HEX}{HEX}"),
            &format!("app@sha256:{}", HEX.to_uppercase()),
            "/app",
            "app/",
            "host:port/app",
        ] {
            match parse_reference(bad) {
                Err(ImageError::InvalidReference { reference, .. }) => assert_eq!(reference, bad),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }
}
