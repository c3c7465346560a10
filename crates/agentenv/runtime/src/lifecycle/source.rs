//! What a sandbox starts from: a template's base snapshot or a user snapshot, and how its memory
//! comes back.

use std::path::{Path, PathBuf};

use crate::SandboxVm;
use crate::persist;

/// What a sandbox starts from: a template's base snapshot or a user snapshot.
#[derive(Clone)]
pub(crate) struct Image {
    pub(crate) template_id: String,
    pub(crate) machine: persist::MachineRecord,
    /// Backing file of the new disk overlay.
    pub(crate) disk: PathBuf,
    pub(crate) start: ImageStart,
    pub(crate) parent: Option<String>,
    pub(crate) envd_version: String,
}

#[derive(Clone)]
pub(crate) enum ImageStart {
    /// Copy `ram` into the sandbox's own shared RAM file, then load the RAM-less `state`.
    CopyRam { ram: PathBuf, state: PathBuf },
    /// Map `ram` private copy-on-write (shared by every sandbox restored from it), load `state`.
    CowRam { ram: PathBuf, state: PathBuf },
    /// `state` carries the RAM: load it into private memory.
    Stream { state: PathBuf },
    /// Filesystem only: cold boot.
    Boot,
}

impl Image {
    /// What a create of sandbox `id` from this image returns.
    pub(crate) fn vm(&self, id: &str) -> SandboxVm {
        SandboxVm {
            id: id.to_owned(),
            template_id: self.template_id.clone(),
            vcpus: self.machine.vcpus,
            memory_mib: self.machine.memory_mib,
            envd_version: self.envd_version.clone(),
        }
    }

    /// The RAM file a create copies, for images started from a copy of their RAM.
    pub(crate) fn ram_copied(&self) -> Option<&Path> {
        match &self.start {
            ImageStart::CopyRam { ram, .. } => Some(ram),
            _ => None,
        }
    }
}
