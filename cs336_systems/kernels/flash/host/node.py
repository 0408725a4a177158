"""The `flash_triton` backend's C++ autograd node (csrc/flash_node.cpp), for calls bound by the host.

Why: at short calls a Python `autograd.Function` costs more than its kernels. The autograd engine runs the Python
backward on its device thread, where each Python line took 1.5-2.4x as long as on the calling thread; a C++ node
with the same allocations and launches costs about as much as a Python Function that launches nothing.

How: once a layout's forward and backward have run through the Python plans of the kernels the dispatch chooses
for it (FA2's plans, the Gluon forward's and backward's plans, in any pairing), those plans hold the binaries
Triton compiled for the layout and every argument Triton passes them (`dispatch.native_passes` gathers them as
`NativePasses`). `make_plan` turns each launch into a C++ `Launch`:
- the CUfunction Triton loaded, the grid, 32 x num_warps threads (all warps, the Gluon kernels' workers included),
  the shared memory;
- the parameters packed as Triton 3.6's launcher packs them (`pack_params`: the signature's parameters in order,
  constexprs left out, each as its C type, each TMA descriptor as a 128-byte CUtensorMap followed by its shape and
  strides, then the global and profile scratch pointers, null here);
- the pointer parameters named by tensor slot, written in at each launch, and the descriptors, encoded at each
  launch by cuTensorMapEncodeTiled for the slot's address with the geometry, box, swizzle and element type Triton
  would use (`TensorMapSpec`); a tensor the plan owns (the persistent forward's schedule) goes by its address.
From then on, calls of that layout run through the C++ node: it allocates O and L, and in the backward dQ, dK, dV
and the scratch buffers (FA2's D; Gluon's float32 dQ accumulator and its L and D rows), as the Python launchers do,
launches the same binaries with the same arguments and, after a Gluon backward, writes dQ as the accumulator times
the scale, as the Python path does. The results are the Python path's bit for bit, but for the Gluon backward's dQ,
whose atomic adds run in no fixed order on either path. The backward's binaries were made for the dO layouts of the
backwards that planned them (O's, or contiguous), one set of launches per layout; a dO of another layout is copied
into the first one's. A compiled graph's backward that brings a dense dO of a layout not yet planned (AOTAutograd
hands a contiguous dO to a region whose output is not) runs the Python path once, which plans it, and the layout's
C++ plan is then made again with it, so that no copy is left that is ours.

This module only keeps and launches nodes: api.py looks a call's node up (`find`), asks the dispatch for the passes
while the node is pending and hands them here (`settle`), then launches through `attention`, `forward` (a compiled
graph's forward operator) or `backward`.

Where the Python path still runs (same kernels): a layout's first calls, until its forward and a backward (with the
forward's O and L and a dO in O's layout or contiguous) have run once; kernels that need scratch memory (FA2's
forward with device-side TMA descriptors, from `tma_min_keys` keys); fast launch off or a Triton release the fast
path was not checked against (no binaries are kept then); the `native` setting off (CS336_FLASH_NATIVE=0); and where
the module cannot be built (no C++ compiler, ninja or CUDA headers: warned once). The node fixes both passes'
kernels when the forward runs (`dispatch.choose_passes`); Triton's launch hooks (Proton) do not see its launches
(torch.profiler does). Triton never unloads a module it loaded, so a plan that outlives its CompiledKernel (cleared
launchers, a backward still pending) still launches valid functions. See DECISIONS.md#host-path.
"""

from __future__ import annotations

import functools
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch

from cs336_systems.kernels.common import INTERPRET
from cs336_systems.kernels.flash.host.launch import PLANS, layout
from cs336_systems.kernels.flash.settings import FlashSettings, made_with

SOURCE = Path(__file__).parent / "csrc" / "flash_node.cpp"
# The call's tensors in the C++ node's slot order (flash_node.cpp's `Slot`): the inputs and outputs of both passes,
# then the Gluon backward's scratch buffers (delta is FA2's and Gluon's).
SLOTS = ("q", "k", "v", "out", "lse", "grad_out", "delta", "dq", "dk", "dv", "dq_acc", "lse2")
# How Triton 3.6's launcher passes each scalar parameter type (driver.py's ty_to_cpp and FLOAT_STORAGE_TYPE), as
# `struct` formats.
SCALAR_FORMATS = {"i1": "b", "i8": "b", "u1": "B", "u8": "B", "i16": "h", "u16": "H", "i32": "i", "u32": "I",
                  "i64": "q", "u64": "Q", "fp32": "f", "f32": "f", "fp64": "d"}
TENSOR_MAP_BYTES = 128  # sizeof(CUtensorMap), passed by value, 64-byte aligned
FILL_NONE, FILL_NAN = 0, 1  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE, ..._NAN_REQUEST_ZERO_FMA


