"""Where the tests run Triton kernels, as the session chose (the repository's conftest.py says why and
how): the device, a mark for tests of the CPU path, and the interpreter for CPU-only child processes."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch

# The mode the kernels of this process are defined in (cs336_systems.kernels.common.INTERPRET reads
# the same variable when the kernels are imported, after the session's conftest set it).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICE = "cpu" if INTERPRET else "cuda" if torch.cuda.is_available() else None
NO_KERNEL_DEVICE = "no GPU, and TRITON_INTERPRET is not 1: the Triton kernels cannot run in this process"

# A test of the CPU path itself (Triton kernels on CPU tensors): only where the interpreter is on.
cpu_kernels = pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels on CPU tensors, which needs "
                                 "the interpreter (the session switches it on only where there is no GPU)")


@contextlib.contextmanager
def interpreter_in_child_processes() -> Iterator[None]:
    """TRITON_INTERPRET=1 in the environment that processes started inside the block inherit (gloo
    ranks, which run the kernels on CPU tensors), whatever this process runs them with. Not for FA2's kernels on
    the GPU machines: Triton 3.6's interpreter turns a loop bound into an int by a conversion numpy 2.5 (theirs)
    refuses, so tests that run FA2 in gloo ranks are `cpu_kernels` tests."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def gluon_call(rule, head_dim: int, is_causal: bool, batch: int = 1) -> tuple[int, int, int, int]:
    """The smallest square (batch, heads, n, head_dim) call that `rule` (a flash_dispatch.GluonRule) gives the Gluon
    kernel: n its `min_keys`, heads the fewest powers of two that reach its `min_scores`."""
    n, heads = rule.min_keys, 1
    while not rule.holds((batch, heads, n, head_dim), (batch, heads, n, head_dim), is_causal):
        heads *= 2
    return batch, heads, n, head_dim
