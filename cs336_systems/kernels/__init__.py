"""FlashAttention-2 kernels; importing this package registers them as attention backends."""
