//! `agentenv serve --join ETCD --advertise URL`: the node registers in the cluster and keeps its record
//! (capacity, load, templates, the snapshots it holds) fresh under a lease (`agentenv_cluster::node`).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use agentenv_cluster::{
    ClusterError, ClusterStore, EntryState, Handoff, MachineSize, NodeRecord, Registration,
    SCHEMA_VERSION, StateChange,
};

use agentenv_control::sandboxes::SandboxState;
use agentenv_control::sandboxes::{Caller, Sandboxes, Transition};

/// What `--join` needs.
pub struct JoinConfig {
    pub etcd: Vec<String>,
    /// etcd over mutual TLS (the certificate's common name must be the node's id).
    pub tls: Option<agentenv_cluster::EtcdTls>,
    /// The node's id; else the one kept in the state folder, or a new random one.
    pub node_id: Option<String>,
    pub prefix: String,
    /// Base URL gateways reach this server at.
    pub advertise: String,
    pub ttl: Duration,
    pub interval: Duration,
    pub max_running: Option<usize>,
    /// Whether snapshots go to a shared bucket (`--s3-endpoint`).
    pub shared_store: bool,
    /// How often this node's cluster entries are checked against its sandboxes ([`RECONCILE_EVERY`]).
    pub reconcile_every: Duration,
}

/// How often a node checks its cluster entries against its sandboxes and repairs an entry a lost or
/// failed transition left wrong.
pub const RECONCILE_EVERY: Duration = Duration::from_secs(5);
/// How long after a failed repair a sandbox's entry is left alone.
const REPAIR_BACKOFF: Duration = Duration::from_secs(60);

/// Registers this node; the registration refreshes itself until it is dropped or leaves.
pub async fn join(
    state_dir: &Path,
    sandboxes: Arc<Sandboxes>,
    cfg: JoinConfig,
) -> anyhow::Result<Registration> {
    let id = node_id(state_dir, cfg.node_id.as_deref())?;
    let store = ClusterStore::connect_with(
        &cfg.etcd,
        cfg.tls.as_ref(),
        &cfg.prefix,
        agentenv_cluster::store::DEFAULT_DEADLINE,
    )
    .await?;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
    let url = cfg.advertise.trim_end_matches('/').to_string();
    let max_running = cfg
        .max_running
        .map(|m| u32::try_from(m).unwrap_or(u32::MAX));
    let shared_store = cfg.shared_store;
    let node = id.clone();
    let sandboxes_for_reconcile = sandboxes.clone();
    let report = Arc::new(move || {
        let load = sandboxes.load();
        let backend = sandboxes.backend();
        let (memory_mb, free_memory_mb) = meminfo();
        let mut sizes = BTreeMap::new();
        let templates = backend
            .templates()
            .into_iter()
            .flat_map(|t| sized_names(t.id, t.aliases, t.vcpus, t.memory_mib, &mut sizes))
            .collect();
        let snapshots = backend
            .snapshots()
            .into_iter()
            .flat_map(|s| sized_names(s.id, s.names, s.vcpus, s.memory_mib, &mut sizes))
            .collect();
        NodeRecord {
            version: SCHEMA_VERSION,
            id: node.clone(),
            url: url.clone(),
            cpus,
            vcpus_used: load.vcpus,
            memory_mb,
            free_memory_mb,
            running: load.running,
            paused: load.paused,
            max_running,
            templates,
            snapshots,
            shared_store,
            updated_at_ms: agentenv_control::sandboxes::now_ms(),
            sizes,
        }
    });
    let reg = Registration::start(store.clone(), cfg.ttl, cfg.interval, report).await?;
    tracing::info!(node = %id, advertise = %cfg.advertise, "joined the cluster");
    if let Err(e) = drop_moved(&store, &id, &sandboxes_for_reconcile).await {
        tracing::warn!(error = %e, "checking for sandboxes moved away while this node was gone failed");
    }
    let node = Follower {
        store,
        me: id,
        sandboxes: sandboxes_for_reconcile,
        shared_store,
        every: cfg.reconcile_every,
    };
    tokio::spawn(node.follow());
    Ok(reg)
}

