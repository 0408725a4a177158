"""The `flash_triton` backend's C++ autograd node (csrc/flash_node.cpp), for calls bound by the host.

Why: at short calls a Python `autograd.Function` costs more than its kernels. The autograd engine runs the Python
backward on its device thread, where each Python line took 1.5-2.4x as long as on the calling thread, and ours'
forward+backward came out at about SDPA flash's time although its FA2 kernels took 0.59-0.78x SDPA flash's
(kernels/NOTES.md, "What a short call's host time is made of"). A C++ node with the same allocations, four TMA
encodes and four launches measured at about the cost of a Python Function that launches nothing ("The floor of a C++
autograd node at short calls"). This is that node, with the real kernels.

How: once a layout's FA2 forward and backward have run through flash_triton's plans, the plans hold the binaries
Triton compiled for that layout and every argument Triton passes them (`flash_triton.fa2_launches`). `attention`
turns each launch into a C++ `Launch`:
- the CUfunction Triton loaded, the grid, 32 x num_warps threads, the shared memory;
- the parameters packed as Triton 3.6's launcher packs them (`pack_params`: the signature's parameters in order,
  constexprs left out, each as its C type, then the global and profile scratch pointers, null here);
- the pointer parameters named by tensor slot, written in at each launch.
From then on, calls of that layout run through the C++ node: it allocates O and L (and in the backward D, dQ, dK,
dV) as the Python launchers do and launches the same binaries with the same arguments, so the results are the
Python path's bit for bit (tests/test_flash_native.py). The backward's binaries were made for the dO layout of the
backward that planned them (O's, or contiguous); a dO of another layout is copied into that one first.

Compiled graphs call flash_triton's two operators instead of an autograd Function; their kernels take the same
launches without the node (`forward`, `backward`), so a compiled call's passes run no Python launcher either.

Where the Python path still runs (same kernels): a layout's first calls, until its FA2 forward and a backward (with
a dO in O's layout or contiguous) have run once; the calls the Gluon kernels take (device-bound, and their TMA
descriptors would have to be encoded here); kernels that need scratch memory (FA2's forward with device-side TMA
descriptors, from `tma_min_keys` keys); fast launch off or a Triton release the fast path was not checked against
(no binaries are kept then); the `native` setting off (CS336_FLASH_NATIVE=0); and where the module cannot be built
(no C++ compiler, ninja or CUDA headers: warned once). The node fixes both passes' kernels when the forward runs;
Triton's launch hooks (Proton) do not see its launches (torch.profiler does). Triton never unloads a module it
loaded, so a plan that outlives its CompiledKernel (cleared launchers, a backward still pending) still launches
valid functions.
"""

from __future__ import annotations

import functools
import struct
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch

from cs336_systems.kernels import flash_dispatch
from cs336_systems.kernels.common import INTERPRET, check_inputs
from cs336_systems.kernels.launch import layout, on_clear
from cs336_systems.kernels.settings import FlashSettings, flash_settings, made_with

SOURCE = Path(__file__).parent / "csrc" / "flash_node.cpp"
# The call's tensors in the C++ node's slot order (flash_node.cpp's `Slot`).
SLOTS = ("q", "k", "v", "out", "lse", "grad_out", "delta", "dq", "dk", "dv")
# How Triton 3.6's launcher passes each scalar parameter type (driver.py's ty_to_cpp and FLOAT_STORAGE_TYPE), as
# `struct` formats.
SCALAR_FORMATS = {"i1": "b", "i8": "b", "u1": "B", "u8": "B", "i16": "h", "u16": "H", "i32": "i", "u32": "I",
                  "i64": "q", "u64": "Q", "fp32": "f", "f32": "f", "fp64": "d"}


class TensorSlot(NamedTuple):
    """A pointer parameter's value: the data pointer of the call's tensor `SLOTS[index]`."""

    index: int


@dataclass(frozen=True)
class PackedParams:
    """A kernel's parameters as the C++ `Launch` takes them: the bytes of all of them back to back, each naturally
    aligned at `offsets[i]`, and which of them (`pointer_params`, indices into `offsets`) take which tensor's data
    pointer (`pointer_slots`)."""

    params: bytes
    offsets: list[int]
    pointer_params: list[int]
    pointer_slots: list[int]


