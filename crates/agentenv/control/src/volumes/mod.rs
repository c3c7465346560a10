//! Volumes (E2B's `/volumes` and its volume content API): named folders of files that belong to one
//! tenant and outlive sandboxes, kept on this node's disk under `<state>/volumes/<id>/` (`volume.json`,
//! the files under `data/`).
//!
//! The content API authenticates with a volume's token (`Authorization: Bearer`), an HMAC of its id
//! under a key derived from the server's, so it needs no storage and proves nothing else. Paths are
//! resolved lexically below `data/` (`..` refused) and never through a symlink. Limits: a tenant holds
//! at most [`MAX_VOLUMES`] volumes of at most [`MAX_VOLUME_BYTES`] each.

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use serde::{Deserialize, Serialize};

use crate::keys;

mod beneath;
pub mod channel;
#[cfg(test)]
mod channel_tests;
#[cfg(test)]
mod tests;

/// Volumes one tenant may hold.
pub const MAX_VOLUMES: usize = 16;
/// Bytes of files one volume may hold.
pub const MAX_VOLUME_BYTES: u64 = 2 << 30;

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
        let ok = (1..=64).contains(&name.len())
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !ok {
            return Err(VolumeError::BadName(name.into()));
        }
        let _held = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let mine: Vec<Volume> = self
            .all()
            .into_iter()
            .filter(|v| v.owner == owner)
            .collect();
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
        let dir = self.dir.join(&id);
        let data = dir.join("data");
        std::fs::create_dir_all(&data).map_err(io("creating", &data))?;
        let meta = serde_json::to_vec(&vol).expect("a volume serializes");
        k3_common::fsutil::write_atomic(&dir.join("volume.json"), &meta)
            .map_err(io("writing", &dir))?;
        let token = self.token(&id);
        Ok((vol, token))
    }

    /// `owner`'s volumes, by name.
    pub fn list(&self, owner: &str) -> Vec<Volume> {
        self.all()
            .into_iter()
            .filter(|v| v.owner == owner)
            .collect()
    }

    /// `owner`'s volume `id` and its token; another tenant's is not found.
    pub fn get(&self, owner: &str, id: &str) -> Result<(Volume, String)> {
        let vol = self
            .read(id)
            .filter(|v| v.owner == owner)
            .ok_or_else(|| VolumeError::NotFound(id.into()))?;
        Ok((vol, self.token(id)))
    }

    /// `owner`'s volume named `name`.
    pub fn by_name(&self, owner: &str, name: &str) -> Result<Volume> {
        self.all()
            .into_iter()
            .find(|v| v.owner == owner && v.name == name)
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
        // The record first: a crash midway leaves files no volume lists, removed below next time.
        let meta = dir.join("volume.json");
        std::fs::remove_file(&meta).map_err(io("deleting", &meta))?;
        std::fs::remove_dir_all(&dir).map_err(io("deleting", &dir))
    }

    /// The files of volume `id` for a content request with `bearer`: checked before the volume is
    /// looked up, so a wrong token learns nothing.
    pub fn content(&self, id: &str, bearer: Option<&str>) -> Result<Content> {
        if !bearer.is_some_and(|b| keys::secret_eq(b, &self.token(id))) {
            return Err(VolumeError::Unauthorized);
        }
        self.read(id)
            .ok_or_else(|| VolumeError::NotFound(id.into()))?;
        Ok(Content {
            root: self.dir.join(id).join("data"),
        })
    }
}

/// The files of one volume (its content API).
pub struct Content {
    root: PathBuf,
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
    /// The host path of `path`, whose parents all are real folders (no symlinks); `display` is its
    /// normal form (`/a/b`).
    fn resolve(&self, path: &str) -> Result<(PathBuf, String)> {
        let parts = components(path)?;
        let mut host = self.root.clone();
        for (i, c) in parts.iter().enumerate() {
            host.push(c);
            if i + 1 < parts.len() {
                match std::fs::symlink_metadata(&host) {
                    Ok(m) if m.is_dir() => {}
                    Ok(_) => return Err(VolumeError::NotADirectory(display(&parts[..=i]))),
                    Err(_) => return Err(VolumeError::PathNotFound(display(&parts[..=i]))),
                }
            }
        }
        Ok((host, display(&parts)))
    }

