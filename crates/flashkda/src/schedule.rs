//! Pure choices of a call's schedule: which kernel runs it with how many blocks per chain,
//! whether and how to split long sequences into segments (intra-card context parallelism) and the
//! workspace layout that follows ([`call_plan`]). No device access, so CPU tests pin every choice;
//! `launch` only carries out a [`CallPlan`].

use crate::error::FlashKdaError;
use crate::reference::{CHUNK, HEAD_DIM};
use crate::validate::FwdPlan;

/// Bytes of one prep record (one 16-token chunk slot of one head).
pub const WORKSPACE_RECORD_BYTES: usize = 13888;
/// Bytes of one prep record of the split-operand kernels (`kda_fwd_ws_split.cu`: M's lo part added).
pub const SPLIT_RECORD_BYTES: usize = 14400;
/// [`WORKSPACE_RECORD_BYTES`] at head dim 64 (`kda_fwd_ws_d64.cu`).
pub const WORKSPACE_RECORD_BYTES_D64: usize = 7488;
/// [`SPLIT_RECORD_BYTES`] at head dim 64 (`kda_fwd_ws_split_d64.cu`).
pub const SPLIT_RECORD_BYTES_D64: usize = 8000;

/// Bytes of one fp32 `head_dim x head_dim` state.
pub fn state_f32_bytes(head_dim: usize) -> usize {
    head_dim * head_dim * 4
}
/// Segments shorter than this many chunks cost more in the scan and second pass than they save
/// (H200, run 4d: B=8 T=1024 H=4 in 16-chunk segments was 3 % slower than unsplit).
pub const MIN_SEGMENT_CHUNKS: usize = 32;
/// Below this many segments per sequence the two passes cost more than the shorter chains save
/// (each segment is walked three times: P, M and the output pass).
pub const MIN_SEGMENTS: usize = 4;
/// Segments are made at most this long once the GPU is full (more, shorter segments keep every
/// SM busy to the end; H200, run 4c: 128 chunks best or within 2 % at T = 64K for H = 4, 16, 32).
pub const MAX_SEGMENT_CHUNKS: usize = 128;
/// At most this many segments per sequence: the fp32 scan over segments is serial (run 4c: 256
/// chunks = 64 segments best at T = 256K for H = 4, 16).
pub const MAX_SEGMENTS: usize = 64;
/// Blocks of the transition pass (4 per segment and head; 3-stage kernels) resident per SM.
pub const TRANSITION_BLOCKS_PER_SM: usize = 4;
/// The transition pass is kept within this many waves (run 4c: H = 32, T = 256K was 7 % slower
/// at 16 waves than at 8).
pub const MAX_TRANSITION_WAVES: usize = 8;
/// Splitting walks every token three times (P, M, output): it needs the unsplit pass to leave
/// most of the GPU idle. Measured gains up to 32 chains (1.7x at H = 32); H = 64 stays whole.
pub const MAX_SPLIT_CHAINS_PER_SM: f64 = 0.25;

/// The overlapped prep and state pass (the state blocks wait on per-record ready flags) runs only
/// while every state block fits on the GPU at once with room for prep blocks beside it: at most
/// this many state blocks per SM (the split kernels' 4-warp blocks take 69 KB: 3 fit per SM).
pub const OVERLAP_MAX_STATE_BLOCKS_PER_SM: usize = 2;
/// Whether `overlap: None` overlaps where it is safe (not yet measured on the H200: off).
pub const AUTO_OVERLAP: bool = false;

/// `Auto` uses the workspace schedule only while its workspace stays below this size.
pub const WORKSPACE_AUTO_LIMIT: usize = 16 << 30;

/// How many blocks share one (sequence, head): each owns a slice of the value rows (row counts
/// below at head dim 128; at head dim 64 every block has half the warps, and `Eight` is refused).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ValueSplit {
    /// `Two` (the measured best on the H200 for every schedule and anchor shape).
    #[default]
    Auto,
    /// Four blocks of 2 warps (32 value rows each).
    Four,
    /// Two blocks of 4 warps (64 value rows each).
    Two,
    /// Eight one-warp blocks (16 value rows each); `Workspace` schedule only (the others use `Four`).
    Eight,
    /// One block of 8 warps (all 128 value rows: each prep record is read once per chain);
    /// `Workspace` schedule only (the others use `Two`).
    One,
}

