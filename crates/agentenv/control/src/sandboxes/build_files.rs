//! Uploaded COPY archives, `<dir>/<template>/<hash>`: a cache the SDK refills (it asks
//! `GET .../files/{hash}` before it uploads), so it is bounded. Each tenant keeps at most
//! [`PER_TENANT_BYTES`] (its least recently used archives go first), an archive unused for
//! [`MAX_AGE`] goes, and uploads past [`TOTAL_BYTES`] on the server are refused. Build entries live in
//! memory, so the folder starts empty with the process.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use super::{LifecycleError, Result, internal};

/// COPY archives one tenant keeps.
pub const PER_TENANT_BYTES: u64 = 2 << 30;
/// COPY archives the server keeps.
pub const TOTAL_BYTES: u64 = 16 << 30;
/// An archive not asked for or used this long goes.
pub const MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);

pub(super) struct BuildFiles {
    dir: PathBuf,
    per_tenant: u64,
    total: u64,
    max_age: Duration,
    /// Uploads one at a time (the bounds are checked and kept under it).
    puts: Mutex<()>,
}

struct Stored {
    template: String,
    path: PathBuf,
    len: u64,
    used: SystemTime,
}

impl BuildFiles {
    /// The archives under `dir` with the default bounds; what an earlier process left is removed.
    pub(super) fn open(dir: PathBuf) -> BuildFiles {
        Self::with_bounds(dir, PER_TENANT_BYTES, TOTAL_BYTES, MAX_AGE)
    }

    fn with_bounds(dir: PathBuf, per_tenant: u64, total: u64, max_age: Duration) -> BuildFiles {
        let _ = std::fs::remove_dir_all(&dir);
        BuildFiles {
            dir,
            per_tenant,
            total,
            max_age,
            puts: Mutex::new(()),
        }
    }

    pub(super) fn path(&self, template: &str, hash: &str) -> PathBuf {
        self.dir.join(template).join(hash)
    }

    /// Whether the archive is here; asking counts as a use (it is kept longest).
    pub(super) fn present(&self, template: &str, hash: &str) -> bool {
        let p = self.path(template, hash);
        let here = p.is_file();
        if here {
            touch(&p);
        }
        here
    }

    /// Stores `data` as archive `hash` of `template`. `owned` tells the uploader's templates: its
    /// least recently used archives make room; others' are never touched (except past their age).
    pub(super) fn put(
        &self,
        template: &str,
        hash: &str,
        data: &[u8],
        owned: impl Fn(&str) -> bool,
    ) -> Result<()> {
        let _one = self.puts.lock().unwrap_or_else(|e| e.into_inner());
        let target = self.path(template, hash);
        let len = data.len() as u64;
        let refused = || {
            LifecycleError::QuotaExceeded(format!(
                "COPY archives: {} bytes per key and {} on the server are kept",
                self.per_tenant, self.total
            ))
        };
        if len > self.per_tenant {
            return Err(refused());
        }
        let now = SystemTime::now();
        let mut all: Vec<Stored> = Vec::new();
        for f in self.list() {
            let old = now.duration_since(f.used).unwrap_or_default() > self.max_age;
            if old || f.path == target {
                let _ = std::fs::remove_file(&f.path);
            } else {
                all.push(f);
            }
        }
        all.sort_by_key(|f| f.used);
        let mut mine: u64 = all
            .iter()
            .filter(|f| owned(&f.template))
            .map(|f| f.len)
            .sum();
        let mut total: u64 = all.iter().map(|f| f.len).sum();
        for f in all.iter().filter(|f| owned(&f.template)) {
            if mine + len <= self.per_tenant {
                break;
            }
            if std::fs::remove_file(&f.path).is_ok() {
                (mine, total) = (mine - f.len, total - f.len);
            }
        }
        if mine + len > self.per_tenant || total + len > self.total {
            return Err(refused());
        }
        if let Some(d) = target.parent() {
            k3_common::fsutil::create_private_dir(d).map_err(internal)?;
        }
        k3_common::fsutil::write_atomic(&target, data).map_err(internal)
    }

    /// Every stored archive.
    fn list(&self) -> Vec<Stored> {
        let mut out = Vec::new();
        for t in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            let template = t.file_name().to_string_lossy().into_owned();
            for f in std::fs::read_dir(t.path()).into_iter().flatten().flatten() {
                if let Ok(m) = f.metadata()
                    && m.is_file()
                {
                    out.push(Stored {
                        template: template.clone(),
                        path: f.path(),
                        len: m.len(),
                        used: m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                    });
                }
            }
        }
        out
    }
}

fn touch(p: &Path) {
    if let Ok(f) = std::fs::File::options().append(true).open(p) {
        let _ = f.set_modified(SystemTime::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn aged(p: &Path, secs_ago: u64) {
        let f = std::fs::File::options().append(true).open(p).unwrap();
        f.set_modified(SystemTime::now() - Duration::from_secs(secs_ago))
            .unwrap();
    }

    #[test]
    fn a_tenants_oldest_archives_make_room_and_others_are_left_alone() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("files");
        std::fs::create_dir_all(dir.join("left-by-an-earlier-process")).unwrap();
        let f = BuildFiles::with_bounds(dir.clone(), 100, 250, Duration::from_secs(3600));
        assert!(!dir.exists(), "an earlier process's archives are gone");
        let mine = |t: &str| t.starts_with("a-");
        let theirs = |t: &str| t.starts_with("b-");
        let h = |i: u8| format!("{i:064x}");
        f.put("a-1", &h(1), &[1; 40], mine).unwrap();
        aged(&f.path("a-1", &h(1)), 30);
        f.put("a-2", &h(2), &[2; 40], mine).unwrap();
        aged(&f.path("a-2", &h(2)), 20);
        f.put("b-1", &h(3), &[3; 90], theirs).unwrap();
        // Asking for a-1 makes it the most recently used: a-2 goes to make room.
        assert!(f.present("a-1", &h(1)));
        f.put("a-3", &h(4), &[4; 50], mine).unwrap();
        assert!(!f.present("a-2", &h(2)), "the least recently used");
        assert!(f.present("a-1", &h(1)) && f.present("a-3", &h(4)));
        assert!(f.present("b-1", &h(3)), "another tenant's archive is kept");
        assert_eq!(std::fs::read(f.path("a-3", &h(4))).unwrap(), [4; 50]);
        // Bigger than a tenant's bound, or past the server's: refused, nothing of others removed.
        let too_big = f.put("a-4", &h(5), &[5; 101], mine);
        assert!(matches!(too_big, Err(LifecycleError::QuotaExceeded(_))));
        let c = |t: &str| t.starts_with("c-");
        let over = f.put("c-1", &h(6), &[6; 80], c);
        assert!(
            matches!(over, Err(LifecycleError::QuotaExceeded(_))),
            "{over:?}"
        );
        assert!(f.present("b-1", &h(3)) && f.present("a-1", &h(1)) && f.present("a-3", &h(4)));
        // Past its age an archive goes, whoever uploads next.
        aged(&f.path("b-1", &h(3)), 7200);
        f.put("c-1", &h(6), &[6; 80], c).unwrap();
        assert!(!f.path("b-1", &h(3)).exists());
    }
}
