//! Float64 reference gradient of the token recurrence (`docs/specs/kda.md §1.3`), by hand-written reverse mode
//! through every token, the fused gate, the L2 norms and the beta sigmoid: the ground truth for the
//! backward kernel (issue 13). Keeps a state every 64 tokens per (sequence, head) and runs the
//! pairs on all cores.

use super::{HEAD_DIM, KdaProblem, NORM_EPS, initial_state_f64, sigmoid};

const D: usize = HEAD_DIM;

/// Gradients of `L = <dout, out> + <dfinal, final_state>` with respect to every input.
#[derive(Debug, Clone)]
pub struct KdaGrads {
    /// `[T, H_qk, 128]` (summed over the value heads of a GVA group).
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    /// `[T, H, 128]`.
    pub dv: Vec<f64>,
    /// `[T, H, 128]`, for the raw gate input `g`.
    pub dg: Vec<f64>,
    /// `[T, H]`, for the beta logits.
    pub dbeta: Vec<f64>,
    /// `[T, H]`: the size of `dbeta` without cancellation, the root of the sum of its squared terms
    /// (`dbeta = sigmoid'(beta) sum_v du_v (v - pred)_v`); what the sum's error scales with when each
    /// term carries an independent relative error. `da_log_scale` (`[H]`) and `ddt_bias_scale`
    /// (`[H, 128]`) the same for those sums over tokens (and channels). Empty where not computed
    /// (gradients read back from a device, the chunked form).
    pub dbeta_scale: Vec<f64>,
    pub da_log_scale: Vec<f64>,
    pub ddt_bias_scale: Vec<f64>,
    /// `[H]`.
    pub da_log: Vec<f64>,
    /// `[H, 128]`.
    pub ddt_bias: Vec<f64>,
    /// `[N, H, 128, 128]` (zeros when the problem has no initial state).
    pub dinitial_state: Vec<f64>,
}

impl KdaGrads {
    /// All-zero gradients of `p`'s shapes.
    pub fn zeros(p: &KdaProblem) -> KdaGrads {
        let (t, h, hq) = (p.tokens(), p.heads, p.qk_heads);
        KdaGrads {
            dq: vec![0.0; t * hq * D],
            dk: vec![0.0; t * hq * D],
            dv: vec![0.0; t * h * D],
            dg: vec![0.0; t * h * D],
            dbeta: vec![0.0; t * h],
            dbeta_scale: vec![0.0; t * h],
            da_log_scale: vec![0.0; h],
            ddt_bias_scale: vec![0.0; h * D],
            da_log: vec![0.0; h],
            ddt_bias: vec![0.0; h * D],
            dinitial_state: vec![0.0; p.seq_lens.len() * h * D * D],
        }
    }
}

pub(super) fn l2(x: &[f32]) -> ([f64; D], f64) {
    let ss: f64 = x.iter().map(|&a| f64::from(a) * f64::from(a)).sum();
    let r = 1.0 / (ss + NORM_EPS).sqrt();
    (std::array::from_fn(|c| f64::from(x[c]) * r), r)
}

/// `dx` of `x_hat = x * r` with `r = (sum x^2 + eps)^(-1/2)`, given `d x_hat`.
pub(super) fn l2_backward(x: &[f32], r: f64, dxh: &[f64; D]) -> [f64; D] {
    let dot: f64 = (0..D).map(|c| f64::from(x[c]) * dxh[c]).sum();
    std::array::from_fn(|c| r * dxh[c] - f64::from(x[c]) * r * r * r * dot)
}

/// One (sequence, head)'s share of the gradients (token rows relative to the sequence start).
struct HeadGrads {
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
    dg: Vec<f64>,
    dbeta: Vec<f64>,
    dbeta_scale: Vec<f64>,
    da_log: f64,
    /// Sums of the squared terms of `da_log` and `ddt_bias`.
    da_log_sq: f64,
    ddt_bias_sq: [f64; D],
    ddt_bias: [f64; D],
    dinitial_state: Vec<f64>,
}

/// Tokens between the saved states of the reference backward (recomputed in between).
const CHECKPOINT: usize = 64;

