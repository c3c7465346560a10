"""moonep: balanced expert-parallel dispatch/combine on torch CUDA tensors.

    buf = moonep.Buffer(experts=E, top_k=K, capacity_s=S, hidden=H)   # collective, once
    hidden, wts, cu_seqlens = moonep.dispatch(buf, x, topk, w)        # autograd
    ...  # experts on the slot layout: y = w_slot * FFN(hidden), rows grouped by cu_seqlens
    out = moonep.combine(buf, y)                                      # autograd

Bootstrap from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_PORT): rank 0 serves
moonep's TCP store on 127.0.0.1:(MASTER_PORT + 1) (override: MOONEP_STORE_PORT); the IPC handles
go through it. Every call runs on torch's current stream and is collective: all ranks issue the
same calls in the same order. `Buffer.views()` are zero-copy tensors over the receive shard;
they die at the next moonep call, so the autograd functions copy what they return.
"""

import os

import torch

from moonep._moonep import Buffer as _RawBuffer
from moonep._moonep import __version__, kernels_built

__all__ = ["Buffer", "dispatch", "combine", "__version__", "kernels_built"]


class _DeviceArray:
    """`__cuda_array_interface__` over moonep memory; keeps the owning Buffer alive."""

    def __init__(self, ptr, shape, typestr, owner):
        self._owner = owner
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": typestr,
            "data": (int(ptr), False),
            "version": 3,
            "strides": None,
        }


def _stream():
    return torch.cuda.current_stream().cuda_stream


