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
        head_dim: HEAD_DIM,
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
            workspace_slots(&p) * h * record_bytes(operands, HEAD_DIM)
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
        (1 << 15) * 64 * record_bytes(c.operands, HEAD_DIM)
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
    assert_eq!(
        l.starts_offset - l.pm_offset,
        2 * 24 * 4 * state_f32_bytes(HEAD_DIM)
    );
    assert_eq!(
        l.total_bytes - l.starts_offset,
        24 * 4 * state_f32_bytes(HEAD_DIM)
    );
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
