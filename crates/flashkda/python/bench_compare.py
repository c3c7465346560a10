#!/usr/bin/env python3
"""Times the public Python calls side by side on one GPU, same inputs, CUDA events, medians:
``flashkda.fwd`` (the wheel), the public FlashKDA ``flash_kda.fwd`` and (with --fla) fla's Triton
``chunk_kda``. A requested baseline that cannot be imported is an error, never a silent gap.

Also: CUDA-graph capture and replay of ``flashkda.fwd`` compared bitwise with the eager call
(outputs NaN-poisoned before the replay), graph replay time, and accuracy of long single
sequences against a float64 token recurrence on the GPU (outputs NaN-poisoned first).

Shapes: the six anchors (T = 8192; H = 96, 64; fixed, varlen6, 1024x8) and long single sequences
(B = 1; H = 4, 16, 32; T = 64K, 256K). Inputs as docs/specs/kda.md §4.
"""
import os.path
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import argparse  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

os.environ["FLA_FLASH_KDA"] = "0"
os.environ.setdefault("FLASHKDA_FLA", "0")

import torch  # noqa: E402
from flashkda.testing import time_median as time_fn  # noqa: E402

D, LB = 128, -5.0
ANCHORS = [("fixed", [8192]), ("varlen6", [1300, 547, 2048, 963, 271, 3063]), ("1024x8", [1024] * 8)]
T0 = time.time()


def log(*a):
    print(f"[bench_compare {time.time() - T0:6.1f}s]", *a, file=sys.stderr, flush=True)


def make_inputs(B, seq_lens, H, seed):
    """B > 1: fixed-length batch of seq_lens[0]; else packed seq_lens (cu_seqlens when > 1)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    T, N = (seq_lens[0], B) if B > 1 else (sum(seq_lens), len(seq_lens))

    def rn(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16)

    cu = None
    if B == 1 and N > 1:
        c = [0]
        for s in seq_lens:
            c.append(c[-1] + s)
        cu = torch.tensor(c, dtype=torch.long, device="cuda")
    return {
        "q": rn(B, T, H, D), "k": rn(B, T, H, D), "v": rn(B, T, H, D), "g": rn(B, T, H, D), "beta": rn(B, T, H),
        "A_log": torch.rand(H, generator=g, device="cuda"), "dt_bias": torch.rand(H, D, generator=g, device="cuda"),
        "h0": (0.1 * rn(N, H, D, D).float()).to(torch.bfloat16).float(), "cu": cu, "N": N, "lens": seq_lens,
    }


def call_flashkda(inp, out, ht, h0=None, **kw):
    import flashkda
    flashkda.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], D ** -0.5, out, inp["A_log"],
                 inp["dt_bias"], LB, initial_state=inp["h0"] if h0 is None else h0, final_state=ht,
                 cu_seqlens=inp["cu"], **kw)


def call_flash_kda(inp, out, h0, ht):
    import flash_kda
    kw = {"cu_seqlens": inp["cu"]} if inp["cu"] is not None else {}
    flash_kda.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], D ** -0.5, out, A_log=inp["A_log"],
                  dt_bias=inp["dt_bias"], lower_bound=LB, initial_state=h0, final_state=ht, **kw)


def call_fla(inp):
    from fla.ops.kda import chunk_kda
    kw = {"cu_seqlens": inp["cu"]} if inp["cu"] is not None else {}
    return chunk_kda(q=inp["q"], k=inp["k"], v=inp["v"], g=inp["g"], beta=inp["beta"], scale=D ** -0.5,
                     initial_state=inp["h0"], output_final_state=True, use_gate_in_kernel=True,
                     use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
                     lower_bound=LB, A_log=inp["A_log"], dt_bias=inp["dt_bias"], state_v_first=True, **kw)


@torch.no_grad()
def reference_f64(inp):
    """Float64 token recurrence (spec 1.3) of a single sequence (B = 1, no cu_seqlens)."""
    dd = torch.float64
    q, k, v = inp["q"][0].to(dd), inp["k"][0].to(dd), inp["v"][0].to(dd)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    a = torch.exp(inp["A_log"].to(dd))[None, :, None]
    decay = torch.exp(LB * torch.sigmoid(a * (inp["g"][0].to(dd) + inp["dt_bias"].to(dd)[None])))
    beta = torch.sigmoid(inp["beta"][0].to(dd))
    S = inp["h0"][0].to(dd).clone()
    out = torch.empty_like(v)
    for t in range(v.shape[0]):
        S.mul_(decay[t][:, None, :])
        u = beta[t][:, None] * (v[t] - torch.einsum("hvk,hk->hv", S, k[t]))
        S.add_(u[:, :, None] * k[t][:, None, :])
        out[t] = D ** -0.5 * torch.einsum("hvk,hk->hv", S, q[t])
    return out, S


def profile_kernels(fn, n=5):
    """Mean device time per call of every kernel `fn` launches (torch.profiler, CUPTI)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            out[e.key] = round(t / n / 1000.0, 4)  # ms per call
    return out


