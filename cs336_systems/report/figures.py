"""Figures drawn from results rows (PNG, no display needed).

Conventions every figure keeps (so a reader can trust what a picture shows):
- the corner names where the rows were measured (device and short commit, from the rows' provenance
  columns; several values are all listed), drawn by `save_figure`;
- the statistic is the one the section's table and prose use (mean ± std, or median) and the axis label
  says which;
- bars only on linear axes (a bar's length means nothing on a log axis): points joined by lines otherwise;
- legends beside the panels, never over them; panels the prose compares share their value axis.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from cs336_systems.analysis.collectives import all_reduce_rows
from cs336_systems.report.tables import SIZE_ORDER
from cs336_systems.analysis import attention_math

if TYPE_CHECKING:
    import matplotlib.pyplot as plt

# Dense TF32 tensor-core peak (TFLOP/s) from NVIDIA's H100 / H200 datasheets (SXM: 989 with sparsity,
# half that dense). Triton's tl.dot multiplies float32 inputs in TF32 unless told otherwise, so it is the
# ceiling of our fp32 kernel; torch's float32 matmuls (default precision "highest") use the plain FP32
# rate instead (timing.PEAK_FLOPS, 67 TFLOP/s on both parts).
TF32_DENSE_TFLOPS = {"H100": 494.5, "H200": 494.5}
# Where |loss difference| is exactly zero the log axis has no place for it: such points are drawn here.
LOSS_DIFF_FLOOR = 1e-7


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed), imported when a figure is drawn: the report's table
    jobs import this module through the sections but never draw, and pyplot was half of their start-up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def short_commit(commit: str) -> str:
    """'004f3b2ff7…' -> '004f3b2' (a '+dirty' suffix is kept: the code differed from the commit)."""
    commit = str(commit)
    return commit[:7] + ("+dirty" if commit.endswith("+dirty") else "")


def provenance_stamp(rows: pd.DataFrame) -> str:
    """'NVIDIA H200 · commit 004f3b2' from the rows' device_name and git_commit columns; several distinct
    values are all listed (sorted), a missing column reads '?'."""
    def distinct(column: str, short=str) -> str:
        if column not in rows:
            return "?"
        seen = sorted({short(v) for v in rows[column].dropna()})
        return ", ".join(seen) if seen else "?"
    return f"{distinct('device_name')} · commit {distinct('git_commit', short_commit)}"


def save_figure(fig: plt.Figure, path: str | Path, title: str, rows: pd.DataFrame | None = None) -> None:
    """Title, lay out, stamp the rows' provenance under the bottom-right corner, write the PNG (making
    its folder) and free the figure."""
    plt = pyplot()
    fig.suptitle(title)
    fig.tight_layout()
    if rows is not None:  # below the figure's edge, so it never covers an axis label; bbox "tight" keeps it
        fig.text(0.995, 0.0, provenance_stamp(rows), ha="right", va="top", fontsize=7, color="dimgray")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130, bbox_inches="tight")  # keeps legends placed outside the axes
    plt.close(fig)


def _sizes(frame: pd.DataFrame) -> list[str]:
    return [s for s in SIZE_ORDER if s in set(frame["size"])]


def _unique(rows: pd.DataFrame, keys: list[str], what: str) -> None:
    """A figure draws one point per key; two rows for one point would be silently overdrawn."""
    dup = rows[rows.duplicated(keys, keep=False)]
    if len(dup):
        raise ValueError(f"{what}: several rows for {dup[keys].drop_duplicates().to_dict('records')}")


def dodged_points(ax: plt.Axes, rows: pd.DataFrame, x: str, x_order: list, series: str, series_order: list,
                  y: str, low: str | None = None, high: str | None = None, labels: dict | None = None,
                  markers: dict | None = None) -> None:
    """One line of markers per series over categorical x, each series shifted a little so the whiskers
    (from column `low` to column `high`) do not overlap; absent points leave gaps."""
    width = 0.6 / max(len(series_order), 1)
    for i, name in enumerate(series_order):
        part = rows[rows[series] == name].set_index(x).reindex(x_order)
        xs = np.arange(len(x_order)) + (i - (len(series_order) - 1) / 2) * width
        err = None
        if low is not None:
            err = np.vstack([(part[y] - part[low]).clip(lower=0), (part[high] - part[y]).clip(lower=0)])
        ax.errorbar(xs, part[y], yerr=err, marker=(markers or {}).get(name, "o"), capsize=2, markersize=4,
                    linewidth=1, label=(labels or {}).get(name, str(name)))
    ax.set_xticks(range(len(x_order)), [str(v) for v in x_order])


def _legend_beside(fig: plt.Figure, ax: plt.Axes, title: str | None = None) -> None:
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, title=title, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)


def _with_std(rows: pd.DataFrame) -> pd.DataFrame:
    return rows.assign(low=rows["mean_ms"] - rows["std_ms"], high=rows["mean_ms"] + rows["std_ms"])


def e2e_timing(frame: pd.DataFrame, path: str | Path) -> None:
    """Forward and backward mean ± std ms per size (the table's statistic), one panel per precision and
    attention backend, all on one log axis so the panels compare directly."""
    plt = pyplot()
    rows = _with_std(frame[(frame["status"] == "ok") & frame["phase"].isin(["forward", "backward"])
                           & (frame["mode"] == "forward_backward")])
    precisions, attentions = sorted(set(rows["precision"]), reverse=True), sorted(set(rows["attention"]))
    fig, axes = plt.subplots(len(attentions), len(precisions), figsize=(4.2 * len(precisions), 3 * len(attentions)),
                             sharey=True, squeeze=False)
    for (r, attention), (c, precision) in ((a, p) for a in enumerate(attentions) for p in enumerate(precisions)):
        part = rows[(rows["attention"] == attention) & (rows["precision"] == precision)]
        _unique(part, ["size", "phase"], "e2e_timing")
        ax = axes[r][c]
        dodged_points(ax, part, "size", _sizes(rows), "phase", ["forward", "backward"], "mean_ms", "low", "high")
        ax.set(yscale="log", title=f"{precision}, {attention} attention", xlabel="model size",
               ylabel="ms per step (mean ± std)" if c == 0 else "")
    _legend_beside(fig, axes[0][0])
    save_figure(fig, path, "Transformer LM: forward and backward time", frame)


def e2e_warmup(frame: pd.DataFrame, path: str | Path) -> None:
    """Step time mean ± std per size, one series per number of warm-up steps."""
    plt = pyplot()
    rows = _with_std(frame[(frame["status"] == "ok") & (frame["phase"] == "step")])
    _unique(rows, ["size", "warmup"], "e2e_warmup")
    fig, ax = plt.subplots(figsize=(6.5, 4))
    warmups = sorted(set(rows["warmup"]))
    dodged_points(ax, rows, "size", _sizes(rows), "warmup", warmups, "mean_ms", "low", "high",
                  labels={w: f"{w} warm-up steps" for w in warmups})
    ax.set(yscale="log", xlabel="model size",
           ylabel="forward+backward ms per step\n(mean ± std; a whisker below the axis is clipped)")
    _legend_beside(fig, ax)
    save_figure(fig, path, "Effect of warm-up steps (forward+backward, fp32)", frame)


def compile_timing(frame: pd.DataFrame, path: str | Path) -> None:
    """Median step time per size: eager and each compile scope as its own series, one panel per mode
    (shared log axis). Medians, the statistic of the table's speed-ups and of the prose (a recompile inside
    the timed window would pull a mean, not the median)."""
    plt = pyplot()
    rows = frame[(frame["status"] == "ok") & (frame["phase"] == "step")]
    scope = rows["compile_scope"] if "compile_scope" in rows else rows["compile"].map({True: "model", False: "none"})
    rows = rows.assign(scope=scope.fillna("none"))
    order = [s for s in ("none", "blocks", "model", "model-cudagraphs") if s in set(rows["scope"])]
    labels = {"none": "eager", "blocks": "compiled: each block", "model": "compiled: whole model",
              "model-cudagraphs": "compiled: whole model + CUDA graphs"}
    modes = [m for m in ("forward", "forward_backward", "train_step") if m in set(rows["mode"])]
    fig, axes = plt.subplots(1, len(modes), figsize=(4.5 * len(modes), 3.6), sharey=True, squeeze=False)
    for ax, mode in zip(axes[0], modes):
        part = rows[rows["mode"] == mode]
        _unique(part, ["size", "scope", "attention", "precision"], "compile_timing")
        dodged_points(ax, part, "size", _sizes(rows), "scope", order, "median_ms", labels=labels)
        ax.set(yscale="log", title=mode.replace("_", " "), xlabel="model size",
               ylabel="ms per step (median)" if ax is axes[0][0] else "")
    _legend_beside(fig, axes[0][0])
    attention = ", ".join(sorted(set(rows["attention"])))
    precision = ", ".join(sorted(set(rows["precision"])))
    save_figure(fig, path, f"Eager versus torch.compile ({attention} attention, {precision})", frame)


def attention_memory(frame: pd.DataFrame, path: str | Path) -> None:
    """Memory in use before backward versus sequence length (1.2.1), with the formula's prediction."""
    plt = pyplot()
    rows = frame[(frame["impl"] == "eager") & (frame["phase"] == "forward")].copy()
    fig, ax = plt.subplots(figsize=(6, 4))
    ok = rows[rows["status"] == "ok"]
    for head_dim, part in ok.groupby("head_dim"):
        part = part.sort_values("seq_len")
        ax.plot(part["seq_len"], part["memory_before_backward_mib"], marker="o", label=f"d = {head_dim}")
    predicted = rows.groupby("seq_len")["saved_for_backward_bytes"].max() / 2**20
    ax.plot(predicted.index, predicted.values, "k--", label="Q, K, V, P by formula (largest d)")
    for _, row in rows[rows["status"] == "oom"].iterrows():
        ax.annotate("OOM", (row["seq_len"], predicted[row["seq_len"]]), color="red")
    ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="MiB in use before backward")
    _legend_beside(fig, ax)
    save_figure(fig, path, "Naive attention: memory before backward", frame)


