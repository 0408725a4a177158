"""The writeup's appendix: long tables, run lists and derivations that a section keeps but the body need not show.

A section marks such a block with `appendix(title, markdown)` (its Markdown stays in the section, so tests that
check a section's prose against its table still see the table); `writeup.build` moves every marked block, in
document order, under '## Appendix' at the end as a sub-section 'A.n title' that links back to its section, and
leaves in its place a line that links to it. `rows_of` gives the body a short table taken from the same frame.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from cs336_systems.report.frame import NumericTable
from cs336_systems.report.render import slugify

HEADING = "Appendix"
_MARKED = re.compile(r"<!-- appendix: (?P<title>[^\n]*?) -->\n(?P<body>.*?)\n<!-- /appendix -->", re.S)


def appendix(title: str, markdown: str) -> str:
    """`markdown` marked for the appendix under `title` (one line of words, e.g. 'flash_benchmarking: every point')."""
    if not title.strip() or "\n" in title or "-->" in title:
        raise ValueError(f"appendix: a title is one non-empty line without '-->', got {title!r}")
    return f"<!-- appendix: {title.strip()} -->\n{markdown.strip()}\n<!-- /appendix -->"


@dataclass(frozen=True)
class Entry:
    """One appendix sub-section: its number ('A.3'), title, Markdown and the index of the section it came from."""
    number: str
    title: str
    markdown: str
    section: int

    @property
    def heading(self) -> str:
        return f"{self.number} {self.title}"

    @property
    def anchor(self) -> str:
        return slugify(self.heading)


def collect(bodies: list[str]) -> tuple[list[str], list[Entry]]:
    """Each section body with its marked blocks replaced by a link line, and the blocks as numbered entries."""
    entries: list[Entry] = []

    def move(match: re.Match, section: int) -> str:
        entry = Entry(f"A.{len(entries) + 1}", match["title"], match["body"], section)
        entries.append(entry)
        return f"_In the appendix: [{entry.heading}](#{entry.anchor})._"

    kept = [_MARKED.sub(lambda m, i=i: move(m, i), body) for i, body in enumerate(bodies)]
    return kept, entries


def render(entries: list[Entry], back: Callable[[int], tuple[str, str]]) -> str:
    """'## Appendix' and its sub-sections; `back(section)` gives the (heading text, anchor) each one links back to."""
    lines = [f"## {HEADING}\n"]
    for entry in entries:
        text, anchor = back(entry.section)
        lines += [f"### {entry.heading}\n", f"From [{text}](#{anchor}).\n", entry.markdown + "\n"]
    return "\n".join(lines)


def rows_of(table: NumericTable, rows: Callable[[pd.DataFrame], pd.Series]) -> NumericTable:
    """The rows `rows(table.data)` selects, as a table printed the way the full one is (a body's summary)."""
    mask = rows(table.data).to_numpy()
    kept = [i for i in range(len(table)) if mask[i]]
    if not kept:
        raise ValueError("rows_of: the selection keeps no row of the table")
    position = {old: new for new, old in enumerate(kept)}
    status = {header: {position[r]: s for r, s in cells.items() if r in position}
              for header, cells in table.status.items()}
    return NumericTable(table.data.iloc[kept], table.columns, {h: c for h, c in status.items() if c})


def outline(table: NumericTable, keys: list[str]) -> str:
    """'N rows over KEY (values as printed), ...': what a moved table holds, from its own cells."""
    said = []
    for key in keys:
        texts = list(dict.fromkeys(table.cell_text(i, key) for i in range(len(table))))
        if len(texts) <= 6:
            shown = ", ".join(texts)
        else:
            values = table.data[key]
            ends = (values.idxmin(), values.idxmax()) if table.col(key).numeric else (0, len(table) - 1)
            shown = f"{len(texts)} values, {table.cell_text(ends[0], key)} to {table.cell_text(ends[1], key)}"
        said.append(f"{key} {shown}")
    return f"{len(table)} rows over " + "; ".join(said)


def moved(ctx, name: str, title: str, keys: tuple[str, ...] = ()) -> list[str]:
    """Table `name` of the section (ctx: a report Context) moved to the appendix: a sentence of what it holds, read
    from its own frame, and the marked table."""
    table = ctx.numeric(name)
    keys = keys or tuple(table.headers[:1])
    return [f"_The table ({outline(table, list(keys))}) is in the appendix._",
            appendix(title, ctx.table(name))]
