"""moonep wheel check on the GPU: run as `torchrun --nproc_per_node=2 two_ranks.py` (two ranks may
share one GPU: MOONEP_DEVICE=0). Every rank builds the same global inputs from a seed and checks
its own tokens against a local torch reference, exactly where the rounding points agree:

- autograd forward out = combine(w_slot * dispatch(x)) equals bf16(sum_k bf16(w_tk * x_t));
- backward dx equals bf16(sum_k bf16(w_tk * g_t)), dw = <g_t, x_t> (f32 sum order differs: 1e-5);
- NaN-poisoned shard before the first call; random and 90%-clustered routings;
- a CUDA graph of dispatch + combine replays with fresh inputs and still matches;
- bad inputs raise ValueError.
Exit status 1 on any failure.
"""

import os
import sys

import torch

import moonep

E, K, S, H, P, s = 16, 4, 256, 128, 8, 200


def routing(rank, world, kind, seed):
    g = torch.Generator().manual_seed(seed * 101 + rank)
    epn = E // world
    weights = torch.ones(E)
    if kind == "clustered":
        weights[:epn] = 40.0
    return torch.multinomial(weights.expand(s, E), K, replacement=False, generator=g).to(torch.int32)


def tokens(rank, seed):
    g = torch.Generator().manual_seed(seed * 977 + rank)
    x = torch.randn(s, H, generator=g).to(torch.bfloat16)
    w = torch.rand(s, K, generator=g) * 0.99 + 0.01
    grad = torch.randn(s, H, generator=g).to(torch.bfloat16)
    return x, w, grad


def reference(x, w, grad):
    acc = torch.zeros(s, H, dtype=torch.float32, device=x.device)
    dacc = torch.zeros_like(acc)
    for k in range(K):
        acc += (x.float() * w[:, k : k + 1]).to(torch.bfloat16).float()
        dacc += (grad.float() * w[:, k : k + 1]).to(torch.bfloat16).float()
    dw = (grad.float() * x.float()).sum(-1, keepdim=True).expand(s, K)
    return acc.to(torch.bfloat16), dacc.to(torch.bfloat16), dw


def expert(hidden, wts):
    return (hidden.float() * wts.unsqueeze(-1)).to(torch.bfloat16)


def main():
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", int(os.environ.get("MOONEP_DEVICE", os.environ.get("LOCAL_RANK", 0))))
    torch.cuda.set_device(dev)
    buf = moonep.Buffer(experts=E, top_k=K, capacity_s=S, hidden=H, padding=P, num_blocks=8)
    hid, wts, _cu, _dst, _red, nvs, _, _pool = buf._raw.layout()
    shard = torch.as_tensor(moonep._DeviceArray(hid, (nvs, H), "<i2", buf), device=dev).view(torch.bfloat16)
    shard.fill_(float("nan"))
    failures = []

    def check(name, ok, detail=""):
        print(f"rank {rank}: {'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
        if not ok:
            failures.append(name)

    def same(a, b):
        return a.shape == b.shape and torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                                                  b.view(torch.int16) if b.dtype == torch.bfloat16 else b)

    for seed, kind in [(1, "random"), (2, "clustered"), (3, "clustered")]:
        topk = routing(rank, world, kind, seed).to(dev)
        x, w, grad = (t.to(dev) for t in tokens(rank, seed))
        xr = x.clone().requires_grad_(True)
        wr = w.clone().requires_grad_(True)
        hidden, wts, cu = moonep.dispatch(buf, xr, topk, wr)
        out = moonep.combine(buf, expert(hidden, wts))
        (out.float() * grad.float()).sum().backward()
        buf.check()
        out_ref, dx_ref, dw_ref = reference(x, w, grad)
        check(f"{kind} seed {seed} forward", same(out, out_ref),
              f"(max diff {(out.float() - out_ref.float()).abs().max().item():.3g})")
        check(f"{kind} seed {seed} dx", same(xr.grad, dx_ref),
              f"(max diff {(xr.grad.float() - dx_ref.float()).abs().max().item():.3g})")
        check(f"{kind} seed {seed} dw", torch.allclose(wr.grad, dw_ref, rtol=1e-5, atol=1e-5),
              f"(max diff {(wr.grad - dw_ref).abs().max().item():.3g})")
        if kind == "clustered" and rank == 0:
            etc = buf._raw.experts_to_copy(torch.cuda.current_stream().cuda_stream)
            check(f"{kind} seed {seed} has replicas", any(e >= 0 for e in etc), str(etc))

    # CUDA graph: static inputs, dispatch + expert + combine captured once, replayed twice.
    try:
        topk = routing(rank, world, "clustered", 7).to(dev)
        x_static = torch.zeros(s, H, dtype=torch.bfloat16, device=dev)
        w_static = torch.zeros(s, K, dtype=torch.float32, device=dev)
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the graph
                h, wv, _ = buf.dispatch_raw(x_static, topk, w_static)
                h.copy_(expert(h, wv))
                out_static, _ = buf.combine_raw()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            h, wv, _ = buf.dispatch_raw(x_static, topk, w_static)
            h.copy_(expert(h, wv))
            out_static, _ = buf.combine_raw()
        for seed in (8, 9):
            x, w, grad = (t.to(dev) for t in tokens(rank, seed))
            x_static.copy_(x)
            w_static.copy_(w)
            graph.replay()
            buf.check()
            out_ref, _, _ = reference(x, w, grad)
            check(f"cuda graph replay seed {seed}", same(out_static, out_ref))
    except Exception as e:  # noqa: BLE001 - report and fail, never hang
        check("cuda graph capture", False, repr(e))

    # Bad input is a ValueError raised before any collective call (no peer waits on it).
    x, w, _ = (t.to(dev) for t in tokens(rank, 10))
    topk = routing(rank, world, "random", 10).to(dev)
    for name, args in [("f32 x", (x.float(), topk, w)), ("s > S", (torch.cat([x, x]), torch.cat([topk, topk]), torch.cat([w, w]))),
                       ("topk shape", (x, topk[:, :2], w))]:
        try:
            moonep.dispatch(buf, *args)
            check(f"bad input ({name}) refused", False)
        except ValueError:
            check(f"bad input ({name}) refused", True)
    print(f"rank {rank}: {len(failures)} failure(s)", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
