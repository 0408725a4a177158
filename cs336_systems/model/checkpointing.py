"""Activation checkpointing of the Transformer blocks (handout 2026, §3.2), applied from outside the
model, and its cost model.

A policy is data: the block counts of the checkpointed segments, outermost first, or selective.

    CheckpointPolicy()              no checkpointing: every block keeps its residuals until backward
    CheckpointPolicy.every(4)       blocks [0..3], [4..7], ... each run under one checkpoint call
    CheckpointPolicy.nested(8, 2)   segments of 8 blocks, and inside each (when it is recomputed in the
                                    backward) segments of 2 blocks, each again under a checkpoint call
    CheckpointPolicy.selective()    each block under its own checkpoint call, which saves the attention
                                    kernel's outputs (output and logsumexp) and recomputes everything else
                                    (torchtitan's selective AC, op-level, through
                                    torch.utils.checkpoint.create_selective_checkpoint_contexts)
    CheckpointPolicy.selective(4)   the same, but blocks 0-3 are not checkpointed at all: they keep
                                    everything (spend free memory on less recomputation)
    CheckpointPolicy.selective(0, 8) selective, but blocks 0-7 also save their matrix products' outputs
                                    (`aten::mm`: q, k, v, the output projection, w1, w3): their rerun
                                    skips every GEMM and redoes only the elementwise work. Per token
                                    that is (4 d_model + 2 d_ff) x 2 B in bf16. At the 8B step it
                                    buys about as much time per GiB as a block kept whole
                                    (selective(4)), in smaller steps (cs336_systems/bench/DECISIONS.md,
                                    "Spending the 8B step's free memory")

A segment at the end of the stack (or of its parent segment) may be shorter when the size does not
divide the count. `apply_activation_checkpointing(model, policy)` rewraps a built `TransformerLM`'s
blocks; the model itself reads no policy. Segment policies replace `model.layers` by a
`CheckpointedBlocks` holding the same blocks (so parameter names are unchanged) whose forward runs
them through `run_blocks`. The selective policy changes each checkpointed block's class to a subclass
whose forward is the block's forward under a checkpoint call (the way torch's `fully_shard` wraps a
module in place): the checkpoint is then part of the block, and compiling the block
(`block.compile()`, regional compilation) compiles the checkpointed block whole, which the selective
policy needs (an op inside a compiled region is invisible to a checkpoint around it).

Checkpoint calls use `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: in the forward a
checkpointed segment keeps only its input; in the backward it reruns its forward (saving this time, so
nested checkpoints inside it save their own inputs) and backpropagates through the rerun. The rerun
stops once everything the first forward saved is back (torch's early stop), so a nested level skips
the blocks of its last inner segment; `checkpoint_cost` counts the reruns this way.

Caveat (selective): an attention backend is saved only if its forward is a dispatched operator named in
`SAVED_OPS` (the SDPA kernels; our Triton kernel's `cs336_systems::flash_triton_forward`, which the
kernel dispatches under torch.compile). Eagerly the Triton kernel is launched without dispatch, so the
checkpoint cannot see it and recomputes it with the rest of the block.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils import checkpoint as torch_checkpoint
from torch.utils.checkpoint import checkpoint

from cs336_systems.model.transformer import TransformerBlocks


@dataclass(frozen=True)
class CheckpointPolicy:
    """Which blocks run under checkpoint calls. `segments` are block counts, outermost level first,
    each smaller than the one before (an inner segment as large as its parent would checkpoint the same
    blocks twice). `keep_blocks` is None for segment policies; for the selective policy it is the number
    of leading blocks that are not checkpointed (0: every block is), and `matmul_blocks` the number of
    checkpointed blocks after those that also save their matrix products' outputs."""

    segments: tuple[int, ...] = ()
    keep_blocks: int | None = None
    matmul_blocks: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.matmul_blocks, int) or isinstance(self.matmul_blocks, bool) or self.matmul_blocks < 0:
            raise ValueError(f"selective checkpointing saves the matmuls of a non-negative number of blocks, "
                             f"got {self.matmul_blocks!r}")
        if self.matmul_blocks and self.keep_blocks is None:
            raise ValueError(f"only a selective policy saves matmul outputs (matmul_blocks {self.matmul_blocks})")
        if self.keep_blocks is not None:
            if not isinstance(self.keep_blocks, int) or isinstance(self.keep_blocks, bool) or self.keep_blocks < 0:
                raise ValueError(f"selective checkpointing keeps a non-negative number of blocks, got {self.keep_blocks!r}")
            if self.segments:
                raise ValueError(f"a policy is selective or has segments, not both (segments {self.segments!r})")
        for size in self.segments:
            if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
                raise ValueError(f"checkpoint segment sizes must be positive integers, got {self.segments!r}")
        for outer, inner in zip(self.segments, self.segments[1:]):
            if inner >= outer:
                raise ValueError(f"nested segment sizes must decrease from the outermost level, got {self.segments!r}")

    @classmethod
    def every(cls, blocks: int) -> CheckpointPolicy:
        return cls((blocks,))

    @classmethod
    def nested(cls, *blocks: int) -> CheckpointPolicy:
        return cls(tuple(blocks))

    @classmethod
    def selective(cls, keep_blocks: int = 0, matmul_blocks: int = 0) -> CheckpointPolicy:
        return cls(keep_blocks=keep_blocks, matmul_blocks=matmul_blocks)

    @classmethod
    def sqrt(cls, num_layers: int) -> CheckpointPolicy:
        """Two levels: segments of about N^(2/3) blocks, inner segments of about N^(1/3) blocks, so the
        stored inputs at each level and the residuals of the innermost segment are all about N^(1/3)."""
        outer = max(1, round(num_layers ** (2 / 3)))
        inner = max(1, round(num_layers ** (1 / 3)))
        return cls((outer, inner) if inner < outer else (outer,))

    @classmethod
    def binary(cls, num_layers: int) -> CheckpointPolicy:
        """Recursive halving down to single blocks: about log2(N) levels, so O(log N) stored inputs and one
        block's residuals at the peak, for O(N log N) recomputation."""
        sizes = []
        size = num_layers
        while size > 1:
            size = math.ceil(size / 2)
            sizes.append(size)
        return cls(tuple(sizes))

    @classmethod
    def parse(cls, text: str) -> CheckpointPolicy:
        """'none', 'every:K', 'nested:K1,K2,...', 'selective', 'selective:N' or 'selective:N,M' (the form `str`
        writes: N blocks kept whole, then M saving their matmul outputs)."""
        kind, _, sizes = text.partition(":")
        try:
            numbers = tuple(int(s) for s in sizes.split(",")) if sizes else ()
        except ValueError:
            raise ValueError(f"bad checkpoint policy {text!r}: sizes must be integers") from None
        if kind == "none" and not numbers:
            return cls()
        if kind == "every" and len(numbers) == 1:
            return cls.every(numbers[0])
        if kind == "nested" and numbers:
            return cls.nested(*numbers)
        if kind == "selective" and len(numbers) <= 2:
            return cls.selective(*numbers)
        raise ValueError(f"bad checkpoint policy {text!r}; write none, every:K, nested:K1,K2,..., selective, "
                         "selective:N or selective:N,M")

    @property
    def kind(self) -> str:
        if self.keep_blocks is not None:
            return "selective"
        return {0: "none", 1: "every"}.get(len(self.segments), "nested")

    @property
    def levels(self) -> int:
        return len(self.segments)

    def __str__(self) -> str:
        if self.matmul_blocks:
            return f"selective:{self.keep_blocks},{self.matmul_blocks}"
        if self.keep_blocks:
            return f"selective:{self.keep_blocks}"
        return self.kind if not self.segments else f"{self.kind}:{','.join(map(str, self.segments))}"

    def check(self, num_layers: int) -> None:
        """Raise if the outermost segment is longer than the stack it would split (or more blocks are
        kept than there are)."""
        if self.keep_blocks is not None and self.keep_blocks + self.matmul_blocks > num_layers:
            saves = f" and saves the matmuls of {self.matmul_blocks}" if self.matmul_blocks else ""
            raise ValueError(f"checkpoint policy {self} keeps {self.keep_blocks} blocks{saves}, more than the "
                             f"model's {num_layers} layers")
        if self.segments and self.segments[0] > num_layers:
            raise ValueError(f"checkpoint policy {self} has segments of {self.segments[0]} blocks, "
                             f"more than the model's {num_layers} layers")


