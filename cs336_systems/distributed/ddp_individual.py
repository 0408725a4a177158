"""Data parallelism that overlaps communication with the backward pass (handout 2.3).

Each gradient is all-reduced asynchronously the moment autograd has finished accumulating it (a
post-accumulate-grad hook), while the backward pass goes on computing earlier layers' gradients.
`finish_gradient_synchronization()` waits for the outstanding reductions; call it after backward
and before optimizer.step(). The hooks issue the all-reduces themselves; `background_issue=True` issues
them from a worker thread instead (`AsyncAllReduce` says why that was tried and why it is not the default).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from cs336_systems.distributed.common import (
    AsyncAllReduce,
    broadcast_from_rank0,
    require_process_group,
    trainable_parameters,
    weak_hook,
)


class DDPIndividualParameters(nn.Module):
    def __init__(self, module: nn.Module, background_issue: bool = False):
        super().__init__()
        require_process_group(type(self).__name__)
        self.module = module
        params = trainable_parameters(module)
        self._all_reduce = AsyncAllReduce(params[0].device if params else torch.device("cpu"), background_issue)
        broadcast_from_rank0(module)
        # A tied weight is one leaf with one AccumulateGrad node: its hook fires once per backward,
        # after both uses have been summed, so it is reduced once.
        for param in params:
            param.register_post_accumulate_grad_hook(weak_hook(self._reduce))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def _reduce(self, param: torch.Tensor) -> None:
        self._all_reduce.submit(param.grad)

    def on_train_batch_start(self) -> None:
        """Nothing to prepare: each hook reduces its gradient whenever it is ready."""

    def finish_gradient_synchronization(self) -> None:
        """Wait for the all-reduces the hooks issued; the averaged gradients are then in `.grad`."""
        self._all_reduce.wait()
