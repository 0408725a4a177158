"""A pre-norm Transformer language model (the CS336 Assignment 1 architecture).

token embedding → num_layers × [x + MHA(RMSNorm(x)); x + SwiGLU(RMSNorm(x))] → RMSNorm → LM head.
Attention is causal multi-head self-attention with rotary position embeddings (RoPE); which kernel
computes it is a name looked up in `cs336_systems.model.attention`.

Parameters are created in the dtype and on the device given to `TransformerLM` (default float32 on
the current default device): an 8B model is built in bf16 on the GPU directly. Each weight is drawn in
float32 and then cast, so a model built in bf16 holds the fp32 model's weights (same seed) rounded.
The RoPE tables stay float32; activations follow the parameters' dtype.

Nothing here runs the blocks under checkpoints or compiles them: `cs336_systems.model.checkpointing` and
`cs336_systems.distributed.parallelize` do that from outside, by wrapping `layers`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn

from cs336_systems.model.attention import get_attention
from cs336_systems.model.config import ModelConfig
from cs336_systems.model.functional import cross_entropy

Device = torch.device | str | None
# (hidden (..., d), LM head weight (vocab, d), targets (...)) → mean cross-entropy of hidden @ weightᵀ
HeadLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _trunc_normal(shape: tuple[int, ...], std: float, dtype: torch.dtype | None, device: Device) -> nn.Parameter:
    """N(0, std²) truncated at 3 sigma, drawn in float32 (the same random stream whatever the dtype)
    and then cast: one float32 tensor at a time, on the target device."""
    weight = torch.empty(shape, dtype=torch.float32, device=device)
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
    return nn.Parameter(weight if dtype in (None, torch.float32) else weight.to(dtype))


class Linear(nn.Module):
    """y = x W^T without bias; W initialised N(0, 2/(in+out)) truncated at 3 sigma."""

    def __init__(self, in_features: int, out_features: int, *, dtype: torch.dtype | None = None,
                 device: Device = None):
        super().__init__()
        self.weight = _trunc_normal((out_features, in_features), math.sqrt(2.0 / (in_features + out_features)),
                                    dtype, device)

    def forward(self, x: torch.Tensor, *, fuse=None) -> torch.Tensor:
        """x @ Wᵀ; or `fuse(x, W)` in its place (the LM head's fused cross-entropy), computed inside this
        layer's forward so that wrappers which swap the weight around the call (FSDP) hand over the full one."""
        if fuse is not None:
            return fuse(x, self.weight)
        return x @ self.weight.T


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, dtype: torch.dtype | None = None,
                 device: Device = None):
        super().__init__()
        self.weight = _trunc_normal((num_embeddings, embedding_dim), 1.0, dtype, device)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.weight[token_ids]


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-5, *, dtype: torch.dtype | None = None, device: Device = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the input dtype: the mean of squares is what loses precision.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight).to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotates each pair (x[2i], x[2i+1]) by angle pos * theta^(-2i/d)."""

    def __init__(self, head_dim: int, context_length: int, theta: float, *, device: Device = None):
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)  # (d/2,)
        angles = torch.arange(context_length, dtype=torch.float64, device=device)[:, None] * inv_freq  # (T, d/2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos[positions], self.sin[positions]  # (T, d/2)
        x_even, x_odd = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
        return rotated.flatten(-2).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, **factory):
        super().__init__()
        self.num_heads = config.num_heads
        d = config.d_model
        self.q_proj = Linear(d, d, **factory)
        self.k_proj = Linear(d, d, **factory)
        self.v_proj = Linear(d, d, **factory)
        self.output_proj = Linear(d, d, **factory)
        self.attention = get_attention(config.attention)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(B, T, self.num_heads, -1).transpose(1, 2)  # (B, H, T, d_head)

        q = rope(heads(self.q_proj(x)), positions)
        k = rope(heads(self.k_proj(x)), positions)
        v = heads(self.v_proj(x))
        out = self.attention(q, k, v, True)  # (B, H, T, d_head)
        return self.output_proj(out.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int, **factory):
        super().__init__()
        self.w1 = Linear(d_model, d_ff, **factory)
        self.w2 = Linear(d_ff, d_model, **factory)
        self.w3 = Linear(d_model, d_ff, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.w1(x)
        return self.w2(a * torch.sigmoid(a) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, **factory):
        super().__init__()
        self.ln1 = RMSNorm(config.d_model, **factory)
        self.attn = CausalSelfAttention(config, **factory)
        self.ln2 = RMSNorm(config.d_model, **factory)
        self.ffn = SwiGLU(config.d_model, config.d_ff, **factory)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), rope, positions)
        return x + self.ffn(self.ln2(x))


class TransformerBlocks(nn.ModuleList):
    """The stack of blocks, called as one module: x → blocks[-1](...blocks[0](x, ...)...). Activation
    checkpointing replaces it by a subclass holding the same blocks (parameter names unchanged) whose
    forward runs them under checkpoints (`cs336_systems.model.checkpointing`)."""

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor) -> torch.Tensor:
        for block in self:
            x = block(x, rope, positions)
        return x


class TransformerLM(nn.Module):
    """TransformerLM(config, dtype=torch.bfloat16, device="cuda"): parameters created in `dtype` on
    `device` (default: float32 on the current default device)."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype | None = None, device: Device = None):
        super().__init__()
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
        factory = dict(dtype=dtype, device=device)
        self.config = config
        self.token_embeddings = Embedding(config.vocab_size, config.d_model, **factory)
        self.rope = RotaryEmbedding(config.head_dim, config.context_length, config.rope_theta, device=device)
        self.layers = TransformerBlocks(TransformerBlock(config, **factory) for _ in range(config.num_layers))
        self.ln_final = RMSNorm(config.d_model, **factory)
        self.lm_head = Linear(config.d_model, config.vocab_size, **factory)

    def hidden(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids (B, T) int64 → the final-normed hidden states (B, T, d_model): all but the LM head."""
        T = token_ids.shape[-1]
        if T > self.config.context_length:
            raise ValueError(f"sequence length {T} exceeds the model's context_length {self.config.context_length}")
        positions = torch.arange(T, device=token_ids.device)
        x = self.token_embeddings(token_ids)  # (B, T, d_model)
        x = self.layers(x, self.rope, positions)
        return self.ln_final(x)

    def forward(self, token_ids: torch.Tensor, *, targets: torch.Tensor | None = None,
                head_loss: HeadLoss | None = None) -> torch.Tensor:
        """token_ids (B, T) int64 → logits (B, T, vocab_size).

        With `targets` (B, T): the mean cross-entropy of those logits instead, `head_loss(hidden, W, targets)`
        of the final hidden states and the LM head's weight, computed inside the head's forward (default:
        the plain `cross_entropy` of the logits). `cs336_systems.train_step.lm_loss` passes the fused LM
        head + cross-entropy kernel here, which never holds the (B·T, vocab) logits; the model itself
        imports no kernel. The loss goes through forward so that data-parallel wrappers, which act around
        the model's and the head's calls (FSDP gathers the head's weight there), see an ordinary forward."""
        h = self.hidden(token_ids)
        if targets is None:
            return self.lm_head(h)
        if head_loss is None:
            return cross_entropy(self.lm_head(h), targets)
        return self.lm_head(h, fuse=lambda hidden, weight: head_loss(hidden, weight, targets))

    def compile_blocks(self, **kwargs) -> None:
        """torch.compile each Transformer block in place (regional compilation: the blocks share one
        graph, so compile time does not grow with depth); the embedding and the head stay eager.
        Kept for existing callers: `cs336_systems.distributed.parallelize` applies compilation in its
        order with checkpointing and data parallelism (ParallelPlan(compile="blocks"))."""
        for layer in self.layers:
            layer.compile(**kwargs)
