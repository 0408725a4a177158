"""The persistent Gluon forward's schedule: heads per group against load balance and L2 (issue #26).

    python results/diagnosis/flash_gluon_groups.py --out FILE.csv [--groups 1 2 4 ...] [--shapes 1x16x16384x128c ...]

`flash_gluon_tile_overhead.py` (2a65729) found the causal forward's time per tile ~2.7 key steps above the
non-causal one's. The cause it points at is the schedule, not the kernel: `persistent_schedule` list-schedules the
tiles in `program_order`, one head after another (then HEADS_PER_GROUP = 1), heaviest first within the head, so the last
head's heaviest tiles are placed when every program is nearly full. With few tiles per SM the walks end unevenly:
the cost model predicts the longest walk at 1.03-1.37x the mean at the grid's causal points with at most 31 tiles per
SM (1.11x at 1 x 16 x 8192). Groups of G heads, rank-major within a group, place the heavy tiles of G heads first and
balance better; they also put G heads' keys and values in flight at once, which the one-tile grid measured as slower
(kernels/NOTES.md, "Gluon forward"). This measures both at once: per shape and group, the forward kernel's device
time (torch.profiler, mean of 10 calls), beside the schedule's predicted balance (longest walk / mean walk, from the
cost model) and cuDNN's kernel at the same inputs; `default_group` is what `heads_per_group` gives the shape (the
rule that came of this run's first version). Rows go to --out with provenance.
"""

import argparse
from pathlib import Path

import torch

from cs336_systems.kernels import flash_gluon
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows

from flash_gluon_tile_overhead import kernel_ms  # this folder is on sys.path as a script's
from flash_short_calls import parse_shape

# (batch, heads, seq, head dim, causal): the grid's Gluon points up to 8192 keys, and two long ones as controls
SHAPES = ([(b, 32, n, 128, True) for b, n in ((8, 1024), (16, 1024), (2, 2048), (8, 2048), (1, 4096), (4, 4096),
                                               (1, 8192), (2, 8192), (8, 8192))]
          + [(b, 16, n, 64, True) for b, n in ((4, 2048), (32, 2048), (1, 4096), (4, 4096), (16, 4096), (1, 8192),
                                               (4, 8192))]
          + [(2, 32, 32768, 128, True), (8, 32, 2048, 128, False), (1, 16, 8192, 64, False)])


def predicted_balance(batch, heads, seq, head_dim, causal, group, programs) -> float:
    tile = flash_gluon.tile_for(head_dim)
    works = flash_gluon.tile_works(seq, seq, batch * heads, group, tile, causal)
    walks = flash_gluon.persistent_schedule(works, programs)
    loads = [sum(works[p] for p in walk) for walk in walks]
    return max(loads) / (sum(loads) / len(loads))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=SHAPES, help="BxHxNxD[c] each")
    args = parser.parse_args()
    prov = provenance("cuda")
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch, heads, seq, dim, causal in args.shapes:
        q, k, v = (torch.randn(batch, seq, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                   for _ in range(3))  # the model's layout
        shape = {"batch": batch, "heads": heads, "seq_len": seq, "head_dim": dim, "causal": causal,
                 "default_group": flash_gluon.heads_per_group(seq, causal, flash_gluon.tile_for(dim).persistent)}
        cudnn = kernel_ms(lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, False, 0.0, causal, False), "")
        for group in [g for g in args.groups if g <= batch * heads]:
            ms = kernel_ms(lambda: flash_gluon._forward(q, k, v, causal, group=group), "flash_fwd_gluon")
            balance = predicted_balance(batch, heads, seq, dim, causal, group, programs)
            print(f"{batch}x{heads}x{seq}x{dim}{'c' if causal else ''} group={group:3d} {ms:.4f} ms "
                  f"(cuDNN {cudnn:.4f}, ratio {ms / cudnn:.3f}) predicted balance {balance:.3f}", flush=True)
            rows.append({**shape, "group": group, "kernel_ms": ms, "cudnn_kernel_ms": cudnn,
                         "predicted_balance": balance, **prov})
        q = k = v = None  # freed before the next shape
    write_rows(rows, args.out)


if __name__ == "__main__":
    main()
