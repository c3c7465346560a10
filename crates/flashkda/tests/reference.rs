//! CPU reference tests (run in CI, no GPU needed).

mod reference_common;
use reference_common::{
    assert_chunked_matches_recurrence, assert_segmented_matches_recurrence,
    assert_single_token_output, repeat_qk_heads, seed,
};

use flashkda::reference::emulated::emulated;
use flashkda::reference::metrics::{max_abs_diff, rel_frobenius};
use flashkda::reference::{HEAD_DIM, KdaProblem, chunked_f64, recurrence_f64};

#[test]
fn chunked_form_matches_recurrence_varlen_with_state() {
    let p = KdaProblem::random(&[1, 15, 17, 40, 16], 2, true, seed());
    assert_chunked_matches_recurrence(&p);
}

#[test]
fn chunked_form_matches_recurrence_extreme_gates() {
    let mut p = KdaProblem::random(&[50], 2, false, seed());
    // large gate inputs saturate the decay at the lower bound (alpha = e^-5 per token)
    for (i, g) in p.g.iter_mut().enumerate() {
        *g = if i % 3 == 0 { 8.0 } else { -8.0 };
    }
    p.a_log.iter_mut().for_each(|a| *a = 0.0);
    let (r, c) = (recurrence_f64(&p), chunked_f64(&p, 16));
    let eo = rel_frobenius(&c.out, &r.out);
    assert!(eo < 1e-12, "out {eo:e}");
}

#[test]
fn single_token_output_is_scaled_beta_value() {
    assert_single_token_output(KdaProblem::random(&[1], 1, false, seed()));
}

#[test]
fn zero_length_sequence_passes_state_through() {
    let p = KdaProblem::random(&[7, 0, 9], 2, true, seed());
    let hd2 = HEAD_DIM * HEAD_DIM;
    for out in [recurrence_f64(&p), chunked_f64(&p, 16), emulated(&p)] {
        let h0 = p.initial_state.as_ref().unwrap();
        for h in 0..2 {
            let at = (2 + h) * hd2; // sequence 1, head h
            let same = out.final_state[at..at + hd2]
                .iter()
                .zip(&h0[at..at + hd2])
                .all(|(a, b)| *a == f64::from(*b));
            assert!(same, "head {h}: zero-length sequence changed its state");
        }
    }
}

#[test]
fn emulated_rounding_stays_within_bf16_error_of_float64() {
    let p = KdaProblem::random(&[100, 37], 3, true, seed());
    let (r, e) = (recurrence_f64(&p), emulated(&p));
    let (eo, es) = e.rel_errors(&r);
    println!(
        "emulated vs f64: out {eo:e} state {es:e} max|d| {:e}",
        max_abs_diff(&e.out, &r.out)
    );
    assert!(
        eo > 1e-5,
        "the emulation must actually round (out rel {eo:e})"
    );
    assert!(eo < 6e-3 && es < 6e-3, "out {eo:e} state {es:e}");
}

#[test]
fn kernels_compiled_when_required() {
    let required = std::env::var("K3_REQUIRE_KERNELS").is_ok_and(|v| v == "1");
    println!(
        "kernels built: {} ({})",
        flashkda::kernels_built(),
        flashkda::KERNELS_BUILT_ENV
    );
    if required {
        assert_eq!(
            flashkda::KERNELS_BUILT_ENV,
            "1",
            "K3_REQUIRE_KERNELS=1 but the sm_90a kernels were not compiled"
        );
        assert!(flashkda::kernels_built());
    } else {
        assert_eq!(
            flashkda::kernels_built(),
            flashkda::KERNELS_BUILT_ENV == "1"
        );
    }
}

#[test]
fn segmented_form_matches_recurrence() {
    // ragged tails, one-chunk segments, segments longer than the sequence, zero-length sequences
    let p = KdaProblem::random(&[1, 37, 100, 0, 64], 2, true, seed());
    assert_segmented_matches_recurrence(p);
}

