//! What the lifecycle is asked and tells: a create request, a sandbox's state, call timings, and why
//! it could not start.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::backend::{EgressPolicy, VmError};

/// Why the lifecycle could not start.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The state folder (records, owners) could not be read or written.
    #[error("the lifecycle's state folder")]
    State(#[source] crate::backend::Cause),
    /// The backend could not recover the VMs of the previous process.
    #[error("recovering the VMs of the previous process")]
    Recover(#[source] VmError),
}

/// What a create asks for.
#[derive(Debug, Clone, Default)]
pub struct CreateRequest {
    /// Template id or alias, or snapshot id or `name[:tag]`, as the caller names it.
    pub template: String,
    /// Seconds until it is killed (or paused with `auto_pause`); default [`super::DEFAULT_TIMEOUT_S`].
    pub timeout_s: Option<u64>,
    pub metadata: BTreeMap<String, String>,
    /// Environment of every process started in it.
    pub env_vars: BTreeMap<String, String>,
    /// On timeout pause instead of kill.
    pub auto_pause: bool,
    /// That pause keeps only the filesystem (`autoPauseMemory: false`; a resume cold-boots).
    pub auto_pause_filesystem: bool,
    /// Data-plane traffic to it while paused resumes it.
    pub auto_resume: bool,
    /// Its egress policy.
    pub network: EgressPolicy,
    /// Its user ports answer without its traffic token (E2B's `allowPublicTraffic`).
    pub public_traffic: bool,
    /// Whether the caller asked for a network explicitly (refused where sandboxes get none);
    /// otherwise such a host creates it without one.
    pub network_asked: bool,
    /// The `Host` its user ports see (E2B's `maskRequestHost`; `${PORT}` is the port).
    pub mask_request_host: Option<String>,
    /// Volumes to mount: (volume name, absolute guest path).
    pub volume_mounts: Vec<(String, String)>,
}

/// Where the lifecycle reports how long each backend call took (`op`: create, pause, ...).
pub trait OpObserver: Send + Sync {
    fn observe_op(&self, op: &'static str, took: Duration);
}
