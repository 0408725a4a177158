"""FlashAttention backward for Hopper (sm_90) in Triton's Gluon: warp-specialised, FA3-shaped (issue #26, stage 2).

Inputs are what the forwards write (`flash_gluon` and `flash_triton` alike): Q, K, V, O, dO and L, the natural-log
logsumexp (float32, contiguous q.shape[:-1]). Three launches:
  1. preprocessing (plain Triton): L2 = L * log2(e) and D = rowsum(dO * O), both float32, one row per (batch·head)
     padded to a whole number of query tiles (L2 = +inf and D = 0 past the last query, so padded queries give
     P = 0 and need no mask in the main loop); and the float32 dQ accumulator zeroed;
  2. the main kernel, one program (CTA) per key tile of BLOCK_N = 128 keys of one (batch, head), in three
     partitions (Shah et al., FlashAttention-3, 2024, section 3.3, as we read it; the code is ours):
       consumer c = 0, 1 (one warpgroup each)  keys [64 c, 64 c + 64) of the tile: dK_c and dV_c in float32
                                               registers, accumulated over the query tiles
       producer (one warp)                     TMA loads of K and V once, of Q_i and dO_i into a ring of slots
     Per query tile i of BLOCK_M = 64 rows, each consumer computes, transposed (keys along the rows, so that the
     16-bit P^T and dS^T are the register A operand of the next wgmmas):
       S^T = K_c Q_i^T,  dP^T = V_c dO_i^T                    (two async wgmmas from shared memory)
       P^T = exp2(S^T * scale * log2(e) - L2_i)               (masked on the causal diagonal)
       dV_c += P^T dO_i,  dS^T = P^T (dP^T - D_i),  dK_c += dS^T Q_i   (register-A wgmmas)
       dQ_i += dS_i K: both consumers' dS^T go to shared memory (two buffers, by step parity); once both are
       written, consumer c computes columns [c d/2, (c+1) d/2) of dS_i K over the program's 128 keys (two wgmmas
       reading dS^T transposed) and adds its (64, d/2) float32 part to a float32 dQ accumulator in global memory
       by a TMA reduce-add (`_tma_reduce_add`). Splitting the head dim, not the keys, halves both the dQ
       registers (d=128 did not fit 240 registers otherwise: BwdTile.split_dq=False keeps the per-consumer
       variant, which spills there) and the reduce-add traffic;
  3. dQ = accumulator * scale, cast to q's dtype into q's layout (one torch multiply).
Two schedules of a consumer's step (BwdTile.defer_dq; TILES ships it, as ping-pong, at d=128 only, where it was
measured faster: kernels/NOTES.md): lockstep (`_query_step`) issues, waits for
and reduces step i's dQ at the end of step i; deferred (`_deferred_step`) issues step i's dQ wgmmas at the start of
step i + 1, just before S^T, and stores and reduces them while S^T runs (the tail overlaps this consumer's own
tensor-core work), and frees the slot as soon as dK retires. Either may keep two float32 dQ buffers per consumer
(BwdTile.dq_buffers = 2, by step parity): writing one then waits (`tma.store_wait(1)`) only for the reduce-add of
two steps ago, not the last one.

Barrier protocol (every mbarrier counts phases; a fresh one passes a wait on parity 1):
  kv_bar                producer -> consumers: both consumers' K and V sub-tiles landed (expect-tx bytes)
  ready[i]              producer -> consumers: slot i holds Q, dO, L2 and D of the next query tile (expect-tx)
  empty[i]              consumers -> producer: both consumers' wgmmas reading slot i have retired (count 2)
  ds_ready[p]           consumer <-> consumer: both dS^T of a step of parity p are in shared memory (count 2)
  done                  consumer <-> consumer: both left the loop, so no dQ wgmma reads K any more (count 2)
Hazards kept (triton #9433, #11781): P^T and dS^T in registers are kept alive (`deps` of the wait) until the
wgmmas reading them have retired; a slot is released only after every wgmma reading it (S, dP, dV, dK) has
retired; a dS^T buffer is rewritten two steps after it was read, and the other consumer arrived on ds_ready in
between, after retiring its dQ wgmma of that step; a dQ buffer is rewritten only after the reduce-add reading it
has finished (`tma.store_wait`); dK leaves through K's buffer only after `done`.

Causal (query i sees keys 0..i, aligned at the start, as flash_triton): a key tile starting at key n0 (a multiple
of BLOCK_N) visits query tiles from n0 // BLOCK_M on; only the first two of them (BLOCK_N // BLOCK_M) touch the
diagonal and are masked (a runtime branch inside the one loop: a peeled loop of their own spilled at d=128).
Keys past the end need no mask: their K and V rows load as zeros, so their dS^T rows
meet a zero K row in dQ, and their dK, dV rows are clipped on store. Key tiles at or past the last query (causal,
n_k > n_q) visit nothing and store zeros. Programs are ordered one head after another, heaviest key tile first.

Caveats: sm_90 only; bf16 or fp16; head dims 64 and 128; q, k, v, dO with 16-byte aligned strides and starts (dO
is copied contiguous where it is not, e.g. the stride-0 dO of `o.sum().backward()`); a float32 dQ accumulator of
q's size (4 bytes per element) is allocated per call. TMA reduce-add has no public Gluon call in Triton 3.6:
`_tma_reduce_add` wraps the private builder call and fails with a clear error on a Triton without it.
EXACT (tests only) replaces the softmax by P^T = S^T mod 8, as flash_gluon's EXACT does for the forward.
Written and compiled without a GPU: at d=64 the split dQ reads K in 32-column halves, inside one 128-byte swizzle
atom, which Triton accepted but only a GPU run shows correct (the stage-2 script checks both dQ schemes).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from cs336_systems.kernels import flash_native
from cs336_systems.kernels.flash_gluon import (DescriptorPlan, _as_2d, _as_4d, _descriptor, _next_slot,
                                               descriptor_launch_key, device_problem, layout_problem)
from cs336_systems.kernels.launch import FastLauncher, cdiv, contiguous_strides, layout, on_clear
from cs336_systems.kernels.settings import flash_settings

LOG2E = 1.4426950408889634
CONSUMERS = 2  # consumer warpgroups per program, each owning block_n / CONSUMERS keys
# the most dynamic shared memory a block may have on sm_90 (227 KiB), less 1 KiB for the barriers and the
# compiler's own: tiles beyond it fail at launch, so BwdTile refuses them up front
SHARED_BYTES = 227 * 1024 - 1024
_CONSUMERS = gl.constexpr(CONSUMERS)


@dataclass(frozen=True)
class BwdTile:
    """One program's shape and resources. block_m: query rows per step (a wgmma's M for dQ, its N for S^T);
    block_n: keys per program (= CONSUMERS x 64: a consumer's dK and dV are (64, d) float32 in registers, which at
    d = 128 is 128 of its registers); num_slots: Q/dO ring depth; split_dq: dQ of a step computed once for the
    program's block_n keys, each consumer taking half of the head dim (half the dQ registers and half the
    reduce-add traffic, for a barrier between the consumers each step), else per consumer over its own keys;
    defer_dq: the deferred-dQ schedule (`_deferred_step`: a step's dQ wgmmas are issued at the start of the next
    step, ahead of its S^T, and drained while S^T runs), else the lockstep one (`_query_step`: dQ issued, waited
    for and reduced at the end of its own step); dq_buffers: float32 dQ buffers per consumer, 1, or 2 by step
    parity so that writing one waits only for the reduce-add of two steps ago; pingpong (with defer_dq): the
    consumers need not meet every step (dQ two steps late, 4 dS^T buffers) and start a fraction of a step apart;
    dq_swizzle: the float32 dQ tile's shared-memory swizzle in bytes (TMA's 32, 64 or 128). A consumer stores its
    dQ accumulator with 64-bit stores, each half-warp writing 32 contiguous bytes of each of 4 consecutive rows: the
    128-byte swizzle puts two of those rows on the same banks (two wavefronts a half-warp where one would do; ncu
    counted 4 per store against 2 ideal), the 32-byte one puts the 4 rows in one 128-byte line, at the price of
    4x as many TMA reduce-adds, each 32 bytes wide; registers as in flash_gluon.GluonTile."""

    head_dim: int
    block_m: int = 64
    block_n: int = 128
    num_slots: int = 2
    split_dq: bool = True
    defer_dq: bool = False
    dq_buffers: int = 1
    pingpong: bool = False
    dq_swizzle: int = 128
    consumer_registers: int = 240
    producer_registers: int = 24
    maxnreg: int = 168

    def __post_init__(self):
        for name in ("split_dq", "defer_dq", "pingpong"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{self}: {name} must be a bool, got {getattr(self, name)!r}")
        if self.dq_swizzle not in (32, 64, 128):
            raise ValueError(f"{self}: dq_swizzle must be 32, 64 or 128 (bytes), got {self.dq_swizzle!r}")
        if self.dq_buffers not in (1, 2):
            raise ValueError(f"{self}: dq_buffers must be 1 or 2, got {self.dq_buffers!r}")
        if self.dq_buffers == 2 and self.num_slots % 2:
            raise ValueError(f"{self}: two dQ buffers need an even num_slots (the deferred schedule picks the "
                             "buffer by the slot's parity)")
        if self.shared_bytes() > SHARED_BYTES:
            raise ValueError(f"{self}: its tiles need {self.shared_bytes()} B of shared memory, more than the "
                             f"{SHARED_BYTES} B an sm_90 block may have")
        if self.pingpong and not self.defer_dq:
            raise ValueError(f"{self}: pingpong=True needs defer_dq=True (it is a variant of the deferred schedule)")
        if self.defer_dq and not self.split_dq:
            # with per-consumer dQ, Triton 3.6's ptxas crashed at d=64 and spilled 628 B at d=128
            raise ValueError(f"{self}: defer_dq=True needs split_dq=True (the deferred schedule is written for the "
                             "split dQ only)")
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
        """The dQ columns one consumer computes and reduces per step."""
        return self.head_dim // CONSUMERS if self.split_dq else self.head_dim

    def shared_bytes(self, element_size: int = 2) -> int:
        """Tiles only (the barriers add a few hundred bytes): K and V, the Q/dO ring with its L2 and D rows, dS^T
        (16-bit; two buffers when split) and each consumer's float32 dQ."""
        d = self.head_dim
        kv = 2 * self.block_n * d * element_size
        ring = self.num_slots * self.block_m * (2 * d * element_size + 2 * 4)
        ds = ((4 if self.pingpong else 2) if self.split_dq else 1) * self.block_n * self.block_m * element_size
        dq = CONSUMERS * self.dq_buffers * self.block_m * self.dq_columns * 4
        return kv + ring + ds + dq


