"""What the Gluon forward (gluon_fwd.py) and backward (gluon_bwd.py) share: the layouts they take, their TMA
descriptors, the ring helpers of their partitions, and per-layout plans of their launches.

A call's plan keeps what its first call derived (the TensorDescriptors' geometry, the launch arguments, the
FastLauncher's binary): building a call's TensorDescriptors (Triton's dataclass validates each), its launch
arguments and its FastLauncher key took ~700 Python calls per Gluon forward+backward, enough to make the host the
bottleneck where the kernels are as fast as cuDNN's. A plan hit checks nothing (the first call of the layout did,
and a layout key covers all it checked), builds no TensorDescriptor and calls the binary. The plans live in
`host.launch.PLANS`. See DECISIONS.md#host-path.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from cs336_systems.kernels.common import check_inputs, cuda_capability
from cs336_systems.kernels.flash.host import node
from cs336_systems.kernels.flash.host.launch import PLANS, FastLauncher, contiguous_strides, launch_key, layout

LOG2E = 1.4426950408889634
CONSUMERS = 2  # consumer warpgroups per program (both kernels' partitions are written for two)
DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
HEAD_DIMS = (64, 128)  # the head dims both kernels have tiles for


def as_4d(t: torch.Tensor) -> torch.Tensor:
    """(batch, n, d) as (batch, 1, n, d): the kernels' descriptors are (batch, head, row, col)."""
    return t.unsqueeze(1) if t.dim() == 3 else t


# ----------------------------------------------------------------------------------------------
# what the kernels take
# ----------------------------------------------------------------------------------------------
# layout_problem's answers by the inputs' layout (what it reads of them), so that "auto" asks once per layout
_LAYOUT_ANSWERS = PLANS.table("gluon_layout_problems")


def layout_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """What in these inputs' shapes, dtypes and strides the kernel does not take, or None. No device check. A
    function of the inputs' `layout` alone, remembered per layout (at most 4096)."""
    key = layout(q, k, v)
    answer = _LAYOUT_ANSWERS.get(key, False)
    if answer is False:
        if len(_LAYOUT_ANSWERS) >= 4096:
            _LAYOUT_ANSWERS.clear()
        answer = _LAYOUT_ANSWERS[key] = _find_layout_problem(q, k, v)
    return answer


def _find_layout_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    try:
        check_inputs(q, k, v, "flash_gluon")
    except ValueError as error:
        return str(error)
    if q.dtype not in DTYPES:
        return f"flash_gluon: dtype {q.dtype} is not supported (bfloat16, float16)"
    if q.shape[-1] not in HEAD_DIMS:
        return f"flash_gluon: head dim {q.shape[-1]} is not supported ({', '.join(map(str, HEAD_DIMS))})"
    for name, t in (("q", q), ("k", k), ("v", v)):
        # TMA's rules: unit stride along the head dim, every other stride and the start 16-byte aligned
        if t.stride(-1) != 1:
            return f"flash_gluon: {name} must have unit stride along the head dim, got strides {t.stride()}"
        if any(s * t.element_size() % 16 for s in t.stride()[:-1]) or t.data_ptr() % 16:
            return (f"flash_gluon: {name}'s strides {t.stride()} (elements of {t.element_size()} B) and start must "
                    "be 16-byte aligned for TMA")
    return None


def device_problem(q: torch.Tensor) -> str | None:
    """Whether q's device can run the kernel: a CUDA device of compute capability 9.0 (H100, H200)."""
    if not q.is_cuda:
        return f"flash_gluon: needs CUDA tensors, got device {q.device}"
    capability = cuda_capability(q.get_device())
    if capability != (9, 0):
        return f"flash_gluon: needs compute capability 9.0 (sm_90: wgmma, setmaxnreg), got {capability[0]}.{capability[1]}"
    return None