    fn stat_of(&self, host: &Path, shown: &str) -> Result<EntryStat> {
        let m =
            std::fs::symlink_metadata(host).map_err(|_| VolumeError::PathNotFound(shown.into()))?;
        let kind = if m.is_dir() {
            "directory"
        } else if m.is_file() {
            "file"
        } else if m.file_type().is_symlink() {
            "symlink"
        } else {
            "unknown"
        };
        let name = shown.rsplit('/').next().unwrap_or_default();
        Ok(EntryStat {
            name: if name.is_empty() {
                "/".into()
            } else {
                name.into()
            },
            kind,
            path: shown.into(),
            size: if m.is_dir() { 0 } else { m.len() },
            mode: m.mode() & 0o7777,
            uid: m.uid(),
            gid: m.gid(),
            atime_ms: m.atime() * 1000 + m.atime_nsec() / 1_000_000,
            mtime_ms: m.mtime() * 1000 + m.mtime_nsec() / 1_000_000,
            ctime_ms: m.ctime() * 1000 + m.ctime_nsec() / 1_000_000,
        })
    }

    /// What `path` is.
    pub fn stat(&self, path: &str) -> Result<EntryStat> {
        let (host, shown) = self.resolve(path)?;
        self.stat_of(&host, &shown)
    }

    /// The entries of folder `path`, `depth` levels down (at least 1).
    pub fn list(&self, path: &str, depth: u32) -> Result<Vec<EntryStat>> {
        let (host, shown) = self.resolve(path)?;
        if !self.stat_of(&host, &shown)?.kind.eq("directory") {
            return Err(VolumeError::NotADirectory(shown));
        }
        let mut out = vec![];
        self.walk(&host, &shown, depth.max(1), &mut out)?;
        Ok(out)
    }

    fn walk(&self, host: &Path, shown: &str, depth: u32, out: &mut Vec<EntryStat>) -> Result<()> {
        let mut names: Vec<String> = std::fs::read_dir(host)
            .map_err(io("listing", host))?
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        names.sort();
        for n in names {
            let (h, s) = (
                host.join(&n),
                format!("{}/{n}", shown.trim_end_matches('/')),
            );
            let st = self.stat_of(&h, &s)?;
            let dir = st.kind == "directory";
            out.push(st);
            if dir && depth > 1 {
                self.walk(&h, &s, depth - 1, out)?;
            }
        }
        Ok(())
    }

    /// Makes folder `path` (its parents too with `force`; with `force` an existing folder is fine).
    pub fn mkdir(&self, path: &str, meta: Meta, force: bool) -> Result<EntryStat> {
        let parts = components(path)?;
        if parts.is_empty() {
            return Err(VolumeError::Exists("/".into()));
        }
        for i in 0..parts.len() {
            let last = i + 1 == parts.len();
            let (host, shown) = self.resolve(&display(&parts[..=i]))?;
            match std::fs::symlink_metadata(&host) {
                Ok(m) if m.is_dir() && (force || !last) => continue,
                Ok(_) if !last || !force => {
                    return Err(if last {
                        VolumeError::Exists(shown)
                    } else {
                        VolumeError::NotADirectory(shown)
                    });
                }
                Ok(_) => return Err(VolumeError::Exists(shown)),
                Err(_) if !last && !force => return Err(VolumeError::PathNotFound(shown)),
                Err(_) => {
                    std::fs::create_dir(&host).map_err(io("creating", &host))?;
                    apply(&host, meta, 0o755)?;
                }
            }
        }
        self.stat(path)
    }