def peak_lines(device_names, dtype: str) -> list[tuple[float, str]]:
    """(TFLOP/s, label) of the datasheet ceilings for a dtype on the rows' device(s): bf16 dense tensor
    cores; for fp32 the TF32 tensor-core rate (what tl.dot uses) and the plain FP32 rate."""
    from cs336_systems.timing import peak_flops  # here, not above: timing imports torch, which a figure job need not

    lines = []
    for name in sorted(set(device_names)):
        short = next((k for k in TF32_DENSE_TFLOPS if k in name), None)
        if short is None:
            continue  # no datasheet entry (e.g. a CPU): no line rather than a wrong one
        if dtype == "fp32":
            lines += [(TF32_DENSE_TFLOPS[short], f"{short} TF32 dense peak"),
                      (peak_flops(name, "fp32") / 1e12, f"{short} FP32 (no tensor cores) peak")]
        else:
            lines.append((peak_flops(name, dtype) / 1e12, f"{short} {dtype} dense peak"))
    return sorted(set(lines))


def _flash_panels(frame: pd.DataFrame, path: str | Path, value: str, ylabel: str, title: str) -> None:
    """One panel per (dtype, head dim), one line per provider; medians (the sweep records medians only)."""
    plt = pyplot()
    rows = frame[(frame["status"] == "ok") & (frame["pass"] == "forward_backward")]
    dtypes, dims = sorted(set(frame["dtype"])), sorted(set(frame["head_dim"]))
    providers = sorted(set(rows["provider"]))
    fig, axes = plt.subplots(len(dtypes), len(dims), figsize=(2.7 * len(dims), 2.6 * len(dtypes)),
                             sharex=True, sharey="row", squeeze=False)
    for (r, dtype), (c, dim) in ((d, h) for d in enumerate(dtypes) for h in enumerate(dims)):
        ax, part = axes[r][c], rows[(rows["dtype"] == dtype) & (rows["head_dim"] == dim)]
        for provider in providers:
            line = part[part["provider"] == provider].sort_values("seq_len")
            ax.plot(line["seq_len"], line[value], marker="o", markersize=3, label=provider)
        if value == "tflops":
            for peak, label in peak_lines(frame["device_name"], dtype):
                style = ":" if "TF32" in label else "-." if "FP32" in label else "--"
                ax.axhline(peak, color="black", linestyle=style, linewidth=0.8, label=f"{label} ({peak:g})")
        if part.empty:
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", va="center", color="grey")
        ax.set(xscale="log", yscale="log" if value == "median_ms" else "linear", title=f"{dtype}, d = {dim}")
        ax.title.set_fontsize(9)
        if c == 0:
            ax.set_ylabel(ylabel)
        if r == len(dtypes) - 1:
            ax.set_xlabel("sequence length")
    handles = {}
    for ax in axes.flat:  # every label once, from whichever panel has it (the fp32 peaks are in fp32 rows)
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    save_figure(fig, path, title, frame)


