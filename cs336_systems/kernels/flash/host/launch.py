"""Launching a Triton kernel's compiled binary directly once it has run for the same argument layout, and the one
cache of every per-layout plan the flash kernels keep.

Each `kernel[grid](...)` of an autotuned kernel goes through Triton's autotuner (building dicts of ~45
arguments), its heuristics and its argument binder before the launch itself: host time that short
calls feel. `FastLauncher` does that once per layout (shapes, strides, dtypes, 16-byte alignment of each
tensor and every scalar argument, which together fix Triton's specialisation and the autotuner's key), keeps
the compiled kernel, the tuned config and the heuristics' values, and afterwards calls the binary with the
arguments in signature order.

That reads Triton internals with no public equivalent: `Autotuner.fn` and `.best_config`,
`Heuristics.fn` and `.values`, `JITFunction.arg_names`, and the compiled kernel's `[grid]` launcher.
`fast_path_problem` checks them, and the Triton version they were checked against
(CHECKED_TRITON_VERSIONS), once per launcher; where anything differs the launcher says so in one
warning and takes the public `kernel[grid](...)` path, as it does under Triton's interpreter (there
is no binary), with the `fast_launch` setting off (settings.py; CS336_FLASH_FAST_LAUNCH=0), and on
the first call per layout.

The binary is called through `lean_runner`: Triton 3.6's own runner (`CompiledKernel[grid]`) builds launch
metadata (a LazyDict) on every launch and hands the C launcher two hook chains to call, because
`knobs.runtime.launch_enter_hook` is an (empty) `HookChain`, never None, so its "no hook" test never holds; where
no hook is registered and the kernel needs no scratch memory, `lean_runner` calls the C launcher with Nones
instead, as Triton's runner would with no hooks. `FastLauncher.bound` hands the remembered binary and the
arguments Triton filled in to a caller that keeps its own per-call plan, so that caller's hits skip the layout
key too.

`PLANS` is the one plan cache: every table of per-layout plans (FA2's and Gluon's launches, the C++ node's plans,
the dispatch's answers) is one of its tables, and every FastLauncher registers with it, so `PLANS.clear()` (after
a kernel's tile configs change: `fa2.pinned_tiles`) forgets all of them at once. See DECISIONS.md#host-path.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import triton

from cs336_systems.kernels.common import INTERPRET
from cs336_systems.kernels.flash.settings import flash_settings

# Triton releases (major.minor) whose internals above were read and checked against the public path; another
# release takes the public path until checked.
CHECKED_TRITON_VERSIONS = ("3.6",)
_warned: set[str] = set()


class PlanCache:
    """Named tables of per-layout plans and the FastLaunchers whose binaries they hold, cleared together: a plan
    made from a launcher's binary is never kept past that launcher's entries. A module takes its table once
    (`PLANS.table(name)`, a plain dict kept for the life of the process) and reads it directly."""

    def __init__(self):
        self.tables: dict[str, dict] = {}
        self.launchers: list[FastLauncher] = []

    def table(self, name: str) -> dict:
        """The table `name` (made empty on first ask)."""
        return self.tables.setdefault(name, {})

    def clear(self) -> None:
        """Forget every plan and every launcher's binaries: each next call derives its launches again."""
        for table in self.tables.values():
            table.clear()
        for launcher in self.launchers:
            launcher.entries.clear()


PLANS = PlanCache()


def _no_launch_hooks() -> bool:
    """Whether no Triton launch hook is registered now (a profiler such as Proton registers one)."""
    runtime = triton.knobs.runtime
    enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
    return (enter is None or (type(enter) is triton.knobs.HookChain and not enter.calls)) and (
        exit_ is None or (type(exit_) is triton.knobs.HookChain and not exit_.calls))


