"""One sharded weight of FSDP: its local rows, the all-gather that rebuilds it, the reduce-scatter
that gives each rank its rows of the gradient; and the collectives, with fallbacks for gloo.

Layout. A weight of shape (rows, *rest) is cut along dim 0 into `world` blocks of
rows_per_rank = ceil(rows / world) rows; the last blocks are padded with zero rows, so every rank
holds a (rows_per_rank, *rest) shard and one all-gather into a (world * rows_per_rank, *rest) buffer
rebuilds the weight as the buffer's first `rows` rows (a view, no copy). Padding rows get zero
gradients, so an elementwise optimizer (SGD, AdamW) keeps them at zero and they never reach the
model. Row blocks (rather than flat ones) keep the shard 2-D, so the optimizer sees a matrix.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

# all_gather_into_tensor / reduce_scatter_tensor were renamed *_single (2.13 deprecates the old names).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending:
    """An asynchronous collective and what must happen once it is done."""

    def __init__(self, work: dist.Work | None, then: Callable[[], None] | None = None):
        self._work, self._then = work, then

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()


class Collectives:
    """All-gather into one tensor and reduce-scatter (mean) from one tensor, asynchronous.

    NCCL does both natively and averages inside the reduction (ReduceOp.AVG). Other backends are
    probed once: gloo in recent PyTorch has both single-tensor collectives, older gloo may lack them;
    then the all-gather writes into the buffer's per-rank blocks (a list all-gather) and the
    reduce-scatter becomes an all-reduce of a copy followed by taking this rank's block. Without
    AVG the gradient is summed and this rank's block divided by the world size once, afterwards.
    `native=False` forces the fallbacks (tests).
    """

    def __init__(self, device: torch.device, native: bool | None = None):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.average_in_reduction = dist.get_backend() == dist.Backend.NCCL
        if native is None:
            native = self.average_in_reduction or self._probe(device)
        self.native = native

    def _probe(self, device: torch.device) -> bool:
        """Whether this backend has both single-tensor collectives (every rank gets the same answer:
        an unsupported collective fails before any communication)."""
        x = torch.zeros(self.world, device=device)
        try:
            _all_gather_single(x, x[:1].clone())
            _reduce_scatter_single(x[:1], x.clone())
        except (RuntimeError, NotImplementedError, ValueError):
            return False
        return True

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> Pending:
        """out (world * n, ...) ← every rank's shard (n, ...), block r from rank r."""
        if self.native:
            return Pending(_all_gather_single(out, shard, async_op=True))
        return Pending(dist.all_gather(list(out.chunk(self.world)), shard, async_op=True))

    def reduce_scatter_mean(self, out: torch.Tensor, full: torch.Tensor) -> Pending:
        """out (n, ...) ← block `rank` of the mean over ranks of full (world * n, ...). `full` is
        only read (it may be a gradient autograd hands to other nodes too)."""
        if self.world == 1:
            out.copy_(full)
            return Pending(None)
        if self.average_in_reduction:
            return Pending(_reduce_scatter_single(out, full, op=dist.ReduceOp.AVG, async_op=True))
        divide = lambda: out.div_(self.world)  # noqa: E731
        if self.native:
            return Pending(_reduce_scatter_single(out, full, async_op=True), divide)
        total = full.clone()
        work = dist.all_reduce(total, async_op=True)
        return Pending(work, lambda: (out.copy_(total.chunk(self.world)[self.rank]), divide()))


