"""FlashAttention-2 kernels in plain PyTorch and in Triton (and `adamw_triton`, the fused AdamW step).

The attention ones live in the package `flash/`; the model names them as its backends `flash_pytorch` and
`flash_triton` (`cs336_systems.model.attention`).
"""

from cs336_systems.kernels.flash import (
    FlashAttentionPytorch,
    FlashAttentionTriton,
    flash_attention_pytorch,
    flash_attention_triton,
)
from cs336_systems.kernels.fused_linear_ce import linear_cross_entropy, linear_cross_entropy_ref

__all__ = ["FlashAttentionPytorch", "FlashAttentionTriton", "flash_attention_pytorch",
           "flash_attention_triton", "linear_cross_entropy", "linear_cross_entropy_ref"]
