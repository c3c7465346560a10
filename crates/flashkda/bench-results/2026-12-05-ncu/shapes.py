#!/usr/bin/env python3
"""Issue 32's goal shapes for the ncu run (2026-12-05): the default (`Auto`) forward of the wheel,
inputs and calls exactly as python/bench_compare.py (make_inputs, call_flashkda).

  --time OUT.json   CUDA-event medians of the default call per shape (warm-up 5, 3 blocks of 20 /
                    10 calls), torch-profiler mean time per kernel, the plan read back from
                    workspace_bytes (operands from the record size, segments from the P/M/start
                    states), forced segment_chunks variants, and a 1 GiB device copy (the card's
                    DRAM ceiling, bytes read + written).
  --variants OUT    (device call 2) overlap=True and value_split 1 / 4 beside the default at the unsplit
                    shapes: time, kernels, output vs the default.
  --ncu SHAPE       one warm-up call, then the call ncu profiles (--launch-skip = kernels per call).
"""
import argparse
import importlib.util
import json
import os
import sys
import time

_here = os.path.dirname(os.path.abspath(__file__))
_bc = os.environ.get("BENCH_COMPARE", os.path.join(_here, "..", "..", "python", "bench_compare.py"))
spec = importlib.util.spec_from_file_location("bench_compare", _bc)
bc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bc)

import torch  # noqa: E402

import flashkda  # noqa: E402
from flashkda.testing import time_median  # noqa: E402

# name: (B, seq_lens, H, chunks)   (chunks of 16 tokens per sequence)
SHAPES = {
    "H96_fixed_T8192": (1, [8192], 96),
    "H32_T64K": (1, [65536], 32),
    "H96_T64K": (1, [65536], 96),
    "H4_T64K": (1, [65536], 4),
    "H16_T64K": (1, [65536], 16),
}
# extra segment_chunks values timed per shape (None = the default's own choice)
FORCED = {
    "H96_fixed_T8192": [32, 64],
    "H32_T64K": [0, 64, 256],
    "H96_T64K": [64, 128, 256],
    "H4_T64K": [],
    "H16_T64K": [],
}
D = 128


def plan_of(inp, seg=None):
    """Operands and segments of the call, read back from its workspace size."""
    q = inp["q"]
    B, T, H = q.shape[0], q.shape[1], q.shape[2]
    slots = B * (T + 15) // 16
    total = flashkda.workspace_bytes(q, inp["cu"], segment_chunks=seg)
    for ops, rec in (("split", 14400), ("bf16", 13888)):
        rb = slots * H * rec
        extra = total - rb
        if extra >= 0 and extra % (3 * H * D * D * 4) == 0:
            segs = extra // (3 * H * D * D * 4) // max(inp["N"], 1)
            return {"operands": ops, "segments_per_seq": int(segs) if segs else 1,
                    "seg_chunks": (T // 16 + segs - 1) // segs if segs else 0,
                    "workspace_bytes": int(total), "records_bytes": int(rb)}
    return {"workspace_bytes": int(total), "unparsed": True}


def copy_bw():
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    a.random_(0, 255)
    b = torch.empty_like(a)
    r = time_median(lambda: b.copy_(a), 5, 20, 3)
    return {"bytes": n, "median_ms": r["median_ms"], "TBps_read_plus_write": 2 * n / r["median_ms"] / 1e9}


def do_time(out_path):
    res = {"env": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                   "sms": torch.cuda.get_device_properties(0).multi_processor_count,
                   "flashkda": flashkda.__version__}, "copy": copy_bw(), "rows": []}
    print("copy", res["copy"], flush=True)
    with torch.inference_mode():
        for name, (B, lens, H) in SHAPES.items():
            inp = bc.make_inputs(B, lens, H, seed=int(time.time() * 1e3) % (2 ** 31))
            out = torch.empty_like(inp["v"])
            ht = torch.empty_like(inp["h0"])
            long = sum(lens) > 8192
            w, it, rp = (5, 10, 3) if long else (5, 20, 3)
            row = {"shape": name, "B": B, "T": sum(lens), "H": H, "plan": plan_of(inp)}
            out.fill_(float("nan"))
            bc.call_flashkda(inp, out, ht)
            torch.cuda.synchronize()
            row["finite"] = bool(torch.isfinite(out).all() and torch.isfinite(ht).all())
            row["default"] = time_median(lambda: bc.call_flashkda(inp, out, ht), w, it, rp)
            row["kernels_ms"] = bc.profile_kernels(lambda: bc.call_flashkda(inp, out, ht), n=5)
            print(name, "plan", row["plan"], "default", round(row["default"]["median_ms"], 4), "ms",
                  "blocks", [round(x, 4) for x in row["default"]["block_medians_ms"]], "finite", row["finite"],
                  "kernels", row["kernels_ms"], flush=True)
            for sc in FORCED[name]:
                try:
                    r = time_median(lambda: bc.call_flashkda(inp, out, ht, segment_chunks=sc), w, it, rp)
                    k = bc.profile_kernels(lambda: bc.call_flashkda(inp, out, ht, segment_chunks=sc), n=3)
                    row[f"seg{sc}"] = {"time": r, "plan": plan_of(inp, sc), "kernels_ms": k}
                    print(f"  {name} segment_chunks={sc}: {r['median_ms']:.4f} ms plan {row[f'seg{sc}']['plan']} "
                          f"kernels {k}", flush=True)
                except Exception as e:  # noqa: BLE001
                    row[f"seg{sc}"] = {"error": repr(e)}
                    print(f"  {name} segment_chunks={sc}: ERROR {e!r}", flush=True)
            res["rows"].append(row)
            with open(out_path, "w") as f:
                json.dump(res, f, indent=1)
            del inp, out, ht
            flashkda.release_workspaces()
            torch.cuda.empty_cache()


