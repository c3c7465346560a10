//! Sandbox lifecycle on top of the runtime: records, timeouts, pause/resume, list filters.
//!
//! Invariant: a record is visible only in `running` or `paused`; create, pause and resume
//! hold the sandbox's operation lock until the runtime call finished.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::StatusCode;

use crate::backend::{VmBackend, VmRunState};
use crate::error::ApiError;
use crate::keys;
use crate::metrics::Metrics;
use crate::model::{NewSandbox, SandboxState};
use crate::store::{RECORD_VERSION, SandboxRecord, SandboxStore};

/// Default sandbox lifetime in seconds (spec §4.4).
pub const DEFAULT_TIMEOUT_S: u64 = 300;
/// Longest accepted timeout (one day).
pub const MAX_TIMEOUT_S: u64 = 86_400;
/// envd protocol version the guest agent implements (spec §6.7).
pub const ENVD_VERSION: &str = "0.5.7";
const IDEMPOTENCY_WINDOW: Duration = Duration::from_secs(300);

/// Current Unix time in milliseconds.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// RFC 3339 UTC with milliseconds.
pub fn rfc3339_ms(ms: i64) -> String {
    let t = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    t.format(time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z"
    ))
    .unwrap_or_default()
}

/// Parses an RFC 3339 time into Unix milliseconds.
pub fn parse_rfc3339_ms(s: &str) -> Option<i64> {
    let t = time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).ok()?;
    Some((t.unix_timestamp_nanos() / 1_000_000) as i64)
}

/// Filters of `GET /v2/sandboxes`.
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    pub states: Option<Vec<SandboxState>>,
    pub metadata: BTreeMap<String, String>,
    pub started_after_ms: Option<i64>,
    pub template: Option<String>,
    pub descending: bool,
}

/// All sandboxes of this server.
pub struct Sandboxes {
    backend: Arc<dyn VmBackend>,
    store: SandboxStore,
    metrics: Arc<Metrics>,
    records: Mutex<HashMap<String, SandboxRecord>>,
    op_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    idempotency: Mutex<HashMap<String, (Instant, String)>>,
}

