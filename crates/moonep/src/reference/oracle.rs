//! Dense MoE oracle: no communication, no planning, same rounding points as the cluster.

use half::bf16;

use super::ExpertBank;
use super::experts::{matvec, matvec_t};

/// `out[t] = bf16(Σ_k bf16(w_tk · W_{e_tk} x_t))`, f32 accumulation in ascending k.
/// `x` is `[s*H]`, `w` and `topk` are `[s*K]`.
pub fn dense_forward(
    bank: &ExpertBank,
    x: &[bf16],
    w: &[f32],
    topk: &[u32],
    top_k: usize,
) -> Vec<bf16> {
    let h = bank.hidden;
    let s = x.len() / h;
    let mut out = vec![bf16::ZERO; s * h];
    let mut z = vec![0f32; h];
    let mut acc = vec![0f32; h];
    for t in 0..s {
        let xt = &x[t * h..(t + 1) * h];
        acc.fill(0.0);
        for k in 0..top_k {
            let i = t * top_k + k;
            matvec(
                &bank.weights[topk[i] as usize],
                |j| xt[j].to_f32(),
                h,
                &mut z,
            );
            for (a, zo) in acc.iter_mut().zip(&z) {
                *a += bf16::from_f32(w[i] * zo).to_f32();
            }
        }
        for (o, a) in out[t * h..(t + 1) * h].iter_mut().zip(&acc) {
            *o = bf16::from_f32(*a);
        }
    }
    out
}

/// Gradients of `L = Σ_t <g_t, out_t>` for one source rank.
#[derive(Debug, Clone, PartialEq)]
pub struct DenseGrads {
    /// `[s*H]`: `bf16(Σ_k bf16(w_tk · Wᵀ g_t))`.
    pub dx: Vec<bf16>,
    /// `[s*K]`: `<g_t, W x_t>`.
    pub dw: Vec<f32>,
}

/// Backward of [`dense_forward`] for one rank; adds `w_tk · g_t x_tᵀ` into `dweights[e]`.
pub fn dense_backward(
    bank: &ExpertBank,
    x: &[bf16],
    w: &[f32],
    topk: &[u32],
    top_k: usize,
    grad_out: &[bf16],
    dweights: &mut [Vec<f32>],
) -> DenseGrads {
    let h = bank.hidden;
    let s = x.len() / h;
    let mut dx = vec![bf16::ZERO; s * h];
    let mut dw = vec![0f32; s * top_k];
    let (mut z, mut tv, mut acc) = (vec![0f32; h], vec![0f32; h], vec![0f32; h]);
    for t in 0..s {
        let xt = &x[t * h..(t + 1) * h];
        let gt = &grad_out[t * h..(t + 1) * h];
        acc.fill(0.0);
        for k in 0..top_k {
            let i = t * top_k + k;
            let e = topk[i] as usize;
            let we = &bank.weights[e];
            matvec(we, |j| xt[j].to_f32(), h, &mut z);
            matvec_t(we, |o| gt[o].to_f32(), h, &mut tv);
            for (a, v) in acc.iter_mut().zip(&tv) {
                *a += bf16::from_f32(w[i] * v).to_f32();
            }
            dw[i] = (0..h)
                .map(|o| gt[o].to_f32() * z[o])
                .fold(0.0, |a, b| a + b);
            for o in 0..h {
                let go = w[i] * gt[o].to_f32();
                for j in 0..h {
                    dweights[e][o * h + j] += go * xt[j].to_f32();
                }
            }
        }
        for (o, a) in dx[t * h..(t + 1) * h].iter_mut().zip(&acc) {
            *o = bf16::from_f32(*a);
        }
    }
    DenseGrads { dx, dw }
}
