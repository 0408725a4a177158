"""Input checks and the plain-PyTorch reference shared by both FlashAttention-2 implementations."""

from __future__ import annotations

import math

import torch

from cs336_systems.model.attention import causal_mask

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128


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


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference O and logsumexp L (natural log) by the textbook formulas, in the inputs' dtype.

    Causal masking aligns queries and keys at the start: query i sees keys 0..i.
    """
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if is_causal:
        scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ v, lse


def flash_backward_math(q, k, v, o, lse, do, is_causal: bool):
    """dQ, dK, dV by recomputation from L (handout equations 13–19), in float32.

    P = exp(S − L), dV = Pᵀ dO, dP = dO Vᵀ, D = rowsum(dO ∘ O), dS = P ∘ (dP − D), dQ = dS K / √d,
    dK = dSᵀ Q / √d. Materialises the (n_q, n_k) matrices: the readable reference, not the fast path.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    qf, kf, vf, of, dof = (t.float() for t in (q, k, v, o, do))
    s = qf @ kf.transpose(-2, -1) * scale
    if is_causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))
    dv = p.transpose(-2, -1) @ dof
    dp = dof @ vf.transpose(-2, -1)
    delta = (dof * of).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = ds @ kf * scale
    dk = ds.transpose(-2, -1) @ qf * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def flash_function(name: str, forward, backward) -> type[torch.autograd.Function]:
    """A FlashAttention-2 `autograd.Function` from a forward (q, k, v, is_causal) -> (O, L) and a backward
    (q, k, v, O, L, dO, is_causal) -> (dQ, dK, dV). Forward saves L (shape q.shape[:-1]), Q, K, V and O;
    called as `Cls.apply(q, k, v, is_causal)`."""

    def forward_(ctx, q, k, v, is_causal=False):
        check_inputs(q, k, v, name)
        out, lse = forward(q, k, v, is_causal)
        ctx.save_for_backward(lse, q, k, v, out)
        ctx.is_causal = is_causal
        return out

    def backward_(ctx, grad_out):
        lse, q, k, v, out = ctx.saved_tensors
        dq, dk, dv = backward(q, k, v, out, lse, grad_out, ctx.is_causal)
        return dq, dk, dv, None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward_), "backward": staticmethod(backward_),
                                                    "__doc__": flash_function.__doc__})
