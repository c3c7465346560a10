//! agentenv's VM vocabulary: what the runtime (`agentenv-runtime`) is asked for and reports, shared
//! with the lifecycle (`agentenv-control`) without linking QEMU, the chunk store or HTTP.
//!
//! - ids and names: [`valid_id`], [`normalize_name`];
//! - sandboxes: [`CreateSpec`], [`SandboxVm`], [`RecoveredVm`], [`VmState`];
//! - [`template`]: [`TemplateSpec`], [`TemplateInfo`], build progress;
//! - [`snapshot`]: [`SnapshotInfo`], [`SnapshotMode`];
//! - [`egress`]: a sandbox's [`EgressPolicy`], its network facts and counters.

use std::collections::BTreeMap;

pub mod egress;
pub mod snapshot;
pub mod template;
pub mod volume_bucket;

pub use egress::{
    EgressError, EgressPolicy, HeaderRule, NetLimits, NetStats, NetworkInfo, Sample, Target,
};
pub use snapshot::{SnapshotInfo, SnapshotMode, StoredChunks};
pub use template::{BuildProgress, BuildStep, ImageSource, TemplateInfo, TemplateSpec};

/// Visible state of a sandbox VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmState {
    /// The guest runs and its agent answers.
    Running,
    /// Stopped with memory and processes kept on disk; no VMM process.
    Paused,
}

/// What [`Runtime::create`] asks for.
#[derive(Debug, Clone, Default)]
pub struct CreateSpec {
    /// Sandbox id chosen by the caller (`[A-Za-z0-9_.-]`, at most 64 characters).
    pub sandbox_id: String,
    /// Template id or alias, or snapshot id or `name[:tag]`.
    pub template_id: String,
    /// Environment variables for every process (sent to envd `POST /init`).
    pub env_vars: BTreeMap<String, String>,
    /// Egress policy; `None`: no network asked for (the NIC stays unplugged).
    pub network: Option<EgressPolicy>,
}

/// A created sandbox VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxVm {
    /// Sandbox id.
    pub id: String,
    /// Template id (resolved from an alias).
    pub template_id: String,
    /// vCPUs.
    pub vcpus: u32,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// envd version of the template.
    pub envd_version: String,
}

/// The outcome of [`Runtime::recover`] for one sandbox record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveredVm {
    /// Sandbox id.
    pub id: String,
    /// Template id.
    pub template_id: String,
    /// `Some` when kept (re-attached running, or paused); `None` when it was dead or half-created and removed.
    pub state: Option<VmState>,
    /// What happened, for logs.
    pub detail: String,
}

/// True for ids of 1..=64 characters from `[A-Za-z0-9_.-]` that do not start with a dot.
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && !id.starts_with('.')
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

/// The default tag of a name given without one.
pub const DEFAULT_TAG: &str = "default";

/// Normalises `name[:tag]` to `name:tag`, or `None` when either part is not a valid id.
pub fn normalize_name(name: &str) -> Option<String> {
    let (n, t) = name.split_once(':').unwrap_or((name, DEFAULT_TAG));
    (valid_id(n) && valid_id(t)).then(|| format!("{n}:{t}"))
}
