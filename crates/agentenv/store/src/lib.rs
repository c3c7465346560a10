//! agentenv snapshot chunk store.
//!
//! Files (sandbox RAM files, disk images) are split into fixed-size chunks named by the BLAKE3 hash of
//! their bytes. A [`Manifest`] lists a file's non-zero chunks; holes and all-zero chunks are never stored,
//! so every ingest after the first stores only the chunks that changed, and chunks are shared across files,
//! sandboxes and snapshots.
//!
//! - [`ChunkStore`]: a local folder as a bounded cache ([`StoreConfig::max_local_bytes`]) plus an optional
//!   S3-compatible bucket ([`RemoteConfig`], through `object_store`). Local only, the folder is the durable
//!   store; with a bucket, local chunks are a cache with LRU eviction that keeps its bound (chunks no pinned
//!   manifest needs go first).
//! - [`ChunkStore::ingest`] / [`ChunkStore::materialize`]: file to manifest and back (sparse, atomic,
//!   missing chunks fetched concurrently and verified).
//! - [`ChunkStore::put_meta`] and friends: small metadata blobs kept beside the manifests, locally and in
//!   the bucket, so another server with its own folder and the same bucket finds and restores a snapshot.
//! - [`ChunkStore::pin`], [`ChunkStore::gc`]: live sandboxes pin what they need; gc removes what no
//!   manifest references.
//! - [`nbd::NbdServer`]: a read-only NBD export of a manifest on a unix socket, served chunk by chunk, so
//!   QEMU starts from a disk that this node does not hold whole.
//!
//! Invariants: a chunk file or object appears only complete (temp + rename) and is verified against its
//! hash on every read; a manifest is written only after its new chunk files are durable (`LocalDir::sync`, bucket puts), and
//! a materialized file appears only complete (temp + fsync + rename). Every remote call has a deadline.
//!
//! Boundary: this crate knows files and bytes only; it knows nothing of sandboxes, QEMU or HTTP.

mod chunk;
mod error;
mod ingest;
mod local;
mod manifest;
mod materialize;
pub mod nbd;
mod pack;
mod remote;
mod sparse;
mod store;
pub mod testing;
mod volume_bucket;

pub use chunk::{ChunkId, Compression, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, is_zero};
pub use error::{Result, StoreError};
pub use ingest::IngestStats;
pub use manifest::{Loc, MANIFEST_VERSION, Manifest, ManifestId, Place};
pub use materialize::{Durability, MaterializeStats};
pub use remote::{RemoteConfig, meta_key_from_secret};
pub use sparse::data_ranges;
pub use store::{ChunkStore, GcStats, LocalStats, MANIFEST_PREFIX, StoreConfig, VerifyReport};
