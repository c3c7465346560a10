"""One flashkda.fwd call of a shape for ncu (kernel stall reasons): H=96 fixed T=8192 by default."""
import sys
import torch
import flashkda

H = int(sys.argv[1]) if len(sys.argv) > 1 else 96
T = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
ops = sys.argv[3] if len(sys.argv) > 3 else "split"
D = 128
g = torch.Generator(device="cuda").manual_seed(1)
rn = lambda *s: torch.randn(*s, generator=g, device="cuda").to(torch.bfloat16)  # noqa: E731
q, k, v, gg, beta = rn(1, T, H, D), rn(1, T, H, D), rn(1, T, H, D), rn(1, T, H, D), rn(1, T, H)
A_log, dt = torch.rand(H, device="cuda"), torch.rand(H, D, device="cuda")
h0 = 0.1 * torch.randn(1, H, D, D, device="cuda")
out, ht = torch.empty_like(v), torch.empty_like(h0)
for _ in range(2):
    flashkda.fwd(q, k, v, gg, beta, D ** -0.5, out, A_log, dt, -5.0, initial_state=h0, final_state=ht,
                 operands=ops, segment_chunks=0)
torch.cuda.synchronize()
print("ok", H, T, ops, float(out.float().abs().mean()))
