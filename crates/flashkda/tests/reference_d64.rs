//! CPU reference tests at head dim 64 (K = V = 64): the chunked and segmented forms equal the token
//! recurrence, the kernel-rounding emulation stays within bf16 error of float64, GVA repeats q/k
//! heads; varlen with ragged tails, zero-length sequences and initial states. Fresh seeds
//! (`FLASHKDA_TEST_SEED` replays one).

mod reference_common;
use reference_common::{
    assert_chunked_matches_recurrence, assert_segmented_matches_recurrence,
    assert_single_token_output, repeat_qk_heads, seed,
};

use flashkda::reference::emulated::{Rounding, emulated, emulated_with};
use flashkda::reference::metrics::{max_abs_diff, rel_frobenius};
use flashkda::reference::{KdaProblem, chunked_f64, recurrence_f64, segmented_f64};

const D: usize = 64;

fn problem(seq_lens: &[usize], heads: usize, qk_heads: usize, state: bool) -> KdaProblem {
    KdaProblem::random_dim(seq_lens, heads, qk_heads, D, state, seed())
}

#[test]
fn d64_problem_has_d64_shapes() {
    let p = problem(&[5, 11], 3, 1, true);
    let t = 16;
    assert_eq!(p.head_dim, D);
    assert_eq!(p.q.len(), t * D);
    assert_eq!(p.k.len(), t * D);
    assert_eq!(p.v.len(), t * 3 * D);
    assert_eq!(p.g.len(), t * 3 * D);
    assert_eq!(p.dt_bias.len(), 3 * D);
    assert_eq!(p.initial_state.as_ref().unwrap().len(), 2 * 3 * D * D);
    assert_eq!(p.scale, 1.0 / 8.0);
    let r = recurrence_f64(&p);
    assert_eq!(r.out.len(), t * 3 * D);
    assert_eq!(r.final_state.len(), 2 * 3 * D * D);
    assert!(r.out.iter().chain(&r.final_state).all(|x| x.is_finite()));
}

#[test]
fn d64_chunked_form_matches_recurrence_varlen_with_state() {
    let p = problem(&[1, 15, 17, 40, 0, 16], 2, 2, true);
    assert_chunked_matches_recurrence(&p);
}

#[test]
fn d64_chunked_form_matches_recurrence_extreme_gates_no_state() {
    let mut p = problem(&[50, 33], 2, 2, false);
    for (i, g) in p.g.iter_mut().enumerate() {
        *g = if i % 3 == 0 { 8.0 } else { -8.0 };
    }
    p.a_log.iter_mut().for_each(|a| *a = 0.0);
    let (r, c) = (recurrence_f64(&p), chunked_f64(&p, 16));
    let (eo, es) = c.rel_errors(&r);
    assert!(eo < 1e-12 && es < 1e-12, "out {eo:e} state {es:e}");
}

#[test]
fn d64_segmented_form_matches_recurrence() {
    assert_segmented_matches_recurrence(problem(&[1, 37, 100, 0, 64], 2, 2, true));
}

#[test]
fn d64_zero_length_sequence_passes_state_through() {
    let p = problem(&[7, 0, 9], 2, 2, true);
    let hd2 = D * D;
    for out in [
        recurrence_f64(&p),
        chunked_f64(&p, 16),
        segmented_f64(&p, 16),
        emulated(&p),
    ] {
        let h0 = p.initial_state.as_ref().unwrap();
        for h in 0..2 {
            let at = (2 + h) * hd2; // sequence 1, head h
            assert!(
                out.final_state[at..at + hd2]
                    .iter()
                    .zip(&h0[at..at + hd2])
                    .all(|(a, &b)| (*a - f64::from(b)).abs() < 1e-6),
                "head {h}: the state of an empty sequence must pass through"
            );
        }
    }
}

#[test]
fn d64_emulated_rounding_stays_within_bf16_error_of_float64() {
    // varlen with ragged tails, an initial state and GVA (6 value heads on 2 q/k heads)
    let p = problem(&[100, 37, 1, 64], 6, 2, true);
    let r = recurrence_f64(&p);
    for (name, ro, tol) in [
        ("bf16", Rounding::KERNEL, 6e-3),
        ("split", Rounding::SPLIT, 2.5e-3),
    ] {
        let e = emulated_with(&p, ro);
        let (eo, es) = e.rel_errors(&r);
        println!(
            "{name}: emulated vs f64: out {eo:e} state {es:e} max|d| {:e}",
            max_abs_diff(&e.out, &r.out)
        );
        assert!(
            eo > 1e-5,
            "{name}: the emulation must actually round (out rel {eo:e})"
        );
        assert!(eo < tol && es < tol, "{name}: out {eo:e} state {es:e}");
    }
}

#[test]
fn d64_gva_equals_repeated_query_key_heads() {
    let g = problem(&[40, 17], 6, 2, true);
    let full = repeat_qk_heads(&g);
    let (a, b) = (recurrence_f64(&g), recurrence_f64(&full));
    assert_eq!(a.out, b.out);
    assert_eq!(a.final_state, b.final_state);
    let (ea, eb) = (emulated(&g), emulated(&full));
    assert_eq!(ea.out, eb.out);
    assert!(rel_frobenius(&chunked_f64(&g, 16).out, &a.out) < 1e-12);
    assert!(rel_frobenius(&segmented_f64(&g, 16).out, &a.out) < 1e-12);
}

/// One token, zero state, q = k: `out = scale * beta * v * |k̂|^2` (scale `1/8` at head dim 64).
#[test]
fn d64_single_token_output_is_scaled_beta_value() {
    assert_single_token_output(problem(&[1], 1, 1, false));
}

/// The panic message of `f`, which must panic.
fn panic_message(f: impl FnOnce() + std::panic::UnwindSafe) -> String {
    let e = std::panic::catch_unwind(f).expect_err("expected a panic");
    e.downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

#[test]
fn backward_references_refuse_head_dim_64() {
    let p = problem(&[4], 1, 1, false);
    let dout = vec![0.0; 4 * D];
    let msg = panic_message(|| {
        let _ = flashkda::reference::recurrence_grad_f64(&p, &dout, None);
    });
    assert!(msg.contains("head dim 128 only"), "{msg}");
    let msg = panic_message(|| {
        let _ = flashkda::reference::chunked_grad_f64(&p, &dout, None, 16);
    });
    assert!(msg.contains("head dim 128 only"), "{msg}");
}

#[test]
fn other_head_dims_are_refused() {
    let msg = panic_message(|| {
        let _ = KdaProblem::random_dim(&[4], 1, 1, 96, false, 1);
    });
    assert!(msg.contains("head dim 96 is not supported"), "{msg}");
}
