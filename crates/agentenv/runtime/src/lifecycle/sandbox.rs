//! Sandbox lifecycle: create (restore from the template's base snapshot), pause, resume, kill, agent streams.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use agentenv_mux::MuxStream;
use tokio::task::JoinHandle;

use crate::agent::{self, AgentLink, Probe};
use crate::error::{ConnectError, CreateError, KillError, PauseError, ResumeError};
use crate::lifecycle::source::{Image, ImageStart};
use crate::persist::{self, RECORD_VERSION, SandboxPhase, VmRecord};
use crate::vmm::{DiskFormat, VmInstance, VmSpec};
use crate::{CreateSpec, Inner, Runtime, SandboxVm, VmState, valid_id};

/// How long one `/health` attempt may take before the runtime reconnects with a fresh session.
const HEALTH_ATTEMPT: Duration = Duration::from_secs(3);
/// How long the agent may take to answer after a restore.
const HEALTH_DEADLINE: Duration = Duration::from_secs(60);
/// A cold boot (filesystem snapshots) under TCG takes seconds.
pub(crate) const BOOT_ATTEMPT: Duration = Duration::from_secs(5);
pub(crate) const BOOT_DEADLINE: Duration = Duration::from_secs(120);

/// The sandboxes this runtime holds, by id.
#[derive(Default)]
pub(crate) struct Slots(std::sync::Mutex<std::collections::HashMap<String, Arc<Slot>>>);

