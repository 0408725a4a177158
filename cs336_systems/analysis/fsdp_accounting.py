"""The 2026 handout's fsdp_accounting (a): model-state memory per rank under DDP, ZeRO-1 and FSDP.

Per parameter, in FP32: a master weight (4 B), its gradient (4 B) and AdamW's two moments (8 B).
- DDP keeps all of it on every rank: 16·P bytes.
- ZeRO-1 (our ShardedOptimizer; ZeRO's P_os) shards the AdamW state: 8·P + 8·P/N (our optimizer splits
  by whole parameters, so a rank's share is about, not exactly, 1/N).
- FSDP (handout section 7) shards every Linear and Embedding weight, its gradient and its AdamW state
  and leaves the RMSNorm gains replicated: 16·(P_sharded/N + P_norms). On top come the gathered copies
  in the compute dtype: with the handout's schedule (start gathering layer k once layer k-2 finished)
  about two units are gathered at a time, plus one full-size gradient before its reduce-scatter. The
  handout says to ignore these buffers; they are reported separately.
Activations are the same under all three (the same batch per rank), so the saving at the peak is the
difference in model state. Units are whole weight tensors, as the model defines them (`units`).
The Markdown answer is written from these numbers by report/parallelism_render.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from cs336_systems.model import ModelConfig, get_config, parameter_count

MIB = 2**20
FP32 = 4
STRATEGIES = ("DDP", "ZeRO-1", "FSDP")


@dataclass(frozen=True)
class Units:
    sharded: tuple[int, ...]  # element counts of the Linear and Embedding weights FSDP shards
    replicated: int  # RMSNorm gains, left whole on every rank

    @property
    def total(self) -> int:
        return sum(self.sharded) + self.replicated


def units(config: ModelConfig) -> Units:
    """The model's weight tensors by what FSDP does with them (TransformerLM's layout), checked against
    the parameter count."""
    d, f, v = config.d_model, config.d_ff, config.vocab_size
    per_layer = [d * d] * 4 + [d * f] * 3  # q, k, v, output projections; SwiGLU w1, w2, w3
    result = Units(sharded=(v * d, *per_layer * config.num_layers, d * v), replicated=(2 * config.num_layers + 1) * d)
    if result.total != parameter_count(config):
        raise AssertionError(f"units sum to {result.total}, parameter_count says {parameter_count(config)}")
    return result


def state_bytes(config: ModelConfig, strategy: str, world_size: int, compute_bytes: int = 2,
                in_flight: int = 2) -> dict[str, float]:
    """Bytes per rank: params, grads, optimizer (AdamW m and v), and gather_buffers (FSDP's gathered
    compute-dtype weights of `in_flight` units plus one full gradient; 0 for DDP and ZeRO-1)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if in_flight < 1 or compute_bytes < 1:
        raise ValueError(f"in_flight={in_flight} and compute_bytes={compute_bytes} must be at least 1")
    u = units(config)
    full = u.total
    if strategy == "DDP":
        return {"params": FP32 * full, "grads": FP32 * full, "optimizer": 2 * FP32 * full, "gather_buffers": 0}
    if strategy == "ZeRO-1":
        return {"params": FP32 * full, "grads": FP32 * full, "optimizer": 2 * FP32 * full / world_size,
                "gather_buffers": 0}
    local = sum(u.sharded) / world_size + u.replicated
    largest = sorted(u.sharded, reverse=True)
    buffers = compute_bytes * (sum(largest[:in_flight]) + largest[0]) if world_size > 1 else 0
    return {"params": FP32 * local, "grads": FP32 * local, "optimizer": 2 * FP32 * local, "gather_buffers": buffers}


def accounting_table(sizes: tuple[str, ...] = ("xl", "2.7B"), world_size: int = 2) -> pd.DataFrame:
    """One row per (size, strategy), MiB per rank; saving_vs_ddp ignores the gather buffers, as asked."""
    rows = []
    for size in sizes:
        config = get_config(size)
        ddp = sum(v for k, v in state_bytes(config, "DDP", world_size).items() if k != "gather_buffers")
        for strategy in STRATEGIES:
            b = state_bytes(config, strategy, world_size)
            state = b["params"] + b["grads"] + b["optimizer"]
            rows.append({"size": size, "parameters": parameter_count(config), "world_size": world_size,
                         "strategy": strategy, **{f"{k}_mib": v / MIB for k, v in b.items()},
                         "state_mib": state / MIB, "saving_vs_ddp_mib": (ddp - state) / MIB})
    return pd.DataFrame(rows)


def predicted_peaks(measured: pd.DataFrame, ddp_config: str = "individual",
                    zero1_config: str = "individual+sharded", peak: str = "peak_after_step_mib") -> pd.DataFrame:
    """Measured DDP and ZeRO-1 peaks (results/sharding.csv rows) beside the accounting: the DDP - ZeRO-1
    difference it predicts, and the FSDP peak it predicts (measured ZeRO-1 peak minus the state FSDP
    also shards), per size and precision."""
    need = {"config", "size", "world_size", "precision", peak}
    if need - set(measured.columns):
        raise ValueError(f"measured peaks lack columns {sorted(need - set(measured.columns))}")
    rows = []
    for (size, world, precision), group in measured.groupby(["size", "world_size", "precision"], sort=True):
        by_config = group.set_index("config")[peak]
        if ddp_config not in by_config or zero1_config not in by_config:
            continue
        table = accounting_table((size,), int(world)).set_index("strategy")["state_mib"]
        rows.append({"size": size, "world_size": int(world), "precision": precision,
                     "ddp_peak_mib": by_config[ddp_config], "zero1_peak_mib": by_config[zero1_config],
                     "measured_ddp_minus_zero1_mib": by_config[ddp_config] - by_config[zero1_config],
                     "predicted_ddp_minus_zero1_mib": table["DDP"] - table["ZeRO-1"],
                     "predicted_fsdp_peak_mib": by_config[zero1_config] - (table["ZeRO-1"] - table["FSDP"])})
    return pd.DataFrame(rows)
