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
/// Bytes of one fp32 128x128 state.
const STATE_F32_BYTES: usize = HEAD_DIM * HEAD_DIM * 4;
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

/// How many blocks share one (sequence, head): each owns a slice of the 128 value rows.
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
/// `sm_count` SMs, or why that call cannot run.
pub fn call_plan(
    plan: &FwdPlan,
    req: &ScheduleRequest,
    sm_count: usize,
) -> Result<CallPlan, FlashKdaError> {
    let gva = plan.qk_heads != plan.heads;
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
        // GVA and split operands run only on the workspace schedule
        KernelSchedule::Auto if gva || split_ops => KernelSchedule::Workspace,
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
    let split = match req.value_split {
        ValueSplit::Auto => auto_split(schedule, plan.num_seqs * plan.heads),
        s => s,
    };
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
    // the segmented passes run with two 4-warp blocks per segment and head
    let split = if segments.active() {
        ValueSplit::Two
    } else {
        split
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
    /// `[B * segs, H, 2, 128, 128]` fp32 (P then M of every segment).
    pub pm_offset: usize,
    /// `[B * segs, H, 128, 128]` fp32 start state of every segment.
    pub starts_offset: usize,
    /// Ready flags of the overlapped passes (`u32` per record; `flags_bytes == 0` without).
    pub flags_offset: usize,
    pub flags_bytes: usize,
    pub total_bytes: usize,
}

impl WorkspaceLayout {
    /// No workspace (the schedules without one).
    pub const NONE: WorkspaceLayout = WorkspaceLayout {
        records_bytes: 0,
        pm_offset: 0,
        starts_offset: 0,
        flags_offset: 0,
        flags_bytes: 0,
        total_bytes: 0,
    };
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

/// Bytes of one prep record of the workspace kernels fed with `operands`.
pub fn record_bytes(operands: Operands) -> usize {
    match operands {
        Operands::Split => SPLIT_RECORD_BYTES,
        _ => WORKSPACE_RECORD_BYTES,
    }
}

/// The workspace of the `Workspace` schedule for `plan` split as `segs`, with `operands`
/// (`Bf16` or `Split`) deciding the record size.
pub fn workspace_layout(plan: &FwdPlan, segs: Segments, operands: Operands) -> WorkspaceLayout {
    let records_bytes = workspace_slots(plan) * plan.heads * record_bytes(operands);
    if !segs.active() {
        return WorkspaceLayout {
            records_bytes,
            pm_offset: records_bytes,
            starts_offset: records_bytes,
            flags_offset: records_bytes,
            flags_bytes: 0,
            total_bytes: records_bytes,
        };
    }
    let states = plan.num_seqs * segs.segs_per_seq * plan.heads;
    let pm_offset = records_bytes;
    let starts_offset = pm_offset + 2 * states * STATE_F32_BYTES;
    let total_bytes = starts_offset + states * STATE_F32_BYTES;
    WorkspaceLayout {
        records_bytes,
        pm_offset,
        starts_offset,
        flags_offset: total_bytes,
        flags_bytes: 0,
        total_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H200_SMS: usize = 132;

    fn plan(batch: usize, seq_len: usize, heads: usize, num_seqs: usize, varlen: bool) -> FwdPlan {
        FwdPlan {
            batch,
            seq_len,
            heads,
            qk_heads: heads,
            num_seqs,
            varlen,
            state: None,
            ordinal: 0,
        }
    }

    #[test]
    fn long_single_sequences_split_as_measured_best() {
        let check = |h: usize, t: usize, segs: usize, seg_chunks: usize| {
            let s = plan_segments(1, t, h, false, H200_SMS);
            assert_eq!(
                (s.segs_per_seq, s.seg_chunks),
                (segs, seg_chunks),
                "H={h} T={t}"
            );
        };
        // H=4, T=64K: one wave of 528 transition blocks = 33 segments of 125 chunks
        check(4, 65536, 33, 125);
        // H=16, 32 at T=64K: 128-chunk segments
        check(16, 65536, 32, 128);
        check(32, 65536, 32, 128);
        // T=256K: 64 segments of 256 chunks; H=32 kept within 8 waves (32 segments)
        check(4, 262144, 64, 256);
        check(16, 262144, 64, 256);
        check(32, 262144, 32, 512);
        // mid sizes: B=1 T=8192 H=16 -> 8 x 64 chunks, T=16384 H=32 -> 8 x 128
        check(16, 8192, 8, 64);
        check(32, 16384, 8, 128);
        // H=33 still splits, H=34 does not
        assert!(plan_segments(1, 65536, 33, false, H200_SMS).active());
        assert_eq!(plan_segments(1, 65536, 34, false, H200_SMS), Segments::NONE);
    }

    #[test]
    fn anchor_shapes_and_short_batches_stay_whole() {
        for (b, t, h) in [
            (1, 8192, 96),
            (1, 8192, 64),
            (8, 1024, 64),
            (8, 1024, 96),
            (8, 1024, 8),
            (8, 1024, 4),
        ] {
            assert_eq!(
                plan_segments(b, t, h, false, H200_SMS),
                Segments::NONE,
                "B={b} T={t} H={h}"
            );
        }
        // short sequences: segments would fall under the minimum length
        assert_eq!(plan_segments(1, 512, 1, false, H200_SMS), Segments::NONE);
        // varlen is never split, however long
        assert_eq!(plan_segments(1, 1 << 20, 4, true, H200_SMS), Segments::NONE);
        assert_eq!(
            plan_segments(0, 1 << 20, 4, false, H200_SMS),
            Segments::NONE
        );
    }

    #[test]
    fn segments_cover_every_chunk_exactly_once() {
        for seq_len in [1, 15, 16, 17, 1000, 65535, 65536, 65537] {
            for seg_chunks in [1, 3, 16, 64, 5000] {
                let s = Segments::with_chunks(seq_len, seg_chunks);
                let chunks = seq_len.div_ceil(CHUNK);
                assert!(s.segs_per_seq * s.seg_chunks >= chunks);
                assert!(
                    (s.segs_per_seq - 1) * s.seg_chunks < chunks,
                    "{seq_len} {seg_chunks}"
                );
            }
        }
        for h in [1, 2, 4, 8, 16] {
            for t in [4096, 30000, 65536, 1 << 18] {
                let s = plan_segments(1, t, h, false, H200_SMS);
                if s.active() {
                    assert!((MIN_SEGMENTS..=MAX_SEGMENTS).contains(&s.segs_per_seq));
                    assert!(s.seg_chunks >= MIN_SEGMENT_CHUNKS, "H={h} T={t} {s:?}");
                }
            }
        }
    }

    fn req(schedule: KernelSchedule, value_split: ValueSplit) -> ScheduleRequest {
        ScheduleRequest {
            schedule,
            value_split,
            segment_chunks: None,
            ..Default::default()
        }
    }

    #[test]
    fn auto_runs_the_anchor_shapes_on_the_workspace_schedule() {
        for (b, t, h, n, varlen, operands) in [
            (1, 8192, 96, 1, false, Operands::Split),
            (1, 8192, 64, 1, false, Operands::Split),
            (1, 8192, 96, 6, true, Operands::Bf16),
            (1, 8192, 64, 6, true, Operands::Bf16),
            (8, 1024, 96, 8, false, Operands::Bf16),
            (8, 1024, 64, 8, false, Operands::Bf16),
        ] {
            let p = plan(b, t, h, n, varlen);
            let c = call_plan(&p, &ScheduleRequest::default(), H200_SMS).unwrap();
            assert_eq!(c.schedule, KernelSchedule::Workspace, "B={b} T={t} H={h}");
            assert_eq!(c.split, ValueSplit::Two);
            assert_eq!(c.segments, Segments::NONE);
            assert_eq!(c.operands, operands, "B={b} T={t} H={h} N={n}");
            assert_eq!(
                c.workspace.total_bytes,
                workspace_slots(&p) * h * record_bytes(operands)
            );
        }
        // long single sequences: split operands while segments x heads <= 2 per SM
        for (t, h, operands) in [
            (65536, 4, Operands::Split),
            (65536, 16, Operands::Bf16),
            (65536, 32, Operands::Bf16),
            (262144, 4, Operands::Split),
            (262144, 32, Operands::Bf16),
            (8192, 4, Operands::Split),
        ] {
            let c = call_plan(
                &plan(1, t, h, 1, false),
                &ScheduleRequest::default(),
                H200_SMS,
            )
            .unwrap();
            assert_eq!(c.operands, operands, "T={t} H={h} {:?}", c.segments);
        }
        // long and few chains: split into segments, always two blocks per segment and head
        let p = plan(1, 65536, 4, 1, false);
        for split in [ValueSplit::Auto, ValueSplit::Eight] {
            let c = call_plan(&p, &req(KernelSchedule::Auto, split), H200_SMS).unwrap();
            assert_eq!((c.segments.segs_per_seq, c.split), (33, ValueSplit::Two));
            assert_eq!(c.workspace, workspace_layout(&p, c.segments, c.operands));
        }
    }

    #[test]
    fn auto_falls_back_to_pipelined_above_the_workspace_limit() {
        let p = plan(1, 1 << 19, 64, 1, false);
        assert!(
            workspace_layout(&p, Segments::NONE, Operands::Bf16).total_bytes > WORKSPACE_AUTO_LIMIT
        );
        let c = call_plan(&p, &ScheduleRequest::default(), H200_SMS).unwrap();
        assert_eq!(c.schedule, KernelSchedule::Pipelined);
        assert_eq!(
            (c.segments, c.workspace),
            (Segments::NONE, WorkspaceLayout::NONE)
        );
        // asked for explicitly, the workspace schedule is kept
        let c = call_plan(
            &p,
            &req(KernelSchedule::Workspace, ValueSplit::Auto),
            H200_SMS,
        )
        .unwrap();
        assert_eq!(c.schedule, KernelSchedule::Workspace);
        assert!(c.workspace.total_bytes > WORKSPACE_AUTO_LIMIT);
    }

    #[test]
    fn gva_plans_the_workspace_of_the_value_heads() {
        let mut p = plan(1, 1 << 19, 64, 1, false);
        p.qk_heads = 16;
        // no pipelined fallback for GVA, however large the workspace
        let c = call_plan(&p, &ScheduleRequest::default(), H200_SMS).unwrap();
        assert_eq!(c.schedule, KernelSchedule::Workspace);
        assert_eq!(
            c.workspace.total_bytes,
            (1 << 15) * 64 * record_bytes(c.operands)
        );
        for s in [KernelSchedule::Sequential, KernelSchedule::Pipelined] {
            let e = call_plan(&p, &req(s, ValueSplit::Auto), H200_SMS).unwrap_err();
            assert!(
                matches!(
                    e,
                    FlashKdaError::GvaSchedule {
                        heads: 64,
                        qk_heads: 16,
                        ..
                    }
                ),
                "{e}"
            );
        }
    }

    #[test]
    fn explicit_choices_are_kept() {
        let p = plan(1, 65536, 4, 1, false);
        let c = call_plan(
            &p,
            &req(KernelSchedule::Sequential, ValueSplit::Four),
            H200_SMS,
        )
        .unwrap();
        assert_eq!(
            (c.schedule, c.split),
            (KernelSchedule::Sequential, ValueSplit::Four)
        );
        assert_eq!(
            (c.segments, c.workspace),
            (Segments::NONE, WorkspaceLayout::NONE)
        );
        let c = call_plan(
            &p,
            &req(KernelSchedule::Pipelined, ValueSplit::Auto),
            H200_SMS,
        )
        .unwrap();
        assert_eq!((c.split, c.workspace.total_bytes), (ValueSplit::Two, 0));
        let mut r = req(KernelSchedule::Workspace, ValueSplit::Eight);
        r.segment_chunks = Some(0);
        let c = call_plan(&p, &r, H200_SMS).unwrap();
        assert_eq!((c.split, c.segments), (ValueSplit::Eight, Segments::NONE));
        r.segment_chunks = Some(64);
        let c = call_plan(&p, &r, H200_SMS).unwrap();
        assert_eq!((c.segments.seg_chunks, c.segments.segs_per_seq), (64, 64));
        assert_eq!(c.split, ValueSplit::Two);
        // varlen is never split, even when asked
        let c = call_plan(&plan(1, 65536, 4, 3, true), &r, H200_SMS).unwrap();
        assert_eq!(c.segments, Segments::NONE);
    }

    #[test]
    fn grids_past_i32_are_refused() {
        let p = plan(1, 1 << 36, 1, 1, false);
        let e = call_plan(
            &p,
            &req(KernelSchedule::Workspace, ValueSplit::Auto),
            H200_SMS,
        )
        .unwrap_err();
        assert!(matches!(e, FlashKdaError::TooLarge(_)), "{e}");
    }

    #[test]
    fn workspace_layout_adds_segment_states() {
        let p = plan(1, 65536, 4, 1, false);
        let none = workspace_layout(&p, Segments::NONE, Operands::Bf16);
        assert_eq!(none.total_bytes, 4096 * 4 * WORKSPACE_RECORD_BYTES);
        let s = Segments::with_chunks(65536, 171);
        let l = workspace_layout(&p, s, Operands::Bf16);
        assert_eq!(l.pm_offset, none.total_bytes);
        assert_eq!(l.starts_offset - l.pm_offset, 2 * 24 * 4 * STATE_F32_BYTES);
        assert_eq!(l.total_bytes - l.starts_offset, 24 * 4 * STATE_F32_BYTES);
        assert!(l.pm_offset.is_multiple_of(16) && l.starts_offset.is_multiple_of(16));
        let v = plan(1, 345, 8, 2, true);
        assert_eq!(workspace_slots(&v), 345 / 16 + 2);
    }

    #[test]
    fn split_operands_run_on_the_workspace_schedule_with_larger_records() {
        let split = |schedule| ScheduleRequest {
            schedule,
            operands: Operands::Split,
            ..Default::default()
        };
        // anchor shape and a split long sequence: workspace schedule, 14400-byte records
        let p = plan(1, 8192, 96, 1, false);
        let c = call_plan(&p, &split(KernelSchedule::Auto), H200_SMS).unwrap();
        assert_eq!(
            (c.schedule, c.operands),
            (KernelSchedule::Workspace, Operands::Split)
        );
        assert_eq!(c.workspace.total_bytes, 512 * 96 * SPLIT_RECORD_BYTES);
        let p = plan(1, 65536, 4, 1, false);
        let c = call_plan(&p, &split(KernelSchedule::Auto), H200_SMS).unwrap();
        assert!(c.segments.active());
        assert_eq!(c.workspace.records_bytes, 4096 * 4 * SPLIT_RECORD_BYTES);
        assert_eq!(
            c.workspace,
            workspace_layout(&p, c.segments, Operands::Split)
        );
        // above the workspace limit Auto keeps the workspace schedule for split operands
        let p = plan(1, 1 << 19, 64, 1, false);
        let c = call_plan(&p, &split(KernelSchedule::Auto), H200_SMS).unwrap();
        assert_eq!(c.schedule, KernelSchedule::Workspace);
        // the workspace-free kernels refuse them
        for s in [KernelSchedule::Sequential, KernelSchedule::Pipelined] {
            let e = call_plan(&p, &split(s), H200_SMS).unwrap_err();
            assert!(matches!(e, FlashKdaError::OperandsSchedule { .. }), "{e}");
        }
        // Auto resolves to a concrete choice, Bf16 off the workspace schedule
        let c = call_plan(&p, &ScheduleRequest::default(), H200_SMS).unwrap();
        assert_eq!(c.operands, Operands::Bf16);
        let c = call_plan(
            &plan(1, 8192, 96, 1, false),
            &ScheduleRequest::default(),
            H200_SMS,
        )
        .unwrap();
        assert_eq!(c.operands, auto_operands(96, H200_SMS));
        assert_eq!(c.operands, Operands::Split);
        assert_eq!(c.workspace.total_bytes, 512 * 96 * SPLIT_RECORD_BYTES);
    }

    #[test]
    fn overlap_only_where_every_state_block_fits_beside_the_prep() {
        let on = |operands| ScheduleRequest {
            operands,
            overlap: Some(true),
            ..Default::default()
        };
        // H=96 fixed: 192 state blocks <= 2 per SM: overlapped, with one flag per record
        let p = plan(1, 8192, 96, 1, false);
        let c = call_plan(&p, &on(Operands::Split), H200_SMS).unwrap();
        assert!(c.overlap);
        assert_eq!(c.workspace.flags_offset, 512 * 96 * SPLIT_RECORD_BYTES);
        assert_eq!(c.workspace.flags_bytes, 512 * 96 * 4);
        assert_eq!(
            c.workspace.total_bytes,
            c.workspace.flags_offset + c.workspace.flags_bytes
        );
        // 1024x8 at H=96: 1536 blocks cannot all be resident: never overlapped
        let c = call_plan(&plan(8, 1024, 96, 8, false), &on(Operands::Split), H200_SMS).unwrap();
        assert!(!c.overlap);
        assert_eq!(c.workspace.flags_bytes, 0);
        // bf16 operands, segmented calls and the default (AUTO_OVERLAP) stay sequential
        assert!(
            !call_plan(&p, &on(Operands::Bf16), H200_SMS)
                .unwrap()
                .overlap
        );
        let long = plan(1, 65536, 4, 1, false);
        assert!(
            !call_plan(&long, &on(Operands::Split), H200_SMS)
                .unwrap()
                .overlap
        );
        let d = call_plan(&p, &ScheduleRequest::default(), H200_SMS).unwrap();
        assert_eq!(d.overlap, AUTO_OVERLAP);
    }
}
