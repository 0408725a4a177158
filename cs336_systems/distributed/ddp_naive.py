"""The minimal data-parallel baselines (handout 2.2, 2.3): after backward, all-reduce every gradient
one by one (`flat=False`), or all of them as one flattened tensor (`flat=True`). No overlap with
the backward pass."""

from __future__ import annotations

import torch
import torch.nn as nn

from cs336_systems.distributed.common import (
    all_reduce_mean,
    broadcast_from_rank0,
    require_process_group,
    trainable_parameters,
)


class DDPNaive(nn.Module):
    def __init__(self, module: nn.Module, flat: bool = False):
        super().__init__()
        require_process_group(type(self).__name__)
        self.module = module
        self.flat = flat
        self._params = trainable_parameters(module)
        broadcast_from_rank0(module)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def on_train_batch_start(self) -> None:
        """Nothing to prepare: all the work happens after the backward pass."""

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Average the gradients over ranks (parameters without a gradient are left alone)."""
        grads = [p.grad for p in self._params if p.grad is not None]
        if not grads:
            return
        if not self.flat:
            for grad in grads:
                all_reduce_mean(grad)
            return
        flat = torch.cat([g.reshape(-1) for g in grads])  # one call instead of one per tensor
        all_reduce_mean(flat)
        for grad, part in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(part.view_as(grad))
