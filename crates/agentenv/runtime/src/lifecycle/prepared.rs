//! Files made ahead of creates: per image, a few copies of its RAM file and empty disk overlays on its
//! disk. They are made in the background, after a create from that image (and for the default
//! template once it is built), so that the next create only renames them into place instead of
//! copying hundreds of MiB and running `qemu-img` on its critical path.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::fsops;

/// What a create takes: an overlay on the image's disk and, for images started from a copy of their
/// RAM, that copy.
#[derive(Debug)]
pub(crate) struct Entry {
    pub(crate) overlay: PathBuf,
    pub(crate) ram: Option<PathBuf>,
}

/// The image an entry belongs to: its disk and the RAM file it copies (if any).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    disk: PathBuf,
    ram: Option<PathBuf>,
}

/// Prepared entries, per image.
pub(crate) struct Prepared {
    /// Overlays (same file system as the sandbox folders).
    disk_dir: PathBuf,
    /// RAM copies (same file system as the sandboxes' RAM files).
    ram_dir: PathBuf,
    per_image: usize,
    ready: Mutex<HashMap<Key, Vec<Entry>>>,
    /// Images with a refill under way.
    filling: Mutex<std::collections::HashSet<Key>>,
    /// One refill copies at a time: creates keep the disk and the cores.
    work: tokio::sync::Semaphore,
    next: AtomicU64,
}

impl Prepared {
    /// Entries kept per image. Each costs one RAM copy of disk space (page cache while it is hot).
    pub(crate) const PER_IMAGE: usize = 2;

    /// A store in `disk_dir` and `ram_dir`, emptied first (leftovers of an earlier process).
    pub(crate) fn open(disk_dir: PathBuf, ram_dir: PathBuf, per_image: usize) -> Prepared {
        for d in [&disk_dir, &ram_dir] {
            let _ = std::fs::remove_dir_all(d);
        }
        Prepared {
            disk_dir,
            ram_dir,
            per_image,
            ready: Mutex::new(HashMap::new()),
            filling: Mutex::new(Default::default()),
            work: tokio::sync::Semaphore::new(1),
            next: AtomicU64::new(0),
        }
    }

    /// A prepared entry for the image of `disk` (and RAM file `ram`), if one is ready.
    pub(crate) fn take(&self, disk: &Path, ram: Option<&Path>) -> Option<Entry> {
        let key = Key {
            disk: disk.to_owned(),
            ram: ram.map(Path::to_owned),
        };
        self.lock().get_mut(&key)?.pop()
    }

