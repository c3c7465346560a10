//! The `flashkda._flashkda` Python module: `fwd` on torch CUDA tensors by duck typing
//! (`data_ptr()`, `shape`, `stride()`, `dtype`, `device`), launched on torch's current stream.
//! No libtorch link; every bad argument raises ValueError/TypeError, driver trouble RuntimeError.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::error::FlashKdaError;
use crate::launch::{
    FwdOptions, KdaKernels, Operands, ValueSplit, Workspace, fwd_planned, open_device,
};
use crate::validate::{BwdArgs, DType, Device, FwdArgs, TensorView};

fn to_py(e: FlashKdaError) -> PyErr {
    match e {
        FlashKdaError::DType { .. } => PyTypeError::new_err(e.to_string()),
        e if e.is_invalid_argument() => PyValueError::new_err(e.to_string()),
        e => PyRuntimeError::new_err(e.to_string()),
    }
}

type Loaded = Mutex<HashMap<usize, Arc<KdaKernels>>>;

fn loaded() -> &'static Loaded {
    static LOADED: OnceLock<Loaded> = OnceLock::new();
    LOADED.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The kernels of cuda:`ordinal` if this process loaded them.
fn loaded_kernels(ordinal: usize) -> Option<Arc<KdaKernels>> {
    let map = loaded().lock().unwrap_or_else(|p| p.into_inner());
    map.get(&ordinal).cloned()
}

fn kernels_for(ordinal: usize) -> Result<Arc<KdaKernels>, FlashKdaError> {
    let mut map = loaded().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(k) = map.get(&ordinal) {
        return Ok(k.clone());
    }
    let k = Arc::new(KdaKernels::load(&open_device(ordinal)?)?);
    map.insert(ordinal, k.clone());
    Ok(k)
}

fn dtype_of(name: &str) -> DType {
    match name {
        "torch.bfloat16" => DType::BF16,
        "torch.float32" => DType::F32,
        "torch.int64" => DType::I64,
        "torch.float16" => DType::Other("float16"),
        "torch.float64" => DType::Other("float64"),
        "torch.int32" => DType::Other("int32"),
        "torch.uint8" => DType::Other("uint8"),
        _ => DType::Other("an unsupported dtype"),
    }
}

fn view(name: &str, t: &Bound<'_, PyAny>) -> PyResult<TensorView> {
    let attr = |what: &str, e: PyErr| {
        PyTypeError::new_err(format!("{name}: expected a torch tensor ({what}: {e})"))
    };
    let ptr: u64 = t
        .call_method0("data_ptr")
        .and_then(|p| p.extract())
        .map_err(|e| attr("data_ptr()", e))?;
    let shape: Vec<usize> = t
        .getattr("shape")
        .and_then(|s| s.extract())
        .map_err(|e| attr("shape", e))?;
    let strides: Vec<isize> = t
        .call_method0("stride")
        .and_then(|s| s.extract())
        .map_err(|e| attr("stride()", e))?;
    let dtype: String = t
        .getattr("dtype")
        .and_then(|d| d.str())
        .map(|s| s.to_string())
        .map_err(|e| attr("dtype", e))?;
    let dev = t.getattr("device").map_err(|e| attr("device", e))?;
    let kind: String = dev
        .getattr("type")
        .and_then(|k| k.extract())
        .map_err(|e| attr("device.type", e))?;
    let device = if kind == "cuda" {
        let idx: Option<usize> = dev
            .getattr("index")
            .and_then(|i| i.extract())
            .map_err(|e| attr("device.index", e))?;
        Device::Cuda(idx.unwrap_or(0))
    } else {
        Device::Other(kind)
    };
    Ok(TensorView {
        ptr,
        dtype: dtype_of(&dtype),
        shape,
        strides,
        device,
    })
}

