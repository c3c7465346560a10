//! Embedded state store: one JSON file per sandbox under `<state>/server/sandboxes/`, written
//! atomically (temp file + rename), each record carrying a format version.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::model::SandboxState;

/// Version of [`SandboxRecord`]; bump on incompatible changes.
pub const RECORD_VERSION: u32 = 1;

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
    #[error("{path} is not a sandbox record: {source}")]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path} has record version {found}, this build reads {RECORD_VERSION}")]
    Version { path: PathBuf, found: u32 },
}

/// The sandbox record directory.
#[derive(Debug, Clone)]
pub struct SandboxStore {
    dir: PathBuf,
}

impl SandboxStore {
    /// Opens (creating) `<state_dir>/server/sandboxes`.
    pub fn open(state_dir: &Path) -> Result<Self, StoreError> {
        let dir = state_dir.join("server").join("sandboxes");
        std::fs::create_dir_all(&dir).map_err(|source| StoreError::CreateDir {
            path: dir.clone(),
            source,
        })?;
        Ok(SandboxStore { dir })
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

    /// Every stored record (temp files from interrupted writes are skipped).
    pub fn load_all(&self) -> Result<Vec<SandboxRecord>, StoreError> {
        let entries = std::fs::read_dir(&self.dir).map_err(|source| StoreError::Read {
            path: self.dir.clone(),
            source,
        })?;
        let mut out = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|source| StoreError::Read {
                path: self.dir.clone(),
                source,
            })?;
            let path = entry.path();
            if path.extension().and_then(|e| e.to_str()) != Some("json") {
                continue;
            }
            let text = std::fs::read(&path).map_err(|source| StoreError::Read {
                path: path.clone(),
                source,
            })?;
            let rec: SandboxRecord =
                serde_json::from_slice(&text).map_err(|source| StoreError::Parse {
                    path: path.clone(),
                    source,
                })?;
            if rec.version != RECORD_VERSION {
                return Err(StoreError::Version {
                    path,
                    found: rec.version,
                });
            }
            out.push(rec);
        }
        out.sort_by(|a, b| {
            a.started_at_ms
                .cmp(&b.started_at_ms)
                .then(a.sandbox_id.cmp(&b.sandbox_id))
        });
        Ok(out)
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
        assert_eq!(reopened.load_all().unwrap(), recs);
        reopened.remove(&recs[0].sandbox_id).unwrap();
        reopened.remove(&recs[0].sandbox_id).unwrap();
        assert_eq!(reopened.load_all().unwrap().len(), recs.len() - 1);
    }

    #[test]
    fn rejects_other_versions_and_garbage() {
        let dir = tempfile::tempdir().unwrap();
        let store = SandboxStore::open(dir.path()).unwrap();
        let mut rec = random_record(&mut rand::rng());
        rec.version = RECORD_VERSION + 1;
        store.save(&rec).unwrap();
        assert!(matches!(store.load_all(), Err(StoreError::Version { .. })));
        store.remove(&rec.sandbox_id).unwrap();
        std::fs::write(dir.path().join("server/sandboxes/bad.json"), b"{nope").unwrap();
        assert!(matches!(store.load_all(), Err(StoreError::Parse { .. })));
    }
}
