"""1.1.4's tables: kernel names made readable, the kernels of one profiled configuration, and kernel
time per phase over the whole grid (profile rows in, NumericTables out: report/frame.py)."""

from __future__ import annotations

import re

import pandas as pd

from cs336_systems.bench.profile_names import MATMUL, is_annotation
from cs336_systems.report.frame import Col, NumericTable
from cs336_systems.report.tables import SIZE_ORDER, ordered_by_size


# Wrapper functors of ATen's elementwise and multi-tensor kernels; the operation is a template argument inside.
_GENERIC_FUNCTORS = {"BinaryFunctor", "BUnaryFunctor", "AUnaryFunctor", "UnaryFunctor", "BinaryOpScalarFunctor",
                     "PointwiseOpScalarFunctor", "TernaryOpScalarFunctor", "UnaryOpFunctor",
                     "BinaryOpListAlphaFunctor", "BinaryOpScalarTensorFunctor"}
_STD_OPS = {"multiplies", "divides", "plus", "minus", "Sqrt"}


def kernel_label(name: str) -> str:
    """A readable kernel name: ATen's templated kernels as `kernel<operation>` (e.g.
    `vectorized_elementwise_kernel<MulFunctor>`), others without `void` and their argument list."""
    if "at::native::" in name:
        words = re.findall(r"[A-Za-z_]\w*", name.removeprefix("void "))
        base = next(w for w in words if w not in {"at", "native", "anonymous", "namespace"})
        ops = [w for w in words if w != base and w not in _GENERIC_FUNCTORS
               and (w.endswith(("Functor", "_kernel", "_kernel_cuda")) or "Functor_" in w or w in _STD_OPS)]
        return f"{base}<{ops[0]}>" if ops else base
    if name.startswith("void "):  # a C++ signature: drop the argument list
        return re.sub(r"\((?:[^()]|\([^()]*\))*\)$", "", name.removeprefix("void "))
    return name


def profile_kernels_of(rows: pd.DataFrame) -> pd.DataFrame:
    """The kernel rows of profile results, labelled with `kernel_label` (instantiations that share a
    label are summed) and without the ranges the profiler also reports on the GPU timeline."""
    kernels = rows[(rows["kind"] == "kernel") & ~rows["name"].map(is_annotation)].assign(
        name=lambda f: f["name"].map(kernel_label))
    keys = [c for c in kernels.columns if c not in ("name", "calls_per_step", "ms_per_step")]
    grouped = kernels.groupby([*keys, "name"], as_index=False, dropna=False, observed=True)
    return grouped[["calls_per_step", "ms_per_step"]].sum()


def profile_point(frame: pd.DataFrame) -> tuple[str, int]:
    """The configuration the profiling discussion is about: xl at 512 tokens if it ran, else the
    largest size at the longest context (up to 512) that ran."""
    ok = frame[frame["status"] == "ok"]
    if ((ok["size"] == "xl") & (ok["context_length"] == 512)).any():
        return "xl", 512
    ok = ok[ok["context_length"] <= 512]
    size = [s for s in SIZE_ORDER if s in set(ok["size"])][-1]
    return size, int(ok[ok["size"] == size]["context_length"].max())


def profile_kernels(frame: pd.DataFrame) -> NumericTable:
    """1.1.4: the top kernels of forward, backward and the optimizer step at the discussed configuration."""
    size, ctx = profile_point(frame)
    rows = profile_kernels_of(frame[(frame["size"] == size) & (frame["context_length"] == ctx)])
    out = []
    for phase in ("forward", "backward", "optimizer", "inference"):
        part = rows[rows["phase"] == phase].sort_values("ms_per_step", ascending=False)
        total = part["ms_per_step"].sum()
        for _, row in part.head(8).iterrows():
            out.append({"size": size, "context": ctx, "phase": phase, "kernel": row["name"][:70],
                        "calls per step": row["calls_per_step"], "ms per step": row["ms_per_step"],
                        "share of phase": row["ms_per_step"] / total})
    # calls per step are counts ('g' prints 144, not 144.0, and a fractional mean as it is)
    return NumericTable(pd.DataFrame(out), (Col("size"), Col("context", "d"), Col("phase"), Col("kernel"),
                                            Col("calls per step", "g"), Col("ms per step", ".3f"),
                                            Col("share of phase", ".1%")))