/// `need` bytes from torch's caching allocator on `like`'s device (stream-ordered on torch's current
/// stream; the graph's private pool while capturing): the tensor, to keep alive until the call is
/// enqueued, and its [`Workspace`].
fn torch_workspace<'py>(
    py: Python<'py>,
    torch: &Bound<'py, PyModule>,
    like: &Bound<'py, PyAny>,
    need: usize,
) -> PyResult<(Bound<'py, PyAny>, Workspace)> {
    let kw = PyDict::new(py);
    kw.set_item("dtype", torch.getattr("uint8")?)?;
    kw.set_item("device", like.getattr("device")?)?;
    let t = torch.call_method("empty", (need,), Some(&kw))?;
    let ws = Workspace {
        ptr: t.call_method0("data_ptr")?.extract()?,
        bytes: need,
    };
    Ok((t, ws))
}

/// torch's current stream of cuda:`ordinal`, borrowed.
fn torch_stream(
    torch: &Bound<'_, PyModule>,
    kernels: &KdaKernels,
    ordinal: usize,
) -> PyResult<Arc<cudarc::driver::CudaStream>> {
    let stream_ptr: usize = torch
        .getattr("cuda")?
        .call_method1("current_stream", (ordinal,))?
        .getattr("cuda_stream")?
        .extract()?;
    // SAFETY: torch owns the stream and keeps it alive for this call; it belongs to the device's
    // primary context, which `kernels` was loaded into.
    Ok(unsafe {
        kernels
            .context()
            .wrap_borrowed_stream(stream_ptr as cudarc::driver::sys::CUstream)
    })
}

fn opt_view(name: &str, t: Option<&Bound<'_, PyAny>>) -> PyResult<Option<TensorView>> {
    match t {
        Some(t) if !t.is_none() => view(name, t).map(Some),
        _ => Ok(None),
    }
}

