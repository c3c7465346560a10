//! The node's side of a cluster (`agentenv serve --join`): its load for the node record, and moving a
//! paused sandbox to another node through the shared bucket (handoff here, adopt there).
//!
//! Invariant: a handoff answers only once the snapshot's chunks are durable in the store (with a
//! bucket: in the bucket), so a node that dies right after still leaves a sandbox another can take over.
//! Handoff snapshots belong to [`HANDOFF_TENANT`], which no key can be, so no tenant lists them.

use serde::{Deserialize, Serialize};

use super::quota::Usage;
use super::{Caller, LifecycleError, Result, Sandboxes, internal, now_ms};
use crate::backend::{CreateSpec, EgressPolicy, SnapshotMode};
use crate::keys;
use crate::sandboxes::SandboxState;
use crate::store::SandboxRecord;

/// Owner of handoff snapshots (not a valid tenant name, so no key is it).
pub const HANDOFF_TENANT: &str = "_cluster";

/// Running and paused sandboxes here, with creates and resumes in flight.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeLoad {
    pub running: u32,
    pub paused: u32,
    pub vcpus: u32,
    pub memory_mb: u64,
}

/// A change the server made on its own (no client call through a gateway asked for it), reported so
/// a joined node can keep its cluster entries true.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transition {
    /// Paused at its timeout (`autoPause`).
    AutoPaused(String),
    /// Resumed by data-plane traffic (`autoResume`).
    AutoResumed(String),
    /// Killed at its timeout or after the paused retention.
    Expired { id: String, access_token: String },
}

/// What another node needs to continue a paused sandbox: its record (id, owner, access token, metadata,
/// ...) and its egress policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HandoffRecord {
    pub sandbox: SandboxRecord,
    pub network: Option<EgressPolicy>,
}

impl Sandboxes {
    /// This node's load, for its cluster record.
    pub fn load(&self) -> NodeLoad {
        let mut load = NodeLoad::default();
        for r in self.records.lock().expect("records").values() {
            match r.state {
                SandboxState::Running => {
                    load.running += 1;
                    load.vcpus += r.cpu_count;
                    load.memory_mb += u64::from(r.memory_mb);
                }
                SandboxState::Paused => load.paused += 1,
            }
        }
        let more = self.in_flight();
        load.running += u32::try_from(more.running).unwrap_or(u32::MAX);
        load.memory_mb += more.memory_mb;
        load
    }

