//! Filesystem-only pauses (E2B's `pause(keep_memory=False)`): only the disk is kept, and the next
//! resume cold-boots the sandbox from it.

use std::collections::BTreeMap;

use crate::agent;
use crate::error::{PauseError, ResumeError};
use crate::lifecycle::sandbox::{BOOT_ATTEMPT, BOOT_DEADLINE, Live, Slot};
use crate::persist::{self, SandboxPhase, VmRecord};
use crate::vmm::VmSpec;
use crate::{Inner, Runtime, VmState};

impl Runtime {
    /// Pauses sandbox `id` keeping only its disk (E2B's filesystem-only pause): the guest's writes are
    /// flushed (`/sync`), its QEMU quits, its RAM is dropped; [`Self::resume`] cold-boots it.
    pub async fn pause_filesystem(&self, id: &str) -> Result<(), PauseError> {
        let slot = self
            .slot(id)
            .ok_or_else(|| PauseError::NotFound(id.into()))?;
        let mut live = slot.live.lock().await;
        if live.gone {
            return Err(PauseError::NotFound(id.into()));
        }
        if live.vm.is_none() {
            return Err(PauseError::AlreadyPaused(id.into()));
        }
        // A guest that cannot flush is not paused: it runs on.
        let link = match live.agent.clone().filter(|l| l.is_alive()) {
            Some(l) => l,
            None => self.inner.reconnect(&live.record).await?,
        };
        agent::sync(&link).await?;
        let vm = live.vm.take().expect("checked above");
        live.agent = None;
        if let Err(e) = vm.shutdown().await {
            live.vm = Some(vm);
            return Err(e.into());
        }
        drop_memory(&self.inner, id, &mut live.record);
        live.record.phase = SandboxPhase::Paused;
        persist::write(&self.inner.record_path(id), &live.record)?;
        slot.set_state(VmState::Paused);
        Ok(())
    }
}

/// Keeps only the disk of stopped sandbox `id`: its RAM (when its own) and device state go, and its
/// next resume cold-boots.
pub(crate) fn drop_memory(inner: &Inner, id: &str, rec: &mut VmRecord) {
    let own_ram = inner.ram_file(id);
    if rec.ram_shared || rec.ram_file == own_ram {
        let _ = std::fs::remove_file(&rec.ram_file);
    }
    let _ = std::fs::remove_file(inner.device_state_path(id));
    // A cold boot makes a RAM file of its own (never the snapshot's it may have mapped).
    rec.ram_file = own_ram;
    rec.ram_shared = true;
    rec.boot_on_resume = true;
    rec.ram_boot_id = None;
}

impl Runtime {
    /// Resumes a sandbox paused without memory: a cold boot from its disk, then `/init`.
    pub(crate) async fn resume_boot(
        &self,
        slot: &Slot,
        live: &mut Live,
        spec: &VmSpec,
        env_vars: &BTreeMap<String, String>,
    ) -> Result<(), ResumeError> {
        let id = live.record.id.clone();
        let vm = self.inner.vmm.boot(spec).await?;
        live.record.phase = SandboxPhase::Running { pid: vm.pid() };
        live.record.boot_on_resume = false;
        if let Err(e) = persist::write(&self.inner.record_path(&id), &live.record) {
            let _ = vm.kill().await;
            live.record.phase = SandboxPhase::Paused;
            live.record.boot_on_resume = true;
            return Err(e.into());
        }
        live.vm = Some(vm);
        slot.set_state(VmState::Running);
        let link =
            agent::connect_healthy(&spec.agent_socket(), BOOT_ATTEMPT, BOOT_DEADLINE).await?;
        agent::init(&link, env_vars, live.net.as_ref().map(|n| n.guest())).await?;
        live.agent = Some(link);
        Ok(())
    }
}
