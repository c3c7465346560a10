//! Which head dimensions (K = V) a forward call may run: those whose kernels a GPU run has checked
//! against the float64 reference. Head dim 64 (`kernels/kda_fwd_ws_d64.cu`,
//! `kda_fwd_ws_split_d64.cu`) joined 128 after its first device run (2026-12-05, one H100:
//! `tests/gpu_d64.rs` 162 cases of 10 variants, split operands and the default within 1.9e-3 of
//! float64, bf16 operands within 4.7e-3 over two runs; memcheck and racecheck clean; `python/check_wheel.py`;
//! `bench-results/2026-12-05-d64/`). A head dim outside [`VERIFIED_HEAD_DIMS`] is refused with
//! [`FlashKdaError::HeadDimUnverified`].

use crate::error::FlashKdaError;

/// Head dims whose forward kernels a GPU run has checked against the float64 reference.
pub const VERIFIED_HEAD_DIMS: [usize; 2] = [128, 64];

/// Whether a forward call of head dim `head_dim` may run.
pub fn head_dim_enabled(head_dim: usize) -> bool {
    VERIFIED_HEAD_DIMS.contains(&head_dim)
}

/// [`FlashKdaError::HeadDimUnverified`] unless [`head_dim_enabled`].
pub fn check_head_dim_enabled(head_dim: usize) -> Result<(), FlashKdaError> {
    if head_dim_enabled(head_dim) {
        Ok(())
    } else {
        Err(FlashKdaError::HeadDimUnverified(head_dim))
    }
}
