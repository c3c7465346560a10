//! Volumes kept in a bucket too (servers with `--s3-bucket`), through the [`VolumeBucket`] seam
//! that the server fills with the chunk store (this crate knows no S3).
//!
//! A flush walks a volume, copies its files into a pack (each file from a chunk boundary, after a
//! header chunk unique to this flush), stores the pack (only chunks the bucket lacks are uploaded)
//! and then writes the volume's manifest (`volumes/<owner tag>/<id>`, a MAC'd metadata blob: the
//! record, every entry and the pack's id); the previous pack is deleted last. A crash midway keeps
//! the previous manifest valid. A volume whose record is here but not its files (`data/`) is
//! restored from its manifest on first use, through the confined operations of `beneath.rs`, after
//! the whole manifest was checked.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use agentenv_vm::volume_bucket::{BucketError, PackPut, VolumeBucket};

use super::beneath::Root;
use super::pack::{
    Entry, MANIFEST_FORMAT, MAX_MANIFEST_BYTES, VolumeManifest, bad, check_pack, fill, parse, walk,
    write_data, write_pack,
};
use super::{Result, Volume, VolumeError, Volumes, io};

/// Metadata prefix of volume manifests.
pub const PREFIX: &str = "volumes/";
/// How often the sync task looks for volumes to flush.
pub const TICK: Duration = Duration::from_secs(5);
/// Quiet time after a content API call before its flush.
const DEBOUNCE: Duration = Duration::from_secs(3);
/// Flush interval of a volume that stays dirty or mounted.
const EVERY: Duration = Duration::from_secs(30);

/// What a flush did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FlushStats {
    pub entries: usize,
    /// Bytes of the volume's files.
    pub bytes: u64,
    /// Chunks the bucket did not hold before (the pack's header included).
    pub chunks_new: u64,
    /// Stored bytes uploaded.
    pub bytes_uploaded: u64,
}

#[derive(Default)]
struct SyncState {
    /// First and last content API use since the last flush.
    dirty: Option<(Instant, Instant)>,
    last_flush: Option<Instant>,
    /// Of the tree the last flush or restore saw (in memory only).
    fingerprint: Option<u64>,
    mounted: bool,
    /// After a failed flush, the next try waits till then.
    retry_after: Option<Instant>,
}

/// The bucket side of [`Volumes`].
pub(crate) struct Bucket {
    store: Arc<dyn VolumeBucket>,
    handle: tokio::runtime::Handle,
    /// Flushes and restores, one at a time.
    busy: tokio::sync::Mutex<()>,
    state: Mutex<HashMap<String, SyncState>>,
}

fn store_err(what: &'static str, volume: &str) -> impl FnOnce(BucketError) -> VolumeError {
    let volume = volume.to_owned();
    move |source| VolumeError::Store {
        what,
        volume,
        source,
    }
}

fn owner_tag(owner: &str) -> String {
    crate::keys::hmac_sha256_hex(b"agentenv volume owner", owner.as_bytes())[..32].to_owned()
}

/// The metadata key of `owner`'s volume `id`.
pub fn key(owner: &str, id: &str) -> String {
    format!("{PREFIX}{}/{id}", owner_tag(owner))
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| VolumeError::Runtime(e.to_string()))?
}

impl Volumes {
    /// Keeps every volume in `store`'s bucket too, flushed by a task of its own (every [`TICK`]).
    pub fn attach_bucket(self: &Arc<Self>, store: Arc<dyn VolumeBucket>) -> Result<()> {
        self.attach_bucket_every(store, TICK)
    }

