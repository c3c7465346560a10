//! CPU tests of the chunk-64 forms (`reference::chunked64`, `reference::emulated64`): the
//! sub-chunked float64 form equals the token recurrence, the emulation of `kda_fwd_c64.cu` stays
//! within issue 11's accuracy bars.

mod reference_common;
use reference_common::{assert_close, seed};

use flashkda::reference::chunked64::CHUNK64;
use flashkda::reference::emulated::{Rounding, emulated_with};
use flashkda::reference::emulated64::{emulated_c64, emulated_chunked_with};
use flashkda::reference::metrics::rel_frobenius;
use flashkda::reference::{KdaProblem, chunked_sub_f64, recurrence_f64};

fn check_f64(p: &KdaProblem, what: &str) {
    let r = recurrence_f64(p);
    for chunk in [CHUNK64, 16, 32, 128] {
        let c = chunked_sub_f64(p, chunk);
        assert_close(&c, &r, 1e-10, &format!("{what} chunk {chunk}"));
    }
}

#[test]
fn chunk64_form_matches_recurrence_varlen_ragged_with_state() {
    let p = KdaProblem::random(&[1, 15, 16, 17, 63, 64, 65, 200], 2, true, seed());
    check_f64(&p, "varlen");
}

#[test]
fn chunk64_form_matches_recurrence_fixed_gva() {
    let p = KdaProblem::random_gva(&[300], 4, 2, true, seed());
    check_f64(&p, "gva");
    let p = KdaProblem::random_gva(&[129, 64], 2, 1, false, seed());
    check_f64(&p, "gva varlen");
}

/// Gates at the lower bound (-5 per token, `alpha = e^-5`) over whole chunks: `2^{-G}` over 64
/// tokens is `2^{462}`, beyond fp32, and `2^{G}` underflows; the sub-chunk construction keeps every
/// factor finite. Mixed with never-decaying channels in the same chunk.
#[test]
fn chunk64_form_matches_recurrence_at_the_lower_bound() {
    let mut p = KdaProblem::random(&[200, 64, 37], 2, true, seed());
    p.a_log.iter_mut().for_each(|a| *a = 1.0);
    let d = p.head_dim;
    for (i, g) in p.g.iter_mut().enumerate() {
        // channel 0..96 saturated (alpha -> e^-5), the rest never decays
        *g = if i % d < 96 { 30.0 } else { -30.0 };
    }
    check_f64(&p, "lower bound");
    let e = emulated_c64(&p);
    let r = recurrence_f64(&p);
    assert!(e.out.iter().chain(&e.final_state).all(|x| x.is_finite()));
    let eo = rel_frobenius(&e.out, &r.out);
    println!("emulated at the bound: out {eo:e}");
    assert!(eo < 4e-3, "emulated at the bound: out {eo:e}");
}

#[test]
fn chunk64_form_matches_recurrence_without_decay() {
    let mut p = KdaProblem::random(&[150], 2, true, seed());
    p.g.iter_mut().for_each(|g| *g = -30.0);
    check_f64(&p, "no decay");
}

/// At chunk 16 the sub-chunked emulation is the 16-token kernels' emulation (one sub-chunk per
/// chunk, the same operands and rounding points).
#[test]
fn chunk16_emulation_equals_the_kernel_emulation() {
    let p = KdaProblem::random(&[40, 16, 3], 2, true, seed());
    for r in [Rounding::KERNEL, Rounding::SPLIT] {
        let a = emulated_with(&p, r);
        let b = emulated_chunked_with(&p, 16, r);
        let eo = rel_frobenius(&b.out, &a.out);
        let es = rel_frobenius(&b.final_state, &a.final_state);
        println!("chunk 16 sub-chunked vs emulated: out {eo:e} state {es:e}");
        assert!(eo < 1e-3 && es < 1e-4, "out {eo:e} state {es:e}");
    }
}

/// Issue 11's bars on anchor-like inputs (<= 3e-3) and everywhere (<= 4e-3), with the chunk-64
/// kernel's rounding; the long-memory cases are in `examples/rounding_cost_c64.rs --long`.
#[test]
fn chunk64_emulation_meets_the_accuracy_bars() {
    let s = seed();
    let mut nd = KdaProblem::random(&[512], 2, true, s);
    nd.g.iter_mut().for_each(|g| *g = -30.0);
    let cases = [
        ("fixed-1024", KdaProblem::random(&[1024], 2, true, s), 3e-3),
        (
            "varlen",
            KdaProblem::random(&[1, 37, 64, 65, 300], 2, true, s),
            3e-3,
        ),
        ("no-decay-512", nd, 4e-3),
    ];
    for (name, p, bar) in cases {
        let r = recurrence_f64(&p);
        let e = emulated_c64(&p);
        let eo = rel_frobenius(&e.out, &r.out);
        let es = rel_frobenius(&e.final_state, &r.final_state);
        println!("{name}: out {eo:.3e} state {es:.3e}");
        assert!(eo <= bar && es <= bar, "{name}: out {eo:e} state {es:e}");
    }
}