    /// Tops the image's entries up to the kept number, in the background.
    pub(crate) fn refill(self: &Arc<Self>, disk: &Path, ram: Option<&Path>) {
        if self.per_image == 0 {
            return;
        }
        let key = Key {
            disk: disk.to_owned(),
            ram: ram.map(Path::to_owned),
        };
        if !self
            .filling
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.clone())
        {
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            while me.lock().get(&key).map_or(0, Vec::len) < me.per_image {
                let Ok(_permit) = me.work.acquire().await else {
                    break;
                };
                match me.make(&key).await {
                    Ok(e) => me.lock().entry(key.clone()).or_default().push(e),
                    Err(e) => {
                        tracing::warn!(disk = %key.disk.display(), error = %e, "preparing files for creates failed");
                        break;
                    }
                }
            }
            me.filling
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&key);
        });
    }

    /// Drops the entries of every image on `disk` (its template or snapshot is going away).
    pub(crate) fn forget(&self, disk: &Path) {
        let gone: Vec<Entry> = {
            let mut map = self.lock();
            let keys: Vec<Key> = map.keys().filter(|k| k.disk == disk).cloned().collect();
            keys.iter()
                .flat_map(|k| map.remove(k).unwrap_or_default())
                .collect()
        };
        for e in gone {
            remove(&e);
        }
    }

    async fn make(&self, key: &Key) -> std::io::Result<Entry> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        std::fs::create_dir_all(&self.disk_dir)?;
        let entry = Entry {
            overlay: self.disk_dir.join(format!("{n}.qcow2")),
            ram: match &key.ram {
                Some(_) => {
                    std::fs::create_dir_all(&self.ram_dir)?;
                    Some(self.ram_dir.join(format!("{n}.mem")))
                }
                None => None,
            },
        };
        let (ram, dst) = (key.ram.as_deref(), entry.ram.as_deref());
        if let Err((_, e)) = self
            .make_files(&key.disk, ram.zip(dst), &entry.overlay, true)
            .await
        {
            remove(&entry);
            return Err(e);
        }
        Ok(entry)
    }

    /// Puts an overlay on `disk` at `overlay` and, for images started from a copy of their RAM
    /// (`ram`: source and destination), that copy: a ready entry renamed into place, else made now
    /// (`background`: as the refill makes them). On failure: what failed, with its error.
    pub(crate) async fn place(
        &self,
        disk: &Path,
        ram: Option<(&Path, &Path)>,
        overlay: &Path,
        background: bool,
    ) -> Result<(), (&'static str, std::io::Error)> {
        let Some(ready) = self.take(disk, ram.map(|(src, _)| src)) else {
            return self.make_files(disk, ram, overlay, background).await;
        };
        std::fs::rename(&ready.overlay, overlay).map_err(|e| ("overlay", e))?;
        if let (Some(r), Some((_, dst))) = (&ready.ram, ram) {
            std::fs::rename(r, dst).map_err(|e| ("RAM copy", e))?;
        }
        Ok(())
    }

    /// The overlay, then the sparse RAM copy; `background` (files for later creates): on a thread that
    /// yields the cores to the sandboxes running meanwhile.
    async fn make_files(
        &self,
        disk: &Path,
        ram: Option<(&Path, &Path)>,
        overlay: &Path,
        background: bool,
    ) -> Result<(), (&'static str, std::io::Error)> {
        let (disk, overlay) = (disk.to_owned(), overlay.to_owned());
        let ram = ram.map(|(s, d)| (s.to_owned(), d.to_owned()));
        let work = move || write_files(&disk, ram, &overlay);
        let worker = |e| ("worker thread", std::io::Error::other(e));
        if !background {
            return tokio::task::spawn_blocking(work)
                .await
                .unwrap_or_else(|e| Err(worker(e.to_string())));
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        k3_common::background::spawn("agentenv-prepare".into(), move || {
            let _ = tx.send(work());
        })
        .map_err(|e| ("worker thread", e))?;
        rx.await.unwrap_or_else(|e| Err(worker(e.to_string())))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Vec<Entry>>> {
        self.ready.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Prepared {
    fn drop(&mut self) {
        for e in self.lock().drain().flat_map(|(_, v)| v) {
            remove(&e);
        }
    }
}

/// A short tag of `state_dir`, naming its RAM copies in a RAM folder other runtimes may share.
pub(crate) fn dir_tag(state_dir: &Path) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    state_dir.hash(&mut h);
    format!("{:08x}", h.finish() as u32)
}

/// [`Prepared::make_files`] on the calling thread.
fn write_files(
    disk: &Path,
    ram: Option<(PathBuf, PathBuf)>,
    overlay: &Path,
) -> Result<(), (&'static str, std::io::Error)> {
    fsops::write_overlay(disk, overlay).map_err(|e| ("overlay", e))?;
    if let Some((src, dst)) = ram {
        fsops::sparse_copy(&src, &dst).map_err(|e| ("RAM copy", e))?;
    }
    Ok(())
}

fn remove(e: &Entry) {
    let _ = std::fs::remove_file(&e.overlay);
    if let Some(r) = &e.ram {
        let _ = std::fs::remove_file(r);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn entries_are_made_taken_and_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let disk = dir.path().join("base.raw");
        std::fs::File::create(&disk)
            .unwrap()
            .set_len(8 << 20)
            .unwrap();
        let ram = dir.path().join("base.mem");
        let data: Vec<u8> = (0..300_000).map(|_| rand::random()).collect();
        std::fs::write(&ram, &data).unwrap();
        let p = Arc::new(Prepared::open(
            dir.path().join("d"),
            dir.path().join("r"),
            2,
        ));
        assert!(p.take(&disk, Some(&ram)).is_none());
        p.refill(&disk, Some(&ram));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while p.lock().values().map(Vec::len).sum::<usize>() < 2 {
            assert!(std::time::Instant::now() < deadline, "no entries made");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        // Another image (no RAM copy) has none.
        assert!(p.take(&disk, None).is_none());
        let e = p.take(&disk, Some(&ram)).unwrap();
        assert_eq!(std::fs::read(e.ram.as_ref().unwrap()).unwrap(), data);
        let head = std::fs::read(&e.overlay).unwrap();
        assert_eq!(&head[..4], b"QFI\xfb", "a qcow2 overlay");
        assert!(
            String::from_utf8_lossy(&head).contains(&*disk.to_string_lossy()),
            "backed by the image's disk"
        );
        let left = p.take(&disk, Some(&ram)).unwrap();
        p.lock()
            .entry(Key {
                disk: disk.clone(),
                ram: Some(ram.clone()),
            })
            .or_default()
            .push(left);
        p.forget(&disk);
        assert!(p.take(&disk, Some(&ram)).is_none());
        assert_eq!(
            std::fs::read_dir(dir.path().join("r")).unwrap().count(),
            1,
            "only the taken copy is left"
        );
    }
}
