"""Wiring of our implementations to the names the course's test suite imports."""

from __future__ import annotations

from typing import Type

import torch

from cs336_systems.kernels import FlashAttentionPytorch, FlashAttentionTriton


def get_flashattention_autograd_function_pytorch() -> Type:
    """A torch.autograd.Function: FlashAttention-2 forward in plain PyTorch, compiled backward."""
    return FlashAttentionPytorch


def get_flashattention_autograd_function_triton() -> Type:
    """A torch.autograd.Function: FlashAttention-2 forward and backward in Triton."""
    return FlashAttentionTriton


__all__ = [
    "get_flashattention_autograd_function_pytorch",
    "get_flashattention_autograd_function_triton",
    "torch",
]