impl Slots {
    fn map(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, Arc<Slot>>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
    pub(crate) fn get(&self, id: &str) -> Option<Arc<Slot>> {
        self.map().get(id).cloned()
    }
    pub(crate) fn ids(&self) -> Vec<String> {
        self.map().keys().cloned().collect()
    }
    pub(crate) fn all(&self) -> Vec<Arc<Slot>> {
        self.map().values().cloned().collect()
    }
    pub(crate) fn insert(&self, id: &str, slot: Arc<Slot>) {
        self.map().insert(id.to_owned(), slot);
    }
    /// Inserts `slot` unless `id` is held here or `taken()` (checked under the same lock).
    pub(crate) fn insert_new(
        &self,
        id: &str,
        slot: Arc<Slot>,
        taken: impl FnOnce() -> bool,
    ) -> bool {
        let mut map = self.map();
        if map.contains_key(id) || taken() {
            return false;
        }
        map.insert(id.to_owned(), slot);
        true
    }
    pub(crate) fn remove(&self, id: &str) {
        self.map().remove(id);
    }
}

/// One sandbox: its record and live handles, behind a lock that serialises its operations.
pub(crate) struct Slot {
    pub(crate) live: tokio::sync::Mutex<Live>,
    state: std::sync::Mutex<VmState>,
}

pub(crate) struct Live {
    pub(crate) record: VmRecord,
    pub(crate) vm: Option<Box<dyn VmInstance>>,
    pub(crate) agent: Option<AgentLink>,
    /// A VMM that is exiting after a pause; a resume waits for it.
    pub(crate) exiting: Option<JoinHandle<()>>,
    /// Set once killed, so operations queued behind the kill fail as unknown.
    pub(crate) gone: bool,
    /// Its network, held from create to kill (also while paused: the address stays).
    pub(crate) net: Option<crate::net::Attachment>,
    /// While paused: its QEMU, stopped but kept for a while, which a resume continues.
    pub(crate) kept: Option<Kept>,
}

/// A paused sandbox's QEMU, stopped after its state was committed, with its agent session. A resume
/// within [`crate::RuntimeConfig::keep_paused`] continues it (no process start, no state load, no mux
/// handshake); after that it exits and a resume restores from the committed files.
pub(crate) struct Kept {
    vm: Box<dyn VmInstance>,
    link: AgentLink,
    /// The RAM file the process maps (the record names the resume's file once the RAM went into the
    /// state).
    ram_file: PathBuf,
    expiry: JoinHandle<()>,
}

impl Kept {
    /// SIGKILLs the kept QEMU without waiting.
    pub(crate) fn kill_now(self) {
        self.expiry.abort();
        let pid = self.vm.pid();
        if pid > 0 && self.vm.alive() {
            // SAFETY: plain syscall on the pid of a QEMU this runtime started.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
    }

    /// Lets the kept QEMU exit.
    pub(crate) async fn end(self) {
        self.expiry.abort();
        if let Err(e) = self.vm.shutdown().await {
            tracing::warn!(error = %e, "VMM did not exit cleanly after pause");
        }
    }
}

impl Slot {
    pub(crate) fn new(live: Live, state: VmState) -> Arc<Slot> {
        Arc::new(Slot {
            live: tokio::sync::Mutex::new(live),
            state: std::sync::Mutex::new(state),
        })
    }
    pub(crate) fn visible_state(&self) -> VmState {
        *self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
    pub(crate) fn set_state(&self, s: VmState) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = s;
    }
}

impl Inner {
    pub(crate) fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.cfg.state_dir.join("sandboxes").join(id)
    }
    pub(crate) fn ram_file(&self, id: &str) -> PathBuf {
        match &self.cfg.ram_dir {
            Some(d) => d.join(format!("{id}.mem")),
            None => self.sandbox_dir(id).join("ram.mem"),
        }
    }
    /// Every sandbox's slot, at this moment.
    pub(crate) fn slots(&self) -> Vec<Arc<Slot>> {
        self.sandboxes.all()
    }
    pub(crate) fn spec_of(&self, rec: &VmRecord) -> VmSpec {
        let dir = rec
            .vm_dir
            .clone()
            .unwrap_or_else(|| self.sandbox_dir(&rec.id));
        let mut spec = rec.machine.spec(
            &dir,
            &rec.ram_file,
            &dir.join("disk.qcow2"),
            DiskFormat::Qcow2,
        );
        spec.ram_shared = rec.ram_shared;
        spec
    }
    pub(crate) fn record_path(&self, id: &str) -> PathBuf {
        self.sandbox_dir(id).join("sandbox.json")
    }
    pub(crate) fn device_state_path(&self, id: &str) -> PathBuf {
        self.sandbox_dir(id).join("device.state")
    }
}

/// Removes the folder of a sandbox's warm VM (and its RAM file when it is the sandbox's own).
fn remove_vm_dir(rec: &VmRecord) {
    if let Some(d) = &rec.vm_dir {
        if rec.ram_shared {
            let _ = std::fs::remove_file(&rec.ram_file);
        }
        let _ = std::fs::remove_dir_all(d);
    }
}

/// How long after a create its image's prepared files are topped up (the create itself goes first).
const REFILL_DELAY: Duration = Duration::from_millis(300);

impl Runtime {
    /// Creates a sandbox from a template (id or alias) or a snapshot (id or `name[:tag]`) and returns once
    /// the guest agent answers and has taken the host's clock, fresh entropy and `env_vars` (`/init`).
    /// Templates and memory snapshots are restored, never cold-booted; filesystem snapshots cold-boot.
    pub async fn create(&self, spec: CreateSpec) -> Result<SandboxVm, CreateError> {
        if !valid_id(&spec.sandbox_id) {
            return Err(CreateError::InvalidId(spec.sandbox_id));
        }
        let image = match self.image(&spec.template_id) {
            Some(i) => i,
            // A template published to the shared chunk store by another machine.
            None => match self.import_template(&spec.template_id).await {
                Ok(Some(_)) => self.image(&spec.template_id),
                Ok(None) => None,
                Err(e) => return Err(CreateError::Template(e)),
            }
            .ok_or_else(|| CreateError::UnknownTemplate(spec.template_id.clone()))?,
        };
        if let Some(rec) = image
            .parent
            .as_ref()
            .and_then(|p| self.inner.catalog.snapshot(p))
        {
            self.ensure_local(&rec).await.map_err(|e| CreateError::Io {
                what: "snapshot files",
                path: PathBuf::from(&rec.id),
                source: std::io::Error::other(e),
            })?;
        }
        self.create_from(&spec, &image, true).await
    }

