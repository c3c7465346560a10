//! Float64 chunked form with long chunks (64 tokens: `kernels/kda_fwd_c64.cu`) whose intra-chunk
//! matrices are built from 16-token sub-chunks, so that every factor stays inside the fp32/bf16
//! range (`docs/specs/kda.md §1.4`, "Range"), plus the intra-chunk builder shared with the kernel
//! emulation [`super::emulated64`].
//!
//! Range argument. A token's log2 decay is `γ·log2 e >= lower_bound·log2 e >= -7.22` per channel, so
//! over 16 tokens a cumulative decay `G` moves by at most 115.4 (`2^{±115.4}` is a normal fp32 and
//! bf16 number; both have 8 exponent bits, `2^{±126}`), but over 64 tokens by up to 462: `2^{-G}`
//! overflows. Let `R_s` be the cumulative decay at the end of sub-chunk `s` (`R_{-1} = 0`, the chunk
//! start). Row block `s` of `A = diag(b) strict_lower(kd kiᵀ)` and `M = lower_incl(qd kiᵀ)` is
//! `[kdl_s; qdl_s] · kc^{(s)ᵀ}` with
//! - row operands `kdl_i = k̂_i 2^{G_i - R_{s-1}}`, `qdl_i = scale q̂_i 2^{G_i - R_{s-1}}` for the 16
//!   tokens `i` of sub-chunk `s`: `G_i - R_{s-1}` lies in `[-115.4, 0]`, so `2^{..}` is in
//!   `[2^{-115.4}, 1]` (normal, never 0);
//! - column operands `kc^{(s)}_j = k̂_j 2^{R_{s-1} - G_j}` for the tokens `j` of sub-chunks `t <= s`:
//!   for `t < s`, `j` is at or before the end of sub-chunk `s-1`, so `R_{s-1} - G_j <= 0` and the
//!   factor is `<= 1` (it may underflow to 0, but then the exact entry `k̂_i k̂_j 2^{G_i - G_j}` is
//!   below `2^{-126}`: dropping it is far below fp32 resolution of the `O(1)` entries of `I + A`);
//!   for `t = s` (the diagonal block) `R_{s-1} - G_j` is in `[0, 115.4]`: at most `2^{115.4}`,
//!   finite, as in today's 16-token chunk. In that block the products above the diagonal may
//!   exceed the range (`2^{G_i - G_j}` with `j > i`), which is why the triangle is taken by
//!   selecting entries, never by masking with a multiply (`0 · inf = NaN`).
//!
//! So every entry `2^{G_i - G_j}` with `j <= i` is split as `2^{G_i - R_{s-1}} · 2^{R_{s-1} - G_j}`,
//! one factor per operand, each finite and the product exact up to rounding. The reference point
//! is the start of the row's sub-chunk (fla's `chunk_kda` does the same) rather than the end of
//! the column's: then the row operand is one tile per sub-chunk (`kdl`, `qdl`, the same for all
//! column blocks) and never underflows; only the column operand depends on the row block.
//! The state-dependent products need no such care: `kd = k̂ 2^{G}`, `qd = scale q̂ 2^{G}`,
//! `kr = k̂ 2^{Gtot - G}`, `E = 2^{Gtot}` all have exponents `<= 0` (at most an underflow to 0 of a
//! term that is below `2^{-126}` of its neighbours).
//!
//! `INV = (I + A)^{-1}` is built by block forward substitution over the 16-token blocks:
//! `X_ss = (I + A_ss)^{-1}` (forward substitution, as the 16-token kernels), then for `s > t`
//! `X_st = -X_ss Σ_{t <= m < s} A_sm X_mt`.

use super::chunked::chunked_walk_f64;
use super::{KdaOutput, KdaProblem};

/// Sub-chunk length of the long-chunk forms (the range argument above needs <= 16 at lower bound -5).
pub const SUB_CHUNK: usize = 16;
/// Chunk length of `kernels/kda_fwd_c64.cu`.
pub const CHUNK64: usize = 64;

