"""Train the Transformer LM, as one process or data-parallel with our wrappers (or torch's) under torchrun.

    python -m cs336_systems.train --size tiny --wrapper none --steps 20
    torchrun --nproc_per_node 2 -m cs336_systems.train --size small --wrapper bucketed:25+sharded \
        --data tokens.bin --steps 1000 --checkpoint-dir ckpt --loss-log train.csv

`--wrapper` is a data-parallel spec, KIND[:BUCKET_MB][+SHARDING] (see
cs336_systems.distributed.parallelize); started without torchrun, the run is one rank. With `--compile`
and `--checkpoint` it makes the run's ParallelPlan, which `parallelize` applies in its fixed order
(checkpointing, compilation, data parallelism).
Data: `--data` names a flat file of uint16 token ids (read through np.memmap); without it, random
tokens. Every step draws a global batch of `batch_size * world` windows from one seeded generator;
rank r takes rows r, r+world, ... so ranks see disjoint data and the run does not depend on timing.
Checkpoints: one folder per saved step (`step_000100/rank0.pt`, one file per rank since with a sharded
optimizer each rank owns a different shard), marked complete by rank 0 (`COMPLETE`) only once every
rank has written its file; `--resume` continues from the newest complete step, so a run killed between
two ranks' saves resumes from the previous step, not from a mix. The last `--keep-checkpoints` stay.
The loss of every step is written by rank 0 (`--loss-log`), so runs can be compared curve against curve,
with the step's wall time (synchronized), the run's settings, its peak memory and provenance on each row.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from cs336_systems.distributed import DataParallelSpec, build_optimizer
from cs336_systems.distributed.launch import init_from_env, shutdown
from cs336_systems.bench.cli import non_negative_int, positive_float, positive_int
from cs336_systems.distributed.parallelize import (KINDS, SHARDINGS, add_plan_arguments, argument_type, parallelize,
                                                   plan_from_args)
from cs336_systems.model import ATTENTION_BACKENDS, MODEL_SIZES, TransformerLM, get_attention, get_config
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows
from cs336_systems.timing import DTYPES, peak_memory_mib, timed
from cs336_systems.train_step import autocast_loss, forwards, train_step

TOKEN_DTYPE = np.uint16
COMPLETE = "COMPLETE"  # the marker file of a step every rank has saved


# ---- data -------------------------------------------------------------------------------------

def load_tokens(path: str | Path, vocab_size: int, context_length: int) -> np.ndarray:
    """The token file as a read-only memmap, checked up front: at least one window of context_length
    inputs plus one target, and every id below vocab_size (a ValueError naming the file otherwise)."""
    nbytes = os.path.getsize(path)
    itemsize = np.dtype(TOKEN_DTYPE).itemsize
    if nbytes % itemsize:
        raise ValueError(f"--data {str(path)!r} has {nbytes} bytes, not a whole number of {TOKEN_DTYPE.__name__} "
                         "token ids")
    needed = context_length + 1
    if nbytes // itemsize < needed:
        raise ValueError(f"--data {str(path)!r} holds {nbytes // itemsize} tokens, fewer than one training window "
                         f"needs: {needed} (--context-length {context_length} inputs, then one more target)")
    data = np.memmap(path, dtype=TOKEN_DTYPE, mode="r")
    largest = int(data.max())
    if largest >= vocab_size:
        raise ValueError(f"--data {str(path)!r} holds token id {largest}, beyond the model's vocabulary of "
                         f"{vocab_size} ids (0..{vocab_size - 1})")
    return data


def batches(data: np.ndarray | None, vocab: int, batch: int, context: int, world: int, rank: int, seed: int, step: int):
    """This rank's (inputs, targets) for a step: its rows of the step's seeded global batch."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if data is None:
        tokens = torch.randint(vocab, (batch * world, context + 1), generator=gen)
    else:  # a window is context + 1 tokens: the last start is len - context - 1
        starts = torch.randint(len(data) - context, (batch * world,), generator=gen).tolist()
        tokens = torch.from_numpy(np.stack([data[s: s + context + 1] for s in starts]).astype(np.int64))
    mine = tokens[rank::world]
    return mine[:, :-1], mine[:, 1:]


# ---- checkpoints ------------------------------------------------------------------------------

def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def saved_steps(root: Path, complete_only: bool = True) -> list[int]:
    """Steps with a folder under root, oldest first (only those marked complete, by default)."""
    steps = []
    for path in root.glob("step_*"):
        number = path.name.removeprefix("step_")
        if path.is_dir() and number.isdigit() and (not complete_only or (path / COMPLETE).exists()):
            steps.append(int(number))
    return sorted(steps)


