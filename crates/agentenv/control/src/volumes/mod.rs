//! Volumes (E2B's `/volumes` and its volume content API): named folders of files that belong to one
//! tenant and outlive sandboxes, kept on this node's disk under `<state>/volumes/<id>/` (`volume.json`,
//! the files under `data/`). With a bucket, every volume is kept there too (`bucket.rs`, `pack.rs`).
//!
//! The content API authenticates with a volume's token (`Authorization: Bearer`), an HMAC of its id
//! under a key derived from the server's, so it needs no storage and proves nothing else. Paths are
//! resolved lexically below `data/` (`..` refused) and never through a symlink. Limits: a tenant holds
//! at most [`MAX_VOLUMES`] volumes of at most [`MAX_VOLUME_BYTES`] each.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use serde::{Deserialize, Serialize};

use crate::keys;

mod beneath;
pub mod bucket;
#[cfg(test)]
mod bucket_tests;
pub mod channel;
#[cfg(test)]
mod channel_tests;
pub mod pack;
#[cfg(test)]
mod tests;

/// Volumes one tenant may hold.
pub const MAX_VOLUMES: usize = 16;
/// Bytes of files one volume may hold.
pub const MAX_VOLUME_BYTES: u64 = 2 << 30;
/// Files, folders and symlinks one volume may hold (bounds every walk and listing of it).
pub const MAX_VOLUME_ENTRIES: u64 = 100_000;

/// Failures of the volume API, each with what it concerns.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("volume {0} not found")]
    NotFound(String),
    #[error("a volume named {0} exists already")]
    NameTaken(String),
    #[error("invalid volume name {0:?}: 1 to 64 of [a-zA-Z0-9_-]")]
    BadName(String),
    #[error("a key holds at most {0} volumes")]
    TooMany(usize),
    #[error("missing or wrong volume token")]
    Unauthorized,
    #[error("invalid path {0:?}")]
    BadPath(String),
    #[error("path {0} not found")]
    PathNotFound(String),
    #[error("path {0} already exists")]
    Exists(String),
    #[error("path {0} is not a directory")]
    NotADirectory(String),
    #[error("path {0} is a directory")]
    IsADirectory(String),
    #[error("the volume would exceed its {0} bytes")]
    Full(u64),
    #[error("the volume holds its {0} entries already")]
    TooManyEntries(u64),
    #[error("volume {volume}: bad bucket manifest: {detail}")]
    BadManifest { volume: String, detail: String },
    #[error("volume {volume}: {what} in the bucket: {source}")]
    Store {
        what: &'static str,
        volume: String,
        source: bucket::BucketError,
    },
    #[error("volume bucket: {0}")]
    Runtime(String),
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

type Result<T, E = VolumeError> = std::result::Result<T, E>;

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> VolumeError {
    let path = path.to_owned();
    move |source| VolumeError::Io { what, path, source }
}

/// One volume, as its tenant sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Volume {
    pub volume_id: String,
    pub name: String,
    pub owner: String,
}

/// A file or folder of a volume (E2B's `VolumeEntryStat`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryStat {
    pub name: String,
    /// `file`, `directory`, `symlink` or `unknown`.
    pub kind: &'static str,
    /// From the volume's root, starting with `/`.
    pub path: String,
    pub size: u64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub atime_ms: i64,
    pub mtime_ms: i64,
    pub ctime_ms: i64,
}

/// Owner and permissions asked for a new or changed entry.
#[derive(Debug, Clone, Copy, Default)]
pub struct Meta {
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// Permission bits only: setuid, setgid and sticky are dropped.
    pub mode: Option<u32>,
}

/// Every volume of this node.
pub struct Volumes {
    dir: PathBuf,
    token_key: String,
    /// Creates and deletes, one at a time (names stay unique per tenant).
    lock: Mutex<()>,
    /// Folders open for mounts, one per volume (shared use accounting).
    mounted: Mutex<HashMap<String, Weak<channel::VolumeDir>>>,
    /// The chunk store's bucket, where there is one (`bucket.rs`).
    bucket: OnceLock<Arc<bucket::Bucket>>,
}

