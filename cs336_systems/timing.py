"""Timing and device helpers shared by every benchmark."""

from __future__ import annotations

import contextlib
import gc
import statistics
import timeit
from collections.abc import Callable, Iterator, Mapping

import torch

# Dense peak rates in FLOP/s from NVIDIA's datasheets (SXM parts), by precision. "fp32" is the
# plain (non-tensor-core) rate, which is what float32 matmuls use at torch's default precision.
PEAK_FLOPS = {
    "H100": {"fp32": 67e12, "bf16": 989e12, "fp16": 989e12},
    "H200": {"fp32": 67e12, "bf16": 989e12, "fp16": 989e12},
    "A100": {"fp32": 19.5e12, "bf16": 312e12, "fp16": 312e12},
}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def peak_flops(device_name: str, precision: str) -> float:
    """The datasheet peak for a device and precision; NaN when unknown (e.g. a CPU)."""
    for key, table in PEAK_FLOPS.items():
        if key in device_name:
            return table[precision]
    return float("nan")


def resolve_device(device: str) -> torch.device:
    """A torch.device, with a clear error for a GPU asked for where there is none."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} was requested but CUDA is not available on this machine")
    return dev


def check_precision(precision: str, device: torch.device) -> None:
    if precision not in DTYPES:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(DTYPES)}")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"precision 'bf16' is not supported by {torch.cuda.get_device_name(device)}")


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Mixed precision for bf16/fp16; a no-op for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def annotate(name: str) -> Iterator[None]:
    """A named range seen by both Nsight Systems (NVTX) and the PyTorch profiler."""
    use_nvtx = torch.cuda.is_available()
    if use_nvtx:
        torch.cuda.nvtx.range_push(name)
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        if use_nvtx:
            torch.cuda.nvtx.range_pop()


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Run fn once and return its wall time in milliseconds, synchronizing before and after."""
    synchronize(device)
    start = timeit.default_timer()
    fn()
    synchronize(device)
    return (timeit.default_timer() - start) * 1e3


def summarize(samples_ms: list[float]) -> dict[str, float]:
    if not samples_ms:
        return {"mean_ms": float("nan"), "std_ms": float("nan"), "median_ms": float("nan"), "n": 0}
    return {
        "mean_ms": statistics.fmean(samples_ms),
        "std_ms": statistics.stdev(samples_ms) if len(samples_ms) > 1 else 0.0,
        "median_ms": statistics.median(samples_ms),
        "n": len(samples_ms),
    }


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def oom_message(error: BaseException) -> str:
    """The first line of an out-of-memory error, long enough to keep the allocator's own account
    (how much PyTorch had allocated and how much was reserved but free)."""
    return str(error).splitlines()[0][:500]


def oom_row(base: Mapping, error: BaseException, message_column: str = "error") -> dict:
    """The results row that records a point which ran out of memory: `base` (the point's own columns),
    status=oom, and the error's first line under `message_column`. Every benchmark's sweep catches
    `torch.OutOfMemoryError` / `RuntimeError`, re-raises what `is_oom` rejects, and records the rest
    with this, so an OOM row reads the same in every results file and the sweep goes on."""
    if not is_oom(error):
        raise ValueError(f"not an out-of-memory error: {type(error).__name__}: {error}")
    return {**base, "status": "oom", message_column: oom_message(error)}


def reset_memory(device: torch.device) -> None:
    """Free what earlier work left (reference cycles included) and restart the peak count."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return float("nan")


def bench_ms(fn: Callable[[], object], device: torch.device, warmup_ms: float, rep_ms: float,
             grad_to_none: list[torch.Tensor] | None = None, min_calls: int = 1) -> float:
    """Median milliseconds of fn: `triton.testing.do_bench` on CUDA (device events, L2 flushed between
    runs); on the CPU a host timer over at least three runs after one warm-up. The measuring window
    grows to hold at least `min_calls` calls (do_bench fits as many calls as `rep_ms` holds, so a call
    longer than the window would otherwise be the median of one or two)."""
    if device.type == "cuda":
        import triton

        if min_calls > 1:
            fn()  # compile / autotune out of the estimate
            rep_ms = max(rep_ms, min_calls * timed(fn, device))
        return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median",
                                       grad_to_none=grad_to_none)
    fn()
    samples: list[float] = []
    while len(samples) < 3 or sum(samples) < rep_ms:
        for t in grad_to_none or []:
            t.grad = None
        samples.append(timed(fn, device))
    return statistics.median(samples)

