"""Running a function on N CPU processes with the gloo backend, for the distributed tests."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    # A short timeout turns a rank that never arrives into an error instead of a hang.
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int = 2, *args) -> None:
    """fn(rank, world_size, *args) on each rank; any rank raising fails the call (others are killed)."""
    mp.spawn(_worker, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True)


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
