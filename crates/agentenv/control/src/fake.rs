//! An in-memory [`VmBackend`] for millisecond tests of the lifecycle layer (idempotency, timeouts,
//! auto-pause, paging, fork bookkeeping, restart reconciliation). It runs no VM and serves no agent
//! stream; the real runtime proves the seams in the QEMU and SDK tests.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::backend::*;

/// What the fake holds.
#[derive(Default)]
pub struct FakeBackend {
    pub vms: Mutex<BTreeMap<String, VmState>>,
    pub snaps: Mutex<Vec<SnapshotInfo>>,
    /// VMs `recover` reports (set before opening `Sandboxes` to model a restart).
    pub recovered: Mutex<Vec<RecoveredVm>>,
    pub creates: AtomicUsize,
    pub kills: AtomicUsize,
    /// Sandboxes whose pause, resume and snapshot never return (a wedged QEMU); kill still works.
    pub wedged: Mutex<std::collections::HashSet<String>>,
    /// Templates "built" (instantly) besides `base`.
    pub built: Mutex<Vec<TemplateInfo>>,
    /// Egress policies of sandboxes created with one.
    pub nets: Mutex<BTreeMap<String, EgressPolicy>>,
    /// Commands `exec` ran, in order, with their sandbox. A command exits with the number after its
    /// last `exit ` (else 0) and prints itself.
    pub execs: Mutex<Vec<(String, ExecRequest)>>,
    /// What `networking_off` answers.
    pub net_off: Mutex<Option<String>>,
    /// Snapshots report their chunks stored at once (a shared bucket that is never slow).
    pub store_snapshots: std::sync::atomic::AtomicBool,
    /// Bytes each new snapshot occupies on disk (`SnapshotInfo::bytes`).
    pub snapshot_bytes: std::sync::atomic::AtomicU64,
    /// Snapshots report that storing them failed, with this reason.
    pub store_failure: Mutex<Option<String>>,
    /// Sandboxes paused without memory, with the environment their last cold boot got.
    pub boots: Mutex<BTreeMap<String, BTreeMap<String, String>>>,
    /// Answers `open_agent_stream` for running sandboxes (none: not found).
    #[allow(clippy::type_complexity)]
    pub agent: Mutex<Option<Arc<dyn Fn(&str) -> AgentStream + Send + Sync>>>,
}

fn template() -> TemplateInfo {
    TemplateInfo {
        id: "base".into(),
        aliases: vec!["default".into()],
        vcpus: 1,
        memory_mib: 256,
        disk_mib: 2048,
        built_at: "2026-12-01T00:00:00Z".into(),
        envd_version: agentenv_envd::ENVD_VERSION.into(),
        from_image: None,
    }
}

fn vm(id: &str) -> SandboxVm {
    SandboxVm {
        id: id.into(),
        template_id: "base".into(),
        vcpus: 1,
        memory_mib: 256,
        envd_version: agentenv_envd::ENVD_VERSION.into(),
    }
}

impl FakeBackend {
    fn state(&self, id: &str) -> Option<VmState> {
        self.vms.lock().unwrap().get(id).copied()
    }
    async fn hang_if_wedged(&self, id: &str) {
        if self.wedged.lock().unwrap().contains(id) {
            std::future::pending::<()>().await;
        }
    }
}

