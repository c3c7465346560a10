//! [`ChunkStore`]: opening, metadata, manifests, pins, eviction and gc. Ingest and materialize live in
//! their own modules.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;

use crate::chunk::{self, ChunkId, Compression, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE};
use crate::error::{Result, StoreError};
use crate::local::{Index, LocalDir};
use crate::manifest::{Manifest, ManifestId};
use crate::remote::{Remote, RemoteConfig};

/// Metadata prefix of manifests (reserved: only the store writes there).
pub const MANIFEST_PREFIX: &str = "manifests/";

/// How to open a [`ChunkStore`].
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Local folder (chunks, metadata, pins).
    pub dir: PathBuf,
    /// Bound of the local chunk files in bytes (stored size). With a remote, least recently used chunks
    /// are evicted to stay within it, those no pinned manifest needs first (the bucket keeps them all);
    /// local only, the folder is the durable store, and only chunks no manifest references are removed.
    pub max_local_bytes: u64,
    /// Chunk size, a power of two in 4 KiB..=4 MiB (default 64 KiB).
    pub chunk_size: usize,
    /// Per-chunk compression (default none).
    pub compression: Compression,
    /// Optional S3-compatible bucket.
    pub remote: Option<RemoteConfig>,
    /// Remote transfers in flight at once (default 16).
    pub remote_concurrency: usize,
    /// Remote gc spares unreferenced chunks younger than this (another server's running ingest may own
    /// them); default 1 hour.
    pub remote_gc_grace: Duration,
    /// How long [`ChunkStore::open`] waits for the folder lock that another opener holds (a restarting
    /// server whose old process is still exiting); default 10 s.
    pub lock_wait: Duration,
}

impl StoreConfig {
    /// A local-only store in `dir` bounded to `max_local_bytes`, with the defaults.
    pub fn local(dir: impl Into<PathBuf>, max_local_bytes: u64) -> Self {
        StoreConfig {
            dir: dir.into(),
            max_local_bytes,
            chunk_size: 64 << 10,
            compression: Compression::None,
            remote: None,
            remote_concurrency: 16,
            remote_gc_grace: Duration::from_secs(3600),
            lock_wait: Duration::from_secs(10),
        }
    }

    /// The same with a remote bucket.
    pub fn with_remote(mut self, remote: RemoteConfig) -> Self {
        self.remote = Some(remote);
        self
    }
}

/// What the local folder holds now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalStats {
    /// Stored bytes of local chunk files.
    pub bytes: u64,
    /// Number of local chunk files.
    pub chunks: usize,
    /// [`StoreConfig::max_local_bytes`].
    pub max_bytes: u64,
    /// Manifests known locally.
    pub manifests: usize,
    /// Manifests with at least one pin.
    pub pinned_manifests: usize,
}

/// What [`ChunkStore::gc`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcStats {
    /// Local chunk files removed.
    pub local_chunks: usize,
    /// Their stored bytes.
    pub local_bytes: u64,
    /// Remote chunk objects removed (the layout before packs).
    pub remote_chunks: usize,
    /// Remote packs removed.
    pub remote_packs: usize,
}

/// What [`ChunkStore::verify`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerifyReport {
    /// Local chunk files read.
    pub chunks: usize,
    /// Their stored bytes.
    pub bytes: u64,
    /// Local chunk files whose bytes do not match their name.
    pub corrupt: Vec<ChunkId>,
    /// `(manifest, chunk)` pairs whose chunk is not local (expected with a remote; data loss without).
    pub missing: Vec<(ManifestId, ChunkId)>,
}

/// A content-addressed chunk store: a bounded local folder plus an optional bucket. Cheap to clone.
#[derive(Clone)]
pub struct ChunkStore {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) cfg: StoreConfig,
    pub(crate) dir: LocalDir,
    pub(crate) remote: Option<Remote>,
    pub(crate) index: Mutex<Index>,
    /// Held (shared) by each background cache write; [`ChunkStore::settle`] takes it whole.
    caching: Arc<tokio::sync::RwLock<()>>,
    /// Bumped by [`ChunkStore::settle`]: cache writes waiting out [`CACHE_DELAY`] start at once.
    hurry: tokio::sync::watch::Sender<u64>,
    _lock: std::fs::File,
}

