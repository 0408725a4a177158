"""What autograd saves for backward (handout 2026, §3.1-3.2): the residuals of RMSNorm and of Transformer
blocks, eager and torch.compile'd, with and without activation checkpointing.

`record_saved_tensors(fn, *args)` runs fn under `torch.autograd.graph.saved_tensors_hooks` and returns
one record per tensor autograd packed. `saved_bytes(records)` totals them two ways:

- tensor_bytes: numel x element size of every packed tensor, as the handout's hook counts (a tensor
  packed twice, or two views of one tensor, count twice);
- storage_bytes: the bytes of each distinct storage that packed tensors keep alive, counted once (a view
  keeps its whole base alive, so this is the memory actually held for backward).

Each storage is classed as a `parameter` (a storage of the module's parameters: W itself or a view such
as W.T; not a copy made by autocast, which is an activation here), an `input` (a storage of fn's tensor
arguments) or an `activation` (anything made in the forward). The handout's number is input +
activation in tensor_bytes.

    python -m cs336_systems.bench.saved_tensors --cases rmsnorm block --modes eager compiled --out results/saved_tensors.csv

The defaults are the handout's settings: RMSNorm on (4, 512, 2560) and a block of d_model 2560, d_ff
10240, 16 heads (the handout's snippet; its Table 1 xl has 32) on (4, 2048, 2560), in float32. The
handout-size block needs ~4 GB and a minute per forward on a CPU, and torch.compile of it on a CPU much
longer: compile the block on a GPU.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from cs336_systems.bench.cli import add_device_argument, device_from_args, positive_int
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows
from cs336_systems.timing import DTYPES, autocast, check_precision, synchronize
from cs336_systems.model import ATTENTION_BACKENDS, ModelConfig
from cs336_systems.model.transformer import RMSNorm, RotaryEmbedding, TransformerBlock

KINDS = ("parameter", "input", "activation")


@dataclass(frozen=True)
class SavedTensor:
    shape: tuple[int, ...]
    dtype: str
    tensor_bytes: int  # numel x element size of the packed tensor itself
    storage: tuple[str, int]  # (device, data pointer) of its storage; (device, -n) for empty storages
    storage_bytes: int  # size of the storage it keeps alive
    kind: str  # one of KINDS
    grad_fn: str  # the packed tensor's grad_fn, "" for leaves and tensors made outside autograd


def _storage_key(t: torch.Tensor, fallback: int) -> tuple[str, int]:
    storage = t.untyped_storage()
    if storage.nbytes() == 0:  # empty storages share a null pointer; keep them apart (they weigh nothing)
        return (str(t.device), -fallback)
    if t.device.type == "meta":
        raise ValueError("meta tensors have no storage addresses to tell storages apart; use a real device")
    return (str(t.device), storage.data_ptr())


def record_saved_tensors(fn: Callable, *args, parameters: Iterable[torch.Tensor] = (),
                         **kwargs) -> tuple[object, list[SavedTensor]]:
    """Run fn(*args, **kwargs) with autograd's pack hook recording every saved tensor; returns (output,
    records). Keep the output alive until the records are used: the graph is what holds the saved
    tensors, and a freed storage's address may be reused."""
    param_keys = {_storage_key(p, 0) for p in parameters if p.untyped_storage().nbytes()}
    input_keys = {_storage_key(a, 0) for a in args if isinstance(a, torch.Tensor) and a.untyped_storage().nbytes()}
    records: list[SavedTensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t, len(records) + 1)
        kind = "parameter" if key in param_keys else "input" if key in input_keys else "activation"
        records.append(SavedTensor(shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."),
                                   tensor_bytes=t.numel() * t.element_size(), storage=key,
                                   storage_bytes=t.untyped_storage().nbytes(), kind=kind,
                                   grad_fn=type(t.grad_fn).__name__ if t.grad_fn is not None else ""))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = fn(*args, **kwargs)
    return output, records


def saved_bytes(records: Iterable[SavedTensor]) -> dict[str, dict[str, int]]:
    """Per kind: count (packed tensors), tensor_bytes (summed per packed tensor) and storage_bytes
    (summed per distinct storage)."""
    totals = {kind: {"count": 0, "tensor_bytes": 0, "storage_bytes": 0} for kind in KINDS}
    seen: set[tuple[str, int]] = set()
    for r in records:
        totals[r.kind]["count"] += 1
        totals[r.kind]["tensor_bytes"] += r.tensor_bytes
        if r.storage not in seen:
            seen.add(r.storage)
            totals[r.kind]["storage_bytes"] += r.storage_bytes
    return totals


# ---- the handout's cases --------------------------------------------------------------------------------

CASES = ("rmsnorm", "block", "four_blocks", "four_blocks_checkpointed")


@dataclass(frozen=True)
class Setting:
    batch_size: int = 4
    d_model: int = 2560
    d_ff: int = 10240
    num_heads: int = 16
    context_length: int = 2048  # the blocks' sequence length
    norm_context_length: int = 512  # RMSNorm's sequence length
    attention: str = "naive"
    precision: str = "fp32"


def _two_blocks(x: torch.Tensor, block: nn.Module, rope: nn.Module, positions: torch.Tensor) -> torch.Tensor:
    return block(block(x, rope, positions), rope, positions)


