#!/usr/bin/env python3
"""Times the cuDNN frontend's KDA forward (``cudnn.linear_attention.kimi_delta_attention``, the sm90
engines ``kda_hopper_cuda`` / ``kda_hopper`` and cuDNN's own choice) beside ``flashkda.fwd`` and, when
importable, the public FlashKDA, on the same inputs in one process (CUDA events, medians), and compares
the outputs: against flashkda on every shape, against a float64 token recurrence on the fixed anchors.

The cuDNN frontend wheel (nvidia-cudnn-frontend, carried and unpacked with ``pip install --no-deps
--target``) compiles its sm90 CUDA kernels with NVRTC at the first call: that first call is timed apart
and left out of the medians. A plan that cannot serve a shape is recorded with its error, never fatal.

Inputs and semantics are ``bench_compare.py``'s (safe gate with lower bound -5, beta sigmoid and q/k
L2 norm in the kernel, fp32 state [N, H, V, K] in and out).
"""
import os.path
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import bench_compare as bc  # noqa: E402  (strips this folder from sys.path again after its import)
import torch  # noqa: E402
from flashkda.testing import time_median as time_fn  # noqa: E402

PLANS = ["kda_hopper_cuda", "kda_hopper", None]


def cudnn_args(inp):
    """THD views and int32 cu_seqlens, built once outside the timed call."""
    B, T, H, D = inp["q"].shape
    cu = inp["cu"]
    cu = (cu.to(torch.int32) if cu is not None
          else torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device="cuda"))
    thd = {n: inp[n].reshape(-1, *inp[n].shape[2:]).contiguous() for n in ("q", "k", "v", "g", "beta")}
    return thd, cu


def call_cudnn(thd, cu, inp, plan):
    from cudnn.linear_attention import kimi_delta_attention
    return kimi_delta_attention(
        thd["q"], thd["k"], thd["v"], thd["g"], thd["beta"], cu, scale=bc.D ** -0.5,
        initial_state=inp["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, safe_gate=True, gate_lower_bound=bc.LB, a_log=inp["A_log"],
        dt_bias=inp["dt_bias"], plan_name=plan)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--heads", default="96,64")
    ap.add_argument("--long", default="4:65536", help="H:T single sequences also timed (B = 1)")
    ap.add_argument("--f64", default="fixed", help="anchor cases also checked against float64")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import cudnn  # noqa: F401  (a requested baseline must import)
    import flashkda  # noqa: F401
    try:
        import flash_kda  # noqa: F401
        have_fkda = True
    except ImportError:
        have_fkda = False
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    for mod in ("nvidia-cudnn-frontend", "flashkda", "flash_kda", "cuda-bindings"):
        try:
            env[mod] = importlib.metadata.version(mod)
        except Exception as e:  # noqa: BLE001
            env[mod] = f"? ({e.__class__.__name__})"
    try:
        env["cudnn_backend"] = cudnn.backend_version()
    except Exception as e:  # noqa: BLE001
        env["cudnn_backend"] = f"? ({e})"
    res = {"env": env, "rows": []}
    bc.log("env", env)

    def dump():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    shapes = [(f"H={H} {name}", 1, lens, H) for H in [int(h) for h in args.heads.split(",") if h]
              for name, lens in bc.ANCHORS]
    for s in [s for s in args.long.split(",") if s]:
        H, T = (int(x) for x in s.split(":"))
        shapes.append((f"H={H} T={T // 1024}K", 1, [T], H))
    dead = set()
    with torch.inference_mode():
        for label, B, lens, H in shapes:
            inp = bc.make_inputs(B, lens, H, seed=int(time.time() * 1e3) % (2 ** 31))
            row = {"shape": label, "H": H, "T": sum(lens)}
            long = sum(lens) > 8192
            w, it, rp = (2, 10, 2) if long else (args.warmup, args.iters, args.repeats)
            out = torch.empty_like(inp["v"])
            ht = torch.empty_like(inp["h0"])
            row["flashkda"] = time_fn(lambda: bc.call_flashkda(inp, out, ht), w, it, rp)
            m = row["flashkda"]["median_ms"]
            bc.log(f"{label}: flashkda {m:.4f} ms")
            if have_fkda:
                fo, fh = torch.empty_like(out), torch.empty_like(ht)
                r = time_fn(lambda: bc.call_flash_kda(inp, fo, inp["h0"], fh), w, it, rp)
                row["flash_kda"] = r
                bc.log(f"{label}: public FlashKDA {r['median_ms']:.4f} ms")
            o_ref = s_ref = None
            name = label.split(" ", 1)[1]
            if name in args.f64.split(","):
                o_ref, s_ref = bc.reference_f64(inp)
                row["flashkda_rel_out_f64"] = bc.rel(out, o_ref)
                row["flashkda_rel_state_f64"] = bc.rel(ht, s_ref)
            thd, cu = cudnn_args(inp)
            for plan in PLANS:
                key = f"cudnn_{plan or 'auto'}"
                if key in dead:
                    continue
                try:
                    t0 = time.time()
                    o, st = call_cudnn(thd, cu, inp, plan)
                    torch.cuda.synchronize()
                    row[key + "_first_call_s"] = round(time.time() - t0, 2)
                    o = o.reshape(out.shape)
                    row[key + "_nonfinite"] = int((~torch.isfinite(o)).sum()) + int((~torch.isfinite(st)).sum())
                    row[key + "_rel_out_vs_flashkda"] = bc.rel(o, out)
                    row[key + "_rel_state_vs_flashkda"] = bc.rel(st, ht)
                    if o_ref is not None:
                        row[key + "_rel_out_f64"] = bc.rel(o, o_ref)
                        row[key + "_rel_state_f64"] = bc.rel(st, s_ref)
                    r = time_fn(lambda: call_cudnn(thd, cu, inp, plan), w, it, rp)
                    row[key] = r
                    g = torch.cuda.CUDAGraph()
                    try:
                        side = torch.cuda.Stream()
                        side.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(side):
                            call_cudnn(thd, cu, inp, plan)
                        torch.cuda.current_stream().wait_stream(side)
                        with torch.cuda.graph(g):
                            call_cudnn(thd, cu, inp, plan)
                        row[key + "_graph"] = time_fn(g.replay, w, it, rp)
                    except Exception as e:  # noqa: BLE001
                        row[key + "_graph_error"] = f"{e.__class__.__name__}: {str(e)[:300]}"
                    del g
                    gm = row.get(key + "_graph", {}).get("median_ms")
                    bc.log(f"{label}: cuDNN {plan or 'auto'} {r['median_ms']:.4f} ms (graph replay {gm}), "
                           f"flashkda/cuDNN {m / r['median_ms']:.3f}, first call {row[key + '_first_call_s']} s, "
                           f"rel out vs flashkda {row[key + '_rel_out_vs_flashkda']:.2e}"
                           + (f", vs f64 {row[key + '_rel_out_f64']:.2e} (flashkda {row['flashkda_rel_out_f64']:.2e})"
                              if o_ref is not None else ""))
                except Exception as e:  # noqa: BLE001
                    row[key + "_error"] = f"{e.__class__.__name__}: {str(e)[:500]}"
                    bc.log(f"{label}: cuDNN {plan or 'auto'} failed: {row[key + '_error']}")
                    if "NotSupported" not in e.__class__.__name__:
                        dead.add(key)
            res["rows"].append(row)
            dump()
    dump()


if __name__ == "__main__":
    main()