/// Which kernel runs the chunk loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KernelSchedule {
    /// `Workspace` (GVA always; otherwise unless its workspace would exceed
    /// [`WORKSPACE_AUTO_LIMIT`]: then `Pipelined`).
    #[default]
    Auto,
    /// `kda_fwd.cu`: prep then state work per chunk, four barriers per chunk.
    Sequential,
    /// `kda_fwd_pipelined.cu`: prep of chunk c+1 overlapped with the state work of chunk c,
    /// two barriers per chunk (always two 4-warp blocks per chain; `value_split` is ignored).
    Pipelined,
    /// `kda_fwd_ws.cu`: a parallel prep kernel over all (chunk, head) writes the state-independent
    /// tensors to a device workspace (13888 bytes per 16 tokens and head); the sequential pass only
    /// does the state matmuls, 2, 4 or 8 blocks per chain.
    Workspace,
    /// `kda_fwd_c64.cu` (opt-in, never picked by `Auto`): 64-token chunks on wgmma, a parallel
    /// prep writing one 74496-byte record per 64 tokens and head, then one block of two
    /// warpgroups per chain. Head dim 128, split operands, no context parallelism, value split
    /// `Auto` or `One`; anything else is [`FlashKdaError::Chunk64Unsupported`]. First device run
    /// (H100, 2026-12-05, `bench-results/2026-12-05-c64/`): every GPU test passes (anchors 1.66e-3
    /// against float64, worst 3.75e-3, sanitizers clean, graph replay bitwise), but it is
    /// 0.52-0.65x the default on the six anchors: `kda_prep64` takes 1.05-1.64 ms (ncu at H=96
    /// fixed: 1.55 ms, 25 % occupancy, 8.5 cycles per issue, a third of them at barriers, DRAM
    /// 27 %) against the default's whole call of 0.78-1.31 ms, while `kda_state64` (0.31-0.46 ms,
    /// DRAM 84 %) beats the default's state pass (0.41-0.71 ms). Opt-in until the prep is fast.
    Chunk64,
}

/// How the workspace schedule feeds its tensor cores (`reference::emulated::Rounding`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Operands {
    /// The measured choice: [`auto_operands`].
    #[default]
    Auto,
    /// Every operand rounded to bf16 once (`kda_fwd_ws.cu`, `Rounding::KERNEL`).
    Bf16,
    /// hi + lo bf16 pairs for the prep products, M, Vb and U (`kda_fwd_ws_split.cu`,
    /// `Rounding::SPLIT`); workspace schedule only.
    Split,
}

/// `Auto` feeds split operands to calls of at most this many state chains (sequences x heads x
/// segments) per SM.
pub const SPLIT_MAX_CHAINS_PER_SM: usize = 2;

/// The operands `Auto` picks for a workspace-schedule call of `state_chains` chains (sequences x
/// heads x segments) on `sm_count` SMs. H200, 2026-12-01 (tc runs 1-2, same run as the bf16
/// kernels, docs/benchmarks.md): split operands bring the output error against float64 from
/// 4.0e-3 to 1.67e-3 on every anchor shape (the bf16 output floor); their state pass is 20-25 %
/// faster (ldmatrix fragments, per-warp v copies) but their prep 20-25 % slower. With few chains
/// the sequential state pass sets the time and split wins (H=96 fixed 1.08x, H=64 fixed 1.21x,
/// B=1 T=8192 H=4 1.11x, H=4 T=64K 1.03x); with many the prep does and bf16 wins (H=96 1024x8
/// 1.13x, H=32 T=64K 1.07x, H=64 varlen6 1.01x).
pub fn auto_operands(state_chains: usize, sm_count: usize) -> Operands {
    if state_chains <= SPLIT_MAX_CHAINS_PER_SM * sm_count {
        Operands::Split
    } else {
        Operands::Bf16
    }
}

/// What the caller asks of a call's schedule (the matching fields of `FwdOptions`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ScheduleRequest {
    pub schedule: KernelSchedule,
    pub value_split: ValueSplit,
    pub operands: Operands,
    /// Run the prep and the state pass at once (split operands, unsegmented, small enough grids
    /// only; elsewhere the request is ignored): `None` = [`AUTO_OVERLAP`].
    pub overlap: Option<bool>,
    /// `None` = [`plan_segments`], `Some(0)` = off, `Some(c)` = segments of `c` chunks
    /// (fixed-length calls of the `Workspace` schedule only).
    pub segment_chunks: Option<usize>,
}

