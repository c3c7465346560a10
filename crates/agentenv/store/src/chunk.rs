//! Chunk names (BLAKE3 of the raw bytes) and the stored encoding (one tag byte, then raw or zstd bytes).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{Result, StoreError};

/// The largest chunk the store accepts (and the decompression bound).
pub const MAX_CHUNK_SIZE: usize = 4 << 20;
/// The smallest chunk size.
pub const MIN_CHUNK_SIZE: usize = 4 << 10;

const TAG_RAW: u8 = 0;
const TAG_ZSTD: u8 = 1;

/// BLAKE3 hash of a chunk's raw (uncompressed) bytes: its name everywhere.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId(pub [u8; 32]);

impl ChunkId {
    /// The id of `data`.
    pub fn of(data: &[u8]) -> ChunkId {
        ChunkId(*blake3::hash(data).as_bytes())
    }

    /// Lowercase hex (64 characters).
    pub fn to_hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }

    /// Parses 64 hex characters.
    pub fn from_hex(s: &str) -> Option<ChunkId> {
        blake3::Hash::from_hex(s)
            .ok()
            .map(|h| ChunkId(*h.as_bytes()))
    }
}

impl fmt::Display for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkId({})", &self.to_hex()[..16])
    }
}

impl Serialize for ChunkId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for ChunkId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ChunkId::from_hex(&s).ok_or_else(|| serde::de::Error::custom("chunk id: 64 hex characters"))
    }
}

/// Per-chunk compression of stored chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compression {
    /// Store raw bytes.
    #[default]
    None,
    /// zstd at this level; kept only where it saves at least 1/8 of the chunk.
    Zstd { level: i32 },
}

/// True when every byte is zero.
pub fn is_zero(data: &[u8]) -> bool {
    // SAFETY: u8 -> u64 reinterpretation; align_to handles the unaligned head and tail.
    let (head, body, tail) = unsafe { data.align_to::<u64>() };
    head.iter().all(|&b| b == 0) && body.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}

/// The stored form of `data`.
pub fn encode(data: &[u8], compression: Compression) -> Vec<u8> {
    if let Compression::Zstd { level } = compression
        && let Ok(z) = zstd::bulk::compress(data, level)
        && z.len() + data.len() / 8 < data.len()
    {
        let mut out = Vec::with_capacity(z.len() + 1);
        out.push(TAG_ZSTD);
        out.extend_from_slice(&z);
        return out;
    }
    let mut out = Vec::with_capacity(data.len() + 1);
    out.push(TAG_RAW);
    out.extend_from_slice(data);
    out
}

/// Decodes a stored chunk and checks that it hashes to `id`; `source_name` says where it came from.
pub fn decode(id: &ChunkId, stored: &[u8], source_name: &dyn fmt::Display) -> Result<Vec<u8>> {
    let corrupt = |detail: String| StoreError::Corrupt {
        id: id.to_hex(),
        source_name: source_name.to_string(),
        detail,
    };
    let data = match stored.split_first() {
        Some((&TAG_RAW, raw)) => raw.to_vec(),
        Some((&TAG_ZSTD, z)) => {
            zstd::bulk::decompress(z, MAX_CHUNK_SIZE).map_err(|e| corrupt(format!("zstd: {e}")))?
        }
        Some((tag, _)) => return Err(corrupt(format!("unknown encoding tag {tag}"))),
        None => return Err(corrupt("empty object".into())),
    };
    let got = ChunkId::of(&data);
    if got != *id {
        return Err(corrupt(format!("bytes hash to {got}")));
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_decode_round_trips_and_detects_flips() {
        for compression in [Compression::None, Compression::Zstd { level: 1 }] {
            let mut data: Vec<u8> = (0..65536).map(|_| rand::random::<u8>() & 0x0f).collect();
            data[100..4096].fill(0);
            let id = ChunkId::of(&data);
            let mut stored = encode(&data, compression);
            assert_eq!(decode(&id, &stored, &"test").unwrap(), data);
            let flip = rand::random_range(1..stored.len());
            stored[flip] ^= 0x40;
            assert!(matches!(
                decode(&id, &stored, &"test"),
                Err(StoreError::Corrupt { .. })
            ));
        }
    }

    #[test]
    fn zero_check_sees_a_single_nonzero_byte_anywhere() {
        let mut data = vec![0u8; 65536 + 3];
        assert!(is_zero(&data[1..]));
        let at = rand::random_range(0..data.len());
        data[at] = 1;
        assert!(!is_zero(&data));
    }
}
