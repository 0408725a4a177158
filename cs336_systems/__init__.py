"""cs336_systems: a Transformer LM, FlashAttention-2 kernels, hand-written data parallelism and
optimizer-state sharding, with the benchmarking harness behind the CS336 Assignment 2 results."""

import os

import torch

# Without a GPU, Triton kernels can only run under Triton's interpreter; the switch is read when a
# kernel is defined, so it is set here, before any module of the package imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cs336_systems.model import MODEL_SIZES, ModelConfig, TransformerLM, get_config  # noqa: E402
from cs336_systems.optim import AdamW  # noqa: E402

__all__ = ["MODEL_SIZES", "AdamW", "ModelConfig", "TransformerLM", "get_config"]
