"""The ring model of collectives (2026 handout 8.1) and its check against measured collective times.

In the handout's idealised setting every device sends to its ring neighbour at W bytes/s, so for a
tensor of S bytes in all (all-gather's output, reduce-scatter's input, all-reduce's input/output):

    all-gather, reduce-scatter:  (N-1)/N · S / W        (N-1 steps of an S/N chunk)
    all-reduce:                 2(N-1)/N · S / W        (reduce-scatter, then all-gather)

Measured times (results/allreduce.csv from cs336_systems.bench.allreduce, one row per op, size and
world size) are fitted per op with t = alpha + factor · S / W (alpha: latency, W: the egress bandwidth
the ring model calls W, which is nccl-tests' "bus bandwidth"). If the ring model holds, every op of
one backend and world size gives the same W, so all-gather and reduce-scatter take half an all-reduce's
time at large S. Rows written before the bench had an `op` column are all-reduces.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = ["OPS", "all_reduce_rows", "alternate_ring_all_reduce_time", "burst_rows", "fit_ring_model",
           "measured_bandwidth", "ring_factor", "ring_model_table", "ring_time", "single_call_rows"]

OPS = ("all_reduce", "all_gather", "reduce_scatter")  # the collectives bench.allreduce times
GROUP = ["backend", "device_type", "world_size", "op"]


def ring_factor(op: str, world: int) -> float:
    """Bytes a ring sends per rank, as a multiple of the full tensor size S (bus/algorithm bandwidth)."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")
    return (2 if op == "all_reduce" else 1) * (world - 1) / world


def ring_time(op: str, size_bytes, world, bandwidth):
    """Seconds the ring `op` takes on S = size_bytes in all (numbers or sympy expressions)."""
    return ring_factor(op, world) * size_bytes / bandwidth


def alternate_ring_all_reduce_time(size_bytes, world, bandwidth):
    """The handout's alternate all-reduce: N-1 steps, each forwarding one whole S-byte input."""
    return (world - 1) * size_bytes / bandwidth


def all_reduce_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The all-reduce rows of a collective-bench CSV (all of them in files written before the `op`
    column), each call timed alone (mode=single; the bench's burst rows, per-call times of back-to-back
    async calls, are `burst_rows`): what the section 2.1 tables, figure and the ring model should read."""
    frame = single_call_rows(frame)
    return frame if "op" not in frame else frame[frame["op"].fillna("all_reduce") == "all_reduce"]


def single_call_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows of calls timed one at a time (all rows of files written before the `mode` column)."""
    return frame if "mode" not in frame else frame[frame["mode"].fillna("single") == "single"]


def burst_rows(frame: pd.DataFrame | None, op: str = "all_reduce") -> pd.DataFrame:
    """The `op` rows timed as bursts of back-to-back async calls (time per call); empty where none."""
    if frame is None or "mode" not in frame:
        return pd.DataFrame(columns=[] if frame is None else frame.columns)
    rows = frame[(frame["mode"] == "burst") & (frame["status"] == "ok")]
    return rows[rows["op"].fillna("all_reduce") == op] if "op" in rows else rows


def _ok_rows(frame: pd.DataFrame) -> pd.DataFrame:
    missing = {"backend", "world_size", "size_mb", "median_ms", "status"} - set(frame.columns)
    if missing:
        raise ValueError(f"collective results lack columns {sorted(missing)}; is this a bench.allreduce CSV?")
    frame = single_call_rows(frame).copy()  # the ring model is about one call's time
    frame["op"] = frame["op"].fillna("all_reduce") if "op" in frame else "all_reduce"
    if "device_type" not in frame:
        frame["device_type"] = ""
    unknown = set(frame["op"]) - set(OPS)
    if unknown:
        raise ValueError(f"unknown collective(s) {sorted(unknown)} in the results; known: {', '.join(OPS)}")
    frame = frame[frame["status"] == "ok"]
    # The bench's sizes are MiB of float32, rounded down to a multiple of the world size in elements.
    numel = (frame["size_mb"] * 2**20).astype("int64") // 4 // frame["world_size"] * frame["world_size"]
    return frame.assign(size_bytes=numel * 4, seconds=frame["median_ms"] / 1e3)


def fit_ring_model(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (backend, device_type, world_size, op): least-squares t = alpha + factor·S/W over its
    sizes. With one size (or a fit whose slope is not positive, as small noisy gloo runs give) alpha is
    taken as 0 and W from the largest size alone, flagged in `fit`."""
    rows = []
    for key, group in _ok_rows(frame).groupby(GROUP, sort=True):
        op, world = key[3], int(key[2])
        moved = ring_factor(op, world) * group["size_bytes"].to_numpy(dtype=float)  # bytes each rank sends
        seconds = group["seconds"].to_numpy(dtype=float)
        slope, alpha, fit = np.nan, 0.0, "largest size"
        if len(np.unique(moved)) >= 2:
            slope, alpha = np.polyfit(moved, seconds, 1)
            fit = "least squares"
        if not slope > 0 or alpha < 0:
            largest = int(np.argmax(moved))
            slope, alpha, fit = seconds[largest] / moved[largest], 0.0, "largest size"
        rows.append(dict(zip(GROUP, key), sizes=len(group), fit=fit, bandwidth_gbps=1 / slope / 1e9,
                         latency_us=alpha * 1e6))
    return pd.DataFrame(rows, columns=[*GROUP, "sizes", "fit", "bandwidth_gbps", "latency_us"])


def ring_model_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Each op's time at the largest size measured against the ring model's prediction from the
    all-reduce fit of the same backend and world size: predicted = alpha_AR + factor_op · S / W_AR.
    A ratio near 1 for all-gather and reduce-scatter says the three collectives share one W, as the
    ring model has it; the all-reduce row's ratio only says how well its own line fits."""
    fits = fit_ring_model(frame).set_index(GROUP)
    rows = []
    for key, group in _ok_rows(frame).groupby(GROUP, sort=True):
        backend, device_type, world, op = key
        largest = group.loc[group["size_bytes"].idxmax()]
        predicted = np.nan
        if (backend, device_type, world, "all_reduce") in fits.index:
            ar = fits.loc[(backend, device_type, world, "all_reduce")]
            predicted = (ar["latency_us"] / 1e6
                         + ring_factor(op, int(world)) * largest["size_bytes"] / (ar["bandwidth_gbps"] * 1e9))
        rows.append(dict(zip(GROUP, key), size_mb=largest["size_mb"], measured_ms=largest["seconds"] * 1e3,
                         algbw_gbps=largest["size_bytes"] / largest["seconds"] / 1e9,
                         fitted_w_gbps=fits.loc[key, "bandwidth_gbps"], predicted_ms=predicted * 1e3,
                         measured_over_predicted=largest["seconds"] / predicted))
    return pd.DataFrame(rows)


def measured_bandwidth(frame: pd.DataFrame | None, backend: str = "nccl", world_size: int = 2) -> float | None:
    """W in bytes/s from the all-reduce fit of (backend, world_size), or None where nothing was measured."""
    if frame is None:
        return None
    fits = fit_ring_model(frame)
    row = fits[(fits["backend"] == backend) & (fits["world_size"] == world_size) & (fits["op"] == "all_reduce")]
    return float(row["bandwidth_gbps"].iloc[0]) * 1e9 if len(row) else None
