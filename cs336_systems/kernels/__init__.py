"""FlashAttention-2 kernels; importing this package registers them as attention backends
`flash_pytorch` and `flash_triton` of the model."""

from cs336_systems.kernels.flash_pytorch import FlashAttentionPytorch, flash_attention_pytorch
from cs336_systems.kernels.flash_triton import FlashAttentionTriton, flash_attention_triton
from cs336_systems.model.attention import register_attention

register_attention("flash_pytorch", flash_attention_pytorch)
register_attention("flash_triton", flash_attention_triton)

__all__ = ["FlashAttentionPytorch", "FlashAttentionTriton", "flash_attention_pytorch", "flash_attention_triton"]
