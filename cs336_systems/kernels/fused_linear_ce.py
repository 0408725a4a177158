"""Fused LM head + cross-entropy: mean_t CE(hidden_t @ Wᵀ, target_t) without the [tokens, vocab] logits.

At the leaderboard sizes (2 × 32768 tokens, vocab 151936) the logits alone are 20 GB in bf16 and 40 GB
in float32, and the plain path keeps them (and their float32 softmax) alive until backward. Here the
tokens are processed in chunks of `chunk_tokens`, and each chunk's gradients are finished during the
forward pass (the approach of Liger-Kernel's fused linear cross-entropy):

    for each chunk c of tokens:
        Z_c = H_c @ Wᵀ                                  (chunk, vocab), in the compute dtype
        per row (Triton, `_ce_kernel`): pass 1, online max/sum over vocab blocks → lse = logsumexp(z),
            loss_t = lse − z[target]; pass 2 overwrites the row in place with
            dZ = (softmax(z) − onehot(target)) / n_valid
        dH_c  = dZ_c @ W                                (chunk, d) → stored in grad_hidden
        dW   += dZ_cᵀ @ H_c                             (vocab, d), accumulated in float32

`backward` only multiplies the stored gradients by the incoming grad_output. The work is one PyTorch
custom operator (`cs336_systems::linear_cross_entropy`, with a fake implementation and an autograd
formula), so torch.compile of a function that calls it has no graph break. The kernel's math is float32; the gradient is stored in the logits' dtype, as the
plain path's autograd casts its float32 dlogits to bf16 for the matmuls.

Memory beyond the inputs, for N tokens, chunk C, vocab V, model dim d, compute dtype of b bytes:
    C·V·b (one chunk of logits/gradients) + N·d·bytes(hidden) (grad_hidden) + V·d·4 (float32 grad_weight)
    + V·d·b (a compute-dtype copy of W when W's dtype differs, e.g. float32 W under bf16 autocast)
    + 12·N (per-token losses, int64 targets) + C·d temporaries; backward adds a V·d·b copy of dW when W
    is 16-bit (the float32 accumulator is cast to W's dtype). At N = 65536, d = 4096, V = 151936, C = 4096
    under bf16 autocast with float32 hidden and W: 1.24 (chunk) + 1.07 (dH) + 2.49 (dW) + 1.24 (bf16 W)
    ≈ 6.0 GB, against ≥ 60 GB for the plain path's bf16 logits and their float32 copy.

Dtypes: without autocast, hidden and weight must share a dtype (float32, bfloat16 or float16), as
`hidden @ weight.T` requires. Under autocast both are cast to the autocast dtype, as `Linear` would be.
The loss is float32. `ignore_index` tokens add nothing and are not counted in the mean (as
torch.nn.functional.cross_entropy); if every token is ignored the loss is NaN, as there.

Targets out of [0, vocab) (other than ignore_index) raise a ValueError naming them when the check is
free (targets on the CPU) or asked for (`check_targets=True`: one device sync). Unchecked on CUDA, the
kernel never reads outside the row: such a token's loss and gradient row are NaN, so the loss shows it.

Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (set before importing; the tests and smoke jobs do).
On CUDA with 16-bit compute, dW accumulates through `torch.addmm(..., out_dtype=torch.float32)`
(cuBLAS bf16 → fp32: no rounding of each chunk's product to bf16) where this torch build accepts a
float32 accumulator there (probed once per device and dtype), else each chunk's product is rounded to
bf16 before the float32 add; on the CPU (tests), the 16-bit operands are upcast to float32 for that
product, which gives the cuBLAS result up to summation order. Not yet run on a GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cs336_systems.kernels.common import check_kernel_device
from cs336_systems.model import cross_entropy

MAX_BLOCK_V = 32768  # vocab elements per block; rows of 151936 take 5 blocks per pass
DEFAULT_CHUNK_TOKENS = 4096
IGNORE_INDEX = -100
_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------------------
# per-row kernel: loss and in-place dlogits
# ----------------------------------------------------------------------------------------------
@triton.jit
def _round_to_bf16(x):
    """float32 x rounded to the nearest bfloat16 (ties to even), still as float32; the cast that follows
    is then exact. The GPU's cast rounds so already, but the interpreter's truncates, which doubled the
    gradients' error in the bf16 tests; rounding here makes both give the same bits."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _ce_kernel(logits_ptr, targets_ptr, loss_ptr, inv_n_ptr, stride_row, n_vocab, ignore_index,
               BLOCK_V: tl.constexpr):
    """One program per row of the chunk. Reads the row twice (max/sum, then gradient), writes it once."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row)
    ignored = target == ignore_index
    in_range = (target >= 0) & (target < n_vocab)

    # pass 1: online logsumexp, m_i the running max, l_i the running sum of exp(z - m_i)
    m_i = tl.full((), float("-inf"), tl.float32)
    l_i = tl.zeros((), tl.float32)
    for start in range(0, n_vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        z = tl.load(row_ptr + offs, mask=offs < n_vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_i, tl.max(z, 0))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m_i = m_new
    lse = m_i + tl.log(l_i)

    z_target = tl.load(row_ptr + target, mask=in_range, other=0.0).to(tl.float32)
    # an out-of-range target poisons its row (NaN loss and gradient) instead of reading out of bounds
    scale = tl.where(in_range, tl.load(inv_n_ptr), float("nan"))
    scale = tl.where(ignored, 0.0, scale)
    loss = tl.where(in_range, lse - z_target, float("nan"))
    tl.store(loss_ptr + row, tl.where(ignored, 0.0, loss))

    # pass 2: dz = (softmax(z) - onehot(target)) * scale, in place
    for start in range(0, n_vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < n_vocab
        z = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        p = tl.exp(z - lse)
        dz = tl.where(offs == target, p - 1.0, p) * scale
        if logits_ptr.dtype.element_ty == tl.bfloat16:
            dz = _round_to_bf16(dz)
        tl.store(row_ptr + offs, dz.to(logits_ptr.dtype.element_ty), mask=mask)


def cross_entropy_grad_(logits: torch.Tensor, targets: torch.Tensor, inv_n: torch.Tensor, *,
                        ignore_index: int = IGNORE_INDEX, block_v: int | None = None) -> torch.Tensor:
    """Per-row CE loss (float32, (rows,); 0 where ignored) of `logits` (rows, vocab), contiguous rows;
    overwrites `logits` with (softmax − onehot(targets)) · inv_n (inv_n: a 1-element float32 tensor, read
    on the device so that 1/n_valid needs no sync). block_v (a power of two) overrides the block size."""
    rows, n_vocab = logits.shape
    if block_v is None:
        block_v = min(triton.next_power_of_2(n_vocab), MAX_BLOCK_V)
    if block_v <= 0 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    if logits.stride(1) != 1:
        raise ValueError(f"logits rows must be contiguous, got strides {logits.stride()}")
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        num_warps = 32 if block_v >= 32768 else 16 if block_v >= 8192 else 8 if block_v >= 2048 else 4
        _ce_kernel[(rows,)](logits, targets, loss, inv_n, logits.stride(0), n_vocab, ignore_index,
                            BLOCK_V=block_v, num_warps=num_warps)
    return loss


# ----------------------------------------------------------------------------------------------
# chunked forward (loss and both gradients)
# ----------------------------------------------------------------------------------------------
@functools.cache
def _has_float32_out_addmm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch.addmm accumulates 16-bit products into a float32 `self`/`out` on this device: CUDA
    builds have `out_dtype` for bf16/fp16 → fp32, but older ones required `self` in the operands' dtype."""
    acc = torch.zeros(2, 2, device=device)
    ones = torch.ones(2, 2, device=device, dtype=dtype)
    try:
        torch.addmm(acc, ones, ones, out_dtype=torch.float32, out=acc)
    except (RuntimeError, NotImplementedError):
        return False
    return bool((acc == 2).all())


