//! The kernels' arithmetic on the CPU: fp32 math with bf16 rounding at the same points as
//! `kernels/kda_fwd.cu` (and `kda_fwd_pipelined.cu`, `kda_fwd_ws.cu`: same rounding points), so a GPU result can be compared at ~1e-3 instead of the ~5e-3 that
//! separates any bf16 implementation from float64.
//!
//! Rounding points (compare `docs/specs/kda.md §1.6`, which lists the public FlashKDA's): q̂, k̂ stay fp32;
//! `kd, qd, ki, kr` are rounded to bf16 once each (`kr` from `2^{Gtot-G}` directly); `A` and its
//! inverse are fp32 (inverse by forward substitution), `INV` and `M` rounded to bf16; the state
//! is **fp32** (rounded to bf16 only as a matmul operand); `Vb = bf16((v - S kd) b)`,
//! `U = bf16(INV Vb)`, `out = bf16(S qd + M U)`, `S = S E + Uᵀ kr` in fp32.

use super::{CHUNK, KdaOutput, KdaProblem, per_sequence_head};

pub(crate) fn bf(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

pub(crate) fn sigmoid32(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Dot product accumulated in f64 and rounded to f32 (the MMA accumulates in fp32; the order
/// differs anyway, so the closer-to-exact sum is the better model).
pub(crate) fn dot32(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum::<f64>() as f32
}

/// How one operand enters its product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operand {
    /// Rounded to bf16 once.
    Bf16,
    /// As a hi + lo pair of bf16 values (`hi = bf16(x)`, `lo = bf16(x - hi)`: about 16 bits).
    Split,
    /// Unrounded fp32 (the floor of this arithmetic; no kernel does this).
    F32,
}

impl Operand {
    pub(crate) fn apply(self, x: f32) -> f32 {
        match self {
            Operand::Bf16 => bf(x),
            Operand::Split => {
                let hi = bf(x);
                hi + bf(x - hi)
            }
            Operand::F32 => x,
        }
    }
}

/// How each intermediate value enters the tensor cores. The output is always rounded (it is a
/// bf16 tensor). Each field is one operand of one product, so it maps onto one kernel change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rounding {
    /// The operands of the per-chunk products `A = kd kiᵀ` and `M = qd kiᵀ` (`kd`, `qd`, `ki`).
    pub prep: Operand,
    /// Decayed keys `kd = k̂ 2^G` as the operand of `W = S kdᵀ`.
    pub kd: Operand,
    /// Decayed, scaled queries `qd` as the operand of `O1 = S qdᵀ`.
    pub qd: Operand,
    /// Tail-decayed keys `kr = k̂ 2^(Gtot-G)` (operand of the state update).
    pub kr: Operand,
    /// `INV = (I + A)^-1`.
    pub inv: Operand,
    /// `M = lower(qd kiᵀ)` (operand of `M U`).
    pub m: Operand,
    /// The state as the operand of `S kdᵀ` and `S qdᵀ` (it is held in fp32 either way).
    pub state_operand: Operand,
    /// `Vb = (v - S kd) b` (operand of `INV Vb`).
    pub vb: Operand,
    /// `U = INV Vb` as the operand of the output product `M U`.
    pub u_out: Operand,
    /// `U` as the operand of the state update `Uᵀ kr`.
    pub u_state: Operand,
}

impl Rounding {
    /// Every operand bf16: `kda_fwd.cu`, `kda_fwd_pipelined.cu`, `kda_fwd_ws.cu`.
    pub const KERNEL: Self = Self::all(Operand::Bf16);
    /// `kda_fwd_ws_split.cu`: hi + lo pairs where bf16 costs the most for the least work
    /// (`examples/rounding_cost.rs`): the prep products, `M`, `Vb` and `U`.
    pub const SPLIT: Self = Self {
        prep: Operand::Split,
        m: Operand::Split,
        vb: Operand::Split,
        u_out: Operand::Split,
        u_state: Operand::Split,
        ..Self::KERNEL
    };
    /// Nothing rounded but the output: the fp32 floor of this arithmetic.
    pub const NONE: Self = Self::all(Operand::F32);

    const fn all(o: Operand) -> Self {
        Self {
            prep: o,
            kd: o,
            qd: o,
            kr: o,
            inv: o,
            m: o,
            state_operand: o,
            vb: o,
            u_out: o,
            u_state: o,
        }
    }
}

/// The fp32 initial state of (sequence `nseq`, head `h`), `[v][k]` (zeros when absent).
pub(crate) fn initial_state_f32(p: &KdaProblem, nseq: usize, h: usize) -> Vec<f32> {
    let hd2 = p.head_dim * p.head_dim;
    match &p.initial_state {
        Some(st) => st[(nseq * p.heads + h) * hd2..][..hd2].to_vec(),
        None => vec![0.0; hd2],
    }
}

/// Kernel-rounding forward; `final_state` is the fp32 state the kernel holds on chip.
pub fn emulated(p: &KdaProblem) -> KdaOutput {
    emulated_with(p, Rounding::KERNEL)
}

/// [`emulated`] with the bf16 rounding points chosen by `r` (to find what each one costs).
pub fn emulated_with(p: &KdaProblem, r: Rounding) -> KdaOutput {
    let rd = |o: Operand, x: f32| o.apply(x);
    let lb2 = p.lower_bound * std::f32::consts::LOG2_E;
    let d = p.head_dim;
    emulate_chunks(p, r, CHUNK, |h, t0, n| {
        let exp_a = p.a_log[h].exp();
        let dtb = &p.dt_bias[h * d..][..d];
        let row =
            |x: &[f32], i: usize| -> Vec<f32> { x[((t0 + i) * p.heads + h) * d..][..d].to_vec() };
        let rn = |x: &[f32]| 1.0 / (x.iter().map(|a| a * a).sum::<f32>() + 1e-6).sqrt();
        let mut kd = vec![vec![0.0f32; d]; n];
        let mut qd = vec![vec![0.0f32; d]; n];
        let mut kd_p = vec![vec![0.0f32; d]; n]; // the prep products' operands
        let mut qd_p = vec![vec![0.0f32; d]; n];
        let mut ki = vec![vec![0.0f32; d]; n];
        let mut kr = vec![vec![0.0f32; d]; n];
        let mut e = vec![0.0f32; d];
        let b: Vec<f32> = (0..n)
            .map(|i| sigmoid32(p.beta[(t0 + i) * p.heads + h]))
            .collect();
        let qk_row = |x: &[f32], i: usize| x[p.qk_offset(t0 + i, h)..][..d].to_vec();
        let qs: Vec<Vec<f32>> = (0..n).map(|i| qk_row(&p.q, i)).collect();
        let ks: Vec<Vec<f32>> = (0..n).map(|i| qk_row(&p.k, i)).collect();
        let gs: Vec<Vec<f32>> = (0..n).map(|i| row(&p.g, i)).collect();
        let rnq: Vec<f32> = qs.iter().map(|x| rn(x)).collect();
        let rnk: Vec<f32> = ks.iter().map(|x| rn(x)).collect();
        for c in 0..d {
            let mut acc = 0.0f32;
            let mut gcum = [0.0f32; CHUNK];
            for i in 0..n {
                acc += lb2 * sigmoid32(exp_a * (gs[i][c] + dtb[c]));
                gcum[i] = acc;
            }
            e[c] = acc.exp2();
            for i in 0..n {
                let kn = ks[i][c] * rnk[i];
                let qn = qs[i][c] * rnq[i] * p.scale;
                let ex = gcum[i].exp2();
                kd[i][c] = rd(r.kd, kn * ex);
                qd[i][c] = rd(r.qd, qn * ex);
                kd_p[i][c] = rd(r.prep, kn * ex);
                qd_p[i][c] = rd(r.prep, qn * ex);
                ki[i][c] = rd(r.prep, kn * (-gcum[i]).exp2());
                kr[i][c] = rd(r.kr, kn * (acc - gcum[i]).exp2());
            }
        }
        // A (fp32, scaled by b), its inverse (fp32 forward substitution), M (bf16)
        let mut inv = vec![vec![0.0f32; n]; n];
        {
            let a: Vec<Vec<f32>> = (0..n)
                .map(|i| {
                    (0..n)
                        .map(|j| {
                            if j < i {
                                dot32(&kd_p[i], &ki[j]) * b[i]
                            } else {
                                0.0
                            }
                        })
                        .collect()
                })
                .collect();
            for j in 0..n {
                let mut x = vec![0.0f32; n];
                for i in 0..n {
                    let mut acc = if i == j { 1.0f32 } else { 0.0 };
                    for m in 0..i {
                        acc = (-a[i][m]).mul_add(x[m], acc);
                    }
                    x[i] = acc;
                }
                for i in 0..n {
                    inv[i][j] = rd(r.inv, x[i]);
                }
            }
        }
        let m: Vec<Vec<f32>> = (0..n)
            .map(|i| {
                (0..n)
                    .map(|j| {
                        if j <= i {
                            rd(r.m, dot32(&qd_p[i], &ki[j]))
                        } else {
                            0.0
                        }
                    })
                    .collect()
            })
            .collect();
        ChunkStep {
            kd,
            qd,
            kr,
            e,
            inv,
            m,
            b,
        }
    })
}

/// One chunk's state-dependent chain with the kernels' rounding (shared by the 16- and 64-token
/// emulations): `Vb = (v - S kd) b`, `U = INV Vb`, `out = bf16(S qd + M U)`, `S = S diag(E) + Uᵀ kr`
/// in fp32. Rows of `kd`, `qd`, `kr` are tokens (already rounded as operands); `out` holds the
/// chunk's `n` rows of `d` values.
pub(crate) struct ChunkStep {
    pub kd: Vec<Vec<f32>>,
    pub qd: Vec<Vec<f32>>,
    pub kr: Vec<Vec<f32>>,
    pub e: Vec<f32>,
    pub inv: Vec<Vec<f32>>,
    pub m: Vec<Vec<f32>>,
    pub b: Vec<f32>,
}

/// Both emulations' walk over the chunks: every (sequence, head) from its fp32 initial state,
/// chunks of at most `chunk` tokens in order; `prep(h, t0, n)` rounds the operands of head `h`'s
/// `n` tokens from token `t0`, [`ChunkStep::run`] steps the state. `final_state` is the fp32 one.
pub(crate) fn emulate_chunks<F>(p: &KdaProblem, r: Rounding, chunk: usize, prep: F) -> KdaOutput
where
    F: Fn(usize, usize, usize) -> ChunkStep + Sync,
{
    let d = p.head_dim;
    per_sequence_head(p, |nseq, h, bos, len| {
        let mut s = initial_state_f32(p, nseq, h);
        let mut out = vec![0.0f64; len * d];
        let mut c0 = 0;
        while c0 < len {
            let n = chunk.min(len - c0);
            let v_at = |i: usize, vi: usize| p.v[((bos + c0 + i) * p.heads + h) * d + vi];
            let step = prep(h, bos + c0, n);
            step.run(&mut s, &v_at, &mut out[c0 * d..(c0 + n) * d], d, r);
            c0 += n;
        }
        (out, s.iter().map(|&x| f64::from(x)).collect())
    })
}

impl ChunkStep {
    pub(crate) fn run(
        &self,
        s: &mut [f32],
        v_at: &dyn Fn(usize, usize) -> f32,
        out: &mut [f64],
        d: usize,
        r: Rounding,
    ) {
        let n = self.kd.len();
        let sb: Vec<f32> = s.iter().map(|&x| r.state_operand.apply(x)).collect();
        let mut u = vec![vec![0.0f32; d]; n]; // [token][v], the output's operand
        let mut us = vec![vec![0.0f32; d]; n]; // the state update's operand
        for vi in 0..d {
            let srow = &sb[vi * d..][..d];
            let vb: Vec<f32> = (0..n)
                .map(|i| {
                    let w = dot32(srow, &self.kd[i]);
                    r.vb.apply((v_at(i, vi) - w) * self.b[i])
                })
                .collect();
            for i in 0..n {
                let x = dot32(&self.inv[i][..n], &vb);
                u[i][vi] = r.u_out.apply(x);
                us[i][vi] = r.u_state.apply(x);
            }
            let ucol: Vec<f32> = (0..n).map(|j| u[j][vi]).collect();
            for i in 0..n {
                let o = f64::from(dot32(srow, &self.qd[i])) + f64::from(dot32(&self.m[i], &ucol));
                out[i * d + vi] = f64::from(bf(o as f32));
            }
        }
        for vi in 0..d {
            for c in 0..d {
                let acc: f64 = (0..n)
                    .map(|i| f64::from(us[i][vi]) * f64::from(self.kr[i][c]))
                    .sum();
                s[vi * d + c] = (f64::from(s[vi * d + c] * self.e[c]) + acc) as f32;
            }
        }
    }
}
