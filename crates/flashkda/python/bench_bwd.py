#!/usr/bin/env python3
"""GPU checks and timing of the flashkda backward through the wheel (issue 13), one process,
same inputs for every contender. Prints progress to stderr and writes one JSON file (--out).

1. ``--check``: ``flashkda.chunk_kda`` gradients (q, k, v, g, beta, A_log, dt_bias, initial state)
   against a float64 torch-autograd token recurrence on fresh random inputs, outputs of the
   backward NaN-free; fla's Triton ``chunk_kda`` gradients on the same inputs against the same
   float64 reference (when fla imports); the fla backend hookup for training calls (dispatch to
   flashkda with ``requires_grad``, bitwise equal to ``flashkda.chunk_kda``; ``FLASHKDA_FLA=0``
   restores fla's Triton path).
2. ``--time``: forward+backward and backward alone (``torch.autograd.grad`` with retained graph)
   of flashkda and of fla's Triton ``chunk_kda`` on the anchor shapes (T = 8192; H = 96, 64;
   fixed, varlen6, 1024x8), CUDA events, medians.
3. ``--train N``: a KDA layer (projections + chunk_kda + output projection) trained N steps on
   random inputs to match a fixed random teacher layer, with flashkda and with fla from the same
   initial weights; both loss curves.
"""
import os.path
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

os.environ["FLA_FLASH_KDA"] = "0"
os.environ.setdefault("FLASHKDA_FLA", "0")

import torch  # noqa: E402

import flashkda  # noqa: E402
from flashkda.testing import time_median as time_fn  # noqa: E402

D, LB = 128, -5.0
ANCHORS = [("fixed", [8192]), ("varlen6", [1300, 547, 2048, 963, 271, 3063]), ("1024x8", [1024] * 8)]
NAMES = ["dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0"]
T0 = time.time()


def log(*a):
    print(f"[bench_bwd {time.time() - T0:6.1f}s]", *a, file=sys.stderr, flush=True)


def inputs(lens, H, seed, state=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T, N = sum(lens), len(lens)
    rn = lambda *s: torch.randn(*s, generator=g, device="cuda").to(torch.bfloat16)  # noqa: E731
    cu = None
    if N > 1:
        cu = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(N)], dtype=torch.long, device="cuda")
    x = dict(q=rn(1, T, H, D), k=rn(1, T, H, D), v=rn(1, T, H, D), g=rn(1, T, H, D), beta=rn(1, T, H),
             A_log=torch.rand(H, generator=g, device="cuda"),
             # [H * 128]: fla's layout (its backward returns ddt_bias flat); flashkda.chunk_kda takes either
             dt_bias=torch.rand(H * D, generator=g, device="cuda"),
             h0=(0.1 * rn(N, H, D, D)).float() if state else None)
    for t in x.values():
        if t is not None:
            t.requires_grad_(True)
    do = rn(1, T, H, D)
    dht = (0.1 * rn(N, H, D, D)).float()
    return x, cu, do, dht


def leaves(x):
    return [x[k] for k in ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0"] if x[k] is not None]


def call_flashkda(x, cu):
    return flashkda.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], scale=D ** -0.5,
                              lower_bound=LB, initial_state=x["h0"], output_final_state=True, cu_seqlens=cu)


def call_fla(x, cu):
    from fla.ops.kda import chunk_kda
    kw = {"cu_seqlens": cu} if cu is not None else {}
    return chunk_kda(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], scale=D ** -0.5, initial_state=x["h0"],
                     output_final_state=True, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LB, A_log=x["A_log"],
                     dt_bias=x["dt_bias"], state_v_first=True, **kw)


def call_ref64(x, cu, lens):
    """The token recurrence in float64 with torch autograd (out-of-place), per sequence."""
    dd = torch.float64
    q, k, v = x["q"][0].to(dd), x["k"][0].to(dd), x["v"][0].to(dd)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    H = v.shape[1]
    dtb = x["dt_bias"].to(dd).view(H, D)
    gate = LB * torch.sigmoid(torch.exp(x["A_log"].to(dd))[None, :, None] * (x["g"][0].to(dd) + dtb[None]))
    decay, beta = torch.exp(gate), torch.sigmoid(x["beta"][0].to(dd))
    outs, hts, t0 = [], [], 0
    for n, L in enumerate(lens):
        S = x["h0"][n].to(dd) if x["h0"] is not None else torch.zeros(H, D, D, dtype=dd, device="cuda")
        for t in range(t0, t0 + L):
            S = S * decay[t][:, None, :]
            u = beta[t][:, None] * (v[t] - torch.einsum("hvk,hk->hv", S, k[t]))
            S = S + u[:, :, None] * k[t][:, None, :]
            outs.append(D ** -0.5 * torch.einsum("hvk,hk->hv", S, q[t]))
        hts.append(S)
        t0 += L
    return torch.stack(outs)[None], torch.stack(hts)