#[test]
fn gva_equals_repeated_query_key_heads() {
    // value head h of a GVA problem reads q/k head h / (H / H_qk): the same as repeating them
    let g = KdaProblem::random_gva(&[40, 17], 6, 2, true, seed());
    let full = repeat_qk_heads(&g);
    let (a, b) = (recurrence_f64(&g), recurrence_f64(&full));
    assert_eq!(a.out, b.out);
    assert_eq!(a.final_state, b.final_state);
    let (ea, eb) = (emulated(&g), emulated(&full));
    assert_eq!(ea.out, eb.out);
    let c = chunked_f64(&g, 16);
    assert!(rel_frobenius(&c.out, &a.out) < 1e-12);
}

/// `<dout, out> + <dfinal, final_state>` of the float64 recurrence.
fn loss(p: &KdaProblem, dout: &[f64], dfinal: &[f64]) -> f64 {
    let r = recurrence_f64(p);
    let a: f64 = r.out.iter().zip(dout).map(|(x, y)| x * y).sum();
    let b: f64 = r.final_state.iter().zip(dfinal).map(|(x, y)| x * y).sum();
    a + b
}

/// Finite-difference step. Exact in f32 for the bf16 inputs, but A_log and dt_bias are f32 `U(0,1)`:
/// `x + h` rounds where it crosses 1, so the quotient divides by the step actually taken.
const FD_STEP: f32 = 1.0 / 1024.0;
/// Relative tolerance on top of the finite differences' own error estimate (Richardson's residual is
/// O(h^4); observed: at most about 1e-8 of the gradient's norm, mostly 1e-12..1e-10).
const FD_RTOL: f64 = 1e-6;

/// One gradient field at its sampled coordinates: the analytic gradient and the central
/// differences `D(h)`, `D(h/2)` (see [`fd_fields`] for the error model).
#[derive(Debug)]
struct FdField {
    name: String,
    an: Vec<f64>,
    d1: Vec<f64>,
    d2: Vec<f64>,
    /// Bound on the loss's float64 rounding in one difference quotient.
    rounding: f64,
}

impl FdField {
    /// (`||R - scale an||`, its tolerance) with `R = (4 D(h/2) - D(h)) / 3`.
    fn err_tol(&self, scale: f64) -> (f64, f64) {
        let norm =
            |f: &dyn Fn(usize) -> f64| (0..self.an.len()).map(|i| f(i).powi(2)).sum::<f64>().sqrt();
        let err = norm(&|i| (4.0 * self.d2[i] - self.d1[i]) / 3.0 - scale * self.an[i]);
        let trunc = norm(&|i| self.d1[i] - self.d2[i]);
        let an = norm(&|i| scale * self.an[i]);
        let n = (self.an.len() as f64).sqrt();
        (err, FD_RTOL * an + trunc + self.rounding * n)
    }

    /// Whether the analytic gradient times `scale` passes.
    fn ok(&self, scale: f64) -> bool {
        let (e, t) = self.err_tol(scale);
        e <= t
    }
}