/// Every name of one template or snapshot (`id`, then `others`), each entered in `sizes` with its size.
fn sized_names(
    id: String,
    others: Vec<String>,
    vcpus: u32,
    memory_mb: u64,
    sizes: &mut BTreeMap<String, MachineSize>,
) -> Vec<String> {
    let names: Vec<String> = std::iter::once(id).chain(others).collect();
    let size = MachineSize { vcpus, memory_mb };
    sizes.extend(names.iter().map(|n| (n.clone(), size)));
    names
}

/// A node back after its lease expired may hold sandboxes the cluster settled without it: paused ones
/// another node has adopted since (their entry names a live node other than this one) and ones a client
/// killed meanwhile (entry `killed`). Their local copies are dropped; the rest, running ones included
/// (their QEMUs outlive the server), carry on.
async fn drop_moved(
    store: &ClusterStore,
    me: &str,
    sandboxes: &Sandboxes,
) -> Result<(), agentenv_cluster::ClusterError> {
    for entry in store.sandboxes().await? {
        if entry.node == me && entry.state == agentenv_cluster::EntryState::Killed {
            // Killed by a client while this node was away.
            if sandboxes.get(&entry.sandbox_id).is_some() {
                match sandboxes
                    .kill(
                        &agentenv_control::sandboxes::Caller::Server,
                        &entry.sandbox_id,
                    )
                    .await
                {
                    Ok(()) => {
                        tracing::info!(sandbox = %entry.sandbox_id, "killed a sandbox a client killed while this node was away")
                    }
                    Err(e) => {
                        tracing::warn!(sandbox = %entry.sandbox_id, error = %e, "killing a sandbox killed meanwhile failed")
                    }
                }
            }
            store.release_sandbox(me, &entry.sandbox_id).await?;
            continue;
        }
        if entry.node == me {
            continue;
        }
        let paused_here = sandboxes
            .get(&entry.sandbox_id)
            .is_some_and(|r| r.state == agentenv_control::sandboxes::SandboxState::Paused);
        if !paused_here || store.node(&entry.node).await?.is_none() {
            continue;
        }
        match sandboxes
            .kill(
                &agentenv_control::sandboxes::Caller::Server,
                &entry.sandbox_id,
            )
            .await
        {
            Ok(()) => {
                tracing::info!(sandbox = %entry.sandbox_id, now_on = %entry.node, "dropped the local copy of a sandbox another node took over")
            }
            Err(e) => {
                tracing::warn!(sandbox = %entry.sandbox_id, error = %e, "dropping a moved sandbox failed")
            }
        }
    }
    Ok(())
}

/// How often, and how long apart, a cluster write for a transition is tried while etcd is away.
const TRANSITION_TRIES: u32 = 10;
const TRANSITION_RETRY: Duration = Duration::from_secs(1);

/// Keeps this node's cluster entries true after changes the node makes on its own: an auto-paused
/// sandbox is handed off (with a shared bucket) and recorded paused, so it resumes elsewhere if the
/// node dies; an auto-resumed one is recorded running (its handoff dropped); an expired one is
/// forgotten. Without this, the cluster would still think them running (lost with the node) or
/// paused (moved from a stale snapshot). A transition that is lost or fails for good is repaired by
/// [`Follower::reconcile`].
struct Follower {
    store: ClusterStore,
    me: String,
    sandboxes: Arc<Sandboxes>,
    shared_store: bool,
    every: Duration,
}

/// What an out-of-date entry needs: recorded paused (handed off with a shared bucket) or running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Repair {
    Paused,
    Running,
}

