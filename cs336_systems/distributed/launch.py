"""Starting ranks: under torchrun (environment variables) or forked here (from a server that has imported torch) for
tests and sweeps."""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import os
import sys
import tempfile
from multiprocessing import reduction
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


class _CallersContext:
    """The caller's environment, stdout and stderr at the call, handed to a rank as it starts: a fork server's own
    are those of its start (output sent there could land in a file that is gone; TRITON_INTERPRET, read when the
    kernels' modules are imported, could differ). Pickled among the rank's arguments before `fn`, so that it is in
    place before unpickling `fn` imports anything."""

    def __reduce__(self):  # called while the rank's arguments are pickled, when descriptors can be passed
        return _enter_callers_context, (dict(os.environ), reduction.DupFd(1), reduction.DupFd(2))


def _enter_callers_context(env: dict[str, str], stdout, stderr) -> None:
    os.environ.clear()
    os.environ.update(env)
    sys.stdout.flush()
    sys.stderr.flush()
    for passed, fd in ((stdout, 1), (stderr, 2)):
        received = passed.detach()
        os.dup2(received, fd)
        os.close(received)


def _worker(rank: int, world_size: int, store_file: str, backend: str, context: None, fn, args) -> None:
    # (context: the caller's, entered as the arguments were unpickled; see _CallersContext)
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
    call and the others are stopped. The ranks are forked from a server that has imported torch (the first call
    starts it): seconds of start-up saved per rank and call. fn must be importable by name (a module's function)."""
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed"])  # before the server's first start
    with tempfile.TemporaryDirectory() as tmp:
        store_file = str(Path(tmp) / "store")
        mp.start_processes(_worker, args=(world_size, store_file, backend, _CallersContext(), fn, args),
                           nprocs=world_size, join=True, start_method="forkserver")
