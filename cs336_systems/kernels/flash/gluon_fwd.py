"""FlashAttention forward for Hopper (sm_90) in Triton's Gluon: warp-specialised, FA3-shaped, persistent.

One tile is CONSUMERS x BLOCK_M = 128 query rows of one (batch, head) against its keys, computed by three
partitions of one CTA (Shah et al., FlashAttention-3, 2024, sections 3.1-3.2):
  consumer 0 (the default partition, one warpgroup)  query rows [0, 64) of the tile
  consumer 1 (a worker warpgroup)                    query rows [64, 128)
  producer   (a worker warp, few registers)          TMA loads of Q once per tile and of K, V tiles into a ring
Each consumer keeps S = Q K^T (64 x 128) and O (64 x d) in float32 registers; P, the softmax numerator, goes to
16 bits in registers and is the register A operand of the P V wgmma. Inside a consumer, S(j) = Q K_j^T is issued
before P(j-1) V(j-1), so the softmax of tile j overlaps the tensor cores' work on j-1; across consumers, a pair
of barriers makes them take turns issuing their GEMMs ("ping-pong", as FA3 does), so one's softmax runs under the
other's GEMMs. The exponentials are base 2 with log2(e)/sqrt(d) folded into one scale, as in fa2.py.

Persistent grid: one program per SM walks a static list of tiles (`persistent_schedule`: list scheduling of the
launch order, as the block scheduler would place one-tile programs); every barrier's phase, the K/V ring and the
turns carry on from tile to tile, the next tile's Q loads while this one's last P V and epilogue run, and O leaves
through buffers of its own, its store drained only before the buffer is rewritten. The launch order is heaviest
first (causal: the last query tiles), one head after another, or for short causal calls in groups of
HEADS_PER_GROUP heads, each rank of the group's heads before the next (`program_order`, `heads_per_group`).

Barrier protocol (every mbarrier counts phases; a fresh one passes a wait on parity 1):
  q_ready               producer -> consumers: both Q sub-tiles landed (expect-tx bytes)
  q_empty               consumers -> producer: both consumers' last S of the tile retired, Q may be reloaded (count 2)
  k_ready[i], v_ready[i] producer -> consumers: slot i holds key tile j (expect-tx bytes)
  k_empty[i], v_empty[i] consumers -> producer: both consumers' wgmmas reading slot i have retired (count 2)
and the turns (GluonTile.named_turns: two named barriers, bar.sync / bar.arrive over both consumers' 256 threads,
ids TURN_BARRIER + c; else two mbarriers, turn[c]):
  turn c                consumer 1-c -> consumer c: your turn to issue GEMMs (consumer 0 issues first: consumer 1
                        arrives once at the start, or the kernel pre-arrives turn[0]; the last arrival is never
                        waited for, which a CTA may end with)
A K slot is released once S(j) has retired, a V slot once P V has; P's registers are rewritten only after the
P V wgmma reading them has retired (register-A wgmma has had read-after-write hazards: triton #9433, #11781).

Causal masking: query i sees keys 0..i (aligned at the start of both sequences, as in fa2.py). The key tile is
as long as a tile's query block (BLOCK_N = CONSUMERS * BLOCK_M), so only a tile's last key tile can touch the
diagonal or run past the last key: only that one is masked. Lengths that are not tile multiples need nothing
else: the TMA descriptors are 4-d (batch, head, row, col) with the tensors' own strides, so rows past a head's
end load as zeros and are clipped on store.

Writes O (q's layout) and L, the natural-log logsumexp, float32, contiguous q.shape[:-1]: the same outputs as
FA2's forward, so either backward can consume them.

Caveats: sm_90 only (wgmma, setmaxnreg); bf16 or fp16; head dims 64 and 128; 16-byte aligned strides and
starts (TMA). `gluon_supported` says whether a call is supported; `flash_attention_gluon_forward` raises
ValueError naming what is not. EXACT (tests only) replaces the softmax by P = S mod 8 with no normalisation: with
small integer inputs every value is an exact integer, which makes the whole pipeline (producer ring, ping-pong,
register-A P V) checkable bit for bit. See DECISIONS.md#forward-tiles.
"""

from __future__ import annotations

import functools
import heapq
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
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
    DescriptorPlan,
    as_2d,
    as_4d,
    descriptor,
    descriptor_launch_key,
    device_problem,
    layout_problem,
    next_slot,
)
from cs336_systems.kernels.flash.host import node
from cs336_systems.kernels.flash.host.launch import PLANS, FastLauncher, cdiv, layout
from cs336_systems.kernels.flash.settings import flash_settings

