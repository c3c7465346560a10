//! Embedded state store: one JSON file per sandbox under `<state>/server/sandboxes/`, written
//! atomically (temp file + rename, mode 0600, folder 0700), each record carrying a format version.
//! Older versions are migrated on load; unreadable or newer records are moved to
//! `<state>/server/quarantine/` and reported, never fatal and never deleted.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// A sandbox's state as tenants see it; transitional states are never shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    Running,
    Paused,
}

impl SandboxState {
    /// `running` or `paused`.
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Running => "running",
            SandboxState::Paused => "paused",
        }
    }
}

/// Version of [`SandboxRecord`]; bump on changes, and migrate the older ones in [`migrate`].
/// 2: `paused_at_ms`. 3: `owner`.
pub const RECORD_VERSION: u32 = 3;

/// Everything the server keeps about one sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub version: u32,
    pub sandbox_id: String,
    pub template_id: String,
    pub alias: Option<String>,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    /// Unix milliseconds.
    pub started_at_ms: i64,
    /// Unix milliseconds.
    pub end_at_ms: i64,
    pub state: SandboxState,
    pub auto_pause: bool,
    pub auto_resume: bool,
    /// envd access token; constant for the sandbox's life.
    pub access_token: String,
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub disk_mb: u32,
    pub envd_version: String,
    /// Unix milliseconds of the last pause (paused sandboxes expire after the retention).
    #[serde(default)]
    pub paused_at_ms: Option<i64>,
    /// The tenant (API key name) whose sandbox this is.
    #[serde(default = "default_owner")]
    pub owner: String,
    /// An auto-pause keeps memory (`autoPauseMemory`); false: only the filesystem.
    #[serde(default = "yes")]
    pub auto_pause_memory: bool,
    /// Paused without memory: a resume cold-boots it from its disk.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused_filesystem: bool,
    /// Its user ports answer without its traffic token (E2B's `allowPublicTraffic`, true unless the
    /// create said false); records of older servers say no.
    #[serde(default)]
    pub public_traffic: bool,
    /// The `Host` its user ports see for requests from outside (E2B's `maskRequestHost`, `${PORT}`
    /// standing for the port); `None`: `localhost:<port>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask_request_host: Option<String>,
    /// Volumes mounted into it (kept attached while it runs).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts: Vec<VolumeMount>,
}

/// A volume mounted into a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeMount {
    pub volume_id: String,
    /// The volume's name, as E2B shows mounts.
    pub name: String,
    /// Absolute path in the guest.
    pub path: String,
}

fn yes() -> bool {
    true
}

fn default_owner() -> String {
    crate::tenants::DEFAULT_TENANT.into()
}

/// Brings a record of an older version to [`RECORD_VERSION`]; `None` for versions this build cannot read.
fn migrate(mut rec: SandboxRecord, now_ms: i64) -> Option<SandboxRecord> {
    match rec.version {
        RECORD_VERSION => Some(rec),
        1 | 2 => {
            // v1 kept no pause time: the retention of a paused v1 sandbox counts from the migration.
            if rec.version == 1 {
                rec.paused_at_ms = (rec.state == SandboxState::Paused).then_some(now_ms);
            }
            // Before tenants (v1, v2) every sandbox was the server key's.
            rec.owner = default_owner();
            rec.version = RECORD_VERSION;
            Some(rec)
        }
        _ => None,
    }
}

/// A record file that could not be used, moved aside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quarantined {
    /// Where the file is now.
    pub path: PathBuf,
    pub reason: String,
}

/// What [`SandboxStore::load_all`] found.
#[derive(Debug, Default)]
pub struct Loaded {
    pub records: Vec<SandboxRecord>,
    /// Records migrated from an older version (and saved again).
    pub migrated: usize,
    pub quarantined: Vec<Quarantined>,
}

