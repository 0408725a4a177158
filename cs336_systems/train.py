"""Train the Transformer LM, as one process or data-parallel with our wrappers (or torch's) under torchrun.

    python -m cs336_systems.train --size tiny --wrapper none --steps 20
    torchrun --nproc_per_node 2 -m cs336_systems.train --size small --wrapper bucketed:25+sharded \
        --data tokens.bin --steps 1000 --checkpoint-dir ckpt --loss-log train.csv

`--wrapper` is a data-parallel spec, KIND[:BUCKET_MB][+SHARDING] (see
cs336_systems.distributed.parallelize); started without torchrun, the run is one rank. With `--compile`
and `--checkpoint` it makes the run's ParallelPlan, which `parallelize` applies in its fixed order
(checkpointing, compilation, data parallelism).
Data: `--data` names a flat file of token ids, each an unsigned 16-bit little-endian integer (numpy
`ids.astype("<u2").tofile(path)`: no header, 2 bytes a token), read through np.memmap; without it, random
tokens. The file is checked up front: a whole number of tokens, at least one window, every id in the
vocabulary, and not an int32/int64 file of small ids (`check_token_width`). Every step draws a global
batch of `batch_size * world` windows from one seeded generator; rank r takes rows r, r+world, ... so
ranks see disjoint data and the run does not depend on timing.
Checkpoints (cs336_systems.checkpoint): one folder per saved step, one file per rank, marked complete with
every file's checksum and the run's identity once every rank has written its file; `--resume` continues from
the newest complete step whose files verify (a damaged newer step is skipped with a warning), refuses another
run's checkpoints, and a second run on the same folder is refused while the first holds it. The last
`--keep-checkpoints` stay.
The loss of every step is appended by rank 0 to `--loss-log` (CSV, flushed each step, so a killed run keeps
every step it finished; a resumed run keeps the rows up to the step it resumes from), with the step's wall
time (synchronized), the run's settings, its peak memory so far and provenance on each row.
"""

from __future__ import annotations

import argparse
import os
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from cs336_systems.distributed import DataParallelSpec, build_optimizer
from cs336_systems.distributed.launch import init_from_env, shutdown
from cs336_systems.bench.checks import check_context_length
from cs336_systems.bench.cli import non_negative_int, positive_float, positive_int
from cs336_systems.checkpoint import (CheckpointError, RunIdentity, checkpoint_lock, load_checkpoint, save_checkpoint,
                                      saved_steps)
from cs336_systems.distributed.parallelize import (KINDS, SHARDINGS, add_plan_arguments, argument_type, parallelize,
                                                   plan_from_args)
from cs336_systems.model import ATTENTION_BACKENDS, MODEL_SIZES, TransformerLM, get_attention, get_config
from cs336_systems.model.attention import SDPA_KERNELS
from cs336_systems.provenance import provenance
from cs336_systems.results import AppendedRows, check_output_file
from cs336_systems.timing import DTYPES, peak_memory_mib, timed
from cs336_systems.train_step import autocast_loss, forwards, train_step

TOKEN_DTYPE = np.dtype("<u2")  # unsigned 16-bit little-endian, whatever the machine's byte order


# ---- data -------------------------------------------------------------------------------------

def load_tokens(path: str | Path, vocab_size: int, context_length: int) -> np.ndarray:
    """The token file as a read-only memmap, checked up front: a whole number of 2-byte ids, at least one
    window of context_length inputs plus one target, ids 16 bits wide (`check_token_width`), and every id
    below vocab_size (a ValueError naming the file otherwise)."""
    if Path(path).is_dir():
        raise ValueError(f"--data {str(path)!r} is a directory, not a token file")
    if not Path(path).is_file():
        raise ValueError(f"--data {str(path)!r} does not exist")
    nbytes = os.path.getsize(path)
    itemsize = TOKEN_DTYPE.itemsize
    if nbytes % itemsize:
        raise ValueError(f"--data {str(path)!r} has {nbytes} bytes, not a whole number of {TOKEN_DTYPE.name} "
                         "token ids")
    needed = context_length + 1
    if nbytes // itemsize < needed:
        raise ValueError(f"--data {str(path)!r} holds {nbytes // itemsize} tokens, fewer than one training window "
                         f"needs: {needed} (--context-length {context_length} inputs, then one more target)")
    data = np.memmap(path, dtype=TOKEN_DTYPE, mode="r")
    check_token_width(data, path)
    largest = int(data.max())
    if largest >= vocab_size:
        raise ValueError(f"--data {str(path)!r} holds token id {largest}, beyond the model's vocabulary of "
                         f"{vocab_size} ids (0..{vocab_size - 1})")
    return data