class ShardedWeight:
    """The shard (an nn.Parameter, the one the optimizer updates), the gathered full weight while
    some holder needs it, and the gradient being accumulated over this step's uses.

    `acquire()` / `release()` count holders (a forward use, a prefetch, a backward use); the first
    acquire starts the all-gather, the last release drops the gathered buffer, which is what frees it.
    """

    def __init__(self, name: str, weight: nn.Parameter, comm: Collectives,
                 compute_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None):
        if weight.dim() == 0:
            raise ValueError(f"cannot shard the 0-d weight of {name}; leave it out of the shard policy")
        self.name, self.comm = name, comm
        self.shape = weight.shape
        self.rows = weight.shape[0]
        self.rows_per_rank = math.ceil(self.rows / comm.world)
        self.compute_dtype = compute_dtype or weight.dtype
        self.reduce_dtype = reduce_dtype or weight.dtype
        start = min(comm.rank * self.rows_per_rank, self.rows)
        stop = min(start + self.rows_per_rank, self.rows)
        shard = weight.new_zeros((self.rows_per_rank, *self.shape[1:]))
        shard[: stop - start] = weight.detach()[start:stop]
        self.shard = nn.Parameter(shard, requires_grad=weight.requires_grad)
        self.holders = 0
        self.buffer: torch.Tensor | None = None  # (world * rows_per_rank, *rest) in compute dtype
        self._gather: Pending | None = None
        self._gather_input: torch.Tensor | None = None  # kept alive while the gather is in flight
        self.pending_uses = 0  # forward uses this step whose weight gradient has not arrived yet
        self.grad_full: torch.Tensor | None = None  # (world * rows_per_rank, *rest), reduce dtype
        self.current_use: int | None = None  # id of the forward use running now, if any

    @property
    def padded_shape(self) -> tuple[int, ...]:
        return (self.comm.world * self.rows_per_rank, *self.shape[1:])

    # ---- the full weight ------------------------------------------------------------------
    def acquire(self) -> None:
        if self.holders == 0 and self.buffer is None:
            self.start_gather()
        self.holders += 1

    def release(self) -> None:
        self.holders -= 1
        if self.holders == 0:
            self.wait_gather()  # never drop a buffer a collective is still writing
            self.buffer = None

    @torch.no_grad()
    def start_gather(self) -> None:
        """Cast the shard to the compute dtype first: the all-gather then moves compute-dtype bytes."""
        shard = self.shard.detach().to(self.compute_dtype)
        if self.comm.world == 1:
            self.buffer = shard
            return
        self.buffer = torch.empty(self.padded_shape, dtype=self.compute_dtype, device=shard.device)
        self._gather_input = shard
        self._gather = self.comm.all_gather(self.buffer, shard)

    def wait_gather(self) -> torch.Tensor:
        """The full weight (rows, *rest), a view of the buffer."""
        if self._gather is not None:
            self._gather.wait()
            self._gather = self._gather_input = None
        return self.buffer[: self.rows]

    # ---- the gradient -----------------------------------------------------------------------
    @torch.no_grad()
    def add_grad(self, grad: torch.Tensor) -> bool:
        """Add one use's gradient of the full weight; True once every use of the step has arrived."""
        self.pending_uses -= 1
        if self.grad_full is None:
            if (self.pending_uses == 0 and grad.dtype == self.reduce_dtype and grad.is_contiguous()
                    and self.rows == self.padded_shape[0]):
                self.grad_full = grad  # the only use, no padding: reduce it where it is
            else:
                self.grad_full = grad.new_empty(self.padded_shape, dtype=self.reduce_dtype)
                self.grad_full[: self.rows].copy_(grad)
                self.grad_full[self.rows:].zero_()
        else:
            self.grad_full[: self.rows].add_(grad)
        return self.pending_uses == 0

    def start_reduce(self) -> Pending:
        """Reduce-scatter the accumulated gradient; when done, this rank's rows are added to shard.grad."""
        full, self.grad_full = self.grad_full, None
        out = full.new_empty((self.rows_per_rank, *self.shape[1:]))
        pending = self.comm.reduce_scatter_mean(out, full)

        def finish() -> None:
            pending.wait()
            grad = out.to(self.shard.dtype)
            if self.shard.grad is None:
                self.shard.grad = grad
            else:
                self.shard.grad.add_(grad)

        return Pending(None, finish)

    @torch.no_grad()
    def gather_master(self) -> torch.Tensor:
        """The full master weight (shard dtype), synchronously; for checkpoints and checks."""
        shard = self.shard.detach()
        if self.comm.world == 1:
            return shard.clone()
        out = torch.empty(self.padded_shape, dtype=shard.dtype, device=shard.device)
        self.comm.all_gather(out, shard).wait()
        return out[: self.rows]
