"""Where the host time of a short FlashAttention call goes (diagnosis for kernels/NOTES.md).

    python results/diagnosis/flash_host.py > flash_host.log

Times 200 forward+backward calls at a launch-bound shape (1 x 16 heads x 512 x 64, causal, bf16, a model's
layout) by the host clock with one synchronisation at the end, then profiles the same loop with cProfile.
"""

import cProfile
import pstats
import time

import torch

from cs336_systems.kernels import FlashAttentionTriton

q, k, v = (torch.randn(1, 512, 16, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
           for _ in range(3))
do = torch.randn(1, 16, 512, 64, device="cuda", dtype=torch.bfloat16)


def loop(n):
    for _ in range(n):
        FlashAttentionTriton.apply(q, k, v, True).backward(do)
        q.grad = k.grad = v.grad = None
    torch.cuda.synchronize()


loop(20)
for name, fn in (("forward only", lambda: FlashAttentionTriton.apply(q.detach(), k.detach(), v.detach(), True)),
                 ("forward+backward", lambda: loop(1))):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    print(f"{name}: {(time.perf_counter() - start) / 200 * 1e6:.0f} us per call (host clock)")
profiler = cProfile.Profile()
profiler.enable()
loop(200)
profiler.disable()
pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
