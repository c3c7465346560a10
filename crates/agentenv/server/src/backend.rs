//! The VM side as the server sees it: one small object-safe trait in the runtime's own types, implemented
//! by `agentenv_runtime::Runtime` (`runtime_backend.rs`) and, for millisecond lifecycle tests, by an
//! in-memory fake (`fake.rs`).
//!
//! Boundary: the server never sees QEMU, QMP or snapshot files; the runtime never sees HTTP or E2B JSON.

use std::future::Future;
use std::pin::Pin;

pub use agentenv_envd::{ExecEvent, ExecRequest};
pub use agentenv_runtime::error::NetworkError;
pub use agentenv_runtime::net::EgressPolicy;
pub use agentenv_runtime::network::{NetworkInfo, Sample};
pub use agentenv_runtime::{
    BuildProgress, BuildStep, ConnectError, CreateError, CreateSpec, KillError, PauseError,
    RecoverError, RecoveredVm, ResumeError, SandboxVm, SnapshotError, SnapshotInfo, SnapshotMode,
    TemplateError, TemplateInfo, TemplateSpec, VmState,
};
use tokio::io::{AsyncRead, AsyncWrite};

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
pub type ForkResults = Vec<Result<SandboxVm, CreateError>>;

/// The VM operations the API server uses.
pub trait VmBackend: Send + Sync + 'static {
    /// "KVM" or "TCG".
    fn accel_name(&self) -> String;
    fn templates(&self) -> Vec<TemplateInfo>;
    fn build_template(
        &self,
        spec: TemplateSpec,
        progress: ProgressFn,
    ) -> BoxFuture<'_, Result<TemplateInfo, TemplateError>>;
    /// Returns once envd in the guest answers. `spec.template_id` names a template or a snapshot.
    fn create(&self, spec: CreateSpec) -> BoxFuture<'_, Result<SandboxVm, CreateError>>;
    fn pause<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), PauseError>>;
    fn resume<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), ResumeError>>;
    fn kill<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), KillError>>;
    fn open_agent_stream<'a>(
        &'a self,
        id: &'a str,
    ) -> BoxFuture<'a, Result<AgentStream, ConnectError>>;
    /// After a restart: every VM record of the previous process, kept (with its state) or removed.
    fn recover(&self) -> BoxFuture<'_, Result<Vec<RecoveredVm>, RecoverError>>;
    fn vm_state(&self, id: &str) -> Option<VmState>;
    fn snapshot<'a>(
        &'a self,
        sandbox_id: &'a str,
        snapshot_id: &'a str,
        names: &'a [String],
        mode: SnapshotMode,
    ) -> BoxFuture<'a, Result<SnapshotInfo, SnapshotError>>;
    fn snapshots(&self) -> Vec<SnapshotInfo>;
    /// Makes snapshot `id_or_name` available, importing it from a chunk store shared with other machines
    /// where this one lacks it. `Ok(None)`: nowhere.
    fn import_snapshot<'a>(
        &'a self,
        id_or_name: &'a str,
    ) -> BoxFuture<'a, Result<Option<SnapshotInfo>, SnapshotError>>;
    fn delete_snapshot(&self, id: &str) -> Result<(), SnapshotError>;
    fn fork<'a>(
        &'a self,
        sandbox_id: &'a str,
        ids: &'a [String],
    ) -> BoxFuture<'a, Result<ForkResults, SnapshotError>>;
    /// Replaces a sandbox's egress policy, without a restart.
    fn set_network<'a>(
        &'a self,
        id: &'a str,
        policy: EgressPolicy,
    ) -> BoxFuture<'a, Result<(), NetworkError>>;
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
    ) -> BoxFuture<'a, Result<(i32, String), ConnectError>>;
    /// A resource sample of a running sandbox (guest CPU, memory, disk; network counters).
    fn sample<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Sample, ConnectError>>;
}
