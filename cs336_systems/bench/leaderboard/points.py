"""The timed points of a run: each (batch, provider) built, its warm-up and timed steps run (ours' checkpointing first
resolved by the memory probe), optionally one more step under the profiler, and its row (out of memory is a row)."""

from __future__ import annotations

import math
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from cs336_systems.bench import step_profile
from cs336_systems.bench.gpu_clock import ClockSampler
from cs336_systems.bench.leaderboard import handout_timer, memory_probe
from cs336_systems.bench.leaderboard.config import LeaderboardConfig
from cs336_systems.bench.leaderboard.provider import (Trainee, batch_mean, build, forwards, fresh, local_tokens,
                                                      recipe_columns, train_step, rank_and_world)
from cs336_systems.bench.leaderboard.recipes import AUTO, recipe
from cs336_systems.model import leaderboard_flops
from cs336_systems.provenance import device_name
from cs336_systems.timing import is_oom, oom_row, peak_flops, summarize, synchronize, timed


def profile_one_step(trainee: Trainee, inputs: torch.Tensor, targets: torch.Tensor, config: LeaderboardConfig,
                     device: torch.device, name: str) -> list[dict]:
    """One more step under the profiler (bench/step_profile.py), its snapshot as DIR/NAME.pickle on CUDA. Where
    recording the allocator's history breaks the step (torch 2.11's SystemError when non-reentrant checkpoints
    recompute a compiled region, pytorch/pytorch#179536: the anchors, `ours-full_ac`), the step is profiled again
    without it (no snapshot; the times and memory rows stand). Any other failure of the profiled step (out of memory
    under the profiler's bookkeeping, say) becomes one `error` row naming it: the point's timed steps stand."""
    parts = {"zero_grad": lambda: trainee.optimizer.zero_grad(set_to_none=True),
             "forwards": forwards(trainee, inputs, targets), "optimizer": trainee.optimizer.step}
    snapshot = Path(config.profile_dir) / f"{name}.pickle"
    failure = None
    for history in (True, False):
        try:
            rows = step_profile.profile_step(parts, trainee.model, trainee.parameters.values(), trainee.optimizer,
                                             device, snapshot, history=history)
        except Exception as error:  # noqa: BLE001: whatever the profiler breaks, the point's timed row is kept
            failure = error
        else:
            print(f"  [{name}] profiled step: {rows[-len(step_profile.MEMORY) - 1]['value']:.1f} ms", file=sys.stderr,
                  flush=True)
            return rows
        if not (history and isinstance(failure, SystemError)):
            break
        print(f"  [{name}] profiled step failed with the allocator's history recorded ({failure}; "
              "pytorch/pytorch#179536): profiling it again without", file=sys.stderr, flush=True)
        failure = None  # let the failed step's frames (and the tensors they hold) go before the next try
        fresh(device)
    print(f"  [{name}] profiled step failed: {type(failure).__name__}: {failure}", file=sys.stderr, flush=True)
    traceback.print_exception(failure, file=sys.stderr)  # where it broke, for the log (the row keeps the message)
    return [{"kind": "error", "category": "profiled step", "value": math.nan, "unit": "",
             "tool": f"{type(failure).__name__}: {str(failure)[:300]}"}]


def _loop_timed(one_step: Callable[[], None], config: LeaderboardConfig, device: torch.device, name: str
                ) -> tuple[float, list[float], float]:
    """The bench's timer: --warmup untimed steps (the first compiles), then --steps timed ones, synchronizing around
    each. (first step's ms, the timed steps' ms, the wall-clock time the timed steps began)."""
    times = []
    total = config.warmup + config.steps
    for step in range(total):
        if step == config.warmup:
            timed_from = time.time()
        times.append(timed(one_step, device))
        phase = "first (compile)" if step == 0 else "warm-up" if step < config.warmup else "timed"
        print(f"  [{name}] step {step + 1}/{total} ({phase}): {times[-1]:.1f} ms", file=sys.stderr, flush=True)
    return times[0], times[config.warmup:], timed_from


