//! The server's egress CA: a key kept in the state folder (mode 0600) and its certificate, which
//! every guest trusts; it signs a leaf per host name the proxy intercepts, minted on first use.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair, KeyUsagePurpose,
    SanType,
};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::sign::CertifiedKey;

use crate::EgressError;

/// Common name of the CA certificate.
pub const CA_NAME: &str = "agentenv egress CA";
/// Leaves kept; the cache is emptied when it is full.
const MAX_LEAVES: usize = 1024;

/// The CA and its minted leaves.
pub struct Ca {
    pem: String,
    issuer: rcgen::Certificate,
    key: KeyPair,
    provider: Arc<CryptoProvider>,
    leaves: Mutex<HashMap<String, Arc<CertifiedKey>>>,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").finish_non_exhaustive()
    }
}

fn validity(p: &mut CertificateParams) {
    p.not_before = rcgen::date_time_ymd(2024, 1, 1);
    p.not_after = rcgen::date_time_ymd(2044, 1, 1);
}

/// The CA's parameters: fixed, so the certificate rebuilt from the stored key issues leaves that
/// chain to the stored certificate (same name, same key).
fn ca_params() -> CertificateParams {
    let mut p = CertificateParams::default();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_NAME);
    p.distinguished_name = dn;
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    validity(&mut p);
    p
}

impl Ca {
    /// The CA of `dir` (`ca.key`, `ca.pem`), made there on first use.
    pub fn load_or_create(dir: &Path) -> Result<Ca, EgressError> {
        let io = |what: &'static str, p: &Path, e: std::io::Error| EgressError::Io {
            what,
            path: p.to_owned(),
            source: e,
        };
        let (key_path, pem_path) = (dir.join("ca.key"), dir.join("ca.pem"));
        if !key_path.exists() || !pem_path.exists() {
            std::fs::create_dir_all(dir).map_err(|e| io("create", dir, e))?;
            let key = KeyPair::generate().map_err(EgressError::cert)?;
            let cert = ca_params().self_signed(&key).map_err(EgressError::cert)?;
            k3_common::fsutil::write_atomic(&key_path, key.serialize_pem().as_bytes())
                .map_err(|e| io("write", &key_path, e))?;
            k3_common::fsutil::write_atomic(&pem_path, cert.pem().as_bytes())
                .map_err(|e| io("write", &pem_path, e))?;
        }
        let key_pem = std::fs::read_to_string(&key_path).map_err(|e| io("read", &key_path, e))?;
        let pem = std::fs::read_to_string(&pem_path).map_err(|e| io("read", &pem_path, e))?;
        let key = KeyPair::from_pem(&key_pem).map_err(EgressError::cert)?;
        Ca::from_parts(pem, key)
    }

    /// A CA that lives in memory only (tests, servers without a state folder).
    pub fn ephemeral() -> Result<Ca, EgressError> {
        let key = KeyPair::generate().map_err(EgressError::cert)?;
        let pem = ca_params()
            .self_signed(&key)
            .map_err(EgressError::cert)?
            .pem();
        Ca::from_parts(pem, key)
    }

    fn from_parts(pem: String, key: KeyPair) -> Result<Ca, EgressError> {
        let issuer = ca_params().self_signed(&key).map_err(EgressError::cert)?;
        Ok(Ca {
            pem,
            issuer,
            key,
            provider: Arc::new(rustls::crypto::ring::default_provider()),
            leaves: Mutex::new(HashMap::new()),
        })
    }

    /// The certificate guests trust, PEM.
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// The leaf for host `name` (cached).
    pub fn leaf(&self, name: &str) -> Result<Arc<CertifiedKey>, EgressError> {
        let name = name.to_ascii_lowercase();
        if let Some(k) = self.lock().get(&name) {
            return Ok(k.clone());
        }
        let mut p = CertificateParams::default();
        let san = match name.parse::<std::net::IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => SanType::DnsName(name.clone().try_into().map_err(EgressError::cert)?),
        };
        p.subject_alt_names = vec![san];
        p.distinguished_name.push(DnType::CommonName, name.as_str());
        validity(&mut p);
        let key = KeyPair::generate().map_err(EgressError::cert)?;
        let cert = p
            .signed_by(&key, &self.issuer, &self.key)
            .map_err(EgressError::cert)?;
        let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let signer = self
            .provider
            .key_provider
            .load_private_key(der)
            .map_err(|e| EgressError::Tls(e.to_string()))?;
        let leaf = Arc::new(CertifiedKey::new(vec![cert.der().clone()], signer));
        let mut leaves = self.lock();
        if leaves.len() >= MAX_LEAVES {
            leaves.clear();
        }
        leaves.insert(name, leaf.clone());
        Ok(leaf)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<CertifiedKey>>> {
        self.leaves.lock().unwrap_or_else(|e| e.into_inner())
    }
}
