//! The template and snapshot records this runtime holds: one owner for both maps, for the rule that a
//! snapshot name (`name:tag`) belongs to one live snapshot at a time, and for the lock that takes
//! imports from the shared store one at a time. Records are written through (`snapshot.json` in
//! `<snapshots>/<id>/`) before a change is visible.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use agentenv_vm::normalize_name;

use crate::persist::{self, PersistError, SnapshotRecord, TemplateInfo, TemplateRecord};

pub(crate) struct Catalog {
    templates: RwLock<BTreeMap<String, TemplateRecord>>,
    snapshots: RwLock<BTreeMap<String, SnapshotRecord>>,
    /// `<state>/snapshots`: one folder per snapshot.
    snapshots_dir: PathBuf,
    imports: tokio::sync::Mutex<()>,
    /// Snapshots deleted here whose delete has not landed in the shared store, which lists them until then.
    deleted: Mutex<BTreeSet<String>>,
}

impl Catalog {
    /// The catalog of loaded records. A name that two live snapshots hold (a crash between writing
    /// one's record and the other's) stays with the newest, and the others' records are rewritten.
    pub(crate) fn new(
        templates: BTreeMap<String, TemplateRecord>,
        mut snapshots: BTreeMap<String, SnapshotRecord>,
        snapshots_dir: PathBuf,
    ) -> Catalog {
        let mut newest: BTreeMap<String, (String, String)> = BTreeMap::new();
        for s in snapshots.values().filter(|s| !s.deleted) {
            for n in &s.names {
                let mine = (s.created_at.clone(), s.id.clone());
                let held = newest.entry(n.clone()).or_insert_with(|| mine.clone());
                *held = held.clone().max(mine);
            }
        }
        for s in snapshots.values_mut().filter(|s| !s.deleted) {
            let before = s.names.len();
            s.names
                .retain(|n| newest.get(n).is_some_and(|(_, id)| *id == s.id));
            if s.names.len() != before {
                tracing::warn!(snapshot = %s.id, "a name another snapshot holds too left it");
                let path = snapshots_dir.join(&s.id).join("snapshot.json");
                if let Err(e) = persist::write(&path, &*s) {
                    tracing::error!(snapshot = %s.id, error = %e, "rewriting a snapshot record");
                }
            }
        }
        Catalog {
            templates: RwLock::new(templates),
            snapshots: RwLock::new(snapshots),
            snapshots_dir,
            imports: tokio::sync::Mutex::new(()),
            deleted: Mutex::new(BTreeSet::new()),
        }
    }

