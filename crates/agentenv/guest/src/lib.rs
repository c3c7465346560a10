//! agentenv guest agent: serves the E2B envd protocol (`docs/specs/e2b-compat.md` §5–§6) on any
//! byte stream: mux streams from the host inside the VM, or a unix/TCP socket on the host.
//!
//! Modules: [`envd`] (wire JSON + Connect framing, the only module that knows field names),
//! [`http`] (routing, auth, plain endpoints), [`rpc`] (Connect methods), [`process`],
//! [`fs`], [`watch`], [`files`] (`/files`), [`users`], [`init`] (PID 1).
//!
//! Host-facing extras beyond the SDK's calls:
//! - `POST /init` `{"envVars"?: {..}, "accessToken"?: str, "defaultUser"?: str,
//!   "defaultWorkdir"?: str, "timestamp"?: unix-seconds | RFC 3339}` → 204. Env vars merge
//!   into every later process; a token makes every route but `/health` require
//!   `X-Access-Token` (or a signed `/files` URL); `timestamp` sets the clock when the agent
//!   runs with `--set-clock` (what `init` starts), e.g. right after a snapshot resume.
//! - `GET /envs` → the merged env vars; `GET /metrics` → cpu/memory/disk usage JSON.
//! - `POST /volume` (upgrade `agentenv-volume`) → 101; mounts a volume at the
//!   `x-agentenv-mount` path (FUSE) and makes the stream its channel ([`volume`]).

pub mod envd;
pub mod exec;
pub mod files;
pub mod fs;
pub mod http;
pub mod init;
pub mod meta;
pub mod net;
pub mod port;
pub mod process;
pub mod router;
pub mod rpc;
pub mod tunnel;
pub mod users;
pub mod volume;
pub mod watch;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use tokio::io::{AsyncRead, AsyncWrite};

/// Static settings of an agent.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// User for requests that name none (`user` in the VM; the current user in `serve`).
    pub default_user: String,
    /// Require this `X-Access-Token` (can also be set through `/init`).
    pub access_token: Option<String>,
    /// Largest accepted `/files` upload, per file, in bytes.
    pub max_upload_bytes: u64,
    /// Let `/init` set the system clock and the NIC (only as the VM's agent).
    pub set_clock: bool,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            default_user: users::current().name,
            access_token: None,
            max_upload_bytes: 4 << 30,
            set_clock: false,
        }
    }
}

/// Longest wait of a process start for the NIC settings.
pub const NET_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Mutable settings changed by `/init`.
#[derive(Debug, Clone, Default)]
pub struct Settings {
    /// Sandbox-wide environment for every process.
    pub env_vars: HashMap<String, String>,
    /// Required `X-Access-Token`, if any.
    pub access_token: Option<String>,
    /// Default user name.
    pub default_user: String,
    /// Default working directory for processes.
    pub default_workdir: Option<PathBuf>,
}

/// Shared state of one agent: settings, the process table, watchers.
pub struct Agent {
    config: AgentConfig,
    settings: RwLock<Settings>,
    procs: Arc<process::ProcessTable>,
    watchers: watch::Watchers,
    /// `false` while `/init`'s NIC settings are being applied (in the background).
    net_ready: tokio::sync::watch::Sender<bool>,
}

impl Agent {
    /// A new agent.
    pub fn new(config: AgentConfig) -> Arc<Agent> {
        let settings = Settings {
            env_vars: HashMap::new(),
            access_token: config.access_token.clone(),
            default_user: config.default_user.clone(),
            default_workdir: None,
        };
        Arc::new(Agent {
            config,
            settings: RwLock::new(settings),
            procs: Arc::default(),
            watchers: watch::Watchers::default(),
            net_ready: tokio::sync::watch::channel(true).0,
        })
    }

    /// A snapshot of the current settings.
    pub fn settings(&self) -> Settings {
        self.settings
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Waits until the NIC settings of the last `/init` are applied (at most [`NET_WAIT`]), so a
    /// process started right after a create finds its network.
    pub async fn network_settled(&self) {
        let mut rx = self.net_ready.subscribe();
        let _ = tokio::time::timeout(NET_WAIT, rx.wait_for(|ready| *ready)).await;
    }

    fn update_settings(&self, f: impl FnOnce(&mut Settings)) {
        f(&mut self.settings.write().unwrap_or_else(|e| e.into_inner()));
    }

    /// Serves HTTP/1.1 on one connection until the peer closes it.
    pub async fn serve_connection<IO>(self: &Arc<Self>, io: IO) -> Result<(), hyper::Error>
    where
        IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let agent = self.clone();
        let svc = hyper::service::service_fn(move |req| {
            let agent = agent.clone();
            async move { Ok::<_, std::convert::Infallible>(router::handle(agent, req).await) }
        });
        hyper::server::conn::http1::Builder::new()
            .keep_alive(true)
            .serve_connection(hyper_util::rt::TokioIo::new(io), svc)
            .with_upgrades()
            .await
    }
}

/// Runs blocking file I/O without holding up the runtime's other tasks: a path may be on a volume,
/// whose FUSE requests travel on those tasks (on a runtime of one worker they would wait forever).
pub(crate) fn blocking<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}
