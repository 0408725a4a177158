"""What each Transformer block saves for the backward, and what its backward gives back (handout 2026,
memory_profiling (f)).

The handout reads these from Nsight Systems' memory tracks under PyTorch's NVTX labels; here the same
quantities are counted where they arise, for one training forward and backward of the whole model:

- residuals: during block i's forward, every tensor autograd saves (`saved_tensors_hooks`) whose storage
  is new, i.e. neither a parameter nor a buffer of the model, is charged to block i, each storage once
  (a tensor saved by two ops, or a view of a saved tensor, counts once: the memory held, not the tensors).
  The block's input, which its first norm saves, is the block's; its output is the next block's.
- the op that made each residual: the ATen op whose output is that storage (a `TorchDispatchMode` sees
  every op below autograd and autocast, so an autocast copy of a weight is `aten::_to_copy`). Per block,
  one row per op with its bytes and share of the block's residuals (`rank` 1 = the largest).
- gradients: the bytes of the block's parameter gradients after the backward (`gradient_mib`), and, on
  CUDA, the handout's derivation of the same number from memory levels: `backward_delta_mib` is the change
  of allocated memory across the block's backward (from the gradient of its output to that of its input,
  read in tensor hooks), in which the block's residuals are freed and its gradients allocated, so
  `implied_gradient_mib = backward_delta_mib + residual_mib` (NaN on a CPU, whose allocator keeps no
  count).

Out-of-memory is a status=oom row; with `--fallback-attention` the point is run again with that backend.

    python -m cs336_systems.bench.block_memory --edition 2026 --size xl --context-lengths 128 2048 \\
        --fallback-attention flash_triton --out results/block_memory_2026.csv
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cs336_systems.bench import e2e
from cs336_systems.bench.checks import check_known, check_not_empty, check_positive
from cs336_systems.bench.cli import add_device_argument, config_or_usage_error, positive_int
from cs336_systems.model import ATTENTION_BACKENDS, SIZE_TABLES, cross_entropy, get_attention
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows
from cs336_systems.timing import DTYPES, autocast, is_oom, oom_row, reset_memory, resolve_device

MIB = 2**20


class _Producers(TorchDispatchMode):
    """storage address -> the ATen op that allocated it, for every op run under the mode. Views, in-place
    ops and ops returning an input's storage (`_unsafe_view`, which is not marked a view) allocate nothing
    and are skipped; a later op at a reused address overwrites the earlier entry."""

    def __init__(self):
        super().__init__()
        self.ops: dict[int, str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func._schema.is_mutable:
            return out
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                address = t.untyped_storage().data_ptr()
                if address not in inputs:
                    self.ops[address] = f"{func.namespace}::{func.overloadpacket.__name__}"
        return out


@contextmanager
def _block_scopes(blocks) -> Iterator[dict]:
    """{"block": index of the block whose forward runs now, or None} kept by forward hooks."""
    current = {"block": None}

    def enter(i):
        return lambda module, args: current.update(block=i)

    handles = [h for i, block in enumerate(blocks) for h in (
        block.register_forward_pre_hook(enter(i)),
        block.register_forward_hook(lambda module, args, out: current.update(block=None)))]
    try:
        yield current
    finally:
        for h in handles:
            h.remove()


def _backward_marks(blocks, device: torch.device) -> tuple[list, dict]:
    """Forward hooks that put tensor hooks on each block's input ("end": its gradient is the last thing
    the block's backward makes) and output ("start"), each recording the allocated memory then."""
    marks: dict[tuple[int, str], int] = {}

    def record(i, edge):
        def hook(grad):
            marks[(i, edge)] = torch.cuda.memory_allocated(device) if device.type == "cuda" else -1
        return hook

    def on_input(i):
        def pre(module, args):
            if args[0].requires_grad:
                args[0].register_hook(record(i, "end"))
        return pre

    def on_output(i):
        def post(module, args, out):
            out.register_hook(record(i, "start"))
        return post

    handles = [h for i, block in enumerate(blocks) for h in (
        block.register_forward_pre_hook(on_input(i)), block.register_forward_hook(on_output(i)))]
    return handles, marks


def measure(spec: e2e.RunSpec) -> tuple[list[dict], list[dict]]:
    """(block rows, op rows) of one forward and backward of the model `spec` builds."""
    device = resolve_device(spec.device)
    torch.manual_seed(0)
    model = e2e.build_model(spec, device)
    blocks = list(model.layers)
    resident = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    tokens = torch.randint(model.config.vocab_size, (spec.batch_size, spec.context_length + 1), device=device)
    saved: dict[int, tuple[int, int, str]] = {}  # storage address -> (block, bytes, op)
    producers = _Producers()
    handles, marks = _backward_marks(blocks, device)

    with _block_scopes(blocks) as current:
        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            address = storage.data_ptr()
            if current["block"] is not None and storage.nbytes() and address not in resident:
                saved.setdefault(address, (current["block"], storage.nbytes(), producers.ops.get(address, "unknown")))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), producers, autocast(spec.precision, device):
            loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    for h in handles:
        h.remove()
    return _rows(blocks, saved, marks, device)