def measure_case(case: str, mode: str, setting: Setting, device: torch.device) -> list[SavedTensor]:
    """The tensors one forward of the case saves for backward; mode "compiled" wraps the module in torch.compile
    (fullgraph, as the handout does) and runs it once before recording, so compilation is not recorded."""
    if case not in CASES:
        raise ValueError(f"unknown case {case!r}; known: {', '.join(CASES)}")
    if mode not in ("eager", "compiled"):
        raise ValueError(f"unknown mode {mode!r}; choose eager or compiled")
    torch.manual_seed(0)
    with device:
        if case == "rmsnorm":
            module: nn.Module = RMSNorm(setting.d_model)
            x = torch.randn(setting.batch_size, setting.norm_context_length, setting.d_model, requires_grad=True)
            extra: tuple = ()
        else:
            config = ModelConfig(d_model=setting.d_model, d_ff=setting.d_ff, num_layers=1, num_heads=setting.num_heads,
                                 context_length=setting.context_length, attention=setting.attention)
            module = TransformerBlock(config)
            rope = RotaryEmbedding(config.head_dim, config.context_length, config.rope_theta)
            x = torch.randn(setting.batch_size, setting.context_length, setting.d_model, requires_grad=True)
            extra = (rope, torch.arange(setting.context_length))
    if mode == "compiled":
        module = torch.compile(module, fullgraph=True)

    def forward(x: torch.Tensor) -> torch.Tensor:
        with autocast(setting.precision, device):
            if case in ("rmsnorm", "block"):
                return module(x, *extra)
            if case == "four_blocks":
                return _two_blocks(_two_blocks(x, module, *extra), module, *extra)
            # the handout's §3.2.1: two checkpoint calls of two blocks each
            x = checkpoint(_two_blocks, x, module, *extra, use_reentrant=False)
            return checkpoint(_two_blocks, x, module, *extra, use_reentrant=False)

    if mode == "compiled":
        forward(x).sum().backward()  # compile (forward and backward) before recording
        x.grad = None
    output, records = record_saved_tensors(forward, x, parameters=module.parameters())
    synchronize(device)
    del output
    return records


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Setting()
    parser.add_argument("--cases", nargs="+", default=["rmsnorm", "block"], choices=CASES)
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--batch-size", type=positive_int, default=defaults.batch_size)
    parser.add_argument("--d-model", type=positive_int, default=defaults.d_model)
    parser.add_argument("--d-ff", type=positive_int, default=defaults.d_ff)
    parser.add_argument("--num-heads", type=positive_int, default=defaults.num_heads,
                        help="the handout's snippet uses 16 (its Table 1 xl has 32)")
    parser.add_argument("--context-length", type=positive_int, default=defaults.context_length,
                        help="sequence length of the block cases")
    parser.add_argument("--norm-context-length", type=positive_int, default=defaults.norm_context_length,
                        help="sequence length of the rmsnorm case")
    parser.add_argument("--attention", default=defaults.attention, choices=sorted(ATTENTION_BACKENDS),
                        help="attention backend of the blocks (cs336_systems.model.attention): %(choices)s")
    parser.add_argument("--precision", default=defaults.precision, choices=list(DTYPES),
                        help="fp32, or autocast to bf16/fp16")
    add_device_argument(parser)
    parser.add_argument("--out", required=True, help="CSV file for the rows (one per case, mode and kind)")
    parser.add_argument("--tensors-out", default=None,
                        help="also write every saved tensor (shape, dtype, kind, grad_fn), one row each, here")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    device = device_from_args(parser, args.device)
    setting = Setting(batch_size=args.batch_size, d_model=args.d_model, d_ff=args.d_ff, num_heads=args.num_heads,
                      context_length=args.context_length, norm_context_length=args.norm_context_length,
                      attention=args.attention, precision=args.precision)
    try:
        check_precision(args.precision, device)
        ModelConfig(d_model=args.d_model, d_ff=args.d_ff, num_layers=1, num_heads=args.num_heads,
                    context_length=args.context_length, attention=args.attention)
    except ValueError as error:
        parser.error(str(error))
    prov = provenance(device)
    rows, tensor_rows = [], []
    for case in args.cases:
        for mode in args.modes:
            records = measure_case(case, mode, setting, device)
            totals = saved_bytes(records)
            tensor_rows += [{"case": case, "mode": mode, "index": i, **vars(r), "storage": f"{r.storage[0]}:{r.storage[1]:#x}",
                             "shape": "x".join(map(str, r.shape))} for i, r in enumerate(records)]
            seq = setting.norm_context_length if case == "rmsnorm" else setting.context_length
            for kind, t in totals.items():
                rows.append({"case": case, "mode": mode, "kind": kind, **t,
                             "tensor_mib": t["tensor_bytes"] / 2**20, "storage_mib": t["storage_bytes"] / 2**20,
                             **{**vars(setting), "context_length": seq}, **prov})
            handout = totals["input"]["tensor_bytes"] + totals["activation"]["tensor_bytes"]
            print(f"{case} {mode}: {handout / 2**20:.2f} MiB saved (inputs + activations, per tensor)",
                  file=sys.stderr, flush=True)
    write_rows(rows, args.out)
    if args.tensors_out:
        write_rows([{**row, **prov} for row in tensor_rows], args.tensors_out)


if __name__ == "__main__":
    main()