def tma_problem(name: str, t: torch.Tensor) -> str | None:
    """Why TMA cannot read or write `t` (the backward's name for it: `name`) in its own layout, or None."""
    if t.stride(-1) != 1 or any(s == 0 or s * t.element_size() % 16 for s in t.stride()[:-1]) or t.data_ptr() % 16:
        return f"flash_gluon_bwd: {name} (strides {t.stride()}) is not a TMA layout"
    return None



# ----------------------------------------------------------------------------------------------
# TMA descriptors and the ring helpers of the partitions
# ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def shared_layout(block: tuple[int, ...], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a (block, dtype) box: a pure function of both (a frozen dataclass, shared by
    every descriptor of that box), whose computation cost ~5 us per descriptor, ten descriptors a forward and
    backward."""
    return gl.NVMMASharedLayout.get_default_for(list(block), DTYPES[dtype])


def descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A (batch, head, row, col) TMA descriptor with t's strides, loading (1, 1, rows, d) boxes."""
    block = [1, 1, rows, t.shape[-1]]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, shared_layout(tuple(block), t.dtype))


@functools.lru_cache(maxsize=None)
def float32_layout(block: tuple[int, ...]) -> gl.NVMMASharedLayout:
    """The shared layout of a float32 box: pure, so computed once per box (as shared_layout)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.float32)


def float32_descriptor(t: torch.Tensor, block: list[int], layout: gl.NVMMASharedLayout | None = None):
    """A TMA descriptor of a float32 tensor with t's strides: the dQ accumulator (batch, head, row, col) in
    (1, 1, block_m, d / 2) boxes, the preprocessed rows (batch·head, padded query) in (1, block_m) boxes
    (unswizzled: one row)."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout or float32_layout(tuple(block)))


def descriptor_launch_key(args: tuple, kwargs: dict) -> tuple:
    """FastLauncher's layout key of a call whose arguments include TMA descriptors (both Gluon kernels'): of each descriptor what the kernel is specialised on or reads from it (its base
    tensor's layout, the box and its shared layout), of the other arguments what `launch_key` takes."""
    descriptors = tuple([(i, d.base.shape, d.base.stride(), d.base.dtype, d.base.data_ptr() % 16,
                          d.base.get_device(), tuple(d.block_shape), d.layout, d.padding)
                         for i, d in enumerate(args) if isinstance(d, TensorDescriptor)])
    return descriptors, launch_key(tuple([a for a in args if not isinstance(a, TensorDescriptor)]), kwargs)


@gluon.jit
def as_2d(ring, i):
    """Slot i of a ring of (1, 1, rows, d) TMA boxes as the (rows, d) matrix the wgmma reads."""
    box = ring.index(i)
    return box.reshape([box.shape[2], box.shape[3]])


@gluon.jit
def next_slot(idx, phase, NUM: gl.constexpr):
    """The ring slot after idx and its barrier parity (which flips each time the ring wraps)."""
    idx += 1
    if idx == NUM:
        idx = 0
        phase ^= 1
    return idx, phase


# ----------------------------------------------------------------------------------------------
# per-layout plans of the launches
# ----------------------------------------------------------------------------------------------
class HostDescriptor:
    """A TMA descriptor argument as Triton 3.6's launcher reads one (`base`, `shape`, `strides`, `padding`:
    `driver.make_tensordesc_arg` encodes the CUtensorMap from them at each launch), without `TensorDescriptor`'s
    checks: made only by a plan hit, whose first call built and checked a real TensorDescriptor of the same geometry.
    Reading these attributes is Triton-internal; FastLauncher's CHECKED_TRITON_VERSIONS guards it, as it guards
    every plan (no bound binary, no plan)."""

    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, base: torch.Tensor, shape: list[int], strides: list[int], padding: str):
        self.base, self.shape, self.strides, self.padding = base, shape, strides, padding


