//! Typed views of device tensors and the one [`validate`] that turns a [`FwdArgs`] into a
//! [`FwdPlan`] or a [`FlashKdaError`] (`docs/specs/kda.md §2`).

use crate::error::FlashKdaError;
use crate::reference::{HEAD_DIM, HEAD_DIMS};

/// Element type of a device tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    BF16,
    F32,
    I64,
    /// Anything else (named for the error message).
    Other(&'static str),
}

impl DType {
    pub fn name(self) -> &'static str {
        match self {
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::I64 => "int64",
            DType::Other(s) => s,
        }
    }

    pub fn size(self) -> u64 {
        match self {
            DType::BF16 => 2,
            DType::F32 => 4,
            DType::I64 => 8,
            DType::Other(_) => 1,
        }
    }
}

/// Where a tensor lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Device {
    Cuda(usize),
    /// Any non-CUDA device, by name (e.g. "cpu").
    Other(String),
}

/// A borrowed device tensor: raw pointer, shape and strides in elements. Building one is safe;
/// the launch trusts the pointer to address `shape` elements on `device`.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorView {
    pub ptr: u64,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub strides: Vec<isize>,
    pub device: Device,
}

impl TensorView {
    /// A contiguous row-major view.
    pub fn contiguous(ptr: u64, dtype: DType, shape: &[usize], ordinal: usize) -> Self {
        let mut strides = vec![1isize; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * shape[i + 1] as isize;
        }
        TensorView {
            ptr,
            dtype,
            shape: shape.to_vec(),
            strides,
            device: Device::Cuda(ordinal),
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Arguments of one forward call (`docs/specs/kda.md §2`): `[B, T, H, D]` bf16 q, k, v, g, out; `[B, T, H]`
/// bf16 beta logits; fp32 `A_log [H]`, `dt_bias [H, D]`; optional `[N, H, D, D]` states
/// (bf16 or fp32, row = value channel) and int64 `cu_seqlens [N + 1]` (then `B == 1`). The head
/// dim `D` (K = V) is 128 or 64 (q's last dimension; 64 runs on the workspace schedule only).
#[derive(Debug, Clone)]
pub struct FwdArgs {
    pub q: TensorView,
    pub k: TensorView,
    pub v: TensorView,
    pub g: TensorView,
    pub beta: TensorView,
    pub out: TensorView,
    pub a_log: TensorView,
    pub dt_bias: TensorView,
    pub initial_state: Option<TensorView>,
    pub final_state: Option<TensorView>,
    pub cu_seqlens: Option<TensorView>,
    pub scale: f32,
    pub lower_bound: f32,
}

/// State dtype of a call with state I/O.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateDType {
    BF16,
    F32,
}

/// What [`validate`] found: the problem's sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FwdPlan {
    pub batch: usize,
    /// Tokens per batch row (the packed total with `cu_seqlens`).
    pub seq_len: usize,
    /// Value heads (of v, g, beta, out, states).
    pub heads: usize,
    /// Query/key heads: `heads` is a multiple (GVA when larger; value head `h` reads q/k head
    /// `h / (heads / qk_heads)`, as fla).
    pub qk_heads: usize,
    /// Sequences: `B` without `cu_seqlens`, `len(cu_seqlens) - 1` with it.
    pub num_seqs: usize,
    pub varlen: bool,
    pub state: Option<StateDType>,
    pub ordinal: usize,
    /// Key = value head dimension, one of [`HEAD_DIMS`].
    pub head_dim: usize,
}

fn check_dtype(name: &'static str, t: &TensorView, want: DType) -> Result<(), FlashKdaError> {
    if t.dtype != want {
        return Err(FlashKdaError::DType {
            tensor: name,
            expected: want.name(),
            found: t.dtype.name().into(),
        });
    }
    Ok(())
}

/// A state tensor (`[N, H, D, D]`, contiguous, on `ordinal`): its dtype, bf16 or fp32.
fn state_view(
    name: &'static str,
    t: &TensorView,
    shape: [usize; 4],
    ordinal: usize,
) -> Result<StateDType, FlashKdaError> {
    let d = match t.dtype {
        DType::BF16 => StateDType::BF16,
        DType::F32 => StateDType::F32,
        other => {
            return Err(FlashKdaError::DType {
                tensor: name,
                expected: "bfloat16 or float32",
                found: other.name().into(),
            });
        }
    };
    check_layout(name, t, &shape, ordinal, 8)?;
    Ok(d)
}

fn check_layout(
    name: &'static str,
    t: &TensorView,
    shape: &[usize],
    ordinal: usize,
    align: u64,
) -> Result<(), FlashKdaError> {
    if t.shape != shape {
        let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        return Err(FlashKdaError::Shape {
            tensor: name,
            expected: format!("[{}]", dims.join(", ")),
            found: t.shape.clone(),
        });
    }
    if t.strides.len() != t.shape.len() {
        return Err(FlashKdaError::NotContiguous {
            tensor: name,
            shape: t.shape.clone(),
            strides: t.strides.clone(),
        });
    }
    let mut expect = 1isize;
    for i in (0..t.shape.len()).rev() {
        if t.shape[i] > 1 && t.strides[i] != expect {
            return Err(FlashKdaError::NotContiguous {
                tensor: name,
                shape: t.shape.clone(),
                strides: t.strides.clone(),
            });
        }
        expect *= t.shape[i] as isize;
    }
    match &t.device {
        Device::Cuda(o) if *o == ordinal => {}
        Device::Cuda(o) => {
            return Err(FlashKdaError::Device {
                tensor: name,
                expected: ordinal,
                found: format!("cuda:{o}"),
            });
        }
        Device::Other(s) => {
            return Err(FlashKdaError::Device {
                tensor: name,
                expected: ordinal,
                found: s.clone(),
            });
        }
    }
    if t.numel() > 0 {
        if t.ptr == 0 {
            return Err(FlashKdaError::NullPointer { tensor: name });
        }
        if !t.ptr.is_multiple_of(align) {
            return Err(FlashKdaError::Misaligned {
                tensor: name,
                ptr: t.ptr,
                align,
            });
        }
    }
    Ok(())
}

/// Checks every shape, dtype, layout, device and scalar of `args`. Does not read device memory
/// (the contents of `cu_seqlens` are checked by the launcher).
pub fn validate(args: &FwdArgs) -> Result<FwdPlan, FlashKdaError> {
    let ordinal = match &args.q.device {
        Device::Cuda(o) => *o,
        Device::Other(s) => {
            return Err(FlashKdaError::Device {
                tensor: "q",
                expected: 0,
                found: s.clone(),
            });
        }
    };
    for (name, t) in [
        ("q", &args.q),
        ("k", &args.k),
        ("v", &args.v),
        ("g", &args.g),
        ("beta", &args.beta),
        ("out", &args.out),
    ] {
        check_dtype(name, t, DType::BF16)?;
    }
    check_dtype("A_log", &args.a_log, DType::F32)?;
    check_dtype("dt_bias", &args.dt_bias, DType::F32)?;
    let s = &args.q.shape;
    if s.len() != 4 || !HEAD_DIMS.contains(&s[3]) {
        return Err(FlashKdaError::Shape {
            tensor: "q",
            expected: "[B, T, H, D] with D = 64 or 128".into(),
            found: s.clone(),
        });
    }
    let (batch, seq_len, qk_heads, d) = (s[0], s[1], s[2], s[3]);
    if qk_heads == 0 {
        return Err(FlashKdaError::Shape {
            tensor: "q",
            expected: "H >= 1".into(),
            found: s.clone(),
        });
    }
    // value heads from v (GVA: a multiple of q's heads); a malformed v fails its layout check
    let vs = &args.v.shape;
    let heads = if vs.len() == 4 && vs[0] == batch && vs[1] == seq_len && vs[3] == d {
        vs[2]
    } else {
        qk_heads
    };
    if heads == 0 || !heads.is_multiple_of(qk_heads) {
        return Err(FlashKdaError::Shape {
            tensor: "v",
            expected: format!("[B, T, H, {d}] with H a multiple of q's {qk_heads} heads"),
            found: vs.clone(),
        });
    }
    let qk = [batch, seq_len, qk_heads, d];
    let act = [batch, seq_len, heads, d];
    for (name, t, shape) in [
        ("q", &args.q, &qk),
        ("k", &args.k, &qk),
        ("v", &args.v, &act),
        ("g", &args.g, &act),
        ("out", &args.out, &act),
    ] {
        check_layout(name, t, shape, ordinal, 16)?;
    }
    check_layout("beta", &args.beta, &[batch, seq_len, heads], ordinal, 2)?;
    check_layout("A_log", &args.a_log, &[heads], ordinal, 4)?;
    check_layout("dt_bias", &args.dt_bias, &[heads, d], ordinal, 4)?;
    if !(-5.0..0.0).contains(&args.lower_bound) {
        return Err(FlashKdaError::LowerBound(args.lower_bound));
    }
    if !args.scale.is_finite() {
        return Err(FlashKdaError::Scale(args.scale));
    }
    let num_seqs = match &args.cu_seqlens {
        None => batch,
        Some(cu) => {
            if batch != 1 {
                return Err(FlashKdaError::VarlenBatch(batch));
            }
            check_dtype("cu_seqlens", cu, DType::I64)?;
            if cu.shape.len() != 1 || cu.shape[0] < 2 {
                return Err(FlashKdaError::Shape {
                    tensor: "cu_seqlens",
                    expected: "[N + 1] with N >= 1".into(),
                    found: cu.shape.clone(),
                });
            }
            check_layout("cu_seqlens", cu, &cu.shape.clone(), ordinal, 8)?;
            cu.shape[0] - 1
        }
    };
    let state_dtype = |name, t: &TensorView| state_view(name, t, [num_seqs, heads, d, d], ordinal);
    let h0 = args
        .initial_state
        .as_ref()
        .map(|t| state_dtype("initial_state", t))
        .transpose()?;
    let ht = args
        .final_state
        .as_ref()
        .map(|t| state_dtype("final_state", t))
        .transpose()?;
    let state = match (h0, ht) {
        (Some(a), Some(b)) if a != b => {
            let n = |d: StateDType| {
                if d == StateDType::BF16 {
                    "bfloat16"
                } else {
                    "float32"
                }
            };
            return Err(FlashKdaError::StateDTypeMismatch {
                initial: n(a),
                final_: n(b),
            });
        }
        (a, b) => a.or(b),
    };
    let blocks = num_seqs as u64 * heads as u64 * 4;
    if blocks > i32::MAX as u64
        || (batch * seq_len) as u64 > (i64::MAX as u64) / (heads as u64 * 256)
    {
        return Err(FlashKdaError::TooLarge(format!(
            "{num_seqs} sequences x {heads} heads"
        )));
    }
    Ok(FwdPlan {
        batch,
        seq_len,
        heads,
        qk_heads,
        num_seqs,
        varlen: args.cu_seqlens.is_some(),
        state,
        ordinal,
        head_dim: d,
    })
}

/// Checks `cu_seqlens` contents read back to the host: starts at 0, non-decreasing, ends at `total`.
pub fn check_cu_seqlens(cu: &[i64], total: usize) -> Result<(), FlashKdaError> {
    if cu.first() != Some(&0) {
        return Err(FlashKdaError::CuSeqlens(format!(
            "must start at 0, starts at {:?}",
            cu.first()
        )));
    }
    if let Some(w) = cu.windows(2).position(|w| w[1] < w[0]) {
        return Err(FlashKdaError::CuSeqlens(format!(
            "decreases at index {}: {} -> {}",
            w,
            cu[w],
            cu[w + 1]
        )));
    }
    if *cu.last().unwrap() != total as i64 {
        return Err(FlashKdaError::CuSeqlens(format!(
            "ends at {}, expected T = {total}",
            cu.last().unwrap()
        )));
    }
    Ok(())
}

/// Arguments of one backward call: the forward's inputs, the upstream gradients `dout`
/// (`[B, T, H, 128]` bf16, like `out`) and `dfinal_state` (like the final state; absent = zeros),
/// and the gradient outputs: `dq`, `dk` (like q), `dv`, `dg` (like v), `dbeta` (like beta), fp32
/// `da_log [H]` and `ddt_bias [H, 128]`, and optionally `dinitial_state` (`[N, H, 128, 128]`,
/// bf16 or fp32; the gradient at the initial state, zeros when absent). Head dim 128 only.
#[derive(Debug, Clone)]
pub struct BwdArgs {
    pub q: TensorView,
    pub k: TensorView,
    pub v: TensorView,
    pub g: TensorView,
    pub beta: TensorView,
    pub a_log: TensorView,
    pub dt_bias: TensorView,
    pub initial_state: Option<TensorView>,
    pub cu_seqlens: Option<TensorView>,
    pub scale: f32,
    pub lower_bound: f32,
    pub dout: TensorView,
    pub dfinal_state: Option<TensorView>,
    pub dq: TensorView,
    pub dk: TensorView,
    pub dv: TensorView,
    pub dg: TensorView,
    pub dbeta: TensorView,
    pub da_log: TensorView,
    pub ddt_bias: TensorView,
    pub dinitial_state: Option<TensorView>,
}

/// What [`validate_bwd`] found: the forward's sizes, the dtype of the forward-side states
/// (`initial_state` / `dfinal_state`), and that of `dinitial_state`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BwdPlan {
    pub fwd: FwdPlan,
    pub dinitial_state: Option<StateDType>,
}

