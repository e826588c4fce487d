//! The node's CA for inspected HTTPS: made once (ECDSA P-256, ten years), kept as
//! `egress-ca.pem` and `egress-ca.key` (0600) in the node's data directory and loaded again
//! at the next start, so a sandbox image that trusts it keeps trusting it. Leaf certificates
//! for the names the proxy terminates are minted on demand (30 days) and kept per name for a
//! day.

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SerialNumber,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::sign::CertifiedKey;

use super::EgressError;
use sbx_node::sync::LockExt;

/// The CA's certificate's file name in the CA directory.
pub const CA_CERT_FILE: &str = "egress-ca.pem";
/// The CA's key's file name (mode 0600).
pub const CA_KEY_FILE: &str = "egress-ca.key";

/// A leaf is minted again after this long.
const LEAF_KEPT: Duration = Duration::from_secs(24 * 3600);
/// Most leaves kept (the cache starts over past it).
const MAX_LEAVES: usize = 4096;

/// The node's CA (made once, kept as ca_dir/egress-ca.pem and ca_dir/egress-ca.key (0600),
/// loaded again at the next start).
pub struct NodeCa {
    cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
    provider: Arc<rustls::crypto::CryptoProvider>,
    leaves: Mutex<HashMap<String, (Instant, Arc<CertifiedKey>)>>,
}

impl std::fmt::Debug for NodeCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeCa").finish_non_exhaustive()
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> EgressError + '_ {
    move |source| EgressError::CaIo {
        path: path.to_path_buf(),
        source,
    }
}

fn random_serial() -> SerialNumber {
    let mut b = [0u8; 16];
    // A fixed serial is only a worse serial: getrandom does not fail on Linux past boot.
    let _ = getrandom::getrandom(&mut b);
    b[0] &= 0x7f;
    b[0] |= 0x01;
    SerialNumber::from_slice(&b)
}

fn ca_params() -> CertificateParams {
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "sbx");
    dn.push(DnType::CommonName, "sbx egress proxy CA");
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let now = time::OffsetDateTime::now_utc();
    p.not_before = now - time::Duration::days(1);
    p.not_after = now + time::Duration::days(3650);
    p.serial_number = Some(random_serial());
    p
}

/// Writes `data` to `path` through a temporary file renamed over it, with `mode`.
fn write_file(path: &Path, data: &[u8], mode: u32) -> Result<(), EgressError> {
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(io_err(&tmp))?;
    f.write_all(data).map_err(io_err(&tmp))?;
    f.sync_all().map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io_err(path))
}

impl NodeCa {
    /// Loads the CA kept in `dir`, or makes one and keeps it there when there is none. A
    /// certificate without its key (or the reverse) is an error, not replaced: sandboxes may
    /// trust the certificate.
    pub fn load_or_create(dir: &Path) -> Result<NodeCa, EgressError> {
        let cert_path = dir.join(CA_CERT_FILE);
        let key_path = dir.join(CA_KEY_FILE);
        let (cert_pem, key) = match (cert_path.exists(), key_path.exists()) {
            (true, true) => {
                let cert_pem = std::fs::read_to_string(&cert_path).map_err(io_err(&cert_path))?;
                let key_pem = std::fs::read_to_string(&key_path).map_err(io_err(&key_path))?;
                let key = KeyPair::from_pem(&key_pem).map_err(|e| EgressError::CaBad {
                    path: key_path.clone(),
                    why: e.to_string(),
                })?;
                (cert_pem, key)
            }
            (false, false) => {
                std::fs::create_dir_all(dir).map_err(io_err(dir))?;
                let key = KeyPair::generate()?;
                let cert = ca_params().self_signed(&key)?;
                write_file(&key_path, key.serialize_pem().as_bytes(), 0o600)?;
                let cert_pem = cert.pem();
                write_file(&cert_path, cert_pem.as_bytes(), 0o644)?;
                (cert_pem, key)
            }
            (cert, _) => {
                let missing: PathBuf = if cert { key_path } else { cert_path };
                return Err(EgressError::CaBad {
                    path: missing,
                    why: "is missing while the other half of the CA is there".into(),
                });
            }
        };
        let issuer = Issuer::from_ca_cert_pem(&cert_pem, key).map_err(|e| EgressError::CaBad {
            path: dir.join(CA_CERT_FILE),
            why: e.to_string(),
        })?;
        Ok(NodeCa {
            cert_pem,
            issuer,
            provider: super::tls::provider(),
            leaves: Mutex::new(HashMap::new()),
        })
    }

    /// The CA's certificate (PEM), for sandboxes to trust.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// A certificate for `host` (a DNS name) signed by the CA, with its key.
    pub(super) fn leaf(&self, host: &str) -> Result<Arc<CertifiedKey>, EgressError> {
        if let Some((at, key)) = self.leaves.locked().get(host) {
            if at.elapsed() < LEAF_KEPT {
                return Ok(key.clone());
            }
        }
        let key = Arc::new(self.mint(host)?);
        let mut leaves = self.leaves.locked();
        if leaves.len() >= MAX_LEAVES {
            leaves.clear();
        }
        leaves.insert(host.to_string(), (Instant::now(), key.clone()));
        Ok(key)
    }

    fn mint(&self, host: &str) -> Result<CertifiedKey, EgressError> {
        let mut p = CertificateParams::new(vec![host.to_string()])?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, host);
        p.distinguished_name = dn;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        p.use_authority_key_identifier_extension = true;
        let now = time::OffsetDateTime::now_utc();
        p.not_before = now - time::Duration::hours(1);
        p.not_after = now + time::Duration::days(30);
        p.serial_number = Some(random_serial());
        let key = KeyPair::generate()?;
        let cert = p.signed_by(&key, &self.issuer)?;
        let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let signing = self.provider.key_provider.load_private_key(der)?;
        Ok(CertifiedKey::new(
            vec![CertificateDer::from(cert.der().to_vec())],
            signing,
        ))
    }
}
