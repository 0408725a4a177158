"""Communication against compute in a profiler trace (handout 2.3 ddp_overlap_individual_parameters (b);
for FSDP, the 2026 handout's fsdp_accounting (b): do the all-gathers finish before their layers need them).

Reads Chrome traces exported by `cs336_systems.bench.ddp --trace-dir`, draws each as a timeline with
lanes (the forward and backward ranges, compute, communication) and measures how much of the
communication time falls inside the backward pass, and how much of it is exposed: communication while
no compute kernel runs, in the forward, in the backward and in the whole step (a gather the compute
has to wait for shows up as exposed time). For the host side it also counts the collectives launched during
backward and the CPU time spent in those calls, and how much of the backward range the GPU is busy:
a backward that the GPU leaves idle is bound by the host, where every launched collective costs.

The figures of one call share their time axis (the longest trace's span), and shade the forward,
backward and optimizer ranges (record_function annotations of those names) behind the lanes.

    python -m cs336_systems.report.traces TRACE.json... --figures-dir figures/ddp_traces --out overlap.csv \
        [--rows results/ddp_traces.csv]

Why overlapping can hide nothing (fp32 torch DDP took as long as naive DDP, whose all-reduces all
run after backward) has candidate causes that these columns tell apart, comparing a trace with
communication during backward against `none` or `naive` (none during backward) of the same run:
- the communication kernels slow the compute kernels down (they share SMs and memory bandwidth):
  `compute_kernel_ms_in_backward` (the sum of compute kernels' durations, not their union) grows
  by about the communication time, while `exposed_in_backward_ms` stays small;
- they do not run concurrently at all (a kernel waits for SMs the other holds): the communication
  falls into gaps between compute kernels, so `exposed_in_backward_ms` is about the communication
  time and `compute_kernel_ms_in_backward` does not grow;
- the host issues the step more slowly (each collective call costs CPU time on autograd's thread):
  `gpu_busy_in_backward` falls and `host_ms_per_collective` times the number of collectives
  accounts for the longer backward;
- the communication is exposed after backward (the last buckets): `comm_after_backward_ms`.
A trace named `none_*` (no data parallelism) has no communication and gives the compute baseline.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pandas as pd

from cs336_systems.results import PROVENANCE_COLUMNS, read_rows, write_rows
from cs336_systems.report.figures import pyplot, save_figure

COMMUNICATION = re.compile(r"nccl|gloo:|all_?reduce|all_?gather|reduce_?scatter", re.IGNORECASE)
PHASES = ("forward", "backward", "optimizer")  # user annotations drawn as shaded ranges
PHASE_COLORS = {"forward": "tab:green", "backward": "tab:orange", "optimizer": "tab:purple"}
CPU_COMPUTE = re.compile(r"^aten::(mm|addmm|bmm|matmul|_softmax|mul|add)")
HOST_COLLECTIVE = re.compile(r"^c10d::")  # the CPU side of a collective call (c10d::allreduce_, ...)

Interval = tuple[float, float]


def lanes(events: list[dict]) -> dict[str, list[Interval]]:
    """(start, end) in µs of the forward, backward and optimizer ranges, compute work and communication."""
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in complete if e.get("cat") == "kernel"]
    out: dict[str, list[Interval]] = {"forward": [], "backward": [], "optimizer": [], "compute": [],
                                      "communication": []}
    for e in complete:
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if e.get("cat") == "user_annotation" and e["name"] in PHASES:
            out[e["name"]].append(span)
        elif COMMUNICATION.search(e["name"]) and (e.get("cat") == "kernel" or not kernels):
            out["communication"].append(span)
        elif (e.get("cat") == "kernel") if kernels else CPU_COMPUTE.match(e["name"]):
            out["compute"].append(span)
    return out


def _union(intervals: list[Interval]) -> list[Interval]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [tuple(m) for m in merged]


def overlap_fraction(communication: list[Interval], window: list[Interval]) -> float:
    """Share of (merged) communication time that lies inside the window intervals."""
    comm, win = _union(communication), _union(window)
    total = sum(end - start for start, end in comm)
    inside = sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in comm for s2, e2 in win)
    return inside / total if total else float("nan")


def exposed_ms(communication: list[Interval], compute: list[Interval], window: list[Interval] | None = None) -> float:
    """Milliseconds of communication during which no compute runs (inside window, if given)."""
    comm = _union(communication)
    if window is not None:
        comm = _union([(max(s1, s2), min(e1, e2)) for s1, e1 in comm for s2, e2 in _union(window)
                       if min(e1, e2) > max(s1, s2)])
    covered = sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in comm for s2, e2 in _union(compute))
    return (sum(end - start for start, end in comm) - covered) / 1e3


def host_side(events: list[dict], backward: list[Interval]) -> dict[str, float]:
    """Collective calls made during backward, the CPU time inside them, and the share of the backward
    range covered by GPU kernels (NaN for a CPU-only trace)."""
    inside = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op" and HOST_COLLECTIVE.match(e["name"])
              and any(s <= float(e["ts"]) <= end for s, end in backward)]
    kernels = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
               if e.get("ph") == "X" and e.get("cat") == "kernel" and "dur" in e]
    window = sum(end - start for start, end in _union(backward))
    return {"collectives_in_backward": len(inside),
            "host_collective_ms_in_backward": sum(float(e["dur"]) for e in inside) / 1e3,
            "backward_ms": window / 1e3,
            "gpu_busy_in_backward": overlap_fraction(backward, kernels) if kernels else float("nan")}


def span_ms(lanes_: dict[str, list[Interval]]) -> float:
    """Milliseconds from a trace's first to its last event (the shared axis is the longest of these)."""
    spans = [t for intervals in lanes_.values() for interval in intervals for t in interval]
    return (max(spans) - min(spans)) / 1e3


