//! GPU accuracy tests at head dim 64 (K = V = 64, `kernels/kda_fwd_ws{,_split}_d64.cu`): every
//! variant the schedule allows at 64 against the float64 recurrence (and the kernel-rounding
//! emulation) on fresh random inputs, NaN-poisoned outputs and canaries, with the bars of
//! `tests/gpu.rs`; the refusals (other schedules, `ValueSplit::Eight`) are typed. Their first device
//! run (2026-12-05, `bench-results/2026-12-05-d64/`) lifted the head-dim-64 gate.
//! Skipped, with the reason printed, where no Hopper GPU is. Run with `--test-threads=1`;
//! `FLASHKDA_GPU_LOG=<file>` appends one JSON line per case, `FLASHKDA_TEST_KERNELS` picks variants.

mod common;
use common::{gpu, log_line, picked_variants, run_fwd, seed};
use std::sync::Arc;

use cudarc::driver::CudaStream;
use flashkda::harness::{DeviceProblem, StateIo};
use flashkda::reference::emulated::{Rounding, emulated_with};
use flashkda::reference::metrics::rel_frobenius;
use flashkda::reference::{KdaOutput, KdaProblem, recurrence_f64};
use flashkda::{FlashKdaError, FwdOptions, KdaKernels, KernelSchedule, Operands, ValueSplit, fwd};

const D: usize = 64;
/// The bars of `tests/gpu.rs`: against float64, against the emulation, split operands vs float64.
const BAR_F64: f64 = 6e-3;
const BAR_EMULATED: f64 = 3e-3;
const BAR_SPLIT: f64 = 4e-3;

/// (name, schedule, value split, segment chunks, operands, overlap).
type Variant = (
    &'static str,
    KernelSchedule,
    ValueSplit,
    Option<usize>,
    Operands,
    Option<bool>,
);

/// What runs at head dim 64: `kda_state_w4` (One), `w2` (Two), `w1` (Four), the segmented passes
/// (`cp3`: 3-chunk segments on fixed-length calls), both operand kinds, the overlapped passes, and
/// the default call.
const VARIANTS: [Variant; 10] = [
    (
        "d64-ws-1",
        KernelSchedule::Workspace,
        ValueSplit::One,
        Some(0),
        Operands::Bf16,
        None,
    ),
    (
        "d64-ws-2",
        KernelSchedule::Workspace,
        ValueSplit::Two,
        Some(0),
        Operands::Bf16,
        None,
    ),
    (
        "d64-ws-4",
        KernelSchedule::Workspace,
        ValueSplit::Four,
        Some(0),
        Operands::Bf16,
        None,
    ),
    (
        "d64-ws-cp3",
        KernelSchedule::Workspace,
        ValueSplit::Auto,
        Some(3),
        Operands::Bf16,
        None,
    ),
    (
        "d64-split-1",
        KernelSchedule::Workspace,
        ValueSplit::One,
        Some(0),
        Operands::Split,
        None,
    ),
    (
        "d64-split-2",
        KernelSchedule::Workspace,
        ValueSplit::Two,
        Some(0),
        Operands::Split,
        None,
    ),
    (
        "d64-split-4",
        KernelSchedule::Workspace,
        ValueSplit::Four,
        Some(0),
        Operands::Split,
        None,
    ),
    (
        "d64-split-cp3",
        KernelSchedule::Workspace,
        ValueSplit::Auto,
        Some(3),
        Operands::Split,
        None,
    ),
    (
        "d64-split-overlap",
        KernelSchedule::Workspace,
        ValueSplit::Two,
        Some(0),
        Operands::Split,
        Some(true),
    ),
    (
        "d64-default",
        KernelSchedule::Auto,
        ValueSplit::Auto,
        None,
        Operands::Auto,
        None,
    ),
];

fn variants() -> Vec<Variant> {
    picked_variants(VARIANTS, |v| v.0, "d64 variant")
}

/// The call options of a variant.
fn options((_, schedule, value_split, segment_chunks, operands, overlap): Variant) -> FwdOptions {
    FwdOptions {
        value_split,
        schedule,
        segment_chunks,
        operands,
        overlap,
        ..Default::default()
    }
}

/// The device, or `None` (skip). Head dim 64 needs no opt-in since its first device run (2026-12-05).
fn gpu64() -> Option<(KdaKernels, Arc<CudaStream>)> {
    gpu()
}

