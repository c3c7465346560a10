//! GPU backward tests: `flashkda::bwd` against the float64 reference gradient
//! (`reference::recurrence_grad_f64`) on fresh random inputs and upstream gradients, with every
//! gradient output NaN-poisoned (and canaried) before the kernels run. Skipped, with the reason
//! printed, where no Hopper GPU is; `K3_REQUIRE_GPU=1` turns the skip into a failure. Run with
//! `--test-threads=1`. `FLASHKDA_GPU_LOG=<file>` appends one JSON line per case;
//! `FLASHKDA_TEST_PASSES=<knob,...>` runs only those state-pass schedules.

mod common;
use common::{gpu, log_line, seed};
use std::sync::Arc;

use cudarc::driver::CudaStream;
use flashkda::harness::{DeviceProblem, StateIo};
use flashkda::reference::metrics::{rel_frobenius, rel_frobenius_floored};
use flashkda::reference::{HEAD_DIM, KdaGrads, KdaProblem, recurrence_grad_f64};
use flashkda::{BwdOptions, FlashKdaError, KdaKernels, PassSchedule, bwd};
use rand::{Rng, SeedableRng};

/// Every gradient within this relative Frobenius error of float64 (issue 13); the denominators of the
/// sums dbeta, dA_log and ddt_bias are floored at the norm of their uncancelled size
/// (`rel_frobenius_floored`, `KdaGrads::{dbeta,da_log,ddt_bias}_scale`).
const BAR: f64 = 1e-2;

fn bf16(x: f64) -> f32 {
    half::bf16::from_f64(x).to_f32()
}

struct Case<'a> {
    name: &'a str,
    seq_lens: Vec<usize>,
    heads: usize,
    qk_heads: usize,
    state: StateIo,
    batched: bool,
}

fn case(name: &str, seq_lens: Vec<usize>, heads: usize, state: StateIo) -> Case<'_> {
    Case {
        name,
        seq_lens,
        heads,
        qk_heads: heads,
        state,
        batched: false,
    }
}

