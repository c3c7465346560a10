//! Reconciling persisted sandbox records with reality after a server restart.

use std::time::Duration;

use crate::agent;
use crate::error::RecoverError;
use crate::lifecycle::sandbox::{Live, Slot};
use crate::persist::{self, SandboxPhase, VmRecord};
use crate::{RecoveredVm, Runtime, VmState};

impl Runtime {
    /// Picks up sandboxes left by a previous process: running VMs whose QEMU survived are re-attached
    /// (QMP + a fresh agent session), paused ones are kept, half-created or dead ones are removed, and
    /// any QEMU process of this state folder that no record keeps is killed (no orphans).
    /// Sandboxes this process already knows are left alone.
    pub async fn recover(&self) -> Result<Vec<RecoveredVm>, RecoverError> {
        let dir = self.inner.cfg.state_dir.join("sandboxes");
        let entries = std::fs::read_dir(&dir).map_err(|e| RecoverError::Io {
            path: dir.clone(),
            source: e,
        })?;
        let mut out = Vec::new();
        let mut keep_pids = Vec::new();
        for e in entries.flatten() {
            let id = e.file_name().to_string_lossy().into_owned();
            if let Some(slot) = self.inner.sandboxes.get(&id) {
                if let Ok(live) = slot.live.try_lock()
                    && let Some(vm) = &live.vm
                {
                    keep_pids.push(vm.pid());
                }
                continue;
            }
            let (state, detail, pid) = self.recover_one(&id).await;
            keep_pids.extend(pid);
            let template_id = persist::read::<VmRecord>(&self.inner.record_path(&id))
                .map(|r| r.template_id)
                .unwrap_or_default();
            if state.is_none() {
                self.remove_files(&id);
            }
            tracing::info!(sandbox = %id, ?state, %detail, "recovered");
            out.push(RecoveredVm {
                id,
                template_id,
                state,
                detail,
            });
        }
        let held: std::collections::HashSet<std::path::PathBuf> = self
            .inner
            .sandboxes
            .ids()
            .iter()
            .filter_map(|id| persist::read::<VmRecord>(&self.inner.record_path(id)).ok())
            .filter_map(|r| r.vm_dir)
            .collect();
        self.remove_stale_warm(&held, &keep_pids);
        // After the warm VMs' folders are gone, so that their slots count as stale.
        self.remove_stale_nets();
        for (pid, id) in crate::vmm::vm_processes_under(&dir) {
            let slot = self.inner.sandboxes.get(&id);
            // A busy slot belongs to an operation of this process (for example a create in flight).
            let busy = slot.is_some_and(|s| s.live.try_lock().is_err());
            if !busy && !keep_pids.contains(&pid) {
                tracing::warn!(pid, "killing orphan QEMU of this state folder");
                // SAFETY: plain syscall on a pid whose command line names our sandboxes folder.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            }
        }
        Ok(out)
    }

    async fn recover_one(&self, id: &str) -> (Option<VmState>, String, Option<u32>) {
        let mut rec: VmRecord = match persist::read(&self.inner.record_path(id)) {
            Ok(r) => r,
            Err(e) => return (None, format!("unreadable record: {e}"), None),
        };
        if rec.phase == SandboxPhase::Paused && rec.ram_boot_id.is_some() {
            self.settle_unflushed_ram(id, &mut rec);
        }
        let spec = self.inner.spec_of(&rec);
        match rec.phase {
            SandboxPhase::Starting => (
                None,
                "was being created when the previous process stopped".into(),
                None,
            ),
            SandboxPhase::Paused => {
                // Paused without memory, only the disk matters.
                if !rec.boot_on_resume
                    && (!self.inner.device_state_path(id).exists()
                        || (rec.ram_shared && !rec.ram_file.exists()))
                {
                    return (
                        None,
                        "paused but its snapshot files are missing".into(),
                        None,
                    );
                }
                if self.inner.vmm.per_vm_uids() && rec.ram_shared {
                    // Its QEMU may have exited without this runtime seeing it: the RAM file is ours again.
                    crate::vmm::launch::reclaim(&rec.ram_file);
                }
                let mut live = Live {
                    record: rec,
                    vm: None,
                    agent: None,
                    exiting: None,
                    gone: false,
                    net: None,
                    kept: None,
                };
                self.recover_net(&mut live).await;
                self.insert(id, Slot::new(live, VmState::Paused));
                (Some(VmState::Paused), "paused snapshot kept".into(), None)
            }
            SandboxPhase::Running { pid } => {
                let vm = match self.inner.vmm.attach(&spec, pid).await {
                    Ok(vm) => vm,
                    Err(e) => return (None, format!("VMM gone ({e}); its memory is lost"), None),
                };
                // A process killed during a pause, snapshot or fork left the VM stopped: run it again
                // (`cont` on a running VM is a no-op).
                if let Err(e) = vm.cont().await {
                    let _ = vm.kill().await;
                    return (None, format!("re-attached VM would not run: {e}"), None);
                }
                let link = agent::connect_healthy(
                    &spec.agent_socket(),
                    Duration::from_secs(3),
                    Duration::from_secs(30),
                )
                .await;
                let detail = match &link {
                    Ok(_) => "re-attached".to_owned(),
                    Err(e) => format!("re-attached; agent not answering yet: {e}"),
                };
                let mut live = Live {
                    record: rec,
                    vm: Some(vm),
                    agent: link.ok(),
                    exiting: None,
                    gone: false,
                    net: None,
                    kept: None,
                };
                self.recover_net(&mut live).await;
                self.insert(id, Slot::new(live, VmState::Running));
                (Some(VmState::Running), detail, Some(pid))
            }
        }
    }

    fn insert(&self, id: &str, slot: std::sync::Arc<Slot>) {
        self.inner.sandboxes.insert(id, slot);
    }

    fn remove_files(&self, id: &str) {
        if let Ok(rec) = persist::read::<VmRecord>(&self.inner.record_path(id)) {
            let _ = std::fs::remove_file(&rec.ram_file);
            if let Some(d) = &rec.vm_dir {
                let _ = std::fs::remove_dir_all(d);
            }
        }
        let _ = std::fs::remove_file(self.inner.ram_file(id));
        let _ = std::fs::remove_dir_all(self.inner.sandbox_dir(id));
    }
}

impl Runtime {
    /// A sandbox paused while its RAM file was not yet flushed: in the same host boot the file is whole
    /// (the page cache outlives processes) and is flushed now; after a reboot it may be torn, so the
    /// sandbox keeps only its disk and its next resume cold-boots (as a filesystem-only pause).
    fn settle_unflushed_ram(&self, id: &str, rec: &mut VmRecord) {
        let same_boot = rec.ram_boot_id == k3_common::machine::boot_id();
        if same_boot
            && std::fs::File::open(&rec.ram_file)
                .and_then(|f| f.sync_data())
                .is_ok()
        {
            rec.ram_boot_id = None;
        } else {
            tracing::warn!(sandbox = %id, "the host restarted before this paused sandbox's memory reached the disk: it resumes by a cold boot from its disk");
            crate::lifecycle::pause_fs::drop_memory(&self.inner, id, rec);
        }
        if let Err(e) = persist::write(&self.inner.record_path(id), rec) {
            tracing::warn!(sandbox = %id, error = %e, "recording a settled RAM file failed");
        }
    }
}
