"""A small MoE layer trained with moonep and with a dense no-communication reference, in lockstep.

    torchrun --nproc_per_node=2 train_moe.py [--steps 300] [--skew 3]   (MOONEP_DEVICE=0: one GPU)

Router (softmax top-k) + experts (SiLU FFN, a gathered batched GEMM per slot row) on bf16 tokens.
moonep run, MoonEP's protocol: each rank owns only its home experts; after dispatch the home ranks
`prefetch` replica weights into the ranks the planner moved hot-expert rows to, and after backward
`reduce_grad` sums the replicas' weight gradients into the owners' grads (only the small router is
all-reduced, over gloo). Reference run: every rank holds all experts, computes its own tokens
densely (no dispatch) and all-reduces every gradient. Skew: a logit bias on rank 0's home experts.
Prints the losses of both runs, the largest relative loss gap and the median iteration time; exit
1 if the gap exceeds 2% or the loss did not fall.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

import moonep

E, K, H, F, S = 16, 4, 64, 128, 256


def init_params(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "router": torch.randn(H, E, generator=g) * 0.1,
        "w1": torch.randn(E, H, F, generator=g) / H**0.5,
        "w2": torch.randn(E, F, H, generator=g) / F**0.5,
    }


def route(p, x, bias):
    logits = x.float() @ p["router"] + bias
    w, topk = torch.softmax(logits, -1).topk(K, dim=-1)
    return w, topk.to(torch.int32)


def ffn(p, h, eid):
    z = torch.nn.functional.silu(torch.bmm(h.float().unsqueeze(1), p["w1"][eid]))
    return torch.bmm(z, p["w2"][eid]).squeeze(1)


def ffn_flat(w, h):
    """SiLU FFN with per-row flat weights w `[rows, 2*H*F]` (w1 then w2)."""
    w1, w2 = w[:, : H * F].view(-1, H, F), w[:, H * F :].view(-1, F, H)
    return torch.bmm(torch.nn.functional.silu(torch.bmm(h.float().unsqueeze(1), w1)), w2).squeeze(1)


def moonep_layer(buf, router, home, x, bias, world):
    """Returns (out, replica leaf): slot groups 0..epn use `home`, epn..2epn the prefetched replicas."""
    w, topk = route({"router": router}, x, bias)
    hidden, wts, cu = moonep.dispatch(buf, x, topk, w)
    buf.prefetch(home.detach())
    replica = buf.replica_weights().clone().requires_grad_(True)
    epn = E // world
    rows = torch.arange(hidden.shape[0], device=x.device)
    valid = (rows < cu[-1].long()).unsqueeze(-1)
    grp = torch.searchsorted(cu.long(), rows, right=True).clamp(max=2 * epn - 1)
    # Rows past the groups are undefined (maybe NaN): keep them out of every product.
    h = torch.where(valid, hidden, 0)
    y = ffn_flat(torch.cat([home, replica])[grp], h)
    y = (y * torch.where(valid.squeeze(-1), wts, 0).unsqueeze(-1)).to(torch.bfloat16)
    return moonep.combine(buf, y), replica


def dense_layer(p, x, bias):
    w, topk = route(p, x, bias)
    s = x.shape[0]
    y = ffn(p, x.repeat_interleave(K, 0), topk.long().flatten()).view(s, K, H)
    return (y * w.unsqueeze(-1)).to(torch.bfloat16).float().sum(1).to(torch.bfloat16)


def sgd(t, g, world, lr):
    with torch.no_grad():
        t -= lr * g / world
    t.grad = None


def step(params, loss, world, lr):
    loss.backward()
    for t in params.values():
        g = t.grad.detach().cpu()
        dist.all_reduce(g)
        sgd(t, g.to(t.device), world, lr)


def moonep_step(buf, router, home, replica, loss, world, lr):
    loss.backward()
    buf.reduce_slots().copy_(replica.grad)
    buf.reduce_grad(home.grad)
    g = router.grad.detach().cpu()
    dist.all_reduce(g)
    sgd(router, g.to(router.device), world, lr)
    sgd(home, home.grad, world, lr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--skew", type=float, default=3.0)
    ap.add_argument("--lr", type=float, default=0.5)
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", int(os.environ.get("MOONEP_DEVICE", os.environ.get("LOCAL_RANK", 0))))
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo")
    epn = E // world
    buf = moonep.Buffer(experts=E, top_k=K, capacity_s=S, hidden=H, padding=8, num_blocks=8,
                        grad_elems=2 * H * F, expert_bytes=2 * H * F * 4)
    buf.replica_weights().zero_()
    bias = torch.zeros(E, device=dev)
    bias[:epn] = a.skew
    full = init_params(0)
    mine = slice(rank * epn, (rank + 1) * epn)
    home = torch.cat([full["w1"][mine].flatten(1), full["w2"][mine].flatten(1)], 1).to(dev).contiguous()
    home.requires_grad_(True)
    router = full["router"].to(dev).requires_grad_(True)
    pr = {k: v.to(dev).requires_grad_(True) for k, v in full.items()}
    replicas_seen = 0
    teacher = torch.randn(H, H, generator=torch.Generator().manual_seed(99)).to(dev) / H**0.5
    data = torch.Generator(device=dev).manual_seed(1000 + rank)
    gap, times, losses = 0.0, [], []
    for i in range(a.steps):
        x = torch.randn(S, H, device=dev, generator=data).to(torch.bfloat16)
        target = torch.tanh(x.float() @ teacher)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out, replica = moonep_layer(buf, router, home, x, bias, world)
        lm = torch.nn.functional.mse_loss(out.float(), target)
        moonep_step(buf, router, home, replica, lm, world, a.lr)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        lr_ = torch.nn.functional.mse_loss(dense_layer(pr, x, bias).float(), target)
        step(pr, lr_, world, a.lr)
        both = torch.tensor([lm.item(), lr_.item()])
        dist.all_reduce(both)
        both /= world
        losses.append(both)
        gap = max(gap, abs(both[0] - both[1]).item() / both[1].item())
        if i == 0:
            replicas_seen = sum(e >= 0 for e in buf._raw.experts_to_copy(torch.cuda.current_stream().cuda_stream))
        if rank == 0 and (i % 50 == 0 or i == a.steps - 1):
            print(f"step {i:4d} loss moonep {both[0]:.5f} reference {both[1]:.5f}", flush=True)
    buf.check()
    med = sorted(times[10:])[len(times[10:]) // 2] * 1e3 if len(times) > 10 else float("nan")
    if rank == 0:
        print(f"skew {a.skew}: {replicas_seen} replica(s) in step 0; first loss {losses[0][1]:.5f} last {losses[-1][1]:.5f}; largest relative loss gap "
              f"{gap:.2e}; median moonep iteration {med:.2f} ms (incl. gloo all-reduce; ranks time-slice one GPU)")
    dist.destroy_process_group()
    sys.exit(0 if gap < 0.02 and losses[-1][0] < losses[0][0] else 1)


if __name__ == "__main__":
    main()
