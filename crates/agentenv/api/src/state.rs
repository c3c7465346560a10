//! The state every handler shares, and how it is opened.

use std::path::PathBuf;
use std::sync::Arc;

use crate::backend::VmBackend;
use crate::metrics::Metrics;
use crate::sandboxes::{LifecycleConfig, Sandboxes};
use crate::store::SandboxStore;
use crate::tenants::KeyRing;

/// Default upper bound of one data-plane request body (file uploads).
pub const DEFAULT_MAX_UPLOAD_BYTES: u64 = 1 << 30;
/// Upper bound of control-plane JSON bodies.
pub const MAX_JSON_BYTES: usize = 1 << 20;

/// Shared state of every handler.
#[derive(Clone)]
pub struct AppState {
    pub sandboxes: Arc<Sandboxes>,
    pub metrics: Arc<Metrics>,
    /// The accepted API keys: the server's own and the named ones.
    pub keys: Arc<KeyRing>,
    pub max_upload_bytes: u64,
    /// E2B's sandbox domain: answers name it as `domain`, and a request for
    /// `<port>-<sandbox id>.<domain>` goes to that port of that sandbox (`--sandbox-domain`).
    pub sandbox_domain: Option<String>,
}

/// What [`AppState::open`] needs.
pub struct ServerConfig {
    pub state_dir: PathBuf,
    pub api_key: String,
    pub max_upload_bytes: u64,
    pub lifecycle: LifecycleConfig,
    /// Control-plane requests of each key (`None`: unlimited).
    pub rate_limit: Option<crate::ratelimit::RateLimit>,
}

impl AppState {
    /// Opens the store, reconciles it with the runtime and starts the timeout reaper.
    pub async fn open(backend: Arc<dyn VmBackend>, cfg: ServerConfig) -> anyhow::Result<AppState> {
        let metrics = Arc::new(Metrics::new());
        let store = SandboxStore::open(&cfg.state_dir)?;
        // The server's own key is held only to the server-wide quota.
        let volumes = Arc::new(agentenv_control::volumes::Volumes::open(
            &cfg.state_dir,
            &cfg.api_key,
        )?);
        let keys = Arc::new(KeyRing::open(
            &cfg.state_dir,
            cfg.api_key,
            Default::default(),
            cfg.rate_limit,
        ));
        let sandboxes = Sandboxes::open(
            backend,
            store,
            metrics.clone(),
            cfg.lifecycle,
            keys.clone(),
            volumes,
        )
        .await?;
        sandboxes.spawn_reaper();
        Ok(AppState {
            sandboxes,
            metrics,
            keys,
            max_upload_bytes: cfg.max_upload_bytes,
            sandbox_domain: None,
        })
    }
}
