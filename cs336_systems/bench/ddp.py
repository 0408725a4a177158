"""Data-parallel training step benchmark (handout 2.2, 2.3, 3), one rank per process under torchrun.

    torchrun --nproc_per_node 2 -m cs336_systems.bench.ddp --size xl --precisions fp32 bf16 \
        --configs none naive flat individual bucketed:1 bucketed:100 torch_ddp --out ddp.csv

A config is a data-parallel spec, KIND[:BUCKET_MB][+SHARDING], parsed once into the library's
DataParallelSpec (cs336_systems.distributed.parallelize, which lists the kinds; --help shows them): kind none (each rank trains alone: the single-GPU speed), naive, flat, individual, bucketed:MB or
torch_ddp; individual-thread and bucketed-thread:MB issue their all-reduces from a worker thread instead
of the gradient hooks (for comparison); sharding none (default, AdamW), sharded (ours, ZeRO-1) or zero
(torch's ZeroRedundancyOptimizer). Each rank gets its own slice of a global batch.
Per step it times forward+backward, the wait for gradient communication that did not overlap the
backward pass (all of it for naive and flat), and the optimizer step. On a GPU the phases are CUDA
events recorded on the compute stream, with no synchronization between them (column timer=cuda_events):
the event after backward marks when the compute stream finished backward, and the one after
finish_gradient_synchronization (whose wait makes the compute stream wait for the NCCL stream) marks
when the gradients were ready, so the time between them is the communication left exposed. (Rows
without a timer column were timed with a device-wide synchronize after backward, which also waits for
the NCCL stream: unfinished all-reduces were charged to forward+backward, and the wait was ~0 by
construction.) On a CPU there are no events: host clocks time the phases (timer=host_clock; CPU
kernels are synchronous, gloo's collectives run on its own threads, so the time inside
finish_gradient_synchronization is still the exposed wait). The whole step is a host clock with a
synchronize before and after it; host_forward_backward_ms is the host's time to issue forward+backward
(near the compute stream's time when the host limits the step, well below it when the GPU does).
It records memory after initialisation, and the allocated memory and each phase's own peak (the peak
statistics are reset before forward+backward and again before the optimizer step, column
peak_scope=phase) just before and just after the optimizer step. Kinds fsdp (ours) and torch_fsdp2 (torch's fully_shard)
shard parameters, gradients and optimizer state; under bf16 they gather and compute in bf16. With
--rounds R the whole list of configs runs R times, interleaved, and each config's statistics pool its
rounds (the spread of the per-round medians is in the row). Rank 0 writes one row per config;
out-of-memory is a row.
--compile blocks compiles each Transformer block (eager bf16 xl steps are limited by the host's kernel
launches, not by the GPU); --adamw picks the AdamW implementation every optimizer updates with.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import timeit
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows
from cs336_systems.timing import DTYPES, annotate, is_oom, oom_message, reset_memory, synchronize
from cs336_systems.distributed import DataParallelSpec, build_optimizer
from cs336_systems.distributed.parallelize import (FULLY_SHARDED_KINDS, KINDS, SHARDINGS, ParallelPlan, argument_type,
                                                   parallelize)
from cs336_systems.distributed.launch import init_from_env, shutdown
from cs336_systems.model import ATTENTION_BACKENDS, MODEL_SIZES, TransformerLM, get_config
from cs336_systems.optim import ADAMW_IMPLEMENTATIONS
from cs336_systems.train_step import autocast_loss, forwards, train_step


@dataclass(frozen=True)
class DDPBenchConfig:
    """Everything one benchmark run measures: the specs, the model and batch, and the repetitions."""

    specs: tuple[DataParallelSpec, ...]
    out: str
    size: str = "xl"
    batch_size: int = 4  # per rank
    context_length: int = 512
    precisions: tuple[str, ...] = ("bf16",)
    attention: str = "sdpa"
    compile: str = "none"  # or "blocks"
    adamw: str = "foreach"  # one of ADAMW_IMPLEMENTATIONS
    backend: str = "nccl"
    lr: float = 1e-4
    warmup: int = 3
    steps: int = 10
    rounds: int = 1
    trace_dir: str | None = None

    def __post_init__(self):
        if not self.specs or len(set(self.specs)) < len(self.specs):
            raise ValueError(f"configs must be given, each once; got {', '.join(map(str, self.specs))}")
        for name, minimum in (("batch_size", 1), ("context_length", 1), ("warmup", 0), ("steps", 1), ("rounds", 1)):
            if getattr(self, name) < minimum:
                raise ValueError(f"--{name.replace('_', '-')} must be at least {minimum}, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        sharded = [str(spec) for spec in self.specs if spec.kind in FULLY_SHARDED_KINDS]
        if self.compile == "blocks" and sharded:
            # Our FSDP's per-layer hooks make Dynamo recompile every step (see distributed/fsdp.py), and
            # torch's fully_shard hooks sit on the very blocks --compile blocks compiles in place.
            raise ValueError(f"--compile blocks is not supported with {', '.join(sharded)}: measure the "
                             "fully-sharded kinds with --compile none")


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_mib(device: torch.device) -> tuple[float, float]:
    if device.type != "cuda":
        return float("nan"), float("nan")
    return torch.cuda.memory_allocated(device) / 2**20, torch.cuda.max_memory_allocated(device) / 2**20


class PhaseClock:
    """Marks in a step, read as milliseconds between consecutive marks after the step has ended.

    On CUDA each mark is an event recorded on the current (compute) stream, so a phase's time is what the
    compute stream spent on it, and nothing synchronizes between marks (the host runs ahead as in
    training). Elsewhere a mark is a host clock reading. `timer` names which."""

    def __init__(self, device: torch.device):
        self.events = device.type == "cuda"
        self.timer = "cuda_events" if self.events else "host_clock"
        self.marks: list[tuple[str, object]] = []

    def mark(self, name: str) -> None:
        if self.events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((name, event))
        else:
            self.marks.append((name, timeit.default_timer()))

    def phases(self) -> dict[str, float]:
        """{name of the later mark: ms since the previous mark}; call after synchronizing."""
        out = {}
        for (_, start), (name, end) in zip(self.marks, self.marks[1:]):
            out[name] = start.elapsed_time(end) if self.events else (end - start) * 1e3
        return out


class StepMeter:
    """The phase hook (`train_step.Phase`) of one measured step: the step is timed from its first forward (after
    zero_grad and the wrapper's on_train_batch_start), with a mark after forward+backward, after
    finish_gradient_synchronization and after the optimizer step; each phase's own peak memory (reset before
    forward+backward and again before the optimizer step, so "peak after step" is the step's alone); named ranges
    for forward, backward and optimizer in a trace."""

    def __init__(self, device: torch.device):
        self.device = device
        self.clock = PhaseClock(device)
        self.memory: dict[str, tuple[float, float]] = {}
        self.start = self.host_forward_backward_ms = float("nan")  # set by the forward and backward phases

    @contextlib.contextmanager
    def phase(self, name: str):
        if name == "forward":
            reset_peak(self.device)
            synchronize(self.device)
            self.start = timeit.default_timer()
            self.clock.mark("start")
        with contextlib.nullcontext() if name == "communication" else annotate(name):
            yield
        if name == "backward":
            self.host_forward_backward_ms = (timeit.default_timer() - self.start) * 1e3
            self.clock.mark("forward_backward")
        elif name == "communication":
            self.clock.mark("communication")
            self.memory["before_step"] = memory_mib(self.device)  # the allocator's counts are on the host: no sync
            reset_peak(self.device)
        elif name == "optimizer":
            self.clock.mark("optimizer")
            self.memory["after_step"] = memory_mib(self.device)

    def step_ms(self) -> float:
        """The whole step's host time, synchronized at its end."""
        synchronize(self.device)
        return (timeit.default_timer() - self.start) * 1e3


@contextlib.contextmanager
def trace_to(path: Path | None, device: torch.device):
    """Profile the enclosed step and export a Chrome trace to path (nothing when path is None)."""
    if path is None:
        yield
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    # All threads: the -thread variants issue their collectives from a worker thread, which a
    # profiler recording only the thread that started it (the default) leaves out.
    with profile(activities=activities, experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        yield
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))


