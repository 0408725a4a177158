"""How the FlashAttention-2 Triton kernels (`fa2.py`) are tuned: the tile configs each kernel
is autotuned over, how those are pruned per problem, and the tuning key (their settings, the float32
dot precision among them, are in `settings.py`).

A tile is (outer, inner, warps, stages). The outer tile is the one a program keeps (queries in the
forward and dQ kernels, keys in the dK/dV kernel); the inner one is streamed. Tuning is keyed on the
head dim, causality, precision, and the sequence lengths and batch x heads rounded up to powers of two
(a "shape bucket"), so a sweep over many lengths tunes once per bucket; the first call in a bucket
benchmarks every kept config (tens of seconds on a GPU where its tiles compile first, under a second
where another batch x heads compiled them) and says so on stderr. The tables are public for the
tests and for `bench/kernel_resources.py`, which compiles each config to read its registers and spills.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import triton

from cs336_systems.kernels.common import INTERPRET
from cs336_systems.kernels.flash.settings import FLOAT32_DOTS

# How float32 inputs may be multiplied and whether the forward uses tensor descriptors are settings
# (settings.py); both are part of the tuning key (PRECISION, TMA).

# Pipelines deeper than 3 stages are the usual Hopper win for 16-bit inputs, but float32 tiles take
# twice the shared memory: `prune_configs` keeps them for 16-bit inputs only. At d=128 with tf32x3
# dots no float32 config of these lists fits in the H100's 227 KiB of shared memory (the smallest
# asks 256 KiB), so FLOAT32_TILES adds smaller, 2-stage tiles for float32 inputs only (52-192 KiB at
# d=128, compiled for sm_90 by bench/kernel_resources.py).
# The 16-bit lists keep the tiles the autotuner chose at least once on an H100 over the leaderboard's shapes,
# the 8B model's attention and short many-head cases; the four it never chose were dropped, so a new shape
# bucket compiles and times 4 + 5 + 5 configs (DECISIONS.md#fa2-triton-tiles-and-autotuning).
FWD_TILES = [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3)]
BWD_TILES = [(128, 32, 8, 3), (128, 64, 8, 3), (64, 32, 4, 3), (128, 32, 4, 5), (128, 64, 8, 4)]
FLOAT32_TILES = [(64, 32, 8, 2), (32, 32, 4, 2), (32, 16, 4, 2)]
MAX_FLOAT32_STAGES = 3
# The interpreter runs any tile slowly: the smallest one keeps CPU tests quick.
INTERPRETER_TILE = (16, 16, 4, 1)


@dataclass(frozen=True)
class Tiling:
    """A kernel's tile list and the constexpr names of its outer and inner tile sizes."""

    tiles: list[tuple[int, int, int, int]]
    outer: str
    inner: str


# The three autotuned kernels of fa2.py (its TUNED_KERNELS), by name.
TILINGS = {"forward": Tiling(FWD_TILES, "BLOCK_M", "BLOCK_N"),
           "backward_dkdv": Tiling(BWD_TILES, "BLOCK_N", "BLOCK_M"),
           "backward_dq": Tiling(BWD_TILES, "BLOCK_M", "BLOCK_N")}

# Batch x heads is in the key because the best tile depends on how many programs fill the GPU: tuned at 16 batch x
# heads only (as before), a bucket's larger calls ran tiles up to 1.23x slower than their own best (dK/dV at 32 x 16
# x 2048 x 64; forward 1.18x, dQ up to 1.19x at 16 x 32 x 512 x 128, on an H100).
# Only the benchmarking repeats per batch x heads bucket: the tiles compile once per length bucket.
TUNING_KEY = ["SEQ_KEY_Q", "SEQ_KEY_K", "BATCH_HEADS_KEY", "BLOCK_D", "IS_CAUSAL", "PRECISION"]


def tile_config(tile: tuple[int, int, int, int], outer: str, inner: str) -> triton.Config:
    o, i, warps, stages = tile
    if o % i:
        # The causal kernels stream the unmasked tiles up to the start of the outer tile in inner-tile
        # steps; an inner tile that does not divide the outer one would run past it without the mask
        # (a (32, 64) tile did, on the H100).
        raise ValueError(f"tile {tile}: the outer tile {o} must be a multiple of the inner tile {i}")
    return triton.Config({outer: o, inner: i}, num_warps=warps, num_stages=stages)


