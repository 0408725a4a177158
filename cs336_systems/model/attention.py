"""Attention backends, chosen by name: the one registry of them.

Every backend takes q, k, v of shape (batch, heads, seq, head_dim) and `is_causal`, and returns the
attention output of the same shape. `naive` materialises the score matrix; `sdpa` is PyTorch's fused
`scaled_dot_product_attention`, which picks its kernel itself; `sdpa_flash` and `sdpa_cudnn` force one
of its fused kernels (FlashAttention-2's, cuDNN's: the anchors the flash benchmark times ours against);
`flash_pytorch` and `flash_triton` are our FlashAttention-2 kernels (`cs336_systems.kernels`).

The model is the ground floor of the package: this module imports nothing of the kernels or the
benchmarks. The kernels' backends are named here by "module:function" and imported on first use, so
every backend is known as soon as the model is, and only the one chosen is loaded (the Triton one
imports Triton, which `bench/kernel_resources.py` must be able to configure before it is imported).
A path may name a module at or below `cs336_systems.kernels`, never one above (a test checks it).
Layers above register their own backends when they are imported: `cs336_systems.bench.e2e` adds
`naive_annotated` (naive with profiler ranges), so a CLI that imports it offers that name too. CLI
choices and the flash benchmark's providers are read from `ATTENTION_BACKENDS`: a new backend is one
entry here (or one `register_attention` call beside its definition).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def causal_mask(n_queries: int, n_keys: int, device: torch.device) -> torch.Tensor:
    """True where query i may attend to key j (j <= i), aligned at the start of both sequences."""
    q_idx = torch.arange(n_queries, device=device)[:, None]
    k_idx = torch.arange(n_keys, device=device)[None, :]
    return k_idx <= q_idx


def attention_scores(q: torch.Tensor, k: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """S = q k^T / sqrt(d), shape (..., n_q, n_k), in q's dtype; causal: -inf where a key comes after
    its query. The reference the kernels are checked against: logsumexp(S) is their L."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (..., n_q, n_k)
    if is_causal:
        scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return scores


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool = False,
    section: Callable[[str], contextlib.AbstractContextManager] = lambda name: contextlib.nullcontext(),
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v, materialising the (.., n_q, n_k) scores: the model's plain
    backend and the one reference the FlashAttention-2 kernels are tested and benchmarked against.

    `section(name)` wraps each of the three stages ("scores", "softmax", "final matmul"); the
    profiler passes NVTX ranges here, so this file stays free of profiling code.
    """
    with section("scores"):
        scores = attention_scores(q, k, is_causal)
    with section("softmax"):
        probs = torch.softmax(scores, dim=-1)
    with section("final matmul"):
        return probs @ v


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


class GradInOutputStrides(torch.autograd.Function):
    """The identity, whose backward hands the output's gradient on in the output's own strides (copied only where
    they differ). Why: torch 2.11's cuDNN attention backward keeps a cuDNN plan per call layout, built for the dO
    strides of the layout's first backward, and runs it on a later dO of other strides: dQ, dK and dV come back
    wrong, with no error (cs336_systems/kernels/DECISIONS.md, "SDPA cuDNN's backward plan per call layout"). O's
    strides follow q's, so with dO always in O's strides a layout's dO strides never change; torch itself made dO
    match O before it let their strides differ (pytorch PR #141147). In a model, which transposes O back to
    (batch, seq, heads * dim), dO arrives in O's strides and nothing is copied."""

    @staticmethod
    def forward(ctx, out: torch.Tensor) -> torch.Tensor:
        ctx.out_stride = out.stride()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if grad.stride() == ctx.out_stride:
            return grad
        return torch.empty_strided(grad.shape, ctx.out_stride, dtype=grad.dtype, device=grad.device).copy_(grad)


def sdpa_kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, *,
                          kernel: SDPBackend) -> torch.Tensor:
    """`sdpa` with one of its kernels forced (an error where that kernel does not take the inputs:
    "No available kernel"). Also takes (batch, n, d) inputs, viewed as one batch of heads: the fused
    kernels need the heads dimension, and the flash benchmark times head-less inputs. cuDNN's output passes
    through `GradInOutputStrides`, so that its backward always sees dO in O's strides."""
    view = q.dim() == 3
    if view:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    with sdpa_kernel(kernel):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    if kernel == SDPBackend.CUDNN_ATTENTION:
        out = GradInOutputStrides.apply(out)
    return out.squeeze(0) if view else out


# SDPA's fused kernels as backends of their own: CUDA only, 16-bit inputs only.
SDPA_KERNELS: dict[str, SDPBackend] = {"sdpa_flash": SDPBackend.FLASH_ATTENTION,
                                       "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}

# Each backend: a function, or "module:function" (at or below cs336_systems.kernels) imported by
# `get_attention` when a model asks for it.
ATTENTION_BACKENDS: dict[str, AttentionFn | str] = {
    "naive": naive_attention,
    "sdpa": sdpa_attention,
    **{name: functools.partial(sdpa_kernel_attention, kernel=kernel) for name, kernel in SDPA_KERNELS.items()},
    "flash_pytorch": "cs336_systems.kernels.flash.reference:flash_attention_pytorch",
    "flash_triton": "cs336_systems.kernels.flash.api:flash_attention_triton",
}


def register_attention(name: str, fn: AttentionFn | str) -> None:
    """Add (or replace) a backend: a function, or "module:function" imported on first use."""
    if isinstance(fn, str) and (fn.count(":") != 1 or not all(fn.split(":"))):
        raise ValueError(f"attention backend {name!r}: {fn!r} is not 'module:function'")
    ATTENTION_BACKENDS[name] = fn


def get_attention(name: str) -> AttentionFn:
    """The backend called `name`, importing its module if it is named by path."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(sorted(ATTENTION_BACKENDS))}")
    fn = ATTENTION_BACKENDS[name]
    if isinstance(fn, str):
        module, function = fn.split(":")
        fn = getattr(importlib.import_module(module), function)
    return fn
