#!/usr/bin/env python3
"""Times fla's Triton chunk_kda on the flashkda anchor shapes and writes JSON (spawned by
`flashkda-bench --tier sm90`, so fla is measured in the same run as our kernel).

With --flashkda it also (a) times `flashkda.fwd` through the wheel on torch's stream and
(b) checks the fla backend hookup: `flashkda.register_fla_backend()`, then `chunk_kda` must
dispatch to flashkda and agree with fla's Triton result.

Protocol (docs/specs/kda.md §4): fresh bf16 randn q, k, v, g, beta logits; A_log, dt_bias U(0,1);
scale 1/sqrt(128); lower_bound -5; fp32 initial state 0.1*randn (bf16-representable); final
state requested; one untimed first call (Triton autotune), warm-up, then blocks of CUDA-event
timed calls; median of all calls and per-block medians.

--check only tests that a run can start (torch sees a GPU, fla imports, with --flashkda the wheel
imports); flashkda-bench runs it before timing its own kernels.
"""
import os.path
import sys

# Run as a script, sys.path[0] is this folder, whose `flashkda/` (the wheel's Python sources,
# without the compiled module) would shadow the installed wheel.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import argparse
import importlib.metadata
import json
import os
import sys
import time

os.environ["FLA_FLASH_KDA"] = "0"  # fla must not dispatch to a FlashKDA install
os.environ.setdefault("FLASHKDA_FLA", "0")  # nor to ours, unless --flashkda turns it on for the check

import torch  # noqa: E402

D = 128
LB = -5.0
CASES = [("fixed", [8192]), ("varlen6", [1300, 547, 2048, 963, 271, 3063]), ("1024x8", [1024] * 8)]
T0 = time.time()


def log(*a):
    print(f"[bench_fla {time.time() - T0:6.1f}s]", *a, file=sys.stderr, flush=True)


def time_fn(fn, warmup, iters, repeats):
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
    return {"samples_ms": all_ms, "block_medians_ms": blocks}


def make_inputs(seq_lens, H, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T, N = sum(seq_lens), len(seq_lens)

    def rn(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16)

    cu = None
    if N > 1:
        c = [0]
        for s in seq_lens:
            c.append(c[-1] + s)
        cu = torch.tensor(c, dtype=torch.long, device="cuda")
    return {
        "q": rn(1, T, H, D), "k": rn(1, T, H, D), "v": rn(1, T, H, D), "g": rn(1, T, H, D), "beta": rn(1, T, H),
        "A_log": torch.rand(H, generator=g, device="cuda"), "dt_bias": torch.rand(H, D, generator=g, device="cuda"),
        "h0": (0.1 * rn(N, H, D, D).float()).to(torch.bfloat16).float(), "cu": cu, "N": N,
    }


def fla_call(inp):
    from fla.ops.kda import chunk_kda
    kw = {"cu_seqlens": inp["cu"]} if inp["cu"] is not None else {}
    return chunk_kda(q=inp["q"], k=inp["k"], v=inp["v"], g=inp["g"], beta=inp["beta"], scale=D ** -0.5,
                     initial_state=inp["h0"], output_final_state=True, use_gate_in_kernel=True,
                     use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
                     lower_bound=LB, A_log=inp["A_log"], dt_bias=inp["dt_bias"], state_v_first=True, **kw)


def flashkda_call(inp, out, ht):
    import flashkda
    flashkda.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], D ** -0.5, out, inp["A_log"], inp["dt_bias"],
                 LB, initial_state=inp["h0"], final_state=ht, cu_seqlens=inp["cu"])


def rel(x, r):
    x, r = x.double(), r.double()
    return float((x - r).norm() / r.norm())


