//! flashkda: Kimi Delta Attention (KDA) chunked-prefill forward on Hopper (`docs/specs/kda.md`).
//!
//! - [`reference`]: float64 token recurrence (the definition), float64 chunked form, and the
//!   kernel-rounding emulation; used by CI and by the GPU accuracy tests.
//! - [`validate`]: typed device-tensor views and the one validation of a call.
//! - [`schedule`]: the pure plan of a validated call ([`call_plan`]: kernel, split, segments,
//!   workspace), CPU-tested.
//! - [`launch`]: the sm_90a kernels (compiled from `kernels/*.cu` by build.rs), launched with
//!   cudarc on the caller's stream.
//! - `python` (feature `python`): the `flashkda` Python module for torch tensors.
//!
//! Invariant: only [`launch`] launches kernels; the crate builds and its CPU tests run without
//! CUDA (cudarc loads the driver dynamically, and without nvcc the GPU entry points return
//! [`FlashKdaError::KernelsNotBuilt`]).

pub mod error;
pub mod harness;
pub mod head_dim;
pub mod launch;
#[cfg(feature = "python")]
mod python;
pub mod reference;
pub mod schedule;
pub mod validate;

pub use error::FlashKdaError;
pub use head_dim::head_dim_enabled;
pub use launch::{
    BwdLayout, BwdOptions, FwdOptions, KdaKernels, PassSchedule, Workspace, bwd, bwd_layout,
    bwd_pass_warps, bwd_validated, bwd_workspace_bytes, fwd, fwd_planned, fwd_validated,
    kernels_built, open_device, pass_schedule, workspace_bytes,
};
pub use schedule::{
    CallPlan, KernelSchedule, Operands, ScheduleRequest, Segments, ValueSplit, call_plan,
    plan_segments,
};
pub use validate::{
    BwdArgs, BwdPlan, DType, Device, FwdArgs, FwdPlan, StateDType, TensorView, validate,
    validate_bwd,
};

/// "1" when build.rs compiled the kernels, "0" otherwise (CI asserts "1" with K3_REQUIRE_KERNELS=1).
pub const KERNELS_BUILT_ENV: &str = env!("FLASHKDA_KERNELS_BUILT");
