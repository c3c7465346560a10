//! The reaper: timed-out sandboxes are paused or killed, paused ones past the retention deleted.

use std::sync::Arc;
use std::time::Duration;

use super::{Caller, LifecycleError, Sandboxes, Transition, now_ms};
use crate::sandboxes::SandboxState;
use crate::store::SandboxRecord;

/// What the reaper does to a due sandbox.
#[derive(Debug, Clone, Copy)]
enum Expiry {
    Pause,
    Kill,
    /// Paused longer than the retention.
    Retention,
}

impl Sandboxes {
    /// Starts expiring every due sandbox: running ones past `endAt` are paused (`autoPause`) or
    /// killed, paused ones past the retention are killed. Each runs in its own task, so a wedged VM
    /// delays no other. The reaper detaches the tasks; tests await them.
    pub fn expire_due(self: &Arc<Self>) -> tokio::task::JoinSet<()> {
        let due: Vec<(String, Expiry)> = {
            let now = now_ms();
            let recs = self.records.lock().expect("records");
            recs.values()
                .filter_map(|r| Some((r.sandbox_id.clone(), self.due(r, now)?)))
                .collect()
        };
        let mut tasks = tokio::task::JoinSet::new();
        for (id, what) in due {
            if !self.expiring.lock().expect("expiring").insert(id.clone()) {
                continue;
            }
            let this = self.clone();
            tasks.spawn(async move {
                // Re-checked: a connect or a new timeout may have come in since.
                let still_due = this
                    .get(&id)
                    .is_some_and(|r| this.due(&r, now_ms()).is_some());
                let rec = this.get(&id);
                let memory = rec.as_ref().is_none_or(|r| r.auto_pause_memory);
                let token = rec.map(|r| r.access_token);
                let res = match what {
                    _ if !still_due => Ok(()),
                    Expiry::Pause => match this.pause_keeping(&Caller::Server, &id, memory).await {
                        Err(LifecycleError::QuotaExceeded(why)) => {
                            tracing::warn!(sandbox = %id, %why, "auto-pause over the paused quota: killing instead");
                            this.kill(&Caller::Server, &id).await
                        }
                        r => r,
                    },
                    Expiry::Kill | Expiry::Retention => this.kill(&Caller::Server, &id).await,
                };
                match res {
                    Ok(()) if still_due => {
                        tracing::info!(sandbox = %id, action = ?what, "sandbox expired");
                        match (this.get(&id), token) {
                            (Some(_), _) => this.report(Transition::AutoPaused(id.clone())),
                            (None, Some(access_token)) => this.report(Transition::Expired {
                                id: id.clone(),
                                access_token,
                            }),
                            (None, None) => {}
                        }
                    }
                    Ok(())
                    | Err(
                        LifecycleError::SandboxNotFound(_)
                        | LifecycleError::AlreadyPaused(_)
                        | LifecycleError::Paused(_),
                    ) => {}
                    Err(e) => tracing::error!(sandbox = %id, error = %e, "expiring sandbox failed"),
                }
                this.expiring.lock().expect("expiring").remove(&id);
            });
        }
        tasks
    }

    fn due(&self, r: &SandboxRecord, now: i64) -> Option<Expiry> {
        match r.state {
            SandboxState::Running if r.end_at_ms <= now => Some(if r.auto_pause {
                Expiry::Pause
            } else {
                Expiry::Kill
            }),
            SandboxState::Paused => {
                let retention =
                    i64::try_from(self.cfg.paused_retention.as_millis()).unwrap_or(i64::MAX);
                let since = r.paused_at_ms.unwrap_or(r.end_at_ms);
                (since.saturating_add(retention) <= now).then_some(Expiry::Retention)
            }
            SandboxState::Running => None,
        }
    }

    /// Forgets running sandboxes whose VM died on its own (killed from outside, OOM, crash): their files
    /// are removed and they are gone, with the reason logged. A sandbox with an operation in flight is
    /// left to that operation.
    pub fn reap_dead(self: &Arc<Self>) -> tokio::task::JoinSet<()> {
        let dead: Vec<String> = {
            let recs = self.records.lock().expect("records");
            recs.values()
                .filter(|r| r.state == SandboxState::Running)
                .map(|r| r.sandbox_id.clone())
                .filter(|id| self.backend.vm_state(id).is_none())
                .collect()
        };
        let mut tasks = tokio::task::JoinSet::new();
        for id in dead {
            let this = self.clone();
            tasks.spawn(async move {
                let lock = this.op_lock(&id);
                let Ok(_guard) = lock.try_lock() else { return };
                this.forget_if_dead(&id).await;
            });
        }
        tasks
    }

    /// Runs [`Self::expire_due`], [`Self::reap_dead`] and `keep_mounts` every 500 ms until the process ends.
    pub fn spawn_reaper(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let this = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            loop {
                tick.tick().await;
                let Some(s) = this.upgrade() else { return };
                s.expire_due().detach_all();
                s.reap_dead().detach_all();
                s.keep_mounts();
            }
        })
    }
}
