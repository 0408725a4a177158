"""FlashAttention-2 forward and backward in Triton.

Forward (Dao, 2023, Algorithm 1): one program per (query tile, batch·head). It loads Q_i once and
streams over key tiles, keeping the running maximum m_i, the running denominator l_i and the
unnormalised output `acc` in float32 registers; the exponentials are base 2 with log2(e)/√d folded
into one scale. It writes O_i = acc / l_i and the natural-log logsumexp L_i = (m_i + log2 l_i)·ln 2.

Backward: two kernels that recompute P = exp(S − L) from L and need no atomics: first one per query
tile, which computes D = rowsum(dO ∘ O) for its rows, stores it and accumulates dQ_i over the key
tiles; then one per key tile, which reads D and accumulates dK_j and dV_j over the query tiles.

Causal masking (query i sees keys 0..i, aligned at the start of both sequences): tiles wholly above
the diagonal are never visited; tiles wholly below it run without index comparisons; only the tiles
on the diagonal build a mask. Heavy query tiles are scheduled first.

Caveats: head dim up to 128 (padded to a power of two ≥ 16 inside the kernel); any sequence
lengths (ragged last tiles are masked; EVEN_* heuristics drop the masks when lengths divide the
tiles); float32 dots use the `float32_dot` setting (settings.py), never plain TF32, so float32 results
match a float32 reference. Pointer arithmetic only (no block pointers, which Triton 3.9 removed). CPU
tensors run only under Triton's interpreter, which TRITON_INTERPRET=1 switches on if set before this
module is imported (the tests and the smoke-scale workflow set it where there is no GPU; the package
never does). The tile configs and their autotuning are in tuning.py; `pinned_tiles` (below) replaces
the autotuning by one config per kernel. The launchers keep a plan per call layout (host/launch.py's
PLANS). The public op, which chooses between these kernels and the Gluon ones, is api.py.

The three kernels share their jit helpers, and the file reads top to bottom as one story (helpers,
kernels, launchers), as Triton's tutorial does. See DECISIONS.md#fa2-triton-tiles-and-autotuning.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from cs336_systems.kernels.common import INTERPRET, check_kernel_device, device_capability, interpreted_bfloat16
from cs336_systems.kernels.flash.host import node
from cs336_systems.kernels.flash.host.launch import (
    PLANS,
    FastLauncher,
    cdiv,
    contiguous_strides,
    layout,
    next_power_of_2,
)
from cs336_systems.kernels.flash.settings import FlashSettings, flash_settings, made_with
from cs336_systems.kernels.flash.tuning import (
    TILINGS,
    TUNING_KEY,
    announcing_prune,
    autotune_configs,
    tile_config,
    tuning_bench,
)

LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------
# jit helpers
# ----------------------------------------------------------------------------------------------
@triton.jit
def _load_tile(base, offs_r, offs_d, stride_r, stride_d, n_rows, head_dim,
               MASK_R: tl.constexpr, MASK_D: tl.constexpr, other):
    """A (rows, BLOCK_D) tile; masked loads only where a tile can run past the data."""
    ptrs = base + offs_r[:, None] * stride_r + offs_d[None, :] * stride_d
    if MASK_R and MASK_D:
        return tl.load(ptrs, mask=(offs_r[:, None] < n_rows) & (offs_d[None, :] < head_dim), other=other)
    elif MASK_R:
        return tl.load(ptrs, mask=offs_r[:, None] < n_rows, other=other)
    elif MASK_D:
        return tl.load(ptrs, mask=offs_d[None, :] < head_dim, other=other)
    else:
        return tl.load(ptrs)


@triton.jit
def _store_tile(base, value, offs_r, offs_d, stride_r, stride_d, n_rows, head_dim,
                MASK_R: tl.constexpr, MASK_D: tl.constexpr):
    ptrs = base + offs_r[:, None] * stride_r + offs_d[None, :] * stride_d
    if MASK_R or MASK_D:
        tl.store(ptrs, value, mask=(offs_r[:, None] < n_rows) & (offs_d[None, :] < head_dim))
    else:
        tl.store(ptrs, value)


@triton.jit
def _load_row(base, offs, n, MASK: tl.constexpr, other):
    if MASK:
        return tl.load(base + offs, mask=offs < n, other=other)
    else:
        return tl.load(base + offs)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
               offs_m, offs_d, lo, hi, n_keys, head_dim, qk_scale,
               BLOCK_N: tl.constexpr, ON_DIAGONAL: tl.constexpr, MASK_N: tl.constexpr,
               MASK_D: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr):
    """Online softmax over key tiles [lo, hi). Scores are kept in the log2 domain. With TMA, k_base and
    v_base are tensor descriptors (rows past the data load as zeros) instead of pointers."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if TMA:
            k = k_base.load([start_n, 0])
            v = v_base.load([start_n, 0])
        else:
            k = _load_tile(k_base, offs_n, offs_d, stride_kn, stride_kd, n_keys, head_dim, MASK_N, MASK_D, 0.0)
            v = _load_tile(v_base, offs_n, offs_d, stride_vn, stride_vd, n_keys, head_dim, MASK_N, MASK_D, 0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        if ON_DIAGONAL:
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
        if MASK_N:
            s = tl.where(offs_n[None, :] < n_keys, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# ----------------------------------------------------------------------------------------------
# forward kernel
# ----------------------------------------------------------------------------------------------
def _even(name: str, block: str):
    return lambda args: args[name] % args[block] == 0


def _tuned(kernel: str, extra_key: tuple[str, ...] = ()):
    """Autotuning over the tiles of `kernel` (a name in tuning.TILINGS), and the EVEN_*
    heuristics that drop masks where the lengths and head dim fill the tiles."""
    autotune = triton.autotune(configs=autotune_configs(TILINGS[kernel]), key=[*TUNING_KEY, *extra_key],
                               prune_configs_by={"early_config_prune": announcing_prune(kernel)},
                               do_bench=tuning_bench, cache_results=True)
    heuristics = triton.heuristics({"EVEN_M": _even("N_Q", "BLOCK_M"), "EVEN_N": _even("N_K", "BLOCK_N"),
                                    "EVEN_D": lambda args: args["HEAD_DIM"] == args["BLOCK_D"]})
    return lambda fn: autotune(heuristics(fn))


@_tuned("forward", extra_key=("TMA",))
@triton.jit
def _flash_fwd_kernel(
    Q, K, V, O, L,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    H, N_Q, N_K, HEAD_DIM, SEQ_KEY_Q, SEQ_KEY_K, BATCH_HEADS_KEY, qk_scale,
    IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if IS_CAUSAL:  # the last query tiles see the most keys: start them first
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    if TMA:  # Hopper's tensor-copy engine: one descriptor per (batch, head) matrix, zero fill past its end
        q_base = tl.make_tensor_descriptor(q_base, [N_Q, HEAD_DIM], [stride_qn, 1], [BLOCK_M, BLOCK_D])
        k_base = tl.make_tensor_descriptor(k_base, [N_K, HEAD_DIM], [stride_kn, 1], [BLOCK_N, BLOCK_D])
        v_base = tl.make_tensor_descriptor(v_base, [N_K, HEAD_DIM], [stride_vn, 1], [BLOCK_N, BLOCK_D])
        q = q_base.load([start_m, 0])
    else:
        q = _load_tile(q_base, offs_m, offs_d, stride_qn, stride_qd, N_Q, HEAD_DIM, not EVEN_M, not EVEN_D, 0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Tiles with no causal mask: all keys, or (causal) the keys before this query tile.
    hi = tl.minimum(start_m, N_K) if IS_CAUSAL else N_K
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                               offs_m, offs_d, 0, hi, N_K, HEAD_DIM, qk_scale,
                               BLOCK_N, False, not EVEN_N, not EVEN_D, PRECISION, TMA)
    if IS_CAUSAL:  # the diagonal tiles
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                   offs_m, offs_d, start_m, tl.minimum(start_m + BLOCK_M, N_K), N_K, HEAD_DIM,
                                   qk_scale, BLOCK_N, True, True, not EVEN_D, PRECISION, TMA)

    out = (acc / l_i[:, None]).to(O.dtype.element_ty)
    o_base = O + b * stride_ob + h * stride_oh
    if TMA:  # the store clips rows and columns past the data
        tl.make_tensor_descriptor(o_base, [N_Q, HEAD_DIM], [stride_on, 1], [BLOCK_M, BLOCK_D]).store([start_m, 0], out)
    else:
        _store_tile(o_base, out, offs_m, offs_d, stride_on, stride_od, N_Q, HEAD_DIM, not EVEN_M, not EVEN_D)
    _store_row = L + bh * N_Q + offs_m
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
    if EVEN_M:
        tl.store(_store_row, lse)
    else:
        tl.store(_store_row, lse, mask=offs_m < N_Q)


# ----------------------------------------------------------------------------------------------
# backward kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base,
                    stride_qn, stride_qd, stride_don, stride_dod,
                    offs_n, offs_d, lo, hi, n_queries, head_dim, qk_scale,
                    BLOCK_M: tl.constexpr, ON_DIAGONAL: tl.constexpr, MASK_M: tl.constexpr,
                    MASK_D: tl.constexpr, PRECISION: tl.constexpr):
    """Accumulate dK_j, dV_j over query tiles [lo, hi); works on transposed scores (keys x queries)."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_tile(q_base, offs_m, offs_d, stride_qn, stride_qd, n_queries, head_dim, MASK_M, MASK_D, 0.0)
        do = _load_tile(do_base, offs_m, offs_d, stride_don, stride_dod, n_queries, head_dim, MASK_M, MASK_D, 0.0)
        # L = +inf past the last query makes those columns of P exactly zero.
        lse = _load_row(l_base, offs_m, n_queries, MASK_M, float("inf")) * 1.4426950408889634
        delta = _load_row(d_base, offs_m, n_queries, MASK_M, 0.0)
        s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M)
        p_t = tl.math.exp2(s_t - lse[None, :])
        if ON_DIAGONAL:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                  offs_m, offs_d, lo, hi, n_keys, head_dim, qk_scale,
                  BLOCK_N: tl.constexpr, ON_DIAGONAL: tl.constexpr, MASK_N: tl.constexpr,
                  MASK_D: tl.constexpr, PRECISION: tl.constexpr):
    """Accumulate dQ_i over key tiles [lo, hi)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(k_base, offs_n, offs_d, stride_kn, stride_kd, n_keys, head_dim, MASK_N, MASK_D, 0.0)
        v = _load_tile(v_base, offs_n, offs_d, stride_vn, stride_vd, n_keys, head_dim, MASK_N, MASK_D, 0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(s - lse[:, None])
        if ON_DIAGONAL:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        if MASK_N:
            p = tl.where(offs_n[None, :] < n_keys, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@_tuned("backward_dkdv")
@triton.jit
def _flash_bwd_dkdv_kernel(
    Q, K, V, DO, L, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    H, N_Q, N_K, HEAD_DIM, SEQ_KEY_Q, SEQ_KEY_K, BATCH_HEADS_KEY, qk_scale, sm_scale,
    IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_tile(K + b * stride_kb + h * stride_kh, offs_n, offs_d, stride_kn, stride_kd, N_K, HEAD_DIM,
                   not EVEN_N, not EVEN_D, 0.0)
    v = _load_tile(V + b * stride_vb + h * stride_vh, offs_n, offs_d, stride_vn, stride_vd, N_K, HEAD_DIM,
                   not EVEN_N, not EVEN_D, 0.0)
    q_base = Q + b * stride_qb + h * stride_qh
    do_base = DO + b * stride_dob + h * stride_doh
    l_base = L + bh * N_Q
    d_base = DELTA + bh * N_Q
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if IS_CAUSAL:
        # Queries on the diagonal of this key tile need the mask; the later ones see every key of it.
        diag_end = tl.minimum(start_n + BLOCK_N, N_Q)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, stride_qn, stride_qd,
                                 stride_don, stride_dod, offs_n, offs_d, start_n, diag_end, N_Q, HEAD_DIM,
                                 qk_scale, BLOCK_M, True, True, not EVEN_D, PRECISION)
        lo = start_n + BLOCK_N
    else:
        lo = 0
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, stride_qn, stride_qd,
                             stride_don, stride_dod, offs_n, offs_d, lo, N_Q, N_Q, HEAD_DIM,
                             qk_scale, BLOCK_M, False, not EVEN_M, not EVEN_D, PRECISION)
    _store_tile(DK + b * stride_dkb + h * stride_dkh, (dk * sm_scale).to(DK.dtype.element_ty), offs_n, offs_d,
                stride_dkn, stride_dkd, N_K, HEAD_DIM, not EVEN_N, not EVEN_D)
    _store_tile(DV + b * stride_dvb + h * stride_dvh, dv.to(DV.dtype.element_ty), offs_n, offs_d,
                stride_dvn, stride_dvd, N_K, HEAD_DIM, not EVEN_N, not EVEN_D)


@_tuned("backward_dq")
@triton.jit
def _flash_bwd_dq_kernel(
    Q, K, V, DO, L, O, DELTA, DQ,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    H, N_Q, N_K, HEAD_DIM, SEQ_KEY_Q, SEQ_KEY_K, BATCH_HEADS_KEY, qk_scale, sm_scale,
    IS_CAUSAL: tl.constexpr, PRECISION: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if IS_CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tile(Q + b * stride_qb + h * stride_qh, offs_m, offs_d, stride_qn, stride_qd, N_Q, HEAD_DIM,
                   not EVEN_M, not EVEN_D, 0.0)
    do = _load_tile(DO + b * stride_dob + h * stride_doh, offs_m, offs_d, stride_don, stride_dod, N_Q, HEAD_DIM,
                    not EVEN_M, not EVEN_D, 0.0)
    lse = _load_row(L + bh * N_Q, offs_m, N_Q, not EVEN_M, float("inf")) * 1.4426950408889634
    # D = rowsum(dO ∘ O) in float32, for this tile's rows: computed here, where dO is loaded anyway, and stored
    # for the dK/dV kernel, launched after this one (rows past the end: O and dO load as zeros, D = 0, not stored).
    o = _load_tile(O + b * stride_ob + h * stride_oh, offs_m, offs_d, stride_on, stride_od, N_Q, HEAD_DIM,
                   not EVEN_M, not EVEN_D, 0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh * N_Q + offs_m, delta, mask=offs_m < N_Q)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = tl.minimum(start_m, N_K) if IS_CAUSAL else N_K
    dq = _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                       offs_m, offs_d, 0, hi, N_K, HEAD_DIM, qk_scale, BLOCK_N, False, not EVEN_N, not EVEN_D,
                       PRECISION)
    if IS_CAUSAL:
        dq = _bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                           offs_m, offs_d, start_m, tl.minimum(start_m + BLOCK_M, N_K), N_K, HEAD_DIM, qk_scale,
                           BLOCK_N, True, True, not EVEN_D, PRECISION)
    _store_tile(DQ + b * stride_dqb + h * stride_dqh, (dq * sm_scale).to(DQ.dtype.element_ty), offs_m, offs_d,
                stride_dqn, stride_dqd, N_Q, HEAD_DIM, not EVEN_M, not EVEN_D)


# The autotuned kernels by their names in tuning.TILINGS, for pinned_tiles and bench/kernel_resources.py.
TUNED_KERNELS = {"forward": _flash_fwd_kernel, "backward_dkdv": _flash_bwd_dkdv_kernel,
                 "backward_dq": _flash_bwd_dq_kernel}


# Every kernel through a FastLauncher (launch.py): after the first call per layout, the compiled binary directly.
LAUNCH = {name: FastLauncher(kernel) for name, kernel in TUNED_KERNELS.items()}


@contextlib.contextmanager
def pinned_tiles(forward: tuple[int, int, int, int], backward: tuple[int, int, int, int]):
    """Run the kernels with one tile config each, (outer, inner, warps, stages) as in
    tuning.py's FWD_TILES and BWD_TILES, instead of autotuning: a single config skips Triton's pruning
    and benchmarking. For checking every tile config, and for quick GPU test runs, where autotuning every
    test shape compiles each config once per specialization (minutes)."""
    roles = [(TUNED_KERNELS[name], TILINGS[name], forward if name == "forward" else backward)
             for name in TUNED_KERNELS]
    saved = [(kernel.configs, kernel.cache) for kernel, _, _ in roles]
    PLANS.clear()  # layouts launched with other tiles
    try:
        for kernel, tiling, tile in roles:
            kernel.configs, kernel.cache = [tile_config(tile, tiling.outer, tiling.inner)], {}
        yield
    finally:
        for (kernel, _, _), (configs, cache) in zip(roles, saved):
            kernel.configs, kernel.cache = configs, cache
        PLANS.clear()


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------
def _strides4(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(batch, head, row, col) strides; a 3-d tensor is one head per batch entry."""
    if t.dim() == 3:
        return t.stride(0), 0, t.stride(1), t.stride(2)
    return t.stride()


def _launch_params(q: torch.Tensor, k: torch.Tensor, settings: FlashSettings) -> dict:
    head_dim = q.shape[-1]
    heads = q.shape[1] if q.dim() == 4 else 1
    return dict(
        H=heads,
        N_Q=q.shape[-2], N_K=k.shape[-2], HEAD_DIM=head_dim,
        SEQ_KEY_Q=next_power_of_2(q.shape[-2]), SEQ_KEY_K=next_power_of_2(k.shape[-2]),
        BATCH_HEADS_KEY=next_power_of_2(q.shape[0] * heads),
        PRECISION=settings.float32_dot if q.dtype == torch.float32 else "tf32",  # "tf32" is ignored for 16-bit inputs
        BLOCK_D=max(16, next_power_of_2(head_dim)),
    )


def _tma_ok(settings: FlashSettings, *tensors: torch.Tensor) -> bool:
    """Whether the forward uses the tensor-copy engine: on in `settings`, a Hopper GPU (or the
    interpreter), enough keys, unit stride along the head dim, and every other stride and the start
    16-byte aligned (TMA's rules)."""
    capability = device_capability(tensors[0])  # cached per device; None under the interpreter
    if not settings.tma or not (INTERPRET or (capability is not None and capability[0] >= 9)):
        return False
    if tensors[1].shape[-2] < settings.tma_min_keys and not INTERPRET:
        return False
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
               and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]) for t in tensors)


