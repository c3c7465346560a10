//! Snapshots and forks: a running (or paused) sandbox captured as disk, device state and RAM, restorable
//! any number of times; forks restore one capture into several sandboxes that share its RAM copy-on-write.
//!
//! A capture stops the source only while its files are written (device state, a sparse copy of a shared
//! RAM file, a copy of its qcow2 overlay), then continues it with its id and expiry unchanged. Files are
//! written into `snapshots/<id>.partial/` and renamed into place with the record, so a crash never leaves
//! a half-written snapshot visible. Deleted snapshots stay on disk, hidden, while a sandbox or another
//! snapshot still depends on them (their disk backs an overlay, or their RAM is mapped).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::agent;
use crate::error::{CreateError, SnapshotError};
use crate::fsops;
use crate::lifecycle::source::{Image, ImageStart};
use crate::persist::{self, RECORD_VERSION, SnapshotRecord, VmRecord};
use crate::{CreateSpec, Inner, Runtime, SandboxVm, valid_id};

pub use agentenv_vm::snapshot::{SnapshotInfo, SnapshotMode, StoredChunks};
pub use agentenv_vm::{DEFAULT_TAG, normalize_name};

pub(crate) use crate::sync::remote::CHUNKS_FILE;

/// Written into a snapshot's folder (with the error) when its ingest gives up.
const STORE_FAILED_FILE: &str = "chunks.failed";

/// A snapshot's ingest is tried this often, `INGEST_RETRY` x attempt apart (a bucket that is briefly
/// away or slow), before it is left unstored.
const INGEST_TRIES: u32 = 3;
const INGEST_RETRY: std::time::Duration = std::time::Duration::from_secs(2);

/// The `chunks.json` of the snapshot folder `dir`, once its ingest finished.
pub(crate) fn read_stored(dir: &Path) -> Option<StoredChunks> {
    let bytes = std::fs::read(dir.join(CHUNKS_FILE)).ok()?;
    serde_json::from_slice(&bytes).ok()
}

impl SnapshotRecord {
    pub(crate) fn image(&self) -> Image {
        let start = match (&self.ram, &self.state) {
            (Some(ram), Some(state)) => ImageStart::CowRam {
                ram: ram.clone(),
                state: state.clone(),
            },
            (None, Some(state)) => ImageStart::Stream {
                state: state.clone(),
            },
            _ => ImageStart::Boot,
        };
        Image {
            template_id: self.template_id.clone(),
            machine: self.machine.clone(),
            disk: self.disk.clone(),
            start,
            parent: Some(self.id.clone()),
            envd_version: self.envd_version.clone(),
        }
    }

    /// Its files by chunk-store name: the disk, and the device state and RAM file where it has them.
    pub(crate) fn files(&self) -> Vec<(&'static str, PathBuf)> {
        let mut f = vec![("disk.qcow2", self.disk.clone())];
        f.extend(self.state.clone().map(|p| ("device.state", p)));
        f.extend(self.ram.clone().map(|p| ("ram.mem", p)));
        f
    }

    pub(crate) fn info(&self, paused_ms: f64) -> SnapshotInfo {
        let dir = self.disk.parent();
        let stored = dir.and_then(read_stored);
        let store_failed =
            dir.and_then(|d| std::fs::read_to_string(d.join(STORE_FAILED_FILE)).ok());
        SnapshotInfo {
            stored,
            store_failed,
            id: self.id.clone(),
            names: self.names.clone(),
            source_sandbox: self.source_sandbox.clone(),
            template_id: self.template_id.clone(),
            mode: if self.state.is_some() {
                SnapshotMode::Full
            } else {
                SnapshotMode::Filesystem
            },
            created_at: self.created_at.clone(),
            bytes: self.bytes,
            vcpus: self.machine.vcpus,
            memory_mib: self.machine.memory_mib,
            paused_ms,
        }
    }
}

impl Inner {
    pub(crate) fn snapshots_dir(&self) -> PathBuf {
        self.catalog.snapshots_dir().to_path_buf()
    }
    pub(crate) fn snapshot_ram(&self, id: &str, dir: &Path) -> PathBuf {
        match &self.cfg.ram_dir {
            Some(d) => d.join(format!("snap-{id}.mem")),
            None => dir.join("ram.mem"),
        }
    }
}

