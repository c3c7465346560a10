//! Ingest: a file into chunks and a manifest, storing only chunks the store does not hold yet.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::chunk::{self, ChunkId, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE};
use crate::error::{Result, StoreError};
use crate::manifest::{Loc, MANIFEST_VERSION, Manifest, Place};
use crate::sparse;
use crate::store::{ChunkStore, blocking, in_background};

/// What one [`ChunkStore::ingest`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IngestStats {
    /// File length.
    pub bytes_total: u64,
    /// Bytes in non-zero chunks.
    pub bytes_data: u64,
    /// Raw bytes of chunks the store did not hold before (what this ingest added).
    pub bytes_new: u64,
    /// Stored (possibly compressed) bytes written to the local folder.
    pub bytes_written: u64,
    /// Stored bytes uploaded to the bucket.
    pub bytes_uploaded: u64,
    /// New distinct chunks.
    pub chunks_new: u64,
    /// Data chunks the store already held (including repeats within the file).
    pub chunks_reused: u64,
    /// All-zero chunks and holes (not stored).
    pub chunks_zero: u64,
    /// Wall time.
    pub elapsed: Duration,
    /// Part of it spent making chunks and manifest durable (chunk fsyncs, manifest writes).
    pub elapsed_commit: Duration,
}

/// Takes chunk protections back when an ingest ends, whichever way.
struct Protection<'a> {
    store: &'a ChunkStore,
    ids: Vec<ChunkId>,
}

impl Drop for Protection<'_> {
    fn drop(&mut self) {
        self.store.index().protect(&self.ids, false);
    }
}

struct Scanned {
    manifest: Manifest,
    stats: IngestStats,
    /// Distinct ids this ingest protected.
    protected: Vec<ChunkId>,
    /// Chunks to upload.
    upload: Vec<ChunkId>,
}

impl ChunkStore {
    /// Splits `path` into chunks, stores the new ones (locally, and in the bucket when there is one) and
    /// then the manifest. Holes and all-zero chunks are not stored. The manifest is written only after
    /// all its chunks are durable.
    pub async fn ingest(&self, path: &Path) -> Result<(Manifest, IngestStats)> {
        self.ingest_chunked(path, self.inner.cfg.chunk_size).await
    }

    /// [`ChunkStore::ingest`] with chunks of `chunk_size` bytes (a power of two in 4 KiB..=4 MiB) instead
    /// of the store's: e.g. guest-page chunks for RAM files, whose changes are scattered pages.
    pub async fn ingest_chunked(
        &self,
        path: &Path,
        chunk_size: usize,
    ) -> Result<(Manifest, IngestStats)> {
        if !(MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&chunk_size) || !chunk_size.is_power_of_two()
        {
            return Err(StoreError::Config(format!(
                "chunk size {chunk_size}: a power of two in {MIN_CHUNK_SIZE}..={MAX_CHUNK_SIZE}"
            )));
        }
        let t0 = Instant::now();
        let me = self.clone();
        let p: PathBuf = path.to_owned();
        let Scanned {
            manifest,
            mut stats,
            protected,
            upload,
        } = in_background("ingest", move || me.scan_and_store(&p, chunk_size as u64)).await?;
        let _guard = Protection {
            store: self,
            ids: protected,
        };
        let mut manifest = manifest;
        if self.inner.remote.is_some() {
            let (placed, n) = self.upload_packs(&upload).await?;
            stats.bytes_uploaded = n;
            self.place_chunks(&mut manifest, &placed);
        }
        let t_commit = Instant::now();
        self.commit_manifest(&manifest).await?;
        stats.elapsed_commit = t_commit.elapsed();
        drop(_guard);
        let me = self.clone();
        blocking("evict", move || Ok(me.evict())).await?;
        stats.elapsed = t0.elapsed();
        Ok((manifest, stats))
    }

