"""``flashkda.chunk_kda``: the KDA forward with gradients (``torch.autograd.Function``).

    o, final_state = flashkda.chunk_kda(q, k, v, g, beta, A_log, dt_bias, scale=None,
                                        lower_bound=-5.0, initial_state=None,
                                        output_final_state=False, cu_seqlens=None)

Inputs as ``flashkda.fwd`` (raw q/k, raw gate g, beta logits; fused gate, L2 norm and sigmoid
inside; states ``[N, H, V, K]``). Gradients flow to q, k, v, g, beta, A_log, dt_bias and
initial_state, computed by the chunked sm_90a backward on torch's current stream. Nothing beyond
the inputs is saved for backward: the backward recomputes the 16-token chunk states into a
temporary workspace (from torch's caching allocator).
"""

from __future__ import annotations

import os

# benchmark knob: how the backward's two state passes run (auto, seq2, seq4, conc2, conc4, conc4o)
_PASSES = os.environ.get("FLASHKDA_BWD_PASSES") or None
# benchmark knob: the forward's prep and state pass at once (`overlap=True` where eligible)
_FWD_OVERLAP = True if os.environ.get("FLASHKDA_FWD_OVERLAP") == "1" else None


def _function():
    import torch

    from flashkda import _flashkda

    class ChunkKdaFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, scale, lower_bound,
                    output_final_state, cu_seqlens):
            n = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
            H = v.shape[2]
            out = torch.empty_like(v)
            final_state = None
            if output_final_state:
                sd = initial_state.dtype if initial_state is not None else torch.float32
                D = q.shape[-1]
                final_state = torch.empty(n, H, D, D, dtype=sd, device=q.device)
            _flashkda.fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state,
                          final_state, cu_seqlens, overlap=_FWD_OVERLAP)
            ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens)
            ctx.scale, ctx.lower_bound = scale, lower_bound
            ctx.state_dtype = final_state.dtype if final_state is not None else torch.float32
            if final_state is None:
                return out
            return out, final_state

        @staticmethod
        def backward(ctx, dout, dfinal=None):
            q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens = ctx.saved_tensors
            dout = torch.zeros_like(v) if dout is None else dout.to(torch.bfloat16).contiguous()
            if dfinal is not None:
                dfinal = dfinal.to(ctx.state_dtype).contiguous()
            dq, dk = torch.empty_like(q), torch.empty_like(k)
            dv, dg, dbeta = torch.empty_like(v), torch.empty_like(g), torch.empty_like(beta)
            dA_log, ddt_bias = torch.empty_like(A_log), torch.empty_like(dt_bias)
            dh0 = None
            if initial_state is not None and ctx.needs_input_grad[7]:
                dh0 = torch.empty_like(initial_state)
            _flashkda.bwd(q, k, v, g, beta, ctx.scale, A_log, dt_bias, ctx.lower_bound, dout, dq, dk, dv, dg,
                          dbeta, dA_log, ddt_bias, initial_state, dfinal, dh0, cu_seqlens, passes=_PASSES)
            return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0, None, None, None, None

    return ChunkKdaFunction


_FUNCTION = None


def chunk_kda(q, k, v, g, beta, A_log, dt_bias, scale=None, lower_bound=-5.0, initial_state=None,
              output_final_state=False, cu_seqlens=None):
    """KDA forward returning ``(o, final_state)`` (``final_state`` None unless requested), with
    gradients through the sm_90a backward. bf16 q, k, v, g, beta; ``A_log [H]`` and ``dt_bias``
    (``[H, D]`` or ``[H * D]``) in any float dtype (used in fp32); states bf16 or fp32. Head dim
    ``D`` (K = V) 128, or 64 without gradients (forward only: the backward is 128-only, a call that
    needs gradients raises NotImplementedError)."""
    global _FUNCTION
    import torch

    if _FUNCTION is None:
        _FUNCTION = _function()
    if scale is None:
        scale = q.shape[-1] ** -0.5
    H, D = v.shape[2], q.shape[-1]
    if D != 128 and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, g, beta, A_log, dt_bias, initial_state)):
        raise NotImplementedError(
            f"flashkda.chunk_kda: the backward supports head dim 128 only, not {D}; train at this head dim "
            "with fla's chunk_kda (Triton), or call under torch.no_grad() for the forward")
    a = A_log.to(torch.float32).contiguous()
    d = dt_bias.to(torch.float32).reshape(H, D).contiguous()
    if cu_seqlens is not None and cu_seqlens.dtype != torch.long:
        cu_seqlens = cu_seqlens.to(torch.long)
    h0 = initial_state.contiguous() if initial_state is not None else None
    r = _FUNCTION.apply(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), a, d,
                        h0, float(scale), float(lower_bound), bool(output_final_state), cu_seqlens)
    if output_final_state:
        return r
    return r, None