def run_config(spec: DataParallelSpec, precision: str, cfg: DDPBenchConfig, rank: int, world: int,
               device: torch.device) -> dict:
    """One round of one spec: build, warm up, measure cfg.steps steps. Returns the per-step times,
    the memory readings and the mean loss of the measured steps."""
    torch.manual_seed(rank)  # ranks start apart; the wrappers broadcast rank 0's weights
    reset_memory(device)  # frees what the previous config left, reference cycles included
    # Memory still allocated before this config builds anything: 0 unless an earlier config leaked.
    at_start = torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
    with device:
        model = TransformerLM(get_config(cfg.size, context_length=cfg.context_length, attention=cfg.attention))
    params = sum(p.numel() * p.element_size() for p in model.parameters())  # the full model, before any sharding
    compute_dtype = None if precision == "fp32" else DTYPES[precision]  # what the FSDP kinds gather in
    # parallelize compiles before wrapping: the wrappers' gradient hooks stay outside the compiled blocks
    ddp = parallelize(model, ParallelPlan(compile=cfg.compile, data_parallel=spec), device,
                      compute_dtype=compute_dtype)
    optimizer = build_optimizer(ddp, spec, cfg.lr, cfg.adamw)
    after_init = memory_mib(device)
    data = torch.Generator(device="cpu").manual_seed(1234)  # the same global batches on every rank
    times = {"forward_backward": [], "communication": [], "optimizer": [], "step": [], "host_forward_backward": []}
    memory = {}
    losses = []
    loss_fn = autocast_loss(ddp, precision, device)
    for step in range(cfg.warmup + cfg.steps):
        tokens = torch.randint(model.config.vocab_size, (cfg.batch_size * world, cfg.context_length + 1),
                               generator=data).chunk(world)[rank].to(device)
        tracing = cfg.trace_dir and rank == 0 and step == cfg.warmup + cfg.steps - 1
        meter = StepMeter(device)
        with trace_to(Path(cfg.trace_dir) / f"{spec}_{precision}.json" if tracing else None, device):
            losses.append(train_step(ddp, optimizer, forwards(loss_fn, tokens[:, :-1], tokens[:, 1:]), meter.phase))
            step_ms = meter.step_ms()
        if step >= cfg.warmup:
            for key, value in meter.clock.phases().items():
                times[key].append(value)
            times["step"].append(step_ms)
            times["host_forward_backward"].append(meter.host_forward_backward_ms)
            memory = {"after_init": after_init, **meter.memory}
    loss = float(torch.stack(losses[-cfg.steps:]).mean())
    del ddp, optimizer, model, loss_fn
    return {"times": times, "memory": memory, "at_start": at_start, "loss": loss, "param_bytes": params,
            "timer": meter.clock.timer}


