"""The GPU's SM clock and board power while a measurement runs, sampled by `nvidia-smi` in the background.

A GPU at its board power limit lowers its SM clock: on an H200 the 8B step's attention forward runs at a lower
clock than at shapes that stay under the limit (cs336_systems/kernels/flash/DECISIONS.md). Two timings of one
kernel can then differ by the clock they ran at. So a measurement
that records the clock and power beside its times says which of its differences the clock explains.

    with ClockSampler() as clocks:
        start = time.time(); run(); end = time.time()
    clocks.window(start, end)   # {"sm_clock_mhz": ..., "power_w": ..., "clock_samples": ...}

Without `nvidia-smi` (a CPU run), or over a window shorter than the sampling interval, the means are NaN and
`clock_samples` is 0.
"""

from __future__ import annotations

import math
import shutil
import statistics
import subprocess
import threading
from datetime import datetime
from typing import NamedTuple

QUERY = "timestamp,clocks.sm,power.draw"
TIMESTAMP = "%Y/%m/%d %H:%M:%S.%f"


class Sample(NamedTuple):
    time: float  # seconds since the epoch, as time.time() gives them
    sm_clock_mhz: float
    power_w: float


def parse_line(line: str) -> Sample | None:
    """One line of `nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader,nounits`,
    e.g. "2026/11/29 04:01:27.668, 1620, 646.65"; None for anything else (a header, an "[N/A]" reading)."""
    parts = [part.strip() for part in line.split(",")]
    if len(parts) != 3:
        return None
    try:
        return Sample(datetime.strptime(parts[0], TIMESTAMP).timestamp(), float(parts[1]), float(parts[2]))
    except ValueError:
        return None


def window_means(samples: list[Sample], start: float, end: float) -> dict:
    """Mean SM clock and power of the samples taken in [start, end] (host time.time() seconds)."""
    if end < start:
        raise ValueError(f"window_means: the window ends ({end}) before it starts ({start})")
    inside = [s for s in samples if start <= s.time <= end]
    if not inside:
        return {"sm_clock_mhz": math.nan, "power_w": math.nan, "clock_samples": 0}
    return {"sm_clock_mhz": statistics.fmean(s.sm_clock_mhz for s in inside),
            "power_w": statistics.fmean(s.power_w for s in inside), "clock_samples": len(inside)}


def cycle_ratio(ms: list[float], mhz: list[float], base_ms: list[float], base_mhz: list[float]) -> float:
    """The median over rounds of one kernel's cycles over another's, a round's cycles being its time × its sample's
    mean SM clock: where the power limit clocks two kernels differently, their time ratio mixes the clocks into
    their cycles. Rounds where either time or clock is NaN are left out; NaN if none is left."""
    if not len(ms) == len(mhz) == len(base_ms) == len(base_mhz):
        raise ValueError(f"cycle_ratio: one time and one clock per round for both kernels, got {len(ms)}, "
                         f"{len(mhz)}, {len(base_ms)} and {len(base_mhz)}")
    rounds = [(t * f) / (bt * bf) for t, f, bt, bf in zip(ms, mhz, base_ms, base_mhz)
              if not any(math.isnan(x) for x in (t, f, bt, bf))]
    return statistics.median(rounds) if rounds else math.nan


class ClockSampler:
    """`nvidia-smi` sampling one GPU's SM clock and power every `interval_ms` for the life of the context.
    device_index: the GPU as nvidia-smi numbers them (torch's index where CUDA_VISIBLE_DEVICES is unset); None
    samples nothing (a CPU run)."""

    stop_timeout_s = 5.0  # how long `nvidia-smi` gets to exit on SIGTERM before it is killed

    def __init__(self, device_index: int | None = 0, interval_ms: int = 50, command: str = "nvidia-smi"):
        if interval_ms < 1:
            raise ValueError(f"ClockSampler: interval_ms must be >= 1, got {interval_ms}")
        self.enabled = device_index is not None
        self.argv = [command, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", str(interval_ms),
                     "-i", str(device_index)]
        self.samples: list[Sample] = []
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    @classmethod
    def for_device(cls, device, **kwargs) -> ClockSampler:
        """A sampler of a torch.device's GPU; one that samples nothing for any other device."""
        if device.type != "cuda":
            return cls(None, **kwargs)
        import torch

        return cls(device.index if device.index is not None else torch.cuda.current_device(), **kwargs)

    def __enter__(self) -> ClockSampler:
        if self.enabled and shutil.which(self.argv[0]) is not None:
            self._process = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._process.stdout:
            sample = parse_line(line)
            if sample is not None:
                self.samples.append(sample)

    def __exit__(self, *exc) -> None:
        if self._process is not None:  # stopping it must not fail the measurement it ran beside
            self._process.terminate()
            try:
                self._process.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._reader.join(timeout=5)

    def window(self, start: float, end: float) -> dict:
        return window_means(list(self.samples), start, end)
