"""Memory profiling of the model (handout 1.1.6): peak memory and an allocator snapshot per point.

For each (context length, mode, precision) it runs the harness for one measured step after warm-up
with the allocator history recorded (max_entries=1_000_000), dumps the snapshot pickle to
`--snapshot-dir/<mode>_<precision>_<context>.pickle`, and writes one row per point with the peak
memory. CUDA only: the allocator history is a CUDA feature.

    python -m cs336_systems.bench.memory --size 2.7B --context-lengths 128 256 512 --out results/memory.csv
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from cs336_systems.bench import e2e
from cs336_systems.bench.cli import add_device_argument, device_from_args, positive_int
from cs336_systems.bench.provenance import provenance
from cs336_systems.bench.results import write_rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="2.7B")
    parser.add_argument("--context-lengths", nargs="+", type=int, default=[128, 256, 512])
    parser.add_argument("--modes", nargs="+", default=["forward", "train_step"], choices=["forward", "train_step"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--batch-size", type=positive_int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--snapshot-dir", required=True)
    add_device_argument(parser)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = device_from_args(parser, args.device)
    if device.type != "cuda":
        parser.error(f"memory snapshots need a CUDA device, got --device {args.device}")
    Path(args.snapshot_dir).mkdir(parents=True, exist_ok=True)
    rows = []
    for context, mode, precision in itertools.product(args.context_lengths, args.modes, args.precisions):
        snapshot = Path(args.snapshot_dir) / f"{mode}_{precision}_{context}.pickle"
        spec = e2e.RunSpec(size=args.size, mode=mode, precision=precision, attention="naive", compile=False,
                           batch_size=args.batch_size, context_length=context, warmup=args.warmup, steps=1,
                           device=args.device, memory_snapshot=str(snapshot))
        step = [r for r in e2e.run(spec) if r["phase"] == "step"][0]
        rows.append({**step, "snapshot": snapshot.name if step["status"] == "ok" else "", **provenance(device)})
        print(f"{mode} {precision} ctx={context}: {step['status']} {step.get('peak_memory_mib', '')}",
              file=sys.stderr, flush=True)
    write_rows(rows, args.out)


if __name__ == "__main__":
    main()