def check_token_width(data: np.ndarray, path: str | Path, sample: int = 1 << 16) -> None:
    """Refuse a file of wider ids read as uint16. Small ids (< 65536) written as int32 or int64 read back, as
    little-endian uint16, with every second value 0 (the high halves): a file whose first `sample` values are
    0 at every odd position but not at every even one is such a file. Real 16-bit token streams do not put id 0
    at every other position of tens of thousands of tokens, so this refuses rather than warns: training on it
    would silently learn a stream of interleaved zeros. Reads at most `sample` values; a file of fewer than 32
    values is not judged."""
    head = np.asarray(data[: min(len(data), sample) // 2 * 2])
    if head.size >= 32 and not head[1::2].any() and head[0::2].any():
        raise ValueError(f"--data {str(path)!r} looks like int32 or int64 token ids, not uint16: every second "
                         f"16-bit value of its first {head.size} is 0. Convert it: "
                         "np.fromfile(path, np.int32).astype('<u2').tofile(new_path)")


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


# ---- training ---------------------------------------------------------------------------------

def run_identity(args: argparse.Namespace, world: int) -> RunIdentity:
    """What this run's checkpoints record, and what a checkpoint must match to be resumed."""
    return RunIdentity(size=args.size, wrapper=args.wrapper.kind, optimizer_sharding=args.wrapper.optimizer_sharding,
                       world_size=world)


def run_columns(args: argparse.Namespace, world: int, device: torch.device) -> dict:
    """The columns of every loss-log row beside the step's own: the run's settings and provenance
    (peak_memory_mib is filled in per row)."""
    spec = args.wrapper
    return {"size": args.size, "attention": args.attention, "wrapper": str(spec.wrapper),
            "sharded_optimizer": spec.optimizer_sharding != "none", **spec.to_columns(), "world_size": world,
            "batch_per_rank": args.batch_size, "context_length": args.context_length, "precision": args.precision,
            "backend": args.backend, "tokens_per_step": args.batch_size * world * args.context_length,
            "peak_memory_mib": peak_memory_mib(device), **provenance(device)}


class LossLog(list):
    """The rows of the steps run: a list whose `append` also appends the row, with the run's columns and the
    peak memory so far, to the --loss-log CSV and flushes it (results.AppendedRows). A resumed run (`resumed`
    the step it continues after) keeps the file's rows up to that step and drops the later ones."""

    def __init__(self, path: str, columns: dict, device: torch.device, resumed: int | None):
        super().__init__()
        self.file = AppendedRows(path, key="step", keep_until=resumed)
        self.columns, self.device = columns, device

    def append(self, row: dict) -> None:
        super().append(row)
        self.file.append({**row, **self.columns, "peak_memory_mib": peak_memory_mib(self.device)})


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> list[dict]:
    """Run (or continue) the training of args (from `parse_args`), one rank of world; the rows of the
    steps it ran. The checkpoint folder, if any, is locked for the run (checkpoint.checkpoint_lock)."""
    with checkpoint_lock(Path(args.checkpoint_dir) if args.checkpoint_dir else None, rank):
        return _train(args, rank, world, device)


def _train(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> list[dict]:
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
        state = load_checkpoint(ckpt_dir, rank, run_identity(args, world), device)
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start = state["step"]
        if rank == 0:
            print(f"resuming after step {start}" if state else f"no complete checkpoint in {ckpt_dir}: from scratch",
                  flush=True)
    log = []  # with --loss-log, rank 0's list also writes each row as it is appended
    if rank == 0 and args.loss_log:
        log = LossLog(args.loss_log, run_columns(args, world, device), device, start if args.resume else None)
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
            save_checkpoint(ckpt_dir, step + 1, state, rank, run_identity(args, world), args.keep_checkpoints)
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
    parser.add_argument("--data", default=None,
                        help="token file: flat unsigned 16-bit little-endian ids, no header (numpy "
                             "ids.astype('<u2').tofile(path)); default: random tokens")
    parser.add_argument("--checkpoint-dir", default=None, help="folder of the per-step checkpoints")
    parser.add_argument("--checkpoint-every", type=positive_int, default=100,
                        help="save every this many steps (and after the last)")
    parser.add_argument("--keep-checkpoints", type=positive_int, default=2, help="complete checkpoints kept")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in --checkpoint-dir, if any")
    parser.add_argument("--log-every", type=positive_int, default=10, help="print the loss every this many steps")
    parser.add_argument("--loss-log", default=None,
                        help="CSV of the loss per step (rank 0), appended as the run goes; a --resume run keeps "
                             "the rows up to the step it resumes from")
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
    check_context_length(args.context_length, {args.size: get_config(args.size).context_length})
    if args.backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("--backend nccl needs CUDA, which this machine does not have: use --backend gloo (the CPU)")
    if args.attention in SDPA_KERNELS and args.backend != "nccl":  # gloo ranks train on the CPU
        raise ValueError(f"--attention {args.attention} is one of SDPA's CUDA kernels; with --backend "
                         f"{args.backend} the run is on the CPU: use --attention sdpa (or naive, flash_pytorch)")
    if args.loss_log:
        check_output_file(args.loss_log, "--loss-log")
    plan_from_args(args, args.wrapper)  # a plan the flags cannot make (fsdp with --compile) fails here
    args.checkpoint.check(get_config(args.size).num_layers)  # and a policy longer than the model's stack
    if args.resume and not args.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir")
    if args.checkpoint_dir and Path(args.checkpoint_dir).exists() and not Path(args.checkpoint_dir).is_dir():
        raise ValueError(f"--checkpoint-dir {args.checkpoint_dir!r} is a file, not a folder")
    if args.checkpoint_dir and not args.resume and saved_steps(Path(args.checkpoint_dir), complete_only=False):
        # a fresh run would mix its checkpoints with the old run's newer ones
        raise ValueError(f"--checkpoint-dir {args.checkpoint_dir!r} already holds checkpoints: pass --resume to "
                         "continue that run, or name an empty folder")
    if args.data:
        load_tokens(args.data, get_config(args.size).vocab_size, args.context_length)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(argv, parser)
    try:
        check_args(args)
    except ValueError as error:
        parser.error(str(error))
    rank, world, device = init_from_env(args.backend)
    try:
        train(args, rank, world, device)
    except CheckpointError as error:  # raised on every rank alike: report it as the usage error it is
        shutdown()
        parser.error(str(error))
    shutdown()


if __name__ == "__main__":
    main()
