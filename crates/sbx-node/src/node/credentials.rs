//! The node's secrets (their routes: `http/secrets.rs`): sealing with the node key, the
//! `secrets` table, the checks of a secret, and their use (`Node::pull_credentials` for image
//! pulls, `sealed_env` for kept sandboxes' `secret_env`).
//!
//! A secret's value is write-only: no answer, log line or error message holds it. At rest it is
//! sealed with the node key (`<data-dir>/node.key`, 32 random bytes, mode 0600, made on the
//! node's first start) by ChaCha20-Poly1305 with a random nonce per value and the secret's name
//! as associated data, so the database never holds a value in clear and a sealed value does not
//! open under another name. The same key seals the `secret_env` values of the sandboxes the
//! node keeps ([`sealed_env`]).

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::sync::OnceLock;

use base64::Engine;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};
use rusqlite::{params, OptionalExtension};
use sbx_api::{ApiError, ErrorCode, SecretDeleted, SecretObject};

use crate::node::Node;
use crate::store::Store;

const KEY_FILE: &str = "node.key";

const KEY_LEN: usize = 32;

const NONCE_LEN: usize = 12;

/// The first byte of a sealed value: the format (nonce, then ciphertext with its tag).
const SEAL_V1: u8 = 1;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS secrets (
  name TEXT PRIMARY KEY,
  sealed BLOB NOT NULL,
  allowed_hosts TEXT,
  created_at_ns INTEGER NOT NULL,
  updated_at_ns INTEGER NOT NULL
);
";

/// The node key, once loaded ([`init`]).
static NODE_KEY: OnceLock<NodeKey> = OnceLock::new();
/// The key of the fleet's object store ([`init_store_key`]): seals what a node stores there
/// that is secret (a sandbox's record: its token and secret variables), so that the store's
/// readers learn nothing of them. Every node of a fleet has the same one.
static STORE_KEY: OnceLock<NodeKey> = OnceLock::new();
/// What binds a sealed record to its sandbox.
const RECORD_AAD: &str = "sbx-record:v1:";

/// The key that seals what the node keeps of secrets. Its bytes are never printed.
#[derive(Clone)]
pub(crate) struct NodeKey(Key);

impl std::fmt::Debug for NodeKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NodeKey(..)")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{0} does not hold a key of 32 bytes")]
    BadLength(String),
    #[error("no random bytes from the system: {0}")]
    Random(getrandom::Error),
    #[error("{0}")]
    Store(#[from] crate::store::StoreError),
}

fn random_bytes<const N: usize>() -> Result<[u8; N], getrandom::Error> {
    let mut b = [0u8; N];
    getrandom::getrandom(&mut b)?;
    Ok(b)
}

impl NodeKey {
    /// Reads `<data_dir>/node.key`, making it first (32 random bytes, mode 0600) when there is
    /// none. A key file readable by others is made 0600.
    pub fn load_or_create(data_dir: &Path) -> Result<NodeKey, KeyError> {
        NodeKey::load_or_create_at(&data_dir.join(KEY_FILE))
    }

