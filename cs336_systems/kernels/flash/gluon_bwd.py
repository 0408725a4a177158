"""FlashAttention backward for Hopper (sm_90) in Triton's Gluon: warp-specialised, FA3-shaped.

Inputs are what either forward writes: Q, K, V, O, dO and L, the natural-log logsumexp (float32, contiguous
q.shape[:-1]). Three launches:
  1. preprocessing (plain Triton): L2 = L * log2(e) and D = rowsum(dO * O), both float32, one row per (batch·head)
     padded to a whole number of query tiles (L2 = +inf and D = 0 past the last query, so padded queries give
     P = 0 and need no mask in the main loop); and the float32 dQ accumulator zeroed;
  2. the main kernel, one program (CTA) per key tile of BLOCK_N = 128 keys of one (batch, head), in three
     partitions (Shah et al., FlashAttention-3, 2024, section 3.3, as we read it; the code is ours):
       consumer c = 0, 1 (one warpgroup each)  keys [64 c, 64 c + 64) of the tile: dK_c and dV_c in float32
                                               registers, accumulated over the query tiles
       producer (one warp)                     TMA loads of K and V once, of Q_i and dO_i into a ring of slots
     Per query tile i of BLOCK_M rows, each consumer computes, transposed (keys along the rows, so that the
     16-bit P^T and dS^T are the register A operand of the next wgmmas):
       S^T = K_c Q_i^T,  dP^T = V_c dO_i^T                    (two async wgmmas from shared memory)
       P^T = exp2(S^T * scale * log2(e) - L2_i)               (masked on the causal diagonal)
       dV_c += P^T dO_i,  dS^T = P^T (dP^T - D_i),  dK_c += dS^T Q_i   (register-A wgmmas)
       dQ_i += dS_i K: both consumers' dS^T go to shared memory; once both are written, consumer c computes
       columns [c d/2, (c+1) d/2) of dS_i K over the program's 128 keys (two wgmmas reading dS^T transposed) and
       adds its (BLOCK_M, d/2) float32 part to a float32 dQ accumulator in global memory by a TMA reduce-add
       (`tma_reduce_add`). Splitting the head dim, not the keys, halves both the dQ registers (d=128 does not
       fit 240 registers otherwise) and the reduce-add traffic;
  3. dQ = accumulator * scale, cast to q's dtype into q's layout (one torch multiply).
Two schedules of a consumer's step (BwdTile.pingpong): lockstep (`_query_step`) issues, waits for and reduces step
i's dQ at the end of step i; ping-pong (`_deferred_step`) issues step i's dQ wgmmas at the start of step i + 2,
just before S^T, and stores and reduces them while S^T runs, frees the slot as soon as dK retires, and lets either
consumer run up to a step ahead of the other.

Barrier protocol (every mbarrier counts phases; a fresh one passes a wait on parity 1):
  kv_bar                producer -> consumers: both consumers' K and V sub-tiles landed (expect-tx bytes)
  ready[i]              producer -> consumers: slot i holds Q, dO, L2 and D of the next query tile (expect-tx)
  empty[i]              consumers -> producer: both consumers' wgmmas reading slot i have retired (count 2)
  ds_ready[p]           consumer <-> consumer: both dS^T of a step of parity p (ping-pong: of step mod 4) are in
                        shared memory (count 2)
  go                    (ping-pong) consumer 0 -> consumer 1: start
  done                  consumer <-> consumer: both left the loop, so no dQ wgmma reads K any more (count 2)
Hazards kept (triton #9433, #11781): P^T and dS^T in registers are kept alive (`deps` of the wait) until the
wgmmas reading them have retired; a slot is released only after every wgmma reading it (S, dP, dV, dK) has
retired; a dS^T buffer is rewritten only after both consumers' dQ wgmmas reading it retired; a dQ buffer is
rewritten only after the reduce-add reading it has finished (`tma.store_wait`); dK leaves through K's buffer only
after `done`.

Causal (query i sees keys 0..i, aligned at the start, as in fa2.py): a key tile starting at key n0 (a multiple
of BLOCK_N) visits query tiles from n0 // BLOCK_M on; only the first BLOCK_N // BLOCK_M of them touch the
diagonal and are masked (a runtime branch inside the one loop: a peeled loop of their own spilled at d=128).
Keys past the end need no mask: their K and V rows load as zeros, so their dS^T rows meet a zero K row in dQ,
and their dK, dV rows are clipped on store. Key tiles at or past the last query (causal, n_k > n_q) visit nothing
and store zeros. Programs are ordered one head after another, heaviest key tile first.

Caveats: sm_90 only; bf16 or fp16; head dims 64 and 128; q, k, v, dO with 16-byte aligned strides and starts (dO
is copied contiguous where it is not, e.g. the stride-0 dO of `o.sum().backward()`); a float32 dQ accumulator of
q's size (4 bytes per element) is allocated per call, and its reduce-adds arrive in no fixed order, so dQ is not
bitwise repeatable across runs. TMA reduce-add has no public Gluon call in Triton 3.6: `tma_reduce_add` wraps
the private builder call and fails with a clear error on a Triton without it. EXACT (tests only) replaces the
softmax by P^T = S^T mod 8, as the forward's EXACT does. See DECISIONS.md#backward-schedule.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from cs336_systems.kernels.flash.gluon_common import (
    CONSUMERS,
    LOG2E,
    BackwardPlan,
    DescriptorPlan,
    as_2d,
    as_4d,
    descriptor,
    descriptor_launch_key,
    device_problem,
    dq_accumulator,
    float32_descriptor,
    layout_problem,
    next_slot,
    tma_problem,
    tma_reduce_add,
    tma_reduce_problem,
)
from cs336_systems.kernels.flash.host import node
from cs336_systems.kernels.flash.host.launch import PLANS, FastLauncher, cdiv, contiguous_strides, layout
from cs336_systems.kernels.flash.settings import flash_settings

# the most dynamic shared memory a block may have on sm_90 (227 KiB), less 1 KiB for the barriers and the
# compiler's own: tiles beyond it fail at launch, so BwdTile refuses them up front
SHARED_BYTES = 227 * 1024 - 1024
_CONSUMERS = gl.constexpr(CONSUMERS)


@dataclass(frozen=True)
class BwdTile:
    """One program's shape and resources. block_m: query rows per step (a wgmma's M for dQ, its N for S^T);
    block_n: keys per program (= CONSUMERS x 64: a consumer's dK and dV are (64, d) float32 in registers, which at
    d = 128 is 128 of its registers); num_slots: Q/dO ring depth; pingpong: the consumers' step schedule, the
    deferred ping-pong one (`_deferred_step`: a step's dQ wgmmas are issued two steps late, ahead of S^T, the
    consumers need not meet every step and start a fraction of a step apart; 4 dS^T buffers) or else the lockstep
    one (`_query_step`: dQ issued, waited for and reduced at the end of its own step; 2 dS^T buffers);
    dq_swizzle: the float32 dQ tile's shared-memory swizzle in bytes (32 or 128). A consumer stores its dQ part
    with 64-bit stores, each half-warp writing 32 contiguous bytes of each of 4 consecutive rows: the 128-byte
    swizzle puts two of those rows on the same banks (two wavefronts a half-warp where one would do), the 32-byte
    one puts the 4 rows in one 128-byte line, at the price of 4x as many TMA reduce-adds, each 32 bytes wide;
    registers as in gluon_fwd.GluonTile."""

    head_dim: int
    block_m: int = 64
    block_n: int = 128
    num_slots: int = 2
    pingpong: bool = False
    dq_swizzle: int = 128
    consumer_registers: int = 240
    producer_registers: int = 24
    maxnreg: int = 168

    def __post_init__(self):
        if not isinstance(self.pingpong, bool):
            raise ValueError(f"{self}: pingpong must be a bool, got {self.pingpong!r}")
        if self.dq_swizzle not in (32, 128):
            raise ValueError(f"{self}: dq_swizzle must be 32 or 128 (bytes), got {self.dq_swizzle!r}")
        if self.shared_bytes() > SHARED_BYTES:
            raise ValueError(f"{self}: its tiles need {self.shared_bytes()} B of shared memory, more than the "
                             f"{SHARED_BYTES} B an sm_90 block may have")
        if self.block_n != CONSUMERS * 64:
            raise ValueError(f"{self}: block_n must be {CONSUMERS} x 64 (one 64-key wgmma M per consumer)")
        if self.block_n % self.block_m:
            raise ValueError(f"{self}: block_m must divide block_n (only the first block_n // block_m query tiles "
                             "of a causal key tile are masked)")

    @property
    def keys_per_consumer(self) -> int:
        return self.block_n // CONSUMERS

    @property
    def masked_steps(self) -> int:
        """Causal: the query tiles of a key tile that touch the diagonal (the first ones it visits)."""
        return self.block_n // self.block_m

    @property
    def dq_columns(self) -> int:
        """The dQ columns one consumer computes and reduces per step: half of the head dim."""
        return self.head_dim // CONSUMERS

    def shared_bytes(self, element_size: int = 2) -> int:
        """Tiles only (the barriers add a few hundred bytes): K and V, the Q/dO ring with its L2 and D rows, the
        dS^T buffers (16-bit) and each consumer's float32 dQ part."""
        d = self.head_dim
        kv = 2 * self.block_n * d * element_size
        ring = self.num_slots * self.block_m * (2 * d * element_size + 2 * 4)
        ds = (4 if self.pingpong else 2) * self.block_n * self.block_m * element_size
        dq = CONSUMERS * self.block_m * self.dq_columns * 4
        return kv + ring + ds + dq


