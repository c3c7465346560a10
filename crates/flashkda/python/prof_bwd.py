#!/usr/bin/env python3
"""Per-kernel times of the flashkda forward+backward (torch.profiler, CUDA activity) on one anchor
shape: ``prof_bwd.py --heads 96 --case fixed``. Prints one line per kernel: calls, total ms."""
import os.path
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
sys.path.insert(0, _here)

import argparse  # noqa: E402

import torch  # noqa: E402

import bench_bwd as bb  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--case", default="fixed")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--contender", default="flashkda")
    a = ap.parse_args()
    lens = dict(bb.ANCHORS)[a.case]
    x, cu, do, dht = bb.inputs(lens, a.heads, seed=1)
    fn = bb.call_flashkda if a.contender == "flashkda" else bb.call_fla

    def step():
        o, ht = fn(x, cu)
        torch.autograd.grad([o, ht], bb.leaves(x), [do, dht.to(ht.dtype)])

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(a.iters):
            step()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n, t = rows.get(e.name, (0, 0.0))
            rows[e.name] = (n + 1, t + e.device_time_total / 1000.0)
    total = sum(t for _, t in rows.values())
    print(f"{a.contender} H={a.heads} {a.case}: {total / a.iters:.3f} ms of kernels per fwd+bwd")
    for name, (n, t) in sorted(rows.items(), key=lambda r: -r[1][1]):
        print(f"  {t / a.iters:8.3f} ms/step  {n // a.iters:3d} calls  {name[:100]}")


if __name__ == "__main__":
    main()