/// Samples every gradient of `p` and the central differences of the float64 recurrence's loss at 8
/// random coordinates per input; `dfinal`: a random upstream gradient of the final state.
///
/// Error model: the central difference `D(h) = f' + c h^2 + O(h^4)`, so the Richardson value
/// `R = (4 D(h/2) - D(h)) / 3` is `f' + O(h^4)`, and `|D(h) - D(h/2)| = 3/4 |c| h^2` is (far more
/// than) a bound on `R`'s truncation error, known per coordinate. The loss's float64 rounding enters
/// `R` as about `3 eps |L| / h`, bounded here by `64 eps sum|terms| / h`. A field passes when
/// `||R - an|| <= FD_RTOL ||an|| + ||D(h) - D(h/2)|| + rounding`: the truncation term keeps a
/// gradient that is near zero at the sampled coordinates (dA_log has one per head) from failing on
/// the differences' own error, while a gradient off by 1 % misses by orders of magnitude.
fn fd_fields(p: &KdaProblem, dfinal: bool, s: u64) -> Vec<FdField> {
    use flashkda::reference::recurrence_grad_f64;
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(s ^ 0x9e37);
    let n_out = p.tokens() * p.heads * HEAD_DIM;
    let n_st = p.seq_lens.len() * p.heads * HEAD_DIM * HEAD_DIM;
    let dout: Vec<f64> = (0..n_out).map(|_| rng.random::<f64>() - 0.5).collect();
    let df: Vec<f64> = if dfinal {
        (0..n_st).map(|_| rng.random::<f64>() - 0.5).collect()
    } else {
        vec![0.0; n_st]
    };
    let g = recurrence_grad_f64(p, &dout, dfinal.then_some(&df[..]));
    // magnitude of the loss's terms, for its rounding error
    let r = recurrence_f64(p);
    let l1: f64 = r
        .out
        .iter()
        .zip(&dout)
        .map(|(x, y)| (x * y).abs())
        .sum::<f64>()
        + r.final_state
            .iter()
            .zip(&df)
            .map(|(x, y)| (x * y).abs())
            .sum::<f64>();
    let rounding = f64::EPSILON * l1 * 64.0 / f64::from(FD_STEP);
    type Field = fn(&mut KdaProblem) -> &mut Vec<f32>;
    let fields: [(&str, Field, &[f64]); 7] = [
        ("q", |p| &mut p.q, &g.dq),
        ("k", |p| &mut p.k, &g.dk),
        ("v", |p| &mut p.v, &g.dv),
        ("g", |p| &mut p.g, &g.dg),
        ("beta", |p| &mut p.beta, &g.dbeta),
        ("A_log", |p| &mut p.a_log, &g.da_log),
        ("dt_bias", |p| &mut p.dt_bias, &g.ddt_bias),
    ];
    let mut out = Vec::new();
    let mut check =
        |name: &str, set: &dyn Fn(&mut KdaProblem, usize, f32) -> f32, len: usize, an: &[f64]| {
            // (L(x + h) - L(x - h)) / ((x + h) - (x - h)), the inputs as rounded to f32
            let central = |i: usize, h: f32| {
                let mut hi = p.clone();
                let xh = set(&mut hi, i, h);
                let mut lo = p.clone();
                let xl = set(&mut lo, i, -h);
                (loss(&hi, &dout, &df) - loss(&lo, &dout, &df)) / (f64::from(xh) - f64::from(xl))
            };
            let idx: Vec<usize> = (0..8).map(|_| rng.random_range(0..len)).collect();
            out.push(FdField {
                name: format!("d{name}"),
                an: idx.iter().map(|&i| an[i]).collect(),
                d1: idx.iter().map(|&i| central(i, FD_STEP)).collect(),
                d2: idx.iter().map(|&i| central(i, FD_STEP / 2.0)).collect(),
                rounding,
            });
        };
    for (name, field, an) in fields {
        let len = field(&mut p.clone()).len();
        let set = |q: &mut KdaProblem, i: usize, d: f32| {
            field(q)[i] += d;
            field(q)[i]
        };
        check(name, &set, len, an);
    }
    if p.initial_state.is_some() {
        check(
            "initial_state",
            &|q: &mut KdaProblem, i, d| {
                let x = &mut q.initial_state.as_mut().unwrap()[i];
                *x += d;
                *x
            },
            n_st,
            &g.dinitial_state,
        );
    } else {
        assert!(g.dinitial_state.iter().all(|&x| x == 0.0));
    }
    out
}