/// What one call runs: the schedule, value split and segments picked for it, and its workspace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallPlan {
    pub schedule: KernelSchedule,
    pub split: ValueSplit,
    /// `Bf16` or `Split` (never `Auto`); always `Bf16` off the workspace schedule.
    pub operands: Operands,
    /// The prep and the state pass run at once (the workspace then holds ready flags).
    pub overlap: bool,
    pub segments: Segments,
    /// Zero for the schedules without a workspace.
    pub workspace: WorkspaceLayout,
}

/// The schedule `Auto` picks for a call whose `Workspace` schedule needs `workspace_bytes`.
/// H200, run 3 (2026-11-29): with two blocks per chain the workspace schedule is 1.34-1.80x
/// faster than `Pipelined` on all six anchor shapes; `Pipelined` (no workspace) is kept for huge
/// problems.
fn auto_schedule(workspace_bytes: usize) -> KernelSchedule {
    if workspace_bytes <= WORKSPACE_AUTO_LIMIT {
        KernelSchedule::Workspace
    } else {
        KernelSchedule::Pipelined
    }
}

/// The split `Auto` picks. H200 (2026-11-29): two 4-warp blocks per chain beat four 2-warp blocks
/// on every anchor shape for the workspace-free kernels (the per-block key-side prep is shared
/// by more warps); run 3, workspace schedule: two blocks were fastest on five anchor shapes and
/// within 0.1 % of four on H=64 fixed (1.1077 vs 1.1067 ms); eight 1-warp blocks never won.
fn auto_split(_schedule: KernelSchedule, _chains: usize) -> ValueSplit {
    ValueSplit::Two
}

/// The schedule, split, segments and workspace of the validated call `plan` on a GPU of
/// `sm_count` SMs, or why that call cannot run. Head dim 64 runs only on the workspace schedule
/// (`Auto` picks it whatever the workspace size) with value split `One`, `Two` (`Auto`, not
/// measured at 64) or `Four`, and its segmented passes take one 4-warp block per segment and head;
/// anything else is [`FlashKdaError::HeadDimSchedule`].
pub fn call_plan(
    plan: &FwdPlan,
    req: &ScheduleRequest,
    sm_count: usize,
) -> Result<CallPlan, FlashKdaError> {
    if req.schedule == KernelSchedule::Chunk64 {
        return c64::call_plan_c64(plan, req);
    }
    let gva = plan.qk_heads != plan.heads;
    let d64 = plan.head_dim != HEAD_DIM;
    let split_ops = req.operands == Operands::Split;
    let segments = || {
        if plan.varlen {
            return Segments::NONE;
        }
        match req.segment_chunks {
            None => plan_segments(
                plan.num_seqs,
                plan.seq_len,
                plan.heads,
                plan.varlen,
                sm_count,
            ),
            Some(c) => Segments::with_chunks(plan.seq_len, c),
        }
    };
    let operands = match req.operands {
        Operands::Auto => auto_operands(
            plan.num_seqs * plan.heads * segments().segs_per_seq,
            sm_count,
        ),
        o => o,
    };
    let schedule = match req.schedule {
        // GVA, split operands and head dim 64 run only on the workspace schedule
        KernelSchedule::Auto if gva || split_ops || d64 => KernelSchedule::Workspace,
        KernelSchedule::Auto => {
            auto_schedule(workspace_layout(plan, segments(), operands).total_bytes)
        }
        s => s,
    };
    if split_ops && schedule != KernelSchedule::Workspace {
        return Err(FlashKdaError::OperandsSchedule {
            schedule: format!("{schedule:?}"),
        });
    }
    if gva && schedule != KernelSchedule::Workspace {
        return Err(FlashKdaError::GvaSchedule {
            heads: plan.heads,
            qk_heads: plan.qk_heads,
            schedule: format!("{schedule:?}"),
        });
    }
    if d64 && schedule != KernelSchedule::Workspace {
        return Err(FlashKdaError::HeadDimSchedule {
            head_dim: plan.head_dim,
            what: format!("the {schedule:?} schedule"),
        });
    }
    let split = match req.value_split {
        ValueSplit::Auto => auto_split(schedule, plan.num_seqs * plan.heads),
        s => s,
    };
    if state_warps(split, plan.head_dim).is_none() {
        return Err(FlashKdaError::HeadDimSchedule {
            head_dim: plan.head_dim,
            what: format!("value split {split:?}"),
        });
    }
    if schedule != KernelSchedule::Workspace {
        return Ok(CallPlan {
            schedule,
            split,
            operands: Operands::Bf16,
            overlap: false,
            segments: Segments::NONE,
            workspace: WorkspaceLayout::NONE,
        });
    }
    let segments = segments();
    let slots = workspace_slots(plan);
    let blocks = (plan.num_seqs * plan.heads) as u64 * segments.segs_per_seq as u64 * 8;
    // the split prep runs as one grid dimension of slots * heads blocks
    if slots > i32::MAX as usize
        || blocks > i32::MAX as u64
        || slots * plan.heads > i32::MAX as usize
    {
        return Err(FlashKdaError::TooLarge(format!(
            "{slots} chunk slots or {blocks} blocks exceed a kernel grid"
        )));
    }
    // the segmented passes run with 4-warp blocks: two per segment and head, one at head dim 64
    let split = match (segments.active(), d64) {
        (false, _) => split,
        (true, false) => ValueSplit::Two,
        (true, true) => ValueSplit::One,
    };
    let state_blocks = plan.num_seqs * plan.heads * blocks_per_chain(split);
    let overlap = req.overlap.unwrap_or(AUTO_OVERLAP)
        && operands == Operands::Split
        && !segments.active()
        && state_blocks <= OVERLAP_MAX_STATE_BLOCKS_PER_SM * sm_count;
    let mut workspace = workspace_layout(plan, segments, operands);
    if overlap {
        workspace.flags_offset = workspace.total_bytes;
        workspace.flags_bytes = (slots * plan.heads * 4).next_multiple_of(16);
        workspace.total_bytes += workspace.flags_bytes;
    }
    Ok(CallPlan {
        schedule,
        split,
        operands,
        overlap,
        segments,
        workspace,
    })
}

