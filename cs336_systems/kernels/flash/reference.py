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

from cs336_systems.kernels.common import check_inputs
from cs336_systems.model.attention import attention_scores

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


def flash_backward_math(q, k, v, o, lse, do, is_causal: bool):
    """dQ, dK, dV by recomputation from L (handout equations 13–19), in float32.

    P = exp(S − L), dV = Pᵀ dO, dP = dO Vᵀ, D = rowsum(dO ∘ O), dS = P ∘ (dP − D), dQ = dS K / √d,
    dK = dSᵀ Q / √d. Materialises the (n_q, n_k) matrices: the readable backward, not a fast one.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    qf, kf, vf, of, dof = (t.float() for t in (q, k, v, o, do))
    p = torch.exp(attention_scores(qf, kf, is_causal) - lse.unsqueeze(-1))  # (..., n_q, n_k)
    dv = p.transpose(-2, -1) @ dof
    dp = dof @ vf.transpose(-2, -1)
    delta = (dof * of).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = ds @ kf * scale
    dk = ds.transpose(-2, -1) @ qf * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@functools.cache
def _compiled_backward():
    return torch.compile(flash_backward_math, dynamic=True)


class FlashAttentionPytorch(torch.autograd.Function):
    """FlashAttention-2 with the tiled forward above and the compiled recomputation backward, called as
    `FlashAttentionPytorch.apply(q, k, v, is_causal)`: q (..., n_q, d), k and v (..., n_k, d), with one
    or two leading dims. Saves L (shape q.shape[:-1], float32), Q, K, V and O for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        check_inputs(q, k, v, "FlashAttentionPytorch")
        out, lse = flash_forward_pytorch(q, k, v, is_causal)
        ctx.save_for_backward(lse, q, k, v, out)
        ctx.is_causal = is_causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        lse, q, k, v, out = ctx.saved_tensors
        dq, dk, dv = _compiled_backward()(q, k, v, out, lse, grad_out, ctx.is_causal)
        return dq, dk, dv, None


def flash_attention_pytorch(q, k, v, is_causal: bool = False) -> torch.Tensor:
    return FlashAttentionPytorch.apply(q, k, v, is_causal)