/// Loads snapshot records, dropping partial captures and RAM files no record owns.
pub(crate) fn load_all(
    dir: &Path,
    ram_dir: Option<&Path>,
) -> Result<BTreeMap<String, SnapshotRecord>, persist::PersistError> {
    let mut out = BTreeMap::new();
    let current_boot = k3_common::machine::boot_id();
    let rd = std::fs::read_dir(dir).map_err(|e| persist::PersistError::Io {
        what: "read",
        path: dir.to_owned(),
        source: e,
    })?;
    for e in rd.flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "partial") {
            tracing::warn!(path = %p.display(), "removing an unfinished snapshot capture");
            let _ = std::fs::remove_dir_all(&p);
            continue;
        }
        match persist::read::<SnapshotRecord>(&p.join("snapshot.json")) {
            Ok(mut r) => {
                if let Err(e) = after_host_restart(&mut r, &p, current_boot.as_deref()) {
                    tracing::error!(path = %p.display(), error = %e, "rewriting a snapshot record");
                }
                out.insert(r.id.clone(), r);
            }
            Err(e) => {
                tracing::error!(path = %p.display(), error = %e, "unreadable snapshot record")
            }
        }
    }
    if let Some(rd) = ram_dir.and_then(|d| std::fs::read_dir(d).ok()) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(id) = name
                .strip_prefix("snap-")
                .and_then(|n| n.strip_suffix(".mem"))
                && !out.contains_key(id)
            {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    Ok(out)
}

/// A snapshot whose RAM copy was not flushed at capture (`boot_id`), found after the host restarted:
/// its RAM file may be torn. With the RAM in the chunk store (folder `dir`), the local copy goes and is
/// restored from the chunks on first use; without, the snapshot cannot resume memory and is hidden
/// (its disk, flushed at capture, stays for sandboxes and snapshots built on it).
fn after_host_restart(
    r: &mut SnapshotRecord,
    dir: &Path,
    current_boot: Option<&str>,
) -> Result<(), persist::PersistError> {
    let (Some(taken), Some(now)) = (r.boot_id.as_deref(), current_boot) else {
        return Ok(());
    };
    if taken == now {
        return Ok(());
    }
    let in_store = read_stored(dir).is_some_and(|s| s.manifests.contains_key("ram.mem"));
    if let Some(ram) = &r.ram {
        let _ = std::fs::remove_file(ram);
    }
    if !in_store {
        tracing::error!(snapshot = %r.id, "the host went down before this snapshot's RAM was stored: hidden");
        r.ram = None;
        r.state = None;
        r.deleted = true;
        r.names.clear();
    }
    r.boot_id = None;
    persist::write(&dir.join("snapshot.json"), &*r)
}

impl Runtime {
    /// Live (not deleted) snapshots.
    pub fn snapshots(&self) -> Vec<SnapshotInfo> {
        self.inner
            .catalog
            .live_snapshots()
            .iter()
            .map(|s| s.info(0.0))
            .collect()
    }

    /// The live snapshot with id `name`, or named `name[:tag]`.
    pub(crate) fn snapshot_record(&self, name: &str) -> Option<SnapshotRecord> {
        self.inner.catalog.snapshot_named(name)
    }

    /// Captures sandbox `sandbox_id` as snapshot `snapshot_id` with `names` (moved from any older
    /// snapshot holding them). A running source is stopped only for the capture.
    pub async fn snapshot(
        &self,
        sandbox_id: &str,
        snapshot_id: &str,
        names: &[String],
        mode: SnapshotMode,
    ) -> Result<SnapshotInfo, SnapshotError> {
        self.capture(sandbox_id, snapshot_id, names, mode, false)
            .await
            .map(|(info, _)| info)
    }

