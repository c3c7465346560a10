//! The `agentenv` and `agentenv-bench` binaries' library: the runtime as the lifecycle's backend
//! ([`runtime_backend`]), a node's HTTPS listener ([`tls_listener`]), and the crates they wire together, re-exported for the binaries and the
//! integration tests (`tests/`).

pub mod hairpin;
pub mod runtime_backend;
pub mod tls_listener;

pub use agentenv_api::{
    app, backend, build_routes, dataplane, egress, error, keys, metrics, model, openapi, ratelimit,
    routes, sandboxes, store, tenants, upgrade, views,
};
pub use agentenv_gateway as gateway;
pub use agentenv_gateway::join;
