//! `LifecycleError` and the conversions from the runtime's errors.

use crate::backend::{
    CreateError, KillError, NetworkError, PauseError, ResumeError, SnapshotError,
};
use agentenv_runtime::vmm::VmmError;

/// Why a lifecycle operation failed. HTTP status is decided at the edge (`error.rs`), nowhere else.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LifecycleError {
    #[error("sandbox {0} was not found")]
    SandboxNotFound(String),
    #[error("template '{0}' not found")]
    TemplateNotFound(String),
    #[error("snapshot '{0}' not found")]
    SnapshotNotFound(String),
    #[error("sandbox {0} is already paused")]
    AlreadyPaused(String),
    #[error("sandbox {0} is already running")]
    AlreadyRunning(String),
    #[error("sandbox {0} is paused")]
    Paused(String),
    /// The request is malformed (bad timeout, name, count, ...).
    #[error("{0}")]
    Invalid(String),
    /// The runtime failed; the text says where.
    #[error("{0}")]
    Runtime(String),
    #[error("state store failure: {0}")]
    Store(String),
    /// The operation would take the key over one of its quotas.
    #[error("quota exceeded: {0}")]
    QuotaExceeded(String),
    /// The host has no room for another VM now (e.g. every QEMU uid is taken); retrying later may work.
    #[error("no capacity: {0}")]
    Unavailable(String),
    /// A runtime call missed its deadline; the VM was killed and the sandbox is gone.
    #[error("{op} of sandbox {id} missed its {secs:.0} s deadline; the VM was killed")]
    DeadlineExceeded {
        op: &'static str,
        id: String,
        secs: f64,
    },
}

pub(super) fn runtime(e: impl std::fmt::Display) -> LifecycleError {
    tracing::error!(error = %e, "runtime error");
    LifecycleError::Runtime(e.to_string())
}

impl From<CreateError> for LifecycleError {
    fn from(e: CreateError) -> Self {
        match e {
            CreateError::UnknownTemplate(t) => LifecycleError::TemplateNotFound(t),
            CreateError::InvalidId(i) => {
                LifecycleError::Invalid(format!("invalid sandbox id {i:?}"))
            }
            CreateError::Vmm(VmmError::NoUid(why)) => LifecycleError::Unavailable(why),
            e @ CreateError::NetworkUnavailable(_) => LifecycleError::Invalid(e.to_string()),
            e => runtime(e),
        }
    }
}
impl From<PauseError> for LifecycleError {
    fn from(e: PauseError) -> Self {
        match e {
            PauseError::NotFound(i) => LifecycleError::SandboxNotFound(i),
            PauseError::AlreadyPaused(i) => LifecycleError::AlreadyPaused(i),
            e => runtime(e),
        }
    }
}
impl From<ResumeError> for LifecycleError {
    fn from(e: ResumeError) -> Self {
        match e {
            ResumeError::NotFound(i) => LifecycleError::SandboxNotFound(i),
            ResumeError::NotPaused(i) => LifecycleError::AlreadyRunning(i),
            ResumeError::Vmm(VmmError::NoUid(why)) => LifecycleError::Unavailable(why),
            e => runtime(e),
        }
    }
}
impl From<KillError> for LifecycleError {
    fn from(e: KillError) -> Self {
        match e {
            KillError::NotFound(i) => LifecycleError::SandboxNotFound(i),
            e => runtime(e),
        }
    }
}
impl From<SnapshotError> for LifecycleError {
    fn from(e: SnapshotError) -> Self {
        match e {
            SnapshotError::SandboxNotFound(i) => LifecycleError::SandboxNotFound(i),
            SnapshotError::NotFound(i) => LifecycleError::SnapshotNotFound(i),
            SnapshotError::InvalidName(n) => LifecycleError::Invalid(format!(
                "invalid snapshot name {n:?}: use [A-Za-z0-9_.-] (at most 64), optionally :tag"
            )),
            e => runtime(e),
        }
    }
}

impl From<NetworkError> for LifecycleError {
    fn from(e: NetworkError) -> Self {
        match e {
            NetworkError::NotFound(i) => LifecycleError::SandboxNotFound(i),
            e @ NetworkError::Unavailable { .. } => LifecycleError::Invalid(e.to_string()),
            e => runtime(e),
        }
    }
}
