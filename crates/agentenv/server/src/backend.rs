//! The VM side as the server sees it: one small object-safe trait, implemented by the
//! real `agentenv_runtime::Runtime` in `runtime_backend.rs`.
//!
//! Boundary: the server never sees QEMU, QMP or snapshots; the runtime never sees HTTP or E2B JSON.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;

use tokio::io::{AsyncRead, AsyncWrite};

/// A boxed future, so the trait stays object safe.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One byte stream to the guest's envd (HTTP/1.1 is spoken over it).
pub trait AgentIo: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> AgentIo for T {}

/// A boxed agent stream.
pub type AgentStream = Box<dyn AgentIo>;

/// Whether a VM is running or paused, as the runtime reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmRunState {
    Running,
    Paused,
}

/// A template as the server needs it.
#[derive(Debug, Clone, PartialEq)]
pub struct TemplateFacts {
    pub id: String,
    pub aliases: Vec<String>,
    pub vcpus: u32,
    pub memory_mib: u32,
    pub disk_mib: u32,
    /// RFC 3339 UTC.
    pub built_at: String,
    pub envd_version: String,
}

/// What to build.
#[derive(Debug, Clone)]
pub struct TemplateBuild {
    pub id: String,
    pub aliases: Vec<String>,
    pub vcpus: Option<u32>,
    pub memory_mib: Option<u32>,
    pub disk_mib: Option<u32>,
}

/// How a runtime failure maps onto HTTP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendErrorKind {
    NotFound,
    Conflict,
    BadRequest,
    Internal,
}

/// A runtime failure with its text.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct BackendError {
    pub kind: BackendErrorKind,
    pub message: String,
}

impl BackendError {
    pub fn new(kind: BackendErrorKind, message: impl Into<String>) -> Self {
        BackendError {
            kind,
            message: message.into(),
        }
    }
}

/// The VM operations the API server uses.
pub trait VmBackend: Send + Sync + 'static {
    /// "KVM" or "TCG".
    fn accel_name(&self) -> String;
    fn templates(&self) -> Vec<TemplateFacts>;
    fn build_template(
        &self,
        build: TemplateBuild,
    ) -> BoxFuture<'_, Result<TemplateFacts, BackendError>>;
    /// Returns once envd in the guest answers.
    fn create<'a>(
        &'a self,
        sandbox_id: &'a str,
        template_id: &'a str,
        env_vars: BTreeMap<String, String>,
    ) -> BoxFuture<'a, Result<(), BackendError>>;
    fn pause<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), BackendError>>;
    fn resume<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), BackendError>>;
    fn kill<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), BackendError>>;
    fn open_agent_stream<'a>(
        &'a self,
        id: &'a str,
    ) -> BoxFuture<'a, Result<AgentStream, BackendError>>;
    /// After a restart: the VMs that still exist, with their state.
    fn recover(&self) -> BoxFuture<'_, Result<Vec<(String, VmRunState)>, BackendError>>;
    fn vm_state(&self, id: &str) -> Option<VmRunState>;
}