impl Follower {
    async fn follow(self) {
        let this = Arc::new(self);
        tokio::spawn(this.clone().reconcile());
        let mut rx = this.sandboxes.transitions();
        while let Some(t) = rx.recv().await {
            let this = this.clone();
            tokio::spawn(async move {
                for attempt in 1..=TRANSITION_TRIES {
                    match this.apply(&t).await {
                        Ok(()) => return,
                        Err(FollowError::Cluster(ClusterError::Unavailable { why, .. }))
                            if attempt < TRANSITION_TRIES =>
                        {
                            tracing::debug!(transition = ?t, %why, attempt, "etcd away; retrying");
                            tokio::time::sleep(TRANSITION_RETRY).await;
                        }
                        Err(e) => {
                            tracing::warn!(transition = ?t, error = %e, "recording a transition in the cluster failed");
                            return;
                        }
                    }
                }
            });
        }
    }

    /// Every [`JoinConfig::reconcile_every`], compares this node's entries with its sandboxes: one that
    /// disagrees in two checks in a row, unchanged in between and with no operation on the sandbox in
    /// flight, is repaired as its transition would have. (A gateway's own pause or resume records its
    /// result within one check, so only a lost or failed transition is repaired.)
    async fn reconcile(self: Arc<Self>) {
        let mut seen = std::collections::HashMap::new();
        let mut failed = std::collections::HashMap::new();
        loop {
            tokio::time::sleep(self.every).await;
            if let Err(e) = self.reconcile_once(&mut seen, &mut failed).await {
                tracing::debug!(error = %e, "checking this node's cluster entries failed");
            }
        }
    }

    /// One check. `seen`: mismatches of the previous check; `failed`: when a repair last failed, so a
    /// sandbox whose repair keeps failing (a bucket that refuses writes) is tried again only after
    /// [`REPAIR_BACKOFF`].
    async fn reconcile_once(
        &self,
        seen: &mut std::collections::HashMap<String, (Repair, i64)>,
        failed: &mut std::collections::HashMap<String, std::time::Instant>,
    ) -> Result<(), FollowError> {
        failed.retain(|_, at| at.elapsed() < REPAIR_BACKOFF);
        let mut still = std::collections::HashMap::new();
        for e in self.store.sandboxes().await? {
            if e.node != self.me {
                continue;
            }
            let Some(here) = self.sandboxes.get(&e.sandbox_id) else {
                continue;
            };
            let repair = match (here.state, e.state) {
                (SandboxState::Paused, EntryState::Running) => Repair::Paused,
                (SandboxState::Paused, EntryState::Paused)
                    if self.shared_store && e.handoff.is_none() =>
                {
                    Repair::Paused
                }
                (SandboxState::Running, EntryState::Paused) => Repair::Running,
                _ => continue,
            };
            if self.sandboxes.busy(&e.sandbox_id) || failed.contains_key(&e.sandbox_id) {
                continue;
            }
            let mark = (repair, e.updated_at_ms);
            if seen.get(&e.sandbox_id) != Some(&mark) {
                still.insert(e.sandbox_id, mark);
                continue;
            }
            tracing::warn!(sandbox = %e.sandbox_id, ?repair, "its cluster entry stayed out of date; repairing");
            let t = match repair {
                Repair::Paused => Transition::AutoPaused(e.sandbox_id.clone()),
                Repair::Running => Transition::AutoResumed(e.sandbox_id.clone()),
            };
            if let Err(err) = self.apply(&t).await {
                tracing::warn!(transition = ?t, error = %err, "repairing a cluster entry failed");
                failed.insert(e.sandbox_id, std::time::Instant::now());
            }
        }
        *seen = still;
        Ok(())
    }

    async fn apply(&self, t: &Transition) -> Result<(), FollowError> {
        match t {
            Transition::AutoPaused(id) if self.shared_store => self.hand_off(id).await,
            Transition::AutoPaused(id) => self.record(id, SandboxState::Paused).await,
            Transition::AutoResumed(id) => self.record(id, SandboxState::Running).await,
            Transition::Expired { id, .. } => {
                let entry = self.store.sandbox(id).await?;
                if entry.as_ref().is_some_and(|e| e.value.node == self.me) {
                    // Its placement and token go at a gateway's next sweep.
                    self.store.release_sandbox(&self.me, id).await?;
                    if let Some(h) = entry.and_then(|e| e.value.handoff) {
                        self.drop_handoff(&h.snapshot_id);
                    }
                }
                Ok(())
            }
        }
    }

