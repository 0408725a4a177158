"""The C++ autograd node of the flash_triton backend (kernels/flash/host/node.py and csrc/flash_node.cpp).

On the CPU: the parameter packing against ctypes' own layout of the same C parameters and, for TMA descriptors,
against the launcher Triton generates; the errors for what the node cannot pass or launch, the setting, what
native_passes hands the node, and that the CPU path never takes the node. On a GPU: the node, once a layout's
passes have run, gives the Python Function's O, dQ, dK and dV bit for bit (the same binaries with the same
arguments; the Gluon backward's dQ, summed by atomic adds in no fixed order, within one rounding), with FA2's
kernels, Gluon's and the two paired, on awkward shapes and layouts, with frozen and tied inputs, a dO of another
layout, another stream, and no gradient at all; and compiled graphs' operators launch through the same plans, with
the same results.
"""

from __future__ import annotations

import ctypes
import functools
import re
import struct

import pytest
import torch

from cs336_systems.kernels.flash import api, dispatch, fa2
from cs336_systems.kernels.flash.host import launch, node
from cs336_systems.kernels.flash.host.node import DescriptorSlot, TensorSlot, pack_params
from cs336_systems.kernels.flash.settings import FlashSettings, flash_settings, set_flash_settings, use_flash_settings
from cs336_systems.model.attention import naive_attention
from tests.kernel_devices import INTERPRET
from tests import test_flash_plans
from tests.test_flash_plans import _inputs

# test_flash_plans' fixtures: its FA2 plans with pinned tiles, and its launch recorders
plans, recorded_launches = test_flash_plans.plans, test_flash_plans.recorded_launches

SIGNATURE = ["*bf16", "*fp32", "i32", "constexpr", "i64", "fp32", "i1", "*bf16", "u64", "constexpr", "i16", "fp64"]
VALUES = [TensorSlot(0), TensorSlot(4), -7, 64, 2**40 + 3, 0.1, True, TensorSlot(7), 2**63 + 5, "tile", 300, 1 / 3]


class _Expected(ctypes.Structure):
    """The same parameters as C fields (constexprs left out, two scratch pointers after): ctypes lays them out with
    the platform's natural alignment, independently of pack_params."""

    _fields_ = [("q", ctypes.c_uint64), ("lse", ctypes.c_uint64), ("a", ctypes.c_int32), ("b", ctypes.c_int64),
                ("scale", ctypes.c_float), ("flag", ctypes.c_int8), ("dq", ctypes.c_uint64), ("big", ctypes.c_uint64),
                ("short", ctypes.c_int16), ("third", ctypes.c_double), ("scratch", ctypes.c_uint64),
                ("profile", ctypes.c_uint64)]


def test_parameters_are_packed_as_c_lays_them_out():
    packed = pack_params(SIGNATURE, VALUES)
    expected = _Expected(0, 0, -7, 2**40 + 3, 0.1, 1, 0, 2**63 + 5, 300, 1 / 3, 0, 0)
    assert packed.offsets == [getattr(_Expected, name).offset for name, _ in _Expected._fields_]
    assert packed.params == bytes(expected)[:len(packed.params)]
    assert len(packed.params) == ctypes.sizeof(_Expected)  # no padding after the last 8-byte field
    assert packed.pointer_params == [0, 1, 6] and packed.pointer_slots == [0, 4, 7]
    # the float32 parameter holds 0.1 rounded to float32, as Triton's launcher packs it
    assert struct.unpack_from("=f", packed.params, packed.offsets[4])[0] == ctypes.c_float(0.1).value


