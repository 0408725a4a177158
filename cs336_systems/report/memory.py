"""Reading allocator snapshots (torch.cuda.memory._dump_snapshot pickles) without a browser: the
active-memory timeline as a PNG, and the largest allocations with the code that made them.

    python -m cs336_systems.report.memory SNAPSHOT.pickle... --figures-dir figures/memory --out allocations.csv
"""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import matplotlib.pyplot as plt

from cs336_systems.results import write_rows
from cs336_systems.report.figures import save_figure  # also selects the Agg backend


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


def draw_timeline(snapshot: dict, path: str | Path, title: str) -> None:
    xs, ys = active_timeline(snapshot)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.fill_between(xs, ys, step="post", alpha=0.6)
    ax.set(xlabel="allocator event", ylabel="active memory (MiB)")
    save_figure(fig, path, title)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("snapshots", nargs="+")
    parser.add_argument("--figures-dir", required=True)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--out", required=True, help="CSV of the largest allocations per snapshot")
    args = parser.parse_args(argv)
    rows = []
    for path in map(Path, args.snapshots):
        with open(path, "rb") as f:
            snapshot = pickle.load(f)
        draw_timeline(snapshot, Path(args.figures_dir) / f"{path.stem}.png", f"Active memory: {path.stem}")
        rows += [{"snapshot": path.stem, "rank": i + 1, **row}
                 for i, row in enumerate(largest_allocations(snapshot, args.top))]
    write_rows(rows, args.out)


if __name__ == "__main__":
    main()
