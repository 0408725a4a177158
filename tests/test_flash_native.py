"""The C++ autograd node of the flash_triton backend (kernels/flash_native.py, kernels/csrc/flash_node.cpp).

On the CPU: the parameter packing against ctypes' own layout of the same C parameters, the errors for what the node
cannot pass or launch, the setting, and that the CPU path never takes the node. On a GPU: the node, once a layout's
FA2 passes have run, gives the Python Function's O, dQ, dK and dV bit for bit (the same binaries with the same
arguments), on awkward shapes and layouts, with frozen and tied inputs, a dO of another layout, another stream, and
no gradient at all; and compiled graphs' operators launch through the same plans, with the same results.
"""

from __future__ import annotations

import ctypes
import re
import struct

import pytest
import torch

from cs336_systems.kernels import flash_native, flash_triton
from cs336_systems.kernels.flash_native import TensorSlot, pack_params
from cs336_systems.kernels.settings import FlashSettings, flash_settings, set_flash_settings, use_flash_settings
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


@pytest.mark.parametrize("signature, values, message", [
    (["*bf16"], [3], "parameter 0 (*bf16) is a pointer"),
    (["*bf16"], [TensorSlot(10)], "TensorSlot of 0..9"),
    (["i32"], [TensorSlot(1)], "parameter 0 (i32) is a scalar, got a tensor (k)"),
    (["i32", "fp16"], [1, 0.5], "parameter 1 has type 'fp16'"),
    (["tensordesc<bf16[64, 64]>"], [None], "which the C++ node does not pass"),
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
    assert flash_native.launch_problem(_Compiled()) is None
    assert "global_scratch_size=128" in flash_native.launch_problem(_Compiled(global_scratch_size=128))
    assert "num_ctas=2" in flash_native.launch_problem(_Compiled(num_ctas=2))
    assert "no metadata" in flash_native.launch_problem(object())


def test_the_setting_reads_its_environment_variable():
    assert FlashSettings.from_env({"CS336_FLASH_NATIVE": "0"}).native is False
    assert FlashSettings.from_env({}).native is True
    with pytest.raises(ValueError, match="CS336_FLASH_NATIVE='yes'"):
        FlashSettings.from_env({"CS336_FLASH_NATIVE": "yes"})


def test_fa2_launches_name_the_tensors_each_binary_takes(recorded_launches):
    """What the node is built from, checked against the Python path's own launches (Triton's binaries replaced by
    recorders, as on a GPU): after a layout's forward and backward, `fa2_launches` gives each binary with the names
    of the tensors it takes first, in the order the Python launchers pass them, its grid and the rest of its
    arguments, and dO's strides; None before a backward has run, or for settings no plan was made with."""
    settings = flash_settings()
    q, k, v, do = _inputs((2, 3, 20, 24), "cpu")
    out, lse = flash_triton.flash_forward_triton(q, k, v, True)
    assert flash_triton.fa2_launches(q, k, v, True, settings) is None  # no backward yet
    flash_triton.flash_backward_triton(q, k, v, out, lse, do, True)
    forward, backward, grad_strides = flash_triton.fa2_launches(q, k, v, True, settings)
    assert grad_strides == do.stride()
    assert recorded_launches == []  # the first calls took the public path
    out, lse = flash_triton.flash_forward_triton(q, k, v, True)  # plan hits: the recorders see every launch
    dq, dk, dv = flash_triton.flash_backward_triton(q, k, v, out, lse, do, True)
    named = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "grad_out": do, "dq": dq, "dk": dk, "dv": dv}
    delta = recorded_launches[1][1][6]  # the backward's own D, written by the dQ launch and read by the dK dV one
    named["delta"] = delta
    assert delta.shape == lse.shape and delta.dtype == torch.float32
    for (names, _, grid, tail), (launched_grid, args) in zip([*forward, *backward], recorded_launches, strict=True):
        assert launched_grid == grid
        assert all(arg is named[name] for name, arg in zip(names, args)), names
        assert list(args[len(names):]) == list(tail)
    with use_flash_settings(float32_dot="ieee"):  # another float32 product: other binaries, other plans
        other = flash_settings()
        assert flash_triton.fa2_launches(q, k, v, True, other) is None
        out, lse = flash_triton.flash_forward_triton(q, k, v, True)
        flash_triton.flash_backward_triton(q, k, v, out, lse, do, True)
        assert flash_triton.fa2_launches(q, k, v, True, other) is not None
    assert flash_triton.fa2_launches(q, k, v, True, settings) is None  # the plans of the old settings are replaced


def test_clearing_the_launchers_forgets_the_nodes():
    flash_native._NODES[("layout", False)] = flash_native._Node(FlashSettings(), None, pending=True)
    flash_triton.LAUNCH["forward"].clear()
    assert not flash_native._NODES


@pytest.mark.skipif(not INTERPRET, reason="the CPU path runs under the interpreter")
def test_cpu_calls_never_take_the_node():
    q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
    for _ in range(2):
        out = flash_triton.flash_attention_triton(q, k, v, True)
        out.sum().backward()
    assert "FlashNode" not in out.grad_fn.name()
    assert not flash_native._NODES


# ------------------------------------------------------------------------------------------------------------------
# on a GPU
# ------------------------------------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="launches CUDA kernels")


@pytest.fixture
def default_settings(monkeypatch):
    from cs336_systems.kernels.settings import ENV_VARS

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
    _run(flash_triton.flash_attention_triton, q, k, v, do, causal)


CASES = [  # (q shape, k shape, dtype, causal, model layout, contiguous dO)
    ((2, 3, 100, 64), (2, 3, 100, 64), torch.bfloat16, True, False, False),
    ((1, 4, 77, 128), (1, 4, 130, 128), torch.float16, False, False, False),
    ((2, 4, 64, 64), (2, 4, 64, 64), torch.bfloat16, True, True, False),
    ((2, 4, 96, 128), (2, 4, 96, 128), torch.bfloat16, False, True, True),
    ((1, 2, 50, 32), (1, 2, 50, 32), torch.float32, True, False, False),
    ((3, 90, 64), (3, 90, 64), torch.bfloat16, False, False, False),
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape_q, shape_k, dtype, causal, model_layout, contiguous_grad", CASES)
def test_the_node_gives_the_python_paths_results(default_settings, shape_q, shape_k, dtype, causal, model_layout,
                                                 contiguous_grad):
    layouts = dict(model_layout=model_layout, contiguous_grad=contiguous_grad)
    q, k, v, do = _leaves(shape_q, shape_k, dtype, seed=0, **layouts)
    _warm(q, k, v, do, causal)
    q, k, v, do = _leaves(shape_q, shape_k, dtype, seed=1, **layouts)  # fresh inputs, same layout
    out, grads, node = _run(flash_triton.flash_attention_triton, q, k, v, do, causal)
    assert "FlashNode" in node, f"the second call of the layout did not take the C++ node ({node})"
    _assert_python_paths_results(q, k, v, do, causal, out, grads)


def _assert_python_paths_results(q, k, v, do, causal, out, grads):
    """O and the gradients equal the Python Function's bit for bit (values and strides), and are near float64's."""
    want_out, want_grads, python = _run(flash_triton.FlashAttentionTriton.apply, q, k, v, do, causal)
    assert "FlashNode" not in python
    for name, got, want in zip(("O", "dQ", "dK", "dV"), (out, *grads), (want_out, *want_grads)):
        assert torch.equal(got, want), name
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
@pytest.mark.parametrize("shape_q, shape_k, dtype, causal, model_layout, contiguous_grad", [CASES[0], CASES[3]])
def test_compiled_calls_launch_through_the_plan(default_settings, monkeypatch, shape_q, shape_k, dtype, causal,
                                                model_layout, contiguous_grad):
    taken = []  # (pass, whether flash_native launched it) for each operator call of the compiled graphs
    for name in ("forward", "backward"):
        def spy(*args, _real=getattr(flash_native, name), _name=name):
            result = _real(*args)
            taken.append((_name, result is not None))
            return result
        monkeypatch.setattr(flash_native, name, spy)
    compiled = torch.compile(lambda q, k, v, c: flash_triton.flash_attention_triton(q, k, v, c), fullgraph=True)
    layouts = dict(model_layout=model_layout, contiguous_grad=contiguous_grad)
    _run(compiled, *_leaves(shape_q, shape_k, dtype, seed=4, **layouts), causal)  # plans the layout in Python
    q, k, v, do = _leaves(shape_q, shape_k, dtype, seed=5, **layouts)
    out, grads, _ = _run(compiled, q, k, v, do, causal)
    assert taken[-2:] == [("forward", True), ("backward", True)], taken
    _assert_python_paths_results(q, k, v, do, causal, out, grads)


@gpu
@pytest.mark.gpu
def test_frozen_tied_and_odd_gradients(default_settings):
    shape = (2, 3, 100, 64)
    q, k, v, do = _leaves(shape, shape, torch.bfloat16, seed=2)
    _warm(q, k, v, do, True)
    backend, python = flash_triton.flash_attention_triton, flash_triton.FlashAttentionTriton.apply
    # a frozen input: no gradient for it, the others as the Python path's
    k.requires_grad_(False)
    got, want = _run(backend, q, k, v, do, True), _run(python, q, k, v, do, True)
    assert "FlashNode" in got[2] and got[1][1] is None and want[1][1] is None
    assert all(torch.equal(a, b) for a, b in zip((got[0], got[1][0], got[1][2]), (want[0], want[1][0], want[1][2])))
    k.requires_grad_(True)
    # tied inputs (self-attention on one tensor): the three gradients summed into one
    x = torch.randn_like(q).requires_grad_()
    flash_triton.flash_attention_triton(x, x, x, True).backward(do)
    got_x, x.grad = x.grad, None
    python(x, x, x, True).backward(do)
    assert torch.equal(got_x, x.grad)
    # a dO of another layout (the backward copies it into O's) and an expanded one (from .sum())
    for grad in (do.transpose(-1, -2).contiguous().transpose(-1, -2), None):
        results = []
        for fn in (backend, python):
            out = fn(q, k, v, True)
            out.backward(grad) if grad is not None else out.float().sum().backward()
            results.append([t.grad.clone() for t in (q, k, v)])
            q.grad = k.grad = v.grad = None
        assert all(torch.equal(a, b) for a, b in zip(*results))


@gpu
@pytest.mark.gpu
def test_another_stream_and_no_gradient(default_settings):
    shape = (1, 4, 128, 128)
    q, k, v, do = _leaves(shape, shape, torch.bfloat16, seed=3)
    _warm(q, k, v, do, False)
    want_out, want_grads, _ = _run(flash_triton.FlashAttentionTriton.apply, q, k, v, do, False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out, grads, node = _run(flash_triton.flash_attention_triton, q, k, v, do, False)
    torch.cuda.current_stream().wait_stream(stream)
    assert "FlashNode" in node
    assert torch.equal(out, want_out) and all(torch.equal(a, b) for a, b in zip(grads, want_grads))
    with torch.no_grad():
        out = flash_triton.flash_attention_triton(q, k, v, False)
    assert out.grad_fn is None and torch.equal(out, want_out)