/// Runs the backward of one case and checks every gradient against float64.
fn check(gpu: &(KdaKernels, Arc<CudaStream>), c: &Case<'_>) {
    let (kernels, stream) = gpu;
    let s = seed();
    let mut p = KdaProblem::random_gva(&c.seq_lens, c.heads, c.qk_heads, c.state.initial, s);
    if !c.state.initial {
        p.initial_state = None;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(s ^ 0xd0);
    let n_out = p.tokens() * p.heads * HEAD_DIM;
    let n_st = p.seq_lens.len() * p.heads * HEAD_DIM * HEAD_DIM;
    // upstream gradients, bf16-representable so both sides see the same values
    let dout: Vec<f32> = (0..n_out)
        .map(|_| bf16(rng.random::<f64>() - 0.5))
        .collect();
    let dfinal: Option<Vec<f32>> = c.state.final_.then(|| {
        (0..n_st)
            .map(|_| bf16(0.1 * (rng.random::<f64>() - 0.5)))
            .collect()
    });
    let dev = DeviceProblem::upload(stream, &p, c.state, c.batched).expect("upload");
    let d64: Vec<f64> = dout.iter().map(|&x| f64::from(x)).collect();
    let df64: Option<Vec<f64>> = dfinal
        .as_ref()
        .map(|d| d.iter().map(|&x| f64::from(x)).collect());
    let want: KdaGrads = recurrence_grad_f64(&p, &d64, df64.as_deref());
    // every state-pass schedule on the same inputs, fresh poisoned outputs each time;
    // FLASHKDA_TEST_NO_OVERLAP=1 skips the prep overlap (under compute-sanitizer, which serializes
    // kernels and would leave the forward pass waiting on flags of a prep that cannot start)
    let no_overlap = std::env::var("FLASHKDA_TEST_NO_OVERLAP").is_ok_and(|v| v == "1");
    for passes in schedules() {
        if no_overlap
            && matches!(
                passes,
                PassSchedule::Concurrent {
                    overlap_prep: true,
                    ..
                }
            )
        {
            continue;
        }
        let grads = dev
            .grads(&dout, dfinal.as_deref(), c.state.initial, c.state.fp32)
            .expect("grad buffers");
        let opts = BwdOptions {
            passes,
            ..BwdOptions::default()
        };
        bwd(kernels, stream, &dev.bwd_args(&grads), &opts)
            .unwrap_or_else(|e| panic!("{} {passes:?}: bwd failed: {e}", c.name));
        stream
            .synchronize()
            .unwrap_or_else(|e| panic!("{} {passes:?}: kernel failed: {e}", c.name));
        let got: KdaGrads = dev
            .read_grads(&grads)
            .unwrap_or_else(|e| panic!("{} {passes:?}: {e}", c.name));
        compare(c, &p, s, passes, &got, &want);
    }
}

/// The state-pass schedules every case runs under.
const SCHEDULES: [PassSchedule; 10] = [
    PassSchedule::ConcurrentV {
        stages: 2,
        staging: 3,
    },
    PassSchedule::ConcurrentV {
        stages: 3,
        staging: 3,
    },
    PassSchedule::ConcurrentV {
        stages: 2,
        staging: 2,
    },
    PassSchedule::ConcurrentV {
        stages: 3,
        staging: 2,
    },
    PassSchedule::ConcurrentV {
        stages: 4,
        staging: 1,
    },
    PassSchedule::Concurrent {
        warps: 4,
        overlap_prep: true,
    },
    PassSchedule::Concurrent {
        warps: 2,
        overlap_prep: false,
    },
    PassSchedule::Concurrent {
        warps: 4,
        overlap_prep: false,
    },
    PassSchedule::Sequential { warps: 2 },
    PassSchedule::Sequential { warps: 4 },
];

/// The schedules of this run: `FLASHKDA_TEST_PASSES=conc4d2,conc4d3,...` (knobs of `PassSchedule::parse`)
/// picks some (e.g. for the sanitizers), default all of [`SCHEDULES`].
fn schedules() -> Vec<PassSchedule> {
    match std::env::var("FLASHKDA_TEST_PASSES") {
        Ok(v) if !v.trim().is_empty() => v
            .split(',')
            .map(|k| {
                PassSchedule::parse(k.trim())
                    .unwrap_or_else(|| panic!("FLASHKDA_TEST_PASSES: unknown knob {k:?}"))
            })
            .collect(),
        _ => SCHEDULES.to_vec(),
    }
}

/// Checks one schedule's gradients against float64 (all written, within [`BAR`]); logs a line.
fn compare(
    c: &Case<'_>,
    p: &KdaProblem,
    s: u64,
    passes: PassSchedule,
    got: &KdaGrads,
    want: &KdaGrads,
) {
    let mut pairs: Vec<(&str, &[f64], &[f64])> = vec![
        ("dq", &got.dq, &want.dq),
        ("dk", &got.dk, &want.dk),
        ("dv", &got.dv, &want.dv),
        ("dg", &got.dg, &want.dg),
        ("dbeta", &got.dbeta, &want.dbeta),
        ("dA_log", &got.da_log, &want.da_log),
        ("ddt_bias", &got.ddt_bias, &want.ddt_bias),
    ];
    if c.state.initial {
        pairs.push(("dinitial_state", &got.dinitial_state, &want.dinitial_state));
    }
    // the checked error: relative Frobenius; the sums (dbeta: 128 terms per token, dA_log and
    // ddt_bias: over tokens, which cancel on short inputs with few heads) against
    // max(|reference|, |scale|)
    let floors: [(&str, &[f64]); 3] = [
        ("dbeta", &want.dbeta_scale),
        ("dA_log", &want.da_log_scale),
        ("ddt_bias", &want.ddt_bias_scale),
    ];
    let err = |name: &str, g: &[f64], w: &[f64]| match floors.iter().find(|f| f.0 == name) {
        Some((_, scale)) => rel_frobenius_floored(g, w, scale),
        None => rel_frobenius(g, w),
    };
    let mut fields = Vec::new();
    let mut worst = 0.0f64;
    for (name, g, w) in &pairs {
        let nonfinite = g.iter().filter(|x| !x.is_finite()).count();
        assert_eq!(
            nonfinite, 0,
            "{} {passes:?}: {name}: {nonfinite} elements not written (still NaN) or non-finite (seed {s})",
            c.name
        );
        let e = err(name, g, w);
        worst = worst.max(e);
        fields.push(format!("\"{name}\":{e:e}"));
    }
    // the plain relative errors of the floored ones too (what the logs before bwd5 called "dbeta", ...)
    for (name, g, w) in &pairs {
        if floors.iter().any(|f| f.0 == *name) {
            fields.push(format!("\"{name}_plain\":{:e}", rel_frobenius(g, w)));
        }
    }
    log_line(&format!(
        "{{\"bwd_case\":\"{}\",\"passes\":\"{passes:?}\",\"seq_lens\":\"{}\",\"H\":{},\"H_qk\":{},\"state\":\"{}\",\"batched\":{},\"seed\":{s},{},\"worst\":{worst:e}}}",
        c.name,
        if c.seq_lens.len() > 8 {
            format!("{} seqs, {} tokens", c.seq_lens.len(), p.tokens())
        } else {
            format!("{:?}", c.seq_lens)
        },
        c.heads,
        c.qk_heads,
        c.state.label(),
        c.batched,
        fields.join(",")
    ));
    for (name, g, w) in &pairs {
        let e = err(name, g, w);
        assert!(
            e <= BAR,
            "{} {passes:?}: {name} rel error {e:e} > {BAR:e} (seed {s})",
            c.name
        );
    }
}

#[test]
fn bwd_smoke() {
    let Some(g) = gpu() else { return };
    check(
        &g,
        &case("bwd-smoke-fixed", vec![37], 2, StateIo::both(true)),
    );
    check(
        &g,
        &case(
            "bwd-smoke-varlen",
            vec![17, 0, 33, 65],
            2,
            StateIo::both(false),
        ),
    );
}

#[test]
fn bwd_edge_cases_match_float64() {
    let Some(g) = gpu() else { return };
    let fp32 = StateIo::both(true);
    let bf16 = StateIo::both(false);
    for t in [1, 15, 16, 17, 63, 64, 65, 1000] {
        check(&g, &case("bwd-fixed", vec![t], 4, fp32));
    }
    check(&g, &case("bwd-no-state", vec![97], 4, StateIo::NONE));
    let out_only = StateIo {
        initial: false,
        final_: true,
        fp32: true,
    };
    check(&g, &case("bwd-zero-initial-state", vec![200], 4, out_only));
    let in_only = StateIo {
        initial: true,
        final_: false,
        fp32: false,
    };
    check(&g, &case("bwd-initial-only", vec![200], 4, in_only));
    check(&g, &case("bwd-bf16-state", vec![300], 4, bf16));
    check(&g, &case("bwd-H=1", vec![37], 1, fp32));
    check(&g, &case("bwd-varlen-16x2", vec![16, 16], 2, fp32));
    check(&g, &case("bwd-varlen-4-8-12", vec![4, 8, 12], 2, bf16));
    check(&g, &case("bwd-varlen-with-empty", vec![5, 0, 20], 2, fp32));
    let lens: Vec<usize> = (0..40)
        .map(|i| {
            1 + (seed() as usize)
                .wrapping_mul(2654435761)
                .wrapping_add(i * 7919)
                % 300
        })
        .collect();
    check(&g, &case("bwd-many-short", lens, 2, fp32));
    check(
        &g,
        &Case {
            batched: true,
            ..case("bwd-batched-B3", vec![100, 100, 100], 4, bf16)
        },
    );
    check(
        &g,
        &Case {
            qk_heads: 2,
            ..case("bwd-gva-8-over-2", vec![100, 37], 8, fp32)
        },
    );
    check(&g, &case("bwd-long-16384", vec![16384], 1, fp32));
}

/// The smallest cases, where a relative error over few elements is noisiest (dbeta on 37 tokens of
/// one head, dA_log of that one head, dbeta on one token of four heads), over
/// `FLASHKDA_TEST_REPEAT` fresh seeds (default 4; bwd5 ran 200).
#[test]
fn bwd_small_cases_over_many_seeds() {
    let Some(g) = gpu() else { return };
    let n: usize = std::env::var("FLASHKDA_TEST_REPEAT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    for _ in 0..n {
        check(&g, &case("bwd-H=1", vec![37], 1, StateIo::both(true)));
        check(&g, &case("bwd-fixed", vec![1], 4, StateIo::both(true)));
    }
}

/// The anchor shapes' sequence lengths (fixed 8192, varlen6, 1024 x 8) at 8 heads (the float64
/// reference gradient on the CPU bounds the head count).
#[test]
fn bwd_anchor_lengths_match_float64() {
    let Some(g) = gpu() else { return };
    let varlen6 = vec![1300, 547, 2048, 963, 271, 3063];
    for (name, lens, state) in [
        ("bwd-anchor-fixed-H8", vec![8192], StateIo::both(true)),
        ("bwd-anchor-varlen6-H8", varlen6, StateIo::both(false)),
        ("bwd-anchor-1024x8-H8", vec![1024; 8], StateIo::both(true)),
    ] {
        check(&g, &case(name, lens, 8, state));
    }
}

#[test]
fn bwd_rejects_bad_gradients() {
    let Some((kernels, stream)) = gpu() else {
        return;
    };
    let p = KdaProblem::random(&[20], 2, true, seed());
    let dev = DeviceProblem::upload(&stream, &p, StateIo::both(true), false).expect("upload");
    let dout = vec![0.0f32; 20 * 2 * HEAD_DIM];
    let grads = dev.grads(&dout, None, true, true).expect("grads");
    let mut a = dev.bwd_args(&grads);
    a.dq.shape[1] = 19;
    let e = bwd(&kernels, &stream, &a, &BwdOptions::default()).unwrap_err();
    assert!(
        matches!(e, FlashKdaError::Shape { tensor: "dq", .. }),
        "{e}"
    );
    let mut a = dev.bwd_args(&grads);
    a.da_log.dtype = flashkda::DType::BF16;
    let e = bwd(&kernels, &stream, &a, &BwdOptions::default()).unwrap_err();
    assert!(
        matches!(
            e,
            FlashKdaError::DType {
                tensor: "dA_log",
                ..
            }
        ),
        "{e}"
    );
}