def grads(fn, x, cu, do, dht):
    o, ht = fn()
    gs = torch.autograd.grad([o, ht], leaves(x), [do.to(o.dtype), dht.to(ht.dtype)])
    return o.detach(), ht.detach(), list(gs)


def rel(a, r):
    return float((a.double() - r.double()).norm() / r.double().norm().clamp_min(1e-300))


def check(res, heads=(96, 64)):
    out, ok = {}, True
    try:
        import fla.ops.kda  # noqa: F401
        have_fla = True
    except Exception as e:  # noqa: BLE001
        have_fla = False
        out["fla_import_error"] = repr(e)
    # the anchors' head counts, so fla's Triton autotuning (keyed on H, not T) is shared with the timing
    for name, lens, H, state in [("fixed-200", [200], 96, True), ("varlen-130-1-64-77", [130, 1, 64, 77], 96, True),
                                 ("no-state-97", [97], 64, False)]:
        if H not in heads:
            continue
        x, cu, do, dht = inputs(lens, H, seed=len(name) * 7 + H, state=state)
        _, _, g64 = grads(lambda: call_ref64(x, cu, lens), x, cu, do, dht)
        _, _, gk = grads(lambda: call_flashkda(x, cu), x, cu, do, dht)
        row = {"case": name, "lens": lens, "H": H}
        names = NAMES if state else NAMES[:-1]
        row["flashkda"] = {n: rel(a, b) for n, a, b in zip(names, gk, g64)}
        row["flashkda_finite"] = all(bool(torch.isfinite(a).all()) for a in gk)
        ok &= row["flashkda_finite"] and max(row["flashkda"].values()) <= 1e-2
        if have_fla:
            try:
                _, _, gf = grads(lambda: call_fla(x, cu), x, cu, do, dht)
                row["fla"] = {n: rel(a, b) for n, a, b in zip(names, gf, g64)}
            except Exception as e:  # noqa: BLE001
                row["fla_error"] = repr(e)[:300]
        log(json.dumps(row))
        out.setdefault("cases", []).append(row)
    if have_fla and 96 in heads:
        # training calls through fla's chunk_kda dispatch to flashkda; the opt-out restores Triton
        x, cu, do, dht = inputs([300, 211], 96, seed=11)
        _, _, g_t = grads(lambda: call_fla(x, cu), x, cu, do, dht)
        os.environ["FLASHKDA_FLA"] = "1"
        out["registered"] = flashkda.register_fla_backend()
        _, _, g_b = grads(lambda: call_fla(x, cu), x, cu, do, dht)
        _, _, g_k = grads(lambda: call_flashkda(x, cu), x, cu, do, dht)
        os.environ["FLASHKDA_FLA"] = "0"
        _, _, g_off = grads(lambda: call_fla(x, cu), x, cu, do, dht)
        out["dispatch_equals_flashkda"] = all(torch.equal(a, b) for a, b in zip(g_b, g_k))
        out["opt_out_equals_triton"] = all(torch.equal(a, b) for a, b in zip(g_off, g_t))
        out["dispatch_vs_triton_rel"] = {n: rel(a, b) for n, a, b in zip(NAMES, g_b, g_t)}
        ok &= out["registered"] and out["dispatch_equals_flashkda"] and out["opt_out_equals_triton"]
        log(json.dumps({k: v for k, v in out.items() if k != "cases"}))
    out["ok"] = ok
    res["check"] = out
    return ok


def saved_bytes(fn, x):
    """Bytes autograd saves for backward in one call (distinct storages): all, and those that are
    not the caller's input tensors."""
    seen, inp = {}, {t.untyped_storage().data_ptr() for t in leaves(x)}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, ht = fn()
    del o, ht
    return sum(seen.values()), sum(b for p, b in seen.items() if p not in inp)