/// 1 to 64 of `[a-zA-Z0-9_-]`.
fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl Volumes {
    /// The volumes under `<state_dir>/volumes`; tokens keyed by a key derived from `server_key`.
    pub fn open(state_dir: &Path, server_key: &str) -> Result<Volumes> {
        let dir = state_dir.join("volumes");
        k3_common::fsutil::create_private_dir(&dir).map_err(io("creating", &dir))?;
        let token_key = keys::hmac_sha256_hex(server_key.as_bytes(), b"agentenv volume tokens");
        Ok(Volumes {
            dir,
            token_key,
            lock: Mutex::new(()),
            mounted: Mutex::default(),
            bucket: OnceLock::new(),
        })
    }

    fn token(&self, id: &str) -> String {
        format!(
            "vol_{}",
            keys::hmac_sha256_hex(self.token_key.as_bytes(), id.as_bytes())
        )
    }

    fn all(&self) -> Vec<Volume> {
        let mut out: Vec<Volume> = std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| std::fs::read(e.path().join("volume.json")).ok())
            .filter_map(|b| serde_json::from_slice(&b).ok())
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Makes volume `name` for `owner`; it and its token.
    pub fn create(&self, owner: &str, name: &str) -> Result<(Volume, String)> {
        if !valid_name(name) {
            return Err(VolumeError::BadName(name.into()));
        }
        let _held = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let mine = self.list(owner);
        if mine.iter().any(|v| v.name == name) {
            return Err(VolumeError::NameTaken(name.into()));
        }
        if mine.len() >= MAX_VOLUMES {
            return Err(VolumeError::TooMany(MAX_VOLUMES));
        }
        let r: [u8; 16] = rand::random();
        let h = keys::hex(&r);
        let id = format!(
            "{}-{}-4{}-{}-{}",
            &h[..8],
            &h[8..12],
            &h[13..16],
            &h[16..20],
            &h[20..32]
        );
        let vol = Volume {
            volume_id: id.clone(),
            name: name.into(),
            owner: owner.into(),
        };
        let data = self.dir.join(&id).join("data");
        std::fs::create_dir_all(&data).map_err(io("creating", &data))?;
        // Every user of a sandbox that mounts it may write at its root (its parents stay private).
        std::fs::set_permissions(&data, std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .map_err(io("chmod", &data))?;
        self.write_record(&vol)?;
        self.touch(&id);
        let token = self.token(&id);
        Ok((vol, token))
    }

    fn write_record(&self, vol: &Volume) -> Result<()> {
        let dir = self.dir.join(&vol.volume_id);
        std::fs::create_dir_all(&dir).map_err(io("creating", &dir))?;
        let meta = serde_json::to_vec(vol).map_err(|e| VolumeError::Runtime(e.to_string()))?;
        k3_common::fsutil::write_atomic(&dir.join("volume.json"), &meta)
            .map_err(io("writing", &dir))
    }

    /// `owner`'s volumes, by name (with a bucket, those it holds too).
    pub fn list(&self, owner: &str) -> Vec<Volume> {
        if let Err(e) = self.learn(Some(owner), None) {
            tracing::warn!(error = %e, "volumes in the bucket not listed");
        }
        self.all()
            .into_iter()
            .filter(|v| v.owner == owner)
            .collect()
    }

    /// `owner`'s volume `id` and its token; another tenant's is not found.
    pub fn get(&self, owner: &str, id: &str) -> Result<(Volume, String)> {
        if self.read(id).is_none() {
            self.learn(Some(owner), Some(id))?;
        }
        let vol = self
            .read(id)
            .filter(|v| v.owner == owner)
            .ok_or_else(|| VolumeError::NotFound(id.into()))?;
        Ok((vol, self.token(id)))
    }

    /// `owner`'s volume named `name`.
    pub fn by_name(&self, owner: &str, name: &str) -> Result<Volume> {
        self.list(owner)
            .into_iter()
            .find(|v| v.name == name)
            .ok_or_else(|| VolumeError::NotFound(name.into()))
    }

    /// The folder of volume `id` for a sandbox's channel (one open folder per volume).
    pub fn mount_dir(&self, id: &str) -> Result<Arc<channel::VolumeDir>> {
        self.read(id)
            .ok_or_else(|| VolumeError::NotFound(id.into()))?;
        let mut m = self.mounted.lock().unwrap_or_else(|e| e.into_inner());
        m.retain(|_, d| d.strong_count() > 0);
        if let Some(d) = m.get(id).and_then(Weak::upgrade) {
            return Ok(d);
        }
        let path = self.dir.join(id).join("data");
        let d = Arc::new(channel::VolumeDir::open(&path).map_err(io("opening", &path))?);
        m.insert(id.into(), Arc::downgrade(&d));
        Ok(d)
    }

    fn read(&self, id: &str) -> Option<Volume> {
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-') {
            return None;
        }
        let b = std::fs::read(self.dir.join(id).join("volume.json")).ok()?;
        serde_json::from_slice(&b).ok()
    }

    /// Deletes `owner`'s volume `id` and its files.
    pub fn delete(&self, owner: &str, id: &str) -> Result<()> {
        let _held = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.get(owner, id)?;
        let dir = self.dir.join(id);
        // The bucket's copy first, then the record: a crash midway leaves files no volume lists.
        self.forget(owner, id, || {
            let meta = dir.join("volume.json");
            std::fs::remove_file(&meta).map_err(io("deleting", &meta))?;
            std::fs::remove_dir_all(&dir).map_err(io("deleting", &dir))
        })
    }

    /// The files of volume `id` for a content request with `bearer`: checked before the volume is
    /// looked up, so a wrong token learns nothing.
    pub fn content(&self, id: &str, bearer: Option<&str>) -> Result<Content> {
        if !bearer.is_some_and(|b| keys::secret_eq(b, &self.token(id))) {
            return Err(VolumeError::Unauthorized);
        }
        if self.bucket.get().is_some() {
            if self.read(id).is_none() {
                self.learn(None, Some(id))?;
            }
            if self.read(id).is_some() && !self.dir.join(id).join("data").is_dir() {
                self.block(self.restore(id))?;
            }
            self.touch(id);
        }
        self.read(id)
            .ok_or_else(|| VolumeError::NotFound(id.into()))?;
        let data = self.dir.join(id).join("data");
        Ok(Content {
            root: beneath::Root::open(&data).map_err(io("opening", &data))?,
        })
    }
}