# The consumers' step schedules by name, each a whole set of BwdTile fields (so that a name means the same
# whichever one TILES ships): lockstep first, the one the others were measured against (kernels/NOTES.md). The
# lockstep ones take either dQ scheme (the tile's stays); the deferred ones are written for the split dQ only, so
# they set it (a tile with per-consumer dQ gets the split one), and ping-pong's four dS^T buffers fit sm_90's shared
# memory only with 64-query steps (at 128, d=64: 264,192 B), so it sets that too (TILES[64] steps 128 queries).
SCHEDULES = {
    "lockstep": {"defer_dq": False, "dq_buffers": 1, "pingpong": False},
    "deferred": {"defer_dq": True, "dq_buffers": 1, "pingpong": False, "split_dq": True},
    "lockstep_dq2": {"defer_dq": False, "dq_buffers": 2, "pingpong": False},
    "deferred_dq2": {"defer_dq": True, "dq_buffers": 2, "pingpong": False, "split_dq": True},
    "pingpong": {"defer_dq": True, "dq_buffers": 1, "pingpong": True, "split_dq": True, "block_m": 64},
}

# Shared memory (tiles): d=128, 2 slots, ping-pong: 225 KiB of the H100's 227 KiB; d=64, 2 slots: 113 KiB.
# d=128 runs ping-pong (one H200, results/diagnosis/flash_gluon_bwd_v2/: 0.952x lockstep's time at the 8B
# shape, 0.983x at 4 x 32 x 4096); d=64 stays lockstep (ping-pong took 1.02-1.04x there), with 128 queries a step,
# split dQ and a two-slot ring. Its consumers spill (48-124 B a thread, ptxas of Triton 3.6: a consumer holds S^T and
# dP^T of 64 x 128 beside dK and dV), and it is still the fastest measured: in the d=64 tile search's second run
# (results/diagnosis/flash_gluon_d64/run2/, H100, f63684a) 0.91-0.99x the time of the 64-query tile shipped before at
# its five shapes, 0.937x their geometric mean, the best of the block_m 128 tiles (per-consumer, deferred dQ).
# d=64 stores dQ through a 32-byte swizzle (BwdTile.dq_swizzle; spills 12-84 B instead of 48-124 B): 0.971-0.978x
# the 128-byte swizzle's main-kernel time at three d=64 points, where d=128 took 1.013-1.088x at five, and in a second
# run 0.937-1.026x at seven d=64 points, median 0.986 (results/diagnosis/flash_gluon_ab/backward_dq_swizzle32_*.csv,
# H100; kernels/NOTES.md, "Two softmax changes and the dQ tile's swizzle": its 32-byte reduce-adds load L2 more).
TILES = {64: BwdTile(64, block_m=128, num_slots=2, dq_swizzle=32),
         128: BwdTile(128, num_slots=2, defer_dq=True, pingpong=True)}


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