def spec_columns(spec: DataParallelSpec) -> dict:
    """The spec's columns: its own (config, dp_kind, bucket_mb, optimizer_sharding) and the older
    wrapper and optimizer (adamw, sharded or zero) that earlier tables read."""
    columns = spec.to_columns()
    optimizer = "adamw" if spec.optimizer_sharding == "none" else spec.optimizer_sharding
    return {"config": columns.pop("config"), "wrapper": spec.kind, "bucket_mb": columns.pop("bucket_mb"),
            "optimizer": optimizer, **columns}


def summarize(spec: DataParallelSpec, rounds: list[dict], world: int) -> dict:
    """One row from a config's rounds: step statistics over all their measured steps, the spread of
    the per-round medians, and the memory of the last round."""
    last = rounds[-1]
    row = {**spec_columns(spec), "status": "ok", "rounds": len(rounds), "timer": last["timer"], "peak_scope": "phase",
           "mem_at_start_mib": max(r["at_start"] for r in rounds), "final_loss": last["loss"]}
    for key in last["times"]:
        values = [t for r in rounds for t in r["times"][key]]
        row[f"{key}_ms"] = statistics.fmean(values)
        row[f"{key}_std_ms"] = statistics.pstdev(values)
    row["step_median_ms"] = statistics.median(t for r in rounds for t in r["times"]["step"])
    round_medians = [statistics.median(r["times"]["step"]) for r in rounds]
    row["step_round_median_min_ms"], row["step_round_median_max_ms"] = min(round_medians), max(round_medians)
    # every round's median, so that the number of rounds a comparison needs can be computed from the spread
    row["step_round_medians_ms"] = " ".join(f"{m:.3f}" for m in round_medians)
    for point, (current, peak) in last["memory"].items():
        row[f"mem_{point}_mib"], row[f"peak_{point}_mib"] = current, peak
    row["peak_mib"] = max(row[f"peak_{point}_mib"] for point in last["memory"])
    # The accounting the measurements are compared with: float32 parameters, gradients, AdamW's two
    # moments (the moments divided among ranks when sharded; all three under the FSDP kinds).
    params = last["param_bytes"]
    fully_sharded = spec.kind in FULLY_SHARDED_KINDS
    shards = world if spec.optimizer_sharding != "none" or fully_sharded else 1
    state_shards = world if fully_sharded else 1
    row.update(param_mib=params / state_shards / 2**20, grad_mib=params / state_shards / 2**20,
               optimizer_state_mib=2 * params / shards / 2**20)
    return row


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shardings = "|".join("+" + s for s in SHARDINGS if s != "none")
    parser.add_argument("--configs", nargs="+", required=True, type=argument_type(DataParallelSpec.parse),
                        help=f"data-parallel specs KIND[:BUCKET_MB][{shardings}], one row each; KIND one of "
                             f"{', '.join(KINDS)}")
    parser.add_argument("--size", default="xl", choices=list(MODEL_SIZES), help="model size")
    parser.add_argument("--batch-size", type=int, default=4, help="per rank")
    parser.add_argument("--context-length", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--precisions", nargs="+", default=["bf16"], choices=sorted(DTYPES),
                        help="autocast dtypes, each a row per config")
    parser.add_argument("--attention", default="sdpa", choices=sorted(ATTENTION_BACKENDS),
                        help="attention backend (cs336_systems.model.attention): %(choices)s")
    parser.add_argument("--compile", default="none", choices=["none", "blocks"],
                        help="torch.compile each Transformer block (the first step of a config compiles, or finds "
                             "the graphs an earlier config of the same process compiled)")
    parser.add_argument("--adamw", default="foreach", choices=ADAMW_IMPLEMENTATIONS,
                        help="the AdamW implementation every config's optimizer updates with (sharded and "
                             "ZeroRedundancyOptimizer included)")
    parser.add_argument("--backend", default="nccl", choices=["nccl", "gloo"], help="torch.distributed backend")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per config and round")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per config and round")
    parser.add_argument("--rounds", type=int, default=1,
                        help="times the whole list of configs is run, interleaved; statistics pool all rounds")
    parser.add_argument("--trace-dir", default=None,
                        help="export a Chrome trace of each config's last step (rank 0) into this folder")
    parser.add_argument("--out", required=True, help="CSV written by rank 0")
    return parser