# A Gluon kernel's signature as Triton 3.6 gives it (descriptors first, as flash_gluon's forward has them) and the
# descriptors' metadata its compiler records (the box it loads: 64 columns of a 128-wide row at a 128-byte swizzle).
DESCRIPTOR = "tensordesc<bf16[1, 1, 64, 128],NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)>"
GLUON_SIGNATURE = [DESCRIPTOR, DESCRIPTOR.replace("64, 128", "128, 128"), "*fp32", "*i32", "i32", "fp32", "constexpr"]
GLUON_META = [{"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [1, 1, 64, 64], "fp4_padded": False},
              {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [1, 1, 128, 64], "fp4_padded": False}]
C_TYPES = {"CUtensorMap": (128, 64), "CUdeviceptr": (8, 8), "int64_t": (8, 8), "uint64_t": (8, 8),
           "int32_t": (4, 4), "uint32_t": (4, 4), "int16_t": (2, 2), "int8_t": (1, 1), "double": (8, 8)}


def _triton_launch_parameters(signature, meta) -> list[str]:
    """The C types of the kernel parameters in the launcher Triton 3.6 generates for `signature` (its `_launch`
    declaration after the two scratch pointers), which is what pack_params must reproduce."""
    from triton.backends.nvidia.driver import make_launcher

    source = make_launcher({}, dict(enumerate(signature)), meta)
    declared = re.search(r"static void _launch\(([^)]*)\)", source).group(1)
    return [part.strip().rsplit(" ", 1)[0] for part in declared.split("profile_scratch,", 1)[1].split(",")]


def test_descriptors_are_packed_as_tritons_launcher_expands_them():
    q_desc = DescriptorSlot(0, (2, 4, 1000, 128), (512000, 128, 512, 1))
    k_desc = DescriptorSlot(1, (2, 4, 1300, 128), (665600, 128, 512, 1), "nan")
    schedule = torch.arange(5, dtype=torch.int32)
    packed = pack_params(GLUON_SIGNATURE, [q_desc, k_desc, TensorSlot(4), schedule, 7, 0.5, True], GLUON_META)
    types = _triton_launch_parameters(GLUON_SIGNATURE, GLUON_META) + ["CUdeviceptr", "CUdeviceptr"]  # + scratch
    expected, end = [], 0
    for c_type in types:
        size, align = C_TYPES[c_type]
        end += -end % align
        expected.append(end)
        end += size
    assert packed.offsets == expected and len(packed.params) == end
    # each descriptor's shape (i32) and strides (i64) follow its 128 bytes; the schedule goes by its address
    for first, desc in ((0, q_desc), (9, k_desc)):
        assert [struct.unpack_from("=i", packed.params, packed.offsets[first + 1 + i])[0] for i in range(4)] == list(
            desc.shape)
        assert [struct.unpack_from("=q", packed.params, packed.offsets[first + 5 + i])[0] for i in range(4)] == list(
            desc.strides)
    assert struct.unpack_from("=Q", packed.params, packed.offsets[19])[0] == schedule.data_ptr()
    assert packed.keep == [schedule] and packed.pointer_params == [18] and packed.pointer_slots == [4]
    # what cuTensorMapEncodeTiled gets, innermost first, as Triton's fill_tma_descriptor passes it
    q_map, k_map = packed.tensor_maps
    assert (q_map.param, q_map.slot, k_map.param, k_map.slot) == (0, 0, 9, 1)
    assert q_map.data_type == k_map.data_type == 9  # CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 (Triton's 10 on the device)
    assert q_map.dims == [128, 1000, 4, 2] and q_map.strides == [1024, 256, 1024000]  # bytes of bf16
    assert q_map.box == [64, 64, 1, 1] and k_map.box == [64, 128, 1, 1] and q_map.swizzle == 3
    assert (q_map.fill, k_map.fill) == (node.FILL_NONE, node.FILL_NAN)


@pytest.mark.parametrize("signature, values, message", [
    (["*bf16"], [3], "parameter 0 (*bf16) is a pointer"),
    (["*bf16"], [TensorSlot(12)], "TensorSlot of 0..11"),
    (["i32"], [TensorSlot(1)], "parameter 0 (i32) is a scalar, got a tensor (k)"),
    (["i32", "fp16"], [1, 0.5], "parameter 1 has type 'fp16'"),
    (["tensordesc<bf16[64, 64]>"], [None], "parameter 0 (tensordesc<bf16) is a TMA descriptor"),
    (["tensordesc<bf16[64, 64]>"], [DescriptorSlot(0, (64, 64), (64, 1))], "and no metadata entry"),
    (["i32"], [DescriptorSlot(0, (64, 64), (64, 1))], "parameter 0 (i32) is a scalar, got a tensor (q)"),
    (["bf16"], [1.0], "parameter 0 has type 'bf16'"),
    (["i32", "i32"], [1], "2 parameters but 1 values"),
])
def test_what_cannot_be_packed_is_named(signature, values, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        pack_params(signature, values)


class _Meta:
    num_ctas, launch_cooperative_grid, launch_pdl, global_scratch_size, profile_scratch_size = 1, False, False, 0, 0
    num_warps, shared = 4, 0


class _Source:
    signature = {"x": "*fp32"}


class _Compiled:
    name, function, src = "kernel", 1234, _Source()

    def __init__(self, **meta):
        self.metadata = _Meta()
        for field, value in meta.items():
            setattr(self.metadata, field, value)


def test_launch_problems_name_the_field():
    assert node.launch_problem(_Compiled()) is None
    assert "global_scratch_size=128" in node.launch_problem(_Compiled(global_scratch_size=128))
    assert "num_ctas=2" in node.launch_problem(_Compiled(num_ctas=2))
    assert "no metadata" in node.launch_problem(object())


def test_the_setting_reads_its_environment_variable():
    assert FlashSettings.from_env({"CS336_FLASH_NATIVE": "0"}).native is False
    assert FlashSettings.from_env({}).native is True
    with pytest.raises(ValueError, match="CS336_FLASH_NATIVE='yes'"):
        FlashSettings.from_env({"CS336_FLASH_NATIVE": "yes"})


def test_native_passes_name_the_tensors_each_binary_takes(recorded_launches):
    """What the node is built from, checked against the Python path's own launches (Triton's binaries replaced by
    recorders, as on a GPU): after a layout's forward and backward, `native_passes` gives each FA2 binary with the
    call's tensors it takes first, in the order the Python launchers pass them, its grid and the rest of its
    arguments; dO's strides; and D as the backward's one scratch buffer. None before a backward has run, or for
    settings no plan was made with."""
    settings = flash_settings()
    q, k, v, do = _inputs((2, 3, 20, 24), "cpu")
    out, lse = fa2.flash_forward_triton(q, k, v, True)
    assert dispatch.native_passes(q, k, v, True, settings) is None  # no backward yet
    fa2.flash_backward_triton(q, k, v, out, lse, do, True)
    passes = dispatch.native_passes(q, k, v, True, settings)
    assert passes.grad_layouts == (do.stride(),) and passes.dq_scale == 0.0
    assert passes.scratch == [("delta", tuple(lse.shape), lse.stride())]  # FA2's D: contiguous, L's shape
    assert recorded_launches == []  # the first calls took the public path
    out, lse = fa2.flash_forward_triton(q, k, v, True)  # plan hits: the recorders see every launch
    dq, dk, dv = fa2.flash_backward_triton(q, k, v, out, lse, do, True)
    named = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "grad_out": do, "dq": dq, "dk": dk, "dv": dv}
    delta = recorded_launches[1][1][6]  # the backward's own D, written by the dQ launch and read by the dK dV one
    named["delta"] = delta
    assert delta.shape == lse.shape and delta.dtype == torch.float32
    for call, (launched_grid, args) in zip([*passes.forward, *passes.backward[0][1]], recorded_launches, strict=True):
        assert call.grid == launched_grid
        names = [node.SLOTS[value.index] for value in call.values if isinstance(value, TensorSlot)]
        assert all(arg is named[name] for name, arg in zip(names, args)), names
        assert list(args[len(names):]) == list(call.values[len(names):])
    with use_flash_settings(float32_dot="ieee"):  # another float32 product: other binaries, other plans
        other = flash_settings()
        assert dispatch.native_passes(q, k, v, True, other) is None
        out, lse = fa2.flash_forward_triton(q, k, v, True)
        fa2.flash_backward_triton(q, k, v, out, lse, do, True)
        assert dispatch.native_passes(q, k, v, True, other) is not None
    assert dispatch.native_passes(q, k, v, True, settings) is None  # the plans of the old settings are replaced


def test_each_dense_do_layout_gets_its_own_backward_launches(recorded_launches):
    """Inputs in the model's layout: a backward with dO in O's layout, then one with a contiguous dO (as AOTAutograd
    hands a compiled region's backward), each plan their own binaries' launches, in that order; a dO of neither
    layout (copied by the node) and a repeated layout add none."""
    settings = flash_settings()
    q, k, v, do = _inputs((2, 3, 20, 24), "cpu", transposed=True)
    out, lse = fa2.flash_forward_triton(q, k, v, False)
    fa2.flash_backward_triton(q, k, v, out, lse, do, False)
    assert dispatch.native_passes(q, k, v, False, settings).grad_layouts == (out.stride(),)
    fa2.flash_backward_triton(q, k, v, out, lse, do.contiguous(), False)
    fa2.flash_backward_triton(q, k, v, out, lse, do.transpose(-1, -2).contiguous().transpose(-1, -2), False)
    fa2.flash_backward_triton(q, k, v, out, lse, do.clone(), False)  # O's layout again
    passes = dispatch.native_passes(q, k, v, False, settings)
    contiguous = do.contiguous().stride()
    assert out.stride() != contiguous and passes.grad_layouts == (out.stride(), contiguous)
    # each layout's launches pass that layout's strides: the dQ launch's values after its tensors hold dO's strides
    (_, (dq_o, _)), (_, (dq_contiguous, _)) = passes.backward
    n_tensors = len(fa2.BACKWARD_TENSORS[0])
    assert dq_o.values[n_tensors:] != dq_contiguous.values[n_tensors:]
    assert tuple(contiguous) == tuple(dq_contiguous.values[n_tensors + 12:n_tensors + 16])  # q's, k's, v's, dO's


def test_the_kernels_of_a_layout_are_chosen_once(monkeypatch):
    """A layout whose node stays pending (no backward ever runs) asks choose_passes at every call: the choice is
    remembered per layout and settings, and a new layout or other settings choose afresh."""
    asked = []
    monkeypatch.setattr(dispatch, "_PASS_CHOICES", {})
    real = dispatch.choose_forward
    monkeypatch.setattr(dispatch, "choose_forward", lambda *a, **kw: asked.append(a[0].shape) or real(*a, **kw))
    q = torch.randn(1, 2, 8, 16)
    settings = FlashSettings(forward="auto", backward="auto")
    for _ in range(3):
        assert dispatch.choose_passes(q, q, q, True, settings) == ("triton", "triton")  # the CPU: FA2
    assert len(asked) == 1
    dispatch.choose_passes(q[:, :1], q[:, :1], q[:, :1], True, settings)  # another layout
    dispatch.choose_passes(q, q, q, True, FlashSettings(forward="auto", backward="triton"))  # other settings
    dispatch.choose_passes(q, q, q, False, settings)  # not causal
    assert len(asked) == 4


def test_clearing_the_plan_cache_forgets_the_nodes_and_the_launchers_binaries():
    launch.PLANS.table("native_nodes")[("layout", False)] = node.Node(FlashSettings(), None, pending=True)
    fa2.LAUNCH["forward"].entries[("layout",)] = ("binary",)
    launch.PLANS.clear()
    assert not launch.PLANS.table("native_nodes") and not fa2.LAUNCH["forward"].entries


@pytest.mark.skipif(not INTERPRET, reason="the CPU path runs under the interpreter")
def test_cpu_calls_never_take_the_node():
    q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
    for _ in range(2):
        out = api.flash_attention_triton(q, k, v, True)
        out.sum().backward()
    assert "FlashNode" not in out.grad_fn.name()
    assert not launch.PLANS.table("native_nodes")


# ------------------------------------------------------------------------------------------------------------------
# on a GPU
# ------------------------------------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="launches CUDA kernels")


@pytest.fixture
def default_settings(monkeypatch):
    from cs336_systems.kernels.flash.settings import ENV_VARS

    for var in ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)
    set_flash_settings(None)
    yield
    set_flash_settings(None)


