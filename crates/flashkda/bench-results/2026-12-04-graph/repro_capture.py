#!/usr/bin/env python3
"""Issue 11's report: torch.cuda.graph capture of flashkda.fwd (H=64 varlen6, fp32 state in and out,
default options). `cold`: the process's first flashkda call is the captured one; `warm`: one eager
call on the default stream first. Prints whether capture and replay worked and the exception chain."""
import sys

import torch

import flashkda

mode = sys.argv[1]
D, LB, H, lens = 128, -5.0, 64, [1300, 547, 2048, 963, 271, 3063]
g = torch.Generator(device="cuda").manual_seed(1)
T, N = sum(lens), len(lens)


def rn(*s):
    return torch.randn(*s, generator=g, device="cuda").to(torch.bfloat16)


q, k, v, gg, beta = rn(1, T, H, D), rn(1, T, H, D), rn(1, T, H, D), rn(1, T, H, D), rn(1, T, H)
A_log, dt_bias = torch.rand(H, generator=g, device="cuda"), torch.rand(H, D, generator=g, device="cuda")
h0 = 0.1 * rn(N, H, D, D).float()
cu = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(N)], dtype=torch.long, device="cuda")
out, ht = torch.full_like(v, float("nan")), torch.full_like(h0, float("nan"))


def call():
    flashkda.fwd(q, k, v, gg, beta, D ** -0.5, out, A_log, dt_bias, LB, initial_state=h0, final_state=ht,
                 cu_seqlens=cu)


if mode == "warm":
    call()
    torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(graph):
        call()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    print(f"{mode}: captured and replayed, outputs written: {bool(torch.isfinite(out).all())}")
except Exception as e:  # noqa: BLE001
    chain, x = [], e
    while x is not None:
        chain.append(repr(x))
        x = x.__context__
    print(f"{mode}: FAILED: " + " <- ".join(chain))
