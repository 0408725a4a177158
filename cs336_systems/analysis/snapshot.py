"""Reading allocator snapshots (torch.cuda.memory._snapshot pickles, with the "phases" entry that
cs336_systems.bench.e2e adds): the allocator's events, the memory held by live tensors over the recorded window
(against the event index or host time), the phases' spans and the levels at their start, maximum and end.
Shared by bench/memory.py, which records the phase levels, and report/memory.py, which draws the timelines.
"""

from __future__ import annotations

PHASES = ("forward", "backward", "optimizer")


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