    /// [`Self::snapshot`]; a `hidden` one (a fork's) is written deleted from the start, so a crash
    /// never leaves it listed. Returns the record as well.
    async fn capture(
        &self,
        sandbox_id: &str,
        snapshot_id: &str,
        names: &[String],
        mode: SnapshotMode,
        hidden: bool,
    ) -> Result<(SnapshotInfo, SnapshotRecord), SnapshotError> {
        if !valid_id(snapshot_id) {
            return Err(SnapshotError::InvalidName(snapshot_id.into()));
        }
        let names = names
            .iter()
            .map(|n| normalize_name(n).ok_or_else(|| SnapshotError::InvalidName(n.clone())))
            .collect::<Result<Vec<_>, _>>()?;
        let slot = self
            .slot(sandbox_id)
            .ok_or_else(|| SnapshotError::SandboxNotFound(sandbox_id.into()))?;
        let inner = &self.inner;
        let final_dir = inner.snapshots_dir().join(snapshot_id);
        let partial = inner.snapshots_dir().join(format!("{snapshot_id}.partial"));
        if final_dir.exists() {
            return Err(SnapshotError::InvalidName(format!(
                "{snapshot_id} (exists)"
            )));
        }
        let io = |what, path: &Path| {
            let path = path.to_owned();
            move |source| SnapshotError::Io { what, path, source }
        };
        std::fs::create_dir_all(&partial).map_err(io("create", &partial))?;
        // Background work (ingests, cache fills) pauses until the capture is committed.
        let _fg = k3_common::background::foreground();
        let live = slot.live.lock().await;
        if live.gone {
            return Err(SnapshotError::SandboxNotFound(sandbox_id.into()));
        }
        let rec = live.record.clone();
        let full = mode == SnapshotMode::Full;
        let ram_out = (full && rec.ram_shared).then(|| inner.snapshot_ram(snapshot_id, &final_dir));
        // A fork's capture goes straight into the memfd its forks map: no file, no second copy.
        let mem =
            match hidden && ram_out.is_some() && inner.vmm.cow_ram() && inner.vmm.ram_via_memfd() {
                true => Some(crate::vmm::launch::ram_memfd()?),
                false => None,
            };
        // Without a RAM folder the RAM sits in the snapshot folder and moves with its rename.
        let ram_tmp = ram_out
            .as_ref()
            .filter(|_| mem.is_none())
            .map(|p| match inner.cfg.ram_dir {
                Some(_) => p.with_extension("mem.partial"),
                None => partial.join("ram.mem"),
            });
        let disk_copy = (inner.spec_of(&rec).disk, partial.join("disk.qcow2"));
        let ram_copy: Vec<_> = ram_tmp
            .iter()
            .map(|t| (rec.ram_file.clone(), t.clone()))
            .collect();
        let t0 = Instant::now();
        let captured = match &live.vm {
            Some(vm) => {
                if !full && let Some(link) = &live.agent {
                    agent::sync(link).await?;
                }
                vm.stop().await?;
                let t_stop = t0.elapsed();
                // The disk, then the device state (whose migration ends by closing the disk); the RAM
                // meanwhile. None is flushed before the VM runs on.
                let disk_then_state = async {
                    copy_files(vec![disk_copy.clone()], &partial).await?;
                    let t_disk = t0.elapsed();
                    if full {
                        vm.save_device_state(&partial.join("device.state")).await?;
                    }
                    Ok::<_, SnapshotError>((t_disk, t0.elapsed()))
                };
                let (disk_state, ram, mem) = tokio::join!(
                    disk_then_state,
                    copy_files(ram_copy.clone(), &partial),
                    copy_into(&rec.ram_file, mem)
                );
                let t_files = t0.elapsed();
                k3_common::crash::point("runtime:snapshot:during-capture");
                k3_common::crash::kill_vm_point("runtime:snapshot:during-capture", vm.pid());
                let resumed = vm.cont().await;
                tracing::debug!(?t_stop, t_disk_state = ?disk_state.as_ref().ok(), ?t_files, t_cont = ?t0.elapsed(), "capture phases");
                disk_state
                    .map(drop)
                    .and(ram)
                    .and(resumed.map_err(SnapshotError::from))
                    .and(mem)
            }
            None if full && rec.boot_on_resume => Err(SnapshotError::NoMemory(sandbox_id.into())),
            None => {
                if full {
                    let src = inner.device_state_path(sandbox_id);
                    let dst = partial.join("device.state");
                    std::fs::copy(&src, &dst).map_err(io("copy", &src))?;
                }
                let all = std::iter::once(disk_copy).chain(ram_copy).collect();
                copy_files(all, &partial)
                    .await
                    .and(copy_into(&rec.ram_file, mem).await)
            }
        };
        let paused_ms = t0.elapsed().as_secs_f64() * 1e3;
        drop(live);
        let mem = match captured {
            Ok(mem) => mem,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&partial);
                if let Some(t) = &ram_tmp {
                    let _ = std::fs::remove_file(t);
                }
                return Err(e);
            }
        };
        let mut bytes = fsops::allocated_bytes(&partial.join("disk.qcow2"));
        if let Some(m) = &mem {
            use std::os::unix::fs::MetadataExt;
            bytes += m.metadata().map_or(0, |m| m.blocks() * 512);
        }
        if full {
            bytes += fsops::allocated_bytes(&partial.join("device.state"));
        }
        if let (Some(t), Some(out)) = (&ram_tmp, &ram_out) {
            bytes += fsops::allocated_bytes(t);
            if inner.cfg.ram_dir.is_some() {
                std::fs::rename(t, out).map_err(io("rename", t))?;
            }
        }
        let boot_id = ram_out
            .is_some()
            .then(k3_common::machine::boot_id)
            .flatten();
        let snap = SnapshotRecord {
            version: RECORD_VERSION,
            id: snapshot_id.into(),
            names: names.clone(),
            source_sandbox: Some(sandbox_id.into()),
            template_id: rec.template_id.clone(),
            machine: rec.machine.clone(),
            disk: final_dir.join("disk.qcow2"),
            ram: ram_out,
            state: full.then(|| final_dir.join("device.state")),
            parent: rec.parent_snapshot.clone(),
            deleted: hidden,
            created_at: k3_common::time::now_rfc3339(),
            bytes,
            envd_version: crate::image::template::ENVD_VERSION.into(),
            boot_id,
        };
        persist::write_unsynced(&partial.join("snapshot.json"), &snap)?;
        // A fork's capture is flushed once its forks run (see `fork`).
        let files: &[&str] = match (hidden, full) {
            (true, _) => &["snapshot.json"],
            (false, true) => &["snapshot.json", "disk.qcow2", "device.state"],
            (false, false) => &["snapshot.json", "disk.qcow2"],
        };
        let t1 = Instant::now();
        flush_files(&partial, files).await?;
        let t_flush = t1.elapsed();
        k3_common::crash::point("runtime:snapshot:before-rename");
        std::fs::rename(&partial, &final_dir).map_err(io("rename", &partial))?;
        // The commit is the rename: make it durable before the snapshot is reported.
        k3_common::fsutil::sync_dir(&inner.snapshots_dir()).map_err(io("fsync", &final_dir))?;
        tracing::debug!(?t_flush, t_commit = ?t1.elapsed(), "capture committed");
        if let (Some(mem), Some(out)) = (mem, &snap.ram) {
            crate::vmm::launch::register_ram_base(out, mem)?;
        }
        inner.catalog.put_snapshot(snap.clone())?;
        // A fork's capture is made durable and stored once its forks run (see `fork`).
        if !hidden {
            self.spawn_ingest(snap.clone(), false);
        }
        tracing::info!(
            snapshot = snapshot_id,
            sandbox = sandbox_id,
            paused_ms,
            bytes,
            "snapshot taken"
        );
        Ok((snap.info(paused_ms), snap))
    }

    /// Gives snapshot `id` the names `add` (each `name:tag`, moved from any snapshot holding it) and
    /// takes `remove` from it; returns its new facts.
    pub fn rename_snapshot(
        &self,
        id: &str,
        add: &[String],
        remove: &[String],
    ) -> Result<SnapshotInfo, SnapshotError> {
        let norm = |v: &[String]| {
            v.iter()
                .map(|n| normalize_name(n).ok_or_else(|| SnapshotError::InvalidName(n.clone())))
                .collect::<Result<Vec<_>, _>>()
        };
        let (add, remove) = (norm(add)?, norm(remove)?);
        match self.inner.catalog.rename(id, add, &remove)? {
            Some(s) => Ok(s.info(0.0)),
            None => Err(SnapshotError::NotFound(id.into())),
        }
    }

    /// Deletes a snapshot: it disappears at once; its files go once nothing depends on them.
    pub fn delete_snapshot(&self, id: &str) -> Result<(), SnapshotError> {
        let s = self
            .inner
            .catalog
            .mark_deleted(id)?
            .ok_or_else(|| SnapshotError::NotFound(id.into()))?;
        self.inner.prepared.forget(&s.image().disk);
        self.inner.warm.forget(&s.image().disk, &self.inner);
        // Other machines sharing the store must not import it any more.
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let (inner, id) = (self.inner.clone(), id.to_string());
            handle.spawn(async move {
                let key = crate::sync::remote::meta_key(&id);
                if inner.store.delete_meta(&key).await.is_ok() {
                    inner.catalog.delete_landed(&id).await;
                }
            });
        }
        self.collect_snapshots();
        Ok(())
    }

    /// Forks sandbox `sandbox_id` into `ids`: one capture, then one restore per id, all sharing the
    /// captured RAM copy-on-write, each with its own disk overlay. One result per id.
    pub async fn fork(
        &self,
        sandbox_id: &str,
        ids: &[String],
    ) -> Result<Vec<Result<SandboxVm, CreateError>>, SnapshotError> {
        let sid = format!("fork-{}", agentenv_envd::hex(&agent::host_entropy()[..8]));
        // Hidden from the start: it lives exactly as long as a fork depends on it.
        let (_, snap) = self
            .capture(sandbox_id, &sid, &[], SnapshotMode::Full, true)
            .await?;
        k3_common::crash::point("runtime:fork:after-capture");
        if cfg!(debug_assertions)
            && let Some(slot) = self.slot(sandbox_id)
            && let Some(vm) = slot.live.lock().await.vm.as_ref()
        {
            k3_common::crash::kill_vm_point("runtime:fork:after-capture", vm.pid());
        }
        let image = snap.image();
        // Forks keep the parent's egress policy, each in a network of its own.
        let network = match self.slot(sandbox_id) {
            Some(slot) => slot.live.lock().await.net.as_ref().map(|n| n.policy()),
            None => None,
        };
        let mut set = tokio::task::JoinSet::new();
        for (i, id) in ids.iter().enumerate() {
            let (rt, image) = (self.clone(), image.clone());
            let spec = CreateSpec {
                sandbox_id: id.clone(),
                template_id: image.template_id.clone(),
                env_vars: BTreeMap::new(),
                network: network.clone(),
            };
            set.spawn(async move { (i, rt.create_from(&spec, &image, false).await) });
        }
        let mut out: Vec<Option<Result<SandboxVm, CreateError>>> =
            ids.iter().map(|_| None).collect();
        while let Some(j) = set.join_next().await {
            if let Ok((i, r)) = j {
                out[i] = Some(r);
            }
        }
        self.collect_snapshots();
        if self.inner.snapshots_dir().join(&sid).exists() {
            self.spawn_ingest(snap, true);
        }
        Ok(out
            .into_iter()
            .zip(ids)
            .map(|(r, id)| {
                r.unwrap_or_else(|| {
                    Err(CreateError::Io {
                        what: "fork task",
                        path: PathBuf::from(id),
                        source: std::io::Error::other("the fork task panicked"),
                    })
                })
            })
            .collect())
    }

    /// Stores a committed snapshot's files as chunks in the background, one snapshot at a time (the capture
    /// itself stays short):
    /// only chunks no earlier file had are written; `chunks.json` appears when all are durable. `sync`:
    /// the files are flushed to disk first (a fork's capture skips that on its critical path).
    fn spawn_ingest(&self, rec: SnapshotRecord, sync: bool) {
        let store = self.inner.store.clone();
        let inner = self.inner.clone();
        let template_build = self
            .inner
            .catalog
            .template(&rec.template_id)
            .map(|t| crate::sync::remote::template_build(&t));
        let dir = self.inner.snapshots_dir().join(&rec.id);
        tokio::spawn(async move {
            let _one_at_a_time = inner.ingests.lock().await;
            let t0 = Instant::now();
            // A fork's RAM capture lives only in its forks' memfd: nothing restores it later.
            let files: Vec<_> = rec
                .files()
                .into_iter()
                .filter(|(n, p)| !(*n == "ram.mem" && crate::vmm::launch::registered_ram_base(p)))
                .collect();
            if sync {
                let paths: Vec<PathBuf> = files.iter().map(|(_, p)| p.clone()).collect();
                let synced = tokio::task::spawn_blocking(move || {
                    paths
                        .iter()
                        .try_for_each(|p| std::fs::File::open(p)?.sync_data())
                })
                .await;
                if let Ok(Err(e)) = synced {
                    tracing::warn!(snapshot = %rec.id, error = %e, "flushing a fork's capture failed");
                }
            }
            let mut out = StoredChunks::default();
            let holder = format!("snapshot-{}", rec.id);
            for (name, path) in files {
                let mut attempt = 1;
                let ingested = loop {
                    // Page chunks only without a bucket (see `RAM_CHUNK_BYTES`).
                    let r = match name {
                        "ram.mem" if store.config().remote.is_none() => {
                            store
                                .ingest_chunked(&path, crate::config::RAM_CHUNK_BYTES)
                                .await
                        }
                        _ => store.ingest(&path).await,
                    };
                    match r {
                        Err(e) if attempt < INGEST_TRIES && dir.exists() => {
                            tracing::warn!(snapshot = %rec.id, file = name, error = %e, attempt, "chunk store ingest failed; retrying");
                            tokio::time::sleep(INGEST_RETRY * attempt).await;
                            attempt += 1;
                        }
                        r => break r,
                    }
                };
                match ingested {
                    Ok((m, st)) => {
                        let id = m.id();
                        if let Err(e) = store.pin(&id, &holder).await {
                            tracing::warn!(snapshot = %rec.id, error = %e, "pinning a manifest failed");
                        }
                        tracing::debug!(snapshot = %rec.id, file = name, bytes_new = st.bytes_new, bytes_data = st.bytes_data, "file stored as chunks");
                        out.manifests.insert(name.into(), id.to_hex());
                        out.bytes_data += st.bytes_data;
                        out.bytes_new += st.bytes_new;
                    }
                    Err(e) => {
                        tracing::warn!(snapshot = %rec.id, file = name, error = %e, "chunk store ingest failed");
                        let why = format!("{name}: {e}");
                        let _ = k3_common::fsutil::write_atomic(
                            &dir.join(STORE_FAILED_FILE),
                            why.as_bytes(),
                        );
                        return;
                    }
                }
            }
            out.elapsed_ms = t0.elapsed().as_secs_f64() * 1e3;
            match serde_json::to_vec_pretty(&out) {
                Ok(bytes) if dir.exists() => {
                    if let Err(e) = k3_common::fsutil::write_atomic(&dir.join(CHUNKS_FILE), &bytes)
                    {
                        tracing::warn!(snapshot = %rec.id, error = %e, "writing chunks.json failed");
                    }
                }
                _ => return,
            }
            let shared = crate::sync::remote::SharedSnapshot {
                record: rec.clone(),
                stored: out.clone(),
                template_build: template_build.unwrap_or_default(),
            };
            let live = inner.catalog.snapshot(&rec.id).is_some();
            if live && let Ok(meta) = serde_json::to_vec(&shared) {
                let _ = store
                    .put_meta(&crate::sync::remote::meta_key(&rec.id), &meta)
                    .await;
            }
            tracing::info!(snapshot = %rec.id, bytes_new = out.bytes_new, bytes_data = out.bytes_data, ms = out.elapsed_ms, "snapshot stored as chunks");
        });
    }

    /// Restores missing snapshot files (an evicted local copy) from the chunk store.
    pub(crate) async fn ensure_local(&self, rec: &SnapshotRecord) -> Result<(), SnapshotError> {
        let dir = self.inner.snapshots_dir().join(&rec.id);
        let stored = read_stored(&dir);
        for (name, path) in rec.files() {
            if path.exists() {
                continue;
            }
            let hex = stored
                .as_ref()
                .and_then(|s| s.manifests.get(name))
                .ok_or_else(|| {
                    SnapshotError::NotFound(format!(
                        "{} ({name} is gone and not in the chunk store)",
                        rec.id
                    ))
                })?;
            let id = agentenv_store::ManifestId::from_hex(hex)
                .ok_or_else(|| SnapshotError::NotFound(format!("{} (bad manifest id)", rec.id)))?;
            let store_err = |e: agentenv_store::StoreError| SnapshotError::Io {
                what: "restore from the chunk store",
                path: path.clone(),
                source: std::io::Error::other(e),
            };
            let m = self.inner.store.manifest(&id).await.map_err(store_err)?;
            let st = self
                .inner
                .store
                .materialize(&m, &path)
                .await
                .map_err(store_err)?;
            tracing::info!(snapshot = %rec.id, file = name, ?st, "snapshot file restored from chunks");
        }
        Ok(())
    }

    /// Removes deleted snapshots that no sandbox and no live snapshot depends on.
    pub(crate) fn collect_snapshots(&self) {
        loop {
            let mut needed: BTreeSet<String> = BTreeSet::new();
            let sdir = self.inner.cfg.state_dir.join("sandboxes");
            for e in std::fs::read_dir(&sdir).into_iter().flatten().flatten() {
                if let Ok(r) = persist::read::<VmRecord>(&e.path().join("sandbox.json")) {
                    needed.extend(r.parent_snapshot);
                }
            }
            let dead = self.inner.catalog.collect(needed);
            if dead.is_empty() {
                return;
            }
            for s in dead {
                let dir = self.inner.snapshots_dir().join(&s.id);
                // The record goes first: a crash mid-removal leaves no record pointing at missing files.
                let _ = std::fs::remove_file(dir.join("snapshot.json"));
                if let Some(r) = &s.ram {
                    crate::vmm::launch::forget_ram_base(r);
                    let _ = std::fs::remove_file(r);
                }
                self.release_chunks(&s.id, &dir);
                let _ = std::fs::remove_dir_all(&dir);
                tracing::info!(snapshot = %s.id, "snapshot files removed");
            }
        }
    }
}