    /// Starts reporting [`Transition`]s to the returned receiver (replacing an earlier one).
    pub fn transitions(&self) -> tokio::sync::mpsc::UnboundedReceiver<Transition> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        *self.transitions.lock().expect("transitions") = Some(tx);
        rx
    }

    pub(super) fn report(&self, t: Transition) {
        if let Some(tx) = &*self.transitions.lock().expect("transitions") {
            let _ = tx.send(t);
        }
    }

    /// Whether an operation (pause, resume, snapshot, handoff, ...) on `id` is in flight now.
    pub fn busy(&self, id: &str) -> bool {
        self.op_lock(id).try_lock().is_err()
    }

    /// Runs `step` with `id`'s record while its operation lock is held and it is in `state`, so no
    /// pause or resume comes between the check and what `step` does; `None` if it is not.
    pub async fn while_in<T>(
        &self,
        id: &str,
        state: SandboxState,
        step: impl AsyncFnOnce(&crate::store::SandboxRecord) -> T,
    ) -> Option<T> {
        let lock = self.op_lock(id);
        let _guard = lock.lock().await;
        let rec = self.get(id).filter(|r| r.state == state)?;
        Some(step(&rec).await)
    }

    /// Snapshots paused sandbox `id` (memory and disk) for another node and returns the snapshot id
    /// with the sandbox's record, once the snapshot is durable in the chunk store.
    pub async fn handoff(&self, caller: &Caller, id: &str) -> Result<(String, HandoffRecord)> {
        self.handoff_then(caller, id, async |_, _| ())
            .await
            .map(|(s, h, ())| (s, h))
    }

    /// [`Self::handoff`], then `then` on its result before the sandbox's lock is released (so no
    /// resume comes between the handoff and what `then` records).
    pub async fn handoff_then<T>(
        &self,
        caller: &Caller,
        id: &str,
        then: impl AsyncFnOnce(&str, &HandoffRecord) -> T,
    ) -> Result<(String, HandoffRecord, T)> {
        self.get_as(caller, id)?;
        let lock = self.op_lock(id);
        let _guard = lock.lock().await;
        let rec = self.get_as(caller, id)?;
        if rec.state != SandboxState::Paused {
            return Err(LifecycleError::AlreadyRunning(id.into()));
        }
        let sid = keys::generate_snapshot_id();
        self.owners
            .set_snapshot(&sid, HANDOFF_TENANT)
            .map_err(internal)?;
        // One paused without memory has only its disk to hand off.
        let mode = match rec.paused_filesystem {
            true => SnapshotMode::Filesystem,
            false => SnapshotMode::Full,
        };
        self.within(
            "snapshot",
            id,
            self.cfg.deadlines.snapshot,
            self.backend.snapshot(id, &sid, &[], mode),
        )
        .await?;
        let network = self.backend.network(id).await.map(|n| n.policy);
        if let Err(e) = self.wait_stored(id, &sid).await {
            // Nothing refers to it: it goes.
            let _ = self.drop_handoff(&sid);
            return Err(e);
        }
        tracing::info!(sandbox = %id, snapshot = %sid, "paused sandbox handed off to the shared store");
        let handoff = HandoffRecord {
            sandbox: rec,
            network,
        };
        let done = then(&sid, &handoff).await;
        Ok((sid, handoff, done))
    }

    /// Waits until snapshot `sid` (of sandbox `id`) is in the chunk store: an error once its ingest gave
    /// up, or past the snapshot deadline.
    async fn wait_stored(&self, id: &str, sid: &str) -> Result<()> {
        let deadline = std::time::Instant::now() + self.cfg.deadlines.snapshot;
        loop {
            let info = self.backend.snapshots().into_iter().find(|s| s.id == sid);
            match info {
                Some(s) if s.stored.is_some() => return Ok(()),
                None => return Err(LifecycleError::SnapshotNotFound(sid.into())),
                Some(crate::backend::SnapshotInfo {
                    store_failed: Some(why),
                    ..
                }) => {
                    return Err(internal(std::io::Error::other(format!(
                        "storing snapshot {sid} failed: {why}"
                    ))));
                }
                Some(_) if std::time::Instant::now() > deadline => {
                    return Err(LifecycleError::DeadlineExceeded {
                        op: "snapshot store",
                        id: id.into(),
                        secs: self.cfg.deadlines.snapshot.as_secs_f64(),
                    });
                }
                Some(_) => tokio::time::sleep(std::time::Duration::from_millis(100)).await,
            }
        }
    }

    /// Continues a sandbox another node handed off: the same id, owner, access token and metadata,
    /// restored from `snapshot_id` (imported from the shared bucket), running. A sandbox already here
    /// (a retried takeover) is returned as it is.
    pub async fn adopt(&self, handoff: HandoffRecord, snapshot_id: &str) -> Result<SandboxRecord> {
        let mut rec = handoff.sandbox;
        let id = rec.sandbox_id.clone();
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
            return Err(LifecycleError::Invalid(format!(
                "invalid sandbox id {id:?}"
            )));
        }
        let lock = self.op_lock(&id);
        let _guard = lock.lock().await;
        if let Some(here) = self.get(&id) {
            return Ok(here);
        }
        let local = self
            .backend
            .snapshots()
            .into_iter()
            .find(|s| s.id == snapshot_id);
        let info = match local {
            Some(s) => s,
            None => self
                .backend
                .import_snapshot(snapshot_id)
                .await?
                .ok_or_else(|| LifecycleError::SnapshotNotFound(snapshot_id.into()))?,
        };
        if self.owners.snapshot_owner(&info.id) != HANDOFF_TENANT {
            self.owners
                .set_snapshot(&info.id, HANDOFF_TENANT)
                .map_err(internal)?;
        }
        let _quota = self.reserve(
            &rec.owner,
            Usage {
                running: 1,
                paused: 0,
                memory_mb: u64::from(rec.memory_mb),
                ..Usage::default()
            },
        )?;
        let network = handoff
            .network
            .filter(|_| self.backend.networking_off().is_none());
        let spec = CreateSpec {
            sandbox_id: id.clone(),
            template_id: info.id.clone(),
            env_vars: rec.env_vars.clone(),
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
        rec.state = SandboxState::Running;
        rec.paused_at_ms = None;
        rec.end_at_ms = now + (super::DEFAULT_TIMEOUT_S * 1000) as i64;
        if let Err(e) = self.put(rec.clone()) {
            let _ = self.backend.kill(&id).await;
            return Err(e);
        }
        tracing::info!(sandbox = %id, snapshot = %snapshot_id, "adopted a sandbox from another node");
        Ok(rec)
    }
}

impl Sandboxes {
    /// Deletes a handoff snapshot once its sandbox runs again (files a sandbox was restored from stay
    /// until it is gone). Only handoff snapshots: anything else is "not found".
    pub fn drop_handoff(&self, snapshot_id: &str) -> Result<()> {
        if self.owners.snapshot_owner(snapshot_id) != HANDOFF_TENANT {
            return Err(LifecycleError::SnapshotNotFound(snapshot_id.into()));
        }
        self.delete_snapshot(&Caller::Server, snapshot_id)
    }
}
