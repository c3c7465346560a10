//! Small filesystem helpers shared by every crate.

use std::io::Write;
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` atomically: a temp file in the same folder, fsync, rename.
/// A crash leaves either the old file or the new one, never a torn one. The file is mode 0600, and
/// folders it creates are 0700: state files hold tokens and environment variables.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    create_private_dir(dir)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // Unique per process and call: threads of one process may write the same file at once.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.tmp.{}.{seq}", std::process::id()));
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    let _ = sync_dir(dir);
    Ok(())
}

/// `name` in the first folder of `PATH` that has it as a file.
pub fn which(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// fsyncs folder `dir`, so renames and creations in it survive a crash.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// `create_dir_all` with mode 0700 for every folder it creates (existing ones are left as they are).
pub fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// An exclusive `flock` on a file (created if missing), held until dropped: the one host-wide lock
/// of the workspace (template builds, network slots, test networks).
#[derive(Debug)]
pub struct FileLock {
    _file: std::fs::File,
}

impl FileLock {
    /// Waits for the lock.
    pub fn lock(path: &Path) -> std::io::Result<FileLock> {
        Self::flock(path, libc::LOCK_EX)?.ok_or_else(std::io::Error::last_os_error)
    }

    /// The lock if nobody holds it now (`None` when another holder has it).
    pub fn try_lock(path: &Path) -> std::io::Result<Option<FileLock>> {
        Self::flock(path, libc::LOCK_EX | libc::LOCK_NB)
    }

    fn flock(path: &Path, op: libc::c_int) -> std::io::Result<Option<FileLock>> {
        use std::os::fd::AsRawFd;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)?;
        // SAFETY: flock on a file this function owns; released when it closes.
        let ok = unsafe { libc::flock(file.as_raw_fd(), op) } == 0;
        Ok(ok.then_some(FileLock { _file: file }))
    }
}

/// The cache folder for downloaded or built artefacts (guest kernels, rootfs, toolchains):
/// `$K3_CACHE_DIR`, else `$XDG_CACHE_HOME/k3-stack`, else `~/.cache/k3-stack`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("K3_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("k3-stack");
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/tmp"), PathBuf::from);
    home.join(".cache").join("k3-stack")
}

#[cfg(test)]
mod tests {
    #[test]
    fn concurrent_writers_of_one_file_never_fail() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("same.txt");
        std::thread::scope(|s| {
            for t in 0..8u8 {
                let p = &p;
                s.spawn(move || {
                    for _ in 0..50 {
                        super::write_atomic(p, &[t; 64]).unwrap();
                    }
                });
            }
        });
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(bytes.len(), 64);
        assert!(bytes.iter().all(|&b| b == bytes[0]), "a torn file");
    }

    #[test]
    fn atomic_write_replaces_whole_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub").join("f.txt");
        super::write_atomic(&p, b"first version, longer").unwrap();
        super::write_atomic(&p, b"second").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"second");
        let leftovers: Vec<_> = std::fs::read_dir(p.parent().unwrap()).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temp files left behind");
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&p), 0o600);
        assert_eq!(mode(p.parent().unwrap()), 0o700);
    }
}
