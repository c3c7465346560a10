#!/usr/bin/env python3
"""One fla ``chunk_kda`` forward+backward on an anchor shape, so Triton compiles and autotunes its
kernels for that (H, fixed/varlen) into TRITON_CACHE_DIR: ``warm_fla.py --heads 96 --case fixed``. Needs fla and the flashkda wheel
on PYTHONPATH (it reuses bench_bwd.py, which imports flashkda)."""
import os.path
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
sys.path.insert(0, _here)

import argparse  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import bench_bwd as bb  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--case", default="fixed")
    a = ap.parse_args()
    t = time.time()
    x, cu, do, dht = bb.inputs(dict(bb.ANCHORS)[a.case], a.heads, seed=1)
    bb.grads(lambda: bb.call_fla(x, cu), x, cu, do, dht)
    torch.cuda.synchronize()
    print(f"fla H={a.heads} {a.case}: first fwd+bwd {time.time() - t:.1f} s", flush=True)


if __name__ == "__main__":
    main()
