//! Snapshot facts.

use std::collections::BTreeMap;

/// What a snapshot keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotMode {
    /// Memory, device state and disk: restores continue where the source was.
    Full,
    /// The disk only: sandboxes made from it cold-boot.
    Filesystem,
}

/// Public facts about a snapshot.
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotInfo {
    /// Snapshot id.
    pub id: String,
    /// Names (`name:tag`).
    pub names: Vec<String>,
    /// Sandbox it was taken from.
    pub source_sandbox: Option<String>,
    /// Template of the source.
    pub template_id: String,
    /// Full or filesystem-only.
    pub mode: SnapshotMode,
    /// RFC 3339 capture time.
    pub created_at: String,
    /// Bytes of data in its files.
    pub bytes: u64,
    /// vCPUs of sandboxes made from it.
    pub vcpus: u32,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// How long the source was stopped.
    pub paused_ms: f64,
    /// What the chunk store holds of it, once its background ingest finished.
    pub stored: Option<StoredChunks>,
    /// Why its ingest gave up (it will not be stored), if it did.
    pub store_failed: Option<String>,
}

/// A snapshot's files in the chunk store (`snapshots/<id>/chunks.json`, written when the ingest is done).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StoredChunks {
    /// File name (`disk.qcow2`, `device.state`, `ram.mem`) → manifest id (hex).
    pub manifests: BTreeMap<String, String>,
    /// Bytes of non-zero data in the files.
    pub bytes_data: u64,
    /// Bytes this snapshot added to the store (chunks no earlier snapshot or file had).
    pub bytes_new: u64,
    /// Ingest wall time.
    pub elapsed_ms: f64,
}
