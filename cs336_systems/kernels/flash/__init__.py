"""FlashAttention-2 for the model's `flash_pytorch` and `flash_triton` attention backends.

    api.py        the public op: FlashAttentionTriton, flash_attention_triton, the torch.library operators
    reference.py  FlashAttention-2 in plain PyTorch (FlashAttentionPytorch), the readable reference
    dispatch.py   the one place that chooses the forward and backward kernels
    fa2.py        the Triton FA2 kernels and launchers (tuning.py: their tiles and autotuning)
    gluon_fwd.py, gluon_bwd.py, gluon_common.py   the Hopper (sm_90) kernels in Triton's Gluon
    settings.py   FlashSettings: how the kernels run (environment variables, read once, or set from code)
    host/         the fast launch path and its plan cache (launch.py), the C++ autograd node (node.py, csrc/)

Why each kernel, tile and threshold is as it is: DECISIONS.md.
"""

from cs336_systems.kernels.flash.api import FlashAttentionTriton, flash_attention_triton
from cs336_systems.kernels.flash.reference import FlashAttentionPytorch, flash_attention_pytorch
from cs336_systems.kernels.flash.settings import FlashSettings, flash_settings, set_flash_settings, use_flash_settings

__all__ = ["FlashAttentionPytorch", "FlashAttentionTriton", "FlashSettings", "flash_attention_pytorch",
           "flash_attention_triton", "flash_settings", "set_flash_settings", "use_flash_settings"]
