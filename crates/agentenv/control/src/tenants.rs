//! Tenants: named API keys. Each key owns the sandboxes, snapshots and templates made with it, sees only
//! those (others' answer 404), and has its own quota and request budget.
//!
//! - `<state>/server/api_key` is the tenant [`DEFAULT_TENANT`], which also owns everything made before
//!   tenants existed.
//! - `<state>/server/keys.json` (0600) lists the named keys by SHA-256, never the key itself. The CLI
//!   (`agentenv keys create|ls|revoke`) edits it under a lock; a running server rereads it when it changes,
//!   so a revoked key stops working at its next request.
//! - Snapshot names are per tenant: a named tenant's `name:tag` is kept in the runtime as
//!   `<tenant>..name:tag`, and `..` is refused in names, so no tenant can take or see another's name.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use sha2::Digest;

use crate::keys::{self, KeyError};
use crate::ratelimit::{Bucket, RateLimit};

/// Limits on what may be held at once (`None`: no limit): by the whole server, or by one key.
/// Exceeding one answers 429. A field missing from `keys.json` (a key made before it existed) reads
/// as `None`, as every field here does.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Quota {
    pub max_running: Option<usize>,
    pub max_paused: Option<usize>,
    /// Total memory of running sandboxes, MiB.
    pub max_memory_mb: Option<u64>,
    /// Snapshots held at once (an API-built template is one too).
    pub max_snapshots: Option<usize>,
    /// What those snapshots occupy on this node's disk together, GiB.
    pub max_snapshot_gb: Option<u64>,
}

impl Quota {
    /// A new named key's limits unless `agentenv keys create` is told otherwise: 20 running and 100
    /// paused sandboxes, 16 GiB of running memory, 100 snapshots of 50 GiB together.
    pub const KEY_DEFAULT_RUNNING: usize = 20;
    pub const KEY_DEFAULT_PAUSED: usize = 100;
    pub const KEY_DEFAULT_MEMORY_MB: u64 = 16 << 10;
    pub const KEY_DEFAULT_SNAPSHOTS: usize = 100;
    pub const KEY_DEFAULT_SNAPSHOT_GB: u64 = 50;
}

/// The tenant of the key in `<state>/server/api_key`.
pub const DEFAULT_TENANT: &str = "default";
const KEYS_VERSION: u32 = 1;
/// Separator between a tenant and a snapshot name in the runtime.
const NAME_SEP: &str = "..";

/// A named key as `keys.json` keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeyEntry {
    pub name: String,
    /// SHA-256 of the key, hex.
    pub sha256: String,
    /// The key's first 12 characters, to recognise it in listings.
    pub prefix: String,
    /// RFC 3339.
    pub created_at: String,
    #[serde(default)]
    pub revoked_at: Option<String>,
    #[serde(default)]
    pub quota: Quota,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct KeyFile {
    version: u32,
    keys: Vec<KeyEntry>,
}

/// Key registry failures.
#[derive(Debug, thiserror::Error)]
pub enum TenantError {
    #[error(transparent)]
    Key(#[from] KeyError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a key file of version {KEYS_VERSION}: {reason}")]
    Malformed { path: PathBuf, reason: String },
    #[error("invalid tenant name {0:?}: 1-24 of [a-z0-9-], starting with a letter")]
    InvalidName(String),
    #[error("a key named {0:?} exists already")]
    Exists(String),
    #[error("no key named {0:?}")]
    NotFound(String),
}

/// Who a request acts for.
#[derive(Debug, Clone)]
pub struct Tenant {
    pub name: Arc<str>,
    pub quota: Quota,
    /// This key's request budget (`None`: unlimited).
    pub limiter: Option<Arc<Bucket>>,
}

impl Tenant {
    /// Whether this is the tenant of the server's own key.
    pub fn is_default(&self) -> bool {
        &*self.name == DEFAULT_TENANT
    }
}

/// The runtime name of tenant `tenant`'s snapshot name `name` (`name[:tag]`), or why it is refused.
pub fn scoped_name(tenant: &str, name: &str) -> Result<String, String> {
    if name.contains(NAME_SEP) {
        return Err(format!("invalid snapshot name {name:?}: '..' is reserved"));
    }
    let scoped = if tenant == DEFAULT_TENANT {
        name.to_string()
    } else {
        format!("{tenant}{NAME_SEP}{name}")
    };
    agentenv_vm::normalize_name(&scoped).ok_or_else(|| {
        format!(
            "invalid snapshot name {name:?}: name and tag are 1-64 of [A-Za-z0-9_.-] (the name \
             {} shorter under this key)",
            scoped.len() - name.len()
        )
    })
}

/// The tenant a runtime snapshot name is scoped to (`None`: the default tenant's).
pub fn scope_of(scoped: &str) -> Option<&str> {
    scoped.split_once(NAME_SEP).map(|(t, _)| t)
}

/// Tenant `tenant`'s view of a runtime snapshot name (`None`: another tenant's).
pub fn unscoped_name<'a>(tenant: &str, scoped: &'a str) -> Option<&'a str> {
    match scoped.split_once(NAME_SEP) {
        None if tenant == DEFAULT_TENANT => Some(scoped),
        Some((t, rest)) if t == tenant => Some(rest),
        _ => None,
    }
}