LN2 = 0.6931471805599453
# the same, as the kernels read them (a jit function sees only constexpr globals)
_CONSUMERS = gl.constexpr(CONSUMERS)
_LN2 = gl.constexpr(LN2)
# Heads interleaved in the program order (`heads_per_group`): short causal calls have few tiles per SM, and one
# head after another leaves the last heads' heaviest tiles to nearly full walks; groups of four heads, rank-major
# within the group, put the heavy tiles of four heads first. From MAX_GROUPED_KEYS keys on every walk holds enough
# tiles to balance with one head at a time, and non-causal calls are balanced by construction.
HEADS_PER_GROUP = 4
MAX_GROUPED_KEYS = 8192


def heads_per_group(n_keys: int, is_causal: bool) -> int:
    """Heads per group of the program order (`program_order`): HEADS_PER_GROUP for causal calls with at most
    MAX_GROUPED_KEYS keys, else 1 (non-causal calls, long sequences)."""
    return HEADS_PER_GROUP if is_causal and n_keys <= MAX_GROUPED_KEYS else 1


# The persistent schedule's cost model (persistent_schedule): a tile costs its key tiles plus this many for its
# prologue and epilogue (Q's load, a first S with no P V beside it, the last P V, O's store). A guess; the balance
# the schedule reaches at the target shapes moves by < 1% between 0.5 and 2.
TILE_OVERHEAD_STEPS = 1
H100_SMS = 132  # an H100 SXM's SMs: the persistent grid of a compile without a GPU (bench.flash_gluon_resources)


@dataclass(frozen=True)
class GluonTile:
    """One tile's shape and resources. block_m: query rows per consumer warpgroup (128 spills); block_n: keys per
    step (= CONSUMERS * block_m, which the causal masking relies on); num_slots: K/V ring depth (shared memory:
    2 Q sub-tiles, 2 O sub-tiles and 2 x num_slots key tiles); registers: per consumer thread and per producer
    thread after setmaxnreg, with maxnreg the kernel-wide cap they are carved from. named_turns: the consumers take
    turns through named barriers (bar.sync / bar.arrive), else through a pair of mbarriers. causal_q_registers: in
    causal calls each consumer loads its Q sub-tile into registers once per tile and issues S = Q K^T with Q as the
    register A operand, so that its key steps read only K and V from shared memory."""

    head_dim: int
    block_m: int = 64
    block_n: int = 128
    num_slots: int = 2
    consumer_registers: int = 240
    producer_registers: int = 24
    maxnreg: int = 168
    named_turns: bool = True
    causal_q_registers: bool = False

    def __post_init__(self):
        if self.block_n != CONSUMERS * self.block_m:
            raise ValueError(f"{self}: block_n must be {CONSUMERS} x block_m (only the last key tile is masked)")

    @property
    def rows(self) -> int:
        return CONSUMERS * self.block_m

    def shared_bytes(self, element_size: int = 2) -> int:
        """Tiles only (the barriers add a few hundred bytes): Q, O, and the K/V ring."""
        return element_size * self.head_dim * (2 * self.rows + 2 * self.num_slots * self.block_n)


# The shipped tiles (DECISIONS.md#forward-tiles): d=64 a six-slot ring (230 KB), mbarrier turns and Q in registers
# in causal calls; d=128 a two-slot ring (197 KB; three slots do not fit) and named-barrier turns.
TILES = {64: GluonTile(64, num_slots=6, named_turns=False, causal_q_registers=True),
         128: GluonTile(128, num_slots=2)}


def tile_for(head_dim: int) -> GluonTile:
    if head_dim not in TILES:
        raise ValueError(f"flash_gluon: head dim {head_dim} is not supported (supported: {', '.join(map(str, TILES))})")
    return TILES[head_dim]


# ----------------------------------------------------------------------------------------------
# the schedule, in plain Python (the kernel's _program_tile and _tile_at compute the same)
# ----------------------------------------------------------------------------------------------
def program_order(n_q_tiles: int, batch_heads: int, group: int, is_causal: bool) -> list[tuple[int, int]]:
    """(query tile, batch·head) of position 0, 1, ... of the launch order (a position of the walks): heads in groups of `group`; within a group, tile-rank major and head minor, heaviest tiles (causal:
    the last ones) first."""
    order = []
    for pid in range(n_q_tiles * batch_heads):
        first = pid // (group * n_q_tiles) * group
        heads = min(group, batch_heads - first)
        within = pid - first * n_q_tiles
        rank = within // heads
        order.append((n_q_tiles - 1 - rank if is_causal else rank, first + within % heads))
    return order


