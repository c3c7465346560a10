//! Float64 chunked (WY-form) gradient of KDA: the same gradients as [`super::recurrence_grad_f64`],
//! computed per chunk with the matrix products a tensor-core backward kernel would do (issue 13's
//! path to a fast backward). Per chunk of `n` tokens with start state `S0` (`V x K`), in-chunk
//! cumulative log decays `G_i`, normalised `q_i`, `k_i` and sigmoid betas:
//!
//! - `A[j][l] = sum_c k_jc k_lc e^(G_jc - G_lc)` (l < j), `M[i][j] = sum_c q_ic k_jc e^(G_ic - G_jc)`
//!   (j <= i), `QG_i = q_i e^G_i`, `KG_j = k_j e^G_j`, `KR_j = k_j e^(G_n - G_j)`;
//! - `X = (I + diag(beta) A)^-1`, `T = X diag(beta)`, `W = V - KG S0^T`, `U = T W`;
//! - `O = scale (QG S0^T + M U)`, `S_n = S0 diag(e^G_n) + U^T KR`.
//!
//! The backward runs these in reverse: `dU = scale M^T dO + KR dS_n^T`, `dW = T^T dU` (= dV),
//! `dS0 = scale dO^T QG + dS_n diag(e^G_n) - dW^T KG`, `dT = dU W^T` gives dbeta and, through
//! `dL = -X^T (dT diag(beta)) X^T`, dA; then dq, dk and dG from A, M, QG, KG, KR, and the decay
//! gradient is the reverse cumulative sum of dG within the chunk.

use super::backward::{KdaGrads, l2, l2_backward};
use super::{HEAD_DIM, KdaProblem, initial_state_f64, sigmoid};

const D: usize = HEAD_DIM;

/// Per-token activations of one (token, head).
struct Tok {
    q: [f64; D],
    rq: f64,
    k: [f64; D],
    rk: f64,
    /// Log decay `lb * sigmoid(x)` and its pieces for the gate chain rule.
    gamma: [f64; D],
    x: [f64; D],
    sig: [f64; D],
    beta: f64,
    v: [f64; D],
}

fn tok(p: &KdaProblem, t: usize, h: usize) -> Tok {
    let base = (t * p.heads + h) * D;
    let qo = p.qk_offset(t, h);
    let (q, rq) = l2(&p.q[qo..qo + D]);
    let (k, rk) = l2(&p.k[qo..qo + D]);
    let a = f64::from(p.a_log[h]).exp();
    let lb = f64::from(p.lower_bound);
    let x: [f64; D] =
        std::array::from_fn(|c| a * (f64::from(p.g[base + c]) + f64::from(p.dt_bias[h * D + c])));
    let sig: [f64; D] = std::array::from_fn(|c| sigmoid(x[c]));
    Tok {
        q,
        rq,
        k,
        rk,
        gamma: std::array::from_fn(|c| lb * sig[c]),
        x,
        sig,
        beta: sigmoid(f64::from(p.beta[t * p.heads + h])),
        v: std::array::from_fn(|c| f64::from(p.v[base + c])),
    }
}

/// Gradients of one chunk's normalised q, k (`dq`, `dk`), log decays (`dgamma`), betas (`dbeta`)
/// and values (`dv`), rows in chunk order; `ds` enters as d(end state) and leaves as d(start state).
struct ChunkGrads {
    dq: Vec<[f64; D]>,
    dk: Vec<[f64; D]>,
    dgamma: Vec<[f64; D]>,
    dbeta: Vec<f64>,
    dv: Vec<[f64; D]>,
}

/// `S0` (`[v][k]`, row-major `D x D`) -> end state of the chunk `tk` (forward of the chunked form).
fn chunk_forward(tk: &[Tok], s0: &[f64]) -> Vec<f64> {
    let mut s = s0.to_vec();
    for t in tk {
        for vi in 0..D {
            let row = &mut s[vi * D..(vi + 1) * D];
            let mut pred = 0.0;
            for c in 0..D {
                row[c] *= t.gamma[c].exp();
                pred += row[c] * t.k[c];
            }
            let u = t.beta * (t.v[vi] - pred);
            for c in 0..D {
                row[c] += u * t.k[c];
            }
        }
    }
    s
}