def _descriptor_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for the descriptors that kernels build on the device (Triton asks for it)."""
    return torch.empty(size, dtype=torch.int8, device="cpu" if INTERPRET else "cuda")


triton.set_allocator(_descriptor_scratch)


# ----------------------------------------------------------------------------------------------
# per-call-signature plans
# ----------------------------------------------------------------------------------------------
# Everything a launcher derives from its inputs' layout and the settings (launch parameters, strides, grids,
# scales, the TMA choice) is the same at every call of that layout: a `_Plan` keeps it, with each launch's
# compiled binary and filled-in arguments once its FastLauncher knows them (after the first call, which autotunes),
# so a hit allocates the outputs and launches. A plan is keyed by `launch.layout` of the inputs and `is_causal`, and
# used only with the settings it was made with (the settings are still read at every call); FastLauncher.clear (new
# tile configs: pinned_tiles) drops every plan.
class _Plan:
    """The launches of one call signature: each `(name, grid, rest, kwargs, bound)` runs as
    `LAUNCH[name](grid, *tensors, *rest, **kwargs)`, or, where `bound` is `(run, tail, compiled, launch_grid)` (the
    launcher's binary for this layout: fast launch on, on a GPU; tail: `rest`, then the keywords and the values
    Triton filled in, in signature order), as `run(*tensors, *tail)`."""

    __slots__ = ("settings", "launches")

    def __init__(self, settings: FlashSettings, launches: list[tuple]):
        self.settings, self.launches = settings, launches

    def run(self, index: int, *tensors: torch.Tensor) -> None:
        name, grid, rest, kwargs, bound = self.launches[index]
        if bound is not None:
            bound[0](*tensors, *bound[1])
        else:
            LAUNCH[name](grid, *tensors, *rest, fast_launch=self.settings.fast_launch, **kwargs)

    def bind(self, index: int, *tensors: torch.Tensor) -> None:
        """After launch `index` ran with `tensors` through its launcher: keep the launcher's binary for it."""
        name, grid, rest, kwargs, _ = self.launches[index]
        launcher = LAUNCH[name]
        if self.settings.fast_launch and isinstance(launcher, FastLauncher):
            bound = launcher.bound(grid, (*tensors, *rest), kwargs)
            if bound is not None:  # the binary takes the tensors, then the rest of the positional arguments, then
                bound = (bound[0], (*rest, *bound[1]), *bound[2:])  # the keywords and the values Triton filled in
            self.launches[index] = (name, grid, rest, kwargs, bound)


