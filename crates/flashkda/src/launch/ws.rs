//! The workspace schedule (`kernels/kda_fwd_ws.cu` and its split-operand and head-dim-64 builds):
//! the loaded kernels of one cubin and the launches of one call (prep, state pass or the
//! context-parallel passes). Every kernel-side size is mirrored here as a constant and tested.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};

use super::{KdaKernels, KernelParams, side_stream};
use crate::error::{DriverContext, FlashKdaError};
use crate::reference::HEAD_DIM;
use crate::schedule::{CallPlan, Operands, blocks_per_chain, state_warps, workspace_slots};
use crate::validate::FwdPlan;

/// Mirror of `struct ScanParams` in `kernels/kda_fwd_ws.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct ScanParams {
    pm: u64,
    starts: u64,
    h0: u64,
    ht: u64,
    state_fp32: i32,
    num_heads: i32,
    segs: i32,
}

// SAFETY: plain-old-data, layout identical to the C struct.
unsafe impl DeviceRepr for ScanParams {}

/// Rows of the state one `kda_cp_scan` block carries (`SCAN_ROWS` in the .cu).
const SCAN_ROWS: u32 = 16;
/// Dynamic shared memory of `kda_cp_scan` (`SCAN_SMEM`: double-buffered M and P rows), per head dim
/// (checked in the .cu).
fn scan_smem_bytes(head_dim: usize) -> u32 {
    if head_dim == HEAD_DIM { 155648 } else { 45056 }
}

/// Value rows of one 4-warp block: the segmented passes run `head_dim / 64` of them per segment
/// and head (and the transition pass twice that: P and M).
const ROWS_PER_W4_BLOCK: usize = 64;

/// Dynamic shared memory of `kda_state_w{1,2,4,8}` and of the 3-stage segmented passes
/// (`STATE_SMEM(1, 2)`, `(2, 4)`, `(4, 4)`, `(8, 4)`, `(4, 3)` in kda_fwd_ws.cu, checked there), per
/// record size and head dim; 0 for `kda_state_w8` at head dim 64 (not built).
fn state_smem_bytes(operands: Operands, head_dim: usize) -> ([u32; 4], u32) {
    match (operands, head_dim == HEAD_DIM) {
        (Operands::Split, true) => ([30608, 63264, 68896, 80160], 52440),
        (_, true) => ([29584, 61216, 66848, 78112], 50904),
        (Operands::Split, false) => ([17808, 37664, 43296, 0], 33240),
        (_, false) => ([16784, 35616, 41248, 0], 31704),
    }
}

/// The kernels of one workspace cubin (`kda_fwd_ws{,_split}{,_d64}.cu`: same names).
#[derive(Debug)]
pub(super) struct WorkspaceKernels {
    head_dim: usize,
    prep: CudaFunction,
    /// `kda_state_w{1,2,4,8}`: 1, 2, 4 and 8 warps per block (no `w8` at head dim 64).
    state: [Option<CudaFunction>; 4],
    /// Dynamic shared memory of `state`.
    state_smem: [u32; 4],
    /// Segmented passes (context parallelism): (transition, output pass, dynamic smem bytes).
    segmented: (CudaFunction, CudaFunction, u32),
    scan: CudaFunction,
}

/// The cubin stem of the workspace kernels for `operands` at `head_dim`.
pub(super) fn cubin_stem(operands: Operands, head_dim: usize) -> &'static str {
    match (operands, head_dim == HEAD_DIM) {
        (Operands::Split, true) => "kda_fwd_ws_split",
        (_, true) => "kda_fwd_ws",
        (Operands::Split, false) => "kda_fwd_ws_split_d64",
        (_, false) => "kda_fwd_ws_d64",
    }
}