def compute_and_tail(found: dict[str, list[Interval]]) -> dict[str, float]:
    """Summed compute-kernel time (in backward and in the whole step) and the communication that runs
    after the backward range has ended (the exposed tail), in ms."""
    backward = _union(found["backward"])

    def starts_in_backward(span: Interval) -> bool:
        return any(s <= span[0] <= e for s, e in backward)

    end = max((e for _, e in backward), default=float("inf"))
    tail = sum(max(0.0, e - max(s, end)) for s, e in _union(found["communication"]))
    return {"compute_kernel_ms": sum(e - s for s, e in found["compute"]) / 1e3,
            "compute_kernel_ms_in_backward": sum(e - s for s, e in found["compute"] if starts_in_backward((s, e))) / 1e3,
            "comm_after_backward_ms": tail / 1e3}


def trace_row(name: str, events: list[dict], found: dict[str, list[Interval]]) -> dict:
    """The overlap table's row of one trace (communication columns NaN or 0 where it has none)."""
    comm = found["communication"]
    host = host_side(events, found["backward"])
    per_call = (host["host_collective_ms_in_backward"] / host["collectives_in_backward"]
                if host["collectives_in_backward"] else float("nan"))
    return {"trace": name, "communication_ms": sum(e - s for s, e in _union(comm)) / 1e3,
            "overlap_with_backward": overlap_fraction(comm, found["backward"]),
            "exposed_communication_ms": exposed_ms(comm, found["compute"]),
            "exposed_in_forward_ms": exposed_ms(comm, found["compute"], found["forward"]),
            "exposed_in_backward_ms": exposed_ms(comm, found["compute"], found["backward"]),
            **host, "host_ms_per_collective": per_call, **compute_and_tail(found)}


def draw(lanes_: dict[str, list[Interval]], path: str | Path, title: str, xmax_ms: float | None = None,
         rows: pd.DataFrame | None = None) -> None:
    """Compute and communication lanes over ms from the first event, the phases shaded behind them and
    named on top; `xmax_ms` fixes the axis so several traces compare."""
    origin = min(start for spans in lanes_.values() for start, _ in spans)
    fig, ax = pyplot().subplots(figsize=(10, 2.4))
    names = ["compute", "communication"]
    colors = {"compute": "tab:blue", "communication": "tab:red"}
    for row, name in enumerate(names):
        ax.broken_barh([((s - origin) / 1e3, (e - s) / 1e3) for s, e in _union(lanes_[name])], (row - 0.4, 0.8),
                       color=colors[name])
    for phase in PHASES:
        for s, e in _union(lanes_.get(phase, [])):
            left, right = (s - origin) / 1e3, (e - origin) / 1e3
            ax.axvspan(left, right, color=PHASE_COLORS[phase], alpha=0.15, linewidth=0)
            ax.text((left + right) / 2, 1.02, phase, transform=ax.get_xaxis_transform(), ha="center", va="bottom",
                    fontsize=8, color=PHASE_COLORS[phase])
    ax.set(yticks=range(len(names)), yticklabels=names, xlabel="ms from the first event", ylim=(-0.6, 1.6))
    ax.set_xlim(0, xmax_ms if xmax_ms is not None else span_ms(lanes_))
    save_figure(fig, path, title + "\n", rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--figures-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", help="the run's results CSV (e.g. ddp_traces.csv): device and commit for the figures")
    args = parser.parse_args(argv)
    provenance = read_rows(args.rows) if args.rows else None
    traced = []
    for path in map(Path, args.traces):
        events = json.loads(path.read_text())["traceEvents"]
        found = lanes(events)
        # only the no-data-parallelism baseline may lack communication (else the patterns missed it)
        if not found["communication"] and not path.stem.startswith("none_"):
            raise SystemExit(f"{path}: no communication events found")
        traced.append((path, events, found))
    xmax = max(span_ms(found) for _, _, found in traced)  # one time axis for every figure of the run
    # the traces' run is the rows': each trace's row carries its device, versions and commit
    carried = {} if provenance is None else {c: provenance[c].iloc[0] for c in PROVENANCE_COLUMNS if c in provenance}
    rows = []
    for path, events, found in traced:
        draw(found, Path(args.figures_dir) / f"{path.stem}.png",
             f"{path.stem}: compute and communication by phase", xmax, provenance)
        rows.append({**trace_row(path.stem, events, found), **carried})
    write_rows(rows, args.out)


if __name__ == "__main__":
    main()
