"""Process-group checks and the broadcast every data-parallel wrapper starts with."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

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


class AsyncAllReduce:
    """Averages tensors over ranks asynchronously; `wait()` returns once every one submitted so far
    is done (on a GPU: once the caller's stream waits for them).

    By default the caller issues each collective. With `background=True` one worker thread issues
    them, in the order they were submitted; c10d releases the GIL while it issues one. The idea: a
    gradient hook runs on autograd's thread, and when the backward pass is limited by the host
    launching kernels the host cost of every all-reduce lands on its critical path. Measured on two
    GPUs it does not pay, eager or with the blocks compiled (cs336_systems/distributed/DECISIONS.md):
    the worker and the compiled backward's Python compete for the GIL. On a GPU the caller records an
    event where the tensor is ready and the worker's stream waits for it, so each collective starts
    after its tensor's producer and after nothing later.
    """

    def __init__(self, device: torch.device, background: bool = False):
        self._device = device
        self._pending: list[Future | dist.Work] = []
        self._executor = self._stream = None
        if background:
            initializer = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="all-reduce", initializer=initializer)
            if device.type == "cuda":
                self._stream = torch.cuda.Stream(device)

    def submit(self, tensor: torch.Tensor) -> None:
        if self._executor is None:
            self._pending.append(all_reduce_mean(tensor, async_op=True))
            return
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._device))
        self._pending.append(self._executor.submit(self._issue, tensor, ready))

    def _issue(self, tensor: torch.Tensor, ready: torch.cuda.Event | None) -> dist.Work:
        if ready is None:
            return all_reduce_mean(tensor, async_op=True)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            return all_reduce_mean(tensor, async_op=True)

    def wait(self) -> None:
        """Wait for every submitted all-reduce; an error raised while issuing one is raised here."""
        pending, self._pending = self._pending, []
        for item in pending:
            (item.result() if isinstance(item, Future) else item).wait()