    /// [`Volumes::attach_bucket`] with the sync task looking every `tick`.
    pub fn attach_bucket_every(
        self: &Arc<Self>,
        store: Arc<dyn VolumeBucket>,
        tick: Duration,
    ) -> Result<()> {
        let handle = tokio::runtime::Handle::try_current()
            .map_err(|e| VolumeError::Runtime(e.to_string()))?;
        let b = Arc::new(Bucket {
            store,
            handle,
            busy: tokio::sync::Mutex::new(()),
            state: Mutex::default(),
        });
        if self.bucket.set(b).is_err() {
            return Err(VolumeError::Runtime("a bucket is attached already".into()));
        }
        // Packs a crash left behind.
        let _ = std::fs::remove_dir_all(self.dir.join(".packs"));
        // Changes from before a restart (or a crash) are flushed once.
        for v in self.all() {
            self.touch(&v.volume_id);
        }
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(tick).await;
                let Some(v) = weak.upgrade() else { break };
                v.tick().await;
            }
        });
        Ok(())
    }

    fn bucket(&self) -> Option<&Arc<Bucket>> {
        self.bucket.get()
    }

    /// Runs `f` to its end from this synchronous call (a multi-thread runtime's worker gives its
    /// thread up meanwhile).
    pub(super) fn block<T>(&self, f: impl std::future::Future<Output = Result<T>>) -> Result<T> {
        use tokio::runtime::{Handle, RuntimeFlavor};
        match (Handle::try_current(), self.bucket()) {
            (Ok(h), _) if h.runtime_flavor() == RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(|| h.block_on(f))
            }
            (Ok(_), _) => Err(VolumeError::Runtime(
                "bucket calls need a multi-thread runtime".into(),
            )),
            (Err(_), Some(b)) => b.handle.block_on(f),
            (Err(e), None) => Err(VolumeError::Runtime(e.to_string())),
        }
    }

    /// Notes a content API use of volume `id` (flushed once quiet for a while).
    pub(super) fn touch(&self, id: &str) {
        if let Some(b) = self.bucket() {
            let now = Instant::now();
            let mut st = b.state.lock().unwrap_or_else(|e| e.into_inner());
            let s = st.entry(id.into()).or_default();
            s.dirty = Some((s.dirty.map_or(now, |d| d.0), now));
        }
    }

    /// Flushes what is due: quiet dirty volumes, mounted ones every [`EVERY`], unmounted ones now.
    async fn tick(&self) {
        for id in self.due(false) {
            if let Err(e) = self.flush(&id).await {
                tracing::warn!(volume = %id, error = %e, "volume not flushed to the bucket");
                if let Some(b) = self.bucket() {
                    let mut st = b.state.lock().unwrap_or_else(|e| e.into_inner());
                    st.entry(id).or_default().retry_after = Some(Instant::now() + EVERY);
                }
            }
        }
    }

    /// Volumes to flush now (`all`: every one touched or mounted since its last flush).
    fn due(&self, all: bool) -> Vec<String> {
        let Some(b) = self.bucket() else {
            return vec![];
        };
        let mounted: HashSet<String> = {
            let m = self.mounted.lock().unwrap_or_else(|e| e.into_inner());
            m.iter()
                .filter(|(_, d)| d.strong_count() > 0)
                .map(|(id, _)| id.clone())
                .collect()
        };
        let now = Instant::now();
        let mut st = b.state.lock().unwrap_or_else(|e| e.into_inner());
        for id in &mounted {
            st.entry(id.clone()).or_default();
        }
        st.iter_mut()
            .filter_map(|(id, s)| {
                let is = mounted.contains(id);
                let stale = all || s.last_flush.is_none_or(|t| now - t >= EVERY);
                let due = (s.mounted && !is)
                    || (is && stale)
                    || s.dirty.is_some_and(|(first, last)| {
                        all || now - last >= DEBOUNCE || now - first >= EVERY
                    });
                s.mounted = is;
                let wait = !all && s.retry_after.is_some_and(|t| now < t);
                if due && wait {
                    // Tried again once the wait is over.
                    s.dirty.get_or_insert((now, now));
                }
                (due && !wait).then(|| id.clone())
            })
            .collect()
    }

    /// Flushes every volume touched or mounted since its last flush (at shutdown).
    pub async fn flush_all(&self) {
        for id in self.due(true) {
            if let Err(e) = self.flush(&id).await {
                tracing::warn!(volume = %id, error = %e, "volume not flushed to the bucket");
            }
        }
    }

    /// Writes volume `id` to the bucket unless its tree is as the last flush saw it; `None` when
    /// nothing was written (no bucket, no such volume here, or no change).
    pub async fn flush(&self, id: &str) -> Result<Option<FlushStats>> {
        let Some(b) = self.bucket().cloned() else {
            return Ok(None);
        };
        let _busy = b.busy.lock().await;
        let Some(vol) = self.read(id) else {
            return Ok(None);
        };
        let data = self.dir.join(id).join("data");
        if !data.is_dir() {
            return Ok(None);
        }
        let started = Instant::now();
        let d = data.clone();
        let (entries, fp) =
            blocking(move || walk(&Root::open(&d).map_err(io("opening", &d))?)).await?;
        let same = {
            let st = b.state.lock().unwrap_or_else(|e| e.into_inner());
            st.get(id).and_then(|s| s.fingerprint) == Some(fp)
        };
        if !same {
            let stats = self.upload(&b, &vol, &data, entries).await?;
            let mut st = b.state.lock().unwrap_or_else(|e| e.into_inner());
            let s = st.entry(id.into()).or_default();
            s.fingerprint = Some(fp);
            s.last_flush = Some(Instant::now());
            s.dirty = s.dirty.filter(|&(_, last)| last > started);
            s.retry_after = None;
            tracing::info!(volume = %id, entries = stats.entries, bytes = stats.bytes,
                chunks_new = stats.chunks_new, "volume flushed to the bucket");
            return Ok(Some(stats));
        }
        let mut st = b.state.lock().unwrap_or_else(|e| e.into_inner());
        let s = st.entry(id.into()).or_default();
        s.last_flush = Some(Instant::now());
        s.dirty = s.dirty.filter(|&(_, last)| last > started);
        s.retry_after = None;
        Ok(None)
    }

    async fn upload(
        &self,
        b: &Bucket,
        vol: &Volume,
        data: &Path,
        mut entries: Vec<Entry>,
    ) -> Result<FlushStats> {
        let id = vol.volume_id.clone();
        let key = key(&vol.owner, &id);
        let old = match b.store.get_meta(&key).await {
            Ok(Some(bytes)) => parse(&id, &bytes).ok(),
            Ok(None) => None,
            Err(e) => return Err(store_err("reading the manifest", &id)(e)),
        };
        // Another node wrote the volume since this one last wrote or restored it: never overwritten.
        let ours = self.generation(&id);
        if let Some(o) = old.as_ref().filter(|o| o.generation > ours) {
            let theirs = o.generation;
            return Err(store_err("keeping a newer copy", &id)(
                format!("the bucket holds generation {theirs}, this node {ours}").into(),
            ));
        }
        let cs = b.store.chunk_size();
        let packs = self.dir.join(".packs");
        k3_common::fsutil::create_private_dir(&packs).map_err(io("creating", &packs))?;
        let pack = packs.join(format!("{id}-{:016x}", rand::random::<u64>()));
        let (p, d, i) = (pack.clone(), data.to_owned(), id.clone());
        let built = blocking(move || {
            let root = Root::open(&d).map_err(io("opening", &d))?;
            write_pack(&root, &p, &i, cs, &mut entries)?;
            Ok(entries)
        })
        .await;
        let ingested = match built {
            Ok(e) => b.store.put_pack(&pack).await.map(|r| (e, r)),
            Err(e) => {
                let _ = std::fs::remove_file(&pack);
                return Err(e);
            }
        };
        let _ = std::fs::remove_file(&pack);
        let (entries, put) = ingested.map_err(store_err("storing the files", &id))?;
        let stats = FlushStats {
            entries: entries.len(),
            bytes: entries.iter().map(|e| e.size).sum(),
            chunks_new: put.chunks_new,
            bytes_uploaded: put.bytes_uploaded,
        };
        let vm = VolumeManifest {
            format: MANIFEST_FORMAT,
            volume: vol.clone(),
            generation: old.as_ref().map_or(1, |o| o.generation + 1),
            chunk_size: cs,
            pack: put.id,
            entries,
        };
        let bytes = serde_json::to_vec(&vm).map_err(|e| VolumeError::Runtime(e.to_string()))?;
        if bytes.len() > MAX_MANIFEST_BYTES {
            return Err(bad(
                &id,
                format!("{} bytes, at most {MAX_MANIFEST_BYTES}", bytes.len()),
            ));
        }
        b.store
            .put_meta(&key, &bytes)
            .await
            .map_err(store_err("writing the manifest", &id))?;
        self.set_generation(&id, vm.generation)?;
        if let Some(o) = old.filter(|o| o.pack != vm.pack)
            && let Err(e) = b.store.delete_pack(&o.pack).await
        {
            tracing::warn!(volume = %id, error = %e, "an old volume pack stays in the bucket");
        }
        Ok(stats)
    }

    /// The manifest generation this node last wrote or restored of volume `id` (0: none).
    fn generation(&self, id: &str) -> u64 {
        std::fs::read_to_string(self.dir.join(id).join("generation"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    fn set_generation(&self, id: &str, generation: u64) -> Result<()> {
        let p = self.dir.join(id).join("generation");
        k3_common::fsutil::write_atomic(&p, generation.to_string().as_bytes())
            .map_err(io("writing", &p))
    }

    /// Removes `owner`'s volume `id` from the bucket, then runs `then` (no flush meanwhile).
    pub(super) fn forget(
        &self,
        owner: &str,
        id: &str,
        then: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let Some(b) = self.bucket().cloned() else {
            return then();
        };
        self.block(async {
            let _busy = b.busy.lock().await;
            let key = key(owner, id);
            let old = b.store.get_meta(&key).await.ok().flatten();
            b.store
                .delete_meta(&key)
                .await
                .map_err(store_err("deleting the manifest", id))?;
            if let Some(o) = old.and_then(|o| parse(id, &o).ok()) {
                let _ = b.store.delete_pack(&o.pack).await;
            }
            b.state.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
            then()
        })
    }

    /// Records of `owner`'s volumes (or with `None`, of volume `only`) that are in the bucket and
    /// not here yet, written here without their files.
    pub(super) fn learn(&self, owner: Option<&str>, only: Option<&str>) -> Result<()> {
        let Some(b) = self.bucket().cloned() else {
            return Ok(());
        };
        self.block(async {
            let prefix = owner.map_or(PREFIX.to_owned(), |o| format!("{PREFIX}{}/", owner_tag(o)));
            let keys = b
                .store
                .list_meta(&prefix)
                .await
                .map_err(store_err("listing volumes", "*"))?;
            for key in keys {
                let Some(id) = key.rsplit('/').next() else {
                    continue;
                };
                if only.is_some_and(|o| o != id) || self.read(id).is_some() {
                    continue;
                }
                let Some(bytes) = b
                    .store
                    .get_meta(&key)
                    .await
                    .map_err(store_err("reading", id))?
                else {
                    continue;
                };
                let vm = parse(id, &bytes).and_then(|vm| {
                    if self::key(&vm.volume.owner, id) == key {
                        Ok(vm)
                    } else {
                        Err(bad(id, "its key does not match its owner"))
                    }
                });
                match vm {
                    Ok(vm) => self.write_record(&vm.volume)?,
                    // Asked for by id: its error; else the others still come.
                    Err(e) if only.is_some() => return Err(e),
                    Err(e) => tracing::warn!(error = %e, "a volume in the bucket is not listed"),
                }
            }
            Ok(())
        })
    }

    /// Restores the files of volume `id` from the bucket when its record is here and they are not.
    pub async fn restore(&self, id: &str) -> Result<()> {
        let Some(b) = self.bucket().cloned() else {
            return Ok(());
        };
        let dir = self.dir.join(id);
        // Here already (the common case): no wait for a flush in progress.
        if self.read(id).is_some() && dir.join("data").is_dir() {
            return Ok(());
        }
        let _busy = b.busy.lock().await;
        let Some(vol) = self.read(id) else {
            return Err(VolumeError::NotFound(id.into()));
        };
        if dir.join("data").is_dir() {
            return Ok(());
        }
        let bytes = b
            .store
            .get_meta(&key(&vol.owner, id))
            .await
            .map_err(store_err("reading the manifest", id))?;
        let Some(bytes) = bytes else {
            // Created but never flushed: empty.
            return write_data(&dir, |_| Ok(())).map(|_| ());
        };
        let vm = parse(id, &bytes)?;
        if vm.volume != vol {
            return Err(bad(id, "its record differs from this volume's"));
        }
        let len = b
            .store
            .pack_len(&vm.pack)
            .await
            .map_err(store_err("reading the pack", id))?;
        check_pack(id, &vm, len)?;
        let tmp = dir.join(".restore.pack");
        let _ = std::fs::remove_file(&tmp);
        b.store
            .get_pack(&vm.pack, &tmp)
            .await
            .map_err(store_err("fetching the files", id))?;
        let (d, t, cs, generation) = (dir.clone(), tmp.clone(), vm.chunk_size, vm.generation);
        let done = blocking(move || {
            let mut f = std::fs::File::open(&t).map_err(io("opening", &t))?;
            write_data(&d, |root| fill(root, &vm.entries, &mut f, cs))
        })
        .await;
        let _ = std::fs::remove_file(&tmp);
        let fp = done?;
        self.set_generation(id, generation)?;
        tracing::info!(volume = %id, generation, "volume restored from the bucket");
        let mut st = b.state.lock().unwrap_or_else(|e| e.into_inner());
        st.entry(id.into()).or_default().fingerprint = Some(fp);
        Ok(())
    }
}
