"""A toy model for the distributed tests; ranks are started by cs336_systems.distributed.launch."""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from cs336_systems.distributed.launch import run_distributed

__all__ = ["ToyModelWithTiedAndFrozen", "run_distributed", "seed"]


def seed(base: int) -> int:
    """A test's seed: base, shifted by $CS336_TEST_SEED (0 when unset), so that the correctness rule
    (cs336_systems.bench.ddp_correctness) can rerun the same tests on fresh weights and batches."""
    return base + 1000 * int(os.environ.get("CS336_TEST_SEED", "0"))


class ToyModelWithTiedAndFrozen(nn.Module):
    """Two layers sharing one weight (used twice), a frozen layer, and a buffer."""

    def __init__(self, d_in: int = 10, d_hidden: int = 12, d_out: int = 5):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.tied = nn.Linear(d_hidden, d_hidden, bias=False)
        self.frozen = nn.Linear(d_hidden, d_hidden)
        self.frozen.requires_grad_(False)
        self.fc2 = nn.Linear(d_hidden, d_out)
        self.register_buffer("scale", torch.randn(d_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(x)) * self.scale
        x = torch.relu(self.tied(x))
        x = self.frozen(x)
        x = torch.relu(self.tied(x))  # the same weight a second time
        return self.fc2(x)
