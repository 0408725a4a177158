"""Fully-sharded data parallelism (handout 7, problem fsdp), applied to a built model from outside.

What is sharded. A shard policy (`default_shard_policy`: modules whose class is named `Linear` or
`Embedding`, ours, the course's `cs336_basics` ones or torch.nn's) picks the layers whose trainable
`weight` is cut into row blocks, one per rank (`fsdp_shard.ShardedWeight`). The layer's registered
`weight` Parameter is replaced by this rank's shard, so `model.parameters()`, the optimizer and
`state_dict()` see shards: build the optimizer after wrapping, and each rank's optimizer updates
its own rows in fp32. Every other trainable parameter (norms, biases) stays replicated, and its
gradient is averaged over ranks by an asynchronous all-reduce when it is ready. Frozen parameters
are left alone (not sharded, not synchronised). A weight shared by several sharded layers (tied) is
one shard; sharing it with a layer the policy does not shard is an error.

Forward. Just before a sharded layer runs, its full weight (in `compute_dtype`; the shard is cast
before the all-gather, so the wire carries compute-dtype bytes) is put in the layer's instance
`__dict__`, where it shadows the registered shard for the layer's own `self.weight`, and removed
when the layer returns. Each use of a layer is one forward "use"; the first forward runs the uses
on demand and records their order; later forwards prefetch by that order: uses 0 and 1 are gathered
when the forward starts and use k + 2 once use k has returned, the handout's bound (a layer's
gather starts only after the layer two before it has finished its forward), so at most two
gathered weights are alive. If the order changes, prefetching stops for that forward and the new
order is recorded.

Backward. The full weight is never kept for the backward: a saved-tensor hook replaces every
tensor autograd saves that lives in a gathered buffer by a marker, and the matching unpack hook
gathers the weight again when the backward needs it (an embedding's backward does not, so it is not
gathered), prefetching the previous saved use in reverse order; it is dropped once that use's
weight gradient has arrived. The gradient of a use's full weight reaches `_Unshard.backward`; the
uses of a weight are summed (in `reduce_dtype`, default fp32) and, when the last one arrives, one
asynchronous reduce-scatter (mean over ranks) gives each rank the gradient of its rows; at most
`max_inflight_reductions` are left in flight (waiting for the oldest lets its full-size gradient
buffer go). `finish_gradient_synchronization()` waits for all of it; every trainable parameter's
`.grad` then has its parameter's shape and dtype.

Use (the same call order as the DDP wrappers):
    model = FSDP(model, compute_dtype=torch.bfloat16)        # after init_process_group, before the optimizer
    optimizer = AdamW(model.parameters(), ...)               # this rank's shards + replicated parameters
    for batch in loader:                                      # each rank its own part of the batch
        model.on_train_batch_start()                          # a no-op, for the common interface
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(batch)).backward()
        model.finish_gradient_synchronization()               # after every backward, before step()
        optimizer.step()
    full = gather_full_params(model)                          # on every rank: a full state dict
Gradient clipping over all parameters needs a global norm: sum the squared norms of the local shards
and of the replicated gradients (the latter divided by the world size) and all-reduce the sum.

Limits: move the model to its device before wrapping (the broadcast and the shards use it; NCCL
needs GPU tensors). The layer's forward must read its weight as `self.weight` (a weight used outside
its layer's forward, e.g. `x @ model.emb.weight.T`, would see the shard). Call the wrapper, not
`.module`, or the full weights stay saved for the backward instead of being freed. The hooks run
Python per layer: compiling a region that contains sharded layers makes Dynamo trace them and
recompile every step (the gathered weight is a new tensor each time) until its recompile limit,
after which the region runs eagerly (seen on CPU with `compile_blocks(backend="aot_eager")`); compile
only regions without sharded layers. Against single-process training on the full batch, fp32
results agree to float32 rounding, not bitwise: each rank sums its part of the batch, and the sum
of the parts rounds differently from one full-batch matmul (tests/test_fsdp.py gives the margins).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks

from cs336_systems.distributed.common import (
    AsyncAllReduce,
    broadcast_from_rank0,
    require_process_group,
    trainable_parameters,
    weak_hook,
)
from cs336_systems.distributed.fsdp_shard import Collectives, Pending, ShardedWeight

SHARDED_CLASS_NAMES = frozenset({"Linear", "Embedding"})


def default_shard_policy(module: nn.Module) -> bool:
    """Shard the weight of Linear and Embedding layers, matched by class name (so that other code's
    classes of those names count, not only torch.nn's) or as torch.nn subclasses."""
    return isinstance(module, (nn.Linear, nn.Embedding)) or type(module).__name__ in SHARDED_CLASS_NAMES


class _Unshard(torch.autograd.Function):
    """shard → full weight in the graph: forward hands over the gathered weight; backward gives the
    full weight's gradient to FSDP (which reduce-scatters it into shard.grad) and none to autograd."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, full: torch.Tensor, on_grad: Callable[[torch.Tensor], None]):
        ctx.on_grad = on_grad
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.on_grad(grad)
        return None, None, None


@dataclass
class _SavedWeight:
    """What autograd keeps, instead of a gathered weight, until the backward needs it again."""
    unit: ShardedWeight
    use: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class FSDP(nn.Module):
    """Wraps `module` (its parameters on one device, the process group initialised) in place.

    compute_dtype: the dtype sharded weights are all-gathered and used in (None: their own). Only
        they are cast; replicated parameters (norms, biases) and frozen weights stay as they are, so
        the model must accept activations in the compute dtype (ours: the embedding sets it).
    shard_policy: layer → whether its trainable `weight` is sharded (`default_shard_policy`).
    reduce_dtype: the dtype gradients are summed and reduce-scattered in (None: the master weights',
        fp32); the compute dtype halves the bytes reduced, at the cost of summing ranks in it.
    max_inflight_reductions: reduce-scatters left in flight before the oldest is waited for; each
        holds one full-size gradient of its weight.
    native_collectives: None detects whether the backend has single-tensor all-gather and
        reduce-scatter (NCCL does); False forces the fallbacks (tests).
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None, *,
                 shard_policy: Callable[[nn.Module], bool] = default_shard_policy,
                 reduce_dtype: torch.dtype | None = None, max_inflight_reductions: int = 2,
                 native_collectives: bool | None = None):
        super().__init__()
        self.rank, self.world_size = require_process_group(type(self).__name__)
        for what, dtype in (("compute_dtype", compute_dtype), ("reduce_dtype", reduce_dtype)):
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(f"{what} must be a floating-point torch.dtype or None, got {dtype!r}")
        if max_inflight_reductions < 1:
            raise ValueError(f"max_inflight_reductions must be at least 1, got {max_inflight_reductions}")
        self.module = module
        self.max_inflight_reductions = max_inflight_reductions
        params = trainable_parameters(module)
        device = params[0].device if params else torch.device("cpu")
        broadcast_from_rank0(module)  # shards are cut from rank 0's weights
        self._comm = Collectives(device, native_collectives)
        self.sharded_weights: list[ShardedWeight] = []  # one per sharded Parameter (a tied one once)
        self.sharded_layers: dict[nn.Module, ShardedWeight] = {}  # every layer whose weight is sharded
        self._shard(shard_policy, compute_dtype, reduce_dtype)
        sharded = {id(u.shard) for u in self.sharded_weights}
        self._all_reduce = AsyncAllReduce(device)
        for p in trainable_parameters(module):
            if id(p) not in sharded:
                p.register_post_accumulate_grad_hook(weak_hook(self._on_replicated_grad))
        for layer in self.sharded_layers:
            layer.register_forward_pre_hook(self._pre_forward)
            layer.register_forward_hook(self._post_forward, always_call=True)
        self._reductions: deque[Pending] = deque()
        self._plan: list[ShardedWeight] | None = None  # the last forward's order of uses
        self._order: list[ShardedWeight] = []  # this forward's order of uses so far
        self._in_forward = False
        self._first_use = 0  # use id of this forward's first use
        self._prefetched: dict[int, ShardedWeight] = {}  # forward position → gathered ahead
        self._in_use: dict[int, ShardedWeight] = {}  # buffer storage address → weight in use
        self._reset_step()

    def _shard(self, policy, compute_dtype, reduce_dtype) -> None:
        """Replace each chosen weight by its shard in every layer that holds it."""
        holders: dict[int, list[tuple[str, nn.Module, str]]] = {}
        for name, m in self.module.named_modules():
            for pname, p in m.named_parameters(recurse=False):
                holders.setdefault(id(p), []).append((name, m, pname))
        chosen: dict[int, nn.Parameter] = {}
        for name, m in self.module.named_modules():
            weight = dict(m.named_parameters(recurse=False)).get("weight")
            if policy(m) and weight is not None and weight.requires_grad:
                chosen[id(weight)] = weight
        for key, weight in chosen.items():
            layers = holders[key]
            first = next(name for name, m, pname in layers if pname == "weight" and policy(m))
            for name, m, pname in layers:
                if pname != "weight" or not policy(m):
                    raise ValueError(f"the weight of {first or 'the model'} is also {name}.{pname}, "
                                     "which the shard policy does not shard; shard both or neither")
            unit = ShardedWeight(first, weight, self._comm, compute_dtype, reduce_dtype)
            self.sharded_weights.append(unit)
            for _, m, _ in layers:
                m.register_parameter("weight", unit.shard)
                self.sharded_layers[m] = unit

    def _reset_step(self) -> None:
        self._next_use = 0
        self._saved_uses: dict[int, ShardedWeight] = {}  # uses whose weight autograd saved, forward order
        self._saved_order: list[int] = []
        self._saved_position: dict[int, int] = {}
        self._backward_held: dict[int, ShardedWeight] = {}

    # ---- forward --------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self._in_forward, self._order, self._first_use = True, [], self._next_use
        for k, unit in enumerate((self._plan or [])[:2]):  # nothing runs before these two
            unit.acquire()
            self._prefetched[k] = unit
        try:
            with saved_tensors_hooks(self._pack, self._unpack):
                return self.module(*args, **kwargs)
        finally:
            self._in_forward = False
            self._drop_prefetched()
            self._plan = self._order

    def _drop_prefetched(self) -> None:
        for unit in self._prefetched.values():
            unit.release()
        self._prefetched.clear()

    def _pre_forward(self, layer: nn.Module, args) -> None:
        unit = self.sharded_layers[layer]
        if unit.current_use is not None:
            raise RuntimeError(f"{unit.name} runs inside its own forward; FSDP cannot hold its weight twice")
        use, self._next_use = self._next_use, self._next_use + 1
        if self._in_forward:
            k = len(self._order)
            self._order.append(unit)
            if self._plan is not None and (k >= len(self._plan) or self._plan[k] is not unit):
                self._plan = None  # the order changed: no more prefetching in this forward
                self._drop_prefetched()
            if self._prefetched.pop(k, None) is None:
                unit.acquire()
        else:
            unit.acquire()
        full = unit.wait_gather()
        unit.current_use = use
        self._in_use[unit.buffer.untyped_storage().data_ptr()] = unit
        if torch.is_grad_enabled() and unit.shard.requires_grad:
            unit.pending_uses += 1
            full = _Unshard.apply(unit.shard, full, partial(self._on_weight_grad, unit, use))
        layer.__dict__["weight"] = full  # shadows the registered shard inside the layer's forward

    def _post_forward(self, layer: nn.Module, args, output) -> None:
        unit = self.sharded_layers[layer]
        layer.__dict__.pop("weight", None)
        if unit.current_use is None:  # the pre-hook failed before taking the weight
            return
        self._in_use.pop(unit.buffer.untyped_storage().data_ptr(), None)
        k = unit.current_use - self._first_use + 2
        unit.current_use = None
        unit.release()
        if self._in_forward and self._plan is not None and k < len(self._plan):
            self._plan[k].acquire()  # the use two after this one may start gathering now
            self._prefetched[k] = self._plan[k]

    # ---- what autograd saves ------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor):
        if not self._in_use or tensor.layout != torch.strided:
            return tensor
        unit = self._in_use.get(tensor.untyped_storage().data_ptr())
        if unit is None or unit.current_use is None:
            return tensor
        if unit.current_use not in self._saved_uses:
            self._saved_position[unit.current_use] = len(self._saved_order)
            self._saved_order.append(unit.current_use)
            self._saved_uses[unit.current_use] = unit
        return _SavedWeight(unit, unit.current_use, tensor.size(), tensor.stride(), tensor.storage_offset())

    def _unpack(self, saved):
        if not isinstance(saved, _SavedWeight):
            return saved
        if saved.use not in self._backward_held:
            self._hold_for_backward(saved.use, saved.unit)
            position = self._saved_position.get(saved.use, 0)
            if position > 0:  # prefetch the use the backward reaches next
                previous = self._saved_order[position - 1]
                if previous not in self._backward_held:
                    self._hold_for_backward(previous, self._saved_uses[previous])
        saved.unit.wait_gather()
        return saved.unit.buffer.as_strided(saved.size, saved.stride, saved.offset)

    def _hold_for_backward(self, use: int, unit: ShardedWeight) -> None:
        unit.acquire()
        self._backward_held[use] = unit

    # ---- gradients ----------------------------------------------------------------------------
    def _on_weight_grad(self, unit: ShardedWeight, use: int, grad: torch.Tensor) -> None:
        held = self._backward_held.pop(use, None)
        if held is not None:  # this use's backward is done with the full weight
            held.release()
        if unit.add_grad(grad):
            self._launch(unit)

    def _launch(self, unit: ShardedWeight) -> None:
        self._reductions.append(unit.start_reduce())
        while len(self._reductions) > self.max_inflight_reductions:
            self._reductions.popleft().wait()

    @torch.no_grad()
    def _on_replicated_grad(self, param: torch.Tensor) -> None:
        self._all_reduce.submit(param.grad)

    def on_train_batch_start(self) -> None:
        """Nothing to do: each step's bookkeeping is reset by finish_gradient_synchronization()."""

    def finish_gradient_synchronization(self) -> None:
        """Launch the reductions of weights some of whose uses got no gradient (summing the others),
        wait for every collective, and leave the averaged gradients in .grad."""
        for unit in self.sharded_weights:
            if unit.grad_full is not None:
                self._launch(unit)
            unit.pending_uses = 0
        while self._reductions:
            self._reductions.popleft().wait()
        self._all_reduce.wait()
        for unit in self._backward_held.values():
            unit.release()
        self._reset_step()


@torch.no_grad()
def gather_full_params(fsdp: FSDP) -> dict[str, torch.Tensor]:
    """Every parameter of the unwrapped module by its name (all names of a tied one): sharded weights
    all-gathered in their master dtype (call on every rank), the others as they are (not copied)."""
    full = {id(unit.shard): unit.gather_master() for unit in fsdp.sharded_weights}
    return {name: full[id(p)] if id(p) in full else p.detach()
            for name, p in fsdp.module.named_parameters(remove_duplicate=False)}
