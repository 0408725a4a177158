"""All-reduce latency and bandwidth on one node (handout 2.1), one rank per process under torchrun.

    torchrun --nproc_per_node 4 -m cs336_systems.bench.allreduce --backend gloo --out gloo_4.csv

For each size, float32 tensors of that many MB are all-reduced `--warmup` times untimed and
`--iters` times timed; each timed call is bracketed by a barrier and a device synchronize, and an
iteration's time is the slowest rank's. Rank 0 writes one row per size: mean/std/median ms,
algorithm bandwidth (bytes per rank / time) and bus bandwidth (× 2(n−1)/n, what a ring moves).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit

import torch
import torch.distributed as dist

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", required=True, choices=["gloo", "nccl"])
    parser.add_argument("--sizes-mb", nargs="+", type=float, default=[1, 10, 100, 1000])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if any(size <= 0 for size in args.sizes_mb):
        parser.error(f"--sizes-mb must be positive, got {args.sizes_mb}")
    rank, world, device = init_from_env(args.backend)
    rows = []
    for size_mb in args.sizes_mb:
        numel = int(size_mb * 2**20) // 4
        local = time_allreduce(numel, device, args.warmup, args.iters)
        gathered: list[list[float]] = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(gathered, local)
        slowest = [max(per_rank) for per_rank in zip(*gathered)]
        if rank == 0:
            median = statistics.median(slowest)
            algbw = numel * 4 / (median / 1e3) / 1e9
            rows.append({"backend": args.backend, "device_type": device.type, "world_size": world,
                         "size_mb": size_mb, "mean_ms": statistics.fmean(slowest), "std_ms": statistics.pstdev(slowest),
                         "median_ms": median, "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (world - 1) / world,
                         "iters": args.iters, "status": "ok", **provenance(device)})
            print(f"{args.backend} x{world} {size_mb:g} MB: {median:.3f} ms, {algbw:.2f} GB/s", file=sys.stderr,
                  flush=True)
    if rank == 0:
        write_rows(rows, args.out)
    shutdown()


if __name__ == "__main__":
    main()
