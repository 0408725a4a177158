"""Process-group checks and the broadcast every data-parallel wrapper starts with."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn


def require_process_group(what: str) -> tuple[int, int]:
    """(rank, world size), or a clear error when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{what} needs an initialised process group: call torch.distributed.init_process_group "
                           "first (or start the script with torchrun)")
    return dist.get_rank(), dist.get_world_size()


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters that get gradients, each once (a tied weight appears once in .parameters())."""
    params = [p for p in module.parameters() if p.requires_grad]
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"parameters are on several devices {sorted(map(str, devices))}; "
                         "one data-parallel replica must live on one device")
    return params


@torch.no_grad()
def broadcast_from_rank0(module: nn.Module) -> None:
    """Make every rank start from rank 0's parameters and buffers."""
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=0)


def all_reduce_mean(tensor: torch.Tensor, async_op: bool = False) -> dist.Work | None:
    """Replace tensor, in place, by its mean over ranks. NCCL averages inside the reduction
    (ReduceOp.AVG), which saves a division kernel per call, and so a host launch per gradient in
    the per-parameter wrapper; gloo has no AVG, so there each rank divides first and the ranks sum."""
    if dist.get_backend() == dist.Backend.NCCL:
        return dist.all_reduce(tensor, op=dist.ReduceOp.AVG, async_op=async_op)
    tensor.div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=async_op)


def weak_hook(method: Callable) -> Callable:
    """A gradient hook that calls a bound method without keeping its object alive.

    A tensor holds its hooks in C++, out of sight of Python's garbage collector, so a hook that holds
    its wrapper strongly makes a cycle (parameter → hook → wrapper → module → parameter) that is
    never collected: the wrapper, its model and their gradients would outlive every reference to
    them. Once the wrapper is gone, the hook does nothing."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        bound = ref()
        if bound is not None:
            bound(*args)

    return hook
