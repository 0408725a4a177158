"""Parallelism as data: a data-parallel spec, a whole plan (compile, activation checkpointing, data
parallelism), and the functions that apply them to a built model from outside.

    plan = ParallelPlan.parse("compile=blocks checkpoint=selective dp=bucketed:1")
    model = parallelize(TransformerLM(config, dtype=torch.bfloat16, device=device), plan, device)

`parallelize` applies, in this fixed order (torchtitan's `parallelize_llama` order):
  1. activation checkpointing (`model.checkpointing.apply_activation_checkpointing`): it rewraps the
     blocks, so it must come before anything that holds on to them; and the selective policy's
     checkpoint must sit inside the compiled region, where it sees the attention operator it saves
     (a checkpoint around a compiled region sees one opaque call and can select nothing in it);
  2. compilation: "blocks" compiles each block in place (regional compilation: one graph shared by all
     blocks; a selectively checkpointed block is compiled whole with its checkpoint inside, as
     torchtitan does; under a segment policy the checkpoints call the compiled blocks), "model" the
     whole model; before data parallelism, so that the wrappers' gradient hooks and FSDP's weight
     swaps stay outside the compiled graphs (our FSDP's Python hooks inside a compiled region make it
     recompile every step, so a plan refuses fsdp with compile);
  3. data parallelism (`apply_data_parallel`), last: it wraps the finished model (broadcasting rank 0's
     weights, hooking gradients, or sharding parameters), and the optimizer is built over its result.

Data parallelism alone:

    spec = DataParallelSpec.parse("bucketed:25+sharded")        # once, at the command line
    ddp = apply_data_parallel(model, spec, device)             # the model, wrapped
    optimizer = build_optimizer(ddp, spec, lr=3e-4)
    for batch in batches:
        ddp.on_train_batch_start()
        optimizer.zero_grad(set_to_none=True)
        loss_fn(ddp(batch)).backward()
        ddp.finish_gradient_synchronization()                  # no-op where the backward already did it
        optimizer.step()

Text form (one spelling, `str(spec)` gives it back): KIND[:BUCKET_MB][+SHARDING]
  KIND       none (each rank trains alone), naive, flat, individual, bucketed, torch_ddp, and the
             individual-thread / bucketed-thread variants that issue their all-reduces from a worker thread;
             fsdp (ours, cs336_systems.distributed.fsdp) and torch_fsdp2 (torch's `fully_shard` on each
             Transformer block and on the root), which shard parameters, gradients and optimizer state;
  BUCKET_MB  bucket size in MiB, for bucketed, bucketed-thread (absent: one bucket) and torch_ddp
             (absent: torch's default of 25);
  SHARDING   sharded (our ZeRO-1 ShardedOptimizer) or zero (torch's ZeroRedundancyOptimizer);
             absent, or `+adamw` on input, means no optimizer-state sharding (the FSDP kinds take none:
             their optimizer already sees only shards).
`apply_data_parallel(..., compute_dtype=torch.bfloat16)` makes the FSDP kinds gather and compute in that
dtype (master weights, gradients handed to the optimizer and the update stay fp32); the DDP kinds ignore
it (their mixed precision is autocast's).
Every wrapper, "none" included, offers `on_train_batch_start()` and `finish_gradient_synchronization()`,
so a training loop calls both unconditionally. A new kind is one entry in `_WRAPPERS` (and in
`BUCKETED_KINDS` if it takes a bucket size).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from cs336_systems.distributed.ddp_bucketed import DDPBucketed
from cs336_systems.distributed.ddp_individual import DDPIndividualParameters
from cs336_systems.distributed.common import broadcast_from_rank0
from cs336_systems.distributed.ddp_naive import DDPNaive
from cs336_systems.distributed.fsdp import FSDP
from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer
from cs336_systems.model.checkpointing import CheckpointPolicy, apply_activation_checkpointing
from cs336_systems.optim import adamw_implementation

TORCH_DDP_DEFAULT_BUCKET_MB = 25.0  # torch DDP's own bucket_cap_mb default, used when the spec names none


class DataParallel(Protocol):
    """What a training loop may call on any wrapped model (besides calling it)."""

    module: nn.Module

    def on_train_batch_start(self) -> None: ...

    def finish_gradient_synchronization(self) -> None: ...


class NoDataParallel(nn.Module):
    """Kind "none": the model as it is (each rank trains alone, on its own data); the hooks do nothing."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def on_train_batch_start(self) -> None:
        pass

    def finish_gradient_synchronization(self) -> None:
        pass


