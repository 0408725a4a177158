"""A/B of FlashAttention kernel variants on one GPU (diagnosis for the kernel notes, not a pipeline rule).

Run once per variant (the variant is fixed per process by CS336_FLASH_DQ / CS336_FLASH_WARP_SPECIALIZE):
    CS336_FLASH_DQ=separate python results/diagnosis/flash_variants.py --tag separate --out a.csv
Each shape is laid out as a model produces it ((batch, seq, heads, dim) viewed as (batch, heads, seq, dim));
our kernel, SDPA flash and SDPA cuDNN are timed in the same process (median of do_bench), with the
first call's wall time (autotuning included) and the tile configs the autotuner chose.
"""

import argparse
import csv
import sys
import time

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from cs336_systems.kernels import flash_triton, flash_tuning
from cs336_systems.kernels.flash_triton import FlashAttentionTriton

SHAPES = [  # (batch, heads, seq, head_dim, causal)
    (1, 16, 16384, 64, True),   # the 2025 leaderboard case (batch·heads 16)
    (1, 32, 32768, 128, True),  # the 8B model's attention per GPU
    (8, 16, 2048, 128, True),
    (16, 16, 1024, 64, False),
    (4, 32, 4096, 128, False),
    (32, 16, 512, 64, True),
]


def sdpa(backend):
    def fn(q, k, v, causal):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fn


PROVIDERS = {"ours": FlashAttentionTriton.apply, "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
             "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--providers", nargs="+", default=list(PROVIDERS))
    ap.add_argument("--rep", type=int, default=300)
    args = ap.parse_args()
    rows = []
    for b, h, n, d, causal in SHAPES:
        for name in args.providers:
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
                       for _ in range(3))
            do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
            fn = PROVIDERS[name]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(q, k, v, causal).backward(do)
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            fwd = triton.testing.do_bench(lambda: fn(q, k, v, causal), rep=args.rep, return_mode="median")
            both = triton.testing.do_bench(lambda: fn(q, k, v, causal).backward(do), rep=args.rep,
                                           return_mode="median", grad_to_none=[q, k, v])
            chosen = ""
            if name == "ours":
                chosen = "; ".join(f"{kn}={getattr(kern, 'best_config', '')}"
                                   for kn, kern in flash_triton.TUNED_KERNELS.items())
            flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
            row = dict(tag=args.tag, provider=name, batch=b, heads=h, seq_len=n, head_dim=d, causal=causal,
                       forward_ms=fwd, forward_backward_ms=both, first_call_s=first_s,
                       forward_tflops=flops / fwd / 1e9, fb_tflops=3.5 * flops / both / 1e9,
                       dq_mode=flash_tuning.DQ_MODE, warp_spec=flash_tuning.WARP_SPECIALIZE, chosen=chosen,
                       device=torch.cuda.get_device_name())
            rows.append(row)
            print(f"{args.tag:10s} {name:10s} b{b} h{h} n{n} d{d} c{int(causal)}: fwd {fwd:.3f} ms "
                  f"fwd+bwd {both:.3f} ms first {first_s:.1f}s {chosen}", file=sys.stderr, flush=True)
            del q, k, v, do
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
