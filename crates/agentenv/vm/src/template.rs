//! Templates: what to build, how a build goes, and what a built one is.

use serde::{Deserialize, Serialize};

/// What to build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateSpec {
    /// Template id (`[A-Za-z0-9_.-]`, at most 64 characters).
    pub id: String,
    /// Other names.
    pub aliases: Vec<String>,
    /// vCPUs per sandbox.
    pub vcpus: u32,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// Root disk size in MiB (sparse); grown to fit an image.
    pub disk_mib: u64,
    /// Build the root file system from this OCI image instead of Debian's minbase.
    pub from_image: Option<ImageSource>,
}

/// An OCI image to build a template from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ImageSource {
    /// `registry[:port]/repo[:tag|@sha256:...]` (Docker Hub defaults).
    pub reference: String,
    /// Basic or token-service credentials.
    pub username: Option<String>,
    /// Password or token.
    pub password: Option<String>,
}

/// Bounds of a template's machine: vCPUs, RAM and disk.
pub const TEMPLATE_VCPUS: std::ops::RangeInclusive<u32> = 1..=64;
pub const TEMPLATE_MEMORY_MIB: std::ops::RangeInclusive<u64> = 128..=16_384;
pub const TEMPLATE_DISK_MIB: std::ops::RangeInclusive<u64> = 512..=65_536;

impl TemplateSpec {
    /// Refuses machine sizes outside [`TEMPLATE_VCPUS`], [`TEMPLATE_MEMORY_MIB`] and [`TEMPLATE_DISK_MIB`],
    /// saying which.
    pub fn check_size(&self) -> Result<(), String> {
        if TEMPLATE_VCPUS.contains(&self.vcpus)
            && TEMPLATE_MEMORY_MIB.contains(&self.memory_mib)
            && TEMPLATE_DISK_MIB.contains(&self.disk_mib)
        {
            return Ok(());
        }
        Err(format!(
            "vcpus {} ({:?}), memory {} MiB ({:?}), disk {} MiB ({:?})",
            self.vcpus,
            TEMPLATE_VCPUS,
            self.memory_mib,
            TEMPLATE_MEMORY_MIB,
            self.disk_mib,
            TEMPLATE_DISK_MIB
        ))
    }

    /// The default template: id `base`, 1 vCPU, 256 MiB RAM, 4 GiB disk (about 1.1 GiB used), Debian
    /// bookworm with `rootfs::PACKAGES`.
    pub fn base() -> TemplateSpec {
        TemplateSpec {
            id: "base".into(),
            aliases: vec![],
            vcpus: 1,
            memory_mib: 256,
            disk_mib: 4096,
            from_image: None,
        }
    }
}

/// Steps of a template build, reported through the progress callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuildStep {
    /// A cached build with the same inputs is reused.
    Cached,
    /// debootstrap (cached after the first run).
    Userland,
    /// Pulling and unpacking an OCI image (detail: layer progress).
    Pull,
    /// mkfs.ext4 of the root image.
    Image,
    /// Cold boot of the template VM until the guest agent answers.
    Boot,
    /// Saving the base snapshot.
    Snapshot,
    /// Storing it in the chunk store's bucket, for runtimes sharing the bucket.
    Publish,
    /// Installed and ready.
    Done,
}

/// One progress report.
#[derive(Debug, Clone)]
pub struct BuildProgress {
    /// Current step.
    pub step: BuildStep,
    /// Human-readable detail.
    pub detail: String,
    /// Bytes done and in all, where the step counts them (an image pull: every layer's blob).
    pub bytes: Option<(u64, u64)>,
}

impl BuildProgress {
    /// A report of `step` that counts no bytes.
    pub fn step(step: BuildStep, detail: String) -> BuildProgress {
        BuildProgress {
            step,
            detail,
            bytes: None,
        }
    }
}

/// Public facts about a template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateInfo {
    /// Template id (`base` for the default one).
    pub id: String,
    /// Other names the template answers to.
    pub aliases: Vec<String>,
    /// vCPUs of every sandbox created from it.
    pub vcpus: u32,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// Root disk size in MiB.
    pub disk_mib: u64,
    /// RFC 3339 build time.
    pub built_at: String,
    /// envd protocol version the guest agent implements (E2B `envdVersion`).
    pub envd_version: String,
    /// The OCI image it was built from (`reference@digest`), if any.
    #[serde(default)]
    pub from_image: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_sizes_are_bounded() {
        assert!(TemplateSpec::base().check_size().is_ok());
        let with = |f: &dyn Fn(&mut TemplateSpec)| {
            let mut t = TemplateSpec::base();
            f(&mut t);
            t.check_size()
        };
        let big = rand::random_range(1u64..1 << 40);
        for bad in [
            with(&|t| t.vcpus = 0),
            with(&|t| t.vcpus = 65),
            with(&|t| t.memory_mib = 64),
            with(&|t| t.memory_mib = 16_385 + big),
            with(&|t| t.disk_mib = 511),
            with(&|t| t.disk_mib = 65_537 + big),
        ] {
            assert!(bad.as_ref().is_err_and(|e| e.contains("vcpus")), "{bad:?}");
        }
        assert!(with(&|t| t.memory_mib = 16_384).is_ok());
    }
}
