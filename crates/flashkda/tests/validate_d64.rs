//! Head dim 64 (K = V = 64) on the CPU: validation of every tensor at D = 64, the schedule it gets
//! (workspace only, refusals typed), the backward's refusal and the not-yet-verified gate.

mod validate_common;
use validate_common::{args, bwd_args, t};

use flashkda::schedule::{
    SPLIT_RECORD_BYTES_D64, WORKSPACE_RECORD_BYTES_D64, record_bytes, state_f32_bytes,
    workspace_slots,
};
use flashkda::{
    DType, FlashKdaError, FwdArgs, KernelSchedule, Operands, ScheduleRequest, StateDType,
    ValueSplit, call_plan, validate, validate_bwd,
};

const D: usize = 64;
const H200_SMS: usize = 132;

#[test]
fn head_dim_64_is_accepted_with_d64_shapes_everywhere() {
    let p = validate(&args(2, 64, 4, 4, D)).unwrap();
    assert_eq!((p.head_dim, p.heads, p.num_seqs), (D, 4, 2));
    // varlen, GVA and fp32 states of [N, H, 64, 64]
    let mut a = args(1, 64, 6, 2, D);
    a.cu_seqlens = Some(t(DType::I64, &[4], 0x9000));
    a.initial_state = Some(t(DType::F32, &[3, 6, D, D], 0xa000));
    a.final_state = Some(t(DType::F32, &[3, 6, D, D], 0xb000));
    let p = validate(&a).unwrap();
    assert_eq!(
        (p.head_dim, p.qk_heads, p.heads, p.num_seqs, p.state),
        (D, 2, 6, 3, Some(StateDType::F32))
    );
    // 128 is still 128
    assert_eq!(validate(&args(1, 8, 2, 2, 128)).unwrap().head_dim, 128);
}

#[test]
fn head_dim_64_mismatches_are_refused_by_tensor() {
    let shape_err = |a: &FwdArgs, want: &str| match validate(a) {
        Err(FlashKdaError::Shape { tensor, .. }) => assert_eq!(tensor, want),
        other => panic!("expected a shape error for {want}, got {other:?}"),
    };
    // K = V: a 128-wide v, g or out under 64-wide q, k
    for which in ["k", "v", "g", "out"] {
        let mut a = args(1, 8, 2, 2, D);
        let wide = t(DType::BF16, &[1, 8, 2, 128], 0x3000);
        match which {
            "k" => a.k = wide,
            "v" => a.v = wide,
            "g" => a.g = wide,
            _ => a.out = wide,
        }
        shape_err(&a, which);
    }
    let mut a = args(1, 8, 2, 2, D);
    a.dt_bias = t(DType::F32, &[2, 128], 0x8000);
    shape_err(&a, "dt_bias");
    let mut a = args(1, 8, 2, 2, D);
    a.initial_state = Some(t(DType::F32, &[1, 2, 128, 128], 0xa000));
    shape_err(&a, "initial_state");
    let mut a = args(1, 8, 2, 2, D);
    a.final_state = Some(t(DType::BF16, &[1, 2, D, 128], 0xa000));
    shape_err(&a, "final_state");
    for d in [32, 96, 256] {
        shape_err(&args(1, 8, 2, 2, d), "q");
    }
}

#[test]
fn the_backward_refuses_head_dim_64() {
    let a = bwd_args(args(1, 8, 2, 2, D));
    let e = validate_bwd(&a).unwrap_err();
    assert!(matches!(e, FlashKdaError::HeadDimBackward(64)), "{e}");
    assert!(e.to_string().contains("head dim 128 only"), "{e}");
}

fn req(schedule: KernelSchedule, value_split: ValueSplit, operands: Operands) -> ScheduleRequest {
    ScheduleRequest {
        schedule,
        value_split,
        operands,
        ..Default::default()
    }
}

#[test]
fn head_dim_64_runs_only_on_the_workspace_schedule() {
    let p = validate(&args(1, 8192, 64, 64, D)).unwrap();
    let c = call_plan(&p, &ScheduleRequest::default(), H200_SMS).unwrap();
    assert_eq!(
        (c.schedule, c.split),
        (KernelSchedule::Workspace, ValueSplit::Two)
    );
    assert_eq!(
        c.workspace.total_bytes,
        workspace_slots(&p) * 64 * record_bytes(c.operands, D)
    );
    // Auto stays on the workspace schedule however large the workspace (no D=64 fallback)
    let huge = validate(&args(1, 1 << 22, 64, 64, D)).unwrap();
    let c = call_plan(&huge, &ScheduleRequest::default(), H200_SMS).unwrap();
    assert_eq!(c.schedule, KernelSchedule::Workspace);
    for s in [KernelSchedule::Sequential, KernelSchedule::Pipelined] {
        let e = call_plan(&p, &req(s, ValueSplit::Auto, Operands::Auto), H200_SMS).unwrap_err();
        assert!(
            matches!(e, FlashKdaError::HeadDimSchedule { head_dim: 64, .. }),
            "{e}"
        );
    }
    // value splits: One, Two, Four map onto kda_state_w4, w2, w1; Eight has no kernel
    for split in [ValueSplit::One, ValueSplit::Two, ValueSplit::Four] {
        for ops in [Operands::Bf16, Operands::Split] {
            let c = call_plan(&p, &req(KernelSchedule::Workspace, split, ops), H200_SMS).unwrap();
            assert_eq!((c.split, c.operands), (split, ops));
        }
    }
    let e = call_plan(
        &p,
        &req(KernelSchedule::Auto, ValueSplit::Eight, Operands::Auto),
        H200_SMS,
    )
    .unwrap_err();
    assert!(
        matches!(e, FlashKdaError::HeadDimSchedule { head_dim: 64, .. }),
        "{e}"
    );
    // at 128 Eight is still fine
    let p128 = validate(&args(1, 8192, 64, 64, 128)).unwrap();
    let req8 = req(KernelSchedule::Workspace, ValueSplit::Eight, Operands::Auto);
    assert!(call_plan(&p128, &req8, H200_SMS).is_ok());
}

#[test]
fn head_dim_64_records_and_segment_states_are_sized_for_64() {
    assert_eq!(record_bytes(Operands::Bf16, D), WORKSPACE_RECORD_BYTES_D64);
    assert_eq!(record_bytes(Operands::Split, D), SPLIT_RECORD_BYTES_D64);
    assert_eq!(state_f32_bytes(D), D * D * 4);
    // B=1, T=64K, H=4: context parallelism, one 4-warp block per segment and head
    let p = validate(&args(1, 65536, 4, 4, D)).unwrap();
    let c = call_plan(&p, &ScheduleRequest::default(), H200_SMS).unwrap();
    assert!(c.segments.active(), "{c:?}");
    assert_eq!(c.split, ValueSplit::One);
    let states = c.segments.segs_per_seq * 4;
    let rec = workspace_slots(&p) * 4 * record_bytes(c.operands, D);
    assert_eq!(c.workspace.records_bytes, rec);
    assert_eq!(c.workspace.pm_offset, rec);
    assert_eq!(c.workspace.starts_offset, rec + 2 * states * D * D * 4);
    assert_eq!(c.workspace.total_bytes, rec + 3 * states * D * D * 4);
    // forced segments, GVA
    let mut g = p.clone();
    g.qk_heads = 2;
    let r = ScheduleRequest {
        segment_chunks: Some(64),
        ..Default::default()
    };
    let c = call_plan(&g, &r, H200_SMS).unwrap();
    assert_eq!((c.segments.seg_chunks, c.split), (64, ValueSplit::One));
}