def lean_runner(compiled, grid: tuple[int, int, int]) -> Callable:
    """`run(*args)` launching `compiled` (Triton's CompiledKernel) on `grid` as `compiled[grid](*args)` does: on the
    current device's current stream, with no launch metadata where no launch hook is registered (checked per call;
    with a hook, Triton's own runner). Kernels that need global or profile scratch memory, and objects that are not
    a CompiledKernel with the CUDA launcher this was checked against, get Triton's runner."""
    runner = compiled[grid]  # also loads the binary (CompiledKernel._init_handles)
    try:
        from triton.backends.nvidia.driver import CudaLauncher
        from triton.compiler.compiler import CompiledKernel
    except ImportError:
        return runner
    if type(compiled) is not CompiledKernel or type(compiled.run) is not CudaLauncher:
        return runner
    launcher = compiled.run
    if launcher.global_scratch_size or launcher.profile_scratch_size:
        return runner
    c_launch, function, packed = launcher.launch, compiled.function, compiled.packed_metadata
    cooperative, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
    grid_x, grid_y, grid_z = grid
    # torch's own calls behind Triton's driver.get_current_device / get_current_stream, without the Python wrapper
    # (`torch.cuda.current_device` checks CUDA's lazy initialisation at each call; it ran when the kernel did)
    get_device = getattr(torch._C, "_cuda_getDevice", None)
    get_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get_device is None or get_stream is None:
        return runner

    def run(*args):
        if not _no_launch_hooks():
            return runner(*args)
        c_launch(grid_x, grid_y, grid_z, get_stream(get_device()), function, cooperative, pdl, None, None, packed,
                 None, None, None, *args)

    return run


def launch_key(args: tuple, kwargs: dict) -> tuple:
    """The layout key of one call: of each argument what fixes Triton's specialisation and the autotuner's key (a
    tensor's shape, strides, dtype, 16-byte alignment and device index; any other value itself). Written inline:
    a call has ~30 arguments, and a Python call per argument was a measurable share of a short attention call."""
    tensor = torch.Tensor
    return (tuple([(a.shape, a.stride(), a.dtype, a.data_ptr() % 16, a.get_device()) if isinstance(a, tensor)
                   else a for a in args]),
            tuple([(name, (a.shape, a.stride(), a.dtype, a.data_ptr() % 16, a.get_device())
                    if isinstance(a, tensor) else a) for name, a in kwargs.items()]))


def layout(*tensors: torch.Tensor) -> tuple:
    """What a per-call plan (FA2's, the Gluon passes') depends on of each input: shape, strides, dtype,
    16-byte alignment (Triton specialises pointers on it) and device index. Fresh outputs are not in it:
    `empty_like` of one layout always gives one layout, and the allocators align every block to at least 64 bytes."""
    return tuple([(t.shape, t.stride(), t.dtype, t.data_ptr() % 16, t.get_device()) for t in tensors])


