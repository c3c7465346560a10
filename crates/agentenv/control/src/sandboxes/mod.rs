//! Sandbox lifecycle on top of the runtime: records, timeouts, pause/resume, list filters.
//!
//! Invariant: a record is visible only in `running` or `paused`; create, pause and resume
//! hold the sandbox's operation lock until the runtime call finished, and every runtime call has a
//! deadline ([`Deadlines`]): a VM that misses one is killed and its sandbox is gone, with the reason logged.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::backend::{CreateSpec, VmBackend, VmError, VmState};
use crate::keys;
use crate::store::{RECORD_VERSION, SandboxRecord, SandboxStore};

/// Default sandbox lifetime in seconds (`docs/specs/e2b-compat.md §4.4`).
pub const DEFAULT_TIMEOUT_S: u64 = 300;
/// Longest accepted timeout (one day).
pub const MAX_TIMEOUT_S: u64 = 86_400;
/// envd protocol version the guest agent implements.
pub const ENVD_VERSION: &str = agentenv_envd::ENVD_VERSION;
const IDEMPOTENCY_WINDOW: Duration = Duration::from_secs(300);
/// Forks per call (E2B's bound).
pub const MAX_FORKS: u32 = 20;

mod build_files;
mod build_log;
mod build_script;
mod build_view;
mod builds;
mod builtin;
mod cluster;
mod config;
mod error;
mod expiry;
mod fork;
mod mounts;
mod network;
mod open;
mod owners;
mod pause;
mod quota;
mod requests;
mod snapshots;
mod tags;

pub use builds::{
    BUILD_MARK, BuildFailure, BuildPlan, BuildSize, BuildStatus, BuildView, BuiltTemplate,
    LogEntry, LogLevel, MAX_BUILD_FILE_BYTES, Step,
};
pub use cluster::{HANDOFF_TENANT, HandoffRecord, NodeLoad, Transition};
pub use config::{DEFAULT_PAUSED_RETENTION, Deadlines, LifecycleConfig, Quota};
use quota::Usage;

pub use crate::store::SandboxState;
pub use error::{LifecycleError, VmCase};
use owners::Owners;
pub use requests::{CreateRequest, OpObserver, OpenError};
pub use snapshots::TemplateBuildError;
pub use tags::build_uuid;

use crate::tenants::{DEFAULT_TENANT, KeyRing};

/// Whose request an operation serves: a tenant, which sees and holds only its own sandboxes, snapshots
/// and templates (others' are "not found"), or the server itself (expiry, data-plane auto-resume).
#[derive(Debug, Clone)]
pub enum Caller {
    Tenant(Arc<str>),
    Server,
}

impl Caller {
    /// The tenant that owns what this caller makes.
    /// The tenant that owns what this caller makes.
    pub fn owner(&self) -> &str {
        match self {
            Caller::Tenant(t) => t,
            Caller::Server => DEFAULT_TENANT,
        }
    }

    /// Whether this caller may rebuild shared templates: the server and the operator's own key.
    fn may_write_shared(&self) -> bool {
        match self {
            Caller::Tenant(t) => &**t == DEFAULT_TENANT,
            Caller::Server => true,
        }
    }

    fn sees(&self, owner: &str) -> bool {
        match self {
            Caller::Tenant(t) => &**t == owner,
            Caller::Server => true,
        }
    }
}

type Result<T, E = LifecycleError> = std::result::Result<T, E>;

// Wall-clock time in Unix milliseconds and its RFC 3339 form (millisecond precision, `Z`).
pub use k3_common::time::{
    now_unix_ms as now_ms, parse_rfc3339_ms, rfc3339_from_unix_ms as rfc3339_ms,
};

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
    metrics: Arc<dyn OpObserver>,
    cfg: LifecycleConfig,
    records: Mutex<HashMap<String, SandboxRecord>>,
    op_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    idempotency: Mutex<HashMap<String, (Instant, String)>>,
    /// Sandboxes the reaper is expiring now (each in its own task).
    expiring: Mutex<HashSet<String>>,
    /// Running sandboxes and memory (MiB) that operations in flight will add, in all and per tenant.
    reserved: Arc<Mutex<quota::Reserved>>,
    owners: Owners,
    /// Each tenant's own quota.
    ring: Arc<KeyRing>,
    /// Template builds (`Template.build`).
    builds: builds::Builds,
    /// Volumes, for mounts.
    volumes: Arc<crate::volumes::Volumes>,
    /// Live volume channels.
    channels: mounts::Channels,
    /// Where the server's own pauses and resumes are reported (`cluster::Transition`).
    transitions: Mutex<Option<tokio::sync::mpsc::UnboundedSender<Transition>>>,
}