impl Sandboxes {
    /// Loads the stored records and reconciles them with the runtime after a restart:
    /// paused ones stay paused, running ones are re-attached, vanished ones are dropped.
    pub async fn open(
        backend: Arc<dyn VmBackend>,
        store: SandboxStore,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<Arc<Self>> {
        let stored = store.load_all()?;
        let recovered: HashMap<String, VmRunState> = backend.recover().await?.into_iter().collect();
        let mut records = HashMap::new();
        for mut rec in stored {
            match recovered.get(&rec.sandbox_id) {
                Some(state) => {
                    rec.state = match state {
                        VmRunState::Running => SandboxState::Running,
                        VmRunState::Paused => SandboxState::Paused,
                    };
                    store.save(&rec)?;
                    tracing::info!(sandbox = %rec.sandbox_id, state = rec.state.as_str(), "recovered sandbox");
                    records.insert(rec.sandbox_id.clone(), rec);
                }
                None => {
                    tracing::warn!(sandbox = %rec.sandbox_id, "sandbox VM did not survive the restart; dropping it");
                    store.remove(&rec.sandbox_id)?;
                }
            }
        }
        for (id, _) in recovered
            .iter()
            .filter(|(id, _)| !records.contains_key(*id))
        {
            tracing::warn!(sandbox = %id, "runtime VM without a server record; killing it");
            if let Err(e) = backend.kill(id).await {
                tracing::warn!(sandbox = %id, error = %e, "kill of orphan VM failed");
            }
        }
        Ok(Arc::new(Sandboxes {
            backend,
            store,
            metrics,
            records: Mutex::new(records),
            op_locks: Mutex::new(HashMap::new()),
            idempotency: Mutex::new(HashMap::new()),
        }))
    }

    pub fn backend(&self) -> &Arc<dyn VmBackend> {
        &self.backend
    }

    fn op_lock(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.op_locks
            .lock()
            .expect("op lock map")
            .entry(id.to_string())
            .or_default()
            .clone()
    }

    /// A copy of one record.
    pub fn get(&self, id: &str) -> Option<SandboxRecord> {
        self.records.lock().expect("records").get(id).cloned()
    }

    /// The sandbox whose envd access token is `token`.
    pub fn by_token(&self, token: &str) -> Option<SandboxRecord> {
        self.records
            .lock()
            .expect("records")
            .values()
            .find(|r| keys::secret_eq(&r.access_token, token))
            .cloned()
    }

    /// Counts per state, for `/metrics`.
    pub fn count_by_state(&self) -> (usize, usize) {
        let recs = self.records.lock().expect("records");
        let running = recs
            .values()
            .filter(|r| r.state == SandboxState::Running)
            .count();
        (running, recs.len() - running)
    }

    fn put(&self, rec: SandboxRecord) -> Result<(), ApiError> {
        self.store.save(&rec).map_err(internal)?;
        self.records
            .lock()
            .expect("records")
            .insert(rec.sandbox_id.clone(), rec);
        Ok(())
    }

    fn drop_record(&self, id: &str) -> Result<(), ApiError> {
        self.records.lock().expect("records").remove(id);
        self.op_locks.lock().expect("op lock map").remove(id);
        self.store.remove(id).map_err(internal)
    }

    /// Creates a sandbox; returns only once envd in it answers.
    pub async fn create(
        &self,
        req: NewSandbox,
        idempotency_key: Option<String>,
    ) -> Result<SandboxRecord, ApiError> {
        if let Some(key) = &idempotency_key {
            let mut map = self.idempotency.lock().expect("idempotency");
            map.retain(|_, (t, _)| t.elapsed() < IDEMPOTENCY_WINDOW);
            if let Some(rec) = map.get(key).and_then(|(_, id)| self.get(id)) {
                return Ok(rec);
            }
        }
        let timeout = checked_timeout(req.timeout)?;
        let tpl = self
            .backend
            .templates()
            .into_iter()
            .find(|t| t.id == req.template_id || t.aliases.contains(&req.template_id))
            .ok_or_else(|| {
                ApiError::not_found(format!("template '{}' not found", req.template_id))
            })?;
        let id = keys::generate_sandbox_id();
        let env_vars = req.env_vars.unwrap_or_default();
        let lock = self.op_lock(&id);
        let _guard = lock.lock().await;
        let t0 = Instant::now();
        self.backend.create(&id, &tpl.id, env_vars.clone()).await?;
        self.metrics.observe_op("create", t0.elapsed());
        let now = now_ms();
        let auto_resume = req.auto_resume.as_ref().is_some_and(|v| {
            v.get("enabled")
                .and_then(|e| e.as_bool())
                .unwrap_or(v.as_bool() == Some(true))
        });
        let rec = SandboxRecord {
            version: RECORD_VERSION,
            sandbox_id: id.clone(),
            template_id: tpl.id.clone(),
            alias: tpl.aliases.first().cloned().or(Some(tpl.id.clone())),
            metadata: req.metadata.unwrap_or_default(),
            env_vars,
            started_at_ms: now,
            end_at_ms: now + (timeout * 1000) as i64,
            state: SandboxState::Running,
            auto_pause: req.auto_pause.unwrap_or(false),
            auto_resume,
            access_token: keys::generate_access_token(),
            cpu_count: tpl.vcpus,
            memory_mb: tpl.memory_mib,
            disk_mb: tpl.disk_mib,
            envd_version: ENVD_VERSION.to_string(),
        };
        if let Err(e) = self.put(rec.clone()) {
            let _ = self.backend.kill(&id).await;
            return Err(e);
        }
        if let Some(key) = idempotency_key {
            self.idempotency
                .lock()
                .expect("idempotency")
                .insert(key, (Instant::now(), id.clone()));
        }
        tracing::info!(sandbox = %id, template = %tpl.id, "created sandbox");
        Ok(rec)
    }

    /// Sandboxes matching `f`, ordered by start time.
    pub fn list(&self, f: &ListFilter) -> Vec<SandboxRecord> {
        let mut out: Vec<SandboxRecord> = self
            .records
            .lock()
            .expect("records")
            .values()
            .filter(|r| f.states.as_ref().is_none_or(|s| s.contains(&r.state)))
            .filter(|r| f.metadata.iter().all(|(k, v)| r.metadata.get(k) == Some(v)))
            .filter(|r| f.started_after_ms.is_none_or(|t| r.started_at_ms > t))
            .filter(|r| {
                f.template
                    .as_ref()
                    .is_none_or(|t| r.template_id == *t || r.alias.as_ref() == Some(t))
            })
            .cloned()
            .collect();
        out.sort_by(|a, b| {
            a.started_at_ms
                .cmp(&b.started_at_ms)
                .then(a.sandbox_id.cmp(&b.sandbox_id))
        });
        if f.descending {
            out.reverse();
        }
        out
    }

    /// Kills a running or paused sandbox.
    pub async fn kill(&self, id: &str) -> Result<(), ApiError> {
        let lock = self.op_lock(id);
        let _guard = lock.lock().await;
        if self.get(id).is_none() {
            return Err(ApiError::sandbox_not_found(id));
        }
        let t0 = Instant::now();
        if let Err(e) = self.backend.kill(id).await {
            if self.backend.vm_state(id).is_some() {
                return Err(e.into());
            }
            tracing::warn!(sandbox = %id, error = %e, "kill reported an error but the VM is gone");
        }
        self.metrics.observe_op("kill", t0.elapsed());
        self.drop_record(id)?;
        tracing::info!(sandbox = %id, "killed sandbox");
        Ok(())
    }

    /// Sets `endAt = now + timeout` (may shorten). Paused sandboxes answer 409.
    pub async fn set_timeout(&self, id: &str, timeout_s: u64) -> Result<(), ApiError> {
        let timeout = checked_timeout(Some(timeout_s))?;
        let lock = self.op_lock(id);
        let _guard = lock.lock().await;
        let mut rec = self
            .get(id)
            .ok_or_else(|| ApiError::sandbox_not_found(id))?;
        if rec.state == SandboxState::Paused {
            return Err(ApiError::conflict(format!("sandbox {id} is paused")));
        }
        rec.end_at_ms = now_ms() + (timeout * 1000) as i64;
        self.put(rec)
    }

    /// Pauses a running sandbox (memory and processes kept). 409 when already paused.
    pub async fn pause(&self, id: &str) -> Result<(), ApiError> {
        let lock = self.op_lock(id);
        let _guard = lock.lock().await;
        let mut rec = self
            .get(id)
            .ok_or_else(|| ApiError::sandbox_not_found(id))?;
        if rec.state == SandboxState::Paused {
            return Err(ApiError::conflict(format!(
                "sandbox {id} is already paused"
            )));
        }
        let t0 = Instant::now();
        self.backend.pause(id).await?;
        self.metrics.observe_op("pause", t0.elapsed());
        rec.state = SandboxState::Paused;
        self.put(rec)?;
        tracing::info!(sandbox = %id, "paused sandbox");
        Ok(())
    }

    /// Connect: running → extend `endAt` (200); paused → resume (201).
    /// Returns the record and whether it was resumed.
    pub async fn connect(
        &self,
        id: &str,
        timeout_s: Option<u64>,
    ) -> Result<(SandboxRecord, bool), ApiError> {
        let timeout = checked_timeout(timeout_s)?;
        let lock = self.op_lock(id);
        let _guard = lock.lock().await;
        let mut rec = self
            .get(id)
            .ok_or_else(|| ApiError::sandbox_not_found(id))?;
        let until = now_ms() + (timeout * 1000) as i64;
        let resumed = rec.state == SandboxState::Paused;
        if resumed {
            let t0 = Instant::now();
            self.backend.resume(id).await?;
            self.metrics.observe_op("resume", t0.elapsed());
            rec.state = SandboxState::Running;
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
        id: &str,
        timeout_s: Option<u64>,
        auto_pause: Option<bool>,
    ) -> Result<SandboxRecord, ApiError> {
        {
            let rec = self
                .get(id)
                .ok_or_else(|| ApiError::sandbox_not_found(id))?;
            if rec.state == SandboxState::Running {
                return Err(ApiError::conflict(format!(
                    "sandbox {id} is already running"
                )));
            }
        }
        let (mut rec, _) = self.connect(id, timeout_s).await?;
        if let Some(ap) = auto_pause {
            rec.auto_pause = ap;
            self.put(rec.clone())?;
        }
        Ok(rec)
    }

    /// Resumes a paused sandbox on data-plane traffic when it asked for `autoResume`.
    pub async fn auto_resume(&self, id: &str) -> Result<(), ApiError> {
        self.connect(id, None).await.map(|_| ())
    }

    /// Kills or pauses every sandbox whose `endAt` passed. Called periodically.
    pub async fn expire_due(&self) {
        let now = now_ms();
        let due: Vec<SandboxRecord> = self
            .records
            .lock()
            .expect("records")
            .values()
            .filter(|r| r.state == SandboxState::Running && r.end_at_ms <= now)
            .cloned()
            .collect();
        for rec in due {
            let id = rec.sandbox_id;
            let res = if rec.auto_pause {
                self.pause(&id).await
            } else {
                self.kill(&id).await
            };
            match res {
                Ok(()) => {
                    tracing::info!(sandbox = %id, auto_pause = rec.auto_pause, "sandbox timed out")
                }
                Err(e) if e.status == StatusCode::NOT_FOUND || e.status == StatusCode::CONFLICT => {
                }
                Err(e) => tracing::error!(sandbox = %id, error = %e, "timing out sandbox failed"),
            }
        }
    }

    /// Runs [`Self::expire_due`] every 500 ms until the process ends.
    pub fn spawn_reaper(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let this = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            loop {
                tick.tick().await;
                let Some(s) = this.upgrade() else { return };
                s.expire_due().await;
            }
        })
    }
}