def key_tiles(q_tile: int, n_queries: int, n_keys: int, tile: GluonTile, is_causal: bool) -> int:
    """Key tiles a program visits (the kernel computes the same): all of them, or (causal) up to its last row."""
    last = triton.cdiv(n_keys, tile.block_n)
    if not is_causal:
        return last
    return min(triton.cdiv(min((q_tile + 1) * tile.rows, n_queries), tile.block_n), last)


def persistent_schedule(works: Sequence[int], programs: int) -> list[list[int]]:
    """The positions each of `programs` persistent programs walks, ascending: list scheduling (Graham's greedy)
    of positions 0, 1, ... in turn, each given to the program with the least work so far (the lowest id among
    equals), position i costing works[i]. This is what the block scheduler does with one-tile programs (an SM
    takes the next program when its last one ends), so the walk keeps its balance and its heads-in-flight (L2)
    while saving each tile's launch, prologue and epilogue gaps. Walking t = pid, pid + programs, ... instead
    would load one program with up to 1.56x the mean work at causal shapes."""
    if programs < 1:
        raise ValueError(f"persistent_schedule: programs must be >= 1, got {programs}")
    loads = [(0, p) for p in range(programs)]  # a valid heap: sorted
    walks: list[list[int]] = [[] for _ in range(programs)]
    for position, work in enumerate(works):
        load, p = heapq.heappop(loads)
        walks[p].append(position)
        heapq.heappush(loads, (load + work, p))
    return walks


def tile_works(n_queries: int, n_keys: int, batch_heads: int, group: int, tile: GluonTile, is_causal: bool
               ) -> list[int]:
    """The schedule's cost of each position of program_order: its key tiles plus TILE_OVERHEAD_STEPS."""
    n_q_tiles = triton.cdiv(n_queries, tile.rows)
    return [key_tiles(t, n_queries, n_keys, tile, is_causal) + TILE_OVERHEAD_STEPS
            for t, _ in program_order(n_q_tiles, batch_heads, group, is_causal)]


def schedule_table(walks: list[list[int]]) -> list[int]:
    """The walks as the kernel reads them: len(walks) + 1 offsets, then every walk's positions in turn (program p
    walks table[len(walks) + 1 + i] for i in table[p]:table[p + 1])."""
    offsets = [0]
    for walk in walks:
        offsets.append(offsets[-1] + len(walk))
    return offsets + [position for walk in walks for position in walk]


@functools.lru_cache(maxsize=64)
def _schedule_on(device: torch.device, n_queries: int, n_keys: int, batch_heads: int, group: int, tile: GluonTile,
                 is_causal: bool, programs: int) -> torch.Tensor:
    """The int32 schedule table on `device`, built once per shape (the 8B shape's 16,384 tiles take ~60 ms in
    Python) and kept. On a GPU it is copied by a thread of its own: torch.compile's CUDA graphs (mode=
    "reduce-overhead") run a graph's first call with every allocation of the calling thread going to the graphs'
    private pool, where a tensor kept after the call is an error ("tensor(s) in the cudagraph pool not tracked as
    outputs"); another thread's allocations stay in the ordinary pool. A capture proper (torch.cuda.graph) cannot
    copy from the host at all: there the layout's first call must come before the capture."""
    walks = persistent_schedule(tile_works(n_queries, n_keys, batch_heads, group, tile, is_causal), programs)
    table = torch.tensor(schedule_table(walks), dtype=torch.int32)
    if device.type != "cuda":
        return table.to(device)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"flash_gluon: the first call of a layout ({batch_heads} heads x {n_queries} queries x "
                           f"{n_keys} keys) copies its tile schedule to the GPU, which a CUDA graph capture does not "
                           "allow: make one call of this layout before capturing")
    copied: list = []

    def copy() -> None:
        try:
            with torch.cuda.device(device):
                copied.append(table.to(device))  # from pageable memory: done when it returns
        except Exception as error:  # raised again on the calling thread
            copied.append(error)

    thread = threading.Thread(target=copy, name="flash_gluon schedule copy")
    thread.start()
    thread.join()
    if isinstance(copied[0], Exception):
        raise copied[0]
    # made on that thread's stream, used on this one's: if the cache drops it, its memory waits for the kernels
    # queued here
    copied[0].record_stream(torch.cuda.current_stream(device))
    return copied[0]


@functools.cache
def sm_count(device: torch.device) -> int:
    """The SMs a persistent grid fills: the device's, or an H100 SXM's (H100_SMS) when compiling on the CPU."""
    if device.type != "cuda":
        return H100_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def persistent_grid(n_tiles: int, sms: int) -> int:
    """One program per SM, or per tile where there are fewer tiles."""
    return max(1, min(sms, n_tiles))