# device call 2: the state-pass options at the unsplit shapes (overlap=True runs the state pass beside
# the prep; value_split 1 / 4 = one 8-warp block / four 2-warp blocks per chain instead of two 4-warp)
VARIANTS = {
    "H96_fixed_T8192": [{"overlap": True}, {"value_split": 1}, {"value_split": 4}],
    "H96_T64K": [{"overlap": True}, {"value_split": 1}, {"value_split": 4}],
}


def do_variants(out_path):
    res = {"env": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}, "rows": []}
    with torch.inference_mode():
        for name, variants in VARIANTS.items():
            B, lens, H = SHAPES[name]
            inp = bc.make_inputs(B, lens, H, seed=int(time.time() * 1e3) % (2 ** 31))
            out = torch.empty_like(inp["v"])
            ht = torch.empty_like(inp["h0"])
            w, it, rp = (5, 10, 3) if sum(lens) > 8192 else (5, 20, 3)
            bc.call_flashkda(inp, out, ht)
            torch.cuda.synchronize()
            row = {"shape": name, "default": time_median(lambda: bc.call_flashkda(inp, out, ht), w, it, rp)}
            print(name, "default", round(row["default"]["median_ms"], 4), "ms", flush=True)
            for kw in variants:
                key = ",".join(f"{k}={v}" for k, v in kw.items())
                try:
                    o2, h2 = torch.full_like(out, float("nan")), torch.full_like(ht, float("nan"))
                    bc.call_flashkda(inp, o2, h2, **kw)
                    torch.cuda.synchronize()
                    eq = bool(torch.equal(o2, out) and torch.equal(h2, ht))
                    fin = bool(torch.isfinite(o2).all() and torch.isfinite(h2).all())
                    rel = bc.rel(o2, out)
                    r = time_median(lambda: bc.call_flashkda(inp, o2, h2, **kw), w, it, rp)
                    k = bc.profile_kernels(lambda: bc.call_flashkda(inp, o2, h2, **kw), n=3)
                    row[key] = {"time": r, "equal_default": eq, "finite": fin, "rel_vs_default": rel, "kernels_ms": k}
                    print(f"  {name} {key}: {r['median_ms']:.4f} ms ({row['default']['median_ms'] / r['median_ms']:.3f}x "
                          f"the default), equal {eq}, finite {fin}, rel {rel:.2e}, kernels {k}", flush=True)
                except Exception as e:  # noqa: BLE001
                    row[key] = {"error": repr(e)}
                    print(f"  {name} {key}: ERROR {e!r}", flush=True)
            row["default_again"] = time_median(lambda: bc.call_flashkda(inp, out, ht), w, it, rp)
            print(name, "default again", round(row["default_again"]["median_ms"], 4), "ms", flush=True)
            res["rows"].append(row)
            with open(out_path, "w") as f:
                json.dump(res, f, indent=1)
            del inp, out, ht
            flashkda.release_workspaces()
            torch.cuda.empty_cache()


def do_ncu(name):
    B, lens, H = SHAPES[name]
    with torch.inference_mode():
        inp = bc.make_inputs(B, lens, H, seed=1234)
        out = torch.empty_like(inp["v"])
        ht = torch.empty_like(inp["h0"])
        print(name, "plan", plan_of(inp), flush=True)
        bc.call_flashkda(inp, out, ht)  # warm-up (skipped by ncu)
        torch.cuda.synchronize()
        bc.call_flashkda(inp, out, ht)  # profiled
        torch.cuda.synchronize()
        print(name, "done, finite", bool(torch.isfinite(out).all()), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--time")
    ap.add_argument("--ncu")
    ap.add_argument("--variants")
    a = ap.parse_args()
    if a.variants:
        do_variants(a.variants)
    if a.time:
        do_time(a.time)
    if a.ncu:
        do_ncu(a.ncu)
    sys.exit(0)