impl Runtime {
    /// Unpins a removed snapshot's manifests and drops its metadata (the store's gc frees the chunks).
    fn release_chunks(&self, id: &str, dir: &Path) {
        let stored = read_stored(dir);
        let (Some(stored), Ok(handle)) = (stored, tokio::runtime::Handle::try_current()) else {
            return;
        };
        let store = self.inner.store.clone();
        let holder = format!("snapshot-{id}");
        let key = format!("snapshots/{id}");
        handle.spawn(async move {
            for hex in stored.manifests.values() {
                if let Some(m) = agentenv_store::ManifestId::from_hex(hex) {
                    let _ = store.unpin(&m, &holder).await;
                }
            }
            let _ = store.delete_meta(&key).await;
        });
    }
}

/// Copies RAM file `from` into `mem` (a fresh memfd), if any, sparsely.
async fn copy_into(
    from: &Path,
    mem: Option<std::fs::File>,
) -> Result<Option<std::fs::File>, SnapshotError> {
    let Some(mem) = mem else { return Ok(None) };
    let path = from.to_owned();
    let from = path.clone();
    tokio::task::spawn_blocking(move || {
        crate::sparse::copy_files(&std::fs::File::open(&from)?, &mem)?;
        Ok::<_, std::io::Error>(mem)
    })
    .await
    .map_err(std::io::Error::other)
    .and_then(|r| r)
    .map(Some)
    .map_err(|source| SnapshotError::Io {
        what: "copy into a memfd",
        path,
        source,
    })
}

