//! `agentenv serve --join ETCD --advertise URL`: the node registers in the cluster and keeps its record
//! (capacity, load, templates, the snapshots it holds) fresh under a lease (`agentenv_cluster::node`).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use agentenv_cluster::{ClusterStore, MachineSize, NodeRecord, Registration, SCHEMA_VERSION};

use crate::sandboxes::Sandboxes;

/// What `--join` needs.
pub struct JoinConfig {
    pub etcd: Vec<String>,
    pub prefix: String,
    /// Base URL gateways reach this server at.
    pub advertise: String,
    pub ttl: Duration,
    pub interval: Duration,
    pub max_running: Option<usize>,
    /// Whether snapshots go to a shared bucket (`--s3-endpoint`).
    pub shared_store: bool,
}

/// Registers this node; the registration refreshes itself until it is dropped or leaves.
pub async fn join(
    state_dir: &Path,
    sandboxes: Arc<Sandboxes>,
    cfg: JoinConfig,
) -> anyhow::Result<Registration> {
    let id = node_id(state_dir)?;
    let store = ClusterStore::connect(
        &cfg.etcd,
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
            updated_at_ms: crate::sandboxes::now_ms(),
            sizes,
        }
    });
    let reg = Registration::start(store.clone(), cfg.ttl, cfg.interval, report).await?;
    tracing::info!(node = %id, advertise = %cfg.advertise, "joined the cluster");
    if let Err(e) = drop_moved(&store, &id, &sandboxes_for_reconcile).await {
        tracing::warn!(error = %e, "checking for sandboxes moved away while this node was gone failed");
    }
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
                    .kill(&crate::sandboxes::Caller::Server, &entry.sandbox_id)
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
            store.remove_sandbox(&entry.sandbox_id, None).await?;
            continue;
        }
        if entry.node == me {
            continue;
        }
        let paused_here = sandboxes
            .get(&entry.sandbox_id)
            .is_some_and(|r| r.state == crate::model::SandboxState::Paused);
        if !paused_here || store.node(&entry.node).await?.is_none() {
            continue;
        }
        match sandboxes
            .kill(&crate::sandboxes::Caller::Server, &entry.sandbox_id)
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

/// This node's id, made once and kept in `<state>/server/node_id`.
fn node_id(state_dir: &Path) -> anyhow::Result<String> {
    let path = state_dir.join("server/node_id");
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
