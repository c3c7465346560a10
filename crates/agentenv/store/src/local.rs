//! The local folder: chunk files, metadata files, pin files, and the in-memory index (sizes, LRU order,
//! references from manifests, pins) that eviction and gc decide from.
//!
//! Layout: `chunks/<2 hex>/<64 hex>` (stored encoding), `meta/<key with '/' as '%'>`,
//! `pins/<manifest hex>@<holder>`, `tmp/` (temp files; emptied on open), `LOCK` (flock: one process per folder).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::chunk::ChunkId;
use crate::error::{Result, StoreError};
use crate::manifest::{Manifest, ManifestId, Place};

/// Paths of one store folder, and the chunk files written since the last [`LocalDir::sync`].
#[derive(Debug, Clone)]
pub(crate) struct LocalDir {
    pub(crate) root: PathBuf,
    unsynced: Arc<std::sync::Mutex<Vec<PathBuf>>>,
    syncing: Arc<std::sync::Mutex<()>>,
    /// The folder's filesystem commits every earlier metadata change with any fsync (see
    /// [`one_journal`]).
    batch: bool,
}

/// Threads flushing a batch of chunk files (the filesystem commits their fsyncs together).
const SYNC_THREADS: usize = 64;

/// Writes `f`'s data to the disk and waits for it, without a journal commit.
fn write_out(f: &std::fs::File) -> std::io::Result<()> {
    let all = libc::SYNC_FILE_RANGE_WAIT_BEFORE
        | libc::SYNC_FILE_RANGE_WRITE
        | libc::SYNC_FILE_RANGE_WAIT_AFTER;
    // SAFETY: plain syscall on an fd we own.
    match unsafe { libc::sync_file_range(f.as_raw_fd(), 0, 0, all) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// Whether `dir` is on ext4 or XFS, whose single journal commits every earlier metadata change (file
/// sizes, allocations, renames) with any later fsync: a batch of files then needs its data written
/// and one fsync, as git's `core.fsyncMethod=batch` does.
fn one_journal(dir: &std::path::Path) -> bool {
    // The folder may not exist yet: its nearest existing ancestor is on the same filesystem.
    let Some(dir) = dir.ancestors().find_map(|d| d.canonicalize().ok()) else {
        return false;
    };
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let fs = mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split(' ');
            let (_, at, kind) = (f.next()?, f.next()?, f.next()?);
            let at = at.replace("\\040", " ");
            dir.starts_with(&at).then(|| (at.len(), kind.to_owned()))
        })
        .max_by_key(|(n, _)| *n);
    matches!(fs, Some((_, k)) if k == "ext4" || k == "xfs")
}

static TMP_SEQ: AtomicU64 = AtomicU64::new(0);

impl LocalDir {
    pub(crate) fn new(root: PathBuf) -> LocalDir {
        LocalDir {
            batch: one_journal(&root),
            root,
            unsynced: Default::default(),
            syncing: Default::default(),
        }
    }

    pub(crate) fn chunk_path(&self, id: &ChunkId) -> PathBuf {
        let hex = id.to_hex();
        self.root.join("chunks").join(&hex[..2]).join(hex)
    }

    pub(crate) fn meta_path(&self, key: &str) -> PathBuf {
        self.root.join("meta").join(key.replace('/', "%"))
    }

    pub(crate) fn pin_path(&self, id: &ManifestId, holder: &str) -> PathBuf {
        self.root
            .join("pins")
            .join(format!("{}@{holder}", id.to_hex()))
    }

    pub(crate) fn tmp_path(&self, what: &str) -> PathBuf {
        let seq = TMP_SEQ.fetch_add(1, Ordering::Relaxed);
        self.root
            .join("tmp")
            .join(format!("{what}.{}.{seq}", std::process::id()))
    }

