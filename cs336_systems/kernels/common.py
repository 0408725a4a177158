"""What the kernels share: the FlashAttention-2 input checks, whether Triton kernels run under
Triton's CPU interpreter in this process, the device check every Triton launcher makes, and a device's compute
capability (cached).

The plain-PyTorch reference they are checked against is the model's `naive_attention` (with
`attention_scores` for the logsumexp), in `cs336_systems.model.attention`.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

# Triton decides when a kernel is defined (`@triton.jit`, at its module's import) whether it runs
# compiled or under the CPU interpreter, from TRITON_INTERPRET. The kernel modules import this one just
# before defining theirs, so this records the mode their kernels have. Nothing in the package sets the
# variable: the entry points that mean the CPU path do (the test session, smoke-scale workflow jobs).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128


@functools.cache
def cuda_capability(index: int) -> tuple[int, int]:
    """The compute capability of CUDA device `index`, asked once (each ask reads the device's properties, which
    the short-call path of the attention kernels felt)."""
    return torch.cuda.get_device_capability(index)


def device_capability(t: torch.Tensor) -> tuple[int, int] | None:
    """t's device's compute capability, cached per device; None on the CPU or under Triton's interpreter."""
    if INTERPRET or not t.is_cuda:
        return None
    return cuda_capability(t.device.index if t.device.index is not None else torch.cuda.current_device())


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, name: str) -> None:
    """Clear errors for what the kernels do not support. Shapes: (..., n, d) with 1 or 2 leading dims."""
    for label, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() not in (3, 4):
            raise ValueError(f"{name}: {label} must be (batch, n, d) or (batch, heads, n, d), got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}: {label} has unsupported dtype {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{name}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{name}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{name}: incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    d = q.shape[-1]
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{name}: head dim {d} is not supported (1..{MAX_HEAD_DIM})")
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        raise ValueError(f"{name}: empty sequence (n_queries={q.shape[-2]}, n_keys={k.shape[-2]})")


def check_kernel_device(t: torch.Tensor, name: str) -> None:
    """A Triton kernel runs on CUDA tensors, or on CPU tensors only where its process runs the kernels
    under Triton's interpreter (decided before they were defined): a clear error otherwise."""
    if t.is_cuda or INTERPRET:
        return
    raise ValueError(f"{name}: got a tensor on device {t.device}, but the Triton kernels run on CUDA tensors; "
                     "set TRITON_INTERPRET=1 before importing cs336_systems (or triton) to run them on the CPU "
                     "under Triton's interpreter")


def interpreted_bfloat16(t: torch.Tensor, name: str) -> bool:
    """Whether a kernel call gets bfloat16 CPU tensors under Triton's interpreter, which cannot multiply bfloat16
    (NumPy has no such type: its dots come out wrong by orders of magnitude, with at most an overflow warning). Such
    a call computes in float32 instead and returns its results in bfloat16, and says so (a warning, which Python
    shows once per call site)."""
    if not (INTERPRET and t.dtype == torch.bfloat16 and not t.is_cuda):
        return False
    warnings.warn(f"{name}: Triton's CPU interpreter cannot multiply bfloat16, so this call computes in float32 and "
                  "returns bfloat16 results (on a GPU the kernels run in bfloat16)", RuntimeWarning, stacklevel=3)
    return True
