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
from pathlib import Path

import pandas as pd

from cs336_systems.analysis.snapshot_file import load_snapshot
from cs336_systems.analysis.snapshot import phase_spans, timed_timeline, trace
from cs336_systems.results import read_rows, write_rows
from cs336_systems.report.figures import pyplot, save_figure

PHASE_COLORS = {"forward": "tab:green", "backward": "tab:orange", "optimizer": "tab:purple"}


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
    fig, ax = pyplot().subplots(figsize=(8, 3.5))
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
        snapshot = load_snapshot(path)  # plain data only: a snapshot from elsewhere runs no code
        draw_timeline(snapshot, Path(args.figures_dir) / f"{path.stem}.png", f"Active memory: {path.stem}",
                      provenance)
        rows += [{"snapshot": path.stem, "rank": i + 1, **row}
                 for i, row in enumerate(largest_allocations(snapshot, args.top))]
    write_rows(rows, args.out)


if __name__ == "__main__":
    main()
