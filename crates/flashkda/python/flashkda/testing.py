"""Timing helpers for the benchmark scripts: CUDA-event times of a call on torch's current stream."""

from __future__ import annotations


def cuda_event_times(fn, warmup, iters, repeats):
    """``repeats`` blocks of ``iters`` calls of ``fn`` after ``warmup`` calls, each timed with CUDA
    events: (every time in ms, each block's times sorted; each block's median)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    all_ms, blocks = [], []
    for _ in range(repeats):
        st = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        en = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            st[i].record()
            fn()
            en[i].record()
        torch.cuda.synchronize()
        ms = sorted(s.elapsed_time(e) for s, e in zip(st, en))
        blocks.append(ms[len(ms) // 2])
        all_ms.extend(ms)
    return all_ms, blocks


def time_median(fn, warmup, iters, repeats):
    """:func:`cuda_event_times` as ``{"median_ms", "block_medians_ms", "n"}``."""
    all_ms, blocks = cuda_event_times(fn, warmup, iters, repeats)
    all_ms.sort()
    return {"median_ms": all_ms[len(all_ms) // 2], "block_medians_ms": blocks, "n": len(all_ms)}