    /// Reads the key file `path` (32 bytes), making it first (random, mode 0600) when there
    /// is none. A key file readable by others is made 0600.
    pub fn load_or_create_at(path: &Path) -> Result<NodeKey, KeyError> {
        let path = path.to_path_buf();
        let data_dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        let key_file = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| KEY_FILE.to_string());
        let io = |source| KeyError::Io {
            path: path.display().to_string(),
            source,
        };
        match std::fs::read(&path) {
            Ok(bytes) => {
                if bytes.len() != KEY_LEN {
                    return Err(KeyError::BadLength(path.display().to_string()));
                }
                let meta = std::fs::metadata(&path).map_err(io)?;
                if meta.permissions().mode() & 0o077 != 0 {
                    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                        .map_err(io)?;
                }
                Ok(NodeKey(*Key::from_slice(&bytes)))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let bytes: [u8; KEY_LEN] = random_bytes().map_err(KeyError::Random)?;
                // Written beside it and renamed: a node that dies meanwhile leaves no half key.
                let tmp = data_dir.join(format!("{key_file}.tmp-{}", std::process::id()));
                let tmp_io = |source| KeyError::Io {
                    path: tmp.display().to_string(),
                    source,
                };
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(0o600)
                    .open(&tmp)
                    .map_err(tmp_io)?;
                f.set_permissions(std::fs::Permissions::from_mode(0o600))
                    .map_err(tmp_io)?;
                f.write_all(&bytes).map_err(tmp_io)?;
                f.sync_all().map_err(tmp_io)?;
                drop(f);
                std::fs::rename(&tmp, &path).map_err(io)?;
                if let Ok(dir) = std::fs::File::open(data_dir) {
                    let _ = dir.sync_all();
                }
                tracing::info!(path = %path.display(), "made a key");
                Ok(NodeKey(*Key::from_slice(&bytes)))
            }
            Err(e) => Err(io(e)),
        }
    }

    /// Seals `plain` with a new random nonce; `aad` binds it to where it belongs.
    pub(crate) fn seal(&self, plain: &[u8], aad: &[u8]) -> Result<Vec<u8>, ApiError> {
        let nonce: [u8; NONCE_LEN] = random_bytes().map_err(|e| {
            tracing::error!(error = %e, "no random bytes for a nonce");
            ApiError::internal()
        })?;
        let ct = ChaCha20Poly1305::new(&self.0)
            .encrypt(Nonce::from_slice(&nonce), Payload { msg: plain, aad })
            .map_err(|_| {
                tracing::error!("sealing a secret failed");
                ApiError::internal()
            })?;
        let mut out = Vec::with_capacity(1 + NONCE_LEN + ct.len());
        out.push(SEAL_V1);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&ct);
        Ok(out)
    }

    /// Opens what [`NodeKey::seal`] sealed with the same `aad`; `None` when it does not open
    /// (another key, another place, damaged).
    pub fn open(&self, sealed: &[u8], aad: &[u8]) -> Option<Vec<u8>> {
        let (&version, rest) = sealed.split_first()?;
        if version != SEAL_V1 || rest.len() < NONCE_LEN {
            return None;
        }
        let (nonce, ct) = rest.split_at(NONCE_LEN);
        ChaCha20Poly1305::new(&self.0)
            .decrypt(Nonce::from_slice(nonce), Payload { msg: ct, aad })
            .ok()
    }
}

/// At the node's start: loads (or makes) the node key and makes the secrets table.
pub fn init(data_dir: &Path, store: &Store) -> Result<(), KeyError> {
    let key = NodeKey::load_or_create(data_dir)?;
    let _ = NODE_KEY.set(key);
    store.with_conn(|c| c.execute_batch(SCHEMA))?;
    Ok(())
}

/// At the start of a node with a store: loads (or makes) the store's key file `path`
/// (`--store-key`, default `DATA_DIR/store.key`).
pub fn init_store_key(path: &Path) -> Result<(), KeyError> {
    let key = NodeKey::load_or_create_at(path)?;
    let _ = STORE_KEY.set(key);
    Ok(())
}

fn store_key() -> Result<&'static NodeKey, ApiError> {
    STORE_KEY.get().ok_or_else(|| {
        tracing::error!("the store key is not loaded");
        ApiError::internal()
    })
}

/// Sandbox `id`'s record (`plain`) sealed with the store key, as the store keeps it.
pub(crate) fn seal_record(id: &str, plain: &[u8]) -> Result<Vec<u8>, ApiError> {
    store_key()?.seal(plain, format!("{RECORD_AAD}{id}").as_bytes())
}

/// What [`seal_record`] sealed for sandbox `id`; `None` when it does not open (sealed with
/// another store key, for another sandbox, or not sealed: a record in clear is refused).
pub(crate) fn open_record(id: &str, sealed: &[u8]) -> Option<Vec<u8>> {
    store_key()
        .ok()?
        .open(sealed, format!("{RECORD_AAD}{id}").as_bytes())
}

