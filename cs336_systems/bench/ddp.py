"""Data-parallel training step benchmark (handout 2.2, 2.3, 3), one rank per process under torchrun.

    torchrun --nproc_per_node 2 -m cs336_systems.bench.ddp --size xl --precisions fp32 bf16 \
        --configs none naive flat individual bucketed:1 bucketed:100 torch_ddp --out ddp.csv

A config is WRAPPER[:BUCKET_MB][+OPTIMIZER]: wrapper none (each rank trains alone: the single-GPU
speed), naive, flat, individual, bucketed:MB or torch_ddp; individual-thread and bucketed-thread:MB
issue their all-reduces from a worker thread instead of the gradient hooks (for comparison);
optimizer adamw (default), sharded (ours, ZeRO-1) or zero (torch's
ZeroRedundancyOptimizer). Each rank gets its own slice of a global batch.
Per step it times forward+backward, the wait for gradient communication that did not overlap the
backward pass (all of it for naive and flat), and the optimizer step, with synchronization around
each; it records memory after initialisation and just before and after the optimizer step. With
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
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._profiler import _ExperimentalConfig
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

from cs336_systems.bench.provenance import provenance
from cs336_systems.bench.results import write_rows
from cs336_systems.bench.timing import DTYPES, annotate, autocast, is_oom, oom_message, reset_memory, timed
from cs336_systems.distributed import DDPBucketed, DDPIndividualParameters, DDPNaive, ShardedOptimizer
from cs336_systems.distributed.launch import init_from_env, shutdown
from cs336_systems.model import (
    MODEL_SIZES,
    TransformerLM,
    cross_entropy,
    get_config,
)
from cs336_systems.optim import ADAMW_IMPLEMENTATIONS, adamw_implementation


def parse_config(text: str) -> tuple[str, float | None, str]:
    wrapper, _, optimizer = text.partition("+")
    wrapper, _, bucket = wrapper.partition(":")
    if wrapper not in ("none", "naive", "flat", "individual", "bucketed", "torch_ddp", "individual-thread",
                       "bucketed-thread"):
        raise ValueError(f"unknown wrapper {wrapper!r} in config {text!r}")
    if optimizer not in ("", "adamw", "sharded", "zero"):
        raise ValueError(f"unknown optimizer {optimizer!r} in config {text!r}")
    bucket_mb = float(bucket) if bucket else None
    if bucket_mb is not None and bucket_mb <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket} in config {text!r}")
    return wrapper, bucket_mb, optimizer or "adamw"


def wrap(model: torch.nn.Module, wrapper: str, bucket_mb: float | None, device: torch.device):
    if wrapper == "none":
        return model
    if wrapper in ("naive", "flat"):
        return DDPNaive(model, flat=wrapper == "flat")
    background = wrapper.endswith("-thread")
    if wrapper.startswith("individual"):
        return DDPIndividualParameters(model, background_issue=background)
    if wrapper.startswith("bucketed"):
        return DDPBucketed(model, bucket_mb, background_issue=background)
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   bucket_cap_mb=bucket_mb or 25)


def make_optimizer(name: str, model: torch.nn.Module, lr: float, adamw: str = "foreach"):
    """The config's optimizer (adamw, sharded or zero), each updating with the same AdamW implementation
    (one of ADAMW_IMPLEMENTATIONS), so that sharded and unsharded steps differ only in the sharding."""
    optimizer_class, extra = adamw_implementation(adamw)
    if name == "sharded":
        return ShardedOptimizer(model.parameters(), optimizer_class, lr=lr, **extra)
    if name == "zero":
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class, lr=lr, **extra)
    return optimizer_class(model.parameters(), lr=lr, **extra)


def memory_mib(device: torch.device) -> tuple[float, float]:
    if device.type != "cuda":
        return float("nan"), float("nan")
    return torch.cuda.memory_allocated(device) / 2**20, torch.cuda.max_memory_allocated(device) / 2**20


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


def run_config(text: str, args, rank: int, world: int, device: torch.device) -> dict:
    """One round of one config: build, warm up, measure args.steps steps. Returns the per-step times,
    the memory readings and the mean loss of the measured steps."""
    wrapper, bucket_mb, opt_name = parse_config(text)
    torch.manual_seed(rank)  # ranks start apart; the wrappers broadcast rank 0's weights
    reset_memory(device)  # frees what the previous config left, reference cycles included
    # Memory still allocated before this config builds anything: 0 unless an earlier config leaked.
    at_start = torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
    with device:
        model = TransformerLM(get_config(args.size, context_length=args.context_length, attention=args.attention))
    if args.compile == "blocks":  # before wrapping: the wrappers' gradient hooks sit on the parameters
        model.compile_blocks()
    ddp = wrap(model, wrapper, bucket_mb, device)
    optimizer = make_optimizer(opt_name, model, args.lr, args.adamw)
    after_init = memory_mib(device)
    data = torch.Generator(device="cpu").manual_seed(1234)  # the same global batches on every rank
    times = {"forward_backward": [], "communication": [], "optimizer": [], "step": []}
    memory = {}
    losses = []
    sync = getattr(ddp, "finish_gradient_synchronization", lambda: None)
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(model.config.vocab_size, (args.batch_size * world, args.context_length + 1),
                               generator=data).chunk(world)[rank].to(device)
        if isinstance(ddp, DDPBucketed):
            ddp.reset()
        optimizer.zero_grad(set_to_none=True)

        def forward_backward():
            with annotate("forward"), autocast(args.precision, device):
                loss = cross_entropy(ddp(tokens[:, :-1]), tokens[:, 1:])
            with annotate("backward"):
                loss.backward()
            losses.append(loss.detach())

        tracing = args.trace_dir and rank == 0 and step == args.warmup + args.steps - 1
        with trace_to(Path(args.trace_dir) / f"{text}_{args.precision}.json" if tracing else None, device):
            parts = {"forward_backward": timed(forward_backward, device), "communication": timed(sync, device)}
            before_step = memory_mib(device)
            parts["optimizer"] = timed(optimizer.step, device)
            after_step = memory_mib(device)
        if step >= args.warmup:
            for key, value in parts.items():
                times[key].append(value)
            times["step"].append(sum(parts.values()))
            memory = {"after_init": after_init, "before_step": before_step, "after_step": after_step}
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    loss = float(torch.stack(losses[-args.steps:]).mean())
    del ddp, optimizer, model
    return {"times": times, "memory": memory, "at_start": at_start, "loss": loss, "param_bytes": params}


def summarize(text: str, rounds: list[dict], world: int) -> dict:
    """One row from a config's rounds: step statistics over all their measured steps, the spread of
    the per-round medians, and the memory of the last round."""
    wrapper, bucket_mb, opt_name = parse_config(text)
    last = rounds[-1]
    row = {"config": text, "wrapper": wrapper, "bucket_mb": bucket_mb, "optimizer": opt_name, "status": "ok",
           "rounds": len(rounds), "mem_at_start_mib": max(r["at_start"] for r in rounds),
           "final_loss": last["loss"]}
    for key in last["times"]:
        values = [t for r in rounds for t in r["times"][key]]
        row[f"{key}_ms"] = statistics.fmean(values)
        row[f"{key}_std_ms"] = statistics.pstdev(values)
    row["step_median_ms"] = statistics.median(t for r in rounds for t in r["times"]["step"])
    round_medians = [statistics.median(r["times"]["step"]) for r in rounds]
    row["step_round_median_min_ms"], row["step_round_median_max_ms"] = min(round_medians), max(round_medians)
    for point, (current, peak) in last["memory"].items():
        row[f"mem_{point}_mib"], row[f"peak_{point}_mib"] = current, peak
    # The accounting the measurements are compared with: float32 parameters, gradients, AdamW's two
    # moments (divided among ranks when sharded).
    params = last["param_bytes"]
    shards = world if opt_name in ("sharded", "zero") else 1
    row.update(param_mib=params / 2**20, grad_mib=params / 2**20, optimizer_state_mib=2 * params / shards / 2**20)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", required=True)
    parser.add_argument("--size", default="xl", choices=list(MODEL_SIZES))
    parser.add_argument("--batch-size", type=int, default=4, help="per rank")
    parser.add_argument("--context-length", type=int, default=512)
    parser.add_argument("--precisions", nargs="+", default=["bf16"], choices=sorted(DTYPES))
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument("--compile", default="none", choices=["none", "blocks"],
                        help="torch.compile each Transformer block (the first step of a config compiles, or finds "
                             "the graphs an earlier config of the same process compiled)")
    parser.add_argument("--adamw", default="foreach", choices=ADAMW_IMPLEMENTATIONS,
                        help="the AdamW implementation every config's optimizer updates with (sharded and "
                             "ZeroRedundancyOptimizer included)")
    parser.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="measured steps per config and round")
    parser.add_argument("--rounds", type=int, default=1,
                        help="times the whole list of configs is run, interleaved; statistics pool all rounds")
    parser.add_argument("--trace-dir", default=None,
                        help="export a Chrome trace of each config's last step (rank 0) into this folder")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        for text in args.configs:
            parse_config(text)
    except ValueError as error:
        parser.error(str(error))
    if args.rounds < 1 or args.steps < 1:
        parser.error(f"--rounds {args.rounds} and --steps {args.steps} must both be at least 1")
    rank, world, device = init_from_env(args.backend)
    grid = [(precision, text) for precision in args.precisions for text in args.configs]
    # Rounds interleave the configs (every config once per round), so a slow spell of the machine
    # lands on all of them instead of on whichever config ran during it.
    measured: dict[tuple[str, str], list[dict]] = {point: [] for point in grid}
    failed: dict[tuple[str, str], str] = {}
    for round_index in range(args.rounds):
        for i, (precision, text) in enumerate(grid, 1):
            if (precision, text) in failed:
                continue
            args.precision = precision
            try:
                result = run_config(text, args, rank, world, device)
                measured[precision, text].append(result)
                shown = f"{statistics.median(result['times']['step']):.1f} ms/step"
            except (torch.OutOfMemoryError, RuntimeError) as error:
                if not is_oom(error):
                    raise
                failed[precision, text] = oom_message(error)
                shown = "oom"
                # (the next config's reset_memory frees what this one held, once the exception is gone)
            if rank == 0:
                print(f"[round {round_index + 1}/{args.rounds}, {i}/{len(grid)}] {precision} {text}: {shown}",
                      file=sys.stderr, flush=True)
            dist.barrier()
    rows = []
    for precision, text in grid:
        if (precision, text) in failed:
            row = {"config": text, "status": "oom", "error": failed[precision, text]}
        else:
            row = summarize(text, measured[precision, text], world)
        row.update(world_size=world, size=args.size, batch_per_rank=args.batch_size,
                   context_length=args.context_length, precision=precision, attention=args.attention,
                   backend=args.backend, compile=args.compile, adamw=args.adamw, warmup=args.warmup,
                   steps=args.steps)
        rows.append({**row, **provenance(device)})
    if rank == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_rows(rows, args.out)
    shutdown()


if __name__ == "__main__":
    main()