# ----------------------------------------------------------------------------------------------
# partitions
# ----------------------------------------------------------------------------------------------
@gluon.jit
def _program_tile(position, n_q_tiles, batch_heads, group, IS_CAUSAL: gl.constexpr):
    """(query tile, batch·head) at `position` of the launch order: program_order's arithmetic."""
    first = position // (group * n_q_tiles) * group
    heads = gl.minimum(group, batch_heads - first)
    within = position - first * n_q_tiles
    q_tile = within // heads  # the rank: heaviest first
    if IS_CAUSAL:
        q_tile = n_q_tiles - 1 - q_tile
    return q_tile, first + within % heads


@gluon.jit
def _tile_at(position, H, batch_heads, n_queries, n_keys, n_q_tiles, group, ROWS: gl.constexpr, BN: gl.constexpr,
             IS_CAUSAL: gl.constexpr):
    """(b, h, b·h, first query row, key tiles to visit) of the tile at `position`: key_tiles' arithmetic."""
    q_tile, bh = _program_tile(position, n_q_tiles, batch_heads, group, IS_CAUSAL)
    q_row = q_tile * ROWS
    n_blk = gl.cdiv(n_keys, BN)
    if IS_CAUSAL:
        n_blk = gl.minimum(gl.cdiv(gl.minimum(q_row + ROWS, n_queries), BN), n_blk)
    return bh // H, bh % H, bh, q_row, n_blk


@gluon.jit
def _walk(sched):
    """This program's range of indices into the schedule's positions (schedule_table's layout), and
    where the positions start."""
    pid = gl.program_id(0)
    return gl.load(sched + pid), gl.load(sched + pid + 1), sched + gl.num_programs(0) + 1


@gluon.jit
def _load_tile(desc_q, desc_k, desc_v, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
               b, h, q_row, n_blk, idx, phase, q_phase):
    """The producer's loads of one tile: its two Q sub-tiles once both consumers released the last ones (a fresh
    barrier passes the first wait), then its key tiles into the ring, which continues from the last tile's slot."""
    NUM: gl.constexpr = k_ring.shape[0]
    BM: gl.constexpr = desc_q.block_type.shape[2]
    BN: gl.constexpr = desc_k.block_type.shape[2]
    mbarrier.wait(q_empty, q_phase)
    mbarrier.expect(q_ready, _CONSUMERS * desc_q.block_type.nbytes)
    for c in gl.static_range(_CONSUMERS):
        tma.async_copy_global_to_shared(desc_q, [b, h, q_row + c * BM, 0], q_ready, q_smem.index(c))
    for j in range(n_blk):
        mbarrier.wait(k_empty.index(idx), phase)
        mbarrier.expect(k_ready.index(idx), desc_k.block_type.nbytes)  # a box past the end still counts whole
        tma.async_copy_global_to_shared(desc_k, [b, h, j * BN, 0], k_ready.index(idx), k_ring.index(idx))
        mbarrier.wait(v_empty.index(idx), phase)
        mbarrier.expect(v_ready.index(idx), desc_v.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_v, [b, h, j * BN, 0], v_ready.index(idx), v_ring.index(idx))
        idx, phase = next_slot(idx, phase, NUM)
    return idx, phase, q_phase ^ 1


@gluon.jit
def _producer(desc_q, desc_k, desc_v, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
              sched, H, batch_heads, n_queries, n_keys, n_q_tiles, group, IS_CAUSAL: gl.constexpr):
    ROWS: gl.constexpr = _CONSUMERS * desc_q.block_type.shape[2]
    BN: gl.constexpr = desc_k.block_type.shape[2]
    # the slots and Q start out free: a fresh mbarrier passes a wait on parity 1 (run-time values, as _consumer's)
    idx = gl.to_tensor(0)
    phase = gl.to_tensor(1)
    q_phase = gl.to_tensor(1)
    first, last, positions = _walk(sched)
    for i in range(first, last):
        b, h, bh, q_row, n_blk = _tile_at(gl.load(positions + i), H, batch_heads, n_queries, n_keys, n_q_tiles,
                                          group, ROWS, BN, IS_CAUSAL)
        idx, phase, q_phase = _load_tile(desc_q, desc_k, desc_v, q_smem, k_ring, v_ring, q_ready, q_empty,
                                         k_ready, v_ready, k_empty, v_empty, b, h, q_row, n_blk, idx, phase,
                                         q_phase)


# The consumers' turns by named barriers use ids 8 + c: clear of the ids Triton gives its partitions' own barriers
# (0-2 in this kernel's PTX with Triton 3.6; a CPU test compiles the kernel and checks). An mbarrier's arrive costs a
# warpgroup barrier before one thread arrives; a named barrier's does not, which pays at d=128 only (TILES).
TURN_BARRIER = 8
_TURN_BARRIER = gl.constexpr(TURN_BARRIER)


