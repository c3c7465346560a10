#!/usr/bin/env python3
"""Head dim 64 (K = V = 64) forward: ``flashkda.fwd`` (default options) against fla's Triton ``chunk_kda``
on the six anchor shapes (T = 8192; H = 96, 64; fixed, varlen6, 1024x8), same inputs, one process, CUDA
events, medians; the outputs compared with each other, and with a float64 token recurrence on the fixed
shapes. ``--warm H:case`` only runs fla once on that shape (Triton compiles and autotunes into
TRITON_CACHE_DIR), for warming in parallel before the timed run.

Inputs and semantics are ``bench_compare.py``'s at D = 64 (its module-level D, read at call time).
"""
import os.path
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import bench_compare as bc  # noqa: E402  (sets FLA_FLASH_KDA=0: fla runs its Triton kernels)
import torch  # noqa: E402
from flashkda.testing import time_median as time_fn  # noqa: E402

bc.D = 64


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--heads", default="96,64")
    ap.add_argument("--warm", default="", help="H:case: one fla call on that anchor, nothing else")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import flashkda
    anchors = dict(bc.ANCHORS)
    if args.warm:
        h, case = args.warm.split(":")
        t = time.time()
        with torch.inference_mode():
            bc.call_fla(bc.make_inputs(1, anchors[case], int(h), seed=1))
        torch.cuda.synchronize()
        print(f"fla D=64 H={h} {case}: first call {time.time() - t:.1f} s", flush=True)
        return
    res = {"env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "D": bc.D,
                   "head_dim_enabled_64": bool(flashkda.head_dim_enabled(64))}, "rows": []}
    with torch.inference_mode():
        for H in [int(h) for h in args.heads.split(",") if h]:
            for name, lens in bc.ANCHORS:
                label = f"D=64 H={H} {name}"
                inp = bc.make_inputs(1, lens, H, seed=int(time.time() * 1e3) % (2 ** 31))
                row = {"shape": label, "H": H, "T": sum(lens)}
                out = torch.full_like(inp["v"], float("nan"))
                ht = torch.full_like(inp["h0"], float("nan"))
                bc.call_flashkda(inp, out, ht)
                torch.cuda.synchronize()
                row["flashkda_nonfinite"] = int((~torch.isfinite(out)).sum()) + int((~torch.isfinite(ht)).sum())
                row["flashkda"] = time_fn(lambda: bc.call_flashkda(inp, out, ht), args.warmup, args.iters,
                                          args.repeats)
                m = row["flashkda"]["median_ms"]
                msg = f"{label}: flashkda {m:.4f} ms"
                o_ref = None
                if name == "fixed":
                    o_ref, s_ref = bc.reference_f64(inp)
                    row["flashkda_rel_out_f64"] = bc.rel(out, o_ref)
                    row["flashkda_rel_state_f64"] = bc.rel(ht, s_ref)
                    msg += f" (vs f64 out {row['flashkda_rel_out_f64']:.2e}, state {row['flashkda_rel_state_f64']:.2e})"
                if not args.no_fla:
                    t = time.time()
                    o_f, h_f = bc.call_fla(inp)
                    torch.cuda.synchronize()
                    row["fla_first_call_s"] = round(time.time() - t, 2)
                    row["fla"] = time_fn(lambda: bc.call_fla(inp), args.warmup, args.iters, args.repeats)
                    f = row["fla"]["median_ms"]
                    row["speedup_vs_fla"] = f / m
                    row["rel_out_flashkda_vs_fla"] = bc.rel(out, o_f)
                    msg += f"; fla {f:.4f} ms -> {f / m:.2f}x, outputs differ by {row['rel_out_flashkda_vs_fla']:.2e}"
                    if o_ref is not None:
                        row["fla_rel_out_f64"] = bc.rel(o_f, o_ref)
                        row["fla_rel_state_f64"] = bc.rel(h_f, s_ref)
                        msg += f" (fla vs f64 out {row['fla_rel_out_f64']:.2e})"
                bc.log(msg)
                res["rows"].append(row)
                if args.out:
                    with open(args.out, "w") as fh:
                        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
