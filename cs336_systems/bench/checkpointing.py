"""Peak memory and step time of activation checkpointing policies (handout 2026, §3.2 (b)).

For one model (a size from the 2025 or 2026 table), batch, context and precision, and each checkpoint
policy in the list (by default: none, then every k blocks for each k dividing num_layers), it builds the
model, applies the policy, runs `warmup` untimed training steps (forward, backward, AdamW; the first
allocates the optimizer state) and `steps` timed ones, synchronizing around each. Before each measured
step the allocator's peak is reset, so the peak is that of one steady-state step; it is read after the
backward (peak_fwd_bwd_mib: the activations' peak) and after the optimizer step (peak_memory_mib).
baseline_mib is what is allocated as the step starts (parameters and optimizer state; gradients are set
to None); fwd_bwd_above_baseline_mib = peak_fwd_bwd_mib - baseline_mib is the activations' peak plus
the gradients allocated by then. Out-of-memory becomes a row with status=oom and the sweep goes on. On a CPU the memory
columns are NaN (only the CUDA allocator keeps peak counts); run it there for smoke tests.

    python -m cs336_systems.bench.checkpointing --edition 2026 --size xl --batch-size 4 --context-length 2048 \\
        --precision bf16 --policies divisors nested:8,2 --out results/checkpointing.csv
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass

import torch

from cs336_systems.bench.cli import add_device_argument, device_from_args, non_negative_int, positive_int
from cs336_systems.bench.e2e import make_optimizer
from cs336_systems.provenance import provenance
from cs336_systems.results import PartialRows
from cs336_systems.timing import (
    DTYPES,
    autocast,
    check_precision,
    is_oom,
    oom_row,
    reset_memory,
    summarize,
    timed,
)
from cs336_systems.distributed.parallelize import ParallelPlan, parallelize
from cs336_systems.model import (
    ATTENTION_BACKENDS,
    SIZE_TABLES,
    CheckpointPolicy,
    TransformerLM,
    checkpoint_cost,
    cross_entropy,
    get_attention,
    get_config,
)
from cs336_systems.model.checkpointing import divisor_policies
from cs336_systems.optim import ADAMW_IMPLEMENTATIONS


@dataclass(frozen=True)
class SweepSpec:
    size: str
    size_table: str  # the handout edition whose size table `size` is from
    batch_size: int
    context_length: int
    precision: str
    attention: str
    compile: str  # "none" or "blocks" (each block torch.compile'd)
    optimizer: str
    warmup: int
    steps: int
    device: str


def _memory_mib(query, device: torch.device) -> float:
    return query(device) / 2**20 if device.type == "cuda" else float("nan")


def measure(spec: SweepSpec, policy: CheckpointPolicy) -> dict:
    """Times (ms) of the measured steps and the memory columns for one policy."""
    device = torch.device(spec.device)
    torch.manual_seed(0)
    config = get_config(spec.size, spec.size_table, context_length=spec.context_length, attention=spec.attention)
    with device:
        model = TransformerLM(config)
    # Checkpointing, then compilation (the selective policy's checkpoint inside each compiled block);
    # no data parallelism: the returned wrapper only passes calls through, so the model is used directly.
    parallelize(model, ParallelPlan(compile=spec.compile, checkpoint=policy), device)
    optimizer = make_optimizer(spec.optimizer, model.parameters())
    tokens = torch.randint(config.vocab_size, (spec.batch_size, spec.context_length + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    peaks_fwd_bwd: list[float] = []

    def step() -> None:
        with autocast(spec.precision, device):
            loss = cross_entropy(model(inputs), targets)
        loss.backward()
        # The caching allocator counts allocations as they are enqueued, so this needs no synchronize.
        peaks_fwd_bwd.append(_memory_mib(torch.cuda.max_memory_allocated, device))
        optimizer.step()

    samples, peaks, baselines = [], [], []
    for i in range(spec.warmup + spec.steps):
        model.zero_grad(set_to_none=True)
        if i >= spec.warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        baseline = _memory_mib(torch.cuda.memory_allocated, device)
        elapsed = timed(step, device)
        if i >= spec.warmup:
            samples.append(elapsed)
            peaks.append(_memory_mib(torch.cuda.max_memory_allocated, device))
            baselines.append(baseline)
    peak_fwd_bwd = max(peaks_fwd_bwd[spec.warmup:])
    return {**summarize(samples), "peak_memory_mib": max(peaks), "peak_fwd_bwd_mib": peak_fwd_bwd,
            "baseline_mib": max(baselines), "fwd_bwd_above_baseline_mib": peak_fwd_bwd - max(baselines)}


def run(spec: SweepSpec, policy: CheckpointPolicy) -> dict:
    """One row: the measurement, or status=oom."""
    device = torch.device(spec.device)
    config = get_config(spec.size, spec.size_table)
    base = {**asdict(spec), "d_model": config.d_model, "d_ff": config.d_ff,
            "num_layers": config.num_layers, "num_heads": config.num_heads, "policy": str(policy),
            "policy_kind": policy.kind, "segment_blocks": policy.segments[0] if policy.segments else 0,
            "levels": policy.levels,
            # block forward passes per step, recomputation included (the cost model's count, which the tests
            # check against the model's own calls)
            "block_forwards": checkpoint_cost(policy, config.num_layers, 1.0, 1.0).block_forwards}
    torch.compiler.reset()  # each point compiles afresh (see bench.e2e.run)
    reset_memory(device)
    try:
        result = measure(spec, policy)
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if not is_oom(error):
            raise
        row = oom_row(base, error)
    else:
        seconds = result["median_ms"] / 1e3
        return {**base, **result, "tokens_per_s": spec.batch_size * spec.context_length / seconds,
                "status": "ok", "error": ""}
    reset_memory(device)  # after the except block, so the traceback no longer holds the model
    return row


def parse_policies(texts: list[str], num_layers: int) -> list[CheckpointPolicy]:
    """Policies named on the command line; `divisors` stands for none and every k dividing num_layers."""
    policies: list[CheckpointPolicy] = []
    for text in texts:
        new = divisor_policies(num_layers) if text == "divisors" else [CheckpointPolicy.parse(text)]
        for policy in new:
            policy.check(num_layers)
            if policy not in policies:
                policies.append(policy)
    return policies


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="xl", help="a model size of the --edition table")
    parser.add_argument("--edition", default="2026", choices=list(SIZE_TABLES),
                        help="which handout's size table --size is from (2026 xl = 2025 2.7B)")
    parser.add_argument("--batch-size", type=positive_int, default=4)
    parser.add_argument("--context-length", type=positive_int, default=2048)
    parser.add_argument("--precision", default="bf16", choices=list(DTYPES), help="fp32, or autocast to bf16/fp16")
    parser.add_argument("--attention", default="naive", choices=sorted(ATTENTION_BACKENDS),
                        help="attention backend (cs336_systems.model.attention): %(choices)s")
    parser.add_argument("--compile", default="none", choices=["none", "blocks"],
                        help="run eagerly, or torch.compile each Transformer block")
    parser.add_argument("--optimizer", default="foreach", choices=ADAMW_IMPLEMENTATIONS,
                        help="AdamW implementation (see bench.e2e)")
    parser.add_argument("--policies", nargs="+", default=["divisors"],
                        help="none, every:K, nested:K1,K2,... or divisors (none and every K dividing num_layers)")
    parser.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps (at least 1 allocates "
                        "the optimizer state before the measured steps)")
    parser.add_argument("--steps", type=positive_int, default=5, help="measured steps")
    add_device_argument(parser)
    parser.add_argument("--out", required=True, help="CSV file for the rows")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    device = device_from_args(parser, args.device)
    try:
        config = get_config(args.size, args.edition, context_length=args.context_length)
        check_precision(args.precision, device)
        get_attention(args.attention)
        policies = parse_policies(args.policies, config.num_layers)
    except ValueError as error:
        parser.error(str(error))
    spec = SweepSpec(size=args.size, size_table=args.edition, batch_size=args.batch_size,
                     context_length=args.context_length, precision=args.precision, attention=args.attention,
                     compile=args.compile, optimizer=args.optimizer, warmup=args.warmup, steps=args.steps,
                     device=args.device)
    prov = provenance(device)
    rows = PartialRows(args.out)  # a cut run keeps its finished points in OUT.partial
    for i, policy in enumerate(policies, 1):
        row = run(spec, policy)
        rows.add([{**row, **prov}])
        shown = (f"{row['median_ms']:.1f} ms/step, peak {row['peak_memory_mib']:.0f} MiB"
                 if row["status"] == "ok" else row["status"])
        print(f"[{i}/{len(policies)}] {args.edition}:{args.size} {policy}: {shown}", file=sys.stderr, flush=True)
    rows.finish()


if __name__ == "__main__":
    main()
