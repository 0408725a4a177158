"""Scratch (#62): RoPE forward+backward at the 8B step's shapes, compiled, as the model writes it (even/odd slices,
stack) against the same rotation written as a pair swap (x*cos2 + swap(x)*sin2); equality checked in float64 first."""
import torch, triton
from cs336_systems.model.transformer import RotaryEmbedding
dev = "cuda"
B, T, H, D = 1, 32768, 32, 128
r = RotaryEmbedding(D, T, 500000.0, device=dev)
pos = torch.arange(T, device=dev)

def current(y):
    return r(y.view(B, T, H, D).transpose(1, 2), pos)

def swapped(y):
    x = y.view(B, T, H, D).transpose(1, 2)
    cos, sin = r.cos[pos], r.sin[pos]
    cos2 = cos.repeat_interleave(2, -1)
    sin2 = torch.stack((-sin, sin), -1).flatten(-2)
    xs = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (x * cos2 + xs * sin2).to(x.dtype)

y64 = torch.randn(B, T, H * D, device=dev, dtype=torch.float64)
print("max diff fp64", (current(y64) - swapped(y64)).abs().max().item())
for name, f in (("current", current), ("swapped", swapped)):
    fc = torch.compile(f)
    y = torch.randn(B, T, H * D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    out = fc(y); g = torch.randn_like(out)
    def step():
        y.grad = None
        fc(y).backward(g)
    def fwd():
        with torch.no_grad(): fc(y)
    for _ in range(3): step()
    print(name, "fwd+bwd ms", triton.testing.do_bench(step, rep=500), "fwd ms", triton.testing.do_bench(fwd, rep=300))
