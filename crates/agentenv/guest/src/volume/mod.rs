//! Volume mounts (the guest side of `agentenv_envd::volume`): a FUSE file system at a guest path
//! whose every operation is a request to the host on the mount's current channel.
//!
//! The host attaches with `POST /volume`; [`prepare`] checks the path and mounts it (once), then
//! [`Mount::install`] makes the upgraded stream the mount's channel. All per-mount state (node ids
//! and their paths) lives here, in the agent's memory, so it survives a pause/restore; the channel
//! does not, and the host's next attach replaces it. A FUSE thread per mount reads `/dev/fuse`
//! (blocking, one request at a time); waiting for a channel or an answer has a deadline
//! ([`ops::OP_DEADLINE`]), past which the operation fails with `EIO`.
//!
//! Not supported: hard links (`EPERM`), devices and FIFOs (`EPERM`), extended attributes,
//! `RENAME_EXCHANGE`, and reading a file after it was unlinked (the host's paths are the only
//! handles).

pub mod fuse;
pub mod link;
pub mod listing;
pub mod nodes;
pub mod ops;

#[cfg(test)]
mod ops_tests;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tokio::io::{AsyncRead, AsyncWrite};

use link::Link;

/// File system type and source of our mounts (as `/proc/self/mountinfo` shows them).
pub const FS_TYPE: &str = "fuse.agentenv";
const SOURCE: &str = "agentenv-volume";
/// Paths no volume may cover (the agent's own state and the kernel's file systems).
const FORBIDDEN: [&str; 3] = ["/proc", "/sys", "/dev"];
const AGENT_RUN: &str = "/run/agentenv";

/// Why a volume could not be mounted.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("bad mount path {path:?}: {why}")]
    BadPath { path: String, why: String },
    #[error("/dev/fuse cannot be opened: {0}")]
    NoFuse(std::io::Error),
    #[error("creating the mount point {path}: {source}")]
    MountPoint {
        path: String,
        source: std::io::Error,
    },
    #[error("mounting a volume at {path} failed: {source}")]
    Mount {
        path: String,
        source: std::io::Error,
    },
    #[error("starting the FUSE thread for {path}: {source}")]
    Thread {
        path: String,
        source: std::io::Error,
    },
    #[error("volume mount task failed: {0}")]
    Task(String),
}

impl VolumeError {
    /// The caller's fault (a 4xx), not the guest's.
    pub fn is_bad_path(&self) -> bool {
        matches!(self, VolumeError::BadPath { .. })
    }
}

/// One volume mount of this process.
pub struct Mount {
    path: PathBuf,
    link: Arc<Link>,
    /// Cleared when the FUSE thread ends (the mount went away).
    alive: Arc<AtomicBool>,
}

impl Mount {
    /// Makes `io` the mount's channel, replacing an older one. Needs a tokio runtime.
    pub fn install<IO>(&self, io: IO)
    where
        IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        self.link.install(io);
        tracing::info!(mount = %self.path.display(), "volume channel attached");
    }

    /// Whether a channel is installed now.
    pub fn attached(&self) -> bool {
        self.link.attached()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn registry() -> &'static Mutex<HashMap<PathBuf, Arc<Mount>>> {
    static MOUNTS: OnceLock<Mutex<HashMap<PathBuf, Arc<Mount>>>> = OnceLock::new();
    MOUNTS.get_or_init(Default::default)
}

fn bad(path: &Path, why: impl Into<String>) -> VolumeError {
    VolumeError::BadPath {
        path: path.display().to_string(),
        why: why.into(),
    }
}

/// Checks a mount path: absolute, normalised, UTF-8, not `/`, not over or under the kernel's file
/// systems or the agent's `/run/agentenv*`.
pub fn check_path(path: &Path) -> Result<&str, VolumeError> {
    let s = path.to_str().ok_or_else(|| bad(path, "not UTF-8"))?;
    if !s.starts_with('/') || s == "/" {
        return Err(bad(path, "must be an absolute path other than /"));
    }
    if s.len() > agentenv_envd::volume::MAX_PATH || s.contains('\0') {
        return Err(bad(path, "too long or holds a NUL"));
    }
    if s[1..]
        .split('/')
        .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err(bad(
            path,
            "must be normalised (no '.', '..', '//' or trailing '/')",
        ));
    }
    let covers = |base: &str| nodes::is_under(s, base) || nodes::is_under(base, s);
    if let Some(f) = FORBIDDEN.iter().find(|f| covers(f)) {
        return Err(bad(path, format!("overlaps {f}")));
    }
    if s.starts_with(AGENT_RUN) || covers(AGENT_RUN) {
        return Err(bad(path, format!("overlaps {AGENT_RUN}")));
    }
    Ok(s)
}

/// Checks `mount` and mounts a volume there unless one of ours already is: the first half of an
/// attach, done before answering `101` so a failure can still be an HTTP error.
pub async fn prepare(mount: &Path) -> Result<Arc<Mount>, VolumeError> {
    let mount = mount.to_path_buf();
    tokio::task::spawn_blocking(move || prepare_blocking(&mount))
        .await
        .map_err(|e| VolumeError::Task(e.to_string()))?
}

/// Mounts a volume at `mount` if needed and makes `io` its channel (replacing an older one).
pub async fn attach(
    mount: &Path,
    io: impl AsyncRead + AsyncWrite + Send + Unpin + 'static,
) -> Result<(), VolumeError> {
    prepare(mount).await?.install(io);
    Ok(())
}