pub(crate) async fn blocking<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| StoreError::Worker {
            what,
            detail: e.to_string(),
        })?
}

/// How long fetched chunks wait before they enter the local cache: the restore that fetched them and its
/// first commands run meanwhile (measured: creating thousands of chunk files slowed them down).
pub(crate) const CACHE_DELAY: std::time::Duration = std::time::Duration::from_secs(2);

/// Runs `f` on a thread of its own at a lower CPU priority (nice +10): hashing and writing a snapshot's
/// chunks yields the cores to the sandboxes and API calls running meanwhile.
pub(crate) async fn in_background<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    k3_common::background::spawn(format!("store-{what}"), move || {
        let _ = tx.send(f());
    })
    .map_err(|e| StoreError::Worker {
        what,
        detail: e.to_string(),
    })?;
    rx.await.map_err(|_| StoreError::Worker {
        what,
        detail: "the worker thread ended without an answer".into(),
    })?
}

pub(crate) fn chunk_key(id: &ChunkId) -> String {
    format!("chunks/{}", id.to_hex())
}

fn manifest_key(id: &ManifestId) -> String {
    format!("{MANIFEST_PREFIX}{}", id.to_hex())
}

/// Keys: 1..=200 characters of `[A-Za-z0-9._-/]`, `/`-separated non-empty segments other than `.`/`..`.
fn check_key(key: &str) -> Result<()> {
    let bad = |detail| {
        Err(StoreError::BadKey {
            key: key.to_owned(),
            detail,
        })
    };
    if key.is_empty() || key.len() > 200 {
        return bad("length must be 1..=200");
    }
    if !key
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/'))
    {
        return bad("allowed characters are A-Z a-z 0-9 . _ - /");
    }
    if key
        .split('/')
        .any(|s| s.is_empty() || s == "." || s == "..")
    {
        return bad("empty, '.' or '..' path segment");
    }
    Ok(())
}

fn check_user_key(key: &str) -> Result<()> {
    check_key(key)?;
    if key.starts_with(MANIFEST_PREFIX) {
        return Err(StoreError::BadKey {
            key: key.to_owned(),
            detail: "the manifests/ prefix is written by the store only",
        });
    }
    Ok(())
}

fn check_holder(holder: &str) -> Result<()> {
    if holder.is_empty()
        || holder.len() > 64
        || !holder
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    {
        return Err(StoreError::BadKey {
            key: holder.to_owned(),
            detail: "pin holders are 1..=64 characters of A-Z a-z 0-9 . _ -",
        });
    }
    Ok(())
}

impl ChunkStore {
    /// Opens (creating) the store folder: takes its lock, empties `tmp/`, indexes chunk files (LRU order
    /// from their mtimes), and loads local manifests and pins.
    pub async fn open(cfg: StoreConfig) -> Result<ChunkStore> {
        let cs = cfg.chunk_size;
        if !(MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&cs) || !cs.is_power_of_two() {
            return Err(StoreError::Config(format!(
                "chunk size {cs}: a power of two in {MIN_CHUNK_SIZE}..={MAX_CHUNK_SIZE}"
            )));
        }
        if cfg.remote_concurrency == 0 {
            return Err(StoreError::Config("remote_concurrency is 0".into()));
        }
        let remote = cfg.remote.as_ref().map(Remote::new).transpose()?;
        let dir = LocalDir::new(cfg.dir.clone());
        let d = dir.clone();
        let lock_wait = cfg.lock_wait;
        let (lock, index) = blocking("open", move || {
            let lock = d.prepare(lock_wait)?;
            let mut index = Index::default();
            let mut files = d.scan_chunks()?;
            files.sort_by_key(|&(_, _, mtime)| mtime);
            for (id, len, _) in files {
                index.insert(id, len);
            }
            for key in d.meta_keys()? {
                let Some(hex) = key.strip_prefix(MANIFEST_PREFIX) else {
                    continue;
                };
                let id = ManifestId::from_hex(hex).ok_or_else(|| StoreError::BadManifest {
                    id: hex.to_owned(),
                    detail: "file name is not a manifest id".into(),
                })?;
                let p = d.meta_path(&key);
                let bytes = std::fs::read(&p).map_err(StoreError::io("read", &p))?;
                index.add_manifest(id, Arc::new(Manifest::from_bytes(&id, &bytes)?));
            }
            for (id, holder) in d.scan_pins()? {
                index.pin(id, holder);
            }
            Ok((lock, index))
        })
        .await?;
        tracing::debug!(dir = %cfg.dir.display(), chunks = index.n_chunks(), bytes = index.total_bytes(),
            manifests = index.manifests.len(), remote = remote.is_some(), "chunk store open");
        Ok(ChunkStore {
            inner: Arc::new(Inner {
                cfg,
                dir,
                remote,
                index: Mutex::new(index),
                caching: Arc::default(),
                hurry: tokio::sync::watch::Sender::new(0),
                _lock: lock,
            }),
        })
    }

