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
}

impl ClusterError {
    pub(crate) fn unavailable(what: &'static str, why: impl std::fmt::Display) -> ClusterError {
        ClusterError::Unavailable {
            what,
            why: why.to_string(),
        }
    }
}
