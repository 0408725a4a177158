"""A toy model for the distributed tests, and `run_cases`: many cases on one set of ranks (ranks are started by
cs336_systems.distributed.launch)."""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from cs336_systems.distributed.launch import run_distributed

__all__ = ["PASSED", "ToyModelWithTiedAndFrozen", "run_cases", "run_cases_once", "run_distributed", "seed"]


def seed(base: int) -> int:
    """A test's seed: base, shifted by $CS336_TEST_SEED (0 when unset), so that the correctness rule
    (cs336_systems.bench.ddp_correctness) can rerun the same tests on fresh weights and batches."""
    return base + 1000 * int(os.environ.get("CS336_TEST_SEED", "0"))


PASSED = "passed"


def _cases_on_each_rank(rank: int, world_size: int, cases: dict[str, tuple[Callable, tuple]], log_dir: str) -> None:
    for name, (fn, args) in cases.items():
        fn(rank, world_size, *args)
        with open(Path(log_dir) / f"rank{rank}.done", "a") as done:
            done.write(name + "\n")


def run_cases(cases: dict[str, tuple[Callable, tuple]], world_size: int = 2) -> dict[str, str]:
    """Each case's fn(rank, world_size, *args), in the order given, on one set of gloo ranks: one start-up (the ranks'
    imports and process group, seconds) for every case instead of one per case. Returns {case: PASSED,
    or why not}: the first case that fails on any rank stops the run and gets the ranks' error; the cases after
    it say they did not run. Each case must leave the process group as it found it (no collective pending)."""
    with tempfile.TemporaryDirectory() as log_dir:
        error = None
        try:
            run_distributed(_cases_on_each_rank, world_size, cases, log_dir)
        except Exception as failure:  # a rank's error, reported against the case it stopped
            error = f"{type(failure).__name__}: {failure}"
        done = [set(path.read_text().splitlines()) if path.exists() else set()
                for path in (Path(log_dir) / f"rank{rank}.done" for rank in range(world_size))]
    outcome, failed = {}, None
    for name in cases:
        if all(name in ranks_done for ranks_done in done):
            outcome[name] = PASSED
        elif failed is None:
            failed = name
            outcome[name] = error or "no rank reported it done"
        else:
            outcome[name] = f"not run: {failed!r} failed before it"
    return outcome


def run_cases_once(tmp_path_factory, worker_id: str, name: str, cases: dict[str, tuple[Callable, tuple]],
                   world_size: int = 2) -> dict[str, str]:
    """`run_cases` once per test session: the first pytest-xdist worker to ask runs the cases and writes their
    outcomes under `name` in the session's shared temporary directory, the others wait for it and read them (a run
    without xdist, worker "master", runs them itself)."""
    if worker_id == "master":
        return run_cases(cases, world_size)
    shared = tmp_path_factory.getbasetemp().parent  # one per session, above every worker's own
    outcomes = shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not outcomes.exists():
            outcomes.write_text(json.dumps(run_cases(cases, world_size)))
        return json.loads(outcomes.read_text())


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
