//! The opt-in chunk-64 forward (`KernelSchedule::Chunk64`, `kernels/kda_fwd_c64.cu`; correct on the
//! GPU, slower than the default: see there): `kda_prep64` over all (64-token chunk slot, head), then `kda_state64`, one block of two
//! warpgroups per (sequence, head). Kernel-side sizes mirrored as constants and tested.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use super::KernelParams;
use crate::error::{DriverContext, FlashKdaError};
use crate::schedule::chunk64_slots;
use crate::validate::FwdPlan;

/// Dynamic shared memory of `kda_prep64` (`sizeof(Prep64Smem)`, asserted in the .cu).
pub(super) const PREP64_SMEM: u32 = 111872;
/// Dynamic shared memory of `kda_state64` (`STATE64_SMEM`, asserted in the .cu).
pub(super) const STATE64_SMEM: u32 = 201232;
/// Threads of both kernels (prep: 8 warps; state pass: two warpgroups).
pub(super) const C64_THREADS: u32 = 256;

/// The two kernels of `kda_fwd_c64.cu`.
#[derive(Debug)]
pub(super) struct Chunk64Kernels {
    prep: CudaFunction,
    state: CudaFunction,
}

impl Chunk64Kernels {
    pub(super) fn load(ctx: &Arc<CudaContext>, cubin: Vec<u8>) -> Result<Self, FlashKdaError> {
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .during("loading the kda_fwd_c64 cubin")?;
        let load = |name: &str, what, smem| super::load_kernel(&module, name, smem, what);
        Ok(Chunk64Kernels {
            prep: load("kda_prep64", "loading kda_prep64", PREP64_SMEM)?,
            state: load("kda_state64", "loading kda_state64", STATE64_SMEM)?,
        })
    }

    pub(super) fn functions(&self) -> [&CudaFunction; 2] {
        [&self.prep, &self.state]
    }
}

/// Prep, then the state pass, on `stream`; `params.ws` holds the call's records.
pub(super) fn launch_chunk64(
    k: &Chunk64Kernels,
    stream: &CudaStream,
    plan: &FwdPlan,
    params: KernelParams,
) -> Result<(), FlashKdaError> {
    let slots = chunk64_slots(plan);
    if slots > 0 {
        let cfg = LaunchConfig {
            grid_dim: (slots as u32, plan.heads as u32, 1),
            block_dim: (C64_THREADS, 1, 1),
            shared_mem_bytes: PREP64_SMEM,
        };
        let mut launch = stream.launch_builder(&k.prep);
        launch.arg(&params);
        // SAFETY: reads the validated inputs, writes records [0, slots * heads) of the workspace.
        unsafe { launch.launch(cfg) }.during("launching kda_prep64")?;
    }
    let cfg = LaunchConfig {
        grid_dim: ((plan.num_seqs * plan.heads) as u32, 1, 1),
        block_dim: (C64_THREADS, 1, 1),
        shared_mem_bytes: STATE64_SMEM,
    };
    let mut launch = stream.launch_builder(&k.state);
    launch.arg(&params);
    // SAFETY: reads the records written above, v and h0; writes out and ht.
    unsafe { launch.launch(cfg) }.during("launching kda_state64")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::CHUNK64_RECORD_BYTES;

    #[test]
    fn shared_memory_mirrors_the_kernel_layout() {
        // prep: q, k [64][136] bf16 (A's rows over q's); G [64][128] f32; rnq, rnk, b; ER [16][136]
        // f32; then one union of g [64][136] bf16 (the smallest), the column operands 2 x [64][136]
        // bf16, X [64][65] + Y [3][16][17] f32
        let (g, col, inv) = (
            64 * 136 * 2,
            2 * 64 * 136 * 2,
            64 * 65 * 4 + 3 * 16 * 17 * 4,
        );
        assert!(g <= col);
        let union = col.max(inv);
        let prep = 2 * 64 * 136 * 2 + 64 * 128 * 4 + 3 * 64 * 4 + 16 * 136 * 4 + union;
        assert_eq!(PREP64_SMEM as usize, prep);
        // state pass: 2 record stages, 2 v stages and the output tile [64][136] bf16, 2 mbarriers
        let state = 2 * CHUNK64_RECORD_BYTES + 2 * 64 * 136 * 2 + 64 * 136 * 2 + 2 * 8;
        assert_eq!(STATE64_SMEM as usize, state);
        // at most 227 KiB per block on the H200; two prep blocks per SM (228 KiB, 1 KiB reserved
        // per block)
        const { assert!(PREP64_SMEM <= 227 * 1024 && STATE64_SMEM <= 227 * 1024) };
        const { assert!(2 * (PREP64_SMEM + 1024) <= 228 * 1024) };
        assert_eq!(C64_THREADS, 2 * 128);
    }
}
