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