    /// Creates the folders, takes the folder lock (waiting up to `lock_wait` for another holder to let
    /// go) and empties `tmp/`.
    pub(crate) fn prepare(&self, lock_wait: std::time::Duration) -> Result<std::fs::File> {
        for sub in ["chunks", "meta", "pins", "tmp"] {
            let p = self.root.join(sub);
            std::fs::create_dir_all(&p).map_err(StoreError::io("create", &p))?;
        }
        let lock_path = self.root.join("LOCK");
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(StoreError::io("open", &lock_path))?;
        let deadline = std::time::Instant::now() + lock_wait;
        loop {
            // SAFETY: flock on an fd we own.
            if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                break;
            }
            let source = std::io::Error::last_os_error();
            if source.kind() != std::io::ErrorKind::WouldBlock
                || std::time::Instant::now() >= deadline
            {
                return Err(StoreError::Io {
                    what: "lock (another process has this store open)",
                    path: lock_path,
                    source,
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let tmp = self.root.join("tmp");
        for e in std::fs::read_dir(&tmp)
            .map_err(StoreError::io("read", &tmp))?
            .flatten()
        {
            let _ = std::fs::remove_file(e.path());
        }
        Ok(lock)
    }

    /// Writes a chunk file (temp, rename; no fsync). `durable`: the next [`LocalDir::sync`] makes it
    /// durable; otherwise (a cached copy of a remote chunk) it is not tracked.
    pub(crate) fn write_chunk(&self, id: &ChunkId, stored: &[u8], durable: bool) -> Result<()> {
        let dst = self.chunk_path(id);
        let tmp = self.tmp_path("chunk");
        let mut f = std::fs::File::create(&tmp).map_err(StoreError::io("create", &tmp))?;
        f.write_all(stored).map_err(StoreError::io("write", &tmp))?;
        drop(f);
        if let Err(e) = std::fs::rename(&tmp, &dst) {
            if e.kind() != std::io::ErrorKind::NotFound {
                let _ = std::fs::remove_file(&tmp);
                return Err(StoreError::io("rename to", &dst)(e));
            }
            let parent = dst.parent().unwrap_or(&self.root);
            std::fs::create_dir_all(parent).map_err(StoreError::io("create", parent))?;
            std::fs::rename(&tmp, &dst).map_err(StoreError::io("rename to", &dst))?;
        }
        if durable {
            self.unsynced
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(dst);
        }
        Ok(())
    }

    /// Reads a chunk file's stored bytes; `Ok(None)` when absent.
    pub(crate) fn read_chunk(&self, id: &ChunkId) -> Result<Option<Vec<u8>>> {
        let p = self.chunk_path(id);
        match std::fs::read(&p) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StoreError::io("read", &p)(e)),
        }
    }

    /// Makes every chunk file written `durable` so far durable, with the folders naming them, and no
    /// other file (a `syncfs` would also flush guest RAM files): on ext4 and XFS their data is written
    /// and waited for, then one fsync commits the journal; elsewhere an fsync each and one per folder,
    /// on [`SYNC_THREADS`] threads. A call returns once the chunks written before it are durable, also
    /// those another call took.
    pub(crate) fn sync(&self) -> Result<()> {
        let _one = self.syncing.lock().unwrap_or_else(|e| e.into_inner());
        let files = std::mem::take(&mut *self.unsynced.lock().unwrap_or_else(|e| e.into_inner()));
        let next = AtomicU64::new(0);
        let flush = |list: &[PathBuf]| -> Result<()> {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                let Some(p) = list.get(i) else { return Ok(()) };
                match std::fs::File::open(p).and_then(|f| match self.batch {
                    true => write_out(&f),
                    false => f.sync_all(),
                }) {
                    Ok(()) => {}
                    // Evicted meanwhile: nothing of it to keep.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(StoreError::io("fsync", p)(e)),
                }
            }
        };
        if self.batch {
            // Every file's writeback first, so that the disk sees them together.
            for p in &files {
                if let Ok(f) = std::fs::File::open(p) {
                    // SAFETY: plain syscall on an fd we own; only starts writeback (a hint).
                    unsafe {
                        libc::sync_file_range(f.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE)
                    };
                }
            }
        }
        // The journal commit covers the renames; elsewhere each folder is flushed too.
        let dirs: Vec<PathBuf> = match self.batch {
            true => vec![],
            false => {
                let set: BTreeSet<&std::path::Path> =
                    files.iter().filter_map(|f| f.parent()).collect();
                set.into_iter().map(PathBuf::from).collect()
            }
        };
        let r = [&files, &dirs].into_iter().try_for_each(|list| {
            next.store(0, Ordering::Relaxed);
            let threads = SYNC_THREADS.min(list.len());
            std::thread::scope(|s| {
                let hs: Vec<_> = (0..threads).map(|_| s.spawn(|| flush(list))).collect();
                hs.into_iter().try_for_each(|h| {
                    h.join().unwrap_or_else(|_| {
                        let e = std::io::Error::other("a flush thread panicked");
                        Err(StoreError::io("fsync", &self.root)(e))
                    })
                })
            })
        });
        let r = match (r, self.batch && !files.is_empty()) {
            (Ok(()), true) => self.commit_journal(),
            (r, _) => r,
        };
        if r.is_err() {
            // Flushed again by the next call.
            self.unsynced
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(files);
        }
        r
    }

