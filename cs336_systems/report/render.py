"""Rendering helpers shared by tables, figures and the writeup."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

def mean_std(mean: float, std: float, digits: int = 2) -> str:
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "—"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def provenance_line(frame: pd.DataFrame) -> str:
    """One line naming where the rows of a table were measured (several values are all listed)."""

    def values(column: str) -> str:
        if column not in frame:
            return "?"
        seen = sorted({str(v) for v in frame[column].dropna()})
        return ", ".join(seen) if seen else "?"

    dates = sorted({str(t)[:10] for t in frame.get("timestamp", pd.Series(dtype=str)).dropna()})
    commits = sorted({str(c)[:12] for c in frame.get("git_commit", pd.Series(dtype=str)).dropna()})
    return (f"Measured on {values('device_name')}; torch {values('torch_version')}, "
            f"triton {values('triton_version')}; commit {', '.join(commits) or '?'}; {', '.join(dates) or '?'}.")


def save_table(table: pd.DataFrame, md_path: str | Path, tex_path: str | Path, caption: str) -> None:
    """Markdown (for the writeup) and LaTeX (for a paper) renderings of one table."""
    md_path, tex_path = Path(md_path), Path(tex_path)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    tex_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(table.to_markdown(index=False) + f"\n\n_{caption}_\n")
    latex = table.to_latex(index=False, caption=caption.replace("_", r"\_"), escape=True)
    tex_path.write_text(latex)
