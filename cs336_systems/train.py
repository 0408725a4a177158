"""Train the Transformer LM on one GPU or data-parallel with our wrappers (or torch's), started with torchrun.

    torchrun --nproc_per_node 2 -m cs336_systems.train --size small --wrapper bucketed:25 \
        --sharded-optimizer --data tokens.bin --steps 1000 --checkpoint-dir ckpt --loss-log train.csv

Data: `--data` names a flat file of uint16 token ids (read through np.memmap); without it, random
tokens. Every step draws a global batch of `batch_size * world` windows from one seeded generator;
rank r takes rows r, r+world, ... so ranks see disjoint data and the run does not depend on timing.
Checkpoints hold the model, the step and each rank's optimizer state (one file per rank: with the
sharded optimizer each rank owns a different shard); `--resume` continues from the latest.
The loss of every step is written by rank 0 (`--loss-log`), so runs can be compared curve against curve,
with the step's wall time (synchronized), the run's settings, its peak memory and provenance on each row.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from cs336_systems.bench.ddp import make_optimizer, parse_config, wrap
from cs336_systems.bench.provenance import provenance
from cs336_systems.bench.results import write_rows
from cs336_systems.bench.timing import DTYPES, autocast, peak_memory_mib, timed
from cs336_systems.distributed import DDPBucketed
from cs336_systems.distributed.launch import init_from_env, shutdown
from cs336_systems.model import MODEL_SIZES, TransformerLM, cross_entropy, get_config


def batches(data: np.ndarray | None, vocab: int, batch: int, context: int, world: int, rank: int, seed: int, step: int):
    """This rank's (inputs, targets) for a step: its rows of the step's seeded global batch."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if data is None:
        tokens = torch.randint(vocab, (batch * world, context + 1), generator=gen)
    else:
        starts = torch.randint(len(data) - context - 1, (batch * world,), generator=gen).tolist()
        tokens = torch.from_numpy(np.stack([data[s: s + context + 1] for s in starts]).astype(np.int64))
    mine = tokens[rank::world]
    return mine[:, :-1], mine[:, 1:]


def checkpoint_path(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank}.pt"


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> list[dict]:
    torch.manual_seed(args.seed + rank)  # ranks start apart: the wrappers broadcast rank 0's weights
    with device:
        model = TransformerLM(get_config(args.size, context_length=args.context_length, attention=args.attention))
    wrapper, bucket_mb, _ = parse_config(args.wrapper)
    ddp = wrap(model, wrapper, bucket_mb, device) if world > 1 else model
    optimizer = make_optimizer("sharded" if args.sharded_optimizer else "adamw", model, args.lr)
    start = 0
    ckpt_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if args.resume and ckpt_dir and checkpoint_path(ckpt_dir, rank).exists():
        state = torch.load(checkpoint_path(ckpt_dir, rank), map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    data = np.memmap(args.data, dtype=np.uint16, mode="r") if args.data else None
    sync = getattr(ddp, "finish_gradient_synchronization", lambda: None)
    log = []
    for step in range(start, args.steps):
        inputs, targets = batches(data, model.config.vocab_size, args.batch_size, args.context_length, world, rank,
                                  args.seed, step)
        inputs, targets = inputs.to(device), targets.to(device)

        def train_step():
            if isinstance(ddp, DDPBucketed):
                ddp.reset()
            optimizer.zero_grad(set_to_none=True)
            with autocast(args.precision, device):
                loss = cross_entropy(ddp(inputs), targets)
            loss.backward()
            sync()
            optimizer.step()
            return loss

        losses = []
        step_ms = timed(lambda: losses.append(train_step()), device)
        mean_loss = losses[0].detach().clone()
        if world > 1:
            dist.all_reduce(mean_loss)
            mean_loss /= world
        log.append({"step": step + 1, "loss": float(mean_loss), "step_ms": step_ms})
        if rank == 0 and (step + 1) % args.log_every == 0:
            print(f"step {step + 1}: loss {float(mean_loss):.4f}", flush=True)
        if ckpt_dir and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps):
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            tmp = checkpoint_path(ckpt_dir, rank).with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, checkpoint_path(ckpt_dir, rank))  # an interrupted save keeps the previous one
    return log


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", choices=list(MODEL_SIZES))
    parser.add_argument("--wrapper", default="bucketed:25",
                        help="none | naive | flat | individual | bucketed:MB | torch_ddp (with 2+ ranks)")
    parser.add_argument("--sharded-optimizer", action="store_true", help="ZeRO-1: shard AdamW's state")
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument("--batch-size", type=int, default=4, help="per rank")
    parser.add_argument("--context-length", type=int, default=256)
    parser.add_argument("--precision", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default=None, help="uint16 token file (np.memmap); default: random tokens")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--loss-log", default=None, help="CSV of the loss per step (rank 0)")
    parser.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        parse_config(args.wrapper)
    except ValueError as error:
        parser.error(str(error))
    if args.data and not Path(args.data).exists():
        parser.error(f"--data {args.data!r} does not exist")
    rank, world, device = init_from_env(args.backend)
    log = train(args, rank, world, device)
    if rank == 0 and args.loss_log:
        run = {"size": args.size, "attention": args.attention, "wrapper": args.wrapper if world > 1 else "none",
               "sharded_optimizer": args.sharded_optimizer, "world_size": world, "batch_per_rank": args.batch_size,
               "context_length": args.context_length, "precision": args.precision, "backend": args.backend,
               "tokens_per_step": args.batch_size * world * args.context_length,
               "peak_memory_mib": peak_memory_mib(device), **provenance(device)}
        write_rows([{**row, **run} for row in log], args.loss_log)
    shutdown()


if __name__ == "__main__":
    main()