def _handout_timed(one_step: Callable[[], None], config: LeaderboardConfig, device: torch.device
                   ) -> tuple[float, list[float], float]:
    """The leaderboard's timer (handout_timer.do_bench_times) around the whole step; do_bench's first call, which
    compiles, timed on its own. (first step's ms, do_bench's times in ms, the wall-clock time its first call ended)."""
    first: list[tuple[float, float]] = []

    def step():
        if first:
            one_step()
        else:
            first.append((timed(one_step, device), time.time()))

    times = handout_timer.do_bench_times(step, config.do_bench_warmup_ms, config.do_bench_rep_ms)
    print(f"  [do_bench] first call {first[0][0]:.1f} ms, {len(times)} timed: mean {sum(times) / len(times):.1f} ms",
          file=sys.stderr, flush=True)
    return first[0][0], times, first[0][1]


def measure(provider: str, batch: int, config: LeaderboardConfig, device: torch.device) -> dict:
    """Build the provider, run its steps, and return the timing columns (times in ms); ours' checkpointing
    first resolved by `probe_matmul_blocks`."""
    model_config = config.model_config()
    probe = memory_probe.probe_matmul_blocks(provider, batch, config, device) if recipe(provider).checkpoint == AUTO else {}
    torch.manual_seed(0)
    trainee = build(provider, model_config, config, device, checkpoint=probe.get("checkpoint"))
    inputs, targets = local_tokens(model_config.vocab_size, batch, config.context_length, device, seed=1)
    loss = None

    def one_step():
        nonlocal loss
        loss = train_step(trainee, inputs, targets)

    with ClockSampler.for_device(device) as clocks:
        if config.timer == "do_bench":
            first_ms, times, timed_from = _handout_timed(one_step, config, device)
        else:
            first_ms, times, timed_from = _loop_timed(one_step, config, device, f"{provider} batch={batch}")
        synchronize(device)
        timed_to = time.time()
    clock = clocks.window(timed_from, timed_to)
    summary = summarize(times)
    # the timed steps' peak, read before the profiled step resets the allocator's peak for its own
    peak = memory_probe.peak_bytes(device) / 2**30
    profiled = profile_one_step(trainee, inputs, targets, config, device, f"{provider}_b{batch}") \
        if config.profile_dir else []
    return {**probe, "profile_rows": profiled,
            "step_ms": summary["mean_ms"], "step_std_ms": summary["std_ms"], "step_median_ms": summary["median_ms"],
            "n_steps": summary["n"], "first_step_s": first_ms / 1e3, "loss": batch_mean(loss).item(),
            "peak_mem_gib": peak, "sm_clock_mhz": clock["sm_clock_mhz"], "power_w": clock["power_w"]}


def _timer_columns(config: LeaderboardConfig) -> dict:
    """How the row's step was timed: the bench's loop (its warm-up steps) or do_bench (its warm-up and repetition
    times in ms), and whether the run began from empty compilation caches."""
    if config.timer == "do_bench":
        return {"timer": "do_bench", "warmup": math.nan, "do_bench_warmup_ms": config.do_bench_warmup_ms,
                "do_bench_rep_ms": config.do_bench_rep_ms, "cold_cache": config.cold_cache}
    return {"timer": "steps", "warmup": config.warmup, "cold_cache": config.cold_cache}


def run_point(provider: str, batch: int, config: LeaderboardConfig, device: torch.device) -> dict:
    """One (batch, provider) row; out of memory becomes a status=oom row."""
    model_config = config.model_config()
    flops = leaderboard_flops(model_config, batch, config.context_length)
    world = rank_and_world()[1]
    base = {**recipe_columns(provider, config, batch), "size": config.size, "world_size": world, "batch": batch,
            "context_length": config.context_length, "flops": flops, **_timer_columns(config)}
    fresh(device)
    try:
        result = measure(provider, batch, config, device)
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if not is_oom(error):
            raise
        row = oom_row(base, error)
        profiled = []
    else:
        profiled = result.pop("profile_rows")
        seconds = result["step_ms"] / 1e3
        tflops = flops / seconds / 1e12
        row = {**base, **result, "tflops": tflops,
               "mfu": tflops * 1e12 / (world * peak_flops(device_name(device), "bf16")), "status": "ok"}
    fresh(device)  # the frames of a failed step are gone once the except block is left
    row["run_wall_s"] = handout_timer.process_age_s()  # the leaderboard allows 10 minutes from an empty cache
    row["profile_rows"] = [{"provider": provider, "batch": batch, "context_length": config.context_length,
                            "size": config.size, **r} for r in profiled]
    return row

