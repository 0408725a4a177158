"""Where the Gluon kernels start to pay: FA2 against Gluon at the short end of `flash_llm_shapes`' grid (a diagnosis
for kernels/NOTES.md, "Where Gluon starts"; not a pipeline rule).

    python results/diagnosis/flash_gluon_threshold.py --seqs 1024 2048 4096 --out threshold.csv

`flash_dispatch` takes the Gluon forward and backward from 4096 keys, the shortest shape at which they were
measured faster; 2049-4095 keys and anything shorter at head dim 128 were never measured. Here each point of the
grid (the bench's shapes: inputs in a model's layout, bf16) is timed with both passes forced to FA2
(`use_flash_settings(forward="triton", backward="triton")`) and both forced to Gluon, beside SDPA's cuDNN backend,
in one process, by the bench's own timer (`timing.bench_ms`, median, the same warm-up and window as the grid).
The backward's time is forward+backward less the forward, so each pass can be chosen on its own.
"""

from __future__ import annotations

import argparse
import sys

import torch

from cs336_systems.bench.flash_bench import MIN_CALLS, LlmShapesConfig
from cs336_systems.kernels.flash_triton import FlashAttentionTriton
from cs336_systems.kernels.settings import use_flash_settings
from cs336_systems.model.attention import get_attention
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows
from cs336_systems.timing import bench_ms

KERNELS = {"fa2": "triton", "gluon": "gluon"}  # variant -> FlashSettings.forward and .backward


def time_point(fn, batch, heads, seq, head_dim, causal, config):
    q, k, v = (torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               .requires_grad_() for _ in range(3))
    do = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16)

    def forward():
        with torch.no_grad():
            fn(q, k, v, causal)

    def both():
        fn(q, k, v, causal).backward(do)

    return {p: bench_ms(call, q.device, config.warmup_ms, config.rep_ms, grad_to_none=[q, k, v], min_calls=MIN_CALLS)
            for p, call in (("forward", forward), ("forward_backward", both))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    config = LlmShapesConfig(seqs=tuple(args.seqs), head_dims=tuple(args.head_dims), providers=("sdpa_cudnn",))
    cudnn = get_attention("sdpa_cudnn")
    rows = []
    for batch, heads, seq, head_dim, causal in config.shapes():
        point = dict(batch=batch, heads=heads, seq_len=seq, head_dim=head_dim, causal=causal)
        for variant in (*KERNELS, "sdpa_cudnn"):
            try:
                if variant in KERNELS:
                    with use_flash_settings(forward=KERNELS[variant], backward=KERNELS[variant]):
                        times = time_point(FlashAttentionTriton.apply, batch, heads, seq, head_dim, causal, config)
                else:
                    times = time_point(cudnn, batch, heads, seq, head_dim, causal, config)
            except ValueError as error:  # a forced Gluon pass that cannot take the shape says why
                rows.append({**point, "variant": variant, "status": "unsupported", "note": str(error)[:200]})
                continue
            times["backward"] = times["forward_backward"] - times["forward"]
            rows += [{**point, "variant": variant, "pass": p, "median_ms": ms, "status": "ok"} for p, ms in times.items()]
            print(f"{variant:10s} b{batch} h{heads} n{seq} d{head_dim} c{int(causal)}: "
                  + " ".join(f"{p}={ms:.4f}" for p, ms in times.items()), file=sys.stderr, flush=True)
    write_rows([{**row, **provenance("cuda")} for row in rows], args.out)


if __name__ == "__main__":
    main()
