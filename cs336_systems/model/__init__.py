"""Our Transformer LM, its configurations, attention backends and accounting (AdamW: `cs336_systems.optim`).

The configurations and the accounting are plain Python and load with the package. The parts built on torch load
on first use (PEP 562 `__getattr__`), so that a process that only reads configurations and counts (the report's
table and figure jobs) does not import torch."""

from cs336_systems.model.lazy import attach
from cs336_systems.model.accounting import forward_flops, leaderboard_flops, parameter_count, train_step_flops
from cs336_systems.model.config import MODEL_SIZES, MODEL_SIZES_2026, SIZE_TABLES, ModelConfig, get_config

# name -> the submodule (of this package) that defines it, imported when the name is first asked for
_ON_FIRST_USE = {
    "ATTENTION_BACKENDS": ".attention",
    "get_attention": ".attention",
    "naive_attention": ".attention",
    "register_attention": ".attention",
    "CheckpointPolicy": ".checkpointing",
    "apply_activation_checkpointing": ".checkpointing",
    "checkpoint_cost": ".checkpointing",
    "cross_entropy": ".functional",
    "TransformerLM": ".transformer",
}

__all__ = [
    "MODEL_SIZES",
    "MODEL_SIZES_2026",
    "SIZE_TABLES",
    "ModelConfig",
    "forward_flops",
    "get_config",
    "leaderboard_flops",
    "parameter_count",
    "train_step_flops",
    *_ON_FIRST_USE,
]

__getattr__, __dir__ = attach(__name__, _ON_FIRST_USE, __all__)
