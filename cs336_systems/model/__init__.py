"""Our Transformer LM, its configurations, attention backends and accounting (AdamW: `cs336_systems.optim`)."""

from cs336_systems.model.attention import ATTENTION_BACKENDS, get_attention, naive_attention, register_attention
from cs336_systems.model.checkpointing import CheckpointPolicy, apply_activation_checkpointing, checkpoint_cost
from cs336_systems.model.config import MODEL_SIZES, MODEL_SIZES_2026, SIZE_TABLES, ModelConfig, get_config
from cs336_systems.model.functional import (
    cross_entropy,
    forward_flops,
    leaderboard_flops,
    parameter_count,
    train_step_flops,
)
from cs336_systems.model.transformer import TransformerLM

__all__ = [
    "ATTENTION_BACKENDS",
    "CheckpointPolicy",
    "MODEL_SIZES",
    "MODEL_SIZES_2026",
    "SIZE_TABLES",
    "ModelConfig",
    "TransformerLM",
    "apply_activation_checkpointing",
    "checkpoint_cost",
    "cross_entropy",
    "forward_flops",
    "get_attention",
    "get_config",
    "leaderboard_flops",
    "naive_attention",
    "parameter_count",
    "register_attention",
    "train_step_flops",
]