def _atomic_write(write, path: Path) -> None:
    """write(tmp) then rename over path: a save killed midway leaves no half-written file under path."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_checkpoint(root: Path, step: int, state: dict, rank: int, world: int, keep: int) -> None:
    """Every rank writes its file of the step; once all have (a barrier), rank 0 marks the step
    complete and deletes the older steps beyond the newest `keep` complete ones."""
    folder = step_dir(root, step)
    folder.mkdir(parents=True, exist_ok=True)
    _atomic_write(lambda tmp: torch.save(state, tmp), folder / f"rank{rank}.pt")
    dist.barrier()
    if rank != 0:
        return
    _atomic_write(lambda tmp: tmp.write_text(json.dumps({"step": step, "world_size": world})), folder / COMPLETE)
    kept = set(saved_steps(root)[-keep:])
    # Only older steps: nothing there is being written (every rank is past them), and a partial
    # folder left by a killed run is cleared once a newer step is complete.
    for old in saved_steps(root, complete_only=False):
        if old < step and old not in kept:
            shutil.rmtree(step_dir(root, old), ignore_errors=True)


def load_checkpoint(root: Path, rank: int, world: int, device: torch.device) -> dict | None:
    """This rank's state at the newest step that every rank saved (rank 0 decides, so all ranks
    load the same step), or None when there is none."""
    choice = [None, None]  # (step, error), decided by rank 0 and sent to all, so that all fail alike
    if rank == 0 and saved_steps(root):
        choice[0] = saved_steps(root)[-1]
        saved_world = json.loads((step_dir(root, choice[0]) / COMPLETE).read_text())["world_size"]
        if saved_world != world:
            choice[1] = f"checkpoint {step_dir(root, choice[0])} was saved by {saved_world} ranks; this run has {world}"
    dist.broadcast_object_list(choice, src=0)
    if choice[1]:
        raise ValueError(choice[1])
    if choice[0] is None:
        return None
    folder = step_dir(root, choice[0])
    return torch.load(folder / f"rank{rank}.pt", map_location=device)


# ---- training ---------------------------------------------------------------------------------

def train(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> list[dict]:
    """Run (or continue) the training of args (from `parse_args`), one rank of world; the rows of the
    steps it ran."""
    spec = args.wrapper
    torch.manual_seed(args.seed + rank)  # ranks start apart: the wrappers broadcast rank 0's weights
    with device:
        model = TransformerLM(get_config(args.size, context_length=args.context_length, attention=args.attention))
    data = load_tokens(args.data, model.config.vocab_size, args.context_length) if args.data else None
    ddp = parallelize(model, plan_from_args(args, spec), device)
    optimizer = build_optimizer(ddp, spec, args.lr)
    start = 0
    ckpt_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if args.resume and ckpt_dir:
        state = load_checkpoint(ckpt_dir, rank, world, device)
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start = state["step"]
        if rank == 0:
            print(f"resuming after step {start}" if state else f"no complete checkpoint in {ckpt_dir}: from scratch",
                  flush=True)
    log = []
    loss_fn = autocast_loss(ddp, args.precision, device)
    for step in range(start, args.steps):
        inputs, targets = batches(data, model.config.vocab_size, args.batch_size, args.context_length, world, rank,
                                  args.seed, step)
        inputs, targets = inputs.to(device), targets.to(device)
        losses = []
        step_ms = timed(lambda: losses.append(train_step(ddp, optimizer, forwards(loss_fn, inputs, targets))), device)
        mean_loss = losses[0].clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world
        log.append({"step": step + 1, "loss": float(mean_loss), "step_ms": step_ms})
        if rank == 0 and (step + 1) % args.log_every == 0:
            print(f"step {step + 1}: loss {float(mean_loss):.4f}", flush=True)
        if ckpt_dir and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps):
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}
            save_checkpoint(ckpt_dir, step + 1, state, rank, world, args.keep_checkpoints)
    return log


# ---- command line -----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", choices=list(MODEL_SIZES), help="model size")
    shardings = "|".join("+" + s for s in SHARDINGS if s != "none")
    parser.add_argument("--wrapper", type=argument_type(DataParallelSpec.parse),
                        default=DataParallelSpec.parse("bucketed:25"),
                        help=f"data-parallel spec KIND[:BUCKET_MB][{shardings}], KIND one of {', '.join(KINDS)} "
                             "(default: bucketed:25)")
    parser.add_argument("--sharded-optimizer", action="store_true",
                        help="deprecated: write --wrapper KIND+sharded (ZeRO-1, our sharded AdamW)")
    add_plan_arguments(parser, data_parallel_flag=None)  # --compile, --checkpoint; --wrapper is the spec
    parser.add_argument("--attention", default="sdpa", choices=sorted(ATTENTION_BACKENDS),
                        help="attention backend (cs336_systems.model.attention): %(choices)s")
    parser.add_argument("--batch-size", type=positive_int, default=4, help="sequences per rank and step")
    parser.add_argument("--context-length", type=positive_int, default=256, help="tokens per sequence")
    parser.add_argument("--precision", default="bf16", choices=sorted(DTYPES), help="autocast dtype (fp32: none)")
    parser.add_argument("--lr", type=positive_float, default=3e-4, help="AdamW learning rate")
    parser.add_argument("--steps", type=positive_int, default=100, help="train until this step (resumed runs too)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the weights and the batches")
    parser.add_argument("--data", default=None, help="uint16 token file (np.memmap); default: random tokens")
    parser.add_argument("--checkpoint-dir", default=None, help="folder of the per-step checkpoints")
    parser.add_argument("--checkpoint-every", type=positive_int, default=100,
                        help="save every this many steps (and after the last)")
    parser.add_argument("--keep-checkpoints", type=positive_int, default=2, help="complete checkpoints kept")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in --checkpoint-dir, if any")
    parser.add_argument("--log-every", type=positive_int, default=10, help="print the loss every this many steps")
    parser.add_argument("--loss-log", default=None, help="CSV of the loss per step (rank 0)")
    parser.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo",
                        choices=["nccl", "gloo"], help="torch.distributed backend (default: nccl with a GPU)")
    return parser


def parse_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The flags, with the data-parallel spec parsed once: `args.wrapper`, the DataParallelSpec every later
    step reads, with the deprecated --sharded-optimizer folded in (+sharded) and then dropped."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    if args.sharded_optimizer:
        warnings.warn("--sharded-optimizer is deprecated: write --wrapper KIND+sharded", DeprecationWarning,
                      stacklevel=2)
        if args.wrapper.optimizer_sharding not in ("none", "sharded"):
            parser.error(f"--sharded-optimizer contradicts --wrapper {args.wrapper} (optimizer sharding "
                         f"{args.wrapper.optimizer_sharding!r})")
        args.wrapper = replace(args.wrapper, optimizer_sharding="sharded")
    del args.sharded_optimizer
    return args


def check_args(args: argparse.Namespace) -> None:
    """Errors argparse's per-flag checks cannot see, raised as ValueError before any rank starts."""
    get_attention(args.attention)  # imports the backend's module: an error there shows before any rank starts
    plan_from_args(args, args.wrapper)  # a plan the flags cannot make (fsdp with --compile) fails here
    args.checkpoint.check(get_config(args.size).num_layers)  # and a policy longer than the model's stack
    if args.resume and not args.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir")
    if args.checkpoint_dir and not args.resume and saved_steps(Path(args.checkpoint_dir), complete_only=False):
        # a fresh run would mix its checkpoints with the old run's newer ones
        raise ValueError(f"--checkpoint-dir {args.checkpoint_dir!r} already holds checkpoints: pass --resume to "
                         "continue that run, or name an empty folder")
    if args.data:
        if not Path(args.data).is_file():
            raise ValueError(f"--data {args.data!r} does not exist")
        load_tokens(args.data, get_config(args.size).vocab_size, args.context_length)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(argv, parser)
    try:
        check_args(args)
    except ValueError as error:
        parser.error(str(error))
    spec = args.wrapper
    rank, world, device = init_from_env(args.backend)
    log = train(args, rank, world, device)
    if rank == 0 and args.loss_log:
        run = {"size": args.size, "attention": args.attention, "wrapper": str(spec.wrapper),
               "sharded_optimizer": spec.optimizer_sharding != "none", **spec.to_columns(), "world_size": world,
               "batch_per_rank": args.batch_size, "context_length": args.context_length, "precision": args.precision,
               "backend": args.backend, "tokens_per_step": args.batch_size * world * args.context_length,
               "peak_memory_mib": peak_memory_mib(device), **provenance(device)}
        write_rows([{**row, **run} for row in log], args.loss_log)
    shutdown()


if __name__ == "__main__":
    main()