/// Reference gradient for upstream gradients `dout` (`[T, H, 128]`) and `dfinal`
/// (`[N, H, 128, 128]`, or none). Runs the (sequence, head) pairs on all cores, each keeping a
/// state every 64 tokens and recomputing the ones in between. Head dim 128 only: panics with a
/// message for any other [`KdaProblem::head_dim`].
pub fn recurrence_grad_f64(p: &KdaProblem, dout: &[f64], dfinal: Option<&[f64]>) -> KdaGrads {
    assert_backward_head_dim(p);
    let h_n = p.heads;
    let cu = p.cu_seqlens();
    let tasks: Vec<(usize, usize)> = (0..p.seq_lens.len())
        .flat_map(|n| (0..h_n).map(move |h| (n, h)))
        .collect();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(tasks.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let done: Vec<Vec<(usize, HeadGrads)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(n, h)) = tasks.get(i) else { break };
                        out.push((i, head_grad(p, n, h, cu[n] as usize, dout, dfinal)));
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("reference gradient worker panicked"))
            .collect()
    });
    let mut g = KdaGrads::zeros(p);
    for (i, hg) in done.into_iter().flatten() {
        let (n, h) = tasks[i];
        let bos = cu[n] as usize;
        for r in 0..p.seq_lens[n] {
            let t = bos + r;
            let qo = p.qk_offset(t, h);
            let base = (t * h_n + h) * D;
            for c in 0..D {
                g.dq[qo + c] += hg.dq[r * D + c];
                g.dk[qo + c] += hg.dk[r * D + c];
                g.dv[base + c] = hg.dv[r * D + c];
                g.dg[base + c] = hg.dg[r * D + c];
            }
            g.dbeta[t * h_n + h] = hg.dbeta[r];
            g.dbeta_scale[t * h_n + h] = hg.dbeta_scale[r];
        }
        g.da_log[h] += hg.da_log;
        g.da_log_scale[h] += hg.da_log_sq;
        for c in 0..D {
            g.ddt_bias[h * D + c] += hg.ddt_bias[c];
            g.ddt_bias_scale[h * D + c] += hg.ddt_bias_sq[c];
        }
        if p.initial_state.is_some() {
            let sb = (n * h_n + h) * D * D;
            g.dinitial_state[sb..sb + D * D].copy_from_slice(&hg.dinitial_state);
        }
    }
    for x in g.da_log_scale.iter_mut().chain(&mut g.ddt_bias_scale) {
        *x = x.sqrt();
    }
    g
}

fn head_grad(
    p: &KdaProblem,
    n: usize,
    h: usize,
    bos: usize,
    dout: &[f64],
    dfinal: Option<&[f64]>,
) -> HeadGrads {
    let h_n = p.heads;
    let len = p.seq_lens[n];
    let scale = f64::from(p.scale);
    let lb = f64::from(p.lower_bound);
    let a = f64::from(p.a_log[h]).exp();
    let mut g = HeadGrads {
        dq: vec![0.0; len * D],
        dk: vec![0.0; len * D],
        dv: vec![0.0; len * D],
        dg: vec![0.0; len * D],
        dbeta: vec![0.0; len],
        dbeta_scale: vec![0.0; len],
        da_log: 0.0,
        da_log_sq: 0.0,
        ddt_bias: [0.0; D],
        ddt_bias_sq: [0.0; D],
        dinitial_state: Vec::new(),
    };
    // forward, keeping the state before every CHECKPOINT-th token
    let mut s = initial_state_f64(p, n, h);
    let mut checkpoints = Vec::with_capacity(len.div_ceil(CHECKPOINT));
    for r in 0..len {
        if r % CHECKPOINT == 0 {
            checkpoints.push(s.clone());
        }
        step(p, bos + r, h, a, lb, &mut s);
    }
    let sb = (n * h_n + h) * D * D;
    let mut ds: Vec<f64> = match dfinal {
        Some(df) => df[sb..sb + D * D].to_vec(),
        None => vec![0.0; D * D],
    };
    for (j, ck) in checkpoints.iter().enumerate().rev() {
        let r0 = j * CHECKPOINT;
        let r1 = (r0 + CHECKPOINT).min(len);
        // the states before tokens r0..r1
        let mut states = Vec::with_capacity(r1 - r0);
        let mut s = ck.clone();
        for r in r0..r1 {
            states.push(s.clone());
            step(p, bos + r, h, a, lb, &mut s);
        }
        for r in (r0..r1).rev() {
            token_backward(
                p,
                h,
                bos + r,
                r,
                a,
                lb,
                scale,
                &states[r - r0],
                dout,
                &mut ds,
                &mut g,
            );
        }
    }
    g.dinitial_state = ds;
    g
}

