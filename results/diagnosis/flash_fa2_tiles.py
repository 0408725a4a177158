"""Does the FA2 kernels' tile choice depend on batch x heads? (issue #26, the grid's short and mid-size FA2 points)

    python results/diagnosis/flash_fa2_tiles.py --out ROWS.csv [--seqs 512 1024 2048] [--head-dims 64 128]
        [--batch-heads 16 64 256 512]

Until f634041 the FA2 kernels were autotuned once per shape bucket (flash_tuning.TUNING_KEY: the lengths rounded up
to powers of two, the head dim, causality, precision), without batch x heads. `flash_llm_shapes` walks each bucket
from 16 batch x heads upwards, so the tile tuned at 16 (few programs: 64 to 256 on 132 SMs) is the one every larger
call of the bucket runs. This asks what that costs. For each shape (bf16, the model's layout, both passes forced to
FA2) it empties the three kernels' autotuning caches and runs one forward and backward, so that each kernel is tuned
at this very shape, and records the autotuner's timing of every tile (`configs_timings`: do_bench median, L2
flushed before each call, so a short kernel's host time hides behind the flush). One row per shape, kernel and tile;
`chosen` marks the tile tuned at this shape. Then, per shape and kernel, the summary (stdout; stderr as it goes): the
time of the tile that the bucket's first (smallest) shape chose, over the best tile's time at this shape. The shapes
are the grid's own (`LlmShapesConfig.shapes`), in its order.
"""

import argparse
import sys
from pathlib import Path

import torch

from cs336_systems.bench.flash_bench import LlmShapesConfig
from cs336_systems.kernels import flash_triton
from cs336_systems.kernels.flash_tuning import TILINGS, tile_of
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows


def tune_at(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> list[dict]:
    """Every kernel's tile timings, tuned afresh at this shape."""
    for kernel in flash_triton.TUNED_KERNELS.values():
        kernel.cache.clear()
        kernel.cache_results = False  # no disk cache: tune here, now
    for launcher in flash_triton.LAUNCH.values():
        launcher.clear()  # and every plan (launch.on_clear)
    q, k, v = (torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               for _ in range(3))
    do = torch.randn_like(q)
    out, lse = flash_triton.flash_forward_triton(q, k, v, causal)
    flash_triton.flash_backward_triton(q, k, v, out, lse, do, causal)
    torch.cuda.synchronize()
    rows = []
    for name, kernel in flash_triton.TUNED_KERNELS.items():
        tiling = TILINGS[name]
        chosen = tile_of(kernel.best_config, tiling.outer, tiling.inner)
        for config, timing in kernel.configs_timings.items():
            tile = tile_of(config, tiling.outer, tiling.inner)
            ms = timing[0] if isinstance(timing, (list, tuple)) else timing
            rows.append({"batch": batch, "heads": heads, "seq_len": seq, "head_dim": head_dim, "causal": causal,
                         "kernel": name, "tile": "x".join(map(str, tile)), "ms": ms, "chosen": tile == chosen})
    return rows


def summary(rows: list[dict]) -> list[str]:
    """Per shape and kernel: the first shape of its bucket's chosen tile, timed here, over the best tile here."""
    lines = []
    first: dict[tuple, str] = {}  # (seq, head dim, causal, kernel) -> the tile chosen at the bucket's first shape
    by_shape: dict[tuple, list[dict]] = {}
    for row in rows:
        by_shape.setdefault((row["batch"], row["heads"], row["seq_len"], row["head_dim"], row["causal"],
                             row["kernel"]), []).append(row)
    for (batch, heads, seq, dim, causal, kernel), group in by_shape.items():
        bucket = (seq, dim, causal, kernel)
        chosen = next(r["tile"] for r in group if r["chosen"])
        first.setdefault(bucket, chosen)
        times = {r["tile"]: r["ms"] for r in group}
        best = min(times.values())
        lines.append(f"{batch}x{heads}x{seq}x{dim}{'c' if causal else ''} {kernel:14s} best {chosen:>12s} "
                     f"{best:.4f} ms; first shape's {first[bucket]:>12s} {times[first[bucket]] / best:.3f}x")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--batch-heads", type=int, nargs="+", default=[16, 64, 256, 512])
    args = parser.parse_args()
    grid = LlmShapesConfig(batch_heads=tuple(sorted(args.batch_heads)), seqs=tuple(args.seqs),
                           head_dims=tuple(args.head_dims))
    rows, meta = [], provenance("cuda")
    for shape in grid.shapes():  # within a bucket, batch x heads ascending, as the grid runs them
        rows += tune_at(*shape)
        print("\n".join(summary(rows)[-3:]), file=sys.stderr, flush=True)
        write_rows([{**row, **meta} for row in rows], args.out)  # after each shape: a timeout keeps the rest
    print("\n".join(summary(rows)), flush=True)


if __name__ == "__main__":
    main()
