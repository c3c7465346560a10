//! Persisted records: versioned serde structs written atomically, one file per template and sandbox.
//!
//! Layout under `state_dir`:
//! - `templates/<id>/template.json` ([`TemplateRecord`]), `base.ext4`, `base.mem`, `base.state`
//! - `sandboxes/<id>/sandbox.json` ([`VmRecord`]), `disk.qcow2`, `device.state` (while paused),
//!   sockets and logs; RAM in `ram_dir/<id>.mem`

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::vmm::{DiskFormat, VmSpec};

/// Format version of every record in this module.
pub const RECORD_VERSION: u32 = 1;

/// Errors reading or writing records.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    /// File i/o.
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// Bad JSON.
    #[error("record {path}: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    /// Written by a newer or older format.
    #[error("record {path} has version {found}, expected {RECORD_VERSION}")]
    Version { path: PathBuf, found: u32 },
}

pub use agentenv_vm::TemplateInfo;

/// The VM shape shared by a template's base snapshot and every sandbox restored from it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MachineRecord {
    /// Uncompressed kernel.
    pub kernel: PathBuf,
    /// Initramfs.
    pub initrd: PathBuf,
    /// Kernel command line.
    pub cmdline: String,
    /// vCPUs.
    pub vcpus: u32,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// A virtio-net device (machines recorded before networking have none).
    #[serde(default)]
    pub nic: bool,
    /// QEMU `-cpu` model (machines recorded before have none: QEMU's default, `qemu64`).
    #[serde(default)]
    pub cpu: Option<String>,
    /// A virtio-balloon device with free page reporting: pages the guest frees go back to the host
    /// (machines recorded before have none).
    #[serde(default)]
    pub free_page_reporting: bool,
}

impl MachineRecord {
    /// A [`VmSpec`] with this shape and the given per-VM files.
    pub fn spec(
        &self,
        dir: &Path,
        ram_file: &Path,
        disk: &Path,
        disk_format: DiskFormat,
    ) -> VmSpec {
        VmSpec {
            dir: dir.to_owned(),
            kernel: self.kernel.clone(),
            initrd: self.initrd.clone(),
            cmdline: self.cmdline.clone(),
            vcpus: self.vcpus,
            memory_mib: self.memory_mib,
            ram_file: ram_file.to_owned(),
            ram_shared: true,
            disk: disk.to_owned(),
            disk_format,
            nic: self.nic,
            tap: None,
            cpu: self.cpu.clone(),
            free_page_reporting: self.free_page_reporting,
            background: false,
        }
    }
}

/// A built template with its ready-to-resume base snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateRecord {
    /// [`RECORD_VERSION`].
    pub version: u32,
    /// Public facts.
    pub info: TemplateInfo,
    /// Machine shape of the base snapshot.
    pub machine: MachineRecord,
    /// Raw ext4 root disk (the backing file of every sandbox overlay; never written after the build).
    pub base_disk: PathBuf,
    /// Guest RAM at snapshot time.
    pub base_ram: PathBuf,
    /// Device state at snapshot time (x-ignore-shared migration stream).
    pub base_state: PathBuf,
}

/// Where a sandbox's VM is in its lifecycle, as committed on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "phase", rename_all = "snake_case")]
pub enum SandboxPhase {
    /// A VMM is being started; a crash here leaves nothing worth keeping.
    Starting,
    /// The VMM process `pid` runs the guest.
    Running {
        /// VMM process id.
        pid: u32,
    },
    /// Stopped; device state in `device.state`, RAM in the RAM file, no VMM process.
    Paused,
}

/// One sandbox VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmRecord {
    /// [`RECORD_VERSION`].
    pub version: u32,
    /// Sandbox id.
    pub id: String,
    /// Template it was created from.
    pub template_id: String,
    /// Machine shape (copied from the template so a rebuilt template cannot change it).
    pub machine: MachineRecord,
    /// RAM file: the sandbox's own (mapped shared) or, when `ram_shared` is false, a file mapped
    /// private copy-on-write (a snapshot's RAM, or an empty file a full stream loads into).
    pub ram_file: PathBuf,
    /// Whether `ram_file` is mapped shared (older records: always).
    #[serde(default = "yes")]
    pub ram_shared: bool,
    /// Snapshot this sandbox's disk (and, while `ram_shared` is false, RAM) depends on.
    #[serde(default)]
    pub parent_snapshot: Option<String>,
    /// RFC 3339 creation time.
    pub created_at: String,
    /// Lifecycle phase.
    pub phase: SandboxPhase,
    /// Folder of the VM's files (disk, sockets, console) when it is not the sandbox's own folder: a
    /// warm VM the sandbox took ([`crate::lifecycle::warm`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm_dir: Option<PathBuf>,
    /// Paused without memory (filesystem only): no device state or RAM is kept, and a resume
    /// cold-boots from the disk.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub boot_on_resume: bool,
    /// Paused with its (shared) RAM file not yet flushed to the disk: the host boot of that pause. A
    /// recovery in the same boot flushes it; after a reboot (a power loss could have torn it) the
    /// sandbox resumes by a cold boot from its disk instead. `None`: flushed (older records too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ram_boot_id: Option<String>,
}

fn yes() -> bool {
    true
}