struct Case<'a> {
    name: &'a str,
    seq_lens: Vec<usize>,
    heads: usize,
    qk_heads: usize,
    state: StateIo,
    batched: bool,
    emulate: bool,
    /// Only the default call (long cases).
    default_only: bool,
}

fn case(name: &str, seq_lens: Vec<usize>, heads: usize, state: StateIo) -> Case<'_> {
    Case {
        name,
        seq_lens,
        heads,
        qk_heads: heads,
        state,
        batched: false,
        emulate: true,
        default_only: false,
    }
}

/// Runs one case with every head-dim-64 variant on the same inputs against one reference.
fn check(gpu: &(KdaKernels, Arc<CudaStream>), c: &Case<'_>) {
    let (kernels, stream) = gpu;
    let s = seed();
    let mut p = KdaProblem::random_dim(&c.seq_lens, c.heads, c.qk_heads, D, c.state.initial, s);
    if !c.state.initial {
        p.initial_state = None;
    }
    let mut dev = DeviceProblem::upload(stream, &p, c.state, c.batched).expect("upload");
    let reference: KdaOutput = recurrence_f64(&p);
    let mut emulations: [Option<KdaOutput>; 2] = [None, None];
    for v in variants() {
        let (variant, opts) = (v.0, options(v));
        if c.default_only && variant != "d64-default" {
            continue;
        }
        dev.poison().expect("poison");
        let name = format!("{} [{variant}] seed {s}", c.name);
        let call = kernels
            .call_plan(&flashkda::validate(&dev.args()).unwrap(), &opts)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let split_ops = call.operands == Operands::Split;
        let run = run_fwd(gpu, &dev, &opts, c.state, &reference, &name);
        let (nan_out, nan_st) = (run.nonfinite_out, run.nonfinite_state);
        let (eo, es) = (run.rel_out, run.rel_state);
        let (mut emo, mut ems) = (f64::NAN, f64::NAN);
        if c.emulate && !call.segments.active() {
            let (i, r) = if split_ops {
                (1, Rounding::SPLIT)
            } else {
                (0, Rounding::KERNEL)
            };
            let e = emulations[i].get_or_insert_with(|| emulated_with(&p, r));
            emo = rel_frobenius(&run.out, &e.out);
            ems = c.state.final_state_error(&run.state, &e.final_state);
        }
        log_line(&format!(
            "{{\"case\":\"{}\",\"head_dim\":{D},\"seq_lens\":\"{:?}\",\"H\":{},\"H_qk\":{},\"state\":\"{}\",\"variant\":\"{variant}\",\
             \"seed\":{s},\"split\":\"{:?}\",\"operands\":\"{:?}\",\"segments\":{},\"rel_out_f64\":{eo:e},\"rel_state_f64\":{es:e},\
             \"rel_out_emulated\":{emo:e},\"rel_state_emulated\":{ems:e},\"nonfinite_out\":{nan_out},\"nonfinite_state\":{nan_st}}}",
            c.name,
            c.seq_lens,
            c.heads,
            c.qk_heads,
            c.state.label(),
            call.split,
            call.operands,
            call.segments.segs_per_seq,
        ));
        run.assert_written_within(BAR_F64, &name);
        if split_ops {
            assert!(
                eo <= BAR_SPLIT && es <= BAR_SPLIT,
                "{name}: split operands out {eo:e} state {es:e} > {BAR_SPLIT:e}"
            );
        }
        if !emo.is_nan() {
            assert!(
                emo <= BAR_EMULATED && ems <= BAR_EMULATED,
                "{name}: vs emulation out {emo:e} state {ems:e}"
            );
        }
    }
}

/// Small cases first (a broken kernel faults here, before the longer tests).
#[test]
fn d64_smoke_small_cases() {
    let Some(g) = gpu64() else { return };
    check(
        &g,
        &case("d64-smoke-fixed", vec![37], 4, StateIo::both(true)),
    );
    check(
        &g,
        &case(
            "d64-smoke-varlen",
            vec![17, 0, 33, 65],
            4,
            StateIo::both(false),
        ),
    );
}

