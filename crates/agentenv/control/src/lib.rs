//! agentenv's lifecycle domain: sandboxes, snapshots, forks, templates as tenants see them, quotas,
//! expiry, tenancy and keys, and the record store, over one seam to the VMs ([`backend::VmBackend`]).
//!
//! - [`sandboxes`]: the lifecycle ([`sandboxes::Sandboxes`]), its requests and [`LifecycleError`];
//! - [`tenants`]: named keys, their quotas and name scopes; [`keys`]: key, id and token formats;
//!   [`ratelimit`]: per-key request budgets;
//! - [`store`]: the sandbox records, written atomically;
//! - [`backend`]: the VM side as the lifecycle sees it; `fake` (feature `fake`): an in-memory one.
//!
//! Invariant: this crate owns every id, name, tenant and ownership fact, and knows neither HTTP, E2B
//! JSON, QEMU, etcd nor S3 (`cargo tree -p agentenv-control` shows none of them).

pub mod backend;
#[cfg(test)]
mod build_tests;
#[cfg(any(test, feature = "fake"))]
pub mod fake;
pub mod keys;
#[cfg(test)]
mod mount_tests;
#[cfg(test)]
mod pause_tests;
#[cfg(test)]
mod quota_tests;
pub mod ratelimit;
pub mod sandboxes;
pub mod store;
pub mod tenants;
pub mod volumes;

pub use sandboxes::{Caller, CreateRequest, LifecycleError, SandboxState, Sandboxes};
