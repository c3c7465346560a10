//! Error metrics used by the accuracy checks (`docs/specs/kda.md §5`).

/// `||x - r||_F / ||r||_F` in float64; NaN when `x` holds a non-finite value or `r` is all zero.
pub fn rel_frobenius(x: &[f64], r: &[f64]) -> f64 {
    assert_eq!(x.len(), r.len(), "rel_frobenius: length mismatch");
    if x.iter().any(|v| !v.is_finite()) {
        return f64::NAN;
    }
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (a, b) in x.iter().zip(r) {
        num += (a - b) * (a - b);
        den += b * b;
    }
    if den == 0.0 {
        if num == 0.0 { 0.0 } else { f64::NAN }
    } else {
        (num / den).sqrt()
    }
}

/// `||x - r||_F / max(||r||_F, ||scale||_F)`: [`rel_frobenius`] whose denominator does not drop below
/// the norm of `scale`, each element's size without cancellation (e.g.
/// [`super::KdaGrads::dbeta_scale`]: the root of the sum of its squared terms). Where the reference
/// is a sum that happens to cancel on a few elements (a 37-token `dbeta`, a one-head `dA_log`), its
/// norm understates the size of the terms that a bf16/fp32 kernel rounds, and the plain relative
/// error swings with it; where it does not cancel (`||r|| >= ||scale||`, as on long inputs) this is
/// the plain relative error. NaN as [`rel_frobenius`].
pub fn rel_frobenius_floored(x: &[f64], r: &[f64], scale: &[f64]) -> f64 {
    assert_eq!(
        x.len(),
        scale.len(),
        "rel_frobenius_floored: length mismatch"
    );
    let norm = |v: &[f64]| v.iter().map(|a| a * a).sum::<f64>().sqrt();
    let floor = norm(scale);
    if floor <= norm(r) {
        return rel_frobenius(x, r);
    }
    if x.iter().any(|v| !v.is_finite()) {
        return f64::NAN;
    }
    let diff: Vec<f64> = x.iter().zip(r).map(|(a, b)| a - b).collect();
    norm(&diff) / floor
}

/// Largest absolute difference (NaN if any element of `x` is non-finite).
pub fn max_abs_diff(x: &[f64], r: &[f64]) -> f64 {
    assert_eq!(x.len(), r.len(), "max_abs_diff: length mismatch");
    x.iter().zip(r).fold(0.0f64, |m, (a, b)| {
        if a.is_finite() {
            m.max((a - b).abs())
        } else {
            f64::NAN
        }
    })
}