class Buffer:
    """One rank's symmetric buffers, sized once per (S, K, H, E)."""

    def __init__(self, experts, top_k, capacity_s, hidden, padding=128, num_blocks=32, dedup=True,
                 grad_elems=0, expert_bytes=0, rank=None, world_size=None, store_port=None):
        env = os.environ
        rank = int(env["RANK"]) if rank is None else rank
        world = int(env["WORLD_SIZE"]) if world_size is None else world_size
        local = int(env.get("LOCAL_RANK", rank))
        if store_port is None:
            store_port = int(env.get("MOONEP_STORE_PORT", int(env.get("MASTER_PORT", 29500)) + 1))
        env.setdefault("MOONEP_DEVICE", str(torch.cuda.current_device()))
        self.experts, self.top_k, self.capacity_s, self.hidden = experts, top_k, capacity_s, hidden
        self.rank, self.world = rank, world
        self.device = torch.device("cuda", int(env["MOONEP_DEVICE"]))
        self._raw = _RawBuffer(rank, world, local, store_port, experts, top_k, capacity_s, hidden,
                               padding=padding, num_blocks=num_blocks, dedup=dedup,
                               grad_elems=grad_elems, expert_bytes=expert_bytes)
        self.grad_elems, self.expert_bytes = grad_elems, expert_bytes
        self.epn = experts // world
        self.s = 0

    def _check_tokens(self, x, topk, w):
        s, k, h = x.shape[0], self.top_k, self.hidden
        if x.dtype != torch.bfloat16 or tuple(x.shape) != (s, h) or not x.is_contiguous():
            raise ValueError(f"x must be a contiguous bf16 [s, {h}] tensor, got {x.dtype} {tuple(x.shape)}")
        if tuple(topk.shape) != (s, k):
            raise ValueError(f"topk must be [s, {k}], got {tuple(topk.shape)}")
        if w is not None and (w.dtype != torch.float32 or tuple(w.shape) != (s, k)):
            raise ValueError(f"w must be f32 [s, {k}], got {w.dtype} {tuple(w.shape)}")
        if not 1 <= s <= self.capacity_s:
            raise ValueError(f"s = {s} outside 1..={self.capacity_s}")
        for t in (x, topk) + ((w,) if w is not None else ()):
            if t.device != self.device:
                raise ValueError(f"tensors must be on {self.device}, got {t.device}")

    def dispatch_raw(self, x, topk, w=None):
        """Plans and dispatches; returns the zero-copy views (hidden, wts, cu_seqlens)."""
        self._check_tokens(x, topk, w)
        topk = topk.to(torch.int32).contiguous()
        # tpe without a host sync (bincount would sync for its size).
        tpe = torch.zeros(self.experts, dtype=torch.int32, device=x.device)
        tpe.index_add_(0, topk.flatten(), torch.ones_like(topk.flatten()))
        w = w.contiguous() if w is not None else None
        self.s = x.shape[0]
        self._keep = (x, topk, tpe, w)
        self._raw.dispatch(x.data_ptr(), 0 if w is None else w.data_ptr(), topk.data_ptr(),
                           tpe.data_ptr(), self.s, _stream())
        return self.views()

    def views(self):
        """Zero-copy (hidden bf16 [nvs_s, H], wts f32 [nvs_s], cu_seqlens i32 [2*epn])."""
        hid, wts, cu, _dst, _red, _nvs, nvs_s, _pool = self._raw.layout()
        epn = self.experts // self.world
        h = torch.as_tensor(_DeviceArray(hid, (nvs_s, self.hidden), "<i2", self), device=self.device)
        return (h.view(torch.bfloat16),
                torch.as_tensor(_DeviceArray(wts, (nvs_s,), "<f4", self), device=self.device),
                torch.as_tensor(_DeviceArray(cu, (2 * epn,), "<i4", self), device=self.device))

    def combine_raw(self, with_weights=False):
        """K-sum of the slot rows now in the shard: out bf16 [s, H] (and the gathered slot weights)."""
        out = torch.empty(self.s, self.hidden, dtype=torch.bfloat16, device=self.device)
        w_out = torch.empty(self.s, self.top_k, dtype=torch.float32, device=self.device) if with_weights else None
        self._raw.combine(out.data_ptr(), 0 if w_out is None else w_out.data_ptr(), _stream())
        return out, w_out

    def combine_backward_raw(self, grad_out):
        grad_out = grad_out.to(torch.bfloat16).contiguous()
        self._keep_g = grad_out
        self._raw.combine_backward(grad_out.data_ptr(), _stream())
        return self.views()

    def dispatch_backward_raw(self):
        dx = torch.empty(self.s, self.hidden, dtype=torch.bfloat16, device=self.device)
        dw = torch.empty(self.s, self.top_k, dtype=torch.float32, device=self.device)
        self._raw.dispatch_backward(dx.data_ptr(), dw.data_ptr(), _stream())
        return dx, dw

    def prefetch(self, home_weights):
        """Pushes this rank's home experts (`[epn, expert_bytes]` as any contiguous dtype) into
        the prefetch slot of every rank that holds a replica of them (latest plan)."""
        if not home_weights.is_contiguous() or home_weights.numel() * home_weights.element_size() != self.epn * self.expert_bytes:
            raise ValueError(f"home_weights must be contiguous with {self.epn} x {self.expert_bytes} bytes")
        self._raw.prefetch(home_weights.data_ptr(), _stream())

    def replica_weights(self, dtype=torch.float32):
        """Zero-copy view of the prefetch slots: `[epn, expert_bytes / itemsize]` of `dtype`;
        slot b holds expert `experts_to_copy[rank][b]` after `prefetch`."""
        typestr = {torch.float32: "<f4", torch.bfloat16: "<i2"}[dtype]
        item = 4 if dtype == torch.float32 else 2
        pool = self._raw.layout()[7]
        if pool == 0:
            raise ValueError("Buffer was built with expert_bytes=0")
        t = torch.as_tensor(_DeviceArray(pool, (self.epn, self.expert_bytes // item), typestr, self), device=self.device)
        return t.view(dtype)

    def reduce_slots(self):
        """Zero-copy view of the reduce slots `[epn, grad_elems]` f32: replica weight grads."""
        red = self._raw.layout()[4]
        if red == 0:
            raise ValueError("Buffer was built with grad_elems=0")
        return torch.as_tensor(_DeviceArray(red, (self.epn, self.grad_elems), "<f4", self), device=self.device)

    def reduce_grad(self, home_grads):
        """Adds every replica's reduce slot of this rank's experts into `home_grads`
        (`[epn, grad_elems]` f32, in place) and zeroes the consumed slots."""
        if home_grads.dtype != torch.float32 or not home_grads.is_contiguous() or \
                tuple(home_grads.shape) != (self.epn, self.grad_elems):
            raise ValueError(f"home_grads must be contiguous f32 [{self.epn}, {self.grad_elems}]")
        self._raw.reduce_grad(home_grads.data_ptr(), _stream())

    def check(self):
        """Waits for the stream; raises on a device status error (barrier timeout, bad input)."""
        self._raw.check(_stream())


def _used_rows_mask(cu, n):
    return (torch.arange(n, device=cu.device) < cu[-1].to(torch.int64)).unsqueeze(-1)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, buf, topk):
        hidden, wts, cu = buf.dispatch_raw(x.detach(), topk, w.detach())
        ctx.buf = buf
        ctx.mark_non_differentiable(cu)
        return hidden.clone(), wts.clone(), cu.clone()

    @staticmethod
    def backward(ctx, grad_hidden, grad_wts, _grad_cu):
        buf = ctx.buf
        hidden, wts, cu = buf.views()
        hidden.copy_(grad_hidden if grad_hidden is not None else torch.zeros_like(hidden))
        wts.copy_(grad_wts if grad_wts is not None else torch.zeros_like(wts))
        dx, dw = buf.dispatch_backward_raw()
        return dx, dw, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, buf):
        hidden, _wts, cu = buf.views()
        if y.data_ptr() != hidden.data_ptr():
            hidden.copy_(y)
        ctx.buf = buf
        out, _ = buf.combine_raw()
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, _wts, cu = ctx.buf.combine_backward_raw(grad_out)
        # Rows past the last group do not reach the output: their gradient is zero.
        return torch.where(_used_rows_mask(cu, hidden.shape[0]), hidden, 0).to(torch.bfloat16), None


def dispatch(buf, x, topk, w):
    """Autograd dispatch: (hidden [nvs_s, H] bf16, wts [nvs_s] f32, cu_seqlens [2*epn] i32)."""
    return _Dispatch.apply(x, w, buf, topk)


def combine(buf, y):
    """Autograd combine of the slot outputs y [nvs_s, H] bf16: out [s, H] bf16."""
    return _Combine.apply(y, buf)
