"""ZeRO-1 optimizer step on xl-shaped fp32 parameters, 2 ranks (torchrun): our ShardedOptimizer with
chunked all-gathers of several sizes, the previous version (one broadcast per owner of a flat copy),
and torch's ZeroRedundancyOptimizer, all updating with our fused AdamW; interleaved, two rounds.
Prints the median step time and the memory the step adds above what was allocated before it.

    git show 705ad8a:cs336_systems/distributed/sharded_optimizer.py > sharded_old.py  # the previous version
    PYTHONPATH=$PWD torchrun --standalone --nproc-per-node 2 results/diagnosis/sharded_gather.py
"""
import os, sys, time, statistics
import torch, torch.distributed as dist
sys.path.insert(0, ".")
from sharded_old import ShardedOptimizer as OldSharded
from torch.distributed.optim import ZeroRedundancyOptimizer
from cs336_systems.distributed import ShardedOptimizer
from cs336_systems.model import TransformerLM, get_config
from cs336_systems.optim import adamw_implementation
gpu = torch.cuda.is_available()
dist.init_process_group("nccl" if gpu else "gloo")
rank = dist.get_rank(); dev = torch.device("cuda", rank) if gpu else torch.device("cpu")
if not gpu:  # a CPU dry run of the script itself
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        setattr(torch.cuda, name, lambda *a: None)
    torch.cuda.memory_allocated = torch.cuda.max_memory_allocated = lambda *a: 0
    torch.cuda.get_device_name = lambda *a: "cpu"
else:
    torch.cuda.set_device(dev)
with torch.device("meta"):
    shapes = [p.shape for p in TransformerLM(get_config(os.environ.get("SIZE", "xl"))).parameters()]
torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(s, device=dev) * 0.02) for s in shapes]
for p in params:
    p.grad = torch.randn_like(p) * 1e-3
cls, extra = adamw_implementation("fused" if gpu else "foreach")
variants = {f"ours, {mb} MiB chunks": (lambda mb=mb: ShardedOptimizer(params, cls, gather_bucket_mb=mb, lr=1e-4, **extra))
            for mb in (16, 64, 256)}
variants["previous (flat broadcast per owner)"] = lambda: OldSharded(params, cls, lr=1e-4, **extra)
variants["torch ZeroRedundancyOptimizer"] = lambda: ZeroRedundancyOptimizer(params, optimizer_class=cls, lr=1e-4, **extra)
variants["unsharded"] = lambda: cls(params, lr=1e-4, **extra)
if rank == 0:
    print(f"{torch.cuda.get_device_name()} x {dist.get_world_size()}, torch {torch.__version__}, "
          f"commit {os.environ.get('CS336_GIT_COMMIT')}; {len(params)} tensors, "
          f"{sum(p.numel() for p in params)/1e9:.3f} B fp32 parameters", flush=True)
for rnd in range(2):
    for name, make in variants.items():
        opt = make()
        for _ in range(3):
            opt.step()
        torch.cuda.synchronize(); dist.barrier()
        base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
        ts = []
        for _ in range(10):
            dist.barrier(); torch.cuda.synchronize()
            s = time.perf_counter(); opt.step(); torch.cuda.synchronize(); ts.append((time.perf_counter() - s) * 1e3)
        extra_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
        if rank == 0:
            print(f"round {rnd} {name}: median {statistics.median(ts):.2f} ms (min {min(ts):.2f}, max {max(ts):.2f}), "
                  f"step adds {extra_mib:.0f} MiB at peak", flush=True)
        del opt; torch.cuda.empty_cache()
# every rank ends with the same parameters
check = torch.cat([p.detach().view(-1)[:1000] for p in params])
gathered = [torch.empty_like(check) for _ in range(2)]; dist.all_gather(gathered, check)
if rank == 0:
    print("ranks agree:", torch.equal(gathered[0], gathered[1]), flush=True)
dist.destroy_process_group()