/// KDA chunked-prefill forward; writes `out` (and `final_state` when given) on torch's current
/// stream of the tensors' device. Shapes: q, k, v, g, out `[B, T, H, D]` bf16 (D = 128 or 64); beta `[B, T, H]` bf16 logits; A_log `[H]`, dt_bias `[H, D]`
/// fp32; states `[N, H, D, D]` (row = value channel) bf16 or fp32; cu_seqlens int64 `[N + 1]` with B = 1. `check_cu_seqlens=False` skips the
/// host copy of cu_seqlens (it is skipped anyway while the stream is being captured);
/// `value_split` is None, 1, 2, 4 or 8 (blocks per chain); `operands` None (automatic), "bf16" or "split" (hi + lo bf16
/// tensor-core operands, more accurate); `overlap` None (automatic) or whether the prep and the state
/// pass run at once where that is safe; `segment_chunks` None (automatic), 0 (off) or the segment
/// length in 16-token chunks; `workspace` a contiguous uint8 CUDA tensor of at least
/// `workspace_bytes(...)` bytes (None: the stream's pooled one, or while capturing one from torch's
/// allocator, i.e. the graph's private pool); `chunk` None or 16 (default) or 64 (the opt-in
/// chunk-64 wgmma forward: correct, slower than the default, see `KernelSchedule::Chunk64`). The arguments are validated and the call planned
/// once, here.
#[pyfunction]
#[pyo3(signature = (q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None, final_state=None, cu_seqlens=None, check_cu_seqlens=true, value_split=None, segment_chunks=None, workspace=None, operands=None, overlap=None, chunk=None))]
#[allow(non_snake_case, clippy::too_many_arguments)]
fn fwd(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    g: &Bound<'_, PyAny>,
    beta: &Bound<'_, PyAny>,
    scale: f32,
    out: &Bound<'_, PyAny>,
    A_log: &Bound<'_, PyAny>,
    dt_bias: &Bound<'_, PyAny>,
    lower_bound: f32,
    initial_state: Option<&Bound<'_, PyAny>>,
    final_state: Option<&Bound<'_, PyAny>>,
    cu_seqlens: Option<&Bound<'_, PyAny>>,
    check_cu_seqlens: bool,
    value_split: Option<u32>,
    segment_chunks: Option<usize>,
    workspace: Option<&Bound<'_, PyAny>>,
    operands: Option<&str>,
    overlap: Option<bool>,
    chunk: Option<usize>,
) -> PyResult<()> {
    let args = FwdArgs {
        q: view("q", q)?,
        k: view("k", k)?,
        v: view("v", v)?,
        g: view("g", g)?,
        beta: view("beta", beta)?,
        out: view("out", out)?,
        a_log: view("A_log", A_log)?,
        dt_bias: view("dt_bias", dt_bias)?,
        initial_state: opt_view("initial_state", initial_state)?,
        final_state: opt_view("final_state", final_state)?,
        cu_seqlens: opt_view("cu_seqlens", cu_seqlens)?,
        scale,
        lower_bound,
    };
    let plan = crate::validate::validate(&args).map_err(to_py)?;
    let workspace = match opt_view("workspace", workspace)? {
        None => None,
        Some(w) => {
            if w.dtype != DType::Other("uint8") {
                return Err(PyTypeError::new_err(format!(
                    "workspace: expected dtype uint8, got {}",
                    w.dtype.name()
                )));
            }
            if w.device != Device::Cuda(plan.ordinal) || w.shape.len() != 1 || w.strides != [1] {
                return Err(PyValueError::new_err(format!(
                    "workspace: expected a contiguous 1-D uint8 tensor on cuda:{}, got shape {:?} strides {:?} on {:?}",
                    plan.ordinal, w.shape, w.strides, w.device
                )));
            }
            Some(Workspace {
                ptr: w.ptr,
                bytes: w.shape[0],
            })
        }
    };
    let split = match value_split {
        None => ValueSplit::Auto,
        Some(2) => ValueSplit::Two,
        Some(4) => ValueSplit::Four,
        Some(8) => ValueSplit::Eight,
        Some(1) => ValueSplit::One,
        Some(x) => {
            return Err(PyValueError::new_err(format!(
                "value_split must be None, 1, 2, 4 or 8, got {x}"
            )));
        }
    };
    let operands = operands_of(operands)?;
    let kernels = kernels_for(plan.ordinal).map_err(to_py)?;
    let mut opts = FwdOptions {
        value_split: split,
        schedule: schedule_of(chunk)?,
        operands,
        overlap,
        check_cu_seqlens,
        segment_chunks,
        workspace,
    };
    let call = kernels.call_plan(&plan, &opts).map_err(to_py)?;
    let torch = py.import("torch")?;
    let stream = torch_stream(&torch, &kernels, plan.ordinal)?;
    // Eager calls use the stream's pooled workspace (no allocation once it is large enough). A
    // capture takes its own from torch's allocator, i.e. from the graph's private pool, freed with
    // the graph; kept alive until the call is enqueued.
    let mut _owned = None;
    let need = call.workspace.total_bytes;
    if opts.workspace.is_none()
        && need > 0
        && crate::launch::is_capturing(&stream).map_err(to_py)?
    {
        let (t, ws) = torch_workspace(py, &torch, q, need)?;
        opts.workspace = Some(ws);
        _owned = Some(t);
    }
    py.detach(|| fwd_planned(&kernels, &stream, &args, &plan, &call, &opts))
        .map_err(to_py)
}

