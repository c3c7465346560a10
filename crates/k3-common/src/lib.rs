//! Shared parts of k3-stack: small facts owned once.
//!
//! - [`background`]: threads that yield the cores (nice +10).
//! - [`device`]: CUDA device detection (feature `cuda`, dynamically loaded) and peer/link discovery.
//! - [`cuda`]: the CUDA driver error helper (feature `cuda`).
//! - [`kvm`]: whether `/dev/kvm` really boots a guest, or only TCG works; the accelerator enum and the
//!   verdict cache.
//! - [`machine`]: hostname and the machine description of a report.
//! - [`provenance`]: the exact commit and dirty-tree flag a measurement came from.
//! - [`require`]: skip a test or bench for missing hardware, or fail under `K3_REQUIRE_*`.
//! - [`stats`]: median, percentiles, CDF.
//! - [`time`]: RFC 3339 formatting and parsing.
//! - [`telemetry`]: `tracing` setup.
//! - [`report`]: benchmark report types that every tier writes and `cargo xtask` merges.
//!
//! Invariant: without the `cuda` feature this crate pulls no CUDA crate (agentenv depends on it so).

pub mod background;
pub mod cpio;
pub mod crash;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod fsutil;
pub mod kvm;
pub mod machine;
pub mod netcheck;
pub mod provenance;
pub mod report;
pub mod require;
pub mod stats;
pub mod telemetry;
pub mod time;
pub mod toolkit;

pub use report::{Better, Figure, Plot, PlotKind, Report, Section, Series, Stats, Tier};
