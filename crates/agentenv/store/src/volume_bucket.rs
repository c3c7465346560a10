//! The chunk store behind the volumes' [`VolumeBucket`] seam: a volume's pack is a store manifest
//! (ingest and materialize), its manifest a MAC'd metadata blob.

use std::path::Path;

use agentenv_vm::volume_bucket::{BoxFuture, BucketError, PackPut, VolumeBucket};

use crate::{ChunkStore, ManifestId};

fn pack_id(id: &str) -> Result<ManifestId, BucketError> {
    ManifestId::from_hex(id).ok_or_else(|| format!("pack {id:?}: not a manifest id").into())
}

impl VolumeBucket for ChunkStore {
    fn chunk_size(&self) -> u64 {
        self.config().chunk_size as u64
    }

    fn put_pack<'a>(&'a self, path: &'a Path) -> BoxFuture<'a, Result<PackPut, BucketError>> {
        Box::pin(async move {
            let (m, st) = self.ingest(path).await?;
            Ok(PackPut {
                id: m.id().to_hex(),
                chunks_new: st.chunks_new,
                bytes_uploaded: st.bytes_uploaded,
            })
        })
    }

    fn pack_len<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<u64, BucketError>> {
        Box::pin(async move { Ok(self.manifest(&pack_id(id)?).await?.len) })
    }

    fn get_pack<'a>(
        &'a self,
        id: &'a str,
        dest: &'a Path,
    ) -> BoxFuture<'a, Result<(), BucketError>> {
        Box::pin(async move {
            let m = self.manifest(&pack_id(id)?).await?;
            self.materialize(&m, dest).await?;
            Ok(())
        })
    }

    fn delete_pack<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), BucketError>> {
        Box::pin(async move { Ok(self.delete_manifest(&pack_id(id)?).await?) })
    }

    fn put_meta<'a>(
        &'a self,
        key: &'a str,
        bytes: &'a [u8],
    ) -> BoxFuture<'a, Result<(), BucketError>> {
        Box::pin(async move { Ok(self.put_meta(key, bytes).await?) })
    }

    fn get_meta<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Vec<u8>>, BucketError>> {
        Box::pin(async move { Ok(self.get_meta(key).await?) })
    }

    fn list_meta<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Vec<String>, BucketError>> {
        Box::pin(async move { Ok(self.list_meta(prefix).await?) })
    }

    fn delete_meta<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<(), BucketError>> {
        Box::pin(async move { Ok(self.delete_meta(key).await?) })
    }
}