def tile_configs(tiles, outer: str, inner: str) -> list[triton.Config]:
    """The kernel's tiles, then the float32-only ones."""
    return [tile_config(tile, outer, inner) for tile in [*tiles, *FLOAT32_TILES]]


def tile_of(config: triton.Config, outer: str = "BLOCK_M", inner: str = "BLOCK_N") -> tuple[int, int, int, int]:
    """A config's (outer, inner, warps, stages), as in the tile lists."""
    return config.kwargs[outer], config.kwargs[inner], config.num_warps, config.num_stages


def autotune_configs(tiling: Tiling) -> list[triton.Config]:
    """What a kernel is autotuned over: its tiles on a GPU, one small tile under the interpreter."""
    if INTERPRET:
        return [tile_config(INTERPRETER_TILE, tiling.outer, tiling.inner)]
    return tile_configs(tiling.tiles, tiling.outer, tiling.inner)


def prune_configs(configs, named_args, kernel: str = "forward", **kwargs):
    """Drop configs whose query or key tile is longer than the (power-of-two rounded) sequence, so a
    short problem is not tuned over tiles it cannot fill; for float32, deep pipelines; for 16-bit
    inputs, the float32-only tiles (`kernel` names the tiling, whose outer tile is the one kept). Keep
    at least the smallest."""
    args = {**named_args, **kwargs}  # the launcher passes the sizes by keyword
    max_m, max_n = args["SEQ_KEY_Q"], args["SEQ_KEY_K"]
    float32 = args["PRECISION"] in FLOAT32_DOTS
    tiling = TILINGS[kernel]
    float32_only = set(FLOAT32_TILES) - set(tiling.tiles)
    kept = [c for c in configs
            if c.kwargs["BLOCK_M"] <= max(16, max_m) and c.kwargs["BLOCK_N"] <= max(16, max_n)
            and (c.num_stages <= MAX_FLOAT32_STAGES if float32
                 else tile_of(c, tiling.outer, tiling.inner) not in float32_only)]
    return kept or [min(configs, key=lambda c: (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"], c.num_stages))]


def announcing_prune(kernel: str):
    """`prune_configs` for the autotuner of `kernel`, which also says on stderr, once per shape bucket,
    what is about to be tuned. Triton prunes only when a bucket has no tuned config yet, just before it
    benchmarks every kept config (tens of seconds, with no other sign of life)."""
    seen = set()

    def prune(configs, named_args, **kwargs):
        kept = prune_configs(configs, named_args, kernel, **kwargs)
        args = {**named_args, **kwargs}
        bucket = (*(args[name] for name in TUNING_KEY), args["Q"].dtype)
        if bucket not in seen:
            seen.add(bucket)
            print(f"flash_triton: autotuning the {kernel} kernel over {len(kept)} of {len(configs)} tile configs "
                  f"for {describe_bucket(args)} (once per shape bucket)", file=sys.stderr, flush=True)
        return kept

    return prune


def describe_bucket(args: dict) -> str:
    """A shape bucket in words, from the kernel's arguments (TUNING_KEY and Q)."""

    def lengths(key: int) -> str:  # a power of two: the lengths that round up to it
        return f"{key // 2 + 1}-{key}" if key > 1 else "1"

    dtype = str(args["Q"].dtype).removeprefix("torch.")
    dots = f", {args['PRECISION']} dots" if args["PRECISION"] in FLOAT32_DOTS else ""
    return (f"{lengths(args['SEQ_KEY_Q'])} queries, {lengths(args['SEQ_KEY_K'])} keys, "
            f"{lengths(args['BATCH_HEADS_KEY'])} batch x heads, head dim <= {args['BLOCK_D']}, "
            f"{'causal' if args['IS_CAUSAL'] else 'not causal'}, {dtype}{dots}")


def tuning_bench(fn, quantiles):
    """Autotuning needs a ranking, not a precise time: short warm-up and repetition."""
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)