class TorchDDP(DistributedDataParallel):
    """torch's DistributedDataParallel with the loop hooks of our wrappers: it averages the gradients
    during the backward pass itself, so both do nothing."""

    def on_train_batch_start(self) -> None:
        pass

    def finish_gradient_synchronization(self) -> None:
        pass


class TorchFSDP2(NoDataParallel):
    """torch's FSDP2 as a user sets it up (torchtitan's recipe): `fully_shard` on each Transformer block
    (children of `module.layers`) and then on the root, with a mixed-precision policy that gathers and
    computes in compute_dtype and reduces gradients in fp32; gradients are reduce-scattered during the
    backward pass itself, so the loop hooks do nothing. Rank 0's weights are broadcast first, as our
    wrappers do."""

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        broadcast_from_rank0(module)
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32 if compute_dtype else None)
        # The mesh on the module's own device type: left to itself, fully_shard takes CUDA wherever CUDA exists,
        # so CPU ranks on a host with fewer GPUs than ranks would each claim a GPU by rank.
        mesh = init_device_mesh(next(module.parameters()).device.type, (dist.get_world_size(),))
        for block in getattr(module, "layers", ()):
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(module, mesh=mesh, mp_policy=policy)
        super().__init__(module)


def _torch_ddp(model: nn.Module, spec: DataParallelSpec, device: torch.device, compute_dtype) -> nn.Module:
    return TorchDDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    bucket_cap_mb=spec.bucket_mb or TORCH_DDP_DEFAULT_BUCKET_MB)


_Builder = Callable[[nn.Module, "DataParallelSpec", torch.device, "torch.dtype | None"], nn.Module]
_WRAPPERS: dict[str, _Builder] = {
    "none": lambda model, spec, device, dtype: NoDataParallel(model),
    "naive": lambda model, spec, device, dtype: DDPNaive(model),
    "flat": lambda model, spec, device, dtype: DDPNaive(model, flat=True),
    "individual": lambda model, spec, device, dtype: DDPIndividualParameters(model),
    "individual-thread": lambda model, spec, device, dtype: DDPIndividualParameters(model, background_issue=True),
    "bucketed": lambda model, spec, device, dtype: DDPBucketed(model, spec.bucket_mb),
    "bucketed-thread": lambda model, spec, device, dtype: DDPBucketed(model, spec.bucket_mb, background_issue=True),
    "torch_ddp": _torch_ddp,
    "fsdp": lambda model, spec, device, dtype: FSDP(model, compute_dtype=dtype),
    "torch_fsdp2": lambda model, spec, device, dtype: TorchFSDP2(model, compute_dtype=dtype),
}
KINDS = tuple(_WRAPPERS)
BUCKETED_KINDS = ("bucketed", "bucketed-thread", "torch_ddp")  # the kinds that take a bucket size
FULLY_SHARDED_KINDS = ("fsdp", "torch_fsdp2")  # parameters, gradients and optimizer state sharded
SHARDINGS = ("none", "sharded", "zero")


