//! `agentenv gateway`: one E2B endpoint in front of many nodes, and a node's cluster join ([`join`]). It keeps no state of its own: nodes,
//! claims and the sandbox-to-node map are in etcd (`agentenv_cluster`), so any number of gateways can
//! run and a restarted one loses nothing.
//!
//! - [`proxy`]: forwarding to a node, bodies streamed.
//! - [`routes`]: creates (placed, claimed in etcd), calls by sandbox id, merged lists.
//! - [`locate`]: where a sandbox is, and taking over a paused one whose node left.
//!
//! Requests are checked as a node checks them: API keys through the same [`KeyRing`] (the gateway's
//! state folder holds the same key files as the nodes'), and the client's key goes on to the node,
//! which checks the tenant again. Data-plane requests are classified by [`agentenv_api::dataplane::classify`]
//! and forwarded to the sandbox's node, whose proxy checks the access token.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};

use agentenv_cluster::{ClusterError, ClusterStore, Unplaceable, ViewCache};

use agentenv_api::dataplane::{self, Plane};
use agentenv_api::error::ApiError;
use agentenv_control::tenants::KeyRing;

mod error;
pub mod join;
pub mod locate;
pub mod proxy;
pub mod routes;

pub use error::gateway_response;

/// Wait for a node's answer head on the control plane (creates import snapshots and boot under TCG).
pub const CONTROL_DEADLINE: Duration = Duration::from_secs(200);
/// Wait for a node's answer head on the data plane (a large upload is sent before the answer).
pub const DATA_DEADLINE: Duration = Duration::from_secs(600);

/// Why a gateway request failed; `error.rs` turns it into HTTP.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("cluster state unavailable: {0}")]
    Etcd(#[from] ClusterError),
    #[error("{0}")]
    NoPlacement(#[from] Unplaceable),
    #[error("node {node} is unreachable: {why}")]
    Node { node: String, why: String },
    #[error("node {node} did not answer within {secs} s")]
    NodeTimeout { node: String, secs: u64 },
    #[error("sandbox {0} was not found")]
    SandboxNotFound(String),
    #[error("sandbox {id} was lost: it was running on node {node}, which left the cluster")]
    SandboxLost { id: String, node: String },
    #[error(
        "sandbox {id} is paused and its node {node} left the cluster; connect to resume it elsewhere"
    )]
    PausedElsewhere { id: String, node: String },
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("taking over sandbox {id} failed: {why}")]
    Takeover { id: String, why: String },
    /// A node's own error answer, passed on as it is.
    #[error("a node answered {}", .0.status())]
    Upstream(Box<Response>),
    /// A request error found by the server's own parsers (list queries).
    #[error(transparent)]
    Api(#[from] ApiError),
}

impl IntoResponse for GatewayError {
    fn into_response(self) -> Response {
        crate::error::gateway_response(self, false)
    }
}

/// Shared state of the gateway's handlers.
#[derive(Clone)]
pub struct Gateway {
    pub store: ClusterStore,
    /// Nodes and claims for placements, kept by a watch.
    pub views: ViewCache,
    pub keys: Arc<KeyRing>,
    /// The server key, for node-to-node calls (handoff, adopt, merged lists of snapshots).
    pub server_key: String,
    pub http: proxy::HttpClient,
    /// E2B's sandbox domain: a request for `<port>-<sandbox id>.<domain>` goes to that port of that
    /// sandbox, as on a node (`--sandbox-domain`; the nodes' answers name it).
    pub sandbox_domain: Option<String>,
}

impl Gateway {
    /// A gateway over `store`; starts its view watch, so it needs a Tokio runtime. `node_tls`: reach
    /// nodes over HTTPS only, checked against the cluster's CA (`agentenv_cluster::node_tls`).
    pub fn new(
        store: ClusterStore,
        keys: Arc<KeyRing>,
        server_key: String,
        node_tls: Option<Arc<rustls::ClientConfig>>,
    ) -> Gateway {
        tokio::spawn(sweep(store.clone()));
        Gateway {
            views: ViewCache::start(store.clone()),
            store,
            keys,
            server_key,
            http: proxy::client(node_tls),
            sandbox_domain: None,
        }
    }
}

/// How often a gateway sweeps the sandbox map ([`ClusterStore::sweep`]).
pub const SWEEP_EVERY: Duration = Duration::from_secs(30);

/// Moves entries of the earlier layout once, then removes, every [`SWEEP_EVERY`], placements and
/// tokens of sandboxes their nodes released.
async fn sweep(store: ClusterStore) {
    match store.migrate_flat_entries().await {
        Ok(0) => {}
        Ok(n) => tracing::info!(moved = n, "moved sandbox entries to the per-node layout"),
        Err(e) => {
            tracing::warn!(error = %e, "moving sandbox entries to the per-node layout failed")
        }
    }
    let mut every = tokio::time::interval(SWEEP_EVERY);
    loop {
        every.tick().await;
        match store.sweep().await {
            Ok(s) if s != Default::default() => tracing::debug!(?s, "swept the sandbox map"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "sweeping the sandbox map failed"),
        }
    }
}

/// The gateway's route table: data plane first, then the API-key check, then the control plane.
pub fn app(gw: Gateway) -> Router {
    // Error answers of the control plane are `{code, message}` JSON; the data plane's pass as envd sent them.
    routes::router()
        .layer(middleware::from_fn(agentenv_api::error::json_errors))
        .layer(middleware::from_fn_with_state(gw.clone(), require_api_key))
        .layer(middleware::from_fn_with_state(gw.clone(), dispatch))
        .layer(tower_http::trace::TraceLayer::new_for_http())
        .with_state(gw)
}

async fn dispatch(State(gw): State<Gateway>, mut req: Request, next: Next) -> Response {
    match dataplane::plane_of(&mut req, gw.sandbox_domain.as_deref()) {
        Plane::Control => next.run(req).await,
        plane => locate::data_plane(&gw, plane, req)
            .await
            .unwrap_or_else(|e| crate::error::gateway_response(e, true)),
    }
}

/// The server's key check: the same keys, rate limits and messages.
async fn require_api_key(State(gw): State<Gateway>, mut req: Request, next: Next) -> Response {
    // The volume content API answers to a volume's token, which the node checks.
    if req.uri().path() == "/health"
        || agentenv_api::volume_routes::is_content_path(req.uri().path())
    {
        return next.run(req).await;
    }
    let key = req.headers().get("x-api-key").and_then(|v| v.to_str().ok());
    match key.map(|k| gw.keys.authenticate(k)) {
        Some(Some(tenant)) => {
            if let Some(Err(wait)) = tenant.limiter.as_ref().map(|b| b.take()) {
                return ApiError::rate_limited(wait).into_response();
            }
            req.extensions_mut().insert(tenant);
            next.run(req).await
        }
        Some(None) => ApiError::unauthorized("Invalid API key").into_response(),
        None => ApiError::unauthorized("Missing X-API-KEY header").into_response(),
    }
}
