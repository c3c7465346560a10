"""flash-linear-attention (fla >= 0.6) backend that routes ``chunk_kda`` to flashkda.

Usage::

    import flashkda
    flashkda.register_fla_backend()        # once, after installing fla
    o, ht = fla.ops.kda.chunk_kda(..., use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                                  use_beta_sigmoid_in_kernel=True, safe_gate=True,
                                  lower_bound=-5, A_log=A_log, dt_bias=dt_bias, state_v_first=True)

It takes precedence over fla's FlashKDA backend (priority 2 < 3) for the calls it accepts
(inference and training: a call with gradients goes through ``flashkda.chunk_kda``'s autograd
function and the chunked sm_90a backward, 8.6 vs 12.7 ms forward+backward at H=96, T=8192 on an
H200; ``FLASHKDA_FLA_TRAIN=0`` keeps training calls on fla's kernels; bf16, K = V = 128, GVA
included, fused gate/norm/sigmoid, ``state_v_first=True``, ``lower_bound`` in [-5, 0)); K = V = 64
only for calls without gradients (the backward is 128-only, so head-dim-64 training stays on fla's
Triton);
anything else falls through to the next backend or to Triton. Opt out with the environment variable
``FLASHKDA_FLA=0`` (read at every call).
"""

from __future__ import annotations

import os

ENV_VAR = "FLASHKDA_FLA"
TRAIN_ENV_VAR = "FLASHKDA_FLA_TRAIN"
_registered = False


def _verify(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
            allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
            return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
            cp_context=None, use_graph=False, max_num_seqs=None, *, A_log=None, dt_bias=None, **kwargs):
    import torch

    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, A_log, dt_bias, initial_state))
    if wants_grad and os.environ.get(TRAIN_ENV_VAR) == "0":
        return False, f"{TRAIN_ENV_VAR}=0 keeps training calls on fla's kernels"
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False, "flashkda needs an sm_90 (Hopper) CUDA device"
    D = q.shape[-1]
    if q.dtype != torch.bfloat16 or D not in (64, 128) or k.shape[-1] != D or v.shape[-1] != D:
        return False, "flashkda needs bf16 and K = V = 128 (or 64)"
    if D == 64:
        if wants_grad:
            return False, "flashkda's backward supports K = V = 128 only: head-dim-64 training stays on fla"
    if v.shape[2] % q.shape[2] != 0:
        return False, "GVA needs the value heads to be a multiple of the query/key heads"
    if not (use_gate_in_kernel and use_qk_l2norm_in_kernel and use_beta_sigmoid_in_kernel and safe_gate):
        return False, "flashkda needs the fused gate, q/k L2 norm, beta sigmoid and safe_gate"
    if allow_neg_eigval or return_intermediate_states or cp_context is not None:
        return False, "flashkda does not support allow_neg_eigval, intermediate states or context parallel"
    if A_log is None or dt_bias is None or lower_bound is None or not (-5.0 <= float(lower_bound) < 0.0):
        return False, "flashkda needs A_log, dt_bias and lower_bound in [-5, 0)"
    if not state_v_first:
        return False, "flashkda needs state_v_first=True"
    return True, None


def _chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
               allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
               return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
               cp_context=None, use_graph=False, max_num_seqs=None, *, A_log=None, dt_bias=None, **kwargs):
    import torch

    from flashkda import chunk_kda, fwd

    if scale is None:
        scale = q.shape[-1] ** -0.5
    H = v.shape[2]
    n = len(cu_seqlens) - 1 if cu_seqlens is not None else q.shape[0]
    if dt_bias.ndim == 1:
        dt_bias = dt_bias.view(H, -1)
    if cu_seqlens is not None and cu_seqlens.dtype != torch.long:
        cu_seqlens = cu_seqlens.to(torch.long)
    if initial_state is not None:
        initial_state = initial_state.to(torch.float32).contiguous()
    if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, g, beta, A_log, dt_bias, initial_state)):
        # fp32 states (as fla's); the final state of a call without one comes out fp32 as well
        return chunk_kda(q, k, v, g, beta, A_log, dt_bias, scale=float(scale), lower_bound=float(lower_bound),
                         initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    out = torch.empty_like(v)
    final_state = None
    if output_final_state:
        D = q.shape[-1]
        final_state = torch.empty(n, H, D, D, dtype=torch.float32, device=q.device)
    fwd(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), float(scale), out,
        A_log.to(torch.float32).contiguous(), dt_bias.to(torch.float32).contiguous(), float(lower_bound),
        initial_state=initial_state, final_state=final_state, cu_seqlens=cu_seqlens,
        check_cu_seqlens=not use_graph)
    return out, final_state


def register_fla_backend() -> bool:
    """Registers flashkda as a backend of ``fla.ops.kda.chunk_kda``; returns False when fla is
    missing or too old (no ``fla.backends.register``)."""
    global _registered
    if _registered:
        return True
    try:
        from fla.backends import BaseBackend, register
        from fla.ops.kda.chunk import chunk_kda
    except ImportError:
        return False

    class FlashKdaBackend(BaseBackend):
        """k3-stack flashkda (Rust + sm_90a CUDA), forward and backward."""

        backend_type = "flashkda"
        package_name = "flashkda"
        env_var = ENV_VAR
        default_enable = True
        priority = 2

        def chunk_kda_verifier(self, *args, **kwargs):
            return _verify(*args, **kwargs)

        def chunk_kda(self, *args, **kwargs):
            return _chunk_kda(*args, **kwargs)

    register(chunk_kda)(FlashKdaBackend)
    _registered = True
    return True
