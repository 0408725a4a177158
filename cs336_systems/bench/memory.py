"""Memory profiling of the model (handout 1.1.6): peak memory and an allocator snapshot per point.

For each (context length, mode, precision) it runs the harness for one measured step after warm-up
with the allocator history recorded (max_entries=1_000_000), dumps the snapshot pickle to
`--snapshot-dir/<mode>_<precision>_<context>.pickle` (with the recorded step's forward / backward /
optimizer spans under "phases", which the timelines of cs336_systems.report.memory mark), and writes
one row per point with the peak memory. CUDA only: the allocator history is a CUDA feature.

    python -m cs336_systems.bench.memory --size 2.7B --context-lengths 128 256 512 --out results/memory.csv

As a library: `memory_rows(MemoryConfig(snapshot_dir=Path("snapshots")))`.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

from cs336_systems.bench import e2e
from cs336_systems.bench.checks import check_known, check_non_negative, check_not_empty, check_positive
from cs336_systems.bench.cli import add_device_argument, config_or_usage_error, non_negative_int, positive_int
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows
from cs336_systems.timing import DTYPES, resolve_device
from cs336_systems.model import MODEL_SIZES

MODES = ("forward", "train_step")


@dataclass(frozen=True)
class MemoryConfig:
    """The points to record: every (context length, mode, precision) of one model size."""

    snapshot_dir: Path
    size: str = "2.7B"
    context_lengths: tuple[int, ...] = (128, 256, 512)
    modes: tuple[str, ...] = MODES
    precisions: tuple[str, ...] = ("fp32", "bf16")
    batch_size: int = 4
    warmup: int = 2
    device: str = "cuda"

    def __post_init__(self):
        for name in ("context_lengths", "modes", "precisions"):
            check_not_empty(name, getattr(self, name))
        check_known("model size", [self.size], MODEL_SIZES)
        check_known("mode", self.modes, MODES)
        check_known("precision", self.precisions, DTYPES)
        check_positive("context length", *self.context_lengths)
        check_positive("batch size", self.batch_size)
        check_non_negative("warm-up steps", self.warmup)
        if resolve_device(self.device).type != "cuda":
            raise ValueError(f"memory snapshots need a CUDA device, got device {self.device!r}")


def memory_rows(config: MemoryConfig) -> list[dict]:
    """One row per point (the harness's step row, peak memory included), the snapshot pickles in
    `config.snapshot_dir`; a point that runs out of memory is its OOM row, with no snapshot."""
    Path(config.snapshot_dir).mkdir(parents=True, exist_ok=True)
    rows = []
    for context, mode, precision in itertools.product(config.context_lengths, config.modes, config.precisions):
        snapshot = Path(config.snapshot_dir) / f"{mode}_{precision}_{context}.pickle"
        spec = e2e.RunSpec(size=config.size, mode=mode, precision=precision, attention="naive",
                           batch_size=config.batch_size, context_length=context, warmup=config.warmup, steps=1,
                           device=config.device, memory_snapshot=str(snapshot))
        step = [r for r in e2e.run(spec) if r["phase"] == "step"][0]
        rows.append({**step, "snapshot": snapshot.name if step["status"] == "ok" else "",
                     **provenance(config.device)})
        print(f"{mode} {precision} ctx={context}: {step['status']} {step.get('peak_memory_mib', '')}",
              file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="2.7B", help=f"model size: {', '.join(MODEL_SIZES)}")
    parser.add_argument("--context-lengths", nargs="+", type=positive_int, default=[128, 256, 512],
                        help="tokens per sequence, one point each")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                        help="forward (inference) and/or train_step (forward, backward, AdamW)")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES),
                        help="fp32, or autocast to bf16 / fp16")
    parser.add_argument("--batch-size", type=positive_int, default=4, help="sequences per step")
    parser.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps before the recorded one")
    parser.add_argument("--snapshot-dir", required=True, type=Path, help="folder for the snapshot pickles")
    add_device_argument(parser)
    parser.add_argument("--out", required=True, help="CSV file for the rows")
    args = parser.parse_args(argv)
    config = config_or_usage_error(
        parser, MemoryConfig, snapshot_dir=args.snapshot_dir, size=args.size,
        context_lengths=tuple(args.context_lengths), modes=tuple(args.modes), precisions=tuple(args.precisions),
        batch_size=args.batch_size, warmup=args.warmup, device=args.device)
    write_rows(memory_rows(config), args.out)


if __name__ == "__main__":
    main()