def _leaves(shape_q, shape_k, dtype, seed, model_layout=False, contiguous_grad=False):
    gen = torch.Generator().manual_seed(seed)

    def draw(shape):
        if model_layout:  # (batch, seq, heads, dim) viewed as (batch, heads, seq, dim)
            b, h, n, d = shape
            return torch.randn(b, n, h, d, generator=gen).to("cuda", dtype).transpose(1, 2)
        return torch.randn(*shape, generator=gen).to("cuda", dtype)

    q, k, v = (draw(shape).requires_grad_() for shape in (shape_q, shape_k, shape_k))
    # dO in O's layout, as the layers above hand it back, or contiguous (as flash_llm_shapes makes it)
    return q, k, v, draw(shape_q).contiguous() if contiguous_grad else draw(shape_q)


def _run(fn, q, k, v, do, causal):
    out = fn(q, k, v, causal)
    out.backward(do)
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    return out.detach(), grads, out.grad_fn.name()


def _warm(q, k, v, do, causal):
    """One forward+backward through the backend, which plans the layout; the next call takes the node."""
    _run(api.flash_attention_triton, q, k, v, do, causal)


CASES = [  # (q shape, k shape, dtype, causal, model layout, contiguous dO)
    ((2, 3, 100, 64), (2, 3, 100, 64), torch.bfloat16, True, False, False),
    ((1, 4, 77, 128), (1, 4, 130, 128), torch.float16, False, False, False),
    ((2, 4, 64, 64), (2, 4, 64, 64), torch.bfloat16, True, True, False),
    ((2, 4, 96, 128), (2, 4, 96, 128), torch.bfloat16, False, True, True),
    ((1, 2, 50, 32), (1, 2, 50, 32), torch.float32, True, False, False),
    ((3, 90, 64), (3, 90, 64), torch.bfloat16, False, False, False),
]


