//! Materialize: a manifest back into a sparse file, atomically, fetching missing chunks concurrently.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;

use crate::chunk::{self, ChunkId};
use crate::error::{Result, StoreError};
use crate::manifest::{Manifest, Place};
use crate::pack;
use crate::sparse::TempBeside;
use crate::store::{ChunkStore, blocking};

/// What one [`ChunkStore::materialize`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MaterializeStats {
    /// File length.
    pub bytes_total: u64,
    /// Raw bytes written from local chunks.
    pub bytes_local: u64,
    /// Stored bytes fetched from the bucket.
    pub bytes_fetched_remote: u64,
    /// Distinct chunks read locally.
    pub chunks_local: u64,
    /// Distinct chunks fetched.
    pub chunks_remote: u64,
    /// Requests to the bucket (a range of a pack, or a chunk stored as its own object).
    pub requests_remote: u64,
    /// Wall time.
    pub elapsed: Duration,
}

fn write_at_all(
    f: &std::fs::File,
    path: &Path,
    m: &Manifest,
    idxs: &[u64],
    data: &[u8],
) -> Result<u64> {
    let mut n = 0;
    for &i in idxs {
        let (off, len) = m.chunk_range(i);
        if len != data.len() {
            return Err(StoreError::BadManifest {
                id: m.id().to_hex(),
                detail: format!("chunk {i} is {} bytes, its slot {len}", data.len()),
            });
        }
        f.write_all_at(data, off)
            .map_err(StoreError::io("write", path))?;
        n += len as u64;
    }
    Ok(n)
}

/// What a materialized file survives once [`ChunkStore::materialize_with`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Flushed (fsync of the file and its folder): a host crash too.
    Flushed,
    /// Renamed into place without a flush: a crash of the process only. For a copy the caller can make
    /// again from the chunks, marked so that it is after a host restart.
    ThisBoot,
}

/// One request of a restore.
enum Read {
    Span(pack::Span),
    Own(ChunkId),
}

impl ChunkStore {
    /// Writes the file `m` describes to `dest`: zero chunks stay holes, local chunks are read and verified,
    /// missing ones are fetched from the bucket (at most [`crate::StoreConfig::remote_concurrency`] at
    /// once) and verified. The file appears under `dest` only when complete and fsynced. Fetched chunks
    /// enter the local cache in the background, read back from the file after the return
    /// ([`ChunkStore::settle`] waits for them).
    pub async fn materialize(&self, m: &Manifest, dest: &Path) -> Result<MaterializeStats> {
        self.materialize_with(m, dest, Durability::Flushed).await
    }

    /// [`ChunkStore::materialize`], with the file's [`Durability`] chosen by the caller.
    pub async fn materialize_with(
        &self,
        m: &Manifest,
        dest: &Path,
        durability: Durability,
    ) -> Result<MaterializeStats> {
        let t0 = Instant::now();
        let mut by_id: BTreeMap<ChunkId, Vec<u64>> = BTreeMap::new();
        for &(i, id) in &m.chunks {
            by_id.entry(id).or_default().push(i);
        }
        let tmp = TempBeside::new(dest);
        // Readable too: the background cache reads fetched chunks back from it.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp.path)
            .map_err(StoreError::io("create", &tmp.path))?;
        file.set_len(m.len)
            .map_err(StoreError::io("truncate", &tmp.path))?;
        let file = Arc::new(file);
        let by_id = Arc::new(by_id);
        let m2 = Arc::new(m.clone());
        let (me, f, ids, mm, tp) = (
            self.clone(),
            file.clone(),
            by_id.clone(),
            m2.clone(),
            tmp.path.clone(),
        );
        let (mut stats, missing) = blocking("materialize local", move || {
            let mut stats = MaterializeStats {
                bytes_total: mm.len,
                ..Default::default()
            };
            let mut missing = Vec::new();
            for (id, idxs) in ids.iter() {
                let Some(stored) = me.inner.dir.read_chunk(id)? else {
                    missing.push(*id);
                    continue;
                };
                me.index().touch(id);
                let p = me.inner.dir.chunk_path(id);
                let data = chunk::decode(id, &stored, &p.display())?;
                stats.bytes_local += write_at_all(&f, &tp, &mm, idxs, &data)?;
                stats.chunks_local += 1;
            }
            Ok((stats, missing))
        })
        .await?;
        let mut fetched = Vec::with_capacity(missing.len());
        if !missing.is_empty() {
            let tp: PathBuf = tmp.path.clone();
            let places: HashMap<ChunkId, Place> = (0..m.chunks.len())
                .filter_map(|i| Some((m.chunks[i].1, m.place(i)?)))
                .collect();
            let (placed, own): (Vec<ChunkId>, Vec<ChunkId>) =
                missing.into_iter().partition(|id| places.contains_key(id));
            let reads = pack::spans(placed.into_iter().map(|id| (id, places[&id])).collect())
                .into_iter()
                .map(Read::Span)
                .chain(own.into_iter().map(Read::Own));
            let mut s = futures_util::stream::iter(reads)
                .map(|r| async move {
                    match r {
                        Read::Span(span) => self.fetch_span(&span).await,
                        Read::Own(id) => {
                            let (data, stored) = self.fetch_chunk(&id).await?;
                            Ok(vec![(id, data, stored)])
                        }
                    }
                })
                .buffer_unordered(self.inner.cfg.remote_concurrency);
            while let Some(r) = s.next().await {
                stats.requests_remote += 1;
                for (id, data, stored) in r? {
                    write_at_all(&file, &tp, m, &by_id[&id], &data)?;
                    stats.bytes_fetched_remote += stored.len() as u64;
                    stats.chunks_remote += 1;
                    let (off, len) = m.chunk_range(by_id[&id][0]);
                    fetched.push((id, off, len));
                }
            }
        }
        let d = dest.to_owned();
        let kept = file.clone();
        let t_commit = Instant::now();
        blocking("commit", move || {
            match durability {
                Durability::Flushed => tmp.commit(&file, &d),
                Durability::ThisBoot => tmp.commit_unflushed(&d),
            }
            .map_err(StoreError::io("commit", &d))
        })
        .await?;
        let commit = t_commit.elapsed();
        self.cache_later(kept, fetched).await;
        stats.elapsed = t0.elapsed();
        tracing::debug!(dest = %dest.display(), ?stats, ?commit, "materialized");
        Ok(stats)
    }
}
