//! Errors of the cluster store.

/// What went wrong talking to etcd, or with what it holds.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// etcd did not answer within the deadline, or refused the connection: retry later.
    #[error("etcd unavailable ({what}): {why}")]
    Unavailable { what: &'static str, why: String },
    /// A stored record cannot be read.
    #[error(transparent)]
    Corrupt(#[from] crate::schema::DecodeError),
    /// An argument no etcd call can take.
    #[error("{0}")]
    Invalid(String),
    /// etcd refused the call: this client's user (its certificate's CN) may not do it.
    #[error("etcd refused {what}: {why}")]
    Denied { what: &'static str, why: String },
    /// A TLS file (`--etcd-*`, `--tls-*`, `--node-ca`) cannot be read or used.
    #[error("TLS file {path}: {source}")]
    Tls {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl ClusterError {
    pub(crate) fn unavailable(what: &'static str, why: impl std::fmt::Display) -> ClusterError {
        ClusterError::Unavailable {
            what,
            why: why.to_string(),
        }
    }
}
