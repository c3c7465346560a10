//! Forks: one capture of a running sandbox, then one restore per new sandbox.

use super::*;

impl Sandboxes {
    /// Forks a sandbox into `count` (1..=20) new ones: one capture, then one restore each. Each result
    /// is a new running sandbox or why that fork failed.
    pub async fn fork(
        &self,
        caller: &Caller,
        id: &str,
        count: Option<u32>,
        timeout_s: Option<u64>,
    ) -> Result<Vec<Result<SandboxRecord>>> {
        let count = count.unwrap_or(1);
        if !(1..=MAX_FORKS).contains(&count) {
            return Err(LifecycleError::Invalid(format!(
                "count must be between 1 and {MAX_FORKS}, got {count}"
            )));
        }
        let timeout = checked_timeout(timeout_s)?;
        self.get_as(caller, id)?;
        let lock = self.op_lock(id);
        let _guard = lock.lock().await;
        let src = self.get_as(caller, id)?;
        let _quota = self.reserve(
            &src.owner,
            Usage {
                running: count as usize,
                paused: 0,
                memory_mb: u64::from(count) * u64::from(src.memory_mb),
                ..Usage::default()
            },
        )?;
        let ids: Vec<String> = (0..count).map(|_| keys::generate_sandbox_id()).collect();
        let results = match self
            .within(
                "fork",
                id,
                self.cfg.deadlines.fork,
                self.backend.fork(id, &ids),
            )
            .await
        {
            Ok(r) => r,
            Err(e) => {
                if matches!(e, LifecycleError::DeadlineExceeded { .. }) {
                    for fid in &ids {
                        self.kill_wedged(fid).await;
                    }
                }
                return Err(e);
            }
        };
        let now = now_ms();
        let mut out = Vec::with_capacity(results.len());
        for (fid, r) in ids.iter().zip(results) {
            out.push(match r {
                Ok(_) => {
                    let rec = SandboxRecord {
                        sandbox_id: fid.clone(),
                        started_at_ms: now,
                        end_at_ms: now + (timeout * 1000) as i64,
                        state: SandboxState::Running,
                        access_token: keys::generate_access_token(),
                        paused_at_ms: None,
                        paused_filesystem: false,
                        ..src.clone()
                    };
                    match self.put(rec.clone()) {
                        Ok(()) => Ok(rec),
                        Err(e) => {
                            let _ = self.backend.kill(fid).await;
                            Err(e)
                        }
                    }
                }
                Err(e) => Err(e.into()),
            });
        }
        tracing::info!(sandbox = %id, count, ok = out.iter().filter(|r| r.is_ok()).count(), "forked sandbox");
        Ok(out)
    }
}