/// Checks every gradient of `p` against finite differences ([`fd_fields`]).
fn check_gradient(p: KdaProblem, dfinal: bool, s: u64) {
    for f in fd_fields(&p, dfinal, s) {
        let (e, t) = f.err_tol(1.0);
        println!("{}: |R - an| {e:e} <= {t:e}", f.name);
        assert!(
            e <= t,
            "{}: |R - an| {e:e} > {t:e}: {f:?} (seed {s})",
            f.name
        );
    }
}

/// The problems the finite-difference test runs for one seed: (problem, with d(final state), seed).
fn fd_problems(s: u64) -> [(KdaProblem, bool, u64); 4] {
    [
        // varlen, GVA (2 value heads over 1 q/k head), an initial state, d(final state)
        (KdaProblem::random_gva(&[6, 3], 2, 1, true, s), true, s),
        // fixed length across two reference checkpoints (64 tokens), no state, dout only
        (KdaProblem::random(&[70], 1, false, s ^ 1), false, s ^ 1),
        // varlen without an initial state but with d(final state); batched-like equal lengths
        (KdaProblem::random(&[5, 5, 9], 2, false, s ^ 2), true, s ^ 2),
        // fixed length with an initial state and no d(final state)
        (KdaProblem::random(&[20], 1, true, s ^ 3), false, s ^ 3),
    ]
}

#[test]
fn reference_gradient_matches_finite_differences() {
    for (p, dfinal, s) in fd_problems(seed()) {
        check_gradient(p, dfinal, s);
    }
}

/// The finite-difference check can fail: every field of a gradient scaled by 1.01 misses by over
/// 100 times its tolerance (fixed seeds, so this test of the checker is deterministic).
#[test]
fn finite_difference_check_rejects_a_gradient_off_by_one_percent() {
    for s in [1, 2] {
        let (p, dfinal, s) = fd_problems(s).into_iter().next().unwrap();
        for f in fd_fields(&p, dfinal, s) {
            let (e, t) = f.err_tol(1.01);
            assert!(
                e > 100.0 * t,
                "{}: a 1 % error: {e:e} vs {t:e} (seed {s})",
                f.name
            );
            assert!(f.ok(1.0), "{}: {f:?} (seed {s})", f.name);
        }
    }
}

#[test]
fn chunked_gradient_equals_the_token_recurrence_gradient() {
    use flashkda::reference::{chunked_grad_f64, recurrence_grad_f64};
    use rand::{Rng, SeedableRng};
    let s = seed();
    let mut rng = rand::rngs::StdRng::seed_from_u64(s ^ 0xc4);
    for (p, dfinal) in [
        (KdaProblem::random_gva(&[37, 5, 0, 20], 2, 1, true, s), true),
        (KdaProblem::random(&[70], 1, false, s ^ 1), false),
    ] {
        let n_out = p.tokens() * p.heads * HEAD_DIM;
        let n_st = p.seq_lens.len() * p.heads * HEAD_DIM * HEAD_DIM;
        let dout: Vec<f64> = (0..n_out).map(|_| rng.random::<f64>() - 0.5).collect();
        let df: Vec<f64> = (0..n_st).map(|_| rng.random::<f64>() - 0.5).collect();
        let df = dfinal.then_some(&df[..]);
        let want = recurrence_grad_f64(&p, &dout, df);
        for chunk in [1, 5, 16, 64] {
            let got = chunked_grad_f64(&p, &dout, df, chunk);
            for (name, a, b) in [
                ("dq", &got.dq, &want.dq),
                ("dk", &got.dk, &want.dk),
                ("dv", &got.dv, &want.dv),
                ("dg", &got.dg, &want.dg),
                ("dbeta", &got.dbeta, &want.dbeta),
                ("dA_log", &got.da_log, &want.da_log),
                ("ddt_bias", &got.ddt_bias, &want.ddt_bias),
                ("dinitial_state", &got.dinitial_state, &want.dinitial_state),
            ] {
                let e = if b.iter().all(|&x| x == 0.0) {
                    a.iter().fold(0.0f64, |m, x| m.max(x.abs()))
                } else {
                    rel_frobenius(a, b)
                };
                assert!(
                    e < 1e-10,
                    "chunk {chunk}: {name} rel error {e:e} (seed {s})"
                );
            }
        }
    }
}

