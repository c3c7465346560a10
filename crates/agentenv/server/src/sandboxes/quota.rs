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

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut r = self.pool.lock().expect("reservations");
        r.running -= self.held.running;
        r.paused -= self.held.paused;
        r.memory_mb -= self.held.memory_mb;
    }
}

impl Sandboxes {
    /// Reserves `add` against the quota: records plus operations in flight plus `add` must fit.
    pub(super) fn reserve(&self, add: Usage) -> Result<Reservation> {
        let q = &self.cfg.quota;
        let records = self.records.lock().expect("records");
        let mut used = Usage::default();
        for r in records.values() {
            match r.state {
                SandboxState::Running => {
                    used.running += 1;
                    used.memory_mb += u64::from(r.memory_mb);
                }
                SandboxState::Paused => used.paused += 1,
            }
        }
        let mut reserved = self.reserved.lock().expect("reservations");
        let over = |what: &str, used: u64, add: u64, max: Option<u64>| match max {
            Some(max) if add > 0 && used + add > max => Some(format!(
                "{what}: {used} in use, {add} more asked, the limit is {max}"
            )),
            _ => None,
        };
        let why = over(
            "running sandboxes",
            (used.running + reserved.running) as u64,
            add.running as u64,
            q.max_running.map(|m| m as u64),
        )
        .or_else(|| {
            over(
                "paused sandboxes",
                (used.paused + reserved.paused) as u64,
                add.paused as u64,
                q.max_paused.map(|m| m as u64),
            )
        })
        .or_else(|| {
            over(
                "memory of running sandboxes (MiB)",
                used.memory_mb + reserved.memory_mb,
                add.memory_mb,
                q.max_memory_mb,
            )
        });
        if let Some(why) = why {
            return Err(LifecycleError::QuotaExceeded(why));
        }
        reserved.running += add.running;
        reserved.paused += add.paused;
        reserved.memory_mb += add.memory_mb;
        Ok(Reservation {
            held: add,
            pool: self.reserved.clone(),
        })
    }
}