# The plans by (the inputs' layout, is_causal): the forward's (q, k, v) and the backward's (q, k, v, O, L, dO)
_FORWARD_PLANS = PLANS.table("fa2_forward")
_BACKWARD_PLANS = PLANS.table("fa2_backward")
# By the forward's key (the layout of q, k, v, and is_causal), then by dO's strides: the first backward plan of those
# inputs and dO (with the latest settings) whose O and L are as the forward allocates them and whose dO is dense (in
# O's layout, as the layers above hand it back, or contiguous): native_backward_calls finds them without O in hand.
_BACKWARD_PLANS_OF_INPUTS = PLANS.table("fa2_backward_of_inputs")
# The tensors each launch takes first, in order (the forward's one launch; the backward's dQ, then dK and dV
# launch), by the C++ node's slot names: the calls below pass them so, and the native calls hand these on.
FORWARD_TENSORS = (("q", "k", "v", "out", "lse"),)
BACKWARD_TENSORS = (("q", "k", "v", "grad_out", "lse", "out", "delta", "dq"),
                    ("q", "k", "v", "grad_out", "lse", "delta", "dk", "dv"))


def _plan_for(plans: dict[tuple, _Plan], key: tuple, settings: FlashSettings) -> _Plan | None:
    plan = plans.get(key)
    return plan if made_with(plan, settings) else None


