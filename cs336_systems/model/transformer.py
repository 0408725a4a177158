"""A pre-norm Transformer language model (the CS336 Assignment 1 architecture).

token embedding → num_layers × [x + MHA(RMSNorm(x)); x + SwiGLU(RMSNorm(x))] → RMSNorm → LM head.
Attention is causal multi-head self-attention with rotary position embeddings (RoPE); which kernel
computes it is a name looked up in `cs336_systems.model.attention`.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from cs336_systems.model.attention import get_attention
from cs336_systems.model.checkpointing import NO_CHECKPOINTING, run_blocks
from cs336_systems.model.config import ModelConfig


def _trunc_normal_(weight: torch.Tensor, std: float) -> torch.Tensor:
    return nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


class Linear(nn.Module):
    """y = x W^T without bias; W initialised N(0, 2/(in+out)) truncated at 3 sigma."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        _trunc_normal_(self.weight, std=math.sqrt(2.0 / (in_features + out_features)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        _trunc_normal_(self.weight, std=1.0)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.weight[token_ids]


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the input dtype: the mean of squares is what loses precision.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight).to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotates each pair (x[2i], x[2i+1]) by angle pos * theta^(-2i/d)."""

    def __init__(self, head_dim: int, context_length: int, theta: float):
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (d/2,)
        angles = torch.arange(context_length, dtype=torch.float64)[:, None] * inv_freq  # (T, d/2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos[positions], self.sin[positions]  # (T, d/2)
        x_even, x_odd = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
        return rotated.flatten(-2).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.q_proj = Linear(config.d_model, config.d_model)
        self.k_proj = Linear(config.d_model, config.d_model)
        self.v_proj = Linear(config.d_model, config.d_model)
        self.output_proj = Linear(config.d_model, config.d_model)
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
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = Linear(d_model, d_ff)
        self.w2 = Linear(d_ff, d_model)
        self.w3 = Linear(d_model, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.w1(x)
        return self.w2(a * torch.sigmoid(a) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ln1 = RMSNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = RMSNorm(config.d_model)
        self.ffn = SwiGLU(config.d_model, config.d_ff)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), rope, positions)
        return x + self.ffn(self.ln2(x))


class TransformerLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.token_embeddings = Embedding(config.vocab_size, config.d_model)
        self.rope = RotaryEmbedding(config.head_dim, config.context_length, config.rope_theta)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
        self.ln_final = RMSNorm(config.d_model)
        self.lm_head = Linear(config.d_model, config.vocab_size)
        self.checkpoint_policy = NO_CHECKPOINTING  # set by model.checkpointing.apply_activation_checkpointing

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids (B, T) int64 → logits (B, T, vocab_size)."""
        T = token_ids.shape[-1]
        if T > self.config.context_length:
            raise ValueError(f"sequence length {T} exceeds the model's context_length {self.config.context_length}")
        positions = torch.arange(T, device=token_ids.device)
        x = self.token_embeddings(token_ids)  # (B, T, d_model)
        x = run_blocks(self.layers, x, self.checkpoint_policy, self.rope, positions)
        return self.lm_head(self.ln_final(x))

    def compile_blocks(self, **kwargs) -> None:
        """torch.compile each Transformer block in place (regional compilation: the blocks share one
        graph, so compile time does not grow with depth); the embedding and the head stay eager."""
        for layer in self.layers:
            layer.compile(**kwargs)