def _accumulate_mm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with acc in float32 and a, b possibly 16-bit."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda and _has_float32_out_addmm(acc.device, a.dtype):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)  # cuBLAS: 16-bit operands, float32 sum
    elif acc.is_cuda:
        acc.add_(a @ b)  # each chunk's product rounded to 16 bits (what plain bf16 grads get once)
    else:
        acc.addmm_(a.float(), b.float())  # the CPU has no mixed-dtype addmm; float32 products match cuBLAS's


def _forward_and_grads(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                       compute_dtype: torch.dtype, chunk_tokens: int, ignore_index: int,
                       need_hidden_grad: bool, need_weight_grad: bool, block_v: int | None):
    """hidden (N, d), weight (V, d), targets (N,) → (loss, grad_hidden (N, d) or None, grad_weight float32
    (V, d) or None), the gradients being those of the mean loss (grad_output 1)."""
    n_tokens = hidden.shape[0]
    w = weight.to(compute_dtype)
    inv_n = 1.0 / (targets != ignore_index).sum(dtype=torch.float32).reshape(1)  # on the device, no sync
    row_loss = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_hidden_grad else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight_grad else None
    for start in range(0, n_tokens, chunk_tokens):
        end = min(start + chunk_tokens, n_tokens)
        h = hidden[start:end].to(compute_dtype)
        logits = h @ w.T  # (chunk, V)
        row_loss[start:end] = cross_entropy_grad_(logits, targets[start:end], inv_n,
                                                  ignore_index=ignore_index, block_v=block_v)
        dlogits = logits  # overwritten in place by the kernel
        if need_hidden_grad and grad_hidden.dtype == compute_dtype and grad_hidden.is_contiguous():
            torch.mm(dlogits, w, out=grad_hidden[start:end])  # rows of a contiguous tensor: no temporary
        elif need_hidden_grad:
            grad_hidden[start:end] = dlogits @ w
        if need_weight_grad:
            _accumulate_mm_(grad_weight, dlogits.T, h)
        del logits, dlogits
    loss = row_loss.sum() * inv_n[0]
    return loss, grad_hidden, grad_weight


