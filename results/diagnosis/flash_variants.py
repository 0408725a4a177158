"""A/B of FlashAttention kernel variants on one GPU (diagnosis for kernels/NOTES.md, not a pipeline rule).

    python results/diagnosis/flash_variants.py --variants tma pointers --out variants.csv --kernels kernels.csv

Each shape is laid out as a model produces it ((batch, seq, heads, dim) viewed as (batch, heads, seq, dim)).
Our kernel in each variant (a setting of kernels/settings.py flipped in this process; the autotuner
keys on it, so each variant tunes for itself), SDPA flash and SDPA cuDNN are timed in the same process
(median of do_bench), with the first call's wall time (autotuning included) and the tile configs chosen.
--kernels adds each provider's CUDA kernel times per forward+backward (torch.profiler, 5 calls).
"""

import argparse
import csv
import dataclasses
import sys
import time

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from cs336_systems.kernels import flash_triton
from cs336_systems.kernels.settings import FlashSettings, set_flash_settings
from cs336_systems.kernels.flash_triton import FlashAttentionTriton

SHAPES = [  # (batch, heads, seq, head_dim, causal)
    (1, 16, 16384, 64, True),   # the 2025 leaderboard case (batch·heads 16)
    (1, 32, 32768, 128, True),  # the 8B model's attention per GPU
    (8, 16, 2048, 128, True),
    (16, 16, 1024, 64, False),
]
VARIANTS = {"tma": {"tma": True}, "pointers": {"tma": False}}  # FlashSettings fields


def sdpa(backend):
    def fn(q, k, v, causal):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fn


SDPA = {"sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION), "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}


def kernel_rows(fn, q, k, v, do, causal, meta):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn(q, k, v, causal).backward(do)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            rows.append({**meta, "kernel": e.key[:80], "calls": e.count / 5, "ms_per_call": e.device_time_total / 5e3})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernels", default=None)
    ap.add_argument("--rep", type=int, default=300)
    args = ap.parse_args()
    rows, kernels = [], []
    for b, h, n, d, causal in SHAPES:
        providers = [(f"ours_{v}", v, FlashAttentionTriton.apply) for v in args.variants] + \
            [(name, None, fn) for name, fn in SDPA.items()]
        for name, variant, fn in providers:
            if variant:
                set_flash_settings(dataclasses.replace(FlashSettings.from_env(), **VARIANTS[variant]))
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
                       for _ in range(3))
            do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(q, k, v, causal).backward(do)
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            fwd = triton.testing.do_bench(lambda: fn(q, k, v, causal), rep=args.rep, return_mode="median")
            both = triton.testing.do_bench(lambda: fn(q, k, v, causal).backward(do), rep=args.rep,
                                           return_mode="median", grad_to_none=[q, k, v])
            chosen = "; ".join(f"{kn}={getattr(kern, 'best_config', '')}"
                               for kn, kern in flash_triton.TUNED_KERNELS.items()) if variant else ""
            flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
            meta = dict(provider=name, batch=b, heads=h, seq_len=n, head_dim=d, causal=causal)
            rows.append({**meta, "forward_ms": fwd, "forward_backward_ms": both, "first_call_s": first_s,
                         "forward_tflops": flops / fwd / 1e9, "fb_tflops": 3.5 * flops / both / 1e9,
                         "chosen": chosen, "device": torch.cuda.get_device_name()})
            if args.kernels:
                kernels += kernel_rows(fn, q, k, v, do, causal, meta)
            print(f"{name:14s} b{b} h{h} n{n} d{d} c{int(causal)}: fwd {fwd:.3f} ms fwd+bwd {both:.3f} ms "
                  f"first {first_s:.1f}s", file=sys.stderr, flush=True)
            del q, k, v, do
    for path, table in ((args.out, rows), (args.kernels, kernels)):
        if path and table:
            with open(path, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(table[0]))
                w.writeheader()
                w.writerows(table)


if __name__ == "__main__":
    main()
