"""Where is bucketed DDP's extra peak? Per step, the peak (GiB) reached during forward, backward, sync
and the optimizer step (peak reset before each phase), and what is allocated after each. 2 ranks:

    PYTHONPATH=$PWD torchrun --standalone --nproc-per-node 2 results/diagnosis/bucket_memory.py
"""
import os

import torch
from cs336_systems.timing import autocast, reset_memory
from cs336_systems.distributed import DataParallelSpec, apply_data_parallel, build_optimizer
from cs336_systems.distributed.launch import init_from_env
from cs336_systems.model import TransformerLM, get_config, cross_entropy
gpu = torch.cuda.is_available()
rank, world, device = init_from_env("nccl" if gpu else "gloo")
size = os.environ.get("SIZE", "xl"); precision = os.environ.get("PREC", "bf16")
G = 2**30
def mem():
    return (torch.cuda.memory_allocated() / G, torch.cuda.max_memory_allocated() / G) if gpu else (0, 0)
for text, compile_ in [("individual+sharded", True), ("bucketed:1000+sharded", True), ("bucketed:1000+sharded", False),
                       ("bucketed:1000", True)]:
    reset_memory(device)
    spec = DataParallelSpec.parse(text)
    with device:
        model = TransformerLM(get_config(size, context_length=512))
    if compile_:
        model.compile_blocks()
    ddp = apply_data_parallel(model, spec, device)
    optimizer = build_optimizer(ddp, spec, 1e-4, "fused" if gpu else "foreach")
    data = torch.Generator().manual_seed(0)
    for step in range(4):
        tokens = torch.randint(10000, (4, 513), generator=data).to(device)
        ddp.on_train_batch_start()
        optimizer.zero_grad(set_to_none=True)
        out = []
        def phase(name, fn):
            if gpu: torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
            r = fn()
            if gpu: torch.cuda.synchronize()
            a, p = mem(); out.append(f"{name} peak {p:.2f} after {a:.2f}")
            return r
        with autocast(precision, device):
            loss = phase("fwd", lambda: cross_entropy(ddp(tokens[:, :-1]), tokens[:, 1:]))
        phase("bwd", loss.backward)
        del loss
        phase("sync", ddp.finish_gradient_synchronization)
        phase("opt", optimizer.step)
        if rank == 0:
            print(f"{text} compile={compile_} step {step}: " + "; ".join(out), flush=True)
    del ddp, optimizer, model
