"""The plain-PyTorch baseline the end-to-end benchmark times beside our model, in the same run.

The same architecture and config as `cs336_systems.model.TransformerLM` (pre-norm blocks, RMSNorm,
RoPE, SwiGLU, untied embedding and LM head, no biases), written only with what torch provides:
`nn.Linear`, `nn.Embedding`, `nn.RMSNorm`, `F.scaled_dot_product_attention` (causal), `F.silu`. It has
exactly our model's parameters (tests/test_bench.py checks the count and that both compute the same
function from the same weights); the benchmark compiles it whole and trains it with
torch.optim.AdamW(fused=True). It is what "a plain PyTorch model" costs on the same GPU, so our
numbers are compared with a measurement, not a quoted figure.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from cs336_systems.model.config import ModelConfig


class PlainRotary(nn.Module):
    """RoPE on interleaved pairs (x[2i], x[2i+1]), angle pos * theta^(-2i/d), as our model rotates."""

    def __init__(self, head_dim: int, context_length: int, theta: float):
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(context_length, dtype=torch.float64), inv_freq)  # (T, d/2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, H, T, d)
        T = x.shape[-2]
        cos, sin = self.cos[:T], self.sin[:T]
        pairs = x.unflatten(-1, (-1, 2))  # (B, H, T, d/2, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).to(x.dtype)


class PlainBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        d, f = config.d_model, config.d_ff
        self.num_heads = config.num_heads
        self.ln1, self.ln2 = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor, rope: PlainRotary) -> torch.Tensor:
        B, T, _ = x.shape
        h = self.ln1(x)
        q, k, v = (proj(h).view(B, T, self.num_heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)  # (B, H, T, d_head)
        x = x + self.o(out.transpose(1, 2).reshape(B, T, -1))
        h = self.ln2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class PlainTransformerLM(nn.Module):
    """token_ids (B, T) int64 → logits (B, T, vocab_size), with torch's own modules."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.rope = PlainRotary(config.head_dim, config.context_length, config.rope_theta)
        self.blocks = nn.ModuleList(PlainBlock(config) for _ in range(config.num_layers))
        self.ln_final = nn.RMSNorm(config.d_model, eps=1e-5)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(token_ids)
        for block in self.blocks:
            x = block(x, self.rope)
        return self.head(self.ln_final(x))
