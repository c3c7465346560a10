//! Lifecycle settings: deadlines of runtime calls, paused retention, quotas, the stored-bytes budget.

use std::time::Duration;

pub use crate::tenants::Quota;

/// How long each runtime call may take before its VM is declared wedged and killed.
#[derive(Debug, Clone)]
pub struct Deadlines {
    pub create: Duration,
    pub pause: Duration,
    pub resume: Duration,
    pub kill: Duration,
    pub snapshot: Duration,
    pub fork: Duration,
}

impl Default for Deadlines {
    /// Generous for TCG (a cold boot takes up to two minutes there).
    fn default() -> Self {
        let s = Duration::from_secs;
        Deadlines {
            create: s(180),
            pause: s(120),
            resume: s(60),
            kill: s(30),
            snapshot: s(300),
            fork: s(600),
        }
    }
}

/// Lifecycle settings.
#[derive(Debug, Clone)]
pub struct LifecycleConfig {
    pub deadlines: Deadlines,
    /// A paused sandbox is deleted this long after it was paused.
    pub paused_retention: Duration,
    pub quota: Quota,
    /// What all snapshots on this node's disk may occupy together, GiB (`None`: no budget): past it,
    /// new snapshots are refused ([`crate::LifecycleError::StorageFull`]).
    pub max_stored_gb: Option<u64>,
}

/// Default retention of paused sandboxes: 30 days.
pub const DEFAULT_PAUSED_RETENTION: Duration = Duration::from_secs(30 * 86_400);

impl Default for LifecycleConfig {
    fn default() -> Self {
        LifecycleConfig {
            deadlines: Deadlines::default(),
            paused_retention: DEFAULT_PAUSED_RETENTION,
            quota: Quota::default(),
            max_stored_gb: None,
        }
    }
}
