"""One AdamW step of one parameter tensor in a single Triton kernel.

The multi-tensor (`torch._foreach_*`) update makes eight passes over memory (weight decay, first
moment, second moment twice, square root, two for the denominator, the update); this kernel reads the
parameter, gradient and both moments once and writes the parameter and moments once: 7 tensor
passes instead of about 20. The arithmetic follows torch.optim.AdamW's order (see cs336_systems/optim.py).

Each tensor may be float32, bfloat16 or float16 on its own (bf16 parameters and gradients with bf16 or
float32 moments, the 8B step's choices): every value is loaded into float32, updated in float32 and
rounded to its tensor's dtype once when stored (round to nearest even on the GPU; Triton's CPU
interpreter truncates instead, one unit in the last place at most).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from cs336_systems.kernels.common import INTERPRET, check_kernel_device

# Elements per program. The interpreter runs the programs one after another, each operation on its whole block at
# once in NumPy, at a fixed cost per operation: long blocks there take a small model's update from hundreds of
# programs per tensor to a few (the CPU tests and the smoke-scale jobs).
BLOCK = 1 << 16 if INTERPRET else 1024
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, n, decay, beta1_weight, beta2, one_minus_beta2, bias2_sqrt, eps,
                  step_size, BLOCK: tl.constexpr, HAS_COPY: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    p = tl.load(p_ptr + offsets, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offsets, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offsets, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offsets, mask=mask).to(tl.float32)
    p = p * decay
    # torch.lerp's two forms, chosen by the weight as torch chooses them
    if beta1_weight < 0.5:
        m = m + beta1_weight * (g - m)
    else:
        m = g - (g - m) * (1.0 - beta1_weight)
    v = v * beta2 + one_minus_beta2 * (g * g)
    denom = tl.sqrt(v) / bias2_sqrt + eps
    p = p + (-step_size) * (m / denom)
    tl.store(p_ptr + offsets, p.to(p_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    if HAS_COPY:  # the narrow copy the model computes with, p being its float32 master
        tl.store(w_ptr + offsets, p.to(w_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(m_ptr + offsets, m.to(m_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(v_ptr + offsets, v.to(v_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def adamw_step_(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                copy: torch.Tensor | None = None) -> None:
    """Update p, exp_avg and exp_avg_sq in place (each float32, bfloat16 or float16, all of one shape,
    contiguous, on CUDA or under the interpreter)."""
    tensors = {"param": p, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if copy is not None:
        tensors["copy"] = copy
    for name, t in tensors.items():
        if t.dtype not in DTYPES or not t.is_contiguous():
            raise ValueError(f"fused AdamW needs contiguous float32, bfloat16 or float16 tensors; {name} is {t.dtype}"
                             f"{'' if t.is_contiguous() else ', not contiguous'}")
        if t.shape != p.shape:
            raise ValueError(f"fused AdamW: {name} has shape {tuple(t.shape)}, the parameter {tuple(p.shape)}")
    check_kernel_device(p, "fused AdamW")
    n = p.numel()
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        p, grad, exp_avg, exp_avg_sq, p if copy is None else copy, n, 1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2,
        math.sqrt(1 - beta2**step), eps, lr / (1 - beta1**step), BLOCK=BLOCK, HAS_COPY=copy is not None)
