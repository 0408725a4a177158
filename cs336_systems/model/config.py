"""Model configurations: Table 1 sizes of the 2025 and 2026 handouts plus two tiny sizes for CPU smoke runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    d_model: int
    d_ff: int
    num_layers: int
    num_heads: int
    vocab_size: int = 10_000
    context_length: int = 1024  # the longest the handout runs (1.1.4); the benchmark CLI enforces it
    rope_theta: float = 10_000.0
    attention: str = "naive"  # a name in cs336_systems.model.attention.ATTENTION_BACKENDS

    def __post_init__(self) -> None:
        for name in ("d_model", "d_ff", "num_layers", "num_heads", "vocab_size", "context_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


# Table 1 of the 2025 handout (vocabulary 10,000). tiny and mini exist for CPU smoke runs only.
MODEL_SIZES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(d_model=64, d_ff=256, num_layers=2, num_heads=4),
    "mini": ModelConfig(d_model=128, d_ff=512, num_layers=3, num_heads=4),
    "small": ModelConfig(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
    "medium": ModelConfig(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
    "large": ModelConfig(d_model=1280, d_ff=5120, num_layers=36, num_heads=20),
    "xl": ModelConfig(d_model=1600, d_ff=6400, num_layers=48, num_heads=25),
    "2.7B": ModelConfig(d_model=2560, d_ff=10240, num_layers=32, num_heads=32),
}

# Table 1 of the 2026 handout (§2.1.2). Its `xl` is the 2025 `2.7B`, not the 2025 `xl`, so the two tables
# are kept apart and every result records which one its size came from. tiny and mini are shared.
# "8B" is the leaderboard model of the 2026 handout (§9): its own vocabulary and context length.
MODEL_SIZES_2026: dict[str, ModelConfig] = {
    "tiny": MODEL_SIZES["tiny"],
    "mini": MODEL_SIZES["mini"],
    "small": ModelConfig(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
    "medium": ModelConfig(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
    "large": ModelConfig(d_model=1280, d_ff=5120, num_layers=36, num_heads=20),
    "xl": ModelConfig(d_model=2560, d_ff=10240, num_layers=32, num_heads=32),
    "10B": ModelConfig(d_model=4608, d_ff=12288, num_layers=50, num_heads=36),
    "8B": ModelConfig(d_model=4096, d_ff=11008, num_layers=34, num_heads=32, vocab_size=151936,
                      context_length=32768),
}

# The size tables by handout edition; 2025 is the default, which every 2025 deliverable relies on.
SIZE_TABLES: dict[str, dict[str, ModelConfig]] = {"2025": MODEL_SIZES, "2026": MODEL_SIZES_2026}


def get_config(size: str, edition: str = "2025", **overrides) -> ModelConfig:
    """The named size of the given handout edition's table, with any field overridden (e.g.
    context_length, attention)."""
    if edition not in SIZE_TABLES:
        raise ValueError(f"unknown handout edition {edition!r}; known editions: {', '.join(SIZE_TABLES)}")
    table = SIZE_TABLES[edition]
    if size not in table:
        raise ValueError(f"unknown model size {size!r} in the {edition} table; known sizes: {', '.join(table)}")
    return table[size].replace(**overrides)
