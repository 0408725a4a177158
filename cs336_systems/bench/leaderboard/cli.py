"""The 8B step benchmark's command line and its run: the correctness check, then every (batch, provider) point,
each run's rows in files of its own (`{run_id}` in a path is the run's id). `--help` is the user's manual."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from cs336_systems.bench.cli import add_device_argument, config_or_usage_error, positive_int
from cs336_systems.bench.leaderboard.check import run_check
from cs336_systems.bench.leaderboard.config import COMPILE_MODES, CHECK_SIZES, TIMERS, LeaderboardConfig, check_world
from cs336_systems.bench.leaderboard.handout_timer import HANDOUT_REP_MS, HANDOUT_WARMUP_MS, empty_caches
from cs336_systems.bench.leaderboard.points import run_point
from cs336_systems.bench.leaderboard.provider import rank_and_world
from cs336_systems.bench.leaderboard.recipes import ABLATIONS, PROVIDERS
from cs336_systems.bench.plain_model import DEFAULT_CHUNK_TOKENS
from cs336_systems.distributed.launch import init_from_env, shutdown
from cs336_systems.model import parameter_count
from cs336_systems.provenance import provenance
from cs336_systems.results import PartialRows
from cs336_systems.timing import resolve_device

RUN_ID = "{run_id}"  # in an output path: the run's id, so that each run writes files of its own

MANUAL = """\
The handout's step: zero_grad(set_to_none=True), forward, cross-entropy, backward, AdamW step(), on random
token ids, bf16 parameters built directly on the device. Providers run one after another in one process, each
model freed, with its compiled code, before the next is built:

  ours             our TransformerLM: our FlashAttention (on sm_90 the Gluon kernels), fused LM head +
                   cross-entropy, fused Triton AdamW (moments in the parameters' dtype), per-block compile,
                   selective checkpointing with as many blocks saving their matmul outputs as the free memory
                   holds (selective:auto, chosen per point and per pass from a plain selective probe's peaks;
                   the row's `checkpoint` is the policy chosen, "A then B" where the first pass's differs),
                   and gradient accumulation over one sequence at a time (`microbatch` 1)
  torch_plain_sac  the plain-PyTorch anchor (bench/plain_model.py: fused QKV, SDPA, per-block compile, chunked
  torch_plain_ac   checkpointed LM head + CE, torch's fused AdamW) with torchtitan's selective checkpointing,
                   or with full per-block checkpointing
  ablations        ours with one choice changed (--ablations); ours-keep:N keeps the first N blocks whole,
                   ours-mm:N makes the first N save their matmul outputs, the others selective

Each point runs --warmup untimed steps (the first, compilation included, is `first_step_s`) and --steps timed
ones, synchronizing around each: one row with mean, std and median step time, TFLOP/s and MFU from the mean
(FLOPs: model.accounting.leaderboard_flops, recomputation not counted; peak: timing.peak_flops), peak memory,
mean SM clock and board power (NaN without nvidia-smi), and provenance. Out of memory is a row (status=oom). Every row's `run_wall_s` is the seconds since the process started.

The leaderboard's own test (handout 2026 §9) is --timer do_bench: each point builds its model and runs
triton.testing.do_bench(train_step, warmup=10_000, rep=30_000) (--do-bench-ms), where train_step is the
handout's zero_grad(set_to_none=True), forward, loss, backward, AdamW step(); the row's step times are do_bench's
(their mean is what the handout's test prints). With --cold-cache the run compiles from empty caches, as the
leaderboard's does, and `run_wall_s` is then what the leaderboard's 10-minute limit applies to:

  python -m cs336_systems.bench.leaderboard --timer do_bench --cold-cache --batch 2 --providers ours \
      --ablations --check-size none --out 'runs/leaderboard_8b/{run_id}.csv'

Before the timings, a correctness check at a scaled-down config with the same code paths (--check-size): each
main provider's loss and gradients against a float32 plain reference, within 2x the plain model's own error in
the run's dtype (or the dtype's floor). One row per provider (check_ok or check_fail), written to --check-out.

With --profile DIR, each point runs one more step under the profiler (bench/step_profile.py): device time by
category and peak memory by what holds it, rows of --profile-out; on CUDA the allocator snapshot is
DIR/<provider>_b<batch>.pickle.

Each run's rows go to files of their own: `{run_id}` in --out, --check-out or --profile-out is replaced by the
run's id (the pipeline writes results/runs/leaderboard_8b*/<run_id>.csv and merges them into the tables).

  python -m cs336_systems.bench.leaderboard --out 'runs/leaderboard_8b/{run_id}.csv'   # 8B, batch 2 and 1
  python -m cs336_systems.bench.leaderboard --size tiny --context 32 --batch 2 --compile none \\
      --param-dtype fp32 --check-size tiny --check-context 32 --warmup 1 --steps 1 --device cpu --out /tmp/lb.csv

On the CPU our kernels run under Triton's interpreter, which cannot multiply bfloat16: use fp32 there.
Two GPUs are a data-parallel spec away: under torchrun each rank takes its GPU and an equal share of every batch,
ours replicates with the given DDP kind and the anchors with torch DDP, and rank 0 writes the rows (MFU against
the ranks' summed peak); a rank's share runs in one pass, and an out-of-memory on one rank ends the run:

  torchrun --standalone --nproc_per_node 2 -m cs336_systems.bench.leaderboard --batch 2 \\
      --data-parallel bucketed:100 --out leaderboard_8b_2gpu.csv
"""


def run_path(template: str | os.PathLike, run_id: str) -> Path:
    """An output path with `{run_id}` replaced by the run's id."""
    return Path(str(template).replace(RUN_ID, run_id))


def default_check_out(out: str | os.PathLike) -> Path:
    """Where the check's rows go when no --check-out is given: OUT's name with `_check` before its suffix."""
    out = Path(out)
    return out.with_name(f"{out.stem}_check{out.suffix}")


def run(config: LeaderboardConfig, out, check_out=None) -> str:
    """The check (its rows to `check_out`, default `default_check_out(out)`), then every (batch, provider) point
    (rows to `out`, OUT.partial as they come), written by rank 0; `{run_id}` in a path is the run's id, which is
    returned. Under torchrun, or with data parallelism, the process group is joined first (NCCL on CUDA, gloo on a
    CPU), each rank on its local GPU; a group the caller started (tests' spawned ranks) is used as it is."""
    joined = not dist.is_initialized() and (config.data_parallel != "none" or "WORLD_SIZE" in os.environ)
    if joined:
        _, _, device = init_from_env("nccl" if resolve_device(config.device).type == "cuda" else "gloo")
    else:
        device = resolve_device(config.device)
    try:
        check_world(config, rank_and_world()[1])
        with empty_caches() if config.cold_cache else contextlib.nullcontext():
            return _run(config, out, check_out or default_check_out(out), device, writer=rank_and_world()[0] == 0)
    finally:
        if joined:
            shutdown()


def _run(config: LeaderboardConfig, out, check_out, device: torch.device, writer: bool) -> str:
    run_id = uuid.uuid4().hex[:12]
    prov = {**provenance(device), "run_id": run_id, "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    start = time.monotonic()
    if config.check_size != "none":
        checked = [{**row, **prov} for row in run_check(config, device)]
        if writer:
            checks = PartialRows(run_path(check_out, run_id))
            checks.add(checked)
            checks.finish()
    rows = PartialRows(run_path(out, run_id)) if writer else None
    points = config.points()
    profiled = (PartialRows(run_path(config.profile_csv(), run_id)) if config.profile_dir is not None and writer
                else None)
    for i, (batch, provider) in enumerate(points, 1):
        print(f"[{i}/{len(points)}] {provider} batch={batch} context={config.context_length}", file=sys.stderr,
              flush=True)
        row = run_point(provider, batch, config, device)
        shown = (f"{row['step_ms']:.1f} ms/step, MFU {row['mfu']:.1%}, peak {row['peak_mem_gib']:.1f} GiB, "
                 f"first step {row['first_step_s']:.1f} s" if row["status"] == "ok" else row["status"])
        print(f"[{i}/{len(points)}] {provider} batch={batch}: {shown} ({time.monotonic() - start:.0f} s into the run)",
              file=sys.stderr, flush=True)
        profile_rows = [{**r, **prov} for r in row.pop("profile_rows")]
        if writer:
            rows.add([{**row, **prov}])
        if profiled is not None:
            profiled.add(profile_rows)
    if writer:
        rows.finish()
    if profiled is not None:
        profiled.finish()
    print(f"run {run_id}: done in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return run_id


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="The 2026 leaderboard step (handout 2026 §9): one whole training step "
                                     "of the 8B model, ours against the plain-PyTorch anchors, on one GPU.",
                                     epilog=MANUAL, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="8B", help="model size of the 2026 table (8B; tiny or mini for a CPU smoke run)")
    parser.add_argument("--batch", nargs="+", type=positive_int, default=[2, 1], help="batch sizes, one point each")
    parser.add_argument("--context", type=positive_int, default=32768, help="tokens per sequence")
    parser.add_argument("--providers", nargs="*", default=list(PROVIDERS), choices=list(PROVIDERS),
                        help="ours and the plain-PyTorch anchors")
    parser.add_argument("--ablations", nargs="*", default=list(ABLATIONS),
                        help=f"variants of ours, each with one optimisation switched off ({', '.join(ABLATIONS)}), "
                             "or ours-keep:N (the first N blocks not checkpointed) or ours-mm:N (the first N blocks "
                             "saving their matmul outputs); none given: no ablations")
    parser.add_argument("--ablation-batch", nargs="+", type=positive_int, default=None,
                        help="the batch sizes (of --batch) at which the ablations run (default: the last of --batch)")
    parser.add_argument("--warmup", type=positive_int, default=2,
                        help="untimed steps, the first (compilation and autotuning) included")
    parser.add_argument("--steps", type=positive_int, default=3, help="timed steps")
    parser.add_argument("--compile", default="blocks", choices=COMPILE_MODES,
                        help="torch.compile each block (blocks) or run eagerly (none: CPU smoke runs)")
    parser.add_argument("--param-dtype", default="bf16", choices=["bf16", "fp32"],
                        help="parameter (and compute) dtype of every provider")
    parser.add_argument("--chunk-tokens", type=positive_int, default=DEFAULT_CHUNK_TOKENS,
                        help="tokens per chunk of the plain anchor's LM head + cross-entropy")
    parser.add_argument("--check-size", default="scaled", choices=CHECK_SIZES,
                        help="the correctness check's model: scaled (2 layers, d 256, the 8B head dim and vocab), "
                             "tiny, or none (no check)")
    parser.add_argument("--check-context", type=positive_int, default=1024, help="tokens per sequence of the check")
    parser.add_argument("--memory-margin-gib", type=float, default=4.0,
                        help="memory ours leaves free when it chooses how many blocks save their matmul outputs")
    parser.add_argument("--memory-capacity-gib", type=float, default=None,
                        help="the memory ours plans with (default: the device's total)")
    parser.add_argument("--profile", metavar="DIR",
                        help="after each point's timed steps, one more step under torch.profiler (and, on CUDA, the "
                             "allocator history: DIR/<provider>_b<batch>.pickle); its time by category and peak "
                             "memory split go to --profile-out")
    parser.add_argument("--profile-out", help="CSV of the profile rows (default: DIR/../leaderboard_8b_profile.csv; "
                                              "{run_id}: the run's id)")
    parser.add_argument("--data-parallel", default="none",
                        help="ours' data parallelism, a DDP kind without optimizer sharding (e.g. bucketed:100, "
                             "torch_ddp; the anchors then run torch DDP), one rank per GPU under torchrun, each "
                             "rank a batch / world share; none: one process")
    parser.add_argument("--timer", default="steps", choices=TIMERS,
                        help="steps: --warmup then --steps steps, synchronized around each; do_bench: the leaderboard's "
                             "test, triton.testing.do_bench over the whole step (CUDA only)")
    parser.add_argument("--do-bench-ms", nargs=2, type=positive_int, metavar=("WARMUP", "REP"),
                        default=[HANDOUT_WARMUP_MS, HANDOUT_REP_MS],
                        help="do_bench's warm-up and repetition times in ms (default: the handout's 10000 30000)")
    parser.add_argument("--cold-cache", action="store_true",
                        help="compile everything afresh: PyTorch's and Triton's caches in a new empty folder, "
                             "removed after (the leaderboard's run starts from empty caches)")
    add_device_argument(parser)
    parser.add_argument("--out", required=True, help="CSV file for the timing rows ({run_id}: the run's id)")
    parser.add_argument("--check-out", help="CSV file for the correctness check's rows ({run_id}: the run's id; "
                                            "default: OUT's name with _check before its suffix)")
    return parser


# Every provider runs with expandable allocator segments (unless the caller sets its own configuration): at the
# 8B step's sizes the default segments fragment, and a point that needs 116 GiB failed with 22 GiB reserved but
# free (H200, ours-mm:6 at batch 2). Read when CUDA first allocates, so set before anything touches the GPU.
ALLOC_CONF = "expandable_segments:True"


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)
    parser = build_parser()
    args = parser.parse_args(argv)
    config = config_or_usage_error(
        parser, LeaderboardConfig, size=args.size, batches=tuple(args.batch), context_length=args.context,
        providers=tuple(args.providers), ablations=tuple(args.ablations), ablation_batches=args.ablation_batch and tuple(args.ablation_batch),
        warmup=args.warmup, steps=args.steps, compile=args.compile, param_dtype=args.param_dtype,
        chunk_tokens=args.chunk_tokens, check_size=args.check_size, check_context=args.check_context,
        memory_margin_gib=args.memory_margin_gib, memory_capacity_gib=args.memory_capacity_gib,
        profile_dir=args.profile, profile_out=args.profile_out, data_parallel=args.data_parallel, timer=args.timer,
        do_bench_warmup_ms=args.do_bench_ms[0], do_bench_rep_ms=args.do_bench_ms[1], cold_cache=args.cold_cache,
        device=args.device)
    check_runs_here(parser, config)
    run(config, args.out, args.check_out)


def check_runs_here(parser: argparse.ArgumentParser, config: LeaderboardConfig) -> None:
    """Off CUDA, refuse at once (not after minutes of compiling) what cannot run: bfloat16 through our kernels under
    Triton's interpreter, or a model whose fp32 state outgrows the machine's memory."""
    if resolve_device(config.device).type == "cuda":
        return
    if config.timer == "do_bench":
        parser.error(f"--timer do_bench on device {config.device!r}: triton.testing.do_bench times with CUDA events; "
                     "use --timer steps off CUDA")
    state_gib = 16 * parameter_count(config.model_config()) / 2**30  # fp32 weights, gradients, AdamW's 2 moments
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    reasons = [*(["Triton's interpreter cannot run our kernels in bfloat16 (it computes them in float32)"]
                 if config.param_dtype == "bf16" else []),
               *([f"the model's fp32 state ({state_gib:.0f} GiB) outgrows this machine's memory"]
                 if state_gib > ram_gib else [])]
    if reasons:
        parser.error(f"size {config.size!r} in {config.param_dtype} on device {config.device!r}: {'; '.join(reasons)}. "
                     "The leaderboard step is a GPU benchmark; for a CPU smoke run pass --size tiny --param-dtype fp32 "
                     "--compile none --check-size tiny (see --help)")


if __name__ == "__main__":
    main()
