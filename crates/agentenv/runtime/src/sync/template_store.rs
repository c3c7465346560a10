//! Templates through the chunk store: [`Runtime::publish_template`] stores a template's base files as
//! chunks and its record as metadata (`templates/<id>`, in the bucket), and a runtime sharing the bucket
//! that lacks the template imports it on first use ([`Runtime::import_template`]): RAM and device state
//! are materialized, the disk becomes a lazy disk ([`crate::vmm::lazy`]) with
//! [`crate::config::LazyDiskMode::Auto`] (never copied here whole) or is materialized with `Off`. The record
//! appears last, so a crash mid-import leaves nothing visible.

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::LazyDiskMode;
use crate::error::TemplateError;
use crate::persist::{self, RECORD_VERSION, TemplateInfo, TemplateRecord};
use crate::vmm::lazy::{self, LazyMarker};
use crate::{Runtime, valid_id};

/// What the chunk store keeps of a template for other machines.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SharedTemplate {
    record: TemplateRecord,
    /// Build key (the folder its files are installed in).
    build: String,
    /// `disk`, `ram`, `state`: manifest ids (hex).
    manifests: BTreeMap<String, String>,
    /// Length of the disk.
    disk_len: u64,
    /// The guest kernel release and a hash of the initramfs the base snapshot was made with.
    kernel_release: String,
    initrd_hash: String,
}

fn meta_key(id: &str) -> String {
    format!("templates/{id}")
}

