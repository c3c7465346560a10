//! Runtime configuration and accelerator choice.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Which accelerator the caller asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Accel {
    /// KVM when a probe guest really boots under it (verdict cached), TCG otherwise.
    #[default]
    Auto,
    /// KVM, without probing (fails at boot where KVM cannot run the guest).
    Kvm,
    /// QEMU TCG software emulation.
    Tcg,
}

/// The accelerator actually in use: k3-common's [`k3_common::kvm::Accel`] (`as_str` gives QEMU's
/// `-accel` name).
pub type AccelKind = k3_common::kvm::Accel;

/// Whether disks this node lacks are served block by block from the chunk store ([`crate::vmm::lazy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum LazyDiskMode {
    /// A template imported from the chunk store keeps its disk there, served to QEMU over NBD.
    #[default]
    Auto,
    /// Imports copy the whole disk here first.
    Off,
}

/// Configuration of a [`crate::Runtime`].
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// Folder for templates, sandboxes and their records (created if missing). Survives restarts.
    pub state_dir: PathBuf,
    /// Accelerator choice.
    pub accel: Accel,
    /// The `agentenv-guest` binary put into template rootfs images. `None`: env `AGENTENV_GUEST_BIN`,
    /// else `target/{release,debug}/agentenv-guest` of the running executable's target folder.
    pub guest_bin: Option<PathBuf>,
    /// QEMU system emulator binary.
    pub qemu_bin: PathBuf,
    /// `qemu-img` binary (qcow2 overlays).
    pub qemu_img_bin: PathBuf,
    /// Folder for guest RAM files. `None`: `<state_dir>/` (persistent across host reboots);
    /// a tmpfs folder such as /dev/shm makes create and pause cheaper but loses paused RAM on reboot.
    pub ram_dir: Option<PathBuf>,
    /// Where snapshots are kept as content-addressed chunks (and optionally an S3 bucket).
    /// `None`: a local store in `<state_dir>/chunks` bounded at [`DEFAULT_STORE_BYTES`].
    pub store: Option<agentenv_store::StoreConfig>,
    /// uids to run QEMU processes as, one per VM ([`crate::vmm::uid`]); used only when this process is
    /// root. `None`: QEMU runs as this process.
    pub qemu_uids: Option<crate::vmm::uid::UidRange>,
    /// Sandbox networking ([`crate::net`]). `None`: sandboxes get no network.
    pub network: Option<crate::net::NetConfig>,
    /// VMs kept restored and stopped per image once it has been used, so a create only continues one
    /// ([`crate::lifecycle::warm`]). 0: every create restores.
    pub warm_vms: usize,
    /// Most warm VMs per image while its creates come in bursts ([`crate::lifecycle::warm`]); below `warm_vms`
    /// counts as `warm_vms`.
    pub warm_vms_max: usize,
    /// Most warm VMs of all images together (the server's, counted against no key): the least recently
    /// used images' pools are drained first to stay within it. 0: none are kept.
    pub max_warm_vms: usize,
    /// An image with no create for this long keeps no warm VM.
    pub warm_idle: std::time::Duration,
    /// How long a paused sandbox's QEMU stays, stopped, so that a resume only continues it
    /// ([`crate::Runtime::pause`]). Zero: it exits at once.
    pub keep_paused: std::time::Duration,
    /// Lazy disks for templates imported from the chunk store.
    pub lazy_disks: LazyDiskMode,
    /// Internal address ranges image pulls may reach (`--registry-allow`); by default none
    /// (`agentenv_oci::guard`).
    pub registry_allow: Vec<agentenv_oci::AllowedNet>,
    /// Size cap in MiB of each QEMU's TCG translation cache (`-accel tcg,tb-size=N`); ignored under KVM.
    /// `None` (the default): QEMU's own (1 GiB on 64-bit hosts in QEMU 7.2, touched only as guest code
    /// is translated). Not part of a VM's saved state: snapshots restore under any value. No cap is the
    /// default because an idle fork's cache holds only ~25 MiB of translated code: 32 MiB changes
    /// nothing, and smaller caps flush and retranslate on every command (measured on the 2-core TCG
    /// box, docs/benchmarks.md 2026-12-06: 16 MiB takes PSS per idle fork 50 to 42 MiB with the first
    /// command after a create +65 %; 4 MiB reaches 28 MiB with fork x8 +57 % and commands 7x slower).
    pub tcg_tb_mib: Option<u32>,
    /// Lets the host's KSM merge identical pages of the VMs: guest RAM (the memory backend's `merge`)
    /// and QEMU's own memory (`PR_SET_MEMORY_MERGE`, Linux 6.4+). Off by default, and then guest RAM is
    /// marked unmergeable (QEMU's default merges it): merged pages across tenants are a timing side
    /// channel. Takes effect only where the host runs KSM (`/sys/kernel/mm/ksm/run` = 1).
    pub mem_merge: bool,
}