# The shipped tiles (DECISIONS.md#backward-schedule). d=64: lockstep, 128 queries a step, a 32-byte dQ swizzle
# (its consumers spill a little, and it is still the fastest measured); d=128: ping-pong, 64 queries a step
# (225 KiB of the 227 KiB an sm_90 block may have).
TILES = {64: BwdTile(64, block_m=128, num_slots=2, dq_swizzle=32),
         128: BwdTile(128, num_slots=2, pingpong=True)}


def tile_for(head_dim: int) -> BwdTile:
    if head_dim not in TILES:
        raise ValueError(f"flash_gluon_bwd: head dim {head_dim} is not supported "
                         f"(supported: {', '.join(map(str, TILES))})")
    return TILES[head_dim]


# ----------------------------------------------------------------------------------------------
# the schedule, in plain Python (the kernel computes the same)
# ----------------------------------------------------------------------------------------------
def program_order(n_kv_tiles: int, batch_heads: int) -> list[tuple[int, int]]:
    """(key tile, batch·head) of program 0, 1, ...: one head after another, key tiles in order, which is
    heaviest first when causal (key tile t visits the query tiles from its diagonal on)."""
    return [(pid % n_kv_tiles, pid // n_kv_tiles) for pid in range(n_kv_tiles * batch_heads)]


def query_steps(kv_tile: int, n_queries: int, tile: BwdTile, is_causal: bool) -> tuple[int, int]:
    """(first query tile, number of query tiles) a program visits (the kernel computes the same)."""
    n_q_tiles = cdiv(n_queries, tile.block_m)
    first = kv_tile * tile.block_n // tile.block_m if is_causal else 0
    return first, max(n_q_tiles - first, 0)


def padded_queries(n_queries: int, tile: BwdTile) -> int:
    """The row length of the preprocessed L2 and D: whole query tiles, so the main loop reads them unmasked."""
    return cdiv(n_queries, tile.block_m) * tile.block_m


# ----------------------------------------------------------------------------------------------
# preprocessing (plain Triton)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _bwd_preprocess_kernel(O, DO, L, L2, DELTA, ACC, stride_ob, stride_oh, stride_on, stride_od, stride_dob,
                           stride_doh, stride_don, stride_dod, stride_ab, stride_ah, stride_an, stride_ad, H, N_Q,
                           N_PAD, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """L2 = L * log2(e) and D = rowsum(dO * O) into (batch·head, N_PAD) rows; +inf and 0 past N_Q. O and dO are
    read in their own strides (a stride-0 dO is read as it is). And the float32 dQ accumulator's rows zeroed, in
    its strides: one launch fewer than a fill of its own."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    offs_m = pid * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    live = offs_m < N_Q
    tl.store(ACC + b * stride_ab + h * stride_ah + offs_m[:, None] * stride_an + offs_d[None, :] * stride_ad,
             tl.zeros([BLOCK, HEAD_DIM], tl.float32), mask=live[:, None])
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od,
                mask=live[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod,
                 mask=live[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse = tl.load(L + bh * N_Q + offs_m, mask=live, other=float("inf")) * 1.4426950408889634
    tl.store(L2 + bh * N_PAD + offs_m, lse)
    tl.store(DELTA + bh * N_PAD + offs_m, delta)


# ----------------------------------------------------------------------------------------------
# partitions
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _producer(desc_q, desc_do, desc_k, desc_v, desc_l2, desc_delta, k_smem, v_smem, q_ring, do_ring, l2_ring,
              delta_ring, kv_bar, ready, empty, b, h, bh, n0, m_first, n_steps):
    NUM: gl.constexpr = q_ring.shape[0]
    BM: gl.constexpr = desc_q.block_type.shape[2]
    BNC: gl.constexpr = desc_k.block_type.shape[2]
    mbarrier.expect(kv_bar, 2 * _CONSUMERS * desc_k.block_type.nbytes)
    for c in gl.static_range(_CONSUMERS):
        tma.async_copy_global_to_shared(desc_k, [b, h, n0 + c * BNC, 0], kv_bar, k_smem.index(c))
        tma.async_copy_global_to_shared(desc_v, [b, h, n0 + c * BNC, 0], kv_bar, v_smem.index(c))
    idx = 0
    phase = 1  # the slots start out free
    for i in range(n_steps):
        mbarrier.wait(empty.index(idx), phase)
        mbarrier.expect(ready.index(idx), desc_q.block_type.nbytes + desc_do.block_type.nbytes
                        + desc_l2.block_type.nbytes + desc_delta.block_type.nbytes)
        row = (m_first + i) * BM
        tma.async_copy_global_to_shared(desc_q, [b, h, row, 0], ready.index(idx), q_ring.index(idx))
        tma.async_copy_global_to_shared(desc_do, [b, h, row, 0], ready.index(idx), do_ring.index(idx))
        tma.async_copy_global_to_shared(desc_l2, [bh, row], ready.index(idx), l2_ring.index(idx))
        tma.async_copy_global_to_shared(desc_delta, [bh, row], ready.index(idx), delta_ring.index(idx))
        idx, phase = next_slot(idx, phase, NUM)


@gluon.jit
def _ds_buffer(ds_smem, step):
    """The dS^T buffer of a step, by step modulo the buffers (both consumers read it: 2 buffers, 4 with
    BwdTile.pingpong). `step` must not be negative (pass step + buffers for step - k)."""
    NDS: gl.constexpr = ds_smem.shape[0]
    return ds_smem.index(step % NDS)


@gluon.jit
def _grads_of_step(s_t, dp_t, q_s, do_s, l2_row, delta_row, ds_buf, dk, dv, q_row, offs_n, qk_scale, masked,
                   CID: gl.constexpr, EXACT: gl.constexpr):
    """From S^T and dP^T in flight (dP^T issued last): P^T, dV += P^T dO, dS^T, dK += dS^T Q, this consumer's dS^T
    into its rows of ds_buf (fenced). Returns dK, dV with every wgmma of the step retired (so the slot may go)."""
    BM: gl.constexpr = q_s.shape[0]
    BNC: gl.constexpr = offs_n.shape[0]  # this consumer's keys
    D: gl.constexpr = q_s.shape[1]
    dtype: gl.constexpr = q_s.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    s_t = warpgroup_mma_wait(1, deps=(s_t, ))  # S^T retired; dP^T may still run
    # L2 and D as (1, BM) rows in S^T's layout, read from shared memory just before use: held in registers they
    # cost 16 each per thread (a row spread over the columns), which at d=128 made the loop spill more
    if EXACT:  # tests only: integer arithmetic, every value exact (see the module docstring)
        p_t = s_t - gl.floor(s_t * 0.125) * 8.0
    else:
        p_t = gl.exp2(s_t * qk_scale - l2_row.load(s_layout))  # padded queries: L2 = +inf, P = 0
    if masked:  # a runtime branch: only the diagonal's tiles pay for the mask
        offs_m = q_row + gl.arange(0, BM, layout=gl.SliceLayout(0, s_layout))
        p_t = gl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
    p_op = gl.convert_layout(p_t.to(dtype), a_layout)
    dv = warpgroup_mma(p_op, do_s, dv, is_async=True)  # dV's tensor-core work overlaps dS^T below
    dp_t = warpgroup_mma_wait(1, deps=(dp_t, ))  # dP^T retired (issued before dV); dV may still run
    ds_t = (p_t * (dp_t - delta_row.load(s_layout))).to(dtype)
    ds_op = gl.convert_layout(ds_t, a_layout)
    dk = warpgroup_mma(ds_op, q_s, dk, is_async=True)
    # dS^T to shared memory for dQ (the caller knows the buffer's last reader retired)
    ds_buf.slice(CID * BNC, BNC).store(ds_t)
    fence_async_shared()
    # dV and dK retire before dQ's accumulator is live: P^T, dS^T (kept alive to here) and dQ never share registers
    dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv, dk, p_op, ds_op))
    return dk, dv


@gluon.jit
def _dq_issue(ds_buf, k_smem, DQ: gl.constexpr, CID: gl.constexpr):
    """The async wgmmas of a step's dQ rows from its dS^T buffer (in flight on return): dQ_i[:, this half] = sum
    over the consumers' key blocks j of dS_ij K_j[:, this half]."""
    BM: gl.constexpr = ds_buf.shape[1]
    BNC: gl.constexpr = k_smem.shape[3]
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DQ, 16])
    dq = warpgroup_mma(ds_buf.slice(0, BNC).permute((1, 0)), as_2d(k_smem, 0).slice(CID * DQ, DQ, dim=1),
                       gl.zeros([BM, DQ], gl.float32, dq_layout), use_acc=False, is_async=True)
    dq = warpgroup_mma(ds_buf.slice(BNC, BNC).permute((1, 0)), as_2d(k_smem, 1).slice(CID * DQ, DQ, dim=1),
                       dq, is_async=True)
    return dq


