//! Manifests: a file as a list of (chunk index, chunk id); absent indices are zeros (holes).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::chunk::{ChunkId, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE};
use crate::error::{Result, StoreError};

/// Format version of [`Manifest`].
pub const MANIFEST_VERSION: u32 = 1;

/// BLAKE3 of a manifest's serialized bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ManifestId(pub ChunkId);

impl ManifestId {
    /// Lowercase hex.
    pub fn to_hex(&self) -> String {
        self.0.to_hex()
    }

    /// Parses 64 hex characters.
    pub fn from_hex(s: &str) -> Option<ManifestId> {
        ChunkId::from_hex(s).map(ManifestId)
    }
}

impl fmt::Display for ManifestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for ManifestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ManifestId({})", &self.to_hex()[..16])
    }
}

/// A chunk's place in the bucket: `(pack, offset, stored length)`.
pub type Place = (ChunkId, u64, u32);

/// Where a chunk's stored bytes lie in the bucket: `(index into Manifest::packs, offset, stored length)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Loc(pub u32, pub u64, pub u32);

/// One stored file: its length, chunk size and the ids of its non-zero chunks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`MANIFEST_VERSION`].
    pub version: u32,
    /// File length in bytes.
    pub len: u64,
    /// Chunk size in bytes (the last chunk may be shorter).
    pub chunk_size: u32,
    /// `(chunk index, id)` of every non-zero chunk, by increasing index.
    pub chunks: Vec<(u64, ChunkId)>,
    /// Bucket packs (objects `packs/<BLAKE3 of the pack>`, stored chunks back to back) holding chunks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub packs: Vec<ChunkId>,
    /// Parallel to `chunks` when not empty: each chunk's place in a pack, `None` for a chunk stored as
    /// its own object `chunks/<id>` (the layout before packs).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub at: Vec<Option<Loc>>,
}

impl Manifest {
    /// The canonical bytes (compact JSON) that are stored and hashed.
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// This manifest's id.
    pub fn id(&self) -> ManifestId {
        ManifestId(ChunkId::of(&self.to_bytes()))
    }

    /// Parses stored bytes and checks them against `id` and the manifest's own invariants.
    pub fn from_bytes(id: &ManifestId, bytes: &[u8]) -> Result<Manifest> {
        let bad = |detail: String| StoreError::BadManifest {
            id: id.to_hex(),
            detail,
        };
        if ChunkId::of(bytes) != id.0 {
            return Err(bad("bytes do not hash to the id".into()));
        }
        let m: Manifest = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
        m.validate().map_err(bad)?;
        Ok(m)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if self.version != MANIFEST_VERSION {
            return Err(format!(
                "version {} (expected {MANIFEST_VERSION})",
                self.version
            ));
        }
        let cs = self.chunk_size as usize;
        if !(MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&cs) || !cs.is_power_of_two() {
            return Err(format!("chunk size {cs}"));
        }
        let n = self.n_chunks();
        let mut prev = None;
        for &(idx, _) in &self.chunks {
            if idx >= n || prev.is_some_and(|p| p >= idx) {
                return Err(format!("chunk index {idx} out of order or past {n}"));
            }
            prev = Some(idx);
        }
        if !self.at.is_empty() && self.at.len() != self.chunks.len() {
            return Err(format!(
                "{} places for {} chunks",
                self.at.len(),
                self.chunks.len()
            ));
        }
        let max = MAX_CHUNK_SIZE as u32 + 1;
        for Loc(p, _, n) in self.at.iter().flatten() {
            if *p as usize >= self.packs.len() || *n == 0 || *n > max {
                return Err(format!(
                    "pack place ({p}, {n}) of {} packs",
                    self.packs.len()
                ));
            }
        }
        Ok(())
    }

    /// Where chunk `i` of [`Manifest::chunks`] lies: `(pack, offset, stored length)`; `None` when it is
    /// an object of its own.
    pub fn place(&self, i: usize) -> Option<Place> {
        let Loc(p, off, n) = (*self.at.get(i)?)?;
        Some((self.packs[p as usize], off, n))
    }

    /// Number of chunk slots (data and zero) covering [`Manifest::len`].
    pub fn n_chunks(&self) -> u64 {
        self.len.div_ceil(self.chunk_size as u64)
    }

    /// Byte range `(offset, len)` of chunk `idx`.
    pub fn chunk_range(&self, idx: u64) -> (u64, usize) {
        let off = idx * self.chunk_size as u64;
        (off, (self.len - off).min(self.chunk_size as u64) as usize)
    }

    /// Bytes of data chunks (the non-zero part).
    pub fn data_bytes(&self) -> u64 {
        self.chunks
            .iter()
            .map(|&(i, _)| self.chunk_range(i).1 as u64)
            .sum()
    }

    /// The id at chunk `idx`, `None` for a zero chunk.
    pub fn chunk_at(&self, idx: u64) -> Option<ChunkId> {
        self.chunks
            .binary_search_by_key(&idx, |&(i, _)| i)
            .ok()
            .map(|p| self.chunks[p].1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_and_a_changed_byte_is_refused() {
        let m = Manifest {
            version: MANIFEST_VERSION,
            len: (10 << 16) + 5,
            chunk_size: 1 << 16,
            chunks: vec![
                (0, ChunkId::of(&rand::random::<[u8; 8]>())),
                (10, ChunkId::of(b"tail")),
            ],
            packs: vec![],
            at: vec![],
        };
        let (id, bytes) = (m.id(), m.to_bytes());
        assert_eq!(Manifest::from_bytes(&id, &bytes).unwrap(), m);
        assert_eq!(m.chunk_range(10), (10 << 16, 5));
        assert_eq!(m.data_bytes(), (1 << 16) + 5);
        let mut evil = bytes.clone();
        let at = rand::random_range(0..evil.len());
        evil[at] ^= 1;
        assert!(Manifest::from_bytes(&id, &evil).is_err());
        let out_of_range = Manifest {
            chunks: vec![(11, ChunkId::of(b"x"))],
            ..m
        };
        let id2 = out_of_range.id();
        assert!(Manifest::from_bytes(&id2, &out_of_range.to_bytes()).is_err());
    }

    #[test]
    fn pack_places_round_trip_and_a_place_outside_the_packs_is_refused() {
        let pack = ChunkId::of(&rand::random::<[u8; 8]>());
        let off = rand::random_range(0..1u64 << 30);
        let m = Manifest {
            version: MANIFEST_VERSION,
            len: 3 << 16,
            chunk_size: 1 << 16,
            chunks: vec![(0, ChunkId::of(b"a")), (2, ChunkId::of(b"b"))],
            packs: vec![pack],
            at: vec![None, Some(Loc(0, off, 1000))],
        };
        let back = Manifest::from_bytes(&m.id(), &m.to_bytes()).unwrap();
        assert_eq!(back, m);
        assert_eq!(back.place(0), None);
        assert_eq!(back.place(1), Some((pack, off, 1000)));
        for at in [
            vec![Some(Loc(1, 0, 10)), None],
            vec![None],
            vec![None, Some(Loc(0, 0, 0))],
        ] {
            let bad = Manifest { at, ..m.clone() };
            assert!(
                Manifest::from_bytes(&bad.id(), &bad.to_bytes()).is_err(),
                "{bad:?}"
            );
        }
        let old = Manifest {
            packs: vec![],
            at: vec![],
            ..m
        };
        assert!(!String::from_utf8(old.to_bytes()).unwrap().contains("packs"));
    }
}
