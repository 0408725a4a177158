"""Memory profiling of the model (handout 1.1.6): peak memory and an allocator snapshot per point.

For each (context length, mode, precision) it runs the harness for one measured step after warm-up
with the allocator history recorded (max_entries=1_000_000), dumps the snapshot pickle to
`--snapshot-dir/<mode>_<precision>_<context>.pickle` (with the recorded step's forward / backward /
optimizer spans under "phases", which the timelines of cs336_systems.report.memory mark), and writes
one row per point with the peak memory, the memory level at the start, maximum and end of each phase (read
from the snapshot: `forward_start_mib`, `forward_peak_mib`, …), and for a training step what its forward pass
saves for the backward (`saved_*_mib`, see `saved_for_backward`): what the activations cost in each precision.
With `--fallback-attention`, a point that runs out of memory with `--attention` is recorded (its status=oom
row) and run again with the fallback backend (the 2026 handout's xl at context 2048 does not fit a training
step with naive attention; its point with our flash attention does). CUDA only: the allocator history is a
CUDA feature.

    python -m cs336_systems.bench.memory --size 2.7B --context-lengths 128 256 512 --out results/memory.csv
    python -m cs336_systems.bench.memory --edition 2026 --size xl --context-lengths 128 2048 \
        --fallback-attention flash_triton --out results/memory_2026.csv

As a library: `memory_rows(MemoryConfig(snapshot_dir=Path("snapshots")))`.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from cs336_systems.bench import e2e
from cs336_systems.bench.checks import check_known, check_non_negative, check_not_empty, check_positive
from cs336_systems.bench.cli import add_device_argument, config_or_usage_error, non_negative_int, positive_int
from cs336_systems.model import ATTENTION_BACKENDS, SIZE_TABLES, cross_entropy, get_attention
from cs336_systems.provenance import provenance
from cs336_systems.analysis.snapshot_file import load_snapshot
from cs336_systems.analysis.snapshot import phase_levels
from cs336_systems.results import write_rows
from cs336_systems.timing import DTYPES, autocast, resolve_device

MODES = ("forward", "train_step")


@dataclass(frozen=True)
class MemoryConfig:
    """The points to record: every (context length, mode, precision) of one model size, with `attention`;
    where that runs out of memory, also with `fallback_attention` (None: no second try)."""

    snapshot_dir: Path
    size: str = "2.7B"
    edition: str = "2025"  # whose size table `size` is from
    context_lengths: tuple[int, ...] = (128, 256, 512)
    modes: tuple[str, ...] = MODES
    precisions: tuple[str, ...] = ("fp32", "bf16")
    batch_size: int = 4
    warmup: int = 2
    device: str = "cuda"
    attention: str = "naive"
    fallback_attention: str | None = None

    def __post_init__(self):
        for name in ("context_lengths", "modes", "precisions"):
            check_not_empty(name, getattr(self, name))
        e2e.check_sizes(self.edition, [self.size], self.context_lengths)
        check_known("mode", self.modes, MODES)
        check_known("precision", self.precisions, DTYPES)
        for name in filter(None, (self.attention, self.fallback_attention)):
            get_attention(name)
        if self.fallback_attention == self.attention:
            raise ValueError(f"the fallback attention must differ from --attention, got {self.attention!r} twice")
        check_positive("batch size", self.batch_size)
        check_non_negative("warm-up steps", self.warmup)
        if resolve_device(self.device).type != "cuda":
            raise ValueError(f"memory snapshots need a CUDA device, got device {self.device!r}")


def memory_rows(config: MemoryConfig) -> list[dict]:
    """One row per point (the harness's step row, peak memory included), the snapshot pickles in
    `config.snapshot_dir`; a point that runs out of memory is its OOM row, with no snapshot, followed by the
    point with the fallback attention where there is one."""
    Path(config.snapshot_dir).mkdir(parents=True, exist_ok=True)
    rows = []
    for context, mode, precision in itertools.product(config.context_lengths, config.modes, config.precisions):
        for attention in filter(None, (config.attention, config.fallback_attention)):
            row = memory_point(config, context, mode, precision, attention)
            rows.append(row)
            if row["status"] != "oom":
                break
    return rows


def memory_point(config: MemoryConfig, context: int, mode: str, precision: str, attention: str) -> dict:
    """The row of one point: its step row, the phase levels of its snapshot and, for a training step, what
    its forward saves for the backward."""
    # the 2025 runs' file names stay as they were; another backend's snapshot carries its name
    suffix = "" if attention == "naive" else f"_{attention}"
    snapshot = Path(config.snapshot_dir) / f"{mode}_{precision}_{context}{suffix}.pickle"
    spec = e2e.RunSpec(size=config.size, mode=mode, precision=precision, attention=attention,
                       batch_size=config.batch_size, context_length=context, warmup=config.warmup, steps=1,
                       device=config.device, memory_snapshot=str(snapshot), size_table=config.edition)
    step = [r for r in e2e.run(spec) if r["phase"] == "step"][0]
    extra = {}
    if step["status"] == "ok":
        extra = phase_levels(load_snapshot(snapshot))
        if mode == "train_step":
            extra |= saved_for_backward(spec)
    print(f"{config.edition}:{config.size} {mode} {precision} ctx={context} {attention}: {step['status']} "
          f"{step.get('peak_memory_mib', '')}", file=sys.stderr, flush=True)
    return {**step, "snapshot": snapshot.name if step["status"] == "ok" else "", **extra,
            **provenance(config.device)}


def saved_for_backward(spec: e2e.RunSpec) -> dict[str, float]:
    """What one forward pass of `spec` (loss included, the model built as e2e builds it) saves for the
    backward, in MiB of distinct storages (a tensor saved by two ops, or a view of one, counts once):

    - `saved_activations_mib`: tensors computed from the inputs (`saved_fp32_activations_mib` of them float32);
    - `saved_weight_copies_mib`: copies of parameters, which autocast makes when it casts a float32 weight
      to the compute dtype and which the matmul keeps for the input gradient (float32 runs save the
      parameters themselves: resident anyway, counted in neither column).

    A copy is told by its autograd history: the saved tensor, or the tensor it is a view of, comes from
    a dtype conversion (ToCopyBackward0) of a parameter (or of a view of one)."""
    device = resolve_device(spec.device)
    torch.manual_seed(0)
    model = e2e.build_model(spec, device)
    tokens = torch.randint(model.config.vocab_size, (spec.batch_size, spec.context_length + 1), device=device)

    def forward() -> torch.Tensor:
        with autocast(spec.precision, device):
            return cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])

    return saved_mib(forward, model.parameters())


def saved_mib(forward: Callable[[], torch.Tensor], parameters: Iterable[torch.Tensor]) -> dict[str, float]:
    """`saved_for_backward`'s columns for any `forward()` over `parameters` (its output is dropped)."""
    resident = {p.untyped_storage().data_ptr() for p in parameters}
    storages: dict[int, tuple[int, str]] = {}  # storage address -> (bytes, kind)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in resident:
            kind = ("weight copy" if _is_parameter_copy(tensor, resident) else
                    "fp32 activation" if tensor.dtype == torch.float32 else "activation")
            storages.setdefault(storage.data_ptr(), (storage.nbytes(), kind))
        # Detached: a saved output packed as itself holds its own grad_fn, a cycle through autograd's C++
        # graph that Python's collector cannot see, so the whole model leaked with it (on the H100 every
        # later point of the profile ran out of memory).
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    total = {kind: sum(n for n, k in storages.values() if k == kind) / 2**20
             for kind in ("weight copy", "fp32 activation", "activation")}
    return {"saved_activations_mib": total["fp32 activation"] + total["activation"],
            "saved_fp32_activations_mib": total["fp32 activation"],
            "saved_weight_copies_mib": total["weight copy"]}


def _is_parameter_copy(tensor: torch.Tensor, parameters: set[int]) -> bool:
    """Whether `tensor` is a dtype conversion (ToCopyBackward0) of a parameter, views allowed on either side:
    autocast casts the Wᵀ view that `x @ W.T` multiplies, and a matmul may save a view of its operand."""
    function = _through_views(tensor.grad_fn)
    if function is None or function.name() != "ToCopyBackward0":
        return False
    source = _through_views(function.next_functions[0][0])
    variable = getattr(source, "variable", None)  # an AccumulateGrad node: the leaf it accumulates into
    return variable is not None and variable.untyped_storage().data_ptr() in parameters


VIEWS = ("TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "ExpandBackward0",
         "AliasBackward0", "UnsafeViewBackward0")


def _through_views(function):
    while function is not None and function.name() in VIEWS:
        function = function.next_functions[0][0]
    return function


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    e2e.add_edition_argument(parser)
    parser.add_argument("--size", default="2.7B", help="model size of the --edition table: " + "; ".join(
        f"{edition}: {', '.join(table)}" for edition, table in SIZE_TABLES.items()))
    parser.add_argument("--context-lengths", nargs="+", type=positive_int, default=[128, 256, 512],
                        help="tokens per sequence, one point each (2025 sizes: at most 1024)")
    parser.add_argument("--attention", default="naive", choices=sorted(ATTENTION_BACKENDS),
                        help="attention backend (cs336_systems.model.attention): %(choices)s")
    parser.add_argument("--fallback-attention", default=None, choices=sorted(ATTENTION_BACKENDS),
                        help="run a point that is out of memory with --attention again with this backend")
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
        parser, MemoryConfig, snapshot_dir=args.snapshot_dir, size=args.size, edition=args.edition,
        attention=args.attention, fallback_attention=args.fallback_attention,
        context_lengths=tuple(args.context_lengths), modes=tuple(args.modes), precisions=tuple(args.precisions),
        batch_size=args.batch_size, warmup=args.warmup, device=args.device)
    write_rows(memory_rows(config), args.out)


if __name__ == "__main__":
    main()