# ----------------------------------------------------------------------------------------------
# the FA2 launchers, through their plans
# ----------------------------------------------------------------------------------------------
def flash_forward_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                         settings: FlashSettings | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """O (q's dtype, contiguous) and L (float32, shape q.shape[:-1]), with `settings` (None: those in force)."""
    if interpreted_bfloat16(q, "flash_triton"):
        out, lse = flash_forward_triton(q.float(), k.float(), v.float(), is_causal, settings)
        return out.to(q.dtype), lse
    settings = settings or flash_settings()
    key = (layout(q, k, v), is_causal)
    plan = _plan_for(_FORWARD_PLANS, key, settings)
    out = torch.empty_like(q)  # q's layout: a model's (batch, seq, heads, dim) view needs no copy after
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    if plan is not None:
        plan.run(0, q, k, v, out, lse)
        return out, lse
    check_kernel_device(q, "flash_triton")
    p = _launch_params(q, k, settings)
    batch_heads = q.shape[0] * p["H"]
    grid = lambda meta: (cdiv(p["N_Q"], meta["BLOCK_M"]), batch_heads)  # noqa: E731
    rest = (*_strides4(q), *_strides4(k), *_strides4(v), *_strides4(out))
    kwargs = dict(qk_scale=q.shape[-1] ** -0.5 * LOG2E, IS_CAUSAL=is_causal, TMA=_tma_ok(settings, q, k, v, out), **p)
    plan = _Plan(settings, [("forward", grid, rest, kwargs, None)])
    plan.run(0, q, k, v, out, lse)
    plan.bind(0, q, k, v, out, lse)
    _FORWARD_PLANS[key] = plan  # only once it ran: a call that raised leaves no plan
    return out, lse