def pack_params(types: Sequence, values: Sequence) -> PackedParams:
    """The parameters of a kernel with signature `types` (Triton's: "*bf16", "i32", "fp32", "constexpr", ...)
    called with `values` (a TensorSlot for each pointer), laid out as Triton 3.6's launcher passes them: constexprs
    left out, each other one as its C type, then two null pointers (the global and profile scratch memory, which
    the node's kernels must not need). A ValueError names a parameter the node cannot pass."""
    if len(types) != len(values):
        raise ValueError(f"the signature has {len(types)} parameters but {len(values)} values were given")
    data, offsets, pointer_params, pointer_slots = bytearray(), [], [], []

    def put(fmt: str, value) -> None:
        size = struct.calcsize("=" + fmt)
        data.extend(bytes(-len(data) % size))  # natural alignment
        offsets.append(len(data))
        data.extend(struct.pack("=" + fmt, value))

    for position, (kind, value) in enumerate(zip(types, values)):
        if kind == "constexpr":
            continue
        if isinstance(kind, str) and kind.startswith("*"):
            if not isinstance(value, TensorSlot) or not 0 <= value.index < len(SLOTS):
                raise ValueError(f"parameter {position} ({kind}) is a pointer, so its value must be a TensorSlot of "
                                 f"0..{len(SLOTS) - 1}, got {value!r}")
            pointer_params.append(len(offsets))
            pointer_slots.append(value.index)
            put("Q", 0)
        elif kind in SCALAR_FORMATS:
            if isinstance(value, TensorSlot):
                raise ValueError(f"parameter {position} ({kind}) is a scalar, got a tensor ({SLOTS[value.index]})")
            put(SCALAR_FORMATS[kind], value)
        else:
            raise ValueError(f"parameter {position} has type {kind!r}, which the C++ node does not pass")
    put("Q", 0)  # global scratch
    put("Q", 0)  # profile scratch
    return PackedParams(bytes(data), offsets, pointer_params, pointer_slots)


@functools.cache
def native_module() -> tuple[ModuleType | None, str | None]:
    """(the built C++ module, None), or (None, why it cannot be built). Built once per machine and source (torch
    keeps it under TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions, and rebuilds it when the source changes); the
    first build takes about a minute."""
    try:
        from torch.utils import cpp_extension

        module = cpp_extension.load(name="cs336_flash_node", sources=[str(SOURCE)], extra_cflags=["-O2"],
                                    with_cuda=True, verbose=False)
    except Exception as error:  # a missing compiler, ninja or CUDA headers, or a failed build: the Python path runs
        first_line = (str(error).strip().splitlines() or [""])[0]
        return None, f"building {SOURCE.name} failed ({type(error).__name__}: {first_line})"
    if tuple(module.SLOTS) != SLOTS:  # the two lists of the call's tensors must agree
        return None, f"{SOURCE.name} numbers the tensors {tuple(module.SLOTS)}, flash_native {SLOTS}"
    return module, None


def launch_problem(compiled) -> str | None:
    """Why the node cannot launch `compiled` (Triton's CompiledKernel) as Triton's launcher would, or None."""
    meta = getattr(compiled, "metadata", None)
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if meta is None or not isinstance(signature, dict) or not getattr(compiled, "function", None):
        return f"{type(compiled).__name__} has no metadata, signature or loaded function"
    for field, wanted in (("num_ctas", 1), ("launch_cooperative_grid", False), ("launch_pdl", False),
                          ("global_scratch_size", 0), ("profile_scratch_size", 0)):
        if getattr(meta, field, wanted) != wanted:
            return f"{compiled.name}: {field}={getattr(meta, field)!r} (the node launches only {field}={wanted!r})"
    return None


def make_launch(module: ModuleType, tensors: Sequence[str], compiled, grid: Sequence[int], tail: Sequence):
    """The C++ Launch of `compiled` on `grid` with the call's `tensors` (SLOTS names) followed by `tail`."""
    problem = launch_problem(compiled)
    if problem:
        raise ValueError(problem)
    values = [TensorSlot(SLOTS.index(name)) for name in tensors] + list(tail)
    packed = pack_params(list(compiled.src.signature.values()), values)
    meta = compiled.metadata
    return module.Launch(function=compiled.function, grid=list(grid), threads=32 * meta.num_warps,
                         shared_bytes=meta.shared, params=packed.params, offsets=packed.offsets,
                         pointer_params=packed.pointer_params, pointer_slots=packed.pointer_slots)


