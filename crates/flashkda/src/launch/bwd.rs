//! The backward launch (`kernels/kda_bwd_chunk.cu`): the prep records, the state pass storing the
//! chunk start states, the reverse state-gradient pass, the per-chunk gradients and the finish.

use cudarc::driver::{
    CudaFunction, CudaModule, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

use super::{KdaKernels, KernelParams, Workspace, begin_call, side_stream, workspace_ptr};
use crate::error::{DriverContext, FlashKdaError};
use crate::reference::HEAD_DIM;
use crate::schedule::{SPLIT_RECORD_BYTES, workspace_slots};
use crate::validate::{BwdArgs, BwdPlan, StateDType, validate_bwd};

/// Floats of row sums per (token, head) (`ACC_W`: d q_hat, d k_hat, d gamma, d b, 3 pad).
const ACC_W: usize = 3 * HEAD_DIM + 4;
/// Tokens per `kda_bwd_finish` block (`FIN_TOK`).
const FIN_TOK: usize = 64;
/// Tokens per chunk of the backward (the forward's prep chunk).
const CHUNK: usize = 16;
/// Bytes of one bf16 128 x 128 state.
const STATE_BYTES: usize = HEAD_DIM * HEAD_DIM * 2;
/// Bytes of the per-(chunk, head) Wr hi, dU hi, dU lo, Wr lo tiles (bf16 `[4][16][128]`).
const WU_BYTES: usize = 4 * CHUNK * HEAD_DIM * 2;
/// Dynamic shared memory of `kdab_states_w*` / `kdab_dstates_w*` (`PASS_SMEM(NW)`).
const fn pass_smem_bytes(nw: usize) -> u32 {
    pass_smem_bytes_v(nw, 3, 1)
}
/// The 4-warp pass variants (`kdab_*states_w4<suffix>`): suffix, cp.async stages, state staging
/// tiles per warp; `PassSchedule::ConcurrentV` names one by its stages and staging.
const PASS_VARIANTS: [(&str, usize, usize); 5] = [
    ("d2", 2, 2),
    ("d3", 3, 2),
    ("p4", 4, 1),
    ("t2", 2, 3),
    ("t3", 3, 3),
];
/// Index into `PASS_VARIANTS` of the variant with `stages` and `staging`.
fn pass_variant(stages: usize, staging: usize) -> Option<usize> {
    PASS_VARIANTS
        .iter()
        .position(|&(_, ps, db)| (ps, db) == (stages, staging))
}
/// `PASS_SMEM_V(NW, PS, DB)`: `ps` cp.async stages, `db` state staging tiles per warp.
const fn pass_smem_bytes_v(nw: usize, ps: usize, db: usize) -> u32 {
    (ps * (SPLIT_RECORD_BYTES + CHUNK * (16 * nw + 8) * 2)
        + nw * (db * HEAD_DIM + 16) * 16 * 2
        + ps * 8) as u32
}
/// Dynamic shared memory of `kdab_chunk` (`CHUNK_SMEM`).
const CHUNK_SMEM_BYTES: u32 = 111008;
/// Floats of one chunk's partial sums (`PART_W`: ddt_bias[128], dA_log, 3 pad).
const PART_W: usize = 132;

/// The earlier sequential schedule's warps per block (16 value rows each): 4 (two blocks per chain)
/// while that still gives 2 blocks per SM, else 2. `Auto` now takes [`pass_schedule`].
pub fn bwd_pass_warps(chains: usize, sm_count: usize) -> usize {
    if chains * 2 >= 2 * sm_count { 4 } else { 2 }
}

/// How the two state passes (forward: chunk start states; reverse: state gradients) run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PassSchedule {
    /// [`pass_schedule`]'s choice.
    #[default]
    Auto,
    /// One launch after the other, `warps` (2 or 4) per block.
    Sequential { warps: usize },
    /// At once (the forward pass on a side stream), `warps` (2 or 4) per block; `overlap_prep`
    /// (opt-in, measured slower): the forward pass also runs beside the prep, waiting on each
    /// record's ready flag, where [`prep_overlap_fits`] (else as without).
    Concurrent { warps: usize, overlap_prep: bool },
    /// At once, 4 warps, `stages` cp.async stages and `staging` state staging tiles per warp
    /// (one of `PASS_VARIANTS`: (2, 2), (3, 2), (4, 1), (2, 3), (3, 3)).
    ConcurrentV { stages: usize, staging: usize },
}

