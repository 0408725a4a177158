"""cs336_systems: a Transformer LM, FlashAttention-2 kernels, hand-written data parallelism and
optimizer-state sharding, with the benchmarking harness behind the CS336 Assignment 2 results.

Importing it sets no environment variable. The Triton kernels run on CUDA
tensors; to run them on CPU tensors under Triton's interpreter, set TRITON_INTERPRET=1 before the
package (or triton) is imported: Triton fixes each kernel's mode when the kernel is defined."""

from cs336_systems.model import MODEL_SIZES, ModelConfig, TransformerLM, get_config
from cs336_systems.optim import AdamW

__all__ = ["MODEL_SIZES", "AdamW", "ModelConfig", "TransformerLM", "get_config"]
