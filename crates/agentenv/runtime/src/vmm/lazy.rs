//! Lazy disks: a raw base disk this node does not hold whole, served block by block from the chunk store.
//!
//! Such a disk is a marker file beside where the disk would be (`<disk>.lazy`: its manifest and length);
//! the disk itself never exists here. Overlays are made on it without opening it (`qemu-img create -u`),
//! and a QEMU whose backing chain ends in it gets that node as `raw` over QEMU's NBD client, connected to
//! an [`agentenv_store::nbd::NbdServer`] export of the manifest that the runtime owns: one per manifest,
//! shared by every QEMU using it (each holds an `Arc`), shut down when the last one exits. Chunks come
//! from the local cache or the bucket; the cache keeps its bound (the manifests are not pinned).
//!
//! Socket access with per-VM uids: each export listens in a folder of its own under `<state>/nbd/`
//! (root `0700`), the folder `0711` and the socket `0666`. A QEMU gets the folder as an inherited
//! descriptor and connects through `/proc/self/fd/N/disk.sock`; no path leads a VM uid there, and the
//! folder holds nothing else.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};

use agentenv_store::nbd::NbdServer;
use agentenv_store::{ChunkStore, ManifestId};
use serde::{Deserialize, Serialize};

use crate::vmm::launch::LazyBacking;
use crate::vmm::{VmSpec, VmmError};

pub use crate::vmm::launch::LAZY_SOCKET as SOCKET;
/// Largest marker file read.
const MARKER_MAX: u64 = 4096;

/// What `<disk>.lazy` says: the manifest that holds the disk, and its length.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LazyMarker {
    /// Manifest id (hex).
    pub manifest: String,
    /// Disk length in bytes.
    pub len: u64,
}

/// The marker path of `disk`.
pub fn marker_path(disk: &Path) -> PathBuf {
    let mut s = disk.as_os_str().to_owned();
    s.push(".lazy");
    PathBuf::from(s)
}

/// The marker of `disk` when the disk is served lazily: no file at `disk`, a valid marker beside it.
pub fn marker(disk: &Path) -> Option<LazyMarker> {
    if std::fs::symlink_metadata(disk).is_ok() {
        return None;
    }
    let p = marker_path(disk);
    let meta = std::fs::metadata(&p).ok()?;
    if !meta.is_file() || meta.len() > MARKER_MAX {
        return None;
    }
    let m: LazyMarker = serde_json::from_slice(&std::fs::read(&p).ok()?).ok()?;
    ManifestId::from_hex(&m.manifest).map(|_| m)
}

/// Writes the marker of `disk` (atomically).
pub fn write_marker(disk: &Path, m: &LazyMarker) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(m).map_err(std::io::Error::other)?;
    k3_common::fsutil::write_atomic(&marker_path(disk), &bytes)
}

/// One running export, shut down when the last QEMU holding it is gone.
pub struct Export {
    server: NbdServer,
    dir: PathBuf,
    name: String,
}

impl Export {
    /// The export as its users see it.
    pub fn backing(&self, path: &Path) -> LazyBacking {
        LazyBacking {
            path: path.to_owned(),
            socket_dir: self.dir.clone(),
            export: self.name.clone(),
        }
    }
    /// The socket path (for tools such as `qemu-img` running as this process).
    pub fn socket(&self) -> &Path {
        self.server.socket()
    }
}

impl Drop for Export {
    fn drop(&mut self) {
        tracing::debug!(export = %self.name, "lazy disk export stopped");
    }
}

/// The runtime's NBD exports of lazy disks, by manifest.
pub struct LazyDisks {
    store: Arc<ChunkStore>,
    dir: PathBuf,
    exports: tokio::sync::Mutex<HashMap<ManifestId, Weak<Export>>>,
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> VmmError {
    let path = path.to_owned();
    move |source| VmmError::Io { what, path, source }
}

impl LazyDisks {
    /// Exports of `store`'s manifests with their sockets under `dir` (created private).
    pub fn new(store: Arc<ChunkStore>, dir: PathBuf) -> LazyDisks {
        LazyDisks {
            store,
            dir,
            exports: tokio::sync::Mutex::new(HashMap::new()),
        }
    }