/// Copies each `(from, to)` sparsely, unflushed, for the capture in `partial`.
async fn copy_files(pairs: Vec<(PathBuf, PathBuf)>, partial: &Path) -> Result<(), SnapshotError> {
    let r = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
        for (from, to) in pairs {
            fsops::sparse_copy(&from, &to)?;
        }
        Ok(())
    })
    .await
    .map_err(std::io::Error::other)
    .and_then(|r| r);
    r.map_err(|source| SnapshotError::Io {
        what: "capture",
        path: partial.to_owned(),
        source,
    })
}

/// Flushes `names` in folder `dir` and the folder itself, each on its own thread so that the
/// filesystem commits them together. A capture's RAM copy is not flushed: it becomes durable through the chunk store, and a
/// capture whose host went down before that is not restored with memory (see [`load_all`]).
async fn flush_files(dir: &Path, names: &[&str]) -> Result<(), SnapshotError> {
    let flushes: Vec<_> = names
        .iter()
        .map(|name| dir.join(name))
        .chain([dir.to_owned()])
        .map(|path| {
            let p = path.clone();
            let h = tokio::task::spawn_blocking(move || std::fs::File::open(&p)?.sync_all());
            (path, h)
        })
        .collect();
    for (path, h) in flushes {
        h.await
            .map_err(std::io::Error::other)
            .and_then(|r| r)
            .map_err(|source| SnapshotError::Io {
                what: "fsync",
                path,
                source,
            })?;
    }
    Ok(())
}

#[cfg(test)]
#[path = "snapshot_tests.rs"]
pub(crate) mod tests;