class TensorSlot(NamedTuple):
    """A pointer parameter's value: the data pointer of the call's tensor `SLOTS[index]`."""

    index: int


class DescriptorSlot(NamedTuple):
    """A TMA descriptor parameter's value: a descriptor of the call's tensor `SLOTS[index]` (its data pointer is the
    descriptor's start) with the fixed geometry of Triton's host descriptor: `shape` and `strides` in elements,
    `padding` ("zero" or "nan")."""

    index: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    padding: str = "zero"


class TensorMapSpec(NamedTuple):
    """What the C++ TensorMap encodes at each launch for parameter `param` (an index into the offsets): everything
    cuTensorMapEncodeTiled takes but the address, in the driver's order (innermost first), as Triton 3.6's
    `fill_tma_descriptor` passes it."""

    param: int
    slot: int
    data_type: int
    dims: list[int]
    strides: list[int]  # bytes, one fewer than dims
    box: list[int]
    swizzle: int
    fill: int


@dataclass(frozen=True)
class PackedParams:
    """A kernel's parameters as the C++ `Launch` takes them: the bytes of all of them back to back, each naturally
    aligned at `offsets[i]`; which of them (`pointer_params`, indices into `offsets`) take which tensor's data
    pointer (`pointer_slots`); the TMA descriptors encoded at each launch (`tensor_maps`); and the tensors passed by
    a fixed address (`keep`), which must outlive the launches."""

    params: bytes
    offsets: list[int]
    pointer_params: list[int]
    pointer_slots: list[int]
    tensor_maps: list[TensorMapSpec] = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list)


def _tensor_map(param: int, value: DescriptorSlot, meta: dict) -> TensorMapSpec:
    """The TensorMap of a descriptor parameter, from the value's geometry and the kernel's `tensordesc_meta` entry
    (swizzle, element size and type, the box the kernel loads), as Triton 3.6's make_tensordesc_arg and
    fill_tma_descriptor build it."""
    # Triton's own map of its TMA element types to the driver's CUtensorMapDataType (they differ at 8, 9 and 10)
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    if meta.get("fp4_padded"):
        raise ValueError(f"parameter {param}: fp4-padded descriptors are not passed by the C++ node")
    shape, strides, box = list(value.shape), list(value.strides), list(meta["block_size"])
    if not (len(shape) == len(strides) == len(box)) or strides[-1] != 1:
        raise ValueError(f"parameter {param}: descriptor shape {shape}, strides {strides} and box {box} must have one "
                         "length and a unit last stride")
    return TensorMapSpec(param, value.index, TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], shape[::-1],
                         [meta["elem_size"] * s for s in strides[-2::-1]], box[::-1], meta["swizzle"],
                         FILL_NAN if value.padding == "nan" else FILL_NONE)


def pack_params(types: Sequence, values: Sequence, tensordesc_meta: Sequence[dict] = ()) -> PackedParams:
    """The parameters of a kernel with signature `types` (Triton's: "*bf16", "i32", "fp32", "constexpr",
    "tensordesc<...>", ...) called with `values`: for each pointer a TensorSlot, or a tensor passed by its fixed
    address; for each descriptor a DescriptorSlot, with the kernel's `tensordesc_meta` entries in order. Laid out as
    Triton 3.6's launcher passes them: constexprs left out; each descriptor as a 128-byte CUtensorMap (64-byte
    aligned), then its shape as i32 and its strides as i64; each other one as its C type; then two null pointers (the
    global and profile scratch memory, which the node's kernels must not need). A ValueError names a parameter the
    node cannot pass."""
    if len(types) != len(values):
        raise ValueError(f"the signature has {len(types)} parameters but {len(values)} values were given")
    data, offsets, pointer_params, pointer_slots, tensor_maps, keep = bytearray(), [], [], [], [], []
    metas = iter(tensordesc_meta)

    def put(fmt: str, value, align: int | None = None) -> None:
        size = struct.calcsize("=" + fmt)
        data.extend(bytes(-len(data) % (align or size)))  # natural alignment
        offsets.append(len(data))
        data.extend(struct.pack("=" + fmt, value))

    for position, (kind, value) in enumerate(zip(types, values)):
        if kind == "constexpr":
            continue
        if isinstance(kind, str) and kind.startswith("tensordesc"):
            meta = next(metas, None)
            if not isinstance(value, DescriptorSlot) or not 0 <= value.index < len(SLOTS) or meta is None:
                raise ValueError(f"parameter {position} ({kind.split('[')[0]}) is a TMA descriptor, so its value must "
                                 f"be a DescriptorSlot of 0..{len(SLOTS) - 1} with the kernel's descriptor metadata, "
                                 f"got {value!r}" + ("" if meta else " and no metadata entry"))
            put(f"{TENSOR_MAP_BYTES}s", bytes(TENSOR_MAP_BYTES), align=64)
            tensor_maps.append(_tensor_map(len(offsets) - 1, value, meta))
            for size in value.shape:
                put("i", size)
            for stride in value.strides:
                put("q", stride)
        elif isinstance(kind, str) and kind.startswith("*"):
            if isinstance(value, torch.Tensor):  # a tensor of the plan's own (a schedule): its fixed address
                keep.append(value)
                put("Q", value.data_ptr())
                continue
            if not isinstance(value, TensorSlot) or not 0 <= value.index < len(SLOTS):
                raise ValueError(f"parameter {position} ({kind}) is a pointer, so its value must be a TensorSlot of "
                                 f"0..{len(SLOTS) - 1} or a tensor, got {value!r}")
            pointer_params.append(len(offsets))
            pointer_slots.append(value.index)
            put("Q", 0)
        elif kind in SCALAR_FORMATS:
            if isinstance(value, (TensorSlot, DescriptorSlot)):
                raise ValueError(f"parameter {position} ({kind}) is a scalar, got a tensor ({SLOTS[value.index]})")
            put(SCALAR_FORMATS[kind], value)
        else:
            raise ValueError(f"parameter {position} has type {kind!r}, which the C++ node does not pass")
    if next(metas, None) is not None:
        raise ValueError(f"{len(tensordesc_meta)} descriptor metadata entries, more than the descriptor parameters")
    put("Q", 0)  # global scratch
    put("Q", 0)  # profile scratch
    return PackedParams(bytes(data), offsets, pointer_params, pointer_slots, tensor_maps, keep)


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
        return None, f"{SOURCE.name} numbers the tensors {tuple(module.SLOTS)}, node.py {SLOTS}"
    return module, None


