//! Float64 chunked form (`docs/specs/kda.md §1.4`): what the kernels compute, without rounding.

use super::{
    KdaOutput, KdaProblem, TokenActs, initial_state_f64, log2_cumulative_gates, per_sequence_head,
    token_acts,
};

/// One chunk of a float64 chunked walk: head `h`, tokens `t0..t0 + acts.len()` with their
/// activations and log2 cumulative gates from the chunk start (`gtot` over the whole chunk).
pub(crate) struct ChunkF64 {
    pub h: usize,
    pub t0: usize,
    pub acts: Vec<TokenActs>,
    pub g: Vec<Vec<f64>>,
    pub gtot: Vec<f64>,
}

/// The float64 chunked forms' walk: every (sequence, head) from its initial state through chunks
/// of at most `chunk` tokens in order; `step(s, c, out)` advances the state `s` (`[v][k]`) over
/// chunk `c` and writes its output rows `out`.
pub(crate) fn chunked_walk_f64<F>(p: &KdaProblem, chunk: usize, step: F) -> KdaOutput
where
    F: Fn(&mut [f64], &ChunkF64, &mut [f64]) + Sync,
{
    let d = p.head_dim;
    per_sequence_head(p, |nseq, h, bos, len| {
        let mut s = initial_state_f64(p, nseq, h); // [v][k]
        let mut out = vec![0.0; len * d];
        let mut c0 = 0;
        while c0 < len {
            let n = chunk.min(len - c0);
            let t0 = bos + c0;
            let acts: Vec<_> = (0..n).map(|i| token_acts(p, t0 + i, h)).collect();
            let (g, gtot) = log2_cumulative_gates(&acts, d);
            let c = ChunkF64 {
                h,
                t0,
                acts,
                g,
                gtot,
            };
            step(&mut s, &c, &mut out[c0 * d..(c0 + n) * d]);
            c0 += n;
        }
        (out, s)
    })
}

/// `(I + A)^{-1}` for a strictly lower-triangular `n x n` matrix `A` by forward substitution.
pub(crate) fn unit_lower_inverse(a: &[Vec<f64>]) -> Vec<Vec<f64>> {
    let n = a.len();
    let mut x = vec![vec![0.0; n]; n];
    for j in 0..n {
        for i in 0..n {
            let mut s = if i == j { 1.0 } else { 0.0 };
            for m in 0..i {
                s -= a[i][m] * x[m][j];
            }
            x[i][j] = s;
        }
    }
    x
}

/// Float64 chunked form with chunk length `chunk` (the kernels use 16); agrees with
/// [`super::recurrence_f64`] to rounding error.
pub fn chunked_f64(p: &KdaProblem, chunk: usize) -> KdaOutput {
    assert!(chunk > 0, "chunk length must be positive");
    let scale = f64::from(p.scale);
    let d = p.head_dim;
    chunked_walk_f64(p, chunk, |s, ch, out| {
        let (acts, g, gtot) = (&ch.acts, &ch.g, &ch.gtot);
        let n = acts.len();
        let per_token = |f: &dyn Fn(usize, usize) -> f64| -> Vec<Vec<f64>> {
            (0..n).map(|i| (0..d).map(|c| f(i, c)).collect()).collect()
        };
        let kd = per_token(&|i, c| acts[i].k[c] * g[i][c].exp2());
        let qd = per_token(&|i, c| scale * acts[i].q[c] * g[i][c].exp2());
        let ki = per_token(&|i, c| acts[i].k[c] * (-g[i][c]).exp2());
        let kr = per_token(&|i, c| acts[i].k[c] * (gtot[c] - g[i][c]).exp2());
        let dot = |x: &[f64], y: &[f64]| x.iter().zip(y).map(|(a, b)| a * b).sum::<f64>();
        let a: Vec<Vec<f64>> = (0..n)
            .map(|i| {
                (0..n)
                    .map(|j| {
                        if j < i {
                            acts[i].beta * dot(&kd[i], &ki[j])
                        } else {
                            0.0
                        }
                    })
                    .collect()
            })
            .collect();
        let m: Vec<Vec<f64>> = (0..n)
            .map(|i| {
                (0..n)
                    .map(|j| if j <= i { dot(&qd[i], &ki[j]) } else { 0.0 })
                    .collect()
            })
            .collect();
        let inv = unit_lower_inverse(&a);
        // rhs_i[v] = beta_i (v_i[v] - (kd_i . S[v,:]))
        let mut rhs = vec![vec![0.0f64; d]; n];
        let mut o1 = vec![vec![0.0f64; d]; n];
        for i in 0..n {
            let vrow = &p.v[((ch.t0 + i) * p.heads + ch.h) * d..][..d];
            for (vi, srow) in s.chunks_exact(d).enumerate() {
                rhs[i][vi] = acts[i].beta * (f64::from(vrow[vi]) - dot(&kd[i], srow));
                o1[i][vi] = dot(&qd[i], srow);
            }
        }
        let mut u = vec![vec![0.0f64; d]; n];
        for i in 0..n {
            for j in 0..=i {
                for vi in 0..d {
                    u[i][vi] += inv[i][j] * rhs[j][vi];
                }
            }
        }
        for i in 0..n {
            for vi in 0..d {
                let mut o = o1[i][vi];
                for j in 0..=i {
                    o += m[i][j] * u[j][vi];
                }
                out[i * d + vi] = o;
            }
        }
        for (vi, srow) in s.chunks_exact_mut(d).enumerate() {
            for c in 0..d {
                let mut x = srow[c] * gtot[c].exp2();
                for i in 0..n {
                    x += u[i][vi] * kr[i][c];
                }
                srow[c] = x;
            }
        }
    })
}