/// The intra-chunk matrices of one chunk (`n <= chunk` tokens), row-major `n x n`.
pub(crate) struct Intra {
    /// `(I + A)^{-1}` (lower triangular, unit diagonal), before the operand rounding of `INV`.
    pub inv: Vec<Vec<f64>>,
    /// `lower_incl(qd kiᵀ)`, before its operand rounding.
    pub m: Vec<Vec<f64>>,
}

/// How the builder stores intermediates: `store` rounds every stored scalar (identity in float64,
/// round-to-f32 in the emulation); `operand` rounds the operands of the products `A` and `M`
/// (applied after `store`); `inv_operand` the operands of the off-diagonal block products of the
/// substitution (`A_sm X_mt` and `X_ss Y`; identity in float64, the kernel's hi + lo split on
/// mma.sync in the emulation).
pub(crate) struct Arith<'a> {
    pub store: &'a (dyn Fn(f64) -> f64 + Sync),
    pub operand: &'a (dyn Fn(f64) -> f64 + Sync),
    pub inv_operand: &'a (dyn Fn(f64) -> f64 + Sync),
}

/// Builds `INV` and `M` for one chunk from the normalised keys `kn[i][c]`, the scaled normalised
/// queries `qs[i][c]` (`scale q̂`), the cumulative log2 decays `g[i][c]` from the chunk start, and
/// the betas, by 16-token sub-chunks (module docs). Values are rounded through `ar` at the points
/// the kernel rounds (every exp2 and product stored, then the operands).
pub(crate) fn build_intra(
    kn: &[Vec<f64>],
    qs: &[Vec<f64>],
    g: &[Vec<f64>],
    b: &[f64],
    ar: &Arith<'_>,
) -> Intra {
    let n = kn.len();
    let d = kn.first().map_or(0, Vec::len);
    let st = ar.store;
    let op = |x: f64| (ar.operand)(st(x));
    let iop = ar.inv_operand;
    let nsub = n.div_ceil(SUB_CHUNK);
    let sub_end = |s: usize| (SUB_CHUNK * (s + 1)).min(n);
    // reference point of row block s: cumulative decay at the end of sub-chunk s-1 (0 at s = 0)
    let r_ref = |s: usize, c: usize| if s == 0 { 0.0 } else { g[SUB_CHUNK * s - 1][c] };
    let mut a = vec![vec![0.0f64; n]; n];
    let mut m = vec![vec![0.0f64; n]; n];
    for s in 0..nsub {
        let rows = SUB_CHUNK * s..sub_end(s);
        let exp_row = |i: usize, c: usize| st((st(g[i][c] - r_ref(s, c))).exp2());
        let kdl: Vec<Vec<f64>> = rows
            .clone()
            .map(|i| (0..d).map(|c| op(kn[i][c] * exp_row(i, c))).collect())
            .collect();
        let qdl: Vec<Vec<f64>> = rows
            .clone()
            .map(|i| (0..d).map(|c| op(qs[i][c] * exp_row(i, c))).collect())
            .collect();
        let cols = sub_end(s);
        let kc: Vec<Vec<f64>> = (0..cols)
            .map(|j| {
                (0..d)
                    .map(|c| op(kn[j][c] * st((st(r_ref(s, c) - g[j][c])).exp2())))
                    .collect()
            })
            .collect();
        let dot = |x: &[f64], y: &[f64]| st(x.iter().zip(y).map(|(p, q)| p * q).sum::<f64>());
        for (li, i) in rows.enumerate() {
            for j in 0..=i {
                if j < i {
                    a[i][j] = st(dot(&kdl[li], &kc[j]) * b[i]);
                }
                m[i][j] = dot(&qdl[li], &kc[j]);
            }
        }
    }
    // block forward substitution
    let mut inv = vec![vec![0.0f64; n]; n];
    for s in 0..nsub {
        let rs = SUB_CHUNK * s..sub_end(s);
        // diagonal block: (I + A_ss)^{-1} by forward substitution, column by column
        for j in rs.clone() {
            for i in rs.clone() {
                let mut acc = if i == j { 1.0 } else { 0.0 };
                for k in rs.start..i {
                    acc = st(acc - a[i][k] * inv[k][j]);
                }
                inv[i][j] = acc;
            }
        }
        // off-diagonal blocks t < s: X_st = -X_ss (Σ_{t <= m < s} A_sm X_mt)
        for t in 0..s {
            let cs = SUB_CHUNK * t..sub_end(t);
            let y: Vec<Vec<f64>> = rs
                .clone()
                .map(|i| {
                    cs.clone()
                        .map(|j| {
                            st((cs.start..rs.start)
                                .map(|k| iop(a[i][k]) * iop(inv[k][j]))
                                .sum())
                        })
                        .collect()
                })
                .collect();
            for i in rs.clone() {
                for (lj, j) in cs.clone().enumerate() {
                    let x: f64 = rs
                        .clone()
                        .filter(|&k| k <= i)
                        .map(|k| iop(inv[i][k]) * iop(y[k - rs.start][lj]))
                        .sum();
                    inv[i][j] = st(-x);
                }
            }
        }
    }
    Intra { inv, m }
}

