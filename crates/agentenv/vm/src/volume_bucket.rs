//! The seam between volumes (`agentenv-control`) and a bucket that keeps them: packs of files
//! cut into content-addressed chunks, and small authenticated metadata blobs. `agentenv-store`'s
//! `ChunkStore` implements it; the control plane knows no S3.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;

/// A boxed future of the seam.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A failure of the bucket's side, as it words it.
pub type BucketError = Box<dyn std::error::Error + Send + Sync>;

/// What one [`VolumeBucket::put_pack`] stored.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PackPut {
    /// The pack's name in the bucket.
    pub id: String,
    /// Chunks the bucket did not hold before.
    pub chunks_new: u64,
    /// Stored bytes uploaded.
    pub bytes_uploaded: u64,
}

/// What volumes need of a bucket: packs (files cut into content-addressed chunks at multiples of
/// [`VolumeBucket::chunk_size`]) and small metadata blobs that the bucket side authenticates (a
/// blob it cannot authenticate reads as absent). Every call has a deadline.
pub trait VolumeBucket: Send + Sync {
    /// Chunk size of new packs (a power of two, 4 KiB to 4 MiB).
    fn chunk_size(&self) -> u64;
    /// Stores file `path` as a pack, uploading only chunks the bucket lacks.
    fn put_pack<'a>(&'a self, path: &'a Path) -> BoxFuture<'a, Result<PackPut, BucketError>>;
    /// The length of pack `id`.
    fn pack_len<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<u64, BucketError>>;
    /// Writes pack `id` whole to `dest` (verified).
    fn get_pack<'a>(
        &'a self,
        id: &'a str,
        dest: &'a Path,
    ) -> BoxFuture<'a, Result<(), BucketError>>;
    /// Deletes pack `id` (its chunks go at the bucket's next gc).
    fn delete_pack<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), BucketError>>;
    fn put_meta<'a>(
        &'a self,
        key: &'a str,
        bytes: &'a [u8],
    ) -> BoxFuture<'a, Result<(), BucketError>>;
    fn get_meta<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Vec<u8>>, BucketError>>;
    /// Keys starting with `prefix`.
    fn list_meta<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Vec<String>, BucketError>>;
    fn delete_meta<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<(), BucketError>>;
}