# The Gluon kernels (Hopper), forced for both passes or for one (flash_dispatch's settings), at lengths that are not
# tile multiples, rectangular, in the model's layout, 3-d, with a contiguous dO: (case as CASES, forward, backward)
GLUON_CASES = [
    (((2, 3, 300, 128), (2, 3, 300, 128), torch.bfloat16, True, False, False), "gluon", "gluon"),
    (((1, 4, 200, 64), (1, 4, 333, 64), torch.float16, False, True, True), "gluon", "gluon"),
    (((2, 4, 130, 128), (2, 4, 130, 128), torch.bfloat16, True, True, False), "gluon", "gluon"),
    (((3, 257, 64), (3, 257, 64), torch.bfloat16, True, False, False), "gluon", "gluon"),
    (((2, 2, 160, 64), (2, 2, 160, 64), torch.bfloat16, True, False, False), "gluon", "triton"),
    (((2, 2, 96, 128), (2, 2, 190, 128), torch.bfloat16, False, True, False), "triton", "gluon"),
]
ON_SM90 = torch.cuda.is_available() and not INTERPRET and torch.cuda.get_device_capability() == (9, 0)
sm90 = pytest.mark.skipif(not ON_SM90, reason="the Gluon kernels need an sm_90 GPU")


def _assert_the_node_gives_the_python_paths_results(shape_q, shape_k, dtype, causal, model_layout, contiguous_grad):
    layouts = dict(model_layout=model_layout, contiguous_grad=contiguous_grad)
    q, k, v, do = _leaves(shape_q, shape_k, dtype, seed=0, **layouts)
    _warm(q, k, v, do, causal)
    q, k, v, do = _leaves(shape_q, shape_k, dtype, seed=1, **layouts)  # fresh inputs, same layout
    out, grads, node = _run(api.flash_attention_triton, q, k, v, do, causal)
    assert "FlashNode" in node, f"the second call of the layout did not take the C++ node ({node})"
    _assert_python_paths_results(q, k, v, do, causal, out, grads)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape_q, shape_k, dtype, causal, model_layout, contiguous_grad", CASES)