PROFILE_GRID_MS = ("forward kernels (ms)", "backward kernels (ms)", "optimizer kernels (ms)", "forward harness (ms)")


def profile_grid(frame: pd.DataFrame) -> NumericTable:
    """1.1.4: kernel time per phase for every size and context length (or OOM: '—' in the time columns)."""
    out = []
    for (size, ctx), rows in ordered_by_size(frame).groupby(["size", "context_length"], observed=True):
        if (rows["status"] != "ok").any():
            out.append({"size": size, "context": ctx, "status": "OOM"})
            continue
        kernels = profile_kernels_of(rows).groupby("phase")["ms_per_step"].sum()
        harness = rows[rows["kind"] == "harness"].set_index("phase")["ms_per_step"]
        out.append({"size": size, "context": ctx, "status": "ok",
                    **{f"{p} kernels (ms)": kernels.get(p, float("nan")) for p in ("forward", "backward", "optimizer")},
                    "forward harness (ms)": harness.get("forward", float("nan"))})
    data = pd.DataFrame(out, columns=["size", "context", "status", *PROFILE_GRID_MS])
    return NumericTable(data.assign(size=lambda t: t["size"].astype(str)),
                        (Col("size"), Col("context", "d"), Col("status"), *(Col(c, ".2f") for c in PROFILE_GRID_MS)))


SOFTMAX = r"softmax"


def kernel_class(name: str) -> str:
    """GEMM, softmax or other (scaling, masking, copies), from a kernel's (or ATen op's) name."""
    if re.search(MATMUL, name, re.IGNORECASE):
        return "GEMM"
    return "softmax" if re.search(SOFTMAX, name, re.IGNORECASE) else "other"


def attention_kernels(rows: pd.DataFrame, phase: str = "forward") -> pd.DataFrame | None:
    """ms per step of each attention stage's kernels by class (stage × GEMM/softmax/other), from the
    `stage_kernel` rows of one profiled point; None for runs from before those rows were recorded."""
    staged = rows[(rows["kind"] == "stage_kernel") & (rows["phase"] == phase)] if "stage" in rows else rows.iloc[:0]
    if staged.empty:
        return None
    staged = staged.assign(kind_of=staged["name"].map(kernel_class))
    return staged.pivot_table(index="stage", columns="kind_of", values="ms_per_step", aggfunc="sum",
                              fill_value=0.0)


def kernel_vs_wall(frame: pd.DataFrame) -> NumericTable:
    """1.1.5(c): per size, each phase's kernel time (profiled) against the harness's synchronized wall time
    of the same phase in the same process (unprofiled), and the share of the step's wall time the GPU
    spends in kernels: far below 1, the host launching kernels sets the pace, not the GPU."""
    out = []
    for (size, ctx, precision), rows in ordered_by_size(frame).groupby(["size", "context_length", "precision"],
                                                                       observed=True):
        record = {"size": size, "context": ctx, "precision": precision, "status": "ok"}
        if (rows["status"] != "ok").any():
            out.append({**record, "status": "OOM"})
            continue
        kernels = profile_kernels_of(rows).groupby("phase")["ms_per_step"].sum()
        wall = rows[rows["kind"] == "harness"].set_index("phase")["ms_per_step"]
        phases = ("forward", "backward", "optimizer")
        for phase in phases:
            record[f"{phase} kernels (ms)"] = kernels.get(phase, float("nan"))
            record[f"{phase} wall (ms)"] = wall.get(phase, float("nan"))
        busy = sum(kernels.get(p, 0.0) for p in phases) / sum(wall.get(p, float("nan")) for p in phases)
        out.append({**record, "kernel share of step": busy})
    times = [f"{phase} {what} (ms)" for phase in ("forward", "backward", "optimizer") for what in ("kernels", "wall")]
    data = pd.DataFrame(out, columns=["size", "context", "precision", "status", *times, "kernel share of step"])
    return NumericTable(data.assign(size=lambda t: t["size"].astype(str)), (
        Col("size"), Col("context", "d"), Col("precision"), Col("status"), *(Col(c, ".2f") for c in times),
        Col("kernel share of step", ".2f")))
