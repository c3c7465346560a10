"""flashkda: KDA chunked-prefill forward for Hopper (sm_90a) on torch CUDA tensors.

    flashkda.fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound,
                 initial_state=None, final_state=None, cu_seqlens=None)

Same semantics as ``flash_kda.fwd``: raw q/k (L2-normalised inside), raw gate input g with the
fused ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` gate, beta logits (sigmoid inside);
states are ``[N, H, V, K]`` (fla's ``state_v_first=True``), bf16 or fp32. Runs on torch's current
stream; bad arguments raise ValueError/TypeError.

To make flash-linear-attention's ``chunk_kda`` use it: ``flashkda.register_fla_backend()``
(opt out with ``FLASHKDA_FLA=0``).
"""

from flashkda._flashkda import __version__, fwd, kernels_built
from flashkda.fla_backend import register_fla_backend

__all__ = ["__version__", "fwd", "kernels_built", "register_fla_backend"]
