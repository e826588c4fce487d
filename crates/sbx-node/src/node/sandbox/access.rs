//! Who reaches a kept sandbox besides the holders of the node's API keys: its token (made at
//! create, sealed with the node key in its row) and its public ports; and what the preview
//! listener (`crate::preview`) needs of it, as typed values: the sandbox a name or id names,
//! whether a port is public, its token, a handle on its network namespace.

use std::net::SocketAddr;
use std::os::fd::OwnedFd;

use base64::Engine;
use sbx_api::{ApiError, ErrorCode};
use subtle::ConstantTimeEq;

use super::*;

/// How a sandbox token starts: the API's edge and the preview listener tell it from a key by it.
pub const TOKEN_PREFIX: &str = "sbt_";

/// A sandbox's token: `sbt_` and 32 hex digits (128 random bits). Never printed: its `Debug`
/// hides it, and only [`SandboxToken::reveal`] gives the text (for the answers of `POST` and
/// `GET /v1/sandboxes/{id}`).
#[derive(Clone, PartialEq, Eq)]
pub struct SandboxToken(String);

impl std::fmt::Debug for SandboxToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SandboxToken(..)")
    }
}

impl SandboxToken {
    /// A new token from the system's random source.
    pub fn new() -> Result<SandboxToken, ApiError> {
        let mut bytes = [0u8; 16];
        getrandom::getrandom(&mut bytes)
            .map_err(crate::node::internal("random bytes for a token"))?;
        let mut s = String::with_capacity(TOKEN_PREFIX.len() + 32);
        s.push_str(TOKEN_PREFIX);
        for b in bytes {
            s.push_str(&format!("{b:02x}"));
        }
        Ok(SandboxToken(s))
    }

    /// The token's text, to hand to its owner.
    pub fn reveal(&self) -> &str {
        &self.0
    }

    /// Whether `given` is this token, compared in constant time.
    pub fn matches(&self, given: &str) -> bool {
        self.0.as_bytes().ct_eq(given.as_bytes()).into()
    }
}

/// `#[serde(with = "…::sealed_token")]` for a sandbox's token in its stored spec: sealed with
/// the node key (`sealed:v1:` + base64), as `secret_env` is.
pub(crate) mod sealed_token {
    use super::*;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    const PREFIX: &str = "sealed:v1:";
    const AAD: &[u8] = b"sandbox_token";

    pub fn serialize<S: Serializer>(t: &Option<SandboxToken>, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::Error;
        let Some(t) = t else {
            return s.serialize_none();
        };
        let key = crate::node::credentials::node_key()
            .map_err(|_| S::Error::custom("the node key is not loaded"))?;
        let sealed = key
            .seal(t.0.as_bytes(), AAD)
            .map_err(|_| S::Error::custom("sealing a sandbox token failed"))?;
        let text = base64::engine::general_purpose::STANDARD.encode(sealed);
        format!("{PREFIX}{text}").serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<SandboxToken>, D::Error> {
        use serde::de::Error;
        let Some(raw) = Option::<String>::deserialize(d)? else {
            return Ok(None);
        };
        let text = raw
            .strip_prefix(PREFIX)
            .ok_or_else(|| D::Error::custom("a sandbox token that is not sealed"))?;
        let key = crate::node::credentials::node_key()
            .map_err(|_| D::Error::custom("the node key is not loaded"))?;
        base64::engine::general_purpose::STANDARD
            .decode(text)
            .ok()
            .and_then(|b| key.open(&b, AAD))
            .and_then(|b| String::from_utf8(b).ok())
            .map(|t| Some(SandboxToken(t)))
            .ok_or_else(|| D::Error::custom("a sandbox token does not open with the node key"))
    }
}

/// The node's preview listener as the sandbox objects name it (`GET /internal/node` too).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreviewSettings {
    /// The address it is bound to (its port, when `--preview-listen` gave 0, the one bound).
    pub listen: SocketAddr,
    /// The domain its host names end with (`localhost`).
    pub domain: String,
    /// HTTPS (`--preview-tls-cert` and `--preview-tls-key`).
    pub tls: bool,
}

