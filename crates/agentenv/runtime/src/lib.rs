//! agentenv sandbox runtime: microVMs for agent sandboxes. Rooms, lowest first (a room never uses a
//! higher one):
//!
//! - [`net`]: a network namespace, tap and nftables rules per sandbox, and its resolver.
//! - [`vmm`]: the VMM traits; [`vmm::qemu`] implements them with QEMU `-M microvm` over QMP, KVM where a
//!   probe guest boots, TCG otherwise; per-VM uids, cgroups, the guest kernel, lazily served disks.
//! - [`image`]: debootstrap userland + guest agent as ext4, booted once into a base snapshot.
//! - [`sync`]: publishing templates and snapshots to the chunk store's bucket, and importing them.
//! - [`lifecycle`]: sandboxes on [`Runtime`]: `create` restores a snapshot (no cold boot), `pause` saves
//!   the device state, snapshots, forks, warm VMs, recovery after a restart.
//!
//! Beside them: [`persist`] (versioned records written atomically), the template and snapshot records
//! (`catalog`), and [`agent`] (the host side of the guest agent's port).
//!
//! Invariant: this crate knows no HTTP routes or E2B JSON beyond the envd `/health` and `/init` probes.

pub mod agent;
pub mod bench;
mod catalog;
pub mod config;
pub mod error;
pub mod fsops;
pub mod image;
pub mod lifecycle;
pub mod net;
pub mod persist;
pub(crate) mod sparse;
pub mod sync;
pub mod vmm;

use crate::image::template;
use crate::lifecycle::{prepared, sandbox, snapshot, warm};
use crate::sync::template_store;
use crate::vmm::{accel, kernel, lazy, qemu};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

pub(crate) use agentenv_vm::valid_id;
pub use agentenv_vm::{CreateSpec, RecoveredVm, SandboxVm, VmState};
pub use config::{Accel, AccelKind, LazyDiskMode, RuntimeConfig};
pub use error::{
    ConnectError, CreateError, KillError, OpenError, PauseError, RecoverError, ResumeError,
    SnapshotError, TemplateError,
};
pub use image::template::{BuildProgress, BuildStep, TemplateSpec};
pub use lifecycle::snapshot::{SnapshotInfo, SnapshotMode};
pub use persist::TemplateInfo;

use crate::persist::TemplateRecord;
use crate::vmm::Vmm;
use crate::vmm::kernel::GuestKernel;

/// The sandbox runtime. Cheap to clone; all clones share the same VMs.
#[derive(Clone)]
pub struct Runtime {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) cfg: RuntimeConfig,
    pub(crate) vmm: Arc<dyn Vmm>,
    pub(crate) kernel: GuestKernel,
    /// `cache_dir()/agentenv`.
    pub(crate) cache: PathBuf,
    /// Template and snapshot records.
    pub(crate) catalog: catalog::Catalog,
    /// Snapshots as content-addressed chunks (incremental, shared, optionally in S3).
    pub(crate) store: Arc<agentenv_store::ChunkStore>,
    pub(crate) sandboxes: sandbox::Slots,
    /// Sandbox networking; `None` with the reason in `net_off`.
    pub(crate) net: Option<Arc<net::Network>>,
    pub(crate) net_off: String,
    /// RAM copies and overlays made ahead of creates.
    pub(crate) prepared: Arc<prepared::Prepared>,
    /// VMs restored ahead of creates.
    pub(crate) warm: warm::WarmPool,
    /// NBD exports of lazily served disks.
    pub(crate) lazy: Arc<lazy::LazyDisks>,
    /// Snapshots are stored as chunks one at a time: a burst of snapshots does not become a burst of
    /// hashing threads that, together, outweigh the requests their lower priority yields to.
    pub(crate) ingests: tokio::sync::Mutex<()>,
}

/// Every 2 s, rotates the serial console log and QEMU's own log of each VM above
/// [`vmm::CONSOLE_LOG_MAX`] (a guest that prints, or makes QEMU complain, without end fills no disk).
/// Ends with the runtime.
fn spawn_console_rotation(inner: std::sync::Weak<Inner>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(2));
        loop {
            tick.tick().await;
            let Some(inner) = inner.upgrade() else { return };
            let sandboxes = inner
                .sandboxes
                .ids()
                .into_iter()
                .map(|id| inner.sandbox_dir(&id));
            // Sandboxes on warm VMs keep their logs in the VM's folder.
            let warm = std::fs::read_dir(inner.warm.dir())
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path());
            for dir in sandboxes.chain(warm) {
                for name in [vmm::CONSOLE_LOG, vmm::QEMU_LOG] {
                    let log = dir.join(name);
                    if let Err(e) = vmm::rotate_console_log(&log, vmm::CONSOLE_LOG_MAX) {
                        tracing::warn!(log = %log.display(), error = %e, "log rotation failed");
                    }
                }
            }
        }
    });
}

