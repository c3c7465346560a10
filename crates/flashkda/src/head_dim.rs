//! Which head dimensions (K = V) a forward call may run, and the opt-in for the ones built but not
//! yet verified on a GPU: head dim 64 (`kernels/kda_fwd_ws_d64.cu`, `kda_fwd_ws_split_d64.cu`) is
//! refused with [`FlashKdaError::HeadDimUnverified`] unless [`HEAD_DIM_64_OPT_IN`]`=1` is set (read
//! once per process) or [`allow_unverified_head_dim_64`] was called. Remove 64 from the gate once a
//! GPU run of `tests/gpu_d64.rs` and `python/check_wheel.py` has passed.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::FlashKdaError;

/// The environment variable that opts in to head dim 64 (value `1`).
pub const HEAD_DIM_64_OPT_IN: &str = "FLASHKDA_EXPERIMENTAL_HEAD_DIM_64";

/// Head dims whose forward kernels a GPU run has checked against the float64 reference.
pub const VERIFIED_HEAD_DIMS: [usize; 1] = [128];

static ALLOWED: AtomicBool = AtomicBool::new(false);

/// Opts this process in to head dim 64 (what [`HEAD_DIM_64_OPT_IN`]`=1` does; the GPU tests call it).
pub fn allow_unverified_head_dim_64() {
    ALLOWED.store(true, Ordering::Relaxed);
}

fn env_opt_in() -> bool {
    static ENV: OnceLock<bool> = OnceLock::new();
    *ENV.get_or_init(|| std::env::var(HEAD_DIM_64_OPT_IN).is_ok_and(|v| v == "1"))
}

/// Whether a forward call of head dim `head_dim` may run now.
pub fn head_dim_enabled(head_dim: usize) -> bool {
    VERIFIED_HEAD_DIMS.contains(&head_dim)
        || (head_dim == 64 && (ALLOWED.load(Ordering::Relaxed) || env_opt_in()))
}

/// [`FlashKdaError::HeadDimUnverified`] unless [`head_dim_enabled`].
pub fn check_head_dim_enabled(head_dim: usize) -> Result<(), FlashKdaError> {
    if head_dim_enabled(head_dim) {
        Ok(())
    } else {
        Err(FlashKdaError::HeadDimUnverified(head_dim))
    }
}