NO_CHECKPOINTING = CheckpointPolicy()


def _run_segment(blocks: Sequence[nn.Module], x: torch.Tensor, segments: tuple[int, ...], args: tuple) -> torch.Tensor:
    if not segments:
        for block in blocks:
            x = block(x, *args)
        return x
    size, inner = segments[0], segments[1:]
    for start in range(0, len(blocks), size):
        x = checkpoint(_run_segment, blocks[start:start + size], x, inner, args, use_reentrant=False)
    return x


def run_blocks(blocks: Sequence[nn.Module], x: torch.Tensor, policy: CheckpointPolicy, *args) -> torch.Tensor:
    """x → blocks[-1](...blocks[0](x, *args)..., *args) under the policy's checkpoint calls (segment
    policies; selective blocks carry their own).

    Without autograd recording (inference, torch.no_grad) there is nothing to save, so the blocks run
    plainly whatever the policy."""
    if not torch.is_grad_enabled():
        policy = NO_CHECKPOINTING
    return _run_segment(list(blocks), x, policy.segments, args)


class CheckpointedBlocks(TransformerBlocks):
    """The model's blocks (the same modules, the same names) run under a segment policy's checkpoints."""

    def __init__(self, blocks: Sequence[nn.Module], policy: CheckpointPolicy):
        super().__init__(blocks)
        self.policy = policy

    def forward(self, x: torch.Tensor, *args) -> torch.Tensor:
        return run_blocks(self, x, self.policy, *args)


