"""Kernel summaries from Nsight Systems (handout 1.1.4), where it can write reports.

`bench.profile --tool nsys` runs each profiling point in a child process under `nsys profile`, keeps
the `.nsys-rep`, exports it to SQLite (`nsys export`) and summarizes it here into the same rows the
PyTorch-profiler path makes. Attribution, from the report's own tables:
- a kernel belongs to a phase (forward, backward, optimizer, inference) when it *runs* inside one of
  that phase's measured windows, NVTX ranges named `measured:<phase>` around one call of the phase. The
  child synchronizes the GPU at both ends of each window, so every kernel of the call runs inside it,
  backward's too, which the autograd thread launches outside the main thread's ranges;
- a kernel belongs to an attention stage (scores, softmax, final matmul) when it was *launched* inside
  that range (its CUDA API call, found by correlation id): stages are not synchronized, so a kernel
  may still run after its range has closed.

On our GPU machines `nsys profile` writes a raw .qdstrm and no report, so `nsys_works` is false there
and the PyTorch profiler is used. The summarizing code is tested on a small database laid out like
nsys's export (tables CUPTI_ACTIVITY_KIND_KERNEL, CUPTI_ACTIVITY_KIND_RUNTIME, NVTX_EVENTS, StringIds);
it has not yet read a real report.
"""

from __future__ import annotations

import functools
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

PHASES = ("forward", "backward", "optimizer", "inference")
TOOL = "Nsight Systems: CUDA kernels"


def window(phase: str) -> str:
    """The NVTX range around each measured, profiled call of `phase`."""
    return f"measured:{phase}"


@functools.cache
def nsys_works() -> bool:
    """Whether `nsys` is installed and writes a report for a trivial program (probed once per process)."""
    if shutil.which("nsys") is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        stem = Path(tmp) / "probe"
        subprocess.run(["nsys", "profile", "--force-overwrite=true", "-o", str(stem), sys.executable, "-c", "pass"],
                       capture_output=True, timeout=300)
        return stem.with_suffix(".nsys-rep").exists()


def profile_under_nsys(stem: Path, argv: list[str]) -> Path:
    """Run `python -m cs336_systems.bench.profile ARGV` under `nsys profile`; the report's path."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["nsys", "profile", "--trace=cuda,nvtx", "--sample=none", "--cpuctxsw=none",
                    "--force-overwrite=true", "-o", str(stem), sys.executable, "-m", "cs336_systems.bench.profile",
                    *argv], check=True)
    report = stem.with_suffix(".nsys-rep")
    if not report.exists():
        raise RuntimeError(f"nsys profile wrote no report at {report}")
    return report


def export_sqlite(report: Path) -> Path:
    database = report.with_suffix(".sqlite")
    subprocess.run(["nsys", "export", "--type", "sqlite", "--force-overwrite", "true", "-o", str(database),
                    str(report)], check=True, capture_output=True)
    return database


def read_report(database: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(kernels: name, start, end, launch; ranges: name, start, end) from an exported report."""
    with sqlite3.connect(database) as db:
        kernels = pd.read_sql_query(
            "SELECT s.value AS name, k.start, k.end, r.start AS launch FROM CUPTI_ACTIVITY_KIND_KERNEL AS k "
            "JOIN StringIds AS s ON s.id = k.demangledName "
            "LEFT JOIN CUPTI_ACTIVITY_KIND_RUNTIME AS r ON r.correlationId = k.correlationId", db)
        ranges = pd.read_sql_query(
            "SELECT COALESCE(e.text, s.value) AS name, e.start, e.end FROM NVTX_EVENTS AS e "
            "LEFT JOIN StringIds AS s ON s.id = e.textId WHERE e.end IS NOT NULL", db)
    return kernels, ranges


def _inside(times: np.ndarray, ranges: pd.DataFrame) -> np.ndarray:
    """For each time, whether it falls in one of `ranges` (which do not overlap one another)."""
    ranges = ranges.sort_values("start")
    starts, ends = ranges["start"].to_numpy(), ranges["end"].to_numpy()
    index = np.searchsorted(starts, times, side="right") - 1
    return (index >= 0) & (times <= ends[np.clip(index, 0, None)]) if len(starts) else np.zeros(len(times), bool)


def summarize_report(kernels: pd.DataFrame, ranges: pd.DataFrame, steps: int,
                     stages: tuple[str, ...]) -> list[dict]:
    """Kernel rows per phase and attention-stage totals per phase, per measured step (ms), as
    `bench.profile` makes them with the PyTorch profiler."""
    start, end = kernels["start"].to_numpy(), kernels["end"].to_numpy()
    launch = kernels["launch"].fillna(kernels["start"]).to_numpy()  # no API record: use the start
    ms = (end - start) / 1e6
    rows = []
    for phase in PHASES:
        windows = ranges[ranges["name"] == window(phase)]
        own = _inside(start, windows) & _inside(end, windows)
        if not own.any():
            continue
        summary = pd.DataFrame({"name": kernels["name"][own], "ms": ms[own]}).groupby("name")["ms"].agg(["count", "sum"])
        rows += [{"kind": "kernel", "phase": phase, "name": name, "calls_per_step": count / steps,
                  "ms_per_step": total / steps, "tool": TOOL} for name, (count, total) in summary.iterrows()]
        for stage in stages:
            stage_ranges = ranges[ranges["name"] == stage]
            stage_ranges = stage_ranges[_inside(stage_ranges["start"].to_numpy(), windows)]
            staged = own & _inside(launch, stage_ranges)
            if len(stage_ranges):
                rows.append({"kind": "attention_stage", "phase": phase, "name": stage,
                             "calls_per_step": len(stage_ranges) / steps, "ms_per_step": ms[staged].sum() / steps,
                             "tool": TOOL})
    return rows
