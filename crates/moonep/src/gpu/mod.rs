//! GPU half of moonep (docs/specs/moonep.md §3, §5, §6): one process per GPU, symmetric buffers
//! through CUDA IPC, the planning kernel (bit-exact with [`crate::plan`]), zero-copy dispatch, pull
//! combine, replica prefetch, device barriers that report timeouts, an NCCL send/recv fallback, and
//! the Megatron-style baseline, plus the nvlink-tier benchmark.
//!
//! - [`store`]: loopback TCP key/value store (NCCL id exchange, host barriers, small all-gathers).
//! - [`launch`]: `moonep-launch -n R -- <bin> args` (one process per GPU, kill all if one fails).
//! - [`driver`], [`nccl`]: thin raw wrappers over cudarc's driver and NCCL bindings.
//! - [`kernels`]: one typed launcher per kernel of `kernels/*.cu` (one file per phase).
//! - [`ep`]: [`ep::EpBuffer`], the collective dispatch/combine engine and its backward.
//! - [`baseline`]: permute + grouped send/recv all-to-all-v + unpermute.
//! - [`bench`]: `run_nvlink`, called by `moonep-bench --tier nvlink`.
//! - [`selftest`], [`selftest_backward`]: the rank-side GPU correctness checks, forward and
//!   backward (run by `tests/gpu_ep.rs` and on the device);
//!   [`workload`]: their seeded routings and data.
//!
//! Only this module imports `cudarc`. Without nvcc at build time the kernels are absent and every
//! GPU entry point returns [`GpuError::NoKernels`].

pub mod baseline;
pub mod bench;
pub mod driver;
pub mod ep;
pub mod kernels;
pub mod launch;
pub mod nccl;
pub mod rank;
pub mod selftest;
pub mod selftest_backward;
pub mod store;
pub mod symm;
pub mod workload;

/// Device status word codes written by the kernels (mirrors `kernels/moonep.cu`).
pub mod status {
    pub const OK: u32 = 0;
    pub const BARRIER_TIMEOUT: u32 = 1;
    pub const CONTRACT: u32 = 2;
    pub const EXPERT_RANGE: u32 = 3;
    pub const HISTOGRAM: u32 = 4;
    pub const OVERFLOW: u32 = 5;
    pub const PLANNER_STUCK: u32 = 6;

    /// Human-readable meaning of a status code.
    pub fn describe(code: u32) -> &'static str {
        match code {
            OK => "ok",
            BARRIER_TIMEOUT => "device barrier timed out (a peer did not arrive)",
            CONTRACT => "tpe contract violated (row sums vs s*K / T*K)",
            EXPERT_RANGE => "topk holds an expert id outside 0..E",
            HISTOGRAM => "topk histogram differs from this rank's tpe row",
            OVERFLOW => "planned layout overflows nvs_s or epn replica slots",
            PLANNER_STUCK => "planner made no progress (internal invariant broken)",
            _ => "unknown status code",
        }
    }
}

/// Errors of the GPU path.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error(
        "moonep was built without nvcc: no GPU kernels embedded (set CUDA_HOME or NVCC and rebuild)"
    )]
    NoKernels,
    #[error("CUDA driver library not found (libcuda.so)")]
    NoDriver,
    #[error("NCCL library not found (libnccl.so; see docs/specs/moonep.md §5 for the symlink)")]
    NoNccl,
    #[error("no NCCL communicator: ranks share a GPU (NCCL refuses that); only the IPC path runs")]
    NoComm,
    #[error(transparent)]
    Cuda(#[from] k3_common::cuda::CudaError),
    #[error("NCCL {what}: {code}")]
    Nccl { what: &'static str, code: String },
    #[error("device status on rank {rank}: {code} ({})", status::describe(*code))]
    DeviceStatus { rank: usize, code: u32 },
    #[error("store: {0}")]
    Store(#[from] store::StoreError),
    #[error("rank environment: {0}")]
    Env(String),
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("planner: {0}")]
    Plan(#[from] crate::plan::PlanError),
    #[error("io: {what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}