class DescriptorPlan:
    """One Gluon launch of a fixed call layout: the FastLauncher's binary (`run`), each leading TensorDescriptor
    argument's geometry (shape, strides, padding) and the arguments after the per-call ones, with the values Triton
    filled in (`rest`); and Triton's CompiledKernel with its grid, for the C++ node's launches.
    `launch(bases, *per_call)` launches with descriptors of `bases` (tensors whose data_ptr is the descriptor's start;
    their views' shapes do not matter) and `per_call` (fresh tensors that follow them)."""

    __slots__ = ("run", "geometry", "rest", "compiled", "grid")

    def __init__(self, run, geometry: tuple, rest: tuple, compiled, grid: tuple[int, int, int]):
        self.run, self.geometry, self.rest, self.compiled, self.grid = run, geometry, rest, compiled, grid

    @classmethod
    def after(cls, launcher: FastLauncher, grid: tuple, args: tuple, options: dict, per_call: int
              ) -> DescriptorPlan | None:
        """The plan of a call that `launcher` has just run (`args`: its TensorDescriptors first, then `per_call`
        per-call arguments, then the rest); None where the launcher keeps no binary (fast launch off, an unchecked
        Triton release, the interpreter)."""
        bound = launcher.bound(grid, args, options)
        if bound is None:
            return None
        n = next(i for i, a in enumerate(args) if not isinstance(a, TensorDescriptor))
        geometry = tuple([(d.shape, d.strides, d.padding) for d in args[:n]])
        return cls(bound[0], geometry, (*args[n + per_call:], *bound[1]), bound[2], bound[3])

    def launch(self, bases: Sequence[torch.Tensor], *per_call) -> None:
        self.run(*[HostDescriptor(base, *geometry) for base, geometry in zip(bases, self.geometry)], *per_call,
                 *self.rest)

    def native_call(self, bases: Sequence[str], per_call: Sequence[str] = ()) -> node.KernelCall:
        """This launch for the C++ node's plan: descriptors of the call's tensors `bases` and then the tensors
        `per_call` (node.SLOTS names), followed by the rest."""
        descriptors = [node.DescriptorSlot(node.SLOTS.index(name), tuple(shape), tuple(strides), padding)
                       for name, (shape, strides, padding) in zip(bases, self.geometry, strict=True)]
        return node.KernelCall(self.compiled, self.grid, (*descriptors, *node.slots(*per_call), *self.rest))


def dq_accumulator(dq4: torch.Tensor) -> torch.Tensor:
    """The float32 dQ accumulator, uninitialised (the preprocessing kernel zeroes it), with dQ's strides (q's
    layout, a model's (batch, seq, heads, dim) view included): the final scale-and-cast into dQ is then one
    vectorised pass over matching strides (a contiguous accumulator under a model-layout dQ made it ATen's strided
    elementwise kernel, at about half the bandwidth). The TMA descriptor takes the accumulator's own strides."""
    return torch.empty_like(dq4, dtype=torch.float32)


class BackwardPlan:
    """The Gluon backward's launches for one call layout: whether dO is copied for TMA, the preprocessed rows' shape, the
    preprocess binary with its arguments after the six tensors (and Triton's CompiledKernel with its grid), the main
    kernel's DescriptorPlan and the scale. (The dQ accumulator follows q's layout, which the plan's key fixes.)"""

    __slots__ = ("copy_do", "rows_shape", "preprocess", "main", "scale")

    def __init__(self, copy_do: bool, rows_shape, preprocess: tuple, main: DescriptorPlan, scale: float):
        self.copy_do, self.rows_shape, self.preprocess = copy_do, rows_shape, preprocess
        self.main, self.scale = main, scale

    def run(self, q, k, v, o, do, lse):
        if self.copy_do:
            do = do.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dq4 = as_4d(dq)
        dq_acc = dq_accumulator(dq4)
        lse2 = torch.empty(self.rows_shape, dtype=torch.float32, device=q.device)
        delta = torch.empty_like(lse2)
        run, rest = self.preprocess[:2]
        run(o, do, lse, lse2, delta, dq_acc, *rest)
        self.main.launch((q, k, v, do, dk, dv, dq_acc, lse2, delta))
        torch.mul(dq_acc, self.scale, out=dq4)
        return dq, dk, dv

    def native(self, dq_strides: tuple[int, ...], q_shape: tuple[int, ...]
               ) -> tuple[list[node.KernelCall], list, float]:
        """These launches for the C++ node's plan: (the two launches, the scratch buffers, dQ's scale). The float32
        accumulator takes q's shape and dQ's strides (`dq_accumulator`: the 4-d view the kernels were planned with
        has the same memory layout)."""
        _, rest, compiled, grid = self.preprocess
        preprocess = node.KernelCall(compiled, grid, (*node.slots("out", "grad_out", "lse", "lse2", "delta",
                                                                  "dq_acc"), *rest))
        main = self.main.native_call(("q", "k", "v", "grad_out", "dk", "dv", "dq_acc", "lse2", "delta"))
        rows = (tuple(self.rows_shape), contiguous_strides(self.rows_shape))
        scratch = [("dq_acc", tuple(q_shape), tuple(dq_strides)), ("lse2", *rows), ("delta", *rows)]
        return [preprocess, main], scratch, self.scale