def launch_problem(compiled) -> str | None:
    """Why the node cannot launch `compiled` (Triton's CompiledKernel) as Triton's launcher would, or None."""
    meta = getattr(compiled, "metadata", None)
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if meta is None or not isinstance(signature, dict) or not getattr(compiled, "function", None):
        return f"{type(compiled).__name__} has no metadata, signature or loaded function"
    for name, wanted in (("num_ctas", 1), ("launch_cooperative_grid", False), ("launch_pdl", False),
                         ("global_scratch_size", 0), ("profile_scratch_size", 0)):
        if getattr(meta, name, wanted) != wanted:
            return f"{compiled.name}: {name}={getattr(meta, name)!r} (the node launches only {name}={wanted!r})"
    return None


class KernelCall(NamedTuple):
    """One launch of a layout's plan: Triton's CompiledKernel `compiled` on the 3-d `grid`, with `values` for its
    signature's parameters in order (TensorSlot, DescriptorSlot, a tensor of the plan's own, scalars, constexprs)."""

    compiled: object
    grid: tuple[int, int, int]
    values: tuple


@dataclass(frozen=True)
class NativePasses:
    """What the node of one layout launches, from the Python plans of its kernels: the forward's launches in order;
    the backward's, as (the strides of the dO its binaries were made for, the launches in order) for each dO layout
    planned, the first planned first (a dO of no planned layout is copied into the first's); the backward's float32
    scratch buffers, as (slot name, sizes, strides), the same for every dO layout; and, where not 0, the scale by
    which dQ is made from the float32 accumulator `dq_acc` after the launches (the Gluon backward)."""

    forward: list[KernelCall]
    backward: list[tuple[tuple[int, ...], list[KernelCall]]]
    scratch: list[tuple[str, tuple[int, ...], tuple[int, ...]]]
    dq_scale: float = 0.0

    @property
    def grad_layouts(self) -> tuple[tuple[int, ...], ...]:
        """The dO strides the backward takes without a copy."""
        return tuple(strides for strides, _ in self.backward)


def slots(*names: str) -> list[TensorSlot]:
    """TensorSlots of the call's tensors `names` (SLOTS names)."""
    return [TensorSlot(SLOTS.index(name)) for name in names]


def make_launch(module: ModuleType, call: KernelCall):
    """(the C++ Launch of `call`, the tensors it reads by fixed address)."""
    problem = launch_problem(call.compiled)
    if problem:
        raise ValueError(problem)
    meta = call.compiled.metadata
    packed = pack_params(list(call.compiled.src.signature.values()), call.values,
                         getattr(meta, "tensordesc_meta", None) or ())
    tensor_maps = [module.TensorMap(*spec) for spec in packed.tensor_maps]
    return module.Launch(function=call.compiled.function, grid=list(call.grid), threads=32 * meta.num_warps,
                         shared_bytes=meta.shared, params=packed.params, offsets=packed.offsets,
                         pointer_params=packed.pointer_params, pointer_slots=packed.pointer_slots,
                         tensor_maps=tensor_maps), packed.keep


