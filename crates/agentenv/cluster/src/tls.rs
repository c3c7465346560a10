//! etcd over mutual TLS: the CA that signed etcd's certificate, and this process's client certificate.
//! With etcd's `--client-cert-auth` and auth on, the certificate's common name is the etcd user, so
//! each node and gateway has an identity of its own ([`crate::auth`] gives each only its keys).

use std::path::{Path, PathBuf};

use crate::ClusterError;

/// PEM files of one etcd client: the CA to trust, its certificate and its private key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdTls {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl EtcdTls {
    /// From the three flags (`--etcd-ca`, `--etcd-cert`, `--etcd-key`): all or none.
    pub fn from_flags(
        ca: Option<PathBuf>,
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
    ) -> Result<Option<EtcdTls>, ClusterError> {
        match (ca, cert, key) {
            (None, None, None) => Ok(None),
            (Some(ca), Some(cert), Some(key)) => Ok(Some(EtcdTls { ca, cert, key })),
            _ => Err(ClusterError::Invalid(
                "--etcd-ca, --etcd-cert and --etcd-key go together".into(),
            )),
        }
    }

    pub(crate) fn options(&self) -> Result<etcd_client::TlsOptions, ClusterError> {
        let ca = etcd_client::Certificate::from_pem(read(&self.ca)?);
        let id = etcd_client::Identity::from_pem(read(&self.cert)?, read(&self.key)?);
        Ok(etcd_client::TlsOptions::new()
            .ca_certificate(ca)
            .identity(id))
    }
}

/// A PEM file, at most 1 MiB.
pub(crate) fn read(path: &Path) -> Result<Vec<u8>, ClusterError> {
    use std::io::Read;
    let tls = |source| ClusterError::Tls {
        path: path.to_owned(),
        source,
    };
    let mut out = Vec::new();
    std::fs::File::open(path)
        .map_err(tls)?
        .take(1 << 20)
        .read_to_end(&mut out)
        .map_err(tls)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_three_flags_go_together_and_files_are_read_with_their_path_in_errors() {
        let p = |s: &str| Some(PathBuf::from(s));
        assert_eq!(EtcdTls::from_flags(None, None, None).unwrap(), None);
        assert!(
            EtcdTls::from_flags(p("ca"), p("c"), p("k"))
                .unwrap()
                .is_some()
        );
        for (a, b, c) in [
            (p("ca"), None, None),
            (None, p("c"), p("k")),
            (p("ca"), p("c"), None),
        ] {
            assert!(matches!(
                EtcdTls::from_flags(a, b, c),
                Err(ClusterError::Invalid(_))
            ));
        }
        let missing = EtcdTls {
            ca: PathBuf::from("/nonexistent/ca.pem"),
            cert: PathBuf::from("/nonexistent/c.pem"),
            key: PathBuf::from("/nonexistent/k.pem"),
        };
        match missing.options() {
            Err(ClusterError::Tls { path, .. }) => assert_eq!(path, missing.ca),
            other => panic!("{other:?}"),
        }
    }
}
