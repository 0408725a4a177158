"""cs336_systems: a Transformer LM, FlashAttention-2 kernels, hand-written data parallelism and
optimizer-state sharding, with the benchmarking harness behind the CS336 Assignment 2 results."""

from cs336_systems.model import MODEL_SIZES, AdamW, ModelConfig, TransformerLM, get_config

__all__ = ["MODEL_SIZES", "AdamW", "ModelConfig", "TransformerLM", "get_config"]