def make_plan(module: ModuleType, passes: NativePasses):
    """The C++ Plan of a layout's NativePasses."""
    keep = []

    def launches(calls: list[KernelCall]) -> list:
        made = []
        for call in calls:
            launch, kept = make_launch(module, call)
            made.append(launch)
            keep.extend(kept)
        return made

    forward = launches(passes.forward)
    backward = [launches(calls) for _, calls in passes.backward]
    scratch = [module.Scratch(SLOTS.index(name), list(sizes), list(strides)) for name, sizes, strides in passes.scratch]
    return module.Plan(forward=forward, backward=backward, grad_strides=[list(s) for s in passes.grad_layouts],
                       scratch=scratch, dq_scale=float(passes.dq_scale), keep=keep)


@dataclass
class Node:
    """What the node knows of one (layout, causal) key: the settings it was decided with, the C++ plan (None: the
    Python Function runs), whether the Python plans are still awaited (`pending`), the dO strides the plan's
    backward takes without a copy, and the dO strides a compiled backward has been sent to the Python path to plan
    (`tried`: once each)."""

    settings: FlashSettings
    plan: object | None
    pending: bool
    grad_layouts: tuple[tuple[int, ...], ...] = ()
    tried: set[tuple[int, ...]] = field(default_factory=set)


# The nodes by (the inputs' layout, is_causal); cleared with every plan (new FA2 tiles drop the binaries they launch)
_NODES = PLANS.table("native_nodes")
_warned: set[str] = set()


def find(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, settings: FlashSettings
         ) -> tuple[tuple, Node | None] | None:
    """(the key of this call's node, its node if made with `settings`, else None), or None where the node is off for
    this call (the `native` setting off, the interpreter, CPU tensors). A node that is None or `pending` must be
    settled (`settle`) before use."""
    if not settings.native or INTERPRET or not q.is_cuda:
        return None
    key = (layout(q, k, v), is_causal)
    node = _NODES.get(key)
    return key, (node if made_with(node, settings) else None)


def python_path(key: tuple, settings: FlashSettings) -> Node:
    """Settle `key` on the Python Function for good (fast launch off: no binaries are kept)."""
    node = _NODES[key] = Node(settings, None, pending=False)
    return node


def settle(key: tuple, settings: FlashSettings, node: Node | None, passes: NativePasses | None) -> Node:
    """The node of `key` now, from `passes` (the dispatch's NativePasses of its layout; None: its Python plans have
    not all run yet, so it stays pending): a C++ plan, or the Python Function for good where the module cannot be
    built or a launch cannot be made (warned once)."""
    tried = node.tried if node is not None else set()  # kept when the plan is made again
    if passes is None:
        node = _NODES[key] = Node(settings, None, True, tried=tried)
        return node
    module, problem = native_module()
    if module is not None:
        try:
            node = _NODES[key] = Node(settings, make_plan(module, passes), False, passes.grad_layouts, tried)
            return node
        except ValueError as error:
            problem = str(error)
    if problem not in _warned:
        _warned.add(problem)
        warnings.warn(f"flash node: {problem}; the Python autograd Function runs instead (CS336_FLASH_NATIVE=0 "
                      "turns the C++ node off)", RuntimeWarning, stacklevel=3)
    return python_path(key, settings)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan) -> torch.Tensor:
    """O through the C++ node's `plan` (its gradients come from the node's C++ backward)."""
    return native_module()[0].flash_attention(q, k, v, plan)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L) through the plan's C++ forward launches, without autograd (a compiled graph's forward operator)."""
    return native_module()[0].forward(q, k, v, plan)


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
             grad_out: torch.Tensor, plan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) through the plan's C++ backward launches, without autograd (a compiled graph's backward
    operator)."""
    return native_module()[0].backward(q, k, v, out, lse, grad_out, plan)


def dense_grad(out: torch.Tensor, grad_out: torch.Tensor) -> bool:
    """Whether dO is of a layout the Python backwards plan launches for the node: dense (in O's layout, as the
    layers above hand it back, or contiguous, as AOTAutograd may) and 16-byte aligned."""
    return (grad_out.stride() == out.stride() or grad_out.is_contiguous()) and grad_out.data_ptr() % 16 == 0


def plans_grad_layout(node: Node, out: torch.Tensor, grad_out: torch.Tensor) -> bool:
    """Whether this backward goes to the Python path to plan its dO's layout: the first dO of a layout that the
    node's plan has no launches for, where the Python backward plans it (dense: in O's layout or contiguous; 16-byte
    aligned), rather than copying every later dO into the plan's first layout. The node then asks for the passes
    again at its next call, with that layout's among them."""
    strides = tuple(grad_out.stride())
    if strides in node.grad_layouts or strides in node.tried or not dense_grad(out, grad_out):
        return False
    node.tried.add(strides)
    node.pending = True
    return True
