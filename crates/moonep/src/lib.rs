//! moonep: balanced expert-parallel dispatch/combine with dynamic redundant experts.
//!
//! - [`plan`]: the deterministic integer planner (docs/specs/moonep.md §2), shared by the CPU
//!   reference and the host side of the GPU implementation.
//! - [`router`]: seeded workload generators (docs/specs/moonep.md §6.2).
//! - [`reference`]: the CPU reference cluster (R virtual ranks) and the dense MoE oracle.
//! - [`sim`]: the cluster-scale load simulator behind `moonep-sim` and the bench's cpu tier.
//! - `python` (feature `python`): the `moonep._moonep` module under the torch package `python/moonep`.

// Index loops mirror the spec's formulas (and the CUDA port) more plainly than iterator chains.
#![allow(clippy::needless_range_loop)]

pub mod gpu;
pub mod plan;
#[cfg(feature = "python")]
mod python;
pub mod reference;
pub mod router;
pub mod sim;
