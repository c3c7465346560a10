//! Snapshots made on another machine. Once a snapshot's files are stored as chunks, its record travels as
//! chunk-store metadata (`snapshots/<id>`, in S3 when the store has a bucket), so a runtime whose state folder
//! lacks it imports it on first use: the files are materialized from the chunks (fetched where the local cache
//! lacks them), the disk is pointed at this machine's template or parent disk, and only then does the record
//! appear, so a crash mid-import leaves nothing visible.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::SnapshotError;
use crate::persist::{self, SnapshotRecord};
use crate::{Runtime, fsops, valid_id};
use agentenv_vm::{SnapshotInfo, StoredChunks, normalize_name};

/// A snapshot's record of its files in the chunk store, in its folder.
pub(crate) const CHUNKS_FILE: &str = "chunks.json";

/// What the chunk store keeps of a snapshot for other machines.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SharedSnapshot {
    pub(crate) record: SnapshotRecord,
    pub(crate) stored: StoredChunks,
    /// Build key of the template whose disk ends the snapshot's disk chain (a hash of every build input):
    /// an importing machine's template must be that same build.
    pub(crate) template_build: String,
}

/// The build key of a template: the folder its base files are installed in is named after it.
pub(crate) fn template_build(t: &crate::persist::TemplateRecord) -> String {
    t.base_disk
        .parent()
        .and_then(|p| p.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The metadata key of snapshot `id`.
pub(crate) fn meta_key(id: &str) -> String {
    format!("snapshots/{id}")
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> SnapshotError {
    let path = path.to_path_buf();
    move |source| SnapshotError::Io { what, path, source }
}

fn store_err(
    what: &'static str,
    path: &Path,
) -> impl Fn(agentenv_store::StoreError) -> SnapshotError {
    let path = path.to_path_buf();
    move |e| SnapshotError::Io {
        what,
        path: path.clone(),
        source: std::io::Error::other(e),
    }
}

impl Runtime {
    /// Makes snapshot `id_or_name` (an id, or `name[:tag]`) available here: a local one as it is, else one
    /// that another machine stored in the shared chunk store is imported. `Ok(None)`: neither has it.
    pub async fn import_snapshot(
        &self,
        id_or_name: &str,
    ) -> Result<Option<SnapshotInfo>, SnapshotError> {
        if let Some(r) = self.snapshot_record(id_or_name) {
            return Ok(Some(r.info(0.0)));
        }
        let _one_at_a_time = self.inner.catalog.import_lock().await;
        if let Some(r) = self.snapshot_record(id_or_name) {
            return Ok(Some(r.info(0.0)));
        }
        let Some(shared) = self.find_shared(id_or_name).await? else {
            return Ok(None);
        };
        let rec = self.import(shared, 0).await?;
        Ok(Some(rec.info(0.0)))
    }

    /// The local record of snapshot `id`, deleted (hidden) ones included.
    fn snapshot_record_any(&self, id: &str) -> Option<SnapshotRecord> {
        self.inner.catalog.snapshot_any(id)
    }

    /// The stored record of `id_or_name` in the chunk store's metadata.
    async fn find_shared(&self, id_or_name: &str) -> Result<Option<SharedSnapshot>, SnapshotError> {
        let store = &self.inner.store;
        let here = Path::new(id_or_name);
        // One this machine knows (deleted ones included, also once their record is collected) is never
        // imported over its own record.
        let parse = |bytes: Vec<u8>| -> Option<SharedSnapshot> {
            serde_json::from_slice::<SharedSnapshot>(&bytes)
                .ok()
                .filter(|s| !s.record.deleted && valid_id(&s.record.id))
                .filter(|s| self.snapshot_record_any(&s.record.id).is_none())
                .filter(|s| !self.inner.catalog.deleted_here(&s.record.id))
        };
        if valid_id(id_or_name)
            && let Some(b) = store
                .get_meta(&meta_key(id_or_name))
                .await
                .map_err(store_err("read snapshot metadata", here))?
            && let Some(s) = parse(b)
        {
            return Ok(Some(s));
        }
        let Some(wanted) = normalize_name(id_or_name) else {
            return Ok(None);
        };
        let keys = store
            .list_meta("snapshots/")
            .await
            .map_err(store_err("list snapshot metadata", here))?;
        let mut found: Option<SharedSnapshot> = None;
        for key in keys {
            let Some(b) = store
                .get_meta(&key)
                .await
                .map_err(store_err("read snapshot metadata", here))?
            else {
                continue;
            };
            if let Some(s) = parse(b).filter(|s| s.record.names.contains(&wanted))
                && found
                    .as_ref()
                    .is_none_or(|f| f.record.created_at < s.record.created_at)
            {
                found = Some(s);
            }
        }
        Ok(found)
    }

    /// Imports `shared` (its parents first), returning the local record.
    async fn import(
        &self,
        shared: SharedSnapshot,
        depth: usize,
    ) -> Result<SnapshotRecord, SnapshotError> {
        let id = shared.record.id.clone();
        if depth > 64 {
            return Err(SnapshotError::NotFound(format!(
                "{id} (parent chain too long)"
            )));
        }
        // A template published to the shared store is imported first (the import lock is held).
        if self
            .inner
            .catalog
            .template(&shared.record.template_id)
            .is_none()
            && let Err(e) = self
                .import_template_locked(&shared.record.template_id)
                .await
        {
            tracing::warn!(snapshot = %id, error = %e, "importing its template failed");
        }
        let template = self
            .inner
            .catalog
            .template(&shared.record.template_id)
            .ok_or_else(|| {
                SnapshotError::NotFound(format!(
                    "{id} (it needs template {}, which this machine lacks)",
                    shared.record.template_id
                ))
            })?;
        if template_build(&template) != shared.template_build {
            return Err(SnapshotError::NotFound(format!(
                "{id} (it needs template {} of build {}; this machine's is build {})",
                template.info.id,
                shared.template_build,
                template_build(&template)
            )));
        }
        let backing: PathBuf = match &shared.record.parent {
            None => template.base_disk.clone(),
            Some(p) => match self.snapshot_record_any(p) {
                Some(r) => r.disk,
                None => {
                    let parent = self.find_shared(p).await?.ok_or_else(|| {
                        SnapshotError::NotFound(format!("{id} (its parent {p} is not stored)"))
                    })?;
                    Box::pin(self.import(parent, depth + 1)).await?.disk
                }
            },
        };
        let dir = self.inner.snapshots_dir();
        let final_dir = dir.join(&id);
        let partial = dir.join(format!("{id}.partial"));
        let _ = std::fs::remove_dir_all(&partial);
        k3_common::fsutil::create_private_dir(&partial).map_err(io("create", &partial))?;
        let r = self
            .materialize(&shared, &partial, &final_dir, &backing)
            .await;
        let rec = match r {
            Ok(rec) => rec,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&partial);
                return Err(e);
            }
        };
        std::fs::rename(&partial, &final_dir).map_err(io("rename", &partial))?;
        let rec = self.inner.catalog.put_imported(&rec)?;
        let holder = format!("snapshot-{id}");
        for hex in shared.stored.manifests.values() {
            if let Some(m) = agentenv_store::ManifestId::from_hex(hex) {
                let _ = self.inner.store.pin(&m, &holder).await;
            }
        }
        tracing::info!(snapshot = %id, bytes = shared.stored.bytes_data, "snapshot imported from the chunk store");
        Ok(rec)
    }

    /// Writes the snapshot's files into `partial` (RAM into its final place when RAM lives elsewhere) and
    /// returns the record as it will be once `partial` is renamed to `final_dir`.
    async fn materialize(
        &self,
        shared: &SharedSnapshot,
        partial: &Path,
        final_dir: &Path,
        backing: &Path,
    ) -> Result<SnapshotRecord, SnapshotError> {
        let src = &shared.record;
        let in_dir = |name: &str| final_dir.join(name);
        let ram_final = src
            .ram
            .as_ref()
            .map(|_| self.inner.snapshot_ram(&src.id, final_dir));
        // The RAM copy is not flushed (its chunks are stored): after a host restart it is made again
        // on first use (`lifecycle::snapshot::after_host_restart`).
        let boot_id = ram_final
            .is_some()
            .then(k3_common::machine::boot_id)
            .flatten();
        let rec = SnapshotRecord {
            disk: in_dir("disk.qcow2"),
            state: src.state.as_ref().map(|_| in_dir("device.state")),
            ram: ram_final.clone(),
            deleted: false,
            boot_id: boot_id.clone(),
            ..src.clone()
        };
        // Where each file goes now: inside `partial`, except a RAM file kept in the RAM folder.
        let now = |p: &Path| -> PathBuf {
            match p.strip_prefix(final_dir) {
                Ok(rel) => partial.join(rel),
                Err(_) => p.to_path_buf(),
            }
        };
        for (name, path) in rec.files() {
            let hex = shared.stored.manifests.get(name).ok_or_else(|| {
                SnapshotError::NotFound(format!("{} ({name} is not in the chunk store)", src.id))
            })?;
            let mid = agentenv_store::ManifestId::from_hex(hex)
                .ok_or_else(|| SnapshotError::NotFound(format!("{} (bad manifest id)", src.id)))?;
            let target = now(&path);
            let err = store_err("restore from the chunk store", &target);
            let m = self.inner.store.manifest(&mid).await.map_err(&err)?;
            let durability = match (name, &boot_id) {
                ("ram.mem", Some(_)) => agentenv_store::Durability::ThisBoot,
                _ => agentenv_store::Durability::Flushed,
            };
            self.inner
                .store
                .materialize_with(&m, &target, durability)
                .await
                .map_err(&err)?;
        }
        let disk = now(&rec.disk);
        fsops::rebase_unsafe(&self.inner.cfg.qemu_img_bin, backing, &disk)
            .await
            .map_err(io("rebase", &disk))?;
        let chunks = serde_json::to_vec_pretty(&shared.stored).expect("chunks serialize");
        k3_common::fsutil::write_atomic(&partial.join(CHUNKS_FILE), &chunks)
            .map_err(io("write", partial))?;
        persist::write(&partial.join("snapshot.json"), &rec)?;
        Ok(rec)
    }
}
