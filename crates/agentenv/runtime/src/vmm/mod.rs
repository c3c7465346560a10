//! The VMM boundary: what the lifecycle code needs from a virtual machine monitor.
//!
//! Capabilities are layered like cloud-hypervisor's: every [`VmInstance`] is [`Pausable`] and
//! [`Snapshottable`]; a [`Vmm`] starts instances by cold boot, by restore from a saved device state, or
//! re-attaches to one that outlived the process that started it. [`crate::vmm::qemu::QemuVmm`] is the only
//! backend here; a Firecracker backend would implement the same traits on standard-KVM hosts.

pub mod accel;
pub mod cgroup;
pub mod jail;
pub mod kernel;
pub mod launch;
pub mod lazy;
pub mod qemu;
pub mod qmp;
pub mod uid;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;

use crate::config::AccelKind;
use crate::vmm::qmp::QmpError;

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
    /// A virtio-net device (part of the machine shape: a restore must match the saved VM).
    pub nic: bool,
    /// The NIC's host side, a tap QEMU inherits; `None` leaves the NIC without a peer.
    pub tap: Option<std::sync::Arc<std::os::fd::OwnedFd>>,
    /// QEMU `-cpu` model; `None`: QEMU's default.
    pub cpu: Option<String>,
    /// A virtio-balloon device with free page reporting (machine shape, as `nic`).
    pub free_page_reporting: bool,
    /// Starts at a background CPU weight (a warm VM for the pool), until [`VmInstance::set_background`].
    pub background: bool,
}