/// Warps per block of the workspace state pass (`kda_state_w{1,2,4,8}`) for a resolved `split`
/// at `head_dim`: the chain's `head_dim / 16` warps of value rows over [`blocks_per_chain`] blocks;
/// `None` where no such kernel is built (head dim 64 has no `kda_state_w8`, so no `Eight`).
pub fn state_warps(split: ValueSplit, head_dim: usize) -> Option<usize> {
    let blocks = blocks_per_chain(split);
    let warps = head_dim / 16 / blocks;
    (warps >= 1 && warps * blocks * 16 == head_dim && warps <= 8).then_some(warps)
}

/// Blocks of the workspace state pass per (sequence, head) for a resolved `split`.
pub fn blocks_per_chain(split: ValueSplit) -> usize {
    match split {
        ValueSplit::One => 1,
        ValueSplit::Four => 4,
        ValueSplit::Eight => 8,
        ValueSplit::Two | ValueSplit::Auto => 2,
    }
}

/// How one call is split: `seg_chunks == 0` runs every sequence as one chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segments {
    /// Chunks per segment (0: no context parallelism).
    pub seg_chunks: usize,
    /// Segments per sequence (1 without context parallelism).
    pub segs_per_seq: usize,
}

impl Segments {
    pub const NONE: Segments = Segments {
        seg_chunks: 0,
        segs_per_seq: 1,
    };

    pub fn active(&self) -> bool {
        self.seg_chunks > 0
    }

    /// Segments of `seg_chunks` over fixed-length sequences of `seq_len` tokens.
    pub fn with_chunks(seq_len: usize, seg_chunks: usize) -> Segments {
        let chunks = seq_len.div_ceil(CHUNK);
        if seg_chunks == 0 || chunks == 0 {
            return Segments::NONE;
        }
        Segments {
            seg_chunks,
            segs_per_seq: chunks.div_ceil(seg_chunks),
        }
    }
}

