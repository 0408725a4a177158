"""Reading allocator snapshots (torch.cuda.memory._snapshot pickles) without a browser: the
active-memory timeline as a PNG, with the forward / backward / optimizer phases marked on a time axis
as PyTorch's memory viewer shows them, and the largest allocations with the code that made them.

Phase boundaries come from the snapshot's "phases" entry (host wall-clock µs that
cs336_systems.bench.e2e records around each phase of the recorded step, the clock the allocator's
`time_us` stamps are converted to), else from PyTorch's own record_function annotations
("external_annotations", START/END stages) where the snapshot has them; a snapshot with neither is
drawn without phases, and one whose events carry no time stamps is drawn over the event index.

    python -m cs336_systems.report.memory SNAPSHOT.pickle... --figures-dir figures/memory --out allocations.csv \
        [--rows results/memory.csv]
"""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from cs336_systems.results import read_rows, write_rows
from cs336_systems.report.figures import save_figure  # also selects the Agg backend

PHASES = ("forward", "backward", "optimizer")
PHASE_COLORS = {"forward": "tab:green", "backward": "tab:orange", "optimizer": "tab:purple"}


def trace(snapshot: dict) -> list[dict]:
    """The allocator events of the device that has any (one GPU per run here)."""
    return next((t for t in snapshot.get("device_traces", []) if t), [])


def allocated_at_dump(snapshot: dict) -> int:
    """Bytes held by live tensors when the snapshot was dumped: its segments' allocated blocks."""
    return sum(block["size"] for segment in snapshot.get("segments", []) for block in segment.get("blocks", [])
               if block.get("state") in ("active_allocated", "active_pending_free"))


def active_timeline(snapshot: dict) -> tuple[list[int], list[float]]:
    """(event index, MiB allocated by live tensors) after each allocation or completed free.

    The trace covers only the recorded window, but tensors made before it (weights, optimizer state)
    are live throughout and some are freed inside it (last step's gradients): the level at the start
    is what was allocated at the dump minus the window's net change, as PyTorch's memory viewer does."""
    events = [(i, e) for i, e in enumerate(trace(snapshot)) if e["action"] in ("alloc", "free_completed")]
    net = sum(e["size"] if e["action"] == "alloc" else -e["size"] for _, e in events)
    active, xs, ys = allocated_at_dump(snapshot) - net, [], []
    for i, event in events:
        active += event["size"] if event["action"] == "alloc" else -event["size"]
        xs.append(i)
        ys.append(active / 2**20)
    return xs, ys


def phase_spans(snapshot: dict) -> list[tuple[str, float, float]]:
    """(phase, start µs, end µs) of each recorded phase, in time order: ours ("phases") if present, else
    PyTorch's record_function annotations of the same names (a START without its END is dropped)."""
    if snapshot.get("phases"):
        return sorted(((p["phase"], float(p["start_us"]), float(p["end_us"])) for p in snapshot["phases"]),
                      key=lambda span: span[1])
    spans, open_ = [], {}
    for note in sorted(snapshot.get("external_annotations", []), key=lambda a: a["time_us"]):
        if note.get("name") not in PHASES:
            continue
        if note["stage"] == "START":
            open_[note["name"]] = float(note["time_us"])
        elif note["stage"] == "END" and note["name"] in open_:
            spans.append((note["name"], open_.pop(note["name"]), float(note["time_us"])))
    return spans


def timed_timeline(snapshot: dict) -> tuple[list[float], list[float], float | None]:
    """Like active_timeline, over ms since the first recorded event (and that event's µs stamp, to place
    the phases); over the event index, with None, when the events carry no time stamps."""
    xs, ys = active_timeline(snapshot)
    events = trace(snapshot)
    if not xs or any("time_us" not in events[i] for i in xs):
        return [float(x) for x in xs], ys, None
    start = float(min(e["time_us"] for e in events if "time_us" in e))  # the recorded window's start
    return [(events[i]["time_us"] - start) / 1e3 for i in xs], ys, start