/// Checks every tensor of a backward call (the forward's rules for the inputs, and each gradient
/// shaped like its input). Does not read device memory. A head dim other than 128 is refused with
/// [`FlashKdaError::HeadDimBackward`].
pub fn validate_bwd(a: &BwdArgs) -> Result<BwdPlan, FlashKdaError> {
    let fwd_args = FwdArgs {
        q: a.q.clone(),
        k: a.k.clone(),
        v: a.v.clone(),
        g: a.g.clone(),
        beta: a.beta.clone(),
        out: a.v.clone(),
        a_log: a.a_log.clone(),
        dt_bias: a.dt_bias.clone(),
        initial_state: a.initial_state.clone(),
        final_state: None,
        cu_seqlens: a.cu_seqlens.clone(),
        scale: a.scale,
        lower_bound: a.lower_bound,
    };
    let mut plan = validate(&fwd_args)?;
    if plan.head_dim != HEAD_DIM {
        return Err(FlashKdaError::HeadDimBackward(plan.head_dim));
    }
    let o = plan.ordinal;
    for (name, t, like) in [
        ("dout", &a.dout, &a.v),
        ("dq", &a.dq, &a.q),
        ("dk", &a.dk, &a.q),
        ("dv", &a.dv, &a.v),
        ("dg", &a.dg, &a.v),
    ] {
        check_dtype(name, t, DType::BF16)?;
        check_layout(name, t, &like.shape, o, 16)?;
    }
    check_dtype("dbeta", &a.dbeta, DType::BF16)?;
    check_layout("dbeta", &a.dbeta, &a.beta.shape, o, 2)?;
    check_dtype("dA_log", &a.da_log, DType::F32)?;
    check_layout("dA_log", &a.da_log, &a.a_log.shape, o, 4)?;
    check_dtype("ddt_bias", &a.ddt_bias, DType::F32)?;
    check_layout("ddt_bias", &a.ddt_bias, &a.dt_bias.shape, o, 4)?;
    let st = [plan.num_seqs, plan.heads, HEAD_DIM, HEAD_DIM];
    let state_dtype = |name, t: &TensorView| state_view(name, t, st, o);
    if let Some(t) = &a.dfinal_state {
        let d = state_dtype("dfinal_state", t)?;
        match plan.state {
            Some(s) if s != d => {
                return Err(FlashKdaError::StateDTypeMismatch {
                    initial: dtype_name(s),
                    final_: dtype_name(d),
                });
            }
            _ => plan.state = Some(d),
        }
    }
    let dinitial_state = a
        .dinitial_state
        .as_ref()
        .map(|t| state_dtype("dinitial_state", t))
        .transpose()?;
    Ok(BwdPlan {
        fwd: plan,
        dinitial_state,
    })
}

fn dtype_name(d: StateDType) -> &'static str {
    match d {
        StateDType::BF16 => "bfloat16",
        StateDType::F32 => "float32",
    }
}