# ---- selective checkpointing ------------------------------------------------------------------------

# Operators whose outputs a selective checkpoint saves (by `OpOverload.name()`): the attention kernels'
# forwards, whose outputs (and logsumexp) their backwards need. Another kernel registers its own with
# `save_op_outputs`.
SAVED_OPS: set[str] = {
    "cs336_systems::flash_triton_forward",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
}


def save_op_outputs(name: str) -> None:
    """Have selective checkpoints save the outputs of the operator `namespace::name`."""
    if name.count("::") != 1 or not all(name.split("::")):
        raise ValueError(f"operator name must be 'namespace::name', got {name!r}")
    SAVED_OPS.add(name)


# What a matmul-saving block saves besides: the linear layers' products (`x @ W.T` on a 3-d x is a view
# and one `aten::mm`, eagerly and in the graphs torch.compile traces).
MATMUL_OPS = {"aten::mm", "aten::addmm"}


def _save_attention(ctx, func, *args, **kwargs) -> torch_checkpoint.CheckpointPolicy:
    if getattr(func, "name", None) and func.name() in SAVED_OPS:
        return torch_checkpoint.CheckpointPolicy.MUST_SAVE
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def _save_attention_and_matmuls(ctx, func, *args, **kwargs) -> torch_checkpoint.CheckpointPolicy:
    if getattr(func, "name", None) and func.name() in MATMUL_OPS:
        return torch_checkpoint.CheckpointPolicy.MUST_SAVE
    return _save_attention(ctx, func, *args, **kwargs)


def _attention_contexts():
    return torch_checkpoint.create_selective_checkpoint_contexts(_save_attention)


def _attention_and_matmul_contexts():
    return torch_checkpoint.create_selective_checkpoint_contexts(_save_attention_and_matmuls)


