"""The arithmetic the attention sections show: naive attention's memory by tensor and where it runs out
of memory on a smaller GPU (1.2.1), and the FLOP counts behind the FlashAttention TFLOP/s (1.3.2).

Memory (naive attention, one head, inputs (batch, seq, d), float32): autograd keeps Q, K, V (each
batch·seq·d floats) and the softmax output P (batch·seq² floats) for backward; the scores S are freed
once P exists. The backward is at its peak while P, dP and dS (three batch·seq² matrices) are alive
together. The measured memory before backward is P plus everything linear in seq (Q, K, V, O, dO, the
gradients left by earlier passes) plus a constant (cuBLAS workspace); `oom_seq_len` fits that
remainder as a line in seq and solves `3·square(seq) + remainder(seq) = capacity` for seq.

FLOPs: a (seq × seq × d) matrix product costs 2·seq²·d FLOPs per head. FlashAttention-2's convention
(Dao, "FlashAttention-2", arXiv:2307.08691, §4.1) counts the forward as 2 products and the backward as
5 (2.5× the forward: S is recomputed), halved when causal. That is what the benchmark's `tflops` column
reports. What each implementation executes differs: our Triton backward runs two kernels (dK/dV, then
dQ), each recomputing S and dP, so 7 products; naive attention computes the full masked matrix (no
causal halving) and keeps P, so its backward is 4 products; our PyTorch FA2's backward materialises the
full matrices (5 products, no causal halving).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

MiB = 2**20
# The H100 80GB's memory, 80 GiB nominal; the allocator gets a little less (the CUDA context takes some),
# so a length within a percent or two of the threshold may already fail.
H100_BYTES = 80 * 2**30

# (forward products, backward products, whether a causal forward / backward skips the masked half).
GEMMS: dict[str, tuple[int, int, bool, bool]] = {
    "convention": (2, 5, True, True),  # FlashAttention-2 paper, §4.1
    "flash_triton": (2, 7, True, True),  # backward: dK/dV kernel (S, dP, dV, dK) + dQ kernel (S, dP, dQ)
    "sdpa_flash": (2, 5, True, True),  # FlashAttention-2's own kernels: the paper's count
    "sdpa_cudnn": (2, 5, True, True),  # cuDNN's fused attention, assumed to recompute S once as FA2 does
    "flash_pytorch": (2, 5, True, False),  # forward skips masked tiles; the backward computes full matrices
    "naive": (2, 4, False, False),  # full masked matrices; P is kept, so the backward recomputes nothing
}
PASSES = ("forward", "backward", "forward_backward")


def attention_flops(provider: str, pass_: str, batch_heads: int, seq: int, head_dim: int, causal: bool) -> float:
    """Matrix-product FLOPs of one pass: `provider` a key of GEMMS ("convention" for FA2's count).

    A causal tiled kernel skips only whole tiles above the diagonal, so "halved" is the long-sequence
    limit (the diagonal tiles add about tile/seq)."""
    if provider not in GEMMS:
        raise ValueError(f"unknown provider {provider!r}; known: {sorted(GEMMS)}")
    if pass_ not in PASSES:
        raise ValueError(f"unknown pass {pass_!r}; known: {PASSES}")
    forward, backward, forward_skips, backward_skips = GEMMS[provider]
    product = 2 * batch_heads * seq * seq * head_dim  # one (seq x seq x d) matrix product
    flops = {"forward": forward * product * (0.5 if causal and forward_skips else 1.0),
             "backward": backward * product * (0.5 if causal and backward_skips else 1.0)}
    flops["forward_backward"] = flops["forward"] + flops["backward"]
    return flops[pass_]


def executed_tflops(frame: pd.DataFrame) -> pd.Series:
    """TFLOP/s of what each flash_sweep row's implementation executes: the row's own `executed_tflops`
    where the benchmark wrote one, else computed from `median_ms` and GEMMS (rows of earlier runs).
    Rows that did not run (status not ok) give NaN."""
    computed = [attention_flops(provider, pass_, batch, seq, d, bool(causal)) / ms / 1e9 if status == "ok"
                else float("nan") for provider, pass_, batch, seq, d, causal, ms, status in
                zip(frame["provider"], frame["pass"], frame["batch"], frame["seq_len"], frame["head_dim"],
                    frame["causal"], frame["median_ms"], frame["status"])]
    computed = pd.Series(computed, index=frame.index, dtype=float)
    if "executed_tflops" in frame:
        return frame["executed_tflops"].astype(float).fillna(computed)
    return computed


def square_mib(batch: int, seq: int, bytes_per_element: int = 4) -> float:
    """One (batch, seq, seq) matrix in MiB."""
    return batch * seq * seq * bytes_per_element / MiB


def vector_mib(batch: int, seq: int, d: int, bytes_per_element: int = 4) -> float:
    """One (batch, seq, d) tensor (Q, K, V, O or a gradient) in MiB."""
    return batch * seq * d * bytes_per_element / MiB


def remainder_line(seqs: np.ndarray, remainder_mib: np.ndarray) -> tuple[float, float]:
    """Least-squares (slope MiB per token, intercept MiB) of the memory that is not P, against seq."""
    slope, intercept = np.polyfit(np.asarray(seqs, dtype=float), np.asarray(remainder_mib, dtype=float), 1)
    return float(slope), float(intercept)


def oom_seq_len(square_mib_per_token2: float, slope_mib: float, intercept_mib: float,
                capacity_mib: float = H100_BYTES / MiB, squares: int = 3) -> float:
    """The seq at which `squares` (batch, seq, seq) matrices (each square_mib_per_token2·seq² MiB) plus
    the fitted remainder fill the capacity: the positive root of
    squares·square_mib_per_token2·seq² + slope·seq + intercept = capacity."""
    if capacity_mib <= intercept_mib:
        raise ValueError(f"capacity {capacity_mib} MiB does not exceed the fixed memory {intercept_mib} MiB")
    a, c = squares * square_mib_per_token2, intercept_mib - capacity_mib
    return (-slope_mib + math.sqrt(slope_mib**2 - 4 * a * c)) / (2 * a)


def peak_mib(square_mib_per_token2: float, slope_mib: float, intercept_mib: float, seq: int,
             squares: int = 3) -> float:
    """The backward's peak at `seq` by the same model (the left-hand side oom_seq_len solves)."""
    return squares * square_mib_per_token2 * seq**2 + slope_mib * seq + intercept_mib
