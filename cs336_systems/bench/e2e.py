"""End-to-end benchmark of the Transformer LM (handout 1.1.3, 1.1.5(c), 1.1.6, 1.3.1(b)).

For every point of the grid (model x size x mode x precision x attention x compile scope x warm-up
[x optimizer x weights]) it builds the model, runs `warmup` untimed steps and `steps` timed ones, synchronizing
around each phase, and writes one tidy row per phase (forward, backward, optimizer, step) with
mean/std/median, every measured step's time (`samples_ms`), tokens/s, MFU and peak memory.
Out-of-memory becomes a row with status=oom and the sweep goes on.

The model is ours (`--models ours`) or the plain-PyTorch baseline (`plain`: `bench.plain_model`, same
config and parameters, torch's SDPA; always trained with torch.optim.AdamW(fused=True)), so both are
timed in one process on the same GPU. Our training steps in bf16 can keep the matmul weights in bf16 with
float32 master copies in our AdamW (`--weights bf16-master`, `optim.keep_master_weights`): autocast then casts
no weight in the forward and no weight gradient in the backward. `--rounds N` runs the whole grid N times,
interleaved (every point once per round, in the same order), each row recording its `round`: points compared
with each other then share each round's state of the GPU and host, and a point's spread over rounds shows.

    python -m cs336_systems.bench.e2e --sizes small xl --modes forward forward_backward \
        --precisions fp32 bf16 --device cuda --out results/e2e.csv

As a library: `sweep(Sweep(sizes=("small",), device="cuda"), "e2e.csv")`, or `run(RunSpec(...))` for the
rows of one point.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import pickle
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cs336_systems.bench.plain_model import PlainTransformerLM
from cs336_systems.bench.checks import (check_context_length, check_known, check_non_negative, check_not_empty,
                                        check_positive)
from cs336_systems.bench.cli import add_device_argument, config_or_usage_error, non_negative_int, positive_int
from cs336_systems.distributed.parallelize import ParallelPlan, parallelize
from cs336_systems.provenance import device_name, provenance
from cs336_systems.results import PartialRows, check_output_file
from cs336_systems.timing import (
    annotate,
    autocast,
    check_precision,
    is_oom,
    oom_row,
    peak_flops,
    peak_memory_mib,
    reset_memory,
    resolve_device,
    summarize,
    synchronize,
    timed,
)
from cs336_systems.model import (
    ATTENTION_BACKENDS,
    SIZE_TABLES,
    TransformerLM,
    cross_entropy,
    forward_flops,
    get_attention,
    get_config,
    naive_attention,
    register_attention,
    train_step_flops,
)
from cs336_systems.model.transformer import Linear
from cs336_systems.optim import ADAMW_IMPLEMENTATIONS, adamw_implementation, keep_master_weights

MODES = ("forward", "forward_backward", "train_step")
# What is compiled: nothing (eager), each Transformer block (regional compilation: the blocks share one
# graph, so compile time does not grow with depth), the whole model, or the whole model with CUDA graphs
# (torch.compile's "reduce-overhead" mode, which replays each step's kernels without launching them one
# by one from the host).
COMPILE_SCOPES = ("none", "blocks", "model", "model-cudagraphs")
# Our Transformer, or the plain-PyTorch baseline with the same config (bench/plain_model.py).
MODELS = ("ours", "plain")
# What the baseline always runs with, whatever the grid asks of ours.
PLAIN_ATTENTION, PLAIN_OPTIMIZER = "sdpa", "torch_fused"
# How ours stores the weights of its matmuls in a training step: float32, cast by autocast each step, or bf16
# with float32 masters that our AdamW updates (bf16 train steps of ours only; every other point is float32).
WEIGHTS = ("float32", "bf16-master")
PHASES = {"forward": ("forward",), "forward_backward": ("forward", "backward"),
          "train_step": ("forward", "backward", "optimizer")}

# The naive backend with NVTX / record_function ranges around its three stages, for profiling. Registered
# here, where it is defined (the model's registry names nothing above the kernels): importing this module
# makes `naive_annotated` a backend, and every CLI that imports it offers the name.
naive_annotated_attention = functools.partial(naive_attention, section=annotate)
register_attention("naive_annotated", naive_annotated_attention)


def check_sizes(edition: str, sizes, context_lengths) -> None:
    """Sizes known to the edition's table, and contexts the edition allows them. The 2025 handout's
    longest context is 1024 (1.1.4), each 2025 size's `context_length`: a longer one is refused before a
    model is built. The 2026 handout's questions ask for longer ones (memory_profiling: 2048;
    nsys_profile: "the longest context length you can fit in memory"), so a 2026 point is limited by the
    memory alone: one that does not fit is a status=oom row."""
    check_known("handout edition", [edition], SIZE_TABLES)
    check_known("model size", sizes, SIZE_TABLES[edition])  # the known names listed are the edition's
    check_positive("context length", *context_lengths)
    if edition == "2025":
        for context_length in context_lengths:
            check_context_length(context_length, {size: SIZE_TABLES[edition][size].context_length for size in sizes})


@dataclass(frozen=True)
class RunSpec:
    """One point of the grid."""

    size: str
    mode: str
    precision: str
    attention: str
    batch_size: int
    context_length: int
    warmup: int
    steps: int
    device: str
    memory_snapshot: str | None = None
    optimizer: str = "foreach"  # train_step only: one of ADAMW_IMPLEMENTATIONS ("none" in rows of other modes)
    compile_scope: str = "none"  # one of COMPILE_SCOPES; "none" runs eagerly
    model: str = "ours"  # one of MODELS
    size_table: str = "2025"  # the handout edition whose size table `size` is from (a key of SIZE_TABLES)
    weights: str = "float32"  # one of WEIGHTS

    def columns(self) -> dict:
        """The point's columns in a results row. `compile` (true unless the scope is "none") is kept beside
        `compile_scope`, in the order of the committed results files, which the report reads; `size_table`
        and `weights` come last (files measured before them hold 2025 sizes and float32 weights only)."""
        return {"model": self.model, "size": self.size, "mode": self.mode, "precision": self.precision, "attention": self.attention,
                "compile": self.compile_scope != "none", "batch_size": self.batch_size,
                "context_length": self.context_length, "warmup": self.warmup, "steps": self.steps,
                "device": self.device, "memory_snapshot": self.memory_snapshot, "optimizer": self.optimizer,
                "compile_scope": self.compile_scope, "size_table": self.size_table, "weights": self.weights}


def build_model(spec: RunSpec, device: torch.device) -> torch.nn.Module:
    config = get_config(spec.size, spec.size_table, attention=spec.attention,
                        context_length=max(spec.context_length, 1))
    check_known("compile scope", [spec.compile_scope], COMPILE_SCOPES)
    check_known("model", [spec.model], MODELS)
    with device:  # initialise on the device: a 2.7B model's init on the CPU takes longer than its benchmark
        model = TransformerLM(config) if spec.model == "ours" else PlainTransformerLM(config)
    if spec.model == "plain":  # stays special: parallelize rewraps `layers`; the baseline's blocks are `blocks`
        if spec.compile_scope == "blocks":
            for block in model.blocks:
                block.compile()
        elif spec.compile_scope in ("model", "model-cudagraphs"):
            model.compile(mode="reduce-overhead" if spec.compile_scope == "model-cudagraphs" else None)
        return model
    # Ours in the library's order of application. "model-cudagraphs" is the plan's "model" scope compiled in
    # torch.compile's mode="reduce-overhead". No data parallelism here: the model itself is returned, not the
    # pass-through wrapper.
    cudagraphs = spec.compile_scope == "model-cudagraphs"
    plan = ParallelPlan(compile="model" if cudagraphs else spec.compile_scope)
    options = {"mode": "reduce-overhead"} if cudagraphs else None
    return parallelize(model, plan, device, compile_options=options).module


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    optimizer_class, extra = adamw_implementation(name)
    return optimizer_class(params, lr=1e-4, weight_decay=1e-2, **extra)


def dump_snapshot(path: str | Path, phases: list[dict]) -> None:
    """torch.cuda.memory._dump_snapshot's pickle, plus a "phases" entry: each recorded phase's host
    wall-clock start and end in µs, the clock the allocator's event stamps (`time_us`) are converted to,
    so the report can mark forward / backward / optimizer on the timeline (cs336_systems.report.memory)."""
    snapshot = torch.cuda.memory._snapshot()
    snapshot["phases"] = phases
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)


def measure(spec: RunSpec) -> dict[str, list[float]]:
    """Run the spec and return per-phase times (ms) of the measured steps."""
    device = resolve_device(spec.device)
    torch.manual_seed(0)
    model = build_model(spec, device)
    optimizer = make_optimizer(spec.optimizer, model.parameters()) if spec.mode == "train_step" else None
    if spec.weights == "bf16-master":
        keep_master_weights(optimizer, [m.weight for m in model.modules() if isinstance(m, Linear)])
    vocab = model.config.vocab_size
    tokens = torch.randint(vocab, (spec.batch_size, spec.context_length + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    samples: dict[str, list[float]] = {phase: [] for phase in PHASES[spec.mode]}
    phase_marks: list[dict] = []  # the recorded steps' phase boundaries, for the memory snapshot
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
            if spec.compile_scope == "model-cudagraphs":
                torch.compiler.cudagraph_mark_step_begin()  # a new step: earlier outputs may be overwritten
            model.zero_grad(set_to_none=True)
            for phase in samples:
                start_us = time.time_ns() // 1000
                with annotate(phase):
                    elapsed = timed(actions[phase], device)
                if measured:
                    samples[phase].append(elapsed)
                    phase_marks.append({"phase": phase, "start_us": start_us, "end_us": time.time_ns() // 1000})
    synchronize(device)
    if spec.memory_snapshot:
        dump_snapshot(spec.memory_snapshot, phase_marks)
        torch.cuda.memory._record_memory_history(enabled=None)
    return samples


def run(spec: RunSpec) -> list[dict]:
    """Rows for one grid point; an out-of-memory failure becomes a single status=oom row."""
    device = resolve_device(spec.device)
    config = get_config(spec.size, spec.size_table)
    base = {**spec.columns(), "d_model": config.d_model, "d_ff": config.d_ff, "num_layers": config.num_layers,
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
        return [oom_row({**base, "phase": "step"}, error)]
    peak_mib = peak_memory_mib(device)
    step_ms = [sum(parts) for parts in zip(*samples.values())]
    # Matmul FLOPs only; the optimizer's elementwise work is not counted, as usual for MFU.
    flops_fn = forward_flops if spec.mode == "forward" else train_step_flops
    flops = flops_fn(config, spec.batch_size, spec.context_length)
    step_summary = summarize(step_ms)
    peak = peak_flops(device_name(device), spec.precision)
    rows = []
    for phase, times in [*samples.items(), ("step", step_ms)]:
        row = {**base, "phase": phase, **summarize(times), "samples_ms": " ".join(f"{t:.3f}" for t in times),
               "peak_memory_mib": peak_mib, "status": "ok"}
        if phase == "step":
            seconds = step_summary["median_ms"] / 1e3
            row.update(tokens_per_s=spec.batch_size * spec.context_length / seconds,
                       tflops=flops / seconds / 1e12, mfu=flops / seconds / peak)
        rows.append(row)
    return rows


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Sweep:
    """A grid of points: every combination of the tuple fields (optimizers apply to train_step only).
    Checked on construction: unknown names, counts out of range, a context longer than a size supports,
    a precision or a memory snapshot the device cannot do, and a GPU asked for where there is none all
    raise a ValueError (RuntimeError for the missing GPU) naming the value."""

    sizes: tuple[str, ...] = ("small",)
    modes: tuple[str, ...] = ("forward_backward",)
    precisions: tuple[str, ...] = ("fp32",)
    attention: tuple[str, ...] = ("naive",)
    compile_scopes: tuple[str, ...] = ("none",)
    warmups: tuple[int, ...] = (5,)
    optimizers: tuple[str, ...] = ("foreach",)
    models: tuple[str, ...] = ("ours",)
    weights: tuple[str, ...] = ("float32",)
    edition: str = "2025"  # whose size table `sizes` are from
    batch_size: int = 4
    context_length: int = 512
    steps: int = 10
    rounds: int = 1  # the grid run this many times, interleaved (every point once per round)
    device: str = field(default_factory=_default_device)
    memory_snapshot: str | None = None

    def __post_init__(self):
        for name in ("sizes", "modes", "precisions", "attention", "compile_scopes", "warmups", "optimizers", "models",
                     "weights"):
            check_not_empty(name, getattr(self, name))
        check_sizes(self.edition, self.sizes, [self.context_length])
        check_known("mode", self.modes, MODES)
        check_known("compile scope", self.compile_scopes, COMPILE_SCOPES)
        check_known("AdamW implementation", self.optimizers, ADAMW_IMPLEMENTATIONS)
        check_known("model", self.models, MODELS)
        check_known("weights", self.weights, WEIGHTS)
        if "bf16-master" in self.weights:
            if "bf16" not in self.precisions or "ours" not in self.models or "train_step" not in self.modes:
                raise ValueError("weights 'bf16-master' are for bf16 training steps of ours; got precisions "
                                 f"{list(self.precisions)}, models {list(self.models)}, modes {list(self.modes)}")
            if set(self.optimizers) == {"torch_fused"}:
                raise ValueError("weights 'bf16-master' keep their masters in our AdamW; got only optimizer "
                                 "'torch_fused'")
        check_positive("batch size", self.batch_size)
        check_positive("measured steps", self.steps)
        check_positive("rounds", self.rounds)
        check_non_negative("warm-up steps", *self.warmups)
        device = resolve_device(self.device)
        for precision in self.precisions:
            check_precision(precision, device)
        for name in self.attention:
            get_attention(name)
        if self.memory_snapshot and device.type != "cuda":
            raise ValueError(f"a memory snapshot needs a CUDA device, got device {self.device!r}")

    def specs(self) -> list[RunSpec]:
        """Every point; the plain baseline's only with SDPA, torch's fused AdamW and float32 weights, once per
        size, mode, precision, scope and warm-up, each right after ours (so the two share the GPU's state); bf16
        master weights only in bf16 training steps of ours with our AdamW."""
        grid = itertools.product(self.sizes, self.modes, self.precisions, self.compile_scopes, self.warmups,
                                 self.models, self.attention)
        specs = []
        for size, mode, precision, scope, warmup, model, attention in grid:
            if model == "plain":
                attention = PLAIN_ATTENTION
            optimizers = ["none"] if mode != "train_step" else [PLAIN_OPTIMIZER] if model == "plain" else self.optimizers
            masters = model == "ours" and mode == "train_step" and precision == "bf16"
            for optimizer, weights in itertools.product(optimizers, self.weights if masters else ["float32"]):
                if weights == "bf16-master" and optimizer == "torch_fused":
                    continue
                spec = RunSpec(size=size, mode=mode, precision=precision, attention=attention,
                               batch_size=self.batch_size, context_length=self.context_length, warmup=warmup,
                               steps=self.steps, device=self.device, memory_snapshot=self.memory_snapshot,
                               optimizer=optimizer, compile_scope=scope, model=model, size_table=self.edition,
                               weights=weights)
                if spec not in specs:
                    specs.append(spec)
        return specs


def sweep(config: Sweep, out: str | Path) -> None:
    """Run every point of the grid, `config.rounds` times interleaved, and write its rows (each with its round
    and provenance) to `out`. The points finished so far are kept in OUT.partial as the sweep goes, so a cut run
    leaves them beside an earlier OUT."""
    specs = config.specs()
    prov = provenance(config.device)
    rows = PartialRows(out)
    for i, (round_, spec) in enumerate(itertools.product(range(config.rounds), specs), 1):
        spec_rows = run(spec)
        rows.add({**row, "round": round_, **prov} for row in spec_rows)
        last = spec_rows[-1]
        shown = f"{last['median_ms']:.2f} ms/step" if last["status"] == "ok" else last["status"]
        print(f"[{i}/{len(specs) * config.rounds}] {spec.size_table}:{spec.size} {spec.mode} {spec.precision} "
              f"{spec.attention} "
              f"compile={spec.compile_scope} warmup={spec.warmup} optimizer={spec.optimizer} model={spec.model} "
              f"weights={spec.weights}: {shown}",
              file=sys.stderr, flush=True)
    rows.finish()


def add_edition_argument(parser: argparse.ArgumentParser, default: str = "2025") -> None:
    """--edition: which handout's size table the sizes are from (the 2026 xl is the 2025 2.7B)."""
    parser.add_argument("--edition", default=default, choices=list(SIZE_TABLES),
                        help="the handout whose Table 1 the sizes are from (2026: xl = 2025's 2.7B, and 10B); "
                             "rows carry it as size_table")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_edition_argument(parser)
    parser.add_argument("--sizes", nargs="+", default=["small"],
                        help="model sizes of the --edition table: " + "; ".join(
                            f"{edition}: {', '.join(table)}" for edition, table in SIZE_TABLES.items()))
    parser.add_argument("--modes", nargs="+", default=["forward_backward"], choices=MODES,
                        help="forward (inference, no grad), forward_backward, or train_step (+ AdamW)")
    parser.add_argument("--precisions", nargs="+", default=["fp32"], help="fp32 | bf16 | fp16 (autocast)")
    parser.add_argument("--attention", nargs="+", default=["naive"], choices=sorted(ATTENTION_BACKENDS),
                        help="attention backends (cs336_systems.model.attention): %(choices)s")
    parser.add_argument("--compile-scopes", nargs="+", default=["none"], choices=COMPILE_SCOPES,
                        help="what torch.compile compiles: none (eager), each block (regional), the whole model, "
                             "or the whole model with CUDA graphs (mode reduce-overhead)")
    parser.add_argument("--batch-size", type=positive_int, default=4, help="sequences per step")
    parser.add_argument("--context-length", type=positive_int, default=512,
                        help="tokens per sequence (2025 sizes: at most 1024, the handout's longest; 2026 sizes: "
                             "any, an out-of-memory point is a status=oom row)")
    parser.add_argument("--warmup", nargs="+", type=non_negative_int, default=[5],
                        help="untimed warm-up steps (several values: one point each)")
    parser.add_argument("--steps", type=positive_int, default=10, help="measured steps")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="run the whole grid this many times, interleaved (every point once per round)")
    add_device_argument(parser)
    parser.add_argument("--optimizers", nargs="+", default=["foreach"], choices=ADAMW_IMPLEMENTATIONS,
                        help="for train_step: our AdamW with multi-tensor ops (foreach) or one Triton kernel per "
                             "tensor (fused), or torch.optim.AdamW(fused=True) (torch_fused)")
    parser.add_argument("--models", nargs="+", default=["ours"], choices=MODELS,
                        help="ours, and/or plain: the plain-PyTorch baseline of the same config (SDPA, torch's fused "
                             "AdamW), timed in the same run")
    parser.add_argument("--weights", nargs="+", default=["float32"], choices=WEIGHTS,
                        help="for bf16 train steps of ours: matmul weights in float32 (autocast casts them), and/or "
                             "in bf16 with float32 masters in our AdamW (bf16-master)")
    parser.add_argument("--memory-snapshot", default=None,
                        help="dump the allocator history of the measured steps to this pickle (CUDA only)")
    parser.add_argument("--out", required=True, help="CSV file for the rows")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_output_file(args.out, "--out")  # before the sweep, not after its first point
    except ValueError as error:
        parser.error(str(error))
    config = config_or_usage_error(
        parser, Sweep, sizes=tuple(args.sizes), modes=tuple(args.modes), precisions=tuple(args.precisions),
        attention=tuple(args.attention), compile_scopes=tuple(args.compile_scopes), warmups=tuple(args.warmup),
        optimizers=tuple(args.optimizers), models=tuple(args.models), weights=tuple(args.weights), edition=args.edition,
        batch_size=args.batch_size, context_length=args.context_length,
        steps=args.steps, rounds=args.rounds, device=args.device, memory_snapshot=args.memory_snapshot)
    sweep(config, args.out)


if __name__ == "__main__":
    main()