def contiguous_strides(shape) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape` (as `torch.empty(shape).stride()`, without allocating)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive ints, as triton.cdiv: that one is a Triton "constexpr function", whose call from
    Python costs ~1-2 us through its wrapper, and the launchers call it on every launch."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of 2 >= n (n >= 1), as triton.next_power_of_2, without its wrapper's cost (see cdiv)."""
    return 1 << (n - 1).bit_length()


def fast_path_problem(kernel, version: str | None = None) -> str | None:
    """Why `kernel` (a JIT function, optionally wrapped by `triton.heuristics` and `triton.autotune`)
    cannot be launched by the fast path with this Triton (or with Triton `version`), or None when it can."""
    version = version or triton.__version__
    if ".".join(version.split(".")[:2]) not in CHECKED_TRITON_VERSIONS:
        return f"Triton {version} is not one of the checked releases {', '.join(CHECKED_TRITON_VERSIONS)}"
    runtime = triton.runtime
    for name in ("Autotuner", "Heuristics"):
        if not isinstance(getattr(runtime, name, None), type):
            return f"triton.runtime.{name} is missing"
    inner = kernel
    if isinstance(inner, runtime.Autotuner):
        if not hasattr(inner, "fn"):
            return "the autotuner has no .fn"
        inner = inner.fn
    if isinstance(inner, runtime.Heuristics):
        if not (hasattr(inner, "fn") and isinstance(getattr(inner, "values", None), dict)):
            return "the heuristics have no .fn or .values"
        inner = inner.fn
    names = getattr(inner, "arg_names", None)
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        return f"{type(inner).__name__} has no .arg_names"
    return None


def _warn_once(problem: str) -> None:
    if problem not in _warned:
        _warned.add(problem)
        warnings.warn(f"FastLauncher: {problem}; launching through kernel[grid](...) instead", RuntimeWarning,
                      stacklevel=3)


class FastLauncher:
    """`launcher(grid, *args, **kwargs)` launches `kernel` (a JIT function, optionally wrapped by
    `triton.heuristics` and `triton.autotune`) as `kernel[grid](*args, **kwargs)` would.

    `key(args, kwargs)` gives the layout key of a call (default `launch_key`; a kernel taking arguments that are neither
    tensors nor hashable values, such as TMA descriptors, brings its own). A grid given as a tuple is part of the
    key; a grid given as a function must depend on nothing but the key's contents. Registered with PLANS, whose
    `clear` forgets its layouts."""

    def __init__(self, kernel, key: Callable[[tuple, dict], tuple] = launch_key):
        self.kernel = kernel
        self.key = key
        self.problem = None if INTERPRET else fast_path_problem(kernel)  # the interpreter never uses it
        self.autotuner = self.heuristics = self.jit = self.names = None
        if self.problem is None and not INTERPRET:
            runtime = triton.runtime
            self.autotuner = kernel if isinstance(kernel, runtime.Autotuner) else None
            inner = kernel.fn if self.autotuner else kernel
            self.heuristics = inner if isinstance(inner, runtime.Heuristics) else None
            self.jit = inner.fn if self.heuristics else inner
            self.names = self.jit.arg_names
        self.entries: dict[tuple, tuple] = {}
        PLANS.launchers.append(self)

    def bound(self, grid: Callable[[dict], tuple] | tuple, args: tuple, kwargs: dict) -> tuple | None:
        """For a call this launcher has run on its fast path: `(run, tail, compiled, launch_grid)` such that
        `run(*args, *tail)` launches it again (tail: the keywords and the values Triton filled in, in signature
        order), for a caller that keys the call by itself and will pass the same `kwargs`; `compiled` is the binary
        (Triton's CompiledKernel) and `launch_grid` its 3-d grid, for a caller that launches it by other means
        (the C++ node). None where there is no such entry (the public path)."""
        if self.problem is not None or INTERPRET:
            return None
        entry = self.entries.get((self.key(args, kwargs), grid if type(grid) is tuple else None))
        if entry is None:
            return None
        run, tail, compiled, launch_grid = entry
        return (run, tuple([kwargs[name] if from_kwargs else value for name, from_kwargs, value in tail]), compiled,
                launch_grid)

    def __call__(self, grid: Callable[[dict], tuple] | tuple, *args, fast_launch: bool | None = None,
                 **kwargs) -> None:
        """`fast_launch` is the caller's `FlashSettings.fast_launch` where it has read the settings for this call
        already; None reads them here."""
        if fast_launch is None:
            fast_launch = flash_settings().fast_launch
        if INTERPRET or not fast_launch:
            self.kernel[grid](*args, **kwargs)
            return
        if self.problem is not None:
            _warn_once(self.problem)
            self.kernel[grid](*args, **kwargs)
            return
        key = (self.key(args, kwargs), grid if type(grid) is tuple else None)
        entry = self.entries.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **kwargs)  # tunes, compiles and launches as usual
            self._remember(key, compiled, grid, args, kwargs)
            return
        run, tail = entry[0], entry[1]
        # The signature's names after the positional ones, each from the keywords or, for those Triton filled in
        # (tuned tiles, heuristic flags), the value it chose: a call of this key passes the same keywords.
        run(*args, *[kwargs[name] if from_kwargs else value for name, from_kwargs, value in tail])

    def _remember(self, key: tuple, compiled, grid, args: tuple, kwargs: dict) -> None:
        """Keep the binary and the arguments Triton filled in (tuned tiles, heuristic flags) for `key`;
        where the internals read after a run are missing, use the public path from now on."""
        try:
            values = {**dict(zip(self.names, args)), **kwargs}
            if self.autotuner is not None:
                values.update(self.autotuner.best_config.kwargs)
            for name, rule in (self.heuristics.values.items() if self.heuristics else ()):
                values[name] = rule(values)
            fixed = {name: values[name] for name in self.names if name not in kwargs and name not in
                     self.names[:len(args)]}  # tuned tiles and heuristic flags
            launch_grid = grid(values) if callable(grid) else grid
            launch_grid = tuple(launch_grid) + (1,) * (3 - len(launch_grid))
            run = lean_runner(compiled, launch_grid)
        except (AttributeError, KeyError, TypeError) as error:
            self.problem = f"reading Triton's state after a launch failed ({type(error).__name__}: {error})"
            _warn_once(self.problem)
            return
        tail = tuple((name, name in kwargs, fixed.get(name)) for name in self.names[len(args):])
        self.entries[key] = (run, tail, compiled, launch_grid)