fn checked_timeout(t: Option<u64>) -> Result<u64, ApiError> {
    let t = t.unwrap_or(DEFAULT_TIMEOUT_S);
    if t > MAX_TIMEOUT_S {
        return Err(ApiError::bad_request(format!(
            "timeout {t} s exceeds the maximum of {MAX_TIMEOUT_S} s"
        )));
    }
    Ok(t)
}

fn internal(e: impl std::fmt::Display) -> ApiError {
    tracing::error!(error = %e, "state store failure");
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        format!("state store failure: {e}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_round_trip_on_random_times() {
        use rand::Rng;
        let mut rng = rand::rng();
        for _ in 0..100 {
            let ms: i64 = rng.random_range(0..4_000_000_000_000);
            let s = rfc3339_ms(ms);
            assert!(s.ends_with('Z') && s.len() == 24, "{s}");
            assert_eq!(parse_rfc3339_ms(&s), Some(ms));
        }
        assert_eq!(parse_rfc3339_ms("yesterday"), None);
    }

    #[test]
    fn timeouts_default_and_bound() {
        assert_eq!(checked_timeout(None).unwrap(), DEFAULT_TIMEOUT_S);
        assert_eq!(checked_timeout(Some(0)).unwrap(), 0);
        assert_eq!(
            checked_timeout(Some(MAX_TIMEOUT_S + 1)).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
    }
}