# ----------------------------------------------------------------------------------------------
# TMA reduce-add: Triton 3.6 has the op (the builder's create_async_tma_reduce, used by its own Blackwell kernels
# and lowered for sm_90 as cp.reduce.async.bulk.tensor) but no public Gluon call. Kept here, alone.
# ----------------------------------------------------------------------------------------------
def tma_reduce_problem() -> str | None:
    """Why this Triton cannot build the reduce-add, or None."""
    from triton._C.libtriton import gluon_ir, ir

    if not hasattr(gluon_ir.GluonOpBuilder, "create_async_tma_reduce") or not hasattr(ir, "DESCRIPTOR_REDUCE_KIND"):
        return (f"flash_gluon_bwd: TMA reduce-add uses Triton 3.6's private GluonOpBuilder.create_async_tma_reduce, "
                f"which Triton {triton.__version__} does not have; port _tma_reduce_add to this version's public "
                "call if it has one")
    return None


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """global[coord box] += src (a shared-memory tile), asynchronously; complete with tma.store_wait."""
    problem = tma_reduce_problem()
    if problem:
        raise RuntimeError(problem)
    from triton._C.libtriton import ir

    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


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
        idx, phase = _next_slot(idx, phase, NUM)


@gluon.jit
def _ds_buffer(ds_smem, step, SPLIT_DQ: gl.constexpr):
    """The dS^T buffer of a step: by step modulo the buffers when split (both consumers read it: 2 buffers, 4 with
    BwdTile.pingpong), else the one buffer. `step` must not be negative (pass step + buffers for step - k)."""
    NDS: gl.constexpr = ds_smem.shape[0]
    if SPLIT_DQ:
        return ds_smem.index(step % NDS)
    else:
        return ds_smem.index(0)


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
def _dq_issue(ds_buf, k_smem, DQ: gl.constexpr, CID: gl.constexpr, SPLIT_DQ: gl.constexpr):
    """The async wgmma(s) of a step's dQ rows from its dS^T buffer (in flight on return). Split: dQ_i[:, this
    half] = sum over the consumers' key blocks j of dS_ij K_j[:, this half]; else dS_i K over this consumer's keys."""
    BM: gl.constexpr = ds_buf.shape[1]
    BNC: gl.constexpr = k_smem.shape[3]
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DQ, 16])
    if SPLIT_DQ:
        dq = warpgroup_mma(ds_buf.slice(0, BNC).permute((1, 0)), _as_2d(k_smem, 0).slice(CID * DQ, DQ, dim=1),
                           gl.zeros([BM, DQ], gl.float32, dq_layout), use_acc=False, is_async=True)
        dq = warpgroup_mma(ds_buf.slice(BNC, BNC).permute((1, 0)), _as_2d(k_smem, 1).slice(CID * DQ, DQ, dim=1),
                           dq, is_async=True)
    else:
        dq = warpgroup_mma(ds_buf.slice(CID * BNC, BNC).permute((1, 0)), _as_2d(k_smem, CID),
                           gl.zeros([BM, DQ], gl.float32, dq_layout), use_acc=False, is_async=True)
    return dq