#[allow(clippy::needless_range_loop)]
fn chunk_backward(
    tk: &[Tok],
    s0: &[f64],
    d_o: &[[f64; D]],
    ds: &mut [f64],
    scale: f64,
) -> ChunkGrads {
    let n = tk.len();
    // cumulative log decays
    let mut g = vec![[0.0f64; D]; n];
    for i in 0..n {
        for c in 0..D {
            g[i][c] = tk[i].gamma[c] + if i > 0 { g[i - 1][c] } else { 0.0 };
        }
    }
    let gl = g[n - 1];
    let e = |a: &[f64; D], b: &[f64; D], c: usize| (a[c] - b[c]).exp();
    let dot_e = |x: &[f64; D], gi: &[f64; D], y: &[f64; D], gj: &[f64; D]| -> f64 {
        (0..D).map(|c| x[c] * y[c] * e(gi, gj, c)).sum()
    };
    let mut a = vec![vec![0.0f64; n]; n];
    let mut m = vec![vec![0.0f64; n]; n];
    for i in 0..n {
        for j in 0..n {
            if j < i {
                a[i][j] = dot_e(&tk[i].k, &g[i], &tk[j].k, &g[j]);
            }
            if j <= i {
                m[i][j] = dot_e(&tk[i].q, &g[i], &tk[j].k, &g[j]);
            }
        }
    }
    let qg: Vec<[f64; D]> = (0..n)
        .map(|i| std::array::from_fn(|c| tk[i].q[c] * g[i][c].exp()))
        .collect();
    let kg: Vec<[f64; D]> = (0..n)
        .map(|i| std::array::from_fn(|c| tk[i].k[c] * g[i][c].exp()))
        .collect();
    let kr: Vec<[f64; D]> = (0..n)
        .map(|i| std::array::from_fn(|c| tk[i].k[c] * (gl[c] - g[i][c]).exp()))
        .collect();
    // X = (I + diag(beta) A)^-1 by forward substitution (unit lower triangular)
    let mut x = vec![vec![0.0f64; n]; n];
    for col in 0..n {
        for i in col..n {
            let mut v = if i == col { 1.0 } else { 0.0 };
            for l in col..i {
                v -= tk[i].beta * a[i][l] * x[l][col];
            }
            x[i][col] = v;
        }
    }
    let t: Vec<Vec<f64>> = (0..n)
        .map(|i| (0..n).map(|j| x[i][j] * tk[j].beta).collect())
        .collect();
    let w: Vec<[f64; D]> = (0..n)
        .map(|j| {
            std::array::from_fn(|vi| {
                tk[j].v[vi] - (0..D).map(|c| kg[j][c] * s0[vi * D + c]).sum::<f64>()
            })
        })
        .collect();
    let u: Vec<[f64; D]> = (0..n)
        .map(|i| std::array::from_fn(|vi| (0..n).map(|j| t[i][j] * w[j][vi]).sum()))
        .collect();
    // reverse mode
    let dsn = ds.to_vec();
    let du: Vec<[f64; D]> = (0..n)
        .map(|j| {
            std::array::from_fn(|vi| {
                let a: f64 = (j..n).map(|i| m[i][j] * d_o[i][vi]).sum();
                let b: f64 = (0..D).map(|c| kr[j][c] * dsn[vi * D + c]).sum();
                scale * a + b
            })
        })
        .collect();
    let dw: Vec<[f64; D]> = (0..n)
        .map(|j| std::array::from_fn(|vi| (0..n).map(|i| t[i][j] * du[i][vi]).sum()))
        .collect();
    let mut dg = vec![[0.0f64; D]; n];
    let mut dq = vec![[0.0f64; D]; n];
    let mut dk = vec![[0.0f64; D]; n];
    // start state: from the outputs, the decayed carry-over and W
    for vi in 0..D {
        for c in 0..D {
            let mut v = dsn[vi * D + c] * gl[c].exp();
            dg[n - 1][c] += dsn[vi * D + c] * s0[vi * D + c] * gl[c].exp();
            for i in 0..n {
                v += scale * d_o[i][vi] * qg[i][c] - dw[i][vi] * kg[i][c];
            }
            ds[vi * D + c] = v;
        }
    }
    let mut dbeta = vec![0.0f64; n];
    // dT = dU W^T; T = X diag(beta)
    let mut dx = vec![vec![0.0f64; n]; n];
    for i in 0..n {
        for j in 0..=i {
            let dt: f64 = (0..D).map(|vi| du[i][vi] * w[j][vi]).sum();
            dx[i][j] = dt * tk[j].beta;
            dbeta[j] += x[i][j] * dt;
        }
    }
    // dL = -X^T dX X^T, L = I + diag(beta) A
    let mut tmp = vec![vec![0.0f64; n]; n]; // X^T dX
    for i in 0..n {
        for j in 0..n {
            tmp[i][j] = (0..n).map(|l| x[l][i] * dx[l][j]).sum();
        }
    }
    let mut da = vec![vec![0.0f64; n]; n];
    for j in 0..n {
        for l in 0..j {
            let dl: f64 = -(0..n).map(|r| tmp[j][r] * x[l][r]).sum::<f64>();
            dbeta[j] += dl * a[j][l];
            da[j][l] = tk[j].beta * dl;
        }
    }
    // dM = scale dO U^T (j <= i), dQG = scale dO S0, dKG = -dW S0, dKR = U dS_n
    for i in 0..n {
        for j in 0..=i {
            let dm: f64 = scale * (0..D).map(|vi| d_o[i][vi] * u[j][vi]).sum::<f64>();
            for c in 0..D {
                let ee = e(&g[i], &g[j], c);
                dq[i][c] += dm * tk[j].k[c] * ee;
                dk[j][c] += dm * tk[i].q[c] * ee;
                let term = dm * tk[i].q[c] * tk[j].k[c] * ee;
                dg[i][c] += term;
                dg[j][c] -= term;
            }
        }
        for l in 0..i {
            for c in 0..D {
                let ee = e(&g[i], &g[l], c);
                dk[i][c] += da[i][l] * tk[l].k[c] * ee;
                dk[l][c] += da[i][l] * tk[i].k[c] * ee;
                let term = da[i][l] * tk[i].k[c] * tk[l].k[c] * ee;
                dg[i][c] += term;
                dg[l][c] -= term;
            }
        }
        for c in 0..D {
            let (mut dqg, mut dkg, mut dkr) = (0.0, 0.0, 0.0);
            for vi in 0..D {
                dqg += scale * d_o[i][vi] * s0[vi * D + c];
                dkg -= dw[i][vi] * s0[vi * D + c];
                dkr += u[i][vi] * dsn[vi * D + c];
            }
            dq[i][c] += dqg * g[i][c].exp();
            dg[i][c] += dqg * qg[i][c];
            dk[i][c] += dkg * g[i][c].exp() + dkr * (gl[c] - g[i][c]).exp();
            dg[i][c] += dkg * kg[i][c] - dkr * kr[i][c];
            dg[n - 1][c] += dkr * kr[i][c];
        }
    }
    // G_i = sum_{j <= i} gamma_j  =>  dgamma_j = sum_{i >= j} dG_i
    let mut dgamma = dg;
    for i in (0..n.saturating_sub(1)).rev() {
        for c in 0..D {
            dgamma[i][c] += dgamma[i + 1][c];
        }
    }
    ChunkGrads {
        dq,
        dk,
        dgamma,
        dbeta,
        dv: dw,
    }
}