impl WorkspaceKernels {
    pub(super) fn load(
        ctx: &Arc<CudaContext>,
        cubin: Vec<u8>,
        operands: Operands,
        head_dim: usize,
    ) -> Result<Self, FlashKdaError> {
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .during(match cubin_stem(operands, head_dim) {
                "kda_fwd_ws_split" => "loading the kda_fwd_ws_split cubin",
                "kda_fwd_ws" => "loading the kda_fwd_ws cubin",
                "kda_fwd_ws_split_d64" => "loading the kda_fwd_ws_split_d64 cubin",
                _ => "loading the kda_fwd_ws_d64 cubin",
            })?;
        let prep = module
            .load_function("kda_prep")
            .during("loading kda_prep")?;
        let load_state = |name: &str, bytes: u32| {
            super::load_kernel(
                &module,
                name,
                bytes,
                "loading a workspace state-pass kernel",
            )
        };
        let (state_smem, cp_smem) = state_smem_bytes(operands, head_dim);
        let mut state = [None, None, None, None];
        for (i, slot) in state.iter_mut().enumerate() {
            let warps = 1usize << i;
            if warps * 16 <= head_dim {
                *slot = Some(load_state(&format!("kda_state_w{warps}"), state_smem[i])?);
            }
        }
        // FLASHKDA_CP_STAGES=4 (tuning only): the 4-stage kernels, 3 blocks per SM instead of 4
        let segmented = if std::env::var("FLASHKDA_CP_STAGES").is_ok_and(|v| v == "4") {
            (
                load_state("kda_cp_transition_w4", state_smem[2])?,
                load_state("kda_state_w4", state_smem[2])?,
                state_smem[2],
            )
        } else {
            (
                load_state("kda_cp_transition_w4s3", cp_smem)?,
                load_state("kda_cp_state_w4s3", cp_smem)?,
                cp_smem,
            )
        };
        let scan = load_state("kda_cp_scan", scan_smem_bytes(head_dim))?;
        Ok(WorkspaceKernels {
            head_dim,
            prep,
            state,
            state_smem,
            segmented,
            scan,
        })
    }

    /// Every function (to load them eagerly).
    pub(super) fn functions(&self) -> impl Iterator<Item = &CudaFunction> {
        let (t, o, _) = &self.segmented;
        self.state
            .iter()
            .flatten()
            .chain([&self.prep, t, o, &self.scan])
    }
}