/// Blocks of `warps` warps a multiprocessor holds at once in a state pass (shared memory).
#[cfg(test)]
const fn pass_blocks_per_sm(warps: usize) -> usize {
    233472 / (pass_smem_bytes(warps) as usize + 1024)
}

/// The schedule `Auto` takes: both passes at once, 4 warps per block, double-buffered state staging
/// (bwd7 call 1: passes 1.93 -> 1.65 ms at H = 96 fixed), without the prep overlap (slower: bwd4
/// call 5). Two cp.async stages (68 KB, 3 blocks per SM) while both passes' blocks all fit at once
/// (the fixed anchors), else three (85 KB, 2 per SM: faster on the other four anchors).
pub fn pass_schedule(chains: usize, sm_count: usize) -> PassSchedule {
    let stages = if 4 * chains <= 3 * sm_count { 2 } else { 3 };
    PassSchedule::ConcurrentV { stages, staging: 2 }
}

/// Whether the forward pass (`chains` x 2 blocks of 4 warps) may wait on the prep's ready flags: at
/// most 2 of its blocks per SM on average, so SMs with room for prep blocks (28 KiB) always remain
/// and a waiting block never starves the prep.
pub fn prep_overlap_fits(chains: usize, warps: usize, sm_count: usize) -> bool {
    warps == 4 && chains * HEAD_DIM / 64 <= 2 * sm_count
}

impl PassSchedule {
    /// `seq2`, `seq4`, `conc2`, `conc4`, `conc4o` (with the prep overlap), `conc4d2`, `conc4d3`
    /// (double-buffered staging, 2 or 3 stages), `conc4p4` (4 stages), `conc4t2`, `conc4t3` (three
    /// staging tiles) or `auto` (benchmark knob of the Python call).
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "auto" => PassSchedule::Auto,
            "seq2" => PassSchedule::Sequential { warps: 2 },
            "seq4" => PassSchedule::Sequential { warps: 4 },
            "conc2" => PassSchedule::Concurrent {
                warps: 2,
                overlap_prep: false,
            },
            "conc4" => PassSchedule::Concurrent {
                warps: 4,
                overlap_prep: false,
            },
            "conc4o" => PassSchedule::Concurrent {
                warps: 4,
                overlap_prep: true,
            },
            "conc4d2" => PassSchedule::ConcurrentV {
                stages: 2,
                staging: 2,
            },
            "conc4d3" => PassSchedule::ConcurrentV {
                stages: 3,
                staging: 2,
            },
            "conc4p4" => PassSchedule::ConcurrentV {
                stages: 4,
                staging: 1,
            },
            "conc4t2" => PassSchedule::ConcurrentV {
                stages: 2,
                staging: 3,
            },
            "conc4t3" => PassSchedule::ConcurrentV {
                stages: 3,
                staging: 3,
            },
            _ => return None,
        })
    }
}

/// Offsets of the backward workspace (bytes, 256-aligned): the prep records, the chunk start
/// states, the d(chunk end) states, the Wr/dU tiles, then either the per-token row sums (GVA,
/// for `kda_bwd_finish`) or the per-chunk partial sums of ddt_bias and dA_log; and the total.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BwdLayout {
    pub rec: usize,
    pub sst: usize,
    pub dss: usize,
    pub wu: usize,
    pub acc: usize,
    pub part: usize,
    /// Per (sequence, head, 16-row tile): the last chunk's `sum_v dht S0` (128 fp32).
    pub dgl: usize,
    /// Per (slot, head): the record's ready flag (u32) for the prep overlap.
    pub flags: usize,
    pub total: usize,
}

