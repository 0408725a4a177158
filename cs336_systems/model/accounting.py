"""The model's accounting, in plain arithmetic (no torch): parameter count and FLOPs per step (for MFU)."""

from __future__ import annotations

from cs336_systems.model.config import ModelConfig


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


def leaderboard_flops(config: ModelConfig, batch: int, context: int) -> int:
    """FLOPs of one training step as the 2026 leaderboard (handout §9, issue 24) counts them, for MFU:

        6 · (non-embedding matmul parameters, LM head included) · tokens
      + 6 · num_layers · tokens · context · d_model                        (causal attention)

    6 = 2 FLOPs per multiply-add × (forward + 2 × backward). The matmul parameters are the four attention
    projections and three SwiGLU matrices of each block plus the LM head (vocab × d); the embedding
    is a lookup and the norms are elementwise, so neither counts. Attention: qkᵀ and pv take
    2 · 2 · T² · d FLOPs forward per sequence and layer with the full score matrix; causal masking
    halves that, and ×3 for forward + backward gives 6 · T² · d = 6 · tokens · context · d for the batch.
    Recomputation (activation checkpointing) is not counted: it is work the step chooses to redo."""
    if batch <= 0 or context <= 0:
        raise ValueError(f"batch and context must be positive, got batch={batch}, context={context}")
    d, f = config.d_model, config.d_ff
    matmul_params = config.num_layers * (4 * d * d + 3 * d * f) + config.vocab_size * d
    tokens = batch * context
    return 6 * matmul_params * tokens + 6 * config.num_layers * tokens * context * d