def test_the_node_gives_the_python_paths_results(default_settings, shape_q, shape_k, dtype, causal, model_layout,
                                                 contiguous_grad):
    _assert_the_node_gives_the_python_paths_results(shape_q, shape_k, dtype, causal, model_layout, contiguous_grad)


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("case, forward, backward", GLUON_CASES)
def test_the_node_gives_the_python_paths_results_with_gluon(default_settings, case, forward, backward):
    """The Gluon launches through the node (TMA descriptors encoded in C++, the backward's scratch buffers and dQ's
    scale-and-cast): the Python path's results bit for bit, alone and paired with FA2's other pass."""
    with use_flash_settings(forward=forward, backward=backward):
        _assert_the_node_gives_the_python_paths_results(*case)
        q = torch.empty(case[0], device="cuda", dtype=case[2])
        chosen = dispatch.choose_passes(q, q, q, case[3], flash_settings())
        assert chosen == (forward, backward)


def _assert_same(got: torch.Tensor, want: torch.Tensor, summed: bool, name: str) -> None:
    """got equals want bit for bit, or, where it was `summed` by atomic float32 adds in an order that differs from
    run to run (the Gluon backward's dQ reduce-add), within one rounding of its dtype."""
    if summed:
        tolerance = torch.finfo(want.dtype).eps
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * want.abs().max().item(), msg=name)
    else:
        assert torch.equal(got, want), name


