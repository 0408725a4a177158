"""Collective latency and bandwidth on one node (handout 2.1; all-gather and reduce-scatter for the
2026 handout's section 8 ring model), one rank per process under torchrun.

    torchrun --nproc_per_node 4 -m cs336_systems.bench.allreduce --backend gloo --out gloo_4.csv
    torchrun ... --ops all_reduce all_gather reduce_scatter

For each op and size, a float32 tensor of that many MB (S, the full tensor: all-reduce's input and
output, all-gather's output, reduce-scatter's input; each rank's shard is S/n) goes through the op
`--warmup` times untimed and `--iters` times timed; each timed call is bracketed by a barrier and a
device synchronize, and an iteration's time is the slowest rank's. Rank 0 writes one row per op and
size: mean/std/median ms, algorithm bandwidth (S / time) and bus bandwidth (× what a ring moves per
rank relative to S: 2(n−1)/n for all-reduce, (n−1)/n for all-gather and reduce-scatter, as
nccl-tests reports it). An op the backend does not implement gives a row with status=unsupported.
These rows have mode=single: each call is timed alone, so its time includes the whole launch and
completion latency.

With --burst N (N > 0) each size of --burst-sizes-mb also gets an all-reduce row with mode=burst: N calls issued
back to back with async_op=True on one tensor, then waited for, the time per call being the burst's
time / N. This is how DDP issues its all-reduces (one per gradient or bucket, without waiting in
between), so consecutive calls overlap their launch and completion latency and the per-call cost o
fitted to these rows (t = o + bytes/w) is the one a bucket-size model needs; the single-call o
overstates it (2.3(b)).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cs336_systems.analysis.collectives import OPS, ring_factor
from cs336_systems.bench.checks import check_known, check_non_negative, check_not_empty, check_positive
from cs336_systems.bench.cli import config_or_usage_error, non_negative_int, positive_float, positive_int
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows
from cs336_systems.timing import synchronize
from cs336_systems.distributed.launch import init_from_env, shutdown



def collective(op: str, numel: int, world: int, device: torch.device,
               async_op: bool = False) -> Callable[[], object]:
    """A call running `op` on a tensor of numel float32 values in all (numel divisible by world); with
    async_op it returns the collective's work handle instead of waiting."""
    if op == "all_reduce":
        data = torch.randn(numel, device=device)
        return lambda: dist.all_reduce(data, async_op=async_op)
    full, shard = torch.randn(numel, device=device), torch.empty(numel // world, device=device)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, shard, async_op=async_op)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(shard, full, async_op=async_op)
    raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")


def time_collective(call: Callable[[], object], device: torch.device, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        call()
    synchronize(device)
    times = []
    for _ in range(iters):
        dist.barrier()
        start = timeit.default_timer()
        call()
        synchronize(device)
        times.append((timeit.default_timer() - start) * 1e3)
    return times


def time_burst(call: Callable[[], object], device: torch.device, warmup: int, iters: int, burst: int) -> list[float]:
    """Per-call milliseconds of `burst` async calls issued back to back and then waited for, once per
    iteration (after a barrier); call returns a work handle."""
    def run_burst():
        for work in [call() for _ in range(burst)]:
            work.wait()

    return [ms / burst for ms in time_collective(run_burst, device, warmup, iters)]


def measure(ops: list[str], sizes_mb: list[float], warmup: int, iters: int, backend: str,
            device: torch.device, burst: int = 0) -> list[dict]:
    """Every op at every size in the current process group; rows on rank 0, [] on the others. With
    burst > 0 the rows are per-call times of bursts of that many async calls (mode=burst)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for op in ops:
        for size_mb in sizes_mb:
            numel = int(size_mb * 2**20) // 4 // world * world  # every rank's shard the same size
            if numel < world:
                raise ValueError(f"--sizes-mb {size_mb:g} holds fewer float32 values than the {world} ranks")
            row = {"op": op, "backend": backend, "device_type": device.type, "world_size": world, "size_mb": size_mb,
                   "mode": "burst" if burst else "single", "burst": burst or 1, "iters": iters, **provenance(device)}
            call = collective(op, numel, world, device, async_op=bool(burst))
            try:
                work = call()  # a backend without the op says so here, on every rank alike
                if burst:
                    work.wait()
            except (RuntimeError, NotImplementedError) as error:
                if rank == 0:
                    rows.append({**row, "status": "unsupported", "error": str(error).splitlines()[0][:200]})
                    print(f"{backend} x{world} {op}: unsupported ({error})", file=sys.stderr, flush=True)
                continue
            times = (time_burst(call, device, warmup, iters, burst) if burst
                     else time_collective(call, device, warmup, iters))
            gathered: list[list[float]] = [None] * world  # type: ignore[list-item]
            dist.all_gather_object(gathered, times)
            slowest = [max(per_rank) for per_rank in zip(*gathered)]
            if rank == 0:
                median = statistics.median(slowest)
                algbw = numel * 4 / (median / 1e3) / 1e9
                rows.append({**row, "mean_ms": statistics.fmean(slowest), "std_ms": statistics.pstdev(slowest),
                             "median_ms": median, "algbw_gbps": algbw, "busbw_gbps": algbw * ring_factor(op, world),
                             "status": "ok"})
                shown = f" (per call of a burst of {burst})" if burst else ""
                print(f"{backend} x{world} {op} {size_mb:g} MB: {median:.3f} ms{shown}, {algbw:.2f} GB/s",
                      file=sys.stderr, flush=True)
    return rows


BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class AllReduceConfig:
    backend: str
    sizes_mb: tuple[float, ...] = (1, 10, 100, 1000)
    warmup: int = 5
    iters: int = 20
    ops: tuple[str, ...] = ("all_reduce",)
    burst: int = 0  # calls per burst; 0: no burst rows
    burst_sizes_mb: tuple[float, ...] = (0.01, 1, 10, 100)

    def __post_init__(self):
        check_known("backend", [self.backend], BACKENDS)
        check_not_empty("sizes_mb", self.sizes_mb)
        check_positive("tensor size (MB)", *self.sizes_mb)
        check_non_negative("warm-up calls", self.warmup)
        check_positive("timed calls", self.iters)
        check_not_empty("ops", self.ops)
        check_known("collective", list(self.ops), OPS)
        check_non_negative("calls per burst", self.burst)
        if self.burst:
            check_not_empty("burst_sizes_mb", self.burst_sizes_mb)
            check_positive("burst tensor size (MB)", *self.burst_sizes_mb)


def allreduce_rows(config: AllReduceConfig) -> list[dict]:
    """Start the process group from torchrun's environment, time every op and size, shut the group
    down; rank 0 returns one row per op and size, the other ranks none."""
    _, _, device = init_from_env(config.backend)
    rows = measure(list(config.ops), list(config.sizes_mb), config.warmup, config.iters, config.backend, device)
    if config.burst:  # the per-call cost DDP's bucket model needs is an all-reduce's
        rows += measure(["all_reduce"], list(config.burst_sizes_mb), config.warmup, config.iters, config.backend,
                        device, burst=config.burst)
    shutdown()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", required=True, choices=BACKENDS, help="gloo (CPU tensors) or nccl (GPUs)")
    parser.add_argument("--sizes-mb", nargs="+", type=positive_float, default=[1, 10, 100, 1000],
                        help="float32 tensor sizes in MB, one row each")
    parser.add_argument("--warmup", type=non_negative_int, default=5, help="untimed calls per op and size")
    parser.add_argument("--iters", type=positive_int, default=20, help="timed calls per op and size")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=["all_reduce"],
                        help="collectives to time (all-gather and reduce-scatter check the ring model of the "
                             "2026 handout's section 8)")
    parser.add_argument("--burst", type=non_negative_int, default=0,
                        help="also time bursts of this many back-to-back async all-reduces per burst size "
                             "(mode=burst rows: time per call); 0: none")
    parser.add_argument("--burst-sizes-mb", nargs="+", type=positive_float, default=[0.01, 1, 10, 100],
                        help="float32 tensor sizes in MB of the burst rows")
    parser.add_argument("--out", required=True, help="CSV file for the rows (written by rank 0)")
    args = parser.parse_args(argv)
    config = config_or_usage_error(parser, AllReduceConfig, backend=args.backend, sizes_mb=tuple(args.sizes_mb),
                                   warmup=args.warmup, iters=args.iters, ops=tuple(args.ops), burst=args.burst,
                                   burst_sizes_mb=tuple(args.burst_sizes_mb))
    rows = allreduce_rows(config)
    if rows:
        write_rows(rows, args.out)


if __name__ == "__main__":
    main()