def config_from_args(args: argparse.Namespace) -> DDPBenchConfig:
    """The typed config of parsed flags; a ValueError naming the bad value."""
    return DDPBenchConfig(specs=tuple(args.configs), out=args.out,
                          size=args.size, batch_size=args.batch_size, context_length=args.context_length,
                          precisions=tuple(args.precisions), attention=args.attention, compile=args.compile,
                          adamw=args.adamw, backend=args.backend, lr=args.lr, warmup=args.warmup, steps=args.steps,
                          rounds=args.rounds, trace_dir=args.trace_dir)


def run(cfg: DDPBenchConfig) -> None:
    """Measure every (precision, spec) of cfg, cfg.rounds times interleaved; rank 0 writes the rows."""
    rank, world, device = init_from_env(cfg.backend)
    grid = [(precision, spec) for precision in cfg.precisions for spec in cfg.specs]
    # Rounds interleave the configs (every config once per round), so a slow spell of the machine
    # lands on all of them instead of on whichever config ran during it.
    measured: dict[tuple[str, DataParallelSpec], list[dict]] = {point: [] for point in grid}
    failed: dict[tuple[str, DataParallelSpec], str] = {}
    for round_index in range(cfg.rounds):
        for i, (precision, spec) in enumerate(grid, 1):
            if (precision, spec) in failed:
                continue
            try:
                result = run_config(spec, precision, cfg, rank, world, device)
                measured[precision, spec].append(result)
                shown = f"{statistics.median(result['times']['step']):.1f} ms/step"
            except (torch.OutOfMemoryError, RuntimeError) as error:
                if not is_oom(error):
                    raise
                failed[precision, spec] = oom_message(error)
                shown = "oom"
                # (the next config's reset_memory frees what this one held, once the exception is gone)
            if rank == 0:
                print(f"[round {round_index + 1}/{cfg.rounds}, {i}/{len(grid)}] {precision} {spec}: {shown}",
                      file=sys.stderr, flush=True)
            dist.barrier()
    rows = []
    for precision, spec in grid:
        if (precision, spec) in failed:
            row = {**spec_columns(spec), "status": "oom", "error": failed[precision, spec]}
        else:
            row = summarize(spec, measured[precision, spec], world)
        row.update(world_size=world, size=cfg.size, batch_per_rank=cfg.batch_size,
                   context_length=cfg.context_length, precision=precision, attention=cfg.attention,
                   backend=cfg.backend, compile=cfg.compile, adamw=cfg.adamw, warmup=cfg.warmup,
                   steps=cfg.steps)
        rows.append({**row, **provenance(device)})
    if rank == 0:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        write_rows(rows, cfg.out)
    shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    try:
        cfg = config_from_args(parser.parse_args(argv))
    except ValueError as error:
        parser.error(str(error))
    run(cfg)


if __name__ == "__main__":
    main()