/// Whether `name` can name a tenant.
pub fn valid_tenant_name(name: &str) -> bool {
    (1..=24).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

fn sha256_hex(key: &str) -> String {
    sha2::Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn keys_path(state_dir: &Path) -> PathBuf {
    state_dir.join("server/keys.json")
}

fn read_keys(path: &Path) -> Result<KeyFile, TenantError> {
    match std::fs::read(path) {
        Ok(bytes) => {
            let f: KeyFile =
                serde_json::from_slice(&bytes).map_err(|e| TenantError::Malformed {
                    path: path.into(),
                    reason: e.to_string(),
                })?;
            if f.version != KEYS_VERSION {
                return Err(TenantError::Malformed {
                    path: path.into(),
                    reason: format!("version {}", f.version),
                });
            }
            Ok(f)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(KeyFile {
            version: KEYS_VERSION,
            keys: vec![],
        }),
        Err(source) => Err(TenantError::Io {
            path: path.into(),
            source,
        }),
    }
}

/// Runs `edit` on the key file under an exclusive lock (`keys.lock`), then writes it back atomically.
fn edit_keys<T>(
    state_dir: &Path,
    edit: impl FnOnce(&mut KeyFile) -> Result<T, TenantError>,
) -> Result<T, TenantError> {
    use std::os::fd::AsRawFd;
    let dir = state_dir.join("server");
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| TenantError::Io { path, source }
    };
    k3_common::fsutil::create_private_dir(&dir).map_err(io(&dir))?;
    let lock_path = dir.join("keys.lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(io(&lock_path))?;
    // SAFETY: flock on an fd this function owns; released when `lock` closes.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(io(&lock_path)(std::io::Error::last_os_error()));
    }
    let path = keys_path(state_dir);
    let mut file = read_keys(&path)?;
    let out = edit(&mut file)?;
    let bytes = serde_json::to_vec_pretty(&file).expect("key file serializes");
    k3_common::fsutil::write_atomic(&path, &bytes).map_err(io(&path))?;
    Ok(out)
}

/// Makes a named key with `quota`; returns the key (shown once) and its entry.
pub fn create_key(
    state_dir: &Path,
    name: &str,
    quota: Quota,
) -> Result<(String, KeyEntry), TenantError> {
    if !valid_tenant_name(name) || name == DEFAULT_TENANT {
        return Err(TenantError::InvalidName(name.into()));
    }
    edit_keys(state_dir, |f| {
        if f.keys.iter().any(|k| k.name == name) {
            return Err(TenantError::Exists(name.into()));
        }
        let key = keys::generate_api_key();
        let entry = KeyEntry {
            name: name.into(),
            sha256: sha256_hex(&key),
            prefix: key[..12].into(),
            created_at: k3_common::time::now_rfc3339(),
            revoked_at: None,
            quota,
        };
        f.keys.push(entry.clone());
        Ok((key, entry))
    })
}

/// The named keys, revoked ones included.
pub fn list_keys(state_dir: &Path) -> Result<Vec<KeyEntry>, TenantError> {
    Ok(read_keys(&keys_path(state_dir))?.keys)
}

/// Revokes the key `name` (kept in the file, marked revoked, so its name stays taken).
pub fn revoke_key(state_dir: &Path, name: &str) -> Result<KeyEntry, TenantError> {
    edit_keys(state_dir, |f| {
        let e = f
            .keys
            .iter_mut()
            .find(|k| k.name == name)
            .ok_or_else(|| TenantError::NotFound(name.into()))?;
        if e.revoked_at.is_none() {
            e.revoked_at = Some(k3_common::time::now_rfc3339());
        }
        Ok(e.clone())
    })
}

/// What identifies a version of the key file.
type Stamp = Option<(std::time::SystemTime, u64, u64)>;

struct Loaded {
    stamp: Stamp,
    /// By SHA-256; `None` when the file could not be read (named keys then fail closed).
    tenants: Option<BTreeMap<String, Tenant>>,
}

/// The keys a running server accepts.
pub struct KeyRing {
    path: PathBuf,
    default_key: String,
    default: Tenant,
    rate: Option<RateLimit>,
    loaded: Mutex<Loaded>,
    /// Buckets by tenant name, kept across reloads.
    buckets: Mutex<BTreeMap<String, Arc<Bucket>>>,
}

impl KeyRing {
    /// The server's own key as tenant `default` with `default_quota`, and the named keys of `state_dir`.
    pub fn open(
        state_dir: &Path,
        default_key: String,
        default_quota: Quota,
        rate: Option<RateLimit>,
    ) -> KeyRing {
        let ring = KeyRing {
            path: keys_path(state_dir),
            default_key,
            default: Tenant {
                name: DEFAULT_TENANT.into(),
                quota: default_quota,
                limiter: rate.map(|r| Arc::new(Bucket::new(r))),
            },
            rate,
            loaded: Mutex::new(Loaded {
                stamp: None,
                tenants: Some(BTreeMap::new()),
            }),
            buckets: Mutex::new(BTreeMap::new()),
        };
        ring.refresh();
        ring
    }

    fn stamp(&self) -> Stamp {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(&self.path).ok()?;
        Some((m.modified().ok()?, m.len(), m.ino()))
    }

    /// Rereads the key file when it changed since the last look.
    fn refresh(&self) {
        let stamp = self.stamp();
        let mut loaded = self.loaded.lock().expect("key ring");
        if loaded.stamp == stamp && stamp.is_some() {
            return;
        }
        loaded.stamp = stamp;
        loaded.tenants = match read_keys(&self.path) {
            Ok(f) => Some(
                f.keys
                    .into_iter()
                    .filter(|k| k.revoked_at.is_none())
                    .map(|k| {
                        let tenant = self.tenant(&k.name, k.quota);
                        (k.sha256, tenant)
                    })
                    .collect(),
            ),
            Err(e) => {
                tracing::error!(error = %e, "key file unreadable: named keys are refused until it is fixed");
                None
            }
        };
    }

    fn tenant(&self, name: &str, quota: Quota) -> Tenant {
        let limiter = self.rate.map(|r| {
            self.buckets
                .lock()
                .expect("buckets")
                .entry(name.to_string())
                .or_insert_with(|| Arc::new(Bucket::new(r)))
                .clone()
        });
        Tenant {
            name: name.into(),
            quota,
            limiter,
        }
    }

    /// The quota of tenant `name` (none for an unknown or revoked one: the server-wide quota still applies).
    pub fn quota_of(&self, name: &str) -> Quota {
        if name == DEFAULT_TENANT {
            return self.default.quota.clone();
        }
        self.refresh();
        let loaded = self.loaded.lock().expect("key ring");
        loaded
            .tenants
            .iter()
            .flat_map(|m| m.values())
            .find(|t| &*t.name == name)
            .map(|t| t.quota.clone())
            .unwrap_or_default()
    }

    /// Signs an upload of COPY archive `hash` of template `tid` by `tenant`, valid until `expires`
    /// (Unix seconds): the query of a URL that needs no key ([`KeyRing::check_upload`]).
    pub fn sign_upload(&self, tenant: &str, tid: &str, hash: &str, expires: i64) -> String {
        let sig = self.upload_mac(tenant, tid, hash, expires);
        format!("tenant={tenant}&expires={expires}&signature={sig}")
    }

    /// The tenant a signed upload URL of `tid`/`hash` was issued to, if its signature holds, it has
    /// not expired at `now` (Unix seconds) and the tenant's key still exists.
    pub fn check_upload(
        &self,
        tid: &str,
        hash: &str,
        query: &std::collections::HashMap<String, String>,
        now: i64,
    ) -> Option<Tenant> {
        let (tenant, sig) = (query.get("tenant")?, query.get("signature")?);
        let expires: i64 = query.get("expires")?.parse().ok()?;
        if now > expires || !keys::secret_eq(sig, &self.upload_mac(tenant, tid, hash, expires)) {
            return None;
        }
        self.named(tenant)
    }

    /// The tenant called `name` (the operator's is [`DEFAULT_TENANT`]), while its key exists.
    pub fn named(&self, name: &str) -> Option<Tenant> {
        if name == DEFAULT_TENANT {
            return Some(self.default.clone());
        }
        self.refresh();
        let loaded = self.loaded.lock().expect("key ring");
        loaded
            .tenants
            .as_ref()?
            .iter()
            .find(|(_, t)| &*t.name == name)
            .map(|(_, t)| t.clone())
    }

    /// The MAC of one upload grant, under a key derived from the server's own key.
    fn upload_mac(&self, tenant: &str, tid: &str, hash: &str, expires: i64) -> String {
        let key = sha256_hex(&format!("agentenv-upload-url:{}", self.default_key));
        keys::hmac_sha256_hex(
            key.as_bytes(),
            format!("{tenant}\n{tid}\n{hash}\n{expires}").as_bytes(),
        )
    }

    /// The tenant of `presented`, or `None` for an unknown or revoked key.
    pub fn authenticate(&self, presented: &str) -> Option<Tenant> {
        if keys::secret_eq(presented, &self.default_key) {
            return Some(self.default.clone());
        }
        if !keys::is_api_key(presented) {
            return None;
        }
        self.refresh();
        let digest = sha256_hex(presented);
        let loaded = self.loaded.lock().expect("key ring");
        loaded
            .tenants
            .as_ref()?
            .iter()
            .find(|(sha, _)| keys::secret_eq(sha, &digest))
            .map(|(_, t)| t.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn ring(dir: &Path) -> (KeyRing, String) {
        let key = keys::generate_api_key();
        (KeyRing::open(dir, key.clone(), Quota::default(), None), key)
    }

    #[test]
    fn signed_uploads_hold_only_for_their_file_tenant_and_time() {
        let dir = tempfile::tempdir().unwrap();
        let (ring, _) = ring(dir.path());
        let name = format!("team-{}", rand::random_range(0..1000));
        create_key(dir.path(), &name, Quota::default()).unwrap();
        let now = rand::random_range(1_000_000_000..2_000_000_000i64);
        let q = |s: String| -> std::collections::HashMap<String, String> {
            s.split('&')
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let good = q(ring.sign_upload(&name, "tpl", "h1", now + 60));
        assert_eq!(
            ring.check_upload("tpl", "h1", &good, now)
                .map(|t| t.name.to_string()),
            Some(name.clone())
        );
        assert!(
            ring.check_upload("tpl", "h2", &good, now).is_none(),
            "another file"
        );
        assert!(
            ring.check_upload("tpl2", "h1", &good, now).is_none(),
            "another template"
        );
        assert!(
            ring.check_upload("tpl", "h1", &good, now + 61).is_none(),
            "expired"
        );
        let mut other = good.clone();
        other.insert("tenant".into(), DEFAULT_TENANT.into());
        assert!(
            ring.check_upload("tpl", "h1", &other, now).is_none(),
            "another tenant"
        );
        let mut later = good.clone();
        later.insert("expires".into(), (now + 3600).to_string());
        assert!(
            ring.check_upload("tpl", "h1", &later, now).is_none(),
            "a stretched expiry"
        );
        revoke_key(dir.path(), &name).unwrap();
        assert!(
            ring.check_upload("tpl", "h1", &good, now).is_none(),
            "a revoked key"
        );
    }

    #[test]
    fn named_keys_authenticate_until_revoked_and_are_stored_hashed() {
        let dir = tempfile::tempdir().unwrap();
        let (ring, default_key) = ring(dir.path());
        let name = format!("team-{}", rand::random_range(0..1000));
        let quota = Quota {
            max_running: Some(rand::random_range(1..9)),
            ..Default::default()
        };
        let (key, entry) = create_key(dir.path(), &name, quota.clone()).unwrap();
        assert!(keys::is_api_key(&key) && key.starts_with(&entry.prefix));
        let text = std::fs::read_to_string(dir.path().join("server/keys.json")).unwrap();
        assert!(!text.contains(&key), "the key itself is never stored");
        let mode = std::fs::metadata(dir.path().join("server/keys.json"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);

        let t = ring.authenticate(&key).expect("a new key works at once");
        assert_eq!(
            (&*t.name, t.quota.max_running),
            (name.as_str(), quota.max_running)
        );
        assert!(ring.authenticate(&default_key).unwrap().is_default());
        assert!(ring.authenticate(&keys::generate_api_key()).is_none());
        assert!(matches!(
            create_key(dir.path(), &name, Quota::default()),
            Err(TenantError::Exists(_))
        ));
        for bad in ["default", "", "Caps", "9lives", "a..b", &"x".repeat(25)] {
            assert!(
                matches!(
                    create_key(dir.path(), bad, Quota::default()),
                    Err(TenantError::InvalidName(_))
                ),
                "{bad:?}"
            );
        }

        let revoked = revoke_key(dir.path(), &name).unwrap();
        assert!(revoked.revoked_at.is_some());
        assert!(
            ring.authenticate(&key).is_none(),
            "revocation takes effect at once"
        );
        assert!(ring.authenticate(&default_key).is_some());
        assert_eq!(list_keys(dir.path()).unwrap().len(), 1);
        assert!(matches!(
            revoke_key(dir.path(), "nobody"),
            Err(TenantError::NotFound(_))
        ));
    }

    #[test]
    fn an_unreadable_key_file_refuses_named_keys_but_not_the_default() {
        let dir = tempfile::tempdir().unwrap();
        let (ring, default_key) = ring(dir.path());
        let (key, _) = create_key(dir.path(), "alpha", Quota::default()).unwrap();
        assert!(ring.authenticate(&key).is_some());
        std::fs::write(dir.path().join("server/keys.json"), b"{not json").unwrap();
        assert!(ring.authenticate(&key).is_none());
        assert!(ring.authenticate(&default_key).is_some());
    }

    #[test]
    fn concurrent_creates_keep_every_key() {
        let dir = tempfile::tempdir().unwrap();
        let n = rand::random_range(4..10);
        std::thread::scope(|s| {
            for i in 0..n {
                let d = dir.path();
                s.spawn(move || create_key(d, &format!("t{i}"), Quota::default()).unwrap());
            }
        });
        assert_eq!(list_keys(dir.path()).unwrap().len(), n);
    }

    #[test]
    fn snapshot_names_are_scoped_per_tenant() {
        let (d, a, b) = (DEFAULT_TENANT, "alpha", "beta");
        assert_eq!(scoped_name(d, "web").unwrap(), "web:default");
        assert_eq!(scoped_name(a, "web:v2").unwrap(), "alpha..web:v2");
        assert!(scoped_name(a, "x..y").is_err() && scoped_name(d, "beta..web").is_err());
        assert!(scoped_name(a, &"n".repeat(60)).is_err());
        assert!(scoped_name(d, &"n".repeat(60)).is_ok());
        assert_eq!(unscoped_name(a, "alpha..web:v2"), Some("web:v2"));
        assert_eq!(unscoped_name(b, "alpha..web:v2"), None);
        assert_eq!(unscoped_name(d, "alpha..web:v2"), None);
        assert_eq!(unscoped_name(d, "web:default"), Some("web:default"));
        assert_eq!(unscoped_name(a, "web:default"), None);
    }
}