@gluon.jit
def _dq_drain(dq, dq_smem, desc_dq, b, h, q_row, step, CID: gl.constexpr, SPLIT_DQ: gl.constexpr):
    """A retired dQ part of a step into this consumer's float32 buffer (one, or two by step parity: BwdTile.
    dq_buffers; `step` is only read for its parity) and on by TMA reduce-add into the accumulator."""
    NB: gl.constexpr = dq_smem.shape[0] // _CONSUMERS  # dQ buffers per consumer: 1 or 2
    BM: gl.constexpr = dq_smem.shape[3]
    DQ: gl.constexpr = dq_smem.shape[4]
    if NB == 1:
        dq_c = dq_smem.index(CID)
    else:
        dq_c = dq_smem.index(CID * 2 + (step & 1))
    # the reduce-add that last read dq_c (NB steps ago) has finished; the NB - 1 later ones may still run
    tma.store_wait(NB - 1)
    dq_c.reshape([BM, DQ]).store(dq)
    fence_async_shared()
    if SPLIT_DQ:
        _tma_reduce_add(desc_dq, [b, h, q_row, CID * DQ], dq_c)
    else:
        _tma_reduce_add(desc_dq, [b, h, q_row, 0], dq_c)


@gluon.jit
def _query_step(k_smem, v_c, q_ring, do_ring, l2_ring, delta_ring, ready, empty, ds_smem, ds_ready, dq_smem, desc_dq,
                dk, dv, idx, phase, step, b, h, q_row, offs_n, qk_scale, masked, CID: gl.constexpr,
                SPLIT_DQ: gl.constexpr, EXACT: gl.constexpr):
    """One query tile (rows q_row..q_row+BM) against this consumer's keys, the lockstep schedule: dK, dV
    accumulated, then this step's dQ computed, waited for and reduced. SPLIT_DQ: dQ_i = dS_i K over both consumers'
    keys, each consumer taking half of the head dim (both dS^T in shared memory, buffered by step parity, ds_ready
    says both are written); else each consumer reduces its own keys' (BM, d) partial."""
    NUM: gl.constexpr = q_ring.shape[0]
    BM: gl.constexpr = q_ring.shape[3]
    BNC: gl.constexpr = k_smem.shape[3]
    DQ: gl.constexpr = dq_smem.shape[4]  # dQ columns this consumer reduces: D / 2 when split, else D
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    k_c = _as_2d(k_smem, CID)
    q_s = _as_2d(q_ring, idx)
    do_s = _as_2d(do_ring, idx)
    s_shape = gl.zeros([BNC, BM], gl.float32, s_layout)  # only gives S^T and dP^T their layout (use_acc=False)

    mbarrier.wait(ready.index(idx), phase)
    s_t = warpgroup_mma(k_c, q_s.permute((1, 0)), s_shape, use_acc=False, is_async=True)
    dp_t = warpgroup_mma(v_c, do_s.permute((1, 0)), s_shape, use_acc=False, is_async=True)
    # dS^T's buffer was last read by the dQ wgmmas of step - 2 (split: both consumers'; the other one's retired
    # before it arrived on ds_ready in step - 1, which this one waited for) or step - 1 (not split: this
    # consumer's own, waited on below)
    ds_buf = _ds_buffer(ds_smem, step, SPLIT_DQ)
    dk, dv = _grads_of_step(s_t, dp_t, q_s, do_s, l2_ring.index(idx), delta_ring.index(idx), ds_buf, dk, dv, q_row,
                            offs_n, qk_scale, masked, CID, EXACT)
    if SPLIT_DQ:
        gl.thread_barrier()  # every thread's dS^T is written (and fenced) before one thread arrives
        mbarrier.arrive(ds_ready.index(step % 2), count=1)
        mbarrier.wait(ds_ready.index(step % 2), (step // 2) & 1)
    dq = _dq_issue(ds_buf, k_smem, DQ, CID, SPLIT_DQ)
    dq = warpgroup_mma_wait(0, deps=(dq, ))
    mbarrier.arrive(empty.index(idx), count=1)  # every wgmma reading Q_i and dO_i has retired
    _dq_drain(dq, dq_smem, desc_dq, b, h, q_row, step, CID, SPLIT_DQ)
    nidx, nphase = _next_slot(idx, phase, NUM)
    return dk, dv, nidx, nphase


@gluon.jit
def _deferred_step(k_smem, v_c, q_ring, do_ring, l2_ring, delta_ring, ready, empty, ds_smem, ds_ready, go, dq_smem,
                   desc_dq, dk, dv, idx, phase, step, b, h, q_row, offs_n, qk_scale, masked, CID: gl.constexpr,
                   SPLIT_DQ: gl.constexpr, PINGPONG: gl.constexpr, EXACT: gl.constexpr):
    """One query tile, the deferred-dQ schedule (BwdTile.defer_dq): the previous step's dQ wgmmas are issued here,
    ahead of this step's S^T, and drained (stored, reduced) while S^T runs, so the dQ tail no longer stands between
    two steps' tensor-core work; dP^T is issued after the drain, so at most two accumulators besides dK and dV are
    live (issuing it before the drain spilled 512 B at d=128). The slot is released as soon as dK retires (dQ does
    not read it). The consumers still meet on ds_ready at the end of each step: waiting there at the start of the
    next step instead (looser lockstep) made Triton 3.6's ptxas 12.8 crash (SIGSEGV), in every placement tried.
    Step 0 issues a dQ of whatever buffer step - 1 would use and drops it (one wgmma pair per program, to keep
    one loop: a peeled step spilled before); the consumer's epilogue issues the last step's dQ. Split dQ only
    (BwdTile refuses defer_dq without split_dq).
    PINGPONG (BwdTile.pingpong): the dQ of step - 2 (LAG = 2) instead, from 4 dS^T buffers, and at the end of a step
    this consumer waits for the other one's step - 1 only, so either may run up to a step ahead; consumer 1 starts
    when consumer 0 has drained in its step 0, so that one's softmax falls under the other's wgmmas (FA3's
    ping-pong, by mbarriers and a start offset instead of named barriers)."""
    NUM: gl.constexpr = q_ring.shape[0]
    BM: gl.constexpr = q_ring.shape[3]
    BNC: gl.constexpr = k_smem.shape[3]
    DQ: gl.constexpr = dq_smem.shape[4]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    k_c = _as_2d(k_smem, CID)
    q_s = _as_2d(q_ring, idx)
    do_s = _as_2d(do_ring, idx)
    s_shape = gl.zeros([BNC, BM], gl.float32, s_layout)  # only gives S^T and dP^T their layout (use_acc=False)
    gl.static_assert(SPLIT_DQ, "the deferred-dQ schedule is written for the split dQ only")
    gl.static_assert(NUM % 2 == 0 or dq_smem.shape[0] == _CONSUMERS, "two dQ buffers need an even ring")
    LAG: gl.constexpr = 2 if PINGPONG else 1  # dQ issued LAG steps late
    gl.static_assert(ds_smem.shape[0] == 2 * LAG, "2 dS^T buffers, 4 with pingpong")

    mbarrier.wait(ready.index(idx), phase)
    # step - LAG's dQ (its dS^T are written: this consumer waited on ds_ready for it at the end of step - 1)
    if PINGPONG:  # step - 2's buffer of 4: the one two away
        dq = _dq_issue(ds_smem.index((step & 3) ^ 2), k_smem, DQ, CID, SPLIT_DQ)
    else:  # step - 1's buffer of 2
        dq = _dq_issue(_ds_buffer(ds_smem, step + 1, SPLIT_DQ), k_smem, DQ, CID, SPLIT_DQ)
    s_t = warpgroup_mma(k_c, q_s.permute((1, 0)), s_shape, use_acc=False, is_async=True)
    dq = warpgroup_mma_wait(1, deps=(dq, ))  # the dQ wgmmas retired (issued first); S^T may still run
    if step >= LAG:
        # step - LAG by its slot (same parity with an even ring, BwdTile checks): a dQ buffer picked from step - 1
        # itself kept one more value live and spilled 4 B at d=128 with two dQ buffers
        _dq_drain(dq, dq_smem, desc_dq, b, h, q_row - LAG * BM, idx + NUM - LAG, CID, SPLIT_DQ)
    if PINGPONG:
        if CID == 0:
            if step == 0:  # the other consumer starts now, a fraction of a step behind (see _consumer)
                mbarrier.arrive(go, count=1)
    dp_t = warpgroup_mma(v_c, do_s.permute((1, 0)), s_shape, use_acc=False, is_async=True)
    # dS^T's buffer was last read by both consumers' dQ wgmmas of step - 2 LAG, issued at the start of step - LAG:
    # this one retired its own there, the other one its own before it arrived on ds_ready at the end of step - LAG,
    # which this one waited for at the end of step - 1
    if PINGPONG:
        ds_buf = ds_smem.index(step & 3)
    else:
        ds_buf = _ds_buffer(ds_smem, step, SPLIT_DQ)
    dk, dv = _grads_of_step(s_t, dp_t, q_s, do_s, l2_ring.index(idx), delta_ring.index(idx), ds_buf, dk, dv, q_row,
                            offs_n, qk_scale, masked, CID, EXACT)
    mbarrier.arrive(empty.index(idx), count=1)  # S, dP, dV, dK (every wgmma reading Q_i and dO_i) retired
    gl.thread_barrier()  # every thread's dS^T is written (and fenced) before one thread arrives
    if PINGPONG:  # 4 buffers and barriers; wait for the other consumer's step - 1 only (phase 1 passes at step 0)
        j4 = step & 3
        mbarrier.arrive(ds_ready.index(j4), count=1)
        mbarrier.wait(ds_ready.index((j4 + 3) & 3), ((step + 3) // 4 + 1) & 1)
    else:
        mbarrier.arrive(ds_ready.index(step % 2), count=1)
        mbarrier.wait(ds_ready.index(step % 2), (step // 2) & 1)
    nidx, nphase = _next_slot(idx, phase, NUM)
    return dk, dv, nidx, nphase


@gluon.jit
def _dq_last(ds_smem, k_smem, dq_smem, desc_dq, b, h, m_first, step, CID: gl.constexpr, SPLIT_DQ: gl.constexpr):
    """The deferred schedule's epilogue: one of the last steps' dQ, issued, waited for and drained."""
    BM: gl.constexpr = ds_smem.shape[2]
    dq = _dq_issue(_ds_buffer(ds_smem, step, SPLIT_DQ), k_smem, dq_smem.shape[4], CID, SPLIT_DQ)
    dq = warpgroup_mma_wait(0, deps=(dq, ))
    _dq_drain(dq, dq_smem, desc_dq, b, h, (m_first + step) * BM, step, CID, SPLIT_DQ)


@gluon.jit
def _consumer(desc_dk, desc_dv, desc_dq, k_smem, v_smem, q_ring, do_ring, l2_ring, delta_ring, ds_smem, dq_smem,
              kv_bar, ready, empty, ds_ready, go, done, b, h, n0, m_first, n_steps, qk_scale, sm_scale,
              CID: gl.constexpr, IS_CAUSAL: gl.constexpr, SPLIT_DQ: gl.constexpr, DEFER_DQ: gl.constexpr,
              PINGPONG: gl.constexpr, EXACT: gl.constexpr, MASKED_STEPS: gl.constexpr):
    BM: gl.constexpr = q_ring.shape[3]
    BNC: gl.constexpr = k_smem.shape[3]
    D: gl.constexpr = k_smem.shape[4]
    dtype: gl.constexpr = desc_dk.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    k_c = _as_2d(k_smem, CID)
    v_c = _as_2d(v_smem, CID)
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
    if DEFER_DQ:
        if PINGPONG:
            if CID == 1:
                if n_steps > 0:  # consumer 0 arrives once, in its step 0
                    mbarrier.wait(go, 0)
        for i in range(0, n_steps):
            dk, dv, idx, phase = _deferred_step(k_smem, v_c, q_ring, do_ring, l2_ring, delta_ring, ready, empty,
                                                ds_smem, ds_ready, go, dq_smem, desc_dq, dk, dv, idx, phase, i, b,
                                                h, (m_first + i) * BM, offs_n, qk_scale, i < n_masked, CID, SPLIT_DQ,
                                                PINGPONG, EXACT)
        # the dQ of the last steps, which no next step issues (pingpong: the last two; one loop, as two copies
        # kept more values live through the main loop and spilled there)
        LAG: gl.constexpr = 2 if PINGPONG else 1
        for t in range(gl.maximum(n_steps - LAG, 0), n_steps):
            if PINGPONG:
                if t == n_steps - 1:  # the other consumer's last step (step - 2's was waited for in the loop)
                    mbarrier.wait(ds_ready.index(t % 4), (t // 4) & 1)
            _dq_last(ds_smem, k_smem, dq_smem, desc_dq, b, h, m_first, t, CID, SPLIT_DQ)
    else:
        for i in range(0, n_steps):
            dk, dv, idx, phase = _query_step(k_smem, v_c, q_ring, do_ring, l2_ring, delta_ring, ready, empty, ds_smem,
                                             ds_ready, dq_smem, desc_dq, dk, dv, idx, phase, i, b, h,
                                             (m_first + i) * BM, offs_n, qk_scale, i < n_masked, CID, SPLIT_DQ,
                                             EXACT)

    # dK and dV leave through this consumer's K and V buffers, rows past the last key clipped. Split dQ: the other
    # consumer's dQ wgmmas read this one's K rows too, so wait until both have left the loop (each retired its
    # last dQ wgmma before arriving)
    v_c.store(dv.to(dtype))
    if SPLIT_DQ:
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
                            IS_CAUSAL: gl.constexpr, SPLIT_DQ: gl.constexpr, DEFER_DQ: gl.constexpr,
                            PINGPONG: gl.constexpr,
                            EXACT: gl.constexpr, NUM_SLOTS: gl.constexpr, DQ_BUFFERS: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    BM: gl.constexpr = desc_q.block_type.shape[2]
    BNC: gl.constexpr = desc_k.block_type.shape[2]
    D: gl.constexpr = desc_q.block_type.shape[3]
    DQ: gl.constexpr = desc_dq.block_type.shape[3]
    dtype: gl.constexpr = desc_q.dtype
    DS_BUFFERS: gl.constexpr = (4 if PINGPONG else 2) if SPLIT_DQ else 1
    k_smem = gl.allocate_shared_memory(dtype, [_CONSUMERS, 1, 1, BNC, D], desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [_CONSUMERS, 1, 1, BNC, D], desc_v.layout)
    q_ring = gl.allocate_shared_memory(dtype, [NUM_SLOTS, 1, 1, BM, D], desc_q.layout)
    do_ring = gl.allocate_shared_memory(dtype, [NUM_SLOTS, 1, 1, BM, D], desc_do.layout)
    ds_smem = gl.allocate_shared_memory(dtype, [DS_BUFFERS, _CONSUMERS * BNC, BM],
                                        gl.NVMMASharedLayout.get_default_for([_CONSUMERS * BNC, BM], dtype))
    dq_smem = gl.allocate_shared_memory(gl.float32, [_CONSUMERS * DQ_BUFFERS, 1, 1, BM, DQ], desc_dq.layout)
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
                     sm_scale, 0, IS_CAUSAL, SPLIT_DQ, DEFER_DQ, PINGPONG, EXACT, MASKED_STEPS)),
        (_consumer, (desc_dk, desc_dv, desc_dq, k_smem, v_smem, q_ring, do_ring, l2_ring, delta_ring, ds_smem,
                     dq_smem, kv_bar, ready, empty, ds_ready, go, done, b, h, n0, m_first, n_steps, qk_scale,
                     sm_scale, 1, IS_CAUSAL, SPLIT_DQ, DEFER_DQ, PINGPONG, EXACT, MASKED_STEPS)),
        (_producer, (desc_q, desc_do, desc_k, desc_v, desc_l2, desc_delta, k_smem, v_smem, q_ring, do_ring, l2_ring,
                     delta_ring, kv_bar, ready, empty, b, h, bh, n0, m_first, n_steps)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _float32_layout(block: tuple[int, ...]) -> gl.NVMMASharedLayout:
    """The shared layout of a float32 box: pure, so computed once per box (as flash_gluon._shared_layout)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.float32)


def _float32_descriptor(t: torch.Tensor, block: list[int], layout: gl.NVMMASharedLayout | None = None):
    """A TMA descriptor of a float32 tensor with t's strides: the dQ accumulator (batch, head, row, col) in
    (1, 1, block_m, d) boxes, the preprocessed rows (batch·head, padded query) in (1, block_m) boxes (unswizzled:
    one row)."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout or _float32_layout(tuple(block)))


@functools.lru_cache(maxsize=None)
def _dq_layout(swizzle: int) -> gl.NVMMASharedLayout:
    """The shared layout of the float32 dQ tile (BwdTile.dq_swizzle)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=32, rank=4)


def kernel_launch(q, k, v, do, dk, dv, dq_acc, lse2, delta, is_causal: bool, scale: float,
                  tile: BwdTile | None = None, exact: bool = False):
    """The main kernel's arguments, grid and launch options for 4-d tensors, without touching a device (so that
    `bench.flash_gluon_bwd_resources` compiles exactly what a launch would). `tile` overrides TILES (to measure
    an alternative)."""
    tile = tile or tile_for(q.shape[-1])
    batch, heads, n_queries, _ = q.shape
    n_kv_tiles = cdiv(k.shape[-2], tile.block_n)
    bnc = tile.keys_per_consumer
    args = (_descriptor(q, tile.block_m), _descriptor(k, bnc), _descriptor(v, bnc), _descriptor(do, tile.block_m),
            _descriptor(dk, bnc), _descriptor(dv, bnc),
            _float32_descriptor(dq_acc, [1, 1, tile.block_m, tile.dq_columns], _dq_layout(tile.dq_swizzle)),
            _float32_descriptor(lse2, [1, tile.block_m]), _float32_descriptor(delta, [1, tile.block_m]),
            heads, n_queries, n_kv_tiles, scale * LOG2E, scale, is_causal,
            tile.split_dq, tile.defer_dq, tile.pingpong, exact, tile.num_slots, tile.dq_buffers,
            tile.consumer_registers, tile.producer_registers)
    grid = (n_kv_tiles * batch * heads,)
    return args, grid, {"num_warps": 4, "maxnreg": tile.maxnreg}


# The backward's two launches, as the forward's (flash_gluon._LAUNCHER): after the first call per layout, the
# compiled binary directly (launch.py), skipping Triton's JIT path (argument binder, specialisation key, the check of
# the kernel's constexpr globals) that a short call feels. The main kernel's arguments include TMA descriptors, which
# the forward's key function keys by their base tensor's layout and their box.
_PREPROCESS = FastLauncher(_bwd_preprocess_kernel)
_LAUNCHER = FastLauncher(_flash_bwd_gluon_kernel, key=descriptor_launch_key)


def _tma_problem(name: str, t: torch.Tensor) -> str | None:
    if t.stride(-1) != 1 or any(s == 0 or s * t.element_size() % 16 for s in t.stride()[:-1]) or t.data_ptr() % 16:
        return f"flash_gluon_bwd: {name} (strides {t.stride()}) is not a TMA layout"
    return None


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


def flash_backward_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
                         lse: torch.Tensor, causal: bool, scale: float | None = None, tile: BwdTile | None = None, *,
                         checked: bool = False, fast_launch: bool | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV (each in its input's dtype and layout) of softmax attention O = softmax(scale Q K^T) V, from
    the forward's O and natural-log logsumexp L (as flash_triton.flash_backward_triton takes them): q, o, do
    (..., n_q, d), k, v (..., n_k, d), one or two leading dims. scale defaults to 1/sqrt(d), the forwards' scale
    (L must have been computed with the same one). `tile` overrides TILES (diagnosis only). Raises ValueError
    naming what is unsupported. `checked`: the caller has just found no `backward_problem` in these inputs
    (flash_dispatch's choice has), so they are not looked for again. `fast_launch`: the caller's
    `FlashSettings.fast_launch`, where it has read the settings (None: read them, once for both launches)."""
    return _backward(q, k, v, o, do, lse, causal, scale, tile, checked=checked, fast_launch=fast_launch)


def _backward(q, k, v, o, do, lse, causal: bool, scale: float | None = None, tile: BwdTile | None = None,
              exact: bool = False, checked: bool = False, fast_launch: bool | None = None):
    """flash_backward_gluon, plus EXACT (tests only: P^T = S^T mod 8 in place of the softmax, L unused; with
    integer inputs, O = 0 (so D = 0) and scale 1 every value is an exact integer, so the whole pipeline is checkable
    bit for bit)."""
    if fast_launch is None:
        fast_launch = flash_settings().fast_launch
    key = (layout(q, k, v, o, do, lse), causal, scale, tile, exact)
    plan = _PLANS.get(key) if fast_launch else None
    if plan is not None:  # this layout ran (checked) before: the same checks would pass
        return plan.run(q, k, v, o, do, lse)
    problem = None if checked else backward_problem(q, k, v, o, do, lse)
    if problem:
        raise ValueError(problem)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    tile = tile or tile_for(q.shape[-1])
    if tile.head_dim != q.shape[-1]:
        raise ValueError(f"flash_gluon_bwd: tile for head dim {tile.head_dim} given for head dim {q.shape[-1]}")
    q4, k4, v4, o4, do4 = map(_as_4d, (q, k, v, o, do))
    copy_do = _tma_problem("do", do4) is not None
    if copy_do:
        do4 = do4.contiguous()  # e.g. the stride-0 dO of o.sum().backward()
    batch, heads, n_queries, head_dim = q4.shape
    n_pad = padded_queries(n_queries, tile)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dk4, dv4 = _as_4d(dk), _as_4d(dv)
    for name, grad, t in (("dk", dk4, k4), ("dv", dv4, v4)):
        # empty_like keeps a dense input's strides, which the checks found TMA-ready, in a fresh (aligned)
        # allocation; any other input (overlapping, with gaps) gets strides of its own: check what TMA will write
        problem = _tma_problem(name, grad) if grad.stride() != t.stride() else None
        if problem:
            raise ValueError(problem)
    dq4 = _as_4d(dq)
    dq_acc = _dq_accumulator(dq4)
    lse2 = torch.empty(batch * heads, n_pad, dtype=torch.float32, device=q.device)
    delta = torch.empty_like(lse2)
    pre_grid = (n_pad // tile.block_m, batch * heads)
    pre_args = (o4, do4, lse, lse2, delta, dq_acc, *o4.stride(), *do4.stride(), *dq_acc.stride(), heads, n_queries,
                n_pad)
    pre_options = {"HEAD_DIM": head_dim, "BLOCK": tile.block_m}
    _PREPROCESS(pre_grid, *pre_args, fast_launch=fast_launch, **pre_options)  # zeroes the accumulator too
    args, grid, options = kernel_launch(q4, k4, v4, do4, dk4, dv4, dq_acc, lse2, delta, causal, scale, tile, exact)
    _LAUNCHER(grid, *args, fast_launch=fast_launch, **options)
    # dQ = accumulator * scale, rounded to q's dtype into q's layout: one elementwise pass (a separate in-place
    # scale and cast copy read and wrote the float32 accumulator once more, and cost a launch more)
    torch.mul(dq_acc, scale, out=dq4)
    if fast_launch:  # only once it ran: a call that raised leaves no plan
        preprocess = _PREPROCESS.bound(pre_grid, pre_args, pre_options)
        main = DescriptorPlan.after(_LAUNCHER, grid, args, options, per_call=0)
        if preprocess is not None and main is not None:
            plan = _PLANS[key] = _BackwardPlan(copy_do, lse2.shape, (preprocess[0], (*pre_args[6:], *preprocess[1]),
                                                                     *preprocess[2:]), main, scale)
            # the plan of these inputs for flash_native's C++ node: O and L as the forward makes them, the defaults
            if (not exact and key[2:4] == (None, None) and o.stride() == q.stride() and lse.is_contiguous()
                    and o.data_ptr() % 16 == 0 == lse.data_ptr() % 16):
                grad_strides = contiguous_strides(do.shape) if copy_do else do.stride()
                _PLANS_OF_INPUTS.setdefault((key[0][:3], causal), {}).setdefault(grad_strides, (plan, dq.stride()))
    return dq, dk, dv


def _dq_accumulator(dq4: torch.Tensor) -> torch.Tensor:
    """The float32 dQ accumulator, uninitialised (the preprocessing kernel zeroes it), with dQ's strides (q's
    layout, a model's (batch, seq, heads, dim) view included): the final scale-and-cast into dQ is then one
    vectorised pass over matching strides. A contiguous accumulator under a model-layout dQ made it ATen's strided
    elementwise kernel, at about half the bandwidth (kernels/NOTES.md). The TMA descriptor takes the accumulator's
    own strides. (Laid out group- or tile-major instead, as its shared tile is, the main kernel was slower:
    kernels/NOTES.md, "The dQ accumulator's layout".)"""
    return torch.empty_like(dq4, dtype=torch.float32)


class _BackwardPlan:
    """The backward's launches for one call layout (flash_gluon's per-layout plans): whether dO is copied for TMA,
    the preprocessed rows' shape, the preprocess binary with its arguments after the six tensors (and Triton's
    CompiledKernel with its grid), the main kernel's DescriptorPlan and the scale. (The dQ accumulator follows q's
    layout, which the plan's key fixes.)"""

    __slots__ = ("copy_do", "rows_shape", "preprocess", "main", "scale")

    def __init__(self, copy_do: bool, rows_shape, preprocess: tuple, main: DescriptorPlan, scale: float):
        self.copy_do, self.rows_shape, self.preprocess = copy_do, rows_shape, preprocess
        self.main, self.scale = main, scale

    def run(self, q, k, v, o, do, lse):
        if self.copy_do:
            do = do.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dq4 = _as_4d(dq)
        dq_acc = _dq_accumulator(dq4)
        lse2 = torch.empty(self.rows_shape, dtype=torch.float32, device=q.device)
        delta = torch.empty_like(lse2)
        run, rest = self.preprocess[:2]
        run(o, do, lse, lse2, delta, dq_acc, *rest)
        self.main.launch((q, k, v, do, dk, dv, dq_acc, lse2, delta))
        torch.mul(dq_acc, self.scale, out=dq4)
        return dq, dk, dv

    def native(self, dq_strides: tuple[int, ...], q_shape: tuple[int, ...]
               ) -> tuple[list[flash_native.KernelCall], list, float]:
        """These launches for flash_native's C++ plan: (the two launches, the scratch buffers, dQ's scale). The
        float32 accumulator takes q's shape and dQ's strides (`_dq_accumulator`: the 4-d view the kernels were
        planned with has the same memory layout)."""
        _, rest, compiled, grid = self.preprocess
        preprocess = flash_native.KernelCall(compiled, grid, (*flash_native.slots("out", "grad_out", "lse", "lse2",
                                                                                  "delta", "dq_acc"), *rest))
        main = self.main.native_call(("q", "k", "v", "grad_out", "dk", "dv", "dq_acc", "lse2", "delta"))
        rows = (tuple(self.rows_shape), contiguous_strides(self.rows_shape))
        scratch = [("dq_acc", tuple(q_shape), tuple(dq_strides)), ("lse2", *rows), ("delta", *rows)]
        return [preprocess, main], scratch, self.scale


_PLANS: dict[tuple, _BackwardPlan] = {}
# By (the layout of q, k, v, is_causal), then by the strides of the dO its kernels read: the first plan of such inputs
# and dO whose O and L were as the forward makes them (O in q's layout, L contiguous), with the strides of its dQ:
# `native_calls` finds them without O in hand, as flash_triton's FA2 plans of inputs.
_PLANS_OF_INPUTS: dict[tuple, dict[tuple[int, ...], tuple[_BackwardPlan, tuple[int, ...]]]] = {}
on_clear(_PLANS.clear)
on_clear(_PLANS_OF_INPUTS.clear)


def native_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
                 ) -> tuple[list[tuple[tuple[int, ...], list[flash_native.KernelCall]]], list, float] | None:
    """The backward's launches for flash_native's C++ plan of these inputs' layout, once a backward of such inputs
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
