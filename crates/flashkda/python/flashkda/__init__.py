"""flashkda: KDA chunked-prefill forward for Hopper (sm_90a) on torch CUDA tensors.

    flashkda.fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound,
                 initial_state=None, final_state=None, cu_seqlens=None, workspace=None)

Same semantics as ``flash_kda.fwd``: raw q/k (L2-normalised inside), raw gate input g with the
fused ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` gate, beta logits (sigmoid inside);
states are ``[N, H, V, K]`` (fla's ``state_v_first=True``), bf16 or fp32. Runs on torch's current
stream; bad arguments raise ValueError/TypeError.

Workspace: eager calls reuse a pooled workspace per device and stream (allocated by the first call
that needs it, never in a steady-state call; outside torch's allocator, so torch neither counts nor
reclaims it: ``flashkda.release_workspaces()`` frees it), or pass
your own ``workspace`` (``flashkda.workspace(q, cu_seqlens, v=v)``). CUDA graphs: the call is
capturable (``torch.cuda.graph``), also as the first call of a process; a capture takes its workspace
from the graph's private pool. Long fixed-length sequences are split into segments processed in
parallel (intra-card context parallelism) automatically.

Training: ``o, ht = flashkda.chunk_kda(q, k, v, g, beta, A_log, dt_bias, ...)`` returns outputs with
gradients (sm_90a backward kernels; see ``flashkda.autograd``).

Head dim: K = V = 128, or 64 on the workspace schedule, forward only (``flashkda.head_dim_enabled(d)``
tells; any other head dim raises ValueError).

To make flash-linear-attention's ``chunk_kda`` use it: ``flashkda.register_fla_backend()``
(opt out with ``FLASHKDA_FLA=0``).
"""

from flashkda import _flashkda
from flashkda._flashkda import __version__, head_dim_enabled, kernels_built
from flashkda.autograd import chunk_kda
from flashkda.fla_backend import register_fla_backend

__all__ = ["__version__", "chunk_kda", "fwd", "head_dim_enabled", "kernels_built", "register_fla_backend", "release_workspaces", "workspace",
           "workspace_bytes"]


def release_workspaces(device=None):
    """Frees the pooled workspaces of ``device`` (default: the current CUDA device) after waiting for
    it; those a CUDA graph captured stay. Returns the bytes freed."""
    import torch

    d = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    return _flashkda.release_workspaces(d.index if d.index is not None else torch.cuda.current_device())


def workspace_bytes(q, cu_seqlens=None, segment_chunks=None, v=None, operands=None, overlap=None, chunk=None):
    """Bytes of workspace a ``fwd`` call on these inputs needs (0 when it needs none); pass ``v``
    when it has more heads than ``q`` (GVA), and the call's ``operands`` and ``chunk``. A head dim other than 128
    or 64 raises like ``fwd``."""
    b, t, hq = int(q.shape[0]), int(q.shape[1]), int(q.shape[2])
    h = hq if v is None else int(v.shape[2])
    n = b if cu_seqlens is None else int(cu_seqlens.shape[0]) - 1
    dev = q.device.index if q.device.index is not None else 0
    return _flashkda.workspace_bytes(b, t, h, n, cu_seqlens is not None, dev, segment_chunks, hq, operands,
                                     overlap, int(q.shape[-1]), chunk)


def workspace(q, cu_seqlens=None, segment_chunks=None, v=None, operands=None, overlap=None, chunk=None):
    """A workspace tensor for ``fwd(..., workspace=)`` (uint8, on q's device)."""
    import torch

    nbytes = max(1, workspace_bytes(q, cu_seqlens, segment_chunks, v, operands, overlap, chunk))
    return torch.empty(nbytes, dtype=torch.uint8, device=q.device)


def fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None, final_state=None,
        cu_seqlens=None, check_cu_seqlens=True, value_split=None, segment_chunks=None, workspace=None,
        operands=None, overlap=None, chunk=None):
    """KDA forward: writes ``out`` (and ``final_state`` when given) on torch's current stream.
    Validated and planned once, in the compiled module, which also supplies the workspace when none
    is passed (the stream's pooled one; the graph's private pool while capturing). ``operands``: None (the measured default), ``"bf16"`` or
    ``"split"`` (hi + lo bf16 tensor-core operands: more accurate); ``overlap``: None (the measured
    default) or whether the prep and the state pass run at once where that is safe; ``chunk``: None or 16
    (the default kernels) or 64 (the opt-in 64-token-chunk wgmma forward, head dim 128: correct, but
    slower than the default)."""
    return _flashkda.fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state,
                         cu_seqlens, check_cu_seqlens, value_split, segment_chunks, workspace, operands, overlap,
                         chunk)
