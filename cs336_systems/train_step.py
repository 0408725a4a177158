"""The training step, written once: `train_step` (the handout's step, 2026 §9), used by `train.py`,
`bench/ddp.py` and the 8B leaderboard benchmark, and the loss it usually runs, `lm_loss`.

    optimizer.zero_grad(set_to_none=True)
    model.on_train_batch_start()                 # the data-parallel wrapper's hooks (distributed.parallelize)
    for each micro-batch:
        loss = loss_fn(inputs, targets) * share  # forward and cross-entropy
        loss.backward()
    model.finish_gradient_synchronization()
    optimizer.step()

`microbatches` splits a batch for gradient accumulation: forward and backward on a few sequences at a time,
each slice's mean loss scaled by its share of the batch, so that the gradients add up to those of the whole
batch's mean loss while only one slice's activations exist at a time. A caller that measures the step passes a
`phase` hook: a context manager around each phase ("forward" and "backward" of every pass, "communication",
"optimizer"), where it can mark clocks, read memory or name profiler ranges.

It lives here, above the model and the kernels, because the model package imports no kernel
(tests/test_imports.py); the kernel is imported on the first fused call, so importing this module
does not import Triton (bench/kernel_resources.py configures Triton before it is imported).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from cs336_systems.model.functional import cross_entropy
from cs336_systems.timing import autocast

if TYPE_CHECKING:
    from cs336_systems.distributed.parallelize import DataParallel

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (token_ids, targets) -> mean loss
Phase = Callable[[str], contextlib.AbstractContextManager]  # "forward", "backward", "communication", "optimizer"


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


def _autocast_cross_entropy(model: nn.Module, precision: str, device: torch.device, token_ids: torch.Tensor,
                            targets: torch.Tensor) -> torch.Tensor:
    with autocast(precision, device):
        return cross_entropy(model(token_ids), targets)


def autocast_loss(model: nn.Module, precision: str, device: torch.device) -> LossFn:
    """The plain cross-entropy of the model's logits, its forward under `timing.autocast(precision)` (fp32: none)
    and the backward outside it, as torch's mixed-precision recipe has it."""
    return functools.partial(_autocast_cross_entropy, model, precision, device)


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


def _scaled_loss(loss_fn: LossFn, token_ids: torch.Tensor, targets: torch.Tensor, share: float) -> torch.Tensor:
    value = loss_fn(token_ids, targets)
    return value if share == 1 else value * share


def forwards(loss_fn: LossFn, token_ids: torch.Tensor, targets: torch.Tensor, microbatch: int | None = None
             ) -> list[Callable[[], torch.Tensor]]:
    """The step's forward passes, one per micro-batch of at most `microbatch` sequences (None: one pass over the
    whole batch), each returning its slice's mean loss scaled by its share of the batch: their backward passes add
    up to the batch's mean loss's gradients."""
    return [functools.partial(_scaled_loss, loss_fn, x, y, share)
            for x, y, share in microbatches(token_ids, targets, microbatch)]


def no_phase(name: str) -> contextlib.AbstractContextManager:
    """The default phase hook: nothing around any phase."""
    return contextlib.nullcontext()


def forward_backward(model: DataParallel, passes: Sequence[Callable[[], torch.Tensor]], phase: Phase = no_phase
                     ) -> torch.Tensor:
    """Forward and backward of every pass in turn (see `forwards`), between the data-parallel wrapper's two loop
    hooks (`model` is the wrapper; every kind, "none" included, has them); the gradients are then synchronized,
    and the batch's loss (this rank's, the sum of the passes' scaled losses) is returned detached."""
    model.on_train_batch_start()
    total = None
    for forward in passes:
        with phase("forward"):
            loss = forward()
        with phase("backward"):
            loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    with phase("communication"):
        model.finish_gradient_synchronization()
    return total


def train_step(model: DataParallel, optimizer: torch.optim.Optimizer, passes: Sequence[Callable[[], torch.Tensor]],
               phase: Phase = no_phase) -> torch.Tensor:
    """The handout's step: zero_grad(set_to_none=True), `forward_backward` over the passes, the optimizer's step
    (in the "optimizer" phase); the batch's loss, detached."""
    optimizer.zero_grad(set_to_none=True)
    loss = forward_backward(model, passes, phase)
    with phase("optimizer"):
        optimizer.step()
    return loss
