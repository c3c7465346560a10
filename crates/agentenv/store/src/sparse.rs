//! Sparse files: where the data is (`SEEK_DATA`/`SEEK_HOLE`), and temp files that never show half-written.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// `(start, end)` byte ranges of `f` that may hold data; holes are left out. Filesystems without
/// `SEEK_DATA` report the whole file.
pub fn data_ranges(f: &std::fs::File, len: u64) -> std::io::Result<Vec<(u64, u64)>> {
    let fd = f.as_raw_fd();
    let mut out = Vec::new();
    let mut pos: i64 = 0;
    while (pos as u64) < len {
        // SAFETY: lseek on an fd the caller owns.
        let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::ENXIO) => break,
                Some(libc::EINVAL) if pos == 0 => return Ok(vec![(0, len)]),
                _ => return Err(e),
            }
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let end = (hole as u64).min(len);
        if end > data as u64 {
            out.push((data as u64, end));
        }
        pos = hole;
    }
    Ok(out)
}

/// Chunk indices (of `chunk_size`) that overlap any of `ranges`, ascending, each once.
pub(crate) fn chunk_indices(ranges: &[(u64, u64)], chunk_size: u64) -> Vec<u64> {
    let mut out: Vec<u64> = Vec::new();
    for &(s, e) in ranges {
        let first = s / chunk_size;
        let last = (e - 1) / chunk_size;
        let from = match out.last() {
            Some(&l) if l >= first => l + 1,
            _ => first,
        };
        out.extend(from..=last);
    }
    out
}

/// A temp file beside `dest` (`.<name>.tmp.<pid>.<seq>`), removed on drop unless renamed into place.
pub(crate) struct TempBeside {
    pub(crate) path: PathBuf,
    armed: bool,
}

impl TempBeside {
    pub(crate) fn new(dest: &Path) -> TempBeside {
        use std::sync::atomic::{AtomicU64, Ordering};
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let dir = dest.parent().unwrap_or(Path::new("."));
        let name = dest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        remove_dead_temps(dir, &name);
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        TempBeside {
            path: dir.join(format!(".{name}.tmp.{}.{seq}", std::process::id())),
            armed: true,
        }
    }

    /// fsync, rename over `dest`, fsync the folder.
    pub(crate) fn commit(self, f: &std::fs::File, dest: &Path) -> std::io::Result<()> {
        f.sync_all()?;
        self.commit_unflushed(dest)?;
        if let Ok(d) = std::fs::File::open(dest.parent().unwrap_or(Path::new("."))) {
            let _ = d.sync_all();
        }
        Ok(())
    }

    /// Rename over `dest` only: whole after a crash of the process, maybe torn after one of the host.
    pub(crate) fn commit_unflushed(mut self, dest: &Path) -> std::io::Result<()> {
        std::fs::rename(&self.path, dest)?;
        self.armed = false;
        Ok(())
    }
}

impl Drop for TempBeside {
    fn drop(&mut self) {
        if self.armed {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Removes `.<name>.tmp.<pid>.*` files whose process is gone (left by a kill -9).
fn remove_dead_temps(dir: &Path, name: &str) {
    let head = format!(".{name}.tmp.");
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = n.strip_prefix(&head) else {
            continue;
        };
        let pid = rest.split('.').next().and_then(|p| p.parse::<u32>().ok());
        if let Some(pid) = pid
            && pid != std::process::id()
            && !Path::new(&format!("/proc/{pid}")).exists()
        {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_indices_merge_overlaps() {
        let r = [(10, 20), (30, 70000), (70001, 70002), (200_000, 262_144)];
        assert_eq!(chunk_indices(&r, 65536), vec![0, 1, 3]);
        assert_eq!(chunk_indices(&[], 65536), Vec::<u64>::new());
    }

    #[test]
    fn data_ranges_skip_holes() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(64 << 20).unwrap();
        let at = rand::random_range(1u64..60) << 20;
        f.write_all_at(&[7u8; 5000], at).unwrap();
        let r = data_ranges(&f, 64 << 20).unwrap();
        let covered: u64 = r.iter().map(|(s, e)| e - s).sum();
        assert!(r.iter().any(|&(s, e)| s <= at && e >= at + 5000), "{r:?}");
        assert!(covered < 4 << 20, "holes reported as data: {r:?}");
    }
}