    /// Creates sandbox `spec.sandbox_id` from `image`; `reused` (a create an API caller may repeat, not
    /// a fork) keeps files prepared for the next create from the same image ([`crate::lifecycle::prepared`]).
    pub(crate) async fn create_from(
        &self,
        spec: &CreateSpec,
        image: &Image,
        reused: bool,
    ) -> Result<SandboxVm, CreateError> {
        let inner = &self.inner;
        // Forks (`reused` false) map the capture's RAM copy-on-write where the VMM can. Other sandboxes
        // of VMs with uids of their own get a copy of the snapshot's RAM, mapped shared: saving them
        // (pause, snapshot) then leaves RAM out of the stream, and a warm pool prepares the copies.
        let cow = inner.vmm.cow_ram() && !(reused && inner.vmm.per_vm_uids());
        let image = &match &image.start {
            ImageStart::CowRam { ram, state } if !cow => Image {
                start: ImageStart::CopyRam {
                    ram: ram.clone(),
                    state: state.clone(),
                },
                ..image.clone()
            },
            _ => image.clone(),
        };
        let id = spec.sandbox_id.clone();
        let (ram_file, ram_shared) = match &image.start {
            ImageStart::CowRam { ram, .. } => (ram.clone(), false),
            ImageStart::Stream { .. } => (inner.ram_file(&id), false),
            ImageStart::CopyRam { .. } | ImageStart::Boot => (inner.ram_file(&id), true),
        };
        let record = VmRecord {
            version: RECORD_VERSION,
            id: id.clone(),
            template_id: image.template_id.clone(),
            machine: image.machine.clone(),
            ram_file,
            ram_shared,
            parent_snapshot: image.parent.clone(),
            created_at: k3_common::time::now_rfc3339(),
            phase: SandboxPhase::Starting,
            vm_dir: None,
            boot_on_resume: false,
            ram_boot_id: None,
        };
        let slot = Slot::new(
            Live {
                record: record.clone(),
                vm: None,
                agent: None,
                exiting: None,
                gone: false,
                net: None,
                kept: None,
            },
            VmState::Running,
        );
        if !inner
            .sandboxes
            .insert_new(&id, slot.clone(), || inner.sandbox_dir(&id).exists())
        {
            return Err(CreateError::AlreadyExists(id));
        }
        if reused {
            let (weak, image) = (Arc::downgrade(&self.inner), image.clone());
            let network = self.wants_warm_net(&image, spec);
            tokio::spawn(async move {
                tokio::time::sleep(REFILL_DELAY).await;
                // A dropped runtime makes nothing more (and releases its state folder at once).
                let Some(inner) = weak.upgrade() else { return };
                let rt = Runtime { inner };
                if let Some(net) = network {
                    rt.refill_warm(&image, net);
                }
                rt.inner.prepared.refill(&image.disk, image.ram_copied());
            });
        }
        let mut live = slot.live.lock().await;
        match self.create_locked(&mut live, image, spec).await {
            Ok(vm) => Ok(vm),
            Err(e) => {
                if let Some(vm) = live.vm.take() {
                    let _ = vm.kill().await;
                }
                self.release_net(&mut live);
                live.gone = true;
                inner.sandboxes.remove(&id);
                let _ = std::fs::remove_dir_all(inner.sandbox_dir(&id));
                let _ = std::fs::remove_file(inner.ram_file(&id));
                remove_vm_dir(&live.record);
                Err(e)
            }
        }
    }