impl PreviewSettings {
    /// The preview URL of sandbox `id` with the literal `{port}` where the port goes; the
    /// listener's port left out when it is the scheme's own.
    pub(crate) fn url_of(&self, id: &str) -> String {
        let (scheme, default_port) = if self.tls {
            ("https", 443)
        } else {
            ("http", 80)
        };
        let port = self.listen.port();
        let domain = &self.domain;
        if port == default_port {
            format!("{scheme}://{{port}}-{id}.{domain}")
        } else {
            format!("{scheme}://{{port}}-{id}.{domain}:{port}")
        }
    }
}

/// Whether `port` of a sandbox made with `spec` is open to anybody.
fn port_is_public(spec: &StoredSpec, port: u16) -> bool {
    spec.public_ports.contains(&port)
        || spec
            .public_ports_except
            .as_ref()
            .is_some_and(|except| !except.contains(&port))
}

/// What the preview listener needs of a sandbox to decide about a request to one of its ports.
#[derive(Debug)]
pub struct PreviewTarget {
    /// The sandbox's id (the host may name it by its name).
    pub id: String,
    /// The port is public: no credential is needed.
    pub public: bool,
    /// The `Host` the sandbox's port is sent instead of the request's: its metadata
    /// `sbx.preview_host`, `${PORT}` replaced by the port (E2B's `maskRequestHost`).
    pub host: Option<String>,
    token: Option<SandboxToken>,
}

/// The metadata key of a sandbox whose ports are sent another `Host` than the request's
/// ([`PreviewTarget::host`]).
pub const PREVIEW_HOST_KEY: &str = "sbx.preview_host";

impl PreviewTarget {
    /// Whether `given` is the sandbox's token (constant time; a sandbox of an older node has
    /// none).
    pub fn token_matches(&self, given: &str) -> bool {
        self.token.as_ref().is_some_and(|t| t.matches(given))
    }
}

impl Node {
    /// The preview listener's settings; `None` when it is off.
    pub fn preview(&self) -> Option<&PreviewSettings> {
        self.preview.as_ref()
    }

    /// The preview URL (with `{port}`) of sandbox `id`, when the listener is on.
    pub fn preview_url(&self, id: &str) -> Option<String> {
        self.preview().map(|p| p.url_of(id))
    }

    /// The id of the kept sandbox `id_or_name` names.
    pub fn sandbox_id(&self, id_or_name: &str) -> Option<String> {
        self.managed(id_or_name).ok().map(|m| m.id.clone())
    }

    /// The token of the kept sandbox `id_or_name` names (`None`: made by an older node).
    pub fn sandbox_token(&self, id_or_name: &str) -> Result<Option<SandboxToken>, ApiError> {
        Ok(self.managed(id_or_name)?.spec.token.clone())
    }

    /// The id of the kept sandbox whose token is `given`. Every sandbox's token is compared,
    /// each in constant time.
    pub fn sandbox_of_token(&self, given: &str) -> Option<String> {
        let all: Vec<Arc<Managed>> = self.managed.locked().values().cloned().collect();
        let mut found = None;
        for m in all {
            if m.spec.token.as_ref().is_some_and(|t| t.matches(given)) {
                found = Some(m.id.clone());
            }
        }
        found
    }

    /// The id of the kept sandbox whose token `signed` says made a signature (E2B's signed
    /// file URLs): every sandbox's token is tried.
    pub fn sandbox_of_signature(&self, signed: impl Fn(&SandboxToken) -> bool) -> Option<String> {
        let all: Vec<Arc<Managed>> = self.managed.locked().values().cloned().collect();
        all.into_iter()
            .find(|m| m.spec.token.as_ref().is_some_and(&signed))
            .map(|m| m.id.clone())
    }

