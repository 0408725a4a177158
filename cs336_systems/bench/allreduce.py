"""All-reduce latency and bandwidth on one node (handout 2.1), one rank per process under torchrun.

    torchrun --nproc_per_node 4 -m cs336_systems.bench.allreduce --backend gloo --out gloo_4.csv

For each size, float32 tensors of that many MB are all-reduced `--warmup` times untimed and
`--iters` times timed; each timed call is bracketed by a barrier and a device synchronize, and an
iteration's time is the slowest rank's. Rank 0 writes one row per size: mean/std/median ms,
algorithm bandwidth (bytes per rank / time) and bus bandwidth (× 2(n−1)/n, what a ring moves).

As a library, in each rank's process: `allreduce_rows(AllReduceConfig(backend="nccl"))`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cs336_systems.bench.checks import check_known, check_non_negative, check_not_empty, check_positive
from cs336_systems.bench.cli import config_or_usage_error, non_negative_int, positive_float, positive_int
from cs336_systems.bench.provenance import provenance
from cs336_systems.bench.results import write_rows
from cs336_systems.bench.timing import synchronize
from cs336_systems.distributed.launch import init_from_env, shutdown


def time_allreduce(numel: int, device: torch.device, warmup: int, iters: int) -> list[float]:
    data = torch.randn(numel, device=device)
    for _ in range(warmup):
        dist.all_reduce(data)
    synchronize(device)
    times = []
    for _ in range(iters):
        dist.barrier()
        start = timeit.default_timer()
        dist.all_reduce(data)
        synchronize(device)
        times.append((timeit.default_timer() - start) * 1e3)
    return times


BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class AllReduceConfig:
    backend: str
    sizes_mb: tuple[float, ...] = (1, 10, 100, 1000)
    warmup: int = 5
    iters: int = 20

    def __post_init__(self):
        check_known("backend", [self.backend], BACKENDS)
        check_not_empty("sizes_mb", self.sizes_mb)
        check_positive("tensor size (MB)", *self.sizes_mb)
        check_non_negative("warm-up calls", self.warmup)
        check_positive("timed calls", self.iters)


def allreduce_rows(config: AllReduceConfig) -> list[dict]:
    """Start the process group from torchrun's environment, time every size, shut the group down; rank
    0 returns one row per size, the other ranks none."""
    rank, world, device = init_from_env(config.backend)
    rows = []
    for size_mb in config.sizes_mb:
        numel = int(size_mb * 2**20) // 4
        local = time_allreduce(numel, device, config.warmup, config.iters)
        gathered: list[list[float]] = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(gathered, local)
        slowest = [max(per_rank) for per_rank in zip(*gathered)]
        if rank == 0:
            median = statistics.median(slowest)
            algbw = numel * 4 / (median / 1e3) / 1e9
            rows.append({"backend": config.backend, "device_type": device.type, "world_size": world,
                         "size_mb": size_mb, "mean_ms": statistics.fmean(slowest), "std_ms": statistics.pstdev(slowest),
                         "median_ms": median, "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (world - 1) / world,
                         "iters": config.iters, "status": "ok", **provenance(device)})
            print(f"{config.backend} x{world} {size_mb:g} MB: {median:.3f} ms, {algbw:.2f} GB/s", file=sys.stderr,
                  flush=True)
    shutdown()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", required=True, choices=BACKENDS, help="gloo (CPU tensors) or nccl (GPUs)")
    parser.add_argument("--sizes-mb", nargs="+", type=positive_float, default=[1, 10, 100, 1000],
                        help="float32 tensor sizes in MB, one row each")
    parser.add_argument("--warmup", type=non_negative_int, default=5, help="untimed all-reduces per size")
    parser.add_argument("--iters", type=positive_int, default=20, help="timed all-reduces per size")
    parser.add_argument("--out", required=True, help="CSV file for the rows (written by rank 0)")
    args = parser.parse_args(argv)
    config = config_or_usage_error(parser, AllReduceConfig, backend=args.backend, sizes_mb=tuple(args.sizes_mb),
                                   warmup=args.warmup, iters=args.iters)
    rows = allreduce_rows(config)
    if rows:
        write_rows(rows, args.out)


if __name__ == "__main__":
    main()