    /// The config it was opened with.
    pub fn config(&self) -> &StoreConfig {
        &self.inner.cfg
    }

    pub(crate) fn index(&self) -> MutexGuard<'_, Index> {
        self.inner.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What the local folder holds now.
    pub fn local_stats(&self) -> LocalStats {
        let ix = self.index();
        LocalStats {
            bytes: ix.total_bytes(),
            chunks: ix.n_chunks(),
            max_bytes: self.inner.cfg.max_local_bytes,
            manifests: ix.manifests.len(),
            pinned_manifests: ix.pins.len(),
        }
    }

    /// Whether chunk `id` is in the local folder.
    pub fn has_local(&self, id: &ChunkId) -> bool {
        self.index().has(id)
    }

    /// Evicts least recently used chunks (see [`StoreConfig::max_local_bytes`]) until within the bound or
    /// nothing more may go. Returns the number of chunks removed.
    pub fn evict(&self) -> usize {
        let victims = self.evict_locked(&mut self.index());
        self.remove_chunk_files(&victims)
    }

    fn evict_locked(&self, ix: &mut Index) -> Vec<ChunkId> {
        ix.evict_to(self.inner.cfg.max_local_bytes, self.inner.remote.is_some())
    }

    fn remove_chunk_files(&self, ids: &[ChunkId]) -> usize {
        for id in ids {
            let _ = std::fs::remove_file(self.inner.dir.chunk_path(id));
        }
        ids.len()
    }

    /// Stores a fetched chunk locally (already verified). Insertion and eviction share one lock, so no
    /// reader of the index sees the cache over its bound.
    pub(crate) fn cache_chunk(&self, id: &ChunkId, stored: &[u8]) -> Result<()> {
        self.inner.dir.write_chunk(id, stored, false)?;
        let victims = {
            let mut ix = self.index();
            ix.insert(*id, stored.len() as u64);
            self.evict_locked(&mut ix)
        };
        self.remove_chunk_files(&victims);
        Ok(())
    }