    async fn create_locked(
        &self,
        live: &mut Live,
        image: &Image,
        spec: &CreateSpec,
    ) -> Result<SandboxVm, CreateError> {
        let inner = &self.inner;
        let id = &spec.sandbox_id;
        let dir = inner.sandbox_dir(id);
        let io = |what, path: &PathBuf| {
            let path = path.clone();
            move |source| CreateError::Io { what, path, source }
        };
        let t0 = std::time::Instant::now();
        // Background work (ingests, cache fills) pauses until the sandbox answers.
        let _fg = k3_common::background::foreground();
        std::fs::create_dir_all(&dir).map_err(io("create", &dir))?;
        persist::write(&inner.record_path(id), &live.record)?;
        let t_record = t0.elapsed();
        let warm_key = self
            .wants_warm_net(image, spec)
            .and_then(|network| crate::lifecycle::warm::Key::of(image, network));
        if let Some(key) = &warm_key {
            inner.warm.record_create(key);
        }
        if let Some(key) = &warm_key
            && let Some(w) = inner.warm.take(key)
        {
            let r = self.create_warm(live, image, spec, w).await;
            tracing::debug!(sandbox = %id, ?t_record, initialised = ?t0.elapsed(), "create phases (warm VM)");
            return r;
        }
        if let Some(policy) = &spec.network {
            self.attach_net(live, image.machine.nic, policy.clone())
                .await?;
        }
        let t_net = t0.elapsed();
        let mut vm_spec = inner.spec_of(&live.record);
        vm_spec.tap = live.net.as_ref().map(|n| n.tap()).transpose()?;
        let ram = live.record.ram_file.clone();
        let copy = image.ram_copied().map(|src| (src, ram.as_path()));
        inner
            .prepared
            .place(&image.disk, copy, &vm_spec.disk, false)
            .await
            .map_err(|(what, source)| CreateError::Io {
                what,
                path: vm_spec.disk.clone(),
                source,
            })?;
        if let ImageStart::Stream { .. } = &image.start {
            std::fs::File::create(&ram)
                .and_then(|f| f.set_len(image.machine.memory_mib << 20))
                .map_err(io("prepare RAM", &ram))?;
        }
        let t_disk = t0.elapsed();
        let state = match &image.start {
            ImageStart::CopyRam { state, .. }
            | ImageStart::CowRam { state, .. }
            | ImageStart::Stream { state } => Some(state.clone()),
            ImageStart::Boot => None,
        };
        let link = match state {
            Some(state) => {
                let restored = inner.vmm.restore(&vm_spec, &state).await?;
                let t_restore = t0.elapsed();
                live.record.phase = SandboxPhase::Running {
                    pid: restored.vm.pid(),
                };
                let vm = live.vm.insert(restored.vm);
                persist::write(&inner.record_path(id), &live.record)?;
                vm.cont().await?;
                let t_cont = t0.elapsed();
                let probe = Probe::Init {
                    env_vars: &spec.env_vars,
                    network: live.net.as_ref().map(|n| n.guest()),
                };
                let sock = vm_spec.agent_socket();
                let first = Some(restored.agent);
                let link =
                    agent::answering(first, &sock, HEALTH_ATTEMPT, HEALTH_DEADLINE, probe).await?;
                tracing::debug!(sandbox = %id, ?t_record, ?t_net, ?t_disk, ?t_restore, ?t_cont, initialised = ?t0.elapsed(), "create phases");
                link
            }
            None => {
                let vm = inner.vmm.boot(&vm_spec).await?;
                live.record.phase = SandboxPhase::Running { pid: vm.pid() };
                live.vm = Some(vm);
                persist::write(&inner.record_path(id), &live.record)?;
                let sock = vm_spec.agent_socket();
                let link = agent::connect_healthy(&sock, BOOT_ATTEMPT, BOOT_DEADLINE).await?;
                agent::init(&link, &spec.env_vars, live.net.as_ref().map(|n| n.guest())).await?;
                link
            }
        };
        live.agent = Some(link);
        tracing::debug!(sandbox = %id, template = %image.template_id, "sandbox created");
        Ok(image.vm(id))
    }

    /// Whether a create of `spec` from `image` can take a warm VM, and then whether with a network:
    /// `None` when it cannot (it asks for a network this runtime or the template lacks, which the cold
    /// path reports).
    fn wants_warm_net(&self, image: &Image, spec: &CreateSpec) -> Option<bool> {
        let with_net = self.inner.net.is_some() && image.machine.nic;
        match &spec.network {
            None => Some(false),
            Some(_) if with_net => Some(true),
            Some(_) => None,
        }
    }

    /// Finishes a create on warm VM `w`: the sandbox takes its folder, RAM and network slot, then it
    /// runs on and takes the host's clock, fresh entropy, `env_vars` and its network (`/init`).
    async fn create_warm(
        &self,
        live: &mut Live,
        image: &Image,
        spec: &CreateSpec,
        w: crate::lifecycle::warm::WarmVm,
    ) -> Result<SandboxVm, CreateError> {
        let inner = &self.inner;
        let id = &spec.sandbox_id;
        let t0 = std::time::Instant::now();
        live.record.vm_dir = Some(w.dir.clone());
        live.record.ram_file = w.ram_file.clone();
        live.record.ram_shared = w.ram_shared;
        live.record.phase = SandboxPhase::Running { pid: w.vm.pid() };
        live.vm = Some(w.vm);
        if let (Some(mut att), Some(net)) = (w.net, &inner.net) {
            net.reown(&mut att, &inner.sandbox_dir(id));
            let policy = spec.network.clone().unwrap_or_default();
            let slot = att.addrs.index;
            let att = live.net.insert(att);
            if policy != att.policy() {
                net.update(att, policy.clone()).await?;
            }
            inner
                .write_net_record(id, &crate::net::NetRecord { slot, policy })
                .map_err(|(path, source)| CreateError::Io {
                    what: "write",
                    path,
                    source,
                })?;
        }
        let t_net = t0.elapsed();
        persist::write(&inner.record_path(id), &live.record)?;
        let t_record = t0.elapsed();
        if let Some(vm) = &live.vm {
            vm.set_background(false);
            vm.cont().await?;
        }
        let t_cont = t0.elapsed();
        agent::init(
            &w.link,
            &spec.env_vars,
            live.net.as_ref().map(|n| n.guest()),
        )
        .await?;
        tracing::debug!(sandbox = %id, ?t_net, ?t_record, ?t_cont, t_init = ?t0.elapsed(), "warm VM taken");
        live.agent = Some(w.link);
        Ok(image.vm(id))
    }

