//! Gateway-to-node HTTPS. A node serves its API with a certificate of the cluster's CA whose name
//! (subjectAltName DNS) is its node id (`--tls-cert`, `--tls-key`); a gateway given that CA
//! (`--node-ca`) checks every node's certificate against the id of the record it routes by and refuses
//! plain-HTTP nodes. So the server key and the clients' traffic a gateway forwards reach only the node
//! the record names, never whoever answers at (or spoofs) its address.

use std::path::Path;
use std::sync::Arc;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::ClusterError;
use crate::tls::read;

fn bad(path: &Path, why: impl std::fmt::Display) -> ClusterError {
    ClusterError::Tls {
        path: path.to_owned(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, why.to_string()),
    }
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, ClusterError> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(path, e))?;
    if certs.is_empty() {
        return Err(bad(path, "no certificate in it"));
    }
    Ok(certs)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The node's HTTPS server: its certificate chain and key (PEM).
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, ClusterError> {
    let chain = certs(cert)?;
    let key_der = PrivateKeyDer::from_pem_slice(&read(key)?).map_err(|e| bad(key, e))?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| bad(cert, e))?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .map_err(|e| bad(key, e))?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// A gateway's client: trusts only `ca` (PEM); the name checked is the node id the connection is for.
pub fn client_config(ca: &Path) -> Result<Arc<rustls::ClientConfig>, ClusterError> {
    let mut roots = rustls::RootCertStore::empty();
    for c in certs(ca)? {
        roots.add(c).map_err(|e| bad(ca, e))?;
    }
    // ALPN is left to the HTTP client (HTTP/1.1).
    let cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| bad(ca, e))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(cfg))
}
