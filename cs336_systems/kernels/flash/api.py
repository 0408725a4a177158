"""The `flash_triton` attention backend: FlashAttention-2 as an autograd Function and as PyTorch operators.

`flash_attention_triton(q, k, v, is_causal)` is what the model's `flash_triton` backend calls. Its walk to a kernel
goes one way, down: this module -> dispatch.py (which kernel runs each pass) -> fa2.py or gluon_fwd.py / gluon_bwd.py
(the kernels and their launchers) -> host/ (the fast launch path and the C++ node). Eager calls of a layout whose
forward and backward have run once go through the C++ autograd node (host/node.py), which launches the same
binaries without Python in the backward; the node's passes come from the dispatch, asked here while the node is
pending (`native_node`).

The launchers are also PyTorch operators (`cs336_systems::flash_triton_forward` and `_backward`): torch.compile then
treats each as one opaque call with a known output shape instead of tracing into Triton's autotuner (which Dynamo
in torch 2.11 fails on: "Can't construct an AttrSource without a valid base source"), so
`torch.compile(FlashAttentionTriton.apply)` compiles as the handout's leaderboard test does. They are registered with
the low-level `torch.library.Library` (schema, a kernel per device, a fake kernel) rather than
`torch.library.custom_op`: a compiled graph then calls the dispatch straight from the dispatcher, where custom_op's
runs it through three Python layers per call (its autograd kernel, a redispatch, and a backend wrapper that checks
the outputs alias no input), which short compiled calls felt. Their outputs are fresh tensors by construction (every
launcher allocates them); they have no autograd kernel of their own: FlashAttentionTriton is their autograd, and
compiled graphs call them with gradients off. Where a layout has the C++ node's launches, the operators launch
through them too. See DECISIONS.md#host-path.
"""

from __future__ import annotations

import torch

from cs336_systems.kernels.common import check_inputs
from cs336_systems.kernels.flash import dispatch
from cs336_systems.kernels.flash.host import node
from cs336_systems.kernels.flash.settings import flash_settings


def native_node(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> node.Node | None:
    """The C++ node of this call's layout (its `plan` None where the Python path should run), or None where the
    node is off for this call. A node not yet settled with the settings in force is settled here: the inputs are
    checked on its first call (the Python path's errors, before anything reads shapes), and while its Python plans
    have not all run it asks the dispatch for the passes at each call."""
    settings = flash_settings()
    found = node.find(q, k, v, is_causal, settings)
    if found is None:
        return None
    key, current = found
    if current is not None and not current.pending:
        return current
    if current is None:
        check_inputs(q, k, v, "FlashAttentionTriton")
        if not settings.fast_launch:  # no binaries are kept
            return node.python_path(key, settings)
    return node.settle(key, settings, current, dispatch.native_passes(q, k, v, is_causal, settings))


_LIBRARY = torch.library.Library("cs336_systems", "FRAGMENT")  # kept alive: dropping it unregisters the operators
_LIBRARY.define("flash_triton_forward(Tensor q, Tensor k, Tensor v, bool is_causal) -> (Tensor, Tensor)",
                tags=(torch.Tag.pt2_compliant_tag,))
_LIBRARY.define("flash_triton_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor grad_out, "
                "bool is_causal) -> (Tensor, Tensor, Tensor)", tags=(torch.Tag.pt2_compliant_tag,))


def _forward_kernel(q, k, v, is_causal):
    found = native_node(q, k, v, is_causal)
    if found is not None and found.plan is not None:
        return node.forward(q, k, v, found.plan)
    return dispatch.flash_forward(q, k, v, is_causal)


def _backward_kernel(q, k, v, out, lse, grad_out, is_causal):
    """The node's C++ backward where the layout has one; the first dO of a layout its plan was not made for goes
    to the Python path once (`node.plans_grad_layout`), which plans it."""
    found = native_node(q, k, v, is_causal)
    if found is not None and found.plan is not None and not node.plans_grad_layout(found, out, grad_out):
        return node.backward(q, k, v, out, lse, grad_out, found.plan)
    return dispatch.flash_backward(q, k, v, out, lse, grad_out, is_causal)


for _device in ("CPU", "CUDA"):  # CPU tensors run under Triton's interpreter (or fail its device check clearly)
    _LIBRARY.impl("flash_triton_forward", _forward_kernel, _device)
    _LIBRARY.impl("flash_triton_backward", _backward_kernel, _device)


@torch.library.register_fake("cs336_systems::flash_triton_forward", lib=_LIBRARY)
def _(q, k, v, is_causal):  # the same layouts as the launchers give
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.register_fake("cs336_systems::flash_triton_backward", lib=_LIBRARY)
def _(q, k, v, out, lse, grad_out, is_causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_forward_op = torch.ops.cs336_systems.flash_triton_forward.default
_backward_op = torch.ops.cs336_systems.flash_triton_backward.default


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2 forward and backward in our Triton kernels (FA2's, or on Hopper the Gluon ones: dispatch.py),
    called as `FlashAttentionTriton.apply(q, k, v, is_causal)`: q (..., n_q, d), k and v (..., n_k, d), with one or
    two leading dims. Saves L (shape q.shape[:-1], float32), Q, K, V and O for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        check_inputs(q, k, v, "FlashAttentionTriton")
        # Eager calls skip the operator (its dispatch costs host time that short calls feel).
        compiling = torch.compiler.is_compiling()
        out, lse = (_forward_op if compiling else dispatch.flash_forward)(q, k, v, is_causal)
        ctx.save_for_backward(lse, q, k, v, out)
        ctx.is_causal = is_causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        lse, q, k, v, out = ctx.saved_tensors
        backward = _backward_op if torch.compiler.is_compiling() else dispatch.flash_backward
        dq, dk, dv = backward(q, k, v, out, lse, grad_out, ctx.is_causal)
        return dq, dk, dv, None


def flash_attention_triton(q, k, v, is_causal: bool = False) -> torch.Tensor:
    """The `flash_triton` attention backend: FlashAttentionTriton, except that eager calls of a layout whose forward
    and backward have run go through the C++ autograd node (the `native` setting)."""
    if not torch.compiler.is_compiling():
        found = native_node(q, k, v, is_causal)
        if found is not None and found.plan is not None:
            return node.attention(q, k, v, found.plan)
    return FlashAttentionTriton.apply(q, k, v, is_causal)