    /// The template or live snapshot with id `id` (names and aliases are resolved by the caller).
    pub(crate) fn image(&self, id: &str) -> Option<Image> {
        if let Some(tpl) = self.inner.catalog.template(id) {
            return Some(Image {
                template_id: tpl.info.id.clone(),
                machine: tpl.machine.clone(),
                disk: tpl.base_disk.clone(),
                start: ImageStart::CopyRam {
                    ram: tpl.base_ram.clone(),
                    state: tpl.base_state.clone(),
                },
                parent: None,
                envd_version: tpl.info.envd_version.clone(),
            });
        }
        self.inner.catalog.snapshot(id).map(|s| s.image())
    }

    pub(crate) fn slot(&self, id: &str) -> Option<Arc<Slot>> {
        self.inner.sandboxes.get(id)
    }

    /// Pauses a running sandbox: stop, save the device state (RAM is already in its file), commit the
    /// record. Memory, processes and files survive, also across a server restart. The stopped QEMU
    /// stays for [`crate::RuntimeConfig::keep_paused`] (a resume meanwhile continues it), then exits.
    pub async fn pause(&self, id: &str) -> Result<(), PauseError> {
        let slot = self
            .slot(id)
            .ok_or_else(|| PauseError::NotFound(id.into()))?;
        let mut live = slot.live.lock().await;
        if live.gone {
            return Err(PauseError::NotFound(id.into()));
        }
        let Some(vm) = live.vm.take() else {
            return Err(PauseError::AlreadyPaused(id.into()));
        };
        let (ram_before, link) = (live.record.ram_file.clone(), live.agent.clone());
        let r = async {
            vm.stop().await?;
            k3_common::crash::kill_vm_point("runtime:pause:after-stop", vm.pid());
            let state = self.inner.device_state_path(id);
            let tmp = state.with_extension("state.tmp");
            // Saved with the agent connected: see `create` (connect before `cont`).
            vm.save_device_state(&tmp).await?;
            if !live.record.ram_shared {
                // The RAM is in this stream: durable before the record says paused. A shared RAM
                // file and its state are flushed after the answer instead (see below).
                std::fs::File::open(&tmp)
                    .and_then(|f| f.sync_all())
                    .map_err(|e| PauseError::Io {
                        what: "fsync",
                        path: tmp.clone(),
                        source: e,
                    })?;
            }
            k3_common::crash::point("runtime:pause:after-save");
            k3_common::crash::kill_vm_point("runtime:pause:after-save", vm.pid());
            live.agent = None;
            // The RAM file is the paused state: safe from a crash of this process (and of QEMU) once
            // the record says paused; flushed to the disk after the answer
            // ([`Runtime::flush_paused_ram`]).
            live.record.ram_boot_id = live
                .record
                .ram_shared
                .then(k3_common::machine::boot_id)
                .flatten();
            std::fs::rename(&tmp, &state).map_err(|e| PauseError::Io {
                what: "rename",
                path: state.clone(),
                source: e,
            })?;
            if !live.record.ram_shared {
                // The RAM went into the state; a resume loads it into a private mapping of our own file.
                live.record.ram_file = self.inner.ram_file(id);
            }
            live.record.phase = SandboxPhase::Paused;
            k3_common::crash::point("runtime:pause:before-record");
            persist::write(&self.inner.record_path(id), &live.record)?;
            Ok::<(), PauseError>(())
        }
        .await;
        match r {
            Ok(()) => {
                slot.set_state(VmState::Paused);
                if live.record.ram_boot_id.is_some() {
                    self.flush_paused_ram(&slot, id.to_string());
                }
                let keep = self.inner.cfg.keep_paused;
                match link {
                    Some(link) if !keep.is_zero() => {
                        let (weak, pid) = (Arc::downgrade(&slot), vm.pid());
                        let expiry = tokio::spawn(async move {
                            tokio::time::sleep(keep).await;
                            let Some(slot) = weak.upgrade() else { return };
                            let kept = {
                                let mut live = slot.live.lock().await;
                                match &live.kept {
                                    Some(k) if k.vm.pid() == pid => live.kept.take(),
                                    _ => None,
                                }
                            };
                            if let Some(k) = kept {
                                k.end().await;
                            }
                        });
                        live.kept = Some(Kept {
                            vm,
                            link,
                            ram_file: ram_before,
                            expiry,
                        });
                    }
                    _ => {
                        live.exiting = Some(tokio::spawn(async move {
                            if let Err(e) = vm.shutdown().await {
                                tracing::warn!(error = %e, "VMM did not exit cleanly after pause");
                            }
                        }));
                    }
                }
                Ok(())
            }
            Err(e) => {
                // Not committed: keep the VM running as it was.
                let _ = vm.cont().await;
                live.vm = Some(vm);
                Err(e)
            }
        }
    }