    /// Exports running now.
    pub async fn running(&self) -> usize {
        self.exports
            .lock()
            .await
            .values()
            .filter(|w| w.strong_count() > 0)
            .count()
    }

    /// The lazy disks in the backing chain of `spec`'s disk, each with its running export; the QEMU of
    /// `spec` holds them while it runs.
    pub async fn exports_for(
        &self,
        spec: &VmSpec,
    ) -> Result<Vec<(LazyBacking, Arc<Export>)>, VmmError> {
        if spec.disk_format != crate::vmm::DiskFormat::Qcow2 {
            return Ok(Vec::new());
        }
        let chain = crate::vmm::launch::backing_chain_with(&spec.disk, &|p| marker(p).is_some())
            .map_err(io("read backing chain of", &spec.disk))?;
        let mut out = Vec::new();
        for (path, _) in chain {
            let Some(m) = marker(&path) else { continue };
            let id = ManifestId::from_hex(&m.manifest).ok_or_else(|| VmmError::LazyDisk {
                path: path.clone(),
                detail: "bad manifest id in its marker".into(),
            })?;
            let ex = self.export(id, &path).await?;
            out.push((ex.backing(&path), ex));
        }
        Ok(out)
    }

    /// The running export of manifest `id`, started if none runs.
    pub async fn export(&self, id: ManifestId, disk: &Path) -> Result<Arc<Export>, VmmError> {
        let mut map = self.exports.lock().await;
        map.retain(|_, w| w.strong_count() > 0);
        if let Some(ex) = map.get(&id).and_then(Weak::upgrade) {
            return Ok(ex);
        }
        let lazy_err = |detail: String| VmmError::LazyDisk {
            path: disk.to_owned(),
            detail,
        };
        let manifest = self
            .store
            .manifest(&id)
            .await
            .map_err(|e| lazy_err(e.to_string()))?;
        k3_common::fsutil::create_private_dir(&self.dir).map_err(io("create", &self.dir))?;
        let hex = id.to_hex();
        let dir = self.dir.join(&hex[..32.min(hex.len())]);
        // Kept across exports of the same manifest: a QEMU re-attached after a restart still holds it,
        // and reconnects to the new socket inside.
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io("create", &dir)(e)),
        }
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711))
            .map_err(io("chmod", &dir))?;
        let sock = dir.join(SOCKET);
        let name = "disk".to_string();
        let server = NbdServer::serve((*self.store).clone(), manifest, &name, &sock)
            .await
            .map_err(|e| lazy_err(e.to_string()))?;
        std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666))
            .map_err(io("chmod", &sock))?;
        tracing::info!(disk = %disk.display(), manifest = %hex, "lazy disk export started");
        let ex = Arc::new(Export { server, dir, name });
        map.insert(id, Arc::downgrade(&ex));
        Ok(ex)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marker_counts_only_while_the_disk_is_absent() {
        let d = tempfile::tempdir().unwrap();
        let disk = d.path().join("base.ext4");
        assert_eq!(marker(&disk), None);
        let m = LazyMarker {
            manifest: "ab".repeat(32),
            len: 1 << 30,
        };
        write_marker(&disk, &m).unwrap();
        assert_eq!(marker(&disk), Some(m.clone()));
        std::fs::write(&disk, b"x").unwrap();
        assert_eq!(marker(&disk), None, "a local disk wins");
        std::fs::remove_file(&disk).unwrap();
        std::fs::write(marker_path(&disk), br#"{"manifest":"zz","len":1}"#).unwrap();
        assert_eq!(marker(&disk), None, "bad manifest id");
    }
}