/// [`BwdLayout`] of `slots` chunk slots, `tokens` tokens, `seqs` sequences and `heads` value heads;
/// `gva`: q/k heads shared by several value heads (the row sums path).
pub fn bwd_layout(slots: usize, tokens: usize, seqs: usize, heads: usize, gva: bool) -> BwdLayout {
    let sh = slots * heads;
    let rec = 0;
    let sst = (rec + sh * SPLIT_RECORD_BYTES).next_multiple_of(256);
    let dss = (sst + sh * STATE_BYTES).next_multiple_of(256);
    let wu = (dss + sh * STATE_BYTES).next_multiple_of(256);
    let acc = (wu + sh * WU_BYTES).next_multiple_of(256);
    let acc_bytes = if gva { tokens * heads * ACC_W * 4 } else { 0 };
    let part = (acc + acc_bytes).next_multiple_of(256);
    let part_bytes = if gva { 0 } else { sh * PART_W * 4 };
    let dgl = (part + part_bytes).next_multiple_of(256);
    let flags = (dgl + seqs * heads * 8 * HEAD_DIM * 4).next_multiple_of(256);
    BwdLayout {
        rec,
        sst,
        dss,
        wu,
        acc,
        part,
        dgl,
        flags,
        total: flags + sh * 4,
    }
}

fn layout(plan: &BwdPlan) -> BwdLayout {
    let p = &plan.fwd;
    bwd_layout(
        workspace_slots(p),
        p.batch * p.seq_len,
        p.num_seqs,
        p.heads,
        p.qk_heads != p.heads,
    )
}

/// Mirror of `struct KdaBwdParams` in `kernels/kda_bwd_chunk.cu` (the one definition of the kernels'
/// argument list; passed by value).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct BwdKernelParams {
    q: u64,
    k: u64,
    v: u64,
    g: u64,
    beta: u64,
    a_log: u64,
    dt_bias: u64,
    h0: u64,
    cu_seqlens: u64,
    dout: u64,
    dht: u64,
    dq: u64,
    dk: u64,
    dv: u64,
    dg: u64,
    dbeta: u64,
    da_log: u64,
    ddt_bias: u64,
    dh0: u64,
    rec: u64,
    sst: u64,
    dss: u64,
    wu: u64,
    acc: u64,
    part: u64,
    dgl: u64,
    seq_len: i64,
    total_tokens: i64,
    num_heads: i32,
    qk_heads: i32,
    num_seqs: i32,
    state_fp32: i32,
    dh0_fp32: i32,
    scale: f32,
    lower_bound: f32,
    fused: i32,
    /// Per-(slot, head) record ready flags (the prep overlap) or 0.
    flags: u64,
}

// SAFETY: plain-old-data, layout identical to the C struct (size checked by a test).
unsafe impl DeviceRepr for BwdKernelParams {}

/// The backward kernels of one device (`kda_bwd_chunk.cu`).
#[derive(Debug)]
pub(super) struct BwdKernels {
    prep: CudaFunction,
    /// `kdab_states_w2`, `_w4`, then `_w4<suffix>` of `PASS_VARIANTS`.
    states: Vec<CudaFunction>,
    /// `kdab_dstates_w2`, `_w4`, then the variants.
    dstates: Vec<CudaFunction>,
    chunk: CudaFunction,
    reduce: CudaFunction,
    finish: CudaFunction,
}

impl BwdKernels {
    pub(super) fn load(module: &Arc<CudaModule>) -> Result<Self, FlashKdaError> {
        let load = |name: &'static str, smem: u32| super::load_kernel(module, name, smem, name);
        let pass_fns = |names: [&'static str; 7]| {
            let mut v = vec![
                load(names[0], pass_smem_bytes(2))?,
                load(names[1], pass_smem_bytes(4))?,
            ];
            for (name, (_, ps, db)) in names[2..].iter().zip(PASS_VARIANTS) {
                v.push(load(name, pass_smem_bytes_v(4, ps, db))?);
            }
            Ok::<_, FlashKdaError>(v)
        };
        Ok(BwdKernels {
            prep: load("kda_prep", 0)?,
            states: pass_fns([
                "kdab_states_w2",
                "kdab_states_w4",
                "kdab_states_w4d2",
                "kdab_states_w4d3",
                "kdab_states_w4p4",
                "kdab_states_w4t2",
                "kdab_states_w4t3",
            ])?,
            dstates: pass_fns([
                "kdab_dstates_w2",
                "kdab_dstates_w4",
                "kdab_dstates_w4d2",
                "kdab_dstates_w4d3",
                "kdab_dstates_w4p4",
                "kdab_dstates_w4t2",
                "kdab_dstates_w4t3",
            ])?,
            chunk: load("kdab_chunk", CHUNK_SMEM_BYTES)?,
            reduce: load("kdab_reduce", 0)?,
            finish: load("kda_bwd_finish", 0)?,
        })
    }
}