/// Default of [`RuntimeConfig::max_warm_vms`].
pub const DEFAULT_MAX_WARM_VMS: usize = 16;
/// Default of [`RuntimeConfig::warm_idle`]: 10 minutes.
pub const DEFAULT_WARM_IDLE: std::time::Duration = std::time::Duration::from_secs(600);
/// Default of [`RuntimeConfig::tcg_tb_mib`].
pub const DEFAULT_TCG_TB_MIB: Option<u32> = None;
/// Bound of the default local chunk store.
pub const DEFAULT_STORE_BYTES: u64 = 32 << 30;
/// Chunk size of RAM files in a store without a bucket: a guest page. A guest's RAM changes in scattered
/// pages: measured on a snapshot after a 1 MiB write, 4 KiB chunks store 2.0 MB of RAM changes, 8 KiB
/// 3.4 MB, 16 KiB 6.1 MB. With a bucket, RAM uses the store's chunk size: a cold restore reads packs
/// either way, but 4 KiB chunks mean four times the chunk files and manifest entries (measured with packs,
/// SeaweedFS on loopback, 2 cores: create from the bucket 823 vs 625 ms, ingest 6.0 vs 4.4 s).
pub const RAM_CHUNK_BYTES: usize = 4 << 10;
/// Chunk size of the default store, for disks and device state (and RAM files with a bucket).
pub const DEFAULT_CHUNK_BYTES: usize = 16 << 10;

impl RuntimeConfig {
    /// A configuration with defaults (Auto accel, QEMU from PATH) for `state_dir`.
    pub fn new(state_dir: impl Into<PathBuf>) -> RuntimeConfig {
        RuntimeConfig {
            state_dir: state_dir.into(),
            accel: Accel::Auto,
            guest_bin: None,
            qemu_bin: PathBuf::from("qemu-system-x86_64"),
            qemu_img_bin: PathBuf::from("qemu-img"),
            ram_dir: None,
            store: None,
            qemu_uids: Some(crate::vmm::uid::UidRange::default()),
            network: None,
            warm_vms: 2,
            warm_vms_max: 8,
            max_warm_vms: DEFAULT_MAX_WARM_VMS,
            warm_idle: DEFAULT_WARM_IDLE,
            keep_paused: std::time::Duration::from_secs(30),
            lazy_disks: LazyDiskMode::Auto,
            registry_allow: Vec::new(),
            tcg_tb_mib: DEFAULT_TCG_TB_MIB,
            mem_merge: false,
        }
    }
}

/// Debian mirror used by debootstrap (override with env `AGENTENV_DEBIAN_MIRROR`).
pub const MIRROR: &str = "http://deb.debian.org/debian";

/// The Debian mirror: env `AGENTENV_DEBIAN_MIRROR`, else [`MIRROR`].
pub fn mirror() -> String {
    std::env::var("AGENTENV_DEBIAN_MIRROR")
        .ok()
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| MIRROR.into())
}