def _check_inputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                  ignore_index: int, check_targets: bool | None) -> None:
    name = "linear_cross_entropy"
    if weight.dim() != 2:
        raise ValueError(f"{name}: weight must be (vocab, d), got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"{name}: hidden (..., d) must end in d = {weight.shape[1]} (weight {tuple(weight.shape)}),"
                         f" got shape {tuple(hidden.shape)}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"{name}: targets must have shape {tuple(hidden.shape[:-1])} (hidden's leading dims),"
                         f" got {tuple(targets.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name}: targets must be int64 (or int32), got {targets.dtype}")
    for label, t in (("hidden", hidden), ("weight", weight)):
        if t.dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"{name}: {label} has unsupported dtype {t.dtype}")
    if not (hidden.device == weight.device == targets.device):
        raise ValueError(f"{name}: hidden, weight, targets must be on one device, got {hidden.device},"
                         f" {weight.device}, {targets.device}")
    check_kernel_device(hidden, name)
    if not (isinstance(chunk_tokens, int) and chunk_tokens > 0):
        raise ValueError(f"{name}: chunk_tokens must be a positive int, got {chunk_tokens!r}")
    if targets.numel() == 0:
        raise ValueError(f"{name}: no tokens (hidden shape {tuple(hidden.shape)})")
    if check_targets is None:
        check_targets = not targets.is_cuda  # free on the CPU; a device sync on CUDA
    if check_targets:
        vocab = weight.shape[0]
        bad = targets[((targets < 0) | (targets >= vocab)) & (targets != ignore_index)]
        if bad.numel():
            raise ValueError(f"{name}: targets must lie in [0, {vocab}) or equal ignore_index={ignore_index};"
                             f" got {bad[:5].tolist()}{' ...' if bad.numel() > 5 else ''}")