/// Options of a backward call.
#[derive(Debug, Clone, Copy)]
pub struct BwdOptions {
    /// Copy `cu_seqlens` to the host and check it (one small sync); skipped while capturing.
    pub check_cu_seqlens: bool,
    /// The caller's workspace (size: [`bwd_workspace_bytes`]); `None` takes the stream's pooled one.
    pub workspace: Option<Workspace>,
    /// How the two state passes run.
    pub passes: PassSchedule,
}

impl Default for BwdOptions {
    fn default() -> Self {
        BwdOptions {
            check_cu_seqlens: true,
            workspace: None,
            passes: PassSchedule::Auto,
        }
    }
}

/// Workspace bytes of a validated backward call, per 16-token chunk slot and head: the prep
/// record (14400), the chunk's start state and d(end state) (bf16, 32 KiB each), the Wr and dU tiles
/// (hi + lo bf16, 16 KiB) and the partial sums (528); with GVA the per-token row sums (1552 per token and
/// head) instead of the partial sums; 4 KiB per sequence and head. Temporary: nothing is saved by
/// the forward for the backward beyond its inputs.
pub fn bwd_workspace_bytes(plan: &BwdPlan) -> usize {
    layout(plan).total
}

/// Validates `args` and enqueues the backward on `stream`: writes dq, dk, dv, dg, dbeta, dA_log,
/// ddt_bias and (when given) dinitial_state. Device pointers must stay valid until the stream has
/// run the call.
pub fn bwd(
    kernels: &KdaKernels,
    stream: &CudaStream,
    args: &BwdArgs,
    opts: &BwdOptions,
) -> Result<BwdPlan, FlashKdaError> {
    let plan = validate_bwd(args)?;
    bwd_validated(kernels, stream, args, &plan, opts)?;
    Ok(plan)
}