/// KDA backward on torch's current stream: from the forward's inputs and the upstream gradients
/// `dout` (like `out`) and `dfinal_state` (like the final state, or None), writes `dq`, `dk` (like
/// q), `dv`, `dg` (like v), `dbeta` (like beta), fp32 `dA_log [H]`, `ddt_bias [H, 128]` and, when
/// given, `dinitial_state` (`[N, H, 128, 128]`, bf16 or fp32). The workspace comes from torch's
/// caching allocator.
#[pyfunction]
#[pyo3(signature = (q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, dout, dq, dk, dv, dg, dbeta, dA_log, ddt_bias, initial_state=None, dfinal_state=None, dinitial_state=None, cu_seqlens=None, check_cu_seqlens=true, passes=None))]
#[allow(non_snake_case, clippy::too_many_arguments)]
fn bwd(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    g: &Bound<'_, PyAny>,
    beta: &Bound<'_, PyAny>,
    scale: f32,
    A_log: &Bound<'_, PyAny>,
    dt_bias: &Bound<'_, PyAny>,
    lower_bound: f32,
    dout: &Bound<'_, PyAny>,
    dq: &Bound<'_, PyAny>,
    dk: &Bound<'_, PyAny>,
    dv: &Bound<'_, PyAny>,
    dg: &Bound<'_, PyAny>,
    dbeta: &Bound<'_, PyAny>,
    dA_log: &Bound<'_, PyAny>,
    ddt_bias: &Bound<'_, PyAny>,
    initial_state: Option<&Bound<'_, PyAny>>,
    dfinal_state: Option<&Bound<'_, PyAny>>,
    dinitial_state: Option<&Bound<'_, PyAny>>,
    cu_seqlens: Option<&Bound<'_, PyAny>>,
    check_cu_seqlens: bool,
    passes: Option<&str>,
) -> PyResult<()> {
    let passes = match passes {
        None => crate::launch::PassSchedule::Auto,
        Some(s) => crate::launch::PassSchedule::parse(s).ok_or_else(|| {
            PyValueError::new_err(format!(
                "passes={s:?}: expected auto, seq2, seq4, conc2, conc4, conc4o, conc4d2, conc4d3, conc4p4, conc4t2 or conc4t3"
            ))
        })?,
    };
    let args = BwdArgs {
        q: view("q", q)?,
        k: view("k", k)?,
        v: view("v", v)?,
        g: view("g", g)?,
        beta: view("beta", beta)?,
        a_log: view("A_log", A_log)?,
        dt_bias: view("dt_bias", dt_bias)?,
        initial_state: opt_view("initial_state", initial_state)?,
        cu_seqlens: opt_view("cu_seqlens", cu_seqlens)?,
        scale,
        lower_bound,
        dout: view("dout", dout)?,
        dfinal_state: opt_view("dfinal_state", dfinal_state)?,
        dq: view("dq", dq)?,
        dk: view("dk", dk)?,
        dv: view("dv", dv)?,
        dg: view("dg", dg)?,
        dbeta: view("dbeta", dbeta)?,
        da_log: view("dA_log", dA_log)?,
        ddt_bias: view("ddt_bias", ddt_bias)?,
        dinitial_state: opt_view("dinitial_state", dinitial_state)?,
    };
    let plan = crate::validate::validate_bwd(&args).map_err(to_py)?;
    let ordinal = plan.fwd.ordinal;
    let kernels = kernels_for(ordinal).map_err(to_py)?;
    let torch = py.import("torch")?;
    let need = crate::launch::bwd_workspace_bytes(&plan).max(16);
    // stream-ordered on torch's current stream; alive until the call is enqueued
    let (ws_t, ws) = torch_workspace(py, &torch, q, need)?;
    let opts = crate::launch::BwdOptions {
        check_cu_seqlens,
        workspace: Some(ws),
        passes,
    };
    let stream = torch_stream(&torch, &kernels, ordinal)?;
    let r = py.detach(|| crate::launch::bwd_validated(&kernels, &stream, &args, &plan, &opts));
    drop(ws_t);
    r.map_err(to_py)
}

