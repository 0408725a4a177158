"""Figures drawn from results rows (PNG, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from cs336_systems.report.tables import SIZE_ORDER  # noqa: E402


def _sizes(frame: pd.DataFrame) -> list[str]:
    return [s for s in SIZE_ORDER if s in set(frame["size"])]


def _save(fig: plt.Figure, path: str | Path, title: str) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def e2e_timing(frame: pd.DataFrame, path: str | Path) -> None:
    """Forward and backward ms per size, one panel per precision, bars per attention backend."""
    rows = frame[(frame["status"] == "ok") & frame["phase"].isin(["forward", "backward"])
                 & (frame["mode"] == "forward_backward")]
    grid = sns.catplot(data=rows, kind="bar", x="size", y="mean_ms", hue="phase", col="precision", row="attention",
                       order=_sizes(rows), errorbar=None, height=3, aspect=1.4, sharey=False)
    grid.set(yscale="log", ylabel="ms per step")
    _save(grid.figure, path, "Transformer LM: forward and backward time")


def e2e_warmup(frame: pd.DataFrame, path: str | Path) -> None:
    rows = frame[(frame["status"] == "ok") & (frame["phase"] == "step")]
    fig, ax = plt.subplots(figsize=(6, 4))
    sns.barplot(data=rows, x="size", y="mean_ms", hue="warmup", order=_sizes(rows), ax=ax, errorbar=None)
    for container, (_, group) in zip(ax.containers, rows.groupby("warmup")):
        group = group.set_index("size").reindex(_sizes(rows))
        ax.errorbar([bar.get_x() + bar.get_width() / 2 for bar in container], group["mean_ms"],
                    yerr=group["std_ms"], fmt="none", color="black", capsize=2)
    ax.set(yscale="log", ylabel="mean ms per step (± std)")
    _save(fig, path, "Effect of warm-up steps (forward+backward)")


def compile_timing(frame: pd.DataFrame, path: str | Path) -> None:
    rows = frame[(frame["status"] == "ok") & (frame["phase"] == "step")].copy()
    rows["execution"] = rows["compile"].map({True: "compiled", False: "eager"})
    grid = sns.catplot(data=rows, kind="bar", x="size", y="median_ms", hue="execution", col="mode", row="attention",
                       order=_sizes(rows), errorbar=None, height=3, aspect=1.4, sharey=False)
    grid.set(yscale="log", ylabel="median ms per step")
    _save(grid.figure, path, "Eager versus torch.compile")


FIGURES = {"e2e_timing": e2e_timing, "e2e_warmup": e2e_warmup, "compile_timing": compile_timing}
