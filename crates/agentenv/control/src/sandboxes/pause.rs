//! Pause, resume (connect, the legacy resume, the data plane's auto-resume).

use super::*;

impl Sandboxes {
    /// Pauses a running sandbox (memory and processes kept). 409 when already paused.
    pub async fn pause(&self, caller: &Caller, id: &str) -> Result<()> {
        self.pause_keeping(caller, id, true).await
    }

    /// Pauses a running sandbox: with `memory` its memory and processes are kept; without, only its
    /// filesystem (its processes end; a resume cold-boots it). 409 when already paused.
    pub async fn pause_keeping(&self, caller: &Caller, id: &str, memory: bool) -> Result<()> {
        self.get_as(caller, id)?;
        let lock = self.op_lock(id);
        let _guard = lock.lock().await;
        let mut rec = self.get_as(caller, id)?;
        if rec.state == SandboxState::Paused {
            return Err(LifecycleError::AlreadyPaused(id.into()));
        }
        let _quota = self.reserve(
            &rec.owner,
            Usage {
                running: 0,
                paused: 1,
                memory_mb: 0,
                ..Usage::default()
            },
        )?;
        self.within(
            "pause",
            id,
            self.cfg.deadlines.pause,
            self.backend.pause(id, memory),
        )
        .await?;
        rec.state = SandboxState::Paused;
        rec.paused_filesystem = !memory;
        rec.paused_at_ms = Some(now_ms());
        self.put(rec)?;
        tracing::info!(sandbox = %id, "paused sandbox");
        Ok(())
    }

    /// Connect: running → extend `endAt` (200); paused → resume (201).
    /// Returns the record and whether it was resumed.
    pub async fn connect(
        &self,
        caller: &Caller,
        id: &str,
        timeout_s: Option<u64>,
    ) -> Result<(SandboxRecord, bool)> {
        let timeout = checked_timeout(timeout_s)?;
        self.get_as(caller, id)?;
        let lock = self.op_lock(id);
        let _guard = lock.lock().await;
        let mut rec = self.get_as(caller, id)?;
        let until = now_ms() + (timeout * 1000) as i64;
        let resumed = rec.state == SandboxState::Paused;
        if resumed {
            // The paused one stops counting once it runs; until then it holds its place.
            let _quota = self.reserve(
                &rec.owner,
                Usage {
                    running: 1,
                    paused: 0,
                    memory_mb: u64::from(rec.memory_mb),
                    ..Usage::default()
                },
            )?;
            self.within(
                "resume",
                id,
                self.cfg.deadlines.resume,
                self.backend.resume(id, &rec.env_vars),
            )
            .await?;
            rec.state = SandboxState::Running;
            rec.paused_filesystem = false;
            rec.paused_at_ms = None;
            rec.end_at_ms = until;
            tracing::info!(sandbox = %id, "resumed sandbox");
        } else {
            rec.end_at_ms = rec.end_at_ms.max(until);
        }
        self.put(rec.clone())?;
        Ok((rec, resumed))
    }

    /// Legacy resume: paused → resumed; running → 409.
    pub async fn resume_legacy(
        &self,
        caller: &Caller,
        id: &str,
        timeout_s: Option<u64>,
        auto_pause: Option<bool>,
    ) -> Result<SandboxRecord> {
        if self.get_as(caller, id)?.state == SandboxState::Running {
            return Err(LifecycleError::AlreadyRunning(id.into()));
        }
        let (mut rec, _) = self.connect(caller, id, timeout_s).await?;
        if let Some(ap) = auto_pause {
            rec.auto_pause = ap;
            self.put(rec.clone())?;
        }
        Ok(rec)
    }

    /// Resumes a paused sandbox on data-plane traffic when it asked for `autoResume` (one paused
    /// without memory stays paused: it needs a connect).
    pub async fn auto_resume(&self, id: &str) -> Result<()> {
        if self.get(id).is_some_and(|r| r.paused_filesystem) {
            return Err(LifecycleError::Paused(id.into()));
        }
        let (_, resumed) = self.connect(&Caller::Server, id, None).await?;
        if resumed {
            self.report(Transition::AutoResumed(id.into()));
        }
        Ok(())
    }
}