/// A captured sandbox: disk always, memory and device state unless filesystem-only.
///
/// Files live in `snapshots/<id>/` (`disk.qcow2`, `device.state`, `ram.mem` or the RAM in `ram_dir`);
/// a capture is written to `snapshots/<id>.partial/` and renamed into place only when complete.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    /// [`RECORD_VERSION`].
    pub version: u32,
    /// Snapshot id.
    pub id: String,
    /// Names (`name:tag`) it answers to.
    pub names: Vec<String>,
    /// Sandbox it was taken from.
    pub source_sandbox: Option<String>,
    /// Template the source was created from.
    pub template_id: String,
    /// Machine shape.
    pub machine: MachineRecord,
    /// qcow2 copy of the source's disk overlay (backed by the template disk or `parent`'s disk).
    pub disk: PathBuf,
    /// RAM file (mapped private by every sandbox restored from it); `None` when the state carries the
    /// RAM or for filesystem-only snapshots.
    pub ram: Option<PathBuf>,
    /// Device state; `None` for filesystem-only snapshots (restores cold-boot).
    pub state: Option<PathBuf>,
    /// Snapshot whose disk backs `disk`.
    pub parent: Option<String>,
    /// Deleted by the user (or a fork's internal base): hidden, files kept while something depends on it.
    pub deleted: bool,
    /// RFC 3339 capture time.
    pub created_at: String,
    /// Bytes of data in its files.
    pub bytes: u64,
    /// envd version of the guest.
    pub envd_version: String,
    /// Host boot the capture was made in, when its RAM file was not flushed to disk at capture (it is
    /// durable once the chunk store holds it). `None`: every file was flushed at capture.
    #[serde(default)]
    pub boot_id: Option<String>,
}

impl Versioned for SnapshotRecord {
    fn version(&self) -> u32 {
        self.version
    }
}

/// Reads a record of type `T` from `path`, checking its version.
pub fn read<T: for<'de> Deserialize<'de> + Versioned>(path: &Path) -> Result<T, PersistError> {
    let bytes = std::fs::read(path).map_err(|e| PersistError::Io {
        what: "read",
        path: path.to_owned(),
        source: e,
    })?;
    let rec: T = serde_json::from_slice(&bytes).map_err(|e| PersistError::Json {
        path: path.to_owned(),
        source: e,
    })?;
    if rec.version() != RECORD_VERSION {
        return Err(PersistError::Version {
            path: path.to_owned(),
            found: rec.version(),
        });
    }
    Ok(rec)
}

/// Writes `rec` to `path` atomically (temp file, fsync, rename).
pub fn write<T: Serialize>(path: &Path, rec: &T) -> Result<(), PersistError> {
    let bytes = json(path, rec)?;
    k3_common::fsutil::write_atomic(path, &bytes).map_err(|e| PersistError::Io {
        what: "write",
        path: path.to_owned(),
        source: e,
    })
}

/// Writes `rec` as JSON to `path` in place, unflushed: for a file in a folder that is flushed and
/// committed later as a whole (a capture's `.partial` folder and its rename).
pub fn write_unsynced<T: Serialize>(path: &Path, rec: &T) -> Result<(), PersistError> {
    let bytes = json(path, rec)?;
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(&bytes))
        .map_err(|e| PersistError::Io {
            what: "write",
            path: path.to_owned(),
            source: e,
        })
}

/// `rec` as the JSON written to `path`.
fn json<T: Serialize>(path: &Path, rec: &T) -> Result<Vec<u8>, PersistError> {
    serde_json::to_vec_pretty(rec).map_err(|e| PersistError::Json {
        path: path.to_owned(),
        source: e,
    })
}

/// Records carrying a format version.
pub trait Versioned {
    /// The format version stored in the record.
    fn version(&self) -> u32;
}

impl Versioned for TemplateRecord {
    fn version(&self) -> u32 {
        self.version
    }
}

impl Versioned for VmRecord {
    fn version(&self) -> u32 {
        self.version
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_record_round_trips_and_rejects_other_versions() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sandbox.json");
        let pid = rand::random::<u32>();
        let rec = VmRecord {
            version: RECORD_VERSION,
            id: format!("sbx-{}", rand::random::<u32>()),
            template_id: "base".into(),
            machine: MachineRecord {
                kernel: "/k".into(),
                initrd: "/i".into(),
                cmdline: "console=ttyS0".into(),
                vcpus: 1,
                memory_mib: 256,
                nic: true,
                cpu: None,
                free_page_reporting: rand::random(),
            },
            ram_file: "/r.mem".into(),
            ram_shared: true,
            parent_snapshot: None,
            created_at: "2026-11-29T00:00:00Z".into(),
            phase: SandboxPhase::Running { pid },
            vm_dir: Some(format!("/state/vms/w{}", rand::random::<u16>()).into()),
            boot_on_resume: rand::random(),
            ram_boot_id: None,
        };
        write(&path, &rec).unwrap();
        assert_eq!(read::<VmRecord>(&path).unwrap(), rec);
        let newer = VmRecord {
            version: RECORD_VERSION + 1,
            ..rec
        };
        write(&path, &newer).unwrap();
        assert!(matches!(
            read::<VmRecord>(&path),
            Err(PersistError::Version { .. })
        ));
    }

    #[test]
    fn machines_recorded_before_free_page_reporting_have_no_balloon() {
        let m = MachineRecord {
            kernel: "/k".into(),
            initrd: "/i".into(),
            cmdline: "console=ttyS0".into(),
            vcpus: rand::random_range(1..4),
            memory_mib: 256,
            nic: true,
            cpu: None,
            free_page_reporting: true,
        };
        let mut old = serde_json::to_value(&m).unwrap();
        old.as_object_mut().unwrap().remove("free_page_reporting");
        let old: MachineRecord = serde_json::from_value(old).unwrap();
        assert!(!old.free_page_reporting);
        let spec = |m: &MachineRecord| {
            m.spec(
                Path::new("/d"),
                Path::new("/r"),
                Path::new("/x"),
                DiskFormat::Qcow2,
            )
        };
        assert!(!spec(&old).free_page_reporting);
        assert!(spec(&m).free_page_reporting);
    }
}
