//! A volume's bucket form: its manifest (checked whole before anything is written), the walk
//! that lists a volume, the pack of its files' bytes, and the restore that writes them back below
//! a fresh folder through `beneath.rs`.

use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::beneath::Root;
use super::{MAX_VOLUME_BYTES, MAX_VOLUME_ENTRIES, Result, Volume, VolumeError, io};

/// Format of [`VolumeManifest`].
pub const MANIFEST_FORMAT: u32 = 1;
/// Largest manifest blob read or written.
pub const MAX_MANIFEST_BYTES: usize = 32 << 20;
const MAX_PATH: usize = 4096;

pub(super) fn bad(volume: &str, detail: impl Into<String>) -> VolumeError {
    VolumeError::BadManifest {
        volume: volume.into(),
        detail: detail.into(),
    }
}

/// A volume as kept in the bucket.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VolumeManifest {
    pub format: u32,
    pub volume: Volume,
    /// One more than the manifest it replaced.
    pub generation: u64,
    /// Files start at multiples of it in the pack.
    pub chunk_size: u64,
    /// The pack holding the files' bytes.
    pub pack: String,
    /// Parents before their children.
    pub entries: Vec<Entry>,
}

/// What an entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    File,
    Dir,
    Symlink,
}

/// One file, folder or symlink of a volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// From the volume's root, without a leading `/` (`a/b`).
    pub path: String,
    pub kind: Kind,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime_ns: i64,
    /// Bytes of a file.
    #[serde(default)]
    pub size: u64,
    /// Chunk slot of the pack where a file's bytes begin.
    #[serde(default)]
    pub first: u64,
    /// A symlink's target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

/// Makes `<dir>/data` from a fresh folder that `fill` writes; the tree's fingerprint.
pub(super) fn write_data(dir: &Path, fill: impl FnOnce(&Root) -> Result<()>) -> Result<u64> {
    let tmp = dir.join(".restore");
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io("deleting", &tmp))?;
    }
    std::fs::create_dir(&tmp).map_err(io("creating", &tmp))?;
    let done = (|| {
        std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .map_err(io("chmod", &tmp))?;
        let root = Root::open(&tmp).map_err(io("opening", &tmp))?;
        fill(&root)?;
        root.syncfs().map_err(io("syncing", &tmp))?;
        let fp = walk(&root)?.1;
        let data = dir.join("data");
        std::fs::rename(&tmp, &data).map_err(io("renaming", &data))?;
        Ok(fp)
    })();
    if done.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    done
}

/// A manifest blob, checked whole: format, bounds, and every path, parent and target.
pub fn parse(id: &str, bytes: &[u8]) -> Result<VolumeManifest> {
    if bytes.len() > MAX_MANIFEST_BYTES {
        return Err(bad(
            id,
            format!("{} bytes, at most {MAX_MANIFEST_BYTES}", bytes.len()),
        ));
    }
    let vm: VolumeManifest = serde_json::from_slice(bytes).map_err(|e| bad(id, e.to_string()))?;
    if vm.format != MANIFEST_FORMAT {
        return Err(bad(id, format!("format {}", vm.format)));
    }
    let cs = vm.chunk_size;
    if !cs.is_power_of_two() || !(4 << 10..=4 << 20).contains(&cs) {
        return Err(bad(id, format!("chunk size {cs}")));
    }
    let pack_ok = (1..=128).contains(&vm.pack.len())
        && vm
            .pack
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-');
    if !pack_ok {
        return Err(bad(id, "pack name"));
    }
    if vm.volume.volume_id != id || !super::valid_name(&vm.volume.name) {
        return Err(bad(id, "its record names another volume or a bad name"));
    }
    if vm.entries.len() as u64 > MAX_VOLUME_ENTRIES {
        return Err(bad(
            id,
            format!("{} entries, at most {MAX_VOLUME_ENTRIES}", vm.entries.len()),
        ));
    }
    let mut dirs: HashSet<&str> = HashSet::from([""]);
    let mut seen: HashSet<&str> = HashSet::new();
    let mut bytes = 0u64;
    for e in &vm.entries {
        let p = e.path.as_str();
        let ok = !p.is_empty()
            && p.len() <= MAX_PATH
            && p.split('/')
                .all(|c| !matches!(c, "" | "." | "..") && c.len() <= 255 && !c.contains('\0'));
        if !ok {
            return Err(bad(id, format!("path {p:?}")));
        }
        let parent = p.rsplit_once('/').map_or("", |(up, _)| up);
        if !dirs.contains(parent) || !seen.insert(p) {
            return Err(bad(
                id,
                format!("path {p:?}: no folder before it, or twice"),
            ));
        }
        match e.kind {
            Kind::Dir => {
                dirs.insert(p);
            }
            Kind::File => bytes = bytes.saturating_add(e.size),
            Kind::Symlink => {
                let t = e.target.as_deref().unwrap_or_default();
                if t.is_empty() || t.len() >= MAX_PATH || t.contains('\0') {
                    return Err(bad(id, format!("symlink {p:?} target")));
                }
            }
        }
    }
    if bytes > MAX_VOLUME_BYTES {
        return Err(bad(
            id,
            format!("{bytes} bytes, at most {MAX_VOLUME_BYTES}"),
        ));
    }
    Ok(vm)
}

/// Every file's slots lie inside the pack.
pub(super) fn check_pack(id: &str, vm: &VolumeManifest, pack_len: u64) -> Result<()> {
    let cs = vm.chunk_size;
    let mut slots = 1u64;
    for e in vm.entries.iter().filter(|e| e.kind == Kind::File) {
        let end = e.first.saturating_mul(cs).saturating_add(e.size);
        if e.first == 0 || end > pack_len {
            return Err(bad(id, format!("file {:?} lies outside its pack", e.path)));
        }
        slots = slots.saturating_add(e.size.div_ceil(cs).max(1));
    }
    // No more is fetched than the files need (a pack is written whole before the restore).
    if pack_len > slots.saturating_mul(cs) {
        return Err(bad(id, format!("a pack of {pack_len} bytes for fewer")));
    }
    Ok(())
}

