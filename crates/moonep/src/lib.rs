//! moonep: balanced expert-parallel dispatch/combine with dynamic redundant experts.
//!
//! - [`plan`]: the deterministic integer planner (spec §2), shared by the CPU reference and the
//!   host side of the GPU implementation.
//! - [`router`]: seeded workload generators (spec §6.2).

pub mod plan;
pub mod router;