    /// Records where each chunk of `m` lies: uploaded now (`placed`) or by an earlier manifest.
    fn place_chunks(&self, m: &mut Manifest, placed: &HashMap<ChunkId, Place>) {
        let ix = self.index();
        let mut packs: HashMap<ChunkId, u32> = HashMap::new();
        let at: Vec<Option<Loc>> = m
            .chunks
            .iter()
            .map(|(_, c)| {
                let (pack, off, n) = placed.get(c).copied().or_else(|| ix.place(c))?;
                let next = packs.len() as u32;
                let k = *packs.entry(pack).or_insert(next);
                Some(Loc(k, off, n))
            })
            .collect();
        if packs.is_empty() {
            return;
        }
        let mut order: Vec<(ChunkId, u32)> = packs.into_iter().collect();
        order.sort_by_key(|&(_, k)| k);
        m.packs = order.into_iter().map(|(p, _)| p).collect();
        m.at = at;
    }

    fn scan_and_store(&self, path: &Path, cs: u64) -> Result<Scanned> {
        let f = std::fs::File::open(path).map_err(StoreError::io("open", path))?;
        let len = f.metadata().map_err(StoreError::io("stat", path))?.len();
        let ranges = sparse::data_ranges(&f, len).map_err(StoreError::io("seek data in", path))?;
        let idxs = sparse::chunk_indices(&ranges, cs);
        let has_remote = self.inner.remote.is_some();
        let compression = self.inner.cfg.compression;
        let mut stats = IngestStats {
            bytes_total: len,
            chunks_zero: len.div_ceil(cs) - idxs.len() as u64,
            ..Default::default()
        };
        let mut chunks = Vec::new();
        let mut seen: HashSet<ChunkId> = HashSet::new();
        let mut protected = Vec::new();
        let mut upload = Vec::new();
        let mut buf = vec![0u8; cs as usize];
        // Protections are taken as chunks are seen; on error the guard in the caller never exists, so undo here.
        let undo = |protected: &Vec<ChunkId>| self.index().protect(protected, false);
        let mut since_evict = 0u32;
        let mut pacer = k3_common::background::Pacer::default();
        for idx in idxs {
            pacer.pace();
            let off = idx * cs;
            let n = (len - off).min(cs) as usize;
            let data = &mut buf[..n];
            if let Err(e) = f.read_exact_at(data, off) {
                undo(&protected);
                return Err(StoreError::io("read", path)(e));
            }
            if chunk::is_zero(data) {
                stats.chunks_zero += 1;
                continue;
            }
            stats.bytes_data += n as u64;
            let id = ChunkId::of(data);
            chunks.push((idx, id));
            if !seen.insert(id) {
                stats.chunks_reused += 1;
                continue;
            }
            let (local, durable) = {
                let mut ix = self.index();
                ix.protect(&[id], true);
                // With a remote, a chunk some manifest references is in the bucket.
                (
                    ix.has(&id),
                    if has_remote {
                        ix.referenced(&id)
                    } else {
                        ix.has(&id)
                    },
                )
            };
            protected.push(id);
            if durable {
                stats.chunks_reused += 1;
                continue;
            }
            stats.chunks_new += 1;
            stats.bytes_new += n as u64;
            if !local {
                let stored = chunk::encode(data, compression);
                if let Err(e) = self.inner.dir.write_chunk(&id, &stored, true) {
                    undo(&protected);
                    return Err(e);
                }
                stats.bytes_written += stored.len() as u64;
                self.index().insert(id, stored.len() as u64);
                since_evict += 1;
                if since_evict >= 64 {
                    since_evict = 0;
                    self.evict();
                }
            }
            if has_remote {
                upload.push(id);
            }
        }
        let manifest = Manifest {
            version: MANIFEST_VERSION,
            len,
            chunk_size: cs as u32,
            chunks,
            packs: vec![],
            at: vec![],
        };
        Ok(Scanned {
            manifest,
            stats,
            protected,
            upload,
        })
    }
}