/// The automatic split for `num_seqs` sequences of `seq_len` tokens (fixed length) with `heads`
/// heads on `sm_count` SMs. Varlen calls are never split (their lengths live on the device).
///
/// Rule: split only when `chains <= MAX_SPLIT_CHAINS_PER_SM * sm_count` (33 on an H200). Take
/// enough segments for one wave of the transition pass (4 blocks per segment and head), or more
/// when segments would exceed [`MAX_SEGMENT_CHUNKS`]; at most [`MAX_SEGMENTS`] and
/// [`MAX_TRANSITION_WAVES`] waves, each segment at least [`MIN_SEGMENT_CHUNKS`] long; split only
/// into [`MIN_SEGMENTS`] or more.
pub fn plan_segments(
    num_seqs: usize,
    seq_len: usize,
    heads: usize,
    varlen: bool,
    sm_count: usize,
) -> Segments {
    let chains = num_seqs * heads;
    if varlen || chains == 0 || chains as f64 > MAX_SPLIT_CHAINS_PER_SM * sm_count as f64 {
        return Segments::NONE;
    }
    let chunks = seq_len.div_ceil(CHUNK);
    let wave = TRANSITION_BLOCKS_PER_SM * sm_count / (4 * chains);
    let segs = wave
        .max(chunks.div_ceil(MAX_SEGMENT_CHUNKS))
        .min(MAX_SEGMENTS)
        .min(MAX_TRANSITION_WAVES * wave)
        .min(chunks / MIN_SEGMENT_CHUNKS);
    if segs < MIN_SEGMENTS {
        return Segments::NONE;
    }
    Segments::with_chunks(seq_len, chunks.div_ceil(segs))
}

/// Byte offsets of the workspace regions of one call (all 16-byte aligned).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkspaceLayout {
    /// Prep records at offset 0: `slots * heads` records.
    pub records_bytes: usize,
    /// `[B * segs, H, 2, D, D]` fp32 (P then M of every segment).
    pub pm_offset: usize,
    /// `[B * segs, H, D, D]` fp32 start state of every segment.
    pub starts_offset: usize,
    /// Ready flags of the overlapped passes (`u32` per record; `flags_bytes == 0` without).
    pub flags_offset: usize,
    pub flags_bytes: usize,
    pub total_bytes: usize,
}

impl WorkspaceLayout {
    /// No workspace (the schedules without one).
    pub const NONE: WorkspaceLayout = WorkspaceLayout::records_only(0);

    /// Prep records only (no segment states, no ready flags).
    pub(crate) const fn records_only(records_bytes: usize) -> Self {
        WorkspaceLayout {
            records_bytes,
            pm_offset: records_bytes,
            starts_offset: records_bytes,
            flags_offset: records_bytes,
            flags_bytes: 0,
            total_bytes: records_bytes,
        }
    }
}

/// Chunk slots of the prep records: `batch * ceil(seq_len / 16)` without `cu_seqlens`, else
/// `T / 16 + N` (sequence `n` starts at slot `cu[n] / 16 + n`; see kda_fwd_ws.cu).
pub fn workspace_slots(plan: &FwdPlan) -> usize {
    if plan.varlen {
        plan.seq_len / CHUNK + plan.num_seqs
    } else {
        plan.batch * plan.seq_len.div_ceil(CHUNK)
    }
}

/// Bytes of one prep record of the workspace kernels fed with `operands` at `head_dim`.
pub fn record_bytes(operands: Operands, head_dim: usize) -> usize {
    match (operands, head_dim == HEAD_DIM) {
        (Operands::Split, true) => SPLIT_RECORD_BYTES,
        (_, true) => WORKSPACE_RECORD_BYTES,
        (Operands::Split, false) => SPLIT_RECORD_BYTES_D64,
        (_, false) => WORKSPACE_RECORD_BYTES_D64,
    }
}

/// The workspace of the `Workspace` schedule for `plan` split as `segs`, with `operands`
/// (`Bf16` or `Split`) deciding the record size.
pub fn workspace_layout(plan: &FwdPlan, segs: Segments, operands: Operands) -> WorkspaceLayout {
    let records_bytes = workspace_slots(plan) * plan.heads * record_bytes(operands, plan.head_dim);
    if !segs.active() {
        return WorkspaceLayout::records_only(records_bytes);
    }
    let states = plan.num_seqs * segs.segs_per_seq * plan.heads;
    let pm_offset = records_bytes;
    let state_bytes = state_f32_bytes(plan.head_dim);
    let starts_offset = pm_offset + 2 * states * state_bytes;
    let total_bytes = starts_offset + states * state_bytes;
    WorkspaceLayout {
        records_bytes,
        pm_offset,
        starts_offset,
        flags_offset: total_bytes,
        flags_bytes: 0,
        total_bytes,
    }
}

mod c64;
pub use c64::{CHUNK64_RECORD_BYTES, chunk64_slots};

#[cfg(test)]
mod tests;