def flash_backward_triton(q, k, v, out, lse, grad_out, is_causal: bool, settings: FlashSettings | None = None):
    """FA2's dQ, dK, dV (each in its input's layout) from the forward's O and L and dO, with `settings` (None:
    those in force)."""
    if interpreted_bfloat16(q, "flash_triton"):
        grads = flash_backward_triton(q.float(), k.float(), v.float(), out.float(), lse, grad_out.float(), is_causal,
                                      settings)
        return tuple(g.to(q.dtype) for g in grads)
    settings = settings or flash_settings()
    key = (layout(q, k, v, out, lse, grad_out), is_causal)
    plan = _plan_for(_BACKWARD_PLANS, key, settings)
    delta = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    # Gradients in their inputs' layouts: autograd then takes them as .grad without a strided copy
    # (which cost a noticeable share of short calls).
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if plan is None:
        check_kernel_device(q, "flash_triton")
        plan = _backward_plan(q, k, v, out, grad_out, dq, dk, dv, is_causal, settings)
        fresh = True
    else:
        fresh = False
    plan.run(0, q, k, v, grad_out, lse, out, delta, dq)  # writes D, which the dK/dV launch reads
    plan.run(1, q, k, v, grad_out, lse, delta, dk, dv)
    if fresh:  # only once they ran: a call that raised leaves no plan
        plan.bind(0, q, k, v, grad_out, lse, out, delta, dq)
        plan.bind(1, q, k, v, grad_out, lse, delta, dk, dv)
        _BACKWARD_PLANS[key] = plan
        if (node.dense_grad(out, grad_out) and lse.is_contiguous()
                and out.data_ptr() % 16 == 0 == lse.data_ptr() % 16):
            inputs_key = (key[0][:3], is_causal)
            kept = _BACKWARD_PLANS_OF_INPUTS.get(inputs_key, {})
            if any(not made_with(old, settings) for old in kept.values()):  # plans of other settings go
                kept = {}
            kept.setdefault(grad_out.stride(), plan)  # the first of these settings and dO layout stays
            _BACKWARD_PLANS_OF_INPUTS[inputs_key] = kept
    return dq, dk, dv


