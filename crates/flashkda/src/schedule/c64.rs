//! The plan of an opt-in chunk-64 call (`KernelSchedule::Chunk64`, `kernels/kda_fwd_c64.cu`).

use super::{
    CallPlan, KernelSchedule, Operands, ScheduleRequest, Segments, ValueSplit, WorkspaceLayout,
};
use crate::error::FlashKdaError;
use crate::reference::HEAD_DIM;
use crate::reference::chunked64::CHUNK64;
use crate::validate::FwdPlan;

/// Bytes of one chunk-64 prep record (`REC64_BYTES` in kda_fwd_c64.cu): kd, qd, krT (16 KiB each),
/// INV, M hi, M lo (8 KiB each), E (128 fp32), b (64 fp32).
pub const CHUNK64_RECORD_BYTES: usize = 74496;

/// 64-token chunk slots: `batch * ceil(seq_len / 64)` without `cu_seqlens`, else `T / 64 + N`
/// (sequence `n` starts at slot `cu[n] / 64 + n`, as the 16-token workspace).
pub fn chunk64_slots(plan: &FwdPlan) -> usize {
    if plan.varlen {
        plan.seq_len / CHUNK64 + plan.num_seqs
    } else {
        plan.batch * plan.seq_len.div_ceil(CHUNK64)
    }
}

/// [`super::call_plan`] for `KernelSchedule::Chunk64`: one block per chain, split operands, records
/// only in the workspace; refuses what the first version does not support.
pub(super) fn call_plan_c64(
    plan: &FwdPlan,
    req: &ScheduleRequest,
) -> Result<CallPlan, FlashKdaError> {
    let refuse = |what: String| Err(FlashKdaError::Chunk64Unsupported(what));
    if plan.head_dim != HEAD_DIM {
        return refuse(format!("head dim {}", plan.head_dim));
    }
    if !matches!(req.value_split, ValueSplit::Auto | ValueSplit::One) {
        return refuse(format!("value split {:?}", req.value_split));
    }
    if req.operands == Operands::Bf16 {
        return refuse("bf16 operands".into());
    }
    if req.segment_chunks.is_some_and(|c| c > 0) {
        return refuse("context parallelism (segment_chunks > 0)".into());
    }
    if req.overlap == Some(true) {
        return refuse("an overlapped prep and state pass".into());
    }
    let slots = chunk64_slots(plan);
    if slots > i32::MAX as usize
        || plan.heads > u16::MAX as usize
        || plan.num_seqs * plan.heads > i32::MAX as usize
    {
        return Err(FlashKdaError::TooLarge(format!(
            "{slots} chunk-64 slots or {} chains exceed a kernel grid",
            plan.num_seqs * plan.heads
        )));
    }
    let records_bytes = slots * plan.heads * CHUNK64_RECORD_BYTES;
    Ok(CallPlan {
        schedule: KernelSchedule::Chunk64,
        split: ValueSplit::One,
        operands: Operands::Split,
        overlap: false,
        segments: Segments::NONE,
        workspace: WorkspaceLayout::records_only(records_bytes),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::call_plan;

    fn plan(batch: usize, seq_len: usize, varlen: bool, num_seqs: usize, d: usize) -> FwdPlan {
        FwdPlan {
            batch,
            seq_len,
            heads: 96,
            qk_heads: 96,
            head_dim: d,
            varlen,
            num_seqs,
            state: None,
            ordinal: 0,
        }
    }

    fn req(split: ValueSplit, operands: Operands, segs: Option<usize>) -> ScheduleRequest {
        ScheduleRequest {
            schedule: KernelSchedule::Chunk64,
            value_split: split,
            operands,
            overlap: None,
            segment_chunks: segs,
        }
    }

    #[test]
    fn record_mirrors_the_kernel_layout() {
        // kd, qd: [64][128] bf16; krT: [128][64]; INV, M hi, M lo: [64][64]; E: 128 f32; b: 64 f32
        let tiles = 3 * 64 * 128 * 2 + 3 * 64 * 64 * 2;
        assert_eq!(CHUNK64_RECORD_BYTES, tiles + 128 * 4 + 64 * 4);
        assert_eq!(CHUNK64_RECORD_BYTES % 16, 0);
        assert_eq!(
            CHUNK64_RECORD_BYTES % 3,
            0,
            "the state pass copies it in 3 equal pieces"
        );
        assert_eq!((CHUNK64_RECORD_BYTES / 3) % 16, 0);
    }

    #[test]
    fn slots_cover_every_sequence_without_overlap() {
        // fixed: ceil(T / 64) per sequence
        assert_eq!(chunk64_slots(&plan(2, 8192, false, 2, 128)), 256);
        assert_eq!(chunk64_slots(&plan(1, 65, false, 1, 128)), 2);
        // varlen: sequence n starts at cu[n] / 64 + n and needs ceil(len / 64) slots
        let lens = [1300usize, 547, 2048, 963, 271, 3063, 1, 64, 65, 0];
        let total: usize = lens.iter().sum();
        let slots = chunk64_slots(&plan(1, total, true, lens.len(), 128));
        let mut a = 0;
        let mut next_free = 0;
        for (n, &l) in lens.iter().enumerate() {
            let s0 = a / CHUNK64 + n;
            assert!(s0 >= next_free, "sequence {n} overlaps the previous one");
            next_free = s0 + l.div_ceil(CHUNK64);
            assert!(next_free <= slots);
            a += l;
        }
    }

    #[test]
    fn chunk64_is_opt_in_and_refuses_what_it_lacks() {
        let p = plan(1, 8192, false, 1, 128);
        let c = call_plan(&p, &req(ValueSplit::Auto, Operands::Auto, None), 132).unwrap();
        assert_eq!(c.schedule, KernelSchedule::Chunk64);
        assert_eq!(
            (c.split, c.operands, c.overlap),
            (ValueSplit::One, Operands::Split, false)
        );
        assert!(!c.segments.active());
        assert_eq!(c.workspace.total_bytes, 128 * 96 * CHUNK64_RECORD_BYTES);
        // segment_chunks Some(0) means "off": accepted
        call_plan(&p, &req(ValueSplit::One, Operands::Split, Some(0)), 132).unwrap();
        // Auto never picks it
        let auto = ScheduleRequest::default();
        assert_ne!(
            call_plan(&p, &auto, 132).unwrap().schedule,
            KernelSchedule::Chunk64
        );
        for bad in [
            req(ValueSplit::Two, Operands::Auto, None),
            req(ValueSplit::Auto, Operands::Bf16, None),
            req(ValueSplit::Auto, Operands::Auto, Some(8)),
            ScheduleRequest {
                overlap: Some(true),
                ..req(ValueSplit::Auto, Operands::Auto, None)
            },
        ] {
            let e = call_plan(&p, &bad, 132).unwrap_err();
            assert!(matches!(e, FlashKdaError::Chunk64Unsupported(_)), "{e}");
        }
        let e = call_plan(
            &plan(1, 512, false, 1, 64),
            &req(ValueSplit::Auto, Operands::Auto, None),
            132,
        )
        .unwrap_err();
        assert!(matches!(e, FlashKdaError::Chunk64Unsupported(_)), "{e}");
    }
}
