//! agentenv's E2B edge: the E2B control plane and the sandbox data-plane proxy on one port, over
//! `agentenv-control`.
//!
//! - [`app`]: route table, API-key check, plane dispatch.
//! - [`routes`]: control-plane handlers, [`build_routes`]: the template builder's; [`model`]: E2B wire
//!   types; [`views`]: records to E2B JSON and E2B requests to the lifecycle's; [`egress`]: E2B's
//!   network options; [`error`]: HTTP errors; [`metrics`]: Prometheus; [`openapi`]: the document.
//! - [`dataplane`]: envd routing and the HTTP/1.1 proxy; [`upgrade`]: upgraded connections (WebSocket)
//!   through it.
//!
//! Security: API keys (`e2b_` + 40 hex) guard the control plane, each one a tenant that sees only its
//! own sandboxes, snapshots and templates; each sandbox's envd is reachable only with its access token.
//! Sandboxes cannot reach this API: each has its own network namespace, and the host table drops
//! everything from sandbox veths to host addresses; envd is reached only over the virtio-serial port
//! the host opens streams on.
//!
//! Invariant: only this crate knows E2B JSON; HTTP status is decided here (and, for the gateway's own
//! failures, in `agentenv-gateway`).

pub mod access;
pub mod app;
pub mod build_routes;
pub mod conn;
pub mod dataplane;
pub mod egress;
pub mod error;
pub mod metrics;
pub mod model;
pub mod openapi;
pub mod routes;
pub mod state;
#[cfg(test)]
mod tenant_tests;
pub mod upgrade;
pub mod views;
pub mod volume_routes;

#[cfg(test)]
use agentenv_control::fake;
pub use agentenv_control::{backend, keys, ratelimit, sandboxes, store, tenants};
