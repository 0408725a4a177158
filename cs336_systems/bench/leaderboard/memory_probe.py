"""Ours' checkpointing resolved per point (`AUTO`): how many blocks save their matmul outputs, from the memory a
plain selective step leaves free (model/checkpointing.py has the policy)."""

from __future__ import annotations

import contextlib
import math
import sys

import torch
import torch.distributed as dist

from cs336_systems.bench.leaderboard.config import LeaderboardConfig
from cs336_systems.bench.leaderboard.provider import (Trainee, build, fresh, local_tokens, train_step, rank_and_world)
from cs336_systems.bench.leaderboard.recipes import PASS_SEPARATOR, sequences_per_pass
from cs336_systems.model.checkpointing import matmul_block_bytes, matmul_blocks_that_fit
from cs336_systems.timing import DTYPES, synchronize


def peak_bytes(device: torch.device) -> float:
    """The allocator's peak since its last reset (NaN where the device keeps none)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else math.nan


def _capacity_bytes(config: LeaderboardConfig, device: torch.device) -> float:
    if config.memory_capacity_gib is not None:
        return config.memory_capacity_gib * 2**30
    return torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else math.nan


def pass_peaks(trainee: Trainee, inputs: torch.Tensor, targets: torch.Tensor, device: torch.device) -> list[float]:
    """One training step, the allocator's peak of each pass (forward and backward of one micro-batch; the last
    pass's includes the optimizer step), in bytes (NaN where the device keeps no peak)."""
    peaks = []

    @contextlib.contextmanager
    def peak_of_pass(phase: str):
        if phase == "forward" and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        yield
        if phase == "backward":
            peaks.append(peak_bytes(device))

    train_step(trainee, inputs, targets, peak_of_pass)
    synchronize(device)
    peaks[-1] = max(peaks[-1], peak_bytes(device))
    return peaks


def _selective_text(blocks: int) -> str:
    return f"selective:0,{blocks}" if blocks else "selective"


def probe_matmul_blocks(provider: str, batch: int, config: LeaderboardConfig, device: torch.device) -> dict:
    """Resolve `AUTO` for one point: the provider with plain selective checkpointing runs its warm-up steps
    (the first compiles), the allocator's peak of each pass is read (the largest over the steps), and the
    blocks that fit in the device's memory less that peak and `memory_margin_gib` save their matmul outputs,
    per pass: the first pass, before any gradient exists, has more room than the later ones, which hold the
    gradients accumulated so far. Columns: the policy chosen ("A then B" when the later passes' differs, see
    `pass_policies`), the blocks of the first and of the later passes, and the probe's peaks. Where no peak
    can be read (a CPU), no block saves its matmuls."""
    model_config = config.model_config()
    torch.manual_seed(0)
    trainee = build(provider, model_config, config, device, checkpoint="selective")
    inputs, targets = local_tokens(model_config.vocab_size, batch, config.context_length, device, seed=1)
    peaks = [max(step) for step in zip(*(pass_peaks(trainee, inputs, targets, device)
                                         for _ in range(config.warmup)))]
    del trainee, inputs, targets
    fresh(device)
    element = torch.empty((), dtype=DTYPES[config.param_dtype]).element_size()
    block = matmul_block_bytes(model_config.d_model, model_config.d_ff,
                               sequences_per_pass(provider, batch // rank_and_world()[1]) * config.context_length, element)
    room = _capacity_bytes(config, device) - config.memory_margin_gib * 2**30
    first = matmul_blocks_that_fit(room - peaks[0], block, model_config.num_layers)
    later = matmul_blocks_that_fit(room - max(peaks[1:]), block, model_config.num_layers) if len(peaks) > 1 else first
    if dist.is_initialized():  # every rank runs the same policy: the fewest blocks any rank has room for
        agreed = torch.tensor([first, later], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        first, later = agreed.tolist()
    policy = _selective_text(first) + (f"{PASS_SEPARATOR}{_selective_text(later)}" if later != first else "")
    print(f"  [{provider} batch={batch}] plain selective peaks at {', '.join(f'{p / 2**30:.1f}' for p in peaks)} GiB "
          f"per pass: {first} blocks save their matmul outputs in the first pass, {later} in the later ones "
          f"({policy})", file=sys.stderr, flush=True)
    return {"checkpoint": policy, "matmul_blocks": first, "matmul_blocks_later": later,
            "probe_peak_gib": max(peaks) / 2**30, "probe_first_peak_gib": peaks[0] / 2**30}