#[test]
fn split_operands_bring_the_emulation_near_the_bf16_output_floor() {
    use flashkda::reference::emulated::{Rounding, emulated_with};
    // the rounding points of kda_fwd_ws_split.cu against the bf16 ones, same inputs
    let p = KdaProblem::random(&[100, 37], 3, true, seed());
    let r = recurrence_f64(&p);
    let err = |ro: Rounding| {
        let e = emulated_with(&p, ro);
        (
            rel_frobenius(&e.out, &r.out),
            rel_frobenius(&e.final_state, &r.final_state),
        )
    };
    let (bo, bs) = err(Rounding::KERNEL);
    let (so, ss) = err(Rounding::SPLIT);
    let (fo, _) = err(Rounding::NONE);
    println!(
        "bf16 operands: out {bo:e} state {bs:e}; split: out {so:e} state {ss:e}; output rounding only: {fo:e}"
    );
    assert!(so < 2.5e-3 && ss < 2.5e-3, "split: out {so:e} state {ss:e}");
    assert!(
        so < 0.6 * bo && ss < bs,
        "split {so:e}/{ss:e} vs bf16 {bo:e}/{bs:e}"
    );
    // what is left is mostly the bf16 output itself
    assert!(so < 1.15 * fo, "split out {so:e} vs output-only {fo:e}");
}

/// The scales that floor the GPU test's denominators of dbeta, dA_log and ddt_bias (each the root of
/// the sum of the squared terms of a sum of `n` terms) are positive and bound their sums:
/// `|sum| <= sum |term| <= sqrt(n) scale`; the floored metric is the plain one above its floor and
/// divides by the floor below it.
#[test]
fn gradient_scales_bound_their_sums_and_floor_the_metric() {
    use flashkda::reference::metrics::rel_frobenius_floored;
    use flashkda::reference::recurrence_grad_f64;
    use rand::{Rng, SeedableRng};
    let s = seed();
    let p = KdaProblem::random(&[20, 5], 2, true, s);
    let mut rng = rand::rngs::StdRng::seed_from_u64(s ^ 0x5c);
    let dout: Vec<f64> = (0..p.tokens() * p.heads * HEAD_DIM)
        .map(|_| rng.random::<f64>() - 0.5)
        .collect();
    let g = recurrence_grad_f64(&p, &dout, None);
    let t = p.tokens() as f64;
    for (name, v, sc, n) in [
        ("dbeta", &g.dbeta, &g.dbeta_scale, HEAD_DIM as f64),
        ("dA_log", &g.da_log, &g.da_log_scale, t * HEAD_DIM as f64),
        ("ddt_bias", &g.ddt_bias, &g.ddt_bias_scale, t),
    ] {
        assert_eq!(v.len(), sc.len(), "{name}");
        let bound = n.sqrt() * (1.0 + 1e-12);
        for (d, sc) in v.iter().zip(sc) {
            assert!(
                *sc > 0.0 && d.abs() <= bound * sc,
                "{name} {d:e}, scale {sc:e} (seed {s})"
            );
        }
    }
    let (r, x) = ([3.0, 4.0], [3.0, 4.5]);
    assert!((rel_frobenius_floored(&x, &r, &[0.0, 1.0]) - 0.1).abs() < 1e-15);
    assert!((rel_frobenius_floored(&x, &r, &[6.0, 8.0]) - 0.05).abs() < 1e-15);
    assert_eq!(rel_frobenius_floored(&r, &r, &[6.0, 8.0]), 0.0);
    assert!(rel_frobenius_floored(&[f64::NAN, 4.0], &r, &[6.0, 8.0]).is_nan());
}
