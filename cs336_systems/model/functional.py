"""Loss and model accounting: cross-entropy, parameter count and FLOPs per step (for MFU)."""

from __future__ import annotations

import torch

from cs336_systems.model.config import ModelConfig


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean of -log softmax(logits)[target] over all leading dims, computed stably in float32."""
    logits = logits.float()
    logits = logits - logits.amax(dim=-1, keepdim=True)
    log_z = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (log_z - target_logit).mean()


def parameter_count(config: ModelConfig) -> int:
    """Trainable parameters of TransformerLM, from the formula (embedding and LM head are untied)."""
    d, f = config.d_model, config.d_ff
    per_layer = 4 * d * d + 3 * d * f + 2 * d  # q,k,v,o projections; SwiGLU w1,w2,w3; two RMSNorm gains
    return 2 * config.vocab_size * d + config.num_layers * per_layer + d


def forward_flops(config: ModelConfig, batch_size: int, seq_len: int) -> int:
    """Matrix-multiply FLOPs of one forward pass (2 per multiply-add; elementwise work ignored).

    Attention counts the full n x n score matrix, as the usual MFU convention does, even when causal.
    """
    d, f, L, T = config.d_model, config.d_ff, config.num_layers, seq_len
    tokens = batch_size * T
    projections = 2 * tokens * (4 * d * d + 3 * d * f) * L
    attention = 2 * 2 * batch_size * T * T * d * L  # q k^T and p v
    lm_head = 2 * tokens * d * config.vocab_size
    return projections + attention + lm_head


def train_step_flops(config: ModelConfig, batch_size: int, seq_len: int) -> int:
    """Forward plus backward (twice the forward: gradients w.r.t. inputs and weights)."""
    return 3 * forward_flops(config, batch_size, seq_len)
