"""A provider built for the 8B step (`build`: its model in the run's dtype on the device, wrapped by the plan,
its loss and optimizer) and its step: `cs336_systems.train_step`'s, over one forward per micro-batch, each pass
first switching the blocks to its checkpoint policy where the first pass's differs from the later ones'. Also the
helpers every part of a run shares: the process group's rank and world, each rank's share of the tokens, the
columns naming what a provider runs."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn

from cs336_systems import train_step as steps
from cs336_systems.bench.leaderboard.config import ANCHOR_DATA_PARALLEL, LeaderboardConfig
from cs336_systems.bench.leaderboard.recipes import AUTO, Recipe, pass_policies, recipe, sequences_per_pass
from cs336_systems.bench.plain_model import PlainTransformerLM, plain_state_dict
from cs336_systems.distributed.parallelize import DataParallel, ParallelPlan, apply_data_parallel, parallelize
from cs336_systems.model import CheckpointPolicy, ModelConfig, TransformerLM
from cs336_systems.model.checkpointing import switch_selective
from cs336_systems.offload import StateOffload, offload_state
from cs336_systems.optim import AdamW
from cs336_systems.timing import DTYPES, reset_memory
from cs336_systems.train_step import lm_loss


@dataclass
class Trainee:
    """A built provider: its loss on (token_ids, targets), its optimizer, its parameters by name
    (`as_plain_names` maps a name → tensor dict of them to the plain model's names, for the check), and the
    data-parallel wrapper whose two loop hooks the step calls (every kind, "none" included, has them)."""

    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: torch.optim.Optimizer
    parameters: dict[str, nn.Parameter]
    as_plain_names: Callable[[dict], dict]
    wrapper: DataParallel
    model: nn.Module | None = None  # the unwrapped model (the profiler hooks its final norm)
    microbatch: int | None = None  # sequences per forward and backward pass (None: the whole batch)
    pass_policies: tuple[CheckpointPolicy, ...] = ()  # (first pass's, later passes') selective policies, or none
    offload: StateOffload | None = None  # the optimizer's state kept on the host between steps (recipe state="host")

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
    optimizer = make_optimizer(recipe, model.parameters(), config.lr)
    return Trainee(loss=lambda x, y: lm_loss(wrapped, x, y, fused=fused), optimizer=optimizer,
                   parameters=parameters, as_plain_names=plain_state_dict, wrapper=wrapped, model=model,
                   microbatch=recipe.microbatch, pass_policies=policies if len(policies) > 1 else (),
                   offload=offload_state(optimizer) if recipe.state == "host" else None)


def build_plain(recipe: Recipe, model_config: ModelConfig, config: LeaderboardConfig, device: torch.device,
                weights: dict | None = None) -> Trainee:
    model = PlainTransformerLM(model_config, checkpoint=recipe.checkpoint, dtype=DTYPES[config.param_dtype],
                               device=device, chunk_tokens=config.chunk_tokens)
    if weights is not None:
        model.load_state_dict(plain_state_dict(weights))
    if config.compile == "blocks":
        model.compile_blocks()
    parameters = dict(model.named_parameters())
    optimizer = make_optimizer(recipe, model.parameters(), config.lr)
    if config.data_parallel_spec().kind == "none":
        wrapped = apply_data_parallel(model, config.data_parallel_spec(), device)  # hooks that do nothing
        return Trainee(loss=model.loss, optimizer=optimizer, parameters=parameters, as_plain_names=dict,
                       wrapper=wrapped, model=model)
    # with data parallelism, the anchors replicate as torch does (torch DDP), whatever ours runs
    wrapped = apply_data_parallel(model, ANCHOR_DATA_PARALLEL, device)
    return Trainee(loss=lambda x, y: wrapped(x, targets=y), optimizer=optimizer, parameters=parameters,
                   as_plain_names=dict, wrapper=wrapped, model=model)


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



def _under_policy(model: nn.Module, policy: CheckpointPolicy, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
    switch_selective(model, policy)
    return forward()


def _armed(offload: StateOffload, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
    offload.arm()
    return forward()


def forwards(trainee: Trainee, inputs: torch.Tensor, targets: torch.Tensor) -> list[Callable[[], torch.Tensor]]:
    """The step's forward passes (`train_step.forwards`, one per micro-batch of the trainee's); with
    `pass_policies`, each pass first puts the blocks under its policy (the first pass's, or the later ones'); with
    the state on the host, the last pass arms its fetch (each parameter's state back once its gradient is final)."""
    passes = steps.forwards(trainee.loss, inputs, targets, trainee.microbatch)
    policies = trainee.pass_policies
    if policies:
        passes = [functools.partial(_under_policy, trainee.model, policies[min(i, len(policies) - 1)], forward)
                  for i, forward in enumerate(passes)]
    if trainee.offload is not None:
        passes[-1] = functools.partial(_armed, trainee.offload, passes[-1])
    return passes


def forward_backward(trainee: Trainee, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`train_step.forward_backward` of the trainee: the gradients of the batch's mean loss (synchronized under
    data parallelism) and that loss, detached (this rank's)."""
    return steps.forward_backward(trainee.wrapper, forwards(trainee, inputs, targets))


def train_step(trainee: Trainee, inputs: torch.Tensor, targets: torch.Tensor,
               phase: steps.Phase = steps.no_phase) -> torch.Tensor:
    """`train_step.train_step` of the trainee (the handout's step; `phase` as there)."""
    return steps.train_step(trainee.wrapper, trainee.optimizer, forwards(trainee, inputs, targets), phase)


def recipe_columns(provider: str, config: LeaderboardConfig, batch: int) -> dict:
    chosen = recipe(provider)
    return {"provider": provider, "model": chosen.model, "attention": chosen.attention, "loss_path": chosen.loss,
            "optimizer": chosen.optimizer, "checkpoint": chosen.checkpoint, "compile": config.compile,
            "param_dtype": config.param_dtype,
            "optimizer_state_dtype": config.param_dtype if chosen.moments == "param" else chosen.moments,
            "optimizer_state_home": chosen.state,
            "microbatch": sequences_per_pass(provider, batch // rank_and_world()[1]), "data_parallel": _data_parallel(provider, config)}


def _data_parallel(provider: str, config: LeaderboardConfig) -> str:
    """The data parallelism a provider runs: ours the configured spec, the plain anchors torch DDP where it is set."""
    if recipe(provider).model == "plain" and config.data_parallel != "none":
        return str(ANCHOR_DATA_PARALLEL)
    return config.data_parallel


def fresh(device: torch.device) -> None:
    """Forget the previous provider: its compiled code (each provider compiles afresh, so its first
    step counts its own compilation) and its memory."""
    torch.compiler.reset()
    reset_memory(device)


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the process group, or (0, 1) without one."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def tokens(vocab: int, batch: int, context: int, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.randint(vocab, (batch, context), device=device, generator=generator) for _ in range(2))


def share(*batches: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This rank's slice of batch / world sequences of each (the whole batch without a process group)."""
    rank, world = rank_and_world()
    return tuple(t.chunk(world)[rank] for t in batches)


def local_tokens(vocab: int, batch: int, context: int, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    """This rank's share of the batch's token ids and targets: every rank draws the whole batch from the same seed
    and keeps its slice."""
    return share(*tokens(vocab, batch, context, device, seed))


def batch_mean(loss: torch.Tensor) -> torch.Tensor:
    """The whole batch's mean loss from this rank's (the mean over ranks of equal shares; itself without a group)."""
    world = rank_and_world()[1]
    if world == 1:
        return loss
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total / world