def _rows(blocks, saved: dict, marks: dict, device: torch.device) -> tuple[list[dict], list[dict]]:
    block_rows, op_rows = [], []
    for i, block in enumerate(blocks):
        mine = [(n, op) for b, n, op in saved.values() if b == i]
        residual = sum(n for n, _ in mine)
        by_op: dict[str, list[int]] = {}
        for n, op in mine:
            by_op.setdefault(op, []).append(n)
        ranked = sorted(by_op.items(), key=lambda item: -sum(item[1]))
        op_rows += [{"kind": "op", "block": i, "op": op, "rank": rank, "tensors": len(sizes),
                     "mib": sum(sizes) / MIB, "share": sum(sizes) / residual}
                    for rank, (op, sizes) in enumerate(ranked, 1)]
        gradient = sum(p.grad.nbytes for p in block.parameters() if p.grad is not None)
        delta = (marks[(i, "end")] - marks[(i, "start")]) / MIB if device.type == "cuda" else float("nan")
        block_rows.append({"kind": "block", "block": i, "tensors": len(mine), "residual_mib": residual / MIB,
                           "gradient_mib": gradient / MIB, "backward_delta_mib": delta,
                           "implied_gradient_mib": delta + residual / MIB})
    return block_rows, op_rows


def run(spec: e2e.RunSpec) -> list[dict]:
    """The point's rows (blocks first, then ops), or its one status=oom row."""
    device = resolve_device(spec.device)
    config = SIZE_TABLES[spec.size_table][spec.size]
    base = {key: value for key, value in spec.columns().items()
            if key not in ("compile", "compile_scope", "memory_snapshot", "optimizer", "model", "warmup", "steps")}
    base |= {"d_model": config.d_model, "d_ff": config.d_ff, "num_layers": config.num_layers,
             "num_heads": config.num_heads}
    reset_memory(device)
    try:
        block_rows, op_rows = measure(spec)
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if not is_oom(error):
            raise
        row = oom_row({**base, "kind": "point"}, error)
    else:
        return [{**base, **row, "status": "ok"} for row in block_rows + op_rows]
    reset_memory(device)  # after the except block, so the traceback no longer holds the model
    return [row]


@dataclass(frozen=True)
class BlockMemoryConfig:
    """Every context length of one size; a point out of memory with `attention` is run again with
    `fallback_attention` (None: no second try)."""

    size: str = "xl"
    edition: str = "2026"
    context_lengths: tuple[int, ...] = (128, 2048)
    batch_size: int = 4
    precision: str = "fp32"
    attention: str = "naive"
    fallback_attention: str | None = None
    device: str = field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")

    def __post_init__(self):
        check_not_empty("context lengths", self.context_lengths)
        e2e.check_sizes(self.edition, [self.size], self.context_lengths)
        check_known("precision", [self.precision], DTYPES)
        check_positive("batch size", self.batch_size)
        for name in filter(None, (self.attention, self.fallback_attention)):
            get_attention(name)
        if self.fallback_attention == self.attention:
            raise ValueError(f"the fallback attention must differ from --attention, got {self.attention!r} twice")
        resolve_device(self.device)


def block_memory_rows(config: BlockMemoryConfig) -> list[dict]:
    prov = provenance(config.device)
    rows = []
    for context in config.context_lengths:
        for attention in filter(None, (config.attention, config.fallback_attention)):
            spec = e2e.RunSpec(size=config.size, mode="forward_backward", precision=config.precision,
                               attention=attention, batch_size=config.batch_size, context_length=context,
                               warmup=0, steps=1, device=config.device, size_table=config.edition)
            point = run(spec)
            rows += [{**row, **prov} for row in point]
            status = point[0]["status"]
            print(f"{config.edition}:{config.size} ctx={context} {attention}: {status}", file=sys.stderr, flush=True)
            if status != "oom":
                break
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    e2e.add_edition_argument(parser, default="2026")  # (f) is a 2026 question
    parser.add_argument("--size", default="xl", help="model size of the --edition table: " + "; ".join(
        f"{edition}: {', '.join(table)}" for edition, table in SIZE_TABLES.items()))
    parser.add_argument("--context-lengths", nargs="+", type=positive_int, default=[128, 2048],
                        help="tokens per sequence, one point each (2025 sizes: at most 1024)")
    parser.add_argument("--batch-size", type=positive_int, default=4, help="sequences per step")
    parser.add_argument("--precision", default="fp32", choices=list(DTYPES), help="fp32, or autocast to bf16 / fp16")
    parser.add_argument("--attention", default="naive", choices=sorted(ATTENTION_BACKENDS),
                        help="attention backend (cs336_systems.model.attention): %(choices)s")
    parser.add_argument("--fallback-attention", default=None, choices=sorted(ATTENTION_BACKENDS),
                        help="run a point that is out of memory with --attention again with this backend")
    add_device_argument(parser)
    parser.add_argument("--out", required=True, help="CSV file for the rows")
    args = parser.parse_args(argv)
    config = config_or_usage_error(
        parser, BlockMemoryConfig, size=args.size, edition=args.edition, context_lengths=tuple(args.context_lengths),
        batch_size=args.batch_size, precision=args.precision, attention=args.attention,
        fallback_attention=args.fallback_attention, device=args.device)
    write_rows(block_memory_rows(config), args.out)


if __name__ == "__main__":
    main()