class _SelectiveCheckpoint:
    """Mixed in front of a block's class: the block's forward under a selective checkpoint call."""

    _plain_class: type
    _context_fn = staticmethod(_attention_contexts)  # a module-level function, as torch.compile traces it

    def forward(self, *args):
        if not torch.is_grad_enabled():
            return super().forward(*args)
        return checkpoint(super().forward, *args, use_reentrant=False, context_fn=self._context_fn)


@functools.cache
def _selective_class(cls: type, save_matmuls: bool = False) -> type:
    name = f"SelectiveCheckpointed{'Matmuls' if save_matmuls else ''}{cls.__name__}"
    contexts = _attention_and_matmul_contexts if save_matmuls else _attention_contexts
    return type(name, (_SelectiveCheckpoint, cls), {"_plain_class": cls, "_context_fn": staticmethod(contexts)})


def _plain_block(block: nn.Module) -> nn.Module:
    if isinstance(block, _SelectiveCheckpoint):
        block.__class__ = block._plain_class
    return block


def matmul_block_bytes(d_model: int, d_ff: int, tokens: int, element_size: int) -> int:
    """What a matmul-saving block keeps beyond a plain selective one: its `aten::mm` outputs the backward needs,
    q, k, v and the output projection (4 x d_model) and w1, w3 (2 x d_ff) per token. (w2's output is never
    needed: the rerun stops before it.) Measured on an H200 at the 8B model's sizes: 2.35 GiB a block at
    32,768 tokens and 4.69 GiB at 65,536 (bf16), as this gives."""
    return tokens * (4 * d_model + 2 * d_ff) * element_size