/// The node key ([`init`] loads it).
pub(crate) fn node_key() -> Result<&'static NodeKey, ApiError> {
    NODE_KEY.get().ok_or_else(|| {
        tracing::error!("the node key is not loaded");
        ApiError::internal()
    })
}

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// A secret as the table keeps it (its value sealed).
pub(crate) struct SecretRow {
    name: String,
    sealed: Vec<u8>,
    pub allowed_hosts: Option<Vec<String>>,
    created_at_ns: i64,
    updated_at_ns: i64,
}

impl SecretRow {
    /// The secret object: never the value.
    fn object(&self) -> SecretObject {
        SecretObject {
            allowed_hosts: self.allowed_hosts.clone(),
            created_at: sbx_api::format_rfc3339_millis(i128::from(self.created_at_ns)),
            name: self.name.clone(),
            object: "secret".into(),
            updated_at: sbx_api::format_rfc3339_millis(i128::from(self.updated_at_ns)),
        }
    }
}

fn row_of(r: &rusqlite::Row<'_>) -> rusqlite::Result<SecretRow> {
    let hosts: Option<String> = r.get(2)?;
    Ok(SecretRow {
        name: r.get(0)?,
        sealed: r.get(1)?,
        allowed_hosts: hosts.and_then(|h| serde_json::from_str(&h).ok()),
        created_at_ns: r.get(3)?,
        updated_at_ns: r.get(4)?,
    })
}

const COLS: &str = "name, sealed, allowed_hosts, created_at_ns, updated_at_ns";

fn store_failed(e: crate::store::StoreError) -> ApiError {
    tracing::error!(error = %e, "secrets table");
    ApiError::internal()
}

pub fn check_name(name: &str) -> Result<(), ApiError> {
    if sbx_api::valid_name(name) {
        return Ok(());
    }
    Err(ApiError::new(
        ErrorCode::InvalidName,
        "a secret's name must be 1 to 63 lower-case letters, digits and hyphens, not starting or \
         ending with a hyphen nor with an id prefix (sbx-, exe-, snap-, vol-, evt-, req-)",
    )
    .with_param("name"))
}

/// The body of a PUT: `{value, allowed_hosts?}` (sbx-api's parser: the client sends what it
/// reads). Messages never quote the body.
pub fn parse_put(body: &[u8]) -> Result<(String, Option<Vec<String>>), ApiError> {
    let put = sbx_api::parse_secret_put(body)?;
    Ok((put.value, put.allowed_hosts))
}

/// Whether `host` (a registry's host as a reference writes it, without its port) is one the
/// secret may go to: `None` is anywhere; an entry is the host itself, or `*.domain` for any
/// subdomain of `domain` (not `domain` itself). Case does not matter.
pub(crate) fn host_allowed(allowed: Option<&[String]>, host: &str) -> bool {
    let Some(list) = allowed else {
        return true;
    };
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    list.iter().any(|p| {
        let p = p.to_ascii_lowercase();
        match p.strip_prefix("*.") {
            Some(domain) => host
                .strip_suffix(domain)
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
            None => p == host,
        }
    })
}

/// `username:password` in printable ASCII, split at the first colon; neither part empty.
fn split_credentials(value: &str) -> Option<(String, String)> {
    if !value.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
        return None;
    }
    let (user, pass) = value.split_once(':')?;
    if user.is_empty() || pass.is_empty() {
        return None;
    }
    Some((user.to_string(), pass.to_string()))
}

impl Node {
    /// A secret's object (its value never), 404 secret_not_found.
    pub fn secret_object(&self, name: &str) -> Result<SecretObject, ApiError> {
        check_name(name)?;
        match self.secret_row(name)? {
            Some(row) => Ok(row.object()),
            None => Err(not_found(name, None)),
        }
    }

    pub(crate) fn secret_row(&self, name: &str) -> Result<Option<SecretRow>, ApiError> {
        secret_row(&self.store, name)
    }