def _gluon_backward() -> bool:
    return flash_settings().backward == "gluon"


def _assert_python_paths_results(q, k, v, do, causal, out, grads):
    """O and the gradients equal the Python Function's bit for bit (values and strides; the Gluon backward's dQ
    within its atomic adds' order), and are near float64's."""
    want_out, want_grads, python = _run(api.FlashAttentionTriton.apply, q, k, v, do, causal)
    assert "FlashNode" not in python
    for name, got, want in zip(("O", "dQ", "dK", "dV"), (out, *grads), (want_out, *want_grads)):
        _assert_same(got, want, name == "dQ" and _gluon_backward(), name)
        assert got.stride() == want.stride(), name
    # and right: against float64 (the Python path's own tests bound its error more tightly)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out = naive_attention(*ref, causal)
    ref_out.backward(do.double())
    tolerance = 1e-4 if q.dtype == torch.float32 else 3e-2
    for name, got, want in zip(("O", "dQ", "dK", "dV"), (out, *grads), (ref_out, *(t.grad for t in ref))):
        torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=tolerance, msg=name)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape_q, shape_k, dtype, causal, model_layout, contiguous_grad, kernels", [
    (*CASES[0], "triton"), (*CASES[3], "triton"),
    pytest.param(*GLUON_CASES[2][0], "gluon", marks=sm90)])