    fn t(&self) -> RwLockReadGuard<'_, BTreeMap<String, TemplateRecord>> {
        self.templates.read().unwrap_or_else(|e| e.into_inner())
    }
    fn s(&self) -> RwLockReadGuard<'_, BTreeMap<String, SnapshotRecord>> {
        self.snapshots.read().unwrap_or_else(|e| e.into_inner())
    }
    fn s_mut(&self) -> RwLockWriteGuard<'_, BTreeMap<String, SnapshotRecord>> {
        self.snapshots.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Holds imports from the shared store to one at a time while the guard lives.
    pub(crate) async fn import_lock(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.imports.lock().await
    }

    pub(crate) fn snapshots_dir(&self) -> &Path {
        &self.snapshots_dir
    }

    fn record_path(&self, id: &str) -> PathBuf {
        self.snapshots_dir.join(id).join("snapshot.json")
    }

    /// The template with id `id`.
    pub(crate) fn template(&self, id: &str) -> Option<TemplateRecord> {
        self.t().get(id).cloned()
    }

    /// The template with id or alias `id_or_alias` (what the shared store is searched by).
    pub(crate) fn template_named(&self, id_or_alias: &str) -> Option<TemplateRecord> {
        let t = self.t();
        t.get(id_or_alias)
            .or_else(|| {
                t.values()
                    .find(|r| r.info.aliases.iter().any(|a| a == id_or_alias))
            })
            .cloned()
    }

    pub(crate) fn template_infos(&self) -> Vec<TemplateInfo> {
        self.t().values().map(|t| t.info.clone()).collect()
    }

    /// Makes `rec` the template of its id (replacing an older one).
    pub(crate) fn put_template(&self, rec: TemplateRecord) -> TemplateInfo {
        let info = rec.info.clone();
        self.templates
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(info.id.clone(), rec);
        info
    }

    /// The live snapshot with id `id`.
    pub(crate) fn snapshot(&self, id: &str) -> Option<SnapshotRecord> {
        self.s().get(id).filter(|s| !s.deleted).cloned()
    }

    /// The snapshot with id `id`, deleted (hidden) ones included.
    pub(crate) fn snapshot_any(&self, id: &str) -> Option<SnapshotRecord> {
        self.s().get(id).cloned()
    }

    /// The live snapshot with id `name`, or named `name[:tag]`.
    pub(crate) fn snapshot_named(&self, name: &str) -> Option<SnapshotRecord> {
        let map = self.s();
        if let Some(s) = map.get(name).filter(|s| !s.deleted) {
            return Some(s.clone());
        }
        let n = normalize_name(name)?;
        map.values()
            .find(|s| !s.deleted && s.names.contains(&n))
            .cloned()
    }

    /// Live snapshots, by id.
    pub(crate) fn live_snapshots(&self) -> Vec<SnapshotRecord> {
        self.s().values().filter(|s| !s.deleted).cloned().collect()
    }

    /// Installs `snap`, a committed capture or import; its names leave every other snapshot first.
    pub(crate) fn put_snapshot(&self, snap: SnapshotRecord) -> Result<(), PersistError> {
        let mut map = self.s_mut();
        self.take_names(&mut map, &snap.id, &snap.names)?;
        map.insert(snap.id.clone(), snap);
        Ok(())
    }

    /// Installs `rec`, imported from the shared store, without its names that a local snapshot holds
    /// (the local holder keeps them; the record is written with the names left).
    pub(crate) fn put_imported(
        &self,
        rec: &SnapshotRecord,
    ) -> Result<SnapshotRecord, PersistError> {
        let mut map = self.s_mut();
        let mut rec = rec.clone();
        let held = |n: &String| {
            map.values()
                .any(|o| o.id != rec.id && !o.deleted && o.names.contains(n))
        };
        let before = rec.names.len();
        rec.names = rec.names.iter().filter(|n| !held(n)).cloned().collect();
        if rec.names.len() != before {
            persist::write(&self.record_path(&rec.id), &rec)?;
        }
        map.insert(rec.id.clone(), rec.clone());
        Ok(rec)
    }

    /// Moves `names` off every snapshot but `keep`, writing each changed record.
    fn take_names(
        &self,
        map: &mut BTreeMap<String, SnapshotRecord>,
        keep: &str,
        names: &[String],
    ) -> Result<(), PersistError> {
        for other in map.values_mut().filter(|o| o.id != keep) {
            if other.names.iter().any(|n| names.contains(n)) {
                other.names.retain(|n| !names.contains(n));
                persist::write(&self.record_path(&other.id), &*other)?;
            }
        }
        Ok(())
    }

    /// Gives live snapshot `id` the (normalized) names `add`, moved from any snapshot holding them,
    /// and takes `remove` from it. `None` when there is no such snapshot. Its record is written
    /// first: a crash before the others' leaves a name twice, which loading settles, never none.
    pub(crate) fn rename(
        &self,
        id: &str,
        add: Vec<String>,
        remove: &[String],
    ) -> Result<Option<SnapshotRecord>, PersistError> {
        let mut map = self.s_mut();
        if map.get(id).is_none_or(|s| s.deleted) {
            return Ok(None);
        }
        let s = map.get_mut(id).expect("checked above");
        s.names.retain(|n| !remove.contains(n));
        for n in &add {
            if !s.names.contains(n) {
                s.names.push(n.clone());
            }
        }
        persist::write(&self.record_path(id), &*s)?;
        let out = s.clone();
        self.take_names(&mut map, id, &add)?;
        Ok(Some(out))
    }

    /// Hides live snapshot `id` (deleted, no names), written before it returns; `None` when there is
    /// no such snapshot. Its files stay until [`Catalog::collect`] finds nothing depends on them.
    pub(crate) fn mark_deleted(&self, id: &str) -> Result<Option<SnapshotRecord>, PersistError> {
        let mut map = self.s_mut();
        let Some(s) = map.get_mut(id).filter(|s| !s.deleted) else {
            return Ok(None);
        };
        s.deleted = true;
        s.names.clear();
        persist::write(&self.record_path(id), &*s)?;
        self.deleted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_string());
        Ok(Some(s.clone()))
    }

    /// Whether snapshot `id` was deleted here and the shared store may still list it (its record may be
    /// gone already).
    pub(crate) fn deleted_here(&self, id: &str) -> bool {
        self.deleted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(id)
    }

    /// Snapshot `id`'s delete reached the shared store. Waits for a running import, which may have read
    /// the store before.
    pub(crate) async fn delete_landed(&self, id: &str) {
        let _no_import = self.imports.lock().await;
        self.deleted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
    }

    /// Takes out the deleted snapshots that neither `needed` nor a snapshot's parent names; their
    /// records leave the map (the caller removes their files).
    pub(crate) fn collect(
        &self,
        mut needed: std::collections::BTreeSet<String>,
    ) -> Vec<SnapshotRecord> {
        let mut map = self.s_mut();
        needed.extend(map.values().filter_map(|s| s.parent.clone()));
        let dead: Vec<String> = map
            .values()
            .filter(|s| s.deleted && !needed.contains(&s.id))
            .map(|s| s.id.clone())
            .collect();
        dead.iter().filter_map(|id| map.remove(id)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(id: &str, names: &[&str]) -> SnapshotRecord {
        let mut s = crate::lifecycle::snapshot::tests::record(Path::new("/nowhere"), None);
        s.id = id.into();
        s.names = names.iter().map(|n| n.to_string()).collect();
        s
    }

    fn catalog() -> (tempfile::TempDir, Catalog) {
        let dir = tempfile::tempdir().unwrap();
        let c = Catalog::new(BTreeMap::new(), BTreeMap::new(), dir.path().to_path_buf());
        (dir, c)
    }

    fn put(c: &Catalog, s: SnapshotRecord) {
        std::fs::create_dir_all(c.snapshots_dir().join(&s.id)).unwrap();
        c.put_snapshot(s).unwrap();
    }

    fn on_disk(c: &Catalog, id: &str) -> SnapshotRecord {
        persist::read(&c.record_path(id)).unwrap()
    }

    #[test]
    fn a_name_found_twice_at_load_stays_with_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        let mut old = snap("a", &["app:default", "a:1"]);
        old.created_at = "2026-12-01T00:00:00.000Z".into();
        let mut new = snap("b", &["app:default"]);
        new.created_at = "2026-12-02T00:00:00.000Z".into();
        let mut map = BTreeMap::new();
        for s in [old, new] {
            std::fs::create_dir_all(dir.path().join(&s.id)).unwrap();
            map.insert(s.id.clone(), s);
        }
        let c = Catalog::new(BTreeMap::new(), map, dir.path().to_path_buf());
        assert_eq!(c.snapshot_named("app").unwrap().id, "b");
        assert_eq!(c.snapshot("a").unwrap().names, ["a:1"]);
        assert_eq!(on_disk(&c, "a").names, ["a:1"], "settled on disk");
    }

    #[test]
    fn a_name_belongs_to_one_live_snapshot_and_moves_are_written() {
        let (_d, c) = catalog();
        let tag = |n: &str| normalize_name(n).unwrap();
        put(&c, snap("a", &["app:default"]));
        persist::write(&c.record_path("a"), &c.snapshot("a").unwrap()).unwrap();
        put(&c, snap("b", &["app:default"]));
        assert!(c.snapshot("a").unwrap().names.is_empty());
        assert!(on_disk(&c, "a").names.is_empty(), "the move is on disk");
        assert_eq!(c.snapshot_named("app").unwrap().id, "b");
        assert_eq!(c.snapshot_named("b").unwrap().id, "b");

        let r = c
            .rename("a", vec![tag("app"), tag("x:1")], &[])
            .unwrap()
            .unwrap();
        assert_eq!(r.names, [tag("app"), tag("x:1")]);
        assert!(on_disk(&c, "b").names.is_empty());
        assert_eq!(on_disk(&c, "a").names, r.names);
        assert!(c.rename("nope", vec![], &[]).unwrap().is_none());
    }

    #[test]
    fn an_import_leaves_a_local_name_to_its_holder() {
        let (_d, c) = catalog();
        put(&c, snap("local", &["app:default"]));
        let mut far = snap("far", &["app:default", "other:v1"]);
        std::fs::create_dir_all(c.snapshots_dir().join("far")).unwrap();
        persist::write(&c.record_path("far"), &far).unwrap();
        let got = c.put_imported(&far).unwrap();
        assert_eq!(got.names, ["other:v1"]);
        assert_eq!(on_disk(&c, "far").names, ["other:v1"]);
        assert_eq!(c.snapshot_named("app").unwrap().id, "local");
        far.names.clear();
        assert_eq!(c.put_imported(&far).unwrap().names, Vec::<String>::new());
    }

    #[test]
    fn deleted_snapshots_hide_at_once_and_go_when_nothing_needs_them() {
        let (_d, c) = catalog();
        put(&c, snap("p", &["p:latest"]));
        let mut child = snap("c", &[]);
        child.parent = Some("p".into());
        put(&c, child);
        assert!(c.mark_deleted("p").unwrap().is_some());
        assert!(c.mark_deleted("p").unwrap().is_none(), "already gone");
        assert!(c.snapshot("p").is_none() && c.snapshot_named("p:latest").is_none());
        assert!(c.snapshot_any("p").is_some_and(|s| s.deleted));
        assert!(on_disk(&c, "p").deleted);
        assert!(c.collect(Default::default()).is_empty(), "a child needs it");
        assert!(c.collect(["p".to_string()].into()).is_empty());
        c.mark_deleted("c").unwrap();
        let gone: Vec<String> = c
            .collect(Default::default())
            .into_iter()
            .map(|s| s.id)
            .collect();
        assert_eq!(gone, ["c"], "the parent goes on the next round");
        let gone: Vec<String> = c
            .collect(Default::default())
            .into_iter()
            .map(|s| s.id)
            .collect();
        assert_eq!(gone, ["p"]);
        assert!(c.live_snapshots().is_empty());
        assert!(c.snapshot_any("p").is_none(), "its record is collected");
        assert!(
            c.deleted_here("p") && c.deleted_here("c") && !c.deleted_here("x"),
            "an import must not bring it back"
        );
    }
}
