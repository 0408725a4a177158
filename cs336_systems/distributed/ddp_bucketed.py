"""Bucketed, overlapped data parallelism (handout 2.3, ddp_overlap_bucketed).

Parameters are packed, in reverse order of `module.parameters()` (roughly the order in which their
gradients become ready), into buckets of at most `bucket_size_mb` MiB (None: one bucket). When a
gradient is ready its hook copies it into the bucket's flat buffer and makes `.grad` a view of that
buffer, so that the gradients are not held twice (torch DDP's `gradient_as_bucket_view`; once `.grad`
is the view, later backward passes accumulate straight into it). A bucket lets go of its buffer once
the step is synchronised: from then on only the gradients hold it, and `zero_grad(set_to_none=True)`
frees it before the next forward, as it would free separate gradients; the next step's first
gradient brings a new buffer, or the old one if the gradients were kept. When the last gradient of
a bucket has arrived — in whatever order the hooks fired — one asynchronous all-reduce, in place, is
launched for the whole bucket.
`finish_gradient_synchronization()` launches any bucket still incomplete (parameters that got no
gradient this step count as zero) and waits; the averaged gradients are then already in `.grad`.
As in `DDPIndividualParameters`, `background_issue=True` issues the all-reduces from a worker
thread instead of the hooks (see `AsyncAllReduce`).

Letting the buffers go brings the peak memory close to the per-parameter wrapper's, well below
keeping them for the whole run or copying the gradients back out of the buckets (the measured peaks
are in cs336_systems/distributed/DECISIONS.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from cs336_systems.distributed.common import (
    AsyncAllReduce,
    broadcast_from_rank0,
    require_process_group,
    trainable_parameters,
    weak_hook,
)


@dataclass
class Bucket:
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    # flat, the concatenation of the params' gradients; held from the step's first gradient to the end
    # of its synchronisation, after which only the gradients (views of it) keep it alive
    buffer: torch.Tensor | None = None
    launched: bool = False
    arrived: set[int] = field(default_factory=set)

    def view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.buffer[self.offsets[i]: self.offsets[i] + p.numel()].view_as(p)

    def take_buffer(self, grad: torch.Tensor | None, i: int) -> None:
        """The step's buffer: the one the parameters' gradients are still views of (they were kept,
        zeroed in place or accumulated into), else a new one."""
        base = None if grad is None else grad._base
        if (base is not None and base.dim() == 1 and base.numel() == self.numel
                and grad.data_ptr() == base.data_ptr() + self.offsets[i] * grad.element_size()):
            self.buffer = base
        else:
            p = self.params[0]
            self.buffer = torch.empty(self.numel, dtype=p.dtype, device=p.device)


def plan_buckets(params: list[nn.Parameter], bucket_size_mb: float | None) -> list[list[nn.Parameter]]:
    """Greedy packing in reverse parameter order; a bucket holds one dtype; a parameter larger than
    the limit gets a bucket of its own."""
    if bucket_size_mb is not None and bucket_size_mb <= 0:
        raise ValueError(f"bucket_size_mb must be positive (or None for one bucket), got {bucket_size_mb}")
    limit = float("inf") if bucket_size_mb is None else bucket_size_mb * 2**20
    buckets: list[list[nn.Parameter]] = []
    size = 0.0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > limit or buckets[-1][0].dtype != p.dtype:
            buckets.append([])
            size = 0.0
        buckets[-1].append(p)
        size += nbytes
    return buckets


class DDPBucketed(nn.Module):
    def __init__(self, module: nn.Module, bucket_size_mb: float | None, background_issue: bool = False):
        super().__init__()
        require_process_group(type(self).__name__)
        self.module = module
        params = trainable_parameters(module)
        groups = plan_buckets(params, bucket_size_mb)
        self._all_reduce = AsyncAllReduce(params[0].device if params else torch.device("cpu"), background_issue)
        broadcast_from_rank0(module)
        self.buckets: list[Bucket] = []
        self._where: dict[int, tuple[Bucket, int]] = {}
        for params in groups:
            offsets = [0]
            for p in params[:-1]:
                offsets.append(offsets[-1] + p.numel())
            bucket = Bucket(params, offsets, offsets[-1] + params[-1].numel())
            self.buckets.append(bucket)
            for i, p in enumerate(params):
                self._where[id(p)] = (bucket, i)
                p.register_post_accumulate_grad_hook(weak_hook(self._on_grad_ready))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        bucket, i = self._where[id(param)]
        if bucket.buffer is None:
            bucket.take_buffer(param.grad, i)
        view = bucket.view(i)
        if param.grad.data_ptr() != view.data_ptr():  # a fresh gradient (after zero_grad(set_to_none=True))
            view.copy_(param.grad)
            param.grad = view
        bucket.arrived.add(i)
        if len(bucket.arrived) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        self._all_reduce.submit(bucket.buffer)
        bucket.launched = True

    def on_train_batch_start(self) -> None:
        """Start a step from clean bookkeeping (finish already did; this covers a step that was abandoned
        between its backward pass and its synchronisation)."""
        self.reset()

    def reset(self) -> None:
        """Forget the previous step's bookkeeping and let go of its buffers (called by finish;
        harmless to call again)."""
        for bucket in self.buckets:
            bucket.arrived.clear()
            bucket.launched = False
            bucket.buffer = None

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        for bucket in self.buckets:
            if not bucket.launched:  # some parameters got no gradient this step
                if bucket.buffer is None:  # none at all: this rank contributes zeros
                    bucket.take_buffer(None, 0)
                for i in range(len(bucket.params)):
                    if i not in bucket.arrived:
                        bucket.view(i).zero_()
                self._launch(bucket)
        self._all_reduce.wait()
        self.reset()
