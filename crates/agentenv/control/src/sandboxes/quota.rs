//! Quotas: what running and paused sandboxes (and operations in flight) hold, checked before each
//! operation that adds to them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::{LifecycleError, Quota, Result, Sandboxes};
use crate::sandboxes::SandboxState;
use crate::store::SandboxRecord;

/// Running and paused sandboxes, and the memory of the running ones (MiB).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Usage {
    pub(super) running: usize,
    pub(super) paused: usize,
    pub(super) memory_mb: u64,
}

/// What operations in flight will add: in all, and per tenant.
#[derive(Debug, Default)]
pub(super) struct Reserved {
    total: Usage,
    by_owner: HashMap<String, Usage>,
}

/// Quota held for an operation in flight; released when dropped (the records count from then on).
pub(super) struct Reservation {
    held: Usage,
    owner: String,
    pool: Arc<Mutex<Reserved>>,
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
    fn of(r: &SandboxRecord) -> Usage {
        match r.state {
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
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut r = self.pool.lock().expect("reservations");
        r.total = r.total.minus(self.held);
        if let Some(u) = r.by_owner.get_mut(&self.owner) {
            *u = u.minus(self.held);
        }
    }
}

/// The first limit of `quota` that `used + add` passes, said in words.
fn over(who: &str, quota: &Quota, used: Usage, add: Usage) -> Option<String> {
    let limit = |m: Option<usize>| m.map(|m| m as u64);
    let checks = [
        (
            "running sandboxes",
            used.running as u64,
            add.running as u64,
            limit(quota.max_running),
        ),
        (
            "paused sandboxes",
            used.paused as u64,
            add.paused as u64,
            limit(quota.max_paused),
        ),
        (
            "memory of running sandboxes (MiB)",
            used.memory_mb,
            add.memory_mb,
            quota.max_memory_mb,
        ),
    ];
    checks
        .into_iter()
        .find_map(|(what, used, add, max)| match max {
            Some(max) if add > 0 && used + add > max => Some(format!(
                "{who}{what}: {used} in use, {add} more asked, the limit is {max}"
            )),
            _ => None,
        })
}

impl Sandboxes {
    /// What operations in flight will add, in all.
    pub(super) fn in_flight(&self) -> Usage {
        self.reserved.lock().expect("reservations").total
    }

    /// Reserves `add` for tenant `owner`: records plus operations in flight plus `add` must fit both the
    /// server's quota and the tenant's.
    pub(super) fn reserve(&self, owner: &str, add: Usage) -> Result<Reservation> {
        let tenant_quota = self.ring.quota_of(owner);
        let records = self.records.lock().expect("records");
        let (all, own) =
            records
                .values()
                .fold((Usage::default(), Usage::default()), |(all, own), r| {
                    let u = Usage::of(r);
                    let own = if r.owner == owner { own.plus(u) } else { own };
                    (all.plus(u), own)
                });
        let mut reserved = self.reserved.lock().expect("reservations");
        let own_reserved = reserved.by_owner.get(owner).copied().unwrap_or_default();
        let why = over("", &self.cfg.quota, all.plus(reserved.total), add).or_else(|| {
            over(
                &format!("key {owner}: "),
                &tenant_quota,
                own.plus(own_reserved),
                add,
            )
        });
        if let Some(why) = why {
            return Err(LifecycleError::QuotaExceeded(why));
        }
        reserved.total = reserved.total.plus(add);
        let mine = reserved.by_owner.entry(owner.to_string()).or_default();
        *mine = mine.plus(add);
        Ok(Reservation {
            held: add,
            owner: owner.to_string(),
            pool: self.reserved.clone(),
        })
    }
}
