//! Snapshots and templates as tenants see them: capture, list, import from a shared store, delete, build.

use super::{Caller, LifecycleError, Result, Sandboxes, Usage, internal};
use crate::backend::{SnapshotInfo, SnapshotMode, TemplateInfo, TemplateSpec, VmError};
use crate::keys;
use crate::tenants::{self, DEFAULT_TENANT};

impl Sandboxes {
    /// Snapshots a sandbox. It keeps running (stopped only for the capture), with its id and expiry.
    /// The snapshot is the sandbox owner's, and outlives the sandbox. Refused past the owner's
    /// snapshot quota (count or bytes: [`LifecycleError::QuotaExceeded`]) or the server's stored-bytes
    /// budget ([`LifecycleError::StorageFull`]); one whose bytes take either over is undone.
    pub async fn snapshot(
        &self,
        caller: &Caller,
        id: &str,
        name: Option<String>,
        memory: bool,
    ) -> Result<SnapshotInfo> {
        self.snapshot_named(caller, id, name.as_slice(), memory)
            .await
    }

    /// [`Sandboxes::snapshot`] with any number of names (`name[:tag]`), each moved from an older
    /// snapshot of the owner that had it.
    pub(super) async fn snapshot_named(
        &self,
        caller: &Caller,
        id: &str,
        names: &[String],
        memory: bool,
    ) -> Result<SnapshotInfo> {
        let t0 = std::time::Instant::now();
        let rec = self.get_as(caller, id)?;
        let (owner, mounts) = (rec.owner, rec.volume_mounts);
        let names = names
            .iter()
            .map(|n| tenants::scoped_name(&owner, n).map_err(LifecycleError::Invalid))
            .collect::<Result<Vec<_>>>()?;
        let _held = self.reserve(&owner, Usage::snapshot())?;
        let lock = self.op_lock(id);
        let _guard = lock.lock().await;
        self.get_as(caller, id)?;
        let sid = keys::generate_snapshot_id();
        // Who holds each name now, to give it back should the new snapshot be undone.
        let holders: Vec<(String, String)> = self
            .backend
            .snapshots()
            .into_iter()
            .flat_map(|s| {
                let held: Vec<String> = s.names.into_iter().filter(|n| names.contains(n)).collect();
                held.into_iter().map(move |n| (n, s.id.clone()))
            })
            .collect();
        let mode = if memory {
            SnapshotMode::Full
        } else {
            SnapshotMode::Filesystem
        };
        // The owner is written first: a crash after it leaves only an entry that the next start drops.
        self.owners.set_snapshot(&sid, &owner).map_err(internal)?;
        if memory && !mounts.is_empty() {
            self.owners
                .set_snapshot_mounts(&sid, &mounts)
                .map_err(internal)?;
        }
        let t_owner = t0.elapsed();
        let r = self
            .within(
                "snapshot",
                id,
                self.cfg.deadlines.snapshot,
                self.backend.snapshot(id, &sid, &names, mode),
            )
            .await;
        if r.is_err() && self.backend.snapshots().iter().all(|s| s.id != sid) {
            let _ = self.owners.forget_snapshot(&sid);
        }
        let info = r?;
        let t_backend = t0.elapsed();
        if let Err(e) = self.check_stored(&owner) {
            self.undo_snapshot(&sid, &holders);
            return Err(e);
        }
        tracing::debug!(?t_owner, ?t_backend, t_checked = ?t0.elapsed(), "snapshot phases");
        Ok(self.as_seen_by(&owner, info))
    }

    /// Undoes snapshot `sid` just taken: its names go back to the snapshots that held them, then it goes.
    fn undo_snapshot(&self, sid: &str, holders: &[(String, String)]) {
        for (name, holder) in holders {
            if let Err(e) = self
                .backend
                .rename_snapshot(holder, std::slice::from_ref(name), &[])
            {
                tracing::warn!(snapshot = %holder, name = %name, error = %e, "giving a name back failed");
            }
        }
        if let Err(e) = self.backend.delete_snapshot(sid) {
            tracing::warn!(snapshot = %sid, error = %e, "deleting a snapshot over its limit failed");
        }
        let _ = self.owners.forget_snapshot(sid);
    }

    /// `info` with only the names of `owner`, as that tenant wrote them.
    fn as_seen_by(&self, owner: &str, mut info: SnapshotInfo) -> SnapshotInfo {
        info.names = info
            .names
            .iter()
            .filter_map(|n| tenants::unscoped_name(owner, n).map(str::to_string))
            .collect();
        info
    }

    /// The live snapshots `caller` may see, as it sees them.
    fn visible_snapshots(&self, caller: &Caller) -> Vec<(String, SnapshotInfo)> {
        self.backend
            .snapshots()
            .into_iter()
            .filter_map(|s| {
                let owner = self.owners.snapshot_owner(&s.id);
                caller
                    .sees(&owner)
                    .then(|| (owner.clone(), self.as_seen_by(&owner, s)))
            })
            .collect()
    }

