//! Shared parts of k3-stack.
//!
//! - [`device`]: CUDA device detection (feature `cuda`, dynamically loaded) and peer/link discovery.
//! - [`kvm`]: whether `/dev/kvm` really boots a guest, or only TCG works.
//! - [`telemetry`]: `tracing` setup.
//! - [`report`]: benchmark report types that every tier writes and `cargo xtask` merges.
//!
//! Invariant: without the `cuda` feature this crate pulls no CUDA crate (agentenv depends on it so).

pub mod cpio;
pub mod device;
pub mod fsutil;
pub mod kvm;
pub mod report;
pub mod telemetry;
pub mod time;
pub mod toolkit;

pub use report::{Better, Figure, Plot, PlotKind, Report, Section, Series, Stats, Tier};