/// [`super::recurrence_grad_f64`] through the chunked form with chunks of `chunk` tokens (test
/// sizes: serial, keeps every chunk's start state).
pub fn chunked_grad_f64(
    p: &KdaProblem,
    dout: &[f64],
    dfinal: Option<&[f64]>,
    chunk: usize,
) -> KdaGrads {
    super::backward::assert_backward_head_dim(p);
    assert!(chunk > 0, "chunk must be positive");
    let h_n = p.heads;
    let mut g = KdaGrads::zeros(p);
    let scale = f64::from(p.scale);
    let lb = f64::from(p.lower_bound);
    let cu = p.cu_seqlens();
    for n in 0..p.seq_lens.len() {
        let (bos, len) = (cu[n] as usize, p.seq_lens[n]);
        for h in 0..h_n {
            let a = f64::from(p.a_log[h]).exp();
            let toks: Vec<Tok> = (bos..bos + len).map(|t| tok(p, t, h)).collect();
            let mut starts = vec![initial_state_f64(p, n, h)];
            let chunks: Vec<&[Tok]> = toks.chunks(chunk).collect();
            for c in &chunks[..chunks.len().saturating_sub(1)] {
                let s = chunk_forward(c, starts.last().unwrap());
                starts.push(s);
            }
            let sb = (n * h_n + h) * D * D;
            let mut ds: Vec<f64> = match dfinal {
                Some(df) => df[sb..sb + D * D].to_vec(),
                None => vec![0.0; D * D],
            };
            for (ci, c) in chunks.iter().enumerate().rev() {
                let r0 = ci * chunk;
                let d_o: Vec<[f64; D]> = (0..c.len())
                    .map(|i| {
                        let base = ((bos + r0 + i) * h_n + h) * D;
                        std::array::from_fn(|vi| dout[base + vi])
                    })
                    .collect();
                let cg = chunk_backward(c, &starts[ci], &d_o, &mut ds, scale);
                for (i, tk) in c.iter().enumerate() {
                    let t = bos + r0 + i;
                    let base = (t * h_n + h) * D;
                    let qo = p.qk_offset(t, h);
                    let dq = l2_backward(&p.q[qo..qo + D], tk.rq, &cg.dq[i]);
                    let dk = l2_backward(&p.k[qo..qo + D], tk.rk, &cg.dk[i]);
                    for c in 0..D {
                        g.dq[qo + c] += dq[c];
                        g.dk[qo + c] += dk[c];
                        g.dv[base + c] = cg.dv[i][c];
                        // gamma = lb sigmoid(x), x = a (g + dt_bias), a = exp(A_log)
                        let dx = cg.dgamma[i][c] * lb * tk.sig[c] * (1.0 - tk.sig[c]);
                        g.dg[base + c] = dx * a;
                        g.ddt_bias[h * D + c] += dx * a;
                        g.da_log[h] += dx * tk.x[c];
                    }
                    g.dbeta[t * h_n + h] = cg.dbeta[i] * tk.beta * (1.0 - tk.beta);
                }
            }
            if p.initial_state.is_some() {
                g.dinitial_state[sb..sb + D * D].copy_from_slice(&ds);
            }
        }
    }
    // not computed here
    g.dbeta_scale = Vec::new();
    g.da_log_scale = Vec::new();
    g.ddt_bias_scale = Vec::new();
    g
}