def flash_latency(frame: pd.DataFrame, path: str | Path) -> None:
    _flash_panels(frame, path, "median_ms", "ms, median\n(forward+backward)", "Causal attention, forward+backward "
                  "latency")


def full_matrix_providers(frame: pd.DataFrame) -> pd.Series:
    """Rows whose provider computes the full masked matrix in some pass (naive attention; our PyTorch FA2's
    backward): FlashAttention-2's count halves causal work, which would under-state what these execute."""
    return frame["provider"].map(lambda p: p in attention_math.GEMMS and not all(attention_math.GEMMS[p][2:]))


def flash_tflops(frame: pd.DataFrame, path: str | Path) -> None:
    """TFLOP/s by FlashAttention-2's count, except the providers that compute the full masked matrix, drawn at
    the count they execute (attention_math.GEMMS)."""
    full = full_matrix_providers(frame)
    frame = frame.assign(tflops=frame["tflops"].where(~full, attention_math.executed_tflops(frame)),
                         provider=frame["provider"].where(~full, frame["provider"] + " (executed count)"))
    _flash_panels(frame, path, "tflops", "TFLOP/s (median time)", "Causal attention, achieved TFLOP/s "
                  "(forward+backward; FA2's count, full-matrix providers their executed count), with the datasheet "
                  "peaks")