    /// The value of secret `name` for the egress proxy's inject (never for an answer);
    /// `None` when there is no such secret (or it does not open).
    pub fn secret_for_inject(&self, name: &str) -> Option<String> {
        secret_for_inject(&self.store, name)
    }

    /// The value of a secret, opened (for the node's own use: never for an answer).
    fn secret_value(&self, row: &SecretRow) -> Result<String, ApiError> {
        secret_value(row)
    }

    /// Makes or replaces a secret; true when it is new.
    pub fn put_secret(
        &self,
        name: &str,
        value: &str,
        allowed_hosts: Option<Vec<String>>,
    ) -> Result<(bool, SecretObject), ApiError> {
        let key = node_key()?;
        let sealed = key.seal(value.as_bytes(), name.as_bytes())?;
        let hosts = match &allowed_hosts {
            Some(h) => Some(
                serde_json::to_string(h)
                    .map_err(crate::node::internal("a secret's hosts as JSON"))?,
            ),
            None => None,
        };
        let now = now_ns();
        let (created, row) = self
            .store
            .with_conn(|c| {
                let tx = c.unchecked_transaction()?;
                let before: Option<i64> = tx
                    .query_row(
                        "SELECT created_at_ns FROM secrets WHERE name=?1",
                        params![name],
                        |r| r.get(0),
                    )
                    .optional()?;
                tx.execute(
                    "INSERT INTO secrets (name, sealed, allowed_hosts, created_at_ns, updated_at_ns) \
                     VALUES (?1,?2,?3,?4,?4) ON CONFLICT(name) DO UPDATE SET \
                     sealed=excluded.sealed, allowed_hosts=excluded.allowed_hosts, \
                     updated_at_ns=excluded.updated_at_ns",
                    params![name, sealed, hosts, now],
                )?;
                tx.commit()?;
                Ok((
                    before.is_none(),
                    SecretRow {
                        name: name.to_string(),
                        sealed: Vec::new(),
                        allowed_hosts,
                        created_at_ns: before.unwrap_or(now),
                        updated_at_ns: now,
                    },
                ))
            })
            .map_err(store_failed)?;
        tracing::info!(secret = %name, created, "secret written");
        Ok((created, row.object()))
    }

    pub fn list_secrets(&self) -> Result<Vec<SecretObject>, ApiError> {
        let rows = self
            .store
            .with_conn(|c| {
                let mut st = c.prepare(&format!("SELECT {COLS} FROM secrets ORDER BY name"))?;
                let rows = st.query_map([], row_of)?;
                rows.collect::<rusqlite::Result<Vec<_>>>()
            })
            .map_err(store_failed)?;
        Ok(rows.iter().map(SecretRow::object).collect())
    }

    pub fn delete_secret(&self, name: &str) -> Result<SecretDeleted, ApiError> {
        let n = self
            .store
            .with_conn(|c| c.execute("DELETE FROM secrets WHERE name=?1", params![name]))
            .map_err(store_failed)?;
        if n == 0 {
            return Err(not_found(name, None));
        }
        tracing::info!(secret = %name, "secret deleted");
        Ok(SecretDeleted::new(name))
    }

    /// The credentials of an image's registry held by the secret `secret_name`, for the tool
    /// that pulls the image (and nothing else). `registry_host` is the registry's host as the
    /// image reference writes it, without its port (`docker.io` where it names none).
    ///
    /// 404 `secret_not_found` when there is no such secret, 403 `secret_host_not_allowed` when
    /// its `allowed_hosts` do not cover the host, 400 `invalid_field` when its value is not
    /// `username:password` in printable ASCII; all with param `image_pull_secret`.
    pub(crate) fn pull_credentials(
        &self,
        secret_name: &str,
        registry_host: &str,
    ) -> Result<(String, String), ApiError> {
        const PARAM: &str = "image_pull_secret";
        let row = match self.secret_row(secret_name)? {
            Some(r) => r,
            None => return Err(not_found(secret_name, Some(PARAM))),
        };
        // The host as the reference writes it, without a port.
        let host = match registry_host.rsplit_once(':') {
            Some((h, port)) if !h.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => h,
            _ => registry_host,
        };
        if !host_allowed(row.allowed_hosts.as_deref(), host) {
            let allowed = row.allowed_hosts.unwrap_or_default();
            let hosts = allowed.join(", ");
            return Err(ApiError::new(
                ErrorCode::SecretHostNotAllowed,
                format!(
                    "secret {secret_name} may not go to {host}: its allowed_hosts are [{hosts}]"
                ),
            )
            .with_param(PARAM)
            .with_beside("allowed_hosts", serde_json::json!(allowed)));
        }
        let value = self.secret_value(&row)?;
        split_credentials(&value).ok_or_else(|| {
            ApiError::invalid_field(
                PARAM,
                format!("secret {secret_name} does not hold username:password in printable ASCII"),
            )
        })
    }
}