    /// Resumes a paused sandbox from its device state and RAM file (see [`Self::resume_with`]).
    pub async fn resume(&self, id: &str) -> Result<(), ResumeError> {
        self.resume_with(id, &BTreeMap::new()).await
    }

    /// Resumes a paused sandbox from its device state and RAM file, or, paused without memory, by a
    /// cold boot from its disk that then takes `env_vars` (`/init`); returns when the agent answers.
    pub async fn resume_with(
        &self,
        id: &str,
        env_vars: &BTreeMap<String, String>,
    ) -> Result<(), ResumeError> {
        let slot = self
            .slot(id)
            .ok_or_else(|| ResumeError::NotFound(id.into()))?;
        let mut live = slot.live.lock().await;
        if live.gone {
            return Err(ResumeError::NotFound(id.into()));
        }
        if live.vm.is_some() {
            return Err(ResumeError::NotPaused(id.into()));
        }
        if let Some(k) = live.kept.take() {
            if k.vm.alive() {
                return self.resume_kept(&slot, &mut live, k).await;
            }
            k.end().await;
        }
        if let Some(h) = live.exiting.take() {
            let _ = h.await;
        }
        let mut spec = self.inner.spec_of(&live.record);
        spec.tap = live.net.as_ref().map(|n| n.tap()).transpose()?;
        if live.record.boot_on_resume {
            return self.resume_boot(&slot, &mut live, &spec, env_vars).await;
        }
        if !spec.ram_shared {
            let size = spec.memory_mib << 20;
            std::fs::File::create(&spec.ram_file)
                .and_then(|f| f.set_len(size))
                .map_err(|e| ResumeError::Io {
                    what: "create",
                    path: spec.ram_file.clone(),
                    source: e,
                })?;
        }
        let restored = self
            .inner
            .vmm
            .restore(&spec, &self.inner.device_state_path(id))
            .await?;
        let (vm, sock) = (restored.vm, restored.agent);
        if let Err(e) = vm.cont().await {
            let _ = vm.kill().await;
            return Err(e.into());
        }
        live.record.phase = SandboxPhase::Running { pid: vm.pid() };
        live.vm = Some(vm);
        let committed = persist::write(&self.inner.record_path(id), &live.record);
        if let Err(e) = committed {
            if let Some(vm) = live.vm.take() {
                let _ = vm.kill().await;
            }
            live.record.phase = SandboxPhase::Paused;
            return Err(e.into());
        }
        slot.set_state(VmState::Running);
        let _ = std::fs::remove_file(self.inner.device_state_path(id));
        let env_vars = Default::default();
        let probe = Probe::Init {
            env_vars: &env_vars,
            network: live.net.as_ref().map(|n| n.guest()),
        };
        let socket = spec.agent_socket();
        let link =
            agent::answering(Some(sock), &socket, HEALTH_ATTEMPT, HEALTH_DEADLINE, probe).await?;
        live.agent = Some(link);
        Ok(())
    }

