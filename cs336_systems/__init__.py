"""cs336_systems: a Transformer LM, FlashAttention-2 kernels, hand-written data parallelism and
optimizer-state sharding, with the benchmarking harness behind the CS336 Assignment 2 results.

Importing it sets no environment variable and imports no torch: the model's configurations load with it, the model
and AdamW on first use (PEP 562 `__getattr__`). The Triton kernels run on CUDA tensors; to run them on CPU tensors
under Triton's interpreter, set TRITON_INTERPRET=1 before the package (or triton) is imported: Triton fixes each
kernel's mode when the kernel is defined."""

from cs336_systems.model.lazy import attach
from cs336_systems.model import MODEL_SIZES, ModelConfig, get_config

# name -> the module that defines it, imported when the name is first asked for
_ON_FIRST_USE = {"AdamW": "cs336_systems.optim", "TransformerLM": "cs336_systems.model"}

__all__ = ["MODEL_SIZES", "AdamW", "ModelConfig", "TransformerLM", "get_config"]
__getattr__, __dir__ = attach(__name__, _ON_FIRST_USE, __all__)
