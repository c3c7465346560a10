//! What a pause keeps on the disk: filesystem-only pauses (E2B's `pause(keep_memory=False)`: only the
//! disk is kept, and the next resume cold-boots the sandbox from it), and the delayed flush of a memory
//! pause's RAM file.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

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

/// How long a paused sandbox's RAM file waits for its flush: a resume within it needs none (and would
/// otherwise wait on pages being written back).
const RAM_FLUSH_DELAY: Duration = Duration::from_secs(2);

impl Runtime {
    /// Flushes the RAM file and device state of paused sandbox `id` to the disk after [`RAM_FLUSH_DELAY`] unless it
    /// resumed, then records it flushed (while the sandbox is still paused on that file). Until then a
    /// host power loss could tear it: recovery after a reboot cold-boots such a sandbox from its disk. A
    /// runtime dropped meanwhile writes nothing (the next one settles it).
    pub(crate) fn flush_paused_ram(&self, slot: &Arc<Slot>, id: String) {
        let (inner, slot) = (Arc::downgrade(&self.inner), Arc::downgrade(slot));
        tokio::spawn(async move {
            tokio::time::sleep(RAM_FLUSH_DELAY).await;
            let (Some(inner), Some(slot)) = (inner.upgrade(), slot.upgrade()) else {
                return;
            };
            let ram = {
                let live = slot.live.lock().await;
                if live.gone || live.record.phase != SandboxPhase::Paused {
                    return;
                }
                live.record.ram_file.clone()
            };
            let (path, state) = (ram.clone(), inner.device_state_path(&id));
            let synced = tokio::task::spawn_blocking(move || {
                std::fs::File::open(&state)?.sync_all()?;
                std::fs::File::open(&path)?.sync_data()
            })
            .await;
            if let Err(e) = synced.map_err(std::io::Error::other).and_then(|r| r) {
                tracing::warn!(sandbox = %id, error = %e, "flushing a paused sandbox's RAM file failed");
                return;
            }
            let mut live = slot.live.lock().await;
            if live.gone
                || live.record.phase != SandboxPhase::Paused
                || live.record.ram_file != ram
                || live.record.ram_boot_id.is_none()
            {
                return;
            }
            live.record.ram_boot_id = None;
            if let Err(e) = persist::write(&inner.record_path(&id), &live.record) {
                tracing::warn!(sandbox = %id, error = %e, "recording a flushed RAM file failed");
            }
        });
    }
}