def test_compiled_calls_launch_through_the_plan(default_settings, monkeypatch, shape_q, shape_k, dtype, causal,
                                                model_layout, contiguous_grad, kernels):
    if kernels == "gluon":
        set_flash_settings(FlashSettings(forward="gluon", backward="gluon"))
    taken = []  # (pass, whether the node launched it) for each operator call of the compiled graphs
    for name in ("forward", "backward"):
        for module, attribute, by_node in ((node, name, True), (dispatch, f"flash_{name}", False)):
            def spy(*args, _real=getattr(module, attribute), _name=name, _by_node=by_node):
                taken.append((_name, _by_node))
                return _real(*args)
            monkeypatch.setattr(module, attribute, spy)
    compiled = torch.compile(lambda q, k, v, c: api.flash_attention_triton(q, k, v, c), fullgraph=True)
    layouts = dict(model_layout=model_layout, contiguous_grad=contiguous_grad)
    _run(compiled, *_leaves(shape_q, shape_k, dtype, seed=4, **layouts), causal)  # plans the layout in Python
    q, k, v, do = _leaves(shape_q, shape_k, dtype, seed=5, **layouts)
    out, grads, _ = _run(compiled, q, k, v, do, causal)
    assert taken[-2:] == [("forward", True), ("backward", True)], taken
    _assert_python_paths_results(q, k, v, do, causal, out, grads)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, kernels", [(64, "triton"), pytest.param(128, "gluon", marks=sm90)])
def test_a_compiled_backwards_do_layout_gets_launches_of_its_own(default_settings, monkeypatch, head_dim, kernels):
    """Inputs in the model's layout, run eager first (the node's plan is made for dO in O's layout), then compiled
    with static shapes, where AOTAutograd hands the backward a dO of the layout it chose (contiguous, with torch 2.11
    on a GPU: cs336_systems/kernels/flash/DECISIONS.md). The first such backward runs the Python path, which
    plans that layout; from the next, the node's plan has launches for both layouts, the compiled backward goes
    through it with dO as it came (no copy of ours), and the results are the Python path's."""
    if kernels == "gluon":
        set_flash_settings(FlashSettings(forward="gluon", backward="gluon"))
    taken = []  # (whether the node launched it, dO's strides) for each backward operator call
    monkeypatch.setattr(node, "backward", functools.partial(_spied, node.backward, taken, True))
    monkeypatch.setattr(dispatch, "flash_backward", functools.partial(_spied, dispatch.flash_backward, taken, False))
    shape, causal = (2, 3, 150, head_dim), True  # a layout no other test plans (plans outlive a test)
    _warm(*_leaves(shape, shape, torch.bfloat16, seed=6, model_layout=True), causal)
    taken.clear()  # the eager warm-up's backward (the Python path, planning O's layout) is not a compiled call
    compiled = torch.compile(lambda q, k, v, c: api.flash_attention_triton(q, k, v, c), dynamic=False,
                             fullgraph=True)
    for seed in (7, 8, 9):
        q, k, v, do = _leaves(shape, shape, torch.bfloat16, seed=seed, model_layout=True)
        out, grads, _ = _run(compiled, q, k, v, do, causal)
    given = taken[-1][1]
    found = launch.PLANS.table("native_nodes")[(launch.layout(q, k, v), causal)]
    if given != tuple(out.stride()):  # a layout the eager calls did not plan: the first compiled backward plans it
        assert taken[0] == (False, given), taken
    assert taken[1:] == [(True, given)] * 2, taken
    assert given in found.grad_layouts and tuple(out.stride()) in found.grad_layouts, found
    _assert_python_paths_results(q, k, v, do, causal, out, grads)


def _spied(real, taken, by_node, *args):
    taken.append((by_node, tuple(args[5].stride())))
    return real(*args)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, kernels", [(64, "triton"), pytest.param(128, "gluon", marks=sm90)])