impl Sandboxes {
    /// Runs one runtime call under its deadline, times it (`op` in the metrics) and passes the
    /// crash point `server:<op>:after-vm` once it succeeded. A miss kills the VM (under the kill
    /// deadline) and drops the sandbox's record: the sandbox ends gone, never half-running.
    async fn within<T, E: Into<LifecycleError>>(
        &self,
        op: &'static str,
        id: &str,
        limit: Duration,
        call: impl Future<Output = std::result::Result<T, E>>,
    ) -> Result<T> {
        let t0 = Instant::now();
        match tokio::time::timeout(limit, call).await {
            Ok(r) => {
                let v = match r {
                    Ok(v) => v,
                    Err(e) => {
                        self.forget_if_dead(id).await;
                        return Err(e.into());
                    }
                };
                k3_common::crash::point(&format!("server:{op}:after-vm"));
                self.metrics.observe_op(op, t0.elapsed());
                Ok(v)
            }
            Err(_) => {
                tracing::error!(sandbox = %id, op, deadline_s = limit.as_secs_f64(), "runtime call missed its deadline; killing the VM");
                self.kill_wedged(id).await;
                Err(LifecycleError::DeadlineExceeded {
                    op,
                    id: id.into(),
                    secs: limit.as_secs_f64(),
                })
            }
        }
    }

    /// After a failed runtime call: when the sandbox's VM is gone (it died during the call, or before),
    /// removes what is left of it and forgets the sandbox, so it is never listed running without a VM.
    async fn forget_if_dead(&self, id: &str) {
        let running = self
            .get(id)
            .is_some_and(|r| r.state == SandboxState::Running);
        if !running || self.backend.vm_state(id).is_some() {
            return;
        }
        tracing::error!(sandbox = %id, "the sandbox's VM exited on its own; the sandbox is gone");
        if let Ok(Err(e)) =
            tokio::time::timeout(self.cfg.deadlines.kill, self.backend.kill(id)).await
            && !matches!(e, VmError::SandboxNotFound(_))
        {
            tracing::warn!(sandbox = %id, error = %e, "cleaning up after a dead VM failed");
        }
        if let Err(e) = self.drop_record(id) {
            tracing::error!(sandbox = %id, error = %e, "dropping the record of a dead VM failed");
        }
    }

    /// Kills a VM that missed a deadline and forgets its sandbox.
    async fn kill_wedged(&self, id: &str) {
        match tokio::time::timeout(self.cfg.deadlines.kill, self.backend.kill(id)).await {
            Ok(Ok(())) | Ok(Err(VmError::SandboxNotFound(_))) => {}
            Ok(Err(e)) => tracing::error!(sandbox = %id, error = %e, "kill of a wedged VM failed"),
            Err(_) => tracing::error!(sandbox = %id, "kill of a wedged VM missed its deadline too"),
        }
        if self.get(id).is_some()
            && let Err(e) = self.drop_record(id)
        {
            tracing::error!(sandbox = %id, error = %e, "dropping the record of a wedged VM failed");
        }
    }

    pub fn backend(&self) -> &Arc<dyn VmBackend> {
        &self.backend
    }