def check(wheel):
    if not torch.cuda.is_available():
        sys.exit("bench_fla: torch sees no CUDA device")
    try:
        from fla.ops.kda import chunk_kda  # noqa: F401
    except Exception as e:  # noqa: BLE001
        sys.exit(f"bench_fla: cannot import fla's chunk_kda ({e!r}); pip install 'fla-core>=0.6'")
    if wheel:
        try:
            import flashkda  # noqa: F401
        except Exception as e:  # noqa: BLE001
            sys.exit(f"bench_fla: cannot import the flashkda wheel ({e!r}); install it or pass --no-fla-wheel")
    log("check passed")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--heads", default="96,64")
    ap.add_argument("--cases", default="fixed,varlen6,1024x8")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--flashkda", action="store_true", help="also time flashkda via the wheel and check the fla hookup")
    ap.add_argument("--check", action="store_true", help="only check that the run can start (GPU, fla, wheel)")
    args = ap.parse_args()
    if args.check:
        check(args.flashkda)
        return
    if args.out is None:
        ap.error("--out is required")
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "python": sys.version.split()[0]}
    for mod in ("triton", "fla-core", "flash-linear-attention", "flashkda"):
        try:
            env[mod] = importlib.metadata.version(mod)
        except Exception as e:  # noqa: BLE001
            env[mod] = f"? ({e.__class__.__name__})"
    res = {"env": env, "rows": [], "hookup": None}

    def dump():
        with open(args.out, "w") as f:
            json.dump(res, f)

    with torch.inference_mode():
        for H in [int(h) for h in args.heads.split(",")]:
            for name, lens in CASES:
                if name not in args.cases.split(","):
                    continue
                inp = make_inputs(lens, H, seed=int(time.time() * 1e3) % (2 ** 31))
                row = {"H": H, "case": name}
                try:
                    t = time.time()
                    fla_call(inp)
                    torch.cuda.synchronize()
                    row["fla_first_call_s"] = time.time() - t
                    row["fla"] = time_fn(lambda: fla_call(inp), args.warmup, args.iters, args.repeats)
                    m = sorted(row["fla"]["samples_ms"])[len(row["fla"]["samples_ms"]) // 2]
                    log(f"H={H} {name}: fla {m:.4f} ms (first call {row['fla_first_call_s']:.1f} s)")
                except Exception as e:  # noqa: BLE001
                    row["fla_error"] = repr(e)
                    log(f"H={H} {name}: fla FAILED {e!r}")
                if args.flashkda:
                    try:
                        out = torch.empty_like(inp["v"])
                        ht = torch.empty_like(inp["h0"])
                        row["flashkda_wheel"] = time_fn(lambda: flashkda_call(inp, out, ht), args.warmup, args.iters,
                                                        args.repeats)
                        o_f, ht_f = fla_call(inp)
                        flashkda_call(inp, out, ht)
                        row["flashkda_vs_fla"] = {"out": rel(out, o_f), "state": rel(ht, ht_f)}
                        log(f"H={H} {name}: flashkda wheel vs fla {row['flashkda_vs_fla']}")
                    except Exception as e:  # noqa: BLE001
                        row["flashkda_error"] = repr(e)
                        log(f"H={H} {name}: flashkda wheel FAILED {e!r}")
                res["rows"].append(row)
                del inp
                torch.cuda.empty_cache()
                dump()
        if args.flashkda:
            try:
                import logging

                import flashkda
                logging.basicConfig(level=logging.INFO)
                inp = make_inputs([1300, 547, 2048, 963, 271, 3063], 64, seed=5)
                o_t, ht_t = fla_call(inp)  # Triton (FLASHKDA_FLA=0 still)
                os.environ["FLASHKDA_FLA"] = "1"
                ok = flashkda.register_fla_backend()
                from fla.backends import _function_registries
                from fla.ops.kda.chunk import chunk_kda
                from inspect import unwrap
                reg = _function_registries.get(unwrap(chunk_kda))
                active = reg.get_active().backend_type if reg is not None and reg.get_active() else None
                o_b, ht_b = fla_call(inp)
                os.environ["FLASHKDA_FLA"] = "0"
                o_off, _ = fla_call(inp)
                res["hookup"] = {"registered": ok, "active_backend": active, "rel_out_vs_triton": rel(o_b, o_t),
                                 "rel_state_vs_triton": rel(ht_b, ht_t),
                                 "opt_out_restores_triton": bool(torch.equal(o_off, o_t))}
                log(f"fla hookup: {res['hookup']}")
            except Exception as e:  # noqa: BLE001
                res["hookup"] = {"error": repr(e)}
                log(f"fla hookup FAILED {e!r}")
    dump()


if __name__ == "__main__":
    main()