@dataclass(frozen=True)
class DataParallelSpec:
    """How a model is trained data-parallel: the wrapper kind, its bucket size in MiB (None: the
    kind's default, see the module docstring), and the optimizer-state sharding."""

    kind: str = "none"
    bucket_mb: float | None = None
    optimizer_sharding: str = "none"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown data-parallel kind {self.kind!r}; known: {', '.join(KINDS)}")
        if self.optimizer_sharding not in SHARDINGS:
            raise ValueError(f"unknown optimizer sharding {self.optimizer_sharding!r}; known: {', '.join(SHARDINGS)}")
        if self.kind in FULLY_SHARDED_KINDS and self.optimizer_sharding != "none":
            raise ValueError(f"{self.kind!r} already shards the optimizer state; it takes no "
                             f"+{self.optimizer_sharding}")
        if self.bucket_mb is not None:
            if self.kind not in BUCKETED_KINDS:
                raise ValueError(f"a bucket size ({self.bucket_mb} MiB) was given for {self.kind!r}, which has no "
                                 f"buckets; only {', '.join(BUCKETED_KINDS)} take one")
            if not 0 < self.bucket_mb < math.inf:  # also refuses NaN
                raise ValueError(f"bucket size must be positive and finite, got {self.bucket_mb}")
            object.__setattr__(self, "bucket_mb", float(self.bucket_mb))

    @classmethod
    def parse(cls, text: str) -> DataParallelSpec:
        """The spec of `KIND[:BUCKET_MB][+SHARDING]`; a ValueError naming the bad part and the whole text."""
        wrapper, plus, sharding = text.strip().partition("+")
        kind, colon, bucket = wrapper.partition(":")
        if not plus or sharding == "adamw":  # "+adamw" is the old spelling of no sharding
            sharding = "none"
        bucket_mb = None
        if colon:
            try:
                bucket_mb = float(bucket)
            except ValueError:
                raise ValueError(f"bad data-parallel spec {text!r}: bucket size {bucket!r} is not a number "
                                 "(expected e.g. bucketed:25)") from None
        try:
            return cls(kind, bucket_mb, sharding)
        except ValueError as error:
            raise ValueError(f"bad data-parallel spec {text!r}: {error}") from None

    def __str__(self) -> str:
        text = self.kind
        if self.bucket_mb is not None:
            text += ":" + str(self.bucket_mb).removesuffix(".0")  # repr of the float: parses back exactly
        if self.optimizer_sharding != "none":
            text += "+" + self.optimizer_sharding
        return text

    @property
    def wrapper(self) -> DataParallelSpec:
        """The same spec without optimizer sharding (the wrapper alone)."""
        return replace(self, optimizer_sharding="none")

    def to_columns(self) -> dict[str, object]:
        """The columns a result row carries: the text form (`config`) and each field on its own."""
        return {"config": str(self), "dp_kind": self.kind, "bucket_mb": self.bucket_mb,
                "optimizer_sharding": self.optimizer_sharding}


def apply_data_parallel(model: nn.Module, spec: DataParallelSpec, device: torch.device,
                        compute_dtype: torch.dtype | None = None) -> nn.Module:
    """The model wrapped as spec.kind says (an initialised process group is needed; rank 0's weights
    are broadcast). The result offers `.module` and the two loop hooks of `DataParallel`. compute_dtype
    (None: fp32) is the dtype the FSDP kinds gather and compute in. Build the optimizer afterwards, over
    the wrapped model (the FSDP kinds replace the parameters by their shards)."""
    return _WRAPPERS[spec.kind](model, spec, device, compute_dtype)


def build_optimizer(model: nn.Module, spec: DataParallelSpec, lr: float,
                    adamw: str = "foreach") -> torch.optim.Optimizer:
    """AdamW over model's parameters (pass the wrapped model: a wrapper that owns its parameters then
    gets its own), sharded as spec says; every variant updates with the same AdamW implementation
    (one of optim.ADAMW_IMPLEMENTATIONS), so sharded and unsharded steps differ only in the sharding."""
    optimizer_class, extra = adamw_implementation(adamw)
    if spec.optimizer_sharding == "sharded":
        return ShardedOptimizer(model.parameters(), optimizer_class, lr=lr, **extra)
    if spec.optimizer_sharding == "zero":
        # imported here: torch.distributed.optim pulls in FSDP and DTensor, ~0.8 s for every importer of this module
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class, lr=lr, **extra)
    return optimizer_class(model.parameters(), lr=lr, **extra)


# ---- the whole plan ------------------------------------------------------------------------------

COMPILE_SCOPES = ("none", "blocks", "model")
_PLAN_KEYS = {"compile": str, "checkpoint": CheckpointPolicy.parse, "dp": DataParallelSpec.parse}