def matmul_blocks_that_fit(free_bytes: float, block_bytes: float, checkpointed_blocks: int) -> int:
    """How many checkpointed blocks can save their matmul outputs in `free_bytes` (what the device holds beyond
    the plain selective step's peak, less a margin): 0 when nothing or an unknown amount (NaN) is free."""
    if block_bytes <= 0:
        raise ValueError(f"a block's saved matmul outputs take a positive number of bytes, got {block_bytes}")
    if not free_bytes > 0:  # NaN included: a device without an allocator peak saves none
        return 0
    return min(checkpointed_blocks, int(free_bytes // block_bytes))


def apply_activation_checkpointing(model: nn.Module, policy: CheckpointPolicy) -> nn.Module:
    """Checkpoint the blocks of a built TransformerLM (`model.layers`) as the policy says, replacing any
    policy applied before; returns the model. Parameters and their names are unchanged, so this composes
    with compilation, DDP and optimizers; apply it before compiling the blocks and before data
    parallelism (`distributed.parallelize` keeps that order)."""
    if not isinstance(policy, CheckpointPolicy):
        raise TypeError(f"policy must be a CheckpointPolicy, got {policy!r}")
    policy.check(len(model.layers))
    blocks = [_plain_block(block) for block in model.layers]
    if policy.kind == "selective":
        model.layers = TransformerBlocks(blocks)
        switch_selective(model, policy)
    elif policy.segments:
        model.layers = CheckpointedBlocks(blocks, policy)
    else:
        model.layers = TransformerBlocks(blocks)
    return model


def switch_selective(model: nn.Module, policy: CheckpointPolicy) -> None:
    """Put a model's blocks under a selective policy in place: only the blocks' classes change (kept whole,
    saving their matmul outputs, or plain selective), not the container, so a training step can switch
    policies between its passes. A compiled block recompiles once per class it meets and keeps each version,
    so switching back and forth costs no further compilation."""
    if policy.kind != "selective":
        raise ValueError(f"switch_selective takes a selective policy, got {policy}")
    if isinstance(model.layers, CheckpointedBlocks):
        raise ValueError(f"switch_selective: the model's blocks are under a segment policy ({model.layers.policy}); "
                         "apply_activation_checkpointing changes that")
    policy.check(len(model.layers))
    matmul_end = policy.keep_blocks + policy.matmul_blocks
    for i, block in enumerate(model.layers):
        _plain_block(block)
        if i >= policy.keep_blocks:
            block.__class__ = _selective_class(type(block), save_matmuls=i < matmul_end)


# ---- cost model ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointCost:
    peak_bytes: float  # activation memory at the peak of the backward (see checkpoint_cost)
    stored_bytes: float  # what the forward leaves saved for the backward
    block_forwards: int  # block forward passes in one training step: N plus the recomputation


def _segment_sizes(n: int, size: int) -> list[int]:
    return [min(size, n - start) for start in range(0, n, size)]


def _peak(n: int, segments: tuple[int, ...], block_bytes: float, boundary_bytes: float) -> float:
    if not segments:
        return n * block_bytes
    # The backward visits segments last to first; while segment j is recomputed and backpropagated,
    # the inputs of segments 1..j are still stored.
    sizes = _segment_sizes(n, segments[0])
    return max(j * boundary_bytes + _peak(size, segments[1:], block_bytes, boundary_bytes)
               for j, size in enumerate(sizes, 1))


def _recompute_forwards(n: int, segments: tuple[int, ...]) -> int:
    """Block forwards to recompute and backpropagate one checkpointed stretch of n blocks whose inner
    levels are `segments`. Non-reentrant checkpoint stops a recomputation as soon as everything the
    original forward saved is back (torch.utils.checkpoint's early stop, on by default): the last inner
    segment's checkpoint saves only its input, so its blocks are not rerun at this level."""
    if not segments:
        return n
    sizes = _segment_sizes(n, segments[0])
    return n - sizes[-1] + sum(_recompute_forwards(size, segments[1:]) for size in sizes)


def checkpoint_cost(policy: CheckpointPolicy, num_layers: int, block_bytes: float,
                    boundary_bytes: float) -> CheckpointCost:
    """Activation memory and recomputation of N identical blocks under a policy, mirroring `run_blocks`.

    block_bytes: what one block run normally saves for backward (its residuals);
    boundary_bytes: one tensor between blocks, which is what a checkpoint call keeps (its input).
    Peak: the largest, over the backward, of the stored segment inputs of every level plus the residuals
    of the innermost segment being backpropagated; for every-k that is ceil(N/k)*boundary + k*block, so
    with boundary = block the optimum is k = sqrt(N). Compute: each level reruns each block at most once
    (the last inner segment of a recomputed segment is skipped, see _recompute_forwards), so every-k
    runs 2N block forwards whatever k, and L levels at most N*(1+L). Gradients, parameters and the
    optimizer state are outside the model, as is the double count of a segment's input, which is also
    the first block's residual (an overestimate by at most one boundary per level).
    """
    if num_layers <= 0:
        raise ValueError(f"num_layers must be positive, got {num_layers}")
    policy.check(num_layers)
    if policy.matmul_blocks:
        raise ValueError(f"the cost model does not model blocks that save their matmul outputs ({policy})")
    if policy.kind == "selective":
        # kept blocks store everything; the others their input and the attention outputs (count those in
        # boundary_bytes), and are rerun once in the backward, one at a time
        keep = policy.keep_blocks
        stored = keep * block_bytes + (num_layers - keep) * boundary_bytes
        rerun = num_layers - keep
        return CheckpointCost(peak_bytes=stored + (block_bytes if rerun else 0.0), stored_bytes=stored,
                              block_forwards=num_layers + rerun)
    if policy.segments:
        sizes = _segment_sizes(num_layers, policy.segments[0])
        stored = len(sizes) * boundary_bytes
        forwards = num_layers + sum(_recompute_forwards(size, policy.segments[1:]) for size in sizes)
    else:
        stored, forwards = num_layers * block_bytes, num_layers
    return CheckpointCost(peak_bytes=_peak(num_layers, policy.segments, block_bytes, boundary_bytes),
                          stored_bytes=stored, block_forwards=forwards)


def divisor_policies(num_layers: int) -> list[CheckpointPolicy]:
    """No checkpointing, then every-k for each k dividing num_layers (the handout's sweep in §3.2(b))."""
    return [NO_CHECKPOINTING, *(CheckpointPolicy.every(k) for k in range(1, num_layers + 1) if num_layers % k == 0)]