    /// Copies chunks of a file just written into the local cache on a low-priority thread, off the
    /// caller's path (a restore's first command should not wait for thousands of small files), after
    /// [`CACHE_DELAY`] (nor share the cores with them): each `(id, offset, length)` is read back from
    /// `file` and kept only if it still hashes to `id`. Holds no chunk bytes meanwhile. Best effort: a
    /// failure only costs a later fetch.
    pub(crate) async fn cache_later(
        &self,
        file: Arc<std::fs::File>,
        chunks: Vec<(ChunkId, u64, usize)>,
    ) {
        if chunks.is_empty() {
            return;
        }
        let guard = self.inner.caching.clone().read_owned().await;
        let mut hurry = self.inner.hurry.subscribe();
        let me = self.clone();
        tokio::spawn(async move {
            let n = chunks.len();
            tokio::select! {
                () = tokio::time::sleep(CACHE_DELAY) => {}
                _ = hurry.changed() => {}
            }
            let r = in_background("cache", move || {
                use std::os::unix::fs::FileExt;
                let mut buf = Vec::new();
                let mut pacer = k3_common::background::Pacer::default();
                for (id, off, len) in chunks {
                    pacer.pace();
                    buf.resize(len, 0);
                    file.read_exact_at(&mut buf, off)
                        .map_err(|e| StoreError::Worker {
                            what: "cache",
                            detail: format!("read back at {off}: {e}"),
                        })?;
                    if ChunkId::of(&buf) != id {
                        continue; // changed since: the caller owns the file now
                    }
                    me.cache_chunk(&id, &chunk::encode(&buf, me.inner.cfg.compression))?;
                }
                Ok(())
            })
            .await;
            if let Err(e) = r {
                tracing::warn!(chunks = n, error = %e, "caching fetched chunks failed");
            }
            drop(guard);
        });
    }

    /// Waits until the fetched chunks of every earlier [`ChunkStore::materialize`] are in the local cache.
    pub async fn settle(&self) {
        self.inner.hurry.send_modify(|g| *g += 1);
        drop(self.inner.caching.write().await);
    }

    /// The raw bytes of chunk `id`: local if present, else fetched from the remote and cached. Verified.
    pub async fn chunk(&self, id: &ChunkId) -> Result<Vec<u8>> {
        let me = self.clone();
        let cid = *id;
        let local = blocking("read chunk", move || {
            let p = me.inner.dir.chunk_path(&cid);
            match me.inner.dir.read_chunk(&cid)? {
                Some(stored) => {
                    me.index().touch(&cid);
                    chunk::decode(&cid, &stored, &p.display()).map(Some)
                }
                None => Ok(None),
            }
        })
        .await?;
        if let Some(d) = local {
            return Ok(d);
        }
        let (data, stored) = self.fetch_chunk(id).await?;
        let me = self.clone();
        let cid = *id;
        blocking("cache chunk", move || me.cache_chunk(&cid, &stored)).await?;
        Ok(data)
    }

    /// Stores a metadata blob under `key` (remote first, then locally), replacing an older one.
    /// The MAC key of metadata blobs: the remote's ([`RemoteConfig::meta_key`]); none without a remote.
    fn meta_key(&self) -> Option<&[u8; 32]> {
        self.inner.cfg.remote.as_ref().map(|r| &r.meta_key)
    }

    pub async fn put_meta(&self, key: &str, bytes: &[u8]) -> Result<()> {
        check_user_key(key)?;
        match self.meta_key() {
            Some(k) => {
                self.put_meta_raw(key, &crate::remote::seal(k, key, bytes))
                    .await
            }
            None => self.put_meta_raw(key, bytes).await,
        }
    }

    pub(crate) async fn put_meta_raw(&self, key: &str, bytes: &[u8]) -> Result<()> {
        if let Some(r) = &self.inner.remote {
            r.put(&format!("meta/{key}"), Bytes::copy_from_slice(bytes))
                .await?;
        }
        let p = self.inner.dir.meta_path(key);
        let b = bytes.to_vec();
        blocking("write meta", move || {
            k3_common::fsutil::write_atomic(&p, &b).map_err(StoreError::io("write", &p))
        })
        .await
    }