@dataclass(frozen=True)
class ParallelPlan:
    """How a built model is trained: what is compiled (`COMPILE_SCOPES`), which activation checkpointing,
    which data parallelism. Text form (`str` gives it back, `parse` reads it; absent keys take defaults):
    `compile=none|blocks|model checkpoint=POLICY dp=SPEC`, e.g.
    `compile=blocks checkpoint=selective dp=bucketed:1`."""

    compile: str = "none"
    checkpoint: CheckpointPolicy = field(default_factory=CheckpointPolicy)
    data_parallel: DataParallelSpec = field(default_factory=DataParallelSpec)

    def __post_init__(self) -> None:
        if self.compile not in COMPILE_SCOPES:
            raise ValueError(f"unknown compile scope {self.compile!r}; known: {', '.join(COMPILE_SCOPES)}")
        if not isinstance(self.checkpoint, CheckpointPolicy):
            raise TypeError(f"checkpoint must be a CheckpointPolicy, got {self.checkpoint!r}")
        if not isinstance(self.data_parallel, DataParallelSpec):
            raise TypeError(f"data_parallel must be a DataParallelSpec, got {self.data_parallel!r}")
        if self.data_parallel.kind == "fsdp" and self.compile != "none":
            raise ValueError(f"compile={self.compile} with dp=fsdp: our FSDP's per-layer Python hooks make a "
                             "compiled region recompile every step; use compile=none, or dp=torch_fsdp2")

    @classmethod
    def parse(cls, text: str) -> ParallelPlan:
        """The plan of `compile=... checkpoint=... dp=...` (any order, each key at most once)."""
        values: dict[str, object] = {}
        for item in text.split():
            key, equals, value = item.partition("=")
            if not equals or key not in _PLAN_KEYS:
                raise ValueError(f"bad parallel plan {text!r}: {item!r} is not KEY=VALUE with KEY one of "
                                 f"{', '.join(_PLAN_KEYS)}")
            if key in values:
                raise ValueError(f"bad parallel plan {text!r}: {key} given twice")
            try:
                values[key] = _PLAN_KEYS[key](value)
            except ValueError as error:
                raise ValueError(f"bad parallel plan {text!r}: {error}") from None
        if "dp" in values:
            values["data_parallel"] = values.pop("dp")
        try:
            return cls(**values)
        except ValueError as error:
            raise ValueError(f"bad parallel plan {text!r}: {error}") from None

    def __str__(self) -> str:
        return f"compile={self.compile} checkpoint={self.checkpoint} dp={self.data_parallel}"

    def to_columns(self) -> dict[str, object]:
        """A result row's columns: the plan's text and each part (the data-parallel spec's own columns)."""
        return {"plan": str(self), "compile_scope": self.compile, "checkpoint": str(self.checkpoint),
                **self.data_parallel.to_columns()}


def argument_type(parse):
    """`parse` (text -> value, a ValueError naming what is wrong) as an argparse type. argparse shows the message of
    an ArgumentTypeError, but of a ValueError only "invalid <name> value", which would drop the reason."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    convert.__name__ = parse.__name__
    return convert


def add_plan_arguments(parser: argparse.ArgumentParser, *, data_parallel_flag: str | None = "--data-parallel") -> None:
    """--compile, --checkpoint and (unless data_parallel_flag is None, for a CLI that has its own
    spelling of the spec) --data-parallel, read back by `plan_from_args`."""
    parser.add_argument("--compile", choices=COMPILE_SCOPES, default="none",
                        help="torch.compile each block in place (blocks), the whole model (model), or nothing")
    parser.add_argument("--checkpoint", type=argument_type(CheckpointPolicy.parse), default=CheckpointPolicy(),
                        help="activation checkpointing: none, every:K, nested:K1,K2,..., selective or selective:N")
    if data_parallel_flag:
        parser.add_argument(data_parallel_flag, dest="data_parallel", type=argument_type(DataParallelSpec.parse),
                            default=DataParallelSpec(),
                            help="data parallelism: KIND[:BUCKET_MB][+SHARDING], e.g. bucketed:25 or fsdp")


def plan_from_args(args: argparse.Namespace, data_parallel: DataParallelSpec | None = None) -> ParallelPlan:
    """The plan of `add_plan_arguments`' flags; data_parallel (if given) replaces args.data_parallel."""
    spec = data_parallel if data_parallel is not None else args.data_parallel
    return ParallelPlan(compile=args.compile, checkpoint=args.checkpoint, data_parallel=spec)


def parallelize(model: nn.Module, plan: ParallelPlan, device: torch.device | str, *,
                compute_dtype: torch.dtype | None = None, compile_options: dict | None = None) -> nn.Module:
    """Apply the plan to a built TransformerLM on `device`: checkpointing, then compilation, then data
    parallelism (the module docstring says why this order). Returns the data-parallel wrapper (kind
    "none" included: call it, its loop hooks, and build the optimizer over it). compute_dtype is the
    FSDP kinds' gather dtype (see `apply_data_parallel`); compile_options go to torch.compile (e.g.
    backend="aot_eager" in CPU tests). A model is parallelized once."""
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"plan must be a ParallelPlan, got {plan!r}")
    apply_activation_checkpointing(model, plan.checkpoint)
    options = compile_options or {}
    if plan.compile == "blocks":
        for block in model.layers:
            block.compile(**options)
    elif plan.compile == "model":
        model.compile(**options)
    return apply_data_parallel(model, plan.data_parallel, torch.device(device), compute_dtype)
