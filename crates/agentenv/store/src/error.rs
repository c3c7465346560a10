//! The crate's one error type.

use std::path::PathBuf;
use std::time::Duration;

/// Everything the chunk store can fail with; every variant names what it was working on.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Local file i/o.
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A bad [`crate::StoreConfig`].
    #[error("bad store config: {0}")]
    Config(String),
    /// A chunk whose bytes do not hash to its name (local file or remote object).
    #[error("chunk {id} from {source_name} is corrupt: {detail}")]
    Corrupt {
        id: String,
        source_name: String,
        detail: String,
    },
    /// A chunk a manifest needs is neither local nor (without a remote, or there) remote.
    #[error("chunk {id} is missing ({detail})")]
    MissingChunk { id: String, detail: String },
    /// No manifest with this id, locally or in the remote.
    #[error("manifest {id} not found")]
    ManifestNotFound { id: String },
    /// A manifest that does not parse or does not match its id.
    #[error("manifest {id} is invalid: {detail}")]
    BadManifest { id: String, detail: String },
    /// A metadata key or pin holder outside the allowed alphabet or length, or in a reserved prefix.
    #[error("bad key {key:?}: {detail}")]
    BadKey { key: String, detail: &'static str },
    /// The manifest is pinned; unpin it before deleting it.
    #[error("manifest {id} is pinned by {holders:?}")]
    Pinned { id: String, holders: Vec<String> },
    /// A remote call failed.
    #[error("remote {op} {key}: {source}")]
    Remote {
        op: &'static str,
        key: String,
        #[source]
        source: object_store::Error,
    },
    /// A remote call ran past its deadline.
    #[error("remote {op} {key}: no answer within {deadline:?}")]
    RemoteTimeout {
        op: &'static str,
        key: String,
        deadline: Duration,
    },
    /// A blocking worker thread died (a bug, reported rather than propagated as a panic).
    #[error("worker for {what} failed: {detail}")]
    Worker { what: &'static str, detail: String },
}

impl StoreError {
    pub(crate) fn io(
        what: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| StoreError::Io { what, path, source }
    }
}

/// Result alias of this crate.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;