def allreduce(frame: pd.DataFrame, path: str | Path) -> None:
    """Latency and bus bandwidth per size, both from the median time (the table's and the prose's one
    statistic); log axes so the CPU gloo rows (GB/s) show beside NCCL's (hundreds of GB/s). size_mb is MiB:
    the bench allocates size_mb · 2**20 bytes of float32."""
    plt = pyplot()
    rows = all_reduce_rows(frame[frame["status"] == "ok"] if "status" in frame else frame)
    rows = rows.assign(setting=rows["backend"] + " × " + rows["world_size"].astype(str))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for setting, part in rows.groupby("setting"):
        part = part.sort_values("size_mb")
        axes[0].plot(part["size_mb"], part["median_ms"], marker="o", label=setting)
        axes[1].plot(part["size_mb"], part["busbw_gbps"], marker="o", label=setting)
    axes[0].set(xscale="log", yscale="log", xlabel="tensor size (MiB, float32)",
                ylabel="ms per all-reduce (median)")
    axes[1].set(xscale="log", yscale="log", xlabel="tensor size (MiB, float32)",
                ylabel="bus bandwidth (GB/s, from the median)")
    _legend_beside(fig, axes[0], "backend × processes")
    save_figure(fig, path, "All-reduce on one node", frame)


# The runs a DDP figure may draw, in the order of the handout: the file a row came from names its run.
DDP_RUNS = ("ddp_naive", "ddp_individual", "ddp_bucketed")