def test_cuda_graphs_replay_the_eager_results(default_settings, head_dim, kernels):
    """torch.compile(mode="reduce-overhead"): Inductor records both passes as CUDA graphs and replays them. Their
    first call runs with the allocations going to the graphs' private pool, so whatever a layout keeps across calls
    (the persistent Gluon forward's schedule) must be made outside it, or the recording fails; each call, on fresh
    inputs, must give the eager Function's results."""
    if kernels == "gluon":
        set_flash_settings(FlashSettings(forward="gluon", backward="gluon"))
    compiled = torch.compile(lambda q, k, v, c: api.flash_attention_triton(q, k, v, c),
                             mode="reduce-overhead", fullgraph=True)
    shape = (1, 3, 200, head_dim)  # a layout no other test plans: its first call is the graphs' warm-up
    for seed in range(3):  # warm-up, recording, replay
        q, k, v, do = _leaves(shape, shape, torch.bfloat16, seed=10 + seed, model_layout=True)
        out, grads, _ = _run(compiled, q, k, v, do, True)
        want_out, want_grads, _ = _run(api.FlashAttentionTriton.apply, q, k, v, do, True)
        for name, got, want in zip(("O", "dQ", "dK", "dV"), (out, *grads), (want_out, *want_grads)):
            _assert_same(got, want, name == "dQ" and _gluon_backward(), f"{name}, call {seed + 1}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["triton", pytest.param("gluon", marks=sm90)])
def test_frozen_tied_and_odd_gradients(default_settings, kernels):
    if kernels == "gluon":  # the Gluon backward reads dO by TMA: the expanded dO is copied before it
        set_flash_settings(FlashSettings(forward="gluon", backward="gluon"))
    shape = (2, 3, 100, 64)
    q, k, v, do = _leaves(shape, shape, torch.bfloat16, seed=2)
    _warm(q, k, v, do, True)
    backend, python = api.flash_attention_triton, api.FlashAttentionTriton.apply
    # a frozen input: no gradient for it, the others as the Python path's
    k.requires_grad_(False)
    got, want = _run(backend, q, k, v, do, True), _run(python, q, k, v, do, True)
    assert "FlashNode" in got[2] and got[1][1] is None and want[1][1] is None
    for name, a, b in zip(("O", "dQ", "dV"), (got[0], got[1][0], got[1][2]), (want[0], want[1][0], want[1][2])):
        _assert_same(a, b, name == "dQ" and _gluon_backward(), name)
    k.requires_grad_(True)
    # tied inputs (self-attention on one tensor): the three gradients summed into one
    x = torch.randn_like(q).requires_grad_()
    api.flash_attention_triton(x, x, x, True).backward(do)
    got_x, x.grad = x.grad, None
    python(x, x, x, True).backward(do)
    _assert_same(got_x, x.grad, _gluon_backward(), "tied")
    # a dO of another layout (the backward copies it into O's) and an expanded one (from .sum())
    for grad in (do.transpose(-1, -2).contiguous().transpose(-1, -2), None):
        results = []
        for fn in (backend, python):
            out = fn(q, k, v, True)
            out.backward(grad) if grad is not None else out.float().sum().backward()
            results.append([t.grad.clone() for t in (q, k, v)])
            q.grad = k.grad = v.grad = None
        for name, a, b in zip(("dQ", "dK", "dV"), *results):
            _assert_same(a, b, name == "dQ" and _gluon_backward(), name)


@gpu
@pytest.mark.gpu
def test_another_stream_and_no_gradient(default_settings):
    shape = (1, 4, 128, 128)
    q, k, v, do = _leaves(shape, shape, torch.bfloat16, seed=3)
    _warm(q, k, v, do, False)
    want_out, want_grads, _ = _run(api.FlashAttentionTriton.apply, q, k, v, do, False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out, grads, node = _run(api.flash_attention_triton, q, k, v, do, False)
    torch.cuda.current_stream().wait_stream(stream)
    assert "FlashNode" in node
    assert torch.equal(out, want_out) and all(torch.equal(a, b) for a, b in zip(grads, want_grads))
    with torch.no_grad():
        out = api.flash_attention_triton(q, k, v, False)
    assert out.grad_fn is None and torch.equal(out, want_out)