def rel(x, r):
    x, r = x.double().reshape(r.shape), r.double()
    return float((x - r).norm() / r.norm())


def graph_check(inp, res_row, warmup, iters, repeats, suffix="", **kw):
    """Capture flashkda.fwd into a CUDA graph, replay over NaN-poisoned outputs, compare bitwise."""
    out_e = torch.empty_like(inp["v"])
    ht_e = torch.empty_like(inp["h0"])
    call_flashkda(inp, out_e, ht_e, **kw)
    torch.cuda.synchronize()
    out_g = torch.empty_like(inp["v"])
    ht_g = torch.empty_like(inp["h0"])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call_flashkda(inp, out_g, ht_g, **kw)  # warm-up on the capture's side stream, as torch advises
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call_flashkda(inp, out_g, ht_g, **kw)
    out_g.fill_(float("nan"))
    ht_g.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    res_row["graph_equal_eager" + suffix] = bool(torch.equal(out_g, out_e) and torch.equal(ht_g, ht_e))
    res_row["graph_replay" + suffix] = time_fn(graph.replay, warmup, iters, repeats)
    del graph


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sets", default="anchors,mid,long", help="anchors, mid, long")
    ap.add_argument("--heads", default="96,64")
    ap.add_argument("--long-heads", default="4,16,32")
    ap.add_argument("--long-t", default="65536,262144")
    ap.add_argument("--segments", default="", help="extra segment_chunks values timed on long shapes")
    ap.add_argument("--operands", default="", help="flashkda operands= values (bf16, split) also timed on every shape")
    ap.add_argument("--overlap", action="store_true", help="also time overlap=True (and its graph replay)")
    ap.add_argument("--chunk64", action="store_true",
                    help="also time chunk=64 (the opt-in 64-token-chunk wgmma forward), profile its kernels and "
                         "compare its output with the default's")
    ap.add_argument("--value-splits", default="", help="operands:value_split pairs also timed on the anchors (split:4)")
    ap.add_argument("--no-flash-kda", action="store_true", help="do not time the public FlashKDA")
    ap.add_argument("--fla", action="store_true", help="also time fla chunk_kda (autotunes per new shape)")
    ap.add_argument("--accuracy-long", default="4:65536", help="H:T of long cases checked against float64")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import flashkda  # noqa: F401  (the wheel is required)
    if not args.no_flash_kda:
        import flash_kda  # noqa: F401  (a requested baseline must import)
    if args.fla:
        import fla.ops.kda  # noqa: F401
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "sms":
           torch.cuda.get_device_properties(0).multi_processor_count}
    for mod in ("triton", "fla-core", "flashkda", "flash_kda"):
        try:
            env[mod] = importlib.metadata.version(mod)
        except Exception as e:  # noqa: BLE001
            env[mod] = f"? ({e.__class__.__name__})"
    res = {"env": env, "rows": []}

    def dump():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    shapes = []
    if "anchors" in args.sets:
        for H in [int(h) for h in args.heads.split(",") if h]:
            for name, lens in ANCHORS:
                shapes.append((f"H={H} {name}", 1, lens, H, False))
    if "mid" in args.sets:  # shorter inputs where the split also engages: never slower than unsplit
        for B, T, H in [(1, 8192, 4), (2, 4096, 4), (8, 1024, 4), (1, 8192, 16), (1, 16384, 32)]:
            shapes.append((f"B={B} T={T} H={H}", B, [T], H, True))
    if "long" in args.sets:
        for T in [int(t) for t in args.long_t.split(",") if t]:
            for H in [int(h) for h in args.long_heads.split(",") if h]:
                shapes.append((f"H={H} T={T // 1024}K", 1, [T], H, True))
    acc_long = {tuple(int(x) for x in s.split(":")) for s in args.accuracy_long.split(",") if s}
    failures = []
    with torch.inference_mode():
        for label, B, lens, H, is_long in shapes:
            inp = make_inputs(B, lens, H, seed=int(time.time() * 1e3) % (2 ** 31))
            row = {"shape": label, "H": H, "T": sum(lens), "N": inp["N"]}
            w, it, rp = (3, 10, 3) if is_long else (args.warmup, args.iters, args.repeats)
            out = torch.empty_like(inp["v"])
            ht = torch.empty_like(inp["h0"])
            row["flashkda"] = time_fn(lambda: call_flashkda(inp, out, ht), w, it, rp)
            m = row["flashkda"]["median_ms"]
            log(f"{label}: flashkda {m:.4f} ms")
            for op in [o for o in args.operands.split(",") if o]:
                r = time_fn(lambda: call_flashkda(inp, out, ht, operands=op), w, it, rp)
                row[f"flashkda_{op}"] = r
                row[f"speedup_{op}_vs_default"] = m / r["median_ms"]
                log(f"{label}: flashkda operands={op} {r['median_ms']:.4f} ms ({m / r['median_ms']:.3f}x the default)")
            if args.overlap:
                r = time_fn(lambda: call_flashkda(inp, out, ht, overlap=True), w, it, rp)
                row["flashkda_overlap"] = r
                log(f"{label}: flashkda overlap=True {r['median_ms']:.4f} ms ({m / r['median_ms']:.3f}x the default)")
                o2, h2 = torch.full_like(out, float("nan")), torch.full_like(ht, float("nan"))
                call_flashkda(inp, out, ht)
                call_flashkda(inp, o2, h2, overlap=True)
                torch.cuda.synchronize()
                row["overlap_equal_default"] = bool(torch.equal(o2, out) and torch.equal(h2, ht))
                log(f"{label}: overlap output equal to the default: {row['overlap_equal_default']}")
                if not row["overlap_equal_default"]:
                    failures.append(f"{label}: overlap=True differs from the default")
            if args.chunk64:
                o2, h2 = torch.full_like(out, float("nan")), torch.full_like(ht, float("nan"))
                call_flashkda(inp, out, ht)
                call_flashkda(inp, o2, h2, chunk=64)
                torch.cuda.synchronize()
                row["chunk64_nonfinite"] = int((~torch.isfinite(o2)).sum()) + int((~torch.isfinite(h2)).sum())
                row["chunk64_rel_out_vs_default"] = rel(o2, out)
                row["chunk64_rel_state_vs_default"] = rel(h2, ht)
                r = time_fn(lambda: call_flashkda(inp, o2, h2, chunk=64), w, it, rp)
                row["flashkda_chunk64"] = r
                row["speedup_chunk64_vs_default"] = m / r["median_ms"]
                log(f"{label}: flashkda chunk=64 {r['median_ms']:.4f} ms ({m / r['median_ms']:.3f}x the default), "
                    f"rel out vs default {row['chunk64_rel_out_vs_default']:.2e}, non-finite {row['chunk64_nonfinite']}")
                if row["chunk64_nonfinite"]:
                    failures.append(f"{label}: chunk=64 left non-finite outputs")
                if not is_long:
                    row["kernels_ms_chunk64"] = profile_kernels(lambda: call_flashkda(inp, o2, h2, chunk=64))
                    log(f"{label}: kernels chunk=64 {row['kernels_ms_chunk64']}")
            for pair in [x for x in args.value_splits.split(",") if x and not is_long]:
                op, vs = pair.split(":")
                r = time_fn(lambda: call_flashkda(inp, out, ht, operands=op, value_split=int(vs)), w, it, rp)
                row[f"flashkda_{op}_vs{vs}"] = r
                log(f"{label}: flashkda operands={op} value_split={vs} {r['median_ms']:.4f} ms ({m / r['median_ms']:.3f}x the default)")
            if is_long:
                for sc in [0] + [int(s) for s in args.segments.split(",") if s]:
                    r = time_fn(lambda: call_flashkda(inp, out, ht, segment_chunks=sc), w, it, rp)
                    row[f"flashkda_seg{sc}"] = r
                    log(f"{label}: flashkda segment_chunks={sc} {r['median_ms']:.4f} ms")
            if (is_long and H in (4, 32) and sum(lens) == 65536) or label in ("H=96 fixed", "H=64 1024x8"):
                row["kernels_ms"] = profile_kernels(lambda: call_flashkda(inp, out, ht))
                log(f"{label}: kernels {row['kernels_ms']}")
                for op in [o for o in args.operands.split(",") if o]:
                    row[f"kernels_ms_{op}"] = profile_kernels(lambda: call_flashkda(inp, out, ht, operands=op))
                    log(f"{label}: kernels operands={op} {row['kernels_ms_' + op]}")
            if not args.no_flash_kda:
                best = None
                for st in ("fp32", "bf16"):
                    h0 = inp["h0"] if st == "fp32" else inp["h0"].to(torch.bfloat16)
                    fht = torch.empty_like(h0)
                    fout = torch.empty_like(inp["v"])
                    r = time_fn(lambda: call_flash_kda(inp, fout, h0, fht), w, it, rp)
                    row[f"flash_kda_{st}"] = r
                    if best is None or r["median_ms"] < best:
                        best = r["median_ms"]
                row["flash_kda_best_ms"] = best
                row["speedup_vs_flash_kda"] = best / m
                log(f"{label}: FlashKDA best {best:.4f} ms -> {best / m:.2f}x")
            if args.fla and not is_long:
                t = time.time()
                call_fla(inp)
                torch.cuda.synchronize()
                row["fla_first_call_s"] = time.time() - t
                row["fla"] = time_fn(lambda: call_fla(inp), w, it, rp)
                row["speedup_vs_fla"] = row["fla"]["median_ms"] / m
                log(f"{label}: fla {row['fla']['median_ms']:.4f} ms -> {row['speedup_vs_fla']:.2f}x")
            if label in ("H=64 varlen6", "H=96 fixed") or (is_long and H == 4):
                try:
                    graph_check(inp, row, w, it, rp)
                    log(f"{label}: graph replay equal to eager: {row['graph_equal_eager']}, "
                        f"{row['graph_replay']['median_ms']:.4f} ms")
                    if not row["graph_equal_eager"]:
                        failures.append(f"{label}: graph replay differs from eager")
                    if args.overlap:
                        graph_check(inp, row, w, it, rp, suffix="_overlap", overlap=True)
                        log(f"{label}: overlap graph replay equal to eager: {row['graph_equal_eager_overlap']}")
                        if not row["graph_equal_eager_overlap"]:
                            failures.append(f"{label}: overlap graph replay differs from eager")
                    for op in [o for o in args.operands.split(",") if o]:
                        graph_check(inp, row, w, it, rp, suffix=f"_{op}", operands=op)
                        log(f"{label}: operands={op} graph replay equal to eager: {row['graph_equal_eager_' + op]}")
                        if not row["graph_equal_eager_" + op]:
                            failures.append(f"{label}: operands={op} graph replay differs from eager")
                except Exception as e:  # noqa: BLE001
                    row["graph_error"] = repr(e)
                    failures.append(f"{label}: graph capture failed: {e!r}")
                    log(f"{label}: graph FAILED {e!r}")
            if is_long and (H, sum(lens)) in acc_long:
                t = time.time()
                o_ref, s_ref = reference_f64(inp)
                row["reference_s"] = time.time() - t
                out.fill_(float("nan"))
                ht.fill_(float("nan"))
                call_flashkda(inp, out, ht)
                torch.cuda.synchronize()
                row["rel_out_f64"], row["rel_state_f64"] = rel(out, o_ref), rel(ht[0], s_ref)
                row["finite"] = bool(torch.isfinite(out).all() and torch.isfinite(ht).all())
                out.fill_(float("nan"))
                call_flashkda(inp, out, ht, segment_chunks=0)
                torch.cuda.synchronize()
                row["rel_out_f64_unsplit"] = rel(out, o_ref)
                for op in [o for o in args.operands.split(",") if o]:
                    out.fill_(float("nan"))
                    ht.fill_(float("nan"))
                    call_flashkda(inp, out, ht, operands=op)
                    torch.cuda.synchronize()
                    row[f"rel_out_f64_{op}"], row[f"rel_state_f64_{op}"] = rel(out, o_ref), rel(ht[0], s_ref)
                if not args.no_flash_kda:
                    fout = torch.full_like(inp["v"], float("nan"))
                    fht = torch.empty_like(inp["h0"])
                    call_flash_kda(inp, fout, inp["h0"], fht)
                    torch.cuda.synchronize()
                    row["flash_kda_rel_out_f64"] = rel(fout, o_ref)
                    row["flash_kda_rel_state_f64"] = rel(fht[0], s_ref)
                log(f"{label}: accuracy {json.dumps({k: v for k, v in row.items() if 'rel' in k})}")
                if not row["finite"] or row["rel_out_f64"] > 4e-3 or row["rel_state_f64"] > 4e-3:
                    failures.append(f"{label}: accuracy {row['rel_out_f64']:.3e} / {row['rel_state_f64']:.3e}")
            res["rows"].append(row)
            del inp, out, ht
            torch.cuda.empty_cache()
            dump()
    res["failures"] = failures
    dump()
    if failures:
        log("FAILURES:", failures)
        sys.exit(1)


if __name__ == "__main__":
    main()
