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
rule that came of this run's first version). Rows go to --out with provenance. With --rounds N every shape is timed
N times over, cuDNN and the groups alternating within a round, and a summary gives each group's median ratio to
one head's time in the same round, with the rounds' range.
"""

import argparse
import statistics
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
    parser.add_argument("--rounds", type=int, default=1, help="times over each shape, groups alternating")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1")
    prov = provenance("cuda")
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch, heads, seq, dim, causal in args.shapes:
        q, k, v = (torch.randn(batch, seq, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                   for _ in range(3))  # the model's layout
        name = f"{batch}x{heads}x{seq}x{dim}{'c' if causal else ''}"
        shape = {"batch": batch, "heads": heads, "seq_len": seq, "head_dim": dim, "causal": causal,
                 "default_group": flash_gluon.heads_per_group(seq, causal, flash_gluon.tile_for(dim).persistent)}
        groups = [g for g in args.groups if g <= batch * heads]
        balances = {g: predicted_balance(batch, heads, seq, dim, causal, g, programs) for g in groups}
        for round_ in range(args.rounds):
            cudnn = kernel_ms(lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, False, 0.0, causal, False), "")
            for group in groups:
                ms = kernel_ms(lambda: flash_gluon._forward(q, k, v, causal, group=group), "flash_fwd_gluon")
                print(f"{name} round {round_} group={group:3d} {ms:.4f} ms (cuDNN {cudnn:.4f}, ratio "
                      f"{ms / cudnn:.3f}) predicted balance {balances[group]:.3f}", flush=True)
                rows.append({**shape, "round": round_, "group": group, "kernel_ms": ms, "cudnn_kernel_ms": cudnn,
                             "predicted_balance": balances[group], **prov})
        summarise(name, [r for r in rows if r["seq_len"] == seq and (r["batch"], r["heads"], r["head_dim"],
                                                                      r["causal"]) == (batch, heads, dim, causal)])
        q = k = v = None  # freed before the next shape
    write_rows(rows, args.out)


def summarise(name: str, rows: list[dict]) -> None:
    """Per group: the median over rounds of its time ÷ one head's in the same round (min-max), and ÷ cuDNN's."""
    one_head = {r["round"]: r["kernel_ms"] for r in rows if r["group"] == 1}
    for group in sorted({r["group"] for r in rows}):
        mine = [r for r in rows if r["group"] == group]
        to_cudnn = statistics.median(r["kernel_ms"] / r["cudnn_kernel_ms"] for r in mine)
        text = f"{name} group={group:3d} ÷ cuDNN {to_cudnn:.3f}"
        if one_head:
            ratios = [r["kernel_ms"] / one_head[r["round"]] for r in mine]
            text += f", ÷ one head {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
        print("summary:", text, flush=True)


if __name__ == "__main__":
    main()
