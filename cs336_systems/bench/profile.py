"""Kernel summaries per phase of a training step (handout 1.1.4), from Nsight Systems or the PyTorch profiler.

For each model size and context length, after warm-up, a few training steps in which forward,
backward and the AdamW step are each profiled on their own, plus forward-only (inference) passes.
With `--tool nsys` (the default where Nsight Systems writes reports) each point runs under `nsys
profile`, and the report is kept and read (`bench.nsys`); elsewhere, as on our GPU machines, where
nsys writes a raw .qdstrm only, each call is a torch.profiler session. Rows:
one per (phase, kernel) with calls and total time, one per attention stage (scores, softmax, final
matmul: ranges of the `naive_annotated` backend), one per (attention stage, kernel) launched inside
that stage (so the GEMMs of a stage can be told from its scaling and masking passes), and the
harness's own synchronized time and peak memory of each phase in the same process. On CUDA the "kernels" are GPU kernels; on a CPU, ATen operators by self
time (the `tool` column says which). Out-of-memory is a row.

    python -m cs336_systems.bench.profile --sizes small xl --context-lengths 128 256 512 1024 --out prof.csv

As a library: `profile_rows(ProfileConfig(sizes=("small",), device="cuda"))`.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from cs336_systems.bench import nsys
from cs336_systems.bench.e2e import RunSpec, add_edition_argument, build_model, check_sizes
from cs336_systems.bench.profile_names import ATTENTION_STAGES, is_annotation
from cs336_systems.bench.checks import check_known, check_non_negative, check_not_empty, check_positive
from cs336_systems.bench.cli import add_device_argument, config_or_usage_error, non_negative_int, positive_int
from cs336_systems.provenance import provenance
from cs336_systems.results import read_table, write_rows
from cs336_systems.timing import (
    annotate,
    autocast,
    DTYPES,
    is_oom,
    oom_row,
    peak_memory_mib,
    reset_memory,
    resolve_device,
    synchronize,
    timed,
)
from cs336_systems.model import SIZE_TABLES, cross_entropy
from cs336_systems.optim import AdamW

def summarize(averages, device: torch.device) -> tuple[list[dict], dict[str, tuple[int, float]]]:
    """(kernel rows, attention stage totals) of one profiling session, times in ms."""
    kernels, stages = [], {}
    for a in averages:
        if a.key in ATTENTION_STAGES:
            total = a.device_time_total if device.type == "cuda" else a.cpu_time_total
            stages[a.key] = (a.count, total / 1e3)
        elif is_annotation(a.key):
            continue
        elif device.type == "cuda":
            if a.self_device_time_total > 0 and a.self_cpu_time_total == 0:  # a GPU kernel, not a CPU op
                kernels.append({"kernel": a.key, "calls": a.count, "total_ms": a.self_device_time_total / 1e3})
        elif a.key.startswith("aten::") and a.self_cpu_time_total > 0:
            kernels.append({"kernel": a.key, "calls": a.count, "total_ms": a.self_cpu_time_total / 1e3})
    return kernels, stages


def stage_kernels(events, device: torch.device) -> dict[tuple[str, str], tuple[int, float]]:
    """{(attention stage, kernel): (calls, total ms)} of one profiling session: each GPU kernel is given to
    the stage range around the CPU op that launched it (the op's chain of `cpu_parent`s); on a CPU, each
    ATen op's self time to the stage around it. Kernels outside every stage are left out."""
    found: dict[tuple[str, str], list] = {}
    for event in events:
        stage, parent = None, event.cpu_parent
        while parent is not None and stage is None:
            stage = parent.name if parent.name in ATTENTION_STAGES else None
            parent = parent.cpu_parent
        if stage is None:
            continue
        if device.type == "cuda":
            launched = [(kernel.name, kernel.duration / 1e3) for kernel in event.kernels]
        elif event.name.startswith("aten::") and event.self_cpu_time_total > 0:
            launched = [(event.name, event.self_cpu_time_total / 1e3)]
        else:
            launched = []
        for name, ms in launched:
            entry = found.setdefault((stage, name), [0, 0.0])
            entry[0] += 1
            entry[1] += ms
    return {key: (calls, ms) for key, (calls, ms) in found.items()}


TOOLS = ("auto", "torch", "nsys")


@dataclass(frozen=True)
class ProfileConfig:
    """What to profile: every (size, context length) point, `warmup` unprofiled steps then `steps`
    profiled ones. `tool` is torch (torch.profiler), nsys (Nsight Systems) or auto (nsys where it writes
    reports, on CUDA; torch elsewhere). `nsys_child` marks the child process of the nsys path."""

    sizes: tuple[str, ...] = ("small",)
    context_lengths: tuple[int, ...] = (128, 256, 512, 1024)
    edition: str = "2025"  # whose size table `sizes` are from
    batch_size: int = 4
    precision: str = "fp32"
    warmup: int = 2
    steps: int = 2
    device: str = field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")
    tool: str = "auto"
    nsys_reports: Path | None = None
    nsys_child: bool = False

    def __post_init__(self):
        check_not_empty("sizes", self.sizes)
        check_not_empty("context lengths", self.context_lengths)
        check_sizes(self.edition, self.sizes, self.context_lengths)
        check_known("precision", [self.precision], DTYPES)
        check_known("profiling tool", [self.tool], TOOLS)
        check_positive("batch size", self.batch_size)
        check_positive("profiled steps", self.steps)
        check_non_negative("warm-up steps", self.warmup)
        resolve_device(self.device)


def resolve_tool(config: ProfileConfig) -> str:
    """The tool that `auto` stands for here; a ValueError when nsys is asked for and cannot work."""
    if config.tool == "torch" or config.nsys_child:
        return "torch"
    works = resolve_device(config.device).type == "cuda" and nsys.nsys_works()
    if config.tool == "nsys" and not works:
        installed = "installed" if shutil.which("nsys") else "not installed"
        raise ValueError(f"tool 'nsys' needs a CUDA device and an Nsight Systems that writes reports "
                         f"(device {config.device!r}; nsys {installed})")
    return "nsys" if works else "torch"


def profile_point(size: str, context_length: int, config: ProfileConfig, device: torch.device) -> list[dict]:
    """Rows of one (size, context) point. In the nsys child each measured call runs in an NVTX window
    (`nsys.window`) instead of a torch.profiler session, and only the harness rows come back: the
    parent reads the kernels from the Nsight report."""
    spec = RunSpec(size=size, mode="train_step", precision=config.precision, attention="naive_annotated",
                   batch_size=config.batch_size, context_length=context_length, warmup=config.warmup,
                   steps=config.steps, device=str(device), size_table=config.edition)
    torch.manual_seed(0)
    model = build_model(spec, device)
    optimizer = AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(model.config.vocab_size, (config.batch_size, context_length + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    state = {}

    def forward():
        # Drop the previous pass's loss first: it holds that pass's activations, and a profiled phase re-runs
        # the forward pass right after the timed one, which would otherwise keep two graphs' worth alive
        # (cs336_systems/bench/DECISIONS.md, "The profile harness's out-of-memory points").
        state.pop("loss", None)
        with annotate("forward"), autocast(config.precision, device):
            state["loss"] = cross_entropy(model(inputs), targets)

    def backward():
        with annotate("backward"):
            state["loss"].backward()

    def step():
        with annotate("optimizer"):
            optimizer.step()

    def inference():
        with annotate("inference"), torch.no_grad(), autocast(config.precision, device):
            model(inputs)

    phases = {"forward": forward, "backward": backward, "optimizer": step, "inference": inference}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    harness = {name: [] for name in phases}
    peaks = {name: 0.0 if device.type == "cuda" else float("nan") for name in phases}
    kernels: dict[tuple[str, str], list] = {}
    stage_rows: dict[tuple[str, str], list] = {}
    by_stage: dict[tuple[str, str, str], list] = {}
    for i in range(config.warmup + config.steps):
        measured = i >= config.warmup
        optimizer.zero_grad(set_to_none=True)
        for name, fn in phases.items():
            if not measured:
                fn()
                continue
            if device.type == "cuda":  # the phase's peak, over its timed and its profiled call
                torch.cuda.reset_peak_memory_stats(device)
            harness[name].append(timed(fn, device))  # the harness's time, unprofiled
            if name == "backward":  # backward needs a fresh graph to be profiled
                # and fresh gradients, as the timed backward had: accumulating into them adds kernels
                optimizer.zero_grad(set_to_none=True)
                forward()
            if config.nsys_child:
                synchronize(device)
                with annotate(nsys.window(name)):
                    fn()
                    synchronize(device)
                peaks[name] = max(peaks[name], peak_memory_mib(device))
                continue
            with profile(activities=activities) as prof:
                fn()
                synchronize(device)
            peaks[name] = max(peaks[name], peak_memory_mib(device))
            found, stages = summarize(prof.key_averages(), device)
            for row in found:
                entry = kernels.setdefault((name, row["kernel"]), [0, 0.0])
                entry[0] += row["calls"]
                entry[1] += row["total_ms"]
            for stage, (calls, total) in stages.items():
                entry = stage_rows.setdefault((name, stage), [0, 0.0])
                entry[0] += calls
                entry[1] += total
            for (stage, kernel), (calls, total) in stage_kernels(prof.events(), device).items():
                entry = by_stage.setdefault((name, stage, kernel), [0, 0.0])
                entry[0] += calls
                entry[1] += total
    harness_rows = [{"kind": "harness", "phase": name, "name": "synchronized wall time", "calls_per_step": 1,
                     "ms_per_step": sum(times) / len(times), "tool": "timeit + synchronize",
                     "peak_memory_mib": peaks[name]}
                    for name, times in harness.items()]
    if config.nsys_child:
        return harness_rows
    tool = "torch.profiler: CUDA kernels" if device.type == "cuda" else "torch.profiler: ATen ops (CPU self time)"
    steps = config.steps
    rows = [{"kind": "kernel", "phase": phase, "name": kernel, "calls_per_step": calls / steps,
             "ms_per_step": total / steps, "tool": tool} for (phase, kernel), (calls, total) in kernels.items()]
    rows += [{"kind": "attention_stage", "phase": phase, "name": stage, "calls_per_step": calls / steps,
              "ms_per_step": total / steps, "tool": tool} for (phase, stage), (calls, total) in stage_rows.items()]
    rows += [{"kind": "stage_kernel", "phase": phase, "stage": stage, "name": kernel, "calls_per_step": calls / steps,
              "ms_per_step": total / steps, "tool": tool}
             for (phase, stage, kernel), (calls, total) in by_stage.items()]
    return rows + harness_rows


def profile_point_nsys(size: str, context_length: int, config: ProfileConfig, reports: Path) -> list[dict]:
    """The point in a child process under Nsight Systems; its harness (or OOM) rows plus the kernel
    rows read from the report, which stays in `reports`."""
    stem = reports / f"{size}_{context_length}"
    child_csv = stem.with_suffix(".harness.csv")
    argv = ["--edition", config.edition, "--sizes", size, "--context-lengths", str(context_length),
            "--batch-size", str(config.batch_size),
            "--precision", config.precision, "--warmup", str(config.warmup), "--steps", str(config.steps),
            "--device", config.device, "--nsys-child", "--out", str(child_csv)]
    report = nsys.profile_under_nsys(stem, argv)
    rows = read_table(child_csv).to_dict("records")
    if rows[0]["status"] != "ok":
        return rows
    kernels, ranges = nsys.read_report(nsys.export_sqlite(report))
    found = nsys.summarize_report(kernels, ranges, config.steps, ATTENTION_STAGES)
    if not found:
        raise RuntimeError(f"no kernels of a measured window in {report}")
    shared = {k: v for k, v in rows[0].items() if k not in found[0] and k not in ("kind", "phase", "tool")}
    return rows + [{**shared, **row} for row in found]


def profile_rows(config: ProfileConfig) -> list[dict]:
    """Every point's rows, with provenance; a point that runs out of memory is one status=oom row."""
    if resolve_tool(config) == "nsys":
        with tempfile.TemporaryDirectory() as tmp:
            reports = config.nsys_reports or Path(tmp)
            return [row for size, context_length in itertools.product(config.sizes, config.context_lengths)
                    for row in profile_point_nsys(size, context_length, config, reports)]
    device = resolve_device(config.device)
    prov = provenance(device)
    rows = []
    for size, context_length in itertools.product(config.sizes, config.context_lengths):
        base = {"size": size, "size_table": config.edition, "context_length": context_length,
                "batch_size": config.batch_size,
                "precision": config.precision, "steps": config.steps}
        reset_memory(device)
        try:
            point = profile_point(size, context_length, config, device)
            rows += [{**base, **row, "status": "ok", **prov} for row in point]
            status = "ok"
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if not is_oom(error):
                raise
            rows.append({**oom_row({**base, "kind": "point"}, error), **prov})
            status = "oom"
        reset_memory(device)
        print(f"{size} ctx={context_length}: {status}", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_edition_argument(parser)
    parser.add_argument("--sizes", nargs="+", default=["small"], help="model sizes of the --edition table: " +
                        "; ".join(f"{edition}: {', '.join(table)}" for edition, table in SIZE_TABLES.items()))
    parser.add_argument("--context-lengths", nargs="+", type=positive_int, default=[128, 256, 512, 1024],
                        help="tokens per sequence, one point each (2025 sizes: at most 1024; 2026 sizes: any, "
                             "a point that does not fit is a status=oom row)")
    parser.add_argument("--batch-size", type=positive_int, default=4, help="sequences per step")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                        help="fp32, or autocast to bf16 / fp16")
    parser.add_argument("--warmup", type=non_negative_int, default=2, help="unprofiled warm-up steps")
    parser.add_argument("--steps", type=positive_int, default=2, help="profiled steps")
    parser.add_argument("--tool", default="auto", choices=TOOLS,
                        help="kernel summaries from torch.profiler or Nsight Systems; auto: nsys where it writes "
                             "reports (on CUDA), else torch.profiler")
    parser.add_argument("--nsys-reports", type=Path, help="keep the Nsight reports here (with --tool nsys)")
    parser.add_argument("--nsys-child", action="store_true", help=argparse.SUPPRESS)  # set by the nsys path
    add_device_argument(parser)
    parser.add_argument("--out", required=True, help="CSV file for the rows")
    args = parser.parse_args(argv)
    config = config_or_usage_error(
        parser, ProfileConfig, sizes=tuple(args.sizes), context_lengths=tuple(args.context_lengths),
        edition=args.edition,
        batch_size=args.batch_size, precision=args.precision, warmup=args.warmup, steps=args.steps,
        device=args.device, tool=args.tool, nsys_reports=args.nsys_reports, nsys_child=args.nsys_child)
    try:
        config = replace(config, tool=resolve_tool(config))
    except ValueError as error:
        parser.error(str(error))
    write_rows(profile_rows(config), args.out)


if __name__ == "__main__":
    main()
