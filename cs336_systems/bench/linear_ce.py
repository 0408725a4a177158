"""LM head + cross-entropy benchmark: forward+backward time and peak memory, fused against plain.

Providers, each computing mean CE(hidden @ Wᵀ, targets) and its gradients w.r.t. hidden and W:
- `fused`: our chunked `linear_cross_entropy` (kernels/fused_linear_ce.py), never holding the logits;
- `plain_compiled`: `torch.compile` of the plain path `linear_cross_entropy_ref` (the model's
  cross_entropy of the full logits);
- `plain_eager`: the same plain path, eager.

One row per (tokens, provider): median ms of forward+backward (`triton.testing.do_bench` on CUDA, via
timing.bench_ms), the peak memory allocated during one forward+backward (total, and beyond the
inputs), TFLOP/s from the three matmuls (6·tokens·d·vocab FLOPs), the loss; an out-of-memory point
is a row with status=oom. Every row carries provenance.

    python -m cs336_systems.bench.linear_ce --tokens 8192 32768 --out results/linear_ce.csv
    python -m cs336_systems.bench.linear_ce --device cpu --tokens 8 --d-model 16 --vocab 37 --out /tmp/lce.csv
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from cs336_systems.bench.checks import check_known, check_not_empty, check_positive
from cs336_systems.bench.cli import config_or_usage_error, positive_int
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows
from cs336_systems.timing import (
    DTYPES,
    bench_ms,
    is_oom,
    oom_row,
    peak_memory_mib,
    reset_memory,
    resolve_device,
    synchronize,
)

PROVIDER_NAMES = ("fused", "plain_compiled", "plain_eager")


def make_provider(name: str, chunk_tokens: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss function a provider name stands for (imports the kernels only when asked)."""
    from cs336_systems.kernels.fused_linear_ce import linear_cross_entropy, linear_cross_entropy_ref

    if name == "fused":
        return lambda h, w, t: linear_cross_entropy(h, w, t, chunk_tokens=chunk_tokens)
    if name == "plain_compiled":
        return torch.compile(linear_cross_entropy_ref)
    if name == "plain_eager":
        return linear_cross_entropy_ref
    raise ValueError(f"unknown provider {name!r}; known: {', '.join(PROVIDER_NAMES)}")


@dataclass(frozen=True)
class LinearCEConfig:
    """The points: every (tokens, provider) at one model dim, vocab and dtype (hidden and W both in it)."""

    tokens: tuple[int, ...] = (8192, 32768)
    d_model: int = 4096
    vocab: int = 151936
    dtype: str = "bf16"
    providers: tuple[str, ...] = PROVIDER_NAMES
    chunk_tokens: int = 4096
    warmup_ms: int = 100
    rep_ms: int = 500
    device: str = "cuda"

    def __post_init__(self):
        check_not_empty("tokens", self.tokens)
        check_not_empty("providers", self.providers)
        check_known("provider", self.providers, PROVIDER_NAMES)
        check_known("dtype", [self.dtype], DTYPES)
        check_positive("tokens", *self.tokens)
        check_positive("d_model", self.d_model)
        check_positive("vocab", self.vocab)
        check_positive("chunk_tokens", self.chunk_tokens)
        check_positive("warm-up time (ms)", self.warmup_ms)
        check_positive("repetition time (ms)", self.rep_ms)
        resolve_device(self.device)


def measure(fn, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, warmup_ms: int,
            rep_ms: int) -> dict:
    """Peak memory of one forward+backward (after a first call that compiles/warms up), then its median ms."""
    device = hidden.device

    def step():
        fn(hidden, weight, targets).backward()

    step()  # compilation and autotuning outside the memory count
    hidden.grad = weight.grad = None
    reset_memory(device)
    base_mib = torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
    loss = fn(hidden, weight, targets)
    loss.backward()
    synchronize(device)
    peak_mib = peak_memory_mib(device)
    hidden.grad = weight.grad = None
    median_ms = bench_ms(step, device, warmup_ms, rep_ms, grad_to_none=[hidden, weight])
    return {"median_ms": median_ms, "peak_mib": peak_mib, "peak_extra_mib": peak_mib - base_mib,
            "loss": loss.item()}


def run(config: LinearCEConfig) -> Iterator[dict]:
    """Each (tokens, provider) point's row in turn."""
    device = resolve_device(config.device)
    dtype = DTYPES[config.dtype]
    for tokens in config.tokens:
        for provider in config.providers:
            base = {"benchmark": "linear_ce", "provider": provider, "tokens": tokens, "d_model": config.d_model,
                    "vocab": config.vocab, "dtype": config.dtype, "pass": "forward_backward",
                    # the plain paths hold all the logits at once: one chunk of every token
                    "chunk_tokens": min(config.chunk_tokens, tokens) if provider == "fused" else tokens}
            hidden = weight = targets = None
            try:
                torch.manual_seed(0)
                hidden = torch.randn(tokens, config.d_model, device=device, dtype=dtype, requires_grad=True)
                weight = (torch.randn(config.vocab, config.d_model, device=device, dtype=dtype)
                          / config.d_model**0.5).requires_grad_()
                targets = torch.randint(0, config.vocab, (tokens,), device=device)
                result = measure(make_provider(provider, config.chunk_tokens), hidden, weight, targets,
                                 config.warmup_ms, config.rep_ms)
            except (torch.OutOfMemoryError, RuntimeError) as error:
                if not is_oom(error):
                    raise
                row = oom_row(base, error)
            else:
                flops = 6 * tokens * config.d_model * config.vocab
                row = {**base, **result, "tflops": flops / result["median_ms"] / 1e9, "status": "ok"}
            finally:
                hidden = weight = targets = None
            print(f"linear_ce tokens={tokens} {provider}: {row['status']}"
                  + (f" {row['median_ms']:.3f} ms, peak {row['peak_mib']:.0f} MiB" if row["status"] == "ok" else ""),
                  file=sys.stderr, flush=True)
            yield row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", nargs="+", type=positive_int, default=[8192, 32768],
                        help="tokens per call (batch x sequence), one point each")
    parser.add_argument("--d-model", type=positive_int, default=4096, help="hidden size d")
    parser.add_argument("--vocab", type=positive_int, default=151936, help="vocabulary size (rows of W)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="dtype of hidden and W")
    parser.add_argument("--providers", nargs="+", default=list(PROVIDER_NAMES), choices=list(PROVIDER_NAMES),
                        help="implementations to time")
    parser.add_argument("--chunk-tokens", type=positive_int, default=4096, help="tokens per chunk of the fused op")
    parser.add_argument("--warmup-ms", type=positive_int, default=100, help="do_bench warm-up time")
    parser.add_argument("--rep-ms", type=positive_int, default=500, help="do_bench measuring time")
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark's device) or cpu (a smoke run)")
    parser.add_argument("--out", required=True, help="CSV file for the rows")
    args = parser.parse_args(argv)
    config = config_or_usage_error(
        parser, LinearCEConfig, tokens=tuple(args.tokens), d_model=args.d_model, vocab=args.vocab, dtype=args.dtype,
        providers=tuple(args.providers), chunk_tokens=args.chunk_tokens, warmup_ms=args.warmup_ms,
        rep_ms=args.rep_ms, device=args.device)
    prov = provenance(args.device)
    write_rows(({**row, **prov} for row in run(config)), args.out)


if __name__ == "__main__":
    main()