fn store_err(what: &'static str) -> impl Fn(agentenv_store::StoreError) -> TemplateError {
    move |source| TemplateError::Store {
        what,
        source: Box::new(source),
    }
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> TemplateError {
    let path = path.to_owned();
    move |source| TemplateError::Io { what, path, source }
}

/// A hash of the file at `path` (the initramfs: a few MB).
fn file_hash(path: &Path) -> Result<String, TemplateError> {
    let bytes = std::fs::read(path).map_err(io("read", path))?;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    Ok(format!("{:016x}", h.finish()))
}

impl Runtime {
    /// Stores template `id`'s base files (disk, RAM, device state) as chunks and its record as metadata,
    /// so runtimes sharing the store's bucket can start it without building it. Needs a bucket; a template
    /// already published with the same build is left as it is.
    pub async fn publish_template(&self, id: &str) -> Result<(), TemplateError> {
        let rec = self
            .inner
            .catalog
            .template(id)
            .ok_or_else(|| TemplateError::NotFound(id.into()))?;
        let store = self.inner.store.clone();
        if store.config().remote.is_none() {
            return Err(TemplateError::NoBucket);
        }
        let build = crate::sync::remote::template_build(&rec);
        let key = meta_key(&rec.info.id);
        if let Some(b) = store
            .get_meta(&key)
            .await
            .map_err(store_err("read template metadata"))?
            && serde_json::from_slice::<SharedTemplate>(&b).is_ok_and(|s| s.build == build)
        {
            return Ok(());
        }
        let mut manifests = BTreeMap::new();
        let mut disk_len = 0;
        for (name, path) in [
            ("disk", &rec.base_disk),
            ("ram", &rec.base_ram),
            ("state", &rec.base_state),
        ] {
            let hex = match lazy::marker(path) {
                Some(m) => {
                    disk_len = m.len;
                    m.manifest
                }
                None => {
                    let (m, _) = store
                        .ingest(path)
                        .await
                        .map_err(store_err("store template files"))?;
                    if name == "disk" {
                        disk_len = m.len;
                    }
                    m.id().to_hex()
                }
            };
            manifests.insert(name.to_string(), hex);
        }
        let shared = SharedTemplate {
            record: rec.clone(),
            build,
            manifests,
            disk_len,
            kernel_release: self.inner.kernel.release.clone(),
            initrd_hash: file_hash(&rec.machine.initrd)?,
        };
        let bytes = serde_json::to_vec(&shared).expect("template metadata serializes");
        store
            .put_meta(&key, &bytes)
            .await
            .map_err(store_err("write template metadata"))?;
        tracing::info!(template = %rec.info.id, "template published to the chunk store");
        Ok(())
    }

    /// Makes template `id_or_alias` available here: a local one as it is, else one published to the shared
    /// chunk store is imported. `Ok(None)`: neither has it.
    pub async fn import_template(
        &self,
        id_or_alias: &str,
    ) -> Result<Option<TemplateInfo>, TemplateError> {
        if let Some(t) = self.inner.catalog.template_named(id_or_alias) {
            return Ok(Some(t.info));
        }
        let _one_at_a_time = self.inner.catalog.import_lock().await;
        self.import_template_locked(id_or_alias).await
    }

    /// [`Runtime::import_template`] for a caller holding the import lock.
    pub(crate) async fn import_template_locked(
        &self,
        id_or_alias: &str,
    ) -> Result<Option<TemplateInfo>, TemplateError> {
        if let Some(t) = self.inner.catalog.template_named(id_or_alias) {
            return Ok(Some(t.info));
        }
        let Some(shared) = self.find_shared_template(id_or_alias).await? else {
            return Ok(None);
        };
        let rec = self.install_shared(shared).await?;
        Ok(Some(self.install_template(rec)))
    }

    async fn find_shared_template(
        &self,
        id_or_alias: &str,
    ) -> Result<Option<SharedTemplate>, TemplateError> {
        if !valid_id(id_or_alias) {
            return Ok(None);
        }
        let store = &self.inner.store;
        let parse = |b: Vec<u8>| {
            serde_json::from_slice::<SharedTemplate>(&b)
                .ok()
                .filter(|s| valid_id(&s.record.info.id) && valid_id(&s.build))
        };
        let read = store_err("read template metadata");
        if let Some(b) = store
            .get_meta(&meta_key(id_or_alias))
            .await
            .map_err(&read)?
            && let Some(s) = parse(b)
        {
            return Ok(Some(s));
        }
        for key in store
            .list_meta("templates/")
            .await
            .map_err(store_err("list template metadata"))?
        {
            if let Some(b) = store.get_meta(&key).await.map_err(&read)?
                && let Some(s) = parse(b)
                && s.record.info.aliases.iter().any(|a| a == id_or_alias)
            {
                return Ok(Some(s));
            }
        }
        Ok(None)
    }

    /// Writes the template's files into its folder and its record, returning the record.
    async fn install_shared(&self, s: SharedTemplate) -> Result<TemplateRecord, TemplateError> {
        let inner = &self.inner;
        let id = s.record.info.id.clone();
        let incompatible = |what: String| {
            Err(TemplateError::Incompatible(format!(
                "template {id} was made with {what}"
            )))
        };
        if s.kernel_release != inner.kernel.release
            || s.initrd_hash != file_hash(&inner.kernel.initrd)?
        {
            return incompatible(format!(
                "guest kernel {} and another initramfs than this machine's (kernel {})",
                s.kernel_release, inner.kernel.release
            ));
        }
        let cpu = crate::image::template::cpu_model(inner.vmm.accel());
        if s.record.machine.cpu.as_deref() != Some(cpu) {
            return incompatible(format!("CPU model {:?}, here {cpu}", s.record.machine.cpu));
        }
        let manifest = |name: &str| -> Result<agentenv_store::ManifestId, TemplateError> {
            s.manifests
                .get(name)
                .and_then(|h| agentenv_store::ManifestId::from_hex(h))
                .ok_or_else(|| TemplateError::MissingManifest {
                    id: id.clone(),
                    file: name.into(),
                })
        };
        let tdir = inner.cfg.state_dir.join("templates").join(&id);
        let dir = tdir.join(&s.build);
        let partial = tdir.join(format!("{}.partial", s.build));
        std::fs::create_dir_all(&tdir).map_err(io("create", &tdir))?;
        let _ = std::fs::remove_dir_all(&partial);
        let _ = std::fs::remove_dir_all(&dir);
        k3_common::fsutil::create_private_dir(&partial).map_err(io("create", &partial))?;
        let r = async {
            for (name, file) in [("ram", "base.mem"), ("state", "base.state")] {
                let m = inner
                    .store
                    .manifest(&manifest(name)?)
                    .await
                    .map_err(store_err("read template manifest"))?;
                inner
                    .store
                    .materialize(&m, &partial.join(file))
                    .await
                    .map_err(store_err("restore template files"))?;
            }
            let disk_id = manifest("disk")?;
            let disk = partial.join("base.ext4");
            match inner.cfg.lazy_disks {
                LazyDiskMode::Auto => {
                    // The manifest must be readable now; its chunks come when QEMU reads them.
                    inner
                        .store
                        .manifest(&disk_id)
                        .await
                        .map_err(store_err("read template manifest"))?;
                    let marker = LazyMarker {
                        manifest: disk_id.to_hex(),
                        len: s.disk_len,
                    };
                    lazy::write_marker(&disk, &marker).map_err(io("write", &disk))?;
                }
                LazyDiskMode::Off => {
                    let m = inner
                        .store
                        .manifest(&disk_id)
                        .await
                        .map_err(store_err("read template manifest"))?;
                    inner
                        .store
                        .materialize(&m, &disk)
                        .await
                        .map_err(store_err("restore template files"))?;
                }
            }
            Ok::<(), TemplateError>(())
        }
        .await;
        if let Err(e) = r {
            let _ = std::fs::remove_dir_all(&partial);
            return Err(e);
        }
        std::fs::rename(&partial, &dir).map_err(io("rename", &partial))?;
        let mut machine = s.record.machine.clone();
        machine.kernel = inner.kernel.vmlinux.clone();
        machine.initrd = inner.kernel.initrd.clone();
        let rec = TemplateRecord {
            version: RECORD_VERSION,
            info: s.record.info.clone(),
            machine,
            base_disk: dir.join("base.ext4"),
            base_ram: dir.join("base.mem"),
            base_state: dir.join("base.state"),
        };
        persist::write(&tdir.join("template.json"), &rec)?;
        tracing::info!(template = %id, lazy = ?inner.cfg.lazy_disks, "template imported from the chunk store");
        Ok(rec)
    }
}

/// The folder under the state folder where lazy disk exports listen.
pub(crate) fn nbd_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("nbd")
}