def _backward_plan(q, k, v, out, grad_out, dq, dk, dv, is_causal: bool, settings: FlashSettings) -> _Plan:
    """The backward's two launches: dQ (which also writes D = rowsum(dO ∘ O)), then dK and dV (which read D)."""
    p = _launch_params(q, k, settings)
    batch_heads = q.shape[0] * p["H"]
    sm_scale = q.shape[-1] ** -0.5
    common = dict(qk_scale=sm_scale * LOG2E, sm_scale=sm_scale, IS_CAUSAL=is_causal, **p)
    strides = (*_strides4(q), *_strides4(k), *_strides4(v), *_strides4(grad_out))
    return _Plan(settings, [
        ("backward_dq", lambda meta: (cdiv(p["N_Q"], meta["BLOCK_M"]), batch_heads),
         (*strides, *_strides4(out), *_strides4(dq)), common, None),
        ("backward_dkdv", lambda meta: (cdiv(p["N_K"], meta["BLOCK_N"]), batch_heads),
         (*strides, *_strides4(dk), *_strides4(dv)), common, None),
    ])


def _native_calls(plan: _Plan, names: tuple[tuple[str, ...], ...]) -> list[node.KernelCall] | None:
    """A plan's launches for the C++ node's plan (each binary with the call's tensors `names` first, then the rest
    of its arguments), or None where a launch has no binary."""
    if any(bound is None for *_, bound in plan.launches):
        return None
    return [node.KernelCall(bound[2], bound[3], (*node.slots(*tensors), *bound[1]))
            for (*_, bound), tensors in zip(plan.launches, names, strict=True)]


