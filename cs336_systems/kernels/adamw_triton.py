"""One AdamW step of many parameter tensors in one Triton kernel launch (two with ragged tails).

The multi-tensor (`torch._foreach_*`) update makes eight passes over memory (weight decay, first
moment, second moment twice, square root, two for the denominator, the update); this kernel reads the
parameter, gradient and both moments once and writes the parameter and moments once: 7 tensor
passes instead of about 20. The arithmetic follows torch.optim.AdamW's order (see model/optimizer.py).

All tensors of a step go to one launch: a table holds each tensor's four addresses and every program
updates one chunk of one tensor. One launch per tensor (this kernel's first form) spent about 40 µs of
host time per tensor, more than the GPU needs for an xl attention matrix; the medium model's 219
tensors then took 8.6 ms, 1.4 TB/s (results/optimizer.csv, f7c4305).

Vector loads: Triton cannot see the alignment of an address loaded from a table, so the kernel
promises 16-byte alignment and a multiple of 16 elements where the host has checked both (VECTOR).
The rest (a tensor's last n % 16 elements, a misaligned tensor) goes to a second launch without
those promises.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from cs336_systems.kernels.flash_triton import INTERPRET

BLOCK = 1024  # elements per iteration of a program
CHUNK = 8 * BLOCK  # elements per program
ALIGN = 16  # elements; 64 bytes of float32, a multiple of the 16-byte vector width


@triton.jit
def _adamw_kernel(table_ptr, prog_tensor_ptr, prog_start_ptr, prog_end_ptr, decay, beta1_weight, beta2,
                  one_minus_beta2, bias2_sqrt, eps, step_size, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                  VECTOR: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(prog_tensor_ptr + pid)
    start = tl.load(prog_start_ptr + pid)
    end = tl.load(prog_end_ptr + pid)
    p_ptr = tl.load(table_ptr + 4 * t).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(table_ptr + 4 * t + 1).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(table_ptr + 4 * t + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(table_ptr + 4 * t + 3).to(tl.pointer_type(tl.float32))
    if VECTOR:
        p_ptr, g_ptr = tl.multiple_of(p_ptr, 16), tl.multiple_of(g_ptr, 16)
        m_ptr, v_ptr = tl.multiple_of(m_ptr, 16), tl.multiple_of(v_ptr, 16)
        start, end = tl.multiple_of(start, 16), tl.multiple_of(end, 16)
    for i in range(CHUNK // BLOCK):
        offsets = start + i * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < end
        p = tl.load(p_ptr + offsets, mask=mask)
        g = tl.load(g_ptr + offsets, mask=mask)
        m = tl.load(m_ptr + offsets, mask=mask)
        v = tl.load(v_ptr + offsets, mask=mask)
        p = p * decay
        # torch.lerp's two forms, chosen by the weight as torch chooses them
        if beta1_weight < 0.5:
            m = m + beta1_weight * (g - m)
        else:
            m = g - (g - m) * (1.0 - beta1_weight)
        v = v * beta2 + one_minus_beta2 * (g * g)
        denom = tl.sqrt(v) / bias2_sqrt + eps
        p = p + (-step_size) * (m / denom)
        tl.store(p_ptr + offsets, p, mask=mask)
        tl.store(m_ptr + offsets, m, mask=mask)
        tl.store(v_ptr + offsets, v, mask=mask)


def _programs(segments: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(tensor index, start, end) of every program: each segment [start, end) cut into CHUNKs."""
    tensor, start, end = [], [], []
    for t, lo, hi in segments:
        for s in range(lo, hi, CHUNK):
            tensor.append(t)
            start.append(s)
            end.append(min(s + CHUNK, hi))
    return tuple(torch.tensor(x, dtype=torch.int64, device=device) for x in (tensor, start, end))


@functools.lru_cache(maxsize=32)
def _plan(sizes: tuple[int, ...], aligned: tuple[bool, ...], device: torch.device):
    """The launches for tensors of these sizes: (VECTOR, program arrays) each; cached, as the sizes
    and alignments of a model's parameters do not change from step to step."""
    vector, scalar = [], []
    for t, (n, ok) in enumerate(zip(sizes, aligned)):
        body = n - n % ALIGN if ok else 0
        if body:
            vector.append((t, 0, body))
        if body < n:
            scalar.append((t, body, n))
    return [(flag, _programs(segments, device)) for flag, segments in ((True, vector), (False, scalar)) if segments]


def adamw_step_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, step: int) -> None:
    """Update every params[i], exp_avgs[i] and exp_avg_sqs[i] in place from grads[i] (float32,
    contiguous, one device: CUDA, or the CPU under the interpreter); all share the step count."""
    if not params:
        return
    device = params[0].device
    for i, group in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        for name, t in zip(("param", "grad", "exp_avg", "exp_avg_sq"), group):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.device != device:
                raise ValueError(f"fused AdamW needs contiguous float32 tensors on one device; {name} {i} is "
                                 f"{t.dtype} on {t.device}{'' if t.is_contiguous() else ', not contiguous'}")
            if t.numel() != group[0].numel():
                raise ValueError(f"fused AdamW: {name} {i} has {t.numel()} elements, its parameter {group[0].numel()}")
    if device.type != "cuda" and not INTERPRET:
        raise ValueError(f"fused AdamW needs CUDA tensors (or TRITON_INTERPRET=1), got device {device}")
    addresses = [t.data_ptr() for group in zip(params, grads, exp_avgs, exp_avg_sqs) for t in group]
    aligned = tuple(all(a % 16 == 0 for a in addresses[4 * i: 4 * i + 4]) for i in range(len(params)))
    table = torch.tensor(addresses, dtype=torch.int64, pin_memory=device.type == "cuda").to(device, non_blocking=True)
    scalars = (1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, math.sqrt(1 - beta2**step), eps,
               lr / (1 - beta1**step))
    for vector, programs in _plan(tuple(p.numel() for p in params), aligned, device):
        _adamw_kernel[(len(programs[0]),)](table, *programs, *scalars, BLOCK=BLOCK, CHUNK=CHUNK, VECTOR=vector)