# ----------------------------------------------------------------------------------------------
# reference and the custom operator
# ----------------------------------------------------------------------------------------------
def linear_cross_entropy_ref(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                             ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The plain path: the model's cross_entropy (float32 softmax) of the full logits hidden @ Wᵀ,
    over the tokens whose target is not ignore_index."""
    keep = targets != ignore_index
    return cross_entropy((hidden @ weight.T)[keep], targets[keep])


# The chunked forward as a PyTorch custom operator, with its autograd formula and a fake (meta)
# implementation registered: torch.compile treats it as one opaque call of known output shapes, so a
# compiled region that calls `linear_cross_entropy` neither breaks its graph nor traces the chunk loop
# and the Triton launches. Outputs: the loss, and the gradients of the mean loss w.r.t. hidden (N, d) and
# weight (float32, (V, d)), empty (0,) where not asked for (an operator cannot return None).
@torch.library.custom_op("cs336_systems::linear_cross_entropy", mutates_args=())
def _linear_ce_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, compute_dtype: torch.dtype,
                  chunk_tokens: int, ignore_index: int, block_v: int | None, need_hidden_grad: bool,
                  need_weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.autocast(hidden.device.type, enabled=False):
        loss, grad_hidden, grad_weight = _forward_and_grads(
            hidden, weight, targets, compute_dtype=compute_dtype, chunk_tokens=chunk_tokens,
            ignore_index=ignore_index, block_v=block_v, need_hidden_grad=need_hidden_grad,
            need_weight_grad=need_weight_grad)
    return (loss, hidden.new_empty(0) if grad_hidden is None else grad_hidden,
            weight.new_empty(0, dtype=torch.float32) if grad_weight is None else grad_weight)


@_linear_ce_op.register_fake
def _(hidden, weight, targets, compute_dtype, chunk_tokens, ignore_index, block_v, need_hidden_grad,
      need_weight_grad):
    loss = hidden.new_empty((), dtype=torch.float32)
    grad_hidden = torch.empty_like(hidden) if need_hidden_grad else hidden.new_empty(0)
    grad_weight = weight.new_empty(weight.shape if need_weight_grad else (0,), dtype=torch.float32)
    return loss, grad_hidden, grad_weight


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight = inputs[:2]
    _, grad_hidden, grad_weight = output
    ctx.weight_dtype = weight.dtype
    ctx.need = inputs[7:9]
    ctx.mark_non_differentiable(grad_hidden, grad_weight)
    ctx.save_for_backward(grad_hidden, grad_weight)


def _backward(ctx, grad_loss, _grad_hidden, _grad_weight):
    """The gradients were computed in the forward for a loss weight of 1: scale them by grad_loss."""
    grad_hidden, grad_weight = ctx.saved_tensors
    need_hidden, need_weight = ctx.need
    grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype) if need_hidden else None
    if need_weight:
        # 16-bit weights: cast, then scale (grad_loss is 1 in training: exact), so that no second
        # float32 (V, d) tensor is made; float32 weights are scaled in float32.
        grad_weight = grad_weight.to(ctx.weight_dtype) * grad_loss.to(ctx.weight_dtype)
    else:
        grad_weight = None
    return grad_hidden, grad_weight, None, None, None, None, None, None, None


_linear_ce_op.register_autograd(_backward, setup_context=_setup_context)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         chunk_tokens: int = DEFAULT_CHUNK_TOKENS, ignore_index: int = IGNORE_INDEX,
                         check_targets: bool | None = None, block_v: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of hidden @ weight.T against targets, never holding more than chunk_tokens
    rows of logits. hidden (..., d) float32/bf16/fp16, weight (vocab, d) (the LM head's `Linear.weight`),
    targets (...) int64. Returns a float32 scalar; see the module docstring for memory and caveats.
    Compiles without a graph break (the work is the custom operator `cs336_systems::linear_cross_entropy`);
    under torch.compile the free target check on CPU tensors is skipped (its boolean indexing would break
    the graph) unless check_targets=True."""
    if check_targets is None and torch.compiler.is_compiling():
        check_targets = False
    _check_inputs(hidden, weight, targets, chunk_tokens, ignore_index, check_targets)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    elif hidden.dtype != weight.dtype:
        raise ValueError(f"linear_cross_entropy: hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a"
                         " dtype outside autocast")
    else:
        compute_dtype = hidden.dtype
    # Only the gradients autograd will ask for are computed (none under torch.no_grad): evaluation then
    # costs one matmul per chunk instead of three.
    grad_enabled = torch.is_grad_enabled()
    d = hidden.shape[-1]
    loss, _, _ = _linear_ce_op(hidden.reshape(-1, d), weight, targets.reshape(-1).long(), compute_dtype,
                               chunk_tokens, ignore_index, block_v, grad_enabled and hidden.requires_grad,
                               grad_enabled and weight.requires_grad)
    return loss