/// Prep, then either the state pass, or (context parallelism) the transition pass, the scan and
/// the segmented state pass.
pub(super) fn launch_workspace_schedule(
    kernels: &KdaKernels,
    stream: &CudaStream,
    plan: &FwdPlan,
    call: &CallPlan,
    params: KernelParams,
) -> Result<(), FlashKdaError> {
    let chains = (plan.num_seqs * plan.heads) as u32;
    let slots = workspace_slots(plan);
    let ws = kernels.workspace_kernels(call.operands, plan.head_dim);
    debug_assert_eq!(ws.head_dim, plan.head_dim);
    let launch_prep = |on: &CudaStream, params: &KernelParams| -> Result<(), FlashKdaError> {
        if slots == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            // the split prep is one slot-major grid dimension (slots * heads <= i32::MAX: call_plan)
            grid_dim: match call.operands {
                Operands::Split => ((slots * plan.heads) as u32, 1, 1),
                _ => (slots as u32, plan.heads as u32, 1),
            },
            // one thread per key channel
            block_dim: (plan.head_dim as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = on.launch_builder(&ws.prep);
        launch.arg(params);
        // SAFETY: reads the validated inputs, writes records [0, slots * heads) of the workspace
        // (and, overlapped, their ready flags).
        unsafe { launch.launch(cfg) }.during("launching kda_prep")?;
        Ok(())
    };
    let segs = call.segments;
    if !segs.active() {
        let refused = || FlashKdaError::HeadDimSchedule {
            head_dim: plan.head_dim,
            what: format!("value split {:?}", call.split),
        };
        let warps = state_warps(call.split, plan.head_dim).ok_or_else(refused)?;
        let index = warps.trailing_zeros() as usize;
        let state = ws.state[index].as_ref().ok_or_else(refused)?;
        let cfg = LaunchConfig {
            grid_dim: (chains * blocks_per_chain(call.split) as u32, 1, 1),
            block_dim: (32 * warps as u32, 1, 1),
            shared_mem_bytes: ws.state_smem[index],
        };
        if !call.overlap {
            launch_prep(stream, &params)?;
            let mut launch = stream.launch_builder(state);
            launch.arg(&params);
            // SAFETY: reads the records written above and the validated tensors.
            unsafe { launch.launch(cfg) }.during("launching kda_state")?;
            return Ok(());
        }
        // Overlapped: flags zeroed on the caller's stream; the state pass on a highest-priority
        // side stream (its blocks, all resident at once by call_plan's bound, wait on each
        // record's flag) beside the prep on the caller's stream, which then waits for both.
        let flags = params.ws + call.workspace.flags_offset as u64;
        // SAFETY: the flags lie inside the call's workspace.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                flags,
                0,
                call.workspace.flags_bytes,
                stream.cu_stream(),
            )
        }
        .during("zeroing the ready flags")?;
        let side = side_stream(kernels, stream)?;
        side.join(stream).during("ordering the side stream")?;
        let over = KernelParams { flags, ..params };
        let mut launch = side.launch_builder(state);
        launch.arg(&over);
        // SAFETY: reads each record once its flag is set, and the validated tensors.
        unsafe { launch.launch(cfg) }.during("launching kda_state (overlapped)")?;
        launch_prep(stream, &over)?;
        stream.join(&side).during("joining the side stream")?;
        return Ok(());
    }
    launch_prep(stream, &params)?;
    let n_segs = chains * segs.segs_per_seq as u32;
    // 4-warp blocks per segment and head: 2 at head dim 128, 1 at 64
    let slices = (plan.head_dim / ROWS_PER_W4_BLOCK) as u32;
    let pm = params.ws + call.workspace.pm_offset as u64;
    let starts = params.ws + call.workspace.starts_offset as u64;
    let seg_params = KernelParams {
        seg_chunks: segs.seg_chunks as i32,
        segs_per_seq: segs.segs_per_seq as i32,
        num_seqs: (plan.num_seqs * segs.segs_per_seq) as i32,
        state_fp32: 1,
        ..params
    };
    // 1. every segment from zero (P) and from the identity with v = 0 (M)
    let trans = KernelParams {
        h0: 0,
        ht: pm,
        ..seg_params
    };
    let (transition, out_kernel, smem) = &ws.segmented;
    let cfg = LaunchConfig {
        grid_dim: (n_segs * 2 * slices, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: *smem,
    };
    let mut launch = stream.launch_builder(transition);
    launch.arg(&trans);
    // SAFETY: reads the records and v; writes P and M of every segment inside the workspace.
    unsafe { launch.launch(cfg) }.during("launching kda_cp_transition")?;
    // 2. start state of every segment, and the final state
    let scan = ScanParams {
        pm,
        starts,
        h0: params.h0,
        ht: params.ht,
        state_fp32: params.state_fp32,
        num_heads: plan.heads as i32,
        segs: segs.segs_per_seq as i32,
    };
    let cfg = LaunchConfig {
        grid_dim: (chains, plan.head_dim as u32 / SCAN_ROWS, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: scan_smem_bytes(plan.head_dim),
    };
    let mut launch = stream.launch_builder(&ws.scan);
    launch.arg(&scan);
    // SAFETY: reads P, M and h0; writes the start states (workspace) and ht.
    unsafe { launch.launch(cfg) }.during("launching kda_cp_scan")?;
    // 3. the outputs of every segment from its start state
    let out_pass = KernelParams {
        h0: starts,
        ht: 0,
        ..seg_params
    };
    let cfg = LaunchConfig {
        grid_dim: (n_segs * slices, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: *smem,
    };
    let mut launch = stream.launch_builder(out_kernel);
    launch.arg(&out_pass);
    // SAFETY: reads the records, v and the start states; writes out.
    unsafe { launch.launch(cfg) }.during("launching kda_state (segments)")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::CHUNK;
    use crate::schedule::record_bytes;

    /// `STATE_SMEM(NW, ST)` of kda_fwd_ws.cu: ST stages of (record + v rows of NW warps), the NW
    /// output tiles (16 x 24 bf16) and ST mbarriers.
    fn state_smem(record: usize, nw: usize, st: usize) -> u32 {
        (st * (record + CHUNK * 16 * nw * 2) + nw * CHUNK * 24 * 2 + 8 * st) as u32
    }

    #[test]
    fn shared_memory_mirrors_the_kernel_formulas() {
        for d in [64, 128] {
            for ops in [Operands::Bf16, Operands::Split] {
                let rec = record_bytes(ops, d);
                let (state, cp) = state_smem_bytes(ops, d);
                let stages = [2, 4, 4, 4];
                for (i, &st) in stages.iter().enumerate() {
                    let nw = 1 << i;
                    let want = if nw * 16 <= d {
                        state_smem(rec, nw, st)
                    } else {
                        0
                    };
                    assert_eq!(state[i], want, "w{nw} at head dim {d}, {ops:?}");
                }
                assert_eq!(cp, state_smem(rec, 4, 3), "w4s3 at head dim {d}, {ops:?}");
                // every state block fits the H200's 227 KiB per block
                assert!(state.iter().all(|&b| b <= 227 * 1024));
            }
            // double-buffered M (d x d) and P rows (16 x d), plus the block's 16 rows, in fp32
            let scan = (2 * (d * d + SCAN_ROWS as usize * d) + SCAN_ROWS as usize * d) * 4;
            assert_eq!(scan_smem_bytes(d) as usize, scan, "scan at head dim {d}");
        }
    }

    #[test]
    fn record_sizes_mirror_the_kernel_layout() {
        // R_KD, R_QD, R_KR: 32 d bytes each; INV, M: 512; E: 4 d; b: 64; split: M lo 512
        for d in [64, 128] {
            let bf16 = 96 * d + 512 + 512 + 4 * d + 64;
            assert_eq!(record_bytes(Operands::Bf16, d), bf16);
            assert_eq!(record_bytes(Operands::Split, d), bf16 + 512);
            assert_eq!(record_bytes(Operands::Split, d) % 16, 0);
        }
        assert_eq!(record_bytes(Operands::Bf16, 128), 13888);
        assert_eq!(record_bytes(Operands::Split, 64), 8000);
    }

    #[test]
    fn every_split_maps_onto_a_built_state_kernel() {
        use crate::schedule::ValueSplit::*;
        for (split, d, warps) in [
            (One, 128, Some(8)),
            (Two, 128, Some(4)),
            (Four, 128, Some(2)),
            (Eight, 128, Some(1)),
            (One, 64, Some(4)),
            (Two, 64, Some(2)),
            (Four, 64, Some(1)),
            (Eight, 64, None),
        ] {
            assert_eq!(state_warps(split, d), warps, "{split:?} at head dim {d}");
            if let Some(w) = warps {
                assert!(w * 16 <= d, "kda_state_w{w} is built at head dim {d}");
                assert_eq!(w * 16 * blocks_per_chain(split), d);
            }
        }
        // the segmented passes: one 4-warp block per 64 value rows
        assert_eq!(128 / ROWS_PER_W4_BLOCK, 2);
        assert_eq!(64 / ROWS_PER_W4_BLOCK, 1);
        assert_eq!(cubin_stem(Operands::Split, 64), "kda_fwd_ws_split_d64");
        assert_eq!(cubin_stem(Operands::Bf16, 128), "kda_fwd_ws");
    }
}
