"""The 2026 leaderboard step (handout 2026 §9, issue 24): one whole training step of the 8B model, ours
against the plain-PyTorch anchors, in one process on one GPU.

The step is the handout's: `zero_grad(set_to_none=True)`, forward, cross-entropy, backward, AdamW `step()`,
on random token ids, bf16 parameters built directly on the GPU. Providers, run one after another (each
model freed, with its compiled code, before the next is built):

- `ours`: our `TransformerLM` in bf16 with our FlashAttention (`flash_triton`: on sm_90 the Gluon kernels), our
  fused LM head + cross-entropy (`lm_loss(..., fused=True)`), our fused Triton AdamW (moments in the parameters'
  dtype), selective activation checkpointing with as many blocks saving their matmul outputs as the free memory
  holds (`AUTO`: per point and per pass, a plain selective probe's peaks decide, `probe_matmul_blocks`; the rows'
  `checkpoint` column is the policy chosen, "A then B" where the first pass's differs from the later ones'), per-block compilation, applied by `parallelize(model, ParallelPlan)`, and
  gradient accumulation over one sequence at a time (`microbatch` 1, `train_step.microbatches`): the loss and
  gradients of the whole batch, with one sequence's activations at a time, so that at batch 2 as many blocks
  save their matmul outputs as at batch 1 (less the gradients' memory, which the second pass holds);
- `torch_plain_sac`, `torch_plain_ac`: the plain-PyTorch anchor (`bench/plain_model.py`: fused QKV, SDPA,
  per-block compile, chunked checkpointed LM head + CE, `torch.optim.AdamW(fused=True)`) with torchtitan's
  selective checkpointing, or full per-block checkpointing;
- ablations of ours, each changing one thing: `ours-no_fused_ce` (the plain CE of the full logits),
  `ours-torch_adamw` (torch's fused AdamW), `ours-sdpa_attention` (SDPA instead of our kernel),
  `ours-full_ac` (every block fully recomputed), `ours-selective` (plain selective checkpointing: no block
  saves its matmul outputs), `ours-whole_batch` (forward and backward over the whole batch at once, no
  gradient accumulation) and `ours-fp32_moments` (the numerics variant: float32 AdamW moments beside the
  bf16 parameters);
- `ours-keep:N` and `ours-mm:N` (any N from 1 to the model's layers, parsed from the name): what the memory
  that selective checkpointing leaves free buys. keep: the first N blocks not checkpointed
  (`CheckpointPolicy.selective(N)`); mm: the first N blocks checkpointed but saving their matrix products'
  outputs, so their rerun skips every GEMM (`CheckpointPolicy.selective(0, N)`); the other blocks selective.

With `--profile DIR`, each point runs one more step under the profiler after its timed ones
(`bench/step_profile.py`): device time by category (attention forward/backward, GEMM, loss, optimizer,
elementwise, copies, recomputation), the step's wall time, and peak memory split into parameters, gradients,
optimizer state and the rest, as rows of DIR/../leaderboard_8b_profile.csv (or `--profile-out`); on CUDA the
step's allocator snapshot is DIR/<provider>_b<batch>.pickle.

Each (batch, provider) point runs `warmup` untimed steps (the first one, compilation and autotuning
included, is reported as `first_step_s`) and `steps` timed ones, synchronizing around each, and becomes
one row: mean, std and median step time, TFLOP/s and MFU from the mean against the device's dense bf16
peak (`timing.peak_flops`), with FLOPs from `model.accounting.leaderboard_flops` (6 x non-embedding matmul
parameters incl. the LM head x tokens + 6 x layers x tokens x context x d_model; recomputation not
counted), peak memory, the SM clock and board power averaged over the timed steps (`sm_clock_mhz`, `power_w`:
`bench.gpu_clock`, NaN without nvidia-smi), and provenance. Out of memory is a row (status=oom) and the run goes
on.

Before the timings, a correctness check at a scaled-down config with the same code paths (`--check-size
scaled`: 2 layers, d_model 256, head dim 128, the 8B vocabulary; `tiny` on the CPU): every main provider and
a float32 plain reference are given the same weights (rounded to the run's parameter dtype) and tokens;
each provider's loss and every gradient are compared with the float32 reference, and must be within 2x
the error of the plain model run eagerly in the same dtype without checkpointing (what torch itself gets
in that dtype), or within the dtype's floor (`CHECK_FLOORS`). One row per provider, status check_ok or
check_fail.

    python -m cs336_systems.bench.leaderboard --out results/leaderboard_8b.csv     # 8B, batch 2 and 1, 32768
    python -m cs336_systems.bench.leaderboard --size tiny --context 32 --batch 2 --compile none \\
        --param-dtype fp32 --check-size tiny --check-context 32 --warmup 1 --steps 1 --device cpu --out /tmp/lb.csv

On the CPU our kernels run under Triton's interpreter, which cannot multiply bfloat16: use fp32 there.

Two GPUs (the handout's setting) are a data-parallel spec away: under torchrun each rank takes its GPU and an equal
share of every batch, ours replicates with the given DDP kind and the anchors with torch DDP; the check compares
each rank's averaged gradients with the one-process reference of the whole batch; rank 0 writes the rows (FLOPs
and TFLOP/s of the whole batch, MFU against the ranks' summed peak, `world_size`, `data_parallel`):

    torchrun --standalone --nproc_per_node 2 -m cs336_systems.bench.leaderboard --batch 2 \
        --data-parallel bucketed:100 --out leaderboard_8b_2gpu.csv

A rank's share runs in one pass there (`check_world`), and an out-of-memory on one rank leaves the others
waiting in a collective, so a point that does not fit ends the run instead of becoming a row.

As a library: `run(LeaderboardConfig(...), "out.csv")`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from cs336_systems.bench import step_profile
from cs336_systems.bench.checks import check_known, check_not_empty, check_positive
from cs336_systems.bench.cli import add_device_argument, config_or_usage_error, positive_int
from cs336_systems.bench.gpu_clock import ClockSampler
from cs336_systems.bench.plain_model import DEFAULT_CHUNK_TOKENS, PlainTransformerLM, plain_state_dict
from cs336_systems.distributed.launch import init_from_env, shutdown
from cs336_systems.distributed.parallelize import DataParallelSpec, ParallelPlan, apply_data_parallel, parallelize
from cs336_systems.model import (CheckpointPolicy, ModelConfig, TransformerLM, get_config, leaderboard_flops,
                                 parameter_count)
from cs336_systems.model.checkpointing import matmul_block_bytes, matmul_blocks_that_fit, switch_selective
from cs336_systems.optim import AdamW
from cs336_systems.provenance import device_name, provenance
from cs336_systems.results import PartialRows
from cs336_systems.train_step import lm_loss, microbatches
from cs336_systems.timing import (
    DTYPES,
    is_oom,
    oom_row,
    peak_flops,
    reset_memory,
    resolve_device,
    summarize,
    synchronize,
    timed,
)


@dataclass(frozen=True)
class Recipe:
    """What a provider runs.

    model: "ours" (TransformerLM) or "plain" (bench/plain_model.py);
    attention: ours' attention backend (the plain model always calls SDPA);
    loss: "fused" (our LM head + CE kernel), "full_logits" (plain CE of the whole logits) or "chunked"
        (the plain model's chunked, checkpointed head + CE);
    optimizer: "ours_fused" (cs336_systems.optim.AdamW, fused Triton) or "torch_fused";
    checkpoint: ours: a CheckpointPolicy text ("selective", "every:1"); plain: "sac" or "ac";
    moments: "param" (AdamW moments in the parameters' dtype) or "fp32";
    microbatch: sequences per forward and backward pass, their gradients accumulated (None: the whole batch)."""

    model: str
    attention: str
    loss: str
    optimizer: str
    checkpoint: str
    moments: str = "param"
    microbatch: int | None = None


# Ours' checkpointing: selective, with as many of the blocks saving their matmul outputs as the memory left free
# by a plain selective step holds, chosen per point by `probe_matmul_blocks` (model/checkpointing.py has the policy).
AUTO = "selective:auto"
# A policy per pass, for the first pass and the later ones (`pass_policies`): "selective:0,27 then selective:0,21".
PASS_SEPARATOR = " then "
# The correctness check's model has 2 blocks: in the first pass both save their matmul outputs, in the later
# ones one of them, the other plain selective (both paths, and the switch between passes).
CHECK_CHECKPOINT = f"selective:0,2{PASS_SEPARATOR}selective:0,1"
OURS = Recipe("ours", "flash_triton", "fused", "ours_fused", AUTO, microbatch=1)
PLAIN_SAC = Recipe("plain", "sdpa", "chunked", "torch_fused", "sac")
PROVIDERS: dict[str, Recipe] = {
    "ours": OURS,
    "torch_plain_sac": PLAIN_SAC,
    "torch_plain_ac": replace(PLAIN_SAC, checkpoint="ac"),
}
# Each ablation switches one of ours' choices off (or, for the moments, changes the numerics).
ABLATIONS: dict[str, Recipe] = {
    "ours-no_fused_ce": replace(OURS, loss="full_logits"),
    "ours-torch_adamw": replace(OURS, optimizer="torch_fused"),
    "ours-sdpa_attention": replace(OURS, attention="sdpa"),
    "ours-full_ac": replace(OURS, checkpoint="every:1"),
    "ours-fp32_moments": replace(OURS, moments="fp32"),
    "ours-selective": replace(OURS, checkpoint="selective"),
    "ours-whole_batch": replace(OURS, microbatch=None),
}
RECIPES = {**PROVIDERS, **ABLATIONS}
# Ablations that use the memory selective checkpointing leaves free, sized by N in their name: the policy
# text each one gives ours (model/checkpointing.py, CheckpointPolicy.parse).
SIZED_ABLATIONS = {"ours-keep:": "selective:{}", "ours-mm:": "selective:0,{}"}


def _sized(name: str) -> tuple[str, int] | None:
    """(prefix, N) of an `ours-keep:N` or `ours-mm:N` name (None for any other name); a ValueError naming a
    bad N."""
    for prefix in SIZED_ABLATIONS:
        if name.startswith(prefix):
            text = name.removeprefix(prefix)
            if not text.isdigit() or int(text) < 1:
                raise ValueError(f"ablation {name!r}: {prefix}N needs N, a number of blocks, a positive integer; "
                                 f"got {text!r}")
            return prefix, int(text)
    return None


def sized_blocks(name: str) -> int | None:
    """N of a sized ablation's name (None for any other name)."""
    sized = _sized(name)
    return sized and sized[1]


def recipe(provider: str) -> Recipe:
    """A provider's recipe: a named one, or ours with the checkpoint policy of a sized ablation."""
    sized = _sized(provider)
    if sized is not None:
        return replace(OURS, checkpoint=SIZED_ABLATIONS[sized[0]].format(sized[1]))
    if provider not in RECIPES:
        raise ValueError(f"unknown provider {provider!r}; known: {', '.join(RECIPES)}, "
                         f"{', '.join(p + 'N' for p in SIZED_ABLATIONS)}")
    return RECIPES[provider]

COMPILE_MODES = ("blocks", "none")
ANCHOR_DATA_PARALLEL = DataParallelSpec.parse("torch_ddp")

# The correctness check's model: the 8B model's head dim (128), vocabulary and d_ff / d_model ratio at
# 2 layers of d_model 256; or the tiny size on the CPU.
CHECK_SIZES = ("scaled", "tiny", "none")
SCALED_CHECK = ModelConfig(d_model=256, d_ff=688, num_layers=2, num_heads=2, vocab_size=151936)
# Tolerance floors of the check (relative L2 error of a gradient; relative error of the loss): below
# these, an error is within the dtype's rounding whatever the plain model's own error happens to be.
CHECK_FLOORS = {"bf16": {"grad": 1e-2, "loss": 2**-8}, "fp32": {"grad": 1e-4, "loss": 1e-5}}


@dataclass(frozen=True)
class LeaderboardConfig:
    """One run: the main providers at each batch, the ablations at each of `ablation_batches` (None: the
    last of `batches`, the cheapest by default), after the correctness check. Checked on construction (a
    ValueError naming the bad value)."""

    size: str = "8B"
    batches: tuple[int, ...] = (2, 1)
    context_length: int = 32768
    providers: tuple[str, ...] = tuple(PROVIDERS)
    ablations: tuple[str, ...] = tuple(ABLATIONS)
    ablation_batches: tuple[int, ...] | None = None
    warmup: int = 2
    steps: int = 3
    compile: str = "blocks"
    param_dtype: str = "bf16"
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    check_size: str = "scaled"
    check_context: int = 1024
    check_batch: int = 2
    lr: float = 1e-4
    memory_margin_gib: float = 4.0
    memory_capacity_gib: float | None = None
    profile_dir: str | None = None
    profile_out: str | None = None
    data_parallel: str = "none"
    device: str = field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")

    def __post_init__(self):
        check_not_empty("batches", self.batches)
        check_positive("batch", *self.batches, *(self.ablation_batches or ()))
        for batch in self.ablation_batches or ():
            if batch not in self.batches:
                raise ValueError(f"ablation batch {batch} is not one of the batches {self.batches}")
        check_positive("context length", self.context_length, self.check_context, self.check_batch)
        check_known("provider", self.providers, PROVIDERS)
        check_known("ablation", [a for a in self.ablations if sized_blocks(a) is None], ABLATIONS)
        layers = self.model_config().num_layers
        for name in self.ablations:
            if (sized_blocks(name) or 0) > layers:
                raise ValueError(f"ablation {name!r} names {sized_blocks(name)} blocks; size {self.size!r} has "
                                 f"{layers}")
        if self.profile_out is not None and self.profile_dir is None:
            raise ValueError(f"profile output {self.profile_out!r} given without a profile folder (--profile DIR)")
        check_known("compile mode", [self.compile], COMPILE_MODES)
        spec = self.data_parallel_spec()  # a ValueError naming a bad spec
        if spec.kind in ("fsdp", "torch_fsdp2") or spec.optimizer_sharding != "none":
            raise ValueError(f"data parallelism {self.data_parallel!r}: the leaderboard replicates the model (a DDP "
                             "kind without optimizer sharding, e.g. bucketed:100 or torch_ddp)")
        if spec.kind != "none" and self.profile_dir is not None:
            raise ValueError(f"--profile with data parallelism {self.data_parallel!r}: profile one rank's step without it")
        check_known("parameter dtype", [self.param_dtype], ("bf16", "fp32"))
        check_known("check size", [self.check_size], CHECK_SIZES)
        check_positive("warm-up steps (the first step compiles, so at least 1)", self.warmup)
        check_positive("timed steps", self.steps)
        check_positive("chunk tokens", self.chunk_tokens)
        check_positive("learning rate", self.lr)
        check_positive("memory margin (GiB)", self.memory_margin_gib)
        if self.memory_capacity_gib is not None:
            check_positive("memory capacity (GiB)", self.memory_capacity_gib)
        self.model_config()  # an unknown size raises here
        resolve_device(self.device)

    def data_parallel_spec(self) -> DataParallelSpec:
        """`data_parallel` parsed (checked on construction)."""
        return DataParallelSpec.parse(self.data_parallel)

    def model_config(self) -> ModelConfig:
        return get_config(self.size, edition="2026", context_length=self.context_length)

    def check_config(self) -> ModelConfig:
        base = SCALED_CHECK if self.check_size == "scaled" else get_config(self.check_size, edition="2026")
        return base.replace(context_length=self.check_context)

    def profile_csv(self) -> Path | None:
        """Where the profile rows go: `profile_out`, else leaderboard_8b_profile.csv beside the profile folder."""
        if self.profile_dir is None:
            return None
        return Path(self.profile_out or Path(self.profile_dir).parent / "leaderboard_8b_profile.csv")

    def points(self) -> list[tuple[int, str]]:
        """(batch, provider) in the order they run."""
        ablation_batches = self.batches[-1:] if self.ablation_batches is None else self.ablation_batches
        return [(batch, name) for batch in self.batches
                for name in (*self.providers, *(self.ablations if batch in ablation_batches else ()))]


# ---- building a provider ----------------------------------------------------------------------------


@dataclass
class Trainee:
    """A built provider: its loss on (token_ids, targets), its optimizer, and its parameters by name
    (`as_plain_names` maps a name → tensor dict of them to the plain model's names, for the check)."""

    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: torch.optim.Optimizer
    parameters: dict[str, nn.Parameter]
    as_plain_names: Callable[[dict], dict]
    model: nn.Module | None = None  # the unwrapped model (the profiler hooks its final norm)
    microbatch: int | None = None  # sequences per forward and backward pass (None: the whole batch)
    pass_policies: tuple[CheckpointPolicy, ...] = ()  # (first pass's, later passes') selective policies, or none
    wrapper: nn.Module | None = None  # the data-parallel wrapper, whose two loop hooks the step calls

    def gradients(self) -> dict[str, torch.Tensor]:
        return self.as_plain_names({name: p.grad for name, p in self.parameters.items()})


def make_optimizer(recipe: Recipe, params, lr: float) -> torch.optim.Optimizer:
    if recipe.optimizer == "torch_fused":
        if recipe.moments != "param":
            raise ValueError(f"torch's AdamW keeps its moments in the parameters' dtype; {recipe} asks for "
                             f"{recipe.moments}")
        return torch.optim.AdamW(params, lr=lr, fused=True)
    state_dtype = torch.float32 if recipe.moments == "fp32" else None
    return AdamW(params, lr=lr, fused=True, state_dtype=state_dtype)


def pass_policies(text: str) -> tuple[CheckpointPolicy, ...]:
    """The policy of each pass from a checkpoint text: one policy, or "FIRST then LATER" (selective both: the
    first pass's, then every later pass's)."""
    policies = tuple(CheckpointPolicy.parse(part) for part in text.split(PASS_SEPARATOR))
    if len(policies) > 2 or (len(policies) == 2 and any(p.kind != "selective" for p in policies)):
        raise ValueError(f"checkpoint {text!r}: one policy, or two selective ones as 'FIRST{PASS_SEPARATOR}LATER'")
    return policies


def build_ours(recipe: Recipe, model_config: ModelConfig, config: LeaderboardConfig, device: torch.device,
               weights: dict | None = None) -> Trainee:
    model = TransformerLM(model_config.replace(attention=recipe.attention), dtype=DTYPES[config.param_dtype],
                          device=device)
    if weights is not None:
        model.load_state_dict(weights)
    parameters = dict(model.named_parameters())  # before wrapping: the names of TransformerLM itself
    if recipe.checkpoint == AUTO:
        raise ValueError(f"{AUTO!r} is resolved per point (probe_matmul_blocks) before ours is built; build() "
                         "takes the resolved policy as `checkpoint`")
    policies = pass_policies(recipe.checkpoint)
    plan = ParallelPlan(compile=config.compile, checkpoint=policies[0],
                        data_parallel=config.data_parallel_spec())
    wrapped = parallelize(model, plan, device)
    fused = recipe.loss == "fused"
    return Trainee(loss=lambda x, y: lm_loss(wrapped, x, y, fused=fused),
                   optimizer=make_optimizer(recipe, model.parameters(), config.lr),
                   parameters=parameters, as_plain_names=plain_state_dict, model=model, microbatch=recipe.microbatch,
                   pass_policies=policies if len(policies) > 1 else (), wrapper=wrapped)


def build_plain(recipe: Recipe, model_config: ModelConfig, config: LeaderboardConfig, device: torch.device,
                weights: dict | None = None) -> Trainee:
    model = PlainTransformerLM(model_config, checkpoint=recipe.checkpoint, dtype=DTYPES[config.param_dtype],
                               device=device, chunk_tokens=config.chunk_tokens)
    if weights is not None:
        model.load_state_dict(plain_state_dict(weights))
    if config.compile == "blocks":
        model.compile_blocks()
    parameters = dict(model.named_parameters())
    if config.data_parallel_spec().kind == "none":
        return Trainee(loss=model.loss, optimizer=make_optimizer(recipe, model.parameters(), config.lr),
                       parameters=parameters, as_plain_names=dict, model=model)
    # with data parallelism, the anchors replicate as torch does (torch DDP), whatever ours runs
    wrapped = apply_data_parallel(model, ANCHOR_DATA_PARALLEL, device)
    return Trainee(loss=lambda x, y: wrapped(x, targets=y), optimizer=make_optimizer(recipe, model.parameters(), config.lr),
                   parameters=parameters, as_plain_names=dict, model=model, wrapper=wrapped)


def build(provider: str, model_config: ModelConfig, config: LeaderboardConfig, device: torch.device,
          weights: dict | None = None, checkpoint: str | None = None) -> Trainee:
    """The provider's model, built directly on the device in the run's dtype (with `weights`, our
    model's state dict, loaded when given; with `checkpoint`, that policy in place of its recipe's), its loss
    and its optimizer."""
    chosen = recipe(provider)
    if checkpoint is not None:
        chosen = replace(chosen, checkpoint=checkpoint)
    builder = build_ours if chosen.model == "ours" else build_plain
    return builder(chosen, model_config, config, device, weights)


def _scaled_loss(trainee: Trainee, inputs: torch.Tensor, targets: torch.Tensor, share: float,
                 policy: CheckpointPolicy | None) -> torch.Tensor:
    if policy is not None:
        switch_selective(trainee.model, policy)
    value = trainee.loss(inputs, targets)
    return value if share == 1 else value * share


def forwards(trainee: Trainee, inputs: torch.Tensor, targets: torch.Tensor) -> list[Callable[[], torch.Tensor]]:
    """The step's forward passes, one per micro-batch (`train_step.microbatches`), each returning its slice's loss
    scaled by its share of the batch: their backward passes add up to the batch's mean loss's gradients. With
    `pass_policies`, each pass first puts the blocks under its policy (the first pass's, or the later ones')."""
    slices = microbatches(inputs, targets, trainee.microbatch)
    policies = trainee.pass_policies or (None,)
    return [functools.partial(_scaled_loss, trainee, x, y, share, policies[min(i, len(policies) - 1)])
            for i, (x, y, share) in enumerate(slices)]


def forward_backward(trainee: Trainee, inputs: torch.Tensor, targets: torch.Tensor,
                     each_pass: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> torch.Tensor:
    """Forward + cross-entropy and backward of every micro-batch in turn (each inside `each_pass()`, e.g. to read
    its memory peak), inside the data-parallel wrapper's two hooks; the batch's mean loss, detached (this rank's,
    under data parallelism)."""
    if trainee.wrapper is not None:
        trainee.wrapper.on_train_batch_start()
    total = None
    for forward in forwards(trainee, inputs, targets):
        with each_pass():
            loss = forward()
            loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    if trainee.wrapper is not None:
        trainee.wrapper.finish_gradient_synchronization()
    return total


def train_step(trainee: Trainee, inputs: torch.Tensor, targets: torch.Tensor,
               each_pass: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> torch.Tensor:
    """The handout's step: zero_grad(set_to_none=True), forward + cross-entropy, backward (per micro-batch,
    gradients accumulated; `each_pass` as forward_backward's), AdamW step."""
    trainee.optimizer.zero_grad(set_to_none=True)
    loss = forward_backward(trainee, inputs, targets, each_pass)
    trainee.optimizer.step()
    return loss


def sequences_per_pass(provider: str, batch: int) -> int:
    """How many sequences one forward and backward pass of the provider holds at this batch."""
    return min(recipe(provider).microbatch or batch, batch)


def recipe_columns(provider: str, config: LeaderboardConfig, batch: int) -> dict:
    chosen = recipe(provider)
    return {"provider": provider, "model": chosen.model, "attention": chosen.attention, "loss_path": chosen.loss,
            "optimizer": chosen.optimizer, "checkpoint": chosen.checkpoint, "compile": config.compile,
            "param_dtype": config.param_dtype,
            "optimizer_state_dtype": config.param_dtype if chosen.moments == "param" else chosen.moments,
            "microbatch": sequences_per_pass(provider, batch // _world()[1]), "data_parallel": _data_parallel(provider, config)}


def _data_parallel(provider: str, config: LeaderboardConfig) -> str:
    """The data parallelism a provider runs: ours the configured spec, the plain anchors torch DDP where it is set."""
    if recipe(provider).model == "plain" and config.data_parallel != "none":
        return str(ANCHOR_DATA_PARALLEL)
    return config.data_parallel


def _fresh(device: torch.device) -> None:
    """Forget the previous provider: its compiled code (each provider compiles afresh, so its first
    step counts its own compilation) and its memory."""
    torch.compiler.reset()
    reset_memory(device)


def _world() -> tuple[int, int]:
    """(rank, world size) of the process group, or (0, 1) without one."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _tokens(vocab: int, batch: int, context: int, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.randint(vocab, (batch, context), device=device, generator=generator) for _ in range(2))


def _share(*batches: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This rank's slice of batch / world sequences of each (the whole batch without a process group)."""
    rank, world = _world()
    return tuple(t.chunk(world)[rank] for t in batches)


def _local_tokens(vocab: int, batch: int, context: int, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    """This rank's share of the batch's token ids and targets: every rank draws the whole batch from the same seed
    and keeps its slice."""
    return _share(*_tokens(vocab, batch, context, device, seed))


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
        _fresh(device)
    print(f"  [{name}] profiled step failed: {type(failure).__name__}: {failure}", file=sys.stderr, flush=True)
    traceback.print_exception(failure, file=sys.stderr)  # where it broke, for the log (the row keeps the message)
    return [{"kind": "error", "category": "profiled step", "value": math.nan, "unit": "",
             "tool": f"{type(failure).__name__}: {str(failure)[:300]}"}]


# ---- the timed points -------------------------------------------------------------------------------


def _peak_bytes(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else math.nan


def _capacity_bytes(config: LeaderboardConfig, device: torch.device) -> float:
    if config.memory_capacity_gib is not None:
        return config.memory_capacity_gib * 2**30
    return torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else math.nan


def _pass_peaks(trainee: Trainee, inputs: torch.Tensor, targets: torch.Tensor, device: torch.device) -> list[float]:
    """One training step, the allocator's peak of each pass (forward and backward of one micro-batch; the last
    pass's includes the optimizer step), in bytes (NaN where the device keeps no peak)."""
    peaks = []

    @contextlib.contextmanager
    def peak_of_pass():
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        yield
        peaks.append(_peak_bytes(device))

    train_step(trainee, inputs, targets, peak_of_pass)
    synchronize(device)
    peaks[-1] = max(peaks[-1], _peak_bytes(device))
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
    inputs, targets = _local_tokens(model_config.vocab_size, batch, config.context_length, device, seed=1)
    peaks = [max(step) for step in zip(*(_pass_peaks(trainee, inputs, targets, device)
                                         for _ in range(config.warmup)))]
    del trainee, inputs, targets
    _fresh(device)
    element = torch.empty((), dtype=DTYPES[config.param_dtype]).element_size()
    block = matmul_block_bytes(model_config.d_model, model_config.d_ff,
                               sequences_per_pass(provider, batch // _world()[1]) * config.context_length, element)
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


def measure(provider: str, batch: int, config: LeaderboardConfig, device: torch.device) -> dict:
    """Build the provider, run its steps, and return the timing columns (times in ms); ours' checkpointing
    first resolved by `probe_matmul_blocks`."""
    model_config = config.model_config()
    probe = probe_matmul_blocks(provider, batch, config, device) if recipe(provider).checkpoint == AUTO else {}
    torch.manual_seed(0)
    trainee = build(provider, model_config, config, device, checkpoint=probe.get("checkpoint"))
    inputs, targets = _local_tokens(model_config.vocab_size, batch, config.context_length, device, seed=1)
    times = []
    total = config.warmup + config.steps
    with ClockSampler.for_device(device) as clocks:
        for step in range(total):
            loss = None

            def one_step():
                nonlocal loss
                loss = train_step(trainee, inputs, targets)

            if step == config.warmup:
                timed_from = time.time()
            times.append(timed(one_step, device))
            phase = "first (compile)" if step == 0 else "warm-up" if step < config.warmup else "timed"
            print(f"  [{provider} batch={batch}] step {step + 1}/{total} ({phase}): {times[-1]:.1f} ms",
                  file=sys.stderr, flush=True)
        synchronize(device)
        timed_to = time.time()
    clock = clocks.window(timed_from, timed_to)
    summary = summarize(times[config.warmup:])
    # the timed steps' peak, read before the profiled step resets the allocator's peak for its own
    peak = _peak_bytes(device) / 2**30
    profiled = profile_one_step(trainee, inputs, targets, config, device, f"{provider}_b{batch}") \
        if config.profile_dir else []
    return {**probe, "profile_rows": profiled,
            "step_ms": summary["mean_ms"], "step_std_ms": summary["std_ms"], "step_median_ms": summary["median_ms"],
            "n_steps": summary["n"], "first_step_s": times[0] / 1e3, "loss": _batch_mean(loss).item(),
            "peak_mem_gib": peak, "sm_clock_mhz": clock["sm_clock_mhz"], "power_w": clock["power_w"]}


def run_point(provider: str, batch: int, config: LeaderboardConfig, device: torch.device) -> dict:
    """One (batch, provider) row; out of memory becomes a status=oom row."""
    model_config = config.model_config()
    flops = leaderboard_flops(model_config, batch, config.context_length)
    world = _world()[1]
    base = {**recipe_columns(provider, config, batch), "size": config.size, "world_size": world, "batch": batch,
            "context_length": config.context_length, "warmup": config.warmup, "flops": flops}
    _fresh(device)
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
    _fresh(device)  # the frames of a failed step are gone once the except block is left
    row["profile_rows"] = [{"provider": provider, "batch": batch, "context_length": config.context_length,
                            "size": config.size, **r} for r in profiled]
    return row


# ---- the correctness check ----------------------------------------------------------------------------


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.double()
    return ((value.double() - reference).norm() / reference.norm().clamp_min(1e-30)).item()


def _batch_mean(loss: torch.Tensor) -> torch.Tensor:
    """The whole batch's mean loss from this rank's (the mean over ranks of equal shares; itself without a group)."""
    world = _world()[1]
    if world == 1:
        return loss
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total / world


def _loss_and_gradients(trainee: Trainee, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, dict]:
    loss = forward_backward(trainee, inputs, targets)
    return _batch_mean(loss).item(), trainee.gradients()


def _errors(result: tuple[float, dict], reference: tuple[float, dict]) -> dict:
    """Relative error of the loss, and the largest relative L2 error over the gradients (and whose)."""
    (loss, grads), (ref_loss, ref_grads) = result, reference
    missing = sorted(set(ref_grads) - {n for n, g in grads.items() if g is not None})
    if missing:
        raise RuntimeError(f"no gradient for {', '.join(missing)}")
    per_param = {name: _relative_error(grads[name], ref) for name, ref in ref_grads.items()}
    worst = max(per_param, key=per_param.get)
    return {"loss_err": abs(loss - ref_loss) / abs(ref_loss), "grad_err": per_param[worst], "worst_param": worst}


def run_check(config: LeaderboardConfig, device: torch.device) -> Iterator[dict]:
    """The check's rows, one per main provider (see the module docstring)."""
    model_config = config.check_config()
    dtype = DTYPES[config.param_dtype]
    torch.manual_seed(0)
    with device:
        source = TransformerLM(model_config)  # float32 weights, our initialisation
    weights = {name: t.to(dtype) for name, t in source.state_dict().items()}  # what every run starts from
    inputs, targets = _tokens(model_config.vocab_size, config.check_batch, config.check_context, device, seed=2)

    def plain_eager(param_dtype: str) -> tuple[float, dict]:  # this process alone, on the whole batch
        eager = replace(config, compile="none", param_dtype=param_dtype, data_parallel="none")
        trainee = build_plain(replace(PLAIN_SAC, checkpoint="none"), model_config, eager, device, weights)
        return _loss_and_gradients(trainee, inputs, targets)

    reference = plain_eager("fp32")
    anchor = _errors(plain_eager(config.param_dtype), reference)  # torch's own error in this dtype
    floors = CHECK_FLOORS[config.param_dtype]
    tolerance = {"loss": max(2 * anchor["loss_err"], floors["loss"]), "grad": max(2 * anchor["grad_err"], floors["grad"])}
    world = _world()[1]  # under data parallelism each rank checks its averaged gradients against the reference
    for provider in config.providers:
        _fresh(device)
        base = {**recipe_columns(provider, config, config.check_batch), "size": f"check:{config.check_size}",
                "world_size": world, "batch": config.check_batch, "context_length": config.check_context}
        trainee = build(provider, model_config, config, device, weights,
                        checkpoint=CHECK_CHECKPOINT if recipe(provider).checkpoint == AUTO else None)
        result = _loss_and_gradients(trainee, *_share(inputs, targets))
        errors = _errors(result, reference)
        del trainee
        ok = errors["loss_err"] <= tolerance["loss"] and errors["grad_err"] <= tolerance["grad"]
        row = {**base, "status": "check_ok" if ok else "check_fail", "check_loss_err": errors["loss_err"],
               "check_loss_tol": tolerance["loss"], "check_grad_err": errors["grad_err"],
               "check_grad_tol": tolerance["grad"], "check_worst_param": errors["worst_param"],
               "loss": result[0], "check_loss_ref": reference[0]}
        if not ok:
            row["error"] = (f"{provider} differs from the float32 reference by {errors['loss_err']:.3g} (loss) and "
                            f"{errors['grad_err']:.3g} ({errors['worst_param']}); tolerances {tolerance['loss']:.3g} "
                            f"and {tolerance['grad']:.3g}")
        print(f"check {provider}: {row['status']} (loss error {errors['loss_err']:.2e}, worst gradient "
              f"{errors['worst_param']} {errors['grad_err']:.2e}; tolerances {tolerance['loss']:.2e}, "
              f"{tolerance['grad']:.2e})", file=sys.stderr, flush=True)
        yield row
    _fresh(device)


# ---- the run ------------------------------------------------------------------------------------------


def check_world(config: LeaderboardConfig, world: int) -> None:
    """Raise (naming the values) where the run's data parallelism does not fit its world: ranks without a spec
    would each train alone; every batch is split into equal shares; and a rank's share runs in one pass, since
    the data-parallel wrappers synchronize gradients during or after one backward, not across accumulated ones."""
    spec = config.data_parallel_spec()
    if world > 1 and spec.kind == "none":
        raise ValueError(f"{world} ranks with data parallelism 'none' would each train alone: give --data-parallel")
    for batch in (*config.batches, *((config.check_batch,) if config.check_size != "none" else ())):
        if batch % world:
            raise ValueError(f"batch {batch} does not split into {world} equal shares")
    if spec.kind != "none":
        for batch, provider in config.points():
            if sequences_per_pass(provider, batch // world) < batch // world:
                raise ValueError(f"{provider} at batch {batch} on {world} ranks passes "
                                 f"{sequences_per_pass(provider, batch // world)} of its {batch // world} sequences at "
                                 f"a time; with data parallelism a rank's share runs in one pass (more ranks, or a "
                                 "smaller batch)")


def run(config: LeaderboardConfig, out) -> None:
    """The check, then every (batch, provider) point; rows written to `out` (OUT.partial as they come) by rank 0.
    Under torchrun, or with data parallelism, the process group is joined first (NCCL on CUDA, gloo on a CPU),
    each rank on its local GPU; a group the caller started (tests' spawned ranks) is used as it is."""
    joined = not dist.is_initialized() and (config.data_parallel != "none" or "WORLD_SIZE" in os.environ)
    if joined:
        _, _, device = init_from_env("nccl" if resolve_device(config.device).type == "cuda" else "gloo")
    else:
        device = resolve_device(config.device)
    try:
        check_world(config, _world()[1])
        _run(config, out, device, writer=_world()[0] == 0)
    finally:
        if joined:
            shutdown()


def _run(config: LeaderboardConfig, out, device: torch.device, writer: bool) -> None:
    prov = {**provenance(device), "run_id": uuid.uuid4().hex[:12],
            "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    rows = PartialRows(out) if writer else None
    start = time.monotonic()
    if config.check_size != "none":
        checked = [{**row, **prov} for row in run_check(config, device)]
        if writer:
            rows.add(checked)
    points = config.points()
    profiled = PartialRows(config.profile_csv()) if config.profile_dir is not None and writer else None
    for i, (batch, provider) in enumerate(points, 1):
        print(f"[{i}/{len(points)}] {provider} batch={batch} context={config.context_length}", file=sys.stderr,
              flush=True)
        row = run_point(provider, batch, config, device)
        shown = (f"{row['step_ms']:.1f} ms/step, MFU {row['mfu']:.1%}, peak {row['peak_mem_gib']:.1f} GiB, "
                 f"first step {row['first_step_s']:.1f} s" if row["status"] == "ok" else row["status"])
        print(f"[{i}/{len(points)}] {provider} batch={batch}: {shown} ({time.monotonic() - start:.0f} s into the run)",
              file=sys.stderr, flush=True)
        profile_rows = [{**r, **prov} for r in row.pop("profile_rows")]
        if writer:
            rows.add([{**row, **prov}])
        if profiled is not None:
            profiled.add(profile_rows)
    if writer:
        rows.finish()
    if profiled is not None:
        profiled.finish()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="8B", help="model size of the 2026 table (8B; tiny or mini for a CPU smoke run)")
    parser.add_argument("--batch", nargs="+", type=positive_int, default=[2, 1], help="batch sizes, one point each")
    parser.add_argument("--context", type=positive_int, default=32768, help="tokens per sequence")
    parser.add_argument("--providers", nargs="*", default=list(PROVIDERS), choices=list(PROVIDERS),
                        help="ours and the plain-PyTorch anchors")
    parser.add_argument("--ablations", nargs="*", default=list(ABLATIONS),
                        help=f"variants of ours, each with one optimisation switched off ({', '.join(ABLATIONS)}), "
                             "or ours-keep:N (the first N blocks not checkpointed) or ours-mm:N (the first N blocks "
                             "saving their matmul outputs); none given: no ablations")
    parser.add_argument("--ablation-batch", nargs="+", type=positive_int, default=None,
                        help="the batch sizes (of --batch) at which the ablations run (default: the last of --batch)")
    parser.add_argument("--warmup", type=positive_int, default=2,
                        help="untimed steps, the first (compilation and autotuning) included")
    parser.add_argument("--steps", type=positive_int, default=3, help="timed steps")
    parser.add_argument("--compile", default="blocks", choices=COMPILE_MODES,
                        help="torch.compile each block (blocks) or run eagerly (none: CPU smoke runs)")
    parser.add_argument("--param-dtype", default="bf16", choices=["bf16", "fp32"],
                        help="parameter (and compute) dtype of every provider")
    parser.add_argument("--chunk-tokens", type=positive_int, default=DEFAULT_CHUNK_TOKENS,
                        help="tokens per chunk of the plain anchor's LM head + cross-entropy")
    parser.add_argument("--check-size", default="scaled", choices=CHECK_SIZES,
                        help="the correctness check's model: scaled (2 layers, d 256, the 8B head dim and vocab), "
                             "tiny, or none (no check)")
    parser.add_argument("--check-context", type=positive_int, default=1024, help="tokens per sequence of the check")
    parser.add_argument("--memory-margin-gib", type=float, default=4.0,
                        help="memory ours leaves free when it chooses how many blocks save their matmul outputs")
    parser.add_argument("--memory-capacity-gib", type=float, default=None,
                        help="the memory ours plans with (default: the device's total)")
    parser.add_argument("--profile", metavar="DIR",
                        help="after each point's timed steps, one more step under torch.profiler (and, on CUDA, the "
                             "allocator history: DIR/<provider>_b<batch>.pickle); its time by category and peak "
                             "memory split go to --profile-out")
    parser.add_argument("--profile-out", help="CSV of the profile rows (default: DIR/../leaderboard_8b_profile.csv)")
    parser.add_argument("--data-parallel", default="none",
                        help="ours' data parallelism, a DDP kind without optimizer sharding (e.g. bucketed:100, "
                             "torch_ddp; the anchors then run torch DDP), one rank per GPU under torchrun, each "
                             "rank a batch / world share; none: one process")
    add_device_argument(parser)
    parser.add_argument("--out", required=True, help="CSV file for the rows")
    return parser


# Every provider runs with expandable allocator segments (unless the caller sets its own configuration): at the
# 8B step's sizes the default segments fragment, and a point that needs 116 GiB failed with 22 GiB reserved but
# free (H200, ours-mm:6 at batch 2). Read when CUDA first allocates, so set before anything touches the GPU.
ALLOC_CONF = "expandable_segments:True"


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)
    parser = build_parser()
    args = parser.parse_args(argv)
    config = config_or_usage_error(
        parser, LeaderboardConfig, size=args.size, batches=tuple(args.batch), context_length=args.context,
        providers=tuple(args.providers), ablations=tuple(args.ablations), ablation_batches=args.ablation_batch and tuple(args.ablation_batch),
        warmup=args.warmup, steps=args.steps, compile=args.compile, param_dtype=args.param_dtype,
        chunk_tokens=args.chunk_tokens, check_size=args.check_size, check_context=args.check_context,
        memory_margin_gib=args.memory_margin_gib, memory_capacity_gib=args.memory_capacity_gib,
        profile_dir=args.profile, profile_out=args.profile_out, data_parallel=args.data_parallel, device=args.device)
    if resolve_device(config.device).type != "cuda":  # refused now, not after minutes of compiling
        state_gib = 16 * parameter_count(config.model_config()) / 2**30  # fp32 weights, gradients, AdamW's 2 moments
        reasons = [*(["our kernels run under Triton's interpreter, which cannot multiply bfloat16"]
                     if config.param_dtype == "bf16" else []),
                   *([f"the model's fp32 state ({state_gib:.0f} GiB) outgrows this machine's memory"]
                     if state_gib * 2**30 > os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") else [])]
        if reasons:
            parser.error(f"size {config.size!r} in {config.param_dtype} on device {config.device!r}: "
                         f"{'; '.join(reasons)}. The leaderboard step is a GPU benchmark; for a CPU smoke run pass "
                         "--size tiny --param-dtype fp32 --compile none --check-size tiny (see --help)")
    run(config, args.out)


if __name__ == "__main__":
    main()
