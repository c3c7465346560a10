//! Which tenant owns each snapshot and each template built through the API: `<state>/server/owners.json`
//! (0600, written atomically). A snapshot not listed is the default tenant's (it predates tenants); a template
//! not listed is public (the built-in base, or one built on the host with `aenv`).

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::store::VolumeMount;
use crate::tenants::DEFAULT_TENANT;

#[derive(Debug, Default, Clone, Serialize, Deserialize)]
struct OwnerFile {
    #[serde(default)]
    snapshots: BTreeMap<String, String>,
    #[serde(default)]
    templates: BTreeMap<String, String>,
    /// Volumes mounted in the sandbox a memory snapshot was taken of (its guest holds the mounts).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    snapshot_mounts: BTreeMap<String, Vec<VolumeMount>>,
}

/// The owner map.
pub(super) struct Owners {
    path: PathBuf,
    map: Mutex<OwnerFile>,
}

impl Owners {
    /// Loads the map; an unreadable file is moved aside (its snapshots fall to the default tenant, its
    /// templates become public, both logged) rather than stopping the server.
    pub(super) fn open(state_dir: &Path) -> std::io::Result<Owners> {
        let dir = state_dir.join("server");
        k3_common::fsutil::create_private_dir(&dir)?;
        let path = dir.join("owners.json");
        let map = match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b).unwrap_or_else(|e| {
                let aside = path.with_extension("json.unreadable");
                tracing::error!(error = %e, aside = %aside.display(), "owner map unreadable; moved aside");
                let _ = std::fs::rename(&path, &aside);
                OwnerFile::default()
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => OwnerFile::default(),
            Err(e) => return Err(e),
        };
        Ok(Owners {
            path,
            map: Mutex::new(map),
        })
    }

    fn save(&self, f: &OwnerFile) -> std::io::Result<()> {
        let bytes = serde_json::to_vec(f).expect("owner map serializes");
        k3_common::fsutil::write_atomic(&self.path, &bytes)
    }

    fn edit(&self, change: impl FnOnce(&mut OwnerFile)) -> std::io::Result<()> {
        let mut map = self.map.lock().expect("owners");
        let mut next = map.clone();
        change(&mut next);
        self.save(&next)?;
        *map = next;
        Ok(())
    }

    pub(super) fn snapshot_owner(&self, id: &str) -> String {
        let map = self.map.lock().expect("owners");
        map.snapshots
            .get(id)
            .cloned()
            .unwrap_or_else(|| DEFAULT_TENANT.into())
    }

    /// The recorded owner of snapshot `id` (`None`: not recorded on this node).
    pub(super) fn recorded_snapshot_owner(&self, id: &str) -> Option<String> {
        self.map.lock().expect("owners").snapshots.get(id).cloned()
    }

    /// `None`: a public template.
    pub(super) fn template_owner(&self, id: &str) -> Option<String> {
        self.map.lock().expect("owners").templates.get(id).cloned()
    }

    pub(super) fn set_snapshot(&self, id: &str, owner: &str) -> std::io::Result<()> {
        self.edit(|f| {
            f.snapshots.insert(id.into(), owner.into());
        })
    }

    pub(super) fn set_snapshot_mounts(
        &self,
        id: &str,
        mounts: &[VolumeMount],
    ) -> std::io::Result<()> {
        self.edit(|f| {
            f.snapshot_mounts.insert(id.into(), mounts.to_vec());
        })
    }

    /// The mounts the guest of snapshot `id` holds.
    pub(super) fn snapshot_mounts(&self, id: &str) -> Vec<VolumeMount> {
        let map = self.map.lock().expect("owners");
        map.snapshot_mounts.get(id).cloned().unwrap_or_default()
    }

    pub(super) fn set_template(&self, id: &str, owner: &str) -> std::io::Result<()> {
        self.edit(|f| {
            f.templates.insert(id.into(), owner.into());
        })
    }

    pub(super) fn forget_snapshot(&self, id: &str) -> std::io::Result<()> {
        self.edit(|f| {
            f.snapshots.remove(id);
            f.snapshot_mounts.remove(id);
        })
    }

    pub(super) fn forget_template(&self, id: &str) -> std::io::Result<()> {
        self.edit(|f| {
            f.templates.remove(id);
        })
    }

    /// Drops entries of snapshots and templates that no longer exist (a crash between the entry and the
    /// capture or build leaves one behind).
    pub(super) fn retain(
        &self,
        snapshots: &HashSet<String>,
        templates: &HashSet<String>,
    ) -> std::io::Result<()> {
        self.edit(|f| {
            f.snapshots.retain(|id, _| snapshots.contains(id));
            f.snapshot_mounts.retain(|id, _| snapshots.contains(id));
            f.templates.retain(|id, _| templates.contains(id));
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_persist_default_and_survive_garbage() {
        let dir = tempfile::tempdir().unwrap();
        let o = Owners::open(dir.path()).unwrap();
        let sid = format!("snap-{}", rand::random::<u32>());
        o.set_snapshot(&sid, "alpha").unwrap();
        o.set_template("tpl", "beta").unwrap();
        let m = VolumeMount {
            volume_id: "v1".into(),
            name: "data".into(),
            path: "/mnt/data".into(),
        };
        o.set_snapshot_mounts(&sid, std::slice::from_ref(&m))
            .unwrap();
        let o = Owners::open(dir.path()).unwrap();
        assert_eq!(o.snapshot_owner(&sid), "alpha");
        assert_eq!(o.snapshot_mounts(&sid), [m]);
        assert_eq!(o.snapshot_owner("snap-old"), DEFAULT_TENANT);
        assert_eq!(o.template_owner("tpl").as_deref(), Some("beta"));
        assert_eq!(o.template_owner("base"), None);
        o.retain(&HashSet::new(), &HashSet::from(["tpl".to_string()]))
            .unwrap();
        assert_eq!(o.snapshot_owner(&sid), DEFAULT_TENANT);
        assert!(o.snapshot_mounts(&sid).is_empty());
        std::fs::write(dir.path().join("server/owners.json"), b"{oops").unwrap();
        let o = Owners::open(dir.path()).unwrap();
        assert_eq!(o.template_owner("tpl"), None);
        assert!(dir.path().join("server/owners.json.unreadable").exists());
    }
}
