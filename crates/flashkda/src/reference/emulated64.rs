//! The chunk-64 kernels' arithmetic on the CPU (`kernels/kda_fwd_c64.cu`): fp32 math with the
//! operand roundings of a [`Rounding`], 64-token chunks whose `INV` and `M` are built from
//! 16-token sub-chunks ([`super::chunked64`] has the construction and its range argument).
//!
//! Rounding points (the same fields as [`super::emulated`], per 64-token chunk):
//! q̂, k̂, the gates and their cumulative sum (from the chunk start) are fp32; the prep products
//! `A` and `M` take the sub-chunk operands `kdl, qdl, kc` through `prep`; `A` is fp32 (scaled by
//! `b`), `INV` by block forward substitution (diagonal blocks in fp32, off-diagonal block products
//! on hi + lo split operands with fp32 sums), then through `inv`; `M` through `m`;
//! `kd, qd, kr` through their fields (`kr` from `2^{Gtot-G}` directly), `E = 2^{Gtot}` fp32; the
//! state is fp32 and enters `S kdᵀ`, `S qdᵀ` through `state_operand`; `Vb = (v - S kd) b` through
//! `vb`, `U = INV Vb` through `u_out` (output product) and `u_state` (state update);
//! `out = bf16(S qd + M U)`, `S = S E + Uᵀ kr` in fp32.

use super::chunked64::{Arith, CHUNK64, SUB_CHUNK, build_intra};
use super::emulated::{ChunkStep, Operand, Rounding, emulate_chunks, sigmoid32};
use super::{KdaOutput, KdaProblem};

/// The rounding the chunk-64 kernel uses (`examples/rounding_cost_c64.rs` measures the choices):
/// the 16-token split kernels' points, hi + lo bf16 pairs for the prep products, `M`, `Vb` and `U`;
/// bf16 `kd, qd, kr`, `INV` and state operand (a split `INV` measured no better: 1.664e-3 either
/// way on fixed-2048-H2).
pub const C64_KERNEL: Rounding = Rounding::SPLIT;

/// Chunk-64 kernel emulation with [`C64_KERNEL`]; `final_state` is the fp32 on-chip state.
pub fn emulated_c64(p: &KdaProblem) -> KdaOutput {
    emulated_chunked_with(p, CHUNK64, C64_KERNEL)
}

/// The emulation at chunk length `chunk` (a multiple of [`SUB_CHUNK`]) with roundings `r`.
pub fn emulated_chunked_with(p: &KdaProblem, chunk: usize, r: Rounding) -> KdaOutput {
    assert!(
        chunk > 0 && chunk.is_multiple_of(SUB_CHUNK),
        "chunk length must be a positive multiple of {SUB_CHUNK}"
    );
    let lb2 = p.lower_bound * std::f32::consts::LOG2_E;
    let d = p.head_dim;
    let f32s = |x: f64| f64::from(x as f32);
    let prep = |x: f64| f64::from(r.prep.apply(x as f32));
    // the kernel's off-diagonal INV blocks: mma.sync on hi + lo operands (the lo x lo term is left
    // out there, below 2^-16 relative)
    let split = |x: f64| f64::from(Operand::Split.apply(x as f32));
    let ar = Arith {
        store: &f32s,
        operand: &prep,
        inv_operand: &split,
    };
    emulate_chunks(p, r, chunk, |h, t0, n| {
        let exp_a = p.a_log[h].exp();
        let dtb = &p.dt_bias[h * d..][..d];
        let tok = |i: usize| t0 + i;
        let qk_row = |x: &[f32], i: usize| x[p.qk_offset(tok(i), h)..][..d].to_vec();
        let rn = |x: &[f32]| 1.0 / (x.iter().map(|a| a * a).sum::<f32>() + 1e-6).sqrt();
        let b: Vec<f32> = (0..n)
            .map(|i| sigmoid32(p.beta[tok(i) * p.heads + h]))
            .collect();
        let mut kn = vec![vec![0.0f32; d]; n];
        let mut qn = vec![vec![0.0f32; d]; n];
        let mut g = vec![vec![0.0f32; d]; n];
        for i in 0..n {
            let (q, k) = (qk_row(&p.q, i), qk_row(&p.k, i));
            let (rq, rk) = (rn(&q), rn(&k));
            for c in 0..d {
                kn[i][c] = k[c] * rk;
                qn[i][c] = q[c] * rq * p.scale;
            }
        }
        let mut e = vec![0.0f32; d];
        for c in 0..d {
            let mut acc = 0.0f32;
            for i in 0..n {
                let x = p.g[(tok(i) * p.heads + h) * d + c] + dtb[c];
                acc += lb2 * sigmoid32(exp_a * x);
                g[i][c] = acc;
            }
            e[c] = acc.exp2();
        }
        let wide = |x: &[Vec<f32>]| -> Vec<Vec<f64>> {
            x.iter()
                .map(|r| r.iter().map(|&v| f64::from(v)).collect())
                .collect()
        };
        let bw: Vec<f64> = b.iter().map(|&x| f64::from(x)).collect();
        let intra = build_intra(&wide(&kn), &wide(&qn), &wide(&g), &bw, &ar);
        let inv: Vec<Vec<f32>> = (0..n)
            .map(|i| {
                (0..n)
                    .map(|j| r.inv.apply(intra.inv[i][j] as f32))
                    .collect()
            })
            .collect();
        let m: Vec<Vec<f32>> = (0..n)
            .map(|i| (0..n).map(|j| r.m.apply(intra.m[i][j] as f32)).collect())
            .collect();
        let per = |o: Operand, f: &dyn Fn(usize, usize) -> f32| -> Vec<Vec<f32>> {
            (0..n)
                .map(|i| (0..d).map(|c| o.apply(f(i, c))).collect())
                .collect()
        };
        let kd = per(r.kd, &|i, c| kn[i][c] * g[i][c].exp2());
        let qd = per(r.qd, &|i, c| qn[i][c] * g[i][c].exp2());
        let gt = &g[n - 1];
        let kr = per(r.kr, &|i, c| kn[i][c] * (gt[c] - g[i][c]).exp2());
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
