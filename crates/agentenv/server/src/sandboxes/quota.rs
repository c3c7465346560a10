//! Quotas: what running and paused sandboxes (and operations in flight) hold, checked before each
//! operation that adds to them.

use std::sync::{Arc, Mutex};

use super::{LifecycleError, Result, Sandboxes};
use crate::model::SandboxState;

/// Running and paused sandboxes, and the memory of the running ones (MiB).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Usage {
    pub(super) running: usize,
    pub(super) paused: usize,
    pub(super) memory_mb: u64,
}

/// Quota held for an operation in flight; released when dropped (the records count from then on).
pub(super) struct Reservation {
    held: Usage,
    pool: Arc<Mutex<Usage>>,
}

impl Usage {
    fn plus(self, o: Usage) -> Usage {
        Usage {
            running: self.running + o.running,
            paused: self.paused + o.paused,
            memory_mb: self.memory_mb + o.memory_mb,
        }
    }
    fn minus(self, o: Usage) -> Usage {
        Usage {
            running: self.running - o.running,
            paused: self.paused - o.paused,
            memory_mb: self.memory_mb - o.memory_mb,
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut r = self.pool.lock().expect("reservations");
        *r = r.minus(self.held);
    }
}

impl Sandboxes {
    /// Reserves `add` against the quota: records plus operations in flight plus `add` must fit.
    pub(super) fn reserve(&self, add: Usage) -> Result<Reservation> {
        let q = &self.cfg.quota;
        let records = self.records.lock().expect("records");
        let stored = records.values().fold(Usage::default(), |u, r| {
            u.plus(match r.state {
                SandboxState::Running => Usage {
                    running: 1,
                    paused: 0,
                    memory_mb: u64::from(r.memory_mb),
                },
                SandboxState::Paused => Usage {
                    running: 0,
                    paused: 1,
                    memory_mb: 0,
                },
            })
        });
        let mut reserved = self.reserved.lock().expect("reservations");
        let used = stored.plus(*reserved);
        let limit = |m: Option<usize>| m.map(|m| m as u64);
        let checks = [
            (
                "running sandboxes",
                used.running as u64,
                add.running as u64,
                limit(q.max_running),
            ),
            (
                "paused sandboxes",
                used.paused as u64,
                add.paused as u64,
                limit(q.max_paused),
            ),
            (
                "memory of running sandboxes (MiB)",
                used.memory_mb,
                add.memory_mb,
                q.max_memory_mb,
            ),
        ];
        let over = checks
            .into_iter()
            .find_map(|(what, used, add, max)| match max {
                Some(max) if add > 0 && used + add > max => Some(format!(
                    "{what}: {used} in use, {add} more asked, the limit is {max}"
                )),
                _ => None,
            });
        if let Some(why) = over {
            return Err(LifecycleError::QuotaExceeded(why));
        }
        *reserved = reserved.plus(add);
        Ok(Reservation {
            held: add,
            pool: self.reserved.clone(),
        })
    }
}