/// Float64 chunked form with chunk length `chunk` (a multiple of [`SUB_CHUNK`], e.g. [`CHUNK64`])
/// and the sub-chunked intra-chunk construction of the module docs; agrees with
/// [`super::recurrence_f64`] to rounding error at every chunk length, including gates at the
/// lower bound over whole chunks.
pub fn chunked_sub_f64(p: &KdaProblem, chunk: usize) -> KdaOutput {
    assert!(
        chunk > 0 && chunk.is_multiple_of(SUB_CHUNK),
        "chunk length must be a positive multiple of {SUB_CHUNK}"
    );
    let scale = f64::from(p.scale);
    let d = p.head_dim;
    let id = |x: f64| x;
    let ar = Arith {
        store: &id,
        operand: &id,
        inv_operand: &id,
    };
    chunked_walk_f64(p, chunk, |s, ch, out| {
        let (acts, g, gtot) = (&ch.acts, &ch.g, &ch.gtot);
        let n = acts.len();
        let kn: Vec<Vec<f64>> = acts.iter().map(|a| a.k.clone()).collect();
        let qs: Vec<Vec<f64>> = acts
            .iter()
            .map(|a| a.q.iter().map(|x| scale * x).collect())
            .collect();
        let b: Vec<f64> = acts.iter().map(|a| a.beta).collect();
        let intra = build_intra(&kn, &qs, g, &b, &ar);
        let kd: Vec<Vec<f64>> = (0..n)
            .map(|i| (0..d).map(|c| kn[i][c] * g[i][c].exp2()).collect())
            .collect();
        let qd: Vec<Vec<f64>> = (0..n)
            .map(|i| (0..d).map(|c| qs[i][c] * g[i][c].exp2()).collect())
            .collect();
        let kr: Vec<Vec<f64>> = (0..n)
            .map(|i| {
                (0..d)
                    .map(|c| kn[i][c] * (gtot[c] - g[i][c]).exp2())
                    .collect()
            })
            .collect();
        let dot = |x: &[f64], y: &[f64]| x.iter().zip(y).map(|(a, b)| a * b).sum::<f64>();
        let mut u = vec![vec![0.0f64; d]; n];
        for (vi, srow) in s.chunks_exact(d).enumerate() {
            let vb: Vec<f64> = (0..n)
                .map(|i| {
                    let v = f64::from(p.v[((ch.t0 + i) * p.heads + ch.h) * d + vi]);
                    b[i] * (v - dot(&kd[i], srow))
                })
                .collect();
            for i in 0..n {
                u[i][vi] = (0..=i).map(|j| intra.inv[i][j] * vb[j]).sum();
            }
            for i in 0..n {
                let o: f64 = (0..=i).map(|j| intra.m[i][j] * u[j][vi]).sum();
                out[i * d + vi] = dot(&qd[i], srow) + o;
            }
        }
        for (vi, srow) in s.chunks_exact_mut(d).enumerate() {
            for c in 0..d {
                let upd: f64 = (0..n).map(|i| u[i][vi] * kr[i][c]).sum();
                srow[c] = srow[c] * gtot[c].exp2() + upd;
            }
        }
    })
}