    /// Hands paused sandbox `id` off to the bucket and records it paused with that handoff, under its
    /// lock (a resume waits). A handoff the cluster did not take is deleted again.
    async fn hand_off(&self, id: &str) -> Result<(), FollowError> {
        let res = self
            .sandboxes
            .handoff_then(&Caller::Server, id, async |sid, rec| {
                let handoff = Handoff {
                    snapshot_id: sid.to_string(),
                    record: serde_json::to_value(rec).map_err(FollowError::Encode)?,
                };
                let now = agentenv_control::sandboxes::now_ms();
                let change = self
                    .store
                    .set_state(id, Some(&self.me), EntryState::Paused, Some(handoff), now)
                    .await?;
                Ok::<_, FollowError>(change)
            })
            .await;
        let (sid, _, change) = match res {
            Ok(done) => done,
            // Resumed or gone before the handoff: nothing to record.
            Err(
                agentenv_control::sandboxes::LifecycleError::AlreadyRunning(_)
                | agentenv_control::sandboxes::LifecycleError::SandboxNotFound(_),
            ) => return Ok(()),
            Err(e) => return Err(FollowError::Handoff(e)),
        };
        match change {
            Ok(StateChange::Written { replaced }) => {
                tracing::info!(sandbox = %id, snapshot = %sid, "auto-paused sandbox handed off");
                if let Some(old) = replaced {
                    self.drop_handoff(&old.snapshot_id);
                }
                Ok(())
            }
            Ok(StateChange::Skipped) => {
                self.drop_handoff(&sid);
                Ok(())
            }
            Err(e) => {
                self.drop_handoff(&sid);
                Err(e)
            }
        }
    }

    /// Records `id` in `state` (no handoff) while it still is in that state here.
    async fn record(&self, id: &str, state: SandboxState) -> Result<(), FollowError> {
        let entry_state = match state {
            SandboxState::Running => EntryState::Running,
            SandboxState::Paused => EntryState::Paused,
        };
        let change = self
            .sandboxes
            .while_in(id, state, async |_| {
                let now = agentenv_control::sandboxes::now_ms();
                self.store
                    .set_state(id, Some(&self.me), entry_state, None, now)
                    .await
            })
            .await;
        if let Some(StateChange::Written {
            replaced: Some(old),
        }) = change.transpose()?
        {
            self.drop_handoff(&old.snapshot_id);
        }
        Ok(())
    }

    /// Deletes a handoff snapshot nothing refers to any more; best effort.
    fn drop_handoff(&self, snapshot_id: &str) {
        if let Err(e) = self.sandboxes.drop_handoff(snapshot_id) {
            tracing::warn!(snapshot = %snapshot_id, error = %e, "deleting a handoff snapshot failed");
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum FollowError {
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    #[error("handoff: {0}")]
    Handoff(agentenv_control::sandboxes::LifecycleError),
    #[error("encoding the handoff record: {0}")]
    Encode(serde_json::Error),
}

/// This node's id, made once and kept in `<state>/server/node_id`.
/// The node's id: `given` (checked, then kept), else the kept one, else a new random one (kept).
fn node_id(state_dir: &Path, given: Option<&str>) -> anyhow::Result<String> {
    let path = state_dir.join("server/node_id");
    if let Some(id) = given {
        anyhow::ensure!(
            agentenv_cluster::schema::valid_node_id(id),
            "node id {id:?}: 1-63 of [a-z0-9-]"
        );
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        k3_common::fsutil::write_atomic(&path, id.as_bytes())?;
        return Ok(id.to_string());
    }
    if let Ok(id) = std::fs::read_to_string(&path) {
        let id = id.trim();
        if !id.is_empty() {
            return Ok(id.to_string());
        }
    }
    let id = format!("node-{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    k3_common::fsutil::write_atomic(&path, id.as_bytes())?;
    Ok(id)
}

/// Host memory and what is available, MiB (`/proc/meminfo`).
fn meminfo() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb / 1024)
    };
    (field("MemTotal:"), field("MemAvailable:"))
}
