"""How the test session runs Triton kernels (at the repository root, not tests/conftest.py: that name
stays free for the course's own test suite, DESIGN.md).

Triton decides when a kernel is defined (`@triton.jit`, at its module's import) whether it runs
compiled or under its CPU interpreter, from TRITON_INTERPRET; one process cannot have both. So the
session picks once, here, before anything imports a kernel:
- no GPU: the interpreter, and every kernel test runs on CPU tensors (child processes inherit it);
- a GPU: compiled kernels; kernel tests run on CUDA tensors (the `kernel_device` fixture), tests of
  the CPU path itself skip (tests/kernel_devices.py), and CPU-only child processes (gloo ranks) that
  run kernels get the interpreter in their own environment (`interpreter_in_child_processes`).
A TRITON_INTERPRET already set is kept (=1 on a GPU machine runs every kernel test on the CPU).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # CUDA up front: torch's checkpoint raises at recomputation if the device state was initialised during the
    # forward it replays, and on a GPU machine a CPU-tensor test's first compile or kernel dispatch can do that
    # lazily, inside a checkpointed block (found on an H100: the first such test in a worker failed, and its
    # half-unwound checkpoint then failed every later checkpointing test in that worker).
    torch.cuda.init()

from tests.kernel_devices import KERNEL_DEVICE, NO_KERNEL_DEVICE  # noqa: E402  (reads the choice above)


@pytest.fixture
def kernel_device() -> str:
    """The device the Triton kernels run on in this session: "cpu" under the interpreter, else "cuda"."""
    if KERNEL_DEVICE is None:
        pytest.skip(NO_KERNEL_DEVICE)
    return KERNEL_DEVICE
