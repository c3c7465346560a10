//! The VMM boundary: what the lifecycle code needs from a virtual machine monitor.
//!
//! Capabilities are layered like cloud-hypervisor's: every [`VmInstance`] is [`Pausable`] and
//! [`Snapshottable`]; a [`Vmm`] starts instances by cold boot, by restore from a saved device state, or
//! re-attaches to one that outlived the process that started it. [`crate::qemu::QemuVmm`] is the only
//! backend here; a Firecracker backend would implement the same traits on standard-KVM hosts.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;

use crate::config::AccelKind;
use crate::qmp::QmpError;

/// A boxed, sendable future (keeps the traits object-safe).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Disk image format of the root disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskFormat {
    /// A raw ext4 image (the template's base disk).
    Raw,
    /// A qcow2 overlay over the base disk (one per sandbox).
    Qcow2,
}

/// Everything needed to start one VM. A restore must use the same machine shape as the saved VM.
#[derive(Debug, Clone)]
pub struct VmSpec {
    /// Per-VM folder for the QMP socket, the agent socket and logs.
    pub dir: PathBuf,
    /// Uncompressed kernel (PVH ELF).
    pub kernel: PathBuf,
    /// Initramfs (newc cpio).
    pub initrd: PathBuf,
    /// Kernel command line.
    pub cmdline: String,
    /// Number of vCPUs.
    pub vcpus: u32,
    /// Guest RAM size in MiB.
    pub memory_mib: u64,
    /// File backing guest RAM.
    pub ram_file: PathBuf,
    /// `true`: `ram_file` is mapped shared and holds the VM's RAM (a device-state save leaves RAM out).
    /// `false`: mapped private copy-on-write (a snapshot's RAM shared by forks); saves carry the RAM.
    pub ram_shared: bool,
    /// Root disk image.
    pub disk: PathBuf,
    /// Format of `disk`.
    pub disk_format: DiskFormat,
}

impl VmSpec {
    /// QMP control socket of the VM.
    pub fn qmp_socket(&self) -> PathBuf {
        self.dir.join("qmp.sock")
    }
    /// Unix socket of the virtio-serial port `agentenv.0` (the guest agent channel).
    pub fn agent_socket(&self) -> PathBuf {
        self.dir.join("agent.sock")
    }
    /// Serial console log.
    pub fn console_log(&self) -> PathBuf {
        self.dir.join("console.log")
    }
}

/// Errors of VMM operations.
#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    /// The VMM process could not be started.
    #[error("cannot start {bin}: {source}")]
    Spawn { bin: String, source: std::io::Error },
    /// The VMM process exited early.
    #[error("VMM exited during {during}: {detail}")]
    Exited {
        during: &'static str,
        detail: String,
    },
    /// A QMP command failed.
    #[error(transparent)]
    Qmp(#[from] QmpError),
    /// A file operation on the VM's files failed.
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// A socket path is longer than a unix socket address allows.
    #[error("socket path too long ({len} bytes, max 107): {path}")]
    SocketPath { path: PathBuf, len: usize },
    /// The process to re-attach is gone or is not this VM.
    #[error("VM process {pid} is not running")]
    NotRunning { pid: u32 },
}

/// Stop and continue the vCPUs.
pub trait Pausable {
    /// Stops the vCPUs (memory and devices stay as they are).
    fn stop(&self) -> BoxFuture<'_, Result<(), VmmError>>;
    /// Continues the vCPUs.
    fn cont(&self) -> BoxFuture<'_, Result<(), VmmError>>;
}

/// Save the device state of a stopped VM; guest RAM stays in its shared RAM file.
pub trait Snapshottable: Pausable {
    /// Writes the device state to `path` (x-ignore-shared: shared RAM stays in [`VmSpec::ram_file`],
    /// private RAM goes into the stream). The VM must be stopped.
    fn save_device_state<'a>(&'a self, path: &'a Path) -> BoxFuture<'a, Result<(), VmmError>>;
}

/// One running VMM process.
pub trait VmInstance: Snapshottable + Send + Sync {
    /// Process id of the VMM.
    fn pid(&self) -> u32;
    /// The spec it was started with.
    fn spec(&self) -> &VmSpec;
    /// Asks the VMM to exit (flushing disks) and waits until it is gone.
    fn shutdown(&self) -> BoxFuture<'_, Result<(), VmmError>>;
    /// Kills the VMM process at once and waits until it is gone.
    fn kill(&self) -> BoxFuture<'_, Result<(), VmmError>>;
}

/// A restored, still stopped VM and its connected agent channel.
pub struct Restored {
    /// The VM (stopped).
    pub vm: Box<dyn VmInstance>,
    /// The host end of the `agentenv.0` port, connected before the device state was loaded.
    pub agent: tokio::net::UnixStream,
}

/// A virtual machine monitor backend.
pub trait Vmm: Send + Sync {
    /// The accelerator this backend runs guests with.
    fn accel(&self) -> AccelKind;
    /// Cold-boots a VM (RAM file created or truncated to size).
    fn boot<'a>(&'a self, spec: &'a VmSpec)
    -> BoxFuture<'a, Result<Box<dyn VmInstance>, VmmError>>;
    /// Starts a VM from `spec.ram_file` plus a saved device state and leaves it stopped; the caller
    /// calls [`Pausable::cont`]. The agent socket is connected before the state loads, so the guest's
    /// port keeps its "host connected" state (it was saved connected) and sees no close/open.
    fn restore<'a>(
        &'a self,
        spec: &'a VmSpec,
        device_state: &'a Path,
    ) -> BoxFuture<'a, Result<Restored, VmmError>>;
    /// Re-attaches to a VM process started earlier (for example by a previous server process).
    fn attach<'a>(
        &'a self,
        spec: &'a VmSpec,
        pid: u32,
    ) -> BoxFuture<'a, Result<Box<dyn VmInstance>, VmmError>>;
}