@gluon.jit
def _dq_drain(dq, dq_smem, desc_dq, b, h, q_row, CID: gl.constexpr):
    """A retired dQ part of a step into this consumer's float32 buffer and on by TMA reduce-add into the
    accumulator."""
    BM: gl.constexpr = dq_smem.shape[3]
    DQ: gl.constexpr = dq_smem.shape[4]
    dq_c = dq_smem.index(CID)
    tma.store_wait(0)  # the reduce-add that last read dq_c has finished
    dq_c.reshape([BM, DQ]).store(dq)
    fence_async_shared()
    tma_reduce_add(desc_dq, [b, h, q_row, CID * DQ], dq_c)


@gluon.jit
def _query_step(k_smem, v_c, q_ring, do_ring, l2_ring, delta_ring, ready, empty, ds_smem, ds_ready, dq_smem, desc_dq,
                dk, dv, idx, phase, step, b, h, q_row, offs_n, qk_scale, masked, CID: gl.constexpr,
                EXACT: gl.constexpr):
    """One query tile (rows q_row..q_row+BM) against this consumer's keys, the lockstep schedule: dK, dV
    accumulated, then this step's dQ computed, waited for and reduced: dQ_i = dS_i K over both consumers' keys,
    each consumer taking half of the head dim (both dS^T in shared memory, buffered by step parity, ds_ready says
    both are written)."""
    NUM: gl.constexpr = q_ring.shape[0]
    BM: gl.constexpr = q_ring.shape[3]
    BNC: gl.constexpr = k_smem.shape[3]
    DQ: gl.constexpr = dq_smem.shape[4]  # dQ columns this consumer reduces: D / 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    k_c = as_2d(k_smem, CID)
    q_s = as_2d(q_ring, idx)
    do_s = as_2d(do_ring, idx)
    s_shape = gl.zeros([BNC, BM], gl.float32, s_layout)  # only gives S^T and dP^T their layout (use_acc=False)

    mbarrier.wait(ready.index(idx), phase)
    s_t = warpgroup_mma(k_c, q_s.permute((1, 0)), s_shape, use_acc=False, is_async=True)
    dp_t = warpgroup_mma(v_c, do_s.permute((1, 0)), s_shape, use_acc=False, is_async=True)
    # dS^T's buffer was last read by both consumers' dQ wgmmas of step - 2 (the other one's retired before it
    # arrived on ds_ready in step - 1, which this one waited for)
    ds_buf = _ds_buffer(ds_smem, step)
    dk, dv = _grads_of_step(s_t, dp_t, q_s, do_s, l2_ring.index(idx), delta_ring.index(idx), ds_buf, dk, dv, q_row,
                            offs_n, qk_scale, masked, CID, EXACT)
    gl.thread_barrier()  # every thread's dS^T is written (and fenced) before one thread arrives
    mbarrier.arrive(ds_ready.index(step % 2), count=1)
    mbarrier.wait(ds_ready.index(step % 2), (step // 2) & 1)
    dq = _dq_issue(ds_buf, k_smem, DQ, CID)
    dq = warpgroup_mma_wait(0, deps=(dq, ))
    mbarrier.arrive(empty.index(idx), count=1)  # every wgmma reading Q_i and dO_i has retired
    _dq_drain(dq, dq_smem, desc_dq, b, h, q_row, CID)
    nidx, nphase = next_slot(idx, phase, NUM)
    return dk, dv, nidx, nphase


@gluon.jit
def _deferred_step(k_smem, v_c, q_ring, do_ring, l2_ring, delta_ring, ready, empty, ds_smem, ds_ready, go, dq_smem,
                   desc_dq, dk, dv, idx, phase, step, b, h, q_row, offs_n, qk_scale, masked, CID: gl.constexpr,
                   EXACT: gl.constexpr):
    """One query tile, the deferred ping-pong schedule (BwdTile.pingpong): the dQ wgmmas of step - 2 (LAG = 2, from
    4 dS^T buffers) are issued here, ahead of this step's S^T, and drained (stored, reduced) while S^T runs, so the
    dQ tail no longer stands between two steps' tensor-core work; dP^T is issued after the drain, so at most two
    accumulators besides dK and dV are live (issuing it before the drain spilled at d=128). The slot is released as
    soon as dK retires (dQ does not read it). At the end of a step this consumer waits for the other one's step - 1
    only, so either may run up to a step ahead; consumer 1 starts when consumer 0 has drained in its step 0, so that
    one's softmax falls under the other's wgmmas (FA3's ping-pong, by mbarriers and a start offset instead of named
    barriers). Steps 0 and 1 issue a dQ of whatever buffer step - 2 would use and drop it (to keep one loop: a peeled
    step spilled); the consumer's epilogue issues the last two steps' dQ."""
    NUM: gl.constexpr = q_ring.shape[0]
    BM: gl.constexpr = q_ring.shape[3]
    BNC: gl.constexpr = k_smem.shape[3]
    DQ: gl.constexpr = dq_smem.shape[4]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    k_c = as_2d(k_smem, CID)
    q_s = as_2d(q_ring, idx)
    do_s = as_2d(do_ring, idx)
    s_shape = gl.zeros([BNC, BM], gl.float32, s_layout)  # only gives S^T and dP^T their layout (use_acc=False)
    LAG: gl.constexpr = 2  # dQ issued LAG steps late
    gl.static_assert(ds_smem.shape[0] == 2 * LAG, "4 dS^T buffers")

    mbarrier.wait(ready.index(idx), phase)
    # step - 2's dQ, from the buffer of 4 two away (its dS^T are written: this consumer waited on ds_ready for the
    # other consumer's step - 1 at the end of step - 1, which came after that one's step - 2)
    dq = _dq_issue(ds_smem.index((step & 3) ^ 2), k_smem, DQ, CID)
    s_t = warpgroup_mma(k_c, q_s.permute((1, 0)), s_shape, use_acc=False, is_async=True)
    dq = warpgroup_mma_wait(1, deps=(dq, ))  # the dQ wgmmas retired (issued first); S^T may still run
    if step >= LAG:
        _dq_drain(dq, dq_smem, desc_dq, b, h, q_row - LAG * BM, CID)
    if CID == 0:
        if step == 0:  # the other consumer starts now, a fraction of a step behind (see _consumer)
            mbarrier.arrive(go, count=1)
    dp_t = warpgroup_mma(v_c, do_s.permute((1, 0)), s_shape, use_acc=False, is_async=True)
    # dS^T's buffer was last read by both consumers' dQ wgmmas of step - 4, issued at the start of step - 2: this
    # one retired its own there, the other one its own before it arrived on ds_ready at the end of step - 2, which
    # this one waited for at the end of step - 1
    ds_buf = ds_smem.index(step & 3)
    dk, dv = _grads_of_step(s_t, dp_t, q_s, do_s, l2_ring.index(idx), delta_ring.index(idx), ds_buf, dk, dv, q_row,
                            offs_n, qk_scale, masked, CID, EXACT)
    mbarrier.arrive(empty.index(idx), count=1)  # S, dP, dV, dK (every wgmma reading Q_i and dO_i) retired
    gl.thread_barrier()  # every thread's dS^T is written (and fenced) before one thread arrives
    # 4 buffers and barriers; wait for the other consumer's step - 1 only (phase 1 passes at step 0)
    j4 = step & 3
    mbarrier.arrive(ds_ready.index(j4), count=1)
    mbarrier.wait(ds_ready.index((j4 + 3) & 3), ((step + 3) // 4 + 1) & 1)
    nidx, nphase = next_slot(idx, phase, NUM)
    return dk, dv, nidx, nphase


@gluon.jit
def _dq_last(ds_smem, k_smem, dq_smem, desc_dq, b, h, m_first, step, CID: gl.constexpr):
    """The ping-pong schedule's epilogue: one of the last steps' dQ, issued, waited for and drained."""
    BM: gl.constexpr = ds_smem.shape[2]
    dq = _dq_issue(_ds_buffer(ds_smem, step), k_smem, dq_smem.shape[4], CID)
    dq = warpgroup_mma_wait(0, deps=(dq, ))
    _dq_drain(dq, dq_smem, desc_dq, b, h, (m_first + step) * BM, CID)


@gluon.jit
def _consumer(desc_dk, desc_dv, desc_dq, k_smem, v_smem, q_ring, do_ring, l2_ring, delta_ring, ds_smem, dq_smem,
              kv_bar, ready, empty, ds_ready, go, done, b, h, n0, m_first, n_steps, qk_scale, sm_scale,
              CID: gl.constexpr, IS_CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, EXACT: gl.constexpr,
              MASKED_STEPS: gl.constexpr):
    BM: gl.constexpr = q_ring.shape[3]
    BNC: gl.constexpr = k_smem.shape[3]
    D: gl.constexpr = k_smem.shape[4]
    dtype: gl.constexpr = desc_dk.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    k_c = as_2d(k_smem, CID)
    v_c = as_2d(v_smem, CID)
    key0 = n0 + CID * BNC
    offs_n = key0 + gl.arange(0, BNC, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([BNC, D], gl.float32, kv_layout)
    dv = gl.zeros([BNC, D], gl.float32, kv_layout)
    mbarrier.wait(kv_bar, 0)

    idx = 0
    phase = 0
    n_masked = 0
    if IS_CAUSAL:  # the diagonal's query tiles come first
        n_masked = gl.minimum(n_steps, MASKED_STEPS)
    # One loop with a branch for the diagonal's tiles: peeling them into a loop of their own (as the forward does)
    # left more values live across the two loops, and the unmasked loop spilled at d=128
    if PINGPONG:
        if CID == 1:
            if n_steps > 0:  # consumer 0 arrives once, in its step 0
                mbarrier.wait(go, 0)
        for i in range(0, n_steps):
            dk, dv, idx, phase = _deferred_step(k_smem, v_c, q_ring, do_ring, l2_ring, delta_ring, ready, empty,
                                                ds_smem, ds_ready, go, dq_smem, desc_dq, dk, dv, idx, phase, i, b,
                                                h, (m_first + i) * BM, offs_n, qk_scale, i < n_masked, CID, EXACT)
        # the dQ of the last two steps, which no next step issues (one loop, as two copies kept more values live
        # through the main loop and spilled there)
        LAG: gl.constexpr = 2
        for t in range(gl.maximum(n_steps - LAG, 0), n_steps):
            if t == n_steps - 1:  # the other consumer's last step (step - 2's was waited for in the loop)
                mbarrier.wait(ds_ready.index(t % 4), (t // 4) & 1)
            _dq_last(ds_smem, k_smem, dq_smem, desc_dq, b, h, m_first, t, CID)
    else:
        for i in range(0, n_steps):
            dk, dv, idx, phase = _query_step(k_smem, v_c, q_ring, do_ring, l2_ring, delta_ring, ready, empty, ds_smem,
                                             ds_ready, dq_smem, desc_dq, dk, dv, idx, phase, i, b, h,
                                             (m_first + i) * BM, offs_n, qk_scale, i < n_masked, CID, EXACT)

    # dK and dV leave through this consumer's K and V buffers, rows past the last key clipped. The other consumer's
    # dQ wgmmas read this one's K rows too, so wait until both have left the loop (each retired its last dQ wgmma
    # before arriving)
    v_c.store(dv.to(dtype))
    gl.thread_barrier()
    mbarrier.arrive(done, count=1)
    mbarrier.wait(done, 0)
    k_c.store((dk * sm_scale).to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc_dk, [b, h, key0, 0], k_smem.index(CID))
    tma.async_copy_shared_to_global(desc_dv, [b, h, key0, 0], v_smem.index(CID))
    tma.store_wait(0)  # also the last reduce-add


# Lengths and counts enter only addresses and loop bounds: not specialised on, so new lengths do not recompile.
@gluon.jit(do_not_specialize=["H", "n_queries", "n_kv_tiles"])
def _flash_bwd_gluon_kernel(desc_q, desc_k, desc_v, desc_do, desc_dk, desc_dv, desc_dq, desc_l2, desc_delta,
                            H, n_queries, n_kv_tiles, qk_scale, sm_scale,
                            IS_CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, EXACT: gl.constexpr,
                            NUM_SLOTS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    BM: gl.constexpr = desc_q.block_type.shape[2]
    BNC: gl.constexpr = desc_k.block_type.shape[2]
    D: gl.constexpr = desc_q.block_type.shape[3]
    DQ: gl.constexpr = desc_dq.block_type.shape[3]
    dtype: gl.constexpr = desc_q.dtype
    DS_BUFFERS: gl.constexpr = 4 if PINGPONG else 2
    k_smem = gl.allocate_shared_memory(dtype, [_CONSUMERS, 1, 1, BNC, D], desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [_CONSUMERS, 1, 1, BNC, D], desc_v.layout)
    q_ring = gl.allocate_shared_memory(dtype, [NUM_SLOTS, 1, 1, BM, D], desc_q.layout)
    do_ring = gl.allocate_shared_memory(dtype, [NUM_SLOTS, 1, 1, BM, D], desc_do.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [DS_BUFFERS, _CONSUMERS * BNC, BM],
                                        gl.NVMMASharedLayout.get_default_for([_CONSUMERS * BNC, BM], dtype))
    dq_smem = gl.allocate_shared_memory(gl.float32, [_CONSUMERS, 1, 1, BM, DQ], desc_dq.layout)
    l2_ring = gl.allocate_shared_memory(gl.float32, [NUM_SLOTS, 1, BM], desc_l2.layout)
    delta_ring = gl.allocate_shared_memory(gl.float32, [NUM_SLOTS, 1, BM], desc_delta.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_SLOTS, 1], mbarrier.MBarrierLayout())
    DS_READY: gl.constexpr = 4 if PINGPONG else 2
    ds_ready = gl.allocate_shared_memory(gl.int64, [DS_READY, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(NUM_SLOTS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=_CONSUMERS)
    for i in gl.static_range(DS_READY):
        mbarrier.init(ds_ready.index(i), count=_CONSUMERS)
    if PINGPONG:  # consumer 0 -> consumer 1: start (once)
        go = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(go, count=1)
    else:
        go = done  # a placeholder: only ping-pong reads it
    mbarrier.init(done, count=_CONSUMERS)

    pid = gl.program_id(0)
    bh = pid // n_kv_tiles
    kv_tile = pid % n_kv_tiles  # causal: the first key tiles see the most queries
    b = bh // H
    h = bh % H
    n0 = kv_tile * (_CONSUMERS * BNC)
    m_first = 0
    if IS_CAUSAL:
        m_first = n0 // BM
    n_steps = gl.maximum(gl.cdiv(n_queries, BM) - m_first, 0)
    MASKED_STEPS: gl.constexpr = _CONSUMERS * BNC // BM
    gl.warp_specialize([
        (_consumer, (desc_dk, desc_dv, desc_dq, k_smem, v_smem, q_ring, do_ring, l2_ring, delta_ring, ds_smem,
                     dq_smem, kv_bar, ready, empty, ds_ready, go, done, b, h, n0, m_first, n_steps, qk_scale,
                     sm_scale, 0, IS_CAUSAL, PINGPONG, EXACT, MASKED_STEPS)),
        (_consumer, (desc_dk, desc_dv, desc_dq, k_smem, v_smem, q_ring, do_ring, l2_ring, delta_ring, ds_smem,
                     dq_smem, kv_bar, ready, empty, ds_ready, go, done, b, h, n0, m_first, n_steps, qk_scale,
                     sm_scale, 1, IS_CAUSAL, PINGPONG, EXACT, MASKED_STEPS)),
        (_producer, (desc_q, desc_do, desc_k, desc_v, desc_l2, desc_delta, k_smem, v_smem, q_ring, do_ring, l2_ring,
                     delta_ring, kv_bar, ready, empty, b, h, bh, n0, m_first, n_steps)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _dq_layout(swizzle: int) -> gl.NVMMASharedLayout:
    """The shared layout of the float32 dQ tile (BwdTile.dq_swizzle)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=32, rank=4)


def kernel_launch(q, k, v, do, dk, dv, dq_acc, lse2, delta, is_causal: bool, scale: float, exact: bool = False):
    """The main kernel's arguments, grid and launch options for 4-d tensors, without touching a device (so that
    `bench.flash_gluon_bwd_resources` compiles exactly what a launch would)."""
    tile = tile_for(q.shape[-1])
    batch, heads, n_queries, _ = q.shape
    n_kv_tiles = cdiv(k.shape[-2], tile.block_n)
    bnc = tile.keys_per_consumer
    args = (descriptor(q, tile.block_m), descriptor(k, bnc), descriptor(v, bnc), descriptor(do, tile.block_m),
            descriptor(dk, bnc), descriptor(dv, bnc),
            float32_descriptor(dq_acc, [1, 1, tile.block_m, tile.dq_columns], _dq_layout(tile.dq_swizzle)),
            float32_descriptor(lse2, [1, tile.block_m]), float32_descriptor(delta, [1, tile.block_m]),
            heads, n_queries, n_kv_tiles, scale * LOG2E, scale, is_causal, tile.pingpong, exact, tile.num_slots,
            tile.consumer_registers, tile.producer_registers)
    grid = (n_kv_tiles * batch * heads,)
    return args, grid, {"num_warps": 4, "maxnreg": tile.maxnreg}


# The backward's two launches, as the forward's: after the first call per layout, the compiled binary directly
# (host/launch.py), skipping Triton's JIT path that a short call feels. The main kernel's arguments include TMA
# descriptors, which `descriptor_launch_key` keys by their base tensor's layout and their box.
PREPROCESS = FastLauncher(_bwd_preprocess_kernel)
LAUNCHER = FastLauncher(_flash_bwd_gluon_kernel, key=descriptor_launch_key)


def backward_problem(q, k, v, o, do, lse) -> str | None:
    """What in these inputs the kernel does not take, or None; the device is checked last, so that shape and dtype
    problems are named on any device. dO that TMA cannot read is copied, not refused."""
    problem = layout_problem(q, k, v)
    if problem:
        return problem.replace("flash_gluon:", "flash_gluon_bwd:")
    if o.shape != q.shape or do.shape != q.shape or o.dtype != q.dtype or do.dtype != q.dtype:
        return (f"flash_gluon_bwd: o {tuple(o.shape)} {o.dtype} and do {tuple(do.shape)} {do.dtype} must match q "
                f"{tuple(q.shape)} {q.dtype}")
    if lse.shape != q.shape[:-1] or lse.dtype != torch.float32 or not lse.is_contiguous():
        return (f"flash_gluon_bwd: lse must be contiguous float32 of shape {tuple(q.shape[:-1])}, got "
                f"{tuple(lse.shape)} {lse.dtype} contiguous={lse.is_contiguous()}")
    if not (q.device == o.device == do.device == lse.device):
        return (f"flash_gluon_bwd: q, o, do, lse must be on one device, got {q.device}, {o.device}, {do.device}, "
                f"{lse.device}")
    problem = device_problem(q)
    if problem:
        return problem.replace("flash_gluon:", "flash_gluon_bwd:")
    return tma_reduce_problem()


def gluon_backward_supported(q, k, v, o, do, lse) -> bool:
    """Whether flash_backward_gluon takes these inputs (backward_problem says why not)."""
    return backward_problem(q, k, v, o, do, lse) is None


# The backward's plans by (the layout of q, k, v, o, do, lse, is_causal, scale, exact)
_PLANS = PLANS.table("gluon_backward")
# By (the layout of q, k, v, is_causal), then by the strides of the dO its kernels read: the first plan of such inputs
# and dO whose O and L were as the forward makes them (O in q's layout, L contiguous), with the strides of its dQ:
# `native_calls` finds them without O in hand, as FA2's plans of inputs.
_PLANS_OF_INPUTS = PLANS.table("gluon_backward_of_inputs")


def flash_backward_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
                         lse: torch.Tensor, causal: bool, scale: float | None = None, *, exact: bool = False,
                         checked: bool = False, fast_launch: bool | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV (each in its input's dtype and layout) of softmax attention O = softmax(scale Q K^T) V, from
    the forward's O and natural-log logsumexp L (as FA2's backward takes them): q, o, do (..., n_q, d), k, v
    (..., n_k, d), one or two leading dims. scale defaults to 1/sqrt(d), the forwards' scale (L must have been
    computed with the same one). Raises ValueError naming what is unsupported. `exact` (tests only): P^T = S^T mod
    8 in place of the softmax, L unused; with integer inputs, O = 0 (so D = 0) and scale 1 every value is an exact
    integer, so the whole pipeline is checkable bit for bit. `checked`: the caller has just found no
    `backward_problem` in these inputs (the dispatch's choice has), so they are not looked for again.
    `fast_launch`: the caller's `FlashSettings.fast_launch`, where it has read the settings (None: read them, once
    for both launches)."""
    if fast_launch is None:
        fast_launch = flash_settings().fast_launch
    key = (layout(q, k, v, o, do, lse), causal, scale, exact)
    plan = _PLANS.get(key) if fast_launch else None
    if plan is not None:  # this layout ran (checked) before: the same checks would pass
        return plan.run(q, k, v, o, do, lse)
    problem = None if checked else backward_problem(q, k, v, o, do, lse)
    if problem:
        raise ValueError(problem)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    tile = tile_for(q.shape[-1])
    q4, k4, v4, o4, do4 = map(as_4d, (q, k, v, o, do))
    copy_do = tma_problem("do", do4) is not None
    if copy_do:
        do4 = do4.contiguous()  # e.g. the stride-0 dO of o.sum().backward()
    batch, heads, n_queries, head_dim = q4.shape
    n_pad = padded_queries(n_queries, tile)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dk4, dv4 = as_4d(dk), as_4d(dv)
    for name, grad, t in (("dk", dk4, k4), ("dv", dv4, v4)):
        # empty_like keeps a dense input's strides, which the checks found TMA-ready, in a fresh (aligned)
        # allocation; any other input (overlapping, with gaps) gets strides of its own: check what TMA will write
        problem = tma_problem(name, grad) if grad.stride() != t.stride() else None
        if problem:
            raise ValueError(problem)
    dq4 = as_4d(dq)
    dq_acc = dq_accumulator(dq4)
    lse2 = torch.empty(batch * heads, n_pad, dtype=torch.float32, device=q.device)
    delta = torch.empty_like(lse2)
    pre_grid = (n_pad // tile.block_m, batch * heads)
    pre_args = (o4, do4, lse, lse2, delta, dq_acc, *o4.stride(), *do4.stride(), *dq_acc.stride(), heads, n_queries,
                n_pad)
    pre_options = {"HEAD_DIM": head_dim, "BLOCK": tile.block_m}
    PREPROCESS(pre_grid, *pre_args, fast_launch=fast_launch, **pre_options)  # zeroes the accumulator too
    args, grid, options = kernel_launch(q4, k4, v4, do4, dk4, dv4, dq_acc, lse2, delta, causal, scale, exact)
    LAUNCHER(grid, *args, fast_launch=fast_launch, **options)
    # dQ = accumulator * scale, rounded to q's dtype into q's layout: one elementwise pass (a separate in-place
    # scale and cast copy read and wrote the float32 accumulator once more, and cost a launch more)
    torch.mul(dq_acc, scale, out=dq4)
    if fast_launch:  # only once it ran: a call that raised leaves no plan
        preprocess = PREPROCESS.bound(pre_grid, pre_args, pre_options)
        main = DescriptorPlan.after(LAUNCHER, grid, args, options, per_call=0)
        if preprocess is not None and main is not None:
            plan = _PLANS[key] = BackwardPlan(copy_do, lse2.shape, (preprocess[0], (*pre_args[6:], *preprocess[1]),
                                                                    *preprocess[2:]), main, scale)
            # the plan of these inputs for the C++ node: O and L as the forward makes them, the default scale
            if (not exact and key[2] is None and o.stride() == q.stride() and lse.is_contiguous()
                    and o.data_ptr() % 16 == 0 == lse.data_ptr() % 16):
                grad_strides = contiguous_strides(do.shape) if copy_do else do.stride()
                _PLANS_OF_INPUTS.setdefault((key[0][:3], causal), {}).setdefault(grad_strides, (plan, dq.stride()))
    return dq, dk, dv


def native_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
                 ) -> tuple[list[tuple[tuple[int, ...], list[node.KernelCall]]], list, float] | None:
    """The backward's launches for the C++ node's plan of these inputs' layout, once a backward of such inputs
    with the forward's O and L has run here with fast launch (None before): ([(dO strides, the two launches), ...]
    for each dO layout planned so, the first planned first; the scratch buffers; dQ's scale). The scratch buffers
    and the scale depend on q's layout alone, so every dO layout's plan gives the same."""
    found = _PLANS_OF_INPUTS.get((layout(q, k, v), is_causal))
    if not found:
        return None
    variants, scratch, scale = [], None, 0.0
    for grad_strides, (plan, dq_strides) in found.items():
        calls, scratch, scale = plan.native(dq_strides, tuple(q.shape))
        variants.append((grad_strides, calls))
    return variants, scratch, scale
