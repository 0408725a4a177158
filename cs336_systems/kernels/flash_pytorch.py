"""FlashAttention-2 in plain PyTorch: the readable reference for the Triton kernels.

Forward (handout Algorithm 1): for each query tile Q_i, stream over key tiles K_j, V_j keeping the
running row maximum m, the running sum l of exp(S − m) and the unnormalised output; rescale by
exp(m_old − m_new) whenever the maximum grows (online softmax). O_i = acc / l, L_i = m + log l.
Causal: key tiles entirely after the query tile are skipped; only tiles crossing the diagonal are
masked. Any lengths work (the last tile is short). Backward: recomputation from L (equations 13–19)
through `torch.compile`.
"""

from __future__ import annotations

import functools
import math

import torch

from cs336_systems.kernels.common import flash_backward_math, flash_function

TILE_Q = 64
TILE_K = 64


def flash_forward_pytorch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                          tile_q: int = TILE_Q, tile_k: int = TILE_K) -> tuple[torch.Tensor, torch.Tensor]:
    """O (q's dtype) and L (float32, shape q.shape[:-1]) for q (..., n_q, d), k and v (..., n_k, d)."""
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for i0 in range(0, n_q, tile_q):
        i1 = min(i0 + tile_q, n_q)
        q_i = q[..., i0:i1, :].float()  # (..., Bq, d)
        m = torch.full(q_i.shape[:-1], float("-inf"), device=q.device)  # (..., Bq)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(q_i)
        k_end = min(n_k, i1) if is_causal else n_k  # causal: keys after the tile's last query are skipped
        for j0 in range(0, k_end, tile_k):
            j1 = min(j0 + tile_k, n_k)
            s = q_i @ k[..., j0:j1, :].float().transpose(-2, -1) * scale  # (..., Bq, Bk)
            if is_causal and j1 - 1 > i0:  # the tile crosses the diagonal
                rows = torch.arange(i0, i1, device=q.device)[:, None]
                cols = torch.arange(j0, j1, device=q.device)[None, :]
                s = s.masked_fill(cols > rows, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new.unsqueeze(-1))
            alpha = torch.exp(m - m_new)
            l = alpha * l + p.sum(dim=-1)
            acc = alpha.unsqueeze(-1) * acc + p @ v[..., j0:j1, :].float()
            m = m_new
        out[..., i0:i1, :] = (acc / l.unsqueeze(-1)).to(q.dtype)
        lse[..., i0:i1] = m + torch.log(l)
    return out, lse


@functools.cache
def _compiled_backward():
    return torch.compile(flash_backward_math, dynamic=True)


def _backward(q, k, v, out, lse, grad_out, is_causal):
    return _compiled_backward()(q, k, v, out, lse, grad_out, is_causal)


FlashAttentionPytorch = flash_function("FlashAttentionPytorch", flash_forward_pytorch, _backward)


def flash_attention_pytorch(q, k, v, is_causal: bool = False) -> torch.Tensor:
    return FlashAttentionPytorch.apply(q, k, v, is_causal)
