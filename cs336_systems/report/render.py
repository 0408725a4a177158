"""Rendering helpers shared by tables, figures and the writeup."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pandas as pd

from cs336_systems.report.frame import NumericTable


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


def save_table(table: NumericTable, md_path: str | Path, tex_path: str | Path, caption: str,
               json_path: str | Path | None = None) -> None:
    """Markdown (for the writeup) and LaTeX (for a paper) renderings of one table, and the numeric frame
    they print (JSON, which the writeup reads back for its quotes: report/frame.py)."""
    if not isinstance(table, NumericTable):
        raise TypeError(f"save_table: a table builder must return a NumericTable (report/frame.py), got "
                        f"{type(table).__name__}")
    paths = [Path(p) for p in (md_path, tex_path, json_path) if p is not None]
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
    Path(md_path).write_text(table.to_markdown() + f"\n\n_{caption}_\n")
    Path(tex_path).write_text(table.to_latex(caption))
    if json_path is not None:
        table.save(json_path)


def slugify(text: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, letters, digits, marks, '_', '-' and spaces kept (each
    space a '-'), everything else (punctuation, '§', dashes other than '-') dropped. The HTML page and the PDF use
    the same anchors, so one link works in all three."""
    text = re.sub(r"`|\*\*|(?<!\w)_|_(?!\w)", "", text)  # Markdown marks are not part of the rendered text
    kept = [ch for ch in text.lower() if ch in "_- " or unicodedata.category(ch)[0] in "LNM"]
    return "".join(kept).replace(" ", "-")


def headings(markdown: str) -> list[tuple[int, str, str]]:
    """Every ATX heading of a Markdown document outside code fences, in order: (level, text, anchor), where a
    repeated anchor gets '-1', '-2', ... as on GitHub."""
    found, seen, fenced = [], {}, False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        match = None if fenced else re.match(r"(#{1,6}) +(.*?) *#*$", line)
        if match:
            slug = slugify(match[2])
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.append((len(match[1]), match[2], f"{slug}-{count}" if count else slug))
    return found