    /// Commits the filesystem's journal: an fsync of a file changed after everything before it.
    fn commit_journal(&self) -> Result<()> {
        let p = self.root.join("tmp").join("journal-commit");
        std::fs::write(&p, TMP_SEQ.fetch_add(1, Ordering::Relaxed).to_le_bytes())
            .and_then(|()| std::fs::File::open(&p)?.sync_all())
            .map_err(StoreError::io("fsync", &p))
    }

    /// Every chunk file with its size and mtime (seconds).
    pub(crate) fn scan_chunks(&self) -> Result<Vec<(ChunkId, u64, i64)>> {
        use std::os::unix::fs::MetadataExt;
        let mut out = Vec::new();
        let root = self.root.join("chunks");
        for sub in std::fs::read_dir(&root)
            .map_err(StoreError::io("read", &root))?
            .flatten()
        {
            let Ok(files) = std::fs::read_dir(sub.path()) else {
                continue;
            };
            for f in files.flatten() {
                let name = f.file_name();
                let (Some(id), Ok(md)) = (ChunkId::from_hex(&name.to_string_lossy()), f.metadata())
                else {
                    continue;
                };
                out.push((id, md.len(), md.mtime()));
            }
        }
        Ok(out)
    }

    /// Metadata keys present locally.
    pub(crate) fn meta_keys(&self) -> Result<Vec<String>> {
        let root = self.root.join("meta");
        let mut keys: Vec<String> = std::fs::read_dir(&root)
            .map_err(StoreError::io("read", &root))?
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| !n.starts_with('.'))
            .map(|n| n.replace('%', "/"))
            .collect();
        keys.sort();
        Ok(keys)
    }

    /// `(manifest, holder)` of every pin file.
    pub(crate) fn scan_pins(&self) -> Result<Vec<(ManifestId, String)>> {
        let root = self.root.join("pins");
        Ok(std::fs::read_dir(&root)
            .map_err(StoreError::io("read", &root))?
            .flatten()
            .filter_map(|e| {
                let n = e.file_name().into_string().ok()?;
                let (m, h) = n.split_once('@')?;
                Some((ManifestId::from_hex(m)?, h.to_owned()))
            })
            .collect())
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    stored_len: u64,
    tick: u64,
}

/// In-memory view of the folder: what is cached, in which LRU order, and what must not go.
#[derive(Debug, Default)]
pub(crate) struct Index {
    chunks: HashMap<ChunkId, Entry>,
    lru: BTreeMap<u64, ChunkId>,
    tick: u64,
    total: u64,
    /// Number of known manifests that reference each chunk.
    refs: HashMap<ChunkId, u32>,
    pub(crate) manifests: HashMap<ManifestId, Arc<Manifest>>,
    pub(crate) pins: HashMap<ManifestId, BTreeSet<String>>,
    /// Number of pinned manifests that reference each chunk.
    pinned: HashMap<ChunkId, u32>,
    /// Chunks of running ingests (not yet covered by a manifest).
    protected: HashMap<ChunkId, u32>,
    /// Where known manifests place chunks in bucket packs: `(pack, offset, stored length)`.
    placed: HashMap<ChunkId, Place>,
}

fn bump(map: &mut HashMap<ChunkId, u32>, id: ChunkId, up: bool) {
    if up {
        *map.entry(id).or_default() += 1;
    } else if let Some(n) = map.get_mut(&id) {
        *n -= 1;
        if *n == 0 {
            map.remove(&id);
        }
    }
}