pub fn not_found(name: &str, param: Option<&str>) -> ApiError {
    let e = ApiError::new(ErrorCode::SecretNotFound, format!("no secret {name}"));
    match param {
        Some(p) => e.with_param(p),
        None => e.with_param("name"),
    }
}

/// `#[serde(with = "crate::node::credentials::sealed_env")]` for a map of secret variables: each value
/// is written sealed with the node key (`sealed:v1:` + base64), with the variable's name as
/// associated data; values written in clear by an older node are read as they are.
pub mod sealed_env {
    use super::*;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    const PREFIX: &str = "sealed:v1:";

    fn aad(var: &str) -> Vec<u8> {
        format!("secret_env:{var}").into_bytes()
    }

    pub fn serialize<S: Serializer>(
        map: &BTreeMap<String, String>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        use serde::ser::Error;
        let key = NODE_KEY
            .get()
            .ok_or_else(|| S::Error::custom("the node key is not loaded"))?;
        let mut out = BTreeMap::new();
        for (k, v) in map {
            let sealed = key
                .seal(v.as_bytes(), &aad(k))
                .map_err(|_| S::Error::custom("sealing a secret variable failed"))?;
            let text = base64::engine::general_purpose::STANDARD.encode(sealed);
            out.insert(k.clone(), format!("{PREFIX}{text}"));
        }
        out.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<String, String>, D::Error> {
        use serde::de::Error;
        let raw = BTreeMap::<String, String>::deserialize(d)?;
        let mut out = BTreeMap::new();
        for (k, v) in raw {
            let Some(text) = v.strip_prefix(PREFIX) else {
                out.insert(k, v);
                continue;
            };
            let key = NODE_KEY
                .get()
                .ok_or_else(|| D::Error::custom("the node key is not loaded"))?;
            let plain = base64::engine::general_purpose::STANDARD
                .decode(text)
                .ok()
                .and_then(|b| key.open(&b, &aad(&k)))
                .and_then(|b| String::from_utf8(b).ok())
                .ok_or_else(|| {
                    D::Error::custom(format!(
                        "secret variable {k} does not open with the node key"
                    ))
                })?;
            out.insert(k, plain);
        }
        Ok(out)
    }
}

/// Secret `name`'s row in `store`.
fn secret_row(store: &Store, name: &str) -> Result<Option<SecretRow>, ApiError> {
    store
        .with_conn(|c| {
            c.query_row(
                &format!("SELECT {COLS} FROM secrets WHERE name=?1"),
                params![name],
                row_of,
            )
            .optional()
        })
        .map_err(store_failed)
}

/// The value of secret `name` in `store` for the egress proxy's inject (never for an answer);
/// `None` when there is no such secret (or it does not open). The node's network reads
/// secrets through this, before the node is built.
pub fn secret_for_inject(store: &Store, name: &str) -> Option<String> {
    let row = secret_row(store, name).ok()??;
    secret_value(&row).ok()
}

/// A secret's value, opened with the node key.
fn secret_value(row: &SecretRow) -> Result<String, ApiError> {
    let key = node_key()?;
    key.open(&row.sealed, row.name.as_bytes())
        .and_then(|b| String::from_utf8(b).ok())
        .ok_or_else(|| {
            tracing::error!(secret = %row.name, "a secret does not open with the node key");
            ApiError::internal()
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> NodeKey {
        NodeKey(*Key::from_slice(&[7u8; 32]))
    }

    #[test]
    fn seal_and_open() {
        let k = key();
        let a = k.seal(b"hunter2", b"reg").unwrap();
        let b = k.seal(b"hunter2", b"reg").unwrap();
        assert_ne!(a, b, "a nonce per value");
        assert!(!a.windows(7).any(|w| w == b"hunter2"));
        assert_eq!(k.open(&a, b"reg").unwrap(), b"hunter2");
        assert!(k.open(&a, b"other").is_none(), "bound to its name");
        let other = NodeKey(*Key::from_slice(&[8u8; 32]));
        assert!(other.open(&a, b"reg").is_none());
        let mut bad = a.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert!(k.open(&bad, b"reg").is_none());
        assert!(k.open(&[], b"reg").is_none());
    }

    #[test]
    fn key_file_is_made_once_and_private() {
        let dir = std::env::temp_dir().join(format!("sbx-key-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let a = NodeKey::load_or_create(&dir).unwrap();
        let meta = std::fs::metadata(dir.join(KEY_FILE)).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(meta.len(), 32);
        let b = NodeKey::load_or_create(&dir).unwrap();
        assert_eq!(a.0, b.0);
        std::fs::write(dir.join(KEY_FILE), b"short").unwrap();
        assert!(NodeKey::load_or_create(&dir).is_err());
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn hosts() {
        let l = vec!["ghcr.io".to_string(), "*.example.com".to_string()];
        assert!(host_allowed(None, "anything"));
        assert!(host_allowed(Some(&l), "ghcr.io"));
        assert!(host_allowed(Some(&l), "GHCR.io"));
        assert!(!host_allowed(Some(&l), "docker.io"));
        assert!(host_allowed(Some(&l), "r.example.com"));
        assert!(host_allowed(Some(&l), "a.b.example.com"));
        assert!(!host_allowed(Some(&l), "example.com"));
        assert!(!host_allowed(Some(&l), "badexample.com"));
        assert!(!host_allowed(Some(&[]), "ghcr.io"));
    }

    #[test]
    fn credentials() {
        assert_eq!(
            split_credentials("AWS:a:b c"),
            Some(("AWS".into(), "a:b c".into()))
        );
        assert_eq!(split_credentials("nocolon"), None);
        assert_eq!(split_credentials(":p"), None);
        assert_eq!(split_credentials("u:"), None);
        assert_eq!(split_credentials("u:p\n"), None);
        assert_eq!(split_credentials("ü:p"), None);
    }

    #[test]
    fn put_bodies() {
        let (v, h) = parse_put(br#"{"value":"x"}"#).unwrap();
        assert_eq!((v.as_str(), h), ("x", None));
        let (_, h) = parse_put(br#"{"value":"x","allowed_hosts":["A.io"]}"#).unwrap();
        assert_eq!(h, Some(vec!["a.io".to_string()]));
        let e = parse_put(br#"{"value":"x","nope":1}"#).unwrap_err();
        assert_eq!(
            (e.code, e.param.as_deref()),
            (ErrorCode::UnknownField, Some("nope"))
        );
        let e = parse_put(br#"{"value":""}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("value"));
        let big = format!(
            r#"{{"value":"{}"}}"#,
            "a".repeat(sbx_api::secret::MAX_SECRET_VALUE_BYTES + 1)
        );
        assert_eq!(
            parse_put(big.as_bytes()).unwrap_err().param.as_deref(),
            Some("value")
        );
        let e = parse_put(br#"{"value":"x","allowed_hosts":["ok.io","a b"]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("allowed_hosts[1]"));
        let e = parse_put(br#"{"value": "sekrit-in-bad-json"#).unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidJson);
        assert!(!e.message.contains("sekrit"));
    }
}
