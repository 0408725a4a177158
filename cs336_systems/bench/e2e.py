"""End-to-end benchmark of the Transformer LM (handout 1.1.3, 1.1.5(c), 1.1.6, 1.3.1(b)).

For every point of the grid (size x mode x precision x attention x compile [x scope] [x optimizer]) it
builds the model, runs `warmup` untimed steps and `steps` timed ones, synchronizing around each phase,
and writes one tidy row per phase (forward, backward, optimizer, step) with mean/std/median, tokens/s,
MFU and peak memory. Out-of-memory becomes a row with status=oom and the sweep goes on.

    python -m cs336_systems.bench.e2e --sizes small xl --modes forward forward_backward \
        --precisions fp32 bf16 --device cuda --out results/e2e.csv
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from dataclasses import asdict, dataclass

import torch

from cs336_systems.bench.cli import add_device_argument, non_negative_int, positive_int
from cs336_systems.bench.provenance import device_name, provenance
from cs336_systems.bench.results import PartialRows
from cs336_systems.bench.timing import (
    annotate,
    autocast,
    check_precision,
    is_oom,
    oom_message,
    peak_flops,
    peak_memory_mib,
    reset_memory,
    resolve_device,
    summarize,
    synchronize,
    timed,
)
from cs336_systems.model import (
    MODEL_SIZES,
    TransformerLM,
    cross_entropy,
    forward_flops,
    get_attention,
    get_config,
    naive_attention,
    train_step_flops,
)
from cs336_systems.optim import ADAMW_IMPLEMENTATIONS, adamw_implementation

MODES = ("forward", "forward_backward", "train_step")
# What `--compile on` compiles: each Transformer block (regional compilation: the blocks share one graph,
# so compile time does not grow with depth), the whole model, or the whole model with CUDA graphs
# (torch.compile's "reduce-overhead" mode, which replays each step's kernels without launching them
# one by one from the host).
COMPILE_SCOPES = ("blocks", "model", "model-cudagraphs")
PHASES = {"forward": ("forward",), "forward_backward": ("forward", "backward"),
          "train_step": ("forward", "backward", "optimizer")}

# The naive backend with NVTX / record_function ranges around its three stages, for profiling: the
# model's registry names it `naive_annotated` (cs336_systems.model.attention).
naive_annotated_attention = functools.partial(naive_attention, section=annotate)


@dataclass(frozen=True)
class RunSpec:
    size: str
    mode: str
    precision: str
    attention: str
    compile: bool
    batch_size: int
    context_length: int
    warmup: int
    steps: int
    device: str
    memory_snapshot: str | None = None
    optimizer: str = "foreach"  # train_step only: one of ADAMW_IMPLEMENTATIONS (the CLI records "none" otherwise)
    compile_scope: str = "blocks"  # with compile only: one of COMPILE_SCOPES (the CLI records "none" otherwise)


def build_model(spec: RunSpec, device: torch.device) -> TransformerLM:
    config = get_config(spec.size, attention=spec.attention, context_length=max(spec.context_length, 1))
    with device:  # initialise on the device: a 2.7B model's init on the CPU takes longer than its benchmark
        model = TransformerLM(config)
    if not spec.compile:
        return model
    if spec.compile_scope == "blocks":
        model.compile_blocks()
    elif spec.compile_scope in ("model", "model-cudagraphs"):
        model.compile(mode="reduce-overhead" if spec.compile_scope == "model-cudagraphs" else None)
    else:
        raise ValueError(f"unknown compile scope {spec.compile_scope!r}; known: {', '.join(COMPILE_SCOPES)}")
    return model


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    optimizer_class, extra = adamw_implementation(name)
    return optimizer_class(params, lr=1e-4, weight_decay=1e-2, **extra)


def measure(spec: RunSpec) -> dict[str, list[float]]:
    """Run the spec and return per-phase times (ms) of the measured steps."""
    device = resolve_device(spec.device)
    torch.manual_seed(0)
    model = build_model(spec, device)
    optimizer = make_optimizer(spec.optimizer, model.parameters()) if spec.mode == "train_step" else None
    vocab = model.config.vocab_size
    tokens = torch.randint(vocab, (spec.batch_size, spec.context_length + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    samples: dict[str, list[float]] = {phase: [] for phase in PHASES[spec.mode]}
    loss = None

    def forward() -> None:
        nonlocal loss
        with autocast(spec.precision, device):
            if spec.mode == "forward":
                with torch.no_grad():
                    model(inputs)
            else:
                loss = cross_entropy(model(inputs), targets)

    actions = {"forward": forward, "backward": lambda: loss.backward(), "optimizer": lambda: optimizer.step()}
    for step in range(spec.warmup + spec.steps):
        measured = step >= spec.warmup
        if measured and step == spec.warmup and spec.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        with annotate("measured_step" if measured else "warmup_step"):
            if spec.compile and spec.compile_scope == "model-cudagraphs":
                torch.compiler.cudagraph_mark_step_begin()  # a new step: earlier outputs may be overwritten
            model.zero_grad(set_to_none=True)
            for phase in samples:
                with annotate(phase):
                    elapsed = timed(actions[phase], device)
                if measured:
                    samples[phase].append(elapsed)
    synchronize(device)
    if spec.memory_snapshot:
        torch.cuda.memory._dump_snapshot(spec.memory_snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
    return samples


def run(spec: RunSpec) -> list[dict]:
    """Rows for one grid point; an out-of-memory failure becomes a single status=oom row."""
    device = resolve_device(spec.device)
    config = get_config(spec.size)
    base = {**asdict(spec), "d_model": config.d_model, "d_ff": config.d_ff, "num_layers": config.num_layers,
            "num_heads": config.num_heads}
    # Each grid point compiles afresh: without this, recompiles for earlier points exhaust dynamo's cache
    # limit and later points silently run eagerly. The compiled code refers to the previous point's model,
    # so the reset comes before the memory is released.
    torch.compiler.reset()
    reset_memory(device)
    try:
        samples = measure(spec)
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if not is_oom(error):
            raise
        if spec.memory_snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)
        reset_memory(device)
        return [{**base, "phase": "step", "status": "oom", "error": oom_message(error)}]
    peak_mib = peak_memory_mib(device)
    step_ms = [sum(parts) for parts in zip(*samples.values())]
    # Matmul FLOPs only; the optimizer's elementwise work is not counted, as usual for MFU.
    flops_fn = forward_flops if spec.mode == "forward" else train_step_flops
    flops = flops_fn(config, spec.batch_size, spec.context_length)
    step_summary = summarize(step_ms)
    peak = peak_flops(device_name(device), spec.precision)
    rows = []
    for phase, times in [*samples.items(), ("step", step_ms)]:
        row = {**base, "phase": phase, **summarize(times), "peak_memory_mib": peak_mib, "status": "ok"}
        if phase == "step":
            seconds = step_summary["median_ms"] / 1e3
            row.update(tokens_per_s=spec.batch_size * spec.context_length / seconds,
                       tflops=flops / seconds / 1e12, mfu=flops / seconds / peak)
        rows.append(row)
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["small"], help=f"model sizes: {', '.join(MODEL_SIZES)}")
    parser.add_argument("--modes", nargs="+", default=["forward_backward"], choices=MODES,
                        help="forward (inference, no grad), forward_backward, or train_step (+ AdamW)")
    parser.add_argument("--precisions", nargs="+", default=["fp32"], help="fp32 | bf16 | fp16 (autocast)")
    parser.add_argument("--attention", nargs="+", default=["naive"],
                        help="attention backends: naive, naive_annotated, sdpa, flash_pytorch, flash_triton")
    parser.add_argument("--compile", nargs="+", default=["off"], choices=["off", "on"],
                        help="run eagerly (off) and/or with each block torch.compile'd (on)")
    parser.add_argument("--compile-scopes", nargs="+", default=["blocks"], choices=COMPILE_SCOPES,
                        help="with --compile on: each block (regional), the whole model, or the whole model "
                             "with CUDA graphs (mode reduce-overhead)")
    parser.add_argument("--batch-size", type=positive_int, default=4)
    parser.add_argument("--context-length", type=positive_int, default=512)
    parser.add_argument("--warmup", nargs="+", type=non_negative_int, default=[5], help="untimed warm-up steps")
    parser.add_argument("--steps", type=positive_int, default=10, help="measured steps")
    add_device_argument(parser)
    parser.add_argument("--optimizers", nargs="+", default=["foreach"], choices=ADAMW_IMPLEMENTATIONS,
                        help="for train_step: our AdamW with multi-tensor ops (foreach) or one Triton kernel per "
                             "tensor (fused), or torch.optim.AdamW(fused=True) (torch_fused)")
    parser.add_argument("--memory-snapshot", default=None,
                        help="dump the allocator history of the measured steps to this pickle (CUDA only)")
    parser.add_argument("--out", required=True, help="CSV file for the rows")
    return parser


def specs_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[RunSpec]:
    for size in args.sizes:
        if size not in MODEL_SIZES:
            parser.error(f"unknown model size {size!r}; known sizes: {', '.join(MODEL_SIZES)}")
        limit = MODEL_SIZES[size].context_length
        if args.context_length > limit:
            parser.error(f"--context-length {args.context_length} exceeds the {limit} tokens size {size!r} supports")
    try:
        device = resolve_device(args.device)
        for precision in args.precisions:
            check_precision(precision, device)
        for name in args.attention:
            get_attention(name)
    except (ValueError, RuntimeError) as error:
        parser.error(str(error))
    if args.memory_snapshot and device.type != "cuda":
        parser.error(f"--memory-snapshot needs a CUDA device, got --device {args.device}")
    grid = itertools.product(args.sizes, args.modes, args.precisions, args.attention, args.compile, args.warmup)
    return [
        RunSpec(size=size, mode=mode, precision=precision, attention=attention, compile=compile_ == "on",
                batch_size=args.batch_size, context_length=args.context_length, warmup=warmup,
                steps=args.steps, device=args.device, memory_snapshot=args.memory_snapshot, optimizer=optimizer,
                compile_scope=scope)
        for size, mode, precision, attention, compile_, warmup in grid
        for scope in (args.compile_scopes if compile_ == "on" else ["none"])
        for optimizer in (args.optimizers if mode == "train_step" else ["none"])
    ]


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    specs = specs_from_args(args, parser)
    prov = provenance(args.device)
    rows = PartialRows(args.out)  # a cut run keeps its finished points in OUT.partial
    for i, spec in enumerate(specs, 1):
        spec_rows = run(spec)
        rows.add({**row, **prov} for row in spec_rows)
        last = spec_rows[-1]
        shown = f"{last['median_ms']:.2f} ms/step" if last["status"] == "ok" else last["status"]
        print(f"[{i}/{len(specs)}] {spec.size} {spec.mode} {spec.precision} {spec.attention} "
              f"compile={spec.compile} scope={spec.compile_scope} warmup={spec.warmup} "
              f"optimizer={spec.optimizer}: {shown}",
              file=sys.stderr, flush=True)
    rows.finish()


if __name__ == "__main__":
    main()
