//! The bucket's chunk layout. Packs: an ingest uploads its new chunks back to back in objects of up to
//! [`PACK_BYTES`] (`packs/<BLAKE3 of the object>`), and a cold restore reads them in a few large ranges
//! instead of one request per chunk. Manifests record each chunk's place ([`crate::manifest::Loc`]); chunks without one
//! are objects of their own (`chunks/<id>`, the layout before packs).

use std::collections::HashMap;

use bytes::Bytes;
use futures_util::StreamExt;

use crate::chunk::{self, ChunkId};
use crate::error::{Result, StoreError};
use crate::manifest::Place;
use crate::store::{ChunkStore, blocking, chunk_key};

/// The most bytes of one pack, and of one range read.
pub(crate) const PACK_BYTES: u64 = 4 << 20;

pub(crate) fn pack_key(pack: &ChunkId) -> String {
    format!("packs/{}", pack.to_hex())
}

/// Splits `(chunk, stored length)` in order into runs of at most [`PACK_BYTES`] (a bigger chunk alone).
fn group(chunks: &[(ChunkId, u64)]) -> Vec<&[(ChunkId, u64)]> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, &(_, n)) in chunks.iter().enumerate() {
        if i > start && bytes + n > PACK_BYTES {
            out.push(&chunks[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += n;
    }
    if start < chunks.len() {
        out.push(&chunks[start..]);
    }
    out
}

/// One range read of a pack and the chunks it covers (`(chunk, offset in the pack, stored length)`).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) pack: ChunkId,
    pub(crate) start: u64,
    pub(crate) end: u64,
    pub(crate) chunks: Vec<(ChunkId, u64, u32)>,
}

/// Range reads for `wanted` chunks: by pack and offset, back-to-back chunks merged up to [`PACK_BYTES`].
pub(crate) fn spans(mut wanted: Vec<(ChunkId, Place)>) -> Vec<Span> {
    wanted.sort_by_key(|&(_, (p, off, _))| (p, off));
    let mut out: Vec<Span> = Vec::new();
    for (id, (pack, off, n)) in wanted {
        let end = off + u64::from(n);
        match out.last_mut() {
            Some(s) if s.pack == pack && s.end == off && end - s.start <= PACK_BYTES => {
                s.end = end;
                s.chunks.push((id, off, n));
            }
            _ => out.push(Span {
                pack,
                start: off,
                end,
                chunks: vec![(id, off, n)],
            }),
        }
    }
    out
}

/// A fetched chunk: `(id, raw bytes, stored bytes)`.
pub(crate) type Fetched = (ChunkId, Vec<u8>, Bytes);

impl ChunkStore {
    /// Uploads local chunks `ids` as packs (at most [`crate::StoreConfig::remote_concurrency`] at once,
    /// and 8) and returns each chunk's place and the bytes uploaded.
    pub(crate) async fn upload_packs(
        &self,
        ids: &[ChunkId],
    ) -> Result<(HashMap<ChunkId, Place>, u64)> {
        let Some(r) = &self.inner.remote else {
            return Ok((HashMap::new(), 0));
        };
        let sized: Vec<(ChunkId, u64)> = {
            let ix = self.index();
            ids.iter()
                .map(|id| ix.stored_len(id).map(|n| (*id, n)).ok_or_else(|| gone(id)))
                .collect::<Result<_>>()?
        };
        let mut placed = HashMap::with_capacity(ids.len());
        let mut uploaded = 0;
        let runs: Vec<Vec<ChunkId>> = group(&sized)
            .into_iter()
            .map(|run| run.iter().map(|&(id, _)| id).collect())
            .collect();
        let mut s = futures_util::stream::iter(runs)
            .map(|ids| async move {
                let me = self.clone();
                let (bytes, places) = blocking("read pack", move || {
                    let mut bytes = Vec::new();
                    let mut places = Vec::with_capacity(ids.len());
                    for id in ids {
                        let stored = me.inner.dir.read_chunk(&id)?.ok_or_else(|| gone(&id))?;
                        places.push((id, bytes.len() as u64, stored.len() as u32));
                        bytes.extend_from_slice(&stored);
                    }
                    Ok((bytes, places))
                })
                .await?;
                let pack = ChunkId::of(&bytes);
                let n = bytes.len() as u64;
                r.put(&pack_key(&pack), bytes.into()).await?;
                Ok::<_, StoreError>((pack, places, n))
            })
            .buffer_unordered(self.inner.cfg.remote_concurrency.min(8));
        while let Some(res) = s.next().await {
            let (pack, places, n) = res?;
            for (id, off, len) in places {
                placed.insert(id, (pack, off, len));
            }
            uploaded += n;
        }
        Ok((placed, uploaded))
    }

    /// Fetches and verifies a chunk from the remote: `(raw, stored)`.
    pub(crate) async fn fetch_chunk(&self, id: &ChunkId) -> Result<(Vec<u8>, Bytes)> {
        let place = self.index().place(id);
        if let Some((pack, off, n)) = place {
            let span = Span {
                pack,
                start: off,
                end: off + u64::from(n),
                chunks: vec![(*id, off, n)],
            };
            let (_, raw, stored) = self.fetch_span(&span).await?.remove(0);
            return Ok((raw, stored));
        }
        let Some(r) = &self.inner.remote else {
            return Err(StoreError::MissingChunk {
                id: id.to_hex(),
                detail: "not local and no remote configured".into(),
            });
        };
        let key = chunk_key(id);
        let stored = r.get(&key).await?.ok_or_else(|| StoreError::MissingChunk {
            id: id.to_hex(),
            detail: "not local and not in the remote".into(),
        })?;
        let data = chunk::decode(id, &stored, &format_args!("remote {key}"))?;
        Ok((data, stored))
    }

    /// Reads one span and verifies each chunk in it.
    pub(crate) async fn fetch_span(&self, span: &Span) -> Result<Vec<Fetched>> {
        let r = self
            .inner
            .remote
            .as_ref()
            .ok_or_else(|| StoreError::MissingChunk {
                id: span.chunks[0].0.to_hex(),
                detail: "not local and no remote configured".into(),
            })?;
        let key = pack_key(&span.pack);
        let bytes = r
            .get_range(&key, span.start..span.end)
            .await?
            .ok_or_else(|| StoreError::MissingChunk {
                id: span.chunks[0].0.to_hex(),
                detail: format!("its pack {key} is not in the remote"),
            })?;
        if bytes.len() as u64 != span.end - span.start {
            return Err(StoreError::Corrupt {
                id: span.chunks[0].0.to_hex(),
                source_name: format!("remote {key}"),
                detail: format!(
                    "bytes {}..{}: {} bytes came",
                    span.start,
                    span.end,
                    bytes.len()
                ),
            });
        }
        span.chunks
            .iter()
            .map(|&(id, off, n)| {
                let at = (off - span.start) as usize;
                let stored = bytes.slice(at..at + n as usize);
                let raw = chunk::decode(&id, &stored, &format_args!("remote {key}@{off}"))?;
                Ok((id, raw, stored))
            })
            .collect()
    }
}

fn gone(id: &ChunkId) -> StoreError {
    StoreError::MissingChunk {
        id: id.to_hex(),
        detail: "written by this ingest, gone before upload".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(k: u64) -> ChunkId {
        ChunkId::of(&k.to_le_bytes())
    }

    #[test]
    fn runs_stay_within_a_pack_and_keep_every_chunk_in_order() {
        let n = rand::random_range(50..400);
        let chunks: Vec<(ChunkId, u64)> = (0..n)
            .map(|k| (id(k), rand::random_range(1..=(1 << 20))))
            .collect();
        let runs = group(&chunks);
        let flat: Vec<_> = runs.iter().flat_map(|r| r.iter().copied()).collect();
        assert_eq!(flat, chunks);
        for r in &runs {
            let bytes: u64 = r.iter().map(|c| c.1).sum();
            assert!(bytes <= PACK_BYTES || r.len() == 1, "{bytes}");
        }
        assert!(group(&[]).is_empty());
    }

    #[test]
    fn back_to_back_chunks_are_one_read_and_gaps_split_reads() {
        let (p, q) = (id(1000), id(1001));
        let mut wanted = vec![
            (id(1), (p, 0, 100)),
            (id(2), (p, 100, 50)),
            (id(3), (p, 300, 10)),
            (id(4), (q, 0, 7)),
        ];
        wanted.reverse();
        let mut got = spans(wanted);
        got.sort_by_key(|s| (s.pack, s.start));
        let mut want = vec![
            Span {
                pack: p,
                start: 0,
                end: 150,
                chunks: vec![(id(1), 0, 100), (id(2), 100, 50)],
            },
            Span {
                pack: p,
                start: 300,
                end: 310,
                chunks: vec![(id(3), 300, 10)],
            },
            Span {
                pack: q,
                start: 0,
                end: 7,
                chunks: vec![(id(4), 0, 7)],
            },
        ];
        want.sort_by_key(|s| (s.pack, s.start));
        assert_eq!(got, want);
        // A whole pack of small chunks is one read; a pack's worth more is two.
        let n = (PACK_BYTES / 4096) as u32;
        let full: Vec<_> = (0..2 * n)
            .map(|k| (id(k.into()), (p, u64::from(k) * 4096, 4096)))
            .collect();
        let s = spans(full);
        assert_eq!(s.len(), 2);
        assert!(s.iter().all(|s| s.end - s.start == PACK_BYTES));
    }
}
