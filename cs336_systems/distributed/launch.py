"""Starting ranks: under torchrun (environment variables) or spawned here for tests and sweeps."""

from __future__ import annotations

import datetime
import faulthandler
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# NVLink multicast (NVLS) can take a shared host's GPUs out of service; keep it off everywhere.
SAFE_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def init_from_env(backend: str, timeout_s: float = 300, init_method: str = "env://") -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes; each NCCL rank takes the GPU of its local rank.

    Started as one plain process (no RANK and WORLD_SIZE in the environment, and the default
    init_method), it makes a group of one, rank 0, over an in-memory store: the same code then runs
    with or without torchrun (collectives over one rank return at once)."""
    for key, value in SAFE_NCCL_ENV.items():
        os.environ.setdefault(key, value)
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'nccl' was requested but CUDA is not available on this machine")
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"local rank {local_rank} needs GPU {local_rank}, but only "
                               f"{torch.cuda.device_count()} are visible")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=timeout_s)
    launched = [key for key in ("RANK", "WORLD_SIZE") if key in os.environ]
    if init_method == "env://" and not launched:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    elif len(launched) < 2:
        raise RuntimeError(f"only {launched} of RANK and WORLD_SIZE are set in the environment; start the ranks with "
                           "torchrun, or set neither to run as one process")
    else:
        dist.init_process_group(backend, init_method=init_method, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def _worker(rank: int, world_size: int, store_file: str, backend: str, fn, args) -> None:
    # A rank that dies in native code (gloo's std::terminate, a segfault) prints every thread's Python stack first.
    faulthandler.enable()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    # A file store has no server: no rank's exit can pull the store from under a peer still shutting
    # down (with a TCP store hosted by rank 0, that aborted the other rank now and then). A short
    # timeout turns a rank that never arrives into an error instead of a hang.
    init_from_env(backend, timeout_s=60, init_method=f"file://{store_file}")
    try:
        fn(rank, world_size, *args)
        shutdown()
    except BaseException:
        dist.destroy_process_group()
        raise


def shutdown() -> None:
    """Leave the process group only once every rank is done: a rank that closes its connections while
    a peer is still finishing its last collective makes gloo abort that peer (std::terminate)."""
    dist.barrier()
    dist.destroy_process_group()


def run_distributed(fn, world_size: int = 2, *args, backend: str = "gloo") -> None:
    """fn(rank, world_size, *args) on each of world_size local processes; a rank that raises fails the
    call and the others are stopped."""
    with tempfile.TemporaryDirectory() as tmp:
        store_file = str(Path(tmp) / "store")
        mp.spawn(_worker, args=(world_size, store_file, backend, fn, args), nprocs=world_size, join=True)
