//! The VM side as the lifecycle sees it: one small object-safe trait in `agentenv-vm`'s vocabulary and
//! one error, [`VmError`]. The `agentenv` binary implements it over `agentenv_runtime::Runtime`; an
//! in-memory fake (`fake.rs`, feature `fake`) implements it for millisecond lifecycle tests.
//!
//! Boundary: the lifecycle never sees QEMU, QMP or snapshot files; the runtime never sees tenants,
//! HTTP or E2B JSON.

use std::future::Future;
use std::pin::Pin;

pub use agentenv_envd::{ExecEvent, ExecRequest};
pub use agentenv_vm::{
    BuildProgress, BuildStep, CreateSpec, EgressPolicy, ImageSource, NetworkInfo, RecoveredVm,
    Sample, SandboxVm, SnapshotInfo, SnapshotMode, TemplateInfo, TemplateSpec, VmState,
};
use tokio::io::{AsyncRead, AsyncWrite};

/// The error chain of a backend failure, kept typed.
pub type Cause = Box<dyn std::error::Error + Send + Sync>;

/// Why a backend call failed, as far as the lifecycle tells cases apart. The backend decides the
/// case once; the cause keeps its error chain.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("sandbox {0} was not found")]
    SandboxNotFound(String),
    #[error("template '{0}' not found")]
    TemplateNotFound(String),
    #[error("snapshot '{0}' not found")]
    SnapshotNotFound(String),
    #[error("sandbox {0} is already paused")]
    AlreadyPaused(String),
    #[error("sandbox {0} is not paused")]
    NotPaused(String),
    #[error("sandbox {0} is paused")]
    Paused(String),
    /// Input the backend refuses (an id, a name, a template's size or image).
    #[error(transparent)]
    Invalid(Cause),
    /// Sandboxes get no network on this host.
    #[error(transparent)]
    NetworkUnavailable(Cause),
    /// No room for another VM now (every VM uid taken, ...); retrying later may work.
    #[error(transparent)]
    NoCapacity(Cause),
    /// Anything else.
    #[error(transparent)]
    Failed(Cause),
}

impl VmError {
    /// An [`VmError::Invalid`] saying `why`.
    pub fn invalid(why: impl Into<String>) -> VmError {
        VmError::Invalid(why.into().into())
    }
}

/// A backend call's result.
pub type VmResult<T> = Result<T, VmError>;

/// A boxed future, so the trait stays object safe.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One byte stream to the guest's envd (HTTP/1.1 is spoken over it).
pub trait AgentIo: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> AgentIo for T {}

/// A boxed agent stream.
pub type AgentStream = Box<dyn AgentIo>;

/// Where a template build reports its progress (a streaming caller, or nobody).
pub type ProgressFn = std::sync::Arc<dyn Fn(BuildProgress) + Send + Sync>;

/// One result per requested fork.
pub type ForkResults = Vec<VmResult<SandboxVm>>;

/// The VM operations the API server uses.
pub trait VmBackend: Send + Sync + 'static {
    /// "KVM" or "TCG".
    fn accel_name(&self) -> String;
    fn templates(&self) -> Vec<TemplateInfo>;
    fn build_template(
        &self,
        spec: TemplateSpec,
        progress: ProgressFn,
    ) -> BoxFuture<'_, VmResult<TemplateInfo>>;
    /// Returns once envd in the guest answers. `spec.template_id` names a template or a snapshot.
    fn create(&self, spec: CreateSpec) -> BoxFuture<'_, VmResult<SandboxVm>>;
    /// Pauses a running VM: with `memory`, its memory and processes are kept (a resume continues
    /// them); without, only its disk (a resume cold-boots it).
    fn pause<'a>(&'a self, id: &'a str, memory: bool) -> BoxFuture<'a, VmResult<()>>;
    /// Resumes a paused VM; one paused without memory cold-boots and then takes `env_vars`.
    fn resume<'a>(
        &'a self,
        id: &'a str,
        env_vars: &'a std::collections::BTreeMap<String, String>,
    ) -> BoxFuture<'a, VmResult<()>>;
    fn kill<'a>(&'a self, id: &'a str) -> BoxFuture<'a, VmResult<()>>;
    fn open_agent_stream<'a>(&'a self, id: &'a str) -> BoxFuture<'a, VmResult<AgentStream>>;
    /// After a restart: every VM record of the previous process, kept (with its state) or removed.
    fn recover(&self) -> BoxFuture<'_, VmResult<Vec<RecoveredVm>>>;
    fn vm_state(&self, id: &str) -> Option<VmState>;
    fn snapshot<'a>(
        &'a self,
        sandbox_id: &'a str,
        snapshot_id: &'a str,
        names: &'a [String],
        mode: SnapshotMode,
    ) -> BoxFuture<'a, VmResult<SnapshotInfo>>;
    fn snapshots(&self) -> Vec<SnapshotInfo>;
    /// Makes snapshot `id_or_name` available, importing it from a chunk store shared with other machines
    /// where this one lacks it. `Ok(None)`: nowhere.
    fn import_snapshot<'a>(
        &'a self,
        id_or_name: &'a str,
    ) -> BoxFuture<'a, VmResult<Option<SnapshotInfo>>>;
    fn delete_snapshot(&self, id: &str) -> VmResult<()>;
    /// Gives snapshot `id` the names `add` (moved from any snapshot holding one) and takes `remove`.
    fn rename_snapshot(
        &self,
        id: &str,
        add: &[String],
        remove: &[String],
    ) -> VmResult<SnapshotInfo>;
    fn fork<'a>(
        &'a self,
        sandbox_id: &'a str,
        ids: &'a [String],
    ) -> BoxFuture<'a, VmResult<ForkResults>>;
    /// Replaces a sandbox's egress policy, without a restart.
    fn set_network<'a>(&'a self, id: &'a str, policy: EgressPolicy) -> BoxFuture<'a, VmResult<()>>;
    /// A sandbox's address and policy; `None` without a network.
    fn network<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Option<NetworkInfo>>;
    /// Why sandboxes get no network, or `None` when they do.
    fn networking_off(&self) -> Option<String>;
    /// Runs one command in a running sandbox to its end (or starts it in the background), handing
    /// its output to `on_event`; the exit code and status text (template builds).
    fn exec<'a>(
        &'a self,
        id: &'a str,
        req: ExecRequest,
        deadline: std::time::Duration,
        on_event: Box<dyn FnMut(ExecEvent) + Send + 'a>,
    ) -> BoxFuture<'a, VmResult<(i32, String)>>;
    /// A resource sample of a running sandbox (guest CPU, memory, disk; network counters).
    fn sample<'a>(&'a self, id: &'a str) -> BoxFuture<'a, VmResult<Sample>>;
}