def timing(res, heads, cases, contenders, iters, repeats, dump):
    rows = res.setdefault("timing", [])
    for H in heads:
        for cname, lens in ANCHORS:
            if cname not in cases:
                continue
            x, cu, do, dht = inputs(lens, H, seed=H)
            row = {"H": H, "case": cname}
            for who in contenders:
                fn = (lambda: call_flashkda(x, cu)) if who == "flashkda" else (lambda: call_fla(x, cu))
                t1 = time.time()
                o, ht = fn()  # first call (fla: Triton autotune)
                torch.autograd.grad([o, ht], leaves(x), [do, dht])
                torch.cuda.synchronize()
                row[f"{who}_first_call_s"] = time.time() - t1
                tot, extra = saved_bytes(fn, x)
                th = sum(lens) * H
                row[f"{who}_saved_bytes_per_token_head"] = tot / th
                row[f"{who}_saved_beyond_inputs_per_token_head"] = extra / th

                def fwd_bwd():
                    o, ht = fn()
                    torch.autograd.grad([o, ht], leaves(x), [do, dht])

                def fwd_only():
                    with torch.no_grad():
                        fn()

                o, ht = fn()

                def bwd_only():
                    torch.autograd.grad([o, ht], leaves(x), [do, dht], retain_graph=True)

                row[f"{who}_fwd_bwd"] = time_fn(fwd_bwd, 3, iters, repeats)
                row[f"{who}_bwd"] = time_fn(bwd_only, 3, iters, repeats)
                row[f"{who}_fwd"] = time_fn(fwd_only, 3, iters, repeats)
                del o, ht
                log(f"H={H} {cname} {who}: fwd+bwd {row[f'{who}_fwd_bwd']['median_ms']:.3f} ms, "
                    f"bwd {row[f'{who}_bwd']['median_ms']:.3f} ms, fwd {row[f'{who}_fwd']['median_ms']:.3f} ms, "
                    f"saved {tot / th:.0f} B/token/head ({extra / th:.0f} beyond inputs)")
            if "flashkda" in contenders and "fla" in contenders:
                row["speedup_fwd_bwd"] = row["fla_fwd_bwd"]["median_ms"] / row["flashkda_fwd_bwd"]["median_ms"]
                row["speedup_bwd"] = row["fla_bwd"]["median_ms"] / row["flashkda_bwd"]["median_ms"]
            rows.append(row)
            del x, do, dht
            torch.cuda.empty_cache()
            dump()


def train(res, steps, who_list):
    """A KDA layer (x -> q, k, v, g, beta projections -> chunk_kda -> o_proj) learns to match a
    teacher: the same layer with other fixed random weights (its output through flashkda's forward,
    without gradients, the same targets for every contender). Loss: MSE to the teacher's output over
    its mean square (1 = predicting zeros). Same initial weights and data for every contender."""
    T, H, Dm = 2048, 96, 256

    def layer(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        rn = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
        w = {n: rn(Dm, H * D) * Dm ** -0.5 for n in "qkvg"}
        w["b"], w["o"] = rn(Dm, H) * Dm ** -0.5, rn(H * D, Dm) * (H * D) ** -0.5
        w["A_log"] = torch.rand(H, device="cuda", generator=g)
        w["dt_bias"] = torch.rand(H * D, device="cuda", generator=g)
        return w

    def forward(w, xin, who):
        xb = xin.to(torch.bfloat16)
        p = {n: (xb @ w[n].to(torch.bfloat16)).view(1, T, H, D) for n in "qkvg"}
        beta = (xb @ w["b"].to(torch.bfloat16)).view(1, T, H)
        x = dict(q=p["q"], k=p["k"], v=p["v"], g=p["g"], beta=beta, A_log=w["A_log"], dt_bias=w["dt_bias"], h0=None)
        o, _ = call_flashkda(x, None) if who == "flashkda" else call_fla(x, None)
        return o.reshape(1, T, H * D).float() @ w["o"]

    teacher = layer(7)
    curves = {}
    for who in who_list:
        w = {n: t.clone().requires_grad_() for n, t in layer(0).items()}
        opt = torch.optim.AdamW(list(w.values()), lr=2e-3, weight_decay=0.0)
        gen = torch.Generator(device="cuda").manual_seed(1)
        losses = []
        for _ in range(steps):
            xin = torch.randn(1, T, Dm, device="cuda", generator=gen)
            with torch.no_grad():
                target = forward(teacher, xin, "flashkda")
            y = forward(w, xin, who)
            loss = torch.nn.functional.mse_loss(y, target) / target.square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
        curves[who] = losses
        log(f"train {who}: loss {losses[0]:.4f} -> {losses[-1]:.4f} (min {min(losses):.4f})")
    res["train"] = {"steps": steps, "T": T, "H": H, "d_model": Dm, "target": "teacher layer (seed 7)",
                    "curves": curves}
    if len(curves) == 2:
        a, b = curves["flashkda"], curves["fla"]
        res["train"]["max_rel_diff"] = max(abs(x - y) / abs(y) for x, y in zip(a, b))
        res["train"]["final"] = {"flashkda": a[-1], "fla": b[-1]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--heads", default="96,64")
    ap.add_argument("--check-heads", default="96,64", help="run only the check cases with these head counts")
    ap.add_argument("--cases", default="fixed,varlen6,1024x8")
    ap.add_argument("--contenders", default="flashkda,fla")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--train", type=int, default=0)
    a = ap.parse_args()
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    try:
        import importlib.metadata as md
        res["fla_core"] = md.version("fla-core")
    except Exception:  # noqa: BLE001
        res["fla_core"] = None

    def dump():
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)

    ok = True
    if a.check:
        ok &= check(res, [int(h) for h in a.check_heads.split(",")])
        dump()
    if a.time:
        timing(res, [int(h) for h in a.heads.split(",")], a.cases.split(","), a.contenders.split(","), a.iters,
               a.repeats, dump)
        dump()
    if a.train:
        train(res, a.train, a.contenders.split(","))
        dump()
    dump()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