    /// The metadata blob under `key`; with a remote, the bucket's copy (the local one is a cache).
    pub async fn get_meta(&self, key: &str) -> Result<Option<Vec<u8>>> {
        check_key(key)?;
        let p = self.inner.dir.meta_path(key);
        if let Some(r) = &self.inner.remote {
            let got = r.get(&format!("meta/{key}")).await?;
            let b = got.as_ref().map(|b| b.to_vec());
            let cache = b.clone();
            blocking("cache meta", move || {
                match cache {
                    Some(b) => k3_common::fsutil::write_atomic(&p, &b)
                        .map_err(StoreError::io("write", &p))?,
                    None => {
                        let _ = std::fs::remove_file(&p);
                    }
                }
                Ok(())
            })
            .await?;
            let key_mac = self.meta_key().expect("a remote has a MAC key");
            return Ok(b.and_then(|b| match crate::remote::open(key_mac, key, &b) {
                Some(body) => Some(body.to_vec()),
                None => {
                    tracing::warn!(key, "bucket metadata without a valid MAC: ignored");
                    None
                }
            }));
        }
        match std::fs::read(&p) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StoreError::io("read", &p)(e)),
        }
    }

    /// Metadata keys starting with `prefix`, sorted (from the bucket when there is one).
    pub async fn list_meta(&self, prefix: &str) -> Result<Vec<String>> {
        if !prefix.is_empty() {
            check_key(prefix.trim_end_matches('/'))?;
        }
        if let Some(r) = &self.inner.remote {
            let mut keys: Vec<String> = r
                .list(&format!("meta/{prefix}"))
                .await?
                .into_iter()
                .filter_map(|l| l.key.strip_prefix("meta/").map(str::to_owned))
                .collect();
            keys.sort();
            return Ok(keys);
        }
        Ok(self
            .inner
            .dir
            .meta_keys()?
            .into_iter()
            .filter(|k| k.starts_with(prefix))
            .collect())
    }

    /// Deletes the metadata blob under `key` (no error if absent).
    pub async fn delete_meta(&self, key: &str) -> Result<()> {
        check_user_key(key)?;
        self.delete_meta_raw(key).await
    }

    async fn delete_meta_raw(&self, key: &str) -> Result<()> {
        if let Some(r) = &self.inner.remote {
            r.delete(&format!("meta/{key}")).await?;
        }
        let p = self.inner.dir.meta_path(key);
        match std::fs::remove_file(&p) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::io("remove", &p)(e)),
        }
    }

    /// Makes a manifest durable: its chunks are already written (and uploaded); flush them, then the
    /// manifest (bucket first, then the local folder).
    pub(crate) async fn commit_manifest(&self, m: &Manifest) -> Result<ManifestId> {
        let id = m.id();
        let bytes = m.to_bytes();
        let dir = self.inner.dir.clone();
        blocking("sync chunks", move || dir.sync()).await?;
        self.put_meta_raw(&manifest_key(&id), &bytes).await?;
        self.index().add_manifest(id, Arc::new(m.clone()));
        Ok(id)
    }

    /// The manifest `id`, from the local folder or else the bucket (then cached locally).
    pub async fn manifest(&self, id: &ManifestId) -> Result<Manifest> {
        if let Some(m) = self.index().manifests.get(id) {
            return Ok((**m).clone());
        }
        let not_found = || StoreError::ManifestNotFound { id: id.to_hex() };
        let r = self.inner.remote.as_ref().ok_or_else(not_found)?;
        let key = manifest_key(id);
        let bytes = r.get(&format!("meta/{key}")).await?.ok_or_else(not_found)?;
        let m = Manifest::from_bytes(id, &bytes)?;
        let p = self.inner.dir.meta_path(&key);
        blocking("cache manifest", move || {
            k3_common::fsutil::write_atomic(&p, &bytes).map_err(StoreError::io("write", &p))
        })
        .await?;
        self.index().add_manifest(*id, Arc::new(m.clone()));
        Ok(m)
    }

    /// Ids of every stored manifest (from the bucket when there is one).
    pub async fn list_manifests(&self) -> Result<Vec<ManifestId>> {
        Ok(self
            .list_meta(MANIFEST_PREFIX)
            .await?
            .iter()
            .filter_map(|k| ManifestId::from_hex(&k[MANIFEST_PREFIX.len()..]))
            .collect())
    }

    /// Deletes a manifest (its chunks go at the next [`ChunkStore::gc`]). Refused while pinned.
    pub async fn delete_manifest(&self, id: &ManifestId) -> Result<()> {
        if let Some(h) = self.index().pins.get(id) {
            return Err(StoreError::Pinned {
                id: id.to_hex(),
                holders: h.iter().cloned().collect(),
            });
        }
        self.delete_meta_raw(&manifest_key(id)).await?;
        self.index().remove_manifest(id);
        Ok(())
    }

    /// Pins manifest `id` for `holder` (e.g. a sandbox id): its local chunks are never evicted while any
    /// holder pins it. Idempotent; survives reopening.
    pub async fn pin(&self, id: &ManifestId, holder: &str) -> Result<()> {
        check_holder(holder)?;
        self.manifest(id).await?;
        let p = self.inner.dir.pin_path(id, holder);
        let p2 = p.clone();
        blocking("write pin", move || {
            k3_common::fsutil::write_atomic(&p2, b"").map_err(StoreError::io("write", &p2))
        })
        .await?;
        self.index().pin(*id, holder.to_owned());
        Ok(())
    }

    /// Removes `holder`'s pin of `id` (no error if absent), then keeps the bound.
    pub async fn unpin(&self, id: &ManifestId, holder: &str) -> Result<()> {
        check_holder(holder)?;
        let p = self.inner.dir.pin_path(id, holder);
        match std::fs::remove_file(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(StoreError::io("remove", &p)(e)),
        }
        self.index().unpin(id, holder);
        let me = self.clone();
        blocking("evict", move || Ok(me.evict())).await?;
        Ok(())
    }

    /// Reads and checks every local chunk file, and lists manifest chunks that are not local.
    pub async fn verify(&self) -> Result<VerifyReport> {
        let me = self.clone();
        blocking("verify", move || {
            let mut rep = VerifyReport::default();
            for (id, len, _) in me.inner.dir.scan_chunks()? {
                rep.chunks += 1;
                rep.bytes += len;
                let p = me.inner.dir.chunk_path(&id);
                let ok = me
                    .inner
                    .dir
                    .read_chunk(&id)?
                    .is_some_and(|b| chunk::decode(&id, &b, &p.display()).is_ok());
                if !ok {
                    rep.corrupt.push(id);
                }
            }
            let ix = me.index();
            for (mid, m) in &ix.manifests {
                for &(_, c) in &m.chunks {
                    if !ix.has(&c) {
                        rep.missing.push((*mid, c));
                    }
                }
            }
            Ok(rep)
        })
        .await
    }

    /// Removes chunks no manifest references: local chunk files, and with a remote, chunk objects and
    /// packs older than [`StoreConfig::remote_gc_grace`] that no manifest in the bucket references.
    pub async fn gc(&self) -> Result<GcStats> {
        let mut stats = GcStats::default();
        let gone = self.index().take_unreferenced();
        for (id, n) in &gone {
            let _ = std::fs::remove_file(self.inner.dir.chunk_path(id));
            stats.local_bytes += n;
        }
        stats.local_chunks = gone.len();
        let Some(r) = &self.inner.remote else {
            return Ok(stats);
        };
        for id in self.list_manifests().await? {
            self.manifest(&id).await?;
        }
        let referenced = self.index().referenced_set();
        let packs = self.index().referenced_packs();
        let grace = self.inner.cfg.remote_gc_grace;
        stats.remote_chunks = sweep(r, "chunks/", &referenced, grace).await?;
        stats.remote_packs = sweep(r, "packs/", &packs, grace).await?;
        Ok(stats)
    }
}

/// Deletes the objects `<prefix><id>` whose id is not in `live` and that are older than `grace`; returns
/// how many.
async fn sweep(
    r: &Remote,
    prefix: &str,
    live: &std::collections::HashSet<ChunkId>,
    grace: Duration,
) -> Result<usize> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let mut n = 0;
    for l in r.list(prefix).await? {
        let Some(id) = l.key.strip_prefix(prefix).and_then(ChunkId::from_hex) else {
            continue;
        };
        if !live.contains(&id) && now - l.modified_s >= grace.as_secs() as i64 {
            r.delete(&l.key).await?;
            n += 1;
        }
    }
    Ok(n)
}