@dataclass
class _Node:
    """What `attention` knows of one (layout, causal) key: the settings it was decided with, the C++ plan (None:
    the Python Function runs) and whether the FA2 plans are still awaited (`pending`)."""

    settings: FlashSettings
    plan: object | None
    pending: bool


_NODES: dict[tuple, _Node] = {}
on_clear(_NODES.clear)  # new FA2 tiles: the binaries the plans launch are dropped with flash_triton's plans
_warned: set[str] = set()

Launches = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, FlashSettings], tuple | None]


def _fa2_both(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, settings: FlashSettings) -> bool:
    """Whether flash_dispatch gives both passes of such a call to FA2 with `settings`."""
    if flash_dispatch.choose_forward(q, k, v, is_causal, forward=settings.forward) != "triton":
        return False
    return settings.backward == "triton" or (settings.backward == "auto" and not flash_dispatch.gluon_backward_pays(
        flash_dispatch.device_capability(q), q.shape, k.shape, is_causal))


def _decide(q, k, v, is_causal: bool, settings: FlashSettings, launches_of: Launches, node: _Node | None) -> _Node:
    """The node of this key now: settled (a plan, or the Python Function for good) or still pending."""
    if node is None:
        check_inputs(q, k, v, "FlashAttentionTriton")  # the Python path's errors, before anything reads shapes
        if not settings.fast_launch or not _fa2_both(q, k, v, is_causal, settings):  # no binaries, or Gluon
            return _Node(settings, None, pending=False)
    launches = launches_of(q, k, v, is_causal, settings)
    if launches is None:
        return _Node(settings, None, pending=True)
    module, problem = native_module()
    if module is not None:
        try:
            forward, backward = ([make_launch(module, *launch) for launch in passes] for passes in launches[:2])
            plan = module.Plan(forward=forward, backward=backward, grad_strides=list(launches[2]))
            return _Node(settings, plan, pending=False)
        except ValueError as error:
            problem = str(error)
    if problem not in _warned:
        _warned.add(problem)
        warnings.warn(f"flash_native: {problem}; the Python autograd Function runs instead (CS336_FLASH_NATIVE=0 "
                      "turns the C++ node off)", RuntimeWarning, stacklevel=4)
    return _Node(settings, None, pending=False)


def _plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, launches_of: Launches):
    """The C++ plan of this call's layout, or None where the Python path should run."""
    settings = flash_settings()
    if not settings.native or INTERPRET or not q.is_cuda:
        return None
    key = (layout(q, k, v), is_causal)
    node = _NODES.get(key)
    current = made_with(node, settings)
    if not current or node.pending:
        node = _NODES[key] = _decide(q, k, v, is_causal, settings, launches_of, node if current else None)
    return node.plan


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, launches_of: Launches
              ) -> torch.Tensor | None:
    """O through the C++ node where this call's layout has one (its gradients come from the node's C++ backward);
    None where the caller should run the Python Function. `launches_of` is flash_triton.fa2_launches."""
    plan = _plan(q, k, v, is_causal, launches_of)
    return None if plan is None else native_module()[0].flash_attention(q, k, v, plan)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, launches_of: Launches
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(O, L) through the layout's C++ forward launches, without autograd (a compiled graph's forward operator),
    or None where the caller should run the Python launchers."""
    plan = _plan(q, k, v, is_causal, launches_of)
    return None if plan is None else native_module()[0].forward(q, k, v, plan)


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
             grad_out: torch.Tensor, is_causal: bool, launches_of: Launches
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(dQ, dK, dV) through the layout's C++ backward launches, without autograd (a compiled graph's backward
    operator), or None where the caller should run the Python launchers."""
    plan = _plan(q, k, v, is_causal, launches_of)
    return None if plan is None else native_module()[0].backward(q, k, v, out, lse, grad_out, plan)