@gluon.jit
def _named_barrier(op: gl.constexpr, barrier_id: gl.constexpr):
    """Every thread of this warpgroup runs `op` (bar.sync: wait; bar.arrive: signal) on named barrier
    barrier_id, counted over both consumer warpgroups (256 threads)."""
    one_per_thread: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    token = gl.full([128], barrier_id, gl.int32, one_per_thread)
    gl.inline_asm_elementwise(op + " $1, 256;\n\tmov.b32 $0, $1;", "=r,r", [token], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _wait_turn(turn, turn_phase, CID: gl.constexpr, NAMED_TURNS: gl.constexpr):
    """Wait until it is this consumer's turn to issue its GEMMs; the next wait's phase (mbarrier turns)."""
    if NAMED_TURNS:
        _named_barrier("bar.sync", _TURN_BARRIER + CID)
    else:
        mbarrier.wait(turn.index(CID), turn_phase)
    return turn_phase ^ 1


@gluon.jit
def _pass_turn(turn, CID: gl.constexpr, NAMED_TURNS: gl.constexpr):
    """Give the turn to the other consumer."""
    if NAMED_TURNS:
        _named_barrier("bar.arrive", _TURN_BARRIER + 1 - CID)
    else:
        mbarrier.arrive(turn.index(1 - CID), count=1)


@gluon.jit
def _mask_scores(s, offs_m, start_n, n_keys, IS_CAUSAL: gl.constexpr, FILL: gl.constexpr):
    """Scores of keys past the end (and, causal, after the query) replaced by FILL."""
    BN: gl.constexpr = s.shape[1]
    offs_n = start_n + gl.arange(0, BN, layout=gl.SliceLayout(0, s.type.layout))
    keep = offs_n[None, :] < n_keys
    if IS_CAUSAL:
        keep = keep & (offs_n[None, :] <= offs_m[:, None])
    return gl.where(keep, s, FILL)


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, EXACT: gl.constexpr):
    """Online softmax of one score tile: P, the new running max and sum, and alpha, the factor that brings O to
    the new max. The max is kept in the log2 domain (scaled by qk_scale)."""
    if EXACT:  # integer arithmetic only; alpha is 1 at run time but not foldable, like the real rescale
        p = s - gl.floor(s * 0.125) * 8.0
        m_new = gl.maximum(m_i, gl.max(p, axis=1))
        alpha = gl.where(m_new > 1.0e30, 0.5, 1.0)
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s * qk_scale - m_new[:, None])
    return p, m_new, l_i * alpha + gl.sum(p, axis=1), alpha


@gluon.jit
def _key_step(q, k_ring, v_ring, q_empty, k_ready, v_ready, k_empty, v_empty, turn, acc, p_op, m_i, l_i, alpha, idx,
              phase, turn_phase, s_shape, offs_m, j, n_keys, qk_scale, CID: gl.constexpr, IS_CAUSAL: gl.constexpr,
              EXACT: gl.constexpr, LAST: gl.constexpr, NAMED_TURNS: gl.constexpr):
    """Key tile j >= 1 of a consumer: S(j) = Q K_j^T issued before P(j-1) V(j-1), then softmax(j) while P V runs.
    Slot idx holds tile j-1 (its V is read here), the next slot tile j. LAST: the tile's last key tile, masked,
    whose S is the last read of Q (released here, so the producer can load the next tile's while P V runs)."""
    NUM: gl.constexpr = k_ring.shape[0]
    BN: gl.constexpr = k_ring.shape[3]
    FILL: gl.constexpr = 0.0 if EXACT else float("-inf")  # EXACT: a zero score is a zero P
    row_o: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    nidx, nphase = next_slot(idx, phase, NUM)
    turn_phase = _wait_turn(turn, turn_phase, CID, NAMED_TURNS)
    mbarrier.wait(k_ready.index(nidx), nphase)
    s = warpgroup_mma(q, as_2d(k_ring, nidx).permute((1, 0)), s_shape, use_acc=False, is_async=True)
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]  # O to step j-1's max before P(j-1) V(j-1) adds
    mbarrier.wait(v_ready.index(idx), phase)
    acc = warpgroup_mma(p_op, as_2d(v_ring, idx), acc, is_async=True)
    _pass_turn(turn, CID, NAMED_TURNS)
    s = warpgroup_mma_wait(1, deps=(s, ))  # S(j) retired; P V may still run
    mbarrier.arrive(k_empty.index(nidx), count=1)
    if LAST:
        mbarrier.arrive(q_empty, count=1)
        s = _mask_scores(s, offs_m, j * BN, n_keys, IS_CAUSAL, FILL)
    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, EXACT)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(idx), count=1)
    p_op = gl.convert_layout(p.to(p_op.dtype), p_op.type.layout)  # only now: the P V that read p_op has retired
    return acc, p_op, m_i, l_i, alpha, nidx, nphase, turn_phase