def ddp_bucketed(frame: pd.DataFrame, path: str | Path) -> None:
    """Mean step time ± its standard deviation (the DDP tables' one statistic: tables.ddp), for every bucket
    size beside the baselines (single GPU, naive, flat, individual, torch DDP) of the runs present. Each run is its own
    series (marker), since the runs come from different processes and commits: torch DDP is measured in
    each, which shows how far runs differ."""
    plt = pyplot()
    rows = frame[frame["status"] == "ok"]
    if "results_file" not in rows:
        rows = rows.assign(results_file="ddp_bucketed")
    rows = rows.assign(low=rows["step_ms"] - rows["step_std_ms"], high=rows["step_ms"] + rows["step_std_ms"])
    runs = [r for r in DDP_RUNS if r in set(rows["results_file"])] + sorted(set(rows["results_file"]) - set(DDP_RUNS))
    configs = list(dict.fromkeys(c for run in runs for c in rows.loc[rows["results_file"] == run, "config"]))
    commits = {run: sorted({short_commit(c) for c in rows.loc[rows["results_file"] == run, "git_commit"]})
               for run in runs}
    labels = {run: f"{run} run ({', '.join(commits[run])})" for run in runs}
    markers = dict(zip(runs, ["s", "^", "o", "D", "v"]))
    precisions = [p for p in ("fp32", "bf16") if p in set(rows["precision"])]
    fig, axes = plt.subplots(len(precisions), 1, figsize=(max(7.0, 0.65 * len(configs)), 3.2 * len(precisions)),
                             squeeze=False)
    for ax, precision in zip(axes[:, 0], precisions):
        part = rows[rows["precision"] == precision]
        _unique(part, ["config", "results_file"], "ddp_bucketed")
        dodged_points(ax, part, "config", configs, "results_file", runs, "step_ms", "low", "high", labels,
                      markers)
        for line in ax.get_lines():
            line.set_linestyle("none")  # configs are categories: no line between them
        ax.set(title=precision, ylabel="ms per step\n(mean ± std)")
        plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    axes[-1, 0].set_xlabel(ddp_wrapper_axis_label(rows))
    _legend_beside(fig, axes[0, 0], "run (commit)")
    save_figure(fig, path, "Data-parallel step time: bucket sizes and baselines", frame)


def ddp_wrapper_axis_label(rows: pd.DataFrame) -> str:
    """The DDP figure's x label: what the baseline `none` ran, from its rows (every rank trains alone on its own
    batch, with no gradient communication)."""
    none = rows[rows["config"] == "none"]
    if none.empty:
        return "wrapper"
    ranks = sorted({int(w) for w in none["world_size"].dropna()}) if "world_size" in none else []
    who = (f"{' or '.join(map(str, ranks))} ranks" if ranks else "every rank") + " training alone"
    return f"wrapper (none = {who}, no gradient communication)"


def train_matrix(frame: pd.DataFrame, path: str | Path) -> None:
    """|loss − torch DDP's loss| per step, one panel per attention backend, one line per wrapper, on a
    log axis; exact agreement (difference 0) is drawn at LOSS_DIFF_FLOOR, which the axis label says."""
    plt = pyplot()
    fig_rows = []
    for attention, part in frame.groupby("attention"):
        reference = part[part["wrapper"] == "torch_ddp"].set_index("step")["loss"]
        if reference.empty:
            raise ValueError(f"train_matrix: no torch_ddp run for attention {attention!r} to compare with")
        for wrapper, run in part[part["wrapper"] != "torch_ddp"].groupby("wrapper"):
            diff = (run.set_index("step")["loss"] - reference).abs().dropna()
            fig_rows.append(pd.DataFrame({"attention": attention, "wrapper": wrapper, "step": diff.index,
                                          "diff": diff.to_numpy()}))
    diffs = pd.concat(fig_rows, ignore_index=True)
    attentions, wrappers = sorted(set(diffs["attention"])), sorted(set(diffs["wrapper"]))
    fig, axes = plt.subplots(1, len(attentions), figsize=(3.8 * len(attentions), 3.4), sharey=True, squeeze=False)
    for ax, attention in zip(axes[0], attentions):
        equal = []
        for wrapper in wrappers:
            line = diffs[(diffs["attention"] == attention) & (diffs["wrapper"] == wrapper)].sort_values("step")
            label = "single GPU" if wrapper == "none" else wrapper
            if len(line) and (line["diff"] == 0).all():
                equal.append(label)
            ax.plot(line["step"], line["diff"].clip(lower=LOSS_DIFF_FLOOR), marker=".", markersize=3, label=label)
        if equal:  # lines lying on the floor would read as "small"; say they are exact
            ax.text(0.03, 0.16, "at the floor: bitwise equal at every step:\n" + ", ".join(equal),
                    transform=ax.transAxes, fontsize=7, va="bottom",
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8})
        ax.set(yscale="log", title=f"{attention} attention", xlabel="step", ylim=(LOSS_DIFF_FLOOR / 3, None))
    axes[0][0].set_ylabel(f"|loss − torch DDP loss|\n(0 drawn at {LOSS_DIFF_FLOOR:g})")
    handles = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    save_figure(fig, path, "Training loss against torch DDP's (same seed and global batch)", frame)