/// Store failures.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("creating state directory {path}: {source}")]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("removing {path}: {source}")]
    Remove {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("moving {path} to quarantine: {source}")]
    Quarantine {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The sandbox record directory.
#[derive(Debug, Clone)]
pub struct SandboxStore {
    state_dir: PathBuf,
    dir: PathBuf,
    quarantine: PathBuf,
}

impl SandboxStore {
    /// Opens (creating, mode 0700) `<state_dir>/server/sandboxes`.
    pub fn open(state_dir: &Path) -> Result<Self, StoreError> {
        let server = state_dir.join("server");
        let dir = server.join("sandboxes");
        k3_common::fsutil::create_private_dir(&dir).map_err(|source| StoreError::CreateDir {
            path: dir.clone(),
            source,
        })?;
        Ok(SandboxStore {
            state_dir: state_dir.to_path_buf(),
            dir,
            quarantine: server.join("quarantine"),
        })
    }

    /// The state folder this store lives in.
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    pub fn save(&self, rec: &SandboxRecord) -> Result<(), StoreError> {
        let path = self.path(&rec.sandbox_id);
        let text = serde_json::to_vec_pretty(rec).expect("record serializes");
        k3_common::fsutil::write_atomic(&path, &text)
            .map_err(|source| StoreError::Write { path, source })
    }

    pub fn remove(&self, id: &str) -> Result<(), StoreError> {
        let path = self.path(id);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(StoreError::Remove { path, source }),
        }
    }

    /// Every usable record, oldest first. Temp files of interrupted writes are skipped; older versions are
    /// migrated and saved; unreadable and newer-version files are quarantined.
    pub fn load_all(&self, now_ms: i64) -> Result<Loaded, StoreError> {
        let entries = std::fs::read_dir(&self.dir).map_err(|source| StoreError::Read {
            path: self.dir.clone(),
            source,
        })?;
        let mut out = Loaded::default();
        for entry in entries {
            let entry = entry.map_err(|source| StoreError::Read {
                path: self.dir.clone(),
                source,
            })?;
            let path = entry.path();
            if path.extension().and_then(|e| e.to_str()) != Some("json") {
                continue;
            }
            let parsed = std::fs::read(&path)
                .map_err(|e| format!("unreadable: {e}"))
                .and_then(|t| {
                    serde_json::from_slice::<SandboxRecord>(&t)
                        .map_err(|e| format!("not a sandbox record: {e}"))
                });
            let rec = match parsed {
                Ok(rec) => rec,
                Err(reason) => {
                    out.quarantined.push(self.quarantine(&path, reason)?);
                    continue;
                }
            };
            let found = rec.version;
            match migrate(rec, now_ms) {
                Some(rec) if found != RECORD_VERSION => {
                    self.save(&rec)?;
                    out.migrated += 1;
                    out.records.push(rec);
                }
                Some(rec) => out.records.push(rec),
                None => {
                    let reason =
                        format!("record version {found}; this build reads 1..={RECORD_VERSION}");
                    out.quarantined.push(self.quarantine(&path, reason)?);
                }
            }
        }
        out.records.sort_by(|a, b| {
            a.started_at_ms
                .cmp(&b.started_at_ms)
                .then(a.sandbox_id.cmp(&b.sandbox_id))
        });
        Ok(out)
    }

    fn quarantine(&self, path: &Path, reason: String) -> Result<Quarantined, StoreError> {
        let fail = |source| StoreError::Quarantine {
            path: path.to_path_buf(),
            source,
        };
        k3_common::fsutil::create_private_dir(&self.quarantine).map_err(fail)?;
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let dest = self
            .quarantine
            .join(format!("{name}.{}", k3_common::time::now_unix_ms()));
        std::fs::rename(path, &dest).map_err(fail)?;
        tracing::error!(record = %path.display(), moved_to = %dest.display(), %reason, "quarantined a sandbox record");
        Ok(Quarantined { path: dest, reason })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    fn random_record(rng: &mut impl Rng) -> SandboxRecord {
        let id: String = (0..20)
            .map(|_| char::from(b"abcdefghijklmnopqrstuvwxyz0123456789"[rng.random_range(0..36)]))
            .collect();
        let mut metadata = BTreeMap::new();
        for i in 0..rng.random_range(0..4) {
            metadata.insert(format!("k{i}"), format!("v{}", rng.random::<u32>()));
        }
        SandboxRecord {
            version: RECORD_VERSION,
            sandbox_id: id,
            template_id: "base".into(),
            alias: Some("base".into()),
            metadata,
            env_vars: BTreeMap::from([("X".to_string(), rng.random::<u64>().to_string())]),
            started_at_ms: rng.random_range(0..1 << 40),
            end_at_ms: rng.random_range(0..1 << 41),
            state: if rng.random() {
                SandboxState::Running
            } else {
                SandboxState::Paused
            },
            auto_pause: rng.random(),
            auto_resume: rng.random(),
            access_token: format!("{:032x}", rng.random::<u128>()),
            cpu_count: 1,
            memory_mb: 256,
            disk_mb: 512,
            envd_version: "0.5.7".into(),
            paused_at_ms: None,
            owner: format!("t{}", rng.random_range(0..9)),
            auto_pause_memory: rng.random(),
            paused_filesystem: rng.random(),
            public_traffic: rng.random(),
            mask_request_host: rng
                .random::<bool>()
                .then(|| "masked.example:${PORT}".to_string()),
            volume_mounts: if rng.random() {
                vec![VolumeMount {
                    volume_id: format!("v{}", rng.random::<u32>()),
                    name: "n".into(),
                    path: "/mnt/v".into(),
                }]
            } else {
                vec![]
            },
        }
    }

    #[test]
    fn records_round_trip_and_removal() {
        let dir = tempfile::tempdir().unwrap();
        let store = SandboxStore::open(dir.path()).unwrap();
        let mut rng = rand::rng();
        let mut recs: Vec<SandboxRecord> = (0..8).map(|_| random_record(&mut rng)).collect();
        for r in &recs {
            store.save(r).unwrap();
        }
        std::fs::write(dir.path().join("server/sandboxes/x.json.tmp"), b"garbage").unwrap();
        let reopened = SandboxStore::open(dir.path()).unwrap();
        recs.sort_by(|a, b| {
            a.started_at_ms
                .cmp(&b.started_at_ms)
                .then(a.sandbox_id.cmp(&b.sandbox_id))
        });
        let loaded = reopened.load_all(0).unwrap();
        assert_eq!(loaded.records, recs);
        assert!(loaded.quarantined.is_empty() && loaded.migrated == 0);
        reopened.remove(&recs[0].sandbox_id).unwrap();
        reopened.remove(&recs[0].sandbox_id).unwrap();
        assert_eq!(reopened.load_all(0).unwrap().records.len(), recs.len() - 1);
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir.path().join("server/sandboxes")), 0o700);
        let file = dir
            .path()
            .join(format!("server/sandboxes/{}.json", recs[1].sandbox_id));
        assert_eq!(mode(&file), 0o600);
    }

    #[test]
    fn version_one_records_migrate_with_the_pause_time() {
        let dir = tempfile::tempdir().unwrap();
        let store = SandboxStore::open(dir.path()).unwrap();
        let mut rec = random_record(&mut rand::rng());
        rec.state = SandboxState::Paused;
        // A v1 file has no `paused_at_ms` and no `owner` at all.
        let mut v1 = serde_json::to_value(&rec).unwrap();
        v1["version"] = 1.into();
        v1.as_object_mut().unwrap().remove("paused_at_ms");
        v1.as_object_mut().unwrap().remove("owner");
        let path = dir
            .path()
            .join(format!("server/sandboxes/{}.json", rec.sandbox_id));
        std::fs::write(&path, serde_json::to_vec(&v1).unwrap()).unwrap();
        let loaded = store.load_all(12345).unwrap();
        assert_eq!(loaded.migrated, 1);
        let got = &loaded.records[0];
        assert_eq!(
            (got.version, got.paused_at_ms, got.owner.as_str()),
            (RECORD_VERSION, Some(12345), crate::tenants::DEFAULT_TENANT)
        );
        // Saved back in the new version: a second load migrates nothing.
        let again = store.load_all(99999).unwrap();
        assert_eq!((again.migrated, &again.records[0]), (0, got));
    }

    #[test]
    fn version_two_records_become_the_default_tenants() {
        let dir = tempfile::tempdir().unwrap();
        let store = SandboxStore::open(dir.path()).unwrap();
        let mut rec = random_record(&mut rand::rng());
        rec.paused_at_ms = Some(rand::random_range(1..1 << 40));
        let mut v2 = serde_json::to_value(&rec).unwrap();
        v2["version"] = 2.into();
        v2.as_object_mut().unwrap().remove("owner");
        let path = dir
            .path()
            .join(format!("server/sandboxes/{}.json", rec.sandbox_id));
        std::fs::write(&path, serde_json::to_vec(&v2).unwrap()).unwrap();
        let loaded = store.load_all(7).unwrap();
        assert_eq!(loaded.migrated, 1);
        let got = &loaded.records[0];
        assert_eq!(got.owner, crate::tenants::DEFAULT_TENANT);
        assert_eq!(
            got.paused_at_ms, rec.paused_at_ms,
            "v2 pause times are kept"
        );
    }

    #[test]
    fn garbage_and_newer_versions_are_quarantined_not_fatal() {
        let dir = tempfile::tempdir().unwrap();
        let store = SandboxStore::open(dir.path()).unwrap();
        let good = random_record(&mut rand::rng());
        store.save(&good).unwrap();
        let mut newer = random_record(&mut rand::rng());
        newer.version = RECORD_VERSION + 1;
        store.save(&newer).unwrap();
        std::fs::write(dir.path().join("server/sandboxes/bad.json"), b"{nope").unwrap();
        let loaded = store.load_all(0).unwrap();
        assert_eq!(loaded.records, vec![good]);
        assert_eq!(loaded.quarantined.len(), 2);
        for q in &loaded.quarantined {
            assert!(
                q.path.starts_with(dir.path().join("server/quarantine")),
                "{q:?}"
            );
            assert!(q.path.is_file(), "{q:?} kept, not deleted");
        }
        assert!(
            loaded
                .quarantined
                .iter()
                .any(|q| q.reason.contains("version"))
        );
        // Nothing left to quarantine the second time.
        assert!(store.load_all(0).unwrap().quarantined.is_empty());
    }
}