/// Distinct chunk ids of a manifest.
fn distinct(m: &Manifest) -> BTreeSet<ChunkId> {
    m.chunks.iter().map(|&(_, id)| id).collect()
}

impl Index {
    pub(crate) fn total_bytes(&self) -> u64 {
        self.total
    }

    pub(crate) fn n_chunks(&self) -> usize {
        self.chunks.len()
    }

    pub(crate) fn has(&self, id: &ChunkId) -> bool {
        self.chunks.contains_key(id)
    }

    /// True when some known manifest references `id`.
    pub(crate) fn referenced(&self, id: &ChunkId) -> bool {
        self.refs.contains_key(id)
    }

    /// Records a chunk file as present (newest in LRU order) or refreshes its LRU position.
    pub(crate) fn insert(&mut self, id: ChunkId, stored_len: u64) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(e) = self.chunks.get_mut(&id) {
            self.lru.remove(&e.tick);
            e.tick = tick;
        } else {
            self.chunks.insert(id, Entry { stored_len, tick });
            self.total += stored_len;
        }
        self.lru.insert(tick, id);
    }

    /// Marks a use (LRU refresh) if present.
    pub(crate) fn touch(&mut self, id: &ChunkId) {
        if let Some(len) = self.chunks.get(id).map(|e| e.stored_len) {
            self.insert(*id, len);
        }
    }

    pub(crate) fn remove(&mut self, id: &ChunkId) -> Option<u64> {
        let e = self.chunks.remove(id)?;
        self.lru.remove(&e.tick);
        self.total -= e.stored_len;
        Some(e.stored_len)
    }

    pub(crate) fn add_manifest(&mut self, id: ManifestId, m: Arc<Manifest>) {
        if self.manifests.contains_key(&id) {
            return;
        }
        for c in distinct(&m) {
            bump(&mut self.refs, c, true);
        }
        self.add_places(&m, None);
        if self.pins.contains_key(&id) {
            for c in distinct(&m) {
                bump(&mut self.pinned, c, true);
            }
        }
        self.manifests.insert(id, m);
    }

    pub(crate) fn remove_manifest(&mut self, id: &ManifestId) {
        let Some(m) = self.manifests.remove(id) else {
            return;
        };
        for c in distinct(&m) {
            bump(&mut self.refs, c, false);
        }
        // A place may have come from this manifest's packs, which gc may now delete: take it from
        // the manifests left.
        let mut redo = HashSet::new();
        for &(_, c) in &m.chunks {
            if self.placed.get(&c).is_some_and(|p| m.packs.contains(&p.0)) {
                self.placed.remove(&c);
                if self.refs.contains_key(&c) {
                    redo.insert(c);
                }
            }
        }
        if !redo.is_empty() {
            let left: Vec<Arc<Manifest>> = self.manifests.values().cloned().collect();
            for m in left {
                self.add_places(&m, Some(&redo));
            }
        }
    }

    fn add_places(&mut self, m: &Manifest, only: Option<&HashSet<ChunkId>>) {
        for (i, &(_, c)) in m.chunks.iter().enumerate() {
            if only.is_some_and(|o| !o.contains(&c)) {
                continue;
            }
            if let Some(p) = m.place(i) {
                self.placed.entry(c).or_insert(p);
            }
        }
    }

    /// Where a known manifest places chunk `id` in a bucket pack.
    pub(crate) fn place(&self, id: &ChunkId) -> Option<Place> {
        self.placed.get(id).copied()
    }

    /// Stored length of a local chunk.
    pub(crate) fn stored_len(&self, id: &ChunkId) -> Option<u64> {
        self.chunks.get(id).map(|e| e.stored_len)
    }

    /// Adds a pin; the manifest's chunks count as pinned once per manifest, however many holders.
    pub(crate) fn pin(&mut self, id: ManifestId, holder: String) {
        let first = !self.pins.contains_key(&id);
        self.pins.entry(id).or_default().insert(holder);
        if first && let Some(m) = self.manifests.get(&id).cloned() {
            for c in distinct(&m) {
                bump(&mut self.pinned, c, true);
            }
        }
    }

    pub(crate) fn unpin(&mut self, id: &ManifestId, holder: &str) {
        let Some(hs) = self.pins.get_mut(id) else {
            return;
        };
        hs.remove(holder);
        if hs.is_empty() {
            self.pins.remove(id);
            if let Some(m) = self.manifests.get(id).cloned() {
                for c in distinct(&m) {
                    bump(&mut self.pinned, c, false);
                }
            }
        }
    }

    pub(crate) fn protect(&mut self, ids: &[ChunkId], up: bool) {
        for id in ids {
            bump(&mut self.protected, *id, up);
        }
    }

    /// Whether a chunk may leave the local folder in the first pass: with a remote, anything not pinned (the
    /// bucket keeps it); local only, nothing a manifest references. Chunks of running ingests never.
    fn evictable(&self, id: &ChunkId, has_remote: bool) -> bool {
        !self.protected.contains_key(id)
            && if has_remote {
                !self.pinned.contains_key(id)
            } else {
                !self.refs.contains_key(id)
            }
    }

    /// Picks the least recently used evictable chunks until the cache is at most `max_bytes`, removing
    /// them from the index; the caller deletes their files.
    pub(crate) fn evict_to(&mut self, max_bytes: u64, has_remote: bool) -> Vec<ChunkId> {
        let mut victims = Vec::new();
        if self.total <= max_bytes {
            return victims;
        }
        let mut freed = 0u64;
        for id in self.lru.values() {
            if self.total - freed <= max_bytes {
                break;
            }
            if self.evictable(id, has_remote) {
                freed += self.chunks[id].stored_len;
                victims.push(*id);
            }
        }
        // With a remote the bound holds: pinned chunks go too (oldest first) when the others do not suffice.
        // Chunks of running ingests may exceed it for a while (they become evictable when the ingest ends).
        let ingesting: u64 = self
            .protected
            .keys()
            .filter_map(|id| self.chunks.get(id))
            .map(|e| e.stored_len)
            .sum();
        if has_remote && self.total - freed > max_bytes + ingesting {
            let first: std::collections::HashSet<ChunkId> = victims.iter().copied().collect();
            for id in self.lru.values() {
                if self.total - freed <= max_bytes + ingesting {
                    break;
                }
                if !first.contains(id) && !self.protected.contains_key(id) {
                    freed += self.chunks[id].stored_len;
                    victims.push(*id);
                }
            }
        }
        for id in &victims {
            self.remove(id);
        }
        victims
    }

    /// Local chunks no known manifest references (and no running ingest holds), removed from the index.
    pub(crate) fn take_unreferenced(&mut self) -> Vec<(ChunkId, u64)> {
        let ids: Vec<ChunkId> = self
            .chunks
            .keys()
            .filter(|id| !self.refs.contains_key(id) && !self.protected.contains_key(id))
            .copied()
            .collect();
        ids.into_iter()
            .filter_map(|id| self.remove(&id).map(|n| (id, n)))
            .collect()
    }

    /// Union of the bucket packs of every known manifest.
    pub(crate) fn referenced_packs(&self) -> HashSet<ChunkId> {
        self.manifests
            .values()
            .flat_map(|m| m.packs.iter().copied())
            .collect()
    }

    /// Union of the chunk ids of every known manifest.
    pub(crate) fn referenced_set(&self) -> std::collections::HashSet<ChunkId> {
        self.refs.keys().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{Loc, MANIFEST_VERSION};

    #[test]
    fn batch_flushes_only_where_one_journal_commits_everything() {
        assert!(!one_journal(std::path::Path::new("/proc/self")), "procfs");
        let root = tempfile::tempdir().unwrap();
        let fs = std::process::Command::new("stat")
            .args(["-f", "-c", "%T"])
            .arg(root.path())
            .output()
            .unwrap();
        let kind = String::from_utf8_lossy(&fs.stdout).trim().to_owned();
        let want = kind == "ext2/ext3" || kind == "xfs";
        assert_eq!(one_journal(&root.path().join("not/yet")), want, "{kind}");
    }

    fn id(n: u32) -> ChunkId {
        ChunkId::of(&n.to_le_bytes())
    }

    #[test]
    fn sync_flushes_the_durable_chunks_written_before_it_and_skips_evicted_ones() {
        for batch in [true, false] {
            sync_case(batch);
        }
    }

    fn sync_case(batch: bool) {
        let root = tempfile::tempdir().unwrap();
        let mut dir = LocalDir::new(root.path().join("store"));
        dir.batch = batch;
        let _lock = dir.prepare(std::time::Duration::from_secs(1)).unwrap();
        let chunks: Vec<(ChunkId, Vec<u8>)> = (0..40)
            .map(|_| {
                let data: Vec<u8> = (0..rand::random_range(1..4096))
                    .map(|_| rand::random())
                    .collect();
                (ChunkId::of(&data), data)
            })
            .collect();
        for (i, (id, data)) in chunks.iter().enumerate() {
            dir.write_chunk(id, data, i % 4 != 0).unwrap();
        }
        let tracked = |d: &LocalDir| d.unsynced.lock().unwrap().len();
        assert_eq!(tracked(&dir), 30, "cached copies are not tracked");
        let evicted = &chunks[1].0;
        std::fs::remove_file(dir.chunk_path(evicted)).unwrap();
        dir.sync().unwrap();
        assert_eq!(tracked(&dir), 0);
        for (id, data) in &chunks[2..] {
            assert_eq!(dir.read_chunk(id).unwrap().as_deref(), Some(&data[..]));
        }
        assert_eq!(dir.read_chunk(evicted).unwrap(), None);
        dir.sync().unwrap();
    }

    #[test]
    fn eviction_takes_oldest_first_and_spares_pinned_and_referenced() {
        let mut ix = Index::default();
        for n in 0..10 {
            ix.insert(id(n), 100);
        }
        ix.touch(&id(0)); // 0 is now the newest
        let m = Manifest {
            version: MANIFEST_VERSION,
            len: 1 << 20,
            chunk_size: 1 << 16,
            chunks: vec![(0, id(1)), (1, id(2))],
            packs: vec![],
            at: vec![],
        };
        let mid = m.id();
        ix.add_manifest(mid, Arc::new(m));
        ix.pin(mid, "sbx-a".into());
        // With a remote: pinned 1 and 2 stay; 3,4,5 are the oldest others.
        let v = ix.evict_to(700, true);
        assert_eq!(v, vec![id(3), id(4), id(5)]);
        assert_eq!(ix.total_bytes(), 700);
        // With a remote the bound holds: once no unpinned chunk is left, pinned ones go, oldest first.
        let v = ix.evict_to(100, true);
        assert_eq!(v, vec![id(6), id(7), id(8), id(9), id(0), id(1)]);
        assert!(ix.has(&id(2)));
        for n in [1, 6, 7, 8, 9, 0] {
            ix.insert(id(n), 100);
        }
        // Local only: referenced chunks stay even when unpinned.
        ix.unpin(&mid, "sbx-a");
        let v = ix.evict_to(200, false);
        assert_eq!(v, vec![id(6), id(7), id(8), id(9), id(0)]);
        assert!(ix.has(&id(1)) && ix.has(&id(2)));
        assert_eq!(ix.total_bytes(), 200);
    }

    #[test]
    fn a_place_outlives_the_manifest_it_came_from_only_through_another_manifest() {
        let mut ix = Index::default();
        let (c, other) = (id(rand::random()), id(rand::random()));
        let (p1, p2) = (id(rand::random()), id(rand::random()));
        let m = |pack: ChunkId, off: u64| Manifest {
            version: MANIFEST_VERSION,
            len: 1 << 17,
            chunk_size: 1 << 16,
            chunks: vec![(0, c), (1, other)],
            packs: vec![pack],
            at: vec![Some(Loc(0, off, 100)), None],
        };
        let (m1, m2) = (m(p1, 0), m(p2, 4096));
        let (i1, i2) = (m1.id(), m2.id());
        ix.add_manifest(i1, Arc::new(m1));
        ix.add_manifest(i2, Arc::new(m2));
        assert_eq!(ix.place(&c), Some((p1, 0, 100)));
        assert_eq!(ix.place(&other), None, "a chunk of its own has no place");
        ix.remove_manifest(&i1);
        assert_eq!(
            ix.place(&c),
            Some((p2, 4096, 100)),
            "p1 may be collected now"
        );
        assert_eq!(ix.referenced_packs(), HashSet::from([p2]));
        ix.remove_manifest(&i2);
        assert_eq!(ix.place(&c), None);
        assert!(ix.referenced_packs().is_empty());
    }
}