/// Backward of token `t` (row `r` of its sequence) with `s0` the state before it and `ds` the
/// gradient of the state after it (updated in place to the gradient of the state before it).
#[allow(clippy::too_many_arguments)]
fn token_backward(
    p: &KdaProblem,
    h: usize,
    t: usize,
    r: usize,
    a: f64,
    lb: f64,
    scale: f64,
    s0: &[f64],
    dout: &[f64],
    ds: &mut [f64],
    g: &mut HeadGrads,
) {
    let h_n = p.heads;
    let base = (t * h_n + h) * D;
    let qo = p.qk_offset(t, h);
    let (qh, rq) = l2(&p.q[qo..qo + D]);
    let (kh, rk) = l2(&p.k[qo..qo + D]);
    let x: [f64; D] =
        std::array::from_fn(|c| a * (f64::from(p.g[base + c]) + f64::from(p.dt_bias[h * D + c])));
    let sig: [f64; D] = std::array::from_fn(|c| sigmoid(x[c]));
    let alpha: [f64; D] = std::array::from_fn(|c| (lb * sig[c]).exp());
    let beta = sigmoid(f64::from(p.beta[t * h_n + h]));
    let vrow = &p.v[base..base + D];
    // recompute this token's intermediates
    let mut s1 = vec![0.0; D * D];
    let mut pred = [0.0f64; D];
    for vi in 0..D {
        for c in 0..D {
            s1[vi * D + c] = s0[vi * D + c] * alpha[c];
            pred[vi] += s1[vi * D + c] * kh[c];
        }
    }
    let u: [f64; D] = std::array::from_fn(|vi| beta * (f64::from(vrow[vi]) - pred[vi]));
    // o = scale * S2 q_hat, S2 = S1 + u k_hat^T
    let dout_t = &dout[base..base + D];
    let mut dqh = [0.0f64; D];
    for vi in 0..D {
        for c in 0..D {
            let s2 = s1[vi * D + c] + u[vi] * kh[c];
            dqh[c] += scale * s2 * dout_t[vi];
            ds[vi * D + c] += scale * dout_t[vi] * qh[c];
        }
    }
    // dS2 = ds; du = dS2 k_hat; dk_hat = dS2^T u + S1^T dp
    let mut dkh = [0.0f64; D];
    let mut du = [0.0f64; D];
    for vi in 0..D {
        for c in 0..D {
            du[vi] += ds[vi * D + c] * kh[c];
            dkh[c] += ds[vi * D + c] * u[vi];
        }
    }
    let mut dbeta = 0.0;
    let mut dp = [0.0f64; D];
    for vi in 0..D {
        g.dv[r * D + vi] = beta * du[vi];
        dbeta += du[vi] * (f64::from(vrow[vi]) - pred[vi]);
        dp[vi] = -beta * du[vi];
    }
    // dS1 = dS2 + dp k_hat^T; dS = dS1 diag(alpha); dalpha = sum_v dS1 * S
    let mut dalpha = [0.0f64; D];
    for vi in 0..D {
        for c in 0..D {
            let ds1 = ds[vi * D + c] + dp[vi] * kh[c];
            dkh[c] += s1[vi * D + c] * dp[vi];
            dalpha[c] += ds1 * s0[vi * D + c];
            ds[vi * D + c] = ds1 * alpha[c];
        }
    }
    // alpha = exp(lb * sigmoid(x)), x = a (g + dt_bias), a = exp(A_log)
    for c in 0..D {
        let dx = dalpha[c] * alpha[c] * lb * sig[c] * (1.0 - sig[c]);
        g.dg[r * D + c] = dx * a;
        g.ddt_bias[c] += dx * a;
        g.da_log += dx * x[c]; // dx / dA_log = x
        g.da_log_sq += (dx * x[c]).powi(2);
        g.ddt_bias_sq[c] += (dx * a).powi(2);
    }
    g.dbeta[r] = dbeta * beta * (1.0 - beta);
    let sq: f64 = (0..D)
        .map(|vi| (du[vi] * (f64::from(vrow[vi]) - pred[vi])).powi(2))
        .sum();
    g.dbeta_scale[r] = beta * (1.0 - beta) * sq.sqrt();
    let dq = l2_backward(&p.q[qo..qo + D], rq, &dqh);
    let dk = l2_backward(&p.k[qo..qo + D], rk, &dkh);
    for c in 0..D {
        g.dq[r * D + c] = dq[c];
        g.dk[r * D + c] = dk[c];
    }
}

/// One token of the recurrence on state `s` (`[v][k]`), as `recurrence_f64`.
fn step(p: &KdaProblem, t: usize, h: usize, a: f64, lb: f64, s: &mut [f64]) {
    let base = (t * p.heads + h) * D;
    let qo = p.qk_offset(t, h);
    let (kh, _) = l2(&p.k[qo..qo + D]);
    let alpha: [f64; D] = std::array::from_fn(|c| {
        let x = a * (f64::from(p.g[base + c]) + f64::from(p.dt_bias[h * D + c]));
        (lb * sigmoid(x)).exp()
    });
    let beta = sigmoid(f64::from(p.beta[t * p.heads + h]));
    for (vi, row) in s.chunks_exact_mut(D).enumerate() {
        let mut pred = 0.0;
        for c in 0..D {
            row[c] *= alpha[c];
            pred += row[c] * kh[c];
        }
        let u = beta * (f64::from(p.v[base + vi]) - pred);
        for c in 0..D {
            row[c] += u * kh[c];
        }
    }
}

/// The backward references take head dim [`HEAD_DIM`] (128) only.
pub(super) fn assert_backward_head_dim(p: &KdaProblem) {
    assert!(
        p.head_dim == HEAD_DIM,
        "the backward references support head dim {HEAD_DIM} only, not {}",
        p.head_dim
    );
}
