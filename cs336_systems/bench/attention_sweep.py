"""Naive PyTorch attention, eager and torch.compile'd (handout 1.2.1 pytorch_attention, 1.3.1(a)).

Batch 8, one head (inputs (batch, seq, d)), every (d, seq) of the grid: after warm-up, `--iters`
forward passes and `--iters` backward passes, each followed by a synchronize, the memory in use
just before the backward pass, and the peak memory of one forward and one backward (peak_memory_mib,
CUDA only). Out-of-memory is a row (status=oom) and the sweep goes on.

    python -m cs336_systems.bench.attention_sweep --impls eager compiled --out results/attention.csv

As a library: `attention_rows(AttentionSweep(impls=("eager", "compiled"), device="cuda"))`.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass, field

import torch

from cs336_systems.bench.checks import check_known, check_non_negative, check_not_empty, check_positive
from cs336_systems.bench.cli import add_device_argument, config_or_usage_error, non_negative_int, positive_int
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows
from cs336_systems.timing import (
    DTYPES,
    is_oom,
    oom_row,
    reset_memory,
    resolve_device,
    summarize,
    timed,
)
from cs336_systems.model.attention import naive_attention


def naive_memory_bytes(batch: int, seq: int, d: int, bytes_per_element: int = 4) -> dict[str, int]:
    """Memory of naive attention by the formulas of the computation (one head, no mask).

    S = Q Kᵀ/√d and P = softmax(S) are (batch, seq, seq). Autograd keeps Q, K (for S), P (for the
    softmax and for P V) and V; S itself is freed once P exists, but both live together at the peak of
    the forward. Backward builds dP and dS, each (batch, seq, seq), while P is still alive.
    """
    square = batch * seq * seq * bytes_per_element
    vector = batch * seq * d * bytes_per_element
    return {
        "saved_for_backward_bytes": 3 * vector + square,  # Q, K, V and P
        "forward_peak_bytes": 4 * vector + 2 * square,  # Q, K, V, O with S and P alive together
        "backward_peak_bytes": 4 * vector + 3 * square,  # + dO-sized grads; P, dP, dS together
        "square_matrix_bytes": square,
    }


IMPLS = ("eager", "compiled")


@dataclass(frozen=True)
class AttentionSweep:
    """The grid: every (implementation, head dim, sequence length), `warmup` untimed forward+backward
    passes then `iters` timed forward passes and `iters` timed backward passes each."""

    head_dims: tuple[int, ...] = (16, 32, 64, 128)
    seqs: tuple[int, ...] = (256, 1024, 4096, 8192, 16384)
    impls: tuple[str, ...] = ("eager",)
    batch_size: int = 8
    dtype: str = "fp32"
    warmup: int = 5
    iters: int = 100
    device: str = field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")

    def __post_init__(self):
        for name in ("head_dims", "seqs", "impls"):
            check_not_empty(name, getattr(self, name))
        check_known("implementation", self.impls, IMPLS)
        check_known("dtype", [self.dtype], DTYPES)
        check_positive("head dim", *self.head_dims)
        check_positive("sequence length", *self.seqs)
        check_positive("batch size", self.batch_size)
        check_positive("timed iterations", self.iters)
        check_non_negative("warm-up passes", self.warmup)
        resolve_device(self.device)


def measure(impl: str, batch: int, seq: int, d: int, dtype: torch.dtype, warmup: int, iters: int,
            device: torch.device) -> dict:
    attention = naive_attention if impl == "eager" else torch.compile(naive_attention)
    q, k, v = (torch.randn(batch, seq, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(batch, seq, d, device=device, dtype=dtype)
    for _ in range(warmup):
        attention(q, k, v, False).backward(grad)
    forward_ms = [timed(lambda: attention(q, k, v, False), device) for _ in range(iters)]
    backward_ms, memory_before_backward, peaks = [], 0, {"forward": float("nan"), "backward": float("nan")}
    for i in range(iters):
        if i == 0 and device.type == "cuda":  # the peak of each phase, measured once (the report's OOM model)
            torch.cuda.reset_peak_memory_stats(device)
        out = attention(q, k, v, False)
        if device.type == "cuda":
            memory_before_backward = torch.cuda.memory_allocated(device)
            if i == 0:
                peaks["forward"] = torch.cuda.max_memory_allocated(device) / 2**20
                torch.cuda.reset_peak_memory_stats(device)
        backward_ms.append(timed(lambda: out.backward(grad), device))
        if i == 0 and device.type == "cuda":
            peaks["backward"] = torch.cuda.max_memory_allocated(device) / 2**20
        del out
    return {"forward": {**summarize(forward_ms), "peak_memory_mib": peaks["forward"]},
            "backward": {**summarize(backward_ms), "peak_memory_mib": peaks["backward"]},
            "memory_before_backward_mib": memory_before_backward / 2**20}


def attention_rows(config: AttentionSweep) -> list[dict]:
    """Two rows (forward, backward) per grid point, with provenance; out of memory makes them OOM rows."""
    device = resolve_device(config.device)
    prov = provenance(device)
    rows = []
    grid = list(itertools.product(config.impls, config.head_dims, config.seqs))
    for i, (impl, d, seq) in enumerate(grid, 1):
        base = {"impl": impl, "head_dim": d, "seq_len": seq, "batch": config.batch_size, "dtype": config.dtype,
                "warmup": config.warmup, "iters": config.iters, **naive_memory_bytes(config.batch_size, seq, d),
                **prov}
        reset_memory(device)
        try:
            result = measure(impl, config.batch_size, seq, d, DTYPES[config.dtype], config.warmup, config.iters,
                             device)
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if not is_oom(error):
                raise
            reset_memory(device)
            rows += [oom_row({**base, "phase": p}, error) for p in ("forward", "backward")]
            print(f"[{i}/{len(grid)}] {impl} d={d} seq={seq}: oom", file=sys.stderr, flush=True)
            continue
        for phase in ("forward", "backward"):
            rows.append({**base, "phase": phase, **result[phase], "status": "ok",
                         "memory_before_backward_mib": result["memory_before_backward_mib"]})
        print(f"[{i}/{len(grid)}] {impl} d={d} seq={seq}: fwd {result['forward']['mean_ms']:.3f} ms, "
              f"bwd {result['backward']['mean_ms']:.3f} ms", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", nargs="+", type=positive_int, default=[16, 32, 64, 128],
                        help="head dimensions d, one point each")
    parser.add_argument("--seqs", nargs="+", type=positive_int, default=[256, 1024, 4096, 8192, 16384],
                        help="sequence lengths, one point each")
    parser.add_argument("--impls", nargs="+", default=["eager"], choices=IMPLS,
                        help="naive attention as it is (eager) and/or torch.compile'd (compiled)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="sequences per pass")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="dtype of Q, K and V")
    parser.add_argument("--warmup", type=non_negative_int, default=5, help="untimed forward+backward passes")
    parser.add_argument("--iters", type=positive_int, default=100, help="timed forward passes, and as many backward")
    add_device_argument(parser)
    parser.add_argument("--out", required=True, help="CSV file for the rows")
    args = parser.parse_args(argv)
    config = config_or_usage_error(
        parser, AttentionSweep, head_dims=tuple(args.head_dims), seqs=tuple(args.seqs), impls=tuple(args.impls),
        batch_size=args.batch_size, dtype=args.dtype, warmup=args.warmup, iters=args.iters, device=args.device)
    write_rows(attention_rows(config), args.out)


if __name__ == "__main__":
    main()
