//! Opening the lifecycle: records loaded and reconciled with the VMs that survived a restart.

use super::*;

impl Sandboxes {
    /// Loads the stored records and reconciles them with the runtime after a restart:
    /// paused ones stay paused, running ones are re-attached, vanished ones are dropped.
    pub async fn open(
        backend: Arc<dyn VmBackend>,
        store: SandboxStore,
        metrics: Arc<dyn OpObserver>,
        cfg: LifecycleConfig,
        ring: Arc<KeyRing>,
        volumes: Arc<crate::volumes::Volumes>,
    ) -> Result<Arc<Self>, OpenError> {
        let state = |e| OpenError::State(Box::new(e));
        let owners = Owners::open(store.state_dir()).map_err(state)?;
        owners
            .retain(
                &backend.snapshots().into_iter().map(|s| s.id).collect(),
                &backend.templates().into_iter().map(|t| t.id).collect(),
            )
            .map_err(state)?;
        let loaded = store
            .load_all(now_ms())
            .map_err(|e| OpenError::State(Box::new(e)))?;
        if loaded.migrated > 0 {
            tracing::info!(
                count = loaded.migrated,
                "migrated sandbox records to version {RECORD_VERSION}"
            );
        }
        let stored = loaded.records;
        let recovered: HashMap<String, VmState> = backend
            .recover()
            .await
            .map_err(OpenError::Recover)?
            .into_iter()
            .filter_map(|v| {
                if v.state.is_none() {
                    tracing::warn!(sandbox = %v.id, detail = %v.detail, "runtime dropped a sandbox VM during recovery");
                }
                Some((v.id, v.state?))
            })
            .collect();
        let mut records = HashMap::new();
        for mut rec in stored {
            // No template build survives a restart: the sandbox of one in flight goes too (its VM
            // is killed below, as one without a record).
            if rec.metadata.contains_key(BUILD_MARK) {
                tracing::warn!(sandbox = %rec.sandbox_id, "dropping the sandbox of a build the restart ended");
                store
                    .remove(&rec.sandbox_id)
                    .map_err(|e| OpenError::State(Box::new(e)))?;
                continue;
            }
            match recovered.get(&rec.sandbox_id) {
                Some(state) => {
                    rec.state = match state {
                        VmState::Running => SandboxState::Running,
                        VmState::Paused => SandboxState::Paused,
                    };
                    store
                        .save(&rec)
                        .map_err(|e| OpenError::State(Box::new(e)))?;
                    tracing::info!(sandbox = %rec.sandbox_id, state = rec.state.as_str(), "recovered sandbox");
                    records.insert(rec.sandbox_id.clone(), rec);
                }
                None => {
                    tracing::warn!(sandbox = %rec.sandbox_id, "sandbox VM did not survive the restart; dropping it");
                    store
                        .remove(&rec.sandbox_id)
                        .map_err(|e| OpenError::State(Box::new(e)))?;
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
            builds: builds::Builds::new(store.state_dir()),
            transitions: Mutex::new(None),
            volumes,
            channels: Arc::default(),
            store,
            metrics,
            cfg,
            records: Mutex::new(records),
            op_locks: Mutex::new(HashMap::new()),
            idempotency: Mutex::new(HashMap::new()),
            expiring: Mutex::new(HashSet::new()),
            reserved: Arc::default(),
            owners,
            ring,
        }))
    }
}