/// Workspace bytes of a default `fwd` call with these sizes on cuda:`device` (0 when the call
/// needs none): `batch, seq_len` of q, `heads` of v (value heads), `qk_heads` of q (GVA when
/// fewer; default `heads`), `num_seqs` = len(cu_seqlens) - 1 or batch, `head_dim` q's last
/// dimension (default 128; 64 is refused like `fwd` unless opted in).
#[pyfunction]
#[pyo3(signature = (batch, seq_len, heads, num_seqs, varlen, device, segment_chunks=None, qk_heads=None, operands=None, overlap=None, head_dim=None, chunk=None))]
#[allow(clippy::too_many_arguments)]
fn workspace_bytes(
    batch: usize,
    seq_len: usize,
    heads: usize,
    num_seqs: usize,
    varlen: bool,
    device: usize,
    segment_chunks: Option<usize>,
    qk_heads: Option<usize>,
    operands: Option<&str>,
    overlap: Option<bool>,
    head_dim: Option<usize>,
    chunk: Option<usize>,
) -> PyResult<usize> {
    let operands = operands_of(operands)?;
    let head_dim = head_dim.unwrap_or(crate::reference::HEAD_DIM);
    if !crate::reference::HEAD_DIMS.contains(&head_dim) {
        return Err(PyValueError::new_err(format!(
            "head_dim must be 64 or 128, got {head_dim}"
        )));
    }
    let kernels = kernels_for(device).map_err(to_py)?;
    let plan = crate::validate::FwdPlan {
        batch,
        seq_len,
        heads,
        qk_heads: qk_heads.unwrap_or(heads),
        num_seqs,
        varlen,
        state: None,
        ordinal: device,
        head_dim,
    };
    let opts = FwdOptions {
        schedule: schedule_of(chunk)?,
        segment_chunks,
        operands,
        overlap,
        ..Default::default()
    };
    Ok(kernels
        .call_plan(&plan, &opts)
        .map_err(to_py)?
        .workspace
        .total_bytes)
}

/// `chunk=` of the Python calls: None or 16 (the default schedules), 64 (the opt-in chunk-64
/// forward, `KernelSchedule::Chunk64`: correct, slower than the default).
fn schedule_of(chunk: Option<usize>) -> PyResult<crate::KernelSchedule> {
    match chunk {
        None | Some(16) => Ok(crate::KernelSchedule::Auto),
        Some(64) => Ok(crate::KernelSchedule::Chunk64),
        Some(x) => Err(PyValueError::new_err(format!(
            "chunk must be None, 16 or 64, got {x}"
        ))),
    }
}

/// `operands=` of the Python calls: None, "bf16" or "split".
fn operands_of(name: Option<&str>) -> PyResult<Operands> {
    match name {
        None => Ok(Operands::Auto),
        Some("bf16") => Ok(Operands::Bf16),
        Some("split") => Ok(Operands::Split),
        Some(x) => Err(PyValueError::new_err(format!(
            "operands must be None, \"bf16\" or \"split\", got {x:?}"
        ))),
    }
}

/// Frees the pooled forward workspaces of cuda:`device` after waiting for it (those a CUDA graph
/// captured stay); returns the bytes freed. Only devices this process already called are touched.
#[pyfunction]
fn release_workspaces(py: Python<'_>, device: usize) -> PyResult<usize> {
    match loaded_kernels(device) {
        None => Ok(0),
        Some(k) => py.detach(|| k.release_workspaces()).map_err(to_py),
    }
}

/// Whether this build embeds the sm_90a kernels.
#[pyfunction]
fn kernels_built() -> bool {
    crate::launch::kernels_built()
}

/// Whether a forward call of head dim `head_dim` may run (128 and 64, the head dims a GPU run has
/// verified).
#[pyfunction]
fn head_dim_enabled(head_dim: usize) -> bool {
    crate::head_dim::head_dim_enabled(head_dim)
}

#[pymodule]
fn _flashkda(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(fwd, m)?)?;
    m.add_function(wrap_pyfunction!(bwd, m)?)?;
    m.add_function(wrap_pyfunction!(kernels_built, m)?)?;
    m.add_function(wrap_pyfunction!(head_dim_enabled, m)?)?;
    m.add_function(wrap_pyfunction!(workspace_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(release_workspaces, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