fn prepare_blocking(mount: &Path) -> Result<Arc<Mount>, VolumeError> {
    let s = check_path(mount)?;
    let mut mounts = registry().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(m) = mounts.get(mount) {
        if m.alive.load(Ordering::SeqCst) {
            // Ours and served: the mount point is not touched (that would wait for a channel).
            return Ok(m.clone());
        }
        mounts.remove(mount);
    }
    mounts.retain(|_, m| m.alive.load(Ordering::SeqCst));
    if let Some(other) = mounts.keys().find(|p| {
        let p = p.to_str().unwrap_or("/");
        nodes::is_under(s, p) || nodes::is_under(p, s)
    }) {
        return Err(bad(
            mount,
            format!("overlaps the volume at {}", other.display()),
        ));
    }
    // One of ours left by an earlier agent (its FUSE file is gone): take it away first.
    if mountinfo()
        .iter()
        .any(|m| m.point == s && m.fstype == FS_TYPE)
    {
        tracing::info!(mount = s, "detaching a stale volume mount");
        let _ = umount_detach(mount);
    }
    std::fs::create_dir_all(mount).map_err(|source| VolumeError::MountPoint {
        path: s.into(),
        source,
    })?;
    match std::fs::canonicalize(mount) {
        Ok(c) if c == mount => {}
        Ok(c) => return Err(bad(mount, format!("resolves to {}", c.display()))),
        Err(source) => {
            return Err(VolumeError::MountPoint {
                path: s.into(),
                source,
            });
        }
    }
    let m = Arc::new(mount_fuse(mount, s)?);
    mounts.insert(mount.to_path_buf(), m.clone());
    tracing::info!(mount = s, "volume mounted");
    Ok(m)
}

/// Opens `/dev/fuse`, mounts it at `mount` and starts the FUSE thread.
fn mount_fuse(mount: &Path, s: &str) -> Result<Mount, VolumeError> {
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .map_err(VolumeError::NoFuse)?;
    let opts = format!(
        "fd={},rootmode=40000,user_id=0,group_id=0,default_permissions,allow_other",
        dev.as_raw_fd()
    );
    let failed = |source| VolumeError::Mount {
        path: s.into(),
        source,
    };
    let cstr = |v: &[u8]| CString::new(v).map_err(|e| failed(std::io::Error::other(e)));
    let (src, target, fstype, opts) = (
        cstr(SOURCE.as_bytes())?,
        cstr(mount.as_os_str().as_bytes())?,
        cstr(FS_TYPE.as_bytes())?,
        cstr(opts.as_bytes())?,
    );
    // SAFETY: every pointer is a live NUL-terminated string.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            opts.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(failed(std::io::Error::last_os_error()));
    }
    let link = Arc::new(Link::default());
    let alive = Arc::new(AtomicBool::new(true));
    let (thread_link, thread_alive) = (link.clone(), alive.clone());
    let name = s.to_string();
    let spawned = std::thread::Builder::new()
        .name("volume-fuse".into())
        .spawn(move || {
            let mut fs = ops::Fs::new(thread_link.clone());
            fuse::serve_device(dev, |msg| fs.handle(msg));
            thread_alive.store(false, Ordering::SeqCst);
            thread_link.close();
            tracing::info!(mount = name, "volume FUSE loop ended");
        });
    if let Err(source) = spawned {
        let _ = umount_detach(mount);
        return Err(VolumeError::Thread {
            path: s.into(),
            source,
        });
    }
    Ok(Mount {
        path: mount.to_path_buf(),
        link,
        alive,
    })
}

/// Unmounts our volume at `mount` (lazily, `MNT_DETACH`), aborts its FUSE connection so its
/// thread ends, and fails its waiting requests. False when no mount of ours is there.
pub fn unmount(mount: &Path) -> bool {
    let Some(m) = registry()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(mount)
    else {
        return false;
    };
    m.link.close();
    let s = mount.to_str().unwrap_or_default();
    let conn = mountinfo()
        .into_iter()
        .rev()
        .find(|i| i.point == s && i.fstype == FS_TYPE)
        .and_then(|i| i.dev.split_once(':').map(|(_, minor)| minor.to_string()));
    if let Err(e) = umount_detach(mount) {
        tracing::warn!(mount = s, error = %e, "unmounting a volume failed");
    }
    if let Some(minor) = conn {
        // Ends the FUSE thread even while files stay open (needs fusectl; else they end it).
        let _ = std::fs::write(format!("/sys/fs/fuse/connections/{minor}/abort"), "1");
    }
    true
}

fn umount_detach(mount: &Path) -> std::io::Result<()> {
    let target = CString::new(mount.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: a live NUL-terminated path.
    if unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// One line of `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountInfo {
    /// `major:minor` of the file system.
    pub dev: String,
    pub point: String,
    pub fstype: String,
}

fn mountinfo() -> Vec<MountInfo> {
    parse_mountinfo(&std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default())
}

/// Parses mountinfo text (mount points unescaped: `\040` is a space).
pub fn parse_mountinfo(text: &str) -> Vec<MountInfo> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let sep = f.iter().position(|x| *x == "-")?;
            Some(MountInfo {
                dev: f.get(2)?.to_string(),
                point: unescape(f.get(4)?),
                fstype: f.get(sep + 1)?.to_string(),
            })
        })
        .collect()
}

fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let oct = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], oct) {
            (b'\\', Some(d)) => {
                let v = d.iter().fold(0u32, |a, c| a * 8 + u32::from(c - b'0'));
                out.push(v as u8);
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
