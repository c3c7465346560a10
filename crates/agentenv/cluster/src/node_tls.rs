//! Gateway-to-node HTTPS. A node serves its API with a certificate of the cluster's CA whose name
//! (subjectAltName DNS) is its node id (`--tls-cert`, `--tls-key`); a gateway given that CA
//! (`--node-ca`) checks every node's certificate against the id of the record it routes by and refuses
//! plain-HTTP nodes. So the clients' traffic a gateway forwards reaches only the node the record names,
//! never whoever answers at (or spoofs) its address.
//!
//! The other way round, a gateway shows nodes a client certificate naming [`GATEWAY_NAME`] (`gateway
//! --client-cert`); a node given its CA (`serve --gateway-ca`) then takes the tenant the gateway
//! asserts (`agentenv_api::conn::TENANT_HEADER`) instead of an API key, so no node sees the operator's
//! or a tenant's key. A node's own certificate (named by its id, never by a dotted name) cannot pass
//! for a gateway's.

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

/// The DNS name (subjectAltName) of a gateway's client certificate.
pub const GATEWAY_NAME: &str = "gateway.agentenv.internal";

fn roots(ca: &Path) -> Result<rustls::RootCertStore, ClusterError> {
    let mut roots = rustls::RootCertStore::empty();
    for c in certs(ca)? {
        roots.add(c).map_err(|e| bad(ca, e))?;
    }
    Ok(roots)
}

/// A certificate chain and its private key (PEM files).
fn identity(
    cert: &Path,
    key: &Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), ClusterError> {
    let key_der = PrivateKeyDer::from_pem_slice(&read(key)?).map_err(|e| bad(key, e))?;
    Ok((certs(cert)?, key_der))
}

/// The node's HTTPS server: its certificate chain and key (PEM). With `gateway_ca`, clients may show a
/// certificate of that CA ([`is_gateway`] tells whether it is a gateway's); clients without one are
/// still served (they authenticate with an API key).
pub fn server_config(
    cert: &Path,
    key: &Path,
    gateway_ca: Option<&Path>,
) -> Result<Arc<rustls::ServerConfig>, ClusterError> {
    let (chain, key_der) = identity(cert, key)?;
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| bad(cert, e))?;
    let builder = match gateway_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots(ca)?),
                provider(),
            )
            .allow_unauthenticated()
            .build()
            .map_err(|e| bad(ca, e))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut cfg = builder
        .with_single_cert(chain, key_der)
        .map_err(|e| bad(key, e))?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// Whether the client of `conn` showed a certificate (already verified against the gateway CA of
/// [`server_config`]) naming [`GATEWAY_NAME`].
pub fn is_gateway(conn: &rustls::ServerConnection) -> bool {
    let Some(leaf) = conn.peer_certificates().and_then(|c| c.first()) else {
        return false;
    };
    let name = rustls_pki_types::ServerName::try_from(GATEWAY_NAME).expect("a valid DNS name");
    webpki::EndEntityCert::try_from(leaf)
        .and_then(|c| c.verify_is_valid_for_subject_name(&name))
        .is_ok()
}

/// A gateway's client: trusts only `ca` (PEM); the name checked is the node id the connection is for.
/// With `client` (certificate and key, PEM), it shows nodes that certificate (one naming
/// [`GATEWAY_NAME`]).
pub fn client_config(
    ca: &Path,
    client: Option<(&Path, &Path)>,
) -> Result<Arc<rustls::ClientConfig>, ClusterError> {
    // ALPN is left to the HTTP client (HTTP/1.1).
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| bad(ca, e))?
        .with_root_certificates(roots(ca)?);
    let cfg = match client {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let (chain, key_der) = identity(cert, key)?;
            builder
                .with_client_auth_cert(chain, key_der)
                .map_err(|e| bad(cert, e))?
        }
    };
    Ok(Arc::new(cfg))
}
