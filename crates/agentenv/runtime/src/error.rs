//! One error enum per runtime operation.

use std::path::PathBuf;

use crate::agent::AgentError;
use crate::image::rootfs::RootfsError;
use crate::persist::PersistError;
use crate::vmm::VmmError;
use crate::vmm::kernel::KernelError;

/// [`crate::Runtime::open`] failed.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The chunk store could not be opened.
    #[error("chunk store: {0}")]
    Store(#[from] agentenv_store::StoreError),
    /// The state folder could not be created or read.
    #[error("state folder {path}: {source}")]
    StateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The guest kernel could not be prepared.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// A template record is unreadable.
    #[error(transparent)]
    Record(#[from] PersistError),
    /// Networking was required and cannot start.
    #[error(transparent)]
    Network(crate::net::NetError),
}

/// Building a template failed.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The template id is empty or has characters other than `[A-Za-z0-9_.-]`.
    #[error("invalid template id {0:?}")]
    InvalidId(String),
    /// The spec asks for an impossible machine.
    #[error("invalid template spec: {0}")]
    InvalidSpec(String),
    /// The OCI image could not be resolved or pulled (bad reference, auth, platform, size, digest).
    #[error("image: {0}")]
    Image(#[from] agentenv_oci::OciError),
    /// The pull's worker thread ended without an answer.
    #[error("image pull worker: {0}")]
    PullWorker(#[from] tokio::task::JoinError),
    /// The root filesystem could not be built.
    #[error(transparent)]
    Rootfs(#[from] RootfsError),
    /// The template VM failed.
    #[error("template VM: {0}")]
    Vmm(#[from] VmmError),
    /// The guest agent in the template VM did not come up.
    #[error("template guest agent: {source}; console log: {log}")]
    Agent { source: AgentError, log: String },
    /// Writing the template record failed.
    #[error(transparent)]
    Record(#[from] PersistError),
    /// File i/o.
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// No installed template has this id or alias.
    #[error("unknown template {0:?}")]
    NotFound(String),
    /// The chunk store failed (publish, import).
    #[error("chunk store: {what}: {source}")]
    Store {
        what: &'static str,
        #[source]
        source: Box<agentenv_store::StoreError>,
    },
    /// Publishing needs a chunk store with a bucket.
    #[error("the chunk store has no bucket to publish templates to")]
    NoBucket,
    /// A published template's metadata names no manifest for one of its files.
    #[error("template {id} lacks its {file} manifest")]
    MissingManifest { id: String, file: String },
    /// A published template cannot run on this machine (another guest kernel, initramfs or CPU model).
    #[error("{0}")]
    Incompatible(String),
}

/// [`crate::Runtime::create`] failed.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    /// No template with this id or alias.
    #[error("unknown template {0:?}")]
    UnknownTemplate(String),
    /// Importing the template from the shared chunk store failed.
    #[error("template import: {0}")]
    Template(#[source] TemplateError),
    /// The sandbox id is empty, too long, or has characters other than `[A-Za-z0-9_.-]`.
    #[error("invalid sandbox id {0:?}")]
    InvalidId(String),
    /// A sandbox with this id exists.
    #[error("sandbox {0} already exists")]
    AlreadyExists(String),
    /// Preparing the sandbox files failed.
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// The VM could not be restored.
    #[error(transparent)]
    Vmm(#[from] VmmError),
    /// The guest agent did not answer.
    #[error(transparent)]
    Agent(#[from] AgentError),
    /// `/init` with the env vars was refused.
    #[error("guest agent refused /init: HTTP {0}")]
    Init(u16),
    /// The record could not be written.
    #[error(transparent)]
    Record(#[from] PersistError),
    /// The sandbox asks for a network this runtime cannot give (the reason says why).
    #[error("the sandbox asks for network access, but {0}")]
    NetworkUnavailable(String),
    /// Setting up its network failed.
    #[error("sandbox network: {0}")]
    Network(#[from] crate::net::NetError),
}

/// [`crate::Runtime::set_network`] failed.
#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    /// No sandbox with this id.
    #[error("unknown sandbox {0}")]
    NotFound(String),
    /// The sandbox has no network to configure (the reason says why).
    #[error("sandbox {id} has no network: {why}")]
    Unavailable { id: String, why: String },
    /// Applying the rules failed.
    #[error(transparent)]
    Net(#[from] crate::net::NetError),
}

/// [`crate::Runtime::pause`] failed.
#[derive(Debug, thiserror::Error)]
pub enum PauseError {
    /// No sandbox with this id.
    #[error("unknown sandbox {0}")]
    NotFound(String),
    /// The sandbox is already paused.
    #[error("sandbox {0} is already paused")]
    AlreadyPaused(String),
    /// Stopping or saving the VM failed.
    #[error(transparent)]
    Vmm(#[from] VmmError),
    /// The guest agent did not flush the guest's writes (a filesystem-only pause).
    #[error("flushing the guest's disk: {0}")]
    Agent(#[from] AgentError),
    /// Committing the snapshot failed.
    #[error(transparent)]
    Record(#[from] PersistError),
    /// Renaming the device state into place failed.
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// [`crate::Runtime::resume`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ResumeError {
    /// No sandbox with this id.
    #[error("unknown sandbox {0}")]
    NotFound(String),
    /// The sandbox is running.
    #[error("sandbox {0} is not paused")]
    NotPaused(String),
    /// Restoring the VM failed.
    #[error(transparent)]
    Vmm(#[from] VmmError),
    /// The guest agent did not answer after the restore.
    #[error(transparent)]
    Agent(#[from] AgentError),
    /// The record could not be written.
    #[error(transparent)]
    Record(#[from] PersistError),
    /// A file operation on the sandbox's files failed.
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// The sandbox's network could not be plugged in again.
    #[error("sandbox network: {0}")]
    Network(#[from] crate::net::NetError),
}

/// [`crate::Runtime::kill`] failed.
#[derive(Debug, thiserror::Error)]
pub enum KillError {
    /// No sandbox with this id.
    #[error("unknown sandbox {0}")]
    NotFound(String),
    /// Killing the VMM failed.
    #[error(transparent)]
    Vmm(#[from] VmmError),
    /// Removing the sandbox files failed.
    #[error("remove {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// [`crate::Runtime::open_agent_stream`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// No sandbox with this id.
    #[error("unknown sandbox {0}")]
    NotFound(String),
    /// The sandbox is paused.
    #[error("sandbox {0} is paused")]
    Paused(String),
    /// The mux session failed (and one reconnect did not help).
    #[error(transparent)]
    Agent(#[from] AgentError),
}

/// [`crate::Runtime::recover`] failed as a whole (single sandboxes that cannot be recovered are
/// reported as removed instead).
#[derive(Debug, thiserror::Error)]
pub enum RecoverError {
    /// The sandboxes folder could not be read.
    #[error("read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// [`crate::Runtime::snapshot`], [`crate::Runtime::delete_snapshot`] or [`crate::Runtime::fork`] failed.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// No such sandbox.
    #[error("unknown sandbox {0}")]
    SandboxNotFound(String),
    /// No such snapshot.
    #[error("unknown snapshot {0}")]
    NotFound(String),
    /// A snapshot id or name that is not allowed.
    #[error("invalid snapshot name {0:?}: use [A-Za-z0-9_.-] (at most 64), optionally :tag")]
    InvalidName(String),
    /// A memory snapshot of a sandbox paused without memory.
    #[error("sandbox {0} is paused without memory: only a filesystem snapshot of it can be taken")]
    NoMemory(String),
    /// The VMM failed while capturing.
    #[error("snapshot capture: {0}")]
    Vmm(#[from] VmmError),
    /// The guest agent did not answer (filesystem snapshots sync the guest first).
    #[error(transparent)]
    Agent(#[from] AgentError),
    /// A file operation failed.
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// A record could not be written.
    #[error(transparent)]
    Record(#[from] PersistError),
}

impl CreateError {
    /// True when the host is at capacity (no uid free to start another VM): retry later or elsewhere.
    pub fn no_capacity(&self) -> bool {
        matches!(self, CreateError::Vmm(VmmError::NoUid(_)))
    }
}

impl ResumeError {
    /// True when the host is at capacity (no uid free to start another VM): retry later or elsewhere.
    pub fn no_capacity(&self) -> bool {
        matches!(self, ResumeError::Vmm(VmmError::NoUid(_)))
    }
}