@gluon.jit
def _attend_tile(desc_o, q_smem, o_smem, k_ring, v_ring, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn,
                 L, b, h, bh, q_row, n_queries, n_keys, n_blk, qk_scale, idx, phase, turn_phase, q_phase,
                 CID: gl.constexpr, IS_CAUSAL: gl.constexpr, EXACT: gl.constexpr, NAMED_TURNS: gl.constexpr,
                 Q_REGS: gl.constexpr):
    """One consumer's 64 rows of one tile, from Q's arrival to O's store. The barrier state (idx, phase: the
    ring slot of the last key tile read; turn_phase; q_phase) comes from the previous tile and goes to the next."""
    NUM: gl.constexpr = k_ring.shape[0]
    BM: gl.constexpr = q_smem.shape[3]
    BN: gl.constexpr = k_ring.shape[3]
    D: gl.constexpr = q_smem.shape[4]
    dtype: gl.constexpr = desc_o.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    FILL: gl.constexpr = 0.0 if EXACT else float("-inf")  # EXACT: a zero score is a zero P

    q = as_2d(q_smem, CID)
    row0 = q_row + CID * BM
    offs_m = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
    s_shape = gl.zeros([BM, BN], gl.float32, s_layout)  # only gives S its layout (use_acc=False)
    acc = gl.zeros([BM, D], gl.float32, o_layout)
    m_i = gl.full([BM], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BM], gl.float32, gl.SliceLayout(1, s_layout))
    mbarrier.wait(q_ready, q_phase)
    if Q_REGS:
        q = q.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))

    # key tile 0: S and P only (no P V to overlap yet)
    idx, phase = next_slot(idx, phase, NUM)
    turn_phase = _wait_turn(turn, turn_phase, CID, NAMED_TURNS)
    mbarrier.wait(k_ready.index(idx), phase)
    s = warpgroup_mma(q, as_2d(k_ring, idx).permute((1, 0)), s_shape, use_acc=False, is_async=True)
    _pass_turn(turn, CID, NAMED_TURNS)
    s = warpgroup_mma_wait(0, deps=(s, ))
    mbarrier.arrive(k_empty.index(idx), count=1)
    if n_blk == 1:  # the only key tile: its S was the last read of Q
        mbarrier.arrive(q_empty, count=1)
        s = _mask_scores(s, offs_m, 0, n_keys, IS_CAUSAL, FILL)
    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, EXACT)
    p_op = gl.convert_layout(p.to(dtype), p_layout)

    for j in range(1, n_blk - 1):  # the unmasked tiles
        acc, p_op, m_i, l_i, alpha, idx, phase, turn_phase = _key_step(
            q, k_ring, v_ring, q_empty, k_ready, v_ready, k_empty, v_empty, turn, acc, p_op, m_i, l_i, alpha, idx,
            phase, turn_phase, s_shape, offs_m, j, n_keys, qk_scale, CID, IS_CAUSAL, EXACT, False, NAMED_TURNS)
    if n_blk > 1:  # the last tile, masked: peeled off the loop (as FA3 does), whose body has no branch
        acc, p_op, m_i, l_i, alpha, idx, phase, turn_phase = _key_step(
            q, k_ring, v_ring, q_empty, k_ready, v_ready, k_empty, v_empty, turn, acc, p_op, m_i, l_i, alpha, idx,
            phase, turn_phase, s_shape, offs_m, n_blk - 1, n_keys, qk_scale, CID, IS_CAUSAL, EXACT, True,
            NAMED_TURNS)

    # the last P V
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    mbarrier.wait(v_ready.index(idx), phase)
    acc = warpgroup_mma(p_op, as_2d(v_ring, idx), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(idx), count=1)
    if not EXACT:
        acc = acc / gl.convert_layout(l_i, row_o)[:, None]
        lse = (m_i + gl.log2(l_i)) * _LN2
        gl.store(L + bh * n_queries + offs_m, lse, mask=offs_m < n_queries)
    # O leaves through o_smem, rows past the end clipped; this consumer's previous O store must have read the
    # buffer first.
    tma.store_wait(0)
    as_2d(o_smem, CID).store(acc.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc_o, [b, h, row0, 0], o_smem.index(CID))
    return idx, phase, turn_phase, q_phase ^ 1


