"""Launching a Triton kernel's compiled binary directly once it has run for the same argument layout.

Each `kernel[grid](...)` of an autotuned kernel goes through Triton's autotuner (building dicts of ~45
arguments), its heuristics and its argument binder before the launch itself: about 80 µs of host time
per launch on the H100 machines (results/diagnosis/flash_host.log: a forward+backward of four launches
took 699 µs of host time for a few tens of µs of GPU work). `FastLauncher` does that once per layout
(shapes, strides, dtypes, 16-byte alignment of each tensor and every scalar argument, which together
fix Triton's specialisation and the autotuner's key), keeps the compiled kernel, the tuned config and
the heuristics' values, and afterwards calls the binary with the arguments in signature order.

Not under Triton's interpreter (there is no binary; every call goes the normal way), and off with
CS336_FLASH_FAST_LAUNCH=0. `clear()` forgets every layout (after a kernel's configs are swapped).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton

from cs336_systems.kernels.common import INTERPRET

ENABLED = os.environ.get("CS336_FLASH_FAST_LAUNCH", "1") == "1" and not INTERPRET


def _layout(value) -> object:
    if isinstance(value, torch.Tensor):
        return value.shape, value.stride(), value.dtype, value.data_ptr() % 16, value.device.index
    return value


class FastLauncher:
    """`launcher(grid, *args, **kwargs)` launches `kernel` (a JIT function, optionally wrapped by
    `triton.heuristics` and `triton.autotune`) as `kernel[grid](*args, **kwargs)` would."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.autotuner = kernel if isinstance(kernel, triton.runtime.Autotuner) else None
        inner = kernel.fn if self.autotuner else kernel
        self.heuristics = inner if isinstance(inner, triton.runtime.Heuristics) else None
        self.jit = inner.fn if self.heuristics else inner
        self.names = self.jit.arg_names
        self.entries: dict[tuple, tuple] = {}

    def clear(self) -> None:
        self.entries.clear()

    def __call__(self, grid: Callable[[dict], tuple] | tuple, *args, **kwargs) -> None:
        if not ENABLED:
            self.kernel[grid](*args, **kwargs)
            return
        key = (tuple(map(_layout, args)), tuple((name, _layout(v)) for name, v in kwargs.items()))
        entry = self.entries.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **kwargs)  # tunes, compiles and launches as usual
            values = {**dict(zip(self.names, args)), **kwargs}
            if self.autotuner is not None:
                values.update(self.autotuner.best_config.kwargs)
            for name, rule in (self.heuristics.values.items() if self.heuristics else ()):
                values[name] = rule(values)
            fixed = {name: values[name] for name in self.names if name not in kwargs and name not in
                     self.names[:len(args)]}  # tuned tiles and heuristic flags
            launch_grid = grid(values) if callable(grid) else grid
            self.entries[key] = (compiled[tuple(launch_grid) + (1,) * (3 - len(launch_grid))], fixed)
            return
        run, fixed = entry
        values = {**dict(zip(self.names, args)), **kwargs, **fixed}
        run(*[values[name] for name in self.names])