impl VmSpec {
    /// Where QEMU creates its sockets: `<dir>/qemu/` (owned by the VM's uid), or `<dir>` itself for a
    /// QEMU started by an older version (its sockets are there and `qemu/` is not).
    pub fn socket_dir(&self) -> PathBuf {
        let new = self.dir.join(SOCKET_DIR);
        if !new.is_dir() && self.dir.join("qmp.sock").exists() {
            return self.dir.clone();
        }
        new
    }
    /// QMP control socket of the VM.
    pub fn qmp_socket(&self) -> PathBuf {
        self.socket_dir().join("qmp.sock")
    }
    /// Unix socket of the virtio-serial port `agentenv.0` (the guest agent channel).
    pub fn agent_socket(&self) -> PathBuf {
        self.socket_dir().join("agent.sock")
    }
    /// Serial console log.
    pub fn console_log(&self) -> PathBuf {
        self.dir.join(CONSOLE_LOG)
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
    /// No uid is free to start another QEMU as.
    #[error(transparent)]
    NoUid(#[from] uid::Exhausted),
    /// The process to re-attach is gone or is not this VM.
    #[error("VM process {pid} is not running")]
    NotRunning { pid: u32 },
    /// A lazily served disk of the backing chain cannot be exported.
    #[error("lazy disk {path}: {detail}")]
    LazyDisk { path: PathBuf, detail: String },
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
    /// private RAM goes into the stream), unflushed. The VM must be stopped.
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
    /// Whether the VMM process still runs (false once it died or was killed from outside).
    fn alive(&self) -> bool;
    /// Runs the VMM at a background CPU weight, or at the default again (best effort: a VMM without
    /// a CPU group of its own keeps its weight).
    fn set_background(&self, _background: bool) {}
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
    /// Whether every VM runs as a uid of its own. Such a VM can open only RAM files it owns (or is
    /// handed read-only), so creates that may be repeated get a copy of a snapshot's RAM of their own.
    fn per_vm_uids(&self) -> bool {
        false
    }
    /// Whether VMs can map a snapshot's RAM file copy-on-write (`VmSpec::ram_shared` false), so that
    /// forks share it instead of copying it.
    fn cow_ram(&self) -> bool {
        !self.per_vm_uids()
    }
    /// Whether private RAM reaches a VM as [`launch::ram_base`]'s memfd (so a capture registered there
    /// needs no file).
    fn ram_via_memfd(&self) -> bool {
        false
    }
    /// The VMM's version: saved states of one version may not load into another, so template builds
    /// are cached per version.
    fn version(&self) -> &str {
        ""
    }
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

/// The folder of a VM's sockets, in its folder: the only part of it the VM's uid owns.
pub const SOCKET_DIR: &str = "qemu";
/// Folder inside a VM's folder that a root runtime's QEMU gets as its root ([`jail`]); empty on the host.
pub const JAIL_DIR: &str = "root";
/// File name of a VM's serial console log, in its folder.
pub const CONSOLE_LOG: &str = "console.log";
/// File name of QEMU's own log (its stderr), in a VM's folder.
pub const QEMU_LOG: &str = "qemu.log";
/// A console log above this many bytes is rotated (the previous part is kept as `console.log.1`).
pub const CONSOLE_LOG_MAX: u64 = 4 << 20;

/// Copies a console log above `max` bytes to `<log>.1` (its last `max` bytes) and truncates it,
/// as logrotate's copytruncate does: QEMU keeps its O_APPEND descriptor and writes on from offset 0.
/// Returns whether it rotated.
pub fn rotate_console_log(log: &std::path::Path, max: u64) -> std::io::Result<bool> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = match std::fs::File::options().read(true).write(true).open(log) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    let len = f.metadata()?.len();
    if len <= max {
        return Ok(false);
    }
    f.seek(SeekFrom::Start(len - max))?;
    let mut tail = Vec::with_capacity(max as usize);
    f.by_ref().take(max).read_to_end(&mut tail)?;
    let mut old = log.as_os_str().to_owned();
    old.push(".1");
    k3_common::fsutil::write_atomic(std::path::Path::new(&old), &tail)?;
    f.set_len(0)?;
    Ok(true)
}

#[cfg(test)]
mod console_tests {
    use std::io::Write;

    #[test]
    fn console_logs_stay_bounded_while_the_writer_appends() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join(super::CONSOLE_LOG);
        // The writer appends as QEMU's `file,append=on` chardev does.
        let mut w = std::fs::File::options()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let max = 64 * 1024;
        let mut last = Vec::new();
        for round in 0..20 {
            let chunk: Vec<u8> = (0..rand::random_range(10_000..40_000))
                .map(|_| b'a' + rand::random_range(0..26u8))
                .collect();
            w.write_all(&chunk).unwrap();
            last = chunk;
            super::rotate_console_log(&log, max).unwrap();
            let len = std::fs::metadata(&log).unwrap().len();
            assert!(len <= max, "round {round}: {len} bytes");
        }
        let kept = std::fs::read(dir.path().join("console.log.1")).unwrap();
        assert!(kept.len() as u64 <= max);
        // What was written since the last rotation is in the log or at the end of the kept part.
        let now = std::fs::read(&log).unwrap();
        assert!(now.ends_with(&last) || kept.ends_with(&last));
        w.write_all(b"after").unwrap();
        assert!(std::fs::read(&log).unwrap().ends_with(b"after"));
        assert!(!super::rotate_console_log(&dir.path().join("missing.log"), max).unwrap());
    }
}

/// Live QEMU processes whose command line names a sandbox folder under `dir`: (pid, sandbox id).
pub(crate) fn vm_processes_under(dir: &Path) -> Vec<(u32, String)> {
    let needle = format!("{}/", dir.display());
    let me = std::process::id();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != me)
        .filter_map(|pid| {
            let c = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let c = String::from_utf8_lossy(&c);
            if !c.contains("qemu-system") {
                return None;
            }
            let at = c.find(&needle)? + needle.len();
            let id: String = c[at..].chars().take_while(|ch| *ch != '/').collect();
            Some((pid, id))
        })
        .collect()
}

#[cfg(test)]
mod socket_tests {
    use super::*;

    fn spec(dir: &Path) -> VmSpec {
        VmSpec {
            dir: dir.to_owned(),
            kernel: PathBuf::new(),
            initrd: PathBuf::new(),
            cmdline: String::new(),
            vcpus: 1,
            memory_mib: 128,
            ram_file: PathBuf::new(),
            ram_shared: true,
            disk: PathBuf::new(),
            disk_format: DiskFormat::Qcow2,
            nic: false,
            tap: None,
            cpu: None,
            free_page_reporting: false,
            background: false,
        }
    }

    #[test]
    fn sockets_of_an_older_qemu_are_found_in_the_vm_folder() {
        let dir = tempfile::tempdir().unwrap();
        let s = spec(dir.path());
        let new = dir.path().join(SOCKET_DIR);
        assert_eq!(s.qmp_socket(), new.join("qmp.sock"), "a new VM");
        // A QEMU of an older version made its sockets in the VM folder itself.
        std::fs::write(dir.path().join("qmp.sock"), b"").unwrap();
        assert_eq!(s.qmp_socket(), dir.path().join("qmp.sock"));
        assert_eq!(s.agent_socket(), dir.path().join("agent.sock"));
        // Once restarted by this version, its socket folder wins.
        std::fs::create_dir(&new).unwrap();
        assert_eq!(s.agent_socket(), new.join("agent.sock"));
    }
}