impl Runtime {
    /// Opens the runtime on `cfg.state_dir`: prepares the guest kernel (cached), picks the accelerator
    /// (probing KVM once for [`Accel::Auto`]) and loads template records. Call [`Runtime::recover`] next to
    /// pick up sandboxes from a previous process.
    pub async fn open(cfg: RuntimeConfig) -> Result<Runtime, OpenError> {
        let state_err = |path: &PathBuf| {
            let path = path.clone();
            move |source| OpenError::StateDir { path, source }
        };
        // Guest RAM, disks, records and sockets hold the sandboxes' data and tokens: everything this
        // process and its QEMU children create is private (files 0600, folders 0700).
        // SAFETY: umask(2) only sets the process's file-mode mask and cannot fail.
        unsafe { libc::umask(0o077) };
        for sub in ["templates", "sandboxes", "snapshots"] {
            let p = cfg.state_dir.join(sub);
            k3_common::fsutil::create_private_dir(&p).map_err(state_err(&p))?;
        }
        if let Some(r) = &cfg.ram_dir {
            k3_common::fsutil::create_private_dir(r).map_err(state_err(r))?;
        }
        let cache = k3_common::fsutil::cache_dir().join("agentenv");
        // 0700, also when it exists: unpacked image layers (setuid files, devices) and templates live here.
        k3_common::fsutil::create_private_dir(&cache).map_err(state_err(&cache))?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o700))
                .map_err(state_err(&cache))?;
        }
        let c = cache.clone();
        let orphans = tokio::task::spawn_blocking(move || template::sweep_stale_builds(&c))
            .await
            .unwrap_or(0);
        if orphans > 0 {
            tracing::warn!(
                killed = orphans,
                "killed the QEMUs of template builds whose server is gone"
            );
        }
        let c = cache.clone();
        let kernel = tokio::task::spawn_blocking(move || kernel::prepare(&c))
            .await
            .map_err(|e| OpenError::StateDir {
                path: cache.clone(),
                source: std::io::Error::other(e),
            })??;
        let accel = accel::choose(&cfg, &kernel, &cache).await;
        let mut templates = BTreeMap::new();
        let tdir = cfg.state_dir.join("templates");
        for e in std::fs::read_dir(&tdir)
            .map_err(state_err(&tdir))?
            .flatten()
        {
            let rec_path = e.path().join("template.json");
            if rec_path.exists() {
                let rec: TemplateRecord = persist::read(&rec_path)?;
                templates.insert(rec.info.id.clone(), rec);
            }
        }
        let snapshots_dir = cfg.state_dir.join("snapshots");
        let snapshots = snapshot::load_all(&snapshots_dir, cfg.ram_dir.as_deref())?;
        let store_cfg = cfg.store.clone().unwrap_or_else(|| {
            let mut c = agentenv_store::StoreConfig::local(
                cfg.state_dir.join("chunks"),
                config::DEFAULT_STORE_BYTES,
            );
            // Guest RAM changes in scattered pages: small chunks keep incremental snapshots small.
            c.chunk_size = config::DEFAULT_CHUNK_BYTES;
            c
        });
        let store = Arc::new(agentenv_store::ChunkStore::open(store_cfg).await?);
        let lazy = Arc::new(lazy::LazyDisks::new(
            store.clone(),
            template_store::nbd_dir(&cfg.state_dir),
        ));
        let vmm: Arc<dyn Vmm> = Arc::new(
            qemu::QemuVmm::new(cfg.qemu_bin.clone(), accel, cfg.qemu_uids)
                .with_tcg_tb_mib(cfg.tcg_tb_mib)
                .with_mem_merge(cfg.mem_merge)
                .with_lazy_disks(lazy.clone()),
        );
        let (net, net_off) = match &cfg.network {
            None => (None, "networking is off (`--network off`)".to_string()),
            Some(nc) => match net::Network::start(nc.clone(), &cfg.state_dir) {
                Ok(n) => {
                    n.refill();
                    (Some(n), String::new())
                }
                Err(e) if nc.required => return Err(OpenError::Network(e)),
                Err(e) => {
                    tracing::warn!(error = %e, "sandboxes get no network");
                    (None, e.to_string())
                }
            },
        };
        tracing::info!(state_dir = %cfg.state_dir.display(), accel = accel.as_str(), templates = templates.len(), snapshots = snapshots.len(), "agentenv runtime open");
        let prepared = Arc::new(prepared::Prepared::open(
            cfg.state_dir.join("prepared"),
            match &cfg.ram_dir {
                Some(d) => d.join(format!(".prepared-{}", prepared::dir_tag(&cfg.state_dir))),
                None => cfg.state_dir.join("prepared"),
            },
            prepared::Prepared::PER_IMAGE,
        ));
        let warm = warm::WarmPool::new(
            cfg.state_dir.join("vms"),
            warm::Sizes {
                per_image: cfg.warm_vms,
                max_per_image: cfg.warm_vms_max,
                max_total: cfg.max_warm_vms,
                idle: cfg.warm_idle,
            },
        );
        let inner = Arc::new(Inner {
            cfg,
            vmm,
            kernel,
            cache,
            catalog: catalog::Catalog::new(templates, snapshots, snapshots_dir),
            store,
            sandboxes: sandbox::Slots::default(),
            net,
            net_off,
            prepared,
            warm,
            lazy,
            ingests: tokio::sync::Mutex::new(()),
        });
        spawn_console_rotation(Arc::downgrade(&inner));
        Ok(Runtime { inner })
    }

    /// NBD exports of lazy disks running now (each serves every QEMU whose disk chain ends in it).
    pub async fn lazy_exports(&self) -> usize {
        self.inner.lazy.running().await
    }

    /// What the chunk store holds locally now.
    pub fn store_stats(&self) -> agentenv_store::LocalStats {
        self.inner.store.local_stats()
    }

    /// The accelerator in use (for reports).
    pub fn accel(&self) -> AccelKind {
        self.inner.vmm.accel()
    }

    /// Warm VMs ready now for creates from template or snapshot `id` ([`crate::lifecycle::warm`]).
    pub fn warm_ready(&self, id: &str) -> usize {
        self.image(id)
            .map_or(0, |image| self.inner.warm.ready_for(&image.disk))
    }

    /// All installed templates, by id.
    pub fn templates(&self) -> Vec<TemplateInfo> {
        self.inner.catalog.template_infos()
    }

    /// Builds the template described by `spec` (reusing a cached build with identical inputs) and installs it,
    /// replacing an older template with the same id for future creates. With a bucket, it is published there
    /// before the build answers, so every runtime sharing the bucket can start it at once.
    pub async fn build_template(
        &self,
        spec: TemplateSpec,
        progress: &(dyn Fn(BuildProgress) + Send + Sync),
    ) -> Result<TemplateInfo, TemplateError> {
        self.build_and_install(spec, progress, true).await
    }

    async fn build_and_install(
        &self,
        spec: TemplateSpec,
        progress: &(dyn Fn(BuildProgress) + Send + Sync),
        publish: bool,
    ) -> Result<TemplateInfo, TemplateError> {
        let rec = template::build(&self.inner, spec, progress).await?;
        let info = self.install_template(rec);
        let say = |step, detail: String| progress(BuildProgress::step(step, detail));
        if publish && self.inner.store.config().remote.is_some() {
            say(
                template::BuildStep::Publish,
                format!("storing template {} in the bucket", info.id),
            );
            self.publish_template(&info.id).await?;
        }
        say(
            template::BuildStep::Done,
            format!("template {} ready", info.id),
        );
        Ok(info)
    }

    /// Makes an installed template's record the one creates use (replacing an older one of its id).
    pub(crate) fn install_template(&self, rec: persist::TemplateRecord) -> TemplateInfo {
        self.inner.catalog.put_template(rec)
    }

    /// Returns the default template `base`, building it first if it is not installed.
    pub async fn ensure_default_template(
        &self,
        progress: &(dyn Fn(BuildProgress) + Send + Sync),
    ) -> Result<TemplateInfo, TemplateError> {
        if let Some(t) = self.inner.catalog.template("base") {
            return Ok(t.info);
        }
        // Not published here: a server publishes it in the background (a bucket down at start-up
        // must not keep the server from starting).
        self.build_and_install(TemplateSpec::base(), progress, false)
            .await
    }

    /// Current state of a sandbox, or `None` if unknown.
    pub fn vm_state(&self, id: &str) -> Option<VmState> {
        let slot = self.inner.sandboxes.get(id)?;
        let state = slot.visible_state();
        // A running sandbox whose VMM died (killed from outside, OOM, crash) has no VM any more. An
        // operation in flight holds the lock; it finds out itself.
        if state == VmState::Running
            && let Ok(live) = slot.live.try_lock()
            && live.vm.as_ref().is_some_and(|vm| !vm.alive())
        {
            return None;
        }
        Some(state)
    }

    /// Bytes sandbox `id`'s RAM file holds on disk (holes, such as pages the guest freed and reported,
    /// excluded; for a sandbox mapping a snapshot's RAM copy-on-write, that snapshot's), or `None` if
    /// unknown.
    pub async fn ram_file_bytes(&self, id: &str) -> Option<u64> {
        let slot = self.inner.sandboxes.get(id)?;
        let ram = slot.live.lock().await.record.ram_file.clone();
        Some(fsops::allocated_bytes(&ram))
    }
}