    /// Writes `bytes` to file `path` (its folder must exist); an existing file only with `force`.
    pub fn write(&self, path: &str, bytes: &[u8], meta: Meta, force: bool) -> Result<EntryStat> {
        let (host, shown) = self.resolve(path)?;
        if shown == "/" {
            return Err(VolumeError::IsADirectory(shown));
        }
        match std::fs::symlink_metadata(&host) {
            Ok(m) if m.is_dir() => return Err(VolumeError::IsADirectory(shown)),
            Ok(_) if !force => return Err(VolumeError::Exists(shown)),
            _ => {}
        }
        let parent = host.parent().unwrap_or(&self.root);
        if !std::fs::symlink_metadata(parent).is_ok_and(|m| m.is_dir()) {
            return Err(VolumeError::PathNotFound(shown));
        }
        let old = std::fs::symlink_metadata(&host).map_or(0, |m| m.len());
        if used(&self.root) - old + bytes.len() as u64 > MAX_VOLUME_BYTES {
            return Err(VolumeError::Full(MAX_VOLUME_BYTES));
        }
        let tmp = parent.join(format!(".k3-upload-{:016x}", rand::random::<u64>()));
        let written = (|| {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .custom_flags(libc::O_NOFOLLOW)
                .mode(0o644)
                .open(&tmp)?;
            f.write_all(bytes)?;
            f.sync_all()
        })();
        if let Err(e) = written.map_err(io("writing", &tmp)) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        apply(&tmp, meta, 0o644)?;
        std::fs::rename(&tmp, &host).map_err(io("writing", &host))?;
        self.stat_of(&host, &shown)
    }

    /// The contents of file `path`.
    pub fn read(&self, path: &str) -> Result<std::fs::File> {
        let (host, shown) = self.resolve(path)?;
        match std::fs::symlink_metadata(&host) {
            Ok(m) if m.is_file() => {}
            _ => return Err(VolumeError::PathNotFound(shown)),
        }
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&host)
            .map_err(|_| VolumeError::PathNotFound(shown))
    }

    /// Deletes `path` (a folder with all it holds).
    pub fn remove(&self, path: &str) -> Result<()> {
        let (host, shown) = self.resolve(path)?;
        if shown == "/" {
            return Err(VolumeError::BadPath(path.into()));
        }
        match std::fs::symlink_metadata(&host) {
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(&host),
            Ok(_) => std::fs::remove_file(&host),
            Err(_) => return Err(VolumeError::PathNotFound(shown)),
        }
        .map_err(io("deleting", &host))
    }

    /// Changes the owner or permissions of `path`.
    pub fn set_meta(&self, path: &str, meta: Meta) -> Result<EntryStat> {
        let (host, shown) = self.resolve(path)?;
        let m = std::fs::symlink_metadata(&host)
            .map_err(|_| VolumeError::PathNotFound(shown.clone()))?;
        if m.file_type().is_symlink() {
            // chmod(2) would change what it points to.
            return Err(VolumeError::BadPath(shown));
        }
        apply(&host, meta, m.mode() & 0o777)?;
        self.stat_of(&host, &shown)
    }
}

fn display(parts: &[&str]) -> String {
    format!("/{}", parts.join("/"))
}

/// Sets the owner and permission bits `meta` asks for (else `default_mode`).
fn apply(host: &Path, meta: Meta, default_mode: u32) -> Result<()> {
    let mode = meta.mode.unwrap_or(default_mode) & 0o777;
    std::fs::set_permissions(host, std::fs::Permissions::from_mode(mode))
        .map_err(io("chmod", host))?;
    if meta.uid.is_some() || meta.gid.is_some() {
        std::os::unix::fs::lchown(host, meta.uid, meta.gid).map_err(io("chown", host))?;
    }
    Ok(())
}

/// Bytes of the files under `root`.
fn used(root: &Path) -> u64 {
    let mut total = 0;
    let mut dirs = vec![root.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => dirs.push(e.path()),
                Ok(m) => total += m.len(),
                Err(_) => {}
            }
        }
    }
    total
}