def native_forward_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                         settings: FlashSettings) -> list[node.KernelCall] | None:
    """The forward's launch for the C++ node's plan of these inputs' layout, once a forward of that layout has run
    here with fast launch and `settings` (its plan holds the binary); None before."""
    plan = _plan_for(_FORWARD_PLANS, (layout(q, k, v), is_causal), settings)
    return None if plan is None else _native_calls(plan, FORWARD_TENSORS)


def native_backward_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, settings: FlashSettings
                          ) -> tuple[list, list, float] | None:
    """The backward's launches for the C++ node's plan of these inputs' layout, once a backward with the forward's
    O and L and a dense dO has run here with fast launch and `settings` (None before): ([(dO strides, the two
    launches), ...] for each dO layout planned so, the first planned first; the scratch buffers (FA2's D); 0.0, as
    FA2 writes dQ itself)."""
    planned = ((strides, _native_calls(plan, BACKWARD_TENSORS) if made_with(plan, settings) else None)
               for strides, plan in _BACKWARD_PLANS_OF_INPUTS.get((layout(q, k, v), is_causal), {}).items())
    variants = [(strides, calls) for strides, calls in planned if calls is not None]
    # FA2's D: one float32 row value per query, q.shape[:-1], contiguous (flash_backward_triton's)
    delta = ("delta", tuple(q.shape[:-1]), contiguous_strides(q.shape[:-1]))
    return (variants, [delta], 0.0) if variants else None