#[test]
fn d64_fixed_varlen_tails_and_states_match_float64() {
    let Some(g) = gpu64() else { return };
    let fp32 = StateIo::both(true);
    let bf16 = StateIo::both(false);
    for t in [1, 15, 16, 17, 1000] {
        check(&g, &case("d64-fixed", vec![t], 4, fp32));
    }
    check(&g, &case("d64-fixed-no-state", vec![97], 4, StateIo::NONE));
    check(&g, &case("d64-bf16-state", vec![300], 4, bf16));
    let out_only = StateIo {
        initial: false,
        final_: true,
        fp32: true,
    };
    check(
        &g,
        &case("d64-zero-initial-out-only", vec![200], 4, out_only),
    );
    check(
        &g,
        &case("d64-varlen-tails", vec![17, 33, 65, 1, 100], 4, fp32),
    );
    check(
        &g,
        &case("d64-varlen-with-empty-bf16", vec![5, 0, 20], 2, bf16),
    );
    check(
        &g,
        &Case {
            batched: true,
            ..case("d64-batched-B3", vec![100, 100, 100], 4, bf16)
        },
    );
    check(&g, &case("d64-H=1", vec![37], 1, fp32));
}

#[test]
fn d64_gva_matches_float64() {
    let Some(g) = gpu64() else { return };
    for (name, lens, h, hq) in [
        ("d64-gva-8-over-2", vec![100, 37], 8, 2),
        ("d64-gva-4-over-1", vec![300], 4, 1),
    ] {
        check(
            &g,
            &Case {
                qk_heads: hq,
                ..case(name, lens, h, StateIo::both(true))
            },
        );
    }
}

/// Context parallelism at head dim 64: the automatic split of a long single sequence (checked
/// active) and the forced 3-chunk segments of the `cp3` variants on every fixed-length case.
#[test]
fn d64_context_parallel_split_matches_float64() {
    let Some(g) = gpu64() else { return };
    let (kernels, _) = &g;
    let plan = flashkda::FwdPlan {
        batch: 1,
        seq_len: 30001,
        heads: 2,
        qk_heads: 2,
        num_seqs: 1,
        varlen: false,
        state: None,
        ordinal: 0,
        head_dim: D,
    };
    let auto = kernels.call_plan(&plan, &FwdOptions::default()).unwrap();
    assert!(auto.segments.active(), "{auto:?}");
    assert_eq!(auto.split, ValueSplit::One);
    for (name, state) in [
        ("d64-cp-auto-30001", StateIo::both(true)),
        ("d64-cp-auto-30001-bf16", StateIo::both(false)),
    ] {
        check(
            &g,
            &Case {
                emulate: false,
                default_only: true,
                ..case(name, vec![30001], 2, state)
            },
        );
    }
}

/// What is not built at head dim 64 is refused with a typed error before any launch.
#[test]
fn d64_unbuilt_variants_are_refused() {
    let Some(g) = gpu64() else { return };
    let (kernels, stream) = &g;
    let p = KdaProblem::random_dim(&[40], 2, 2, D, false, seed());
    let dev = DeviceProblem::upload(stream, &p, StateIo::NONE, false).unwrap();
    for (schedule, split) in [
        (KernelSchedule::Sequential, ValueSplit::Auto),
        (KernelSchedule::Pipelined, ValueSplit::Auto),
        (KernelSchedule::Workspace, ValueSplit::Eight),
    ] {
        let opts = FwdOptions {
            schedule,
            value_split: split,
            ..Default::default()
        };
        let e = fwd(kernels, stream, &dev.args(), &opts).unwrap_err();
        assert!(
            matches!(e, FlashKdaError::HeadDimSchedule { head_dim: 64, .. }),
            "{schedule:?} {split:?}: {e}"
        );
    }
}

/// Two runs of every variant on the same inputs are bitwise equal (output and fp32 final state).
#[test]
fn d64_deterministic() {
    let Some(g) = gpu64() else { return };
    let (kernels, stream) = &g;
    let p = KdaProblem::random_dim(&[300, 45], 8, 8, D, true, seed());
    let mut dev = DeviceProblem::upload(stream, &p, StateIo::both(true), false).unwrap();
    for v in variants() {
        let (variant, opts) = (v.0, options(v));
        let mut runs = Vec::new();
        for _ in 0..2 {
            dev.poison().unwrap();
            fwd(kernels, stream, &dev.args(), &opts).unwrap_or_else(|e| panic!("{variant}: {e}"));
            stream.synchronize().unwrap();
            runs.push(dev.read().unwrap());
        }
        let same = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(
            same(&runs[0].0, &runs[1].0),
            "{variant}: output differs between runs"
        );
        assert!(
            same(&runs[0].1, &runs[1].1),
            "{variant}: state differs between runs"
        );
    }
}
