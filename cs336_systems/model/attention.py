"""Attention backends, chosen by name.

Every backend takes q, k, v of shape (batch, heads, seq, head_dim) and `is_causal`, and returns the
attention output of the same shape. `naive` materialises the score matrix; `sdpa` is PyTorch's fused
`scaled_dot_product_attention`; `flash_pytorch` and `flash_triton` are our FlashAttention-2 kernels
(`cs336_systems.kernels`); `naive_annotated` is `naive` with profiler ranges around its three stages
(`cs336_systems.bench.e2e`).

The model is the ground floor of the package: this module imports nothing of the kernels or the
benchmarks. Backends defined above it are named here by "module:function" and imported on first use,
so every backend is known as soon as the model is, and only the one chosen is loaded (the Triton one
imports Triton, which `bench/kernel_resources.py` must be able to configure before it is imported).
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

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


# Each backend: a function, or "module:function" for one defined above the model, imported by
# `get_attention` when a model asks for it.
ATTENTION_BACKENDS: dict[str, AttentionFn | str] = {
    "naive": naive_attention,
    "sdpa": sdpa_attention,
    "flash_pytorch": "cs336_systems.kernels.flash_pytorch:flash_attention_pytorch",
    "flash_triton": "cs336_systems.kernels.flash_triton:flash_attention_triton",
    "naive_annotated": "cs336_systems.bench.e2e:naive_annotated_attention",
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
