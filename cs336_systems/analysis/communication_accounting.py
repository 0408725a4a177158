"""Handout 2.4 communication_accounting: memory and compute-bound batch size of the XXL model, from the
handout's assumptions (report/accounting.py writes the derivation out as Markdown).

Assumptions (the handout's): each block is two linear layers d_model→d_ff→d_model, no attention,
embeddings or head; FP32 master weights, accumulated gradients and AdamW state (two moments);
BF16 activations and communication; TPU v5p numbers from the Scaling Book: W_ici = 2·9e10 B/s,
C = 4.6e14 FLOP/s, mesh M_X = 2, M_Y = 1, FSDP X = 16, TP Y = 4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class XXL:
    d_model: int = 16384
    d_ff: int = 53248
    num_blocks: int = 126

    @property
    def params(self) -> int:
        return self.num_blocks * 2 * self.d_model * self.d_ff

    def activation_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """Saved for backward per token: each linear's input (d_model for the first, d_ff for the second)."""
        return self.num_blocks * (self.d_model + self.d_ff) * bytes_per_value


def derivation(model: XXL = XXL(), device_gb: float = 80.0, tpu_gb: float = 95.0, w_ici: float = 2 * 9e10,
               flops: float = 4.6e14, m_x: int = 2, m_y: int = 1, x: int = 16, y: int = 4) -> dict[str, float]:
    state = 4 * 4 * model.params  # master weights, gradients, two AdamW moments: 4 FP32 values per parameter
    per_device_batch_fsdp = flops / (w_ici * m_x)  # tokens per FSDP shard for T_math >= T_FSDP-comms
    return {
        "params": model.params,
        "state_gb": state / GB,
        "h100s_for_state": state / (device_gb * GB),
        "activation_mb_per_token": model.activation_bytes_per_token() / 1e6,
        "n_fsdp_min": math.ceil(state / (tpu_gb * GB)),
        "tp_condition_d_ff_min": y * flops / (w_ici * m_y),
        "per_shard_batch": per_device_batch_fsdp,
        "per_device_batch": per_device_batch_fsdp / y,
        "global_batch": per_device_batch_fsdp * x,
    }