    /// Imports `caller`'s snapshot `name` (an id, or its own `name[:tag]`) from a chunk store shared with
    /// other machines. It belongs to the tenant its names are scoped to (the default one when unnamed), so
    /// a tenant can import only its own.
    pub(super) async fn import_snapshot(
        &self,
        caller: &Caller,
        name: &str,
    ) -> Result<Option<SnapshotInfo>> {
        let wanted = if keys::is_snapshot_id(name) {
            name.to_string()
        } else {
            match tenants::scoped_name(caller.owner(), name) {
                Ok(n) => n,
                Err(_) => return Ok(None),
            }
        };
        let Some(info) = self.backend.import_snapshot(&wanted).await? else {
            return Ok(None);
        };
        // An owner, once recorded, is never recomputed (a snapshot this node already knows keeps
        // its owner whoever asks); one new to this node belongs to the tenant its names are scoped to.
        let owner = match self.owners.recorded_snapshot_owner(&info.id) {
            Some(o) => o,
            None => {
                let o = info
                    .names
                    .iter()
                    .find_map(|n| tenants::scope_of(n).map(str::to_string))
                    .unwrap_or_else(|| DEFAULT_TENANT.into());
                self.owners.set_snapshot(&info.id, &o).map_err(internal)?;
                o
            }
        };
        Ok(caller.sees(&owner).then(|| self.as_seen_by(&owner, info)))
    }

    /// `caller`'s snapshot with id or name (`name[:tag]`) `name`.
    pub(super) fn find_snapshot(&self, caller: &Caller, name: &str) -> Option<SnapshotInfo> {
        let wanted = agentenv_vm::normalize_name(name);
        self.visible_snapshots(caller)
            .into_iter()
            .map(|(_, s)| s)
            .find(|s| s.id == name || wanted.as_ref().is_some_and(|w| s.names.contains(w)))
    }

    /// Live snapshots `caller` may see, oldest first, optionally of one sandbox and/or with one name
    /// (`name[:tag]`).
    pub fn snapshots(
        &self,
        caller: &Caller,
        sandbox_id: Option<&str>,
        name: Option<&str>,
    ) -> Result<Vec<SnapshotInfo>> {
        let wanted =
            match name {
                Some(n) => Some(agentenv_vm::normalize_name(n).ok_or_else(|| {
                    LifecycleError::Invalid(format!("invalid snapshot name {n:?}"))
                })?),
                None => None,
            };
        let mut all: Vec<SnapshotInfo> = self
            .visible_snapshots(caller)
            .into_iter()
            .map(|(_, s)| s)
            .filter(|s| sandbox_id.is_none_or(|id| s.source_sandbox.as_deref() == Some(id)))
            .filter(|s| wanted.as_ref().is_none_or(|w| s.names.contains(w)))
            .collect();
        all.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
        Ok(all)
    }

    /// Deletes `caller`'s snapshot by id or name.
    pub fn delete_snapshot(&self, caller: &Caller, id_or_name: &str) -> Result<()> {
        let id = self
            .find_snapshot(caller, id_or_name)
            .map(|s| s.id)
            .ok_or_else(|| LifecycleError::SnapshotNotFound(id_or_name.into()))?;
        self.backend.delete_snapshot(&id)?;
        if let Err(e) = self.owners.forget_snapshot(&id) {
            tracing::warn!(snapshot = %id, error = %e, "owner entry of a deleted snapshot stays until the next start");
        }
        Ok(())
    }

    /// Templates `caller` may use: the public ones and its own.
    pub fn templates(&self, caller: &Caller) -> Vec<TemplateInfo> {
        self.backend
            .templates()
            .into_iter()
            .filter(|t| {
                self.owners
                    .template_owner(&t.id)
                    .is_none_or(|o| caller.sees(&o))
            })
            .collect()
    }

    /// Builds a template owned by `caller` (minutes). A new id is the caller's; an existing one (or a
    /// name an existing template answers to) is rebuilt only by its owner. Shared templates (the base,
    /// ones the operator built) are read-only to named tenants; another tenant's are unknown to them.
    pub async fn build_template(
        &self,
        caller: &Caller,
        spec: TemplateSpec,
        progress: crate::backend::ProgressFn,
    ) -> std::result::Result<TemplateInfo, TemplateBuildError> {
        if !keys::valid_template_id(&spec.id) {
            return Err(TemplateBuildError::InvalidId(spec.id));
        }
        let id = spec.id.clone();
        let existing = self.backend.templates();
        for name in std::iter::once(&spec.id).chain(&spec.aliases) {
            let Some(t) = existing
                .iter()
                .find(|t| &t.id == name || t.aliases.contains(name))
            else {
                continue;
            };
            match self.owners.template_owner(&t.id) {
                Some(o) if caller.sees(&o) => {}
                Some(_) => return Err(TemplateBuildError::NotFound(name.clone())),
                None if caller.may_write_shared() => {}
                None => return Err(TemplateBuildError::Shared(name.clone())),
            }
        }
        let taken = existing.iter().any(|t| t.id == id);
        if !taken && let Err(e) = self.owners.set_template(&id, caller.owner()) {
            return Err(TemplateBuildError::Owner(e));
        }
        let r = self.backend.build_template(spec, progress).await;
        if r.is_err() && !taken && self.backend.templates().iter().all(|t| t.id != id) {
            let _ = self.owners.forget_template(&id);
        }
        Ok(r?)
    }
}

/// A template build through the API failed or was refused.
#[derive(Debug, thiserror::Error)]
pub enum TemplateBuildError {
    /// Not an id a tenant may choose ([`crate::keys::valid_template_id`]).
    #[error("templateID {0:?} must be 1-63 of [a-z0-9-]")]
    InvalidId(String),
    /// The name is another tenant's template: unknown to this caller.
    #[error("template {0:?} not found")]
    NotFound(String),
    /// The name is a shared template (the base, or one the operator built): read-only to tenants.
    #[error("template {0:?} is shared and read-only to this key; build under another name")]
    Shared(String),
    /// Its owner could not be recorded.
    #[error("recording the template's owner")]
    Owner(#[source] std::io::Error),
    /// The build itself failed.
    #[error(transparent)]
    Build(#[from] VmError),
}