/// The tree below `root`, parents first, and its fingerprint; bounded by the volume's limits.
pub(super) fn walk(root: &Root) -> Result<(Vec<Entry>, u64)> {
    let mut out = vec![];
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let mut bytes = 0u64;
    let mut dirs: Vec<String> = vec![String::new()];
    let mut i = 0;
    while i < dirs.len() {
        let d = dirs[i].clone();
        i += 1;
        let parts: Vec<&str> = d.split('/').filter(|c| !c.is_empty()).collect();
        let shown = format!("/{d}");
        for (name, st) in root
            .list(&parts)
            .map_err(io("listing", Path::new(&shown)))?
        {
            let path = if d.is_empty() {
                name
            } else {
                format!("{d}/{name}")
            };
            let kind = match st.st_mode & libc::S_IFMT {
                libc::S_IFDIR => Kind::Dir,
                libc::S_IFREG => Kind::File,
                libc::S_IFLNK => Kind::Symlink,
                _ => continue,
            };
            if out.len() as u64 >= MAX_VOLUME_ENTRIES {
                return Err(VolumeError::TooManyEntries(MAX_VOLUME_ENTRIES));
            }
            let p: Vec<&str> = path.split('/').collect();
            let target = match kind {
                Kind::Symlink => Some(root.readlink(&p).map_err(io("reading", Path::new(&path)))?),
                _ => None,
            };
            let size = if kind == Kind::File {
                st.st_size.max(0) as u64
            } else {
                0
            };
            bytes += size;
            if bytes > MAX_VOLUME_BYTES {
                return Err(VolumeError::Full(MAX_VOLUME_BYTES));
            }
            (&path, kind, size, st.st_mode, st.st_uid, st.st_gid).hash(&mut h);
            (
                st.st_mtime,
                st.st_mtime_nsec,
                st.st_ctime,
                st.st_ctime_nsec,
                st.st_ino,
            )
                .hash(&mut h);
            if kind == Kind::Dir {
                dirs.push(path.clone());
            }
            out.push(Entry {
                path,
                kind,
                mode: st.st_mode & 0o7777,
                uid: st.st_uid,
                gid: st.st_gid,
                mtime_ns: st
                    .st_mtime
                    .saturating_mul(1_000_000_000)
                    .saturating_add(st.st_mtime_nsec),
                size,
                first: 0,
                target,
            });
        }
    }
    // Breadth first: parents before children, each folder's names sorted.
    Ok((out, h.finish()))
}

/// The pack: a header chunk unique to this flush, then each file from a chunk boundary.
pub(super) fn write_pack(
    root: &Root,
    pack: &Path,
    id: &str,
    cs: u64,
    entries: &mut [Entry],
) -> Result<()> {
    let mut f = std::fs::File::create_new(pack).map_err(io("creating", pack))?;
    let header = format!("k3 volume pack\n{id}\n{:032x}\n", rand::random::<u128>());
    f.write_all(header.as_bytes())
        .map_err(io("writing", pack))?;
    let mut slot = 1u64;
    for e in entries.iter_mut().filter(|e| e.kind == Kind::File) {
        let p: Vec<&str> = e.path.split('/').collect();
        let shown = PathBuf::from(&e.path);
        let src = root.open_file(&p, false).map_err(io("reading", &shown))?;
        f.seek(SeekFrom::Start(slot * cs))
            .map_err(io("writing", pack))?;
        // A file written meanwhile: what it holds now, up to its size at the walk.
        let n = std::io::copy(&mut src.take(e.size), &mut f).map_err(io("reading", &shown))?;
        e.size = n;
        e.first = slot;
        slot += n.div_ceil(cs).max(1);
    }
    f.set_len((slot * cs).max(cs))
        .map_err(io("writing", pack))?;
    f.sync_all().map_err(io("syncing", pack))
}

/// Writes `entries` below `root` from the materialized pack `f`; folders' times last.
pub(super) fn fill(root: &Root, entries: &[Entry], f: &mut std::fs::File, cs: u64) -> Result<()> {
    let ts = |ns: i64| libc::timespec {
        tv_sec: ns.div_euclid(1_000_000_000),
        tv_nsec: ns.rem_euclid(1_000_000_000),
    };
    for e in entries {
        let p: Vec<&str> = e.path.split('/').collect();
        let shown = PathBuf::from(&e.path);
        match e.kind {
            Kind::Dir => root.mkdir(&p, e.mode & 0o1777),
            Kind::Symlink => root.symlink(&p, e.target.as_deref().unwrap_or_default()),
            Kind::File => (|| {
                let mut out = root.create(&p, e.mode & 0o1777, true)?;
                f.seek(SeekFrom::Start(e.first * cs))?;
                let n = std::io::copy(&mut Read::by_ref(f).take(e.size), &mut out)?;
                if n != e.size {
                    return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
                }
                Ok(())
            })(),
        }
        .map_err(io("restoring", &shown))?;
        // Owners as they were where the server may set them.
        let _ = root.chown(&p, Some(e.uid), Some(e.gid));
        if e.kind != Kind::Dir {
            let _ = root.utimes(&p, None, Some(ts(e.mtime_ns)));
        }
    }
    for e in entries.iter().rev().filter(|e| e.kind == Kind::Dir) {
        let p: Vec<&str> = e.path.split('/').collect();
        let _ = root.utimes(&p, None, Some(ts(e.mtime_ns)));
    }
    Ok(())
}
