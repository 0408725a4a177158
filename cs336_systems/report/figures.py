"""Figures drawn from results rows (PNG, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from cs336_systems.report.collectives import all_reduce_rows  # noqa: E402
from cs336_systems.report.tables import SIZE_ORDER  # noqa: E402


def _sizes(frame: pd.DataFrame) -> list[str]:
    return [s for s in SIZE_ORDER if s in set(frame["size"])]


def save_figure(fig: plt.Figure, path: str | Path, title: str) -> None:
    """Title, lay out, write the PNG (making its folder) and free the figure."""
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130, bbox_inches="tight")  # keeps legends placed outside the axes
    plt.close(fig)


def e2e_timing(frame: pd.DataFrame, path: str | Path) -> None:
    """Forward and backward ms per size, one panel per precision, bars per attention backend."""
    rows = frame[(frame["status"] == "ok") & frame["phase"].isin(["forward", "backward"])
                 & (frame["mode"] == "forward_backward")]
    grid = sns.catplot(data=rows, kind="bar", x="size", y="mean_ms", hue="phase", col="precision", row="attention",
                       order=_sizes(rows), errorbar=None, height=3, aspect=1.4, sharey=False)
    grid.set(yscale="log", ylabel="ms per step")
    save_figure(grid.figure, path, "Transformer LM: forward and backward time")


def e2e_warmup(frame: pd.DataFrame, path: str | Path) -> None:
    rows = frame[(frame["status"] == "ok") & (frame["phase"] == "step")]
    fig, ax = plt.subplots(figsize=(6, 4))
    sns.barplot(data=rows, x="size", y="mean_ms", hue="warmup", order=_sizes(rows), ax=ax, errorbar=None)
    for container, (_, group) in zip(ax.containers, rows.groupby("warmup")):
        group = group.set_index("size").reindex(_sizes(rows))
        ax.errorbar([bar.get_x() + bar.get_width() / 2 for bar in container], group["mean_ms"],
                    yerr=group["std_ms"], fmt="none", color="black", capsize=2)
    ax.set(yscale="log", ylabel="mean ms per step (± std)")
    save_figure(fig, path, "Effect of warm-up steps (forward+backward)")


def compile_timing(frame: pd.DataFrame, path: str | Path) -> None:
    rows = frame[(frame["status"] == "ok") & (frame["phase"] == "step")].copy()
    rows["execution"] = rows["compile"].map({True: "compiled", False: "eager"})
    grid = sns.catplot(data=rows, kind="bar", x="size", y="median_ms", hue="execution", col="mode", row="attention",
                       order=_sizes(rows), errorbar=None, height=3, aspect=1.4, sharey=False)
    grid.set(yscale="log", ylabel="median ms per step")
    save_figure(grid.figure, path, "Eager versus torch.compile")



def attention_memory(frame: pd.DataFrame, path: str | Path) -> None:
    """Memory in use before backward versus sequence length (1.2.1), with the formula's prediction."""
    rows = frame[(frame["impl"] == "eager") & (frame["phase"] == "forward")].copy()
    fig, ax = plt.subplots(figsize=(6, 4))
    ok = rows[rows["status"] == "ok"]
    sns.lineplot(data=ok, x="seq_len", y="memory_before_backward_mib", hue="head_dim", marker="o", ax=ax,
                 palette="viridis")
    predicted = rows.groupby("seq_len")["saved_for_backward_bytes"].max() / 2**20
    ax.plot(predicted.index, predicted.values, "k--", label="Q, K, V, P by formula (largest d)")
    for _, row in rows[rows["status"] == "oom"].iterrows():
        ax.annotate("OOM", (row["seq_len"], predicted[row["seq_len"]]), color="red")
    ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="MiB in use before backward")
    ax.legend(title="d", fontsize=8)
    save_figure(fig, path, "Naive attention: memory before backward")


def _flash_panels(frame: pd.DataFrame, path: str | Path, value: str, ylabel: str, title: str) -> None:
    rows = frame[(frame["status"] == "ok") & (frame["pass"] == "forward_backward")]
    grid = sns.relplot(data=rows, x="seq_len", y=value, hue="provider", row="dtype", col="head_dim", kind="line",
                       marker="o", height=2.6, aspect=1.1, facet_kws={"sharey": False})
    grid.set(xscale="log", yscale="log" if value == "median_ms" else "linear", ylabel=ylabel,
             xlabel="sequence length")
    for (dtype, head_dim), ax in grid.axes_dict.items():
        if rows[(rows["dtype"] == dtype) & (rows["head_dim"] == head_dim)].empty:
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", va="center", color="grey")
    sns.move_legend(grid, "upper left", bbox_to_anchor=(1.0, 0.9))  # beside the panels, not over the last one
    save_figure(grid.figure, path, title)


def flash_latency(frame: pd.DataFrame, path: str | Path) -> None:
    _flash_panels(frame, path, "median_ms", "ms (forward+backward)", "Causal attention, forward+backward latency")


def flash_tflops(frame: pd.DataFrame, path: str | Path) -> None:
    _flash_panels(frame, path, "tflops", "TFLOP/s (forward+backward)", "Causal attention, achieved TFLOP/s")



def allreduce(frame: pd.DataFrame, path: str | Path) -> None:
    rows = all_reduce_rows(frame).copy()
    rows["setting"] = rows["backend"] + " × " + rows["world_size"].astype(str)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    sns.lineplot(data=rows, x="size_mb", y="median_ms", hue="setting", marker="o", ax=axes[0])
    sns.lineplot(data=rows, x="size_mb", y="busbw_gbps", hue="setting", marker="o", ax=axes[1], legend=False)
    axes[0].set(xscale="log", yscale="log", xlabel="MB per rank", ylabel="median ms")
    axes[1].set(xscale="log", xlabel="MB per rank", ylabel="bus bandwidth (GB/s)")
    save_figure(fig, path, "All-reduce on one node")


def ddp_bucketed(frame: pd.DataFrame, path: str | Path) -> None:
    rows = frame[frame["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(6, 4))
    sns.barplot(data=rows, x="config", y="step_ms", hue="precision", ax=ax, errorbar=None)
    ax.set(ylabel="ms per training step", xlabel="")
    ax.tick_params(axis="x", rotation=30)
    sns.move_legend(ax, "upper left", bbox_to_anchor=(1.0, 1.0))
    save_figure(fig, path, "Bucketed DDP: step time by bucket size")


def train_matrix(frame: pd.DataFrame, path: str | Path) -> None:
    """Loss per step, one panel per attention backend, one line per wrapper: the curves should coincide."""
    rows = frame.assign(wrapper=frame["wrapper"].replace({"none": "single GPU"}))
    grid = sns.relplot(data=rows, x="step", y="loss", hue="wrapper", style="wrapper", col="attention", kind="line",
                       height=3.2, aspect=1.1, facet_kws={"sharey": True})
    sns.move_legend(grid, "upper left", bbox_to_anchor=(1.0, 0.9))  # beside the panels, not over the last one
    save_figure(grid.figure, path, "Training loss by data-parallel wrapper (same seed and global batch)")

