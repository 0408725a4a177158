"""The language-modelling loss of a training step, through our fused LM head + cross-entropy.

The handout's step (2026 §9) around it:

    optimizer.zero_grad(set_to_none=True)
    loss = lm_loss(model, inputs, targets)       # forward and cross-entropy
    loss.backward()
    model.finish_gradient_synchronization()      # for a data-parallel wrapper (distributed.parallelize)
    optimizer.step()

`microbatches` splits a batch for gradient accumulation: forward and backward on a few sequences at a time,
each slice's mean loss scaled by its share of the batch, so that the gradients add up to those of the whole
batch's mean loss while only one slice's activations exist at a time.

It lives here, above the model and the kernels, because the model package imports no kernel
(tests/test_imports.py); the kernel is imported on the first fused call, so importing this module
does not import Triton (bench/kernel_resources.py configures Triton before it is imported).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from cs336_systems.model.functional import cross_entropy


def lm_loss(model: nn.Module, token_ids: torch.Tensor, targets: torch.Tensor, *, fused: bool = True) -> torch.Tensor:
    """Mean cross-entropy of the model's next-token logits for token_ids (B, T) against targets (B, T).

    fused=True: `linear_cross_entropy(hidden, model.lm_head.weight, targets)` of our kernel
    (`kernels.fused_linear_ce`, a torch.library custom op: no graph break under torch.compile), passed
    to the model's forward as its `head_loss`, so the (B·T, vocab) logits never exist.
    fused=False: the plain `cross_entropy(model(token_ids), targets)`. `model` is a TransformerLM or any
    wrapper that passes keyword arguments on to it (the data-parallel wrappers, torch.compile's)."""
    if not fused:
        return cross_entropy(model(token_ids), targets)
    from cs336_systems.kernels.fused_linear_ce import linear_cross_entropy  # see the module docstring

    # the module-level function: the same object every step, so a compiled model's guards on it hold
    return model(token_ids, targets=targets, head_loss=linear_cross_entropy)


def microbatches(token_ids: torch.Tensor, targets: torch.Tensor, sequences: int | None
                 ) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """(token_ids, targets, share) slices of at most `sequences` sequences each (None: the whole batch, share 1):
    `share` is the slice's fraction of the batch's sequences (of equal length, so of its tokens), the factor
    that turns the slice's mean loss into its part of the batch's mean loss. In bf16 the gradients of the slices
    then add up in the gradients' dtype: one more rounding per slice than one pass over the whole batch."""
    if sequences is None:
        return [(token_ids, targets, 1.0)]
    if sequences < 1:
        raise ValueError(f"a micro-batch holds at least one sequence, got {sequences}")
    if token_ids.shape != targets.shape:
        raise ValueError(f"token ids {tuple(token_ids.shape)} and targets {tuple(targets.shape)} differ in shape")
    batch = token_ids.shape[0]
    return [(token_ids[i:i + sequences], targets[i:i + sequences], min(sequences, batch - i) / batch)
            for i in range(0, batch, sequences)]