# ----------------------------------------------------------------------------------------------
# TMA reduce-add (the backward's dQ): Triton 3.6 has the op (the builder's create_async_tma_reduce, used by its own Blackwell kernels
# and lowered for sm_90 as cp.reduce.async.bulk.tensor) but no public Gluon call. Kept here, alone.
# ----------------------------------------------------------------------------------------------
def tma_reduce_problem() -> str | None:
    """Why this Triton cannot build the TMA reduce-add, or None."""
    from triton._C.libtriton import gluon_ir, ir

    if not hasattr(gluon_ir.GluonOpBuilder, "create_async_tma_reduce") or not hasattr(ir, "DESCRIPTOR_REDUCE_KIND"):
        return (f"flash_gluon_bwd: TMA reduce-add uses Triton 3.6's private GluonOpBuilder.create_async_tma_reduce, "
                f"which Triton {triton.__version__} does not have; port tma_reduce_add to this version's public "
                "call if it has one")
    return None


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """global[coord box] += src (a shared-memory tile), asynchronously; complete with tma.store_wait."""
    problem = tma_reduce_problem()
    if problem:
        raise RuntimeError(problem)
    from triton._C.libtriton import ir

    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


# ----------------------------------------------------------------------------------------------
# the EXACT check (tests only): P = S mod 8 in place of the softmax, every value an exact integer
# ----------------------------------------------------------------------------------------------
def exact_inputs(shape_q, shape_k, device, generator=None, dtype=torch.bfloat16):
    """q, k, v, do for an EXACT check: q, k in {-1, 0, 1}; v, do sparse in {-1, 0, 1}, so that dP and dS = P dP
    stay small integers (a 16-bit float holds every integer up to 256 exactly)."""
    def draw(shape, density):
        values = torch.randint(-1, 2, shape, device=device, generator=generator)
        return (values * (torch.rand(shape, device=device, generator=generator) < density)).to(dtype)

    return draw(shape_q, 1.0), draw(shape_k, 1.0), draw(shape_k, 0.25), draw(shape_q, 0.25)


def exact_reference(q, k, v, do, causal: bool):
    """float64 dQ, dK, dV of the EXACT kernel (the plain-PyTorch reference its test compares against bit for bit,
    after rounding to q's dtype): P = S mod 8 with S = Q K^T (0 where causal hides a key), dS = P * dP, dP = dO V^T
    (D = 0 as O = 0, scale 1). Raises ValueError if some dS is not exact in q's dtype (draw other inputs)."""
    from cs336_systems.model.attention import causal_mask

    s = q.double() @ k.double().transpose(-1, -2)
    p = s - torch.floor(s / 8) * 8
    if causal:
        p = p.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), 0.0)
    ds = p * (do.double() @ v.double().transpose(-1, -2))
    if not torch.equal(ds.to(q.dtype).double(), ds):
        raise ValueError(f"exact_reference: |dS| up to {ds.abs().max().item():.0f} is not exact in {q.dtype}")
    return ds @ k.double(), ds.transpose(-1, -2) @ q.double(), p.transpose(-1, -2) @ do.double()
