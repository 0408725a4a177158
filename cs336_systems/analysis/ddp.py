"""The DDP cost models (handout 2.2–2.3): how many interleaved rounds a comparison of two configs needs,
the all-reduce cost t = o + bytes/w fitted to the collective benchmark (single calls and bursts of
back-to-back calls), and the bucket-size model of 2.3(b), whose optimum the report quotes.

Bucket model: n_b buckets of s/n_b bytes; computing a bucket's gradients takes as long as sending it,
s/(n_b·w), and every all-reduce also costs o. Communication falls behind by o per bucket and the last
bucket can only start when backward ends, so the time after backward is overhead(n_b) = n_b·o + s/(n_b·w),
least at n_b* = √(s/(w·o)), i.e. a bucket of b* = s/n_b* = √(s·w·o) bytes.
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import pandas as pd

from cs336_systems.analysis.collectives import all_reduce_rows, burst_rows


# d2: the expected range of n normal samples in standard deviations (the range estimator of sigma).
RANGE_D2 = {2: 1.128, 3: 1.693, 4: 2.059, 5: 2.326, 6: 2.534, 7: 2.704, 8: 2.847, 9: 2.970, 10: 3.078}


def round_sigma(row: pd.Series) -> float:
    """Standard deviation of a config's per-round median step time: the sample deviation of the
    rounds' medians where the row lists them, else their range over d2(rounds)."""
    listed = row.get("step_round_medians_ms")
    if isinstance(listed, str) and len(listed.split()) > 1:
        return statistics.stdev(float(v) for v in listed.split())
    return (row["step_round_median_max_ms"] - row["step_round_median_min_ms"]) / RANGE_D2[int(row["rounds"])]


def rounds_needed(frame: pd.DataFrame, relative_difference: float = 0.05, z: float = 2.0) -> dict:
    """Rounds R for two configs of `frame` (the first two ok rows) whose step times differ by
    `relative_difference` to be z standard errors apart: the difference of their mean round medians
    has standard error √(σ_a² + σ_b²)/√R, so R = ⌈(z·√(σ_a² + σ_b²) / (relative_difference·level))²⌉,
    level being the mean of their medians."""
    a, b = (row for _, row in frame[frame["status"] == "ok"].head(2).iterrows())
    sigma_a, sigma_b = round_sigma(a), round_sigma(b)
    level = (a["step_median_ms"] + b["step_median_ms"]) / 2
    difference = relative_difference * level
    rounds = math.ceil((z * math.hypot(sigma_a, sigma_b) / difference) ** 2)
    return {"configs": (a["config"], b["config"]), "measured_rounds": int(a["rounds"]), "sigma_ms": (sigma_a, sigma_b),
            "level_ms": level, "difference_ms": difference, "z": z, "rounds": rounds}


def allreduce_burst_cost(allreduce: pd.DataFrame | None) -> tuple[float, float] | None:
    """(o seconds, w bytes/s) of t = o + bytes/w per call, fitted to the 2-rank NCCL all-reduces issued
    in bursts of back-to-back async calls (bench.allreduce --burst); None where none were measured."""
    rows = burst_rows(allreduce)
    nccl = rows[(rows["backend"] == "nccl") & (rows["world_size"] == 2)] if len(rows) else rows
    if len(nccl) < 2:
        return None
    slope, intercept = np.polyfit(nccl["size_mb"] * 2**20, nccl["median_ms"] / 1e3, 1)
    return max(intercept, 1e-7), 1 / slope


def allreduce_cost(allreduce: pd.DataFrame | None) -> tuple[float, float] | None:
    """(o seconds, w bytes/s) of t = o + bytes/w, fitted to the 2-rank NCCL all-reduce times of 2.1."""
    if allreduce is None:
        return None
    allreduce = all_reduce_rows(allreduce)
    nccl = allreduce[(allreduce["backend"] == "nccl") & (allreduce["world_size"] == 2)]
    if len(nccl) < 2:
        return None
    slope, intercept = np.polyfit(nccl["size_mb"] * 2**20, nccl["median_ms"] / 1e3, 1)
    return max(intercept, 1e-7), 1 / slope


def bucket_overhead(n_buckets: float, model_bytes: float, o: float, w: float) -> float:
    """Seconds of communication left after backward with n_buckets buckets: n_b·o + s/(n_b·w)."""
    return n_buckets * o + model_bytes / (n_buckets * w)


def optimal_bucket_bytes(model_bytes: float, o: float, w: float) -> float:
    """b* = √(s·w·o): the bucket size at which bucket_overhead is least."""
    return math.sqrt(model_bytes * w * o)
