"""The FA2 backward with D = rowsum(dO ∘ O) computed in its dQ kernel (two launches) against the backward with a
kernel of its own for D (three launches), both passes forced to FA2.

    PYTHONPATH=TREE python results/diagnosis/flash_fa2_delta.py --label LABEL --out ROWS.csv [--shapes ...]

Run it once per tree (this one, and `git archive` of the commit before the change unpacked beside it), alternating,
on one machine: the rows of each run carry its label and commit. Per shape (bf16, the model's layout):
- `backward_ms`: the backward alone (`out.backward(dO, retain_graph=True)`), do_bench median, L2 flushed;
- `fb_ms`: forward+backward, the grid's statistic;
- `fb_sync_us`: forward+backward wall time with a synchronisation after each call (median of 200);
- `bwd_kernel_us`, `bwd_kernels`: the backward's summed kernel time and its kernel count (torch.profiler, mean of
  10 calls).
"""

import argparse
from pathlib import Path

import torch
from flash_short_calls import parse_shape, sync_us  # this folder is on sys.path as a script's

from cs336_systems.kernels.settings import use_flash_settings
from cs336_systems.model.attention import get_attention
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows
from cs336_systems.timing import bench_ms

SHAPES = ["1x16x512x64c", "1x16x1024x128c", "4x16x1024x64c", "16x16x1024x64", "32x16x1024x64c", "32x16x2048x64c",
          "8x32x1024x128"]


def backward_kernels(call, n=10) -> tuple[float, float]:
    """Mean summed kernel time (us) and mean kernel count of `call`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / n, len(kernels) / n


def measure(shape) -> dict:
    batch, heads, seq, dim, causal = shape
    q, k, v = (torch.randn(batch, seq, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               .requires_grad_() for _ in range(3))
    do = torch.randn_like(q)
    attend = get_attention("flash_triton")
    out = attend(q, k, v, causal)

    def backward():
        out.backward(do, retain_graph=True)

    def both():
        attend(q, k, v, causal).backward(do)

    for _ in range(5):  # compile and autotune
        both()
    wall_us = sync_us(both)
    kernel_us, kernels = backward_kernels(backward)
    return {"batch": batch, "heads": heads, "seq_len": seq, "head_dim": dim, "causal": causal,
            "backward_ms": bench_ms(backward, q.device, 50, 200, grad_to_none=[q, k, v], min_calls=10),
            "fb_ms": bench_ms(both, q.device, 50, 200, grad_to_none=[q, k, v], min_calls=10),
            "fb_sync_us": wall_us, "bwd_kernel_us": kernel_us, "bwd_kernels": kernels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="which tree this run imports (a column of its rows)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=[parse_shape(s) for s in SHAPES])
    args = parser.parse_args()
    prov = provenance("cuda")
    rows = []
    with use_flash_settings(forward="triton", backward="triton"):
        for shape in args.shapes:
            row = {"label": args.label, **measure(shape), **prov}
            print({key: row[key] for key in ("label", "batch", "heads", "seq_len", "head_dim", "causal", "backward_ms",
                                             "fb_ms", "fb_sync_us", "bwd_kernel_us", "bwd_kernels")}, flush=True)
            rows.append(row)
    write_rows(rows, args.out)


if __name__ == "__main__":
    main()
