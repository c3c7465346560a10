//! What the CPU reference test binaries share: the replayable seed, the printed error check
//! against the recurrence, and checks written once for every head dim.

use flashkda::reference::metrics::rel_frobenius;
use flashkda::reference::{KdaOutput, KdaProblem, chunked_f64, recurrence_f64, segmented_f64};

/// A fresh seed (printed), or `FLASHKDA_TEST_SEED` to replay a failure.
pub fn seed() -> u64 {
    let s = std::env::var("FLASHKDA_TEST_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    println!("seed {s}");
    s
}

/// Prints `got`'s relative errors against `want` and asserts both (out, final state) below `tol`.
pub fn assert_close(got: &KdaOutput, want: &KdaOutput, tol: f64, what: &str) {
    let (eo, es) = got.rel_errors(want);
    println!("{what}: out {eo:e} state {es:e}");
    assert!(eo < tol && es < tol, "{what}: out {eo:e} state {es:e}");
}

/// The float64 chunked form at chunk lengths 16, 5 and 64 equals the token recurrence on `p`.
#[allow(dead_code, reason = "reference.rs and reference_d64.rs")]
pub fn assert_chunked_matches_recurrence(p: &KdaProblem) {
    let r = recurrence_f64(p);
    for chunk in [16, 5, 64] {
        assert_close(&chunked_f64(p, chunk), &r, 1e-12, &format!("chunk {chunk}"));
    }
}

/// The segmented form equals the token recurrence on `p` at several segment lengths (ragged
/// tails, one-chunk segments, segments longer than a sequence), and without an initial state.
#[allow(dead_code, reason = "reference.rs and reference_d64.rs")]
pub fn assert_segmented_matches_recurrence(mut p: KdaProblem) {
    let r = recurrence_f64(&p);
    for seg in [16, 48, 7, 1, 1000] {
        assert_close(
            &segmented_f64(&p, seg),
            &r,
            1e-12,
            &format!("segments of {seg}"),
        );
    }
    p.initial_state = None;
    let r = recurrence_f64(&p);
    let s = segmented_f64(&p, 32);
    assert!(rel_frobenius(&s.out, &r.out) < 1e-12);
    assert!(rel_frobenius(&s.final_state, &r.final_state) < 1e-12);
}

/// `g` with its query/key heads repeated for every value head (GVA written out as MHA).
#[allow(dead_code, reason = "reference.rs and reference_d64.rs")]
pub fn repeat_qk_heads(g: &KdaProblem) -> KdaProblem {
    let d = g.head_dim;
    let (mut q, mut k) = (Vec::new(), Vec::new());
    for tok in 0..g.tokens() {
        for h in 0..g.heads {
            let o = g.qk_offset(tok, h);
            q.extend_from_slice(&g.q[o..o + d]);
            k.extend_from_slice(&g.k[o..o + d]);
        }
    }
    KdaProblem {
        qk_heads: g.heads,
        q,
        k,
        ..g.clone()
    }
}

/// With one token of one head, zero state and q = k (set here): `S = beta v k̂ᵀ` and
/// `out = scale beta v |k̂|^2` on every channel.
#[allow(dead_code, reason = "reference.rs and reference_d64.rs")]
pub fn assert_single_token_output(mut p: KdaProblem) {
    p.q = p.k.clone();
    let r = recurrence_f64(&p);
    let kk: f64 = p.k.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
    let nrm2 = kk / (kk + 1e-6);
    let beta = 1.0 / (1.0 + (-f64::from(p.beta[0])).exp());
    for c in 0..p.head_dim {
        let want = f64::from(p.scale) * beta * f64::from(p.v[c]) * nrm2;
        assert!(
            (r.out[c] - want).abs() < 1e-12,
            "channel {c}: {} vs {want}",
            r.out[c]
        );
    }
}
