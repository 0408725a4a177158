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
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from cs336_systems.results import read_rows, write_rows
from cs336_systems.report.figures import save_figure  # also selects the Agg backend

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


def draw(lanes_: dict[str, list[Interval]], path: str | Path, title: str, xmax_ms: float | None = None,
         rows: pd.DataFrame | None = None) -> None:
    """Compute and communication lanes over ms from the first event, the phases shaded behind them and
    named on top; `xmax_ms` fixes the axis so several traces compare."""
    origin = min(start for spans in lanes_.values() for start, _ in spans)
    fig, ax = plt.subplots(figsize=(10, 2.4))
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
        if not found["communication"]:
            raise SystemExit(f"{path}: no communication events found")
        traced.append((path, events, found))
    xmax = max(span_ms(found) for _, _, found in traced)  # one time axis for every figure of the run
    rows = []
    for path, events, found in traced:
        draw(found, Path(args.figures_dir) / f"{path.stem}.png",
             f"{path.stem}: compute and communication by phase", xmax, provenance)
        rows.append({"trace": path.stem, "communication_ms": sum(e - s for s, e in _union(found["communication"])) / 1e3,
                     "overlap_with_backward": overlap_fraction(found["communication"], found["backward"]),
                     "exposed_communication_ms": exposed_ms(found["communication"], found["compute"]),
                     "exposed_in_forward_ms": exposed_ms(found["communication"], found["compute"], found["forward"]),
                     "exposed_in_backward_ms": exposed_ms(found["communication"], found["compute"], found["backward"]),
                     **host_side(events, found["backward"])})
    write_rows(rows, args.out)


if __name__ == "__main__":
    main()
