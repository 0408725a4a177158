"""One profiled training step of a leaderboard provider: device time by category, and peak memory by what
holds it (issue 24's breakdown; `python -m cs336_systems.bench.leaderboard --profile DIR`).

The step is the leaderboard's (`zero_grad`, forward + loss and backward of each micro-batch, AdamW step) under
`torch.profiler` (CPU and, on CUDA, CUDA activities), with a `record_function` range per phase (per micro-batch
for the first two): `forward` around the whole forward + loss call, `loss` nested in it from the final norm's
output on (a forward hook on the model's `ln_final` opens it: the LM head and cross-entropy), `backward` and
`optimizer`. On CUDA the allocator's
history is recorded around the step and its snapshot pickled to DIR (`bench.e2e.dump_snapshot`, with the
phases' host times, so `report.memory` can draw it), unless `history=False`: in torch 2.11 recording it breaks
the backward of a step whose non-reentrant checkpoints recompute a compiled region (a SystemError, "returned NULL
without setting an exception": pytorch/pytorch#179536; the history breaks it, not the profiler:
cs336_systems/bench/DECISIONS.md), so the leaderboard profiles such a step again without it.

Device time: on CUDA each GPU kernel's duration, given to the CPU op that launched it (a kernel the profiler
links to no op, as a Triton kernel launched from Python outside any op is on CUDA, to the phase that started
last before it ran: `unlinked_kernels`); on a CPU each op's
self CPU time (ATen and our custom ops, ranges excluded), which partitions the ops' time without double
counting. A kernel's phase is the innermost phase range whose host interval holds its launching op's start
(the autograd engine runs CUDA backward ops on its own thread, outside the main thread's range stack, but
inside the range's time). Its category is `classify(name)` (first matching pattern of `PATTERNS`), then:
- in `backward`, a forward-type kernel (`FORWARD_ONLY`: attention and CE forwards) or one launched under a
  forward-only op (`aten::linear`, `aten::matmul`, `aten::einsum`: the backward formulas call mm/bmm
  directly) is `recompute`: activation checkpointing reran it. Caveat: inside a compiled region Inductor
  calls mm directly in both passes, so recomputed GEMMs of compiled blocks stay `GEMM` (only their attention
  forwards are told apart);
- in `loss`, everything but attention is `loss` (the LM head's GEMM and the CE kernels);
- in `optimizer`, everything is `optimizer`.
Every kernel counted is listed beside the snapshot (DIR/NAME.kernels.csv: name, ms, category, phase, linked or
unlinked, the launching op or the device start), so a sum that does not add up can be traced to its kernels.
Two more rows: `profiled ops (total)`, the same device time summed another way (`total_device_ms`), which
the categories must add up to, and `step (wall)`, the profiled step's synchronized host time, above both.

Memory (CUDA): the step's allocator peak (`max_memory_allocated` after a reset), and parameters, gradients
and optimizer state counted from the tensors (untyped storage bytes, each storage once) at the end of the
step, when every gradient exists; `activations + workspace` = peak − the three. Since some gradients of a
backward peak may not exist yet, that rest is a lower bound on activations + workspace at the peak.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from cs336_systems.bench.profile import summarize
from cs336_systems.bench.profile_names import MATMUL, is_annotation
from cs336_systems.results import write_rows
from cs336_systems.timing import synchronize

PHASES = ("forward", "loss", "backward", "optimizer")
RANGE_PREFIX = "step:"  # our ranges' names, e.g. step:backward (no op is named so)
CATEGORIES = ("attention forward", "attention backward", "GEMM", "loss", "optimizer", "elementwise/norm/rope",
              "copies", "recompute", "other")
WALL = "step (wall)"
MEMORY = ("peak", "parameters", "gradients", "optimizer state", "activations + workspace")

# Kernel (CUDA) or op (CPU) name -> category, the first match wins; case-insensitive. Sources of the names:
# our Triton kernels (_flash_fwd_kernel, _flash_bwd_dkdv_kernel, _flash_bwd_dq_kernel,
# Gluon's _flash_*_gluon_kernel, _ce_kernel, _adamw_kernel) and custom ops (cs336_systems::flash_triton_*,
# linear_cross_entropy); SDPA's flash (pytorch_flash::flash_fwd_kernel, flash_bwd_*), memory-efficient
# (fmha_cutlassF/B) and cuDNN (cudnn_generated_..._sdpa_..._fprop/bprop_...) kernels and their aten ops; cuBLAS
# (sm80_xmma_gemm, cutlass, nvjet_sm90 on Hopper) and ATen's elementwise/reduce/copy kernels.
PATTERNS: tuple[tuple[str, str], ...] = (
    ("attention backward", r"FlashAttention\w*Backward|flash_bwd|flash_triton_backward"
                           r"|_bwd_preprocess_kernel|fmha_cutlassB"
                           r"|sdpa\w*bprop|attention_backward|scaled_dot_product\w*backward"),
    ("attention forward", r"FlashAttention|flash_fwd|flash_triton_forward|fmha_cutlassF|sdpa\w*fprop"
                          r"|_flash_attention_forward"
                          r"|_efficient_attention_forward|_cudnn_attention_forward|scaled_dot_product"),
    ("loss", r"_ce_kernel|linear_cross_entropy|cross_entropy|nll_loss|log_softmax|SoftMaxForward|SoftMaxBackward"),
    ("optimizer", r"_adamw_kernel|fused_adam|adamw|_foreach_|multi_tensor_apply"),
    ("GEMM", MATMUL + r"|splitKreduce|aten::linear|aten::einsum"),
    ("elementwise/norm/rope", r"^triton_(poi|per|red)_"),  # Inductor's fusions: "_to_copy" in one is a cast
    ("copies", r"memcpy|memset|copy|aten::to\b|aten::_to_copy|aten::clone|aten::contiguous|aten::cat\b"),
    ("elementwise/norm/rope", r"elementwise|reduce_kernel|triton_(poi|per|red)_|rms_?norm|softmax|rope|rotary"
                              r"|aten::(add|sub|mul|div|neg|exp|log|pow|rsqrt|sqrt|mean|sum|silu|sigmoid|where"
                              r"|masked_fill|fill_|zero_|sin|cos|cumsum|max|min)"),
)
# Forward-type kernels/ops: met in the backward range, they are a checkpoint's recomputation.
FORWARD_ONLY = r"FlashAttention|flash_fwd|flash_triton_forward|fmha_cutlassF|sdpa\w*fprop|_attention_forward" \
               r"|scaled_dot_product|SoftMaxForward|nll_loss_forward|log_softmax(?!_backward)|_ce_kernel|linear_cross_entropy"
FORWARD_ONLY_OPS = {"aten::linear", "aten::matmul", "aten::einsum"}
BACKWARD_NAME = r"backward|bprop|bwd"
# Categories an op passes on to the kernels and ops it launches (a GEMM inside our fused loss is the loss).
OWNING = ("attention forward", "attention backward", "loss")
WALL_OF_OPS = "profiled ops (total)"


def classify(name: str) -> str:
    """The category of a kernel (or CPU op) by its name alone (the module docstring's PATTERNS)."""
    return next((category for category, pattern in PATTERNS if re.search(pattern, name, re.IGNORECASE)), "other")


def _forward_only(name: str) -> bool:
    return name in FORWARD_ONLY_OPS or (re.search(FORWARD_ONLY, name, re.IGNORECASE) is not None
                                        and re.search(BACKWARD_NAME, name, re.IGNORECASE) is None)


def categorize(name: str, phase: str | None, parents: tuple[str, ...] = ()) -> str:
    """The category of a kernel launched in `phase` (None: outside every phase range) by an op whose chain of
    enclosing ops is `parents` (innermost first): classify(name), or, unless that is itself attention or
    loss, the innermost enclosing op's attention or loss category (OWNING); then the phase rules of the
    module docstring."""
    if phase == "optimizer":
        return "optimizer"
    category = classify(name)
    if category not in OWNING:
        category = next((c for c in map(classify, parents) if c in OWNING), category)
    if phase == "loss" and not category.startswith("attention"):
        return "loss"
    if phase == "backward" and any(map(_forward_only, (name, *parents))):
        return "recompute"
    return category


def _phase_intervals(events) -> list[tuple[float, float, str]]:
    """(start µs, end µs, phase) of our CPU phase ranges, innermost (latest start) first on lookup."""
    spans = [(e.time_range.start, e.time_range.end, e.name.removeprefix(RANGE_PREFIX)) for e in events
             if e.name.startswith(RANGE_PREFIX) and e.device_type == DeviceType.CPU]
    return sorted(spans, key=lambda span: -span[0])


def _phase_at(intervals, t: float) -> str | None:
    return next((phase for start, end, phase in intervals if start <= t <= end), None)


def _phase_started_before(intervals, t: float) -> str | None:
    """The phase whose range started last before t: a kernel's phase from its device start, which lags its
    launch (and may come after its range has ended on the host)."""
    return next((phase for start, _, phase in intervals if start <= t), None)


# CUPTI's overhead records (kineto's "overhead" activities: the host blocked on a full launch queue, a buffer
# request, ...) reach the profiler as CPU events that carry the correlation id of the op launching at the time, so
# the profiler lists that op's kernels under them as well. A step whose host runs ahead of the GPU fills the queue
# often, and its kernels were counted twice until these were left out. Names as CUPTI's overhead kinds
# (torch.profiler._cupti_monitor lists them).
CUPTI_OVERHEADS = frozenset({"Unknown", "Driver Compiler", "Buffer Flush", "Instrumentation", "Resource",
                             "Runtime Triggered Module Loading", "Lazy Function Loading", "Command Buffer Full",
                             "Activity Buffer Request", "UVM Activity Init"})


def _launchers(events):
    """The CPU events whose kernels are theirs: every CPU event but CUPTI's overhead records."""
    return [event for event in events if event.device_type == DeviceType.CPU and event.name not in CUPTI_OVERHEADS
            and str(getattr(event, "activity_type", None) or "").lower() != "overhead"]


def unlinked_kernels(events) -> list[tuple[str, float, float]]:
    """(name, device start µs, ms) of the device kernels that no CPU event lists among its launches. The
    profiler links a kernel to its launching op through the CUDA runtime call; a Triton kernel launched from
    Python (our AdamW's) goes through the driver with no op around it and comes out unlinked on CUDA."""
    linked = Counter((kernel.name, kernel.duration) for event in _launchers(events) for kernel in event.kernels)
    found = []
    for event in events:
        # The profiler also puts record_function ranges on the GPU timeline (`step:forward`, ...): ranges, not
        # kernels (counted as kernels, they made seconds of `other`).
        if (event.device_type != DeviceType.CUDA or getattr(event, "is_user_annotation", False)
                or is_annotation(event.name)):
            continue
        key = (event.name, event.time_range.end - event.time_range.start)
        if linked[key] > 0:
            linked[key] -= 1
        else:
            found.append((event.name, event.time_range.start, key[1] / 1e3))
    return found


def _parents(event) -> tuple[str, ...]:
    names, parent = [], event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return tuple(names)


def device_times(events, device: torch.device, listing: list[dict] | None = None) -> dict[str, tuple[int, float]]:
    """{category: (calls, ms)} of one profiled step (see the module docstring for what a "call" and its time
    are on CUDA and on a CPU). With `listing`, every kernel (op) counted is appended to it: its name, ms,
    category, phase, how it was found (`linked` to a CPU op, or `unlinked`), and the launching op or the
    device start (µs): what a total that does not add up is checked with."""
    intervals = _phase_intervals(events)
    found = {category: [0, 0.0] for category in CATEGORIES}

    def count(name: str, ms: float, phase: str | None, parents: tuple[str, ...], how: str, where: str) -> None:
        category = categorize(name, phase, parents)
        found[category][0] += 1
        found[category][1] += ms
        if listing is not None:
            listing.append({"name": name, "ms": ms, "category": category, "phase": phase, "found": how,
                            "where": where})

    for event in _launchers(events):
        if device.type == "cuda":  # kernels linked to the innermost op or range on the stack: ours too (a
            # Triton kernel launched from Python, as our AdamW's, may have no op around it but the phase)
            launched = [(kernel.name, kernel.duration / 1e3) for kernel in event.kernels]
        elif event.self_cpu_time_total > 0 and not is_annotation(event.name):
            launched = [(event.name, event.self_cpu_time_total / 1e3)]
        else:
            launched = []
        if not launched:
            continue
        phase, parents = _phase_at(intervals, event.time_range.start), _parents(event)
        for name, ms in launched:
            count(name, ms, phase, parents, "linked", f"{event.name} @{event.time_range.start:.1f}")
    if device.type == "cuda":
        for name, start, ms in unlinked_kernels(events):
            count(name, ms, _phase_started_before(intervals, start), (), "unlinked", f"@{start:.1f}")
    return {category: (calls, ms) for category, (calls, ms) in found.items()}


def total_device_ms(prof, device: torch.device) -> float:
    """The step's device time by another path than `device_times`, to check its categories against: on CUDA
    the kernels' total of `bench.profile.summarize` (the profiler's key averages); on a CPU the total CPU time
    of the outermost ops (those not inside another op: ranges aside), whose nested self times
    `device_times` sums."""
    if device.type == "cuda":
        return sum(row["total_ms"] for row in summarize(prof.key_averages(), device)[0])
    return sum(e.cpu_time_total for e in prof.events() if e.device_type == DeviceType.CPU
               and not is_annotation(e.name) and (e.cpu_parent is None or is_annotation(e.cpu_parent.name))) / 1e3


def _storage_bytes(tensors, device: torch.device) -> int:
    """Bytes of the distinct storages behind those of `tensors` on `device` (a view or a tied weight counted once;
    an optimizer state kept on the host, cs336_systems/offload.py, not at all)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == device.type:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def state_bytes(parameters, optimizer: torch.optim.Optimizer, device: torch.device) -> dict[str, int]:
    """Bytes the parameters, their gradients and the optimizer's state tensors hold on `device` now."""
    params = list(parameters)
    return {"parameters": _storage_bytes(params, device), "gradients": _storage_bytes((p.grad for p in params), device),
            "optimizer state": _storage_bytes((t for state in optimizer.state.values() for t in state.values()),
                                              device)}


class _LossRange:
    """A `loss` range opened by a forward hook on the model's final norm and closed after the loss returns."""

    def __init__(self, model: torch.nn.Module | None):
        self.handle, self.range = None, None
        norm = getattr(model, "ln_final", None)
        if norm is not None:
            self.handle = norm.register_forward_hook(lambda *_: self.open())

    def open(self) -> None:
        if self.range is None:
            self.range = record_function(RANGE_PREFIX + "loss")
            self.range.__enter__()

    def close(self) -> None:
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None

    def remove(self) -> None:
        self.close()
        if self.handle is not None:
            self.handle.remove()


def profile_step(step_parts: dict[str, Callable[[], object]], model: torch.nn.Module | None, parameters,
                 optimizer: torch.optim.Optimizer, device: torch.device, snapshot: Path | None = None,
                 history: bool = True) -> list[dict]:
    """Profile one step made of `step_parts`: zero_grad, forwards (a list of callables, one per micro-batch, each
    returning the loss its backward starts from; each runs in a `forward` range and its backward in a `backward`
    range before the next), optimizer. Rows of (kind, category, value, unit[, calls]); the snapshot pickled to
    `snapshot` on CUDA where `history` is recorded, the kernel listing beside it either way."""
    from cs336_systems.bench.e2e import dump_snapshot  # the snapshot format report.memory reads

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    cuda = device.type == "cuda"
    recording = cuda and snapshot is not None and history
    loss_range, marks = _LossRange(model), []

    def phase(name: str, fn: Callable[[], object]):
        start_us = time.time_ns() // 1000
        with record_function(RANGE_PREFIX + name):
            result = fn()
            if name == "forward":
                loss_range.close()
        marks.append({"phase": name, "start_us": start_us, "end_us": time.time_ns() // 1000})
        return result

    synchronize(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    if recording:  # Python frames only: symbolising C++ frames of an 8B step's allocations takes minutes
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            step_parts["zero_grad"]()
            for forward in step_parts["forwards"]:
                loss = phase("forward", forward)
                phase("backward", loss.backward)
            phase("optimizer", step_parts["optimizer"])
            synchronize(device)
            wall_ms = (time.perf_counter() - start) * 1e3
        if recording:
            Path(snapshot).parent.mkdir(parents=True, exist_ok=True)
            dump_snapshot(snapshot, marks)
    finally:
        loss_range.remove()
        if recording:
            torch.cuda.memory._record_memory_history(enabled=None)
    tool = "torch.profiler: CUDA kernel time" if cuda else "torch.profiler: CPU op self time"
    listing = []
    rows = [{"kind": "time", "category": category, "calls": calls, "value": ms, "unit": "ms", "tool": tool}
            for category, (calls, ms) in device_times(prof.events(), device, listing).items()]
    if snapshot is not None:  # every kernel counted, beside the snapshot (a check of the categories' sum)
        write_rows(listing, Path(snapshot).with_suffix(".kernels.csv"))
    rows.append({"kind": "time", "category": WALL_OF_OPS, "value": total_device_ms(prof, device), "unit": "ms",
                 "tool": tool + " (summed another way: the check of the categories)"})
    rows.append({"kind": "time", "category": WALL, "calls": 1, "value": wall_ms, "unit": "ms",
                 "tool": "perf_counter + synchronize (under the profiler)"})
    held = state_bytes(parameters, optimizer, device)
    peak = torch.cuda.max_memory_allocated(device) if cuda else float("nan")
    memory = {"peak": peak, **held, "activations + workspace": peak - sum(held.values())}
    rows += [{"kind": "memory", "category": name, "value": memory[name] / 2**30, "unit": "GiB",
              "tool": "max_memory_allocated; tensors' storage bytes at the step's end"} for name in MEMORY]
    return rows
