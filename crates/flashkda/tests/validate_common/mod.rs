//! What the validation test binaries share: argument views over made-up device addresses.

use flashkda::{BwdArgs, DType, FwdArgs, TensorView};

/// A contiguous view of `shape` at `ptr` on device 0.
pub fn t(dtype: DType, shape: &[usize], ptr: u64) -> TensorView {
    TensorView::contiguous(ptr, dtype, shape, 0)
}

/// Forward arguments: `b` x `tt` tokens, `h` value heads over `hq` query/key heads, head dim `d`;
/// bf16 activations, fp32 `A_log` and `dt_bias`, no states, scale 1/8.
pub fn args(b: usize, tt: usize, h: usize, hq: usize, d: usize) -> FwdArgs {
    FwdArgs {
        q: t(DType::BF16, &[b, tt, hq, d], 0x1000),
        k: t(DType::BF16, &[b, tt, hq, d], 0x2000),
        v: t(DType::BF16, &[b, tt, h, d], 0x3000),
        g: t(DType::BF16, &[b, tt, h, d], 0x4000),
        beta: t(DType::BF16, &[b, tt, h], 0x5000),
        out: t(DType::BF16, &[b, tt, h, d], 0x6000),
        a_log: t(DType::F32, &[h], 0x7000),
        dt_bias: t(DType::F32, &[h, d], 0x8000),
        initial_state: None,
        final_state: None,
        cu_seqlens: None,
        scale: 0.125,
        lower_bound: -5.0,
    }
}

/// Backward arguments over the inputs of `f` (without states): `dout` at `out`'s shape, every
/// gradient at its input's shape, bf16 (fp32 `dA_log`, `ddt_bias`).
pub fn bwd_args(f: FwdArgs) -> BwdArgs {
    BwdArgs {
        dout: t(DType::BF16, &f.out.shape, 0x11000),
        dfinal_state: None,
        dq: t(DType::BF16, &f.q.shape, 0x12000),
        dk: t(DType::BF16, &f.k.shape, 0x13000),
        dv: t(DType::BF16, &f.v.shape, 0x14000),
        dg: t(DType::BF16, &f.g.shape, 0x15000),
        dbeta: t(DType::BF16, &f.beta.shape, 0x16000),
        da_log: t(DType::F32, &f.a_log.shape, 0x17000),
        ddt_bias: t(DType::F32, &f.dt_bias.shape, 0x18000),
        dinitial_state: None,
        q: f.q,
        k: f.k,
        v: f.v,
        g: f.g,
        beta: f.beta,
        a_log: f.a_log,
        dt_bias: f.dt_bias,
        initial_state: None,
        cu_seqlens: None,
        scale: f.scale,
        lower_bound: f.lower_bound,
    }
}
