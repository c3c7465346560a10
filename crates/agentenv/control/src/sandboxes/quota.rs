//! Quotas: what running and paused sandboxes, snapshots (and operations in flight) hold, checked
//! before each operation that adds to them. A snapshot's bytes are known only once it is taken: a
//! snapshot is refused when its key's snapshots (or all of this node's) already fill their bytes, and
//! undone when it takes them over ([`Sandboxes::check_stored`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::{LifecycleError, Quota, Result, Sandboxes};
use crate::sandboxes::SandboxState;
use crate::store::SandboxRecord;

/// Running and paused sandboxes, the memory of the running ones (MiB), and snapshots with their bytes
/// on this node's disk (bytes only of snapshots taken: one in flight counts as 0).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Usage {
    pub(super) running: usize,
    pub(super) paused: usize,
    pub(super) memory_mb: u64,
    pub(super) snapshots: usize,
    pub(super) snapshot_bytes: u64,
}

const GIB: u64 = 1 << 30;

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
            snapshots: self.snapshots + o.snapshots,
            snapshot_bytes: self.snapshot_bytes + o.snapshot_bytes,
        }
    }
    fn minus(self, o: Usage) -> Usage {
        Usage {
            running: self.running - o.running,
            paused: self.paused - o.paused,
            memory_mb: self.memory_mb - o.memory_mb,
            snapshots: self.snapshots - o.snapshots,
            snapshot_bytes: self.snapshot_bytes - o.snapshot_bytes,
        }
    }
    fn of(r: &SandboxRecord) -> Usage {
        match r.state {
            SandboxState::Running => Usage {
                running: 1,
                memory_mb: u64::from(r.memory_mb),
                ..Usage::default()
            },
            SandboxState::Paused => Usage {
                paused: 1,
                ..Usage::default()
            },
        }
    }
    /// One more snapshot (its bytes unknown until it is taken).
    pub(super) fn snapshot() -> Usage {
        Usage {
            snapshots: 1,
            ..Usage::default()
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
        (
            "snapshots",
            used.snapshots as u64,
            add.snapshots as u64,
            limit(quota.max_snapshots),
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
        .or_else(|| match quota.max_snapshot_gb {
            // A new snapshot's size is known only once it is taken: refused when the others fill the bytes.
            Some(gb) if add.snapshots > 0 && used.snapshot_bytes >= gb.saturating_mul(GIB) => {
                Some(bytes_over(who, used.snapshot_bytes, gb))
            }
            _ => None,
        })
}

fn bytes_over(who: &str, used: u64, gb: u64) -> String {
    format!(
        "{who}snapshots on this node's disk: {:.2} GiB stored, the limit is {gb} GiB",
        used as f64 / GIB as f64
    )
}

/// Why snapshots holding `used` bytes pass the server's stored-bytes budget of `gb` GiB (with room for
/// none more when `full` holds), if they do.
fn storage_over(max_gb: Option<u64>, used: u64, full: bool) -> Option<String> {
    let max = max_gb?.saturating_mul(GIB);
    (used > max || (full && used >= max)).then(|| {
        format!(
            "this server's snapshot storage is full: {:.2} GiB stored, the budget is {} GiB",
            used as f64 / GIB as f64,
            max / GIB
        )
    })
}

impl Sandboxes {
    /// What operations in flight will add, in all.
    pub(super) fn in_flight(&self) -> Usage {
        self.reserved.lock().expect("reservations").total
    }

    /// Snapshots of this node and their bytes: in all, and `owner`'s.
    fn stored(&self, owner: &str) -> (Usage, Usage) {
        self.backend.snapshots().into_iter().fold(
            (Usage::default(), Usage::default()),
            |(all, own), s| {
                let u = Usage {
                    snapshots: 1,
                    snapshot_bytes: s.bytes,
                    ..Usage::default()
                };
                let own = match self.owners.snapshot_owner(&s.id) == owner {
                    true => own.plus(u),
                    false => own,
                };
                (all.plus(u), own)
            },
        )
    }

    /// Reserves `add` for tenant `owner`: records (and, for a snapshot, the snapshots there are) plus
    /// operations in flight plus `add` must fit both the server's quota and the tenant's, and a snapshot
    /// the server's stored-bytes budget.
    pub(super) fn reserve(&self, owner: &str, add: Usage) -> Result<Reservation> {
        let tenant_quota = self.ring.quota_of(owner);
        let records = self.records.lock().expect("records");
        let (mut all, mut own) =
            records
                .values()
                .fold((Usage::default(), Usage::default()), |(all, own), r| {
                    let u = Usage::of(r);
                    let own = if r.owner == owner { own.plus(u) } else { own };
                    (all.plus(u), own)
                });
        let mut reserved = self.reserved.lock().expect("reservations");
        if add.snapshots > 0 {
            // Listed under the reservations' lock: a snapshot just taken is listed before its
            // reservation goes, so it is counted at least once.
            let (s_all, s_own) = self.stored(owner);
            (all, own) = (all.plus(s_all), own.plus(s_own));
            if let Some(why) = storage_over(self.cfg.max_stored_gb, all.snapshot_bytes, true) {
                return Err(LifecycleError::StorageFull(why));
            }
        }
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

    /// After a snapshot of `owner` was taken: an error when the bytes of `owner`'s snapshots or of all
    /// this node's now pass their limit (the caller undoes the snapshot).
    pub(super) fn check_stored(&self, owner: &str) -> Result<()> {
        let (all, own) = self.stored(owner);
        if let Some(why) = storage_over(self.cfg.max_stored_gb, all.snapshot_bytes, false) {
            return Err(LifecycleError::StorageFull(why));
        }
        let (key, tenant) = (format!("key {owner}: "), self.ring.quota_of(owner));
        for (who, quota, used) in [("", &self.cfg.quota, all), (key.as_str(), &tenant, own)] {
            match quota.max_snapshot_gb {
                Some(gb) if used.snapshot_bytes > gb.saturating_mul(GIB) => {
                    return Err(LifecycleError::QuotaExceeded(bytes_over(
                        who,
                        used.snapshot_bytes,
                        gb,
                    )));
                }
                _ => {}
            }
        }
        Ok(())
    }
}
