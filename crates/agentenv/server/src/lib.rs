//! agentenv API server: the E2B control plane and the sandbox data-plane proxy on one port.
//!
//! - [`app`]: route table, API-key check, plane dispatch.
//! - [`routes`]: control-plane handlers; [`dataplane`]: envd routing and the HTTP/1.1 proxy;
//!   [`upgrade`]: upgraded connections (WebSocket) through it.
//! - [`sandboxes`]: lifecycle and timeouts; [`store`]: persisted records; [`keys`]: key and tokens;
//!   [`tenants`]: named keys, their quotas and name scopes.
//! - [`backend`]: the runtime as the server sees it; [`runtime_backend`]: the real runtime.
//!
//! Security: API keys (`e2b_` + 40 hex) guard the control plane, each one a tenant that sees only its
//! own sandboxes, snapshots and templates ([`tenants`]); each sandbox's envd is reachable only with its
//! access token. The server listens on
//! loopback by default. Sandboxes cannot reach this API: guests have no network device at all,
//! only the virtio-serial port the host opens streams on.
//!
//! Invariant: only this crate knows HTTP and E2B JSON; the runtime knows neither.

pub mod app;
pub mod backend;
pub mod build_routes;
#[cfg(test)]
mod build_tests;
pub mod dataplane;
pub mod error;
#[cfg(test)]
mod fake;
pub mod gateway;
pub mod join;
pub mod keys;
pub mod metrics;
pub mod model;
pub mod openapi;
pub mod ratelimit;
pub mod routes;
pub mod runtime_backend;
pub mod sandboxes;
pub mod store;
#[cfg(test)]
mod tenant_tests;
pub mod tenants;
pub mod upgrade;
pub mod views;