@gluon.jit
def _consumer(desc_o, q_smem, o_smem, k_ring, v_ring, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn, L,
              sched, H, batch_heads, n_queries, n_keys, n_q_tiles, group, qk_scale, CID: gl.constexpr,
              IS_CAUSAL: gl.constexpr, EXACT: gl.constexpr, NAMED_TURNS: gl.constexpr, Q_REGS: gl.constexpr):
    NUM: gl.constexpr = k_ring.shape[0]
    ROWS: gl.constexpr = _CONSUMERS * q_smem.shape[3]
    BN: gl.constexpr = k_ring.shape[3]
    # the state before the first tile: "the last key tile read" is the slot before 0, so the first is slot 0 at
    # parity 0; mbarrier turns: turn[0] was pre-arrived, so both first waits are on parity 0 (run-time values:
    # _next_slot's branch must not see a constant)
    idx = gl.to_tensor(NUM - 1)
    phase = gl.to_tensor(1)
    turn_phase = gl.to_tensor(0)
    q_phase = gl.to_tensor(0)
    if NAMED_TURNS and CID == 1:  # consumer 0 issues first
        _named_barrier("bar.arrive", _TURN_BARRIER)
    first, last, positions = _walk(sched)
    for i in range(first, last):
        b, h, bh, q_row, n_blk = _tile_at(gl.load(positions + i), H, batch_heads, n_queries, n_keys, n_q_tiles,
                                          group, ROWS, BN, IS_CAUSAL)
        idx, phase, turn_phase, q_phase = _attend_tile(
            desc_o, q_smem, o_smem, k_ring, v_ring, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn,
            L, b, h, bh, q_row, n_queries, n_keys, n_blk, qk_scale, idx, phase, turn_phase, q_phase, CID,
            IS_CAUSAL, EXACT, NAMED_TURNS, Q_REGS)
    tma.store_wait(0)  # the last O store has read its buffer before the CTA's shared memory is released