    /// The volumes sandboxes mount (E2B's `/volumes`).
    pub fn volumes(&self) -> &Arc<crate::volumes::Volumes> {
        &self.volumes
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

    /// The record of `id` if `caller` may see it; "not found" otherwise, whether it exists or not.
    pub fn get_as(&self, caller: &Caller, id: &str) -> Result<SandboxRecord> {
        self.get(id)
            .filter(|r| caller.sees(&r.owner))
            .ok_or_else(|| LifecycleError::SandboxNotFound(id.into()))
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

    /// The first record `pick` accepts (the data plane's signed URLs name no sandbox).
    pub fn find(&self, pick: impl Fn(&SandboxRecord) -> bool) -> Option<SandboxRecord> {
        self.records
            .lock()
            .expect("records")
            .values()
            .find(|r| pick(r))
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

    fn put(&self, rec: SandboxRecord) -> Result<()> {
        self.store.save(&rec).map_err(internal)?;
        self.records
            .lock()
            .expect("records")
            .insert(rec.sandbox_id.clone(), rec);
        Ok(())
    }

    fn drop_record(&self, id: &str) -> Result<()> {
        self.records.lock().expect("records").remove(id);
        self.op_locks.lock().expect("op lock map").remove(id);
        self.store.remove(id).map_err(internal)
    }

    /// Creates a sandbox from a template or a snapshot; returns only once envd in it answers.
    pub async fn create(
        &self,
        caller: &Caller,
        req: CreateRequest,
        idempotency_key: Option<String>,
    ) -> Result<SandboxRecord> {
        if req.template.is_empty() {
            return Err(LifecycleError::Invalid("templateID is required".into()));
        }
        let owner = caller.owner().to_string();
        // Keys are per tenant: one tenant's key never returns another's sandbox.
        let idempotency_key = idempotency_key.map(|k| format!("{owner}/{k}"));
        if let Some(key) = &idempotency_key {
            let mut map = self.idempotency.lock().expect("idempotency");
            map.retain(|_, (t, _)| t.elapsed() < IDEMPOTENCY_WINDOW);
            if let Some(rec) = map.get(key).and_then(|(_, id)| self.get(id)) {
                return Ok(rec);
            }
        }
        let timeout = checked_timeout(req.timeout_s)?;
        if req.auto_pause_filesystem && req.auto_resume {
            // Traffic cannot wake a sandbox that has to boot: it is resumed by connect.
            return Err(LifecycleError::Invalid(
                "autoResume needs autoPauseMemory: a sandbox paused without memory cold-boots, so only connect resumes it".into(),
            ));
        }
        // Without networking here, only an explicit ask for the internet is refused (400).
        let network =
            (req.network_asked || self.backend.networking_off().is_none()).then_some(req.network);
        let source = self.resolve_source(caller, &req.template).await?;
        let _quota = self.reserve(
            &owner,
            Usage {
                running: 1,
                paused: 0,
                memory_mb: u64::from(source.memory_mb),
                ..Usage::default()
            },
        )?;
        let mounts = self.resolve_mounts(&owner, &req.volume_mounts, &source.mounts)?;
        let id = keys::generate_sandbox_id();
        let env_vars = req.env_vars;
        let lock = self.op_lock(&id);
        let _guard = lock.lock().await;
        let spec = CreateSpec {
            sandbox_id: id.clone(),
            template_id: source.id.clone(),
            env_vars: env_vars.clone(),
            network,
        };
        self.within(
            "create",
            &id,
            self.cfg.deadlines.create,
            self.backend.create(spec),
        )
        .await?;
        let now = now_ms();
        let rec = SandboxRecord {
            version: RECORD_VERSION,
            sandbox_id: id.clone(),
            template_id: source.id.clone(),
            alias: source.alias.clone(),
            metadata: req.metadata,
            env_vars,
            started_at_ms: now,
            end_at_ms: now + (timeout * 1000) as i64,
            state: SandboxState::Running,
            auto_pause: req.auto_pause,
            auto_resume: req.auto_resume,
            access_token: keys::generate_access_token(),
            cpu_count: source.vcpus,
            memory_mb: source.memory_mb,
            disk_mb: source.disk_mb,
            envd_version: ENVD_VERSION.to_string(),
            paused_at_ms: None,
            owner,
            auto_pause_memory: !req.auto_pause_filesystem,
            paused_filesystem: false,
            public_traffic: req.public_traffic,
            mask_request_host: req.mask_request_host,
            volume_mounts: mounts.clone(),
        };
        if let Err(e) = self.put(rec.clone()) {
            let _ = self.backend.kill(&id).await;
            return Err(e);
        }
        if let Err(e) = self.attach_mounts(&id, &mounts).await {
            let _ = self.backend.kill(&id).await;
            let _ = self.drop_record(&id);
            return Err(e);
        }
        if let Some(key) = idempotency_key {
            self.idempotency
                .lock()
                .expect("idempotency")
                .insert(key, (Instant::now(), id.clone()));
        }
        tracing::info!(sandbox = %id, source = %source.id, "created sandbox");
        Ok(rec)
    }

    /// A template (id or alias) or a live snapshot (id or `name[:tag]`) that `caller` may use; a snapshot
    /// stored by another machine in a shared chunk store is imported first.
    async fn resolve_source(&self, caller: &Caller, name: &str) -> Result<Source> {
        if let Some(t) = self
            .templates(caller)
            .into_iter()
            .find(|t| t.id == name || t.aliases.iter().any(|a| a == name))
        {
            return Ok(Source {
                id: t.id.clone(),
                alias: t.aliases.first().cloned().or(Some(t.id.clone())),
                vcpus: t.vcpus,
                memory_mb: u32::try_from(t.memory_mib).unwrap_or(u32::MAX),
                disk_mb: u32::try_from(t.disk_mib).unwrap_or(u32::MAX),
                mounts: vec![],
            });
        }
        let snap = match self.find_snapshot(caller, name) {
            Some(s) => s,
            None => self
                .import_snapshot(caller, name)
                .await?
                .ok_or_else(|| LifecycleError::TemplateNotFound(name.into()))?,
        };
        let disk_mb = self
            .backend
            .templates()
            .iter()
            .find(|t| t.id == snap.template_id)
            .map_or(0, |t| u32::try_from(t.disk_mib).unwrap_or(u32::MAX));
        Ok(Source {
            id: snap.id.clone(),
            alias: snap.names.first().cloned(),
            vcpus: snap.vcpus,
            memory_mb: u32::try_from(snap.memory_mib).unwrap_or(u32::MAX),
            disk_mb,
            mounts: self.owners.snapshot_mounts(&snap.id),
        })
    }

    /// Sandboxes matching `f`, ordered by start time.
    pub fn list(&self, caller: &Caller, f: &ListFilter) -> Vec<SandboxRecord> {
        let mut out: Vec<SandboxRecord> = self
            .records
            .lock()
            .expect("records")
            .values()
            .filter(|r| caller.sees(&r.owner))
            .filter(|r| f.states.as_ref().is_none_or(|s| s.contains(&r.state)))
            .filter(|r| f.metadata.iter().all(|(k, v)| r.metadata.get(k) == Some(v)))
            .filter(|r| f.started_after_ms.is_none_or(|t| r.started_at_ms >= t))
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
    pub async fn kill(&self, caller: &Caller, id: &str) -> Result<()> {
        self.get_as(caller, id)?;
        let lock = self.op_lock(id);
        let _guard = lock.lock().await;
        self.get_as(caller, id)?;
        let t0 = Instant::now();
        let limit = self.cfg.deadlines.kill;
        match tokio::time::timeout(limit, self.backend.kill(id)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                if self.backend.vm_state(id).is_some() {
                    return Err(e.into());
                }
                tracing::warn!(sandbox = %id, error = %e, "kill reported an error but the VM is gone");
            }
            // The record stays: the reaper or the next DELETE tries again.
            Err(_) => {
                tracing::error!(sandbox = %id, "kill missed its deadline");
                return Err(LifecycleError::DeadlineExceeded {
                    op: "kill",
                    id: id.into(),
                    secs: limit.as_secs_f64(),
                });
            }
        }
        k3_common::crash::point("server:kill:after-vm");
        self.metrics.observe_op("kill", t0.elapsed());
        self.drop_record(id)?;
        tracing::info!(sandbox = %id, "killed sandbox");
        Ok(())
    }

    /// Sets `endAt = now + timeout` (may shorten). Paused sandboxes answer 409.
    pub async fn set_timeout(&self, caller: &Caller, id: &str, timeout_s: u64) -> Result<()> {
        let timeout = checked_timeout(Some(timeout_s))?;
        self.get_as(caller, id)?;
        let lock = self.op_lock(id);
        let _guard = lock.lock().await;
        let mut rec = self.get_as(caller, id)?;
        if rec.state == SandboxState::Paused {
            return Err(LifecycleError::Paused(id.into()));
        }
        rec.end_at_ms = now_ms() + (timeout * 1000) as i64;
        self.put(rec)
    }
}

fn checked_timeout(t: Option<u64>) -> Result<u64> {
    let t = t.unwrap_or(DEFAULT_TIMEOUT_S);
    if t > MAX_TIMEOUT_S {
        return Err(LifecycleError::Invalid(format!(
            "timeout {t} s exceeds the maximum of {MAX_TIMEOUT_S} s"
        )));
    }
    Ok(t)
}

fn internal(e: impl std::error::Error + Send + Sync + 'static) -> LifecycleError {
    tracing::error!(error = %e, "state store failure");
    LifecycleError::Store(Arc::new(e))
}

/// What a create starts from, as the records need it.
struct Source {
    id: String,
    alias: Option<String>,
    vcpus: u32,
    memory_mb: u32,
    disk_mb: u32,
    /// The mounts a snapshot's guest holds.
    mounts: Vec<crate::store::VolumeMount>,
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
        assert!(matches!(
            checked_timeout(Some(MAX_TIMEOUT_S + 1)).unwrap_err(),
            LifecycleError::Invalid(_)
        ));
    }
}
