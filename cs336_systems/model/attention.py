"""Attention backends, chosen by name.

Every backend takes q, k, v of shape (batch, heads, seq, head_dim) and `is_causal`, and returns the
attention output of the same shape. `naive` materialises the score matrix; `sdpa` is PyTorch's fused
`scaled_dot_product_attention`; the FlashAttention-2 kernels register themselves as `flash_pytorch`
and `flash_triton` (see `cs336_systems.kernels`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]
ATTENTION_BACKENDS: dict[str, AttentionFn] = {}


def register_attention(name: str, fn: AttentionFn) -> None:
    ATTENTION_BACKENDS[name] = fn


def get_attention(name: str) -> AttentionFn:
    if name not in ATTENTION_BACKENDS:
        import cs336_systems.kernels  # noqa: F401  (registers the flash backends on first use)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(sorted(ATTENTION_BACKENDS))}")
    return ATTENTION_BACKENDS[name]


def causal_mask(n_queries: int, n_keys: int, device: torch.device) -> torch.Tensor:
    """True where query i may attend to key j (j <= i), aligned at the start of both sequences."""
    q_idx = torch.arange(n_queries, device=device)[:, None]
    k_idx = torch.arange(n_keys, device=device)[None, :]
    return k_idx <= q_idx


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool = False,
    section: Callable[[str], contextlib.AbstractContextManager] = lambda name: contextlib.nullcontext(),
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v, materialising the (.., n_q, n_k) scores.

    `section(name)` wraps each of the three stages ("scores", "softmax", "final matmul"); the
    profiler passes NVTX ranges here, so this file stays free of profiling code.
    """
    with section("scores"):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (..., n_q, n_k)
        if is_causal:
            scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    with section("softmax"):
        probs = torch.softmax(scores, dim=-1)
    with section("final matmul"):
        return probs @ v


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


register_attention("naive", naive_attention)
register_attention("sdpa", sdpa_attention)