def phase_levels(snapshot: dict) -> dict[str, float]:
    """Memory allocated by tensors (MiB) at the start, the maximum and the end of each recorded phase:
    `{phase}_start_mib`, `{phase}_peak_mib`, `{phase}_end_mib`. An event belongs to a phase when its host
    time stamp lies in the phase's span (allocations and frees are made by the host as it enqueues the
    kernels, so this is exact even where the GPU runs behind); the level at a time is that after the last
    event at or before it. Empty when the snapshot has no phase marks or no time stamps."""
    xs, ys, start_us = timed_timeline(snapshot)
    spans = phase_spans(snapshot)
    if start_us is None or not spans:
        return {}
    events = trace(snapshot)
    first = [e for e in events if e["action"] in ("alloc", "free_completed")]
    # the level before the window's first event: the first point of the timeline less that event's change
    initial = ys[0] - (first[0]["size"] if first[0]["action"] == "alloc" else -first[0]["size"]) / 2**20
    times = [start_us + x * 1e3 for x in xs]

    def level(t_us: float) -> float:
        before = [y for t, y in zip(times, ys) if t <= t_us]
        return before[-1] if before else initial

    levels = {}
    for phase, begin, end in spans:
        inside = [y for t, y in zip(times, ys) if begin <= t <= end]
        levels[f"{phase}_start_mib"] = level(begin)
        levels[f"{phase}_peak_mib"] = max([level(begin), *inside])
        levels[f"{phase}_end_mib"] = level(end)
    return levels


def origin(frames: list[dict], package: str = "cs336_systems") -> str:
    """The innermost frame in our own code (else the innermost frame) as file:line (function)."""
    ours = [f for f in frames if package in f.get("filename", "")]
    frame = (ours or frames or [{"filename": "?", "line": 0, "name": "?"}])[0]
    return f"{Path(frame['filename']).name}:{frame['line']} ({frame['name']})"


def largest_allocations(snapshot: dict, n: int = 10) -> list[dict]:
    allocs = [e for e in trace(snapshot) if e["action"] == "alloc"]
    by_size: dict[tuple[int, str], int] = {}
    for event in allocs:
        key = (event["size"], origin(event.get("frames", [])))
        by_size[key] = by_size.get(key, 0) + 1
    top = sorted(by_size.items(), key=lambda item: -item[0][0])[:n]
    return [{"size_mib": size / 2**20, "count": count, "origin": where} for (size, where), count in top]


def draw_timeline(snapshot: dict, path: str | Path, title: str, rows: pd.DataFrame | None = None) -> None:
    """Active memory over the recorded window, each phase a shaded band named at the top."""
    xs, ys, start_us = timed_timeline(snapshot)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.fill_between(xs, ys, step="post", alpha=0.6, color="tab:blue", linewidth=0)
    spans = phase_spans(snapshot) if start_us is not None else []
    # Marks from another clock than the events' would land far outside the window: drop, and say so.
    window = (xs[0] - 1e3, xs[-1] + 1e3) if xs else (0.0, 0.0)
    placed = [s for s in spans if window[0] <= (s[1] - start_us) / 1e3 and (s[2] - start_us) / 1e3 <= window[1]]
    for phase, begin, end in placed:
        left, right = (begin - start_us) / 1e3, (end - start_us) / 1e3
        ax.axvspan(left, right, color=PHASE_COLORS.get(phase, "grey"), alpha=0.15, linewidth=0)
        ax.text((left + right) / 2, 1.01, phase, transform=ax.get_xaxis_transform(), ha="center", va="bottom",
                fontsize=8, color=PHASE_COLORS.get(phase, "grey"))
    if start_us is None:
        xlabel = "allocator event (no time stamps in this snapshot: phases cannot be placed)"
    elif not spans:
        xlabel = "ms since the first recorded allocator event (phase boundaries not recorded in this snapshot)"
    elif not placed:
        xlabel = "ms since the first recorded allocator event (phase marks lie outside the recorded window)"
    else:
        xlabel = "ms since the first recorded allocator event (host time of each allocation and free)"
    ax.set(xlabel=xlabel, ylabel="memory allocated by tensors (MiB)")
    ax.set_ylim(bottom=0)
    save_figure(fig, path, title + ("\n" if placed else ""), rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("snapshots", nargs="+")
    parser.add_argument("--figures-dir", required=True)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--out", required=True, help="CSV of the largest allocations per snapshot")
    parser.add_argument("--rows", help="the run's results CSV (memory.csv): device and commit for the figures")
    args = parser.parse_args(argv)
    provenance = read_rows(args.rows) if args.rows else None
    rows = []
    for path in map(Path, args.snapshots):
        with open(path, "rb") as f:
            snapshot = pickle.load(f)
        draw_timeline(snapshot, Path(args.figures_dir) / f"{path.stem}.png", f"Active memory: {path.stem}",
                      provenance)
        rows += [{"snapshot": path.stem, "rank": i + 1, **row}
                 for i, row in enumerate(largest_allocations(snapshot, args.top))]
    write_rows(rows, args.out)


if __name__ == "__main__":
    main()