    /// Resumes a paused sandbox by continuing its kept QEMU, then `/init` (host clock, fresh entropy).
    async fn resume_kept(&self, slot: &Slot, live: &mut Live, k: Kept) -> Result<(), ResumeError> {
        let id = live.record.id.clone();
        k.expiry.abort();
        let before = (live.record.ram_file.clone(), live.record.phase);
        live.record.ram_file = k.ram_file.clone();
        live.record.phase = SandboxPhase::Running { pid: k.vm.pid() };
        if let Err(e) = persist::write(&self.inner.record_path(&id), &live.record) {
            (live.record.ram_file, live.record.phase) = before;
            k.end().await;
            return Err(e.into());
        }
        let vm = live.vm.insert(k.vm);
        vm.cont().await?;
        slot.set_state(VmState::Running);
        let _ = std::fs::remove_file(self.inner.device_state_path(&id));
        agent::init(
            &k.link,
            &Default::default(),
            live.net.as_ref().map(|n| n.guest()),
        )
        .await?;
        live.agent = Some(k.link);
        Ok(())
    }

    /// Kills a sandbox (running or paused) and removes its files.
    pub async fn kill(&self, id: &str) -> Result<(), KillError> {
        let slot = self
            .slot(id)
            .ok_or_else(|| KillError::NotFound(id.into()))?;
        let mut live = slot.live.lock().await;
        if live.gone {
            return Err(KillError::NotFound(id.into()));
        }
        live.gone = true;
        live.agent = None;
        if let Some(vm) = live.vm.take() {
            vm.kill().await?;
        }
        if let Some(k) = live.kept.take() {
            k.expiry.abort();
            k.vm.kill().await?;
        }
        if let Some(h) = live.exiting.take() {
            let _ = h.await;
        }
        self.release_net(&mut live);
        self.inner.sandboxes.remove(id);
        let dir = self.inner.sandbox_dir(id);
        // The record goes first, so a crash mid-removal leaves no record pointing at half-removed files.
        let _ = std::fs::remove_file(self.inner.record_path(id));
        remove_vm_dir(&live.record);
        // A private mapping of a snapshot's RAM is not ours to remove.
        let _ = std::fs::remove_file(self.inner.ram_file(id));
        std::fs::remove_dir_all(&dir).map_err(|e| KillError::Io {
            path: dir,
            source: e,
        })?;
        self.collect_snapshots();
        Ok(())
    }

    /// Runs one command in sandbox `id` through envd `/exec` (see [`agent::exec_on`]).
    pub async fn exec(
        &self,
        id: &str,
        req: &agentenv_envd::ExecRequest,
        deadline: std::time::Duration,
        on_event: impl FnMut(agentenv_envd::ExecEvent) + Send,
    ) -> Result<(i32, String), ConnectError> {
        let s = self.open_agent_stream(id).await?;
        Ok(agent::exec_on(s, req, deadline, on_event).await?)
    }

    /// Opens one stream to envd in the guest (carry one HTTP/1.1 connection on it). Reconnects the mux
    /// session once if the previous one has ended.
    pub async fn open_agent_stream(&self, id: &str) -> Result<MuxStream, ConnectError> {
        let slot = self
            .slot(id)
            .ok_or_else(|| ConnectError::NotFound(id.into()))?;
        let mut live = slot.live.lock().await;
        if live.gone {
            return Err(ConnectError::NotFound(id.into()));
        }
        if live.vm.is_none() {
            return Err(ConnectError::Paused(id.into()));
        }
        if let Some(link) = live.agent.as_ref().filter(|l| l.is_alive())
            && let Ok(s) = link.open().await
        {
            return Ok(s);
        }
        let link = self.inner.reconnect(&live.record).await?;
        let s = link.open().await.map_err(agent::AgentError::from)?;
        live.agent = Some(link);
        Ok(s)
    }
}

impl Inner {
    /// A fresh session with the agent of running sandbox `rec` once it answers `/health`.
    pub(crate) async fn reconnect(&self, rec: &VmRecord) -> Result<AgentLink, agent::AgentError> {
        let sock = self.spec_of(rec).agent_socket();
        agent::connect_healthy(&sock, HEALTH_ATTEMPT, HEALTH_DEADLINE).await
    }
}
