"""Optimizer-state sharding (ZeRO stage 1; handout 3).

Every rank keeps the full parameters and gradients but the optimizer state of only its shard:
parameters are assigned to ranks greedily by size as groups are added (the same on every rank,
since every rank sees the same parameters in the same order). A step runs in two phases:
  1. update: the wrapped optimizer (built over this rank's shard only) steps its parameters;
  2. all-gather: each rank broadcasts the parameters it owns, packed into one flat tensor per dtype,
     so every rank ends the step with all parameters updated.
Gradients are expected to be synchronised already (e.g. by a DDP wrapper). With one rank it is the
wrapped optimizer.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from cs336_systems.distributed.common import require_process_group


class ShardedOptimizer(Optimizer):
    def __init__(self, params, optimizer_cls: type[Optimizer], **kwargs: Any):
        self.rank, self.world_size = require_process_group(type(self).__name__)
        self._optimizer_cls = optimizer_cls
        self._kwargs = kwargs
        self._load = [0] * self.world_size  # elements owned per rank
        self._owner: dict[torch.Tensor, int] = {}
        self.local_optimizer: Optimizer | None = None
        super().__init__(params, defaults=kwargs)  # calls add_param_group for each group

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add the group to the full view and this rank's share of it to the local optimizer."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        mine = []
        for p in group["params"]:
            rank = min(range(self.world_size), key=lambda r: (self._load[r], r))  # least loaded, ties to low rank
            self._owner[p] = rank
            self._load[rank] += p.numel()
            if rank == self.rank:
                mine.append(p)
        local_group = {**{k: v for k, v in group.items() if k != "params"}, "params": mine}
        if self.local_optimizer is None:
            self.local_optimizer = self._optimizer_cls([local_group], **self._kwargs)
        else:
            self.local_optimizer.add_param_group(local_group)

    def step(self, closure=None, **kwargs):
        # Hyperparameters set on this wrapper (e.g. by an LR scheduler) reach the local optimizer.
        for full, local in zip(self.param_groups, self.local_optimizer.param_groups):
            local.update({k: v for k, v in full.items() if k != "params"})
        loss = self.local_optimizer.step(closure, **kwargs)  # 1. update this rank's shard
        if self.world_size > 1:
            self._gather_parameters()  # 2. every rank receives the others' updated shards
        return loss

    @torch.no_grad()
    def _gather_parameters(self) -> None:
        for owner in range(self.world_size):
            by_dtype: dict[tuple, list[torch.Tensor]] = defaultdict(list)
            for group in self.param_groups:
                for p in group["params"]:
                    if self._owner[p] == owner:
                        by_dtype[(p.dtype, p.device)].append(p)
            for params in by_dtype.values():
                flat = torch.cat([p.reshape(-1) for p in params])
                dist.broadcast(flat, src=owner)
                if owner != self.rank:
                    for p, part in zip(params, flat.split([p.numel() for p in params])):
                        p.copy_(part.view_as(p))

    def owned_parameters(self) -> list[torch.Tensor]:
        return [p for group in self.local_optimizer.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (save one file per rank)."""
        return {"rank": self.rank, "world_size": self.world_size, "local": self.local_optimizer.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if (state_dict["rank"], state_dict["world_size"]) != (self.rank, self.world_size):
            raise ValueError(f"state of rank {state_dict['rank']} of {state_dict['world_size']} cannot be loaded "
                             f"on rank {self.rank} of {self.world_size}")
        self.local_optimizer.load_state_dict(state_dict["local"])
