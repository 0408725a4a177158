"""The loss: cross-entropy over the vocabulary (the model's accounting is in `model.accounting`)."""

from __future__ import annotations

import torch


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean of -log softmax(logits)[target] over all leading dims, computed stably in float32."""
    logits = logits.float()
    logits = logits - logits.amax(dim=-1, keepdim=True)
    log_z = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (log_z - target_logit).mean()