/// [`bwd`] for arguments [`validate_bwd`] already accepted as `plan`.
pub fn bwd_validated(
    kernels: &KdaKernels,
    stream: &CudaStream,
    args: &BwdArgs,
    plan: &BwdPlan,
    opts: &BwdOptions,
) -> Result<(), FlashKdaError> {
    let fp = &plan.fwd;
    let capturing = begin_call(
        kernels,
        stream,
        fp,
        args.cu_seqlens.as_ref(),
        opts.check_cu_seqlens,
    )?;
    let total = fp.batch * fp.seq_len;
    let s = stream.cu_stream();
    // dA_log and ddt_bias are sums over tokens (atomics): zero them first
    // SAFETY: both were validated as contiguous fp32 tensors of these sizes on this device.
    unsafe {
        cudarc::driver::result::memset_d8_async(args.da_log.ptr, 0, fp.heads * 4, s)
            .during("zeroing dA_log")?;
        cudarc::driver::result::memset_d8_async(args.ddt_bias.ptr, 0, fp.heads * HEAD_DIM * 4, s)
            .during("zeroing ddt_bias")?;
    }
    let chains = fp.num_seqs * fp.heads;
    if total == 0 && chains == 0 {
        return Ok(());
    }
    let lay = layout(plan);
    let ws = workspace_ptr(kernels, stream, opts.workspace, lay.total, capturing)?;
    let params = BwdKernelParams {
        q: args.q.ptr,
        k: args.k.ptr,
        v: args.v.ptr,
        g: args.g.ptr,
        beta: args.beta.ptr,
        a_log: args.a_log.ptr,
        dt_bias: args.dt_bias.ptr,
        h0: args.initial_state.as_ref().map_or(0, |t| t.ptr),
        cu_seqlens: args.cu_seqlens.as_ref().map_or(0, |t| t.ptr),
        dout: args.dout.ptr,
        dht: args.dfinal_state.as_ref().map_or(0, |t| t.ptr),
        dq: args.dq.ptr,
        dk: args.dk.ptr,
        dv: args.dv.ptr,
        dg: args.dg.ptr,
        dbeta: args.dbeta.ptr,
        da_log: args.da_log.ptr,
        ddt_bias: args.ddt_bias.ptr,
        dh0: args.dinitial_state.as_ref().map_or(0, |t| t.ptr),
        rec: ws + lay.rec as u64,
        sst: ws + lay.sst as u64,
        dss: ws + lay.dss as u64,
        wu: ws + lay.wu as u64,
        acc: ws + lay.acc as u64,
        part: ws + lay.part as u64,
        dgl: ws + lay.dgl as u64,
        seq_len: fp.seq_len as i64,
        total_tokens: total as i64,
        num_heads: fp.heads as i32,
        qk_heads: fp.qk_heads as i32,
        num_seqs: fp.num_seqs as i32,
        state_fp32: i32::from(fp.state == Some(StateDType::F32)),
        dh0_fp32: i32::from(plan.dinitial_state == Some(StateDType::F32)),
        scale: args.scale,
        lower_bound: args.lower_bound,
        fused: i32::from(fp.qk_heads == fp.heads),
        flags: 0,
    };
    let bk = &kernels.bwd;
    let slots = workspace_slots(fp);
    let sh = (slots * fp.heads) as u32;
    let prep = if sh > 0 {
        let prep = KernelParams {
            q: args.q.ptr,
            k: args.k.ptr,
            v: args.v.ptr,
            g: args.g.ptr,
            beta: args.beta.ptr,
            a_log: args.a_log.ptr,
            dt_bias: args.dt_bias.ptr,
            out: 0,
            h0: 0,
            ht: 0,
            cu_seqlens: params.cu_seqlens,
            seq_len: params.seq_len,
            total_tokens: params.total_tokens,
            num_heads: params.num_heads,
            num_seqs: params.num_seqs,
            state_fp32: 0,
            scale: args.scale,
            lower_bound: args.lower_bound,
            ws: params.rec,
            seg_chunks: 0,
            segs_per_seq: 0,
            qk_heads: params.qk_heads,
            pad: 0,
            flags: 0,
        };
        Some(prep)
    } else {
        None
    };
    let launch_prep = |on: &CudaStream, flags: u64| -> Result<(), FlashKdaError> {
        let Some(prep) = prep else { return Ok(()) };
        let prep = KernelParams { flags, ..prep };
        let cfg = LaunchConfig {
            grid_dim: (sh, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = on.launch_builder(&bk.prep);
        launch.arg(&prep);
        // SAFETY: reads the validated inputs, writes the records (and flags) of the workspace.
        unsafe { launch.launch(cfg) }.during("launching kda_prep (backward)")?;
        Ok(())
    };
    if chains == 0 {
        launch_prep(stream, 0)?;
    } else {
        let sched = match opts.passes {
            PassSchedule::Auto => pass_schedule(chains, kernels.sm_count),
            s => s,
        };
        // (index into `states` / `dstates`, dynamic smem) of a variant; `None`: `_w2` / `_w4`
        let mut variant = None;
        let (nw, both, overlap) = match sched {
            PassSchedule::Sequential { warps } => (warps, false, false),
            PassSchedule::ConcurrentV { stages, staging } => {
                let Some(v) = pass_variant(stages, staging) else {
                    return Err(FlashKdaError::PassVariant { stages, staging });
                };
                variant = Some((2 + v, pass_smem_bytes_v(4, stages, staging)));
                (4, true, false)
            }
            PassSchedule::Concurrent {
                warps,
                overlap_prep,
            } => (
                warps,
                true,
                overlap_prep && sh > 0 && prep_overlap_fits(chains, warps, kernels.sm_count),
            ),
            PassSchedule::Auto => unreachable!("resolved above"),
        };
        if variant.is_none() && nw != 2 && nw != 4 {
            return Err(FlashKdaError::PassWarps(nw));
        }
        let (i, smem) = variant.unwrap_or((usize::from(nw == 4), pass_smem_bytes(nw)));
        // value rows per block: 16 per warp
        let blocks = (chains * HEAD_DIM / (16 * nw)) as u32;
        let cfg = |grid: u32| LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: ((32 * nw) as u32, 1, 1),
            shared_mem_bytes: smem,
        };
        // Concurrent: the forward pass on the highest-priority side stream beside the reverse pass
        // on the caller's stream, which then waits for both (they share no data). Overlapped: the
        // forward pass starts beside the prep, each record's copy waiting on its ready flag.
        let flags = if overlap { ws + lay.flags as u64 } else { 0 };
        if overlap {
            // SAFETY: the flags lie inside the call's workspace.
            unsafe { cudarc::driver::result::memset_d8_async(flags, 0, sh as usize * 4, s) }
                .during("zeroing the ready flags")?;
        } else {
            launch_prep(stream, 0)?;
        }
        let side = if both {
            let side = side_stream(kernels, stream)?;
            side.join(stream).during("ordering the side stream")?;
            Some(side)
        } else {
            None
        };
        let fwd_stream = side.as_deref().unwrap_or(stream);
        let fp_params = BwdKernelParams { flags, ..params };
        let mut launch = fwd_stream.launch_builder(&bk.states[i]);
        launch.arg(&fp_params);
        // SAFETY: reads the records (once flagged, when overlapped) and inputs; writes the states and
        // Wr tiles of the workspace.
        unsafe { launch.launch(cfg(blocks)) }.during("launching kdab_states")?;
        if overlap {
            launch_prep(stream, flags)?;
        }
        let mut launch = stream.launch_builder(&bk.dstates[i]);
        launch.arg(&params);
        // SAFETY: reads the records, dout, dfinal_state; writes dv, dinitial_state and workspace
        // regions kdab_states does not touch.
        unsafe { launch.launch(cfg(blocks)) }.during("launching kdab_dstates")?;
        if let Some(side) = side {
            stream.join(&side).during("joining the side stream")?;
        }
    }
    if sh > 0 {
        let cfg = LaunchConfig {
            grid_dim: (sh, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: CHUNK_SMEM_BYTES,
        };
        let mut launch = stream.launch_builder(&bk.chunk);
        launch.arg(&params);
        // SAFETY: reads the workspace, inputs and dv; writes the row sums.
        unsafe { launch.launch(cfg) }.during("launching kdab_chunk")?;
    }
    if params.fused == 1 {
        if fp.heads > 0 {
            let cfg = LaunchConfig {
                grid_dim: (fp.heads as u32, 1, 1),
                block_dim: (HEAD_DIM as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let n = slots as i32;
            let mut launch = stream.launch_builder(&bk.reduce);
            launch.arg(&params);
            launch.arg(&n);
            // SAFETY: reads the partial sums of every slot; writes dA_log and ddt_bias.
            unsafe { launch.launch(cfg) }.during("launching kdab_reduce")?;
        }
    } else if total > 0 {
        let cfg = LaunchConfig {
            grid_dim: (total.div_ceil(FIN_TOK) as u32, fp.qk_heads as u32, 1),
            block_dim: (HEAD_DIM as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = stream.launch_builder(&bk.finish);
        launch.arg(&params);
        // SAFETY: reads the row sums and inputs; writes dq, dk, dg, dbeta, dA_log, ddt_bias.
        unsafe { launch.launch(cfg) }.during("launching kda_bwd_finish")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_layout_matches_the_c_struct() {
        // 26 pointers, 2 int64, 5 int32, 2 float, 1 int32, 1 pointer = 208 + 16 + 32 + 8 = 264 bytes
        assert_eq!(std::mem::size_of::<BwdKernelParams>(), 264);
        assert_eq!(std::mem::align_of::<BwdKernelParams>(), 8);
        assert_eq!(pass_smem_bytes(2), 56280);
        assert_eq!(pass_smem_bytes(4), 68568);
        assert_eq!(pass_smem_bytes_v(4, 2, 2), 68240);
        assert_eq!(pass_smem_bytes_v(4, 3, 2), 84952);
        assert_eq!(pass_smem_bytes_v(4, 4, 1), 85280);
        assert_eq!(pass_smem_bytes_v(4, 2, 3), 84624);
        assert_eq!(pass_smem_bytes_v(4, 3, 3), 101336);
        assert_eq!(ACC_W % 4, 0);
    }

    #[test]
    fn layout_is_aligned_disjoint_and_sized() {
        let sh = 512 * 96;
        let dgl_bytes = 96 * 8 * HEAD_DIM * 4;
        for gva in [false, true] {
            let l = bwd_layout(512, 8192, 1, 96, gva);
            for off in [l.rec, l.sst, l.dss, l.wu, l.acc, l.part, l.dgl, l.flags] {
                assert_eq!(off % 256, 0);
            }
            assert!(l.sst >= sh * SPLIT_RECORD_BYTES);
            assert!(l.dss >= l.sst + sh * STATE_BYTES);
            assert!(l.wu >= l.dss + sh * STATE_BYTES);
            assert!(l.acc >= l.wu + sh * WU_BYTES);
            assert!(l.flags >= l.dgl + dgl_bytes);
            assert_eq!(l.total, l.flags + sh * 4);
            if gva {
                assert!(l.part >= l.acc + 8192 * 96 * ACC_W * 4);
                assert_eq!(l.dgl, l.part);
            } else {
                assert_eq!(l.part, l.acc);
                assert!(l.dgl >= l.part + sh * PART_W * 4);
            }
        }
        // per token and head without GVA: (14400 + 2 * 32768 + 16384 + 528) / 16 bytes
        let per = (SPLIT_RECORD_BYTES + 2 * STATE_BYTES + WU_BYTES + PART_W * 4) / CHUNK;
        assert_eq!(per, 6053);
        let l = bwd_layout(512, 8192, 1, 96, false);
        assert!(
            l.total >= 8192 * 96 * per && l.total < 8192 * 96 * per + dgl_bytes + sh * 4 + 8 * 256
        );
        assert_eq!(bwd_layout(0, 0, 0, 4, false).total, 0);
    }

    #[test]
    fn pass_schedule_keeps_both_passes_resident_where_it_can() {
        assert_eq!(pass_blocks_per_sm(2), 4);
        assert_eq!(pass_blocks_per_sm(4), 3);
        // H = 96 fixed: both passes' 2 x 192 blocks of 4 warps fit 132 SMs x 3
        assert!(2 * 96 * HEAD_DIM / 64 <= pass_blocks_per_sm(4) * 132);
        assert_eq!(
            pass_schedule(96, 132),
            PassSchedule::ConcurrentV {
                stages: 2,
                staging: 2
            }
        );
        // varlen6 at H = 64: 384 chains, not all resident: three stages
        assert_eq!(
            pass_schedule(6 * 64, 132),
            PassSchedule::ConcurrentV {
                stages: 3,
                staging: 2
            }
        );
        // the prep overlap: H = 96 and 64 fixed (192 / 128 forward blocks), not varlen6 at H = 64
        assert!(prep_overlap_fits(96, 4, 132) && prep_overlap_fits(132, 4, 132));
        assert!(!prep_overlap_fits(133, 4, 132) && !prep_overlap_fits(6 * 64, 4, 132));
        assert!(!prep_overlap_fits(64, 2, 132));
        assert_eq!(
            PassSchedule::parse("seq4"),
            Some(PassSchedule::Sequential { warps: 4 })
        );
        assert_eq!(
            PassSchedule::parse("conc2"),
            Some(PassSchedule::Concurrent {
                warps: 2,
                overlap_prep: false
            })
        );
        assert_eq!(
            PassSchedule::parse("conc4d3"),
            Some(PassSchedule::ConcurrentV {
                stages: 3,
                staging: 2
            })
        );
        assert_eq!(PassSchedule::parse("x"), None);
        // every knob names a compiled variant, nothing else does
        for k in ["conc4d2", "conc4d3", "conc4p4", "conc4t2", "conc4t3"] {
            let Some(PassSchedule::ConcurrentV { stages, staging }) = PassSchedule::parse(k) else {
                panic!("{k}");
            };
            assert!(pass_variant(stages, staging).is_some(), "{k}");
        }
        assert_eq!(pass_variant(2, 1), None);
        // the warp-pair knobs are gone (bwd8: they lost to the w4 passes on every anchor)
        for k in ["pair2", "pair3", "pair2n"] {
            assert_eq!(PassSchedule::parse(k), None);
        }
    }

    #[test]
    fn pass_warps_keep_two_blocks_per_sm() {
        assert_eq!(bwd_pass_warps(96, 132), 2);
        assert_eq!(bwd_pass_warps(132, 132), 4);
        assert_eq!(bwd_pass_warps(8 * 64, 132), 4);
        assert_eq!(bwd_pass_warps(1, 132), 2);
    }
}