    /// What the preview listener needs to decide about a request to `port` of the sandbox
    /// `id_or_name` names. 404 sandbox_not_found for none.
    pub fn preview_target(&self, id_or_name: &str, port: u16) -> Result<PreviewTarget, ApiError> {
        let m = self.managed(id_or_name)?;
        Ok(PreviewTarget {
            id: m.id.clone(),
            public: port_is_public(&m.spec, port),
            host: m
                .spec
                .metadata
                .get(PREVIEW_HOST_KEY)
                .map(|h| h.replace("${PORT}", &port.to_string())),
            token: m.spec.token.clone(),
        })
    }

    /// A handle on the network namespace of sandbox `id`'s machine (for
    /// [`sbx_runtime::netns::in_netns_of_handle`]), while it runs: 502 port_not_open when it
    /// does not.
    pub fn sandbox_netns(&self, id: &str, port: u16) -> Result<OwnedFd, ApiError> {
        let m = self.managed(id)?;
        let status = m.status();
        let not_open = |why: String| {
            ApiError::new(
                ErrorCode::PortNotOpen,
                format!("port {port} of sandbox {id} is not open: {why}"),
            )
        };
        if !status.can_exec() {
            return Err(not_open(format!("the sandbox is {}", status.as_str())));
        }
        let machine = m
            .machine()
            .ok_or_else(|| not_open("the sandbox is starting".into()))?;
        machine
            .netns_handle()
            .map_err(|e| not_open(format!("no handle on its network: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_random_printable_and_hidden() {
        let a = SandboxToken::new().expect("token");
        let b = SandboxToken::new().expect("token");
        assert_ne!(a, b);
        assert!(a.reveal().starts_with(TOKEN_PREFIX));
        assert_eq!(a.reveal().len(), TOKEN_PREFIX.len() + 32);
        assert!(a.reveal()[4..].bytes().all(|c| c.is_ascii_hexdigit()));
        assert!(a.matches(a.reveal()));
        assert!(!a.matches(b.reveal()));
        assert!(!a.matches(&a.reveal()[..20]));
        assert!(!format!("{a:?}").contains(&a.reveal()[4..]));
    }

    #[test]
    fn preview_urls_leave_out_the_schemes_own_port() {
        let s = |listen: &str, tls: bool| PreviewSettings {
            listen: listen.parse().expect("addr"),
            domain: "preview.example.com".into(),
            tls,
        };
        assert_eq!(
            s("127.0.0.1:7780", false).url_of("sbx-a"),
            "http://{port}-sbx-a.preview.example.com:7780"
        );
        assert_eq!(
            s("0.0.0.0:80", false).url_of("sbx-a"),
            "http://{port}-sbx-a.preview.example.com"
        );
        assert_eq!(
            s("0.0.0.0:443", true).url_of("sbx-a"),
            "https://{port}-sbx-a.preview.example.com"
        );
        assert_eq!(
            s("0.0.0.0:443", false).url_of("sbx-a"),
            "http://{port}-sbx-a.preview.example.com:443"
        );
    }

    #[test]
    fn public_ports_and_their_exceptions() {
        let mut spec: StoredSpec = serde_json::from_value(serde_json::json!({
            "image": "base", "vcpus": 1, "memory_bytes": 1, "hostname": null,
            "tmp_memory": false, "env": {}, "secret_env": {}, "metadata": {}, "cwd": null,
            "user": null, "start_command": null, "stop_grace_ms": 1, "expires_at": null
        }))
        .expect("an older row reads");
        assert_eq!(spec.token, None);
        assert!(!port_is_public(&spec, 80));
        spec.public_ports = vec![8080];
        assert!(port_is_public(&spec, 8080) && !port_is_public(&spec, 80));
        spec.public_ports_except = Some(vec![49983]);
        assert!(port_is_public(&spec, 80) && !port_is_public(&spec, 49983));
        spec.public_ports_except = Some(vec![]);
        assert!(port_is_public(&spec, 49983));
    }
}
