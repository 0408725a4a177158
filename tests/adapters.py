"""Wiring of our implementations to the names the course's test suite imports."""

from __future__ import annotations

from typing import Type

import torch

from cs336_systems.kernels import FlashAttentionPytorch, FlashAttentionTriton


def get_flashattention_autograd_function_pytorch() -> Type:
    """A torch.autograd.Function: FlashAttention-2 forward in plain PyTorch, compiled backward."""
    return FlashAttentionPytorch


def get_flashattention_autograd_function_triton() -> Type:
    """A torch.autograd.Function: FlashAttention-2 forward and backward in Triton."""
    return FlashAttentionTriton




# ---- data parallelism and optimizer-state sharding -------------------------------------------
from cs336_systems.distributed import DDPBucketed, DDPIndividualParameters, ShardedOptimizer  # noqa: E402


def get_ddp(module: torch.nn.Module) -> torch.nn.Module:
    """The 2026 name of the overlapped per-parameter DDP (each gradient all-reduced as it is ready)."""
    return DDPIndividualParameters(module)


def ddp_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    ddp_model.finish_gradient_synchronization()


def get_ddp_individual_parameters(module: torch.nn.Module) -> torch.nn.Module:
    return DDPIndividualParameters(module)


def ddp_individual_parameters_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    ddp_model.finish_gradient_synchronization()


def get_ddp_bucketed(module: torch.nn.Module, bucket_size_mb: float) -> torch.nn.Module:
    return DDPBucketed(module, bucket_size_mb)


def ddp_bucketed_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    ddp_model.finish_gradient_synchronization()


def ddp_bucketed_on_train_batch_start(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    ddp_model.on_train_batch_start()


def get_sharded_optimizer(params, optimizer_cls: Type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
    return ShardedOptimizer(params, optimizer_cls, **kwargs)


# ---- fully-sharded data parallelism (2026 edition) -------------------------------------------
from cs336_systems.distributed import FSDP, gather_full_params  # noqa: E402


def get_fsdp(module: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Shards every Linear/Embedding weight (matched by class name); build the optimizer afterwards,
    over the wrapper's parameters (this rank's shards and the replicated parameters)."""
    return FSDP(module, compute_dtype=compute_dtype)


def fsdp_on_after_backward(fsdp_model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    fsdp_model.finish_gradient_synchronization()


def fsdp_gather_full_params(fsdp_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters by the unwrapped module's names; a collective: call it on every rank."""
    return gather_full_params(fsdp_model)