# Lengths and counts enter only addresses and loop bounds: not specialised on, so new lengths do not recompile.
@gluon.jit(do_not_specialize=["H", "batch_heads", "n_queries", "n_keys", "n_q_tiles", "group"])
def _flash_fwd_gluon_kernel(desc_q, desc_k, desc_v, desc_o, L, sched, H, batch_heads, n_queries, n_keys, n_q_tiles,
                            group, qk_scale, IS_CAUSAL: gl.constexpr, EXACT: gl.constexpr, NUM_SLOTS: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                            NAMED_TURNS: gl.constexpr, Q_REGS: gl.constexpr):
    BM: gl.constexpr = desc_q.block_type.shape[2]
    BN: gl.constexpr = desc_k.block_type.shape[2]
    D: gl.constexpr = desc_q.block_type.shape[3]
    dtype: gl.constexpr = desc_q.dtype
    q_smem = gl.allocate_shared_memory(dtype, [_CONSUMERS, 1, 1, BM, D], desc_q.layout)
    # O gets its own buffers, so the next tile's Q can land while O is stored
    o_smem = gl.allocate_shared_memory(dtype, [_CONSUMERS, 1, 1, BM, D], desc_o.layout)
    k_ring = gl.allocate_shared_memory(dtype, [NUM_SLOTS, 1, 1, BN, D], desc_k.layout)
    v_ring = gl.allocate_shared_memory(dtype, [NUM_SLOTS, 1, 1, BN, D], desc_v.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_SLOTS, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_SLOTS, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_SLOTS, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_SLOTS, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [_CONSUMERS, 1], mbarrier.MBarrierLayout())  # unused: NAMED_TURNS
    mbarrier.init(q_ready, count=1)
    mbarrier.init(q_empty, count=_CONSUMERS)
    for i in gl.static_range(NUM_SLOTS):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=_CONSUMERS)
        mbarrier.init(v_empty.index(i), count=_CONSUMERS)
    if not NAMED_TURNS:
        for c in gl.static_range(_CONSUMERS):
            mbarrier.init(turn.index(c), count=1)
        mbarrier.arrive(turn.index(0), count=1)  # consumer 0 issues first
    # (argument tuples written inline: a tuple bound to a local variable first turns constexprs into tensors)
    gl.warp_specialize([
        (_consumer, (desc_o, q_smem, o_smem, k_ring, v_ring, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
                     turn, L, sched, H, batch_heads, n_queries, n_keys, n_q_tiles, group, qk_scale, 0, IS_CAUSAL,
                     EXACT, NAMED_TURNS, Q_REGS)),
        (_consumer, (desc_o, q_smem, o_smem, k_ring, v_ring, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
                     turn, L, sched, H, batch_heads, n_queries, n_keys, n_q_tiles, group, qk_scale, 1, IS_CAUSAL,
                     EXACT, NAMED_TURNS, Q_REGS)),
        (_producer, (desc_q, desc_k, desc_v, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, v_ready, k_empty,
                     v_empty, sched, H, batch_heads, n_queries, n_keys, n_q_tiles, group, IS_CAUSAL)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------
def gluon_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> bool:
    """Whether flash_attention_gluon_forward takes these inputs (every causal and rectangular case is supported:
    is_causal is part of the question for the day a restriction depends on it)."""
    return layout_problem(q, k, v) is None and device_problem(q) is None


def kernel_launch(q, k, v, out, lse, is_causal: bool, exact: bool = False):
    """The kernel's arguments, grid and launch options for 4-d inputs (and out, lse), without touching a device
    beyond the schedule's first copy, so that `bench.flash_gluon_resources` can compile exactly what a launch
    would."""
    batch, heads, n_queries, head_dim = q.shape
    tile = tile_for(head_dim)
    n_q_tiles = cdiv(n_queries, tile.rows)
    group = min(heads_per_group(k.shape[-2], is_causal), batch * heads)
    programs = persistent_grid(n_q_tiles * batch * heads, sm_count(q.device))
    sched = _schedule_on(q.device, n_queries, k.shape[-2], batch * heads, group, tile, is_causal, programs)
    args = (descriptor(q, tile.block_m), descriptor(k, tile.block_n), descriptor(v, tile.block_n),
            descriptor(out, tile.block_m), lse, sched, heads, batch * heads, n_queries, k.shape[-2], n_q_tiles,
            group, head_dim**-0.5 * LOG2E, is_causal, exact, tile.num_slots,
            tile.consumer_registers, tile.producer_registers, tile.named_turns,
            tile.causal_q_registers and is_causal)
    return args, (programs,), {"num_warps": 4, "maxnreg": tile.maxnreg}


# The forward's launches: after the first call per layout, the compiled binary directly (host/launch.py): Triton's
# JIT path (argument binder, specialisation key, checks of the kernel's globals) costs a short call its host time.
LAUNCHER = FastLauncher(_flash_fwd_gluon_kernel, key=descriptor_launch_key)
# The forward's plans by (the inputs' layout, is_causal, exact)
_PLANS = PLANS.table("gluon_forward")


def flash_attention_gluon_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, *,
                                  exact: bool = False, checked: bool = False, fast_launch: bool | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """O (q's dtype and layout) and L (natural-log logsumexp, float32, contiguous q.shape[:-1]) of softmax
    attention with scale 1/sqrt(d): q (..., n_q, d), k and v (..., n_k, d), one or two leading dims, as FA2's
    forward. Raises ValueError naming what is unsupported (see gluon_supported). `exact`: the EXACT kernel (tests
    only; see the module docstring). `checked`: the caller has just found no `layout_problem` or `device_problem`
    in these inputs (the dispatch's choice has), so they are not looked for again (~10 us of a short call).
    `fast_launch`: the caller's `FlashSettings.fast_launch`, where it has read the settings (None: read them)."""
    if fast_launch is None:
        fast_launch = flash_settings().fast_launch
    key = (layout(q, k, v), is_causal, exact)
    plan = _PLANS.get(key) if fast_launch else None
    if plan is not None:  # this layout ran (checked) before: the same checks would pass
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        plan.launch((q, k, v, out), lse)
        return out, lse
    problem = None if checked else layout_problem(q, k, v) or device_problem(q)
    if problem:
        raise ValueError(problem)
    out = torch.empty_like(q)  # q's layout: a (batch, seq, heads, dim) view stays one
    if out.stride() != q.stride():  # a q that empty_like does not reproduce (e.g. overlapping): check out too
        problem = layout_problem(out, k, v)
        if problem:
            raise ValueError(problem)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    args, grid, options = kernel_launch(as_4d(q), as_4d(k), as_4d(v), as_4d(out), lse, is_causal, exact)
    LAUNCHER(grid, *args, fast_launch=fast_launch, **options)
    if fast_launch:
        plan = DescriptorPlan.after(LAUNCHER, grid, args, options, per_call=1)
        if plan is not None:  # only once it ran: a call that raised leaves no plan
            _PLANS[key] = plan
    return out, lse


def native_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> list[node.KernelCall] | None:
    """The forward's launch for the C++ node's plan of these inputs' layout, once a call of that layout has run
    here with fast launch (its plan holds the binary); None before."""
    plan = _PLANS.get((layout(q, k, v), is_causal, False))
    return None if plan is None else [plan.native_call(("q", "k", "v", "out"), ("lse",))]
