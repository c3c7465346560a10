//! An in-memory [`VmBackend`] for millisecond tests of the lifecycle layer (idempotency, timeouts,
//! auto-pause, paging, fork bookkeeping, restart reconciliation). It runs no VM and serves no agent
//! stream; the real runtime proves the seams in the QEMU and SDK tests.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

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
}

impl VmBackend for FakeBackend {
    fn accel_name(&self) -> String {
        "fake".into()
    }
    fn templates(&self) -> Vec<TemplateInfo> {
        vec![template()]
    }
    fn build_template(
        &self,
        _: TemplateSpec,
    ) -> BoxFuture<'_, Result<TemplateInfo, TemplateError>> {
        Box::pin(async {
            Err(TemplateError::InvalidSpec(
                "the fake builds no templates".into(),
            ))
        })
    }
    fn create(&self, spec: CreateSpec) -> BoxFuture<'_, Result<SandboxVm, CreateError>> {
        Box::pin(async move {
            let known = spec.template_id == "base"
                || self
                    .snaps
                    .lock()
                    .unwrap()
                    .iter()
                    .any(|s| s.id == spec.template_id);
            if !known {
                return Err(CreateError::UnknownTemplate(spec.template_id));
            }
            self.creates.fetch_add(1, Ordering::SeqCst);
            self.vms
                .lock()
                .unwrap()
                .insert(spec.sandbox_id.clone(), VmState::Running);
            Ok(vm(&spec.sandbox_id))
        })
    }
    fn pause<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), PauseError>> {
        Box::pin(async move {
            match self.state(id) {
                None => Err(PauseError::NotFound(id.into())),
                Some(VmState::Paused) => Err(PauseError::AlreadyPaused(id.into())),
                Some(VmState::Running) => {
                    self.vms.lock().unwrap().insert(id.into(), VmState::Paused);
                    Ok(())
                }
            }
        })
    }
    fn resume<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), ResumeError>> {
        Box::pin(async move {
            match self.state(id) {
                None => Err(ResumeError::NotFound(id.into())),
                Some(VmState::Running) => Err(ResumeError::NotPaused(id.into())),
                Some(VmState::Paused) => {
                    self.vms.lock().unwrap().insert(id.into(), VmState::Running);
                    Ok(())
                }
            }
        })
    }
    fn kill<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), KillError>> {
        Box::pin(async move {
            self.kills.fetch_add(1, Ordering::SeqCst);
            self.vms
                .lock()
                .unwrap()
                .remove(id)
                .map(|_| ())
                .ok_or_else(|| KillError::NotFound(id.into()))
        })
    }
    fn open_agent_stream<'a>(
        &'a self,
        id: &'a str,
    ) -> BoxFuture<'a, Result<AgentStream, ConnectError>> {
        Box::pin(async move { Err(ConnectError::NotFound(id.into())) })
    }
    fn recover(&self) -> BoxFuture<'_, Result<Vec<RecoveredVm>, RecoverError>> {
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
    ) -> BoxFuture<'a, Result<SnapshotInfo, SnapshotError>> {
        Box::pin(async move {
            if self.state(sandbox_id).is_none() {
                return Err(SnapshotError::SandboxNotFound(sandbox_id.into()));
            }
            let names = names
                .iter()
                .map(|n| {
                    agentenv_runtime::snapshot::normalize_name(n)
                        .ok_or_else(|| SnapshotError::InvalidName(n.clone()))
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
                bytes: 0,
                vcpus: 1,
                memory_mib: 256,
                paused_ms: 0.0,
            };
            snaps.push(info.clone());
            Ok(info)
        })
    }
    fn snapshots(&self) -> Vec<SnapshotInfo> {
        self.snaps.lock().unwrap().clone()
    }
    fn delete_snapshot(&self, id: &str) -> Result<(), SnapshotError> {
        let mut snaps = self.snaps.lock().unwrap();
        let before = snaps.len();
        snaps.retain(|s| s.id != id);
        if snaps.len() == before {
            return Err(SnapshotError::NotFound(id.into()));
        }
        Ok(())
    }
    fn fork<'a>(
        &'a self,
        sandbox_id: &'a str,
        ids: &'a [String],
    ) -> BoxFuture<'a, Result<ForkResults, SnapshotError>> {
        Box::pin(async move {
            if self.state(sandbox_id).is_none() {
                return Err(SnapshotError::SandboxNotFound(sandbox_id.into()));
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
}
