"""flashkda: KDA chunked-prefill forward for Hopper (sm_90a) on torch CUDA tensors.

    flashkda.fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound,
                 initial_state=None, final_state=None, cu_seqlens=None, workspace=None)

Same semantics as ``flash_kda.fwd``: raw q/k (L2-normalised inside), raw gate input g with the
fused ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` gate, beta logits (sigmoid inside);
states are ``[N, H, V, K]`` (fla's ``state_v_first=True``), bf16 or fp32. Runs on torch's current
stream; bad arguments raise ValueError/TypeError.

CUDA graphs: the call is capturable (``torch.cuda.graph``). Its workspace comes from torch's
caching allocator (stream-ordered, and from the graph's private pool while capturing), or pass
your own ``workspace`` (``flashkda.workspace(q, cu_seqlens, v=v)``). Long fixed-length sequences are
split into segments processed in parallel (intra-card context parallelism) automatically.

Training: ``o, ht = flashkda.chunk_kda(q, k, v, g, beta, A_log, dt_bias, ...)`` returns outputs with
gradients (sm_90a backward kernels; see ``flashkda.autograd``).

To make flash-linear-attention's ``chunk_kda`` use it: ``flashkda.register_fla_backend()``
(opt out with ``FLASHKDA_FLA=0``).
"""

from flashkda import _flashkda
from flashkda._flashkda import __version__, kernels_built
from flashkda.autograd import chunk_kda
from flashkda.fla_backend import register_fla_backend

__all__ = ["__version__", "chunk_kda", "fwd", "kernels_built", "register_fla_backend", "workspace", "workspace_bytes"]


def workspace_bytes(q, cu_seqlens=None, segment_chunks=None, v=None, operands=None, overlap=None):
    """Bytes of workspace a ``fwd`` call on these inputs needs (0 when it needs none); pass ``v``
    when it has more heads than ``q`` (GVA), and the call's ``operands``."""
    b, t, hq = int(q.shape[0]), int(q.shape[1]), int(q.shape[2])
    h = hq if v is None else int(v.shape[2])
    n = b if cu_seqlens is None else int(cu_seqlens.shape[0]) - 1
    dev = q.device.index if q.device.index is not None else 0
    return _flashkda.workspace_bytes(b, t, h, n, cu_seqlens is not None, dev, segment_chunks, hq, operands,
                                     overlap)


def workspace(q, cu_seqlens=None, segment_chunks=None, v=None, operands=None, overlap=None):
    """A workspace tensor for ``fwd(..., workspace=)`` (uint8, on q's device)."""
    import torch

    nbytes = max(1, workspace_bytes(q, cu_seqlens, segment_chunks, v, operands, overlap))
    return torch.empty(nbytes, dtype=torch.uint8, device=q.device)


def fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None, final_state=None,
        cu_seqlens=None, check_cu_seqlens=True, value_split=None, segment_chunks=None, workspace=None,
        operands=None, overlap=None):
    """KDA forward: writes ``out`` (and ``final_state`` when given) on torch's current stream.
    Validated and planned once, in the compiled module, which also takes the workspace from torch's
    caching allocator when none is passed. ``operands``: None (the measured default), ``"bf16"`` or
    ``"split"`` (hi + lo bf16 tensor-core operands: more accurate); ``overlap``: None (the measured
    default) or whether the prep and the state pass run at once where that is safe."""
    return _flashkda.fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state,
                         cu_seqlens, check_cu_seqlens, value_split, segment_chunks, workspace, operands, overlap)
