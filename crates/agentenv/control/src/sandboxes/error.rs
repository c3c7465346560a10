//! `LifecycleError`, and the one conversion from the backend's [`VmError`].

use std::sync::Arc;

use crate::backend::VmError;

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
    /// The VM backend refused or failed (its own case: invalid input, no network, no capacity,
    /// failure); see [`LifecycleError::vm_case`].
    #[error(transparent)]
    Vm(Arc<VmError>),
    #[error("state store failure")]
    Store(#[source] Arc<dyn std::error::Error + Send + Sync>),
    /// The operation would take the key over one of its quotas.
    #[error("quota exceeded: {0}")]
    QuotaExceeded(String),
    /// The server's budget for snapshots on its disk is spent (`LifecycleConfig::max_stored_gb`).
    #[error("{0}")]
    StorageFull(String),
    /// A built-in template is being built on first use (or its build failed); a later create gets it.
    #[error("{0}")]
    Building(String),
    /// A create named a volume its tenant does not have.
    #[error("volume {0} not found")]
    VolumeNotFound(String),
    /// A volume could not be mounted into the sandbox (the guest refused or did not answer).
    #[error("mounting a volume at {path} in sandbox {id} failed: {detail}")]
    Mount {
        id: String,
        path: String,
        detail: String,
    },
    /// A runtime call missed its deadline; the VM was killed and the sandbox is gone.
    #[error("{op} of sandbox {id} missed its {secs:.0} s deadline; the VM was killed")]
    DeadlineExceeded {
        op: &'static str,
        id: String,
        secs: f64,
    },
}

/// What a [`LifecycleError::Vm`] means for the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmCase {
    /// The request was wrong (an id, name or size, or a network this host cannot give).
    BadRequest,
    /// No room now; retrying later may work.
    NoCapacity,
    /// The backend failed.
    Failed,
}

impl LifecycleError {
    /// The case of a [`LifecycleError::Vm`]; `None` for the other variants.
    pub fn vm_case(&self) -> Option<VmCase> {
        let LifecycleError::Vm(e) = self else {
            return None;
        };
        Some(match **e {
            VmError::Invalid(_) | VmError::NetworkUnavailable(_) => VmCase::BadRequest,
            VmError::NoCapacity(_) => VmCase::NoCapacity,
            _ => VmCase::Failed,
        })
    }
}

impl From<VmError> for LifecycleError {
    fn from(e: VmError) -> Self {
        match e {
            VmError::SandboxNotFound(i) => LifecycleError::SandboxNotFound(i),
            VmError::TemplateNotFound(t) => LifecycleError::TemplateNotFound(t),
            VmError::SnapshotNotFound(s) => LifecycleError::SnapshotNotFound(s),
            VmError::AlreadyPaused(i) => LifecycleError::AlreadyPaused(i),
            VmError::NotPaused(i) => LifecycleError::AlreadyRunning(i),
            VmError::Paused(i) => LifecycleError::Paused(i),
            e => {
                if matches!(e, VmError::Failed(_)) {
                    tracing::error!(error = ?e, "backend error");
                }
                LifecycleError::Vm(Arc::new(e))
            }
        }
    }
}