/// The files of one volume (its content API).
pub struct Content {
    root: beneath::Root,
}

/// `path` as components below the root (`/a//b/` is `a/b`); `..` is refused.
fn components(path: &str) -> Result<Vec<&str>> {
    let mut out = vec![];
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => return Err(VolumeError::BadPath(path.into())),
            c if c.contains('\0') => return Err(VolumeError::BadPath(path.into())),
            c => out.push(c),
        }
    }
    Ok(out)
}

impl Content {
    /// `path` checked: its components and normal form (`/a/b`).
    fn parts<'p>(&self, path: &'p str) -> Result<(Vec<&'p str>, String)> {
        let parts = components(path)?;
        let shown = display(&parts);
        Ok((parts, shown))
    }

    fn stat_at(&self, parts: &[&str], shown: &str) -> Result<EntryStat> {
        let st = self.root.stat(parts).map_err(|e| fail(e, shown, "stat"))?;
        let kind = match st.st_mode & libc::S_IFMT {
            libc::S_IFDIR => "directory",
            libc::S_IFREG => "file",
            libc::S_IFLNK => "symlink",
            _ => "unknown",
        };
        let name = shown.rsplit('/').next().unwrap_or_default();
        let ms = |s: i64, n: i64| s * 1000 + n / 1_000_000;
        Ok(EntryStat {
            name: if name.is_empty() {
                "/".into()
            } else {
                name.into()
            },
            kind,
            path: shown.into(),
            size: if kind == "directory" {
                0
            } else {
                st.st_size.max(0) as u64
            },
            mode: st.st_mode & 0o7777,
            uid: st.st_uid,
            gid: st.st_gid,
            atime_ms: ms(st.st_atime, st.st_atime_nsec),
            mtime_ms: ms(st.st_mtime, st.st_mtime_nsec),
            ctime_ms: ms(st.st_ctime, st.st_ctime_nsec),
        })
    }

    /// What `path` is.
    pub fn stat(&self, path: &str) -> Result<EntryStat> {
        let (parts, shown) = self.parts(path)?;
        self.stat_at(&parts, &shown)
    }

    /// The entries of folder `path`, `depth` levels down (at least 1).
    pub fn list(&self, path: &str, depth: u32) -> Result<Vec<EntryStat>> {
        let (parts, shown) = self.parts(path)?;
        if self.stat_at(&parts, &shown)?.kind != "directory" {
            return Err(VolumeError::NotADirectory(shown));
        }
        let mut out = vec![];
        self.walk(&parts, depth.max(1), &mut out)?;
        Ok(out)
    }

    fn walk(&self, parts: &[&str], depth: u32, out: &mut Vec<EntryStat>) -> Result<()> {
        let shown = display(parts);
        let names = self
            .root
            .list(parts)
            .map_err(|e| fail(e, &shown, "listing"))?;
        for (n, _) in names {
            let child: Vec<&str> = parts.iter().copied().chain([n.as_str()]).collect();
            let Ok(st) = self.stat_at(&child, &display(&child)) else {
                continue;
            };
            let dir = st.kind == "directory";
            out.push(st);
            if dir && depth > 1 {
                self.walk(&child, depth - 1, out)?;
            }
        }
        Ok(())
    }

    /// Makes folder `path` (its parents too with `force`; with `force` an existing folder is fine).
    pub fn mkdir(&self, path: &str, meta: Meta, force: bool) -> Result<EntryStat> {
        let (parts, shown) = self.parts(path)?;
        if parts.is_empty() {
            return Err(VolumeError::Exists("/".into()));
        }
        for i in 0..parts.len() {
            let last = i + 1 == parts.len();
            let (here, at) = (&parts[..=i], display(&parts[..=i]));
            match self.root.stat(here) {
                Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFDIR && (force || !last) => {}
                Ok(_) if !last => return Err(VolumeError::NotADirectory(at)),
                Ok(_) => return Err(VolumeError::Exists(at)),
                Err(_) if !last && !force => return Err(VolumeError::PathNotFound(at)),
                Err(_) => {
                    if self.root.usage(MAX_VOLUME_ENTRIES).1 >= MAX_VOLUME_ENTRIES {
                        return Err(VolumeError::TooManyEntries(MAX_VOLUME_ENTRIES));
                    }
                    let mode = meta.mode.unwrap_or(0o755);
                    self.root
                        .mkdir(here, mode)
                        .map_err(|e| fail(e, &at, "creating"))?;
                    self.chown(here, &at, meta)?;
                }
            }
        }
        self.stat_at(&parts, &shown)
    }

    fn chown(&self, parts: &[&str], shown: &str, meta: Meta) -> Result<()> {
        if meta.uid.is_some() || meta.gid.is_some() {
            self.root
                .chown(parts, meta.uid, meta.gid)
                .map_err(|e| fail(e, shown, "chown"))?;
        }
        Ok(())
    }

    /// Writes `bytes` to file `path` (its folder must exist); an existing file only with `force`.
    pub fn write(&self, path: &str, bytes: &[u8], meta: Meta, force: bool) -> Result<EntryStat> {
        let (parts, shown) = self.parts(path)?;
        let Some((_, up)) = parts.split_last() else {
            return Err(VolumeError::IsADirectory(shown));
        };
        let old = match self.root.stat(&parts) {
            Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFDIR => {
                return Err(VolumeError::IsADirectory(shown));
            }
            Ok(_) if !force => return Err(VolumeError::Exists(shown)),
            Ok(st) => st.st_size.max(0) as u64,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => 0,
            Err(e) => return Err(fail(e, &shown, "stat")),
        };
        match self.root.stat(up) {
            Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFDIR => {}
            Ok(_) => return Err(VolumeError::NotADirectory(display(up))),
            Err(_) => return Err(VolumeError::PathNotFound(shown)),
        }
        let (used, entries) = self.root.usage(MAX_VOLUME_ENTRIES);
        if entries >= MAX_VOLUME_ENTRIES {
            return Err(VolumeError::TooManyEntries(MAX_VOLUME_ENTRIES));
        }
        if used.saturating_sub(old) + bytes.len() as u64 > MAX_VOLUME_BYTES {
            return Err(VolumeError::Full(MAX_VOLUME_BYTES));
        }
        let tmp_name = format!(".k3-upload-{:016x}", rand::random::<u64>());
        let tmp: Vec<&str> = up.iter().copied().chain([tmp_name.as_str()]).collect();
        let written = (|| {
            let mut f = self.root.create(&tmp, meta.mode.unwrap_or(0o644), true)?;
            f.write_all(bytes)?;
            f.sync_all()
        })();
        if let Err(e) = written {
            let _ = self.root.remove(&tmp, false);
            return Err(fail(e, &shown, "writing"));
        }
        self.chown(&tmp, &shown, meta)?;
        self.root
            .rename(&tmp, &parts, false)
            .map_err(|e| fail(e, &shown, "writing"))?;
        self.stat_at(&parts, &shown)
    }

    /// The contents of file `path`.
    pub fn read(&self, path: &str) -> Result<std::fs::File> {
        let (parts, shown) = self.parts(path)?;
        self.root
            .open_file(&parts, false)
            .map_err(|_| VolumeError::PathNotFound(shown))
    }

    /// Deletes `path` (a folder with all it holds).
    pub fn remove(&self, path: &str) -> Result<()> {
        let (parts, shown) = self.parts(path)?;
        if parts.is_empty() {
            return Err(VolumeError::BadPath(path.into()));
        }
        self.root
            .stat(&parts)
            .map_err(|e| fail(e, &shown, "stat"))?;
        self.remove_at(&parts)
            .map_err(|e| fail(e, &shown, "deleting"))
    }

    /// Removes `parts`, depth first, never leaving the volume.
    fn remove_at(&self, parts: &[&str]) -> std::io::Result<()> {
        let st = self.root.stat(parts)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
            return self.root.remove(parts, false);
        }
        for (n, _) in self.root.list(parts)? {
            let child: Vec<&str> = parts.iter().copied().chain([n.as_str()]).collect();
            self.remove_at(&child)?;
        }
        self.root.remove(parts, true)
    }

    /// Changes the owner or permissions of `path`.
    pub fn set_meta(&self, path: &str, meta: Meta) -> Result<EntryStat> {
        let (parts, shown) = self.parts(path)?;
        let st = self
            .root
            .stat(&parts)
            .map_err(|e| fail(e, &shown, "stat"))?;
        if st.st_mode & libc::S_IFMT == libc::S_IFLNK {
            // chmod(2) would change what it points to.
            return Err(VolumeError::BadPath(shown));
        }
        self.root
            .chmod(&parts, meta.mode.unwrap_or(st.st_mode & 0o777))
            .map_err(|e| fail(e, &shown, "chmod"))?;
        self.chown(&parts, &shown, meta)?;
        self.stat_at(&parts, &shown)
    }
}

/// A confined operation's failure on `shown`, as the content API names it.
fn fail(e: std::io::Error, shown: &str, what: &'static str) -> VolumeError {
    match e.raw_os_error() {
        Some(libc::ENOENT) => VolumeError::PathNotFound(shown.into()),
        // A symlink on the way is refused as a non-folder.
        Some(libc::ENOTDIR | libc::ELOOP | libc::EXDEV) => VolumeError::NotADirectory(shown.into()),
        Some(libc::EISDIR) => VolumeError::IsADirectory(shown.into()),
        Some(libc::EEXIST) => VolumeError::Exists(shown.into()),
        _ => VolumeError::Io {
            what,
            path: shown.into(),
            source: e,
        },
    }
}

fn display(parts: &[&str]) -> String {
    format!("/{}", parts.join("/"))
}