impl VmBackend for FakeBackend {
    fn accel_name(&self) -> String {
        "fake".into()
    }
    fn templates(&self) -> Vec<TemplateInfo> {
        let mut all = vec![template()];
        all.extend(self.built.lock().unwrap().iter().cloned());
        all
    }
    fn build_template(
        &self,
        spec: TemplateSpec,
        progress: crate::backend::ProgressFn,
    ) -> BoxFuture<'_, VmResult<TemplateInfo>> {
        Box::pin(async move {
            // As the runtime: an existing id is rebuilt (the built-in base cannot be, here).
            if spec.id == template().id {
                return Err(VmError::invalid(format!("{} is built in", spec.id)));
            }
            self.built.lock().unwrap().retain(|t| t.id != spec.id);
            // A pull of two 1 MiB layers, then the build's own steps.
            use agentenv_vm::{BuildProgress as P, BuildStep as S};
            let pull = [0, 1 << 20, 2 << 20].map(|d| (S::Pull, Some((d, 2 << 20))));
            for (step, bytes) in pull.into_iter().chain([(S::Image, None), (S::Boot, None)]) {
                let detail = String::new();
                progress(P {
                    step,
                    detail,
                    bytes,
                });
            }
            let t = TemplateInfo {
                id: spec.id,
                aliases: spec.aliases,
                vcpus: spec.vcpus,
                memory_mib: spec.memory_mib,
                from_image: spec.from_image.map(|i| i.reference),
                ..template()
            };
            self.built.lock().unwrap().push(t.clone());
            Ok(t)
        })
    }
    fn create(&self, spec: CreateSpec) -> BoxFuture<'_, VmResult<SandboxVm>> {
        Box::pin(async move {
            let known = self.templates().iter().any(|t| t.id == spec.template_id)
                || self
                    .snaps
                    .lock()
                    .unwrap()
                    .iter()
                    .any(|s| s.id == spec.template_id);
            if !known {
                return Err(VmError::TemplateNotFound(spec.template_id));
            }
            self.creates.fetch_add(1, Ordering::SeqCst);
            self.vms
                .lock()
                .unwrap()
                .insert(spec.sandbox_id.clone(), VmState::Running);
            if let Some(p) = spec.network {
                self.nets.lock().unwrap().insert(spec.sandbox_id.clone(), p);
            }
            Ok(vm(&spec.sandbox_id))
        })
    }
    fn pause<'a>(&'a self, id: &'a str, memory: bool) -> BoxFuture<'a, VmResult<()>> {
        Box::pin(async move {
            self.hang_if_wedged(id).await;
            match self.state(id) {
                None => Err(VmError::SandboxNotFound(id.into())),
                Some(VmState::Paused) => Err(VmError::AlreadyPaused(id.into())),
                Some(VmState::Running) => {
                    self.vms.lock().unwrap().insert(id.into(), VmState::Paused);
                    if !memory {
                        self.boots
                            .lock()
                            .unwrap()
                            .insert(id.into(), BTreeMap::new());
                    }
                    Ok(())
                }
            }
        })
    }
    fn resume<'a>(
        &'a self,
        id: &'a str,
        env_vars: &'a BTreeMap<String, String>,
    ) -> BoxFuture<'a, VmResult<()>> {
        Box::pin(async move {
            self.hang_if_wedged(id).await;
            match self.state(id) {
                None => Err(VmError::SandboxNotFound(id.into())),
                Some(VmState::Running) => Err(VmError::NotPaused(id.into())),
                Some(VmState::Paused) => {
                    if let Some(e) = self.boots.lock().unwrap().get_mut(id) {
                        *e = env_vars.clone();
                    }
                    self.vms.lock().unwrap().insert(id.into(), VmState::Running);
                    Ok(())
                }
            }
        })
    }
    fn kill<'a>(&'a self, id: &'a str) -> BoxFuture<'a, VmResult<()>> {
        Box::pin(async move {
            self.kills.fetch_add(1, Ordering::SeqCst);
            self.nets.lock().unwrap().remove(id);
            self.vms
                .lock()
                .unwrap()
                .remove(id)
                .map(|_| ())
                .ok_or_else(|| VmError::SandboxNotFound(id.into()))
        })
    }
    fn open_agent_stream<'a>(&'a self, id: &'a str) -> BoxFuture<'a, VmResult<AgentStream>> {
        Box::pin(async move {
            let agent = self.agent.lock().unwrap().clone();
            match (self.state(id), agent) {
                (Some(VmState::Running), Some(a)) => Ok(a(id)),
                _ => Err(VmError::SandboxNotFound(id.into())),
            }
        })
    }
    fn recover(&self) -> BoxFuture<'_, VmResult<Vec<RecoveredVm>>> {
        Box::pin(async move {
            let r = std::mem::take(&mut *self.recovered.lock().unwrap());
            let mut vms = self.vms.lock().unwrap();
            for v in &r {
                if let Some(s) = v.state {
                    vms.insert(v.id.clone(), s);
                }
            }
            Ok(r)
        })
    }
    fn vm_state(&self, id: &str) -> Option<VmState> {
        self.state(id)
    }
    fn snapshot<'a>(
        &'a self,
        sandbox_id: &'a str,
        snapshot_id: &'a str,
        names: &'a [String],
        mode: SnapshotMode,
    ) -> BoxFuture<'a, VmResult<SnapshotInfo>> {
        Box::pin(async move {
            self.hang_if_wedged(sandbox_id).await;
            if self.state(sandbox_id).is_none() {
                return Err(VmError::SandboxNotFound(sandbox_id.into()));
            }
            let names = names
                .iter()
                .map(|n| {
                    agentenv_vm::normalize_name(n)
                        .ok_or_else(|| VmError::invalid(format!("invalid snapshot name {n:?}")))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let mut snaps = self.snaps.lock().unwrap();
            for s in snaps.iter_mut() {
                s.names.retain(|n| !names.contains(n));
            }
            let info = SnapshotInfo {
                id: snapshot_id.into(),
                names,
                source_sandbox: Some(sandbox_id.into()),
                template_id: "base".into(),
                mode,
                created_at: format!("2026-12-01T00:00:{:02}Z", snaps.len()),
                bytes: self.snapshot_bytes.load(Ordering::Relaxed),
                vcpus: 1,
                memory_mib: 256,
                paused_ms: 0.0,
                stored: self
                    .store_snapshots
                    .load(Ordering::Relaxed)
                    .then(Default::default),
                store_failed: self.store_failure.lock().unwrap().clone(),
            };
            snaps.push(info.clone());
            Ok(info)
        })
    }
    fn snapshots(&self) -> Vec<SnapshotInfo> {
        self.snaps.lock().unwrap().clone()
    }
    fn import_snapshot<'a>(
        &'a self,
        id_or_name: &'a str,
    ) -> BoxFuture<'a, VmResult<Option<SnapshotInfo>>> {
        // The fake shares no store with other machines: only its own snapshots exist.
        let snap = self.snapshots().into_iter().find(|s| s.id == id_or_name);
        Box::pin(async move { Ok(snap) })
    }
    fn delete_snapshot(&self, id: &str) -> VmResult<()> {
        let mut snaps = self.snaps.lock().unwrap();
        let before = snaps.len();
        snaps.retain(|s| s.id != id);
        if snaps.len() == before {
            return Err(VmError::SnapshotNotFound(id.into()));
        }
        Ok(())
    }
    fn rename_snapshot(
        &self,
        id: &str,
        add: &[String],
        remove: &[String],
    ) -> VmResult<SnapshotInfo> {
        let norm = |v: &[String]| {
            v.iter()
                .map(|n| {
                    agentenv_vm::normalize_name(n)
                        .ok_or_else(|| VmError::invalid(format!("invalid snapshot name {n:?}")))
                })
                .collect::<VmResult<Vec<_>>>()
        };
        let (add, remove) = (norm(add)?, norm(remove)?);
        let mut snaps = self.snaps.lock().unwrap();
        if !snaps.iter().any(|s| s.id == id) {
            return Err(VmError::SnapshotNotFound(id.into()));
        }
        for s in snaps.iter_mut() {
            s.names
                .retain(|n| !(add.contains(n) || s.id == id && remove.contains(n)));
        }
        let s = snaps
            .iter_mut()
            .find(|s| s.id == id)
            .expect("checked above");
        s.names.extend(add);
        Ok(s.clone())
    }

    fn fork<'a>(
        &'a self,
        sandbox_id: &'a str,
        ids: &'a [String],
    ) -> BoxFuture<'a, VmResult<ForkResults>> {
        Box::pin(async move {
            if self.state(sandbox_id).is_none() {
                return Err(VmError::SandboxNotFound(sandbox_id.into()));
            }
            let mut vms = self.vms.lock().unwrap();
            Ok(ids
                .iter()
                .map(|id| {
                    vms.insert(id.clone(), VmState::Running);
                    Ok(vm(id))
                })
                .collect())
        })
    }
    fn set_network<'a>(&'a self, id: &'a str, policy: EgressPolicy) -> BoxFuture<'a, VmResult<()>> {
        Box::pin(async move {
            if self.state(id).is_none() {
                return Err(VmError::SandboxNotFound(id.into()));
            }
            self.nets.lock().unwrap().insert(id.into(), policy);
            Ok(())
        })
    }
    fn network<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Option<NetworkInfo>> {
        Box::pin(async move {
            let policy = self.nets.lock().unwrap().get(id).cloned()?;
            Some(NetworkInfo {
                address: std::net::Ipv4Addr::new(10, 200, 0, 2),
                policy,
            })
        })
    }
    fn networking_off(&self) -> Option<String> {
        self.net_off.lock().unwrap().clone()
    }
    fn exec<'a>(
        &'a self,
        id: &'a str,
        req: ExecRequest,
        _deadline: std::time::Duration,
        mut on_event: Box<dyn FnMut(ExecEvent) + Send + 'a>,
    ) -> BoxFuture<'a, VmResult<(i32, String)>> {
        Box::pin(async move {
            match self.state(id) {
                None => return Err(VmError::SandboxNotFound(id.into())),
                Some(VmState::Paused) => return Err(VmError::Paused(id.into())),
                Some(VmState::Running) => {}
            }
            self.execs.lock().unwrap().push((id.into(), req.clone()));
            if req.background {
                return Ok((42, "started".into()));
            }
            on_event(ExecEvent::Stdout(format!("{}\n", req.cmd)));
            let code = req
                .cmd
                .rsplit_once("exit ")
                .and_then(|(_, n)| n.trim().parse().ok())
                .unwrap_or(0);
            Ok((code, format!("exit status {code}")))
        })
    }
    fn sample<'a>(&'a self, id: &'a str) -> BoxFuture<'a, VmResult<Sample>> {
        Box::pin(async move {
            match self.state(id) {
                None => Err(VmError::SandboxNotFound(id.into())),
                Some(VmState::Paused) => Err(VmError::Paused(id.into())),
                Some(VmState::Running) => Ok(Sample {
                    guest: agentenv_envd::GuestMetrics {
                        ts: 1_764_547_200,
                        cpu_count: 1,
                        mem_total: 256 << 20,
                        ..Default::default()
                    },
                    net: self.nets.lock().unwrap().contains_key(id).then_some(
                        agentenv_vm::NetStats {
                            tx_bytes: 10,
                            rx_bytes: 20,
                            dropped_packets: 1,
                        },
                    ),
                }),
            }
        })
    }
}

#[cfg(test)]
#[path = "fake_tests.rs"]
pub(crate) mod fake_tests;
